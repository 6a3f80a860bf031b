"""No copy of a TLS private key is left in a live process after the before-snapshot pass
(issue #13.1): every TLS mode, a real handshake, then a scan of ``/proc/PID/mem``.

The child (tests/tls_memory_child.py) is made to draw a key this test knows; the scan
looks for the raw scalar (big-endian, as in DER/SEC1/PKCS#8), the scalar as OpenSSL's
BIGNUM words (little-endian on x86-64) and the base64 of the key's PEM. Where OpenSSL's
own decoders leave a copy that no caller can wipe, the allowance is counted here and
documented in docs/identity.md ("What stays in memory").
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from memscan import scan_child

HERE = Path(__file__).resolve().parent
P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551

# mode -> (child mode, key file format, allowed copies of the big-endian scalar)
MODES = {
    "self-signed": ("self-signed", None, 0),
    # Ed25519 goes in as PKCS#8 (OpenSSL takes no other form): its decoder now and then
    # leaves a freed copy of the 32-byte seed in the heap — 0 in 240 runs alone, 1 in 2
    # of 5 full-suite runs (the freed buffer not yet reused) — allowed 1, as documented.
    "self-signed-ed25519": ("self-signed-ed25519", None, 1),
    # a context detached from its only handle, which the before-snapshot pass skips
    "self-signed-detached": ("self-signed-detached", None, 0),
    "issued": ("issued", None, 0),
    "key-pem": ("key-pem", None, 0),
    "files-sec1": ("files", serialization.PrivateFormat.TraditionalOpenSSL, 0),
    # one bundle.pem given as both files (certificate and key in it): its certificate
    # read kept a copy of the key's text (a bytes copy for the parser) until wiped/parsed
    # by blocks; loading contexts from the whole bundle once left the key's text in
    # freed heap (CI), so only the key block is kept for them
    "files-bundle": ("files", serialization.PrivateFormat.TraditionalOpenSSL, 0),
    # OpenSSL's PKCS#8 decoders for EC keys (Python's ssl; cryptography's) free a decoded
    # copy without clearing it: measured 2, allowed 3, as documented.
    "files-pkcs8": ("files", serialization.PrivateFormat.PKCS8, 3),
}


def _key() -> ec.EllipticCurvePrivateKey:
    while True:
        v = int.from_bytes(os.urandom(32), "big")
        if 0 < v < P256_ORDER:
            return ec.derive_private_key(v, ec.SECP256R1())


def _pem_lines(key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey) -> list[bytes]:
    out = []
    formats = [serialization.PrivateFormat.PKCS8]
    if isinstance(key, ec.EllipticCurvePrivateKey):
        formats.append(serialization.PrivateFormat.TraditionalOpenSSL)
    for fmt in formats:
        pem = key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())
        out.append(pem.splitlines()[1])  # the first base64 line holds most of the scalar
    return out


@pytest.mark.parametrize("handshake", ["handshake", "no-handshake"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_no_private_key_left_in_memory_after_the_snapshot_pass(
        mode: str, handshake: str, tmp_path: Path) -> None:
    """With a handshake the key is really used; without one, the freed memory of the
    loads is not reused by it, so nothing a load left behind can be hidden."""
    child_mode, file_format, allowed = MODES[mode]
    key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
    if mode.endswith("ed25519"):  # the raw private key is the 32-byte seed itself
        scalar = os.urandom(32)
        key = ed25519.Ed25519PrivateKey.from_private_bytes(scalar)
    else:
        key = _key()
        scalar = key.private_numbers().private_value.to_bytes(32, "big")
    args = [sys.executable, str(HERE / "tls_memory_child.py"), child_mode, scalar.hex(),
            handshake]
    if file_format is not None:
        key_path, cert_path = tmp_path / "tls.key", tmp_path / "tls.crt"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, file_format,
                                               serialization.NoEncryption()))
        name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "localhost")])
        now = dt.datetime.now(dt.timezone.utc)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .sign(key, hashes.SHA256()))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if mode == "files-bundle":
            cert_path = key_path  # tls.key now holds the certificate, then the key
            key_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM)
                                 + key_path.read_bytes())
        args += [str(key_path), str(cert_path)]
    needles = {"scalar": scalar, "bignum": scalar[::-1]}
    needles.update({f"pem{i}": line for i, line in enumerate(_pem_lines(key))})
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}  # this checkout's rehydrate
    found = scan_child(args, needles, env=env, cwd=str(HERE.parent))
    assert found["bignum"] == [], f"a live or freed BIGNUM of the key: {found}"
    assert not any(found[k] for k in found if k.startswith("pem")), f"PEM text: {found}"
    assert len(found["scalar"]) <= allowed, f"{mode}: raw key copies {found['scalar']}"
