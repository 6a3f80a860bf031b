#!/usr/bin/env bash
# System packages the full test suite needs. Root only; otherwise the tests that need
# them skip with a reason (and CI, which is root, refuses to skip them).
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
  echo "setup-system: not root; skipping system packages (runsc, servers)" >&2
  exit 0
fi
here="$(cd "$(dirname "$0")" && pwd)"
if [ -x "$here/install-runsc.sh" ]; then
  bash "$here/install-runsc.sh"
fi
