"""rehydrate.adapters.kserve against the real KServe 0.21 ModelServer (CPU) with a real
kserve.Model, observed with tritonclient's HTTP client as a real v2 client would; restores
are announced through the control socket by the real ``rehydrate notify``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.http as httpclient

from tests.detect_helpers import wait_for
from tests.netservers import PICK_ATTEMPTS, PortTaken, free_port, wait_listening

REPO = Path(__file__).resolve().parents[2]


class KServe:
    def __init__(self, tmp: Path, mode: str, grpc: bool = False) -> None:
        self.control = tmp / "control"
        self.control.mkdir()
        self.env = {**os.environ, "REHYDRATE_CONTROL_SOCKET": str(tmp / "rehydrate.sock"),
                    "PYTHONPATH": str(REPO)}
        # kserve takes its ports on the command line (no port 0): picked here, and picked
        # again when the server exits on its bind (a test beside this one took a port)
        for attempt in range(PICK_ATTEMPTS):
            self.port = free_port()
            self.grpc_port = free_port() if grpc else None
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.kserve_server", str(self.port),
                 str(self.control), mode, *([str(self.grpc_port)] if grpc else [])],
                env=self.env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                for port in (self.port, self.grpc_port):
                    if port is not None:
                        wait_listening(port, self.proc, timeout=60)
            except PortTaken:
                if attempt == PICK_ATTEMPTS - 1:
                    raise
                self.proc.wait(10)
                continue
            break
        self.client = httpclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        wait_for(lambda: os.path.exists(self.env["REHYDRATE_CONTROL_SOCKET"]), 30,
                 "the control socket")

    def notify(self, action: str = "restore") -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "rehydrate", "notify", action],
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def ready(self) -> tuple[bool, bool, bool]:
        """(server ready, model ready, live) as tritonclient sees them."""
        return (self.client.is_server_ready(), self.client.is_model_ready("echo"),
                self.client.is_server_live())

    def touch(self, name: str) -> None:
        (self.control / name).touch()

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def kserve_gated(tmp_path: Path) -> Iterator[KServe]:
    server = KServe(tmp_path, "gated")
    yield server
    server.close()


def test_not_ready_while_restoring_and_when_degraded(kserve_gated: KServe) -> None:
    import httpx

    s = kserve_gated
    url = f"http://127.0.0.1:{s.port}"
    assert s.ready() == (True, True, True)

    # a restore whose warm-up hook is held: the server and the model say not ready
    notify = s.notify()
    wait_for(lambda: not s.client.is_server_ready(), 30, "server not ready during restore")
    assert s.ready() == (False, False, True)
    assert notify.poll() is None  # the restore is really still running
    s.touch("release")
    assert notify.wait(30) == 0, notify.stderr.read() if notify.stderr else ""
    assert s.ready() == (True, True, True)
    assert httpx.post(f"{url}/v1/models/echo:predict", json={"instances": [1]}).json() == {
        "predictions": [1]}

    # a failed required hook leaves the process degraded: not ready until a good restore
    s.touch("fail")
    notify = s.notify()
    assert notify.wait(30) != 0
    assert s.ready() == (False, False, True)
    # KServe's inference endpoint checks model readiness: 503, not a prediction made with
    # pre-restore state; unknown models stay 404; liveness stays 200
    assert httpx.post(f"{url}/v1/models/echo:predict", json={"instances": [1]}
                      ).status_code == 503
    assert httpx.get(f"{url}/v2/models/nope/ready").status_code == 404
    assert httpx.get(f"{url}/v2/health/live").status_code == 200
    (s.control / "fail").unlink()
    assert s.notify().wait(30) == 0
    assert s.ready() == (True, True, True)


def test_the_gate_in_front_of_kserve_keeps_liveness_and_metrics(tmp_path: Path) -> None:
    """docs/inference.md's recipe for draining KServe: ``ReadinessGate`` in front of its
    FastAPI app. Before, without ``exempt``, the gate answered ``/v2/health/live`` (and
    ``/metrics``) 503 while restoring or degraded: a liveness probe restarted the
    restoring pod the docs promise it keeps."""
    import httpx

    s = KServe(tmp_path, "drained")
    try:
        url = f"http://127.0.0.1:{s.port}"
        assert s.ready() == (True, True, True)
        notify = s.notify()
        wait_for(lambda: httpx.get(f"{url}/readyz").status_code == 503, 30,
                 "the gate to close for the restore")
        assert notify.poll() is None  # the restore is really still running
        assert httpx.get(f"{url}/v2/health/live").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/v2/health/ready").status_code == 503
        assert httpx.post(f"{url}/v1/models/echo:predict", json={"instances": [1]}
                          ).status_code == 503
        s.touch("release")
        assert notify.wait(30) == 0, notify.stderr.read() if notify.stderr else ""
        assert s.ready() == (True, True, True)
    finally:
        s.close()


def test_without_the_adapter_kserve_says_ready_while_restoring(tmp_path: Path) -> None:
    """The control case: KServe's own readiness ignores the restore."""
    s = KServe(tmp_path, "plain")
    try:
        notify = s.notify()
        wait_for(lambda: notify.poll() is None and _status_state(s) == "restoring", 30,
                 "the restore to start")
        assert s.ready() == (True, True, True)
        s.touch("release")
        assert notify.wait(30) == 0
    finally:
        s.close()


def _status_state(s: KServe) -> Any:
    import json

    out = subprocess.run([sys.executable, "-m", "rehydrate", "status", "--json"], env=s.env,
                         capture_output=True, check=False)
    return json.loads(out.stdout)["state"] if out.returncode == 0 else None


def test_install_refuses_what_is_not_a_model_server(rehydrate_engine: Any) -> None:
    from rehydrate.adapters import kserve as adapter

    with pytest.raises(TypeError, match="install\\(\\) needs a kserve.ModelServer, not int"):
        adapter.install(42, engine=rehydrate_engine)
    assert adapter.probe().usable


def _run_script(script: Path) -> list[str]:
    """Run ``script`` in a Python process of its own (rehydrate importable): its output
    lines, once it has exited 0."""
    proc = subprocess.run([sys.executable, str(script)], env={**os.environ,
                          "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_install_refuses_a_server_with_several_workers(tmp_path: Path) -> None:
    """Before: ``install()`` accepted ``ModelServer(workers=2)``, whose ``start()`` then
    died pickling the gated data plane (``Can't pickle local object
    '_gate_model.<locals>.gated_healthy'``) — and worker processes would not share this
    process's engine anyway. Now refused at once, saying what to do, with nothing patched.
    (A process of its own: KServe's protos in this one clash with tritonclient's.)"""
    script = tmp_path / "workers.py"
    script.write_text(
        "import kserve\n"
        "from rehydrate.adapters import kserve as adapter\n"
        "server = kserve.ModelServer(workers=2, http_port=0, grpc_port=0, "
        "enable_grpc=False)\n"
        "ready = server.dataplane.ready\n"
        "try:\n"
        "    adapter.install(server)\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
        "assert server.dataplane.ready == ready, 'patched'\n"
        "server.workers = 1\n"
        "adapter.install(server)\n"
        "assert server.dataplane.ready != ready, 'not gated'\n"
        "print('gated')\n")
    assert _run_script(script) == [
        "refused: install() gates one process: this ModelServer has workers=2; run it "
        "with workers=1 (KServe's default) and scale with replicas", "gated"]


def test_a_load_after_the_process_is_ready_again_runs(tmp_path: Path) -> None:
    """A task that asked a model's ``healthy()`` during a restore (False) and called its
    ``load()`` once the process was ready again — an application's watchdog reloading the
    model — was refused with ``ModelNotReady`` "... rehydrate: ready": the veto its
    ``healthy()`` left in the task's context was never checked against readiness. A
    ``load()`` while still not ready stays refused. (A process of its own, as above.)"""
    script = tmp_path / "veto.py"
    script.write_text(
        "import asyncio, threading\n"
        "import kserve\n"
        "from kserve.errors import ModelNotReady\n"
        "from rehydrate.adapters import kserve as adapter\n"
        "from rehydrate.testing import isolated_engine\n"
        "engine = isolated_engine()\n"
        "entered, release = threading.Event(), threading.Event()\n"
        "def warm():\n"
        "    entered.set()\n"
        "    release.wait(30)\n"
        "engine.registry.register(warm, event='restore', name='warm')\n"
        "class M(kserve.Model):\n"
        "    def load(self):\n"
        "        self.ready = True\n"
        "        print('load ran')\n"
        "        return True\n"
        "m = M('m')\n"
        "m.load()\n"
        "server = kserve.ModelServer(workers=1, enable_grpc=False)\n"
        "adapter.install(server, engine=engine)\n"
        "server.register_model(m)\n"
        "def load():\n"
        "    try:\n"
        "        m.load()\n"
        "    except ModelNotReady as exc:\n"
        "        print('refused:', exc.reason)\n"
        "async def watchdog():\n"
        "    restore = threading.Thread(target=engine.simulate_restore)\n"
        "    restore.start()\n"
        "    await asyncio.to_thread(entered.wait, 30)\n"
        "    print('healthy:', await m.healthy())\n"
        "    load()\n"
        "    print('healthy:', await m.healthy())\n"
        "    release.set()\n"
        "    await asyncio.to_thread(restore.join, 30)\n"
        "    print('ready:', engine.is_ready())\n"
        "    load()\n"
        "asyncio.run(watchdog())\n")
    assert _run_script(script) == [
        "load ran", "healthy: False",
        "refused: Model with name m is not ready. rehydrate: restoring",
        "healthy: False", "ready: True", "load ran"]


def test_a_failed_install_patches_nothing_and_a_retry_gates(rehydrate_engine: Any) -> None:
    """A server-like object missing a piece: refused before anything is patched, so that
    installing again once it is complete really gates it (not a silent no-op)."""
    from types import SimpleNamespace

    from rehydrate.adapters import kserve as adapter

    async def ready() -> bool:
        return True

    async def get_model(name: str) -> object:
        return object()

    dataplane = SimpleNamespace(ready=ready, model_ready=ready, get_model=get_model,
                                get_model_from_registry=lambda name: object())
    server = SimpleNamespace(dataplane=dataplane, registered_models=SimpleNamespace())
    with pytest.raises(TypeError, match="needs a kserve.ModelServer, not SimpleNamespace"):
        adapter.install(server, engine=rehydrate_engine)
    assert dataplane.ready is ready and dataplane.model_ready is ready  # untouched
    server.registered_models = SimpleNamespace(get_models=dict, update=lambda model: None)
    adapter.install(server, engine=rehydrate_engine)
    assert dataplane.ready is not ready  # gated now


def _loads(s: KServe, name: str = "loads") -> int:
    return len((s.control / name).read_text().splitlines())


def _builds(s: KServe) -> int:
    """How many whole ``rehydrate.status()`` the server has built."""
    path = s.control / "status-builds"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_inference_is_refused_during_a_restore_over_grpc_and_rest(tmp_path: Path) -> None:
    """gRPC ``ModelInfer`` served predictions during a restore (only the readiness RPCs
    were gated), and every call reloaded the model: KServe calls ``load()`` on a model
    that is not healthy."""
    import httpx
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    s = KServe(tmp_path, "gated", grpc=True)
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
        data = grpcclient.InferInput("in", [1], "INT32")
        data.set_data_from_numpy(np.array([7], dtype=np.int32))
        v2 = {"inputs": [{"name": "in", "shape": [1], "datatype": "INT32", "data": [7]}]}
        url = f"http://127.0.0.1:{s.port}/v2/models/echo/infer"
        assert client.infer("echo", [data]).as_numpy("echo").tolist() == [7]
        loads = _loads(s)
        notify = s.notify()
        wait_for(lambda: not s.client.is_server_ready(), 30, "not ready during the restore")
        for _ in range(2):
            with pytest.raises(InferenceServerException) as refused:
                client.infer("echo", [data])
            assert "is not ready" in str(refused.value)
            assert httpx.post(url, json=v2).status_code == 503
        assert not client.is_server_ready() and not client.is_model_ready("echo")
        assert _loads(s) == loads, "the model was reloaded during the restore"
        s.touch("release")
        assert notify.wait(30) == 0
        assert client.infer("echo", [data]).as_numpy("echo").tolist() == [7]
        assert httpx.post(url, json=v2).json()["outputs"][0]["data"] == [7]
        client.close()
    finally:
        s.close()


def test_time_series_forecasts_are_refused_during_a_restore(kserve_gated: KServe) -> None:
    """KServe serves ``POST /v1/timeseries/forecast`` from a data plane of its own, over a
    copy of its registry: it ignored the gate on the server's data plane, found the model
    not healthy, reloaded it and served the forecast in the middle of a restore.

    The server's async restore hook asks the model's ``healthy()`` and reloads it, as
    KServe's own ``get_model()`` does: that ``load()`` was refused like a request's (the
    restore failed, every time). And each refusal built a whole ``rehydrate.status()``
    (its /proc scan costs milliseconds per request under gVisor)."""
    import httpx

    s = kserve_gated
    url = f"http://127.0.0.1:{s.port}"
    body = {"model": "forecaster", "options": {"horizon": 1}, "inputs": [
        {"type": "univariate_time_series", "name": "s", "series": [1.0, 2.0],
         "frequency": "H"}]}
    expected = {"model": "forecaster", "forecasts": [{"name": "s", "last": 2.0}]}
    assert httpx.post(f"{url}/v1/timeseries/forecast", json=body).json() == expected
    loads = _loads(s, "ts-loads")
    notify = s.notify()
    wait_for(lambda: not s.client.is_server_ready(), 30, "not ready during the restore")
    builds = _builds(s)
    for _ in range(2):
        refused = httpx.post(f"{url}/v1/timeseries/forecast", json=body)
        assert refused.status_code == 503, refused.text
        assert "is not ready" in refused.json()["error"]
    assert not s.client.is_model_ready("forecaster")
    assert httpx.get(f"{url}/v2/health/live").status_code == 200
    assert _loads(s, "ts-loads") == loads, "the model was reloaded during the restore"
    assert _builds(s) == builds, "a refusal built a whole status"
    assert notify.poll() is None  # the restore is really still running
    s.touch("release")
    assert notify.wait(30) == 0, notify.stderr.read() if notify.stderr else ""
    # the restore hook's own reload ran; the next forecast is served without another one
    assert _loads(s, "ts-loads") == loads + 1
    assert httpx.post(f"{url}/v1/timeseries/forecast", json=body).json() == expected
    assert _loads(s, "ts-loads") == loads + 1
    assert s.client.is_model_ready("forecaster")
