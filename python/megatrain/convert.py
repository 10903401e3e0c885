"""Batches in, log-probabilities out: what the caller hands the Engine and gets back.

In: lists, tuples, numpy arrays and torch tensors (any device), nested in the dicts of
docs/serve.md's batches, become plain lists of ints and floats (`.tolist()`; numpy's and
torch's scalars through `.item()`); a row's `images` (paths) become absolute paths. A NaN or infinity is refused by the wire, naming its
place (`rollouts[3].reward`), before anything is sent.

Out: per-row log-probabilities as 1-D float32 numpy arrays, or torch tensors, or the plain
lists when neither library is installed. The server's f64 numbers are the workers' f32
values, so the float32 arrays hold them exactly.

Neither numpy nor torch is imported unless the caller's data or an output asks for it.
"""

import os
import sys


def plain(x):
    """`x` with every array or tensor inside it turned into lists and Python numbers, and
    each row's `images` (file paths, str or os.PathLike) made absolute: the server resolves
    no path against its own working directory."""
    if isinstance(x, dict):
        return {k: images(v) if k == "images" else plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, (str, bytes, int, float, bool)) or x is None:
        return x
    if hasattr(x, "detach"):  # a torch tensor: off the graph and the device first
        x = x.detach().cpu()
    if hasattr(x, "tolist"):  # numpy arrays and scalars, torch tensors
        return plain(x.tolist())
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"cannot send a {type(x).__name__} to the engine (lists, numpy arrays or torch tensors)")


def images(paths):
    """A row's `images`: each an absolute path (a vision-language model reads the files)."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise TypeError("`images` is a list of image file paths, one per image of the row")
    return [os.path.abspath(os.fspath(p)) for p in paths]


def rows_of(rows):
    """`forward`'s rows: dicts as docs/serve.md has them, or bare token-id sequences (every
    token a label), or a 2-D array of them."""
    out = []
    for r in plain(rows):
        out.append(r if isinstance(r, dict) else {"input_ids": r})
    return out


def float_rows(lists, as_torch=False):
    """Each list of numbers as a 1-D float32 array (numpy), tensor (`as_torch`), or as it is
    when numpy is not installed."""
    if as_torch:
        import torch

        return [torch.tensor(v, dtype=torch.float32) for v in lists]
    np = _numpy()
    if np is None:
        return [list(v) for v in lists]
    return [np.asarray(v, dtype=np.float32) for v in lists]


def _numpy():
    if "numpy" in sys.modules:
        return sys.modules["numpy"]
    try:
        import numpy
    except ImportError:
        return None
    return numpy
