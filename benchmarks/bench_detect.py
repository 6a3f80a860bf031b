"""gVisor waiter and control socket: how fast a notice becomes a running hook, and idle cost.

* gVisor answer -> first hook: the waiter blocks on a FIFO standing in for
  ``/proc/gvisor/checkpoint`` (as the test harness emulates it); the "platform" writes
  ``resume\\n`` into it; latency = the first hook's start (observer ``hook_started``)
  minus the moment just before the write, both ``time.perf_counter()`` (CLOCK_MONOTONIC)
  in one process. Median and p90 over 60 checkpoints.
* control ``restore`` -> first hook: the same for a ``{"cmd": "restore"}`` line sent on an
  open control-socket connection.
* Idle CPU: a child process runs the gVisor waiter (on a FIFO) and the control socket,
  blocked, for 3 s; its CPU time (all threads) beside a child that only imports rehydrate.

(The clock-jump latency and ``start("auto")`` idle rows are in bench_detect_generic.py.)

Run alone: ``python benchmarks/bench_detect.py``.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUNS = 60
IDLE_SECONDS = 3.0

_IDLE_CHILD = textwrap.dedent("""
    import json, os, sys, tempfile, time
    from rehydrate.testing import isolated_engine
    d = tempfile.mkdtemp(prefix="rh-bench-")
    engine = None
    if sys.argv[1] == "waiter":
        from rehydrate.detect.control import ControlDetector
        from rehydrate.detect.gvisor import GVisorDetector
        os.mkfifo(os.path.join(d, "checkpoint"))
        engine = isolated_engine()
        engine.start([GVisorDetector(d), ControlDetector(os.path.join(d, "c.sock"))])
    time.sleep(0.3)
    c0, w0 = time.process_time(), time.monotonic()
    time.sleep(float(sys.argv[2]))
    c1, w1 = time.process_time(), time.monotonic()
    print(json.dumps({"cpu": c1 - c0, "wall": w1 - w0}))
    if engine is not None:
        engine.close()
""")


class _FirstHook:
    """Observer: remembers when the first hook of each event started."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.event = threading.Event()

    def hook_started(self, hook: Any, ctx: Any) -> object:
        if self.at is None:
            self.at = time.perf_counter()
            self.event.set()
        return None

    def hook_finished(self, token: object, result: Any) -> None:
        pass

    def reset(self) -> None:
        self.at = None
        self.event.clear()


def _wait(cond: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError("benchmark stalled")
        time.sleep(0.0005)


def _ms(values: list[float]) -> str:
    qs = statistics.quantiles(values, n=10)
    return f"median {statistics.median(values) * 1000:.3f} ms, p90 {qs[-1] * 1000:.3f} ms"


def bench_gvisor_answer() -> list[float]:
    from rehydrate.detect.gvisor import GVisorDetector
    from rehydrate.testing import isolated_engine

    d = tempfile.mkdtemp(prefix="rh-bench-")
    os.mkfifo(os.path.join(d, "checkpoint"))
    engine = isolated_engine()
    obs = _FirstHook()
    engine.add_observer(obs)
    engine.registry.after_restore(lambda: None, name="app")
    waiter = GVisorDetector(d)
    engine.start([waiter])
    out = []
    try:
        for i in range(RUNS + 5):
            _wait(lambda i=i: waiter.status()["waiting"] and waiter.status()["answers"] == i)
            obs.reset()
            fd = os.open(waiter.path, os.O_WRONLY | os.O_NONBLOCK)
            t0 = time.perf_counter()
            os.write(fd, b"resume\n")
            if not obs.event.wait(5):
                raise RuntimeError("no hook ran")
            os.close(fd)
            assert obs.at is not None
            if i >= 5:  # warm-up
                out.append(obs.at - t0)
    finally:
        engine.close()
        os.unlink(os.path.join(d, "checkpoint"))
        os.rmdir(d)
    return out


def bench_control_restore() -> list[float]:
    from rehydrate.detect.control import ControlDetector
    from rehydrate.testing import isolated_engine

    d = tempfile.mkdtemp(prefix="rh-bench-")
    path = os.path.join(d, "c.sock")
    engine = isolated_engine()
    obs = _FirstHook()
    engine.add_observer(obs)
    engine.registry.after_restore(lambda: None, name="app")
    engine.start([ControlDetector(path)])
    out = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    f = sock.makefile("rb")
    try:
        for i in range(RUNS + 5):
            obs.reset()
            t0 = time.perf_counter()
            sock.sendall(b'{"cmd": "restore"}\n')
            if not json.loads(f.readline())["ok"]:
                raise RuntimeError("restore failed")
            assert obs.at is not None
            if i >= 5:
                out.append(obs.at - t0)
    finally:
        f.close()
        sock.close()
        engine.close()
        os.rmdir(d)
    return out


def bench_idle() -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {mode: subprocess.Popen([sys.executable, "-c", _IDLE_CHILD, mode, str(IDLE_SECONDS)],
                                    stdout=subprocess.PIPE, text=True, env=env)
             for mode in ("waiter", "bare")}
    res = {}
    for mode, p in procs.items():
        stdout, _ = p.communicate(timeout=60)
        data = json.loads(stdout.strip().splitlines()[-1])
        res[mode] = data["cpu"] / data["wall"]
    return res["waiter"], res["bare"]


def run() -> list[tuple[str, str, str]]:
    gv = bench_gvisor_answer()
    ctl = bench_control_restore()
    waiter_idle, bare_idle = bench_idle()
    return [
        (f"gVisor answer -> first hook ({len(gv)} runs)", _ms(gv), "median < 1 ms"),
        (f"control 'restore' line -> first hook ({len(ctl)} runs)", _ms(ctl), "median < 1 ms"),
        (f"idle CPU: gVisor waiter + control socket blocked, {IDLE_SECONDS:g} s",
         f"{waiter_idle * 100:.4f} % of a core (import-only child: {bare_idle * 100:.4f} %)",
         "~0 (no wake-ups while waiting)"),
    ]


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    from run import main  # benchmarks/ is on sys.path when a module runs as a script

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
