"""Nothing secret in the image, under real gVisor: a file-backed secret, and a restore of
the scrubbed image (issue 4; complements ``test_secrets_image.py``).

Two identical workloads run side by side, each holding a ``rehydrate.secrets.Secret``
read with ``Secret.from_file`` from a bind-mounted file (48 random bytes the test wrote),
an Ed25519 ``rehydrate.keys.ephemeral`` key and a self-signed Ed25519 certificate
(``rehydrate.tls.self_signed``). Both are checkpointed with trixie's
``runsc checkpoint --compression=none`` (memory pages uncompressed in ``pages.img``):

* the one that got ``rehydrate notify save`` first (run inside the sandbox with
  ``runsc exec``, as gVisor's save-restore-exec would) has **zero** copies of the secret's
  bytes, of the ephemeral private key's raw bytes and of the certificate's private key's
  raw bytes in its image;
* the other (the control case) has them: the search would find them.

A clone restored from the scrubbed image is fully working after ``notify restore``: the
secret is read again from its file, a new key pair and a new certificate exist.

The secret file is a bind mount on purpose: runsc gives bind mounts shared file access,
which keeps no copy of file contents in the sandbox's page cache (files of the root
file system are cached, and that cache is part of the image).

The certificate is deliberately *not* loaded into an ``ssl.SSLContext`` here. rehydrate
does replace the key in live contexts before a snapshot (tests/managers/test_tls.py shows the
context presenting a placeholder), but the system OpenSSL behind the ``ssl`` module leaves
copies of the raw key in *freed* heap memory when ``load_cert_chain`` parses the PEM
(measured outside gVisor: two copies of an Ed25519 key per load, with or without PEM
encryption, after the context itself was freed). Those would make this grep find the key;
docs/identity.md states the limitation.

How the test learns the private key without planting copies of it: the workload exports
it once through the public API (``private_bytes_raw()``), writes it as hex, and
overwrites the returned ``bytes`` object before dropping it (hex text does not contain
the raw bytes). Only rehydrate's own copies are left for the checkpoint to find, or not.
"""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any

import pytest

from .harness import Container, GVisorHarness, Mount, image_contains

REHYDRATE = str(Path(sys.executable).parent / "rehydrate")  # the venv's console script
SOCKET = "/var/tmp/rehydrate.sock"

WORKLOAD = """
import ctypes, json, os, sys, time
import rehydrate, rehydrate.keys, rehydrate.secrets, rehydrate.tls

out = open("/results/events.jsonl", "a", buffering=1)
secret = rehydrate.secrets.Secret.from_file("/secrets/token", name="token")
key = rehydrate.keys.ephemeral("session", "ed25519")
cert = rehydrate.tls.self_signed("web", algorithm="ed25519")

def export_private_key(private_key, filename):
    # The test needs the raw private key; leave no raw copy of ours behind.
    raw = private_key.private_bytes_raw()
    text = raw.hex().encode()
    ctypes.memset(id(raw) + sys.getsizeof(b"") - 1, 0, len(raw))  # the bytes payload
    del raw
    fd = os.open("/results/" + filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, text)
    os.close(fd)

def report(event, **extra):
    with secret as view:  # the no-copy way to use a secret
        size = len(view)
    out.write(json.dumps({"event": event, "secret_len": size,
                          "public": key.public_bytes_raw().hex(),
                          "cert_serial": format(cert.serial, "x"), **extra}) + "\\n")

@rehydrate.after_restore(name="app.after_restore")
def after_restore(ctx):
    report("restored", reason=ctx.reason, generation=ctx.generation)

export_private_key(key.private_key, "key.hex")
export_private_key(cert.private_key, "cert-key.hex")
rehydrate.start()
report("ready")
while True:
    time.sleep(3600)
"""


def _start(gvisor: GVisorHarness, secret_dir: Path, name: str) -> Container:
    return gvisor.run(
        [sys.executable, "-c", WORKLOAD],
        env={"REHYDRATE_CONTROL_SOCKET": SOCKET},
        mounts=[Mount("/secrets", secret_dir)],
        name=name,
    )


def _notify(c: Container, action: str) -> dict[str, Any]:
    proc = c.exec([REHYDRATE, "notify", action, "--json"], timeout=60)
    assert proc.returncode == 0, (action, proc.returncode, proc.stdout, proc.stderr)
    reply: dict[str, Any] = json.loads(proc.stdout)
    return reply


def _outcomes(reply: dict[str, Any]) -> dict[str, str]:
    return {h["name"]: h["outcome"] for h in reply["report"]["hooks"]}


@pytest.mark.gvisor
def test_file_secret_and_key_absent_after_notify_save_and_restored_after(
    gvisor_uncompressed: GVisorHarness, tmp_path: Path
) -> None:
    gvisor = gvisor_uncompressed
    secret_value = secrets.token_bytes(48)
    secret_dir = tmp_path / "secrets"
    secret_dir.mkdir()
    (secret_dir / "token").write_bytes(secret_value)

    saved = _start(gvisor, secret_dir, "saved")
    control = _start(gvisor, secret_dir, "control")
    ready = saved.wait_for("events.jsonl", lambda r: r["event"] == "ready", timeout=60)
    control.wait_for("events.jsonl", lambda r: r["event"] == "ready", timeout=60)
    assert ready["secret_len"] == len(secret_value)
    key_raw = bytes.fromhex(saved.result_file("key.hex").read_text())
    control_key_raw = bytes.fromhex(control.result_file("key.hex").read_text())
    assert len(key_raw) == 32 and key_raw != control_key_raw
    cert_key_raw = bytes.fromhex(saved.result_file("cert-key.hex").read_text())
    control_cert_key_raw = bytes.fromhex(control.result_file("cert-key.hex").read_text())
    assert len(cert_key_raw) == 32 and cert_key_raw != control_cert_key_raw

    outcomes = _outcomes(_notify(saved, "save"))
    assert outcomes["rehydrate.secret:token"] == "ok", outcomes
    assert outcomes["rehydrate.keys"] == "ok", outcomes
    assert outcomes["rehydrate.tls"] == "ok", outcomes

    image = saved.checkpoint(tmp_path / "image-saved", compression="none")
    image_control = control.checkpoint(tmp_path / "image-control", compression="none")
    assert (image / "pages.img").stat().st_size > 1_000_000  # a real memory image

    # The control case: without `notify save` the search finds both.
    assert image_contains(image_control, secret_value) >= 1, "control: secret not found"
    assert image_contains(image_control, control_key_raw) >= 1, "control: key not found"
    assert image_contains(image_control, control_cert_key_raw) >= 1, \
        "control: certificate key not found"
    # After `notify save`: not a single copy.
    found = {
        "secret": image_contains(image, secret_value),
        "private key": image_contains(image, key_raw),
        "certificate key": image_contains(image, cert_key_raw),
    }
    assert found == {"secret": 0, "private key": 0, "certificate key": 0}, found

    # The scrubbed image restores into a working process: secret re-read, new key.
    clone = gvisor.restore(image, saved, name="clone")
    outcomes = _outcomes(_notify(clone, "restore"))
    assert outcomes["rehydrate.secret:token"] == "ok", outcomes
    assert outcomes["rehydrate.keys"] == "ok", outcomes
    assert outcomes["rehydrate.tls:web"] == "ok", outcomes
    rec = clone.wait_for("events.jsonl", lambda r: r["event"] == "restored", timeout=30)
    assert rec["secret_len"] == len(secret_value) and rec["generation"] == 1, rec
    assert rec["public"] != ready["public"], "a new key pair after restore"
    assert rec["cert_serial"] != ready["cert_serial"], "a new certificate after restore"
