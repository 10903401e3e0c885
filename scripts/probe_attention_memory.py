#!/usr/bin/env python3
"""Device memory of one Qwen2.5-7B layer's attention half under recompute and backward, as
worker/src/model computes it, in query-sized units: what src/plan/acts.rs counts for the
fused attention backward on GPUs (benches/results/long_context_H200_2026-11-23.md).
Run on a GPU machine: python3 scripts/probe_attention_memory.py"""
import torch, torch.nn.functional as F
dev, bf = "cuda", torch.bfloat16
H, N, K, D = 3584, 28, 4, 128
def rot(x, cos, sin):
    x1, x2 = x[..., :D//2], x[..., D//2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin

for B, T in ((128, 1024), (16, 8192), (4, 32768), (1, 131072), (1, 262144), (1, 524288)):
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    unit = B * T * H * 2
    w = {n: torch.randn(*s, device=dev, dtype=bf) * 0.02 for n, s in
         dict(ln=(H,), q=(N*D, H), k=(K*D, H), v=(K*D, H), o=(H, N*D), qb=(N*D,), kb=(K*D,), vb=(K*D,)).items()}
    for t in w.values(): t.requires_grad_(True)
    x = torch.randn(B, T, H, device=dev, dtype=bf, requires_grad=True)
    pos = torch.arange(T, device=dev, dtype=torch.float32)
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    ang = torch.cat([pos[:, None] * inv] * 2, -1)
    cos, sin = ang.cos().to(bf), ang.sin().to(bf); del ang, pos
    dy = torch.randn(B, T, H, device=dev, dtype=bf)
    base_a = torch.cuda.memory_allocated(); base_r = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    xf = x.float(); hn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf) * w["ln"]
    q = F.linear(hn, w["q"], w["qb"]).view(B, T, N, D).transpose(1, 2)
    k = F.linear(hn, w["k"], w["kb"]).view(B, T, K, D).transpose(1, 2)
    v = F.linear(hn, w["v"], w["vb"]).view(B, T, K, D).transpose(1, 2)
    q, k = rot(q, cos, sin), rot(k, cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    y = F.linear(o.transpose(1, 2).reshape(B, T, N*D), w["o"]) + x
    graph = torch.cuda.memory_allocated() - base_a
    fwd_a = torch.cuda.max_memory_allocated() - base_a
    torch.cuda.reset_peak_memory_stats()
    y.backward(dy)
    bwd_a = torch.cuda.max_memory_allocated() - base_a
    bwd_r = torch.cuda.max_memory_reserved() - base_r
    print(f"B={B} T={T}: graph {graph/unit:.2f}, recompute peak {fwd_a/unit:.2f}, backward peak allocated {bwd_a/unit:.2f} reserved {bwd_r/unit:.2f} (units of {unit/1e9:.2f} GB) {o.grad_fn.name()}", flush=True)
    del x, dy, y, o, q, k, v, hn, xf, w
