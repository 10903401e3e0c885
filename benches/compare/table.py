#!/usr/bin/env python3
"""One markdown table from the logs of benches/compare/run.sh: per system its optimizer, mean
step time over the steps after the first, TFLOPS by MegaTrain's formula and by this
project's model formula (both computed here from the shape, the same way for every system),
host and GPU memory peaks (monitor.py's meters, the same for every system), host bytes per
parameter, and what each system reported of itself; a system that did not finish gets a row
saying why. Printed and written to --out.

Usage: table.py --logs DIR --out FILE.md [--machine NAME --gpu NAME --cores N]
DIR holds shape.json (make_inputs.py), and per system NAME in ours, megatrain, zero3: NAME.log
(its output), NAME.mon.json (monitor.py), NAME.status.json (run.sh, when it did not run), and
ours.jsonl / zero3.jsonl (their per-step metrics).
"""

import argparse
import datetime
import json
import os
import re
import sys

SYSTEMS = [
    ("ours", "megatrain-rs (mt-launch)"),
    ("megatrain", "MegaTrain (published, examples/sft/train.py)"),
    ("zero3", "DeepSpeed ZeRO-3, offload params + optimizer"),
]


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def read_lines(path: str) -> list[str]:
    with open(path, errors="replace") as f:
        return f.readlines()


def step_flops(shape: dict) -> tuple[float, float]:
    """FLOPs of one step of `batch` full rows of `seq` tokens: MegaTrain's formula (6 x all
    parameters x tokens) and this project's model FLOPs (src/metrics.rs `step_flops`: 6 x
    matmul parameters x real tokens, plus QK^T and AV forward and backward, 12 x layers x
    heads x head_dim x the causal pairs, T(T+1)/2 a row). The rows have no padding, so
    padded and real tokens are both batch x seq."""
    b, t = shape["batch"], shape["seq"]
    tokens = b * t
    megatrain = 6.0 * shape["params"] * tokens
    pairs = b * t * (t + 1) // 2
    attention = 3.0 * 4.0 * shape["attention_layers"] * shape["attn_width"] * pairs
    return megatrain, 6.0 * shape["matmul_params"] * tokens + attention


def parse_ours(path: str) -> dict:
    """mt-launch --metrics-out JSONL: one object per optimizer step."""
    steps = [json.loads(line) for line in read_lines(path) if line.strip()]
    steps = [m for m in steps if "step" in m and "step_time_s" in m]
    return {
        "optimizer": "AdamW (own, fp32 master + moments on host)",
        "step_s": [m["step_time_s"] for m in steps],
        "loss": [m["loss"] for m in steps],
        "own_gpu_bytes": max((m.get("peak_gpu_bytes", 0) for m in steps), default=None),
        "own_host_bytes": max((m.get("launcher_peak_rss_bytes", m.get("launcher_rss_bytes", 0))
                               for m in steps), default=None),
        "own_tflops_megatrain": [m["tflops_megatrain"] for m in steps if "tflops_megatrain" in m],
        "own_tflops_model": [m["tflops_model"] for m in steps if "tflops_model" in m],
    }


MT_STEP = re.compile(r"\] Step (\d+)/\d+ \| Loss ([-\d.naif]+)")
MT_TIME = re.compile(r"\]\s+Time: ([\d.]+)s \| Tokens/s [\d.]+ \| TFLOPS ([\d.]+)")
MT_GPU = re.compile(r"\]\s+GPU: ([\d.]+)GB peak")
MT_PEAK_CPU = re.compile(r"\] Peak CPU: ([\d.]+) GB")


def parse_megatrain(path: str) -> dict:
    """The published MegaTrain's train.py log (Python logging, "HH:MM:SS [INFO] ..."): per
    step "Step i/n | Loss l | ..." then "Time: s | Tokens/s .. | TFLOPS t"; its GPU peak is
    torch's max_memory_allocated in GiB, its CPU figure the RSS in GiB."""
    out = {"step_s": [], "loss": [], "own_tflops_megatrain": [], "optimizer": None,
           "own_gpu_bytes": None, "own_host_bytes": None}
    for line in read_lines(path):
        if "Using DeepSpeed CPUAdam optimizer" in line:
            out["optimizer"] = "DeepSpeed CPUAdam (its bf16 parameters on host)"
        elif "Using PyTorch AdamW optimizer" in line:
            out["optimizer"] = "torch AdamW on host (DeepSpeed CPUAdam not available)"
        elif m := MT_STEP.search(line):
            out["loss"].append(float(m.group(2)))
        elif m := MT_TIME.search(line):
            out["step_s"].append(float(m.group(1)))
            out["own_tflops_megatrain"].append(float(m.group(2)))
        elif m := MT_GPU.search(line):
            out["own_gpu_bytes"] = max(out["own_gpu_bytes"] or 0, float(m.group(1)) * 2**30)
        elif m := MT_PEAK_CPU.search(line):
            out["own_host_bytes"] = float(m.group(1)) * 2**30
    return out


def parse_zero3(path: str) -> dict:
    """zero3.py's JSONL: a first "ready" line, then one object per step."""
    lines = [json.loads(line) for line in read_lines(path) if line.strip()]
    ready = next((m for m in lines if m.get("event") == "ready"), {})
    steps = [m for m in lines if "step" in m]
    opt = ready.get("optimizer")
    return {
        "optimizer": {"DeepSpeedCPUAdam": "DeepSpeed CPUAdam (fp32 master + moments on host)",
                      "AdamW": "torch AdamW on host (fp32 master; DeepSpeed CPUAdam not built)"}
        .get(opt, opt),
        "step_s": [m["step_time_s"] for m in steps],
        "loss": [m["loss"] for m in steps],
        "own_gpu_bytes": max((m["gpu_max_allocated_bytes"] for m in steps), default=None),
        "own_host_bytes": None,
    }


PARSERS = {"ours": ("ours.jsonl", parse_ours), "megatrain": ("megatrain.log", parse_megatrain),
           "zero3": ("zero3.jsonl", parse_zero3)}

ERROR_LINE = re.compile(
    r"(\b\w*(Error|Exception)\b.*|.*out of memory.*|.*\bKilled\b.*|^error: .*|.*panicked at.*)",
    re.IGNORECASE)


def why_failed(log_path: str, mon: dict, steps: int) -> str:
    """A short reason for a run that did not finish its steps."""
    if mon.get("timed_out"):
        return f"time limit ({mon.get('timeout_s'):.0f} s) reached after {steps} step(s)"
    sig = mon.get("signal")
    if sig == 9:
        total = mon.get("host_total_bytes") or 0
        used = (mon.get("host_used_peak_bytes") or 0) + (mon.get("host_used_before_bytes") or 0)
        return (f"killed (SIGKILL) after {steps} step(s); host memory reached {used / 1e9:.0f} "
                f"of {total / 1e9:.0f} GB: the OOM killer, likely")
    last = None
    if os.path.exists(log_path):
        for line in read_lines(log_path):
            line = line.strip()
            if ERROR_LINE.search(line) and "Warning" not in line:
                last = line
    rc = mon.get("rc")
    head = f"exit {rc}" if sig is None else f"signal {sig}"
    if last:
        return f"{head} after {steps} step(s): {last[:200]}"
    return f"{head} after {steps} step(s)" + ("" if rc else " (finished with fewer steps than asked)")


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def row_for(name: str, logs: str, shape: dict, cpu_adam: dict) -> dict:
    """One system's figures, or its reason for having none."""
    status = os.path.join(logs, f"{name}.status.json")
    if os.path.exists(status):
        return {"failed": read_json(status)["reason"]}
    fname, parse = PARSERS[name]
    path = os.path.join(logs, fname)
    mon_path = os.path.join(logs, f"{name}.mon.json")
    mon = read_json(mon_path) if os.path.exists(mon_path) else {}
    r = parse(path) if os.path.exists(path) else {"step_s": [], "loss": []}
    r["mon"] = mon
    steps = len(r["step_s"])
    if steps < 2 or mon.get("rc", 0) != 0:
        # Steps beyond the first tell a time even from a run cut short; say why it ended.
        reason = why_failed(os.path.join(logs, f"{name}.log"), mon, steps)
        if steps < 2:
            r["failed"] = reason
        else:
            r["note"] = reason
    timed = r["step_s"][1:]
    r["timed_steps"] = len(timed)
    r["step_mean_s"] = mean(timed)
    mt, model = step_flops(shape)
    r["tflops_megatrain"] = mt / r["step_mean_s"] / 1e12 if timed else float("nan")
    r["tflops_model"] = model / r["step_mean_s"] / 1e12 if timed else float("nan")
    if name in ("megatrain", "zero3") and not r.get("optimizer"):
        r["optimizer"] = "DeepSpeed CPUAdam" if cpu_adam.get("cpu_adam") else "torch AdamW"
    return r


def gb(x):
    return "n/a" if x is None else f"{x / 1e9:.1f}"


def render(logs: str, machine: str, gpu: str, cores: str) -> str:
    shape = read_json(os.path.join(logs, "shape.json"))
    ca_path = os.path.join(logs, "cpu_adam.json")
    cpu_adam = read_json(ca_path) if os.path.exists(ca_path) else {}
    lines = [
        f"# {shape['model']} ({shape['layers']} layers) b{shape['batch']} x {shape['seq']}: "
        f"this project beside its peers on {machine}",
        "",
        f"{datetime.date.today()}; GPU {gpu}, {cores} cores; random init (one bf16 model "
        f"directory all three load, {shape['params']:,} parameters); the same "
        f"{shape['batch']} rows of {shape['seq']} tokens each step, every token a label; "
        f"means over the steps after the first. {cpu_adam.get('note', '')}",
        "",
        "| system | optimizer | steps timed | step s | TFLOPS (MegaTrain formula) | TFLOPS (model) "
        "| host GB peak | host B/param | GPU GB peak | own report: GPU / host GB | loss step 1 → last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, title in SYSTEMS:
        if not os.path.exists(os.path.join(logs, f"{name}.status.json")) and not any(
                os.path.exists(os.path.join(logs, f)) for f in (f"{name}.log", f"{name}.mon.json")):
            continue  # not asked for in this call
        r = row_for(name, logs, shape, cpu_adam)
        if "failed" in r and "step_s" not in r:
            lines.append(f"| {title} | | | | | | | | | | {r['failed']} |")
            continue
        mon = r.get("mon", {})
        host = mon.get("host_used_peak_bytes")
        host_bpp = f"{host / shape['params']:.1f}" if host else "n/a"
        loss = f"{r['loss'][0]:.3f} → {r['loss'][-1]:.3f}" if r.get("loss") else ""
        if "failed" in r:
            lines.append(f"| {title} | {r.get('optimizer') or ''} | {r['timed_steps']} | | | "
                         f"| {gb(host)} | {host_bpp} | {gb(mon.get('gpu_used_peak_bytes'))} | | "
                         f"{r['failed']} |")
            continue
        own = f"{gb(r.get('own_gpu_bytes'))} / {gb(r.get('own_host_bytes'))}"
        lines.append(
            f"| {title} | {r.get('optimizer') or 'n/a'} | {r['timed_steps']} | {r['step_mean_s']:.2f} "
            f"| {r['tflops_megatrain']:.1f} | {r['tflops_model']:.1f} | {gb(host)} | {host_bpp} "
            f"| {gb(mon.get('gpu_used_peak_bytes'))} | {own} | {loss} |")
        if r.get("note"):
            notes.append(f"- {title}: {r['note']}")
    mt, model = step_flops(shape)
    lines += [
        "",
        *notes,
        *([""] if notes else []),
        f"TFLOPS (MegaTrain formula): 6 x all {shape['params']:,} parameters x batch x seq / step "
        f"time ({mt / 1e12:.1f} TFLOP a step), as MegaTrain's train.py prints it. TFLOPS (model): "
        f"this project's `tflops_model` (src/metrics.rs): 6 x {shape['matmul_params']:,} matmul "
        f"parameters (the looked-up embedding left out) x tokens, plus causal attention (QK^T and "
        f"AV, forward and backward) ({model / 1e12:.1f} TFLOP a step). Both from each system's "
        "own step time: ours the optimizer-step interval, MegaTrain's forward + backward + "
        "update as its train.py times it, ZeRO-3's forward + backward + step between CUDA syncs.",
        "",
        "Host GB peak: the machine's used memory (MemTotal - MemAvailable) above its level before "
        "the system started, sampled every 0.5 s (page cache left out, shared and pinned memory "
        "in); host B/param divides it by all parameters. GPU GB peak: nvidia-smi's memory.used "
        "above its level before (CUDA context and allocator cache in). Own report: ours "
        "`peak_gpu_bytes` / launcher VmHWM; MegaTrain torch max_memory_allocated / its final "
        "RSS; ZeRO-3 torch max_memory_allocated. GB = 1e9 bytes.",
    ]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--logs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--machine", default="unknown")
    ap.add_argument("--gpu", default="unknown")
    ap.add_argument("--cores", default=str(os.cpu_count()))
    a = ap.parse_args()
    text = render(a.logs, a.machine, a.gpu, a.cores)
    with open(a.out, "w") as f:
        f.write(text)
    print(text)
    print(f"written: {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
