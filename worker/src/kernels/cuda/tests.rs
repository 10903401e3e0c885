//! The kernel files checked on CPU (NVRTC needs no GPU), and on a GPU where one is visible
//! (the `gpu_` tests: skipped without one).

use super::*;

/// Every kernel file compiles with NVRTC for Hopper (no GPU needed: NVRTC comes with
/// torch's wheel in .venv), with each entry point `build` loads: a kernel that stops
/// compiling fails here, on CPU, not on the GPU machine.
#[test]
fn every_kernel_file_compiles_with_its_entry_points() {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/lib");
    let dir = std::fs::read_dir(&lib)
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/setup.sh makes .venv)", lib.display()))
        .filter_map(|e| e.ok().map(|e| e.path().join("site-packages/nvidia")))
        .filter_map(|nvidia| std::fs::read_dir(nvidia).ok())
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path().join("lib")))
        .find(|l| newest(l, "libnvrtc.so").is_ok_and(|n| n.is_some()))
        .unwrap_or_else(|| panic!("no nvidia/*/lib/libnvrtc.so* under {}", lib.display()));
    load_nvrtc_from(&dir).unwrap();
    let arch = "--gpu-architecture=compute_90".to_string();
    let conv: Vec<String> = ["conv_qkv_fwd", "conv_qkv_bwd"]
        .iter()
        .flat_map(|p| conv_entries(p))
        .collect();
    let files = [
        ("conv_qkv.cu", CONV_QKV_SRC, conv, false),
        (
            "adamw.cu",
            ADAMW_SRC,
            ADAMW_ENTRIES.map(String::from).to_vec(),
            true,
        ),
        (
            "mlp.cu",
            MLP_SRC,
            MLP_ENTRIES.map(String::from).to_vec(),
            false,
        ),
        ("rope.cu", ROPE_SRC, vec!["rope".to_string()], false),
        ("ce.cu", CE_SRC, vec!["cross_entropy".to_string()], false),
        (
            "norm.cu",
            NORM_SRC,
            NORM_ENTRIES.map(String::from).to_vec(),
            false,
        ),
    ];
    for (name, src, entries, no_fma) in files {
        let mut opts = vec![arch.clone(), "--std=c++17".into()];
        if no_fma {
            opts.push("--fmad=false".into());
        }
        let ptx = compile(src, name, opts).unwrap_or_else(|e| panic!("{e:#}"));
        for e in entries {
            assert!(
                ptx.contains(&format!(".entry {e}(")),
                "{name} has no entry point {e}"
            );
        }
    }
}

/// The first GPU, or None (said so) where none is visible.
fn gpu() -> Option<tch::Device> {
    match crate::cuda::load_torch_cuda() {
        Ok(()) => Some(tch::Device::Cuda(0)),
        Err(_) => {
            eprintln!("skipped: no GPU visible");
            None
        }
    }
}

/// The largest |got - want| of a row (the last dim) relative to the row's largest |want|,
/// over all rows; `got` in any dtype, `want` f64.
fn rowwise_error(got: &Tensor, want: &Tensor) -> f64 {
    let scale = want.abs().amax([-1i64].as_slice(), true);
    ((got.to_kind(Kind::Double) - want).abs() / scale)
        .max()
        .double_value(&[])
}

/// norm.cu against the `1 + w` RMSNorm and its gradients in f64, on a GPU (skipped where
/// none is visible, as in CI; scripts/check_gpu.sh part `kernels` runs it on the device):
/// rows of 5120 (Qwen3.5's hidden size, 256 threads a row), 2304 (Gemma 2's: 288 packs
/// over 128 threads, the last round partial), 256 (a head: 32 threads, 8 rows a block),
/// over 1001 rows (a partial block).
/// Bounds: y and dx are rounded once to bf16 (bf16's unit roundoff 2^-8 of the element,
/// so of the row's largest), from f32 sums of H terms (H 2^-24 relative at worst), so
/// within 2^-8 + H 2^-24 of the f64 value relative to the row's scale (a wrong term is
/// O(1)); dw is f32 summed over rows (1e-4 relative is far above the f32 rounding of 1001
/// partial sums and 100x below a wrong term's O(1e-2)).
#[test]
fn gpu_norm_plus_one_matches_f64() {
    let Some(dev) = gpu() else { return };
    tch::manual_seed(11);
    let eps = 1e-6;
    for h in [5120i64, 2304, 256] {
        let rows = 1001;
        let x = (Tensor::randn([rows, h], (Kind::Float, dev)) * 3.0).to_kind(Kind::BFloat16);
        let w = (Tensor::randn([h], (Kind::Float, dev)) * 0.1).to_kind(Kind::BFloat16);
        let dy = Tensor::randn([rows, h], (Kind::Float, dev)).to_kind(Kind::BFloat16);
        let w1 = w.to_kind(Kind::Float) + 1.0;
        let (y, rstd) = norm_plus_one_fwd(&x, &w1, eps, true).unwrap();
        let (dx, dw) = norm_plus_one_bwd(&x, &dy, &w1, &rstd.unwrap()).unwrap();

        let f = |t: &Tensor| t.to_kind(Kind::Double);
        let (xd, w1d, dyd) = (f(&x), f(&w1), f(&dy));
        let rs = (xd.square().mean_dim(-1, true, Kind::Double) + eps).rsqrt();
        let xhat = &xd * &rs;
        let y_ref = &xhat * &w1d;
        let g = &dyd * &w1d;
        let dot = (&g * &xhat).mean_dim(-1, true, Kind::Double);
        let dx_ref = &rs * (&g - &xhat * dot);
        let dw_ref = (&dyd * &xhat).sum_dim_intlist([0i64].as_slice(), false, Kind::Double);

        let (ey, edx) = (rowwise_error(&y, &y_ref), rowwise_error(&dx, &dx_ref));
        let edw = ((f(&dw) - &dw_ref).norm() / dw_ref.norm()).double_value(&[]);
        let bound = 2f64.powi(-8) + h as f64 * 2f64.powi(-24);
        eprintln!(
            "norm.cu h {h}: y {ey:.2e}, dx {edx:.2e} (bound {bound:.2e}), dw {edw:.2e} (bound 1e-4)"
        );
        assert!(ey <= bound, "h {h}: y off by {ey:e} of the row's scale");
        assert!(edx <= bound, "h {h}: dx off by {edx:e} of the row's scale");
        assert!(edw <= 1e-4, "h {h}: dw off by {edw:e}");
    }
}

/// norm.cu's gated norm against f64, on a GPU (skipped where none is visible): value heads
/// of 128 and 64, T = 200 of P = 256 padded positions (o past T is garbage the kernel must
/// not read, and its gradient there exactly zero), z a strided view of a wider projection
/// output, as the model's. Bounds as [`gpu_norm_plus_one_matches_f64`]'s: one bf16 rounding
/// (2^-8 of the row's scale) plus f32 sums of Dv terms; dw 1e-4.
#[test]
fn gpu_gated_norm_matches_f64() {
    let Some(dev) = gpu() else { return };
    tch::manual_seed(12);
    let (b, t, p, v, eps) = (2i64, 200i64, 256i64, 6i64, 1e-6);
    let bf = |x: Tensor| x.to_kind(Kind::BFloat16);
    for dv in [128i64, 64] {
        let o = bf(Tensor::randn([b, v, p, dv], (Kind::Float, dev)) * 2.0);
        let zba = bf(Tensor::randn([b, t, v * dv + 2 * v], (Kind::Float, dev)) * 2.0);
        let z = zba.narrow(2, 0, v * dv).view([b, t, v, dv]);
        let w = (Tensor::randn([dv], (Kind::Float, dev)) * 0.1 + 1.0).to_kind(Kind::BFloat16);
        let wf = w.to_kind(Kind::Float);
        let dy = bf(Tensor::randn([b, t, v * dv], (Kind::Float, dev)));
        let (y, rstd) = gated_norm_fwd(&o, &z, &wf, eps, true).unwrap();
        let (d_o, dz, dw) = gated_norm_bwd(&o, &z, &wf, &rstd.unwrap(), &dy).unwrap();

        let f = |t: &Tensor| t.to_kind(Kind::Double);
        let o_btvd = f(&o).narrow(2, 0, t).permute([0, 2, 1, 3]);
        let (zd, wd, dyd) = (f(&z), f(&wf), f(&dy).view([b, t, v, dv]));
        let rs = (o_btvd.square().mean_dim(-1, true, Kind::Double) + eps).rsqrt();
        let xh = &o_btvd * &rs;
        let sg = zd.sigmoid();
        let s = &zd * &sg;
        let n = &xh * &wd;
        let y_ref = &n * &s;
        let dz_ref = &dyd * &n * &sg * ((1.0 - &sg) * &zd + 1.0);
        let dn = &dyd * &s;
        let g = &dn * &wd;
        let dot = (&g * &xh).mean_dim(-1, true, Kind::Double);
        let do_ref = &rs * (&g - &xh * dot);
        let dw_ref = (&dn * &xh).sum_dim_intlist([0i64, 1, 2].as_slice(), false, Kind::Double);

        let ey = rowwise_error(&y.view([b, t, v, dv]), &y_ref);
        let edz = rowwise_error(&dz, &dz_ref);
        let edo = rowwise_error(&d_o.narrow(2, 0, t).permute([0, 2, 1, 3]), &do_ref);
        let edw = ((f(&dw) - &dw_ref).norm() / dw_ref.norm()).double_value(&[]);
        let past = d_o.narrow(2, t, p - t).abs().max().double_value(&[]);
        let bound = 2f64.powi(-8) + dv as f64 * 2f64.powi(-24);
        eprintln!(
            "gated norm dv {dv}: y {ey:.2e}, dz {edz:.2e}, do {edo:.2e} (bound {bound:.2e}), dw {edw:.2e} (bound 1e-4), do past T {past}"
        );
        assert!(ey <= bound, "dv {dv}: y off by {ey:e} of the row's scale");
        assert!(
            edz <= bound,
            "dv {dv}: dz off by {edz:e} of the row's scale"
        );
        assert!(
            edo <= bound,
            "dv {dv}: do off by {edo:e} of the row's scale"
        );
        assert!(edw <= 1e-4, "dv {dv}: dw off by {edw:e}");
        assert_eq!(past, 0.0, "dv {dv}: do past T");
    }
}
