#!/usr/bin/env bash
# Checkpoint benchmark: what a periodic checkpoint written while training goes on costs the
# GPUs, and how fast it writes against the disk's own sequential write bandwidth.
#
# One run of a model shape (random init, as scripts/bench_gpu.sh runs it) for 2 x EVERY
# steps with checkpoint.every_steps = EVERY: steps 1..EVERY have no checkpoint in flight (the
# baseline step time, after WARMUP), the full-state checkpoint of step EVERY is written in
# the background during steps EVERY+1.., and the end of the run writes one more in place
# (nothing runs beside it: the writer's bandwidth alone). Beside it, `dd oflag=direct` into
# the same directory measures the disk's sequential write bandwidth: DD_RUNS times, before
# and after the run, and the median is the reference (one reading of a cloud volume varied
# 1.20-1.60 GB/s minutes apart, which alone moved a write from 73% to 93% of it). Each checkpoint is
# deleted as soon as the launcher reports it complete, which it does for the periodic one
# before it writes the end-of-run one, so the disk needs room for one checkpoint (14 bytes per
# parameter: 12 of optimizer state, 2 of bf16 export) and a tenth, and dd's file; use LAYERS
# to fit a smaller disk.
#
# Pass: the periodic checkpoint stalls the GPUs at most one baseline step (launcher-measured
# `training waited`, and the extra step time of the steps it overlapped), and both writes
# run at >= 80% of dd's bandwidth.
#
# Environment (defaults in brackets):
#   CONFIG [configs/bench/qwen_7b.yaml]  LAYERS (override num_hidden_layers)  GPUS [2]
#   BATCH per GPU [16]  SEQ [1024]  EVERY [20]  WARMUP [3]
#   STAGING (checkpoint.staging_size, e.g. 32GB; unset: the default, grown at launch into half
#   the RAM left free, up to the whole checkpoint)
#   CKDIR [target/bench-checkpoint: on the disk to measure]  DD_GB [16]  DD_RUNS [3: 2 before the
#   run, the rest after]
#   BIN [target/release]  RESULTS [benches/results]  MACHINE [from nvidia-smi]  PYTHON [python3]
#   EXTRA (more mt-launch flags)
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/bench/qwen_7b.yaml}
GPUS=${GPUS:-2}
BATCH=${BATCH:-16}
SEQ=${SEQ:-1024}
EVERY=${EVERY:-20}
WARMUP=${WARMUP:-3}
CKDIR=${CKDIR:-target/bench-checkpoint}
DD_GB=${DD_GB:-16}
DD_RUNS=${DD_RUNS:-3}
BIN=${BIN:-target/release}
RESULTS=${RESULTS:-benches/results}
PYTHON=${PYTHON:-python3}
EXTRA=${EXTRA:-}
MACHINE=${MACHINE:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-' || echo unknown)}
DATE=$(date +%Y-%m-%d)
[ "$DD_RUNS" -ge 1 ] || { echo "DD_RUNS ($DD_RUNS) must be at least 1" >&2; exit 2; }
[ "$EVERY" -gt "$WARMUP" ] || { echo "EVERY ($EVERY) must exceed WARMUP ($WARMUP)" >&2; exit 2; }
work=$(mktemp -d)
mkdir -p "$CKDIR"
CKDIR=$(cd "$CKDIR" && pwd)
ck="$CKDIR/ck-$$"
launcher_pid=
cleanup() {
  [ -n "$launcher_pid" ] && kill "$launcher_pid" 2>/dev/null || true
  rm -rf "$work" "$ck" "$CKDIR/dd-$$.bin"
}
trap cleanup EXIT

# The model dir named by the config, optionally with fewer layers (as bench_gpu.sh).
model_dir=$(cd "$(dirname "$CONFIG")" && cd "$(sed -n 's/^  path: *//p' "$(basename "$CONFIG")" | head -1)" && pwd)
if [ -n "${LAYERS:-}" ]; then
  mkdir -p "$work/model"
  "$PYTHON" - "$model_dir/config.json" "$work/model/config.json" "$LAYERS" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); n = c["num_hidden_layers"] = int(sys.argv[3])
if c.get("layer_types"):
    c["layer_types"] = c["layer_types"][:n]
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
  model_dir=$work/model
fi
model=$(basename "$(dirname "$CONFIG")/$(sed -n 's/^  path: *//p' "$CONFIG" | head -1)")${LAYERS:+-${LAYERS}L}
rows=$(( (GPUS > 0 ? GPUS : 1) * BATCH ))
"$PYTHON" - "$model_dir/config.json" "$work/data.jsonl" "$rows" "$SEQ" <<'PY'
import json, random, sys
vocab = json.load(open(sys.argv[1]))["vocab_size"]
rng = random.Random(0)
with open(sys.argv[2], "w") as f:
    for _ in range(int(sys.argv[3])):
        f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(int(sys.argv[4]))]}) + "\n")
PY

args=(--config "$CONFIG" --gpus "$GPUS"
  --set "model.path=$model_dir" --set "dataset.path=$work/data.jsonl" --set dataset.shuffle=false
  --set "dataset.max_seq_len=$SEQ" --set "training.batch_size=$rows"
  --set "training.num_steps=$(( 2 * EVERY ))"
  --set "checkpoint.dir=$ck" --set "checkpoint.every_steps=$EVERY" --set checkpoint.keep_last=100)
[ -n "${STAGING:-}" ] && args+=(--set "checkpoint.staging_size=$STAGING")
# shellcheck disable=SC2086
"$BIN/mt-launch" plan "${args[@]}" $EXTRA --json > "$work/plan.json"
# shellcheck disable=SC2086
"$BIN/mt-launch" plan "${args[@]}" $EXTRA | sed -n '/^host memory/,/total/p' >&2

# Room for a checkpoint (about 14 bytes per parameter), a tenth more (the end-of-run one
# starts while the loop below deletes the periodic one, polled every second) and dd's file.
need=$("$PYTHON" -c "import json,sys; print(int(json.load(open(sys.argv[1]))['host']['params'] * 1.1 * 14.1 + $DD_GB * 2**30))" "$work/plan.json")
free=$(df -B1 --output=avail "$CKDIR" | tail -1 | tr -d ' ')
if [ "$free" -lt "$need" ]; then
  echo "$CKDIR has $((free / 10**9)) GB free, a checkpoint and dd need $((need / 10**9)) GB: use fewer LAYERS or another CKDIR" >&2
  exit 1
fi

# One dd reading, its summary line appended to dd.log.
dd_once() {
  echo "== dd: $DD_GB GiB into $CKDIR (oflag=direct), $1" >&2
  dd if=/dev/zero of="$CKDIR/dd-$$.bin" bs=64M count=$(( DD_GB * 16 )) oflag=direct conv=fsync 2> "$work/dd.one"
  rm -f "$CKDIR/dd-$$.bin"
  tail -1 "$work/dd.one" | tee -a "$work/dd.log" >&2
}
: > "$work/dd.log"
before=$(( DD_RUNS > 1 ? 2 : DD_RUNS ))
for i in $(seq 1 "$before"); do dd_once "before the run ($i)"; done

echo "== $model: $GPUS GPU(s), batch $BATCH x $SEQ per GPU, checkpoint every $EVERY steps${STAGING:+, staging $STAGING}" >&2
mkdir -p "$RESULTS/metrics"
metrics="$RESULTS/metrics/checkpoint_${model}_${MACHINE}_${DATE}.jsonl"
# shellcheck disable=SC2086
"$BIN/mt-launch" "${args[@]}" --set logging.log_every=1 --metrics-out "$metrics" $EXTRA > "$work/run.log" 2>&2 &
launcher_pid=$!
# Delete each checkpoint once complete (keep_last is high, so the launcher never prunes).
deleted=0
while kill -0 "$launcher_pid" 2>/dev/null; do
  { grep -o "checkpoint $ck/step-[0-9]* written" "$work/run.log" || true; } | awk '{print $2}' | tail -n +$((deleted + 1)) | while read -r d; do
    rm -rf "$d"
  done
  deleted=$(grep -c "checkpoint $ck/step-[0-9]* written" "$work/run.log" || true)
  sleep 1
done
wait "$launcher_pid" && status=0 || status=$?
launcher_pid=
cat "$work/run.log" >&2
[ "$status" -eq 0 ] || { echo "the run failed ($status)" >&2; exit "$status"; }
for i in $(seq $(( before + 1 )) "$DD_RUNS"); do dd_once "after the run ($i)"; done

mkdir -p "$RESULTS"
out="$RESULTS/checkpoint_${model}_${MACHINE}_${DATE}.md"
cmd="CONFIG=$CONFIG ${LAYERS:+LAYERS=$LAYERS }GPUS=$GPUS BATCH=$BATCH SEQ=$SEQ EVERY=$EVERY WARMUP=$WARMUP ${STAGING:+STAGING=$STAGING }DD_GB=$DD_GB DD_RUNS=$DD_RUNS CKDIR=$CKDIR ${EXTRA:+EXTRA=\"$EXTRA\" }scripts/bench_checkpoint.sh"
"$PYTHON" - "$metrics" "$work/run.log" "$work/dd.log" "$work/plan.json" "$EVERY" "$WARMUP" "$model" "$MACHINE" "$DATE" "$out" "$cmd" <<'PY'
import json, re, sys
metrics, log, dd, plan, every, warmup, model, machine, date, out, cmd = sys.argv[1:]
every, warmup = int(every), int(warmup)
ms = [json.loads(l) for l in open(metrics)]
step = {m["step"]: m for m in ms}
base_steps = [step[s]["step_time_s"] for s in range(warmup + 1, every + 1) if s in step]
# The median: a long run's first steps after the warm-up can run slower (a 7B run on a fresh
# 2xH100 host: 3.0-3.4 s against 2.7 s from step 25 on), which a mean would carry into the
# baseline.
base = sorted(base_steps)[len(base_steps) // 2]
after = [step[s] for s in range(every + 1, 2 * every + 1) if s in step]
excess = sum(max(0.0, m["step_time_s"] - base) for m in after)
hook = sum(m.get("checkpoint_wait_s", 0.0) for m in after)
readings = []
for text in open(dd).read().strip().splitlines():
    rate = re.search(r"([0-9.]+) ([GM])B/s", text)
    readings.append(float(rate.group(1)) / (1000 if rate.group(2) == "M" else 1))
# The median reading is the reference; every reading is shown.
dd_gbs = sorted(readings)[len(readings) // 2]
pat = re.compile(r"checkpoint \S+/step-0*(\d+) written: ([0-9.]+) GB in ([0-9.]+)s \(([0-9.]+) GB/s\); "
                 r"training waited ([0-9.]+)s for it; (?:blocks|parts): (\d+) staged, (\d+) copied ahead, (\d+) from the live state")
run_log = open(log).read()
writes = {int(g[0]): g for g in pat.findall(run_log)}
staging = json.load(open(plan))["host"].get("checkpoint_staging", 0)
# The launch's own plan line: unset, the area grows at launch into free RAM.
line = re.search(r"^  checkpoint staging +([0-9.]+) GB", run_log, re.M)
# The launch's start-up phases (the staging area is touched in the background, after them).
startup = re.search(r"^start-up [^\n]*", run_log, re.M)
touched = re.search(r"checkpoint staging area touched: [^\n]*", run_log)
if line:
    staging = float(line.group(1)) * 1e9
rows, ok = [], True
for s, kind in ((every, "periodic (training goes on)"), (2 * every, "end of run (in place)")):
    if s not in writes:
        rows.append(f"| {s} | {kind} | missing | | | | | |")
        ok = False
        continue
    _, gb, secs, gbs, waited, staged, copied, live = writes[s]
    frac = float(gbs) / dd_gbs
    ok &= frac >= 0.8
    stall = float(waited) if s == every else None
    if stall is not None:
        ok &= stall <= base and excess <= base
    rows.append(f"| {s} | {kind} | {float(gb):.1f} | {float(secs):.1f} | {float(gbs):.2f} ({frac:.0%} of dd) | "
                + (f"{stall:.2f} ({stall / base:.2f} steps) | {excess:.2f} ({excess / base:.2f} steps)" if stall is not None else "| ")
                + f" | {staged} / {copied} / {live} |")
# Staging that would hold the stall under one step at this bandwidth: what the writer
# cannot write in the two steps before the optimizer's first pass ends.
size = float(writes[every][1]) if every in writes else 0.0
need = max(0.0, size - 2 * base * float(writes[every][3])) if every in writes else 0.0
head = ("| step | checkpoint | GB | write s | GB/s | training waited s (launcher) | extra step time s | parts (weights, moments of a block) staged / copied ahead / live |\n"
        "|---|---|---|---|---|---|---|---|")
body = (f"# Checkpoints while training: {model} on {machine}, {date}\n\n"
        f"Command: `{cmd}`\n\n"
        f"Baseline step (the median of steps {warmup + 1}-{every}, no checkpoint in flight): {base:.2f} s. "
        f"Disk (dd oflag=direct, same directory): {dd_gbs:.2f} GB/s, the median of "
        f"{', '.join(f'{r:.2f}' for r in readings)} GB/s (in order: before the run, then after). Staging area: {staging / 1e9:.1f} GB. "
        f"Optimizer time in the checkpoint hook over steps {every + 1}-{2 * every}: {hook:.2f} s.\n\n"
        f"{head}\n" + "\n".join(rows) + "\n\n"
        f"Staging that would hold the stall under one step at this bandwidth: about {need:.0f} GB "
        f"(checkpoint size minus what the writer writes in two steps).\n\n"
        f"Pass (stall <= one step, writes >= 80% of dd): {'yes' if ok else 'NO'}\n"
        + (f"\nThe launch's {startup.group(0)}; step 1 {step[1]['step_time_s']:.2f} s "
           f"({step[1]['step_time_s'] / base:.2f}x the baseline step).\n" if startup and 1 in step else "")
        + (f"The {touched.group(0)}, after the start-up.\n" if touched else ""))
open(out, "w").write(body)
print(body)
PY
echo "written: $out" >&2
