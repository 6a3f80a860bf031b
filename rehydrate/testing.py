"""Testing helpers, and the fixtures of rehydrate's pytest plugin (``rehydrate._pytest_plugin``,
registered through the ``pytest11`` entry point).

This module does not import pytest: :func:`isolated_engine` and :func:`restored_environ`
work in any test framework, or none. pytest finds the fixtures through the plugin, in
every test of a project that has rehydrate installed: nothing to import.

Fixtures:

``rehydrate_engine``
    A fresh :class:`~rehydrate.Lifecycle` with its own :class:`~rehydrate.Registry`, so
    hooks registered in one test never leak into another. Register hooks with
    ``rehydrate_engine.registry.after_restore`` and drive them with
    ``rehydrate_engine.simulate_restore(env=...)`` / ``simulate_snapshot()``. The engine's
    environment refresh reads no file (only what ``simulate_restore(env=...)`` passes),
    and ``os.environ`` is restored after the test (it uses ``rehydrate_environ``).

``rehydrate_environ``
    Puts ``os.environ`` back as it was (byte-exact, through ``os.environb``) after the
    test: for tests that build their own engine, or apply an environment some other way.
    :func:`restored_environ` is the same as a context manager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Iterator

from ._contract import Extension
from ._hooks import Registry
from ._lifecycle import Lifecycle
from .env import EnvRefresher

__all__ = ["isolated_engine", "restored_environ"]


def isolated_engine(*, builtins: bool = True,
                    extensions: Iterable[str | Extension] | None = None,
                    snapshot_deadline: float | None = None,
                    **env_options: object) -> Lifecycle:
    """An engine with its own registry whose environment refresh reads no file, unless
    ``path=`` names one (the other options — ``policy``, ``protect`` … — are passed to
    :class:`~rehydrate.env.EnvRefresher` too). ``builtins``, ``extensions`` and
    ``snapshot_deadline`` are the engine's (:class:`~rehydrate.Lifecycle`): before, they
    went to the environment refresh too, which refused them by its own name."""
    known = [f.name for f in dataclasses.fields(EnvRefresher) if f.init]
    unknown = [k for k in env_options if k not in known]
    if unknown:
        raise TypeError(f"isolated_engine() got an unexpected keyword argument "
                        f"{unknown[0]!r} (engine options: builtins, extensions, "
                        f"snapshot_deadline; environment refresh: {', '.join(known)})")
    # setdefault: path=... was passed twice ("multiple values for keyword argument").
    env_options.setdefault("path", None)
    return Lifecycle(Registry(), env=EnvRefresher(**env_options),  # type: ignore[arg-type]
                     builtins=builtins, extensions=extensions,
                     snapshot_deadline=snapshot_deadline)


@contextlib.contextmanager
def restored_environ() -> Iterator[None]:
    """On exit, put ``os.environ`` back as it was on entry (keys added, changed, removed)."""
    saved = dict(os.environb)
    try:
        yield
    finally:
        for k in [k for k in os.environb if k not in saved]:
            del os.environb[k]
        for k, v in saved.items():
            if os.environb.get(k) != v:
                os.environb[k] = v

