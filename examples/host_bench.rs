//! Host-side throughput of the step's CPU kernels, for `scripts/bench_host.sh`: memory copy
//! bandwidth (the yardstick), the gradient-slab reduce, and the fused AdamW update.
//!
//! ```text
//! host_bench [--threads T] [--n N] [--iters K] [--workers W,...] [copy] [reduce] [adamw]
//! ```
//! Prints one `RESULT <kernel> key=value …` line per measurement (best of K timed runs
//! after a warm-up). Bytes count what the kernel must move: copy reads and writes n f32;
//! reduce (`accumulate`) reads dst, the W sources and writes dst; `assign` reads the
//! sources and writes dst; AdamW reads p, g, m, v and writes p, m, v and the bf16 store
//! (30 B/param); with a bf16 gradient (`memory.grad_dtype: bfloat16`) 28 B/param; with a
//! split master too (`memory.master_weights: split`) it reads store 2, residual 2, g 2,
//! m 4, v 4 and writes store, residual, m, v: 26 B/param. `MT_SIMD=portable|avx2` lowers
//! the SIMD level.

use std::hint::black_box;
use std::time::Instant;

use half::bf16;
use mt::elem::{GradElem, bits};
use mt::optim::{
    AdamWStep, Moments, StoreOut, WeightsMut, adamw_moments, adamw_moments_bf16, adamw_update,
    adamw_update_bf16_moments, adamw_update_split,
};
use mt::reduce::{accumulate, assign};
use mt::simd::Simd;
use rayon::prelude::*;

struct Args {
    threads: usize,
    n: usize,
    iters: usize,
    workers: Vec<usize>,
    kernels: Vec<String>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        n: 1 << 28,
        iters: 10,
        workers: vec![1, 2, 4],
        kernels: vec![],
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--threads" => a.threads = num(&val("--threads")?)?,
            "--n" => a.n = num(&val("--n")?)?,
            "--iters" => a.iters = num(&val("--iters")?)?.max(1),
            "--workers" => {
                a.workers = val("--workers")?
                    .split(',')
                    .map(num)
                    .collect::<Result<_, _>>()?
            }
            "copy" | "reduce" | "adamw" => a.kernels.push(arg),
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    if a.kernels.is_empty() {
        a.kernels = ["copy", "reduce", "adamw"].map(String::from).to_vec();
    }
    Ok(a)
}

/// A count such as `268435456`, `1e9` or `2^28`.
fn num(s: &str) -> Result<usize, String> {
    let bad = || format!("not a count: {s:?}");
    if let Some((b, e)) = s.split_once('^') {
        let (b, e): (usize, u32) = (b.parse().map_err(|_| bad())?, e.parse().map_err(|_| bad())?);
        return b.checked_pow(e).ok_or_else(bad);
    }
    s.parse::<usize>()
        .or_else(|_| s.parse::<f64>().map(|f| f as usize))
        .map_err(|_| bad())
}

/// Best and median seconds of `iters` runs after one warm-up.
fn time(iters: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut t: Vec<f64> = (0..iters)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    (t[0], t[t.len() / 2])
}

/// A vector filled in parallel, so its pages are faulted in by the threads that use them.
fn filled<T: Send + Sync + Copy>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    v.spare_capacity_mut()
        .par_iter_mut()
        .enumerate()
        .for_each(|(i, x)| {
            x.write(f(i));
        });
    // SAFETY: every element was written just above.
    unsafe { v.set_len(n) };
    v
}

fn val(i: usize, salt: usize) -> f32 {
    let h = (i.wrapping_mul(0x9e37_79b9) ^ salt.wrapping_mul(0x85eb_ca6b)) % 20011;
    (h as f32 - 10005.0) * 1e-5
}

fn report(kernel: &str, extra: &str, (best, median): (f64, f64), bytes: f64, n: usize) {
    println!(
        "RESULT {kernel} {extra} n={n} best_s={best:.6} median_s={median:.6} gb_s={:.2} \
         gelem_s={:.4}",
        bytes / best / 1e9,
        n as f64 / best / 1e9
    );
}

fn copy(a: &Args) {
    let src = filled(a.n, |i| val(i, 1));
    let mut dst = filled(a.n, |_| 0.0f32);
    let t = time(a.iters, || {
        dst.par_chunks_mut(1 << 16)
            .zip(src.par_chunks(1 << 16))
            .for_each(|(d, s)| d.copy_from_slice(s));
        black_box(&mut dst);
    });
    report("copy", "", t, 8.0 * a.n as f64, a.n);
}

/// `accumulate` (dst += Σ) and, for bf16 slabs, `assign` (dst = Σ: a step's first
/// micro-batch, dst not read) over the same sources.
fn reduce_one<T: GradElem>(a: &Args, w: usize, name: &str, make: fn(f32) -> T) {
    let srcs: Vec<Vec<T>> = (0..w).map(|r| filled(a.n, |i| make(val(i, r)))).collect();
    let refs: Vec<&[T]> = srcs.iter().map(|s| s.as_slice()).collect();
    let mut dst = filled(a.n, |i| val(i, 99));
    let t = time(a.iters, || {
        accumulate(&mut dst, &refs);
        black_box(&mut dst);
    });
    let bytes = (8 + w * size_of::<T>()) as f64 * a.n as f64;
    let what = format!("workers={w} dtype={name}");
    report("reduce", &what, t, bytes, a.n);
    if size_of::<T>() == 2 {
        let t = time(a.iters, || {
            assign(&mut dst, &refs);
            black_box(&mut dst);
        });
        let bytes = (4 + w * size_of::<T>()) as f64 * a.n as f64;
        report("assign", &what, t, bytes, a.n);
    }
}

fn adamw(a: &Args) {
    let n = a.n;
    let mut p = filled(n, |i| val(i, 1));
    let g = filled(n, |i| val(i, 2));
    let mut m = filled(n, |i| val(i, 3) * 0.1);
    let mut v = filled(n, |i| val(i, 4).abs() * 0.01);
    let mut s = filled(n, |_| bf16::ZERO);
    let mut step = 0;
    let mut hp = move || {
        step += 1;
        AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            step,
            grad_scale: 1.0,
        }
    };
    let t = time(a.iters, || {
        let out = StoreOut::Bf16(&mut s);
        adamw_update(&mut p, &g, &mut m, &mut v, out, &hp(), true, Moments::Write);
        black_box(&mut p);
    });
    report("adamw", "store=bf16", t, 30.0 * n as f64, n);
    let gb = filled(n, |i| bf16::from_f32(g[i]));
    let t = time(a.iters, || {
        let out = StoreOut::Bf16(&mut s);
        adamw_update(
            &mut p,
            &gb,
            &mut m,
            &mut v,
            out,
            &hp(),
            true,
            Moments::Write,
        );
        black_box(&mut p);
    });
    report(
        "adamw",
        "store=bf16 variant=bf16grad",
        t,
        28.0 * n as f64,
        n,
    );
    let mut lo = filled(n, |_| 0u16);
    bits::split_slice(&p, &mut s, &mut lo);
    drop(p);
    let t = time(a.iters, || {
        let hp = hp();
        adamw_update_split(
            &mut s,
            &mut lo,
            &gb,
            &mut m,
            &mut v,
            &hp,
            true,
            Moments::Write,
        );
        black_box(&mut s);
    });
    report(
        "adamw",
        "store=bf16 variant=split+bf16grad",
        t,
        26.0 * n as f64,
        n,
    );
    // The two passes of a deferred update: what the next forward waits for (store and
    // residual written, m and v read: 18 B/param), then the moments (18 B/param).
    let t = time(a.iters, || {
        let hp = hp();
        adamw_update_split(
            &mut s,
            &mut lo,
            &gb,
            &mut m,
            &mut v,
            &hp,
            true,
            Moments::Keep,
        );
        black_box(&mut s);
    });
    report(
        "adamw",
        "store=bf16 variant=split+bf16grad-weights-pass",
        t,
        18.0 * n as f64,
        n,
    );
    let t = time(a.iters, || {
        adamw_moments(&gb, &mut m, &mut v, &hp());
        black_box(&mut m);
    });
    report(
        "adamw",
        "store=bf16 variant=bf16grad-moments-pass",
        t,
        18.0 * n as f64,
        n,
    );
    // bf16 moments (memory.moments_dtype: bfloat16): the weights pass reads 4 B of moments
    // instead of 8 (14 B/param), the moments pass moves 10 (g 2, m and v 4 read, 4 written).
    let mb = filled(n, |i| bf16::from_f32(m[i]));
    let vb = filled(n, |i| bf16::from_f32(v[i]));
    drop((m, v));
    let (mut m, mut v) = (mb, vb);
    let t = time(a.iters, || {
        let w = WeightsMut::Split {
            hi: &mut s,
            lo: &mut lo,
        };
        let hp = hp();
        adamw_update_bf16_moments(w, &gb, &mut m, &mut v, &hp, true, 1, 0, Moments::Keep);
        black_box(&mut s);
    });
    report(
        "adamw",
        "store=bf16 variant=split+bf16grad+bf16moments-weights-pass",
        t,
        14.0 * n as f64,
        n,
    );
    let t = time(a.iters, || {
        adamw_moments_bf16(&gb, &mut m, &mut v, &hp(), 1, 0);
        black_box(&mut m);
    });
    report(
        "adamw",
        "store=bf16 variant=bf16grad+bf16moments-moments-pass",
        t,
        10.0 * n as f64,
        n,
    );
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("host_bench: {e}");
            std::process::exit(2);
        }
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(a.threads)
        .build()
        .expect("thread pool");
    println!(
        "INFO threads={} simd={} n={} iters={}",
        a.threads,
        Simd::get().name(),
        a.n,
        a.iters
    );
    pool.install(|| {
        for k in &a.kernels {
            match k.as_str() {
                "copy" => copy(&a),
                "reduce" => {
                    for &w in &a.workers {
                        reduce_one(&a, w, "bf16", bf16::from_f32);
                        reduce_one(&a, w, "f32", |x| x);
                    }
                }
                _ => adamw(&a),
            }
        }
    });
}
