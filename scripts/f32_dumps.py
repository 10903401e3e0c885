"""What the GPU checks compare (scripts/check_gated_delta.sh, scripts/check_sinks.sh): the
f32 tensors of a worker's --dump-logits / --dump-grads safetensors files, read without
packages, and the norm-wise relative error between two of them."""
import json
import math
import struct
from array import array


def load(path):
    """The f32 tensors of a safetensors file: name -> (shape, values)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header, data = json.loads(f.read(n)), f.read()
    out = {}
    for name, info in header.items():
        if name != "__metadata__":
            assert info["dtype"] == "F32", (path, name, info["dtype"])
            a, b = info["data_offsets"]
            out[name] = (info["shape"], array("f", data[a:b]))
    return out


def rel(a, b):
    """||a - b|| / ||b||."""
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    return num / max(math.sqrt(sum(y * y for y in b)), 1e-30)
