"""The gVisor checkpoint waiter inside real runsc sandboxes, across real checkpoints.

What is real: the sandbox, ``runsc checkpoint`` / ``runsc restore`` (the waiter's thread
is frozen blocked in ``poll()`` on its descriptor and wakes up in each clone), the clock
step the clones see, and the clock-jump detector seeing it too. What is emulated:
``/proc/gvisor/checkpoint`` — neither Debian runsc release has it — by a FIFO the
workload creates on the sandbox's tmpfs (``REHYDRATE_GVISOR_PROC`` points there); the
test plays gVisor's part by writing the answer into it with ``runsc exec`` (a host FIFO
cannot be opened inside the sandbox). The clock-jump detector is given a long grace, so
it waits for the more specific waiter, as it does when the real file answers at once.

Covered: resume, garbage and error answers in the original; in each clone, is_ready()
asked the moment the workload notices its freeze says "restoring" (the waiter has not
been answered yet); checkpoint, two clones each
answered ``restore`` (hooks once, reason ``gvisor``, generation 1, the clock-jump notice
of the same restore recognised as a duplicate); a clone checkpointed again and its clone
answered ``restore`` (generation 2).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest

from .harness import Container, GVisorHarness

PROC = "/var/tmp/gv"  # on the sandbox's tmpfs
FROZEN = 2.5  # seconds between checkpoint and restore (> clock threshold + interval)
GAP = 2.0  # a pause of the workload's own loop this long is the freeze (FROZEN - 0.5)

WORKLOAD = f"""
import json, logging, os, threading, time
os.makedirs({PROC!r}, exist_ok=True)
os.mkfifo({PROC!r} + "/checkpoint")
import rehydrate

out = open("/results/events.jsonl", "a", buffering=1)
lock = threading.Lock()
calls = {{"restore": 0, "resume": 0}}

def emit(**rec):
    with lock:
        out.write(json.dumps(rec) + "\\n")

class ToResults(logging.Handler):
    def emit(self, record):
        emit(event="log", level=record.levelname, msg=record.getMessage())

log = logging.getLogger("rehydrate")
log.setLevel(logging.INFO)
log.addHandler(ToResults())

@rehydrate.after_restore(name="app.after_restore")
def after_restore(ctx):
    calls[ctx.kind] += 1
    emit(event="after_restore", reason=ctx.reason, kind=ctx.kind, generation=ctx.generation,
         calls=calls[ctx.kind])

emit(event="ready", detectors=rehydrate.start(), pid=os.getpid())
# The readiness promise on the waiter path: this loop notices its own freeze and asks
# is_ready() at once. The test answers the waiter only later (and the clock-jump detector
# waits out its grace), so no restore hook can have run yet: True would be a lie.
last = time.monotonic()
while True:
    time.sleep(0.01)
    now = time.monotonic()
    if now - last > {GAP}:
        emit(event="resumed", ready=rehydrate.is_ready(), state=rehydrate.status().state,
             gap=now - last, hooks_so_far=calls["restore"])
    last = now
"""


def _answer(c: Container, text: str) -> None:
    """Play gVisor: write the checkpoint answer into the stand-in from inside the sandbox."""
    proc = c.exec(["/bin/sh", "-c", f"printf '{text}' > {PROC}/checkpoint"], timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)


def _runs(c: Container) -> list[dict[str, Any]]:
    return [r for r in c.records("events.jsonl") if r["event"] == "after_restore"]


def _logs(c: Container) -> list[str]:
    return [r["msg"] for r in c.records("events.jsonl") if r["event"] == "log"]


def _wait_log(c: Container, needle: str, timeout: float = 30.0) -> None:
    c.wait_for("events.jsonl", lambda r: r["event"] == "log" and needle in r["msg"],
               timeout=timeout)


def _restored_once(clone: Container, generation: int, calls: int) -> None:
    resumed = clone.wait_for("events.jsonl", lambda r: r["event"] == "resumed", timeout=60)
    assert resumed["hooks_so_far"] == calls - 1, resumed
    assert resumed["ready"] is False and resumed["state"] == "restoring", (
        f"{clone.id}: ready before its restore hooks ran: {resumed}")
    _answer(clone, "restore\\n")
    rec = clone.wait_for("events.jsonl",
                         lambda r: r["event"] == "after_restore" and r["kind"] == "restore",
                         timeout=30)
    assert (rec["reason"], rec["generation"], rec["calls"]) == ("gvisor", generation, calls), rec
    # The clock-jump detector saw the same restore; its notice is a duplicate.
    _wait_log(clone, "restore notice from clock-jump is the restore already handled")
    restores = [r for r in _runs(clone) if r["kind"] == "restore"]
    assert len(restores) == 1, restores


@pytest.mark.gvisor
def test_waiter_across_real_checkpoints(gvisor: GVisorHarness) -> None:
    orig = gvisor.run(
        [sys.executable, "-c", WORKLOAD],
        env={
            "REHYDRATE_GVISOR_PROC": PROC,
            "REHYDRATE_CLOCK_THRESHOLD": "1.0",
            "REHYDRATE_CLOCK_GRACE": "60",  # let the waiter report first, deterministically
        },
        name="waiter",
    )
    ready = orig.wait_for("events.jsonl", lambda r: r["event"] == "ready", timeout=60)
    assert "gvisor" in ready["detectors"] and "clock-jump" in ready["detectors"], ready

    # -- the original: resume, garbage, error
    _answer(orig, "resume\\n")
    rec = orig.wait_for("events.jsonl", lambda r: r["event"] == "after_restore", timeout=30)
    assert (rec["reason"], rec["kind"], rec["generation"]) == ("gvisor", "resume", 0), rec
    _answer(orig, "bogus\\n")
    _wait_log(orig, "gave unknown answer b'bogus'")
    _answer(orig, "error\\n")
    _wait_log(orig, "checkpoint failed")
    orig.wait_for("events.jsonl",
                  lambda r: r["event"] == "after_restore" and r["calls"] == 2, timeout=30)
    assert [(r["kind"], r["generation"]) for r in _runs(orig)] == [("resume", 0), ("resume", 0)]

    # -- checkpoint; the waiter is frozen inside poll() on its descriptor
    t0 = time.monotonic()
    image = orig.checkpoint()
    while time.monotonic() - t0 < FROZEN:
        time.sleep(0.05)
    clones = [gvisor.restore(image, orig, name=f"clone{k}") for k in range(2)]
    for clone in clones:
        _restored_once(clone, generation=1, calls=1)

    # -- a clone checkpointed again: its clone is generation 2
    t0 = time.monotonic()
    image2 = clones[0].checkpoint()
    while time.monotonic() - t0 < FROZEN:
        time.sleep(0.05)
    grandchild = gvisor.restore(image2, clones[0], name="grandchild", seed_results="copy")
    before = len([r for r in _runs(grandchild) if r["kind"] == "restore"])
    _answer(grandchild, "restore\\n")
    rec = grandchild.wait_for(
        "events.jsonl",
        lambda r: r["event"] == "after_restore" and r["kind"] == "restore" and r["calls"] == 2,
        timeout=30)
    assert (rec["reason"], rec["generation"]) == ("gvisor", 2), rec
    assert len([r for r in _runs(grandchild) if r["kind"] == "restore"]) == before + 1
    # No spurious errors anywhere: only the garbage the test sent was complained about.
    for c in (orig, *clones, grandchild):
        errors = [m for m in _logs(c) if " gave " in m]
        assert all("bogus" in m for m in errors), (c.id, errors)
