"""What a hook is told (:class:`RestoreContext`) and what a run reports (:class:`Report`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from ._config import one_line, shown_names
from ._hooks import Phase, is_glob

if sys.version_info >= (3, 11):  # pragma: no cover - version dependent
    from builtins import ExceptionGroup as _ExceptionGroup
else:  # pragma: no cover
    from exceptiongroup import ExceptionGroup as _ExceptionGroup  # type: ignore[import-not-found,unused-ignore]

__all__ = [
    "EnvChanges",
    "HookFailed",
    "HookResult",
    "HookStillRunning",
    "HookTimeout",
    "Kind",
    "Outcome",
    "RedactedError",
    "Report",
    "RestoreContext",
    "RestoreReport",
    "SnapshotReport",
    "describe_error",
]

Kind = Literal["restore", "resume", "snapshot"]
Outcome = Literal["ok", "failed", "timeout", "skipped"]


@dataclass(frozen=True)
class EnvChanges:
    """Names (never values) of environment keys a refresh added, changed or removed."""

    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self.added) | frozenset(self.changed) | frozenset(self.removed)

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def only(self, keys: tuple[str, ...]) -> EnvChanges:
        """The subset that concerns ``keys`` (all of it when ``keys`` is empty): key
        names, or glob patterns (``DB_*``, case-sensitive, as ``protect=`` takes them)."""
        if not keys:
            return self
        exact = {k for k in keys if not is_glob(k)}
        patterns = tuple(k for k in keys if is_glob(k))

        def wanted(name: str) -> bool:
            if name in exact:
                return True
            if not patterns:
                return False
            import fnmatch  # only with a pattern: none at ``import rehydrate``

            return any(fnmatch.fnmatchcase(name, p) for p in patterns)

        return EnvChanges(
            added=tuple(k for k in self.added if wanted(k)),
            changed=tuple(k for k in self.changed if wanted(k)),
            removed=tuple(k for k in self.removed if wanted(k)),
        )

    def to_dict(self) -> dict[str, list[str]]:
        """Every name, whole (:meth:`shown` is what a report's ``to_dict`` carries)."""
        return {
            "added": list(self.added),
            "changed": list(self.changed),
            "removed": list(self.removed),
        }

    def shown(self) -> dict[str, list[str]]:
        """:meth:`to_dict` for a log line or a status: each list at most
        :data:`~rehydrate._config.NAMES_SHOWN` names, each cut to 60 characters, then
        ``"... (+N more)"`` (:func:`~rehydrate._config.shown_names`)."""
        return {
            "added": shown_names(self.added),
            "changed": shown_names(self.changed),
            "removed": shown_names(self.removed),
        }

    def __repr__(self) -> str:
        # shortened as shown(): a report's repr (in a status, a traceback) held every name
        s = self.shown()
        return (f"EnvChanges(added={tuple(s['added'])!r}, changed={tuple(s['changed'])!r}, "
                f"removed={tuple(s['removed'])!r})")


@dataclass
class RestoreContext:
    """Passed to hooks that take one argument. One instance per event, shared by its hooks."""

    generation: int
    """0 in the original process, +1 per restore (a resume keeps the generation)."""
    reason: str
    """Which detector fired: ``gvisor``, ``control``, ``clock-jump``, ``simulated`` …"""
    kind: Kind
    """``restore`` (a clone), ``resume`` (the original after a snapshot) or ``snapshot``."""
    env_changes: EnvChanges = field(default_factory=EnvChanges)
    frozen_for: float | None = None
    """Seconds spent frozen, when known; ``None`` when not. ``0.0``: nothing froze — a
    "carry on" resume after a snapshot that never happened (the before-snapshot hooks
    failed, the checkpoint was aborted before it began, the snapshot deadline passed)."""
    confirmed_by: tuple[str, ...] = ()
    """Reasons of later notices recognised as this same restore (they ran nothing)."""
    deduplicated: bool = False
    """True on the copy returned to a notice that was recognised as an earlier run (the
    hooks did not run again for it); the stored report keeps False."""
    detected_at: float = 0.0
    """``time.monotonic()`` when the detector noticed the event."""
    deadline: float | None = None
    """``time.monotonic()`` by which the whole run must be over (None: no such limit; set
    by ``restore_detected(deadline=…)``, e.g. by the SnapStart bridge). A hook still
    running then is reported ``timeout`` and later hooks are not started; a hook that
    waits for something (the connections manager) ends its wait by then."""
    env: Mapping[str, str | None] | None = field(default=None, repr=False)
    """The new environment handed to this event (by a simulator or a detector), if any.
    Kept out of ``repr()``: it holds values, which must never reach a log."""
    data: dict[str, Any] = field(default_factory=dict)
    """Scratch space hooks of one event may use to talk to each other."""

    def time_left(self) -> float | None:
        """Seconds until :attr:`deadline` (at least 0), or None when the run has none."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())


class HookTimeout(TimeoutError):
    """A hook ran past its timeout — or past the deadline of the whole run
    (:attr:`RestoreContext.deadline`), or was not started because that had passed.

    ``timeout``: the hook's own limit; ``run_deadline``: the run's limit in seconds when
    that is what stopped the hook (else None); ``started``: False when it never ran."""

    def __init__(self, name: str, timeout: float, *, run_deadline: float | None = None,
                 started: bool = True) -> None:
        if run_deadline is None:
            message = f"hook {name!r} timed out after {timeout:g}s"
        elif started:
            message = f"hook {name!r} ran past the run's {run_deadline:g}s deadline"
        else:
            message = f"hook {name!r} not started: the run's {run_deadline:g}s deadline had passed"
        super().__init__(message)
        self.hook_name = name
        self.timeout = timeout
        self.run_deadline = run_deadline
        self.started = started


class HookStillRunning(RuntimeError):
    """A sync hook was not started: its thread from an earlier timed-out run still runs it."""

    def __init__(self, name: str) -> None:
        super().__init__(f"hook {name!r} not started: it is still running in the thread "
                         "abandoned when it timed out earlier (Python threads cannot be "
                         "killed)")
        self.hook_name = name


class RedactedError(Exception):
    """A hook's error, in the report in place of the one it raised, when its text (or
    that of an error it was raised from or groups) quoted the value of a managed secret
    (a :class:`~rehydrate.secrets.Secret`, or what another extension registered with
    :func:`~rehydrate.extensions.add_redactor`), or a URL with user info or a query string
    (a password, an ``api_key=``): its message and notes with each such value replaced by
    ``[redacted secret 'name']`` and each such URL without them. Usually an instance of a
    subclass made for the type raised, ``Redacted<Name>(RedactedError, <type raised>)``, so that
    ``isinstance()``, ``except*`` and an ``OSError``'s ``errno`` still work; a plain
    ``RedactedError`` where the type cannot be stood for so.

    ``original_name`` and ``original_type`` name the type of the error raised (reports
    and log lines show ``original_name`` where they show an error's type). It keeps the
    original's type and redacted message (and notes) only: not its attributes or slots
    (requests' ``.response``, with the URL and its token), nor its traceback (its frames
    hold the hook's locals, the value among them, for as long as the report lives) —
    where it failed is kept as text (file, line and function of each frame), which
    telemetry shows as the span's ``exception.stacktrace``. Its cause, context and
    members stand redacted the same way."""

    def __init__(self, message: str, original: type[BaseException] | str = "Exception",
                 original_type: str | None = None) -> None:
        super().__init__(message)
        if isinstance(original, type):
            self.original_name = original.__name__
            self.original_type = f"{original.__module__}.{original.__qualname__}"
        else:
            self.original_name = original
            self.original_type = original_type or original

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.original_name, self.original_type),
                self.__dict__)


class HookFailed(_ExceptionGroup):  # type: ignore[type-arg,misc,unused-ignore]
    """All hook errors of one run, nested (an ``ExceptionGroup`` on 3.11+)."""

    def derive(self, excs: Any) -> HookFailed:
        return HookFailed(self.message, excs)


@dataclass(frozen=True, init=False)
class HookResult:
    """One hook's result in a report: its ``name`` and ``phase``, the ``outcome`` (``ok``,
    ``failed``, ``timeout`` or ``skipped``), ``duration`` in seconds, the ``error`` it raised
    (or ``None``), whether it was ``required`` and how many ``attempts`` it took."""

    name: str
    phase: Phase
    outcome: Outcome
    duration: float
    error: BaseException | None = None
    required: bool = True
    attempts: int = 1

    def __init__(self, name: str, phase: Phase, outcome: Outcome, duration: float,  # noqa: PLR0917
                 error: BaseException | None = None, required: bool = True,
                 attempts: int = 1) -> None:
        # One is made per hook per event: the generated frozen __init__ (a guarded
        # object.__setattr__ per field) cost more than the rest of the dispatch.
        d = self.__dict__
        d["name"] = name
        d["phase"] = phase
        d["outcome"] = outcome
        d["duration"] = duration
        d["error"] = error
        d["required"] = required
        d["attempts"] = attempts

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "phase": str(self.phase),
            "outcome": self.outcome,
            "duration": round(self.duration, 6),
            "error": describe_error(self.error),
            "required": self.required,
            "attempts": self.attempts,
        }


@overload
def describe_error(exc: BaseException) -> str: ...
@overload
def describe_error(exc: None) -> None: ...


def describe_error(exc: BaseException | None) -> str | None:
    """``"Type: message"`` on one line (whitespace runs collapsed, any other character
    that is not printable escaped as :func:`~rehydrate._config.one_line` does: a message
    with a terminal escape sequence cannot recolour or rewrite an operator's terminal),
    ``"Type"`` when the message is empty, None for None: how reports and log lines show
    an error. A :class:`RedactedError` shows the type of the error it stands for."""
    if exc is None:
        return None
    try:
        text = " ".join(str(exc).split())
    except Exception:  # an exception class whose __str__ fails must not break a report
        text = "<its message could not be formatted>"
    name = exc.original_name if isinstance(exc, RedactedError) else type(exc).__name__
    return one_line(f"{name}: {text}" if text else name)


@dataclass(frozen=True)
class Report:
    """The result of one lifecycle event. ``ok`` is false when a required hook failed."""

    ok: bool
    generation: int
    reason: str
    kind: Kind
    duration: float
    hooks: tuple[HookResult, ...]
    started_at: float
    """Wall-clock (``time.time()``) start of the run."""
    error: BaseException | None = None
    """One exception nesting every hook error (:class:`HookFailed`), or None."""
    env_changes: EnvChanges = field(default_factory=EnvChanges)
    frozen_for: float | None = None
    confirmed_by: tuple[str, ...] = ()
    """Reasons of later notices recognised as this same restore (they ran nothing)."""
    deduplicated: bool = False
    """True on the copy returned to a notice that was recognised as an earlier run (the
    hooks did not run again for it); the stored report keeps False."""
    notice_to_run: float | None = None
    """Seconds from the first notice (``ctx.detected_at``: when the detector saw the
    event) to the start of the run: the detector's and the engine's own handling first."""
    recovered: tuple[str, ...] = ()
    """Failed required hooks that reported recovery while the run went on
    (:meth:`~rehydrate.Lifecycle.recovered`); when they are all of them the run ended
    ready (:attr:`ready`) though ``ok`` is false."""

    @property
    def event(self) -> str:
        return "snapshot" if self.kind == "snapshot" else "restore"

    @property
    def ready(self) -> bool:
        """The run left the process ready: ``ok``, or every required hook that failed
        recovered while it went on (:attr:`recovered`)."""
        if self.ok:
            return True
        left = list(self.recovered)
        for h in self.hooks:
            if h.required and h.outcome in ("failed", "timeout"):
                if h.name not in left:
                    return False
                left.remove(h.name)
        return bool(self.recovered)

    @property
    def failed(self) -> tuple[HookResult, ...]:
        return tuple(h for h in self.hooks if h.outcome in ("failed", "timeout"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": self.event,
            "ok": self.ok,
            "generation": self.generation,
            "reason": self.reason,
            "kind": self.kind,
            "duration": round(self.duration, 6),
            "started_at": self.started_at,
            "frozen_for": self.frozen_for,
            "confirmed_by": list(self.confirmed_by),
            "deduplicated": self.deduplicated,
            "recovered": list(self.recovered),
            "notice_to_run": (None if self.notice_to_run is None
                                else round(self.notice_to_run, 6)),
            "env_changes": self.env_changes.shown(),
            "error": describe_error(self.error),
            "hooks": [h.to_dict() for h in self.hooks],
        }

    def table(self) -> str:
        """The report as a fixed-width text table (what ``make demo`` prints)."""
        rows = [("hook", "phase", "outcome", "ms", "error")]
        for h in self.hooks:
            rows.append(
                (h.name, str(h.phase), h.outcome, f"{h.duration * 1000:.2f}",
                 describe_error(h.error) or "")
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            f"{self.event} (kind={self.kind}, reason={self.reason}, "
            f"generation={self.generation}) ok={self.ok} in {self.duration * 1000:.2f} ms"
        ]
        for i, r in enumerate(rows):
            lines.append(
                "  ".join(c.ljust(widths[j]) for j, c in enumerate(r[:4])) + "  " + r[4]
            )
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  -----")
        return "\n".join(line.rstrip() for line in lines)


@dataclass(frozen=True)
class RestoreReport(Report):
    """Report of a restore (kind ``restore``) or resume (kind ``resume``) run."""


@dataclass(frozen=True)
class SnapshotReport(Report):
    """Report of the before-snapshot run."""


# Users import these from ``rehydrate``: reprs, tracebacks and the API reference say so.
for _public in (EnvChanges, HookFailed, HookResult, HookStillRunning, HookTimeout,
                RedactedError, Report, RestoreContext, RestoreReport, SnapshotReport):
    _public.__module__ = "rehydrate"
del _public
