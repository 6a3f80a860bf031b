"""Which engine an adapter attaches to (until ``rehydrate.extensions.resolve_engine``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rehydrate import Lifecycle


def resolve_engine(engine: Lifecycle | None) -> Lifecycle:
    """``engine``, or the process-wide default engine when it is ``None``."""
    if engine is not None:
        return engine
    from rehydrate.api import default_engine

    return default_engine
