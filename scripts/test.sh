#!/usr/bin/env bash
# Every test: lints, the fixture step (PyTorch reference runs), then all Rust tests
# (unit, multi-process integration, numerics against the fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo fmt --all -- --check
python3 scripts/check_modules.py src
python3 scripts/check_architecture.py
cargo build --release --workspace --all-targets
cargo clippy --release --workspace --all-targets -- -D warnings

echo "test: generating golden fixtures with transformers + torch"
.venv/bin/python scripts/make_golden.py --out target/golden

echo "test: generating data fixtures with transformers' tokenizer and chat template"
.venv/bin/python scripts/make_data_fixtures.py --out target/data-fixtures

export MT_GOLDEN_DIR="$PWD/target/golden"
export MT_DATA_FIXTURES="$PWD/target/data-fixtures"
cargo test --release --workspace
