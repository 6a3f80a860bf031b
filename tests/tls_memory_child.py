"""Child process for tests/test_tls_memory.py: set up one TLS mode, serve one real
handshake, run the before-snapshot pass, then wait to be scanned.

argv: MODE SCALAR_HEX handshake|no-handshake [KEY_FILE CERT_FILE]. The first 32-byte
key rehydrate draws from the kernel is made to be SCALAR (parsed digit by digit into a
bytearray that is wiped after use, so the only copies left are rehydrate's and OpenSSL's).
"""

from __future__ import annotations

import gc
import socket
import ssl
import sys
import threading

import rehydrate
from rehydrate import keys, tls

mode, scalar_hex, handshake = sys.argv[1], sys.argv[2], sys.argv[3] == "handshake"
seed = bytearray(32)
if mode != "files":  # there the key comes from the file: every key drawn is a new one
    for i in range(32):
        seed[i] = int(scalar_hex[2 * i:2 * i + 2], 16)
real_urandom_into = keys.urandom_into


def seeded_once(buf: bytearray) -> None:
    if len(buf) == 32 and any(seed):
        buf[:] = seed
        seed[:] = bytes(32)
        return
    real_urandom_into(buf)


keys.urandom_into = seeded_once  # type: ignore[assignment]


class LocalIssuer:
    """An issuer that signs CSRs with its own CA key (a stand-in for a CA behind HTTP)."""

    def __init__(self) -> None:
        import datetime as dt

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "test CA")])
        now = dt.datetime.now(dt.timezone.utc)
        self.ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(self.key.public_key()).serial_number(1)
                   .not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                   .sign(self.key, hashes.SHA256()))
        self.trust = (self.ca,)

    def issue(self, csr):  # type: ignore[no-untyped-def]
        import datetime as dt

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes

        now = dt.datetime.now(dt.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(csr.subject)
                .issuer_name(self.ca.subject).public_key(csr.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=1))
                .not_valid_after(now + dt.timedelta(days=1))
                .sign(self.key, hashes.SHA256()))
        return cert, [self.ca]


if mode in ("self-signed", "key-pem", "self-signed-detached"):
    cert = tls.self_signed("web")
elif mode == "self-signed-ed25519":
    cert = tls.self_signed("web", algorithm="ed25519")
elif mode == "issued":
    cert = tls.issued("web", LocalIssuer(), common_name="localhost", sans=["localhost"])
elif mode == "files":
    cert = tls.from_files("web", key=sys.argv[4], cert=sys.argv[5], watch=False)
else:
    raise SystemExit(f"unknown mode {mode}")

server_ctx = cert.server_context()
if mode == "key-pem":  # an application handing the PEM on, then wiping its copy
    pem = cert.material.key_pem()
    if isinstance(pem, bytearray):
        pem[:] = bytes(len(pem))
    del pem
client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
client_ctx.check_hostname = False
client_ctx.verify_mode = ssl.CERT_NONE  # the handshake is here to make the server sign

listener = socket.create_server(("127.0.0.1", 0))
port = listener.getsockname()[1]


def serve() -> None:
    conn, _ = listener.accept()
    with server_ctx.wrap_socket(conn, server_side=True) as tls_conn:
        tls_conn.sendall(tls_conn.recv(16))


if handshake:
    t = threading.Thread(target=serve)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as raw, \
            client_ctx.wrap_socket(raw, server_hostname="localhost") as c:
        c.sendall(b"ping")
        assert c.recv(16) == b"ping"
    t.join()
listener.close()
if mode == "self-signed-detached":  # the before-snapshot pass visits attached contexts
    cert.detach(server_ctx)

report = rehydrate.simulate_snapshot()
assert report.ok and cert.key_dropped, report
del client_ctx
gc.collect()
print("ready", flush=True)
sys.stdin.readline()  # scanned now; then exit
