"""An ASGI application served by a real uvicorn on loopback, in a thread of the test process
(so the test drives the same engine the server's gate follows)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


@contextlib.contextmanager
def serve(app: Any, *, lifespan: str = "off", timeout: float = 15.0,
          **config: Any) -> Iterator[str]:
    """Run ``app`` under uvicorn on 127.0.0.1; yields the base URL; shuts down on exit.
    ``config``: more ``uvicorn.Config`` settings (``root_path``, ``ws``)."""
    # port 0: the server binds a free port itself (a port picked here and bound later
    # could be taken by a test running beside this one meanwhile); asked once it listens
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan=lifespan,
                            log_level="warning", access_log=False, **config)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited during startup")
        if time.monotonic() > deadline:
            raise TimeoutError(f"uvicorn not started after {timeout}s")
        time.sleep(0.01)
    try:
        (listener,) = [sock for srv in server.servers for sock in srv.sockets]
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)



class Switch:
    """An ASGI app that forwards to whichever :attr:`app` a test sets: one uvicorn serves
    a module's stand-ins one after another (each test starts from a fresh one)."""

    app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


@contextlib.contextmanager
def switchboard() -> Iterator[tuple[str, Switch]]:
    """:func:`serve` a :class:`Switch`; yields ``(url, switch)``."""
    switch = Switch()
    with serve(switch) as url:
        yield url, switch
