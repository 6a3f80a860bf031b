"""What the connection helpers and :mod:`rehydrate.connections` share about event loops."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

__all__ = ["LoopClosed", "LoopStopped"]


class LoopClosed(RuntimeError):
    """Raised by a helper's ``async`` close (the pool of an ``httpx.AsyncClient``, of a
    ``redis.asyncio`` client) when connections it holds belong to an event loop that is
    closed: nothing can close them through that loop any more. The connection lets the
    value go with one warning naming it (see ``Connection._drop``) instead of failing."""


class LoopStopped(RuntimeError):
    """Raised by a helper's ``async`` close, before it closes anything, when the
    connections it holds belong to ``loop``, an event loop that is stopped but not closed
    (the application drives it with ``run_until_complete`` between two calls): nothing
    but that loop can close them. The connection schedules the same close there (see
    ``Connection._close_later``), to run when the application runs that loop again."""

    def __init__(self, loop: asyncio.AbstractEventLoop, what: str) -> None:
        super().__init__(f"the event loop {what} is stopped")
        self.loop = loop
