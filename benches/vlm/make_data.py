#!/usr/bin/env python3
"""Data for the vision-language speed bench (issue #49): LlamaFactory-format records whose
rows are ROW tokens each with two images, and the same number of text-only rows of ROW
tokens, for benches/vlm/run.sh, for one family (`--family`, default qwen2_5_vl):

  family      images          tokens per image                                 ROW
  qwen2_5_vl  448 x 448       256 (32 x 32 patches of 14, merged 2 x 2)        1024
  qwen3_vl    448 x 448       196 (28 x 28 patches of 16, merged 2 x 2)        1024
  qwen3_5     448 x 448       196 (as Qwen3-VL: its processor is Qwen3VLProcessor) 1024
  gemma3      896 x 896       256 soft tokens (+ the blank lines, boi and eoi)  1024
  llava_next  336 x 336       1176 (the base tile's 576, then the 336 x 672     3072
                              pinpoint's 2 tiles unpadded to 24 x 24 patches,
                              each row with its newline: 24 x 25); 3 tiles of
                              336 x 336 through the tower

LLaVA-NeXT has no image under 1,160 tokens (the base tile's 576 and at least two tiles of
the pinpoints, unpadded), so two images do not fit a row of 1024: its rows are 3072 tokens
(2 x 1176 image tokens, the rest text), text-only rows likewise. 336 x 336, the tower's own
tile, is the smallest image that takes the fewest tiles (3) and tokens short of extreme
aspect ratios.

Written under OUT: images/ (16 PNGs of the family's size), mllm.json (each row: two images +
text filling the row), text.json (text only), dataset_info.json naming both (`bench_mllm`,
`bench_text`), and tokenizer/: the tiny demo tokenizer (configs/tiny) with the family's
vision tokens (Qwen's <|vision_start|>, <|vision_end|>, <|image_pad|>; Gemma 3's
<start_of_image>, <image_soft_token>, <end_of_image> and turn markers; LLaVA-NeXT's
<image>), the chat template (the tiny ChatML one; Gemma 3's own, which trims each message
and so must come before the image expansion, as its processor does), a
preprocessor_config.json whose size keeps the images as they are (Qwen) or is the tower's
(Gemma 3, LLaVA-NeXT), and processor_config.json (Gemma 3: image_seq_length; LLaVA-NeXT:
image_token, patch_size, the feature strategy). Row lengths are counted with that tokenizer
and template as the launcher counts them (src/data/qwen_vl.rs, gemma3_vl.rs,
llava_next.rs); each family's per-image count is checked against transformers' image
processor or processor.

Usage: .venv/bin/python benches/vlm/make_data.py --out target/bench-vlm [--family F] [--rows 256]
"""
import argparse
import json
import os
import random
import shutil
import sys

from PIL import Image
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from fixture_templates import GEMMA3  # noqa: E402

VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
BOI, SOFT, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
IMAGE = "<image>"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# family: (image side, tokens per image, row tokens, the model's config).
FAMILIES = {
    "qwen2_5_vl": (448, 256, 1024, "configs/qwen2.5-vl-7b/config.json"),
    "qwen3_vl": (448, 196, 1024, "configs/qwen3-vl-8b/config.json"),
    "qwen3_5": (448, 196, 1024, "configs/qwen3.5-27b/config.json"),
    "gemma3": (896, 256, 1024, "configs/gemma3-27b/config.json"),
    "llava_next": (336, 1176, 3072, "configs/llava-next-7b/config.json"),
}
WORDS = ("the a shape colour red green blue circle square line left right top bottom large small "
         "bright dark edge corner centre picture image shows with and of near far above below").split()

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--family", default="qwen2_5_vl", choices=sorted(FAMILIES))
ap.add_argument("--rows", type=int, default=256)
args = ap.parse_args()
family = args.family
SIDE, TOKENS_PER_IMAGE, ROW, CONFIG = FAMILIES[family]
model_cfg = json.load(open(os.path.join(ROOT, CONFIG)))
out = os.path.abspath(args.out)
shutil.rmtree(out, ignore_errors=True)
os.makedirs(os.path.join(out, "images"))


def write_json(name, obj):
    with open(os.path.join(tok_dir, name), "w") as f:
        json.dump(obj, f, indent=2)


tok_dir = os.path.join(out, "tokenizer")
tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "configs/tiny"))
special = {"gemma3": [BOI, SOFT, EOI, "<start_of_turn>", "<end_of_turn>"], "llava_next": [IMAGE]}
tok.add_special_tokens({"additional_special_tokens": special.get(family, VISION)})
if family == "gemma3":
    tok.chat_template = GEMMA3
tok.save_pretrained(tok_dir)
if family == "gemma3":  # the processor's boi / image / eoi tokens, as the hub's tokenizer names them
    path = os.path.join(tok_dir, "tokenizer_config.json")
    tok_cfg = json.load(open(path))
    tok_cfg["extra_special_tokens"] = {"boi_token": BOI, "image_token": SOFT, "eoi_token": EOI}
    write_json("tokenizer_config.json", tok_cfg)
tok = AutoTokenizer.from_pretrained(tok_dir)

if family == "qwen2_5_vl":
    write_json("preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2, "min_pixels": 56 * 56, "max_pixels": SIDE * SIDE})
elif family in ("qwen3_vl", "qwen3_5"):  # the hub's Qwen3-VL / Qwen3.5 settings
    write_json("preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
        "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})
elif family == "gemma3":  # google/gemma-3-27b-it's
    write_json("preprocessor_config.json", {
        "image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": None, "do_normalize": True,
        "do_pan_and_scan": None, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "resample": 2, "rescale_factor": 1 / 255,
        "size": {"height": SIDE, "width": SIDE}})
    write_json("processor_config.json", {"image_seq_length": TOKENS_PER_IMAGE,
                                         "processor_class": "Gemma3Processor"})
else:  # llava_next: llava-hf/llava-v1.6-mistral-7b-hf's
    tile = model_cfg["vision_config"]["image_size"]
    write_json("preprocessor_config.json", {
        "image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor",
        "aspect_ratio_setting": "anyres", "crop_size": {"height": tile, "width": tile},
        "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_pad": True,
        "do_rescale": True, "do_resize": True, "image_grid_pinpoints": model_cfg["image_grid_pinpoints"],
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "resample": 3, "rescale_factor": 1 / 255,
        "size": {"shortest_edge": tile}})
    write_json("processor_config.json", {
        "image_token": IMAGE, "num_additional_image_tokens": 1,
        "patch_size": model_cfg["vision_config"]["patch_size"], "processor_class": "LlavaNextProcessor",
        "vision_feature_select_strategy": "default"})

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


def check_tokens_per_image():
    """TOKENS_PER_IMAGE against transformers' own count for one of the images."""
    img = Image.open(os.path.join(out, names[0])).convert("RGB")
    pre = json.load(open(os.path.join(tok_dir, "preprocessor_config.json")))
    keep = {k: v for k, v in pre.items() if k not in ("image_processor_type", "processor_class",
                                                       "aspect_ratio_setting")}
    if family.startswith("qwen"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        t, h, w = Qwen2VLImageProcessorPil(**keep)(images=[img])["image_grid_thw"][0].tolist()
        got = t * h * w // pre["merge_size"] ** 2
    elif family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
        from transformers.models.gemma3.processing_gemma3 import Gemma3Processor
        proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(**keep), tokenizer=tok,
                               chat_template=GEMMA3, image_seq_length=TOKENS_PER_IMAGE)
        assert proc.full_image_sequence == image_sequence(), proc.full_image_sequence
        got = model_cfg["mm_tokens_per_image"]
    else:
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
        from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor
        proc_cfg = json.load(open(os.path.join(tok_dir, "processor_config.json")))
        proc = LlavaNextProcessor(image_processor=LlavaNextImageProcessorPil(**keep), tokenizer=tok,
                                  **{k: v for k, v in proc_cfg.items() if k != "processor_class"})
        tile = model_cfg["vision_config"]["image_size"]
        got = proc._get_number_of_features(SIDE, SIDE, tile, tile) - 1  # less the class token
    assert got == TOKENS_PER_IMAGE, f"{family}: transformers counts {got} tokens per image, not {TOKENS_PER_IMAGE}"


def image_sequence():
    """Gemma 3's `full_image_sequence`: what each <start_of_image> of the rendered text becomes."""
    return f"\n\n{BOI}{SOFT * TOKENS_PER_IMAGE}{EOI}\n\n"


def length(messages):
    """The row's tokens: the rendered conversation with each image expanded to its tokens, as
    the launcher expands it (Qwen: in the messages; Gemma 3 and LLaVA-NeXT: in the rendered
    text)."""
    if family.startswith("qwen"):
        one = VISION[0] + VISION[2] * TOKENS_PER_IMAGE + VISION[1]
        msgs = [{"role": m["role"], "content": m["content"].replace(IMAGE, one)} for m in messages]
        text = tok.apply_chat_template(msgs, tokenize=False)
    elif family == "gemma3":
        msgs = [{"role": m["role"], "content": m["content"].replace(IMAGE, BOI)} for m in messages]
        text = tok.apply_chat_template(msgs, tokenize=False).replace(BOI, image_sequence())
    else:
        text = tok.apply_chat_template(messages, tokenize=False).replace(IMAGE, IMAGE * TOKENS_PER_IMAGE)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def row(images):
    """A conversation of at most ROW tokens, as close to it as whole words allow."""
    words = [rng.choice(WORDS) for _ in range(2000 * ROW // 1024)]
    prefix = IMAGE * images

    def make(n):
        q, a = n * 3 // 4, n - n * 3 // 4
        return [{"role": "user", "content": prefix + " ".join(words[:q])},
                {"role": "assistant", "content": " ".join(words[q:q + a])}]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words that fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if length(make(mid)) <= ROW else (lo, mid - 1)
    return make(lo), length(make(lo))


check_tokens_per_image()
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
with open(os.path.join(out, "bench.json"), "w") as f:  # what run.sh reads back
    json.dump({"family": family, "side": SIDE, "tokens_per_image": TOKENS_PER_IMAGE, "row": ROW}, f)
print(f"bench data ({family}): {args.rows} rows with 2 images of {SIDE}x{SIDE}, {TOKENS_PER_IMAGE} tokens each "
      f"({min(a for a, _ in lens)}-{max(a for a, _ in lens)} tokens), {args.rows} text-only "
      f"({min(b for _, b in lens)}-{max(b for _, b in lens)} tokens) under {out}")
