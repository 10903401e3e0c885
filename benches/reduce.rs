//! Gradient-slab reduce throughput (`mt::reduce::accumulate`): `dst += Σ_W src_w` for W
//! workers' bf16 or f32 slabs, against a plain parallel copy of the same length as the
//! memory yardstick. Bytes are what the kernel must move: dst read and written, each source
//! read once (copy: read + write). `workers_sum_sq` also returns Σ dst² (the norm pass
//! folded in); `assign_workers` is `dst = Σ` (dst written, not read). `MT_SIMD=portable|avx2` lowers the SIMD level.
//!
//! `cargo bench -p mt --bench reduce`; scripts/bench_host.sh runs the same comparison.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use mt::elem::GradElem;
use mt::reduce::{accumulate, accumulate_sum_sq, assign};
use mt::simd::Simd;
use rayon::prelude::*;

/// 512 MiB of f32 destination: well beyond a server's last-level cache.
const N: usize = 1 << 27;

fn val(i: usize, salt: usize) -> f32 {
    let h = (i.wrapping_mul(0x9e37_79b9) ^ salt.wrapping_mul(0x85eb_ca6b)) % 20011;
    (h as f32 - 10005.0) * 1e-5
}

fn reduce<T: GradElem>(c: &mut Criterion, dtype: &str, make: fn(f32) -> T) {
    let mut group = c.benchmark_group(format!("reduce_{dtype}_{}", Simd::get().name()));
    group.sample_size(20);
    for w in [1, 2, 4] {
        let srcs: Vec<Vec<T>> = (0..w)
            .map(|r| (0..N).map(|i| make(val(i, r))).collect())
            .collect();
        let refs: Vec<&[T]> = srcs.iter().map(|s| s.as_slice()).collect();
        let mut dst: Vec<f32> = (0..N).map(|i| val(i, 99)).collect();
        group.throughput(Throughput::Bytes(((8 + w * size_of::<T>()) * N) as u64));
        group.bench_function(BenchmarkId::new("workers", w), |b| {
            b.iter(|| {
                accumulate(&mut dst, &refs);
                black_box(&mut dst);
            })
        });
        group.bench_function(BenchmarkId::new("workers_sum_sq", w), |b| {
            b.iter(|| black_box(accumulate_sum_sq(&mut dst, &refs)))
        });
        group.throughput(Throughput::Bytes(((4 + w * size_of::<T>()) * N) as u64));
        group.bench_function(BenchmarkId::new("assign_workers", w), |b| {
            b.iter(|| {
                assign(&mut dst, &refs);
                black_box(&mut dst);
            })
        });
    }
    group.finish();
}

fn copy(c: &mut Criterion) {
    let src: Vec<f32> = (0..N).map(|i| val(i, 1)).collect();
    let mut dst = vec![0.0f32; N];
    let mut group = c.benchmark_group("copy");
    group.sample_size(20);
    group.throughput(Throughput::Bytes(8 * N as u64));
    group.bench_function("f32", |b| {
        b.iter(|| {
            dst.par_chunks_mut(1 << 16)
                .zip(src.par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s));
            black_box(&mut dst);
        })
    });
    group.finish();
}

fn bench(c: &mut Criterion) {
    copy(c);
    reduce(c, "bf16", bf16::from_f32);
    reduce(c, "f32", |x| x);
}

criterion_group!(benches, bench);
criterion_main!(benches);
