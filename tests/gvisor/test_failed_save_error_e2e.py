"""A failed ``notify save`` and gVisor's ``error`` answer, inside a real runsc sandbox.

The workload runs the gVisor waiter (on a FIFO stand-in for ``/proc/gvisor/checkpoint``, as
in ``test_gvisor_waiter_e2e.py``: neither Debian runsc has the file) and the control socket.
The test plays save-restore-exec: ``rehydrate-notify`` with
``GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE=save`` run in the sandbox with ``runsc exec``; then it
plays gVisor's answer on the waiter's descriptor.

1. the before-snapshot hook fails: ``notify save`` exits 1 after the resume hooks ran; the
   ``error`` answer for the aborted checkpoint only confirms that run (the resume hooks ran
   twice before the fix); then ``notify save`` run by hand fails the same way, and a later
   unrelated checkpoint's ``error`` runs the resume hooks (it was taken for the hand-run
   save's abort, and nothing ran);
2. the retry succeeds and the save fails later: its ``error`` runs the resume hooks once;
3. a third attempt succeeds and a real ``runsc checkpoint`` follows: the clone's
   ``restore`` answer runs the restore hooks once, generation 1 — the confirmations
   before do not make it look handled.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest

from .harness import Container, GVisorHarness
from .test_gvisor_waiter_e2e import FROZEN, PROC, _answer, _wait_log

SOCKET = "/var/tmp/rehydrate.sock"  # on the sandbox's tmpfs
FAIL_FLAG = "/var/tmp/fail-save"  # exists: the required before-snapshot hook fails
NOTIFY = "rehydrate-notify"  # the console script: on the sandbox's PATH (the venv's bin)

WORKLOAD = f"""
import json, logging, os, threading, time
os.makedirs({PROC!r}, exist_ok=True)
os.mkfifo({PROC!r} + "/checkpoint")
import rehydrate

out = open("/results/events.jsonl", "a", buffering=1)
lock = threading.Lock()

def emit(**rec):
    with lock:
        out.write(json.dumps(rec) + "\\n")

class ToResults(logging.Handler):
    def emit(self, record):
        emit(event="log", level=record.levelname, msg=record.getMessage())

log = logging.getLogger("rehydrate")
log.setLevel(logging.INFO)
log.addHandler(ToResults())

@rehydrate.after_restore(name="app.reconnect")
def reconnect(ctx):
    emit(event="after_restore", reason=ctx.reason, kind=ctx.kind, generation=ctx.generation,
         frozen_for=ctx.frozen_for)

@rehydrate.before_snapshot(name="app.flush")
def flush(ctx):
    if os.path.exists({FAIL_FLAG!r}):
        raise RuntimeError("disk full (test flag)")

emit(event="ready", detectors=rehydrate.start(), pid=os.getpid())
while True:
    time.sleep(3600)
"""


def _runs(c: Container) -> list[tuple[str, str, int]]:
    return [(r["kind"], r["reason"], r["generation"]) for r in c.records("events.jsonl")
            if r["event"] == "after_restore"]


def _notify_save(c: Container) -> Any:
    """What gVisor's save-restore-exec runs before saving."""
    return c.exec([NOTIFY], env={"GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE": "save"}, timeout=60)


def _error_answer(c: Container, needle: str) -> None:
    """Answer ``error`` and wait until the waiter has handled it (its log line)."""
    seen = sum(needle in r["msg"] for r in c.records("events.jsonl") if r["event"] == "log")
    _answer(c, "error\\n")
    deadline = time.monotonic() + 30
    while sum(needle in r["msg"] for r in c.records("events.jsonl")
              if r["event"] == "log") <= seen:
        if time.monotonic() > deadline:
            raise AssertionError(f"{c.id}: no {needle!r} after the error answer; "
                                 f"runs {_runs(c)}")
        time.sleep(0.05)


@pytest.mark.gvisor
def test_failed_save_then_error_answer_runs_the_resume_hooks_once(
        gvisor: GVisorHarness) -> None:
    orig = gvisor.run(
        [sys.executable, "-c", WORKLOAD],
        env={
            "REHYDRATE_GVISOR_PROC": PROC,
            "REHYDRATE_CONTROL_SOCKET": SOCKET,
            "REHYDRATE_CLOCK_THRESHOLD": "1.0",
            "REHYDRATE_CLOCK_GRACE": "60",  # let the waiter report the restore first
        },
        name="errdup",
    )
    ready = orig.wait_for("events.jsonl", lambda r: r["event"] == "ready", timeout=60)
    assert {"gvisor", "control"} <= set(ready["detectors"]), ready

    # 1. notify save fails: the platform aborts, gVisor answers "error".
    orig.exec(["/bin/touch", FAIL_FLAG], check=True)
    failed = _notify_save(orig)
    assert failed.returncode == 1, (failed.returncode, failed.stdout, failed.stderr)
    assert "app.flush" in failed.stderr, failed.stderr
    assert _runs(orig) == [("resume", "control", 0)]
    _error_answer(orig, "already undid")
    assert _runs(orig) == [("resume", "control", 0)], "the error answer ran the hooks again"

    # 1b. `notify save` run by hand (runsc exec, no checkpoint behind it) fails as well: its
    # carry-on runs, and a later, unrelated checkpoint's "error" is no abort it announced —
    # that checkpoint may have paused the sandbox: its resume hooks run (nothing ran before).
    by_hand = orig.exec([NOTIFY, "save"], timeout=60)
    assert by_hand.returncode == 1, (by_hand.returncode, by_hand.stdout, by_hand.stderr)
    assert _runs(orig) == [("resume", "control", 0)] * 2
    _error_answer(orig, "resume (reason gvisor")
    assert _runs(orig) == [("resume", "control", 0)] * 2 + [("resume", "gvisor", 0)]

    # 2. the retry's notify save succeeds; the save itself fails later: "error" runs them.
    orig.exec(["/bin/rm", FAIL_FLAG], check=True)
    saved = _notify_save(orig)
    assert saved.returncode == 0, (saved.returncode, saved.stdout, saved.stderr)
    _error_answer(orig, "resume (reason gvisor")
    assert _runs(orig) == [("resume", "control", 0)] * 2 + [("resume", "gvisor", 0)] * 2

    # 3. a third attempt that really checkpoints: the clone runs its restore hooks once.
    saved = _notify_save(orig)
    assert saved.returncode == 0, (saved.returncode, saved.stdout, saved.stderr)
    t0 = time.monotonic()
    image = orig.checkpoint()
    while time.monotonic() - t0 < FROZEN:
        time.sleep(0.05)
    clone = gvisor.restore(image, orig, name="errdup-clone")
    _answer(clone, "restore\\n")
    rec = clone.wait_for("events.jsonl",
                         lambda r: r["event"] == "after_restore" and r["kind"] == "restore",
                         timeout=30)
    assert (rec["reason"], rec["generation"]) == ("gvisor", 1), rec
    _wait_log(clone, "restore notice from clock-jump is the restore already handled")
    assert [r for r in _runs(clone) if r[0] == "restore"] == [("restore", "gvisor", 1)]
