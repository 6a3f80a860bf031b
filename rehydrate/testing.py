"""Testing helpers and the pytest plugin (registered through the ``pytest11`` entry point).

Fixtures:

``rehydrate_engine``
    A fresh :class:`~rehydrate.Lifecycle` with its own :class:`~rehydrate.Registry`, so
    hooks registered in one test never leak into another. Register hooks with
    ``rehydrate_engine.registry.after_restore`` and drive them with
    ``rehydrate_engine.simulate_restore(env=...)`` / ``simulate_snapshot()``. The engine's
    environment refresh reads no file (only what ``simulate_restore(env=...)`` passes),
    and ``os.environ`` is restored after the test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .env import EnvRefresher
from .hooks import Registry
from .lifecycle import Lifecycle

__all__ = ["isolated_engine", "rehydrate_engine"]


def isolated_engine(**env_options: object) -> Lifecycle:
    """An engine with its own registry whose environment refresh reads no file."""
    return Lifecycle(Registry(), env=EnvRefresher(path=None, **env_options))  # type: ignore[arg-type]


@pytest.fixture
def rehydrate_engine() -> Iterator[Lifecycle]:
    saved = dict(os.environb)
    engine = isolated_engine()
    try:
        yield engine
    finally:
        engine.close()
        for k in [k for k in os.environb if k not in saved]:
            del os.environb[k]
        for k, v in saved.items():
            if os.environb.get(k) != v:
                os.environb[k] = v
