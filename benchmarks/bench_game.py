"""Game servers: restore → first tick, restore → first health ping acknowledged.

Run alone: ``python benchmarks/bench_game.py`` (``make bench`` runs every ``bench_*.py``).

A game-server process (an asyncio loop ticking a 500-entity world at 60 Hz, the Agones
adapter, rehydrate with its control socket) is really frozen: the benchmark runs
``rehydrate notify save`` in it (the before-snapshot pass: the adapter's loops stop),
``SIGSTOP``s it for FREEZE seconds, ``SIGCONT``s it and at once sends the restore notice
over the control socket, as save-restore-exec's ``rehydrate notify restore`` would — a
stopped process's ``CLOCK_MONOTONIC`` keeps counting, exactly as under a gVisor restore,
so the game loop sees the freeze as it would after a restore. Times are
``CLOCK_MONOTONIC`` readings, shared by the processes of one machine: from the
``SIGCONT`` to the game's first simulated tick, and to the stand-in sidecar
(``tests/agones_sidecar.py``, running in this process) having answered the first
``POST /health``. The sidecar's own latency — a ``POST /health`` on a new connection from a
fresh client, as after a restore — is measured in the same run; the goal for the health
ping is < 50 ms beyond it, and < 50 ms for the first tick.

Side by side, in the same frozen process: a naive fixed-step loop (Fiedler's accumulator
with no clamp) against ``TickClock(max_catch_up=2)`` — ticks run in the first frame after
the freeze.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from agones_sidecar import AgonesSidecar  # noqa: E402 - after the sys.path insert

from rehydrate import _control_client as control_client  # noqa: E402

RATE = 60
FREEZE = 1.0
ROUNDS = 5
MAX_CATCH_UP = 2
GOAL_MS = 50.0
REHYDRATE = str(Path(sys.executable).parent / "rehydrate")

CHILD = r"""
import asyncio, json, math, os, sys, time
import rehydrate
from rehydrate.adapters.agones import AgonesAdapter
from rehydrate.adapters.gameloop import TickClock

mode, rate, catch_up, events = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
out = open(events, "a", buffering=1)
world = [[float(i), float(i)] for i in range(500)]

def step():
    for e in world:
        e[0] = (e[0] + 0.5) % 1000.0
        e[1] = (e[1] + math.sin(e[0])) % 1000.0

class Naive:
    # Fiedler's accumulator without the clamp: every second owed is simulated.
    def __init__(self, rate):
        self.dt, self.last, self.acc = 1.0 / rate, time.monotonic(), 0.0
    def due(self):
        now = time.monotonic()
        self.acc += now - self.last
        self.last = now
        n = int(self.acc / self.dt)
        self.acc -= n * self.dt
        return n
    def until_next(self):
        return max(0.0, self.dt - self.acc)

async def main():
    rehydrate.start(loop=asyncio.get_running_loop())
    agones = AgonesAdapter(health_interval=1.0)
    agones.install()
    clock = TickClock(rate, max_catch_up=catch_up) if mode == "tickclock" else Naive(rate)
    out.write(json.dumps({"event": "ready"}) + "\n")
    while True:
        due_at = time.monotonic()  # the benchmark takes the first frame due after SIGCONT
        n = clock.due()
        first = None
        for i in range(n):
            step()
            if i == 0:
                first = time.monotonic()
        out.write(json.dumps({"event": "frame", "due_at": due_at, "ticks": n,
                              "first_tick_done": first}) + "\n")
        await asyncio.sleep(clock.until_next())

asyncio.run(main())
"""


def _records(path: Path) -> list[dict[str, Any]]:
    recs = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line still being written
            recs.append(json.loads(line))
    return recs


def _wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


def sidecar_latency(sidecar: AgonesSidecar, n: int = 20) -> float:
    """Median seconds of a POST /health on a new connection from a fresh client."""
    import httpx

    times = []
    for _ in range(n):
        with httpx.Client(base_url=sidecar.url, verify=False, trust_env=False) as client:
            t0 = time.monotonic()
            client.post("/health", json={}).raise_for_status()
            times.append(time.monotonic() - t0)
    return statistics.median(times)


def freeze_rounds(mode: str, sidecar: AgonesSidecar, tmp: Path) -> dict[str, list[float]]:
    events = tmp / f"{mode}.jsonl"
    sock = str(tmp / f"{mode}.sock")
    env = {**os.environ, "AGONES_SDK_HTTP_PORT": str(sidecar.port),
           "REHYDRATE_CONTROL_SOCKET": sock, "REHYDRATE_CLOCK_THRESHOLD": "0.5",
           "REHYDRATE_CLOCK_INTERVAL": "0.1", "REHYDRATE_CLOCK_GRACE": "0",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(RATE), str(MAX_CATCH_UP),
                             str(events)], env=env, stdout=subprocess.DEVNULL)
    result: dict[str, list[float]] = {"first_tick": [], "health": [], "ticks": []}
    try:
        _wait(lambda: events.exists() and _records(events), 60, "the game to start")
        for _ in range(ROUNDS):
            subprocess.run([REHYDRATE, "notify", "save"], env=env, check=True,
                           capture_output=True, timeout=60)
            n_seen = len(_records(events))
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(FREEZE)
            t_resume = time.monotonic()
            os.kill(proc.pid, signal.SIGCONT)
            # the restore notice, as save-restore-exec's `rehydrate notify restore` sends it
            # (the clock-jump detector takes a SIGCONT for a job-control stop, rightly)
            reply = control_client.request("restore", socket_path=sock, timeout=30)
            assert reply["ok"], reply
            resumed = _wait(lambda k=n_seen, t=t_resume: [
                r for r in _records(events)[k:] if r["event"] == "frame" and r["due_at"] >= t],
                10, f"the first frame after the freeze ({mode})")[0]
            ping = sidecar.wait_for("POST", "/health", since=t_resume)[0]
            result["first_tick"].append(resumed["first_tick_done"] - t_resume)
            result["ticks"].append(resumed["ticks"])
            result["health"].append(ping.answered - t_resume)
            time.sleep(0.3)  # let the restore hooks finish before the next save
    finally:
        proc.kill()
        proc.wait(10)
    return result


def run() -> list[tuple[str, str, str]]:
    med = statistics.median
    with AgonesSidecar() as sidecar, tempfile.TemporaryDirectory() as tmp:
        sidecar.wait_listening()
        latency = sidecar_latency(sidecar)
        ours = freeze_rounds("tickclock", sidecar, Path(tmp))
        naive = freeze_rounds("naive", sidecar, Path(tmp))
    health_ms = med(ours["health"]) * 1e3
    tick_ms = med(ours["first_tick"]) * 1e3
    lat_ms = latency * 1e3
    return [
        ("sidecar's own latency: POST /health, new connection (median)",
         f"{lat_ms:.1f} ms", "baseline"),
        (f"restore -> first health ping acknowledged ({FREEZE:g} s SIGSTOP, median of "
         f"{ROUNDS})", f"{health_ms:.1f} ms ({health_ms - lat_ms:+.1f} ms beyond the sidecar)",
         f"< {GOAL_MS:g} ms beyond"),
        (f"restore -> first tick, TickClock({RATE} Hz, max_catch_up={MAX_CATCH_UP})",
         f"{tick_ms:.1f} ms", f"< {GOAL_MS:g} ms"),
        ("  ticks in the first frame after the freeze: TickClock vs naive accumulator",
         f"{med(ours['ticks']):.0f} vs {med(naive['ticks']):.0f}", f"<= {MAX_CATCH_UP}"),
        ("  restore -> first tick, naive accumulator (the burst's first tick)",
         f"{med(naive['first_tick']) * 1e3:.1f} ms", "info"),
    ]


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import main

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
