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
  dequantized.safetensors  (MXFP4 cases) the expert weights as transformers dequantizes
                      the packed checkpoint in model/ (bf16), to compare bit for bit

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

import safetensors.torch
import torch
import torch.nn.functional as F
import transformers

STEPS = 3
BATCH = 4
ROWS = 12  # 3 steps x 4 rows, file order

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
#   mxfp4: the checkpoint's expert weights are MXFP4-packed (pack_mxfp4)
# With output_router_logits the loss adds router_aux_loss_coef x transformers' router
# load-balancing loss. Each micro-batch (one per worker here) adds its own aux loss,
# weighted by its share of the batch's label tokens, so the reference depends on the number
# of workers: the 1-worker run is exactly transformers' loss (its `aux_loss` output), and
# expected_w2.json / grads0_w2.safetensors hold the 2-worker reference.
# MoE cases mix sparse and dense layers where the family allows it, so the layout holds
# layers of different structures; hybrid cases mix Gated DeltaNet and attention layers.
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


def checkpoint_named(model, values, tmp):
    """`values` (one tensor per named parameter) under the checkpoint's names: transformers 5
    fuses some families' experts in memory but saves them per expert, so the tensors go
    through save_pretrained in place of the parameters."""
    params = dict(model.named_parameters())
    kept = {n: p.data for n, p in params.items()}
    for n, p in params.items():
        p.data = values[n]
    model.save_pretrained(tmp)
    for n, p in params.items():
        p.data = kept[n]
    return safetensors.torch.load_file(os.path.join(tmp, "model.safetensors"))


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


def reference(model, rows, tr, grads_path, world=1):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tr["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tr["learning_rate"], betas=(tr["beta1"], tr["beta2"]), eps=tr["eps"],
    )
    losses, norms = [], []
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
        if step == 0 and world > 1:
            grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()}
            tmp = grads_path + ".tmp"
            safetensors.torch.save_file(checkpoint_named(model, grads, tmp), grads_path)
            shutil.rmtree(tmp)
        elif step == 0:
            grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()}
            tmp = os.path.join(os.path.dirname(grads_path), "grads0.tmp")
            safetensors.torch.save_file(checkpoint_named(model, grads, tmp), grads_path)
            shutil.rmtree(tmp)
            logits_path = os.path.join(os.path.dirname(grads_path), "logits0.safetensors")
            safetensors.torch.save_file({"logits": logits.detach().float().contiguous()}, logits_path)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tr["max_grad_norm"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    for name, case in CASES.items():
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        torch.manual_seed(1234)
        overrides = case["config"]
        if "rope_parameters" not in overrides:
            overrides = {**overrides, "rope_theta": 10000.0}
        cfg = transformers.AutoConfig.for_model(case["model_type"], **{**BASE, **overrides})
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=case.get("attn")).float()
        # Non-trivial norm weights and biases, so their gradients and updates are checked.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn_like(p))
                for part, factor in case.get("scale", {}).items():
                    if part in n:
                        p.mul_(factor)
        model.save_pretrained(os.path.join(out, "model"))
        if case.get("mxfp4"):
            dequantized = pack_mxfp4(model, os.path.join(out, "model"), torch.Generator().manual_seed(7))
            safetensors.torch.save_file(dequantized, os.path.join(out, "dequantized.safetensors"))
        gen = torch.Generator().manual_seed(99)
        rows = make_rows(gen, cfg.vocab_size, case.get("row_len"))
        with open(os.path.join(out, "data.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        tr = {**TRAIN, **case.get("train", {})}
        if getattr(cfg, "output_router_logits", False):
            losses, norms = reference(copy.deepcopy(model), rows, tr, os.path.join(out, "grads0_w2.safetensors"), 2)
            with open(os.path.join(out, "expected_w2.json"), "w") as f:
                json.dump({"losses": losses, "grad_norms": norms}, f, indent=1)
        losses, norms = reference(model, rows, tr, os.path.join(out, "grads0.safetensors"))
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump({"losses": losses, "grad_norms": norms, "transformers": transformers.__version__,
                       "torch": torch.__version__}, f, indent=1)
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
