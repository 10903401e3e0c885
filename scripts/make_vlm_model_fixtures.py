#!/usr/bin/env python3
"""Vision-tower fixtures (issue #49): a tiny random Qwen2.5-VL (and, with `--family qwen3_vl`,
a tiny Qwen3-VL) built with transformers' own classes, and what its vision tower makes of
random pixels, for the worker's `qwen2_5_vl_vision` (worker/src/model/qwen2_vl_vision.rs) and
`qwen3_vl_vision` (worker/src/model/qwen3_vl_vision.rs) to compare with.

Written under OUT/vision/qwen2_5_vl/:
  model/            config.json + model.safetensors as `save_pretrained` writes them
                    (transformers 5.17 saves the hub's names: `visual.*`, `model.layers.*`)
  io.safetensors    pixel_values (N, 3*2*14*14) f32, grid_thw (images, 3) int64 and
                    `merged` = `model.visual(pixel_values, grid_thw).pooler_output`
                    (N / 4, text hidden): the features the model places at image tokens

The tower is sized so that every part of it acts: 3 blocks, block 1 with full attention and
blocks 0 and 2 with window attention whose windows (window_size 56: 2 x 2 merged patches)
split every image, grids whose merged sides are odd and even (partial windows, an empty
padding column of windows), one entry with two temporal patches; weights drawn wider than
the init (std 0.15, norm weights around 1) so that attention is far from uniform and a
permutation or a norm bug moves the output.

Qwen3-VL (OUT/vision/qwen3_vl/, same files; io.safetensors adds `deepstack.K`, the K-th
deepstack feature): 3 blocks with deepstack mergers after blocks 2 and 0 (listed out of order:
the features come in block order, each from its own merger), learned position embeddings on a
6 x 6 grid resampled to grids smaller and larger than it, one entry with two frames (attention
within each frame), the same wide weights.

Qwen3.5 (`--family qwen3_5`, OUT/vision/qwen3_5/): `Qwen3_5VisionModel`, Qwen3-VL's tower
without deepstack mergers, sized and drawn as Qwen3-VL's (io.safetensors without `deepstack.K`);
`qwen3_vl_vision` computes it with its spec's empty deepstack list.

Gemma 3 (`--family gemma3`, OUT/vision/gemma3/): its SigLIP tower and projector, described at
`gemma3()` below; worker/src/model/siglip_vision.rs compares with it.

LLaVA-NeXT (`--family llava_next`, OUT/vision/llava_next/): its CLIP tower, projector and
image_newline over any-resolution tiles, described at `llava_next()` below;
worker/src/model/clip_vision.rs compares with it.

Usage: .venv/bin/python scripts/make_vlm_model_fixtures.py --out target/golden
       [--family qwen3_vl|qwen3_5|gemma3|llava_next]
"""
import argparse
import os
import shutil

import safetensors.torch
import torch
from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, LlavaNextConfig,
                          LlavaNextForConditionalGeneration, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration, Qwen3_5Config,
                          Qwen3_5ForConditionalGeneration, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration)
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

GRIDS = [(1, 6, 8), (1, 4, 10), (2, 4, 4)]  # (t, h, w) in patches

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--family", default="qwen2_5_vl",
                choices=["qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma3", "llava_next"])
args = ap.parse_args()
out = os.path.join(os.path.abspath(args.out), "vision", args.family)
shutil.rmtree(out, ignore_errors=True)
os.makedirs(out)


def qwen3_vl(qwen3_5=False):
    """The Qwen3-VL case: its own model, inputs and outputs (with the deepstack features); or
    Qwen3.5's, the same tower without deepstack mergers (`qwen3_5`)."""
    torch.manual_seed(1)
    vision = dict(depth=3, hidden_size=48, intermediate_size=80, num_heads=3, out_hidden_size=64,
                  patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=36)
    tokens = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
    if qwen3_5:
        config = Qwen3_5Config(
            text_config=dict(vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                             linear_value_head_dim=8, layer_types=["full_attention"]),
            vision_config=vision, **tokens)
        model = Qwen3_5ForConditionalGeneration(config).float().eval()
    else:
        config = Qwen3VLConfig(
            text_config=dict(
                vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            ),
            vision_config=dict(vision, deepstack_visual_indexes=[2, 0]), **tokens)
        model = Qwen3VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.startswith("pos_embed"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(os.path.join(out, "model"))
    grids = GRIDS + [(1, 10, 2)]
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    n = int(grid_thw.prod(-1).sum())
    v = config.vision_config
    pixel_values = torch.randn(n, v.in_channels * v.temporal_patch_size * v.patch_size ** 2)
    with torch.no_grad():
        o = model.model.visual(pixel_values, grid_thw=grid_thw)
        per_image = model.model.get_image_features(pixel_values, grid_thw)
    assert torch.equal(torch.cat(per_image.pooler_output), o.pooler_output)
    deepstack = getattr(o, "deepstack_features", None) or []
    assert len(deepstack) == (0 if qwen3_5 else 2) and o.pooler_output.shape == (n // 4, 64)
    io = {"pixel_values": pixel_values.contiguous(), "grid_thw": grid_thw,
          "merged": o.pooler_output.contiguous()}
    io.update({f"deepstack.{k}": f.contiguous() for k, f in enumerate(deepstack)})
    safetensors.torch.save_file(io, os.path.join(out, "io.safetensors"))
    print(f"wrote {out}: {n} patches of {len(grids)} grids -> merged {tuple(o.pooler_output.shape)}"
          f" and {len(deepstack)} deepstack features")


# Gemma 3 (OUT/vision/gemma3/): a tiny Gemma3ForConditionalGeneration's SigLIP tower and
# projector. io.safetensors: pixel_values (3 images, 3, 84, 84) and `features` =
# `get_image_features(pixel_values).pooler_output` flattened to (3 x 9, text hidden): 6 x 6
# patches of 14 pooled 2 x 2 into 9 tokens per image, 2 encoder layers, weights drawn wide
# (std 0.15, norm weights around 1, the projector's RMSNorm weight around 0 as it acts as 1 + w)
# so that attention is far from uniform.
def gemma3():
    out_g = out
    shutil.rmtree(out_g, ignore_errors=True)
    os.makedirs(out_g)
    torch.manual_seed(3)
    g_config = Gemma3Config(
        text_config=dict(vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        vision_config=dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
                           image_size=84, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=9, image_token_index=90, boi_token_index=91, eoi_token_index=92,
    )
    g_model = Gemma3ForConditionalGeneration(g_config).float().eval()
    with torch.no_grad():
        for name, p in list(g_model.model.vision_tower.named_parameters()) + list(
                g_model.model.multi_modal_projector.named_parameters()):
            if "layer_norm" in name or "layernorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
            elif "mm_soft_emb_norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    g_model.save_pretrained(os.path.join(out_g, "model"))
    g_pixels = torch.randn(3, 3, 84, 84)
    with torch.no_grad():
        g_features = g_model.model.get_image_features(g_pixels).pooler_output
    assert g_features.shape == (3, 9, 64), g_features.shape
    safetensors.torch.save_file(
        {"pixel_values": g_pixels.contiguous(), "features": g_features.reshape(-1, 64).contiguous()},
        os.path.join(out_g, "io.safetensors"),
    )
    print(f"wrote {out_g}: 3 images of 84 x 84 -> features {tuple(g_features.shape)}")


# LLaVA-NeXT (OUT/vision/llava_next/): a tiny LlavaNextForConditionalGeneration's CLIP tower (3
# layers, the projector reading the second's output: `vision_feature_layer` -2, the class token
# dropped), projector and image_newline. io.safetensors: pixel_values (every image's tiles, the
# base image first, (tiles, 3, 42, 42)), image_sizes (images, 2: height, width; wide, tall, tiny
# and large, each picking another pinpoint) and `features` = `get_image_features(...)
# .pooler_output` concatenated (image tokens, text hidden): the base tile's 36 features, then the
# tiles' grid unpadded to the image's aspect with image_newline after each row. Weights drawn
# wide (std 0.15, LayerNorm weights around 1), so attention is far from uniform.
def llava_next():
    torch.manual_seed(5)
    side = 42
    config = LlavaNextConfig(
        text_config=dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=88,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=48, intermediate_size=80,
                           num_hidden_layers=3, num_attention_heads=3, image_size=side, patch_size=7),
        image_token_index=90, vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_grid_pinpoints=[[side, 2 * side], [2 * side, side], [2 * side, 2 * side], [3 * side, side],
                              [side, 3 * side]],
    )
    model = LlavaNextForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        vision = list(model.model.vision_tower.named_parameters()) + list(
            model.model.multi_modal_projector.named_parameters()) + [("image_newline", model.model.image_newline)]
        for name, p in vision:
            if "layer_norm" in name or "layrnorm" in name or "layernorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(os.path.join(out, "model"))
    sizes = torch.tensor([[45, 77], [190, 61], [9, 20], [500, 700], [113, 300]], dtype=torch.int64)
    tiles = [image_size_to_num_patches(s, config.image_grid_pinpoints, side) for s in sizes]
    pixel_values = torch.randn(sum(tiles), 3, side, side)
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values, sizes).pooler_output
    features = torch.cat(features)
    safetensors.torch.save_file(
        {"pixel_values": pixel_values.contiguous(), "image_sizes": sizes, "features": features.contiguous()},
        os.path.join(out, "io.safetensors"),
    )
    print(f"wrote {out}: {len(tiles)} images, {sum(tiles)} tiles of {side} x {side} -> features "
          f"{tuple(features.shape)}")


if args.family == "llava_next":
    llava_next()
    raise SystemExit(0)
if args.family in ("qwen3_vl", "qwen3_5"):
    qwen3_vl(qwen3_5=args.family == "qwen3_5")
    raise SystemExit(0)
if args.family == "gemma3":
    gemma3()
    raise SystemExit(0)

torch.manual_seed(0)
config = Qwen2_5_VLConfig(
    text_config=dict(
        vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    ),
    vision_config=dict(
        depth=3, hidden_size=48, intermediate_size=80, num_heads=3, out_hidden_size=64,
        patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
        fullatt_block_indexes=[1],
    ),
    image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93,
)
model = Qwen2_5_VLForConditionalGeneration(config).float().eval()
with torch.no_grad():
    for name, p in model.model.visual.named_parameters():
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or "ln_q" in name:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        else:
            p.copy_(0.15 * torch.randn_like(p))
model.save_pretrained(os.path.join(out, "model"))

grid_thw = torch.tensor(GRIDS, dtype=torch.int64)
n = int(grid_thw.prod(-1).sum())
v = config.vision_config
pixel_values = torch.randn(n, v.in_channels * v.temporal_patch_size * v.patch_size ** 2)
with torch.no_grad():
    merged = model.model.visual(pixel_values, grid_thw=grid_thw).pooler_output
    # The features the model places at the image tokens are these rows, image after image.
    per_image = model.model.get_image_features(pixel_values, grid_thw).pooler_output
assert torch.equal(torch.cat(per_image), merged)
assert merged.shape == (n // 4, config.text_config.hidden_size), merged.shape
safetensors.torch.save_file(
    {"pixel_values": pixel_values.contiguous(), "grid_thw": grid_thw, "merged": merged.contiguous()},
    os.path.join(out, "io.safetensors"),
)
print(f"wrote {out}: {n} patches of {len(GRIDS)} grids -> merged {tuple(merged.shape)}")
