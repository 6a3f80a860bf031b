"""The example inference server (``examples/inference_server/app.py``) as a real process,
without gVisor: the real model, uvicorn, the upstream service, HTTP over loopback, and a
snapshot/restore announced by the real ``rehydrate notify`` over the control socket.

One server process serves every test (module fixture: the model loads once). The runsc
version of the restore story is ``tests/gvisor/test_inference_server.py``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from netservers import free_port, start_listening, wait_port

# Checked without importing it: importing sentence-transformers here would cost seconds.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None,
                                reason="the example's dependencies: pip install -e '.[examples]'")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "inference_server"
START_DEADLINE = 180.0


def _start_upstream(env: dict[str, str], port: int | None = None,
                    ) -> tuple[subprocess.Popen[bytes], int]:
    """The quota service, listening: on ``port``, or on one picked (again when another
    process took it first); ``(process, port)``."""
    proc, port = start_listening(
        lambda p: [sys.executable, str(EXAMPLE / "upstream.py"), "--port", str(p)], port,
        env=env, stdin=subprocess.DEVNULL)
    _wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), "the upstream")
    return proc, port


def _write_environ(path: Path, env: dict[str, str]) -> None:
    path.write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


@dataclass
class Server:
    url: str
    upstream_port: int
    env: dict[str, str]
    env_file: Path
    log_file: Path
    process: subprocess.Popen[bytes]
    upstream: subprocess.Popen[bytes] | None

    def start_upstream(self) -> None:
        """Again on the port the server was told (after an outage the test made)."""
        self.upstream, _ = _start_upstream(self.env, self.upstream_port)

    def stop_upstream(self) -> None:
        assert self.upstream is not None
        self.upstream.terminate()
        self.upstream.wait(timeout=10)
        self.upstream = None

    def notify(self, action: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rehydrate", "notify", action],
                              env=self.env, capture_output=True, text=True, timeout=60,
                              check=False)

    def embed(self, key: str | None, body: object = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.post(f"{self.url}/v1/embed", json=body or {"texts": ["hello"]},
                          headers=headers, timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_for(check: object, what: str, timeout: float = START_DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come up in {timeout:.0f} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("inference-example")
    env_file = tmp / "spec_environ"
    spec = {"API_KEY": "key-one", "UPSTREAM_TOKEN": "upstream-token"}
    _write_environ(env_file, spec)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REHYDRATE_")}
    env.update(spec, REHYDRATE_ENV_FILE=str(env_file), HF_HUB_OFFLINE="1",
               REHYDRATE_CONTROL_SOCKET=str(tmp / "control.sock"))
    # Ports are picked and bound by the servers later (they take them on the command
    # line): start_listening picks again when a process beside this one took one first.
    upstream, up_port = _start_upstream(env)
    process, srv = None, None
    try:
        log_file = tmp / "server.log"
        with log_file.open("wb") as log:
            process, port = start_listening(
                lambda p: [sys.executable, str(EXAMPLE / "app.py"), "--port", str(p),
                           "--upstream", f"http://127.0.0.1:{up_port}"],
                env=env, stderr=log, timeout=START_DEADLINE)
        srv = Server(f"http://127.0.0.1:{port}", up_port, env, env_file, log_file, process,
                     upstream)
        _wait_for(lambda: process.poll() is None and _answers(f"{srv.url}/readyz"),
                  "the server")
        yield srv
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
        upstream = srv.upstream if srv is not None else upstream  # a test restarts it
        if upstream is not None:
            upstream.terminate()
            upstream.wait(timeout=10)


def test_requests_without_a_valid_key_or_body_get_one_clear_error(server: Server) -> None:
    assert server.embed(None).status_code == 401
    wrong = server.embed("not-the-key")
    assert wrong.status_code == 401 and wrong.json() == {"detail": "invalid API key"}
    assert server.embed("key-one", {"texts": []}).status_code == 422
    assert server.embed("key-one", {"text": "x"}).status_code == 422
    ok = server.embed("key-one")
    assert ok.status_code == 200
    body = ok.json()
    assert len(body["embeddings"][0]) == 384
    assert ok.headers["x-instance-id"] == body["instance_id"]


def test_upstream_outage_is_a_502_and_the_server_recovers(server: Server) -> None:
    server.stop_upstream()
    try:
        down = server.embed("key-one")
        assert down.status_code == 502
        assert down.json() == {"detail": "upstream quota service unavailable"}
        assert _answers(f"{server.url}/healthz")  # still alive
    finally:
        server.start_upstream()
    assert server.embed("key-one").status_code == 200


def test_notify_restore_rotates_the_api_key_and_the_instance(server: Server) -> None:
    before = server.embed("key-one").json()
    saved = server.notify("save")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    held = httpx.get(f"{server.url}/readyz", timeout=5)
    assert held.status_code == 503 and held.json()["ready"] is False
    assert "retry-after" in held.headers
    _write_environ(server.env_file, {"API_KEY": "key-two", "UPSTREAM_TOKEN": "upstream-token"})
    restored = server.notify("restore")
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert server.embed("key-one").status_code == 401
    after = server.embed("key-two")
    assert after.status_code == 200
    body = after.json()
    assert body["generation"] == 1
    assert body["instance_id"] != before["instance_id"]
    assert body["public_key"] != before["public_key"]  # a new signing key
    assert body["embeddings"] == before["embeddings"]
    report = httpx.get(f"{server.url}/rehydrate/status", timeout=5).json()["last_report"]
    hooks = {h["name"]: h["outcome"] for h in report["hooks"]}
    assert hooks["app.warmup-canary"] == "ok" and hooks["rehydrate.connections"] == "ok"
    assert "key-two" not in restored.stdout + restored.stderr  # names, never values
    server_log = server.log_file.read_text()
    assert "API_KEY rotated (generation 1)" in server_log
    assert "key-one" not in server_log and "key-two" not in server_log


def test_upstream_refuses_a_bad_content_length_and_keeps_serving(tmp_path: Path) -> None:
    """Content-Length: -1 made the quota service read until the client closed, holding one
    of its 8 workers (8 such connections hung it, /healthz too); "abc" dropped the
    connection with a traceback. No model needed: upstream.py alone."""
    proc, port = _start_upstream({**os.environ, "UPSTREAM_TOKEN": "upstream-token"})
    try:
        held = []
        for length, status in (("-1", b"400"), ("abc", b"400"), ("1_0", b"400"),
                               (str(10**9), b"413")):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)  # upper bound
            held.append(s)  # kept open: a worker waiting on it would stay taken
            s.sendall(b"POST /v1/quota HTTP/1.1\r\nHost: x\r\nContent-Length: %s\r\n"
                      b"\r\n{}" % length.encode())
            assert s.recv(200).split(b" ")[1] == status, length
        for _ in range(8):  # as many as the service has workers
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            held.append(s)
            s.sendall(b"POST /v1/quota HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        for s in held:
            s.close()
    finally:
        proc.terminate()
        proc.wait(10)


class _CountingService:
    """Stands in for InferenceService (no model): counts what is charged."""

    def __init__(self, fail: bool = False) -> None:
        self.charged: list[int] = []
        self.fail = fail
        self.embedder = self

    def encode(self, texts: list[str]) -> list[list[float]]:
        if self.fail:
            raise RuntimeError("the model failed")
        return [[0.0] for _ in texts]

    def authorized(self, header: str | None) -> bool:
        return True

    async def charge(self, items: int) -> dict[str, int]:
        self.charged.append(items)
        return {"used": items}

    def sign(self, payload: bytes) -> dict[str, str]:
        return {}


def _example_app(service: _CountingService) -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("inference_example_app",
                                                  EXAMPLE / "app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the models' annotations there
    spec.loader.exec_module(module)
    return module.create_app(service)


@pytest.mark.parametrize("body", [b'{"texts": ["\\ud800"]}', b'{"texts": ["ok", "a\\udfffb"]}',
                                  b'{"texts": ["' + b"a" * 8193 + b'"]}'])
def test_texts_the_model_cannot_take_are_a_422_and_cost_no_quota(rehydrate_environ,
                                                                 body: bytes) -> None:
    """A lone surrogate passed validation and crashed the tokenizer (a bare 500 and the
    connection reset) after the quota was charged; a 2 MB text took 1.6 s."""
    from starlette.testclient import TestClient

    service = _CountingService()
    with TestClient(_example_app(service), raise_server_exceptions=False) as client:
        r = client.post("/v1/embed", content=body,
                        headers={"content-type": "application/json",
                                 "authorization": "Bearer k"})
        assert r.status_code == 422, r.text
        [error] = r.json()["detail"]
        assert error["loc"][:2] == ["body", "texts"] and "input" not in error
        assert service.charged == []
        ok = client.post("/v1/embed", json={"texts": ["fine", "\u00e9t\u00e9"]},
                         headers={"authorization": "Bearer k"})
        assert ok.status_code == 200 and service.charged == [2]


def test_a_request_the_model_fails_on_costs_no_quota(rehydrate_environ) -> None:
    from starlette.testclient import TestClient

    service = _CountingService(fail=True)
    with TestClient(_example_app(service), raise_server_exceptions=False) as client:
        r = client.post("/v1/embed", json={"texts": ["x"]}, headers={"authorization": "Bearer k"})
        assert r.status_code == 500
    assert service.charged == []


def test_a_clone_given_an_empty_api_key_is_not_ready_and_says_why(rehydrate_engine,
                                                                 monkeypatch) -> None:
    """API_KEY="" in a clone's environment loaded an empty key: the clone reported ready
    and then answered 401 to every request."""
    from rehydrate.secrets import Secret, SecretError

    source = (EXAMPLE / "app.py").read_text()
    assert 'Secret.from_env("API_KEY", name="api-key")' in source  # as the server makes it
    monkeypatch.setenv("API_KEY", "key-one")
    key = Secret.from_env("API_KEY", name="api-key", engine=rehydrate_engine)
    report = rehydrate_engine.simulate_restore(env={"API_KEY": ""})
    assert not report.ok and not rehydrate_engine.is_ready()
    [failed] = [h for h in report.hooks if h.outcome != "ok"]
    assert "api-key" in failed.name and "env:API_KEY gave an empty value" in str(failed.error)
    assert "key-one" not in report.table()
    report = rehydrate_engine.simulate_restore(env={"API_KEY": "key-two"})
    assert report.ok and key.get() == b"key-two"
    monkeypatch.setenv("API_KEY", "")
    with pytest.raises(SecretError, match="env:API_KEY gave an empty value"):
        Secret.from_env("API_KEY", name="api-key-2", engine=rehydrate_engine)


def _app_with_upstream(env: dict[str, str], up_port: int, log: Path, port: int = 0,
                       ) -> subprocess.Popen[bytes]:
    """app.py --with-upstream in a process group of its own: what is left in the group
    once app.py has exited is an upstream it did not stop. Output to ``log``, not a pipe,
    which such an upstream would hold open."""
    env = {k: v for k, v in env.items() if not k.startswith("REHYDRATE_")}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, str(EXAMPLE / "app.py"), "--port", str(port), "--with-upstream",
             "--upstream", f"http://127.0.0.1:{up_port}"], env={**env, "HF_HUB_OFFLINE": "1"},
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


def _left_in_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    os.killpg(pgid, signal.SIGKILL)  # cleans up after a failing run
    return True


@pytest.mark.parametrize("how", ["SIGTERM while serving", "SIGTERM", "missing API_KEY"])
def test_the_upstream_stops_with_the_server(tmp_path: Path, how: str) -> None:
    """The server alone got SIGTERM (as from `kill` or a supervisor) and its upstream kept
    running, reparented to init; the next start's upstream could not have the port, and
    that server answered /readyz 200 but every /v1/embed 502 (the old upstream refused
    its token)."""
    up_port = free_port()
    env = {**os.environ, "UPSTREAM_TOKEN": "upstream-token", "API_KEY": "key-one"}
    if how == "missing API_KEY":
        del env["API_KEY"]
    log = tmp_path / "app.log"
    port = free_port() if how == "SIGTERM while serving" else 0
    app = _app_with_upstream(env, up_port, log, port)
    try:
        if how == "SIGTERM while serving":  # uvicorn's graceful shutdown
            wait_port(port, timeout=START_DEADLINE, proc=app)
            assert _answers(f"http://127.0.0.1:{port}/readyz")
            app.send_signal(signal.SIGTERM)
        elif how == "SIGTERM":  # while the model loads, uvicorn not running yet
            wait_port(up_port, timeout=60, proc=app)
            app.send_signal(signal.SIGTERM)
        assert app.wait(timeout=120) != 0
        if how == "missing API_KEY":
            assert b"API_KEY is not set" in log.read_bytes()
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
        left = _left_in_group(app.pid)
    assert not left, "the upstream outlived the server"


def test_the_server_does_not_start_when_its_upstream_cannot_listen(monkeypatch,
                                                                   rehydrate_environ) -> None:
    """An upstream left from an earlier run held the port: the new one failed to bind
    and the server started anyway, answering every /v1/embed with 502."""
    _example_app(_CountingService())  # loads the module
    app = sys.modules["inference_example_app"]
    monkeypatch.setattr(app, "InferenceService", lambda url, events: _CountingService())
    import uvicorn

    served: list[object] = []

    def run(self: object) -> None:
        served.append(self)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setenv("UPSTREAM_TOKEN", "upstream-token")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            app.main(["--port", "0", "--with-upstream", "--upstream",
                      f"http://127.0.0.1:{port}"])
    assert str(exited.value).startswith("inference server: upstream.py exited (1) "
                                        f"instead of listening on port {port}")
    assert served == []
