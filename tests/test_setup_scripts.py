"""scripts/setup-system.sh's apt calls wait for the dpkg and apt locks another apt process
holds (a fresh ``make test`` once failed because an unattended apt run held them).

Real ``apt-get`` against a private copy of the dpkg database and a private lists
directory (through ``APT_CONFIG``), so the system's own locks are never taken; the lock
is held with ``fcntl`` as dpkg and apt themselves take it.
"""

from __future__ import annotations

import fcntl
import os
import select
import shutil
import subprocess
import time

import pytest

pytestmark = pytest.mark.root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE = 60.0


def _require_or_skip(reason: str) -> None:
    if os.environ.get("REHYDRATE_REQUIRE_ROOT_TESTS", "") not in ("", "0", "false", "no"):
        pytest.fail(f"REHYDRATE_REQUIRE_ROOT_TESTS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def private_apt(tmp_path):
    if os.geteuid() != 0:
        _require_or_skip("apt lock tests need root")
    if shutil.which("apt-get") is None or not os.path.exists("/var/lib/dpkg/status"):
        _require_or_skip("apt-get and dpkg are needed")
    dpkg = tmp_path / "dpkg"
    (dpkg / "updates").mkdir(parents=True)
    shutil.copy("/var/lib/dpkg/status", dpkg / "status")
    lists = tmp_path / "lists"
    (lists / "partial").mkdir(parents=True)
    (tmp_path / "cache" / "archives" / "partial").mkdir(parents=True)
    (tmp_path / "sources.list.d").mkdir()
    conf = tmp_path / "apt.conf"
    conf.write_text(
        f'Dir::State::status "{dpkg}/status";\n'
        f'Dir::State::Lists "{lists}";\n'
        f'Dir::Cache "{tmp_path}/cache";\n'
        'Dir::Etc::sourcelist "/dev/null";\n'  # `update` fetches nothing
        f'Dir::Etc::sourceparts "{tmp_path}/sources.list.d";\n'
    )
    env = dict(os.environ, APT_CONFIG=str(conf), DEBIAN_FRONTEND="noninteractive")
    return {"frontend": dpkg / "lock-frontend", "lists": lists / "lock", "env": env}


def _apt_get(args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    script = f'. "{ROOT}/scripts/apt-wait.sh"; apt_get {args}'
    return subprocess.Popen(["bash", "-c", script], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for_line(proc: subprocess.Popen[str], needle: str) -> list[str]:
    """Lines of ``proc`` up to one containing ``needle``; fails if it exits first."""
    assert proc.stdout is not None
    seen: list[str] = []
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], end - time.monotonic())
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    proc.kill()
    raise AssertionError(f"no {needle!r} from apt_get (exit {proc.wait()}): {seen}")


def _locked(path: os.PathLike[str]) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    fcntl.lockf(fd, fcntl.LOCK_EX)  # the fcntl record lock dpkg and apt use
    return fd


@pytest.mark.parametrize(("lock", "args", "needle"), [
    ("frontend", "install -y --no-install-recommends bash", "Waiting for cache lock"),
    ("lists", "update", "apt: waiting for the lock"),
])
def test_apt_get_waits_for_a_lock_another_apt_holds(private_apt, lock, args, needle):
    fd = _locked(private_apt[lock])
    try:
        proc = _apt_get(args, private_apt["env"])
        _wait_for_line(proc, needle)  # still running: it waits instead of failing
        assert proc.poll() is None
    finally:
        os.close(fd)  # the other apt process is done
    out, _ = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 0, out


def test_setup_scripts_use_the_waiting_apt_get():
    for name in ("setup-system.sh", "install-runsc.sh", "install-criu.sh"):
        with open(os.path.join(ROOT, "scripts", name)) as fh:
            text = fh.read()
        assert "apt-wait.sh" in text
        bare = [line for line in text.splitlines()
                if "apt-get " in line and not line.lstrip().startswith("#")
                and "apt_opts" not in line]  # install-runsc/criu's private throw-away lists
        assert bare == [], f"{name} calls apt-get without waiting for its locks: {bare}"
