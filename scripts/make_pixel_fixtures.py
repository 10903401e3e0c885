#!/usr/bin/env python3
"""Image pixel fixtures (issue #49): PNG and JPEG files and what Pillow and transformers make of
them, for src/data/image/fixtures.rs and src/data/qwen_vl/pixels.rs to compare with ours.

Written under OUT/vlm/pixels:
- images/: PNGs written by Pillow (RGB, RGBA, L, LA, I;16, palette at 8 and 4 bits with and
  without tRNS, 1-bit) and by the small encoder below for what Pillow does not write (16-bit
  RGB/RGBA/LA, 1/2/4-bit grey and palette, Adam7 interlacing, every scanline filter); JPEGs
  written by Pillow (libjpeg-turbo): 4:4:4, 4:2:2, 4:2:0, progressive, greyscale, restart
  markers, optimised Huffman tables, RGB (Adobe) coding, quality 100, odd and tiny sizes;
  lossless WebPs written by Pillow (libwebp); lossy WebPs written by Pillow (qualities, methods,
  sizes, alpha) and by Pillow's libwebp through its advanced API for the encoder options `save`
  does not pass on (the simple loop filter, sharpness, segments, token partitions); an animated
  WebP (refused by our decoder).
- decoded.safetensors: per file name, Pillow's `Image.open(path).convert("RGB")` as (H, W, 3)
  uint8.
- processor.safetensors + preprocessor_config.json: for a few images, `pixel_values` and
  `image_grid_thw` of transformers' Qwen2VLImageProcessorPil (what AutoImageProcessor picks
  for qwen2_vl / qwen2_5_vl when torchvision is absent, as here), with the config written
  beside them; one image above max_pixels (scaled down), one below min_pixels (scaled up),
  one already a multiple of 28, one JPEG.
- qwen3vl/: the same for Qwen3-VL's settings (16-pixel patches, mean and std 0.5, the pixel
  bounds in `size`, as its hub preprocessor_config.json spells them), over the same images.
- gemma3/: the same images through transformers' Gemma3ImageProcessorPil (bilinear resize to a
  fixed 224 x 224, rescale, normalise with mean and std 0.5), `pixel_values` (3, 224, 224) per
  file in processor.safetensors, beside the preprocessor_config.json and a config.json whose
  SigLIP tower takes that size.
- llava_next/: the same images through transformers' LlavaNextImageProcessorPil (what
  AutoImageProcessor picks for llava_next without torchvision) with the hub's
  preprocessor_config.json keys at 112-pixel tiles (llava-v1.6's pinpoints scaled by 1/3): the
  image resized keeping its aspect (bicubic) into the best pinpoint, padded, cut into tiles, the
  whole image resized to one tile before them; `pixel_values` (tiles, 3, 112, 112) per file,
  beside a config.json whose CLIP tower takes that size.
- manifest.json: the file lists, and the libwebp options of the lossy WebPs written through its
  advanced API.

Usage: .venv/bin/python scripts/make_pixel_fixtures.py --out target/data-fixtures
(make_vlm_fixtures.py calls it.)
"""
import argparse
import ctypes
import glob
import json
import os
import shutil
import struct
import zlib

import numpy as np
import PIL
from PIL import Image
from safetensors.numpy import save_file
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
out = os.path.join(os.path.abspath(ap.parse_args().out), "vlm", "pixels")
shutil.rmtree(out, ignore_errors=True)
os.makedirs(os.path.join(out, "images"))
rng = np.random.default_rng(49)


def scene(w, h, channels=3):
    """A photo-like test image: smooth gradients, a hard edge, and noise (uint8, (H, W, C))."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    base = [128 + 100 * np.sin(x / (3 + c) + y / (5 + 2 * c)) * np.cos(y / 7) for c in range(channels)]
    img = np.stack(base, -1)
    img[(x > w / 3) & (y < h / 2)] = 250
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def filtered(raw, prev, bpp, ftype):
    """One scanline filtered with type `ftype` (the PNG spec's five filters)."""
    out = bytearray()
    for i, v in enumerate(raw):
        a = raw[i - bpp] if i >= bpp else 0
        b = prev[i] if prev is not None else 0
        c = prev[i - bpp] if prev is not None and i >= bpp else 0
        if ftype == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
        else:
            pred = [0, a, b, (a + b) // 2][ftype]
        out.append((v - pred) & 0xFF)
    return bytes(out)


def pack_row(samples, depth):
    """Samples of one scanline to bytes: sub-byte samples packed MSB first, 16-bit big-endian."""
    if depth == 16:
        return b"".join(struct.pack(">H", int(s)) for s in samples)
    if depth == 8:
        return bytes(int(s) for s in samples)
    bits = "".join(format(int(s), f"0{depth}b") for s in samples)
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))


ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]


def write_png(path, arr, colour, depth, interlace=False, palette=None, trns=None):
    """A PNG of `arr` ((H, W, C) samples) with every filter type used in turn."""
    h, w, ch = arr.shape
    bpp = max(1, ch * depth // 8)
    passes = [(x0, y0, dx, dy) for x0, y0, dx, dy in ADAM7] if interlace else [(0, 0, 1, 1)]
    raw = bytearray()
    n = 0
    for x0, y0, dx, dy in passes:
        sub = arr[y0::dy, x0::dx]
        if sub.size == 0:
            continue
        prev = None
        for row in sub:
            line = pack_row(row.reshape(-1), depth)
            ftype = n % 5
            n += 1
            raw.append(ftype)
            raw += filtered(line, prev, bpp, ftype)
            prev = line
    b = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, colour, 0, 0, int(interlace)))
    if palette is not None:
        b += png_chunk(b"PLTE", bytes(palette))
    if trns is not None:
        b += png_chunk(b"tRNS", trns)
    b += png_chunk(b"IDAT", zlib.compress(bytes(raw), 9)) + png_chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(b)


files = []


def save(name, write):
    write(os.path.join(out, "images", name))
    files.append(name)


# PNGs written by Pillow.
rgb = scene(77, 45)
save("rgb.png", lambda p: Image.fromarray(rgb).save(p))
save("rgba.png", lambda p: Image.fromarray(scene(31, 20, 4)).save(p))
save("l.png", lambda p: Image.fromarray(scene(40, 23, 1)[..., 0]).save(p))
save("la.png", lambda p: Image.fromarray(scene(19, 30, 2), "LA").save(p))
save("i16.png", lambda p: Image.fromarray(rng.integers(0, 600, (17, 29)).astype(np.uint16)).save(p))
pal = Image.fromarray(rgb).quantize(200)
save("p8.png", lambda p: pal.save(p))
save("p8_trns.png", lambda p: pal.save(p, transparency=3))
pal16 = Image.fromarray(rgb).quantize(16)
save("p4.png", lambda p: pal16.save(p, bits=4))
save("one_bit.png", lambda p: Image.fromarray(scene(37, 11, 1)[..., 0] > 128).save(p))
# PNGs of our encoder: 16-bit colour, sub-byte depths, palettes, interlacing, all filters.
for il in (False, True):
    s = "_adam7" if il else ""
    save(f"rgb16{s}.png", lambda p: write_png(p, rng.integers(0, 65536, (13, 22, 3)), 2, 16, il))
    save(f"rgba16{s}.png", lambda p: write_png(p, rng.integers(0, 65536, (9, 11, 4)), 6, 16, il))
    save(f"la16{s}.png", lambda p: write_png(p, rng.integers(0, 65536, (7, 10, 2)), 4, 16, il))
    save(f"rgb8{s}.png", lambda p: write_png(p, scene(45, 33), 2, 8, il))
    save(f"rgba8{s}.png", lambda p: write_png(p, scene(5, 3, 4), 6, 8, il))
    for depth in (1, 2, 4):
        g = rng.integers(0, 1 << depth, (10, 13, 1))
        save(f"grey{depth}{s}.png", lambda p: write_png(p, g, 0, depth, il, trns=b"\0\1"))
        plte = rng.integers(0, 256, 3 * (1 << depth)).tolist()
        save(f"pal{depth}{s}.png", lambda p: write_png(p, g, 3, depth, il, palette=plte, trns=b"\0\x80"))
    save(f"grey16{s}.png", lambda p: write_png(p, rng.integers(0, 400, (8, 9, 1)), 0, 16, il))
# JPEGs written by Pillow (libjpeg-turbo).
photo = Image.fromarray(scene(77, 45))
for sub, tag in ((0, "444"), (1, "422"), (2, "420")):
    save(f"q90_{tag}.jpg", lambda p: photo.save(p, quality=90, subsampling=sub))
    save(f"prog_{tag}.jpg", lambda p: photo.save(p, quality=85, subsampling=sub, progressive=True))
save("wide_420.jpg", lambda p: Image.fromarray(scene(300, 113)).save(p, quality=75))
save("odd_420.jpg", lambda p: Image.fromarray(scene(33, 17)).save(p, quality=95))
save("tiny_420.jpg", lambda p: Image.fromarray(scene(2, 3)).save(p, quality=90))
save("pixel_420.jpg", lambda p: Image.fromarray(scene(1, 1)).save(p, quality=90))
save("three_420.jpg", lambda p: Image.fromarray(scene(5, 7)).save(p, quality=90))
save("q100_444.jpg", lambda p: photo.save(p, quality=100, subsampling=0))
save("restart_420.jpg", lambda p: photo.save(p, quality=80, restart_marker_blocks=3))
save("restart_prog.jpg", lambda p: photo.save(p, quality=80, progressive=True, restart_marker_rows=1))
save("optimized.jpg", lambda p: photo.save(p, quality=70, optimize=True))
save("adobe_rgb.jpg", lambda p: photo.save(p, quality=90, keep_rgb=True))
grey = Image.fromarray(scene(50, 31, 1)[..., 0])
save("grey.jpg", lambda p: grey.save(p, quality=90))
save("grey_prog.jpg", lambda p: grey.save(p, quality=90, progressive=True))
# Lossless WebPs written by Pillow (libwebp): photo-like (predictor, colour and
# subtract-green transforms, backward references, colour cache), few colours (colour
# indexing, pixels packed 2, 4 and 8 to a byte), alpha (dropped), each effort level.
for m in (0, 4, 6):
    save(f"lossless_m{m}.webp", lambda p: photo.save(p, lossless=True, quality=100, method=m))
save("lossless_big.webp", lambda p: Image.fromarray(scene(300, 113)).save(p, lossless=True))
save("lossless_rgba.webp", lambda p: Image.fromarray(scene(31, 20, 4)).save(p, lossless=True, exact=True))
for n in (2, 4, 16, 200):
    few = Image.fromarray(rgb).quantize(n).convert("RGB")
    save(f"lossless_{n}colours.webp", lambda p: few.save(p, lossless=True))
# Lossy WebPs written by Pillow (libwebp): photo-like (detail, a hard edge, noise) and flat,
# sizes that are and are not multiples of 16 (odd, tiny), qualities 0 to 100, each method,
# alpha (VP8X + ALPH: the alpha dropped, the RGB as decoded).
for q in (0, 5, 50, 95, 100):
    save(f"lossy_q{q}.webp", lambda p: photo.save(p, quality=q))
big = Image.fromarray(scene(300, 113))
for m in (0, 4, 6):
    save(f"lossy_m{m}.webp", lambda p: big.save(p, quality=75, method=m))
save("lossy_mb.webp", lambda p: Image.fromarray(scene(64, 48)).save(p, quality=80))
save("lossy_wide.webp", lambda p: Image.fromarray(scene(419, 61)).save(p, quality=70))
for w, h in ((1, 1), (2, 3), (5, 7), (17, 33)):
    save(f"lossy_{w}x{h}.webp", lambda p: Image.fromarray(scene(w, h)).save(p, quality=80))
save("lossy_flat.webp", lambda p: Image.new("RGB", (50, 37), (30, 120, 200)).save(p, quality=80))
y, x = np.mgrid[0:40, 0:70]
ramp = np.stack([x * 3, y * 5, 255 - x * 2], -1).clip(0, 255).astype(np.uint8)
save("lossy_ramp.webp", lambda p: Image.fromarray(ramp).save(p, quality=90))
rgba = Image.fromarray(scene(31, 20, 4))
save("lossy_rgba.webp", lambda p: rgba.save(p, quality=80))
save("lossy_rgba_exact.webp", lambda p: rgba.save(p, quality=60, alpha_quality=40, exact=True))


def libwebp_encode(rgb, quality, **options):
    """A lossy WebP from Pillow's own libwebp, through its advanced API (ctypes), for the
    encoder options Pillow's `save` does not pass on: `filter_type` (0: the simple loop filter),
    `filter_sharpness`, `filter_strength`, `segments`, `partitions` (log2 of the token
    partitions' count), `sns_strength` (fields of libwebp 1.x's WebPConfig, in order)."""
    names = ("lossless quality method image_hint target_size target_PSNR segments sns_strength "
             "filter_strength filter_sharpness filter_type autofilter alpha_compression "
             "alpha_filtering alpha_quality pass show_compressed preprocessing partitions "
             "partition_limit emulate_jpeg_size thread_level low_memory near_lossless exact "
             "use_delta_palette use_sharp_yuv qmin qmax").split()
    ptr, i32, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32

    class Config(ctypes.Structure):
        _fields_ = [(n, ctypes.c_float if n in ("quality", "target_PSNR") else i32) for n in names]

    class Picture(ctypes.Structure):
        _fields_ = [("use_argb", i32), ("colorspace", i32), ("width", i32), ("height", i32),
                    ("y", ptr), ("u", ptr), ("v", ptr), ("y_stride", i32), ("uv_stride", i32),
                    ("a", ptr), ("a_stride", i32), ("pad1", u32 * 2), ("argb", ptr),
                    ("argb_stride", i32), ("pad2", u32 * 3), ("writer", ptr), ("custom_ptr", ptr),
                    ("extra_info_type", i32), ("extra_info", ptr), ("stats", ptr), ("error_code", i32),
                    ("progress_hook", ptr), ("user_data", ptr), ("pad3", u32 * 3), ("pad4", ptr),
                    ("pad5", ptr), ("pad6", u32 * 8), ("memory_", ptr), ("memory_argb_", ptr),
                    ("pad7", ptr * 2)]

    class Writer(ctypes.Structure):
        _fields_ = [("mem", ptr), ("size", ctypes.c_size_t), ("max_size", ctypes.c_size_t), ("pad", u32)]

    lib = ctypes.CDLL(PILLOW_LIBWEBP)
    abi = 0x0210  # WEBP_ENCODER_ABI_VERSION of libwebp 1.x (its major byte must match)
    config, pic, writer = Config(), Picture(), Writer()
    assert lib.WebPConfigInitInternal(ctypes.byref(config), 0, ctypes.c_float(quality), abi)
    for k, v in options.items():
        setattr(config, k, v)
    assert lib.WebPValidateConfig(ctypes.byref(config)), options
    assert lib.WebPPictureInitInternal(ctypes.byref(pic), abi)
    pic.height, pic.width, _ = rgb.shape
    pic.use_argb = 1
    data = np.ascontiguousarray(rgb, dtype=np.uint8)
    assert lib.WebPPictureImportRGB(ctypes.byref(pic), data.ctypes.data_as(ptr), 3 * pic.width)
    lib.WebPMemoryWriterInit(ctypes.byref(writer))
    pic.writer = ctypes.cast(lib.WebPMemoryWrite, ptr)
    pic.custom_ptr = ctypes.cast(ctypes.byref(writer), ptr)
    ok = lib.WebPEncode(ctypes.byref(config), ctypes.byref(pic))
    encoded = ctypes.string_at(writer.mem, writer.size)
    lib.WebPPictureFree(ctypes.byref(pic))
    lib.WebPMemoryWriterClear(ctypes.byref(writer))
    assert ok, f"WebPEncode: error {pic.error_code}"
    return encoded


def save_bytes(name, b):
    save(name, lambda p: open(p, "wb").write(b))


# What Pillow's options do not reach (the manifest's `lossy_options` say which header each
# must show): the simple loop filter, sharpness, no filter, one segment, 2/4/8 token
# partitions, no spatial noise shaping.
detail = scene(161, 130)
LOSSY_OPTIONS = {
    "lossy_simple.webp": dict(filter_type=0, filter_strength=60),
    "lossy_simple_sharp.webp": dict(filter_type=0, filter_strength=100, filter_sharpness=5),
    "lossy_sharp3.webp": dict(filter_type=1, filter_strength=80, filter_sharpness=3),
    "lossy_sharp7.webp": dict(filter_type=1, filter_strength=100, filter_sharpness=7),
    "lossy_nofilter.webp": dict(filter_strength=0),
    "lossy_segments1.webp": dict(segments=1, sns_strength=0),
    # (libwebp writes one partition where its method >= 3 keeps tokens, unless low_memory)
    "lossy_parts2.webp": dict(partitions=1, method=1),
    "lossy_parts4.webp": dict(partitions=2, segments=2, low_memory=1),
    "lossy_parts8.webp": dict(partitions=3, method=2),
}
# Pillow's manylinux wheels carry libwebp beside it; a Pillow built otherwise has none to
# call: those files are then left out (the manifest lists what was written).
PILLOW_LIBWEBP = next(iter(glob.glob(os.path.join(os.path.dirname(PIL.__file__), "..", "pillow.libs", "libwebp-*"))), None)
if PILLOW_LIBWEBP is None:
    print("make_pixel_fixtures: no libwebp beside Pillow (pillow.libs): the lossy WebPs of "
          f"encoder options Pillow does not pass ({', '.join(LOSSY_OPTIONS)}) are left out")
    LOSSY_OPTIONS = {}
for name, options in LOSSY_OPTIONS.items():
    save_bytes(name, libwebp_encode(detail, 40.0, **options))
# Refused by our decoder, by name: an animation.
animated = "animated.webp"
frames = [Image.fromarray(scene(20, 10)), Image.fromarray(scene(20, 10))]
frames[0].save(os.path.join(out, "images", animated), save_all=True, append_images=frames[1:], duration=50)

decoded = {}
for name in files:
    with Image.open(os.path.join(out, "images", name)) as im:
        decoded[name] = np.ascontiguousarray(np.asarray(im.convert("RGB"), dtype=np.uint8))
save_file(decoded, os.path.join(out, "decoded.safetensors"))

# The image processor: a config as a checkpoint writes it, with Qwen2-VL's mean and std.
config = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
          "temporal_patch_size": 2, "min_pixels": 56 * 56, "max_pixels": 200_704,
          "image_mean": [0.48145466, 0.4578275, 0.40821073],
          "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3,
          "rescale_factor": 1 / 255, "do_rescale": True, "do_normalize": True}
with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
    json.dump(config, f, indent=2)
proc = Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if k != "image_processor_type"})
for name, arr in (("big.png", scene(700, 500)), ("small.png", scene(20, 9)), ("exact.png", scene(56, 28))):
    save(name, lambda p: Image.fromarray(arr).save(p))
processed = {}
through = ["big.png", "small.png", "exact.png", "rgb.png", "q90_420.jpg"]
for name in through:
    with Image.open(os.path.join(out, "images", name)) as im:
        enc = proc(images=[im.convert("RGB")])
    processed[f"{name}.pixel_values"] = np.ascontiguousarray(enc["pixel_values"], dtype=np.float32)
    processed[f"{name}.grid"] = np.asarray(enc["image_grid_thw"], dtype=np.int64)
save_file(processed, os.path.join(out, "processor.safetensors"))

# Qwen3-VL's settings: the same image processor class (AutoImageProcessor's pick for qwen3_vl).
config3 = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2,
           "temporal_patch_size": 2, "size": {"shortest_edge": 65536 // 16, "longest_edge": 200_704},
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
os.makedirs(os.path.join(out, "qwen3vl"))
with open(os.path.join(out, "qwen3vl", "preprocessor_config.json"), "w") as f:
    json.dump(config3, f, indent=2)
proc3 = Qwen2VLImageProcessorPil.from_pretrained(os.path.join(out, "qwen3vl"))
processed3 = {}
for name in through:
    with Image.open(os.path.join(out, "images", name)) as im:
        enc = proc3(images=[im.convert("RGB")])
    processed3[f"{name}.pixel_values"] = np.ascontiguousarray(enc["pixel_values"], dtype=np.float32)
    processed3[f"{name}.grid"] = np.asarray(enc["image_grid_thw"], dtype=np.int64)
save_file(processed3, os.path.join(out, "qwen3vl", "processor.safetensors"))

# Gemma 3's processor: its hub preprocessor_config.json's keys at a small fixed size (both
# shrinking, antialiased, and enlarging images), and a config.json whose tower takes it.
g3 = os.path.join(out, "gemma3")
os.makedirs(g3)
g3_config = {"image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": None, "do_normalize": True,
             "do_pan_and_scan": None, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "resample": 2, "rescale_factor": 1 / 255,
             "size": {"height": 224, "width": 224}}
with open(os.path.join(g3, "preprocessor_config.json"), "w") as f:
    json.dump(g3_config, f, indent=2)
with open(os.path.join(g3, "config.json"), "w") as f:
    json.dump({"model_type": "gemma3", "mm_tokens_per_image": 256,
               "vision_config": {"image_size": 224, "patch_size": 14}}, f, indent=2)
g3_proc = Gemma3ImageProcessorPil(**{k: v for k, v in g3_config.items() if k != "image_processor_type"})
g3_processed = {}
for name in through:
    with Image.open(os.path.join(out, "images", name)) as im:
        enc = g3_proc(images=[im.convert("RGB")])
    assert list(enc["num_crops"]) == [0]
    g3_processed[f"{name}.pixel_values"] = np.ascontiguousarray(enc["pixel_values"][0], dtype=np.float32)
save_file(g3_processed, os.path.join(g3, "processor.safetensors"))

# LLaVA-NeXT's processor: the hub's preprocessor_config.json keys (llava-hf/llava-v1.6-*) at
# 112-pixel tiles, and a config.json whose CLIP tower and pinpoints match them.
ln = os.path.join(out, "llava_next")
os.makedirs(ln)
ln_pins = [[112, 224], [224, 112], [224, 224], [336, 112], [112, 336]]
ln_config = {"image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor",
             "aspect_ratio_setting": "anyres", "crop_size": {"height": 112, "width": 112},
             "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_pad": True,
             "do_rescale": True, "do_resize": True, "image_grid_pinpoints": ln_pins,
             "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3,
             "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 112}}
with open(os.path.join(ln, "preprocessor_config.json"), "w") as f:
    json.dump(ln_config, f, indent=2)
with open(os.path.join(ln, "config.json"), "w") as f:
    json.dump({"model_type": "llava_next", "image_grid_pinpoints": ln_pins, "text_config": {"hidden_size": 64},
               "vision_config": {"image_size": 112, "patch_size": 14, "hidden_size": 32,
                                 "intermediate_size": 48, "num_attention_heads": 2, "num_hidden_layers": 2}},
              f, indent=2)
drop = ("image_processor_type", "processor_class", "aspect_ratio_setting")
ln_proc = LlavaNextImageProcessorPil(**{k: v for k, v in ln_config.items() if k not in drop})
ln_processed = {}
for name in through:
    with Image.open(os.path.join(out, "images", name)) as im:
        enc = ln_proc(images=[im.convert("RGB")])
    ln_processed[f"{name}.pixel_values"] = np.ascontiguousarray(enc["pixel_values"][0], dtype=np.float32)
    ln_processed[f"{name}.image_size"] = np.asarray(enc["image_sizes"][0], dtype=np.int64)
save_file(ln_processed, os.path.join(ln, "processor.safetensors"))
with open(os.path.join(out, "manifest.json"), "w") as f:
    json.dump({"decoded": sorted(decoded), "processed": through, "refused": [animated],
               "lossy_options": LOSSY_OPTIONS}, f, indent=2)
print(f"pixel fixtures: {len(decoded)} decoded images, {len(through)} through Qwen2VLImageProcessorPil"
      " (Qwen2-VL's and Qwen3-VL's settings), Gemma3ImageProcessorPil and LlavaNextImageProcessorPil")
