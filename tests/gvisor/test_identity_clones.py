"""Clone uniqueness under real gVisor (issue 4): one checkpoint, five restored clones.

Every clone of a snapshot starts with the same memory: PRNG states, keys, certificates,
instance ID. With rehydrate's ENTROPY and SECRETS phases the five clones' ``random``
streams, NumPy streams (global legacy state and a registered ``Generator``), tempfile
names, ``instance_id()``, ephemeral public keys (Ed25519, EC P-256), self-signed
certificate serials and TLS client randoms are pairwise different. The TLS handshake uses
the ``SSLContext`` that ``connections.httpx_client`` builds once before the snapshot and
reuses in every clone (it holds no secrets; OpenSSL's generator is reseeded by the
ENTROPY phase): each clone's handshake is a fresh one (no session resumed) with its own
client random.

The control case proves the test can fail: the same workload with
``REHYDRATE_DISABLE=entropy,secrets`` is checkpointed side by side and restored into two
clones, whose restore hooks run (reason ``clock-jump``, generation 1) and draw exactly
the same values.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any

import pytest

from .harness import Container, GVisorHarness

THRESHOLD = 1.0  # clock-jump threshold in the workload
FROZEN = 2.5  # seconds between checkpoint and restore (> THRESHOLD + interval)
CLONES = 5
CONTROL_CLONES = 2

WORKLOAD = """
import json, os, random, tempfile, time
import numpy as np
import rehydrate
import rehydrate.entropy, rehydrate.keys, rehydrate.tls

out = open("/results/identity.jsonl", "a", buffering=1)
rng = rehydrate.entropy.register(np.random.default_rng())
ed = rehydrate.keys.ephemeral("session-ed", "ed25519")
ec = rehydrate.keys.ephemeral("session-ec", "ec-p256")
cert = rehydrate.tls.self_signed("web")
fd, path = tempfile.mkstemp()  # tempfile's name sequence now exists (and is cloned)
os.close(fd)

import socket, ssl, threading
from rehydrate import connections
listener = socket.create_server(("127.0.0.1", 0))
port = listener.getsockname()[1]
server_ctx = cert.server_context()

def serve():
    while True:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as s:
                s.recv(1)
        except OSError:
            pass

threading.Thread(target=serve, daemon=True).start()
peer = connections.httpx_client("tls-peer", base_url=f"https://127.0.0.1:{port}", verify=False)
tls_ctx = peer._transport._kwargs["verify"]  # built once, reused by every rebuilt pool
assert isinstance(tls_ctx, ssl.SSLContext)

def handshake():
    log = f"/results/keylog-{time.monotonic_ns()}"
    tls_ctx.keylog_filename = log
    with socket.create_connection(("127.0.0.1", port)) as raw:
        with tls_ctx.wrap_socket(raw, server_hostname="localhost") as s:
            reused = s.session_reused
    tls_ctx.keylog_filename = None
    with open(log) as f:
        secrets = [line.split() for line in f if not line.startswith("#")]
    return secrets[0][1], reused  # NSS key log: LABEL CLIENT_RANDOM SECRET

def identity():
    return {"instance_id": rehydrate.instance_id(),
            "ed25519": ed.public_bytes_raw().hex(), "ec_p256": ec.public_bytes_raw().hex(),
            "cert_serial": format(cert.serial, "x")}

@rehydrate.after_restore(name="app.sample")
def sample(ctx):
    fd, path = tempfile.mkstemp()
    os.close(fd)
    client_random, reused = handshake()
    out.write(json.dumps({
        "tls_client_random": client_random, "tls_session_reused": reused,
        "event": "restored", "reason": ctx.reason, "kind": ctx.kind,
        "generation": ctx.generation,
        "random": [str(random.getrandbits(64)) for _ in range(4)],
        "numpy": [str(x) for x in np.random.randint(0, 2**62, size=4)],
        "numpy_generator": [str(x) for x in rng.integers(0, 2**62, size=4)],
        "tempfile": os.path.basename(path),
        **identity()}) + "\\n")

detectors = rehydrate.start()
out.write(json.dumps({"event": "ready", "detectors": detectors,
                      "disabled": os.environ.get("REHYDRATE_DISABLE"), **identity()}) + "\\n")
while True:
    time.sleep(3600)
"""

FIELDS = ("random", "numpy", "numpy_generator", "tempfile", "instance_id", "ed25519",
          "ec_p256", "cert_serial", "tls_client_random")
IDENTITY = ("instance_id", "ed25519", "ec_p256", "cert_serial")


def _value(rec: dict[str, Any], field: str) -> Any:
    v = rec[field]
    return tuple(v) if isinstance(v, list) else v


def _restored(clones: list[Container]) -> list[dict[str, Any]]:
    recs = []
    for c in clones:
        rec = c.wait_for("identity.jsonl", lambda r: r["event"] == "restored", timeout=60)
        assert (rec["reason"], rec["kind"], rec["generation"]) == (
            "clock-jump", "restore", 1), rec
        recs.append(rec)
    return recs


@pytest.mark.gvisor
def test_clones_are_distinct_and_collide_without_entropy_and_secrets(
    gvisor: GVisorHarness,
) -> None:
    env = {"REHYDRATE_CLOCK_THRESHOLD": str(THRESHOLD)}
    # Both workloads side by side: one checkpoint wait, one freeze.
    managed = gvisor.run([sys.executable, "-c", WORKLOAD], env=env, name="identity")
    control = gvisor.run(
        [sys.executable, "-c", WORKLOAD],
        env={**env, "REHYDRATE_DISABLE": "entropy,secrets"},
        name="identity-off",
    )
    ready = managed.wait_for("identity.jsonl", lambda r: r["event"] == "ready", timeout=60)
    ready_off = control.wait_for("identity.jsonl", lambda r: r["event"] == "ready", timeout=60)
    assert "clock-jump" in ready["detectors"] and ready["disabled"] is None, ready
    assert ready_off["disabled"] == "entropy,secrets", ready_off

    image = managed.checkpoint()
    image_off = control.checkpoint()
    frozen_at = time.monotonic()
    while time.monotonic() - frozen_at < FROZEN:
        time.sleep(0.05)
    clones = gvisor.restore_many(image, managed, CLONES, name="id")
    clones_off = gvisor.restore_many(image_off, control, CONTROL_CLONES, name="id-off")

    # -- with rehydrate: pairwise different, and different from the original.
    recs = _restored(clones)
    assert not any(r["tls_session_reused"] for r in recs), recs
    for field in FIELDS:
        values = [_value(r, field) for r in recs]
        assert len(set(values)) == CLONES, f"{field} collides between clones: {values}"
    for field in IDENTITY:
        assert ready[field] not in {r[field] for r in recs}, f"a clone kept the original {field}"
    for a, b in itertools.combinations(recs, 2):  # not even one draw in common
        for field in ("random", "numpy", "numpy_generator"):
            assert not set(a[field]) & set(b[field]), (field, a[field], b[field])

    # -- control: ENTROPY and SECRETS disabled -> every clone draws the same values.
    recs_off = _restored(clones_off)
    for field in FIELDS:
        values = [_value(r, field) for r in recs_off]
        assert len(set(values)) == 1, f"{field} differs although the phases are off: {values}"
    for field in IDENTITY:
        assert recs_off[0][field] == ready_off[field], field
