"""A control socket answering every request with one fixed line: garbage, or a reply of
another shape, as a broken or foreign server would (tests of the CLI client)."""

from __future__ import annotations

import socket
import threading


class OneAnswer:
    """A control socket that answers every request with one fixed line (garbage, or a
    reply of another shape), as a broken or foreign server would."""

    def __init__(self, path: str, answer: bytes) -> None:
        self.answer = answer
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.recv(65536)
                conn.sendall(self.answer)

    def close(self) -> None:
        self.srv.shutdown(socket.SHUT_RDWR)
        self.srv.close()
        self.thread.join(10)
