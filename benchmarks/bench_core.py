"""Core engine costs, side by side in one run.

Run alone: ``python benchmarks/bench_core.py`` (``make bench`` runs every benchmark).

* **Per-hook dispatch overhead**: an engine with 1,000 no-op hooks (sync, then async) and
  an engine with none run restores interleaved, so machine noise hits both alike; the
  difference of the medians divided by 1,000 is the cost the engine adds per hook (result
  record, timeout bookkeeping, thread/loop hand-off amortised). Goal: under 10 µs.
* **``import rehydrate``** in a fresh interpreter against ``import json`` as the baseline,
  alternated, many repetitions, median of the in-process import time. Byte-code is cached
  (a private ``PYTHONPYCACHEPREFIX``, warmed first) as in any installed package. Goal:
  under 20 ms more than the baseline. The heavy optional dependencies that must not be
  loaded by the import are listed too, and (for information) the cost of the first use
  that follows the import in an application: registering a hook and creating the engine,
  which loads the rest of the core (``dataclasses``, ``inspect``, ``logging``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rehydrate._hooks import Registry  # noqa: E402
from rehydrate._lifecycle import Lifecycle  # noqa: E402
from rehydrate.env import EnvRefresher  # noqa: E402 - after the sys.path insert

HOOKS = 1000
ROUNDS = 30
IMPORT_REPEATS = 25
DISPATCH_GOAL_US = 10.0
IMPORT_GOAL_MS = 20.0
HEAVY = ("asyncio", "concurrent.futures", "cryptography", "httpx", "watchdog",
         "opentelemetry", "pyroute2", "ssl", "socket", "pytest")


def _engine(n: int, is_async: bool, builtins: bool = False) -> Lifecycle:
    reg = Registry()
    for i in range(n):
        if is_async:
            async def hook() -> None:
                pass
        else:
            def hook() -> None:
                pass
        reg.register(hook, name=f"h{i}")
    return Lifecycle(reg, env=EnvRefresher(path=None), builtins=builtins)


def _timed(engine: Lifecycle) -> tuple[float, float]:
    """Wall-clock and CPU seconds (all threads of the process) of one restore."""
    t0, c0 = time.perf_counter(), time.process_time()
    engine.simulate_restore()
    return time.perf_counter() - t0, time.process_time() - c0


def dispatch_us(is_async: bool, builtins: bool = False) -> tuple[float, float]:
    """Median extra microseconds per hook (wall, CPU) for ``HOOKS`` no-op hooks.

    CPU time is reported next to wall time because it does not count the time a busy
    machine (a CI box running other jobs) keeps the process waiting for a core.
    """
    full = _engine(HOOKS, is_async, builtins)
    empty = _engine(0, is_async, builtins)
    if is_async:  # the empty engine must pay the loop hand-off too: one async hook
        async def one() -> None:
            pass
        empty.registry.register(one)
        full.registry.register(one)
    try:
        for _ in range(3):  # warm up threads, loop, caches
            full.simulate_restore()
            empty.simulate_restore()
        w_full, w_empty, c_full, c_empty = [], [], [], []
        for _ in range(ROUNDS):
            w, c = _timed(full)
            w_full.append(w)
            c_full.append(c)
            w, c = _timed(empty)
            w_empty.append(w)
            c_empty.append(c)
        med = statistics.median
        return ((med(w_full) - med(w_empty)) / HOOKS * 1e6,
                (med(c_full) - med(c_empty)) / HOOKS * 1e6)
    finally:
        full.close()
        empty.close()


_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
t = time.perf_counter()
{stmt}
elapsed = time.perf_counter() - t
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
print(repr((elapsed, heavy)))
"""

FIRST_USE = ("import rehydrate; rehydrate.after_restore(lambda: None); "
             "rehydrate.status()")
"""What an application does right after the import: register a hook, touch the engine."""


def _child(stmt: str, env: dict[str, str]) -> tuple[float, list[str]]:
    code = _CHILD.format(root=str(ROOT), stmt=stmt, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=env, timeout=60).stdout
    elapsed, heavy = eval(out.strip().splitlines()[-1])  # our own repr() output
    return float(elapsed), list(heavy)


def import_times() -> tuple[float, float, float, list[str]]:
    """Median ms of ``import json``, ``import rehydrate`` and :data:`FIRST_USE`, alternated;
    the heavy modules ``import rehydrate`` loaded."""
    with tempfile.TemporaryDirectory(prefix="rehydrate-bench-pyc-") as cache:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPROFILEIMPORTTIME")}
        env["PYTHONPYCACHEPREFIX"] = cache
        stmts = ("import json", "import rehydrate", FIRST_USE)
        for stmt in stmts:  # write the byte-code caches
            _child(stmt, env)
        times: dict[str, list[float]] = {stmt: [] for stmt in stmts}
        heavy: list[str] = []
        for _ in range(IMPORT_REPEATS):
            for stmt in stmts:
                t, loaded = _child(stmt, env)
                times[stmt].append(t)
                if stmt == "import rehydrate":
                    heavy = loaded
    base, ours, first = (statistics.median(times[s]) * 1e3 for s in stmts)
    return base, ours, first, heavy


def run() -> list[tuple[str, str, str]]:
    sync_us, sync_cpu = dispatch_us(is_async=False)
    async_us, async_cpu = dispatch_us(is_async=True)
    builtin_us, builtin_cpu = dispatch_us(is_async=False, builtins=True)
    json_ms, rehydrate_ms, first_use_ms, heavy = import_times()
    extra = rehydrate_ms - json_ms
    goal = f"< {DISPATCH_GOAL_US:g} µs/hook"
    return [
        (f"dispatch overhead, {HOOKS} no-op sync hooks",
         f"{sync_us:.2f} µs/hook (CPU {sync_cpu:.2f})", goal),
        (f"dispatch overhead, {HOOKS} no-op async hooks",
         f"{async_us:.2f} µs/hook (CPU {async_cpu:.2f})", goal),
        ("  (sync, with default built-ins: telemetry observer etc.)",
         f"{builtin_us:.2f} µs/hook (CPU {builtin_cpu:.2f})", "info"),
        ("import json (baseline, fresh interpreter, median)", f"{json_ms:.1f} ms", "-"),
        ("import rehydrate (fresh interpreter, median)", f"{rehydrate_ms:.1f} ms", "-"),
        ("import rehydrate - import json", f"{extra:+.1f} ms", f"< {IMPORT_GOAL_MS:g} ms"),
        ("  (+ register a hook + create the engine: first use) - import json",
         f"{first_use_ms - json_ms:+.1f} ms", "info"),
        ("heavy modules loaded by import rehydrate", ", ".join(heavy) or "none", "none"),
    ]


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    from run import main  # benchmarks/ is on sys.path when a module runs as a script

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
