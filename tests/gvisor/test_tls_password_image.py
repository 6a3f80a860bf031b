"""A TLS key file's password is not in the checkpoint image, under real gVisor.

Two identical workloads load an encrypted key file (``tls.from_files``) whose password is
a ``rehydrate.secrets.Secret`` read from a bind-mounted file (bind mounts keep no copy of
file contents in the sandbox's page cache, which would be part of the image). Both are
checkpointed with trixie's ``runsc checkpoint --compression=none`` (memory pages
uncompressed in ``pages.img``):

* the control, without ``rehydrate notify save``: the password is in its image (the
  secret's buffer) — the search would find it;
* after ``rehydrate notify save`` (run inside the sandbox with ``runsc exec``, as gVisor's
  save-restore-exec would): **zero** copies of the password.

A clone restored from the scrubbed image re-reads the password (the secret's hook), then
the key (the certificate's hook): it serves the file's certificate again.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from .harness import Container, GVisorHarness, Mount, image_contains

REHYDRATE = str(Path(sys.executable).parent / "rehydrate")  # the venv's console script
SOCKET = "/var/tmp/rehydrate.sock"

WORKLOAD = """
import json, time
import rehydrate, rehydrate.secrets, rehydrate.tls

out = open("/results/events.jsonl", "a", buffering=1)
password = rehydrate.secrets.Secret.from_file("/secrets/password", name="tls-password")
cert = rehydrate.tls.from_files("web", cert="/secrets/tls.crt", key="/secrets/tls.key",
                                password=password, watch=False)
ctx = cert.server_context()

def report(event, **extra):
    out.write(json.dumps({"event": event, "serial": format(cert.serial, "x"),
                          "key_dropped": cert.key_dropped, **extra}) + "\\n")

@rehydrate.after_restore(name="app.after_restore")
def after_restore(ctx):
    report("restored", generation=ctx.generation)

rehydrate.start()
report("ready")
while True:
    time.sleep(3600)
"""


def _secret_dir(tmp_path: Path) -> tuple[Path, bytes, int]:
    password = secrets.token_urlsafe(24).encode()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    d = tmp_path / "secrets"
    d.mkdir()
    (d / "password").write_bytes(password)
    (d / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(password)))
    (d / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return d, password, cert.serial_number


def _start(gvisor: GVisorHarness, secret_dir: Path, name: str) -> Container:
    return gvisor.run([sys.executable, "-c", WORKLOAD],
                      env={"REHYDRATE_CONTROL_SOCKET": SOCKET},
                      mounts=[Mount("/secrets", secret_dir)], name=name)


def _notify(c: Container, action: str) -> dict[str, str]:
    proc = c.exec([REHYDRATE, "notify", action, "--json"], timeout=60)
    assert proc.returncode == 0, (action, proc.returncode, proc.stdout, proc.stderr)
    reply: dict[str, Any] = json.loads(proc.stdout)
    return {h["name"]: h["outcome"] for h in reply["report"]["hooks"]}


@pytest.mark.gvisor
def test_key_password_absent_from_the_image_after_notify_save_and_reread_after_restore(
    gvisor_uncompressed: GVisorHarness, tmp_path: Path
) -> None:
    gvisor = gvisor_uncompressed
    secret_dir, password, serial = _secret_dir(tmp_path)
    saved = _start(gvisor, secret_dir, "pw-saved")
    control = _start(gvisor, secret_dir, "pw-control")
    ready = saved.wait_for("events.jsonl", lambda r: r["event"] == "ready", timeout=60)
    control.wait_for("events.jsonl", lambda r: r["event"] == "ready", timeout=60)
    assert ready["serial"] == format(serial, "x") and not ready["key_dropped"], ready

    outcomes = _notify(saved, "save")
    assert outcomes["rehydrate.secret:tls-password"] == "ok", outcomes
    assert outcomes["rehydrate.tls"] == "ok", outcomes

    image = saved.checkpoint(tmp_path / "image-saved", compression="none")
    image_control = control.checkpoint(tmp_path / "image-control", compression="none")
    assert (image / "pages.img").stat().st_size > 1_000_000  # a real memory image
    assert image_contains(image_control, password) >= 1, "control: password not found"
    assert image_contains(image, password) == 0, "the key password is in the image"

    clone = gvisor.restore(image, saved, name="pw-clone")
    outcomes = _notify(clone, "restore")
    assert outcomes["rehydrate.secret:tls-password"] == "ok", outcomes
    assert outcomes["rehydrate.tls:web"] == "ok", outcomes
    rec = clone.wait_for("events.jsonl", lambda r: r["event"] == "restored", timeout=30)
    assert rec["serial"] == format(serial, "x") and not rec["key_dropped"], rec
    assert rec["generation"] == 1, rec
