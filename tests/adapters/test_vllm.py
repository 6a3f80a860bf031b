"""rehydrate.adapters.vllm against a vLLM stand-in server (real uvicorn on loopback) and
duck-typed in-process LLM / AsyncLLM twins, driven by an isolated engine's real snapshot
and restore runs."""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rehydrate import Lifecycle, Registry
from rehydrate.adapters import not_ready_reason, sglang, vllm
from rehydrate.adapters._server import redact
from rehydrate.env import EnvRefresher
from rehydrate.extensions import Probe
from tests.asgi_server import Switch, serve, switchboard
from tests.inference_standins import (
    API_KEY,
    GATEWAY_ECHOES,
    EchoingGateway,
    FakeAsyncLLM,
    FakeLLM,
    LosingGateway,
    SlowSleepAsyncLLM,
    SlowSleepLLM,
    SlowUpstream,
    VLLMStandIn,
    _json,
    retry_refused_after_a_504,
    trickling,
)
from tests.key_redaction import assert_the_key_is_shown_nowhere

LEVEL1_WAKE = ["GET /is_sleeping", "POST /wake_up", "GET /is_sleeping", "GET /v1/models",
               "POST /v1/completions"]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Switch]]:
    with switchboard() as board:
        yield board


@pytest.fixture
def standin(server: tuple[str, Switch]) -> VLLMStandIn:
    standin = VLLMStandIn()
    server[1].app = standin
    return standin


@pytest.fixture
def url(server: tuple[str, Switch]) -> str:
    return server[0]


def hook(report: Any, name: str) -> Any:
    return next(h for h in report.hooks if h.name == name)


def test_level1_sleep_and_wake_with_canary(url: str, standin: VLLMStandIn,
                                           rehydrate_engine: Any) -> None:
    vllm.install(url, engine=rehydrate_engine)
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    assert standin.log == ["GET /is_sleeping", "POST /sleep?level=1", "GET /is_sleeping"]
    assert standin.sleeping and standin.weights == "cpu"
    standin.log.clear()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log == LEVEL1_WAKE
    assert not standin.sleeping and standin.canaries == 1
    assert rehydrate_engine.is_ready()


def test_level2_wakes_weights_reloads_then_kv_cache(url: str, standin: VLLMStandIn,
                                                    rehydrate_engine: Any) -> None:
    """vllm snapshot restore's sequence; the stand-in's `scheduling` tag is still asleep
    after it, so the adapter wakes the rest; the canary proves the weights are loaded."""
    vllm.install(url, engine=rehydrate_engine, level=2, model="stand-in/model", mode="wait")
    assert rehydrate_engine.simulate_snapshot().ok
    assert "POST /sleep?level=2&mode=wait" in standin.log
    assert standin.weights == "discarded"
    standin.log.clear()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log == ["GET /is_sleeping", "POST /wake_up?tags=weights",
                           "POST /collective_rpc", "POST /wake_up?tags=kv_cache",
                           "GET /is_sleeping", "POST /wake_up", "GET /is_sleeping",
                           "POST /v1/completions"]
    assert standin.weights == "gpu" and standin.canaries == 1


@pytest.mark.parametrize("variant", ["legacy", "tags_woken"])
def test_lenient_responses(url: str, server: Any, rehydrate_engine: Any, variant: str) -> None:
    """Older servers answer an empty 200 to sleep and wake_up; some say tags_woken."""
    standin = VLLMStandIn(**{variant: True})
    server[1].app = standin
    vllm.install(url, engine=rehydrate_engine, level=2)
    assert rehydrate_engine.simulate_snapshot().ok
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.canaries == 1 and not standin.sleeping


def test_already_awake_is_not_woken_again(url: str, standin: VLLMStandIn,
                                          rehydrate_engine: Any) -> None:
    vllm.install(url, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_restore(kind="resume").ok
    assert standin.log == ["GET /is_sleeping", "GET /v1/models", "POST /v1/completions"]
    # and a server already asleep is not put to sleep twice
    standin.asleep = {"weights"}
    standin.log.clear()
    assert rehydrate_engine.simulate_snapshot().ok
    assert standin.log == ["GET /is_sleeping"]


def test_transient_500s_are_retried(url: str, standin: VLLMStandIn,
                                    rehydrate_engine: Any) -> None:
    vllm.install(url, engine=rehydrate_engine, deadline=10)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.fail["/wake_up"] = 2
    assert rehydrate_engine.simulate_restore().ok
    assert standin.log.count("POST /wake_up") == 3


def test_500_for_good_fails_the_hook_with_the_servers_reason(
        url: str, standin: VLLMStandIn, rehydrate_engine: Any) -> None:
    vllm.install(url, engine=rehydrate_engine, deadline=1.5)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.broken["/wake_up"] = (500, "CUDA error: out of memory")
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    wake = hook(report, "rehydrate.vllm.wake")
    assert wake.outcome == "failed"
    assert str(wake.error) == (f"vllm POST {url}/wake_up: HTTP 500: CUDA error: out of memory "
                               "(gave up after the 1.5s deadline)")
    assert standin.log.count("POST /wake_up") > 1  # retried until the deadline
    assert rehydrate_engine.state == "degraded"
    assert f"rehydrate.vllm.wake failed (ServerError: vllm POST {url}/wake_up: HTTP 500" in \
        not_ready_reason(rehydrate_engine)


@pytest.mark.parametrize("via", ["adapter", "install"])
def test_hanging_server_times_out_per_request_and_fails_at_the_deadline(
        url: str, standin: VLLMStandIn, rehydrate_engine: Any, via: str) -> None:
    if via == "install":
        vllm.install(url, engine=rehydrate_engine, deadline=1.5, request_timeout=0.2)
    else:
        vllm.VLLMAdapter(url, deadline=1.5, request_timeout=0.2).install(rehydrate_engine)
    standin.hang["/is_sleeping"] = 5
    t0 = time.monotonic()
    report = rehydrate_engine.simulate_snapshot()
    assert time.monotonic() - t0 < 5
    sleep = hook(report, "rehydrate.vllm.sleep")
    assert sleep.outcome == "failed"
    # the last attempt gets what is left of the deadline
    assert re.fullmatch(rf"vllm GET {re.escape(url)}/is_sleeping: no answer within 0\.[0-9]+s "
                        r"\(gave up after the 1\.5s deadline\)", str(sleep.error))
    assert standin.log.count("GET /is_sleeping") >= 2  # 0.2 s per attempt, retried
    assert not report.ok


def test_server_that_never_answers(rehydrate_engine: Any, refused_port: int) -> None:
    url = f"http://127.0.0.1:{refused_port}"
    vllm.install(url, engine=rehydrate_engine, deadline=0.3)
    report = rehydrate_engine.simulate_restore()
    wake = hook(report, "rehydrate.vllm.wake")
    assert str(wake.error).startswith(f"vllm GET {url}/is_sleeping: unreachable (ConnectError")
    assert str(wake.error).endswith("(gave up after the 0.3s deadline)")
    assert not rehydrate_engine.is_ready()


def test_without_dev_mode_fails_at_once_saying_so(url: str, server: Any,
                                                  rehydrate_engine: Any) -> None:
    server[1].app = standin = VLLMStandIn(dev_mode=False)
    vllm.install(url, engine=rehydrate_engine, deadline=30)
    report = rehydrate_engine.simulate_snapshot()
    sleep = hook(report, "rehydrate.vllm.sleep")
    assert str(sleep.error) == (
        f"vllm GET {url}/is_sleeping: HTTP 404: Not Found — start the vLLM server with "
        "VLLM_SERVER_DEV_MODE=1 (the sleep endpoints exist only in dev mode)")
    assert sleep.duration < 5  # no retrying a 404 until the deadline
    assert standin.log == ["GET /is_sleeping"]
    adapter = vllm.VLLMAdapter(url)
    assert adapter.probe() == Probe(
        False, f"{url} has no /is_sleeping: start vLLM with VLLM_SERVER_DEV_MODE=1")


def test_without_sleep_mode_fails_at_once_saying_so(url: str, server: Any,
                                                    rehydrate_engine: Any) -> None:
    server[1].app = VLLMStandIn(sleep_mode=False)
    vllm.install(url, engine=rehydrate_engine, deadline=30)
    report = rehydrate_engine.simulate_snapshot()
    sleep = hook(report, "rehydrate.vllm.sleep")
    assert str(sleep.error) == (
        f"vllm POST {url}/sleep: HTTP 500: Sleep mode is not enabled in the model config — "
        "start vLLM with --enable-sleep-mode (CUDA, ROCm or XPU only)")
    assert sleep.duration < 5
    assert rehydrate_engine.state == "degraded"


def test_failed_canary_fails_the_wake(url: str, standin: VLLMStandIn,
                                      rehydrate_engine: Any) -> None:
    vllm.install(url, engine=rehydrate_engine, deadline=0.5)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.broken["/v1/completions"] = (500, "engine dead")
    report = rehydrate_engine.simulate_restore()
    assert str(hook(report, "rehydrate.vllm.wake").error).startswith(
        f"vllm POST {url}/v1/completions: HTTP 500: engine dead")


@pytest.mark.parametrize(("body", "message"), [
    (b'{"object": "list", "data": []}', "/v1/models lists no model (pass model=)"),
    (b"<html>proxy</html>", "/v1/models answered no model list"),
    (b'{"data": [{"name": "m"}]}', "/v1/models answered no model list"),
    (b'{"data": {"id": "m"}}', "/v1/models answered no model list"),
])
def test_a_models_answer_naming_no_model_fails_the_canary_saying_which(
        url: str, server: Any, standin: VLLMStandIn, rehydrate_engine: Any, body: bytes,
        message: str) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/models":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        await standin(scope, receive, send)

    server[1].app = app
    vllm.install(url, engine=rehydrate_engine, deadline=5)
    assert rehydrate_engine.simulate_snapshot().ok
    error = str(hook(rehydrate_engine.simulate_restore(), "rehydrate.vllm.wake").error)
    assert f"vllm canary: {url}{message}" in error


def test_sync_and_asyncio_entry_points(url: str, standin: VLLMStandIn) -> None:
    adapter = vllm.VLLMAdapter(url, canary=False)
    adapter.sleep()
    assert standin.sleeping
    adapter.wake()
    assert not standin.sleeping
    assert adapter.probe() == Probe(True, f"{url} answers, sleep endpoints present")


async def test_asyncio_entry_points(url: str, standin: VLLMStandIn) -> None:
    adapter = vllm.VLLMAdapter(url)
    await adapter.sleep_async()
    assert standin.sleeping
    await adapter.wake_async()
    assert not standin.sleeping and standin.canaries == 1
    with pytest.raises(RuntimeError, match="await the \\*_async variant instead"):
        adapter.sleep()


@pytest.mark.parametrize("twin", [FakeLLM, FakeAsyncLLM])
@pytest.mark.parametrize("level", [1, 2])
def test_in_process_engines(rehydrate_engine: Any, twin: type[FakeLLM], level: int) -> None:
    llm = twin()
    vllm.install(llm, engine=rehydrate_engine, level=level)
    assert rehydrate_engine.simulate_snapshot().ok
    assert llm.calls == ["is_sleeping", f"sleep({level})", "is_sleeping"]
    llm.calls.clear()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    wake = (["wake_up(['weights'])", "collective_rpc(reload_weights)",
             "wake_up(['kv_cache'])", "is_sleeping", "wake_up(None)"] if level == 2
            else ["wake_up(None)"])
    assert llm.calls == ["is_sleeping", *wake, "is_sleeping", "generate"]
    assert llm.engine.weights == "gpu" and not llm.engine.sleeping


def test_in_process_failure_is_the_hook_error(rehydrate_engine: Any) -> None:
    llm = FakeLLM()
    vllm.install(llm, engine=rehydrate_engine, level=2)
    assert rehydrate_engine.simulate_snapshot().ok
    llm.engine.asleep = {"weights"}  # reload before the weights were woken
    llm.wake_up = lambda tags=None: None  # type: ignore[method-assign]
    report = rehydrate_engine.simulate_restore()
    assert str(hook(report, "rehydrate.vllm.wake").error) == \
        "weights memory is not allocated (still asleep)"


@pytest.mark.parametrize("kwargs, error, message", [
    ({"level": 3}, ValueError, "level must be one of 0, 1, 2, not 3"),
    ({"mode": "later"}, ValueError,
     "mode must be one of abort, wait, keep (or None), not 'later'"),
    ({"deadline": 0}, ValueError,
     "deadline must be a number of seconds > 0 and at most 31536000 (a year), not 0"),
    ({"deadline": 10**400}, ValueError,  # accepted: every hook failed with OverflowError
     "deadline must be a number of seconds > 0 and at most 31536000 (a year), not 1e+400"),
    ({"request_timeout": 1e300}, ValueError,
     "request_timeout must be a number of seconds > 0 and at most 31536000 (a year), not 1e+300"),
    ({"level": 1.0}, ValueError, "level must be one of 0, 1, 2, not 1.0"),
    ({"canary": "no"}, TypeError, "canary must be True or False, not 'no'"),  # "no" is truthy
    ({"deadline": "5"}, TypeError,
     "deadline must be a number of seconds > 0 and at most 31536000 (a year), not str"),
])
def test_bad_options(url: str, kwargs: dict[str, Any], error: type[Exception],
                     message: str) -> None:
    with pytest.raises(error) as exc:
        vllm.VLLMAdapter(url, **kwargs)
    assert str(exc.value) == message


def test_bad_targets() -> None:
    with pytest.raises(TypeError, match="target must be a URL or a vLLM LLM/AsyncLLM; "
                                        "object has no sleep, wake_up"):
        vllm.VLLMAdapter(object())
    with pytest.raises(ValueError, match="url must start with http:// or https://"):
        vllm.VLLMAdapter("localhost:8000")
    for bad in ("http://", "http:///x", "http://h:99999", "http://a b"):  # not at hook time
        with pytest.raises(ValueError, match=r"url must name a host \(and a port 1-65535"):
            vllm.VLLMAdapter(bad)
    with pytest.raises(ValueError) as exc:
        vllm.VLLMAdapter("http://user:s3cret@localhost:8000")
    assert str(exc.value) == "url must not contain credentials: pass api_key= instead"


def test_an_adapter_whose_server_does_not_answer_yet_is_installed_and_its_hooks_fail(
        url: str, standin: VLLMStandIn, refused_port: int) -> None:
    """A vLLM still loading its model does not listen yet: skipping its adapter (an INFO
    line) left the snapshot without a sleep and the restore ready without a wake-up."""
    up = vllm.VLLMAdapter(url)
    down_url = f"http://127.0.0.1:{refused_port}"
    down = vllm.VLLMAdapter(down_url, deadline=0.3)
    engine = Lifecycle(Registry(), env=EnvRefresher(path=None), extensions=[up, down])
    try:
        assert engine.installed == [f"rehydrate.adapters.vllm:{url}",
                                    f"rehydrate.adapters.vllm:{down_url}"]
        report = engine.simulate_snapshot()
        sleeps = [h for h in report.hooks if h.name.startswith("rehydrate.vllm.sleep")]
        assert len(sleeps) == 2 and not report.ok
        assert any(h.error is not None and "unreachable (ConnectError" in str(h.error)
                   for h in sleeps)
    finally:
        engine.close()


def test_an_explicit_adapter_whose_server_cannot_serve_it_is_skipped_with_a_warning(
        url: str, server: Any, caplog: pytest.LogCaptureFixture) -> None:
    server[1].app = VLLMStandIn(dev_mode=False)
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        engine = Lifecycle(Registry(), env=EnvRefresher(path=None),
                           extensions=[vllm.VLLMAdapter(url)])
    try:
        assert engine.installed == []
        [record] = [r for r in caplog.records if "not installed" in r.getMessage()]
        assert record.levelno == logging.WARNING
        assert record.getMessage() == (
            f"extension rehydrate.adapters.vllm:{url} not installed: {url} has no "
            "/is_sleeping: start vLLM with VLLM_SERVER_DEV_MODE=1")
    finally:
        engine.close()


def test_api_key_is_sent_as_a_bearer_token(url: str, server: Any) -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(dict(scope["headers"]).get(b"authorization", b"").decode())
        await VLLMStandIn()(scope, receive, send)

    server[1].app = app
    vllm.VLLMAdapter(url, api_key="k-123", canary=False).wake()
    assert seen and set(seen) == {"Bearer k-123"}
    seen.clear()  # a key read from a file ends in a newline: sent without it
    vllm.VLLMAdapter(url, api_key="k-123\n", canary=False).wake()
    assert seen and set(seen) == {"Bearer k-123"}


@pytest.mark.parametrize("key", ["sk-live SECRET", "sk-\nlive-SECRET", "  ", "sk-é-SECRET"])
def test_an_api_key_no_header_can_carry_is_refused_without_showing_it(url: str,
                                                                       key: str) -> None:
    """Sent, it would fail in the HTTP client with a message quoting the header — the key —
    into logs, reports and the public /readyz."""
    with pytest.raises(ValueError, match="api_key must be visible ASCII") as exc:
        vllm.VLLMAdapter(url, api_key=key, canary=False)
    assert "SECRET" not in str(exc.value)


def test_probe_of_a_server_that_is_down(refused_port: int) -> None:
    url = f"http://127.0.0.1:{refused_port}"
    assert vllm.VLLMAdapter(url).probe() == Probe(
        True, f"{url} is not ready yet (does not answer: ConnectError): installed anyway")


@pytest.mark.parametrize("body", [b"<html>Welcome to nginx</html>", b"{not json",
                                  b"[true]", b'{"is_sleeping": "yes"}'])
def test_an_is_sleeping_answer_that_cannot_confirm_fails_the_sleep(
        url: str, server: Any, rehydrate_engine: Any, body: bytes) -> None:
    """A 200 that is no vLLM answer (a proxy's page, another server) must not count as
    "asleep": the snapshot would be taken of an engine still holding its memory."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/is_sleeping":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        await VLLMStandIn()(scope, receive, send)

    server[1].app = app
    vllm.install(url, engine=rehydrate_engine, deadline=5)
    report = rehydrate_engine.simulate_snapshot()
    sleep = hook(report, "rehydrate.vllm.sleep")
    assert not report.ok and sleep.outcome == "failed"
    assert "no true/false is_sleeping in the answer" in str(sleep.error)


def test_a_reload_slower_than_request_timeout_is_sent_once_and_waited_for(
        url: str, standin: VLLMStandIn, rehydrate_engine: Any) -> None:
    """reload_weights takes minutes for a big model: re-sent on every request_timeout it
    would queue reloads behind each other and the kv_cache never be woken."""
    vllm.install(url, engine=rehydrate_engine, level=2, deadline=5, request_timeout=0.2)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.hang["/collective_rpc"] = 0.6
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log.count("POST /collective_rpc") == 1
    assert "POST /wake_up?tags=kv_cache" in standin.log
    assert standin.weights == "gpu" and not standin.sleeping


@pytest.mark.parametrize("path", ["/sleep", "/wake_up"])
def test_an_unanswered_sleep_or_wake_is_not_sent_again_the_engine_state_decides(
        url: str, standin: VLLMStandIn, rehydrate_engine: Any, path: str) -> None:
    vllm.install(url, engine=rehydrate_engine, deadline=1, request_timeout=0.2, canary=False)
    if path == "/wake_up":
        assert rehydrate_engine.simulate_snapshot().ok
    standin.unanswered.add(path)
    standin.log.clear()
    report = rehydrate_engine.simulate_snapshot() if path == "/sleep" else \
        rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert sum(line.startswith(f"POST {path}") for line in standin.log) == 1
    assert standin.sleeping is (path == "/sleep")


def test_an_unanswered_reload_fails_the_wake_without_sending_it_again(
        url: str, standin: VLLMStandIn, rehydrate_engine: Any) -> None:
    vllm.install(url, engine=rehydrate_engine, level=2, deadline=1, request_timeout=0.2)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.unanswered.add("/collective_rpc")
    report = rehydrate_engine.simulate_restore()
    assert re.fullmatch(rf"vllm POST {re.escape(url)}/collective_rpc: no answer within "
                        r"(0\.9[0-9]*|1)s; not sent again: the server may have performed it",
                        str(hook(report, "rehydrate.vllm.wake").error))
    assert standin.log.count("POST /collective_rpc") == 1


async def test_an_adapter_extension_is_probed_inside_a_running_event_loop(
        url: str, standin: VLLMStandIn) -> None:
    """Lifecycle(extensions=[...]) probes synchronously; an async main (every AsyncLLM
    user) builds it inside a running loop."""
    http, in_process = vllm.VLLMAdapter(url), vllm.VLLMAdapter(FakeAsyncLLM())
    engine = Lifecycle(Registry(), env=EnvRefresher(path=None), extensions=[http, in_process])
    try:
        assert engine.installed == [http.key, in_process.key]
    finally:
        engine.close()
    assert http.probe() == Probe(True, f"{url} answers, sleep endpoints present")
    assert in_process.probe() == Probe(True, "in-process FakeAsyncLLM")


@pytest.mark.parametrize("bad", ["http://127.0.0.1:8000/?api-key=SECRET123",
                                 "http://127.0.0.1:8000?token=SECRET123",
                                 "http://127.0.0.1:8000/#SECRET123",
                                 "http://127.0.0.1:99999/?api-key=SECRET123",
                                 "localhost:8000/?api-key=SECRET123"])
def test_a_url_with_a_query_or_fragment_is_refused_without_showing_it(bad: str) -> None:
    """A gateway token in the query would show up in the extension key, probe reasons,
    logs and errors (and be joined into every request path)."""
    with pytest.raises(ValueError) as exc:
        vllm.VLLMAdapter(bad)
    assert "SECRET123" not in str(exc.value)
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="url must not contain a query or fragment"):
        vllm.VLLMAdapter("http://127.0.0.1:8000/?api-key=SECRET123")


def test_a_url_with_credentials_that_is_bad_otherwise_is_refused_without_them() -> None:
    with pytest.raises(ValueError) as exc:
        vllm.VLLMAdapter("http://user:s3cret@localhost:99999")
    assert "s3cret" not in str(exc.value)


@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_the_openai_base_url_is_refused_saying_to_give_the_server_root(url: str,
                                                                         suffix: str) -> None:
    """Every call would 404 and read as "enable dev mode", which is on."""
    for make in (vllm.VLLMAdapter, sglang.SGLangAdapter):
        with pytest.raises(ValueError) as exc:
            make(url + suffix)
        assert str(exc.value) == (f"url must be the server root, not the OpenAI base URL: "
                                  f"drop the /v1 from '{url}{suffix}'")
    assert vllm.VLLMAdapter(url + "/vllm").url == url + "/vllm"  # a proxy's prefix is fine


@pytest.mark.parametrize("body", [b"<html>gateway</html>", b'{"is_sleeping": "no"}'])
def test_probe_wants_a_vllm_is_sleeping_answer(url: str, server: Any, body: bytes) -> None:
    """A gateway answering 200 to everything is not a vLLM server in dev mode."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    server[1].app = app
    assert vllm.VLLMAdapter(url).probe() == Probe(
        False, f"{url}/is_sleeping answers HTTP 200 without a true/false is_sleeping: is it "
               "a vLLM server?")


def raw_app(status: int, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        app.calls += 1  # type: ignore[attr-defined]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    app.calls = 0  # type: ignore[attr-defined]
    return app


@pytest.mark.parametrize("location", [b"https://gw.example/x?sig=SECRET123", None])
def test_a_redirect_fails_at_once_saying_where_without_its_query(
        url: str, server: Any, location: bytes | None) -> None:
    """Not followed (it could take the bearer token elsewhere), and no transient answer to
    retry until the deadline."""
    server[1].app = app = raw_app(308, [(b"location", location)] if location else [])
    adapter = vllm.VLLMAdapter(url, deadline=30, canary=False)
    t0 = time.monotonic()
    with pytest.raises(vllm.ServerError) as exc:
        adapter.wake()
    assert time.monotonic() - t0 < 5 and app.calls == 1
    where = " to https://gw.example/x" if location else ""
    assert str(exc.value) == (f"vllm GET {url}/is_sleeping: HTTP 308 redirect{where} — point url= "
                              "at the server itself (redirects are not followed)")


@pytest.mark.parametrize("status", [501, 505])
def test_not_implemented_fails_at_once(url: str, server: Any, status: int) -> None:
    server[1].app = app = raw_app(status, [], b'{"message": "no"}')
    with pytest.raises(vllm.ServerError, match=f"vllm GET {url}/is_sleeping: HTTP {status}: no$"):
        vllm.VLLMAdapter(url, deadline=30, canary=False).wake()
    assert app.calls == 1


def test_an_unreadable_answer_is_a_server_error_naming_the_call(url: str, server: Any) -> None:
    """A proxy's Content-Encoding on a plain body: httpx's DecodingError is no transport
    error and escaped unwrapped."""
    server[1].app = raw_app(200, [(b"content-encoding", b"gzip")], b'{"is_sleeping": false}')
    with pytest.raises(vllm.ServerError) as exc:
        vllm.VLLMAdapter(url, deadline=5, canary=False).wake()
    assert str(exc.value) == f"vllm GET {url}/is_sleeping: unreadable answer (DecodingError)"
    with pytest.raises(sglang.ServerError) as exc:
        sglang.SGLangAdapter(url, deadline=5, canary=False).release()
    assert str(exc.value) == (f"sglang POST {url}/pause_generation: unreadable answer "
                              "(DecodingError)")


def test_an_answer_trickling_in_is_cut_at_the_deadline(url: str, server: Any) -> None:
    """httpx's timeout bounds each read, not the answer: a byte every 0.1 s held a try
    (and the hook) for as long as the server liked."""
    body = b'{"is_sleeping": false}' + b" " * 200

    async def trickle(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        for i in range(len(body)):
            await send({"type": "http.response.body", "body": body[i:i + 1],
                        "more_body": True})
            await asyncio.sleep(0.1)

    server[1].app = trickle
    adapter = vllm.VLLMAdapter(url, deadline=1, request_timeout=0.3, canary=False)
    t0 = time.monotonic()
    with pytest.raises(vllm.ServerError) as exc:
        adapter.wake()
    assert time.monotonic() - t0 < 4  # the answer would take 20 s
    assert re.fullmatch(rf"vllm GET {re.escape(url)}/is_sleeping: no answer within 0\.[0-9]+s "
                        r"\(gave up after the 1s deadline\)", str(exc.value))


@pytest.mark.parametrize("twin", [FakeLLM, FakeAsyncLLM])
def test_an_in_process_call_is_cut_at_the_deadline(twin: type[FakeLLM]) -> None:
    release = threading.Event()

    class Stuck(twin):  # type: ignore[misc,valid-type]
        def sleep(self, level: int = 1, mode: str = "abort") -> None:  # type: ignore[override]
            release.wait(30)

    llm = Stuck()
    try:
        t0 = time.monotonic()
        with pytest.raises(vllm.ServerError) as exc:
            vllm.VLLMAdapter(llm, deadline=0.5).sleep()
        assert time.monotonic() - t0 < 4
        assert re.fullmatch(r"vllm sleep\(\): not finished within 0\.[0-9]+s \(the 0\.5s "
                            r"deadline\)", str(exc.value))
    finally:
        release.set()


def test_a_call_cancelled_from_outside_cancels_the_request_it_waits_for() -> None:
    """Before: each HTTP try ran as a task of its own awaited through ``asyncio.wait``; a
    hook cancelled at its timeout left that task going — a sleep or wake-up POST carried
    on after the hook had given up, and failed as its client closed."""
    from rehydrate.adapters._server import within

    async def main() -> None:
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def request() -> None:
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        outer = asyncio.ensure_future(within(request(), 30, "never"))
        await started.wait()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await asyncio.wait_for(cancelled.wait(), 5)  # before: still sleeping

    asyncio.run(main())


def test_abandon_collects_a_task_that_failed_already_even_on_a_closed_loop() -> None:
    """A request that failed in the very step its waiter was cancelled is done when it is
    abandoned: its error was to be read by a callback, which a closed loop never runs
    (``call_soon`` refused: "Event loop is closed"), and asyncio then logged "Task
    exception was never retrieved" at ERROR."""
    import gc

    from rehydrate.adapters._server import abandon

    async def fail() -> None:
        raise OSError("the server is down")

    seen: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    task = loop.create_task(fail())
    loop.run_until_complete(asyncio.wait({task}))
    loop.close()
    abandon(task)
    del task
    gc.collect()
    assert seen == []


DEEP_JSON = b"[" * 100_000 + b"]" * 100_000  # valid JSON that json.loads cannot nest into


@pytest.mark.parametrize("status", [200, 400])
def test_json_nested_too_deep_for_the_parser_is_a_server_error(url: str, server: Any,
                                                               status: int) -> None:
    """A broken proxy or hostile peer answering deeply nested JSON: json.loads raises
    RecursionError (no ValueError), which escaped the adapter instead of a one-line
    ServerError naming the call."""
    server[1].app = raw_app(status, [(b"content-type", b"application/json")], DEEP_JSON)
    with pytest.raises(vllm.ServerError) as exc:
        vllm.VLLMAdapter(url, deadline=5, canary=False).wake()
    message = str(exc.value)
    assert message.startswith(f"vllm GET {url}/is_sleeping: ") and "\n" not in message
    assert len(message) < 500


def test_the_servers_reason_is_shown_without_its_control_characters(url: str,
                                                                    server: Any) -> None:
    """The reason lands in logs, status and 503 bodies: no terminal escape sequences."""
    server[1].app = raw_app(400, [], b'\x1b]0;owned\x07\x1b[31mbad request\x1b[0m\x00')
    with pytest.raises(vllm.ServerError) as exc:
        vllm.VLLMAdapter(url, deadline=5, canary=False).wake()
    assert str(exc.value) == (f"vllm GET {url}/is_sleeping: HTTP 400: "
                              "?]0;owned??[31mbad request?[0m?")
    assert exc.value.reason == "?]0;owned??[31mbad request?[0m?"


def test_installing_again_replaces_the_hooks_it_does_not_add_a_second_pair(
        url: str, standin: VLLMStandIn, rehydrate_engine: Any, caplog: Any) -> None:
    """vllm.install(url) twice (an app factory run twice, or beside
    Lifecycle(extensions=[...])) attached two pairs of hooks: two sleeps, two wake-ups,
    two canaries per restore. The latest install wins."""
    vllm.install(url, engine=rehydrate_engine, level=2)
    with caplog.at_level(logging.INFO, logger="rehydrate.adapters"):
        vllm.install(url, engine=rehydrate_engine)  # level 1 now
    assert [h.name for h in rehydrate_engine.hooks("snapshot")].count("rehydrate.vllm.sleep") == 1
    assert "installed again: it replaces the one before" in caplog.text
    assert rehydrate_engine.simulate_snapshot().ok
    assert standin.log == ["GET /is_sleeping", "POST /sleep?level=1", "GET /is_sleeping"]
    standin.log.clear()
    assert rehydrate_engine.simulate_restore().ok
    assert standin.log == LEVEL1_WAKE and standin.canaries == 1
    # another engine is another engine: its own pair
    other = Lifecycle(Registry(), env=EnvRefresher(path=None))
    try:
        vllm.install(url, engine=other)
        assert [h.name for h in other.hooks("restore")].count("rehydrate.vllm.wake") == 1
        assert [h.name for h in rehydrate_engine.hooks("restore")].count(
            "rehydrate.vllm.wake") == 1
    finally:
        other.close()


def test_two_servers_on_one_engine_have_hooks_and_errors_that_say_which(
        rehydrate_engine: Any) -> None:
    """A generator and a reranker on one engine: both hooks were named
    ``rehydrate.vllm.wake`` and the error named no server, so a report, /readyz and the
    log could not tell which one failed to wake. The first keeps the plain names (probes,
    alerts and tests elsewhere match them); the second's carry its host:port."""
    first, second = VLLMStandIn(), VLLMStandIn()
    with serve(first) as url_a, serve(second) as url_b:
        vllm.install(url_a, engine=rehydrate_engine, deadline=2)
        vllm.install(url_b, engine=rehydrate_engine, deadline=2)
        where_b = url_b.split("://", 1)[1]
        assert [h.name for h in rehydrate_engine.hooks("restore")
                if h.name.startswith("rehydrate.vllm")] == [
            "rehydrate.vllm.wake", f"rehydrate.vllm.wake[{where_b}]"]
        vllm.install(url_a, engine=rehydrate_engine, deadline=2)  # again: still plain
        vllm.install(url_b, engine=rehydrate_engine, deadline=2)
        assert sorted(h.name for h in rehydrate_engine.hooks("snapshot")
                      if h.name.startswith("rehydrate.vllm")) == [
            "rehydrate.vllm.sleep", f"rehydrate.vllm.sleep[{where_b}]"]
        assert rehydrate_engine.simulate_snapshot().ok
        second.broken["/wake_up"] = (500, "CUDA error: out of memory")
        report = rehydrate_engine.simulate_restore()
        assert hook(report, "rehydrate.vllm.wake").outcome == "ok"
        failed = hook(report, f"rehydrate.vllm.wake[{where_b}]")
        assert str(failed.error).startswith(f"vllm POST {url_b}/wake_up: HTTP 500: CUDA")
        assert f"rehydrate.vllm.wake[{where_b}] failed (ServerError: vllm POST {url_b}/" \
            in not_ready_reason(rehydrate_engine)


def test_an_in_process_engine_installed_twice_is_put_to_sleep_once(
        rehydrate_engine: Any) -> None:
    llm = FakeLLM()
    vllm.install(llm, engine=rehydrate_engine)
    vllm.install(llm, engine=rehydrate_engine)
    vllm.install(FakeLLM(), engine=rehydrate_engine)  # another engine object: its own hooks
    names = [h.name for h in rehydrate_engine.hooks("snapshot")]
    assert names.count("rehydrate.vllm.sleep") == 1
    assert [n for n in names if n.startswith("rehydrate.vllm.sleep[in-process ")] != []
    assert rehydrate_engine.simulate_snapshot().ok
    assert llm.calls == ["is_sleeping", "sleep(1)", "is_sleeping"]


def test_sglang_installed_twice_restores(url: str, server: Any, rehydrate_engine: Any) -> None:
    """Two resume hooks for one server: the second resume was refused (nothing released
    any more) and the restore failed."""
    from tests.inference_standins import SGLangStandIn

    server[1].app = standin = SGLangStandIn()
    sglang.install(url, engine=rehydrate_engine)
    sglang.install(url, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    assert standin.log.count("POST /release_memory_occupation") == 1
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log.count("POST /resume_memory_occupation") == 1


def test_a_loopback_server_is_called_directly_despite_an_egress_proxy(
        url: str, standin: VLLMStandIn, rehydrate_engine: Any, monkeypatch: Any) -> None:
    """A Pod with HTTP_PROXY set for egress (and no NO_PROXY for 127.0.0.1): the adapter's
    calls to the engine on loopback went to the proxy — which cannot reach this Pod's
    loopback — and the engine "did not answer"."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:1")  # nothing listens there
    assert url.startswith("http://127.0.0.1:")
    assert vllm.VLLMAdapter(url, canary=False).probe().usable
    vllm.install(url, engine=rehydrate_engine, deadline=5)
    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.simulate_restore().ok
    assert standin.canaries == 1
    # a remote server still goes through the proxy the environment names
    assert vllm.VLLMAdapter("http://10.1.2.3:8000").client().trust_env
    for local in ("http://localhost:8000", "http://[::1]:8000", "http://127.8.9.10",
                  "http://api.localhost:1"):
        assert not vllm.VLLMAdapter(local).client().trust_env, local


PROXY_USER, PROXY_PASSWORD = "alice", "hunter2@pw"
PROXY_TOKEN = "YWxpY2U6aHVudGVyMkBwdw=="  # base64 of alice:hunter2@pw


@pytest.mark.parametrize("quote", [
    lambda header: f"credentials {header.split()[-1]} rejected",  # the bare token
    lambda header: f"got Proxy-Authorization: {header}",
    lambda header: f"user {PROXY_USER}:{PROXY_PASSWORD} unknown",
    lambda header: f"password {PROXY_PASSWORD} expired",
    lambda header: "password hunter2%40pw expired",  # as written in the proxy URL
], ids=["bare token", "header", "user info", "password", "password as written"])
def test_a_proxys_credentials_are_shown_nowhere(
        server: tuple[str, Switch], monkeypatch: Any, caplog: pytest.LogCaptureFixture,
        quote: Any) -> None:
    """HTTP_PROXY with credentials, and a proxy whose 407 quotes them: httpx sends them
    as a Proxy-Authorization header of the proxy connection, which the request's own
    headers do not show, and the bare base64 token looks like no credential — the error
    line carried the proxy's password, base64-encoded."""
    seen: list[str] = []

    async def proxy(scope: Any, receive: Any, send: Any) -> None:
        header = dict(scope["headers"]).get(b"proxy-authorization", b"").decode()
        seen.append(header)
        await _json(send, 407, {"message": quote(header)})

    server[1].app = proxy
    for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                 "all_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", server[0].replace(
        "http://", f"http://{PROXY_USER}:hunter2%40pw@"))
    adapter = vllm.VLLMAdapter("http://vllm.internal.example:8000", deadline=0.5,
                               canary=False)
    with caplog.at_level(logging.DEBUG), pytest.raises(vllm.ServerError) as exc:
        adapter.sleep()
    assert seen and seen[0] == f"Basic {PROXY_TOKEN}"  # what the proxy could quote
    message = str(exc.value)
    assert "HTTP 407 from a proxy between this process and vLLM" in message
    assert "[redacted]" in message
    for shown in (message, *caplog.messages):
        for secret in (PROXY_TOKEN, PROXY_PASSWORD, "hunter2%40pw", "hunter2"):
            assert secret not in shown, shown


def stalling_app(status: int, size: int) -> Any:
    """Answers ``size`` bytes of body and then never ends the answer (a broken proxy
    streaming for ever, stalled here so that an uncapped client waits instead of filling
    this test's memory); it returns when the client goes away."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain")]})
        chunk = b"x" * 65536
        for _ in range(size // len(chunk)):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
    return app


@pytest.mark.parametrize("status", [200, 400])
def test_an_answer_is_read_up_to_a_cap_not_to_its_end(url: str, server: Any,
                                                      status: int) -> None:
    """Bodies were read whole, with no size cap: a proxy streaming without end (or a huge
    error page) filled memory during a restore, and one that stalled mid-body held the
    call until its timeout. The adapters read at most MAX_BODY bytes (1 MiB) of an
    answer: here more than that arrives and the body never ends, yet the call fails at
    once on what it read."""
    from rehydrate.adapters._bodies import MAX_BODY

    server[1].app = stalling_app(status, MAX_BODY + 512 * 1024)
    adapter = vllm.VLLMAdapter(url, deadline=30, request_timeout=30, canary=False)
    with pytest.raises(vllm.ServerError) as exc:
        adapter.wake()  # GET /is_sleeping: no true/false in 1 MiB of "x" (or an HTTP 400)
    message = str(exc.value)
    assert "no answer within" not in message and "\n" not in message, message
    expected = (f"vllm GET {url}/is_sleeping: no true/false is_sleeping" if status == 200
                else f"vllm GET {url}/is_sleeping: HTTP 400: xxxx")
    assert message.startswith(expected) and len(message) < 600


@pytest.mark.parametrize("echo", [*GATEWAY_ECHOES, "canary answer without choices"])
def test_the_api_key_echoed_by_a_gateway_is_shown_nowhere(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn, rehydrate_engine: Any,
        caplog: pytest.LogCaptureFixture, echo: str) -> None:
    """A gateway echoing the Authorization header in its answers: the reasons quoted in
    errors, logs, the status and /readyz's 503 carry no trace of the adapter's key."""
    def answer(path: str, auth: str) -> tuple[int, Any] | None:
        if echo == "canary answer without choices":
            if path != "/v1/completions":
                return None  # the stand-in answers
            return 200, {"object": "error", "request": {"headers": {"authorization": auth}}}
        return GATEWAY_ECHOES[echo](auth)  # type: ignore[no-any-return]

    server[1].app = gateway = EchoingGateway(answer, behind=standin)
    adapter = vllm.install(url, engine=rehydrate_engine, api_key=API_KEY, deadline=0.3)
    _, report = assert_the_key_is_shown_nowhere(rehydrate_engine, adapter, gateway, caplog,
                                                adapter.wake, vllm.ServerError)
    assert not report.ok


@pytest.mark.parametrize(("answer", "quoted"), [
    ('Bearer realm="api", error="invalid_token"', 'Bearer realm="api", error="invalid_token"'),
    ("Basic authentication required", "Basic authentication required"),
    ("max token count exceeded", "max token count exceeded"),
    ("Authorization: Token abcd1234 refused", "Authorization: [redacted] refused"),
    ("Basic Zm9vOmJhcg== refused", "Basic [redacted] refused"),
    ('{"x-api-key": "k-123456"}', '{"x-api-key": "[redacted]"}'),
    ("see https://user:pw@gw/p?sig=abc&a=1#f", "see https://gw/p?sig=[redacted]&a=[redacted]#f"),
    # a server's words after a scheme or a key name are no credential
    ("Basic sampling params are invalid", "Basic sampling params are invalid"),
    ("Bearer tokens expired", "Bearer tokens expired"),
    ("api_key: missing in config", "api_key: missing in config"),
    # credentials of letters only are still credentials
    ("Authorization: Bearer AbCdEfGhIjKlMnOpQrStUvWxYz", "Authorization: [redacted]"),
    ("invalid token: Bearer AbCdEfGhIjKlMnOpQrSt", "invalid token: Bearer [redacted]"),
    ("api_key=QWERTYUIOPASDFGHJKLZXCVB", "api_key=[redacted]"),
    ('{"x-api-key": "abcdef.ghijkl.mnopqr"}', '{"x-api-key": "[redacted]"}'),
    ('{"x-api-key": "required"}', '{"x-api-key": "required"}'),
])
def test_redaction_hides_credentials_but_keeps_a_servers_explanations(
        answer: str, quoted: str) -> None:
    assert redact(answer) == quoted


# Cloudflare's 5xx page, cut down: its title comes after some 350 characters of markup.
CLOUDFLARE_PAGE = """<!DOCTYPE html>
<!--[if lt IE 7]> <html class="no-js ie6 oldie" lang="en-US"> <![endif]-->
<!--[if IE 7]>    <html class="no-js ie7 oldie" lang="en-US"> <![endif]-->
<!--[if IE 8]>    <html class="no-js ie8 oldie" lang="en-US"> <![endif]-->
<!--[if gt IE 8]><!--> <html class="no-js" lang="en-US"> <!--<![endif]-->
<head>
<title>vllm.example.com | 500: Internal server error</title>
<meta charset="UTF-8" />
<meta http-equiv="Content-Type" content="text/html; charset=UTF-8" />
<link rel="stylesheet" id="cf_styles-css" href="/cdn-cgi/styles/main.css?key=KEY" />
<script>window._cf_chl_opt = {cRay: "8f1c2a", auth: "Bearer KEY"};</script>
<style>body{margin:0;padding:0}#cf-wrapper{font-family:system-ui}</style>
</head>
<body><div id="cf-wrapper"><header><h1>
<span class="inline-block">Internal server error</span>
<span class="code-label">Error code 500</span></h1></header>
<p>There is an unknown connection issue between Cloudflare &amp; the origin web server.</p>
</div></body></html>""".replace("KEY", API_KEY)


def test_an_html_error_page_is_quoted_by_its_words_not_its_markup(
        url: str, server: tuple[str, Switch]) -> None:
    """A gateway's HTML error page (Content-Type text/html): the hook's error quotes its
    title and text. Quoted as it came, the 300 characters a reason keeps were comments
    and tags ending before the title: nothing said what went wrong."""
    server[1].app = raw_app(500, [(b"content-type", b"text/html; charset=UTF-8")],
                            CLOUDFLARE_PAGE.encode())
    adapter = vllm.VLLMAdapter(url, deadline=0.3, api_key=API_KEY)
    with pytest.raises(vllm.ServerError) as failed:
        adapter.wake()
    assert str(failed.value) == (
        f"vllm GET {url}/is_sleeping: HTTP 500: vllm.example.com | 500: Internal server "
        "error: Internal server error Error code 500 There is an unknown connection issue "
        "between Cloudflare & the origin web server. (gave up after the 0.3s deadline)")


@pytest.mark.parametrize("page", [
    "<title>Error</title><script>document.write('<!--')</script><p>model-a timed out</p>",
    "<title>Error</title><!--><p>model-a timed out</p>",
    "<title>Error</title><!---><p>model-a timed out</p>",
    "<TITLE>Error</TITLE><stylesheet/><p>model-a timed out</p>",
    "<title>Error</title><style>p{}</style><!-- <script> --><p>model-a timed out</p>",
], ids=["comment-in-script", "empty-comment", "empty-comment-2", "tag-named-like-style",
        "script-in-comment"])
def test_an_html_page_keeps_its_message_whatever_its_blocks(page: str) -> None:
    """A ``<!--`` inside a script, an empty comment (``<!-->``) or a tag whose name starts
    like one (``<stylesheet>``) took the rest of the page for a comment or a style: the
    reason was its title alone."""
    from rehydrate.adapters._server import page_text

    answer = httpx.Response(502, headers={"content-type": "text/html"},
                            content=page.encode())
    assert page_text(answer) == "Error: model-a timed out"


@pytest.mark.parametrize(("status", "usable"), [(503, True), (429, True), (404, False)])
def test_probe_of_a_server_still_loading_is_usable_and_of_a_wrong_one_is_not(
        url: str, server: Any, status: int, usable: bool) -> None:
    """A 503 from /health is a server not ready yet (its adapter is installed and its
    hooks say why if it stays so); a 404 is not the server the adapter talks to."""
    server[1].app = raw_app(status, [], b"loading")
    found = vllm.VLLMAdapter(url).probe()
    assert found.usable is usable
    assert f"{url}/health answers HTTP {status}: loading" in found.reason


GATEWAY_PAGE = "<html><head><title>401 Authorization Required</title></head></html>"


@pytest.mark.parametrize("path", ["/health", "/is_sleeping"])
@pytest.mark.parametrize(("status", "body", "says"), [
    (401, GATEWAY_PAGE,
     f" from a gateway in front of vLLM, not vLLM (its own authentication: {GATEWAY_PAGE})"
     " — the call did not reach vLLM; give the adapter credentials the gateway accepts "
     "(api_key= is sent as a bearer token) or point url= at vLLM itself"),
    (403, "RBAC: access denied",
     " from a gateway in front of vLLM, not vLLM (its own authentication: RBAC: access "
     "denied) — the call did not reach vLLM; give the adapter credentials the gateway "
     "accepts (api_key= is sent as a bearer token) or point url= at vLLM itself"),
    (407, "Proxy Authentication Required",
     " from a proxy between this process and vLLM, not vLLM (Proxy Authentication "
     "Required: Proxy Authentication Required) — the call did not reach vLLM; give the "
     "proxy its credentials (HTTPS_PROXY / HTTP_PROXY) or exempt the host with NO_PROXY"),
    (401, {"error": "Unauthorized"},  # vLLM's own --api-key middleware
     ": Unauthorized — vLLM refused the API key: pass api_key= matching its --api-key"),
])
def test_probe_says_whose_authentication_refusal_it_is(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn, path: str,
        status: int, body: Any, says: str) -> None:
    """A gateway's 401 on the probe's request read "answers HTTP 401: <its page>" (on
    /is_sleeping: "is it a vLLM server?"): nothing said the probe never reached vLLM, nor
    whose credentials to fix, as the hooks' calls say."""
    server[1].app = EchoingGateway(
        lambda p, auth: (status, body) if p == path else None, behind=standin)
    found = vllm.VLLMAdapter(url).probe()
    assert not found.usable
    assert found.reason == f"{url}{path} answers HTTP {status}{says}"


@pytest.mark.parametrize("status", [503, 429])
def test_probe_of_is_sleeping_not_ready_yet_is_usable(url: str, server: Any,
                                                      status: int) -> None:
    """/health answers, /is_sleeping answers 503 or 429 (the server still warming up): as
    for /health, a server not ready yet, not "is it a vLLM server?" (before, the adapter
    was skipped)."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        code = 200 if scope["path"] == "/health" else status
        await send({"type": "http.response.start", "status": code, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    server[1].app = app
    found = vllm.VLLMAdapter(url).probe()
    assert found.usable, found.reason
    assert f"/is_sleeping answers HTTP {status}" in found.reason


def test_only_what_can_be_shown_of_a_huge_answer_is_redacted(monkeypatch) -> None:
    """A server's 1 MB error page: redaction looks at a margin past the 300 characters
    shown, not the whole body (on some bodies the patterns took minutes: a
    ``a.a.a…`` run made the URL search quadratic)."""
    import httpx

    from rehydrate.adapters import _server

    seen: list[int] = []
    real = _server.redact

    def measured(text: str, secrets=(), *, patterns=True):  # type: ignore[no-untyped-def]
        if patterns:  # the request's own secrets are replaced everywhere (linear)
            seen.append(len(text))
        return real(text, secrets, patterns=patterns)

    monkeypatch.setattr(_server, "redact", measured)
    request = httpx.Request("GET", "http://vllm.invalid/health")
    response = httpx.Response(500, request=request)
    out = _server.answer_text(response, "a." * 500_000)
    assert len(out) == 300 and seen == [1200]
    # and the URL pattern no longer starts at every position of a dotted run
    assert _server._URL.search("a." * 50 + "x") is None


def test_the_adapters_key_deep_in_an_indented_page_is_never_cut_in_half() -> None:
    """An indented HTML error page echoing the key around character 1200: cut to the
    patterns' margin before the white space was collapsed, the key lost its tail, no
    longer matched, and 37 of its 38 characters were shown."""
    import httpx

    from rehydrate.adapters import _server

    key = "sk-live-0123456789abcdefghij0123456789"
    request = httpx.Request("GET", "http://vllm.invalid/health",
                            headers={"Authorization": f"Bearer {key}"})
    response = httpx.Response(401, request=request)
    page = "<html>" + " " * 1150 + f"echo: {key} " + "x " * 200
    out = _server.answer_text(response, page)
    assert key[:12] not in out and "[redacted]" in out, out


@pytest.mark.parametrize("status", [502, 504])
def test_a_gateways_502_or_504_on_every_performed_sleep_is_checked_at_the_deadline(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn, rehydrate_engine: Any,
        status: int) -> None:
    """vLLM slept, a gateway in front answers 502/504 to every sleep: re-sent until the
    deadline (a sleep of a sleeping engine does nothing), the snapshot failed there. The
    last 502/504 leaves it unconfirmed: /is_sleeping says it happened."""
    adapter = vllm.install(url, engine=rehydrate_engine, deadline=1)
    server[1].app = LosingGateway(standin, {"/sleep"}, status=status)
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    assert standin.log.count("POST /sleep?level=1") >= 2
    assert standin.log[-2:] == ["GET /is_sleeping", "GET /is_sleeping"]
    assert standin.sleeping and standin.weights == "cpu" and not adapter.sleep_unconfirmed


def test_a_gateways_504_on_every_performed_wake_up_is_checked_at_the_deadline(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any) -> None:
    vllm.install(url, engine=rehydrate_engine, deadline=1)
    assert rehydrate_engine.simulate_snapshot().ok
    server[1].app = LosingGateway(standin, {"/wake_up"})
    standin.log.clear()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log.count("POST /wake_up") >= 2 and not standin.sleeping
    assert standin.canaries == 1


def test_a_gateways_504_on_a_performed_reload_is_not_resent(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any) -> None:
    """A reload_weights longer than the gateway's timeout: performed once, the wake fails
    saying why (nothing tells whether the reload happened), and the next wake — the
    gateway fixed — starts over from /is_sleeping and succeeds."""
    vllm.install(url, engine=rehydrate_engine, level=2, deadline=2)
    assert rehydrate_engine.simulate_snapshot().ok
    server[1].app = LosingGateway(standin, {"/collective_rpc"})
    first = rehydrate_engine.simulate_restore()
    assert str(hook(first, "rehydrate.vllm.wake").error) == (
        f"vllm POST {url}/collective_rpc: HTTP 504: upstream request timeout; not sent "
        "again: the server behind the gateway may have performed it (point url= at the "
        "server, or give the gateway a timeout above the 2s deadline)")
    assert standin.log.count("POST /collective_rpc") == 1
    server[1].app = standin
    second = rehydrate_engine.simulate_restore()
    assert second.ok, second.table()
    assert not standin.sleeping and standin.weights == "gpu" and standin.canaries == 1


def test_a_gateways_504_on_a_performed_level2_weights_wake_up_is_sent_again(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any) -> None:
    """At level 2 /is_sleeping says true after wake_up?tags=weights (kv_cache still
    sleeps), so it cannot tell whether a wake-up answered 504 happened: the restore
    failed and left vLLM asleep. vLLM's wake_up of a tag already awake does nothing, so it
    is sent again."""
    vllm.install(url, engine=rehydrate_engine, level=2, deadline=3)
    assert rehydrate_engine.simulate_snapshot().ok
    server[1].app = LosingGateway(standin, {"/wake_up"}, times=1)
    standin.log.clear()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log[:4] == ["GET /is_sleeping", "POST /wake_up?tags=weights",
                               "POST /wake_up?tags=weights", "POST /collective_rpc"]
    assert not standin.sleeping and standin.weights == "gpu" and standin.canaries == 1


def test_a_sleep_the_gateway_times_out_is_sent_again_until_it_answers(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any) -> None:
    """A sleep longer than the gateway's timeout: 504 while vLLM still works on it, and
    /is_sleeping says false meanwhile — the snapshot failed. Sent again (a sleep of a
    sleeping engine does nothing), it is answered once vLLM is done."""
    vllm.install(url, engine=rehydrate_engine, deadline=5)
    server[1].app = gateway = SlowUpstream(standin, {"/sleep": 0.6}, timeout=0.2)
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    assert standin.log.count("POST /sleep?level=1") >= 2 and standin.sleeping
    assert gateway.settled.wait(5)
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert not standin.sleeping and standin.canaries == 1


def test_a_sleep_whose_connection_was_cut_is_awaited_until_the_deadline(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any) -> None:
    """The answer lost, vLLM still sleeping: /is_sleeping asked once said false and the
    snapshot failed. It is asked until the deadline."""
    vllm.install(url, engine=rehydrate_engine, deadline=5)
    server[1].app = gateway = SlowUpstream(standin, {"/sleep": 0.6}, timeout=0.1, drop=True)
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    assert standin.log.count("POST /sleep?level=1") == 1 and standin.sleeping
    assert standin.log.count("GET /is_sleeping") >= 3
    assert gateway.settled.wait(5)


def test_a_wake_after_an_unconfirmed_sleep_wakes_whatever_is_sleeping_says(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any) -> None:
    """A sleep still in vLLM past the deadline: the snapshot fails, /is_sleeping says
    false, and the resume took it as awake — vLLM fell asleep after it while the engine
    said ready. The wake_up is sent anyway; vLLM runs it after the sleep."""
    adapter = vllm.install(url, engine=rehydrate_engine, deadline=0.6)
    server[1].app = gateway = SlowUpstream(standin, {"/sleep": 1.0}, timeout=0.1, drop=True)
    snap = rehydrate_engine.simulate_snapshot()
    assert not snap.ok and adapter.sleep_unconfirmed
    assert not standin.sleeping  # not yet
    gateway.timeout = 5  # the calls after it wait behind it in vLLM, answered
    report = rehydrate_engine.simulate_restore(kind="resume")
    assert report.ok, report.table()
    assert gateway.settled.wait(5)
    assert "POST /wake_up" in standin.log
    assert standin.log.index("POST /wake_up") < standin.log.index("POST /v1/completions")
    assert not standin.sleeping and standin.weights == "gpu"
    assert not adapter.sleep_unconfirmed and rehydrate_engine.is_ready()


@pytest.mark.parametrize("refusal", ["401", "sleep mode"])
def test_a_refused_sleep_is_not_taken_as_maybe_performed(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any, refusal: str) -> None:
    """A sleep refused outright (a 4xx, or vLLM's 500 "Sleep mode is not enabled", which
    hint() recognises) did nothing: flagged as maybe performed, the resume after the
    failed snapshot woke the weights and reloaded them on an awake engine (level 2)."""
    adapter = vllm.install(url, engine=rehydrate_engine, level=2, deadline=0.5)
    if refusal == "401":
        server[1].app = LosingGateway(standin, {"/sleep"}, status=401, performed=False,
                                      message="auth")
    else:
        standin.sleep_mode = False
    snap = rehydrate_engine.simulate_snapshot()
    assert not snap.ok
    _resume_finds_it_awake(adapter, server, standin, rehydrate_engine)


def _resume_finds_it_awake(adapter: Any, server: tuple[str, Switch], standin: VLLMStandIn,
                           engine: Any) -> None:
    """The refused sleep was not flagged as maybe performed: with the stand-in served
    again, the resume finds the engine awake and neither wakes nor reloads it."""
    assert not adapter.sleep_unconfirmed
    server[1].app = standin
    standin.log.clear()
    report = engine.simulate_restore(kind="resume")
    assert report.ok, report.table()
    assert standin.log == ["GET /is_sleeping", "GET /v1/models", "POST /v1/completions"]


@pytest.mark.parametrize("refusal", ["sleep mode", "no dev mode", "vLLM's 401"])
@pytest.mark.parametrize("status", [502, 504])
def test_a_sleep_refused_for_every_try_after_a_gateways_502_or_504_fails_at_once(
        url: str, server: tuple[str, Switch], rehydrate_engine: Any, refusal: str,
        status: int) -> None:
    """vLLM without --enable-sleep-mode behind a gateway: the first /sleep try got a
    502, the re-sent one vLLM's "Sleep mode is not enabled" — an answer the first try
    met too. Taken as "that try may have been performed", the snapshot failed only at
    the deadline (after polling /is_sleeping throughout), with a false "the server may
    have performed it", and flagged: the next wake of the awake engine woke the weights
    and reloaded them (level 2). Likewise a 404 (no dev mode) and vLLM's own 401."""
    standin = VLLMStandIn(sleep_mode=refusal != "sleep mode")
    behind: Any = standin
    if refusal == "no dev mode":
        # a route table without /sleep (dev mode's endpoints): its 404
        behind = EchoingGateway(lambda path, auth: (
            (404, {"detail": "Not Found"}) if path == "/sleep" else None), behind=standin)
    elif refusal == "vLLM's 401":
        behind = EchoingGateway(lambda path, auth: (
            (401, {"error": "Unauthorized"}) if path == "/sleep" else None), behind=standin)
    server[1].app = LosingGateway(behind, {"/sleep"}, status=status, times=1,
                                  performed=False)
    adapter = vllm.install(url, engine=rehydrate_engine, level=2, deadline=30)
    snap = rehydrate_engine.simulate_snapshot()
    error = hook(snap, "rehydrate.vllm.sleep").error
    assert type(error) is vllm.ServerError, error
    # the re-sent try's refusal (the first got the gateway's answer), and nothing else
    code = {"sleep mode": 500, "no dev mode": 404, "vLLM's 401": 401}[refusal]
    assert str(error).startswith(f"vllm POST {url}/sleep: HTTP {code}: ")
    assert "may have performed it" not in str(error)
    assert hook(snap, "rehydrate.vllm.sleep").duration < 5  # not held until the deadline
    assert standin.log.count("GET /is_sleeping") == 1
    _resume_finds_it_awake(adapter, server, standin, rehydrate_engine)


def test_a_refused_sleep_keeps_an_earlier_unconfirmed_one_owed(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any) -> None:
    """The refusal says nothing about an earlier sleep that went unanswered: the next
    wake still wakes whatever /is_sleeping says."""
    adapter = vllm.install(url, engine=rehydrate_engine, deadline=0.5)
    adapter.sleep_unconfirmed = True  # an earlier sleep went unanswered
    server[1].app = LosingGateway(standin, {"/sleep"}, status=403, performed=False,
                                  message="forbidden")
    assert not rehydrate_engine.simulate_snapshot().ok
    assert adapter.sleep_unconfirmed


def test_envoys_503_after_forwarding_is_unconfirmed_and_its_connect_failure_retried(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any) -> None:
    """Envoy / Istio answer 503 "upstream connect error or disconnect/reset before
    headers" also when the connection died after the request was forwarded: a reload
    re-sent on it was performed twice. "connection failure" means it never connected."""
    vllm.install(url, engine=rehydrate_engine, level=2, deadline=2)
    assert rehydrate_engine.simulate_snapshot().ok
    reset = ("upstream connect error or disconnect/reset before headers. reset reason: "
             "connection termination")
    server[1].app = LosingGateway(standin, {"/collective_rpc"}, status=503, times=1,
                                  message=reset)
    first = rehydrate_engine.simulate_restore()
    assert str(hook(first, "rehydrate.vllm.wake").error).startswith(
        f"vllm POST {url}/collective_rpc: HTTP 503: {reset}; not sent again")
    assert standin.log.count("POST /collective_rpc") == 1
    refused = ("upstream connect error or disconnect/reset before headers. reset reason: "
               "connection failure, transport failure reason: delayed connect error: 111")
    server[1].app = LosingGateway(standin, {"/collective_rpc"}, status=503, times=1,
                                  performed=False, message=refused)
    standin.log.clear()
    second = rehydrate_engine.simulate_restore()
    assert second.ok, second.table()
    assert standin.log.count("POST /collective_rpc") == 1


ENVOY = "upstream connect error or disconnect/reset before headers. "


@pytest.mark.parametrize("reason", [
    "reset reason: connection failure",
    "retried and the latest reset reason: remote connection failure, transport failure "
    "reason: delayed connect error: 111",
    "reset reason: connection timeout",
    "reset reason: overflow",
    "reset reason: remote refused stream reset",
    "reset reason: local refused stream reset",
])
def test_envoys_503_for_a_request_never_forwarded_is_retried(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any, reason: str) -> None:
    """No connection, the circuit breaker, or an HTTP/2 REFUSED_STREAM (the stream was
    not processed, RFC 9113): the reload never reached vLLM and is sent again."""
    vllm.install(url, engine=rehydrate_engine, level=2, deadline=2)
    assert rehydrate_engine.simulate_snapshot().ok
    server[1].app = LosingGateway(standin, {"/collective_rpc"}, status=503, times=1,
                                  performed=False, message=ENVOY + reason)
    standin.log.clear()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log.count("POST /collective_rpc") == 1


def test_a_gateways_504_on_the_canary_is_sent_again(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any) -> None:
    """One generated token changes nothing: the canary is a POST that may be re-sent."""
    vllm.install(url, engine=rehydrate_engine, deadline=5)
    assert rehydrate_engine.simulate_snapshot().ok
    server[1].app = LosingGateway(standin, {"/v1/completions"}, times=1)
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log.count("POST /v1/completions") == 2 and standin.canaries == 2


class PoolingVLLM(VLLMStandIn):
    """vLLM serving an embedding model: /v1/completions answers 400 (or 404 where the
    route is not mounted)."""

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status

    def route(self, method: str, path: str, query: dict[str, list[str]],
              body: Any) -> tuple[int, Any]:
        if (method, path) == ("POST", "/v1/completions"):
            return self.status, {"object": "error", "type": "BadRequestError",
                                 "message": "The model does not support Completions API",
                                 "code": self.status}
        return super().route(method, path, query, body)


@pytest.mark.parametrize("status", [400, 404])
def test_a_pooling_models_canary_refusal_says_pass_canary_false(
        url: str, server: tuple[str, Switch], rehydrate_engine: Any, status: int) -> None:
    server[1].app = standin = PoolingVLLM(status)
    vllm.install(url, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    report = rehydrate_engine.simulate_restore()
    assert str(hook(report, "rehydrate.vllm.wake").error) == (
        f"vllm POST {url}/v1/completions: HTTP {status}: The model does not support "
        "Completions API — the canary generates one token, which a pooling (embedding) "
        "model cannot: pass canary=False for pooling models (or model= naming a model the "
        "server serves)")
    assert standin.log.count("POST /v1/completions") == 1  # no retry
    vllm.install(url, engine=rehydrate_engine, canary=False)
    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.simulate_restore().ok


@pytest.mark.parametrize("path", ["/health", "/is_sleeping"])
def test_an_answer_trickling_in_does_not_hold_the_probe(
        url: str, server: Any, standin: VLLMStandIn, path: str) -> None:
    """Lifecycle(extensions=[VLLMAdapter(url)]) probes in its constructor: it never
    returned while a broken proxy trickled /health or /is_sleeping a byte at a time."""
    stop, ended = threading.Event(), threading.Event()
    server[1].app = trickling(standin, path, stop, ended)
    try:
        found = vllm.VLLMAdapter(url, request_timeout=0.3).probe()
        assert not ended.is_set(), "the probe waited for the whole answer"
    finally:
        stop.set()
    where = "" if path == "/health" else "/is_sleeping: "
    assert found == Probe(True, f"{url} is not ready yet ({where}no complete answer within "
                                "0.3s): installed anyway")


class _OnRecord(logging.Handler):
    """Calls ``then`` when a record containing ``text`` is logged."""

    def __init__(self, text: str, then: Any) -> None:
        super().__init__(logging.INFO)
        self.text, self.then = text, then

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.then()


class SlowSleepWrappedLLM(SlowSleepAsyncLLM):
    """:class:`SlowSleepAsyncLLM` behind a wrapper that is no coroutine function (a
    decorator without ``functools.wraps``' marker): ``sleep()`` returns the coroutine that
    does the sleep. Before, the call counted as ended once that coroutine was returned,
    and the coroutine was cancelled at the deadline: the wake ran beside the sleep."""

    def sleep(self, level: int = 1, mode: str = "abort") -> Any:  # type: ignore[override]
        return SlowSleepAsyncLLM.sleep(self, level, mode)


@pytest.mark.parametrize("twin", [SlowSleepLLM, SlowSleepAsyncLLM, SlowSleepWrappedLLM])
def test_an_in_process_sleep_past_the_deadline_is_woken_after(
        rehydrate_engine: Any, caplog: pytest.LogCaptureFixture,
        twin: type[SlowSleepLLM]) -> None:
    """sleep() outlived the deadline (its worker thread goes on; an AsyncLLM's engine
    goes on when the awaiting coroutine is cancelled), and an in-process LLM
    (VLLM_ENABLE_V1_MULTIPROCESSING=0) runs each call in its caller's thread: the resume's
    wake_up ran beside the sleep and ended first, the sleep then ended with a ready process
    on a sleeping engine. The wake waits for it, then wakes what it put to sleep."""
    llm = twin()
    adapter = vllm.install(llm, engine=rehydrate_engine, deadline=1)
    snap = rehydrate_engine.simulate_snapshot()
    assert "sleep(): not finished within" in str(hook(snap, "rehydrate.vllm.sleep").error)
    assert adapter.sleep_unconfirmed
    # the sleep ends the moment the wake waits for it (never, without the wait)
    waiting = _OnRecord("still runs: is_sleeping() waits for it", llm.go.set)
    logging.getLogger("rehydrate").addHandler(waiting)
    try:
        with caplog.at_level(logging.INFO, logger="rehydrate"):
            report = rehydrate_engine.simulate_restore(kind="resume")
    finally:
        logging.getLogger("rehydrate").removeHandler(waiting)
        llm.go.set()
    assert llm.slept.wait(5)
    assert report.ok, report.table()
    assert llm.calls.index("sleep(1)") < llm.calls.index("wake_up(None)")
    assert not llm.engine.sleeping and not adapter.sleep_unconfirmed


def test_an_awaitable_handed_over_after_its_loop_ended_still_ends_the_call(
        caplog: pytest.LogCaptureFixture) -> None:
    """A sync engine call still blocked when the loop that waited for it ended (a sync
    twin's asyncio.run, given up at its deadline) then returns an awaitable: nobody awaits
    it, and the call never counted as ended — every later engine call waited a deadline
    for it and failed. Dropped unawaited, it ends the call (its rest never runs)."""
    entered, release = threading.Event(), threading.Event()
    rest: list[Any] = []

    async def the_rest() -> None:
        rest.append("ran")

    def blocks_then_returns_an_awaitable() -> Any:
        entered.set()
        release.wait(30)
        rest.append(the_rest())
        return rest[-1]

    async def give_up() -> Any:
        handover, finished = vllm._tracked(blocks_then_returns_an_awaitable)
        await asyncio.to_thread(entered.wait, 30)
        return handover, finished  # the loop ends with the call still in its thread

    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        handover, finished = asyncio.run(give_up())
        del handover
        assert not finished.done()
        release.set()
        assert finished.result(timeout=10) is None  # never, without the fix
    [coro] = rest  # the rest did not run, and was closed: no "never awaited" warning
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
    assert [r.getMessage() for r in caplog.records] == [
        "vLLM's test_an_awaitable_handed_over_after_its_loop_ended_still_ends_the_call."
        "<locals>.blocks_then_returns_an_awaitable: the awaitable it returned was never "
        "awaited (the event loop that waited for it ended first); the rest of the call did "
        "not run"]


class _AwaitableObject:
    """An awaitable that is no coroutine: only ``__await__``."""

    def __init__(self, then: Any) -> None:
        self.then = then

    def __await__(self) -> Any:
        yield from asyncio.sleep(0).__await__()
        self.then()


@pytest.mark.parametrize("shape", ["generator-based coroutine", "__await__ object"])
def test_a_sync_call_returning_any_awaitable_is_awaited_to_its_end(shape: str) -> None:
    """A sync sleep() returning a generator-based coroutine (@types.coroutine), which
    await accepts, failed with AttributeError: the handover called its __await__, which
    such a generator does not have."""
    class Engine:
        sleeping = False

        def sleep(self, level: int = 1, mode: str = "abort") -> Any:
            def done() -> None:
                self.sleeping = True

            if shape == "__await__ object":
                return _AwaitableObject(done)

            @types.coroutine
            def rest() -> Any:
                yield from asyncio.sleep(0).__await__()
                done()
            return rest()

        def wake_up(self, tags: Any = None) -> None:
            self.sleeping = False

        def generate(self, *args: Any, **kwargs: Any) -> list[str]:
            return ["x"]

    engine = Engine()
    adapter = vllm.VLLMAdapter(engine, deadline=30, canary=False)
    adapter.sleep()
    assert engine.sleeping
    adapter.wake()
    assert not engine.sleeping


class BlockingThenAsyncLLM(FakeAsyncLLM):
    """An engine whose ``sleep()`` is a plain method that blocks (until :attr:`go`), then
    returns the coroutine doing the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def sleep(self, level: int = 1, mode: str = "abort") -> Any:  # type: ignore[override]
        self.go.wait(30)
        return FakeAsyncLLM.sleep(self, level, mode)


def test_a_sync_twin_s_sleep_handing_over_too_late_does_not_block_later_calls() -> None:
    """The reviewer's shape: adapter.sleep() (asyncio.run) gives up at the deadline, the
    engine's sleep() then returns its coroutine to a loop that has ended. Each wake()
    after it failed "still running" after a whole deadline; now the first one works."""
    llm = BlockingThenAsyncLLM()
    adapter = vllm.VLLMAdapter(llm, deadline=1, canary=False)
    with pytest.raises(vllm.ServerError, match="sleep\\(\\): not finished within"):
        adapter.sleep()
    llm.go.set()  # the engine call ends: the wake waits for it, within its deadline
    adapter.wake()
    assert not llm.engine.sleeping


def test_a_wake_fails_clearly_when_the_sleep_before_never_ends(rehydrate_engine: Any) -> None:
    """The sleep given up at the snapshot's deadline still runs through the wake's: the
    wake fails saying so, calls nothing beside it, and the next one wakes the engine."""
    llm = SlowSleepLLM()
    vllm.install(llm, engine=rehydrate_engine, deadline=0.5)
    assert not rehydrate_engine.simulate_snapshot().ok
    llm.calls.clear()
    try:
        report = rehydrate_engine.simulate_restore(kind="resume")
        assert not report.ok
        assert re.fullmatch(
            r"vllm is_sleeping\(\): the engine's sleep\(\), given up at an earlier deadline, "
            r"is still running after another 0\.[0-9]+s \(the 0\.5s deadline\); not called "
            r"beside it, which could leave the engine asleep — the next hook waits for it "
            r"again", str(hook(report, "rehydrate.vllm.wake").error))
        assert llm.calls == []
    finally:
        llm.go.set()
    assert llm.slept.wait(5) and llm.engine.sleeping
    report = rehydrate_engine.simulate_restore(kind="resume")
    assert report.ok, report.table()
    assert not llm.engine.sleeping


def test_a_sleep_refused_after_a_gateways_504_is_checked_not_forgotten(
        url: str, server: tuple[str, Switch], standin: VLLMStandIn,
        rehydrate_engine: Any) -> None:
    """The sleep was performed and its answer lost (the gateway's 504); re-sent, the
    second try got a refusal. Read as never performed, the snapshot failed on an engine
    asleep and the sleep was no longer remembered as unconfirmed: /is_sleeping decides."""
    adapter = vllm.install(url, engine=rehydrate_engine, deadline=1)
    server[1].app, tries = retry_refused_after_a_504(standin, "/sleep")
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    assert standin.sleeping and not adapter.sleep_unconfirmed
    assert len(tries) == 2


def test_a_canary_whose_connection_was_cut_is_sent_again(
        url: str, standin: VLLMStandIn, rehydrate_engine: Any) -> None:
    """The one-token canary performed, its connection cut before the answer (a kept-alive
    connection closed under it): the required wake hook failed on one transient cut, and
    the restored server stayed not ready. A canary is safe to send again; it is."""
    vllm.install(url, engine=rehydrate_engine, deadline=5)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.cut["/v1/completions"] = 1
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log.count("POST /v1/completions") == 2 and standin.canaries == 2
    assert rehydrate_engine.is_ready()


def test_a_canary_cut_every_time_fails_the_wake_at_the_deadline_saying_so(
        url: str, standin: VLLMStandIn, rehydrate_engine: Any) -> None:
    vllm.install(url, engine=rehydrate_engine, deadline=0.5)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.cut["/v1/completions"] = 10**6
    report = rehydrate_engine.simulate_restore()
    error = str(hook(report, "rehydrate.vllm.wake").error)
    assert error.startswith(f"vllm POST {url}/v1/completions: connection lost before the "
                            "answer (RemoteProtocolError) (gave up after the 0.5s deadline)")
    assert standin.log.count("POST /v1/completions") >= 2
