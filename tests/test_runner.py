"""The hook runner: timeouts (sync and async), retries with backoff, mixed batches,
observers, and containment of odd exceptions."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import rehydrate
from rehydrate import HookFailed, HookTimeout, Phase
from rehydrate._runner import ASYNC_GRACE, BACKOFF_BASE, BACKOFF_MAX, backoff_delay

DEADLINE = 10.0
GRACE = 3 * DEADLINE  # an async hook's grace after its timeout, where a test widens it


def user_hooks(report):
    return [h for h in report.hooks if not h.name.startswith("rehydrate.")]


def by_name(report):
    return {h.name: h for h in user_hooks(report)}


def wait_for(predicate, timeout=DEADLINE):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


# -- sync timeouts ----------------------------------------------------------------------


def test_sync_timeout_abandons_the_worker_and_moves_on(rehydrate_engine):
    reg = rehydrate_engine.registry
    release = threading.Event()
    stuck = {}
    calls = []

    @reg.after_restore(name="stuck", timeout=0.2, phase=Phase.CONNECTIONS)
    def stuck_hook():
        stuck["thread"] = threading.current_thread()
        release.wait(DEADLINE)
        calls.append("stuck-returned")

    @reg.after_restore(name="after")
    def after():
        calls.append("after")
        stuck["after_thread"] = threading.current_thread()

    @reg.after_restore(name="after-async")
    async def after_async():
        calls.append("after-async")

    t0 = time.monotonic()
    report = rehydrate_engine.simulate_restore()
    elapsed = time.monotonic() - t0
    try:
        hooks = by_name(report)
        assert hooks["stuck"].outcome == "timeout"
        assert isinstance(hooks["stuck"].error, HookTimeout)
        assert isinstance(hooks["stuck"].error, TimeoutError)
        assert hooks["stuck"].error.hook_name == "stuck" and hooks["stuck"].error.timeout == 0.2
        # Not joined: the stuck hook blocks until ``release`` (set below), so a runner that
        # waited for it would take DEADLINE; these bounds are causal, not about speed.
        assert 0.2 <= hooks["stuck"].duration < DEADLINE
        assert hooks["after"].outcome == "ok" and hooks["after-async"].outcome == "ok"
        assert calls == ["after", "after-async"]  # later hooks ran; the stuck one still runs
        assert elapsed < DEADLINE
        assert not report.ok and isinstance(report.error, HookFailed)
        # the stuck worker was abandoned, not joined: it is still alive, and the rest ran
        # on a fresh worker
        assert stuck["thread"].is_alive()
        assert stuck["after_thread"] is not stuck["thread"]
    finally:
        release.set()
    stuck["thread"].join(DEADLINE)
    assert not stuck["thread"].is_alive()  # exits on its own once the hook returns
    assert calls[-1] == "stuck-returned"
    # its late result does not leak into the report or a later event
    assert [h.outcome for h in user_hooks(report)] == ["timeout", "ok", "ok"]
    reg.unregister("stuck")
    again = rehydrate_engine.simulate_restore()
    assert again.ok and [h.name for h in user_hooks(again)] == ["after", "after-async"]


def _hook_threads():
    return [t for t in threading.enumerate() if t.name == "rehydrate-hooks"]


def test_a_hung_sync_hook_is_not_started_again_while_its_thread_runs(rehydrate_engine):
    """Documented (concepts.md, Timeouts): a timed-out sync hook keeps running in its
    abandoned thread and may finish after its ``timeout`` report; until it has, later
    events do not start it again, so hung threads are bounded (one per hook function)
    and counted in ``status()["hung_hooks"]``."""
    reg = rehydrate_engine.registry
    release = threading.Event()
    calls = []

    @reg.after_restore(name="stuck", timeout=0.2)
    def stuck_hook():
        calls.append("started")
        if len(calls) == 1:
            release.wait(DEADLINE)
        calls.append("finished")

    first = rehydrate_engine.simulate_restore()
    try:
        assert by_name(first)["stuck"].outcome == "timeout"
        assert rehydrate_engine.status().extra["hung_hooks"] == ["stuck"]
        threads = []
        for _ in range(5):
            again = rehydrate_engine.simulate_restore()
            result = by_name(again)["stuck"]
            assert result.outcome == "failed" and not again.ok
            assert isinstance(result.error, rehydrate.HookStillRunning)
            assert "still running" in str(result.error)
            threads.append(len(_hook_threads()))
        assert threads == threads[:1] * 5  # no new thread per event
        assert rehydrate_engine.status().extra["hung_hooks"] == ["stuck"]
        assert calls == ["started"]  # never started twice
    finally:
        release.set()
    # the hook reported "timeout" does run to its end afterwards
    assert wait_for(lambda: calls == ["started", "finished"])
    assert wait_for(lambda: rehydrate_engine.status().extra["hung_hooks"] == [])
    assert by_name(first)["stuck"].outcome == "timeout"  # the report is not rewritten
    last = rehydrate_engine.simulate_restore()
    assert last.ok and calls[-2:] == ["started", "finished"]


def test_ctrl_c_while_waiting_for_hooks_never_leaves_restoring(rehydrate_engine):
    import signal

    reg = rehydrate_engine.registry
    release = threading.Event()

    @reg.after_restore(name="slow", timeout=None)
    def slow():
        if not release.is_set():
            # Ctrl-C reaches the waiting main thread. Sent to the thread, not the process:
            # a process-directed signal may be delivered to any thread (this one, or a
            # native thread an earlier test left), and the main thread's blocked wait is
            # then not interrupted (2 of 7 full runs under load: "DID NOT RAISE").
            signal.pthread_kill(main, signal.SIGINT)
            release.wait(DEADLINE)

    assert threading.current_thread() is threading.main_thread()
    main = threading.main_thread().ident
    assert main is not None
    # Python's own SIGINT handler, installed again at the C level: a native library an
    # earlier test loaded (libuv) can replace it there while signal.getsignal() still
    # reports Python's.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            rehydrate_engine.simulate_restore()
        assert rehydrate_engine.state == "degraded"
        assert not rehydrate_engine.is_ready()
        assert rehydrate_engine.status().extra["hung_hooks"] == ["slow"]
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)
    assert wait_for(lambda: rehydrate_engine.status().extra["hung_hooks"] == [])
    report = rehydrate_engine.simulate_restore()
    assert report.ok and rehydrate_engine.state == "ready"


def test_sync_timeout_before_a_snapshot(rehydrate_engine):
    reg = rehydrate_engine.registry
    release = threading.Event()
    calls = []
    reg.before_snapshot(name="first", timeout=0.1)(lambda: release.wait(DEADLINE))
    reg.before_snapshot(name="second", phase=Phase.ENTROPY)(lambda: calls.append("second"))
    try:
        report = rehydrate_engine.simulate_snapshot()
    finally:
        release.set()
    assert [(h.name, h.outcome) for h in report.hooks if not h.name.startswith("rehydrate.")
            ] == [("first", "timeout"), ("second", "ok")]
    assert calls == ["second"]


def test_two_consecutive_sync_timeouts(rehydrate_engine):
    reg = rehydrate_engine.registry
    release = threading.Event()
    reg.after_restore(name="a", timeout=0.1)(lambda: release.wait(DEADLINE))
    reg.after_restore(name="b", timeout=0.1)(lambda: release.wait(DEADLINE))
    reg.after_restore(name="c")(lambda: None)
    try:
        report = rehydrate_engine.simulate_restore()
    finally:
        release.set()
    assert [h.outcome for h in user_hooks(report)] == ["timeout", "timeout", "ok"]


# -- async timeouts ---------------------------------------------------------------------


def test_async_timeout_cancels_the_coroutine(rehydrate_engine, monkeypatch):
    from rehydrate import _runner

    # A grace far beyond any scheduling delay: a runner that did not cancel would wait for
    # the hook's DEADLINE sleep (within GRACE); one that cancelled takes the 0.2 s timeout.
    monkeypatch.setattr(_runner, "ASYNC_GRACE", GRACE)
    reg = rehydrate_engine.registry
    saw_cancel = threading.Event()
    calls = []

    @reg.after_restore(name="slow", timeout=0.2)
    async def slow():
        try:
            await asyncio.sleep(DEADLINE)
        except asyncio.CancelledError:
            saw_cancel.set()
            raise
        calls.append("slow finished")  # pragma: no cover - must not happen

    @reg.after_restore(name="next-async")
    async def next_async():
        calls.append("next-async")
        await asyncio.sleep(0)

    @reg.after_restore(name="next-sync")
    def next_sync():
        calls.append("next-sync")

    t0 = time.monotonic()
    report = rehydrate_engine.simulate_restore()
    elapsed = time.monotonic() - t0
    hooks = by_name(report)
    assert saw_cancel.is_set()
    assert hooks["slow"].outcome == "timeout"
    assert isinstance(hooks["slow"].error, HookTimeout)
    assert 0.2 <= hooks["slow"].duration < DEADLINE / 2
    assert hooks["next-async"].outcome == "ok" and hooks["next-sync"].outcome == "ok"
    assert calls == ["next-async", "next-sync"]
    assert elapsed < DEADLINE / 2
    assert not report.ok


def test_async_timeout_on_the_users_loop(rehydrate_engine):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    saw_cancel = threading.Event()

    @rehydrate_engine.registry.after_restore(name="slow", timeout=0.1)
    async def slow():
        try:
            await asyncio.sleep(DEADLINE)
        except asyncio.CancelledError:
            saw_cancel.set()
            raise

    try:
        rehydrate_engine.start(detectors="none", loop=loop)
        report = rehydrate_engine.simulate_restore()
        assert by_name(report)["slow"].outcome == "timeout" and saw_cancel.is_set()
        # the application's loop keeps working and is not left cancelled
        assert asyncio.run_coroutine_threadsafe(asyncio.sleep(0, "alive"),
                                                loop).result(DEADLINE) == "alive"
    finally:
        rehydrate_engine.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(DEADLINE)
        loop.close()


def test_async_hook_blocking_its_loop_is_given_up_after_the_grace(rehydrate_engine, caplog):
    calls = []
    returned = threading.Event()

    @rehydrate_engine.registry.after_restore(name="blocks-loop", timeout=0.1)
    async def blocks_loop():
        time.sleep(ASYNC_GRACE + 1.0)  # never awaits: cancellation cannot reach it
        returned.set()

    rehydrate_engine.registry.after_restore(name="next")(lambda: calls.append("next"))
    t0 = time.monotonic()
    report = rehydrate_engine.simulate_restore()
    elapsed = time.monotonic() - t0
    assert not returned.is_set()  # the engine moved on before the hook returned
    hooks = by_name(report)
    assert hooks["blocks-loop"].outcome == "timeout"
    assert hooks["next"].outcome == "ok" and calls == ["next"]
    assert elapsed >= 0.1 + ASYNC_GRACE
    assert any("did not give control back" in r.getMessage() for r in caplog.records)
    assert returned.wait(DEADLINE)


def test_async_hooks_after_one_that_blocks_the_loop_are_bounded_too(rehydrate_engine,
                                                                    monkeypatch, caplog):
    """The next async hook's clock started only when the (blocked) loop got to it: the
    supervisor waited without limit, the event stayed "restoring" until the blocking call
    returned, and every later event queued behind it."""
    from rehydrate import _runner

    monkeypatch.setattr(_runner, "ASYNC_GRACE", 0.1)
    release = threading.Event()

    @rehydrate_engine.registry.after_restore(name="blocks-loop", timeout=0.1)
    async def blocks_loop():
        release.wait(DEADLINE)  # a sync call inside an async hook

    @rehydrate_engine.registry.after_restore(name="after-it", timeout=0.1)
    async def after_it():
        pass

    try:
        done = concurrent.futures.ThreadPoolExecutor(1).submit(
            rehydrate_engine.simulate_restore)
        report = done.result(timeout=DEADLINE / 2)  # long before the loop is free
        assert not release.is_set()
        assert [by_name(report)[n].outcome for n in ("blocks-loop", "after-it")] == [
            "timeout", "timeout"]
        assert rehydrate_engine.status().state == "degraded"
        assert any("async hook after-it did not start within 0.2s: its event loop is still "
                   "blocked" in r.getMessage() for r in caplog.records)
    finally:
        release.set()


def test_async_hook_swallowing_cancellation_is_still_a_timeout(rehydrate_engine):
    reg = rehydrate_engine.registry
    calls = []

    @reg.after_restore(name="stubborn", timeout=0.1)
    async def stubborn():
        try:
            await asyncio.sleep(DEADLINE)
        except asyncio.CancelledError:
            calls.append("swallowed")
        # returns normally, although it overran

    @reg.after_restore(name="next")
    async def nxt():
        await asyncio.sleep(0.01)  # would be cancelled if the swallowed cancel leaked
        calls.append("next")

    report = rehydrate_engine.simulate_restore()
    hooks = by_name(report)
    assert hooks["stubborn"].outcome == "timeout"
    assert hooks["next"].outcome == "ok"
    assert calls == ["swallowed", "next"]


def test_async_hook_converting_cancellation_into_an_error_is_a_timeout(rehydrate_engine):
    @rehydrate_engine.registry.after_restore(name="converts", timeout=0.1)
    async def converts():
        try:
            await asyncio.sleep(DEADLINE)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    report = rehydrate_engine.simulate_restore()
    assert by_name(report)["converts"].outcome == "timeout"


def test_async_hook_using_its_own_timeouts_is_unaffected(rehydrate_engine):
    @rehydrate_engine.registry.after_restore(name="inner", timeout=5.0)
    async def inner():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.sleep(DEADLINE), 0.01)
        await asyncio.sleep(0.01)  # still allowed to run

    report = rehydrate_engine.simulate_restore()
    assert by_name(report)["inner"].outcome == "ok"


def test_many_fast_async_hooks_with_one_short_timeout(rehydrate_engine):
    """The single watchdog timer re-arms correctly across hooks with different timeouts."""
    reg = rehydrate_engine.registry
    for i in range(20):
        reg.after_restore(name=f"fast-{i}", timeout=30.0)(_noop_async)
    reg.after_restore(name="short", timeout=0.1)(_sleep_async)
    for i in range(5):
        reg.after_restore(name=f"tail-{i}", timeout=0.5)(_noop_async)
    reg.after_restore(name="short2", timeout=0.05)(_sleep_async)
    report = rehydrate_engine.simulate_restore()
    outcomes = {h.name: h.outcome for h in user_hooks(report)}
    assert outcomes.pop("short") == "timeout" and outcomes.pop("short2") == "timeout"
    assert set(outcomes.values()) == {"ok"}


async def _noop_async():
    await asyncio.sleep(0)


async def _sleep_async():
    await asyncio.sleep(DEADLINE)


def test_no_timeout_means_no_limit(rehydrate_engine):
    @rehydrate_engine.registry.after_restore(name="unbounded", timeout=None)
    async def unbounded():
        await asyncio.sleep(0.05)

    assert by_name(rehydrate_engine.simulate_restore())["unbounded"].outcome == "ok"


# -- retries ----------------------------------------------------------------------------


def _hook_calling(body, is_async):
    """A sync or an async hook whose whole work is ``body()``."""
    if is_async:
        async def ahook():
            body()

        return ahook

    def hook():
        body()

    return hook


@pytest.mark.parametrize("is_async", [False, True])
def test_retry_succeeds_on_the_third_attempt(rehydrate_engine, is_async):
    attempts = []

    def body():
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise ConnectionError(f"attempt {len(attempts)}")

    rehydrate_engine.registry.after_restore(name="flaky", retries=2)(
        _hook_calling(body, is_async))
    report = rehydrate_engine.simulate_restore()
    (res,) = user_hooks(report)
    assert (res.outcome, res.attempts, res.error) == ("ok", 3, None)
    assert len(attempts) == 3
    assert report.ok and report.error is None
    # exponential backoff: attempt k waits in [cap/2, cap], cap = BACKOFF_BASE * 2**k
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert gaps[0] >= BACKOFF_BASE / 2 * 0.9
    assert gaps[1] >= BACKOFF_BASE * 0.9
    assert res.duration >= sum(gaps) * 0.9


@pytest.mark.parametrize("is_async", [False, True])
def test_retries_exhausted_report_the_last_error(rehydrate_engine, is_async):
    errors = []

    def body():
        exc = ValueError(f"attempt {len(errors) + 1}")
        errors.append(exc)
        raise exc

    rehydrate_engine.registry.after_restore(name="broken", retries=1)(
        _hook_calling(body, is_async))
    report = rehydrate_engine.simulate_restore()
    (res,) = user_hooks(report)
    assert (res.outcome, res.attempts) == ("failed", 2)
    assert res.error is errors[-1] and len(errors) == 2
    assert list(report.error.exceptions) == [errors[-1]]


def test_no_retries_by_default(rehydrate_engine):
    calls = []

    @rehydrate_engine.registry.after_restore
    def once():
        calls.append(1)
        raise RuntimeError

    (res,) = user_hooks(rehydrate_engine.simulate_restore())
    assert res.attempts == 1 and calls == [1]


def test_async_retry_after_a_timeout(rehydrate_engine):
    attempts = []

    @rehydrate_engine.registry.after_restore(name="slow-then-fast", timeout=0.1, retries=1)
    async def hook():
        attempts.append(1)
        if len(attempts) == 1:
            await asyncio.sleep(DEADLINE)

    (res,) = user_hooks(rehydrate_engine.simulate_restore())
    assert (res.outcome, res.attempts, len(attempts)) == ("ok", 2, 2)


@pytest.mark.parametrize("is_async", [False, True])
def test_the_wait_before_a_retry_is_no_part_of_the_attempts_timeout(
        rehydrate_engine, monkeypatch, is_async):
    """The backoff wait came after the attempt's deadline: the supervisor, still on the
    failed attempt's limit, reported the hook ``timeout`` while it only waited, and gave
    up on its worker — which then started the retry after the run was reported (a sync
    hook's second attempt ran with nobody watching; the hook counted as hung)."""
    timeout = 1.0 if not is_async else 0.2
    # Longer than what the supervisor allowed past the failed attempt's start.
    delay = timeout + (0.2 if not is_async else ASYNC_GRACE + 0.2)
    monkeypatch.setattr("rehydrate._runner.backoff_delay", lambda attempt: delay)
    calls = []

    def body():
        calls.append(time.monotonic())
        raise ConnectionError(f"attempt {len(calls)}")

    rehydrate_engine.registry.after_restore(name="flaky", timeout=timeout, retries=1)(
        _hook_calling(body, is_async))
    report = rehydrate_engine.simulate_restore()
    (res,) = user_hooks(report)
    assert (res.outcome, res.attempts, str(res.error)) == ("failed", 2, "attempt 2")
    assert len(calls) == 2  # both attempts inside the run, none after it
    assert rehydrate_engine.status().extra["hung_hooks"] == []
    assert calls[1] - calls[0] >= delay


@given(st.integers(min_value=0, max_value=40))
def test_backoff_delay_is_exponential_with_bounded_jitter(attempt):
    cap = min(BACKOFF_MAX, BACKOFF_BASE * 2.0**attempt)
    for _ in range(5):
        d = backoff_delay(attempt)
        assert cap / 2 <= d <= cap


def test_backoff_delay_stays_at_its_cap_for_any_attempt():
    """``hook(retries=N)`` takes any N: 2.0 ** 1100 would overflow a float."""
    assert BACKOFF_MAX / 2 <= backoff_delay(5000) <= BACKOFF_MAX


# -- batches, observers ----------------------------------------------------------------


def test_mixed_sync_and_async_hooks_keep_their_order(rehydrate_engine):
    reg = rehydrate_engine.registry
    calls = []
    threads = {}
    pattern = "sasaassass"
    for i, kind in enumerate(pattern):
        if kind == "a":
            async def hook(i=i):
                calls.append(i)
                threads[i] = threading.current_thread().name
        else:
            def hook(i=i):
                calls.append(i)
                threads[i] = threading.current_thread().name
        reg.after_restore(name=f"h{i}")(hook)
    report = rehydrate_engine.simulate_restore()
    assert calls == list(range(len(pattern)))
    assert [h.name for h in user_hooks(report)] == [f"h{i}" for i in range(len(pattern))]
    for i, kind in enumerate(pattern):
        assert threads[i] == ("rehydrate-loop" if kind == "a" else "rehydrate-hooks")


def test_observers_see_every_hook(rehydrate_engine):
    events = []

    class Obs:
        def hook_started(self, hook, ctx):
            events.append(("start", hook.name, ctx.kind))
            return hook.name

        def hook_finished(self, token, result):
            events.append(("end", token, result.outcome))

    rehydrate_engine.builtins.clear()
    rehydrate_engine.add_observer(Obs())
    reg = rehydrate_engine.registry
    reg.after_restore(name="s")(lambda: None)

    @reg.after_restore(name="a")
    async def a():
        raise ValueError

    rehydrate_engine.simulate_restore()
    assert events == [("start", "s", "restore"), ("end", "s", "ok"),
                      ("start", "a", "restore"), ("end", "a", "failed")]


class _FinishedLog:
    """An observer recording each ``hook_finished`` result, with a condition to wait on."""

    def __init__(self):
        self.results = {}
        self.cond = threading.Condition()

    def hook_started(self, hook, ctx):
        return hook.name

    def hook_finished(self, token, result):
        with self.cond:
            self.results[token] = result
            self.cond.notify_all()

    def wait(self, name):
        with self.cond:
            assert self.cond.wait_for(lambda: name in self.results, DEADLINE), self.results
            return self.results[name]


def test_abandoned_sync_hook_reports_timeout_to_observers_when_it_returns(rehydrate_engine):
    obs = _FinishedLog()
    rehydrate_engine.add_observer(obs)
    release = threading.Event()

    @rehydrate_engine.registry.after_restore(name="slow", timeout=0.1)
    def slow():
        release.wait(DEADLINE)  # returns normally, long after its timeout

    report = rehydrate_engine.simulate_restore()
    assert by_name(report)["slow"].outcome == "timeout"
    assert "slow" not in obs.results  # still running
    release.set()
    late = obs.wait("slow")
    assert late.outcome == "timeout"  # not "ok": observers agree with the report
    assert late is by_name(report)["slow"]


def test_abandoned_async_hook_reports_timeout_to_observers(rehydrate_engine, monkeypatch):
    from rehydrate import _runner

    monkeypatch.setattr(_runner, "ASYNC_GRACE", 0.1)
    obs = _FinishedLog()
    rehydrate_engine.add_observer(obs)
    release = threading.Event()

    @rehydrate_engine.registry.after_restore(name="blocking", timeout=0.1)
    async def blocking():
        release.wait(DEADLINE)  # blocks the loop: neither the watchdog nor a cancel gets in

    report = rehydrate_engine.simulate_restore()
    assert by_name(report)["blocking"].outcome == "timeout"
    release.set()
    late = obs.wait("blocking")
    assert late.outcome == "timeout"
    assert late is by_name(report)["blocking"]


# -- containment ------------------------------------------------------------------------


def test_system_exit_in_a_sync_hook_is_contained(rehydrate_engine):
    reg = rehydrate_engine.registry
    calls = []

    @reg.after_restore(name="exits")
    def exits():
        raise SystemExit(3)

    reg.after_restore(name="after")(lambda: calls.append("after"))
    report = rehydrate_engine.simulate_restore()
    res = by_name(report)["exits"]
    assert res.outcome == "failed"
    assert isinstance(res.error, RuntimeError) and isinstance(res.error.__cause__, SystemExit)
    assert "SystemExit" in str(res.error)
    assert calls == ["after"]
    assert isinstance(report.error, HookFailed)
    assert rehydrate_engine.simulate_restore().generation == 2  # worker still alive


def test_keyboard_interrupt_in_an_async_hook_is_contained(rehydrate_engine):
    reg = rehydrate_engine.registry

    @reg.after_restore(name="interrupt")
    async def interrupt():
        raise KeyboardInterrupt

    @reg.after_restore(name="after")
    async def after():
        pass

    report = rehydrate_engine.simulate_restore()
    assert by_name(report)["interrupt"].outcome == "failed"
    assert by_name(report)["after"].outcome == "ok"
    assert rehydrate_engine.simulate_restore().generation == 2  # loop still alive


@pytest.mark.skipif(sys.version_info < (3, 11), reason="needs Task.cancelling()")
def test_stray_cancelled_error_inside_an_async_hook_is_a_failure(rehydrate_engine):
    reg = rehydrate_engine.registry

    @reg.after_restore(name="stray")
    async def stray():
        fut = asyncio.get_running_loop().create_future()
        fut.cancel()
        await fut  # raises CancelledError although nobody cancelled the hook

    @reg.after_restore(name="after")
    async def after():
        await asyncio.sleep(0)

    report = rehydrate_engine.simulate_restore()
    hooks = by_name(report)
    assert hooks["stray"].outcome == "failed"
    assert isinstance(hooks["stray"].error.__cause__, asyncio.CancelledError)
    assert hooks["after"].outcome == "ok"


def test_close_stops_the_engine_threads():
    from rehydrate.testing import isolated_engine

    engine = isolated_engine()

    @engine.registry.after_restore
    async def a():
        pass

    engine.registry.after_restore(lambda: None)
    engine.simulate_restore()
    names = {t.name for t in threading.enumerate()}
    assert {"rehydrate-loop", "rehydrate-hooks"} <= names
    before = threading.active_count()
    engine.close()
    assert wait_for(lambda: threading.active_count() <= before - 2)
    # a closed engine can still be used (threads start again on demand) and closed again
    assert engine.simulate_restore().ok
    engine.close()


def test_a_failing_observer_neither_breaks_nor_hangs_the_event(rehydrate_engine, caplog):
    class Broken:
        def hook_started(self, hook, ctx):
            raise RuntimeError("observer bug (start)")

        def hook_finished(self, token, result):
            raise RuntimeError("observer bug (finish)")

    calls = []
    rehydrate_engine.add_observer(Broken())
    rehydrate_engine.registry.after_restore(name="s", timeout=None)(lambda: calls.append("s"))

    @rehydrate_engine.registry.after_restore(name="a", timeout=None)
    async def a():
        calls.append("a")

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", rehydrate_engine.simulate_restore()),
                         daemon=True)
    t.start()
    t.join(DEADLINE)
    assert not t.is_alive(), "the event hung"
    report = box["r"]
    assert report.ok and calls == ["s", "a"]
    assert any("observer" in r.getMessage() for r in caplog.records)


def test_a_plain_callable_returning_a_coroutine_is_awaited(rehydrate_engine):
    """``after_restore(lambda: reconnect())`` with ``async def reconnect``: the coroutine
    must run (not be dropped and reported ``ok``), within the hook's timeout."""
    ran = []

    async def reconnect():
        await asyncio.sleep(0)
        ran.append(threading.current_thread().name)

    async def hang():
        await asyncio.sleep(60)

    reg = rehydrate_engine.registry
    reg.after_restore(lambda: reconnect(), name="wrapped")  # noqa: PLW0108 - the point
    reg.after_restore(lambda: hang(), name="wrapped-hang", timeout=0.2)  # noqa: PLW0108
    report = rehydrate_engine.simulate_restore()
    outcomes = {h.name: h.outcome for h in report.hooks}
    assert outcomes["wrapped"] == "ok" and ran == ["rehydrate-loop"]
    assert outcomes["wrapped-hang"] == "timeout"
    assert isinstance(by_name(report)["wrapped-hang"].error, HookTimeout)


class _Unprintable(Exception):
    """A library exception whose __str__ reads an attribute it never set."""

    def __init__(self, code: int) -> None:
        self.code = code  # no super().__init__: no args either

    def __str__(self) -> str:
        return f"error {self.code}: {self.detail}"  # type: ignore[attr-defined]


def _tuple_notes() -> ValueError:
    exc = ValueError("boom")
    exc.__notes__ = ("from a library",)  # type: ignore[assignment]  # add_note refuses it
    return exc


@pytest.mark.parametrize(("make", "shown"), [
    (lambda: _Unprintable(42), "RuntimeError: hook 'db' raised _Unprintable, whose message "
                               "could not be formatted (AttributeError)"),
    (_tuple_notes, "ValueError: boom"),
])
@pytest.mark.parametrize("required", [False, True])
def test_an_awkward_exception_from_a_hook_still_ends_the_run(rehydrate_engine, make, shown,
                                                             required):
    """Before: formatting the error (its __str__) or noting the hook on it (a tuple of
    __notes__) raised after the hooks ran, so the run raised instead of reporting and the
    engine stayed ``restoring`` — not ready — until some later event."""
    def db() -> None:
        raise make()

    rehydrate_engine.registry.after_restore(name="db", required=required)(db)
    report = rehydrate_engine.simulate_restore()
    (result,) = [h for h in report.hooks if h.name == "db"]
    assert result.outcome == "failed"
    assert result.to_dict()["error"] == shown
    assert report.ok is not required
    assert rehydrate_engine.status().state == ("degraded" if required else "ready")
    assert rehydrate_engine.status().to_dict()["last_report"]["hooks"][-1]["error"] == shown


def test_a_timeout_error_raised_by_a_hook_is_its_failure_not_a_timeout(rehydrate_engine):
    """Before: ``except TimeoutError`` around a sync hook also caught the hook's own
    (a client's connect timeout): reported as rehydrate's "timed out after 30s", duration
    0, the real error lost — while the same error from an async hook was ``failed``."""
    async def connect() -> None:
        raise TimeoutError("connect to db:5432 timed out")

    def sync_db() -> None:
        raise TimeoutError("connect to db:5432 timed out")

    def returns_a_coroutine():
        return connect()

    reg = rehydrate_engine.registry
    reg.after_restore(name="sync", required=False)(sync_db)
    reg.after_restore(name="coro", required=False)(returns_a_coroutine)
    reg.after_restore(name="async", required=False)(connect)
    report = rehydrate_engine.simulate_restore()
    for name in ("sync", "coro", "async"):
        (result,) = [h for h in report.hooks if h.name == name]
        assert result.outcome == "failed", name
        assert result.to_dict()["error"] == "TimeoutError: connect to db:5432 timed out", name


def test_a_coroutine_returned_by_a_sync_hook_still_times_out(rehydrate_engine):
    never = threading.Event()

    async def slow() -> None:
        while not never.is_set():
            await asyncio.sleep(0.01)

    def returns_a_coroutine():  # a sync function: the runner awaits what it returns
        return slow()

    rehydrate_engine.registry.after_restore(name="slow", timeout=0.2,
                                            required=False)(returns_a_coroutine)
    report = rehydrate_engine.simulate_restore()
    (result,) = [h for h in report.hooks if h.name == "slow"]
    assert result.outcome == "timeout"
    assert isinstance(result.error, HookTimeout)


class _CallableRecord:
    """A callable that cannot be hashed (like a @dataclass instance with __call__)."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, block: threading.Event | None = None) -> None:
        self.block = block
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.block is not None:
            self.block.wait(30)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CallableRecord) and other.block is self.block


@pytest.mark.parametrize("hung_is_unhashable", [True, False])
def test_unhashable_callable_hooks_survive_an_abandoned_hook(rehydrate_engine,
                                                             hung_is_unhashable):
    """Before: abandoned hooks were remembered in a dict keyed by the function, so an
    unhashable callable object that timed out raised TypeError out of the run (later
    hooks never ran), and one that ran while another hook was hung failed with TypeError
    at every event."""
    release = threading.Event()
    stuck: object
    if hung_is_unhashable:
        stuck = _CallableRecord(release)
    else:
        def stuck() -> None:
            release.wait(30)
    fine = _CallableRecord()
    reg = rehydrate_engine.registry
    reg.after_restore(name="stuck", timeout=0.2, required=False)(stuck)
    reg.after_restore(name="fine")(fine)
    try:
        for _ in range(2):
            report = rehydrate_engine.simulate_restore()
            outcomes = {h.name: h.outcome for h in report.hooks}
            assert outcomes["fine"] == "ok", report.to_dict()
            assert outcomes["stuck"] in ("timeout", "failed")  # failed: still running
        assert fine.calls == 2
        assert rehydrate_engine.status().state == "ready"
    finally:
        release.set()


# -- a deadline for the whole run (restore_detected(deadline=...), set_restore_deadline) --


def test_run_deadline_cuts_the_running_hook_and_starts_no_more(rehydrate_engine):
    reg = rehydrate_engine.registry
    release = threading.Event()
    calls = []

    @reg.after_restore(name="stuck", timeout=DEADLINE * 3, phase=Phase.CONNECTIONS)
    def stuck():
        release.wait(DEADLINE * 3)

    @reg.after_restore(name="later-async")
    async def later_async():
        calls.append("later-async")

    @reg.after_restore(name="later-sync")
    def later_sync():
        calls.append("later-sync")

    @reg.on_env_change("NEVER_CHANGED", phase=Phase.APPLICATION, name="watcher")
    def watcher(ctx, changes):
        calls.append("watcher")

    t0 = time.monotonic()
    try:
        report = rehydrate_engine.restore_detected("test", deadline=0.3)
        elapsed = time.monotonic() - t0
    finally:
        release.set()
    hooks = by_name(report)
    assert elapsed < DEADLINE  # not the stuck hook's own (tripled) limit
    assert not report.ok and rehydrate_engine.status().state == "degraded"
    err = hooks["stuck"].error
    assert (hooks["stuck"].outcome, type(err), err.run_deadline, err.started) == \
        ("timeout", HookTimeout, 0.3, True)
    assert str(err) == "hook 'stuck' ran past the run's 0.3s deadline"
    for name in ("later-async", "later-sync"):
        h = hooks[name]
        assert (h.outcome, h.attempts, h.duration, h.error.started) == ("timeout", 0, 0.0, False)
        assert str(h.error) == f"hook {name!r} not started: the run's 0.3s deadline had passed"
    assert hooks["watcher"].outcome == "skipped"  # would not have run anyway: no failure
    assert calls == []


def test_run_deadline_cuts_an_async_batch(rehydrate_engine):
    reg = rehydrate_engine.registry
    calls = []

    @reg.after_restore(name="stuck", timeout=DEADLINE * 3)
    async def stuck():
        await asyncio.Event().wait()

    @reg.after_restore(name="next")
    async def nxt():
        calls.append("next")

    report = rehydrate_engine.restore_detected("test", deadline=0.3)
    hooks = by_name(report)
    assert hooks["stuck"].outcome == "timeout" and hooks["stuck"].error.run_deadline == 0.3
    assert hooks["stuck"].error.started
    assert hooks["next"].outcome == "timeout" and not hooks["next"].error.started
    assert calls == []


def test_run_deadline_cuts_an_awaitable_returned_by_a_sync_hook(rehydrate_engine):
    async def forever():
        await asyncio.Event().wait()

    def wrapped():  # a plain callable that returns a coroutine
        return forever()

    rehydrate_engine.registry.after_restore(wrapped, name="wrapped", timeout=DEADLINE * 3)
    report = rehydrate_engine.restore_detected("test", deadline=0.3)
    h = by_name(report)["wrapped"]
    assert h.outcome == "timeout" and h.error.run_deadline == 0.3 and h.error.started


def test_an_async_hook_cancelled_at_the_run_deadline_finishes_its_cleanup_in_the_run(
        rehydrate_engine):
    """The supervisor gave up on an async hook at the very moment the run's deadline
    cancelled it, so its cleanup ran after the run had returned (and the hook was counted
    as hung meanwhile). It allows a short grace past the run's
    deadline, as it does past a hook's own timeout."""
    reg = rehydrate_engine.registry
    cleaned: list[str] = []

    @reg.after_restore(name="stuck", timeout=DEADLINE * 3)
    async def stuck():
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.02)  # cleanup on cancel, e.g. closing a connection
            cleaned.append("stuck")

    for _ in range(3):
        cleaned.clear()
        report = rehydrate_engine.restore_detected("test", deadline=0.3)
        hooks = by_name(report)
        assert hooks["stuck"].outcome == "timeout" and hooks["stuck"].error.started
        # done when the run returned, not after it
        assert cleaned[:1] == ["stuck"], cleaned
        assert rehydrate_engine._runner.hung_hooks() == []


def test_retries_stop_at_the_run_deadline(rehydrate_engine):
    attempts = []

    @rehydrate_engine.registry.after_restore(name="flaky", retries=1000)
    def flaky():
        attempts.append(1)
        raise ConnectionRefusedError("refused")

    t0 = time.monotonic()
    report = rehydrate_engine.restore_detected("test", deadline=0.5)
    assert time.monotonic() - t0 < DEADLINE
    h = by_name(report)["flaky"]
    # the hook's own failure, not a timeout: no retry was begun that could not start in time
    assert h.outcome == "failed" and isinstance(h.error, ConnectionRefusedError)
    assert 1 <= h.attempts == len(attempts) < 1000


def test_hooks_see_the_run_deadline(rehydrate_engine):
    seen = []
    rehydrate_engine.registry.after_restore(
        lambda ctx: seen.append((ctx.deadline, ctx.detected_at, ctx.time_left())))
    rehydrate_engine.restore_detected("test", deadline=4.0)
    rehydrate_engine.simulate_restore()  # no deadline
    (end, noticed, left), unbounded = seen
    assert end == noticed + 4.0 and 0 < left <= 4.0
    assert unbounded[0] is None and unbounded[2] is None


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (-1.0, ValueError),
                                            (float("nan"), ValueError), ("5", TypeError),
                                            (True, TypeError)])
def test_bad_run_deadline_is_refused_before_anything_runs(rehydrate_engine, bad, error):
    calls = []
    rehydrate_engine.registry.after_restore(lambda: calls.append(1))
    with pytest.raises(error, match=r"^deadline must be a number of seconds > 0"):
        rehydrate_engine.restore_detected("test", deadline=bad)
    assert calls == [] and rehydrate_engine.status().generation == 0
    with pytest.raises(error, match=r"^x restore deadline must be a number of seconds > 0"):
        rehydrate_engine.set_restore_deadline("x", bad)


def test_set_restore_deadline_bounds_every_restore_run(rehydrate_engine):
    budgets = []
    rehydrate_engine.registry.after_restore(
        lambda ctx: budgets.append(None if ctx.deadline is None
                                   else round(ctx.deadline - ctx.detected_at, 6)))
    rehydrate_engine.set_restore_deadline("platform", 5.0)
    rehydrate_engine.restore_detected("clock-jump")
    rehydrate_engine.restore_detected("clock-jump", deadline=2.0)  # the tightest applies
    rehydrate_engine.set_restore_deadline("other", 3.0)
    rehydrate_engine.simulate_restore(kind="resume")
    with pytest.raises(ValueError):  # refused; the bounds set stay as they were
        rehydrate_engine.set_restore_deadline("platform", -1)
    rehydrate_engine.restore_detected("identity")
    rehydrate_engine.set_restore_deadline("platform", None)
    rehydrate_engine.set_restore_deadline("other", None)
    rehydrate_engine.restore_detected("identity")
    assert budgets == [5.0, 2.0, 3.0, 3.0, None]


# -- the failure's log line ----------------------------------------------------------------


def test_a_failed_hooks_log_line_escapes_terminal_control_characters(rehydrate_engine,
                                                                      caplog):
    """A hook error carrying a terminal escape (``\\x1b[2J`` clears the screen) reached
    the log line and the report raw: only whitespace was collapsed."""

    class Odd(Exception):
        pass

    @rehydrate_engine.registry.after_restore(name="painter")
    def painter(ctx):  # type: ignore[no-untyped-def]
        raise Odd("bad \x1b[2J\x1b[31mred\x07 and\nmore\x00")

    report = rehydrate_engine.simulate_restore()
    [line] = [r.getMessage() for r in caplog.records if "painter" in r.getMessage()]
    shown = "Odd: bad \\x1b[2J\\x1b[31mred\\x07 and more\\x00"
    assert line == f"restore hook painter failed: {shown}"
    assert line.isprintable()
    assert by_name(report)["painter"].to_dict()["error"] == shown
