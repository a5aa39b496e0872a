#!/usr/bin/env bash
# Install what a fresh Debian machine lacks to build and test rolter:
#   cmake (pingora's zlib-ng build), a C toolchain, pkg-config, and for the Python
#   interop tests python3 + msgspec, and systemd-analyze (package systemd) for the unit
#   file check (tests/systemd.rs). Idempotent: installs only what is missing.
set -euo pipefail

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v python3 >/dev/null 2>&1 || need+=(python3 python3-pip)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust (stable) with rustup first" >&2
  exit 1
fi
# msgspec: an independent decoder of vLLM's KV-event structs; pyzmq: a real ZMQ peer.
for mod in msgspec zmq; do
  pkg=$mod; [ "$mod" = zmq ] && pkg=pyzmq
  if ! python3 -c "import $mod" >/dev/null 2>&1; then
    echo "setup: installing $pkg for the KV-event interop tests" >&2
    python3 -m pip install -q "$pkg" 2>/dev/null \
      || python3 -m pip install -q --break-system-packages "$pkg"
  fi
done
