"""End to end under real gVisor: a rehydrate workload checkpointed with ``runsc checkpoint``
and restored with ``runsc restore`` into three clones (issue 3).

What is real: the sandbox, the checkpoint image, the restored process memory and its
clock, the control socket on the sandbox's tmpfs, and ``rehydrate notify`` run inside the
sandbox with ``runsc exec`` (as gVisor's save-restore-exec would run it). What is
emulated: ``/proc/gvisor`` — neither Debian runsc release has it — by a bind-mounted
directory holding ``spec_environ`` (``REHYDRATE_GVISOR_PROC`` points there). It has no
``checkpoint`` file, so the only restore signal in a clone is the clock jump (and the
notify the test sends).

One checkpoint serves every assertion: before it, ``notify save`` is run twice (first with
a required before-snapshot hook failing: non-zero exit, then succeeding); after it, each
clone gets its own ``spec_environ`` (a key changed, a key added, a key removed) and must
run its restore hooks once, with reason ``clock-jump``, generation 1 and the new
environment applied; ``notify restore`` in each clone then must not run them again. A
fourth clone gets ``notify restore`` at once, racing the clock-jump detector: whichever
comes first runs the hooks, the other is a duplicate, and the count is still 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .harness import Container, GVisorHarness, Mount

PROC = "/etc/rehydrate-gvisor"  # REHYDRATE_GVISOR_PROC: holds spec_environ, no checkpoint
SOCKET = "/var/tmp/rehydrate.sock"  # on the sandbox's tmpfs
FAIL_FLAG = "/var/tmp/fail-prepare"  # exists: the required before-snapshot hook fails
REHYDRATE = str(Path(sys.executable).parent / "rehydrate")  # the venv's console script
THRESHOLD = 1.0  # clock-jump threshold in the workload (default is 2.0)
FROZEN = 2.5  # seconds between the checkpoint and the first restore (> THRESHOLD + interval)

WORKLOAD = f"""
import json, os, threading, time
import rehydrate

out = open("/results/events.jsonl", "a", buffering=1)
lock = threading.Lock()
calls = {{"restore": 0, "resume": 0, "snapshot": 0, "env": 0}}

def emit(**rec):
    with lock:
        out.write(json.dumps(rec) + "\\n")

@rehydrate.after_restore(name="app.after_restore")
def after_restore(ctx):
    calls[ctx.kind] += 1
    ch = ctx.env_changes
    emit(event="after_restore", reason=ctx.reason, kind=ctx.kind, generation=ctx.generation,
         calls=calls[ctx.kind], frozen_for=ctx.frozen_for,
         added=list(ch.added), changed=list(ch.changed), removed=list(ch.removed),
         test_key=os.environ.get("TEST_KEY"), drop_key=os.environ.get("DROP_KEY"),
         added_key=os.environ.get("ADDED_KEY"), keep_key=os.environ.get("KEEP_KEY"))

@rehydrate.on_env_change("TEST_KEY", "DROP_KEY")
def env_changed(ctx, changes):
    calls["env"] += 1
    emit(event="env_change", keys=sorted(changes.keys), calls=calls["env"],
         test_key=os.environ.get("TEST_KEY"))

@rehydrate.before_snapshot(name="app.before_snapshot")
def before_snapshot(ctx):
    calls["snapshot"] += 1
    failing = os.path.exists({FAIL_FLAG!r})
    emit(event="before_snapshot", calls=calls["snapshot"], failing=failing,
         pid=os.getpid())
    if failing:
        raise RuntimeError("not ready to be snapshotted (test flag)")

detectors = rehydrate.start()
engine = rehydrate.default_engine
clock = engine.detector("clock-jump")

def clock_status():
    last = clock.last_report
    return {{"jumps": clock.jumps, "pending": clock.pending,
            "last": None if last is None else
                    {{"reason": last.reason, "generation": last.generation,
                     "started_at": last.started_at}}}}

engine.add_status("test_clock", clock_status)
emit(event="ready", detectors=detectors, pid=os.getpid())
while True:
    time.sleep(3600)
"""


def _spec_environ(path: Path, env: dict[str, str]) -> None:
    path.write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


def _rehydrate(c: Container, *args: str, timeout: float = 60) -> Any:
    """Run the venv's ``rehydrate`` console script inside the sandbox."""
    return c.exec([REHYDRATE, *args], timeout=timeout)


def _status(c: Container) -> dict[str, Any]:
    proc = _rehydrate(c, "status", "--json")
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def _restore_runs(c: Container) -> list[dict[str, Any]]:
    return [r for r in c.records("events.jsonl")
            if r["event"] == "after_restore" and r["kind"] == "restore"]


def _wait_clock_done(c: Container, timeout: float = 30.0) -> dict[str, Any]:
    """Poll the clone's status (over its control socket) until the clock-jump detector has
    seen the restore and finished its notice (run or recognised as a duplicate)."""
    deadline = time.monotonic() + timeout
    while True:
        status = _status(c)
        clock = status["test_clock"]
        if clock["jumps"] >= 1 and not clock["pending"] and clock["last"] is not None:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"clock-jump detector of {c.id} never finished: {clock}")
        time.sleep(0.1)


@pytest.mark.gvisor
def test_checkpoint_notify_and_restore_into_three_clones(
    gvisor: GVisorHarness, tmp_path: Path
) -> None:
    original_env = {"TEST_KEY": "old", "DROP_KEY": "going", "KEEP_KEY": "kept"}
    proc_dir = tmp_path / "proc-original"
    proc_dir.mkdir()
    _spec_environ(proc_dir / "spec_environ", original_env)
    orig = gvisor.run(
        [sys.executable, "-c", WORKLOAD],
        env={
            **original_env,  # gVisor's spec_environ is the spec's process environment
            "REHYDRATE_GVISOR_PROC": PROC,
            "REHYDRATE_CONTROL_SOCKET": SOCKET,
            "REHYDRATE_CLOCK_THRESHOLD": str(THRESHOLD),
        },
        mounts=[Mount(PROC, proc_dir)],
        name="e2e",
    )
    ready = orig.wait_for("events.jsonl", lambda r: r["event"] == "ready", timeout=60)
    assert "clock-jump" in ready["detectors"] and "control" in ready["detectors"], ready
    assert "gvisor" not in ready["detectors"], "the stand-in has no checkpoint file"

    # -- notify save, failing: a required before-snapshot hook raises -> non-zero exit,
    #    and the resume hooks run (the platform aborts the checkpoint).
    orig.exec(["/bin/touch", FAIL_FLAG], check=True)
    failed = _rehydrate(orig, "notify", "save")
    assert failed.returncode == 1, (failed.returncode, failed.stdout, failed.stderr)
    assert "app.before_snapshot" in failed.stderr, failed.stderr
    events = orig.records("events.jsonl")
    assert [r for r in events if r["event"] == "before_snapshot"] == [
        {"event": "before_snapshot", "calls": 1, "failing": True, "pid": 1}
    ], "the hook ran inside the sandbox, in the workload (PID 1)"
    resumed = [r for r in events if r["event"] == "after_restore"]
    assert [(r["kind"], r["reason"], r["generation"]) for r in resumed] == [
        ("resume", "control", 0)
    ], resumed

    # -- notify save, succeeding: exit 0 only after the hook ran; the report shows it.
    orig.exec(["/bin/rm", FAIL_FLAG], check=True)
    saved = _rehydrate(orig, "notify", "save", "--json")
    assert saved.returncode == 0, (saved.returncode, saved.stdout, saved.stderr)
    reply = json.loads(saved.stdout)
    assert reply["ok"] is True
    hooks = {h["name"]: h["outcome"] for h in reply["report"]["hooks"]}
    assert hooks["app.before_snapshot"] == "ok", hooks
    last_save = orig.records("events.jsonl")[-1]
    assert last_save == {"event": "before_snapshot", "calls": 2, "failing": False, "pid": 1}

    # -- checkpoint; meanwhile give each clone its own new spec_environ.
    t_checkpoint = time.monotonic()
    image = orig.checkpoint()
    clone_envs = []
    mounts = []
    for k in range(4):
        env = {"TEST_KEY": f"new-{k}", "KEEP_KEY": "kept", "ADDED_KEY": f"added-{k}"}
        d = tmp_path / f"proc-clone{k}"
        d.mkdir()
        _spec_environ(d / "spec_environ", env)
        clone_envs.append(env)
        mounts.append(Mount(PROC, d))
    # The freeze must be long enough for the clock-jump detector (threshold 1 s).
    while time.monotonic() - t_checkpoint < FROZEN:
        time.sleep(0.05)

    # Clone 3 first: notify restore right away, racing the clock-jump detector.
    racer = gvisor.restore(image, orig, name="racer", mounts=[mounts[3]])
    raced = _rehydrate(racer, "notify", "restore", "--json")
    clones = [gvisor.restore(image, orig, name=f"clone{k}", mounts=[mounts[k]])
              for k in range(3)]

    # -- (a) every clone runs its restore hooks once: clock-jump, generation 1, new env.
    for k, clone in enumerate(clones):
        rec = clone.wait_for(
            "events.jsonl", lambda r: r["event"] == "after_restore", timeout=30
        )
        assert (rec["reason"], rec["kind"], rec["generation"], rec["calls"]) == (
            "clock-jump", "restore", 1, 1), rec
        assert rec["frozen_for"] >= FROZEN - 1.0, rec
        assert rec["test_key"] == f"new-{k}", "os.environ shows the clone's new value"
        assert rec["added_key"] == f"added-{k}"
        assert rec["drop_key"] is None, "a key the new spec_environ lacks is removed"
        assert rec["keep_key"] == "kept"
        assert (rec["added"], rec["changed"], rec["removed"]) == (
            ["ADDED_KEY"], ["TEST_KEY"], ["DROP_KEY"]), rec
        env_rec = clone.wait_for("events.jsonl", lambda r: r["event"] == "env_change")
        assert env_rec["keys"] == ["DROP_KEY", "TEST_KEY"] and env_rec["calls"] == 1
        assert env_rec["test_key"] == f"new-{k}"

    # -- (b) notify restore after the clock jump: a duplicate; the hooks do not run again.
    for clone in clones:
        status = _wait_clock_done(clone)
        assert status["generation"] == 1 and status["state"] == "ready", status
        proc = _rehydrate(clone, "notify", "restore", "--json")
        assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
        report = json.loads(proc.stdout)["report"]
        assert (report["reason"], report["generation"], report["ok"]) == (
            "clock-jump", 1, True), "notify answers with the run that already happened"
        assert "app.after_restore" in {h["name"] for h in report["hooks"]}
        assert _status(clone)["generation"] == 1
        runs = _restore_runs(clone)
        assert len(runs) == 1, runs

    # -- (b) the racer: notify restore and the clock jump both fired; hooks ran once.
    assert raced.returncode == 0, (raced.returncode, raced.stdout, raced.stderr)
    report = json.loads(raced.stdout)["report"]
    status = _wait_clock_done(racer)
    runs = _restore_runs(racer)
    assert len(runs) == 1, runs
    run = runs[0]
    assert (run["generation"], run["calls"], run["test_key"]) == (1, 1, "new-3"), run
    assert report["reason"] == run["reason"] and report["generation"] == 1, (report, run)
    # The clock-jump detector's notice returned the same report, whoever came first.
    assert status["test_clock"]["last"]["started_at"] == report["started_at"], status
    assert status["generation"] == 1, status
    print(f"\nracer: notify restore vs clock jump -> hooks ran for {run['reason']!r}")
