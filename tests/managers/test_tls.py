"""TLS: self-signed, CSR-issued and file certificates on real loopback TLS servers.

Servers: a stdlib ``ssl`` HTTPS server thread and uvicorn, both started here; clients:
httpx, reading the certificate the server actually presented from the TLS connection.
The CSR issuer is a small CA HTTP server on loopback built here with ``cryptography``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.server
import json
import logging
import os
import socket
import ssl
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from rehydrate import Phase, tls
from rehydrate.tls import CertificateError

NOW = dt.datetime.now(dt.timezone.utc)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


# -- a small CA ------------------------------------------------------------------------


class CA:
    def __init__(self, name: str = "Test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(NOW - dt.timedelta(days=1))
            .not_valid_after(NOW + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()),
                           critical=False)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def sign(self, public_key, cn: str = "localhost", *, days: int = 10,
             start: dt.datetime | None = None) -> x509.Certificate:
        start = start or NOW - dt.timedelta(hours=1)
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.cert.subject).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(__import__("ipaddress")
                                                            .ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def leaf(self, **kw) -> tuple[bytes, bytes, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self.sign(key.public_key(), **kw)
        key_pem = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem, cert


# -- servers ---------------------------------------------------------------------------


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def https_server() -> Iterator[Callable[[ssl.SSLContext], int]]:
    """A stdlib HTTPS server on loopback using the given (live) context."""
    servers = []

    def start(ctx: ssl.SSLContext) -> int:
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(srv)
        return srv.server_address[1]

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def served_certificate(port: int, verify: ssl.SSLContext) -> x509.Certificate:
    """GET over a new connection; the certificate the server presented."""
    with httpx.Client(verify=verify) as client, \
            client.stream("GET", f"https://127.0.0.1:{port}/") as resp:
        assert resp.status_code == 200
        der = resp.extensions["network_stream"].get_extra_info("ssl_object") \
            .getpeercert(True)
        resp.read()
    return x509.load_der_x509_certificate(der)


def unverified() -> ssl.SSLContext:
    """A client context that accepts any certificate (to see a placeholder)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def spki(cert_or_key) -> bytes:
    pub = cert_or_key.public_key()
    return pub.public_bytes(serialization.Encoding.DER,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def is_placeholder(cert: x509.Certificate) -> bool:
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    return "placeholder" in str(cn)


# -- self-signed -----------------------------------------------------------------------


def test_self_signed_stdlib_server_serves_the_new_certificate(rehydrate_engine, https_server):
    cert = tls.self_signed("web", engine=rehydrate_engine)
    assert tls.self_signed("web", engine=rehydrate_engine) is cert
    port = https_server(cert.server_context())
    old_client = cert.client_context()
    first = served_certificate(port, old_client)
    assert first.serial_number == cert.serial
    old_key = cert.private_key

    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert "rehydrate.tls:web" in [h.name for h in report.hooks]
    second = served_certificate(port, cert.client_context())
    assert second.serial_number == cert.serial != first.serial_number
    assert second.public_key() != first.public_key()
    assert cert.private_key is not old_key
    assert second.not_valid_before_utc >= first.not_valid_before_utc
    # the old client context trusts only the old certificate: rebuilt contexts are needed
    with pytest.raises(httpx.ConnectError):
        served_certificate(port, old_client)


def test_self_signed_uvicorn_server(rehydrate_engine, tmp_path):
    uvicorn = pytest.importorskip("uvicorn")
    cert = tls.self_signed("api", engine=rehydrate_engine)
    (tmp_path / "c.pem").write_bytes(cert.material.chain_pem())
    (tmp_path / "k.pem").write_bytes(cert.material.key_pem())
    (tmp_path / "k.pem").chmod(0o600)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, ssl_certfile=str(tmp_path / "c.pem"),
                            ssl_keyfile=str(tmp_path / "k.pem"), log_level="warning",
                            lifespan="off")
    config.load()
    cert.attach(config.ssl)  # uvicorn's own live context, kept current from now on
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, what="uvicorn to start")
        first = served_certificate(port, cert.client_context())
        assert first.serial_number == cert.serial
        assert rehydrate_engine.simulate_restore().ok
        second = served_certificate(port, cert.client_context())
        assert second.serial_number == cert.serial != first.serial_number
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_self_signed_rsa_and_ed25519(rehydrate_engine):
    ed = tls.self_signed("ed", algorithm="ed25519", engine=rehydrate_engine)
    assert ed.certificate.signature_hash_algorithm is None
    s = ed.serial
    rehydrate_engine.simulate_restore()
    assert ed.serial != s


def test_listener_and_status(rehydrate_engine):
    cert = tls.self_signed("web", engine=rehydrate_engine)
    seen = []
    cert.subscribe(lambda h: seen.append(h.serial))
    rehydrate_engine.simulate_restore()
    assert seen == [cert.serial]
    st = rehydrate_engine.status().extra["tls"]["web"]
    assert st["serial"] == f"{cert.serial:x}" and st["kind"] == "self-signed"


def test_mutual_tls_client_context_presents_the_certificate(rehydrate_engine, https_server):
    cert = tls.self_signed("mtls", engine=rehydrate_engine)
    server_ctx = cert.server_context()
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    server_ctx.load_verify_locations(cadata=cert.material.trust_pem())
    port = https_server(server_ctx)
    assert served_certificate(port, cert.client_context(present=True)).serial_number == cert.serial


# -- before a snapshot ------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["ec-p256", "ed25519"])
def test_snapshot_drops_the_key_and_contexts_present_a_placeholder(rehydrate_engine,
                                                                   https_server, algorithm):
    cert = tls.self_signed("web", algorithm=algorithm, engine=rehydrate_engine)
    server_ctx = cert.server_context()
    port = https_server(server_ctx)
    presenting = cert.client_context(present=True)
    old = served_certificate(port, cert.client_context())
    serial = cert.serial

    report = rehydrate_engine.simulate_snapshot()
    assert report.ok, report.table()
    assert "rehydrate.tls" in [h.name for h in report.hooks]
    # the handle keeps the certificate, not the key
    assert cert.material.private_key is None and cert.key_dropped
    assert cert.serial == serial
    with pytest.raises(CertificateError, match="dropped before a snapshot"):
        cert.private_key  # noqa: B018
    with pytest.raises(CertificateError, match="dropped before a snapshot"):
        cert.material.key_pem()
    with pytest.raises(CertificateError, match="dropped before a snapshot"):
        cert.client_context(present=True)
    assert rehydrate_engine.status().extra["tls"]["web"]["key_dropped"] is True
    # the live context now holds a placeholder of the same key type: OpenSSL keeps one
    # key per type, so the real key was replaced there too
    served = served_certificate(port, unverified())
    assert is_placeholder(served) and served.serial_number != serial
    assert spki(served) != spki(old)
    assert type(served.public_key()) is type(old.public_key())
    # renewing now would put a new key into the image
    with pytest.raises(CertificateError, match="dropped before a snapshot"):
        cert.renew()
    # a context attached in the window gets the placeholder too
    late_ctx = cert.attach(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    late_port = https_server(late_ctx)
    assert is_placeholder(served_certificate(late_port, unverified()))

    assert rehydrate_engine.simulate_restore().ok
    assert not cert.key_dropped and cert.serial != serial
    for p in (port, late_port):
        assert served_certificate(p, cert.client_context()).serial_number == cert.serial
    assert presenting is not cert.client_context(present=True)


def _presented_by(client_ctx: ssl.SSLContext, trusted: x509.Certificate,
                  engine) -> x509.Certificate | None:  # type: ignore[no-untyped-def]
    """The certificate ``client_ctx`` presents to a server that requires one issued by
    ``trusted`` (a handshake over memory BIOs); None when the handshake fails."""
    server = tls.self_signed("recorder", engine=engine).server_context()
    server.verify_mode = ssl.CERT_REQUIRED
    server.load_verify_locations(cadata=trusted.public_bytes(serialization.Encoding.PEM)
                                 .decode())
    client_ctx.check_hostname = False
    client_ctx.verify_mode = ssl.CERT_NONE
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_side=False)
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(20):
        for end, out, peer_in in ((client, c_out, s_in), (srv, s_out, c_in)):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:
                return None
            data = out.read()
            if data:
                peer_in.write(data)
    der = srv.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der) if der else None


def test_a_replaced_presenting_client_context_keeps_no_key_through_the_snapshot(
        rehydrate_engine):
    """Before: only the current presenting client context got the placeholder; one a
    renewal had replaced (an HTTP client built at start-up keeps it) still held the real
    key through the snapshot — into the image — and presented it from every clone."""
    cert = tls.self_signed("web", engine=rehydrate_engine)
    first = cert.certificate
    kept = cert.client_context(present=True)  # given to a client once, at start-up
    assert _presented_by(kept, first, rehydrate_engine) == first
    cert.renew()  # the application never asks for the new context
    assert rehydrate_engine.simulate_snapshot().ok
    assert _presented_by(kept, first, rehydrate_engine) is None  # a placeholder now
    assert rehydrate_engine.simulate_restore().ok
    assert _presented_by(kept, first, rehydrate_engine) is None


def test_resume_after_the_snapshot_pass_brings_a_key_back(rehydrate_engine, https_server):
    cert = tls.self_signed("web", engine=rehydrate_engine)
    port = https_server(cert.server_context())
    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.simulate_restore(kind="resume").ok
    assert not cert.key_dropped
    assert served_certificate(port, cert.client_context()).serial_number == cert.serial


def test_certificate_added_after_the_snapshot_pass(rehydrate_engine, https_server):
    """Made after the before-snapshot pass, its key would be written into the image: the
    first material is produced on restore, a placeholder is served meanwhile."""
    assert rehydrate_engine.simulate_snapshot().ok
    cert = tls.self_signed("late", engine=rehydrate_engine)
    assert cert.key_dropped
    with pytest.raises(CertificateError, match="after the before-snapshot pass"):
        cert.material  # noqa: B018
    port = https_server(cert.server_context())
    assert is_placeholder(served_certificate(port, unverified()))
    assert rehydrate_engine.simulate_restore().ok
    assert served_certificate(port, cert.client_context()).serial_number == cert.serial


def test_tls_disabled_at_snapshot_keeps_the_key(rehydrate_engine, monkeypatch):
    cert = tls.self_signed("web", engine=rehydrate_engine)
    monkeypatch.setenv("REHYDRATE_DISABLE", "tls")
    assert rehydrate_engine.simulate_snapshot().ok
    assert not cert.key_dropped


# -- CSR issuance --------------------------------------------------------------------------


class CAServer:
    """POST {"csr": PEM} -> {"certificate": PEM, "chain": [PEM]}; ``mode`` breaks it."""

    def __init__(self) -> None:
        self.ca = CA("Issuer CA")
        self.mode = "ok"
        self.requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.requests += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                csr = x509.load_pem_x509_csr(body["csr"].encode())
                assert csr.is_signature_valid
                status, payload = outer.answer(csr)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                         daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/sign"

    def answer(self, csr: x509.CertificateSigningRequest) -> tuple[int, bytes]:
        pem = lambda c: c.public_bytes(serialization.Encoding.PEM).decode()  # noqa: E731
        if self.mode == "500":
            return 500, b'{"error": "boom"}'
        if self.mode == "garbage":
            return 200, b"<html>not json</html>"
        if self.mode == "bad-pem":
            return 200, json.dumps({"certificate": "-----BEGIN CERTIFICATE-----\nAAAA",
                                    "chain": []}).encode()
        if self.mode == "wrong-key":
            other = ec.generate_private_key(ec.SECP256R1()).public_key()
            return 200, json.dumps({"certificate": pem(self.ca.sign(other)),
                                    "chain": [pem(self.ca.cert)]}).encode()
        if self.mode == "expired":
            cert = self.ca.sign(csr.public_key(), start=NOW - dt.timedelta(days=20), days=1)
            return 200, json.dumps({"certificate": pem(cert),
                                    "chain": [pem(self.ca.cert)]}).encode()
        if self.mode == "other-ca":
            cert = CA("Rogue").sign(csr.public_key())
            return 200, json.dumps({"certificate": pem(cert),
                                    "chain": [pem(self.ca.cert)]}).encode()
        cert = self.ca.sign(csr.public_key(),
                            cn=csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)
        return 200, json.dumps({"certificate": pem(cert),
                                "chain": [pem(self.ca.cert)]}).encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def ca_server() -> Iterator[CAServer]:
    srv = CAServer()
    yield srv
    srv.close()


def test_issued_certificate_renewed_on_restore(rehydrate_engine, ca_server, https_server):
    issuer = tls.HTTPIssuer(ca_server.url)
    cert = tls.issued("api", issuer, common_name="localhost", sans=["localhost", "127.0.0.1"],
                      engine=rehydrate_engine)
    assert cert.certificate.issuer == ca_server.ca.cert.subject
    assert cert.material.trust == (ca_server.ca.cert,)
    port = https_server(cert.server_context())
    first = served_certificate(port, cert.client_context())
    assert first.serial_number == cert.serial
    assert ca_server.requests == 1

    assert rehydrate_engine.simulate_restore().ok
    assert ca_server.requests == 2
    second = served_certificate(port, cert.client_context())
    assert second.serial_number == cert.serial != first.serial_number
    assert second.public_key() != first.public_key()


@pytest.mark.parametrize("mode,message", [
    ("down", "unreachable"),
    ("500", "HTTP 500"),
    ("garbage", "returned no JSON"),
    ("bad-pem", "not valid PEM"),
    ("wrong-key", "private key does not match the certificate"),
    ("expired", "certificate expired"),
    ("other-ca", "does not verify against the CA bundle"),
])
def test_issuer_failure_after_a_restore_never_serves_the_snapshot_key(
        rehydrate_engine, ca_server, https_server, caplog, mode, message):
    """Every clone of the snapshot holds the old key: a clone whose renewal failed must not
    keep serving it. It serves a fresh-key placeholder and stays degraded."""
    issuer = tls.HTTPIssuer(ca_server.url, timeout=2.0, trust=[ca_server.ca.cert])
    cert = tls.issued("api", issuer, common_name="localhost", engine=rehydrate_engine)
    port = https_server(cert.server_context())
    old = served_certificate(port, cert.client_context())
    serial = cert.serial
    if mode == "down":
        ca_server.close()
    else:
        ca_server.mode = mode
    caplog.set_level(logging.WARNING, logger="rehydrate")
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    [res] = [h for h in report.hooks if h.name == "rehydrate.tls:api"]
    assert res.outcome == "failed"
    assert message in str(res.error) and "placeholder" in str(res.error)
    assert message in cert.last_error and cert.key_dropped
    with pytest.raises(CertificateError, match=message):
        cert.material  # noqa: B018
    served = served_certificate(port, unverified())
    assert is_placeholder(served) and served.serial_number != serial
    assert spki(served) != spki(old)  # not the key every clone got from the image
    with pytest.raises(httpx.ConnectError):  # and nobody trusts the placeholder
        served_certificate(port, ssl.create_default_context(cadata=ca_server.ca.pem.decode()))
    assert rehydrate_engine.status().state == "degraded"
    assert rehydrate_engine.status().extra["tls"]["api"]["serial"] is None
    # (a connection another test left opening in the background may log meanwhile)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING
                and not r.threadName.startswith("rehydrate-open-")]
    assert len(warnings) == 1 and message in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    if mode == "down":
        return
    ca_server.mode = "ok"
    assert rehydrate_engine.simulate_restore().ok
    assert cert.serial != serial and cert.last_error is None and not cert.key_dropped
    assert served_certificate(port, cert.client_context()).serial_number == cert.serial
    assert rehydrate_engine.status().state == "ready"


def test_issuer_failure_on_resume_keeps_the_previous_certificate(rehydrate_engine, ca_server,
                                                                 https_server):
    """A resume is the original process itself: when it still holds its key (no
    before-snapshot pass dropped it), a failed renewal keeps the previous material."""
    cert = tls.issued("api", tls.HTTPIssuer(ca_server.url, timeout=2.0),
                      common_name="localhost", engine=rehydrate_engine)
    port = https_server(cert.server_context())
    serial = cert.serial
    ca_server.mode = "500"
    report = rehydrate_engine.simulate_restore(kind="resume")
    [res] = [h for h in report.hooks if h.name == "rehydrate.tls:api"]
    assert res.outcome == "failed" and f"keeping serial {serial:x}" in str(res.error)
    assert cert.serial == serial and not cert.key_dropped
    assert served_certificate(port, cert.client_context()).serial_number == serial


def test_issuer_failure_on_resume_after_the_snapshot_pass(rehydrate_engine, ca_server,
                                                          https_server):
    """After the before-snapshot pass the key is gone even from the original: a failed
    renewal on resume leaves the placeholder (nothing to keep)."""
    cert = tls.issued("api", tls.HTTPIssuer(ca_server.url, timeout=2.0),
                      common_name="localhost", engine=rehydrate_engine)
    port = https_server(cert.server_context())
    serial = cert.serial
    assert rehydrate_engine.simulate_snapshot().ok
    ca_server.mode = "500"
    report = rehydrate_engine.simulate_restore(kind="resume")
    [res] = [h for h in report.hooks if h.name == "rehydrate.tls:api"]
    assert res.outcome == "failed" and "placeholder" in str(res.error)
    served = served_certificate(port, unverified())
    assert is_placeholder(served) and served.serial_number != serial
    ca_server.mode = "ok"
    assert rehydrate_engine.simulate_restore(kind="resume").ok
    assert served_certificate(port, cert.client_context()).serial_number == cert.serial


def test_optional_certificate_failure_keeps_ready_without_the_old_key(
        rehydrate_engine, ca_server, https_server):
    cert = tls.issued("api", tls.HTTPIssuer(ca_server.url), common_name="localhost",
                      required=False, engine=rehydrate_engine)
    port = https_server(cert.server_context())
    old = served_certificate(port, cert.client_context())
    ca_server.mode = "garbage"
    report = rehydrate_engine.simulate_restore()
    assert report.ok and report.failed[0].name == "rehydrate.tls:api"
    assert cert.last_error and cert.key_dropped
    assert rehydrate_engine.status().state == "ready"
    served = served_certificate(port, unverified())
    assert is_placeholder(served) and spki(served) != spki(old)


def test_first_issuance_failure_raises(rehydrate_engine, ca_server):
    ca_server.mode = "500"
    with pytest.raises(CertificateError, match="HTTP 500"):
        tls.issued("api", tls.HTTPIssuer(ca_server.url), common_name="localhost",
                   engine=rehydrate_engine)
    assert tls.manager(rehydrate_engine).get("api") is None


# -- files -----------------------------------------------------------------------------------


class K8sSecretDir:
    """A Kubernetes-style secret volume: files are symlinks through ``..data``, which is
    swapped atomically to a new timestamped directory on update."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0

    def publish(self, files: dict[str, bytes]) -> None:
        self.n += 1
        d = self.root / f"..2026_11_30_00_00_{self.n:02d}"
        d.mkdir()
        for name, data in files.items():
            (d / name).write_bytes(data)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(d.name)
        os.replace(tmp, self.root / "..data")
        for name in files:
            link = self.root / name
            if not link.is_symlink():
                link.symlink_to(f"..data/{name}")

    def paths(self) -> dict[str, str]:
        return {"cert": str(self.root / "tls.crt"), "key": str(self.root / "tls.key"),
                "ca": str(self.root / "ca.crt")}


@pytest.fixture
def secret_dir(tmp_path) -> K8sSecretDir:
    d = tmp_path / "tls"
    d.mkdir()
    return K8sSecretDir(d)


def _bundle(ca: CA, **kw) -> tuple[dict[str, bytes], x509.Certificate]:
    cert_pem, key_pem, cert = ca.leaf(**kw)
    return {"tls.crt": cert_pem, "tls.key": key_pem, "ca.crt": ca.pem}, cert


@pytest.mark.parametrize("poll", [False, True], ids=["inotify", "poll"])
def test_file_certificate_follows_symlink_swap(rehydrate_engine, secret_dir, https_server,
                                               poll):
    ca = CA()
    files, first = _bundle(ca)
    secret_dir.publish(files)
    cert = tls.from_files("files", **secret_dir.paths(), poll=poll, poll_interval=0.1,
                          engine=rehydrate_engine)
    try:
        assert cert.serial == first.serial_number
        assert cert.status()["watching"] == ("poll" if poll else "inotify")
        port = https_server(cert.server_context())
        assert served_certificate(port, cert.client_context()).serial_number == cert.serial

        files2, second = _bundle(ca)
        secret_dir.publish(files2)
        wait_until(lambda: cert.serial == second.serial_number, what="the swapped certificate")
        assert served_certificate(port, cert.client_context()).serial_number == \
            second.serial_number
    finally:
        cert.close()


def _bad_bundles(ca: CA) -> dict[str, tuple[dict[str, bytes], str]]:
    good, _ = _bundle(ca)
    other_key = _bundle(ca)[0]["tls.key"]
    expired, _ = _bundle(ca, start=NOW - dt.timedelta(days=20), days=1)
    rogue, _ = _bundle(CA("Rogue"))
    rogue["ca.crt"] = ca.pem
    return {
        "corrupt-pem": ({**good, "tls.crt": b"-----BEGIN CERTIFICATE-----\nnope\n"},
                        "is not valid PEM"),
        "corrupt-key": ({**good, "tls.key": b"garbage"}, "not a usable PEM private key"),
        "key-mismatch": ({**good, "tls.key": other_key},
                         "private key does not match the certificate"),
        "expired": (expired, "certificate expired"),
        "ca-mismatch": (rogue, "does not verify against the CA bundle"),
        "key-as-cert": ({**good, "tls.crt": good["tls.key"]},
                        "holds no certificate (PEM of another kind: a key given as"),
    }


@pytest.mark.parametrize("case", ["corrupt-pem", "corrupt-key", "key-mismatch", "expired",
                                  "ca-mismatch", "key-as-cert"])
def test_bad_files_keep_previous_material(rehydrate_engine, secret_dir, caplog, case):
    ca = CA()
    files, first = _bundle(ca)
    secret_dir.publish(files)
    cert = tls.from_files("files", **secret_dir.paths(), poll=False, engine=rehydrate_engine)
    try:
        bad, message = _bad_bundles(ca)[case]
        caplog.set_level(logging.WARNING, logger="rehydrate")
        secret_dir.publish(bad)
        wait_until(lambda: cert.last_error is not None, what="the bad files to be rejected")
        # more events on the same bad files: still one line
        secret_dir.publish(bad)
        cert.reload_if_changed()
        assert cert.serial == first.serial_number
        assert message in cert.last_error
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        line = warnings[0].getMessage()
        assert message in line and "keeping serial" in line and "\n" not in line

        # a restore with the bad files still in place: required hook fails -> degraded
        caplog.clear()
        report = rehydrate_engine.simulate_restore()
        assert not report.ok
        assert cert.serial == first.serial_number
        assert rehydrate_engine.status().state == "degraded"
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1

        # fixed files are picked up by the watcher — the process is ready again at once,
        # not degraded until the next restore — and by the next restore
        files3, third = _bundle(ca)
        secret_dir.publish(files3)
        wait_until(lambda: cert.serial == third.serial_number, what="the fixed certificate")
        wait_until(rehydrate_engine.is_ready, what="readiness back")
        assert rehydrate_engine.status().state == "ready"
        assert rehydrate_engine.simulate_restore().ok
        assert rehydrate_engine.status().state == "ready"
    finally:
        cert.close()


def _intermediate(root: CA) -> CA:
    """A CA whose certificate ``root`` signed (so leaves need it in their chain)."""
    inter = CA("Test Intermediate")
    inter.cert = (
        x509.CertificateBuilder().subject_name(inter.cert.subject)
        .issuer_name(root.cert.subject).public_key(inter.key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=1))
        .not_valid_after(NOW + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(root.key, hashes.SHA256())
    )
    return inter


@pytest.mark.parametrize("with_ca", [False, True], ids=["no-ca", "ca"])
def test_a_cut_off_chain_file_keeps_the_full_chain_in_use(rehydrate_engine, tmp_path,
                                                          https_server, caplog, with_ca):
    """A fullchain.pem cut off inside its intermediate (a partial write, a full disk)
    used to be read as the leaf alone: applied, it made every client's verification
    fail. Like OpenSSL, rehydrate refuses the file, and the full chain stays served."""
    root = CA("Test Root")
    inter = _intermediate(root)
    c1, k1, first = inter.leaf()
    _write_pair(tmp_path, c1 + inter.pem, k1)
    ca = {"ca": tmp_path / "ca.pem"} if with_ca else {}
    if with_ca:
        # a CA bundle of two roots, cut off the same way: also refused
        (tmp_path / "ca.pem").write_bytes(root.pem + CA("Other Root").pem)
    cert = tls.from_files("chain", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                          watch=False, engine=rehydrate_engine, **ca)
    port = https_server(cert.server_context())
    trusting_root = ssl.create_default_context(cadata=root.pem.decode())
    assert served_certificate(port, trusting_root).serial_number == first.serial_number

    c2, k2, _ = inter.leaf()
    if with_ca:
        bundle = (tmp_path / "ca.pem").read_bytes()
        (tmp_path / "ca.pem").write_bytes(bundle[:-200])
        _write_pair(tmp_path, c2 + inter.pem, k2)
    else:
        _write_pair(tmp_path, (c2 + inter.pem)[:-200], k2)
    caplog.set_level(logging.WARNING, logger="rehydrate")
    assert cert.reload_if_changed() is False
    assert "cut off" in cert.last_error
    assert cert.serial == first.serial_number and cert.material.chain == (inter.cert,)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "keeping serial" in warnings[0], warnings
    assert not rehydrate_engine.simulate_restore().ok
    assert served_certificate(port, trusting_root).serial_number == first.serial_number


def _handshake_serial(port: int, verify: ssl.SSLContext) -> int:
    """A TLS handshake on loopback (no HTTP): the serial of the certificate presented."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            verify.wrap_socket(raw, server_hostname="localhost") as conn:
        return int(x509.load_der_x509_certificate(conn.getpeercert(True)).serial_number)


@pytest.mark.parametrize("poll", [False, True], ids=["inotify", "poll"])
def test_a_forked_child_watches_only_when_asked_and_leaves_the_parents_watcher_alone(
        rehydrate_engine, tmp_path, poll):
    """A pre-fork worker: the parent's watcher threads did not come along, so the child
    never re-read rotated files while its status said it watched, and its close()
    stopped the observer it inherited — whose inotify instance is the parent's: the
    parent stopped following its files too. Now the child's status says it does not
    watch, ``start_watching()`` there follows the files, and the parent keeps its own."""
    from detect_helpers import in_forked_child

    ca = CA()
    c1, k1, _ = ca.leaf()
    _write_pair(tmp_path, c1, k1)
    cert = tls.from_files("forked", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                          poll=poll, poll_interval=0.05, engine=rehydrate_engine)
    server_ctx = cert.server_context()
    trusting_ca = ssl.create_default_context(cadata=ca.pem.decode())
    c2, k2, second = ca.leaf()

    def child() -> dict:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def serve() -> None:
            while True:
                conn, _ = listener.accept()
                with contextlib.suppress(OSError), \
                        server_ctx.wrap_socket(conn, server_side=True):
                    pass

        threading.Thread(target=serve, daemon=True).start()
        inherited = cert.status()["watching"]
        cert.start_watching()  # a pre-fork worker that serves follows its files
        _write_pair(tmp_path, c2, k2)
        with contextlib.suppress(AssertionError):  # reported below, after the close
            wait_until(lambda: cert.serial == second.serial_number, 5, "the child's reload")
        served = _handshake_serial(port, trusting_ca)
        cert.close()
        return {"served": served, "inherited": inherited}

    out = in_forked_child(child, 15)
    wait_until(lambda: cert.serial == second.serial_number, what="the parent's reload")
    c3, k3, third = ca.leaf()
    _write_pair(tmp_path, c3, k3)
    wait_until(lambda: cert.serial == third.serial_number, 5, "the parent's next reload")
    cert.close()
    assert out == {"served": second.serial_number, "inherited": None}, out


def test_bad_files_at_creation_raise(rehydrate_engine, secret_dir):
    ca = CA()
    bad, message = _bad_bundles(ca)["key-mismatch"]
    secret_dir.publish(bad)
    with pytest.raises(CertificateError, match=message):
        tls.from_files("files", **secret_dir.paths(), engine=rehydrate_engine)


def _write_pair(d, cert_pem, key_pem):
    (d / "c.pem").write_bytes(cert_pem)
    (d / "k.pem").write_bytes(key_pem)


def _plain_file_cert(engine, d, cert_pem, key_pem):
    """``d/c.pem`` and ``d/k.pem`` written, then loaded without a watcher."""
    _write_pair(d, cert_pem, key_pem)
    return tls.from_files("plain", cert=d / "c.pem", key=d / "k.pem", watch=False,
                          engine=engine)


def test_files_reread_on_restore_without_watching(rehydrate_engine, tmp_path):
    ca = CA()
    c1, k1, first = ca.leaf()
    cert = _plain_file_cert(rehydrate_engine, tmp_path, c1, k1)
    c2, k2, second = ca.leaf()
    _write_pair(tmp_path, c2, k2)
    assert cert.serial == first.serial_number
    assert rehydrate_engine.simulate_restore().ok
    assert cert.serial == second.serial_number
    # unchanged files: re-read and validated, but not re-applied (no listener call)
    calls = []
    cert.subscribe(lambda h: calls.append(h.serial))
    renewals = cert.renewals
    assert rehydrate_engine.simulate_restore().ok
    assert calls == [] and cert.renewals == renewals


def test_file_certificate_key_dropped_before_snapshot_and_reread_on_restore(
        rehydrate_engine, secret_dir, https_server):
    """File keys are the same in every clone (they are on disk), but the image still should
    not hold them: dropped from memory, re-read from the files on restore. The watcher
    pauses in between (a reload would put the key back into memory)."""
    ca = CA()
    files, first = _bundle(ca)
    secret_dir.publish(files)
    cert = tls.from_files("files", **secret_dir.paths(), poll=False, engine=rehydrate_engine)
    try:
        port = https_server(cert.server_context())
        assert rehydrate_engine.simulate_snapshot().ok
        assert cert.key_dropped and cert.serial == first.serial_number
        assert is_placeholder(served_certificate(port, unverified()))
        files2, second = _bundle(ca)
        secret_dir.publish(files2)
        assert cert.reload_if_changed() is False and cert.key_dropped

        assert rehydrate_engine.simulate_restore().ok
        assert not cert.key_dropped and cert.serial == second.serial_number
        assert served_certificate(port, cert.client_context()).serial_number == \
            second.serial_number
    finally:
        cert.close()


def test_file_certificate_unchanged_files_are_reloaded_after_the_drop(rehydrate_engine,
                                                                     tmp_path, https_server):
    ca = CA()
    c1, k1, first = ca.leaf()
    cert = _plain_file_cert(rehydrate_engine, tmp_path, c1, k1)
    port = https_server(cert.server_context())
    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.simulate_restore().ok
    assert not cert.key_dropped and cert.serial == first.serial_number
    trusting_ca = ssl.create_default_context(cadata=ca.pem.decode())
    assert served_certificate(port, trusting_ca).serial_number == first.serial_number


def test_bad_files_after_the_drop_leave_the_placeholder(rehydrate_engine, tmp_path,
                                                        https_server):
    """The previous key was dropped before the snapshot: with bad files on restore there
    is nothing good to keep, so the placeholder stays and the hook fails."""
    ca = CA()
    c1, k1, _ = ca.leaf()
    cert = _plain_file_cert(rehydrate_engine, tmp_path, c1, k1)
    port = https_server(cert.server_context())
    assert rehydrate_engine.simulate_snapshot().ok
    (tmp_path / "k.pem").write_bytes(b"garbage")
    report = rehydrate_engine.simulate_restore()
    assert not report.ok and "placeholder" in str(report.failed[0].error)
    assert is_placeholder(served_certificate(port, unverified()))


def test_watcher_reload_and_restore_renewal_are_serialised(rehydrate_engine, tmp_path):
    """The watcher's reload (timer thread) and the restore hook's renewal must not
    interleave: otherwise a reload that read older files can apply them after a renewal
    that read newer ones (stale material wins). Deterministic: the watcher's read is held
    inside produce() until the renewal has either finished (no lock: the bug) or is
    waiting for the handle's lock (the fix)."""
    ca = CA()
    c1, k1, _ = ca.leaf()
    cert = _plain_file_cert(rehydrate_engine, tmp_path, c1, k1)
    c2, k2, v2 = ca.leaf()
    _write_pair(tmp_path, c2, k2)

    watcher = threading.current_thread()
    watcher_read, release = threading.Event(), threading.Event()
    real_produce = cert.produce

    def produce():
        m = real_produce()
        if threading.current_thread() is watcher:
            watcher_read.set()
            assert release.wait(10)
        return m

    cert.produce = produce  # type: ignore[method-assign]

    class SpyLock:
        """The handle's renewal lock, noting who waits for it."""

        def __init__(self, inner):
            self.inner, self.waiting = inner, set()

        def __enter__(self):
            self.waiting.add(threading.current_thread())
            self.inner.acquire()
            return self

        def __exit__(self, *exc):
            self.inner.release()

    spy = SpyLock(threading.RLock())
    cert._renew_lock = spy
    applied: list[int] = []
    cert.subscribe(lambda h: applied.append(h.serial))

    def watch() -> None:
        nonlocal watcher
        watcher = threading.current_thread()
        cert.reload_if_changed()

    a = threading.Thread(target=watch)
    a.start()
    assert watcher_read.wait(10)  # the watcher has read v2 and is about to apply it
    c3, k3, v3 = ca.leaf()
    _write_pair(tmp_path, c3, k3)
    b = threading.Thread(target=cert.renew)  # what the restore hook calls
    b.start()
    wait_until(lambda: not b.is_alive() or b in spy.waiting, what="the renewal")
    release.set()
    a.join(10)
    b.join(10)
    assert not a.is_alive() and not b.is_alive()
    # the newest files win, each version applied once, in order
    assert cert.serial == v3.serial_number
    assert applied == [v2.serial_number, v3.serial_number]


def test_validate_signature_fallback():
    ca = CA()
    _, key_pem, cert = ca.leaf()
    key = serialization.load_pem_private_key(key_pem, None)
    tls._verify_signatures(cert, [], [ca.cert], NOW)
    with pytest.raises(CertificateError, match="does not verify"):
        tls._verify_signatures(cert, [], [CA("x").cert], NOW)
    tls.validate(cert, key, (), [ca.cert])


def test_tls_disabled(rehydrate_engine, monkeypatch):
    cert = tls.self_signed("web", engine=rehydrate_engine)
    serial = cert.serial
    monkeypatch.setenv("REHYDRATE_DISABLE", "tls")
    assert rehydrate_engine.simulate_restore().ok
    assert cert.serial == serial


def test_device_fifo_or_huge_file_as_certificate_is_one_clear_error(rehydrate_engine,
                                                                    tmp_path):
    """Issue #13.13: /dev/zero as a certificate was a MemoryError; a FIFO hung the hook."""
    good = tls.self_signed("good", engine=rehydrate_engine).material
    key = tmp_path / "k.pem"
    pem = good.key_pem()
    key.write_bytes(bytes(pem))
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.pem"
    with open(huge, "wb") as fh:
        fh.truncate(tls.MAX_PEM_BYTES + 1)
    for path, why in (("/dev/zero", "not a regular file (a character device)"),
                      (str(fifo), "not a regular file (a FIFO)"),
                      (str(huge), f"larger than {tls.MAX_PEM_BYTES} bytes")):
        with pytest.raises(CertificateError, match=r"cannot read certificate file .*: "
                           + why.replace("(", r"\(").replace(")", r"\)")):
            tls.from_files(f"bad-{len(why)}", cert=path, key=key, watch=False,
                           engine=rehydrate_engine)
    (tmp_path / "c.pem").write_bytes(good.chain_pem())
    with pytest.raises(CertificateError, match=r"key file .*not a regular file \(a FIFO\)"):
        tls.from_files("bad-key", cert=tmp_path / "c.pem", key=fifo, watch=False,
                       engine=rehydrate_engine)
    assert tls.from_files("ok", cert=tmp_path / "c.pem", key=key, watch=False,
                          engine=rehydrate_engine).serial == good.serial


class _SlowServer:
    """A raw HTTP server on loopback that answers 200 and then either trickles its body
    one byte per ``interval`` or streams ``flood`` bytes as fast as it can."""

    def __init__(self, *, interval: float = 1.0, flood: int = 0) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/sign"
        self.interval, self.flood = interval, flood
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                size = self.flood or 10_000
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % size)
                if self.flood:
                    block = b" " * 65536
                    for _ in range(self.flood // len(block)):
                        conn.sendall(block)
                    return
                while not self.stop.wait(self.interval):
                    conn.sendall(b" ")
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def test_a_stalled_issuer_is_bounded_and_wedges_nothing(rehydrate_engine):
    """Issue #13.4: a 1 byte/s issuer kept HTTPIssuer(timeout=2) busy for good, and the
    renew lock with it: later renewals, restores and the snapshot pass all hung."""
    good = CAServer()
    slow = _SlowServer(interval=0.5)
    try:
        issuer = tls.HTTPIssuer(good.url, timeout=2)
        cert = tls.issued("api", issuer, common_name="api.local", engine=rehydrate_engine)
        serial = cert.serial
        issuer.url = slow.url
        errors: list[BaseException] = []

        def renew() -> None:
            try:
                cert.renew()
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        worker = threading.Thread(target=renew, daemon=True)
        worker.start()
        worker.join(6.0)  # a deadline for the check, not a wait for timing
        assert not worker.is_alive(), "renew() against a 1 byte/0.5s issuer did not end"
        assert len(errors) == 1 and "did not answer within 2s" in str(errors[0]), errors
        assert cert.serial == serial and not cert.key_dropped  # the old one stays
        report = rehydrate_engine.simulate_snapshot()  # the lock is free: the key drops
        assert report.ok and cert.key_dropped
        issuer.url = good.url
        report = rehydrate_engine.simulate_restore()
        assert report.ok, report.table()
        assert cert.serial != serial and not cert.key_dropped
    finally:
        slow.close()
        good.close()


def test_an_issuer_response_over_the_cap_is_refused_without_reading_it_all(rehydrate_engine):
    import resource

    flood = _SlowServer(flood=400 * 1024 * 1024)
    try:
        issuer = tls.HTTPIssuer(flood.url, timeout=30)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with pytest.raises(CertificateError, match=r"sent more than 1048576 bytes"):
            issuer.issue(_csr())
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert grown_mib < 64, f"peak RSS grew by {grown_mib:.0f} MiB"
    finally:
        flood.close()


def _spki(key) -> bytes:  # type: ignore[no-untyped-def]
    return key.public_bytes(serialization.Encoding.DER,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def _csr() -> x509.CertificateSigningRequest:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api.local")])
    return x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())


class _StuckRenewal:
    """A certificate from an issuer that answers at once, then a renewal of it, started on
    a thread, that stalls in the issuer until :attr:`release` is set. :attr:`outcome`
    gets what ``renew()`` returned or raised; :attr:`stale` the stalled request's key."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        ca = CA("Slow CA")
        entered, self.release = threading.Event(), threading.Event()
        self.stale: list[bytes] = []
        stall: list[bool] = []

        class SlowIssuer:
            trust = (ca.cert,)

            def issue(_, csr):  # type: ignore[no-untyped-def]
                if stall:
                    stall.clear()
                    self.stale.append(_spki(csr.public_key()))
                    entered.set()
                    self.release.wait(30)
                return ca.sign(csr.public_key()), [ca.cert]

        self.cert = tls.issued("slow", SlowIssuer(), common_name="localhost", engine=engine)
        self.first = self.cert.serial
        self.outcome: list[BaseException | None] = []
        stall.append(True)
        self.worker = threading.Thread(target=self._renew, daemon=True)
        self.worker.start()
        assert entered.wait(5)

    def _renew(self) -> None:
        try:
            self.cert.renew()
            self.outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked by the tests
            self.outcome.append(exc)

    def finish(self) -> None:
        self.release.set()
        self.worker.join(10.0)


def test_a_stuck_custom_issuer_does_not_keep_the_key_in_the_snapshot(rehydrate_engine,
                                                                     monkeypatch):
    """Any issuer (not only HTTPIssuer) can stall while its renewal holds the renew lock:
    the before-snapshot pass still drops the key after DROP_WAIT, and what the stalled
    renewal brings back afterwards is discarded, not served or put into the image."""
    monkeypatch.setattr(tls, "DROP_WAIT", 0.2, raising=False)
    stuck = _StuckRenewal(rehydrate_engine)
    snap: list[object] = []
    snapper = threading.Thread(target=lambda: snap.append(rehydrate_engine.simulate_snapshot()),
                               daemon=True)
    snapper.start()
    snapper.join(10.0)  # a deadline for the check: the snapshot hook's own timeout is 60 s
    try:
        assert not snapper.is_alive(), "the snapshot pass waited for the stuck issuer"
        assert snap[0].ok and stuck.cert.key_dropped  # type: ignore[attr-defined]
    finally:
        stuck.finish()
    assert len(stuck.outcome) == 1 and "discarded" in str(stuck.outcome[0]), stuck.outcome
    assert stuck.cert.key_dropped and stuck.cert.material.serial == stuck.first


@pytest.mark.parametrize("snapshot_pass", [True, False])
def test_a_renewal_that_outlives_the_restore_is_discarded(rehydrate_engine, monkeypatch,
                                                         snapshot_pass):
    """Before: a renewal stuck in its issuer across the snapshot *and the restore* (or
    across a restore with no snapshot pass) was applied in the clone once the issuer
    answered — its key made before the snapshot, the same in every clone — since only
    ``frozen`` was checked, and the restore had cleared it."""
    monkeypatch.setattr(tls, "DROP_WAIT", 0.1, raising=False)
    stuck = _StuckRenewal(rehydrate_engine)
    applied: list[bytes] = []
    stuck.cert.subscribe(lambda c: applied.append(_spki(c.certificate.public_key())))
    if snapshot_pass:
        assert rehydrate_engine.simulate_snapshot().ok
    began = threading.Event()  # runs right after the tls manager's own restore hook
    rehydrate_engine.registry.after_restore(phase=Phase.SECRETS, order=99,
                                            name="test.tls-restore-began")(began.set)
    restored: list[object] = []
    restorer = threading.Thread(
        target=lambda: restored.append(rehydrate_engine.simulate_restore()), daemon=True)
    restorer.start()
    try:  # the restore has begun (its certificate hook waits for the renew lock) ...
        assert began.wait(10)
    finally:
        stuck.finish()  # ... and only then does the stale renewal come back
        restorer.join(30.0)
    assert len(stuck.outcome) == 1 and "discarded" in str(stuck.outcome[0]), stuck.outcome
    assert restored[0].ok  # type: ignore[attr-defined]
    assert stuck.stale[0] not in applied, "the pre-snapshot key was applied after the restore"
    assert _spki(stuck.cert.certificate.public_key()) != stuck.stale[0]


def test_one_string_of_sans_is_one_name(rehydrate_engine):
    cert = tls.self_signed("one", sans="localhost", engine=rehydrate_engine)
    names = cert.certificate.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == ["localhost"]  # not ["l", "o", "c", ...]
    with pytest.raises(TypeError, match="sans must be non-empty strings"):
        tls.self_signed("bad", sans=["localhost", 5], engine=rehydrate_engine)


def _weak_bundles(ca: CA) -> dict[str, tuple[bytes, bytes]]:
    """Material ``validate()`` accepts without a CA bundle but OpenSSL refuses at its
    default security level: an RSA-1024 leaf key, or an RSA-1024 intermediate CA."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = serialization.Encoding.PEM
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    weak_pem = weak.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    inter = CA("Weak Intermediate")
    inter.key = weak
    inter.cert = ca.sign(weak.public_key(), "Weak Intermediate")
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = inter.sign(leaf_key.public_key())
    leaf_key_pem = leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())
    return {
        "weak-leaf-key": (ca.sign(weak.public_key()).public_bytes(pem), weak_pem),
        "weak-intermediate": (leaf.public_bytes(pem) + inter.cert.public_bytes(pem),
                              leaf_key_pem),
    }


@pytest.mark.parametrize("case", ["weak-leaf-key", "weak-intermediate"])
def test_material_openssl_refuses_leaves_every_context_serving_the_old_certificate(
        rehydrate_engine, tmp_path, https_server, caplog, case):
    """OpenSSL installed the new certificate before refusing it (and dropped the old key):
    every handshake failed while status() showed the new serial without an error, and
    the next restore, seeing the files unchanged, reported ok."""
    ca = CA()
    c1, k1, first = ca.leaf()
    cert = _plain_file_cert(rehydrate_engine, tmp_path, c1, k1)
    port = https_server(cert.server_context())
    trust = ssl.create_default_context(cadata=ca.pem.decode())
    assert served_certificate(port, trust).serial_number == first.serial_number
    _write_pair(tmp_path, *_weak_bundles(ca)[case])
    for _ in range(2):  # the files stay as they are: the second restore fails the same way
        report = rehydrate_engine.simulate_restore()
        (hook,) = [h for h in report.hooks if h.name == "rehydrate.tls:plain"]
        assert hook.outcome == "failed" and not report.ok
        message = str(hook.error)
        assert message.startswith("certificate 'plain': OpenSSL refuses the new certificate")
        assert message.endswith(f"; keeping serial {first.serial_number:x}")
        assert message.count("certificate 'plain'") == 1
        assert cert.serial == first.serial_number
        assert served_certificate(port, trust).serial_number == first.serial_number
    assert cert.reload_if_changed() is False
    assert "OpenSSL refuses the new certificate" in cert.last_error
    assert cert.status()["serial"] == f"{first.serial_number:x}"
    assert served_certificate(port, trust).serial_number == first.serial_number


def test_an_issuer_url_with_credentials_never_shows_them(rehydrate_engine, ca_server, caplog):
    """``HTTPIssuer("https://user:pw@ca/sign?token=...")`` put the whole URL in its repr,
    every error, the log and status()."""
    url = ca_server.url.replace("http://", "http://user:PW-secret@") + "?token=T-secret"
    issuer = tls.HTTPIssuer(url, timeout=2.0)
    assert "secret" not in repr(issuer)
    cert = tls.issued("creds", issuer, common_name="localhost", engine=rehydrate_engine)
    ca_server.mode = "500"
    with caplog.at_level(logging.DEBUG, logger="rehydrate"):
        report = rehydrate_engine.simulate_restore()
    [hook] = [h for h in report.hooks if h.name == "rehydrate.tls:creds"]
    assert f"issuer {ca_server.url} answered HTTP 500" in str(hook.error)
    shown = "\n".join([str(hook.error), report.table(), caplog.text, repr(issuer),
                       json.dumps(rehydrate_engine.status().to_dict(), default=str)])
    assert "PW-secret" not in shown and "T-secret" not in shown
    cert.close()


def test_a_certificate_name_the_hooks_refuse_is_refused_before_a_key_is_made(
        rehydrate_engine):
    """It used to be stored without a restore hook: dropped before the snapshot, never
    renewed, and a second call returned it silently."""
    for _ in range(2):
        with pytest.raises(TypeError, match="certificate name must be a non-empty string"):
            tls.self_signed("a\nb", engine=rehydrate_engine)
    assert tls.manager(rehydrate_engine).get("a\nb") is None


@pytest.mark.parametrize("value", ["Bearer s3cr3t-TOKEN\n", "Bearer s3cr3t-TOKEN\r", "s3cr3t\0"])
def test_an_issuer_header_with_a_line_break_is_refused_without_its_value(value):
    """Before: accepted, then httpx refused to send it with a message quoting the value
    (a bearer token read from a file with its newline) — into the error, ``last_error``,
    ``status()``, the ERROR log line and the restore report."""
    with pytest.raises(ValueError) as caught:
        tls.HTTPIssuer("http://127.0.0.1:9/sign", headers={"Authorization": value})
    assert "s3cr3t" not in str(caught.value)
    assert str(caught.value).startswith("HTTPIssuer header 'Authorization': its value "
                                        "(not shown)")


# -- key passwords -------------------------------------------------------------------------


def _encrypted_leaf(ca: CA, password: bytes,
                    fmt: serialization.PrivateFormat = serialization.PrivateFormat.PKCS8
                    ) -> tuple[bytes, bytes, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = ca.sign(key.public_key())
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, fmt,
                              serialization.BestAvailableEncryption(password)), cert)


def _trusting(ca: CA) -> ssl.SSLContext:
    return ssl.create_default_context(cadata=ca.pem.decode())


def _pem_body_lines(pem: bytes) -> list[str]:
    return [ln.decode() for ln in pem.splitlines() if ln and not ln.startswith(b"-")
            and b":" not in ln]


@pytest.mark.parametrize("fmt", [serialization.PrivateFormat.PKCS8,
                                 serialization.PrivateFormat.TraditionalOpenSSL],
                         ids=["pkcs8", "traditional"])
@pytest.mark.parametrize("kind", ["secret", "callable"])
def test_a_secret_or_callable_key_password_is_read_again_after_a_restore(
        rehydrate_engine, tmp_path, https_server, kind, fmt):
    """The password is read when the key is loaded — at creation and again on restore,
    after the secret was wiped before the snapshot and reloaded — never kept between."""
    from rehydrate.secrets import Secret

    ca = CA()
    pw_file = tmp_path / "password"
    pw_file.write_bytes(b"first password")
    c1, k1, first = _encrypted_leaf(ca, b"first password", fmt)
    _write_pair(tmp_path, c1, k1)
    calls = []

    def read_password() -> bytearray:
        calls.append(1)
        return bytearray(pw_file.read_bytes())

    password = (Secret.from_file(pw_file, name="tls-pw", engine=rehydrate_engine)
                if kind == "secret" else read_password)
    cert = tls.from_files("enc", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                          password=password, watch=False, engine=rehydrate_engine)
    assert cert.serial == first.serial_number
    port = https_server(cert.server_context())
    assert served_certificate(port, _trusting(ca)).serial_number == first.serial_number

    # the platform rotated the key and its password while the process was frozen
    c2, k2, second = _encrypted_leaf(ca, b"second password", fmt)
    assert rehydrate_engine.simulate_snapshot().ok
    if kind == "secret":
        assert not password.available  # wiped before the snapshot
    _write_pair(tmp_path, c2, k2)
    pw_file.write_bytes(b"second password")
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.failed
    assert cert.serial == second.serial_number and not cert.key_dropped
    assert served_certificate(port, _trusting(ca)).serial_number == \
        second.serial_number
    if kind == "callable":
        assert len(calls) == 2  # creation, restore: read only when the key is loaded


def test_a_key_password_is_not_read_for_an_unencrypted_key(rehydrate_engine, tmp_path):
    ca = CA()
    c1, k1, first = ca.leaf()
    _write_pair(tmp_path, c1, k1)
    calls = []
    cert = tls.from_files("plain-key", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                          password=lambda: calls.append(1) or b"unused", watch=False,
                          engine=rehydrate_engine)
    assert cert.serial == first.serial_number and calls == []
    assert cert.material.key_buffer is not None  # loaded into contexts from a wiped buffer


@pytest.mark.parametrize("kind", ["bytes", "str", "bytearray"])
def test_a_plain_key_password_is_copied_kept_for_rereads_and_warned_about(
        rehydrate_engine, tmp_path, https_server, caplog, kind):
    import sys

    ca = CA()
    secret = os.urandom(12).hex()
    password = {"bytes": secret.encode(), "str": secret,
                "bytearray": bytearray(secret.encode())}[kind]
    c1, k1, first = _encrypted_leaf(ca, secret.encode())
    _write_pair(tmp_path, c1, k1)
    refs = sys.getrefcount(password)
    caplog.set_level(logging.INFO, logger="rehydrate")
    cert = tls.from_files("plain-pw", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                          password=password, watch=False, engine=rehydrate_engine)
    assert cert.serial == first.serial_number
    # the caller's object is not kept (rehydrate could not wipe it), nor changed
    assert sys.getrefcount(password) == refs
    assert password == {"bytes": secret.encode(), "str": secret,
                        "bytearray": bytearray(secret.encode())}[kind]
    assert cert._password is not None and not cert._password.spent  # rehydrate's copy
    assert secret not in repr(cert._password) and not hasattr(cert, "password")
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "in every snapshot image" in warning and "Secret or a callable" in warning

    # the copy re-reads a changed key file, and the key after a restore (no new warning)
    port = https_server(cert.server_context())
    c2, k2, second = _encrypted_leaf(ca, secret.encode())
    _write_pair(tmp_path, c2, k2)
    assert cert.reload_if_changed() is True
    assert served_certificate(port, _trusting(ca)).serial_number == second.serial_number
    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.simulate_restore().ok
    assert served_certificate(port, _trusting(ca)).serial_number == second.serial_number
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    # closed: the copy is wiped
    buf = cert._password._plain
    assert buf is not None
    cert.close()
    assert cert._password.spent and buf == bytearray(len(buf))
    assert all(secret not in r.getMessage() for r in caplog.records)


def _password_failures(ca: CA, password: bytes) -> dict[str, tuple[Callable[..., object],
                                                                   bytes, str]]:
    """case -> (password callable, key file, expected message). Each callable's own
    error text holds the password: it must not reach any message."""
    c_other, k_other, _ = _encrypted_leaf(ca, b"another password")
    _, k_good, _ = _encrypted_leaf(ca, password)
    lines = k_good.splitlines()
    broken = b"\n".join(lines[:2] + [b"A" * len(lines[2])] + lines[3:]) + b"\n"

    def raising() -> bytes:
        raise RuntimeError(f"vault said no to {password.decode()}")

    return {
        "wrong-password": (lambda: password, k_other, "wrong password"),
        "broken-key-file": (lambda: password, b"-----BEGIN ENCRYPTED PRIVATE KEY-----\n"
                            b"garbage\n-----END ENCRYPTED PRIVATE KEY-----\n",
                            "not a usable PEM private key"),
        "corrupted-key": (lambda: password, broken, "k.pem"),
        "raising-source": (raising, k_good, "key password callable failed: RuntimeError"),
        "wrong-type": (lambda: 42, k_good, "returned int, expected bytes"),
    }


@pytest.mark.parametrize("case", ["wrong-password", "broken-key-file", "corrupted-key",
                                  "raising-source", "wrong-type"])
def test_a_bad_password_or_key_file_is_one_line_and_keeps_the_previous_key(
        rehydrate_engine, tmp_path, https_server, caplog, case):
    ca = CA()
    password = os.urandom(12).hex().encode()
    c1, k1, first = _encrypted_leaf(ca, password)
    _write_pair(tmp_path, c1, k1)
    source = {"fn": lambda: password}

    def current_source() -> object:  # the vault: answers well first, then badly
        return source["fn"]()

    cert = tls.from_files("enc", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                          password=current_source, watch=False, engine=rehydrate_engine)
    port = https_server(cert.server_context())
    fn, key_pem, message = _password_failures(ca, password)[case]
    source["fn"] = fn
    (tmp_path / "k.pem").write_bytes(key_pem)
    forbidden = [password.decode(), *_pem_body_lines(key_pem), *_pem_body_lines(k1)]

    caplog.set_level(logging.WARNING, logger="rehydrate")
    assert cert.reload_if_changed() is False  # the watcher's path: one line, logged
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    with pytest.raises(CertificateError) as caught:  # renew(): the same line, raised
        cert.renew()
    error = str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__context__ is None
    for text in (line, error, cert.last_error):
        assert message in text and "\n" not in text, text
        assert not any(f in text for f in forbidden), text
    assert "keeping serial" in line
    assert cert.serial == first.serial_number and not cert.key_dropped
    assert served_certificate(port, _trusting(ca)).serial_number == first.serial_number

    # and at creation: the same one line, raised
    with pytest.raises(CertificateError, match=message) as caught:
        tls.from_files("enc-new", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                       password=fn, watch=False, engine=rehydrate_engine)
    assert "\n" not in str(caught.value)
    assert not any(f in str(caught.value) for f in forbidden)
    assert tls.manager(rehydrate_engine).get("enc-new") is None


def test_an_encrypted_key_without_a_password_is_one_line(rehydrate_engine, tmp_path):
    c1, k1, _ = _encrypted_leaf(CA(), b"pw")
    _write_pair(tmp_path, c1, k1)
    with pytest.raises(CertificateError, match="is encrypted and no password was given"):
        tls.from_files("enc", cert=tmp_path / "c.pem", key=tmp_path / "k.pem", watch=False,
                       engine=rehydrate_engine)


def test_a_key_password_of_the_wrong_kind_is_refused_before_anything_is_read(
        rehydrate_engine, tmp_path):
    from rehydrate.secrets import Secret
    from rehydrate.testing import isolated_engine

    c1, k1, _ = _encrypted_leaf(CA(), b"pw")
    _write_pair(tmp_path, c1, k1)
    with pytest.raises(TypeError, match="Secret, a callable returning bytes, or bytes"):
        tls.from_files("enc", cert=tmp_path / "c.pem", key=tmp_path / "k.pem", password=5,
                       watch=False, engine=rehydrate_engine)
    (tmp_path / "pw").write_bytes(b"pw")
    other = isolated_engine()
    try:
        foreign = Secret.from_file(tmp_path / "pw", engine=other)
        with pytest.raises(ValueError, match="belongs to another engine"):
            tls.from_files("enc", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                           password=foreign, watch=False, engine=rehydrate_engine)
    finally:
        other.close()
    assert tls.manager(rehydrate_engine).get("enc") is None


def test_an_unavailable_password_secret_fails_the_restore_in_one_line(rehydrate_engine,
                                                                      tmp_path):
    from rehydrate.secrets import Secret

    c1, k1, _ = _encrypted_leaf(CA(), b"pw")
    _write_pair(tmp_path, c1, k1)
    (tmp_path / "pw").write_bytes(b"pw")
    secret = Secret.from_file(tmp_path / "pw", name="tls-pw", engine=rehydrate_engine)
    cert = tls.from_files("enc", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                          password=secret, watch=False, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    (tmp_path / "pw").unlink()  # the clone's secret volume lacks the file
    report = rehydrate_engine.simulate_restore()
    errors = {r.name: str(r.error) for r in report.failed}
    assert set(errors) == {"rehydrate.secret:tls-pw", "rehydrate.tls:enc"}, errors
    assert "password for key file" in errors["rehydrate.tls:enc"]
    assert "secret 'tls-pw' is unavailable" in errors["rehydrate.tls:enc"]
    assert "\n" not in errors["rehydrate.tls:enc"] and cert.key_dropped


def _record_wipes(monkeypatch) -> list[str]:
    """The kind of every SecretSource wiped from now on."""
    from rehydrate.secrets import SecretSource

    wiped: list[str] = []
    real_wipe = SecretSource.wipe

    def spy(self: SecretSource) -> None:
        wiped.append(self.kind)
        real_wipe(self)

    monkeypatch.setattr(SecretSource, "wipe", spy)
    return wiped


def test_a_plain_key_password_is_wiped_when_the_first_load_fails(rehydrate_engine,
                                                                   tmp_path, monkeypatch):
    """An unreadable certificate file fails before the key is read: the certificate is
    not created, so the plain password's copy is wiped (no handle is left to close)."""
    wiped = _record_wipes(monkeypatch)
    _, k1, _ = _encrypted_leaf(CA(), b"pw")
    (tmp_path / "k.pem").write_bytes(k1)
    with pytest.raises(CertificateError, match="cannot read certificate file"):
        tls.from_files("enc", cert=tmp_path / "missing.pem", key=tmp_path / "k.pem",
                       password=bytearray(b"pw"), watch=False, engine=rehydrate_engine)
    assert wiped == ["plain"]


def test_a_plain_key_password_given_for_a_name_that_exists_is_wiped(rehydrate_engine,
                                                                    tmp_path, monkeypatch):
    """``from_files`` with a name already managed returns the existing handle: the new
    call's plain password has no handle to be closed with, so its copy is wiped at once."""
    wiped = _record_wipes(monkeypatch)
    ca = CA()
    c1, k1, _ = _encrypted_leaf(ca, b"pw")
    _write_pair(tmp_path, c1, k1)
    first = tls.from_files("dup", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                           password=b"pw", watch=False, engine=rehydrate_engine)
    assert wiped == []
    again = tls.from_files("dup", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                           password=bytearray(b"pw"), watch=False, engine=rehydrate_engine)
    assert again is first and wiped == ["plain"]  # the second call's copy, not the first's
    assert first._password is not None and not first._password.spent


def test_a_password_source_the_caller_shares_is_never_wiped_by_a_certificate(
        rehydrate_engine, tmp_path):
    """A ``SecretSource`` the application made may serve several certificates: closing
    one, or a second ``from_files`` with a name that exists, wiped it under the others
    (their next re-read of the key failed, the restore left a placeholder)."""
    from rehydrate.secrets import SecretSource

    ca = CA()
    shared = SecretSource(bytearray(b"pw"))
    pairs = {}
    for name in ("a", "b"):
        cert_pem, key_pem, _ = _encrypted_leaf(ca, b"pw")
        (tmp_path / name).mkdir()
        _write_pair(tmp_path / name, cert_pem, key_pem)
        pairs[name] = tls.from_files(name, cert=tmp_path / name / "c.pem",
                                     key=tmp_path / name / "k.pem", password=shared,
                                     watch=False, engine=rehydrate_engine)
    tls.from_files("a", cert=tmp_path / "a" / "c.pem", key=tmp_path / "a" / "k.pem",
                   password=shared, watch=False, engine=rehydrate_engine)
    pairs["a"].close()
    assert not shared.spent
    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.simulate_restore().ok  # b re-reads its key with the password
    assert not pairs["b"].key_dropped


@pytest.mark.parametrize(("timeout", "error", "shown"), [
    (10**400, ValueError, "1e+400"), (float("nan"), ValueError, "nan"),
    (0, ValueError, "0"), (True, TypeError, "bool"), ("5", TypeError, "str"),
])
def test_an_issuer_timeout_follows_the_seconds_rule(timeout, error, shown):
    """``HTTPIssuer(timeout=10**400)`` passed its "> 0 and finite" check and failed every
    ``issue()`` later with OverflowError; a huge one is refused at once, shown short."""
    with pytest.raises(error, match="HTTPIssuer timeout must be a number of seconds") as e:
        tls.HTTPIssuer("https://ca.example/sign", timeout=timeout)
    assert shown in str(e.value) and len(str(e.value)) < 200


def test_bundle_given_as_key_file_keeps_only_the_key_block(rehydrate_engine, tmp_path,
                                                           https_server):
    """A bundle.pem (certificate, then key) named as both files: only the key's PEM block is
    kept for re-loading contexts, so no load reads the certificates ahead of the key text
    (that path once left the key's text in freed heap), and the bundle still serves."""
    ca = CA()
    cert_pem, key_pem, leaf = ca.leaf()
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(cert_pem + key_pem)
    cert = tls.from_files("bundle", cert=bundle, key=bundle, watch=False,
                          engine=rehydrate_engine)
    try:
        kept = cert._material.key_buffer
        assert kept is not None and b"CERTIFICATE" not in kept
        assert bytes(kept).strip() == key_pem.strip()
        port = https_server(cert.server_context())
        assert served_certificate(port, unverified()).serial_number == leaf.serial_number
    finally:
        cert.close()


def test_the_key_block_is_copied_without_a_temporary(monkeypatch):
    """The block is copied view to view: a slice assignment from a memoryview would make
    an unwiped temporary bytearray of the whole block (one more copy of the key text)."""
    import ctypes
    import tracemalloc

    from rehydrate import tls as tls_module
    from rehydrate.tls import _key_block

    def wipe_in_place(buf: bytearray) -> None:  # measured apart: zeros are no key text
        ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), 0, len(buf))

    monkeypatch.setattr(tls_module, "wipe", wipe_in_place)

    size = 4 * 1024 * 1024
    data = bytearray(b"-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n"
                     b"-----BEGIN PRIVATE KEY-----\n" + b"A" * size
                     + b"\n-----END PRIVATE KEY-----\n")
    tracemalloc.start()
    try:
        block = _key_block(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert block.startswith(b"-----BEGIN PRIVATE KEY-----") and block.endswith(b"-----\n")
    assert not any(data)  # the whole read was wiped
    assert peak < 1.5 * size, f"peak {peak} bytes: a temporary copy of the {size}-byte block"


def test_a_wrong_password_that_decrypts_to_garbage_still_says_wrong_password(
        rehydrate_engine, tmp_path, monkeypatch):
    """About once in 256 wrong passwords the decrypted bytes end in valid padding, and
    cryptography reports a parse error of the inner key ("Could not deserialize key
    data ... ASN.1 parsing error") instead of a bad decrypt. The line must still name the
    password as a possible cause (before: only "not a usable PEM private key")."""
    ca = CA()
    password = os.urandom(12).hex().encode()
    c1, k1, first = _encrypted_leaf(ca, password)
    _write_pair(tmp_path, c1, k1)
    cert = tls.from_files("enc", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                          password=lambda: password, watch=False, engine=rehydrate_engine)
    _, k_other, _ = _encrypted_leaf(ca, b"another password")
    (tmp_path / "k.pem").write_bytes(k_other)

    def garbage_after_decrypt(data, password=None, **kw):  # what cryptography raises then
        raise ValueError("Could not deserialize key data. Details: ASN.1 parsing error: "
                         "unexpected tag")

    from cryptography.hazmat.primitives import serialization

    monkeypatch.setattr(serialization, "load_pem_private_key", garbage_after_decrypt)
    with pytest.raises(CertificateError) as caught:
        cert.renew()
    text = str(caught.value)
    assert "wrong password" in text and "not a usable PEM private key" in text, text
    assert cert.serial == first.serial_number


# -- recovery of a failed restore hook -------------------------------------------------


@pytest.mark.parametrize("retry", ["renew", "watcher", "next-restore"])
def test_a_listener_that_failed_to_take_the_certificate_recovers_when_it_takes_it(
        rehydrate_engine, tmp_path, https_server, retry):
    """A restore brought new files; the certificate is in use, but a listener — here one
    that puts it into a server context the application made itself — failed to take it,
    so the hook failed. Before, a re-read of the unchanged files called no listener:
    renew() and the watcher left the process degraded (only a change of the files or a
    manual recovered() helped) and the next restore said ok with that server still on
    the old certificate. Now every re-read calls the listeners that failed again, and
    once they all take it the hook counts as recovered."""
    ca = CA()
    c1, k1, first = ca.leaf()
    cert = _plain_file_cert(rehydrate_engine, tmp_path, c1, k1)
    app_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # not attached: the listener feeds it
    app_ctx.load_cert_chain(cert.cert_path, cert.key_path)
    port = https_server(app_ctx)
    client = ssl.create_default_context(cadata=ca.pem.decode())
    down = [True]

    def push(handle: tls.ManagedCertificate) -> None:
        if down[0]:
            raise OSError("the server is not taking certificates yet")
        app_ctx.load_cert_chain(cert.cert_path, cert.key_path)

    cert.subscribe(push)
    c2, k2, second = ca.leaf()
    _write_pair(tmp_path, c2, k2)
    report = rehydrate_engine.simulate_restore()
    [failed] = report.failed
    assert failed.name == "rehydrate.tls:plain" and "renewed but" in str(failed.error)
    assert cert.serial == second.serial_number and "not taking" in cert.last_error
    assert rehydrate_engine.status().state == "degraded"
    assert served_certificate(port, client).serial_number == first.serial_number

    def again() -> bool:
        """The retry under test; True when it reported success."""
        if retry == "renew":
            try:
                cert.renew()
            except CertificateError:
                return False
            return True
        if retry == "watcher":  # what a change in the directory runs
            cert.reload_if_changed()
            return cert.last_error is None
        return rehydrate_engine.simulate_restore().ok

    assert not again()  # the server still refuses: still degraded, and said why
    assert "not taking" in cert.last_error
    assert rehydrate_engine.status().state == "degraded"
    assert served_certificate(port, client).serial_number == first.serial_number
    down[0] = False
    assert again()
    assert cert.last_error is None and rehydrate_engine.status().state == "ready"
    assert rehydrate_engine.is_ready()
    assert served_certificate(port, client).serial_number == second.serial_number


def test_an_unsubscribed_failed_listener_is_not_called_again(rehydrate_engine, tmp_path):
    ca = CA()
    c1, k1, _ = ca.leaf()
    cert = _plain_file_cert(rehydrate_engine, tmp_path, c1, k1)
    calls = []

    def refuse(handle: tls.ManagedCertificate) -> None:
        calls.append(handle.serial)
        raise OSError("refused")

    cert.subscribe(refuse)
    c2, k2, second = ca.leaf()
    _write_pair(tmp_path, c2, k2)
    assert not rehydrate_engine.simulate_restore().ok
    cert.unsubscribe(refuse)  # the application gave that server up
    assert cert.renew().serial == second.serial_number
    assert calls == [second.serial_number]
    assert rehydrate_engine.status().state == "ready"


def test_a_renewal_does_not_clear_a_user_hook_that_shares_the_certificates_hook_name(
        rehydrate_engine):
    """recovered() went by name: every renewal of certificate "web" cleared the failure
    of a user hook named ``rehydrate.tls:web`` and made the process ready with it still
    broken. The manager now recovers its own hook by record."""
    cert = tls.self_signed("web", engine=rehydrate_engine)

    @rehydrate_engine.registry.after_restore(name="rehydrate.tls:web")
    def lookalike() -> None:
        raise ConnectionError("the user's own job failed")

    assert not rehydrate_engine.simulate_restore().ok
    cert.renew()
    assert rehydrate_engine.status().state == "degraded"
    assert rehydrate_engine.recovered("rehydrate.tls:web") is True
    assert rehydrate_engine.status().state == "ready"


def test_a_certificate_made_again_after_its_failed_one_was_closed_makes_the_process_ready(
        rehydrate_engine, https_server):
    """A listener failed to take the certificate at the restore; the application closed
    it and made it again under the same name, without that listener. Before, the failure
    held the closed certificate's hook record, which no renewal could name any more:
    degraded until the next restore. The new certificate's material in use — its first,
    here — now mends it; closing alone does not."""
    cert = tls.self_signed("web", engine=rehydrate_engine)

    def refuse(handle: tls.ManagedCertificate) -> None:
        raise OSError("the old server is gone")

    cert.subscribe(refuse)
    assert not rehydrate_engine.simulate_restore().ok
    cert.close()
    assert rehydrate_engine.status().state == "degraded"  # closing fixed nothing
    again = tls.self_signed("web", engine=rehydrate_engine)
    assert rehydrate_engine.status().state == "ready" and rehydrate_engine.is_ready()
    port = https_server(again.server_context())
    served = served_certificate(port, again.client_context())
    assert served.serial_number == again.serial
    assert rehydrate_engine.simulate_restore().ok


@pytest.mark.parametrize("retry", ["renew", "watcher"])
def test_a_file_certificate_recovers_when_its_unchanged_files_read_fine_again(
        rehydrate_engine, tmp_path, https_server, retry):
    """The key file was briefly unreadable at the restore: the hook failed "keeping
    serial ..." with the certificate in use. Before, re-reading the unchanged files
    (renew(), the watcher) said all was well (no error, renew() returned) but never
    recovered the hook, as no listener was pending: degraded until the next restore."""
    ca = CA()
    c1, k1, first = ca.leaf()
    cert = _plain_file_cert(rehydrate_engine, tmp_path, c1, k1)
    port = https_server(cert.server_context())
    client = ssl.create_default_context(cadata=ca.pem.decode())
    (tmp_path / "k.pem").rename(tmp_path / "k.tmp")
    [failed] = rehydrate_engine.simulate_restore().failed
    assert "keeping serial" in str(failed.error)
    assert rehydrate_engine.status().state == "degraded"
    (tmp_path / "k.tmp").rename(tmp_path / "k.pem")
    if retry == "renew":
        assert cert.renew().serial == first.serial_number
    else:
        assert cert.reload_if_changed() is False  # nothing new to apply
    assert cert.last_error is None
    assert rehydrate_engine.status().state == "ready" and rehydrate_engine.is_ready()
    assert served_certificate(port, client).serial_number == first.serial_number


def test_a_listener_retry_between_the_hook_failing_and_the_run_counting_it_is_not_lost(
        rehydrate_engine, tmp_path, monkeypatch):
    """A listener retry (here the watcher's) took the certificate after its restore hook
    raised but before the run counted the failure: its recovery found nothing to forget,
    and as it left no listener pending, no later renew() or re-read recovered the hook
    either. Such a retry is now followed by the next re-read of the files in use."""
    from rehydrate import _runner

    ca = CA()
    c1, k1, _ = ca.leaf()
    cert = _plain_file_cert(rehydrate_engine, tmp_path, c1, k1)
    calls = []

    def flaky(handle: tls.ManagedCertificate) -> None:
        calls.append(handle.serial)
        if len(calls) == 1:
            raise OSError("the server is busy")

    cert.subscribe(flaky)
    c2, k2, second = ca.leaf()
    _write_pair(tmp_path, c2, k2)
    told = _runner._tell_failed

    def in_the_window(on_failed, hook, result):  # type: ignore[no-untyped-def]
        if hook.name == "rehydrate.tls:plain":
            assert cert.reload_if_changed() is False  # the retry: it takes it now
            assert cert.last_error is None
        told(on_failed, hook, result)

    monkeypatch.setattr(_runner, "_tell_failed", in_the_window)
    report = rehydrate_engine.simulate_restore()
    assert not report.ok and report.recovered == ()
    assert calls == [second.serial_number] * 2
    assert rehydrate_engine.status().state == "degraded"  # counted after the retry
    assert cert.renew().serial == second.serial_number
    assert calls == [second.serial_number] * 2  # nobody left to call again
    assert rehydrate_engine.status().state == "ready"


def _refused_cert(engine, d):  # type: ignore[no-untyped-def]
    """A file certificate whose one listener always raises, and a CA for new files."""
    ca = CA()
    c1, k1, _ = ca.leaf()
    cert = _plain_file_cert(engine, d, c1, k1)

    def refuse(handle: tls.ManagedCertificate) -> None:
        raise OSError("not taking certificates")

    cert.subscribe(refuse)
    return cert, ca


def test_a_failing_listener_is_a_certificate_error_in_the_log_and_the_report(
        rehydrate_engine, tmp_path, caplog):
    """The failure showed the private class name ``_ListenersFailed`` in the engine's log
    line and in the report: greps and alerts on ``CertificateError`` missed it."""
    caplog.set_level(logging.WARNING, logger="rehydrate")
    cert, ca = _refused_cert(rehydrate_engine, tmp_path)
    _write_pair(tmp_path, *ca.leaf()[:2])
    report = rehydrate_engine.simulate_restore()
    [failed] = report.failed
    assert type(failed.error) is CertificateError
    assert type(report.error.exceptions[0]) is CertificateError
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "failed: CertificateError: certificate 'plain' renewed but: listener" in line
    assert cert.status()["error"].startswith("renewed but: listener")
    with pytest.raises(CertificateError) as raised:  # a retry: still failing
        cert.renew()
    assert type(raised.value) is CertificateError
    [failed] = rehydrate_engine.simulate_restore().failed
    assert type(failed.error) is CertificateError


def test_after_a_retry_that_renewed_nothing_the_error_names_the_serial_in_use(
        rehydrate_engine, tmp_path, caplog):
    """``status()`` said "renewed but: listener ..." after renew(), the watcher or a
    restore re-read unchanged files and called a failed listener again in vain."""
    cert, ca = _refused_cert(rehydrate_engine, tmp_path)
    c2, k2, second = ca.leaf()
    _write_pair(tmp_path, c2, k2)
    assert not rehydrate_engine.simulate_restore().ok
    still = f"serial {second.serial_number:x} in use, but still: listener"
    with pytest.raises(CertificateError, match=still):
        cert.renew()
    assert rehydrate_engine.status()["tls"]["plain"]["error"].startswith(still)
    caplog.set_level(logging.WARNING, logger="rehydrate")
    caplog.clear()
    assert cert.reload_if_changed() is False
    assert cert.status()["error"].startswith(still)
    [line] = [r.getMessage() for r in caplog.records]
    assert still in line and "renewed but" not in line
    [failed] = rehydrate_engine.simulate_restore().failed
    assert still in str(failed.error)
    assert cert.status()["error"].startswith(still)


def test_the_watcher_that_applied_new_files_says_so_when_a_listener_fails(
        rehydrate_engine, tmp_path, caplog):
    """reload_if_changed() applied the new files but returned False and logged that it
    was "keeping serial <the new serial>" when a listener failed to take them."""
    cert, ca = _refused_cert(rehydrate_engine, tmp_path)
    c2, k2, second = ca.leaf()
    _write_pair(tmp_path, c2, k2)
    caplog.set_level(logging.WARNING, logger="rehydrate")
    assert cert.reload_if_changed() is True
    assert cert.serial == second.serial_number
    assert cert.status()["error"].startswith("renewed but: listener")
    [line] = [r.getMessage() for r in caplog.records]
    assert f"reloaded from files (serial {second.serial_number:x}) but: listener" in line
    assert "keeping" not in line


# -- one name, two threads -----------------------------------------------------------------


class _Racer:
    """``fn`` in a thread of its own. :attr:`parked` is set once the call either ended or
    waits for the name (the manager's condition is wrapped to say so): the test then lets
    the first call go on, knowing where the second one stands — without a sleep."""

    def __init__(self, manager: tls.TLSManager, monkeypatch: pytest.MonkeyPatch,
                 fn: Callable[[], tls.ManagedCertificate]) -> None:
        self.parked = threading.Event()
        self.result: tls.ManagedCertificate | None = None
        self.hooks_at_return: tuple = ()
        self.error: BaseException | None = None
        idle, parked = getattr(manager, "_idle", None), self.parked

        class Signalling:
            def wait(self, timeout: float | None = None) -> bool:
                parked.set()
                assert idle is not None
                return idle.wait(timeout)

            def notify_all(self) -> None:
                assert idle is not None
                idle.notify_all()

        monkeypatch.setattr(manager, "_idle", Signalling(), raising=False)

        def run() -> None:
            try:
                self.result = fn()
                self.hooks_at_return = self.result._hooks  # what it was handed
            except BaseException as exc:  # noqa: BLE001 - inspected by the test
                self.error = exc
            finally:
                parked.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(10)
        assert not self.thread.is_alive()


def _blocking(monkeypatch, owner, attr: str, when=lambda *a, **kw: True):  # type: ignore[no-untyped-def]
    """Make ``owner.attr`` block the first call ``when`` accepts until ``release`` is
    set (``entered`` says it got there)."""
    entered, release = threading.Event(), threading.Event()
    original = getattr(owner, attr)

    def blocked(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not entered.is_set() and when(*args, **kwargs):
            entered.set()
            assert release.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, attr, blocked)
    return entered, release


def _tls_hooks(engine, name: str) -> list:  # type: ignore[no-untyped-def]
    return [h for h in engine.hooks("restore") if h.name == f"rehydrate.tls:{name}"]


def test_an_add_of_a_name_another_thread_is_adding_waits_for_the_set_up_handle(
        rehydrate_engine, monkeypatch):
    """The second add found the first one's handle stored and returned it at once, before
    its restore hook was registered (had the registration failed, it held a handle that
    would never be renewed). It now waits, and both callers get the same handle, set up."""
    m = tls.manager(rehydrate_engine)
    entered, release = _blocking(monkeypatch, rehydrate_engine.builtins, "register",
                                 lambda fn, **kw: kw.get("name") == "rehydrate.tls:web")
    first: list[tls.ManagedCertificate] = []
    adder = threading.Thread(target=lambda: first.append(
        tls.self_signed("web", engine=rehydrate_engine)), daemon=True)
    adder.start()
    assert entered.wait(10)  # its material is made, its hook not registered yet
    second = _Racer(m, monkeypatch, lambda: tls.self_signed("web", engine=rehydrate_engine))
    assert second.parked.wait(10)
    release.set()
    adder.join(10)
    second.join()
    assert second.error is None
    assert second.result is first[0] is m.get("web")
    assert second.hooks_at_return == tuple(_tls_hooks(rehydrate_engine, "web"))
    assert len(second.hooks_at_return) == 1
    serial = first[0].serial
    assert rehydrate_engine.simulate_restore().ok
    assert first[0].serial != serial  # renewed by its hook


def test_an_add_of_another_kind_under_a_name_being_added_is_refused_like_a_later_one(
        rehydrate_engine, monkeypatch, tmp_path):
    """A from_files() that finished while a self_signed() of the same name was still making
    its key won the name, and the self_signed() call returned the file certificate (it
    kept the type check only for a name that existed when it began). The name is now
    taken by the first call; the second is refused as it is when called afterwards."""
    m = tls.manager(rehydrate_engine)
    entered, release = _blocking(monkeypatch, tls.SelfSignedCertificate, "produce")
    first: list[object] = []
    adder = threading.Thread(target=lambda: first.append(
        tls.self_signed("web", engine=rehydrate_engine)), daemon=True)
    adder.start()
    assert entered.wait(10)  # inside its first renewal
    c, k, _ = CA().leaf()
    _write_pair(tmp_path, c, k)
    second = _Racer(m, monkeypatch, lambda: tls.from_files(
        "web", cert=tmp_path / "c.pem", key=tmp_path / "k.pem", watch=False,
        engine=rehydrate_engine))
    assert second.parked.wait(10)
    release.set()
    adder.join(10)
    second.join()
    assert type(first[0]) is tls.SelfSignedCertificate and m.get("web") is first[0]
    assert isinstance(second.error, ValueError)
    assert str(second.error) == "certificate 'web' already exists as self-signed"
    assert len(_tls_hooks(rehydrate_engine, "web")) == 1


def test_an_add_whose_set_up_fails_leaves_nothing_and_a_waiting_add_makes_its_own(
        rehydrate_engine, monkeypatch, tmp_path):
    """The watcher of a file certificate failed to start: the caller got the error, but
    the handle stayed stored with its hook — and a second add of the name, meanwhile,
    had been handed it, not watching. Now the failed one leaves nothing registered, and
    the waiting add makes (and watches) its own."""
    m = tls.manager(rehydrate_engine)
    c, k, _ = CA().leaf()
    _write_pair(tmp_path, c, k)
    entered, release = threading.Event(), threading.Event()
    start = tls.FileCertificate.start_watching

    def start_watching(self):  # type: ignore[no-untyped-def]
        if not entered.is_set():
            entered.set()
            assert release.wait(10)
            raise OSError(28, "inotify watch limit reached")
        start(self)

    monkeypatch.setattr(tls.FileCertificate, "start_watching", start_watching)

    def add() -> tls.FileCertificate:
        return tls.from_files("web", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                              engine=rehydrate_engine)

    failed: list[BaseException] = []
    made: list[tls.FileCertificate] = []

    def first() -> None:
        try:
            made.append(add())
        except OSError as exc:
            failed.append(exc)

    adder = threading.Thread(target=first, daemon=True)
    adder.start()
    assert entered.wait(10)
    second = _Racer(m, monkeypatch, add)
    assert second.parked.wait(10)
    release.set()
    adder.join(10)
    second.join()
    assert not made and len(failed) == 1 and "watch limit" in str(failed[0])
    handle = second.result
    assert isinstance(handle, tls.FileCertificate) and second.error is None
    try:
        assert handle._observer is not None  # watching
        assert m.get("web") is handle and m.certificates() == [handle]
        assert second.hooks_at_return == tuple(_tls_hooks(rehydrate_engine, "web"))
        assert len(second.hooks_at_return) == 1
    finally:
        handle.close()


def test_an_add_of_a_name_being_closed_makes_a_new_handle(rehydrate_engine, monkeypatch):
    """close() unregisters the hook, then frees the name: an add in between returned the
    handle being closed — never renewed after a restore, its key not dropped before a
    snapshot (it was no longer managed). The add now waits and makes a new one."""
    m = tls.manager(rehydrate_engine)
    old = tls.self_signed("web", engine=rehydrate_engine)
    [hook] = old._hooks
    entered, release = _blocking(monkeypatch, rehydrate_engine.builtins, "unregister",
                                 lambda h: h is hook)
    closer = threading.Thread(target=old.close, daemon=True)
    closer.start()
    assert entered.wait(10)
    second = _Racer(m, monkeypatch, lambda: tls.self_signed("web", engine=rehydrate_engine))
    assert second.parked.wait(10)
    release.set()
    closer.join(10)
    second.join()
    again = second.result
    assert second.error is None and again is not None and again is not old
    assert m.get("web") is again and _tls_hooks(rehydrate_engine, "web") == list(again._hooks)
    assert rehydrate_engine.simulate_snapshot().ok
    assert again.key_dropped


def test_an_encrypted_file_certificate_closed_during_its_restore_hook_leaves_the_run_ok(
        rehydrate_engine, monkeypatch, tmp_path):
    """close() of a file certificate wiped its key password before marking it closed: a
    restore hook reading the key file in that moment failed for want of the password,
    the handle not closed yet — a failed run, and the handle's certificate replaced by
    a placeholder. The password is now wiped once the handle is closed."""
    ca = CA()
    c, k, leaf = _encrypted_leaf(ca, b"pw")
    _write_pair(tmp_path, c, k)
    cert = tls.from_files("enc", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                          password=b"pw", watch=False, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    [hook] = cert._hooks
    reading, read = _blocking(monkeypatch, tls.FileCertificate, "produce")
    closing, closed = _blocking(monkeypatch, rehydrate_engine.builtins, "unregister",
                                lambda h: h is hook)
    report: list[object] = []
    restorer = threading.Thread(
        target=lambda: report.append(rehydrate_engine.simulate_restore()), daemon=True)
    closer = threading.Thread(target=cert.close, daemon=True)
    restorer.start()
    try:
        assert reading.wait(10)  # the hook is about to read the key file
        closer.start()
        assert closing.wait(10)  # close() is under way, its hook being unregistered
        read.set()
        restorer.join(30)
    finally:
        read.set()
        closed.set()
        restorer.join(30)
        closer.join(10)
    assert not closer.is_alive() and not restorer.is_alive()
    assert report[0].ok, report[0].failed  # type: ignore[attr-defined]
    assert rehydrate_engine.status().state == "ready"
    assert cert.certificate.serial_number == leaf.serial_number
    with pytest.raises(CertificateError, match="is closed: its private key was wiped"):
        _ = cert.private_key
    assert cert._password is not None and cert._password.spent


@pytest.mark.parametrize("password", [None, b"pw"])
def test_a_file_reload_outlived_by_close_is_dropped_quietly(rehydrate_engine, monkeypatch,
                                                            tmp_path, caplog, password):
    """The watcher's re-read of a handle closed meanwhile: apply() refused (and wiped) the
    key — or, the key encrypted, the read failed for the password close() wiped — and
    the watcher logged a warning and set ``last_error`` as for rejected files. Nothing
    went wrong: it is one INFO line."""
    c, k, _ = _encrypted_leaf(CA(), password) if password else CA().leaf()
    _write_pair(tmp_path, c, k)
    cert = tls.from_files("web", cert=tmp_path / "c.pem", key=tmp_path / "k.pem",
                          password=password, watch=False, engine=rehydrate_engine)
    reading, read = _blocking(monkeypatch, tls.FileCertificate, "produce")
    result: list[bool] = []
    reloader = threading.Thread(target=lambda: result.append(cert.reload_if_changed()),
                                daemon=True)
    caplog.clear()  # a plain password is warned about when the handle is made
    caplog.set_level(logging.INFO, logger="rehydrate")
    reloader.start()
    try:
        assert reading.wait(10)
        cert.close()
    finally:
        read.set()
        reloader.join(10)
    assert result == [False]
    assert cert.last_error is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "certificate web was closed: not reloaded" in caplog.text


def test_an_issuer_adding_its_own_certificate_again_is_an_error_not_a_hang(rehydrate_engine):
    """A name is added by one thread at a time; the thread adding it would wait for
    itself. It is one clear error instead."""
    class Reentrant:
        def issue(self, csr):  # type: ignore[no-untyped-def]
            tls.issued("web", self, common_name="localhost", engine=rehydrate_engine)
            raise AssertionError("not reached")

    errors: list[BaseException] = []

    def add() -> None:
        try:
            tls.issued("web", Reentrant(), common_name="localhost", engine=rehydrate_engine)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    t = threading.Thread(target=add, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive()
    [error] = errors
    assert isinstance(error, CertificateError)
    assert "certificate 'web' is already being added or closed by this thread" in str(error)
    assert tls.manager(rehydrate_engine).get("web") is None
    assert not _tls_hooks(rehydrate_engine, "web")


def test_an_interrupt_right_after_the_claim_leaves_the_name_free(rehydrate_engine,
                                                                monkeypatch):
    """A KeyboardInterrupt between add()'s claim of the name and the try/finally that
    released it (``frozen = self.frozen``) left the name busy for ever: every later add
    of it waited without a timeout (or, in the same thread, failed as re-entrant)."""
    m = tls.manager(rehydrate_engine)
    claim = tls.TLSManager._claim

    def claim_then_interrupt(self, name, *args):  # type: ignore[no-untyped-def]
        assert claim(self, name, *args) is None
        assert name in self._busy  # the name is claimed: now the interrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(tls.TLSManager, "_claim", claim_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        tls.self_signed("web", engine=rehydrate_engine)
    monkeypatch.undo()
    assert m._busy == {} and m.get("web") is None
    cert = tls.self_signed("web", engine=rehydrate_engine)  # neither waits nor fails
    assert m.get("web") is cert and m._busy == {}


def test_a_nested_add_that_fails_does_not_release_the_outer_claim(rehydrate_engine):
    """Released by the call's own token, not the thread: an issuer adding its own name
    again fails, and the name stays the outer add's until that one is done."""
    m = tls.manager(rehydrate_engine)
    during: list[object] = []

    class Reentrant:
        def issue(self, csr):  # type: ignore[no-untyped-def]
            outer = m._busy.get("web")
            with pytest.raises(RuntimeError, match="already being added"):
                tls.issued("web", self, common_name="localhost", engine=rehydrate_engine)
            during.append(outer is not None and m._busy.get("web") is outer)
            raise RuntimeError("issuer gave up")

    with pytest.raises(CertificateError):
        tls.issued("web", Reentrant(), common_name="localhost", engine=rehydrate_engine)
    assert during == [True]
    assert m._busy == {} and m.get("web") is None


@pytest.mark.parametrize("make", ["self_signed", "issued"])
def test_an_algorithm_that_cannot_sign_is_refused_up_front_in_one_line(rehydrate_engine,
                                                                       make):
    class NeverCalled:
        def issue(self, csr):
            raise AssertionError("no key, no CSR")

    with pytest.raises(CertificateError) as info:
        if make == "self_signed":
            tls.self_signed("x", algorithm="x25519", engine=rehydrate_engine)
        else:
            tls.issued("x", NeverCalled(), common_name="x", algorithm="x25519",
                       engine=rehydrate_engine)
    assert str(info.value) == (
        "certificate 'x': algorithm 'x25519' (a key-exchange algorithm: it cannot sign) "
        "cannot be used for a certificate; choose one of ec-p256, ec-p384, ed25519, "
        "rsa-2048, rsa-3072, rsa-4096")
    assert tls.manager(rehydrate_engine).get("x") is None
    with pytest.raises(CertificateError, match="algorithm 'bogus' cannot be used"):
        tls.self_signed("y", algorithm="bogus", engine=rehydrate_engine)


def test_an_issuer_error_quoting_a_url_token_shows_nowhere(rehydrate_engine, caplog):
    """A Vault-like issuer failing with ``403 … for url: …/sign/web?token=hvs.…``: the
    restore report and the log line left the query out, but ``last_error``,
    ``status()`` and the error :meth:`renew` raised still showed the token."""
    ca = CA()
    failing: list[bool] = []

    class Vault:
        def issue(self, csr):  # type: ignore[no-untyped-def]
            if failing:
                raise RuntimeError("403 Forbidden for url: "
                                   "https://vault:8200/v1/pki/sign/web?token=hvs.SECRETTOKEN")
            return ca.sign(csr.public_key()), [ca.cert]

    cert = tls.issued("web", Vault(), common_name="localhost", engine=rehydrate_engine)
    failing.append(True)
    caplog.set_level(logging.WARNING, logger="rehydrate")
    with pytest.raises(CertificateError) as caught:
        cert.renew()
    report = rehydrate_engine.simulate_restore()
    shown = "https://vault:8200/v1/pki/sign/web"
    assert str(caught.value) == f"RuntimeError: 403 Forbidden for url: {shown}"
    assert cert.last_error == str(caught.value)
    for where, text in {
            "renew()": "".join(traceback.format_exception(caught.value)),
            "last_error": cert.last_error,
            "status": json.dumps(rehydrate_engine.status().to_dict(), default=str),
            "report": json.dumps(report.to_dict()),
            "log": caplog.text}.items():
        assert "SECRETTOKEN" not in text, where
        assert shown in text, where

    # a listener failing the same way: the renewal's error and last_error leave it out
    @cert.subscribe
    def reload_proxy(_):  # type: ignore[no-untyped-def]
        raise RuntimeError("POST https://proxy/reload?token=hvs.SECRETTOKEN: 500")

    failing.clear()
    with pytest.raises(CertificateError) as caught:
        cert.renew()
    assert "SECRETTOKEN" not in str(caught.value) and "SECRETTOKEN" not in cert.last_error
    assert "RuntimeError: POST https://proxy/reload 500" in str(caught.value)
