//! Running launchers under mpirun for the multi-node tests (`nodes.rs`,
//! `nodes_checkpoint.rs`): where mpirun is absent they are skipped with a message, except in
//! CI (`CI=true`), where scripts/setup.sh installs OpenMPI and they must run.
//!
//! MPICH runs beside it: [`mpich`] gives Debian's `mpiexec.mpich` (Hydra), and every helper
//! here that takes an mpirun path starts that one with MPICH's flags and a shim built
//! against MPICH's `mpi.h` (the C ABIs differ, so each MPI needs its own).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::{launcher, run};

/// One multi-node test at a time: each starts several launchers and workers, and the fault
/// tests time how fast every rank stops, which other runs competing for the cores would
/// blur (CI's machine has 2 cores).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `mpirun` and the lock that serializes these tests, or `None` (with the reason printed)
/// where the test may be skipped.
pub fn mpirun() -> Option<(PathBuf, std::sync::MutexGuard<'static, ()>)> {
    let found = in_path("mpirun");
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI must run the multi-node tests: mpirun is missing (scripts/setup.sh installs OpenMPI)"
        );
        eprintln!("skipped: no mpirun on PATH (apt-get install openmpi-bin libopenmpi-dev)");
    }
    let lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    found.map(|m| (m, lock))
}

/// MPICH's launcher (`mpiexec.mpich`) and the lock that serializes these tests, or `None`
/// (with the reason printed) where the test may be skipped; CI must have it
/// (scripts/setup.sh installs MPICH beside OpenMPI there).
pub fn mpich() -> Option<(PathBuf, std::sync::MutexGuard<'static, ()>)> {
    let found = in_path(MPICH_EXEC).filter(|_| in_path("mpicc.mpich").is_some());
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI must run the MPICH tests: {MPICH_EXEC} or mpicc.mpich is missing (scripts/setup.sh installs MPICH)"
        );
        eprintln!(
            "skipped: no {MPICH_EXEC} and mpicc.mpich on PATH (apt-get install mpich libmpich-dev)"
        );
    }
    let lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    found.map(|m| (m, lock))
}

/// Debian's name for MPICH's process manager (Hydra).
const MPICH_EXEC: &str = "mpiexec.mpich";

fn in_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The MPI shim built with `mpicc.mpich` (once per test binary), for launchers under MPICH:
/// the one the build put beside the binaries is OpenMPI's.
fn mpich_shim() -> &'static Path {
    static SHIM: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    SHIM.get_or_init(|| {
        let dir = super::scratch("mpich-shim");
        let lib = dir.join("libmt_mpi.so");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("mpi/shim.c");
        let out = Command::new("mpicc.mpich")
            .args(["-shared", "-fPIC", "-O3", "-Wall", "-Werror", "-o"])
            .arg(&lib)
            .arg(&src)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mpicc.mpich failed on {}:\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        lib
    })
}

/// `mpirun -np ranks mt-launch --gpus 0 --workers W <args>`, as root too, with more ranks
/// than cores; under MPICH (`mpirun` is [`mpich`]'s), `mpiexec.mpich -n ranks` with the
/// MPICH shim.
pub fn mpi_command(mpirun: &Path, ranks: usize, workers: usize, args: &[&str]) -> Command {
    let mut cmd = Command::new(mpirun);
    cmd.current_dir(super::fresh_cwd());
    if mpirun.file_name().is_some_and(|n| n == MPICH_EXEC) {
        // Hydra passes the environment on, runs as root and oversubscribes as it is.
        cmd.args(["-n", &ranks.to_string()])
            .env("MT_MPI_SHIM", mpich_shim());
    } else {
        cmd.args(["--oversubscribe", "-np", &ranks.to_string()])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            // OpenMPI 4 over shared memory only: no network probing on a CI box.
            .env("OMPI_MCA_btl", "self,vader");
    }
    cmd.arg(launcher())
        .args(["--gpus", "0", "--workers", &workers.to_string()])
        .args(args);
    cmd
}

/// Runs `ranks` launchers of `workers` CPU workers each with `args` to completion: one
/// directly (`env` is then ignored, as the one-node baselines need none), several under
/// mpirun with `env` set.
pub fn launch(
    mpirun: &Path,
    ranks: usize,
    workers: usize,
    args: &[&str],
    env: &[(&str, &str)],
) -> Output {
    match ranks {
        1 => run(&[&["--gpus", "0", "--workers", &workers.to_string()], args].concat()),
        _ => mpi_command(mpirun, ranks, workers, args)
            .envs(env.iter().copied())
            .output()
            .unwrap(),
    }
}

/// Fails with every output of the run `tag` unless it succeeded.
pub fn assert_mpi_ok(out: &Output, tag: &str) {
    assert!(
        out.status.success(),
        "{tag} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
