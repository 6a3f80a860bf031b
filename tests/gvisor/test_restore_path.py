"""The restore path under real runsc, for each configuration a user deploys (issue 10).

Every clone runs a loop that asks ``rehydrate.is_ready()`` the moment it notices it was
frozen (its 1 ms sleep came back seconds late): it must never see True before that
restore's hooks ran (0 of N clones), ``wait_ready()`` must return only once the hooks ran,
which run as soon as the restore is seen (no fixed grace), and exactly once per restore.

Configurations (one checkpoint image each, shared by the clones of that configuration):

* clock-jump only (no control socket);
* ``REHYDRATE_CONTROL_SOCKET`` set, no ``notify`` at all;
* the same image, and a late ``notify restore`` (no ``notify save`` before the
  checkpoint): a duplicate, flagged as such;
* ``notify save`` before the checkpoint and no notice after the restore: the clock jump
  alone, with the snapshot pending in every clone;
* ``notify save`` + ``runsc checkpoint --leave-running`` (trixie's runsc): the original
  is ready again within a few seconds of the checkpoint without ``notify resume``; its
  clones get ``notify restore`` right away (racing the clock jump): one run;
* the same for a bare interpreter whose clock-jump thread sleeps 5 s at a time: each
  short leave-running checkpoint is still seen (the detector watches in short slices
  while a snapshot is pending), also right after a ``SIGSTOP``/``SIGCONT`` stop.

What is emulated: ``/proc/gvisor`` (neither Debian runsc has it) by a bind-mounted
directory with ``spec_environ`` only, so the detectors in play are the clock jump and
the control socket — the configurations without the gVisor waiter.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .harness import Container, GVisorHarness, Mount
from .restore_helpers import (
    GAP,
    PROC,
    REHYDRATE,
    SOCKET,
    frozen_until,
    hook_runs,
    notify,
    restored,
    status_until,
    write_spec_environ,
)

WORKLOAD = f"""
import json, os, threading, time
import rehydrate

out = open("/results/ev.jsonl", "a", buffering=1)
# A workload of some size (a model): its dump freezes it for longer than a tiny process's
ballast = os.urandom(int(os.environ.get("BALLAST_MB", "0")) << 20)
lock = threading.Lock()
hooks = []  # time.monotonic() at which each restore hook ran

def emit(**rec):
    with lock:
        out.write(json.dumps(rec) + "\\n")

@rehydrate.after_restore(name="app.after_restore")
def after_restore(ctx):
    hooks.append(time.monotonic())
    emit(event="hook", reason=ctx.reason, kind=ctx.kind, generation=ctx.generation,
         n=len(hooks), at=hooks[-1], detected_at=ctx.detected_at, frozen_for=ctx.frozen_for)

if os.environ.get("CONT_WAIT"):  # stretch the SIGCONT allowance: a wait for it shows
    import rehydrate.detect.clock_jump
    rehydrate.detect.clock_jump._CONT_WAIT = float(os.environ["CONT_WAIT"])
emit(event="ready", detectors=rehydrate.start(), pid=os.getpid())
clock = rehydrate.default_engine.detector("clock-jump")
rehydrate.default_engine.add_status("test_clock", lambda: {{
    "stop_skips": clock.stop_skips, "busy_skips": clock.busy_skips, "jumps": clock.jumps}})
last = time.monotonic()
while True:
    time.sleep(0.001)
    now = time.monotonic()
    if now - last > {GAP}:  # this loop was frozen: the process has just resumed
        ready = rehydrate.is_ready()
        after = time.monotonic()
        lie = ready and not any(last < h < after for h in list(hooks))
        ok = rehydrate.wait_ready(timeout=30)
        emit(event="resumed", lie=lie, ready_at_once=ready, ok=ok, gap=now - last,
             frozen_at=last, returned_at=time.monotonic(), state=rehydrate.status().state)
    last = now
"""


def _original(gvisor: GVisorHarness, tmp_path: Path, name: str, socket: bool,
              ballast_mb: int = 0, extra_env: dict[str, str] | None = None,
              ) -> tuple[Container, Mount]:
    proc = tmp_path / f"proc-{name}"
    write_spec_environ(proc, {"APP": "original"})
    env = {"APP": "original", "REHYDRATE_GVISOR_PROC": PROC, "BALLAST_MB": str(ballast_mb),
           **(extra_env or {})}
    if socket:
        env["REHYDRATE_CONTROL_SOCKET"] = SOCKET
    mount = Mount(PROC, proc)
    c = gvisor.run([sys.executable, "-c", WORKLOAD], env=env, mounts=[mount], name=name)
    ready = c.wait_for("ev.jsonl", lambda r: r["event"] == "ready", timeout=60)
    assert ("control" in ready["detectors"]) is socket, ready
    assert "clock-jump" in ready["detectors"], ready
    return c, mount


def _clones(gvisor: GVisorHarness, image: Path, orig: Container, tmp_path: Path,
            name: str, n: int) -> list[Container]:
    clones = []
    for k in range(n):
        proc = tmp_path / f"proc-{name}{k}"
        write_spec_environ(proc, {"APP": f"{name}{k}"})
        clones.append(gvisor.restore(image, orig, name=f"{name}{k}", mounts=[Mount(PROC, proc)]))
    return clones


def _settled(c: Container) -> dict[str, Any]:
    """Status once the clone's clock-jump detector has seen its restore (run or confirmed)."""
    def seen(status: dict[str, Any]) -> bool:
        last = status["last_report"] or {}
        return "clock-jump" in [last.get("reason"), *last.get("confirmed_by", [])]

    return status_until(c, seen)


@pytest.mark.gvisor
def test_clock_jump_only_and_control_socket_without_notify(
        gvisor_uncompressed: GVisorHarness, tmp_path: Path) -> None:
    gvisor = gvisor_uncompressed
    plain, _ = _original(gvisor, tmp_path, "plain", socket=False)
    # The late notices below come two runsc execs after the restore: on a loaded host
    # more than the default 2 s window, which then (as documented) runs the hooks again.
    sock, _ = _original(gvisor, tmp_path, "sock", socket=True,
                        extra_env={"REHYDRATE_SIGNAL_WINDOW": "120"})
    plain_image = plain.checkpoint()
    sock_image = sock.checkpoint()
    frozen_until(time.monotonic())  # every clone frozen at least FROZEN s
    clones = {
        "clock-jump only": _clones(gvisor, plain_image, plain, tmp_path, "plain", 3),
        "control socket, no notify": _clones(gvisor, sock_image, sock, tmp_path, "sock", 3),
        "late notify restore": _clones(gvisor, sock_image, sock, tmp_path, "late", 2),
    }
    for config, group in clones.items():
        for clone in group:
            restored(clone)
            runs = hook_runs(clone)
            assert [(r["reason"], r["kind"], r["generation"]) for r in runs] == [
                ("clock-jump", "restore", 1)], (config, runs)
    # A late notify restore, no notify save before the checkpoint: the same restore.
    for clone in clones["late notify restore"]:
        reply = notify(clone, "restore")
        assert reply["deduplicated"] is True, reply
        assert reply["report"]["reason"] == "clock-jump", reply
        assert reply["report"]["confirmed_by"] == ["control"], reply
        text = clone.exec([REHYDRATE, "notify", "restore"], timeout=60)
        assert text.returncode == 0 and "de-duplicated" in text.stdout, text
        assert len(hook_runs(clone)) == 1, hook_runs(clone)


@pytest.mark.gvisor
def test_notify_save_then_only_the_clock_jump_notices_the_restore(
        gvisor_uncompressed: GVisorHarness, tmp_path: Path) -> None:
    """``notify save`` before the checkpoint, and no notice after the restore: each clone
    wakes with the snapshot pending, and only the clock jump sees the restore. The freeze
    is far longer than the restore threshold, so the hooks run at once: they used to wait
    for a SIGCONT (a job-control stop?) that a restored clone never gets, 0.2 s per clone;
    stretched to 30 s here, that wait would fail ``restored``'s bound."""
    gvisor = gvisor_uncompressed
    orig, _ = _original(gvisor, tmp_path, "saveonly", socket=True,
                        extra_env={"CONT_WAIT": "30"})
    assert notify(orig, "save")["ok"] is True
    image = orig.checkpoint()
    frozen_until(time.monotonic())
    for clone in _clones(gvisor, image, orig, tmp_path, "saveonly", 3):
        restored(clone)
        runs = hook_runs(clone)
        assert [(r["reason"], r["kind"], r["generation"]) for r in runs] == [
            ("clock-jump", "restore", 1)], runs


@pytest.mark.gvisor
def test_notify_save_then_leave_running_checkpoint_and_notify_restore(
        gvisor_uncompressed: GVisorHarness, tmp_path: Path) -> None:
    gvisor = gvisor_uncompressed
    # 64 MB that do not compress: the checkpoint freezes the original for 0.4-2 s, as with
    # a real model (a bare interpreter's shorter dump: the test at the end of this file).
    orig, _ = _original(gvisor, tmp_path, "saved", socket=True, ballast_mb=64)
    saved = notify(orig, "save")
    assert saved["ok"] is True, saved
    t = time.monotonic()
    image = orig.checkpoint(leave_running=True)
    # The original comes back by itself: no notify resume.
    deadline = time.monotonic() + 5.0
    while not hook_runs(orig):
        assert time.monotonic() < deadline, "the original is not ready 5 s after the checkpoint"
        time.sleep(0.05)
    status = json.loads(orig.exec([REHYDRATE, "status", "--json"], timeout=60).stdout)
    assert status["ready"] is True and status["state"] == "ready", status
    assert [r["reason"] for r in hook_runs(orig)] == ["clock-jump"], hook_runs(orig)
    print(f"\noriginal ready again {time.monotonic() - t:.2f}s after the checkpoint began; "
          f"frozen for {hook_runs(orig)[0]['frozen_for']:.3f}s")

    frozen_until(time.monotonic())  # the checkpoint itself may have taken that long
    clones = _clones(gvisor, image, orig, tmp_path, "saved", 2)
    replies = [notify(c, "restore") for c in clones]  # right away, racing the clock jump
    for clone, reply in zip(clones, replies):
        restored(clone)
        status = _settled(clone)
        runs = hook_runs(clone)
        assert len(runs) == 1 and runs[0]["generation"] == 1, runs
        assert status["generation"] == 1, status
        last = status["last_report"]
        # whichever came first ran the hooks; the other confirmed it
        assert sorted([last["reason"], *last["confirmed_by"]]) == ["clock-jump", "control"], last
        assert reply["report"]["started_at"] == last["started_at"], (reply, last)
    assert len(hook_runs(orig)) == 1, "the clones' notices never reached the original"


@pytest.mark.gvisor
def test_leave_running_checkpoints_inside_one_long_sleep_are_seen(
        gvisor_uncompressed: GVisorHarness, tmp_path: Path) -> None:
    """A checkpoint's freeze that begins and ends within one sleep of the clock-jump
    thread does not delay its wake-up at all: the sleep's deadline is on CLOCK_MONOTONIC,
    which counts through the freeze. It used to sleep its full interval while a snapshot
    was pending, so a small process's leave-running checkpoint (0.1-0.7 s under load)
    went unseen 6 times in 8 with the default 0.5 s interval and the original stayed
    ``snapshotting`` until the 300 s deadline. Now the before-snapshot pass wakes it and
    it sleeps in slices of the pending threshold until the checkpoint is seen. A 5 s
    interval makes a miss near-certain without that; two checkpoints in a row, the first
    after a SIGSTOP/SIGCONT stop (issue 13 item 5: a stall before the dump, not the dump;
    the checkpoint after it went unseen in 3 of 9 runs before)."""
    # 64 MB stands for a model: a bare interpreter's second dump can freeze it for less
    # than pending_threshold + one slice (~0.12 s), below what the watch promises to see
    # (then the 300 s deadline ends the snapshot; CI saw that once with no ballast).
    orig, _ = _original(gvisor_uncompressed, tmp_path, "idle", socket=True, ballast_mb=64,
                        extra_env={"REHYDRATE_CLOCK_INTERVAL": "5"})
    for n in (1, 2):
        assert notify(orig, "save")["ok"] is True
        if n == 1:
            # 0.8 s: far above the pending threshold, below the workload loop's GAP (the
            # loop must not take the stop for a restore and wait in it).
            gvisor_uncompressed.runsc_call("kill", orig.id, "STOP")
            stopped = time.monotonic()
            while time.monotonic() - stopped < 0.8:
                time.sleep(0.02)
            gvisor_uncompressed.runsc_call("kill", orig.id, "CONT")
            status = status_until(orig, lambda st: st["test_clock"]["stop_skips"] >= 1)
            assert (status["state"], status["test_clock"]["jumps"]) == ("snapshotting", 0), (
                status)
            assert hook_runs(orig) == [], "the stop was taken for the checkpoint"
        orig.checkpoint(leave_running=True)
        deadline = time.monotonic() + 5.0
        while len(hook_runs(orig)) < n:
            assert time.monotonic() < deadline, (
                f"checkpoint {n}: the original is not ready 5 s after it",
                orig.exec([REHYDRATE, "status", "--json"], timeout=60).stdout)
            time.sleep(0.05)
        status = json.loads(orig.exec([REHYDRATE, "status", "--json"], timeout=60).stdout)
        assert (status["ready"], status["state"]) == (True, "ready"), status
        runs = hook_runs(orig)
        assert [(r["reason"], r["generation"]) for r in runs] == [
            ("clock-jump", k) for k in range(1, n + 1)], runs
