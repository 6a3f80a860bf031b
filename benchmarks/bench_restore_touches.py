"""Memory pages a restore run touches, per hook: the count behind rehydrate's share.

Under gVisor every page a restored clone touches is touched for the first time in that
sandbox, and each first touch is a fault costing 1-15 µs (examples/inference_server/
README.md). rehydrate's share of resume -> ready is therefore mostly the number of pages
its hooks touch, and that number does not depend on the host's load: this benchmark
counts it outside the sandbox, so that a change that makes the restore path touch more
(or less) shows in one quiet run, where the share's own timing under runsc needs many.

A child interpreter runs a small service with every built-in manager a web service uses
(the environment from a ``spec_environ`` file, entropy, an ephemeral key, an
``httpx.AsyncClient`` health-checked against a loopback server of this process, NumPy
when installed) on its event loop, and simulates restores. An observer in the child
stops at each hook's start and end (a pipe to this process, which answers once it has
counted): the process's referenced bits are read from ``/proc/PID/smaps`` and cleared
(``/proc/PID/clear_refs``). Counted are the private anonymous mappings (heap, stacks,
Python's arenas); file mappings are left out because their pages' referenced flags are
shared with every other process on the host. The first simulated restore is a warm-up;
the table shows the median of the others, in KB (4 KB per page). Each interval also
holds what one stop of the counting touches itself (shown in its own row, measured as two
stops back to back); the dispatch row sums the intervals before, between and after the
hooks. ``TOUCH_DETECTORS=none`` starts the child without detectors (their threads add
a few hundred KB).

``BENCH_BASELINE_TREE=DIR`` (a checkout of another commit, e.g. ``git archive C | tar -x
-C DIR``) runs the same child on that tree's rehydrate, side by side. Linux only (the
``/proc`` files); no root needed. Run alone: ``python benchmarks/bench_restore_touches.py``.
"""

from __future__ import annotations

import http.server
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = os.environ.get("BENCH_BASELINE_TREE")
RESTORES = 6  # the first is a warm-up

_CHILD = r"""
import asyncio, os, sys
sys.path.insert(0, {root!r})
import rehydrate
from rehydrate import connections, keys
from rehydrate.extensions import default_engine
try:
    import numpy  # noqa: F401 - reseeded by rehydrate.entropy when imported
except ImportError:
    pass

req, ack = int(os.environ["TOUCH_REQ_FD"]), int(os.environ["TOUCH_ACK_FD"])

def stop_here(tag):
    os.write(req, (tag + "\n").encode())
    os.read(ack, 1)

def restoring(ctx):
    return getattr(ctx, "kind", None) == "restore"

class Counter:
    def hook_started(self, hook, ctx):
        if not restoring(ctx):
            return None
        stop_here("start " + hook.name)
        return hook.name
    def hook_finished(self, token, result):
        if token is not None:
            stop_here("end " + token)
    def event_started(self, ctx):
        if restoring(ctx):
            stop_here("event-start")
            stop_here("calibration")  # what one stop of the counting touches itself
    def event_finished(self, ctx, report):
        if restoring(ctx):
            stop_here("event-end")

async def main():
    rehydrate.start(os.environ.get("TOUCH_DETECTORS", "auto"), loop=asyncio.get_running_loop())
    keys.ephemeral("bench-key", algorithm="ed25519")
    client = connections.httpx_async_client(
        "upstream", check_url="/healthz", base_url=os.environ["UPSTREAM"], timeout=5.0)
    await client.get("/healthz")
    default_engine().add_observer(Counter())
    for _ in range({restores}):
        await asyncio.to_thread(rehydrate.simulate_restore)
        await client.get("/healthz")
    os.write(req, b"done\n")

asyncio.run(main())
"""


class _Health(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:
        pass


def _private_referenced_kb(pid: int) -> int:
    total = 0
    counted = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=6)
            if head and "-" in head[0] and not head[0].endswith(":"):
                path = head[5].strip() if len(head) > 5 else ""
                counted = path in ("", "[heap]", "[stack]")
            elif counted and head and head[0] == "Referenced:":
                total += int(head[1])
    return total


def touches(tree: Path, upstream: str, spec_dir: str) -> list[dict[str, int]]:
    """Per simulated restore: KB touched in each interval, keyed by where it ended
    (``start NAME`` = the dispatch before hook NAME, ``end NAME`` = the hook itself,
    ``event-end`` = after the last hook)."""
    req_r, req_w = os.pipe()
    ack_r, ack_w = os.pipe()
    env = dict(os.environ, TOUCH_REQ_FD=str(req_w), TOUCH_ACK_FD=str(ack_r),
               UPSTREAM=upstream, REHYDRATE_GVISOR_PROC=spec_dir)
    env.pop("PYTHONPATH", None)
    code = _CHILD.format(root=str(tree), restores=RESTORES)
    child = subprocess.Popen([sys.executable, "-c", code], env=env,
                             pass_fds=(req_w, ack_r), stdout=subprocess.DEVNULL)
    os.close(req_w)
    os.close(ack_r)
    runs: list[dict[str, int]] = []
    try:
        with os.fdopen(req_r, "rb", buffering=0) as requests:
            for raw in iter(requests.readline, b""):
                tag = raw.decode().strip()
                if tag == "done":
                    break
                kb = _private_referenced_kb(child.pid)
                with open(f"/proc/{child.pid}/clear_refs", "w") as f:
                    f.write("1")
                if tag == "event-start":
                    runs.append({})
                elif tag == "calibration" and runs:
                    runs[-1]["calibration"] = kb
                elif runs:
                    runs[-1][tag] = kb
                os.write(ack_w, b"k")
    finally:
        os.close(ack_w)
        if child.wait(timeout=120) != 0:
            raise RuntimeError(f"the child on {tree} exited {child.returncode}")
    if len(runs) != RESTORES:
        raise RuntimeError(f"the child on {tree} ran {len(runs)} restores of {RESTORES}")
    return runs[1:]


def _rows(runs: list[dict[str, int]]) -> dict[str, float]:
    """Median KB per row: each hook, the dispatch (before, between and after the hooks
    summed), and the total."""
    per_run: list[dict[str, int]] = []
    for run in runs:
        rows: dict[str, int] = defaultdict(int)
        for tag, kb in run.items():
            if tag == "calibration":
                rows["the counting's own stop (each row has one per interval)"] = kb
                continue
            if tag.startswith("end "):
                rows[tag[4:]] += kb
            else:
                rows["dispatch (engine, between hooks)"] += kb
            rows["total"] += kb
        per_run.append(rows)
    names = {name for rows in per_run for name in rows}
    return {name: statistics.median(rows.get(name, 0) for rows in per_run) for name in names}


def run() -> list[tuple[str, str, str]]:
    if not Path("/proc/self/clear_refs").exists():
        return [("pages touched by a restore run", "not measured: no /proc/PID/clear_refs",
                 "-")]
    trees = [ROOT] + ([Path(BASELINE).resolve()] if BASELINE else [])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    upstream = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with tempfile.TemporaryDirectory(prefix="rehydrate-touch-") as spec_dir:
            Path(spec_dir, "spec_environ").write_bytes(b"APP_SETTING=1\0")
            measured = [_rows(touches(tree, upstream, spec_dir)) for tree in trees]
    finally:
        server.shutdown()
    order = sorted((n for n in measured[0] if n != "total"),
                   key=lambda n: (n.startswith("the counting"), n.startswith("dispatch"), n))
    rows = []
    for name in [*order, "total"]:
        ours = measured[0].get(name, 0.0)
        text = f"{ours:,.0f} KB"
        if BASELINE:
            theirs = measured[1].get(name, 0.0)
            ratio = f"{ours / theirs:.2f}x" if theirs else "-"
            text += f" (baseline {theirs:,.0f} KB, {ratio})"
        rows.append((f"pages touched: {name}", text, "info"))
    return rows


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import main

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
