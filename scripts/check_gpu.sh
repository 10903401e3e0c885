#!/usr/bin/env bash
# GPU correctness: the tiny model trained in bfloat16 on GPUs must give per-step losses
# within 2e-2 (relative) of the same run in float32 on CPU: on 1 and 2 GPUs, with two
# micro-batches per step, with layer inputs offloaded to host memory (which must also
# match the plain 1-GPU run to 1e-6), and with tied embeddings. Needs the built binaries
# (BIN, default target/release) and a GPU machine; Python only for the comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--config configs/tiny.yaml --set dataset.shuffle=false --set "training.num_steps=$STEPS" --set training.learning_rate=3e-3 --set logging.log_every=4)

"$PYTHON" - configs/tiny/config.json "$work/tied" <<'PY'
import json, os, sys
cfg = json.load(open(sys.argv[1]))
cfg["tie_word_embeddings"] = True
os.makedirs(sys.argv[2])
json.dump(cfg, open(f"{sys.argv[2]}/config.json", "w"))
PY
cp configs/tiny/tokenizer.json configs/tiny/tokenizer_config.json "$work/tied/"
run() { local name=$1; shift; "$BIN/mt-launch" "${common[@]}" "$@" --metrics-out "$work/$name.jsonl"; }
cpu=(--gpus 0 --workers 1 --set model.dtype=float32)
gpu=(--set model.dtype=bfloat16)
run cpu "${cpu[@]}"
run cpu_tied "${cpu[@]}" --set "model.path=$work/tied"
run gpu1 --gpus 1 "${gpu[@]}"
run gpu2 --gpus 2 "${gpu[@]}"
run gpu1_accum2 --gpus 1 "${gpu[@]}" --set training.gradient_accumulation_steps=2
run gpu1_offload --gpus 1 "${gpu[@]}" --set memory.offload_activations=true
run gpu1_tied --gpus 1 "${gpu[@]}" --set "model.path=$work/tied"

"$PYTHON" - "$work" <<'PY'
import json, sys
load = lambda n: [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/{n}.jsonl")]
ok = True
def check(name, ref_name, bound):
    global ok
    got, ref = load(name), load(ref_name)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    ok &= worst <= bound and len(got) == len(ref)
    print(f"{name} vs {ref_name} over {len(ref)} steps: worst relative difference {worst:.2e} "
          f"(bound {bound:.0e}; first {got[0]:.4f} vs {ref[0]:.4f}, last {got[-1]:.4f} vs {ref[-1]:.4f})")
for name in ("gpu1", "gpu2", "gpu1_accum2", "gpu1_offload"):
    check(name, "cpu", 2e-2)
check("gpu1_tied", "cpu_tied", 2e-2)
check("gpu1_offload", "gpu1", 1e-6)
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
