#!/usr/bin/env bash
# GPU throughput benchmark: a model shape with random init at a fixed sequence length, for
# several per-GPU batch sizes, on several GPU counts; WARMUP + STEPS optimizer steps each,
# averaged over the timed steps. Prints a table and writes it, with the command, to
# $RESULTS/<model>_<machine>_<date>.md.
#
# Environment (defaults in brackets):
#   CONFIG [configs/bench/qwen_7b.yaml]  BATCHES per GPU ["8 32"]  GPUS ["1 2"]  SEQ [1024]
#   WARMUP [2]  STEPS [5]  ACCUM [1]  LAYERS (override num_hidden_layers, for quick probes)
#   BIN [target/release]  RESULTS [benches/results]  MACHINE [from nvidia-smi]  PYTHON [python3]
#   EXTRA (more mt-launch flags, e.g. "--set memory.num_grad_slabs=8")
#   MT_GATED_DELTA, MT_GATED_DELTA_CHUNK (the Gated DeltaNet path and chunk length; recorded)
#   PLAN_TOLERANCE (e.g. 0.10: fail when `mt-launch plan` misses a run's measured device
#   memory, context excluded, by more than this fraction)
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/bench/qwen_7b.yaml}
BATCHES=${BATCHES:-"8 32"}
GPUS=${GPUS:-"1 2"}
SEQ=${SEQ:-1024}
WARMUP=${WARMUP:-2}
STEPS=${STEPS:-5}
ACCUM=${ACCUM:-1}
BIN=${BIN:-target/release}
RESULTS=${RESULTS:-benches/results}
PYTHON=${PYTHON:-python3}
EXTRA=${EXTRA:-}
MACHINE=${MACHINE:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-' || echo unknown)}
DATE=$(date +%Y-%m-%d)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The model dir named by the config, optionally with fewer layers.
model_dir=$(cd "$(dirname "$CONFIG")" && cd "$(sed -n 's/^  path: *//p' "$(basename "$CONFIG")" | head -1)" && pwd)
if [ -n "${LAYERS:-}" ]; then
  mkdir -p "$work/model"
  "$PYTHON" - "$model_dir/config.json" "$work/model/config.json" "$LAYERS" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
t = c.get("text_config", c)  # a multimodal wrapper (Qwen3.5, Gemma 3) nests its decoder
n = t["num_hidden_layers"] = int(sys.argv[3])
if t.get("layer_types"):  # per-layer lists (GPT-OSS, hybrids) keep their first n entries
    t["layer_types"] = t["layer_types"][:n]
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
  model_dir=$work/model
fi
model=$(basename "$(dirname "$CONFIG")/$(sed -n 's/^  path: *//p' "$CONFIG" | head -1)")${LAYERS:+-${LAYERS}L}

max_rows=0
for g in $GPUS; do for b in $BATCHES; do r=$(( (g > 0 ? g : 1) * b * ACCUM)); [ $r -gt $max_rows ] && max_rows=$r; done; done
"$PYTHON" - "$model_dir/config.json" "$work/data.jsonl" "$max_rows" "$SEQ" <<'PY'
import json, random, sys
c = json.load(open(sys.argv[1]))
vocab = c.get("text_config", c)["vocab_size"]
rng = random.Random(0)
with open(sys.argv[2], "w") as f:
    for _ in range(int(sys.argv[3])):
        f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(int(sys.argv[4]))]}) + "\n")
PY

runs=()
for g in $GPUS; do
  for b in $BATCHES; do
    tag="g${g}_b${b}"
    echo "== $model: $g GPU(s), per-GPU batch $b x $SEQ (accumulation $ACCUM)" >&2
    args=(--config "$CONFIG" --gpus "$g"
      --set "model.path=$model_dir" --set "dataset.path=$work/data.jsonl" --set dataset.shuffle=false
      --set "dataset.max_seq_len=$SEQ" --set "training.batch_size=$(( (g > 0 ? g : 1) * b * ACCUM))"
      --set "training.gradient_accumulation_steps=$ACCUM" --set "training.num_steps=$((WARMUP + STEPS))")
    # The memory plan of the same run, to print beside the measured peak.
    # shellcheck disable=SC2086
    "$BIN/mt-launch" plan "${args[@]}" $EXTRA --json > "$work/$tag.plan.json" 2>/dev/null || echo '{}' > "$work/$tag.plan.json"
    # shellcheck disable=SC2086
    # Metrics go straight to RESULTS, so a run cut short (time limit, crash) keeps its steps.
    metrics="$RESULTS/metrics/${model}_${MACHINE}_${DATE}_$tag.jsonl"
    mkdir -p "$RESULTS/metrics"
    cp "$work/$tag.plan.json" "${metrics%.jsonl}.plan.json"
    if "$BIN/mt-launch" "${args[@]}" --set logging.log_every=1 --metrics-out "$metrics" $EXTRA >&2; then
      runs+=("$g $b $metrics")
    else
      echo "run $tag failed" >&2
      runs+=("$g $b FAILED")
    fi
  done
done

mkdir -p "$RESULTS"
out="$RESULTS/${model}_${MACHINE}_${DATE}.md"
"$PYTHON" - "$WARMUP" "$SEQ" "$model" "$MACHINE" "$DATE" "$out" "$(env | sed -n '/^MT_\(GATED_DELTA\|SWIGLU\|MOE_\|ROPE\|RMS_NORM\|CROSS_ENTROPY\)/p' | tr '\n' ' ')CONFIG=$CONFIG BATCHES=\"$BATCHES\" GPUS=\"$GPUS\" SEQ=$SEQ WARMUP=$WARMUP STEPS=$STEPS ACCUM=$ACCUM ${LAYERS:+LAYERS=$LAYERS }${EXTRA:+EXTRA=\"$EXTRA\" }scripts/bench_gpu.sh" "${runs[@]}" <<'PY'
import json, os, sys
warmup, seq, model, machine, date, out, cmd = int(sys.argv[1]), sys.argv[2], *sys.argv[3:8]
rows, base, worst_plan = [], {}, 0.0
for spec in sys.argv[8:]:
    g, b, path = spec.split(" ", 2)
    if path == "FAILED":
        rows.append(f"| {g} | {b} | failed | | | | | | | | | | | | |")
        continue
    plan_json = json.load(open(path[:-len(".jsonl")] + ".plan.json"))
    plan = plan_json.get("device", {}).get("total")
    host_plan = plan_json.get("host", {}).get("total")
    all_ms = [json.loads(l) for l in open(path)]
    ms = all_ms[warmup:]
    avg = lambda k: sum(m[k] for m in ms) / len(ms)
    step = avg("step_time_s")
    tps = avg("tokens_per_s")
    base.setdefault(b, {})[int(g)] = tps
    # The plan leaves out the CUDA context (measured by the worker before it allocates).
    used = max(m["peak_gpu_bytes"] - m.get("gpu_context_bytes", 0) for m in ms)
    if plan and used > 0:
        err = plan / used - 1
        worst_plan = max(worst_plan, abs(err))
        plan_col = f"{plan / 2**30:.1f} / {used / 2**30:.1f} ({err:+.0%})"
    else:
        plan_col = "n/a"
    peak_rss = max(m.get("launcher_peak_rss_bytes", m["launcher_rss_bytes"]) for m in ms)
    first = all_ms[0]
    first_col = "{} / {:.2f} ({:.2f}x)".format(
        f"{first['startup_s']:.1f}" if "startup_s" in first else "n/a",
        first["step_time_s"], first["step_time_s"] / avg("step_time_s"))
    bounds = [m.get("bound", "n/a") for m in ms]
    bound = max(set(bounds), key=bounds.count)
    wait_col = "{:.1%} / {:.1%} / {:.1%}".format(*(avg(k) / step for k in ("update_wait_s", "h2d_wait_s", "slot_wait_s"))) if "update_wait_s" in ms[0] else "n/a"
    host_col = (f"{host_plan / 1e9:.1f}" if host_plan else "n/a") + f" / {peak_rss / 1e9:.1f}"
    rows.append("| {} | {} | {:.2f} | {:.0f} | {:.1f} | {:.1f} | {} | {} | {:.2f} / {:.2f} | {:.2f} ({:.0%}) | {:.2f} ({:.0%}) | {:.2f} | {} | {} | {} |".format(
        g, b, step, tps, avg("tflops_megatrain"), avg("tflops_model"), bound, wait_col,
        avg("forward_s"), avg("backward_s"), avg("reduce_s"), avg("reduce_s") / step,
        avg("optimizer_s"), avg("optimizer_s") / step, max(m["peak_gpu_bytes"] for m in ms) / 2**30,
        plan_col, host_col, first_col))
head = ("| GPUs | batch/GPU | step s | tokens/s | TFLOPS/GPU (MegaTrain) | TFLOPS/GPU (model) | bound | waits: update / H2D / slot | fwd / bwd s "
        "| host reduce s (share) | optimizer s (share) | peak GPU GiB | plan / measured GiB (error) | host plan / launcher peak RSS GB | start-up s / step 1 s (x later) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
scaling = []
for b, by_g in base.items():
    for g, t in sorted(by_g.items()):
        if g > 1 and 1 in by_g:
            scaling.append(f"batch {b}/GPU: {g} GPUs = {t / by_g[1]:.2f}x the tokens/s of 1 GPU")
text = (f"# {model} on {machine}, {date}\n\nseq {seq}, random init, bf16 compute, fp32 master + Adam on host; "
        f"averages over the timed steps after {warmup} warm-up steps. Host reduce and optimizer run "
        f"beside the GPUs' work (reduce during the backward, the update during the next forward); "
        f"their share is of the step time, not of its critical path.\n\nCommand: `{cmd}`\n\n{head}\n" + "\n".join(rows) + "\n")
if scaling:
    text += "\n" + "\n".join(f"- {s}" for s in scaling) + "\n"
text += ("\nTFLOPS (model): 6 x matmul parameters (MoE: the routed experts only) x real tokens, plus "
         "QK^T and AV of the softmax-attention layers; Gated DeltaNet layers count their projections "
         "only, not the chunked delta rule (src/metrics.rs). TFLOPS (MegaTrain): 6 x all parameters x "
         "padded tokens.\n")
text += ("\nplan / measured: `mt-launch plan` device total against the peak device memory in use "
         "minus the CUDA context the worker measured before allocating (`gpu_context_bytes`); "
         f"worst error {worst_plan:.1%}.\n")
open(out, "w").write(text)
print(text)
tol = os.environ.get("PLAN_TOLERANCE")
if tol and worst_plan > float(tol):
    sys.exit(f"plan error {worst_plan:.1%} exceeds PLAN_TOLERANCE={tol}")
PY
echo "written: $out" >&2
