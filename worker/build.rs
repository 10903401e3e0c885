//! Bake libtorch's lib/ folder into the binary's RUNPATH so `mt-worker` runs on the build
//! machine without LD_LIBRARY_PATH. On the GPU machine LD_LIBRARY_PATH (which takes
//! precedence over RUNPATH) points at that machine's own torch/lib.
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(root) = std::env::var("LIBTORCH") {
        let lib = std::path::Path::new(&root).join("lib");
        let lib = lib.canonicalize().unwrap_or(lib);
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}
