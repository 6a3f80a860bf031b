"""AgonesAdapter against the stand-in sidecar (real HTTP on loopback, real engine)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

import pytest
from agones_sidecar import AgonesSidecar
from detect_helpers import wait_for

from rehydrate.adapters.agones import AgonesAdapter, AgonesError

INTERVAL = 0.2


@pytest.fixture
def sidecar() -> Iterator[AgonesSidecar]:
    with AgonesSidecar() as sc:
        sc.wait_listening()
        yield sc


def _adapter(sidecar: AgonesSidecar, engine, **kw) -> AgonesAdapter:
    kw.setdefault("deadline", 3.0)
    kw.setdefault("request_timeout", 1.0)
    return AgonesAdapter(sidecar.port, kw.pop("health_interval", INTERVAL), engine=engine, **kw)


def _failing_hook(engine, name: str, error: Exception) -> threading.Event:
    """A required after-restore hook ``name`` that raises ``error`` until the event it
    returns is set (its cause fixed)."""
    fixed = threading.Event()

    @engine.registry.after_restore(name=name)
    def hook() -> None:
        if not fixed.is_set():
            raise error

    return fixed


@pytest.fixture
def adapter(sidecar, rehydrate_engine) -> Iterator[AgonesAdapter]:
    a = _adapter(sidecar, rehydrate_engine)
    a.install()
    try:
        yield a
    finally:
        a.close()


def test_sdk_calls_hit_the_documented_endpoints(sidecar, adapter):
    adapter.ready()
    adapter.set_label("map", "dust")
    adapter.set_annotation("match", "m-1")
    gs = adapter.gameserver()
    assert gs["status"]["state"] == "Ready"
    assert gs["object_meta"]["labels"] == {"agones.dev/sdk-map": "dust"}
    assert gs["object_meta"]["annotations"] == {"agones.dev/sdk-match": "m-1"}
    assert isinstance(gs["object_meta"]["creation_timestamp"], str)  # int64 as string
    assert [r.body for r in sidecar.calls("PUT", "/metadata/label")] == [
        {"key": "map", "value": "dust"}]
    assert [r.body for r in sidecar.calls("POST", "/ready")] == [{}]
    adapter.reserve(10)
    assert sidecar.wait_for("POST", "/reserve")[0].body == {"seconds": "10"}  # logged once answered
    adapter.allocate()
    assert adapter.gameserver()["status"]["state"] == "Allocated"
    adapter.shutdown()
    assert sidecar.gs.state == "Shutdown"


async def test_async_twins(sidecar, adapter):
    await adapter.aready()
    await adapter.aset_label("mode", "ctf")
    await adapter.aset_annotation("seed", "7")
    await adapter.aallocate()
    gs = await adapter.agameserver()
    assert gs["status"]["state"] == "Allocated"
    assert gs["object_meta"]["labels"]["agones.dev/sdk-mode"] == "ctf"
    await adapter.ashutdown()
    assert sidecar.gs.state == "Shutdown"


def test_health_pings_every_interval_and_watch_follows(sidecar, adapter):
    pings = sidecar.wait_for("POST", "/health", count=3)
    gaps = [b.mono - a.mono for a, b in zip(pings, pings[1:])]
    assert all(g >= INTERVAL * 0.9 for g in gaps), gaps
    seen: list[str] = []
    adapter.on_change(lambda gs: seen.append(gs["status"]["state"]))
    sidecar.wait_for("GET", "/watch/gameserver")
    sidecar.set_state("Allocated")
    wait_for(lambda: "Allocated" in seen, what="the watch stream to deliver Allocated")
    assert adapter.known_gameserver["status"]["state"] == "Allocated"
    assert rehydrate_status(adapter)["state"] == "Allocated"


def rehydrate_status(adapter: AgonesAdapter) -> dict:
    return adapter.engine.status().extra["agones"]


def test_snapshot_stops_loops_and_restore_resyncs(sidecar, rehydrate_engine):
    adapter = _adapter(sidecar, rehydrate_engine, health_interval=1.0)
    adapter.install()
    try:
        _snapshot_then_restore(sidecar, adapter, rehydrate_engine)
    finally:
        adapter.close()


def _snapshot_then_restore(sidecar, adapter, rehydrate_engine):
    adapter.ready()
    adapter.set_label("map", "dust")
    adapter.set_annotation("match", "m-1")
    sidecar.wait_for("GET", "/watch/gameserver")
    assert rehydrate_engine.simulate_snapshot().ok
    t_snap = time.monotonic()
    # The sidecar forgets what the adapter set (a new Pod's sidecar) and is not Ready.
    with sidecar.cond:
        sidecar.gs.labels.clear()
        sidecar.gs.annotations.clear()
    sidecar.set_state("Scheduled")
    time.sleep(1.5)  # long enough for a ping, had the loop kept running
    assert sidecar.calls("POST", "/health", since=t_snap) == [], "health loop kept running"

    t0 = time.monotonic()
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    first = sidecar.wait_for("POST", "/health", since=t0)[0]
    # "Right after restore" as causality, not wall time: the health loop restarts with a
    # ping in the same step as the resync's GET /gameserver, so the two arrive together
    # however loaded the machine is; a loop that slept first would ping a whole
    # health_interval after that GET.
    resync = sidecar.wait_for("GET", "/gameserver", since=t0)[0]
    assert abs(first.mono - resync.mono) < adapter.health_interval / 2, (
        "first ping after restore is late", first.mono - resync.mono)
    sidecar.wait_for("POST", "/ready", count=2)  # ready() before, and once more now
    gs = adapter.gameserver()
    assert gs["object_meta"]["labels"] == {"agones.dev/sdk-map": "dust"}
    assert gs["object_meta"]["annotations"] == {"agones.dev/sdk-match": "m-1"}
    assert gs["status"]["state"] == "Ready"
    sidecar.wait_for("GET", "/watch/gameserver", count=2)
    assert rehydrate_status(adapter)["reason"] == ""


@pytest.mark.parametrize("state", ["Ready", "Allocated", "Reserved"])
def test_no_ready_after_restore_when_state_does_not_need_it(sidecar, adapter,
                                                            rehydrate_engine, state):
    adapter.ready()
    sidecar.set_state(state)
    assert rehydrate_engine.simulate_restore().ok
    # A barrier: the adapter's loop runs the after-restore Ready decision before this.
    adapter.gameserver()
    assert len(sidecar.calls("POST", "/ready")) == 1
    assert sidecar.gs.state == state


@pytest.mark.parametrize("answer", [[], {}, {"object_meta": {}, "status": {}}])
def test_an_allocated_server_is_never_marked_ready_on_an_answer_of_unknown_state(
        sidecar, adapter, rehydrate_engine, answer):
    """A sidecar answering GET /gameserver with 200 ``[]`` or ``{}`` after the restore:
    taken for a GameServer of unknown state, it got a POST /ready — an Allocated server
    (a match in progress) became Ready, to be allocated a second time."""
    adapter.ready()
    sidecar.set_state("Allocated")
    sidecar.faults.answer["/gameserver"] = answer
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    [resync] = [h for h in report.hooks if h.name == "rehydrate.agones.resync"]
    assert "answered something that is not a GameServer" in str(resync.error)
    sidecar.faults.answer.clear()
    adapter.gameserver()  # barrier: the adapter's loop has made its Ready decision
    assert len(sidecar.calls("POST", "/ready")) == 1  # the one before the snapshot
    assert sidecar.gs.state == "Allocated"


def test_no_ready_after_restore_when_ready_was_never_called(sidecar, adapter,
                                                            rehydrate_engine):
    assert rehydrate_engine.simulate_restore().ok
    adapter.gameserver()  # barrier, as above
    assert sidecar.calls("POST", "/ready") == []


def test_sidecar_that_never_answers_leaves_server_not_ready(sidecar, rehydrate_engine):
    a = _adapter(sidecar, rehydrate_engine, deadline=0.5, request_timeout=0.2)
    a.install()
    try:
        a.ready()
        sidecar.faults.hang = True
        report = rehydrate_engine.simulate_restore()
        assert not report.ok, report.table()
        assert not rehydrate_engine.is_ready()
        failed = [h for h in report.hooks if h.name == "rehydrate.agones.resync"]
        assert [h.outcome for h in failed] == ["failed"], report.table()
        message = str(failed[0].error)
        assert "did not answer GET /gameserver within the 0.5s deadline" in message, \
            report.table()
        assert a.status()["reason"] == message
        assert [h.outcome for h in report.hooks if h.name != "rehydrate.agones.resync"] == \
            ["ok"] * (len(report.hooks) - 1), report.table()
        # the watch stream keeps retrying: once the sidecar answers, it is back
        n_watch = len(sidecar.calls("GET", "/watch/gameserver"))
        sidecar.faults.hang = False
        sidecar.wait_for("GET", "/watch/gameserver", count=n_watch + 1, timeout=15)
    finally:
        sidecar.faults.hang = False
        a.close()
    assert len(sidecar.calls("POST", "/ready")) == 1, "Ready must not follow a failed restore"


def test_sidecar_down_at_first_is_waited_for(rehydrate_engine, caplog):
    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "health ping failed" in r.getMessage()]

    with AgonesSidecar(down_for=None) as sc, \
            caplog.at_level(logging.DEBUG, logger="rehydrate.agones"):
        a = _adapter(sc, rehydrate_engine, deadline=30.0, request_timeout=0.5)
        a.install()  # health loop fails (connection refused) and retries
        try:
            wait_for(warnings, what="a failed health ping")
            result = {}
            restore = threading.Thread(
                target=lambda: result.update(report=rehydrate_engine.simulate_restore()))
            restore.start()
            wait_for(lambda: a.status()["reason"].startswith("restoring"),
                  what="the restore to wait for the sidecar")
            assert not rehydrate_engine.is_ready()
            sc.up()
            restore.join(30)
            assert result["report"].ok, result["report"].table()
            wait_for(lambda: a.health_acks >= 1, what="an acknowledged health ping")
        finally:
            a.close()
    assert len(warnings()) == 1, [r.getMessage() for r in caplog.records]
    assert any("works again" in r.getMessage() for r in caplog.records)


def test_health_500s_are_retried_never_a_hook_failure(sidecar, rehydrate_engine):
    a = _adapter(sidecar, rehydrate_engine, health_interval=30.0)
    a.install()
    try:
        # Only the loop the restore starts may meet the 500s. Armed before install(), a
        # ping of the first loop could take one and then be cancelled by the restore's
        # ping hook: the sidecar's answer hit a closed connection (BrokenPipeError) and was
        # never recorded, so 2 of the 3 500s were seen (a full-suite run on a loaded box).
        # So: the first loop's ping acknowledged (it now sleeps its 30 s interval, nothing
        # in flight), the loops paused by the before-snapshot hooks, then the 500s armed.
        wait_for(lambda: a.health_acks >= 1, what="the first loop's ping")
        assert rehydrate_engine.simulate_snapshot().ok
        acks = a.health_acks
        sidecar.fail_next(3, "/health")
        t0 = time.monotonic()
        report = rehydrate_engine.simulate_restore()
        assert report.ok, report.table()
        # three 500s, then an answered ping: retried with backoff (at most 0.35 s in all),
        # not paced by the 30 s interval; the rest of the bound is room for a loaded machine
        ok = sidecar.wait_for("POST", "/health", count=1, since=t0)
        errors = [r for r in sidecar.calls("POST", "/health", since=t0) if r.status == 500]
        assert len(errors) == 3
        assert errors[-1].mono < ok[0].mono  # the answered ping is the retry after them
        assert ok[0].mono - errors[0].mono < 5.0
        wait_for(lambda: a.health_acks > acks, what="the adapter to see the acknowledgement")
    finally:
        a.close()


def test_slow_sidecar_still_syncs(sidecar, rehydrate_engine):
    a = _adapter(sidecar, rehydrate_engine, request_timeout=2.0)
    a.install()
    try:
        a.set_label("map", "dust")
        sidecar.faults.delay = 0.3
        report = rehydrate_engine.simulate_restore()
        assert report.ok, report.table()
        sidecar.wait_for("PUT", "/metadata/label", count=2)  # logged once answered
        assert len(sidecar.calls("PUT", "/metadata/label")) == 2
    finally:
        sidecar.faults.delay = 0.0
        a.close()


def test_ready_while_not_ready_is_deferred(sidecar, adapter, rehydrate_engine):
    fixed = _failing_hook(rehydrate_engine, "game.flaky", RuntimeError("not yet"))

    assert not rehydrate_engine.simulate_restore().ok
    adapter.ready()  # degraded: remembered, not sent
    assert sidecar.calls("POST", "/ready") == []
    fixed.set()
    assert rehydrate_engine.simulate_restore().ok
    sidecar.wait_for("POST", "/ready")
    wait_for(lambda: "rehydrate-agones-ready" not in [t.name for t in threading.enumerate()],
             what="the readiness waiter to end")
    adapter.gameserver()  # barrier: the adapter's loop has run what was handed to it
    assert len(sidecar.calls("POST", "/ready")) == 1  # the report and the waiter: once


def test_ready_deferred_while_not_ready_goes_out_when_readiness_returns_without_a_report(
        sidecar, adapter, rehydrate_engine):
    """ready() during a late freeze-watch heartbeat (a stall the clock-jump detector then
    judged no restore: no report follows) waited for a report that never came; status
    said ready_requested while POST /ready was never sent."""
    # What the clock-jump detector calls: a beat older than its limit, then a fresh one.
    rehydrate_engine.heartbeat(time.monotonic() - 3.0, 1.0)
    assert not rehydrate_engine.is_ready()
    adapter.ready()
    assert sidecar.calls("POST", "/ready") == []
    assert adapter.status()["ready_requested"]
    rehydrate_engine.heartbeat(time.monotonic(), 1.0)
    assert rehydrate_engine.is_ready() and rehydrate_engine.status().last_report is None
    sidecar.wait_for("POST", "/ready")
    assert sidecar.gs.state == "Ready"


def test_a_failed_restore_that_recovers_without_a_new_run_marks_the_gameserver_ready(
        sidecar, adapter, rehydrate_engine):
    """A clone restored before its secret arrived: the required hook fails (degraded, no
    Ready); the hook recovers later without a new run (``engine.recovered()``, which a
    secret's successful reload calls) and publishes no report — Ready must still go out,
    or the clone's new GameServer stays Scheduled for good."""
    _failing_hook(rehydrate_engine, "game.secret", FileNotFoundError("not mounted yet"))

    adapter.ready()
    sidecar.wait_for("POST", "/ready")
    sidecar.wait_for("GET", "/watch/gameserver")
    assert rehydrate_engine.simulate_snapshot().ok
    sidecar.set_state("Scheduled")  # a new Pod's GameServer
    t0 = time.monotonic()
    assert not rehydrate_engine.simulate_restore().ok
    sidecar.wait_for("GET", "/gameserver", since=t0)  # the resync ran
    adapter.gameserver()  # barrier: the adapter's loop has run what was handed to it
    assert sidecar.calls("POST", "/ready", since=t0) == []  # degraded: not Ready
    assert rehydrate_engine.recovered("game.secret")
    sidecar.wait_for("POST", "/ready", since=t0)
    assert sidecar.gs.state == "Ready"


def test_request_errors_are_one_clear_line(rehydrate_engine):
    with AgonesSidecar() as sc:
        sc.wait_listening()
        a = _adapter(sc, rehydrate_engine)
        try:
            sc.fail_next(1, "/allocate")
            with pytest.raises(AgonesError, match=r"POST /allocate .* failed: HTTP 500"):
                a.allocate()
            sc.faults.refuse_keys.add("refused")
            with pytest.raises(AgonesError, match="HTTP 400"):
                a.set_label("refused", "x")
            with pytest.raises(ValueError, match=r"label key 'bad key!' is not valid"):
                a.set_label("bad key!", "x")
            assert a.gameserver()["object_meta"]["labels"] == {}
        finally:
            a.close()


def test_port_from_environment(monkeypatch):
    monkeypatch.setenv("AGONES_SDK_HTTP_PORT", "9400")
    assert AgonesAdapter().base_url == "http://localhost:9400"
    monkeypatch.delenv("AGONES_SDK_HTTP_PORT")
    assert AgonesAdapter().base_url == "http://localhost:9358"
    monkeypatch.setenv("AGONES_SDK_HTTP_PORT", "http")
    with pytest.raises(ValueError, match="AGONES_SDK_HTTP_PORT must be a port number"):
        AgonesAdapter()
    with pytest.raises(ValueError, match="health_interval"):
        AgonesAdapter(9358, 0)


@pytest.mark.parametrize("raw", ["http", "s3cret-token", "70000", "0", "-1", "+9_358",
                                 "9" * 5000, "٩٣٥٨"])
def test_a_bad_port_in_the_environment_is_named_without_its_value(monkeypatch, caplog, raw):
    """An invalid AGONES_SDK_HTTP_PORT was quoted in the error (a value out of range even
    as "Agones SDK port must be an int in 1..65535, not 70000"): environment values are
    never repeated, key names only. Nothing is built."""
    monkeypatch.setenv("AGONES_SDK_HTTP_PORT", raw)
    with pytest.raises(ValueError) as info:
        AgonesAdapter()
    message = str(info.value)
    assert message == ("AGONES_SDK_HTTP_PORT must be a port number 1-65535 (its value is "
                       "not shown: environment values never are)")
    assert raw not in caplog.text


def test_hooks_are_named_and_removed_on_close(sidecar, rehydrate_engine):
    a = _adapter(sidecar, rehydrate_engine)
    a.install()
    a.install()  # idempotent
    names = [h.name for h in rehydrate_engine.hooks("restore")]
    assert names.count("rehydrate.agones.resync") == 1
    # the ping stays first of all, before the environment refresh (itself below the
    # orders user hooks may take)
    assert names[:2] == ["rehydrate.agones.ping", "rehydrate.env"]
    a.close()
    assert "rehydrate.agones.resync" not in [h.name for h in rehydrate_engine.hooks("restore")]
    with pytest.raises(RuntimeError, match="closed"):
        a.ready()


async def test_async_calls_do_not_block_the_callers_loop(sidecar, adapter):
    sidecar.faults.delay = 0.3
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    t = asyncio.create_task(ticker())
    await adapter.aset_label("a", "b")
    t.cancel()
    sidecar.faults.delay = 0.0
    assert ticks >= 10


def test_adapter_is_an_extension(sidecar, rehydrate_environ):
    from rehydrate import Lifecycle, Registry
    from rehydrate.env import EnvRefresher
    from rehydrate.extensions import Extension

    a = AgonesAdapter(sidecar.port, INTERVAL)
    assert isinstance(a, Extension)
    probe = a.probe()
    assert probe.usable and f"localhost:{sidecar.port} (the port argument)" in probe.reason
    engine = Lifecycle(Registry(), env=EnvRefresher(path=None), extensions=[a])
    try:
        assert engine.installed == ["agones"]
        assert a.engine is engine
        sidecar.wait_for("POST", "/health")
        assert engine.simulate_restore().ok
        assert engine.status().extra["agones"]["gameserver"] == sidecar.gs.name
    finally:
        a.close()
        engine.close()


def test_blocking_call_from_a_listener_is_refused_not_a_deadlock(sidecar, adapter):
    errors: list[BaseException] = []

    def listener(gs):
        try:
            adapter.set_label("from", "listener")
        except RuntimeError as exc:
            errors.append(exc)

    adapter.on_change(listener)
    adapter.gameserver()  # a fetch delivers the GameServer to the listeners
    assert errors and "a-prefixed twin" in str(errors[0])
    assert adapter.gameserver()["object_meta"]["labels"] == {}


def test_a_gameserver_of_another_shape_is_one_clear_error_or_ignored(sidecar, adapter,
                                                                     monkeypatch, caplog):
    """{"status": "Ready"} (a string where the GameServer has an object) used to fail the
    restore hook with an AttributeError naming nothing, and a watch line like it was
    kept, breaking status() afterwards."""
    before = adapter.known_gameserver
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        adapter._watched('{"result": {"status": "Ready", "object_meta": "x"}}')
    assert adapter.known_gameserver is before and "ignoring a line" in caplog.text

    async def shapeless(*args, **kwargs):
        return {"status": "Ready"}

    monkeypatch.setattr(adapter, "_request", shapeless)
    with pytest.raises(AgonesError, match="answered something that is not a GameServer"):
        adapter.gameserver()
    assert isinstance(adapter.status()["state"], (str, type(None)))


def test_the_first_ping_after_a_restore_does_not_wait_for_other_hooks(sidecar,
                                                                      rehydrate_engine):
    """A managed connection to an unreachable peer, registered before the adapter, ran
    first in the connections phase: the first health ping waited for its whole deadline
    (30 s by default) — longer than Agones' health window, so the server went Unhealthy."""
    from rehydrate import connections

    def refused() -> None:
        raise ConnectionRefusedError("peer down")

    # required: an optional one no longer holds the run (it reopens in the background)
    connections.register("peer", open=refused, deadline=2.0, engine=rehydrate_engine)
    a = _adapter(sidecar, rehydrate_engine)
    a.install()
    try:
        assert rehydrate_engine.simulate_snapshot().ok  # the health loop stops here
        t0 = time.monotonic()
        run = threading.Thread(target=rehydrate_engine.simulate_restore)
        run.start()
        first = sidecar.wait_for("POST", "/health", since=t0)[0]
        run.join(30)
        finished = time.monotonic()
        assert first.mono - t0 < 1.0, first.mono - t0
        assert finished - t0 >= 2.0  # the connection's deadline: the run really waited
    finally:
        a.close()


def test_a_label_set_between_the_pause_and_the_restore_is_sent_after_it(
        sidecar, adapter, rehydrate_engine):
    """Sent at once, it opened a keep-alive connection that the snapshot froze."""
    assert rehydrate_engine.simulate_snapshot().ok
    t_pause = time.monotonic()
    adapter.set_label("map", "dust")
    assert sidecar.calls("PUT", "/metadata/label", since=t_pause) == []
    assert rehydrate_engine.simulate_restore().ok
    sidecar.wait_for("PUT", "/metadata/label", since=t_pause)  # logged once answered
    assert [r.body for r in sidecar.calls("PUT", "/metadata/label", since=t_pause)] == [
        {"key": "map", "value": "dust"}]
    assert adapter.gameserver()["object_meta"]["labels"] == {"agones.dev/sdk-map": "dust"}


def test_a_sidecar_that_keeps_refusing_is_not_said_to_be_silent(sidecar, rehydrate_engine):
    a = _adapter(sidecar, rehydrate_engine, deadline=0.5, request_timeout=0.45)
    a.install()
    try:
        sidecar.faults.fail, sidecar.faults.paths = 1000, ("/gameserver",)
        report = rehydrate_engine.simulate_restore()
        [resync] = [h for h in report.hooks if h.name == "rehydrate.agones.resync"]
        assert "kept refusing GET /gameserver within the 0.5s deadline" in str(resync.error)
    finally:
        a.close()


def test_a_refusing_sidecar_is_named_so_though_the_last_attempt_ran_out_of_time(
        sidecar, rehydrate_engine):
    """The message was taken from the last attempt alone, which the deadline may cut to
    a sliver (10 ms): a sidecar that answered 500 every time it had the time to was
    reported as one that "did not answer"."""
    a = _adapter(sidecar, rehydrate_engine, deadline=0.5, request_timeout=0.45)
    a.install()
    try:
        sidecar.faults.fail, sidecar.faults.paths = 1000, ("/gameserver",)
        sidecar.faults.delay = 0.15  # the first attempt is answered, the last cannot be
        report = rehydrate_engine.simulate_restore()
        [resync] = [h for h in report.hooks if h.name == "rehydrate.agones.resync"]
        assert "kept refusing GET /gameserver within the 0.5s deadline" in str(resync.error)
    finally:
        a.close()


@pytest.mark.parametrize(("kind", "key", "value"), [
    ("label", "bad key!", "v"), ("label", "k" * 60, "v"), ("label", "x.", "v"),
    ("label", "map", "not a value"), ("label", "map", "v" * 64),
    ("annotation", "a/b", "any value at all"),
])
def test_metadata_the_sidecar_would_refuse_is_refused_at_once_even_while_paused(
        sidecar, adapter, rehydrate_engine, kind, key, value):
    """While paused for a snapshot, set_label("bad key!", ...) used to be stored silently;
    every restore then PUT it again for the whole deadline and failed the resync."""
    setter = adapter.set_label if kind == "label" else adapter.set_annotation
    with pytest.raises(ValueError, match="is not (a )?valid") as outside:
        setter(key, value)
    assert rehydrate_engine.simulate_snapshot().ok
    with pytest.raises(ValueError, match="is not (a )?valid") as paused:
        setter(key, value)
    assert str(paused.value) == str(outside.value) and "\n" not in str(paused.value)
    if kind == "label" and value != "v":
        assert value not in str(paused.value)  # a value is never echoed
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert sidecar.calls("PUT", f"/metadata/{kind}") == []


def test_a_refused_label_is_dropped_once_and_the_others_still_applied(
        sidecar, rehydrate_engine, caplog):
    """A key the sidecar refuses (HTTP 400) was retried like an outage for the whole
    deadline after every restore, failing the resync so POST /ready never went out."""
    a = _adapter(sidecar, rehydrate_engine, deadline=30.0)
    a.install()
    try:
        a.ready()
        assert rehydrate_engine.simulate_snapshot().ok
        a.set_label("refused", "x")
        a.set_label("map", "dust")
        a.set_annotation("match", "m-1")
        sidecar.faults.refuse_keys.add("refused")
        sidecar.set_state("Scheduled")  # a new Pod's GameServer: Ready is asked again
        with caplog.at_level(logging.WARNING, logger="rehydrate.agones"):
            report = rehydrate_engine.simulate_restore()
        assert report.ok, report.table()
        refused = [r for r in sidecar.calls("PUT", "/metadata/label")
                   if r.body["key"] == "refused"]
        assert len(refused) == 1, "a refusal must not be retried"
        warnings = [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and "refused label 'refused'" in
                    r.getMessage()]
        assert len(warnings) == 1, caplog.text
        gs = a.gameserver()
        assert gs["object_meta"]["labels"] == {"agones.dev/sdk-map": "dust"}
        assert gs["object_meta"]["annotations"] == {"agones.dev/sdk-match": "m-1"}
        sidecar.wait_for("POST", "/ready", count=2)
        assert a.status()["reason"] == ""
        # dropped for good: the next restore does not send it again
        assert rehydrate_engine.simulate_restore().ok
        assert len([r for r in sidecar.calls("PUT", "/metadata/label")
                    if r.body["key"] == "refused"]) == 1
    finally:
        a.close()


def test_a_refused_gameserver_fetch_fails_the_resync_and_is_retried_in_the_background(
        sidecar, rehydrate_engine):
    """The hook fails at once on the refusal (not retried until the deadline); the
    resync then went on nowhere, so the known GameServer, the labels and the annotations
    stayed stale, and the engine degraded, until the next restore. Now it is retried in
    the background until the sidecar gives the GameServer, and the hook recovers."""
    a = _adapter(sidecar, rehydrate_engine, deadline=30.0)
    a.install()
    try:
        a.ready()
        a.set_label("map", "dust")
        sidecar.wait_for("GET", "/watch/gameserver")
        assert rehydrate_engine.simulate_snapshot().ok
        with sidecar.cond:
            sidecar.gs.labels.clear()  # a clone's new Pod
        sidecar.set_state("Scheduled")
        sidecar.fail_next(3, "/gameserver", status=403)
        t0 = time.monotonic()
        report = rehydrate_engine.simulate_restore()
        [resync] = [h for h in report.hooks if h.name == "rehydrate.agones.resync"]
        assert resync.outcome == "failed" and "HTTP 403" in str(resync.error)
        assert report.duration < a.deadline / 2  # failed at once, not at the deadline
        assert not report.ok
        # the hook's GET and two background ones refused, then the GameServer
        refused = sidecar.wait_for("GET", "/gameserver", count=3, status=403, since=t0)
        [fetched] = sidecar.wait_for("GET", "/gameserver", since=t0)
        assert fetched.mono > refused[-1].mono
        assert rehydrate_engine.wait_ready(15), rehydrate_engine.status()
        assert sidecar.gs.labels == {"agones.dev/sdk-map": "dust"}
        sidecar.wait_for("POST", "/ready", since=t0)
        assert sidecar.gs.state == "Ready"
        assert a.status()["reason"] == ""
        assert a._recover_task is None or a._recover_task.done()
    finally:
        sidecar.faults.fail = 0
        a.close()


def test_the_background_retry_of_a_refused_fetch_stops_at_the_pause_and_at_close(
        sidecar, rehydrate_engine):
    a = _adapter(sidecar, rehydrate_engine, deadline=30.0)
    a.install()
    try:
        sidecar.fail_next(10**6, "/gameserver", status=404)
        t0 = time.monotonic()
        assert not rehydrate_engine.simulate_restore().ok
        sidecar.wait_for("GET", "/gameserver", count=3, status=404, since=t0)
        task = a._recover_task
        assert task is not None
        assert rehydrate_engine.simulate_snapshot().ok
        assert task.cancelled() and a._recover_task is None
        t1 = time.monotonic()
        assert not rehydrate_engine.simulate_restore().ok  # still refused: retried again
        sidecar.wait_for("GET", "/gameserver", count=3, status=404, since=t1)
        task = a._recover_task
        assert task is not None and not task.done()
        a.close()
        assert task.cancelled()
        assert not a._thread.is_alive()  # nothing left to send another request
    finally:
        sidecar.faults.fail = 0
        a.close()


@pytest.mark.parametrize("status", [408, 429])
def test_a_sidecar_asking_to_retry_later_is_retried(sidecar, rehydrate_engine, status):
    a = _adapter(sidecar, rehydrate_engine)
    a.install()
    try:
        sidecar.fail_next(2, "/gameserver", status=status)
        report = rehydrate_engine.simulate_restore()
        assert report.ok, report.table()
        sidecar.wait_for("GET", "/gameserver")  # recorded once answered: may lag the report
        assert len(sidecar.wait_for("GET", "/gameserver", count=2, status=status)) == 2
    finally:
        a.close()


DEEP_JSON = b"[" * 100_000 + b"]" * 100_000  # valid JSON that json.loads cannot nest into


def test_json_nested_too_deep_for_the_parser_is_not_json(rehydrate_engine):
    """resp.json() caught only ValueError: an answer nested deeper than json parses raised
    RecursionError out of the resync hook, and a watch line like it ended the watch loop
    for good (its errors are to be logged and retried)."""
    import httpx

    watches = []

    def sidecar(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/watch/gameserver":
            watches.append(1)
            return httpx.Response(200, content=b'{"result": ' + DEEP_JSON + b"}\n")
        if request.url.path == "/gameserver":
            return httpx.Response(200, content=DEEP_JSON)
        return httpx.Response(200, json={})

    a = AgonesAdapter(9358, INTERVAL, engine=rehydrate_engine, deadline=0.5,
                      request_timeout=1.0, transport=httpx.MockTransport(sidecar))
    a.install()
    try:
        wait_for(lambda: len(watches) >= 3, timeout=30.0,
                 what="the watch loop to go on after a line nested too deep")
        with pytest.raises(AgonesError, match="answered something that is not JSON"):
            a.gameserver()
        report = rehydrate_engine.simulate_restore()
        [resync] = [h for h in report.hooks if h.name == "rehydrate.agones.resync"]
        assert resync.outcome == "failed"
        assert "not JSON" in str(resync.error) and "Recursion" not in str(resync.error)
        # every attempt was answered: not "did not answer"
        assert "kept answering what is not JSON to GET /gameserver" in str(resync.error)
    finally:
        a.close()


def test_a_watch_line_without_end_is_refused_and_the_watch_retried(rehydrate_engine):
    """The watch stream was read with aiter_lines(): a stream that never sends a newline
    grew one line in memory for ever. A line longer than 1 MiB is now a stream error,
    retried like any other."""
    import asyncio

    import httpx

    watches = []

    async def no_newline():
        for _ in range(64):  # 4 MiB, then stalled: what an uncapped reader would wait on
            yield b"x" * 65536
        await asyncio.Event().wait()

    def sidecar(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/watch/gameserver":
            watches.append(1)
            return httpx.Response(200, content=no_newline())
        return httpx.Response(200, json={})

    a = AgonesAdapter(9358, INTERVAL, engine=rehydrate_engine, deadline=0.5,
                      request_timeout=1.0, transport=httpx.MockTransport(sidecar))
    a.install()
    try:
        wait_for(lambda: len(watches) >= 2, timeout=30.0,
                 what="the watch loop to give up the endless line and watch again")
    finally:
        a.close()


@pytest.mark.parametrize("kwargs", [{"deadline": 10**400}, {"request_timeout": 1e300},
                                    {"health_interval": 0}, {"deadline": float("nan")}],
                         ids=["deadline-1e400", "request_timeout-1e300", "health-0", "nan"])
def test_a_number_of_seconds_out_of_range_is_one_clear_error(kwargs):
    """deadline=10**400 failed with OverflowError: int too large to convert to float."""
    [(what, value)] = kwargs.items()
    with pytest.raises(ValueError) as info:
        AgonesAdapter(9358, **kwargs)
    assert str(info.value).startswith(f"{what} must be a number of seconds > 0 and at most "
                                      "31536000 (a year), not ")
    assert len(str(info.value)) < 120


@pytest.mark.parametrize("seconds", [-5, True, "10", 2.5, float("nan"), float("inf"),
                                     pytest.param(10**400, id="1e400"), None])
def test_reserve_refuses_what_is_no_whole_number_of_seconds(sidecar, adapter, seconds):
    """``int(seconds)`` took anything: -5 went out (Agones reserves for ever for anything
    not above 0), True reserved for 1 s, "10" and 2.5 (cut to 2) passed, NaN and infinity
    failed naming neither the argument nor the rule. Nothing is sent, the state stays."""
    adapter.ready()
    with pytest.raises(ValueError, match=r"^reserve\(\): seconds must be a whole number "
                                         r"from 0 \(until allocated\) to 31536000 \(a year\)"
                                         r", not "):
        adapter.reserve(seconds)
    with pytest.raises(ValueError, match=r"^reserve\(\): seconds must be"):
        asyncio.run(adapter.areserve(seconds))
    assert sidecar.calls("POST", "/reserve") == []
    assert sidecar.gs.state == "Ready"


def test_reserve_takes_whole_numbers_up_to_a_year(sidecar, adapter):
    import numpy as np

    cases = ((0, "0"), (30.0, "30"), (np.int64(7), "7"), (31_536_000, "31536000"))
    for n, (seconds, sent) in enumerate(cases, start=1):
        adapter.reserve(seconds)
        # the sidecar logs a request once it has answered it: wait, do not read at once
        assert sidecar.wait_for("POST", "/reserve", count=n)[-1].body == {"seconds": sent}


def _restore_with_a_duplicate_notice_queued(engine, during=None):
    """A restore run during which a second notice of the same restore (same key) arrives
    and queues behind it, as when the clock-jump detector runs the restore and
    ``rehydrate notify restore`` comes a moment later: the run's report is published while
    that notice still counts, so the engine is not ready then; the notice then runs
    nothing and publishes no report."""
    duplicates: list[threading.Thread] = []

    @engine.registry.after_restore(name="test.duplicate-notice")
    def queue_duplicate() -> None:
        if duplicates:
            return
        if during is not None:
            during()
        t = threading.Thread(target=engine.restore_detected, args=("control",),
                             kwargs={"key": "the-restore"})
        duplicates.append(t)
        t.start()
        # counted as soon as it arrives, before it waits for this run (no public count)
        wait_for(lambda: engine._notices >= 2, what="the duplicate notice to be counted")

    published: list[object] = []
    engine.add_listener(published.append)
    t0 = time.monotonic()
    report = engine.restore_detected("clock-jump", key="the-restore")
    assert report.ok, report.table()
    duplicates[0].join(10)
    assert not duplicates[0].is_alive()
    assert published == [report]  # the duplicate published nothing
    return t0


def test_a_clone_is_marked_ready_when_a_duplicate_restore_notice_was_queued(
        sidecar, adapter, rehydrate_engine):
    """The clone's new GameServer (Scheduled) was never marked Ready: the report found the
    engine not ready (the duplicate notice still queued), dropped the Ready and nothing
    retried it."""
    adapter.ready()
    sidecar.set_state("Scheduled")
    t0 = _restore_with_a_duplicate_notice_queued(rehydrate_engine)
    assert rehydrate_engine.is_ready()
    sidecar.wait_for("POST", "/ready", since=t0)
    assert sidecar.gs.state == "Ready"


def test_ready_called_during_a_restore_with_a_duplicate_notice_queued_goes_out(
        sidecar, adapter, rehydrate_engine):
    """ready() during the restore run was deferred, then the report (engine not ready:
    the duplicate notice) cancelled the deferral: Ready was never sent."""
    t0 = _restore_with_a_duplicate_notice_queued(rehydrate_engine, during=adapter.ready)
    assert adapter.status()["ready_requested"]
    sidecar.wait_for("POST", "/ready", since=t0)
    assert sidecar.gs.state == "Ready"
    adapter.gameserver()  # barrier: the adapter's loop has run what was handed to it
    assert len(sidecar.calls("POST", "/ready")) == 1


_GS = {"object_meta": {"name": "gs-1", "uid": "u-1"}, "status": {"state": "Ready"}}
_ENDED_STREAMS = {
    # grpc-gateway's answer to a watch that fails: 200, one error line, the end
    "error-line": b'{"error": {"grpc_code": 14, "http_code": 503, "message": "x"}}\n',
    "bad-line": b'{"result": null}\n',
    "empty": b"",
}


def _ending_watch(engine, body: bytes, health_interval: float):
    """An adapter whose watch stream answers 200 with ``body`` and ends, every time; the
    monotonic time of every watch request."""
    import json

    import httpx

    watches: list[float] = []

    def sidecar(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/watch/gameserver":
            watches.append(time.monotonic())
            return httpx.Response(200, content=body)
        if request.url.path == "/gameserver":
            return httpx.Response(200, content=json.dumps(_GS).encode())
        return httpx.Response(200, json={})

    a = AgonesAdapter(9358, health_interval, engine=engine, deadline=0.5,
                      request_timeout=1.0, transport=httpx.MockTransport(sidecar))
    return a, watches


@pytest.mark.parametrize("body", list(_ENDED_STREAMS.values()), ids=list(_ENDED_STREAMS))
def test_a_watch_stream_answering_200_and_ending_backs_off(rehydrate_engine, caplog, body):
    """The backoff was reset as soon as the 200 arrived: a stream that failed that way
    (grpc-gateway's error line) was asked for again every 25-50 ms, each time with a new
    warning (86 watches and up to 172 warnings in 5 s)."""
    interval = 0.3
    a, watches = _ending_watch(rehydrate_engine, body, interval)
    with caplog.at_level(logging.DEBUG, logger="rehydrate.agones"):
        a.install()
        try:
            wait_for(lambda: len(watches) >= 4, timeout=30.0, what="four watch requests")
        finally:
            a.close()
    gaps = [b - a for a, b in zip(watches, watches[1:])]
    assert all(g >= interval for g in gaps), gaps
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([w for w in warnings if "GameServer watch failed" in w]) == 1, warnings
    assert len([w for w in warnings if "ignoring a line" in w]) <= 1, warnings
    if body.startswith(b'{"error"'):
        assert "the watch stream sent an error (HTTP 503, gRPC code 14)" in warnings[0]


def test_a_watch_stream_that_ends_after_the_same_gameserver_runs_no_listener_again(
        rehydrate_engine, caplog):
    """Each reopened stream delivers the current GameServer first: every on_change
    listener ran again for an unchanged GameServer, as often as the stream ended (and a
    warning was logged each time). A stream that worked and ended is said once, at info."""
    import json

    interval = 0.3
    body = json.dumps({"result": _GS}).encode() + b"\n"
    a, watches = _ending_watch(rehydrate_engine, body, interval)
    seen: list[dict] = []
    a.on_change(seen.append)
    with caplog.at_level(logging.DEBUG, logger="rehydrate.agones"):
        a.install()
        try:
            wait_for(lambda: len(watches) >= 3, timeout=30.0, what="three watch requests")
            a.gameserver()  # a fetch of the same GameServer: no change either
        finally:
            a.close()
    assert seen == [_GS]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert len([r for r in caplog.records if r.levelno == logging.INFO
                and "watch stream ended" in r.getMessage()]) == 1
    gaps = [b - a for a, b in zip(watches, watches[1:])]
    assert all(g >= interval for g in gaps), gaps


def test_ready_and_a_label_that_failed_unheard_are_sent_after_a_restore(rehydrate_engine):
    """ready() and set_label() that failed because the sidecar was not up yet were
    forgotten: a restore neither asked to be Ready nor applied the label."""
    with AgonesSidecar(down_for=None) as sc:
        a = _adapter(sc, rehydrate_engine, request_timeout=0.5)
        a.install()
        try:
            with pytest.raises(AgonesError, match="POST /ready"):
                a.ready()
            with pytest.raises(AgonesError, match="PUT /metadata/label"):
                a.set_label("map", "dust")
            assert a.status()["ready_requested"]
            sc.up()
            sc.wait_listening()
            t0 = time.monotonic()
            assert rehydrate_engine.simulate_restore().ok  # the GameServer is Scheduled
            sc.wait_for("POST", "/ready", since=t0)
            assert sc.gs.labels == {"agones.dev/sdk-map": "dust"}
            assert sc.gs.state == "Ready"
        finally:
            a.close()


def test_ready_and_a_label_the_sidecar_refused_are_not_remembered(sidecar, adapter,
                                                                   rehydrate_engine):
    sidecar.fail_next(2, "/ready", "/metadata/label", status=400)
    with pytest.raises(AgonesError, match="HTTP 400"):
        adapter.ready()
    with pytest.raises(AgonesError, match="HTTP 400"):
        adapter.set_label("map", "dust")
    assert not adapter.status()["ready_requested"]
    t0 = time.monotonic()
    assert rehydrate_engine.simulate_restore().ok
    adapter.gameserver()  # barrier: the adapter's loop has made its Ready decision
    assert sidecar.calls("POST", "/ready", since=t0) == []
    assert sidecar.calls("PUT", "/metadata/label", since=t0) == []


def test_a_watch_stopped_as_its_request_fails_leaves_no_unretrieved_error(
        rehydrate_engine, caplog):
    """close() or the before-snapshot pause stopping the watch loop in the very step its
    request failed (the sidecar unreachable): the request's error was never read, and
    asyncio logged "Task exception was never retrieved" at ERROR with a long httpx
    traceback. The ordering is forced: the transport cancels the watch loop, then fails."""
    import gc

    import httpx

    failed = threading.Event()
    a: AgonesAdapter

    async def sidecar(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/watch/gameserver" and not failed.is_set():
            failed.set()
            assert a._watch_task is not None
            a._watch_task.cancel()  # what _stop_loops() does, at this very moment
            raise httpx.ConnectError("All connection attempts failed", request=request)
        return httpx.Response(200, json={})

    a = AgonesAdapter(9358, 60.0, engine=rehydrate_engine, deadline=0.5,
                      request_timeout=1.0, transport=httpx.MockTransport(sidecar))
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        a.install()
        try:
            assert failed.wait(10)
            wait_for(lambda: a._watch_task is not None and a._watch_task.done(),
                     what="the watch loop to end")
        finally:
            a.close()
        gc.collect()  # the failed request's task, once unreferenced, says what it holds
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


# -- the Ready after a restore, and the calls that supersede it -------------------------


def _retrying_ready_after_a_restore(sidecar, adapter, engine, monkeypatch, status=503):
    """A clone (its GameServer Scheduled) whose POST /ready after the restore the sidecar
    answers with ``status``; retries come fast. Returns the retry task and the time the
    restore began."""
    from rehydrate.adapters import agones as agones_module

    monkeypatch.setattr(agones_module, "_backoff", lambda attempt, cap: 0.01)
    adapter.ready()
    sidecar.wait_for("GET", "/watch/gameserver")
    assert engine.simulate_snapshot().ok
    sidecar.set_state("Scheduled")
    sidecar.fail_next(10**6, "/ready", status=status)
    t0 = time.monotonic()
    assert engine.simulate_restore().ok
    sidecar.wait_for("POST", "/ready", since=t0, status=status)
    return adapter._ready_task, t0


@pytest.mark.parametrize(("call", "state"), [
    (lambda a: a.allocate(), "Allocated"),
    (lambda a: a.reserve(0), "Reserved"),
    (lambda a: a.shutdown(), "Shutdown"),
], ids=["allocate", "reserve", "shutdown"])
def test_a_call_during_the_ready_retry_after_a_restore_stops_it(
        sidecar, adapter, rehydrate_engine, monkeypatch, call, state):
    """The retry loop ran on after allocate() (or shutdown()): once the sidecar took the
    POST /ready, the Allocated server was Ready again and a second match landed on it."""
    task, _ = _retrying_ready_after_a_restore(sidecar, adapter, rehydrate_engine,
                                              monkeypatch)
    assert task is not None
    call(adapter)
    sidecar.fail_next(0)  # a retry still running would now be answered
    wait_for(task.done, what="the Ready retry to end")
    [superseding] = [r for r in sidecar.requests if r.path in (
        "/allocate", "/reserve", "/shutdown")]
    # an attempt in flight was answered before the call went out, none came after it
    assert all(r.mono < superseding.mono for r in sidecar.calls("POST", "/ready"))
    assert sidecar.gs.state == state


def test_the_ready_retry_stops_when_the_watch_shows_the_server_allocated(
        sidecar, adapter, rehydrate_engine, monkeypatch):
    task, t0 = _retrying_ready_after_a_restore(sidecar, adapter, rehydrate_engine,
                                               monkeypatch)
    sidecar.set_state("Allocated")  # by Agones' allocator, say
    # The sidecar still answers 503: only the state the watch delivered ends the retry
    # (answering now could meet an attempt decided just before the watch line came).
    wait_for(task.done, what="the Ready retry to end")
    assert adapter.known_gameserver["status"]["state"] == "Allocated"
    assert [r.status for r in sidecar.calls("POST", "/ready", since=t0)
            if r.status == 200] == []
    assert sidecar.gs.state == "Allocated"


def test_a_refused_ready_after_a_restore_is_not_retried(sidecar, adapter, rehydrate_engine,
                                                        monkeypatch, caplog):
    """HTTP 400 was retried for good, a request a second."""
    with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
        task, t0 = _retrying_ready_after_a_restore(sidecar, adapter, rehydrate_engine,
                                                   monkeypatch, status=400)
        wait_for(task.done, what="the Ready retry to stop on the refusal")
    assert len(sidecar.calls("POST", "/ready", since=t0)) == 1
    refused = [r.getMessage() for r in caplog.records if "refused POST /ready" in
               r.getMessage()]
    assert refused == ["Agones sidecar refused POST /ready (after the restore) with HTTP "
                       "400: not asked again before the next restore"]


def test_the_games_own_ready_deferred_by_a_snapshot_returns_an_allocated_server(
        sidecar, rehydrate_engine, monkeypatch):
    """Agones' reuse of an Allocated GameServer: the match ends and the game calls ready()
    to return the server to the pool. Made during the snapshot window, it is deferred and
    sent once rehydrate is ready. The ordering that lost it is forced: the readiness
    waiter takes the deferred ready() (its first POST /ready fails, so it is pending in
    its backoff) before the restore's report does, whose Ready (not the game's: the
    GameServer is Allocated, so none) replaced it."""
    from rehydrate.adapters import agones as agones_module

    reported = threading.Event()
    t_snap = [float("inf")]

    def before(report) -> None:  # runs ahead of the adapter's listener
        if report.kind == "restore":
            sidecar.wait_for("POST", "/ready", since=t_snap[0], status=503)

    def backoff(attempt: int, cap: float) -> float:
        reported.wait(10)  # the loop holds here until the adapter's listener has run
        return 0.01

    rehydrate_engine.add_listener(before)
    a = _adapter(sidecar, rehydrate_engine)
    a.install()
    rehydrate_engine.add_listener(
        lambda report: reported.set() if report.kind == "restore" else None)
    try:
        a.ready()
        a.allocate()
        assert rehydrate_engine.simulate_snapshot().ok
        t_snap[0] = time.monotonic()
        a.ready()  # not ready while paused: deferred
        assert sidecar.calls("POST", "/ready", since=t_snap[0]) == []
        sidecar.fail_next(1, "/ready", status=503)
        monkeypatch.setattr(agones_module, "_backoff", backoff)
        assert rehydrate_engine.simulate_restore().ok
        sidecar.wait_for("POST", "/ready", since=t_snap[0])
        assert sidecar.gs.state == "Ready"
    finally:
        reported.set()
        a.close()


def test_the_games_own_ready_deferred_by_a_degraded_restore_goes_out_on_recovery(
        sidecar, adapter, rehydrate_engine):
    fixed = _failing_hook(rehydrate_engine, "game.db", ConnectionError("db not reachable yet"))

    adapter.ready()
    adapter.allocate()
    t0 = time.monotonic()
    assert not rehydrate_engine.simulate_restore().ok
    adapter.ready()  # the match ended: back to the pool, deferred (degraded)
    assert sidecar.calls("POST", "/ready", since=t0) == []
    fixed.set()
    assert rehydrate_engine.recovered("game.db")
    sidecar.wait_for("POST", "/ready", since=t0)
    assert sidecar.gs.state == "Ready"


def test_allocate_after_a_deferred_ready_was_taken_drops_it(sidecar, adapter,
                                                            rehydrate_engine):
    """The game's ready() deferred (degraded), then allocate() — ordered so that the
    readiness waiter has already taken the deferred Ready and handed it to the adapter's
    loop when allocate() runs there: only the epoch, checked when the Ready is about to
    go out, keeps the Allocated server from being marked Ready. A guard of that check
    (older than the restore-start epoch): without it, this test fails, and no other test
    of the game's own deferred ready() does."""
    _failing_hook(rehydrate_engine, "game.db", ConnectionError("db not reachable yet"))

    t0 = time.monotonic()
    assert not rehydrate_engine.simulate_restore().ok
    adapter.ready()  # deferred (degraded)
    hold, held = threading.Event(), threading.Event()

    async def block_the_loop() -> None:
        held.set()
        hold.wait(10)  # blocks the adapter's loop: what is handed to it queues up

    adapter._submit(block_the_loop())
    assert held.wait(10)
    try:
        allocated = adapter._submit(adapter._simple("/allocate"))  # queued first
        assert rehydrate_engine.recovered("game.db")
        # the waiter saw readiness, took the deferred Ready and queued it behind
        wait_for(lambda: "rehydrate-agones-ready" not in [t.name for t in
                                                          threading.enumerate()],
                 what="the readiness waiter to hand the Ready over")
        assert not adapter._ready_deferred
    finally:
        hold.set()
    allocated.result(10)
    adapter.gameserver()  # barrier: the adapter's loop has run what was handed to it
    assert sidecar.calls("POST", "/ready", since=t0) == []
    assert sidecar.gs.state == "Allocated"


def _allocate_in_the_pause(adapter: AgonesAdapter, caplog) -> tuple[threading.Thread,
                                                                   list[object]]:
    """Starts allocate() on a thread of its own and returns once the call waits for the
    restore: that thread, and the list that gets allocate()'s return or its exception."""
    got: list[object] = []

    def call() -> None:
        try:
            got.append(adapter.allocate())
        except Exception as exc:  # noqa: BLE001 - the test judges it
            got.append(exc)

    caller = threading.Thread(target=call)
    with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
        caller.start()
        wait_for(lambda: "POST /allocate while paused" in caplog.text,
                 what="the call to wait for the restore")
    return caller, got


def _ready_decided(caplog) -> bool:
    text = caplog.text
    return "not asking to be Ready (after the restore)" in text or \
        "marked Ready again (after the restore" in text


def test_an_allocate_once_ready_before_the_restores_report_is_not_followed_by_ready(
        sidecar, rehydrate_engine, caplog):
    """The game waits for rehydrate to be ready after a restore, then self-allocates; the
    restore's report reached the adapter after that (a listener ahead of it did a little
    I/O). Its Ready was decided then, with the counter bumped by allocate() and on the
    state the resync fetched before it (Scheduled): the Allocated server went Ready."""
    allocated = threading.Event()
    rehydrate_engine.add_listener(
        lambda report: allocated.wait(10) if report.kind == "restore" else None)
    a = _adapter(sidecar, rehydrate_engine)
    a.install()
    try:
        a.ready()
        sidecar.wait_for("GET", "/watch/gameserver")
        assert rehydrate_engine.simulate_snapshot().ok
        sidecar.fail_next(10**6, "/watch/gameserver", status=503)  # it shows nothing new
        sidecar.set_state("Scheduled")  # a clone in a new Pod

        def game() -> None:
            assert rehydrate_engine.wait_ready(10)
            a.allocate()  # a player joined
            allocated.set()

        player = threading.Thread(target=game)
        player.start()
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
            assert rehydrate_engine.simulate_restore().ok
            player.join(10)
            wait_for(lambda: _ready_decided(caplog), what="the restore's Ready decided")
        assert sidecar.calls("POST", "/ready", since=t0) == []
        assert sidecar.gs.state == "Allocated"
    finally:
        allocated.set()
        a.close()


@pytest.mark.parametrize("answer", [200, 503])
def test_an_allocate_from_a_restore_hook_is_not_followed_by_ready(
        sidecar, adapter, rehydrate_engine, caplog, answer):
    """A game's own restore hook (APPLICATION phase) self-allocates: a match was running
    when the snapshot was taken. The watch does not show it yet (it follows the cluster
    late); the report decided the Ready on the state the resync fetched before it, with
    the counter read after the allocate. Also when the allocate failed (503): it may have
    been applied, and a Ready decided before it is never sent after it."""
    from rehydrate import Phase

    adapter.ready()
    sidecar.wait_for("GET", "/watch/gameserver")

    @rehydrate_engine.registry.after_restore(name="game.rejoin", phase=Phase.APPLICATION)
    def rejoin() -> None:
        try:
            adapter.allocate()
        except AgonesError:
            assert answer == 503

    assert rehydrate_engine.simulate_snapshot().ok
    paths = ("/watch/gameserver",) if answer == 200 else ("/watch/gameserver", "/allocate")
    sidecar.fail_next(10**6, *paths, status=503)
    sidecar.set_state("Scheduled")
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
        report = rehydrate_engine.simulate_restore()
        assert report.ok, report.table()
        wait_for(lambda: _ready_decided(caplog), what="the restore's Ready decided")
    assert sidecar.calls("POST", "/ready", since=t0) == []
    assert sidecar.calls("POST", "/allocate", since=t0)
    assert sidecar.gs.state == ("Allocated" if answer == 200 else "Scheduled")


@pytest.mark.parametrize("seen", ["seen", "never-seen", "clone"])
def test_an_allocate_made_while_paused_makes_the_known_state_stale(
        sidecar, adapter, rehydrate_engine, caplog, seen):
    """allocate() while paused goes out as the restore begins; the resync's fetch still
    answered the state from before it (Scheduled: the sidecar follows the cluster late),
    and the Ready decided on that went out after the allocate. Also when no GameServer
    was seen before the call: the first one seen after it is not "another GameServer".
    And when the restore is a clone's in a new Pod: the call went to the clone's sidecar,
    so the clone's GameServer is its target, not "another GameServer" than the one known
    from before the restore (the Allocated clone was marked Ready)."""
    adapter.ready()
    wait_for(lambda: adapter.known_gameserver is not None, what="the watch")
    assert rehydrate_engine.simulate_snapshot().ok
    if seen == "never-seen":
        adapter._gameserver = None  # paused: nothing sets it again before the restore
    elif seen == "clone":
        sidecar.gs.name, sidecar.gs.uid = "gameserver-clone", "uid-of-the-clone"
    sidecar.set_state("Scheduled")
    stale = sidecar.gs.to_json()
    sidecar.fail_next(10**6, "/watch/gameserver", status=503)
    done: list[object] = []
    real_apply = sidecar._apply

    def apply(method: str, path: str, body):
        if path == "/gameserver":
            # answered once the allocate() returned, with the state from before it
            wait_for(lambda: done, timeout=10, what="allocate() to return")
            return 200, stale
        return real_apply(method, path, body)

    sidecar._apply = apply
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
        call = threading.Thread(target=lambda: done.append(adapter.allocate()))
        call.start()
        wait_for(lambda: "POST /allocate while paused" in caplog.text,
                 what="the call to wait for the restore")
        assert rehydrate_engine.simulate_restore().ok
        call.join(10)
        wait_for(lambda: _ready_decided(caplog), what="the restore's Ready decided")
    assert done == [None]
    assert adapter.known_gameserver["status"]["state"] == "Scheduled"  # stale
    # and known to be: the restore's Ready is held off by the call counter too, but a
    # later one (the next resume's, say) is decided on this state
    assert adapter._expected is not None
    assert sidecar.calls("POST", "/ready", since=t0) == []
    assert sidecar.gs.state == "Allocated"
    # a GameServer in the state the call made ends the staleness
    sidecar._apply = real_apply
    sidecar.fail_next(0)
    adapter.gameserver()
    assert adapter._expected is None


def test_a_ready_decided_while_an_allocate_is_in_flight_waits_for_its_answer(
        sidecar, adapter, rehydrate_engine):
    """allocate() made while paused goes out as the restore begins; the sidecar has not
    answered it when the restore's Ready is decided (on the stale fetch: Scheduled). The
    Ready went out meanwhile, after the allocate had reached the sidecar: a real one
    applies both, in an order of its own. Holding the gate across the allocate makes the
    Ready wait for its answer, and then see the known state stale."""
    adapter.ready()
    sidecar.wait_for("GET", "/watch/gameserver")
    assert rehydrate_engine.simulate_snapshot().ok
    sidecar.set_state("Scheduled")
    sidecar.faults.answer["/gameserver"] = sidecar.gs.to_json()
    sidecar.fail_next(10**6, "/watch/gameserver", status=503)
    answer_allocate = threading.Event()
    real_apply = sidecar._apply

    def apply(method: str, path: str, body):
        if path == "/allocate":
            answer_allocate.wait(10)
        return real_apply(method, path, body)

    sidecar._apply = apply
    done: list[object] = []
    t0 = time.monotonic()
    call = threading.Thread(target=lambda: done.append(adapter.allocate()))
    call.start()
    try:
        assert rehydrate_engine.simulate_restore().ok
        wait_for(lambda: sidecar.calls("POST", "/ready", since=t0) or (
            adapter._ready_task is not None and adapter._ready_gate.locked()),
            what="the restore's Ready to be sent or to wait for the allocate")
    finally:
        answer_allocate.set()
    call.join(10)
    assert done == [None]
    adapter.gameserver()  # barrier: the Ready task has decided
    [allocate] = sidecar.calls("POST", "/allocate", since=t0)
    assert [r for r in sidecar.calls("POST", "/ready", since=t0)
            if r.mono >= allocate.mono] == []
    assert sidecar.gs.state == "Allocated"


def test_a_resync_owed_to_a_failed_restore_does_not_run_while_paused(
        sidecar, rehydrate_engine):
    """A restore's resync missed its deadline; a snapshot came before its report reached
    the adapter's listener (the engine publishes outside its run lock). The background
    resync then started after the pause and talked to the sidecar from the image."""
    snapshotted = threading.Event()
    rehydrate_engine.add_listener(
        lambda report: snapshotted.wait(10) if report.kind == "restore" else None)
    a = _adapter(sidecar, rehydrate_engine, deadline=0.5, request_timeout=0.3)
    a.install()
    try:
        a.ready()
        sidecar.wait_for("GET", "/watch/gameserver")
        assert rehydrate_engine.simulate_snapshot().ok
        sidecar.set_state("Scheduled")
        sidecar.fail_next(10**6, "/gameserver", status=503)
        second: dict[str, object] = {}

        def snapshot_when_degraded() -> None:
            wait_for(lambda: rehydrate_engine.status().state == "degraded", timeout=10,
                     what="the failed restore")
            second["report"] = rehydrate_engine.simulate_snapshot()
            snapshotted.set()

        snap = threading.Thread(target=snapshot_when_degraded)
        snap.start()
        assert not rehydrate_engine.simulate_restore().ok
        snap.join(10)
        assert second["report"].ok
        assert a._paused
        a._call(asyncio.sleep(0))  # barrier: what the listener handed over has run
        assert a._recover_task is None
        assert a._client is None
        sidecar.fail_next(0)
        t0 = time.monotonic()
        assert rehydrate_engine.simulate_restore().ok  # resyncs on its own
        sidecar.wait_for("POST", "/ready", since=t0)
    finally:
        snapshotted.set()
        a.close()


def test_a_call_waiting_for_the_restore_does_not_count_the_freeze(
        sidecar, adapter, rehydrate_engine, caplog):
    """The monotonic clock counts the time frozen in the image (DESIGN.md): a call made
    in the pause window failed with AgonesUnavailable the moment the clone woke. The
    freeze is a jump of the adapter's loop clock here."""
    assert rehydrate_engine.simulate_snapshot().ok
    caller, done = _allocate_in_the_pause(adapter, caplog)
    loop = adapter._loop
    real = loop.time
    loop.time = lambda: real() + 3600.0  # an hour in the image, well over deadline=3
    for _ in range(5):  # the loop wakes, sees its timers due, and runs what they woke
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)
    assert done == []
    t_restore = time.monotonic()
    assert rehydrate_engine.simulate_restore().ok
    caller.join(10)
    assert done == [None]
    [allocate] = sidecar.calls("POST", "/allocate")
    assert allocate.mono >= t_restore


def test_a_call_from_a_hook_while_paused_fails_at_once(sidecar, adapter, rehydrate_engine):
    """A before-snapshot hook that runs after the adapter's pause (ENVIRONMENT phase: the
    phases run in reverse) read the GameServer: it waited the whole deadline for a
    restore that cannot come while the snapshot waits for this very hook."""
    from rehydrate import Phase
    from rehydrate.adapters.agones import AgonesUnavailable

    got: list[BaseException] = []

    @rehydrate_engine.registry.before_snapshot(name="game.note", phase=Phase.ENVIRONMENT)
    def note() -> None:
        for call in (adapter.gameserver, adapter.allocate):
            try:
                call()
            except AgonesError as exc:
                got.append(exc)

    assert rehydrate_engine.simulate_snapshot().ok
    assert len(got) == 2
    assert not any(isinstance(e, AgonesUnavailable) for e in got)
    assert str(got[0]).startswith(
        "GET /gameserver from a rehydrate hook while the adapter is paused for a "
        "snapshot (hook rehydrate.agones.pause ran): the restore it would wait for "
        "cannot come before this hook returns")
    assert str(got[1]).startswith("POST /allocate from a rehydrate hook")
    assert sidecar.calls("GET", "/gameserver") == []
    assert sidecar.calls("POST", "/allocate") == []


def test_a_resync_that_missed_its_deadline_finishes_once_the_sidecar_answers(
        sidecar, rehydrate_engine):
    """The engine stayed degraded for good after the sidecar answered again, and the
    clone's GameServer Scheduled."""
    a = _adapter(sidecar, rehydrate_engine, deadline=0.5, request_timeout=0.3)
    a.install()
    try:
        a.ready()
        a.set_label("map", "dust")
        sidecar.wait_for("GET", "/watch/gameserver")
        assert rehydrate_engine.simulate_snapshot().ok
        with sidecar.cond:
            sidecar.gs.labels.clear()
        sidecar.set_state("Scheduled")  # a clone in a new Pod
        sidecar.fail_next(10**6, "/gameserver", status=503)
        t0 = time.monotonic()
        report = rehydrate_engine.simulate_restore()
        assert not report.ok
        assert [h.outcome for h in report.hooks if h.name == "rehydrate.agones.resync"] \
            == ["failed"]
        assert not rehydrate_engine.is_ready()
        sidecar.fail_next(0)  # the sidecar answers again
        assert rehydrate_engine.wait_ready(15), rehydrate_engine.status()
        sidecar.wait_for("POST", "/ready", since=t0)
        assert sidecar.gs.state == "Ready"
        assert sidecar.gs.labels == {"agones.dev/sdk-map": "dust"}
        assert a.status()["reason"] == ""
    finally:
        a.close()


def test_close_from_a_listener_returns_at_once_and_detaches(sidecar, rehydrate_engine):
    """close() from on_change (the adapter's own thread) waited 10 s for itself, raised
    "cannot join current thread" and left the hooks registered: every later snapshot
    and restore failed on the closed adapter."""
    a = _adapter(sidecar, rehydrate_engine)
    outcome: list[object] = []
    closed = threading.Event()

    @a.on_change
    def changed(gs) -> None:
        if gs["status"]["state"] == "Shutdown":
            try:
                a.close()
                outcome.append("returned")
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                outcome.append(exc)
            closed.set()

    a.install()
    thread = a._thread
    sidecar.set_state("Shutdown")
    assert closed.wait(10)
    assert outcome == ["returned"]
    thread.join(10)
    assert not thread.is_alive()
    assert a._loop.is_closed()
    names = [h.name for h in rehydrate_engine.hooks("restore")]
    assert not [n for n in names if n.startswith("rehydrate.agones")], names
    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.simulate_restore().ok


def test_close_during_a_restores_resync_fails_it_at_once(sidecar, rehydrate_engine, caplog):
    """The hook waited deadline + 5 s for a loop that had been stopped, then failed with a
    misleading timeout, and an ERROR traceback "Event loop is closed" followed."""
    a = _adapter(sidecar, rehydrate_engine, deadline=30.0)
    a.install()
    sidecar.fail_next(10**6, "/gameserver", status=503)
    result: dict[str, object] = {}
    t0 = time.monotonic()
    run = threading.Thread(
        target=lambda: result.update(report=rehydrate_engine.simulate_restore()))
    run.start()
    try:
        sidecar.wait_for("GET", "/gameserver", since=t0, status=503)
        a.close()
        run.join(10)
        assert not run.is_alive(), "the resync hook still waits for the closed adapter"
    finally:
        a.close()
        run.join(40)
    report = result["report"]
    [resync] = [h for h in report.hooks if h.name == "rehydrate.agones.resync"]
    assert "AgonesAdapter closed" in str(resync.error), report.table()
    assert "Event loop is closed" not in caplog.text


def test_an_sdk_call_between_the_pause_and_the_restore_waits_for_the_restore(
        sidecar, adapter, rehydrate_engine, caplog):
    """Sent at once, it opened a connection that the snapshot froze (the docs promise
    none in flight or pooled in the image)."""
    assert rehydrate_engine.simulate_snapshot().ok
    t_pause = time.monotonic()
    with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
        call, done = _allocate_in_the_pause(adapter, caplog)
        assert sidecar.calls("POST", "/allocate") == []
        assert adapter._client is None
        t_restore = time.monotonic()
        assert rehydrate_engine.simulate_restore().ok
        call.join(10)
    assert done == [None]
    [allocate] = sidecar.calls("POST", "/allocate", since=t_pause)
    assert allocate.mono >= t_restore
    assert sidecar.gs.state == "Allocated"


def test_an_sdk_call_while_paused_with_no_restore_coming_is_one_clear_error(
        sidecar, rehydrate_engine):
    from rehydrate.adapters.agones import AgonesUnavailable

    a = _adapter(sidecar, rehydrate_engine, deadline=0.2)
    a.install()
    try:
        assert rehydrate_engine.simulate_snapshot().ok
        with pytest.raises(AgonesUnavailable, match=r"GET /gameserver: the adapter is "
                           r"paused for a snapshot and no restore or resume came within "
                           r"the 0.2s deadline"):
            a.gameserver()
        assert sidecar.calls("GET", "/gameserver") == []
    finally:
        a.close()


def test_a_call_made_before_any_gameserver_was_seen_is_forgotten_by_a_clone(
        sidecar, rehydrate_engine, caplog):
    """No working watch: ready() and allocate() before any GameServer was seen, then a
    snapshot restored into a clone in a new Pod. The clone's GameServer, the first one
    seen, was taken for the one that allocate() (made in another Pod) was made for: its
    state counted as stale for ever and the clone was never asked to be Ready."""
    sidecar.fail_next(10**6, "/watch/gameserver", status=404)
    a = _adapter(sidecar, rehydrate_engine)
    a.install()
    try:
        a.ready()
        a.allocate()
        assert a.known_gameserver is None
        assert rehydrate_engine.simulate_snapshot().ok
        sidecar.gs.name, sidecar.gs.uid = "gameserver-clone", "uid-of-the-clone"
        sidecar.set_state("Scheduled")
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
            assert rehydrate_engine.simulate_restore().ok
            wait_for(lambda: _ready_decided(caplog), what="the restore's Ready decided")
        assert len(sidecar.calls("POST", "/ready", since=t0)) == 1
        assert sidecar.gs.state == "Ready"
    finally:
        a.close()


def test_a_call_from_a_hook_while_paused_does_not_wait_behind_a_game_threads_call(
        sidecar, rehydrate_engine, caplog):
    """A game thread's allocate() made in the pause window held the call gate while it
    waited for the restore: a before-snapshot hook's reserve() after it queued on the gate
    before it could fail, and held the snapshot up for the game thread's whole deadline."""
    from rehydrate import Phase
    from rehydrate.adapters.agones import AgonesUnavailable

    a = _adapter(sidecar, rehydrate_engine, deadline=5.0)
    a.install()
    game: list[object] = []
    hook: list[object] = []

    def allocate() -> None:
        try:
            game.append(a.allocate())
        except AgonesError as exc:
            game.append(exc)

    # the phases of a snapshot run in reverse, and so do the orders within one
    @rehydrate_engine.registry.before_snapshot(name="game.thread", phase=Phase.ENVIRONMENT,
                                               order=100)
    def game_thread_calls() -> None:  # stands for a game thread calling in the window
        threading.Thread(target=allocate, daemon=True).start()
        wait_for(lambda: "POST /allocate while paused" in caplog.text,
                 what="the game's call to wait for the restore")

    @rehydrate_engine.registry.before_snapshot(name="game.note", phase=Phase.ENVIRONMENT,
                                               order=-100)
    def note() -> None:
        try:
            a.reserve(10)
        except AgonesError as exc:
            hook.append(exc)
        hook.append(list(game))  # what the game thread's call had got by then

    try:
        with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
            assert rehydrate_engine.simulate_snapshot().ok
        assert len(hook) == 2, hook
        assert str(hook[0]).startswith("POST /reserve from a rehydrate hook")
        assert not isinstance(hook[0], AgonesUnavailable)
        assert hook[1] == [], "the hook's call waited for the game thread's to end"
        assert rehydrate_engine.simulate_restore().ok
        wait_for(lambda: game, what="the game thread's call")
        assert game == [None]
        assert sidecar.calls("POST", "/reserve") == []
    finally:
        a.close()


def test_calls_waiting_for_the_restore_wait_side_by_side(sidecar, rehydrate_engine, caplog):
    """The first call waiting in the pause held the gate: the next one waited on it, with
    no deadline of its own, and then began its own wait (N callers: N x deadline)."""
    a = _adapter(sidecar, rehydrate_engine, deadline=30.0)
    a.install()
    done: list[object] = []
    try:
        assert rehydrate_engine.simulate_snapshot().ok
        with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
            calls = [threading.Thread(target=lambda: done.append(a.allocate())),
                     threading.Thread(target=lambda: done.append(a.reserve(5)))]
            for call in calls:
                call.start()
            wait_for(lambda: "POST /allocate while paused" in caplog.text
                     and "POST /reserve while paused" in caplog.text,
                     what="both calls to wait for the restore")
        assert rehydrate_engine.simulate_restore().ok
        for call in calls:
            call.join(10)
        assert done == [None, None]
    finally:
        a.close()


def test_a_paused_allocate_that_fails_is_not_followed_by_the_restores_ready(
        sidecar, adapter, rehydrate_engine, caplog):
    """allocate() made in the pause window goes out as the restore begins and fails (503:
    a gateway's error, maybe applied upstream). Its counter bump came before the restore
    began, and the known state is made stale only by an answer: the restore's Ready went
    out after it."""
    adapter.ready()
    wait_for(lambda: adapter.known_gameserver is not None, what="the watch")
    assert rehydrate_engine.simulate_snapshot().ok
    sidecar.set_state("Scheduled")
    sidecar.fail_next(10**6, "/watch/gameserver", "/allocate", status=503)
    with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
        caller, got = _allocate_in_the_pause(adapter, caplog)
        t0 = time.monotonic()
        assert rehydrate_engine.simulate_restore().ok
        caller.join(10)
        wait_for(lambda: _ready_decided(caplog), what="the restore's Ready decided")
    assert len(got) == 1 and isinstance(got[0], AgonesError)
    [allocate] = sidecar.calls("POST", "/allocate", since=t0)
    assert [r for r in sidecar.calls("POST", "/ready", since=t0)
            if r.mono >= allocate.mono] == []


def test_the_games_own_ready_retried_when_the_next_snapshot_pauses_is_kept(
        sidecar, adapter, rehydrate_engine, caplog):
    """The game's own ready() deferred by a snapshot (returning an Allocated server to the
    pool) failed its first POST /ready and was in its backoff when the next snapshot's
    pause cancelled it; the flag saying so was already taken: after the next restore only
    the restore's Ready was decided, skipped for Allocated, and the game's ready() lost."""
    adapter.ready()
    adapter.allocate()
    wait_for(lambda: adapter.known_gameserver["status"]["state"] == "Allocated",
             what="the watch")
    assert rehydrate_engine.simulate_snapshot().ok
    adapter.ready()  # the match is over: back to the pool (deferred)
    sidecar.fail_next(10**6, "/ready", status=503)
    t0 = time.monotonic()
    assert rehydrate_engine.simulate_restore().ok
    sidecar.wait_for("POST", "/ready", since=t0, status=503)
    assert rehydrate_engine.simulate_snapshot().ok  # cancels the retrying task
    sidecar.fail_next(0)
    t1 = time.monotonic()
    assert rehydrate_engine.simulate_restore().ok
    sidecar.wait_for("POST", "/ready", since=t1)
    assert sidecar.gs.state == "Ready"


def test_a_call_whose_state_the_watch_showed_before_its_answer_leaves_nothing_stale(
        sidecar, adapter):
    """The sidecar applied allocate(), the watch showed the GameServer Allocated, and then
    the answer came: the known state was marked stale after it already showed the call's
    state, and every equal GameServer seen later was skipped, so it stayed stale."""
    wait_for(lambda: adapter.known_gameserver is not None, what="the watch")
    real_apply = sidecar._apply

    def apply(method: str, path: str, body):
        answer = real_apply(method, path, body)
        if path == "/allocate":
            wait_for(lambda: adapter.known_gameserver["status"]["state"] == "Allocated",
                     what="the watch to show the allocation before the answer")
        return answer

    sidecar._apply = apply
    adapter.allocate()
    assert adapter._expected is None
    adapter.gameserver()
    assert adapter._expected is None


def test_a_task_a_restore_hook_left_running_waits_for_the_restore_like_the_game(
        sidecar, adapter, rehydrate_engine, caplog):
    """A matchmaking worker started by an async restore hook inherited the hook's
    context: at the next snapshot its aallocate() in the pause window failed at once, as
    if a hook had made it, instead of waiting for the restore."""
    result: list[str] = []
    started: dict[str, object] = {}

    async def matchmaker() -> None:
        await started["go"].wait()  # a player joins, some time later
        try:
            await adapter.aallocate()
            result.append("allocated")
        except AgonesError as exc:
            result.append(str(exc))

    @rehydrate_engine.registry.after_restore(name="game.start_matchmaker")
    async def start() -> None:
        if "task" not in started:  # the first restore only
            started["go"] = asyncio.Event()
            started["task"] = asyncio.get_running_loop().create_task(matchmaker())

    assert rehydrate_engine.simulate_restore().ok  # the worker is started
    loop = started["task"].get_loop()
    assert rehydrate_engine.simulate_snapshot().ok
    with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
        loop.call_soon_threadsafe(started["go"].set)  # the player joins while paused
        wait_for(lambda: result or "POST /allocate while paused" in caplog.text,
                 what="the worker's call")
    assert result == []
    assert rehydrate_engine.simulate_restore().ok
    wait_for(lambda: result, what="the worker's call to end")
    assert result == ["allocated"]


# -- no POST /ready while paused for a snapshot -----------------------------------------


def test_a_ready_handed_over_as_a_snapshot_pauses_waits_for_the_restore(
        sidecar, adapter, rehydrate_engine, monkeypatch, caplog):
    """The restore's report found rehydrate ready and handed its Ready to the adapter's
    loop; a snapshot pass (another thread: the engine publishes outside its run lock)
    paused the adapter in between. The Ready then went out from the paused adapter, a
    request in the image, and was retried there. The order is forced: the pass runs
    between the report's readiness check and the hand-over."""
    adapter.ready()
    sidecar.wait_for("GET", "/watch/gameserver")
    assert rehydrate_engine.simulate_snapshot().ok
    sidecar.set_state("Scheduled")  # a clone's GameServer: the restore asks for Ready
    real_submit = adapter._submit
    handed: dict[str, object] = {}

    def submit(coro):
        if coro.__name__ == "_ready_after_restore" and "ready" not in handed:
            snap = threading.Thread(
                target=lambda: handed.setdefault("pass", rehydrate_engine.simulate_snapshot()))
            snap.start()
            snap.join(10)
            handed["t_pass"] = time.monotonic()
            handed["ready"] = real_submit(coro)
            return handed["ready"]
        return real_submit(coro)

    monkeypatch.setattr(adapter, "_submit", submit)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="rehydrate.agones"):
        assert rehydrate_engine.simulate_restore().ok
        assert handed["pass"].ok and adapter._paused
        handed["ready"].result(10)  # the Ready handed over has decided
    assert sidecar.gs.state == "Scheduled", "POST /ready sent while paused"
    assert "while paused for a snapshot: decided again after the restore" in caplog.text
    t1 = time.monotonic()
    assert rehydrate_engine.simulate_restore().ok  # the restore of that pass's image
    sidecar.wait_for("POST", "/ready", since=t0)
    assert [r.mono >= t1 for r in sidecar.calls("POST", "/ready", since=t0)] == [True]
    assert sidecar.gs.state == "Ready"


def test_the_games_own_ready_decided_while_paused_is_kept_for_after_the_restore(
        sidecar, adapter, rehydrate_engine):
    """The game's own deferred ready() (returning an Allocated server to the pool) taken
    by a report just before a snapshot paused the adapter: not sent while paused, and not
    lost either — it goes out once rehydrate is ready after the restore, also to the
    Allocated GameServer (the restore's own Ready would skip it)."""
    adapter.ready()
    adapter.allocate()
    wait_for(lambda: adapter.known_gameserver["status"]["state"] == "Allocated",
             what="the watch")
    assert rehydrate_engine.simulate_snapshot().ok
    t0 = time.monotonic()
    adapter._submit(adapter._ready_after_restore(asked=True,
                                                 epoch=adapter._ready_epoch)).result(10)
    assert sidecar.gs.state == "Allocated", "POST /ready sent while paused"
    assert adapter._ready_deferred and adapter._ready_asked
    t1 = time.monotonic()
    assert rehydrate_engine.simulate_restore().ok
    sidecar.wait_for("POST", "/ready", since=t0)
    assert all(r.mono >= t1 for r in sidecar.calls("POST", "/ready", since=t0))
    assert sidecar.gs.state == "Ready"
