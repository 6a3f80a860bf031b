"""A checkpoint taken while a restore's hooks run, under real runsc (clock jump only).

Clone A (restored from the original's image) runs its restore hooks; the workload's hook
blocks until ``/var/tmp/release`` exists in that container. While it blocks, A is
checkpointed (``--leave-running``) and clone B is restored from that image: B wakes in
the middle of A's run — A's new key and instance id already made, the hook still
waiting. B's memory is A's, so its clock-jump thread was the one waiting for that run
and never saw B's own freeze: B finished A's run and became ready with A's key and
instance id ("keys are never reused across clones", "exactly one run per restore").

Now the freeze watch stays alive while a run is in progress: B's freeze gets exactly
one more full run after the one it carried on (generation 2, kind ``restore``, a new key
and instance id), and B's ``is_ready()`` is never True before that run's hook finished.
A, which kept running, finishes its own run; its own short freeze is what it is — a
restore only when its clock jump reported it as one (a dump longer than the threshold).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .harness import Container, GVisorHarness, Mount
from .restore_helpers import (
    GAP,
    PROC,
    frozen_until,
    hook_runs,
    write_spec_environ,
)

WORKLOAD = f"""
import json, os, threading, time
import rehydrate, rehydrate.keys

out = open("/results/ev.jsonl", "a", buffering=1)
lock = threading.Lock()
key = rehydrate.keys.ephemeral("session", "ed25519")
RELEASE = "/var/tmp/release"

def emit(**rec):
    with lock:
        out.write(json.dumps(rec) + "\\n")

def ident():
    return dict(instance_id=rehydrate.instance_id(), key=key.public_bytes_raw().hex())

@rehydrate.after_restore(name="app.slow_restore", timeout=600)
def slow_restore(ctx):
    emit(event="hook-start", reason=ctx.reason, kind=ctx.kind, generation=ctx.generation,
         at=time.monotonic(), **ident())
    while not os.path.exists(RELEASE):  # the test says when this hook may finish
        time.sleep(0.02)
    emit(event="hook", reason=ctx.reason, kind=ctx.kind, generation=ctx.generation,
         at=time.monotonic(), **ident())

detectors = rehydrate.start(["clock-jump"])  # only the clock jump watches
clock = rehydrate.default_engine.detector("clock-jump")
rehydrate.default_engine.add_status("test_jumps", lambda: clock.jumps)
emit(event="ready", detectors=detectors, **ident())
was = True
last = time.monotonic()
while True:
    time.sleep(0.001)
    now = time.monotonic()
    if now - last > {GAP}:  # this loop was frozen: the process has just resumed
        emit(event="resumed", frozen_at=last, gap=now - last, ready=rehydrate.is_ready(),
             at=time.monotonic())
    ready = rehydrate.is_ready()
    if ready != was:  # every change of readiness, after the reading
        st = rehydrate.status()
        emit(event="readiness", ready=ready, at=time.monotonic(), generation=st.generation,
             jumps=clock.jumps, **(ident() if ready else {{}}))
        was = ready
    last = now
"""


def _start(gvisor: GVisorHarness, tmp_path: Path) -> Container:
    proc = tmp_path / "proc-midrun"
    write_spec_environ(proc, {"APP": "original"})
    env = {"APP": "original", "REHYDRATE_GVISOR_PROC": PROC}
    return gvisor.run([sys.executable, "-c", WORKLOAD], env=env, mounts=[Mount(PROC, proc)],
                      name="midrun")


def _restore(gvisor: GVisorHarness, tmp_path: Path, template: Container,
             name: str) -> Container:
    proc = tmp_path / f"proc-{name}"
    write_spec_environ(proc, {"APP": name})
    assert template.image is not None
    return gvisor.restore(template.image, template, name=name, mounts=[Mount(PROC, proc)])


def _release(c: Container) -> None:
    assert c.exec(["/bin/touch", "/var/tmp/release"], timeout=60).returncode == 0


def _records(c: Container, event: str) -> list[dict[str, Any]]:
    return [r for r in c.records("ev.jsonl") if r["event"] == event]


def _runs(c: Container) -> list[tuple[str, str, int]]:
    return [(r["reason"], r["kind"], r["generation"]) for r in hook_runs(c)]


@pytest.mark.gvisor
def test_a_clone_checkpointed_mid_run_gets_a_run_of_its_own(
        gvisor_uncompressed: GVisorHarness, tmp_path: Path) -> None:
    gvisor = gvisor_uncompressed
    orig = _start(gvisor, tmp_path)
    start = orig.wait_for("ev.jsonl", lambda r: r["event"] == "ready", timeout=90)
    assert start["detectors"] == ["clock-jump"], start  # nothing is told about checkpoints
    orig.checkpoint()
    frozen_until(time.monotonic())
    a = _restore(gvisor, tmp_path, orig, "midrun-A")
    # A's run has made A's key and instance id; its hook now waits to be released.
    a_run = a.wait_for("ev.jsonl", lambda r: r["event"] == "hook-start", timeout=60)
    assert (a_run["reason"], a_run["kind"], a_run["generation"]) == (
        "clock-jump", "restore", 1), a_run
    assert (a_run["instance_id"], a_run["key"]) != (start["instance_id"], start["key"])

    t_checkpoint = time.monotonic()
    a.checkpoint(leave_running=True)  # mid-run: A's restore hooks are running
    frozen_until(t_checkpoint)
    b = _restore(gvisor, tmp_path, a, "midrun-B")
    resumed = b.wait_for("ev.jsonl", lambda r: r["event"] == "resumed", timeout=60)
    assert resumed["ready"] is False, resumed
    _release(b)
    ready = b.wait_for("ev.jsonl", lambda r: r["event"] == "readiness" and r["ready"],
                       timeout=60)
    # B finished the run it woke up in (A's: generation 1, A's identity), then ran its own.
    runs = hook_runs(b)
    assert _runs(b) == [("clock-jump", "restore", 1), ("clock-jump", "restore", 2)], runs
    carried, own = runs
    assert (carried["instance_id"], carried["key"]) == (a_run["instance_id"], a_run["key"])
    assert own["instance_id"] != a_run["instance_id"], (own, a_run)
    assert own["key"] != a_run["key"], (own, a_run)
    # Never ready before its own run's hook finished, and ready with its own identity.
    assert ready["at"] > own["at"], (ready, own)
    assert (ready["generation"], ready["instance_id"], ready["key"]) == (
        2, own["instance_id"], own["key"]), (ready, own)
    assert all(r["at"] > own["at"] for r in _records(b, "readiness") if r["ready"]), (
        _records(b, "readiness"), own)
    assert [r["generation"] for r in _records(b, "hook-start")] == [2], (
        _records(b, "hook-start"))  # exactly one more run (the carried one began in A)

    # A kept running: its run finishes once released; its own freeze was a restore only
    # if its clock jump reported one (a dump longer than the threshold).
    _release(a)
    a_ready = a.wait_for("ev.jsonl", lambda r: r["event"] == "readiness" and r["ready"],
                         timeout=60)
    a_runs = hook_runs(a)
    assert a_runs and (a_runs[0]["instance_id"], a_runs[0]["key"]) == (
        a_run["instance_id"], a_run["key"]), a_runs
    jumps = a_ready["jumps"]  # final: A's freeze was weighed before it was released
    assert len(a_runs) == jumps, (a_runs, jumps)
    assert _runs(a) == [("clock-jump", "restore", g) for g in range(1, jumps + 1)], a_runs
    assert a_ready["instance_id"] == a_runs[-1]["instance_id"], (a_ready, a_runs)
    if jumps == 1:  # A carried on as itself: same identity as before the checkpoint
        assert a_ready["key"] == a_run["key"], (a_ready, a_run)
    for rec in (a_ready, *a_runs[1:]):
        assert rec["key"] != own["key"] and rec["instance_id"] != own["instance_id"], (
            rec, own)

