#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, and fine-tune the built-in tiny Llama (its
# own BPE tokenizer and ChatML template) on the built-in alpaca demo set (240 instructions)
# with 2 worker processes on CPU; a progress bar on a terminal, one line per step otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo build --release --workspace
exec target/release/mt-launch --config configs/tiny.yaml --gpus 0 --workers 2 "$@"
