#!/usr/bin/env bash
# Install CRIU for the real checkpoint/restore tests (tests/criu):
#
#   * /usr/local/bin/criu-trixie    Debian trixie's CRIU (4.1.x), run by a wrapper with
#                                   trixie's glibc through trixie's own dynamic loader,
#   * /opt/rehydrate/criu-trixie/   the criu binary and trixie's glibc.
#
# Debian bookworm's CRIU 3.17 fails `criu check` on newer kernels (its vDSO handling);
# trixie's criu binary needs glibc >= 2.38, which bookworm lacks. Its other libraries
# (libprotobuf-c, libnl, libnet, libnftables, gnutls, ...) keep their bookworm sonames
# and come from bookworm's packages. The wrapper passes the library path to the loader
# (`--library-path`), not through LD_LIBRARY_PATH, so whatever criu starts (its action
# scripts, e.g. rehydrate-notify) runs with the system's own glibc.
#
# The trixie packages (criu, libc6) are fetched with `apt-get download` through a
# private, throw-away sources list that points at the trixie suite of the same Debian
# mirror the system already uses (as scripts/install-runsc.sh does); the system's apt
# configuration is not touched (its package lists only when bookworm's own libraries
# criu needs must be installed and the first install attempt fails), and nothing from
# trixie is installed as a package.
#
# Idempotent; must run as root. Exits 0 at once when criu-trixie already works.
set -euo pipefail

WRAPPER=/usr/local/bin/criu-trixie
DEST=/opt/rehydrate/criu-trixie
# The bookworm libraries trixie's criu links besides glibc.
RUNTIME_PKGS=(libbsd0 libgnutls30 libnet1 libnftables1 libnl-3-200 libprotobuf-c1 libuuid1)
log() { printf 'install-criu: %s\n' "$*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
    log "must run as root"
    exit 1
fi

have_criu() { [[ -x $WRAPPER ]] && "$WRAPPER" --version >/dev/null 2>&1; }

if have_criu; then
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# shellcheck source=scripts/apt-wait.sh
. "$(cd "$(dirname "$0")" && pwd)/apt-wait.sh"  # apt_get: waits for another apt's locks

missing=()
for p in "${RUNTIME_PKGS[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if (( ${#missing[@]} )); then
    log "installing ${missing[*]}"
    if ! apt_get install -y --no-install-recommends "${missing[@]}" >/dev/null; then
        apt_get update >/dev/null
        apt_get install -y --no-install-recommends "${missing[@]}" >/dev/null
    fi
fi

# shellcheck source=trixie-debs.sh
source "$(dirname "${BASH_SOURCE[0]}")/trixie-debs.sh"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/deb"
fetch_trixie_debs "$tmp/deb" criu libc6 || { log "criu not installed"; exit 1; }
for deb in "$tmp"/deb/criu_*.deb "$tmp"/deb/libc6_*.deb; do
    log "unpacking $(basename "$deb")"
    dpkg -x "$deb" "$tmp/root"
done

# The loader's name and directory depend on the architecture (ld-linux-x86-64.so.2 in
# usr/lib/x86_64-linux-gnu, ld-linux-aarch64.so.1 in usr/lib/aarch64-linux-gnu, ...).
loader=$(find "$tmp/root/usr/lib" -maxdepth 2 -name 'ld-linux*.so.*' | head -1)
[[ -n $loader ]] || { log "no dynamic loader in trixie's libc6"; exit 1; }
libdir=$(dirname "$loader")
triplet=$(basename "$libdir")

# A fresh directory swapped in, so a failed run never leaves half an installation.
rm -rf "$DEST.new"
mkdir -p "$DEST.new/lib"
cp -a "$libdir"/*.so* "$DEST.new/lib/"
install -m 0755 "$tmp/root/usr/sbin/criu" "$DEST.new/criu"
rm -rf "$DEST"
mv "$DEST.new" "$DEST"

cat >"$WRAPPER.new" <<WRAP
#!/bin/sh
# Debian trixie's CRIU with trixie's glibc, through trixie's loader (installed by
# rehydrate's scripts/install-criu.sh). --library-path, not LD_LIBRARY_PATH: programs
# criu starts (action scripts) keep the system's glibc.
exec $DEST/lib/$(basename "$loader") \\
    --library-path $DEST/lib:/lib/$triplet:/usr/lib/$triplet \\
    $DEST/criu "\$@"
WRAP
chmod 0755 "$WRAPPER.new"
mv "$WRAPPER.new" "$WRAPPER"

if ! have_criu; then
    log "$WRAPPER does not run:"
    "$WRAPPER" --version >&2 || true
    exit 1
fi
log "$("$WRAPPER" --version | head -1) at $WRAPPER"
