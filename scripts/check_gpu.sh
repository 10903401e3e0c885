#!/usr/bin/env bash
# GPU correctness: the tiny model trained in bfloat16 on GPUs must give per-step losses
# within 2e-2 (relative) of the same run in float32 on CPU: on 1 and 2 GPUs, with two
# micro-batches per step, with layer inputs offloaded to host memory (which must also
# match the plain 1-GPU run to 1e-6), with tied embeddings, and for three variants of the
# tiny model: a Qwen3-MoE (routed experts, router aux loss; also on 2 GPUs), a Qwen3-Next
# hybrid (Gated DeltaNet + gated full attention, shared expert) and a Qwen3.5 one (split
# projections, dense MLP); the GPU runs take the chunked Gated DeltaNet path. Then
# scripts/check_gated_delta.sh compares that path with the reference one layer deep. Needs
# the built binaries (BIN, default target/release) and a GPU machine; Python only for the
# comparison.
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
"$PYTHON" - configs/tiny/config.json "$work" <<'PY'
import json, os, sys
base = json.load(open(sys.argv[1]))
moe = dict(base, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
           num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, decoder_sparse_step=1,
           mlp_only_layers=[], norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01)
hybrid = dict(base, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", head_dim=16,
              layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
              linear_key_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_value_head_dim=16,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, decoder_sparse_step=1,
              mlp_only_layers=[], norm_topk_prob=True, shared_expert_intermediate_size=128,
              output_router_logits=True, router_aux_loss_coef=0.01, partial_rotary_factor=0.25)
hybrid35 = dict(base, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", head_dim=16,
                layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                linear_key_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_value_head_dim=16, partial_rotary_factor=0.25)
for name, cfg in (("moe", moe), ("hybrid", hybrid), ("hybrid35", hybrid35)):
    os.makedirs(f"{sys.argv[2]}/{name}")
    json.dump(cfg, open(f"{sys.argv[2]}/{name}/config.json", "w"))
PY
for d in tied moe hybrid hybrid35; do cp configs/tiny/tokenizer.json configs/tiny/tokenizer_config.json "$work/$d/"; done
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
for m in moe hybrid hybrid35; do
  run "cpu_$m" "${cpu[@]}" --set "model.path=$work/$m"
  run "gpu1_$m" --gpus 1 "${gpu[@]}" --set "model.path=$work/$m"
done
run gpu2_moe --gpus 2 "${gpu[@]}" --set "model.path=$work/moe"

status=0
"$PYTHON" - "$work" <<'PY' || status=1
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
for name, ref in (("gpu1_moe", "cpu_moe"), ("gpu2_moe", "cpu_moe"), ("gpu1_hybrid", "cpu_hybrid"),
                  ("gpu1_hybrid35", "cpu_hybrid35")):
    check(name, ref, 2e-2)
check("gpu1_offload", "gpu1", 1e-6)
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
BIN=$BIN PYTHON=$PYTHON scripts/check_gated_delta.sh || status=1
exit $status
