"""A TLS key file's password is not left in a live process: after the key is loaded (a
callable password; a plain one only as rehydrate's own copy, which it keeps to re-read the
key after a restore), and after the before-snapshot pass (a ``Secret`` too). The child
(tests/tls_password_child.py) loads an encrypted key file with the password given one way;
its ``/proc/PID/mem`` is scanned at each stage.

A copy found is one a snapshot image would hold, and every clone restored from it.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from memscan import count

HERE = Path(__file__).resolve().parent

# kind -> copies of the password (after the load, after the before-snapshot pass)
KINDS = {
    "secret": (1, 0),  # the Secret's own buffer, until the before-snapshot pass
    "callable": (0, 0),
    "bytes": (1, 1),  # rehydrate's own copy, kept to re-read the key after the restore
    "str": (1, 1),
}
FORMATS = {"pkcs8": serialization.PrivateFormat.PKCS8,
           "traditional": serialization.PrivateFormat.TraditionalOpenSSL}


def _files(tmp_path: Path, fmt: serialization.PrivateFormat) -> tuple[Path, Path, Path,
                                                                       bytes]:
    password = secrets.token_urlsafe(24).encode()  # 32 ASCII characters
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    key_path, cert_path, pw_path = (tmp_path / "tls.key", tmp_path / "tls.crt",
                                    tmp_path / "password")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, fmt,
                                           serialization.BestAvailableEncryption(password)))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pw_path.write_bytes(password)  # no newline: the secret is read as it is
    return key_path, cert_path, pw_path, password


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_no_key_password_left_in_memory(kind: str, fmt: str, tmp_path: Path) -> None:
    allowed_loaded, allowed_saved = KINDS[kind]
    key_path, cert_path, pw_path, password = _files(tmp_path, FORMATS[fmt])
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}  # this checkout's rehydrate
    child = subprocess.Popen(
        [sys.executable, str(HERE / "tls_password_child.py"), kind, str(key_path),
         str(cert_path), str(pw_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE.parent, env=env)
    found = {}
    try:
        assert child.stdout is not None and child.stdin is not None
        for stage in ("loaded", "saved"):
            line = child.stdout.readline()
            assert line.strip() == stage, f"child failed before the {stage} scan: {line!r}"
            found[stage] = count(child.pid, {"password": password})["password"]
            child.stdin.write("\n")
            child.stdin.flush()
        restored = child.stdout.readline().split()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # exactly: the Secret's own copy is also the proof that the scan sees the password
    assert len(found["loaded"]) == allowed_loaded, f"after the load: {found}"
    assert len(found["saved"]) == allowed_saved, f"after the before-snapshot pass: {found}"
    # every kind re-reads the key for the restore
    assert restored == ["restored", "ok"]
