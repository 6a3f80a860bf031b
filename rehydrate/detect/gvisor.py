"""gVisor application-driven checkpoint: wait on ``/proc/gvisor/checkpoint``.

gVisor (``pkg/sentry/fsimpl/proc/checkpoint.go``) exposes a character-device-like file:

* opening it registers the descriptor for the *next* checkpoint;
* ``read()`` blocks (``poll``/``epoll`` readiness is supported) until that checkpoint is
  over, then returns ``resume\\n`` (the original process carries on), ``restore\\n`` (this
  is a restored copy) or ``error\\n`` (the checkpoint failed; the process carries on);
  the answer never changes for that descriptor — open again to wait for the next one;
* writing ``1`` triggers a checkpoint. The file is mode 0444 and refuses writers with
  ``EPERM`` unless the sandbox has the annotation
  ``dev.gvisor.internal.checkpoint.enable=true``.

:class:`GVisorDetector` is a daemon thread that opens the file read-only and blocks in
``poll()`` on it and on a private stop pipe: no polling loop, no CPU while waiting.
``restore`` runs the restore hooks (kind ``restore``), ``resume`` the resume hooks (kind
``resume``: hooks that closed things before the snapshot reopen them), ``error`` logs a
failed checkpoint and runs the resume hooks too (the before-snapshot hooks may have
closed things) — unless the failure is the abort a failed ``notify save`` asked for: the
control socket ran the resume hooks for that pass already, and the answer only confirms
that run (``confirmed_by``). A ``resume`` or ``error`` that arrived before the latest
before-snapshot pass began — or while a :func:`rehydrate.trigger_snapshot` had begun and not
yet written its ``1`` — is an earlier checkpoint's (a timed-out trigger's) and runs
nothing for that pass (``older_than`` in
:meth:`~rehydrate._lifecycle.Lifecycle.restore_detected`); a ``restore`` always runs.
An answer arrives when ``poll()`` wakes for it (stamped before it is read), and a
trigger writes only while the descriptor holds no answer and none is being taken out
of it (checked, and its write recorded, in one step), so such an answer is not taken
for that trigger's, however late the thread gets to it — except one arriving between
that step and the ``write()`` itself.
Anything else is logged as one error line; the waiter then re-opens the file for the
next checkpoint. The first line read from gVisor's file is its answer: more lines in
that read are no other checkpoint's answer, and are ignored with one warning line (a
FIFO stand-in is a stream, one answer per line). Each notice carries ``since`` = the
later of the moment the descriptor was opened and :data:`ANSWER_WINDOW` seconds before
the answer arrived, so that another detector's notice of the same restore (the clock
jump, detected after the restore) runs the hooks only once, while an unrelated restore
handled while the descriptor sat open for hours (one only the clock jump saw, or a false
alarm) does not make this real restore look handled. Simulated runs never count (see
``anchor`` in :meth:`~rehydrate._lifecycle.Lifecycle.restore_detected`).

Test stand-ins: ``REHYDRATE_GVISOR_PROC`` (default ``/proc/gvisor``) may point at a
directory whose ``checkpoint`` is a FIFO: a writer that opens it and writes one answer
line per checkpoint plays gVisor's part. The waiter opens a FIFO *blocking* (it sleeps in
``open()`` until a writer comes; ``stop()`` wakes it by opening the FIFO as a writer),
reads answer lines until the writers are gone, then opens it again; a writer that closes
without writing costs one log line, never a spin (under gVisor a FIFO without writers
reads as end of file at once, so a non-blocking reader would spin). The ``since`` of a
FIFO answer is the moment the waiter started to open it (before the freeze). A FIFO
cannot carry a trigger (the ``1`` would be read back as an answer);
:func:`rehydrate.trigger_snapshot` needs the real file, or a stand-in that is a
pseudo-terminal (writes reach the platform side, reads return what the platform side
writes).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import stat
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

from .. import _config
from .._contract import Probe, refuse_another_engine
from .._gvisor import running_under_gvisor
from .._threads import fresh_lock_after_fork
from . import Detector, probe_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._context import RestoreReport
    from ..extensions import Engine

__all__ = [
    "ANNOTATION",
    "DEFAULT_PROC",
    "ENV_PROC",
    "Answer",
    "GVisorDetector",
    "GVisorError",
    "TriggerNotPermitted",
    "checkpoint_path",
    "proc_dir",
]

log = logging.getLogger("rehydrate")

ENV_PROC = "REHYDRATE_GVISOR_PROC"
"""The variable naming another directory than ``/proc/gvisor`` (test stand-ins)."""
DEFAULT_PROC: str = _config.default(ENV_PROC)
"""Where gVisor serves ``checkpoint`` and ``spec_environ``: ``/proc/gvisor``."""
ANNOTATION = "dev.gvisor.internal.checkpoint.enable=true"
"""The sandbox annotation without which gVisor refuses the trigger's write (``EPERM``)."""
PATH_ANNOTATION = "dev.gvisor.internal.checkpoint.path=<dir>"
"""On the root container: creates /proc/gvisor/{checkpoint,spec_environ}."""

Answer = Literal["resume", "restore", "error"]
"""What gVisor answers on a checkpoint descriptor: the original carries on (``resume``),
this is a restored copy (``restore``), or the checkpoint failed (``error``)."""
ANSWERS: tuple[Answer, ...] = ("resume", "restore", "error")

MAX_ANSWER = 256
"""More bytes than this without a newline is not an answer."""

_OPEN_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_OPEN_WRITE = os.O_WRONLY | os.O_CLOEXEC | os.O_NOCTTY
_OPEN_FIFO = os.O_RDONLY | os.O_CLOEXEC  # blocking: waits for a writer
_QUICK = 0.05
"""A bad answer this soon after opening may repeat at once (e.g. a regular file): back off."""
ANSWER_WINDOW = 2.0
"""gVisor delivers the answer as the restored process resumes: a restore detected by
another detector more than this many seconds before the answer arrived is not this one."""
_BACKOFF_MAX = 5.0


class GVisorError(RuntimeError):
    """The gVisor checkpoint file could not be used."""


class TriggerNotPermitted(GVisorError, PermissionError):
    """Writing ``1`` to the checkpoint file was refused (the sandbox lacks the annotation)."""


def proc_dir() -> str:
    """``$REHYDRATE_GVISOR_PROC`` or ``/proc/gvisor``."""
    return _config.text(ENV_PROC) or DEFAULT_PROC


def checkpoint_path(proc: str | None = None) -> str:
    """The checkpoint file: ``checkpoint`` in ``proc``, else in :func:`proc_dir`."""
    return os.path.join(proc or proc_dir(), "checkpoint")


def _missing_reason(proc: str, source: str | None = None) -> str | None:  # noqa: PLR0911
    """None when ``<proc>/checkpoint`` can be opened for reading, else why not.
    ``source``: where ``proc`` came from, as the message names it (default
    ``REHYDRATE_GVISOR_PROC=<proc>``; an argument is no environment variable)."""
    path = os.path.join(proc, "checkpoint")
    if os.path.exists(path):
        if not os.access(path, os.R_OK):
            return f"{path} exists but is not readable by this user"
        if os.path.isfile(path):
            return (f"{path} is a regular file, not gVisor's checkpoint file (a test "
                    "stand-in must be a FIFO)")
        if os.path.isdir(path):
            return f"{path} is a directory, not gVisor's checkpoint file"
        return None
    if proc == DEFAULT_PROC and not os.path.isdir("/proc/self"):
        return "/proc is not mounted, so /proc/gvisor/checkpoint cannot exist"
    if os.path.isdir(proc):
        return (f"{proc} exists but has no checkpoint file: application-driven "
                f"checkpointing is not enabled for this sandbox ({PATH_ANNOTATION})")
    if proc == DEFAULT_PROC:
        return ("/proc/gvisor/checkpoint not found: not running under gVisor, or under a "
                "runsc without application-driven checkpoint support (Debian's 0.0~20221219 and "
                "0.0~20240729 have none), "
                f"or the sandbox lacks the annotation {PATH_ANNOTATION} "
                f"(set {ENV_PROC} for a stand-in)")
    return f"{path} not found ({source or f'{ENV_PROC}={proc}'})"


def _describe_bytes(data: bytes) -> str:
    text = repr(data[:40])
    return text + ("…" if len(data) > 40 else "")


def _poll_read(fd: int, stop_fd: int | None, deadline: float | None) -> bytes | None:
    """Read one answer line from ``fd``: bytes up to a newline, EOF, or MAX_ANSWER.

    Returns None when ``stop_fd`` became readable or ``deadline`` passed first. Never
    busy-waits: it sleeps in ``poll()`` until the descriptor or the stop pipe is ready.
    """
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    if stop_fd is not None:
        poller.register(stop_fd, select.POLLIN)
    buf = b""
    while True:
        if deadline is None:
            timeout_ms = None
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            timeout_ms = max(1, int(left * 1000))
        try:
            events = poller.poll(timeout_ms)
        except InterruptedError:  # pragma: no cover - PEP 475 retries poll itself
            continue
        if not events:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            continue
        if stop_fd is not None and any(e[0] == stop_fd for e in events):
            return None
        try:
            chunk = os.read(fd, MAX_ANSWER + 1 - len(buf))
        except BlockingIOError:
            continue  # readiness without data (a FIFO writer still writing)
        buf += chunk
        if not chunk or b"\n" in buf or len(buf) > MAX_ANSWER:
            return buf


def _wait_readable(fd: int, stop_fd: int) -> bool:
    """Sleep in ``poll()`` until ``fd`` is ready (data, end of file or an error to read):
    True; False when ``stop_fd`` fired."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    poller.register(stop_fd, select.POLLIN)
    events = poller.poll()
    return not any(e[0] == stop_fd for e in events)


def _parse(data: bytes) -> tuple[list[Answer], list[str]]:
    """The answer in ``data`` (at most one: its first line, as gVisor answers a descriptor
    once) and a description of everything else in it."""
    if not data:
        return [], ["no answer (end of file: for a FIFO stand-in, the writer closed "
                    "without writing)"]
    first = data.split(b"\n", 1)[0]
    if len(first) > MAX_ANSWER:  # the first line: an answer and more after it is fine
        return [], [f"{len(first)}+ bytes without a newline, starting "
                    f"{_describe_bytes(first)}"]
    words = [line.strip() for line in data.split(b"\n") if line.strip()]
    if not words:
        return [], ["an empty answer (only whitespace)"]
    word = words[0].decode("ascii", "replace")
    if word not in ANSWERS:
        return [], [f"unknown answer {_describe_bytes(words[0])}"]
    rest = b"\n".join(words[1:])
    return [word], [f"more after its answer: {_describe_bytes(rest)}"] if rest else []


def _handle(engine: Engine, answer: Answer, since: float, reason: str,
            arrived: float, *, older_than: float | None = None) -> RestoreReport:
    """Run the hooks ``answer`` asks for (deduplicated against other detectors by ``since``).

    ``since`` (when the descriptor was opened) is clamped to ``arrived - ANSWER_WINDOW``:
    see the module docstring. An ``error`` answer for a checkpoint whose before-snapshot
    pass a carry-on run already undid (a failed ``notify save``) runs nothing: it
    confirms that run. A ``resume`` or ``error`` answer is about a checkpoint that was
    over when it ``arrived``: a before-snapshot pass begun after that (or after
    ``older_than``: a trigger that had not written its ``1`` yet) is a later
    checkpoint's, and the answer runs nothing for it (``older_than`` in
    :meth:`~rehydrate._lifecycle.Lifecycle.restore_detected`). A ``restore`` always runs.
    """
    opened, since = since, max(since, arrived - ANSWER_WINDOW)
    if answer == "restore":
        return engine.restore_detected(reason, kind="restore", since=since)
    if answer == "error":
        log.warning("gVisor reports that the checkpoint failed; the process carries on")
        # No clone: like every carry-on run, no anchor for a later real restore. Whether
        # the sandbox was paused is not known (frozen_for None): gVisor answers "error"
        # both when the save is refused before the pause (a failing save-restore-exec)
        # and when it fails after pausing (writing the image, or resuming, failed).
        # The resume hooks run for a before-snapshot pass still pending (they may have
        # closed things). When `notify save` failed, the control socket's carry-on run
        # undid this checkpoint's pass already and told the platform to abort: this
        # answer is that abort, and only confirms the run (abort="answered"). The pass
        # must have begun after this descriptor was opened: gVisor answers a descriptor
        # for the next checkpoint to end after its open.
        return engine.restore_detected(reason, kind="resume", since=since, anchor=False,
                                       undoes=opened, abort="answered", detected_at=arrived,
                                       older_than=older_than)
    # The original carried on after the checkpoint that ended as the answer arrived: a
    # pass begun since (a retried trigger's) is not this answer's to end.
    return engine.restore_detected(reason, kind="resume", since=since, detected_at=arrived,
                                   older_than=older_than)


class _Trigger:
    """A :func:`~rehydrate.trigger_snapshot` in progress that waits on this waiter."""

    def __init__(self) -> None:
        self.begun = time.monotonic()
        """Before its before-snapshot pass began."""
        self.writing: float | None = None
        """Just before it wrote its ``1``, when the waiter's descriptor held no answer
        (:meth:`GVisorDetector._trigger_writes`): its checkpoint's answer arrives after
        this, an earlier one's before."""
        self.owes: float | None = None
        """The waiter's ``_due`` this trigger set (undone when its write fails)."""


class GVisorDetector(Detector):
    """gVisor checkpoint file: a thread blocked in read() learns restore / resume / error."""

    key: ClassVar[str] = "gvisor"
    specificity: ClassVar[int] = 100
    auto: ClassVar[bool] = True

    def __init__(self, proc: str | None = None) -> None:
        self._proc_arg = proc
        self.proc = proc or proc_dir()
        self.path = checkpoint_path(self.proc)
        self._engine: Engine | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        """The process that started the thread (a child of fork() has not got it)."""
        self._stop_r = -1
        self._stop_w = -1
        self._stopping = False
        self._cond = threading.Condition()
        # A trigger's deadline watch, left listening on the engine in a child of fork(),
        # notifies it there; the parent's waiter thread may hold it at the fork.
        fresh_lock_after_fork(self, "_cond")
        self._armed = False
        self._armed_fd = -1
        """The armed descriptor (gVisor's file, not a FIFO stand-in), while armed."""
        self._seq = 0
        self._last: tuple[Answer, RestoreReport | None] | None = None
        self._last_at = -float("inf")
        """``time.monotonic()`` when the latest answer (or bad answer) arrived."""
        self._triggers: list[_Trigger] = []
        """Triggers in progress: an answer that arrives before one of them wrote its
        ``1`` is an earlier checkpoint's, not about that trigger's pass."""
        self._due: float | None = None
        """A trigger's checkpoint is under way and its answer has not come (a trigger
        that timed out, or one refused because a checkpoint was in progress): the moment
        before its ``1`` was written, after which that answer arrives."""
        self._last_bad: tuple[int, str] = (-1, "")
        """(sequence number, what) of the latest bad answer."""
        self._arriving: float | None = None
        """When the answer the thread is taking out of the armed descriptor arrived
        (stamped at ``poll()`` wake, before the read; None once handled): a trigger does
        not write its ``1`` meanwhile (see :meth:`_arrives`)."""
        self._bad_streak = 0
        self._backoff_due = False
        self._opens = 0
        self._in_open = False
        self._exited = False
        self._failure: str | None = None
        self._orphaned = False
        self._orphan: threading.Thread | None = None
        """The thread a timed-out stop() left running (it owns the stop pipe until it
        ends): start() refuses to run a second one beside it."""
        self._poll_keeper = not running_under_gvisor()
        self._keeper = -1
        """FIFO stand-in only: a reader held across re-opening, so that an answer written
        while the previous descriptor was being closed stays in the pipe."""

    @classmethod
    def probe(cls) -> Probe:
        why = _missing_reason(proc_dir())
        return Probe(why is None, why or "")

    def probe_instance(self) -> Probe:
        if self._proc_arg is None:
            return probe_of(type(self))
        # A directory of its own is checked by start(), loudly (status detector_errors).
        return Probe(True, f"checked when started: {self.proc}")

    @classmethod
    def configured(cls) -> bool:
        """Another directory than gVisor's own that does not exist (a typo), or whose
        ``checkpoint`` is there but unusable: someone meant this detector to run, so
        that is an error, not a silent skip. A directory that exists without a
        ``checkpoint`` is not: it may serve only ``spec_environ`` to the environment
        refresh (a runsc without ``/proc/gvisor``, see docs/platforms/runsc.md)."""
        proc = proc_dir()
        if proc == DEFAULT_PROC:
            return False
        return not os.path.isdir(proc) or os.path.lexists(checkpoint_path(proc))

    def describe(self) -> str:
        return f"waits in poll() on {self.path}"

    # -- lifecycle -------------------------------------------------------------------

    def start(self, engine: Engine) -> None:
        if self._thread is not None:
            refuse_another_engine(self, self._engine, engine)
            if self._pid != os.getpid():
                # An installed waiter, started again in a child of fork(): its thread,
                # descriptor and state are the parent's (its lock may have been held
                # at the fork). "already running" hid that the child has no waiter.
                raise RuntimeError(f"this gVisor waiter serves the parent process "
                                   f"({self._pid}); a child of fork() needs a "
                                   "GVisorDetector of its own (engine.install("
                                   "GVisorDetector()))")
            raise RuntimeError("this gVisor waiter is already running")
        orphan = self._orphan
        if orphan is not None and orphan.is_alive():
            # It still uses this instance's stop pipe and state: a second thread beside
            # it would leave two waiters, a leaked pipe and a stray thread.
            raise RuntimeError("this gVisor waiter's previous thread is still running "
                               "(in a restore hook, after a stop() that timed out); start "
                               "it again once that has ended, or use a new GVisorDetector")
        self._orphan = None
        why = _missing_reason(self.proc, None if self._proc_arg is None
                              else f"GVisorDetector(proc={self._proc_arg!r})")
        if why is not None:
            raise GVisorError(why)
        self._engine = engine
        self._stopping = False
        self._due = None  # an answer due to a stopped waiter's descriptor never comes
        self._exited = False
        self._failure = None
        self._orphaned = False
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        engine.add_status("gvisor", self.status)
        self._thread = threading.Thread(target=self._main, name="rehydrate-gvisor",
                                        daemon=True)
        self._pid = os.getpid()
        self._thread.start()

    def failure(self) -> str | None:
        return self._failure

    def stop(self, timeout: float = 5.0) -> None:
        thread = self._thread
        if thread is None:
            return
        if self._pid != os.getpid():
            # A child of fork() (an inherited shutdown handler): the waiter is the parent's.
            self.forget_in_child()
            self._thread = None
            return
        self._stopping = True
        with contextlib.suppress(OSError):  # the pipe is ours and never full
            os.write(self._stop_w, b"x")
        with self._cond:
            self._cond.notify_all()
        if thread is not threading.current_thread():
            deadline = time.monotonic() + timeout
            self._unblock_fifo_open(thread, deadline)
            thread.join(max(0.0, deadline - time.monotonic()))  # one timeout in all
        with self._cond:
            self._thread = None
            if not self._exited:
                # Still inside a hook (or stop() called from a hook): the thread closes
                # the pipe itself when it ends.
                self._orphaned = True
                self._orphan = thread
                if thread is not threading.current_thread():
                    log.warning("gVisor waiter still busy (running hooks, or blocked opening "
                                "%s) after %.0fs; left to finish in the background",
                                self.path, timeout)
                return
        self._close_pipe()

    def forget_in_child(self) -> None:
        """In a child of fork(): the waiter is the parent's. A byte in the shared stop
        pipe would end it, and opening the FIFO as a writer would wake it: only this
        process's copies are closed. Still taken for the parent's, the waiter is
        refused by :meth:`start` here (it would take the parent's answers)."""
        if self._thread is None or self._pid == os.getpid():
            return
        keeper, self._keeper = self._keeper, -1
        if keeper >= 0:
            with contextlib.suppress(OSError):
                os.close(keeper)  # a copy: the parent's reader stays
        self._close_pipe()

    def _unblock_fifo_open(self, thread: threading.Thread, deadline: float) -> None:
        """A thread blocked opening a FIFO (waiting for a writer) is woken by becoming one."""
        while thread.is_alive() and self._in_open and time.monotonic() < deadline:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:  # ENXIO: not inside open() yet (or any more); try again
                thread.join(0.005)
                continue
            os.close(fd)
            thread.join(0.05)

    def _close_pipe(self) -> None:
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._stop_r = self._stop_w = -1

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._exited and not self._stopping

    def status(self) -> dict[str, Any]:
        last = self._last
        return {
            "path": self.path,
            "waiting": self._armed,
            "answers": self._seq,
            "opens": self._opens,
            "last_answer": last[0] if last else None,
        }

    # -- the thread ------------------------------------------------------------------

    def _main(self) -> None:
        try:
            while not self._stopping:
                if not self._wait_once():
                    break
                if self._backoff_due:
                    self._backoff_due = False
                    if not self._backoff():
                        break
        except Exception as exc:  # a bug; never let the thread die silently
            log.exception("gVisor waiter failed")
            self._failure = f"its thread died: {type(exc).__name__}: {exc}"
        finally:
            self._drop_keeper()
            with self._cond:
                self._armed = False
                self._arriving = None
                self._exited = True
                self._cond.notify_all()
                if self._orphaned:
                    self._close_pipe()

    def _backoff(self) -> bool:
        """After a bad answer that may repeat at once: wait on the stop pipe. False = stop."""
        delay = min(_BACKOFF_MAX, 0.01 * (2 ** min(self._bad_streak, 10)))
        ready, _, _ = select.select([self._stop_r], [], [], delay)
        return not ready

    def _bad(self, what: str, quick: bool, arrived: float | None = None) -> bool:
        """Log one line for a bad answer; back off before re-opening if it came at once.
        A trigger waiting for this descriptor's answer gets it as an error, unless it
        ``arrived`` (default: now) before that trigger wrote its ``1``."""
        with self._cond:
            self._seq += 1
            self._last_at = time.monotonic() if arrived is None else arrived
            self._last_bad = (self._seq, what)
            self._settle_due(self._last_at)
            self._cond.notify_all()
        self._bad_streak += 1
        self._backoff_due = self._backoff_due or quick
        n = self._bad_streak
        if n <= 3 or (n & (n - 1)) == 0:
            log.error("gVisor checkpoint file %s gave %s; ignored, waiting for the next "
                      "checkpoint%s", self.path, what,
                      f" (bad answer {n} in a row)" if n > 1 else "")
        return not self._stopping

    def _wait_once(self) -> bool:
        """Open the file, wait for its answer(s), handle them. False when stopping.

        gVisor gives one answer per descriptor (then end of file), so the descriptor is
        closed after one answer. A FIFO stand-in is a stream: a writer may stay connected
        and write one answer line per checkpoint, so a FIFO is read until its writers
        are gone (end of file after data is then normal, not an error). A FIFO is opened
        *blocking*, which waits (without CPU) for a writer: with no writer connected a
        FIFO reads as end of file at once on some kernels (gVisor's), so a non-blocking
        reader would spin.
        """
        try:
            fifo = stat.S_ISFIFO(os.stat(self.path).st_mode)
            since = time.monotonic()
            with self._cond:
                self._opens += 1
                # gVisor registers a descriptor for the next checkpoint when open()
                # returns: armed (what trigger_snapshot waits for before writing 1) only
                # then. A FIFO stand-in is armed while it waits in open() for a writer.
                self._armed = fifo
                self._in_open = fifo
                self._cond.notify_all()
            if self._stopping:  # (stop() sets this before it looks at _in_open)
                self._disarm()
                return False
            try:
                fd = self._reopen_fifo() if fifo else os.open(self.path, _OPEN_READ)
            finally:
                with self._cond:
                    self._in_open = False
        except OSError as exc:
            self._disarm()
            return self._bad(f"an error on open ({exc.strerror or exc})", quick=True)
        if not fifo:
            since = time.monotonic()  # gVisor: registered for the next checkpoint now
            with self._cond:
                self._armed = True
                self._armed_fd = fd
                self._cond.notify_all()
        try:
            if self._stopping:
                return False
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return self._bad("nothing usable: it is a regular file (gVisor's is a "
                                 "character device; a stand-in must be a FIFO)", quick=True)
            return self._read_answers(fd, since, fifo)
        finally:
            self._disarm()
            if fifo and not self._stopping:
                self._hold_pipe()
            os.close(fd)

    def _hold_pipe(self) -> None:
        """Before closing a FIFO descriptor, open another reader: an answer a new writer
        writes in between would otherwise vanish with the last reader."""
        self._drop_keeper()
        with contextlib.suppress(OSError):
            self._keeper = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)

    def _drop_keeper(self) -> None:
        keeper, self._keeper = self._keeper, -1
        if keeper >= 0:
            with contextlib.suppress(OSError):
                os.close(keeper)

    def _reopen_fifo(self) -> int:
        """The next FIFO descriptor: the held reader when an answer is already waiting in
        it, else a blocking open (no CPU until a writer comes).

        On Linux the held reader is always the next descriptor: poll() on it sleeps until
        an answer arrives or a writer leaves. Checking it and then opening is a race: a
        writer that answers and leaves in between leaves its answer in the pipe, and the
        blocking open waits for the next writer. gVisor reports a writerless FIFO as hung
        up at once, so there it is checked and opened as before.
        """
        keeper = self._keeper
        if keeper >= 0 and self._poll_keeper:
            self._keeper = -1
            return keeper  # non-blocking: _read_answers takes readiness without data
        if keeper >= 0:
            poller = select.poll()
            poller.register(keeper, select.POLLIN)
            if any(ev & select.POLLIN for _, ev in poller.poll(0)):
                self._keeper = -1
                return keeper  # non-blocking: _read_answers takes readiness without data
        try:
            return os.open(self.path, _OPEN_FIFO)
        finally:
            self._drop_keeper()

    def _read_answers(self, fd: int, since: float, fifo: bool) -> bool:  # noqa: PLR0911
        buf = b""
        got_data = False
        handled = 0
        discard = False  # inside an oversize line: drop bytes up to its newline
        while True:
            if not buf and not discard:
                self._taken()  # no answer in hand: a trigger may write its 1
            arrived: float | None = None
            try:
                if not _wait_readable(fd, self._stop_r):
                    return False  # stopped
                # Stamped before the read, while the answer is still readable: see
                # _arrives.
                arrived = self._arrives()
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                continue  # readiness without data (a FIFO writer still writing)
            except OSError as exc:
                self._disarm()
                quick = time.monotonic() - since < _QUICK
                return self._bad(f"a read error ({exc.strerror or exc})", quick, arrived)
            quick = arrived - since < _QUICK
            buf += chunk
            got_data = got_data or bool(chunk)
            if discard:
                if b"\n" not in buf:
                    buf = b""
                    if chunk:
                        continue
                else:
                    buf = buf.split(b"\n", 1)[1]
                discard = False
            lines = buf.split(b"\n")
            buf = lines.pop()
            if not chunk and buf:  # end of file ends the last line too
                lines.append(buf)
                buf = b""
            for i, line in enumerate(lines):
                word = line.strip()
                if not word:
                    continue
                handled += 1
                # gVisor answers a descriptor once: the rest of its read is no answer.
                # Taken as more answers, "resume\nrestore" ran the restore hooks too, and
                # a garbage read logged an error line per line of it.
                rest = b"" if fifo else b"\n".join([*lines[i + 1:], buf]).strip()
                if word.decode("ascii", "replace") in ANSWERS:
                    if rest:
                        log.warning("gVisor checkpoint file %s gave more after its answer "
                                    "%s: %s; ignored (one answer per descriptor)", self.path,
                                    word.decode("ascii"), _describe_bytes(rest))
                    since = self._answer(cast(Answer, word.decode("ascii")), since, fifo,
                                         arrived)
                elif not self._bad(f"unknown answer {_describe_bytes(word)}", quick,
                                   arrived):
                    return False
                if not fifo:
                    return not self._stopping  # one answer per descriptor: open again
            if len(buf) > MAX_ANSWER:
                handled += 1
                if not self._bad(f"{len(buf)}+ bytes without a newline, starting "
                                 f"{_describe_bytes(buf)}", quick, arrived):
                    return False
                if not fifo:
                    return not self._stopping
                buf, discard = b"", True
            if not chunk:  # end of file
                self._disarm()
                if not got_data:
                    return self._bad("no answer (end of file: for a FIFO stand-in, the "
                                     "writer closed without writing)", quick, arrived)
                if not handled:
                    return self._bad("an empty answer (only whitespace)", quick, arrived)
                return not self._stopping
            if handled and not fifo:
                return not self._stopping  # one answer per descriptor: open again

    def _disarm(self) -> None:
        with self._cond:
            self._armed = False
            self._armed_fd = -1  # closed right after
            self._arriving = None
            self._cond.notify_all()

    def _arrives(self) -> float:
        """The armed descriptor woke ``poll()``: an answer (or end of file) is readable.
        Its arrival is stamped now, under ``_cond`` and before ``read()`` takes it out of
        the descriptor, and marked as being taken (:attr:`_arriving`) until it is
        handled: whenever a trigger looks (:meth:`_wait_quiet`, under ``_cond``), an
        earlier answer is either still readable or stamped and marked — never read and
        not yet stamped. (Stamped after the read, an answer that arrived before a
        trigger's write could be stamped after it, by a thread slow to get the GIL
        back, and that trigger took it for its own.)"""
        with self._cond:
            self._arriving = time.monotonic()
            return self._arriving

    def _taken(self) -> None:
        """Nothing of an answer is in hand any more (handled, or readiness without data):
        a waiting trigger may go on."""
        if self._arriving is None:  # only this thread sets it
            return
        with self._cond:
            self._arriving = None
            self._cond.notify_all()

    def _answer(self, answer: Answer, since: float, rearm: bool, arrived: float) -> float:
        """Run the hooks for one answer; returns the ``since`` for a later answer.

        ``rearm``: the descriptor stays open for further answers (a FIFO stream).
        """
        engine = self._engine
        assert engine is not None
        with self._cond:
            self._armed = False
            older_than = self._older_than(arrived)
            # At once, not after the hooks: a trigger ending meanwhile must see that no
            # answer is due any more, and run its own carry-on (see _trigger_ends).
            self._settle_due(arrived)
        self._bad_streak = 0
        log.debug("gVisor checkpoint answer: %s", answer)
        report: RestoreReport | None = None
        try:
            report = _handle(engine, answer, since, self.key, arrived,
                             older_than=older_than)
        except Exception:
            log.exception("running the hooks for gVisor answer %r failed", answer)
        with self._cond:
            self._seq += 1
            self._last = (answer, report)
            self._last_at = arrived
            self._armed = rearm
            self._cond.notify_all()
        return time.monotonic()  # a later answer on this descriptor is a later checkpoint

    def _older_than(self, arrived: float) -> float | None:
        """``older_than`` for an answer that arrived at ``arrived`` (see :func:`_handle`).
        Under ``_cond``.

        A trigger that had not written its ``1`` by then: its checkpoint had not begun, so
        the answer is an earlier one's and must not end that trigger's pass — begun
        already, or about to (its ``begun``, a moment before its pass, is the bound: its
        pass may be under way and not known here yet). With two triggers at once that
        holds back the answer of the one that wrote first too, when the other registered
        earlier: the process stays ``snapshotting`` until the other's own answer. Moving
        the bound up to the writer's pass let the answer reopen what the other's pass had
        closed, and the other then wrote its ``1`` while the process said ready."""
        return min((t.begun for t in self._triggers
                    if t.writing is None or t.writing > arrived), default=None)

    def _settle_due(self, at: float) -> None:
        """An answer arrived at ``at``: the due one if it came after that ``1`` (an
        earlier checkpoint's otherwise). Under ``_cond``."""
        if self._due is not None and at >= self._due:
            self._due = None

    # -- used by rehydrate._trigger ------------------------------------------------------

    def _trigger_begins(self) -> _Trigger:
        """A trigger is about to run its before-snapshot pass (see :attr:`_triggers`)."""
        trigger = _Trigger()
        engine = self._engine
        with self._cond:
            self._triggers.append(trigger)
            if self._due is not None and engine is not None and not engine.snapshot_pending:
                # A run ended the pass of the checkpoint still to be answered (the snapshot
                # deadline's, the last resort): the process is ready already, so that
                # answer no longer holds this trigger's carry-on back (left to it, a
                # failed pass stayed degraded: no pass of its own to end).
                self._due = None
        return trigger

    def _trigger_writes(self, trigger: _Trigger, deadline: float | None = None) -> int:
        """``trigger`` writes its ``1`` now: its checkpoint's answer is due (set before
        the write: the answer may come before the write returns). Returns the sequence
        number after which its answer comes (for :meth:`_wait_answer`).

        Waits, like :meth:`_wait_armed`, until the waiter's descriptor is registered and
        holds no earlier answer, and records ``trigger.writing`` in the same hold of
        ``_cond``: an earlier answer is then readable (seen: wait), or stamped by the
        thread before this (:meth:`_arrives`: its arrival comes before ``writing``),
        or not there yet — it can only arrive after ``writing``. ``writing`` is read
        before the check, so an answer arriving during the check is seen or later."""
        with self._cond:
            writing = self._wait_quiet(deadline)
            trigger.writing = writing
            if self._due is None:
                self._due = trigger.owes = trigger.writing
            return self._seq

    def _trigger_unwritten(self, trigger: _Trigger) -> None:
        """``trigger``'s write failed: no checkpoint of its own, no answer due for it."""
        with self._cond:
            if trigger.owes is not None and self._due == trigger.owes:
                self._due = None
            trigger.writing = trigger.owes = None

    def _trigger_ends(self, trigger: _Trigger) -> bool:
        """``trigger`` is over; whether a checkpoint's answer is still due to this waiter
        (a timed-out trigger's, or the one under way when this trigger's write was
        refused): that answer then runs the resume hooks — a carry-on now would say
        ready while that checkpoint is pending. One step under the lock: an answer
        arriving meanwhile either came first (and is no longer due: the carry-on runs)
        or finds the trigger gone (and ends its pass)."""
        with self._cond:
            with contextlib.suppress(ValueError):
                self._triggers.remove(trigger)
            return self._due is not None and self.running

    def _wait_armed(self, deadline: float | None) -> int:
        """Wait until the waiter's descriptor is registered for the next checkpoint and
        holds no earlier answer (see :meth:`_wait_quiet`); returns the sequence number.
        A trigger waits here before its last look at its deadline, then writes through
        :meth:`_trigger_writes`, which checks again."""
        with self._cond:
            self._wait_quiet(deadline)
            return self._seq

    def _wait_quiet(self, deadline: float | None) -> float:
        """Under ``_cond``: wait until the descriptor is armed, no answer is being taken
        out of it (:attr:`_arriving`) and none is readable in it — for the calling
        trigger, which has not written its ``1``, an earlier checkpoint's: writing now,
        it could take that answer for its own, and the waiter's descriptor, spent on
        that answer, would not get its checkpoint's. Returns ``time.monotonic()`` read
        just before the check that found it so. TimeoutError past ``deadline`` (also
        when a wait ends at it), GVisorError when the waiter stopped."""
        what: str | None = None  # why it waited last
        while True:
            now = time.monotonic()
            if not self._armed and self._arriving is None:
                what = "the gVisor waiter did not open the checkpoint file"
            elif self._arriving is not None or self._answer_waiting():
                # until it has handled that answer (as an earlier one's) and opened
                # the file again
                what = "the gVisor waiter did not take an earlier checkpoint's answer"
            elif what is not None and deadline is not None and now >= deadline:
                raise TimeoutError(what)  # a wait ended at it: no checkpoint after it
            else:
                return now
            self._wait_some(deadline, what)

    def _wait_some(self, deadline: float | None, what: str,
                   stopped: str = "the gVisor waiter stopped") -> None:
        """One wait on ``_cond`` (held) for a trigger: GVisorError (``stopped``) when the
        waiter stopped, TimeoutError (``what``) past ``deadline``."""
        if not self.running:
            raise GVisorError(stopped)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(what)
        self._cond.wait(left)

    def _answer_waiting(self) -> bool:
        """Whether the armed descriptor is readable already (no wait). Under ``_cond``:
        the thread disarms under it before closing the descriptor."""
        fd = self._armed_fd
        if fd < 0:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        try:
            return any(ev & (select.POLLIN | select.POLLPRI) for _, ev in poller.poll(0))
        except OSError:  # pragma: no cover - the descriptor is open while armed
            return False

    def _wait_answer(self, seq: int, deadline: float | None, written: float = -math.inf,
                     given_up: Callable[[], str | None] | None = None,
                     ) -> tuple[Answer, RestoreReport | None]:
        """The first answer after ``seq`` that arrived after ``written`` (the moment
        before the trigger wrote its ``1``): one that arrived before is an earlier
        checkpoint's (a timed-out trigger's, whose descriptor this waiter held).

        ``given_up``: TimeoutError with the text it returns once it returns one (checked
        under ``_cond``: whoever makes it return text notifies ``_cond``) — the snapshot
        deadline ran the hooks, and without a timeout the wait never ended."""
        with self._cond:
            while True:
                while self._seq <= seq:
                    why = given_up() if given_up is not None else None
                    if why is not None:
                        raise TimeoutError(why)
                    self._wait_some(deadline, "no checkpoint answer before the timeout",
                                    "the gVisor waiter stopped before the answer came")
                if self._last_at >= written:
                    break
                log.info("gVisor answer for an earlier checkpoint (it came before this "
                         "trigger wrote its 1); waiting for this one's")
                seq = self._seq
            bad_seq, what = self._last_bad
            if bad_seq == self._seq:
                raise GVisorError(f"{self.path} gave {what} after the trigger")
            assert self._last is not None
            return self._last


GVisorWaiter = GVisorDetector
"""Former name of :class:`GVisorDetector` (named after its catalogue key now)."""
