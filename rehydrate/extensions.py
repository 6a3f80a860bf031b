"""The extension contract: how detectors, built-in managers and adapters plug into an engine.

An extension has a ``key``, a ``probe()`` saying whether it can work here (and why not),
and an ``install(engine)`` that attaches its hooks (in ``engine.builtins``, each with a
clear ``name=``), observers, listeners and status fields. The engine imports none of
them: :data:`DEFAULT_EXTENSIONS` names the default-on ones as dotted names, loaded when an
engine is created; ``Lifecycle(extensions=[...])`` takes another list.

Functions of a manager module take ``engine: Engine | None = None``;
:func:`resolve_engine` turns ``None`` into the process-wide default engine, created on
first use. See ``docs/architecture.md`` for the layers and the checklists.

What an extension needs besides: :data:`BEFORE_USER_HOOKS` (the order of a built-in hook
that must run before every user hook of its phase), :func:`in_hook` (is this call made by
a rehydrate hook?), :func:`loop_blocked` (is that event loop's thread waiting for an
event?), and the argument checks the built-in ones use, so that a bad argument is refused
the same way everywhere: :func:`check_seconds` (with :data:`MAX_SECONDS`) and
:func:`shown` (a caller's value in an error message); and :func:`fresh_lock_after_fork`
for its locks (a child of ``fork()`` gets new ones where a parent thread may hold them).
A manager that holds sensitive values registers a redactor with :func:`add_redactor`
(the secrets manager does): every hook error, and what :func:`redact` is given, loses
those values before it is logged, reported or served.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Final

from . import _config, _hooks
from ._config import MAX_SECONDS, shown
from ._contract import DEFAULT_EXTENSIONS, Engine, Extension, Probe, load_extension
from ._hooks import default_registry
from ._redact import add_redactor, redact
from ._threads import fresh_lock_after_fork

if TYPE_CHECKING:
    import asyncio

    from ._hooks import Hook
    from ._lifecycle import Lifecycle

__all__ = [
    "BEFORE_USER_HOOKS",
    "DEFAULT_EXTENSIONS",
    "MAX_SECONDS",
    "Engine",
    "Extension",
    "Probe",
    "add_redactor",
    "check_seconds",
    "default_engine",
    "default_registry",
    "fresh_lock_after_fork",
    "in_hook",
    "load_extension",
    "loop_blocked",
    "redact",
    "resolve_engine",
    "running_before",
    "shown",
]

BEFORE_USER_HOOKS: Final[int] = _hooks.BEFORE_USER_HOOKS
"""The ``order`` of a built-in hook that runs before every user hook of its phase, whatever
their ``order`` (``engine.builtins.register(fn, phase=..., order=BEFORE_USER_HOOKS)``): it
lies below the range user hooks may take, which only ``engine.builtins`` accepts. The
environment refresh runs there in the ENVIRONMENT phase; an extension whose hook must run
before even that one subtracts from it (down to ``-2_000_000_000``)."""

_default: Lifecycle | None = None
_lock = threading.Lock()
# A parent thread creating the default engine at fork() holds it: the child's first use
# of rehydrate waited for it for ever.
fresh_lock_after_fork(sys.modules[__name__])


def default_engine() -> Lifecycle:
    """The process-wide engine (on :data:`default_registry`), created on first use so that
    ``import rehydrate`` stays light. ``rehydrate.default_engine`` is that engine itself (an
    object, not this function); extend it with ``rehydrate.start(extensions=[...])`` or
    :meth:`~rehydrate.Lifecycle.install`."""
    global _default
    engine = _default
    if engine is None:
        with _lock:
            engine = _default
            if engine is None:
                from ._lifecycle import Lifecycle

                engine = _default = Lifecycle(default_registry)
    return engine


def resolve_engine(engine: Engine | None) -> Engine:
    """``engine``, or the default engine when it is ``None`` (every manager's ``engine=``).

    Anything else that is no engine is a one-line ``TypeError`` naming it: passed on, it
    failed later with an ``AttributeError`` from inside the extension (``'function'
    object has no attribute 'builtins'`` for :func:`default_engine` given uncalled)."""
    if engine is None:
        return default_engine()
    given: object = engine  # typed as an Engine, but a caller's value may be anything
    # What every extension reaches for first; a class has them only as methods, if at all.
    if isinstance(given, type) or not all(
            hasattr(given, name) for name in ("builtins", "registry", "extension")):
        hint = (" (rehydrate.extensions.default_engine is the function that returns it: "
                "call it, or pass rehydrate.default_engine)" if given is default_engine
                else "")
        raise TypeError(f"engine must be a rehydrate engine (a rehydrate.Lifecycle, e.g. "
                        f"rehydrate.default_engine) or None, not {shown(given)}{hint}")
    return engine


def check_seconds(value: object, what: str, *, zero_ok: bool = False) -> float:
    """``value`` as a float when it is a number of seconds: a real number (not a bool; a
    NumPy scalar or a ``Fraction`` too), ``> 0`` (with ``zero_ok``: ``>= 0``) and at most
    :data:`MAX_SECONDS`; otherwise a one-line ``TypeError`` (not a number) or
    ``ValueError`` (NaN, infinity, out of range) naming the argument ``what`` and the
    rule. The check the built-in extensions make of every timeout, deadline and interval
    argument — where it enters (a constructor), not later in a thread that an exception
    would end."""
    return _config.seconds(value, what, zero_ok=zero_ok)


def loop_blocked(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop``'s own thread is waiting for a lifecycle event to end — a
    ``simulate_restore()``, ``restore_detected()`` or ``trigger_snapshot()`` called on it,
    whose hooks run elsewhere meanwhile: work a hook submits to ``loop`` and waits for
    would only run after that event, so the hook fails at once instead of timing out."""
    from ._loop_roles import is_blocked

    return is_blocked(loop)


def in_hook() -> bool:
    """Whether this call comes from a rehydrate hook that is running now — a hook of any
    engine, in the thread or task that runs it, and in what it starts with its context
    (``asyncio`` tasks, ``contextvars.copy_context()``) until the hook returns: a task it
    leaves running (a worker started by a restore hook) is not the hook afterwards. A gate
    that refuses requests while the engine is not ready uses it to let the restore hook
    through that reloads what the gate guards."""
    from ._runner import hook_call

    call = hook_call.get()
    return call is not None and call.running


def running_before(hook: Hook) -> Hook | None:
    """The hook running in this context (its thread or task, and what it starts with its
    context until it returns) and on its own thread (an async hook's: its event loop's,
    every task there included) when ``hook`` comes later in that hook's run: the hooks of
    a run run one after another, so nothing ``hook`` does — a reload it makes — can
    happen before the running hook returns, and waiting for it from there only times out.
    None outside hooks, on another thread (one the hook started with its context, such as
    ``asyncio.to_thread``: blocking there holds the run up only if the hook waits for it),
    when ``hook`` is not in the running hook's run or has started, and in a hook its run
    gave up on at its timeout (the run went on without it). A secret read
    by a restore hook that runs before the secret's own reload fails at once with it."""
    from ._runner import running_before as before

    return before(hook)

