"""Stand-in for the GCE metadata server (only what rehydrate reads), on loopback.

Like the real one (https://cloud.google.com/compute/docs/metadata/querying-metadata):
``GET /computeMetadata/v1/instance/machine-type`` answers
``projects/PROJECT_NUMBER/machineTypes/MACHINE_TYPE`` with the response header
``Metadata-Flavor: Google``; its root ``GET /computeMetadata/v1/`` answers 200 with the
directory listing; a request without ``Metadata-Flavor: Google`` gets 403, an unknown path
404. Error answers carry ``Metadata-Flavor: Google`` too, unless ``bare_errors``: GKE's
metadata server's published error answers (googleapis/google-api-dotnet-client#1409,
google-cloud-ruby#3750) carry only Content-Type, X-Content-Type-Options, Date and
Content-Length. Point ``GCE_METADATA_HOST`` at :attr:`MetadataServer.host`.
:class:`TricklingServer` is a broken one that never finishes its answer.
"""

from __future__ import annotations

import itertools
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class MetadataServer:
    def __init__(self, machine_type: str, *, impostor: bool = False,
                 status: int = 200, server: str | None = None,
                 bare_errors: bool = False) -> None:
        """``impostor``: answer without ``Metadata-Flavor`` (a captive proxy or another
        cloud's metadata service, not GCE); ``status``: answer the machine type's path with
        this status and the body ``unavailable`` instead (an error page that would parse as
        a machine type); ``server``: the ``Server`` header (GKE's metadata server sends
        ``GKE Metadata Server``); ``bare_errors``: answer every error (any status but 200)
        without ``Metadata-Flavor`` and ``Server``, as GKE's does, its 200s unchanged."""
        self.machine_type = machine_type
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's spelling
                outer.requests.append(self.path)
                if self.headers.get("Metadata-Flavor") != "Google":
                    self._reply(403, "Missing Metadata-Flavor:Google header.")
                elif self.path == "/computeMetadata/v1/instance/machine-type":
                    self._reply(status, f"projects/123456789/machineTypes/{outer.machine_type}"
                                if status == 200 else "unavailable")
                elif self.path == "/computeMetadata/v1/":
                    self._reply(200, "instance/\noauth/\nproject/\n")
                else:
                    self._reply(404, "Not Found")

            def _reply(self, code: int, body: str) -> None:
                data = body.encode()
                if bare_errors and code != 200:
                    self.send_response_only(code)  # no Server header
                    self.send_header("Date", self.date_time_string())
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("X-Content-Type-Options", "nosniff")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(code)
                if not impostor:
                    self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/text")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def version_string(self) -> str:
                return server if server is not None else super().version_string()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> MetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class TricklingServer:
    """A metadata server that answers one byte at a time, each well within a per-read
    timeout, for ever (a header that never ends): only a bound on the whole request
    ends a client's wait. ``sent`` counts the bytes it got out."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.sent = 0
        self.requests = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._listener.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by __exit__
            with conn:
                conn.recv(65536)  # the request
                self.requests += 1
                head = b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nX-Padding: "
                data = itertools.chain(head, itertools.repeat(ord("a")))
                for byte in data:
                    if self._stop.wait(self.interval):
                        return
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        break  # the client gave up
                    self.sent += 1

    def __enter__(self) -> TricklingServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(10)
