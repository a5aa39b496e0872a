#!/usr/bin/env bash
# Soak test: SOAK_MINUTES of mixed workload through the gateway (release build) in front of
# simulated vLLM replicas, with faults injected, reporting lost requests, errors by kind,
# and the gateway's RSS and open file descriptors over time.
#
#   loadtest/soak.sh                       # 10 minutes, writes loadtest/reports/soak.md
#   SOAK_MINUTES=2 SOAK_REPORT=/tmp/s.md loadtest/soak.sh
#
# Knobs (environment): SOAK_MINUTES (10), SOAK_REPORT (loadtest/reports/soak.md),
# SOAK_PORT_BASE (19000: gateway +80, replica i HTTP +1+i, KV PUB +101+2i, replay +102+2i),
# SOAK_CLIENTS (2 closed-loop clients per driver), SOAK_SAMPLE_SECS (10), SOAK_BUILD (1: run
# `cargo build --release` first; 0 uses the binaries already in $CARGO_TARGET_DIR/release),
# SOAK_FAULT_EVERY (30 s between faults), SOAK_FAULTS (which steps of the cycle below to
# inject, in order, e.g. "7" for KV stalls only; default all: "0 1 2 3 4 5 6 7 8 9 10"),
# SOAK_FLOOD_CONNECTIONS (7000 idle connections in the connection-flood step).
#
# What runs: four single-replica `rolter-sim` processes (one process per replica, so a
# replica can really be killed and restarted), the gateway with four routes over them
# (cache_aware, precise_cache_aware with KV events + replay, lmcache_aware, pipeline), and
# four `rolter-load run` drivers in a loop, one per route (multi-turn, few-shot, unique,
# multi-turn with sessions). Every FAULT_EVERY seconds the next fault of a fixed cycle is
# injected: replica SIGKILL + restart, KV-event gap (dropped batch), corrupt KV batch, KV
# sequence restart, KV stall (stale stream), LMCache status 500s, replica health failing,
# SIGHUP reload of a changed routing file, SIGHUP with an invalid file (must be refused),
# a connection flood (SOAK_FLOOD_CONNECTIONS idle connections held 10 s, loadtest/flood.py;
# loadtest/flood.sh measures floods on their own).
#
# "Lost" requests are client-side failures. The only ones expected are those in flight on a
# replica when it was killed (the gateway answers them 502 `upstream_broken`; they cannot be
# retried because the replica may already have acted on them). The report says how many
# failures that does not explain. RSS and fd counts are sampled from /proc/PID.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

MINUTES="${SOAK_MINUTES:-10}"
REPORT="${SOAK_REPORT:-$ROOT/loadtest/reports/soak.md}"
BASE="${SOAK_PORT_BASE:-19000}"
CLIENTS="${SOAK_CLIENTS:-2}"
SAMPLE_SECS="${SOAK_SAMPLE_SECS:-10}"
BUILD="${SOAK_BUILD:-1}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
BIN="$TARGET/release"
REPLICAS=4
FAULT_EVERY="${SOAK_FAULT_EVERY:-30}"
read -r -a FAULTS <<< "${SOAK_FAULTS:-0 1 2 3 4 5 6 7 8 9 10}"
FLOOD_CONNECTIONS="${SOAK_FLOOD_CONNECTIONS:-7000}"
KILL_DOWN_SECS=10
GW_PORT=$((BASE + 80))
GW="http://127.0.0.1:$GW_PORT"

if [ "$BUILD" = 1 ]; then
  cargo build --release -q -p rolter --bin rolter -p rolter-loadtest --bin rolter-sim --bin rolter-load --bin zmq-frame-bomb
fi
for b in rolter rolter-sim rolter-load; do
  [ -x "$BIN/$b" ] || { echo "missing $BIN/$b (build with cargo build --release --workspace)" >&2; exit 2; }
done

# The flood's connections are descriptors here and in the gateway.
if [ "$(ulimit -n)" -lt $((FLOOD_CONNECTIONS + 2000)) ]; then
  ulimit -n $((FLOOD_CONNECTIONS + 2000)) 2>/dev/null || { echo "raise the file limit (ulimit -n) or lower SOAK_FLOOD_CONNECTIONS" >&2; exit 2; }
fi
WORK=$(mktemp -d /tmp/rolter-soak.XXXXXX)
# Private copies: a rebuild in the shared target directory must not swap binaries mid-soak.
mkdir -p "$WORK/bin"
cp "$BIN/rolter" "$BIN/rolter-sim" "$BIN/rolter-load" "$BIN/zmq-frame-bomb" "$WORK/bin/"
BIN="$WORK/bin"
mkdir -p "$(dirname "$REPORT")"
SIM_PIDS=()
DRIVER_PIDS=()
GW_PID=""
cleanup() {
  set +e
  for p in "${DRIVER_PIDS[@]}"; do kill "$p" 2>/dev/null; done
  [ -n "$GW_PID" ] && kill "$GW_PID" 2>/dev/null
  for p in "${SIM_PIDS[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
}
trap cleanup EXIT

port_busy() { ss -ltn "sport = :$1" | grep -q LISTEN; }
for p in $GW_PORT $BOMB_PORT $(seq $((BASE + 1)) $((BASE + REPLICAS))) $(seq $((BASE + 101)) $((BASE + 100 + 2 * REPLICAS))); do
  if port_busy "$p"; then echo "port $p is in use; set SOAK_PORT_BASE" >&2; exit 2; fi
done

http_port() { echo $((BASE + 1 + $1)); }
BOMB_PORT=$((BASE + 199))
kv_port() { echo $((BASE + 101 + 2 * $1)); }

start_replica() { # index
  local i=$1
  "$BIN/rolter-sim" --replicas 1 --base-port "$(http_port "$i")" --kv-base-port "$(kv_port "$i")" \
    --max-running 4 --prefill-us-per-token 20 --decode-us-per-token 2000 --cache-blocks 512 \
    --default-max-tokens 32 > "$WORK/sim-$i.out" 2> "$WORK/sim-$i.err" &
  SIM_PIDS[$i]=$!
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$(http_port "$i")/health" > /dev/null && return 0
    sleep 0.1
  done
  echo "replica $i did not start" >&2
  return 1
}

routes() { # weight of p0 (changing it makes a SIGHUP reload a real change)
  local w0=$1 i
  for i in $(seq 0 $((REPLICAS - 1))); do
    cat <<EOF
[[providers]]
name = "r$i"
kind = "openai_compatible"
api_base = "http://127.0.0.1:$(http_port "$i")"
[providers.health]
interval_ms = 1000
timeout_ms = 500
[providers.kv_events]
endpoint = "tcp://127.0.0.1:$(kv_port "$i")"
replay_endpoint = "tcp://127.0.0.1:$(($(kv_port "$i") + 1))"
staleness_ms = 5000
max_blocks = 4096
[providers.lmcache]
endpoint = "http://127.0.0.1:$(http_port "$i")/cache/status"

EOF
  done
  # A provider no route uses, whose KV-event endpoint is the frame-bomb step's hostile
  # publisher: the gateway dials it (and is refused) until that step listens there.
  cat <<EOF
[[providers]]
name = "bomb"
kind = "openai_compatible"
api_base = "http://127.0.0.1:$(http_port 0)"
[providers.kv_events]
endpoint = "tcp://127.0.0.1:$BOMB_PORT"

EOF
  for spec in "mt cache_aware" "fs precise_cache_aware" "uq lmcache_aware" "pl pipeline"; do
    set -- $spec
    printf '[[routes]]\nmodel = "%s"\nstrategy = "%s"\ntrie_max_nodes = 3000\n' "$1" "$2"
    for i in $(seq 0 $((REPLICAS - 1))); do
      local w=1
      [ "$i" = 0 ] && w=$w0
      printf '[[routes.targets]]\nprovider = "r%s"\nmodel = "sim-model"\nweight = %s\n' "$i" "$w"
    done
    echo
  done
  printf '[limits]\nclient_body_timeout_ms = 10000\nread_timeout_ms = 30000\n'
}

for i in $(seq 0 $((REPLICAS - 1))); do start_replica "$i"; done
routes 1 > "$WORK/routes.toml"
cat > "$WORK/pingora.yaml" <<EOF
---
version: 1
threads: 2
pid_file: $WORK/rolter.pid
upgrade_sock: $WORK/upgrade.sock
grace_period_seconds: 1
graceful_shutdown_timeout_seconds: 1
EOF
RUST_LOG=warn "$BIN/rolter" -c "$WORK/pingora.yaml" --routes "$WORK/routes.toml" \
  --listen "127.0.0.1:$GW_PORT" > "$WORK/gateway.out" 2> "$WORK/gateway.log" &
GW_PID=$!
for _ in $(seq 200); do curl -sf "$GW/health" > /dev/null && break; sleep 0.1; done
curl -sf "$GW/health" > /dev/null || { echo "gateway did not start" >&2; exit 1; }

START=$(date +%s)
END=$((START + MINUTES * 60))
now() { echo $(($(date +%s) - START)); }

# One driver: rounds of `rolter-load run` until the end time; one result line per round:
# "<planned requests> <client-side errors>".
driver() { # name alias workload-args...
  local name=$1 alias=$2 round=0
  shift 2
  while [ "$(date +%s)" -lt "$END" ]; do
    round=$((round + 1))
    local out
    out=$("$BIN/rolter-load" run --target "$GW" --request-model "$alias" --clients "$CLIENTS" \
      --seed "$round" --request-timeout-secs 60 --max-duration-secs 600 --label "$name" "$@" 2>>"$WORK/driver-$name.err") || true
    local planned errors
    planned=$(echo "$out" | grep -oE '(→ [0-9]+ requests|^[a-z -]+: [0-9]+ requests)' | grep -oE '[0-9]+' | head -1)
    errors=$(echo "$out" | grep -E "^\| $name " | awk -F'|' '{gsub(/ /,"",$10); print $10}')
    echo "${planned:-0} ${errors:-0}" >> "$WORK/driver-$name.rounds"
  done
}
driver mt mt --workload multi-turn --sessions 12 --turns 4 --prefixes 4 --prefix-tokens 1000 & DRIVER_PIDS+=($!)
driver fs fs --workload few-shot --requests 40 --prefixes 6 --prefix-tokens 800 & DRIVER_PIDS+=($!)
driver uq uq --workload unique --requests 40 --user-tokens 300 & DRIVER_PIDS+=($!)
driver pl pl --workload multi-turn --sessions 10 --turns 5 --prefixes 2 --prefix-tokens 600 & DRIVER_PIDS+=($!)

metric_sum() { # metric name regex over a saved scrape
  awk -v re="$1" '$0 !~ /^#/ && $1 ~ re { s += $NF } END { printf "%d", s }' "$2"
}
fault() { echo "| $(now) | $* |" >> "$WORK/faults.md"; }
sim_fault() { curl -sf -X POST "http://127.0.0.1:$(http_port "$1")/sim/fault/$2/$3" > /dev/null || echo "fault $2/$3 on r$1 failed" >&2; }

echo "| t (s) | RSS MiB | peak RSS MiB | open fds | threads | client connections | admitted | trie nodes | KV index blocks | requests answered |" > "$WORK/samples.md"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" >> "$WORK/samples.md"
: > "$WORK/samples.tsv"
sample() {
  local rss hwm fds threads
  rss=$(awk '/^VmRSS/ {print $2}' "/proc/$GW_PID/status")
  hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$GW_PID/status")
  threads=$(awk '/^Threads/ {print $2}' "/proc/$GW_PID/status")
  fds=$(ls "/proc/$GW_PID/fd" | wc -l)
  curl -sf "$GW/metrics" > "$WORK/scrape.txt" || : > "$WORK/scrape.txt"
  local admitted trie blocks answered conns
  conns=$(metric_sum '^rolter_client_connections$' "$WORK/scrape.txt")
  admitted=$(metric_sum '^rolter_admitted_requests$' "$WORK/scrape.txt")
  trie=$(metric_sum '^rolter_trie_nodes' "$WORK/scrape.txt")
  blocks=$(metric_sum '^rolter_kv_index_blocks' "$WORK/scrape.txt")
  answered=$(metric_sum '^rolter_requests_total[{]route="(mt|fs|uq|pl)"' "$WORK/scrape.txt")
  local t
  t=$(now)
  printf '%s\t%s\t%s\t%s\n' "$t" "$rss" "$fds" "$trie" >> "$WORK/samples.tsv"
  awk -v t="$t" -v r="$rss" -v h="$hwm" -v f="$fds" -v th="$threads" -v c="$conns" -v a="$admitted" -v n="$trie" \
    -v b="$blocks" -v q="$answered" 'BEGIN { printf "| %s | %.1f | %.1f | %s | %s | %s | %s | %s | %s | %s |\n", t, r / 1024, h / 1024, f, th, c, a, n, b, q }' \
    >> "$WORK/samples.md"
}

# The fault cycle; one step every FAULT_EVERY seconds, sampling in between.
echo "| t (s) | fault |" > "$WORK/faults.md"
echo "|---:|---|" >> "$WORK/faults.md"
KILLS=()
step=0
next_fault=$((START + 20))
next_sample=$START
while [ "$(date +%s)" -lt "$END" ]; do
  kill -0 "$GW_PID" 2>/dev/null || { echo "gateway died" >&2; break; }
  if [ "$(date +%s)" -ge "$next_sample" ]; then
    sample
    next_sample=$((next_sample + SAMPLE_SECS))
  fi
  if [ "$(date +%s)" -ge "$next_fault" ]; then
    case "${FAULTS[$((step % ${#FAULTS[@]}))]}" in
      0) fault "SIGKILL replica r1 (restart in ${KILL_DOWN_SECS} s)"
         kill -9 "${SIM_PIDS[1]}"; wait "${SIM_PIDS[1]}" 2>/dev/null || true
         KILLS+=("$(now)")
         ( sleep "$KILL_DOWN_SECS"; start_replica 1; echo "${SIM_PIDS[1]}" > "$WORK/r1.pid" ) &
         ;;
      1) fault "KV-event gap on r0 (one batch dropped; replay repairs)"; sim_fault 0 kv drop ;;
      2) fault "LMCache status 500s on r2 for 20 s"; sim_fault 2 lmcache error
         ( sleep 20; sim_fault 2 lmcache none ) & ;;
      3) fault "SIGHUP reload (routes changed: r0 weight 2)"; routes 2 > "$WORK/routes.toml"; kill -HUP "$GW_PID" ;;
      4) fault "corrupt KV batch on r3"; sim_fault 3 kv corrupt ;;
      5) fault "r2 health checks fail for 10 s"; sim_fault 2 http unhealthy
         ( sleep 10; sim_fault 2 http none ) & ;;
      6) fault "KV sequence restart on r0 (replica restart without process exit)"; sim_fault 0 kv restart ;;
      7) fault "KV stream stalled on r3 for 15 s (stale)"; sim_fault 3 kv stall
         ( sleep 15; sim_fault 3 kv resume ) & ;;
      8) fault "SIGHUP with an invalid routing file (must be refused), then the good one back"
         echo 'this is = not [valid' > "$WORK/routes.toml"; kill -HUP "$GW_PID"; sleep 2
         routes 1 > "$WORK/routes.toml"; kill -HUP "$GW_PID" ;;
      10) fault "ZMQ frame bomb: a KV-event publisher the gateway dials declares a 2^50-byte frame (3 times)"
         ( "$BIN/zmq-frame-bomb" --listen "127.0.0.1:$BOMB_PORT" --count 3 --wait-ms 20000 \
             --health "http://127.0.0.1:$GW_PORT/health" >> "$WORK/bombs.txt" 2>&1 ) & ;;
      9) fault "connection flood: $FLOOD_CONNECTIONS idle connections held 10 s"
         ( python3 "$ROOT/loadtest/flood.py" idle --port "$GW_PORT" --connections "$FLOOD_CONNECTIONS" \
             --hold-secs 10 >> "$WORK/floods.txt" 2>&1 ) & ;;
    esac
    step=$((step + 1))
    next_fault=$((next_fault + FAULT_EVERY))
  fi
  # The restarted r1's pid (written by the background restart) replaces the killed one.
  if [ -f "$WORK/r1.pid" ]; then SIM_PIDS[1]=$(cat "$WORK/r1.pid"); rm -f "$WORK/r1.pid"; fi
  sleep 1
done

echo "load stopping; waiting for the drivers' last rounds" >&2
for p in "${DRIVER_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
DRIVER_PIDS=()
sleep 2
sample
ALIVE=yes
kill -0 "$GW_PID" 2>/dev/null || ALIVE=no
# Idle RSS, then again after glibc returns free heap pages to the OS (malloc_trim(0) via
# gdb): what the second number drops by was freed memory the allocator kept, not live data.
rss_mib() { awk '/^VmRSS/ { printf "%.1f", $2 / 1024 }' "/proc/$GW_PID/status"; }
TRIM="not measured (gdb not installed)"
if [ "$ALIVE" = yes ] && command -v gdb > /dev/null; then
  idle=$(rss_mib)
  if timeout 60 gdb -p "$GW_PID" -batch -ex 'call (int)malloc_trim(0)' > /dev/null 2>&1; then
    TRIM="$idle → $(rss_mib) MiB"
  else
    TRIM="$idle MiB (gdb could not attach)"
  fi
fi
curl -sf "$GW/metrics" > "$WORK/final.txt" || : > "$WORK/final.txt"

# ---- report ----
planned=0; failed=0; rounds=0
for d in mt fs uq pl; do
  while read -r p e; do planned=$((planned + p)); failed=$((failed + e)); rounds=$((rounds + 1)); done < "$WORK/driver-$d.rounds"
done
broken=$(metric_sum '^rolter_request_errors_total[{]kind="upstream_broken"[}]' "$WORK/final.txt")
unexplained=$((failed - broken))
[ "$unexplained" -lt 0 ] && unexplained=0
reloads_ok=$(metric_sum '^rolter_config_reloads_total[{]result="ok"[}]' "$WORK/final.txt")
reloads_failed=$(metric_sum '^rolter_config_reloads_total[{]result="failed"[}]' "$WORK/final.txt")

# Flatness after warm-up (the first third of the run): RSS growth from the first sample past
# warm-up to the last, and the fd range.
WARM=$((MINUTES * 60 / 3))
read -r rss_warm rss_last rss_max fd_min fd_max < <(awk -v w="$WARM" -F'\t' '
  $1 >= w { if (!seen) { first = $2; fmin = $3; fmax = $3; seen = 1 }
            last = $2; if ($2 > max) max = $2; if ($3 < fmin) fmin = $3; if ($3 > fmax) fmax = $3 }
  END { printf "%d %d %d %d %d\n", first, last, max, fmin, fmax }' "$WORK/samples.tsv")

{
  echo "# Soak: ${MINUTES} minutes of mixed load with faults"
  echo
  echo "Produced by \`SOAK_MINUTES=$MINUTES SOAK_FAULTS=\"${FAULTS[*]}\" loadtest/soak.sh\` (release build) on $(date -u +%Y-%m-%d), $(nproc) cores."
  echo "Gateway: \`rolter\` (2 worker threads) in front of $REPLICAS \`rolter-sim\` processes (one replica each:"
  echo "at most 4 running requests, 512-block cache, 20 µs/uncached prompt token, 2 ms/output token, 32 output"
  echo "tokens), routes \`mt\` cache_aware, \`fs\` precise_cache_aware (KV events + replay), \`uq\` lmcache_aware,"
  echo "\`pl\` pipeline; \`trie_max_nodes = 3000\` per target, \`max_blocks = 4096\` per KV index. Four"
  echo "\`rolter-load run\` drivers ($CLIENTS closed-loop streaming clients each) loop over seeded rounds:"
  echo "multi-turn (12 sessions × 4 turns, 1,000-token system prompts), few-shot (40 requests, 800-token"
  echo "templates), unique (40 × 300 tokens), multi-turn with \`x-session-id\` (10 × 5)."
  echo
  echo "## Result"
  echo
  echo "| | |"
  echo "|---|---:|"
  echo "| driver rounds | $rounds |"
  echo "| requests sent | $planned |"
  echo "| client-side failures (lost) | $failed |"
  echo "| of which in flight on a killed replica (\`upstream_broken\`) | $broken |"
  echo "| lost and not explained by a replica kill | **$unexplained** |"
  echo "| replica kills | ${#KILLS[@]} (at t = ${KILLS[*]:-–} s) |"
  echo "| SIGHUP reloads ok / refused | $reloads_ok / $reloads_failed |"
  echo "| gateway alive at the end | $ALIVE |"
  echo "| connection floods (opened, closed by the gateway) | $(paste -sd ';' "$WORK/floods.txt" 2>/dev/null || echo none) |"
  echo "| ZMQ frame bombs (summary line of each zmq-frame-bomb run) | $(grep -h exchanges "$WORK/bombs.txt" 2>/dev/null | paste -sd ';' || echo none) |"
  echo "| KV-event protocol errors counted (\`rolter_kv_stream_total{kind=\"protocol_errors\"}\`) | $(metric_sum '^rolter_kv_stream_total.*protocol_errors' "$WORK/final.txt") |"
  echo "| client connections refused at accept (\`rolter_client_connections_refused_total\`) | $(metric_sum '^rolter_client_connections_refused_total$' "$WORK/final.txt") |"
  echo "| RSS after warm-up (t ≥ ${WARM} s): first / last / max | $((rss_warm / 1024)) / $((rss_last / 1024)) / $((rss_max / 1024)) MiB |"
  echo "| open fds after warm-up: min / max | $fd_min / $fd_max |"
  echo "| idle RSS at the end, before → after \`malloc_trim(0)\` | $TRIM |"
  echo
  echo "## Gateway errors by kind (\`rolter_request_errors_total\`)"
  echo
  echo "| kind | count |"
  echo "|---|---:|"
  grep -E '^rolter_request_errors_total[{]' "$WORK/final.txt" | sed -E 's/^.*kind="([^"]+)"[}] ([0-9.e+]+)$/| \1 | \2 |/' || echo "| (none) | 0 |"
  echo
  echo "## Responses by route and status (\`rolter_requests_total\`)"
  echo
  echo "| route | status | count |"
  echo "|---|---|---:|"
  grep -E '^rolter_requests_total[{]route="(mt|fs|uq|pl)"' "$WORK/final.txt" | awk '{
      match($0, /route="[^"]*"/); r = substr($0, RSTART + 7, RLENGTH - 8)
      match($0, /status="[^"]*"/); s = substr($0, RSTART + 8, RLENGTH - 9)
      c[r " | " s] += $NF } END { for (k in c) print "| " k " | " c[k] " |" }' | sort
  echo
  echo "## KV-event streams (\`rolter_kv_stream_total\`, all providers)"
  echo
  echo "| kind | count |"
  echo "|---|---:|"
  grep -E '^rolter_kv_stream_total[{]' "$WORK/final.txt" | awk '{ match($0, /kind="[^"]*"/); k = substr($0, RSTART + 6, RLENGTH - 7); c[k] += $NF }
      END { for (k in c) print "| " k " | " c[k] " |" }' | sort
  echo
  echo "## Faults injected"
  echo
  cat "$WORK/faults.md"
  echo
  echo "## Gateway resources over time"
  echo
  echo "RSS and peak RSS from /proc/PID/status (VmRSS, VmHWM), open fds = entries of /proc/PID/fd,"
  echo "client connections = \`rolter_client_connections\`, admitted = \`rolter_admitted_requests\`; trie nodes and KV index"
  echo "blocks summed over targets."
  echo
  cat "$WORK/samples.md"
  echo
  echo "## Gateway log"
  echo
  echo "$(grep -c . "$WORK/gateway.log" || true) lines at warn level and above; by message (first 60 characters):"
  echo
  echo '```'
  sed -E 's/^\[[^]]*\] *//; s/[0-9]+/N/g' "$WORK/gateway.log" | cut -c1-60 | sort | uniq -c | sort -rn | head -15
  echo '```'
} > "$REPORT"
echo "report: $REPORT (work dir $WORK)" >&2
