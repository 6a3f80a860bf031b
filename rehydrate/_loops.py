"""What the connection helpers and :mod:`rehydrate.connections` share about event loops."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

__all__ = ["LoopClosed", "LoopStopped", "run_quietly"]

_T = TypeVar("_T")


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


def run_quietly(loop: asyncio.AbstractEventLoop,
                coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
    """``asyncio.run_coroutine_threadsafe(coro, loop)`` (from any thread), for a close of
    what belongs to ``loop`` while the application keeps that loop stopped between two
    ``run_until_complete`` calls — except that if ``loop`` is closed (or dropped)
    without ever running it, ``coro`` is closed: it never started, and Python reported
    it "coroutine ... was never awaited".

    The future is left pending in that case (nothing ran). ``RuntimeError`` (``coro``
    closed) when ``loop`` is already closed."""
    fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
    start = _Start(loop, coro, fut)
    try:
        loop.call_soon_threadsafe(start)
    except BaseException:
        start.drop()
        raise
    return fut


class _Start(Generic[_T]):
    """The callback :func:`run_quietly` queues: creates the task, and closes the coroutine
    if it is dropped unrun (the loop was closed: its ready queue is cleared)."""

    __slots__ = ("coro", "fut", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, _T],
                 fut: concurrent.futures.Future[_T]) -> None:
        self.loop = loop
        self.coro: Coroutine[Any, Any, _T] | None = coro
        self.fut = fut

    def drop(self) -> None:
        coro, self.coro = self.coro, None
        if coro is not None:
            coro.close()

    def __del__(self) -> None:
        self.drop()

    def __call__(self) -> None:
        coro, self.coro = self.coro, None
        if coro is None:
            return
        fut, loop = self.fut, self.loop
        if fut.cancelled():
            coro.close()
            return
        try:
            task = loop.create_task(coro)
        except BaseException as exc:
            coro.close()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)
            raise

        def ended(t: asyncio.Task[_T]) -> None:
            if t.cancelled():
                fut.cancel()
            if not fut.set_running_or_notify_cancel():
                return
            exc = t.exception()
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(t.result())

        def cancelled(f: concurrent.futures.Future[_T]) -> None:
            if f.cancelled() and not task.done():
                with contextlib.suppress(RuntimeError):  # that loop is closed: it never runs
                    loop.call_soon_threadsafe(task.cancel)

        task.add_done_callback(ended)
        fut.add_done_callback(cancelled)
