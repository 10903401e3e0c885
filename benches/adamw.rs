//! Fused AdamW throughput (`mt::optim::adamw_update`) on flat fp32 slices, with the bf16 and
//! the fp32 store. Bytes are what the update must move: p, g, m, v read, p, m, v written,
//! plus the store (30 B/param with bf16). The two passes of a deferred update: the weights
//! (m, v read only: 22 B/param) and the moments (g, m, v read, m, v written: 20 B/param).
//! `MT_SIMD=portable|avx2` lowers the SIMD level.
//!
//! `cargo bench -p mt --bench adamw`; scripts/bench_host.sh compares with torch.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use mt::optim::{AdamWStep, Moments, StoreOut, adamw_moments, adamw_update};
use mt::simd::Simd;

fn val(i: usize, salt: usize) -> f32 {
    let h = (i.wrapping_mul(0x9e37_79b9) ^ salt.wrapping_mul(0x85eb_ca6b)) % 20011;
    (h as f32 - 10005.0) * 1e-5
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group(format!("adamw_{}", Simd::get().name()));
    group.sample_size(20);
    // In cache (L2/L3: compute-bound) and far beyond it (memory-bound).
    for n in [1 << 16, 1 << 26] {
        let mut p: Vec<f32> = (0..n).map(|i| val(i, 1)).collect();
        let g: Vec<f32> = (0..n).map(|i| val(i, 2)).collect();
        let mut m: Vec<f32> = (0..n).map(|i| val(i, 3) * 0.1).collect();
        let mut v: Vec<f32> = (0..n).map(|i| val(i, 4).abs() * 0.01).collect();
        let mut sb = vec![bf16::ZERO; n];
        let mut sf = vec![0.0f32; n];
        let hp = AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            step: 10,
            grad_scale: 1.0,
        };
        group.throughput(Throughput::Bytes(30 * n as u64));
        group.bench_function(BenchmarkId::new("bf16_store", n), |b| {
            b.iter(|| {
                let out = StoreOut::Bf16(&mut sb);
                adamw_update(&mut p, &g, &mut m, &mut v, out, &hp, true, Moments::Write);
                black_box(&mut p);
            })
        });
        group.throughput(Throughput::Bytes(22 * n as u64));
        group.bench_function(BenchmarkId::new("bf16_store_weights_pass", n), |b| {
            b.iter(|| {
                let out = StoreOut::Bf16(&mut sb);
                adamw_update(&mut p, &g, &mut m, &mut v, out, &hp, true, Moments::Keep);
                black_box(&mut p);
            })
        });
        group.throughput(Throughput::Bytes(20 * n as u64));
        group.bench_function(BenchmarkId::new("moments_pass", n), |b| {
            b.iter(|| {
                adamw_moments(&g, &mut m, &mut v, &hp);
                black_box(&mut m);
            })
        });
        group.throughput(Throughput::Bytes(32 * n as u64));
        group.bench_function(BenchmarkId::new("f32_store", n), |b| {
            b.iter(|| {
                let out = StoreOut::F32(&mut sf);
                adamw_update(&mut p, &g, &mut m, &mut v, out, &hp, true, Moments::Write);
                black_box(&mut p);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
