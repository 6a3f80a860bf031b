"""SnapStart bridge: run rehydrate's hooks from AWS Lambda SnapStart's runtime hooks.

The Lambda Python runtime (``awslambdaric``) runs the callables registered with
``snapshot_restore_py.register_before_snapshot`` before it snapshots the initialised
execution environment, and those registered with ``register_after_restore`` in each
environment restored from that snapshot. When ``snapshot_restore_py`` imports,
``rehydrate.start()`` registers one pair of bridge functions there:

* before the snapshot: ``engine.snapshot_requested("snapstart")``; when a required hook
  failed it raises, because SnapStart aborts on the first error of a runtime hook;
* after restore: ``engine.restore_detected("snapstart", kind="restore", since=<the
  monotonic time the before-snapshot bridge started>)`` (generation +1). When another
  detector (identity, clock jump) reported this restore first, the hooks do not run again;
  the bridge's notice returns that report. The time is consumed by the first
  after-restore call (a second call in the same process is a new event).
  Lambda allows 10 s for after-restore work: keep restore hooks within that.

The runtime pops before-snapshot callables as it runs them (newest first) and runs
after-restore callables in registration order; the bridge registers itself once per
process however many engines start it, and again if the runtime already consumed it.

``start("auto")`` starts the bridge only inside Lambda (see :meth:`SnapStartDetector.auto_here`);
``start(["snapstart"])`` starts it wherever ``snapshot_restore_py`` imports (tests, emulators).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

from .._contract import Probe
from . import Detector

if TYPE_CHECKING:
    from ..extensions import Engine

__all__ = ["SnapStartDetector", "SnapStartHookFailed"]

log = logging.getLogger("rehydrate")

_lock = threading.Lock()
_engines: list[Engine] = []
_snapshot_at: float | None = None
"""``time.monotonic()`` when the before-snapshot bridge ran (before the freeze)."""


class SnapStartHookFailed(RuntimeError):
    """Raised from the before-snapshot bridge so that SnapStart aborts the snapshot."""


def _before_snapshot() -> None:
    global _snapshot_at  # one bridge per process
    with _lock:
        engines = list(_engines)
        _snapshot_at = time.monotonic()
    failed = []
    for engine in engines:
        report = engine.snapshot_requested("snapstart")
        if not report.ok:
            failed.append(report)
    if failed:
        names = "; ".join(
            f"{h.name} {h.outcome}" + (f" ({type(h.error).__name__}: {h.error})"
                                       if h.error is not None else "")
            for r in failed for h in r.hooks
            if h.required and h.outcome in ("failed", "timeout"))
        raise SnapStartHookFailed(f"rehydrate before-snapshot hooks failed: {names}") \
            from failed[0].error


def _after_restore() -> None:
    global _snapshot_at  # one bridge per process
    with _lock:
        engines = list(_engines)
        since, _snapshot_at = _snapshot_at, None
    for engine in engines:
        engine.restore_detected("snapstart", kind="restore", since=since)


def _registered(entries: list[Any], fn: object) -> bool:
    return any(entry is fn or (isinstance(entry, tuple) and entry and entry[0] is fn)
               for entry in entries)


def _ensure_registered(module: Any) -> None:
    """Register the bridge functions unless they already are (the runtime pops them)."""
    getters = (getattr(module, "get_before_snapshot", None),
               getattr(module, "get_after_restore", None))
    before = getters[0]() if callable(getters[0]) else None
    after = getters[1]() if callable(getters[1]) else None
    if before is None or not _registered(before, _before_snapshot):
        module.register_before_snapshot(_before_snapshot)
    if after is None or not _registered(after, _after_restore):
        module.register_after_restore(_after_restore)


class SnapStartDetector(Detector):
    """SnapStart: rehydrate's hooks run as snapshot_restore_py runtime hooks."""

    key: ClassVar[str] = "snapstart"
    specificity: ClassVar[int] = 90
    auto: ClassVar[bool] = True

    def __init__(self) -> None:
        self._engine: Engine | None = None

    @classmethod
    def probe(cls) -> Probe:
        if importlib.util.find_spec("snapshot_restore_py") is None:
            return Probe(False, "snapshot_restore_py is not importable (it comes with the "
                         "Lambda Python runtime; elsewhere: pip install 'rehydrate[snapstart]')")
        return Probe(True)

    @classmethod
    def auto_here(cls) -> str | None:
        """Automatic only inside Lambda, from its documented environment variables:
        ``AWS_LAMBDA_INITIALIZATION_TYPE=snap-start``, or ``AWS_LAMBDA_FUNCTION_NAME`` on
        a runtime that does not set the initialization type. ``snapshot_restore_py`` is
        importable on any host that installed it; being importable proves nothing."""
        init_type = os.environ.get("AWS_LAMBDA_INITIALIZATION_TYPE")
        if init_type == "snap-start":
            return None
        if init_type:
            return f"off: AWS_LAMBDA_INITIALIZATION_TYPE is {init_type!r}, not 'snap-start'"
        if os.environ.get("AWS_LAMBDA_FUNCTION_NAME"):
            return None
        return ("off outside AWS Lambda (no AWS_LAMBDA_FUNCTION_NAME); "
                'start(["snapstart"]) starts it')

    def describe(self) -> str:
        return "registered with snapshot_restore_py (Lambda SnapStart runtime hooks)"

    def start(self, engine: Engine) -> None:
        module = importlib.import_module("snapshot_restore_py")
        with _lock:
            _ensure_registered(module)
            if not any(e is engine for e in _engines):
                _engines.append(engine)
        self._engine = engine
        log.debug("SnapStart bridge registered with snapshot_restore_py")

    def stop(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        with _lock:
            # snapshot_restore_py has no unregister: the bridge stays registered and
            # does nothing for an engine that stopped.
            _engines[:] = [e for e in _engines if e is not engine]


SnapStartBridge = SnapStartDetector
"""Former name of :class:`SnapStartDetector` (named after its catalogue key now)."""
