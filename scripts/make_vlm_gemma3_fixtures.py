#!/usr/bin/env python3
"""Gemma 3 vision-language data fixtures (issue #49): the multimodal records of
make_vlm_fixtures.py as transformers' Gemma3Processor and Gemma 3's chat template make them,
for src/data/gemma3_vl/fixtures.rs to compare with ours token for token, and the model
directory the end-to-end case trains (make_vlm_golden_gemma3.py).

Reads DIR/vlm (mllm.json, images/); writes DIR/vlm/model-gemma3: the tiny demo tokenizer with
Gemma 3's special tokens (`<start_of_image>`, `<image_soft_token>`, `<end_of_image>` as its
boi / image / eoi tokens, the turn markers) and Gemma 3's chat template, the config.json of a
tiny Gemma3ForConditionalGeneration (a SigLIP tower on 112 x 112 images, 16 image tokens per
image, a sliding window shorter than an image's tokens), its preprocessor_config.json (the hub's
Gemma3ImageProcessor keys at that size) and processor_config.json; and expected_gemma3.jsonl:
per record input_ids, labels (the assistant answers) and token_type_ids.

The ids are the processor's: each `<image>` becomes `<start_of_image>` in the message text, the
conversation is rendered with the chat template (which trims each message), and
`Gemma3Processor(text, images)` expands each `<start_of_image>` to its `full_image_sequence`.
The labels are the answers' spans in the rendered text, moved by the expansion.

Usage: .venv/bin/python scripts/make_vlm_gemma3_fixtures.py --dir target/data-fixtures
(make_vlm_fixtures.py calls it.)
"""
import argparse
import json
import os
import shutil

from PIL import Image
from transformers import AutoTokenizer, Gemma3Config
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

# google/gemma-3-4b-it's chat template (tokenizer_config.json), the model's own.
from fixture_templates import GEMMA3 as GEMMA3_TEMPLATE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOI, SOFT, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
IMAGE_SIZE, TOKENS = 112, 16  # 8 x 8 patches of 14, pooled 2 x 2: 16 tokens per image

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True)
vlm = os.path.join(os.path.abspath(ap.parse_args().dir), "vlm")
model = os.path.join(vlm, "model-gemma3")
shutil.rmtree(model, ignore_errors=True)

tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "configs/tiny"))
tok.add_special_tokens({"additional_special_tokens": [BOI, SOFT, EOI, "<start_of_turn>", "<end_of_turn>"]})
tok.chat_template = GEMMA3_TEMPLATE
tok.save_pretrained(model)
cfg_path = os.path.join(model, "tokenizer_config.json")
tok_cfg = json.load(open(cfg_path))
tok_cfg["extra_special_tokens"] = {"boi_token": BOI, "image_token": SOFT, "eoi_token": EOI}
json.dump(tok_cfg, open(cfg_path, "w"), indent=2)
tok = AutoTokenizer.from_pretrained(model)
assert (tok.boi_token, tok.image_token, tok.eoi_token) == (BOI, SOFT, EOI)
vocab = len(tok)

config = Gemma3Config(
    text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                     sliding_window=12, layer_types=["sliding_attention", "full_attention"],
                     max_position_embeddings=4096, rms_norm_eps=1e-6, pad_token_id=0),
    vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       image_size=IMAGE_SIZE, patch_size=14, vision_use_head=False),
    mm_tokens_per_image=TOKENS, image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
    eoi_token_index=tok.eoi_token_id, tie_word_embeddings=True,
)
config.save_pretrained(model)
pre = {"image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": None, "do_normalize": True,
       "do_pan_and_scan": None, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
       "image_std": [0.5, 0.5, 0.5], "resample": 2, "rescale_factor": 1 / 255,
       "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}
json.dump(pre, open(os.path.join(model, "preprocessor_config.json"), "w"), indent=2)
json.dump({"image_seq_length": TOKENS, "processor_class": "Gemma3Processor"},
          open(os.path.join(model, "processor_config.json"), "w"), indent=2)
improc = Gemma3ImageProcessorPil(**{k: v for k, v in pre.items() if k != "image_processor_type"})
proc = Gemma3Processor(image_processor=improc, tokenizer=tok, chat_template=GEMMA3_TEMPLATE,
                       image_seq_length=TOKENS)
sequence = proc.full_image_sequence
assert sequence == f"\n\n{BOI}{SOFT * TOKENS}{EOI}\n\n", sequence


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
with open(os.path.join(vlm, "expected_gemma3.jsonl"), "w") as f:
    for rec in records:
        pil = [Image.open(os.path.join(vlm, p)).convert("RGB") for p in rec["images"]]
        msgs = [{"role": m["role"], "content": m["content"].replace("<image>", BOI)} for m in rec["messages"]]
        text, spans = answer_spans(msgs)
        enc = proc(text=[text], images=[pil] if pil else None)
        ids = [int(i) for i in enc["input_ids"][0]]
        types = [int(i) for i in enc["token_type_ids"][0]]
        # The spans where their bytes are once each `<start_of_image>` is its sequence.
        ends = [i + len(BOI) for i in range(len(text)) if text.startswith(BOI, i)]
        grow = len(sequence) - len(BOI)

        def moved(p):
            return p + grow * sum(e <= p for e in ends)

        expanded = text.replace(BOI, sequence)
        enc2 = tok(expanded, add_special_tokens=False, return_offsets_mapping=True)
        assert enc2["input_ids"] == ids, "the expanded text's ids differ from the processor's"
        labels = [t if any(moved(a) <= s < moved(b) for a, b in spans) else -100
                  for t, (s, _) in zip(ids, enc2["offset_mapping"])]
        assert sum(types) == TOKENS * len(pil) == ids.count(tok.image_token_id)
        f.write(json.dumps({"input_ids": ids, "labels": labels, "token_type_ids": types}) + "\n")
print(f"vlm gemma3 fixtures: {len(records)} records, Gemma3Processor ({TOKENS} tokens of {IMAGE_SIZE}^2 images)")
