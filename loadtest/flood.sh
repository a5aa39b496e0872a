#!/usr/bin/env bash
# Connection floods against the gateway (release build) in front of rolter-stub: what they
# cost it in memory and CPU, and what a normal client's latency does meanwhile.
#
#   loadtest/flood.sh                          # writes loadtest/reports/flood.md
#   FLOOD_REPORT=/tmp/f.md ROLTER_BIN=/tmp/old/rolter loadtest/flood.sh   # another build
#   FLOOD_BASELINE_BIN=/tmp/old/rolter FLOOD_BASELINE_LABEL="commit abc" loadtest/flood.sh
#                                              # this build, then another, in one report
#
# Knobs (environment): FLOOD_CONNECTIONS (7000 idle connections), FLOOD_SLOW (2000 slowloris
# connections, each holding a 1 KiB unfinished header), FLOOD_BIG (300 connections, each
# sending a 900 KB unfinished header, then a byte per 100 ms per connection for
# FLOOD_DRIBBLE_SECS = 10), FLOOD_REQUESTS (400 requests per latency sample), FLOOD_PORT_BASE
# (19500: gateway, stub +1), FLOOD_REPORT (loadtest/reports/flood.md), FLOOD_BUILD (1: build
# the release binaries first), ROLTER_BIN (the gateway binary to flood; default the release
# build), FLOOD_BASELINE_BIN (another build, e.g. of an earlier commit, flooded the same way
# afterwards; FLOOD_BASELINE_LABEL names it in the report). The gateway runs with its
# default [limits]; FLOOD_LIMITS adds lines to [limits] (an earlier build may refuse keys it
# does not know).
#
# Phases, in one gateway process: a normal client's latency alone (baseline); FLOOD_CONNECTIONS
# idle connections opened and held (RSS, open-connection gauge, the normal client's latency
# meanwhile); all closed (RSS 5 s and 20 s later, latency again); slowloris headers; big
# dribbled headers (gateway CPU seconds). RSS is VmRSS from /proc/PID/status, CPU is
# utime + stime from /proc/PID/stat. The normal client is one keep-alive connection sending
# 4 KiB chat requests one after another (loadtest/profile.sh's workload).
#
# loadtest/soak.sh floods its own gateway with loadtest/flood.py's `idle` mode as one of its
# fault steps; this script is the measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
# shellcheck source=loadtest/stub-gateway.sh
. loadtest/stub-gateway.sh

CONNS="${FLOOD_CONNECTIONS:-7000}"
SLOW="${FLOOD_SLOW:-2000}"
BIG="${FLOOD_BIG:-300}"
DRIBBLE="${FLOOD_DRIBBLE_SECS:-10}"
REQUESTS="${FLOOD_REQUESTS:-400}"
BASE="${FLOOD_PORT_BASE:-19500}"
REPORT="${FLOOD_REPORT:-$ROOT/loadtest/reports/flood.md}"
BUILD="${FLOOD_BUILD:-1}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
GW_BIN="${ROLTER_BIN:-$TARGET/release/rolter}"
STUB_BIN="$TARGET/release/rolter-stub"
GW_PORT=$BASE
STUB_PORT=$((BASE + 1))

if [ "$BUILD" = 1 ]; then
  cargo build --release -q -p rolter --bin rolter -p rolter-loadtest --bin rolter-stub
fi
for b in "$GW_BIN" "$STUB_BIN"; do
  [ -x "$b" ] || { echo "missing $b" >&2; exit 2; }
done
# Each flood connection is a descriptor here and one in the gateway.
NEED=$((CONNS + SLOW + BIG + 1000))
if [ "$(ulimit -n)" -lt "$NEED" ]; then
  ulimit -n "$NEED" 2>/dev/null || { echo "raise the file limit to $NEED (ulimit -n)" >&2; exit 2; }
fi

W=$(mktemp -d /tmp/rolter-flood.XXXXXX)
PIDS=()
cleanup() {
  set +e
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$W"
}
trap cleanup EXIT

"$STUB_BIN" --listen "127.0.0.1:$STUB_PORT" > /dev/null 2>&1 &
PIDS+=($!)
{ stub_routes round_robin 1 "$STUB_PORT"; printf '[limits]\n%b' "${FLOOD_LIMITS:-}"; } > "$W/routes.toml"
printf -- '---\nversion: 1\nthreads: 2\npid_file: %s/rolter.pid\nupgrade_sock: %s/upgrade.sock\ngrace_period_seconds: 1\ngraceful_shutdown_timeout_seconds: 1\n' "$W" "$W" > "$W/p.yaml"

flood() { # binary -> the phases' table on stdout, the gateway's error lines in $W/gateway.log
  RUST_LOG=error "$1" -c "$W/p.yaml" --routes "$W/routes.toml" --listen "127.0.0.1:$GW_PORT" \
    > /dev/null 2> "$W/gateway.log" &
  local gw=$!
  PIDS+=("$gw")
  for _ in $(seq 200); do curl -sf "127.0.0.1:$GW_PORT/health" > /dev/null && break; sleep 0.1; done
  curl -sf "127.0.0.1:$GW_PORT/health" > /dev/null || { echo "gateway did not start" >&2; cat "$W/gateway.log" >&2; exit 1; }
  python3 "$ROOT/loadtest/flood.py" measure --port "$GW_PORT" --pid "$gw" --idle "$CONNS" \
    --slow "$SLOW" --big "$BIG" --dribble-secs "$DRIBBLE" --requests "$REQUESTS"
  echo
  echo "Gateway log lines (error level): $(grep -c . "$W/gateway.log" || true)"
  kill "$gw"
  wait "$gw" 2>/dev/null || true
}

flood "$GW_BIN" > "$W/rows.md"
if [ -n "${FLOOD_BASELINE_BIN:-}" ]; then
  flood "$FLOOD_BASELINE_BIN" > "$W/baseline.md"
fi

{
  echo "# Connection floods"
  echo
  echo "Produced by \`loadtest/flood.sh\` on $(date -u +%Y-%m-%d), $(nproc) cores: the release gateway"
  echo "(\`$(basename "$GW_BIN")\`, 2 worker threads, default \`[limits]\`${FLOOD_LIMITS:+ plus \`$(printf '%b' "$FLOOD_LIMITS" | tr '\n' ' ')\`}) in front of"
  echo "\`rolter-stub\`. A normal client (one keep-alive connection, 4 KiB chat requests one after"
  echo "another, $REQUESTS per sample) is measured alone, then while each flood is held."
  echo
  cat "$W/rows.md"
  if [ -n "${FLOOD_BASELINE_BIN:-}" ]; then
    echo
    echo "## The same floods against ${FLOOD_BASELINE_LABEL:-\`$FLOOD_BASELINE_BIN\`}"
    echo
    cat "$W/baseline.md"
  fi
} > "$REPORT"
cat "$REPORT"
