"""rehydrate._loops.run_quietly: what a close scheduled on a stopped event loop does
when that loop is closed unrun, or run one iteration only."""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import sys
import threading
import warnings

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


def test_a_loop_run_one_iteration_then_closed(caplog):
    """``loop.call_soon(loop.stop); loop.run_forever()`` (one iteration, the idiom of
    GUI and framework integrations), then ``loop.close()``: the callback created the
    task but its first step waited for the next iteration, so asyncio logged "Task was
    destroyed but it is pending!" and Python "never awaited". From 3.12 the task starts
    eagerly in the callback: the close has run. On 3.10 and 3.11 that remains the
    documented limit (docs/network.md)."""
    ran: list[str] = []
    loop = asyncio.new_event_loop()
    coro = _close(ran)
    fut = run_quietly(loop, coro)
    loop.call_soon(loop.stop)
    loop.run_forever()
    if sys.version_info >= (3, 12):
        assert ran == ["close"] and fut.result(0) == "closed"
        del coro
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(
                logging.ERROR, logger="asyncio"):
            warnings.simplefilter("always")
            loop.close()
            gc.collect()
        assert [str(w.message) for w in caught] == []
        assert not [r for r in caplog.records if "destroyed" in r.getMessage()]
    else:
        assert ran == [] and not fut.done()
        assert inspect.getcoroutinestate(coro) == "CORO_CREATED"
        # the application runs the loop again after all: the close runs then
        loop.run_until_complete(asyncio.wrap_future(fut, loop=loop))
        assert ran == ["close"]
        loop.close()
