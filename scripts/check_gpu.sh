#!/usr/bin/env bash
# GPU correctness: the tiny model trained in bfloat16 on GPUs must give per-step losses
# within 2e-2 (relative) of the same run in float32 on CPU: on 1 and 2 GPUs, with two
# micro-batches per step, with layer inputs offloaded to host memory (which must also
# match the plain 1-GPU run to 1e-6), with tied embeddings, and for three variants of the
# tiny model: a Qwen3-MoE (routed experts, router aux loss; also on 2 GPUs), a Qwen3-Next
# hybrid (Gated DeltaNet + gated full attention, shared expert) and a Qwen3.5 one (split
# projections, dense MLP), the GPU runs taking the chunked Gated DeltaNet path; and the
# families and multimodal wrappers of issue 17 at the tiny model's size: OLMo 2, GLM-4,
# GLM-4.5 (group-limited sigmoid router, correction bias), DeepSeek-V3 (latent attention),
# Llama 4 (NoPE + chunked layers, temperature, input-scaled experts), and Qwen3.5,
# Qwen3.5-MoE, Gemma 3, Mistral 3 and Llama 4 wrappers (random init: the text model, as
# trained). The eval loss of the held-out samples (configs/tiny.yaml's val_size, evaluated
# after the last step by the forward-only path) must agree the same way. Then
# scripts/check_gated_delta.sh compares the chunked Gated DeltaNet path with the reference
# one layer deep. Needs the built binaries (BIN, default target/release) and a GPU machine;
# Python only for the configs and the comparison.
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
"$PYTHON" - configs/tiny/config.json "$work" <<'PY'
import json, os, sys
base = json.load(open(sys.argv[1]))
base.pop("architectures")
tiny = {k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                             "rms_norm_eps", "rope_parameters", "hidden_act", "initializer_range")}
router = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=96,
              n_shared_experts=1, first_k_dense_replace=1)
llama4 = dict(tiny, model_type="llama4_text", head_dim=16, intermediate_size=96, intermediate_size_mlp=344,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
              attention_chunk_size=64, floor_scale=32)
qwen3_5 = dict(tiny, model_type="qwen3_5_text", head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               layer_types=["linear_attention"] * 3 + ["full_attention"],
               rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
configs = {
    "olmo2": dict(base, model_type="olmo2"),
    "glm4": dict(base, model_type="glm4", head_dim=16, partial_rotary_factor=0.5),
    "glm4_moe": dict(base, model_type="glm4_moe", head_dim=16, use_qk_norm=True, **router),
    "deepseek_v3": dict(base, model_type="deepseek_v3", num_key_value_heads=8, kv_lora_rank=64,
                        q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, **router),
    "llama4_text": llama4,
    "w_qwen3_5": dict(model_type="qwen3_5", text_config=qwen3_5, vision_config={}),
    "w_qwen3_5_moe": dict(model_type="qwen3_5_moe", vision_config={},
                          text_config=dict(qwen3_5, model_type="qwen3_5_moe_text", num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=96,
                                           shared_expert_intermediate_size=128)),
    "w_gemma3": dict(model_type="gemma3", vision_config={},
                     text_config=dict(tiny, model_type="gemma3_text", head_dim=16, sliding_window=64)),
    "w_mistral3": dict(model_type="mistral3", tie_word_embeddings=False, vision_config={},
                       text_config=dict(tiny, model_type="mistral", sliding_window=None)),
    "w_llama4": dict(model_type="llama4", vision_config={}, text_config=llama4),
}
for name, cfg in configs.items():
    os.makedirs(f"{sys.argv[2]}/{name}")
    json.dump(cfg, open(f"{sys.argv[2]}/{name}/config.json", "w"))
PY
families="olmo2 glm4 glm4_moe deepseek_v3 llama4_text w_qwen3_5 w_qwen3_5_moe w_gemma3 w_mistral3 w_llama4"
for d in tied moe hybrid hybrid35 $families; do cp configs/tiny/tokenizer.json configs/tiny/tokenizer_config.json "$work/$d/"; done
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
for m in $families; do
  run "cpu_$m" "${cpu[@]}" --set "model.path=$work/$m"
  run "gpu1_$m" --gpus 1 "${gpu[@]}" --set "model.path=$work/$m"
done

status=0
"$PYTHON" - "$work" $families <<'PY' || status=1
import json, sys
def load(n, key):
    rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{n}.jsonl")]
    return [r[key] for r in rows if key in r]
ok = True
def check(name, ref_name, bound):
    global ok
    for key, what in (("loss", "steps"), ("eval_loss", "evaluations")):
        got, ref = load(name, key), load(ref_name, key)
        if not got or len(got) != len(ref):
            ok = False
            print(f"{name} vs {ref_name} {key}: {len(got)} values vs {len(ref)}")
            continue
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        ok &= worst <= bound
        print(f"{name} vs {ref_name} {key} over {len(ref)} {what}: worst relative difference {worst:.2e} "
              f"(bound {bound:.0e}; first {got[0]:.4f} vs {ref[0]:.4f}, last {got[-1]:.4f} vs {ref[-1]:.4f})")
for name in ("gpu1", "gpu2", "gpu1_accum2", "gpu1_offload"):
    check(name, "cpu", 2e-2)
check("gpu1_tied", "cpu_tied", 2e-2)
for name, ref in (("gpu1_moe", "cpu_moe"), ("gpu2_moe", "cpu_moe"), ("gpu1_hybrid", "cpu_hybrid"),
                  ("gpu1_hybrid35", "cpu_hybrid35")):
    check(name, ref, 2e-2)
for m in sys.argv[2:]:
    check(f"gpu1_{m}", f"cpu_{m}", 2e-2)
check("gpu1_offload", "gpu1", 1e-6)
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
BIN=$BIN PYTHON=$PYTHON scripts/check_gated_delta.sh || status=1
exit $status
