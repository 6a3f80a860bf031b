"""Small pieces shared by the generic detectors (clock, identity, vmclock, signal, file).

Private: nothing here is public API.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from .. import _config
from .._contract import refuse_another_engine
from .._threads import fresh_lock_after_fork
from . import Detector

if TYPE_CHECKING:
    from .._context import Report
    from ..extensions import Engine

log = logging.getLogger("rehydrate")

DEFAULT_WINDOW: float = _config.default("REHYDRATE_SIGNAL_WINDOW")
"""Event-driven detectors (signal, file, vmclock notification) cannot tell when the
process was frozen; a restore already handled less than this many seconds before their
notice is taken to be the same restore."""


def env_kind(name: str) -> Literal["restore", "resume"]:
    """``restore`` or ``resume`` from a declared choice variable (default: ``restore``)."""
    return "resume" if _config.choice(name) == "resume" else "restore"


def checked_kind(kind: str) -> Literal["restore", "resume"]:
    """``kind`` if it is ``restore`` or ``resume``; else ``ValueError``."""
    if kind not in ("restore", "resume"):
        raise ValueError(f"kind must be 'restore' or 'resume', not {_config.shown(kind)}")
    return kind  # type: ignore[return-value]


class Deferral:
    """Lets a generic detector give a more specific running detector the first word.

    When a generic detector (clock jump, identity) sees a restore while a more specific
    detector is running (the gVisor waiter, vmclock …), it waits up to ``grace`` seconds
    for a restore report to appear before reporting itself. The engine's ``since``
    de-duplication then makes the generic notice a duplicate of the specific one, so the
    report carries the specific reason. Waiting is on an event (set by the engine's
    report listener, or by :meth:`cancel`), never a sleep.
    """

    def __init__(self, detector: Detector, grace: float) -> None:
        self.detector = detector
        self.grace = grace
        self._event = threading.Event()
        self._engine: Engine | None = None
        self._cancelled = False

    def attach(self, engine: Engine) -> None:
        self._engine = engine
        self._cancelled = False
        engine.add_listener(self._on_report)

    def detach(self) -> None:
        engine, self._engine = self._engine, None
        self.cancel()
        if engine is not None:
            with contextlib.suppress(ValueError):
                engine.remove_listener(self._on_report)

    def cancel(self) -> None:
        self._cancelled = True
        self._event.set()

    def _on_report(self, report: Report) -> None:
        if report.kind in ("restore", "resume"):
            self._event.set()

    def wait(self, since: float) -> bool:
        """Give more specific detectors up to ``grace`` seconds. False when cancelled."""
        engine = self._engine
        if engine is None or self._cancelled:
            return False
        specific = engine.specific_detectors(than=self.detector.specificity)
        if not specific or self.grace <= 0:
            return True
        self._event.clear()
        last = engine.last_restore_at  # anchored restores only: a simulation is no report
        if last is not None and last > since:
            return not self._cancelled  # the specific report is already in
        log.debug("%s: giving %s up to %.2fs to report first", self.detector.key,
                  ", ".join(d.key for d in specific), self.grace)
        self._event.wait(self.grace)
        return not self._cancelled


class DetectorThread:
    """A daemon thread running ``target(stop_event)``; :meth:`stop` sets the event and joins."""

    def __init__(self, name: str, target: Callable[[threading.Event], None]) -> None:
        self.stop_event = threading.Event()
        self._target = target
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: str | None = None
        """Why the thread ended while it was not asked to stop (``None`` while it runs)."""

    def _run(self) -> None:
        try:
            self._target(self.stop_event)
        except BaseException as exc:  # SystemExit too: the detector is dead either way
            log.exception("detector thread %s died", self._thread.name)
            self.error = f"its thread died: {type(exc).__name__}: {exc}"

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_event.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Running its target. A thread that died is not, though it may still be finishing
        (its ``error`` is set just before it ends): a ``start()`` made as soon as
        ``failure()`` said so took it for running and did nothing, leaving the detector
        dead."""
        return self.error is None and self._thread.is_alive()


def thread_failure(thread: DetectorThread | None) -> str | None:
    """:meth:`Detector.failure` of a detector running on ``thread``."""
    return None if thread is None else thread.error


class DeferringDetector(Detector):
    """A generic detector whose :class:`DetectorThread` runs :meth:`_loop` and that defers
    to more specific detectors through a :class:`Deferral`.

    Subclasses set ``grace`` and call ``super().__init__()``, implement :meth:`_loop`,
    and may override :meth:`_prepare` (runs under the lock before the thread starts).
    """

    grace: float

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self._thread: DetectorThread | None = None
        self._deferral = Deferral(self, self.grace)
        self._lock = threading.Lock()
        # a parent thread may hold it at fork() (a start() or stop()): the child's start()
        # of an installed instance waited for it for ever
        fresh_lock_after_fork(self)

    def failure(self) -> str | None:
        return thread_failure(self._thread)

    def start(self, engine: Engine) -> None:
        with self._lock:
            if self._thread is not None and self._thread.alive:
                refuse_another_engine(self, self._engine, engine)
                return
            # Started again after its thread died, without stop(): the old deferral's
            # report listener is still attached (a leak, and one more per restart).
            self._deferral.detach()
            self._engine = engine
            self._prepare()
            self._deferral = Deferral(self, self.grace)
            self._deferral.attach(engine)
            self._thread = DetectorThread(f"rehydrate-{self.key}", self._loop)
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            self._deferral.detach()
        if thread is not None:
            thread.stop()

    def _prepare(self) -> None:
        """Per-detector setup before the thread starts (under the lock)."""

    def _loop(self, stop: threading.Event) -> None:
        raise NotImplementedError
