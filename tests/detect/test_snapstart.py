"""SnapStart bridge driven by the real Lambda runtime client's hooks runner."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import snapshot_restore_py
from awslambdaric import lambda_runtime_hooks_runner as runtime
from detect_helpers import Recorder, wait_for

import rehydrate
from rehydrate.detect import available, select
from rehydrate.detect.snapstart import SnapStartDetector, SnapStartHookFailed


@pytest.fixture(autouse=True)
def clean_runtime_registries():  # type: ignore[no-untyped-def]
    before = list(snapshot_restore_py.get_before_snapshot())
    after = list(snapshot_restore_py.get_after_restore())
    snapshot_restore_py.get_before_snapshot().clear()
    snapshot_restore_py.get_after_restore().clear()
    yield
    snapshot_restore_py.get_before_snapshot()[:] = before
    snapshot_restore_py.get_after_restore()[:] = after


def test_runtime_hooks_run_rehydrate_hooks(rehydrate_engine):
    rec = Recorder(rehydrate_engine)
    assert rehydrate_engine.start(["snapstart"]) == ["snapstart"]

    runtime.run_before_snapshot()
    assert rec.snapshots == [{"reason": "snapstart", "kind": "snapshot"}]

    runtime.run_after_restore()
    assert [(c["reason"], c["kind"], c["generation"]) for c in rec.calls] == \
        [("snapstart", "restore", 1)]
    status = rehydrate_engine.status()
    assert (status.generation, status.state) == (1, "ready")


def test_failed_before_snapshot_hook_aborts_the_snapshot(rehydrate_engine):
    @rehydrate_engine.registry.before_snapshot(name="flush")
    def flush() -> None:
        raise OSError("disk full")

    rehydrate_engine.start(["snapstart"])
    with pytest.raises(SnapStartHookFailed, match="disk full"):
        runtime.run_before_snapshot()


def test_a_refused_pass_is_undone_before_snapstart_hears_of_it(rehydrate_engine):
    """The control socket's refused save, here: the refusing engine's pass (its hooks that
    did run closed things) is undone by a resume run, not left `degraded` with them
    closed."""
    events: list[tuple[str, str | None]] = []
    rehydrate_engine.registry.before_snapshot(lambda: events.append(("close", None)),
                                              name="close", order=0)

    @rehydrate_engine.registry.before_snapshot(name="flush", order=1)
    def flush() -> None:
        raise OSError("disk full")

    rehydrate_engine.registry.after_restore(
        lambda ctx: events.append(("reopen", ctx.kind)), name="reopen")
    rehydrate_engine.start(["snapstart"])
    with pytest.raises(SnapStartHookFailed, match=r"disk full\); the resume hooks ran$"):
        runtime.run_before_snapshot()
    assert events == [("close", None), ("reopen", "resume")]
    status = rehydrate_engine.status()
    assert (status.state, status.generation) == ("ready", 0)
    assert status.last_report.kind == "resume" and status.last_report.frozen_for == 0.0


@pytest.fixture
def three_engines(rehydrate_engine):  # type: ignore[no-untyped-def]
    """rehydrate_engine and two more, in the order they start the bridge; the two are
    closed after the test."""
    others = [rehydrate.testing.isolated_engine(), rehydrate.testing.isolated_engine()]
    try:
        yield [rehydrate_engine, *others]
    finally:
        for engine in others:
            engine.close()


def _record(engine: Any, name: str, log: list[str]) -> None:
    engine.registry.before_snapshot(lambda: log.append(f"{name} closed"), name=f"{name}.close")
    engine.registry.after_restore(lambda ctx: log.append(f"{name} reopened ({ctx.kind})"),
                                  name=f"{name}.reopen")


def _flush_fails(engine: Any) -> None:
    """A before-snapshot hook ``flush`` in ``engine`` that refuses its pass."""
    @engine.registry.before_snapshot(name="flush")
    def flush() -> None:
        raise OSError("disk full")


def _refused_by_one(engines: Any) -> SnapStartHookFailed:
    """Every engine started under SnapStart, and the runtime's before-snapshot call that
    one of them refuses: what it raised."""
    for engine in engines:
        engine.start(["snapstart"])
    with pytest.raises(SnapStartHookFailed) as info:
        runtime.run_before_snapshot()
    return info.value


def test_engines_that_prepared_are_resumed_when_another_refuses(three_engines):
    """One engine refuses its pass: SnapStart takes no snapshot (the runtime fails the
    init), so the engines whose passes ran get their resume runs and are ready again —
    they stayed `snapshotting`, their connections closed — and the ones after it are not
    asked to close anything. The line names the refusing engine."""
    first, refusing, last = three_engines
    log: list[str] = []
    _record(first, "first", log)

    _flush_fails(refusing)

    _record(refusing, "refusing", log)
    _record(last, "last", log)
    error = _refused_by_one(three_engines)
    assert _one_line(error) == (
        "rehydrate before-snapshot hooks failed in engine 2 of 3: flush failed "
        "(OSError: disk full); the resume hooks ran in engines 1-2")
    assert isinstance(error.__cause__, rehydrate.HookFailed)
    assert log == ["first closed", "refusing closed",
                   "first reopened (resume)", "refusing reopened (resume)"]
    assert [e.status().state for e in three_engines] == ["ready", "ready", "running"]
    assert [e.status().generation for e in three_engines] == [0, 0, 0]
    assert [e.status().last_report.reason for e in three_engines[:2]] == ["snapstart"] * 2


def test_a_resume_that_fails_too_is_named(three_engines):
    first, refusing, _ = three_engines

    @first.registry.after_restore(name="db")
    def reconnect() -> None:
        raise ConnectionRefusedError("refused")

    _flush_fails(refusing)

    error = _refused_by_one(three_engines)
    assert _one_line(error) == (
        "rehydrate before-snapshot hooks failed in engine 2 of 3: flush failed "
        "(OSError: disk full); the resume hooks failed too in engine 1 of 3 (db failed "
        "(ConnectionRefusedError: refused)): degraded")
    assert [e.status().state for e in three_engines] == ["degraded", "ready", "running"]


def test_an_engine_that_cannot_run_its_pass_undoes_the_ones_before_it(three_engines,
                                                                       monkeypatch):
    """snapshot_requested() raises when no thread can watch its snapshot deadline (the
    pids limit): no hook of that engine ran, but the engines before it closed theirs."""
    first, refusing, last = three_engines
    log: list[str] = []
    _record(first, "first", log)
    _record(last, "last", log)

    def no_thread(reason: str = "simulated", **kwargs: Any) -> Any:
        raise RuntimeError("no thread for the snapshot deadline")

    for engine in three_engines:
        engine.start(["snapstart"])
    monkeypatch.setattr(refusing, "snapshot_requested", no_thread)
    with pytest.raises(RuntimeError, match="no thread for the snapshot deadline"):
        runtime.run_before_snapshot()
    assert log == ["first closed", "first reopened (resume)"]
    assert [e.status().state for e in three_engines] == ["ready", "running", "running"]


def test_lambda_is_told_which_engine_refused(three_engines, monkeypatch):
    from awslambdaric import bootstrap

    from rehydrate import extensions

    _, refusing, _ = three_engines
    monkeypatch.setattr(extensions, "_default", refusing)  # the one rehydrate.start() uses

    _flush_fails(refusing)

    for engine in three_engines:
        engine.start(["snapstart"])
    client = _RuntimeClient()
    with pytest.raises(SystemExit) as exited:
        bootstrap.on_init_complete(client, bootstrap.StandardLogSink())
    assert exited.value.code == 64  # no snapshot: the version is not published
    [(what, (error, _))] = client.calls
    assert what == "post_init_error"
    assert error["errorMessage"] == (
        "rehydrate before-snapshot hooks failed in engine 2 of 3 (the default engine): "
        "flush failed (OSError: disk full); the resume hooks ran in engines 1-2")
    assert [e.status().state for e in three_engines] == ["ready", "ready", "running"]


def test_user_runtime_hooks_keep_their_order(rehydrate_engine):
    order: list[str] = []
    snapshot_restore_py.register_after_restore(lambda: order.append("user-first"))
    rehydrate_engine.registry.after_restore(lambda: order.append("rehydrate"))
    rehydrate_engine.start(["snapstart"])
    snapshot_restore_py.register_after_restore(lambda: order.append("user-last"))
    runtime.run_after_restore()
    assert order == ["user-first", "rehydrate", "user-last"]


def test_registered_once_for_many_starts_and_engines(rehydrate_engine):
    other = rehydrate.testing.isolated_engine()
    try:
        rec1, rec2 = Recorder(rehydrate_engine), Recorder(other)
        rehydrate_engine.start(["snapstart"])
        other.start(["snapstart"])
        rehydrate_engine.stop()
        rehydrate_engine.start(["snapstart"])
        assert len(snapshot_restore_py.get_after_restore()) == 1
        assert len(snapshot_restore_py.get_before_snapshot()) == 1
        runtime.run_after_restore()
        assert len(rec1.calls) == len(rec2.calls) == 1

        other.stop()  # no unregister in snapshot_restore_py: the bridge skips it
        runtime.run_after_restore()
        assert (len(rec1.calls), len(rec2.calls)) == (2, 1)
    finally:
        other.close()


@pytest.fixture
def outside_lambda(monkeypatch):
    monkeypatch.delenv("AWS_LAMBDA_FUNCTION_NAME", raising=False)
    monkeypatch.delenv("AWS_LAMBDA_INITIALIZATION_TYPE", raising=False)


def test_auto_start_leaves_the_bridge_off_outside_lambda(rehydrate_engine, outside_lambda):
    assert SnapStartDetector.probe().usable  # importable here ...
    assert "snapstart" not in [d.key for d in select("auto")]  # ... but not Lambda
    assert "snapstart" not in rehydrate_engine.start("auto")
    assert snapshot_restore_py.get_after_restore() == []
    [info] = [i for i in available() if i.name == "snapstart"]
    assert info.usable and not info.auto
    assert "outside AWS Lambda" in info.reason


@pytest.mark.parametrize(("env", "auto"), [
    ({"AWS_LAMBDA_FUNCTION_NAME": "f", "AWS_LAMBDA_INITIALIZATION_TYPE": "snap-start"}, True),
    ({"AWS_LAMBDA_FUNCTION_NAME": "f"}, True),  # a runtime without the init type
    ({"AWS_LAMBDA_FUNCTION_NAME": "f", "AWS_LAMBDA_INITIALIZATION_TYPE": "on-demand"}, False),
    ({"AWS_LAMBDA_INITIALIZATION_TYPE": "snap-start"}, True),
])
def test_auto_follows_lambdas_documented_variables(outside_lambda, monkeypatch, env, auto):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert (SnapStartDetector.auto_here() is None) is auto
    assert ("snapstart" in [d.key for d in select("auto")]) is auto


def test_auto_start_registers_the_bridge(rehydrate_engine, outside_lambda, monkeypatch):
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "handler")
    monkeypatch.setenv("AWS_LAMBDA_INITIALIZATION_TYPE", "snap-start")
    assert SnapStartDetector.probe().usable
    assert "snapstart" in [d.key for d in select("auto")]
    rec = Recorder(rehydrate_engine)
    assert "snapstart" in rehydrate_engine.start("auto")
    runtime.run_after_restore()
    assert rec.calls[0]["reason"] == "snapstart"


@pytest.mark.parametrize("first", ["identity", "snapstart"])
def test_restore_seen_by_another_detector_runs_hooks_once(rehydrate_engine, first):
    rec = Recorder(rehydrate_engine)
    rehydrate_engine.start(["snapstart"])
    runtime.run_before_snapshot()
    t_freeze = time.monotonic()  # the identity detector last looked before the freeze
    if first == "identity":
        rehydrate_engine.restore_detected("identity", kind="restore", since=t_freeze)
        runtime.run_after_restore()
    else:
        runtime.run_after_restore()
        rehydrate_engine.restore_detected("identity", kind="restore", since=t_freeze)
    assert [c["reason"] for c in rec.calls] == [first]
    assert rehydrate_engine.status().generation == 1


# -- a failed or slow restore, as Lambda sees it ----------------------------------------
#
# Lambda has no readiness probe: the only way to refuse a bad restore is to fail the
# after-restore runtime hook (the runtime then reports the error and the environment is
# discarded). And Lambda ends a restore whose runtime hooks take over 10 s, without a word.


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


def test_failed_required_restore_hook_fails_the_runtime_hook(rehydrate_engine, caplog):
    @rehydrate_engine.registry.after_restore(name="db")
    def reconnect() -> None:
        raise ConnectionRefusedError("db.internal:5432 refused\nafter 3 tries")

    @rehydrate_engine.registry.after_restore(name="warm", required=False)
    def warm() -> None:
        raise OSError("cache cold")

    reached: list[str] = []
    rehydrate_engine.registry.after_restore(lambda: reached.append("later"), name="later")
    rehydrate_engine.start(["snapstart"])
    caplog.set_level("INFO", logger="rehydrate")

    with pytest.raises(SnapStartHookFailed) as info:
        runtime.run_after_restore()

    line = _one_line(info.value)
    assert line == ("rehydrate after-restore hooks failed: db failed "
                    "(ConnectionRefusedError: db.internal:5432 refused after 3 tries)")
    assert reached == ["later"]  # every hook ran (CRaC semantics) before the bridge failed
    # The report was recorded and logged before the runtime hook failed.
    status = rehydrate_engine.status()
    assert (status.state, status.ready, status.generation) == ("degraded", False, 1)
    assert status.last_report.reason == "snapstart" and not status.last_report.ok
    assert any("restore (reason snapstart, generation 1)" in r.getMessage()
               and "degraded" in r.getMessage() for r in caplog.records)


def test_failed_optional_restore_hook_keeps_the_environment(rehydrate_engine):
    @rehydrate_engine.registry.after_restore(name="warm", required=False)
    def warm() -> None:
        raise OSError("cache cold")

    rehydrate_engine.start(["snapstart"])
    runtime.run_after_restore()  # does not raise: the restore is good
    assert rehydrate_engine.status().state == "ready"


def test_failed_restore_run_by_another_detector_still_fails_the_runtime_hook(rehydrate_engine):
    calls: list[str] = []

    @rehydrate_engine.registry.after_restore(name="db")
    def reconnect(ctx) -> None:
        calls.append(ctx.reason)
        raise ConnectionRefusedError("refused")

    rehydrate_engine.start(["snapstart"])
    runtime.run_before_snapshot()
    t_freeze = time.monotonic()
    rehydrate_engine.restore_detected("identity", kind="restore", since=t_freeze)
    with pytest.raises(SnapStartHookFailed, match=r"db failed \(ConnectionRefusedError"):
        runtime.run_after_restore()  # the same restore: not run again, but it failed
    assert calls == ["identity"]


def test_multi_line_before_snapshot_error_is_one_line(rehydrate_engine):
    @rehydrate_engine.registry.before_snapshot(name="flush")
    def flush() -> None:
        raise OSError("disk full\non /var/tmp")

    rehydrate_engine.start(["snapstart"])
    with pytest.raises(SnapStartHookFailed) as info:
        runtime.run_before_snapshot()
    assert _one_line(info.value) == ("rehydrate before-snapshot hooks failed: flush failed "
                                     "(OSError: disk full on /var/tmp); the resume hooks ran")


@pytest.fixture
def release():  # type: ignore[no-untyped-def]
    """An event that blocked hooks wait on; set at the end so their threads end."""
    event = threading.Event()
    yield event
    event.set()


def test_slow_restore_is_cut_at_the_snapstart_deadline(rehydrate_engine, monkeypatch, release):
    monkeypatch.setenv("REHYDRATE_SNAPSTART_DEADLINE", "1")
    reached: list[str] = []

    @rehydrate_engine.registry.after_restore(name="slow", timeout=30)
    def slow() -> None:
        release.wait()  # a peer that never answers

    rehydrate_engine.registry.after_restore(lambda: reached.append("next"), name="next")
    rehydrate_engine.start(["snapstart"])

    t0 = time.monotonic()
    with pytest.raises(SnapStartHookFailed) as info:
        runtime.run_after_restore()
    took = time.monotonic() - t0
    # Without the deadline this waits for the hook's own 30 s timeout, and Lambda would
    # have ended the restore at 10 s without any report.
    assert took < 10, took

    assert _one_line(info.value) == (
        "rehydrate after-restore hooks failed: "
        "slow timeout (HookTimeout: hook 'slow' ran past the run's 1s deadline); "
        "next timeout (HookTimeout: hook 'next' not started: the run's 1s deadline had passed)")
    report = rehydrate_engine.status().last_report
    by_name = {h.name: h for h in report.hooks}
    assert (by_name["slow"].outcome, by_name["slow"].error.run_deadline,
            by_name["slow"].error.started) == ("timeout", 1.0, True)
    assert (by_name["next"].outcome, by_name["next"].attempts,
            by_name["next"].error.started) == ("timeout", 0, False)
    assert reached == []
    assert isinstance(by_name["next"].error, rehydrate.HookTimeout)


def test_a_sync_hook_cut_at_the_deadline_that_finishes_later_changes_nothing(
        rehydrate_engine, monkeypatch, release):
    """An optional sync hook cut at the SnapStart deadline: the report is ok, Lambda keeps
    the environment, and the hook's thread runs on (it cannot be killed). When it returns
    later, the report, readiness and generation stay as reported; meanwhile a later run
    does not start a second copy of it (``HookStillRunning``) and its other hooks run."""
    monkeypatch.setenv("REHYDRATE_SNAPSTART_DEADLINE", "0.5")
    finished: list[tuple[int, str]] = []
    later: list[int] = []

    @rehydrate_engine.registry.after_restore(name="warm", required=False, order=1)
    def warm(ctx: rehydrate.RestoreContext) -> None:
        if ctx.generation == 1:
            release.wait()  # a cache warm-up stuck on a slow peer
        finished.append((ctx.generation, rehydrate_engine.status().state))

    rehydrate_engine.registry.after_restore(
        lambda ctx: later.append(ctx.generation), name="other", order=0)
    rehydrate_engine.start(["snapstart"])
    runtime.run_after_restore()  # does not raise: the cut hook is optional
    report = rehydrate_engine.status().last_report
    assert report.ok and {h.name: h.outcome for h in report.hooks}["warm"] == "timeout"
    assert rehydrate_engine.is_ready() and rehydrate_engine.status().extra[
        "hung_hooks"] == ["warm"]

    again = rehydrate_engine.simulate_restore()  # while the cut hook still runs
    result = {h.name: h for h in again.hooks}["warm"]
    assert isinstance(result.error, rehydrate.HookStillRunning) and result.attempts == 0
    assert later == [1, 2] and finished == []  # no second copy of "warm"

    release.set()
    wait_for(lambda: rehydrate_engine.status().extra["hung_hooks"] == [],
             what="the cut hook's thread to end")
    assert finished == [(1, "ready")]  # its side effects land late, as generation 1's
    status = rehydrate_engine.status()
    assert status.last_report is again and (status.state, status.generation) == ("ready", 2)
    assert {h.name: h.outcome for h in report.hooks}["warm"] == "timeout"  # never rewritten
    third = rehydrate_engine.simulate_restore()  # its thread ended: it runs again
    assert {h.name: h.outcome for h in third.hooks}["warm"] == "ok"
    assert finished[-1][0] == 3


def test_slow_async_restore_hook_is_cancelled_at_the_deadline(rehydrate_engine, monkeypatch):
    import asyncio

    monkeypatch.setenv("REHYDRATE_SNAPSTART_DEADLINE", "1")
    cancelled: list[bool] = []

    @rehydrate_engine.registry.after_restore(name="stream", timeout=30)
    async def stream() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    rehydrate_engine.start(["snapstart"])
    t0 = time.monotonic()
    with pytest.raises(SnapStartHookFailed, match=r"stream timeout .*1s deadline"):
        runtime.run_after_restore()
    assert time.monotonic() - t0 < 10
    [hook] = [h for h in rehydrate_engine.status().last_report.hooks if h.name == "stream"]
    assert hook.outcome == "timeout" and hook.error.run_deadline == 1.0


def test_deadline_defaults_under_lambdas_limit_and_is_configurable(rehydrate_engine,
                                                                   monkeypatch, caplog):
    budgets: list[float] = []
    rehydrate_engine.registry.after_restore(
        lambda ctx: budgets.append(ctx.deadline - ctx.detected_at), name="budget")

    rehydrate_engine.start(["snapstart"])
    runtime.run_after_restore()
    assert budgets == [8.0]  # the default: under Lambda's 10 s, with room to report

    rehydrate_engine.stop()
    monkeypatch.setenv("REHYDRATE_SNAPSTART_DEADLINE", "5.5")
    rehydrate_engine.start(["snapstart"])
    runtime.run_after_restore()
    assert budgets[-1] == 5.5

    rehydrate_engine.stop()  # a bad value: one warning line, and the default
    monkeypatch.setenv("REHYDRATE_SNAPSTART_DEADLINE", "soon")
    rehydrate_engine.start(["snapstart"])
    runtime.run_after_restore()
    assert budgets[-1] == 8.0
    assert any("REHYDRATE_SNAPSTART_DEADLINE='soon' is not" in r.getMessage()
               for r in caplog.records)

    rehydrate_engine.stop()  # in code, per detector
    rehydrate_engine.start([SnapStartDetector(deadline=3)])
    runtime.run_after_restore()
    assert budgets[-1] == 3.0
    assert rehydrate_engine.detector("snapstart").describe().endswith("restore deadline 3s")
    assert rehydrate_engine.status().state == "ready"


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_bad_deadline_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^SnapStartDetector deadline must be a number of "
                       r"seconds > 0 and at most \d+ \(a year\), not "):
        SnapStartDetector(deadline=bad)


def test_deadline_past_lambdas_limit_is_warned_about(rehydrate_engine, caplog):
    rehydrate_engine.start([SnapStartDetector(deadline=12)])
    assert any("not under Lambda's 10s limit" in r.getMessage() for r in caplog.records)


def test_several_engines_share_one_deadline(rehydrate_engine, monkeypatch, release):
    monkeypatch.setenv("REHYDRATE_SNAPSTART_DEADLINE", "1")
    other = rehydrate.testing.isolated_engine()
    try:
        ends: list[float] = []
        for engine in (rehydrate_engine, other):
            engine.registry.after_restore(lambda ctx: ends.append(ctx.deadline), name="end")
            engine.registry.after_restore(release.wait, name="slow", timeout=30)
            engine.start(["snapstart"])
        t0 = time.monotonic()
        with pytest.raises(SnapStartHookFailed):
            runtime.run_after_restore()
        assert time.monotonic() - t0 < 10
        assert len(ends) == 1  # the second engine's run began after the deadline ...
        [end] = [h for h in other.status().last_report.hooks if h.name == "end"]
        assert end.outcome == "timeout" and not end.error.started  # ... and says so
    finally:
        other.close()


def test_connections_are_cut_to_the_deadline_and_named(rehydrate_engine, monkeypatch):
    import socket

    from rehydrate import connections

    monkeypatch.setenv("REHYDRATE_SNAPSTART_DEADLINE", "2")
    with socket.socket() as s:  # a port nobody listens on: every connect is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    connections.register(
        "db", lambda: socket.create_connection(("127.0.0.1", port), timeout=1),
        lambda sock: sock.close(), engine=rehydrate_engine, peers=[("127.0.0.1", port)])
    rehydrate_engine.start(["snapstart"])

    t0 = time.monotonic()
    with pytest.raises(SnapStartHookFailed) as info:
        runtime.run_after_restore()
    assert time.monotonic() - t0 < 10  # the connection's own deadline is 30 s
    line = _one_line(info.value)
    assert f"db (to 127.0.0.1:{port}) after 1.5s (cut to the restore run's deadline)" in line
    assert "ConnectionRefusedError" in line
    [hook] = [h for h in rehydrate_engine.status().last_report.hooks
              if h.name == "rehydrate.connections"]
    assert hook.outcome == "failed"  # reported by the manager, not stopped by the runner


# -- what the Lambda runtime does with it ----------------------------------------------


class _RuntimeClient:
    """Records what awslambdaric's bootstrap tells the Lambda Runtime API."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def restore_next(self) -> None:
        self.calls.append(("restore_next", None))

    def post_init_error(self, error: dict[str, Any], error_type: str | None = None) -> None:
        self.calls.append(("post_init_error", (error, error_type)))

    def report_restore_error(self, error: dict[str, Any]) -> None:
        self.calls.append(("report_restore_error", error))


def test_lambda_reports_a_failed_restore_and_discards_the_environment(rehydrate_engine,
                                                                      capsys):
    from awslambdaric import bootstrap

    @rehydrate_engine.registry.after_restore(name="db")
    def reconnect() -> None:
        raise ConnectionRefusedError("refused")

    rehydrate_engine.start(["snapstart"])
    client = _RuntimeClient()
    with pytest.raises(SystemExit) as exited:
        bootstrap.on_init_complete(client, bootstrap.StandardLogSink())
    assert exited.value.code == 65  # the runtime's "after-restore hook failed" exit
    [(_, _), (what, error)] = client.calls
    assert what == "report_restore_error"
    assert error["errorType"] == "SnapStartHookFailed"
    assert error["errorMessage"] == ("rehydrate after-restore hooks failed: db failed "
                                     "(ConnectionRefusedError: refused)")
    assert "SnapStartHookFailed: rehydrate after-restore hooks failed" in capsys.readouterr().out


def test_lambda_aborts_the_snapshot_when_a_before_snapshot_hook_fails(rehydrate_engine,
                                                                       capsys):
    from awslambdaric import bootstrap
    from awslambdaric.lambda_runtime_exception import FaultException

    @rehydrate_engine.registry.before_snapshot(name="flush")
    def flush() -> None:
        raise OSError("disk full")

    rehydrate_engine.start(["snapstart"])
    client = _RuntimeClient()
    with pytest.raises(SystemExit) as exited:
        bootstrap.on_init_complete(client, bootstrap.StandardLogSink())
    assert exited.value.code == 64  # no snapshot is taken of this process
    [(what, (error, error_type))] = client.calls  # restore_next never came
    assert (what, error_type) == ("post_init_error", FaultException.BEFORE_SNAPSHOT_ERROR)
    assert error["errorMessage"] == ("rehydrate before-snapshot hooks failed: flush failed "
                                     "(OSError: disk full); the resume hooks ran")


def test_lambda_carries_on_after_a_good_restore(rehydrate_engine):
    from awslambdaric import bootstrap

    rehydrate_engine.start(["snapstart"])
    client = _RuntimeClient()
    bootstrap.on_init_complete(client, bootstrap.StandardLogSink())
    assert [c[0] for c in client.calls] == ["restore_next"]
    assert rehydrate_engine.status().state == "ready"


def test_restore_run_by_another_detector_first_is_bounded_too(rehydrate_engine, monkeypatch,
                                                              release):
    """A clock jump seen as the VM resumes may start the restore run before the runtime
    calls the bridge; the bridge's notice then waits for that run, so it must end in
    time as well."""
    monkeypatch.setenv("REHYDRATE_SNAPSTART_DEADLINE", "1")
    entered = threading.Event()

    @rehydrate_engine.registry.after_restore(name="slow", timeout=30)
    def slow() -> None:
        entered.set()
        release.wait()

    rehydrate_engine.start(["snapstart"])
    runtime.run_before_snapshot()
    t_freeze = time.monotonic()
    t0 = time.monotonic()
    first = threading.Thread(target=rehydrate_engine.restore_detected, args=("clock-jump",),
                             kwargs={"since": t_freeze})
    first.start()
    try:
        assert entered.wait(30)  # the clock-jump run is in its slow hook
        with pytest.raises(SnapStartHookFailed, match=r"slow timeout .*1s deadline"):
            runtime.run_after_restore()
        assert time.monotonic() - t0 < 10
    finally:
        first.join(30)
    report = rehydrate_engine.status().last_report
    assert (report.reason, report.confirmed_by) == ("clock-jump", ("snapstart",))

    rehydrate_engine.stop()  # the bound goes with the bridge
    release.set()
    budgets: list[float | None] = []
    rehydrate_engine.registry.after_restore(lambda ctx: budgets.append(ctx.deadline),
                                            name="budget")
    rehydrate_engine.simulate_restore()
    assert budgets == [None]


@pytest.mark.parametrize(("value", "said"), [
    ("on-demand", "'on-demand'"),
    ("provisioned-concurrency", "'provisioned-concurrency'"),
    ("s3cr3t-from-a-misused-variable", "another value"),
])
def test_the_off_reason_repeats_only_lambdas_own_init_types(outside_lambda, monkeypatch,
                                                            value, said):
    """Key names only: a value Lambda does not document is not echoed into the reason."""
    monkeypatch.setenv("AWS_LAMBDA_INITIALIZATION_TYPE", value)
    reason = SnapStartDetector.auto_here()
    assert reason == f"off: AWS_LAMBDA_INITIALIZATION_TYPE is {said}, not 'snap-start'"
