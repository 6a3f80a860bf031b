"""What the connection helpers and :mod:`rehydrate.connections` share about event loops."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import weakref
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
                 close: Callable[[], Coroutine[Any, Any, None]] | None = None,
                 dropped: str | None = None) -> None:
        super().__init__(f"the event loop {what} is stopped")
        self.loop = loop
        self.close = close
        """What to schedule there instead of the same close: one that closes only what
        the helper took out of its pool before raising (nothing the application could
        get hold of since), where the same close would cut what is in use by then."""
        self.dropped = dropped
        """Why, when the helper also let go of connections it took out on another loop,
        closed since (what :class:`LoopClosed` would have said): said once, as for it."""


def run_quietly(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, _T], *,
                on_unrun: Callable[[], None] | None = None) -> concurrent.futures.Future[_T]:
    """``asyncio.run_coroutine_threadsafe(coro, loop)`` (from any thread), for a close of
    what belongs to ``loop`` while the application keeps that loop stopped between two
    ``run_until_complete`` calls — except that if ``loop`` is closed (or dropped)
    without ever starting it, ``coro`` is closed: Python reported it "coroutine ... was
    never awaited".

    The future is left pending in that case (nothing ran), and ``on_unrun`` is called,
    once, by whatever drops the callback: the thread closing the loop, a garbage
    collection in any thread, the interpreter's shutdown — it must not wait for a lock
    that thread may hold; what it raises is swallowed. ``RuntimeError`` (``coro``
    closed, ``on_unrun`` not called) when ``loop`` is already closed.

    Once started, the close is the loop's: a loop closed while it is under way (run for
    one iteration only, ``loop.call_soon(loop.stop); loop.run_forever()``, which
    creates the task without starting it) destroys it as asyncio does any pending task
    ("Task was destroyed but it is pending!"), and the garbage collector frees what it
    held. (Telling the owner from a finalizer of the task kept the task alive: a
    suspended close refers to its task through what it awaits.)"""
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
        if coro is not None:
            _destroyed(coro, told)

    def __del__(self) -> None:
        self.drop()

    def __call__(self) -> None:
        coro, self.coro = self.coro, None
        self.on_unrun = None  # started: a close under way is the loop's to finish
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

        # weakly: the owner keeps the future, and a task its loop destroyed must be freed
        ref = weakref.ref(task)

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
            t = ref()
            if f.cancelled() and t is not None and not t.done():
                with contextlib.suppress(RuntimeError):  # that loop is closed: it never runs
                    loop.call_soon_threadsafe(t.cancel)

        task.add_done_callback(ended)
        fut.add_done_callback(cancelled)


def _destroyed(coro: Coroutine[Any, Any, Any], told: Callable[[], None] | None) -> None:
    """``coro`` will never run (its loop dropped the callback that was to start it):
    closed (one never started was reported "never awaited"), and its owner told."""
    # from __del__ too: any thread, or the interpreter's shutdown — nothing escapes
    try:
        if inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED:
            return
    except BaseException:  # noqa: S110 - a coroutine of another kind: closed below
        pass
    with contextlib.suppress(BaseException):
        coro.close()
    if told is not None:
        with contextlib.suppress(BaseException):
            told()
