"""examples/game_server without gVisor: a snapshot and a restore told by the real
``rehydrate notify`` over the control socket (as save-restore-exec would), the stand-in
sidecar on loopback, the example's own UDP client. The same server under real runsc with
two clones is tests/gvisor/test_game_server_gvisor.py."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agones_sidecar import AgonesSidecar
from detect_helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "examples" / "game_server" / "server.py"
CLIENT = ROOT / "examples" / "game_server" / "client.py"
REHYDRATE = str(Path(sys.executable).parent / "rehydrate")

# Runs server.main() on a thread of its own (as asyncio.run would on the main thread) in a
# fresh interpreter (the server uses the process-wide engine), restores from another
# thread, and reports which of the server's broadcasts ran off the game loop's thread.
_IN_PROCESS = r"""
import asyncio, json, sys, threading
sys.path.insert(0, sys.argv[1])
import rehydrate
import server

ready = threading.Event()
emit = server.Events.emit
def emitted(self, event, **fields):
    emit(self, event, **fields)
    if event == "ready":
        ready.set()
server.Events.emit = emitted

off_loop = []
broadcast = server.GameProtocol.broadcast
def checked(self, msg):
    if threading.current_thread() is not game:
        off_loop.append(msg["op"])
    broadcast(self, msg)
server.GameProtocol.broadcast = checked

game = threading.Thread(target=lambda: asyncio.run(server.main(
    ["--port", "0", "--no-agones", *sys.argv[2:]])), daemon=True)
game.start()
assert ready.wait(30), "the server never became ready"
report = rehydrate.simulate_restore()
print(json.dumps({"ok": report.ok, "off_loop": off_loop,
                  "game": rehydrate.status().to_dict()["game"]}))
"""


def _in_process(*args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("REHYDRATE_CONTROL_SOCKET", None)
    proc = subprocess.run([sys.executable, "-c", _IN_PROCESS, str(SERVER.parent), *args],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


def _ready_port(events: Path) -> int | None:
    """The port the server's "ready" event names (None before it was written)."""
    if not events.exists():
        return None
    for line in events.read_text().splitlines():
        if '"event": "ready"' in line:
            return int(json.loads(line)["port"])
    return None


@contextlib.contextmanager
def _game(tmp_path: Path, *extra: str) -> Iterator[tuple[AgonesSidecar, dict[str, str], int,
                                                      Path]]:
    events = tmp_path / "events.jsonl"
    with AgonesSidecar() as sidecar:
        sidecar.wait_listening()
        env = {**os.environ, "AGONES_SDK_HTTP_PORT": str(sidecar.port),
               "REHYDRATE_CONTROL_SOCKET": str(tmp_path / "ctl.sock"),
               "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            # port 0: the server binds a free port itself and names it in its "ready"
            # event (a port picked here could be taken before it binds); a restore
            # binds that same port again (UdpEndpoint)
            [sys.executable, str(SERVER), "--port", "0", "--health-interval", "1",
             "--events", str(events), *extra], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: _ready_port(events) is not None, 30, "the server to be ready")
            port = _ready_port(events)
            assert port is not None
            yield sidecar, env, port, events
        finally:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def game(tmp_path: Path) -> Iterator[tuple[AgonesSidecar, dict[str, str], int, Path]]:
    with _game(tmp_path) as g:
        yield g


def _run(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_example_server_across_a_notified_snapshot_and_restore(game):
    sidecar, env, port, events = game
    client = [sys.executable, str(CLIENT), "--port", str(port)]
    before = _run([*client, "--name", "alice", "--inputs", "10", "--stay"], env)
    assert before["states"] >= 3 and before["position"][0] > 0, before
    assert sidecar.gs.state == "Ready"
    assert sidecar.gs.labels.keys() == {"agones.dev/sdk-match"}

    assert _run([REHYDRATE, "notify", "save", "--json"], env)["ok"]
    t_saved = time.monotonic()
    with sidecar.cond:  # a new Pod's sidecar: nothing set, not Ready
        sidecar.gs.labels.clear()
    sidecar.set_state("Scheduled")
    assert _run([REHYDRATE, "notify", "restore", "--json"], env)["ok"]

    sidecar.wait_for("POST", "/health", since=t_saved)
    sidecar.wait_for("POST", "/ready", count=2)
    assert sidecar.gs.labels.keys() == {"agones.dev/sdk-match"}
    after = _run([*client, "--name", "bob", "--inputs", "10",
                  "--stale", f"{before['player']}:{before['token']}"], env)
    assert after["stale_reply"] == "rejoin"
    assert after["token"] != before["token"] and after["states"] >= 3
    restored = [json.loads(line) for line in events.read_text().splitlines()
                if '"restored"' in line]
    assert [(r["kind"], r["generation"]) for r in restored] == [("restore", 1)]
    status = _run([REHYDRATE, "status", "--json"], env)
    assert status["ready"] and status["agones"]["reason"] == "" and status["game"]["tick"] > 0


def test_example_server_answers_bad_datagrams_with_one_error(game):
    _, _, port, _ = game
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        for bad in (b"not json", b"[1]", b'{"op": "fly"}'):
            s.send(bad)
            assert json.loads(s.recv(2048))["op"] == "error"
        s.send(b'{"op": "join", "name": "x"}')
        welcome = json.loads(s.recv(2048))
        assert welcome["op"] == "welcome"
        s.send(json.dumps({"op": "input", "player": welcome["player"],
                           "token": welcome["token"], "dx": "left"}).encode())
        while (reply := json.loads(s.recv(2048)))["op"] == "state":
            pass
        assert reply == {"op": "error", "error": "dx and dy must be -1, 0 or 1"}


def test_the_restore_hook_touches_the_players_only_on_the_game_loop():
    """The sync restore hook ran on rehydrate's worker thread and iterated the players
    while the loop added joining ones: "dictionary changed size during iteration", a
    failed required hook, a degraded server."""
    result = _in_process()
    assert result["ok"], result
    assert result["off_loop"] == [], result


# The server's TickClock on a clock only this script moves (no real frame is ever long,
# however loaded the machine): a snapshot the platform never takes (the snapshot deadline
# runs the resume hooks), then an ordinary frame. Prints what the game loop made of it.
_CARRY_ON = r"""
import asyncio, json, sys, threading, time
sys.path.insert(0, sys.argv[1])
import rehydrate
import server
from rehydrate.adapters.gameloop import TickClock

class Clock:
    now = 1000.0
    def __call__(self):
        return self.now

fake, clocks = Clock(), []
def tick_clock(rate, **kwargs):
    clocks.append(TickClock(rate, clock=fake, **kwargs))
    return clocks[-1]
server.TickClock = tick_clock

ready = threading.Event()
emit = server.Events.emit
def emitted(self, event, **fields):
    emit(self, event, **fields)
    if event == "ready":
        ready.set()
server.Events.emit = emitted

threading.Thread(target=lambda: asyncio.run(server.main(
    ["--port", "0", "--no-agones", "--rate", "30", "--max-catch-up", "2"])),
    daemon=True).start()
assert ready.wait(30), "the server never became ready"
clock = clocks[0]
rehydrate.default_engine.snapshot_deadline = 0.05
assert rehydrate.simulate_snapshot().ok
assert rehydrate.wait_ready(30), "the snapshot deadline did not run the resume hooks"
end = time.monotonic() + 30  # its report is published just after the run made it ready
while rehydrate.status().last_report.reason != "snapshot-deadline" and time.monotonic() < end:
    time.sleep(0.01)
report = rehydrate.status().last_report
ticks = clock.ticks
fake.now += 0.1  # an ordinary frame: three ticks owed
end = time.monotonic() + 30
while clock.ticks == ticks and time.monotonic() < end:
    time.sleep(0.01)  # the loop polls its clock every tick (a real 1/30 s)
print(json.dumps({"reason": report.reason, "kind": report.kind,
                  "frozen_for": report.frozen_for, "ticks": clock.ticks - ticks,
                  "game": rehydrate.status().to_dict()["game"]}))
"""


def test_a_snapshot_never_taken_makes_no_jump_and_no_resync():
    """The snapshot deadline (and a failed before-snapshot pass) runs the resume hooks
    although the process was never frozen: the tick clock still forced a jump, so the
    server dropped a frame and told every client to resync for nothing."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("REHYDRATE_CONTROL_SOCKET", None)
    proc = subprocess.run([sys.executable, "-c", _CARRY_ON, str(SERVER.parent)], env=env,
                          capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert (result["reason"], result["kind"], result["frozen_for"]) == (
        "snapshot-deadline", "resume", 0.0), result
    assert result["ticks"] == 3, result
    assert result["game"]["jumps"] == 0 and result["game"]["dropped"] == 0, result


def _ask(s: socket.socket, msg: dict[str, Any] | bytes, want: str) -> dict[str, Any]:
    """Send ``msg``; the first reply with op ``want`` (states in between are skipped)."""
    s.send(msg if isinstance(msg, bytes) else json.dumps(msg).encode())
    while (reply := json.loads(s.recv(65536)))["op"] != want:
        pass
    return reply


def _client(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(10)  # an upper bound for a reply that must come
    s.connect(("127.0.0.1", port))
    return s


def test_out_of_range_or_overflowing_inputs_get_one_error_reply(game):
    """dx = 1e999 (inf in JSON) made int() raise OverflowError: no reply, and a traceback
    from the loop for every such datagram."""
    _, _, port, _ = game
    with _client(port) as s:
        w = _ask(s, {"op": "join", "name": "x"}, "welcome")
        who = f'"player": "{w["player"]}", "token": "{w["token"]}"'.encode()
        for dx in (b"1e999", b"-1e999", b"NaN", b"true", b"2", b"0.5", b'"1"'):
            reply = _ask(s, b'{"op": "input", %s, "dx": %s}' % (who, dx), "error")
            assert reply == {"op": "error", "error": "dx and dy must be -1, 0 or 1"}, dx
        _ask(s, {"op": "input", "player": w["player"], "token": w["token"], "dx": 1,
                 "dy": -1}, "state")  # the valid values still work, the player is still in


def test_a_restore_drops_the_players_it_told_to_rejoin(game):
    """Old players stayed after a restore: ghosts moving in every state, unable to leave
    (their tokens no longer verify), and a rejoined client got every state twice."""
    _, env, port, _ = game
    with _client(port) as s:
        w = _ask(s, {"op": "join", "name": "alice"}, "welcome")
        assert _run([REHYDRATE, "status", "--json"], env)["game"]["players"] == 1
        assert _run([REHYDRATE, "notify", "save", "--json"], env)["ok"]
        assert _run([REHYDRATE, "notify", "restore", "--json"], env)["ok"]
        assert _run([REHYDRATE, "status", "--json"], env)["game"]["players"] == 0
        _ask(s, {"op": "leave", "player": w["player"], "token": w["token"]}, "rejoin")
        again = _ask(s, {"op": "join", "name": "alice"}, "welcome")
        state = _ask(s, {"op": "input", "player": again["player"], "token": again["token"],
                         "dx": 1}, "state")
        assert list(state["players"]) == [again["player"]]


def test_idle_players_are_dropped_and_a_full_match_answers_busy(tmp_path):
    """No idle timeout and no cap: 1,168 joins from clients that never came back stalled
    the tick, and every one of them stayed in every state."""
    with _game(tmp_path, "--max-players", "2", "--idle-timeout", "1") as (_, env, port, _e), \
            _client(port) as a, _client(port) as b, _client(port) as c:
        _ask(a, {"op": "join", "name": "a"}, "welcome")
        _ask(b, {"op": "join", "name": "b"}, "welcome")
        assert _ask(c, {"op": "join", "name": "c"}, "busy")["reason"] == "match full"
        wait_for(lambda: _run([REHYDRATE, "status", "--json"], env)["game"]["players"] == 0,
                 30, "the idle players to be dropped")
        _ask(c, {"op": "join", "name": "c"}, "welcome")


def test_a_sidecar_that_starts_after_the_server_still_gets_the_label_and_ready(tmp_path):
    """The server tried the label and Ready once and swallowed the error: with its
    sidecar up a moment later (common in a Pod) the GameServer never became Ready."""
    import threading

    events = tmp_path / "events.jsonl"
    with AgonesSidecar(down_for=None) as sidecar:
        env = {**os.environ, "AGONES_SDK_HTTP_PORT": str(sidecar.port),
               "REHYDRATE_CONTROL_SOCKET": str(tmp_path / "ctl.sock"),
               "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, str(SERVER), "--port", "0", "--health-interval", "1",
             "--events", str(events)], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        assert proc.stderr is not None
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        try:
            # the server's first attempt failed: the sidecar is not listening yet
            wait_for(lambda: any("PUT /metadata/label" in line for line in lines), 30,
                     "the server's first, failed attempt")
            sidecar.up()
            sidecar.wait_listening()
            wait_for(lambda: _ready_port(events) is not None, 30, "the server to be ready")
            sidecar.wait_for("POST", "/ready", timeout=30)
            assert sidecar.gs.state == "Ready"
            assert sidecar.gs.labels.keys() == {"agones.dev/sdk-match"}
        finally:
            proc.kill()
            proc.wait(10)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_client_with_nothing_listening_says_no_reply_and_fails():
    """An ICMP port unreachable made recv() raise ConnectionRefusedError: a traceback
    instead of "no 'welcome' reply within ...s"."""
    proc = subprocess.run([sys.executable, str(CLIENT), "--port", str(_free_udp_port()),
                           "--timeout", "1"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 1, proc
    assert proc.stderr.strip() == "client: no 'welcome' reply within 1.0s", proc.stderr
    assert proc.stdout == ""


def test_the_client_of_a_server_gone_after_the_welcome_fails_without_a_traceback():
    import threading

    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(30)

    def welcome_then_go() -> None:
        with server:
            data, addr = server.recvfrom(2048)
            assert json.loads(data)["op"] == "join"
            server.sendto(json.dumps({"op": "welcome", "player": "p1", "token": "t",
                                      "tick": 0, "rate": 30, "instance": "i"}).encode(),
                          addr)
        # closed: the client's inputs now meet ICMP port unreachable

    t = threading.Thread(target=welcome_then_go)
    t.start()
    proc = subprocess.run([sys.executable, str(CLIENT), "--port",
                           str(server.getsockname()[1]), "--timeout", "1"],
                          capture_output=True, text=True, timeout=60, check=False)
    t.join(30)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1, proc
    assert json.loads(proc.stdout)["states"] == 0
