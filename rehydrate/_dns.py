"""Name lookups with a deadline.

``socket.getaddrinfo`` takes no timeout, and neither http.client's nor httpx's connect
timeout covers it: a resolver that does not answer holds its caller for as long as it
likes (the system resolver's own retries: tens of seconds, or for ever with a stuck NSS
module). :func:`resolve` looks a host name up on a daemon thread abandoned at the deadline
(it ends when the resolver gives up); an address literal needs no lookup and no thread.
Used where a command or hook must answer in bounded time: the GCE metadata request
(:mod:`rehydrate._nodefit`), ``doctor --connections``' peer names and ``tcp_socket``'s
connect (:mod:`rehydrate.connections`).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

__all__ = ["resolve"]


def resolve(host: str, port: int, deadline: float, *,
            thread_name: str = "rehydrate-dns",
            wake: threading.Event | None = None) -> list[tuple[Any, ...]]:
    """``getaddrinfo`` for a TCP connection to ``host``:``port``, ended by ``deadline`` (a
    ``time.monotonic()``): ``TimeoutError`` when the lookup has not answered by then, the
    lookup's own ``OSError`` when it failed. An address literal is converted even after
    the deadline (no lookup is asked).

    ``wake``: an event the caller sets to stop waiting before the deadline (its work was
    given up): ``InterruptedError`` then, the lookup left to end on its own. The lookup
    sets it as well when it ends, so give one event per call."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                  flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass  # a host name
    found: list[list[tuple[Any, ...]]] = []
    failed: list[OSError] = []
    answered = wake if wake is not None else threading.Event()

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            failed.append(exc)
        finally:
            answered.set()

    if answered.is_set():  # given up already: no thread for it
        raise InterruptedError("name lookup abandoned")
    left = deadline - time.monotonic()
    if left <= 0:  # no thread for a lookup that could not be waited for
        raise TimeoutError("name lookup timed out")
    resolver = threading.Thread(target=lookup, name=thread_name, daemon=True)
    resolver.start()
    woken = answered.wait(left)
    if failed:
        raise failed[0]
    if found:
        return found[0]
    # set but unanswered: the caller's wake (the lookup appends before it sets)
    raise InterruptedError("name lookup abandoned") if woken else TimeoutError(
        "name lookup timed out")
