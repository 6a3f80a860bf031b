"""The restore path under real runsc: resume -> ready per configuration, and the notifier.

Everything runs in real gVisor sandboxes (the test harness, ``tests/gvisor/harness.py``;
root and trixie's runsc needed — without them the table says so in one row). One workload
loop per sandbox sleeps 1 ms at a time; when a sleep comes back more than 1 s late the
process has just been restored, and it then waits for readiness and writes one record.

* restore -> ready: from the start of ``runsc restore`` (host clock) until the clone's
  record appears in its results file (polled every 2 ms), median of the clones; beside
  it the same for a bare workload (no rehydrate: its record is written at once), and the
  ratio. This is what a user sees: platform restore plus rehydrate.
* resume -> ready (rehydrate's share): inside the clone, from the loop's first moment
  after the freeze to ``wait_ready()`` returning (the hooks ran), median.
* Configurations: clock-jump only; ``REHYDRATE_CONTROL_SOCKET`` set and no notice;
  ``runsc exec … rehydrate notify restore`` sent right after the restore (the notice
  races the clock jump; the first one runs the hooks); ``notify save`` before the
  checkpoint and no notice after the restore (the clock jump with the snapshot pending).
* leave-running: ``notify save``, then ``runsc checkpoint --leave-running``; the time
  from the start of the checkpoint command until the original ran its hooks and is
  ready again (no ``notify resume``), beside the checkpoint command's own duration.
* notifier start: ``runsc exec`` of each form of the notifier (``rehydrate-notify``,
  ``rehydrate notify``, ``python -m rehydrate notify``, the last also with ``-S``) against
  a running clone (its restore already handled, so the notice is only confirmed and the
  time is the notifier's own), median (and best) of 15, beside ``runsc exec`` of ``/bin/true``,
  ``python -S -c pass`` and ``python -c pass``.

Clones and execs go round robin over the configurations, so that load drifting during
the run (a shared 2-core host) hits each of them alike.

With ``BENCH_BASELINE_TREE=DIR`` (a checkout of an older commit, e.g. ``git worktree add
DIR COMMIT``) the clock-jump configuration also runs on that checkout's rehydrate, in the
same round robin (as does the ``notify save`` one): old and new side by side.
``BENCH_CLONES=N`` sets the clones per configuration (default 5).

Run alone: ``python benchmarks/bench_restore_path.py`` (as root).
"""

from __future__ import annotations

import compileall
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.gvisor.harness import (  # noqa: E402 - the harness lives in the test tree
    Container,
    GVisorHarness,
    find_runsc,
    runsc_available,
    supports_uncompressed_checkpoint,
)

# BENCH_CLONES: more clones per configuration narrow the medians (a comparison
# of two trees wants 15 or more; one clone's figure spans 3x on a shared host).
CLONES = int(os.environ.get("BENCH_CLONES", "5"))
EXECS = 15
FROZEN = 2.5
SOCKET = "/var/tmp/rehydrate.sock"
BIN = Path(sys.executable).parent

_WORKLOAD = """
import json, os, time
BARE = os.environ["MODE"] == "bare"
if not BARE:
    import rehydrate
    rehydrate.after_restore(name="app.after_restore")(lambda: None)
    rehydrate.start()
out = open("/results/ev.jsonl", "a", buffering=1)
out.write(json.dumps({"event": "started"}) + "\\n")
last = time.monotonic()
while True:
    time.sleep(0.001)
    now = time.monotonic()
    if now - last > 1.0:
        if not BARE:
            rehydrate.wait_ready(timeout=30)
        out.write(json.dumps({"event": "ready", "resume_to_ready": time.monotonic() - now})
                  + "\\n")
    last = now
"""


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} ms"


LEAVE_RUNNING_WAIT = 20.0
"""How long the leave-running row waits for the original to be ready again."""


def _wait(check: Callable[[], bool], timeout: float = 60.0, interval: float = 0.002) -> float:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the workload never reported")
        time.sleep(interval)
    return time.monotonic()


def _records(c: Container) -> list[dict[str, Any]]:
    return [r for r in c.records("ev.jsonl") if r.get("event") == "ready"]


def _start(h: GVisorHarness, name: str, mode: str, socket: bool,
           tree: str | None = None) -> Container:
    env = {"MODE": mode}
    if socket:
        env["REHYDRATE_CONTROL_SOCKET"] = SOCKET
    if tree:  # rehydrate imported from an older checkout
        env["PYTHONPATH"] = tree
    c = h.run([sys.executable, "-c", _WORKLOAD], env=env, name=name)
    c.wait_for("ev.jsonl", lambda r: r["event"] == "started", timeout=60)
    return c


def _clone_once(h: GVisorHarness, image: Path, orig: Container, name: str,
                notify: bool) -> tuple[float, float]:
    """(restore -> ready on the host, resume -> ready in the clone) for one clone."""
    t0 = time.monotonic()
    clone = h.restore(image, orig, name=name)
    notifier = None
    if notify:  # sent at once and not waited for: the platform's notice racing the clock
        notifier = subprocess.Popen(
            h.command("exec", clone.id, str(BIN / "rehydrate"), "notify", "restore"),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t1 = _wait(lambda: bool(_records(clone)))
    finally:
        if notifier is not None:
            notifier.wait(timeout=60)
    inside = _records(clone)[0]["resume_to_ready"]
    h.kill(clone)
    h.delete(clone)
    return t1 - t0, inside


def _exec_times(h: GVisorHarness, c: Container, argv: list[str], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        proc = h.exec(c, argv, timeout=60)
        times.append(time.monotonic() - t0)
        if proc.returncode != 0:
            raise RuntimeError(f"{argv} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return times


def run() -> list[tuple[str, str, str]]:
    why = runsc_available()
    runsc = find_runsc()
    if why is None and runsc is not None and not supports_uncompressed_checkpoint(runsc):
        why = f"{runsc} is not trixie's runsc (scripts/install-runsc.sh)"
    if why is not None or runsc is None:  # `make bench` as a user: say so, measure the rest
        return [("restore path under runsc", f"not measured: {why}", "root + trixie runsc")]
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="rh-bench-restore-") as tmp, \
            GVisorHarness(Path(tmp), runsc=runsc, debug_log=False) as h:
        origs = {"bare": _start(h, "bare", "bare", False),
                 "clock": _start(h, "clock", "rehydrate", False),
                 "sock": _start(h, "sock", "rehydrate", True),
                 "save": _start(h, "save", "rehydrate", True)}
        h.exec(origs["save"], [str(BIN / "rehydrate"), "notify", "save"], timeout=60,
               check=True)
        baseline = os.environ.get("BENCH_BASELINE_TREE")
        if baseline:
            tree = str(Path(baseline).resolve())
            origs["old"] = _start(h, "old", "rehydrate", False, tree)
            origs["oldsave"] = _start(h, "oldsave", "rehydrate", True, tree)
            h.exec(origs["oldsave"], [str(BIN / "rehydrate"), "notify", "save"], timeout=60,
                   check=True)
        t = time.monotonic()
        images = {key: h.checkpoint(c) for key, c in origs.items()}
        while time.monotonic() - t < FROZEN:
            time.sleep(0.05)
        configs = [("bare process (no rehydrate)", "bare", False),
                   ("clock-jump only", "clock", False),
                   ("control socket set, no notify", "sock", False),
                   ("notify restore right after restore", "sock", True),
                   ("notify save before, no notice after", "save", False)]
        if baseline:
            configs.append((f"clock-jump only, baseline tree {baseline}", "old", False))
            configs.append((f"notify save before, no notice after, baseline tree {baseline}",
                            "oldsave", False))
        outside: dict[str, list[float]] = {name: [] for name, _, _ in configs}
        inside: dict[str, list[float]] = {name: [] for name, _, _ in configs}
        for k in range(CLONES):  # round robin: load drift hits every configuration alike
            for name, key, notify in configs:
                out, ins = _clone_once(h, images[key], origs[key], f"{key}{int(notify)}-{k}",
                                       notify)
                outside[name].append(out)
                inside[name].append(ins)
        bare = statistics.median(outside[configs[0][0]])
        rows.append((f"restore -> ready, median: {configs[0][0]} ({CLONES} clones each)",
                     _ms(outside[configs[0][0]]), "baseline"))
        for name, _, _ in configs[1:]:
            ratio = statistics.median(outside[name]) / bare
            rows.append((f"restore -> ready, median: {name}",
                         f"{_ms(outside[name])} ({ratio:.2f}x bare)", "close to bare"))
            rows.append((f"  resume -> ready inside the clone: {name}", _ms(inside[name]),
                         "median < 20 ms"))

        saved = _start(h, "saved", "rehydrate", True)
        h.exec(saved, [str(BIN / "rehydrate"), "notify", "save"], timeout=60, check=True)
        t0 = time.monotonic()
        h.checkpoint(saved, leave_running=True)
        t_cmd = time.monotonic() - t0
        try:
            t_ready = _wait(lambda: '"ready": true' in h.exec(
                saved, [str(BIN / "rehydrate"), "status", "--json"], timeout=60).stdout,
                timeout=LEAVE_RUNNING_WAIT, interval=0.05) - t0
            ready = f"{t_ready * 1000:.0f} ms"
        except TimeoutError:
            # A small process's checkpoint can freeze it for less than the clock-jump
            # detector's pending threshold plus one wake-up (docs/platforms/runsc.md): then
            # only `notify resume` or the snapshot deadline ends it. A row, not a crash
            # that lost every other row (2 runs in 5 on a loaded 2-core host).
            ready = (f"not within {LEAVE_RUNNING_WAIT:.0f} s (freeze too short to see; "
                     "send notify resume)")
        rows.append(("leave-running: checkpoint start -> original ready (no notify resume)",
                     f"{ready} (checkpoint command {t_cmd * 1000:.0f} ms)",
                     "a few seconds"))

        clone = h.restore(images["sock"], origs["sock"], name="notifier")
        _wait(lambda: bool(_records(clone)))
        # The sandbox sees the host's / read-only: a stale or missing .pyc would be compiled
        # at every start in there (an installed package has its .pyc written at install).
        compileall.compile_dir(REPO / "rehydrate", quiet=1)
        forms = {
            "/bin/true": ["/bin/true"],
            "python -S -c pass": [sys.executable, "-S", "-c", "pass"],
            "python -c pass": [sys.executable, "-c", "pass"],
            "rehydrate-notify restore": [str(BIN / "rehydrate-notify"), "restore"],
            "rehydrate notify restore": [str(BIN / "rehydrate"), "notify", "restore"],
            "python -m rehydrate notify restore": [sys.executable, "-m", "rehydrate",
                                                   "notify", "restore"],
            # the harness puts the repository on PYTHONPATH: -S only skips site
            "python -S -m rehydrate notify restore": [sys.executable, "-S", "-m", "rehydrate",
                                                      "notify", "restore"],
        }
        times: dict[str, list[float]] = {label: [] for label in forms}
        for _ in range(EXECS):  # round robin, like the clones
            for label, argv in forms.items():
                times[label].extend(_exec_times(h, clone, argv, 1))
        def start(label: str) -> str:  # the best run beside the median: load only adds
            return f"{_ms(times[label])} (best {min(times[label]) * 1000:.0f} ms)"

        python = statistics.median(times["python -c pass"])
        rows.append(("notifier: runsc exec /bin/true", start("/bin/true"), "floor"))
        rows.append(("notifier: runsc exec python -S -c pass", start("python -S -c pass"),
                     "interpreter without site"))
        rows.append(("notifier: runsc exec python -c pass", start("python -c pass"),
                     "interpreter"))
        for label in list(forms)[3:]:
            median = statistics.median(times[label])
            rows.append((f"notifier: runsc exec {label}",
                         f"{start(label)}, {median / python:.2f}x python -c pass "
                         f"(+{(median - python) * 1000:.0f} ms)",
                         "close to python -c pass"))
    return rows


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    from run import main  # benchmarks/ is on sys.path when a module runs as a script

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
