#!/usr/bin/env bash
# Install gVisor's runsc for the real checkpoint/restore tests (tests/gvisor).
#
#   * /usr/bin/runsc             Debian bookworm's package (0.0~20221219)
#   * /usr/local/bin/runsc-trixie  Debian trixie's static binary (0.0~20240729),
#                                which adds `checkpoint --compression=none`.
#
# The trixie binary is fetched with `apt-get download` through a private,
# throw-away sources list that points at the trixie suite of the same Debian
# mirror the system already uses; the system's apt configuration and package
# lists are not touched. Nothing else is installed.
#
# Idempotent; must run as root. Exits 0 at once when both are already there.
set -euo pipefail

TRIXIE_BIN=/usr/local/bin/runsc-trixie
log() { printf 'install-runsc: %s\n' "$*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
    log "must run as root"
    exit 1
fi

have_bookworm() { [[ -x /usr/bin/runsc ]] && /usr/bin/runsc --version >/dev/null 2>&1; }
have_trixie() { [[ -x $TRIXIE_BIN ]] && "$TRIXIE_BIN" --version >/dev/null 2>&1; }

if have_bookworm && have_trixie; then
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# shellcheck source=scripts/apt-wait.sh
. "$(cd "$(dirname "$0")" && pwd)/apt-wait.sh"  # apt_get: waits for another apt's locks

if ! have_bookworm; then
    log "installing Debian's runsc package"
    if ! apt_get install -y --no-install-recommends runsc; then
        apt_get update
        apt_get install -y --no-install-recommends runsc
    fi
fi

# shellcheck source=trixie-debs.sh
source "$(dirname "${BASH_SOURCE[0]}")/trixie-debs.sh"

if ! have_trixie; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$tmp/deb"
    fetch_trixie_debs "$tmp/deb" runsc || { log "trixie's runsc not installed"; exit 1; }
    deb=$(ls "$tmp"/deb/runsc_*.deb)
    log "unpacking $(basename "$deb")"
    dpkg -x "$deb" "$tmp/root"
    install -m 0755 "$tmp/root/usr/bin/runsc" "$TRIXIE_BIN"
fi

log "$(/usr/bin/runsc --version | head -1) at /usr/bin/runsc"
log "$("$TRIXIE_BIN" --version | head -1) at $TRIXIE_BIN"
