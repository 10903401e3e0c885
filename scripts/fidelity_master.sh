#!/usr/bin/env bash
# Fidelity of the 12-bytes-per-parameter mode (`memory.master_weights: bfloat16`: the bf16
# store is the master, AdamW rounds it stochastically): the same training run twice, with
# an fp32 master and with a bf16 master, both with model.dtype and memory.grad_dtype
# bfloat16, and their losses compared. Prints the mean loss over each 50-step window of
# both runs, then the final loss (mean of the last 20 steps) of each and their relative
# difference: PASS if within 1%, else FAIL (exit 1).
#
#   CONFIG  a run config (default configs/tiny.yaml), or a model directory holding a
#           config.json (e.g. configs/qwen2.5-0.5b): that architecture is then trained on
#           configs/tiny.yaml's data and settings, from its weights if the directory has
#           them (else a random init), tokenized with the directory's tokenizer, or with
#           configs/tiny's byte-level BPE where it has none (ids < 512, valid in any larger
#           vocabulary)
#   STEPS   optimizer steps (default 300)
#   GPUS    GPUs to train on (default 0: CPU workers)
#   WORKERS CPU workers when GPUS=0 (default 2)
#   EXTRA   more mt-launch flags for both runs (e.g. "--set dataset.max_seq_len=64")
#   BIN     the built binaries (default target/release)
#   A, B    the two settings compared (default memory.master_weights=float32 and
#           memory.master_weights=bfloat16); e.g. B=memory.master_weights=split for the
#           14 B/param default against fp32: how far two runs that differ by rounding only
#           part at the end of the same schedule
#
# On CPU bf16 matmuls are slow (about 30x f32 on AMD cores): shrink max_seq_len and
# batch_size through EXTRA there.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/tiny.yaml}
STEPS=${STEPS:-300}
GPUS=${GPUS:-0}
WORKERS=${WORKERS:-2}
EXTRA=${EXTRA:-}
BIN=${BIN:-target/release}
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

args=()
if [[ -d $CONFIG ]]; then
    [[ -f $CONFIG/config.json ]] || { echo "fidelity_master: $CONFIG has no config.json" >&2; exit 2; }
    model=$work/model
    mkdir -p "$model"
    for f in "$CONFIG"/*; do ln -s "$(realpath "$f")" "$model/"; done
    if [[ ! -e $model/tokenizer.json ]]; then
        rm -f "$model/tokenizer_config.json"
        ln -s "$(realpath configs/tiny/tokenizer.json)" "$model/"
        ln -s "$(realpath configs/tiny/tokenizer_config.json)" "$model/"
        echo "fidelity_master: $CONFIG has no tokenizer: using configs/tiny's" >&2
    fi
    init=random
    compgen -G "$model/model*.safetensors*" >/dev/null && init=pretrained
    args+=(--config configs/tiny.yaml --set "model.path=$model" --set "model.init=$init")
else
    args+=(--config "$CONFIG")
fi
args+=(--gpus "$GPUS")
[[ $GPUS == 0 ]] && args+=(--workers "$WORKERS")
args+=(--set "training.num_steps=$STEPS" --set logging.log_every=1
    --set model.dtype=bfloat16 --set memory.grad_dtype=bfloat16)
# shellcheck disable=SC2206
extra=($EXTRA)

A=${A:-memory.master_weights=float32}
B=${B:-memory.master_weights=bfloat16}
for run in a b; do
    setting=$A
    [[ $run == b ]] && setting=$B
    echo "fidelity_master: training with $setting" >&2
    # shellcheck disable=SC2086
    "$BIN/mt-launch" "${args[@]}" $(printf -- '--set %s ' $setting) \
        --set "training.output_dir=$work/out-$run" \
        --metrics-out "$work/$run.jsonl" "${extra[@]}" >"$work/$run.log" 2>&1 ||
        { tail -20 "$work/$run.log" >&2; exit 1; }
done

"$PYTHON" - "$work/a.jsonl" "$work/b.jsonl" "$A" "$B" <<'PY'
import json, sys

def losses(path):
    rows = [json.loads(l) for l in open(path)]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]

a, b = losses(sys.argv[1]), losses(sys.argv[2])
na, nb = sys.argv[3], sys.argv[4]
assert len(a) == len(b) and len(a) >= 20, (len(a), len(b))
mean = lambda x: sum(x) / len(x)
print(f"A: {na}\nB: {nb}")
print(f"{'steps':>11} {'A':>12} {'B':>12} {'rel diff':>9}")
for s in range(0, len(a), 50):
    wa, wb = a[s:s + 50], b[s:s + 50]
    print(f"{s + 1:>5}-{s + len(wa):<5} {mean(wa):>12.4f} {mean(wb):>12.4f} {(mean(wb) - mean(wa)) / mean(wa):>+9.2%}")
fa, fb = mean(a[-20:]), mean(b[-20:])
rel = abs(fb - fa) / fa
print(f"final loss (mean of the last 20 of {len(a)} steps): A {fa:.4f}, "
      f"B {fb:.4f}, relative difference {rel:.2%}")
print("PASS" if rel <= 0.01 else "FAIL: B's final loss is not within 1% of A's")
sys.exit(0 if rel <= 0.01 else 1)
PY
