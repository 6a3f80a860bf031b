"""Which engine an adapter attaches to (until ``rehydrate.extensions.resolve_engine``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rehydrate.extensions import default_engine

if TYPE_CHECKING:
    from rehydrate import Lifecycle


def resolve_engine(engine: Lifecycle | None) -> Lifecycle:
    """``engine``, or the process-wide default engine when it is ``None``."""
    return engine if engine is not None else default_engine()
