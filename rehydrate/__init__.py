"""rehydrate: make being restored from a memory snapshot a handled event.

Register hooks with the decorators, call :func:`start` once, and every restore (or
resume after a snapshot) runs them phase by phase before the process reports ready.
"""

from __future__ import annotations

from ._version import __version__
from .api import (
    after_restore,
    before_snapshot,
    default_engine,
    default_registry,
    is_ready,
    on_env_change,
    simulate_restore,
    simulate_snapshot,
    start,
    status,
    stop,
    trigger_snapshot,
    unregister,
    wait_ready,
)
from .context import (
    EnvChanges,
    HookFailed,
    HookResult,
    HookTimeout,
    Report,
    RestoreContext,
    RestoreReport,
    SnapshotReport,
)
from .hooks import Hook, Phase, Registry
from .lifecycle import Lifecycle, Status

__all__ = [
    "EnvChanges",
    "Hook",
    "HookFailed",
    "HookResult",
    "HookTimeout",
    "Lifecycle",
    "Phase",
    "Registry",
    "Report",
    "RestoreContext",
    "RestoreReport",
    "SnapshotReport",
    "Status",
    "__version__",
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
