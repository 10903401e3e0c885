#!/usr/bin/env python3
"""torch.optim.AdamW(fused=True) on CPU: the yardstick for our AdamW (scripts/bench_host.sh).

Same N, dtype (fp32 param, grad, exp_avg, exp_avg_sq) and thread count as
`host_bench adamw`. Prints `RESULT <name> key=value ...` lines, best of --iters timed steps
after two warm-up steps:
  torch_fused       opt.step() alone (28 B/param: reads p, g, m, v; writes p, m, v)
  torch_fused_bf16  opt.step() then store.copy_(p) into a bf16 tensor: the same outputs as
                    our update, which also writes the bf16 store (36 B/param this way)
"""

import argparse
import time

import torch


def timed(iters, fn):
    fn()
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[0], ts[len(ts) // 2]


def report(name, n, best_median, bytes_per_param):
    best, median = best_median
    print(
        f"RESULT {name} n={n} best_s={best:.6f} median_s={median:.6f} "
        f"gb_s={bytes_per_param * n / best / 1e9:.2f} gelem_s={n / best / 1e9:.4f}",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 28, help="parameters")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(
        f"INFO torch={torch.__version__} threads={torch.get_num_threads()} "
        f"cpu_capability={torch.backends.cpu.get_cpu_capability()} n={a.n}",
        flush=True,
    )

    p = torch.nn.Parameter(torch.rand(a.n) * 0.2 - 0.1)
    p.grad = torch.rand(a.n) * 0.2 - 0.1
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            fused=True)
    store = torch.empty(a.n, dtype=torch.bfloat16)

    def step_and_store():
        opt.step()
        store.copy_(p.detach())

    report("torch_fused", a.n, timed(a.iters, opt.step), 28)
    report("torch_fused_bf16", a.n, timed(a.iters, step_and_store), 36)


if __name__ == "__main__":
    main()
