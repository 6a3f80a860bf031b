"""rehydrate's pytest plugin (the ``pytest11`` entry point): the fixtures documented in
:mod:`rehydrate.testing`. Kept apart so that ``rehydrate.testing`` imports without pytest."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._lifecycle import Lifecycle
from .testing import isolated_engine, restored_environ

__all__ = ["rehydrate_engine", "rehydrate_environ"]


@pytest.fixture
def rehydrate_environ() -> Iterator[None]:
    """``os.environ`` is put back as it was after the test."""
    with restored_environ():
        yield


@pytest.fixture
def rehydrate_engine(rehydrate_environ: None) -> Iterator[Lifecycle]:
    """A fresh engine with its own registry, closed after the test; ``os.environ`` restored."""
    engine = isolated_engine()
    try:
        yield engine
    finally:
        engine.close()
