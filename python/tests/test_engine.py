"""megatrain.Engine against a stand-in server (fake_server.py, the real wire): the start-up
and its failures, each command's request and answer, batches from numpy and torch, errors
from the server, and a started server never outliving its Engine (shutdown, garbage
collection, interpreter exit, the client killed).

    python -m unittest discover -s python/tests
"""

import gc
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import megatrain  # noqa: E402
from procs import alive  # noqa: E402
from megatrain import Engine, EngineError  # noqa: E402


def running_with(arg):
    """The live pids whose command line has `arg`."""
    found = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if arg.encode() in f.read().split(b"\0") and alive(int(d)):
                    found.append(int(d))
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError, NotADirectoryError):
            pass
    return found


def wait_gone(pid, timeout=20.0):
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


class FakeServer(unittest.TestCase):
    """Helpers: a launcher script running fake_server.py, configs for it."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="megatrain-test-")
        cls.launcher = os.path.join(cls.dir, "mt-launch")
        with open(cls.launcher, "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.join(HERE, "fake_server.py")}" "$@"\n')
        os.chmod(cls.launcher, 0o755)
        cls.log = os.path.join(cls.dir, "server.log")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def config(self, **cfg):
        path = os.path.join(self.dir, f"config-{len(os.listdir(self.dir))}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        return path

    def engine(self, **kw):
        kw.setdefault("log", self.log)
        return Engine(self.config(), gpus=0, launcher=self.launcher, **kw)


class Fake(FakeServer):
    def test_commands(self):
        import numpy as np
        import torch

        with self.engine(workers=2, overrides={"training.num_steps": 3, "model.path": "m", "x.on": True}) as e:
            info = e.info()
            self.assertEqual(info["protocol"], 1)
            self.assertEqual(info["pid"], e.pid)
            self.assertEqual(info["args"]["set"], ["training.num_steps=3", "model.path=m", "x.on=true"])
            self.assertEqual((info["args"]["gpus"], info["args"]["workers"]), ("0", "2"))
            self.assertTrue(stat.S_IMODE(os.stat(os.path.dirname(e.socket_path)).st_mode) == 0o700)
            out = e.train_step(rows=[{"input_ids": np.array([1, 2, 3]), "labels": torch.tensor([-100, 2, 3])},
                                     {"input_ids": (4, 5), "w": np.float32(0.5)}])
            self.assertEqual(out["echo"]["rows"], [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
                                                   {"input_ids": [4, 5], "w": 0.5}])
            self.assertEqual(e.train_step(rows=[[1, 2]], loss_units=np.int64(7))["echo"]["loss_units"], 7)
            lp = e.forward_logprobs(torch.tensor([[1, 2, 3], [4, 5, 6]]))
            self.assertEqual([a.dtype for a in lp], [np.float32] * 2)
            self.assertEqual(lp[1].tolist(), [-0.5, -1.0])
            lp = e.forward_logprobs([{"input_ids": [1, 2]}], as_torch=True)
            self.assertTrue(torch.equal(lp[0], torch.tensor([-0.5])))
            out = e.forward([[1, 2, 3]], entropy=True)
            self.assertEqual((out["logprobs"][0].tolist(), out["entropy"][0].tolist()), ([-0.5, -1.0], [0.25, 0.25]))
            self.assertEqual(e.forward([[1, 2, 3], [4, 5]], sum=True)["logprobs"], [-1.5, -0.5])
            self.assertEqual(e.save(), "/ck/step-0")
            self.assertEqual(e.set_lr(0.125), 0.125)
            self.assertEqual(e.optimizer_step(lr=0.25)["lr"], 0.25)
            self.assertTrue(e.export("rel").startswith("/"))
            self.assertEqual(e.sleep(), {})
            self.assertEqual(e.wake(), {})

            v = e.weights_version()
            self.assertEqual(v, 2)
            views = dict(e.state_dict_views())
            self.assertTrue(torch.equal(views["w"], torch.ones(2, 3)))
            self.assertTrue(e.views_consistent(v))
            e.optimizer_step()  # the views are the store: they follow it
            self.assertTrue(torch.equal(views["w"], torch.full((2, 3), 2.0)))
            self.assertFalse(e.views_consistent(v))
            dst = torch.nn.Module()
            dst.w = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))
            self.assertEqual(e.copy_weights_to(dst), 4)
            self.assertTrue(torch.equal(dst.w.detach(), torch.full((2, 3), 2.0, dtype=torch.bfloat16)))
            pid, sockdir = e.pid, os.path.dirname(e.socket_path)
        self.assertTrue(wait_gone(pid))
        self.assertFalse(os.path.exists(sockdir))
        with self.assertRaisesRegex(EngineError, "shut down"):
            e.info()
        e.shutdown()  # again: nothing

    def test_errors_from_the_server_change_nothing(self):
        with self.engine() as e:
            with self.assertRaisesRegex(EngineError, r"^rows\[0\]\.input_ids\[1\]: token id 999 out of range"):
                e.train_step(rows=[{"input_ids": [1, 999]}])
            with self.assertRaisesRegex(EngineError, "^rollouts\\[0\\]\\.reward: not a finite"):
                e.train_step(rollouts=[{"prompt_ids": [1], "completion_ids": [2], "reward": float("nan")}])
            with self.assertRaisesRegex(EngineError, "one of rows=, pairs=, rollouts="):
                e.train_step(rows=[], pairs=[])
            self.assertEqual(e.info()["step"], 0)  # still serving, on the same connection

    def test_startup_failure_raises_with_the_last_lines(self):
        with self.assertRaises(EngineError) as c:
            Engine(self.config(startup="fail"), launcher=self.launcher, log=self.log)
        msg = str(c.exception)
        self.assertIn("exited with status 3 during start-up", msg)
        self.assertIn("fake server starting", msg)
        self.assertIn("error: model.path: no such directory", msg)

    def test_startup_timeout_kills_the_server(self):
        private = tempfile.mkdtemp(dir=self.dir)
        config = self.config(startup="hang")
        saved, tempfile.tempdir = tempfile.tempdir, private  # where the Engine makes its own
        try:
            with self.assertRaisesRegex(EngineError, "did not print `serving on` within 1 s"):
                Engine(config, launcher=self.launcher, log=self.log, startup_timeout=1)
        finally:
            tempfile.tempdir = saved
        self.assertEqual(os.listdir(private), [], "the private socket directory is removed")
        self.assertEqual(running_with(config), [], "the server is killed")

    def test_a_server_that_dies_is_a_clear_error(self):
        e = self.engine()
        with self.assertRaisesRegex(EngineError, r"(?s)^die: the server closed the connection "
                                                 r"\(mt-launch serve exited with status 7\):.*serving on"):
            e._call("die")
        with self.assertRaisesRegex(EngineError, "cannot connect"):
            e.info()
        e.shutdown()

    def test_a_fatal_answer_says_the_server_stopped(self):
        e = self.engine()
        with self.assertRaisesRegex(EngineError, r"(?s)^worker 1 died \(SIGKILL\) \(fatal: the server stopped\) "
                                                 r"\(mt-launch serve exited with status 1\)"):
            e._call("lose_worker")
        e.shutdown()

    def test_no_launcher(self):
        with self.assertRaisesRegex(EngineError, "cannot run /nonexistent/mt-launch"):
            Engine(self.config(), launcher="/nonexistent/mt-launch")

    def test_attach_and_close_leave_the_server_serving(self):
        with self.engine() as owner:
            owner._res.disconnect()  # one client at a time: let the attached one in
            other = Engine.attach(owner.socket_path)
            self.assertIsNone(other.pid)
            other.optimizer_step()
            other.close()
            self.assertEqual(owner.info()["step"], 1)  # reconnects
            self.assertTrue(alive(owner.pid))

    def test_garbage_collection_stops_the_server(self):
        e = self.engine()
        pid = e.pid
        del e
        gc.collect()
        self.assertTrue(wait_gone(pid))

    def run_client(self, body):
        """A Python that starts an Engine, prints its server's pid, then runs `body`."""
        code = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {os.path.join(HERE, '..')!r})
            import megatrain
            e = megatrain.Engine({self.config()!r}, launcher={self.launcher!r}, log={self.log!r})
            print(e.pid, flush=True)
        """) + textwrap.dedent(body)
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)

    def test_interpreter_exit_stops_the_server(self):
        p = self.run_client("")
        pid = int(p.stdout.readline())
        p.stdout.close()
        self.assertEqual(p.wait(timeout=60), 0)
        self.assertTrue(wait_gone(pid))

    def test_a_killed_client_takes_its_server_down(self):
        p = self.run_client("import time; time.sleep(600)")
        pid = int(p.stdout.readline())
        p.stdout.close()
        self.assertTrue(alive(pid))
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.assertTrue(wait_gone(pid))


class VerlAdapter(FakeServer):
    """examples/verl_engine.py's BaseEngine methods on the stand-in server (no verl)."""

    def test_batch_mapping_sleep_wake_and_views(self):
        import torch

        sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
        import verl_engine

        data = {"prompts": torch.tensor([[0, 5, 6], [7, 8, 9]]),
                "responses": torch.tensor([[1, 2, 0], [3, 0, 0]]),
                "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]),
                "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
                "advantages": torch.tensor([[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]]),
                "old_log_probs": torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]])}
        self.assertEqual(verl_engine.to_rollouts(data), [
            {"prompt_ids": [5, 6], "completion_ids": [1, 2], "advantage": 0.5, "old_logps": [-1.0, -2.0]},
            {"prompt_ids": [7, 8, 9], "completion_ids": [3], "advantage": -1.0, "old_logps": [-3.0]}])
        ve = verl_engine.MegatrainEngine(self.config(), gpus=0, launcher=self.launcher, log=self.log)
        try:
            out = ve.infer_batch(data)
            self.assertTrue(torch.equal(out["model_output"]["log_probs"],
                                        torch.tensor([[-0.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])))
            with ve.train_mode():
                out = ve.train_batch(data)
            self.assertEqual((out["loss"], out["metrics"]["grad_norm"]), ([1.25], 0.25))
            ve.to("cpu")
            ve.to("cpu")
            ve.to("cuda")
            self.assertEqual(ve.engine.info()["calls"], ["sleep", "wake"])
            self.assertEqual(ve.lr_scheduler_step(), 0.5)
            views, peft = ve.get_per_tensor_param()
            self.assertIsNone(peft)
            self.assertEqual([n for n, _ in views], ["w"])
        finally:
            ve.engine.shutdown()


class Launcher(unittest.TestCase):
    def test_explicit_then_env(self):
        from megatrain.server import find_launcher

        self.assertEqual(find_launcher("/x/mt-launch"), "/x/mt-launch")
        os.environ["MT_LAUNCH"] = "/y/mt-launch"
        try:
            self.assertEqual(find_launcher(), "/y/mt-launch")
        finally:
            del os.environ["MT_LAUNCH"]

    def test_version(self):
        self.assertEqual(megatrain.__version__, "0.1.0")


if __name__ == "__main__":
    unittest.main()
