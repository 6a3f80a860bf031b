"""A real KServe ModelServer with a real kserve.Model, gated by rehydrate (run as a script).

argv: HTTP port, a directory of control files, "gated", "drained" (gated, and
``ReadinessGate`` in front of KServe's app as docs/inference.md shows) or "plain" (no
adapter: the control case), and optionally a gRPC port. Every ``load()`` appends a line to
``<dir>/loads`` (``<dir>/ts-loads`` for the time-series model; KServe reloads a model it
finds not healthy). The restore hook ``warm-up`` waits until ``<dir>/release`` exists and
fails while ``<dir>/fail`` exists, so the test holds a restore open or makes it fail; then
the async restore hook ``reload-forecaster`` asks the time-series model's ``healthy()`` and
reloads it (a hook's own ``load()`` must run). Every ``rehydrate.status()`` built appends a
line to ``<dir>/status-builds``.
The test drives restores through the control socket (``rehydrate notify restore``).
"""

from __future__ import annotations

import os
import sys
import time

import kserve

import rehydrate
from rehydrate.adapters import kserve as rehydrate_kserve
from rehydrate.extensions import default_engine


class Echo(kserve.Model):
    def load(self) -> bool:
        with open(os.path.join(sys.argv[2], "loads"), "a") as f:
            f.write("load\n")
        self.ready = True
        return self.ready

    async def predict(self, payload, headers=None, response_headers=None):
        if isinstance(payload, dict):  # REST v1
            return {"predictions": payload.get("instances", [])}
        first = payload.inputs[0]  # Open Inference Protocol v2 (REST or gRPC)
        values = first.as_numpy()
        out = kserve.InferOutput(name="echo", shape=list(values.shape),
                                 datatype=first.datatype)
        # gRPC answers carry raw contents; a JSON answer carries the list
        out.set_data_from_numpy(values, binary_data=bool(getattr(payload, "from_grpc", 0)))
        return kserve.InferResponse(model_name=self.name, infer_outputs=[out],
                                    response_id=payload.id or "echo")


class HuggingFaceTimeSeriesModel(kserve.Model):
    """KServe 0.21 serves ``POST /v1/timeseries/forecast`` for models of this class name,
    from a data plane of its own over a copy of the server's registry."""

    def load(self) -> bool:
        with open(os.path.join(sys.argv[2], "ts-loads"), "a") as f:
            f.write("load\n")
        self.ready = True
        return self.ready

    async def forecast(self, request, context=None):
        return {"model": request.model, "forecasts": [
            {"name": series.name, "last": series.series[-1]} for series in request.inputs]}


def main() -> None:
    port, control, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    forecaster = HuggingFaceTimeSeriesModel("forecaster")

    @rehydrate.after_restore(name="warm-up", timeout=60)
    def warm_up() -> None:
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(control, "release")):
            if time.monotonic() > deadline:
                raise TimeoutError("never released")
            time.sleep(0.01)
        if os.path.exists(os.path.join(control, "fail")):
            raise RuntimeError("warm-up inference failed")

    @rehydrate.after_restore(name="reload-forecaster", order=1)  # after the warm-up
    async def reload_forecaster() -> None:
        # What KServe's own get_model() does: ask healthy() (gated: False while the
        # restore runs), then reload, e.g. with new credentials. Not refused: the restore
        # is ours, not a request.
        if not await forecaster.healthy():
            forecaster.load()

    def status_built() -> None:
        with open(os.path.join(control, "status-builds"), "a") as f:
            f.write("built\n")

    # every whole status() built appends a line: refusals must not build one
    default_engine().add_status("status-builds", status_built)

    grpc_port = int(sys.argv[4]) if len(sys.argv) > 4 else None
    server = kserve.ModelServer(http_port=port, enable_grpc=grpc_port is not None,
                                grpc_port=grpc_port or 8081, workers=1)
    if mode in ("gated", "drained"):
        rehydrate_kserve.install(server)
    if mode == "drained":
        from rehydrate.adapters.asgi import ReadinessGate

        kserve.model_server.app.add_middleware(ReadinessGate,
                                               exempt=rehydrate_kserve.GATE_EXEMPT)
    rehydrate.start(detectors=["control"])
    model = Echo("echo")
    model.load()
    forecaster.load()
    server.start([model, forecaster])


if __name__ == "__main__":
    main()
