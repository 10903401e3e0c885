#!/usr/bin/env bash
# Fidelity of a low-precision host mode: the same training run with an fp32 master (A) and
# with the mode (B; default the 12 B/param bf16 master, `memory.master_weights: bfloat16`;
# the 10 B/param mode is B="memory.master_weights=split memory.moments_dtype=bfloat16"),
# all with model.dtype and memory.grad_dtype bfloat16, and their losses compared. Prints the
# mean loss over each 50-step window of the runs, then the final loss (mean of the last 20
# steps) of each and their relative difference: PASS if within 1%, else FAIL (exit 1).
#
# By default the runs do not memorize: continued pretraining (training.stage: pt, packed
# blocks) on a corpus of Python source text written from this machine's Python standard
# library (sorted files, up to CORPUS_MB megabytes, default 16; the library holds 10-30 MB
# depending on the Python, about a token per byte with configs/tiny's byte-level BPE). No
# block is seen twice, so each step's loss is a held-out loss and the final loss measures
# the mode, not how far two trajectories of a memorizing run drift apart; the script fails
# if the corpus is too small for that. START=pretrained (below) measures fine-tuning.
#
#   CONFIG  a run config (default configs/tiny.yaml), or a model directory holding a
#           config.json (e.g. configs/qwen2.5-0.5b): that architecture is then trained on
#           configs/tiny.yaml's data and settings, from its weights if the directory has
#           them (else a random init), tokenized with the directory's tokenizer, or with
#           configs/tiny's byte-level BPE where it has none (ids < 512, valid in any larger
#           vocabulary)
#   DATA    `corpus` (default: the non-memorizing run above) or `config`: the config's own
#           dataset (configs/tiny.yaml: 240 alpaca samples, about 20 epochs in 300 steps)
#   START   `random` (default: both runs from the config's init) or `pretrained`: first a
#           run with A's setting pretrains for PRE_STEPS steps (default STEPS) on half of
#           the corpus (every other file), and A and B then fine-tune its exported model on
#           the other half; needs DATA=corpus
#   STEPS   optimizer steps (default 300)
#   GPUS    GPUs to train on (default 0: CPU workers)
#   WORKERS CPU workers when GPUS=0 (default 2)
#   EXTRA   more mt-launch flags for both runs (e.g. "--set dataset.max_seq_len=64")
#   BIN     the built binaries (default target/release)
#   C       a third setting, compared with A as B is (reported, not judged); e.g.
#           C=memory.master_weights=bfloat16 beside B=memory.moments_dtype=bfloat16
#   SEEDS   `1` makes C A with training.seed SEED_C (default 1234: another init and
#           data order):
#           the spread two runs of the same mode show, beside the A/B difference
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
DATA=${DATA:-corpus}
START=${START:-random}
SEEDS=${SEEDS:-0}
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
if [[ $DATA == corpus ]]; then
    # One JSONL record per source file, in sorted path order, up to CORPUS_MB megabytes.
    # With START=pretrained, twice as much, every other file into pre.jsonl.
    "$PYTHON" - "$work" "${CORPUS_MB:-16}" "$START" <<'PY'
import json, os, sys, sysconfig
work, limit, start = sys.argv[1], float(sys.argv[2]) * 1e6, sys.argv[3]
limit *= 2 if start == "pretrained" else 1
root = sysconfig.get_paths()["stdlib"]
files = sorted(
    os.path.join(d, f)
    for d, _, fs in os.walk(root)
    if "site-packages" not in d
    for f in fs
    if f.endswith(".py")
)
size, kept = 0, 0
outs = [open(f"{work}/corpus.jsonl", "w")]
if start == "pretrained":
    outs.append(open(f"{work}/pre.jsonl", "w"))
for f in files:
    text = open(f, encoding="utf-8", errors="replace").read()
    if text.strip():
        outs[kept % len(outs)].write(json.dumps({"text": text}) + "\n")
        size += len(text.encode())
        kept += 1
    if size >= limit:
        break
for w in outs:
    w.close()
print(f"fidelity_master: corpus of {size / 1e6:.1f} MB from {root}", file=sys.stderr)
PY
    # Every block is trained on once at most, so each step's loss is already a held-out loss:
    # no eval set.
    args+=(--set training.stage=pt --set "dataset.path=$work/corpus.jsonl" --set dataset.name=null
        --set dataset.packing=true --set dataset.val_size=null --set training.eval_steps=null)
fi
# shellcheck disable=SC2206
extra=($EXTRA)

A=${A:-memory.master_weights=float32}
if [[ $START == pretrained ]]; then
    [[ $DATA == corpus ]] || { echo "fidelity_master: START=pretrained needs DATA=corpus" >&2; exit 2; }
    echo "fidelity_master: pretraining with $A for ${PRE_STEPS:-$STEPS} steps" >&2
    # shellcheck disable=SC2086
    "$BIN/mt-launch" "${args[@]}" $(printf -- '--set %s ' $A) \
        --set "dataset.path=$work/pre.jsonl" --set "training.num_steps=${PRE_STEPS:-$STEPS}" \
        --set "training.output_dir=$work/pretrained" \
        --metrics-out "$work/pre.metrics.jsonl" "${extra[@]}" >"$work/pre.log" 2>&1 ||
        { tail -20 "$work/pre.log" >&2; exit 1; }
    args+=(--set "model.path=$work/pretrained" --set model.init=pretrained)
fi
B=${B:-memory.master_weights=bfloat16}
runs=(a b)
[[ $SEEDS == 1 ]] && C="$A training.seed=${SEED_C:-1234}"
[[ -n ${C:-} ]] && runs+=(c)
for run in "${runs[@]}"; do
    setting=$A
    [[ $run == b ]] && setting=$B
    [[ $run == c ]] && setting=$C
    echo "fidelity_master: training with $setting" >&2
    # shellcheck disable=SC2086
    "$BIN/mt-launch" "${args[@]}" $(printf -- '--set %s ' $setting) \
        --set "training.output_dir=$work/out-$run" \
        --metrics-out "$work/$run.jsonl" "${extra[@]}" >"$work/$run.log" 2>&1 ||
        { tail -20 "$work/$run.log" >&2; exit 1; }
done
grep -m1 '^dataset:' "$work/a.log" >&2 || true

"$PYTHON" - "$work" "$A" "$B" "$DATA" "${C:-}" <<'PY'
import json, os, re, sys

work, na, nb, data, nc = sys.argv[1:6]

def losses(run):
    rows = [json.loads(l) for l in open(f"{work}/{run}.jsonl")]
    steps = [r for r in rows if "loss" in r and "step" in r]
    return [r["loss"] for r in steps], sum(r.get("tokens", 0) for r in steps)

a, tokens = losses("a")
repeated = False
b, _ = losses("b")
assert len(a) == len(b) and len(a) >= 20, (len(a), len(b))
if data == "corpus":
    m = re.search(r"concatenated into (\d+) blocks of (\d+) tokens", open(f"{work}/a.log").read())
    assert m, "the launcher's dataset line is missing"
    capacity = int(m[1]) * int(m[2])
    repeated = tokens > capacity
    print(f"corpus: {m[1]} blocks of {m[2]} tokens; the run trained on {tokens} tokens "
          f"({tokens / capacity:.0%} of them): "
          + ("blocks were seen twice" if repeated else "no block seen twice"))
mean = lambda x: sum(x) / len(x)
rel = lambda x, y: (mean(y) - mean(x)) / mean(x)
c = losses("c")[0] if os.path.exists(f"{work}/c.jsonl") else None
print(f"A: {na}\nB: {nb}")
if c:
    print(f"C: {nc}")
print(f"{'steps':>11} {'A':>12} {'B':>12} {'B vs A':>9}" + (f" {'C':>12} {'C vs A':>9}" if c else ""))
for s in range(0, len(a), 50):
    wa, wb = a[s:s + 50], b[s:s + 50]
    line = f"{s + 1:>5}-{s + len(wa):<5} {mean(wa):>12.4f} {mean(wb):>12.4f} {rel(wa, wb):>+9.2%}"
    if c:
        wc = c[s:s + 50]
        line += f" {mean(wc):>12.4f} {rel(wa, wc):>+9.2%}"
    print(line)
fa, fb = mean(a[-20:]), mean(b[-20:])
d = abs(fb - fa) / fa
print(f"final loss (mean of the last 20 of {len(a)} steps): A {fa:.4f}, "
      f"B {fb:.4f}, relative difference {d:.2%}")
if c:
    print(f"C's final loss: {mean(c[-20:]):.4f}, {rel(a[-20:], c[-20:]):+.2%} from A")
if data == "corpus" and repeated:
    sys.exit("FAIL: the corpus is too small for the run (blocks were seen twice): raise "
             "CORPUS_MB, or shorten the run (this Python's standard library may be smaller)")
print("PASS" if d <= 0.01 else "FAIL: B's final loss is not within 1% of A's")
sys.exit(0 if d <= 0.01 else 1)
PY
