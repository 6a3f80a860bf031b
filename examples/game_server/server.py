"""A small asyncio UDP game server that survives snapshot restores (rehydrate example).

Players join, send inputs (a direction), and receive the world state at a fixed tick
rate. Wired to rehydrate:

* ``TickClock``: after a restore the loop runs at most ``--max-catch-up`` ticks for the
  frozen seconds, then tells every client to resync;
* ``MatchSessions``: session tokens differ in every clone; tokens issued before the
  snapshot are refused ("rejoin");
* ``UdpEndpoint``: the game socket is probed after a restore and bound again if dead;
* ``AgonesAdapter``: health pings, ``Ready``, the match label (``--no-agones`` without a
  sidecar), retried until a sidecar that starts after the game answers.

Run it (and ``client.py`` against it)::

    python examples/game_server/server.py --port 7777 --no-agones
    python examples/game_server/client.py --port 7777 --name alice

Protocol: one JSON object per datagram. Client → server: ``{"op": "join", "name": N}``,
``{"op": "input", "player": P, "token": T, "dx": -1|0|1, "dy": -1|0|1}``,
``{"op": "leave", "player": P, "token": T}``. Server → client: ``welcome`` (player, token,
tick, rate), ``state`` (tick, positions of every player), ``resync`` (after a jump),
``rejoin`` (unknown player or stale token; to everyone after a restore, which also drops
every player), ``busy`` (a snapshot is being taken, or ``--max-players`` are in), ``error``.
A player not heard from for ``--idle-timeout`` seconds is dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import rehydrate
from rehydrate.adapters.agones import AgonesAdapter, AgonesError
from rehydrate.adapters.gameloop import TickClock
from rehydrate.adapters.sessions import MatchSessions
from rehydrate.adapters.udp import UdpEndpoint

log = logging.getLogger("game")

WORLD = 100  # the world is a WORLD x WORLD torus
MAX_DATAGRAM = 1200


class Events:
    """JSON lines for whoever watches the server (tests, dashboards)."""

    def __init__(self, path: str | None) -> None:
        self._out = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    def emit(self, event: str, **fields: Any) -> None:
        if self._out is not None:
            self._out.write(json.dumps({"event": event, "wall": time.time(), **fields}) + "\n")


@dataclass
class Player:
    name: str
    addr: Any
    x: int = 0
    y: int = 0
    dx: int = 0
    dy: int = 0
    last_seen: float = field(default_factory=time.monotonic)


@dataclass
class Match:
    """The simulation: players move one cell per tick in their chosen direction."""

    rate: float
    max_players: int = 64
    idle_timeout: float = 30.0
    tick: int = 0
    players: dict[str, Player] = field(default_factory=dict)
    joined: int = 0

    def step(self) -> None:
        self.tick += 1
        for p in self.players.values():
            p.x = (p.x + p.dx) % WORLD
            p.y = (p.y + p.dy) % WORLD

    def drop_idle(self, now: float) -> list[str]:
        """Players not heard from for ``idle_timeout`` s: a client that vanished without
        ``leave`` would otherwise stay in every state, and hold a slot, for ever."""
        gone = [pid for pid, p in self.players.items()
                if now - p.last_seen > self.idle_timeout]
        for pid in gone:
            del self.players[pid]
        return gone

    def state(self) -> dict[str, Any]:
        return {"op": "state", "tick": self.tick,
                "players": {pid: [p.x, p.y] for pid, p in self.players.items()}}


class GameProtocol(asyncio.DatagramProtocol):
    def __init__(self, match: Match, sessions: MatchSessions) -> None:
        self.match = match
        self.sessions = sessions
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # again after a re-bind

    def send(self, msg: dict[str, Any], addr: Any) -> None:
        if self.transport is not None:
            self.transport.sendto(json.dumps(msg).encode(), addr)

    def broadcast(self, msg: dict[str, Any]) -> None:
        for p in self.match.players.values():
            self.send(msg, p.addr)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            msg = json.loads(data[:MAX_DATAGRAM])
            if not isinstance(msg, dict):
                raise TypeError
            op = msg["op"]
        except (ValueError, KeyError, TypeError):
            self.send({"op": "error", "error": "expected a JSON object with 'op'"}, addr)
            return
        if op == "join":
            self.join(str(msg.get("name", "anonymous"))[:32], addr)
        elif op in ("input", "leave"):
            pid = str(msg.get("player", ""))
            player = self.match.players.get(pid)
            if player is None or not self.sessions.verify(pid, str(msg.get("token", ""))):
                self.send({"op": "rejoin", "reason": "unknown player or stale token"}, addr)
                return
            player.addr = addr
            player.last_seen = time.monotonic()
            if op == "leave":
                del self.match.players[pid]
                return
            dx, dy = msg.get("dx", 0), msg.get("dy", 0)
            # Exactly the protocol's values: int() of a JSON 1e999 (inf) raised an
            # OverflowError that reached the loop's exception handler, with no reply.
            if not all(type(d) is int and -1 <= d <= 1 for d in (dx, dy)):
                self.send({"op": "error", "error": "dx and dy must be -1, 0 or 1"}, addr)
                return
            player.dx, player.dy = dx, dy
        else:
            self.send({"op": "error", "error": f"unknown op {op!r}"}, addr)

    def join(self, name: str, addr: Any) -> None:
        if not self.sessions.available:
            self.send({"op": "busy", "reason": "snapshot in progress"}, addr)
            return
        if len(self.match.players) >= self.match.max_players:
            self.send({"op": "busy", "reason": "match full"}, addr)
            return
        self.match.joined += 1
        pid = f"p{self.match.joined}"
        self.match.players[pid] = Player(name, addr)
        self.send({"op": "welcome", "player": pid, "token": self.sessions.token(pid),
                   "tick": self.match.tick, "rate": self.match.rate,
                   "instance": rehydrate.instance_id()}, addr)


async def game_loop(match: Match, clock: TickClock, proto: GameProtocol,
                    events: Events) -> None:
    while True:
        n = clock.due()
        for _ in range(n):
            match.step()
        if clock.last_jump:
            # Frozen (or restored): the skipped seconds are not simulated. Clients resync.
            events.emit("jump", ticks=n, skipped=clock.last_jump, tick=match.tick)
            proto.broadcast({"op": "resync", "tick": match.tick, "skipped": clock.last_jump})
        if n:
            for pid in match.drop_idle(time.monotonic()):
                events.emit("idle", player=pid, tick=match.tick)
            proto.broadcast(match.state())
        await asyncio.sleep(clock.until_next())


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="rehydrate example: a UDP game server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7777)
    ap.add_argument("--rate", type=float, default=30.0, help="ticks per second")
    ap.add_argument("--max-catch-up", type=int, default=2)
    ap.add_argument("--max-players", type=int, default=64)
    ap.add_argument("--idle-timeout", type=float, default=30.0,
                    help="drop a player not heard from for this many seconds")
    ap.add_argument("--health-interval", type=float, default=2.0)
    ap.add_argument("--no-agones", action="store_true", help="run without an SDK sidecar")
    ap.add_argument("--events", default=None, help="append JSON-line events to this file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    events = Events(args.events)
    if args.max_players < 1 or not args.idle_timeout > 0:
        ap.error("--max-players must be at least 1 and --idle-timeout positive")
    match = Match(rate=args.rate, max_players=args.max_players,
                  idle_timeout=args.idle_timeout)
    sessions = MatchSessions("match")
    clock = TickClock(args.rate, max_catch_up=args.max_catch_up)
    endpoint = UdpEndpoint(lambda: GameProtocol(match, sessions), (args.host, args.port))
    await endpoint.start()
    proto = endpoint.protocol
    assert isinstance(proto, GameProtocol)

    @rehydrate.after_restore(name="game.restored")
    async def restored(ctx: rehydrate.RestoreContext) -> None:
        # async, so it runs on this loop (rehydrate.start(loop=...) below), the one thread
        # that touches match.players: a sync hook ran on rehydrate's worker thread and
        # iterated the players while joins added some ("dictionary changed size").
        # Tokens changed with the key: every connected player must rejoin (a clone's
        # players are not even connected to it).
        proto.broadcast({"op": "rejoin", "reason": ctx.kind})
        # Their tokens no longer verify, so kept entries were ghosts: unable to leave,
        # moving in every state, and a rejoined client got each state twice.
        dropped = len(match.players)
        match.players.clear()
        events.emit("restored", kind=ctx.kind, reason=ctx.reason, generation=ctx.generation,
                    frozen_for=ctx.frozen_for, tick=match.tick, epoch=sessions.epoch,
                    instance=rehydrate.instance_id(), dropped=dropped)

    engine = rehydrate.default_engine
    engine.add_status("game", lambda: {
        "tick": match.tick, "players": len(match.players), "jumps": clock.jumps,
        "dropped": round(clock.dropped, 3), "rebinds": endpoint.rebinds})
    rehydrate.start(loop=asyncio.get_running_loop())

    agones = None
    game = asyncio.create_task(game_loop(match, clock, proto, events))
    try:
        if not args.no_agones:
            agones = AgonesAdapter(health_interval=args.health_interval)
            agones.install()
            await agones_ready(agones, f"m-{os.getpid()}-{int(time.time())}")
        events.emit("ready", port=endpoint.address[1], pid=os.getpid(), tick=match.tick,
                    agones=agones is not None)
        await game
    finally:
        game.cancel()
        endpoint.close()
        if agones is not None:
            await agones.aclose()


async def agones_ready(agones: AgonesAdapter, label: str) -> None:
    """The match label, then Ready, retried with backoff until the sidecar answers: in a
    Pod the SDK sidecar may start a moment after the game, and the adapter does not retry
    these calls itself (it only remembers them for after a restore)."""
    attempt = 0
    while True:
        try:
            await agones.aset_label("match", label)
            await agones.aready()
            return
        except AgonesError as exc:
            attempt += 1
            if refused(exc):  # the sidecar answered "no": asking again cannot help
                log.error("Agones refused: %s", exc)
                return
            delay = min(5.0, 0.1 * 2 ** min(attempt, 6))
            # one warning, then quiet: a sidecar starting late is normal in a Pod
            log.log(logging.WARNING if attempt == 1 else logging.DEBUG,
                    "Agones (attempt %d, again in %.1fs): %s", attempt, delay, exc)
            await asyncio.sleep(delay)


def refused(exc: AgonesError) -> bool:
    """A 4xx other than 408 and 429: the request itself was refused."""
    cause = exc.__cause__
    response = getattr(cause, "response", None)
    code = getattr(response, "status_code", 0)
    return isinstance(code, int) and 400 <= code < 500 and code not in (408, 429)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
