#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, and train the built-in tiny Llama on the
# built-in data with 2 worker processes on CPU; the loss is printed every step.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo build --release --workspace
exec target/release/mt-launch --config configs/tiny.yaml --gpus 0 --workers 2 "$@"
