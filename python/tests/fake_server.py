"""A stand-in for `mt-launch serve` speaking docs/serve.md's wire, for the Engine's own
tests (test_engine.py): start-up, process ownership, errors and fds, without building or
running the real server (launcher/tests/serve_client.rs drives that one).

    fake_server.py serve --config FILE --socket PATH [--gpus N] [--workers W] [--set k=v ...]

FILE is JSON: {"startup": "fail" | "hang"} misbehave before serving. The store holds one
float32 tensor `w` (2 x 3) whose values are the number of updates applied; the version page
is twice that. Commands: those of docs/serve.md, plus `die` (exit 7 without answering) and `lose_worker`
(a fatal answer, then exit 1).
"""

import argparse
import json
import os
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatrain import wire  # noqa: E402

HEADER = 4096


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verb")
    ap.add_argument("--config", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--gpus")
    ap.add_argument("--workers")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    print("fake server starting", flush=True)
    if cfg.get("startup") == "fail":
        print("error: model.path: no such directory", file=sys.stderr, flush=True)
        sys.exit(3)
    if cfg.get("startup") == "hang":
        time.sleep(3600)
    store = os.memfd_create("store")
    os.ftruncate(store, HEADER + 24)
    page = os.memfd_create("version")
    os.ftruncate(page, 4096)
    state = {"step": 0, "args": vars(args), "lr": 0.5}

    def update():
        os.pwrite(page, struct.pack("<Q", 2 * state["step"] + 1), 0)
        state["step"] += 1
        os.pwrite(store, struct.pack("<6f", *[float(state["step"])] * 6), HEADER)
        os.pwrite(page, struct.pack("<Q", 2 * state["step"]), 0)

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    srv.bind(args.socket)
    os.umask(old)
    srv.listen(8)
    print(f"serving on {args.socket}", flush=True)
    while True:
        conn, _ = srv.accept()
        while True:
            try:
                req, fds = wire.recv_msg(conn)
            except wire.WireError:
                break
            wire.close_fds(fds)
            answer, send = handle(req, state, update), []
            if req.get("cmd") == "weights":
                send = [store, page]
            wire.send_msg(conn, answer, fds=send)
            if answer.get("fatal"):
                sys.exit(1)
            if req.get("cmd") == "shutdown":
                os.unlink(args.socket)
                return
        conn.close()


def labelled(row):
    labels = row.get("labels", row["input_ids"])
    return sum(1 for t in labels[1:] if t != -100)


def handle(req, state, update):
    cmd = req.get("cmd")
    if cmd == "info":
        return {"ok": True, "protocol": 1, "step": state["step"], "version": 2 * state["step"],
                "args": state["args"], "pid": os.getpid(), "lr": state["lr"], "calls": state.get("calls", [])}
    if cmd == "train_step":
        rows = req.get("rows")
        for i, r in enumerate(rows or []):
            for j, t in enumerate(r["input_ids"]):
                if not isinstance(t, int) or not 0 <= t < 256:
                    return {"ok": False, "error": f"rows[{i}].input_ids[{j}]: token id {t} out of range 0..256"}
        return {"ok": True, "loss": 1.25, "units": len(rows or []), "tokens": 0, "metrics": {}, "echo": req}
    if cmd == "forward":  # -0.5, -1.0, ... for each label token (labels shifted, as the server's)
        lps = [[-0.5 * (k + 1) for k in range(labelled(r))] for r in req["rows"]]
        answer = {"ok": True, "logprobs": [sum(lp) for lp in lps] if req.get("sum") else lps}
        if req.get("entropy"):
            answer["entropy"] = [[0.25] * len(lp) for lp in lps]
        return answer
    if cmd == "optimizer_step":
        update()
        return {"ok": True, "step": state["step"], "grad_norm": 0.25, "lr": req.get("lr", state["lr"]),
                "skipped": False}
    if cmd == "set_lr":
        state["lr"] = req["lr"]
        return {"ok": True, "lr": req["lr"]}
    if cmd == "save":
        return {"ok": True, "dir": f"/ck/step-{state['step']}"}
    if cmd == "export":
        return {"ok": True, "dir": req["dir"]}
    if cmd in ("sleep", "wake"):
        state.setdefault("calls", []).append(cmd)
        return {"ok": True}
    if cmd == "shutdown":
        return {"ok": True}
    if cmd == "weights":
        return {"ok": True, "version": 2 * state["step"], "dtype": "float32", "size": 24,
                "tensors": [{"name": "w", "shape": [2, 3], "offset": HEADER, "nbytes": 24}]}
    if cmd == "die":
        os._exit(7)
    if cmd == "lose_worker":
        return {"ok": False, "error": "worker 1 died (SIGKILL)", "fatal": True}
    return {"ok": False, "error": f"unknown command {cmd!r}"}


if __name__ == "__main__":
    main()
