#!/usr/bin/env bash
# Idempotent setup: a git-ignored .venv holding torch==2.11.0 (our libtorch) and the
# packages the test fixtures use, plus the stable link .venv/libtorch that
# .cargo/config.toml points LIBTORCH at. After this `cargo build --release --workspace` works,
# and the binaries in target/release find libtorch through their RUNPATH, relative to the
# binary ($ORIGIN/../../.venv/libtorch/lib, src/runpath.rs), no LD_LIBRARY_PATH needed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# wandb and mlflow-skinny: `logging.report_to: wandb, mlflow` (launcher/tests/trackers.rs).
# mlflow-skinny is MLflow's client and file store without the server's dependencies
# (SQLAlchemy, Flask, pandas...): ~10 s to install beside wandb.
REQS="torch==2.11.0 transformers==5.17.0 safetensors numpy pyarrow datasets tensorboard wandb mlflow-skinny"
STAMP=.venv/.mt-setup-$(echo "$REQS" | cksum | cut -d' ' -f1)

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if [ ! -f "$STAMP" ]; then
  echo "setup: installing $REQS (first time: a few minutes, ~5 GB)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install --quiet $REQS
  rm -f .venv/.mt-setup-*
  touch "$STAMP"
fi
torch_dir=$(.venv/bin/python -c 'import os, torch; print(os.path.dirname(torch.__file__))')
# The resolved path: .venv may itself be a link (worktrees share one venv), and the link
# must not depend on where it was made from.
ln -sfn "$(readlink -f "$torch_dir")" .venv/libtorch
echo "setup: libtorch $(.venv/bin/python -c 'import torch; print(torch.__version__)') at .venv/libtorch"

# OpenMPI and MPICH for the multi-node tests (launcher/tests/nodes.rs: 2 and 3 ranks on this
# machine, under each) and the MPI shim (launcher/build.rs builds it with mpicc, OpenMPI's
# where both are installed: Debian ranks it first; the MPICH tests build their own with
# mpicc.mpich). Installed from the system's packages where missing, in CI (which must run
# those tests) or when asked with MT_MPI=1; elsewhere the tests say they are skipped and
# mt-launch works on one node without MPI.
mpi_packages=()
if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
  mpi_packages+=(openmpi-bin libopenmpi-dev)
fi
if ! command -v mpiexec.mpich >/dev/null || ! command -v mpicc.mpich >/dev/null; then
  mpi_packages+=(mpich libmpich-dev)
fi
if [ ${#mpi_packages[@]} -gt 0 ]; then
  if [ "${CI:-}" = "true" ] || [ "${MT_MPI:-}" = "1" ]; then
    if command -v apt-get >/dev/null; then
      echo "setup: installing ${mpi_packages[*]}"
      sudo=""
      [ "$(id -u)" = 0 ] || sudo="sudo"
      $sudo apt-get update -qq
      $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${mpi_packages[@]}" >/dev/null
    else
      echo "setup: no apt-get: install ${mpi_packages[*]} (OpenMPI's mpirun and mpicc, MPICH's mpiexec.mpich and mpicc.mpich) with the system's package manager" >&2
      exit 1
    fi
  else
    echo "setup: missing ${mpi_packages[*]}: those multi-node tests will be skipped (MT_MPI=1 scripts/setup.sh installs them)"
  fi
fi
