#!/usr/bin/env python3
"""End-to-end LLaVA-NeXT vision-language golden case (issue #49): the tiny
LlavaNextForConditionalGeneration of make_vlm_llava_next_fixtures.py (its config.json, built with
the hub classes, random init, seeded) trained one step by transformers + torch on the multimodal
records of make_vlm_fixtures.py, its CLIP tower, projector and image_newline frozen;
launcher/tests/vlm.rs runs mt-launch on the same records and compares.

Reads DIR/vlm (the records, images, model-llava_next and expected_llava_next.jsonl: the
processor's ids and the labels per record, which the data tests hold ours equal to); writes
DIR/vlm/golden-llava_next: model/ (the tiny model beside the tokenizer and processor settings),
run.yaml, expected.json (the step's loss and gradient norm), grads0.safetensors (every
language-model gradient under its checkpoint name) and tower_flops.json (FlopCounterMode's count
of the tower's and projector's forward per image size, the tower cut after the layer whose output
the projector reads: what runs). The projector case (`vlm.freeze_projector: false`, given as
LlamaFactory's `freeze_multi_modal_projector: false`): the same step with `multi_modal_projector`
and `image_newline` trained too, then torch's AdamW step (weight decay on the tensors of >= 2
dims, clipped to half the gradient norm): DIR/vlm/golden-llava_next/projector/run.yaml,
expected.json, grads0.safetensors (the projector's and the newline's gradients beside the
language model's) and step1.safetensors (every trained tensor after the step, checkpoint names);
likewise the tower case (golden-llava_next/tower: `vlm: {freeze_vision_encoder: false,
freeze_projector: false}`) and the encoder case (golden-llava_next/encoder: LlamaFactory's
`freeze_vision_tower: false`), where the CLIP layers after the one `vision_feature_layer` reads
and `post_layernorm` get no gradient (None in torch).

Usage: .venv/bin/python scripts/make_vlm_golden_llava_next.py --dir target/data-fixtures
(make_vlm_fixtures.py calls it.)
"""
import argparse
import json
import os
import shutil

import safetensors.torch
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

import vlm_golden_common as c

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True)
vlm = os.path.join(os.path.abspath(ap.parse_args().dir), "vlm")
out = os.path.join(vlm, "golden-llava_next")
shutil.rmtree(out, ignore_errors=True)
model_dir = os.path.join(out, "model")
shutil.copytree(os.path.join(vlm, "model-llava_next"), model_dir)

torch.manual_seed(4951)
torch.use_deterministic_algorithms(True)
cfg = LlavaNextConfig.from_pretrained(model_dir)
model = LlavaNextForConditionalGeneration(cfg).float()
with torch.no_grad():  # wider than the default init, so every path moves the loss
    for n, p in model.named_parameters():
        if ("norm" in n or "layrnorm" in n) and n.endswith("weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif p.ndim >= 2:
            p.normal_(0.0, 0.08)
        else:
            p.normal_(0.0, 0.1 if "image_newline" in n or "class_embedding" in n else 0.02)
model.save_pretrained(model_dir)

pre = json.load(open(os.path.join(model_dir, "preprocessor_config.json")))
drop = ("image_processor_type", "processor_class", "aspect_ratio_setting")
improc = LlavaNextImageProcessorPil(**{k: v for k, v in pre.items() if k not in drop})
records = json.load(open(os.path.join(vlm, "mllm.json")))
expected = [json.loads(line) for line in open(os.path.join(vlm, "expected_llava_next.jsonl"))]
images = [Image.open(os.path.join(vlm, p)).convert("RGB") for r in records for p in r["images"]]
pix = improc(images=images, return_tensors="pt")
assert pix["image_sizes"].tolist() == [s for e in expected for s in e["image_sizes"]]
B, T = len(expected), max(len(e["input_ids"]) for e in expected)
ids = torch.zeros(B, T, dtype=torch.long)
labels = torch.full((B, T), -100, dtype=torch.long)
mask = torch.zeros(B, T, dtype=torch.long)
for i, e in enumerate(expected):
    n = len(e["input_ids"])
    ids[i, :n] = torch.tensor(e["input_ids"])
    labels[i, :n] = torch.tensor(e["labels"])
    mask[i, :n] = 1

saved = set(safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors")))
projector = list(model.model.multi_modal_projector.parameters()) + [model.model.image_newline]


def checkpoint_name(n):
    """The checkpoint's name of parameter `n` (transformers 5.17 writes the legacy names)."""
    name = (n.replace("model.language_model.", "language_model.model.").replace("lm_head.", "language_model.lm_head.")
            .replace("model.multi_modal_projector.", "multi_modal_projector.").replace("model.image_newline", "image_newline")
            .replace("model.vision_tower.", "vision_tower."))
    assert name in saved, f"{name}: not a checkpoint name ({sorted(saved)[:5]}...)"
    return name


def step(train_projector, train_tower=False):
    """One forward and backward on every record, the projector and the newline trained where
    `train_projector`, the CLIP tower where `train_tower`, else frozen: (loss, {checkpoint
    name: gradient}, grad norm). Of a trained tower, the layers after the one
    `vision_feature_layer` reads and `post_layernorm` (the class token's) get no gradient."""
    model.zero_grad(set_to_none=True)
    for p in model.model.vision_tower.parameters():
        p.requires_grad_(train_tower)
    for p in projector:
        p.requires_grad_(train_projector)
    logits = model(input_ids=ids, attention_mask=mask, pixel_values=pix["pixel_values"],
                   image_sizes=pix["image_sizes"]).logits
    targets = labels[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=-100, reduction="sum") / (targets != -100).sum()
    loss.backward()
    grads, norm = c.gradients(model, checkpoint_name)
    return loss, grads, norm


def write_case(case_dir, loss, grads, norm, extra_yaml):
    c.write_case(case_dir, out, "make_vlm_golden_llava_next.py", loss, grads, norm, B, len(images), extra_yaml)


def adamw_case(name, train_projector, train_tower, keys):
    """One step with the parts asked for trained, then torch's AdamW step
    (vlm_golden_common.adamw_case), written to OUT/<name> with `keys`, the config lines asking
    for it (the model's weights put back after); returns the trained vision tensors' names."""
    loss, grads, norm = step(train_projector, train_tower)
    c.adamw_case(model, checkpoint_name, os.path.join(out, name), out, "make_vlm_golden_llava_next.py", loss, grads, norm, B,
                 len(images), keys)
    print(f"vlm llava_next golden, {name}: loss {loss.item():.6f}, grad norm {norm:.6f}")
    return sorted(n for n in grads if not n.startswith("language_model."))


# The tower, its projector and the newline frozen.
loss, grads, norm = step(False)
write_case(out, loss, grads, norm,
           f"training: {{batch_size: {B}, num_steps: 1, learning_rate: 0.001, max_grad_norm: 1000.0}}\n")
print(f"vlm llava_next golden: loss {loss.item():.6f}, grad norm {norm:.6f}, {B} rows, {len(images)} images")

# The projector and the newline trained (LlamaFactory's key, which reads as
# vlm.freeze_projector: false).
projector_names = ["image_newline"] + [f"multi_modal_projector.linear_{i}.{k}" for i in (1, 2)
                                       for k in ("weight", "bias")]
trained = adamw_case("projector", True, False, "freeze_multi_modal_projector: false\n")
assert trained == sorted(projector_names), trained

# The whole tower trained (MegaTrain's keys) and the tower under a frozen projector and newline
# (LlamaFactory's key): the CLIP embeddings, pre_layrnorm and the layers up to the one
# `vision_feature_layer` reads get gradients; the layers after it and post_layernorm (the class
# token's) none, so torch's AdamW leaves them as they are.
keep = cfg.vision_config.num_hidden_layers + 1 + cfg.vision_feature_layer
assert keep == 2, keep
reached = [n for n in saved if n.startswith("vision_tower.") and "post_layernorm" not in n
           and not any(f"layers.{i}." in n for i in range(keep, cfg.vision_config.num_hidden_layers))]
trained = adamw_case("tower", True, True, "vlm: {freeze_vision_encoder: false, freeze_projector: false}\n")
assert trained == sorted(reached + projector_names), trained
trained = adamw_case("encoder", False, True, "freeze_vision_tower: false\n")
assert trained == sorted(reached), trained

# The tower's and projector's forward FLOPs per image as torch counts them (FlopCounterMode: the
# patch convolution, matmuls, the eager attention's two matmuls, which CPU SDPA's fused kernel
# would hide), over the layers that run: those up to the one `vision_feature_layer` reads
# (ClipSpec::forward_flops). The records' image sizes and a few others (each pinpoint chosen).
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

tower = model.model.vision_tower
tower.config._attn_implementation = "eager"
layers = tower.vision_model.encoder.layers if hasattr(tower, "vision_model") else tower.encoder.layers
keep = len(layers) + 1 + cfg.vision_feature_layer
del layers[keep:]
counted = []
for h, w in pix["image_sizes"].tolist() + [[42, 42], [300, 40], [40, 300], [90, 91]]:
    tiles = image_size_to_num_patches((h, w), cfg.image_grid_pinpoints, cfg.vision_config.image_size)
    x = torch.randn(1, tiles, 3, cfg.vision_config.image_size, cfg.vision_config.image_size)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model.model.get_image_features(x, torch.tensor([[h, w]]), vision_feature_layer=-1)
    counted.append({"size": [h, w], "tiles": tiles, "flops": fc.get_total_flops()})
json.dump(counted, open(os.path.join(out, "tower_flops.json"), "w"), indent=2)
print(f"vlm llava_next golden: tower FLOPs of {len(counted)} image sizes")
