#!/usr/bin/env bash
# What the integrity guarantees cost on a GPU host (docs/faults.md): a full checkpoint
# written with its CRC32C manifest computed while writing (GB/s against `dd oflag=direct`
# into the same directory), and a resume that verifies every file of it against the manifest
# (GB/s against `dd iflag=direct`) beside the same resume with `checkpoint.verify: false`.
#
# A random-init shape (CONFIG, LAYERS of its layers) trains STEPS steps and writes its
# end-of-run checkpoint in place; it is then resumed twice for one more step, each resume
# writing into a directory of its own that is deleted after it, so the disk needs room for two
# checkpoints (14 bytes per parameter each) and dd's file. The page cache is dropped before
# each resume where the host allows it (said in the output), so the verify reads the disk.
#
# Environment (defaults in brackets):
#   CONFIG [configs/bench/qwen_7b.yaml]  LAYERS [2]  BATCH [16]  STEPS [2]  DD_GB [8]
#   CKDIR [target/bench-integrity: on the disk to measure]  BIN [target/release]  PYTHON [python3]
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/bench/qwen_7b.yaml}
LAYERS=${LAYERS:-2}
BATCH=${BATCH:-16}
STEPS=${STEPS:-2}
DD_GB=${DD_GB:-8}
CKDIR=${CKDIR:-target/bench-integrity}
BIN=${BIN:-target/release}
PYTHON=${PYTHON:-python3}
mkdir -p "$CKDIR"
CKDIR=$(cd "$CKDIR" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work" "$CKDIR/ck" "$CKDIR/ck2" "$CKDIR/out" "$CKDIR/dd.bin"' EXIT

model_dir=$(cd "$(dirname "$CONFIG")" && cd "$(sed -n 's/^  path: *//p' "$(basename "$CONFIG")" | head -1)" && pwd)
mkdir -p "$work/model"
"$PYTHON" - "$model_dir/config.json" "$work/model/config.json" "$LAYERS" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); n = c["num_hidden_layers"] = int(sys.argv[3])
if c.get("layer_types"):
    c["layer_types"] = c["layer_types"][:n]
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY

drop_caches() {
  sync
  if echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then echo "page cache dropped"; else echo "page cache NOT dropped (no permission): reads may come from memory"; fi
}

echo "== disk: dd ${DD_GB} GB"
dd if=/dev/zero of="$CKDIR/dd.bin" bs=1M count=$((DD_GB * 1024)) oflag=direct 2>&1 | tail -1 | tee "$work/dd_write"
drop_caches
dd if="$CKDIR/dd.bin" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1 | tee "$work/dd_read"
rm -f "$CKDIR/dd.bin"

common=(--config "$CONFIG" --gpus 1 --set "model.path=$work/model" --set "training.batch_size=$BATCH"
  --set training.lr_scheduler=constant --set training.warmup_steps=0 --set checkpoint.every_minutes=0)
echo "== train $STEPS steps, full checkpoint at the end"
"$BIN/mt-launch" "${common[@]}" --set "training.num_steps=$STEPS" --set training.save_model=true \
  --set "training.output_dir=$CKDIR/out" --set "checkpoint.dir=$CKDIR/ck" 2>&1 | tee "$work/train.log" | grep -v '^step' || true
step=$(printf 'step-%08d' "$STEPS")
for verify in true false; do
  drop_caches
  echo "== resume, checkpoint.verify: $verify"
  "$BIN/mt-launch" "${common[@]}" --set "training.num_steps=$((STEPS + 1))" --set training.save_model=false \
    --set "checkpoint.dir=$CKDIR/ck2" --set checkpoint.keep_last=1 --set "checkpoint.verify=$verify" \
    --resume "$CKDIR/ck/$step" 2>&1 | tee "$work/resume_$verify.log" | grep -v '^step' || true
  rm -rf "$CKDIR/ck2"
done

"$PYTHON" - "$work" <<'PY'
import re, sys, os
w = sys.argv[1]
def text(n): return open(os.path.join(w, n)).read()
def dd(n):
    m = re.search(r"([\d.]+) s, ([\d.]+) ([GM])B/s", text(n))
    return float(m.group(2)) / (1000 if m.group(3) == "M" else 1) if m else float("nan")
ck = re.search(r"checkpoint \S+ written: ([\d.]+) GB in ([\d.]+)s \(([\d.]+) GB/s\)", text("train.log"))
ver = re.search(r"verified .*?\(\d+ files, ([\d.]+) GB in ([\d.]+)s, ([\d.]+) GB/s\)", text("resume_true.log"))
def weights(n):
    m = re.search(r"weights ([\d.]+)s", text(n))
    return float(m.group(1)) if m else float("nan")
print("| what | GB | s | GB/s |")
print("|---|---|---|---|")
print(f"| dd oflag=direct write | | | {dd('dd_write'):.2f} |")
print(f"| dd iflag=direct read | | | {dd('dd_read'):.2f} |")
if ck: print(f"| end-of-run checkpoint, CRC32C while writing | {ck.group(1)} | {ck.group(2)} | {ck.group(3)} |")
if ver: print(f"| resume: verify every file | {ver.group(1)} | {ver.group(2)} | {ver.group(3)} |")
print(f"| resume: weights phase with verify / without | | {weights('resume_true.log'):.2f} / {weights('resume_false.log'):.2f} | |")
PY
