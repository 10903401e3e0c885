#!/usr/bin/env python3
"""A random-init Qwen2.5-VL model directory of a given architecture for the speed bench
(benches/vlm/run.sh): every tensor transformers' Qwen2_5_VLForConditionalGeneration has, in
its names (built on the meta device, so nothing is allocated), filled with normal(0, 0.02)
values (one block of them, tiled) (norm scales 1, biases 0) in bf16 and written in safetensors shards; config.json is
the given one with the vision token ids of the bench's tokenizer (whose files are copied in).

Usage: python3 benches/vlm/make_model.py --config configs/qwen2.5-vl-7b/config.json \
           --tokenizer target/bench-vlm/tokenizer --out /tmp/qwen2.5-vl-7b [--layers N]
Needs torch, transformers and safetensors (the GPU machine has them).
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

ap = argparse.ArgumentParser()
ap.add_argument("--config", required=True)
ap.add_argument("--tokenizer", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the config's)")
args = ap.parse_args()

cfg = json.load(open(args.config))
tok = json.load(open(os.path.join(args.tokenizer, "tokenizer.json")))
ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
cfg.update(image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
           vision_end_token_id=ids["<|vision_end|>"], torch_dtype="bfloat16")
if args.layers:
    text = cfg.get("text_config", cfg)
    text["num_hidden_layers"] = args.layers
    cfg["num_hidden_layers"] = args.layers
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
for name in os.listdir(args.tokenizer):
    shutil.copy(os.path.join(args.tokenizer, name), args.out)

with torch.device("meta"):
    model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(args.out))
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


total, at = 0, 0
for name, p in model.state_dict().items():
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
print(f"make_model: {total / 1e9:.2f} B parameters in {n} shards under {args.out}")
