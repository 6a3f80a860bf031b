"""The extension contract's bottom layer: what the engine and its extensions agree on.

Private: users import these names from :mod:`rehydrate.extensions`. They live here, below
the engine, so that :mod:`rehydrate._lifecycle` can load extensions without importing the
module that also holds the default engine (which imports the lifecycle).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

from ._config import shown

if TYPE_CHECKING:
    import asyncio

    from ._context import Report, RestoreReport, SnapshotReport
    from ._hooks import Hook, Registry
    from .detect import Detector
    from .env import EnvRefresher

__all__ = ["DEFAULT_EXTENSIONS", "Engine", "Extension", "Probe", "load_extension"]

T = TypeVar("T")

DEFAULT_EXTENSIONS: tuple[str, ...] = (
    "rehydrate.env",
    "rehydrate.entropy",
    "rehydrate.telemetry",
    "rehydrate.fingerprint",
    "rehydrate.files",
)
"""The extensions every :class:`~rehydrate.Lifecycle` installs unless told otherwise:
dotted names (``"package.module"`` or ``"package.module:attribute"``), imported only when
an engine is created. Adding a default-on extension is one line here."""

NO_DEADLINE_THREAD = "no thread to watch the snapshot deadline"
"""How the ``RuntimeError`` of a before-snapshot pass refused for want of a thread (the
pids limit; no hook ran) begins: an expected refusal, which callers log in one line."""


@dataclass(frozen=True)
class Probe:
    """Whether an extension (or detector) can work here, and if not, why not."""

    usable: bool
    reason: str = ""


@runtime_checkable
class Extension(Protocol):
    """A detector, built-in manager or adapter that plugs into an engine.

    A module can be an extension itself (module-level ``key``, ``probe()`` and
    ``install(engine)``), as the built-in managers are.
    """

    @property
    def key(self) -> str:
        """Unique per engine; also the name of the per-engine singleton, if any (read-only:
        a class-level constant, as a detector's, or a module-level one, as a manager's)."""
        ...

    def probe(self) -> Probe:
        """Can this extension work here? ``reason`` says why not (or how it works)."""
        ...

    def install(self, engine: Engine) -> None:
        """Attach hooks (in ``engine.builtins``), observers, listeners and status fields."""
        ...


class Engine(Protocol):
    """What extensions use of the lifecycle engine (:class:`~rehydrate.Lifecycle`)."""

    registry: Registry
    """The user hooks."""
    builtins: Registry
    """Where extensions register their hooks (merged with the user hooks at run time)."""
    env: EnvRefresher

    @property
    def state(self) -> str: ...

    @property
    def generation(self) -> int: ...

    @property
    def snapshot_pending(self) -> bool: ...

    @property
    def last_restore_at(self) -> float | None: ...

    def extension(self, key: str, factory: Callable[[Any], T]) -> T:
        """The per-engine instance for ``key``, created by ``factory(engine)`` on first use
        (``Any``: a factory may be typed against :class:`~rehydrate.Lifecycle` itself)."""
        ...

    def add_observer(self, observer: Any) -> None: ...

    def remove_observer(self, observer: Any) -> None: ...

    def add_listener(self, fn: Callable[[Report], None]) -> None: ...

    def remove_listener(self, fn: Callable[[Report], None]) -> None: ...

    def add_status(self, key: str, fn: Callable[[], Any]) -> None:
        """Add the field ``key`` to ``status()``. ``ValueError`` for a field of the
        engine's own (``state``, ``generation``, ``ready``, ``detectors``,
        ``last_report``, ``detector_errors``, ``hung_hooks``) or one another extension
        added; the same owner (a bound method's or classmethod's class, else ``fn``'s
        module, a partial's function's) may add it again."""
        ...

    def recovered(self, hook: str | Hook, *, since: float | None = None) -> bool:
        """A required hook that failed in the last restore/resume run did its job since:
        ready again once none of that run's failures is left. An extension passes the
        :class:`~rehydrate.Hook` record its registration returned (a name may also be a
        user hook's); a record of :attr:`builtins` also takes over a failure of a built-in
        hook of its name that has been unregistered since (what it manages was closed and
        made again)."""
        ...

    def add_start_listener(self, fn: Callable[[Engine], None]) -> None: ...

    def set_restore_deadline(self, source: str, seconds: float | None) -> None:
        """Bound every restore/resume run to ``seconds`` from its notice (None: unset)."""
        ...

    def hook_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop async hooks run on: the application's under ``start(loop=...)``
        while it runs, else rehydrate's own. For work an extension schedules there
        without waiting for it (closing what belongs to that loop)."""
        ...

    def is_ready(self) -> bool: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def status(self, fields: Iterable[str] | None = None) -> Any:
        """The status; ``fields``: only these published fields (None: all)."""
        ...

    def restore_detected(
        self,
        reason: str,
        *,
        kind: Literal["restore", "resume"] = "restore",
        since: float | None = None,
        key: str | None = None,
        frozen_for: float | None = None,
        env: Mapping[str, str | None] | None = None,
        detected_at: float | None = None,
        anchor: bool = True,
        undoes: float | None = None,
        abort: Literal["announced", "answered"] | None = None,
        deadline: float | None = None,
        older_than: float | None = None,
        counted: Callable[[], None] | None = None,
    ) -> RestoreReport:
        """Run the restore (``kind="restore"``, a clone) or resume (the original after a
        checkpoint) hooks for an event a detector noticed; returns the run's report.

        One run per restore, however many detectors notice it: a later notice of the same
        restore runs nothing (its ``reason`` goes into the report's ``confirmed_by``, the
        notice gets a copy flagged ``deduplicated``). How the engine tells:

        * ``key``: a name for the event (a checkpoint counter, a message id): a key
          already handled is that event.
        * ``since``: the ``time.monotonic()`` at which the detector last saw the process
          running before the freeze (as late as it honestly knows). A restore detected
          after it — with no before-snapshot pass since — is this one. A notice that
          arrives as the process resumes may pass "arrival minus a short window" (the
          signal and marker-file detectors pass ``received - 2 s``).
        * neither given: the engine asks its freeze watch (``freeze_since()``, fed by
          the clock-jump detector): the notice is the last restore when nothing froze
          since that restore ran and it was detected less than 2 s before the notice
          (the watch cannot see a freeze whose guest clock was carried over). With no
          freeze watch running it never deduplicates by time.

        ``detected_at``: when the detector noticed (default now). ``counted``: called,
        under the engine's lock, once the notice counts for readiness (see
        :meth:`add_arrival_check`). The other arguments (``anchor``, ``undoes``, ``abort``,
        ``deadline``, ``older_than``, ``frozen_for``, ``env``) serve the built-in
        detectors; see ``Lifecycle.restore_detected``."""
        ...

    def add_arrival_check(self, check: Callable[[], bool]) -> None:
        """Readiness also asks ``check()`` (cheap, lock-free: it runs in every
        ``is_ready()``): True while a notice has arrived that the detector has not handed
        to :meth:`restore_detected` yet (a signal handler that only wakes a worker)."""
        ...

    def remove_arrival_check(self, check: Callable[[], bool]) -> None: ...

    def arrival_handed(self) -> None:
        """An arrival check turned False without a run: wake ``wait_ready()``."""
        ...

    def snapshot_requested(self, reason: str = "simulated", *,
                           key: str | None = None) -> SnapshotReport: ...

    def pass_started(self, report: SnapshotReport) -> float | None:
        """When the before-snapshot pass that produced ``report`` began (monotonic): the
        ``undoes=`` of a carry-on about exactly that pass."""
        ...

    def pass_ended(self, report: SnapshotReport) -> RestoreReport | None:
        """The restore or resume run that ended the pass ``report``, None while it is
        pending."""
        ...

    def await_answer(self, report: SnapshotReport) -> bool:
        """The resume hooks for the failed pass ``report`` are left to a checkpoint's
        answer still due: bound that wait by the snapshot deadline. False: run them now."""
        ...

    def simulate_restore(
        self,
        env: Mapping[str, str | None] | None = None,
        reason: str = "simulated",
        kind: Literal["restore", "resume"] = "restore",
        frozen_for: float | None = None,
    ) -> RestoreReport: ...

    def simulate_snapshot(self, reason: str = "simulated") -> SnapshotReport: ...

    def add_detector(self, detector: Detector) -> None:
        """Install a detector: started by every ``start()`` (also in a child of
        ``fork()``), listed by ``status()``, its key accepted by ``start([...])``,
        stopped by ``stop()``; taken off again when the ``install()`` that added it
        raises."""
        ...

    def detector(self, key: str) -> Detector | None: ...

    def specific_detectors(self, than: int) -> Sequence[Detector]: ...

    # The freeze watch (fed by the clock-jump detector; see Lifecycle.heartbeat).

    def heartbeat(self, now: float, limit: float, *, gap_since: float | None = None,
                  due: float | None = None) -> None: ...

    def freeze_noticed(self, since: float, now: float) -> None: ...

    def heartbeat_stopped(self) -> None: ...

    def freeze_since(self) -> float | None: ...

    def notice_since(self, at: float) -> float | None: ...


def refuse_another_engine(detector: object, running_on: Engine | None,
                          engine: Engine) -> None:
    """``RuntimeError`` when ``detector`` runs on an engine other than ``engine``.

    One instance serves one engine at a time (it reports to the engine its ``start()``
    got). The engines refuse a second one; a detector started directly
    (``det.start(engine)``, outside an engine) refuses it too, with this same line, rather
    than going on reporting to the first engine while the caller thinks it watches for
    the second."""
    if running_on is not None and running_on is not engine:
        raise RuntimeError(
            f"this {type(detector).__qualname__} instance already runs on another engine "
            "(it reports there): a detector instance serves one engine at a time; stop it "
            "there first, or give this engine its own instance")


def load_extension(spec: str | Extension) -> Extension:
    """The extension named by ``spec`` (``"pkg.module"`` or ``"pkg.module:attr"``), imported
    now; a class there (a detector's, an adapter's) is instantiated without arguments. An
    :class:`Extension` object is returned as it is."""
    if not isinstance(spec, str):
        if isinstance(spec, type):
            # A detector class passes the protocol check (class-level key and probe), then
            # failed in install() with "missing 1 required positional argument", or was
            # skipped quietly when its probe said no.
            raise TypeError(f"{spec.__qualname__} is a class, not an extension object: pass "
                            f"an instance ({spec.__qualname__}(...)) or its dotted name "
                            f"('{spec.__module__}:{spec.__qualname__}')")
        if not isinstance(spec, Extension):
            raise TypeError(f"{shown(spec)} ({type(spec).__name__}) is not an extension: give a "
                            "dotted name or an object with key, probe() and install(engine)")
        return spec
    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    if attr:
        obj = getattr(obj, attr)
        if isinstance(obj, type):
            obj = obj()
    if not isinstance(obj, Extension):
        raise TypeError(f"{spec} is not an extension (needs key, probe() and install(engine))")
    return obj


def own_pass_started(engine: Engine, snap: SnapshotReport, prepared: float) -> float:
    """When ``snap``'s before-snapshot pass began (:meth:`Engine.pass_started`), else
    ``prepared`` — a moment taken before asking for the pass, a lower bound: a carry-on
    must run even on an engine without ``pass_started`` or when the lookup fails."""
    try:
        return engine.pass_started(snap) or prepared
    except Exception:  # an older engine, a failed lookup: the bound will do
        return prepared


def own_pass_ended(engine: Engine, snap: SnapshotReport) -> RestoreReport | None:
    """The run that ended ``snap``'s before-snapshot pass (:meth:`Engine.pass_ended`),
    None while it is pending — and on an engine without ``pass_ended`` or when the
    lookup fails (the caller then waits as before)."""
    try:
        return engine.pass_ended(snap)
    except Exception:  # an older engine, a failed lookup: not known to have ended
        return None


def left_to_answer(engine: Engine, snap: SnapshotReport) -> bool:
    """Whether the resume hooks for the failed pass ``snap`` can be left to a checkpoint's
    answer still due (:meth:`Engine.await_answer`: bounded by the snapshot deadline).
    False — run them now — on an engine without ``await_answer`` or when it fails: a
    failed pass left to an answer with nothing to bound the wait could stay degraded for
    good."""
    try:
        return engine.await_answer(snap) is True
    except Exception:  # an older engine, a failed call: the carry-on runs now
        return False
