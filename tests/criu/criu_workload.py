"""The process tests/criu/test_criu_e2e.py dumps and restores with real CRIU.

``python criu_workload.py EVENTS SOCKET [BALLAST_MB]``: serves rehydrate's control socket
at SOCKET and appends one JSON line per event to EVENTS (opened in append mode: CRIU
reopens it by path and offset on restore): ``started``, then one per hook run with its
kind, generation, instance ID and pid, the monotonic and wall clocks, and the time
namespace the process is in. BALLAST_MB of touched memory makes the dump freeze the
process for longer (CRIU writes every page while the process is frozen).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

events_path, socket_path = sys.argv[1], sys.argv[2]
ballast_mb = int(sys.argv[3]) if len(sys.argv) > 3 else 0
os.environ["REHYDRATE_CONTROL_SOCKET"] = socket_path

import rehydrate  # noqa: E402  (after the variable: start() reads it)

out = open(events_path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
lock = threading.Lock()


def emit(kind: str, **extra: object) -> None:
    rec = {"kind": kind, "pid": os.getpid(), "instance_id": rehydrate.instance_id(),
           "mono": time.monotonic(), "wall": time.time(),
           "timens": os.readlink("/proc/self/ns/time"), **extra}
    with lock:
        out.write(json.dumps(rec) + "\n")


@rehydrate.before_snapshot(name="criu.before_snapshot")
def before_snapshot(ctx):  # noqa: ANN001
    emit("before_snapshot", generation=ctx.generation)


@rehydrate.after_restore(name="criu.after_restore")
def after_restore(ctx):  # noqa: ANN001
    emit(ctx.kind, generation=ctx.generation, reason=ctx.reason, frozen_for=ctx.frozen_for)


ballast = bytearray(ballast_mb << 20)
for i in range(0, len(ballast), 4096):
    ballast[i] = 1  # touched, so the dump has to write the page

rehydrate.start()
emit("started", generation=0)
while True:
    time.sleep(3600)
