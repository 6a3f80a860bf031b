"""rehydrate: make being restored from a memory snapshot a handled event.

Register hooks with the decorators, call :func:`start` once, and every restore (or
resume after a snapshot) runs them phase by phase before the process reports ready.
"""

# No ``from __future__ import annotations``: it would leave a name ``annotations`` in
# ``dir(rehydrate)``; the annotations here need no postponing.
from ._version import __version__

TYPE_CHECKING = False
if TYPE_CHECKING:
    # the lazily loaded submodules, as attributes (``rehydrate.keys``) for type checkers
    from . import connections as connections
    from . import entropy as entropy
    from . import files as files
    from . import fingerprint as fingerprint
    from . import keys as keys
    from . import routes as routes
    from . import secrets as secrets
    from . import telemetry as telemetry
    from . import tls as tls
    from ._api import (
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
    from ._context import (
        EnvChanges,
        HookFailed,
        HookResult,
        HookStillRunning,
        HookTimeout,
        RedactedError,
        Report,
        RestoreContext,
        RestoreReport,
        SnapshotReport,
    )
    from ._hooks import Hook, Phase, Registry
    from ._lifecycle import Lifecycle, Status
    from ._notify import ControlError, UntrustedSocket, request

__all__ = [
    "ControlError",
    "EnvChanges",
    "Hook",
    "HookFailed",
    "HookResult",
    "HookStillRunning",
    "HookTimeout",
    "Lifecycle",
    "Phase",
    "RedactedError",
    "Registry",
    "Report",
    "RestoreContext",
    "RestoreReport",
    "SnapshotReport",
    "Status",
    "UntrustedSocket",
    "__version__",
    "after_restore",
    "before_snapshot",
    "default_engine",
    "default_registry",
    "instance_id",
    "is_ready",
    "on_env_change",
    "request",
    "simulate_restore",
    "simulate_snapshot",
    "start",
    "status",
    "stop",
    "trigger_snapshot",
    "unregister",
    "wait_ready",
]

# Identity managers load on first use so that ``import rehydrate`` stays light
# (``rehydrate.keys`` / ``tls`` import cryptography only when a key or certificate is made).
_LAZY_SUBMODULES = ("connections", "entropy", "files", "fingerprint", "keys", "routes",
                    "secrets", "telemetry", "tls")


def instance_id() -> str:
    """This process's instance ID (UUIDv4), regenerated on every restore.

    Process-wide: any engine's restore run (an isolated test engine's too) renews it."""
    from .entropy import instance_id as _instance_id

    return _instance_id()


# Every API name loads on first use (PEP 562): ``import rehydrate`` runs this file and
# ``_version`` only. ``rehydrate notify`` imports the package inside a sandbox at every
# checkpoint and restore, where the registry, the engine and their imports (threading,
# logging, typing …) cost tens of milliseconds; an application pays for them when it
# registers its first hook.
_LAZY_NAMES = {
    **dict.fromkeys(("after_restore", "before_snapshot", "default_engine", "default_registry",
                     "is_ready", "on_env_change", "simulate_restore", "simulate_snapshot",
                     "start", "status", "stop", "trigger_snapshot", "unregister",
                     "wait_ready"), "_api"),
    **dict.fromkeys(("Hook", "Phase", "Registry"), "_hooks"),
    **dict.fromkeys(("Lifecycle", "Status"), "_lifecycle"),
    # the control socket's client (docs/control-socket.md); light: no engine behind it
    **dict.fromkeys(("ControlError", "UntrustedSocket", "request"), "_notify"),
    **dict.fromkeys(("EnvChanges", "HookFailed", "HookResult", "HookStillRunning",
                     "HookTimeout", "RedactedError", "Report", "RestoreContext", "RestoreReport",
                     "SnapshotReport"), "_context"),
}


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY_SUBMODULES))


if not TYPE_CHECKING:  # a type checker sees the imports above: rehydrate.wait_redy is an error

    def __getattr__(name: str) -> object:
        module = _LAZY_NAMES.get(name)
        if module is not None:
            import importlib

            value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
            globals()[name] = value
            return value
        if name in _LAZY_SUBMODULES:
            import importlib

            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


del TYPE_CHECKING  # not an API name: dir(rehydrate) lists the API and the submodules
