#!/usr/bin/env bash
# Optimizer state on the drives (issue #51): a model trained with `memory.optimizer_offload:
# nvme`, its master low halves and bf16 moments in files under NVME_DIR, host RAM holding the
# bf16 store and gradient; beside it the drive's own sequential bandwidth (dd with O_DIRECT,
# 16 MiB blocks, the size of the run's stripes' windows) on the same directory. Runs
# scripts/bench_gpu.sh once per ACCUMS entry (gradient accumulation: more tokens per update,
# the same drive traffic) and writes the drive table, with the command, to
# $RESULTS/nvme_<model>_<machine>_<date>.md.
#
# Environment [defaults]: NVME_DIR (required: a directory on the drive)  CONFIG
#   [configs/bench/qwen_7b.yaml]  BATCH [128]  ACCUMS ["1 2"]  WARMUP [1]  STEPS [2]  LAYERS
#   BIN [target/release]  RESULTS [benches/results]  DD_GB [8]  PYTHON [python3]  GPUS [1] (0: CPU
#   workers, to try the script)  KEEP (a directory for the runs' metrics and logs, kept)
#   READ_AHEADS ["1"]: MT_NVME_READ_AHEAD values to run each accumulation with; "0 1" measures
#   the read-ahead across blocks against the update that reads each block's first window when
#   the block starts, in the same invocation, and writes the ratio of their drive waits
#   MACHINE [from nvidia-smi]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NVME_DIR:?NVME_DIR: a directory on the drive to hold the state}"
CONFIG=${CONFIG:-configs/bench/qwen_7b.yaml}; BATCH=${BATCH:-128}; ACCUMS=${ACCUMS:-"1 2"}
WARMUP=${WARMUP:-1}; STEPS=${STEPS:-2}; BIN=${BIN:-target/release}; RESULTS=${RESULTS:-benches/results}
DD_GB=${DD_GB:-8}; PYTHON=${PYTHON:-python3}; GPUS=${GPUS:-1}; READ_AHEADS=${READ_AHEADS:-1}
MACHINE=${MACHINE:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-' || echo unknown)}
mkdir -p "$NVME_DIR"
# KEEP: a directory to keep each run's metrics and logs in (they survive a cut-short call).
if [ -n "${KEEP:-}" ]; then work=$KEEP; mkdir -p "$work"; trap 'rm -f "$NVME_DIR/dd.probe"' EXIT
else work=$(mktemp -d); trap 'rm -rf "$work"; rm -f "$NVME_DIR/dd.probe"' EXIT; fi

# The drive alone: write then read DD_GB with O_DIRECT (the page cache bypassed, as the run's).
dd_rate() { sed -n 's/.*copied, \([0-9.]*\) s, .*/\1/p' "$1" | tail -1; }
count=$(( DD_GB * 64 ))
dd if=/dev/zero of="$NVME_DIR/dd.probe" bs=16M count=$count oflag=direct conv=fsync 2>"$work/ddw"
dd if="$NVME_DIR/dd.probe" of=/dev/null bs=16M iflag=direct 2>"$work/ddr"
dd_w=$("$PYTHON" -c "print(f'{$count * 16 * 2**20 / $(dd_rate "$work/ddw") / 1e9:.2f}')")
dd_r=$("$PYTHON" -c "print(f'{$count * 16 * 2**20 / $(dd_rate "$work/ddr") / 1e9:.2f}')")
rm -f "$NVME_DIR/dd.probe"
df -h "$NVME_DIR" | tail -1 > "$work/df"
echo "bench_nvme: dd on $NVME_DIR: write $dd_w GB/s, read $dd_r GB/s ($(cat "$work/df"))" >&2

nvme=(--set memory.optimizer_offload=nvme --set "memory.nvme_path=$NVME_DIR" --set memory.master_weights=split
      --set memory.moments_dtype=bfloat16 --set memory.grad_dtype=bfloat16)
for r in $READ_AHEADS; do for a in $ACCUMS; do
  envs=(CONFIG="$CONFIG" BATCHES="$BATCH" GPUS="$GPUS" ACCUM="$a" WARMUP="$WARMUP" STEPS="$STEPS" BIN="$BIN"
        RESULTS="$work/r${r}a$a" EXTRA="${nvme[*]}" PYTHON="$PYTHON" MT_NVME_READ_AHEAD="$r" MACHINE="$MACHINE")
  [ -z "${LAYERS:-}" ] || envs+=(LAYERS="$LAYERS")
  env "${envs[@]}" scripts/bench_gpu.sh >&2 || echo "bench_nvme: the run with accumulation $a failed" >&2
done; done
mkdir -p "$RESULTS"
model=$(basename "$(dirname "$CONFIG")/$(sed -n 's/^  path: *//p' "$CONFIG" | head -1)")${LAYERS:+-${LAYERS}L}
out="$RESULTS/nvme_${model}_${MACHINE}_$(date +%Y-%m-%d).md"
"$PYTHON" - "$work" "$out" "$WARMUP" "$dd_w" "$dd_r" "$(cat "$work/df")" "$BATCH" \
  "NVME_DIR=$NVME_DIR CONFIG=$CONFIG BATCH=$BATCH ACCUMS=\"$ACCUMS\" READ_AHEADS=\"$READ_AHEADS\" GPUS=$GPUS WARMUP=$WARMUP STEPS=$STEPS ${LAYERS:+LAYERS=$LAYERS }scripts/bench_nvme.sh" "$READ_AHEADS" $ACCUMS <<'PY'
import glob, json, sys
work, out, warmup, dd_w, dd_r, df, batch, cmd, read_aheads, *accums = sys.argv[1:]
rows, waits = [], {}
for r in read_aheads.split():
  for a in accums:
    ra = {"0": "off", "1": "on"}.get(r, r)
    files = glob.glob(f"{work}/r{r}a{a}/metrics/*.jsonl")
    if not files:
        rows.append(f"| {ra} | {batch} x {a} | failed |||||||||")
        continue
    ms = [json.loads(l) for l in open(files[0])][int(warmup):]
    if not ms:
        rows.append(f"| {ra} | {batch} x {a} | no timed step |||||||||")
        continue
    avg = lambda k: sum(m.get(k, 0.0) for m in ms) / len(ms)
    step = avg("step_time_s")
    waits[(r, a)] = avg("drive_wait_s")
    rows.append(f"| {ra} | {batch} x {a} | {step:.1f} | {avg('tflops_megatrain'):.1f} / {avg('tflops_model'):.1f} | "
                f"{avg('drive_read_bytes') / 1e9:.1f} / {avg('drive_write_bytes') / 1e9:.1f} | "
                f"{avg('drive_read_gb_s'):.2f} / {avg('drive_write_gb_s'):.2f} | {avg('drive_wait_s'):.2f} ({avg('drive_wait_s') / step:.0%}) | "
                f"{avg('forward_s') + avg('backward_s'):.1f} | {max(m['launcher_peak_rss_bytes'] for m in ms) / 1e9:.1f} | "
                f"{max(m.get('peak_gpu_bytes', 0) for m in ms) / 2**30:.1f} | {len(ms)} |")
ratios = [f"accumulation {a}: the read-ahead across blocks waited {waits[('1', a)]:.2f} s per step for the drive, "
          f"{waits[('1', a)] / waits[('0', a)]:.2f}x the {waits[('0', a)]:.2f} s of the update without it (MT_NVME_READ_AHEAD=0)"
          for a in accums if waits.get(('0', a)) and ('1', a) in waits]
head = ("| read-ahead across blocks | batch x accumulation | step s | TFLOPS MegaTrain / model | drive GB read / written per step | drive GB/s read / write "
        "| drive wait s (share of step) | GPU fwd+bwd s | launcher peak RSS GB | peak GPU GiB | timed steps |\n|---|---|---|---|---|---|---|---|---|---|---|")
text = (f"# Optimizer state on the drive: {sys.argv[2].split('/')[-1][:-3]}\n\n"
        f"Master low halves (split master) and bf16 moments in files on the drive, bf16 store and gradient in RAM; "
        f"averages after {warmup} warm-up step(s). The drive alone (dd, O_DIRECT, 16 MiB blocks): write {dd_w} GB/s, read {dd_r} GB/s; "
        f"`df`: {df}\n\nCommand: `{cmd}`\n\n{head}\n" + "\n".join(rows) + "\n"
        + "".join(f"\n{line}\n" for line in ratios))
open(out, "w").write(text)
print(text)
PY
echo "bench_nvme: wrote $out" >&2
