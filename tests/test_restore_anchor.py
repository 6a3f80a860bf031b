"""Freeze anchors and the snapshot deadline (lifecycle engine).

Only runs that follow a real freeze ("anchored") take part in ``since`` de-duplication:
a simulated run, or a "carry on" resume after a checkpoint that never happened, must not
make a later real restore look already handled.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rehydrate import Lifecycle, Registry
from rehydrate._cli import main as cli_main
from rehydrate._control_client import request
from rehydrate._lifecycle import DEFAULT_SNAPSHOT_DEADLINE
from rehydrate.detect.control import ControlServer
from rehydrate.env import EnvRefresher

DEADLINE = 10.0
REPO = Path(__file__).resolve().parents[1]


def _runs(engine: Lifecycle) -> list[tuple[str, str, int]]:
    runs: list[tuple[str, str, int]] = []
    engine.registry.after_restore(
        lambda ctx: runs.append((ctx.reason, ctx.kind, ctx.generation)), name="test.runs")
    return runs


@pytest.fixture
def control(rehydrate_engine: Lifecycle, tmp_path: Path) -> Iterator[ControlServer]:
    """The engine's control socket, as ``rehydrate notify`` reaches it."""
    server = ControlServer(rehydrate_engine, str(tmp_path / "c.sock"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_simulated_restore_does_not_hide_a_real_restore(rehydrate_engine: Lifecycle) -> None:
    runs = _runs(rehydrate_engine)
    since = time.monotonic()  # a detector last saw the process before the simulation
    rehydrate_engine.simulate_restore()
    assert rehydrate_engine.last_restore_at is None
    report = rehydrate_engine.restore_detected("gvisor", since=since)
    assert report.reason == "gvisor" and report.generation == 2
    assert runs == [("simulated", "restore", 1), ("gvisor", "restore", 2)]
    assert rehydrate_engine.last_restore_at is not None


def test_carry_on_resume_is_not_an_anchor(rehydrate_engine: Lifecycle) -> None:
    runs = _runs(rehydrate_engine)
    since = time.monotonic()
    rehydrate_engine.restore_detected("control", kind="resume", anchor=False)
    report = rehydrate_engine.restore_detected("clock-jump", since=since)
    assert (report.reason, report.generation) == ("clock-jump", 1)
    assert [r[0] for r in runs] == ["control", "clock-jump"]
    # An anchored run still merges a second notice of the same restore.
    dup = rehydrate_engine.restore_detected("identity", since=since)
    assert dup.deduplicated and dup.started_at == report.started_at and len(runs) == 2


# -- freeze watch: readiness and "no new freeze since" de-duplication ----------------------


def test_freeze_watch_readiness_and_late_notices(
        rehydrate_engine: Lifecycle, control: ControlServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 10: a stale heartbeat means not ready; a late ``notify restore`` without a
    ``notify save`` after the clock jump ran is a duplicate (flagged in the reply, the
    text and ``confirmed_by``); after another freeze the same notice runs again."""
    engine = rehydrate_engine
    runs = _runs(engine)
    t = time.monotonic()
    engine.heartbeat(t - 10, 1.0)  # the watch began
    engine.heartbeat(t - 3, 1.0)   # the last heartbeat before a freeze
    assert not engine.is_ready() and not engine.wait_ready(timeout=0.01)
    assert engine.status().state == "restoring" and not engine.status().ready
    engine.freeze_noticed(t - 3, t)  # what the clock-jump detector does, then its run
    first = engine.restore_detected("clock-jump", since=t - 3, detected_at=t)
    assert engine.is_ready() and first.generation == 1

    reply = request("restore", socket_path=control.path)
    assert reply["ok"] and reply["deduplicated"] is True, reply
    assert reply["report"]["reason"] == "clock-jump"
    assert reply["report"]["confirmed_by"] == ["control"]
    assert engine.status().last_report.confirmed_by == ("control",)
    assert cli_main(["notify", "restore", "--socket", control.path]) == 0
    assert "de-duplicated" in capsys.readouterr().out
    assert runs == [("clock-jump", "restore", 1)]

    # The clone is checkpointed and restored again: a new freeze, noticed first by
    # the notice itself (the heartbeat is late): a new restore.
    engine.heartbeat(time.monotonic(), 0.05)  # the last heartbeat before that freeze
    deadline = time.monotonic() + 5
    while engine.is_ready():  # the heartbeat goes stale: the process "was frozen"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    reply = request("restore", socket_path=control.path)
    assert reply["deduplicated"] is False and reply["report"]["generation"] == 2
    assert runs == [("clock-jump", "restore", 1), ("control", "restore", 2)]
    engine.heartbeat(time.monotonic(), 1.0)
    assert engine.is_ready()


def test_a_clone_resumed_after_notify_save_says_restoring_not_snapshotting(
        rehydrate_engine: Lifecycle) -> None:
    """After ``notify save`` the state is ``snapshotting``; a clone that has just resumed
    (the freeze watch's heartbeat is stale, no notice handled yet) says ``restoring`` as
    the docs promise — the pass is over, the restore is what comes."""
    engine = rehydrate_engine
    t = time.monotonic()
    engine.heartbeat(t - 10, 1.0)  # the watch began
    assert engine.simulate_snapshot().ok
    engine.heartbeat(time.monotonic(), 1.0)
    assert engine.status().state == "snapshotting"  # the pass, not frozen yet
    engine.heartbeat(time.monotonic() - 3, 1.0)  # the last heartbeat before the freeze
    status = engine.status()
    assert (status.state, status.ready) == ("restoring", False)
    assert engine.state == "snapshotting"  # the engine's own state is unchanged
    engine.freeze_noticed(t - 3, time.monotonic())
    engine.heartbeat(time.monotonic(), 1.0)
    assert engine.status().state == "restoring"  # noticed, not handled yet
    report = engine.restore_detected("clock-jump", since=t - 3)
    assert report.ok and engine.status().state == "ready"


def _notice_waiting_for_the_watcher(engine: Lifecycle,
                                    path: str) -> tuple[threading.Thread, list[dict]]:
    """``notify restore`` sent on a thread; returns once it waits for the watcher's next
    heartbeat (its verdict on an overdue one)."""
    replies: list[dict] = []
    thread = threading.Thread(target=lambda: replies.append(request("restore",
                                                                    socket_path=path)))
    thread.start()
    deadline = time.monotonic() + DEADLINE
    while engine._verdict_waiters == 0:
        assert time.monotonic() < deadline, f"the notice did not wait: {replies}"
        assert thread.is_alive(), f"the notice did not wait: {replies}"
        time.sleep(0.01)
    return thread, replies


def _overdue(since: float, by: float) -> None:
    while time.monotonic() - since <= by:
        time.sleep(0.02)


def test_a_clone_of_a_clone_noticed_first_by_notify_restore_is_a_new_restore(
        rehydrate_engine: Lifecycle, control: ControlServer) -> None:
    """Original -> A -> B. B's memory is A's: A's restore report, and A's freeze watch
    whose last known freeze is the one before A's restore. Before: a ``notify restore``
    reaching B before B's clock-jump thread had woken (a freeze shorter than the readiness
    limit, interval + threshold) got ``since`` = that old freeze, so B's restore was taken
    for A's: ``deduplicated``, no hooks ever ran in B (A's keys, A's instance id, A's
    environment, generation 1). The heartbeat is overdue by more than a sleep and the gap
    slack: the notice waits for the watcher's verdict — here a gap — and is a new restore."""
    engine = rehydrate_engine
    runs = _runs(engine)
    t = time.monotonic()
    # limit 30 s (a high threshold): B's freeze is shorter, only a gap for the watcher
    engine.heartbeat(t - 20, 30.0, due=0.3)  # the original's watch began
    engine.heartbeat(t - 15, 30.0, due=0.3)  # its last heartbeat before its checkpoint
    engine.freeze_noticed(t - 15, t - 10)  # A resumed: its clock jump runs the hooks
    a = engine.restore_detected("clock-jump", since=t - 15, detected_at=t - 10)
    assert a.generation == 1
    last = time.monotonic()
    engine.heartbeat(last, 30.0, due=0.3)  # A's last heartbeat before its checkpoint
    _overdue(last, 0.6)  # A is checkpointed, B restored from it
    # B runs; its watcher has not woken yet when the platform's notice comes...
    thread, replies = _notice_waiting_for_the_watcher(engine, control.path)
    # ... then it wakes: the step, shorter than the threshold, is a gap
    engine.heartbeat(time.monotonic(), 30.0, gap_since=last, due=0.3)
    thread.join(DEADLINE)
    [reply] = replies
    assert reply["deduplicated"] is False, reply
    assert (reply["report"]["reason"], reply["report"]["generation"]) == ("control", 2)
    assert runs == [("clock-jump", "restore", 1), ("control", "restore", 2)]
    # A second notice of B's restore is B's, not a third restore.
    engine.heartbeat(time.monotonic(), 30.0, due=30.0)
    again = request("restore", socket_path=control.path)
    assert again["deduplicated"] is True and again["report"]["generation"] == 2, again
    assert len(runs) == 2


def test_a_late_notice_while_the_watcher_waits_for_the_gil_is_a_duplicate(
        rehydrate_engine: Lifecycle, control: ControlServer) -> None:
    """One restore, run by the clock jump; the platform's ``notify restore`` for it comes
    while the watcher's next heartbeat is overdue but not stale (it waits for the GIL held
    by a long C call, for a CPU, or for a blocked log write). Before: an overdue heartbeat
    was taken for a freeze, and the duplicate notice ran the hooks a second time
    (generation 2, keys rotated twice). Now the notice waits for the watcher's verdict:
    a stall, no gap — the same restore."""
    engine = rehydrate_engine
    runs = _runs(engine)
    t = time.monotonic()
    engine.heartbeat(t - 10.5, 30.0, due=0.3)
    engine.heartbeat(t - 10, 30.0, due=0.3)  # the last heartbeat before the checkpoint
    engine.freeze_noticed(t - 10, t)  # restored: the watcher woke, a 10 s step
    engine.restore_detected("clock-jump", since=t - 9.5, detected_at=t)
    beat = time.monotonic()
    engine.heartbeat(beat, 30.0, due=0.3)  # the watcher's beat after the run
    _overdue(beat, 0.6)  # its next one is late: the GIL
    thread, replies = _notice_waiting_for_the_watcher(engine, control.path)
    engine.heartbeat(time.monotonic(), 30.0, due=0.3)  # a stall: no gap
    thread.join(DEADLINE)
    [reply] = replies
    assert reply["deduplicated"] is True, reply
    assert runs == [("clock-jump", "restore", 1)]


def test_a_notice_whose_watcher_never_beats_again_is_a_new_restore(
        rehydrate_engine: Lifecycle, control: ControlServer) -> None:
    """The overdue heartbeat never comes before it would be stale: for all the watch can
    tell the process was frozen since, so the notice is a new restore (at worst twice,
    never zero) — after waiting no longer than the heartbeat's limit."""
    engine = rehydrate_engine
    runs = _runs(engine)
    t = time.monotonic()
    engine.heartbeat(t - 10, 1.0, due=0.3)
    engine.freeze_noticed(t - 10, t)
    engine.restore_detected("clock-jump", since=t - 9.5, detected_at=t)
    beat = time.monotonic()
    engine.heartbeat(beat, 1.0, due=0.3)
    _overdue(beat, 0.4)
    reply = request("restore", socket_path=control.path)
    assert reply["deduplicated"] is False, reply
    assert time.monotonic() - beat > 1.0  # it waited for the heartbeat's limit
    assert runs == [("clock-jump", "restore", 1), ("control", "restore", 2)]


def test_a_heartbeat_read_before_the_freeze_is_no_verdict(
        rehydrate_engine: Lifecycle, control: ControlServer) -> None:
    """The watcher read its clock just before the checkpoint (a normal step, no gap) and
    was frozen before it called ``heartbeat()``; in the clone that heartbeat arrives while
    a notice waits for the verdict. Before: any heartbeat was the verdict, this one said
    "no gap", and the clone's restore was taken for its parent's (no hooks ever ran). A
    verdict must come from a heartbeat that is current again; none came, so the notice is
    a new restore once the heartbeat would be stale."""
    engine = rehydrate_engine
    runs = _runs(engine)
    t = time.monotonic()
    engine.heartbeat(t - 20, 1.5, due=0.3)
    engine.freeze_noticed(t - 20, t - 10)
    engine.restore_detected("clock-jump", since=t - 20, detected_at=t - 10)  # the parent's
    read = time.monotonic()  # the watcher's reading, just before the clone's checkpoint
    _overdue(read, 0.4)  # the clone resumed; its watcher has not run yet
    thread, replies = _notice_waiting_for_the_watcher(engine, control.path)
    assert not engine.is_ready()  # a notice is waiting: readiness must not say True
    engine.heartbeat(read, 1.5, due=0.3)  # the heartbeat in flight, from before the freeze
    thread.join(DEADLINE)
    [reply] = replies
    assert reply["deduplicated"] is False, reply
    assert runs == [("clock-jump", "restore", 1), ("control", "restore", 2)]


def test_a_notice_racing_slow_restore_hooks_is_that_restore(rehydrate_engine: Lifecycle,
                                                            tmp_path: Path) -> None:
    """The clock jump runs a restore whose hooks take longer than the readiness limit (a
    connection with a slow peer); ``notify restore`` for the same restore arrives while
    they run. Before: the heartbeat (last set when the freeze was noticed) was stale by
    then, so the notice's ``since`` was the very moment the run was detected, not before
    it: the hooks ran a second time (generation 2, keys rotated twice). The watcher beats
    during runs now; here it is late (a hook holding the GIL): the notice waits for its
    verdict — a stall, no gap — and is that restore."""
    engine = rehydrate_engine
    runs = _runs(engine)
    server = ControlServer(engine, str(tmp_path / "c.sock"))
    server.start()
    replies: list[dict[str, object]] = []
    t = time.monotonic()

    def slow(ctx: object) -> None:
        if len(runs) != 1:
            return
        # The clock jump's run; the heartbeat goes stale (limit 1 s) while it runs...
        while time.monotonic() - t <= 1.2:
            time.sleep(0.01)
        # ... and the platform's notice for this restore comes: it waits for the
        # watcher's verdict on the overdue heartbeat ...
        threading.Thread(target=lambda: replies.append(
            request("restore", socket_path=server.path)), daemon=True).start()
        deadline = time.monotonic() + 10
        while engine._verdict_waiters == 0:
            assert time.monotonic() < deadline, f"the notice did not wait: {replies}"
            time.sleep(0.01)
        engine.heartbeat(time.monotonic(), 1.0, due=1.0)  # a stall: no gap
        # ... takes its ``since`` and waits for this run (the engine counts it then).
        while engine._notices < 2:
            assert time.monotonic() < deadline, "the notice never reached the engine"
            time.sleep(0.01)

    engine.registry.after_restore(slow, name="test.slow")
    try:
        engine.heartbeat(t - 10, 1.0, due=1.0)
        engine.heartbeat(t - 3, 1.0, due=1.0)  # the last heartbeat before the freeze
        engine.freeze_noticed(t - 3, t)
        first = engine.restore_detected("clock-jump", since=t - 3, detected_at=t)
        deadline = time.monotonic() + 10
        while not replies:
            assert time.monotonic() < deadline, "no reply to the racing notice"
            time.sleep(0.01)
        assert replies[0]["deduplicated"] is True, replies
        assert runs == [("clock-jump", "restore", 1)]
        assert first.generation == 1 and engine.generation == 1
        # the same just after the run, the watcher beating on (no gap)
        engine.heartbeat(time.monotonic(), 30.0, due=30.0)
        late = request("restore", socket_path=server.path)
        assert late["deduplicated"] is True and len(runs) == 1, late
    finally:
        server.stop()


def test_a_notice_in_a_clone_made_mid_run_is_that_clone_s_restore(
        rehydrate_engine: Lifecycle, control: ControlServer) -> None:
    """The clock jump runs A's restore; while its hooks run, A is checkpointed and clone
    B restored from that image: B wakes in A's run, with A's freeze noticed and being
    handled and the heartbeat overdue. The platform's ``notify restore`` reaches B before
    B's watcher has woken. Before: a freeze being handled answered every notice ("that
    freeze"), so B's restore was taken for A's — ``deduplicated``, B's hooks never ran
    (A's keys). Now the notice waits for the watcher's verdict: it notices B's freeze,
    and the notice runs B's hooks once more, after A's run; the watcher's own notice of
    that freeze is then the duplicate."""
    engine = rehydrate_engine
    runs = _runs(engine)
    entered, release = threading.Event(), threading.Event()

    def slow(ctx: object) -> None:
        if len(runs) == 1:
            entered.set()
            release.wait(DEADLINE)

    engine.registry.after_restore(slow, name="test.slow", timeout=60)
    t = time.monotonic()
    engine.heartbeat(t - 10, 1.0, due=0.3)  # the original's last heartbeat
    engine.freeze_noticed(t - 10, t)  # A resumed: its clock jump reports the restore
    a_run = threading.Thread(target=lambda: engine.restore_detected(
        "clock-jump", since=t - 9.5, detected_at=t))
    a_run.start()
    replies: list[dict] = []
    notice = threading.Thread(target=lambda: replies.append(
        request("restore", socket_path=control.path)))
    try:
        assert entered.wait(DEADLINE), "A's hooks did not run"
        last = time.monotonic()
        engine.heartbeat(last, 1.0, due=0.3)  # the watch beats during the run ...
        _overdue(last, 0.4)  # ... until A is checkpointed; B resumes from that image
        notice.start()
        deadline = time.monotonic() + DEADLINE
        while engine._verdict_waiters == 0 and engine._notices < 2:
            assert time.monotonic() < deadline, f"the notice did not arrive: {replies}"
            time.sleep(0.01)
        woke = time.monotonic()
        engine.freeze_noticed(last, woke)  # B's watcher wakes: a step, B's restore
        assert not engine.is_ready()
    finally:
        release.set()
        notice.join(DEADLINE)
        a_run.join(DEADLINE)
    [reply] = replies
    assert reply["deduplicated"] is False, reply
    assert (reply["report"]["reason"], reply["report"]["generation"]) == ("control", 2)
    assert runs == [("clock-jump", "restore", 1), ("control", "restore", 2)]
    assert engine.is_ready()
    # the watcher's own notice of B's freeze comes after: B's restore, run already
    dup = engine.restore_detected("clock-jump", since=last + 0.1, detected_at=woke)
    assert dup.deduplicated and dup.reason == "control" and len(runs) == 2


@pytest.mark.parametrize("watcher", ["notices a freeze", "was stalled"])
def test_a_notice_right_after_a_run_with_the_watch_late_waits_for_its_verdict(
        rehydrate_engine: Lifecycle, control: ControlServer, watcher: str) -> None:
    """The clock jump's run ends with its watcher's heartbeat overdue; a notice comes
    before the watcher's next one. Either the run spanned a freeze — a clone made
    mid-run finishes its parent's run before its watcher wakes, and the notice must not
    be taken for the parent's restore (the end of the run made the watch look current) —
    or the watcher was stalled (a hook holding the GIL past the readiness limit), and
    the notice is that run's restore (the stale heartbeat alone made it a new one). The
    notice waits for the watcher's verdict either way."""
    engine = rehydrate_engine
    runs = _runs(engine)
    t = time.monotonic()
    engine.heartbeat(t - 10, 1.0, due=0.3)
    engine.freeze_noticed(t - 10, t)  # the restore; the watch beats during its run ...
    last = time.monotonic()
    engine.heartbeat(last, 1.0, due=0.3)
    frozen = watcher == "notices a freeze"
    _overdue(last, 0.4 if frozen else 1.1)  # ... until a checkpoint, or a GIL stall
    engine.restore_detected("clock-jump", since=t - 9.5, detected_at=t)  # the run ends
    thread, replies = _notice_waiting_for_the_watcher(engine, control.path)
    if frozen:
        engine.freeze_noticed(last, time.monotonic())  # the clone's freeze
    else:
        engine.heartbeat(time.monotonic(), 1.0, due=0.3)  # a stall: no gap
    thread.join(DEADLINE)
    [reply] = replies
    assert reply["deduplicated"] is not frozen, reply
    assert runs == [("clock-jump", "restore", 1)] + (
        [("control", "restore", 2)] if frozen else []), runs


def test_a_run_after_the_last_heartbeat_is_not_the_next_clone_s_restore(
        rehydrate_engine: Lifecycle, control: ControlServer) -> None:
    """A's restore notice (``notify restore``) runs A's hooks less than a sleep after A's
    watcher last beat; A is checkpointed before it beats again, and B's notice comes
    before B's watcher wakes: stale, frozen since — since the end of A's run, not since
    that heartbeat, which came before A's run (taken from it, B's restore was A's)."""
    engine = rehydrate_engine
    runs = _runs(engine)
    beat = time.monotonic()
    engine.heartbeat(beat, 1.0, due=0.3)  # A's watcher, just before A's notice
    engine.restore_detected("control")  # A's restore
    _overdue(beat, 1.1)  # A is checkpointed; B resumes, its watcher not awake yet
    reply = request("restore", socket_path=control.path)
    assert reply["deduplicated"] is False, reply
    assert runs == [("control", "restore", 1), ("control", "restore", 2)]


def test_a_forked_child_does_not_inherit_the_freeze_watch(rehydrate_engine: Lifecycle) -> None:
    """The parent's heartbeat thread does not exist in a fork()ed child: the child must
    not look frozen for ever."""
    engine = rehydrate_engine
    # A beat already stale: the child checks and exits at once. A child of this
    # many-threaded test process (gRPC, torch, gevent loaded by earlier tests) that lived
    # on for a while was once killed by SIGSEGV in a thread some library's fork handler
    # started in it.
    engine.heartbeat(time.monotonic() - 1.0, 0.05)
    assert not engine.is_ready()  # the parent: frozen by its watch's reckoning
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if it is ready though the beat is stale
        os._exit(0 if engine.is_ready() and engine.wait_ready(timeout=1) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    engine.heartbeat_stopped()


# -- snapshot deadline -------------------------------------------------------------------


def _engine(**kw: object) -> Lifecycle:
    return Lifecycle(Registry(), env=EnvRefresher(path=None), **kw)  # type: ignore[arg-type]


def test_state_stays_snapshotting_without_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REHYDRATE_SNAPSHOT_DEADLINE", "off")
    engine = _engine()
    try:
        assert engine.snapshot_deadline is None
        assert engine.simulate_snapshot().ok
        assert engine.state == "snapshotting"
        assert not engine.wait_ready(timeout=0.3)
    finally:
        engine.close()


def test_snapshot_deadline_runs_resume_hooks(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rehydrate")
    engine = _engine(snapshot_deadline=0.2)
    runs = _runs(engine)
    try:
        t0 = time.monotonic()
        assert engine.simulate_snapshot().ok
        assert engine.state == "snapshotting"
        assert engine.wait_ready(timeout=DEADLINE)
        assert time.monotonic() - t0 >= 0.2
        assert runs == [("snapshot-deadline", "resume", 0)]
        assert engine.state == "ready" and engine.generation == 0
        assert engine.last_restore_at is None, "no freeze happened: not an anchor"
        # ... and the run says so to its hooks (the game's tick clock jumped on None).
        assert engine.status().last_report.frozen_for == 0.0
        assert any("snapshot_deadline" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()


def test_snapshot_deadline_cancelled_by_restore_and_by_failure() -> None:
    engine = _engine(snapshot_deadline=0.3)
    runs = _runs(engine)
    try:
        assert engine.simulate_snapshot().ok
        engine.restore_detected("control", kind="resume")
        # Wait past the deadline: the watch saw the resume and ended.
        end = time.monotonic() + 0.8
        while time.monotonic() < end:
            time.sleep(0.05)
        assert runs == [("control", "resume", 0)]

        @engine.registry.before_snapshot(name="boom")
        def boom() -> None:
            raise RuntimeError("cannot close")

        assert not engine.simulate_snapshot().ok  # degraded: no watch armed
        end = time.monotonic() + 0.8
        while time.monotonic() < end:
            time.sleep(0.05)
        assert runs == [("control", "resume", 0)] and engine.state == "degraded"
    finally:
        engine.close()


def test_snapshot_deadline_from_environment(monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("REHYDRATE_SNAPSHOT_DEADLINE", "12.5")
    engine = _engine()
    assert engine.snapshot_deadline == 12.5
    engine.close()
    for off in ("off", "none"):
        monkeypatch.setenv("REHYDRATE_SNAPSHOT_DEADLINE", off)
        engine = _engine()
        assert engine.snapshot_deadline is None
        engine.close()
    # Issue 10: bounded by default, the last resort when no resume notice ever comes.
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv("REHYDRATE_SNAPSHOT_DEADLINE")
        else:
            monkeypatch.setenv("REHYDRATE_SNAPSHOT_DEADLINE", unset)
        engine = _engine()
        assert engine.snapshot_deadline == DEFAULT_SNAPSHOT_DEADLINE
        engine.close()
    caplog.set_level(logging.WARNING, logger="rehydrate")
    # 0 is not "off": the documented rule is > 0 or off (0.0 was a bad value already)
    for bad in ("soon", "-3", "nan", "inf", "0", "0.0"):
        monkeypatch.setenv("REHYDRATE_SNAPSHOT_DEADLINE", bad)
        engine = _engine()
        assert engine.snapshot_deadline == DEFAULT_SNAPSHOT_DEADLINE
        engine.close()
    assert sum("REHYDRATE_SNAPSHOT_DEADLINE" in r.getMessage() for r in caplog.records) == 6
    with pytest.raises(ValueError, match="snapshot_deadline"):
        _engine(snapshot_deadline=float("nan"))


CHILD = """
import json, os, signal, sys, time
from rehydrate import Lifecycle, Registry
from rehydrate._cli import main as cli_main
from rehydrate._control_client import request
from rehydrate.detect.control import ControlServer
from rehydrate.env import EnvRefresher
from rehydrate._lifecycle import DEFAULT_SNAPSHOT_DEADLINE
engine = Lifecycle(Registry(), env=EnvRefresher(path=None), snapshot_deadline=2.0)
runs = []
engine.registry.after_restore(lambda ctx: runs.append((ctx.reason, ctx.kind)))
engine.simulate_snapshot()
# Frozen at once: a parent that stops us on reading "armed" may, on a loaded box, come
# later than the deadline. The parent keeps us stopped and continues us.
os.kill(os.getpid(), signal.SIGSTOP)
end = time.monotonic() + 0.3
while time.monotonic() < end:
    time.sleep(0.05)
print(json.dumps({"state": engine.state, "runs": runs}), flush=True)
ready = engine.wait_ready(30)
print(json.dumps({"ready": ready, "runs": runs}), flush=True)
"""


def test_snapshot_deadline_starts_again_after_a_freeze() -> None:
    """A freeze (SIGSTOP here, a checkpoint for real) gives the detectors a whole deadline
    from its end: the deadline must not fire just because the clock stepped past it while
    frozen. When nothing came by then (a stall the detectors did not count, an answer that
    never came), the deadline runs the restore hooks — the freeze may have made this
    process a clone. Before, the watch ended at the freeze, and such a process stayed
    snapshotting for good."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                             text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None
        give_up = time.monotonic() + 60
        while True:  # until the child has stopped itself right after arming the deadline
            pid, status = os.waitpid(child.pid, os.WNOHANG | os.WUNTRACED)
            if pid:
                assert os.WIFSTOPPED(status), f"child ended before stopping ({status})"
                break
            assert time.monotonic() < give_up, "the child never stopped itself"
            time.sleep(0.01)
        end = time.monotonic() + 3.5  # frozen for longer than the deadline (and a slice)
        while time.monotonic() < end:
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGCONT)
        line = child.stdout.readline()
        assert json.loads(line) == {"state": "snapshotting", "runs": []}, line
        line = child.stdout.readline()
        assert json.loads(line) == {"ready": True,
                                    "runs": [["snapshot-deadline", "restore"]]}, line
    finally:
        child.kill()
        child.wait(DEADLINE)


def test_a_restore_after_a_new_snapshot_pass_is_never_the_previous_one(
        rehydrate_engine: Lifecycle) -> None:
    """Before: a clone of a snapshot taken within a notice's window (2 s for the signal
    and file detectors) after the previous restore was taken for that restore: its hooks
    never ran (no reseed, no new keys), the generation stayed, and it stayed
    ``snapshotting`` — not ready — until the snapshot deadline."""
    engine = rehydrate_engine
    engine.snapshot_deadline = None
    runs: list[int] = []
    engine.registry.after_restore(name="reseed")(lambda ctx: runs.append(ctx.generation))
    first = engine.restore_detected("signal", since=time.monotonic() - 2.0)
    assert first.ok and runs == [1]
    assert engine.snapshot_requested("control").ok  # the warmed clone is snapshotted again
    # the new clone's notice: its window reaches back before the first restore
    second = engine.restore_detected("signal", since=time.monotonic() - 2.0)
    assert not second.deduplicated
    assert runs == [1, 2] and engine.generation == 2
    assert engine.is_ready() and engine.status().state == "ready"
    # and a second notice of that same restore is still recognised as it
    again = engine.restore_detected("file", since=time.monotonic() - 2.0)
    assert again.deduplicated and runs == [1, 2]


def test_a_late_heartbeat_wakes_a_waiter_that_saw_it_stale(rehydrate_engine: Lifecycle
                                                           ) -> None:
    """Before: ``heartbeat()`` woke waiters only when the beat was stale by the watcher's
    own reading; one read just inside the limit but delivered just after it (GIL, a log
    write) woke nobody, and ``wait_ready()`` slept through a ready engine."""
    import threading

    engine = rehydrate_engine
    t0 = time.monotonic()
    engine.heartbeat(t0, 1.0)
    while time.monotonic() - t0 <= 1.0:  # the watcher is late: not ready meanwhile
        time.sleep(0.01)
    assert not engine.is_ready()
    returned: list[tuple[bool, float]] = []
    waiter = threading.Thread(
        target=lambda: returned.append((engine.wait_ready(10), time.monotonic())))
    waiter.start()
    engine.heartbeat(t0 + 0.9, 1.0)  # read at t0 + 0.9, delivered now
    waiter.join(15)
    assert returned and returned[0][0] is True
    assert returned[0][1] < t0 + 1.9, "woken only by a later change, not by this heartbeat"


# -- carry-on notices that name a before-snapshot pass (``undoes``) ------------------------


def _failing_snapshot(engine: Lifecycle) -> None:
    @engine.registry.before_snapshot(name="test.flush")
    def flush() -> None:
        raise RuntimeError("disk full")


def test_an_abort_answer_confirms_the_carry_on_that_announced_the_abort(
        rehydrate_engine: Lifecycle) -> None:
    """``notify save`` failed: its carry-on run told the platform to abort; the platform's
    answer that the checkpoint failed (gVisor's ``error``) runs nothing again."""
    runs = _runs(rehydrate_engine)
    _failing_snapshot(rehydrate_engine)
    opened = time.monotonic()  # the waiter's descriptor, opened before the pass
    before_pass = time.monotonic()
    assert not rehydrate_engine.snapshot_requested("control").ok
    carried = rehydrate_engine.restore_detected("control", kind="resume", anchor=False,
                                                frozen_for=0.0, undoes=before_pass,
                                                abort="announced")
    dup = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                            undoes=opened, abort="answered")
    assert runs == [("control", "resume", 0)]
    assert dup.deduplicated and dup.started_at == carried.started_at
    assert dup.confirmed_by == ("gvisor",)
    assert rehydrate_engine.status().last_report.confirmed_by == ("gvisor",)
    # A descriptor opened after that pass is not about it: a later failure runs again.
    later = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                              undoes=time.monotonic(), abort="answered")
    assert not later.deduplicated and [r[0] for r in runs] == ["control", "gvisor"]


def test_a_carry_on_for_a_pass_an_answer_already_undid_is_a_confirmation(
        rehydrate_engine: Lifecycle) -> None:
    runs = _runs(rehydrate_engine)
    _failing_snapshot(rehydrate_engine)
    before_pass = time.monotonic()
    assert not rehydrate_engine.snapshot_requested("control").ok
    first = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                              undoes=before_pass, abort="answered")
    second = rehydrate_engine.restore_detected("control", kind="resume", anchor=False,
                                               frozen_for=0.0, undoes=before_pass,
                                               abort="announced")
    assert runs == [("gvisor", "resume", 0)]
    assert not first.deduplicated and second.deduplicated
    assert second.confirmed_by == ("control",)


def test_an_abort_answer_after_a_run_that_announced_no_abort_runs_again(
        rehydrate_engine: Lifecycle) -> None:
    """A pass ended by a run that expected no checkpoint (the trigger's carry-on, the
    snapshot deadline): whether a later failed checkpoint paused the sandbox is not known,
    so its ``error`` runs the hooks."""
    runs = _runs(rehydrate_engine)
    opened = time.monotonic()
    assert rehydrate_engine.simulate_snapshot().ok
    rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False, frozen_for=0.0)
    again = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                              undoes=opened, abort="answered")
    assert not again.deduplicated and len(runs) == 2


@pytest.mark.parametrize("attempt_one", ["failed", "ok"])
def test_an_answer_for_an_earlier_pass_does_not_undo_the_latest_one(
        rehydrate_engine: Lifecycle, attempt_one: str) -> None:
    """A checkpoint retried before the waiter handled the first attempt's ``error``: that
    answer names the first pass after its descriptor was opened, not the retry's pass,
    which stays pending (before: the resume hooks ran and undid the retry's pass)."""
    runs = _runs(rehydrate_engine)
    fail = [attempt_one == "failed"]

    @rehydrate_engine.registry.before_snapshot(name="test.flush")
    def flush() -> None:
        if fail[0]:
            raise RuntimeError("disk full")

    opened = time.monotonic()  # the waiter's descriptor, before attempt 1
    first = rehydrate_engine.snapshot_requested("control")
    if attempt_one == "failed":
        assert not first.ok
        rehydrate_engine.restore_detected("control", kind="resume", anchor=False,
                                          frozen_for=0.0, undoes=opened,
                                          abort="announced")
    fail[0] = False
    reopened = time.monotonic()  # the waiter's next descriptor, before attempt 2
    assert rehydrate_engine.snapshot_requested("control").ok  # attempt 2
    late = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                             undoes=opened, abort="answered",
                                             detected_at=reopened)
    assert late.deduplicated
    assert len(runs) == (1 if attempt_one == "failed" else 0)
    assert rehydrate_engine.status().state == "snapshotting"
    assert not rehydrate_engine.is_ready()
    # Attempt 2's own answer (on the descriptor opened before it) runs them.
    own = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                            undoes=reopened, abort="answered")
    assert not own.deduplicated and runs[-1] == ("gvisor", "resume", 0)
    assert rehydrate_engine.is_ready()


@pytest.mark.parametrize("between", ["simulated", "simulated-20-times", "failed-trigger"])
def test_a_pass_nobody_checkpointed_does_not_swallow_a_later_checkpoints_error(
        rehydrate_engine: Lifecycle, between: str) -> None:
    """A pass no checkpoint followed (a simulated snapshot and resume, or a before-snapshot
    pass that failed and carried on without announcing an abort) began after the waiter's
    descriptor was opened; then a real checkpoint's pass, and gVisor answers ``error``
    for it. The answer is that checkpoint's: the resume hooks run and the process is
    ready (before: it named the older pass, looked superseded, and nothing ran — the
    process stayed ``snapshotting``)."""
    runs = _runs(rehydrate_engine)
    fail = [between == "failed-trigger"]

    @rehydrate_engine.registry.before_snapshot(name="test.flush")
    def flush() -> None:
        if fail[0]:
            raise RuntimeError("disk full")

    opened = time.monotonic()  # the waiter's descriptor
    if between.startswith("simulated"):  # 20: more passes than the engine keeps (16)
        for _ in range(20 if between.endswith("times") else 1):
            assert rehydrate_engine.simulate_snapshot("by-hand").ok
            assert rehydrate_engine.simulate_restore(kind="resume").ok
    else:  # trigger_snapshot's hooks failed: it carries on, no checkpoint, no abort told
        prepared = time.monotonic()
        assert not rehydrate_engine.snapshot_requested("trigger").ok
        rehydrate_engine.restore_detected("trigger", kind="resume", anchor=False,
                                          frozen_for=0.0, undoes=prepared)
        fail[0] = False
    before = len(runs)
    assert rehydrate_engine.snapshot_requested("control").ok  # the real checkpoint's pass
    answer = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                               undoes=opened, abort="answered")
    assert not answer.deduplicated and len(runs) == before + 1
    assert rehydrate_engine.status().state == "ready" and rehydrate_engine.is_ready()


def test_an_error_on_a_descriptor_opened_mid_pass_confirms_the_announced_carry_on(
        rehydrate_engine: Lifecycle) -> None:
    """Both attempts' ``notify save`` fail. The waiter handled attempt 1's late ``error``
    after attempt 2's pass began and reopened its descriptor before attempt 2's carry-on
    announced the abort: attempt 2's ``error`` on that descriptor is the answer that
    carry-on announced — nothing runs again (before: the resume hooks ran twice)."""
    runs = _runs(rehydrate_engine)
    _failing_snapshot(rehydrate_engine)
    opened = time.monotonic()  # the waiter's first descriptor
    first = time.monotonic()
    assert not rehydrate_engine.snapshot_requested("control").ok
    rehydrate_engine.restore_detected("control", kind="resume", anchor=False,
                                      frozen_for=0.0, undoes=first, abort="announced")
    second = time.monotonic()
    assert not rehydrate_engine.snapshot_requested("control").ok  # the retry's pass
    late = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                             undoes=opened, abort="answered",
                                             detected_at=second)
    assert late.deduplicated  # attempt 1's answer: superseded by the retry's pass
    reopened = time.monotonic()  # the waiter's next descriptor, mid-pass
    rehydrate_engine.restore_detected("control", kind="resume", anchor=False,
                                      frozen_for=0.0, undoes=second, abort="announced")
    assert len(runs) == 2
    answer = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                               undoes=reopened, abort="answered")
    assert answer.deduplicated and len(runs) == 2
    assert answer.confirmed_by[-1] == "gvisor"
    assert rehydrate_engine.is_ready()


def test_a_late_error_does_not_undo_a_retry_after_the_snapshot_deadline(
        rehydrate_engine: Lifecycle) -> None:
    """The snapshot deadline ran the resume hooks for attempt 1 (its checkpoint may still
    be in flight: the deadline does not settle the pass), then the platform retried:
    attempt 1's late ``error`` names attempt 1's pass and runs nothing — the resume hooks
    would undo the retry's pending pass (it did, for one commit, when every pass undone
    without an announced abort was skipped)."""
    runs = _runs(rehydrate_engine)
    rehydrate_engine.snapshot_deadline = 0.3
    opened = time.monotonic()  # the waiter's descriptor
    assert rehydrate_engine.snapshot_requested("control").ok  # attempt 1
    end = time.monotonic() + 30
    while not runs and time.monotonic() < end:  # the deadline's run, within its bound
        time.sleep(0.05)
    assert [r[0] for r in runs] == ["snapshot-deadline"]
    arrived = time.monotonic()
    assert rehydrate_engine.snapshot_requested("control").ok  # the retry, pending
    late = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                             undoes=opened, abort="answered",
                                             detected_at=arrived)
    assert late.deduplicated and len(runs) == 1
    assert rehydrate_engine.status().state == "snapshotting"
    assert not rehydrate_engine.is_ready()


def test_a_failed_trigger_whose_carry_on_started_no_hook_is_settled(
        rehydrate_engine: Lifecycle) -> None:
    """A failed trigger's carry-on reached the engine after its run deadline (no hook
    started, nothing reopened): its pass had no checkpoint all the same, so the next real
    checkpoint's ``error`` is that checkpoint's and runs the hooks (before: it named the
    trigger's pass, looked superseded, and the process stayed ``snapshotting``)."""
    runs = _runs(rehydrate_engine)
    fail = [True]

    @rehydrate_engine.registry.before_snapshot(name="test.flush")
    def flush() -> None:
        if fail[0]:
            raise RuntimeError("disk full")

    opened = time.monotonic()
    assert not rehydrate_engine.snapshot_requested("trigger").ok
    empty = rehydrate_engine.restore_detected("trigger", kind="resume", anchor=False,
                                              frozen_for=0.0,
                                              detected_at=time.monotonic() - 2, deadline=1.0)
    assert {h.attempts for h in empty.hooks} == {0} and not runs
    fail[0] = False
    assert rehydrate_engine.snapshot_requested("control").ok  # the real checkpoint
    answer = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                               undoes=opened, abort="answered")
    assert not answer.deduplicated and len(runs) == 1
    assert rehydrate_engine.status().state == "ready"


def test_an_announced_abort_is_answered_once_whichever_descriptor_carries_it(
        rehydrate_engine: Lifecycle) -> None:
    """The retry's carry-on announced its abort before the waiter had handled attempt 1's
    late ``error`` and reopened: the retry's ``error`` on the reopened descriptor names no
    pass, and is the announced abort's answer — nothing runs again (before: only when the
    waiter had reopened before the carry-on). A second ``error`` after it is something
    else and runs the hooks."""
    runs = _runs(rehydrate_engine)
    fail = [False]

    @rehydrate_engine.registry.before_snapshot(name="test.flush")
    def flush() -> None:
        if fail[0]:
            raise RuntimeError("disk full")

    opened = time.monotonic()
    assert rehydrate_engine.snapshot_requested("control").ok  # attempt 1, fails later
    fail[0] = True
    second = time.monotonic()
    assert not rehydrate_engine.snapshot_requested("control").ok  # the retry's save fails
    rehydrate_engine.restore_detected("control", kind="resume", anchor=False,
                                      frozen_for=0.0, undoes=second, abort="announced")
    late = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                             undoes=opened, abort="answered",
                                             detected_at=second)
    assert late.deduplicated and len(runs) == 1
    reopened = time.monotonic()
    answer = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                               undoes=reopened, abort="answered")
    assert answer.deduplicated and len(runs) == 1
    again = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                              undoes=time.monotonic(), abort="answered")
    assert not again.deduplicated and len(runs) == 2


def test_an_error_after_a_trigger_and_its_save_restore_exec_pass_runs_the_hooks(
        rehydrate_engine: Lifecycle) -> None:
    """``trigger_snapshot()`` with gVisor's save-restore-exec: the trigger's pass, then
    the same checkpoint's ``notify save`` pass; the checkpoint fails and gVisor answers
    ``error`` on the descriptor opened before both. Every pass began before the answer
    arrived: no retry, the answer undoes the latest pass (before: it named the trigger's
    pass, looked superseded, and the process stayed ``snapshotting``)."""
    runs = _runs(rehydrate_engine)
    opened = time.monotonic()
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # the trigger's pass
    assert rehydrate_engine.snapshot_requested("control").ok  # its notify save pass
    answer = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                               undoes=opened, abort="answered",
                                               detected_at=time.monotonic())
    assert not answer.deduplicated and len(runs) == 1
    assert rehydrate_engine.status().state == "ready"


def test_a_carry_on_names_its_own_pass_even_when_an_answer_settled_it(
        rehydrate_engine: Lifecycle) -> None:
    """Attempt 1's ``notify save`` was killed while its hooks ran; gVisor's ``error`` got
    the engine first (and settled pass 1), then the retry's pass, then attempt 1's
    carry-on: it is about pass 1, which a newer pass followed — nothing runs (before: it
    skipped the settled pass 1, named the retry's pending pass and undid it)."""
    runs = _runs(rehydrate_engine)
    opened = time.monotonic()
    received = time.monotonic()  # the control socket's moment before pass 1
    assert rehydrate_engine.snapshot_requested("control").ok  # pass 1
    rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                      undoes=opened, abort="answered",
                                      detected_at=time.monotonic())
    assert len(runs) == 1
    assert rehydrate_engine.snapshot_requested("control").ok  # the retry's pass, pending
    late = rehydrate_engine.restore_detected("control", kind="resume", anchor=False,
                                             frozen_for=0.0, undoes=received,
                                             abort="announced")
    assert late.deduplicated and len(runs) == 1
    assert rehydrate_engine.status().state == "snapshotting"


def _another_pass_first(engine: Lifecycle, reason: str, other: str) -> None:
    """``engine.snapshot_requested(reason)`` loses the engine once to another pass (and
    its resume), as when that one took the run lock after the caller's own moment."""
    real = engine.snapshot_requested
    first = [True]

    def snapshot_requested(why: str = "simulated", **kw):  # type: ignore[no-untyped-def]
        if why == reason and first[0]:
            first[0] = False
            assert real(other).ok
            engine.restore_detected(other, kind="resume", anchor=False)
        return real(why, **kw)

    engine.snapshot_requested = snapshot_requested  # type: ignore[method-assign]


def _second_pass_fails(engine: Lifecycle) -> list[str]:
    log: list[str] = []
    count = [0]

    @engine.registry.before_snapshot(name="test.flush")
    def flush() -> None:
        count[0] += 1
        log.append(f"pass {count[0]}")
        if count[0] == 2:
            raise RuntimeError("disk full")

    engine.registry.after_restore(lambda ctx: log.append(f"resume {ctx.reason}"),
                                  name="test.reopen")
    return log


def test_a_failed_notify_save_undoes_its_own_pass_when_another_got_the_engine_first(
        rehydrate_engine: Lifecycle, control: ControlServer) -> None:
    """Another pass (and its resume) took the engine between the control socket's moment
    and its own pass, which then failed: the carry-on must undo the failed pass itself
    (before: it named the other, already undone pass and only confirmed it — the process
    stayed degraded, connections closed, while the reply said the hooks ran)."""
    log = _second_pass_fails(rehydrate_engine)
    _another_pass_first(rehydrate_engine, "control", "simulated")
    reply = request("prepare-snapshot", socket_path=control.path)
    assert reply["ok"] is False
    assert log == ["pass 1", "resume simulated", "pass 2", "resume control"]
    assert rehydrate_engine.is_ready()


def test_a_failed_notify_save_runs_its_carry_on_when_the_pass_lookup_fails(
        rehydrate_engine: Lifecycle, control: ControlServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``pass_started`` raising (an engine without it, a lookup racing a new pass): the
    carry-on falls back to the moment before the pass and still runs (before: the reply
    was that error, and no resume hook ran — the process stayed degraded)."""
    log = _second_pass_fails(rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok  # pass 1, then its resume
    assert rehydrate_engine.simulate_restore(kind="resume").ok

    def broken(report: object) -> float:
        raise RuntimeError("deque mutated during iteration")

    monkeypatch.setattr(rehydrate_engine, "pass_started", broken)
    reply = request("prepare-snapshot", socket_path=control.path)
    assert reply["ok"] is False and "resume hooks ran" in reply["error"]
    assert log[-2:] == ["pass 2", "resume control"]
    assert rehydrate_engine.is_ready()


def test_a_failed_trigger_undoes_its_own_pass_when_another_got_the_engine_first(
        rehydrate_engine: Lifecycle, tmp_path: Path) -> None:
    """The same for ``trigger_snapshot()``: a platform checkpoint (``notify save``, the
    checkpoint, ``notify resume``) got the engine before the trigger's own pass, which
    failed — the trigger's carry-on undoes the trigger's pass."""
    from rehydrate._trigger import trigger_snapshot

    (tmp_path / "checkpoint").symlink_to("/dev/null")
    log = _second_pass_fails(rehydrate_engine)
    _another_pass_first(rehydrate_engine, "gvisor", "control")
    assert trigger_snapshot(rehydrate_engine, proc=str(tmp_path)) == "error"
    assert log == ["pass 1", "resume control", "pass 2", "resume gvisor"]
    assert rehydrate_engine.is_ready()


def test_a_duplicate_confirmed_after_a_newer_freeze_leaves_that_freeze_unhandled(
        rehydrate_engine: Lifecycle) -> None:
    """A second notice of restore 0 waits while restore 0's hooks run; meanwhile the
    process is checkpointed and this clone resumes (the watch notices the freeze). The
    duplicate is confirmed after the run: it must not count the clone's freeze as
    handled — readiness stays False until the clone's own run (before: True, with the
    parent's keys, until the clock-jump reporter's notice got the engine)."""
    engine = rehydrate_engine
    entered, release = threading.Event(), threading.Event()

    @engine.registry.after_restore(name="test.slow", timeout=60)
    def slow(ctx: object) -> None:
        if getattr(ctx, "generation", 0) == 1:
            entered.set()
            release.wait(30)

    t0 = time.monotonic()
    engine.heartbeat(t0, 60.0, due=60.0)
    engine.freeze_noticed(t0 - 10, t0)
    results: list[object] = []
    first = threading.Thread(target=lambda: results.append(engine.restore_detected(
        "clock-jump", since=t0 - 9.5, detected_at=t0)))
    first.start()
    try:
        assert entered.wait(30)
        # its own list: the first notice's thread may append after it (it publishes and
        # logs its report once the run lock is free for the duplicate)
        duplicates: list[object] = []
        duplicate = threading.Thread(target=lambda: duplicates.append(engine.restore_detected(
            "gvisor", kind="restore", since=t0 - 1.0, detected_at=time.monotonic())))
        duplicate.start()
        end = time.monotonic() + 30
        while engine._notices < 2 and time.monotonic() < end:  # it waits for the run
            time.sleep(0.01)
        assert engine._notices == 2
        last = time.monotonic()
        engine.heartbeat(last, 60.0, due=60.0)
        engine.freeze_noticed(last, time.monotonic())  # the clone's freeze, mid-run
    finally:
        release.set()
        first.join(30)
    duplicate.join(30)
    assert [getattr(r, "deduplicated", None) for r in duplicates] == [True], duplicates
    engine.heartbeat(time.monotonic(), 60.0, due=60.0)
    assert not engine.is_ready(), "ready before the clone's own run"
    clone = engine.restore_detected("clock-jump", since=last, detected_at=time.monotonic())
    assert not clone.deduplicated and clone.generation == 2 and engine.is_ready()


def test_a_carry_on_that_started_no_hook_is_not_the_pass_undone(
        rehydrate_engine: Lifecycle) -> None:
    """A run deadline (the SnapStart bridge's, on every run of the engine) had passed by
    the time the announced carry-on got the engine (it waited for a run in progress): no
    hook started, nothing was reopened. gVisor's ``error`` for that pass then runs the
    resume hooks (before: it confirmed the empty run, and the engine stayed degraded)."""
    runs = _runs(rehydrate_engine)
    _failing_snapshot(rehydrate_engine)
    rehydrate_engine.set_restore_deadline("snapstart", 8.0)
    opened = time.monotonic()
    assert not rehydrate_engine.snapshot_requested("control").ok
    late = rehydrate_engine.restore_detected(
        "control", kind="resume", anchor=False, frozen_for=0.0, undoes=opened,
        abort="announced", detected_at=time.monotonic() - 9.0)  # 9 s waiting for the lock
    assert runs == [] and not late.ok
    assert late.hooks and {(h.outcome, h.attempts, getattr(h.error, "started", None))
                           for h in late.hooks} == {("timeout", 0, False)}
    assert rehydrate_engine.status().state == "degraded"

    answered = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                                 undoes=opened, abort="answered")
    assert not answered.deduplicated and answered.ok
    assert runs == [("gvisor", "resume", 0)]
    assert rehydrate_engine.is_ready() and rehydrate_engine.status().state == "ready"
    # That run undid the pass: another notice for it is the confirmation.
    again = rehydrate_engine.restore_detected("control", kind="resume", anchor=False,
                                              frozen_for=0.0, undoes=opened,
                                              abort="announced")
    assert again.deduplicated and runs == [("gvisor", "resume", 0)]


def test_a_bad_abort_value_is_refused_before_anything_runs(
        rehydrate_engine: Lifecycle) -> None:
    runs = _runs(rehydrate_engine)
    with pytest.raises(ValueError, match="abort must be None, 'announced' or 'answered'"):
        rehydrate_engine.restore_detected("gvisor", kind="resume", abort="maybe")  # type: ignore[arg-type]
    assert runs == [] and rehydrate_engine.status().last_report is None


@pytest.mark.parametrize("deadline", [10**400, 1e300, 31_536_001],
                         ids=["1e400", "1e300", "a-year-and-a-second"])
def test_a_snapshot_deadline_beyond_a_year_is_refused(deadline: float) -> None:
    """``snapshot_deadline=10**400`` (or ``1e300``) was accepted; after a before-snapshot
    pass the deadline watch's thread died of an OverflowError, so its last-resort resume
    never ran. ``REHYDRATE_SNAPSHOT_DEADLINE`` has always been at most a year."""
    with pytest.raises(ValueError, match=r"^snapshot_deadline must be a number of seconds > 0 "
                                         r"and at most 31536000 \(a year\), not \S+$"):
        _engine(snapshot_deadline=deadline)


@pytest.mark.parametrize("earlier", ["trigger-pass", "no-pass", "deadline-ran"])
def test_a_late_resume_does_not_end_a_newer_pass(rehydrate_engine: Lifecycle,
                                                 earlier: str) -> None:
    """``trigger_snapshot(timeout=...)`` timed out (its pass pending, the answer still to
    come), the application triggered again, and checkpoint 1's ``resume`` — which arrived
    before trigger 2's pass began — got the engine only after it. It is checkpoint 1's:
    nothing runs, trigger 2's pass stays pending (before: the resume hooks ran and the
    process said ready while checkpoint 2 was pending). Also for a checkpoint without a
    pass of its own (a platform's ``runsc checkpoint``), and after the snapshot deadline
    undid pass 1 (its run is confirmed)."""
    runs = _runs(rehydrate_engine)
    if earlier == "deadline-ran":
        rehydrate_engine.snapshot_deadline = 0.3
    if earlier != "no-pass":
        assert rehydrate_engine.snapshot_requested("gvisor").ok  # trigger 1, timed out
    if earlier == "deadline-ran":
        end = time.monotonic() + 30
        while not runs and time.monotonic() < end:  # the deadline's run, within its bound
            time.sleep(0.05)
        assert [r[0] for r in runs] == ["snapshot-deadline"]
        rehydrate_engine.snapshot_deadline = None
    before = len(runs)
    arrived = time.monotonic()  # checkpoint 1's resume answer
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # trigger 2's pass
    late = rehydrate_engine.restore_detected("gvisor", kind="resume", since=arrived - 2.0,
                                             detected_at=arrived)
    assert late.deduplicated and late.kind == "resume" and len(runs) == before
    assert rehydrate_engine.status().state == "snapshotting"
    assert not rehydrate_engine.is_ready()
    # Checkpoint 2's own resume (it arrived after trigger 2's pass) runs the hooks.
    own = rehydrate_engine.restore_detected("gvisor", kind="resume", since=arrived)
    assert not own.deduplicated and len(runs) == before + 1
    assert rehydrate_engine.is_ready() and rehydrate_engine.status().state == "ready"


def test_a_late_resume_settles_the_pass_it_answers(rehydrate_engine: Lifecycle) -> None:
    """The late ``resume`` says checkpoint 1 is over: its pass is settled, so a later
    checkpoint's ``error`` on a descriptor opened before pass 1 is not taken for pass 1's
    (which would look superseded and leave the latest pass pending for ever)."""
    runs = _runs(rehydrate_engine)
    opened = time.monotonic()
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # trigger 1, timed out
    arrived = time.monotonic()
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # trigger 2
    assert rehydrate_engine.restore_detected("gvisor", kind="resume",
                                             detected_at=arrived).deduplicated
    failed = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                               undoes=opened, abort="answered")
    assert not failed.deduplicated and len(runs) == 1
    assert rehydrate_engine.is_ready()


def test_a_late_restore_still_runs_its_restore_hooks(rehydrate_engine: Lifecycle) -> None:
    """Only ``resume`` and ``error`` answers are held to the newer pass: a clone must run
    its restore hooks (new keys, reseeded entropy) however late its notice."""
    runs = _runs(rehydrate_engine)
    arrived = time.monotonic()
    assert rehydrate_engine.snapshot_requested("gvisor").ok
    report = rehydrate_engine.restore_detected("gvisor", kind="restore", detected_at=arrived,
                                               older_than=arrived)
    assert not report.deduplicated and runs == [("gvisor", "restore", 1)]


def test_an_error_that_arrived_before_a_newer_pass_does_not_end_it(
        rehydrate_engine: Lifecycle) -> None:
    """A checkpoint without a pass of its own after the waiter's descriptor was opened
    failed; its ``error`` arrived, and a pass began before the waiter handled it. That
    pass is the only one after the descriptor's open, but the answer came before it
    (before: it was taken for that pass's answer and the resume hooks ended it)."""
    runs = _runs(rehydrate_engine)
    opened = time.monotonic()
    arrived = time.monotonic()
    assert rehydrate_engine.snapshot_requested("gvisor").ok
    late = rehydrate_engine.restore_detected("gvisor", kind="resume", anchor=False,
                                             undoes=opened, abort="answered",
                                             detected_at=arrived)
    assert late.deduplicated and runs == []
    assert rehydrate_engine.status().state == "snapshotting"


@pytest.mark.parametrize("answer", ["resume", "error"])
def test_an_answer_older_than_a_trigger_that_has_not_written_runs_nothing(
        rehydrate_engine: Lifecycle, answer: str) -> None:
    """The answer arrived after trigger 2's pass began, but before trigger 2 wrote its
    ``1`` (the waiter says so with ``older_than``): it is checkpoint 1's, and trigger 2's
    pass stays pending."""
    runs = _runs(rehydrate_engine)
    opened = time.monotonic()
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # trigger 1, timed out
    begun = time.monotonic()  # trigger 2 began
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # trigger 2's pass
    extra: dict[str, object] = ({"anchor": False, "undoes": opened, "abort": "answered"}
                                if answer == "error" else {})
    late = rehydrate_engine.restore_detected("gvisor", kind="resume", older_than=begun,
                                             **extra)  # type: ignore[arg-type]
    assert late.deduplicated and runs == []
    assert rehydrate_engine.status().state == "snapshotting"
    with pytest.raises(ValueError, match="older_than must be None"):
        rehydrate_engine.restore_detected("gvisor", kind="resume",
                                          older_than="soon")  # type: ignore[arg-type]
    assert runs == []


def test_a_resume_notice_received_before_a_newer_pass_does_not_end_it(
        rehydrate_engine: Lifecycle, control: ControlServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``notify resume`` for checkpoint 1 reached the control socket, which then waited
    (for the freeze watch's verdict) while a newer before-snapshot pass began: the notice
    is about checkpoint 1 and runs nothing for the newer pass (before: its resume hooks
    ended that pass and the process said ready while its checkpoint was pending). A
    ``notify restore`` in the same order still runs (a clone always does)."""
    runs = _runs(rehydrate_engine)
    assert rehydrate_engine.snapshot_requested("control").ok  # checkpoint 1's save
    waiting, go = threading.Event(), threading.Event()
    real = rehydrate_engine.freeze_since

    def slow_verdict() -> float | None:
        waiting.set()
        assert go.wait(DEADLINE)
        return real()

    monkeypatch.setattr(rehydrate_engine, "freeze_since", slow_verdict)
    replies: dict[str, dict[str, object]] = {}

    def notify(cmd: str) -> None:
        replies[cmd] = request(cmd, socket_path=control.path)

    for cmd in ("resume", "restore"):
        waiting.clear()
        go.clear()
        client = threading.Thread(target=notify, args=(cmd,))
        client.start()
        assert waiting.wait(DEADLINE)  # received, not handled yet
        assert rehydrate_engine.snapshot_requested("control").ok  # the newer pass
        go.set()
        client.join(DEADLINE)
        if cmd == "resume":
            assert replies["resume"]["ok"] and replies["resume"]["deduplicated"]
            assert runs == []
            assert rehydrate_engine.status().state == "snapshotting"
    assert not replies["restore"]["deduplicated"]
    assert runs == [("control", "restore", 1)]


def test_the_clock_jumps_notice_of_a_late_answers_freeze_does_not_end_the_newer_pass(
        rehydrate_engine: Lifecycle) -> None:
    """Trigger 1 timed out; checkpoint 1 froze the original; on resume the application
    triggered again before the notices were handled. gVisor's ``resume`` (arrived before
    trigger 2's pass) is checkpoint 1's and runs nothing; the clock jump's notice of the
    same freeze (detected before trigger 2's pass too) is its duplicate. Before, it ran
    the restore hooks on the original: a new identity, and ready while checkpoint 2 was
    pending."""
    runs = _runs(rehydrate_engine)
    beat = time.monotonic()  # the watch's last wake-up before checkpoint 1's freeze
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # trigger 1, timed out
    arrived = noticed = time.monotonic()  # after the freeze: the answer, the clock jump
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # trigger 2's pass
    late = rehydrate_engine.restore_detected("gvisor", kind="resume", since=arrived - 2.0,
                                             detected_at=arrived)
    assert late.deduplicated and runs == []
    jump = rehydrate_engine.restore_detected("clock-jump", kind="restore", since=beat,
                                             frozen_for=5.0, detected_at=noticed)
    assert jump.deduplicated and runs == []
    assert rehydrate_engine.status().state == "snapshotting"
    assert rehydrate_engine.generation == 0 and not rehydrate_engine.is_ready()
    # Checkpoint 2's resume runs the resume hooks once; a clone of checkpoint 2 (a freeze
    # after trigger 2's pass began) still runs its restore hooks.
    resumed = time.monotonic()
    assert not rehydrate_engine.restore_detected("gvisor", kind="resume",
                                                 since=resumed - 2.0).deduplicated
    assert [r[:2] for r in runs] == [("gvisor", "resume")] and rehydrate_engine.is_ready()
    clone = rehydrate_engine.restore_detected("clock-jump", kind="restore",
                                              since=time.monotonic(), frozen_for=5.0)
    assert not clone.deduplicated and runs[-1] == ("clock-jump", "restore", 1)


def test_a_restore_notice_detected_before_a_newer_pass_confirms_the_run_before_it(
        rehydrate_engine: Lifecycle) -> None:
    """Checkpoint 1's ``resume`` ran the resume hooks before trigger 2's pass; the clock
    jump's notice of the same freeze, detected before that pass but handled after it, is
    a duplicate of that run (it cannot be a clone of checkpoint 2: it was detected before
    checkpoint 2's pass began). Before, it ran the restore hooks and ended trigger 2's
    pass: ready while checkpoint 2 was pending."""
    runs = _runs(rehydrate_engine)
    beat = time.monotonic()
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # trigger 1
    opened = time.monotonic()
    assert not rehydrate_engine.restore_detected("gvisor", kind="resume",
                                                 since=opened).deduplicated
    noticed = time.monotonic()  # the clock jump saw the freeze, before trigger 2's pass
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # trigger 2
    jump = rehydrate_engine.restore_detected("clock-jump", kind="restore", since=beat,
                                             frozen_for=1.0, detected_at=noticed)
    assert jump.deduplicated and [r[:2] for r in runs] == [("gvisor", "resume")]
    assert rehydrate_engine.status().state == "snapshotting"
    assert not rehydrate_engine.is_ready()


@pytest.mark.parametrize("earlier", ["resume-ran", "late-resume"])
def test_a_clone_whose_own_pass_gets_the_engine_first_still_runs_its_restore_hooks(
        rehydrate_engine: Lifecycle, earlier: str) -> None:
    """A clone of checkpoint 2 whose restore notice has a wide window (a signal or file
    detector: received minus 2 s) and whose next pass (the application retrying, the next
    link of a chain) gets the engine before that notice. The notice is judged against the
    passes that existed when it was detected: the run of checkpoint 1 — or checkpoint 1's
    late answer — copied from the parent's memory is not this clone's restore. (Judged
    against "some pass began after it", the clone kept its parent's keys.)"""
    runs = _runs(rehydrate_engine)
    assert rehydrate_engine.snapshot_requested("gvisor").ok  # pass 1
    arrived = time.monotonic()  # checkpoint 1's resume
    if earlier == "late-resume":
        assert rehydrate_engine.snapshot_requested("gvisor").ok  # pass 2, a retry
    answer = rehydrate_engine.restore_detected("gvisor", kind="resume",
                                               since=arrived - 2.0, detected_at=arrived)
    assert answer.deduplicated is (earlier == "late-resume")
    if earlier == "resume-ran":
        assert rehydrate_engine.snapshot_requested("gvisor").ok  # pass 2
    before = len(runs)
    received = time.monotonic()  # checkpoint 2 froze; in the clone the signal comes
    assert rehydrate_engine.snapshot_requested("control").ok  # the clone's own next pass
    clone = rehydrate_engine.restore_detected("signal", kind="restore",
                                              since=received - 2.0, detected_at=received)
    assert not clone.deduplicated
    assert runs[before:] == [("signal", "restore", 1)]


@pytest.mark.parametrize("passed", [True, False], ids=["pass-ok", "pass-failed"])
def test_a_gil_stall_does_not_end_the_snapshot_deadline_watch(
        rehydrate_engine: Lifecycle, passed: bool) -> None:
    """A long C call holding the GIL right after the before-snapshot pass looks like a
    freeze to the deadline watch. The detectors do not count such a stall as a
    checkpoint, so before, nobody ended the pass: ``snapshotting`` (or, for a failed pass
    left to a due answer, ``degraded``) for good when the platform's answer never came.
    Now the deadline starts again after it and then runs the (restore) hooks."""
    import ctypes

    usleep = ctypes.PyDLL(None).usleep  # PyDLL: the GIL stays held during the call
    usleep.argtypes = [ctypes.c_uint]
    runs = _runs(rehydrate_engine)
    rehydrate_engine.snapshot_deadline = 0.5
    if not passed:
        @rehydrate_engine.registry.before_snapshot(name="test.fails")
        def fails() -> None:
            raise RuntimeError("cannot close")

    report = rehydrate_engine.snapshot_requested("gvisor")
    assert report.ok is passed
    if not passed:
        assert rehydrate_engine.await_answer(report)  # as a retried trigger does
    give_up = time.monotonic() + 10
    while not rehydrate_engine._cond._waiters:  # type: ignore[attr-defined]
        # the watch is inside its first slice: the stall is inside it
        assert time.monotonic() < give_up, "the deadline watch never began waiting"
        time.sleep(0.001)
    usleep(2_500_000)  # a stall past the deadline (and a slice)
    assert rehydrate_engine.wait_ready(20)
    assert [r[:2] for r in runs] == [("snapshot-deadline", "restore")]
