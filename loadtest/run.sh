#!/usr/bin/env bash
# Regenerate the routing comparison tables in loadtest/reports/.
#
# Builds the gateway and the load driver (release), then for each workload runs every strategy
# through the gateway against a fresh in-process simulated fleet (ephemeral loopback ports) and
# writes loadtest/reports/<name>.md (+ .json). A strategy the gateway rejects is listed as
# "Not run" instead of failing the whole comparison.
#
#   loadtest/run.sh                      # all workloads, all strategies
#   STRATEGIES=round_robin,cache_aware loadtest/run.sh
#   WORKLOADS="multi-turn" loadtest/run.sh
#   WORKLOADS="multi-turn-16 multi-turn-16-pressure" loadtest/run.sh   # the 16-replica fleet
#   REPEATS=3 loadtest/run.sh            # 3 interleaved rounds: per-strategy medians + spread
#   WORKLOADS="agentic skewed" loadtest/run.sh      # bursty fan-out; one hot prompt at 60%
#   WORKLOADS=multi-turn-sweep loadtest/run.sh      # open-loop rates to saturation: goodput
#   GATEWAYS=2 SUFFIX=-2gw STRATEGIES=cache_aware,pipeline,precise_cache_aware \
#     WORKLOADS="multi-turn multi-turn-pressure" loadtest/run.sh   # +rows behind 2 gateways
#   PEERING=1 with GATEWAYS=N adds rows behind N peered gateways (S@Np, `[peering]`)
#   WITHOUT_KV_CACHE_TOKENS=1 SUFFIX=-unsized WORKLOADS=multi-turn-pressure \
#     STRATEGIES=cache_aware,precise_cache_aware loadtest/run.sh   # no kv_cache_tokens set
#   PROVIDER_OPTION='metrics_path = ""' (with the above): nor read from the replicas' /metrics
#   (peer gateways as rows: loadtest/peers.sh, which installs them and then runs this script)
#
# The fleet profile below makes the cache matter: a 2,000-token prefill (20 µs/token) costs
# about as much as 20 decode steps (2 ms/token), each replica runs at most 4 requests at once,
# and caches hold 512 blocks (8,192 tokens) — enough for a replica's share of sessions when
# related requests stay together, not when they are scattered. The "-pressure" run shrinks the
# caches to 192 blocks so that evictions are frequent. The "-16" runs repeat both on 16
# replicas with four times the sessions and twice the clients (4 per replica instead of 8).
# "agentic": 6 agents, each with its own ~4,000-token tool prompt, 4 steps of 4-16 parallel
# calls (a replica's cache holds two tool prompts). "skewed": 96 chat sessions, 60% on one hot
# system prompt, the rest over 31 others. "multi-turn-sweep": multi-turn at rising open-loop
# rates (RATES, requests/s) past the fleet's capacity; goodput = requests/s with TTFT within
# SLO_TTFT_MS (500 ms; the fleet's uncached 2,000-token prefill takes 40 ms).
set -euo pipefail
cd "$(dirname "$0")/.."

STRATEGIES="${STRATEGIES:-round_robin,least_load,cache_aware,pipeline,precise_cache_aware,lmcache_aware}"
WORKLOADS="${WORKLOADS:-multi-turn multi-turn-pressure multi-turn-16 multi-turn-16-pressure few-shot unique}"
TARGET="${CARGO_TARGET_DIR:-target}"

cargo build --release -q -p rolter --bin rolter -p rolter-loadtest --bin rolter-load
# Run private copies: a shared target directory may be rebuilt by someone else mid-run.
BIN=$(mktemp -d /tmp/rolter-run.XXXXXX)
trap 'rm -rf "$BIN"' EXIT
cp "$TARGET/release/rolter" "$TARGET/release/rolter-load" "$BIN/"

FLEET=(--max-running 4 --prefill-us-per-token 20 --decode-us-per-token 2000)
REPEATS="${REPEATS:-1}"
GATEWAYS="${GATEWAYS:-1}"
SUFFIX="${SUFFIX:-}"
RATES="${RATES:-60,120,180,240,300}"
SLO_TTFT_MS="${SLO_TTFT_MS:-500}"
COMMON=(--gateway "$BIN/rolter" --strategies "$STRATEGIES" --max-duration-secs 120
  --repeats "$REPEATS" --gateways "$GATEWAYS" --slo-ttft-ms "$SLO_TTFT_MS")
if [ "${PEERING:-0}" = 1 ]; then COMMON+=(--peering); fi
if [ "${WITHOUT_KV_CACHE_TOKENS:-0}" = 1 ]; then COMMON+=(--without-kv-cache-tokens); fi
if [ -n "${PROVIDER_OPTION:-}" ]; then COMMON+=(--provider-option "$PROVIDER_OPTION"); fi
# Users pause between turns (mean 100 ms here, exponential): without it a closed-loop client
# sends its next turn the instant a replica frees up, and least_load "finds" that replica again.
CHAT=(--think-time-ms 100)

for w in $WORKLOADS; do
  size=(--replicas 4 --clients 32)
  cmd=(compare)
  case "$w" in
    multi-turn)
      args=(--workload multi-turn --sessions 96 --turns 5 --cache-blocks 512 "${CHAT[@]}") ;;
    multi-turn-pressure)
      args=(--workload multi-turn --sessions 96 --turns 5 --cache-blocks 192 "${CHAT[@]}") ;;
    multi-turn-16)
      size=(--replicas 16 --clients 64)
      args=(--workload multi-turn --sessions 384 --turns 5 --cache-blocks 512 "${CHAT[@]}") ;;
    multi-turn-16-pressure)
      size=(--replicas 16 --clients 64)
      args=(--workload multi-turn --sessions 384 --turns 5 --cache-blocks 192 "${CHAT[@]}") ;;
    few-shot)
      args=(--workload few-shot --requests 400 --prefixes 8 --prefix-tokens 1500 --cache-blocks 512) ;;
    unique)
      args=(--workload unique --requests 400 --user-tokens 500 --cache-blocks 512) ;;
    agentic)
      size=(--replicas 4 --clients 6)
      args=(--workload agentic --sessions 6 --turns 4 --prefixes 6 --prefix-tokens 4000
        --fanout-min 4 --fanout-max 16 --cache-blocks 512) ;;
    skewed)
      args=(--workload skewed --sessions 96 --turns 5 --prefixes 32 --hot-share 0.6
        --cache-blocks 512 "${CHAT[@]}") ;;
    multi-turn-sweep)
      cmd=(sweep --rates "$RATES")
      args=(--workload multi-turn --sessions 384 --turns 5 --cache-blocks 512 "${CHAT[@]}") ;;
    *)
      echo "unknown workload $w" >&2; exit 2 ;;
  esac
  echo "### $w" >&2
  "$BIN/rolter-load" "${cmd[@]}" "${args[@]}" "${size[@]}" "${FLEET[@]}" "${COMMON[@]}" \
    --out "loadtest/reports/$w$SUFFIX.md" > /dev/null
done
echo "reports in loadtest/reports/" >&2
