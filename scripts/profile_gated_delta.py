# Where a Gated DeltaNet layer's GPU time goes (issue #16): a torch mirror of the mixer as
# worker/src/model/gated_delta/chunked.rs computes it (same ops, same order, same dtypes),
# at the Qwen3.5-27B shape (hidden 5120; 16 key / 48 value heads of 128; conv 4), timed
# forward-only and forward + backward against its input projections alone (the FLOPs the
# model TFLOPS count), then one forward + backward under torch.profiler, every aten op's
# own GPU time grouped by op and input shapes. A profiling aid: it mirrors the Rust code and
# must follow it when that changes; the numerics are checked by scripts/check_gated_delta.sh.
# The causal conv, SiLU and q/k norms run as torch ops here (the worker's
# MT_GATED_DELTA_FUSED=0); on CUDA the worker runs them as one kernel (worker/src/kernels).
#
# Environment: B [32] rows, T [1024] tokens, C [64] chunk, DEV [cuda], PROFILE [1]: 1
# profiles one forward + backward, fwd one forward without grad (the engine's first pass
# over each layer), 0 neither.
# Run on a GPU machine: python3 scripts/profile_gated_delta.py
import os, sys, time
import torch
import torch.nn.functional as F

B = int(os.environ.get("B", 32)); T = int(os.environ.get("T", 1024))
H, G, V, DK, DV, K = 5120, 16, 48, 128, 128, 4
C = int(os.environ.get("C", 64)); BLOCK = 16
dev = os.environ.get("DEV", "cuda"); bf = torch.bfloat16
torch.manual_seed(0)
Fc = 2 * G * DK + V * DV
w_qkv = (torch.randn(Fc, H, device=dev) * H ** -0.5).to(bf).requires_grad_()
w_zba = (torch.randn(V * DV + 2 * V, H, device=dev) * H ** -0.5).to(bf).requires_grad_()
conv_w = (torch.randn(Fc, 1, K, device=dev) * 0.5).to(bf).requires_grad_()
A_log = torch.randn(V, device=dev).log().nan_to_num(0.0).to(bf).requires_grad_()
dt_bias = torch.randn(V, device=dev).to(bf).requires_grad_()
norm_w = torch.ones(DV, device=dev).to(bf).requires_grad_()
w_out = (torch.randn(H, V * DV, device=dev) * (V * DV) ** -0.5).to(bf).requires_grad_()


def halves(x, dim):
    n = x.shape[dim]
    a, b = x.split(n // 2, dim)
    return a, b


def unit_lower_inverse(a):
    n = a.shape[-1]
    if n <= BLOCK:
        m = a.tril(-1)
        t = torch.eye(n, dtype=a.dtype, device=a.device) - m
        power = m @ m
        p = 2
        while p < n:
            t = t + t @ power
            p *= 2
            if p < n:
                power = power @ power
        return t
    h = n // 2
    shape = list(a.shape[:-2]) + [2, h, 2, h]
    rows = a.view(shape).unbind(-4)
    top, bottom = rows[0].unbind(-2), rows[1].unbind(-2)
    a11, a21, a22 = top[0], bottom[0], bottom[1]
    diag = unit_lower_inverse(torch.stack([a11, a22], -3)).unbind(-3)
    t11, t22 = diag
    t21 = -(t22 @ (a21 @ t11))
    return torch.cat([F.pad(t11, (0, h)), torch.cat([t21, t22], -1)], -2)


def inverse_with_its_gradient(a):
    """As chunked.rs: the inverse without grad, its gradient -T^T dT T^T through T - T (A - A') T."""
    with torch.no_grad():
        t = unit_lower_inverse(a)
    if not a.requires_grad:
        return t
    strict = a.tril(-1)
    return t - t @ (strict - strict.detach()) @ t


def state_recurrence(u, nw, q, k, p, d):
    kind = u.dtype
    us, nws, qs, ks, ps, ds = (x.unbind(1) for x in (u, nw, q, k, p, d))
    state = None
    outs = []
    for n in range(len(us)):
        if state is None:
            v_new = us[n]; o = ps[n] @ us[n]
        else:
            s = state.to(kind)
            v_new = torch.baddbmm(us[n], nws[n], s)
            o = torch.baddbmm(qs[n] @ s, ps[n], v_new)
        if n + 1 < len(us):
            kv = ks[n].transpose(-1, -2) @ v_new
            state = kv.float() if state is None else torch.addcmul(kv, state, ds[n])
        outs.append(o)
    return torch.stack(outs, 1)


def mixer(x):
    b, t, _ = x.shape
    u = (t + C - 1) // C; c = C; p_ = u * c; r = V // G
    zba = (x @ w_zba.t()).split([V * DV, V, V], -1)
    z_btvd, b_btv, a_btv = zba[0].view(b, t, V, DV), zba[1], zba[2]
    qkv_btf = x @ w_qkv.t()
    pad = max(K - 1, p_ - t)
    qkv_bfp = F.silu(F.conv1d(qkv_btf.transpose(1, 2), conv_w, None, 1, pad, 1, Fc)
                     .narrow(2, pad - K + 1, p_))
    kind = qkv_bfp.dtype
    qkv = qkv_bfp.split([2 * G * DK, V * DV], 1)
    qk = qkv[0].view(b, 2, G, DK, u, c).permute(0, 2, 4, 1, 5, 3)
    v_ = qkv[1].view(b, V, DV, u, c).permute(0, 1, 3, 4, 2)
    norm = torch.linalg.vector_norm(qk, 2, -1, True, dtype=torch.float32)
    iq, ik = halves((norm.square() + 1e-6).rsqrt(), 3)
    inv = torch.cat([iq * DK ** -0.5, ik], 3)
    qk = (inv.to(kind) * qk).contiguous().view(b, G, u, 2 * c, DK)
    q_, k_ = halves(qk, -2)
    qk_cc, kk_cc = halves(qk @ k_.transpose(-1, -2), -2)
    beta = b_btv.sigmoid().float()
    g_ = -A_log.float().exp() * F.softplus(a_btv.float() + dt_bias)
    ch = lambda x: F.pad(x, (0, 0, 0, p_ - t)).transpose(1, 2).reshape(b, V, u, c)
    beta_c = ch(beta); gamma = ch(g_).cumsum(-1, dtype=torch.float32)
    glast = gamma.narrow(-1, c - 1, 1); eg = gamma.exp()
    pvh = lambda coef, xx: (coef.to(kind).view(b, G, r, u, c, 1) * xx.unsqueeze(2)).view(b, V, u, c, DK)
    nkb = pvh(-beta_c * eg, k_)
    kdec = pvh((glast - gamma).exp(), k_)
    qdec = pvh(eg, q_)
    vb = (beta_c.to(kind).unsqueeze(-1) * v_).contiguous()
    upper = torch.ones(c, c, dtype=torch.bool, device=x.device).triu(1)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp()
    a_ = ((decay * beta_c.unsqueeze(-1)).view(b, G, r, u, c, c) * kk_cc.unsqueeze(2)).view(b, V, u, c, c)
    t_ = inverse_with_its_gradient(a_).to(kind)
    p_cc = (decay.to(kind).view(b, G, r, u, c, c) * qk_cc.unsqueeze(2)).view(b, V, u, c, c)
    uu = t_ @ vb; nw = t_ @ nkb
    fl = lambda xx: xx.reshape(b * V, *xx.shape[2:])
    o = state_recurrence(fl(uu), fl(nw), fl(qdec), fl(kdec), fl(p_cc), fl(glast.exp().unsqueeze(-1)))
    o = o.view(b, V, p_, DV).narrow(2, 0, t)
    normed = F.rms_norm(o, [DV], norm_w, 1e-6)
    gated = F.silu(z_btvd) * normed.transpose(1, 2)
    return gated.reshape(b, t, V * DV) @ w_out.t()


def proj_only(x):
    b, t, _ = x.shape
    y = x @ w_qkv.t(); zz = x @ w_zba.t()
    return (y[..., : V * DV] + zz[..., : V * DV]) @ w_out.t()


def peak():
    return torch.cuda.max_memory_allocated() if dev == 'cuda' else 0


def run(fn, x, gy):
    y = fn(x)
    y.backward(gy)


def timeit(fn, x, gy, n=3):
    for _ in range(2):
        run(fn, x, gy)
    (torch.cuda.synchronize() if dev == "cuda" else None); t0 = time.time()
    for _ in range(n):
        run(fn, x, gy)
    (torch.cuda.synchronize() if dev == "cuda" else None)
    return (time.time() - t0) / n


def timefwd(fn, x, n=3):
    with torch.no_grad():
        for _ in range(2):
            fn(x)
        (torch.cuda.synchronize() if dev == "cuda" else None); t0 = time.time()
        for _ in range(n):
            fn(x)
        (torch.cuda.synchronize() if dev == "cuda" else None)
    return (time.time() - t0) / n


x = (torch.randn(B, T, H, device=dev)).to(bf).requires_grad_()
gy = torch.randn(B, T, H, device=dev).to(bf) * 1e-2
tm = timeit(mixer, x, gy); tp = timeit(proj_only, x, gy)
print(f"forward only: mixer {timefwd(mixer, x)*1e3:.1f} ms, projections {timefwd(proj_only, x)*1e3:.1f} ms")
proj_flops = 6 * B * T * H * (Fc + V * DV + 2 * V + V * DV)
print(f"B={B} T={T} C={C}: mixer fwd+bwd {tm*1e3:.1f} ms, projections only {tp*1e3:.1f} ms "
      f"({proj_flops/tp/1e12:.0f} TFLOPS); mixer at projection FLOPs: {proj_flops/tm/1e12:.0f} TFLOPS; "
      f"peak {peak()/2**30:.1f} GiB")
x.grad = None; conv_w.grad = None
y = mixer(x); y.backward(gy)
print(f"  check: y {y.float().double().sum().item():.6e} |y| {y.float().norm().item():.6e} |dx| {x.grad.float().norm().item():.6e} |dconv| {conv_w.grad.float().norm().item():.6e}")
sys.stdout.flush()
mode = os.environ.get("PROFILE", "1")
if mode in ("1", "fwd"):
    from torch.profiler import profile, ProfilerActivity
    from profile_common import aten_rows, print_rows
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        if mode == "fwd":
            with torch.no_grad():
                mixer(x)
        else:
            run(mixer, x, gy)
        torch.cuda.synchronize()
    rows = aten_rows(prof)
    print_rows(rows, 70)
