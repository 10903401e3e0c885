//! Where `mt-worker` finds libtorch without an absolute path into the build tree: the
//! RUNPATH entries that worker/build.rs bakes into it, all relative to the binary
//! (`$ORIGIN`), one per layout we ship, so a copied or installed binary depends on no
//! directory of the machine it was built on. The launcher checks the same entries
//! ([`beside`]) before it asks Python for a torch (`launcher/src/torch.rs`).
//!
//! std only: worker/build.rs includes this file as it is (`#[path]`).

use std::path::{Path, PathBuf};

/// RUNPATH entries of `mt-worker`, in search order. `LD_LIBRARY_PATH` goes first.
pub const RUNPATH: &[&str] = &[
    // The wheel (scripts/build_wheel.sh): site-packages/megatrain_rs/bin/ beside torch/.
    "$ORIGIN/../../torch/lib",
    // The build tree: target/release/ under the checkout whose .venv/libtorch links torch
    // (scripts/setup.sh).
    "$ORIGIN/../../.venv/libtorch/lib",
    // Its test binaries: target/release/deps/.
    "$ORIGIN/../../../.venv/libtorch/lib",
];

/// The library of libtorch that `mt-worker` links first (with libc10.so beside it).
pub const LIBTORCH_SO: &str = "libtorch_cpu.so";

/// The torch release the worker is built against (tch 0.24): `major.minor`.
pub const TORCH_VERSION: &str = "2.11";

/// The directories [`RUNPATH`] names for a binary in directory `bin_dir`.
pub fn beside(bin_dir: &Path) -> Vec<PathBuf> {
    RUNPATH
        .iter()
        .map(|e| {
            let rest = e.trim_start_matches("$ORIGIN/");
            bin_dir.join(rest)
        })
        .collect()
}

/// Whether `dir` holds libtorch ([`LIBTORCH_SO`]).
pub fn has_libtorch(dir: &Path) -> bool {
    dir.join(LIBTORCH_SO).is_file()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_relative_to_the_binary() {
        for e in RUNPATH {
            assert!(e.starts_with("$ORIGIN/"), "{e} is not relative to $ORIGIN");
        }
        let dirs = beside(Path::new("/opt/x/bin"));
        assert_eq!(dirs[0], Path::new("/opt/x/bin/../../torch/lib"));
    }
}
