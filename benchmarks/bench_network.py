"""Network benchmarks: concurrent reconnect after restore; re-applying routes and rules.

1. 50 managed HTTP connections (``rehydrate.connections.httpx_client`` with a health URL)
   to a loopback server that makes every new connection wait 20 ms before it is served
   (its single event loop accepts one connection after another; each then pays a 20 ms
   handshake delay — the cost of a TLS/auth handshake or a far peer). Reconnecting them
   one after another vs. rehydrate's restore hook, side by side in one run.
2. Re-applying 200 captured routes plus a 100-rule nftables table inside a network
   namespace made for the run (root only; otherwise a "skipped (needs root)" row).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N_CONN = 50
ACCEPT_DELAY = 0.020
N_ROUTES = 200
N_RULES = 100
REPEAT = 5


SERVER = r"""
import asyncio, sys

DELAY = float(sys.argv[1])

async def handle(reader, writer):
    await asyncio.sleep(DELAY)  # every new connection waits before it is served
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=128)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


class SlowAcceptServer:
    """HTTP/1.1 keep-alive server on loopback in its own process (so that it does not
    share the benchmark's GIL); one event loop accepts connections one after another and
    each new connection waits ``ACCEPT_DELAY`` before it is served."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(ACCEPT_DELAY)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def reconnect_rows() -> list[tuple[str, str, str]]:
    from rehydrate import connections
    from rehydrate.testing import isolated_engine

    server = SlowAcceptServer()
    engine = isolated_engine()
    try:
        clients = [connections.httpx_client(f"api{i}", base_url=f"http://127.0.0.1:{server.port}",
                                            check_url="/health", engine=engine)
                   for i in range(N_CONN)]
        conns = connections.connections(engine=engine)
        seq, conc = [], []
        for _ in range(REPEAT):
            # each round starts like a real one: the pools were closed before the snapshot
            assert engine.simulate_snapshot().ok
            t0 = time.perf_counter()
            for c in conns:  # what an application does without rehydrate: one by one
                assert c.open_fn is not None and c.check_fn is not None
                c.open_fn()
                c.check_fn()
            seq.append(time.perf_counter() - t0)
            assert engine.simulate_snapshot().ok
            t0 = time.perf_counter()
            report = engine.simulate_restore()
            conc.append(time.perf_counter() - t0)
            assert report.ok, report.table()
        for client in clients:
            client.close()
    finally:
        engine.close()
        server.close()
    s, c = statistics.median(seq), statistics.median(conc)
    return [
        (f"reconnect {N_CONN} HTTP connections, {ACCEPT_DELAY * 1e3:.0f} ms per new "
         "connection: sequential", f"{s * 1e3:.0f} ms", "baseline"),
        (f"reconnect {N_CONN} HTTP connections: rehydrate restore (concurrent)",
         f"{c * 1e3:.0f} ms ({s / c:.1f}x faster)", ">= 10x faster"),
    ]


ROUTES_SNIPPET = r'''
import json, statistics, subprocess, sys, time
from rehydrate import routes
from rehydrate.testing import isolated_engine

engine = isolated_engine()
cap = routes.capture(engine=engine)
assert len(cap.routes) == int(sys.argv[1]) and len(cap.tables) == 1, cap.problems
times = []
for _ in range(int(sys.argv[2])):
    subprocess.run("ip route flush proto boot; ip route flush proto static; "
                   "nft flush ruleset", shell=True, check=True)
    t0 = time.perf_counter()
    result = routes.apply(engine=engine)
    times.append(time.perf_counter() - t0)
    assert result.ok and result.routes == len(cap.routes) and result.tables == 1, \
        result.to_dict()
print(json.dumps({"median": statistics.median(times), "min": min(times)}))
'''


def routes_rows() -> list[tuple[str, str, str]]:
    name = f"re-apply {N_ROUTES} routes + a {N_RULES}-rule nftables table (netns, verified)"
    if os.geteuid() != 0:
        return [(name, "skipped (needs root)", "< 100 ms")]
    if shutil.which("ip") is None or shutil.which("nft") is None:
        return [(name, "skipped (needs ip and nft)", "< 100 ms")]
    tag = uuid.uuid4().hex[:6]
    ns, dev = f"rh5bench-{tag}", f"rh5b{tag}"

    def sh(cmd: str, stdin: str | None = None) -> None:
        subprocess.run(cmd, shell=True, check=True, input=stdin, text=True,
                       capture_output=True)

    sh(f"ip netns add {ns}")
    try:
        sh(f"ip -n {ns} link add {dev} type veth peer name {dev}p && "
           f"ip -n {ns} link set {dev} up && ip -n {ns} link set {dev}p up && "
           f"ip -n {ns} addr add 10.200.1.1/24 dev {dev}")
        batch = "".join(f"route add 10.200.{10 + i}.0/24 via 10.200.1.2 dev {dev}\n"
                        for i in range(N_ROUTES))
        sh(f"ip -n {ns} -batch -", batch)
        rules = "\n".join(f"    tcp dport {1000 + i} counter accept" for i in range(N_RULES))
        sh(f"ip netns exec {ns} nft -f -",
           "table inet bench {\n  chain out {\n    type filter hook output priority 0; "
           f"policy accept;\n{rules}\n  }}\n}}\n")
        proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                               textwrap.dedent(ROUTES_SNIPPET), str(N_ROUTES), "5"],
                              capture_output=True, text=True, cwd=ROOT, check=False)
        if proc.returncode != 0:
            return [(name, f"failed: {proc.stderr.strip().splitlines()[-1:]}", "< 100 ms")]
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    return [(name, f"{data['median'] * 1e3:.1f} ms (min {data['min'] * 1e3:.1f} ms)",
             "< 100 ms")]


def run() -> list[tuple[str, str, str]]:
    return reconnect_rows() + routes_rows()


if __name__ == "__main__":
    rows = run()
    widths = [max(len(r[i]) for r in [("benchmark", "measured", "goal"), *rows])
              for i in range(3)]
    for r in [("benchmark", "measured", "goal"), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
