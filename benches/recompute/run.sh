#!/usr/bin/env bash
# memory.recompute on a GPU machine: one shape trained with `full` (every layer recomputed
# from its input; the down projection's forward skipped) and `auto` (the last layers keep
# their MLP activations, as many as the device plan fits), and, with BEFORE=<dir of an
# earlier build's mt-launch and mt-worker>, with those binaries too, in one call; one table
# of scripts/bench_gpu.sh's columns per variant, ratios against `full`.
#
# Environment (defaults in brackets): CONFIG [configs/bench/qwen_7b.yaml] BATCH [128]
# WARMUP [1] STEPS [3] LAYERS (fewer layers, for a quick probe) BIN [target/release]
# BEFORE (none) MACHINE (from nvidia-smi). Prints the table; copy it into benches/results/.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
[ -n "${LAYERS:-}" ] && export LAYERS
variants="full auto"
[ -n "${BEFORE:-}" ] && variants="before $variants"
for v in $variants; do
  case $v in
    before) bin=$BEFORE; extra="";;
    full) bin=$BIN; extra="--set memory.recompute=full";;
    auto) bin=$BIN; extra="--set memory.recompute=auto";;
  esac
  echo "== $v" >&2
  BIN=$bin EXTRA="$extra" CONFIG=${CONFIG:-configs/bench/qwen_7b.yaml} BATCHES=${BATCH:-128} \
    GPUS=1 WARMUP=${WARMUP:-1} STEPS=${STEPS:-3} RESULTS=$out/$v \
    scripts/bench_gpu.sh >&2
done
python3 - "$out" $variants <<'PY'
import glob, json, os, sys
out, variants = sys.argv[1], sys.argv[2:]
rows, tflops = [], {}
for v in variants:
    md = glob.glob(f"{out}/{v}/*.md")
    metrics = glob.glob(f"{out}/{v}/metrics/*.jsonl")
    line = next((l for l in open(md[0]) if l.startswith("| 1 ")), None) if md else None
    ms = [json.loads(l) for l in open(metrics[0])][1:] if metrics else []
    if ms:
        tflops[v] = sum(m["tflops_megatrain"] for m in ms) / len(ms)
    kept = max((m.get("kept_layers", 0) for m in ms), default=0)
    rows.append((v, kept, line.strip() if line else "| failed |"))
    name = os.path.basename(md[0]) if md else None
base = tflops.get("full")
text = ["| variant | kept layers | vs full (MegaTrain TFLOPS) | bench_gpu.sh row |", "|---|---|---|---|"]
for v, kept, line in rows:
    ratio = f"{tflops[v] / base:.3f}" if base and v in tflops else "n/a"
    text.append(f"| {v} | {kept} | {ratio} | `{line}` |")
print("\n".join(text))
PY
