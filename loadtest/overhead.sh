#!/usr/bin/env bash
# Proxy overhead, side by side in one run on this machine (issue 10):
#   (a) client -> upstream directly
#   (b) client -> nginx (Debian's package, proxy_pass with upstream keepalive) -> upstream
#   (c) client -> rolter round_robin -> upstream
#   (d) client -> rolter cache_aware -> upstream
#   (e) client -> rolter precise_cache_aware with a route tokenizer -> upstream (no KV
#       events: the decision falls back, but every request is rendered and tokenized as
#       the gateway does for a client that sends no token ids; issue 23)
# for 4 KiB and 32 KiB chat bodies at 64 connections, with the same load generator (wrk)
# (then 128 KiB and 512 KiB conversations that grow turn by turn, loadtest/growth.lua)
# and the same fast upstream (rolter-stub). Reports requests/s, p50/p99 latency, CPU
# seconds per 10k requests of the proxy process(es), upstream connection reuse, and the
# ratios c/b and d/b, into loadtest/reports/overhead.md. Then drives 1M requests of
# distinct prompts through cache_aware over 8 targets and reports the gateway's RSS.
#
# Fairness: nginx gets worker_processes 1 and rolter threads: 1 (one core each), wrk
# one thread; the upstream stub one thread. The machine has 2 cores, so all of them
# compete; medians of REPEATS runs are reported, and every variant runs interleaved.
#
# At saturation (closed loop, every connection sends its next request as soon as the last
# answer arrives) latency is queueing: 64 connections / throughput (Little's law), so the
# "p99 added" there mostly restates a throughput difference. The latency a proxy adds is
# also measured at a fixed offered load well below every path's capacity: each connection
# waits a random 0..2*PACE_MS ms (default PACE_MS 10) after an answer before its next
# request (wrk's delay()), ~6k req/s over 64 connections, the same for every path.
#
# Knobs: DURATION (s per run, default 8), REPEATS (default 3), CONNS (default 64),
# PGO (set: measure the profile-guided build of scripts/build-pgo.sh instead of the plain
# release build), ROLTER_BIN (a gateway binary to measure instead of building one: two
# builds compared by alternating runs, each copied out of the target directory first),
# RSS_REQUESTS (default 1000000; 0 skips the RSS step), ROLTER_LOG (RUST_LOG of the
# gateways, default "warn": no per-request access line, like nginx's access_log off;
# "info" measures with rolter's access log on), TOKENIZER (the Hugging Face tokenizer
# directory of path (e), default the Llama-3-style fixture tests/fixtures/tokenizer/llama3;
# empty skips (e)), GROWTH_SIZES (body sizes of the growing-conversation runs, default
# "131072 524288"; empty skips them).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=loadtest/stub-gateway.sh
. loadtest/stub-gateway.sh
DURATION=${DURATION:-8}
REPEATS=${REPEATS:-3}
CONNS=${CONNS:-64}
RSS_REQUESTS=${RSS_REQUESTS:-1000000}
ROLTER_LOG=${ROLTER_LOG:-warn}
OUT=${OUT:-loadtest/reports/overhead.md}
PACE_MS=${PACE_MS:-10}
TOKENIZER=${TOKENIZER-$PWD/tests/fixtures/tokenizer/llama3}
GROWTH_SIZES=${GROWTH_SIZES-131072 524288}

need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v wrk >/dev/null 2>&1 || need+=(wrk)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
scripts/setup.sh
cargo build --release -q --bin rolter-stub -p rolter-loadtest
if [ -n "${ROLTER_BIN:-}" ]; then
  [ -x "$ROLTER_BIN" ] || { echo "overhead: ROLTER_BIN $ROLTER_BIN is not an executable" >&2; exit 1; }
  ROLTER_BUILT=$ROLTER_BIN; BUILD_NOTE="given binary $ROLTER_BIN,"
elif [ -n "${PGO:-}" ]; then
  scripts/build-pgo.sh
  ROLTER_BUILT=target/pgo/rolter; BUILD_NOTE="release + PGO, scripts/build-pgo.sh,"
else
  cargo build --release -q --bin rolter -p rolter
  ROLTER_BUILT=target/release/rolter; BUILD_NOTE="release"
fi
WORK=$(mktemp -d /tmp/rolter-overhead.XXXXXX)
# Private copies: a shared target directory may be rebuilt by someone else mid-run.
BIN=$WORK/bin
mkdir -p "$BIN" && cp "$ROLTER_BUILT" "$BIN/rolter" && cp target/release/rolter-stub "$BIN/"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

STUB_PORT=18901; NGINX_PORT=18902; RR_PORT=18903; CA_PORT=18904; RSS_PORT=18905; PT_PORT=18906
"$BIN/rolter-stub" --listen 127.0.0.1:$STUB_PORT --threads 1 >/dev/null & PIDS+=($!)

cat > "$WORK/nginx.conf" <<NGINX
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx-error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_buffer_size 1m;
  client_max_body_size 4m;
  client_body_temp_path $WORK/body;
  proxy_temp_path $WORK/proxy;
  upstream stub { server 127.0.0.1:$STUB_PORT; keepalive 128; }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    location / {
      proxy_pass http://stub;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering on;
    }
  }
}
NGINX
"$NGINX" -c "$WORK/nginx.conf" -p "$WORK"

gateway_yaml "$WORK" > "$WORK/pingora.yaml"
start_rolter() { # port, strategy, targets [tokenizer dir] -> pid in ROLTER_PID
  stub_routes "$2" "$3" $STUB_PORT > "$WORK/routes-$1.toml"
  if [ -n "${4:-}" ]; then
    sed -i "s|^strategy = \"$2\"\$|&\ntokenizer = \"$4\"|" "$WORK/routes-$1.toml"
  fi
  RUST_LOG=$ROLTER_LOG "$BIN/rolter" -c "$WORK/pingora.yaml" --routes "$WORK/routes-$1.toml" --listen 127.0.0.1:$1 \
    2>"$WORK/rolter-$1.log" >/dev/null &
  ROLTER_PID=$!; PIDS+=($ROLTER_PID)
  for _ in $(seq 100); do curl -sf "127.0.0.1:$1/health" >/dev/null && return; sleep 0.1; done
  echo "rolter on $1 did not start" >&2; exit 1
}
start_rolter $RR_PORT round_robin 2; RR_PID=$ROLTER_PID
start_rolter $CA_PORT cache_aware 2; CA_PID=$ROLTER_PID
LABELS="direct nginx rolter-rr rolter-ca"
if [ -n "$TOKENIZER" ]; then
  start_rolter $PT_PORT precise_cache_aware 2 "$TOKENIZER"; PT_PID=$ROLTER_PID
  LABELS+=" rolter-pt"
fi
NGINX_MASTER=$(cat "$WORK/nginx.pid")
NGINX_PIDS="$NGINX_MASTER $(pgrep -P "$NGINX_MASTER" | tr '\n' ' ')"

# wrk script: bodies of BODY_BYTES bytes, 64 conversations sharing a system prompt.
cp loadtest/chat.lua "$WORK/post.lua"
cp loadtest/growth.lua "$WORK/growth.lua"

cpu_ticks() { # "utime stime" summed over pids
  local u=0 s=0 p
  for p in "$@"; do
    [ -r "/proc/$p/stat" ] || continue
    read -r pu ps < <(awk '{print $14, $15}' "/proc/$p/stat")
    u=$((u + pu)); s=$((s + ps))
  done
  echo "$u $s"
}
HZ=$(getconf CLK_TCK)
declare -A RPS P50 P99 CPU USR
run() { # label port size pace pids...   (pace: think time in ms per connection, 0 = closed loop;
  #                                       size gN: growing conversations of about N bytes)
  local label=$1 port=$2 size=$3 pace=$4; shift 4
  local before after out rps p50 p99 reqs u0 s0 u1 s1 script=post.lua bytes
  if [ "$pace" -gt 0 ]; then size="${size}p"; fi
  bytes=${size%p}
  if [ "${bytes#g}" != "$bytes" ]; then script=growth.lua; bytes=${bytes#g}; fi
  read -r u0 s0 < <(cpu_ticks "$@")
  out=$(PACE_MS=$pace BODY_BYTES=$bytes wrk -t1 -c"$CONNS" -d"${DURATION}s" --latency -s "$WORK/$script" "http://127.0.0.1:$port" 2>&1)
  read -r u1 s1 < <(cpu_ticks "$@")
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  p50=$(echo "$out" | awk '$1=="50%" {print $2}')
  p99=$(echo "$out" | awk '$1=="99%" {print $2}')
  if grep -q "Non-2xx" <<<"$out"; then echo "$label: non-2xx answers: $out" >&2; exit 1; fi
  # A missing figure would shift every later repeat's pairing in the report.
  if [ -z "$rps" ] || [ -z "$reqs" ] || [ -z "$p99" ]; then echo "$label: no result: $out" >&2; exit 1; fi
  local cpu="-" usr="-"
  if [ $# -gt 0 ]; then
    cpu=$(awk -v d=$((u1 + s1 - u0 - s0)) -v hz="$HZ" -v n="$reqs" 'BEGIN {printf "%.3f", d / hz / n * 10000}')
    usr=$(awk -v d=$((u1 - u0)) -v hz="$HZ" -v n="$reqs" 'BEGIN {printf "%.3f", d / hz / n * 10000}')
  fi
  RPS["$label/$size"]+="$rps "; P50["$label/$size"]+="$p50 "; P99["$label/$size"]+="$p99 "; CPU["$label/$size"]+="$cpu "
  USR["$label/$size"]+="$usr "
  echo "  $label size=$size: $rps req/s p50=$p50 p99=$p99 cpu/10k=$cpu" >&2
}
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
# Median over repeats of B/A from the same repeat (runs a minute apart at most): a shared
# machine drifts between phases over minutes, and a ratio of two medians can pair a quiet
# run of one path with a busy run of the other.
paired() { # "a1 a2 ..." "b1 b2 ..." -> median of b_i / a_i
  paste <(echo "$1" | tr ' ' '\n' | grep -v '^$') <(echo "$2" | tr ' ' '\n' | grep -v '^$') |
    awk '{printf "%.4f ", $2 / $1}' | median
}
to_ms() { # wrk latency like 1.23ms / 850.00us / 1.2s
  awk '{v=$1; if (v ~ /us$/) {sub(/us$/,"",v); v/=1000} else if (v ~ /ms$/) {sub(/ms$/,"",v)} else if (v ~ /s$/) {sub(/s$/,"",v); v*=1000}; printf "%.3f", v}'
}

SIZES="4096 32768"
echo "warming up" >&2
for port in $STUB_PORT $NGINX_PORT $RR_PORT $CA_PORT ${TOKENIZER:+$PT_PORT}; do
  PACE_MS=0 BODY_BYTES=4096 wrk -t1 -c"$CONNS" -d2s -s "$WORK/post.lua" "http://127.0.0.1:$port" >/dev/null
done
for r in $(seq "$REPEATS"); do
  echo "repeat $r/$REPEATS" >&2
  for size in $SIZES; do
    run direct $STUB_PORT "$size" 0
    # shellcheck disable=SC2086
    run nginx $NGINX_PORT "$size" 0 $NGINX_PIDS
    run rolter-rr $RR_PORT "$size" 0 "$RR_PID"
    run rolter-ca $CA_PORT "$size" 0 "$CA_PID"
    if [ -n "$TOKENIZER" ]; then run rolter-pt $PT_PORT "$size" 0 "$PT_PID"; fi
  done
  for size in $GROWTH_SIZES; do
    run direct $STUB_PORT "g$size" 0
    # shellcheck disable=SC2086
    run nginx $NGINX_PORT "g$size" 0 $NGINX_PIDS
    run rolter-rr $RR_PORT "g$size" 0 "$RR_PID"
    run rolter-ca $CA_PORT "g$size" 0 "$CA_PID"
  done
  if [ "$PACE_MS" -gt 0 ]; then
    run direct $STUB_PORT 4096 "$PACE_MS"
    # shellcheck disable=SC2086
    run nginx $NGINX_PORT 4096 "$PACE_MS" $NGINX_PIDS
    run rolter-rr $RR_PORT 4096 "$PACE_MS" "$RR_PID"
    run rolter-ca $CA_PORT 4096 "$PACE_MS" "$CA_PID"
  fi
done

# Medians of one path's runs under key KEY (a body size, "p" appended for the fixed-load runs).
rps() { echo "${RPS[$1/$2]}" | median; }       # label key
cpu() { echo "${CPU[$1/$2]}" | median; }       # label key
ms() { # P50|P99 label key -> median in ms
  local -n lat=$1
  for v in ${lat[$2/$3]}; do echo "$v" | to_ms; echo; done | median
}
table() { # key [labels] -> the paths' table
  echo "| path | req/s | p50 ms | p99 ms | CPU s / 10k req | of it user |"
  echo "|---|---:|---:|---:|---:|---:|"
  for label in ${2:-$LABELS}; do
    printf "| %s | %s | %s | %s | %s | %s |\n" "$label" "$(rps $label "$1")" \
      "$(ms P50 $label "$1")" "$(ms P99 $label "$1")" "$(cpu $label "$1")" \
      "$(echo "${USR[$label/$1]}" | median)"
  done
}
reuse() { # port -> "reused% (new/total)"
  curl -s "127.0.0.1:$1/metrics" | awk '/^rolter_upstream_connections_total\{reused="true"\}/ {r=$2} /^rolter_upstream_connections_total\{reused="false"\}/ {f=$2} END {printf "%.3f%% (%d new of %d)", 100*r/(r+f), f, r+f}'
}

{
  echo "# Proxy overhead: rolter vs nginx"
  echo
  echo "Generated by \`loadtest/overhead.sh\` on $(date -u +%Y-%m-%d) ($(nproc) cores, $(uname -m)); wrk -t1 -c$CONNS, ${DURATION}s per run, median of $REPEATS interleaved runs."
  echo "Upstream: rolter-stub (1 thread, answers at once). nginx $("$NGINX" -v 2>&1 | sed 's/.*\///'): worker_processes 1, upstream keepalive. rolter ($BUILD_NOTE build): pingora threads 1, RUST_LOG=$ROLTER_LOG (access log $([ "$ROLTER_LOG" = info ] && echo on || echo off))."
  [ -z "$TOKENIZER" ] || echo "rolter-pt: precise_cache_aware over the same stubs with \`tokenizer = $(basename "$TOKENIZER")\` (no KV events, so only the tokenization is added: every request is rendered with the chat template and tokenized, the earlier messages' ids cached)."
  echo "CPU = user+system seconds of the proxy process(es) per 10k requests (from /proc/PID/stat); \"of it user\" is the user-space part."
  echo
  for size in $SIZES; do
    echo "## $((size / 1024)) KiB chat bodies"
    echo
    table "$size"
    echo
    awk -v n="$(rps nginx "$size")" -v rr="$(rps rolter-rr "$size")" -v ca="$(rps rolter-ca "$size")" \
        -v nc="$(cpu nginx "$size")" -v rc="$(cpu rolter-rr "$size")" -v cc="$(cpu rolter-ca "$size")" \
        -v dp="$(ms P99 direct "$size")" -v cp="$(ms P99 rolter-ca "$size")" \
        -v rp="$(ms P99 rolter-rr "$size")" -v np="$(ms P99 nginx "$size")" \
        -v prr="$(paired "${RPS[nginx/$size]}" "${RPS[rolter-rr/$size]}")" \
        -v pca="$(paired "${RPS[nginx/$size]}" "${RPS[rolter-ca/$size]}")" \
        -v pcr="$(paired "${CPU[nginx/$size]}" "${CPU[rolter-rr/$size]}")" \
        -v pcc="$(paired "${CPU[nginx/$size]}" "${CPU[rolter-ca/$size]}")" 'BEGIN {
      printf "- throughput c/b (round_robin / nginx) = %.2f, d/b (cache_aware / nginx) = %.2f (median of same-repeat ratios: %.2f / %.2f)\n", rr / n, ca / n, prr, pca;
      printf "- CPU per request c/b = %.2f, d/b = %.2f (median of same-repeat ratios: %.2f / %.2f)\n", rc / nc, cc / nc, pcr, pcc;
      printf "- p99 added over direct by cache_aware: %.3f ms (round_robin %.3f ms, nginx %.3f ms)\n", cp - dp, rp - dp, np - dp }'
    if [ -n "$TOKENIZER" ]; then
      awk -v t="$(paired "${RPS[rolter-ca/$size]}" "${RPS[rolter-pt/$size]}")" \
          -v c="$(paired "${CPU[rolter-ca/$size]}" "${CPU[rolter-pt/$size]}")" 'BEGIN {
        printf "- precise_cache_aware with a route tokenizer (e) beside cache_aware (d): throughput e/d = %.2f, CPU per request e/d = %.2f (medians of same-repeat ratios)\n", t, c }'
    fi
    echo
  done
  for size in $GROWTH_SIZES; do
    k=g$size
    echo "## $((size / 1024)) KiB growing conversations (loadtest/growth.lua: 16 conversations, each request extending its previous one; bodies 13/16-16/16 of $((size / 1024)) KiB, mean 29/32)"
    echo
    table "$k" "direct nginx rolter-rr rolter-ca"
    echo
    awk -v n="$(rps nginx "$k")" -v rr="$(rps rolter-rr "$k")" -v ca="$(rps rolter-ca "$k")" \
        -v nc="$(cpu nginx "$k")" -v rc="$(cpu rolter-rr "$k")" -v cc="$(cpu rolter-ca "$k")" \
        -v kib="$(awk -v s="$size" 'BEGIN {print s * 29 / 32 / 1024}')" \
        -v pca="$(paired "${RPS[nginx/$k]}" "${RPS[rolter-ca/$k]}")" \
        -v pcc="$(paired "${CPU[nginx/$k]}" "${CPU[rolter-ca/$k]}")" 'BEGIN {
      printf "- throughput c/b (round_robin / nginx) = %.2f, d/b (cache_aware / nginx) = %.2f (median of same-repeat ratios d/b: %.2f)\n", rr / n, ca / n, pca;
      printf "- CPU per request c/b = %.2f, d/b = %.2f (median of same-repeat ratios d/b: %.2f)\n", rc / nc, cc / nc, pcc;
      printf "- CPU per KiB of body (mean %.0f KiB): nginx %.2f us, round_robin %.2f us, cache_aware %.2f us\n", kib, nc * 100 / kib, rc * 100 / kib, cc * 100 / kib }'
    echo
  done
  if [ "$PACE_MS" -gt 0 ]; then
    k=4096p
    echo "## 4 KiB chat bodies at a fixed offered load (each connection waits a random 0-$((2 * PACE_MS)) ms after an answer before its next request)"
    echo
    table "$k"
    echo
    awk -v d="$(ms P99 direct $k)" -v n="$(ms P99 nginx $k)" -v r="$(ms P99 rolter-rr $k)" -v c="$(ms P99 rolter-ca $k)" \
        -v d5="$(ms P50 direct $k)" -v n5="$(ms P50 nginx $k)" -v c5="$(ms P50 rolter-ca $k)" \
        -v nc="$(cpu nginx $k)" -v cc="$(cpu rolter-ca $k)" \
        -v pcc="$(paired "${CPU[nginx/$k]}" "${CPU[rolter-ca/$k]}")" 'BEGIN {
      printf "- p99 added over direct by cache_aware: %.3f ms (round_robin %.3f ms, nginx %.3f ms); p50 added: cache_aware %.3f ms, nginx %.3f ms\n", c - d, r - d, n - d, c5 - d5, n5 - d5;
      printf "- CPU per request d/b = %.2f (median of same-repeat ratios: %.2f)\n", cc / nc, pcc }'
    echo
  fi
  echo "Upstream connection reuse (whole run): round_robin $(reuse $RR_PORT); cache_aware $(reuse $CA_PORT)."
  echo
} > "$OUT.tmp"

if [ "$RSS_REQUESTS" -gt 0 ]; then
  start_rolter $RSS_PORT cache_aware 8; RSS_PID=$ROLTER_PID
  cat > "$WORK/unique.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local system = string.rep("You are a careful assistant. ", 40)
local n = 0
local thread_id = 0
setup = function(thread) thread_id = thread_id + 1 end
-- The question is ~300 bytes, unique from its start: several whole 64-byte chunks of every
-- prompt are new to the tries (a distinct tail shorter than a chunk would add no node).
request = function()
  n = n + 1
  local q = string.rep("unique question number " .. n .. " " .. math.random(1e9) .. " ", 8)
  return wrk.format(nil, "/v1/chat/completions", nil,
    '{"model":"bench","messages":[{"role":"system","content":"' .. system ..
    '"},{"role":"user","content":"' .. q .. '"}]}')
end
LUA
  rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
  echo "driving $RSS_REQUESTS distinct prompts through cache_aware x8 targets" >&2
  r0=$(rss "$RSS_PID"); done_reqs=0; samples=""
  while [ "$done_reqs" -lt "$RSS_REQUESTS" ]; do
    out=$(wrk -t1 -c"$CONNS" -d10s -s "$WORK/unique.lua" "http://127.0.0.1:$RSS_PORT" 2>&1)
    done_reqs=$((done_reqs + $(echo "$out" | awk '/requests in/ {print $1}')))
    samples+="| $done_reqs | $(( $(rss "$RSS_PID") / 1024 )) |\n"
  done
  nodes=$(curl -s "127.0.0.1:$RSS_PORT/metrics" | awk '/^rolter_trie_nodes/ {s+=$2} END {print s}')
  {
    echo "## Gateway RSS under distinct prompts (cache_aware, 8 targets, default trie caps)"
    echo
    echo "RSS at start: $((r0 / 1024)) MiB. Trie nodes at the end (all targets): $nodes."
    echo
    echo "| requests | RSS MiB |"
    echo "|---:|---:|"
    printf "%b" "$samples"
    echo
  } >> "$OUT.tmp"
fi
mv "$OUT.tmp" "$OUT"
cat "$OUT"
