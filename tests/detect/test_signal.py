"""Signal detector: a real signal to this process runs the hooks off the main thread."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from detect_helpers import Recorder, wait_for

from rehydrate.detect import select
from rehydrate.detect.signal import SignalDetector, parse_signal


def test_signal_runs_restore_hooks_on_a_worker_thread(rehydrate_engine):
    rec = Recorder(rehydrate_engine)
    callers: list[str] = []

    def note_caller(report):  # type: ignore[no-untyped-def]
        callers.append(threading.current_thread().name)

    rehydrate_engine.add_listener(note_caller)
    det = SignalDetector("USR2", window=0)
    assert rehydrate_engine.start([det]) == ["signal"]
    os.kill(os.getpid(), signal.SIGUSR2)
    calls = rec.wait(1)
    assert (calls[0]["reason"], calls[0]["kind"], calls[0]["generation"]) == \
        ("signal", "restore", 1)
    wait_for(lambda: callers)
    assert callers == ["rehydrate-signal"]  # not the interrupted main thread

    os.kill(os.getpid(), signal.SIGUSR2)
    rec.wait(2)
    assert rec.calls[1]["generation"] == 2


def test_a_signal_right_after_a_handled_restore_is_the_same_restore(rehydrate_engine):
    rec = Recorder(rehydrate_engine)
    det = SignalDetector("USR2", window=30)
    rehydrate_engine.start([det])
    rehydrate_engine.restore_detected("clock-jump")
    os.kill(os.getpid(), signal.SIGUSR2)
    wait_for(lambda: det.received == 1)
    wait_for(lambda: rehydrate_engine.status().last_report is not None)
    rehydrate_engine.stop()  # joins the worker: its notice has been handled
    assert [c["reason"] for c in rec.calls] == ["clock-jump"]


def test_stop_restores_the_previous_handler(rehydrate_engine):
    seen: list[int] = []

    def app_handler(signum, frame):  # type: ignore[no-untyped-def]
        seen.append(signum)

    old = signal.signal(signal.SIGUSR1, app_handler)
    try:
        det = SignalDetector(signal.SIGUSR1, kind="resume")
        rehydrate_engine.start([det])
        assert signal.getsignal(signal.SIGUSR1) == det._handler
        rehydrate_engine.stop()
        assert signal.getsignal(signal.SIGUSR1) is app_handler
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: seen == [signal.SIGUSR1])
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_only_from_the_main_thread(rehydrate_engine):
    out: dict[str, object] = {}

    def other() -> None:
        out["probe"] = SignalDetector.probe().reason
        try:
            SignalDetector().start(rehydrate_engine)
        except RuntimeError as exc:
            out["error"] = str(exc)

    t = threading.Thread(target=other, name="not-main")
    t.start()
    t.join()
    assert "main thread" in str(out["probe"])
    assert "main thread" in str(out["error"])
    assert SignalDetector.probe().usable  # pytest runs tests on the main thread


def test_parsing_and_configuration(monkeypatch):
    assert parse_signal("USR1") is signal.SIGUSR1
    assert parse_signal("sigusr2") is signal.SIGUSR2
    assert parse_signal("10") is signal.Signals(10)
    assert parse_signal(12) is signal.Signals(12)
    with pytest.raises(ValueError):
        parse_signal("NOPE")
    with pytest.raises(ValueError):
        SignalDetector("KILL")
    assert SignalDetector().signum is signal.SIGUSR2
    monkeypatch.setenv("REHYDRATE_SIGNAL", "HUP")
    monkeypatch.setenv("REHYDRATE_SIGNAL_KIND", "resume")
    det = SignalDetector()
    assert (det.signum, det.kind) == (signal.SIGHUP, "resume")
    monkeypatch.setenv("REHYDRATE_SIGNAL", "bogus")
    assert SignalDetector().signum is signal.SIGUSR2
    for uncatchable in ("SIGKILL", "9", "STOP"):  # a setting: a warning, not a crash
        monkeypatch.setenv("REHYDRATE_SIGNAL", uncatchable)
        assert SignalDetector().signum is signal.SIGUSR2


def test_off_unless_asked_for():
    assert SignalDetector.auto is False
    assert "signal" not in [d.key for d in select("auto")]
