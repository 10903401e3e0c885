"""The server's weight store, mapped read-only: (HF name, tensor) without a copy.

The `weights` answer (docs/serve.md) names each tensor of the store (`name`, `shape`,
`offset`, `nbytes`, in `dtype`) and carries two fds: the store's memfd and its version
page. Both are mapped read-only (`PROT_READ`, shared) and the fds closed; a tensor is
`torch.frombuffer` over the store's mapping at its offset, viewed to its shape.

Lifetime: a mapping lives as long as any tensor made from it (each holds the mmap object;
nothing here calls `close` on it, which would unmap memory that tensors still point at),
and keeps the store's memory alive that long, also after the server exits. Writing into a
view faults (the pages are read-only): copy first (`t.clone()`, `param.copy_(t)`).

The version page holds one little-endian u64, the server's seqlock: twice the number of
updates applied, plus one while an update is writing the store. A reader that reads an
even V (`version()`), reads or copies the tensors, then reads V again
(`consistent(V)`), has read update V / 2 whole; otherwise it read while an update was
writing and must read again ([`Weights.copy_into`] does that loop). The loads are in
program order: on x86-64 (total store order) the page's value read after the tensors
cannot be older than them; the server writes the odd value before the first byte of an
update and the even one after the last.

Without torch the tensors are numpy arrays (bfloat16 as its raw uint16 bits).
"""

import mmap
import os
import struct
import time
import warnings

from .wire import EngineError, close_fds

_U64 = struct.Struct("<Q")
_TORCH = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "f32": "float32",
          "float16": "float16", "f16": "float16"}
_NUMPY = {"bfloat16": "uint16", "float32": "float32", "float16": "float16"}
_ITEM = {"bfloat16": 2, "float32": 4, "float16": 2}


class Weights:
    """One `weights` answer, mapped: `tensors()`, `version()`, `consistent(v)`."""

    def __init__(self, answer, fds):
        try:
            if len(fds) != 2:
                raise EngineError(f"the weights answer came with {len(fds)} file descriptors, expected 2")
            self.dtype = _TORCH.get(str(answer.get("dtype")))
            if self.dtype is None:
                raise EngineError(f"the weights answer's dtype {answer.get('dtype')!r} is not one of "
                                  "bfloat16, float32, float16")
            self._store = _map(fds[0], "store")
            self._page = _map(fds[1], "version page")
        finally:
            close_fds(fds)
        if len(self._page) < _U64.size:
            raise EngineError(f"the version page is {len(self._page)} bytes, shorter than its u64")
        self.size = len(self._store)
        self.entries = [_entry(t, self.dtype, self.size) for t in answer.get("tensors", [])]

    def version(self):
        """The version page's u64: even between updates (2 x updates applied), odd while one
        writes the store."""
        return _U64.unpack_from(self._page, 0)[0]

    def consistent(self, version):
        """Whether tensors read after `version()` returned `version` are update `version`/2
        whole: `version` was even and the page still holds it."""
        return version % 2 == 0 and self.version() == version

    def tensors(self):
        """(HF name, read-only tensor) for each tensor of the store, in the store's order."""
        try:
            import torch
        except ImportError:
            torch = None
        for name, shape, offset, nbytes in self.entries:
            count = nbytes // _ITEM[self.dtype]
            if torch is None:
                import numpy as np

                yield name, np.frombuffer(self._store, dtype=_NUMPY[self.dtype], count=count,
                                          offset=offset).reshape(shape)
                continue
            with warnings.catch_warnings():
                # The mapping is read-only on purpose; torch warns that it cannot say so.
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(self._store, dtype=getattr(torch, self.dtype), count=count, offset=offset)
            yield name, t.view(shape)

    def copy_into(self, params, timeout=60.0):
        """Copies every store tensor into `params[name]` (a dict of tensors, e.g. a module's
        `state_dict()`; `copy_` converts the dtype) under the seqlock, again if an update
        wrote meanwhile. Returns the version read (even). Names absent from `params` are an
        error naming them."""
        missing = [e[0] for e in self.entries if e[0] not in params]
        if missing:
            raise EngineError(f"{len(missing)} store tensors have no parameter to go to: {missing[:5]}")
        deadline = time.monotonic() + timeout
        while True:
            v = self.version()
            if v % 2 == 0:
                import torch

                with torch.no_grad():
                    for name, t in self.tensors():
                        params[name].copy_(t)
                if self.consistent(v):
                    return v
            if time.monotonic() > deadline:
                raise EngineError(f"the weights kept changing for {timeout} s (version {v})")
            time.sleep(0.001)


def _map(fd, what):
    size = os.fstat(fd).st_size
    if size == 0:
        raise EngineError(f"the {what}'s file descriptor is empty")
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


def _entry(t, dtype, size):
    try:
        name, shape, offset, nbytes = str(t["name"]), [int(d) for d in t["shape"]], int(t["offset"]), int(t["nbytes"])
    except (KeyError, TypeError, ValueError):
        raise EngineError(f"a weights tensor entry lacks name, shape, offset or nbytes: {t!r}") from None
    count = 1
    for d in shape:
        count *= d
    if count * _ITEM[dtype] != nbytes or offset < 0 or offset + nbytes > size or offset % _ITEM[dtype]:
        raise EngineError(f"weights tensor {name}: shape {shape} in {dtype} at offset {offset} with "
                          f"{nbytes} bytes does not fit a store of {size} bytes")
    return name, shape, offset, nbytes
