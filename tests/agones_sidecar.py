"""A stand-in for the Agones SDK sidecar's REST gateway (the real ``sdk-server`` ships only
as a release binary / image, not installable here).

It implements the endpoints the Agones docs give, exactly: ``POST /ready``, ``/health``,
``/allocate``, ``/shutdown`` (body ``{}``), ``POST /reserve {"seconds": "N"}``,
``GET /gameserver``, ``GET /watch/gameserver`` (newline-delimited ``{"result": {...}}``,
one line per change, the current state first), ``PUT /metadata/label`` and
``/metadata/annotation`` (``{"key", "value"}``, stored as ``agones.dev/sdk-<key>``). JSON is
snake_case and int64 fields are strings. Health: with ``period_seconds`` ×
``failure_threshold`` (after ``initial_delay_seconds``) without a ping the GameServer goes
``Unhealthy``, as the Agones controller would make it.

Faults, for the adapter's tests: ``down_for`` (not listening at first; ``None``: until
``up()``), ``fail_next(n)`` (answer 500, or ``status=``), ``delay`` (slow answers),
``hang`` (accept, never answer), ``refuse_keys`` (metadata keys answered with 400, as a
sidecar refusing them would).

Every request is recorded (``requests``, and as JSON lines in ``log_path`` when given) with
its wall-clock and monotonic time. Run it as a process (inside a gVisor sandbox too)::

    python tests/agones_sidecar.py --port 9358 --log /results/sidecar.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


@dataclass
class Request:
    method: str
    path: str
    body: Any
    wall: float
    mono: float
    status: int = 0
    answered: float = 0.0  # time.monotonic() once the answer was written


@dataclass
class Faults:
    fail: int = 0  # answer ``fail_status`` to this many requests
    fail_status: int = 500
    delay: float = 0.0  # seconds before every answer
    hang: bool = False  # accept, never answer
    paths: tuple[str, ...] = ()  # faults apply only to these paths (empty: all)
    answer: dict[str, Any] = field(default_factory=dict)  # path -> a 200 answer instead
    refuse_keys: set[str] = field(default_factory=set)  # metadata keys answered with 400


@dataclass
class GameServerState:
    name: str
    uid: str
    port: int
    state: str = "Scheduled"
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    resource_version: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    period_seconds: int = 5
    failure_threshold: int = 3
    initial_delay_seconds: int = 5

    def to_json(self) -> dict[str, Any]:
        return {
            "object_meta": {
                "name": self.name,
                "namespace": "default",
                "uid": self.uid,
                "resource_version": str(self.resource_version),
                "generation": "1",
                "creation_timestamp": str(self.created),
                "labels": dict(self.labels),
                "annotations": dict(self.annotations),
            },
            "spec": {
                "health": {
                    "disabled": False,
                    "period_seconds": self.period_seconds,
                    "failure_threshold": self.failure_threshold,
                    "initial_delay_seconds": self.initial_delay_seconds,
                },
            },
            "status": {
                "state": self.state,
                "address": "127.0.0.1",
                "ports": [{"name": "default", "port": self.port}],
            },
        }


class AgonesSidecar:
    """The stand-in: ``start()`` / ``stop()``, or a context manager."""

    def __init__(self, port: int = 0, *, name: str | None = None, game_port: int = 7654,
                 down_for: float | None = 0.0, log_path: str | None = None,
                 period_seconds: int = 5, failure_threshold: int = 3,
                 initial_delay_seconds: int = 5) -> None:
        self.port = port
        self.gs = GameServerState(
            name=name or f"gameserver-{uuid.uuid4().hex[:5]}", uid=str(uuid.uuid4()),
            port=game_port, period_seconds=period_seconds,
            failure_threshold=failure_threshold,
            initial_delay_seconds=initial_delay_seconds)
        self.down_for = down_for
        self.log_path = log_path
        self.faults = Faults()
        self.requests: list[Request] = []
        self.cond = threading.Condition()
        self._started_at = time.monotonic()
        self._last_health: float | None = None
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._up = threading.Event()
        self._log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> AgonesSidecar:
        if self.port == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
        self._started_at = time.monotonic()
        starter = threading.Thread(target=self._serve, daemon=True)
        starter.start()
        self._threads.append(starter)
        health = threading.Thread(target=self._health_checker, daemon=True)
        health.start()
        self._threads.append(health)
        return self

    def up(self) -> None:
        """Start listening now (a sidecar created with ``down_for=None``)."""
        self._up.set()

    def _serve(self) -> None:
        if self.down_for is None:
            self._up.wait()
        elif self.down_for and self._stopping.wait(self.down_for):
            return
        if self._stopping.is_set():
            return
        handler = type("Handler", (_Handler,), {"sidecar": self})
        server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        server.daemon_threads = True
        with self.cond:
            self._server = server
            self.cond.notify_all()
        server.serve_forever(poll_interval=0.05)

    def wait_listening(self, timeout: float = 10.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self._server is not None, timeout):
                raise TimeoutError("the stand-in sidecar never started listening")

    def stop(self) -> None:
        self._stopping.set()
        self._up.set()
        with self.cond:
            server = self._server
            self.cond.notify_all()
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> AgonesSidecar:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://localhost:{self.port}"

    # -- state -----------------------------------------------------------------------

    def set_state(self, state: str) -> None:
        with self.cond:
            self._change(lambda: setattr(self.gs, "state", state))

    def _change(self, fn: Any) -> None:
        """Apply ``fn`` (lock held) and wake the watch streams."""
        fn()
        self.gs.resource_version += 1
        self.cond.notify_all()

    def fail_next(self, n: int, *paths: str, status: int = 500) -> None:
        with self.cond:
            self.faults.fail = n
            self.faults.paths = paths
            self.faults.fail_status = status

    def record(self, req: Request) -> None:
        with self.cond:
            self.requests.append(req)
            self.cond.notify_all()
        if self._log is not None:
            with contextlib.suppress(ValueError):  # closed by stop()
                self._log.write(json.dumps({"method": req.method, "path": req.path,
                                            "body": req.body, "wall": req.wall,
                                            "mono": req.mono, "status": req.status,
                                            "answered": req.answered}) + "\n")

    def calls(self, method: str, path: str, since: float = 0.0) -> list[Request]:
        """Requests to ``method path`` that arrived at ``since`` (monotonic) or later.
        (A request is logged once answered, so count by arrival, not by log order.)"""
        with self.cond:
            return [r for r in self.requests
                    if r.method == method and r.path == path and r.mono >= since]

    def wait_for(self, method: str, path: str, count: int = 1, timeout: float = 10.0,
                 status: int = 200, since: float = 0.0) -> list[Request]:
        """Block until ``count`` answered requests to ``method path`` arrived (at
        ``since`` or later); they are returned in order of arrival."""
        def answered() -> list[Request]:
            return sorted((r for r in self.calls(method, path, since) if r.status == status),
                          key=lambda r: r.mono)
        with self.cond:
            if not self.cond.wait_for(lambda: len(answered()) >= count, timeout):
                got = [(r.method, r.path, r.status) for r in self.requests]
                raise TimeoutError(f"{count} x {method} {path} ({status}) not seen within "
                                   f"{timeout}s; got {got}")
            return answered()

    def _health_checker(self) -> None:
        """Unhealthy when pings lapse, like the Agones controller."""
        while not self._stopping.wait(0.1):
            now = time.monotonic()
            g = self.gs
            if now - self._started_at < g.initial_delay_seconds:
                continue
            last = self._last_health if self._last_health is not None else self._started_at
            if now - last > g.period_seconds * g.failure_threshold and \
                    g.state not in ("Unhealthy", "Shutdown"):
                with self.cond:
                    self._change(lambda: setattr(g, "state", "Unhealthy"))

    def _apply(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        g = self.gs
        posts = {"/ready": "Ready", "/allocate": "Allocated", "/shutdown": "Shutdown"}
        if method == "POST" and path in posts:
            with self.cond:
                self._change(lambda: setattr(g, "state", posts[path]))
            return 200, {}
        if method == "POST" and path == "/health":
            self._last_health = time.monotonic()
            return 200, {}
        if method == "POST" and path == "/reserve":
            seconds = body.get("seconds", "0") if isinstance(body, dict) else None
            if not isinstance(seconds, str) or not seconds.lstrip("-").isdigit():
                return 400, {"error": "seconds must be an int64 string"}
            with self.cond:
                self._change(lambda: setattr(g, "state", "Reserved"))
            return 200, {}
        if method == "GET" and path == "/gameserver":
            with self.cond:
                return 200, g.to_json()
        if method == "PUT" and path in ("/metadata/label", "/metadata/annotation"):
            if not (isinstance(body, dict) and isinstance(body.get("key"), str)
                    and isinstance(body.get("value"), str)):
                return 400, {"error": "body must be {\"key\": str, \"value\": str}"}
            key = body["key"]
            if key in self.faults.refuse_keys:
                return 400, {"error": f"refused key {key!r}"}
            if path.endswith("label") and not _LABEL_KEY.match(key):
                return 400, {"error": f"invalid label key {key!r}"}
            target = g.labels if path.endswith("label") else g.annotations
            with self.cond:
                self._change(lambda: target.__setitem__(f"agones.dev/sdk-{key}",
                                                        body["value"]))
            return 200, {}
        return 404, {"error": f"no {method} {path}"}


class _Handler(BaseHTTPRequestHandler):
    sidecar: AgonesSidecar
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _body(self) -> Any:
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return ValueError

    def _fault(self, path: str) -> int | None:
        """Apply the configured faults; the status to answer instead, if any."""
        sc = self.sidecar
        f = sc.faults
        if f.paths and path not in f.paths:
            return None
        if f.delay:
            time.sleep(f.delay)
        if f.hang:
            sc._stopping.wait()
            return -1
        with sc.cond:
            if f.fail > 0:
                f.fail -= 1
                return f.fail_status
        return None

    def _handle(self, method: str) -> None:
        sc = self.sidecar
        path = self.path.split("?", 1)[0]
        body = self._body() if method in ("POST", "PUT") else None
        req = Request(method, path, body, time.time(), time.monotonic())
        fault = self._fault(path)
        if fault == -1:
            self.close_connection = True
            return
        if fault is not None:
            status, payload = fault, {"error": "injected fault"}
        elif path in sc.faults.answer:
            status, payload = 200, sc.faults.answer[path]
        elif body is ValueError:
            status, payload = 400, {"error": "body is not JSON"}
        elif method == "GET" and path == "/watch/gameserver":
            req.status = 200
            sc.record(req)
            self._watch()
            return
        else:
            status, payload = sc._apply(method, path, body)
        req.status = status
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        req.answered = time.monotonic()
        sc.record(req)

    def _watch(self) -> None:
        sc = self.sidecar
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        seen = -1
        try:
            while not sc._stopping.is_set():
                with sc.cond:
                    sc.cond.wait_for(lambda: sc.gs.resource_version != seen
                                     or sc._stopping.is_set(), 0.5)
                    if sc._stopping.is_set():
                        break
                    if sc.gs.resource_version == seen:
                        continue
                    seen = sc.gs.resource_version
                    line = json.dumps({"result": sc.gs.to_json()}).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        self.close_connection = True

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=9358)
    parser.add_argument("--name", default=None)
    parser.add_argument("--game-port", type=int, default=7654)
    parser.add_argument("--log", default=None)
    args = parser.parse_args()
    sidecar = AgonesSidecar(args.port, name=args.name, game_port=args.game_port,
                            log_path=args.log).start()
    sidecar.wait_listening()
    threading.Event().wait()


if __name__ == "__main__":
    main()
