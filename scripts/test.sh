#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up, format and lint gates, every Rust test
# in the workspace, then the Python interop tests against vLLM's wire format.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

cargo fmt --all --check
cargo clippy --workspace --all-targets --all-features -- -D warnings
# `--all-features`: the demo tests (tests/demo.rs, tests/stop.rs) need `rolter --demo`.
cargo test --workspace --all-features

if [ -d tests/python ]; then
  cargo build -q -p rolter-loadtest --bins
  # The gateway the SDK interop test (tests/python/test_sdk_interop.py) drives; the test
  # run above built it with the same features, so this is normally a no-op.
  cargo build -q --all-features --bin rolter
  export ROLTER_SIM_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/rolter-sim"
  export ROLTER_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/rolter"
  python3 -m unittest discover -s tests/python -v
fi
