"""Tests of benches/compare's parsers, table, input writers and monitor, on a CPU machine.

Run: python3 -m unittest discover -s benches/compare -p 'test_*.py'
testdata/h100_7b_b16/ours.jsonl is the first 3 steps of a real mt-launch run
(benches/results/metrics/qwen2.5-7b_4xH100-64c_2026-11-26_g1_b16.jsonl); the MegaTrain and
ZeRO-3 logs there are written in the formats their programs print (MegaTrain's train.py
logging lines, zero3.py's JSONL), with round figures so the expected means are exact.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import table  # noqa: E402
from table import read_json, read_lines  # noqa: E402

SAMPLE = os.path.join(HERE, "testdata", "h100_7b_b16")


def have(*mods):
    try:
        for m in mods:
            __import__(m)
        return True
    except ImportError:
        return False


class FlopsTest(unittest.TestCase):
    def test_both_formulas_equal_what_mt_launch_reported(self):
        # The step FLOPs from the shape, over each step's time, are the TFLOPS mt-launch
        # wrote for that step (src/metrics.rs step_flops): to rounding of f64 (1e-12).
        shape = read_json(os.path.join(SAMPLE, "shape.json"))
        mt, model = table.step_flops(shape)
        for line in read_lines(os.path.join(SAMPLE, "ours.jsonl")):
            m = json.loads(line)
            self.assertAlmostEqual(mt / m["step_time_s"] / 1e12 / m["tflops_megatrain"], 1.0, places=12)
            self.assertAlmostEqual(model / m["step_time_s"] / 1e12 / m["tflops_model"], 1.0, places=12)

    @unittest.skipUnless(have("torch", "safetensors"), "needs torch")
    def test_written_model_has_the_counted_parameters(self):
        # The tensors make_inputs.py writes for the full Qwen2.5-7B config count the
        # parameters mt-launch counted for it (the figure in the sample's shape.json, which
        # reproduces its reported TFLOPS above).
        import make_inputs
        base = read_json(os.path.join(ROOT, "configs", "qwen2.5-7b", "config.json"))
        c = make_inputs.model_config(base, 28, tiny=False)
        n = 0
        for _, shape in make_inputs.qwen2_tensors(c):
            k = 1
            for d in shape:
                k *= d
            n += k
        self.assertEqual(n, read_json(os.path.join(SAMPLE, "shape.json"))["params"])


class ParseTest(unittest.TestCase):
    def test_megatrain_log(self):
        r = table.parse_megatrain(os.path.join(SAMPLE, "megatrain.log"))
        self.assertEqual(r["step_s"], [9.5, 4.0, 6.0])
        self.assertEqual(r["loss"], [12.0123, 12.0100, 12.0050])
        self.assertEqual(r["own_tflops_megatrain"], [82.1, 195.0, 130.0])
        self.assertIn("CPUAdam", r["optimizer"])
        self.assertEqual(r["own_gpu_bytes"], 31.0 * 2**30)
        self.assertEqual(r["own_host_bytes"], 61.0 * 2**30)

    def test_ours_and_zero3(self):
        o = table.parse_ours(os.path.join(SAMPLE, "ours.jsonl"))
        self.assertEqual(len(o["step_s"]), 3)
        self.assertEqual(o["own_gpu_bytes"], 25426722816)
        z = table.parse_zero3(os.path.join(SAMPLE, "zero3.jsonl"))
        self.assertEqual(z["step_s"], [5.0])
        self.assertIn("CPUAdam", z["optimizer"])


class TableTest(unittest.TestCase):
    def rows(self, logs):
        text = table.render(logs, "H100-16c", "NVIDIA H100", "16")
        return text, {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()
                      if line.startswith("| ") and not line.startswith("| system")}

    def test_sample(self):
        text, rows = self.rows(SAMPLE)
        shape = read_json(os.path.join(SAMPLE, "shape.json"))
        mt, _ = table.step_flops(shape)
        # MegaTrain: the mean of steps 2 and 3 (5.0 s), the first discarded.
        mega = rows["MegaTrain (published, examples/sft/train.py)"].split(" | ")
        self.assertEqual(mega[3], "5.00")
        self.assertEqual(mega[4], f"{mt / 5.0 / 1e12:.1f}")
        self.assertEqual(mega[6], "95.0")  # host GB, monitor's meter
        self.assertEqual(mega[7], f"{95e9 / shape['params']:.1f}")
        # Ours: the mean of its steps 2 and 3.
        steps = [json.loads(l)["step_time_s"] for l in read_lines(os.path.join(SAMPLE, "ours.jsonl"))]
        self.assertEqual(rows["megatrain-rs (mt-launch)"].split(" | ")[3], f"{(steps[1] + steps[2]) / 2:.2f}")
        # ZeRO-3 crashed after one step: no figures, the CUDA OOM as the reason.
        z = rows["DeepSpeed ZeRO-3, offload params + optimizer"]
        self.assertIn("exit 1 after 1 step(s): torch.OutOfMemoryError: CUDA out of memory", z)
        self.assertIn("b16 x 1024", text)

    def test_not_run_killed_and_timed_out(self):
        with tempfile.TemporaryDirectory() as d:
            for f in os.listdir(SAMPLE):
                shutil.copy(os.path.join(SAMPLE, f), d)
            json.dump({"status": "not run", "reason": "no target/x/mt-launch"},
                      open(os.path.join(d, "ours.status.json"), "w"))
            mon = read_json(os.path.join(d, "zero3.mon.json"))
            json.dump(dict(mon, rc=-9, signal=9), open(os.path.join(d, "zero3.mon.json"), "w"))
            mon = read_json(os.path.join(d, "megatrain.mon.json"))
            json.dump(dict(mon, rc=-15, signal=15, timed_out=True),
                      open(os.path.join(d, "megatrain.mon.json"), "w"))
            _, rows = self.rows(d)
        self.assertIn("| no target/x/mt-launch |", rows["megatrain-rs (mt-launch)"])
        self.assertIn("killed (SIGKILL) after 1 step(s); host memory reached 103 of 134 GB",
                      rows["DeepSpeed ZeRO-3, offload params + optimizer"])
        # Cut short by its limit after 3 steps, MegaTrain keeps its figures, with a note.
        mega = rows["MegaTrain (published, examples/sft/train.py)"].split(" | ")
        self.assertEqual(mega[3], "5.00")


@unittest.skipUnless(have("torch", "transformers", "safetensors", "tokenizers"), "needs transformers")
class InputsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        subprocess.run([sys.executable, os.path.join(HERE, "make_inputs.py"), "--base-config",
                        os.path.join(ROOT, "configs", "qwen2.5-7b", "config.json"),
                        "--model-out", os.path.join(cls.tmp, "model"),
                        "--data-out", os.path.join(cls.tmp, "data"),
                        "--layers", "2", "--batch", "3", "--seq", "16", "--tiny"],
                       check=True, capture_output=True)
        cls.ids = [json.loads(l)["input_ids"] for l in read_lines(os.path.join(cls.tmp, "data", "tokens.jsonl"))]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def test_rows_and_model(self):
        import torch
        from transformers import AutoModelForCausalLM
        self.assertEqual([len(r) for r in self.ids], [16, 16, 16])
        shape = read_json(os.path.join(self.tmp, "data", "shape.json"))
        vocab = shape["vocab_size"]
        self.assertTrue(all(0 <= i < vocab - 1 for r in self.ids for i in r))
        m = AutoModelForCausalLM.from_pretrained(os.path.join(self.tmp, "model"), dtype=torch.bfloat16)
        self.assertEqual(sum(p.numel() for p in m.parameters()), shape["params"])
        self.assertEqual(m.model.layers[0].self_attn.q_proj.bias.abs().sum().item(), 0.0)

    @unittest.skipUnless(os.path.isfile(os.path.join(HERE, "vendor", "megatrain", "infinity", "data",
                                                     "datasets.py")), "needs vendor/ (fetch.sh)")
    def test_megatrain_reads_the_same_tokens(self):
        # MegaTrain's own ChatDataset, through the datasets shim and the word-level tokenizer,
        # yields exactly the ids ours reads, unpadded, every token a label.
        code = f"""
import json, sys
sys.path[:0] = [{os.path.join(HERE, 'shim')!r}, {os.path.join(HERE, 'vendor', 'megatrain')!r}]
from transformers import AutoTokenizer
from infinity.data.datasets import ChatDataset
tok = AutoTokenizer.from_pretrained({os.path.join(self.tmp, 'model')!r}, trust_remote_code=True)
ds = ChatDataset(tok, 16, dataset_name="synthetic", dataset_dir={os.path.join(self.tmp, 'data', 'megatrain')!r},
                 train_on_prompt=True)
print(json.dumps([[ds[i][k].tolist() for k in ("input_ids", "attention_mask", "labels")] for i in range(len(ds))]))
"""
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                             env=dict(os.environ, HF_HOME=os.path.join(self.tmp, "hf")))
        got = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertEqual(len(got), 3)
        for (ids, mask, labels), want in zip(got, self.ids):
            self.assertEqual(ids, want)
            self.assertEqual(mask, [1] * 16)
            self.assertEqual(labels, want)


class MonitorTest(unittest.TestCase):
    def run_monitor(self, d, code, timeout):
        subprocess.run([sys.executable, os.path.join(HERE, "monitor.py"), "--out", os.path.join(d, "m.json"),
                        "--log", os.path.join(d, "m.log"), "--timeout", str(timeout), "--interval", "0.1",
                        "--", sys.executable, "-c", code])
        return read_json(os.path.join(d, "m.json"))

    def test_peak_and_exit(self):
        with tempfile.TemporaryDirectory() as d:
            m = self.run_monitor(d, "import time; x = b'1' * (300 << 20); time.sleep(1.0)", 30)
        self.assertEqual(m["rc"], 0)
        self.assertFalse(m["timed_out"])
        self.assertGreater(m["tree_rss_peak_bytes"], 300 << 20)

    def test_time_limit_kills_the_group(self):
        with tempfile.TemporaryDirectory() as d:
            # A grandchild in the group, which would outlive a plain kill of the child.
            code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                    "'import time; time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)")
            m = self.run_monitor(d, code, 1)
            grandchild = int(open(os.path.join(d, "m.log")).read().split()[0])
        self.assertTrue(m["timed_out"])
        self.assertEqual(m["signal"], 15)
        self.assertLess(m["wall_s"], 10)
        for _ in range(50):  # reaped by init shortly after the kill
            if not os.path.exists(f"/proc/{grandchild}") or \
                    open(f"/proc/{grandchild}/stat").read().split(") ")[1][0] == "Z":
                break
            __import__("time").sleep(0.1)
        else:
            self.fail(f"pid {grandchild} outlived the time limit")


if __name__ == "__main__":
    unittest.main()
