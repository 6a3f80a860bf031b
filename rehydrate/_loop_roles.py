"""What rehydrate knows about an event loop: whether it is rehydrate's own, and whether
its thread is waiting in a lifecycle event.

The engine marks the application's loop while a run started on that loop's thread blocks
it (the hooks then run on rehydrate's loop); the connection helpers ask before they send
work to a loop, which would only run after the event that waits for it, and tell
rehydrate's own loops from the application's.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ._threads import fresh_lock_after_fork

if TYPE_CHECKING:
    import asyncio

__all__ = ["blocking", "is_blocked", "is_private", "mark_private", "running_loop"]

_blocked_lock = threading.Lock()
# Every engine run from an event loop's thread takes it, in a forked child too.
fresh_lock_after_fork(sys.modules[__name__], "_blocked_lock")
_blocked: dict[int, int] = {}
"""``id()`` of each event loop whose own thread is waiting in a lifecycle event (the
hooks run on rehydrate's loop instead), and how many such waits are nested."""


@contextlib.contextmanager
def blocking(loop: asyncio.AbstractEventLoop | None) -> Iterator[None]:
    """While the body runs, ``loop`` counts as :func:`is_blocked` (None: no loop)."""
    if loop is None:
        yield
        return
    key = id(loop)  # the loop outlives the body: its id cannot be reused meanwhile
    with _blocked_lock:
        _blocked[key] = _blocked.get(key, 0) + 1
    try:
        yield
    finally:
        with _blocked_lock:
            if _blocked[key] == 1:
                del _blocked[key]
            else:
                _blocked[key] -= 1


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on the calling thread, if any (asyncio not imported: none)."""
    aio = sys.modules.get("asyncio")
    if aio is None:
        return None
    try:
        loop: asyncio.AbstractEventLoop = aio.get_running_loop()
    except RuntimeError:
        return None
    return loop


def is_blocked(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop``'s own thread is waiting for a lifecycle event to end: work
    submitted there and awaited from that event's hooks would only run after it."""
    with _blocked_lock:
        return id(loop) in _blocked


_private_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
"""The loops of every ``LoopThread`` (``rehydrate._runner``): no application's."""


def mark_private(loop: asyncio.AbstractEventLoop) -> None:
    """Record ``loop`` as rehydrate's own (called by the ``LoopThread`` that runs it)."""
    _private_loops.add(loop)


def is_private(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is rehydrate's own (a ``LoopThread``'s), which hooks run on when
    the engine was not given the application's loop (``start(loop=...)``)."""
    return loop in _private_loops
