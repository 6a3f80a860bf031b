"""Core engine costs, side by side in one run.

Run alone: ``python benchmarks/bench_core.py`` (``make bench`` runs every ``bench_*.py``).
``BENCH_CORE_AGAINST=/path/to/another/checkout`` (e.g. main's worktree) measures that
tree in the same run, alternated with this one, and prints its figure beside each.

* **Per-hook dispatch overhead**: an engine with 1,000 no-op hooks (sync, then async) and
  an engine with none run restores interleaved, so machine noise hits both alike; the
  difference of the medians divided by 1,000 is the cost the engine adds per hook (result
  record, timeout bookkeeping, thread/loop hand-off amortised). Goal: under 10 µs.
  Measured in a fresh interpreter per tree.
* **``import rehydrate``** in a fresh interpreter against ``import json`` as the baseline,
  alternated, many repetitions, median of the in-process import time. Byte-code is cached
  (a private ``PYTHONPYCACHEPREFIX``, warmed first) as in any installed package. Goal:
  under 20 ms more than the baseline. The heavy optional dependencies that must not be
  loaded by the import are listed too.
* **Engine creation** (after the import: register a hook and read ``status()``, which
  creates the default engine and installs the default extensions) and **first start**
  (then ``rehydrate.start()``: probe the detectors and start the usable ones), each timed
  alone in a fresh interpreter; with the modules that only a feature (a manifest, a
  volume, a mapping, a control request) needs, which both must leave unimported.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(os.environ.get("BENCH_CORE_ROOT") or Path(__file__).resolve().parents[1])
"""The tree measured (``BENCH_CORE_ROOT``: how a child measures another checkout)."""
sys.path.insert(0, str(ROOT))

from rehydrate import Lifecycle, Registry  # noqa: E402 - after the sys.path insert
from rehydrate.env import EnvRefresher  # noqa: E402

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


AGAINST = os.environ.get("BENCH_CORE_AGAINST")
"""Another checkout measured in the same run (its figure is shown beside ours)."""
LAZY = ("json", "hashlib", "ipaddress", "urllib", "pathlib", "mmap")
"""Needed only when a feature is used (a manifest, a volume, a mapping, a control
request): engine creation and the first start must not import them
(``tests/test_extensions.py`` fails when they do)."""

_DISPATCH_CHILD = """
import runpy
g = runpy.run_path({bench!r})
print(repr((g["dispatch_us"](False), g["dispatch_us"](True), g["dispatch_us"](False, True))))
"""

Dispatch = tuple[tuple[float, float], tuple[float, float], tuple[float, float]]


def dispatch_in_child(root: Path) -> Dispatch:
    """(sync, async, sync with the default built-ins) :func:`dispatch_us` of ``root``'s
    rehydrate, measured in a fresh interpreter."""
    env = dict(os.environ, BENCH_CORE_ROOT=str(root))
    out = subprocess.run([sys.executable, "-c", _DISPATCH_CHILD.format(bench=__file__)],
                         check=True, capture_output=True, text=True, env=env,
                         timeout=600).stdout
    result: Dispatch = eval(out.strip().splitlines()[-1])  # our own repr() output
    return result


_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
{setup}
t, c = time.perf_counter(), time.process_time()
{stmt}
elapsed, cpu = time.perf_counter() - t, time.process_time() - c
loaded = sorted(m for m in {watch!r} if m in sys.modules)
{teardown}
print(repr((elapsed, cpu, loaded)))
"""

# name -> (setup, timed statement, teardown, modules to list when loaded)
CASES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "json": ("", "import json", "", ()),
    "import": ("", "import rehydrate", "", HEAVY),
    "engine": ("import rehydrate",
               "rehydrate.after_restore(lambda: None); rehydrate.status()", "", LAZY),
    "start": ("import rehydrate; rehydrate.status()", "rehydrate.start()",
              "rehydrate.stop()", LAZY),
}


def _child(root: Path, case: str, env: dict[str, str]) -> tuple[float, float, list[str]]:
    setup, stmt, teardown, watch = CASES[case]
    code = _CHILD.format(root=str(root), setup=setup, stmt=stmt, teardown=teardown,
                         watch=watch)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=env, timeout=60).stdout
    elapsed, cpu, loaded = eval(out.strip().splitlines()[-1])  # our own repr() output
    return float(elapsed), float(cpu), list(loaded)


Timings = dict[str, tuple[float, float, list[str]]]


def fresh_interpreter_times(roots: list[Path]) -> list[Timings]:
    """Per tree: median wall and CPU ms of every case in :data:`CASES` and the watched
    modules it loaded; trees and cases alternated so that machine noise hits all alike
    (CPU time does not count the waits of a busy machine)."""
    with tempfile.TemporaryDirectory(prefix="rehydrate-bench-pyc-") as cache:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPROFILEIMPORTTIME")}
        env["PYTHONPYCACHEPREFIX"] = cache
        for root in roots:  # write the byte-code caches
            for case in CASES:
                _child(root, case, env)
        walls: list[dict[str, list[float]]] = [{c: [] for c in CASES} for _ in roots]
        cpus: list[dict[str, list[float]]] = [{c: [] for c in CASES} for _ in roots]
        loaded: list[dict[str, list[str]]] = [{} for _ in roots]
        for _ in range(IMPORT_REPEATS):
            for case in CASES:
                for i, root in enumerate(roots):
                    wall, cpu, mods = _child(root, case, env)
                    walls[i][case].append(wall)
                    cpus[i][case].append(cpu)
                    loaded[i][case] = mods
    med = statistics.median
    return [{c: (med(walls[i][c]) * 1e3, med(cpus[i][c]) * 1e3, loaded[i][c]) for c in CASES}
            for i in range(len(roots))]


def run() -> list[tuple[str, str, str]]:
    roots = [ROOT] + ([Path(AGAINST).resolve()] if AGAINST else [])
    label = roots[-1].name if AGAINST else ""
    dispatch = [dispatch_in_child(root) for root in roots]
    fresh = fresh_interpreter_times(roots)

    def both(fmt: str, values: list[tuple[float, float]]) -> str:
        def one(wall: float, cpu: float) -> str:
            return f"{fmt.format(wall)} (CPU {fmt.format(cpu)})"

        return one(*values[0]) + (f"; {one(*values[1])} [{label}]" if AGAINST else "")

    def us(which: int) -> str:
        return "; ".join(
            f"{d[which][0]:.2f} µs/hook (CPU {d[which][1]:.2f})" + (f" [{label}]" if i else "")
            for i, d in enumerate(dispatch))

    def ms(*cases: str, minus_json: bool = False) -> list[tuple[float, float]]:
        return [(sum(f[c][0] for c in cases) - (f["json"][0] if minus_json else 0.0),
                 sum(f[c][1] for c in cases) - (f["json"][1] if minus_json else 0.0))
                for f in fresh]

    goal = f"< {DISPATCH_GOAL_US:g} µs/hook"
    return [
        (f"dispatch overhead, {HOOKS} no-op sync hooks", us(0), goal),
        (f"dispatch overhead, {HOOKS} no-op async hooks", us(1), goal),
        ("  (sync, with default built-ins: telemetry observer etc.)", us(2), "info"),
        ("import json (baseline, fresh interpreter, median)", both("{:.1f} ms", ms("json")),
         "-"),
        ("import rehydrate (fresh interpreter, median)", both("{:.1f} ms", ms("import")), "-"),
        ("import rehydrate - import json", both("{:+.1f} ms", ms("import", minus_json=True)),
         f"< {IMPORT_GOAL_MS:g} ms"),
        ("engine creation (register a hook + status(), after the import)",
         both("{:.1f} ms", ms("engine")), "info"),
        ("first start (rehydrate.start(), after engine creation)",
         both("{:.1f} ms", ms("start")), "info"),
        ("  first use: import + engine creation + first start",
         both("{:.1f} ms", ms("import", "engine", "start")), "info"),
        ("heavy modules loaded by import rehydrate",
         ", ".join(fresh[0]["import"][2]) or "none", "none"),
        ("feature-only modules loaded by engine creation + first start",
         "; ".join((", ".join(sorted({*f["engine"][2], *f["start"][2]})) or "none")
                   + (f" [{label}]" if i else "") for i, f in enumerate(fresh)), "none"),
    ]


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    from run import main  # benchmarks/ is on sys.path when a module runs as a script

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
