#!/usr/bin/env python3
"""LLaVA-NeXT vision-language data fixtures (issue #49): the multimodal records of
make_vlm_fixtures.py as transformers' LlavaNextProcessor makes them (any-resolution tiles, the
unpadded grid's tokens and a newline per row, the base image's tokens), for
src/data/llava_next/fixtures.rs to compare with ours token for token, and the model directory the
end-to-end case trains (make_vlm_golden_llava_next.py).

Reads DIR/vlm (mllm.json, images/); writes DIR/vlm/model-llava_next: the tiny demo tokenizer with
`<image>` added as a special token (the hub's llava-hf tokenizers have it at id 32000), the
config.json of a tiny LlavaNextForConditionalGeneration (a CLIP tower of 3 layers on 42 x 42
tiles of 7-pixel patches, a tiny llama), its preprocessor_config.json (the hub's
LlavaNextImageProcessor keys, llava-v1.6's pinpoints scaled from 336 to 42) and
processor_config.json (patch_size, vision_feature_select_strategy, num_additional_image_tokens,
as llava-hf's); and expected_llava_next.jsonl: per record input_ids, labels (the assistant
answers), image_sizes ((height, width) per image) and each image's token count.

The ids are the processor's: the conversation is rendered with the chat template, `<image>` left
in the text (it is the model's image token), and `LlavaNextProcessor(text, images)` replaces each
`<image>` with as many `<image>` as the image has features. The labels are the answers' spans in
the rendered text, moved by the expansion.

The image processor is LlavaNextImageProcessorPil: what AutoImageProcessor picks for llava_next
where torchvision is absent (as here); with torchvision it picks LlavaNextImageProcessor, whose
resize runs in torch (not measured here).

Usage: .venv/bin/python scripts/make_vlm_llava_next_fixtures.py --dir target/data-fixtures
(make_vlm_fixtures.py calls it.)
"""
import argparse
import json
import os
import shutil

from PIL import Image
from transformers import AutoTokenizer, LlavaNextConfig
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE = "<image>"
SIDE, PATCH = 42, 7  # tiles of 6 x 6 patches
# llava-v1.6's image_grid_pinpoints (336 x {1, 2, 3}) at this tile size.
PINPOINTS = [[SIDE, 2 * SIDE], [2 * SIDE, SIDE], [2 * SIDE, 2 * SIDE], [3 * SIDE, SIDE], [SIDE, 3 * SIDE]]
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True)
vlm = os.path.join(os.path.abspath(ap.parse_args().dir), "vlm")
model = os.path.join(vlm, "model-llava_next")
shutil.rmtree(model, ignore_errors=True)

tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "configs/tiny"))
tok.add_special_tokens({"additional_special_tokens": [IMAGE]})
tok.save_pretrained(model)
tok = AutoTokenizer.from_pretrained(model)
image_id = tok.convert_tokens_to_ids(IMAGE)
vocab = len(tok)

config = LlavaNextConfig(
    text_config=dict(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False),
    vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48,
                       num_hidden_layers=3, num_attention_heads=2, image_size=SIDE, patch_size=PATCH,
                       projection_dim=16),
    image_token_index=image_id, image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2,
    vision_feature_select_strategy="default", projector_hidden_act="gelu", tie_word_embeddings=False,
    image_seq_length=(SIDE // PATCH) ** 2,
)
config.save_pretrained(model)
pre = {"image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor",
       "aspect_ratio_setting": "anyres", "crop_size": {"height": SIDE, "width": SIDE},
       "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_pad": True,
       "do_rescale": True, "do_resize": True, "image_grid_pinpoints": PINPOINTS, "image_mean": CLIP_MEAN,
       "image_std": CLIP_STD, "resample": 3, "rescale_factor": 1 / 255, "size": {"shortest_edge": SIDE}}
json.dump(pre, open(os.path.join(model, "preprocessor_config.json"), "w"), indent=2)
proc_cfg = {"image_token": IMAGE, "num_additional_image_tokens": 1, "patch_size": PATCH,
            "processor_class": "LlavaNextProcessor", "vision_feature_select_strategy": "default"}
json.dump(proc_cfg, open(os.path.join(model, "processor_config.json"), "w"), indent=2)
improc = LlavaNextImageProcessorPil(
    **{k: v for k, v in pre.items() if k not in ("image_processor_type", "processor_class", "aspect_ratio_setting")})
proc = LlavaNextProcessor(image_processor=improc, tokenizer=tok, chat_template=tok.chat_template,
                          **{k: v for k, v in proc_cfg.items() if k != "processor_class"})


def answer_spans(msgs):
    """The rendered conversation and its assistant answers' (start, end) in it."""
    full = tok.apply_chat_template(msgs, tokenize=False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            prompt = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            turn = tok.apply_chat_template(msgs[: i + 1], tokenize=False)
            assert full.startswith(turn) and turn.startswith(prompt)
            spans.append((len(prompt), len(turn)))
    return full, spans


records = json.load(open(os.path.join(vlm, "mllm.json")))
with open(os.path.join(vlm, "expected_llava_next.jsonl"), "w") as f:
    for rec in records:
        pil = [Image.open(os.path.join(vlm, p)).convert("RGB") for p in rec["images"]]
        text, spans = answer_spans(rec["messages"])
        enc = proc(text=[text], images=pil or None)
        ids = [int(i) for i in enc["input_ids"][0]]
        sizes = [[int(x) for x in s] for s in enc["image_sizes"]] if pil else []
        counts = [proc._get_number_of_features(h, w, SIDE, SIDE) - 1 for h, w in sizes]
        assert sum(counts) == ids.count(image_id)
        # The spans where their bytes are once each `<image>` is its tokens.
        starts = [i for i in range(len(text)) if text.startswith(IMAGE, i)]
        assert len(starts) == len(pil)

        def moved(p):
            return p + sum(len(IMAGE) * (n - 1) for s, n in zip(starts, counts) if s + len(IMAGE) <= p)

        parts = text.split(IMAGE)
        expanded = parts[0] + "".join(IMAGE * n + part for n, part in zip(counts, parts[1:]))
        enc2 = tok(expanded, add_special_tokens=False, return_offsets_mapping=True)
        assert enc2["input_ids"] == ids, "the expanded text's ids differ from the processor's"
        labels = [t if any(moved(a) <= s < moved(b) for a, b in spans) else -100
                  for t, (s, _) in zip(ids, enc2["offset_mapping"])]
        f.write(json.dumps({"input_ids": ids, "labels": labels, "image_sizes": sizes, "image_tokens": counts}) + "\n")
print(f"vlm llava_next fixtures: {len(records)} records, LlavaNextProcessor ({SIDE}^2 tiles, pinpoints {PINPOINTS})")
