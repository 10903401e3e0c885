#!/usr/bin/env python3
"""End-to-end Gemma 3 vision-language golden case (issue #49): the tiny
Gemma3ForConditionalGeneration of make_vlm_gemma3_fixtures.py (its config.json, built with the
hub classes, random init, seeded) trained one step by transformers + torch on the multimodal
records of make_vlm_fixtures.py, its SigLIP tower and projector frozen; launcher/tests/vlm.rs
runs mt-launch on the same records and compares.

Reads DIR/vlm (the records, images, model-gemma3 and expected_gemma3.jsonl: the processor's ids,
token_type_ids and the labels per record, which the data tests hold ours equal to); writes
DIR/vlm/golden-gemma3: model/ (the tiny model beside the tokenizer and processor settings),
run.yaml, tower_flops.json (FlopCounterMode's count of the tower's forward over one image),
expected.json (the step's loss and gradient norm, and the loss the same step gives
without the image blocks' bidirectional attention, `token_type_ids` left out: how far a causal
mask lands) and grads0.safetensors (every language-model gradient under its checkpoint name).
The projector case (`vlm.freeze_projector: false`, given as LlamaFactory's
`freeze_multi_modal_projector: false`): the same step with `multi_modal_projector` trained
too, then torch's AdamW step (vlm_golden_common.adamw_case): DIR/vlm/golden-gemma3/projector/
run.yaml, expected.json, grads0.safetensors and step1.safetensors; likewise the tower case
(DIR/vlm/golden-gemma3/tower: `vlm: {freeze_vision_encoder: false, freeze_projector: false}`,
every tensor of the tower and projector) and the encoder case (golden-gemma3/encoder:
LlamaFactory's `freeze_vision_tower: false`, the SigLIP tower under a frozen projector).

Usage: .venv/bin/python scripts/make_vlm_golden_gemma3.py --dir target/data-fixtures
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
from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

import vlm_golden_common as c

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True)
vlm = os.path.join(os.path.abspath(ap.parse_args().dir), "vlm")
out = os.path.join(vlm, "golden-gemma3")
shutil.rmtree(out, ignore_errors=True)
model_dir = os.path.join(out, "model")
shutil.copytree(os.path.join(vlm, "model-gemma3"), model_dir)

torch.manual_seed(4950)
torch.use_deterministic_algorithms(True)
cfg = Gemma3Config.from_pretrained(model_dir)
model = Gemma3ForConditionalGeneration(cfg).float()
with torch.no_grad():  # wider than the default init, so every path moves the loss
    for n, p in model.named_parameters():
        if "norm" in n and n.endswith("weight"):
            base = 1.0 if "vision_tower" in n else 0.0  # LayerNorm w vs Gemma's 1 + w
            p.copy_(base + 0.1 * torch.randn_like(p))
        elif p.ndim >= 2:
            p.normal_(0.0, 0.08)
        else:
            p.normal_(0.0, 0.02)
model.save_pretrained(model_dir)

pre = json.load(open(os.path.join(model_dir, "preprocessor_config.json")))
improc = Gemma3ImageProcessorPil(**{k: v for k, v in pre.items() if k != "image_processor_type"})
records = json.load(open(os.path.join(vlm, "mllm.json")))
expected = [json.loads(line) for line in open(os.path.join(vlm, "expected_gemma3.jsonl"))]
images = [Image.open(os.path.join(vlm, p)).convert("RGB") for r in records for p in r["images"]]
pix = improc(images=images, return_tensors="pt")
B, T = len(expected), max(len(e["input_ids"]) for e in expected)
ids = torch.zeros(B, T, dtype=torch.long)
labels = torch.full((B, T), -100, dtype=torch.long)
types = torch.zeros(B, T, dtype=torch.long)
mask = torch.zeros(B, T, dtype=torch.long)
for i, e in enumerate(expected):
    n = len(e["input_ids"])
    ids[i, :n] = torch.tensor(e["input_ids"])
    labels[i, :n] = torch.tensor(e["labels"])
    types[i, :n] = torch.tensor(e["token_type_ids"])
    mask[i, :n] = 1
assert int(types.sum()) == cfg.mm_tokens_per_image * len(images)

saved = set(safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors")))
projector = list(model.model.multi_modal_projector.parameters())
targets = labels[:, 1:]


def checkpoint_name(n):
    """The checkpoint's name of parameter `n` (transformers 5.17 writes the legacy names)."""
    name = (n.replace("model.language_model.", "language_model.model.")
            .replace("model.multi_modal_projector.", "multi_modal_projector.")
            .replace("model.vision_tower.", "vision_tower."))
    assert name in saved, f"{name}: not a checkpoint name ({sorted(saved)[:5]}...)"
    return name


def step_loss(token_type_ids):
    logits = model(input_ids=ids, attention_mask=mask, pixel_values=pix["pixel_values"],
                   token_type_ids=token_type_ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=-100, reduction="sum") / (targets != -100).sum()


def step(train_projector, train_tower=False):
    """One forward and backward on every record, the projector (the pooling's RMSNorm and the
    projection) trained where `train_projector`, the SigLIP tower where `train_tower`, else
    frozen: (loss, {checkpoint name: gradient}, grad norm)."""
    model.zero_grad(set_to_none=True)
    for p in model.model.vision_tower.parameters():
        p.requires_grad_(train_tower)
    for p in projector:
        p.requires_grad_(train_projector)
    loss = step_loss(types)
    loss.backward()
    grads, norm = c.gradients(model, checkpoint_name)
    return loss, grads, norm


def adamw_case(name, train_projector, train_tower, keys):
    """One step with the parts asked for trained, then torch's AdamW step
    (vlm_golden_common.adamw_case), written to OUT/<name> with `keys`, the config lines asking
    for it (the model's weights put back after); returns the trained vision tensors' names."""
    loss, grads, norm = step(train_projector, train_tower)
    c.adamw_case(model, checkpoint_name, os.path.join(out, name), out, "make_vlm_golden_gemma3.py", loss, grads, norm, B,
                 len(images), keys)
    print(f"vlm gemma3 golden, {name}: loss {loss.item():.6f}, grad norm {norm:.6f}")
    return sorted(n for n in grads if not n.startswith("language_model."))


# The tower and its projector frozen; the same step's loss under a causal mask beside it.
with torch.no_grad():
    loss_causal = step_loss(None).item()
loss, grads, norm = step(False)
safetensors.torch.save_file(grads, os.path.join(out, "grads0.safetensors"))
json.dump({"loss": loss.item(), "grad_norm": norm, "loss_causal": loss_causal, "rows": B,
           "images": len(images)}, open(os.path.join(out, "expected.json"), "w"), indent=2)
with open(os.path.join(out, "run.yaml"), "w") as f:
    f.write(f"""# generated by scripts/make_vlm_golden_gemma3.py
model: {{path: model, init: pretrained, dtype: float32}}
dataset: {{name: mllm_demo, dataset_dir: .., shuffle: false, max_seq_len: 1024}}
training: {{batch_size: {B}, num_steps: 1, learning_rate: 0.001, max_grad_norm: 1000.0}}
""")
print(f"vlm gemma3 golden: loss {loss.item():.6f} (causal only: {loss_causal:.6f}), grad norm {norm:.6f}, "
      f"{B} rows, {len(images)} images")

# The projector trained (LlamaFactory's key, which reads as vlm.freeze_projector: false): the
# average pool's RMSNorm (1 + w) and the projection; the gradient stops at the tower's output.
projector_names = ["multi_modal_projector.mm_input_projection_weight", "multi_modal_projector.mm_soft_emb_norm.weight"]
trained = adamw_case("projector", True, False, "freeze_multi_modal_projector: false\n")
assert trained == projector_names, trained

# The whole tower trained (MegaTrain's keys): the SigLIP patch embedding, positions, both
# encoder layers and post_layernorm too; and the tower under a frozen projector (LlamaFactory's
# key), the gradient passing through the projector.
tower = [n for n in saved if n.startswith("vision_tower.")]
trained = adamw_case("tower", True, True, "vlm: {freeze_vision_encoder: false, freeze_projector: false}\n")
assert trained == sorted(tower + projector_names), trained
trained = adamw_case("encoder", False, True, "freeze_vision_tower: false\n")
assert trained == sorted(tower), trained

# The tower's and projector's forward FLOPs over one image as torch counts them
# (FlopCounterMode: the convolution, matmuls; the eager attention's two matmuls, which CPU
# SDPA's fused kernel would hide): what the metrics' model TFLOPS add per image
# (SiglipSpec::forward_flops).
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

model.model.vision_tower.config._attn_implementation = "eager"
with torch.no_grad(), FlopCounterMode(display=False) as fc:
    model.model.get_image_features(pix["pixel_values"][:1])
json.dump({"flops": fc.get_total_flops()}, open(os.path.join(out, "tower_flops.json"), "w"), indent=2)
print(f"vlm gemma3 golden: tower FLOPs per image {fc.get_total_flops()}")
