"""The example game server under real gVisor: checkpointed mid-match, restored twice (issue 12).

What is real: the sandbox, ``runsc checkpoint`` / ``restore``, the restored memory and
clock (``CLOCK_MONOTONIC`` jumps by the time frozen), the UDP socket, the game loop, the
HTTP between the adapter and the sidecar, ``rehydrate notify save`` and the UDP client run
inside the sandbox with ``runsc exec``. What stands in: the Agones SDK sidecar
(``tests/agones_sidecar.py``, the documented REST endpoints), started *inside* the sandbox
next to the game — runsc here runs with ``--network=none``, and on GKE the whole Pod (game
and sidecar) is snapshotted together, as here.

One checkpoint serves every assertion. Before it, a client plays (mid-match) and
``notify save`` stops the adapter's loops. The original is checkpointed, frozen for
FROZEN seconds, and restored into two clones; in each: the tick clock runs at most
MAX_CATCH_UP ticks for the frozen seconds, the first health ping reaches the sidecar
within one HEALTH_INTERVAL of the clone running, labels are re-applied and ``Ready`` is not
re-sent (the restored GameServer is already Ready), a UDP client inside the sandbox joins
and plays, the match's tick continued, and the two clones' session tokens differ from each
other and from the original's, which they refuse.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from detect_helpers import wait_for

from .harness import REPO_ROOT, Container, GVisorHarness, read_jsonl

PY = sys.executable
REHYDRATE = str(Path(sys.executable).parent / "rehydrate")
SERVER = str(REPO_ROOT / "examples" / "game_server" / "server.py")
CLIENT = str(REPO_ROOT / "examples" / "game_server" / "client.py")
SIDECAR = str(REPO_ROOT / "tests" / "agones_sidecar.py")
SOCKET = "/var/tmp/rehydrate.sock"
RATE = 30
MAX_CATCH_UP = 2
HEALTH_INTERVAL = 1.0
FROZEN = 3.0
GAME_PORT = 7777


def _client(c: Container, *args: str) -> dict[str, Any]:
    proc = c.exec([PY, CLIENT, "--port", str(GAME_PORT), *args], timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _status(c: Container) -> dict[str, Any]:
    proc = c.exec([REHYDRATE, "status", "--json"], timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def _sidecar_log(c: Container) -> list[dict[str, Any]]:
    return read_jsonl(c.result_file("sidecar.jsonl"))


def _wait_ready(c: Container, timeout: float = 30.0) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def ready() -> bool:
        last.update(_status(c))
        return bool(last["ready"] and last["generation"] >= 1)

    wait_for(ready, timeout, f"clone {c.id} to be ready")
    return last


def _restore_run(c: Container) -> dict[str, Any]:
    """The clone's "restored" event; if it never comes, fail with what the detectors saw
    (the clone's status and rehydrate's log lines), not only the harness's runsc logs."""
    try:
        return c.wait_for("events.jsonl", lambda r: r["event"] == "restored", timeout=60)
    except TimeoutError as exc:
        lines = c.stderr.read_text(errors="replace").splitlines()
        ours = [line for line in lines if " rehydrate" in line][-30:]
        raise AssertionError(
            f"{c.id}: its restore never ran: {exc}\nstatus: {_status(c)}\n"
            "rehydrate log:\n" + "\n".join(ours)) from exc


@pytest.mark.gvisor
def test_game_server_checkpointed_mid_match_restores_into_two_clones(
    gvisor: GVisorHarness,
) -> None:
    command = (
        f"{PY} {SIDECAR} --port 9358 --game-port {GAME_PORT} --log /results/sidecar.jsonl & "
        f"exec {PY} {SERVER} --port {GAME_PORT} --rate {RATE} --max-catch-up {MAX_CATCH_UP} "
        f"--health-interval {HEALTH_INTERVAL} --events /results/events.jsonl"
    )
    orig = gvisor.run(
        ["/bin/sh", "-c", command],
        env={
            "AGONES_SDK_HTTP_PORT": "9358",
            "REHYDRATE_CONTROL_SOCKET": SOCKET,
            "REHYDRATE_CLOCK_THRESHOLD": "1.0",
            # The clock jump is this sandbox's only restore signal (no /proc/gvisor): no
            # point waiting the default 1 s for a more specific detector to report first.
            "REHYDRATE_CLOCK_GRACE": "0",
        },
        name="game",
    )
    ready = orig.wait_for("events.jsonl", lambda r: r["event"] == "ready", timeout=90)
    assert ready["agones"] is True
    gs_ready = [r for r in _sidecar_log(orig) if r["path"] == "/ready"]
    assert [r["status"] for r in gs_ready] == [200], _sidecar_log(orig)

    # -- mid-match: a player joins and plays
    before = _client(orig, "--name", "alice", "--inputs", "15", "--stay")
    assert before["states"] >= 3, before

    # -- the before-snapshot pass (what save-restore-exec runs): loops stop
    saved = orig.exec([REHYDRATE, "notify", "save"], timeout=60)
    assert saved.returncode == 0, (saved.stdout, saved.stderr)
    t_saved = time.time()  # the sandbox's realtime clock is the host's
    image = orig.checkpoint()
    t_frozen = time.monotonic()
    # by arrival time: a ping sent before the loop stopped may be logged a moment later
    pings_after_save = [r for r in _sidecar_log(orig)
                        if r["path"] == "/health" and r["wall"] > t_saved]
    assert pings_after_save == [], "health pings went on after the before-snapshot pass"
    while time.monotonic() - t_frozen < FROZEN:
        time.sleep(0.05)

    clones = [gvisor.restore(image, orig, name=f"game{k}") for k in range(2)]
    tokens = []
    for clone in clones:
        # the tick clock: at most MAX_CATCH_UP ticks for the frozen seconds
        jump = clone.wait_for("events.jsonl", lambda r: r["event"] == "jump", timeout=60)
        assert jump["ticks"] <= MAX_CATCH_UP, jump
        assert jump["skipped"] >= FROZEN - 0.5, jump
        restored = _restore_run(clone)
        assert (restored["kind"], restored["generation"]) == ("restore", 1), restored

        # Agones: a health ping within one interval of the clone running
        log = _sidecar_log(clone)
        health = [r for r in log if r["path"] == "/health" and r["status"] == 200]
        assert health, log
        assert health[0]["wall"] - clone.started_at <= HEALTH_INTERVAL, (
            health[0]["wall"] - clone.started_at, log[:5])
        status = _wait_ready(clone)
        assert status["agones"]["reason"] == "", status["agones"]
        log = _sidecar_log(clone)
        paths = [(r["method"], r["path"]) for r in log]
        assert ("GET", "/gameserver") in paths and ("PUT", "/metadata/label") in paths, paths
        assert ("POST", "/ready") not in paths, "Ready re-sent to a GameServer already Ready"

        # a UDP client inside the clone's sandbox plays; the stale token is refused
        after = _client(clone, "--name", "bob", "--inputs", "15",
                        "--stale", f"{before['player']}:{before['token']}")
        assert after["stale_reply"] == "rejoin", after
        assert after["states"] >= 3, after
        assert after["first_tick"] > before["last_tick"], "the match did not continue"
        assert after["instance"] != before["instance"]
        tokens.append((after["player"], after["token"]))
        game = status["game"]
        assert game["jumps"] >= 1 and game["dropped"] >= FROZEN - 0.5, game

    # both clones numbered the new player alike, yet signed different tokens
    assert tokens[0][0] == tokens[1][0], tokens
    assert tokens[0][1] != tokens[1][1], tokens
    assert before["token"] not in {t for _, t in tokens}
