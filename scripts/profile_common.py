"""What the GPU profiling aids (scripts/profile_gated_delta.py, scripts/profile_moe.py)
share: the table of every aten op's own GPU time in a torch.profiler trace.
"""


def aten_rows(prof):
    """(own GPU time in us, op, input shapes, calls) of each aten op with GPU time in `prof`
    (grouped by op and input shapes), the longest first."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0 and e.key.startswith("aten::"):
            rows.append((t, e.key, str(e.input_shapes)[:150], e.count))
    rows.sort(reverse=True)
    return rows


def print_rows(rows, top):
    """The first `top` of [`aten_rows`], one line each."""
    for t, k, sh, n in rows[:top]:
        print(f"{t/1e3:8.2f} ms {n:4d}x {k:28s} {sh}")
