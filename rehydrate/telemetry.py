"""OpenTelemetry spans and metrics for every lifecycle event (OpenTelemetry API only).

Every :class:`~rehydrate.Lifecycle` is instrumented when it is created (this module's
:func:`instrument`); what that costs depends on what the application configured, decided
each time an event runs, never at import:

* no OpenTelemetry SDK configured (the API's proxy providers, or ``opentelemetry`` never
  imported): nothing is created, no OpenTelemetry module is imported — a few attribute
  checks per event and per hook;
* an SDK ``TracerProvider`` / ``MeterProvider`` set globally (or given to
  :func:`instrument`): a ``rehydrate.restore`` / ``rehydrate.snapshot`` span per event
  with one child span per hook (each a *direct* child of the event span, whichever
  thread or event loop ran the hook), and the metrics below.

Metrics (meter ``rehydrate``):

==================================  =========  =====================================
``rehydrate.restore.duration``      histogram  seconds per restore/resume run
``rehydrate.snapshot.duration``     histogram  seconds per before-snapshot run
``rehydrate.hook.duration``         histogram  seconds per hook, by phase and outcome
``rehydrate.hook.failures``         counter    failed or timed-out hook runs
``rehydrate.generation``            gauge      each live engine's generation (observable)
``rehydrate.snapshot.misses``       counter    cold starts where a restore was expected
``rehydrate.fingerprint.mismatches`` counter   manifest fields that differ after restore
==================================  =========  =====================================

The duration histograms advise bucket bounds in seconds, 1 ms to 60 s (an SDK ``View``
overrides them; an API or SDK older than 1.30 ignores the advice, and so does SDK 1.30
for a reader whose exporter asks for an explicit-bucket aggregation of its own, as the
OTLP exporters do: they need 1.31). The generation gauge reports each engine from its
``start()`` (or the ``instrument(engine, meter_provider=...)`` call, or its first event)
until its ``close()`` (a ``start()`` or an event after that reports it again), unless its
telemetry is off.

Clone identity: :func:`resource_attributes` / :func:`resource_detector` give the SDK
``Resource`` a ``service.instance.id`` equal to :func:`rehydrate.entropy.instance_id`,
and :func:`refresh_on_restore` keeps it fresh in every clone, flushes telemetry before a
snapshot and rebuilds exporters (external connections) after restore. ``REHYDRATE_TELEMETRY=off``
switches the instrumentation off.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import _config
from . import entropy as _entropy  # its fork handler first: see _new_id_in_child
from . import extensions as _extensions
from ._context import HookResult, RedactedError, Report, RestoreContext, describe_error
from ._hooks import BEFORE_USER_HOOKS, Hook, Phase
from ._redact import describe_scrubbed, redacted_stacktrace
from ._threads import fresh_lock_after_fork
from ._version import __version__
from .extensions import Probe, resolve_engine

if TYPE_CHECKING:
    import concurrent.futures

    from .extensions import Engine

__all__ = [
    "EVENT_SPAN_NAMES",
    "Telemetry",
    "instrument",
    "manager",
    "record_fingerprint_mismatch",
    "record_snapshot_miss",
    "refresh_on_restore",
    "resource_attributes",
    "resource_detector",
    "restorable_metric_exporter",
    "restorable_span_exporter",
]

log = logging.getLogger("rehydrate")

SCOPE = "rehydrate"
EVENT_SPAN_NAMES = {"restore": "rehydrate.restore", "resume": "rehydrate.restore",
                    "snapshot": "rehydrate.snapshot"}
"""The event span's name per event kind (a resume is a ``rehydrate.restore`` span)."""
_OTEL_ENV = ("OTEL_PYTHON_TRACER_PROVIDER", "OTEL_PYTHON_METER_PROVIDER")


def _disabled_by_env() -> bool:
    return _config.flag("REHYDRATE_TELEMETRY") is False


def _otel_in_use() -> bool:
    """False when no OpenTelemetry provider can possibly be configured (cheap check)."""
    mods = sys.modules
    if "opentelemetry.trace" in mods or "opentelemetry.metrics" in mods:
        return True
    env = os.environ
    return any(k in env for k in _OTEL_ENV)


def _global_tracer_provider() -> Any | None:
    """The global SDK tracer provider, or None for the API's proxy / no-op ones."""
    from opentelemetry import trace

    tp = trace.get_tracer_provider()
    if isinstance(tp, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return tp


def _global_meter_provider() -> Any | None:
    from opentelemetry import metrics

    mp = metrics.get_meter_provider()
    if isinstance(mp, metrics.NoOpMeterProvider) or type(mp).__name__ == "_ProxyMeterProvider":
        return None
    return mp


_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
"""Bucket bounds (seconds) advised for the duration histograms. The SDK's default bounds
(0, 5, 10, 25 … 10000) are meant for milliseconds: every run under 5 s fell in one bucket.
An SDK ``View`` with its own aggregation overrides them."""


def _duration_histogram(meter: Any, name: str, description: str) -> Any:
    try:
        return meter.create_histogram(name, unit="s", description=description,
                                      explicit_bucket_boundaries_advisory=_DURATION_BUCKETS)
    except TypeError:  # an API or SDK older than 1.30 has no advisory parameter: default bounds
        return meter.create_histogram(name, unit="s", description=description)


class _Instruments:
    """The instruments of one meter, shared by every engine instrumented on it.

    One set per meter, not per engine: the SDK keeps the first instrument of a name and
    ignores a second one's callback, so the generation gauge reported the first engine a
    meter provider saw and no other (and older SDKs logged a warning per instrument for
    each further engine). The gauge reports every live engine in :attr:`telemetries`
    (held weakly, as their engines hold them) whose telemetry is on and that is not
    closed."""

    def __init__(self, meter: Any) -> None:
        self.restore_duration = _duration_histogram(
            meter, "rehydrate.restore.duration",
            "Duration of restore and resume runs (all hooks)")
        self.snapshot_duration = _duration_histogram(
            meter, "rehydrate.snapshot.duration",
            "Duration of before-snapshot runs (all hooks)")
        self.hook_duration = _duration_histogram(
            meter, "rehydrate.hook.duration", "Duration of one hook run")
        self.hook_failures = meter.create_counter(
            "rehydrate.hook.failures", unit="{failure}",
            description="Hook runs that failed or timed out")
        self.snapshot_misses = meter.create_counter(
            "rehydrate.snapshot.misses", unit="{miss}",
            description="Cold starts where the deployment expected a restore")
        self.fingerprint_mismatches = meter.create_counter(
            "rehydrate.fingerprint.mismatches", unit="{field}",
            description="Snapshot manifest fields that differ on the node after restore")
        self.telemetries: weakref.WeakSet[Telemetry] = weakref.WeakSet()
        # Held around every change of telemetries and the gauge callback's copy of it:
        # engines join and leave from their own threads (under their own locks) while the
        # SDK runs the callback on the collecting thread; iterating the set as it changed
        # raised "Set changed size during iteration" and the export lost every engine's
        # point.
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)
        meter.create_observable_gauge(
            "rehydrate.generation", callbacks=[self._observe_generation],
            unit="{generation}", description="0 in the original process, +1 per restore")

    def _observe_generation(self, options: Any) -> Iterator[Any]:
        from opentelemetry.metrics import Observation

        with self._lock:
            telemetries = list(self.telemetries)
        if _disabled_by_env():
            return
        for tel in telemetries:
            engine = tel._engine()
            if engine is not None and tel.enabled and not tel._closed:
                yield Observation(engine.generation, {"rehydrate.state": engine.state,
                                                      "rehydrate.engine": tel.engine_label()})


# meter -> its instruments; the instruments do not refer to their meter, so a meter
# provider that is dropped takes its entry with it
_by_meter: weakref.WeakKeyDictionary[Any, _Instruments] = weakref.WeakKeyDictionary()
_by_meter_lock = threading.Lock()
fresh_lock_after_fork(sys.modules[__name__], "_by_meter_lock")
_engine_numbers = itertools.count(1)


def _instruments_of(meter: Any) -> _Instruments:
    with _by_meter_lock:
        try:
            inst = _by_meter.get(meter)
        except TypeError:  # a meter that cannot be referred to weakly: a set per call
            return _Instruments(meter)
        if inst is None:
            inst = _by_meter[meter] = _Instruments(meter)
        return inst


def _engine_started(tel_ref: weakref.ref[Telemetry], engine: Engine) -> None:
    """Start listener: join the generation gauge of the meter provider in use now (the
    lookup an event makes: no OpenTelemetry import when none can be configured)."""
    tel = tel_ref()
    if tel is None:
        return
    # Started again after close(): live again, as an event after close() makes it (it
    # was off the gauge until its next event, which may be hours away).
    tel._closed = False
    try:
        _, mp = tel._providers()
    except Exception:  # telemetry must never break start(); the first event logs it
        log.exception("telemetry: could not look up the meter provider")
        return
    if mp is not None:
        tel._join_gauge(mp)


class _Event:
    __slots__ = ("ctx", "inst", "lock", "open", "parent", "span", "tracer")

    def __init__(self, ctx: RestoreContext) -> None:
        self.ctx = ctx
        self.span: Any = None
        self.parent: Any = None
        self.tracer: Any = None
        self.inst: _Instruments | None = None
        self.lock = threading.Lock()
        self.open: list[_HookToken] = []


class _HookToken:
    __slots__ = ("attached", "ended", "event", "hook", "span")

    def __init__(self, event: _Event, hook: Hook) -> None:
        self.event = event
        self.hook = hook
        self.span: Any = None
        self.attached: object = None
        self.ended = False


class Telemetry:
    """The engine observer that turns events and hooks into spans and metrics.

    One per engine (see :func:`instrument`). ``tracer_provider`` / ``meter_provider``
    override the global providers (tests pass the SDK's in-memory ones).
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)
        self._number = next(_engine_numbers)
        self.enabled = True
        self.tracer_provider: Any = None
        self.meter_provider: Any = None
        self._tracer: Any = None
        self._tracer_src: Any = None
        self._instruments: _Instruments | None = None
        self._instruments_src: Any = None
        self._closed = False
        self._gen_lock = threading.Lock()
        # Held around the meter provider's calls (it takes its own locks): a parent thread
        # inside them at fork() made the child's events wait for it for ever.
        fresh_lock_after_fork(self, "_gen_lock")
        self._event: _Event | None = None
        # refresh_on_restore state
        self._managed_providers: list[Any] = []
        self._exporters: list[Any] = []
        self._flush_timeout = 5.0
        # id(provider) -> the future of its last force_flush (the provider itself is kept
        # alive by _managed_providers, so its id is not reused)
        self._flushing: dict[int, concurrent.futures.Future[Any]] = {}
        self._hooks_installed = False
        self._flush_at_end: RestoreContext | None = None
        self.last_instance_id: str | None = None
        engine.add_observer(self)
        # Reported by the generation gauge from start(), not only from its first event
        # (the original process showed no generation 0 until its first snapshot).
        engine.add_start_listener(functools.partial(_engine_started, weakref.ref(self)))

    # -- providers (resolved per event) ------------------------------------------------

    def configure(self, *, tracer_provider: Any = None, meter_provider: Any = None,
                  enabled: bool | None = None) -> None:
        # Checked before anything changes: a wrong object here used to be accepted and
        # then logged a traceback at every event.
        for what, provider, method in (("tracer_provider", tracer_provider, "get_tracer"),
                                       ("meter_provider", meter_provider, "get_meter")):
            if provider is not None and not callable(getattr(provider, method, None)):
                raise TypeError(f"telemetry: {what} has no {method}() (a "
                                f"{type(provider).__name__}, not an OpenTelemetry provider)")
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"telemetry: enabled must be True or False, not "
                            f"{type(enabled).__name__}")
        if tracer_provider is not None:
            self.tracer_provider = tracer_provider
        if meter_provider is not None:
            self.meter_provider = meter_provider
        if enabled is not None:
            self.enabled = enabled
        if meter_provider is not None and self.enabled:
            # Joins that provider's generation gauge (and leaves the one it was on) now,
            # not at its next event.
            self._join_gauge(meter_provider)

    def _join_gauge(self, mp: Any) -> None:
        try:
            self._instruments_for(mp)
        except Exception:  # telemetry must never break configuration; events log it again
            log.exception("telemetry: could not create the instruments of %s",
                          type(mp).__name__)

    def close(self) -> None:
        """Leave the generation gauge (called by the engine's ``close()``): a closed
        engine is not reported, even while something still refers to it. Its next
        ``start()`` or event reports it again."""
        with self._gen_lock:
            self._closed = True
            inst, self._instruments, self._instruments_src = self._instruments, None, None
            if inst is not None:
                with inst._lock:
                    inst.telemetries.discard(self)

    def _providers(self) -> tuple[Any, Any]:
        if not self.enabled or _disabled_by_env():
            return None, None
        tp, mp = self.tracer_provider, self.meter_provider
        if (tp is None or mp is None) and _otel_in_use():
            if tp is None:
                tp = _global_tracer_provider()
            if mp is None:
                mp = _global_meter_provider()
        return tp, mp

    def _tracer_for(self, tp: Any) -> Any:
        if tp is not self._tracer_src:
            self._tracer = tp.get_tracer(SCOPE, __version__)
            self._tracer_src = tp
        return self._tracer

    def _instruments_for(self, mp: Any) -> _Instruments:
        with self._gen_lock:
            if mp is not self._instruments_src or self._instruments is None:
                old = self._instruments
                inst = _instruments_of(mp.get_meter(SCOPE, __version__))
                if old is not None and old is not inst:
                    # the provider it left no longer reports its generation
                    with old._lock:
                        old.telemetries.discard(self)
                with inst._lock:
                    inst.telemetries.add(self)
                self._instruments = inst
                self._instruments_src = mp
            return self._instruments

    def active(self) -> bool:
        """Whether an event started now would record anything."""
        tp, mp = self._providers()
        return tp is not None or mp is not None

    def engine_label(self) -> str:
        """The engine's ``rehydrate.engine`` attribute on the generation gauge:
        ``default`` for the process-wide engine, else a number unique in the process."""
        engine = self._engine()
        if engine is not None and engine is _extensions._default:
            return "default"
        return str(self._number)

    # -- event observer ----------------------------------------------------------------

    def event_started(self, ctx: RestoreContext) -> None:
        self._event = None
        self._closed = False  # an engine used after close() is live again
        # event_finished will flush the managed providers after this snapshot's own span
        # and metrics end (the flush hook then has nothing to do)
        self._flush_at_end = ctx if ctx.kind == "snapshot" else None
        tp, mp = self._providers()
        if tp is None and mp is None:
            return
        ev = _Event(ctx)
        if mp is not None:
            ev.inst = self._instruments_for(mp)
            # the generation gauge is observable; nothing to record here
        if tp is not None:
            from opentelemetry import trace

            ev.tracer = self._tracer_for(tp)
            attrs: dict[str, Any] = {
                "rehydrate.event": "snapshot" if ctx.kind == "snapshot" else "restore",
                "rehydrate.generation": ctx.generation,
                "rehydrate.reason": ctx.reason,
                "rehydrate.kind": ctx.kind,
            }
            if ctx.frozen_for is not None:
                attrs["rehydrate.frozen_for"] = float(ctx.frozen_for)
            ev.span = ev.tracer.start_span(EVENT_SPAN_NAMES[ctx.kind], attributes=attrs)
            ev.parent = trace.set_span_in_context(ev.span)
        self._event = ev

    def event_finished(self, ctx: RestoreContext, report: Report) -> None:
        try:
            self._finish_event(ctx, report)
        finally:
            if ctx.kind == "snapshot" and self._flush_at_end is ctx:
                self._flush_at_end = None
                # Last thing before the process is frozen: export the snapshot span, its
                # hook spans and the snapshot metrics from the original, with its
                # service.instance.id — not from every clone with the clone's.
                errors = self._flush()
                if errors:
                    log.warning("telemetry: flush before the snapshot incomplete: %s",
                                "; ".join(errors))

    def _finish_event(self, ctx: RestoreContext, report: Report) -> None:
        ev = self._event
        if ev is None or ev.ctx is not ctx:
            return
        self._event = None
        with ev.lock:
            pending = list(ev.open)
            ev.open.clear()
            for tok in pending:
                tok.ended = True
        # Hooks still open here were abandoned by the runner (timeout): end their spans
        # with the outcome the report gives them.
        for tok in pending:
            res = next((r for r in report.hooks
                        if r.name == tok.hook.name and r.phase == tok.hook.phase
                        and r.outcome in ("timeout", "failed")), None)
            if res is None:
                res = HookResult(tok.hook.name, tok.hook.phase, "timeout", 0.0, None,
                                 tok.hook.required)
            self._end_hook(tok, res)
        event = "snapshot" if report.kind == "snapshot" else "restore"
        if ev.inst is not None:
            attrs = {"rehydrate.kind": report.kind, "rehydrate.reason": report.reason,
                     "rehydrate.ok": report.ok}
            hist = ev.inst.snapshot_duration if event == "snapshot" else ev.inst.restore_duration
            hist.record(report.duration, attrs)
        span = ev.span
        if span is None:
            return
        changes = report.env_changes
        span.set_attribute("rehydrate.ok", report.ok)
        span.set_attribute("rehydrate.duration", report.duration)
        span.set_attribute("rehydrate.hooks.count", len(report.hooks))
        span.set_attribute("rehydrate.hooks.failed", len(report.failed))
        # names only, never values; shortened as in the run's log line (a key of megabytes)
        shown = changes.shown()
        span.set_attribute("rehydrate.env.added", shown["added"])
        span.set_attribute("rehydrate.env.changed", shown["changed"])
        span.set_attribute("rehydrate.env.removed", shown["removed"])
        if not report.ok or report.failed:
            from opentelemetry.trace import Status, StatusCode

            names = ", ".join(f"{h.name} {h.outcome}" for h in report.failed)
            if not report.ok:
                span.set_status(Status(StatusCode.ERROR, f"required hook(s) failed: {names}"))
        span.end()

    def event_interrupted(self, ctx: RestoreContext, exc: BaseException) -> None:
        """The run was given up without a report (Ctrl-C in its waiting caller): end its
        span and those of the hooks still running, status ``ERROR``. They stayed open for
        ever, and the hooks that had ended were exported under a parent never exported."""
        ev = self._event
        if ev is None or ev.ctx is not ctx:
            return
        self._event = None
        if self._flush_at_end is ctx:
            self._flush_at_end = None
        with ev.lock:
            pending = list(ev.open)
            ev.open.clear()
            for tok in pending:
                tok.ended = True  # a hook that returns later ends nothing
        if ev.tracer is None:
            return
        from opentelemetry.trace import Status, StatusCode

        # the type only: what interrupted the run is not a hook's error, and not redacted
        status = Status(StatusCode.ERROR, f"run interrupted ({type(exc).__name__})")
        for tok in pending:
            if tok.span is not None:
                tok.span.set_status(status)
                tok.span.end()
        if ev.span is not None:
            ev.span.set_attribute("rehydrate.ok", False)
            ev.span.set_status(status)
            ev.span.end()

    # -- hook observer (called on the thread that runs the hook) ------------------------

    def hook_started(self, hook: Hook, ctx: RestoreContext) -> object:
        ev = self._event
        if ev is None or ev.ctx is not ctx:
            return None
        tok = _HookToken(ev, hook)
        if ev.tracer is not None:
            try:
                from opentelemetry import context as otel_context
                from opentelemetry import trace

                tok.span = ev.tracer.start_span(hook.name, context=ev.parent, attributes={
                    "rehydrate.hook.name": hook.name,
                    "rehydrate.hook.phase": str(hook.phase),
                    "rehydrate.hook.order": hook.order,
                    "rehydrate.hook.required": hook.required,
                    "rehydrate.hook.async": hook.is_async,
                    "rehydrate.generation": ctx.generation,
                    "rehydrate.kind": ctx.kind,
                })
                # spans the hook itself creates become children of its hook span
                tok.attached = otel_context.attach(trace.set_span_in_context(tok.span))
            except Exception:  # telemetry must never keep a hook from running
                log.exception("telemetry: could not start the span of hook %s", hook.name)
        with ev.lock:
            ev.open.append(tok)
        return tok

    def hook_finished(self, token: object, result: HookResult) -> None:
        if not isinstance(token, _HookToken):
            return
        if token.attached is not None:
            from opentelemetry import context as otel_context

            with contextlib.suppress(Exception):
                otel_context.detach(token.attached)  # type: ignore[arg-type]
            token.attached = None
        ev = token.event
        with ev.lock:
            if token.ended:
                return  # the event already reported it (timeout)
            token.ended = True
            with contextlib.suppress(ValueError):
                ev.open.remove(token)
        self._end_hook(token, result)

    def _end_hook(self, tok: _HookToken, result: HookResult) -> None:
        try:
            ev = tok.event
            event = "snapshot" if ev.ctx.kind == "snapshot" else "restore"
            failed = result.outcome in ("failed", "timeout")
            if ev.inst is not None:
                attrs = {"rehydrate.event": event, "rehydrate.hook.phase": str(result.phase),
                         "rehydrate.hook.name": result.name,
                         "rehydrate.hook.outcome": result.outcome}
                ev.inst.hook_duration.record(result.duration, attrs)
                if failed:
                    ev.inst.hook_failures.add(1, attrs)
            span = tok.span
            if span is None:
                return
            span.set_attribute("rehydrate.hook.outcome", result.outcome)
            span.set_attribute("rehydrate.hook.attempts", result.attempts)
            if failed:
                from opentelemetry.trace import Status, StatusCode

                err = result.error
                if err is not None:
                    span.record_exception(err, attributes=_exception_type(err, span))
                # describe_error: the one line reports and logs show, the type a
                # RedactedError stands for included
                desc = describe_error(err) if err is not None else result.outcome
                span.set_status(Status(StatusCode.ERROR, desc))
            span.end()
        except Exception:  # telemetry must never break a hook run
            log.exception("telemetry: could not record hook %s", tok.hook.name)

    # -- events recorded by other managers ----------------------------------------------

    def snapshot_miss(self, reason: str, field: str | None, fields: Sequence[str]) -> None:
        tp, mp = self._providers()
        attrs = {"rehydrate.miss.field": field or "unknown"}
        if mp is not None:
            self._instruments_for(mp).snapshot_misses.add(1, attrs)
        if tp is not None:
            span = self._tracer_for(tp).start_span("rehydrate.snapshot-miss", attributes={
                **attrs, "rehydrate.miss.reason": reason,
                "rehydrate.miss.fields": list(fields)})
            span.end()

    def fingerprint_mismatch(self, fields: Sequence[str]) -> None:
        ev = self._event
        _, mp = self._providers()
        if mp is not None:
            inst = self._instruments_for(mp)
            for f in fields:
                inst.fingerprint_mismatches.add(1, {"rehydrate.fingerprint.field": f})
        if ev is not None and ev.span is not None:
            ev.span.add_event("rehydrate.fingerprint.mismatch",
                              {"rehydrate.fingerprint.fields": list(fields)})

    # -- clone identity and exporters ---------------------------------------------------

    def _install_refresh_hooks(self) -> None:
        engine = self._engine()
        if engine is None or self._hooks_installed:
            return
        self._hooks_installed = True
        # Before a snapshot the flush runs in event_finished, after the snapshot span and
        # metrics end. This hook (the last before-snapshot hook) is only the fallback for
        # an event this observer was not told about.
        engine.builtins.register(self._flush_hook, event="snapshot", phase=Phase.ENVIRONMENT,
                                 order=BEFORE_USER_HOOKS - 1_000_000,  # after the audit
                                 name="rehydrate.telemetry.flush",
                                 required=False, timeout=self._flush_timeout + 5.0)
        # After restore: after the entropy hook renewed instance_id().
        engine.builtins.register(self._refresh, event="restore", phase=Phase.ENTROPY,
                                 order=1_000_000, name="rehydrate.telemetry.identity",
                                 required=False, timeout=self._flush_timeout + 5.0)

    def _flush_hook(self, ctx: RestoreContext) -> None:
        if self._flush_at_end is ctx:
            return  # event_finished flushes, after the snapshot span has ended
        errors = self._flush()
        if errors:
            raise RuntimeError("telemetry flush incomplete: " + "; ".join(errors))

    def _flush(self) -> list[str]:
        """``force_flush()`` every managed provider, waiting ``flush_timeout`` at most in
        all; the problems, one string each."""
        import concurrent.futures

        from ._threads import blocking

        timeout = self._flush_timeout
        ms = int(timeout * 1000)
        errors: list[str] = []
        running: list[tuple[Any, concurrent.futures.Future[Any]]] = []
        for p in list(self._managed_providers):
            flush = getattr(p, "force_flush", None)
            if flush is None:
                continue
            prev = self._flushing.get(id(p))
            if prev is not None and not prev.done():
                # Still stuck in the last flush: another call would only stack a second
                # stuck thread on it.
                errors.append(f"{type(p).__name__}: an earlier flush has not returned")
                continue
            # On a pool thread, never in the caller's: the SDK passes the timeout to the
            # exporter, which need not honour it (a black-holed collector), and this runs
            # inside snapshot_requested() — a stuck flush blocked the snapshot for ever.
            fut = blocking.submit(_force_flush, flush, ms)
            self._flushing[id(p)] = fut
            running.append((p, fut))
        if running:
            concurrent.futures.wait([f for _, f in running], timeout=timeout)
        for p, fut in running:
            name = type(p).__name__
            if not fut.done():
                errors.append(f"{name}: not flushed within {timeout}s")
                continue
            exc = fut.exception()
            if exc is not None:  # telemetry must never break a snapshot
                errors.append(f"{name}: {describe_scrubbed(exc)}")
            elif fut.result() is False:
                errors.append(f"{name}: not flushed within {timeout}s")
        return errors

    def _refresh(self, ctx: RestoreContext) -> None:
        errors: list[str] = []
        if ctx.kind == "restore":
            iid = _instance_id()
            for p in list(self._managed_providers):
                if not _set_instance_id(p, iid):
                    errors.append(f"{type(p).__name__}: no SDK resource found")
            self.last_instance_id = iid
        for exp in list(self._exporters):
            try:
                exp.rebuild()
            except Exception as exc:
                errors.append(f"exporter {type(exp).__name__}: {describe_scrubbed(exc)}")
        if errors:
            raise RuntimeError("telemetry refresh incomplete: " + "; ".join(errors))


def _exception_type(err: BaseException, span: Any) -> dict[str, str] | None:
    """``exception.type`` (and ``exception.stacktrace``, from the stack it kept as text)
    for a :class:`RedactedError`: the type it stands for, named as
    ``span``'s ``record_exception()`` names an unredacted one (module-qualified, a builtin
    bare; the bare class name on SDKs before 1.25), so that a failure groups with the
    same failure whose message quoted no secret. None for any other error: the SDK's own
    naming."""
    if not isinstance(err, RedactedError):
        return None
    out = {"exception.type": err.original_type.removeprefix("builtins.")
           if _qualifies_type_names(type(span)) else err.original_name}
    # where it failed: a redacted error keeps no traceback (its frames hold the locals)
    stack = redacted_stacktrace(err)
    if stack is not None:
        out["exception.stacktrace"] = stack
    return out


class _NamingProbe(Exception):
    """Never raised: handed to a span class's ``record_exception()`` to see how it names
    an exception type."""


class _EventRecorder:
    """Stands for the span in that call: keeps the event's attributes."""

    def __init__(self) -> None:
        self.attributes: Any = None

    def add_event(self, name: str, attributes: Any = None, timestamp: Any = None) -> None:
        self.attributes = attributes


_type_naming: dict[type, bool] = {}
"""Span class -> whether its ``record_exception()`` names a type module-qualified."""


def _qualifies_type_names(span_type: type) -> bool:
    """Whether ``record_exception()`` of ``span_type`` names an application's exception
    type ``module.Qualname`` (SDK 1.25 and later) rather than by its bare ``__name__``
    (SDK 1.20 to 1.24): asked once per class, by running it on a probe with a stand-in
    span (what it records is the only way to tell; the SDK's version need not be the
    span's). True (the current SDK's naming) when that cannot be told."""
    known = _type_naming.get(span_type)
    if known is None:
        recorder = _EventRecorder()
        try:
            span_type.record_exception(recorder, _NamingProbe())  # type: ignore[attr-defined]
            name = recorder.attributes["exception.type"]
        except Exception:
            known = True
        else:
            known = name != _NamingProbe.__name__
        _type_naming[span_type] = known
    return known


def _force_flush(flush: Callable[..., Any], ms: int) -> Any:
    try:
        return flush(timeout_millis=ms)
    except TypeError:  # a provider whose force_flush() takes no timeout
        return flush()


def _instance_id() -> str:
    return _entropy.instance_id()


def _new_id_in_child(tel_ref: weakref.ref[Telemetry]) -> None:
    """In a forked child: set its new :func:`instance_id` (entropy's fork handler, the
    module imported above, made it) as ``service.instance.id`` of ``tel``'s providers.

    A forked worker is another instance: the Resource said the parent's ID (or, with an
    SDK that renews the ID in a child itself, one other than :func:`instance_id`)."""
    tel = tel_ref()
    if tel is None:
        return
    iid = _instance_id()
    for p in list(tel._managed_providers):
        try:
            _set_instance_id(p, iid)
        except Exception as exc:  # a fork handler must not raise: the next restore retries
            log.debug("telemetry: %s: service.instance.id not renewed after fork(): %s",
                      type(p).__name__, exc)
    tel.last_instance_id = iid


def _resources_of(provider: Any) -> list[Any]:
    out: list[Any] = []
    for res in (getattr(provider, "_resource", None), getattr(provider, "resource", None),
                getattr(getattr(provider, "_sdk_config", None), "resource", None)):
        if res is not None and hasattr(res, "attributes") and all(res is not r for r in out):
            out.append(res)
    return out


def _set_instance_id(provider: Any, iid: str) -> bool:
    """Rewrite ``service.instance.id`` of ``provider``'s SDK Resource in place.

    Tracers, meters, readers and exporters share that Resource object, so the new value
    reaches everything the provider exports from now on.
    """
    from opentelemetry.attributes import BoundedAttributes

    resources = _resources_of(provider)
    for res in resources:
        attrs = dict(res.attributes)
        attrs["service.instance.id"] = iid
        res._attributes = BoundedAttributes(attributes=attrs)
    return bool(resources)


# -- public functions ------------------------------------------------------------------


def instrument(
    engine: Engine | None = None,
    *,
    tracer_provider: Any = None,
    meter_provider: Any = None,
    enabled: bool | None = None,
) -> Telemetry:
    """The telemetry observer of ``engine`` (default: the process-wide engine).

    Called for every engine at creation; call it again to pass explicit providers
    (otherwise the global ones are used, looked up at each event) or ``enabled=False``.
    """
    tel = manager(engine)
    tel.configure(tracer_provider=tracer_provider, meter_provider=meter_provider,
                  enabled=enabled)
    return tel


def manager(engine: Engine | None = None) -> Telemetry:
    """The telemetry observer of ``engine`` (default: the process-wide engine), as it is;
    :func:`instrument` also configures it."""
    return resolve_engine(engine).extension("telemetry", Telemetry)


key = "telemetry"


def probe() -> Probe:
    """Always usable: without an OpenTelemetry SDK every span and metric is a no-op."""
    return Probe(True)


def install(engine: Engine) -> None:
    """Instrument ``engine`` (every engine is, by default; see :func:`instrument`)."""
    instrument(engine)


def record_snapshot_miss(reason: str, field: str | None = None, fields: Sequence[str] = (),
                         *, engine: Engine | None = None) -> None:
    """Count a snapshot miss and emit a ``rehydrate.snapshot-miss`` span (no-op without SDK)."""
    try:
        instrument(engine).snapshot_miss(reason, field, fields)
    except Exception:
        log.exception("telemetry: could not record the snapshot miss")


def record_fingerprint_mismatch(fields: Sequence[str], *, engine: Engine | None = None) -> None:
    """Count manifest mismatches (per field) and add an event to the current event span."""
    try:
        instrument(engine).fingerprint_mismatch(fields)
    except Exception:
        log.exception("telemetry: could not record fingerprint mismatches")


def resource_attributes() -> dict[str, str]:
    """Resource attributes that identify this clone: ``service.instance.id``.

    ``Resource.create({**resource_attributes(), "service.name": …})``; the value is
    :func:`rehydrate.entropy.instance_id`, regenerated on every restore.
    """
    return {"service.instance.id": _instance_id()}


def resource_detector() -> Any:
    """An SDK ``ResourceDetector`` returning :func:`resource_attributes` (needs the SDK)."""
    from opentelemetry.sdk.resources import Resource, ResourceDetector

    class RehydrateResourceDetector(ResourceDetector):
        def detect(self) -> Resource:
            return Resource(resource_attributes())

    return RehydrateResourceDetector()


def refresh_on_restore(
    *providers: Any,
    exporters: Iterable[Any] = (),
    engine: Engine | None = None,
    flush_timeout: float = 5.0,
) -> Telemetry:
    """Keep the SDK ``providers`` (tracer, meter, logger) right across snapshots.

    * before a snapshot, once the before-snapshot run has ended (after the
      ``rehydrate.snapshot`` span and the snapshot metrics are recorded, before
      ``snapshot_requested()`` returns): ``force_flush()`` every provider, so what the
      original recorded — the snapshot span included — is exported once, by the original
      and with its ``service.instance.id``, not by every clone with the clone's;
    * after a restore (kind ``restore``, after the entropy phase renewed
      :func:`rehydrate.entropy.instance_id`): set that ID as ``service.instance.id`` of
      every provider's Resource (clones must not report as one instance) — and in the
      child of an ``os.fork()``, which gets its own ID too;
    * after a restore or resume: call ``rebuild()`` on every exporter in ``exporters``
      (:func:`restorable_span_exporter` / :func:`restorable_metric_exporter`), which
      replaces the exporter — and its connection, which the restore severed — by a new one.

    The hooks are ``rehydrate.telemetry.flush`` (a fallback: it flushes only when this
    engine's telemetry observer did not see the event start) and
    ``rehydrate.telemetry.identity`` (neither required: a telemetry problem never makes
    the process unready).
    """
    from ._notify import timeout_value

    # Everything is checked before anything changes (a bad argument used to leave the
    # hooks half-installed: a corrected second call then installed none).
    timeout = timeout_value(flush_timeout, "telemetry: flush_timeout")
    for p in providers:
        # An SDK provider (tracer, meter, logger) has force_flush(): anything else (a
        # Tracer, the API's proxy provider, a string) was accepted, never flushed, and
        # failed every restore's identity hook with "no SDK resource found".
        if not callable(getattr(p, "force_flush", None)):
            raise TypeError(f"telemetry: {type(p).__name__} is not an OpenTelemetry SDK "
                            "provider (it has no force_flush()): pass the TracerProvider, "
                            "MeterProvider or LoggerProvider itself")
    exporters = list(exporters)
    for e in exporters:
        if not callable(getattr(e, "rebuild", None)):
            raise TypeError(f"{e!r} has no rebuild(): wrap it with restorable_span_exporter()")
    tel = instrument(engine)
    tel._flush_timeout = timeout
    added = False
    for p in providers:
        if all(p is not q for q in tel._managed_providers):
            tel._managed_providers.append(p)
            added = True
    if added:
        # Registered after the providers' own fork handlers (they exist already): an SDK
        # that gives a child a Resource with its own service.instance.id does so first.
        os.register_at_fork(after_in_child=functools.partial(_new_id_in_child,
                                                             weakref.ref(tel)))
    for e in exporters:
        if all(e is not q for q in tel._exporters):
            tel._exporters.append(e)
    tel._install_refresh_hooks()
    return tel


def restorable_span_exporter(factory: Callable[[], Any]) -> Any:
    """A ``SpanExporter`` delegating to ``factory()``'s exporter, rebuilt after restore.

    ``BatchSpanProcessor(restorable_span_exporter(lambda: OTLPSpanExporter(...)))``; pass
    it to :func:`refresh_on_restore` (``exporters=[...]``). Needs the SDK.
    """
    from opentelemetry.sdk.trace.export import SpanExporter

    class RestorableSpanExporter(SpanExporter, _Rebuildable):
        def __init__(self) -> None:
            _Rebuildable.__init__(self, factory)

        def export(self, spans: Sequence[Any]) -> Any:
            return self.inner.export(spans)

        def shutdown(self) -> None:
            self.inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(self.inner.force_flush(timeout_millis))

    return RestorableSpanExporter()


def restorable_metric_exporter(factory: Callable[[], Any]) -> Any:
    """A ``MetricExporter`` delegating to ``factory()``'s exporter, rebuilt after restore.

    ``PeriodicExportingMetricReader(restorable_metric_exporter(lambda: OTLPMetricExporter()))``.
    """
    from opentelemetry.sdk.metrics.export import MetricExporter

    class RestorableMetricExporter(MetricExporter, _Rebuildable):
        def __init__(self) -> None:
            _Rebuildable.__init__(self, factory)
            MetricExporter.__init__(
                self,
                preferred_temporality=getattr(self.inner, "_preferred_temporality", None),
                preferred_aggregation=getattr(self.inner, "_preferred_aggregation", None),
            )

        def export(self, metrics_data: Any, timeout_millis: float = 10_000,
                   **kwargs: Any) -> Any:
            return self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return bool(self.inner.force_flush(timeout_millis=timeout_millis))

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    return RestorableMetricExporter()


class _Rebuildable:
    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # the child's restore rebuilds it: the identity hook
        self.inner: Any = factory()
        self.rebuilds = 0

    def rebuild(self) -> None:
        """Replace the wrapped exporter by a new one; shut the old one down (best effort)."""
        new = self._factory()
        with self._lock:
            old, self.inner = self.inner, new
            self.rebuilds += 1
        try:
            old.shutdown()
        except Exception as exc:  # its connection is gone anyway
            # scrubbed: an exporter's error quotes its collector URL (an api_key=...)
            log.info("telemetry: old exporter %s did not shut down cleanly: %s",
                     type(old).__name__, describe_scrubbed(exc))
