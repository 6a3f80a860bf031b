#!/usr/bin/env bash
# System packages the full test suite needs. Root only; otherwise the tests that need
# them skip with a reason (and CI, which is root, refuses to skip them).
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
  echo "setup-system: not root; skipping system packages (runsc, criu, servers)" >&2
  exit 0
fi
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/apt-wait.sh
. "$here/apt-wait.sh"  # apt_get: waits for the dpkg/apt locks another apt process holds
if [ -x "$here/install-runsc.sh" ]; then
  bash "$here/install-runsc.sh"
fi
if [ -x "$here/install-criu.sh" ]; then
  bash "$here/install-criu.sh"
fi
# Network tests: redis-server (connections), nftables + iproute2 + iptables (routes/rules).
net_missing=""
for p in redis-server nftables iproute2 iptables; do
  dpkg -s "$p" >/dev/null 2>&1 || net_missing="$net_missing $p"
done
if [ -n "$net_missing" ]; then
  apt_stamp=/var/tmp/rehydrate-apt-updated
  [ -e "$apt_stamp" ] || { apt_get update >/dev/null && touch "$apt_stamp"; }
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt_get install -y --no-install-recommends $net_missing >/dev/null \
    || { apt_get update >/dev/null && touch "$apt_stamp" &&
         DEBIAN_FRONTEND=noninteractive apt_get install -y --no-install-recommends $net_missing >/dev/null; }
fi
