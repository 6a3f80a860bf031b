"""What the connection helpers and :mod:`rehydrate.connections` share about event loops."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
from collections.abc import Callable, Coroutine
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
    but that loop can close them. The connection schedules ``close`` there (the same
    close when None; see ``Connection._close_later``), to run when the application runs
    that loop again — after whatever the application runs first, so a helper takes
    what ``close`` closes out of its pool before raising."""

    def __init__(self, loop: asyncio.AbstractEventLoop, what: str,
                 close: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        super().__init__(f"the event loop {what} is stopped")
        self.loop = loop
        self.close = close
        """What to schedule there instead of the same close: one that closes only what
        the helper took out of its pool before raising (nothing the application could
        get hold of since), where the same close would cut what is in use by then."""


def run_quietly(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, _T], *,
                on_unrun: Callable[[], None] | None = None) -> concurrent.futures.Future[_T]:
    """``asyncio.run_coroutine_threadsafe(coro, loop)`` (from any thread), for a close of
    what belongs to ``loop`` while the application keeps that loop stopped between two
    ``run_until_complete`` calls — except that if ``loop`` is closed (or dropped)
    without ever running it, ``coro`` is closed: it never started, and Python reported
    it "coroutine ... was never awaited".

    The future is left pending in that case (nothing ran), and ``on_unrun`` is called,
    once, by whatever drops the callback: the thread closing the loop, a garbage
    collection in any thread, the interpreter's shutdown — it must not wait for a lock
    that thread may hold; what it raises is swallowed. ``RuntimeError`` (``coro``
    closed, ``on_unrun`` not called) when ``loop`` is already closed.

    On Python 3.12+ the coroutine's first step runs in the callback itself (an eager
    task): a loop run one iteration (``loop.call_soon(loop.stop); loop.run_forever()``)
    and then closed has run it. On 3.10 and 3.11 that first step is queued for the
    next iteration, so such a loop destroys the task unstarted: asyncio logs "Task was
    destroyed but it is pending!" and Python "coroutine ... was never awaited"."""
    fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
    start = _Start(loop, coro, fut, on_unrun)
    try:
        loop.call_soon_threadsafe(start)
    except BaseException:
        start.on_unrun = None  # the caller is told by the exception
        start.drop()
        raise
    return fut


class _Start(Generic[_T]):
    """The callback :func:`run_quietly` queues: creates the task, and closes the coroutine
    if it is dropped unrun (the loop was closed: its ready queue is cleared)."""

    __slots__ = ("coro", "fut", "loop", "on_unrun")

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, _T],
                 fut: concurrent.futures.Future[_T],
                 on_unrun: Callable[[], None] | None) -> None:
        self.loop = loop
        self.coro: Coroutine[Any, Any, _T] | None = coro
        self.fut = fut
        self.on_unrun = on_unrun

    def drop(self) -> None:
        coro, self.coro = self.coro, None
        told, self.on_unrun = self.on_unrun, None
        if coro is None:
            return
        # from __del__ too: any thread, or the interpreter's shutdown — nothing escapes
        with contextlib.suppress(BaseException):
            coro.close()
        if told is not None:
            with contextlib.suppress(BaseException):
                told()

    def __del__(self) -> None:
        self.drop()

    def __call__(self) -> None:
        coro, self.coro = self.coro, None
        self.on_unrun = None
        if coro is None:
            return
        fut, loop = self.fut, self.loop
        if fut.cancelled():
            coro.close()
            return
        try:
            task = _create_task(loop, coro)
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

        if task.done():
            # ended eagerly: a done callback would wait for the next iteration, which a
            # loop closed after this one never runs
            ended(task)
            return
        task.add_done_callback(ended)
        fut.add_done_callback(cancelled)


def _create_task(loop: asyncio.AbstractEventLoop,
                 coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
    """A task of ``coro`` on ``loop`` (running: called from its callback), started
    eagerly where asyncio can (3.12+, the loop's own task factory unset)."""
    if sys.version_info >= (3, 12) and loop.get_task_factory() is None:
        return asyncio.Task(coro, loop=loop, eager_start=True)
    return loop.create_task(coro)
