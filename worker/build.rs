//! Give `mt-worker` a RUNPATH relative to itself (`$ORIGIN`, the entries of
//! src/runpath.rs: the wheel's layout and the build tree's `.venv/libtorch`), never an
//! absolute path: a binary copied to another directory or machine finds libtorch through
//! `LD_LIBRARY_PATH` (the GPU machines set it at their torch/lib; the launcher sets it for
//! the workers it spawns when it finds torch itself, launcher/src/torch.rs), not through a
//! build tree that may be gone.
//!
//! And compile src/kernels/backward.cpp (autograd's backward from given gradients),
//! src/kernels/flash.cpp (FlashAttention's forward and backward) and src/profile.cpp
//! (torch's profiler), which tch does not bind, against the same libtorch's
//! headers, with its C++ ABI (`LIBTORCH_CXX11_ABI`, default 1, as torch-sys reads it).

#[allow(dead_code)]
#[path = "../src/runpath.rs"]
mod runpath;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-changed=src/kernels/backward.cpp");
    println!("cargo:rerun-if-changed=src/kernels/flash.cpp");
    println!("cargo:rerun-if-changed=src/profile.cpp");
    println!("cargo:rerun-if-changed=../src/runpath.rs");
    let root = std::env::var("LIBTORCH").expect("LIBTORCH names libtorch (.cargo/config.toml)");
    let root = std::path::Path::new(&root);
    for entry in runpath::RUNPATH {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{entry}");
    }
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .file("src/kernels/backward.cpp")
        .file("src/kernels/flash.cpp")
        .file("src/profile.cpp")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .warnings(false)
        .compile("mt_backward");
}
