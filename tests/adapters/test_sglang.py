"""rehydrate.adapters.sglang against an SGLang stand-in server (real uvicorn on loopback),
driven by an isolated engine's real snapshot and restore runs."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rehydrate.adapters import sglang
from rehydrate.adapters._server import Unconfirmed
from rehydrate.extensions import Probe
from tests.asgi_server import Switch, switchboard
from tests.inference_standins import (
    API_KEY,
    GATEWAY_ECHOES,
    EchoingGateway,
    LosingGateway,
    SGLangStandIn,
    retry_refused_after_a_504,
    trickling,
)
from tests.key_redaction import assert_the_key_is_shown_nowhere

ENVOY = "upstream connect error or disconnect/reset before headers. reset reason: "
# the upstream answered something Envoy could not parse: the request reached SGLang
ENVOY_RESET = ENVOY + "protocol error"
# nginx's 502 and Envoy's 503 for a pooled connection SGLang had closed (keep-alive race)
NOT_PASSED_ON = [(502, "upstream prematurely closed connection"),
                 (503, ENVOY + "connection termination"),
                 (503, ENVOY + "remote reset")]
INGRESS_NGINX_503 = ("<html>\r\n<head><title>503 Service Temporarily Unavailable</title>"
                     "</head>\r\n<body>\r\n<center><h1>503 Service Temporarily Unavailable"
                     "</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Switch]]:
    with switchboard() as board:
        yield board


@pytest.fixture
def url(server: tuple[str, Switch]) -> str:
    return server[0]


@pytest.fixture
def standin(server: tuple[str, Switch]) -> SGLangStandIn:
    server[1].app = standin = SGLangStandIn()
    return standin


def hook(report: Any, name: str) -> Any:
    return next(h for h in report.hooks if h.name == name)


def release_lost_before_performing(standin: SGLangStandIn) -> Any:
    """The stand-in behind a connection that loses the release before SGLang performs
    it: the request is held unanswered until the client gives up, and nothing is
    released (unlike ``standin.unanswered``, which performs it). Other paths pass on."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/release_memory_occupation":
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        await standin(scope, receive, send)

    return app


@pytest.mark.parametrize("tags", [None, ["kv_cache", "cuda_graph"]])
def test_release_then_resume_and_canary(url: str, standin: SGLangStandIn,
                                        rehydrate_engine: Any, tags: list[str] | None) -> None:
    sglang.install(url, engine=rehydrate_engine, tags=tags)
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    assert standin.log == ["GET /server_info", "POST /pause_generation",
                           "POST /release_memory_occupation"]
    assert standin.released == set(tags or SGLangStandIn.MEMORY) and standin.paused
    standin.log.clear()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log == ["POST /resume_memory_occupation", "POST /continue_generation",
                           "GET /health_generate"]
    assert standin.released == set() and standin.canaries == 1 and not standin.paused


def test_warns_when_the_memory_saver_is_off(url: str, server: Any, rehydrate_engine: Any,
                                            caplog: pytest.LogCaptureFixture) -> None:
    server[1].app = SGLangStandIn(memory_saver=False)
    sglang.install(url, engine=rehydrate_engine)
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert rehydrate_engine.simulate_snapshot().ok
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "SGLang runs without --enable-memory-saver: release/resume of GPU memory do "
        "nothing (the snapshot keeps the GPU state)"]


def test_canary_waits_while_the_server_is_starting(url: str, standin: SGLangStandIn,
                                                   rehydrate_engine: Any) -> None:
    sglang.install(url, engine=rehydrate_engine, deadline=10)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.starting = 2
    assert rehydrate_engine.simulate_restore().ok
    assert standin.log.count("GET /health_generate") == 3


def test_500_for_good_fails_the_snapshot_with_the_servers_reason(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any) -> None:
    sglang.install(url, engine=rehydrate_engine, deadline=1.5)
    standin.broken["/release_memory_occupation"] = (500, "scheduler is not idle")
    report = rehydrate_engine.simulate_snapshot()
    assert not report.ok
    release = hook(report, "rehydrate.sglang.release")
    assert str(release.error) == (f"sglang POST {url}/release_memory_occupation: HTTP 500: "
                                  "scheduler is not idle (gave up after the 1.5s deadline)")
    assert standin.log.count("POST /release_memory_occupation") > 1


@pytest.mark.parametrize("via", ["adapter", "install"])
def test_hanging_server_times_out_per_request_and_fails_at_the_deadline(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any, via: str) -> None:
    """A server that accepts and never answers: each GET is cut at request_timeout and
    retried, and the required hook fails once the deadline passed (never hangs)."""
    if via == "install":
        sglang.install(url, engine=rehydrate_engine, deadline=1.5, request_timeout=0.2)
    else:
        sglang.SGLangAdapter(url, deadline=1.5, request_timeout=0.2).install(rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.hang["/health_generate"] = 5
    t0 = time.monotonic()
    report = rehydrate_engine.simulate_restore()
    assert time.monotonic() - t0 < 5
    resume = hook(report, "rehydrate.sglang.resume")
    assert resume.outcome == "failed" and not report.ok
    assert re.fullmatch(rf"sglang GET {re.escape(url)}/health_generate: no answer within "
                        r"0\.[0-9]+s \(gave up after the 1\.5s deadline\)", str(resume.error))
    assert standin.log.count("GET /health_generate") >= 2  # retried


def test_a_release_slower_than_request_timeout_is_sent_once_and_waited_for(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any) -> None:
    """Re-sent on every request_timeout, a slow release would queue behind itself and
    the hook fail although the server released."""
    sglang.install(url, engine=rehydrate_engine, deadline=5, request_timeout=0.2)
    standin.hang["/release_memory_occupation"] = 0.6
    standin.hang["/resume_memory_occupation"] = 0.6
    assert rehydrate_engine.simulate_snapshot().ok
    assert standin.released == set(SGLangStandIn.MEMORY)
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log.count("POST /release_memory_occupation") == 1
    assert standin.log.count("POST /resume_memory_occupation") == 1
    assert standin.released == set() and standin.canaries == 1


def test_success_false_fails_with_the_message(url: str, standin: SGLangStandIn,
                                              rehydrate_engine: Any) -> None:
    sglang.install(url, engine=rehydrate_engine)
    standin.refuse = "release requires an idle server"
    report = rehydrate_engine.simulate_snapshot()
    assert str(hook(report, "rehydrate.sglang.release").error) == (
        f"sglang POST {url}/release_memory_occupation: the server says it failed: release "
        "requires an idle server")


def test_resume_without_a_release_only_checks(url: str, standin: SGLangStandIn,
                                              rehydrate_engine: Any) -> None:
    """Nothing was released by this process (e.g. its snapshot failed before): the
    restore does not resume (the server would refuse) but still runs the canary."""
    sglang.install(url, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_restore(kind="resume").ok
    assert standin.log == ["GET /health_generate"]


def test_failed_canary_leaves_the_process_degraded(url: str, standin: SGLangStandIn,
                                                   rehydrate_engine: Any) -> None:
    sglang.install(url, engine=rehydrate_engine, deadline=0.4)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.starting = 10**6  # never comes up
    report = rehydrate_engine.simulate_restore()
    assert str(hook(report, "rehydrate.sglang.resume").error) == (
        f"sglang GET {url}/health_generate: HTTP 503: empty body (gave up after the 0.4s deadline)")
    assert rehydrate_engine.state == "degraded"


def test_server_that_never_answers(rehydrate_engine: Any, refused_port: int) -> None:
    url = f"http://127.0.0.1:{refused_port}"
    sglang.install(url, engine=rehydrate_engine, deadline=0.3)
    report = rehydrate_engine.simulate_snapshot()
    assert str(hook(report, "rehydrate.sglang.release").error).startswith(
        f"sglang POST {url}/pause_generation: unreachable (ConnectError")
    assert sglang.SGLangAdapter(url).probe() == Probe(
        True, f"{url} is not ready yet (does not answer: ConnectError): installed anyway")


async def test_sync_and_asyncio_entry_points(url: str, standin: SGLangStandIn) -> None:
    adapter = sglang.SGLangAdapter(url, canary=False)
    await adapter.release_async()
    assert standin.released
    await adapter.resume_async()
    assert not standin.released
    with pytest.raises(RuntimeError, match="await the \\*_async variant instead"):
        adapter.release()


def test_sync_entry_points_and_probe(url: str, standin: SGLangStandIn) -> None:
    adapter = sglang.SGLangAdapter(url)
    adapter.release()
    adapter.resume()
    assert standin.canaries == 1
    assert adapter.probe() == Probe(True, f"{url}/health answers 200")


def test_bad_options(url: str) -> None:
    with pytest.raises(ValueError, match="unknown memory tag\\(s\\) 'gpu'; SGLang knows "
                                         "weights, kv_cache, cuda_graph"):
        sglang.SGLangAdapter(url, tags=["gpu"])
    assert sglang.SGLangAdapter(url, tags="kv_cache").tags == ["kv_cache"]  # one string: one tag
    with pytest.raises(TypeError, match="tags must be a list of tag names, not int"):
        sglang.SGLangAdapter(url, tags=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="canary must be True or False"):
        sglang.SGLangAdapter(url, canary="no")  # type: ignore[arg-type]


def test_a_release_that_went_unanswered_is_still_resumed(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any) -> None:
    """The server released, its answer never came: the snapshot fails, but the restore
    (or resume) must still send the resume, or the replica never generates again."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=1, request_timeout=0.2)
    standin.unanswered.add("/release_memory_occupation")
    snap = rehydrate_engine.simulate_snapshot()
    assert not snap.ok
    assert standin.released == set(SGLangStandIn.MEMORY)
    standin.unanswered.clear()
    report = rehydrate_engine.simulate_restore(kind="resume")
    assert report.ok, report.table()
    assert standin.log.count("POST /resume_memory_occupation") == 1
    assert standin.released == set() and standin.canaries == 1
    assert not adapter.released


def test_a_release_that_never_reached_the_server_refused_on_resume_is_no_failure(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any) -> None:
    """Unanswered, the release may not have happened either: from a server that refuses
    a resume of memory not released (SGLang 0.5 dies of it instead: see
    test_a_502_on_the_release_owes_no_resume), "not released" is the answer the resume
    hoped for."""
    sglang.install(url, engine=rehydrate_engine, deadline=1, request_timeout=0.2)
    standin.not_released = "memory occupation was not released"
    server[1].app = release_lost_before_performing(standin)
    assert not rehydrate_engine.simulate_snapshot().ok
    assert standin.released == set()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log == ["GET /server_info", "POST /pause_generation",
                           "POST /resume_memory_occupation", "POST /continue_generation",
                           "GET /health_generate"]


@pytest.mark.parametrize("canary", [True, False])
def test_a_resume_that_went_unanswered_is_never_sent_again(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any, canary: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    """The server resumed, its answer never came. Sent again by the next restore, the
    resume of memory already resumed killed SGLang 0.5 (its scheduler's KeyError): it is
    counted as performed — SGLang performs what reached it — generation is continued, and
    the canary, which runs after it, confirms it (without a canary the hook fails)."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=1, request_timeout=0.2,
                             canary=canary)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.unanswered.add("/resume_memory_occupation")
    standin.log.clear()
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        first = rehydrate_engine.simulate_restore()
    if canary:
        assert first.ok, first.table()
        assert "SGLang's resume went unanswered, but it generates" in caplog.messages
    else:
        assert str(hook(first, "rehydrate.sglang.resume").error).startswith(
            f"sglang POST {url}/resume_memory_occupation: no answer within")
    assert standin.log == ["POST /resume_memory_occupation", "POST /continue_generation",
                           *(["GET /health_generate"] if canary else [])]
    assert standin.released == set() and not standin.paused
    assert not adapter.released and not adapter.paused
    standin.unanswered.clear()
    standin.log.clear()
    assert rehydrate_engine.simulate_restore().ok
    assert standin.log == (["GET /health_generate"] if canary else [])
    assert standin.crashed is None


def test_a_confirmed_release_refused_on_resume_still_fails(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any) -> None:
    sglang.install(url, engine=rehydrate_engine, deadline=1)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.not_released = "memory occupation was not released"
    standin.released.clear()  # resumed behind the adapter's back
    report = rehydrate_engine.simulate_restore()
    assert str(hook(report, "rehydrate.sglang.resume").error) == (
        f"sglang POST {url}/resume_memory_occupation: HTTP 400: memory occupation was not released")


@pytest.mark.parametrize("refusal", ["success false", "error status"])
def test_a_refused_release_is_not_resumed(url: str, standin: SGLangStandIn,
                                          rehydrate_engine: Any, refusal: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """SGLang answered the release with a failure: nothing was released, so the restore
    sends no resume (which SGLang would refuse) and only checks generation."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.5)
    if refusal == "success false":
        standin.refused["/release_memory_occupation"] = "server is not idle"
    else:
        standin.broken["/release_memory_occupation"] = (400, "server is not idle")
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        assert not rehydrate_engine.simulate_snapshot().ok
        assert not adapter.released and not adapter.unconfirmed
        standin.refused.clear()
        standin.broken.clear()
        standin.log.clear()
        report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    # the pause before the refused release is still continued
    assert standin.log == ["POST /continue_generation", "GET /health_generate"]
    assert not standin.paused
    messages = [r.getMessage() for r in caplog.records]
    assert ("SGLang did not release its memory (the release was refused or never sent): "
            "the next resume only checks generation") in messages
    assert "SGLang generating" in messages
    assert not [m for m in messages if "memory resumed" in m], "nothing was resumed"
    assert not [m for m in messages if "went unanswered" in m]


def test_a_refused_release_after_a_confirmed_one_still_owes_the_resume(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any) -> None:
    """Memory released before (and not resumed yet) is not released again — that would
    end SGLang — and is still resumed, whatever a later release attempt meets."""
    adapter = sglang.SGLangAdapter(url, canary=False, deadline=0.5)
    adapter.release()
    standin.refused["/release_memory_occupation"] = "already released"
    adapter.release()
    assert standin.log.count("POST /release_memory_occupation") == 1
    assert adapter.released
    adapter.resume()
    assert standin.released == set()


@pytest.mark.parametrize("wording", [
    "memory occupation was not released",
    "Memory has not been released yet",
    "release_memory_occupation was never called: nothing to resume",
    "memory is already resumed",
    "region is not paused",
])
def test_not_released_is_recognised_in_its_wordings(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any, wording: str) -> None:
    """After a release that may not have happened, SGLang's "nothing is released" is the
    state the resume wanted, however it is phrased: the restore does not fail over it."""
    sglang.install(url, engine=rehydrate_engine, deadline=1, request_timeout=0.2)
    standin.not_released = wording
    server[1].app = release_lost_before_performing(standin)
    assert not rehydrate_engine.simulate_snapshot().ok
    server[1].app = standin
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log[-3:] == ["POST /resume_memory_occupation", "POST /continue_generation",
                                "GET /health_generate"]


@pytest.mark.parametrize("echo", [*GATEWAY_ECHOES, "refusal quoting the key"])
def test_the_api_key_echoed_by_a_gateway_is_shown_nowhere(
        url: str, server: tuple[str, Switch], rehydrate_engine: Any,
        caplog: pytest.LogCaptureFixture, echo: str) -> None:
    """A gateway echoing the Authorization header in its answers: the reasons quoted in
    errors, logs, the status and /readyz's 503 carry no trace of the adapter's key."""
    def answer(path: str, auth: str) -> tuple[int, Any]:
        if echo == "refusal quoting the key":
            return 200, {"success": False, "message": f"denied for {auth}"}
        return GATEWAY_ECHOES[echo](auth)  # type: ignore[no-any-return]

    server[1].app = gateway = EchoingGateway(answer)
    adapter = sglang.install(url, engine=rehydrate_engine, api_key=API_KEY, deadline=0.3)
    snap, _ = assert_the_key_is_shown_nowhere(rehydrate_engine, adapter, gateway, caplog,
                                              adapter.release, sglang.ServerError)
    assert not snap.ok


@pytest.mark.parametrize("status", [504, 503])
def test_a_gateways_504_on_a_performed_release_is_not_resent_and_still_resumed(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any, status: int) -> None:
    """A gateway whose timeout is shorter than the release: SGLang released, the adapter
    got the gateway's 504 (or Envoy's 503 "disconnect/reset before headers"). Re-sent on
    it, the release was performed again and again, and the refusal restored ``released``
    to False: no resume was ever sent, and every restore failed at the canary for good."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=2)
    message = LosingGateway.MESSAGES[504] if status == 504 else ENVOY_RESET
    server[1].app = LosingGateway(standin, {"/release_memory_occupation"}, status=status,
                                  message=message)
    snap = rehydrate_engine.simulate_snapshot()
    assert not snap.ok
    assert str(hook(snap, "rehydrate.sglang.release").error) == (
        f"sglang POST {url}/release_memory_occupation: HTTP {status}: "
        f"{message}; not sent again: the server behind the gateway may "
        f"have performed it (point url= at the server, or give the gateway a timeout above "
        f"the 2s deadline)")
    assert standin.log.count("POST /release_memory_occupation") == 1
    assert standin.released == set(SGLangStandIn.MEMORY)
    assert adapter.released and adapter.unconfirmed
    for _ in range(2):  # the gateway stays: only the release goes through it
        report = rehydrate_engine.simulate_restore()
        assert report.ok, report.table()
        assert standin.released == set() and not standin.paused
    assert standin.log.count("POST /resume_memory_occupation") == 1
    assert standin.canaries == 2


def test_a_502_on_the_release_owes_no_resume(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any) -> None:
    """nginx's 502 "connect() failed (111: Connection refused)": the release never
    reached SGLang. Taken as unconfirmed, it owed a resume, and the resume of memory never
    released killed SGLang 0.5 (its scheduler's KeyError). A 502 on a release counts as
    not passed on: retried until the deadline, then nothing is owed."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.5)
    server[1].app = LosingGateway(standin, {"/release_memory_occupation"}, status=502,
                                  performed=False)
    snap = rehydrate_engine.simulate_snapshot()
    assert str(hook(snap, "rehydrate.sglang.release").error) == (
        f"sglang POST {url}/release_memory_occupation: HTTP 502: upstream prematurely closed "
        "connection (gave up after the 0.5s deadline)")
    assert "POST /release_memory_occupation" not in standin.log
    assert not adapter.released and not adapter.unconfirmed
    report = rehydrate_engine.simulate_restore(kind="resume")
    assert "POST /resume_memory_occupation" not in standin.log
    assert standin.crashed is None
    assert report.ok, report.table()


def test_memory_still_released_is_not_released_again(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """A resume that failed leaves the memory released: the next snapshot's release was
    a second one, which ends SGLang (torch_memory_saver exits). The skip is a WARNING:
    the snapshot keeps whatever GPU memory is not released."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.5)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.broken["/resume_memory_occupation"] = (500, "resume failed")
    assert not rehydrate_engine.simulate_restore().ok
    assert adapter.released
    caplog.clear()
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    assert standin.crashed is None
    assert standin.log.count("POST /release_memory_occupation") == 1
    assert [r.levelno for r in caplog.records if "not released again" in r.getMessage()] \
        == [logging.WARNING]
    standin.broken.clear()
    assert rehydrate_engine.simulate_restore().ok
    assert standin.released == set() and not standin.paused


def test_a_resume_nothing_listened_for_leaves_nothing_released(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any, refused_port: int) -> None:
    """SGLang died after the release: every resume try is refused (no HTTP status at
    all). Its supervisor starts a fresh one, with nothing released. Still taken as
    released, the next snapshot skipped the release — the snapshot held the GPU memory —
    and every clone's resume of memory never released killed SGLang (KeyError)."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.3)
    assert rehydrate_engine.simulate_snapshot().ok
    adapter.url = f"http://127.0.0.1:{refused_port}"  # SGLang gone: connection refused
    report = rehydrate_engine.simulate_restore()
    assert "ConnectError" in str(hook(report, "rehydrate.sglang.resume").error)
    assert not adapter.released and not adapter.unconfirmed
    adapter.url = url
    server[1].app = fresh = SGLangStandIn()  # restarted: nothing released
    assert rehydrate_engine.simulate_snapshot().ok
    assert "POST /release_memory_occupation" in fresh.log
    assert fresh.released == set(SGLangStandIn.MEMORY)
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert fresh.crashed is None and fresh.released == set()


@pytest.mark.parametrize("status,message", [
    *NOT_PASSED_ON, (503, ENVOY + "connection failure"), (503, "no healthy upstream"),
    (503, '{"message": "no healthy upstream"}'), (503, INGRESS_NGINX_503)])
def test_a_resume_only_a_gateway_answered_does_not_skip_the_next_release(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any, status: int, message: str) -> None:
    """Behind a gateway: its 502 "connect() failed (111: Connection refused)" (or Envoy's
    503 for a connection that failed or closed, or for no healthy upstream while SGLang's
    Pod restarts, or ingress-nginx's 503 page) until the deadline — SGLang itself never
    answered the resume, and the one restarted in its place has nothing released. The
    next release is sent (the resume stays owed until then: SGLang may be alive)."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.3)
    assert rehydrate_engine.simulate_snapshot().ok
    server[1].app = LosingGateway(standin, {"/resume_memory_occupation"}, status=status,
                                  performed=False, message=message)
    assert not rehydrate_engine.simulate_restore().ok
    assert adapter.released  # owed while SGLang may still be alive behind the gateway
    server[1].app = fresh = SGLangStandIn()  # restarted: nothing released
    for _ in range(2):
        assert rehydrate_engine.simulate_snapshot().ok
        assert fresh.released == set(SGLangStandIn.MEMORY)
        report = rehydrate_engine.simulate_restore()
        assert report.ok, report.table()
        assert fresh.crashed is None and fresh.released == set()
    assert fresh.log.count("POST /release_memory_occupation") == 2


def test_sglangs_own_503_on_the_resume_keeps_the_next_release_skipped(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any) -> None:
    """A 503 with a JSON body is SGLang's own answer (a gateway's 503 page is not JSON):
    its memory is still released, and a second release would end it."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.3)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.broken["/resume_memory_occupation"] = (503, "scheduler busy")
    assert not rehydrate_engine.simulate_restore().ok
    assert adapter.released and not adapter.unheard
    assert rehydrate_engine.simulate_snapshot().ok
    assert standin.crashed is None
    assert standin.log.count("POST /release_memory_occupation") == 1
    standin.broken.clear()
    assert rehydrate_engine.simulate_restore().ok
    assert standin.released == set()


class _DroppedSyns(httpx.AsyncHTTPTransport):
    """A network that drops the connection attempts to ``paths`` (a partition, a firewall
    blackhole): each try ends in a connect timeout, the server behind never sees it."""

    def __init__(self, paths: set[str]) -> None:
        super().__init__()
        self.paths = paths

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in self.paths:
            raise httpx.ConnectTimeout("timed out", request=request)
        return await super().handle_async_request(request)


def test_a_resume_that_found_no_connection_in_time_keeps_the_next_release_skipped(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every resume try timed out connecting, SGLang alive behind with its memory
    released: nothing says it is gone. Taken as unheard, the next snapshot released it
    again, which ends SGLang (torch_memory_saver exits)."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.3)
    assert rehydrate_engine.simulate_snapshot().ok
    dropped = _DroppedSyns({"/resume_memory_occupation"})
    client = adapter.client

    def through_the_partition() -> httpx.AsyncClient:
        c = client()
        c._transport = dropped
        return c

    monkeypatch.setattr(adapter, "client", through_the_partition)
    report = rehydrate_engine.simulate_restore()
    assert "no connection within" in str(hook(report, "rehydrate.sglang.resume").error)
    assert adapter.released and not adapter.unheard
    dropped.paths.clear()  # the network is back
    assert rehydrate_engine.simulate_snapshot().ok
    assert standin.crashed is None
    assert standin.log.count("POST /release_memory_occupation") == 1
    assert rehydrate_engine.simulate_restore().ok
    assert standin.crashed is None and standin.released == set()


def test_a_502_after_sglang_performed_the_release_kills_it_when_sent_again(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any) -> None:
    """The cost of the rule above, accepted and documented (docs/inference.md): SGLang
    alive, the connection broken between its release and its answer. Sent again, the
    second release of memory already released ends SGLang (torch_memory_saver's "Cannot
    pause allocation that is not active", exit(1)); taken as performed instead, every
    far likelier 502 for a release never passed on would end it with the resume."""
    sglang.install(url, engine=rehydrate_engine, deadline=2)
    server[1].app = LosingGateway(standin, {"/release_memory_occupation"}, status=502,
                                  times=1, performed=True)
    assert not rehydrate_engine.simulate_snapshot().ok
    assert standin.log.count("POST /release_memory_occupation") == 2
    assert standin.crashed == ("torch_memory_saver: Cannot pause allocation that is not "
                               "active")


@pytest.mark.parametrize("status,message", NOT_PASSED_ON)
def test_a_502_on_the_release_once_is_sent_again(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any, status: int, message: str) -> None:
    """Envoy's 503 "connection termination" / "remote reset" is nginx's 502 for the same
    keep-alive race (istio/istio#55138): taken as performed, the release owed a resume of
    memory never released, which killed SGLang."""
    sglang.install(url, engine=rehydrate_engine, deadline=5)
    server[1].app = LosingGateway(standin, {"/release_memory_occupation"}, status=status,
                                  times=1, performed=False, message=message)
    assert rehydrate_engine.simulate_snapshot().ok
    assert standin.log.count("POST /release_memory_occupation") == 1  # the second
    assert standin.released == set(SGLangStandIn.MEMORY)
    assert rehydrate_engine.simulate_restore().ok
    assert standin.released == set() and standin.crashed is None


@pytest.mark.parametrize("status,message", NOT_PASSED_ON)
def test_a_release_ending_on_a_gateway_that_never_passed_it_on_owes_no_resume(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any, status: int, message: str) -> None:
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.3)
    server[1].app = LosingGateway(standin, {"/release_memory_occupation"}, status=status,
                                  performed=False, message=message)
    assert not rehydrate_engine.simulate_snapshot().ok
    assert not adapter.released
    server[1].app = standin
    report = rehydrate_engine.simulate_restore(kind="resume")
    assert report.ok, report.table()
    assert "POST /resume_memory_occupation" not in standin.log
    assert standin.crashed is None


@pytest.mark.parametrize("status,message", NOT_PASSED_ON)
def test_a_resume_a_gateway_never_passed_on_is_sent_again(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any, status: int, message: str) -> None:
    """Taken as performed, the resume was never sent again: SGLang kept its memory
    released, and every later restore failed at the canary."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=5)
    assert rehydrate_engine.simulate_snapshot().ok
    server[1].app = LosingGateway(standin, {"/resume_memory_occupation"}, status=status,
                                  times=1, performed=False, message=message)
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log.count("POST /resume_memory_occupation") == 1
    assert standin.released == set() and not adapter.released
    assert standin.crashed is None


def test_a_503_on_a_release_is_sent_again(url: str, server: tuple[str, Switch],
                                          standin: SGLangStandIn,
                                          rehydrate_engine: Any) -> None:
    """A 503 says the request was not handled (a server's own, or a gateway's "no healthy
    upstream"): the release is sent again, and performed once."""
    sglang.install(url, engine=rehydrate_engine, deadline=5)
    server[1].app = LosingGateway(standin, {"/release_memory_occupation"}, status=503,
                                  times=2, performed=False)
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    assert standin.log.count("POST /release_memory_occupation") == 1
    assert standin.released == set(SGLangStandIn.MEMORY)


def test_a_gateways_504_on_a_performed_resume_still_continues_generation(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any) -> None:
    """SGLang resumed, the gateway answered 504: the continue was skipped and SGLang
    stayed paused for good (every generation waiting behind the pause). SGLang takes the
    calls in order, so the continue is sent anyway, and the canary confirms the resume."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=2)
    assert rehydrate_engine.simulate_snapshot().ok
    server[1].app = LosingGateway(standin, {"/resume_memory_occupation"}, times=1)
    standin.log.clear()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log == ["POST /resume_memory_occupation", "POST /continue_generation",
                           "GET /health_generate"]
    assert standin.released == set() and not standin.paused and not adapter.paused
    assert standin.canaries == 1 and not adapter.released


def test_a_pause_stays_owed_with_a_warning_when_the_resume_is_refused(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.5)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.broken["/resume_memory_occupation"] = (500, "resume failed")
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert not rehydrate_engine.simulate_restore().ok
    assert "POST /continue_generation" not in standin.log and adapter.paused
    assert f"SGLang at {url} stays paused: its memory was not resumed, so generation is " \
           "not continued (the next resume continues it)" in caplog.messages
    standin.broken.clear()
    assert rehydrate_engine.simulate_restore().ok
    assert not standin.paused and standin.released == set()


def test_a_continue_that_fails_after_an_unconfirmed_resume_is_warned_about(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.5, request_timeout=0.5)
    assert rehydrate_engine.simulate_snapshot().ok
    server[1].app = LosingGateway(standin, {"/resume_memory_occupation"}, times=1)
    standin.broken["/continue_generation"] = (500, "scheduler error")
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert not rehydrate_engine.simulate_restore().ok
    assert adapter.paused and standin.paused and standin.released == set()
    assert [m for m in caplog.messages if m.startswith(
        f"SGLang at {url} stays paused: /continue_generation failed (sglang POST "
        f"{url}/continue_generation: HTTP 500: scheduler error")]


@pytest.mark.parametrize("status", [502, 504])
def test_pause_and_continue_are_sent_again_after_a_gateways_502_or_504(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any, status: int) -> None:
    """A second pause or continue changes nothing: both are re-sent after a gateway lost
    the answer, and the snapshot and restore succeed."""
    sglang.install(url, engine=rehydrate_engine, deadline=3)
    server[1].app = LosingGateway(standin, {"/pause_generation", "/continue_generation"},
                                  status=status, times=1)
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log.count("POST /pause_generation") == 2
    assert standin.log.count("POST /continue_generation") == 2
    assert not standin.paused and standin.canaries == 1


def test_generation_is_paused_before_the_release_and_continued_after_the_resume(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any) -> None:
    """Requests sent to SGLang directly (a supervisor beside it: no gate drains them)
    are running at the snapshot: SGLang's release asserts an idle scheduler, so the
    adapter pauses generation first (abort mode) and continues it after the resume —
    before the canary, whose generation would wait behind the pause."""
    sglang.install(url, engine=rehydrate_engine, deadline=1)
    standin.running = 2
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    assert standin.log == ["GET /server_info", "POST /pause_generation",
                           "POST /release_memory_occupation"]
    assert standin.aborted == 2 and standin.paused
    assert standin.released == set(SGLangStandIn.MEMORY)
    standin.log.clear()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log == ["POST /resume_memory_occupation", "POST /continue_generation",
                           "GET /health_generate"]
    assert not standin.paused and standin.canaries == 1


def test_a_server_without_the_pause_endpoints_is_released_after_one_info_line(
        url: str, server: tuple[str, Switch], rehydrate_engine: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    server[1].app = standin = SGLangStandIn(pause_endpoints=False)
    adapter = sglang.install(url, engine=rehydrate_engine)
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        assert rehydrate_engine.simulate_snapshot().ok
        assert not adapter.paused
        report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.log == ["GET /server_info", "POST /pause_generation",
                           "POST /release_memory_occupation",
                           "POST /resume_memory_occupation", "GET /health_generate"]
    assert [r.getMessage() for r in caplog.records if "pause" in r.getMessage()] == [
        f"SGLang at {url} has no /pause_generation (HTTP 404): generation is not paused "
        "before the release; only a drain in front of the server (ReadinessGate) keeps its "
        "scheduler idle"]


def test_a_refused_pause_fails_the_snapshot_without_releasing(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any) -> None:
    """Released on a busy scheduler, SGLang's assertion fails: a pause that did not
    happen stops the release, and nothing is owed afterwards but the canary."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.5)
    standin.broken["/pause_generation"] = (500, "scheduler error")
    snap = rehydrate_engine.simulate_snapshot()
    assert str(hook(snap, "rehydrate.sglang.release").error) == (
        f"sglang POST {url}/pause_generation: HTTP 500: scheduler error (gave up after the "
        "0.5s deadline)")
    assert "POST /release_memory_occupation" not in standin.log
    assert not adapter.paused and not adapter.released
    standin.broken.clear()
    standin.log.clear()
    assert rehydrate_engine.simulate_restore().ok
    assert standin.log == ["GET /health_generate"]


def test_running_requests_at_the_release_without_a_pause_kill_the_stand_in_as_sglang(
        url: str, server: tuple[str, Switch], rehydrate_engine: Any) -> None:
    """The stand-in dies as SGLang does (its scheduler's assertion ends the server), so a
    test that releases on a busy scheduler cannot pass on a polite refusal."""
    server[1].app = standin = SGLangStandIn(pause_endpoints=False)
    standin.running = 1
    sglang.install(url, engine=rehydrate_engine, deadline=0.5)
    assert not rehydrate_engine.simulate_snapshot().ok
    assert standin.crashed is not None and standin.crashed.startswith("AssertionError")


def test_a_server_info_trickling_in_does_not_hold_the_release(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn) -> None:
    stop, ended = threading.Event(), threading.Event()
    server[1].app = trickling(standin, "/server_info", stop, ended)
    adapter = sglang.SGLangAdapter(url, canary=False, request_timeout=0.3)
    try:
        adapter.release()
        assert not ended.is_set(), "the release waited for the whole answer"
    finally:
        stop.set()
    assert standin.released == set(SGLangStandIn.MEMORY)


def test_a_health_answer_trickling_in_does_not_hold_the_probe(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn) -> None:
    """Lifecycle(extensions=[SGLangAdapter(url)]) probes in its constructor: it never
    returned while a broken proxy trickled /health."""
    stop, ended = threading.Event(), threading.Event()
    server[1].app = trickling(standin, "/health", stop, ended)
    try:
        found = sglang.SGLangAdapter(url, request_timeout=0.3).probe()
        assert not ended.is_set(), "the probe waited for the whole answer"
    finally:
        stop.set()
    assert found == Probe(True, f"{url} is not ready yet (no complete answer within 0.3s): "
                                "installed anyway")


def test_the_confirmation_of_an_unanswered_resume_gets_request_timeout_of_its_own(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """The resume used the whole deadline without an answer: the continue and the canary
    got one 0.5 s try, and SGLang's /health_generate waits a second before it first
    looks for its token (http_server.py), so a resume SGLang performed failed the hook.
    The hook's own timeout (deadline + 5 s) makes room for it too."""
    sglang.install(url, engine=rehydrate_engine, deadline=0.3, request_timeout=6)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.unanswered.add("/resume_memory_occupation")  # performed, never answered
    standin.hang["/health_generate"] = 5.2  # past the hook timeout of deadline + 5 s
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.released == set() and standin.canaries == 1
    assert [m for m in caplog.messages if m.startswith(
        f"SGLang at {url}: the resume went unanswered (sglang POST "
        f"{url}/resume_memory_occupation: no answer within")
        and m.endswith("taken as performed, not sent again: the continue and the canary "
                       "confirm it")]


def test_a_failed_confirmation_of_an_unanswered_resume_is_chained_to_it(
        url: str, standin: SGLangStandIn, rehydrate_engine: Any) -> None:
    sglang.install(url, engine=rehydrate_engine, deadline=0.3, request_timeout=0.3)
    assert rehydrate_engine.simulate_snapshot().ok
    standin.unanswered.add("/resume_memory_occupation")
    standin.broken["/health_generate"] = (500, "generation failed")
    report = rehydrate_engine.simulate_restore()
    error = hook(report, "rehydrate.sglang.resume").error
    assert "generation failed" in str(error)
    assert isinstance(error.__cause__, Unconfirmed)
    assert "/resume_memory_occupation" in str(error.__cause__)


@pytest.mark.parametrize("status,body,says", [
    (401, "<html><head><title>401 Authorization Required</title></head></html>",
     "HTTP 401 from a gateway in front of SGLang, not SGLang (its own authentication: "
     "<html><head><title>401 Authorization Required</title></head></html>) — the call did "
     "not reach SGLang; give the adapter credentials the gateway accepts (api_key= is sent "
     "as a bearer token) or point url= at SGLang itself"),
    (403, "RBAC: access denied",
     "HTTP 403 from a gateway in front of SGLang, not SGLang (its own authentication: RBAC: "
     "access denied) — the call did not reach SGLang; give the adapter credentials the "
     "gateway accepts (api_key= is sent as a bearer token) or point url= at SGLang itself"),
    (401, {"message": "No API key found in request"},
     "HTTP 401 from a gateway in front of SGLang, not SGLang (its own authentication: No API "
     "key found in request) — the call did not reach SGLang; give the adapter credentials "
     "the gateway accepts (api_key= is sent as a bearer token) or point url= at SGLang "
     "itself"),
    (407, "Proxy Authentication Required",
     "HTTP 407 from a proxy between this process and SGLang, not SGLang (Proxy "
     "Authentication Required: Proxy Authentication Required) — the call did not reach "
     "SGLang; give the proxy its credentials (HTTPS_PROXY / HTTP_PROXY) or exempt the host "
     "with NO_PROXY"),
    (401, {"error": "Unauthorized"},  # SGLang's own --api-key middleware
     "HTTP 401: Unauthorized — SGLang refused the API key: pass api_key= matching its "
     "--admin-api-key if it has one (SGLang then takes only that key on its memory and "
     "pause endpoints), else its --api-key"),
])
def test_an_authentication_refusal_says_whose_it_is(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn, rehydrate_engine: Any,
        status: int, body: Any, says: str) -> None:
    """A gateway's own 401 / 403 (or a proxy's 407) read as SGLang's refusal: nothing in
    the error said the release never reached SGLang, nor that the credentials to fix are
    the gateway's."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.5)
    server[1].app = EchoingGateway(
        lambda path, auth: (status, body) if path == "/release_memory_occupation" else None,
        behind=standin)
    snap = rehydrate_engine.simulate_snapshot()
    assert str(hook(snap, "rehydrate.sglang.release").error) == (
        f"sglang POST {url}/release_memory_occupation: {says}")
    assert not adapter.released and standin.released == set()
    assert "POST /release_memory_occupation" not in standin.log


@pytest.mark.parametrize(("body", "says"), [
    ("<html>401 Authorization Required</html>",
     " from a gateway in front of SGLang, not SGLang (its own authentication: <html>401 "
     "Authorization Required</html>) — the call did not reach SGLang; give the adapter "
     "credentials the gateway accepts (api_key= is sent as a bearer token) or point url= "
     "at SGLang itself"),
    ({"error": "Unauthorized"},  # SGLang's own --api-key middleware
     ": Unauthorized — SGLang refused the API key: pass api_key= matching its --api-key"),
])
def test_probe_says_whose_401_it_is(url: str, server: tuple[str, Switch],
                                     standin: SGLangStandIn, body: Any, says: str) -> None:
    """The probe's /health refused: worded as the hooks' calls word it (before: "answers
    HTTP 401: <the gateway's page>", whoever refused)."""
    server[1].app = EchoingGateway(
        lambda path, auth: (401, body) if path == "/health" else None, behind=standin)
    found = sglang.SGLangAdapter(url).probe()
    assert not found.usable
    assert found.reason == f"{url}/health answers HTTP 401{says}"


def test_sglangs_admin_key_refusal_names_the_admin_key(
        url: str, server: tuple[str, Switch], rehydrate_engine: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """SGLang started with --api-key and --admin-api-key takes only the admin key on its
    memory and pause endpoints (ADMIN_OPTIONAL) and refuses the other with its own 401:
    the message said "pass api_key= matching its --api-key" — the key already passed."""
    server[1].app = standin = SGLangStandIn(api_key="normal-key-123",
                                            admin_api_key="admin-key-456")
    adapter = sglang.install(url, engine=rehydrate_engine, api_key="normal-key-123",
                             deadline=0.5)
    snap = rehydrate_engine.simulate_snapshot()
    assert str(hook(snap, "rehydrate.sglang.release").error) == (
        f"sglang POST {url}/pause_generation: HTTP 401: Unauthorized — SGLang refused the "
        "API key: pass api_key= matching its --admin-api-key if it has one (SGLang then "
        "takes only that key on its memory and pause endpoints), else its --api-key")
    assert not adapter.paused and standin.log == ["GET /server_info"]
    # the admin key, as the message says: snapshot and restore pass (only /server_info,
    # a look for the memory saver's warning, takes the other key and is skipped)
    adapter = sglang.install(url, engine=rehydrate_engine, api_key="admin-key-456",
                             deadline=0.5)
    assert rehydrate_engine.simulate_snapshot().ok
    assert standin.released == set(SGLangStandIn.MEMORY) and standin.paused
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.released == set() and not standin.paused and standin.canaries == 1


def test_a_gateways_refusal_of_the_resume_leaves_the_next_release_sent(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any) -> None:
    """The resume met only a gateway's 502s (SGLang may be gone: the next release is
    sent), then, at the next restore, the gateway's own 401. Taken as SGLang's answer,
    it said the memory was still released: the next release was skipped, the snapshot
    held the GPU memory of the restarted SGLang, and the resume after it killed it."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.3)
    assert rehydrate_engine.simulate_snapshot().ok
    server[1].app = LosingGateway(standin, {"/resume_memory_occupation"}, status=502,
                                  performed=False)
    assert not rehydrate_engine.simulate_restore().ok
    assert adapter.released and adapter.unheard
    server[1].app = EchoingGateway(
        lambda path, auth: ((401, "Unauthorized") if path == "/resume_memory_occupation"
                            else None), behind=standin)
    assert not rehydrate_engine.simulate_restore().ok
    assert adapter.released and adapter.unheard
    server[1].app = fresh = SGLangStandIn()  # restarted: nothing released
    assert rehydrate_engine.simulate_snapshot().ok
    assert fresh.released == set(SGLangStandIn.MEMORY)
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert fresh.crashed is None and fresh.released == set()


def test_a_gateways_refusal_saying_not_released_is_not_sglangs(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any) -> None:
    """After an unanswered release (performed), a gateway's 403 whose text happens to say
    "not released" was SGLang's "nothing to resume": the resume counted as done and the
    memory stayed released for good."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.5, request_timeout=0.2)
    standin.unanswered.add("/release_memory_occupation")
    assert not rehydrate_engine.simulate_snapshot().ok
    standin.unanswered.clear()
    assert standin.released == set(SGLangStandIn.MEMORY)
    server[1].app = EchoingGateway(
        lambda path, auth: ((403, "this route is not released for your client")
                            if path == "/resume_memory_occupation" else None),
        behind=standin)
    assert not rehydrate_engine.simulate_restore().ok
    assert adapter.released
    server[1].app = standin
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert standin.released == set() and standin.crashed is None


def test_a_pause_refused_after_a_gateways_504_stays_owed(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any) -> None:
    """The pause was performed and its answer lost (the gateway's 504); re-sent, the
    second try was refused. Read as never performed, the pause was forgotten: the
    restore sent no continue and SGLang stayed paused for good (every canary 503)."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=1)
    server[1].app, _ = retry_refused_after_a_504(standin, "/pause_generation")
    snap = rehydrate_engine.simulate_snapshot()
    error = hook(snap, "rehydrate.sglang.release").error
    assert isinstance(error, Unconfirmed)
    assert str(error).endswith("; an earlier try got a gateway's 502 / 504: the server may "
                               "have performed it")
    assert standin.paused and adapter.paused
    assert "POST /release_memory_occupation" not in standin.log
    server[1].app = standin
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert not standin.paused and not adapter.paused and standin.canaries == 1


@pytest.mark.parametrize("status", [502, 504])
def test_no_pause_endpoints_behind_a_gateway_502_or_504_is_no_failure(
        url: str, server: tuple[str, Switch], rehydrate_engine: Any,
        caplog: pytest.LogCaptureFixture, status: int) -> None:
    """SGLang without the pause endpoints behind nginx: the pause's first try got a
    gateway's 502 (a keep-alive connection SGLang had closed), the re-sent one SGLang's
    404. Taken as "the earlier try may have been paused", the snapshot failed, the
    adapter owed a continue to a server that has none, and the restore failed on the
    same 502-then-404 with "stays paused". A 404 says no try was performed."""
    standin = SGLangStandIn(pause_endpoints=False)
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=3)
    server[1].app = LosingGateway(standin, {"/pause_generation"}, status=status, times=1,
                                  performed=False)
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        snap = rehydrate_engine.simulate_snapshot()
    assert snap.ok, snap.table()
    assert standin.log.count("POST /pause_generation") == 1  # the re-sent try
    assert standin.released == set(SGLangStandIn.MEMORY) and not adapter.paused
    assert f"SGLang at {url} has no /pause_generation (HTTP 404): generation is not " \
        "paused before the release; only a drain in front of the server (ReadinessGate) " \
        "keeps its scheduler idle" in caplog.messages
    # a continue still owed from before (a pause this process sent to an SGLang since
    # replaced by one without the endpoints) meets the same 502, then the 404
    adapter.paused = True
    server[1].app = LosingGateway(standin, {"/continue_generation"}, status=status,
                                  times=1, performed=False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert not adapter.paused and standin.released == set() and standin.canaries == 1
    assert f"SGLang at {url} has no /continue_generation (HTTP 404): not continued" in \
        caplog.messages
    assert not [m for m in caplog.messages if "stays paused" in m]


def test_sglangs_own_api_key_refusal_of_a_resent_pause_owes_no_continue(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any) -> None:
    """The pause's first try got a gateway's 502, the re-sent one SGLang's own 401 (its
    --api-key check, which the first try met as well): nothing was paused, so the failed
    snapshot owes no continue."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=1)
    sglang_checking_its_key = EchoingGateway(
        lambda path, auth: ((401, {"error": "Unauthorized"})
                            if path == "/pause_generation" else None), behind=standin)
    server[1].app = LosingGateway(sglang_checking_its_key, {"/pause_generation"},
                                  status=502, times=1, performed=False)
    snap = rehydrate_engine.simulate_snapshot()
    error = hook(snap, "rehydrate.sglang.release").error
    assert type(error) is sglang.ServerError
    assert str(error).startswith(f"sglang POST {url}/pause_generation: HTTP 401: "
                                 "Unauthorized — SGLang refused the API key: ")
    assert not adapter.paused and not standin.paused
    server[1].app = standin
    standin.log.clear()
    assert rehydrate_engine.simulate_restore().ok
    assert standin.log == ["GET /health_generate"]


@pytest.mark.parametrize("before", ["nothing released", "resume unheard"])
def test_a_release_resent_after_a_502_and_refused_leaves_what_it_found(
        url: str, server: tuple[str, Switch], standin: SGLangStandIn,
        rehydrate_engine: Any, before: str) -> None:
    """A release is re-sent only after answers saying it was not passed on (502, Envoy's
    "no healthy upstream", a 503 page), and SGLang refuses it before its scheduler (an
    exception there ends SGLang): the refusal changed nothing, so the state the release
    found stands — no resume owed for it, and a resume still owed from before is sent."""
    adapter = sglang.install(url, engine=rehydrate_engine, deadline=0.5)
    if before == "resume unheard":
        assert rehydrate_engine.simulate_snapshot().ok
        server[1].app = LosingGateway(standin, {"/resume_memory_occupation"}, status=502,
                                      performed=False)
        assert not rehydrate_engine.simulate_restore().ok
        assert adapter.released and adapter.unheard
    found = adapter.released, adapter.unconfirmed, adapter.unheard
    standin.refused["/release_memory_occupation"] = "server is busy"
    server[1].app = LosingGateway(standin, {"/release_memory_occupation"}, status=502,
                                  times=1, performed=False)
    standin.log.clear()
    assert not rehydrate_engine.simulate_snapshot().ok
    assert standin.log.count("POST /release_memory_occupation") == 1  # the re-sent try
    assert (adapter.released, adapter.unconfirmed, adapter.unheard) == found
    standin.refused.clear()
    server[1].app = standin
    standin.log.clear()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert ("POST /resume_memory_occupation" in standin.log) == (before == "resume unheard")
    assert standin.released == set() and standin.crashed is None
