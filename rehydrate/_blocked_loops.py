"""Which event loops have their own thread waiting in a lifecycle event.

The engine marks the application's loop while a run started on that loop's thread blocks
it (the hooks then run on rehydrate's loop); the connection helpers ask before they send
work to a loop, which would only run after the event that waits for it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ._threads import fresh_lock_after_fork

if TYPE_CHECKING:
    import asyncio

__all__ = ["blocking", "is_blocked"]

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


def is_blocked(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop``'s own thread is waiting for a lifecycle event to end: work
    submitted there and awaited from that event's hooks would only run after it."""
    with _blocked_lock:
        return id(loop) in _blocked
