"""rehydrate._loops.run_quietly: what a close scheduled on a stopped event loop does
when that loop is closed unrun, or run one iteration only."""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import threading
import warnings
import weakref

import pytest

from rehydrate._loops import run_quietly


async def _close(ran: list[str]) -> str:
    ran.append("close")
    return "closed"


def test_on_unrun_is_called_once_when_the_loop_is_closed_unrun():
    """The owner of a close dropped unrun is told (once), so that it can say so: the
    coroutine was closed in silence and its connection said ``closing`` for good."""
    told: list[str] = []
    ran: list[str] = []
    loop = asyncio.new_event_loop()
    coro = _close(ran)
    fut = run_quietly(loop, coro, on_unrun=lambda: told.append(threading.current_thread().name))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.close()
        gc.collect()
    assert told == [threading.current_thread().name]
    assert [str(w.message) for w in caught] == []
    assert inspect.getcoroutinestate(coro) == "CORO_CLOSED" and ran == []
    assert not fut.done()


def test_on_unrun_is_not_called_when_the_close_ran_or_could_not_be_scheduled():
    told: list[str] = []
    ran: list[str] = []
    loop = asyncio.new_event_loop()
    try:
        fut = run_quietly(loop, _close(ran), on_unrun=lambda: told.append("ran"))
        assert loop.run_until_complete(asyncio.wrap_future(fut, loop=loop)) == "closed"
    finally:
        loop.close()
        gc.collect()
    with pytest.raises(RuntimeError):  # closed: the caller is told by the exception
        run_quietly(loop, _close(ran), on_unrun=lambda: told.append("closed"))
    gc.collect()
    assert told == [] and ran == ["close"]


def test_what_on_unrun_raises_is_swallowed():
    """It may run in a garbage collection or at the interpreter's shutdown: nothing it
    raises escapes (``loop.close()`` of the application went on)."""
    def boom() -> None:
        raise RuntimeError("owner gone")

    loop = asyncio.new_event_loop()
    run_quietly(loop, _close([]), on_unrun=boom)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.close()
        gc.collect()
    assert [str(w.message) for w in caught] == []


def _one_iteration_then_close(loop: asyncio.AbstractEventLoop,
                              caplog: pytest.LogCaptureFixture) -> list[str]:
    """``loop.call_soon(loop.stop); loop.run_forever()`` (one iteration, the idiom of GUI
    and framework integrations), then ``loop.close()``: what asyncio logged and Python
    warned meanwhile."""
    loop.call_soon(loop.stop)
    loop.run_forever()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(
            logging.ERROR, logger="asyncio"):
        warnings.simplefilter("always")
        loop.close()
        gc.collect()
    return [str(w.message) for w in caught] + [
        r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_a_close_started_then_destroyed_with_its_loop_is_freed(caplog):
    """A loop run until the close had started (one iteration creates its task; a close
    waiting on its socket is still under way after more), then closed: asyncio destroys
    the task as any pending one, the owner is not told (a close under way is the
    loop's), and nothing keeps the task or its coroutine alive — a finalizer telling
    the owner did: a suspended close refers to its task through what it awaits, and
    the owner's callback to the close."""
    told: list[str] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()

    async def slow() -> None:
        started.set()
        await loop.create_future()  # never done: the loop ends first

    def owner_told(close: object):  # type: ignore[no-untyped-def]
        return lambda: told.append(f"unrun {close!r}")  # holds the close, as owners do

    coro = slow()
    fut = run_quietly(loop, coro, on_unrun=owner_told(coro))
    alive = weakref.ref(coro)

    async def until_started() -> None:
        while not started.is_set():
            await asyncio.sleep(0)

    loop.run_until_complete(until_started())
    del coro
    with caplog.at_level(logging.CRITICAL, logger="asyncio"):  # asyncio's own line
        loop.close()
        gc.collect()
    assert told == [] and not fut.done()
    assert alive() is None


def test_a_close_that_ended_is_not_reported_unrun(caplog):
    """A close that ran to its end before the loop was closed tells nobody."""
    told: list[str] = []
    ran: list[str] = []
    loop = asyncio.new_event_loop()
    fut = run_quietly(loop, _close(ran), on_unrun=lambda: told.append("unrun"))
    assert loop.run_until_complete(asyncio.wrap_future(fut, loop=loop)) == "closed"
    assert _one_iteration_then_close(loop, caplog) == []
    assert told == [] and ran == ["close"]
