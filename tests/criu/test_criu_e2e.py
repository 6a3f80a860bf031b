"""Real CRIU: the action-script wiring docs/platforms/criu.md documents.

``criu-trixie`` (Debian trixie's CRIU 4.1 with trixie's glibc, installed by
scripts/install-criu.sh) dumps and restores :mod:`criu_workload` with
``--action-script <venv>/bin/rehydrate-notify`` and ``REHYDRATE_CONTROL_SOCKET`` in its
environment, as the page says:

* a dump runs the before-snapshot hooks once (``pre-dump``) and the process is gone; each
  restore of the image runs the restore hooks exactly once (generation 1, a new instance
  ID per clone) and answers ``rehydrate status`` as ready;
* a ``--leave-running`` dump leaves the original with its before-snapshot hooks done; it
  is ready again by itself, no ``rehydrate notify resume`` by hand: the action script
  queues a ``resume`` at ``post-dump``, which the original reads when CRIU lets it go on
  — also after a small workload's dump, whose freeze (about 50 ms) is too short for the
  clock-jump detector — and the hooks run once, also when the clock-jump detector saw a
  longer freeze (a workload with some memory to write) and the two notices race.

CRIU restores the process into a new time namespace whose offsets hide the time it was
not running: its CLOCK_MONOTONIC does not jump over the downtime (checked here).

Needs root and ``criu-trixie``; without them the tests skip, or fail with
``REHYDRATE_REQUIRE_ROOT_TESTS=1`` (root CI). Every workload — the original and the
clones CRIU restores, which are nobody's children here — is killed in teardown.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.root, pytest.mark.criu]

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "criu_workload.py"
REPO = HERE.parent.parent
BIN = Path(sys.executable).parent
NOTIFY = str(BIN / "rehydrate-notify")  # the venv's console script, as documented
REHYDRATE = str(BIN / "rehydrate")
CRIU = "criu-trixie"
DEADLINE = 15.0  # for anything to show up; each normally takes well under a second
BALLAST_MB = 256  # the dump writes it while the process is frozen: ~0.2 s here


def _require_or_skip(reason: str) -> None:
    if os.environ.get("REHYDRATE_REQUIRE_ROOT_TESTS", "") not in ("", "0", "false", "no"):
        pytest.fail(f"REHYDRATE_REQUIRE_ROOT_TESTS=1 but {reason}", pytrace=False)
    pytest.skip(f"{reason} (REHYDRATE_REQUIRE_ROOT_TESTS=1 makes this a failure)")


@pytest.fixture(scope="module")
def criu() -> str:
    if os.geteuid() != 0:
        _require_or_skip("CRIU tests need root")
    path = shutil.which(CRIU)
    if path is None:
        _require_or_skip(f"no {CRIU}; run scripts/install-criu.sh as root")
        raise AssertionError("unreachable")
    check = subprocess.run([path, "check"], check=False, capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        _require_or_skip(f"`{CRIU} check` fails here: {check.stdout}{check.stderr}".strip())
    return path


class Workload:
    """One workload process and every clone restored from it; :meth:`kill_all` in teardown."""

    def __init__(self, criu: str, workdir: Path) -> None:
        self.criu = criu
        self.dir = workdir
        self.events = workdir / "events.jsonl"
        self.sock = str(workdir / "rehydrate.sock")
        self.env = dict(os.environ, REHYDRATE_CONTROL_SOCKET=self.sock,
                        PYTHONPATH=os.pathsep.join(
                            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self.images = 0

    def start(self, ballast_mb: int = 0) -> dict[str, Any]:
        self.events.touch()
        # CRIU dumps a tree: its own session, stdio on files, stdin /dev/null.
        with open(self.dir / "stdout", "ab") as out, open(self.dir / "stderr", "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKLOAD), str(self.events), self.sock, str(ballast_mb)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=self.env,
                start_new_session=True, cwd=self.dir)
        started = self.wait_for(lambda r: r["kind"] == "started")[0]
        self.pid = started["pid"]
        return started

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.events.read_text().splitlines() if line]

    def wait_for(self, match: Callable[[dict[str, Any]], bool],
                 count: int = 1) -> list[dict[str, Any]]:
        deadline = time.monotonic() + DEADLINE
        while True:
            found = [r for r in self.records() if match(r)]
            if len(found) >= count:
                return found
            if self.proc is not None and self.proc.poll() is not None and not self.alive():
                raise AssertionError(f"workload exited: {self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {count} matching event(s): {self.records()}")
            time.sleep(0.02)

    def run_criu(self, *args: str) -> subprocess.CompletedProcess[str]:
        log = self.dir / f"criu-{args[0]}-{self.images}.log"
        proc = subprocess.run([self.criu, *args, "--action-script", NOTIFY, "-o", str(log),
                               "-v2"], check=False, capture_output=True, text=True,
                              env=self.env, timeout=60, cwd=self.dir)
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr, self._log(log))
        # CRIU logs a failed action script but carries on (exit 0) after post-resume.
        # This kernel refuses criu's own RLIMIT_NOFILE raise: harmless, always there.
        errors = [line for line in self._log(log).splitlines()
                  if line.startswith("Error") and "RLIMIT_NOFILE" not in line]
        assert errors == [], self._log(log)
        return proc

    def dump(self, *extra: str) -> Path:
        self.images += 1
        img = self.dir / f"img{self.images}"
        img.mkdir()
        self.run_criu("dump", "-t", str(self.pid), "-D", str(img), *extra)
        return img

    def restore(self, img: Path) -> None:
        self.run_criu("restore", "-D", str(img), "-d")

    def status(self) -> dict[str, Any]:
        proc = subprocess.run([REHYDRATE, "status", "--json", "--socket", self.sock,
                               "--expect-pid", str(self.pid)],
                              check=False, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        result: dict[str, Any] = json.loads(proc.stdout)
        return result

    def wait_ready(self, generation: int) -> dict[str, Any]:
        deadline = time.monotonic() + DEADLINE
        while True:
            status = self.status()
            if status["state"] == "ready" and status["generation"] == generation:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready at generation {generation}: {status}")
            time.sleep(0.05)

    def alive(self) -> bool:
        """Whether the workload's pid runs (a zombie or a reused pid does not count)."""
        try:
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes()
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return str(WORKLOAD).encode() in cmdline and state != "Z"

    def wait_gone(self) -> None:
        """Until the pid is free again: a restore needs the image's pid."""
        if self.proc is not None:
            self.proc.wait(timeout=DEADLINE)  # the original is our child: reap it
        deadline = time.monotonic() + DEADLINE
        while os.path.exists(f"/proc/{self.pid}"):  # a clone is reaped by init
            if time.monotonic() > deadline:
                raise AssertionError(f"pid {self.pid} still exists")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)

    def kill_all(self) -> None:
        pids = {self.pid, *(r["pid"] for r in self.records())} - {0}
        for pid in pids:
            try:
                if str(WORKLOAD).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=DEADLINE)

    def output(self) -> str:
        return "".join(f"{p.name}:\n{p.read_text(errors='replace')}\n"
                       for p in sorted(self.dir.glob("std*")))

    @staticmethod
    def _log(path: Path) -> str:
        if not path.exists():
            return ""
        return "\n".join(line for line in path.read_text(errors="replace").splitlines()
                         if line.startswith(("Error", "Warn", "rehydrate")))


@pytest.fixture
def workload(criu: str, tmp_path: Path) -> Iterator[Workload]:
    w = Workload(criu, tmp_path)
    try:
        yield w
    finally:
        w.kill_all()


def _timens_offset(pid: int) -> float:
    """The monotonic offset of the time namespace ``pid`` runs in, in seconds."""
    for line in Path(f"/proc/{pid}/timens_offsets").read_text().splitlines():
        name, secs, nsecs = line.split()
        if name == "monotonic":
            return int(secs) + int(nsecs) / 1e9
    raise AssertionError("no monotonic offset")


def test_dump_and_two_restores_run_each_hook_kind_once(workload: Workload) -> None:
    started = workload.start()
    pid = started["pid"]

    img = workload.dump()
    saves = [r for r in workload.records() if r["kind"] == "before_snapshot"]
    assert [(r["generation"], r["pid"]) for r in saves] == [(0, pid)]
    workload.wait_gone()  # a dump without --leave-running kills the process

    clone_ids = []
    for clone in (1, 2):
        workload.restore(img)  # returns after post-resume's `rehydrate notify restore`
        status = workload.wait_ready(generation=1)
        assert status["entropy"]["instance_id"] not in {started["instance_id"], *clone_ids}
        restores = [r for r in workload.records() if r["kind"] == "restore"]
        assert len(restores) == clone, restores  # once per clone, however it was noticed
        run = restores[-1]
        assert (run["generation"], run["pid"]) == (1, pid), run
        # the notice (post-resume) or the clock-jump detector, whichever came first
        assert run["reason"] in ("control", "clock-jump"), run
        assert run["instance_id"] == status["entropy"]["instance_id"]
        clone_ids.append(run["instance_id"])
        assert not [r for r in workload.records() if r["kind"] == "resume"]
        # CRIU restored the clone into its own time namespace whose monotonic offset
        # takes back the time since the dump: its CLOCK_MONOTONIC does not jump.
        assert run["timens"] != started["timens"], run
        assert _timens_offset(pid) < 0
        assert run["mono"] - saves[0]["mono"] < run["wall"] - saves[0]["wall"]
        workload.kill()
        workload.wait_gone()
    assert len(set(clone_ids)) == 2


def test_leave_running_original_is_ready_again_by_itself(workload: Workload) -> None:
    started = workload.start(ballast_mb=BALLAST_MB)
    workload.dump("--leave-running")
    # No `rehydrate notify resume` by hand: the post-dump `resume` the action script
    # queued, or the clock-jump detector (the freeze is over the threshold), whichever the
    # original handles first, ends the pending snapshot; the other is the same event.
    _ready_again_once(workload, started)
    runs = [r for r in workload.records() if r["kind"] in ("restore", "resume")]
    if runs[0]["reason"] == "clock-jump":
        assert runs[0]["frozen_for"] > 0.1, runs  # the dump's freeze, over the threshold
    assert runs[0]["timens"] == started["timens"]  # the original: no new namespace


def test_leave_running_of_a_small_process_is_ready_again_by_itself(
        workload: Workload) -> None:
    """A small process's dump freezes it for about 50 ms here, under the clock-jump
    detector's pending threshold: before post-dump sent `resume`, the original stayed
    ``snapshotting`` (a gated server answering 503) until the 300 s snapshot deadline,
    unless `rehydrate notify resume` was run by hand after the dump. Now it is ready
    again within moments, its hooks run once; a `notify resume` by hand after that is
    the same event and runs nothing."""
    started = workload.start()
    workload.dump("--leave-running")
    status = _ready_again_once(workload, started)
    proc = subprocess.run([REHYDRATE, "notify", "resume", "--json", "--socket", workload.sock,
                           "--expect-pid", str(started["pid"])],
                          check=False, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert json.loads(proc.stdout)["deduplicated"] is True, proc.stdout
    runs = [r for r in workload.records() if r["kind"] in ("restore", "resume")]
    assert len(runs) == 1, runs
    assert workload.status()["generation"] == status["generation"]


def _ready_again_once(workload: Workload, started: dict[str, Any]) -> dict[str, Any]:
    """After a ``--leave-running`` dump: the original is ready again within
    :data:`DEADLINE` with no notice by hand, its before-snapshot hooks ran once and the
    resume (or, for a freeze the clock-jump detector saw, restore) hooks once."""
    saves = [r for r in workload.records() if r["kind"] == "before_snapshot"]
    assert [(r["generation"], r["pid"]) for r in saves] == [(0, started["pid"])]
    deadline = time.monotonic() + DEADLINE
    while True:
        status = workload.status()
        if status["state"] == "ready":
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"the original is not ready again: {status}")
        time.sleep(0.05)
    runs = [r for r in workload.records() if r["kind"] in ("restore", "resume")]
    assert [(r["kind"], r["reason"], r["generation"]) for r in runs] in (
        [("resume", "control", 0)], [("restore", "clock-jump", 1)]), runs
    assert status["generation"] == runs[0]["generation"]
    assert status["entropy"]["instance_id"] == runs[0]["instance_id"]
    if runs[0]["kind"] == "resume":  # the original, resumed: same instance as before
        assert runs[0]["instance_id"] == started["instance_id"]
    else:  # taken for a restore (no word from the platform came first): a new instance
        assert runs[0]["instance_id"] != started["instance_id"]
        # (a loaded machine can stretch even a small process's freeze over the threshold)
    # The post-dump `resume` came through: it ran the hooks, or, read after the
    # clock-jump detector's run, only confirmed it (and ran nothing).
    deadline = time.monotonic() + DEADLINE
    while True:
        last = workload.status()["last_report"]
        if last["reason"] == "control" or "control" in last["confirmed_by"]:
            break
        assert time.monotonic() < deadline, f"no post-dump resume: {last}"
        time.sleep(0.05)
    runs = [r for r in workload.records() if r["kind"] in ("restore", "resume")]
    assert len(runs) == 1, runs
    assert workload.alive()
    return status
