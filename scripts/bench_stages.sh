#!/usr/bin/env bash
# SFT, DPO and GRPO step speed on one GPU (issue #25 part 7): the Qwen2.5-7B shape with 8
# layers, random init, 32 rows of 1024 tokens per step each way (SFT: 32 sequences; DPO:
# 16 pairs sharing a 256-token prompt, answers labelled; GRPO: 4 groups of 8 completions of
# 768 tokens after a 256-token prompt, random rewards; GRPO again with grpo.beta 0.04, whose
# KL term needs the reference pass over the rollouts); 5 steps, the first left out.
# Environment: BIN [target/release], OUT [a new temporary directory] for logs and metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
OUT=${OUT:-$(mktemp -d)}
w=$(mktemp -d); mkdir -p $w/model
trap 'rm -rf "$w"' EXIT
python3 - configs/qwen2.5-7b/config.json $w <<'PY'
import json, random, sys
c = json.load(open(sys.argv[1])); c["num_hidden_layers"] = 8; w = sys.argv[2]
json.dump(c, open(f"{w}/model/config.json", "w"))
rng = random.Random(0); V = c["vocab_size"]; T = 1024; P = 256
ids = lambda n: [rng.randrange(V) for _ in range(n)]
with open(f"{w}/sft.jsonl", "w") as f:
    for _ in range(64): f.write(json.dumps({"input_ids": ids(T)}) + "\n")
with open(f"{w}/dpo.jsonl", "w") as f:
    for _ in range(32):
        p = ids(P); a, b = ids(T - P), ids(T - P)
        f.write(json.dumps({"chosen_input_ids": p + a, "chosen_labels": [-100] * P + a,
                            "rejected_input_ids": p + b, "rejected_labels": [-100] * P + b}) + "\n")
with open(f"{w}/grpo.jsonl", "w") as f:
    for g in range(8):
        p = ids(P)
        for _ in range(8):
            f.write(json.dumps({"prompt_ids": p, "completion_ids": ids(T - P), "reward": rng.random(), "group": g}) + "\n")
PY
common=(--config configs/bench/qwen_7b.yaml --gpus 1 --set model.path=$w/model --set dataset.shuffle=false --set dataset.max_seq_len=1024 --set training.num_steps=5 --set logging.log_every=1)
"$BIN/mt-launch" "${common[@]}" --set dataset.path=$w/sft.jsonl --set training.batch_size=32 --metrics-out $OUT/sft.jsonl > "$OUT/sft.log" 2>&1 || echo "sft run failed: $OUT/sft.log"
"$BIN/mt-launch" "${common[@]}" --set dataset.path=$w/dpo.jsonl --set training.stage=dpo --set training.batch_size=16 --metrics-out $OUT/dpo.jsonl > "$OUT/dpo.log" 2>&1 || echo "dpo run failed: $OUT/dpo.log"
"$BIN/mt-launch" "${common[@]}" --set dataset.path=$w/grpo.jsonl --set training.stage=grpo --set training.batch_size=32 --metrics-out $OUT/grpo.jsonl > "$OUT/grpo.log" 2>&1 || echo "grpo run failed: $OUT/grpo.log"
"$BIN/mt-launch" "${common[@]}" --set dataset.path=$w/grpo.jsonl --set training.stage=grpo --set training.batch_size=32 --set grpo.beta=0.04 --metrics-out $OUT/grpo-kl.jsonl > "$OUT/grpo-kl.log" 2>&1 || echo "grpo-kl run failed: $OUT/grpo-kl.log"
grep -i "reference pass" "$OUT/dpo.log" "$OUT/grpo-kl.log" || true
for r in sft dpo grpo grpo-kl; do python3 - $OUT/$r.jsonl $r <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l]
t = [r for r in rows if r["step"] >= 2]
print(sys.argv[2], "steps", len(t), "step_s %.3f" % (sum(r["step_time_s"] for r in t)/len(t)), "tokens/s %.0f" % (sum(r["tokens"] for r in t)/sum(r["step_time_s"] for r in t)), "fwd %.3f bwd %.3f" % (sum(r["forward_s"] for r in t)/len(t), sum(r["backward_s"] for r in t)/len(t)), "model TFLOPS %.1f" % (sum(r["tflops_model"] for r in t)/len(t)))
PY
done
