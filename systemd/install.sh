#!/usr/bin/env bash
# Install rolter as a systemd service.
#
#   binary  -> /usr/local/bin/rolter
#   config  -> /etc/rolter/pingora.yaml  (from conf/pingora.yaml)
#              /etc/rolter/rolter.toml   (from conf/rolter.example.toml)
#              existing config files are never overwritten
#   unit    -> /etc/systemd/system/rolter.service
#   user    -> rolter (system user and group, no login shell, no home)
#
# Usage:   sudo systemd/install.sh [BINARY]       BINARY defaults to target/release/rolter
#          (build it first: cargo build --release)
# Then:    edit /etc/rolter/rolter.toml; systemctl enable --now rolter
#
# DESTDIR=/some/dir stages the same files under that directory instead of / and skips
# the user, ownership and systemctl steps (systemd/verify.sh checks the staged unit).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
bin=${1:-"${CARGO_TARGET_DIR:-$repo/target}/release/rolter"}
dest=${DESTDIR:-}

if [ ! -x "$bin" ]; then
  echo "install.sh: $bin is not an executable; build it first (cargo build --release)" >&2
  exit 1
fi
if [ -z "$dest" ] && [ "$(id -u)" -ne 0 ]; then
  echo "install.sh: run as root (or set DESTDIR to stage the files)" >&2
  exit 1
fi

# The dedicated user (a fixed one rather than DynamicUser=, so /etc/rolter can be
# group-readable by it and an operator can run a `-u` upgrade process as the same user).
if [ -z "$dest" ] && ! id -u rolter >/dev/null 2>&1; then
  nologin=$(command -v nologin || echo /usr/sbin/nologin)
  useradd --system --user-group --no-create-home --home-dir /nonexistent \
    --shell "$nologin" --comment "rolter gateway" rolter
  echo "install.sh: created system user rolter"
fi

install -D -m 0755 "$bin" "$dest/usr/local/bin/rolter"

install -d -m 0750 "$dest/etc/rolter"
install_config() { # source, name
  local target="$dest/etc/rolter/$2"
  if [ -e "$target" ]; then
    echo "install.sh: keeping existing $target"
  else
    install -m 0640 "$1" "$target"
  fi
}
install_config "$repo/conf/pingora.yaml" pingora.yaml
install_config "$repo/conf/rolter.example.toml" rolter.toml
if [ -z "$dest" ]; then
  chown root:rolter /etc/rolter /etc/rolter/pingora.yaml /etc/rolter/rolter.toml
fi

install -D -m 0644 "$here/rolter.service" "$dest/etc/systemd/system/rolter.service"

if [ -z "$dest" ]; then
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
  else
    echo "install.sh: systemd is not running here; run 'systemctl daemon-reload' on the target"
  fi
  cat <<EOF
install.sh: installed. Next:
  edit /etc/rolter/rolter.toml   (check it: /usr/local/bin/rolter -t -c /etc/rolter/pingora.yaml --routes /etc/rolter/rolter.toml)
  systemctl enable --now rolter
  systemctl reload rolter        (after editing the routing file: SIGHUP, state is kept)
  journalctl -u rolter -f
EOF
else
  echo "install.sh: staged under $dest"
fi
