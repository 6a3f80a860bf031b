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

A Python thread also wakes late when another thread holds the GIL. That looks like a
jump, but the process was stalled, not frozen. First question: did the sleep itself end
late? The thread sleeps in ``read()`` on a periodic ``timerfd`` (``_sleeper``), and the
kernel counts the expirations up to the moment that read returns — before the thread
asks for the GIL. A sleep that ended more than the threshold late was a freeze, whatever
followed (a restored process's threads all want the GIL at once: under runsc a clone's
detector thread was charged 0.10 s of CPU across a 3 s freeze that way, and the CPU clue
below took it for a stall, so the clone never became ready). Otherwise the sleep ended on
time, or the process froze while the thread already waited for the GIL; the thread then
tells a stall by its own GIL wake-ups: while it waits it wakes every 5 ms (the
interpreter's switch interval) to ask for it, which shows in its own voluntary context
switches (``getrusage(RUSAGE_THREAD)``, native Linux) and in its own CPU time (gVisor,
which counts no context switches: measured under runsc, a 3.1 s GIL-holding C call cost
the waiting thread 0.3 s of CPU, a 4.6 s checkpoint/restore freeze 0.01 s). A frozen
thread does neither. Such a stall, and a step during which the process used CPU for at
least 80 % of the elapsed time, is logged and not reported (``busy_check``).

Freeze watch: every wake-up is a heartbeat for the engine
(:meth:`~rehydrate._lifecycle.Lifecycle.heartbeat`). A clone whose main loop asks
``is_ready()`` right after it resumed — before this thread has run — gets False, because
the last heartbeat is older than ``interval + threshold``; the hooks run, then it is ready.

The watch never waits for a run: the thread hands each restore notice to a reporter
thread (started with it) that calls the engine and waits for the hooks, and goes on
sleeping and beating meanwhile. A process checkpointed while its restore hooks run (a
clone made mid-run) wakes in its parent's run; the watch sees that freeze too, and the
engine's ``since`` rule gives it exactly one more full run after the current one
(freezes seen while a notice waits merge into it). Before, the thread waiting for the
run was the watch: such a clone finished its parent's run and became ready with the
parent's keys and instance id.

No grace: the first notice of a restore runs the hooks at once. A more specific detector
(the gVisor waiter, ``notify restore``) reporting the same restore later only confirms it
(``confirmed_by`` in the report).

While a snapshot is pending (after the before-snapshot hooks, before any restore or
resume notice) the checkpoint itself is the freeze to look for, and it can be short
(measured under load: 0.1-0.7 s for ``runsc checkpoint --leave-running`` of a bare
interpreter). A sleep cannot see a freeze that begins and ends within it: its deadline
is on a clock that counts through the freeze, so the wake-up comes on time (with 0.5 s
sleeps, 6 of 8 such checkpoints went unseen). So the before-snapshot pass wakes the
thread (an engine listener), and while the snapshot is pending it sleeps in slices of
``pending_threshold / 5``: a freeze of more than ``pending_threshold`` (default 0.1 s)
plus one slice always shows as a step. Such a step is taken for the checkpoint and ends
it with the restore hooks (kind ``restore``: without a notice the original after a checkpoint that
left it running cannot be told from a clone, and a fresh identity is the safe side). A
job-control stop is not a checkpoint: when the detector was started from the main thread
and ``SIGCONT`` has no handler, it records ``SIGCONT`` (a stopped process receives it
when continued; checkpoints and freezers send none), and a freeze of up to ``threshold``
that ended with one leaves the snapshot pending. The record is made in C, in whichever
thread the kernel hands the signal to (``faulthandler``'s handler, not chained to
Python's): Python's own handler runs only in the main thread and only once it runs Python
code again, so with the main thread asleep and another thread taking the signal it came
too late and the stop was taken for the checkpoint — and, chained, its late record made a
later checkpoint look like a stop. Telling them apart waits up to 0.2 s
for the record; a longer freeze is a restore whether a snapshot is pending or not, so a
clone restored after ``notify save`` runs its hooks at once. A GIL stall never ends a
pending snapshot either.

Detection latency: after a freeze the pending sleep is already overdue, so the thread
wakes as soon as the process runs again; ``interval`` bounds only the part of the
freeze that can go unnoticed (a step is measured from the last wake-up, or from after
the detector's own log line about it: a log write that blocks — a full stderr pipe, a
slow disk — leaves the thread without CPU or GIL wake-ups like a freeze, so that time is
not counted). Idle cost is one wake-up per ``interval`` (50 a second while a snapshot is
pending); the reporter thread idles without wake-ups.

Configuration: ``REHYDRATE_CLOCK_INTERVAL`` (seconds, default 0.5),
``REHYDRATE_CLOCK_THRESHOLD`` (default 2.0), ``REHYDRATE_CLOCK_PENDING_THRESHOLD``
(default 0.1; at most the threshold), ``REHYDRATE_CLOCK_GRACE`` (how long to let a more
specific detector report first, default 0: none), ``REHYDRATE_CLOCK_BUSY_CHECK`` (1/0,
default 1).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .. import _config
from .._contract import Probe
from ._sleeper import Sleeper, open_sleeper
from ._util import DeferringDetector

if TYPE_CHECKING:
    from .._context import Report, RestoreReport
    from .._contract import Engine

__all__ = ["ClockJumpDetector"]

log = logging.getLogger("rehydrate")

DEFAULT_INTERVAL: float = _config.default("REHYDRATE_CLOCK_INTERVAL")
DEFAULT_THRESHOLD: float = _config.default("REHYDRATE_CLOCK_THRESHOLD")
DEFAULT_PENDING_THRESHOLD: float = _config.default("REHYDRATE_CLOCK_PENDING_THRESHOLD")
DEFAULT_GRACE: float = _config.default("REHYDRATE_CLOCK_GRACE")
BUSY_FRACTION = 0.8
GIL_WAKEUPS_PER_S = 20.0
"""A thread waiting for the GIL wakes about 200 times a second; a frozen one never."""
GIL_CPU_FRACTION = 0.03
"""gVisor: the waiting thread's own CPU share while it waits for the GIL (measured 10 %)."""
GAP_SLACK = 0.5
"""A heartbeat this much later than the sleep is a gap: a freeze too short to report,
remembered so that a later notice without a time of its own counts as a new restore.
Well above scheduling noise: on a loaded 2-core host 0.1 s late wake-ups are common, and
each would make a late ``notify restore`` run the hooks a second time."""
PENDING_SLICE = 0.2
"""While a snapshot is pending the thread sleeps this fraction of ``pending_threshold``."""
_CONT_WAIT = 0.2
"""How long a freeze seen while a snapshot is pending waits for a SIGCONT record (the
thread that took the signal writes it as soon as it runs)."""
KERNEL_PERIOD = 0.005
"""Resolution of the kernel's measure of how late a sleep ended (see ``_sleeper``)."""


@dataclass(frozen=True)
class _Marks:
    """What one wake-up of the detector thread measured."""

    now: float
    cpu: float
    thread_cpu: float
    switches: int


def _switches() -> int:
    """Voluntary context switches of the calling thread (0 where not counted: gVisor)."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw)
    except (ImportError, AttributeError, OSError):  # pragma: no cover - non-Linux
        return 0


class _ContWatch:
    """Records SIGCONT (a job-control stop ended) for the whole process, once.

    Python runs a signal handler in the main thread, and only once that thread runs Python
    code again. The kernel hands a process's SIGCONT to any thread that does not block it;
    when that is not the main thread and the main thread sleeps (``time.sleep``, a join,
    a blocking call), the handler runs when the sleep ends — after the detector, which
    waits only briefly, took the stop for the checkpoint and ran the restore hooks (seen
    with a main thread in ``time.sleep(1)``: its handler ran 0.5 s late). So the arrival
    is recorded where it happens: ``faulthandler``'s handler for SIGCONT runs in C in the
    thread that takes the signal, without the GIL, and writes a traceback into a
    non-blocking pipe (only a doorbell: :meth:`poll` drains it).

    Not chained to Python's handler, which therefore never runs while the C record is in
    place: run late, it rang for a stop long over, and a checkpoint (no SIGCONT) within
    its reach was taken for a stop — no hooks, the snapshot pending until its deadline.
    Chaining also re-raised SIGCONT inside a handler installed with ``SA_NODEFER``: a
    burst of SIGCONTs nested handlers until faulthandler's alternate stack overflowed
    (SIGSEGV). Unchained, the kernel blocks SIGCONT while the handler runs. Python's
    handler stays installed: ``signal.getsignal()`` shows it (an application's own
    ``signal.signal(SIGCONT)`` replaces it and the C record alike, and the detector
    then records nothing), and it is the record where ``faulthandler.register`` fails.

    Only the current thread's traceback: dumping every thread's walks their states
    without a lock from the handler, and a thread being created or freed meanwhile
    crashed the process (SIGSEGV, CPython issue 116008) — a server starting a thread per
    request, continued after a stop or sent SIGCONT at a unit's stop by systemd. The
    limit: a thread Python does not know (a native library's worker) that takes the
    signal writes nothing, and the stop is then taken for the checkpoint (the hooks run
    when they need not). The kernel gives a process's SIGCONT to such a thread only when
    every Python thread blocks it or is already handling a signal.

    ``faulthandler`` keeps one registration per signal. An application's own
    ``faulthandler.register(SIGCONT)`` made after ``start()`` replaces this record (with
    ``chain=False`` SIGCONT is then not recorded at all; with ``chain=True`` only by the
    late Python handler). One made before ``start()`` is replaced, and not by this record:
    Python's handler, installed first, takes the signal over from it, and faulthandler,
    taking its own handler for still installed, does not install it again — its dumps
    stop and SIGCONT is recorded only by the (late) Python handler.
    Like the handlers, the pipe (two descriptors) stays for the life of the process.
    """

    installed = False
    last: float | None = None
    """``time.monotonic()`` when a SIGCONT was last seen: the doorbell found rung, or (no
    C record) the Python handler ran."""
    _read_fd: int | None = None
    _write_fd: int | None = None

    @classmethod
    def install(cls) -> bool:
        if not cls.installed:
            if threading.current_thread() is not threading.main_thread():
                return False
            try:
                if signal.getsignal(signal.SIGCONT) not in (signal.SIG_DFL, None):
                    return False  # the application's own handler: leave it alone
                signal.signal(signal.SIGCONT, cls._handler)
            except (ValueError, OSError, AttributeError):  # pragma: no cover
                return False
            cls.installed = True
        if cls._read_fd is None and signal.getsignal(signal.SIGCONT) == cls._handler:
            cls._record_in_c()  # once, or again in a child of fork() (see _forget_in_child)
        return True

    @classmethod
    def _record_in_c(cls) -> None:
        try:
            r, w = os.pipe()
        except OSError as exc:  # pragma: no cover - out of descriptors
            log.debug("clock-jump: SIGCONT is recorded by the Python handler only: %s", exc)
            return
        for fd in (r, w):
            os.set_blocking(fd, False)  # a full pipe must not block a signal handler
        cls._read_fd, cls._write_fd = r, w
        try:
            # Not chained: Python's handler would run late and ring for a stop long over,
            # and the re-raise nests handlers in a burst (see the class docstring).
            faulthandler.register(signal.SIGCONT, file=w, all_threads=False, chain=False)
        except (AttributeError, ValueError, OSError, RuntimeError) as exc:  # pragma: no cover
            log.debug("clock-jump: SIGCONT is recorded by the Python handler only: %s", exc)

    @classmethod
    def _forget_in_child(cls) -> None:
        """After ``fork()``, in the child: the pipe is the parent's too (each would read the
        other's stops). Back to the Python handler alone; ``install()`` opens a new pipe."""
        r, w = cls._read_fd, cls._write_fd
        if r is None or w is None:
            return
        cls._read_fd = cls._write_fd = None
        try:
            if signal.getsignal(signal.SIGCONT) == cls._handler:
                faulthandler.unregister(signal.SIGCONT)  # back to Python's handler
        except (AttributeError, ValueError, OSError, RuntimeError):  # pragma: no cover
            pass
        for fd in (r, w):
            with contextlib.suppress(OSError):
                os.close(fd)

    @classmethod
    def _handler(cls, signum: int, frame: object) -> None:
        cls.last = time.monotonic()
        w = cls._write_fd
        if w is not None:
            with contextlib.suppress(OSError):  # full: it has rung already
                os.write(w, b"c")

    @classmethod
    def poll(cls) -> bool:
        """Drain the doorbell; True (``last`` set to now) when it rang since the last poll.
        The detector polls right before each reading of its clock, so a SIGCONT is dated
        between the reading before its freeze ended and the one after: it counts for that
        step and for no later one."""
        r = cls._read_fd
        if r is None:
            return False
        rang = False
        try:
            while os.read(r, 65536):
                rang = True
        except BlockingIOError:
            pass
        except OSError:  # pragma: no cover - closed by the application
            return False
        if rang:
            cls.last = time.monotonic()
        return rang

    @classmethod
    def continued_since(cls, since: float) -> bool:
        """Was a SIGCONT seen after ``since``? Waits up to ``_CONT_WAIT`` for one: the
        thread that took it may not have run its handler yet."""
        if not cls.installed:
            return False
        deadline = time.monotonic() + _CONT_WAIT
        while True:
            cls.poll()
            last = cls.last
            if last is not None and last > since:
                return True
            left = deadline - time.monotonic()
            r = cls._read_fd
            if left <= 0 or r is None:
                return False
            waiter = select.poll()
            waiter.register(r, select.POLLIN)
            waiter.poll(max(1, math.ceil(left * 1000)))


class ClockJumpDetector(DeferringDetector):
    """Clock jump: a sleeping thread sees CLOCK_MONOTONIC step past its sleep."""

    key: ClassVar[str] = "clock-jump"
    specificity: ClassVar[int] = 10
    auto: ClassVar[bool] = True

    def __init__(
        self,
        interval: float | None = None,
        threshold: float | None = None,
        grace: float | None = None,
        *,
        pending_threshold: float | None = None,
        clock: Callable[[], float] | None = None,
        cpu_clock: Callable[[], float] | None = None,
        busy_check: bool | None = None,
    ) -> None:
        self.interval = _config.seconds(
            interval if interval is not None
            else _config.number("REHYDRATE_CLOCK_INTERVAL"),
            "interval")
        self.threshold = _config.seconds(
            threshold if threshold is not None
            else _config.number("REHYDRATE_CLOCK_THRESHOLD"),
            "threshold")
        self.pending_threshold = _config.seconds(
            pending_threshold if pending_threshold is not None
            else _config.number("REHYDRATE_CLOCK_PENDING_THRESHOLD"),
            "pending_threshold")
        if self.pending_threshold > self.threshold:
            # Raised past the restore threshold (an overloaded host's advice taken too far),
            # a clone restored after `notify save` with a freeze between the two was not
            # taken for a restore at all: it stayed `snapshotting` until another notice or
            # the snapshot deadline. A freeze beyond the restore threshold is a restore.
            # Said only when it was set: the default above a threshold set low is no
            # mistake of the user's.
            name = "REHYDRATE_CLOCK_PENDING_THRESHOLD"
            set_as = ("pending_threshold" if pending_threshold is not None
                      else name if _config.number(name) != _config.default(name) else None)
            if set_as is not None:
                log.warning("clock-jump: %s %gs is above the restore threshold %gs; using %gs",
                            set_as, self.pending_threshold, self.threshold, self.threshold)
            self.pending_threshold = self.threshold
        self.pending_slice = self.pending_threshold * PENDING_SLICE
        """Seconds per sleep while a snapshot is pending: a checkpoint freezing the process
        for more than ``pending_threshold + pending_slice`` is always seen."""
        self.grace = _config.seconds(grace if grace is not None
                              else _config.number("REHYDRATE_CLOCK_GRACE"), "grace", zero_ok=True)
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
        """Steps ignored because the process was busy or stalled on the GIL, not frozen."""
        self.stop_skips = 0
        """Freezes during a pending snapshot that were job-control stops (SIGCONT)."""
        self.ticks = 0
        self.pending = False
        """True while a jump was seen and more specific detectors get their grace."""
        self.last_report: RestoreReport | None = None
        self._based = threading.Event()
        self._sleeper = Sleeper()
        self._listens_to: Engine | None = None
        super().__init__()

    @classmethod
    def probe(cls) -> Probe:
        try:
            time.clock_gettime(time.CLOCK_MONOTONIC)
        except (AttributeError, OSError) as exc:  # pragma: no cover - every Linux has it
            return Probe(False, f"CLOCK_MONOTONIC is not readable here: {exc}")
        return Probe(True)

    def describe(self) -> str:
        return (f"wakes every {self.interval:g}s; a CLOCK_MONOTONIC step of more than "
                f"{self.threshold:g}s beyond that is a restore")

    # -- the thread ------------------------------------------------------------------

    def _prepare(self) -> None:
        _ContWatch.install()
        self._based = threading.Event()
        # The kernel's view of a late wake-up needs the real clock: an injected one
        # (tests) would disagree with it.
        self._sleeper = open_sleeper(KERNEL_PERIOD, kernel=self.clock is time.monotonic)

    def start(self, engine: Engine) -> None:
        """Start the thread; return once it has taken its first reading (at most 1 s):
        a checkpoint right after ``start()`` is then still measured from before it."""
        super().start(engine)
        if self._listens_to is not engine:
            self._unlisten()
            engine.add_listener(self._snapshot_begun)
            self._listens_to = engine
        self._based.wait(1.0)

    def stop(self) -> None:
        self._unlisten()
        thread = self._thread
        if thread is not None:
            thread.stop_event.set()
        self._sleeper.wake()  # the loop sleeps on this, not on its stop event
        super().stop()

    def _unlisten(self) -> None:
        engine, self._listens_to = self._listens_to, None
        if engine is not None:
            engine.remove_listener(self._snapshot_begun)

    def _marks(self) -> _Marks:
        return _Marks(self.clock(), self.cpu_clock(), time.thread_time(), _switches())

    def _stall(self, before: _Marks, after: _Marks, kernel_late: float | None,
               limit: float) -> str | None:
        """Why a late wake-up was a stall of a running process (None: a freeze)."""
        if not self.busy_check:
            return None
        if kernel_late is not None and kernel_late > limit:
            # The thread's sleep itself ended that late: it did not run at all, whatever
            # CPU time it was charged afterwards (a wait for the GIL once resumed).
            return None
        elapsed = after.now - before.now
        cpu = after.cpu - before.cpu
        if cpu >= BUSY_FRACTION * elapsed:
            return f"the process used {cpu:.1f}s of CPU meanwhile (a call held the GIL?)"
        woke = after.switches - before.switches
        if woke >= max(10.0, GIL_WAKEUPS_PER_S * elapsed):
            return f"this thread woke {woke} times meanwhile (waiting for the GIL)"
        own = after.thread_cpu - before.thread_cpu
        if own >= max(0.03, GIL_CPU_FRACTION * elapsed):
            return f"this thread used {own:.2f}s of CPU meanwhile (waiting for the GIL)"
        return None

    def _loop(self, stop: threading.Event) -> None:
        if self._engine is None:
            return
        # The engine compares heartbeats with time.monotonic(): an injected clock (tests)
        # feeds a private stand-in instead.
        engine = self._engine if self.clock is time.monotonic else _NoWatch(self._engine)
        interval, threshold = self.interval, self.threshold
        limit = interval + threshold
        # A heartbeat this overdue may hide a gap not seen yet (a notice must not take the
        # restore before it for its own: see Lifecycle.freeze_since).
        due = interval + GAP_SLACK
        sleeper = self._sleeper
        reporter = _Reporter(self._report, stop)
        _ContWatch.poll()  # a SIGCONT from before the watch is no stop it will see
        last = self._marks()
        engine.heartbeat(last.now, limit, due=due)
        self._based.set()
        try:
            while True:
                # A sleep's deadline is absolute on a clock that counts through a freeze: a
                # freeze that begins and ends within one sleep does not delay the wake-up
                # at all. While a snapshot is pending the checkpoint's short freeze is the
                # thing to see, so the sleeps are short slices of pending_threshold.
                nap = self.pending_slice if engine.snapshot_pending else interval
                kernel_late = sleeper.sleep(nap)
                if stop.is_set():
                    return
                # Before the reading: a SIGCONT found now counts for this step only.
                _ContWatch.poll()
                marks = self._marks()
                self.ticks += 1
                step = marks.now - last.now - nap
                pending = engine.snapshot_pending
                # A log line may block (a full stderr pipe, a slow disk): the thread then
                # waits without CPU or GIL wake-ups, like a frozen one. The next step is
                # measured from after any logging, so that wait never counts as a freeze.
                logged = step > self.pending_threshold and log.isEnabledFor(logging.DEBUG)
                if logged:  # what the stall check will weigh
                    log.debug("clock-jump: woke %.3fs late after a %.3fs sleep (snapshot "
                              "pending: %s); meanwhile process CPU %.3fs, own CPU %.3fs, "
                              "%d switches; late in the kernel: %s", step, nap, pending,
                              marks.cpu - last.cpu, marks.thread_cpu - last.thread_cpu,
                              marks.switches - last.switches, kernel_late)
                limit_step = self.pending_threshold if pending else threshold
                if step > limit_step:
                    stall = self._stall(last, marks, kernel_late, limit_step)
                    # Only a freeze that counts because a snapshot is pending is weighed
                    # against a job-control stop: one longer than the restore threshold
                    # is a restore as it would be without the pending snapshot, and it
                    # must not wait for a SIGCONT that a restored clone never receives.
                    stopped = (stall is None and pending and step <= threshold
                               and _ContWatch.continued_since(last.now))
                    if stopped:
                        stall = "it ended with SIGCONT (a job-control stop)"
                        # Measure on from after the SIGCONT was seen: a reading taken before
                        # it would make the next freeze (the checkpoint) look continued too.
                        marks = self._marks()
                    if stall is not None:
                        log.warning("clock-jump: the detector thread woke %.2fs late but %s; "
                                    "not a %s", step, stall,
                                    "checkpoint" if pending else "restore")
                        # counted after the log line: tests wait on the count
                        if stopped:
                            self.stop_skips += 1
                        else:
                            self.busy_skips += 1
                        marks = self._marks()  # the next step starts after the log line
                        # Still a gap: a real freeze can hide inside a stall (a clone
                        # restored while a hook held the GIL), and a later notice must
                        # then run the clone's hooks. The price: the platform's notice of
                        # a restore whose hook held the GIL past the threshold runs the
                        # hooks a second time (twice at worst, never zero times).
                        engine.heartbeat(marks.now, limit, gap_since=last.now, due=due)
                    else:
                        engine.freeze_noticed(last.now, marks.now)
                        # The freeze began after last.now and, since the wake-up came
                        # late, no later than last.now + nap; it ended after that. So a
                        # run detected up to last.now + nap (a resume answered just
                        # before the checkpoint) came before the freeze, not after it:
                        # only later runs are this restore's (not last.now + step: with
                        # an interval above the threshold a step can be shorter than the
                        # sleep, and a run from before the freeze was taken for the
                        # clone's). Handed to the reporter: this thread goes on watching
                        # while the hooks run.
                        reporter.submit(_Notice(since=last.now + nap,
                                                frozen_for=step, detected=marks.now))
                else:
                    gap = (step > GAP_SLACK
                           and self._stall(last, marks, kernel_late, GAP_SLACK) is None)
                    if logged:
                        marks = self._marks()
                    engine.heartbeat(marks.now, limit, gap_since=last.now if gap else None,
                                     due=due)
                last = marks
        finally:
            sleeper.close()
            engine.heartbeat_stopped()
            reporter.close()

    def _snapshot_begun(self, report: Report) -> None:
        """Engine listener: a before-snapshot pass finished; the checkpoint may follow at
        once, so end the current (long) sleep and watch in short slices from now on."""
        if report.kind == "snapshot":
            self._sleeper.wake()

    def _report(self, notice: _Notice, stop: threading.Event) -> None:
        """Report ``notice`` and wait for its run (on the reporter's thread)."""
        engine = self._engine
        if engine is None:
            return
        # DEBUG: the engine logs the run (with frozen_for) once the hooks ran.
        log.debug("clock-jump: CLOCK_MONOTONIC stepped %.2fs beyond the expected sleep",
                  notice.frozen_for)
        self.pending = True
        try:
            if not self._deferral.wait(notice.since) or stop.is_set():
                return
            self.jumps += 1
            self.last_report = engine.restore_detected(
                "clock-jump", kind="restore", since=notice.since,
                frozen_for=notice.frozen_for, detected_at=notice.detected)
        except Exception:
            log.exception("clock-jump: running the restore hooks failed")
        finally:
            self.pending = False


@dataclass(frozen=True)
class _Notice:
    """A freeze the watch reported as a restore: ``since`` and ``detected`` as in
    :meth:`~rehydrate._lifecycle.Lifecycle.restore_detected`, ``frozen_for`` its step."""

    since: float
    frozen_for: float
    detected: float

    def then(self, later: _Notice) -> _Notice:
        """This notice and ``later`` (both waiting for a run in progress) as one: one
        run after the current one covers both freezes — it is detected after the later
        one. ``since`` is the later one's: a run between the two freezes (another
        detector's, for the earlier one) is not the later clone's restore."""
        return _Notice(since=later.since, frozen_for=self.frozen_for + later.frozen_for,
                       detected=later.detected)


class _Reporter:
    """The thread that reports the watch's freezes to the engine and waits for their runs.

    The watch must go on while a run is in progress: a checkpoint taken then (a clone made
    mid-run) is a new restore, and the thread waiting for that run could not see it — the
    clone finished its parent's run, keys and instance id included, and became ready. So
    the watching thread only hands each notice over; the engine's rule "a restore run
    detected after ``since`` is this one" gives the freeze seen mid-run exactly one more
    run after the current one. Freezes seen while an earlier one waits merge into it (one
    run covers them). Started with the watch, the thread idles without wake-ups; the
    hand-off is one condition notify.
    """

    def __init__(self, report: Callable[[_Notice, threading.Event], None],
                 stop: threading.Event) -> None:
        self._report = report
        self._stop = stop
        # Not renewed at fork(): only its two threads take it, and neither is in a child
        # (a hook run here that forks must end that child with os._exit()).
        self._cond = threading.Condition()
        self._next: _Notice | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._main, name="rehydrate-clock-jump-run",
                                        daemon=True)
        self._thread.start()

    def submit(self, notice: _Notice) -> None:
        with self._cond:
            queued = self._next
            self._next = notice if queued is None else queued.then(notice)
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """End the thread: a notice not taken yet is dropped (the watch stopped); a run in
        progress is waited for up to ``timeout`` seconds, like the watching thread's."""
        with self._cond:
            self._closed = True
            self._next = None
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _main(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._next is not None or self._closed)
                if self._closed:
                    return
                notice, self._next = self._next, None
            if notice is not None:
                try:
                    self._report(notice, self._stop)
                except BaseException:  # SystemExit from a report listener, say
                    # The thread must live on: every later freeze is reported through it.
                    log.exception("clock-jump: reporting a restore failed")


class _NoWatch:
    """The engine as seen by a detector on an injected clock: no freeze watch."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def snapshot_pending(self) -> bool:
        return self._engine.snapshot_pending

    def heartbeat(self, now: float, limit: float, *, gap_since: float | None = None,
                  due: float | None = None) -> None:
        pass

    def freeze_noticed(self, since: float, now: float) -> None:
        pass

    def heartbeat_stopped(self) -> None:
        pass


os.register_at_fork(after_in_child=_ContWatch._forget_in_child)
