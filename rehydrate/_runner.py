"""Runs an ordered list of hooks with per-hook timeouts, retries and CRaC semantics.

Sync hooks run one after another on a persistent worker thread, so a hook that never
returns cannot hang the caller: the supervising (calling) thread watches the current
hook's deadline, reports it ``timeout`` when it passes, abandons that worker (Python
threads cannot be killed; it exits on its own once the hook returns) and continues the
remaining hooks on a fresh worker. Consecutive ``async`` hooks are sent to the event loop
as one batch, each under its own timeout, and cancelled when it passes (one watchdog timer
per batch, re-armed lazily, instead of an ``asyncio.timeout`` per hook). The worker only
wakes the supervisor when a deadline moves earlier, so dispatch costs a few microseconds
per hook. ``asyncio`` is imported on first use, not with ``rehydrate``.

A run may also have a deadline of its own (:attr:`RestoreContext.deadline`, e.g. Lambda
SnapStart's restore budget): every hook's limit is cut to it, a hook still running then is
reported ``timeout`` (and abandoned like any other), and hooks not started by then are
reported ``timeout`` without being started, so the run returns by that moment.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from . import _backoff
from ._context import (
    HookResult,
    HookStillRunning,
    HookTimeout,
    Outcome,
    Report,
    RestoreContext,
    describe_error,
)
from ._hooks import Hook
from ._loop_roles import mark_private
from ._redact import redact_error

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures
    from collections.abc import Callable, Coroutine

log = logging.getLogger("rehydrate")

ASYNC_GRACE = 2.0
"""Extra seconds the supervisor allows an async hook past its own (cancelling) timeout."""
RUN_DEADLINE_GRACE = 0.25
"""The same past a run's own deadline (which is there because a platform kills the restore
soon after it: Lambda SnapStart): a cancelled hook's cleanup usually takes milliseconds."""

BACKOFF_BASE = 0.05
BACKOFF_MAX = 5.0


class HookCall:
    """One call of a hook function: ``running`` until it returns. What it starts with its
    context (an ``asyncio`` task, a thread given ``copy_context()``) holds the same object,
    so it is not taken for the hook once the hook has returned."""

    __slots__ = ("_token", "index", "job", "runner", "running", "thread")

    def __init__(self, runner: object, job: _Progress | None = None, index: int = -1) -> None:
        self.running = True
        self.runner = runner
        self.job = job
        """The run it is part of, and its place there (:func:`running_before`)."""
        self.index = index
        self.thread = threading.get_ident()
        """The thread it runs on (made where it is entered): an async hook's is its event
        loop's. Its run waits for that thread only (:func:`_waited_for`)."""

    # Its own context manager (no contextlib generator): it runs around every hook call.
    def __enter__(self) -> None:
        self._token = hook_call.set(self)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        # A task or thread the hook started keeps this object: it must not keep the run
        # (its context's environment, the results) alive into later snapshot images.
        self.job = None
        hook_call.reset(self._token)


hook_call: contextvars.ContextVar[HookCall | None] = contextvars.ContextVar(
    "rehydrate_hook_call", default=None
)
"""The :class:`HookCall` of the hook running in this context (None outside hooks):
:func:`rehydrate.extensions.in_hook`."""


def running_hook_of(runner: object) -> bool:
    """Whether a hook of ``runner`` is running in this context now: its engine refuses to
    wait for or start an event of its own from there (it would wait for itself), but a
    task or thread the hook started may once the hook has returned, and another engine's
    hooks always may."""
    call = hook_call.get()
    return call is not None and call.running and call.runner is runner


def _waited_for() -> HookCall | None:
    """The hook call running in this context on its own thread (an async hook's: its
    loop's, every task there included), when its run is waiting for it: a thread the hook
    started with its context (``asyncio.to_thread``, ``copy_context()``) may block
    without holding up the run, unless the hook waits for it (not known here)."""
    call = hook_call.get()
    job = call.job if call is not None and call.running else None
    if (call is None or job is None or job.abandoned
            or call.thread != threading.get_ident()):
        return None
    return call


def running_before(hook: Hook) -> Hook | None:
    """The hook running in this context and thread (:func:`_waited_for`) when ``hook``
    comes later in that same run: the hooks of a run run one after another, so nothing
    ``hook`` does can happen before the running one returns. None outside hooks, on
    another thread, when ``hook`` is not in the run or has started, and for a hook its
    run gave up on at its timeout (the run went on)."""
    call = _waited_for()
    if call is None or call.job is None:
        return None
    hooks = call.job.hooks
    if any(h is hook for h in hooks[call.index + 1:]):
        return hooks[call.index]
    return None


def running_after(hook: Hook) -> Hook | None:
    """The hook running in this context and thread (:func:`_waited_for`) when ``hook``
    came earlier in that same run (it has run, or the run gave up on it): nothing
    ``hook`` did is undone before the run ends. None outside hooks, on another thread,
    when ``hook`` is not earlier in the run, and for a hook its run gave up on at its
    timeout."""
    call = _waited_for()
    if call is None or call.job is None:
        return None
    hooks = call.job.hooks
    if any(h is hook for h in hooks[:call.index]):
        return hooks[call.index]
    return None


class Observer(Protocol):
    """Receives per-hook events (telemetry). Called on the thread running the hook.

    An observer may also define the optional :class:`EventObserver` methods; the engine
    calls them (when present) around every event, on the thread running the event.
    """

    def hook_started(self, hook: Hook, ctx: RestoreContext) -> object: ...

    def hook_finished(self, token: object, result: HookResult) -> None: ...


class EventObserver(Protocol):
    """Optional per-event callbacks of an :class:`Observer` (looked up with ``getattr``).

    ``event_started`` runs before the first hook of an event, ``event_finished`` after
    the last one (readiness already updated), both under the engine's event lock. A hook
    that timed out may call ``hook_finished`` later, after ``event_finished``; its result
    is then the ``timeout`` the report holds, however the hook ended. A run that makes no
    report (its caller interrupted while waiting, Ctrl-C) ends with ``event_interrupted``
    instead of ``event_finished``, with the exception; a hook still running then may call
    ``hook_finished`` later.
    """

    def event_started(self, ctx: RestoreContext) -> None: ...

    def event_finished(self, ctx: RestoreContext, report: Report) -> None: ...

    def event_interrupted(self, ctx: RestoreContext, exc: BaseException) -> None: ...


def backoff_delay(attempt: int) -> float:
    """Seconds before a hook's retry ``attempt`` (0-based): in [cap/2, cap], where
    cap = min(BACKOFF_MAX, BACKOFF_BASE * 2**attempt)."""
    return _backoff.backoff_delay(attempt, BACKOFF_BASE, BACKOFF_MAX)


UNBOUNDED_ALLOWANCE = 120.0
"""What :func:`worst_case` counts for a hook without a limit of its own (one that bounds
itself, such as ``rehydrate.connections``): the wait ``notify save`` had before it knew
any budget."""


def worst_case(hooks: Iterable[Hook]) -> float:
    """The longest a run of ``hooks`` can take under the limits this runner enforces: each
    hook's ``timeout`` per attempt plus the grace an async one gets, the longest backoff
    before each retry, summed (hooks run one after another); a hook with no limit counts
    :data:`UNBOUNDED_ALLOWANCE` per attempt.

    What a waiting client (``rehydrate notify save``) needs to know: every hook within its
    own limit finishes the run by then, so a client giving up earlier aborts a pass that
    was going to succeed. (A null budget, for any hook without a limit, sent the client
    back to its own 120 s: every process with a managed connection lost the budget.)"""
    total = 0.0
    for hook in hooks:
        limit = UNBOUNDED_ALLOWANCE if math.isinf(hook.timeout) else hook.timeout
        # The grace for every attempt: a sync hook that returns an awaitable gets it too.
        total += (hook.retries + 1) * (limit + ASYNC_GRACE)
        total += sum(min(BACKOFF_MAX, BACKOFF_BASE * 2.0 ** min(a, 64))
                     for a in range(hook.retries))
    return total


def _observe_start(observers: Sequence[Observer], hook: Hook,
                   ctx: RestoreContext) -> list[object]:
    tokens: list[object] = []
    for o in observers:
        try:
            tokens.append(o.hook_started(hook, ctx))
        except Exception:  # an observer must never break (or hang) an event
            log.exception("observer %r failed in hook_started", o)
            tokens.append(None)
    return tokens


def _observe_finish(observers: Sequence[Observer], tokens: Sequence[object],
                    result: HookResult) -> None:
    for o, t in zip(observers, tokens, strict=True):
        try:
            o.hook_finished(t, result)
        except Exception:
            log.exception("observer %r failed in hook_finished", o)


def _log_outcome(ctx: RestoreContext, result: HookResult) -> None:
    """The one line of a hook that failed or timed out, written when its result is
    recorded: an operator watching a 30 s restore sees the failure then, not at the end
    of the run (which logs no line of its own per hook)."""
    if result.outcome in ("failed", "timeout"):
        log.log(logging.ERROR if result.required else logging.WARNING, "%s hook %s %s: %s",
                ctx.kind, result.name, result.outcome, describe_error(result.error))


def _tell_failed(on_failed: Callable[[Hook, HookResult], None] | None, hook: Hook,
                 result: HookResult) -> None:
    if on_failed is not None and result.required and result.outcome in ("failed", "timeout"):
        try:
            on_failed(hook, result)
        except Exception:  # never lose the run over it
            log.exception("failed-hook callback %r failed", on_failed)


class _Expired(Exception):
    """The limit of an awaitable returned by a sync-looking hook passed."""


def _fn_key(fn: object) -> object:
    """How :attr:`HookRunner._hung` knows a hook function: the function itself (bound
    methods of one object compare equal), or its id when it cannot be hashed (an
    instance of a callable dataclass)."""
    try:
        hash(fn)
    except TypeError:
        return id(fn)
    return fn


def _contain(exc: BaseException, name: str) -> Exception:
    """An ``Exception`` to report for ``exc`` (``SystemExit`` and friends get wrapped, so
    that they neither kill the engine's threads nor break the report's exception group; one
    whose message cannot be formatted gets wrapped too: every report and log line shows it).

    Every hook error is recorded through here, so this is where a managed secret's value,
    and a URL's user info and query string, quoted in its text is redacted
    (:func:`~rehydrate._redact.redact_error`): once, before
    the log line, the report, ``status()``, telemetry and readiness answers format it."""
    if isinstance(exc, Exception):
        try:
            str(exc)  # reports, logs and the exception group format it
        except Exception as broken:
            wrapped = RuntimeError(f"hook {name!r} raised {type(exc).__name__}, whose message "
                                   f"could not be formatted ({type(broken).__name__})")
        else:
            return redact_error(exc)
    else:
        wrapped = RuntimeError(f"hook {name!r} raised {type(exc).__name__}")
    wrapped.__cause__ = exc
    return redact_error(wrapped)


def _run_budget(ctx: RestoreContext) -> float | None:
    """The run's deadline in seconds from its notice, to the millisecond (the notice time
    plus the deadline, less the notice time, is not exactly the deadline), or None."""
    return None if ctx.deadline is None else max(0.0, round(ctx.deadline - ctx.detected_at, 3))


def _timed_out(hook: Hook, ctx: RestoreContext, started: float) -> HookTimeout:
    """The error of a hook stopped at whichever came first: its own timeout (counted from
    ``started``, a ``time.monotonic()``) or the run's deadline."""
    if ctx.deadline is not None and ctx.deadline < started + hook.timeout:
        return HookTimeout(hook.name, hook.timeout, run_deadline=_run_budget(ctx))
    return HookTimeout(hook.name, hook.timeout)


def _unstarted(hook: Hook, ctx: RestoreContext) -> HookResult:
    """The result of a hook the run's deadline left no time for: ``timeout``, never run
    (``skipped`` when it would have been skipped anyway: no key it watches changed)."""
    if hook.env_keys is not None and _skip_reason(hook, ctx):
        return HookResult(hook.name, hook.phase, "skipped", 0.0, None, hook.required, 0)
    return HookResult(hook.name, hook.phase, "timeout", 0.0,
                      HookTimeout(hook.name, hook.timeout, run_deadline=_run_budget(ctx),
                                  started=False),
                      hook.required, 0)


def _call_args(hook: Hook, ctx: RestoreContext) -> tuple[Any, ...]:
    if hook.arity == 0:
        return ()
    if hook.arity == 1:
        return (ctx,)
    return (ctx, ctx.env_changes.only(hook.env_keys or ()))


def _skip_reason(hook: Hook, ctx: RestoreContext) -> bool:
    """``on_env_change`` hooks run only when a key they watch changed."""
    if hook.env_keys is None:
        return False
    changes = ctx.env_changes
    return not changes or (bool(hook.env_keys) and not changes.only(hook.env_keys))


class LoopThread:
    """A private event loop on a daemon thread, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                import asyncio

                loop = asyncio.new_event_loop()
                mark_private(loop)
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=run, name="rehydrate-loop", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
            return self._loop

    def is_current(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        thread = self._thread
        return thread is not None and thread is threading.current_thread()

    def close(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            if not thread.is_alive():
                loop.close()


@dataclass
class _Progress:
    """State shared by one worker and the supervisor. Guarded by ``lock``."""

    hooks: Sequence[Hook]
    ctx: RestoreContext
    results: list[HookResult | None]
    index: int
    observers: Sequence[Observer]
    loop: asyncio.AbstractEventLoop | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)
    deadline: float = math.inf
    started: float = 0.0
    waiting_until: float = math.inf
    done: bool = False
    abandoned: bool = False
    future: concurrent.futures.Future[None] | None = None
    thread: threading.Thread | None = None
    """The worker running this job (set when it takes the job)."""
    entered: bool = True
    """False while hook ``index`` waits for its event loop to get to it."""
    run_end: float = math.inf
    """``time.monotonic()`` by which the whole run must be over (``ctx.deadline``)."""
    on_failed: Callable[[Hook, HookResult], None] | None = None
    """:attr:`HookRunner.on_failed` when the job began."""

    def begin(self, index: int, timeout: float, *, entered: bool = True,
              grace: float = 0.0) -> None:
        """Mark hook ``index`` as started now (also for each retry attempt).

        ``grace``: what the supervisor allows past ``timeout`` (async hooks, which are
        cancelled at it and may clean up), at most :data:`RUN_DEADLINE_GRACE` past the
        run's deadline. ``entered=False``: handed to its event loop, not started yet. The
        supervisor is then woken only when it waits without any limit: one that waits for an earlier
        deadline still gives up in bounded time, and waking it costs a GIL hand-off in
        the middle of a restore (measured: the engine's dispatch between hooks doubled).
        """
        now = time.monotonic()
        with self.lock:
            self.entered = entered
            self.index = index
            self.started = now
            self.deadline = min(now + timeout + grace,
                                self.run_end + min(grace, RUN_DEADLINE_GRACE))
            if self.deadline < self.waiting_until and (
                    entered or math.isinf(self.waiting_until)):
                self.wake.set()

    def backoff(self, seconds: float) -> None:
        """Hook ``index`` waits ``seconds`` before its next attempt and then gets its full
        timeout: the supervisor's limit is moved past both (never past the run's
        deadline), or it would report the wait as the last attempt's ``timeout`` and
        abandon a worker that then starts the retry after the run was reported."""
        with self.lock:
            self.deadline = min(time.monotonic() + seconds, self.run_end)

    def time_left(self) -> float:
        """Seconds until the run's deadline (``inf`` without one; may be negative)."""
        return self.run_end - time.monotonic()

    def finish(self, index: int, result: HookResult) -> bool:
        """Record a result (and log it when it failed or timed out); False when the
        supervisor already gave up on this worker (it recorded and logged the timeout)."""
        with self.lock:
            if self.abandoned:
                return False
            self.results[index] = result
            self.deadline = math.inf
        # Counted before the log line (I/O, slow in a fresh clone): a recovery made just
        # after the hook returned finds its failure counted.
        _tell_failed(self.on_failed, self.hooks[index], result)
        _log_outcome(self.ctx, result)  # outside the lock: the supervisor must not wait on I/O
        return True

    def settle(self, index: int, tokens: Sequence[object], result: HookResult) -> bool:
        """:meth:`finish`, then tell the observers the result that stands: the recorded
        ``timeout`` when the supervisor already gave up on this worker."""
        recorded = self.finish(index, result)
        if self.observers:
            if not recorded:
                result = self.results[index] or result
            _observe_finish(self.observers, tokens, result)
        return recorded

    def not_started(self, index: int, result: HookResult) -> bool:
        """:meth:`finish` for a hook reported ``failed`` or ``timeout`` without being
        started (its thread from an earlier timeout still runs it; the run's deadline had
        passed), told to the observers as a run of no length: telemetry counted neither
        in ``rehydrate.hook.failures`` nor gave it a span, so a hook failing every restore
        this way was counted once, at its first timeout."""
        if not self.observers or result.outcome == "skipped":
            return self.finish(index, result)
        tokens = _observe_start(self.observers, self.hooks[index], self.ctx)
        return self.settle(index, tokens, result)

    def complete(self) -> None:
        with self.lock:
            self.done = True
            self.wake.set()


class HookRunner:
    """Runs hook lists for one lifecycle engine; owns its worker thread."""

    def __init__(self, loop_thread: LoopThread) -> None:
        self._loop_thread = loop_thread
        self._jobs: list[_Progress] = []
        self._cv = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False
        self.on_failed: Callable[[Hook, HookResult], None] | None = None
        """Called with each failed or timed-out required hook and its result as that is
        recorded (the engine: a recovery during the run counts only after the failure,
        and only for that very hook when made by its record)."""
        self._hung: dict[Any, tuple[str, threading.Thread]] = {}
        """Sync hooks abandoned at their timeout whose thread may still run them, by hook
        function: such a hook is not started again until that thread has returned, so at
        most one abandoned thread exists per hook function (the bound on leaked threads)."""

    # -- worker side -----------------------------------------------------------------

    def prestart(self) -> None:
        """Start the hook worker now rather than at the first event: a snapshot taken
        after this carries a waiting worker, so a clone's first restore does not create a
        thread (measured under runsc: 10-54 ms from the event to its first hook)."""
        with self._cv:
            if not self._closed:
                self._ensure_worker()

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(
                target=self._work, name="rehydrate-hooks", daemon=True
            )
            self._worker.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cv:
                while not self._jobs and not self._closed and self._worker is me:
                    self._cv.wait()
                if self._closed or self._worker is not me:
                    return
                job = self._jobs.pop(0)
                if job.abandoned:  # its caller gave up before this worker took it
                    continue
                job.thread = me
            try:
                alive = self._run_job(job)
            except BaseException as exc:  # a bug here must not leave the caller waiting
                # not log.exception: the chain may hold a hook's raw error (a secret's value)
                log.error("rehydrate's hook runner failed: %s",
                          describe_error(_contain(exc, "rehydrate.runner")))
                for k, r in enumerate(job.results):
                    if r is None and k >= job.index:
                        h = job.hooks[k]
                        job.finish(k, HookResult(h.name, h.phase, "failed", 0.0,
                                                 _contain(exc, h.name), h.required, 0))
                job.complete()
                alive = True
            if not alive:
                return  # abandoned: the supervisor started a new worker

    def _run_job(self, job: _Progress) -> bool:
        hooks = job.hooks
        i = job.index
        n = len(hooks)
        while i < n:
            if job.time_left() <= 0:  # the run's deadline passed: start nothing more
                for k in range(i, n):
                    if not job.not_started(k, _unstarted(hooks[k], job.ctx)):
                        return False
                break
            hook = hooks[i]
            if hook.is_async:
                j = i
                while j < n and hooks[j].is_async:
                    j += 1
                if not self._run_async_batch(job, i, j):
                    return False
                i = j
                continue
            if not self._run_sync(job, i, hook):
                return False
            i += 1
        job.complete()
        return True

    def _run_sync(self, job: _Progress, index: int, hook: Hook) -> bool:
        """Run one sync hook; False when the supervisor gave up on this worker."""
        ctx = job.ctx
        if hook.env_keys is not None and _skip_reason(hook, ctx):
            return job.finish(index, HookResult(hook.name, hook.phase, "skipped", 0.0, None,
                                                hook.required, 0))
        if self._still_running(hook):
            return job.not_started(index, HookResult(hook.name, hook.phase, "failed", 0.0,
                                                     HookStillRunning(hook.name), hook.required, 0))
        tokens = _observe_start(job.observers, hook, ctx) if job.observers else ()
        start = time.perf_counter()
        attempt = 0
        outcome: Outcome = "ok"
        error: BaseException | None = None
        while True:
            job.begin(index, hook.timeout)
            began = job.started
            try:
                with HookCall(self, job, index):
                    value = hook.fn(*_call_args(hook, ctx)) if hook.arity else hook.fn()
                    if inspect.isawaitable(value):  # a plain callable returned a coroutine
                        job.begin(index, hook.timeout, grace=ASYNC_GRACE)
                        began = job.started  # the awaitable's own limit counts from here
                        self._await(job, value, max(0.0, min(hook.timeout,
                                                             job.time_left())))
                outcome, error = "ok", None
                break
            except _Expired:  # only the awaitable's own limit: a hook's TimeoutError failed
                outcome, error = "timeout", _timed_out(hook, ctx, began)
            except BaseException as exc:  # every hook runs even when others fail
                outcome, error = "failed", _contain(exc, hook.name)
            if attempt >= hook.retries or job.abandoned:
                break
            delay = backoff_delay(attempt)
            if delay >= job.time_left():  # no retry that could not start before the deadline
                break
            job.backoff(delay + hook.timeout)
            time.sleep(delay)
            if job.abandoned:  # given up meanwhile (the caller interrupted): no late retry
                break
            attempt += 1
        result = HookResult(
            hook.name,
            hook.phase,
            outcome,
            time.perf_counter() - start,
            error,
            hook.required,
            attempt + 1,
        )
        return job.settle(index, tokens, result)

    def _await(self, job: _Progress, awaitable: Any, timeout: float) -> None:
        """Await what a sync-looking hook returned, on the hook loop, within ``timeout``."""
        import asyncio

        async def bounded() -> None:
            call = hook_call.get()
            if call is not None:  # the hook runs here now; its worker only waits for it
                call.thread = threading.get_ident()
            # Not wait_for: a TimeoutError raised by the awaitable itself (a client's
            # connect timeout) must be reported as the hook's failure, not as its timeout.
            task = asyncio.ensure_future(awaitable)
            done, _ = await asyncio.wait({task}, timeout=None if math.isinf(timeout)
                                         else timeout)
            if not done:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise _Expired
            task.result()

        loop = job.loop or self._loop_thread.get()
        asyncio.run_coroutine_threadsafe(bounded(), loop).result()

    def _run_async_batch(self, job: _Progress, start: int, stop: int) -> bool:
        loop = job.loop or self._loop_thread.get()
        # The first hook's clock starts now, not when the loop gets to it: a loop still
        # blocked by an earlier hook (a sync call inside an async hook) would otherwise
        # hold the whole event, and every later one, without any limit.
        job.begin(start, job.hooks[start].timeout, entered=False, grace=ASYNC_GRACE)
        fut = _submit(loop, lambda: self._async_batch(job, start, stop))
        with job.lock:
            if job.abandoned:
                fut.cancel()
                return False
            job.future = fut
        try:
            fut.result()
        except BaseException:  # cancelled by the supervisor, or the loop went away
            with job.lock:
                if job.abandoned:
                    return False
            # The loop died under us: report what did not finish as failed.
            for k in range(start, stop):
                if job.results[k] is None:
                    h = job.hooks[k]
                    job.finish(k, HookResult(h.name, h.phase, "failed", 0.0,
                                             RuntimeError("event loop stopped"), h.required))
        return not job.abandoned

    async def _async_batch(self, job: _Progress, start: int, stop: int) -> None:
        import asyncio

        ctx = job.ctx
        task = asyncio.current_task()
        assert task is not None
        watchdog = _Watchdog(asyncio.get_running_loop(), task)
        try:
            for i in range(start, stop):
                hook = job.hooks[i]
                if hook.env_keys is not None and _skip_reason(hook, ctx):
                    alive = job.finish(i, HookResult(hook.name, hook.phase, "skipped", 0.0,
                                                     None, hook.required, 0))
                elif job.time_left() <= 0:
                    alive = job.not_started(i, _unstarted(hook, ctx))
                else:
                    alive = await self._run_async(job, i, hook, watchdog)
                if not alive:
                    return
        finally:
            watchdog.close()

    async def _run_async(self, job: _Progress, index: int, hook: Hook,
                         watchdog: _Watchdog) -> bool:
        """Run one async hook; False when the supervisor gave up on this worker."""
        import asyncio

        ctx = job.ctx
        tokens = _observe_start(job.observers, hook, ctx) if job.observers else ()
        start = time.perf_counter()
        attempt = 0
        outcome = "ok"
        error: BaseException | None = None
        while True:
            job.begin(index, hook.timeout, grace=ASYNC_GRACE)
            began = job.started
            # cancelled at its own timeout or the run's deadline, whichever comes first
            watchdog.arm(max(0.0, min(hook.timeout, job.time_left())))
            try:
                with HookCall(self, job, index):
                    await (hook.fn(*_call_args(hook, ctx)) if hook.arity else hook.fn())
                outcome, error = "ok", None
            except asyncio.CancelledError as exc:
                if not watchdog.fired and watchdog.cancel_requested():
                    watchdog.disarm()
                    raise  # cancelled from outside: the supervisor or the loop's shutdown
                outcome, error = "failed", _contain(exc, hook.name)
            except BaseException as exc:
                outcome, error = "failed", _contain(exc, hook.name)
            if watchdog.disarm():  # ran past its timeout (however the hook reacted)
                outcome, error = "timeout", _timed_out(hook, ctx, began)
            if outcome == "ok" or attempt >= hook.retries or job.abandoned:
                break
            delay = backoff_delay(attempt)
            if delay >= job.time_left():  # no retry that could not start before the deadline
                break
            job.backoff(delay + hook.timeout + ASYNC_GRACE)
            await asyncio.sleep(delay)
            attempt += 1
        result = HookResult(hook.name, hook.phase, outcome,  # type: ignore[arg-type]
                            time.perf_counter() - start, error, hook.required, attempt + 1)
        return job.settle(index, tokens, result)

    # -- supervisor side -------------------------------------------------------------

    def run(
        self,
        hooks: Sequence[Hook],
        ctx: RestoreContext,
        loop: asyncio.AbstractEventLoop | None,
        observers: Sequence[Observer] = (),
    ) -> list[HookResult]:
        """Run ``hooks`` in order and return one result per hook (blocks the caller)."""
        results: list[HookResult | None] = [None] * len(hooks)
        index = 0
        while index < len(hooks):
            job = _Progress(hooks, ctx, results, index, observers, loop,
                            run_end=math.inf if ctx.deadline is None else ctx.deadline,
                            on_failed=self.on_failed)
            with self._cv:
                if self._closed:
                    raise RuntimeError("hook runner is closed")
                self._jobs.append(job)
                self._ensure_worker()
                self._cv.notify_all()
            try:
                index = self._supervise(job)
            except BaseException:  # Ctrl-C in the waiting caller: give the job up
                self._abandon(job, None)
                raise
        return [r for r in results if r is not None]

    def _still_running(self, hook: Hook) -> bool:
        if not self._hung:  # the usual case: no lock on the per-hook path
            return False
        with self._cv:
            entry = self._hung.get(_fn_key(hook.fn))
            if entry is not None and not entry[1].is_alive():
                del self._hung[_fn_key(hook.fn)]
                entry = None
        return entry is not None

    def hung_hooks(self) -> list[str]:
        """Names of sync hooks abandoned at their timeout whose threads still run them."""
        with self._cv:
            for fn in [fn for fn, (_, t) in self._hung.items() if not t.is_alive()]:
                del self._hung[fn]
            return sorted(name for name, _ in self._hung.values())

    def _abandon(self, job: _Progress, hook: Hook | None) -> None:
        """Give up on ``job``'s worker (``hook``: the sync hook it is stuck in, if any)."""
        with job.lock:
            job.abandoned = True
            fut, thread = job.future, job.thread
            if hook is None and not job.done and job.index < len(job.hooks):
                current = job.hooks[job.index]
                hook = None if current.is_async else current
        if fut is not None:
            fut.cancel()
        with self._cv:
            self._jobs = [j for j in self._jobs if j is not job]  # not taken yet: drop it
            if hook is not None and thread is not None and thread.is_alive():
                self._hung[_fn_key(hook.fn)] = (hook.name, thread)
            if self._worker is thread or thread is None:
                self._worker = None  # exits as soon as its hook returns
            self._cv.notify_all()

    def _supervise(self, job: _Progress) -> int:
        """Wait for ``job``; on a timeout return the index to resume from, else ``len``."""
        while True:
            with job.lock:
                if job.done:
                    return len(job.hooks)
                now = time.monotonic()
                if now >= job.deadline:
                    i = job.index
                    hook = job.hooks[i]
                    job.abandoned = True  # in this locked section: the worker's finish() loses
                    entered = job.entered
                    error = _timed_out(hook, job.ctx, job.started)
                    result = job.results[i] = HookResult(
                        hook.name, hook.phase, "timeout", now - job.started, error,
                        hook.required,
                    )
                    break
                job.waiting_until = job.deadline
                job.wake.clear()
                wait = None if math.isinf(job.deadline) else job.deadline - now
            job.wake.wait(wait)
        self._abandon(job, None if hook.is_async else hook)
        _tell_failed(job.on_failed, hook, result)
        _log_outcome(job.ctx, result)
        if hook.is_async and error.run_deadline is not None:
            log.warning("%s; moving on", error)
        elif hook.is_async and not entered:
            log.warning("async hook %s did not start within %gs: its event loop is still "
                        "blocked (an earlier hook made a blocking call); moving on",
                        hook.name, hook.timeout + ASYNC_GRACE)
        elif hook.is_async:
            log.warning("async hook %s did not give control back to its event loop within "
                        "%gs of its %gs timeout; moving on", hook.name, ASYNC_GRACE,
                        hook.timeout)
        else:
            log.warning("%s; its thread is left to finish on its own (Python threads cannot "
                        "be killed) and the hook is not started again until it has; hook "
                        "threads still running: %d", error, len(self.hung_hooks()))
        # Results of the remaining hooks of an abandoned async batch are lost: resume
        # right after the hook that timed out.
        return i + 1

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=5)


def _submit(loop: asyncio.AbstractEventLoop,
            make: Callable[[], Coroutine[Any, Any, None]]) -> concurrent.futures.Future[None]:
    """``run_coroutine_threadsafe(make(), loop)``, except that the coroutine is made on the
    loop, when it gets to it: one abandoned while the loop was blocked, and never started,
    leaves no coroutine that was never awaited. Cancelling the returned future cancels
    the task."""
    import concurrent.futures

    fut: concurrent.futures.Future[None] = concurrent.futures.Future()

    def start() -> None:
        if fut.cancelled():
            return  # abandoned before the loop got here: nothing to run
        task = loop.create_task(make())

        def copy(t: asyncio.Task[None]) -> None:
            if fut.done():
                return
            if t.cancelled():
                fut.cancel()
            elif t.exception() is not None:
                fut.set_exception(t.exception())
            else:
                fut.set_result(None)

        def cancel(f: concurrent.futures.Future[None]) -> None:
            if f.cancelled() and not task.done():
                with contextlib.suppress(RuntimeError):  # the loop is closed already
                    loop.call_soon_threadsafe(task.cancel)

        task.add_done_callback(copy)
        fut.add_done_callback(cancel)

    loop.call_soon_threadsafe(start)
    return fut


class _Watchdog:
    """Enforces per-hook timeouts of one async batch with a single timer.

    ``asyncio.timeout()`` per hook costs a timer handle each (several microseconds). Here a
    timer is armed only when the current hook's deadline is earlier than the armed one;
    when it fires early (the hook it was armed for already finished) it re-arms for the
    current deadline. When the current hook is overdue its task is cancelled: the hook
    sees ``CancelledError`` like under ``asyncio.timeout``.
    """

    __slots__ = ("_armed_at", "_handle", "_loop", "_task", "deadline", "fired")

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        self._loop = loop
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self.deadline = math.inf
        self.fired = False

    def arm(self, timeout: float) -> None:
        self.fired = False
        if math.isinf(timeout):
            self.deadline = math.inf
            return
        self.deadline = deadline = self._loop.time() + timeout
        if deadline < self._armed_at:
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self._loop.call_at(deadline, self._check)
            self._armed_at = deadline

    def disarm(self) -> bool:
        """Stop watching the current hook; True when it was cancelled for its timeout."""
        self.deadline = math.inf
        fired, self.fired = self.fired, False
        if fired:
            uncancel = getattr(self._task, "uncancel", None)  # 3.11+: balance cancel()
            if uncancel is not None:
                uncancel()
        return fired

    def cancel_requested(self) -> bool:
        """Whether someone asked to cancel the task (always assumed on 3.10)."""
        cancelling = getattr(self._task, "cancelling", None)
        return cancelling is None or cancelling() > 0

    def _check(self) -> None:
        self._handle = None
        self._armed_at = math.inf
        if math.isinf(self.deadline):
            return
        if self._loop.time() >= self.deadline:
            self.deadline = math.inf
            self.fired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_at(self.deadline, self._check)
            self._armed_at = self.deadline

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed_at = math.inf
        self.deadline = math.inf
