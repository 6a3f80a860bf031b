"""rehydrate._threads: the reusable, never-bounded pool for the restore path's blocking
calls (a clone reuses threads instead of starting them right after the restore)."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import pytest

from rehydrate._threads import ThreadPool
from tests.detect_helpers import wait_for


def named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_sequential_calls_reuse_one_thread() -> None:
    pool = ThreadPool("rht-reuse")
    first = pool.submit(threading.get_ident).result(5)
    assert [pool.submit(threading.get_ident).result(5) for _ in range(20)] == [first] * 20
    assert len(named("rht-reuse")) == 1


def test_a_next_call_made_at_once_finds_the_thread_that_just_answered_idle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker counted itself idle only after publishing the result: a caller that
    made its next call at once, while the worker was descheduled between the two (a CI
    race in the test above), found no idle thread and started another one."""
    pool = ThreadPool("rht-publish")
    next_call_made = threading.Event()
    real_set_result = concurrent.futures.Future.set_result

    def set_result_then_stall(fut: concurrent.futures.Future[object], result: object) -> None:
        real_set_result(fut, result)
        if threading.current_thread().name == "rht-publish":
            next_call_made.wait(5)  # descheduled until the caller made its next call

    monkeypatch.setattr(concurrent.futures.Future, "set_result", set_result_then_stall)
    first = pool.submit(threading.get_ident).result(5)
    second = pool.submit(threading.get_ident)
    next_call_made.set()
    assert second.result(5) == first
    assert len(named("rht-publish")) == 1


def test_reserved_threads_wait_idle_and_serve_the_next_calls() -> None:
    """Each distinct reserved key keeps one idle thread, started at once (before a
    snapshot); they serve later calls, also at the same time, without starting any."""
    pool = ThreadPool("rht-reserve", keep=0, idle_exit=0.05)
    pool.reserve("a")
    pool.reserve("b")
    pool.reserve("a")  # again: nothing more
    wait_for(lambda: len(named("rht-reserve")) == 2, what="the reserved threads")
    reserved = {t.ident for t in named("rht-reserve")}
    together = threading.Barrier(2, timeout=10)  # both calls run at the same time
    both = [pool.submit(lambda: (together.wait(), threading.get_ident())[1])
            for _ in range(2)]
    assert {f.result(10) for f in both} == reserved
    time.sleep(0.2)  # well past idle_exit: reserved threads stay
    assert {t.ident for t in named("rht-reserve")} == reserved


def test_reservations_are_bounded() -> None:
    """Many engines or connections reserving cannot pile up idle threads for ever."""
    pool = ThreadPool("rht-bounded", keep=0, idle_exit=0.05, max_reserved=3)
    for i in range(10):
        pool.reserve(f"connection:{i}")
    wait_for(lambda: len(named("rht-bounded")) == 3, what="three reserved threads")
    assert pool.submit(lambda: 5).result(5) == 5
    assert len(named("rht-bounded")) == 3


def test_a_call_never_waits_for_a_busy_thread() -> None:
    """A call stuck on a hung mount or peer must not delay the next one."""
    pool = ThreadPool("rht-busy")
    release = threading.Event()
    stuck = [pool.submit(release.wait, 30) for _ in range(3)]
    try:
        assert pool.submit(lambda: "answered").result(5) == "answered"
        assert not any(f.done() for f in stuck)
        assert len(named("rht-busy")) == 4
    finally:
        release.set()
    assert all(f.result(5) for f in stuck)


def test_exceptions_reach_the_caller_and_the_thread_lives_on() -> None:
    pool = ThreadPool("rht-raise")
    first = pool.submit(threading.get_ident).result(5)

    def boom() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        pool.submit(boom).result(5)
    with pytest.raises(SystemExit):  # not even SystemExit ends the thread
        pool.submit(lambda: exec("raise SystemExit(3)")).result(5)
    assert pool.submit(threading.get_ident).result(5) == first


def test_idle_threads_beyond_keep_exit() -> None:
    pool = ThreadPool("rht-keep", keep=1, idle_exit=0.05)
    release = threading.Event()
    stuck = [pool.submit(release.wait, 30) for _ in range(3)]
    wait_for(lambda: len(named("rht-keep")) == 3, what="three busy threads")
    release.set()
    assert all(f.result(5) for f in stuck)
    wait_for(lambda: len(named("rht-keep")) == 1, what="extra idle threads to exit")
    assert pool.submit(lambda: 7).result(5) == 7


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_gets_threads_of_its_own() -> None:
    """The parent's idle thread does not exist in a child: the child's first call must
    start one rather than wait for it."""
    pool = ThreadPool("rht-fork")
    pool.reserve("fork-test")
    wait_for(lambda: len(named("rht-fork")) == 1, what="the idle thread")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            ok = pool.submit(lambda: 42).result(5) == 42
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool.submit(lambda: 1).result(5) == 1  # the parent's pool is untouched


def _refuse_starts(monkeypatch: pytest.MonkeyPatch, name: str, times: int = 1) -> list[int]:
    """``Thread.start`` raises for the next ``times`` threads named ``name``, as it does
    when the process is at its pids limit; the list holds how many refusals are left."""
    real = threading.Thread.start
    left = [times]

    def start(self: threading.Thread) -> None:
        if self.name == name and left[0] > 0:
            left[0] -= 1
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return left


def test_a_thread_that_could_not_start_is_no_phantom(monkeypatch: pytest.MonkeyPatch) -> None:
    """It was counted (idle) before start(): the failed call's job stayed queued and the
    pool believed in a thread that did not exist, so a later call was handed to it (no
    thread started for it) and ran, if ever, only behind another — jobs that must run at
    the same time (two connections' reopens) never did."""
    pool = ThreadPool("rht-phantom", keep=0)
    left = _refuse_starts(monkeypatch, "rht-phantom")
    ran: list[str] = []
    with pytest.raises(RuntimeError, match="can't start new thread"):
        pool.submit(ran.append, "refused")
    assert left == [0]
    # the limit is gone: a call made while another runs gets a thread of its own
    a_running, release = threading.Event(), threading.Event()
    a = pool.submit(lambda: (a_running.set(), release.wait(30))[1])
    try:
        assert a_running.wait(5)
        b = pool.submit(release.set)
        assert b.result(5) is None  # not handed to the phantom: it never ran
    finally:
        release.set()
    assert a.result(5) is True
    assert ran == []  # the refused job is not run behind the caller's back
    assert len(named("rht-phantom")) == 2


def test_a_reservation_that_cannot_start_a_thread_does_not_raise(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Reserving is ahead of need: a failure there failed the caller's start() (the
    control socket's, its accept thread already running); the call that needs the
    thread starts it later."""
    pool = ThreadPool("rht-reserve-fail", keep=0)
    _refuse_starts(monkeypatch, "rht-reserve-fail")
    pool.reserve("ctl")
    assert "could not start a thread to keep in reserve" in caplog.text
    assert named("rht-reserve-fail") == []
    assert pool.submit(lambda: "served").result(5) == "served"
