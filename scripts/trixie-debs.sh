# Sourced by install-runsc.sh and install-criu.sh (not run on its own): fetch .deb files
# of Debian trixie without touching the system's apt configuration or package lists.
#
# debian_mirror: the Debian archive URI the system already uses (deb822 .sources or
# one-line .list format); the first one that is not a security mirror wins, else
# deb.debian.org. APT_ETC_DIR overrides /etc/apt (for tests).
debian_mirror() {
    local f uri etc=${APT_ETC_DIR:-/etc/apt}
    for f in "$etc"/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        while read -r uri; do
            case $uri in
                *security*) ;;
                */debian | */debian/) echo "${uri%/}"; return 0 ;;
            esac
        done < <(sed -n 's/^[[:space:]]*URIs:[[:space:]]*//p' "$f" | tr ' \t' '\n\n' | sed '/^$/d')
    done
    for f in "$etc"/sources.list "$etc"/sources.list.d/*.list; do
        [[ -f $f ]] || continue
        while read -r uri; do
            case $uri in
                *security*) ;;
                */debian | */debian/) echo "${uri%/}"; return 0 ;;
            esac
        # "deb [opts] URI suite comp..." -> URI
        done < <(sed -n 's/^[[:space:]]*deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\).*/\2/p' "$f")
    done
    echo "http://deb.debian.org/debian"
}

# fetch_trixie_debs DIR PKG...: download trixie's PKG... (.deb files) into DIR through a
# private, throw-away sources list pointing at the trixie suite of the mirror the system
# uses. A failed fetch of trixie's index (no network) is an error with one clear line,
# not a warning after which `download` picks the system's own versions and fails
# obscurely. Returns non-zero on failure.
fetch_trixie_debs() {
    local dir=$1 mirror keyring=/usr/share/keyrings/debian-archive-keyring.gpg apt_tmp pkg
    shift
    mirror=$(debian_mirror)
    apt_tmp=$(mktemp -d)
    mkdir -p "$apt_tmp/lists/partial" "$apt_tmp/archives/partial" "$apt_tmp/sources.list.d"
    printf 'deb [signed-by=%s] %s trixie main\n' "$keyring" "$mirror" >"$apt_tmp/sources.list"
    local apt_opts=(
        -o "Dir::Etc::sourcelist=$apt_tmp/sources.list"
        -o "Dir::Etc::sourceparts=$apt_tmp/sources.list.d"
        -o "Dir::State::Lists=$apt_tmp/lists"
        -o "Dir::Cache::Archives=$apt_tmp/archives"
        -o "Dir::Cache::pkgcache="
        -o "Dir::Cache::srcpkgcache="
        -o "APT::Architecture=$(dpkg --print-architecture)"
        -o "Acquire::Languages=none"
        -o "APT::Get::List-Cleanup=false"
        -o "APT::Sandbox::User=root"
    )
    echo "fetching trixie's $* from $mirror" >&2
    if ! apt-get "${apt_opts[@]}" --error-on=any update >&2; then
        echo "cannot fetch trixie's package index from $mirror (no network?)" >&2
        rm -rf "$apt_tmp"
        return 1
    fi
    local wanted=()
    for pkg in "$@"; do wanted+=("$pkg/trixie"); done
    if ! (cd "$dir" && apt-get "${apt_opts[@]}" download "${wanted[@]}" >&2); then
        rm -rf "$apt_tmp"
        return 1
    fi
    rm -rf "$apt_tmp"
}
