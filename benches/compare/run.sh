#!/usr/bin/env bash
# This project beside its peers on one machine, one shape, one call: mt-launch, the published
# MegaTrain (its examples/sft/train.py) and DeepSpeed ZeRO-3 with CPU offload (zero3.py), each
# on the same random-init model directory and the same token rows, one after the other, each
# under a time limit with its host and GPU memory peaks sampled (monitor.py); then table.py
# writes one markdown table to stdout and $OUT/compare_<shape>.md. A system that fails (OOM,
# a package missing, the time limit) gets a row saying why; the others still run.
#
# Usage (GPU machine, from the repository root; vendor/ from fetch.sh carried along):
#   BIN=target/carry benches/compare/run.sh --layers 28 --batch 128
# Options [defaults]:
#   --layers N [28]  --batch B [128]  --seq T [1024]  --steps S [4; the first is discarded]
#   --systems LIST [ours,megatrain,zero3]  --timeout S per system [300]
#   --deadline S for the whole call [570; a system starts only with >= 60 s left, and its
#     limit is cut to what is left less 20 s, so the table is always written]
#   --tiny (a tiny shape, for a CPU machine: inputs and configs as for the real one; ours
#     runs on CPU where no GPU is found)   --dry-run (venv, inputs and configs only; prints
#     the commands)
# Environment: BIN [target/release] (mt-launch, mt-worker)  OUT [benches/compare/out]
#   WORK [benches/compare/work: venv, model and data, reused on a warm machine]
#   PYTHON [python3]  MACHINE [GPU name and core count]  OURS_EXTRA (more mt-launch flags)
#   BASE_CONFIG [configs/qwen2.5-7b/config.json]  OURS_CONFIG [configs/bench/qwen_7b.yaml]
#   COMPARE_DATASETS_SHIM=1 (use shim/datasets even where `datasets` is installed)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
root=$PWD
start=$(date +%s)

LAYERS=28 BATCH=128 SEQ=1024 STEPS=4 SYSTEMS=ours,megatrain,zero3 TIMEOUT=300 DEADLINE=570
TINY=0 DRY=0
while [ $# -gt 0 ]; do
  case $1 in
    --layers) LAYERS=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --seq) SEQ=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --systems) SYSTEMS=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ "$STEPS" -ge 2 ] || { echo "run.sh: --steps $STEPS: at least 2 (the first is discarded)" >&2; exit 2; }

BIN=${BIN:-target/release}
OUT=${OUT:-$here/out}
WORK=${WORK:-$here/work}
PYTHON=${PYTHON:-python3}
BASE_CONFIG=${BASE_CONFIG:-configs/qwen2.5-7b/config.json}
OURS_CONFIG=${OURS_CONFIG:-configs/bench/qwen_7b.yaml}
VENDOR=$here/vendor
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd) WORK=$(cd "$WORK" && pwd)

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
if [ -z "${MACHINE:-}" ]; then
  short=$(echo "${gpu_name:-cpu}" | sed 's/NVIDIA //; s/ .*//')
  MACHINE="${short}-$(nproc)c"
fi
model=$(basename "$(dirname "$BASE_CONFIG")")$([ $TINY = 1 ] && echo -tiny)
tag="${model}-${LAYERS}L_b${BATCH}_s${SEQ}_${MACHINE}"
logs=$OUT/logs/$tag
rm -rf "$logs"
mkdir -p "$logs"
echo "== compare $tag (logs: $logs)" >&2

# A system that does not run leaves a status file saying why; table.py prints it as its row.
skip() {  # skip SYSTEM REASON
  "$PYTHON" -c 'import json,sys; json.dump({"status": "not run", "reason": sys.argv[2]}, open(sys.argv[1], "w"))' \
    "$logs/$1.status.json" "$2"
  echo "-- $1: not run: $2" >&2
}
left() { echo $(( DEADLINE - ($(date +%s) - start) )); }

# --- The vendored packages the machine lacks, installed one by one (no resolver: a GPU machine's
# torch often sits in a user site, which a venv cannot see) into $WORK/site on PYTHONPATH.
site=$WORK/site
venv_ok=0 venv_why=""
if [ -d "$VENDOR/wheels" ]; then
  stamp=$(cd "$VENDOR" && ls -l wheels sdist 2>/dev/null | md5sum | cut -c1-16)
  if [ -f "$site/.stamp" ] && [ "$(cat "$site/.stamp")" = "$stamp" ]; then
    venv_ok=1
  else
    rm -rf "$site"
    mkdir -p "$site"
    {
      pip=("$PYTHON" -m pip install --no-index --no-deps --find-links "$VENDOR/wheels" --find-links "$VENDOR/sdist"
        --disable-pip-version-check --target "$site")
      # What DeepSpeed (0.19: requirements.txt) and MegaTrain (setup.py) need beyond torch,
      # transformers and numpy, as distribution:module; one the machine has is left as it is.
      missing=()
      for pm in setuptools:setuptools wheel:wheel packaging:packaging einops:einops hjson:hjson \
          msgpack:msgpack ninja:ninja psutil:psutil py-cpuinfo:cpuinfo typing-extensions:typing_extensions \
          annotated-types:annotated_types typing-inspection:typing_inspection pydantic-core:pydantic_core \
          pydantic:pydantic tqdm:tqdm pyyaml:yaml accelerate:accelerate; do
        "$PYTHON" -c "import ${pm#*:}" 2>/dev/null || missing+=("${pm%%:*}")
      done
      echo "installing: ${missing[*]:-nothing}"
      { [ ${#missing[@]} = 0 ] || "${pip[@]}" "${missing[@]}"; } &&
        PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation deepspeed
    } > "$logs/venv.log" 2>&1 && { echo "$stamp" > "$site/.stamp"; venv_ok=1; } ||
      venv_why="the packages did not install (logs/$tag/venv.log: $(tail -1 "$logs/venv.log"))"
  fi
else
  venv_why="no $VENDOR/wheels: run benches/compare/fetch.sh on a machine with network and carry benches/compare/vendor"
fi
vpy=$PYTHON
# On PYTHONPATH, and its bin/ on PATH: torch's JIT builds (DeepSpeed's ops) look for ninja there.
[ $venv_ok = 1 ] && export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PATH=$site/bin:$PATH
echo "-- packages: $([ $venv_ok = 1 ] && echo "$site" || echo "$venv_why")" >&2

# --- The shared inputs.
inputs_model=$WORK/models/$model-${LAYERS}L
inputs_data=$WORK/data/$model-${LAYERS}L_b${BATCH}_s${SEQ}
if ! "$vpy" "$here/make_inputs.py" --base-config "$BASE_CONFIG" --model-out "$inputs_model" \
    --data-out "$inputs_data" --layers "$LAYERS" --batch "$BATCH" --seq "$SEQ" \
    $([ $TINY = 1 ] && echo --tiny) > "$logs/inputs.log" 2>&1; then
  cat "$logs/inputs.log" >&2
  echo "run.sh: the model and data could not be written (above)" >&2
  exit 1
fi
cp "$inputs_data/shape.json" "$logs/shape.json"
echo "-- inputs: $inputs_model, $inputs_data ($(( $(date +%s) - start )) s in)" >&2

# --- DeepSpeed's CPUAdam: built (JIT, g++ and ninja) once, where it builds.
export TORCH_EXTENSIONS_DIR=$WORK/torch_extensions HF_HUB_OFFLINE=1 HF_HOME=$WORK/hf
cpu_adam=0 cpu_adam_why="not tried"
need_ds=0
case ",$SYSTEMS," in *,megatrain,*|*,zero3,*) need_ds=1 ;; esac
if [ $need_ds = 1 ] && [ $DRY = 0 ] && [ $venv_ok = 1 ]; then
  if timeout 400 "$vpy" -c '
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
p = torch.nn.Parameter(torch.zeros(64)); p.grad = torch.ones(64)
o = DeepSpeedCPUAdam([p], lr=0.1); o.step()
assert abs(p[0].item() + 0.1) < 1e-3, p[0].item()  # Adam'"'"'s first step: -lr x sign(grad)
print("DeepSpeedCPUAdam builds and steps")' > "$logs/cpu_adam.log" 2>&1; then
    cpu_adam=1 cpu_adam_why="DeepSpeedCPUAdam built"
  else
    cpu_adam_why="DeepSpeedCPUAdam did not build ($(grep -E 'Error|error:' "$logs/cpu_adam.log" | head -1 | cut -c1-160)): torch AdamW instead"
  fi
  echo "-- $cpu_adam_why ($(( $(date +%s) - start )) s in)" >&2
fi
"$PYTHON" -c 'import json,sys; json.dump({"cpu_adam": sys.argv[1] == "1", "note": sys.argv[2]}, open(sys.argv[3], "w"))' \
  "$cpu_adam" "$cpu_adam_why" "$logs/cpu_adam.json"

torch_lib=$("$PYTHON" -c 'import torch,os;print(os.path.dirname(torch.__file__))' 2>/dev/null)/lib
gpus=1
[ -z "$gpu_name" ] && gpus=0

# --- Each system: its command, then a run under monitor.py within the time left.
run_system() {  # run_system NAME CMD...
  local name=$1; shift
  local t=$TIMEOUT l
  l=$(left)
  if [ "$l" -lt 60 ]; then skip "$name" "the call's deadline (--deadline $DEADLINE s) left $l s"; return; fi
  [ $(( l - 20 )) -lt "$t" ] && t=$(( l - 20 ))
  printf '%q ' "$@" > "$logs/$name.cmd"
  if [ $DRY = 1 ]; then echo "-- $name (dry run): $(cat "$logs/$name.cmd")" >&2; skip "$name" "dry run"; return; fi
  echo "-- $name: up to $t s ($(( $(date +%s) - start )) s in)" >&2
  "$PYTHON" "$here/monitor.py" --out "$logs/$name.mon.json" --log "$logs/$name.log" --timeout "$t" -- "$@" ||
    echo "-- $name failed: $(grep -E 'Error|error|Killed' "$logs/$name.log" | tail -1 | cut -c1-200)" >&2
}

IFS=, read -r -a systems <<< "$SYSTEMS"
for s in "${systems[@]}"; do
  case $s in
  ours)
    if [ ! -x "$BIN/mt-launch" ] || [ ! -x "$BIN/mt-worker" ]; then
      skip ours "no $BIN/mt-launch and mt-worker (set BIN to the built binaries)"; continue
    fi
    args=(--config "$OURS_CONFIG" --gpus $gpus --set "model.path=$inputs_model" --set model.init=pretrained
      --set "dataset.path=$inputs_data/tokens.jsonl" --set dataset.shuffle=false
      --set "dataset.max_seq_len=$SEQ" --set "training.batch_size=$BATCH"
      --set "training.num_steps=$STEPS" --set logging.log_every=1)
    [ $gpus = 0 ] && args+=(--set model.dtype=float32)  # bf16 on CPU is ~30x slower
    # The README headline's memory mode: 14 B/param, the master fp32-exact (bf16 store + low
    # halves), fp32 moments, bf16 gradient accumulator (OURS_EXTRA may override any of them).
    args+=(--set memory.master_weights=split --set memory.grad_dtype=bfloat16 --set memory.moments_dtype=float32)
    # shellcheck disable=SC2086
    LD_LIBRARY_PATH=$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
      run_system ours "$BIN/mt-launch" "${args[@]}" --metrics-out "$logs/ours.jsonl" ${OURS_EXTRA:-}
    ;;
  megatrain)
    src=$VENDOR/megatrain
    if [ ! -f "$src/examples/sft/train.py" ]; then
      skip megatrain "no $src/examples/sft/train.py: run benches/compare/fetch.sh and carry benches/compare/vendor"; continue
    fi
    [ $venv_ok = 1 ] || { skip megatrain "$venv_why"; continue; }
    opt=adamw
    [ $cpu_adam = 1 ] && opt=deepspeed_adam
    # The published qwen_7b_1gpu.yaml with this call's model, rows and shape; causal SDPA in
    # place of flash_attention_2 (flash-attn is not installed here: shim/attention); every
    # token a label, as ours.
    cat > "$logs/megatrain.yaml" <<EOF
# Written by benches/compare/run.sh from MegaTrain's examples/sft/configs/qwen_7b_1gpu.yaml.
model:
  name: "$inputs_model"
  dtype: "bfloat16"
  device: 0
  attn_implementation: "sdpa"
  trust_remote_code: true
dataset:
  name: "synthetic"
  dataset_dir: "$inputs_data/megatrain"
  max_seq_len: $SEQ
  num_workers: 4
  train_on_prompt: true
training:
  batch_size: $BATCH
  gradient_accumulation_steps: 1
  num_steps: $STEPS
  learning_rate: 1.0e-5
  weight_decay: 0.01
  max_grad_norm: 1.0
  seed: 42
optimizer:
  type: "$opt"
  beta1: 0.9
  beta2: 0.999
  eps: 1.0e-8
memory:
  checkpoint_interval: 4
  num_grad_slabs: 12
logging:
  log_interval: 1
  enable_timing: true
EOF
    pypath=$src:$here/shim/attention
    if [ "${COMPARE_DATASETS_SHIM:-0}" = 1 ] || ! "$vpy" -c 'import datasets' 2>/dev/null; then
      pypath=$pypath:$here/shim
      echo "datasets: benches/compare/shim (the package is not installed here)" > "$logs/megatrain.datasets"
    fi
    PYTHONPATH=$pypath${PYTHONPATH:+:$PYTHONPATH} \
      run_system megatrain "$vpy" "$src/examples/sft/train.py" --config "$logs/megatrain.yaml"
    ;;
  zero3)
    [ $venv_ok = 1 ] || { skip zero3 "$venv_why"; continue; }
    opt=torch_adamw
    [ $cpu_adam = 1 ] && opt=cpu_adam
    run_system zero3 "$vpy" "$here/zero3.py" --model "$inputs_model" --data "$inputs_data/tokens.jsonl" \
      --batch "$BATCH" --seq "$SEQ" --steps "$STEPS" --optimizer $opt --metrics "$logs/zero3.jsonl"
    ;;
  *) echo "run.sh: unknown system $s (ours, megatrain, zero3)" >&2 ;;
  esac
done

"$PYTHON" "$here/table.py" --logs "$logs" --machine "$MACHINE" \
  --gpu "${gpu_name:-none}" --cores "$(nproc)" --out "$OUT/compare_$tag.md"
