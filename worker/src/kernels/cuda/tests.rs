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
    if crate::stream::load_torch_cuda().is_err() {
        eprintln!("skipped: no GPU visible");
        return;
    }
    let dev = tch::Device::Cuda(0);
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

        let rowwise = |got: &Tensor, want: &Tensor| {
            let scale = want.abs().amax([-1i64].as_slice(), true);
            ((f(got) - want).abs() / scale).max().double_value(&[])
        };
        let (ey, edx) = (rowwise(&y, &y_ref), rowwise(&dx, &dx_ref));
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
