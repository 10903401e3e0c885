# Where a sparse MoE block's GPU time goes (issue #15): a torch mirror of the routed experts
# as worker/src/model/experts.rs and moe.rs compute them on CUDA (router, stable sort by
# expert, one gather, grouped GEMMs, the inverse permutation, the weighted sum over the K
# slots), at the Qwen3-30B-A3B shape (hidden 2048, 128 experts of 768, top-8), timed forward
# + backward against the grouped GEMMs alone on pre-sorted rows (the FLOPs the model TFLOPS
# count), then variants of the glue, then one forward + backward of the block as it is under
# torch.profiler, every aten op's own GPU time grouped by op and input shapes. A profiling
# aid: it mirrors the Rust code and must follow it when that changes; the numerics are
# checked by scripts/check_gpu.sh (part `experts`).
#
# Environment: N [65536] tokens, PROFILE [1], VARIANTS [1], DEV [cuda].
# Run on a GPU machine: python3 scripts/profile_moe.py
import os, sys, time
import torch
import torch.nn.functional as F

N = int(os.environ.get("N", 65536))
H, E, I, K = 2048, 128, 768, 8
dev = os.environ.get("DEV", "cuda"); bf = torch.bfloat16
torch.manual_seed(0)


def leaf(*shape, scale):
    return (torch.randn(*shape, device=dev) * scale).to(bf).requires_grad_()


w_router = leaf(E, H, scale=H ** -0.5)
w_gate = leaf(E, I, H, scale=H ** -0.5)
w_up = leaf(E, I, H, scale=H ** -0.5)
w_down = leaf(E, H, I, scale=I ** -0.5)
experts_e = torch.arange(E, device=dev)


def route(x):
    logits = F.linear(x, w_router)
    probs = logits.softmax(-1, dtype=torch.float)
    top, idx = probs.topk(K, -1)
    top = top / top.sum(-1, keepdim=True)
    return top.to(x.dtype), idx


def sort_pairs(idx):
    expert_s, pair_s = idx.reshape(-1).sort(stable=True)
    offs = torch.searchsorted(expert_s, experts_e, out_int32=True, right=True)
    return expert_s, pair_s, offs


def gemms(x_sh, offs, fused_gate_up=False):
    mm = lambda a, w: torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    if fused_gate_up:
        gu = mm(x_sh, torch.cat([w_gate, w_up], 1))
        g, u = gu.split(I, -1)
        return mm(F.silu(g) * u, w_down)
    return mm(F.silu(mm(x_sh, w_gate)) * mm(x_sh, w_up), w_down)


def block(x, gather="embedding", combine="mul_sum", fused_gate_up=False, unsort_by="index_copy"):
    """The routed experts, (N, H) -> (N, H), as experts.rs (the defaults) or with the named glue."""
    w_nk, idx = route(x)
    _, pair_s, offs = sort_pairs(idx)
    S = pair_s.numel()
    if gather == "index_select":  # before 2026-11-24: backward is an index_add (K rows per token)
        x_sh = x.index_select(0, pair_s // K)
    elif gather == "embedding":  # experts.rs: backward sorts the indices, a segmented sum
        x_sh = F.embedding(pair_s // K, x)
    else:
        raise ValueError(gather)
    y_sh = gemms(x_sh, offs, fused_gate_up)
    unsort = torch.zeros_like(pair_s).scatter(0, pair_s, torch.arange(S, device=dev))
    if unsort_by == "index_copy" and y_sh.requires_grad:  # experts.rs: backward index_select
        y_nkh = y_sh.new_empty(S, H).index_copy_(0, pair_s, y_sh).view(N, K, H)
    elif unsort_by == "index_put":  # y_sh's rows written back in pair order: backward gathers
        if y_sh.requires_grad:
            y_nkh = y_sh.new_empty(S, H).index_put((pair_s,), y_sh).view(N, K, H)
        else:  # without grad the gather is faster and equal
            y_nkh = y_sh.index_select(0, unsort).view(N, K, H)
    else:  # before 2026-11-24, and experts.rs without grad: backward is an index_add
        y_nkh = y_sh.index_select(0, unsort).view(N, K, H)
    if combine == "mul_sum":  # experts.rs (the router weights' dtype, as transformers)
        return (y_nkh * w_nk.unsqueeze(-1)).to(x.dtype).sum(1)
    if combine == "bmm":  # one read of y: (N, 1, K) x (N, K, H)
        return torch.bmm(w_nk.unsqueeze(1), y_nkh).squeeze(1)
    raise ValueError(combine)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def timeit(fn, x, gy, n=3, grad=True):
    def once():
        if grad:
            fn(x).backward(gy)
        else:
            with torch.no_grad():
                fn(x)
    for _ in range(2):
        once()
    sync(); t0 = time.time()
    for _ in range(n):
        once()
    sync()
    return (time.time() - t0) / n


def peak():
    return torch.cuda.max_memory_allocated() if dev == "cuda" else 0


x = torch.randn(N, H, device=dev).to(bf).requires_grad_()
gy = torch.randn(N, H, device=dev).to(bf) * 1e-2
# The GEMMs alone on rows already sorted (routing of a fixed, balanced-at-random draw).
with torch.no_grad():
    _, idx0 = route(x)
    _, pair0, offs0 = sort_pairs(idx0)
    xs0 = x.index_select(0, pair0 // K).detach().requires_grad_()
    gys0 = torch.randn_like(xs0) * 1e-2
counts = torch.diff(offs0, prepend=offs0.new_zeros(1))
print(f"N={N} tokens, S={N*K} rows; rows per expert min {counts.min().item()} max {counts.max().item()}")
flops = 6 * N * K * 3 * H * I  # forward + backward of the three expert projections
tg = timeit(lambda a: gemms(a, offs0), xs0, gys0)
tgf = timeit(lambda a: gemms(a, offs0), xs0, None, grad=False)
tgu = timeit(lambda a: gemms(a, offs0, True), xs0, gys0)
print(f"grouped GEMMs alone: fwd+bwd {tg*1e3:.1f} ms ({flops/tg/1e12:.0f} TFLOPS), fwd {tgf*1e3:.1f} ms "
      f"({flops/3/tgf/1e12:.0f} TFLOPS); gate+up fused fwd+bwd {tgu*1e3:.1f} ms ({flops/tgu/1e12:.0f} TFLOPS)")
sys.stdout.flush()
variants = [("as experts.rs", {})]
if os.environ.get("VARIANTS", "1") == "1":
    variants += [
        ("index_select (before)", {"gather": "index_select", "unsort_by": "index_select"}),
        ("gather by embedding", {"unsort_by": "index_select"}),
        ("unsort by index_put", {"unsort_by": "index_put"}),
        ("combine by bmm", {"combine": "bmm"}),
        ("gate+up fused", {"fused_gate_up": True}),
    ]
for name, kw in variants:
    x.grad = None; w_gate.grad = None; w_up.grad = None; w_down.grad = None; w_router.grad = None
    torch.cuda.reset_peak_memory_stats() if dev == "cuda" else None
    fn = lambda a, kw=kw: block(a, **kw)
    t = timeit(fn, x, gy); tf = timeit(fn, x, None, grad=False)
    x.grad = None; y = fn(x); y.backward(gy)
    print(f"{name:22s} fwd+bwd {t*1e3:7.1f} ms ({flops/t/1e12:4.0f} TFLOPS at expert FLOPs, "
          f"glue {(t-tg)*1e3:6.1f} ms = {(t-tg)/tg:.2f}x GEMMs), fwd {tf*1e3:6.1f} ms; "
          f"|y| {y.float().norm().item():.5e} |dx| {x.grad.float().norm().item():.5e} "
          f"|dgate| {w_gate.grad.float().norm().item():.5e}; peak {peak()/2**30:.1f} GiB")
    dx1 = x.grad.clone(); x.grad = None; fn(x).backward(gy)
    print(f"{'':22s} dx bit-equal on a second run: {torch.equal(dx1, x.grad)}")
    x.grad = None; w_gate.grad = None; w_up.grad = None; w_down.grad = None; w_router.grad = None
    sys.stdout.flush()
if os.environ.get("PROFILE", "1") == "1":
    from torch.profiler import profile, ProfilerActivity
    from profile_common import aten_rows, print_rows
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        block(x, **dict(variants)[os.environ.get("PROFILE_VARIANT", "as experts.rs")]).backward(gy); sync()
    rows = aten_rows(prof)
    total = sum(r[0] for r in rows)
    print(f"own GPU time of aten ops, one forward + backward: {total/1e3:.1f} ms")
    print_rows(rows, 40)
    kern = sorted(((e.self_device_time_total, e.key) for e in prof.key_averages()
                   if not e.key.startswith("aten::") and e.self_device_time_total > 0), reverse=True)
    print("top kernels:")
    for t, k in kern[:25]:
        print(f"{t/1e3:8.2f} ms {k[:140]}")
