#!/usr/bin/env bash
# Vision-language speed (issue #49): the Qwen2.5-VL-7B shape (configs/qwen2.5-vl-7b, random
# init in bf16, built by make_model.py), rows of 1024 tokens each with two 448x448 images,
# against the same model on text-only rows of 1024 tokens, in one call. Model TFLOPS count
# the frozen vision tower's forward over the step's images (VisionSpec::forward_flops) on top
# of the language model's 6 x params x tokens + attention; MegaTrain's formula counts the
# trained parameters only. Writes a table with the command to
# $RESULTS/vlm_qwen2.5-vl-7b<-NL>_b<B>_<machine>_<date>.md.
#
# Environment [defaults]: BIN [target/release]  DATA [target/bench-vlm: make_data.py's output,
#   made here first: .venv/bin/python benches/vlm/make_data.py --out target/bench-vlm]
#   BATCH [64]  STEPS [4] (the first is left out of the means)  LAYERS [28]  MODEL (a model dir
#   made earlier by make_model.py, else one is made under WORK)  WORK [a temporary directory]
#   RESULTS [benches/results]  PYTHON [python3]  GPUS [1] (0: CPU workers, to try the script)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release}; DATA=${DATA:-target/bench-vlm}; BATCH=${BATCH:-64}; STEPS=${STEPS:-4}
LAYERS=${LAYERS:-28}; GPUS=${GPUS:-1}; RESULTS=${RESULTS:-benches/results}; PYTHON=${PYTHON:-python3}
MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-' || echo cpu)
if [ -z "${WORK:-}" ]; then WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT; fi
DATA=$(cd "$DATA" && pwd)
[ -f "$DATA/mllm.json" ] || { echo "run.sh: no $DATA/mllm.json: run benches/vlm/make_data.py first" >&2; exit 2; }
if [ -z "${MODEL:-}" ]; then
  MODEL=$WORK/model
  t0=$(date +%s)
  "$PYTHON" benches/vlm/make_model.py --config configs/qwen2.5-vl-7b/config.json --tokenizer "$DATA/tokenizer" \
    --out "$MODEL" --layers "$LAYERS"
  echo "run.sh: model made in $(( $(date +%s) - t0 )) s" >&2
fi
cat > "$WORK/run.yaml" <<YAML
model: {path: $MODEL, init: pretrained, dtype: bfloat16}
dataset: {name: bench_mllm, dataset_dir: $DATA, max_seq_len: 1024, packing: false, shuffle: false}
training: {save_model: false, batch_size: $BATCH, num_steps: $STEPS, learning_rate: 1.0e-5, max_grad_norm: 1.0}
memory: {num_grad_slabs: 4, ce_chunk_tokens: 8192, grad_dtype: bfloat16, master_weights: split}
logging: {log_every: 1}
YAML
for what in mllm text; do
  "$BIN/mt-launch" --config "$WORK/run.yaml" --gpus "$GPUS" --set "dataset.name=bench_$what" \
    --metrics-out "$WORK/$what.jsonl" > "$WORK/$what.log" 2>&1 || { tail -20 "$WORK/$what.log" >&2; exit 1; }
done
mkdir -p "$RESULTS"
out="$RESULTS/vlm_qwen2.5-vl-7b$([ "$LAYERS" = 28 ] || echo "-${LAYERS}L")_b${BATCH}_${MACHINE}_$(date +%Y-%m-%d).md"
"$PYTHON" - "$WORK" "$out" "$BATCH" "$LAYERS" "$MACHINE" "$(git rev-parse --short HEAD 2>/dev/null || echo ?)" <<'PY'
import json, re, sys
work, out, batch, layers, machine, commit = sys.argv[1:]
def rows(what):
    r = [json.loads(l) for l in open(f"{work}/{what}.jsonl")]
    return [x for x in r if "step_time_s" in x][1:]  # the first step warms up
def mean(rs, k):
    return sum(r[k] for r in rs) / len(rs)
log = open(f"{work}/mllm.log").read()
tower = re.search(r"vision tower: .*", log)
lines = [f"# Qwen2.5-VL-7B shape ({layers} layers), batch {batch} x 1024 tokens, two 448x448 images per row vs text only, {machine}",
         "", f"Binaries of {commit}; benches/vlm/run.sh (BATCH={batch} LAYERS={layers}); random init, bf16, fp32 master and moments in host RAM, every block streamed.",
         f"{tower.group(0) if tower else ''}", "",
         "| rows | step s | model TFLOPS | MegaTrain-formula TFLOPS | tokens/s (labels) | forward s | backward s | peak GPU GB | launcher peak GB |",
         "|---|---|---|---|---|---|---|---|---|"]
res = {}
for what, name in (("mllm", "2 images + text"), ("text", "text only")):
    rs = rows(what)
    res[what] = rs
    lines.append(f"| {name} | {mean(rs, 'step_time_s'):.2f} | {mean(rs, 'tflops_model'):.1f} | {mean(rs, 'tflops_megatrain'):.1f} | "
                 f"{mean(rs, 'tokens_per_s'):.0f} | {mean(rs, 'forward_s'):.2f} | {mean(rs, 'backward_s'):.2f} | "
                 f"{max(r['peak_gpu_bytes'] for r in rs) / 1e9:.1f} | {max(r['launcher_peak_rss_bytes'] for r in rs) / 1e9:.1f} |")
ratio = mean(res["mllm"], "tflops_model") / mean(res["text"], "tflops_model")
lines += ["", "Images: " + ", ".join(f"{r.get('images_s', 0):.2f}" for r in res["mllm"]) + " s per step on the images before the forward (read, decoded, resized, uploaded; the tower launched).", "", f"Model TFLOPS with images / text only: {ratio:.3f} (steps {len(res['mllm'])} and {len(res['text'])} after the first)."]
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "run.sh: wrote $out" >&2
