# shellcheck shell=bash
# Sourced by loadtest/overhead.sh, loadtest/profile.sh and scripts/build-pgo.sh: the one
# description of "a rolter gateway in front of N providers that are all one rolter-stub".
# Defines functions only; sourcing it runs nothing.

# stub_routes STRATEGY TARGETS STUB_PORT [UPSTREAM_MODEL]
# Prints a routing file: providers p0..p<TARGETS-1>, every one at 127.0.0.1:STUB_PORT with
# active health checks off, and one route, model "bench", over all of them with STRATEGY.
# UPSTREAM_MODEL (default "upstream-model") is the model name sent upstream; profile.sh
# keeps its historical "m" so its instruction counts stay comparable across commits.
stub_routes() {
  local strategy=$1 targets=$2 port=$3 model=${4:-upstream-model} i
  for ((i = 0; i < targets; i++)); do
    printf '[[providers]]\nname = "p%s"\nkind = "openai_compatible"\napi_base = "http://127.0.0.1:%s"\n[providers.health]\nenabled = false\n\n' "$i" "$port"
  done
  printf '[[routes]]\nmodel = "bench"\nstrategy = "%s"\n' "$strategy"
  for ((i = 0; i < targets; i++)); do
    printf '[[routes.targets]]\nprovider = "p%s"\nmodel = "%s"\n' "$i" "$model"
  done
}

# gateway_yaml DIR
# Prints pingora's YAML for a benchmark gateway: one worker thread, pid file and upgrade
# socket under DIR (used only with -d / -u, so gateways may share it), an upstream
# keep-alive pool above the 64 connections every benchmark opens, and a 1 s shutdown so a
# run ends promptly.
gateway_yaml() {
  printf -- '---\nversion: 1\nthreads: 1\npid_file: %s/rolter.pid\nupgrade_sock: %s/upgrade.sock\nupstream_keepalive_pool_size: 256\ngrace_period_seconds: 1\ngraceful_shutdown_timeout_seconds: 1\n' "$1" "$1"
}
