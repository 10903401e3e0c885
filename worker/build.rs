//! Bake libtorch's lib/ folder into the binary's RUNPATH so `mt-worker` runs on the build
//! machine without LD_LIBRARY_PATH. On the GPU machine LD_LIBRARY_PATH (which takes
//! precedence over RUNPATH) points at that machine's own torch/lib.
//!
//! And compile src/kernels/backward.cpp (autograd's backward from given gradients),
//! src/kernels/flash.cpp (FlashAttention's forward and backward) and src/profile.cpp
//! (torch's profiler), which tch does not bind, against the same libtorch's
//! headers, with its C++ ABI (`LIBTORCH_CXX11_ABI`, default 1, as torch-sys reads it).
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-changed=src/kernels/backward.cpp");
    println!("cargo:rerun-if-changed=src/kernels/flash.cpp");
    println!("cargo:rerun-if-changed=src/profile.cpp");
    let root = std::env::var("LIBTORCH").expect("LIBTORCH names libtorch (.cargo/config.toml)");
    let root = std::path::Path::new(&root);
    let lib = root.join("lib");
    let lib = lib.canonicalize().unwrap_or(lib);
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
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
