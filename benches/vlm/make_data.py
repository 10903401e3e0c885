#!/usr/bin/env python3
"""Data for the vision-language speed bench (issue #49): LlamaFactory-format records whose
rows are 1024 tokens each with two 448x448 images, and the same number of text-only rows of
1024 tokens, for benches/vlm/run.sh.

Written under OUT: images/ (16 PNGs, 448x448: 32x32 patches of 14, 256 tokens after the 2x2
merge), mllm.json (each row: two images + text filling the row), text.json (text only),
dataset_info.json naming both (`bench_mllm`, `bench_text`), and tokenizer/ (the tiny demo
tokenizer with Qwen2-VL's vision tokens, the chat template, a preprocessor_config.json whose
max_pixels keeps 448x448 as it is). Row lengths are counted with that tokenizer and template
as the launcher counts them: the rendered text, each `<image>` as <|vision_start|>, 256
<|image_pad|>, <|vision_end|>.

Usage: .venv/bin/python benches/vlm/make_data.py --out target/bench-vlm [--rows 256]
"""
import argparse
import json
import os
import random
import shutil

from PIL import Image
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
SIDE, TOKENS_PER_IMAGE, ROW = 448, 256, 1024
WORDS = ("the a shape colour red green blue circle square line left right top bottom large small "
         "bright dark edge corner centre picture image shows with and of near far above below").split()

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--rows", type=int, default=256)
args = ap.parse_args()
out = os.path.abspath(args.out)
shutil.rmtree(out, ignore_errors=True)
os.makedirs(os.path.join(out, "images"))

tok_dir = os.path.join(out, "tokenizer")
tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "configs/tiny"))
tok.add_special_tokens({"additional_special_tokens": VISION})
tok.save_pretrained(tok_dir)
tok = AutoTokenizer.from_pretrained(tok_dir)
with open(os.path.join(tok_dir, "preprocessor_config.json"), "w") as f:
    json.dump({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
               "temporal_patch_size": 2, "min_pixels": 56 * 56, "max_pixels": SIDE * SIDE}, f, indent=2)

rng = random.Random(49)
names = []
for i in range(16):  # smooth colour fields with a little noise: small files, real decode work
    img = Image.new("RGB", (SIDE, SIDE))
    px = img.load()
    for y in range(SIDE):
        for x in range(SIDE):
            px[x, y] = ((x * (i + 1)) % 256, (y * 3 + i * 20) % 256, (x + y + rng.randrange(16)) % 256)
    names.append(f"images/{i:02d}.png")
    img.save(os.path.join(out, names[-1]))


def length(messages, images):
    """The row's tokens: the rendered conversation, each image expanded to its pads."""
    one = "".join(VISION[i] for i in (0, 2, 1))
    msgs = [{"role": m["role"], "content": m["content"].replace("<image>", one)} for m in messages]
    n = len(tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"])
    return n + images * (TOKENS_PER_IMAGE - 1)


def row(images):
    """A conversation of at most ROW tokens, as close to it as whole words allow."""
    words = [rng.choice(WORDS) for _ in range(2000)]
    prefix = "<image>" * images

    def make(n):
        q, a = n * 3 // 4, n - n * 3 // 4
        return [{"role": "user", "content": prefix + " ".join(words[:q])},
                {"role": "assistant", "content": " ".join(words[q:q + a])}]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words that fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if length(make(mid), images) <= ROW else (lo, mid - 1)
    return make(lo), length(make(lo), images)


mllm, text, lens = [], [], []
for r in range(args.rows):
    msgs, n = row(2)
    mllm.append({"messages": msgs, "images": [names[(2 * r) % 16], names[(2 * r + 1) % 16]]})
    tmsgs, m = row(0)
    text.append({"messages": tmsgs})
    lens.append((n, m))
for name, recs in (("mllm.json", mllm), ("text.json", text)):
    with open(os.path.join(out, name), "w") as f:
        json.dump(recs, f)
tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
        "system_tag": "system"}
with open(os.path.join(out, "dataset_info.json"), "w") as f:
    json.dump({"bench_mllm": {"file_name": "mllm.json", "formatting": "sharegpt",
                              "columns": {"messages": "messages", "images": "images"}, "tags": tags},
               "bench_text": {"file_name": "text.json", "formatting": "sharegpt",
                              "columns": {"messages": "messages"}, "tags": tags}}, f, indent=2)
print(f"bench data: {args.rows} rows with 2 images ({min(a for a, _ in lens)}-{max(a for a, _ in lens)} tokens), "
      f"{args.rows} text-only ({min(b for _, b in lens)}-{max(b for _, b in lens)} tokens) under {out}")
