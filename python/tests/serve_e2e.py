"""A real `mt-launch serve` driven through megatrain.Engine, on CPU (run by
launcher/tests/serve_client.rs, once per worker count):

  serve_e2e.py --launcher target/release/mt-launch --config configs/tiny.yaml --workers W \
      [--dtype float32|bfloat16] --work DIR

1. a second client is told the server is busy; train_step + optimizer_step on one batch of
   SFT rows, five times: the loss falls;
2. forward_logprobs equals transformers' log_softmax gathered at the labels on the
   exported model, within a tolerance derived from transformers itself: the engine's
   values are as close to an f64 evaluation of the same weights as transformers' own in
   model.dtype are (4 times their largest error, plus 8 f32 ulps of the value);
3. state_dict_views at a version equal the exported safetensors of that version bit for bit;
4. the server and its workers are gone after `shutdown()`, and a second Engine's after the
   object is dropped without it (garbage collection);
5. and a third's after its client process is killed (SIGKILL).

Prints one JSON line: the losses, the grad norms, the largest log-prob differences and the
pids seen (the Rust side checks again that none is left).
"""

import argparse
import gc
import json
import math
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import megatrain  # noqa: E402
from procs import alive  # noqa: E402


def children(pid):
    """The pids whose parent is `pid` (its workers)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return out


def gone(pids, timeout=30.0):
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def hf_logprobs(model, rows):
    """transformers' per-row label log-probabilities (labels shifted, -100 skipped)."""
    out = []
    for r in rows:
        ids = torch.tensor([r["input_ids"]])
        labels = torch.tensor(r.get("labels", r["input_ids"]))
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        lp = torch.log_softmax(logits, dim=-1)
        tgt = labels[1:]
        keep = tgt != -100
        out.append(lp[keep].gather(1, tgt[keep].unsqueeze(1)).squeeze(1))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--launcher", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=0, help="0: CPU workers (--workers); else one worker per GPU")
    ap.add_argument("--dtype", default="float32", help="model.dtype: the store's and the compute's")
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    rng = random.Random(0)
    rows = [{"input_ids": [rng.randrange(3, 500) for _ in range(24)]} for _ in range(4)]
    rows[1]["labels"] = [-100] * 10 + rows[1]["input_ids"][10:]
    overrides = {"checkpoint.dir": os.path.join(args.work, "ck"),
                 "training.output_dir": os.path.join(args.work, "out"),
                 "training.batch_size": 4, "dataset.max_seq_len": 32, "model.dtype": args.dtype}
    start = dict(gpus=args.gpus, workers=args.workers if args.gpus == 0 else None,
                 launcher=args.launcher, overrides=overrides,
                 log=os.path.join(args.work, "server.log"))
    report = {}
    engine = megatrain.Engine(args.config, **start)
    pids = [engine.pid] + children(engine.pid)
    workers = args.workers if args.gpus == 0 else args.gpus
    assert len(pids) == 1 + workers, f"server and workers: {pids}"
    info = engine.info()
    assert info["protocol"] == 1 and info["step"] == 0, info
    other = megatrain.Engine.attach(engine.socket_path)  # one client at a time
    try:
        other.info()
        raise AssertionError("a second client was served")
    except megatrain.EngineError as e:
        assert str(e).startswith("busy"), e
    other.close()

    # 1. the loss falls on one batch trained on repeatedly
    losses, norms = [], []
    for _ in range(5):
        losses.append(engine.train_step(rows=rows)["loss"])
        norms.append(engine.optimizer_step()["grad_norm"])
    assert losses[-1] < losses[0], f"the loss does not fall: {losses}"
    report.update(losses=losses, grad_norms=norms)

    # 2. forward log-probabilities against transformers on the exported model
    export = engine.export(os.path.join(args.work, "export"))
    got = engine.forward_logprobs(rows, as_torch=True)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=dtype).eval()
    ref_dt = hf_logprobs(model, rows)
    ref64 = hf_logprobs(model.double(), rows)
    worst = []
    for i, (g, r_dt, r64) in enumerate(zip(got, ref_dt, ref64)):
        assert g.shape == r64.shape, f"row {i}: {tuple(g.shape)} log-probs, transformers {tuple(r64.shape)}"
        hf_err = (r_dt.double() - r64).abs().max().item()
        err = (g.double() - r64).abs()
        tol = 4 * hf_err + 8 * torch.finfo(torch.float32).eps * r64.abs()
        assert bool((err <= tol).all()), f"row {i}: engine {err.max().item():.3e} from f64, tolerance {tol.max():.3e}"
        worst.append([err.max().item(), hf_err])
    report["logprob_errors"] = worst
    # ... and with each label token's entropy: the same log-probabilities, bit for bit, and
    # entropies between 0 and log(vocabulary) (their values against transformers' are
    # launcher/tests/serve.rs's).
    both = engine.forward(rows, entropy=True, as_torch=True)
    vocab = engine.info()["vocab_size"]
    for i, (g, lp, ent) in enumerate(zip(got, both["logprobs"], both["entropy"])):
        assert torch.equal(g, lp), f"row {i}: log-probabilities differ with entropy asked"
        ok = ent.shape == g.shape and bool(((ent >= -1e-4) & (ent <= math.log(vocab) + 1e-4)).all())
        assert ok, f"row {i}: entropies {ent} outside [0, log {vocab}]"

    # 3. the views at this version are the export's tensors, bit for bit
    v = engine.weights_version()
    assert v == 2 * len(losses), f"version page {v} after {len(losses)} updates"
    tensors = {}
    for f in os.listdir(export):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(export, f)))
    views = dict(engine.state_dict_views())
    assert engine.views_consistent(v)
    assert views, "no tensors in the store"
    for name, t in views.items():
        e = tensors[name]
        assert e.dtype == t.dtype and e.shape == t.shape, f"{name}: {e.dtype} {tuple(e.shape)} vs {t.dtype} {tuple(t.shape)}"
        assert torch.equal(e.view(torch.uint8), t.view(torch.uint8)), f"{name}: bits differ"
    report["tensors"] = len(views)

    # 4. nothing left after shutdown, nor after an Engine dropped without one
    engine.shutdown()
    left = gone(pids)
    assert not left, f"left after shutdown: {left}"
    second = megatrain.Engine(args.config, **start)
    pids2 = [second.pid] + children(second.pid)
    assert second.info()["step"] == 0
    del second
    gc.collect()
    left = gone(pids2)
    assert not left, f"left after the Engine was dropped: {left}"

    # 5. nor after the client is killed (SIGKILL: no finalizer runs; the server's parent-death
    # signal stops it)
    code = (f"import sys, time; sys.path.insert(0, {os.path.join(os.path.dirname(__file__), '..')!r}); "
            "import megatrain; "
            f"e = megatrain.Engine(*{[args.config]!r}, **{start!r}); print(e.pid, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server = int(child.stdout.readline())
    child.stdout.close()
    pids3 = [server] + children(server)
    child.kill()
    child.wait()
    left = gone(pids3)
    assert not left, f"left after the client was killed: {left}"
    report["pids"] = pids + pids2 + pids3
    del views  # the mapping goes with the last view
    print(json.dumps(report))


if __name__ == "__main__":
    main()
