"""rehydrate._loops.run_quietly: what a close scheduled on a stopped event loop does
when that loop is closed unrun, or run one iteration only."""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
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


def test_a_loop_run_one_iteration_then_closed(caplog):
    """One iteration runs the callback that creates the close's task, whose first step
    waits for the next iteration: closing the loop then destroyed the task pending —
    asyncio logged "Task was destroyed but it is pending!", Python "never awaited", and
    the owner was not told (the callback had run), so a connection closed by the engine
    before stayed ``closing`` for good. The owner is told as for a close dropped
    unrun, and nothing is logged."""
    told: list[str] = []
    ran: list[str] = []
    loop = asyncio.new_event_loop()
    coro = _close(ran)
    fut = run_quietly(loop, coro, on_unrun=lambda: told.append("unrun"))
    assert _one_iteration_then_close(loop, caplog) == []
    assert told == ["unrun"] and ran == [] and not fut.done()
    assert inspect.getcoroutinestate(coro) == "CORO_CLOSED"


def test_a_close_under_way_when_its_loop_is_closed(caplog):
    """The application ran the loop until the close had started and was waiting in it
    (as the helpers' closes do at once: a gather, an anyio ``aclose``), then closed it:
    the task was destroyed pending, in silence for its owner."""
    told: list[str] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()

    async def slow() -> None:
        started.set()
        await loop.create_future()  # never done: the loop ends first

    fut = run_quietly(loop, slow(), on_unrun=lambda: told.append("unrun"))

    async def until_started() -> None:
        while not started.is_set():
            await asyncio.sleep(0)

    loop.run_until_complete(until_started())
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(
            logging.ERROR, logger="asyncio"):
        warnings.simplefilter("always")
        loop.close()
        gc.collect()
    assert [str(w.message) for w in caught] == []
    assert not [r for r in caplog.records if r.name == "asyncio"]
    assert told == ["unrun"] and not fut.done()


def test_a_close_that_ended_is_not_reported_unrun(caplog):
    """A close that ran to its end before the loop was closed tells nobody."""
    told: list[str] = []
    ran: list[str] = []
    loop = asyncio.new_event_loop()
    fut = run_quietly(loop, _close(ran), on_unrun=lambda: told.append("unrun"))
    assert loop.run_until_complete(asyncio.wrap_future(fut, loop=loop)) == "closed"
    assert _one_iteration_then_close(loop, caplog) == []
    assert told == [] and ran == ["close"]
