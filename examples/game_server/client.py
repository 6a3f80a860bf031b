"""A UDP client for ``server.py``: joins, sends inputs, collects states; prints one JSON
object summarising what it saw (the tests read it).

    python examples/game_server/client.py --port 7777 --name alice --inputs 20

``--stale PLAYER:TOKEN`` first sends an input with an old token and reports the answer
(``rejoin`` from a restored clone).

Exit status 1, with one line on stderr (``client: no 'welcome' reply within 10.0s``), when
a reply never came — nothing listening on the port included — or no state arrived.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import time
from typing import Any


def request(sock: socket.socket, msg: dict[str, Any], want: str, timeout: float
            ) -> dict[str, Any]:
    """Send ``msg`` (again every 0.2 s) until a reply with op ``want`` arrives.

    On a connected UDP socket an ICMP "port unreachable" (nothing listening: the server
    not up yet, gone, or rebinding after a restore) comes back as ConnectionRefusedError
    from the next send() or recv(): no reply, like a timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        end = min(deadline, time.monotonic() + 0.2)
        try:
            sock.send(json.dumps(msg).encode())
            while time.monotonic() < end:
                sock.settimeout(max(0.01, end - time.monotonic()))
                reply = json.loads(sock.recv(65536))
                if reply.get("op") == want:
                    return dict(reply)
        except ConnectionRefusedError:
            time.sleep(max(0.0, end - time.monotonic()))  # refused at once: no busy loop
        except TimeoutError:
            pass
    raise TimeoutError(f"no {want!r} reply within {timeout}s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="rehydrate example: game client")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7777)
    ap.add_argument("--name", default="player")
    ap.add_argument("--inputs", type=int, default=20)
    ap.add_argument("--stale", default=None, help="PLAYER:TOKEN to try first")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--stay", action="store_true", help="do not leave the match at the end")
    args = ap.parse_args(argv)

    try:
        return play(args)
    except TimeoutError as exc:
        print(f"client: {exc}", file=sys.stderr)
        return 1


def play(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((args.host, args.port))
        if args.stale:
            pid, token = args.stale.split(":", 1)
            reply = request(sock, {"op": "input", "player": pid, "token": token, "dx": 1},
                            "rejoin", args.timeout)
            out["stale_reply"] = reply["op"]
        welcome = request(sock, {"op": "join", "name": args.name}, "welcome", args.timeout)
        pid, token = welcome["player"], welcome["token"]
        out.update(player=pid, token=token, joined_at_tick=welcome["tick"],
                   instance=welcome["instance"])
        ticks: list[int] = []
        deadline = time.monotonic() + args.timeout
        sent = 0
        while (sent < args.inputs or len(ticks) < 3) and time.monotonic() < deadline:
            try:
                if sent < args.inputs:
                    sock.send(json.dumps({"op": "input", "player": pid, "token": token,
                                          "dx": 1, "dy": 0}).encode())
                    sent += 1
                sock.settimeout(0.05)
                msg = json.loads(sock.recv(65536))
            except ConnectionRefusedError:
                time.sleep(0.05)  # the server is gone (or rebinding): no reply
                continue
            except TimeoutError:
                continue
            if msg.get("op") == "state" and pid in msg["players"]:
                ticks.append(msg["tick"])
                out["position"] = msg["players"][pid]
            elif msg.get("op") == "rejoin":
                out["rejoin"] = msg.get("reason")
        if not args.stay:
            with contextlib.suppress(ConnectionRefusedError):
                sock.send(json.dumps({"op": "leave", "player": pid, "token": token}).encode())
    out.update(states=len(ticks), first_tick=ticks[0] if ticks else None,
               last_tick=ticks[-1] if ticks else None, inputs=sent)
    print(json.dumps(out))
    return 0 if ticks else 1


if __name__ == "__main__":
    sys.exit(main())
