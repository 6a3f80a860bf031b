"""KServe's Python ``ModelServer``: readiness that knows about restores.

KServe's ``GET /v2/health/ready`` answers ready regardless of its models (only a
transformer asks its predictor), and a model's ``healthy()`` is just ``self.ready``, which
``ModelServer.start()`` forces to True. A restored replica would therefore take traffic
while its restore hooks (new keys, reconnections, a warm-up) are still running, or after
they failed. :func:`install` gates both on rehydrate::

    from kserve import ModelServer
    from rehydrate.adapters import kserve as rehydrate_kserve

    server = ModelServer()
    rehydrate_kserve.install(server)
    rehydrate.start()
    server.start([MyModel("my-model")])

From then on, while a restore or snapshot is in progress or the process is degraded:

* ``GET /v2/health/ready`` (and gRPC ``ServerReady``) answer not ready (503);
* every registered model's ``healthy()``, ``GET /v2/models/{name}/ready`` (and
  ``/v1/models/{name}``, gRPC ``ModelReady``) say not ready — so do KServe's
  inference endpoints, which check model readiness first (503 "model not ready");
* inference itself (REST v1/v2 predict/infer/explain, gRPC ``ModelInfer``, and the
  routes KServe serves from data planes of their own: ``POST /v1/timeseries/forecast``,
  the OpenAI ``/openai/v1/...`` routes) is refused with KServe's ``ModelNotReady`` (HTTP
  503, gRPC ``UNAVAILABLE``) — also a request whose readiness check passed just before a
  snapshot began — and the model is not reloaded (KServe calls ``load()`` on a model that
  is not healthy). The REST handlers refuse first, with KServe's own message (no state);
  the adapter's refusals (gRPC ``ModelInfer``, the forecast, that late request) end with
  ``rehydrate: <state>``;
* ``GET /v2/health/live`` stays 200 (a liveness probe must not kill a restoring pod).

In-flight requests are not drained before a snapshot (KServe offers no hook for it):
put :class:`~rehydrate.adapters.asgi.ReadinessGate` in front of KServe's app when a
request may still run when the checkpoint begins, with ``exempt=GATE_EXEMPT`` — the gate
otherwise answers ``/v2/health/live`` with 503 too::

    kserve.model_server.app.add_middleware(ReadinessGate, exempt=rehydrate_kserve.GATE_EXEMPT)

They say ready again once every required restore hook has succeeded. Unknown models still
answer 404. Gating happens on the server object's own data plane and on every model
registered with it, so it covers models registered after :func:`install` too
(``ModelServer.start(models)`` registers them then) and the time-series and OpenAI data
planes KServe builds over copies of its registry (the server does not keep them): their
``get_model()`` asks the model's gated ``healthy()``, then calls ``load()``, and that
``load()`` is refused. A ``load()`` called otherwise — a restore hook reloading the model,
also after asking its ``healthy()``; one called once the process is ready again — runs.
Run the server with one worker (``workers=1``, KServe's default): :func:`install` refuses
a server with more (``ValueError``).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..extensions import Probe, in_hook, resolve_engine
from ._readiness import probe_import, readiness

if TYPE_CHECKING:
    from ..extensions import Engine

__all__ = ["GATE_EXEMPT", "install", "probe"]

log = logging.getLogger("rehydrate.adapters.kserve")

_MARK = "_rehydrate_engine"

GATE_EXEMPT = ("/v2/health/live", "/metrics")
"""What a :class:`~rehydrate.adapters.asgi.ReadinessGate` in front of KServe's FastAPI app
must pass through in every state (its ``exempt=``): KServe's liveness endpoint — a
liveness probe that got the gate's 503 during a restore would restart the pod — and its
Prometheus metrics."""

# The model whose gated healthy() last said not ready in this context (a request's task):
# KServe's get_model() calls that model's load() right after, which is then refused.
_vetoed: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "rehydrate_kserve_vetoed", default=None)


def probe() -> Probe:
    """Usable when the ``kserve`` package is installed."""
    return probe_import("kserve", "pip install 'rehydrate[kserve]'")


def install(model_server: Any, *, engine: Engine | None = None) -> None:
    """Gate ``model_server``'s readiness (server and every model) on ``engine``'s.

    ``model_server``: a ``kserve.ModelServer`` with one worker (``workers=1``, KServe's
    default; more is a ``ValueError``: rehydrate gates the process it runs in, and KServe
    cannot pickle the gated data plane into worker processes). ``engine``: default, the
    process's engine. Installing twice on one server is a no-op; installing for another
    engine is refused.
    """
    eng = resolve_engine(engine)
    dataplane: Any = getattr(model_server, "dataplane", None)
    repository: Any = getattr(model_server, "registered_models", None)
    needed = ((dataplane, "ready"), (dataplane, "model_ready"), (dataplane, "get_model"),
              (dataplane, "get_model_from_registry"), (repository, "get_models"),
              (repository, "update"))
    if not all(callable(getattr(obj, attr, None)) for obj, attr in needed):
        # all checked before anything is patched: a failed install leaves nothing half done
        raise TypeError(f"install() needs a kserve.ModelServer, not "
                        f"{type(model_server).__name__}")
    workers = getattr(model_server, "workers", 1)
    if isinstance(workers, int) and workers > 1:
        # KServe then pickles its data plane into worker processes: the gated methods
        # (closures) cannot be pickled, and start() failed with "Can't pickle local
        # object"; a worker process would not share this process's engine either.
        raise ValueError(f"install() gates one process: this ModelServer has workers="
                         f"{workers}; run it with workers=1 (KServe's default) and scale "
                         "with replicas")
    installed = getattr(model_server, _MARK, None)
    if installed is eng:
        return
    if installed is not None:
        raise ValueError("this ModelServer is already gated on another rehydrate engine")
    models = repository.get_models()
    if not isinstance(models, Mapping):
        raise TypeError(f"install() needs a kserve.ModelServer: its registered_models."
                        f"get_models() returned {type(models).__name__}, not a mapping")
    setattr(model_server, _MARK, eng)

    server_ready: Callable[[], Awaitable[bool]] = dataplane.ready
    model_ready: Callable[..., Awaitable[bool]] = dataplane.model_ready

    async def ready() -> bool:
        return eng.is_ready() and await server_ready()

    async def gated_model_ready(model_name: str, *args: Any, **kwargs: Any) -> bool:
        # the original first: an unknown model still raises ModelNotFound (404)
        return await model_ready(model_name, *args, **kwargs) and eng.is_ready()

    get_model: Callable[..., Awaitable[Any]] = dataplane.get_model

    async def gated_get_model(name: str, *args: Any, **kwargs: Any) -> Any:
        # Every inference (REST v1/v2 and gRPC ModelInfer, explain) fetches its model
        # here, and KServe calls model.load() for a model that is not healthy: while
        # not ready, refuse (503 / UNAVAILABLE) instead of serving or reloading it.
        if not eng.is_ready():
            dataplane.get_model_from_registry(name)  # an unknown model stays a 404
            raise _not_ready(name, eng)
        return await get_model(name, *args, **kwargs)

    dataplane.ready = ready
    # A transformer asks its predictor instead of the model's healthy(): gate that too.
    dataplane.model_ready = gated_model_ready
    dataplane.get_model = gated_get_model

    for model in models.values():
        _gate_model(model, eng)
    update: Callable[..., None] = repository.update

    @functools.wraps(update)
    def gated_update(model: Any, *args: Any, **kwargs: Any) -> None:
        _gate_model(model, eng)
        update(model, *args, **kwargs)

    repository.update = gated_update
    log.info("KServe readiness gated on rehydrate (%d model(s) registered so far)",
             len(repository.get_models()))


def _not_ready(name: str, engine: Engine) -> Exception:
    """KServe's ``ModelNotReady`` (HTTP 503, gRPC ``UNAVAILABLE``) for ``name``."""
    from kserve.errors import ModelNotReady  # type: ignore[import-untyped]

    # readiness(), not engine.status(): this answers every request that arrives during a
    # restore, on the server's loop, and a whole status (its /proc scan of TCP
    # connections, ...) costs milliseconds per call under gVisor.
    refused = ModelNotReady(name, f"rehydrate: {readiness(engine)[1]}")
    # KServe 0.21's gRPC interceptor reads .reason, which ModelNotReady lacks
    # (an AttributeError would make it an UNKNOWN error instead of UNAVAILABLE).
    refused.reason = str(refused)
    return refused  # type: ignore[no-any-return]


def _gate_model(model: Any, engine: Engine) -> None:
    """Make ``model.healthy()`` say False while ``engine`` is not ready, and refuse the
    ``load()`` KServe then calls.

    KServe builds the time-series and OpenAI data planes over copies of the server's
    registry, holding the same model objects: their ``get_model()`` is not the one
    :func:`install` gates. It awaits ``healthy()`` and, on False, calls ``load()`` and
    serves the request. Here, a ``load()`` that follows this gate's "not ready" in the same
    context (the request's task) raises ``ModelNotReady`` (503) instead, when the process
    is still not ready: neither a reload nor a request served during a restore. Other
    ``load()`` calls (a restore hook reloading the model, also after asking ``healthy()``
    itself; one made once the process is ready again) run.
    """
    if getattr(model, _MARK, None) is engine:
        return
    healthy: Callable[[], Awaitable[bool]] = model.healthy
    load: Callable[..., Any] = model.load

    async def gated_healthy() -> bool:
        if not engine.is_ready():
            # Not from a rehydrate hook: a restore hook that asks healthy() (False while
            # it runs) and then reloads the model is the restore itself, not a request.
            _vetoed.set(None if in_hook() else model)
            return False
        _vetoed.set(None)
        return await healthy()

    @functools.wraps(load)
    def gated_load(*args: Any, **kwargs: Any) -> Any:
        if _vetoed.get() is model:
            _vetoed.set(None)
            # Only while still not ready: a task that asked healthy() during a restore
            # and calls load() once the process is ready again (a watchdog reloading the
            # model) was refused with "rehydrate: ready".
            if not engine.is_ready():
                raise _not_ready(str(getattr(model, "name", model)), engine)
        return load(*args, **kwargs)

    model.healthy = gated_healthy
    model.load = gated_load
    setattr(model, _MARK, engine)
