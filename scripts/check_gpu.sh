#!/usr/bin/env bash
# GPU correctness: the tiny model trained in bfloat16 on 1 and on 2 GPUs must give per-step
# losses within 2e-2 (relative) of the same run in float32 on CPU. Needs the built
# binaries (BIN, default target/release) and a GPU machine; Python only for the comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--config configs/tiny.yaml --set dataset.shuffle=false --set "training.num_steps=$STEPS" --set training.learning_rate=3e-3 --set logging.log_every=4)

"$BIN/mt-launch" "${common[@]}" --gpus 0 --workers 1 --set model.dtype=float32 --metrics-out "$work/cpu.jsonl"
"$BIN/mt-launch" "${common[@]}" --gpus 1 --set model.dtype=bfloat16 --metrics-out "$work/gpu1.jsonl"
"$BIN/mt-launch" "${common[@]}" --gpus 2 --set model.dtype=bfloat16 --metrics-out "$work/gpu2.jsonl"

"$PYTHON" - "$work" <<'PY'
import json, sys
load = lambda n: [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/{n}.jsonl")]
ref = load("cpu")
ok = True
for name in ("gpu1", "gpu2"):
    got = load(name)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    ok &= worst <= 2e-2 and len(got) == len(ref)
    print(f"{name}: bf16 losses vs CPU f32 over {len(ref)} steps: worst relative difference {worst:.2e} "
          f"(first {got[0]:.4f} vs {ref[0]:.4f}, last {got[-1]:.4f} vs {ref[-1]:.4f})")
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
