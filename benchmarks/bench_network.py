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
import asyncio, json, select, statistics, subprocess, sys, time
from rehydrate import routes
from rehydrate.testing import isolated_engine

N, REPEAT = int(sys.argv[1]), int(sys.argv[2])
engine = isolated_engine()
cap = routes.capture(engine=engine)  # also encodes the route messages, as before a snapshot
assert len(cap.routes) == N and len(cap.tables) == 1, cap.problems

def flush(nft=True):
    subprocess.run("ip route flush proto boot; ip route flush proto static"
                   + ("; nft flush ruleset" if nft else ""), shell=True, check=True)

def timed(fn, nft=False, fresh=True):
    times = []
    for _ in range(REPEAT):
        if fresh:
            flush(nft)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "min": min(times)}

def apply(cold=False):
    if cold:  # what a restore without a before-snapshot notice pays
        routes.manager(engine)._encoder.warm([])
    result = routes.apply(engine=engine)
    assert result.ok and result.routes == N and result.tables == 1, result.to_dict()

out = {"apply": timed(apply, nft=True), "apply_cold": timed(lambda: apply(True), nft=True)}

# the replace step alone (no read-back), the ways pyroute2 offers, side by side
from pyroute2 import AsyncIPRoute, IPBatch, IPRoute
from pyroute2.netlink import NLMSG_ERROR

with IPRoute(groups=0) as ipr:
    by_name = {int(m["index"]): m.get_attr("IFLA_IFNAME") for m in ipr.get_links()}
by_name = {v: k for k, v in by_name.items()}
msgs = [routes._route_msg(r, by_name) for r in cap.routes]
kwargs = [{"dst": r.dst, "gateway": r.gateway, "oif": by_name[r.dev]} for r in cap.routes]

def one_by_one():
    with IPRoute(groups=0) as ipr:
        for kw in kwargs:
            ipr.route("replace", **kw)

def ipbatch():
    ipb = IPBatch()
    for kw in kwargs:
        ipb.route("replace", **kw)  # compiled with NLM_F_ACK, one sequence number each
    data, _ = bytes(ipb.batch), ipb.close()
    with IPRoute(groups=0) as ipr:
        ipr.sendto(data, (0, 0))
        acks = 0
        while acks < len(kwargs):
            select.select([ipr], [], [], 5)
            for m in ipr.marshal.parse(ipr.recv(1 << 20)):
                assert m["header"]["type"] == NLMSG_ERROR and m["header"]["error"] is None
                acks += 1

def gather():
    async def main():
        async with AsyncIPRoute(groups=0) as ipr:
            await asyncio.gather(*(ipr.route("replace", **kw) for kw in kwargs))
    asyncio.run(main())

# the manager pre-encodes captured routes create-only (what a restore sends for them);
# these replace messages get an encoder of their own, warmed as before a snapshot
warm = routes._netlink._Encoder()
warm.warm(msgs)

def batch(cold):
    rtnl = routes._Rtnl()
    try:
        enc = None if cold else warm
        assert not any(rtnl.replace(msgs, enc))
    finally:
        rtnl.close()

def dump():
    rtnl = routes._Rtnl()
    try:
        assert len(rtnl.routes()) >= N
    finally:
        rtnl.close()

out.update({"one_by_one": timed(one_by_one), "ipbatch": timed(ipbatch),
            "gather": timed(gather), "batch_cold": timed(lambda: batch(True)),
            "batch": timed(lambda: batch(False))})
batch(False)
out["dump"] = timed(dump, fresh=False)
print(json.dumps(out))
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
                               textwrap.dedent(ROUTES_SNIPPET), str(N_ROUTES), str(REPEAT)],
                              capture_output=True, text=True, cwd=ROOT, check=False)
        if proc.returncode != 0:
            return [(name, f"failed: {proc.stderr.strip().splitlines()[-1:]}", "< 100 ms")]
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def ms(key: str) -> str:
        return f"{data[key]['median'] * 1e3:.1f} ms (min {data[key]['min'] * 1e3:.1f} ms)"

    step = f"  replace {N_ROUTES} routes (no read-back) with pyroute2:"
    return [
        (name, ms("apply"), "< 100 ms"),
        ("  same, route messages encoded in the restore (no before-snapshot notice)",
         ms("apply_cold"), "-"),
        (f"{step} IPRoute.route('replace') one by one", ms("one_by_one"), "-"),
        (f"{step} IPBatch + one sendto, ACKs parsed", ms("ipbatch"), "-"),
        (f"{step} AsyncIPRoute, asyncio.gather", ms("gather"), "-"),
        (f"{step} rehydrate's rtmsg batch, encoded now", ms("batch_cold"), "-"),
        (f"{step} rehydrate's rtmsg batch, pre-encoded", ms("batch"), "-"),
        (f"  read back every route: one pyroute2 dump ({N_ROUTES}+ routes)", ms("dump"), "-"),
    ]


def run() -> list[tuple[str, str, str]]:
    return reconnect_rows() + routes_rows()


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    from run import main  # benchmarks/ is on sys.path when a module runs as a script

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
