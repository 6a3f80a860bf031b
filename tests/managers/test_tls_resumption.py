"""TLS session resumption across a restore, over real loopback handshakes.

A resumed session skips the certificate: the server proves nothing but its knowledge of
the session's secret (a ticket key or a session-cache entry), which is in the snapshot
image and the same in every clone. So a session from before the snapshot must not
resume after a restore: the client has to make a full handshake and see the renewed
certificate.

Each connection ends with a close_notify both ways (``unwrap``): OpenSSL drops a session
from its cache when a connection ends without one, which would hide session-ID
resumption.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives import serialization

from rehydrate import tls

VERSIONS = [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3]


class Server:
    """A loopback TLS server on ``ctx`` that serves one connection per :meth:`connect`."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx = ctx
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.errors: list[BaseException] = []
        self.clients: dict[ssl.TLSVersion, ssl.SSLContext] = {}

    def _serve_one(self) -> None:
        conn, _ = self.sock.accept()
        try:
            with self.ctx.wrap_socket(conn, server_side=True) as s:
                s.sendall(b"x")  # TLS 1.3: tickets go out with the first data
                s.recv(1)
                s.unwrap()
        except (OSError, ssl.SSLError) as exc:
            self.errors.append(exc)
        finally:
            conn.close()

    def connect(self, version: ssl.TLSVersion, session: ssl.SSLSession | None = None
                ) -> tuple[ssl.SSLSession, bool, bytes]:
        """One full connection: (the client's session, whether it was resumed, the DER
        certificate the server presented — for a resumed session, the one it presented
        when the session was made)."""
        cctx = self.clients.get(version)
        if cctx is None:  # a session resumes only through the context that made it
            cctx = self.clients[version] = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            # the renewed self-signed certificate is trusted by no one: the test compares
            # what was presented instead
            cctx.check_hostname = False
            cctx.verify_mode = ssl.CERT_NONE
            cctx.minimum_version = cctx.maximum_version = version
        server = threading.Thread(target=self._serve_one, daemon=True)
        server.start()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=10) as raw, \
                    cctx.wrap_socket(raw, server_hostname="localhost",
                                     session=session) as s:
                assert s.recv(1) == b"x"  # reads the TLS 1.3 tickets too
                s.sendall(b"y")
                result = (s.session, s.session_reused, s.getpeercert(binary_form=True))
                s.unwrap()
        finally:
            server.join(10)
        assert not server.is_alive() and not self.errors, self.errors
        sess, reused, der = result
        assert sess is not None and der is not None
        return sess, reused, der

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    made: list[Server] = []
    yield made
    for s in made:
        s.close()


def _der(cert: tls.ManagedCertificate) -> bytes:
    return cert.certificate.public_bytes(serialization.Encoding.DER)


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: v.name)
@pytest.mark.parametrize("how", ["server_context", "attach"])
def test_a_session_from_before_the_snapshot_does_not_resume_after_the_restore(
        rehydrate_engine, servers, version, how):
    """Before: the context's ticket key (TLS 1.2 and 1.3) and session cache (TLS 1.2
    session IDs) were the image's, so a pre-snapshot session resumed on the restored clone
    and the client never saw the renewed certificate."""
    cert = tls.self_signed("web", sans=["localhost"], engine=rehydrate_engine)
    if how == "attach":
        ctx = cert.attach(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    else:
        ctx = cert.server_context()
    server = Server(ctx)
    servers.append(server)
    old = _der(cert)
    session, reused, presented = server.connect(version)
    assert not reused and presented == old
    # no resumption at all, also within one clone's life
    session2, reused, _ = server.connect(version, session)
    assert not reused

    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.simulate_restore().ok
    assert _der(cert) != old
    for held in (session, session2):
        _, reused, presented = server.connect(version, held)
        assert not reused, "a pre-snapshot session resumed on the restored clone"
        assert presented == _der(cert)


def test_attach_forgets_sessions_the_context_cached_before(rehydrate_engine, servers):
    """A context that served TLS 1.2 sessions before it was attached: turning the session
    cache off does not remove what it holds (lookups still find it), so attach() empties
    it too."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_into(ctx, tls.self_signed("before", engine=rehydrate_engine).material)
    ctx.options |= ssl.OP_NO_TICKET  # the session lives in the server's cache only
    server = Server(ctx)
    servers.append(server)
    v12 = ssl.TLSVersion.TLSv1_2
    session, _, _ = server.connect(v12)
    assert server.connect(v12, session)[1]  # cached: it resumes (the premise)

    cert = tls.self_signed("web", engine=rehydrate_engine)
    cert.attach(ctx)
    _, reused, presented = server.connect(v12, session)
    assert not reused and presented == _der(cert)


def test_attach_warns_when_the_session_cache_cannot_be_turned_off(
        rehydrate_engine, monkeypatch, caplog):
    """Where OpenSSL cannot be reached (not CPython, ``_ssl`` built in), tickets are still
    off and one warning says TLS 1.2 session IDs can still resume."""
    monkeypatch.setattr(tls, "_libssl", lambda: None)
    cert = tls.self_signed("web", engine=rehydrate_engine)
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        ctx = cert.server_context()
    assert ctx.options & ssl.OP_NO_TICKET and ctx.num_tickets == 0
    assert "session cache of a server context could not be turned off" in caplog.text
    assert "certificate web" in caplog.text


def test_the_session_cache_is_turned_off_in_this_python(rehydrate_engine):
    """CI runs CPython with a shared ``_ssl``: the ctypes path must work there, not fall
    back to the warning."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    assert tls._session_cache_off(ctx)
    # a stand-in object has no SSL_CTX* to read: refused, not dereferenced
    assert not tls._session_cache_off(object())  # type: ignore[arg-type]


def test_an_openssl_without_the_cert_store_calls_still_turns_the_session_cache_off(
        monkeypatch):
    """``SSL_CTX_set1_cert_store`` is OpenSSL 1.1.1's: where ``_ssl``'s OpenSSL lacks it
    (or its getter), the session cache is still turned off and the trust store is not
    shared (a swapped-in context loads the CA certificates Python can see instead)."""
    import ctypes

    real = ctypes.CDLL

    class Without:
        def __init__(self, path: str) -> None:
            self.lib = real(path)

        def __getattr__(self, name: str) -> object:
            if name in ("SSL_CTX_get_cert_store", "SSL_CTX_set1_cert_store"):
                raise AttributeError(name)
            return getattr(self.lib, name)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls._libssl.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setattr(ctypes, "CDLL", Without)
            assert tls._session_cache_off(ctx)
            assert not tls._share_cert_store(ctx, ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    finally:
        tls._libssl.cache_clear()  # the real one for the tests after this
    assert tls._share_cert_store(ctx, ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
