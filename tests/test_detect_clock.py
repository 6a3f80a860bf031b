"""Clock-jump detector: injected clock steps, a real SIGSTOP freeze, duplicate suppression."""

from __future__ import annotations

import logging
import os
import signal
import textwrap
import threading
import time

import pytest
from detect_helpers import Child, Recorder, wait_for

from rehydrate.detect import Detector
from rehydrate.detect.clock import ClockJumpDetector


class SteppedClock:
    """CLOCK_MONOTONIC plus an offset the test can step forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class FakeSpecific(Detector):
    """A stand-in for a more specific detector (the gVisor waiter): the test fires it."""

    name = "fake-specific"
    specificity = 100

    def start(self, engine) -> None:  # type: ignore[no-untyped-def]
        self.engine = engine

    def stop(self) -> None:
        pass


def test_step_beyond_threshold_is_a_restore(rehydrate_engine):
    rec = Recorder(rehydrate_engine)
    clock = SteppedClock()
    det = ClockJumpDetector(interval=0.02, threshold=1.5, grace=0, clock=clock)
    assert rehydrate_engine.start([det]) == ["clock-jump"]
    wait_for(lambda: det.ticks >= 3, what="a few ordinary ticks")
    assert rec.calls == []  # ordinary ticks are not restores

    clock.offset += 10.0
    calls = rec.wait(1)
    assert calls[0]["reason"] == "clock-jump"
    assert calls[0]["kind"] == "restore"
    assert calls[0]["generation"] == 1
    assert 9.9 <= calls[0]["frozen_for"] <= 10.5
    assert rehydrate_engine.status().generation == 1

    clock.offset += 0.3  # below the threshold
    ticks = det.ticks
    wait_for(lambda: det.ticks >= ticks + 3, what="more ticks")
    assert len(rec.calls) == 1

    clock.offset += 7.0
    rec.wait(2)
    assert rec.calls[1]["generation"] == 2


def test_busy_process_is_not_a_restore(rehydrate_engine, caplog):
    """A late wake-up while the process burned CPU (GIL held) is not a freeze."""
    rec = Recorder(rehydrate_engine)
    clock, cpu = SteppedClock(), SteppedClock()
    det = ClockJumpDetector(interval=0.02, threshold=1.5, grace=0, clock=clock,
                            cpu_clock=cpu)
    rehydrate_engine.start([det])
    wait_for(lambda: det.ticks >= 2)
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        cpu.offset += 3.0
        clock.offset += 3.0
        wait_for(lambda: det.busy_skips == 1, what="the busy step to be seen")
    assert rec.calls == []
    assert "not a restore" in caplog.text

    off = ClockJumpDetector(interval=0.02, threshold=1.5, clock=clock, cpu_clock=cpu,
                            busy_check=False)
    assert off.busy_check is False


def test_configuration_from_environment(monkeypatch, caplog):
    monkeypatch.setenv("REHYDRATE_CLOCK_INTERVAL", "0.25")
    monkeypatch.setenv("REHYDRATE_CLOCK_THRESHOLD", "4")
    monkeypatch.setenv("REHYDRATE_CLOCK_BUSY_CHECK", "0")
    det = ClockJumpDetector()
    assert (det.interval, det.threshold, det.busy_check) == (0.25, 4.0, False)

    monkeypatch.setenv("REHYDRATE_CLOCK_THRESHOLD", "soon")
    monkeypatch.setenv("REHYDRATE_CLOCK_INTERVAL", "-1")
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        det = ClockJumpDetector()
    assert (det.interval, det.threshold) == (0.5, 2.0)  # the defaults
    assert "REHYDRATE_CLOCK_THRESHOLD='soon' is not a finite number" in caplog.text
    assert "REHYDRATE_CLOCK_INTERVAL='-1' is not a finite number >= 0.001" in caplog.text

    monkeypatch.delenv("REHYDRATE_CLOCK_THRESHOLD")
    monkeypatch.delenv("REHYDRATE_CLOCK_INTERVAL")
    det = ClockJumpDetector()
    assert det.threshold <= 5.0  # DESIGN: the default is at most 5 s
    with pytest.raises(ValueError):
        ClockJumpDetector(interval=0)


def test_stop_is_prompt_even_with_a_long_interval(rehydrate_engine):
    det = ClockJumpDetector(interval=60)
    rehydrate_engine.start([det])
    t0 = time.monotonic()
    rehydrate_engine.stop()
    assert time.monotonic() - t0 < 1.0
    assert not any(t.name == "rehydrate-clock-jump" for t in threading.enumerate())


def test_specific_detector_reports_first_and_hooks_run_once(rehydrate_engine):
    """Duplicate suppression: the clock jump waits for the specific detector's report."""
    rec = Recorder(rehydrate_engine)
    clock = SteppedClock()
    det = ClockJumpDetector(interval=0.02, threshold=1.5, grace=5.0, clock=clock)
    specific = FakeSpecific()
    rehydrate_engine.start([det, specific])
    wait_for(lambda: det.ticks >= 2)

    clock.offset += 8.0
    wait_for(lambda: det.pending, what="the clock-jump detector to see the step")
    assert rec.calls == []  # it is giving the specific detector its grace
    report = rehydrate_engine.restore_detected("gvisor", kind="restore")
    wait_for(lambda: det.last_report is not None, what="the clock-jump notice")
    assert det.last_report is report  # the same restore: its report, nothing ran again
    assert [c["reason"] for c in rec.calls] == ["gvisor"]
    assert rehydrate_engine.status().generation == 1


def test_without_a_specific_report_the_grace_ends(rehydrate_engine):
    rec = Recorder(rehydrate_engine)
    clock = SteppedClock()
    det = ClockJumpDetector(interval=0.02, threshold=1.5, grace=0.2, clock=clock)
    rehydrate_engine.start([det, FakeSpecific()])
    wait_for(lambda: det.ticks >= 2)
    clock.offset += 8.0
    t0 = time.monotonic()
    rec.wait(1)
    assert time.monotonic() - t0 >= 0.2
    assert rec.calls[0]["reason"] == "clock-jump"


CHILD = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    from rehydrate.testing import isolated_engine
    from rehydrate.detect.clock import ClockJumpDetector
    from rehydrate.detect.signals import SignalDetector

    def say(**kw):
        sys.stdout.write(json.dumps(kw) + "\\n"); sys.stdout.flush()

    engine = isolated_engine()
    calls = []
    def hook(ctx):
        calls.append(ctx.reason)
        say(event="hook", reason=ctx.reason, kind=ctx.kind, generation=ctx.generation,
            frozen_for=ctx.frozen_for, at=time.monotonic())
    engine.registry.after_restore(hook)
    clock = ClockJumpDetector(interval=0.1, threshold=1.0, grace=3.0)
    dets = [clock]
    if os.environ.get("WITH_SIGNAL") == "1":
        dets.append(SignalDetector("USR2"))
    engine.start(dets)
    say(event="ready", pid=os.getpid())
    deadline = time.monotonic() + 20
    # Both notices are synchronous: once the clock-jump's returned and a hook ran,
    # every notice of this freeze has been handled.
    while (clock.last_report is None or not calls) and time.monotonic() < deadline:
        time.sleep(0.01)
    say(event="done", calls=calls, jumps=clock.jumps,
        clock_report=clock.last_report.reason if clock.last_report else None)
""")


def _freeze(pid: int, seconds: float, also: signal.Signals | None = None) -> float:
    """SIGSTOP the process for ``seconds`` (the freeze itself), then SIGCONT."""
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    if also is not None:
        os.kill(pid, also)  # stays pending while the process is stopped
    resumed = time.monotonic()
    os.kill(pid, signal.SIGCONT)
    return resumed


def test_real_freeze_with_sigstop_is_detected():
    """A process stopped with SIGSTOP sees CLOCK_MONOTONIC step when it continues."""
    child = Child(CHILD)
    try:
        ready = child.next()
        assert ready["event"] == "ready"
        resumed = _freeze(ready["pid"], 1.6)
        hook = child.next()
        assert hook["event"] == "hook"
        assert (hook["reason"], hook["kind"], hook["generation"]) == ("clock-jump", "restore", 1)
        assert 1.3 <= hook["frozen_for"] <= 3.5
        assert hook["at"] - resumed < 1.0  # detected right after the process ran again
        done = child.next()
        assert done["calls"] == ["clock-jump"]
    finally:
        child.close()


def test_real_freeze_seen_by_two_detectors_runs_hooks_once_with_the_specific_reason():
    """SIGSTOP, a pending SIGUSR2, SIGCONT: the clock jump and the signal detector both
    see the one restore; the hooks run once, with the more specific reason ``signal``."""
    child = Child(CHILD, env={"WITH_SIGNAL": "1"})
    try:
        ready = child.next()
        _freeze(ready["pid"], 1.6, also=signal.SIGUSR2)
        hook = child.next()
        assert (hook["reason"], hook["generation"]) == ("signal", 1)
        done = child.next()
        assert done["event"] == "done"
        assert done["jumps"] == 1  # the clock jump was seen and reported …
        assert done["clock_report"] == "signal"  # … as a duplicate of the signal's restore
        assert done["calls"] == ["signal"]
    finally:
        child.close()
