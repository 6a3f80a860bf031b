"""Generic detectors: clock-jump detection latency, and idle CPU of start(detectors="auto").

* Clock-jump latency: a child process runs the clock-jump detector at its defaults
  (interval 0.5 s, threshold 2 s) and is really frozen with SIGSTOP for 2.6 s, then
  continued; latency = first restore hook start - SIGCONT (both CLOCK_MONOTONIC, which
  is system-wide on Linux). Three freezes, one child.
* Idle CPU: a child calls ``rehydrate.start(detectors="auto")`` and then idles; its CPU
  time (all threads) over 10 s, as a share of one core. A child that only imports
  rehydrate idles beside it as the baseline.

The children run side by side, so the whole benchmark takes about 11 s.

Run alone: ``python benchmarks/bench_detect_generic.py``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IDLE_SECONDS = 10.0
FREEZES = 3
FREEZE_SECONDS = 2.6

_CLOCK_CHILD = textwrap.dedent("""
    import json, os, sys, time
    from rehydrate.testing import isolated_engine
    from rehydrate.detect.clock_jump import ClockJumpDetector

    def say(**kw):
        sys.stdout.write(json.dumps(kw) + "\\n"); sys.stdout.flush()

    engine = isolated_engine()
    engine.registry.after_restore(lambda ctx: say(at=time.monotonic(),
                                                  frozen_for=ctx.frozen_for))
    det = ClockJumpDetector()
    engine.start([det])
    say(ready=os.getpid(), interval=det.interval, threshold=det.threshold)
    sys.stdin.read()  # until the parent closes stdin
""")

_IDLE_CHILD = textwrap.dedent("""
    import json, sys, time
    import rehydrate
    names = rehydrate.start(detectors="auto") if sys.argv[1] == "auto" else []
    time.sleep(0.5)  # let every detector settle into its wait
    c0, w0 = time.process_time(), time.monotonic()
    time.sleep(float(sys.argv[2]))
    c1, w1 = time.process_time(), time.monotonic()
    print(json.dumps({"cpu": c1 - c0, "wall": w1 - w0, "detectors": names}))
""")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("REHYDRATE_MARKER_FILE", "REHYDRATE_CLOCK_INTERVAL",
                 "REHYDRATE_CLOCK_THRESHOLD"):
        env.pop(name, None)
    return env


def _idle(mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _IDLE_CHILD, mode, str(IDLE_SECONDS)],
                            stdout=subprocess.PIPE, text=True, env=_env())


def _clock_latency() -> tuple[list[float], float, float]:
    child = subprocess.Popen([sys.executable, "-c", _CLOCK_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=_env())
    assert child.stdout is not None and child.stdin is not None
    try:
        ready = json.loads(child.stdout.readline())
        latencies = []
        for _ in range(FREEZES):
            time.sleep(ready["interval"] * 2)  # a couple of ordinary ticks first
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(FREEZE_SECONDS)  # the freeze itself
            resumed = time.monotonic()
            os.kill(child.pid, signal.SIGCONT)
            line = child.stdout.readline()
            if not line:
                raise RuntimeError("clock-jump child exited")
            latencies.append(json.loads(line)["at"] - resumed)
        return latencies, ready["interval"], ready["threshold"]
    finally:
        child.stdin.close()
        child.wait(10)


def run() -> list[tuple[str, str, str]]:
    auto, base = _idle("auto"), _idle("none")
    latencies, interval, threshold = _clock_latency()
    out_auto, _ = auto.communicate(timeout=IDLE_SECONDS + 60)
    out_base, _ = base.communicate(timeout=IDLE_SECONDS + 60)
    a, b = json.loads(out_auto), json.loads(out_base)
    share_auto = 100.0 * a["cpu"] / a["wall"]
    share_base = 100.0 * b["cpu"] / b["wall"]
    med, worst = statistics.median(latencies) * 1e3, max(latencies) * 1e3
    return [
        (f"clock-jump detection latency (interval {interval:g}s, threshold {threshold:g}s, "
         f"{FREEZES} real {FREEZE_SECONDS:g}s SIGSTOP freezes)",
         f"median {med:.1f} ms, max {worst:.1f} ms", f"< {interval * 1e3:.0f} ms"),
        (f"idle CPU, start(detectors='auto') over {IDLE_SECONDS:g}s "
         f"[{', '.join(a['detectors']) or 'none'}]",
         f"{share_auto:.3f} % of one core (import only: {share_base:.3f} %)", "< 0.2 %"),
    ]


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    from run import main  # benchmarks/ is on sys.path when a module runs as a script

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
