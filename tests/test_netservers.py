"""The loopback servers the connection tests start: a port collision with a test running
beside them (another process binding the picked port first) must not make a test talk to
the wrong server or find a "refused" port answering."""

from __future__ import annotations

import socket

import httpx
import netservers
import pytest


def test_a_server_whose_picked_port_was_taken_picks_another(monkeypatch) -> None:
    """``free_port()`` closes its socket and the server binds later: when another process
    took the port meanwhile, the server exited on its bind and the start "succeeded"
    against the other process's listener. Here the first pick is a port a listener holds
    (and never answers on): the server must end up on another port, serving itself."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(8)
    picks = iter([taken.getsockname()[1]])
    real = netservers.free_port
    monkeypatch.setattr(netservers, "free_port", lambda: next(picks, None) or real())
    srv = netservers.uvicorn_server()
    try:
        srv.start()
        assert srv.port != taken.getsockname()[1]
        assert httpx.get(f"{srv.url}/mine", timeout=10).text == "/mine"
        srv.kill()  # a restart keeps the port the clients know
        srv.start()
        assert httpx.get(f"{srv.url}/again", timeout=10).text == "/again"
    finally:
        srv.kill()
        taken.close()


def test_a_server_given_a_taken_port_says_so() -> None:
    """A port the caller chose is not changed behind its back: a clear error."""
    with netservers.refused_port() as port:
        srv = netservers.uvicorn_server(port)
        with pytest.raises(netservers.PortTaken, match=f"port {port} exited"):
            srv.start()
        assert srv.proc is None


def test_a_refused_port_refuses_and_cannot_be_taken() -> None:
    with netservers.refused_port() as port:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what servers set
        with other, pytest.raises(OSError, match="Address already in use"):
            other.bind(("127.0.0.1", port))
