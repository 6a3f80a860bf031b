"""A client for the example server, standard library only (fast to start under gVisor).

Sandboxes here have no network (``runsc --network=none``), so every request to a
sandboxed server comes from inside the sandbox: the test, ``make demo`` and
``make bench-restore`` run these commands there with ``runsc exec``. Each prints one
JSON object.

    client.py get PATH                      # {"status", "body", "instance_id"}
    client.py embed --key KEY TEXT...       # POST /v1/embed with a bearer key
    client.py maintenance on|off            # switch the upstream's maintenance mode
    client.py watch --env-file F --out F    # the prober (below)

``watch`` is the probe that times "first correct response": it runs beside the server
from the start, reads the API key from the environment file the platform gives the
sandbox (the emulated ``/proc/gvisor/spec_environ``, as a client would read it from its
secret store) and, whenever that key is one it has not yet been served with, sends
``/v1/embed`` at once — in a clone that request arrives before the restore may even have
been noticed, and must be refused (503), never served with the pre-snapshot key — then
waits for readiness with one ``GET /readyz?wait=`` (the gate answers it the moment the
restore hooks have run) and sends ``/v1/embed`` again, until the answer is 200 with the
embedding of the first answer it ever got (the cold server's). Then it appends one record
(``first-response``: wall time, instance ID, generation, how many 503 / 401 / connection
errors it saw first) to ``--out``. A restored clone's prober is a restored copy too: it
wakes with the clone and times the clone's first correct response the same way.

Waiting with one held request rather than polling every few milliseconds matters for
what is measured: every refused request is answered on the server's event loop, under
the GIL the restore hooks need (a prober sending ``/v1/embed`` every 5 ms put ~10
requests into each restore and made rehydrate's hooks ~40 ms slower in a clone). A
platform's readiness probe asks once a second at most; nothing else reaches a pod that
is not ready.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
from typing import Any

HOST = "127.0.0.1"
PORT = 8000
UPSTREAM_PORT = 8001
PROBE_TEXT = "restore me in a second"
POLL = 0.005  # seconds between attempts while a key is not yet served
READY_WAIT = 30.0  # seconds one GET /readyz?wait= may be held


def request(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
            *, port: int | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """One request on a new connection; ``{"status", "body", "instance_id"}``."""
    conn = http.client.HTTPConnection(HOST, port or PORT, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        hdrs = {"content-type": "application/json", **(headers or {})}
        conn.request(method, path, body=payload, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw.decode(errors="replace")
        return {"status": resp.status, "body": parsed,
                "instance_id": resp.getheader("x-instance-id")}
    finally:
        conn.close()


def embed(key: str, texts: list[str], timeout: float = 30.0) -> dict[str, Any]:
    return request("POST", "/v1/embed", {"texts": texts},
                   {"authorization": f"Bearer {key}"}, timeout=timeout)


def read_env_key(path: str, key: str = "API_KEY") -> str | None:
    """``key`` from a ``KEY=VALUE\\0`` file (the spec_environ format); last one wins."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    value = None
    for item in data.split(b"\0"):
        name, sep, val = item.partition(b"=")
        if sep and name.decode(errors="replace") == key:
            value = val.decode(errors="replace")
    return value


def watch(env_file: str, out_path: str) -> None:
    """The prober (see the module docstring). Runs until killed."""
    out = open(out_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    reference: list[float] | None = None
    served: str | None = None
    counts = {"503": 0, "401": 0, "other": 0, "errors": 0}
    while True:
        key = read_env_key(env_file)
        if key is None or key == served:
            time.sleep(POLL)
            continue
        try:
            r = embed(key, [PROBE_TEXT], timeout=30.0)
            if r["status"] != 200:
                counts[str(r["status"]) if str(r["status"]) in counts else "other"] += 1
                request("GET", f"/readyz?wait={READY_WAIT:g}", timeout=READY_WAIT + 10)
                r = embed(key, [PROBE_TEXT], timeout=30.0)
        except OSError:
            counts["errors"] += 1
            time.sleep(POLL)
            continue
        status = r["status"]
        if status != 200:
            counts[str(status) if str(status) in counts else "other"] += 1
            time.sleep(POLL)
            continue
        body = r["body"]
        vector = body["embeddings"][0]
        if reference is None:
            reference = vector
        correct = vector == reference
        out.write(json.dumps({
            "event": "first-response", "t": time.time(), "correct": correct,
            "instance_id": body["instance_id"], "generation": body["generation"],
            "seen_before": dict(counts), "embedding": vector}) + "\n")
        served = key if correct else None
        counts = dict.fromkeys(counts, 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    get = sub.add_parser("get")
    get.add_argument("path")
    emb = sub.add_parser("embed")
    emb.add_argument("--key", required=True)
    emb.add_argument("texts", nargs="+")
    mnt = sub.add_parser("maintenance")
    mnt.add_argument("state", choices=["on", "off"])
    wat = sub.add_parser("watch")
    wat.add_argument("--env-file", required=True)
    wat.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "get":
            result = request("GET", args.path)
        elif args.cmd == "embed":
            result = embed(args.key, args.texts)
        elif args.cmd == "maintenance":
            result = request("POST", "/admin/maintenance", {"on": args.state == "on"},
                             port=UPSTREAM_PORT)
        else:
            watch(args.env_file, args.out)
            return
    except OSError as exc:
        result = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result))
    sys.exit(0)


if __name__ == "__main__":
    main()
