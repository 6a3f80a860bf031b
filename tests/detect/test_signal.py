"""Signal detector: a real signal to this process runs the hooks off the main thread."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from detect_helpers import (
    Recorder,
    in_forked_child,
    recorded_reports,
    slow_restore_hook,
    wait_for,
)

from rehydrate.detect import select
from rehydrate.detect.signal import _SIGACTION_SIZE, SignalDetector, _sigaction, parse_signal


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


def test_not_ready_from_the_signal_until_the_worker_has_reported_it(rehydrate_engine,
                                                                     monkeypatch):
    """The handler only wakes the worker, which may wait for the GIL before it calls the
    engine: meanwhile a main thread checking readiness right after the signal (a server's
    gate) was told ready in the clone the signal was about, keys and all not renewed."""
    rec = Recorder(rehydrate_engine)
    det = SignalDetector("USR2", window=0)
    rehydrate_engine.start([det])
    assert rehydrate_engine.is_ready()
    reached, go = threading.Event(), threading.Event()
    real = rehydrate_engine.restore_detected

    def worker_not_there_yet(*args, **kwargs):  # type: ignore[no-untyped-def]
        reached.set()
        go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(rehydrate_engine, "restore_detected", worker_not_there_yet)
    os.kill(os.getpid(), signal.SIGUSR2)  # the handler runs before the next line
    assert reached.wait(5)
    assert not rehydrate_engine.is_ready()
    assert rehydrate_engine.status().state == "restoring"
    assert not rehydrate_engine.wait_ready(0.05)
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(rehydrate_engine.wait_ready(10)))
    waiter.start()
    go.set()
    waiter.join(10)
    assert waited == [True]  # woken once the worker handed the signal over
    assert rec.wait(1)[0]["reason"] == "signal"

    # A duplicate (inside the window of that restore) does not leave it unready either.
    det.window = 30
    os.kill(os.getpid(), signal.SIGUSR2)
    assert rehydrate_engine.wait_ready(5)
    wait_for(lambda: det.received == 2)
    assert rehydrate_engine.wait_ready(5)
    assert len(rec.calls) == 1


def test_a_restore_signals_listeners_see_ready_once_its_run_is_over(rehydrate_engine):
    """The signal was handed over only once restore_detected had returned, after the
    run's report listeners: they saw "restoring" (a gate's ``/readyz?wait`` answered
    ~50 ms late). It is handed over the moment the engine counts the notice."""
    seen: list[tuple[str, bool]] = []
    done = threading.Event()

    def listener(report: object) -> None:
        seen.append((rehydrate_engine.status().state, rehydrate_engine.is_ready()))
        done.set()

    rehydrate_engine.add_listener(listener)
    rehydrate_engine.start([SignalDetector("USR2", window=0)])
    os.kill(os.getpid(), signal.SIGUSR2)
    assert done.wait(10)
    assert seen == [("ready", True)]


def test_a_listener_ending_the_worker_leaves_readiness_working(rehydrate_engine):
    """A report listener calling sys.exit() ended the worker (only Exception was caught):
    every later signal was counted and never handed over — not ready for good."""
    calls = threading.Semaphore(0)

    def listener(report: object) -> None:
        calls.release()
        raise SystemExit("the application's listener exits")

    rehydrate_engine.add_listener(listener)
    det = SignalDetector("USR2", window=0)
    rehydrate_engine.start([det])
    for _ in range(2):
        os.kill(os.getpid(), signal.SIGUSR2)
        assert calls.acquire(timeout=10)
        assert rehydrate_engine.wait_ready(10), rehydrate_engine.status()
    assert det._thread is not None and det._thread.is_alive()


def test_a_worker_that_cannot_start_leaves_no_arrival_check(rehydrate_engine, monkeypatch):
    """The worker thread could not be started ("can't start new thread") after the
    engine's arrival check had been added: the next signal made the engine not ready for
    good, also after stop()."""
    real_start = threading.Thread.start

    def failing(self: threading.Thread) -> None:
        if self.name == "rehydrate-signal":
            raise RuntimeError("can't start new thread")
        real_start(self)

    heard: list[int] = []
    app = signal.signal(signal.SIGUSR2, lambda signum, frame: heard.append(signum))
    try:
        monkeypatch.setattr(threading.Thread, "start", failing)
        det = SignalDetector("USR2", window=0)
        rehydrate_engine.start([det])
        monkeypatch.setattr(threading.Thread, "start", real_start)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert rehydrate_engine.is_ready() and rehydrate_engine.wait_ready(1)
        assert heard == [signal.SIGUSR2], "the application's handler was left replaced"
        det.stop()  # raised "cannot join thread before it is started"
    finally:
        rehydrate_engine.stop()
        signal.signal(signal.SIGUSR2, app)


def test_is_ready_right_after_the_signal_never_says_ready(rehydrate_engine):
    """is_ready() read the notice count before asking the arrival checks: a check that
    took a moment (another detector's) let the worker count the notice in between, and
    the handed-over signal was in neither read — ready before the restore hook ran."""
    ran: list[int] = []
    release = threading.Event()

    def hook() -> None:
        release.wait(10)
        ran.append(1)

    rehydrate_engine.registry.after_restore(hook, required=False, timeout=30)
    rehydrate_engine.add_arrival_check(lambda: (time.sleep(0.01), False)[1])
    rehydrate_engine.start([SignalDetector("USR2", window=0)])
    try:
        for i in range(5):
            os.kill(os.getpid(), signal.SIGUSR2)
            assert not rehydrate_engine.is_ready() or len(ran) > i
            release.set()
            assert rehydrate_engine.wait_ready(10)
            release.clear()
    finally:
        release.set()


class _AppHandler:
    """The application's own handler for ``signum`` while the ``with`` block runs (the
    previous one put back after): the calls it got, in ``seen``."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.seen: list[int] = []

    def __call__(self, signum: int, frame: object) -> None:
        self.seen.append(signum)

    def __enter__(self) -> _AppHandler:
        self.old = signal.signal(self.signum, self)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.signum, self.old)

    def gets_the_signal_back(self) -> None:
        """The handler is the application's again, and a signal reaches it."""
        assert signal.getsignal(self.signum) is self
        os.kill(os.getpid(), self.signum)
        wait_for(lambda: self.seen == [self.signum])


def test_stop_restores_the_previous_handler(rehydrate_engine):
    with _AppHandler(signal.SIGUSR1) as app:
        det = SignalDetector(signal.SIGUSR1, kind="resume")
        rehydrate_engine.start([det])
        assert signal.getsignal(signal.SIGUSR1) == det._handler
        rehydrate_engine.stop()
        app.gets_the_signal_back()


@pytest.mark.parametrize("later", [False, True], ids=["first-start", "later-start"])
def test_signal_listed_twice_starts_once_and_stop_gives_the_handler_back(
        rehydrate_engine, caplog, later):
    """``start(["signal", "signal"])`` installed two handlers, the second saving the first
    as "the application's": ``stop()`` left a detector's handler in place, and every
    later SIGUSR2 was swallowed instead of reaching the application."""
    with _AppHandler(signal.SIGUSR2) as app:
        if later:
            rehydrate_engine.start("none")
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            assert rehydrate_engine.start(["signal", "signal"]) == ["signal"]
        assert rehydrate_engine.status().detectors == ("signal",)
        assert [r.getMessage() for r in caplog.records if "more than once" in r.getMessage()] \
            == ["detectors: signal listed more than once; each starts once (the first "
                "listed)"]
        rehydrate_engine.stop()
        app.gets_the_signal_back()


@pytest.mark.parametrize("later", [False, True], ids=["one-start", "later-start"])
@pytest.mark.parametrize("first", ["key", "instance"])
def test_a_second_detector_on_a_watched_signal_is_refused(rehydrate_engine, caplog, first,
                                                          later):
    """``start(["signal", SignalDetector()])`` started both on SIGUSR2: the second saved
    the first's handler as the application's, only one heard the signal, and after
    ``stop()`` an inert detector handler swallowed SIGUSR2 for good."""
    with _AppHandler(signal.SIGUSR2) as app:
        one: str | SignalDetector = "signal" if first == "key" else SignalDetector(window=0)
        second = SignalDetector(window=0)
        with caplog.at_level(logging.ERROR, logger="rehydrate"):
            if later:
                rehydrate_engine.start("none")
            assert rehydrate_engine.start([one, second]) == ["signal"]
        (running,) = rehydrate_engine._detectors
        assert running is not second
        error = ("SIGUSR2 is already watched by another signal detector; give this one "
                 "another signal (SignalDetector(\"SIGUSR1\"))")
        assert rehydrate_engine.status().extra["detector_errors"] == {"signal": error}
        assert [r.getMessage() for r in caplog.records] == [
            f"detector signal could not start: {error}"]
        assert signal.getsignal(signal.SIGUSR2) == running._handler
        rehydrate_engine.stop()
        app.gets_the_signal_back()


class _FaultHandlerDump:
    """``faulthandler.register(signum)`` into a file (a handler installed outside Python,
    which ``signal.getsignal()`` does not see) while the ``with`` block runs."""

    def __init__(self, signum: int, path: Path, *, chain: bool = False) -> None:
        self.signum = signum
        self.path = path
        self.chain = chain

    def __enter__(self) -> _FaultHandlerDump:
        self.file = self.path.open("w+")
        faulthandler.register(self.signum, file=self.file, chain=self.chain)
        return self

    def __exit__(self, *exc: object) -> None:
        faulthandler.unregister(self.signum)
        self.file.close()

    def still_dumps(self) -> None:
        """The signal still dumps the stacks (it killed the process when SIG_DFL had been
        put in its place)."""
        os.kill(os.getpid(), self.signum)
        wait_for(lambda: "most recent call first" in self.path.read_text(),
                 what="faulthandler's dump")


@pytest.mark.parametrize("python_handler", [False, True], ids=["alone", "over-python's"])
def test_a_handler_installed_outside_python_is_not_replaced(rehydrate_engine, tmp_path,
                                                            python_handler):
    """``faulthandler.register(SIGUSR1)`` (getsignal() says SIG_DFL) was replaced without
    a word, and ``stop()`` then installed SIG_DFL: the next SIGUSR1 killed the process."""
    with _AppHandler(signal.SIGUSR1) if python_handler else contextlib.nullcontext(), \
            _FaultHandlerDump(signal.SIGUSR1, tmp_path / "dump") as dump:
        before = signal.getsignal(signal.SIGUSR1)
        assert rehydrate_engine.start([SignalDetector("USR1")]) == []
        assert rehydrate_engine.status().extra["detector_errors"] == {"signal": (
            "SIGUSR1 has a handler installed outside Python (faulthandler.register() or a "
            "C extension), which the signal detector will not replace; choose another "
            "signal (REHYDRATE_SIGNAL=USR2)")}
        rehydrate_engine.stop()
        assert signal.getsignal(signal.SIGUSR1) == before
        dump.still_dumps()


def test_failure_reports_a_handler_the_application_installed_later(rehydrate_engine,
                                                                   tmp_path):
    """A handler installed after start() silently disabled the detector, status() still
    listing it as watching; one installed outside Python was then replaced by stop()."""
    det = SignalDetector("USR1")
    with _AppHandler(signal.SIGUSR1):
        rehydrate_engine.start([det])
        assert det.failure() is None
        with _AppHandler(signal.SIGUSR1):
            assert rehydrate_engine.status().extra["detector_errors"] == {"signal": (
                "the application replaced the SIGUSR1 handler; SIGUSR1 no longer reaches "
                "the signal detector")}
        assert det.failure() is None  # its own is back
        with _FaultHandlerDump(signal.SIGUSR1, tmp_path / "dump") as dump:
            assert det.failure() == (
                "a handler installed outside Python (faulthandler.register() or a C "
                "extension) replaced the SIGUSR1 handler; SIGUSR1 may no longer reach the "
                "signal detector (unless that handler chains)")
            rehydrate_engine.stop()
            dump.still_dumps()  # stop() left it in place
        assert det.failure() is None  # stopped


@pytest.mark.parametrize("again", ["same", "another"])
def test_a_start_after_a_stop_off_the_main_thread_gives_the_apps_handler_back(
        rehydrate_engine, caplog, again):
    """stop() off the main thread leaves the detector's inert handler installed; the next
    start() saved it as the application's (with a WARNING that it replaced it) and put it
    back on stop(): the application's handler was lost for good."""
    with _AppHandler(signal.SIGUSR2) as app:
        first = SignalDetector("USR2", window=0)
        rehydrate_engine.start([first])
        off_main = threading.Thread(target=rehydrate_engine.stop)
        off_main.start()
        off_main.join()
        assert signal.getsignal(signal.SIGUSR2) == first._handler  # left, inert
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            rehydrate_engine.start([first if again == "same" else SignalDetector("USR2")])
        assert [r.getMessage() for r in caplog.records] == []
        rehydrate_engine.stop()
        app.gets_the_signal_back()


def test_a_start_refused_after_a_stop_off_the_main_thread_gives_the_apps_handler_back(
        rehydrate_engine, tmp_path):
    """stop() off the main thread, then ``faulthandler.register(chain=True)``: the next
    start(), refused for the outside handler, put the stopped detector's inert handler
    back into Python's table, so the chained signal never reached the application's
    handler again, even after ``faulthandler.unregister()``."""
    with _AppHandler(signal.SIGUSR2) as app:
        rehydrate_engine.start([SignalDetector("USR2", window=0)])
        off_main = threading.Thread(target=rehydrate_engine.stop)
        off_main.start()
        off_main.join()
        with _FaultHandlerDump(signal.SIGUSR2, tmp_path / "dump", chain=True) as dump:
            assert rehydrate_engine.start([SignalDetector("USR2", window=0)]) == []
            assert "installed outside Python" in \
                rehydrate_engine.status().extra["detector_errors"]["signal"]
            rehydrate_engine.stop()
            assert signal.getsignal(signal.SIGUSR2) is app
            dump.still_dumps()
            wait_for(lambda: app.seen == [signal.SIGUSR2], what="the chained signal")
        app.seen.clear()
        app.gets_the_signal_back()


def test_failure_does_not_say_a_chaining_outside_handler_takes_the_signal(rehydrate_engine,
                                                                        tmp_path):
    """``faulthandler.register(chain=True)`` after start() hands the signal on to the
    detector, whose failure() said the signal no longer reached it; once a signal has
    come through that handler, failure() said it "may no longer" reach it, still listing
    the detector as failed."""
    rec = Recorder(rehydrate_engine)
    det = SignalDetector("USR1", window=0)
    may_not = ("a handler installed outside Python (faulthandler.register() or a C "
               "extension) replaced the SIGUSR1 handler; SIGUSR1 may no longer reach "
               "the signal detector (unless that handler chains)")
    with _AppHandler(signal.SIGUSR1):  # put back by stop(), not the inert handler
        rehydrate_engine.start([det])
        with _FaultHandlerDump(signal.SIGUSR1, tmp_path / "dump", chain=True) as dump:
            assert det.failure() == may_not  # no signal through it yet
            dump.still_dumps()
            assert rec.wait(1)[0]["reason"] == "signal"  # it does reach the detector
            assert "detector_errors" not in rehydrate_engine.status().extra
        assert det.failure() is None  # Python's own C handler is back
        # the same C function again, not chaining this time: no longer taken on trust
        with open(tmp_path / "dump2", "w") as f:
            faulthandler.register(signal.SIGUSR1, file=f, chain=False)
            try:
                assert det.failure() == may_not
            finally:
                faulthandler.unregister(signal.SIGUSR1)
        # another handler installed outside Python (SIG_IGN set in C): not known to chain
        ignore = ctypes.create_string_buffer(_SIGACTION_SIZE)
        ctypes.c_void_p.from_buffer(ignore).value = 1  # sa_handler = SIG_IGN
        saved = _sigaction(signal.SIGUSR1, ignore)
        try:
            assert rehydrate_engine.status().extra["detector_errors"] == {"signal": may_not}
        finally:
            _sigaction(signal.SIGUSR1, saved)
        rehydrate_engine.stop()


@pytest.mark.parametrize("where", ["after-stop", "forked-child"])
def test_a_chaining_handler_installed_outside_python_later_hands_on_to_the_apps(
        rehydrate_engine, tmp_path, where):
    """``faulthandler.register(chain=True)`` after start(): stop(), and a child of fork(),
    left the detector's inert handler in Python's table, into which the signal was
    chained, so the application's handler never ran again."""
    with _AppHandler(signal.SIGUSR2) as app:
        rehydrate_engine.start([SignalDetector("USR2", window=0)])
        with _FaultHandlerDump(signal.SIGUSR2, tmp_path / "dump", chain=True) as dump:

            def app_gets_it() -> dict[str, object]:
                apps = signal.getsignal(signal.SIGUSR2) is app
                dump.still_dumps()  # the outside handler stays in force
                if apps:
                    wait_for(lambda: app.seen, what="the application's handler")
                return {"app_handler": apps, "app_calls": len(app.seen)}

            if where == "forked-child":
                assert in_forked_child(app_gets_it) == {"app_handler": True, "app_calls": 1}
                rehydrate_engine.stop()
            else:
                rehydrate_engine.stop()
                assert app_gets_it() == {"app_handler": True, "app_calls": 1}
        assert signal.getsignal(signal.SIGUSR2) is app


def test_a_chaining_handler_installed_outside_python_later_over_sig_ign_stays_quiet(
        rehydrate_engine, tmp_path, monkeypatch):
    """With no application handler (SIG_IGN) to put back, stop() leaves its inert handler
    in Python's table under a chaining outside handler: SIG_IGN there made CPython report
    every chained signal as "Signal 12 ignored due to race condition"."""
    unraisable: list[object] = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    old = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        rehydrate_engine.start([SignalDetector("USR2", window=0)])
        with _FaultHandlerDump(signal.SIGUSR2, tmp_path / "dump", chain=True):
            rehydrate_engine.stop()
            # to this thread: handled, Python's handlers too, before pthread_kill returns
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
            assert "most recent call first" in (tmp_path / "dump").read_text()
        assert unraisable == []
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_a_chaining_handler_installed_outside_python_later_over_sig_dfl_loses_the_default(
        rehydrate_engine, tmp_path):
    """What docs/platforms/modal-and-generic.md says of no application handler (SIG_DFL)
    under an outside handler installed after start(): stop() leaves its inert handler in
    Python's table, so the signal, chained to it or, after ``faulthandler.unregister()``,
    delivered to it, no longer takes its default action (here: ending the process),
    until the application sets a handler with ``signal.signal()``. In a child of fork(),
    which a SIGUSR2 taking its default action kills (failing the test)."""

    def child() -> dict[str, object]:
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
        det = SignalDetector("USR2", window=0)
        rehydrate_engine.start([det])
        dump = tmp_path / "dump"
        with dump.open("w+") as file:
            faulthandler.register(signal.SIGUSR2, file=file, chain=True)
            rehydrate_engine.stop()
            # to this thread: handled, Python's handlers too, before pthread_kill returns
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
            faulthandler.unregister(signal.SIGUSR2)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
        inert = signal.getsignal(signal.SIGUSR2) == det._handler
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # the application's way back
        return {"inert_in_table": inert, "dumped": "most recent call first" in
                dump.read_text(), "alive": True}

    assert in_forked_child(child) == {"inert_in_table": True, "dumped": True, "alive": True}


@pytest.mark.parametrize("later", [False, True], ids=["first-start", "later-start"])
def test_two_signal_detectors_on_different_signals_both_start(rehydrate_engine, caplog, later):
    """``start([SignalDetector("SIGUSR1", ...), SignalDetector("SIGUSR2", ...)])`` started
    only the first (two instances of one key taken for a repeat): SIGUSR2 then hit the
    default action and killed the process."""
    usr1 = SignalDetector("SIGUSR1", kind="restore", window=0)
    usr2 = SignalDetector("SIGUSR2", kind="resume", window=0)
    old1, old2 = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    try:
        if later:
            rehydrate_engine.start("none")
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            assert rehydrate_engine.start([usr1, usr2]) == ["signal", "signal"]
        assert "more than once" not in caplog.text
        assert signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, old2)
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_for(lambda: usr2.received == 1)
        rehydrate_engine.stop()
        assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)) \
            == (old1, old2)
    finally:
        signal.signal(signal.SIGUSR1, old1)
        signal.signal(signal.SIGUSR2, old2)


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


def test_real_time_signals_are_taken_and_bool_and_unwatchable_signals_refused(
        rehydrate_engine, monkeypatch):
    """Real-time signals (which supervisors use) were "unknown signal '35'"; ``True``
    was SIGHUP; SIGCHLD (every child's exit), SIGPIPE (every write to a closed pipe),
    SIGWINCH, SIGTTIN, SIGTTOU, SIGTSTP (the terminal's), SIGURG and SIGSEGV were
    taken."""
    rt1 = signal.SIGRTMIN + 1
    assert parse_signal(str(rt1)) == parse_signal("SIGRTMIN+1") == parse_signal(rt1) == rt1
    assert parse_signal("rtmax-1") == signal.SIGRTMAX - 1
    assert parse_signal("RTMIN") is signal.SIGRTMIN
    for bad in ("0", "999", "RTMIN+999", "12.0"):
        with pytest.raises(ValueError, match="unknown signal"):
            parse_signal(bad)
    with pytest.raises(TypeError, match="not bool"):
        parse_signal(True)
    with pytest.raises(TypeError, match="not bool"):
        SignalDetector(True)
    for refused, why in (("CHLD", "SIGCHLD is sent whenever a child process ends"),
                         ("PIPE", "SIGPIPE is sent whenever a write to a pipe or socket "
                                  "finds its reader gone"),
                         ("WINCH", "SIGWINCH is sent whenever the terminal window"),
                         ("TTIN", "SIGTTIN is sent whenever a background process reads"),
                         ("SIGTTOU", "SIGTTOU is sent whenever a background process "
                                     "writes"),
                         (signal.SIGTSTP, "SIGTSTP is sent whenever the terminal's "
                                          "suspend key"),
                         ("URG", "SIGURG is sent whenever urgent"),
                         ("SEGV", "SIGSEGV is a fault signal"), ("9", "SIGKILL cannot")):
        with pytest.raises(ValueError, match=why):
            SignalDetector(refused)
    monkeypatch.setenv("REHYDRATE_SIGNAL", "RTMIN+1")
    det = SignalDetector(window=0)
    assert (det.signum, det.describe()) == (rt1, "SIGRTMIN+1 -> restore")
    rec = Recorder(rehydrate_engine)
    old = signal.getsignal(rt1)
    try:
        assert rehydrate_engine.start([det]) == ["signal"]
        os.kill(os.getpid(), rt1)
        assert rec.wait(1)[0]["reason"] == "signal"
        rehydrate_engine.stop()
        assert signal.getsignal(rt1) == old
    finally:
        signal.signal(rt1, old)


def test_off_unless_asked_for():
    assert SignalDetector.auto is False
    assert "signal" not in [d.key for d in select("auto")]


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe."""
    import array
    import fcntl
    import termios

    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return buf[0]


def test_stop_while_a_hook_runs_leaves_the_pipe_to_the_worker(rehydrate_engine,
                                                              monkeypatch):
    """stop() gives up waiting for a worker stuck in a hook: it must not close the
    worker's read end under it (the application reuses the number and the worker reads
    the application's bytes as signals), and a notice still in the pipe runs nothing."""
    from rehydrate.detect import signal as signal_module

    monkeypatch.setattr(signal_module, "STOP_WAIT", 0.05)
    entered, release, calls = slow_restore_hook(rehydrate_engine)
    det = SignalDetector("USR2", window=0)
    rehydrate_engine.start([det])
    worker = det._thread
    assert worker is not None
    os.kill(os.getpid(), signal.SIGUSR2)
    assert entered.wait(5.0), "the hook did not run"
    os.kill(os.getpid(), signal.SIGUSR2)  # pending in the pipe when stop() is called
    run = det._run
    assert run is not None
    wait_for(lambda: _unread(run.read_fd) == 1, what="the second notice in the pipe")
    det.stop()
    assert worker.is_alive()  # stop() gave up on it
    app_r, app_w = os.pipe()  # the application's next descriptors
    try:
        os.write(app_w, b"APPDATA")
        release.set()
        worker.join(10.0)
        assert not worker.is_alive()
        os.set_blocking(app_r, False)
        assert os.read(app_r, 100) == b"APPDATA"  # not consumed by the worker
    finally:
        release.set()
        os.close(app_r)
        os.close(app_w)
    assert calls == [1]  # the notice read after stop() ran nothing
    assert det.received == 2


def test_a_signal_to_a_forked_child_is_not_the_parents_restore(rehydrate_engine):
    """A child made with fork() must not keep the parent's handler: it wrote into the
    pipe the parent's worker reads, so a signal sent to the child alone ran the parent's
    restore hooks. The child gets the application's handler back."""
    rec = Recorder(rehydrate_engine)
    app_calls: list[int] = []

    def app_handler(signum, frame):  # type: ignore[no-untyped-def]
        app_calls.append(signum)

    old = signal.signal(signal.SIGUSR2, app_handler)
    try:
        det = SignalDetector("USR2", window=0)
        rehydrate_engine.start([det])

        def child() -> dict[str, object]:
            apps = signal.getsignal(signal.SIGUSR2) is app_handler
            os.kill(os.getpid(), signal.SIGUSR2)
            if apps:
                wait_for(lambda: app_calls, what="the application's handler in the child")
            return {"app_handler": apps, "app_calls": len(app_calls)}

        in_child = in_forked_child(child)
        os.kill(os.getpid(), signal.SIGUSR2)  # the parent's own notice still works
        rec.wait(1)
        rehydrate_engine.stop()  # joins the worker: everything in the pipe was read
        assert det.received == 1  # the child wrote nothing into the parent's pipe
        assert [c["generation"] for c in rec.calls] == [1]
        assert app_calls == []  # not in the parent: the detector's handler ran there
        assert in_child == {"app_handler": True, "app_calls": 1}
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_a_signal_while_slow_hooks_run_is_the_same_restore(rehydrate_engine, monkeypatch):
    """A second signal about the same restore (a supervisor's retry), sent while its hooks
    still run, is dated when it arrived, not when the worker reads it: hooks outlasting
    the window made it a second restore (a new instance ID)."""
    window = 0.5
    entered, release, calls = slow_restore_hook(rehydrate_engine)
    reports = recorded_reports(rehydrate_engine, monkeypatch)
    det = SignalDetector("USR2", window=window)
    rehydrate_engine.start([det])
    run = det._run
    assert run is not None
    os.kill(os.getpid(), signal.SIGUSR2)
    try:
        assert entered.wait(5.0), "the hook did not run"
        entered_at = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_for(lambda: _unread(run.read_fd) == 1, what="the second signal in the pipe")
        # The hooks outlast the window (the condition of the bug), then return.
        wait_for(lambda: time.monotonic() > entered_at + 2 * window,
                 what="the window to pass")
    finally:
        release.set()
    wait_for(lambda: len(reports) == 2, what="the second notice to be handled")
    assert calls == [1]
    assert reports[1].deduplicated
    assert det.received == 2
