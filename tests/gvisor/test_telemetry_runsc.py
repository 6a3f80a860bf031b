"""Spans and metrics of a real restore: a runsc sandbox checkpointed and restored into a clone.

The workload configures the OpenTelemetry SDK with in-memory exporters, the clock-jump
detector notices the real restore, and a report listener dumps what telemetry recorded.
"""

from __future__ import annotations

import sys
import time

import pytest

from .harness import GVisorHarness

WORKLOAD = """
import asyncio, json, time
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rehydrate import fingerprint, telemetry
from rehydrate.detect.clock_jump import ClockJumpDetector
from rehydrate.testing import isolated_engine

out = open("/results/otel.jsonl", "a", buffering=1)
engine = isolated_engine()
resource = Resource.create({"service.name": "runsc-test", **telemetry.resource_attributes()})
exporter = InMemorySpanExporter()
tp = TracerProvider(resource=resource)
tp.add_span_processor(SimpleSpanProcessor(exporter))
reader = InMemoryMetricReader()
mp = MeterProvider(metric_readers=[reader], resource=resource)
telemetry.instrument(engine, tracer_provider=tp, meter_provider=mp)
telemetry.refresh_on_restore(tp, mp, engine=engine)
fingerprint.configure(engine=engine)

@engine.registry.after_restore(name="app.sync")
def app_sync():
    pass

@engine.registry.after_restore(name="app.async")
async def app_async():
    await asyncio.sleep(0)

def dump(report):
    if report.kind != "restore":
        return
    spans = [{"name": s.name, "id": s.context.span_id,
              "parent": s.parent.span_id if s.parent else None,
              "attrs": {k: (list(v) if isinstance(v, tuple) else v)
                        for k, v in s.attributes.items()},
              "status": s.status.status_code.name} for s in exporter.get_finished_spans()]
    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    points.setdefault(m.name, []).append(
                        {"attrs": dict(p.attributes),
                         "value": getattr(p, "value", None), "count": getattr(p, "count", None)})
    out.write(json.dumps({"event": "restored", "spans": spans, "metrics": points,
                          "instance_id": tp.resource.attributes["service.instance.id"],
                          "fingerprint": engine.status().extra["fingerprint"]}) + "\\n")

engine.add_listener(dump)
engine.simulate_snapshot()  # the before-snapshot run (manifest kept in memory)
exporter.clear()
engine.start([ClockJumpDetector(threshold=1.0)])
out.write(json.dumps({"event": "ready",
                      "instance_id": tp.resource.attributes["service.instance.id"]}) + "\\n")
while True:
    time.sleep(3600)
"""


@pytest.mark.gvisor
def test_restore_telemetry_in_a_runsc_clone(gvisor: GVisorHarness) -> None:
    orig = gvisor.run([sys.executable, "-c", WORKLOAD], name="otel")
    ready = orig.wait_for("otel.jsonl", lambda r: r["event"] == "ready", timeout=60)
    image = orig.checkpoint()
    frozen_at = time.monotonic()
    while time.monotonic() - frozen_at < 2.0:  # frozen well past the detector threshold
        time.sleep(0.05)
    clone = gvisor.restore(image, orig, name="otel-clone")
    rec = clone.wait_for("otel.jsonl", lambda r: r["event"] == "restored", timeout=60)

    spans = rec["spans"]
    (event,) = [s for s in spans if s["name"] == "rehydrate.restore"]
    assert event["attrs"]["rehydrate.reason"] == "clock-jump"
    assert event["attrs"]["rehydrate.kind"] == "restore"
    assert event["attrs"]["rehydrate.generation"] == 1
    assert event["attrs"]["rehydrate.frozen_for"] >= 1.5
    assert event["attrs"]["rehydrate.ok"] is True
    hooks = {s["name"]: s for s in spans if s["parent"] == event["id"]}
    assert {"app.sync", "app.async", "rehydrate.env", "rehydrate.entropy",
            "rehydrate.fingerprint.check", "rehydrate.telemetry.identity"} <= set(hooks)
    assert all(s["parent"] == event["id"] for s in spans if s is not event)
    assert all(h["attrs"]["rehydrate.hook.outcome"] == "ok" for h in hooks.values())

    metrics = rec["metrics"]
    (gen,) = metrics["rehydrate.generation"]
    assert gen["value"] == 1
    restores = metrics["rehydrate.restore.duration"]
    assert sum(p["count"] for p in restores) == 1
    assert restores[0]["attrs"]["rehydrate.reason"] == "clock-jump"
    assert any(p["attrs"]["rehydrate.hook.name"] == "app.async"
               for p in metrics["rehydrate.hook.duration"])
    assert "rehydrate.hook.failures" not in metrics

    # the clone reports as a new instance; same node, so the manifest still matches
    assert rec["instance_id"] != ready["instance_id"]
    assert rec["fingerprint"]["compatible"] is True
