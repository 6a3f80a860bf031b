"""Attached server contexts are never changed once they serve: every renewal builds a
fresh context and new connections are moved to it (``rehydrate.tls._Swap``)."""

from __future__ import annotations

import datetime as dt
import functools
import gc
import os
import queue
import re
import socket
import ssl
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from rehydrate import Phase, tls

CHILD = Path(__file__).resolve().parent.parent / "tls_swap_child.py"


@pytest.mark.parametrize(("mode", "rounds", "handshakes"),
                         [("renew", 3000, 3000), ("restore", 1000, 3000)])
def test_renewals_while_a_threaded_server_handshakes_do_not_crash_it(mode, rounds,
                                                                      handshakes):
    env = dict(os.environ)
    root = str(CHILD.parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(CHILD), mode, str(rounds), str(handshakes)],
                          check=False, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert f"{mode} rounds" in proc.stdout


# -- in-process: what a moved connection keeps -----------------------------------------


def _self_signed_pem(key, cn: str) -> tuple[bytes, bytes, x509.Certificate]:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem, cert


def _write_self_signed(crt: Path, key: Path, private_key, cn: str) -> x509.Certificate:
    """A certificate for ``cn`` on ``private_key``, its PEM written to ``crt`` and the
    key's (unencrypted) to ``key``."""
    c, k, cert = _self_signed_pem(private_key, cn)
    crt.write_bytes(c)
    key.write_bytes(k)
    return cert


class Server:
    """A threaded TLS server on loopback: each connection reads one byte, answers
    ``ok`` and records what the handshake negotiated."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx = ctx
        self.seen: queue.Queue[tuple[str | None, bool]] = queue.Queue()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with self.ctx.wrap_socket(conn, server_side=True) as t:
                t.recv(1)
                self.seen.put((t.selected_alpn_protocol(), bool(t.getpeercert())))
                t.send(b"ok")
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


def client_ctx(*, alpn: list[str] | None = None, present: tls.Material | None = None,
               max_version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if alpn:
        ctx.set_alpn_protocols(alpn)
    if present is not None:
        tls.load_into(ctx, present)
    if max_version is not None:
        ctx.maximum_version = max_version
    return ctx


def handshake(port: int, ctx: ssl.SSLContext, *, sni: bool | str = True
              ) -> tuple[x509.Certificate, bytes]:
    """The certificate the server presented and what it answered (b"" when it dropped
    the connection after the handshake: a client certificate it required was missing).
    ``sni``: the server name sent (True: localhost, False: none)."""
    name = sni if isinstance(sni, str) else "localhost" if sni else None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, \
            ctx.wrap_socket(sock, server_hostname=name) as t:
        der = t.getpeercert(binary_form=True)
        try:
            t.send(b"x")
            answer = t.recv(2)
        except (ssl.SSLError, ConnectionError):
            answer = b""
    assert der is not None
    return x509.load_der_x509_certificate(der), answer


@pytest.fixture
def servers():
    made: list[Server] = []

    def start(ctx: ssl.SSLContext) -> Server:
        made.append(Server(ctx))
        return made[-1]

    yield start
    for s in made:
        s.close()


def test_a_key_type_change_is_served_after_renew_and_after_restore(rehydrate_engine,
                                                                   tmp_path, servers):
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    old = _write_self_signed(crt, key, ec.generate_private_key(ec.SECP256R1()), "old-ec")
    cert = tls.from_files("f", cert=crt, key=key, watch=False, engine=rehydrate_engine)
    srv = servers(cert.server_context())
    assert handshake(srv.port, client_ctx())[0] == old

    new = _write_self_signed(crt, key, rsa.generate_private_key(65537, 2048), "new-rsa")
    cert.renew()
    # OpenSSL keeps one certificate per key type in a context: the EC one used to stay
    # and be preferred by every client that accepts EC
    for ctx in (client_ctx(), client_ctx(max_version=ssl.TLSVersion.TLSv1_2)):
        assert handshake(srv.port, ctx)[0] == new

    rehydrate_engine.simulate_snapshot()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    for ctx in (client_ctx(), client_ctx(max_version=ssl.TLSVersion.TLSv1_2)):
        assert handshake(srv.port, ctx)[0] == new, "a placeholder or the old EC certificate"


def test_a_moved_connection_keeps_alpn_and_required_client_certificates(rehydrate_engine,
                                                                        servers):
    cert = tls.self_signed("web", engine=rehydrate_engine)
    client = tls.self_signed("client", engine=rehydrate_engine)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=client.material.trust_pem())
    cert.attach(ctx)
    srv = servers(ctx)
    for _ in range(2):  # as attached, and after a renewal (a fresh context)
        for sni in (True, False):  # OpenSSL calls the sni_callback without SNI too
            served, answer = handshake(
                srv.port, client_ctx(alpn=["http/1.1", "h2"], present=client.material),
                sni=sni)
            assert served.serial_number == cert.serial and answer == b"ok"
            assert srv.seen.get(timeout=10) == ("h2", True)
            served, answer = handshake(srv.port, client_ctx(), sni=sni)
            assert served.serial_number == cert.serial and answer == b""
        cert.renew()


def test_a_callback_set_before_attach_is_chained_and_one_set_after_is_put_back(
        rehydrate_engine, servers, caplog):
    cert = tls.self_signed("web", engine=rehydrate_engine)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    names: list[str | None] = []
    ctx.sni_callback = lambda sslobj, name, c: names.append(name)
    cert.attach(ctx)
    srv = servers(ctx)
    assert handshake(srv.port, client_ctx())[0].serial_number == cert.serial
    assert handshake(srv.port, client_ctx(), sni=False)[0].serial_number == cert.serial
    assert names == ["localhost", None]

    later: list[str | None] = []
    ctx.sni_callback = lambda sslobj, name, c: later.append(name)  # replaces rehydrate's
    served = handshake(srv.port, client_ctx())[0]
    assert "placeholder" in served.subject.rfc4514_string()  # ctx's own, never a real key
    with caplog.at_level("WARNING", logger="rehydrate"):
        cert.renew()
        cert.renew()
    assert caplog.text.count("sni_callback of an attached server context was replaced") == 1
    assert handshake(srv.port, client_ctx())[0].serial_number == cert.serial
    assert later == ["localhost", "localhost"]


def test_a_certificate_openssl_refuses_leaves_every_context_serving(rehydrate_engine,
                                                                   tmp_path, servers):
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    first = _write_self_signed(crt, key, ec.generate_private_key(ec.SECP256R1()), "first")
    cert = tls.from_files("f", cert=crt, key=key, watch=False, engine=rehydrate_engine)
    a, b = servers(cert.server_context()), servers(cert.server_context())
    _write_self_signed(crt, key, rsa.generate_private_key(65537, 1024), "weak")
    with pytest.raises(tls.CertificateError, match="OpenSSL refuses the new certificate"):
        cert.renew()
    for srv in (a, b):
        assert handshake(srv.port, client_ctx())[0] == first


def test_the_fresh_context_shares_the_trust_store_of_the_attached_one(rehydrate_engine,
                                                                     servers):
    cert = tls.self_signed("web", engine=rehydrate_engine)
    client = tls.self_signed("client", engine=rehydrate_engine)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_mode = ssl.CERT_REQUIRED
    cert.attach(ctx)
    srv = servers(ctx)
    presenting = client_ctx(present=client.material)
    assert handshake(srv.port, presenting)[1] == b""  # nobody trusted yet
    # loaded after attach, before any renewal: the very store, not a copy made at attach
    ctx.load_verify_locations(cadata=client.material.trust_pem())
    assert handshake(srv.port, presenting)[1] == b"ok"
    assert srv.seen.get(timeout=10) == (None, True)


# RFC 7919-sized (2048-bit) DH parameters: public, made once with `openssl dhparam`
DH_PARAMS = b"""-----BEGIN DH PARAMETERS-----
MIIBCAKCAQEAxLQV6fDSv384BN9OD7nLXj88JFPyaHPQYHspKkzxkN2TKSd5fiqT
/y1NjJ5/B4K3tnvCqRTFrHqkfQnV2vM3bqgfUiS85fy6VcTeuoQ/lRDhVRqwAh9Y
uC1tmurYWsnq2RodjeQN5Uqv/AFDoaRQDzL8khBL4at+uHCSo67cS+eT7Lkfw2OB
vWskxtcJ8q+k7TPd3XaNqrpTmXNep58QfQ3lOH45NV4tHkTAt9oypOFhf4yy0yhF
2xFlVAXkx2AE3gATVVuxpEI3Z9aJY/xZiTH541KMBAeXWnqWAQaN72GOzaJGgic9
jYgROHSSEzxkvzBS94lIj4J9WjPK7ljlPwIBAg==
-----END DH PARAMETERS-----
"""


def test_a_dhe_only_server_still_negotiates_dhe(rehydrate_engine, tmp_path, servers):
    dh = tmp_path / "dh.pem"
    dh.write_bytes(DH_PARAMS)
    cert = tls.self_signed("web", algorithm="rsa-2048", engine=rehydrate_engine)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_dh_params(str(dh))  # not carried over: moving a connection replaces them
    ctx.set_ciphers("DHE-RSA-AES128-GCM-SHA256")
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    cert.attach(ctx)
    srv = servers(ctx)
    client = client_ctx(max_version=ssl.TLSVersion.TLSv1_2)
    client.set_ciphers("DHE-RSA-AES128-GCM-SHA256")
    for _ in range(2):  # as attached, and after a renewal
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock, \
                client.wrap_socket(sock, server_hostname="localhost") as t:
            assert t.cipher()[0] == "DHE-RSA-AES128-GCM-SHA256"
            served = x509.load_der_x509_certificate(t.getpeercert(binary_form=True))
            assert served.serial_number == cert.serial
            t.send(b"x")
            assert t.recv(2) == b"ok"
        cert.renew()


# -- several certificates on one listener (SNI) ------------------------------------------

DOCS = Path(__file__).resolve().parent.parent.parent / "docs" / "identity.md"


def _sni_recipe() -> str:
    """The code block of the SNI recipe in docs/identity.md, as documented."""
    text = DOCS.read_text()
    at = text.index("**Several certificates on one listener (SNI)**")
    block = re.search(r"```python\n(.*?)```", text[at:], re.S)
    assert block is not None
    return "\n".join(line.removeprefix("  ") for line in block.group(1).splitlines())


def test_the_sni_recipe_in_the_docs_serves_each_current_certificate(
        rehydrate_engine, servers, monkeypatch):
    monkeypatch.setattr(tls, "self_signed",
                        functools.partial(tls.self_signed, engine=rehydrate_engine))
    scope: dict[str, object] = {}
    exec(compile(_sni_recipe(), str(DOCS), "exec"), scope)  # noqa: S102
    api, web = scope["api"], scope["web"]
    assert isinstance(api, tls.ManagedCertificate)
    assert isinstance(web, tls.ManagedCertificate)
    front = scope["front"]
    assert isinstance(front, ssl.SSLContext)
    srv = servers(front)
    for round_ in range(3):  # as set up, after renew(), after a snapshot and restore
        for sni, handle in (("api.example", api), ("www.example", web), (False, web)):
            served, answer = handshake(srv.port, client_ctx(alpn=["h2"]), sni=sni)
            assert served.serial_number == handle.serial, (round_, sni)
            assert answer == b"ok"
            assert srv.seen.get(timeout=10) == ("h2", False)
        if round_ == 0:
            api.renew()
            web.renew()
        else:
            rehydrate_engine.simulate_snapshot()
            report = rehydrate_engine.simulate_restore()
            assert report.ok, report.table()


def test_a_plain_front_context_hands_out_the_current_server_context(
        rehydrate_engine, servers, tmp_path):
    api = tls.self_signed("api", engine=rehydrate_engine)
    kept = api.server_context()
    own = _write_self_signed(tmp_path / "c.pem", tmp_path / "k.pem",
                             ec.generate_private_key(ec.SECP256R1()), "front's own")
    front = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # never attached
    front.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")

    def pick(sslsock, name, listening):
        if name == "api":
            sslsock.context = api.current_server_context()
        elif name == "kept":
            sslsock.context = kept  # an attached context: OpenSSL never runs its callback

    front.sni_callback = pick
    srv = servers(front)
    for _ in range(2):
        assert handshake(srv.port, client_ctx(), sni="api")[0].serial_number == api.serial
        assert handshake(srv.port, client_ctx(), sni="other")[0] == own
        served = handshake(srv.port, client_ctx(), sni="kept")[0]
        assert "placeholder" in served.subject.rfc4514_string()  # as documented
        api.renew()
    with pytest.raises(ValueError, match="not attached"):
        api.current_server_context(front)


def test_a_connection_moved_to_another_attached_context_presents_its_certificate(
        rehydrate_engine, servers):
    web = tls.self_signed("web", engine=rehydrate_engine)
    api = tls.self_signed("api", engine=rehydrate_engine)
    api_ctx = api.server_context()

    def pick(sslsock, name, listening):
        if name == "api":
            sslsock.context = api_ctx  # attached: rehydrate moves it on to api's current

    front = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    front.sni_callback = pick
    web.attach(front)
    srv = servers(front)
    for _ in range(2):  # as attached, and after a renewal of each
        assert handshake(srv.port, client_ctx(), sni="api")[0].serial_number == api.serial
        assert handshake(srv.port, client_ctx(), sni="web")[0].serial_number == web.serial
        api.renew()
        web.renew()


def _tls12_client(cipher: str) -> ssl.SSLContext:
    """A TLS 1.2 client offering ``cipher`` alone (TLS 1.3 suites cannot pick a key
    type): the server must present the certificate of that key type."""
    c = client_ctx(max_version=ssl.TLSVersion.TLSv1_2)
    c.set_ciphers(cipher)
    return c


def _ecdsa_and_rsa_on_one_context(engine, servers):
    """An ECDSA and an RSA self-signed handle both attached to one server context, and a
    server on it: ``(ecdsa, rsa_, ctx, srv)``."""
    ecdsa = tls.self_signed("ec", engine=engine)
    rsa_ = tls.self_signed("rsa", algorithm="rsa-2048", engine=engine)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ecdsa.attach(ctx)
    rsa_.attach(ctx)
    return ecdsa, rsa_, ctx, servers(ctx)


def test_an_rsa_and_an_ecdsa_certificate_attached_to_one_context_are_both_served(
        rehydrate_engine, servers):
    ecdsa, rsa_, ctx, srv = _ecdsa_and_rsa_on_one_context(rehydrate_engine, servers)
    for round_ in range(4):  # attached; each renewed in turn; after a snapshot and restore
        served, answer = handshake(srv.port, _tls12_client("ECDHE-ECDSA-AES128-GCM-SHA256"))
        assert served.serial_number == ecdsa.serial and answer == b"ok", round_
        served, answer = handshake(srv.port, _tls12_client("ECDHE-RSA-AES128-GCM-SHA256"))
        assert served.serial_number == rsa_.serial and answer == b"ok", round_
        if round_ == 0:
            ecdsa.renew()
        elif round_ == 1:
            rsa_.renew()
        else:
            rehydrate_engine.simulate_snapshot()
            report = rehydrate_engine.simulate_restore()
            assert report.ok, report.table()
    rsa_.detach(ctx)
    for _ in range(2):  # the detached certificate goes at once, not at the next rebuild
        served, _ = handshake(srv.port, client_ctx())
        assert served.serial_number == ecdsa.serial
        with pytest.raises(ssl.SSLError):
            handshake(srv.port, _tls12_client("ECDHE-RSA-AES128-GCM-SHA256"))
        ecdsa.renew()


def _rsa_only() -> ssl.SSLContext:
    return _tls12_client("ECDHE-RSA-AES128-GCM-SHA256")


def test_a_closed_certificate_is_no_longer_served_by_a_shared_context(rehydrate_engine,
                                                                       servers):
    """close() used to leave the handle's material in the shared context's swap: an
    RSA-only client kept getting the closed RSA certificate — after close, during the
    before-snapshot window (so its key went into the image, no hook dropping it), and
    after a restore and a renewal of the other handle."""
    ecdsa, rsa_, ctx, srv = _ecdsa_and_rsa_on_one_context(rehydrate_engine, servers)
    assert handshake(srv.port, _rsa_only())[0].serial_number == rsa_.serial
    rsa_.close()

    def served_alone() -> None:
        with pytest.raises(ssl.SSLError):  # the context has no RSA certificate left
            handshake(srv.port, _rsa_only())
        served, answer = handshake(srv.port, client_ctx())
        assert served.serial_number == ecdsa.serial and answer == b"ok"

    served_alone()
    assert rehydrate_engine.simulate_snapshot().ok
    with pytest.raises(ssl.SSLError):
        handshake(srv.port, _rsa_only())
    assert rehydrate_engine.simulate_restore().ok
    ecdsa.renew()
    served_alone()
    assert list(tls._swap_of(ctx).materials) == [ecdsa]
    with pytest.raises(tls.CertificateError, match="is closed: its private key was wiped"):
        _ = rsa_.private_key  # nothing would drop it before a snapshot
    with pytest.raises(tls.CertificateError, match="is closed"):
        rsa_.client_context(present=True)
    with pytest.raises(tls.CertificateError, match="'rsa' is closed"):
        rsa_.renew()
    with pytest.raises(tls.CertificateError, match="is closed; the renewed key"):
        rsa_.apply(rsa_.produce())  # a renewal that outlived close() keeps no key


def test_a_context_only_a_closed_certificate_served_presents_its_placeholder(
        rehydrate_engine, servers):
    cert = tls.self_signed("web", engine=rehydrate_engine)
    ctx = cert.server_context()
    client = cert.client_context(present=True)
    srv = servers(ctx)
    assert handshake(srv.port, client_ctx())[0].serial_number == cert.serial
    cert.close()
    served, answer = handshake(srv.port, client_ctx())
    assert served.serial_number != cert.serial and answer == b"ok"
    assert "placeholder" in served.subject.rfc4514_string()
    assert tls._swap_of(ctx).materials == {} and tls._swap_of(ctx).current is None
    again = tls.self_signed("web", engine=rehydrate_engine)  # a handle made again
    again.attach(ctx)
    assert handshake(srv.port, client_ctx())[0].serial_number == again.serial
    del client


@pytest.mark.parametrize("when", ["running", "queued"])
def test_a_certificate_closed_while_its_restore_hook_runs_leaves_the_run_ok(
        rehydrate_engine, servers, monkeypatch, when):
    """close() during a restore run that had this handle's hook running (an issuer slow
    to answer) or queued: apply() refused the renewed key, which the hook took for a
    failed renewal — the run failed, the engine stayed degraded (the hook gone, nothing
    to mend it) and the handle's certificate became unreadable (a placeholder put in
    its place). A closed handle has nothing to renew: the hook returns quietly."""
    cert = tls.self_signed("web", engine=rehydrate_engine)
    srv = servers(cert.server_context())
    assert handshake(srv.port, client_ctx())[0].serial_number == cert.serial
    closed_serial = cert.serial
    assert rehydrate_engine.simulate_snapshot().ok
    waiting, go = threading.Event(), threading.Event()
    made: list[tls.Material] = []
    produce = tls.SelfSignedCertificate.produce

    def slow_produce(self: tls.SelfSignedCertificate) -> tls.Material:
        if when == "running":
            waiting.set()
            assert go.wait(10)
        made.append(produce(self))
        return made[-1]

    monkeypatch.setattr(tls.SelfSignedCertificate, "produce", slow_produce)
    if when == "queued":  # a hook run before the certificate's own (order 100)
        def before() -> None:
            waiting.set()
            assert go.wait(10)

        rehydrate_engine.registry.after_restore(phase=Phase.SECRETS, order=99,
                                                name="test.before-web")(before)
    report: list[object] = []
    restorer = threading.Thread(
        target=lambda: report.append(rehydrate_engine.simulate_restore()), daemon=True)
    restorer.start()
    try:
        assert waiting.wait(10)
        cert.close()
    finally:
        go.set()
        restorer.join(30)
    assert not restorer.is_alive()
    assert report[0].ok, report[0].failed  # type: ignore[attr-defined]
    assert rehydrate_engine.status().state == "ready"
    assert cert.serial == closed_serial and cert.last_error is None
    assert cert.certificate.serial_number == closed_serial
    with pytest.raises(tls.CertificateError, match="is closed: its private key was wiped"):
        _ = cert.private_key
    if when == "running":  # the key made while it was closed is wiped, never served
        assert len(made) == 1 and made[0].key_buffer is not None
        assert not any(made[0].key_buffer)
    else:
        assert made == []  # not even made
    served, answer = handshake(srv.port, client_ctx())
    assert "placeholder" in served.subject.rfc4514_string() and answer == b"ok"
    assert not made or served.serial_number != made[0].serial


def test_closed_certificates_do_not_pile_up_in_a_shared_context(rehydrate_engine):
    """Each handle made again under a name and attached to a long-lived context stayed in
    its swap after close(): every later renewal built contexts loading all of them."""
    keep = tls.self_signed("keep", engine=rehydrate_engine)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    keep.attach(ctx)
    for _ in range(20):
        rotated = tls.self_signed("rot", engine=rehydrate_engine)
        rotated.attach(ctx)
        assert len(tls._swap_of(ctx).materials) == 2
        rotated.close()
    assert list(tls._swap_of(ctx).materials) == [keep]
    keep.renew()
    assert list(tls._swap_of(ctx).materials) == [keep]


def _spki(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)


def test_a_context_detached_from_its_only_certificate_never_serves_that_key_again(
        rehydrate_engine, servers):
    """detach() used to leave the context presenting the handle's last material; the
    before-snapshot pass visits only attached contexts, so that key went into the image
    and every clone presented it."""
    cert = tls.self_signed("web", engine=rehydrate_engine)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert.attach(ctx)
    srv = servers(ctx)
    assert handshake(srv.port, client_ctx())[0].serial_number == cert.serial
    detached = {_spki(cert.certificate)}
    cert.detach(ctx)

    def placeholder_served() -> None:
        for _ in range(3):
            served, answer = handshake(srv.port, client_ctx())
            assert _spki(served) not in detached and answer == b"ok"
            assert "placeholder" in served.subject.rfc4514_string()

    placeholder_served()
    assert rehydrate_engine.simulate_snapshot().ok
    placeholder_served()  # what the image would hold
    assert rehydrate_engine.simulate_restore().ok
    detached.add(_spki(cert.certificate))  # renewed on restore: not followed by ctx
    placeholder_served()
    cert.renew()
    detached.add(_spki(cert.certificate))
    placeholder_served()
    assert tls._swap_of(ctx).materials == {} and tls._swap_of(ctx).current is None
    cert.attach(ctx)  # attached again: presents the certificate in use
    assert handshake(srv.port, client_ctx())[0].serial_number == cert.serial
    other = tls.self_signed("other", engine=rehydrate_engine)
    other.attach(ctx)  # the documented switch: attach the new one first, then detach
    cert.detach(ctx)
    assert handshake(srv.port, client_ctx())[0].serial_number == other.serial


def test_attached_contexts_referring_back_to_themselves_are_freed(rehydrate_engine):
    cert = tls.self_signed("web", engine=rehydrate_engine)

    class App:
        def __init__(self) -> None:
            self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.ctx.sni_callback = self.pick  # the context -> callback -> app -> context
            cert.attach(self.ctx)

        def pick(self, sslobj, name, ctx):
            return None

    gone = []
    for _ in range(5):
        app = App()
        weakref.finalize(app.ctx, gone.append, True)
        del app
    gc.collect()
    assert len(gone) == 5
    assert len(cert._served) == 0
