"""Real servers on loopback for the connection tests and benchmarks (started here, never a
system service): uvicorn (HTTP) and Debian's redis-server, each a killable subprocess."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

UVICORN_APP = r'''
import sys, uvicorn

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif m["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    # /needs-header answers 503 unless the request carries "x-probe: yes" (tests that a
    # client's default headers reach the server)
    status = 200
    if scope["path"] == "/needs-header" and (b"x-probe", b"yes") not in scope["headers"]:
        status = 503
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": scope["path"].encode()})

# keep idle keep-alive connections open for a minute (uvicorn's default is 5 s): tests
# assert a reconnected client's pooled connection is still established seconds later
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            access_log=False, timeout_keep_alive=60)
'''


def free_port() -> int:
    """A loopback port free a moment ago. Racy: another test may bind it before the caller
    does — for a port a server must listen on, start it through :class:`Server` (which
    picks again when the bind fails) or let the server bind port 0 and ask it; for a port
    nothing may listen on, use :func:`refused_port`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port where every connect is refused while the block runs: a socket is
    bound to it and does not listen (Linux answers the SYN with a reset), so no other test
    can take the port meanwhile — a port from :func:`free_port` could be listened on by
    the time the test connects, and "refused" became "connected"."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield int(holder.getsockname()[1])


def _listening_inodes(port: int) -> set[int]:
    """The socket inodes listening on TCP ``port`` (any address, IPv4 or IPv6: gRPC
    servers bind ``[::]``)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]  # after the header
        except FileNotFoundError:  # no IPv6
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                found.add(int(fields[9]))
    return found


def listens(pid: int, port: int) -> bool:
    """True when the process ``pid`` itself listens on ``port`` — not merely "something
    answers there", which another test's server on the same port would."""
    from rehydrate.connections import _socket_inodes  # the same /proc/PID/fd scan

    return bool(_listening_inodes(port) & _socket_inodes(str(pid)))


class PortTaken(RuntimeError):
    """The server exited before it listened: the port was taken (or it failed)."""


def wait_listening(port: int, proc: subprocess.Popen[Any], timeout: float = 15.0) -> None:
    """Wait until ``proc`` listens on ``port``; :class:`PortTaken` when it exits first."""
    deadline = time.monotonic() + timeout
    while not listens(proc.pid, port):
        if proc.poll() is not None:
            raise PortTaken(f"server for port {port} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not listen on 127.0.0.1:{port} after "
                               f"{timeout}s")
        time.sleep(0.02)


PICK_ATTEMPTS = 5
"""How many ports :class:`Server` tries before giving up: a collision needs another test
to bind the same port between the pick and the bind, so a second one almost never does."""


def start_listening(argv: Callable[[int], list[str]], port: int | None = None, *,
                    timeout: float = 15.0, **popen: Any) -> tuple[subprocess.Popen[Any], int]:
    """Start ``argv(port)`` and wait until that process listens on the port: ``(process,
    port)``. Without a ``port`` one is picked, and picked again when the process exits
    before it listens (another process bound the port between the pick and the
    server's bind). A given port is kept: :class:`PortTaken` when the server cannot
    have it."""
    for attempt in range(1 if port else PICK_ATTEMPTS):
        chosen = port or free_port()
        proc = subprocess.Popen(argv(chosen), **popen)
        try:
            wait_listening(chosen, proc, timeout)
        except PortTaken:
            if port or attempt == PICK_ATTEMPTS - 1:
                raise
            continue
        except BaseException:
            proc.kill()
            proc.wait(10)
            raise
        return proc, chosen
    raise AssertionError("not reached")


def wait_port(port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None
              ) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")
            time.sleep(0.02)


class Server:
    """A restartable subprocess server on a loopback port.

    ``argv(port)`` is its command line. Without a ``port`` the first :meth:`start` picks
    one, and picks again when the server exits before it listens (another test bound the
    port between the pick and the server's bind); the port then stays the server's for
    every restart, where the clients already connect.
    """

    def __init__(self, argv: Callable[[int], list[str]], port: int | None = None) -> None:
        self.argv = argv
        self.port = port or 0
        self._fixed = port is not None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc, self.port = start_listening(
            self.argv, self.port if self._fixed else None, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self._fixed = True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def uvicorn_server(port: int | None = None) -> Server:
    return Server(lambda p: [sys.executable, "-c", UVICORN_APP, str(p)], port)


def redis_binary() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)


def redis_server(port: int | None = None) -> Server:
    binary = redis_binary()
    assert binary is not None
    return Server(lambda p: [binary, "--port", str(p), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--daemonize", "no",
                             "--protected-mode", "no"], port)
