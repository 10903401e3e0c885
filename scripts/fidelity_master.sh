#!/usr/bin/env bash
# Fidelity of the 12-bytes-per-parameter mode (`memory.master_weights: bfloat16`: the bf16
# store is the master, AdamW rounds it stochastically): the same training run twice, with
# an fp32 master and with a bf16 master, both with model.dtype and memory.grad_dtype
# bfloat16, and their losses compared. Prints the mean loss over each 50-step window of
# both runs, then the final loss (mean of the last 20 steps) of each and their relative
# difference: PASS if within 1%, else FAIL (exit 1).
#
# By default the runs do not memorize: continued pretraining (training.stage: pt, packed
# blocks) on a corpus of Python source text written from this machine's Python standard
# library (sorted files, CORPUS_MB megabytes, default 16: about 16M tokens with configs/tiny's
# byte-level BPE, more than 300 steps x 16 x 1024 three times over). No block is seen twice,
# so each step's loss is a held-out loss and the final loss measures the mode, not how far
# two trajectories of a memorizing run drift apart; the script fails if the corpus is too
# small for that.
#
#   CONFIG  a run config (default configs/tiny.yaml), or a model directory holding a
#           config.json (e.g. configs/qwen2.5-0.5b): that architecture is then trained on
#           configs/tiny.yaml's data and settings, from its weights if the directory has
#           them (else a random init), tokenized with the directory's tokenizer, or with
#           configs/tiny's byte-level BPE where it has none (ids < 512, valid in any larger
#           vocabulary)
#   DATA    `corpus` (default: the non-memorizing run above) or `config`: the config's own
#           dataset (configs/tiny.yaml: 240 alpaca samples, about 20 epochs in 300 steps)
#   STEPS   optimizer steps (default 300)
#   GPUS    GPUs to train on (default 0: CPU workers)
#   WORKERS CPU workers when GPUS=0 (default 2)
#   EXTRA   more mt-launch flags for both runs (e.g. "--set dataset.max_seq_len=64")
#   BIN     the built binaries (default target/release)
#   SEEDS   `1` adds a third run, A with training.seed SEED_C (default 1234: another init and
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
    "$PYTHON" - "$work/corpus.jsonl" "${CORPUS_MB:-16}" <<'PY'
import json, os, sys, sysconfig
out, limit = sys.argv[1], float(sys.argv[2]) * 1e6
root = sysconfig.get_paths()["stdlib"]
files = sorted(
    os.path.join(d, f)
    for d, _, fs in os.walk(root)
    if "site-packages" not in d
    for f in fs
    if f.endswith(".py")
)
size = 0
with open(out, "w") as w:
    for f in files:
        text = open(f, encoding="utf-8", errors="replace").read()
        if text.strip():
            w.write(json.dumps({"text": text}) + "\n")
            size += len(text.encode())
        if size >= limit:
            break
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
B=${B:-memory.master_weights=bfloat16}
runs=(a b)
[[ $SEEDS == 1 ]] && runs+=(c)
for run in "${runs[@]}"; do
    setting=$A
    [[ $run == b ]] && setting=$B
    [[ $run == c ]] && setting="$A training.seed=${SEED_C:-1234}"
    echo "fidelity_master: training with $setting" >&2
    # shellcheck disable=SC2086
    "$BIN/mt-launch" "${args[@]}" $(printf -- '--set %s ' $setting) \
        --set "training.output_dir=$work/out-$run" \
        --metrics-out "$work/$run.jsonl" "${extra[@]}" >"$work/$run.log" 2>&1 ||
        { tail -20 "$work/$run.log" >&2; exit 1; }
done
grep -m1 '^dataset:' "$work/a.log" >&2 || true

"$PYTHON" - "$work" "$A" "$B" "$DATA" <<'PY'
import json, os, re, sys

work, na, nb, data = sys.argv[1:5]

def losses(run):
    rows = [json.loads(l) for l in open(f"{work}/{run}.jsonl")]
    steps = [r for r in rows if "loss" in r and "step" in r]
    return [r["loss"] for r in steps], sum(r.get("tokens", 0) for r in steps)

a, tokens = losses("a")
b, _ = losses("b")
assert len(a) == len(b) and len(a) >= 20, (len(a), len(b))
if data == "corpus":
    m = re.search(r"concatenated into (\d+) blocks of (\d+) tokens", open(f"{work}/a.log").read())
    assert m, "the launcher's dataset line is missing"
    capacity = int(m[1]) * int(m[2])
    if tokens > capacity:
        sys.exit(f"FAIL: the run trained on {tokens} tokens but the corpus holds {capacity}: "
                 "blocks were seen twice; raise CORPUS_MB")
    print(f"corpus: {m[1]} blocks of {m[2]} tokens; the run trained on {tokens} tokens "
          f"({tokens / capacity:.0%} of them): no block seen twice")
mean = lambda x: sum(x) / len(x)
rel = lambda x, y: (mean(y) - mean(x)) / mean(x)
c = losses("c")[0] if os.path.exists(f"{work}/c.jsonl") else None
print(f"A: {na}\nB: {nb}")
if c:
    print("C: A with another training.seed (SEED_C)")
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
    print(f"seed spread: C {mean(c[-20:]):.4f}, {abs(rel(a[-20:], c[-20:])):.2%} from A")
print("PASS" if d <= 0.01 else "FAIL: B's final loss is not within 1% of A's")
sys.exit(0 if d <= 0.01 else 1)
PY
