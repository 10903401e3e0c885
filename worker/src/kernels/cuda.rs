//! The CUDA path of the fused ops: kernels compiled at run time by NVRTC (cudarc, loaded
//! from torch's own install), loaded into torch's context and launched on torch's stream.
//!
//! NVRTC comes with torch's wheel (`nvidia/cu13/lib/libnvrtc.so.13`, beside
//! `torch/lib/libtorch_cuda.so`), not on the library path; it is loaded by its full path
//! first (`MT_NVRTC` names another), so that cudarc's own lookup by soname finds it. The
//! kernels are compiled once per process for the device's architecture, on first use.

use std::ffi::{CString, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context as _, Result, bail};
use cudarc::driver::sys::{self, CUfunction, CUmodule, CUresult};
use tch::{Kind, Tensor};

use super::ConvQkv;
use crate::cuda::torch_stream;

/// What every kernel file reads first (bf16 words).
const BF16_H: &str = include_str!("bf16.cuh");
const CONV_QKV_SRC: &str = include_str!("conv_qkv.cu");
const ADAMW_SRC: &str = include_str!("adamw.cu");
const MLP_SRC: &str = include_str!("mlp.cu");
const ROPE_SRC: &str = include_str!("rope.cu");
const CE_SRC: &str = include_str!("ce.cu");
const NORM_SRC: &str = include_str!("norm.cu");
/// Threads per block of every kernel here (conv_qkv.cu's WARPS * 32) and positions per
/// block (its SPAN).
const THREADS: u32 = 128;
const SPAN: i64 = 256;
/// conv_qkv.cu's instances: lanes' channel counts N, for head dims 32 N.
const LANE_CHANNELS: [i64; 4] = [1, 2, 4, 8];

struct Kernels {
    _modules: [CUmodule; 6],
    /// By N's index in `LANE_CHANNELS`.
    conv_fwd: [CUfunction; 4],
    conv_bwd: [CUfunction; 4],
    /// adamw.cu's, by [`adamw_index`].
    adamw: [CUfunction; 4],
    /// mlp.cu's, as [`MLP_ENTRIES`].
    mlp: [CUfunction; 8],
    /// rope.cu's.
    rope: CUfunction,
    /// ce.cu's.
    cross_entropy: CUfunction,
    /// norm.cu's, as [`NORM_ENTRIES`].
    norm: [CUfunction; 4],
}

/// norm.cu's entry points: the `1 + w` RMSNorm's forward and backward, the gated norm's.
const NORM_ENTRIES: [&str; 4] = [
    "norm_plus_one_fwd",
    "norm_plus_one_bwd",
    "gated_norm_fwd",
    "gated_norm_bwd",
];

/// adamw.cu's entry points, by [`adamw_index`].
const ADAMW_ENTRIES: [&str; 4] = [
    "adamw_g32_w32",
    "adamw_g32_w16",
    "adamw_g16_w32",
    "adamw_g16_w16",
];
/// mlp.cu's entry points: the combine's forward and backward for f32 and bf16 router
/// weights ([`COMBINE_FWD`], [`COMBINE_BWD`], + 1 for bf16), the SwiGLU's forward and
/// backward ([`SWIGLU`]) and the clamped SwiGLU's ([`CLAMPED_SWIGLU`]).
const MLP_ENTRIES: [&str; 8] = [
    "moe_combine_fwd_w32",
    "moe_combine_fwd_w16",
    "moe_combine_bwd_w32",
    "moe_combine_bwd_w16",
    "swiglu_fwd",
    "swiglu_bwd",
    "clamped_swiglu_fwd",
    "clamped_swiglu_bwd",
];
const COMBINE_FWD: usize = 0;
const COMBINE_BWD: usize = 2;
const SWIGLU: usize = 4;
const CLAMPED_SWIGLU: usize = 6;

/// conv_qkv.cu's entry points `{prefix}_{N}`, by N's index in [`LANE_CHANNELS`].
fn conv_entries(prefix: &str) -> [String; 4] {
    LANE_CHANNELS.map(|n| format!("{prefix}_{n}"))
}

/// The functions `names` of a loaded module.
fn functions<const N: usize, S: AsRef<str>>(
    module: CUmodule,
    names: &[S; N],
) -> Result<[CUfunction; N]> {
    let mut out = [std::ptr::null_mut(); N];
    for (f, name) in out.iter_mut().zip(names) {
        *f = function(module, name.as_ref().to_string())?;
    }
    Ok(out)
}

// SAFETY: module and function handles are plain driver handles, valid in every thread of
// the process while the context lives (the process's life).
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

fn check(r: CUresult, what: &str) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        bail!("{what} failed: {r:?}")
    }
}

/// The compiled kernels, or why there are none (said once, by the caller).
fn kernels() -> Result<&'static Kernels, &'static str> {
    static KERNELS: OnceLock<Result<Kernels, String>> = OnceLock::new();
    KERNELS
        .get_or_init(|| build().map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(String::as_str)
}

/// Whether the fused kernels can run here; the first failure is logged with its cause.
pub fn available() -> bool {
    static SAID: OnceLock<()> = OnceLock::new();
    match kernels() {
        Ok(_) => true,
        Err(e) => {
            SAID.get_or_init(|| {
                tracing::warn!("fused GPU kernels unavailable, using tch ops instead: {e}")
            });
            false
        }
    }
}

fn build() -> Result<Kernels> {
    let start = std::time::Instant::now();
    load_nvrtc()?;
    let mut dev = 0;
    // SAFETY: writes one device handle; torch made its context current on this thread.
    check(unsafe { sys::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    let attr = |a| {
        let mut v = 0;
        // SAFETY: writes one integer for a valid device.
        check(
            unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) },
            "cuDeviceGetAttribute",
        )
        .map(|_| v)
    };
    use sys::CUdevice_attribute::*;
    let (major, minor) = (
        attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    let arch = format!("--gpu-architecture=compute_{major}{minor}");
    let conv = load_module(
        CONV_QKV_SRC,
        "conv_qkv.cu",
        vec![arch.clone(), "--std=c++17".into()],
    )?;
    // The host's arithmetic, operation for operation: no contracted multiply-adds.
    let adamw = load_module(
        ADAMW_SRC,
        "adamw.cu",
        vec![arch.clone(), "--std=c++17".into(), "--fmad=false".into()],
    )?;
    let mlp = load_module(MLP_SRC, "mlp.cu", vec![arch.clone(), "--std=c++17".into()])?;
    let rope = load_module(
        ROPE_SRC,
        "rope.cu",
        vec![arch.clone(), "--std=c++17".into()],
    )?;
    let ce = load_module(CE_SRC, "ce.cu", vec![arch.clone(), "--std=c++17".into()])?;
    let norm = load_module(NORM_SRC, "norm.cu", vec![arch, "--std=c++17".into()])?;
    let kernels = Kernels {
        conv_fwd: functions(conv, &conv_entries("conv_qkv_fwd"))?,
        conv_bwd: functions(conv, &conv_entries("conv_qkv_bwd"))?,
        adamw: functions(adamw, &ADAMW_ENTRIES)?,
        mlp: functions(mlp, &MLP_ENTRIES)?,
        rope: function(rope, "rope".into())?,
        cross_entropy: function(ce, "cross_entropy".into())?,
        norm: functions(norm, &NORM_ENTRIES)?,
        _modules: [conv, adamw, mlp, rope, ce, norm],
    };
    tracing::debug!(
        "compiled the fused kernels for sm_{major}{minor} in {:.2} s",
        start.elapsed().as_secs_f64()
    );
    Ok(kernels)
}

/// `src` (file `name`) after [`BF16_H`], compiled by NVRTC with `options`: its PTX.
fn compile(src: &str, name: &str, options: Vec<String>) -> Result<String> {
    let opts = cudarc::nvrtc::CompileOptions {
        options,
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(format!("{BF16_H}\n{src}"), opts)
        .map_err(|e| anyhow::anyhow!("NVRTC could not compile {name}: {e:?}"))?;
    Ok(ptx.to_src())
}

/// [`compile`]d and loaded into the current context.
fn load_module(src: &str, name: &str, options: Vec<String>) -> Result<CUmodule> {
    let image = CString::new(compile(src, name, options)?).context("PTX with a NUL")?;
    let mut module = std::ptr::null_mut();
    // SAFETY: a NUL-terminated PTX image; writes one module handle.
    check(
        unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) },
        &format!("cuModuleLoadData ({name})"),
    )?;
    Ok(module)
}

/// Function `name` of a loaded module.
fn function(module: CUmodule, name: String) -> Result<CUfunction> {
    let c = CString::new(name.clone()).expect("no NUL");
    let mut f = std::ptr::null_mut();
    // SAFETY: writes one function handle of a loaded module.
    check(
        unsafe { sys::cuModuleGetFunction(&mut f, module, c.as_ptr()) },
        &format!("cuModuleGetFunction({name})"),
    )?;
    Ok(f)
}

/// Loads torch's NVRTC (and its builtins) globally by full path, unless one is loaded.
fn load_nvrtc() -> Result<()> {
    let dir = match &mt::switches::get().nvrtc {
        Some(p) => p.clone(),
        None => nvrtc_dir()?,
    };
    load_nvrtc_from(&dir)
}

/// Loads NVRTC and its builtins from `dir` (no GPU needed).
fn load_nvrtc_from(dir: &Path) -> Result<()> {
    // The builtins first: NVRTC opens them by name at its first compile.
    for prefix in ["libnvrtc-builtins.so", "libnvrtc.so"] {
        let Some(path) = newest(dir, prefix)? else {
            bail!(
                "no {prefix}* in {} (MT_NVRTC names the folder)",
                dir.display()
            );
        };
        let c = CString::new(path.as_os_str().as_encoded_bytes()).context("path with a NUL")?;
        // SAFETY: dlopen with a valid C string; the handle is kept for the process's life.
        if unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null() {
            bail!("cannot load {}", path.display());
        }
    }
    // SAFETY: only probes the library names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!(
            "NVRTC loaded from {} but not found by soname",
            dir.display()
        );
    }
    Ok(())
}

/// torch's CUDA libraries' folder: `nvidia/cu*/lib` beside the folder that holds the
/// loaded libtorch_cuda.so's `torch/lib`.
fn nvrtc_dir() -> Result<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").context("reading /proc/self/maps")?;
    let torch_cuda = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libtorch_cuda.so"))
        .map(PathBuf::from)
        .context("libtorch_cuda.so is not loaded")?;
    // .../site-packages/torch/lib/libtorch_cuda.so -> .../site-packages/nvidia
    let nvidia = torch_cuda
        .ancestors()
        .nth(3)
        .map(|p| p.join("nvidia"))
        .context("libtorch_cuda.so's path")?;
    for entry in std::fs::read_dir(&nvidia).with_context(|| {
        format!(
            "reading {} (MT_NVRTC names NVRTC's folder)",
            nvidia.display()
        )
    })? {
        let lib = entry?.path().join("lib");
        if newest(&lib, "libnvrtc.so")?.is_some() {
            return Ok(lib);
        }
    }
    bail!("no libnvrtc.so* under {}/*/lib", nvidia.display())
}

/// The file in `dir` named `prefix` or `prefix.<version>` with the longest name (the most
/// specific version); an `.alt` variant is not taken.
fn newest(dir: &Path, prefix: &str) -> Result<Option<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(None);
    };
    let mut best: Option<PathBuf> = None;
    for entry in entries {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let ok = name == prefix || name.starts_with(&format!("{prefix}."));
        if ok
            && best
                .as_ref()
                .is_none_or(|b| b.as_os_str().len() < path.as_os_str().len())
        {
            best = Some(path);
        }
    }
    Ok(best)
}

fn lane_index(d: i64) -> Option<usize> {
    LANE_CHANNELS.iter().position(|&n| 32 * n == d)
}

/// Whether the kernels take this shape and dtype (head dim 32, 64, 128 or 256 for q, k and
/// v alike; 4 taps; bf16).
pub fn supports(s: &ConvQkv, kind: Kind) -> bool {
    kind == Kind::BFloat16 && s.taps == 4 && s.dk == s.dv && lane_index(s.dk).is_some()
}

/// A kernel argument: a pointer to the value.
fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

fn launch(f: CUfunction, blocks: i64, args: &mut [*mut c_void]) -> Result<()> {
    launch_with(f, blocks, THREADS, args, "cuLaunchKernel")
}

/// Launches `f` on torch's stream: `blocks` blocks of `threads`, no dynamic shared memory.
fn launch_with(
    f: CUfunction,
    blocks: i64,
    threads: u32,
    args: &mut [*mut c_void],
    what: &str,
) -> Result<()> {
    let blocks = u32::try_from(blocks)
        .ok()
        .filter(|&b| b < 1 << 31)
        .with_context(|| format!("{what}: {blocks} blocks"))?;
    launch_grid(f, (blocks, 1, 1), (threads, 1), args, what)
}

/// [`launch_with`] for a grid of `grid` blocks of `threads.0` x `threads.1` threads (the
/// caller keeps the grid within the device's limits).
fn launch_grid(
    f: CUfunction,
    grid: (u32, u32, u32),
    threads: (u32, u32),
    args: &mut [*mut c_void],
    what: &str,
) -> Result<()> {
    // SAFETY: the arguments match the kernel's signature (the callers below); the grid is
    // within limits (checked by the callers).
    check(
        unsafe {
            sys::cuLaunchKernel(
                f,
                grid.0,
                grid.1,
                grid.2,
                threads.0,
                threads.1,
                1,
                0,
                torch_stream(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        what,
    )
}

fn ptr(t: &Tensor) -> u64 {
    t.data_ptr() as u64
}

/// `t` as mlp.cu's and ce.cu's kernels read it, 16 bytes at a time: contiguous, and copied
/// where a view starts off a 16-byte boundary (torch's own allocations are 512-byte aligned).
fn packed(t: &Tensor) -> Tensor {
    let t = t.contiguous();
    match ptr(&t) % 16 {
        0 => t,
        _ => t.copy(),
    }
}

/// The arguments every conv_qkv kernel ends with: T, P, C, G, V, then Dk^-1/2.
struct Shape {
    ints: [i32; 5],
    scale: f32,
}

impl Shape {
    fn new(s: &ConvQkv, t: i64) -> Shape {
        let p = s.chunks * s.chunk;
        Shape {
            ints: [t, p, s.chunk, s.g, s.v].map(|x| x as i32),
            scale: (s.dk as f32).powf(-0.5),
        }
    }
}

/// Launches conv_qkv kernel `f` with device pointers `ptrs`, then `shape`.
fn launch_conv(f: CUfunction, blocks: i64, ptrs: &[u64], mut shape: Shape) -> Result<()> {
    let mut ptrs = ptrs.to_vec();
    let mut args: Vec<*mut c_void> = ptrs.iter_mut().map(arg).collect();
    args.extend(shape.ints.iter_mut().map(arg));
    args.push(arg(&mut shape.scale));
    launch(f, blocks, &mut args)
}

/// See `super::conv_qkv`: qkv (B, T, F) bf16 contiguous, w (F, 1, 4) -> (qk, v).
pub fn conv_qkv_fwd(s: &ConvQkv, qkv_btf: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor)> {
    let k = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let n = lane_index(s.dk).context("head dim")?;
    let (b, t) = (qkv_btf.size()[0], qkv_btf.size()[1]);
    let p = s.chunks * s.chunk;
    let opts = (qkv_btf.kind(), qkv_btf.device());
    let qk = Tensor::empty([b, s.g, s.chunks, 2 * s.chunk, s.dk], opts);
    let v = Tensor::empty([b, s.v, s.chunks, s.chunk, s.dv], opts);
    let w = w.contiguous();
    let blocks = b * (2 * s.g + s.v) * ((p + SPAN - 1) / SPAN);
    let ptrs = [ptr(qkv_btf), ptr(&w), ptr(&qk), ptr(&v)];
    launch_conv(k.conv_fwd[n], blocks, &ptrs, Shape::new(s, t))?;
    Ok((qk, v))
}

/// The backward of [`conv_qkv_fwd`]: the gradients of qk and v (bf16, contiguous) -> the
/// gradients of qkv (B, T, F) and of w (F, 1, 4) in w's dtype.
pub fn conv_qkv_bwd(
    s: &ConvQkv,
    qkv_btf: &Tensor,
    w: &Tensor,
    dqk: &Tensor,
    dv: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let k = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let n = lane_index(s.dk).context("head dim")?;
    let (b, t, f) = qkv_btf.size3().context("qkv is (B, T, F)")?;
    let nblk = (t + SPAN - 1) / SPAN;
    let dx = Tensor::empty([b, t, f], (qkv_btf.kind(), qkv_btf.device()));
    let dw_part = Tensor::empty([b * nblk, f, 4], (Kind::Float, qkv_btf.device()));
    let wc = w.contiguous();
    let ptrs = [
        ptr(qkv_btf),
        ptr(&wc),
        ptr(dqk),
        ptr(dv),
        ptr(&dx),
        ptr(&dw_part),
    ];
    let blocks = b * (2 * s.g + s.v) * nblk;
    launch_conv(k.conv_bwd[n], blocks, &ptrs, Shape::new(s, t))?;
    let dw = dw_part.sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    Ok((dx, dw.view([f, 1, 4]).to_kind(w.kind())))
}

/// adamw.cu's kernel for a gradient in bf16 or not, a compute copy in bf16 or not.
fn adamw_index(g_bf16: bool, w_bf16: bool) -> usize {
    2 * usize::from(g_bf16) + usize::from(w_bf16)
}

/// AdamW on elements of a resident block's copy (flat, contiguous, one length): master `p`,
/// moments `m` and `v` (f32), the reduced gradient `g` (f32 or bf16) and the compute copy
/// `w` (bf16 or f32), on torch's stream, with the host's constants `k`
/// (`mt::optim::adamw::element_constants`); `split` as `adamw_update_resident`.
pub fn adamw_resident(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    w: &Tensor,
    k: [f32; 8],
    split: bool,
) -> Result<()> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let n = p.numel();
    for (t, what) in [(g, "g"), (m, "m"), (v, "v"), (w, "w")] {
        if t.numel() != n || !t.is_contiguous() {
            bail!("adamw_resident: {what} has {} elements, p {n}", t.numel());
        }
    }
    if n == 0 {
        return Ok(());
    }
    let f = kernels.adamw[adamw_index(g.kind() == Kind::BFloat16, w.kind() == Kind::BFloat16)];
    const THREADS: u32 = 256;
    let blocks = (n as u64).div_ceil(u64::from(THREADS)).min(16 * 1024) as i64;
    let (mut pp, mut gp, mut mp, mut vp, mut wp) = (ptr(p), ptr(g), ptr(m), ptr(v), ptr(w));
    let mut n = n as i64;
    let mut k = k;
    let mut split = i32::from(split);
    let mut args = [
        arg(&mut pp),
        arg(&mut gp),
        arg(&mut mp),
        arg(&mut vp),
        arg(&mut wp),
        arg(&mut n),
        arg(&mut k),
        arg(&mut split),
    ];
    // The arguments match adamw.cu's signature (five device pointers to `n` elements
    // each, checked above, a count, the constants by value, a flag).
    launch_with(f, blocks, THREADS, &mut args, "cuLaunchKernel (adamw)")
}

mod ce;
mod flash;
mod mlp;
mod norm;
mod rope;
pub use ce::{cross_entropy, cross_entropy_supports};
pub use flash::{FlashSaved, flash_bwd, flash_fwd, flash_supports};
pub use mlp::{
    clamped_swiglu_bwd, clamped_swiglu_fwd, combine_supports, moe_combine_bwd, moe_combine_fwd,
    swiglu_bwd, swiglu_fwd, swiglu_supports,
};
pub use norm::{
    gated_norm_bwd, gated_norm_fwd, gated_norm_supports, norm_plus_one_bwd, norm_plus_one_fwd,
    norm_plus_one_supports,
};
pub use rope::{rope, rope_supports};

#[cfg(test)]
mod tests;
