"""Runs inside a runsc sandbox (``python -m tests.gvisor.vllm_sandbox serve``): a vLLM
stand-in server in its own process on 127.0.0.1:8000 and, in this process, a supervisor
that drives it with ``rehydrate.adapters.vllm`` (level 2) and serves the probes with
``health_app()`` on 127.0.0.1:8081 — the deployment docs/inference.md describes for
``vllm serve``. Detection: the control socket (``rehydrate notify`` run with runsc exec).

``python -m tests.gvisor.vllm_sandbox get|post URL [JSON]`` is the in-sandbox HTTP client
the test runs with ``runsc exec`` (the sandbox has no network): prints
``{"status": …, "body": …}``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

VLLM = "http://127.0.0.1:8000"


def serve() -> None:
    import httpx
    import uvicorn

    from rehydrate.adapters import vllm
    from rehydrate.adapters.asgi import health_app

    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory",
                               "tests.inference_standins:VLLMStandIn", "--port", "8000",
                               "--log-level", "warning", "--no-access-log"])
    deadline = time.monotonic() + 60
    while True:  # the supervisor starts once the engine answers, as with vllm serve
        try:
            httpx.get(f"{VLLM}/health", timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the vLLM stand-in did not start") from None
            time.sleep(0.1)
    vllm.install(VLLM, level=2)
    uvicorn.run(health_app(), host="127.0.0.1", port=8081, log_level="warning",
                access_log=False)


def client(method: str, url: str, body: str | None = None) -> None:
    import httpx

    try:
        r = httpx.request(method.upper(), url, json=json.loads(body) if body else None,
                          timeout=10)
        out = {"status": r.status_code, "body": r.json() if r.content else None}
    except httpx.HTTPError as exc:
        out = {"status": None, "body": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        client(*sys.argv[1:])
