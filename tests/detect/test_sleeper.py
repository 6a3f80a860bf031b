"""The clock-jump detector's sleep: the kernel measures how late it ended, the GIL not."""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time

import pytest
from detect_helpers import in_forked_child, wait_for

from rehydrate.detect._sleeper import KernelSleeper, Sleeper, open_sleeper

READ_SYSCALL = {"x86_64": 0, "aarch64": 63}.get(platform.machine())


def _in_read(tid: int) -> bool:
    with open(f"/proc/self/task/{tid}/syscall") as f:
        return f.read().split()[0] == str(READ_SYSCALL)


@pytest.fixture
def sleeper():
    s = open_sleeper(0.005)
    assert isinstance(s, KernelSleeper)
    yield s
    s.close()


@pytest.mark.skipif(READ_SYSCALL is None, reason="read's syscall number unknown here")
def test_a_wait_for_the_gil_after_the_deadline_is_not_lateness(sleeper):
    """The thread's timer expired on time; it then waited 0.6 s for the GIL (held by a C
    call): the kernel's measure says on time, Python's clock says 0.6 s late."""
    result: dict[str, float | None] = {}

    def sleep() -> None:
        result["tid"] = threading.get_native_id()
        t0 = time.monotonic()
        result["late"] = sleeper.sleep(0.2)
        result["took"] = time.monotonic() - t0

    t = threading.Thread(target=sleep)
    t.start()
    wait_for(lambda: "tid" in result and _in_read(int(result["tid"] or 0)),
             what="the thread blocked in read()")
    ctypes.PyDLL(None).usleep(600000)  # holds the GIL past the thread's deadline
    t.join(5)
    assert result["took"] is not None and result["took"] >= 0.55, result
    assert result["late"] is not None and result["late"] < 0.1, result


def test_wake_ends_a_sleep_at_once(sleeper):
    done = threading.Event()
    result: list[float | None] = []
    t = threading.Thread(target=lambda: (result.append(sleeper.sleep(30)), done.set()))
    t.start()
    sleeper.wake()
    assert done.wait(5), "wake() did not end a 30 s sleep"
    assert result == [0.0]
    t.join()


def test_a_wake_before_the_sleep_ends_the_next_sleep_and_only_that(sleeper):
    sleeper.wake()
    t0 = time.monotonic()
    assert sleeper.sleep(30) == 0.0
    assert time.monotonic() - t0 < 5
    assert sleeper.sleep(0.01) is not None  # the flag was consumed: an ordinary sleep


def test_close_releases_the_descriptor_and_wake_after_it_is_harmless(sleeper):
    fd = sleeper._fd
    os.fstat(fd)
    sleeper.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    sleeper.wake()
    sleeper.close()


def test_a_forked_child_closes_the_timer_it_inherited(sleeper):
    fd = sleeper._fd

    def child() -> dict[str, object]:
        try:
            os.fstat(fd)
            still_open = True
        except OSError:
            still_open = False
        return {"open": still_open, "fd": sleeper._fd}

    assert in_forked_child(child) == {"open": False, "fd": -1}
    os.fstat(fd)  # the parent's stays open


def test_without_the_kernel_timer_lateness_is_unknown():
    s = open_sleeper(0.005, kernel=False)
    assert type(s) is Sleeper
    assert s.sleep(0.001) is None
    s.wake()
    t0 = time.monotonic()
    s.sleep(30)
    assert time.monotonic() - t0 < 5


def test_a_wait_between_arming_and_reading_is_not_lateness():
    """The thread armed its timer, then (waiting for the GIL) reached its read() only
    after the deadline: the read returns at once with the expirations of that wait, which
    must not be taken for a freeze. Here the wait is a sleep inside the arming call."""
    from rehydrate.detect._sleeper import _timerfd

    fd, settime = _timerfd()

    def arm_then_stall(fd: int, first: float, period: float) -> None:
        settime(fd, first, period)
        time.sleep(first + 0.3)

    s = KernelSleeper(fd, arm_then_stall, 0.005)
    try:
        assert s.sleep(0.05) is None
    finally:
        s.close()


@pytest.mark.parametrize("seconds", [0.0, 1e-10, -1.0, 0.9999999999])
def test_any_sleep_length_ends_and_none_is_refused_by_the_kernel(sleeper, seconds):
    """The timerfd is armed with the first expiry as a timespec: a zero one disarms the
    timer (the read then blocked for good), and a fraction rounding up to 1e9 ns was
    refused (EINVAL, ending the detector's thread)."""
    outcome: list[object] = []

    def sleep() -> None:
        try:
            outcome.append(sleeper.sleep(seconds))
        except OSError as exc:
            outcome.append(exc)

    t = threading.Thread(target=sleep, daemon=True)
    t.start()
    t.join(10.0)
    if t.is_alive():
        sleeper.wake()  # release the test's thread
        t.join(5.0)
        pytest.fail(f"sleep({seconds!r}) never ended by itself")
    assert len(outcome) == 1 and not isinstance(outcome[0], OSError), outcome


def test_a_child_forked_while_a_parent_thread_wakes_the_timer_closes_it(sleeper):
    """A parent thread inside wake() (a stop() ending the sleep) holds the lock the
    child's fork handler closes the timer under: the child hung inside fork()."""
    fd = sleeper._fd
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with sleeper._lock:
            holding.set()
            release.wait(10.0)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert holding.wait(10.0)
    try:
        out = in_forked_child(lambda: {"fd": sleeper._fd})
    finally:
        release.set()
        holder.join(10.0)
    assert out == {"fd": -1}
    os.fstat(fd)  # the parent's stays open
