#!/usr/bin/env bash
# Check the systemd integration the way it is installed:
#   1. stage systemd/install.sh into a temporary DESTDIR;
#   2. `systemd-analyze verify` the staged unit: no error and no warning (an unknown or
#      misspelled directive is only a warning to systemd, so any output fails here);
#      verify requires ExecStart's binary to exist, so the unit is checked as a copy
#      whose /usr/local/bin/rolter points at the staged binary;
#   3. run the unit's ExecStartPre (`rolter -t`) on the staged config files;
#   4. check the unit against conf/pingora.yaml: TimeoutStopSec covers
#      grace_period_seconds + graceful_shutdown_timeout_seconds, and pid_file /
#      upgrade_sock live in the unit's RuntimeDirectory (/run/rolter).
#
# Usage: systemd/verify.sh [ROLTER_BINARY]    default: target/debug/rolter
# Exit: 0 ok, 1 check failed, 2 cannot check here (no systemd-analyze, no binary).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
bin=${1:-"${CARGO_TARGET_DIR:-$repo/target}/debug/rolter"}
yaml="$repo/conf/pingora.yaml"

if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "verify.sh: systemd-analyze not found (Debian: apt-get install systemd)" >&2
  exit 2
fi
if [ ! -x "$bin" ]; then
  echo "verify.sh: $bin is not built (cargo build)" >&2
  exit 2
fi
fail() { echo "verify.sh: $*" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
DESTDIR="$tmp/root" "$here/install.sh" "$bin" >/dev/null
unit="$tmp/root/etc/systemd/system/rolter.service"
staged="$tmp/root/usr/local/bin/rolter"
[ -x "$staged" ] || fail "install.sh did not stage the binary"

# 2. systemd-analyze verify, on a copy pointing at the staged binary.
mkdir "$tmp/unit"
sed "s|/usr/local/bin/rolter|$staged|g" "$unit" >"$tmp/unit/rolter.service"
if ! out=$(systemd-analyze verify --man=no "$tmp/unit/rolter.service" 2>&1); then
  echo "$out" >&2
  fail "systemd-analyze verify failed"
fi
if [ -n "$out" ]; then
  echo "$out" >&2
  fail "systemd-analyze verify printed warnings"
fi

# 3. The ExecStartPre check on the staged config files.
pre=$(sed -n 's/^ExecStartPre=//p' "$unit")
[ "$pre" = "/usr/local/bin/rolter -t -c /etc/rolter/pingora.yaml --routes /etc/rolter/rolter.toml" ] \
  || fail "unexpected ExecStartPre: $pre"
"$staged" -t -c "$tmp/root/etc/rolter/pingora.yaml" --routes "$tmp/root/etc/rolter/rolter.toml" \
  >"$tmp/check.log" 2>&1 || { cat "$tmp/check.log" >&2; fail "rolter -t rejects the shipped config"; }

# 4. Consistency with conf/pingora.yaml, and the directives operators rely on.
yaml_int() { sed -n "s/^$1: *\([0-9][0-9]*\) *$/\1/p" "$yaml"; }
grace=$(yaml_int grace_period_seconds)
drain=$(yaml_int graceful_shutdown_timeout_seconds)
[ -n "$grace" ] && [ -n "$drain" ] || fail "$yaml lacks grace_period_seconds / graceful_shutdown_timeout_seconds"
stop=$(sed -n 's/^TimeoutStopSec=\([0-9][0-9]*\)s\{0,1\}$/\1/p' "$unit")
[ -n "$stop" ] || fail "TimeoutStopSec missing or not in seconds"
[ "$stop" -gt $((grace + drain)) ] \
  || fail "TimeoutStopSec=${stop}s does not cover grace ${grace}s + shutdown timeout ${drain}s"
grep -q '^pid_file: /run/rolter/' "$yaml" || fail "pid_file is not under /run/rolter"
grep -q '^upgrade_sock: /run/rolter/' "$yaml" || fail "upgrade_sock is not under /run/rolter"
for line in \
  'Type=simple' \
  'ExecStart=/usr/local/bin/rolter -c /etc/rolter/pingora.yaml --routes /etc/rolter/rolter.toml' \
  'ExecReload=/bin/kill -HUP $MAINPID' \
  'KillSignal=SIGTERM' \
  'Restart=on-failure' \
  'User=rolter' \
  'RuntimeDirectory=rolter' \
  'NoNewPrivileges=yes' \
  'ProtectSystem=strict' \
  'CapabilityBoundingSet=' \
  'LimitNOFILE=65536'; do
  grep -qxF "$line" "$unit" || fail "missing: $line"
done

echo "systemd/rolter.service: ok (systemd-analyze verify clean; TimeoutStopSec=${stop}s > ${grace}s + ${drain}s; rolter -t accepts the installed config)"
