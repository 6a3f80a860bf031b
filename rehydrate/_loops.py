"""What the connection helpers and :mod:`rehydrate.connections` share about event loops."""

from __future__ import annotations

__all__ = ["LoopClosed"]


class LoopClosed(RuntimeError):
    """Raised by a helper's ``async`` close (the pool of an ``httpx.AsyncClient``, of a
    ``redis.asyncio`` client) when connections it holds belong to an event loop that is
    closed: nothing can close them through that loop any more. The connection lets the
    value go with one warning naming it (see ``Connection._drop``) instead of failing."""
