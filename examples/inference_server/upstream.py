"""The example server's upstream dependency: a tiny quota service on loopback.

Every ``/v1/embed`` request of the inference server asks this service whether the caller
still has quota (``POST /v1/quota`` with ``Authorization: Bearer $UPSTREAM_TOKEN``). It
stands in for any internal HTTP dependency a real inference deployment has (quota,
billing, feature flags, a vector store): an *outbound* connection that a snapshot ends
and that must be reopened before the server may say it is ready.

``GET /healthz`` answers 200, or 503 while in maintenance; ``POST /admin/maintenance``
with ``{"on": true|false}`` switches maintenance (what an operator — or the example's
runsc test — does to hold a restored clone in "not ready").

With ``UPSTREAM_TIMINGS=FILE`` in its environment it appends one JSON line per request
to ``FILE`` (path, status, seconds the connection waited for a worker, seconds spent on
the request, wall time at the end): ``make bench-restore`` reads them to show how much
of a clone's health check was this service — restored together with the server inside
the sandbox — answering, a cost a real upstream outside the sandbox does not have.

Standard library only (it starts in a fraction of a second, also under gVisor)::

    UPSTREAM_TOKEN=... python examples/inference_server/upstream.py --port 8001
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

DEFAULT_PORT = 8001
TIMINGS = os.environ.get("UPSTREAM_TIMINGS")
MAX_BODY = 64 * 1024  # a quota request is a few dozen bytes


class QuotaState:
    """Requests counted per calling instance; the maintenance switch."""

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.maintenance = False
        self.used: dict[str, int] = {}
        self.lock = threading.Lock()

    def charge(self, instance: str, items: int) -> int:
        with self.lock:
            self.used[instance] = self.used.get(instance, 0) + items
            return self.used[instance]


def make_handler(state: QuotaState) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to ``state``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the server's pool reuses connections
        # Headers and body go out in two writes: with Nagle on, the body waits for the
        # client's delayed ACK (~40 ms per response on loopback).
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request would drown the example's output

        def parse_request(self) -> bool:
            self._began = time.perf_counter()  # the request line has been read
            return super().parse_request()

        def _reply(self, code: int, body: dict[str, Any]) -> None:
            payload = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            if TIMINGS:
                _record_timing(TIMINGS, self.server, self.path, code,
                               time.perf_counter() - self._began)

        def _body(self) -> dict[str, Any] | None:
            """The JSON body, or None once a 400/413 went out for its Content-Length:
            ``-1`` made ``rfile.read(-1)`` wait for the client to close, holding one of
            the few workers; ``abc`` raised and dropped the connection."""
            raw = (self.headers.get("content-length") or "0").strip()
            if not raw.isascii() or not raw.isdigit():
                self.close_connection = True  # where the body ends is unknown
                self._reply(400, {"error": "Content-Length must be a non-negative integer"})
                return None
            length = int(raw)
            if length > MAX_BODY:
                self.close_connection = True
                self._reply(413, {"error": f"body larger than {MAX_BODY} bytes"})
                return None
            try:
                data = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return {}
            return data if isinstance(data, dict) else {}

        def do_GET(self) -> None:
            if self.path == "/healthz":
                if state.maintenance:
                    self._reply(503, {"ok": False, "reason": "maintenance"})
                else:
                    self._reply(200, {"ok": True})
                return
            self._reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = self._body()
            if body is None:
                return
            if self.path == "/admin/maintenance":
                state.maintenance = bool(body.get("on"))
                self._reply(200, {"maintenance": state.maintenance})
                return
            if self.path != "/v1/quota":
                self._reply(404, {"error": "not found"})
                return
            if state.maintenance:
                self._reply(503, {"error": "maintenance"})
                return
            auth = self.headers.get("authorization", "").encode()
            if not hmac.compare_digest(auth, b"Bearer " + state.token):
                self._reply(401, {"error": "bad upstream token"})
                return
            items = body.get("items")
            instance = body.get("instance")
            if not isinstance(items, int) or items < 1 or not isinstance(instance, str):
                self._reply(400, {"error": "need items (int >= 1) and instance (str)"})
                return
            self._reply(200, {"allowed": True, "used": state.charge(instance, items)})

    return Handler


def _record_timing(out_path: str, server: Any, path: str, status: int,
                   handled: float) -> None:
    local = getattr(server, "local", None)
    queued = getattr(local, "queued", 0.0)
    if local is not None:
        local.queued = 0.0  # only the connection's first request waited for the worker
    line = json.dumps({"path": path, "status": status, "queued_s": round(queued, 6),
                       "handled_s": round(handled, 6), "t": time.time()})
    try:
        with open(out_path, "a") as out:
            out.write(line + "\n")
    except OSError:
        pass  # timings are a diagnostic: never fail a request over them


class PooledHTTPServer(HTTPServer):
    """Each connection is served by one of ``workers`` threads started up front, not by a
    thread started per connection (``ThreadingHTTPServer``): inside the sandbox this
    service is restored together with the server, and starting a thread right after a
    gVisor restore costs milliseconds — a cost a real upstream outside the sandbox does
    not have, which would otherwise show in every clone's reconnect and health check."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 workers: int = 8) -> None:
        super().__init__(address, handler)
        self._queue: queue.SimpleQueue[tuple[Any, Any, float]] = queue.SimpleQueue()
        self.local = threading.local()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"upstream-{i}", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self._queue.put((request, client_address, time.perf_counter()))

    def _work(self) -> None:
        while True:
            request, client_address, accepted = self._queue.get()
            self.local.queued = time.perf_counter() - accepted
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)


def serve(port: int = DEFAULT_PORT, host: str = "127.0.0.1") -> HTTPServer:
    """A started-but-not-serving server (call ``serve_forever``); token from the env."""
    token = os.environ.get("UPSTREAM_TOKEN")
    if not token:
        raise SystemExit("upstream: UPSTREAM_TOKEN is not set")
    return PooledHTTPServer((host, port), make_handler(QuotaState(token.encode())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = parser.parse_args()
    server = serve(args.port)
    # app.py --with-upstream waits for this line: the port is this process's, not an
    # earlier run's left listening.
    print(f"upstream: listening on 127.0.0.1:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        # Ctrl-C in a terminal reaches the whole process group: the demo says
        # "interrupted" once; this child's traceback only buried that line.
        raise SystemExit(130) from None
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
