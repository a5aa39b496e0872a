#!/usr/bin/env bash
# precise_cache_aware with ids from the x-rolter-vllm-token-ids header vs ids the gateway
# computes with the route's `tokenizer` (issue #23), against the simulator tokenizing with the
# same Hugging Face directory (`--tokenizer`), plus the no-ids baseline (fallback routing).
# Usage: loadtest/tokenizer-compare.sh [TOKENIZER_DIR]   (default: the Llama-3-style fixture)
set -euo pipefail
cd "$(dirname "$0")/.."
TOK="$(realpath "${1:-tests/fixtures/tokenizer/llama3}")"
cargo build --release -q -p rolter --bin rolter -p rolter-loadtest --bin rolter-load
COMMON=(compare --workload multi-turn --sessions 48 --turns 5 --cache-blocks 192 --replicas 4
  --clients 16 --max-running 4 --prefill-us-per-token 20 --decode-us-per-token 2000
  --think-time-ms 100 --gateway target/release/rolter --strategies precise_cache_aware
  --tokenizer "$TOK" --max-duration-secs 90)
OUT="${OUT:-/tmp/rolter-tokenizer-compare}"
mkdir -p "$OUT"
echo "### header ids" >&2
target/release/rolter-load "${COMMON[@]}" --route-option "tokenizer = \"$TOK\"" --out "$OUT/header.md" | grep "hit rate" || true
echo "### gateway-computed ids (--no-token-header, route tokenizer)" >&2
target/release/rolter-load "${COMMON[@]}" --route-option "tokenizer = \"$TOK\"" --no-token-header --out "$OUT/tokenizer.md" | grep "hit rate" || true
echo "### no ids (--no-token-header, no tokenizer)" >&2
target/release/rolter-load "${COMMON[@]}" --no-token-header --out "$OUT/none.md" | grep "hit rate" || true
