"""gVisor application-driven checkpoint, triggered from inside: :func:`trigger_snapshot`.

An action, not detection: it runs the before-snapshot hooks, writes ``1`` to
``/proc/gvisor/checkpoint`` and waits for the answer on a descriptor opened before the
write — the running gVisor waiter's (:class:`~rehydrate.detect.gvisor.GVisorDetector`)
when there is one, else its own. ``rehydrate.trigger_snapshot()`` is this function on the
default engine.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import stat
import threading
import time
from typing import TYPE_CHECKING

from ._contract import left_to_answer, own_pass_ended, own_pass_started
from ._loop_roles import blocking, running_loop
from ._notify import timeout_value
from ._threads import fresh_lock_after_fork
from .detect.gvisor import (
    _OPEN_READ,
    _OPEN_WRITE,
    ANNOTATION,
    Answer,
    GVisorDetector,
    GVisorError,
    TriggerNotPermitted,
    _handle,
    _missing_reason,
    _parse,
    _poll_read,
    checkpoint_path,
)
from .detect.gvisor import (
    _Trigger as _Ticket,
)
from .extensions import Engine, resolve_engine

if TYPE_CHECKING:
    from ._context import Report, RestoreReport, SnapshotReport

__all__ = ["trigger_snapshot"]

log = logging.getLogger("rehydrate")


def _not_permitted(path: str, exc: OSError) -> TriggerNotPermitted:
    return TriggerNotPermitted(
        f"writing to {path} was refused ({exc.strerror or exc}): application-driven "
        f"checkpoints need the sandbox annotation {ANNOTATION} (and, on GKE, a "
        "PodSnapshotPolicy with triggerConfig.type: workload)")


def trigger_snapshot(
    engine: Engine | None = None,
    *,
    proc: str | None = None,
    timeout: float | None = None,
) -> Answer:
    """Checkpoint this sandbox now and return what happened to this process.

    Runs the before-snapshot hooks, writes ``1`` to the checkpoint file, blocks until gVisor
    answers, runs the restore (``"restore"``) or resume (``"resume"``, ``"error"``) hooks
    and returns the answer. The answer is read on a descriptor opened before the write:
    the running gVisor waiter's when there is one (it runs the hooks and this call waits
    for them), else one of its own. When the before-snapshot hooks fail (``report.ok``
    false) no checkpoint is triggered: the resume hooks run and the answer is ``"error"``.

    Raises :class:`TriggerNotPermitted` (naming the annotation) when gVisor refuses the
    write, :class:`GVisorError` when the file is missing or unusable, ``TimeoutError``
    when ``timeout`` seconds pass without an answer — or when the engine's
    ``snapshot_deadline`` passed first and its run ended this call's before-snapshot
    pass (the resume hooks, or the restore hooks after a freeze, ran: the message says
    "snapshot deadline"; with no ``timeout`` that is what ends a wait for an answer
    that never comes) —, ``ValueError`` (before anything runs) when ``timeout`` is not
    a number of seconds > 0 and at most a year. After the deadline's run a late answer
    is handled as after a timeout: the running waiter's runs its hooks, without a
    waiter it is not read.

    A failure after the before-snapshot hooks ran never leaves the process
    ``snapshotting``: the resume hooks run (kind ``resume``, not a freeze anchor) before
    the error is raised — except when the running waiter timed out waiting for the
    answer *after* the ``1`` was written: its descriptor is registered for this
    checkpoint, so the late answer runs the restore or resume hooks then (until it comes,
    the process stays ``snapshotting``; set ``snapshot_deadline`` on the engine for a
    bound). Without a waiter a late answer is not read: a restore after such a timeout is
    left to the generic detectors (clock jump …).

    While such a late answer is due to the running waiter, a later call never makes the
    process ready before it: when that call fails too (its ``1`` refused with ``ENXIO``
    because the earlier checkpoint is still in progress, or its before-snapshot hooks
    failed) the resume hooks are left to the due answer (the error says so) — bounded
    by the engine's ``snapshot_deadline``, and only while that checkpoint's pass is still
    pending (once a run ended it, the snapshot deadline's, this call carries on). And an
    answer that arrives before this call wrote its ``1`` is the earlier checkpoint's: it
    does not end this call's pass and is not returned as this call's answer (without a
    waiter, one already readable before the write is handled as such, and this call's
    own answer is read on a new descriptor).

    Called on an event loop's thread, it blocks that loop until it returns: the loop
    counts as waiting for a lifecycle event all along (as in a ``simulate_restore()``
    there), so that hooks the running waiter runs meanwhile do not wait for it.
    """
    # Without the mark, the waiter thread's restore hooks sent work to this blocked loop
    # and waited their whole timeout for it (the UDP check: 9.5 s, then degraded).
    with blocking(running_loop()):
        return _trigger_snapshot(engine, proc=proc, timeout=timeout)


def _trigger_snapshot(engine: Engine | None, *, proc: str | None,
                      timeout: float | None) -> Answer:
    if timeout is not None:
        timeout = timeout_value(timeout)  # ValueError before any hook runs
    engine = resolve_engine(engine)
    deadline = None if timeout is None else time.monotonic() + timeout
    waiter = engine.detector("gvisor")
    if not isinstance(waiter, GVisorDetector) or not waiter.running:
        waiter = None
    if proc is None and waiter is not None:
        path = waiter.path
    else:
        path = checkpoint_path(proc)
        if waiter is not None and os.path.abspath(waiter.path) != os.path.abspath(path):
            waiter = None
    try:
        st = os.stat(path)
    except OSError:
        source = None if proc is None else f"trigger_snapshot(proc={proc!r})"
        raise GVisorError(_missing_reason(os.path.dirname(path), source)
                          or f"{path} not found") from None
    if stat.S_ISFIFO(st.st_mode):
        raise GVisorError(f"{path} is a FIFO (a test stand-in for gVisor): it cannot carry "
                          "a trigger, the 1 written would be read back as an answer")
    if stat.S_ISREG(st.st_mode):  # the 1 would be written into it, read back as garbage
        raise GVisorError(f"{path} is a regular file, not gVisor's checkpoint file (a "
                          "leftover, or REHYDRATE_GVISOR_PROC pointing elsewhere)")
    # Opening for write is where gVisor checks permission: find out before any hook runs.
    try:
        wfd = os.open(path, _OPEN_WRITE)
    except PermissionError as exc:
        raise _not_permitted(path, exc) from None
    except OSError as exc:
        raise GVisorError(f"cannot open {path} for writing: {exc.strerror or exc}") from None
    progress = _Progress()
    # Answers the waiter gets before this trigger writes its 1 are an earlier
    # checkpoint's (a timed-out trigger's): registered before the pass begins, so that
    # such an answer does not end this trigger's pass.
    ticket = waiter._trigger_begins() if waiter is not None else None
    # Carry-ons name this trigger's own pass: when a platform's checkpoint ran its
    # `notify save` pass after it (the write of 1 then fails with ENXIO, "a checkpoint is
    # already in progress"), the resume hooks must not undo that pending pass.
    prepared = asked = time.monotonic()  # a lower bound until the pass is known
    try:
        snap = engine.snapshot_requested("gvisor")
        # its own pass exactly (another may have got the engine first, after `prepared`)
        prepared = own_pass_started(engine, snap, prepared)
        if not snap.ok:
            # Left to the due answer only with the snapshot deadline bounding the wait
            # (else degraded for good when that answer never comes).
            if _answer_due(waiter, ticket) and left_to_answer(engine, snap):
                log.error("before-snapshot hooks failed: checkpoint not triggered; %s",
                          _LEFT_TO_ANSWER)
                return "error"
            log.error("before-snapshot hooks failed: checkpoint not triggered; running the "
                      "resume hooks")
            engine.restore_detected("gvisor", kind="resume", anchor=False, frozen_for=0.0,
                                    undoes=prepared)
            return "error"
        # The before-snapshot hooks ran: from here on, a failure must not leave the process
        # "snapshotting" for ever. Unless an answer is still coming to the running waiter
        # (which then runs the hooks), the resume hooks run before the error is raised.
        watch = _DeadlineWatch(engine, snap, waiter)
        try:
            return _trigger(engine, waiter, path, wfd, deadline=deadline, timeout=timeout,
                            progress=progress, ticket=ticket, begun=asked, watch=watch)
        except Exception as exc:
            if progress.answer_pending or progress.ended:
                raise
            if _answer_due(waiter, ticket):
                # An earlier trigger's checkpoint (timed out), or the one under way that
                # refused this write, is still to be answered: the process is not ready
                # until then, and that answer runs the resume hooks for this pass too.
                log.warning("trigger failed after the before-snapshot hooks ran (%s); %s",
                            exc, _LEFT_TO_ANSWER)
                raise _left_to_answer(exc) from exc.__cause__
            log.warning("trigger failed after the before-snapshot hooks ran (%s); running "
                        "the resume hooks, the process carries on", exc)
            # Before the 1 was written nothing can have frozen; after it, a checkpoint
            # may have paused the sandbox while no answer came: not known.
            frozen_for = None if progress.written else 0.0
            try:
                engine.restore_detected("gvisor", kind="resume", anchor=False,
                                        frozen_for=frozen_for, undoes=prepared)
            except Exception:
                log.exception("running the resume hooks after a failed trigger failed")
            raise
        finally:
            watch.close()
    finally:
        if ticket is not None:
            waiter._trigger_ends(ticket)  # type: ignore[union-attr]
        os.close(wfd)


_LEFT_TO_ANSWER = ("a checkpoint under way is still to be answered to the gVisor waiter, "
                   "whose answer runs the resume hooks")
_RAN = "resume hooks ran"


def _answer_due(waiter: GVisorDetector | None, ticket: _Ticket | None) -> bool:
    """Whether an earlier checkpoint's answer is still due to the running waiter (it
    then runs the resume hooks; see :meth:`GVisorDetector._trigger_ends`)."""
    return waiter is not None and ticket is not None and waiter._trigger_ends(ticket)


def _left_to_answer(exc: Exception) -> Exception:
    """``exc`` saying that the resume hooks run at the pending answer, not now."""
    text = str(exc)
    if _RAN not in text or not isinstance(exc, (GVisorError, TimeoutError)):
        return exc
    try:
        return type(exc)(text.replace(_RAN, "the resume hooks run when the checkpoint "
                                            "under way is answered"))
    except Exception:  # pragma: no cover - a subclass with another signature
        return exc


def _skip_earlier_answer(engine: Engine, path: str, rfd: int, since: float,
                         begun: float | None) -> tuple[int, float]:
    """Without a waiter: an answer already readable before the ``1`` is written is an
    earlier checkpoint's (a timed-out trigger's, which ended after ``rfd`` was opened):
    not this trigger's, and not about its pass (``older_than``). Handled as such, then
    ``rfd`` is opened again, for this trigger's checkpoint."""
    poller = select.poll()
    poller.register(rfd, select.POLLIN | select.POLLPRI)
    if not poller.poll(0):  # no wait: already there, or not
        return rfd, since
    arrived = time.monotonic()
    try:
        fresh = os.open(path, _OPEN_READ)  # registered for the next checkpoint: this one's
    except OSError as exc:
        raise GVisorError(f"cannot open {path} for reading: {exc.strerror or exc}; resume "
                          "hooks ran") from None
    try:
        data = _poll_read(rfd, None, None) or b""  # ready: an answer line, or end of file
    except OSError:
        data = b""
    os.close(rfd)
    answers, bad = _parse(data)
    log.info("%s gave %s before this trigger wrote its 1: an earlier checkpoint's answer",
             path, answers[0] if answers else "; ".join(bad))
    if answers:
        try:
            _handle(engine, answers[0], since, "gvisor", arrived,
                    older_than=arrived if begun is None else min(begun, arrived))
        except Exception:
            os.close(fresh)
            raise
    return fresh, time.monotonic()


class _Progress:
    answer_pending = False
    """The running waiter holds a descriptor for the triggered checkpoint: its (late)
    answer runs the restore or resume hooks."""
    ended = False
    """The snapshot deadline's run ended the pass: no carry-on of its own to run."""
    written = False
    """The ``1`` was written: a checkpoint may have begun (and paused the sandbox)."""


def _trigger(engine: Engine, waiter: GVisorDetector | None, path: str, wfd: int, *,
             deadline: float | None, timeout: float | None, progress: _Progress,
             ticket: _Ticket | None = None, begun: float | None = None,
             watch: _DeadlineWatch | None = None) -> Answer:
    """Write ``1`` and wait for the answer (the part of :func:`trigger_snapshot` after the
    before-snapshot hooks ran). ``ticket``: this trigger's record with the waiter;
    ``begun``: a moment before its before-snapshot pass began; ``watch``: ends the wait
    when the snapshot deadline's run ended that pass."""
    rfd = -1
    seq = 0
    since = 0.0
    try:
        if waiter is not None:
            seq = waiter._wait_armed(deadline)
        else:
            try:
                rfd = os.open(path, _OPEN_READ)
            except OSError as exc:  # EMFILE, or the file went away: GVisorError, as documented
                raise GVisorError(f"cannot open {path} for reading: "
                                  f"{exc.strerror or exc}; resume hooks ran") from None
            since = time.monotonic()
        if deadline is not None and time.monotonic() >= deadline:
            # The before-snapshot hooks used up the time: a checkpoint started now would
            # go ahead while the caller is told it timed out (and the resume hooks run).
            raise TimeoutError(f"the before-snapshot hooks took the whole {timeout}s: "
                               "checkpoint not triggered; resume hooks ran")
        if rfd >= 0:
            rfd, since = _skip_earlier_answer(engine, path, rfd, since, begun)
        if waiter is not None and ticket is not None:
            # Checks again, and records the write in the same step: an earlier answer
            # that came since _wait_armed is then seen, never taken for this one's.
            seq = waiter._trigger_writes(ticket, deadline)
        before_write = time.monotonic()
        try:
            written = os.write(wfd, b"1")
        except OSError as exc:
            if waiter is not None and ticket is not None and exc.errno != errno.ENXIO:
                waiter._trigger_unwritten(ticket)  # no checkpoint, no answer due for it
            if exc.errno in (errno.EPERM, errno.EACCES):
                raise _not_permitted(path, exc) from None
            if exc.errno == errno.ENXIO:
                raise GVisorError(f"writing 1 to {path} failed: a checkpoint is already in "
                                  "progress; resume hooks ran") from None
            raise GVisorError(f"writing 1 to {path} failed: {exc.strerror or exc}; "
                              "resume hooks ran, the process carries on") from None
        progress.written = True
        if written != 1:  # pragma: no cover - a 1-byte write is all or nothing
            raise GVisorError(f"short write to {path}")
        log.info("checkpoint triggered through %s; waiting for the answer", path)
        if waiter is not None:
            given_up = None if watch is None else (lambda: watch.gave_up(
                "the gVisor waiter still handles the late answer"))
            try:
                answer, _report = waiter._wait_answer(
                    seq, deadline, ticket.writing if ticket is not None and
                    ticket.writing is not None else before_write, given_up)
            except TimeoutError:
                # The waiter's descriptor gets the late answer and runs the hooks then.
                progress.answer_pending = True
                raise
            return answer
        try:
            data = _poll_read(rfd, None if watch is None else watch.stop_fd, deadline)
        except OSError as exc:
            raise GVisorError(f"reading the answer from {path} failed: "
                              f"{exc.strerror or exc}; resume hooks ran") from None
        why = None if watch is None or data is not None else watch.gave_up(
            "a late answer is not waited for")
        if why is not None:
            progress.ended = True
            raise TimeoutError(why)
        if data is None:
            raise TimeoutError(f"no answer from {path} within {timeout}s; resume hooks ran "
                               "(a late answer is not waited for)")
        arrived = time.monotonic()
        answers, bad = _parse(data)
        if not answers:
            raise GVisorError(f"{path} gave {'; '.join(bad)} after a trigger; resume hooks "
                              "ran")
        if bad:
            log.warning("%s gave %s; ignored (one answer per descriptor)", path,
                        "; ".join(bad))
        _handle(engine, answers[0], since, "gvisor", arrived)
        return answers[0]
    finally:
        if rfd >= 0:
            os.close(rfd)


class _DeadlineWatch:
    """Ends a trigger's wait for gVisor's answer once the snapshot deadline's run ended
    its before-snapshot pass (the platform seems to have given up): without a timeout
    the wait never ended — the process was ready again, the caller still blocked.

    A report listener wakes the wait: the running waiter's condition, or (without a
    waiter) a pipe that :func:`_poll_read` watches. The pass is looked up again on every
    wake-up (:meth:`gave_up`), so a wake-up for another run ends nothing, and a run
    published before the listener was added is found by the first look."""

    def __init__(self, engine: Engine, snap: SnapshotReport,
                 waiter: GVisorDetector | None) -> None:
        self._engine = engine
        self._snap = snap
        self._waiter = waiter
        self._lock = threading.Lock()
        # Its report listener stays on the engine in a child of fork(), where a restore
        # run the snapshot deadline starts calls it: the trigger's thread may hold it then.
        fresh_lock_after_fork(self)
        self._closed = False
        self._later: RestoreReport | None = None
        """A deadline run heard since the wait began that ended a later pass (a `notify
        save` inside the checkpoint this trigger started began one)."""
        self._stop_r = self._stop_w = -1
        if waiter is None:
            self._stop_r, self._stop_w = os.pipe()
        engine.add_listener(self._heard)
        if waiter is None:
            self._wake()  # a run published before the listener was there

    @property
    def stop_fd(self) -> int | None:
        """Readable once the deadline's run ended the pass (without a waiter)."""
        return self._stop_r if self._stop_r >= 0 else None

    def gave_up(self, late: str) -> str | None:
        """Why the wait ends (``late``: what becomes of a late answer), or None: the pass
        is still pending, or another run ended it (the answer is still waited for)."""
        run = own_pass_ended(self._engine, self._snap)
        if run is None or run.reason != DEADLINE_REASON:
            # The deadline ended a later pass instead (only the latest pass is marked
            # ended): the process carried on all the same, and the wait never ended.
            run = self._later
            if run is None:
                return None
        return (f"no answer from gVisor before the snapshot deadline "
                f"({self._engine_deadline()}): it ran the {run.kind} hooks; {late}")

    def _engine_deadline(self) -> str:
        seconds = getattr(self._engine, "snapshot_deadline", None)
        return "snapshot_deadline" if seconds is None else f"snapshot_deadline {seconds:g}s"

    def _heard(self, report: Report) -> None:
        if (report.kind == "snapshot" or report.reason != DEADLINE_REASON
                or report.started_at < self._snap.started_at):
            return  # (an earlier pass's deadline run, published late, is not about this)
        self._later = report  # type: ignore[assignment]  # not a snapshot: a restore's
        if self._waiter is not None:
            cond = self._waiter._cond
            with cond:  # the trigger looks under it: woken after its look, or sees it
                cond.notify_all()
            return
        self._wake()

    def _wake(self) -> None:
        with self._lock:  # never written once closed: the number may be reused
            if not self._closed and self.gave_up("") is not None:
                os.write(self._stop_w, b"x")

    def close(self) -> None:
        self._engine.remove_listener(self._heard)
        with self._lock:
            self._closed = True
            for fd in (self._stop_r, self._stop_w):
                if fd >= 0:
                    os.close(fd)


DEADLINE_REASON = "snapshot-deadline"
"""The ``reason`` of the snapshot deadline's run (:meth:`Lifecycle._deadline_run`)."""
