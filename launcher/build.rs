//! Builds `libmt_mpi.so` (mpi/shim.c) with the machine's `mpicc` (or `$MPICC`) when there is
//! one, and puts it beside the binaries, where `mt-launch` looks for it under mpirun. Without
//! an MPI compiler nothing is built and `mt-launch` runs as before on one node: the binaries
//! never link libmpi: they run as they are where there is no MPI. (The GPU machines' image
//! has OpenMPI 4.1.6 with mpirun and mpicc; a shim built here against 4.1.4 loads there.)

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=mpi/shim.c");
    println!("cargo:rerun-if-env-changed=MPICC");
    println!("cargo:rerun-if-env-changed=PATH");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let lib = out.join("libmt_mpi.so");
    let mpicc = std::env::var_os("MPICC")
        .map(PathBuf::from)
        .or_else(|| find_in_path("mpicc"));
    match &mpicc {
        Some(cc) => println!("cargo:rerun-if-changed={}", cc.display()),
        // Build again once an MPI is installed: installing one changes a PATH directory.
        None => std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .filter(|d| d.is_dir())
            .for_each(|d| println!("cargo:rerun-if-changed={}", d.display())),
    }
    let built = mpicc.is_some_and(|cc| compile(&cc, &lib));
    // The fallback path compiled into mt-launch; empty when no shim was built.
    let shown = if built {
        lib.display().to_string()
    } else {
        String::new()
    };
    println!("cargo:rustc-env=MT_MPI_SHIM_BUILT={shown}");
    if built {
        // OUT_DIR is target/<profile>/build/mt-launch-<hash>/out: the binaries are three up.
        if let Some(bin_dir) = out.ancestors().nth(3) {
            let _ = std::fs::copy(&lib, bin_dir.join("libmt_mpi.so"));
        }
    }
}

fn compile(cc: &Path, lib: &Path) -> bool {
    let status = Command::new(cc)
        .args(["-shared", "-fPIC", "-O3", "-Wall", "-o"])
        .arg(lib)
        .arg("mpi/shim.c")
        .status();
    match status {
        Ok(s) if s.success() => true,
        other => {
            println!(
                "cargo:warning=MPI shim not built ({} failed: {other:?}); mt-launch will refuse to run under mpirun",
                cc.display()
            );
            false
        }
    }
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
