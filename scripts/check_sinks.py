"""The contract worker/src/kernels/sinks.rs builds on, checked on a GPU with torch's own
FlashAttention-2 (scripts/check_sinks.sh runs it): the rows' log-sum-exp the forward returns,
and attention with sinks as y = o sigmoid(L - sink) with its backward through flash's
backward given out = y, against autograd over transformers' eager formula (the sink as one
more score column, its probability dropped) in f32. Prints each case; exits non-zero on a
miss."""
import sys

import torch

torch.manual_seed(0)
B, T, N, K, D = 2, 256, 8, 2, 64
SCALE = D ** -0.5
# Inputs rounded to bf16 (<= 2^-9 = 2e-3 each) through a few roundings: 2e-2 norm-wise.
BOUND = 2e-2
# The log-sum-exp from the same bf16 inputs, summed in f32 in another order.
LSE_BOUND = 1e-3
dev = "cuda"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


ok = True
for mag in (1.0, 4.0):
    q = (torch.randn(B, T, N, D, device=dev) * mag).bfloat16()
    k = (torch.randn(B, T, K, D, device=dev) * mag).bfloat16()
    v = torch.randn(B, T, K, D, device=dev).bfloat16()
    sink = torch.randn(N, device=dev) * 3
    dy = torch.randn(B, T, N, D, device=dev).bfloat16()
    for left in (None, 63):
        right = None if left is None else 0
        o, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, T, T, 0.0, True, False, scale=SCALE,
            window_size_left=left, window_size_right=right)
        # The reference: transformers' eager formula in f32, by autograd.
        qf, kf, vf = [x.float().transpose(1, 2).requires_grad_(True) for x in (q, k, v)]
        sf = sink.clone().requires_grad_(True)
        kr, vr = kf.repeat_interleave(N // K, 1), vf.repeat_interleave(N // K, 1)
        i = torch.arange(T, device=dev)
        allowed = i[None, :] <= i[:, None]
        if left is not None:
            allowed &= (i[:, None] - i[None, :]) <= left
        s = (qf @ kr.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))
        lse_ref = s.logsumexp(-1)
        scores = torch.cat([s, sf.view(1, N, 1, 1).expand(B, N, T, 1)], -1)
        y_ref = (scores.softmax(-1)[..., :T] @ vr).transpose(1, 2)
        (y_ref * dy.float()).sum().backward()
        # The op, as sinks.rs computes it.
        sig = torch.sigmoid(lse - sink.view(1, N, 1)).transpose(1, 2).unsqueeze(-1)
        y = (o.float() * sig).bfloat16()
        ds = (dy.float() * o.float()).sum(-1, keepdim=True)
        do = (dy.float() * sig).bfloat16().contiguous()
        dsink = -(ds * sig * (1 - sig)).sum((0, 1, 3))
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            do, q, k, v, y, lse, None, None, T, T, 0.0, True, seed, offset, scale=SCALE,
            window_size_left=left, window_size_right=right)
        lse_err = (lse - lse_ref).abs().max().item()
        errs = {"y": rel(y, y_ref), "dq": rel(dq, qf.grad.transpose(1, 2)),
                "dk": rel(dk, kf.grad.transpose(1, 2)), "dv": rel(dv, vf.grad.transpose(1, 2)),
                "dsink": rel(dsink, sf.grad)}
        good = lse_err <= LSE_BOUND and all(e <= BOUND for e in errs.values())
        ok &= good
        print(f"sinks op, scores x{mag}, window {left}: lse {tuple(lse.shape)} max error {lse_err:.1e} "
              f"(bound {LSE_BOUND:.0e}); " + " ".join(f"{n} {e:.1e}" for n, e in errs.items())
              + f" (bound {BOUND:.0e}){'' if good else '  <- FAIL'}")
print("sinks op: " + ("PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
