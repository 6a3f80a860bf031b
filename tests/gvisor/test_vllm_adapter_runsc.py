"""The vLLM adapter across a real runsc checkpoint and restore.

In one sandbox: a vLLM stand-in server (its own process, level-2 sleep state machine) and
a supervisor with ``rehydrate.adapters.vllm`` and ``health_app()``
(``tests/gvisor/vllm_sandbox.py``). ``rehydrate notify save`` (run inside with runsc exec,
as save-restore-exec does) puts the engine to sleep; the sandbox is checkpointed with the
engine asleep; in the restored clone ``rehydrate notify restore`` wakes it with vLLM's
level-2 sequence and the canary. The stand-in answers 500 to ``/wake_up`` until the test
lifts that fault, so the test sees ``/readyz`` say 503 while the wake hook retries and
200 only after it succeeded — no race with the hooks.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from .harness import REPO_ROOT, Container, GVisorHarness

ENV = {"REHYDRATE_CONTROL_SOCKET": "/var/tmp/rehydrate.sock"}
PROBES = "http://127.0.0.1:8081"
VLLM = "http://127.0.0.1:8000"


def call(gvisor: GVisorHarness, c: Container, method: str, url: str,
         body: Any = None) -> dict[str, Any]:
    args = [sys.executable, "-m", "tests.gvisor.vllm_sandbox", method, url]
    if body is not None:
        args.append(json.dumps(body))
    proc = gvisor.exec(c, args, cwd=str(REPO_ROOT), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return answer


def wait_until(what: str, probe: Callable[[], dict[str, Any]],
               ok: Callable[[dict[str, Any]], bool], timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        answer = probe()
        if ok(answer):
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last answer {answer}")
        time.sleep(0.2)


def notify(gvisor: GVisorHarness, c: Container, action: str) -> Any:
    return gvisor.exec(c, [sys.executable, "-m", "rehydrate", "notify", action],
                       cwd=str(REPO_ROOT), timeout=180)


@pytest.mark.gvisor
def test_vllm_sleeps_through_the_checkpoint_and_wakes_in_the_clone(
        gvisor: GVisorHarness) -> None:
    orig = gvisor.run([sys.executable, "-m", "tests.gvisor.vllm_sandbox", "serve"],
                      env=ENV, cwd=str(REPO_ROOT), name="vllm")
    wait_until("the supervisor's /readyz", lambda: call(gvisor, orig, "get", f"{PROBES}/readyz"),
               lambda a: a["status"] == 200)

    saved = notify(gvisor, orig, "save")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    engine = call(gvisor, orig, "get", f"{VLLM}/stand-in/state")["body"]
    assert (engine["sleeping"], engine["weights"]) == (True, "discarded")
    readyz = call(gvisor, orig, "get", f"{PROBES}/readyz")
    assert readyz["status"] == 503 and readyz["body"]["state"] == "snapshotting"
    call(gvisor, orig, "post", f"{VLLM}/stand-in/fault", {"path": "/wake_up", "count": 10**6})

    image = orig.checkpoint()
    clone = gvisor.restore(image, orig, name="vllm-clone")

    restored: list[Any] = []
    t = threading.Thread(target=lambda: restored.append(notify(gvisor, clone, "restore")),
                         daemon=True)
    t.start()
    # the wake hook retries the failing /wake_up: the clone is not ready meanwhile
    held = wait_until("the wake hook retrying",
                      lambda: call(gvisor, clone, "get", f"{VLLM}/stand-in/state"),
                      lambda a: a["body"]["log"].count("POST /wake_up?tags=weights") >= 2)
    assert held["body"]["sleeping"] is True
    readyz = call(gvisor, clone, "get", f"{PROBES}/readyz")
    assert readyz["status"] == 503, readyz
    assert readyz["body"]["reason"] == "restore hooks are running"
    assert t.is_alive()

    call(gvisor, clone, "post", f"{VLLM}/stand-in/fault", {"path": "/wake_up", "count": 0})
    t.join(120)
    assert restored and restored[0].returncode == 0, restored
    readyz = call(gvisor, clone, "get", f"{PROBES}/readyz")
    assert readyz["status"] == 200 and readyz["body"]["generation"] >= 1, readyz
    engine = call(gvisor, clone, "get", f"{VLLM}/stand-in/state")["body"]
    assert (engine["sleeping"], engine["weights"], engine["canaries"]) == (False, "gpu", 1)
    log = engine["log"]
    restore_calls = log[log.index("POST /sleep?level=2") + 2:]  # after sleep's confirmation
    # vLLM's level-2 wake (the 500s retried), the rest woken, confirmed, the canary
    assert [call for call, _ in itertools.groupby(restore_calls)] == [
        "GET /is_sleeping", "POST /wake_up?tags=weights", "POST /collective_rpc",
        "POST /wake_up?tags=kv_cache", "GET /is_sleeping", "POST /wake_up", "GET /is_sleeping",
        "GET /v1/models", "POST /v1/completions"], restore_calls
    status = call(gvisor, clone, "get", f"{PROBES}/rehydrate/status")["body"]
    wake = next(h for h in status["last_report"]["hooks"] if h["name"] == "rehydrate.vllm.wake")
    assert wake["outcome"] == "ok"
