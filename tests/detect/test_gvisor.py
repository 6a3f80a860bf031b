"""The gVisor checkpoint waiter against real stand-ins of /proc/gvisor.

* Waiter tests: ``checkpoint`` is a FIFO, as the gVisor test harness emulates it; the
  test plays gVisor by opening the FIFO for writing and writing one answer line.
* Trigger tests: ``checkpoint`` is a symlink to a pseudo-terminal slave, a character
  device like gVisor's file: a ``1`` written to it arrives at the master side (the fake
  platform), and what the platform writes to the master is what reads of the file return.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from detect_helpers import FakePlatform, wait_for

from rehydrate import Lifecycle, Registry
from rehydrate._trigger import trigger_snapshot
from rehydrate.detect import gvisor
from rehydrate.detect.gvisor import (
    ANNOTATION,
    GVisorDetector,
    GVisorError,
    TriggerNotPermitted,
)
from rehydrate.env import EnvRefresher

DEADLINE = 5.0


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    d = tmp_path / "gvisor"
    d.mkdir()
    os.mkfifo(d / "checkpoint")
    (d / "spec_environ").write_bytes(b"RHT_GV_A=1\0RHT_GV_B=2\0")
    return d


@pytest.fixture
def engine(proc: Path, rehydrate_environ: None) -> Iterator[Lifecycle]:
    eng = Lifecycle(Registry(), env=EnvRefresher(path=str(proc / "spec_environ")))
    yield eng
    eng.close()


class Recorder:
    """Restore/snapshot hooks that remember what ran; ``wait(n)`` blocks for n calls."""

    def __init__(self, eng: Lifecycle) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.cond = threading.Condition()

        def on_restore(ctx):  # type: ignore[no-untyped-def]
            self._add(("restore-hook", ctx.kind, ctx.generation, ctx.reason, ctx.env_changes))

        def on_snapshot(ctx):  # type: ignore[no-untyped-def]
            self._add(("snapshot-hook", ctx.kind, ctx.generation, ctx.reason, None))

        eng.registry.after_restore(on_restore, name="rec")
        eng.registry.before_snapshot(on_snapshot, name="rec-snap")

    def _add(self, item) -> None:  # type: ignore[no-untyped-def]
        with self.cond:
            self.calls.append(item)
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = DEADLINE) -> list:  # type: ignore[type-arg]
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.calls) >= n, timeout), (
                f"expected {n} hook calls, got {self.calls}")
            return list(self.calls)


def start_waiter(eng: Lifecycle, proc: Path) -> GVisorDetector:
    waiter = GVisorDetector(str(proc))
    assert eng.start([waiter]) == ["gvisor"]
    wait_for(lambda: waiter.status()["waiting"], what="the waiter to open the checkpoint file")
    return waiter


def open_writer(path: str) -> int:
    """Connect to the FIFO as gVisor's writer as soon as a reader is there. "waiting" is
    announced just before the waiter's open() of the FIFO, so until that thread runs
    again there may be no reader yet: ENXIO, on a loaded machine for a while."""
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def answer(waiter: GVisorDetector, data: bytes, *, after: int | None = None) -> None:
    """Play gVisor: wait until the waiter has the FIFO open (for a fresh checkpoint), write."""
    seq = waiter.status()["answers"] if after is None else after
    wait_for(lambda: waiter.status()["waiting"] and waiter.status()["answers"] >= seq,
             what="the waiter to be waiting")
    fd = open_writer(waiter.path)
    try:
        if data:
            os.write(fd, data)
    finally:
        os.close(fd)


# -- answers ---------------------------------------------------------------------------


def test_restore_answer_runs_restore_hooks(engine: Lifecycle, proc: Path) -> None:
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    answer(waiter, b"restore\n")
    (call,) = rec.wait(1)
    assert call[:4] == ("restore-hook", "restore", 1, "gvisor")
    wait_for(lambda: engine.status().last_report is not None)
    report = engine.status().last_report
    assert report is not None and report.ok and report.reason == "gvisor"
    assert engine.status().generation == 1
    assert waiter.status()["last_answer"] == "restore"


def test_resume_answer_runs_resume_hooks(engine: Lifecycle, proc: Path) -> None:
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    answer(waiter, b"resume\n")
    (call,) = rec.wait(1)
    assert call[:4] == ("restore-hook", "resume", 0, "gvisor")
    assert engine.status().generation == 0


def test_error_answer_logs_failed_checkpoint_and_resumes(
    engine: Lifecycle, proc: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rehydrate")
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    answer(waiter, b"error\n")
    (call,) = rec.wait(1)
    assert call[:2] == ("restore-hook", "resume")
    failed = [r for r in caplog.records if "checkpoint failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING


def test_an_error_answer_does_not_hide_a_real_restore_right_after(
    engine: Lifecycle, proc: Path
) -> None:
    """``error``: the checkpoint failed and nothing froze, so its carry-on resume is no
    freeze anchor (as the docs say of carry-on runs): a clock-jump notice whose freeze
    began before that answer — a real checkpoint retried at once — still runs the
    restore hooks instead of being taken for the failed checkpoint's resume."""
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    before = time.monotonic()  # the clock-jump thread's last look before the freeze
    answer(waiter, b"error\n")
    rec.wait(1)
    engine.restore_detected("clock-jump", since=before)
    calls = rec.wait(2)
    assert [(c[1], c[3]) for c in calls] == [("resume", "gvisor"), ("restore", "clock-jump")]
    assert engine.status().generation == 1


def test_answer_without_newline_then_eof(engine: Lifecycle, proc: Path) -> None:
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    answer(waiter, b"restore")
    assert rec.wait(1)[0][:2] == ("restore-hook", "restore")


@pytest.mark.parametrize(
    ("data", "expect"),
    [
        (b"bogus\n", "unknown answer"),
        (b"", "no answer (end of file"),
        (b"\n\n", "empty answer"),
        (b"\xff\xfe garbage\n", "unknown answer"),
        (b"x" * 5000, "without a newline"),
    ],
)
def test_garbage_answers_log_one_line_and_waiter_carries_on(
    engine: Lifecycle, proc: Path, caplog: pytest.LogCaptureFixture, data: bytes, expect: str
) -> None:
    caplog.set_level(logging.INFO, logger="rehydrate")
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    before = waiter.status()["answers"]
    opens = waiter.status()["opens"]
    answer(waiter, data)
    wait_for(lambda: any(expect in r.getMessage() for r in caplog.records),
             what="the error line")
    # Done with that writer's bytes: the waiter opened the FIFO again.
    wait_for(lambda: waiter.status()["opens"] > opens, what="the waiter to re-open")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert str(proc / "checkpoint") in errors[0].getMessage()
    assert rec.calls == []  # nothing ran for garbage
    # The waiter re-opened and handles the next checkpoint normally.
    answer(waiter, b"restore\n", after=before)
    assert rec.wait(1)[0][:3] == ("restore-hook", "restore", 1)
    assert engine.status().generation == 1


def test_eof_without_data_does_not_spin(engine: Lifecycle, proc: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rehydrate")
    waiter = start_waiter(engine, proc)
    answer(waiter, b"")  # a writer that opens and closes without writing
    wait_for(lambda: caplog.records, what="the error line")
    wait_for(lambda: waiter.status()["waiting"], what="the waiter to re-open")
    cpu0 = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - cpu0 < 0.05
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


def test_repeated_checkpoints(engine: Lifecycle, proc: Path) -> None:
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    sequence = [b"restore\n", b"resume\n", b"restore\n", b"error\n", b"restore\n", b"resume\n"]
    for i, data in enumerate(sequence):
        answer(waiter, data)
        rec.wait(i + 1)
    kinds = [(c[1], c[2]) for c in rec.calls]
    assert kinds == [("restore", 1), ("resume", 1), ("restore", 2), ("resume", 2),
                     ("restore", 3), ("resume", 3)]
    wait_for(lambda: waiter.status()["answers"] == len(sequence), what="all answers counted")


def test_two_answers_in_one_read_are_two_checkpoints(engine: Lifecycle, proc: Path) -> None:
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    answer(waiter, b"restore\nrestore\n")
    rec.wait(2)
    assert engine.status().generation == 2


def test_writer_that_stays_connected_is_a_stream_of_answers(
    engine: Lifecycle, proc: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO writer may keep the FIFO open and write one line per checkpoint."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    fd = open_writer(waiter.path)
    answered = 0
    try:
        for data in [b"restore\n", b"bogus\n", b"x" * 600, b"yyy\n", b"res", b"ume\n",
                     b"restore\n"]:
            wait_for(lambda: waiter.status()["waiting"], what="the waiter to wait")
            os.write(fd, data)
            if data in (b"restore\n", b"ume\n"):
                # Counted here, not from rec.calls after the write: the hook may already
                # have run by then, and waiting for one call more would wait for ever.
                answered += 1
                rec.wait(answered)
    finally:
        os.close(fd)
    assert [c[1:3] for c in rec.calls] == [("restore", 1), ("resume", 1), ("restore", 2)]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    # (600 bytes without a newline: "without a newline", or, when the reads coalesce
    # the next write, an unknown 604-byte answer; one line either way.)
    assert len(errors) == 2 and "bogus" in errors[0] and "xxxxxxxx" in errors[1]
    # The writer left after answering: that is no error, the waiter just re-opens.
    wait_for(lambda: waiter.status()["waiting"])
    answer(waiter, b"restore\n")
    rec.wait(4)
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 2


def test_regular_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 rehydrate_environ: None) -> None:
    (tmp_path / "checkpoint").write_text("restore\n")
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path))
    why = GVisorDetector.probe()
    assert not why.usable and "regular file" in why.reason
    eng = Lifecycle(Registry(), env=EnvRefresher(path=None))
    try:
        with pytest.raises(GVisorError, match="regular file"):
            GVisorDetector(str(tmp_path)).start(eng)
        assert "gvisor" not in eng.start("auto")
        assert eng.status().generation == 0
    finally:
        eng.close()


def test_spec_environ_changes_applied_on_restore(engine: Lifecycle, proc: Path) -> None:
    os.environ["RHT_GV_A"] = "1"
    os.environ["RHT_GV_B"] = "2"
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)  # baseline: A, B come from spec_environ
    (proc / "spec_environ").write_bytes(
        b"RHT_GV_A=1\0RHT_GV_C=new\0RHT_GV_A=changed\0")  # last A wins
    answer(waiter, b"restore\n")
    call = rec.wait(1)[0]
    changes = call[4]
    assert changes.added == ("RHT_GV_C",)
    assert changes.changed == ("RHT_GV_A",)
    assert changes.removed == ("RHT_GV_B",)
    assert os.environ["RHT_GV_A"] == "changed"
    assert os.environ["RHT_GV_C"] == "new"
    assert "RHT_GV_B" not in os.environ
    wait_for(lambda: engine.status().last_report is not None, what="the report")
    report = engine.status().last_report
    assert report is not None and report.env_changes == changes


def test_clock_jump_notice_of_the_same_restore_runs_hooks_once(
    engine: Lifecycle, proc: Path
) -> None:
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    # Another detector (the clock jump) sees the restore first...
    engine.restore_detected("clock-jump", since=time.monotonic() - 1.0)
    rec.wait(1)
    # ... then gVisor's answer for the same checkpoint arrives: a duplicate.
    answer(waiter, b"restore\n")
    wait_for(lambda: waiter.status()["answers"] == 1)
    assert len(rec.calls) == 1 and rec.calls[0][3] == "clock-jump"
    assert engine.status().generation == 1
    # The next checkpoint is a new event again.
    answer(waiter, b"restore\n")
    rec.wait(2)
    assert engine.status().generation == 2


def test_stop_is_prompt_and_closes_everything(engine: Lifecycle, proc: Path) -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    waiter = start_waiter(engine, proc)
    thread = waiter._thread
    assert thread is not None
    t0 = time.monotonic()
    engine.stop()
    # Prompt: woken by its stop pipe, not left to the 5 s join timeout (0.5 s here was
    # a loaded 2-core box's scheduling latency, not the waiter's).
    assert time.monotonic() - t0 < 2.0
    assert not thread.is_alive()
    assert len(os.listdir("/proc/self/fd")) <= fds_before


_IDLE_CHILD = """
import json, os, sys, threading, time
from rehydrate import Lifecycle, Registry
from rehydrate.env import EnvRefresher
from rehydrate.detect.gvisor import GVisorDetector
eng = Lifecycle(Registry(), env=EnvRefresher(path=None))
waiter = GVisorDetector(sys.argv[1])
eng.start([waiter])
while not waiter.status()["waiting"]:
    time.sleep(0.001)
clock = time.pthread_getcpuclockid(waiter._thread.ident)
t0, c0 = time.clock_gettime(clock), time.process_time()
time.sleep(1.0)  # measuring CPU over one second of waiting
print(json.dumps({"thread": time.clock_gettime(clock) - t0, "process": time.process_time() - c0}))
eng.close()
"""


def test_idle_waiter_uses_no_cpu(proc: Path) -> None:
    # A fresh process, so that no other test's threads are counted.
    out = subprocess.run([sys.executable, "-c", _IDLE_CHILD, str(proc)], capture_output=True,
                         text=True, timeout=60, check=True)
    used = json.loads(out.stdout)
    assert used["process"] < 0.010, f"{used['process'] * 1000:.2f} ms CPU in 1 s while waiting"
    assert used["thread"] < 0.001, f"waiter thread used {used['thread'] * 1000:.3f} ms"


def test_probe_explains_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path / "nope"))
    why = GVisorDetector.probe()
    assert not why.usable and str(tmp_path / "nope") in why.reason
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path))
    why = GVisorDetector.probe()
    assert not why.usable and "no checkpoint file" in why.reason
    monkeypatch.delenv("REHYDRATE_GVISOR_PROC")
    if not os.path.exists("/proc/gvisor/checkpoint"):
        why = GVisorDetector.probe()
        assert not why.usable and "not running under gVisor" in why.reason
    os.mkfifo(tmp_path / "checkpoint")
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path))
    assert GVisorDetector.probe().usable


def test_auto_start_picks_the_waiter(proc: Path, monkeypatch: pytest.MonkeyPatch,
                                     rehydrate_environ: None) -> None:
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(proc))
    eng = Lifecycle(Registry(), env=EnvRefresher(path=None))
    try:
        names = eng.start("auto")
        assert "gvisor" in names
        waiter = eng.detector("gvisor")
        assert isinstance(waiter, GVisorDetector) and waiter.path == str(proc / "checkpoint")
    finally:
        eng.close()


# -- trigger_snapshot --------------------------------------------------------------------


CARRIED_ON = [("snapshot-hook", "snapshot"), ("restore-hook", "resume")]
"""The calls of a trigger that failed after the before-snapshot hooks: the resume hooks ran."""


@pytest.fixture
def pty_proc(tmp_path: Path) -> Path:
    d = tmp_path / "gvisor-pty"
    d.mkdir()
    (d / "spec_environ").write_bytes(b"RHT_GV_A=1\0")
    return d


@pytest.fixture
def iso_engine(rehydrate_environ: None) -> Iterator[Lifecycle]:
    eng = Lifecycle(Registry(), env=EnvRefresher(path=None))
    yield eng
    eng.close()


@pytest.mark.parametrize("reply", [b"restore\n", b"resume\n", b"error\n"])
def test_trigger_without_waiter(iso_engine: Lifecycle, pty_proc: Path, reply: bytes) -> None:
    platform = FakePlatform(pty_proc, reply)
    try:
        rec = Recorder(iso_engine)
        result = trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=DEADLINE)
    finally:
        platform.close()
    expected = reply.strip().decode()
    assert result == expected
    assert platform.triggers == [b"1"]
    kind = "restore" if expected == "restore" else "resume"
    assert [c[:2] for c in rec.calls] == [("snapshot-hook", "snapshot"), ("restore-hook", kind)]
    assert rec.calls[1][3] == "gvisor"


def test_trigger_with_running_waiter_runs_hooks_once(iso_engine: Lifecycle,
                                                     pty_proc: Path) -> None:
    platform = FakePlatform(pty_proc, b"restore\n")
    try:
        rec = Recorder(iso_engine)
        start_waiter(iso_engine, pty_proc)
        assert trigger_snapshot(iso_engine, timeout=DEADLINE) == "restore"
        # trigger_snapshot returned after the hooks ran, and they ran once.
        assert [c[:2] for c in rec.calls] == [("snapshot-hook", "snapshot"),
                                              ("restore-hook", "restore")]
        assert iso_engine.status().generation == 1
        assert platform.triggers == [b"1"]
        # The waiter carries on for the next checkpoint.
        assert trigger_snapshot(iso_engine, timeout=DEADLINE) == "restore"
        assert iso_engine.status().generation == 2
    finally:
        iso_engine.stop()
        platform.close()


def test_trigger_eperm_names_the_annotation(iso_engine: Lifecycle, pty_proc: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    platform = FakePlatform(pty_proc)
    real_open = os.open

    def fake_open(path, flags, *a):  # type: ignore[no-untyped-def]
        if str(path).endswith("checkpoint") and flags & os.O_ACCMODE == os.O_WRONLY:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(gvisor.os, "open", fake_open)
    try:
        rec = Recorder(iso_engine)
        with pytest.raises(TriggerNotPermitted) as info:
            trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=DEADLINE)
    finally:
        monkeypatch.undo()
        platform.close()
    assert ANNOTATION in str(info.value)
    assert "dev.gvisor.internal.checkpoint.enable=true" in str(info.value)
    assert isinstance(info.value, PermissionError)
    assert rec.calls == [] and platform.triggers == []


def test_trigger_with_failing_snapshot_hook_does_not_checkpoint(
    iso_engine: Lifecycle, pty_proc: Path
) -> None:
    platform = FakePlatform(pty_proc)
    try:
        rec = Recorder(iso_engine)

        @iso_engine.registry.before_snapshot(name="boom")
        def boom() -> None:
            raise RuntimeError("cannot close")

        assert trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=DEADLINE) == "error"
    finally:
        platform.close()
    assert platform.triggers == []
    assert ("restore-hook", "resume") in [c[:2] for c in rec.calls]


def test_trigger_times_out_without_answer(iso_engine: Lifecycle, pty_proc: Path) -> None:
    platform = FakePlatform(pty_proc, reply=None)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=0.3)
        assert time.monotonic() - t0 < 2
    finally:
        platform.close()
    assert platform.triggers == [b"1"]


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0, -1.0, 1e12, True, "5"])
def test_a_bad_trigger_timeout_is_refused_before_anything_runs(
        iso_engine: Lifecycle, pty_proc: Path, timeout: object) -> None:
    ran: list[int] = []
    iso_engine.registry.before_snapshot(name="app")(lambda: ran.append(1))
    platform = FakePlatform(pty_proc, reply=b"resume")
    try:
        with pytest.raises(ValueError, match="seconds|at most"):
            trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=timeout)  # type: ignore[arg-type]
    finally:
        platform.close()
    assert ran == [] and platform.triggers == []


def test_trigger_refuses_a_fifo_and_a_missing_file(iso_engine: Lifecycle, proc: Path,
                                                   tmp_path: Path) -> None:
    with pytest.raises(GVisorError, match="FIFO"):
        trigger_snapshot(iso_engine, proc=str(proc))
    missing = str(tmp_path / "missing")
    # the path came from the argument: the message named REHYDRATE_GVISOR_PROC, unset
    with pytest.raises(GVisorError) as info:
        trigger_snapshot(iso_engine, proc=missing)
    assert str(info.value) == (f"{missing}/checkpoint not found "
                               f"(trigger_snapshot(proc={missing!r}))")
    with pytest.raises(GVisorError) as info:
        GVisorDetector(missing).start(iso_engine)
    assert str(info.value) == f"{missing}/checkpoint not found (GVisorDetector(proc={missing!r}))"


# -- review fixes: freeze anchors, arming, no stuck "snapshotting" -------------------------


def test_simulated_restore_does_not_hide_a_real_restore_answer(engine: Lifecycle,
                                                                proc: Path) -> None:
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)  # its descriptor (its `since`) is older than...
    engine.simulate_restore()  # ... an operator's simulate (or a carry-on resume)
    answer(waiter, b"restore\n")  # a real checkpoint later: this process is a clone
    calls = rec.wait(2)
    assert [c[3] for c in calls] == ["simulated", "gvisor"]
    assert engine.status().generation == 2


def test_long_open_descriptor_does_not_swallow_a_later_restore(
    engine: Lifecycle, proc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gvisor, "ANSWER_WINDOW", 0.2)
    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)
    # A restore only the clock jump saw (or a false alarm) while the descriptor is open.
    engine.restore_detected("clock-jump", since=time.monotonic() - 1.0)
    rec.wait(1)
    handled = engine.last_restore_at
    assert handled is not None
    wait_for(lambda: time.monotonic() > handled + 0.4, what="the window to pass")
    answer(waiter, b"restore\n")  # gVisor's answer for a later, real restore
    calls = rec.wait(2)
    assert [c[3] for c in calls] == ["clock-jump", "gvisor"]
    assert engine.status().generation == 2


def _slow_waiter_open(monkeypatch: pytest.MonkeyPatch, delay: float,
                      events: list[tuple[str, float]]) -> None:
    real_open, real_write = os.open, os.write

    def slow_open(path, flags, *a):  # type: ignore[no-untyped-def]
        if (str(path).endswith("checkpoint") and flags == gvisor._OPEN_READ
                and threading.current_thread().name == "rehydrate-gvisor"):
            time.sleep(delay)  # the waiter thread is slow to get into open()
            fd = real_open(path, flags, *a)
            events.append(("waiter-opened", time.monotonic()))
            return fd
        return real_open(path, flags, *a)

    def rec_write(fd, data):  # type: ignore[no-untyped-def]
        if data == b"1":
            events.append(("trigger-wrote-1", time.monotonic()))
        return real_write(fd, data)

    monkeypatch.setattr(gvisor.os, "open", slow_open)
    monkeypatch.setattr(gvisor.os, "write", rec_write)


def test_trigger_waits_until_the_waiter_descriptor_exists(
    iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On gVisor a descriptor opened after the ``1`` is registered for the NEXT checkpoint:
    the waiter must be armed only once open() returned."""
    platform = FakePlatform(pty_proc, b"restore\n")
    events: list[tuple[str, float]] = []
    try:
        _slow_waiter_open(monkeypatch, 0.3, events)
        iso_engine.start([GVisorDetector(str(pty_proc))])
        assert trigger_snapshot(iso_engine, timeout=DEADLINE) == "restore"
    finally:
        iso_engine.stop()
        monkeypatch.undo()
        platform.close()
    order = [e[0] for e in sorted(events, key=lambda e: e[1])]
    assert order[:2] == ["waiter-opened", "trigger-wrote-1"], events


def test_trigger_timeout_without_waiter_runs_resume_hooks(iso_engine: Lifecycle,
                                                           pty_proc: Path) -> None:
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        with pytest.raises(TimeoutError, match="resume hooks ran"):
            trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=0.3)
    finally:
        platform.close()
    assert [c[:2] for c in rec.calls] == CARRIED_ON
    assert iso_engine.state == "ready" and iso_engine.is_ready()
    assert iso_engine.last_restore_at is None, "no checkpoint seen: not a freeze anchor"


# "garbage\nrestore": the first line is the answer (as the running waiter takes it); a
# later line was taken for it, and the clone's restore hooks ran after garbage.
@pytest.mark.parametrize("reply", [b"garbage\n", b"garbage\nrestore\n"])
def test_trigger_bad_answer_without_waiter_runs_resume_hooks(iso_engine: Lifecycle,
                                                              pty_proc: Path,
                                                              reply: bytes) -> None:
    platform = FakePlatform(pty_proc, reply=reply)
    try:
        rec = Recorder(iso_engine)
        with pytest.raises(GVisorError, match="unknown answer b'garbage'"):
            trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=DEADLINE)
    finally:
        platform.close()
    assert [c[:2] for c in rec.calls] == CARRIED_ON
    assert iso_engine.is_ready()
    assert iso_engine.status().generation == 0


@pytest.mark.parametrize("after", [b"restore\n", b"x" * 300 + b"\n"],
                         ids=["another-answer", "a-long-line"])
def test_trigger_without_waiter_takes_the_first_line_for_the_answer(
        iso_engine: Lifecycle, pty_proc: Path, caplog: pytest.LogCaptureFixture,
        after: bytes) -> None:
    """What follows the first line is ignored, however long (a read returning more than
    an answer's length was "bytes without a newline", the answer in it refused)."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    platform = FakePlatform(pty_proc, reply=b"resume\n" + after)
    try:
        rec = Recorder(iso_engine)
        assert trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=DEADLINE) == "resume"
    finally:
        platform.close()
    assert [c[:2] for c in rec.calls] == CARRIED_ON
    assert iso_engine.status().generation == 0
    assert any(f"gave more after its answer: b'{after[:7].decode()}" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


def test_trigger_waiter_never_armed_runs_resume_hooks(
    iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    platform = FakePlatform(pty_proc, b"restore\n")
    events: list[tuple[str, float]] = []
    try:
        rec = Recorder(iso_engine)
        _slow_waiter_open(monkeypatch, 1.0, events)
        iso_engine.start([GVisorDetector(str(pty_proc))])
        with pytest.raises(TimeoutError, match="did not open"):
            trigger_snapshot(iso_engine, timeout=0.2)
        assert platform.triggers == [], "no 1 written: no checkpoint"
        assert [c[:2] for c in rec.calls] == CARRIED_ON
        assert iso_engine.is_ready()
    finally:
        iso_engine.stop()
        monkeypatch.undo()
        platform.close()


def test_trigger_answer_timeout_with_waiter_leaves_hooks_to_the_late_answer(
    iso_engine: Lifecycle, pty_proc: Path
) -> None:
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        start_waiter(iso_engine, pty_proc)
        with pytest.raises(TimeoutError):
            trigger_snapshot(iso_engine, timeout=0.3)
        assert platform.triggers == [b"1"]
        # The checkpoint may still be under way: no resume yet, the waiter will answer.
        assert iso_engine.state == "snapshotting"
        assert [c[:2] for c in rec.calls] == [("snapshot-hook", "snapshot")]
        os.write(platform.master, b"resume\n")  # the late answer
        assert iso_engine.wait_ready(timeout=DEADLINE)
        assert [c[:2] for c in rec.calls] == CARRIED_ON
    finally:
        iso_engine.stop()
        platform.close()


def test_answers_written_back_to_back_are_never_lost(engine: Lifecycle, proc: Path) -> None:
    """A FIFO writer may come while the waiter is between the previous answer's end of
    file and re-opening; the answer must not vanish with the descriptor being closed."""
    rec = Recorder(engine)
    start_waiter(engine, proc)
    path = str(proc / "checkpoint")
    n = 100
    for i in range(n):
        fd = open_writer(path)  # as soon as a reader exists, not once the waiter re-opened
        try:
            os.write(fd, b"resume\n")
        finally:
            os.close(fd)
        rec.wait(i + 1)
    assert [c[1] for c in rec.calls] == ["resume"] * n


def test_an_answer_written_while_the_waiter_closes_its_descriptor_is_kept(
        engine: Lifecycle, proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic version of the race above: a writer connects and answers exactly
    when the waiter is closing the descriptor that just gave it end of file."""
    rec = Recorder(engine)
    path = str(proc / "checkpoint")
    fifo_ino = os.stat(path).st_ino
    real_close = os.close
    injected: list[bool] = []

    def close(fd: int) -> None:
        if (not injected and threading.current_thread().name == "rehydrate-gvisor"
                and os.fstat(fd).st_ino == fifo_ino):
            injected.append(True)
            w = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # a reader still exists
            os.write(w, b"restore\n")
            real_close(w)
        real_close(fd)

    monkeypatch.setattr(os, "close", close)
    waiter = start_waiter(engine, proc)
    answer(waiter, b"resume\n")
    calls = rec.wait(2)
    assert injected and [c[1] for c in calls] == ["resume", "restore"]


def test_trigger_bad_answer_with_a_running_waiter_fails_and_runs_resume_hooks(
        iso_engine: Lifecycle, pty_proc: Path) -> None:
    """The waiter logged the garbage answer but never told the trigger: it waited for
    ever (``rehydrate trigger`` hung) and the process stayed ``snapshotting``."""
    platform = FakePlatform(pty_proc, reply=b"garbage\n")
    try:
        rec = Recorder(iso_engine)
        start_waiter(iso_engine, pty_proc)
        done = concurrent.futures.ThreadPoolExecutor(1).submit(trigger_snapshot, iso_engine)
        with pytest.raises(GVisorError, match="gave unknown answer b'garbage' after the trig"):
            done.result(timeout=DEADLINE)  # no timeout given to trigger_snapshot itself
        assert [c[:2] for c in rec.calls] == CARRIED_ON
        assert iso_engine.is_ready()
    finally:
        iso_engine.stop()
        platform.close()


@pytest.mark.parametrize(("data", "kinds", "line"), [
    (b"resume\nrestore\n", ["resume"], "gave more after its answer resume: b'restore'"),
    (b"x\n" * 20, [], "gave unknown answer b'x'"),
])
def test_one_read_of_the_checkpoint_file_is_one_answer(
        iso_engine: Lifecycle, pty_proc: Path, caplog: pytest.LogCaptureFixture,
        data: bytes, kinds: list[str], line: str) -> None:
    """gVisor answers a descriptor once: every line of its read was taken for an answer,
    so "resume\nrestore" also ran the restore hooks (a new generation in the original)
    and a garbage read logged an error line per line."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    platform = FakePlatform(pty_proc, reply=None)  # the answers are written below
    try:
        rec = Recorder(iso_engine)
        waiter = start_waiter(iso_engine, pty_proc)
        os.write(platform.master, data)
        wait_for(lambda: waiter.status()["opens"] >= 2, what="the waiter to open again")
        assert [c[1] for c in rec.calls] == kinds
        assert iso_engine.status().generation == 0
        assert waiter.status()["answers"] == 1
        problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(problems) == 1 and line in problems[0], problems
        os.write(platform.master, b"restore\n")  # the next checkpoint's, as usual
        assert rec.wait(len(kinds) + 1)[-1][1:3] == ("restore", 1)
    finally:
        iso_engine.stop()
        platform.close()


def test_no_checkpoint_is_triggered_once_the_timeout_has_passed(iso_engine: Lifecycle,
                                                                pty_proc: Path) -> None:
    """Before-snapshot hooks that used up the timeout: the 1 was still written — a
    checkpoint went ahead while the caller was told it timed out and the resume hooks
    reopened everything."""
    platform = FakePlatform(pty_proc, reply=b"restore\n")
    release = threading.Event()
    iso_engine.registry.before_snapshot(name="slow")(lambda: release.wait(0.6))
    try:
        rec = Recorder(iso_engine)
        with pytest.raises(TimeoutError, match="checkpoint not triggered"):
            trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=0.3)
    finally:
        platform.close()
    assert platform.triggers == []
    assert [c[:2] for c in rec.calls] == CARRIED_ON
    assert iso_engine.is_ready()


def test_trigger_refuses_a_regular_file_before_any_hook(iso_engine: Lifecycle,
                                                        tmp_path: Path) -> None:
    (tmp_path / "checkpoint").write_text("restore\n")
    rec = Recorder(iso_engine)
    with pytest.raises(GVisorError, match="is a regular file, not gVisor's checkpoint"):
        trigger_snapshot(iso_engine, proc=str(tmp_path), timeout=DEADLINE)
    assert rec.calls == [] and (tmp_path / "checkpoint").read_text() == "restore\n"


def test_a_directory_at_the_checkpoint_path_is_not_usable(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          rehydrate_environ: None) -> None:
    """It was "usable": the waiter then logged a read error with backoff for ever."""
    (tmp_path / "checkpoint").mkdir()
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path))
    why = GVisorDetector.probe()
    assert not why.usable and why.reason.endswith("is a directory, not gVisor's checkpoint "
                                                  "file")


def test_a_waiter_whose_thread_died_is_shown_in_status(engine: Lifecycle, proc: Path,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    def broken(self: GVisorDetector) -> bool:
        raise RuntimeError("a bug")

    monkeypatch.setattr(GVisorDetector, "_wait_once", broken)
    det = GVisorDetector(str(proc))
    assert engine.start([det]) == ["gvisor"]
    wait_for(lambda: det._exited, what="the waiter thread to end")
    errors = engine.status().to_dict()["detector_errors"]
    assert errors == {"gvisor": "its thread died: RuntimeError: a bug"}


def test_a_configured_stand_in_that_is_missing_is_a_loud_error(rehydrate_engine, tmp_path,
                                                               monkeypatch):
    """REHYDRATE_GVISOR_PROC pointing at no checkpoint file (a typo, a FIFO not made
    yet): start("auto") left the waiter out without a word, while the marker file and
    vmclock detectors report the same mistake."""
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path / "typo"))
    started = rehydrate_engine.start("auto")
    assert "gvisor" not in started
    errors = rehydrate_engine.status().to_dict()["detector_errors"]
    assert f"{tmp_path / 'typo' / 'checkpoint'} not found" in errors["gvisor"]
    rehydrate_engine.stop()

    from rehydrate.detect.gvisor import GVisorDetector
    env_only = tmp_path / "env-only"  # serves only spec_environ (the runsc bundle recipe)
    env_only.mkdir()
    (env_only / "spec_environ").write_bytes(b"A=1\0")
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(env_only))
    assert GVisorDetector.configured() is False
    (env_only / "checkpoint").write_text("")  # there but unusable: meant to be used
    assert GVisorDetector.configured() is True
    monkeypatch.delenv("REHYDRATE_GVISOR_PROC")
    assert GVisorDetector.configured() is False  # gVisor's own /proc/gvisor: only probed


def test_a_restart_while_the_stopped_thread_runs_a_hook_is_refused(engine: Lifecycle,
                                                                   proc: Path) -> None:
    """stop() that timed out (the thread still in a hook) and start() again: the second
    thread shared the first one's stop pipe and flags — two waiters, a leaked pipe and a
    stray thread. start() refuses until the first has ended, then works."""
    entered, release = threading.Event(), threading.Event()

    def slow_hook() -> None:
        entered.set()
        assert release.wait(10.0)

    engine.registry.after_restore(slow_hook, required=False, timeout=30)
    fds_before = set(os.listdir("/proc/self/fd"))
    waiter = GVisorDetector(str(proc))
    waiter.start(engine)
    answer(waiter, b"restore\n")
    assert entered.wait(DEADLINE), "the restore hook did not run"
    first = waiter._thread
    assert first is not None
    waiter.stop(timeout=0.05)  # gives up: the thread is in the hook
    assert first.is_alive()
    try:
        with pytest.raises(RuntimeError, match="previous thread is still running"):
            waiter.start(engine)
        assert [t for t in threading.enumerate() if t.name == "rehydrate-gvisor"] == [first]
    finally:
        release.set()
    first.join(DEADLINE)
    assert not first.is_alive()
    waiter.start(engine)  # the first has ended: a restart works
    second = waiter._thread
    assert second is not None
    waiter.stop()
    assert not second.is_alive()
    assert set(os.listdir("/proc/self/fd")) <= fds_before  # no pipe left behind


def test_a_trigger_refused_for_a_checkpoint_in_progress_leaves_its_pass_pending(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A platform's checkpoint ran its ``notify save`` pass right after the trigger's, and
    the trigger's write of ``1`` is refused (ENXIO: a checkpoint is already in progress).
    The trigger's carry-on is about its own pass, which a newer one followed: it runs
    nothing (before: the resume hooks undid the platform's pending pass, and that
    checkpoint captured everything reopened); the platform's own answer runs them."""
    platform = FakePlatform(pty_proc, reply=None)
    real_write = os.write

    def refused(fd: int, data: bytes) -> int:
        if data == b"1":
            assert iso_engine.snapshot_requested("control").ok  # the platform's pass
            raise OSError(errno.ENXIO, os.strerror(errno.ENXIO))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refused)
    try:
        rec = Recorder(iso_engine)
        with pytest.raises(GVisorError, match="already in progress"):
            trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=DEADLINE)
    finally:
        monkeypatch.undo()
        platform.close()
    assert [c for c in rec.calls if c[1] != "snapshot"] == []
    assert iso_engine.state == "snapshotting" and not iso_engine.is_ready()


@pytest.mark.parametrize("fault", ["open", "read"])
def test_trigger_open_or_read_failure_is_a_gvisor_error_naming_the_file(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch,
        fault: str) -> None:
    """Without a waiter, opening the file for the answer (EMFILE: the process ran out of
    descriptors) or reading it (EIO) raised a bare OSError ("[Errno 24] Too many open
    files", no path) where GVisorError is documented — and an EACCES would have looked
    like TriggerNotPermitted's base class to a caller catching PermissionError."""
    from rehydrate import _trigger

    platform = FakePlatform(pty_proc, b"restore\n")
    if fault == "open":
        real_open = os.open

        def failing_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
            if flags == gvisor._OPEN_READ and os.fspath(path).endswith("checkpoint"):
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", failing_open)
        expected = r"cannot open .*checkpoint for reading: Too many open files; resume"
    else:
        def failing_read(*args: object) -> bytes:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(_trigger, "_poll_read", failing_read)
        expected = r"reading the answer from .*checkpoint failed: Input/output error; resume"
    try:
        rec = Recorder(iso_engine)
        with pytest.raises(GVisorError, match=expected) as info:
            trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=DEADLINE)
        assert not isinstance(info.value, PermissionError)
    finally:
        monkeypatch.undo()
        platform.close()
    assert [c[:2] for c in rec.calls] == CARRIED_ON
    assert iso_engine.is_ready()


@pytest.mark.parametrize(("case", "frozen_for"), [
    ("before-snapshot hooks fail", 0.0),  # no checkpoint triggered
    ("answer file cannot be opened", 0.0),  # fails before the 1 is written
    ("answer cannot be read", None),  # after the 1: a checkpoint may have paused us
    ("error", None),  # gVisor says "error" before the pause and after it alike
    ("resume", None),  # a real checkpoint left running: frozen, for how long unknown
])
def test_trigger_resume_runs_say_whether_anything_froze(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch,
        case: str, frozen_for: float | None) -> None:
    """The carry-on resume runs of a trigger that never checkpointed had frozen_for None,
    like a real resume: hooks (the game's tick clock) took them for a freeze."""
    from rehydrate import _trigger

    reply = {"error": b"error\n", "resume": b"resume\n"}.get(case, b"restore\n")
    platform = FakePlatform(pty_proc, reply)
    if case == "before-snapshot hooks fail":
        @iso_engine.registry.before_snapshot(name="boom")
        def boom() -> None:
            raise RuntimeError("cannot close")

    elif case == "answer file cannot be opened":
        real_open = os.open

        def failing_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
            if flags == gvisor._OPEN_READ and os.fspath(path).endswith("checkpoint"):
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", failing_open)
    elif case == "answer cannot be read":
        def failing_read(*args: object) -> bytes:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(_trigger, "_poll_read", failing_read)
    try:
        with contextlib.suppress(GVisorError):
            trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=DEADLINE)
    finally:
        monkeypatch.undo()
        platform.close()
    last = iso_engine.status().last_report
    assert last.kind == "resume" and last.reason == "gvisor", last
    assert last.frozen_for == frozen_for


# -- a late answer of an earlier trigger after a newer trigger began --------------------

SNAP = ("snapshot-hook", "snapshot")
RESUMED = ("restore-hook", "resume")


def _timed_out_trigger(eng: Lifecycle, platform: FakePlatform) -> None:
    """Trigger 1: its ``1`` written, no answer within its timeout; the running waiter's
    descriptor will get checkpoint 1's late answer."""
    with pytest.raises(TimeoutError):
        trigger_snapshot(eng, timeout=0.3)
    assert b"".join(platform.triggers) == b"1"
    assert eng.state == "snapshotting"


def _second_trigger_pending(eng: Lifecycle, platform: FakePlatform, rec: Recorder,
                            pool: concurrent.futures.ThreadPoolExecutor, *,
                            calls_before: int) -> concurrent.futures.Future[str]:
    """Trigger 2 in the background, up to its ``1``: its checkpoint is pending, so the
    process is not ready and no resume hook ran since ``calls_before`` calls."""
    second = pool.submit(trigger_snapshot, eng, timeout=4 * DEADLINE)
    wait_for(lambda: b"".join(platform.triggers) == b"11" or second.done(),
             what="trigger 2's 1")
    assert not second.done(), f"trigger 2 returned {second.result()!r} before its answer"
    assert [c[:2] for c in rec.calls[calls_before:]] == [SNAP]
    assert eng.status().state == "snapshotting" and not eng.is_ready()
    return second


def _answer_checkpoint_2(eng: Lifecycle, platform: FakePlatform, rec: Recorder,
                         second: concurrent.futures.Future[str], calls_before: int) -> None:
    os.write(platform.master, b"resume\n")  # checkpoint 2's own answer
    assert second.result(DEADLINE) == "resume"
    assert [c[:2] for c in rec.calls[calls_before:]] == [SNAP, RESUMED]
    assert eng.is_ready() and eng.status().state == "ready"


def test_a_late_resume_read_before_a_retried_trigger_does_not_end_its_pass(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoint 1's late ``resume`` arrived before trigger 2's pass began, and the
    waiter got to the engine only after it (its thread was slow): the answer is
    checkpoint 1's and runs nothing (before: the resume hooks ended trigger 2's pass, and
    the process said ready while checkpoint 2 was pending)."""
    platform = FakePlatform(pty_proc, reply=None)
    read, go = threading.Event(), threading.Event()
    real_handle = gvisor._handle

    def slow_handle(*args, **kwargs):  # type: ignore[no-untyped-def]
        read.set()
        assert go.wait(DEADLINE)
        return real_handle(*args, **kwargs)

    try:
        rec = Recorder(iso_engine)
        start_waiter(iso_engine, pty_proc)
        _timed_out_trigger(iso_engine, platform)
        monkeypatch.setattr(gvisor, "_handle", slow_handle)
        os.write(platform.master, b"resume\n")  # checkpoint 1's late answer
        assert read.wait(DEADLINE)  # read (it has arrived); not handled yet
        iso_engine.registry.before_snapshot(go.set, name="trigger-2-began")
        before = len(rec.calls)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = _second_trigger_pending(iso_engine, platform, rec, pool,
                                             calls_before=before)
            _answer_checkpoint_2(iso_engine, platform, rec, second, before)
    finally:
        go.set()
        iso_engine.stop()
        monkeypatch.undo()
        platform.close()


def test_a_late_resume_during_a_retried_triggers_pass_does_not_end_it(
        iso_engine: Lifecycle, pty_proc: Path) -> None:
    """The brief's order: trigger 2's before-snapshot pass is running when checkpoint 1's
    late ``resume`` arrives. Trigger 2 has not written its ``1``, so the answer cannot be
    its checkpoint's: nothing runs (before: the resume hooks ran after the pass, and the
    process said ready while checkpoint 2 was pending)."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        start_waiter(iso_engine, pty_proc)
        _timed_out_trigger(iso_engine, platform)

        @iso_engine.registry.before_snapshot(name="checkpoint-1-ends-now")
        def late_answer() -> None:
            os.write(platform.master, b"resume\n")

        before = len(rec.calls)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = _second_trigger_pending(iso_engine, platform, rec, pool,
                                             calls_before=before)
            iso_engine.registry.unregister(late_answer)
            _answer_checkpoint_2(iso_engine, platform, rec, second, before)
    finally:
        iso_engine.stop()
        platform.close()


def test_a_late_resume_just_before_a_retried_triggers_write_is_not_its_answer(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoint 1's late ``resume`` arrives after trigger 2 found the waiter armed (on
    the descriptor registered for checkpoint 1) and before it wrote its ``1``: it is not
    trigger 2's answer — trigger 2 waits for its own (before: it returned ``resume`` at
    once, and the resume hooks ran, while checkpoint 2 was pending)."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        waiter = start_waiter(iso_engine, pty_proc)
        _timed_out_trigger(iso_engine, platform)
        real_armed = waiter._wait_armed

        def armed_then_late_answer(deadline: float | None) -> int:
            seq = real_armed(deadline)
            os.write(platform.master, b"resume\n")  # checkpoint 1 ends now
            wait_for(lambda: waiter.status()["answers"] > seq, what="the late answer")
            return seq

        monkeypatch.setattr(waiter, "_wait_armed", armed_then_late_answer)
        before = len(rec.calls)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = _second_trigger_pending(iso_engine, platform, rec, pool,
                                             calls_before=before)
            _answer_checkpoint_2(iso_engine, platform, rec, second, before)
    finally:
        iso_engine.stop()
        monkeypatch.undo()
        platform.close()


class _SlowWaiter:
    """The waiter thread is held, once :attr:`armed` is set, until trigger 2 wrote its
    ``1`` or waits for the waiter (``_wait_some``): it is slow to get back to Python
    (the GIL, scheduling) after its ``poll()`` woke for checkpoint 1's late answer.
    ``after_read``: held after its read (the answer is consumed, no longer readable,
    but not handled); else held as ``poll()`` returns (the answer still readable).
    :attr:`opens_at_write`: the waiter's ``opens`` when a ``1`` was written. Made before
    the waiter starts (its ``poll()`` object is made once per descriptor), then
    :meth:`watch` it."""

    def __init__(self, platform: FakePlatform, monkeypatch: pytest.MonkeyPatch, *,
                 after_read: bool) -> None:
        self.armed = threading.Event()
        self.held = threading.Event()
        self.released = threading.Event()
        self.trigger_waits = threading.Event()
        self.platform = platform
        self.opens_at_write: list[int] = []
        self.waiter: GVisorDetector | None = None
        self._monkeypatch = monkeypatch
        real_read, real_write, real_poll = os.read, os.write, select.poll
        slow = self

        def hold() -> None:
            slow.held.set()
            assert slow.released.wait(DEADLINE), "the waiter was never let go on"

        def holds_now() -> bool:
            return (slow.armed.is_set() and not slow.held.is_set()
                    and threading.current_thread().name == "rehydrate-gvisor")

        class Poll:
            def __init__(self) -> None:
                self._poll = real_poll()

            def register(self, *args):  # type: ignore[no-untyped-def]
                self._poll.register(*args)

            def poll(self, *args):  # type: ignore[no-untyped-def]
                events = self._poll.poll(*args)
                if (not after_read and holds_now() and slow.waiter is not None
                        and any(fd != slow.waiter._stop_r for fd, _ in events)):
                    hold()
                return events

        def read(fd: int, n: int) -> bytes:
            if not (after_read and holds_now()):
                return real_read(fd, n)
            data = real_read(fd, n)
            hold()
            return data

        def write(fd: int, data: bytes) -> int:
            if data == b"1" and slow.waiter is not None:
                slow.opens_at_write.append(slow.waiter.status()["opens"])
            return real_write(fd, data)

        monkeypatch.setattr(select, "poll", Poll)
        monkeypatch.setattr(os, "read", read)
        monkeypatch.setattr(os, "write", write)

    def watch(self, waiter: GVisorDetector) -> None:
        real_wait = waiter._wait_some

        def wait_some(*args):  # type: ignore[no-untyped-def]
            self.trigger_waits.set()
            return real_wait(*args)

        self._monkeypatch.setattr(waiter, "_wait_some", wait_some)
        self.waiter = waiter

    def release_when_trigger_2_wrote_or_waits(self) -> None:
        wait_for(lambda: b"".join(self.platform.triggers) == b"11"
                 or self.trigger_waits.is_set(), what="trigger 2 to write or wait")
        self.released.set()


def _own_answer_after_the_late_one(eng: Lifecycle, waiter: GVisorDetector,
                                   platform: FakePlatform, rec: Recorder,
                                   second: concurrent.futures.Future[str], before: int,
                                   handled: int) -> None:
    """Checkpoint 1's late answer was handled as an earlier checkpoint's: nothing ran
    for trigger 2's pending pass; trigger 2 then writes its ``1`` and returns its own
    checkpoint's answer (``restore``, so that it cannot be mistaken for the late one)."""
    wait_for(lambda: waiter.status()["answers"] > handled, what="the late answer handled")
    assert [c[:2] for c in rec.calls[before:]] == [SNAP], "the late answer ran hooks"
    assert eng.status().state == "snapshotting" and not eng.is_ready()
    wait_for(lambda: b"".join(platform.triggers) == b"11" or second.done(),
             what="trigger 2's 1")
    assert not second.done(), f"trigger 2 returned {second.result()!r} before its answer"
    assert [c[:2] for c in rec.calls[before:]] == [SNAP]
    os.write(platform.master, b"restore\n")  # checkpoint 2's own answer
    assert second.result(DEADLINE) == "restore"
    assert [c[:2] for c in rec.calls[before:]] == [SNAP, ("restore-hook", "restore")]
    assert eng.is_ready() and eng.status().state == "ready"


def _trigger_2_after_the_late_answer(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch, *,
        after_read: bool,
        late_answer: Callable[[_SlowWaiter, GVisorDetector, FakePlatform], None]) -> None:
    """Trigger 1 times out; with the waiter slowed (:class:`_SlowWaiter`, ``after_read``),
    ``late_answer(slow, waiter, platform)`` sets up checkpoint 1's late answer, then
    trigger 2 runs: it must return its own checkpoint's answer
    (:func:`_own_answer_after_the_late_one`), its ``1`` written once the waiter had
    opened the file again."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        slow = _SlowWaiter(platform, monkeypatch, after_read=after_read)
        waiter = start_waiter(iso_engine, pty_proc)
        _timed_out_trigger(iso_engine, platform)
        slow.watch(waiter)
        handled, opens = waiter.status()["answers"], waiter.status()["opens"]
        late_answer(slow, waiter, platform)
        before = len(rec.calls)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(trigger_snapshot, iso_engine, timeout=4 * DEADLINE)
            slow.release_when_trigger_2_wrote_or_waits()
            _own_answer_after_the_late_one(iso_engine, waiter, platform, rec, second,
                                           before, handled)
        # written once the waiter had opened the file again: on gVisor, the descriptor
        # that gave checkpoint 1's answer would not get checkpoint 2's
        assert slow.opens_at_write == [opens + 1]
    finally:
        slow.released.set()
        iso_engine.stop()
        monkeypatch.undo()
        platform.close()


@pytest.mark.parametrize("late", [b"resume\n", b"garbage\n"])
def test_a_late_answer_read_but_not_yet_stamped_is_not_the_retried_triggers(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch,
        late: bytes) -> None:
    """The waiter has read checkpoint 1's late answer (it is no longer readable) and
    waits to get back to Python when trigger 2 looks: the descriptor is armed and
    quiet. The answer arrived before trigger 2 wrote its ``1``: it is checkpoint 1's —
    trigger 2 waits for the waiter to take it and open the file again, then writes and
    returns its own answer (before: the answer was stamped after trigger 2's write and
    taken for its own — ``resume`` returned and the resume hooks ended trigger 2's pass
    while checkpoint 2 was pending; a bad one failed trigger 2)."""
    def read_but_not_handled(slow: _SlowWaiter, waiter: GVisorDetector,
                             platform: FakePlatform) -> None:
        slow.armed.set()
        os.write(platform.master, late)  # checkpoint 1's late answer
        assert slow.held.wait(DEADLINE)  # read, not handled: the waiter is held

    _trigger_2_after_the_late_answer(iso_engine, pty_proc, monkeypatch, after_read=True,
                                     late_answer=read_but_not_handled)


def test_a_late_answer_readable_once_the_waiter_looked_quiet_is_not_the_retried_triggers(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trigger 2 found the waiter armed with nothing to read (``_wait_armed``); checkpoint
    1's late answer becomes readable just then, before trigger 2 records that it writes
    (``_trigger_writes``), and the waiter is slow to take it. The answer is checkpoint
    1's: trigger 2 waits for its own (before: the waiter stamped the answer after trigger
    2's write and it was taken for trigger 2's)."""
    def readable_as_trigger_2_writes(slow: _SlowWaiter, waiter: GVisorDetector,
                                     platform: FakePlatform) -> None:
        real_writes = waiter._trigger_writes

        def late_answer_then_writes(*args):  # type: ignore[no-untyped-def]
            slow.armed.set()
            os.write(platform.master, b"resume\n")  # checkpoint 1 ends now
            poller = select.poll()
            poller.register(waiter._armed_fd, select.POLLIN)
            assert poller.poll(DEADLINE * 1000), "the late answer never became readable"
            return real_writes(*args)

        monkeypatch.setattr(waiter, "_trigger_writes", late_answer_then_writes)

    _trigger_2_after_the_late_answer(iso_engine, pty_proc, monkeypatch, after_read=False,
                                     late_answer=readable_as_trigger_2_writes)


@pytest.mark.parametrize("failure", ["write refused: a checkpoint in progress",
                                     "before-snapshot hooks failed"])
def test_a_retried_trigger_that_fails_leaves_the_resume_to_the_due_answer(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch,
        failure: str) -> None:
    """Trigger 1 timed out (its checkpoint under way, the answer due to the waiter);
    trigger 2 fails — gVisor refuses its ``1`` (ENXIO: checkpoint 1 is still in progress),
    or its own before-snapshot hooks fail. Its carry-on must not say ready while
    checkpoint 1 is pending (before: it ran the resume hooks); checkpoint 1's answer then
    runs them, and the process is ready again."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        start_waiter(iso_engine, pty_proc)
        _timed_out_trigger(iso_engine, platform)
        before = len(rec.calls)
        if failure.startswith("write refused"):
            real_write = os.write

            def refused(fd: int, data: bytes) -> int:
                if data == b"1":
                    raise OSError(errno.ENXIO, os.strerror(errno.ENXIO))
                return real_write(fd, data)

            monkeypatch.setattr(os, "write", refused)
            with pytest.raises(GVisorError, match="already in progress; the resume hooks "
                                                  "run when the checkpoint under way"):
                trigger_snapshot(iso_engine, timeout=DEADLINE)
            monkeypatch.undo()
            assert iso_engine.state == "snapshotting"
        else:
            @iso_engine.registry.before_snapshot(name="boom")
            def boom() -> None:
                raise RuntimeError("cannot close")

            assert trigger_snapshot(iso_engine, timeout=DEADLINE) == "error"
            iso_engine.registry.unregister(boom)
            assert iso_engine.state == "degraded"
        assert [c[:2] for c in rec.calls[before:]] == [SNAP]
        assert not iso_engine.is_ready()
        os.write(platform.master, b"resume\n")  # checkpoint 1's answer, at last
        assert iso_engine.wait_ready(timeout=DEADLINE)
        assert [c[:2] for c in rec.calls[before:]] == [SNAP, RESUMED]
    finally:
        iso_engine.stop()
        monkeypatch.undo()
        platform.close()


def _deadline_reported(eng: Lifecycle) -> None:
    """The last report is the snapshot deadline's run. It is published just after that
    run made the process ready: wait_ready() can return before it is the last one."""
    def reported() -> bool:
        last = eng.status().last_report
        return last is not None and last.reason == "snapshot-deadline"

    wait_for(reported, DEADLINE, what=f"the deadline's report ({eng.status().last_report})")


def _failing_pass(eng: Lifecycle) -> None:
    @eng.registry.before_snapshot(name="boom")
    def boom() -> None:
        raise RuntimeError("cannot close")


def test_a_failed_retry_after_the_snapshot_deadline_carries_on_at_once(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trigger 1 timed out and the platform never answered: the snapshot deadline ran the
    resume hooks (ready). Trigger 2's before-snapshot hooks fail: its carry-on runs at
    once and the process is ready (before: the resume hooks were left to checkpoint 1's
    answer, still counted due, and the process stayed degraded for good — no deadline
    watches a failed pass)."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        iso_engine.snapshot_deadline = 0.3
        # The deadline counts from the end of the pass, the trigger's 0.3 s from before
        # it: they end almost together, and a test thread descheduled after the timeout
        # found the deadline's run begun. The deadline counts from the check instead.
        checked = threading.Event()
        real_deadline_main = iso_engine._deadline_main

        def after_the_check(*args: Any, started: Any = None, **kwargs: Any) -> None:
            if started is not None:
                started()  # the trigger goes on (arm() waits for this) ...
            assert checked.wait(DEADLINE)  # ... and the deadline starts after the check
            real_deadline_main(*args, **kwargs)

        monkeypatch.setattr(iso_engine, "_deadline_main", after_the_check)
        start_waiter(iso_engine, pty_proc)
        _timed_out_trigger(iso_engine, platform)
        checked.set()
        assert iso_engine.wait_ready(timeout=DEADLINE)  # the deadline's resume run
        _deadline_reported(iso_engine)
        before = len(rec.calls)
        _failing_pass(iso_engine)
        assert trigger_snapshot(iso_engine, timeout=DEADLINE) == "error"
        assert iso_engine.is_ready() and iso_engine.state == "ready"
        assert [c[:2] for c in rec.calls[before:]] == [SNAP, RESUMED]
        assert iso_engine.status().last_report.reason == "gvisor"  # the carry-on
    finally:
        iso_engine.stop()
        platform.close()


def test_a_failed_retry_left_to_a_due_answer_is_bounded_by_the_snapshot_deadline(
        iso_engine: Lifecycle, pty_proc: Path) -> None:
    """Trigger 1 timed out (no deadline watched its pass); trigger 2's before-snapshot
    hooks fail while checkpoint 1's answer is due, and that answer never comes. The
    resume hooks are left to it — but only as long as the snapshot deadline: then they
    run (before: nothing watched the failed pass, and the process stayed degraded for
    good)."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        iso_engine.snapshot_deadline = None  # pass 1 unwatched: only pass 2's bound counts
        start_waiter(iso_engine, pty_proc)
        _timed_out_trigger(iso_engine, platform)
        iso_engine.snapshot_deadline = 0.3
        before = len(rec.calls)
        _failing_pass(iso_engine)
        assert trigger_snapshot(iso_engine, timeout=DEADLINE) == "error"
        assert iso_engine.wait_ready(timeout=DEADLINE), iso_engine.state
        assert [c[:2] for c in rec.calls[before:]] == [SNAP, RESUMED]
        # left to the answer, then the deadline's run — not the trigger's carry-on
        _deadline_reported(iso_engine)
    finally:
        iso_engine.stop()
        platform.close()


def test_a_failed_pass_with_no_answer_due_keeps_no_deadline_watch() -> None:
    """:meth:`Lifecycle.await_answer` bounds only the latest pass, not yet undone: for an
    older one (a run followed) it says no, and the caller carries on itself."""
    eng = Lifecycle(Registry(), env=EnvRefresher(path=None), snapshot_deadline=0.2)
    try:
        _failing_pass(eng)
        snap = eng.simulate_snapshot()
        assert not snap.ok and eng.state == "degraded"
        eng.restore_detected("test", kind="resume", anchor=False, frozen_for=0.0)
        assert eng.is_ready()
        assert eng.await_answer(snap) is False
    finally:
        eng.close()


def _trigger_b_held(waiter: GVisorDetector, monkeypatch: pytest.MonkeyPatch, step: str
                    ) -> tuple[threading.Event, threading.Event]:
    """Hold trigger B (a thread named ``B…``) right after its registration with the
    waiter (``_trigger_begins``), or after its pass, just before it waits for the waiter
    to be armed and writes (``_wait_armed``): B is slow to go on (scheduling)."""
    real = getattr(waiter, step)
    held, release = threading.Event(), threading.Event()

    def hold(*args):  # type: ignore[no-untyped-def]
        after = step == "_trigger_begins"
        out = real(*args) if after else None
        if threading.current_thread().name.startswith("B"):
            held.set()
            assert release.wait(DEADLINE)
        return out if after else real(*args)

    monkeypatch.setattr(waiter, step, hold)
    return held, release


@pytest.mark.parametrize("held_after", ["_trigger_begins", "_wait_armed"])
def test_concurrent_triggers_are_never_ready_before_the_last_ones_answer(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch,
        held_after: str) -> None:
    """Trigger B registered with the waiter first (``_trigger_begins``; or even ran its
    pass, ``_wait_armed``), then trigger A's pass ran, A wrote its ``1`` and checkpoint A
    answered ``resume`` while B had not written. The resume hooks must not run yet: B's
    checkpoint is still to come, and with B's pass already run they would reopen what it
    closed, so that B wrote its ``1`` while the process said ready (a fix that ran them
    for A did that). The process stays snapshotting until B's own answer."""
    platform = FakePlatform(pty_proc, reply=b"resume\n")
    try:
        rec = Recorder(iso_engine)
        waiter = start_waiter(iso_engine, pty_proc)
        held, release = _trigger_b_held(waiter, monkeypatch, held_after)
        at_write: list[tuple[str, str, bool]] = []
        writes = waiter._trigger_writes

        def recorded(*args):  # type: ignore[no-untyped-def]
            at_write.append((threading.current_thread().name[:1], iso_engine.state,
                             iso_engine.is_ready()))
            return writes(*args)

        monkeypatch.setattr(waiter, "_trigger_writes", recorded)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="B") as pool:
            b = pool.submit(trigger_snapshot, iso_engine, timeout=DEADLINE)
            try:
                assert held.wait(DEADLINE)
                b_pass = [SNAP] if held_after == "_wait_armed" else []
                assert trigger_snapshot(iso_engine, timeout=DEADLINE) == "resume"  # A
                assert [c[:2] for c in rec.calls] == [*b_pass, SNAP]
                assert iso_engine.state == "snapshotting" and not iso_engine.is_ready()
            finally:
                release.set()
            assert b.result(DEADLINE) == "resume"
        assert b"".join(platform.triggers) == b"11"
        assert [w for w in at_write if w[0] == "B"] == [("B", "snapshotting", False)]
        assert [c[:2] for c in rec.calls][-1] == RESUMED
        assert [c[:2] for c in rec.calls].count(RESUMED) == 1
        assert iso_engine.is_ready() and iso_engine.state == "ready"
    finally:
        iso_engine.stop()
        monkeypatch.undo()
        platform.close()


def test_a_concurrent_triggers_answer_does_not_end_a_later_triggers_pass(
        iso_engine: Lifecycle, pty_proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trigger A wrote its ``1``; trigger B's pass ran after A's (the latest), and B has
    not written yet when checkpoint A answers ``resume``. That answer is A's, but B's
    pass belongs to B's checkpoint, still to come: nothing runs, the process stays
    snapshotting until B's own answer (the bound never reaches back before the latest
    pass just because A's pass was answered)."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        waiter = start_waiter(iso_engine, pty_proc)
        held, release = _trigger_b_held(waiter, monkeypatch, "_wait_armed")
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="A") as pa, \
                concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="B") as pb:
            a = pa.submit(trigger_snapshot, iso_engine, timeout=DEADLINE)
            try:
                wait_for(lambda: b"".join(platform.triggers) == b"1" or a.done(),
                         what="trigger A's 1")
                b = pb.submit(trigger_snapshot, iso_engine, timeout=DEADLINE)
                assert held.wait(DEADLINE)  # B's pass ran; B has not written
                os.write(platform.master, b"resume\n")  # checkpoint A's answer
                assert a.result(DEADLINE) == "resume"
                assert [c[:2] for c in rec.calls] == [SNAP, SNAP]
                assert iso_engine.state == "snapshotting" and not iso_engine.is_ready()
            finally:
                release.set()
            wait_for(lambda: b"".join(platform.triggers) == b"11" or b.done(),
                     what="trigger B's 1")
            os.write(platform.master, b"resume\n")  # checkpoint B's answer
            assert b.result(DEADLINE) == "resume"
        assert [c[:2] for c in rec.calls] == [SNAP, SNAP, RESUMED]
        assert iso_engine.is_ready() and iso_engine.state == "ready"
    finally:
        iso_engine.stop()
        monkeypatch.undo()
        platform.close()


def test_without_a_waiter_an_earlier_answer_is_not_the_retried_triggers(
        iso_engine: Lifecycle, pty_proc: Path) -> None:
    """No waiter: trigger 1 timed out (and carried on); checkpoint 1's late ``resume``
    is already readable when trigger 2 opens the file for its answer. It is not trigger
    2's: trigger 2 writes its ``1`` and waits for its own (before: it read checkpoint 1's
    answer right after its write, returned ``resume`` and ran the resume hooks while
    checkpoint 2 was pending)."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        with pytest.raises(TimeoutError):
            trigger_snapshot(iso_engine, proc=str(pty_proc), timeout=0.3)
        assert iso_engine.is_ready()  # no waiter: trigger 1 carried on
        os.write(platform.master, b"resume\n")  # checkpoint 1's late answer
        before = len(rec.calls)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(trigger_snapshot, iso_engine, proc=str(pty_proc),
                                 timeout=4 * DEADLINE)
            wait_for(lambda: b"".join(platform.triggers) == b"11" or second.done(),
                     what="trigger 2's 1")
            assert not second.done(), f"trigger 2 returned {second.result()!r} early"
            assert [c[:2] for c in rec.calls[before:]] == [SNAP]
            assert iso_engine.status().state == "snapshotting"
            _answer_checkpoint_2(iso_engine, platform, rec, second, before)
    finally:
        platform.close()


def _trigger_in_thread(eng: Lifecycle,
                       **kwargs: object) -> tuple[threading.Thread, dict[str, object]]:
    """trigger_snapshot() without a timeout, in a daemon thread (a wait that never ends
    must fail the test, not hang it)."""
    out: dict[str, object] = {}

    def call() -> None:
        try:
            out["answer"] = trigger_snapshot(eng, **kwargs)  # type: ignore[arg-type]
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("with_waiter", [True, False])
def test_a_trigger_without_timeout_ends_when_the_snapshot_deadline_ran_the_hooks(
        iso_engine: Lifecycle, pty_proc: Path, with_waiter: bool) -> None:
    """gVisor never answers and no timeout was given: the snapshot deadline runs the
    resume hooks, and trigger_snapshot() raises TimeoutError saying so (before: the
    process was ready again but the call stayed blocked for good). With the waiter, a
    late answer still runs its hooks."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        rec = Recorder(iso_engine)
        iso_engine.snapshot_deadline = 0.3
        if with_waiter:
            start_waiter(iso_engine, pty_proc)
        thread, out = _trigger_in_thread(
            iso_engine, **({} if with_waiter else {"proc": str(pty_proc)}))
        thread.join(DEADLINE)
        assert not thread.is_alive(), "trigger_snapshot() still waits after the deadline ran"
        error = out.get("error")
        assert isinstance(error, TimeoutError), out
        assert "snapshot deadline" in str(error) and "resume hooks" in str(error)
        assert platform.triggers == [b"1"]
        assert [c[:2] for c in rec.calls] == [SNAP, RESUMED]  # the deadline's run only
        assert iso_engine.is_ready()
        _deadline_reported(iso_engine)
        if with_waiter:
            os.write(platform.master, b"restore\n")  # the late answer: a clone after all
            # the hook's record, not the generation (set when the run begins, before it)
            wait_for(lambda: len(rec.calls) == 3, DEADLINE,
                     what="the late answer's restore run")
            assert iso_engine.generation == 1
            assert [c[:2] for c in rec.calls] == [SNAP, RESUMED, ("restore-hook", "restore")]
    finally:
        iso_engine.stop()
        platform.close()


@pytest.mark.parametrize("with_waiter", [True, False])
def test_a_trigger_ends_when_the_deadline_ended_a_later_pass(
        iso_engine: Lifecycle, pty_proc: Path, with_waiter: bool) -> None:
    """A second before-snapshot pass while the answer is pending (``notify save`` inside
    the checkpoint the trigger started): the deadline's run ends that later pass — only
    the latest is marked ended — and the trigger, looking at its own, waited for good."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        iso_engine.snapshot_deadline = 0.3
        if with_waiter:
            start_waiter(iso_engine, pty_proc)
        thread, out = _trigger_in_thread(
            iso_engine, **({} if with_waiter else {"proc": str(pty_proc)}))
        wait_for(lambda: platform.triggers == [b"1"], what="the trigger's 1")
        assert iso_engine.snapshot_requested("control").ok  # the second pass
        thread.join(DEADLINE)
        assert not thread.is_alive(), "trigger_snapshot() still waits after the deadline ran"
        assert isinstance(out.get("error"), TimeoutError), out
        assert iso_engine.is_ready()
    finally:
        iso_engine.stop()
        platform.close()


def test_an_earlier_pass_s_deadline_run_published_late_does_not_end_a_new_wait(
        iso_engine: Lifecycle) -> None:
    """A deadline run of an earlier pass, published (by its thread, after the run lock)
    once a new trigger's watch listened: it ended that wait at once with a false
    TimeoutError while the new pass was pending."""
    import dataclasses

    from rehydrate._trigger import DEADLINE_REASON, _DeadlineWatch

    snap = iso_engine.simulate_snapshot()
    watch = _DeadlineWatch(iso_engine, snap, None)
    try:
        run = iso_engine.simulate_restore(kind="resume")
        older = dataclasses.replace(run, reason=DEADLINE_REASON,
                                    started_at=snap.started_at - 1.0)
        watch._heard(older)
        assert watch.gave_up("") is None
        later = dataclasses.replace(older, started_at=snap.started_at + 1.0)
        watch._heard(later)
        assert watch.gave_up("") is not None
    finally:
        watch.close()


def test_another_run_ending_the_pass_does_not_end_the_wait_for_the_answer(
        iso_engine: Lifecycle, pty_proc: Path) -> None:
    """Only the snapshot deadline's run gives up on the answer: another run that ended
    the pass (a notice) leaves the trigger waiting for gVisor's answer, which it returns."""
    platform = FakePlatform(pty_proc, reply=None)
    try:
        Recorder(iso_engine)
        start_waiter(iso_engine, pty_proc)
        thread, out = _trigger_in_thread(iso_engine)
        wait_for(lambda: platform.triggers == [b"1"], what="the trigger's 1")
        iso_engine.restore_detected("test", kind="resume", anchor=False, frozen_for=0.0)
        assert iso_engine.is_ready()
        assert thread.is_alive() and not out
        os.write(platform.master, b"resume\n")
        thread.join(DEADLINE)
        assert out == {"answer": "resume"}
    finally:
        iso_engine.stop()
        platform.close()


def test_stop_in_a_forked_child_leaves_the_parents_waiter(engine: Lifecycle,
                                                           proc: Path) -> None:
    """A child of fork() calling stop() on the parent's waiter (an inherited shutdown
    handler) wrote to the shared stop pipe and opened the FIFO as a writer: the parent's
    waiter ended while the engine still listed it, deaf to the next checkpoint."""
    from detect_helpers import in_forked_child

    rec = Recorder(engine)
    waiter = start_waiter(engine, proc)

    def child() -> dict[str, Any]:
        waiter.stop(timeout=0.5)
        return {"stopped": waiter._thread is None}

    assert in_forked_child(child) == {"stopped": True}
    assert waiter._stop_w != -1  # the parent's own stop pipe, still open
    answer(waiter, b"restore\n")  # the parent's waiter still hears the checkpoint
    (call,) = rec.wait(1)
    assert call[:2] == ("restore-hook", "restore")
    assert waiter.running and waiter._thread is not None and waiter._thread.is_alive()
