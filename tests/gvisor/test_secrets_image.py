"""Nothing secret in the image (issue 4), under real gVisor.

A workload holds a :class:`~rehydrate.secrets.Secret` and an ephemeral Ed25519 key, both
made from kernel bytes. Their raw bytes are reported to the test only as hex (a different
byte pattern), so the only raw copies are the ones rehydrate manages. The sandbox is
checkpointed twice with trixie's ``runsc checkpoint --compression=none`` (memory pages
land uncompressed in ``pages.img``):

* control: without ``rehydrate notify save`` (``-leave-running``) — the secret's bytes and
  the private key's raw bytes are found in the image;
* after ``rehydrate notify save`` (run inside the sandbox with ``runsc exec``, as gVisor's
  save-restore-exec would) — they occur zero times.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .harness import GVisorHarness, image_contains

SOCKET = "/var/tmp/rehydrate.sock"  # control socket on the sandbox's tmpfs
REHYDRATE = str(Path(sys.executable).parent / "rehydrate")  # the venv's console script

WORKLOAD = """
import json, time
import rehydrate
import rehydrate.keys as keys
from rehydrate.secrets import Secret

out = open("/results/image.jsonl", "a", buffering=1)
real_fill = keys.urandom_into
seen = {}

def spy(buf):  # records the key's seed as hex: never as raw bytes outside rehydrate
    real_fill(buf)
    seen["key"] = memoryview(buf).hex()

keys.urandom_into = spy
key = keys.ephemeral("image-test", "ed25519")  # Ed25519 raw private key == this seed
keys.urandom_into = real_fill

def token():
    buf = bytearray(48)
    real_fill(buf)
    return buf  # copied into the secret's buffer, then zeroed by rehydrate

secret = Secret.from_callable(token, name="session-token")
with secret as view:
    secret_hex = view.hex()

@rehydrate.before_snapshot(phase=rehydrate.Phase.ENVIRONMENT, name="app.saved")
def saved():  # ENVIRONMENT: the last phase before a snapshot, after SECRETS
    out.write(json.dumps({"event": "saved", "key_dropped": key.dropped,
                          "secret_available": secret.available}) + "\\n")

detectors = rehydrate.start()
out.write(json.dumps({"event": "ready", "detectors": detectors, "key": seen.pop("key"),
                      "secret": secret_hex,
                      "public": key.public_bytes_raw().hex()}) + "\\n")
while True:
    time.sleep(3600)
"""


@pytest.mark.gvisor
def test_no_secret_or_private_key_in_the_image_after_notify_save(
    gvisor_uncompressed: GVisorHarness, tmp_path: Path
) -> None:
    gvisor = gvisor_uncompressed
    c = gvisor.run(
        [sys.executable, "-c", WORKLOAD],
        env={"REHYDRATE_CONTROL_SOCKET": SOCKET,
             "REHYDRATE_GVISOR_PROC": "/nonexistent-gvisor-proc"},
        name="secrets-image",
    )
    ready = c.wait_for("image.jsonl", lambda r: r["event"] == "ready", timeout=60)
    key_raw = bytes.fromhex(ready["key"])
    secret_raw = bytes.fromhex(ready["secret"])
    assert len(key_raw) == 32 and len(secret_raw) == 48
    assert "control" in ready["detectors"], ready

    # -- control: no notice before the checkpoint -> both are in the memory image.
    leaky = c.checkpoint(tmp_path / "without-notify", compression="none", leave_running=True)
    assert (leaky / "pages.img").exists()
    assert image_contains(leaky, secret_raw) >= 1, "control: the secret should be in memory"
    assert image_contains(leaky, key_raw) >= 1, "control: the private key should be in memory"

    # -- rehydrate notify save: before-snapshot pass (SECRETS: drop keys, wipe secrets).
    proc = c.exec([REHYDRATE, "notify", "save"], timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    saved = c.wait_for("image.jsonl", lambda r: r["event"] == "saved", timeout=30)
    assert saved["key_dropped"] is True and saved["secret_available"] is False, saved

    clean = c.checkpoint(tmp_path / "after-notify", compression="none")
    assert (clean / "pages.img").stat().st_size > 1_000_000  # a real memory image
    assert image_contains(clean, secret_raw) == 0, "the secret's bytes are in the image"
    assert image_contains(clean, key_raw) == 0, "the private key's raw bytes are in the image"
