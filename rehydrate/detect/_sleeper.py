"""The clock-jump detector's sleep, with the lateness of its wake-up measured by the kernel.

Why: a Python thread that wakes late was either frozen (the process did not run: a
checkpoint) or woke on time and then waited for the GIL (another thread held it). Seen
from Python both look the same, and the CPU-time clues that tell them apart are not
dependable under gVisor (a restored thread that waits for the GIL while the rest of the
process touches its restored memory is charged CPU time, just like a stalled one). A
``timerfd`` read needs no GIL: the kernel counts the timer's expirations up to the moment
the blocked ``read()`` returns in the thread, so a freeze that spans the deadline shows
as extra expirations, and a GIL wait that follows the wake-up does not. Verified under
runsc: a 2.9 s checkpoint/restore freeze read as 2.87 s late in the kernel; a 0.7 s
GIL-holding C call as 0.

:class:`Sleeper` is the fallback where no ``timerfd`` exists (not Linux, an injected
clock): an event wait whose lateness is unknown. ``os.timerfd_create`` is Python 3.13+;
the package supports 3.10, so the calls go through ``ctypes``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

from .._threads import fresh_lock_after_fork

__all__ = ["KernelSleeper", "Sleeper", "open_sleeper"]

log = logging.getLogger("rehydrate")

_CLOCK_MONOTONIC = 1
_TFD_CLOEXEC = 0o2000000


class Sleeper:
    """Sleeps on an event; :meth:`wake` ends a sleep early. Lateness is not measured."""

    def __init__(self) -> None:
        self._woken = threading.Event()

    def sleep(self, seconds: float) -> float | None:
        """Sleep up to ``seconds``; how late the kernel saw the wake-up (None: unknown)."""
        self._woken.wait(seconds)
        self._woken.clear()
        return None

    def wake(self) -> None:
        """End the current (or the next) sleep now; from any thread."""
        self._woken.set()

    def close(self) -> None:
        self._woken.set()


class KernelSleeper(Sleeper):
    """Sleeps in ``read()`` on a periodic ``timerfd`` (one owner thread sleeps)."""

    def __init__(self, fd: int, settime: SetTime, period: float) -> None:
        super().__init__()
        self._fd = fd
        self._settime = settime
        self.period = period
        """Seconds between expirations after the deadline: the lateness resolution."""
        self._lock = threading.Lock()  # wake() against close()
        # A parent thread may hold it at fork() (a stop() waking the sleep): the fork
        # handler's close() below then hung the child inside fork(). Renewed first: that
        # handler is registered after fresh_lock_after_fork's (imported above).
        fresh_lock_after_fork(self)
        _OPEN.add(self)

    def sleep(self, seconds: float) -> float | None:
        armed = time.monotonic()
        self._settime(self._fd, seconds, self.period)
        # wake() sets the flag before it re-arms: seen here, or its arming ends the read.
        if self._woken.is_set():
            self._woken.clear()
            return 0.0
        entered = time.monotonic()
        data = os.read(self._fd, 8)
        self._woken.clear()
        if entered - armed > seconds:
            # The deadline passed before the read began (this thread waited for the GIL
            # after arming): the expirations count that wait, not a sleep. Unknown.
            return None
        expirations = int.from_bytes(data, sys.byteorder)
        return max(0, expirations - 1) * self.period

    def wake(self) -> None:
        self._woken.set()
        with self._lock:
            if self._fd >= 0:
                self._settime(self._fd, 1e-9, 0.0)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        _OPEN.discard(self)
        if fd >= 0:
            os.close(fd)


SetTime = Callable[[int, float, float], None]
"""``settime(fd, first_expiry_in_s, period_s)``: arms a timerfd relative to now."""

_OPEN: weakref.WeakSet[KernelSleeper] = weakref.WeakSet()


def _close_in_child() -> None:
    # The child has no sleeping thread; its detector, when restarted, opens its own timer.
    for sleeper in list(_OPEN):
        sleeper.close()


os.register_at_fork(after_in_child=_close_in_child)


def _timerfd() -> tuple[int, SetTime]:
    """A new ``CLOCK_MONOTONIC`` timerfd and the function that arms it (raises OSError,
    AttributeError where libc has none)."""
    import ctypes

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    class ITimerSpec(ctypes.Structure):
        _fields_ = [("it_interval", Timespec), ("it_value", Timespec)]

    libc = ctypes.CDLL(None, use_errno=True)
    create = libc.timerfd_create
    create.argtypes = [ctypes.c_int, ctypes.c_int]
    # Armed with the GIL held (PyDLL: the call does not release it): released there, the
    # GIL could go to a thread that then holds it past the deadline before this thread
    # reads, and that wait would count as expirations like a freeze.
    arm = ctypes.PyDLL(None, use_errno=True).timerfd_settime
    arm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]

    def failed(call: str) -> OSError:
        err = ctypes.get_errno()
        return OSError(err, f"{call}: {os.strerror(err)}")

    def timespec(seconds: float, *, at_least: int = 0) -> Timespec:
        # Rounded as a whole, not its fraction alone: 0.9999999999 s made tv_nsec 1e9,
        # which the kernel refuses (EINVAL).
        sec, nsec = divmod(max(at_least, round(seconds * 1e9)), 1_000_000_000)
        return Timespec(sec, nsec)

    def settime(fd: int, first: float, period: float) -> None:
        # A first expiry of zero would disarm the timer and the read would block for
        # good: a sleep of 0 (or of less than 0.5 ns) ends at once instead.
        spec = ITimerSpec(timespec(period), timespec(first, at_least=1))
        if arm(fd, 0, ctypes.byref(spec), None) != 0:
            raise failed("timerfd_settime")

    fd = create(_CLOCK_MONOTONIC, _TFD_CLOEXEC)
    if fd < 0:
        raise failed("timerfd_create")
    return fd, settime


def open_sleeper(period: float, *, kernel: bool = True) -> Sleeper:
    """A :class:`KernelSleeper` with ``period`` resolution where the kernel has
    ``timerfd`` (Linux, gVisor), else (or with ``kernel=False``) a :class:`Sleeper`."""
    if not kernel or not sys.platform.startswith("linux"):
        return Sleeper()
    try:
        fd, settime = _timerfd()
    except (OSError, AttributeError, ImportError) as exc:
        log.debug("clock-jump: no timerfd here (%s); a late wake-up is judged by CPU time "
                  "alone", exc)
        return Sleeper()
    return KernelSleeper(fd, settime, period)
