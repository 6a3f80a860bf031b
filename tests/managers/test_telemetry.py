"""OpenTelemetry spans and metrics, checked with the SDK's in-memory exporter and reader."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from typing import Any

import pytest
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, ObservableGauge
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from rehydrate import Phase, entropy, fingerprint, telemetry
from rehydrate.testing import isolated_engine


@pytest.fixture
def otel(rehydrate_engine):
    exporter = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create({"service.name": "t",
                                                  **telemetry.resource_attributes()}))
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader], resource=tp.resource)
    telemetry.instrument(rehydrate_engine, tracer_provider=tp, meter_provider=mp)
    yield rehydrate_engine, exporter, reader, tp, mp
    tp.shutdown()
    mp.shutdown()


def spans_by_name(exporter: InMemorySpanExporter) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for s in exporter.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


def metric_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    out: dict[str, list[Any]] = {}
    if data is None:
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def test_restore_span_env_names_are_shortened(otel):
    """A key of megabytes, or thousands of keys, made a span attribute of megabytes."""
    engine, exporter, _, _, _ = otel
    huge = "RHT_" + "K" * 100_000
    overlay: dict[str, str | None] = {huge: "v", **{f"RHT_X{i:03d}": "v" for i in range(30)}}
    try:
        assert engine.simulate_restore(env=overlay).ok
        (event,) = spans_by_name(exporter)["rehydrate.restore"]
        added = list(dict(event.attributes)["rehydrate.env.added"])
        assert len(added) == 21 and added[-1] == "... (+11 more)"
        assert all(len(name) <= 60 for name in added)
    finally:
        for key in overlay:
            os.environ.pop(key, None)


def test_restore_span_hook_spans_are_direct_children(otel):
    engine, exporter, _, tp, _ = otel
    threads: dict[str, str] = {}
    user_tracer = tp.get_tracer("app")

    @engine.registry.after_restore(phase=Phase.CONNECTIONS, name="db")
    def db(ctx):
        threads["db"] = threading.current_thread().name
        with user_tracer.start_as_current_span("app.reconnect"):
            pass

    @engine.registry.after_restore(name="warm")
    async def warm(ctx):
        threads["warm"] = threading.current_thread().name
        await asyncio.sleep(0)
        with user_tracer.start_as_current_span("app.warm"):
            pass

    @engine.registry.after_restore(name="cache")
    def cache():
        threads["cache"] = threading.current_thread().name

    report = engine.simulate_restore(env={"API_KEY": "s3cr3t-value"}, reason="test",
                                     frozen_for=12.5)
    assert report.ok
    # hooks really ran on other threads than the caller (worker and loop threads)
    assert threads["db"] != threading.current_thread().name
    assert threads["warm"] != threads["db"]

    by = spans_by_name(exporter)
    (event,) = by["rehydrate.restore"]
    attrs = dict(event.attributes)
    assert attrs["rehydrate.generation"] == 1
    assert attrs["rehydrate.reason"] == "test"
    assert attrs["rehydrate.kind"] == "restore"
    assert attrs["rehydrate.frozen_for"] == 12.5
    assert attrs["rehydrate.ok"] is True
    assert list(attrs["rehydrate.env.added"]) == ["API_KEY"]
    assert event.status.status_code is not StatusCode.ERROR

    hook_names = {h.name for h in report.hooks if h.outcome != "skipped"}
    assert {"db", "warm", "cache", "rehydrate.env"} <= hook_names
    for name in hook_names:
        (span,) = by[name]
        assert span.parent is not None and span.parent.span_id == event.context.span_id, name
        assert span.context.trace_id == event.context.trace_id
        a = dict(span.attributes)
        assert a["rehydrate.hook.name"] == name
        assert a["rehydrate.hook.outcome"] == "ok"
        assert a["rehydrate.generation"] == 1
        assert "rehydrate.hook.phase" in a
        assert event.start_time <= span.start_time and span.end_time <= event.end_time
    assert dict(by["db"][0].attributes)["rehydrate.hook.phase"] == "connections"
    assert dict(by["warm"][0].attributes)["rehydrate.hook.async"] is True
    # spans the hooks create are children of their hook span
    assert by["app.reconnect"][0].parent.span_id == by["db"][0].context.span_id
    assert by["app.warm"][0].parent.span_id == by["warm"][0].context.span_id
    # env values never appear anywhere
    dump = json.dumps([s.to_json() for s in exporter.get_finished_spans()])
    assert "s3cr3t-value" not in dump


def test_failures_and_timeouts_set_error_status(otel):
    engine, exporter, reader, _, _ = otel
    release = threading.Event()

    @engine.registry.after_restore(name="boom")
    def boom():
        raise ValueError("broken peer")

    @engine.registry.after_restore(name="stuck", timeout=0.2)
    def stuck():
        release.wait(10)

    @engine.registry.after_restore(name="slow_async", timeout=0.2)
    async def slow_async():
        await asyncio.sleep(10)

    @engine.registry.after_restore(name="optional", required=False)
    def optional():
        raise RuntimeError("meh")

    report = engine.simulate_restore()
    assert not report.ok
    outcomes = {h.name: h.outcome for h in report.hooks}
    assert outcomes["stuck"] == "timeout" and outcomes["slow_async"] == "timeout"

    by = spans_by_name(exporter)
    (event,) = by["rehydrate.restore"]
    assert event.status.status_code is StatusCode.ERROR
    assert dict(event.attributes)["rehydrate.ok"] is False
    for name, outcome in (("boom", "failed"), ("stuck", "timeout"), ("slow_async", "timeout"),
                          ("optional", "failed")):
        (span,) = by[name]
        assert span.status.status_code is StatusCode.ERROR, name
        assert dict(span.attributes)["rehydrate.hook.outcome"] == outcome
        assert span.parent.span_id == event.context.span_id
    assert any(e.name == "exception" for e in by["boom"][0].events)
    assert "broken peer" in by["boom"][0].status.description

    # the abandoned sync hook returns later: its span is not ended twice, nothing breaks
    release.set()
    # Wait for the abandoned thread to finish: until it has, the hook is not started again.
    deadline = time.monotonic() + 10
    while engine.status().extra["hung_hooks"]:
        assert time.monotonic() < deadline, "the released hook thread never finished"
        time.sleep(0.01)
    engine.simulate_restore()
    assert len(spans_by_name(exporter)["stuck"]) == 2

    failures = metric_points(reader)["rehydrate.hook.failures"]
    per_hook = {dict(p.attributes)["rehydrate.hook.name"]: p.value for p in failures}
    assert per_hook["boom"] == 2 and per_hook["optional"] == 2
    assert per_hook["stuck"] == 1  # the second run was fast


def test_hooks_failed_without_being_started_get_a_span_and_are_counted(otel):
    """A hook whose thread from an earlier timeout still ran it failed every later
    restore (HookStillRunning), and hooks the run's deadline left no time for timed out:
    the report said so, but no hook span and no rehydrate.hook.failures point did — an
    alert on the counter saw one failure, the first timeout, then nothing."""
    engine, exporter, reader, _, _ = otel
    release = threading.Event()

    @engine.registry.after_restore(name="stuck", timeout=0.1)
    def stuck():
        release.wait(10)

    try:
        first = engine.simulate_restore()
        again = [engine.simulate_restore() for _ in range(2)]
        assert [h.outcome for r in (first, *again) for h in r.hooks if h.name == "stuck"] \
            == ["timeout", "failed", "failed"]
        spans = spans_by_name(exporter)["stuck"]
        assert [dict(s.attributes)["rehydrate.hook.outcome"] for s in spans] == \
            ["timeout", "failed", "failed"]
        assert all(s.status.status_code is StatusCode.ERROR for s in spans)
        assert [dict(s.attributes)["rehydrate.hook.attempts"] for s in spans[1:]] == [0, 0]
        assert "still running" in spans[1].status.description
        events = [e for e in spans_by_name(exporter)["rehydrate.restore"]]
        assert [s.parent.span_id for s in spans] == [e.context.span_id for e in events]
        failures = metric_points(reader)["rehydrate.hook.failures"]
        per_outcome = {dict(p.attributes)["rehydrate.hook.outcome"]: p.value
                       for p in failures if dict(p.attributes)["rehydrate.hook.name"] == "stuck"}
        assert per_outcome == {"timeout": 1, "failed": 2}
    finally:
        release.set()

    # the run's deadline: a hook never started is a timeout of its own
    deadline = time.monotonic() + 10
    while engine.status().extra["hung_hooks"]:
        assert time.monotonic() < deadline, "the released hook thread never finished"
        time.sleep(0.01)
    exporter.clear()
    release.clear()

    @engine.registry.after_restore(name="later", phase=Phase.APPLICATION)
    def later():
        raise AssertionError("not started: the deadline passed")

    try:
        report = engine.restore_detected("test", deadline=0.05)
    finally:
        release.set()
    assert {h.name: (h.outcome, h.attempts) for h in report.hooks}["later"] == ("timeout", 0)
    (span,) = spans_by_name(exporter)["later"]
    assert dict(span.attributes)["rehydrate.hook.outcome"] == "timeout"
    assert "not started" in span.status.description


def test_a_run_interrupted_by_ctrl_c_ends_its_spans(otel):
    """Ctrl-C in the caller waiting for the hooks gives the run up with no report (so no
    event_finished): its rehydrate.restore span stayed open for ever, and the hook spans
    already exported pointed to a parent that never was."""
    import signal

    engine, exporter, _, _, _ = otel
    release = threading.Event()
    main = threading.main_thread().ident
    assert threading.current_thread() is threading.main_thread() and main is not None

    @engine.registry.after_restore(name="slow", timeout=None)
    def slow():
        if not release.is_set():
            # sent to the main thread itself: its blocked wait is interrupted (test_runner)
            signal.pthread_kill(main, signal.SIGINT)
            release.wait(10)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.simulate_restore()
        by = spans_by_name(exporter)
        (event,) = by["rehydrate.restore"]
        assert event.status.status_code is StatusCode.ERROR
        assert event.status.description == "run interrupted (KeyboardInterrupt)"
        assert dict(event.attributes)["rehydrate.ok"] is False
        # the hook still running: ended with its event, under it
        (span,) = by["slow"]
        assert span.status.status_code is StatusCode.ERROR
        assert span.parent.span_id == event.context.span_id
        assert all(s.parent.span_id == event.context.span_id
                   for s in exporter.get_finished_spans() if s is not event)
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)
    # the hook returning later ends nothing twice; the next run is a run of its own
    deadline = time.monotonic() + 10
    while engine.status().extra["hung_hooks"]:
        assert time.monotonic() < deadline, "the released hook thread never finished"
        time.sleep(0.01)
    assert len(spans_by_name(exporter)["slow"]) == 1
    assert engine.simulate_restore().ok
    assert len(spans_by_name(exporter)["rehydrate.restore"]) == 2


def test_snapshot_span_and_resume(otel):
    engine, exporter, _, _, _ = otel

    @engine.registry.before_snapshot(phase=Phase.CONNECTIONS, name="close_db")
    def close_db():
        pass

    @engine.registry.after_restore(name="reopen")
    def reopen():
        pass

    engine.simulate_snapshot()
    engine.simulate_restore(kind="resume")
    by = spans_by_name(exporter)
    (snap,) = by["rehydrate.snapshot"]
    assert dict(snap.attributes)["rehydrate.kind"] == "snapshot"
    assert by["close_db"][0].parent.span_id == snap.context.span_id
    (resume,) = by["rehydrate.restore"]
    assert dict(resume.attributes)["rehydrate.kind"] == "resume"
    assert dict(resume.attributes)["rehydrate.generation"] == 0
    assert by["reopen"][0].parent.span_id == resume.context.span_id


def test_metrics_after_simulated_restores(otel):
    engine, _, reader, _, _ = otel

    @engine.registry.after_restore(phase=Phase.NETWORK, name="routes")
    def routes():
        pass

    @engine.registry.after_restore(name="app")
    def app():
        pass

    for _ in range(3):
        assert engine.simulate_restore().ok
    engine.simulate_restore(kind="resume")
    engine.simulate_snapshot()

    pts = metric_points(reader)
    restore = pts["rehydrate.restore.duration"]
    assert sum(p.count for p in restore) == 4
    by_kind = {dict(p.attributes)["rehydrate.kind"]: p.count for p in restore}
    assert by_kind == {"restore": 3, "resume": 1}
    assert sum(p.count for p in pts["rehydrate.snapshot.duration"]) == 1
    phases = {}
    for p in pts["rehydrate.hook.duration"]:
        a = dict(p.attributes)
        if a["rehydrate.event"] == "restore":
            phases[(a["rehydrate.hook.phase"], a["rehydrate.hook.name"])] = p.count
    assert phases[("network", "routes")] == 4
    assert phases[("application", "app")] == 4
    assert phases[("environment", "rehydrate.env")] == 4
    (gen,) = pts["rehydrate.generation"]
    assert gen.value == 3
    assert "rehydrate.hook.failures" not in pts or all(
        p.value == 0 for p in pts["rehydrate.hook.failures"])


def test_an_exporters_errors_are_logged_without_its_urls_credentials(rehydrate_engine, caplog):
    """An exporter's shutdown error (the old one, replaced at a restore) and a flush's
    error quote the collector's URL, query token included: logged raw, the token reached
    the log."""
    import logging

    from opentelemetry.sdk.trace.export import SpanExportResult

    class Failing:
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            raise ConnectionError("POST https://u:pw@collector/v1/traces?api_key=tok_S3CR3T "
                                  "failed")

        def force_flush(self, timeout_millis: int = 0) -> bool:
            raise ConnectionError("POST https://collector/v1/traces?api_key=tok_S3CR3T failed")

    class Provider:
        def force_flush(self, timeout_millis: int = 0) -> bool:
            raise ConnectionError("POST https://collector/v1/traces?api_key=tok_S3CR3T failed")

    exporter = telemetry.restorable_span_exporter(Failing)
    telemetry.refresh_on_restore(Provider(), exporters=[exporter], engine=rehydrate_engine)
    caplog.set_level(logging.DEBUG, logger="rehydrate")
    rehydrate_engine.simulate_snapshot()
    rehydrate_engine.simulate_restore()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "did not shut down cleanly" in text and "collector/v1/traces" in text, text
    assert "tok_S3CR3T" not in text and "pw@" not in text, text


def test_clone_identity_and_exporter_rebuild(otel):
    engine, _, _, _, mp = otel
    inner = InMemorySpanExporter
    wrapped = telemetry.restorable_span_exporter(inner)
    tp = TracerProvider(resource=Resource.create({"service.name": "svc",
                                                  **telemetry.resource_attributes()}))
    batch = BatchSpanProcessor(wrapped, schedule_delay_millis=60_000)
    tp.add_span_processor(batch)
    telemetry.instrument(engine, tracer_provider=tp)
    telemetry.refresh_on_restore(tp, mp, exporters=[wrapped], engine=engine)
    first = wrapped.inner
    old_id = tp.resource.attributes["service.instance.id"]
    assert old_id == entropy.instance_id()

    # before a snapshot: everything recorded so far is flushed (exported by the original)
    with tp.get_tracer("app").start_as_current_span("work-before-snapshot"):
        pass
    report = engine.simulate_snapshot()
    assert report.ok, report.table()
    assert "work-before-snapshot" in [s.name for s in first.get_finished_spans()]

    # after restore: a new instance id on every provider, a new exporter
    report = engine.simulate_restore()
    assert report.ok, report.table()
    new_id = tp.resource.attributes["service.instance.id"]
    assert new_id != old_id and new_id == entropy.instance_id()
    assert mp._sdk_config.resource.attributes["service.instance.id"] == new_id
    assert wrapped.inner is not first and wrapped.rebuilds == 1
    with tp.get_tracer("app").start_as_current_span("work-after-restore"):
        pass
    tp.force_flush()
    after = [s for s in wrapped.inner.get_finished_spans() if s.name == "work-after-restore"]
    assert after and after[0].resource.attributes["service.instance.id"] == new_id
    assert "work-after-restore" not in [s.name for s in first.get_finished_spans()]

    # a resume keeps the identity but still rebuilds the exporter
    engine.simulate_restore(kind="resume")
    assert tp.resource.attributes["service.instance.id"] == new_id
    assert wrapped.rebuilds == 2
    tp.shutdown()


class _RecordingSpanExporter(InMemorySpanExporter):
    """In-memory exporter that also notes the ``service.instance.id`` each span carried
    when it was exported (the SDK Resource is rewritten in place after a restore)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, str]] = []

    def export(self, spans: Any) -> Any:
        self.sent.extend((s.name, s.resource.attributes["service.instance.id"]) for s in spans)
        return super().export(spans)


class _MemoryMetricExporter(MetricExporter):
    def __init__(self, temporality: dict[type, AggregationTemporality] | None = None) -> None:
        super().__init__(preferred_temporality=temporality)
        self.sent: list[tuple[str, str, int]] = []  # (metric, instance id, count or value)

    def export(self, metrics_data: Any, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        for rm in metrics_data.resource_metrics:
            iid = rm.resource.attributes["service.instance.id"]
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.data.data_points:
                        self.sent.append((m.name, iid, getattr(p, "count", None)
                                          or getattr(p, "value", 0)))
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


@pytest.fixture
def batched(rehydrate_engine):
    """Batching providers (nothing exported until a flush) managed by refresh_on_restore."""
    engine = rehydrate_engine
    spans = _RecordingSpanExporter()
    resource = Resource.create({"service.name": "svc", **telemetry.resource_attributes()})
    tp = TracerProvider(resource=resource)
    tp.add_span_processor(BatchSpanProcessor(spans, schedule_delay_millis=600_000))
    metrics = _MemoryMetricExporter()
    mp = MeterProvider(resource=resource, metric_readers=[
        PeriodicExportingMetricReader(metrics, export_interval_millis=600_000)])
    tel = telemetry.instrument(engine, tracer_provider=tp, meter_provider=mp)
    telemetry.refresh_on_restore(tp, mp, engine=engine)
    yield engine, tel, tp, spans, metrics
    tp.shutdown()
    mp.shutdown()


def test_snapshot_span_and_metrics_exported_by_the_original_before_snapshot_returns(batched):
    engine, _, tp, spans, metrics = batched

    @engine.registry.before_snapshot(phase=Phase.CONNECTIONS, name="close_db")
    def close_db():
        pass

    pre_id = entropy.instance_id()
    assert tp.resource.attributes["service.instance.id"] == pre_id
    report = engine.simulate_snapshot()
    assert report.ok, report.table()

    # everything of the snapshot event left the process before simulate_snapshot()
    # returned — the rehydrate.snapshot span itself included — with the original's id
    sent = dict(spans.sent)
    assert sent.get("rehydrate.snapshot") == pre_id, spans.sent
    for h in report.hooks:
        if h.outcome != "skipped":
            assert sent.get(h.name) == pre_id, h.name
    snap_metrics = [(iid, n) for name, iid, n in metrics.sent
                    if name == "rehydrate.snapshot.duration"]
    assert snap_metrics == [(pre_id, 1)]

    # the clone: new identity; it does not export the snapshot span a second time
    spans.sent.clear()
    assert engine.simulate_restore().ok
    new_id = entropy.instance_id()
    assert new_id != pre_id
    tp.force_flush()
    names = [name for name, _ in spans.sent]
    assert "rehydrate.snapshot" not in names and "close_db" not in names
    assert "rehydrate.restore" in names
    assert {iid for _, iid in spans.sent} == {new_id}


def test_flush_hook_is_the_fallback_when_the_observer_missed_the_event(batched):
    engine, tel, tp, spans, _ = batched
    engine.remove_observer(tel)  # no event callbacks: only the hook can flush
    with tp.get_tracer("app").start_as_current_span("work-before-snapshot"):
        pass
    report = engine.simulate_snapshot()
    assert report.ok, report.table()
    assert "work-before-snapshot" in [name for name, _ in spans.sent]
    (hook,) = [h for h in report.hooks if h.name == "rehydrate.telemetry.flush"]
    assert hook.outcome == "ok"


def test_snapshot_miss_and_mismatch_are_recorded(otel, tmp_path, monkeypatch):
    engine, exporter, reader, _, _ = otel
    monkeypatch.delenv("REHYDRATE_EXPECT_RESTORE", raising=False)
    manifest = fingerprint.fingerprint()
    manifest["gpu_driver"] = "535.104.05"  # the snapshot's node had another driver
    path = tmp_path / "manifest.json"
    fingerprint.write_manifest(manifest, path)
    fingerprint.configure(path=path, engine=engine)
    engine.start(detectors="none")

    pts = metric_points(reader)
    (miss,) = pts["rehydrate.snapshot.misses"]
    assert miss.value == 1 and dict(miss.attributes)["rehydrate.miss.field"] == "gpu_driver"
    (span,) = spans_by_name(exporter)["rehydrate.snapshot-miss"]
    assert "gpu_driver" in dict(span.attributes)["rehydrate.miss.reason"]

    # after a restore onto a differing node: counter per field + event on the restore span
    mgr = fingerprint.configure(engine=engine)
    mgr.manifest = manifest
    engine.simulate_restore()
    (event,) = spans_by_name(exporter)["rehydrate.restore"]
    (ev,) = [e for e in event.events if e.name == "rehydrate.fingerprint.mismatch"]
    assert list(ev.attributes["rehydrate.fingerprint.fields"]) == ["gpu_driver"]
    mism = metric_points(reader)["rehydrate.fingerprint.mismatches"]
    assert {dict(p.attributes)["rehydrate.fingerprint.field"]: p.value for p in mism} == {
        "gpu_driver": 1}


def test_instrumentation_can_be_switched_off(otel, monkeypatch):
    engine, exporter, _, _, _ = otel
    monkeypatch.setenv("REHYDRATE_TELEMETRY", "off")
    engine.simulate_restore()
    assert exporter.get_finished_spans() == ()
    monkeypatch.delenv("REHYDRATE_TELEMETRY")
    engine.simulate_restore()
    assert len(spans_by_name(exporter)["rehydrate.restore"]) == 1


_SUBPROCESS = textwrap.dedent("""
    import json, sys
    import rehydrate
    from rehydrate.testing import isolated_engine

    out = {"after_import": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}
    engine = isolated_engine()
    seen = []

    @engine.registry.after_restore
    def hook():
        if "opentelemetry.trace" in sys.modules:
            from opentelemetry import trace
            seen.append(trace.get_current_span().get_span_context().is_valid)

    assert engine.simulate_restore().ok
    out["after_restore"] = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    # the API imported by the application, still no SDK configured: no-op spans
    import opentelemetry.trace
    assert engine.simulate_restore().ok
    out["valid_span_without_sdk"] = list(seen)
    # an SDK configured later is picked up at the next event
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exp = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exp))
    opentelemetry.trace.set_tracer_provider(tp)
    assert engine.simulate_restore().ok
    out["spans_with_sdk"] = sorted({s.name for s in exp.get_finished_spans()})
    out["valid_span_with_sdk"] = seen[-1]
    print(json.dumps(out))
""")


def test_no_sdk_is_a_noop_and_sdk_is_detected_per_event():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS], check=False, capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["after_import"] == []  # import rehydrate does not import opentelemetry
    assert out["after_restore"] == []  # nor does a restore when no SDK is configured
    assert out["valid_span_without_sdk"] == [False]
    assert "rehydrate.restore" in out["spans_with_sdk"] and "__main__.hook" in out["spans_with_sdk"]
    assert out["valid_span_with_sdk"] is True


def test_default_engine_is_instrumented():
    eng = isolated_engine()
    try:
        assert eng.extension("telemetry", telemetry.Telemetry) is telemetry.instrument(eng)
        assert not telemetry.instrument(eng).active() or "opentelemetry.trace" in sys.modules
    finally:
        eng.close()


def test_a_broken_provider_never_breaks_hooks(rehydrate_engine, caplog):
    class BrokenTracer:
        def start_span(self, *a, **k):
            raise RuntimeError("exporter misconfigured")

    class BrokenProvider:
        def get_tracer(self, *a, **k):
            return BrokenTracer()

    ran = []
    rehydrate_engine.registry.after_restore(lambda: ran.append(1), name="app")
    telemetry.instrument(rehydrate_engine, tracer_provider=BrokenProvider())
    report = rehydrate_engine.simulate_restore()
    assert report.ok and ran == [1]
    assert "exporter misconfigured" in caplog.text


def test_bad_refresh_or_instrument_arguments_change_nothing(otel):
    """``refresh_on_restore(tp, flush_timeout=nan)`` raised after marking its hooks
    installed: the corrected call then installed none, and clones kept the original's
    ``service.instance.id``. ``instrument(tracer_provider="garbage")`` was accepted and
    logged a traceback at every event."""
    engine, _, _, _, mp = otel
    tp = TracerProvider(resource=Resource.create({"service.name": "svc",
                                                  **telemetry.resource_attributes()}))
    for bad in (float("nan"), -1, "5", True):
        with pytest.raises(ValueError, match="telemetry: flush_timeout"):
            telemetry.refresh_on_restore(tp, engine=engine, flush_timeout=bad)
    with pytest.raises(TypeError, match="has no rebuild"):
        telemetry.refresh_on_restore(tp, exporters=[object()], engine=engine)
    with pytest.raises(TypeError, match="tracer_provider has no get_tracer"):
        telemetry.instrument(engine, tracer_provider="garbage")
    with pytest.raises(TypeError, match="meter_provider has no get_meter"):
        telemetry.instrument(engine, meter_provider=tp)
    telemetry.refresh_on_restore(tp, engine=engine, flush_timeout=2)
    old_id = tp.resource.attributes["service.instance.id"]
    report = engine.simulate_restore()
    assert report.ok, report.table()
    assert tp.resource.attributes["service.instance.id"] not in (old_id, None)
    assert [h.name for h in report.hooks].count("rehydrate.telemetry.identity") == 1


@pytest.mark.parametrize("bad", ["nope", None, "tracer", "proxy"])
def test_refresh_refuses_what_is_not_an_sdk_provider(otel, bad):
    """refresh_on_restore(tracer) or (the API's proxy provider) was accepted: nothing was
    ever flushed before a snapshot and every restore's identity hook failed with "no SDK
    resource found" (or, for a Tracer, quietly flushed nothing)."""
    from opentelemetry.trace import ProxyTracerProvider

    engine, _, _, tp, _ = otel
    arg = {"tracer": tp.get_tracer("app"), "proxy": ProxyTracerProvider()}.get(bad, bad)
    with pytest.raises(TypeError, match="not an OpenTelemetry SDK provider"):
        telemetry.refresh_on_restore(tp, arg, engine=engine)
    # nothing changed: no hooks, no provider managed
    assert telemetry.manager(engine)._managed_providers == []
    assert "rehydrate.telemetry.identity" not in [
        h.name for h in engine.simulate_restore().hooks]


class _StuckProvider:
    """A provider whose force_flush() ignores its timeout and blocks (an exporter stuck on
    a black-holed collector) until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        self.calls += 1
        self.release.wait()
        return True


def test_a_stuck_flush_does_not_block_the_snapshot(rehydrate_engine, caplog):
    # force_flush ran in the caller's thread: snapshot_requested() / simulate_snapshot()
    # never returned, whatever flush_timeout said.
    engine = rehydrate_engine
    stuck = _StuckProvider()
    telemetry.refresh_on_restore(stuck, engine=engine, flush_timeout=0.2)
    done: list[Any] = []
    try:
        for _ in range(2):
            caplog.clear()
            t = threading.Thread(target=lambda: done.append(engine.simulate_snapshot()),
                                 daemon=True)
            t.start()
            t.join(60)  # only bounds a failure: the snapshot returns after flush_timeout
            assert not t.is_alive(), "simulate_snapshot() blocked by the stuck flush"
            assert engine.simulate_restore(kind="resume").ok
            warnings = [r.getMessage() for r in caplog.records
                        if r.levelname == "WARNING" and "telemetry" in r.getMessage()]
            assert len(warnings) == 1, warnings
            assert "_StuckProvider" in warnings[0]
        assert [r.ok for r in done] == [True, True]
        # the second snapshot did not stack another stuck flush on the first
        assert stuck.calls == 1
    finally:
        stuck.release.set()


def test_a_forked_child_reports_its_own_service_instance_id(batched):
    """A forked worker got a new instance_id(), but its providers' Resource still said the
    parent's service.instance.id: every worker reported as the parent."""
    from detect_helpers import in_forked_child

    _, tel, tp, _, _ = batched
    parent_id = tp.resource.attributes["service.instance.id"]

    def child() -> dict:
        return {"resource": tp.resource.attributes["service.instance.id"],
                "id": entropy.instance_id(), "last": tel.last_instance_id}

    out = in_forked_child(child)
    assert out["id"] != parent_id and out["resource"] == out["last"] == out["id"], out
    assert tp.resource.attributes["service.instance.id"] == parent_id


SECONDS_BOUNDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


def test_duration_histograms_have_bounds_in_seconds(otel):
    """The histograms (unit s) had the SDK's default bounds 0, 5, 10, 25 … 10000, meant
    for milliseconds: every restore and hook under 5 s fell in one bucket."""
    engine, _, reader, _, _ = otel
    engine.registry.after_restore(lambda: None, name="app")
    engine.simulate_snapshot()
    engine.simulate_restore()
    pts = metric_points(reader)
    for name in ("rehydrate.restore.duration", "rehydrate.snapshot.duration",
                 "rehydrate.hook.duration"):
        assert pts[name], name
        for p in pts[name]:
            assert list(p.explicit_bounds) == SECONDS_BOUNDS, name
            # a fast run lands in a low bucket, not in (0, 5]
            assert sum(p.bucket_counts[:10]) == p.count, (name, p)


class _OldApiMeter:
    """A meter of an opentelemetry-api older than 1.30: create_histogram() takes no
    explicit_bucket_boundaries_advisory."""

    def __init__(self, meter: Any) -> None:
        self._meter = meter

    def create_histogram(self, name: str, unit: str = "", description: str = "") -> Any:
        return self._meter.create_histogram(name, unit=unit, description=description)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meter, name)


class _OldApiMeterProvider:
    def __init__(self, mp: MeterProvider) -> None:
        self._mp = mp

    def get_meter(self, *args: Any, **kwargs: Any) -> _OldApiMeter:
        return _OldApiMeter(self._mp.get_meter(*args, **kwargs))


def test_an_api_without_the_bucket_advisory_gets_the_default_bounds(rehydrate_engine, caplog):
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    telemetry.instrument(rehydrate_engine, meter_provider=_OldApiMeterProvider(mp))
    assert rehydrate_engine.simulate_restore().ok
    (p,) = metric_points(reader)["rehydrate.restore.duration"]
    assert p.count == 1 and list(p.explicit_bounds)[:3] == [0, 5, 10]
    assert "telemetry" not in caplog.text
    mp.shutdown()


def test_generation_gauge_reports_every_engine_on_a_meter_provider(rehydrate_engine):
    """The SDK keeps the first instrument of a name and ignores the callback of a second:
    a second engine on the same MeterProvider was never reported."""
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    first, second = isolated_engine(), rehydrate_engine
    try:
        for engine, restores in ((first, 1), (second, 3)):
            telemetry.instrument(engine, meter_provider=mp)
            for _ in range(restores):
                assert engine.simulate_restore().ok
        points = metric_points(reader)["rehydrate.generation"]
        assert sorted(p.value for p in points) == [1, 3]
        gauge = {dict(p.attributes)["rehydrate.engine"]: p.value for p in points}
        assert gauge == {telemetry.manager(first).engine_label(): 1,
                         telemetry.manager(second).engine_label(): 3}
    finally:
        first.close()
    gone = weakref.ref(first)
    del first, engine
    gc.collect()
    assert gone() is None  # the gauge holds engines weakly
    assert second.simulate_restore().ok
    (point,) = metric_points(reader)["rehydrate.generation"]
    label = telemetry.manager(second).engine_label()
    assert dict(point.attributes) == {"rehydrate.engine": label, "rehydrate.state": "ready"}
    assert point.value == 4
    mp.shutdown()


def test_an_engine_given_another_meter_provider_leaves_the_first_ones_gauge(
        rehydrate_engine):
    readers = [InMemoryMetricReader(), InMemoryMetricReader()]
    providers = [MeterProvider(metric_readers=[r]) for r in readers]
    for mp in providers:
        telemetry.instrument(rehydrate_engine, meter_provider=mp)
        assert rehydrate_engine.simulate_restore().ok
    assert "rehydrate.generation" not in metric_points(readers[0])
    (point,) = metric_points(readers[1])["rehydrate.generation"]
    assert point.value == 2
    for mp in providers:
        mp.shutdown()


def test_the_default_engine_is_labelled_default():
    import rehydrate

    assert telemetry.manager(rehydrate.default_engine).engine_label() == "default"


DELTA = {Counter: AggregationTemporality.DELTA, Histogram: AggregationTemporality.DELTA,
         ObservableGauge: AggregationTemporality.DELTA}


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_what_a_clone_exports_of_the_originals_metrics(rehydrate_engine, temporality):
    """docs/telemetry.md, Limits: with cumulative temporality a clone exports the
    original's accumulated points (here its snapshot duration) again under its own
    service.instance.id; with delta temporality the flush before the snapshot took them,
    and the clone exports only what it recorded itself."""
    engine = rehydrate_engine
    resource = Resource.create({"service.name": "svc", **telemetry.resource_attributes()})
    exporter = _MemoryMetricExporter(DELTA if temporality == "delta" else None)
    mp = MeterProvider(resource=resource, metric_readers=[
        PeriodicExportingMetricReader(exporter, export_interval_millis=600_000)])
    telemetry.instrument(engine, meter_provider=mp)
    telemetry.refresh_on_restore(mp, engine=engine)
    pre_id = entropy.instance_id()
    assert engine.simulate_snapshot().ok
    assert [(n, iid) for n, iid, _ in exporter.sent
            if n == "rehydrate.snapshot.duration"] == [("rehydrate.snapshot.duration", pre_id)]
    exporter.sent.clear()
    assert engine.simulate_restore().ok
    mp.force_flush()
    clone_id = entropy.instance_id()
    assert {iid for _, iid, _ in exporter.sent} == {clone_id}
    names = {n for n, _, _ in exporter.sent}
    assert "rehydrate.restore.duration" in names
    assert ("rehydrate.snapshot.duration" in names) is (temporality == "cumulative")
    mp.shutdown()


def _gauge(reader: InMemoryMetricReader) -> dict[str, Any]:
    return {dict(p.attributes)["rehydrate.engine"]: p.value
            for p in metric_points(reader).get("rehydrate.generation", [])}


class _SpyLock:
    """A lock that tells when one of ``threads`` starts waiting for it."""

    def __init__(self, threads: list[threading.Thread], waiting: threading.Event) -> None:
        self._lock = threading.Lock()
        self._threads = threads
        self._waiting = waiting

    def __enter__(self) -> Any:
        if threading.current_thread() in self._threads:
            self._waiting.set()
        return self._lock.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._lock.__exit__(*exc)


def test_an_engine_joining_while_the_gauge_is_collected_loses_no_point(rehydrate_engine,
                                                                         caplog):
    """Engines join a meter's gauge on their own threads: one that joined while the SDK's
    collecting thread iterated the set raised "Set changed size during iteration" in the
    callback, and that collection exported no engine's generation at all. Here another
    thread's engine joins in the middle of the callback's iteration, every time."""
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    others = [isolated_engine() for _ in range(2)]
    late = isolated_engine()
    joiners: list[threading.Thread] = []
    errors: list[BaseException] = []
    progress = threading.Event()  # the joining thread has added, or waits to add

    def join() -> None:
        try:
            telemetry.instrument(late, meter_provider=mp)
            assert late.simulate_restore().ok
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            progress.set()

    class JoinMidIteration(weakref.WeakSet):
        def add(self, item: Any) -> None:
            super().add(item)
            progress.set()

        def __iter__(self) -> Any:
            it = super().__iter__()
            yield next(it)
            if not joiners:
                joiners.append(threading.Thread(target=join))
                joiners[0].start()
                assert progress.wait(30)
            yield from it

    try:
        for engine in (rehydrate_engine, *others):
            telemetry.instrument(engine, meter_provider=mp)
            assert engine.simulate_restore().ok
        inst = telemetry.manager(rehydrate_engine)._instruments
        assert inst is not None
        inst.telemetries = JoinMidIteration(inst.telemetries)
        inst._lock = _SpyLock(joiners, progress)  # type: ignore[assignment]
        labels = [telemetry.manager(e).engine_label() for e in (rehydrate_engine, *others)]
        assert _gauge(reader) == dict.fromkeys(labels, 1)
        assert "Callback failed" not in caplog.text
        joiners[0].join(30)
        assert errors == []
        # the engine that joined meanwhile is in the next collection
        assert _gauge(reader) == {**dict.fromkeys(labels, 1),
                                  telemetry.manager(late).engine_label(): 1}
    finally:
        for t in joiners:
            t.join(30)
        for engine in (*others, late):
            engine.close()
        mp.shutdown()


def test_a_forked_child_collects_the_gauge_while_a_parent_thread_held_its_lock(
        rehydrate_engine):
    """The gauge's lock, held by a parent thread at fork(), would be held for ever in the
    child: its every collection hung."""
    from detect_helpers import in_forked_child

    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    telemetry.instrument(rehydrate_engine, meter_provider=mp)
    assert rehydrate_engine.simulate_restore().ok
    inst = telemetry.manager(rehydrate_engine)._instruments
    assert inst is not None
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with inst._lock:
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(30)
        out = in_forked_child(lambda: {"gauge": _gauge(reader)}, deadline=5)
    finally:
        release.set()
        holder.join(30)
    assert out == {"gauge": {telemetry.manager(rehydrate_engine).engine_label(): 1}}, out
    mp.shutdown()


@pytest.fixture
def another_on_the_same_provider(rehydrate_engine):
    """Another engine: it and rehydrate_engine instrumented on one MeterProvider and
    restored once each. The provider's reader, and that engine (closed after the test)."""
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    other = isolated_engine()
    try:
        for engine in (rehydrate_engine, other):
            telemetry.instrument(engine, meter_provider=mp)
            assert engine.simulate_restore().ok
        yield reader, other
    finally:
        other.close()
        mp.shutdown()


def test_a_closed_engine_leaves_the_gauge_until_it_runs_again(rehydrate_engine,
                                                              another_on_the_same_provider):
    """docs/telemetry.md says the gauge reports every live engine: a closed engine that
    something still referred to was reported as ready for ever."""
    reader, other = another_on_the_same_provider
    other.close()
    label = telemetry.manager(rehydrate_engine).engine_label()
    assert _gauge(reader) == {label: 1}
    assert other.simulate_restore().ok  # used again: live again
    assert _gauge(reader) == {label: 1, telemetry.manager(other).engine_label(): 2}


def test_a_closed_engine_started_again_is_on_the_gauge_at_once(
        rehydrate_engine, another_on_the_same_provider):
    """docs/telemetry.md: an engine is reported from its start() until its close(). One
    closed and started again was missing from the gauge until its next event."""
    reader, other = another_on_the_same_provider
    label = telemetry.manager(rehydrate_engine).engine_label()
    theirs = telemetry.manager(other).engine_label()
    other.close()
    assert _gauge(reader) == {label: 1}
    assert other.start("none") == []
    points = {dict(p.attributes)["rehydrate.engine"]: dict(p.attributes)["rehydrate.state"]
              for p in metric_points(reader)["rehydrate.generation"]}
    assert _gauge(reader) == {label: 1, theirs: 1}
    assert points[theirs] == "ready"


def test_engines_with_telemetry_off_are_not_on_the_gauge(rehydrate_engine,
                                                        another_on_the_same_provider,
                                                        monkeypatch):
    reader, other = another_on_the_same_provider
    telemetry.instrument(other, enabled=False)
    label = telemetry.manager(rehydrate_engine).engine_label()
    assert _gauge(reader) == {label: 1}
    monkeypatch.setenv("REHYDRATE_TELEMETRY", "off")
    assert _gauge(reader) == {}
    monkeypatch.delenv("REHYDRATE_TELEMETRY")
    telemetry.instrument(other, enabled=True)
    assert _gauge(reader) == {label: 1, telemetry.manager(other).engine_label(): 1}


def test_an_engine_given_a_meter_provider_moves_to_its_gauge_at_once(rehydrate_engine):
    """It was reported by the provider it left (and not by the new one) until its next
    event."""
    readers = [InMemoryMetricReader(), InMemoryMetricReader()]
    providers = [MeterProvider(metric_readers=[r]) for r in readers]
    label = telemetry.manager(rehydrate_engine).engine_label()
    telemetry.instrument(rehydrate_engine, meter_provider=providers[0])
    assert _gauge(readers[0]) == {label: 0}
    assert rehydrate_engine.simulate_restore().ok
    telemetry.instrument(rehydrate_engine, meter_provider=providers[1])
    assert _gauge(readers[0]) == {}
    assert _gauge(readers[1]) == {label: 1}
    for mp in providers:
        mp.shutdown()


def test_a_broken_meter_provider_given_to_instrument_is_logged_not_raised(
        rehydrate_engine, caplog):
    class BrokenMeterProvider:
        def get_meter(self, *a: Any, **k: Any) -> Any:
            raise RuntimeError("meter provider misconfigured")

    telemetry.instrument(rehydrate_engine, meter_provider=BrokenMeterProvider())
    assert "meter provider misconfigured" in caplog.text
    assert rehydrate_engine.simulate_restore().ok


_GAUGE_AT_START = textwrap.dedent("""
    import json
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    import rehydrate

    def gauge():
        data = reader.get_metrics_data()
        return [(dict(p.attributes), p.value) for rm in (data.resource_metrics if data else [])
                for sm in rm.scope_metrics for m in sm.metrics
                if m.name == "rehydrate.generation" for p in m.data.data_points]

    out = {"before_start": gauge()}
    rehydrate.start()
    out["after_start"] = gauge()
    rehydrate.default_engine.close()
    print(json.dumps(out))
""")


def test_the_original_process_reports_generation_0_from_start():
    """The gauge reported an engine only from its first event: the original process,
    started but not yet snapshotted, had no generation 0 point."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "REHYDRATE_"))}
    proc = subprocess.run([sys.executable, "-c", _GAUGE_AT_START], check=False,
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before_start"] == []
    assert out["after_start"] == [[{"rehydrate.engine": "default",
                                    "rehydrate.state": "running"}, 0]], out
