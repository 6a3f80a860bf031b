"""Real servers on loopback for the connection tests and benchmarks (started here, never a
system service): uvicorn (HTTP) and Debian's redis-server, each a killable subprocess."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    """A restartable subprocess server on a fixed loopback port."""

    def __init__(self, argv: list[str], port: int) -> None:
        self.argv = argv
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        wait_port(self.port, proc=self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def uvicorn_server(port: int | None = None) -> Server:
    port = port or free_port()
    return Server([sys.executable, "-c", UVICORN_APP, str(port)], port)


def redis_binary() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)


def redis_server(port: int | None = None) -> Server:
    binary = redis_binary()
    assert binary is not None
    port = port or free_port()
    return Server([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no"],
                  port)
