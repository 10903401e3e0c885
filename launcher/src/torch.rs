//! The worker binary and the libtorch it runs with, found before any long work.
//!
//! `mt-launch` itself never links libtorch; `mt-worker` does, through its RUNPATH, which is
//! relative to the binary only (`mt::runpath`: the wheel's layout, the build tree). Where
//! none of those holds libtorch, the launcher finds a torch for its workers, in order:
//! 1. `MT_LIBTORCH`: torch's `lib/` folder, or a torch / libtorch folder holding `lib/`;
//! 2. `LD_LIBRARY_PATH` already holding libtorch (the GPU machines' way): nothing to add;
//! 3. the worker's RUNPATH directories: nothing to add;
//! 4. `LIBTORCH` (a libtorch folder, as tch's build reads it);
//! 5. the torch of `python3` (or `$MT_PYTHON`), found without importing it, which must be
//!    torch [`mt::runpath::TORCH_VERSION`].
//!
//! and prepends that folder to the workers' `LD_LIBRARY_PATH`. Found nowhere, the launch
//! fails at once saying how to give one.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail};
use mt::runpath::{LIBTORCH_SO, TORCH_VERSION, beside, has_libtorch};

/// Names a folder holding libtorch for the workers.
const ENV_LIBTORCH: &str = "MT_LIBTORCH";
/// Names the worker binary (default: `mt-worker` beside this executable).
const ENV_WORKER: &str = "MT_WORKER_BIN";

/// The worker binary and what its environment needs for libtorch.
#[derive(Debug, Clone)]
pub struct Worker {
    pub bin: PathBuf,
    /// The folder to put first on the workers' `LD_LIBRARY_PATH`; None when the worker
    /// finds libtorch as it is.
    pub lib: Option<PathBuf>,
}

impl Worker {
    /// `LD_LIBRARY_PATH` for a worker: [`Worker::lib`] before the launcher's own value.
    pub fn library_path(&self) -> Option<OsString> {
        let lib = self.lib.as_ref()?;
        let rest = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
        let dirs = std::iter::once(lib.clone()).chain(std::env::split_paths(&rest));
        std::env::join_paths(dirs).ok()
    }
}

/// The worker binary (`MT_WORKER_BIN`, or `mt-worker` beside this executable) and the
/// libtorch it will run with (module docs).
pub fn locate() -> Result<Worker> {
    let bin = match &mt::switches::get().worker_bin {
        Some(p) => p.clone(),
        None => {
            let exe = std::env::current_exe().context("locate mt-launch")?;
            let bin = exe.with_file_name("mt-worker");
            if !bin.is_file() {
                bail!(
                    "worker binary not found at {} (build both binaries: cargo build --release --workspace; or set {ENV_WORKER})",
                    bin.display()
                );
            }
            bin
        }
    };
    let lib = libtorch_for(&bin)?;
    if let Some(lib) = &lib {
        tracing::debug!("workers run with libtorch from {}", lib.display());
    }
    Ok(Worker { bin, lib })
}

/// The folder of libtorch to give worker `bin`, None where it finds one itself.
fn libtorch_for(bin: &Path) -> Result<Option<PathBuf>> {
    if let Some(given) = mt::switches::get().libtorch.clone() {
        return lib_of(&given).map(Some).ok_or_else(|| {
            anyhow!(
                "{ENV_LIBTORCH}={}: no {LIBTORCH_SO} there nor in its lib/ (expected torch's lib folder, e.g. the output of {})",
                given.display(),
                python_hint()
            )
        });
    }
    let ld = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
    if std::env::split_paths(&ld).any(|d| has_libtorch(&d)) {
        return Ok(None);
    }
    let bin_dir = bin.parent().unwrap_or(Path::new("."));
    if beside(bin_dir).iter().any(|d| has_libtorch(d)) {
        return Ok(None);
    }
    if let Some(root) = std::env::var_os("LIBTORCH")
        && let Some(lib) = lib_of(Path::new(&root))
    {
        return Ok(Some(lib));
    }
    python_torch().map(Some)
}

/// `dir` if it holds libtorch, else its `lib/` if that does.
fn lib_of(dir: &Path) -> Option<PathBuf> {
    [dir.to_path_buf(), dir.join("lib")]
        .into_iter()
        .find(|d| has_libtorch(d))
}

fn python_hint() -> String {
    "python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), \"lib\"))'"
        .into()
}

/// torch's `lib/` folder of `$MT_PYTHON` (default `python3`), found without importing
/// torch (which takes seconds), checked to be torch [`TORCH_VERSION`].
fn python_torch() -> Result<PathBuf> {
    let python = mt::switches::get()
        .python
        .clone()
        .unwrap_or_else(|| "python3".into());
    let shown = Path::new(&python).display().to_string();
    let fail = |why: String| {
        anyhow!(
            "mt-worker cannot find libtorch ({LIBTORCH_SO} of torch {TORCH_VERSION}): {why}. Set {ENV_LIBTORCH} (or LD_LIBRARY_PATH) to torch's lib folder, or install it for {shown}: {shown} -m pip install torch=={TORCH_VERSION}.0"
        )
    };
    let out = Command::new(&python)
        .args([
            "-c",
            "import importlib.util as u; s = u.find_spec('torch'); print(s.submodule_search_locations[0] if s else '')",
        ])
        .output();
    let out = match out {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            return Err(fail(format!(
                "{shown} failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            )));
        }
        Err(e) => return Err(fail(format!("{shown} cannot be run ({e})"))),
    };
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if dir.is_empty() {
        return Err(fail(format!("{shown} has no torch")));
    }
    let torch = PathBuf::from(dir);
    let version = std::fs::read_to_string(torch.join("version.py"))
        .ok()
        .and_then(|t| version_of(&t));
    match version {
        Some(v) if same_release(&v) => {}
        Some(v) => {
            return Err(fail(format!(
                "{shown}'s torch at {} is {v}",
                torch.display()
            )));
        }
        None => {
            return Err(fail(format!(
                "{}/version.py does not say which torch it is",
                torch.display()
            )));
        }
    }
    let lib = torch.join("lib");
    match has_libtorch(&lib) {
        true => Ok(lib),
        false => Err(fail(format!("{} holds no {LIBTORCH_SO}", lib.display()))),
    }
}

/// `__version__` of a torch/version.py (`__version__ = '2.11.0+cu130'`, maybe typed).
fn version_of(text: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (name, value) = l.split_once('=')?;
        let name = name.split(':').next()?.trim();
        (name == "__version__").then(|| value.trim().trim_matches(['\'', '"']).to_string())
    })
}

/// Whether torch `version` (e.g. `2.11.0+cu130`) is the release the worker is built for.
fn same_release(version: &str) -> bool {
    version
        .strip_prefix(TORCH_VERSION)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '+']))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_version_torch_writes() {
        let text = "from typing import Optional\n\n__all__ = ['__version__']\n__version__ = '2.11.0+cu130'\ndebug = False\n";
        assert_eq!(version_of(text).as_deref(), Some("2.11.0+cu130"));
        let typed = "__version__: str = \"2.11.0\"\n";
        assert_eq!(version_of(typed).as_deref(), Some("2.11.0"));
        assert!(same_release("2.11.0+cu130"));
        assert!(same_release("2.11.1"));
        assert!(!same_release("2.1.0"));
        assert!(!same_release("2.110.0"));
    }
}
