"""What the restore-path tests under real runsc share (test_restore_path, one restore
per clone; test_restore_chain, a clone of a clone): the emulated ``/proc/gvisor``, the
freeze long enough to be a restore, and the checks of a clone's readiness records.

The workloads they run write JSON lines to ``/results/ev.jsonl``: ``{"event": "hook",
…}`` from their restore hook and ``{"event": "resumed", …}`` from their main loop the
moment it notices it was frozen (a step longer than :data:`GAP`).

``/proc/gvisor`` (neither Debian runsc has it) is emulated by a bind-mounted directory
(:data:`PROC`, named by ``REHYDRATE_GVISOR_PROC``) with ``spec_environ`` only, so the
detectors in play are the clock jump and the control socket (:data:`SOCKET`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from .harness import Container

PROC = "/etc/rehydrate-gvisor"
SOCKET = "/var/tmp/rehydrate.sock"
REHYDRATE = str(Path(sys.executable).parent / "rehydrate")
FROZEN = 2.5  # seconds between checkpoint and restore (> threshold + interval)
GAP = 1.0  # the workload's loop takes a step this long for "I was frozen"


def write_spec_environ(path: Path, env: dict[str, str]) -> None:
    """Make ``path`` a ``/proc/gvisor`` stand-in whose ``spec_environ`` holds ``env``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "spec_environ").write_bytes(
        b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


def frozen_until(t_checkpoint: float) -> None:
    """Wait until :data:`FROZEN` seconds have passed since ``t_checkpoint``."""
    while time.monotonic() - t_checkpoint < FROZEN:
        time.sleep(0.05)


def restored(clone: Container) -> dict[str, Any]:
    """The clone's "resumed" record, after checking the readiness promise in it."""
    rec = clone.wait_for("ev.jsonl", lambda r: r["event"] == "resumed", timeout=60)
    assert rec["gap"] >= FROZEN - 0.5, rec
    assert rec["lie"] is False, f"{clone.id}: is_ready() was True before the hooks ran: {rec}"
    assert rec["ok"] is True and rec["state"] == "ready", rec
    # Causality rather than wall time (CI shares 2 cores: any step can be descheduled for
    # a while): this freeze was seen, then the hooks ran, then wait_ready() returned.
    runs = hook_runs(clone)  # written before the "resumed" record: the hook ran first
    assert runs, rec
    hook = runs[0]
    assert rec["frozen_at"] < hook["detected_at"] <= hook["at"] <= rec["returned_at"], (
        rec, hook)
    # No fixed grace: the old clock-jump grace held the hooks 1 s after the jump was seen
    # (waiting for the control socket); now only the hand-off to the runner separates them.
    assert hook["at"] - hook["detected_at"] < 0.9, (
        f"{clone.id}: the hooks ran {hook['at'] - hook['detected_at']:.2f}s after detection",
        clone.exec([REHYDRATE, "status", "--json"], timeout=60).stdout, runs)
    return rec


def hook_runs(c: Container) -> list[dict[str, Any]]:
    """The records of the workload's restore hook, in the order it ran."""
    return [r for r in c.records("ev.jsonl") if r["event"] == "hook"]


def notify(c: Container, action: str) -> dict[str, Any]:
    """``rehydrate notify ACTION --json`` in the container: its reply."""
    proc = c.exec([REHYDRATE, "notify", action, "--json"], timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    reply: dict[str, Any] = json.loads(proc.stdout)
    return reply


def status_until(c: Container, ok: Any, timeout: float = 15.0) -> dict[str, Any]:
    """The clone's status (``rehydrate status --json`` in it) once ``ok(status)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        proc = c.exec([REHYDRATE, "status", "--json"], timeout=60)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        status: dict[str, Any] = json.loads(proc.stdout)
        if ok(status):
            return status
        assert time.monotonic() < deadline, f"{c.id}: never got there: {status}"
        time.sleep(0.1)
