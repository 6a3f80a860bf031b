"""The extension contract: how detectors, built-in managers and adapters plug into an engine.

An extension has a ``key``, a ``probe()`` saying whether it can work here (and why not),
and an ``install(engine)`` that attaches its hooks (in ``engine.builtins``, each with a
clear ``name=``), observers, listeners and status fields. The engine imports none of
them: :data:`DEFAULT_EXTENSIONS` names the default-on ones as dotted names, loaded when an
engine is created; ``Lifecycle(extensions=[...])`` takes another list.

Functions of a manager module take ``engine: Engine | None = None``;
:func:`resolve_engine` turns ``None`` into the process-wide default engine, created on
first use. See ``docs/architecture.md`` for the layers and the checklists.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from ._contract import DEFAULT_EXTENSIONS, Engine, Extension, Probe, load_extension
from ._hooks import default_registry

if TYPE_CHECKING:
    from ._lifecycle import Lifecycle

__all__ = [
    "DEFAULT_EXTENSIONS",
    "Engine",
    "Extension",
    "Probe",
    "default_engine",
    "default_registry",
    "load_extension",
    "resolve_engine",
]

_default: Lifecycle | None = None
_lock = threading.Lock()


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
    """``engine``, or the default engine when it is ``None`` (every manager's ``engine=``)."""
    return engine if engine is not None else default_engine()


def _new_lock_in_child() -> None:
    # A thread of the parent may hold the lock at fork() (it was creating the default
    # engine): that thread does not exist in the child, so the child's first use of
    # rehydrate waited for the lock for ever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)
