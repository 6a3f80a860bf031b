"""Telemetry overhead per restore (no-op API vs SDK, side by side) and fingerprint cost.

Run alone: ``python benchmarks/bench_telemetry.py``. Three engines with the same 50 trivial
sync hooks run restores interleaved, so that machine noise hits all of them alike:

* ``bare``: telemetry observer removed (the reference);
* ``no-op``: instrumented, OpenTelemetry API imported, no SDK configured (the default case
  of an application that uses the API without an SDK);
* ``sdk``: instrumented with an SDK TracerProvider (in-memory exporter) and MeterProvider.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rehydrate import telemetry
from rehydrate._hooks import Registry
from rehydrate._lifecycle import Lifecycle
from rehydrate.env import EnvRefresher
from rehydrate.fingerprint import distributions, fingerprint

HOOKS = 50
ROUNDS = 120


def _engine() -> Lifecycle:
    reg = Registry()
    for i in range(HOOKS):
        reg.register(lambda: None, name=f"h{i}")
    return Lifecycle(reg, env=EnvRefresher(path=None), builtins=False)


def _restore_time(engine: Lifecycle) -> float:
    t0 = time.perf_counter()
    engine.simulate_restore()
    return time.perf_counter() - t0


def _observer_cost(engine: Lifecycle) -> tuple[float, float]:
    """µs per hook for exactly what the runner adds per hook with a no-op observer, and
    µs per event for event_started + event_finished."""
    from rehydrate._context import HookResult, RestoreContext

    tel = telemetry.instrument(engine)
    observers = (tel,)
    hook = engine.hooks("restore")[0]
    ctx = RestoreContext(generation=1, reason="bench", kind="restore")
    result = HookResult(hook.name, hook.phase, "ok", 0.0)
    report = engine.simulate_restore()
    n = 20_000
    best_hook = best_event = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            tokens = [o.hook_started(hook, ctx) for o in observers]
            for o, t in zip(observers, tokens, strict=True):
                o.hook_finished(t, result)
        best_hook = min(best_hook, (time.perf_counter() - t0) / n * 1e6)
        t0 = time.perf_counter()
        for _ in range(n // 10):
            tel.event_started(ctx)
            tel.event_finished(ctx, report)
        best_event = min(best_event, (time.perf_counter() - t0) / (n // 10) * 1e6)
    return best_hook, best_event


def telemetry_rows() -> list[tuple[str, str, str]]:
    import opentelemetry.metrics
    import opentelemetry.trace  # noqa: F401 - the "API imported, no SDK" case
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    bare = _engine()
    noop = _engine()
    telemetry.instrument(noop)
    sdk = _engine()
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    mp = MeterProvider(metric_readers=[InMemoryMetricReader()])
    telemetry.instrument(sdk, tracer_provider=tp, meter_provider=mp)
    if telemetry.instrument(noop).active():  # another module set a global SDK provider
        return [("telemetry no-op overhead per hook", "n/a (a global SDK is configured)",
                 "< 5 µs")]

    times: dict[str, list[float]] = {"bare": [], "noop": [], "sdk": []}
    engines = {"bare": bare, "noop": noop, "sdk": sdk}
    for _ in range(10):  # warm up threads and caches
        for e in engines.values():
            e.simulate_restore()
    for _ in range(ROUNDS):
        for name, e in engines.items():
            times[name].append(_restore_time(e))
        exporter.clear()
    # the lower quartile: end-to-end restores are noisy on a shared 2-core box
    med = {k: statistics.quantiles(v, n=4)[0] for k, v in times.items()}
    per_hook_noop = (med["noop"] - med["bare"]) / HOOKS * 1e6
    per_hook_sdk = (med["sdk"] - med["bare"]) / HOOKS * 1e6
    direct_hook, direct_event = _observer_cost(noop)
    for e in engines.values():
        e.close()
    tp.shutdown()
    mp.shutdown()
    return [
        (f"restore, {HOOKS} hooks: bare / no-op / SDK (lower quartile)",
         f"{med['bare'] * 1e3:.2f} / {med['noop'] * 1e3:.2f} / {med['sdk'] * 1e3:.2f} ms",
         "report"),
        ("telemetry no-op: observer calls per hook (direct)", f"{direct_hook:.2f} µs",
         "< 5 µs"),
        ("telemetry no-op: per event (provider lookup)", f"{direct_event:.2f} µs", "report"),
        ("telemetry no-op overhead per hook (end to end, noisy)", f"{per_hook_noop:.2f} µs",
         "< 5 µs"),
        ("telemetry SDK overhead per hook (span + metrics)", f"{per_hook_sdk:.1f} µs", "report"),
    ]


def fingerprint_rows() -> list[tuple[str, str, str]]:
    fingerprint(nvidia_smi=False)  # warm the import system's caches once
    full = [0.0] * 15
    dists = [0.0] * 15
    for i in range(15):
        t0 = time.perf_counter()
        fingerprint(env_keys=("HOME", "PATH"), nvidia_smi=False)
        full[i] = time.perf_counter() - t0
        t0 = time.perf_counter()
        distributions()
        dists[i] = time.perf_counter() - t0
    cold = subprocess.run(
        [sys.executable, "-c",
         "import time; from rehydrate.fingerprint import fingerprint; t = time.perf_counter(); "
         "fingerprint(nvidia_smi=False); print(time.perf_counter() - t)"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    return [
        ("fingerprint() first call in a fresh process",
         f"{float(cold.stdout) * 1e3:.1f} ms", "< 50 ms"),
        ("fingerprint() without nvidia-smi (median)",
         f"{statistics.median(full) * 1e3:.1f} ms", "< 50 ms"),
        ("  of which: installed distributions list",
         f"{statistics.median(dists) * 1e3:.1f} ms ({len(distributions())} dists)", "report"),
    ]


def run() -> list[tuple[str, str, str]]:
    return telemetry_rows() + fingerprint_rows()


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    from run import main  # benchmarks/ is on sys.path when a module runs as a script

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
