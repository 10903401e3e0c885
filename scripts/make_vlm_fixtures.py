#!/usr/bin/env python3
"""Vision-language data fixtures (issue #49): LlamaFactory-format multimodal records (sharegpt
`messages` with `<image>` placeholders, an `images` column of paths relative to the dataset
directory) and the rows transformers' Qwen2VLProcessor makes of them, for
src/data/qwen_vl/tests.rs to compare with ours token for token.

Written under OUT/vlm: images of odd sizes (PNG, JPEG, WebP, written by PIL), the records and
their dataset_info.json, model-qwen2vl (the tiny demo tokenizer with Qwen2-VL's vision special
tokens added, and a preprocessor_config.json with a small max_pixels so that one image is
scaled down), and expected_qwen2vl.jsonl: per record, input_ids and labels (the assistant
answers, as make_data_fixtures.py labels them), plus each image's (width, height) and
image_grid_thw. model-qwen3vl and expected_qwen3vl.jsonl are the same for Qwen3-VL: its
processor (`Qwen3VLProcessor`) over the same image processor class with Qwen3-VL's settings
(16-pixel patches, mean and std 0.5, the pixel bounds in `size`), fewer tokens per image.
model-qwen3_5 and expected_qwen3_5.jsonl: Qwen3.5, whose processor AutoProcessor also makes a
`Qwen3VLProcessor` over `Qwen2VLImageProcessor` (checked against transformers' auto mappings),
with the settings of Qwen/Qwen3.5-27B's preprocessor_config.json but the fixture's pixel
bounds (the pixel fixtures' qwen3vl settings, so the same pixel check covers it).

The ids are the processor's: each `<image>` becomes `<|vision_start|><|image_pad|><|vision_end|>`
(LlamaFactory's Qwen2-VL plugin text before the processor), the conversation is rendered with
the chat template, and `Qwen2VLProcessor(text, images)` expands each `<|image_pad|>` to its
grid's count. The labels come from rendering the expanded messages (the same text, checked).

Usage: .venv/bin/python scripts/make_vlm_fixtures.py --out target/data-fixtures
(make_data_fixtures.py calls it; it calls make_pixel_fixtures.py, make_vlm_golden.py, Gemma 3's
make_vlm_gemma3_fixtures.py and make_vlm_golden_gemma3.py, and LLaVA-NeXT's
make_vlm_llava_next_fixtures.py and make_vlm_golden_llava_next.py.)
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

from PIL import Image
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_processing_utils import BaseVideoProcessor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
MAX_PIXELS = 200_704  # 256 tokens' worth (16 x 16 merged patches of 28 x 28)
# Qwen3-VL: merged patches of 32 x 32; at most 48 tokens an image, at least 4.
QWEN3VL_SIZE = {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 48}

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
out = os.path.join(os.path.abspath(ap.parse_args().out), "vlm")
shutil.rmtree(out, ignore_errors=True)
os.makedirs(os.path.join(out, "images"))

# Images: (file, width, height); one wide, one tall, one below min_pixels, one above max_pixels.
IMAGES = [("a.png", 77, 45), ("b.jpg", 300, 113), ("c.webp", 61, 190), ("d.png", 20, 9),
          ("e.jpg", 700, 500)]
for i, (name, w, h) in enumerate(IMAGES):
    img = Image.new("RGB", (w, h), (40 * i % 256, 90, 200 - 30 * i))
    # WebP lossless (lossy WebP's pixels are checked against Pillow's in make_pixel_fixtures.py).
    img.save(os.path.join(out, "images", name), **({"lossless": True} if name.endswith(".webp") else {}))

model = os.path.join(out, "model-qwen2vl")
tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "configs/tiny"))
tok.add_special_tokens({"additional_special_tokens": VISION})
tok.save_pretrained(model)
tok = AutoTokenizer.from_pretrained(model)
improc = Qwen2VLImageProcessorPil(max_pixels=MAX_PIXELS)
with open(os.path.join(model, "preprocessor_config.json"), "w") as f:
    json.dump({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
               "temporal_patch_size": 2, "min_pixels": 56 * 56, "max_pixels": MAX_PIXELS}, f, indent=2)
# No video here: the base video processor stands in (Qwen's needs torchvision, absent offline),
# and without torchvision transformers' class check takes it for a stub, so it is skipped.
Qwen2VLProcessor.check_argument_for_proper_class = lambda self, name, arg: type(arg)
proc = Qwen2VLProcessor(image_processor=improc, tokenizer=tok, video_processor=BaseVideoProcessor(),
                        chat_template=tok.chat_template)

RECORDS = [
    ([("user", "<image>What is in this picture?"), ("assistant", "A flat colour.")], ["a.png"]),
    ([("system", "Describe images."), ("user", "Compare <image> and <image>, please."),
      ("assistant", "The second is wider.")], ["b.jpg", "images/c.webp"]),
    ([("user", "<image>Tiny?"), ("assistant", "Yes."), ("user", "And this: <image>"),
      ("assistant", "Large, scaled down.")], ["d.png", "e.jpg"]),
    ([("user", "No image here."), ("assistant", "Text only.")], []),
]


def rel(p):
    return p if p.startswith("images/") else "images/" + p


records = []
for turns, imgs in RECORDS:
    records.append({"messages": [{"role": r, "content": c} for r, c in turns],
                    "images": [rel(p) for p in imgs]})
with open(os.path.join(out, "mllm.json"), "w") as f:
    json.dump(records, f, indent=2)
with open(os.path.join(out, "dataset_info.json"), "w") as f:
    json.dump({"mllm_demo": {"file_name": "mllm.json", "formatting": "sharegpt",
                             "columns": {"messages": "messages", "images": "images"},
                             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                      "assistant_tag": "assistant", "system_tag": "system"}}}, f, indent=2)


def labelled(msgs):
    """input_ids and labels of the rendered messages (labels on the assistant answers)."""
    full = tok.apply_chat_template(msgs, tokenize=False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            turn = tok.apply_chat_template(msgs[: i + 1], tokenize=False)
            spans.append((len(prompt), len(turn)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [t if any(a <= s < b for a, b in spans) else -100
              for t, (s, _) in zip(enc["input_ids"], enc["offset_mapping"])]
    return full, enc["input_ids"], labels


def expected(proc, merge, name):
    """The processor's rows of every record, checked against our expansion of the text."""
    f = open(os.path.join(out, name), "w")
    for rec in records:
        pil = [Image.open(os.path.join(out, p)).convert("RGB") for p in rec["images"]]
        one = "".join(VISION[i] for i in (0, 2, 1))
        msgs = [{"role": m["role"], "content": m["content"].replace("<image>", one)} for m in rec["messages"]]
        text = tok.apply_chat_template(msgs, tokenize=False)
        enc = proc(text=[text], images=pil or None)
        ids = [int(i) for i in enc["input_ids"][0]]
        grids = [[int(x) for x in g] for g in enc["image_grid_thw"]] if pil else []
        counts = iter([t * h * w // merge ** 2 for t, h, w in grids])
        expanded = []
        for m in rec["messages"]:
            parts = m["content"].split("<image>")
            c = parts[0] + "".join(VISION[0] + VISION[2] * next(counts) + VISION[1] + p for p in parts[1:])
            expanded.append({"role": m["role"], "content": c})
        full, ours, labels = labelled(expanded)
        assert ours == ids, "the expanded text's ids differ from the processor's"
        f.write(json.dumps({"input_ids": ids, "labels": labels, "grids": grids,
                            "sizes": [list(im.size) for im in pil]}) + "\n")
    f.close()


expected(proc, 2, "expected_qwen2vl.jsonl")

# Qwen3-VL: the same tokenizer, its own processor settings as the hub's preprocessor_config.json
# spells them (`size`, not min/max_pixels).
model3 = os.path.join(out, "model-qwen3vl")
shutil.copytree(model, model3)
cfg3 = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
        "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "size": QWEN3VL_SIZE,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
with open(os.path.join(model3, "preprocessor_config.json"), "w") as f:
    json.dump(cfg3, f, indent=2)
Qwen3VLProcessor.check_argument_for_proper_class = lambda self, name, arg: type(arg)
improc3 = Qwen2VLImageProcessorPil.from_pretrained(model3)
assert improc3.patch_size == 16 and improc3.size["longest_edge"] == QWEN3VL_SIZE["longest_edge"]
proc3 = Qwen3VLProcessor(image_processor=improc3, tokenizer=tok, video_processor=BaseVideoProcessor(),
                         chat_template=tok.chat_template)
expected(proc3, 2, "expected_qwen3vl.jsonl")

# Qwen3.5: the processor classes transformers' auto mappings give a `qwen3_5` checkpoint (the
# video processor, which needs torchvision, stands in as above).
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES  # noqa: E402
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES  # noqa: E402
assert PROCESSOR_MAPPING_NAMES["qwen3_5"] == "Qwen3VLProcessor", PROCESSOR_MAPPING_NAMES["qwen3_5"]
assert IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_5"]["pil"] == "Qwen2VLImageProcessorPil"
model35 = os.path.join(out, "model-qwen3_5")
shutil.copytree(model, model35)
with open(os.path.join(model35, "preprocessor_config.json"), "w") as f:
    json.dump(cfg3, f, indent=2)
improc35 = Qwen2VLImageProcessorPil.from_pretrained(model35)
proc35 = Qwen3VLProcessor(image_processor=improc35, tokenizer=tok, video_processor=BaseVideoProcessor(),
                          chat_template=tok.chat_template)
expected(proc35, 2, "expected_qwen3_5.jsonl")
print(f"vlm fixtures: {len(records)} records, {len(IMAGES)} images, Qwen2VLProcessor (max_pixels {MAX_PIXELS}),"
      f" Qwen3VLProcessor ({QWEN3VL_SIZE}) for Qwen3-VL and Qwen3.5")

# The pixels: decoded images and the image processor's pixel_values (OUT/vlm/pixels).
subprocess.run([sys.executable, os.path.join(ROOT, "scripts/make_pixel_fixtures.py"),
                "--out", os.path.dirname(out)], check=True)

# The end-to-end golden case on these records (OUT/vlm/golden).
subprocess.run([sys.executable, os.path.join(ROOT, "scripts/make_vlm_golden.py"),
                "--dir", os.path.dirname(out)], check=True)

# Gemma 3: the same records through its processor and chat template (OUT/vlm/model-gemma3,
# expected_gemma3.jsonl), then its end-to-end golden case (OUT/vlm/golden-gemma3); LLaVA-NeXT's
# likewise (model-llava_next, expected_llava_next.jsonl, golden-llava_next).
for script in ("make_vlm_gemma3_fixtures.py", "make_vlm_golden_gemma3.py", "make_vlm_llava_next_fixtures.py",
               "make_vlm_golden_llava_next.py"):
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), "--dir", os.path.dirname(out)],
                   check=True)
