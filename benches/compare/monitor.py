#!/usr/bin/env python3
"""Runs one command under a time limit and records its host and GPU memory peaks.

Usage: monitor.py --out SUMMARY.json --log LOG [--timeout S] [--interval S] -- CMD...

The command runs in a process group of its own; stdout and stderr go to LOG. Every
`--interval` seconds (0.5) it samples
- host: the machine's used memory, MemTotal - MemAvailable from /proc/meminfo, above its level
  before the command started (one meter for all three systems: it counts shared memory,
  pinned buffers and every process once, and leaves out the reclaimable page cache of the
  model files they read); and the summed VmRSS of the command's process tree (shared pages
  counted once per process that maps them: an upper bound, for the record);
- GPU: `nvidia-smi`'s memory.used of the GPU (CUDA_VISIBLE_DEVICES' first, else 0) above its
  level before the command started (CUDA contexts and allocator caches included).
At the time limit the group gets SIGTERM, then SIGKILL 15 s later; when the command ends, any
process it left in its group (workers, data loader processes) is killed, so the next system
starts on an idle GPU. SUMMARY.json holds the peaks, the exit status and the wall time.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def meminfo() -> dict:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            out[key] = int(rest.split()[0]) * 1024
    return out


def host_used() -> int:
    m = meminfo()
    return m["MemTotal"] - m.get("MemAvailable", m["MemFree"])


def tree_rss(root: int) -> int:
    """Summed VmRSS of `root` and its descendants (0 for processes gone meanwhile)."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                # The command name may hold spaces: the fields after its closing paren.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


class GpuMeter:
    """memory.used of one GPU through nvidia-smi; `None` readings where it is absent."""

    def __init__(self):
        vis = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        self.index = vis if vis else "0"
        self.ok = self.read() is not None

    def read(self):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                 "-i", self.index], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode != 0:
            return None
        try:
            return int(out.stdout.strip().splitlines()[0]) * 2**20  # MiB
        except (ValueError, IndexError):
            return None


def kill_group(pgid: int, sig: int):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--timeout", type=float, default=0, help="seconds; 0: none")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        sys.exit("monitor.py: no command after --")
    gpu = GpuMeter()
    host0 = host_used()
    gpu0 = gpu.read() if gpu.ok else None
    t0 = time.monotonic()
    with open(a.log, "ab") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    host_peak = rss_peak = gpu_peak = 0
    samples, timed_out, term_at = 0, False, None
    while p.poll() is None:
        host_peak = max(host_peak, host_used() - host0)
        rss_peak = max(rss_peak, tree_rss(p.pid))
        if gpu.ok:
            g = gpu.read()
            if g is not None:
                gpu_peak = max(gpu_peak, g - gpu0)
        samples += 1
        now = time.monotonic() - t0
        if a.timeout and now > a.timeout and term_at is None:
            timed_out, term_at = True, now
            kill_group(p.pid, signal.SIGTERM)
        if term_at is not None and now > term_at + 15:
            kill_group(p.pid, signal.SIGKILL)
        time.sleep(a.interval)
    wall = time.monotonic() - t0
    kill_group(p.pid, signal.SIGKILL)  # whatever the command left behind in its group
    rc = p.returncode
    summary = {
        "cmd": cmd,
        "rc": rc,
        "signal": -rc if rc < 0 else None,
        "timed_out": timed_out,
        "timeout_s": a.timeout or None,
        "wall_s": round(wall, 2),
        "samples": samples,
        "interval_s": a.interval,
        "host_used_peak_bytes": host_peak,
        "host_used_before_bytes": host0,
        "host_total_bytes": meminfo()["MemTotal"],
        "tree_rss_peak_bytes": rss_peak,
        "gpu_used_peak_bytes": gpu_peak if gpu.ok else None,
        "gpu_used_before_bytes": gpu0,
    }
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    sys.exit(0 if rc == 0 else 1)


if __name__ == "__main__":
    main()
