"""Measured under runsc: what happens to loopback TCP across a checkpoint/restore.

docs/network.md and docs/platforms/runsc.md state this result; this test pins it. The
workload holds a listener on 127.0.0.1 and one connected client/server pair and, every
0.1 s, echoes a line over the existing connection and opens a fresh connection to the
listener, recording each outcome. The checkpoint is taken while it runs; each record a
clone writes comes from after the restore.
"""

from __future__ import annotations

import sys

import pytest

from .harness import GVisorHarness

WORKLOAD = r"""
import json, socket, threading, time
out = open("/results/loopback.jsonl", "a", buffering=1)
srv = socket.create_server(("127.0.0.1", 0))
port = srv.getsockname()[1]

def serve():
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()

def echo(conn):
    with conn:
        while True:
            try:
                data = conn.recv(64)
            except OSError:
                return
            if not data:
                return
            conn.sendall(data)

threading.Thread(target=serve, daemon=True).start()
old = socket.create_connection(("127.0.0.1", port), timeout=2)

def roundtrip(sock, n):
    sock.sendall(b"%d\n" % n)
    return sock.recv(64) == b"%d\n" % n

i = 0
while True:
    rec = {"i": i, "mono": time.monotonic()}
    try:
        rec["existing"] = "ok" if roundtrip(old, i) else "wrong answer"
    except OSError as exc:
        rec["existing"] = type(exc).__name__ + ": " + str(exc)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as fresh:
            rec["fresh"] = "ok" if roundtrip(fresh, i) else "wrong answer"
    except OSError as exc:
        rec["fresh"] = type(exc).__name__ + ": " + str(exc)
    out.write(json.dumps(rec) + "\n")
    i += 1
    time.sleep(0.1)
"""


@pytest.mark.gvisor
@pytest.mark.parametrize("runsc", ["gvisor", "gvisor_uncompressed"])  # bookworm's, trixie's
def test_loopback_tcp_across_a_runsc_restore(request: pytest.FixtureRequest,
                                             runsc: str) -> None:
    gvisor: GVisorHarness = request.getfixturevalue(runsc)
    orig = gvisor.run([sys.executable, "-c", WORKLOAD], name="loopback")
    before = orig.wait_for("loopback.jsonl", lambda r: r["i"] >= 3, timeout=30)
    assert (before["existing"], before["fresh"]) == ("ok", "ok"), before
    image = orig.checkpoint()
    last_before = orig.records("loopback.jsonl")[-1]["i"]
    clone = gvisor.restore(image, orig, name="loopback-clone")
    # the clone's results file starts empty: every record in it was written after restore
    clone.wait_for("loopback.jsonl", lambda r: r["i"] >= last_before + 5, timeout=30)
    after = clone.records("loopback.jsonl")[:5]
    assert len(after) == 5 and after[0]["i"] >= last_before, after
    # the connection established before the checkpoint still carries data, and the
    # listener still accepts: loopback TCP survives a runsc restore
    assert [(r["existing"], r["fresh"]) for r in after] == [("ok", "ok")] * 5, after
