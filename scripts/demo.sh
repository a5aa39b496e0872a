#!/usr/bin/env bash
# Run the gateway on a built-in demo: simulated replicas in-process, no GPU, no config.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec cargo run --release --features demo --bin rolter -- --demo --listen "${ROLTER_DEMO_LISTEN:-127.0.0.1:8080}" "$@"
