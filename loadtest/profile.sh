#!/usr/bin/env bash
# Instructions per proxied request, by function, under callgrind (issue 10's
# profile-driven pass). Instruction counts are repeatable whatever else the machine is
# doing, unlike timings on a shared 2-core box.
#
# Runs the release gateway under `valgrind --tool=callgrind` in front of rolter-stub,
# warms up with 200 requests, zeroes the counters, sends REQUESTS (default 2000) 4 KiB
# chat requests (64 conversations sharing a system prompt, one keep-alive client),
# dumps, and prints Ir per request plus the top functions.
# Usage: loadtest/profile.sh [strategy]   (default cache_aware; ROLTER_BIN=path profiles
# another build of the gateway, e.g. a saved one for an A/B; BODY_KIB=32 sends 32 KiB bodies)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=loadtest/stub-gateway.sh
. loadtest/stub-gateway.sh
STRATEGY=${1:-cache_aware}
REQUESTS=${REQUESTS:-2000}
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }
cargo build --release -q --bin rolter -p rolter
cargo build --release -q --bin rolter-stub -p rolter-loadtest
W=$(mktemp -d /tmp/rolter-profile.XXXXXX)
trap 'pkill -f "listen 127.0.0.1:18962" 2>/dev/null || true; pkill -f "rolter-stub --listen 127.0.0.1:18961" 2>/dev/null || true; rm -rf "$W"' EXIT
target/release/rolter-stub --listen 127.0.0.1:18961 >/dev/null &
stub_routes "$STRATEGY" 2 18961 m > "$W/routes.toml"
gateway_yaml "$W" > "$W/p.yaml"
cat > "$W/drive.py" <<'PY'
import http.client, json, os, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
scale = int(os.environ.get("BODY_KIB", "4")) // 4
system = "You are a careful assistant. " * (70 * scale)
bodies = [json.dumps({"model": "bench", "messages": [{"role": "system", "content": system},
          {"role": "user", "content": ("question %d " % i) * (170 * scale)}]}) for i in range(64)]
c = http.client.HTTPConnection("127.0.0.1", port)
for i in range(n):
    c.request("POST", "/v1/chat/completions", bodies[i % 64], {"content-type": "application/json"})
    r = c.getresponse(); r.read()
    assert r.status == 200, r.status
PY
# Two runs, WARMUP and WARMUP + REQUESTS requests: the difference of their totals is the
# cost of REQUESTS requests without start-up; functions are listed from the longer run.
WARMUP=200
profile_run() { # requests -> writes $W/cg-$1.out
  RUST_LOG=${ROLTER_LOG:-warn} valgrind --tool=callgrind --callgrind-out-file="$W/cg-$1.out" \
    "${ROLTER_BIN:-target/release/rolter}" -c "$W/p.yaml" --routes "$W/routes.toml" --listen 127.0.0.1:18962 \
    2>"$W/gateway.log" >/dev/null &
  for _ in $(seq 120); do curl -sf 127.0.0.1:18962/health >/dev/null && break; sleep 0.5; done
  python3 "$W/drive.py" 18962 "$1"
  # SIGINT: pingora exits at once and callgrind writes its counts.
  pkill -INT -f "listen 127.0.0.1:18962"
  for _ in $(seq 60); do pgrep -f "listen 127.0.0.1:18962" >/dev/null || break; sleep 0.5; done
}
totals() { callgrind_annotate "$1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}'; }
profile_run $WARMUP
profile_run $((WARMUP + REQUESTS))
total=$(( $(totals "$W/cg-$((WARMUP + REQUESTS)).out") - $(totals "$W/cg-$WARMUP.out") ))
dump="$W/cg-$((WARMUP + REQUESTS)).out"
[ -n "${KEEP:-}" ] && cp "$dump" "$KEEP"
echo "strategy=$STRATEGY requests=$REQUESTS Ir/request=$((total / REQUESTS))"
callgrind_annotate "$dump" 2>/dev/null | grep -E "^ *[0-9,]+ \(" | sed -n 2,25p | cut -c1-150 | sed "s|/rustc/[0-9a-f]*/||; s|/root/.cargo/registry/src/[^/]*/||"
