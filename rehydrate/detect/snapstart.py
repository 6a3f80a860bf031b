"""SnapStart bridge: run rehydrate's hooks from AWS Lambda SnapStart's runtime hooks.

The Lambda Python runtime (``awslambdaric``) runs the callables registered with
``snapshot_restore_py.register_before_snapshot`` before it snapshots the initialised
execution environment, and those registered with ``register_after_restore`` in each
environment restored from that snapshot. When ``snapshot_restore_py`` imports,
``rehydrate.start()`` registers one pair of bridge functions there:

* before the snapshot: ``engine.snapshot_requested("snapstart")`` for each engine in
  turn; when a required hook of one failed it raises :class:`SnapStartHookFailed`,
  because that is the only way to stop SnapStart from snapshotting a half-prepared
  process (the runtime reports an init error and exits; publishing the version fails).
  No snapshot follows, so first — as the control socket does for a refused save — the
  engines whose passes ran, the refusing one included, get a resume run
  (``restore_detected("snapstart", kind="resume", frozen_for=0.0)``: their resume hooks
  reopen what their before-snapshot hooks closed) and are ready again rather than left
  ``snapshotting``; the engines after it are not asked to prepare. The message is one
  line naming the refusing engine (``engine 2 of 3``, in the order the engines started
  the bridge, when there are several), its failed hooks, and how the resume runs went;
* after restore: ``engine.restore_detected("snapstart", kind="restore", since=<the
  monotonic time the before-snapshot bridge started>)`` (generation +1). When another
  detector (identity, clock jump) reported this restore first, the hooks do not run
  again; the bridge's notice returns that report. The time is consumed by the first
  after-restore call (a second call in the same process is a new event). When a required
  hook failed or timed out — in this run or in the one it confirms — it raises
  :class:`SnapStartHookFailed` (one line: the hooks and their errors) after the report
  was published and logged: Lambda has no readiness probe, so failing the runtime hook is
  the only way to make it discard the environment instead of sending invocations to a
  degraded process.

Lambda allows 10 s for after-restore work and ends the restore without any report when
it takes longer. So while the bridge runs, every restore run of the engine has a total
deadline (``REHYDRATE_SNAPSTART_DEADLINE``, default :data:`DEFAULT_DEADLINE` s from its
notice, or ``SnapStartDetector(deadline=…)``; ``engine.set_restore_deadline``) — also a
run another detector started first, which the runtime hook waits for: a hook still
running then is reported ``timeout``, later hooks are not started, the connections
manager cuts its reconnect deadlines to it, and the bridge then fails with the report's
line, inside Lambda's limit. With several engines every deadline counts from the same
notice, so engines run one after another all end within it.

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
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .. import _config
from .. import extensions as _extensions
from .._context import Report, SnapshotReport, describe_error
from .._contract import Probe, own_pass_started, refuse_another_engine
from .._threads import fresh_lock_after_fork
from . import Detector

if TYPE_CHECKING:
    from ..extensions import Engine

__all__ = ["SnapStartDetector", "SnapStartHookFailed"]

log = logging.getLogger("rehydrate")

LAMBDA_RESTORE_LIMIT = 10.0
"""Seconds Lambda allows the after-restore runtime hooks (then the restore fails)."""
DEFAULT_DEADLINE: float = _config.default("REHYDRATE_SNAPSTART_DEADLINE")
"""Seconds the after-restore run may take by default: under :data:`LAMBDA_RESTORE_LIMIT`
with room for the runtime's own work and for user runtime hooks registered after the
bridge."""

_lock = threading.Lock()
# start() in a forked child takes it (a parent thread holds it around calls into
# snapshot_restore_py).
fresh_lock_after_fork(sys.modules[__name__], "_lock")
_engines: list[Engine] = []
_snapshot_at: float | None = None
"""``time.monotonic()`` when the before-snapshot bridge ran (before the freeze)."""

_OTHER_INIT_TYPES = ("on-demand", "provisioned-concurrency")
"""Lambda's documented ``AWS_LAMBDA_INITIALIZATION_TYPE`` values besides ``snap-start``."""


class SnapStartHookFailed(RuntimeError):
    """Raised from a bridge function when a required hook failed or timed out: before the
    snapshot it makes SnapStart abort the snapshot (after the resume runs that undo the
    passes that ran), after a restore it makes Lambda discard the restored environment.
    The message is one line naming the hooks and their errors (before the snapshot: also
    the refusing engine and the resume runs' outcome)."""


def _hook_failures(failed: Sequence[Report]) -> str:
    """``name outcome (Type: message); …``: the required hooks that failed or timed out,
    with the same error texts the engine logged (hook names and exception messages, never
    environment values)."""
    parts = [f"{h.name} {h.outcome} ({describe_error(h.error)})" if h.error is not None
             else f"{h.name} {h.outcome}"
             for r in failed for h in r.hooks
             if h.required and h.outcome in ("failed", "timeout")]
    return "; ".join(parts) or "see the report"


def _failure_line(when: str, failed: Sequence[Report]) -> str:
    """``rehydrate <when> hooks failed: name outcome (Type: message); …`` on one line."""
    return f"rehydrate {when} hooks failed: {_hook_failures(failed)}"


def _engine_name(engine: Engine, number: int, count: int) -> str:
    """``engine 2 of 3``: its place in the bridge's list (the order the engines started
    the bridge), and which engine the process-wide one is."""
    default = " (the default engine)" if engine is _extensions._default else ""
    return f"engine {number} of {count}{default}"


def _carry_on(prepared: Sequence[tuple[Engine, float, SnapshotReport]],
              count: int) -> list[str]:
    """Resume runs for the engines whose before-snapshot passes ran when one refused: no
    snapshot is taken, so what their hooks closed is reopened (as the control socket does
    for a refused save) — in the bridge's order, as a restore after the snapshot would
    have run them. Whatever they report, every engine gets its run; returns the names and
    failures of the ones that are not ready after it (``count``: the bridge's engines;
    with one, only its failures)."""
    failed: list[str] = []
    for number, (engine, asked, report) in enumerate(prepared, 1):
        name = _engine_name(engine, number, count)
        # Nothing froze (the snapshot is not taken): not a restore anchor, frozen for 0 s,
        # and about exactly this pass (a carry-on, as the control socket's).
        undoes = own_pass_started(engine, report, asked)
        try:
            resume = engine.restore_detected("snapstart", kind="resume", anchor=False,
                                             frozen_for=0.0, undoes=undoes)
        except Exception as exc:  # the refusal must still reach SnapStart
            log.exception("SnapStart bridge: the resume run of %s failed", name)
            failures = describe_error(exc)
        else:
            if resume.ready:
                continue
            failures = _hook_failures([resume])
        failed.append(failures if count == 1 else f"{name} ({failures})")
    return failed


def _before_snapshot() -> None:
    global _snapshot_at  # one bridge per process
    with _lock:
        engines = list(_engines)
        _snapshot_at = time.monotonic()
    prepared: list[tuple[Engine, float, SnapshotReport]] = []
    for number, engine in enumerate(engines, 1):
        asked = time.monotonic()
        try:
            report = engine.snapshot_requested("snapstart")
        except Exception:
            # No pass of this engine ran (no thread for its deadline watch: the pids
            # limit), but the ones before it did: undo them before SnapStart hears it.
            _carry_on(prepared, len(engines))
            raise
        prepared.append((engine, asked, report))
        if not report.ok:
            # SnapStart takes no snapshot now (the runtime fails the init), so the engines
            # after this one are not asked to close anything, and the ones that did close
            # theirs, this one included, reopen it: nothing stays `snapshotting`.
            not_ready = _carry_on(prepared, len(engines))
            who = (f" in {_engine_name(engine, number, len(engines))}"
                   if len(engines) > 1 else "")
            if not not_ready:
                ran = ("the resume hooks ran" if len(engines) == 1 else
                       "the resume hooks ran in engine 1" if number == 1 else
                       f"the resume hooks ran in engines 1-{number}")
            else:
                where = "" if len(engines) == 1 else " in "
                ran = f"the resume hooks failed too{where}{'; '.join(not_ready)}: degraded"
            raise SnapStartHookFailed(
                f"rehydrate before-snapshot hooks failed{who}: {_hook_failures([report])}; "
                f"{ran}") from report.error


def _after_restore() -> None:
    global _snapshot_at  # one bridge per process
    with _lock:
        engines = list(_engines)
        since, _snapshot_at = _snapshot_at, None
    # One notice time for every engine: each one's restore deadline (set by start())
    # counts from it, so engines run one after another all end within the budget.
    noticed = time.monotonic()
    failed = []
    for engine in engines:
        # Every engine runs (and publishes its report) before the bridge fails.
        report = engine.restore_detected("snapstart", kind="restore", since=since,
                                         detected_at=noticed)
        if not report.ready:  # failures all recovered during the run: ready, no failure
            failed.append(report)
    if failed:
        raise SnapStartHookFailed(_failure_line("after-restore", failed)) \
            from failed[0].error


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

    def __init__(self, deadline: float | None = None) -> None:
        """``deadline``: seconds the whole after-restore run may take (default:
        ``REHYDRATE_SNAPSTART_DEADLINE``, read at :meth:`start`)."""
        self._engine: Engine | None = None
        self.deadline = (None if deadline is None
                         else _config.seconds(deadline, "SnapStartDetector deadline"))
        self._in_effect: float | None = None
        """The deadline :meth:`start` set on the engine (None while stopped)."""

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
            # Lambda's own values are named; anything else is an environment value that
            # is not rehydrate's to repeat (key names only).
            shown = repr(init_type) if init_type in _OTHER_INIT_TYPES else "another value"
            return f"off: AWS_LAMBDA_INITIALIZATION_TYPE is {shown}, not 'snap-start'"
        if os.environ.get("AWS_LAMBDA_FUNCTION_NAME"):
            return None
        return ("off outside AWS Lambda (no AWS_LAMBDA_FUNCTION_NAME); "
                'start(["snapstart"]) starts it')

    def describe(self) -> str:
        return ("registered with snapshot_restore_py (Lambda SnapStart runtime hooks); "
                f"restore deadline {self._in_effect or self._deadline():g}s")

    def _deadline(self) -> float:
        if self.deadline is not None:
            return self.deadline
        return _config.number("REHYDRATE_SNAPSTART_DEADLINE")

    def start(self, engine: Engine) -> None:
        # Before anything changes: started directly for a second engine, it took that
        # engine's deadline, bridged to both and let stop() release only the second.
        refuse_another_engine(self, self._engine, engine)
        module = importlib.import_module("snapshot_restore_py")
        deadline = self._deadline()
        if deadline >= LAMBDA_RESTORE_LIMIT:
            log.warning("SnapStart restore deadline %gs is not under Lambda's %gs limit: "
                        "Lambda may end a slow restore before rehydrate reports it",
                        deadline, LAMBDA_RESTORE_LIMIT)
        # On the engine, not only on the bridge's notices: another detector (a clock jump
        # seen as the VM resumes) may run this restore first, and the runtime hook then
        # waits for that run.
        engine.set_restore_deadline(self.key, deadline)
        self._in_effect = deadline
        with _lock:
            _ensure_registered(module)
            if not any(e is engine for e in _engines):
                _engines.append(engine)
        self._engine = engine
        log.debug("SnapStart bridge registered with snapshot_restore_py")

    def stop(self) -> None:
        engine, self._engine = self._engine, None
        self._in_effect = None
        if engine is None:
            return
        with _lock:
            # snapshot_restore_py has no unregister: the bridge stays registered and
            # does nothing for an engine that stopped.
            _engines[:] = [e for e in _engines if e is not engine]
        engine.set_restore_deadline(self.key, None)


SnapStartBridge = SnapStartDetector
"""Former name of :class:`SnapStartDetector` (named after its catalogue key now)."""
