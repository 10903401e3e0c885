"""The wire of docs/serve.md over real sockets: frames (u64 LE length + JSON object) both
ways, fds beside a frame (SCM_RIGHTS, real memfds), every way a stream can be wrong, and
the weights mapped from a memfd as the `weights` answer hands them over (views.py).

    python -m unittest discover -s python/tests      (or python -m pytest python/tests)
"""

import json
import mmap
import os
import socket
import struct
import sys
import threading
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatrain import EngineError, wire  # noqa: E402
from megatrain.views import Weights  # noqa: E402


def memfd(data, name="t"):
    fd = os.memfd_create(name)
    os.write(fd, data)
    return fd


class Frames(unittest.TestCase):
    def setUp(self):
        self.a, self.b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def tearDown(self):
        self.a.close()
        self.b.close()

    def test_header_is_u64_le_length_of_the_json_body(self):
        wire.send_msg(self.a, {"cmd": "info", "x": "é"})
        raw = self.b.recv(1 << 16)
        (n,) = struct.unpack("<Q", raw[:8])
        self.assertEqual(n, len(raw) - 8)
        self.assertEqual(json.loads(raw[8:].decode("utf-8")), {"cmd": "info", "x": "é"})

    def test_round_trip_small_empty_and_large(self):
        big = {"rows": [{"input_ids": list(range(i, i + 1024))} for i in range(64)], "r": 0.1 + 0.2}
        for obj in ({}, {"ok": True, "lr": 5e-3, "n": None}, big):
            t = threading.Thread(target=wire.send_msg, args=(self.a, obj))
            t.start()  # the large one exceeds the socket buffer: the reader drains it
            got, fds = wire.recv_msg(self.b)
            t.join()
            self.assertEqual(got, obj)
            self.assertEqual(fds, [])

    def test_frames_split_across_writes_are_joined(self):
        frame = wire.encode({"cmd": "forward", "rows": [[1, 2, 3]]})
        for i in range(len(frame)):
            self.a.sendall(frame[i:i + 1])
        self.assertEqual(wire.recv_msg(self.b)[0]["rows"], [[1, 2, 3]])

    def test_two_fds_beside_a_frame_are_the_same_files_close_on_exec(self):
        fds = [memfd(b"store" * 1000, "store"), memfd(struct.pack("<Q", 6), "version")]
        wire.send_msg(self.a, {"ok": True, "version": 6}, fds=fds)
        got, recv = wire.recv_msg(self.b)
        try:
            self.assertEqual(got["version"], 6)
            self.assertEqual(len(recv), 2)
            for sent, fd in zip(fds, recv):
                self.assertNotEqual(sent, fd)
                self.assertEqual(os.fstat(sent).st_ino, os.fstat(fd).st_ino)
                self.assertFalse(os.get_inheritable(fd))
            with mmap.mmap(recv[1], 8, prot=mmap.PROT_READ) as m:
                self.assertEqual(struct.unpack("<Q", m[:8])[0], 6)
            # written after the hand-over, seen through the received fd: one file, not a copy
            os.pwrite(fds[0], b"STORE", 0)
            self.assertEqual(os.pread(recv[0], 5, 0), b"STORE")
        finally:
            wire.close_fds(fds + recv)

    def test_too_many_fds_are_refused_and_closed(self):
        fds = [memfd(b"x") for _ in range(wire.MAX_FDS + 2)]
        wire.send_msg(self.a, {"ok": True}, fds=fds)
        with self.assertRaisesRegex(wire.WireError, "truncated"):
            wire.recv_msg(self.b)
        wire.close_fds(fds)

    def test_closed_at_a_boundary_and_mid_frame(self):
        self.a.close()
        with self.assertRaises(wire.Closed):
            wire.recv_msg(self.b)
        a, b = socket.socketpair()
        a.sendall(wire.encode({"cmd": "info"})[:11])
        a.close()
        with self.assertRaisesRegex(wire.WireError, r"middle of a frame body \(3 of \d+ bytes\)") as e:
            wire.recv_msg(b)
        self.assertNotIsInstance(e.exception, wire.Closed)
        b.close()
        a, b = socket.socketpair()
        a.sendall(b"\x05\x00")
        a.close()
        with self.assertRaisesRegex(wire.WireError, r"middle of a frame header \(2 of 8"):
            wire.recv_msg(b)
        b.close()

    def test_bad_bodies_and_lengths(self):
        for raw, msg in ((struct.pack("<Q", wire.MAX_FRAME + 1), "limit"),
                         (struct.pack("<Q", 3) + b"{x}", "not JSON"),
                         (struct.pack("<Q", 2) + b"[]", "not an object")):
            a, b = socket.socketpair()
            a.sendall(raw)
            with self.assertRaisesRegex(wire.WireError, msg):
                wire.recv_msg(b)
            a.close()
            b.close()

    def test_non_finite_numbers_are_refused_naming_the_field(self):
        for bad in (float("nan"), float("inf"), -float("inf")):
            req = {"cmd": "train_step", "rollouts": [{"reward": 1.0}, {"old_logps": [0.0, bad]}]}
            with self.assertRaisesRegex(EngineError, r"^rollouts\[1\]\.old_logps\[1\]: not a finite"):
                wire.encode(req)
        with self.assertRaises(TypeError):
            wire.encode([1, 2])


class Views(unittest.TestCase):
    """A store laid out as the server's: tensors at offsets of one memfd, a version page."""

    def setUp(self):
        import torch

        self.torch = torch
        self.a = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7
        self.b = torch.tensor([1.5, -2.25, 3e-3], dtype=torch.bfloat16)
        self.store = bytearray(8192)
        pa = self.a.numpy().tobytes()
        pb = self.b.view(torch.int16).numpy().tobytes()
        self.store[4096:4096 + len(pa)] = pa
        self.store[5000:5000 + len(pb)] = pb

    def weights(self, dtype, tensors, version=4):
        fds = [memfd(bytes(self.store), "store"), memfd(struct.pack("<Q", version), "version")]
        self.page = os.dup(fds[1])
        self.addCleanup(os.close, self.page)
        return Weights({"ok": True, "version": version, "dtype": dtype, "size": len(self.store),
                        "tensors": tensors}, fds)

    def test_views_are_the_bytes_at_their_offsets(self):
        w = self.weights("float32", [{"name": "a", "shape": [2, 3], "offset": 4096, "nbytes": 24}])
        (name, t), = list(w.tensors())
        self.assertEqual(name, "a")
        self.assertTrue(self.torch.equal(t, self.a))
        w2 = self.weights("bfloat16", [{"name": "b", "shape": [3], "offset": 5000, "nbytes": 6}])
        (_, t2), = list(w2.tensors())
        self.assertEqual(t2.dtype, self.torch.bfloat16)
        self.assertTrue(self.torch.equal(t2, self.b))

    def test_a_view_outlives_its_weights_object(self):
        w = self.weights("float32", [{"name": "a", "shape": [2, 3], "offset": 4096, "nbytes": 24}])
        t = next(w.tensors())[1]
        del w
        import gc

        gc.collect()
        self.assertTrue(self.torch.equal(t, self.a))

    def test_seqlock(self):
        w = self.weights("float32", [], version=4)
        v = w.version()
        self.assertEqual(v, 4)
        self.assertTrue(w.consistent(v))
        os.pwrite(self.page, struct.pack("<Q", 5), 0)  # an update writing
        self.assertEqual(w.version(), 5)
        self.assertFalse(w.consistent(v))
        self.assertFalse(w.consistent(5))  # odd: never consistent
        os.pwrite(self.page, struct.pack("<Q", 6), 0)
        self.assertFalse(w.consistent(v))  # a whole update happened meanwhile
        self.assertTrue(w.consistent(w.version()))

    def test_copy_into_converts_and_names_what_is_missing(self):
        w = self.weights("bfloat16", [{"name": "b", "shape": [3], "offset": 5000, "nbytes": 6}], version=8)
        dst = {"b": self.torch.zeros(3)}
        self.assertEqual(w.copy_into(dst), 8)
        self.assertTrue(self.torch.equal(dst["b"], self.b.float()))
        with self.assertRaisesRegex(EngineError, r"no parameter to go to: \['b'\]"):
            w.copy_into({})

    def test_bad_answers(self):
        with self.assertRaisesRegex(EngineError, "does not fit"):
            self.weights("float32", [{"name": "a", "shape": [2, 3], "offset": 8190, "nbytes": 24}])
        with self.assertRaisesRegex(EngineError, "does not fit"):
            self.weights("float32", [{"name": "a", "shape": [2, 4], "offset": 0, "nbytes": 24}])
        with self.assertRaisesRegex(EngineError, "lacks"):
            self.weights("float32", [{"name": "a"}])
        with self.assertRaisesRegex(EngineError, "int8"):
            self.weights("int8", [])
        fd = memfd(b"x")
        with self.assertRaisesRegex(EngineError, "1 file descriptors, expected 2"):
            Weights({"dtype": "float32"}, [fd])
        with self.assertRaises(OSError):
            os.fstat(fd)  # closed by the refusal


if __name__ == "__main__":
    unittest.main()


class Batches(unittest.TestCase):
    def test_a_rows_images_become_absolute_paths(self):
        import pathlib

        from megatrain import convert

        here = os.getcwd()
        rows = convert.rows_of([{"input_ids": [1, 2], "images": ["a.png", pathlib.Path("/x/b.jpg")]}])
        self.assertEqual(rows, [{"input_ids": [1, 2], "images": [os.path.join(here, "a.png"), "/x/b.jpg"]}])
        pairs = convert.plain([{"chosen_input_ids": (3,), "images": ("c.webp",)}])
        self.assertEqual(pairs[0]["images"], [os.path.join(here, "c.webp")])
        with self.assertRaises(TypeError):
            convert.plain([{"input_ids": [1], "images": "a.png"}])
