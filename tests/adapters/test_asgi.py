"""rehydrate.adapters.asgi.ReadinessGate under a real uvicorn on loopback and with httpx's
ASGI transport, driven by an isolated engine's real restore and snapshot runs."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rehydrate.adapters import not_ready_reason
from rehydrate.adapters.asgi import ReadinessGate
from rehydrate.detect import Detector
from tests.asgi_server import serve
from tests.detect_helpers import wait_for


class App:
    """A bare ASGI app (no lifespan support); ``/slow`` waits until :attr:`release` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.finished: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http", scope["type"]
        if scope["path"] == "/slow":
            self.entered.set()
            await asyncio.to_thread(self.release.wait, 30)
            self.finished.append("slow")
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"served " + scope["path"].encode()})


def in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)
    t.start()
    return t, out


@pytest.fixture
def app() -> Iterator[App]:
    app = App()
    yield app
    app.release.set()  # a failed test must not leave uvicorn's shutdown waiting for /slow


@pytest.fixture
def gate(app: App, rehydrate_engine: Any) -> ReadinessGate:
    return ReadinessGate(app, engine=rehydrate_engine, retry_after=3, lifespan=False)


def asgi_client(gate: ReadinessGate) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://gate")


async def test_endpoints_when_ready(gate: ReadinessGate) -> None:
    async with asgi_client(gate) as c:
        assert (await c.get("/healthz")).json() == {"alive": True}
        r = await c.get("/readyz")
        assert r.status_code == 200
        assert r.json() == {"ready": True, "state": "running", "generation": 0}
        r = await c.get("/rehydrate/status")
        assert r.status_code == 200
        assert {"state", "generation", "ready", "detectors", "last_report"} <= set(r.json())
        r = await c.get("/anything")
        assert (r.status_code, r.text) == (200, "served /anything")
        assert (await c.head("/readyz")).content == b""
        r = await c.post("/readyz")
        assert r.status_code == 405
        assert r.headers["allow"] == "GET, HEAD"


async def test_degraded_refuses_with_retry_after_and_recovers(
        gate: ReadinessGate, rehydrate_engine: Any) -> None:
    broken = True

    @rehydrate_engine.registry.after_restore(name="reload-model")
    def reload_model() -> None:
        if broken:
            raise RuntimeError("weights file missing")

    report = await asyncio.to_thread(rehydrate_engine.simulate_restore)
    assert not report.ok
    async with asgi_client(gate) as c:
        r = await c.get("/readyz")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "3"
        body = r.json()
        assert body["ready"] is False
        assert body["state"] == "degraded"
        # the failed hook's name, not its error text (the port is public)
        assert body["reason"] == "restore hook(s) failed: reload-model failed"
        r = await c.get("/predict")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "3"
        assert r.json()["state"] == "degraded"
        assert (await c.get("/healthz")).status_code == 200  # liveness is not readiness
        broken = False
        assert (await asyncio.to_thread(rehydrate_engine.simulate_restore)).ok
        assert (await c.get("/readyz")).status_code == 200
        assert (await c.get("/predict")).text == "served /predict"


def test_restoring_under_uvicorn(app: App, rehydrate_engine: Any) -> None:
    """While restore hooks run the gate answers 503; it admits again only after they all
    succeeded (the last hook is still blocked when the first ones are done)."""
    hold = threading.Event()

    @rehydrate_engine.registry.after_restore(name="warm-up")
    def warm_up() -> None:
        hold.wait(30)

    gate = ReadinessGate(app, engine=rehydrate_engine, lifespan=False)
    with serve(gate) as url, httpx.Client(base_url=url) as c:
        t, reports = in_thread(rehydrate_engine.simulate_restore)
        wait_for(lambda: rehydrate_engine.state == "restoring", what="restoring")
        r = c.get("/readyz")
        assert r.status_code == 503
        assert r.json()["reason"] == "restore hooks are running"
        assert r.json()["generation"] == 1
        r = c.get("/embed")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        hold.set()
        t.join(10)
        assert reports[0].ok
        assert c.get("/readyz").status_code == 200
        assert c.get("/embed").text == "served /embed"


async def test_answers_during_a_restore_build_no_status_diagnostics(
        gate: ReadinessGate, rehydrate_engine: Any) -> None:
    """Every request arriving while the restore hooks run is answered on the loop the
    hooks share: refusals and /readyz give state and reason without building a whole
    status (its diagnostic fields, such as the /proc scan of TCP connections, cost
    milliseconds each under gVisor). The public /rehydrate/status does not either; with
    status_detail=True it builds the whole status."""
    built: list[int] = []
    rehydrate_engine.add_status("rht-diagnostics", lambda: built.append(1))
    hold = threading.Event()

    @rehydrate_engine.registry.after_restore(name="slow-hook")
    def slow_hook() -> None:
        hold.wait(30)

    async with asgi_client(gate) as c:
        t, reports = in_thread(rehydrate_engine.simulate_restore)
        try:
            await asyncio.to_thread(wait_for, lambda: rehydrate_engine.state == "restoring",
                                    what="restoring")
            for _ in range(5):
                r = await c.get("/predict")
                assert r.status_code == 503
                assert r.json() == {"error": "not ready", "state": "restoring",
                                    "reason": "restore hooks are running"}
                r = await c.get("/readyz")
                assert (r.status_code, r.json()) == (503, {
                    "ready": False, "state": "restoring", "generation": 1,
                    "reason": "restore hooks are running"})
            assert built == []
            assert "rht-diagnostics" not in (await c.get("/rehydrate/status")).json()
            assert built == []
            detail = ReadinessGate(gate.app, engine=rehydrate_engine, lifespan=False,
                                   status_detail=True)
            async with asgi_client(detail) as d:
                assert "rht-diagnostics" in (await d.get("/rehydrate/status")).json()
            assert built == [1]
        finally:
            hold.set()
            await asyncio.to_thread(t.join, 10)
        assert reports[0].ok
        assert (await c.get("/readyz")).status_code == 200


async def test_public_answers_name_failed_hooks_without_their_errors(
        app: App, rehydrate_engine: Any) -> None:
    """The 503 bodies and /readyz answer whoever reaches the application's port — also
    with status=None. They name the failed hooks but carry none of their error text (a
    secret file's path, an internal host, a rejected value), and build none of the
    status's published fields. not_ready_reason() keeps the detail for the operator."""
    built: list[int] = []
    rehydrate_engine.add_status("rht-diagnostics", lambda: built.append(1))

    @rehydrate_engine.registry.after_restore(name="billing-client")
    def billing() -> None:
        raise RuntimeError("key rht-leaked-key rejected by billing.internal:8443")

    report = await asyncio.to_thread(rehydrate_engine.simulate_restore)
    assert not report.ok
    gate = ReadinessGate(app, engine=rehydrate_engine, status=None, lifespan=False)
    async with asgi_client(gate) as c:
        for path in ("/readyz", "/predict", "/rehydrate/status"):
            r = await c.get(path)
            assert r.status_code == 503, path
            assert r.json()["state"] == "degraded"
            assert r.json()["reason"] == "restore hook(s) failed: billing-client failed"
            assert "rht-leaked-key" not in r.text and "billing.internal" not in r.text
    assert built == []
    assert "rht-leaked-key" in not_ready_reason(rehydrate_engine)
    assert not_ready_reason(rehydrate_engine, detail=False) == (
        "restore hook(s) failed: billing-client failed")


def test_status_endpoint_is_a_public_view_unless_status_detail(
        app: App, rehydrate_engine: Any, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /rehydrate/status on the application's port: states, names and outcomes, but
    not the process's TCP connections (other clients' addresses), a connection's peers,
    a secret's file path, hook error text or fields it does not know — and no /proc scan
    per request. status_detail=True (a private port) shows the whole status."""
    from rehydrate import connections, secrets

    scans: list[int] = []
    real_scan = connections.established_tcp

    def counted() -> Any:
        scans.append(1)
        return real_scan()

    monkeypatch.setattr(connections, "established_tcp", counted)
    secret_file = tmp_path / "rht-secret-dir" / "db-password"
    secret_file.parent.mkdir()
    secret_file.write_text("pw\n")
    secret = secrets.Secret.from_file(secret_file, name="db-password", engine=rehydrate_engine)
    connections.register("cache", open=object, peers=[("10.20.30.40", 6379)],
                         engine=rehydrate_engine)
    rehydrate_engine.add_status("rht-diagnostics", lambda: "rht-internal-detail")

    @rehydrate_engine.registry.after_restore(name="billing-client")
    def billing() -> None:
        raise RuntimeError("key rht-leaked-key rejected")

    secret_file.unlink()  # its reload fails, with the path in the error
    assert not rehydrate_engine.simulate_restore().ok
    public = ReadinessGate(app, engine=rehydrate_engine, lifespan=False)
    with serve(public) as url, httpx.Client(base_url=url) as c:
        r = c.get("/rehydrate/status")
        assert r.status_code == 200
        body = r.json()
        assert body["state"] == "degraded" and body["ready"] is False
        hooks = {h["name"]: h for h in body["last_report"]["hooks"]}
        assert hooks["billing-client"] == {
            "name": "billing-client", "phase": "application", "outcome": "failed",
            "duration": hooks["billing-client"]["duration"], "required": True,
            "attempts": 1}
        assert hooks["rehydrate.secret:db-password"]["outcome"] == "failed"
        assert body["secrets"] == {"db-password": {"available": False}}
        assert body["connections"] == [
            {"name": "cache", "state": "open", "required": True, "attempts": 1}]
        for hidden in ("tcp_connections", "rht-diagnostics", "files", "control"):
            assert hidden not in body
        for leaked in ("rht-secret-dir", "10.20.30.40", "rht-leaked-key",
                       "rht-internal-detail", "127.0.0.1"):
            assert leaked not in r.text, leaked
        c.get("/rehydrate/status")
        assert scans == []
    detail = ReadinessGate(app, engine=rehydrate_engine, lifespan=False, status_detail=True)
    with serve(detail) as url, httpx.Client(base_url=url) as c:
        r = c.get("/rehydrate/status")
        assert r.status_code == 200
        body = r.json()
        assert scans == [1]
        assert isinstance(body["tcp_connections"], list) and body["tcp_connections"]
        assert body["rht-diagnostics"] == "rht-internal-detail"
        for shown in ("rht-secret-dir", "10.20.30.40:6379", "rht-leaked-key"):
            assert shown in r.text, shown
    del secret  # held until here: the manager keeps only a weak reference


async def test_status_detail_with_keys_json_cannot_have(
        app: App, rehydrate_engine: Any) -> None:
    """A status field keyed by (host, port): GET /rehydrate/status with status_detail=True
    raised TypeError out of the gate (the control socket alone converted such keys)."""
    rehydrate_engine.add_status("peers", lambda: {("db", 5432): 3})
    detail = ReadinessGate(app, engine=rehydrate_engine, lifespan=False, status_detail=True)
    async with asgi_client(detail) as c:
        r = await c.get("/rehydrate/status")
    assert r.status_code == 200
    assert r.json()["peers"] == {"('db', 5432)": 3}


def test_status_detail_must_be_a_bool(app: App, rehydrate_engine: Any) -> None:
    with pytest.raises(TypeError, match="status_detail must be True or False, not 'yes'"):
        ReadinessGate(app, engine=rehydrate_engine, status_detail="yes")  # type: ignore[arg-type]


def test_readyz_wait_answers_when_the_restore_hooks_finish(
        app: App, rehydrate_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GET /readyz?wait=S`` is held while the hooks run, without holding the event loop
    (``/healthz`` answers meanwhile), and answers 200 once the restore's report is out:
    woken by the report, not by its periodic recheck (made 60 s here)."""
    monkeypatch.setattr("rehydrate.adapters.asgi._RECHECK", 60.0)
    hold = threading.Event()

    @rehydrate_engine.registry.after_restore(name="warm-up")
    def warm_up() -> None:
        hold.wait(30)

    published: list[float] = []
    rehydrate_engine.add_listener(lambda report: published.append(time.monotonic()))
    gate = ReadinessGate(app, engine=rehydrate_engine, lifespan=False)
    with serve(gate) as url, httpx.Client(base_url=url, timeout=30) as c:
        t, reports = in_thread(rehydrate_engine.simulate_restore)
        wait_for(lambda: rehydrate_engine.state == "restoring", what="restoring")
        waiting, answers = in_thread(lambda: (c.get("/readyz?wait=20"), time.monotonic()))
        wait_for(lambda: bool(gate._waiters), what="the /readyz?wait request waiting")
        with httpx.Client(base_url=url) as other:
            assert other.get("/healthz").status_code == 200  # the loop is free meanwhile
            assert other.get("/readyz").status_code == 503
        assert waiting.is_alive()
        hold.set()
        waiting.join(15)
        t.join(10)
        assert reports[0].ok
        response, answered_at = answers[0]
        assert response.status_code == 200
        assert response.json()["ready"] is True
        assert answered_at >= published[0]  # after the report, and long before 60 s
        assert not gate._waiters


async def test_readyz_wait_gives_up_after_wait_or_max_wait(
        app: App, rehydrate_engine: Any) -> None:
    """Not ready for the whole wait: 503 with the reason once ``wait`` (or the gate's
    ``max_wait``, when shorter) has passed; ``wait=0`` and no wait answer at once."""
    hold = threading.Event()

    @rehydrate_engine.registry.after_restore(name="slow-hook")
    def slow_hook() -> None:
        hold.wait(30)

    gate = ReadinessGate(app, engine=rehydrate_engine, lifespan=False, max_wait=0.3)
    async with asgi_client(gate) as c:
        t, _ = in_thread(rehydrate_engine.simulate_restore)
        try:
            await asyncio.to_thread(wait_for, lambda: rehydrate_engine.state == "restoring",
                                    what="restoring")
            for query, at_least in (("?wait=0.2", 0.2), ("?wait=600", 0.3)):
                t0 = time.monotonic()
                r = await c.get("/readyz" + query)
                assert time.monotonic() - t0 >= at_least
                assert r.status_code == 503
                assert r.json()["reason"] == "restore hooks are running"
            assert (await c.get("/readyz?wait=0")).status_code == 503
        finally:
            hold.set()
            await asyncio.to_thread(t.join, 10)
        assert (await c.get("/readyz?wait=5")).status_code == 200


@pytest.mark.parametrize("query", ["wait=soon", "wait=-1", "wait=nan", "wait=inf"])
async def test_readyz_bad_wait_one_clear_error(gate: ReadinessGate, query: str) -> None:
    async with asgi_client(gate) as c:
        r = await c.get(f"/readyz?{query}")
    assert r.status_code == 400
    assert r.json() == {"error": "wait must be a number of seconds >= 0"}


def test_drains_in_flight_requests_before_snapshot(app: App, rehydrate_engine: Any) -> None:
    """A request in flight when the snapshot starts finishes (200) before any other
    before-snapshot hook runs; requests arriving meanwhile get 503; after the snapshot
    the gate stays closed until the restore ran (a clone must not serve pre-snapshot state)."""
    seen_running: list[bool] = []

    @rehydrate_engine.registry.before_snapshot(name="close-db")
    def close_db() -> None:
        seen_running.append(app.entered.is_set() and not app.finished)

    gate = ReadinessGate(app, engine=rehydrate_engine, lifespan=False)
    with serve(gate) as url, httpx.Client(base_url=url) as c, httpx.Client(base_url=url) as c2:
        slow, slow_out = in_thread(c2.get, "/slow")
        assert app.entered.wait(10)
        snap, snap_out = in_thread(rehydrate_engine.simulate_snapshot)
        wait_for(lambda: rehydrate_engine.state == "snapshotting", what="snapshotting")
        r = c.get("/new")
        assert r.status_code == 503
        assert r.json()["reason"] == "before-snapshot hooks are running"
        snap.join(0.5)  # a broken drain lets the snapshot finish here at once
        assert snap.is_alive(), "the snapshot did not wait for the request in flight"
        app.release.set()
        slow.join(10)
        snap.join(10)
        assert slow_out[0].status_code == 200
        assert snap_out[0].ok
        assert seen_running == [False]
        drain = next(h for h in snap_out[0].hooks if h.name == "rehydrate.asgi.drain")
        assert drain.outcome == "ok"
        r = c.get("/after-snapshot")
        assert r.status_code == 503
        assert r.json()["reason"] == "snapshot prepared; waiting for the restore or resume"
        assert rehydrate_engine.simulate_restore().ok
        assert c.get("/after-restore").status_code == 200


def test_the_snapshot_budget_covers_the_drain_and_an_engine_s_deadline(
        app: App, rehydrate_engine: Any) -> None:
    """The budget ``notify save`` waits for (rehydrate._runner.worst_case) follows
    ``drain_timeout`` and the adapters' deadlines. Before, the drain hook had no limit of
    its own, so the pass had no known bound, and the client's fixed 120 s gave up on a
    drain of 25 s followed by an engine sleep of 97 s — each within its limit."""
    from rehydrate._notify import DEFAULT_TIMEOUT
    from rehydrate._runner import worst_case
    from rehydrate.adapters import vllm

    ReadinessGate(app, engine=rehydrate_engine, lifespan=False, drain_timeout=30)
    ReadinessGate(app, engine=rehydrate_engine, lifespan=False, drain_timeout=10)
    vllm.VLLMAdapter("http://127.0.0.1:9", deadline=120).install(rehydrate_engine)
    hooks = rehydrate_engine.hooks("snapshot")
    drains = [h for h in hooks if h.name == "rehydrate.asgi.drain"]
    assert len(drains) == 1 and drains[0].timeout > 30  # the longest gate's, with grace
    assert hooks[0] is drains[0]  # still the very first before-snapshot hook
    budget = worst_case(hooks)
    assert budget is not None and budget >= 30 + 120 > DEFAULT_TIMEOUT
    ReadinessGate(app, engine=rehydrate_engine, lifespan=False, drain_timeout=50)
    assert worst_case(rehydrate_engine.hooks("snapshot")) == pytest.approx(budget + 20)


def test_a_gate_draining_about_a_year_keeps_the_drain_hook(app: App,
                                                            rehydrate_engine: Any) -> None:
    """``drain_timeout`` near the one-year cap passes the gate's check; its hook (drain +
    grace) went over the cap, the registration failed — after the first gate's drain hook
    had been removed: no drain at all."""
    from rehydrate.extensions import MAX_SECONDS

    ReadinessGate(app, engine=rehydrate_engine, lifespan=False, drain_timeout=30)
    ReadinessGate(app, engine=rehydrate_engine, lifespan=False, drain_timeout=MAX_SECONDS)
    drains = [h for h in rehydrate_engine.hooks("snapshot") if h.name == "rehydrate.asgi.drain"]
    assert [h.timeout for h in drains] == [MAX_SECONDS]


def test_drain_timeout_fails_the_snapshot(app: App, rehydrate_engine: Any) -> None:
    gate = ReadinessGate(app, engine=rehydrate_engine, lifespan=False, drain_timeout=0.2)
    with serve(gate) as url, httpx.Client(base_url=url) as c:
        slow, slow_out = in_thread(c.get, "/slow")
        assert app.entered.wait(10)
        report = rehydrate_engine.simulate_snapshot()
        assert not report.ok
        drain = next(h for h in report.hooks if h.name == "rehydrate.asgi.drain")
        assert drain.outcome == "failed"
        assert str(drain.error) == "1 request(s) still in flight after 0.2s (drain_timeout)"
        assert not_ready_reason(rehydrate_engine).startswith(
            "snapshot hook(s) failed: rehydrate.asgi.drain failed (DrainTimeout: 1 request")
        app.release.set()
        slow.join(10)
        assert slow_out[0].status_code == 200  # the request itself was never cut
        assert rehydrate_engine.simulate_restore(kind="resume").ok
        assert c.get("/ok").status_code == 200


@pytest.mark.parametrize("exempt", [["/metrics"], "/metrics"])  # one string: one prefix
async def test_exempt_paths_pass_in_every_state(app: App, rehydrate_engine: Any,
                                                exempt: Any) -> None:
    gate = ReadinessGate(app, engine=rehydrate_engine, lifespan=False, exempt=exempt,
                         readyz="/ready", healthz=None, status=None)
    await asyncio.to_thread(rehydrate_engine.simulate_snapshot)
    async with asgi_client(gate) as c:
        assert (await c.get("/metrics/x")).text == "served /metrics/x"
        assert (await c.get("/other")).status_code == 503
        assert (await c.get("/ready")).status_code == 503
        # switched-off endpoints are the application's paths again (gated like any other)
        assert (await c.get("/healthz")).status_code == 503
    await asyncio.to_thread(rehydrate_engine.simulate_restore, kind="resume")
    async with asgi_client(gate) as c:
        assert (await c.get("/healthz")).text == "served /healthz"
        assert (await c.get("/rehydrate/status")).text == "served /rehydrate/status"


async def test_websocket_refused_with_try_again_later(gate: ReadinessGate,
                                                      rehydrate_engine: Any) -> None:
    await asyncio.to_thread(rehydrate_engine.simulate_snapshot)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await gate({"type": "websocket", "path": "/ws"}, receive, send)
    assert sent == [{"type": "websocket.accept"},
                    {"type": "websocket.close", "code": 1013, "reason": "not ready"}]


class RecordingDetector(Detector):
    """Records the engine it was started with (the gate's lifespan starts detection)."""

    key = "recording"

    def __init__(self) -> None:
        self.started: list[Any] = []
        self.stopped = 0

    def start(self, engine: Any) -> None:
        self.started.append(engine)

    def stop(self) -> None:
        self.stopped += 1


def test_lifespan_starts_and_stops_detection_on_the_server_loop(
        app: App, rehydrate_engine: Any) -> None:
    """The app does not speak lifespan: the gate serves it, starts detection with the
    server's loop (async hooks run there) and stops it at shutdown."""
    loops: list[Any] = []

    @rehydrate_engine.registry.after_restore(name="async-hook")
    async def async_hook() -> None:
        loops.append(asyncio.get_running_loop())

    detector = RecordingDetector()
    gate = ReadinessGate(app, engine=rehydrate_engine, detectors=[detector])
    server_loops: list[Any] = []

    async def which_loop(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/loop":
            server_loops.append(asyncio.get_running_loop())
        await gate(scope, receive, send)

    with serve(which_loop, lifespan="on") as url:
        assert detector.started == [rehydrate_engine]
        assert rehydrate_engine.status().detectors == ("recording",)
        assert httpx.get(url + "/loop").status_code == 200
        assert rehydrate_engine.simulate_restore().ok
        assert loops == server_loops
    assert detector.stopped == 1
    assert rehydrate_engine.status().detectors == ()


def test_an_app_returning_after_its_startup_still_stops_detection_at_shutdown(
        rehydrate_engine: Any) -> None:
    """An application that answers the startup and returns at once, without waiting for
    the shutdown: uvicorn takes its return for the end of the lifespan and sends no
    shutdown, and detection ran on after the server had exited."""
    events: list[str] = []

    async def returns_early(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            events.append((await receive())["type"])
            await send({"type": "lifespan.startup.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"served"})

    detector = RecordingDetector()
    gate = ReadinessGate(returns_early, engine=rehydrate_engine, detectors=[detector])
    with serve(gate, lifespan="on") as url:
        assert detector.started == [rehydrate_engine]
        assert httpx.get(url + "/x").text == "served"
    assert events == ["lifespan.startup"]
    assert detector.stopped == 1
    assert not rehydrate_engine.started


def test_a_server_without_lifespan_is_warned_about_once(app: App, rehydrate_engine: Any,
                                                        caplog: Any) -> None:
    """``uvicorn --lifespan off``, or the gate mounted as a sub-application: no startup
    ever starts detection. Before, the gate said nothing and stayed ready for ever; now
    the first request logs one warning (none when detection runs anyway, or after a
    lifespan startup, or with ``lifespan=False``)."""
    gate = ReadinessGate(app, engine=rehydrate_engine)
    with caplog.at_level(logging.WARNING, logger="rehydrate.adapters.asgi"), \
            serve(gate, lifespan="off") as url, httpx.Client(base_url=url) as c:
        assert c.get("/a").status_code == 200
        assert c.get("/readyz").status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "lifespan" in r.getMessage()]
    assert len(warnings) == 1 and "restores and snapshots are not detected" in warnings[0]

    caplog.clear()
    quiet = [ReadinessGate(app, engine=rehydrate_engine, detectors="none"),
             ReadinessGate(app, engine=rehydrate_engine, lifespan=False)]
    with caplog.at_level(logging.WARNING, logger="rehydrate.adapters.asgi"):
        with serve(quiet[0], lifespan="on") as url:  # a startup came first
            assert httpx.get(url + "/a").status_code == 200
        with serve(quiet[1], lifespan="off") as url:  # the application's to start
            assert httpx.get(url + "/a").status_code == 200
        rehydrate_engine.start("none")
        try:  # detection runs (a module-level rehydrate.start()): nothing missing
            with serve(ReadinessGate(app, engine=rehydrate_engine), lifespan="off") as url:
                assert httpx.get(url + "/a").status_code == 200
        finally:
            rehydrate_engine.stop()
    assert [r for r in caplog.records if "lifespan" in r.getMessage()] == []


def test_lifespan_wraps_an_app_that_has_one(rehydrate_engine: Any) -> None:
    events: list[str] = []

    async def app_with_lifespan(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                events.append(m["type"] + (" started" if rehydrate_engine.status().detectors
                                           else ""))
                await send({"type": m["type"] + ".complete"})
                if m["type"] == "lifespan.shutdown":
                    return
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    detector = RecordingDetector()
    gate = ReadinessGate(app_with_lifespan, engine=rehydrate_engine, detectors=[detector])
    with serve(gate, lifespan="on") as url:
        assert httpx.get(url + "/x").status_code == 204
    # detection starts before the application's own startup runs, stops before its shutdown
    assert events == ["lifespan.startup started", "lifespan.shutdown"]
    assert detector.stopped == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"retry_after": -1}, "retry_after must be a whole number of seconds >= 0 and at most "
                          "31536000 (a year), not -1"),
    ({"retry_after": 1.5}, "retry_after must be a whole number of seconds >= 0 and at most "
                           "31536000 (a year), not 1.5"),
    ({"retry_after": 10**400},  # sent as a 401-digit Retry-After before
     "retry_after must be a whole number of seconds >= 0 and at most 31536000 (a year), "
     "not 1e+400"),
    ({"retry_after": 10**5000},  # str() of it failed, naming nothing
     "retry_after must be a whole number of seconds >= 0 and at most 31536000 (a year), "
     "not 1e+5000"),
    ({"drain_timeout": 0},
     "drain_timeout must be a number of seconds > 0 and at most 31536000 (a year), not 0"),
    ({"drain_timeout": float("nan")},
     "drain_timeout must be a number of seconds > 0 and at most 31536000 (a year), not nan"),
    ({"drain_timeout": 10**400},  # accepted before, and overflowed a wait later
     "drain_timeout must be a number of seconds > 0 and at most 31536000 (a year), not 1e+400"),
    ({"max_wait": -1},
     "max_wait must be a number of seconds >= 0 and at most 31536000 (a year), not -1"),
    ({"max_wait": float("inf")},
     "max_wait must be a number of seconds >= 0 and at most 31536000 (a year), not inf"),
    ({"control_grace": -1},
     "control_grace must be a number of seconds >= 0 and at most 31536000 (a year), not -1"),
    ({"control_grace": "5"},
     "control_grace must be a number of seconds >= 0 and at most 31536000 (a year), not str"),
    ({"exempt": ["metrics"]}, "exempt must be path prefixes starting with '/', not ('metrics',)"),
    ({"healthz": "/x", "readyz": "/x"},  # liveness would answer 503 while restoring
     "healthz, readyz and status must be distinct paths starting with '/' (or None), not "
     "'/x', '/x', '/rehydrate/status'"),
    # one endpoint as routed (a trailing slash is the same path): during a restore the
    # liveness probe at /health got readyz's 503 and restarted the restoring pod
    ({"healthz": "/health", "readyz": "/health/"},
     "healthz, readyz and status must be distinct paths starting with '/' (or None), not "
     "'/health', '/health/', '/rehydrate/status'"),
    ({"readyz": "/", "status": "//"},
     "healthz, readyz and status must be distinct paths starting with '/' (or None), not "
     "'/healthz', '/', '//'"),
    ({"readyz": "readyz"}, "healthz, readyz and status must be distinct paths starting with "
                           "'/' (or None), not '/healthz', 'readyz', '/rehydrate/status'"),
    ({"status": ""}, "healthz, readyz and status must be distinct paths starting with '/' "
                     "(or None), not '/healthz', '/readyz', ''"),
    ({"drain_timeout": "30"},
     "drain_timeout must be a number of seconds > 0 and at most 31536000 (a year), not str"),
    ({"max_wait": "5"},
     "max_wait must be a number of seconds >= 0 and at most 31536000 (a year), not str"),
])
def test_bad_options_one_clear_error(app: App, rehydrate_engine: Any, kwargs: dict[str, Any],
                                     message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as exc:
        ReadinessGate(app, engine=rehydrate_engine, **kwargs)
    assert str(exc.value) == message


def test_gates_on_one_engine_share_one_drain_hook(app: App, rehydrate_engine: Any) -> None:
    ReadinessGate(app, engine=rehydrate_engine, drain_timeout=5)
    ReadinessGate(app, engine=rehydrate_engine, drain_timeout=7)
    report = rehydrate_engine.simulate_snapshot()
    names = [h.name for h in report.hooks]
    assert names.count("rehydrate.asgi.drain") == 1
    assert names[0] == "rehydrate.asgi.drain"  # first before-snapshot hook of all


def test_fastapi_add_middleware_under_uvicorn(rehydrate_engine: Any) -> None:
    """The FastAPI recipe: ``app.add_middleware(ReadinessGate, ...)``; lifespan messages
    pass through Starlette's middleware stack, so detection starts with the server."""
    from fastapi import FastAPI

    api = FastAPI()

    @api.get("/embed")
    async def embed() -> dict[str, str]:
        return {"ok": "yes"}

    detector = RecordingDetector()
    api.add_middleware(ReadinessGate, engine=rehydrate_engine, detectors=[detector])
    with serve(api, lifespan="on") as url, httpx.Client(base_url=url) as c:
        assert detector.started == [rehydrate_engine]
        assert c.get("/embed").json() == {"ok": "yes"}
        assert c.get("/readyz").status_code == 200
        rehydrate_engine.simulate_snapshot()
        r = c.get("/embed")
        assert (r.status_code, r.headers["retry-after"]) == (503, "1")
        assert c.get("/healthz").status_code == 200
        assert rehydrate_engine.simulate_restore().ok
        assert c.get("/embed").status_code == 200
    assert detector.stopped == 1


def test_health_app_serves_probes_for_a_supervisor(rehydrate_engine: Any) -> None:
    """health_app(): the probes on a port of their own, next to a server that is not a
    Python ASGI app (vllm serve, SGLang); detection starts with its lifespan."""
    from rehydrate.adapters.asgi import health_app

    detector = RecordingDetector()
    with serve(health_app(engine=rehydrate_engine, detectors=[detector]),
               lifespan="on") as url, httpx.Client(base_url=url) as c:
        assert detector.started == [rehydrate_engine]
        assert c.get("/readyz").status_code == 200
        assert c.get("/v1/completions").status_code == 404
        rehydrate_engine.simulate_snapshot()
        r = c.get("/readyz")
        assert (r.status_code, r.json()["state"]) == (503, "snapshotting")
        assert c.get("/healthz").status_code == 200


class EchoSocket:
    """A WebSocket endpoint that echoes one message (and plain HTTP answers 200)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":
                return
            await send({"type": "websocket.send", "text": "echo:" + message["text"]})


def test_websockets_under_uvicorn_refused_with_1013_and_never_block_a_snapshot(
        rehydrate_engine: Any) -> None:
    """Closed before the handshake, uvicorn answered the refused WebSocket HTTP 403 ("do
    not retry") instead of the documented close code 1013; and one admitted WebSocket
    counted as in flight for its whole life, failing every snapshot's drain."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    gate = ReadinessGate(EchoSocket(), engine=rehydrate_engine, drain_timeout=0.5,
                         lifespan=False)
    with serve(gate) as url:
        ws_url = url.replace("http://", "ws://") + "/ws"
        with connect(ws_url) as open_socket:
            open_socket.send("a")
            assert open_socket.recv(timeout=5) == "echo:a"
            report = rehydrate_engine.simulate_snapshot()  # the socket stays open
            assert report.ok, report.table()
            with connect(ws_url) as refused, pytest.raises(ConnectionClosed) as closed:
                refused.recv(timeout=5)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
        assert rehydrate_engine.simulate_restore().ok
        with connect(ws_url) as again:
            again.send("b")
            assert again.recv(timeout=5) == "echo:b"


def test_the_gate_under_a_root_path(app: App, rehydrate_engine: Any) -> None:
    """Behind a proxy mounting the app at /api (uvicorn --root-path), ASGI servers put
    the root path into ``path``: the gate never matched its own endpoints — /readyz was
    the app's 404 (readiness never passed) and /healthz answered 503 while snapshotting
    (the liveness probe restarted the pod)."""
    gate = ReadinessGate(app, engine=rehydrate_engine, lifespan=False, exempt="/metrics")
    # requests as the proxy forwards them (it strips /api; uvicorn puts it back in path)
    with serve(gate, root_path="/api") as url:
        assert httpx.get(f"{url}/readyz").json()["ready"] is True
        assert httpx.get(f"{url}/healthz/").json() == {"alive": True}
        assert rehydrate_engine.simulate_snapshot().ok
        assert httpx.get(f"{url}/healthz").status_code == 200
        assert httpx.get(f"{url}/readyz").status_code == 503
        assert httpx.get(f"{url}/work").status_code == 503
        assert httpx.get(f"{url}/metrics").text == "served /api/metrics"
        assert httpx.get(f"{url}/metricsfoo").status_code == 503  # not a prefix match


def test_a_held_readyz_wait_ends_with_its_client(app: App, rehydrate_engine: Any) -> None:
    """The client gave up after a second, but its /readyz?wait=30 stayed held for the
    whole wait (max_wait, 60 s by default, beyond a pod's termination grace), holding the
    server's shutdown too."""
    gate = ReadinessGate(app, engine=rehydrate_engine, lifespan=False, max_wait=30)
    assert rehydrate_engine.simulate_snapshot().ok  # not ready from now on
    with serve(gate) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(f"{url}/readyz?wait=30", timeout=0.5)
        wait_for(lambda: not gate._waiters, what="the abandoned wait to end")
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 10, "shutdown waited for the abandoned request"


async def test_a_failed_application_startup_stops_detection(rehydrate_engine: Any) -> None:
    """The server exits after ``lifespan.startup.failed`` without a shutdown message: the
    detection the gate had started stayed running."""
    async def failing_app(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        await receive()  # lifespan.startup
        await send({"type": "lifespan.startup.failed", "message": "no database"})

    detector = RecordingDetector()
    gate = ReadinessGate(failing_app, engine=rehydrate_engine, detectors=[detector])
    messages = [{"type": "lifespan.startup"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await gate({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert sent == [{"type": "lifespan.startup.failed", "message": "no database"}]
    assert detector.started == [rehydrate_engine] and detector.stopped == 1
    assert rehydrate_engine.status().detectors == ()


async def test_an_endpoint_configured_with_a_trailing_slash_still_answers(
        app: App, rehydrate_engine: Any) -> None:
    gate = ReadinessGate(app, engine=rehydrate_engine, healthz="/live/", lifespan=False)
    async with asgi_client(gate) as c:
        assert (await c.get("/live/")).json() == {"alive": True}
        assert (await c.get("/live")).json() == {"alive": True}


def test_a_refused_request_is_not_counted_in_flight(app: App, rehydrate_engine: Any) -> None:
    """Before: a request the gate refused stayed counted while its 503 was written, so a
    slow reader of that 503 failed the next snapshot's drain with no admitted request
    running."""
    gate = ReadinessGate(app, engine=rehydrate_engine, lifespan=False)
    assert rehydrate_engine.simulate_snapshot().ok  # not ready until the restore

    async def main() -> int:
        writing, release = asyncio.Event(), asyncio.Event()
        statuses: list[int] = []

        async def slow_send(message: dict[str, Any]) -> None:  # a client reading slowly
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            writing.set()
            await release.wait()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "GET", "path": "/x", "root_path": "",
                 "query_string": b"", "headers": []}
        request = asyncio.ensure_future(gate(scope, receive, slow_send))
        await writing.wait()
        counted = gate._drain.in_flight  # while its 503 is being written
        release.set()
        await request
        assert statuses == [503]
        return counted

    assert asyncio.run(main()) == 0


@pytest.mark.parametrize("second", ["health_app", "the same gate"])
def test_detection_runs_until_the_last_server_on_the_engine_shuts_down(
        app: App, rehydrate_engine: Any, second: str) -> None:
    """Two servers in one process share the engine: the API behind its gate and the probes
    on a port of their own (``health_app()``), or one gate served on two ports. Before,
    the first to shut down stopped detection under the other, which served on, deaf to
    restores (a clone answered with pre-snapshot state)."""
    from rehydrate.adapters.asgi import health_app

    detector = RecordingDetector()
    api = ReadinessGate(app, engine=rehydrate_engine, detectors=[detector])
    other = (health_app(engine=rehydrate_engine, detectors=[detector])
             if second == "health_app" else api)
    with serve(api, lifespan="on") as url:
        with serve(other, lifespan="on") as other_url:
            assert httpx.get(other_url + "/readyz").status_code == 200
        assert detector.stopped == 0, "the other server's shutdown stopped detection"
        assert rehydrate_engine.status().detectors == ("recording",)
        assert httpx.get(url + "/x").status_code == 200
    assert detector.started == [rehydrate_engine] and detector.stopped == 1
    assert rehydrate_engine.status().detectors == ()


@pytest.mark.parametrize("detectors", [["contrl"], "control,clock-jmp", [42], ("auto",)])
def test_an_unknown_detector_is_refused_when_the_gate_is_built(
        app: App, rehydrate_engine: Any, detectors: Any) -> None:
    """Before: accepted, and the lifespan startup only logged that detection did not start
    (a failure there must not stop the server): the server served on, deaf to restores —
    a clone answered with its parent's state."""
    from rehydrate import detect

    with pytest.raises(ValueError, match=r"^unknown detector .* \(known: ") as refused:
        ReadinessGate(app, engine=rehydrate_engine, detectors=detectors)
    assert ", ".join(detect.catalogue_keys()) in str(refused.value)
    with pytest.raises(TypeError, match="^detectors must be 'auto', 'none', or detector keys"):
        ReadinessGate(app, engine=rehydrate_engine, detectors=7)  # type: ignore[arg-type]


def test_detector_keys_and_instances_are_taken(app: App, rehydrate_engine: Any) -> None:
    detector = RecordingDetector()
    for detectors, kept in (("auto", "auto"), ("none", "none"),
                            (" control , clock-jump ", " control , clock-jump "),
                            (iter(["control", detector]), ["control", detector])):
        assert ReadinessGate(app, engine=rehydrate_engine,
                             detectors=detectors).detectors == kept


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_an_application_startup_that_raises_stops_detection(rehydrate_engine: Any,
                                                            mode: str) -> None:
    """A bare app whose lifespan startup raises (without sending ``startup.failed``, which
    Starlette sends itself): uvicorn never sends a shutdown then, so detection stayed
    running after the server was gone — and with ``--lifespan auto`` uvicorn took the
    exception for "no lifespan support" and served the app whose startup had failed.
    The gate says the startup failed for it: the server exits, detection stops."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        await receive()  # lifespan.startup
        raise RuntimeError("database unreachable")

    import uvicorn

    detector = RecordingDetector()
    gate = ReadinessGate(app, engine=rehydrate_engine, detectors=[detector])
    server = uvicorn.Server(uvicorn.Config(gate, host="127.0.0.1", port=0,
                                           lifespan=mode, log_level="critical"))
    exits: list[Any] = []

    def run() -> None:
        try:
            server.run()
        except SystemExit as exc:  # uvicorn's "startup failed" exit
            exits.append(exc.code)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), 30, "startup or exit")
        assert not server.started, "uvicorn served an app whose startup had failed"
    finally:
        server.should_exit = True
        thread.join(15)
    assert exits and exits[0] != 0
    assert detector.started == [rehydrate_engine] and detector.stopped == 1
    assert rehydrate_engine.status().detectors == ()


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_an_app_that_reads_the_startup_as_a_request_is_served(rehydrate_engine: Any,
                                                              mode: str) -> None:
    """A lifespan-unaware app that reads ``receive()`` first and answers with
    ``http.response.start`` on the lifespan scope: uvicorn alone serves it ("lifespan
    appears unsupported"). Once the gate said ``startup.failed`` for apps that raise in
    the lifespan, uvicorn refused to start with it (exit 3) under the default ``auto``.
    Its message is not forwarded; the gate serves the lifespan for it: the server starts,
    detection runs, and the shutdown stops it."""
    async def naive(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # the request body, it believes
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hello"})

    detector = RecordingDetector()
    gate = ReadinessGate(naive, engine=rehydrate_engine, detectors=[detector])
    with serve(gate, lifespan=mode) as url:
        r = httpx.get(url + "/")
        assert (r.status_code, r.text) == (200, "hello")
        assert detector.started == [rehydrate_engine] and detector.stopped == 0
        assert rehydrate_engine.status().detectors == ("recording",)
    assert detector.stopped == 1
    assert rehydrate_engine.status().detectors == ()


class _LifespanDriver:
    """Drives one lifespan of ``gate`` on an event loop of its own thread: one server."""

    def __init__(self, gate: ReadinessGate) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sent: list[str] = []
        self.queue: asyncio.Queue[Any] = self.call(self._queue())
        self.done = asyncio.run_coroutine_threadsafe(
            gate({"type": "lifespan", "asgi": {"version": "3.0"}}, self.queue.get,
                 self._send), self.loop)

    async def _queue(self) -> asyncio.Queue[Any]:
        return asyncio.Queue()

    async def _send(self, message: Any) -> None:
        self.sent.append(message["type"])

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(15)

    def startup(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, {"type": "lifespan.startup"})
        wait_for(lambda: "lifespan.startup.complete" in self.sent, 15, "startup complete")

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, {"type": "lifespan.shutdown"})
        self.done.result(15)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        if not self.done.done():
            self.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(15)
        self.loop.close()


def test_async_hooks_move_to_a_server_still_running_when_another_stops(
        app: App, rehydrate_engine: Any) -> None:
    """Two servers on two event loops share the engine (the API, and ``health_app`` on a
    port of its own). Hooks ran on the loop of the last one started; once that one shut
    down they ran on rehydrate's private loop, away from the surviving server's clients,
    although its lifespan still held detection. They run on the surviving loop now."""
    from rehydrate.adapters.asgi import health_app

    loops: list[Any] = []

    @rehydrate_engine.registry.after_restore(name="async-hook")
    async def async_hook() -> None:
        loops.append(asyncio.get_running_loop())

    api = _LifespanDriver(ReadinessGate(app, engine=rehydrate_engine, detectors="none"))
    probes = _LifespanDriver(health_app(engine=rehydrate_engine, detectors="none"))
    try:
        api.startup()
        probes.startup()
        assert rehydrate_engine.simulate_restore().ok
        assert loops == [probes.loop]  # the latest server's loop
        probes.shutdown()
        probes.close()
        assert rehydrate_engine.simulate_restore().ok
        assert loops[1] is api.loop, "async hooks left the surviving server's loop"
    finally:
        probes.close()
        api.close()
    assert rehydrate_engine.status().detectors == ()


def test_a_server_shutting_down_does_not_restart_an_engine_the_app_stopped(
        app: App, rehydrate_engine: Any) -> None:
    """Moving the hooks' loop to a surviving server calls ``start(loop=)``: after the
    application had stopped the engine itself, a server's shutdown started detection
    again behind its back."""
    api = _LifespanDriver(ReadinessGate(app, engine=rehydrate_engine, detectors="none"))
    probes = _LifespanDriver(ReadinessGate(app, engine=rehydrate_engine, detectors="none"))
    try:
        api.startup()
        probes.startup()
        assert rehydrate_engine.started
        rehydrate_engine.stop()  # the application's own shutdown, before the servers'
        probes.shutdown()
        assert not rehydrate_engine.started
    finally:
        probes.close()
        api.close()


def test_the_gate_starts_its_detectors_when_the_application_started_detection_first(
        app: App, rehydrate_engine: Any) -> None:
    """The README's pattern: a module-level ``rehydrate.start()`` at import, then the
    server's lifespan. The gate's ``detectors=[...]`` were ignored (a second start()
    started nothing), and the server was deaf to the restores it was configured for."""
    assert rehydrate_engine.start("none") == []  # the application's own start(), first
    detector = RecordingDetector()
    api = _LifespanDriver(ReadinessGate(app, engine=rehydrate_engine, detectors=[detector]))
    try:
        api.startup()
        assert detector.started == [rehydrate_engine]
        assert rehydrate_engine.status().detectors == ("recording",)
    finally:
        api.close()


class _RefusingDetector(RecordingDetector):
    key = "refusing"

    def start(self, engine: Any) -> None:
        super().start(engine)
        raise OSError("the socket is taken")


def test_a_server_shutting_down_does_not_start_another_servers_detectors_again(
        app: App, rehydrate_engine: Any) -> None:
    """Moving the hooks' loop to the surviving server only moves the loop: its
    detectors were started (or their failure logged) by its own startup; another
    attempt at every shutdown would log the same failure again, or raise for an
    unusable one in the shutdown."""
    refusing = _RefusingDetector()
    probes = _LifespanDriver(ReadinessGate(app, engine=rehydrate_engine,
                                           detectors=[refusing]))
    api = _LifespanDriver(ReadinessGate(app, engine=rehydrate_engine, detectors="none"))
    try:
        probes.startup()
        api.startup()
        assert len(refusing.started) == 1
        api.shutdown()
        assert len(refusing.started) == 1
        assert rehydrate_engine.started
    finally:
        api.close()
        probes.close()


def test_readyz_wait_holds_on_a_server_still_running_after_another_stops(
        app: App, rehydrate_engine: Any) -> None:
    """One gate served on two ports: the first server's shutdown marked the whole gate
    closing, so ``/readyz?wait=N`` on the surviving server answered 503 at once instead
    of waiting for the restore in progress to finish."""
    hold = threading.Event()

    @rehydrate_engine.registry.after_restore(name="warm-up")
    def warm_up() -> None:
        hold.wait(30)

    gate = ReadinessGate(app, engine=rehydrate_engine, detectors="none")
    first, second = _LifespanDriver(gate), _LifespanDriver(gate)
    restoring: tuple[threading.Thread, list[Any]] | None = None
    try:
        first.startup()
        second.startup()
        second.shutdown()
        restoring = in_thread(rehydrate_engine.simulate_restore)
        wait_for(lambda: not rehydrate_engine.is_ready(), 15, "the restore to begin")

        async def readyz_wait() -> httpx.Response:
            async with asgi_client(gate) as c:
                return await c.get("/readyz?wait=30")

        # on the surviving server's loop; the hook holds the restore until it waits
        answer = asyncio.run_coroutine_threadsafe(readyz_wait(), first.loop)
        wait_for(lambda: gate._waiters or answer.done(), 15, "the wait to begin")
        assert not answer.done(), f"answered at once: {answer.result().text}"
        hold.set()
        assert answer.result(30).status_code == 200
        restoring[0].join(30)
        assert restoring[1][0].ok
    finally:
        hold.set()
        if restoring is not None:
            restoring[0].join(30)
        first.close()
        second.close()
