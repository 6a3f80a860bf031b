"""A failed ``notify save`` under gVisor, and gVisor's ``error`` answer for the aborted
checkpoint: the resume hooks run once for the pass, whichever notice comes first.

gVisor's save-restore-exec runs ``rehydrate notify save`` before saving; its non-zero exit
fails the checkpoint, and gVisor then answers ``error`` on every checkpoint descriptor —
the gVisor waiter's too. The control socket has already run the resume hooks (the
"carry-on" run) before ``notify save`` exits, so that answer is a confirmation: before
the fix it ran every resume hook a second time (reconnects, secret reloads, a jump of the
game's tick clock, two resumes in the reports).

Stand-ins as in ``test_gvisor.py``: ``checkpoint`` is a FIFO the test writes gVisor's answer
into; the control socket is real, and ``notify save`` is the real CLI where the order of
events allows. Orders that depend on two threads racing for the engine are forced by
holding one of them until the other has run — by events, never by sleeping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from detect_helpers import FakePlatform, Recorder, wait_for

from rehydrate import Lifecycle, Registry
from rehydrate._control_client import request
from rehydrate._trigger import trigger_snapshot
from rehydrate.adapters.gameloop import TickClock
from rehydrate.detect.control import ControlDetector
from rehydrate.detect.gvisor import GVisorDetector
from rehydrate.env import EnvRefresher

from .test_gvisor import answer, start_waiter

DEADLINE = 10.0
IN_CHECKPOINT = {"in_checkpoint": True}
"""What ``rehydrate notify`` adds to ``prepare-snapshot`` when gVisor's save-restore-exec
runs it: the save belongs to a checkpoint in progress, whose failure gVisor answers."""
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # AF_UNIX paths are limited to 108 bytes: pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="rh-errdup-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def engine(rehydrate_environ: None) -> Iterator[Lifecycle]:
    eng = Lifecycle(Registry(), env=EnvRefresher(path=None))
    yield eng
    eng.close()


class Sandbox:
    """The application's detectors: the gVisor waiter on a FIFO, the control socket."""

    def __init__(self, engine: Lifecycle, short_dir: Path) -> None:
        self.engine = engine
        proc = short_dir / "gvisor"
        proc.mkdir()
        os.mkfifo(proc / "checkpoint")
        self.socket = str(short_dir / "ctl.sock")
        self.rec = Recorder(engine)
        self.waiter = GVisorDetector(str(proc))
        assert engine.start([self.waiter, ControlDetector(self.socket)]) == ["gvisor",
                                                                             "control"]
        wait_for(lambda: self.waiter.status()["waiting"], what="the waiter to open the FIFO")

    def notify_save(self, by_hand: bool = False) -> subprocess.CompletedProcess[str]:
        """What gVisor's save-restore-exec runs before saving (``rehydrate notify`` with
        ``GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE=save``); ``by_hand``: ``rehydrate notify
        save`` as an operator runs it (``runsc exec``), with no checkpoint behind it."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("CRTOOLS_SCRIPT_ACTION", "GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE")}
        env.update(REHYDRATE_CONTROL_SOCKET=self.socket)
        if not by_hand:
            env.update(GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE="save")
        return subprocess.run([sys.executable, "-m", "rehydrate", "notify",
                               *(["save"] if by_hand else [])], env=env,
                              cwd=REPO, capture_output=True, text=True, timeout=60,
                              check=False)

    def gvisor_answers(self, data: bytes) -> None:
        """Play gVisor: answer the checkpoint, and wait until the waiter has handled it
        (run the hooks, or recognised the answer as a confirmation)."""
        before = self.waiter.status()["answers"]
        answer(self.waiter, data)
        wait_for(lambda: self.waiter.status()["answers"] > before,
                 what="the waiter to handle the answer")

    def runs(self) -> list[tuple[str, str, float | None]]:
        return [(c["kind"], c["reason"], c["frozen_for"]) for c in self.rec.calls]

    def waiter_report(self) -> Any:
        last = self.waiter._last
        assert last is not None
        return last[1]


@pytest.fixture
def sandbox(engine: Lifecycle, short_dir: Path) -> Iterator[Sandbox]:
    yield Sandbox(engine, short_dir)
    # Before short_dir is removed: a waiter that got no answer sits in a blocking open()
    # of the FIFO, which stop() ends by opening it as a writer — by its path.
    engine.stop()


def _failing_pass(engine: Lifecycle, fail: list[bool] | None = None) -> None:
    @engine.registry.before_snapshot(name="app.flush")
    def flush() -> None:
        if fail is None or fail[0]:
            raise RuntimeError("disk full")


def test_error_answer_after_a_failed_notify_save_only_confirms_the_carry_on_run(
        sandbox: Sandbox, engine: Lifecycle) -> None:
    fake_now = [1000.0]
    clock = TickClock(20, max_catch_up=0, clock=lambda: fake_now[0], engine=engine)
    _failing_pass(engine)

    saved = sandbox.notify_save()
    assert saved.returncode == 1, (saved.stdout, saved.stderr)
    assert "app.flush" in saved.stderr and "the resume hooks ran" in saved.stderr
    assert sandbox.runs() == [("resume", "control", 0.0)]

    sandbox.gvisor_answers(b"error\n")  # gVisor aborted the checkpoint
    assert sandbox.runs() == [("resume", "control", 0.0)], "the resume hooks ran twice"
    dup = sandbox.waiter_report()
    assert dup.deduplicated and dup.reason == "control"
    last = engine.status().last_report
    assert (last.reason, last.kind, last.confirmed_by) == ("control", "resume", ("gvisor",))
    assert engine.is_ready() and engine.status().state == "ready"
    # The loop ran on throughout: the tick clock takes no jump for the failed save.
    fake_now[0] += 0.1
    assert clock.due() == 2 and clock.jumps == 0


def _hold_until(engine: Lifecycle, reason: str, until: Callable[[], bool],
                monkeypatch: pytest.MonkeyPatch, arrived: threading.Event) -> None:
    """Hold ``reason``'s restore/resume notice until ``until()`` is true (the other notice
    has run); ``arrived`` is set when the notice comes."""
    real = engine.restore_detected

    def held(name: str, **kwargs: Any) -> Any:
        if name == reason:
            arrived.set()
            wait_for(until, timeout=DEADLINE, what="the other notice to run first")
        return real(name, **kwargs)

    monkeypatch.setattr(engine, "restore_detected", held)


def _gvisor_notice_first(engine: Lifecycle, rec: Recorder,
                         monkeypatch: pytest.MonkeyPatch, arrived: threading.Event) -> None:
    """The error notice is already waiting behind the before-snapshot pass; hold the
    control socket after the pass until the waiter's notice has been handled."""
    real_restore, real_snapshot = engine.restore_detected, engine.snapshot_requested
    handled = threading.Event()

    def gvisor_notice(name: str, **kwargs: Any) -> Any:
        if name == "gvisor":
            arrived.set()
            try:
                return real_restore(name, **kwargs)
            finally:
                handled.set()
        return real_restore(name, **kwargs)

    def snapshot_then_wait(*args: Any, **kwargs: Any) -> Any:
        report = real_snapshot(*args, **kwargs)
        assert handled.wait(DEADLINE), "the gVisor notice was not handled"
        return report

    monkeypatch.setattr(engine, "restore_detected", gvisor_notice)
    monkeypatch.setattr(engine, "snapshot_requested", snapshot_then_wait)


@pytest.mark.parametrize("first", ["gvisor", "control"])
def test_error_answer_during_the_failing_save_runs_the_resume_hooks_once(
        sandbox: Sandbox, engine: Lifecycle, monkeypatch: pytest.MonkeyPatch,
        first: str) -> None:
    """The platform's timeout killed ``notify save`` while the hooks still ran: gVisor's
    ``error`` arrives before the carry-on run. Whichever of the two then runs first runs
    the resume hooks; the other confirms it."""
    entered, release, arrived = threading.Event(), threading.Event(), threading.Event()

    @engine.registry.before_snapshot(name="app.flush")
    def flush() -> None:
        entered.set()
        assert release.wait(DEADLINE)
        raise RuntimeError("disk full")

    if first == "gvisor":
        _gvisor_notice_first(engine, sandbox.rec, monkeypatch, arrived)
    else:
        _hold_until(engine, "gvisor", lambda: len(sandbox.rec.calls) >= 1, monkeypatch,
                    arrived)
    reply: dict[str, Any] = {}
    t = threading.Thread(target=lambda: reply.update(
        request("prepare-snapshot", socket_path=sandbox.socket, timeout=DEADLINE,
                fields=IN_CHECKPOINT)))
    t.start()
    assert entered.wait(DEADLINE)
    answer(sandbox.waiter, b"error\n")  # the checkpoint failed while the hooks ran
    assert arrived.wait(DEADLINE), "the waiter did not pass on the answer"
    release.set()
    t.join(DEADLINE)
    wait_for(lambda: sandbox.waiter.status()["answers"] >= 1, what="the answer handled")

    other = "control" if first == "gvisor" else "gvisor"
    assert [(k, r) for k, r, _ in sandbox.runs()] == [("resume", first)], sandbox.runs()
    last = engine.status().last_report
    assert (last.reason, last.confirmed_by) == (first, (other,))
    assert reply["ok"] is False and reply["resume_report"]["reason"] == first
    assert reply["resume_report"]["deduplicated"] is (first == "gvisor")
    if first == "gvisor":
        assert "the resume hooks ran (run already, for the gvisor notice)" in reply["error"]
    assert engine.is_ready()


@pytest.mark.parametrize("first", ["gvisor", "control"])
def test_notify_save_killed_before_the_reply_and_error_answer_run_the_hooks_once(
        sandbox: Sandbox, engine: Lifecycle, monkeypatch: pytest.MonkeyPatch,
        first: str) -> None:
    """The hooks succeed, but the platform's timeout killed ``notify save`` first (so the
    reply cannot be delivered) and aborted the checkpoint (``error``)."""
    from .test_control import Conn

    entered, release, arrived = threading.Event(), threading.Event(), threading.Event()

    @engine.registry.before_snapshot(name="app.slow")
    def slow() -> None:
        entered.set()
        assert release.wait(DEADLINE)

    if first == "gvisor":
        _gvisor_notice_first(engine, sandbox.rec, monkeypatch, arrived)
    else:
        _hold_until(engine, "gvisor", lambda: len(sandbox.rec.calls) >= 1, monkeypatch,
                    arrived)
    client = Conn(sandbox.socket)
    client.send(b'{"cmd": "prepare-snapshot", "in_checkpoint": true}\n')
    assert entered.wait(DEADLINE)
    client.close()  # killed by the platform's timeout
    answer(sandbox.waiter, b"error\n")
    assert arrived.wait(DEADLINE)
    release.set()
    other = "control" if first == "gvisor" else "gvisor"
    wait_for(lambda: (engine.status().last_report is not None
                      and engine.status().last_report.confirmed_by == (other,)),
             timeout=DEADLINE, what=f"the {other} notice to confirm the run")
    assert [(k, r) for k, r, _ in sandbox.runs()] == [("resume", first)], sandbox.runs()
    assert engine.is_ready()


def test_error_answer_for_a_pending_pass_runs_the_resume_hooks_once(
        sandbox: Sandbox, engine: Lifecycle) -> None:
    """``notify save`` succeeded and the save failed later: nothing undid the pass yet."""
    saved = sandbox.notify_save()
    assert saved.returncode == 0, saved.stderr
    assert engine.status().state == "snapshotting"
    sandbox.gvisor_answers(b"error\n")
    assert sandbox.runs() == [("resume", "gvisor", None)]
    report = sandbox.waiter_report()
    assert not report.deduplicated and report.confirmed_by == ()
    assert engine.is_ready() and engine.status().state == "ready"


@pytest.mark.parametrize("second", ["error", "restore", "resume"])
def test_a_second_checkpoint_attempt_right_after_runs_its_own_hooks(
        sandbox: Sandbox, engine: Lifecycle, second: str) -> None:
    """The failed attempt was confirmed; the retry (its ``notify save`` succeeds) is a new
    pass, whose answer runs its hooks — the confirmation does not carry over."""
    fail = [True]
    _failing_pass(engine, fail)
    assert request("prepare-snapshot", socket_path=sandbox.socket,
                   fields=IN_CHECKPOINT)["ok"] is False
    sandbox.gvisor_answers(b"error\n")
    assert sandbox.runs() == [("resume", "control", 0.0)]

    fail[0] = False
    assert request("prepare-snapshot", socket_path=sandbox.socket,
                   fields=IN_CHECKPOINT)["ok"] is True
    sandbox.gvisor_answers(f"{second}\n".encode())
    kind = "restore" if second == "restore" else "resume"
    assert [(k, r) for k, r, _ in sandbox.runs()] == [("resume", "control"), (kind, "gvisor")]
    report = sandbox.waiter_report()
    assert not report.deduplicated
    assert report.generation == (1 if second == "restore" else 0)
    assert engine.is_ready()


def test_an_error_after_a_carry_on_that_expected_no_checkpoint_still_runs(
        engine: Lifecycle, tmp_path: Path) -> None:
    """``trigger_snapshot()`` whose before-snapshot hooks failed writes no ``1``: its
    carry-on run tells no platform to abort, so a later ``error`` (some other checkpoint,
    which may have paused the sandbox) is not its confirmation: the hooks run."""
    proc = tmp_path / "gvisor-pty"
    proc.mkdir()
    platform = FakePlatform(proc, reply=None)
    try:
        rec = Recorder(engine)
        _failing_pass(engine)
        waiter = start_waiter(engine, proc)
        assert trigger_snapshot(engine, timeout=DEADLINE) == "error"
        assert platform.triggers == []
        os.write(platform.master, b"error\n")  # an operator's checkpoint failed
        wait_for(lambda: waiter.status()["answers"] >= 1, what="the answer handled")
        assert [(c["kind"], c["reason"]) for c in rec.calls] == [("resume", "gvisor"),
                                                                 ("resume", "gvisor")]
        last = waiter._last
        assert last is not None and last[0] == "error" and last[1] is not None
        assert not last[1].deduplicated
    finally:
        engine.stop()
        platform.close()


@pytest.mark.parametrize("second", ["resume", "restore", "error"])
def test_a_late_error_for_attempt_one_does_not_undo_the_retry_pass(
        sandbox: Sandbox, engine: Lifecycle, monkeypatch: pytest.MonkeyPatch,
        second: str) -> None:
    """Attempt 1's ``notify save`` fails (carry-on run), gVisor answers ``error`` for it,
    and the platform retries at once: attempt 2's ``notify save`` (a new before-snapshot
    pass) runs before the waiter thread has handled attempt 1's ``error``. That late answer
    belongs to attempt 1's pass: it ran the resume hooks while attempt 2's checkpoint was
    pending (undoing attempt 2's pass) before the fix."""
    fail = [True]
    _failing_pass(engine, fail)
    retried = threading.Event()
    arrived = threading.Event()
    real = engine.restore_detected

    def slow_waiter(name: str, **kwargs: Any) -> Any:
        if name == "gvisor" and not retried.is_set():
            arrived.set()  # the waiter read attempt 1's answer; the thread is slow now
            assert retried.wait(DEADLINE), "attempt 2 did not come"
        return real(name, **kwargs)

    monkeypatch.setattr(engine, "restore_detected", slow_waiter)
    first = request("prepare-snapshot", socket_path=sandbox.socket,
                    fields=IN_CHECKPOINT)
    assert first["ok"] is False
    assert sandbox.runs() == [("resume", "control", 0.0)]
    answer(sandbox.waiter, b"error\n")  # gVisor: attempt 1 failed
    assert arrived.wait(DEADLINE)

    fail[0] = False  # attempt 2's before-snapshot pass succeeds
    assert request("prepare-snapshot", socket_path=sandbox.socket,
                   fields=IN_CHECKPOINT)["ok"] is True
    retried.set()
    wait_for(lambda: sandbox.waiter.status()["answers"] >= 1, what="attempt 1's answer")
    assert sandbox.runs() == [("resume", "control", 0.0)], "attempt 2's pass was undone"
    assert engine.status().state == "snapshotting" and not engine.is_ready()
    late = sandbox.waiter_report()
    assert late.deduplicated and late.reason == "control"

    sandbox.gvisor_answers(f"{second}\n".encode())  # attempt 2's own answer
    kind = "restore" if second == "restore" else "resume"
    assert [(k, r) for k, r, _ in sandbox.runs()] == [("resume", "control"), (kind, "gvisor")]
    assert not sandbox.waiter_report().deduplicated
    assert engine.is_ready()


def test_a_hand_run_failing_save_does_not_swallow_a_later_checkpoints_error(
        sandbox: Sandbox, engine: Lifecycle) -> None:
    """``rehydrate notify save`` run by hand fails: nothing checkpoints after it, so no
    ``error`` is due for it. A later, unrelated checkpoint (no ``notify save`` of its own)
    that fails answers ``error`` on the same descriptor: it may have paused the sandbox,
    and its resume hooks must run (before: it was taken for the hand-run save's abort,
    and nothing ran)."""
    _failing_pass(engine)
    saved = sandbox.notify_save(by_hand=True)
    assert saved.returncode == 1, (saved.stdout, saved.stderr)
    assert sandbox.runs() == [("resume", "control", 0.0)]

    sandbox.gvisor_answers(b"error\n")  # some other checkpoint failed, later
    assert sandbox.runs() == [("resume", "control", 0.0), ("resume", "gvisor", None)]
    report = sandbox.waiter_report()
    assert not report.deduplicated and report.confirmed_by == ()
    assert engine.is_ready()


def test_a_bad_in_checkpoint_value_is_refused_before_any_hook_runs(
        sandbox: Sandbox, engine: Lifecycle) -> None:
    _failing_pass(engine)
    reply = request("prepare-snapshot", socket_path=sandbox.socket,
                    fields={"in_checkpoint": "yes"})
    assert reply == {"ok": False,
                     "error": 'bad request: "in_checkpoint" must be true or false'}
    assert sandbox.runs() == [] and engine.status().state == "running"
