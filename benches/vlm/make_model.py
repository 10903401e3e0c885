#!/usr/bin/env python3
"""A random-init vision-language model directory of a given architecture for the speed bench
(benches/vlm/run.sh): every tensor transformers' class for the config's `model_type` has
(Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration,
Qwen3_5ForConditionalGeneration, Gemma3ForConditionalGeneration,
LlavaNextForConditionalGeneration), in its names (built on the meta device, so nothing is
allocated), filled with normal(0, 0.02) values (one block of them, tiled) (norm scales 1,
biases 0) in bf16 and written in safetensors shards; config.json is the given one with the
vision token ids of the bench's tokenizer (whose files are copied in: make_data.py's
tokenizer/ of the same family).

--layers N keeps the text model's first N layers (Qwen3.5's `layer_types` cut to them).
--small (for trying the bench on CPU only) shrinks the text model to width 512 (4 heads of
128, 2 KV heads, MLP 1024; Qwen3.5's linear attention 2 key and 4 value heads) and the
tower to 2 blocks (Qwen3-VL's deepstack taps to block 1), the vocabulary and the tower's
width kept.

Usage: python3 benches/vlm/make_model.py --config configs/qwen2.5-vl-7b/config.json \
           --tokenizer target/bench-vlm/tokenizer --out /tmp/qwen2.5-vl-7b [--layers N] [--small]
           [--config-only]
Needs torch, transformers and safetensors (the GPU machine has them).
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file
import transformers
from transformers import AutoConfig

ap = argparse.ArgumentParser()
ap.add_argument("--config", required=True)
ap.add_argument("--tokenizer", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the config's)")
ap.add_argument("--small", action="store_true", help="a narrow text model and a 2-block tower (CPU tries)")
ap.add_argument("--config-only", action="store_true",
                help="write config.json and the tokenizer only (enough for `mt-launch plan`)")
args = ap.parse_args()

# model_type: transformers' class; then per family, config key: the tokenizer's token whose id it takes.
FAMILIES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
}
QWEN_IDS = {"image_token_id": "<|image_pad|>", "vision_start_token_id": "<|vision_start|>",
            "vision_end_token_id": "<|vision_end|>"}
TOKEN_IDS = {"gemma3": {"image_token_index": "<image_soft_token>", "boi_token_index": "<start_of_image>",
                        "eoi_token_index": "<end_of_image>"},
             "llava_next": {"image_token_index": "<image>"}}
cfg = json.load(open(args.config))
family = cfg.get("model_type")
if family not in FAMILIES:
    raise SystemExit(f"make_model: {args.config}: model_type {family!r} is not one of {sorted(FAMILIES)}")
if not hasattr(transformers, FAMILIES[family]):
    raise SystemExit(f"make_model: transformers {transformers.__version__} has no {FAMILIES[family]} "
                     f"(model_type {family}): a newer transformers is needed")
tok = json.load(open(os.path.join(args.tokenizer, "tokenizer.json")))
ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
for key, token in TOKEN_IDS.get(family, QWEN_IDS).items():
    if token not in ids:
        raise SystemExit(f"make_model: {args.tokenizer}/tokenizer.json has no {token} ({key}): "
                         f"not the {family} bench tokenizer (make_data.py --family {family})")
    cfg[key] = ids[token]
cfg["torch_dtype"] = "bfloat16"
text = cfg.get("text_config", cfg)
if args.layers:
    text["num_hidden_layers"] = args.layers
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:args.layers]
    if "text_config" not in cfg or "num_hidden_layers" in cfg:
        cfg["num_hidden_layers"] = args.layers
if args.small:
    text.update(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2)
    if "head_dim" in text:
        text["head_dim"] = 128
    if "linear_num_key_heads" in text:
        text.update(linear_num_key_heads=2, linear_num_value_heads=4)
    if "query_pre_attn_scalar" in text:
        text["query_pre_attn_scalar"] = 128
    vision = cfg["vision_config"]
    vision["depth" if "depth" in vision else "num_hidden_layers"] = 2
    if "out_hidden_size" in vision:  # Qwen's merger writes the text width
        vision["out_hidden_size"] = 512
    if vision.get("deepstack_visual_indexes"):
        vision["deepstack_visual_indexes"] = [1]
    if "fullatt_block_indexes" in vision:
        vision["fullatt_block_indexes"] = [1]
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
for name in os.listdir(args.tokenizer):
    shutil.copy(os.path.join(args.tokenizer, name), args.out)
if args.config_only:
    raise SystemExit(0)

with torch.device("meta"):
    model = getattr(transformers, FAMILIES[family])(AutoConfig.from_pretrained(args.out))
# One block of normal(0, 0.02) values, tiled into every matrix from a moving offset: the
# speed does not depend on the values, and filling 8e9 elements this way takes seconds.
gen = torch.Generator().manual_seed(0)
BASE = (torch.randn(1 << 24, generator=gen) * 0.02).to(torch.bfloat16)
shard, size, n, index = {}, 0, 0, {}


def fill(t, at):
    flat = t.view(-1)
    done = 0
    while done < flat.numel():
        k = min(flat.numel() - done, BASE.numel() - at)
        flat[done:done + k] = BASE[at:at + k]
        done, at = done + k, (at + k) % BASE.numel()
    return (at + 7919) % BASE.numel()


def flush():
    global shard, size, n
    if shard:
        n += 1
        name = f"model-{n:05d}.safetensors"
        save_file(shard, os.path.join(args.out, name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        shard, size = {}, 0


total, at, seen = 0, 0, set()
for name, p in model.state_dict(keep_vars=True).items():
    if id(p) in seen:  # a tied weight (Gemma 3's lm_head): the checkpoint holds it once
        continue
    seen.add(id(p))
    t = torch.empty(p.shape, dtype=torch.bfloat16)
    if name.endswith("bias"):
        t.zero_()
    elif p.ndim == 1:
        t.fill_(1.0)
    else:
        at = fill(t, at)
    shard[name] = t
    size += t.numel() * 2
    total += t.numel()
    if size >= 4 << 30:
        flush()
flush()
with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total * 2}, "weight_map": index}, f, indent=1)
print(f"make_model: {family}, {total / 1e9:.2f} B parameters in {n} shards under {args.out}")
