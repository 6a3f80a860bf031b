"""SnapStart bridge driven by the real Lambda runtime client's hooks runner."""

from __future__ import annotations

import time

import pytest
import snapshot_restore_py
from awslambdaric import lambda_runtime_hooks_runner as runtime
from detect_helpers import Recorder

import rehydrate
from rehydrate.detect import select
from rehydrate.detect.snapstart import SnapStartBridge, SnapStartHookFailed


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


def test_auto_start_registers_the_bridge(rehydrate_engine):
    assert SnapStartBridge.probe() is None
    assert "snapstart" in [d.name for d in select("auto")]
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
