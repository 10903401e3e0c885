#!/usr/bin/env bash
# The wheel a user installs: `pip install megatrain_rs-<version>-py3-none-linux_<arch>.whl`
# puts `mt-launch` and `mt-worker` on PATH next to the torch they run with.
#
# A pure-Python package (python/megatrain_rs/) holding the two binaries, stripped, as
# package data in megatrain_rs/bin/ (and the MPI shim libmt_mpi.so where the build made
# one); its console scripts exec them with that Python's torch/lib on LD_LIBRARY_PATH.
# Requires torch==2.11.0, the libtorch the worker is built against. The binaries' RUNPATH
# ($ORIGIN/../../torch/lib, src/runpath.rs) finds the same torch when run directly.
# The platform tag is linux_<arch>: the binaries link this machine's glibc and libstdc++
# and are not audited for a manylinux tag, so the wheel is for machines like this one (the
# GPU machines run the same image family); pip installs it there, PyPI would refuse it.
#
#   scripts/build_wheel.sh [OUT_DIR]     (default target/wheels; prints the wheel's path)
#   BIN=DIR     take the binaries from DIR instead of `cargo build --release --workspace`
#   PYTHON=...  the Python that writes the zip (stdlib only; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/wheels}
if [ -z "${BIN:-}" ]; then
  cargo build --release --workspace >&2
  BIN=target/release
fi
for b in mt-launch mt-worker; do
  [ -x "$BIN/$b" ] || { echo "build_wheel: $BIN/$b is missing (cargo build --release --workspace)" >&2; exit 1; }
done
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/megatrain_rs/bin"
cp python/megatrain_rs/__init__.py "$stage/megatrain_rs/"
for b in mt-launch mt-worker; do
  strip --strip-unneeded -o "$stage/megatrain_rs/bin/$b" "$BIN/$b"
done
if [ -f "$BIN/libmt_mpi.so" ]; then
  cp "$BIN/libmt_mpi.so" "$stage/megatrain_rs/bin/"
fi
mkdir -p "$out"
"${PYTHON:-python3}" - "$stage" "$out" "$version" "linux_$(uname -m)" <<'PY'
import base64, hashlib, os, sys, zipfile

stage, out, version, plat = sys.argv[1:]
name = "megatrain_rs"
info = f"{name}-{version}.dist-info"
meta = {
    "METADATA": (
        "Metadata-Version: 2.1\n"
        "Name: megatrain-rs\n"
        f"Version: {version}\n"
        "Summary: Train LLMs larger than GPU memory from host RAM (mt-launch, mt-worker)\n"
        "License: Apache-2.0\n"
        "Requires-Python: >=3.9\n"
        "Requires-Dist: torch==2.11.0\n"
    ),
    "WHEEL": (
        "Wheel-Version: 1.0\n"
        "Generator: megatrain-rs scripts/build_wheel.sh\n"
        "Root-Is-Purelib: false\n"
        f"Tag: py3-none-{plat}\n"
    ),
    "entry_points.txt": (
        "[console_scripts]\n"
        "mt-launch = megatrain_rs:launch\n"
        "mt-worker = megatrain_rs:worker\n"
    ),
}
wheel = os.path.join(out, f"{name}-{version}-py3-none-{plat}.whl")
tmp = wheel + ".tmp"
record = []

def add(z, arc, data, mode):
    zi = zipfile.ZipInfo(arc, date_time=(2026, 1, 1, 0, 0, 0))
    zi.external_attr = (0o100000 | mode) << 16
    zi.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(zi, data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append(f"{arc},sha256={digest},{len(data)}")

with zipfile.ZipFile(tmp, "w") as z:
    for root, _, files in sorted(os.walk(stage)):
        for f in sorted(files):
            path = os.path.join(root, f)
            arc = os.path.relpath(path, stage)
            mode = 0o755 if os.access(path, os.X_OK) else 0o644
            with open(path, "rb") as fh:
                add(z, arc, fh.read(), mode)
    for f, text in meta.items():
        add(z, f"{info}/{f}", text.encode(), 0o644)
    record.append(f"{info}/RECORD,,")
    zi = zipfile.ZipInfo(f"{info}/RECORD", date_time=(2026, 1, 1, 0, 0, 0))
    zi.external_attr = 0o100644 << 16
    z.writestr(zi, "\n".join(record) + "\n")
with open(tmp, "rb") as fh:
    os.fsync(fh.fileno())
os.replace(tmp, wheel)
print(wheel)
PY
