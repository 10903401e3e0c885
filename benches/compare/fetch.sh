#!/usr/bin/env bash
# Fetches, on a machine with network, what benches/compare/run.sh installs on the GPU machine
# (which has none) into the git-ignored benches/compare/vendor/ (~7 MiB; carry it along):
#   megatrain/  the published MegaTrain's source at a pinned commit (its Python package
#               `infinity` and examples/sft; run from the source tree, not pip-installed:
#               its setup.py compiles an optional CUDA extension that needs nvcc)
#   sdist/      DeepSpeed's sdist (PyPI ships no wheel; run.sh installs it with
#               DS_BUILD_OPS=0 and its CPUAdam builds JIT there with g++ and ninja)
#   wheels/     what DeepSpeed (requirements.txt) and MegaTrain (setup.py) need that torch and
#               transformers do not bring, for CPython 3.12 on x86-64 Linux (the GPU machine)
#               and for this machine's Python (to test run.sh --tiny here); accelerate
#               too (transformers 5 wants it for MegaTrain's from_pretrained(device_map="cpu"))
# Left out, and why: `datasets` (MegaTrain's data loading; pyarrow alone is ~40 MiB: run.sh
# puts shim/datasets in its place where it is missing), flash-attn and flash-linear-attention
# (CUDA builds; MegaTrain runs with SDPA), causal-conv1d (hybrid models only), DeepSpeed's
# optional extras.
#
# Environment: MEGATRAIN_GIT (a git directory or URL holding the pinned commit)
#   [the local mirror /work/.mirror/DLYuanGod+MegaTrain/repo if present, else
#   https://github.com/DLYuanGod/MegaTrain]   PIP [.venv/bin/pip, else pip3]
#   PYTHON_VERSIONS [3.12 and this machine's]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
vendor=$here/vendor

# The pins: bump together, and rerun the comparison.
MEGATRAIN_COMMIT=919520f07182c0d4d3e9765b2f915702e71c11a4  # 2026-04-18, main
DEEPSPEED=deepspeed==0.19.8
WHEELS=(einops==0.8.2 tqdm==4.70.1 pyyaml==6.0.4 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 psutil==7.2.2 py-cpuinfo==9.0.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-extensions==4.16.0
  typing-inspection==0.4.5 packaging==26.4 setuptools==84.2.1 wheel==0.48.0 accelerate==1.15.0)

PIP=${PIP:-}
if [ -z "$PIP" ]; then
  if [ -x "$here/../../.venv/bin/pip" ]; then PIP=$here/../../.venv/bin/pip; else PIP=pip3; fi
fi
local_py=$("${PIP%pip*}python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null ||
  python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
PYTHON_VERSIONS=${PYTHON_VERSIONS:-$(printf '%s\n' 3.12 "$local_py" | sort -u | tr '\n' ' ')}

rm -rf "$vendor.tmp"
mkdir -p "$vendor.tmp/wheels" "$vendor.tmp/sdist" "$vendor.tmp/megatrain"

# --- MegaTrain: the pinned commit's files, from a git directory (a bare mirror or a clone).
src=${MEGATRAIN_GIT:-}
if [ -z "$src" ]; then
  if [ -d /work/.mirror/DLYuanGod+MegaTrain/repo ]; then src=/work/.mirror/DLYuanGod+MegaTrain/repo
  else src=https://github.com/DLYuanGod/MegaTrain; fi
fi
if [ -d "$src" ]; then
  gitdir=$src
else
  gitdir=$vendor.tmp/megatrain.git
  git clone --quiet --bare --filter=blob:none "$src" "$gitdir"
fi
git --git-dir="$gitdir" cat-file -e "$MEGATRAIN_COMMIT^{commit}" ||
  { echo "fetch.sh: $src has no commit $MEGATRAIN_COMMIT" >&2; exit 1; }
# File by file (the upstream tree carries built aarch64 binaries and caches, which are left
# out, and which a partial mirror may lack).
git --git-dir="$gitdir" ls-tree -r --name-only "$MEGATRAIN_COMMIT" -- \
    infinity examples/sft LICENSE README.md setup.py requirements.txt |
  grep -Ev '(^|/)(build|__pycache__)/|\.(so|o|pyc)$' |
  while read -r f; do
    mkdir -p "$vendor.tmp/megatrain/$(dirname "$f")"
    git --git-dir="$gitdir" cat-file blob "$MEGATRAIN_COMMIT:$f" > "$vendor.tmp/megatrain/$f"
  done
echo "$MEGATRAIN_COMMIT" > "$vendor.tmp/megatrain/COMMIT"
rm -rf "$vendor.tmp/megatrain.git"

# --- DeepSpeed's sdist and the wheels.
"$PIP" download --quiet --no-deps --no-binary :all: -d "$vendor.tmp/sdist" "$DEEPSPEED"
for v in $PYTHON_VERSIONS; do
  "$PIP" download --quiet --no-deps --only-binary :all: --python-version "$v" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
    -d "$vendor.tmp/wheels" "${WHEELS[@]}"
done

rm -rf "$vendor"
mv "$vendor.tmp" "$vendor"
(cd "$vendor" && { echo "MegaTrain $MEGATRAIN_COMMIT"; ls sdist wheels; } > MANIFEST)
echo "fetch.sh: $vendor holds $(du -sh "$vendor" | cut -f1) (carry benches/compare/vendor to the GPU machine):" >&2
cat "$vendor/MANIFEST" >&2
