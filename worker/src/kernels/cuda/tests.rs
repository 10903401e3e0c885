//! The kernel files checked on CPU: NVRTC needs no GPU.

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
