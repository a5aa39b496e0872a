#!/usr/bin/env bash
# Peer gateways as comparison rows: install smg (and vllm-router) from PyPI into a venv outside
# the repository, then regenerate the routing reports with them among the strategies,
# interleaved and repeated (loadtest/run.sh does the runs: same fleet, workloads and seeds).
#
#   loadtest/peers.sh                      # 3 rounds of the strategies below, 3 workloads
#   STRATEGIES=cache_aware,smg_cache_aware REPEATS=5 WORKLOADS="multi-turn" loadtest/peers.sh
#   INSTALL_ONLY=1 loadtest/peers.sh       # just install (idempotent)
#
# ROLTER_PEERS_VENV (default ~/.cache/rolter-peers/venv) is where the peers live; rolter-load
# finds them there (or use its --peer-venv). A `smg_<policy>` / `vllm_router_<policy>` strategy
# runs that peer with `--policy <policy>` and its defaults otherwise. A peer that is not
# installed (e.g. no network) is reported as "Not run", like a strategy rolter rejects.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${ROLTER_PEERS_VENV:-$HOME/.cache/rolter-peers/venv}"
SMG_VERSION="${SMG_VERSION:-1.13.0}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"

# The installed version of a Python package in the venv, or nothing.
installed() {
  "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true
}

ensure() { # package version
  if [ "$(installed "$1")" != "$2" ]; then
    echo "installing $1==$2 into $VENV" >&2
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "$1==$2"
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
fi
ensure smg "$SMG_VERSION"
# vllm-router is optional: a failed install leaves its rows "Not run".
ensure vllm-router "$VLLM_ROUTER_VERSION" || echo "warning: vllm-router not installed" >&2

[ -n "${INSTALL_ONLY:-}" ] && exit 0

export ROLTER_PEERS_VENV="$VENV"
export STRATEGIES="${STRATEGIES:-round_robin,cache_aware,pipeline,precise_cache_aware,smg_cache_aware,vllm_router_cache_aware}"
export REPEATS="${REPEATS:-3}"
export WORKLOADS="${WORKLOADS:-multi-turn multi-turn-pressure few-shot}"
exec loadtest/run.sh
