#!/usr/bin/env bash
# Install what a fresh Debian machine lacks to build and test rolter:
#   cmake (pingora's zlib-ng build), a C and C++ toolchain (libzmq is built from source by
#   the zmq crate), pkg-config, for the Python interop tests python3 + msgspec (pyzmq,
#   openai and anthropic optional), and systemd-analyze (package systemd) for the unit
#   file check (tests/systemd.rs). Idempotent: installs only what is missing.
set -euo pipefail

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v c++ >/dev/null 2>&1 || need+=(g++)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v python3 >/dev/null 2>&1 || need+=(python3 python3-pip)
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
updated=""
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}" >&2
  $sudo apt-get update -qq && updated=1
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
# Optional: systemd-analyze for tests/systemd.rs, which skips (saying why) without it, so
# a container where the systemd package will not install does not stop the suite.
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "setup: installing systemd (for systemd-analyze verify)" >&2
  { [ -n "$updated" ] || $sudo apt-get update -qq; } \
    && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq systemd >/dev/null \
    || echo "setup: systemd-analyze unavailable; tests/systemd.rs will skip" >&2
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust (stable) with rustup first" >&2
  exit 1
fi
# msgspec (required): an independent decoder of vLLM's KV-event structs.
# pyzmq (optional): a real ZMQ peer; without it the interop test checks dumped frames only.
pip_install() {
  python3 -m pip install -q "$1" 2>/dev/null || python3 -m pip install -q --break-system-packages "$1"
}
if ! python3 -c "import msgspec" >/dev/null 2>&1; then
  echo "setup: installing msgspec for the KV-event interop tests" >&2
  pip_install msgspec
fi
if ! python3 -c "import zmq" >/dev/null 2>&1; then
  echo "setup: installing pyzmq for the KV-event interop tests" >&2
  pip_install pyzmq || echo "setup: pyzmq unavailable; the interop test skips its live-socket part" >&2
fi
# openai, anthropic (optional): the official SDKs, driven through rolter by
# tests/python/test_sdk_interop.py, which skips (saying why) without them.
for mod in openai anthropic; do
  if ! python3 -c "import $mod" >/dev/null 2>&1; then
    echo "setup: installing $mod for the SDK interop tests" >&2
    pip_install "$mod" || echo "setup: $mod unavailable; the SDK interop test skips its part" >&2
  fi
done
