#!/usr/bin/env bash
# Host-side kernels in one run, on the same N, dtype and thread count:
#   (a) our fused AdamW (fp32 p, g, m, v + bf16 store) vs torch.optim.AdamW(fused=True),
#       alternating ROUNDS times so that both see the same machine state; best of each;
#       also ours with a bf16 gradient (memory.grad_dtype: bfloat16, 28 B/p) and with a
#       split master too (memory.master_weights: split, 26 B/p);
#   (b) the gradient-slab reduce (W workers, bf16 and f32 slabs; `reduce` is dst += Σ,
#       `assign` is dst = Σ for a step's first micro-batch) vs this machine's copy
#       bandwidth measured by the same binary in the same run.
# Prints a compact table last. Floors: AdamW >= 1.0x torch fused; reduce >= 70% of copy.
#
# usage: scripts/bench_host.sh [N]            N = parameters (default 2**28: ~5 GiB of RAM)
# env:   THREADS    threads for both sides (default: all cores)
#        ITERS      timed steps per measurement (default 10), ROUNDS (default 3)
#        WORKERS    reduce fan-ins (default 1,2,4)
#        BENCH_BIN  prebuilt `host_bench` (cargo build --release -p mt --example host_bench);
#                   without it the script builds one (needs Rust)
#        PYTHON     a python with torch (default: .venv/bin/python if present, else python3)
#        MT_SIMD    portable|avx2 to lower our SIMD level (default: the widest the CPU has)
# On a machine without Rust, from the repository root:
#   BENCH_BIN=target/release/examples/host_bench PYTHON=python3 scripts/bench_host.sh
set -euo pipefail
cd "$(dirname "$0")/.."

N=$(( ${1:-2**28} ))    # an integer or an expression such as 2**27
THREADS=${THREADS:-$(nproc)}
ITERS=${ITERS:-10}
ROUNDS=${ROUNDS:-3}
WORKERS=${WORKERS:-1,2,4}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ -z "${BENCH_BIN:-}" ]]; then
    cargo build --release -q -p mt --example host_bench
    BENCH_BIN=target/release/examples/host_bench
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
echo "# $(date -u +%FT%TZ) $(hostname) | $cpu | $(nproc) cores | threads=$THREADS N=$N" \
    "iters=$ITERS rounds=$ROUNDS"

run() { "$@" | tee -a "$log"; }
for r in $(seq "$ROUNDS"); do
    echo "# round $r/$ROUNDS"
    run "$BENCH_BIN" --threads "$THREADS" --n "$N" --iters "$ITERS" adamw
    run "$PYTHON" scripts/bench_adamw_torch.py --threads "$THREADS" --n "$N" --iters "$ITERS"
    run "$BENCH_BIN" --threads "$THREADS" --n "$N" --iters "$ITERS" --workers "$WORKERS" \
        copy reduce
done

# Best (highest) throughput per measurement over the rounds, then the table.
awk -v threads="$THREADS" -v n="$N" '
    /^INFO threads=/ { for (i = 2; i <= NF; i++) if ($i ~ /^simd=/) simd = substr($i, 6) }
    /^RESULT/ {
        key = $2
        for (i = 3; i <= NF; i++) {
            split($i, kv, "=")
            if (kv[1] == "workers") key = key " W=" kv[2]
            if (kv[1] == "dtype") key = key " " kv[2]
            if (kv[1] == "variant") key = key " " kv[2]
            if (kv[1] == "gb_s") gb = kv[2]
            if (kv[1] == "gelem_s") ge = kv[2]
        }
        if (!(key in best) || gb + 0 > best[key] + 0) { best[key] = gb; gelem[key] = ge }
        if (!(key in seen)) { seen[key] = 1; order[++k] = key }
    }
    END {
        ours = gelem["adamw"]; tf = gelem["torch_fused"]; tb = gelem["torch_fused_bf16"]
        cp = best["copy"]
        printf "\n== host kernels: %s threads, N=%d, our SIMD %s (best of rounds) ==\n", \
            threads, n, simd
        printf "%-34s %9s %8s  %s\n", "kernel", "Gparam/s", "GB/s", "vs"
        printf "%-34s %9.3f %8.1f\n", "AdamW ours (+bf16 store, 30 B/p)", ours, best["adamw"]
        printf "%-34s %9.3f %8.1f  %.2fx fp32 grad\n", "AdamW ours, bf16 grad (28 B/p)", \
            gelem["adamw bf16grad"], best["adamw bf16grad"], gelem["adamw bf16grad"] / ours
        printf "%-34s %9.3f %8.1f  %.2fx fp32 grad\n", "AdamW ours, split+bf16g (26 B/p)", \
            gelem["adamw split+bf16grad"], best["adamw split+bf16grad"], \
            gelem["adamw split+bf16grad"] / ours
        printf "%-34s %9.3f %8.1f  ours %.2fx  (floor 1.0x, aim 1.3x)\n", \
            "torch fused AdamW (28 B/p)", tf, best["torch_fused"], ours / tf
        printf "%-34s %9.3f %8.1f  ours %.2fx  (same outputs)\n", \
            "torch fused + bf16 copy_", tb, best["torch_fused_bf16"], ours / tb
        printf "%-34s %9s %8.1f\n", "copy (read+write)", "", cp
        for (i = 1; i <= k; i++) if (order[i] ~ /^(reduce|assign)/) {
            printf "%-34s %9s %8.1f  %3.0f%% of copy  (floor 70%%)\n", \
                order[i], "", best[order[i]], 100 * best[order[i]] / cp
        }
    }' "$log"
