"""Where one profiled step of the real engine spends its GPU time: tables from the Chrome
trace a worker writes under MT_TORCH_PROFILE (worker/src/profile.rs).

    python3 scripts/trace_summary.py DIR/worker0_step3.json [TOP]

Prints:
- the step's span, the device's busy time (the union of kernels, copies and sets) and its
  idle time: idle time is the step waiting on the host;
- by phase (the engine's ranges: `forward`, `backward`, `head`, ... summed over layers) and
  by layer: the GPU time of the kernels their ops launched;
- the TOP (25) kernels, and the TOP aten ops (with input shapes) by the GPU time of the
  kernels they launched.

A kernel belongs to the aten op whose launch it came from (Kineto's `External id`), and to
the phase range open on the launching thread at its launch (the runtime call's time).
"""
import bisect
import collections
import json
import re
import sys

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def union_us(spans):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def kind_of(name):
    n = name.lower()
    if re.search(r"gemm|nvjet|cutlass|xmma|sm90_|sm100_|grouped_mm|splitk", n):
        return "matmul"
    if re.search(r"flash|fmha|attention|sdpa", n):
        return "attention"
    if re.search(r"adamw_|moe_|swiglu|conv_qkv|gated_delta", n):
        return "worker (NVRTC)"
    if re.search(r"reduce|norm|softmax|cross_entropy|logsumexp", n):
        return "reduction / norm"
    if re.search(r"elementwise|vectorized|copy|fill|index|gather|scatter|cat|sort|radix", n):
        return "elementwise / copy / index"
    return "other"


class Ranges:
    """The phase ranges of each CPU thread, for finding the one open at a time."""

    def __init__(self, events):
        by_tid = collections.defaultdict(list)
        for e in events:
            if e.get("cat") == "user_annotation":
                by_tid[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        self.by_tid = {t: sorted(r) for t, r in by_tid.items()}
        self.starts = {t: [r[0] for r in rs] for t, rs in self.by_tid.items()}

        # The engine's thread (the one with the most ranges): autograd's device threads
        # launch the backward's kernels while the engine's range for that layer is open.
        self.main = max(self.by_tid, key=lambda t: len(self.by_tid[t]), default=None)

    def at(self, tid, ts):
        """The innermost range open at `ts` on thread `tid`, else on the engine's thread.
        Ranges nest (a layer's `h2d` inside its `backward`): the latest one to start
        before `ts` may have ended while one that started earlier is still open."""
        for t in (tid, self.main):
            rs = self.by_tid.get(t)
            if not rs:
                continue
            for i in range(bisect.bisect_right(self.starts[t], ts) - 1, -1, -1):
                if rs[i][0] <= ts <= rs[i][1]:
                    return rs[i][2]
        return None


def summarize(path, top):
    ev = load(path)
    gpu = [e for e in ev if e.get("cat") in GPU_CATS and "dur" in e]
    if not gpu:
        print(f"{path}: no GPU activity in the trace (a CPU run, or CUPTI unavailable)")
    ops = {}
    for e in ev:
        if e.get("cat") == "cpu_op":
            x = e.get("args", {}).get("External id")
            if x is not None and x not in ops:
                dims = e.get("args", {}).get("Input Dims")
                ops[x] = (e["name"], str(dims)[:110] if dims else "")
    launches = {}
    for e in ev:
        if e.get("cat") == "cuda_runtime":
            c = e.get("args", {}).get("correlation")
            if c is not None:
                launches[c] = (e["tid"], e["ts"])
    ranges = Ranges(ev)

    t0 = min(e["ts"] for e in ev if "ts" in e and e.get("ph") == "X")
    t1 = max(e["ts"] + e.get("dur", 0) for e in ev if "ts" in e and e.get("ph") == "X")
    span = t1 - t0
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    gpu_sum = sum(e["dur"] for e in gpu)
    streams = collections.defaultdict(list)
    for e in gpu:
        streams[(e["cat"] == "kernel", e.get("args", {}).get("stream"))].append((e["ts"], e["ts"] + e["dur"]))
    print(f"trace {path}")
    print(f"step span {span/1e3:.1f} ms; device busy {busy/1e3:.1f} ms ({100*busy/max(span,1):.1f}%),"
          f" idle {(span-busy)/1e3:.1f} ms; kernel time summed over streams {gpu_sum/1e3:.1f} ms")
    for (is_kernel, stream), spans in sorted(streams.items(), key=lambda kv: -union_us(kv[1])):
        what = "kernels" if is_kernel else "copies/sets"
        print(f"  stream {stream} {what}: busy {union_us(spans)/1e3:.1f} ms ({len(spans)} ops)")

    by_phase, by_range, by_kind = (collections.Counter() for _ in range(3))
    by_kernel, n_kernel = collections.Counter(), collections.Counter()
    by_op, n_op = collections.Counter(), collections.Counter()
    for e in gpu:
        d = e["dur"]
        name = e["name"] if e["cat"] == "kernel" else f"[{e['name']}]"
        by_kernel[name] += d
        n_kernel[name] += 1
        by_kind["copy / set" if e["cat"] != "kernel" else kind_of(e["name"])] += d
        a = e.get("args", {})
        launch = launches.get(a.get("correlation"))
        r = ranges.at(*launch) if launch else None
        r = r or "(no phase range)"
        by_range[r] += d
        by_phase[re.sub(r" \d+$", "", r)] += d
        op = ops.get(a.get("External id"))
        if op:
            by_op[op] += d
            n_op[op] += 1

    def table(title, counter, counts=None, n=None):
        print(f"\n{title}")
        total = sum(counter.values()) or 1
        for k, v in counter.most_common(n):
            c = f" {counts[k]:6d}x" if counts else ""
            label = k if isinstance(k, str) else f"{k[0]:34s} {k[1]}"
            print(f"{v/1e3:9.2f} ms {100*v/total:5.1f}%{c}  {label[:150]}")

    table("GPU time by kind of kernel", by_kind)
    table("GPU time by phase (summed over layers)", by_phase)
    table("GPU time by phase and layer", by_range, n=top * 2)
    table(f"top {top} kernels", by_kernel, n_kernel, top)
    table(f"top {top} aten ops (GPU time of their kernels)", by_op, n_op, top)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    summarize(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25)
