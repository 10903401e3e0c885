#!/usr/bin/env bash
# GPU check of resident blocks (memory.resident_blocks): the leading blocks kept and updated
# on the GPU must train exactly as the host's update of every block.
#
# 1. adamw.cu against the host's arithmetic: `mt-worker --check-resident-update` runs the
#    kernel and mt::optim's update on a million random elements for each gradient dtype,
#    compute dtype, weight decay and split master; every bit of the master, the moments and
#    the compute weights must agree.
# 2. End to end: configs/tiny.yaml in bf16 on one GPU, 6 steps of 2 micro-batches with a
#    split master and bf16 gradients, an evaluation every 3 steps, a checkpoint at step 3 and
#    the export: with every block resident, with 2, and with none (twice, which tells
#    whether the GPU's own compute repeats bit for bit). Where it does, the losses, gradient
#    norms, eval losses and every file written must be the same bits; where it does not,
#    within what two runs without resident blocks differ by, or 1e-6 relative.
# Needs the built binaries (BIN, default target/release) and a GPU. Prints PASS or FAIL.
# LOCAL=1 runs part 2 on CPU in float32 instead (for checking this script).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0

if [ -n "${LOCAL:-}" ]; then
  DEVICE="--gpus 0 --workers 1"
  MODE="--set model.dtype=float32 --set memory.master_weights=float32 --set memory.grad_dtype=float32"
else
  DEVICE="--gpus 1"
  MODE="--set model.dtype=bfloat16 --set memory.master_weights=split --set memory.grad_dtype=bfloat16"
  echo "== adamw.cu against the host's update"
  "$BIN/mt-worker" --check-resident-update || status=1
fi

run() {
  local tag=$1 resident=$2
  # shellcheck disable=SC2086
  "$BIN/mt-launch" --config configs/tiny.yaml $DEVICE --metrics-out "$work/$tag.jsonl" $MODE \
    --set training.num_steps=6 --set training.gradient_accumulation_steps=2 \
    --set training.eval_steps=3 --set checkpoint.dir="$work/$tag/ck" --set checkpoint.every_steps=3 \
    --set training.output_dir="$work/$tag/out" --set memory.resident_blocks="$resident" \
    > "$work/$tag.log" 2>&1 || { echo "run $tag failed:"; tail -20 "$work/$tag.log"; return 1; }
  grep -h "resident blocks" "$work/$tag.log" | head -1 || true
}
echo "== configs/tiny.yaml, bf16, 1 GPU: none, none again, all, 2 resident blocks"
for t in "off off" "off2 off" "all all" "two 2"; do
  # shellcheck disable=SC2086
  run $t || status=1
done
"$PYTHON" - "$work" <<'PY' || status=1
import filecmp, json, os, sys
work = sys.argv[1]
def rows(tag):
    return [json.loads(l) for l in open(f"{work}/{tag}.jsonl")]
def values(tag):
    out = []
    for r in rows(tag):
        for k in ("loss", "grad_norm", "eval_loss"):
            if k in r and r[k] is not None:
                out.append((r.get("step"), k, r[k]))
    return out
def files(tag):
    root = f"{work}/{tag}"
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, fs in os.walk(root) for f in fs)
def rel(a, b):
    return max(abs(x[2] - y[2]) / max(abs(x[2]), 1e-30) for x, y in zip(a, b))
base, again = values("off"), values("off2")
det = base == again and all(filecmp.cmp(f"{work}/off/{f}", f"{work}/off2/{f}", shallow=False)
                            for f in files("off"))
noise = rel(base, again)
print(f"two runs without resident blocks: {'the same bits' if det else f'differ by up to {noise:.2e} relative'}")
ok = True
for tag in ("all", "two"):
    got = values(tag)
    if [x[:2] for x in got] != [x[:2] for x in base]:
        print(f"{tag}: other metrics than the run without: {got} vs {base}"); ok = False; continue
    if files(tag) != files("off"):
        print(f"{tag}: other files: {files(tag)}"); ok = False; continue
    same_files = all(filecmp.cmp(f"{work}/off/{f}", f"{work}/{tag}/{f}", shallow=False) for f in files("off"))
    d = rel(base, got)
    if det:
        good = got == base and same_files
        print(f"resident {tag}: {'the same bits' if good else f'differs (up to {d:.2e} relative; files equal: {same_files})'}")
    else:
        good = d <= max(noise, 1e-6)
        print(f"resident {tag}: up to {d:.2e} relative from the run without (bound {max(noise, 1e-6):.2e})")
    ok &= good
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
exit $status
