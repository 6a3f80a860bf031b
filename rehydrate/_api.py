"""The module-level API: one default registry and engine for the whole process."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Literal

from ._hooks import default_registry

if TYPE_CHECKING:
    import asyncio

    from ._context import RestoreReport, SnapshotReport
    from ._lifecycle import Lifecycle, Status
    from .detect import Detector
    from .extensions import Extension

__all__ = [
    "after_restore",
    "before_snapshot",
    "default_engine",
    "default_registry",
    "is_ready",
    "on_env_change",
    "simulate_restore",
    "simulate_snapshot",
    "start",
    "status",
    "stop",
    "trigger_snapshot",
    "unregister",
    "wait_ready",
]

if TYPE_CHECKING:
    default_engine: Lifecycle
    """The process-wide engine that the module-level functions drive, an object (created on
    first use). Not to be confused with ``rehydrate.extensions.default_engine``, the
    function that returns it."""

def _engine() -> Lifecycle:
    # Imported on first use: the extension contract loads dataclasses and typing machinery
    # that ``import rehydrate`` does without.
    from .extensions import default_engine

    return default_engine()


def __getattr__(name: str) -> object:
    if name == "default_engine":
        return _engine()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


after_restore = default_registry.after_restore
"""Register a restore/resume hook in the default registry: ``@after_restore`` or
``@after_restore(phase=..., order=..., timeout=..., required=..., name=..., retries=...)``
(:meth:`Registry.after_restore`)."""
before_snapshot = default_registry.before_snapshot
"""Register a before-snapshot hook in the default registry, with the same options
(:meth:`Registry.before_snapshot`)."""
on_env_change = default_registry.on_env_change
"""Register a hook for changed environment keys: ``@on_env_change("API_KEY", ...)``, no
names for any change; the hook may take ``(ctx, changes)`` (:meth:`Registry.on_env_change`)."""
unregister = default_registry.unregister
"""Remove hooks from the default registry by record, function or name; returns how many
(:meth:`Registry.unregister`)."""


def start(
    detectors: str | Iterable[str | Detector] = "auto",
    *,
    loop: asyncio.AbstractEventLoop | None = None,
    extensions: Iterable[str | Extension] = (),
) -> list[str]:
    """Start background detection. Returns the running detectors' names.

    Idempotent with ``"auto"`` (the default) or ``"none"``; a later call that lists
    detectors checks them as the first does and starts those not running yet
    (:meth:`Lifecycle.start`); a key string or instance listed twice starts once.
    ``extensions`` are installed in the process-wide engine first
    (:meth:`Lifecycle.install`: probed, a key installed already raises)."""
    return _engine().start(detectors, loop=loop, extensions=extensions)


def stop() -> None:
    """Stop background detection. Hooks stay registered."""
    _engine().stop()


def status() -> Status:
    """State, generation, readiness, running detectors and the last report."""
    return _engine().status()


def is_ready() -> bool:
    """True while the process may take work: never between a restore and its hooks' end."""
    return _engine().is_ready()


def wait_ready(timeout: float | None = None) -> bool:
    """Block until ready; False when ``timeout`` seconds passed first."""
    return _engine().wait_ready(timeout)


def simulate_restore(
    env: Mapping[str, str | None] | None = None,
    reason: str = "simulated",
    kind: Literal["restore", "resume"] = "restore",
    frozen_for: float | None = None,
) -> RestoreReport:
    """Run the restore hooks now, as after a real restore, and return the report.

    The arguments are checked before any hook runs (``TypeError`` / ``ValueError``)."""
    return _engine().simulate_restore(env=env, reason=reason, kind=kind,
                                      frozen_for=frozen_for)


def simulate_snapshot(reason: str = "simulated") -> SnapshotReport:
    """Run the before-snapshot hooks now and return the report (``reason`` is recorded in
    it and in the context the hooks get)."""
    return _engine().simulate_snapshot(reason)


def trigger_snapshot(timeout: float | None = None) -> Literal["resume", "restore", "error"]:
    """gVisor: run the before-snapshot hooks, checkpoint this sandbox, run the restore or
    resume hooks; returns ``"restore"`` in a clone, ``"resume"`` in the original, ``"error"``
    when the checkpoint failed. Needs the annotation
    ``dev.gvisor.internal.checkpoint.enable=true``.

    Raises :class:`~rehydrate.detect.gvisor.GVisorError` when ``/proc/gvisor/checkpoint``
    is missing (not gVisor) or answers garbage, its subclass ``TriggerNotPermitted`` on
    ``EPERM`` (the annotation is missing), and ``TimeoutError`` when no answer came within
    ``timeout`` seconds or before the snapshot deadline ran the resume hooks (the only
    bound when no ``timeout`` is given). A failure after the before-snapshot hooks ran
    runs the resume hooks before raising, so the process is not left ``snapshotting``
    (except when the gVisor waiter is running and ``1`` was written: its descriptor gets
    the late answer)."""
    from ._trigger import trigger_snapshot as trigger

    return trigger(_engine(), timeout=timeout)


# Users call these as ``rehydrate.start()`` & co.: reprs and the API reference say so.
for _public in (start, stop, status, is_ready, wait_ready, simulate_restore, simulate_snapshot,
                trigger_snapshot):
    _public.__module__ = "rehydrate"
del _public
