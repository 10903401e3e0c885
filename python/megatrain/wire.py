"""The wire of `mt-launch serve` (docs/serve.md): frames over a Unix domain socket.

A frame is the length of its body in bytes (8 bytes, unsigned, little-endian) then the
body, one JSON object in UTF-8. File descriptors travel beside a frame's bytes as
`SCM_RIGHTS` ancillary data (the `weights` answer carries two); `recv_msg` collects those
of any chunk of the frame, received close-on-exec (Linux's MSG_CMSG_CLOEXEC), and hands
them to the caller, who owns them from then on.

Standard library only. Errors are `WireError` (an `EngineError`): `Closed` when the peer
closed the connection at a frame boundary, otherwise a message naming what was wrong with
the bytes; nothing here retries.
"""

import array
import json
import math
import os
import socket
import struct

HEADER = struct.Struct("<Q")
# A frame longer than this is refused before its body is read: a length this large is a
# garbled stream, not a batch (64 x 1024 token ids are under a megabyte of JSON).
MAX_FRAME = 1 << 32
# The most fds a frame may carry; more, and the kernel truncates (MSG_CTRUNC, refused).
MAX_FDS = 8
_CHUNK = 1 << 20


class EngineError(Exception):
    """An error from the engine or on the way to it: one line naming what was wrong."""


class WireError(EngineError):
    """The bytes on the socket are not frames of docs/serve.md, or the socket broke."""


class Closed(WireError):
    """The peer closed the connection at a frame boundary."""


def encode(obj):
    """The frame of `obj` (a dict), as bytes. A non-finite number anywhere is refused
    naming its place (JSON cannot carry NaN or infinities)."""
    if not isinstance(obj, dict):
        raise TypeError(f"a frame's body is a JSON object, not {type(obj).__name__}")
    try:
        body = json.dumps(obj, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()
    except ValueError:
        where = non_finite(obj)
        raise EngineError(f"{where or 'the request'}: not a finite number (JSON cannot carry NaN or inf)") from None
    return HEADER.pack(len(body)) + body


def non_finite(obj, path=""):
    """The place (`rollouts[3].reward`) of the first NaN or infinity in `obj`, or None."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (path or "value")
    if isinstance(obj, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    else:
        return None
    for p, v in items:
        found = non_finite(v, p)
        if found:
            return found
    return None


def send_msg(sock, obj, fds=()):
    """Sends one frame; `fds` go beside its first byte (SCM_RIGHTS) and stay the caller's."""
    data = encode(obj)
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([data], anc)
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def _recv_chunk(sock, n):
    """Up to `n` bytes and the fds beside them, received close-on-exec.

    recvmsg itself rather than socket.recv_fds (the same call otherwise): recv_fds drops
    its flags argument (CPython 3.9-3.13), so it cannot ask for MSG_CMSG_CLOEXEC, and an fd
    made non-inheritable afterwards could leak into a child forked meanwhile, keeping the
    store's memory alive as long as that child lives."""
    ints = array.array("i")
    data, anc, msg_flags, _ = sock.recvmsg(n, socket.CMSG_SPACE(MAX_FDS * ints.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            ints.frombytes(payload[: len(payload) - len(payload) % ints.itemsize])
    fds = list(ints)
    if msg_flags & socket.MSG_CTRUNC:
        close_fds(fds)
        raise WireError(f"more than {MAX_FDS} file descriptors beside a frame (ancillary data truncated)")
    return data, fds


def _recv_exact(sock, n, fds, what):
    parts, got = [], 0
    while got < n:
        try:
            data, more = _recv_chunk(sock, min(n - got, _CHUNK))
        except OSError as e:
            close_fds(fds)
            raise WireError(f"the connection broke while reading {what}: {e}") from None
        fds.extend(more)
        if not data:
            close_fds(fds)
            if what == "a frame header" and got == 0:
                raise Closed("the server closed the connection")
            raise WireError(f"the connection closed in the middle of {what} ({got} of {n} bytes)")
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def recv_msg(sock):
    """One frame: (the JSON object, [the fds that came beside it]). The fds are the
    caller's to close, also when it does not expect any."""
    fds = []
    (n,) = HEADER.unpack(_recv_exact(sock, HEADER.size, fds, "a frame header"))
    if n > MAX_FRAME:
        close_fds(fds)
        raise WireError(f"a frame of {n} bytes (the limit is {MAX_FRAME}): not a megatrain server?")
    body = _recv_exact(sock, n, fds, "a frame body")
    try:
        obj = json.loads(body)
    except ValueError as e:
        close_fds(fds)
        raise WireError(f"a frame body of {n} bytes is not JSON: {e}") from None
    if not isinstance(obj, dict):
        close_fds(fds)
        raise WireError(f"a frame body is JSON {type(obj).__name__}, not an object")
    return obj, fds


def close_fds(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
