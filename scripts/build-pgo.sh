#!/usr/bin/env bash
# Profile-guided (PGO) release build of the gateway: target/pgo/rolter.
#
# 1. builds rolter instrumented (-Cprofile-generate) in target/pgo/gen;
# 2. trains it: the gateway in front of rolter-stub, cache_aware then round_robin, each
#    driven by wrk with loadtest/chat.lua: 4 and 32 KiB chat bodies, and 4 KiB streamed
#    (SSE) ones, then with loadtest/growth.lua: conversations growing to 128 and 512 KiB,
#    each request extending an earlier one (~55 s in all);
# 3. merges the profile (llvm-profdata from rustup's llvm-tools component, installed if
#    missing) and rebuilds with -Cprofile-use in target/pgo/use.
# The profile is made afresh on every run, so it always matches the source. Measured on the
# request path (loadtest/profile.sh, README "Proxy overhead"): ~11% fewer instructions and
# ~13% less user time per request than the plain release build. Takes two release builds (~12 min on
# 2 cores). Needs wrk (installed if missing, like loadtest/overhead.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=loadtest/stub-gateway.sh
. loadtest/stub-gateway.sh
OUT=$PWD/target/pgo
STUB_PORT=18981; GW_PORT=18982

if ! command -v wrk >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq wrk >/dev/null
fi
profdata() { find "$(rustc --print sysroot)" -name llvm-profdata -type f 2>/dev/null | head -1; }
if [ -z "$(profdata)" ]; then
  rustup component add llvm-tools-preview
fi
PROFDATA=$(profdata)
[ -n "$PROFDATA" ] || { echo "build-pgo: llvm-profdata not found after installing llvm-tools" >&2; exit 1; }

echo "build-pgo: instrumented build" >&2
cargo build --release -q --bin rolter-stub -p rolter-loadtest
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$OUT/profiles" CARGO_TARGET_DIR=$OUT/gen \
  cargo build --release -q --bin rolter -p rolter
# Build scripts of that build were instrumented too and wrote profiles: start clean.
rm -rf "$OUT/profiles"

W=$(mktemp -d /tmp/rolter-pgo.XXXXXX)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$W"' EXIT
target/release/rolter-stub --listen 127.0.0.1:$STUB_PORT --threads 1 >/dev/null & PIDS+=($!)
gateway_yaml "$W" > "$W/p.yaml"
for strategy in cache_aware round_robin; do
  stub_routes "$strategy" 2 $STUB_PORT > "$W/routes.toml"
  RUST_LOG=warn "$OUT/gen/release/rolter" -c "$W/p.yaml" --routes "$W/routes.toml" \
    --listen 127.0.0.1:$GW_PORT >/dev/null 2>"$W/gateway.log" &
  gw=$!; PIDS+=($gw)
  for _ in $(seq 100); do curl -sf 127.0.0.1:$GW_PORT/health >/dev/null && break; sleep 0.1; done
  for run in "4096 0 6 chat" "32768 0 6 chat" "4096 1 4 chat" "131072 0 5 growth" \
    "524288 0 5 growth"; do
    read -r size stream secs script <<<"$run"
    echo "build-pgo: training $strategy, $size-byte bodies ($script.lua), stream=$stream" >&2
    out=$(PACE_MS=0 STREAM=$stream BODY_BYTES=$size wrk -t1 -c64 -d"${secs}s" \
      -s "loadtest/$script.lua" "http://127.0.0.1:$GW_PORT" 2>&1)
    # Training on error answers would optimise the error path instead of the request path.
    if grep -q "Non-2xx" <<<"$out"; then echo "build-pgo: non-2xx answers: $out" >&2; exit 1; fi
  done
  # SIGINT: pingora exits, and the profile runtime writes its counters at exit.
  kill -INT "$gw"
  for _ in $(seq 100); do kill -0 "$gw" 2>/dev/null || break; sleep 0.1; done
done
ls "$OUT"/profiles/*.profraw >/dev/null 2>&1 || { echo "build-pgo: training wrote no profile" >&2; exit 1; }
"$PROFDATA" merge -o "$OUT/merged.profdata" "$OUT/profiles"
# Named by its content: cargo does not track the profile file, only RUSTFLAGS, so a new
# profile under the old name would leave every crate built with the previous one.
sum=$(sha256sum "$OUT/merged.profdata" | cut -c1-16)
rm -f "$OUT"/rolter-*.profdata
mv "$OUT/merged.profdata" "$OUT/rolter-$sum.profdata"

echo "build-pgo: optimised build" >&2
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$OUT/rolter-$sum.profdata" CARGO_TARGET_DIR=$OUT/use \
  cargo build --release -q --bin rolter -p rolter
cp "$OUT/use/release/rolter" "$OUT/rolter"
echo "build-pgo: $OUT/rolter" >&2
