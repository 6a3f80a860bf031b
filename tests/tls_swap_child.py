"""Child process for tests/managers/test_tls_swap.py: a threaded TLS server handshaking
with clients in a loop (half of them sending no server name) while its certificate is
renewed (``renew``) or snapshot+restore cycles run (``restore``).

argv: MODE ROUNDS HANDSHAKES. Exits 0 once at least ROUNDS renewals (or cycles) ran and
HANDSHAKES handshakes succeeded meanwhile, and a last handshake presents the certificate
in use; a crash of the process (what changing a serving context did) is its exit code.
"""

from __future__ import annotations

import socket
import ssl
import sys
import threading

from cryptography import x509

from rehydrate import tls
from rehydrate.testing import isolated_engine

mode, rounds, wanted = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = isolated_engine()
cert = tls.self_signed("swap", engine=engine)
server_ctx = cert.server_context()
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(128)
port = listener.getsockname()[1]
done = threading.Event()
lock = threading.Lock()
handshakes = [0]


def handle(conn: socket.socket) -> None:
    try:
        with server_ctx.wrap_socket(conn, server_side=True) as tls_conn:
            tls_conn.recv(1)
    except OSError:
        pass
    finally:
        conn.close()


def serve() -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def client_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def served(sni: bool) -> x509.Certificate:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, \
            client_context().wrap_socket(
                sock, server_hostname="localhost" if sni else None) as tls_conn:
        der = tls_conn.getpeercert(binary_form=True)
        tls_conn.send(b"x")
    assert der is not None
    return x509.load_der_x509_certificate(der)


def client(sni: bool) -> None:
    while not done.is_set():
        try:
            served(sni)
        except OSError:
            continue
        with lock:
            handshakes[0] += 1


threading.Thread(target=serve, daemon=True).start()
clients = [threading.Thread(target=client, args=(i % 2 == 0,), daemon=True)
           for i in range(4)]
for t in clients:
    t.start()
n = 0
while n < rounds or handshakes[0] < wanted:
    if mode == "renew":
        cert.renew()
    else:
        engine.simulate_snapshot()
        report = engine.simulate_restore()
        assert report.ok, report.table()
    n += 1
done.set()
for t in clients:
    t.join()
for sni in (True, False):
    assert served(sni).serial_number == cert.serial, "a handshake presented another certificate"
print(f"{n} {mode} rounds, {handshakes[0]} handshakes", flush=True)
