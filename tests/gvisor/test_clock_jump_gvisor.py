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
