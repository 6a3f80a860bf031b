"""Clock-jump detector: a sleeping thread notices that ``CLOCK_MONOTONIC`` stepped.

A frozen process does not run, but on the platforms that matter the monotonic clock
keeps counting while it is frozen: under gVisor ``CLOCK_MONOTONIC`` includes the time
between checkpoint and restore (verified: a 0.5 s sleep loop saw a 5.6 s step), and a
process stopped with ``SIGSTOP`` sees the same step when it is continued. The thread
sleeps ``interval`` seconds at a time; when a wake-up comes more than ``threshold``
seconds later than the expected sleep, that is reported as a restore (reason
``clock-jump``, kind ``restore``, ``frozen_for`` = the step beyond the sleep).

Which clock: ``CLOCK_MONOTONIC`` on purpose, not ``CLOCK_BOOTTIME``. When a laptop or VM
suspends, ``CLOCK_BOOTTIME`` jumps by the time suspended while ``CLOCK_MONOTONIC`` does
not, so a system suspend is not mistaken for a restore. The flip side: a platform that
restores a VM with its guest clock carried over (a Firecracker snapshot restores
kvm-clock from the snapshot) may show no step at all — use the vmclock detector or the
SnapStart bridge there.

A Python thread also wakes late when another thread holds the GIL in a long C call. That
looks like a jump, but the process was busy, not frozen: its CPU time advanced. A step
during which the process used CPU for at least 80 % of the elapsed wall time is logged
and not reported (``busy_check``; a frozen process uses no CPU while frozen).

Detection latency: after a freeze the pending sleep is already overdue, so the thread
wakes as soon as the process runs again; ``interval`` bounds only the part of the
freeze that can go unnoticed (a step is measured from the last wake-up). Idle cost is
one wake-up per ``interval``.

Configuration: ``REHYDRATE_CLOCK_INTERVAL`` (seconds, default 0.5),
``REHYDRATE_CLOCK_THRESHOLD`` (default 2.0), ``REHYDRATE_CLOCK_GRACE`` (how long to let
a more specific detector report first, default 1.0), ``REHYDRATE_CLOCK_BUSY_CHECK``
(1/0, default 1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from .. import _config
from ._util import DeferringDetector, positive

if TYPE_CHECKING:
    from ..context import RestoreReport

__all__ = ["ClockJumpDetector"]

log = logging.getLogger("rehydrate")

DEFAULT_INTERVAL: float = _config.default("REHYDRATE_CLOCK_INTERVAL")
DEFAULT_THRESHOLD: float = _config.default("REHYDRATE_CLOCK_THRESHOLD")
DEFAULT_GRACE: float = _config.default("REHYDRATE_CLOCK_GRACE")
BUSY_FRACTION = 0.8


class ClockJumpDetector(DeferringDetector):
    """Clock jump: a sleeping thread sees CLOCK_MONOTONIC step past its sleep."""

    name: ClassVar[str] = "clock-jump"
    specificity: ClassVar[int] = 10
    auto: ClassVar[bool] = True

    def __init__(
        self,
        interval: float | None = None,
        threshold: float | None = None,
        grace: float | None = None,
        *,
        clock: Callable[[], float] | None = None,
        cpu_clock: Callable[[], float] | None = None,
        busy_check: bool | None = None,
    ) -> None:
        self.interval = positive(
            interval if interval is not None
            else _config.number("REHYDRATE_CLOCK_INTERVAL"),
            "interval")
        self.threshold = positive(
            threshold if threshold is not None
            else _config.number("REHYDRATE_CLOCK_THRESHOLD"),
            "threshold")
        self.grace = (grace if grace is not None
                      else _config.number("REHYDRATE_CLOCK_GRACE"))
        if busy_check is None:
            flag = _config.flag("REHYDRATE_CLOCK_BUSY_CHECK")
            busy_check = True if flag is None else flag
        self.busy_check = busy_check
        self.clock: Callable[[], float] = clock if clock is not None else time.monotonic
        self.cpu_clock: Callable[[], float] = (cpu_clock if cpu_clock is not None
                                               else time.process_time)
        self.jumps = 0
        """Steps reported as restores (duplicates included)."""
        self.busy_skips = 0
        """Steps ignored because the process was busy, not frozen."""
        self.ticks = 0
        self.pending = False
        """True while a jump was seen and more specific detectors get their grace."""
        self.last_report: RestoreReport | None = None
        super().__init__()

    @classmethod
    def probe(cls) -> str | None:
        try:
            time.clock_gettime(time.CLOCK_MONOTONIC)
        except (AttributeError, OSError) as exc:  # pragma: no cover - every Linux has it
            return f"CLOCK_MONOTONIC is not readable here: {exc}"
        return None

    def describe(self) -> str:
        return (f"wakes every {self.interval:g}s; a CLOCK_MONOTONIC step of more than "
                f"{self.threshold:g}s beyond that is a restore")

    # -- the thread ------------------------------------------------------------------

    def _loop(self, stop: threading.Event) -> None:
        interval, threshold = self.interval, self.threshold
        last, last_cpu = self.clock(), self.cpu_clock()
        while not stop.wait(interval):
            now, cpu = self.clock(), self.cpu_clock()
            self.ticks += 1
            elapsed = now - last
            step = elapsed - interval
            if step > threshold:
                if self.busy_check and cpu - last_cpu >= BUSY_FRACTION * elapsed:
                    log.warning(
                        "clock-jump: the detector thread woke %.1fs late but the process "
                        "used %.1fs of CPU meanwhile (a call held the GIL?); not a restore",
                        step, cpu - last_cpu)
                    self.busy_skips += 1  # after the log: observers of the count see it
                else:
                    self._report(since=last, frozen_for=step, stop=stop)
                    if stop.is_set():
                        return
                    # The hooks took time: measure the next sleep from now.
                    now, cpu = self.clock(), self.cpu_clock()
            last, last_cpu = now, cpu

    def _report(self, since: float, frozen_for: float, stop: threading.Event) -> None:
        engine = self._engine
        if engine is None:
            return
        log.info("clock-jump: CLOCK_MONOTONIC stepped %.1fs beyond the expected sleep",
                 frozen_for)
        self.pending = True
        try:
            if not self._deferral.wait(since) or stop.is_set():
                return
            self.jumps += 1
            self.last_report = engine.restore_detected(
                "clock-jump", kind="restore", since=since, frozen_for=frozen_for)
        except Exception:
            log.exception("clock-jump: running the restore hooks failed")
        finally:
            self.pending = False
