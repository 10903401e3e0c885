#!/usr/bin/env python3
"""Golden fixtures: tiny random HF models trained a few steps by transformers + torch.

For each case this writes, under OUT/<case>/:
  model/          an HF model dir saved by transformers (config.json + model.safetensors)
  data.jsonl      a tokenized dataset with uneven lengths (right padding) and masked labels
  run.yaml        an mt-launch config for the same run (float32, no shuffle)
  expected.json   per-step loss and pre-clip gradient norm from the PyTorch reference
  grads0.safetensors  every parameter's gradient at step 1 (before clipping), under the
                      names save_pretrained writes (per-expert tensors for fused MoE experts)
  expected_w2.json, grads0_w2.safetensors  the 2-worker reference, for cases whose loss
                      depends on the split of the batch (the router aux loss)
  logits0.safetensors the step-1 logits (f32, rows x padded length x vocab)
  eval.jsonl      a separate eval set; expected.json's `eval_losses` is its loss (summed
                  token cross-entropy / label tokens of the whole set, no router aux term)
                  under the weights after each step
  dequantized.safetensors  (MXFP4 cases) the expert weights as transformers dequantizes
                      the packed checkpoint in model/ (bf16), to compare bit for bit

The vision towers' fixtures (OUT/vision/qwen2_5_vl/, OUT/vision/qwen3_vl/, OUT/vision/qwen3_5/,
OUT/vision/gemma3/, OUT/vision/llava_next/): scripts/make_vlm_model_fixtures.py.

DPO cases (OUT/dpo/<case>/, training.stage: dpo; scripts/golden_dpo.py): model/, pairs.jsonl
(tokenized preference pairs: a shared prompt, labels on each answer only), run.yaml, and
expected.json (per-step DPO loss, gradient norm and TRL's reward metrics) and
grads0.safetensors from the same tiny model trained by TRL's DPO loss formula in torch.

The reference implements the contract of DESIGN.md "Numerics": loss = summed token
cross-entropy / unmasked label tokens of the global batch, labels shifted inside,
torch.optim.AdamW with decay on >= 2-dim tensors only, torch clip_grad_norm_.

Installed by scripts/setup.sh: torch==2.11.0 transformers==5.17.0 safetensors numpy.
"""
import argparse
import copy
import importlib
import json
import os
import shutil
import subprocess
import sys

import safetensors.torch
import torch
import torch.nn.functional as F
import transformers

STEPS = 3
BATCH = 4
ROWS = 12  # 3 steps x 4 rows, file order
EVAL_ROWS = 5

# Every case: a tiny random model (>= 2 layers, GQA, sizes that are not powers of two) with
# its family's distinctive options switched on, sized so they matter: sliding windows
# shorter than the rows (6..20 tokens), soft-caps near the score and logit magnitudes, RoPE
# scalings whose regimes all occur; cases whose feature acts through attention scores use a
# larger init, so that attention is far from uniform and the feature moves the loss.
#   model_type: the transformers config class (AutoConfig.for_model)
#   config: overrides of BASE
#   train: overrides of TRAIN
#   attn: attention implementation of the reference; Gemma 2 needs "eager", as transformers'
#         SDPA path silently drops attention soft-capping
#   row_len: every row this long (no padding), so that every micro-batch of every worker
#         sees the same sequence length (dynamic NTK RoPE depends on it)
#   scale: {parameter-name substring: factor} applied after init, to push a feature into its
#         active range (GPT-OSS's expert clamp at +-7)
#   buffers: {buffer-name substring: std} non-zero random buffers (the routers' correction
#         bias, which a fresh model holds at 0)
#   wrapper: the multimodal class (`model_type` of AutoConfig) whose text model is
#         `model_type` with `config`; `vision` its vision_config, `top` its own keys. The
#         reference is the wrapper's forward on text; its vision tower gets no gradient,
#         so the reference neither clips nor updates it (carried by mt-launch)
#   names: "current" rewrites the saved checkpoint from the legacy names transformers 5.17
#         writes (`language_model.model.*`) to the current ones (`model.language_model.*`);
#         "language_model" rewrites a Qwen2.5-VL save (the hub's names, `model.layers.*`
#         beside `visual.*`, which transformers 5.17 writes) to the names of its modules
#         (`model.language_model.*`, `model.visual.*`), as other tools save it;
#         `flat_config` rewrites config.json as the hub's Qwen2.5-VL uploads have it (the
#         text keys at the top, `rope_scaling` of type mrope); either is checked to load
#         into transformers as the model it came from;
#         `drop_top_keys` removes keys from the saved config.json
#   mxfp4: the checkpoint's expert weights are MXFP4-packed (pack_mxfp4)
# With output_router_logits the loss adds router_aux_loss_coef x transformers' router
# load-balancing loss. Each micro-batch (one per worker here) adds its own aux loss,
# weighted by its share of the batch's label tokens, so the reference depends on the number
# of workers: the 1-worker run is exactly transformers' loss (its `aux_loss` output), and
# expected_w2.json / grads0_w2.safetensors hold the 2-worker reference.
# MoE cases mix sparse and dense layers where the family allows it, so the layout holds
# layers of different structures; hybrid cases mix Gated DeltaNet and attention layers.
# Llama 4: layer 1 a NoPE layer with a temperature that varies inside the rows (floor_scale
# 4), layers 0 and 2 chunked (5 positions) with RoPE and the query/key L2 norm; layer 1 an
# MoE layer (2 of 4 experts per token, scores scaling the experts' input) beside a shared
# expert, the others dense (intermediate_size_mlp).
LLAMA4_TEXT = dict(
    head_dim=8, intermediate_size=20, intermediate_size_mlp=40, num_local_experts=4,
    num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layers=[1, 0, 1],
    attention_chunk_size=5, floor_scale=4, attn_scale=0.5, use_qk_norm=True, pad_token_id=0,
    initializer_range=0.08,
    rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=16, rope_theta=500000.0),
)
MISTRAL3_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                       image_size=28, patch_size=14, head_dim=16)

# Qwen2.5-VL: a 1-block vision tower (its merger's output as wide as the text model), the
# text model's mrope sections [1, 2, 1] over head_dim 8 (text rows turn every section by
# the same position), and image tokens inside the vocabulary, as the `mrope` stage's rows
# place them.
QWEN2_5_VL_VISION = dict(depth=1, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=48,
                         fullatt_block_indexes=[0])
QWEN2_5_VL_TOP = dict(image_token_id=64, video_token_id=65, vision_start_token_id=62, vision_end_token_id=63)
QWEN2_5_VL_TEXT = dict(rope_parameters=dict(rope_type="default", mrope_section=[1, 2, 1], rope_theta=10000.0),
                       initializer_range=0.05)

CASES = {
    "llama": dict(model_type="llama", config=dict(tie_word_embeddings=False, attention_bias=False)),
    # Embedding and lm_head ~3.6 decoder layers large: a gradient slab slot holds one layer,
    # so their gradients travel in 4 parts each (tied: the embedding's, which collects the
    # lm_head gradient over the whole backward).
    "llama_wide_vocab": dict(model_type="llama", config=dict(vocab_size=1531, tie_word_embeddings=False)),
    "llama_wide_vocab_tied": dict(model_type="llama", config=dict(vocab_size=1531, tie_word_embeddings=True)),
    "llama_tied_bias": dict(
        model_type="llama",
        config=dict(tie_word_embeddings=True, attention_bias=True),
        train=dict(weight_decay=0.0),
    ),
    "llama_rope_linear": dict(
        model_type="llama",
        config=dict(head_dim=10, mlp_bias=True, initializer_range=0.08, rope_parameters=dict(rope_type="linear", factor=2.5, rope_theta=10000.0)),
    ),
    "llama_rope_dynamic": dict(
        model_type="llama",
        config=dict(max_position_embeddings=12, initializer_range=0.08, rope_parameters=dict(rope_type="dynamic", factor=3.0, rope_theta=10000.0)),
        row_len=19,
    ),
    "llama32_tied_rope_llama3": dict(
        model_type="llama",
        config=dict(
            tie_word_embeddings=True, head_dim=16, max_position_embeddings=256, initializer_range=0.08,
            rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64, rope_theta=500000.0),
        ),
    ),
    "llama_rope_yarn": dict(
        model_type="llama",
        config=dict(head_dim=12, max_position_embeddings=128, initializer_range=0.08,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                         rope_theta=10000.0)),
    ),
    "mistral_sliding": dict(model_type="mistral", config=dict(num_key_value_heads=3, sliding_window=5)),
    "qwen2_bias_sliding": dict(
        model_type="qwen2",
        config=dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "qwen3_qk_norm": dict(model_type="qwen3", config=dict(head_dim=10, tie_word_embeddings=True)),
    "gemma2_softcap": dict(
        model_type="gemma2",
        config=dict(head_dim=10, query_pre_attn_scalar=12, sliding_window=5, initializer_range=0.2,
                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0, pad_token_id=0),
        attn="eager",
    ),
    "gemma3_text_local_rope": dict(
        model_type="gemma3_text",
        config=dict(
            head_dim=10, query_pre_attn_scalar=12, sliding_window=5, initializer_range=0.2,
            final_logit_softcapping=3.0, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=100000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=1000.0),
            },
        ),
        attn="eager",
    ),
    "phi3_fused_longrope": dict(
        model_type="phi3",
        config=dict(
            hidden_size=60, sliding_window=6, pad_token_id=None, bos_token_id=1, eos_token_id=2,
            max_position_embeddings=128, initializer_range=0.08,
            original_max_position_embeddings=32,
            rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.6,
                                 short_factor=[1.0, 1.7, 2.9], long_factor=[1.2, 3.1, 5.3]),
        ),
    ),
    "mixtral_moe": dict(
        model_type="mixtral",
        config=dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=20, sliding_window=7),
    ),
    "qwen2_moe_shared_dense": dict(
        model_type="qwen2_moe",
        config=dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20,
                    shared_expert_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[1]),
    ),
    "qwen3_moe_norm_topk": dict(
        model_type="qwen3_moe",
        config=dict(head_dim=10, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
                    norm_topk_prob=True, decoder_sparse_step=2, tie_word_embeddings=True),
    ),
    "mixtral_router_aux_loss": dict(
        model_type="mixtral",
        config=dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=20,
                    output_router_logits=True, router_aux_loss_coef=0.5, num_hidden_layers=2),
    ),
    "gpt_oss_sinks_clamp": dict(
        model_type="gpt_oss",
        config=dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=20,
                    sliding_window=5, initializer_range=0.1,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                         truncate=False, original_max_position_embeddings=32,
                                         rope_theta=150000.0)),
        scale={"gate_up_proj": 6.0},
    ),
    # GPT-OSS as OpenAI publishes it: the experts' weights in MXFP4 (`*_blocks`, `*_scales`,
    # random codes and scales; widths multiples of 32), loaded by transformers
    # (Mxfp4Config(dequantize=True)) for the reference, which trains the dequantized model.
    "gpt_oss_mxfp4": dict(
        model_type="gpt_oss",
        config=dict(hidden_size=64, intermediate_size=32, head_dim=8, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=5, initializer_range=0.1,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                         truncate=False, original_max_position_embeddings=32,
                                         rope_theta=150000.0)),
        mxfp4=True,
    ),
    "qwen3_next_hybrid_moe": dict(
        model_type="qwen3_next",
        config=dict(
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
            shared_expert_intermediate_size=24, mlp_only_layers=[2],
            output_router_logits=True, router_aux_loss_coef=0.3,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
    ),
    "qwen3_5_text_long_chunks": dict(
        model_type="qwen3_5_text",
        config=dict(
            head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=10, linear_conv_kernel_dim=3, initializer_range=0.05,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        ),
        row_len=70,
    ),
    "qwen3_5_moe_text": dict(
        model_type="qwen3_5_moe_text",
        config=dict(
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
            shared_expert_intermediate_size=24, linear_num_key_heads=1, linear_num_value_heads=3,
            linear_key_head_dim=8, linear_value_head_dim=6,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        ),
    ),
    "olmo2_post_norm": dict(
        model_type="olmo2",
        config=dict(attention_bias=True, pad_token_id=1, eos_token_id=2, initializer_range=0.08),
    ),
    "glm4_sandwich_partial_rope": dict(
        model_type="glm4",
        config=dict(head_dim=12, pad_token_id=0, eos_token_id=2, initializer_range=0.08,
                    rms_norm_eps=1e-5),
    ),
    "glm4_moe_group_router": dict(
        model_type="glm4_moe",
        config=dict(head_dim=8, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                    moe_intermediate_size=20, n_shared_experts=2, first_k_dense_replace=1,
                    routed_scaling_factor=1.8, use_qk_norm=True, pad_token_id=0, initializer_range=0.08),
        buffers={"e_score_correction_bias": 0.1},
    ),
    "deepseek_v3_mla_yarn": dict(
        model_type="deepseek_v3",
        config=dict(num_key_value_heads=6, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
                    qk_nope_head_dim=6, v_head_dim=5, n_routed_experts=8, num_experts_per_tok=2,
                    n_group=4, topk_group=2, moe_intermediate_size=20, first_k_dense_replace=1,
                    rms_norm_eps=1e-5, pad_token_id=0, initializer_range=0.08,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                         mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0,
                                         rope_theta=10000.0)),
        buffers={"e_score_correction_bias": 0.1},
    ),
    "deepseek_v3_plain_q_halves": dict(
        model_type="deepseek_v3",
        config=dict(num_key_value_heads=6, kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=6,
                    qk_nope_head_dim=4, v_head_dim=7, n_routed_experts=4, num_experts_per_tok=2,
                    n_group=1, topk_group=1, moe_intermediate_size=20, first_k_dense_replace=2,
                    n_shared_experts=1, norm_topk_prob=False, rope_interleave=False, pad_token_id=0,
                    initializer_range=0.08),
    ),
    "llama4_text_chunked_nope": dict(
        model_type="llama4_text",
        config=LLAMA4_TEXT,
    ),
    "qwen3_5_wrapper": dict(
        wrapper="qwen3_5",
        model_type="qwen3_5_text",
        config=dict(
            head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=10, linear_conv_kernel_dim=3, initializer_range=0.05,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                 mrope_section=[1, 0, 0], mrope_interleaved=True),
        ),
        vision=dict(depth=1, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=48),
    ),
    "qwen3_5_moe_wrapper": dict(
        wrapper="qwen3_5_moe",
        model_type="qwen3_5_moe_text",
        config=dict(
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
            shared_expert_intermediate_size=24, linear_num_key_heads=1, linear_num_value_heads=3,
            linear_key_head_dim=8, linear_value_head_dim=6,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        ),
        vision=dict(depth=1, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=48),
    ),
    "gemma3_wrapper": dict(
        wrapper="gemma3",
        model_type="gemma3_text",
        config=dict(
            head_dim=10, query_pre_attn_scalar=12, sliding_window=5, initializer_range=0.2,
            final_logit_softcapping=3.0, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=100000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=1000.0),
            },
        ),
        vision=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                    image_size=28, patch_size=14),
        top=dict(mm_tokens_per_image=4),
        attn="eager",
    ),
    "mistral3_wrapper": dict(
        wrapper="mistral3",
        model_type="mistral",
        config=dict(head_dim=10, sliding_window=None, initializer_range=0.08),
        vision=MISTRAL3_VISION,
        top=dict(tie_word_embeddings=False),
    ),
    # The current names, and a config that ties by default (no `tie_word_embeddings`) over
    # a checkpoint that stores its own lm_head: transformers leaves it untied.
    "mistral3_current_names_untied": dict(
        wrapper="mistral3",
        model_type="mistral",
        config=dict(num_key_value_heads=3, sliding_window=7),
        vision=MISTRAL3_VISION,
        top=dict(tie_word_embeddings=False),
        names="current",
        drop_top_keys=["tie_word_embeddings"],
    ),
    "qwen2_5_vl_wrapper": dict(
        wrapper="qwen2_5_vl",
        model_type="qwen2_5_vl_text",
        config=QWEN2_5_VL_TEXT,
        vision=QWEN2_5_VL_VISION,
        top=QWEN2_5_VL_TOP,
    ),
    # The hub's layout (Qwen/Qwen2.5-VL-*-Instruct): flat config.json, `model.layers.*` beside
    # `visual.*`; tied, as the 3B model is.
    "qwen2_5_vl_hub_layout": dict(
        wrapper="qwen2_5_vl",
        model_type="qwen2_5_vl_text",
        config={**QWEN2_5_VL_TEXT, "num_key_value_heads": 3},
        vision=QWEN2_5_VL_VISION,
        top={**QWEN2_5_VL_TOP, "tie_word_embeddings": True},
        flat_config=True,
    ),
    # The module names: `model.language_model.*`, `model.visual.*`, `lm_head.weight`.
    "qwen2_5_vl_module_names": dict(
        wrapper="qwen2_5_vl",
        model_type="qwen2_5_vl_text",
        config={**QWEN2_5_VL_TEXT, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
        vision=QWEN2_5_VL_VISION,
        top=QWEN2_5_VL_TOP,
        names="language_model",
    ),
    "llama4_wrapper": dict(
        wrapper="llama4",
        model_type="llama4_text",
        config=LLAMA4_TEXT,
        vision=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                    image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                    projector_output_dim=32),
    ),
}

BASE = dict(
    vocab_size=67,
    hidden_size=48,
    intermediate_size=88,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
TRAIN = dict(learning_rate=3e-3, weight_decay=0.1, max_grad_norm=1.0, beta1=0.9, beta2=0.95, eps=1e-8)


def make_rows(gen, vocab, row_len=None):
    rows = []
    for i in range(ROWS):
        n = int(torch.randint(6, 21, (1,), generator=gen))
        n = row_len or n
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        if i % 3 == 2:
            rows.append({"input_ids": ids})  # labels absent = input_ids
            continue
        prompt = int(torch.randint(1, n - 2, (1,), generator=gen))
        labels = [-100] * prompt + ids[prompt:]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def batch(rows):
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    labels = torch.full((len(rows), t), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r.get("labels", r["input_ids"]))
        mask[i, :n] = 1
    return ids, labels, mask


def eval_loss(model, rows):
    """The loss of the whole eval set: one right-padded batch, summed token cross-entropy
    over its label tokens."""
    with torch.no_grad():
        ids, labels, mask = batch(rows)
        logits = model(input_ids=ids, attention_mask=mask).logits
        targets = labels[:, 1:]
        loss_sum = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
            ignore_index=-100, reduction="sum")
        return (loss_sum / (targets != -100).sum()).item()


MXFP4_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def pack_mxfp4(model, model_dir, gen):
    """Rewrites the checkpoint in `model_dir` as OpenAI publishes GPT-OSS: each expert weight
    X (E, C, R) becomes X_blocks (E, R, C/32, 16) uint8, random pairs of e2m1 codes, and
    X_scales (E, R, C/32) uint8, random e8m0 exponents 2^-6 .. 2^-3; config.json gains the
    quantization_config. transformers then loads it (dequantizing, on CPU) into `model`'s
    parameters; returns the dequantized expert tensors as transformers holds them."""
    path = os.path.join(model_dir, "model.safetensors")
    packed = {}
    for name, value in safetensors.torch.load_file(path).items():
        if not name.endswith(MXFP4_EXPERTS):
            packed[name] = value
            continue
        e, c, r = value.shape
        packed[name + "_blocks"] = torch.randint(0, 256, (e, r, c // 32, 16), generator=gen).to(torch.uint8)
        packed[name + "_scales"] = torch.randint(121, 125, (e, r, c // 32), generator=gen).to(torch.uint8)
    safetensors.torch.save_file(packed, path, metadata={"format": "pt"})
    cfg_path = os.path.join(model_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    state = loaded.state_dict()
    model.load_state_dict({n: v.float() for n, v in state.items()})
    return {n: v.contiguous() for n, v in state.items() if n.endswith(MXFP4_EXPERTS)}


def checkpoint_named(model, values, tmp, names=None):
    """`values` (one tensor per named parameter, None where it has none) under the
    checkpoint's names: transformers 5 fuses some families' experts in memory but saves them
    per expert, and wrappers under their legacy names, so the tensors go through
    save_pretrained in place of the parameters. Parameters without a value and buffers
    (NaN while saved) are left out."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    kept = {n: p.data for n, p in params.items()}
    kept_buffers = {n: b.data for n, b in buffers.items()}
    for n, p in params.items():
        p.data = values[n] if values[n] is not None else torch.full_like(p.data, float("nan"))
    for b in buffers.values():
        if b.is_floating_point():
            b.data = torch.full_like(b.data, float("nan"))
    model.save_pretrained(tmp)
    for n, p in params.items():
        p.data = kept[n]
    for n, b in buffers.items():
        b.data = kept_buffers[n]
    saved = safetensors.torch.load_file(os.path.join(tmp, "model.safetensors"))
    saved = {n: t for n, t in saved.items() if t.is_floating_point() and not torch.isnan(t).all()}
    return rename(saved, names)


def rename(tensors, names):
    """Legacy wrapper names (`language_model.model.*`, `vision_tower.*`) to the current ones
    (`model.language_model.*`, `model.vision_tower.*`) when `names` is "current"; Qwen2.5-VL's
    hub names (`model.*`, `visual.*`) to its modules' (`model.language_model.*`,
    `model.visual.*`) when it is "language_model"."""
    if names == "language_model":
        out = {}
        for n, t in tensors.items():
            if n.startswith("visual."):
                n = "model." + n
            elif n.startswith("model."):
                n = "model.language_model." + n[len("model."):]
            out[n] = t
        return out
    if names != "current":
        return tensors
    out = {}
    for n, t in tensors.items():
        if n.startswith("language_model.model."):
            n = "model.language_model." + n[len("language_model.model."):]
        elif n == "language_model.lm_head.weight":
            n = "lm_head.weight"
        elif not n.startswith("model."):
            n = "model." + n
        out[n] = t
    return out


def aux_loss(model, out, mask, targets, world):
    """The router aux term of the loss: the batch split into `world` contiguous slices (one
    micro-batch per worker), each slice's load-balancing loss weighted by its share of the
    label tokens. With world 1 it is transformers' own `aux_loss`."""
    cfg = model.config
    if world == 1:
        return cfg.router_aux_loss_coef * out.aux_loss
    balance = importlib.import_module(type(model).__module__).load_balancing_loss_func
    b, t = mask.shape
    per = b // world
    n = (targets != -100).sum()
    total = 0.0
    for r in range(world):
        rows = slice(r * per, (r + 1) * per)
        logits = tuple(l.view(b, t, -1)[rows].reshape(per * t, -1) for l in out.router_logits)
        aux = balance(logits, model.num_experts, model.num_experts_per_tok, mask[rows])
        total = total + aux * (targets[rows] != -100).sum() / n
    return cfg.router_aux_loss_coef * total


def reference(model, rows, eval_rows, tr, grads_path, world=1, names=None):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tr["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tr["learning_rate"], betas=(tr["beta1"], tr["beta2"]), eps=tr["eps"],
    )
    losses, norms, eval_losses = [], [], []
    for step in range(STEPS):
        ids, labels, mask = batch(rows[step * BATCH:(step + 1) * BATCH])
        out = model(input_ids=ids, attention_mask=mask)
        logits = out.logits
        targets = labels[:, 1:]
        loss_sum = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
            ignore_index=-100, reduction="sum")
        loss = loss_sum / (targets != -100).sum()
        if getattr(model.config, "output_router_logits", False):
            loss = loss + aux_loss(model, out, mask, targets, world)
        loss.backward()
        grads = {n: None if p.grad is None else p.grad.detach().clone().contiguous()
                 for n, p in model.named_parameters()}
        if step == 0 and world > 1:
            tmp = grads_path + ".tmp"
            safetensors.torch.save_file(checkpoint_named(model, grads, tmp, names), grads_path)
            shutil.rmtree(tmp)
        elif step == 0:
            tmp = os.path.join(os.path.dirname(grads_path), "grads0.tmp")
            safetensors.torch.save_file(checkpoint_named(model, grads, tmp, names), grads_path)
            shutil.rmtree(tmp)
            logits_path = os.path.join(os.path.dirname(grads_path), "logits0.safetensors")
            safetensors.torch.save_file({"logits": logits.detach().float().contiguous()}, logits_path)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tr["max_grad_norm"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
        eval_losses.append(eval_loss(model, eval_rows))
    return losses, norms, eval_losses


def build(case):
    """The case's tiny model (float32) and its text config."""
    overrides = case["config"]
    if "rope_parameters" not in overrides:
        overrides = {**overrides, "rope_theta": 10000.0}
    text = {**BASE, **overrides}
    attn = case.get("attn")
    if "wrapper" not in case:
        cfg = transformers.AutoConfig.for_model(case["model_type"], **text)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float(), cfg
    if case["wrapper"] == "mistral3":
        text["model_type"] = case["model_type"]
    cfg = transformers.AutoConfig.for_model(case["wrapper"], text_config=text, vision_config=case["vision"],
                                            **case.get("top", {}))
    model = transformers.AutoModelForImageTextToText.from_config(cfg, attn_implementation=attn).float()
    return model, cfg.get_text_config()


def flatten_qwen2_5_vl_config(path):
    """A transformers 5 Qwen2.5-VL config.json rewritten as the hub's: the text config's keys
    at the top level, its RoPE as `rope_theta` + `rope_scaling` of type mrope."""
    cfg = json.load(open(path))
    text = cfg.pop("text_config")
    text.pop("model_type", None)
    rope = text.pop("rope_parameters")
    for k, v in text.items():
        cfg.setdefault(k, v)
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def save_model(model, case, out):
    """save_pretrained, then the case's renames and config edits."""
    model.save_pretrained(out)
    if case.get("names"):
        path = os.path.join(out, "model.safetensors")
        safetensors.torch.save_file(rename(safetensors.torch.load_file(path), case["names"]), path,
                                    metadata={"format": "pt"})
    if case.get("flat_config"):
        flatten_qwen2_5_vl_config(os.path.join(out, "config.json"))
    if case.get("flat_config") or case.get("names") == "language_model":
        loaded = transformers.AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
        want, got = model.state_dict(), loaded.state_dict()
        assert want.keys() == got.keys(), sorted(set(want) ^ set(got))
        assert all(torch.equal(want[n], got[n]) for n in want), "the hub layout loads as saved"
        assert loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    if case.get("drop_top_keys"):
        path = os.path.join(out, "config.json")
        cfg = json.load(open(path))
        for k in case["drop_top_keys"]:
            cfg.pop(k, None)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)


# Learning-rate schedules through transformers' own get_scheduler (HF Trainer's path), as
# HF-named config keys and the rate of the update after each number of completed steps
# (launcher/tests/schedules.rs loads the same keys and compares).
SCHEDULES = [
    {"lr_scheduler_type": "linear", "learning_rate": 3e-5, "warmup_steps": 3, "max_steps": 12},
    {"lr_scheduler_type": "constant_with_warmup", "learning_rate": 1e-4, "warmup_steps": 4, "max_steps": 8},
    {"lr_scheduler_type": "cosine", "learning_rate": 2e-5, "warmup_steps": 3, "max_steps": 20},
    {"lr_scheduler_type": "cosine", "learning_rate": 2e-5, "warmup_steps": 0, "max_steps": 9,
     "lr_scheduler_kwargs": {"num_cycles": 1.5}},
    {"lr_scheduler_type": "cosine_with_min_lr", "learning_rate": 1e-5, "warmup_steps": 2, "max_steps": 15,
     "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
    {"lr_scheduler_type": "cosine_with_min_lr", "learning_rate": 1e-5, "warmup_steps": 0, "max_steps": 10,
     "lr_scheduler_kwargs": {"min_lr": 1e-6, "num_cycles": 1.0}},
    {"lr_scheduler_type": "warmup_stable_decay", "learning_rate": 1e-4, "warmup_steps": 3, "max_steps": 20,
     "lr_scheduler_kwargs": {"num_decay_steps": 5}},
    {"lr_scheduler_type": "warmup_stable_decay", "learning_rate": 1e-4, "warmup_steps": 3, "max_steps": 16,
     "lr_scheduler_kwargs": {"num_decay_steps": 5, "num_stable_steps": 4, "warmup_type": "cosine",
                             "decay_type": "1-sqrt", "min_lr_ratio": 0.05}},
    {"lr_scheduler_type": "warmup_stable_decay", "learning_rate": 1e-4, "warmup_steps": 4, "max_steps": 14,
     "lr_scheduler_kwargs": {"num_decay_steps": 6, "warmup_type": "1-sqrt", "decay_type": "linear",
                             "min_lr_ratio": 0.2}},
]


def make_mrope(out):
    """Qwen2.5-VL's image rows (OUT/mrope/): three right-padded rows, two with two images of
    different grids each, one of text only. rope_index.json: the ids, real lengths, grids
    and transformers' `get_rope_index` positions (3, B, T) and deltas. lm.safetensors: the
    same rows through the tiny `qwen2_5_vl_wrapper` model (model/), random features in place
    of its vision tower's output (its `get_image_features` replaced), so transformers itself
    places them and computes the positions: the step-0 logits (B, T, V)."""
    out = os.path.join(out, "mrope")
    os.makedirs(out, exist_ok=True)
    case = CASES["qwen2_5_vl_wrapper"]
    torch.manual_seed(1234)
    model, _ = build(case)
    model.eval()
    model.save_pretrained(os.path.join(out, "model"))
    top = QWEN2_5_VL_TOP
    img, start, end = top["image_token_id"], top["vision_start_token_id"], top["vision_end_token_id"]
    merge = model.config.vision_config.spatial_merge_size
    gen = torch.Generator().manual_seed(5)
    text = lambda n: torch.randint(0, start, (n,), generator=gen).tolist()  # noqa: E731
    grids = [[1, 4, 6], [1, 6, 2], [1, 2, 2], [1, 8, 4]]
    image = lambda g: [start] + [img] * (g[0] * (g[1] // merge) * (g[2] // merge)) + [end]  # noqa: E731
    rows = [
        text(3) + image(grids[0]) + text(2) + image(grids[1]) + text(1),
        text(9),
        text(1) + image(grids[2]) + text(2) + image(grids[3]) + text(4),
    ]
    b, t = len(rows), max(len(r) for r in rows) + 1
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    types = (ids == img).int()
    grid_thw = torch.tensor(grids)
    with torch.no_grad():
        pos, deltas = model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid_thw,
                                                 attention_mask=mask)
    with open(os.path.join(out, "rope_index.json"), "w") as f:
        json.dump({"input_ids": ids.flatten().tolist(), "row_lens": [len(r) for r in rows], "seq_len": t,
                   "grids": grids, "image_token_id": img, "spatial_merge_size": merge,
                   "position_ids": pos.flatten().tolist(), "deltas": deltas.flatten().tolist(),
                   "transformers": transformers.__version__}, f)
    n_img = int(types.sum())
    features = torch.randn(n_img, model.config.text_config.hidden_size, generator=gen)
    sizes = [g[0] * g[1] * g[2] // merge ** 2 for g in grids]

    def tower(pixel_values, image_grid_thw=None, **kwargs):
        return transformers.modeling_outputs.BaseModelOutputWithPooling(
            pooler_output=torch.split(features, sizes))

    model.model.get_image_features = tower
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, pixel_values=torch.zeros(1, 1),
                       image_grid_thw=grid_thw, mm_token_type_ids=types).logits
        again = model(inputs_embeds=model.get_input_embeddings()(ids).masked_scatter(
            types.bool().unsqueeze(-1), features), position_ids=pos, attention_mask=mask).logits
    assert torch.equal(logits, again), "the tower's output placed and positioned as transformers does"
    safetensors.torch.save_file({
        "input_ids": ids, "row_lens": torch.tensor([len(r) for r in rows]), "grids": grid_thw,
        "features": features, "position_ids": pos, "logits": logits.float().contiguous(),
    }, os.path.join(out, "lm.safetensors"))
    print(f"mrope: {b} rows of {t}, {len(grids)} images, {n_img} image tokens")


def make_schedules(out):
    os.makedirs(out, exist_ok=True)
    cases = []
    for case in SCHEDULES:
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.AdamW([p], lr=case["learning_rate"])
        sched = transformers.get_scheduler(
            case["lr_scheduler_type"], opt, num_warmup_steps=case["warmup_steps"],
            num_training_steps=case["max_steps"], scheduler_specific_kwargs=case.get("lr_scheduler_kwargs"))
        lrs = []
        for _ in range(case["max_steps"] + 3):
            lrs.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        cases.append({"config": case, "lrs": lrs})
    with open(os.path.join(out, "schedules.json"), "w") as f:
        json.dump({"cases": cases, "transformers": transformers.__version__}, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    import golden_dpo  # noqa: E402 (it imports this module's helpers)
    import golden_grpo  # noqa: E402

    staged = {f"dpo/{n}" for n in golden_dpo.DPO_CASES} | {f"grpo/{n}" for n in golden_grpo.GRPO_CASES}
    staged.add("schedules")
    staged.add("mrope")
    staged.add("vision/qwen2_5_vl")
    staged.add("vision/qwen3_vl")
    staged.add("vision/qwen3_5")
    staged.add("vision/gemma3")
    staged.add("vision/llava_next")
    only = set(args.cases.split(",")) if args.cases else set(CASES) | staged
    if only - set(CASES) - staged:
        raise SystemExit(f"unknown cases: {sorted(only - set(CASES) - staged)}")
    if "schedules" in only:
        make_schedules(os.path.join(args.out, "schedules"))
    if "mrope" in only:
        make_mrope(args.out)
    if "vision/qwen2_5_vl" in only:  # worker/src/model/qwen2_vl_vision
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_vlm_model_fixtures.py")
        subprocess.run([sys.executable, script, "--out", args.out], check=True)
    if "vision/qwen3_vl" in only:  # worker/src/model/qwen3_vl_vision
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_vlm_model_fixtures.py")
        subprocess.run([sys.executable, script, "--out", args.out, "--family", "qwen3_vl"], check=True)
    if "vision/qwen3_5" in only:  # worker/src/model/qwen3_vl_vision, no deepstack
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_vlm_model_fixtures.py")
        subprocess.run([sys.executable, script, "--out", args.out, "--family", "qwen3_5"], check=True)
    if "vision/gemma3" in only:  # worker/src/model/siglip_vision
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_vlm_model_fixtures.py")
        subprocess.run([sys.executable, script, "--out", args.out, "--family", "gemma3"], check=True)
    if "vision/llava_next" in only:  # worker/src/model/clip_vision
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_vlm_model_fixtures.py")
        subprocess.run([sys.executable, script, "--out", args.out, "--family", "llava_next"], check=True)
    for name, case in golden_dpo.DPO_CASES.items():
        if f"dpo/{name}" in only:
            golden_dpo.make_case(args.out, name, case)
    for name, case in golden_grpo.GRPO_CASES.items():
        if f"grpo/{name}" in only:
            golden_grpo.make_case(args.out, name, case)
    for name, case in CASES.items():
        if name not in only:
            continue
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        torch.manual_seed(1234)
        model, cfg = build(case)
        # Non-trivial norm weights and biases, so their gradients and updates are checked.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn_like(p))
                for part, factor in case.get("scale", {}).items():
                    if part in n:
                        p.mul_(factor)
            for n, b in model.named_buffers():
                for part, std in case.get("buffers", {}).items():
                    if part in n:
                        b.copy_(std * torch.randn_like(b))
        save_model(model, case, os.path.join(out, "model"))
        if case.get("mxfp4"):
            dequantized = pack_mxfp4(model, os.path.join(out, "model"), torch.Generator().manual_seed(7))
            safetensors.torch.save_file(dequantized, os.path.join(out, "dequantized.safetensors"))
        gen = torch.Generator().manual_seed(99)
        rows = make_rows(gen, cfg.vocab_size, case.get("row_len"))
        with open(os.path.join(out, "data.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        eval_rows = make_rows(torch.Generator().manual_seed(7), cfg.vocab_size, case.get("row_len"))[:EVAL_ROWS]
        with open(os.path.join(out, "eval.jsonl"), "w") as f:
            for r in eval_rows:
                f.write(json.dumps(r) + "\n")
        tr = {**TRAIN, **case.get("train", {})}
        if getattr(cfg, "output_router_logits", False):
            losses, norms, evals = reference(
                copy.deepcopy(model), rows, eval_rows, tr, os.path.join(out, "grads0_w2.safetensors"), 2)
            with open(os.path.join(out, "expected_w2.json"), "w") as f:
                json.dump({"losses": losses, "grad_norms": norms, "eval_losses": evals}, f, indent=1)
        losses, norms, evals = reference(model, rows, eval_rows, tr, os.path.join(out, "grads0.safetensors"),
                                         names=case.get("names"))
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump({"losses": losses, "grad_norms": norms, "eval_losses": evals,
                       "transformers": transformers.__version__, "torch": torch.__version__}, f, indent=1)
        with open(os.path.join(out, "run.yaml"), "w") as f:
            f.write(f"""# generated by scripts/make_golden.py
model: {{path: model, init: pretrained, dtype: float32}}
dataset: {{format: tokenized, path: data.jsonl, shuffle: false}}
training:
  batch_size: {BATCH}
  num_steps: {STEPS}
  learning_rate: {tr['learning_rate']}
  weight_decay: {tr['weight_decay']}
  max_grad_norm: {tr['max_grad_norm']}
optimizer: {{beta1: {tr['beta1']}, beta2: {tr['beta2']}, eps: {tr['eps']}}}
""")
        print(f"{name}: losses {['%.5f' % l for l in losses]}")


if __name__ == "__main__":
    main()
