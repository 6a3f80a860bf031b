"""The clock-jump detector inside a real gVisor sandbox that is checkpointed and restored.

Proves what the detector relies on under runsc: the restored clone's CLOCK_MONOTONIC
includes the time frozen, and its CPU time does not (so the busy check does not mistake
the restore for a GIL hog).
"""

from __future__ import annotations

import sys
import time

import pytest

from .harness import GVisorHarness

WORKLOAD = """
import json, time
from rehydrate.testing import isolated_engine
from rehydrate.detect.clock_jump import ClockJumpDetector

out = open("/results/clock.jsonl", "a", buffering=1)
engine = isolated_engine()
det = ClockJumpDetector(threshold=1.0)  # default interval (0.5 s)

def hook(ctx):
    out.write(json.dumps({"event": "hook", "reason": ctx.reason, "kind": ctx.kind,
                          "generation": ctx.generation, "frozen_for": ctx.frozen_for,
                          "busy_skips": det.busy_skips}) + "\\n")

engine.registry.after_restore(hook)
engine.start([det])
out.write(json.dumps({"event": "ready"}) + "\\n")
while True:
    time.sleep(3600)
"""


@pytest.mark.gvisor
def test_clock_jump_fires_in_a_restored_runsc_clone(gvisor: GVisorHarness) -> None:
    orig = gvisor.run([sys.executable, "-c", WORKLOAD], name="clock")
    orig.wait_for("clock.jsonl", lambda r: r["event"] == "ready", timeout=60)
    image = orig.checkpoint()
    frozen_at = time.monotonic()
    while time.monotonic() - frozen_at < 2.0:  # stay frozen well past the threshold
        time.sleep(0.05)
    clone = gvisor.restore(image, orig, name="clock-clone")
    hook = clone.wait_for("clock.jsonl", lambda r: r["event"] == "hook", timeout=60)
    assert (hook["reason"], hook["kind"], hook["generation"]) == ("clock-jump", "restore", 1)
    assert hook["frozen_for"] >= 1.5
    assert hook["busy_skips"] == 0


GIL_AT_RESUME = """
import ctypes, json, time
from rehydrate.testing import isolated_engine
from rehydrate.detect.clock_jump import ClockJumpDetector

out = open("/results/clock.jsonl", "a", buffering=1)
engine = isolated_engine()
det = ClockJumpDetector(interval=5.0, threshold=1.0)  # one deadline every 5 s

def hook(ctx):
    out.write(json.dumps({"event": "hook", "reason": ctx.reason, "frozen_for": ctx.frozen_for,
                          "busy_skips": det.busy_skips}) + "\\n")

engine.registry.after_restore(hook)
engine.start([det])
while det.ticks < 1:
    time.sleep(0.01)
ticks = det.ticks
while det.ticks == ticks:  # just after a wake-up: the next deadline is 5 s away
    time.sleep(0.001)
out.write(json.dumps({"event": "hogging", "busy_skips": det.busy_skips}) + "\\n")
# A C call holding the GIL from before the checkpoint until well after the restore: the
# detector thread, once resumed, waits for the GIL for seconds and is charged CPU time
# for it, like a stalled thread.
ctypes.PyDLL(None).usleep(13_000_000)
out.write(json.dumps({"event": "hog-done", "busy_skips": det.busy_skips}) + "\\n")
while True:
    time.sleep(3600)
"""


@pytest.mark.gvisor
def test_a_restore_is_seen_though_the_clone_waits_for_the_gil(gvisor: GVisorHarness) -> None:
    """The freeze spans the detector's deadline, and once restored the detector thread
    waits seconds for the GIL (a C call holds it): the kernel measured the sleep's
    lateness before that wait, so the restore is not taken for a GIL stall (a clone whose
    detector did that never became ready)."""
    orig = gvisor.run([sys.executable, "-c", GIL_AT_RESUME], name="gil")
    orig.wait_for("clock.jsonl", lambda r: r["event"] == "hogging", timeout=60)
    image = orig.checkpoint()  # the freeze begins well inside the 5 s sleep
    frozen_at = time.monotonic()
    while time.monotonic() - frozen_at < 7.0:  # restored past the deadline + threshold
        time.sleep(0.05)
    clone = gvisor.restore(image, orig, name="gil-clone")
    done = clone.wait_for("clock.jsonl", lambda r: r["event"] == "hog-done", timeout=60)
    hook = clone.wait_for("clock.jsonl", lambda r: r["event"] == "hook", timeout=30)
    assert hook["reason"] == "clock-jump"
    assert hook["busy_skips"] == 0 and done["busy_skips"] == 0
    assert hook["frozen_for"] >= 1.0
