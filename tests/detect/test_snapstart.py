"""SnapStart bridge driven by the real Lambda runtime client's hooks runner."""

from __future__ import annotations

import time

import pytest
import snapshot_restore_py
from awslambdaric import lambda_runtime_hooks_runner as runtime
from detect_helpers import Recorder

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
