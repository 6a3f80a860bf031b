# shellcheck shell=bash
# Sourced by the setup scripts: apt_get ARGS... is apt-get that waits (up to
# $APT_LOCK_TIMEOUT seconds, default 600) for the dpkg and apt locks another apt process
# holds — an unattended upgrade or a parallel `make test` — instead of failing at once.
#
# apt-get waits for the dpkg frontend lock itself when given DPkg::Lock::Timeout (and
# prints "Waiting for cache lock" with -q); `apt-get update` does not wait for the lists
# lock, so a lock failure is retried here until the same deadline.
apt_get() {
  local timeout=${APT_LOCK_TIMEOUT:-600} start=$SECONDS err rc said=""
  err=$(mktemp)
  while :; do
    if apt-get -q -o "DPkg::Lock::Timeout=$timeout" "$@" 2>"$err"; then
      rm -f "$err"
      return 0
    else
      rc=$?
    fi
    if grep -q -e "Could not get lock" -e "Unable to lock" "$err" \
        && (( SECONDS - start < timeout )); then
      if [ -z "$said" ]; then
        echo "apt: waiting for the lock: $(head -n 1 "$err")" >&2
        said=1
      fi
      sleep 1
      continue
    fi
    cat "$err" >&2
    rm -f "$err"
    return "$rc"
  done
}
