#!/usr/bin/env python3
"""End-to-end vision-language golden cases (issue #49): a tiny Qwen2.5-VL, a tiny Qwen3-VL and a
tiny Qwen3.5 built with the hub classes, each trained one step by transformers + torch on the multimodal
records of make_vlm_fixtures.py (images in PNG, JPEG and lossless WebP, one and two per row, a
text-only row), their vision towers and mergers frozen; launcher/tests/vlm.rs runs mt-launch on
the same records (read, tokenized, decoded and resized by it) and compares.

Reads DIR/vlm (the records, images, model-<family>'s tokenizer and processor
settings, and expected_<family>.jsonl: the processor's ids and the labels per record, which the
data tests hold ours equal to); writes DIR/vlm/golden (Qwen2.5-VL) and DIR/vlm/golden-qwen3vl
(Qwen3-VL: Qwen3's layers with q/k norms under the interleaved mrope, the tower's learned
positions, and two deepstack features added after the first two of its three layers) and
DIR/vlm/golden-qwen3_5 (Qwen3.5: Gated DeltaNet and gated attention layers, the attention's
partial RoPE under the interleaved mrope, the tower without deepstack mergers) and
DIR/vlm/golden-qwen3_5_moe (Qwen3.5-MoE: the same with experts and a shared expert): model/
(the tiny model beside that tokenizer and preprocessor_config.json), run.yaml, expected.json
(the step's loss) and grads0.safetensors (every language-model gradient under its checkpoint
name), plus tower_flops.json (the tower's forward FLOPs as torch counts them, per grid).
The trained-tower cases, each the same step with parts of the tower trained too, then torch's
AdamW step (weight decay on the tensors of >= 2 dims, clipped to max_grad_norm):
DIR/vlm/golden{,-qwen3vl,-qwen3_5}/projector (`vlm.freeze_projector: false`, as LlamaFactory's
`freeze_multi_modal_projector: false`: the merger, and Qwen3-VL's deepstack mergers), and
DIR/vlm/golden{,-qwen3vl,-qwen3_5}/tower (`vlm: {freeze_vision_encoder: false, freeze_projector:
false}`: every tensor of the tower) and DIR/vlm/golden{,-qwen3vl,-qwen3_5}/encoder (LlamaFactory's
`freeze_vision_tower: false`: the patch embedding (and learned positions) and the blocks under
a frozen merger and deepstack mergers): run.yaml, expected.json,
grads0.safetensors (the tower's
gradients beside the language model's) and step1.safetensors (every trained tensor after the
step, checkpoint names).

Usage: .venv/bin/python scripts/make_vlm_golden.py --dir target/data-fixtures
(make_vlm_fixtures.py calls it last.)
"""
import argparse
import json
import os
import shutil

import sys
import tempfile

import safetensors.torch
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3_5Config,
                          Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration,
                          Qwen3VLConfig, Qwen3VLForConditionalGeneration)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden  # noqa: E402  (checkpoint_named: fused experts under their saved names)
import vlm_golden_common as c  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--dir", required=True)
vlm = os.path.join(os.path.abspath(ap.parse_args().dir), "vlm")


def qwen2_5_vl(vocab, ids_of):
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], in_channels=3),
        image_token_id=ids_of["<|image_pad|>"], vision_start_token_id=ids_of["<|vision_start|>"],
        vision_end_token_id=ids_of["<|vision_end|>"], tie_word_embeddings=False,
    )
    return cfg, Qwen2_5_VLForConditionalGeneration(cfg).float()


def qwen3_vl(vocab, ids_of):
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           num_position_embeddings=16, deepstack_visual_indexes=[2, 0]),
        image_token_id=ids_of["<|image_pad|>"], vision_start_token_id=ids_of["<|vision_start|>"],
        vision_end_token_id=ids_of["<|vision_end|>"], tie_word_embeddings=False,
    )
    return cfg, Qwen3VLForConditionalGeneration(cfg).float()


def qwen3_5_config(config_class, vocab, ids_of, **text):
    """A tiny Qwen3.5 (or Qwen3.5-MoE, `text` adding its experts): Gated DeltaNet layers (no
    positions) and gated attention layers whose partial RoPE (16 of 32 dims: 8 pairs) turns
    under the interleaved sections [3, 3, 2] (pairs 0, 3, 6 temporal, 1, 4, 7 height, 2, 5
    width); the tower without deepstack mergers."""
    return config_class(
        text_config=dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4,
                         layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                         max_position_embeddings=4096, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                          "mrope_section": [3, 3, 2], "mrope_interleaved": True}, **text),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           num_position_embeddings=16),
        image_token_id=ids_of["<|image_pad|>"], vision_start_token_id=ids_of["<|vision_start|>"],
        vision_end_token_id=ids_of["<|vision_end|>"], tie_word_embeddings=False,
    )


def qwen3_5(vocab, ids_of):
    """Qwen3.5 ([`qwen3_5_config`]), a dense MLP in every layer."""
    cfg = qwen3_5_config(Qwen3_5Config, vocab, ids_of, intermediate_size=96)
    model = Qwen3_5ForConditionalGeneration(cfg).float()
    assert model.model.language_model.rotary_emb.inv_freq.numel() == 8, "8 rotary pairs"
    assert not hasattr(model.model.visual, "deepstack_merger_list")
    return cfg, model


def qwen3_5_moe(vocab, ids_of):
    """Qwen3.5-MoE: Qwen3.5's text model with a mixture of experts and a shared expert in
    every layer (4 experts, 2 routed a token), behind the same tower; the processor and
    tokenizer are Qwen3.5's."""
    cfg = qwen3_5_config(Qwen3_5MoeConfig, vocab, ids_of, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=40, shared_expert_intermediate_size=48)
    model = Qwen3_5MoeForConditionalGeneration(cfg).float()
    assert not hasattr(model.model.visual, "deepstack_merger_list")
    return cfg, model


def golden(family, build, out_name, seed, projector, towers=True):
    out = os.path.join(vlm, out_name)
    shutil.rmtree(out, ignore_errors=True)
    model_dir = os.path.join(out, "model")
    shutil.copytree(os.path.join(vlm, f"model-{family}"), model_dir)
    tok_cfg = json.load(open(os.path.join(model_dir, "tokenizer.json")))
    vocab = max([t["id"] for t in tok_cfg["added_tokens"]] + list(tok_cfg["model"]["vocab"].values())) + 1
    ids_of = {t["content"]: t["id"] for t in tok_cfg["added_tokens"]}

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    cfg, model = build(vocab, ids_of)
    with torch.no_grad():  # wider than the default init, so every path moves the loss
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(model_dir)

    improc = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    records = json.load(open(os.path.join(vlm, "mllm.json")))
    expected = [json.loads(line) for line in open(os.path.join(vlm, f"expected_{family}.jsonl"))]
    images = [Image.open(os.path.join(vlm, p)).convert("RGB") for r in records for p in r["images"]]
    pix = improc(images=images, return_tensors="pt")
    B, T = len(expected), max(len(e["input_ids"]) for e in expected)
    ids = torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, e in enumerate(expected):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    assert [list(map(int, g)) for g in pix["image_grid_thw"]] == [g for e in expected for g in e["grids"]]

    saved = set(safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors")))
    fused_experts = any(n.endswith("mlp.experts.gate_up_proj") for n, _ in model.named_parameters())

    def checkpoint_name(n):
        """The checkpoint's name of parameter `n`: Qwen2.5-VL saves the hub's names
        (`model.layers.*`, `visual.*`), Qwen3-VL its class's own."""
        name = n if n in saved else n.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        assert name in saved, f"{name}: not a checkpoint name ({sorted(saved)[:5]}...)"
        return name

    def projector_tensor(n):
        """Whether tower tensor `n` is the projector's: the merger, and Qwen3-VL's deepstack
        mergers (whose features the first decoder layers add)."""
        return n.startswith(("merger.", "deepstack_merger_list."))

    def step(train_merger, train_encoder=False):
        """One forward and backward on every record, the tower's merger trained where
        `train_merger`, its encoder (patch embedding and blocks) where `train_encoder`, else
        frozen: (loss, {checkpoint name: gradient}, grad norm)."""
        model.zero_grad(set_to_none=True)
        for n, p in model.model.visual.named_parameters():
            p.requires_grad_(train_merger if projector_tensor(n) else train_encoder)
        out_ = model(input_ids=ids, attention_mask=mask, pixel_values=pix["pixel_values"],
                     image_grid_thw=pix["image_grid_thw"], mm_token_type_ids=(ids == cfg.image_token_id).long())
        logits = out_.logits
        targets = labels[:, 1:]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100, reduction="sum") / (targets != -100).sum()
        loss.backward()
        if fused_experts:  # saved per expert: the gradients go through save_pretrained
            with tempfile.TemporaryDirectory() as tmp:
                grads = make_golden.checkpoint_named(
                    model, {n: None if p.grad is None else p.grad.detach().clone()
                            for n, p in model.named_parameters()}, tmp)
            norm = c.norm_of(grads)
        else:
            grads, norm = c.gradients(model, checkpoint_name)
        return loss, grads, norm

    def write_case(case_dir, loss, grads, norm, extra_yaml=""):
        c.write_case(case_dir, out, "make_vlm_golden.py", loss, grads, norm, B, len(images), extra_yaml)

    # The tower and its mergers frozen.
    loss, grads, norm = step(False)
    write_case(out, loss, grads, norm,
               f"training: {{batch_size: {B}, num_steps: 1, learning_rate: 0.001, max_grad_norm: 1000.0}}\n")
    print(f"vlm golden ({family}): loss {loss.item():.6f}, grad norm {norm:.6f}, {B} rows, {len(images)} images")

    # The tower's checkpoint prefix: `visual.` (Qwen2.5-VL's hub names), `model.visual.`.
    tower = checkpoint_name("model.visual.patch_embed.proj.weight").removesuffix("patch_embed.proj.weight")

    def adamw_case(name, train_merger, train_encoder, keys):
        """One step with the tower's parts trained as asked, then torch's AdamW step
        (vlm_golden_common.adamw_case), written to OUT/<name> with `keys`, the config lines
        asking for it. The model's weights are put back after."""
        loss, grads, norm = step(train_merger, train_encoder)
        visual = [n.removeprefix(tower) for n in grads if n.startswith(tower)]
        assert train_merger == any(projector_tensor(n) for n in visual)
        assert train_encoder == any(not projector_tensor(n) for n in visual)
        deepstack = [n for n in visual if n.startswith("deepstack_merger_list.")]
        assert not deepstack or len(deepstack) == 6 * len(cfg.vision_config.deepstack_visual_indexes)
        c.adamw_case(model, checkpoint_name, os.path.join(out, name), out, "make_vlm_golden.py", loss, grads,
                     norm, B, len(images), keys)
        print(f"vlm golden ({family}), {name}: loss {loss.item():.6f}, grad norm {norm:.6f}, "
              f"{len(visual)} tower tensors trained")

    if projector:
        # The merger trained (LlamaFactory's key, which reads as vlm.freeze_projector: false);
        # Qwen3-VL's deepstack mergers with it.
        adamw_case("projector", True, False, "freeze_multi_modal_projector: false\n")
    # Every family's tower trains. Qwen2.5-VL: blocks under windows and a full one, RMSNorm,
    # gated MLP; Qwen3-VL and Qwen3.5: LayerNorm with bias, plain GELU MLP, the learned
    # positions' bilinear resampling and the patch embedding's bias, Qwen3-VL's tapped
    # blocks' outputs read by the deepstack mergers too.
    # The whole tower trained (MegaTrain's keys): the encoder's blocks and patch embedding too.
    if towers:
        adamw_case("tower", True, True, "vlm: {freeze_vision_encoder: false, freeze_projector: false}\n")
        # The encoder under a frozen merger (LlamaFactory's key): the gradient passes through
        # the merger (and Qwen3-VL's deepstack mergers).
        adamw_case("encoder", False, True, "freeze_vision_tower: false\n")

    # The tower's forward FLOPs as torch counts them (FlopCounterMode: convolutions, matmuls,
    # SDPA), per image grid: what the metrics' model TFLOPS add for the images of a step
    # (VisionSpec::forward_flops). The records' grids, and a few of other shapes (partial
    # windows, two frames).
    grids = [list(map(int, g)) for g in pix["image_grid_thw"]] + [[1, 12, 20], [1, 6, 10], [2, 8, 8]]
    v = cfg.vision_config
    visual, patch = model.model.visual, v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    # The eager attention's two matmuls are counted; CPU SDPA's fused kernel is not.
    visual.config._attn_implementation = "eager"
    counted = []
    for g in grids:
        x = torch.randn(g[0] * g[1] * g[2], patch)
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            visual(x, grid_thw=torch.tensor([g]))
        counted.append({"grid": g, "flops": fc.get_total_flops()})
    json.dump(counted, open(os.path.join(out, "tower_flops.json"), "w"), indent=2)
    print(f"vlm golden ({family}): tower FLOPs of {len(counted)} grids")


golden("qwen2vl", qwen2_5_vl, "golden", 4949, projector=True)
golden("qwen3vl", qwen3_vl, "golden-qwen3vl", 4950, projector=True)
golden("qwen3_5", qwen3_5, "golden-qwen3_5", 4951, projector=True)
# Qwen3.5-MoE: its tower is Qwen3.5's (trained there); the frozen case holds its experts.
golden("qwen3_5", qwen3_5_moe, "golden-qwen3_5_moe", 4952, projector=False, towers=False)
