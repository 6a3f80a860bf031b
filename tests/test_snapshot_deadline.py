"""The snapshot deadline is bounded, and defers to a restore notice in flight.

The watch (``Lifecycle._deadline_main``) sees gaps through the engine module's clock: the
tests swap it for the real clocks plus injected gaps (:class:`_Clock`), injected while the
watch thread waits inside one of its slices — no multi-second sleeps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rehydrate import Lifecycle, Registry, RestoreContext, _lifecycle
from rehydrate.env import EnvRefresher

GIVE_UP = 15.0
STALL = 1.6  # just over _FROZEN_STEP: the watch takes the slice for a gap


class _Clock:
    """``time`` as the engine module sees it: the real clocks, moved on by injected gaps
    (``monotonic``) and by CPU time charged meanwhile (``process_time``)."""

    def __init__(self) -> None:
        self.gap = 0.0
        self.cpu = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.gap

    def process_time(self) -> float:
        return time.process_time() + self.cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(_lifecycle, "time", fake)
    return fake


@pytest.fixture
def engine() -> Iterator[Lifecycle]:
    eng = Lifecycle(Registry(), env=EnvRefresher(path=None), builtins=False)
    try:
        yield eng
    finally:
        eng.close()


class _Runs:
    """The restore/resume runs' (reason, kind, detected_at), and an event when one ran."""

    def __init__(self, engine: Lifecycle) -> None:
        self.runs: list[tuple[str, str, float]] = []
        self.ran = threading.Event()
        engine.registry.after_restore(self._hook, name="test.runs")

    def _hook(self, ctx: RestoreContext) -> None:
        self.runs.append((ctx.reason, ctx.kind, ctx.detected_at))
        self.ran.set()


def _waiters(engine: Lifecycle) -> list[object]:
    return list(engine._cond._waiters)  # type: ignore[attr-defined]


def _next_slice(engine: Lifecycle, previous: object | None, ran: threading.Event
                ) -> object | None:
    """The deadline watch's wait once it is a new slice (not ``previous``); None once a
    run happened instead."""
    give_up = time.monotonic() + GIVE_UP
    while not ran.is_set():
        waiters = _waiters(engine)
        if waiters and waiters[0] is not previous and not engine._verdict_waiters:
            return waiters[0]
        assert time.monotonic() < give_up, "the deadline watch never waited again"
        time.sleep(0.001)
    return None


def _judging(engine: Lifecycle, previous: object, ran: threading.Event) -> bool:
    """True once the watch waits for the freeze watch's verdict on a gap; False when it
    went on without one (a new slice, or a run)."""
    give_up = time.monotonic() + GIVE_UP
    while not ran.is_set():
        if engine._verdict_waiters:
            return True
        waiters = _waiters(engine)
        if waiters and waiters[0] is not previous:
            return False
        assert time.monotonic() < give_up, "the deadline watch never woke"
        time.sleep(0.001)
    return False


def _stall_every_slice(engine: Lifecycle, clock: _Clock, runs: _Runs, *, busy: bool,
                       watch: bool, most: int) -> int:
    """Make every slice of the deadline watch end ``STALL`` late (with that much process
    CPU time when ``busy``; judged by a heartbeat after it when ``watch``) until a run
    happened or ``most`` stalls were made; the number made."""
    made = 0
    current = _next_slice(engine, None, runs.ran)
    while current is not None and made < most:
        clock.gap += STALL
        if busy:
            # every core busy through the on-time part, and the GIL's holder through the
            # stall
            clock.cpu += 0.5 * _lifecycle._cpus() + STALL
        made += 1
        if watch and _judging(engine, current, runs.ran):
            # the watcher's heartbeat after the gap, with no freeze noticed: a stall
            engine.heartbeat(clock.monotonic(), 2.5)
        current = _next_slice(engine, current, runs.ran)
    return made


@pytest.mark.parametrize(("busy", "watch"), [(True, False), (False, True), (False, False)],
                         ids=["cpu-busy", "watch-saw-it-run", "cannot-tell"])
def test_repeated_stalls_do_not_postpone_the_snapshot_deadline_for_ever(
        engine: Lifecycle, clock: _Clock, busy: bool, watch: bool) -> None:
    """A main thread holding the GIL for more than 1.5 s in every slice. Before, each such
    stall started the deadline again: the hooks never ran and the process stayed
    ``snapshotting`` (a gated server answering 503) for good. Now a stall the engine can
    tell — the process used CPU meanwhile, or the freeze watch saw it run — postpones the
    deadline by its length only, and one it cannot tell from a freeze starts it again no
    further than the bound: one more deadline of the time the process was seen running."""
    deadline = 1.0
    engine.snapshot_deadline = deadline
    runs = _Runs(engine)
    if watch:
        engine.heartbeat(clock.monotonic(), 2.5)
    start = clock.monotonic()
    assert engine.snapshot_requested("gvisor").ok
    made = _stall_every_slice(engine, clock, runs, busy=busy, watch=watch, most=12)
    assert runs.ran.wait(GIVE_UP), "the deadline never ran"
    assert made < 12, f"the deadline ran only after the stalls stopped ({made})"
    [(reason, kind, detected)] = runs.runs
    assert (reason, kind) == ("snapshot-deadline", "restore")
    # The bound: twice the deadline of the time seen running (a stall's counts; a gap
    # that may have been a freeze does not), plus the last stall and a slice.
    counted = detected - start - (0 if (busy or watch) else made * STALL)
    assert counted <= 2 * deadline + STALL + 0.5 + 0.5, (counted, made)
    assert engine.wait_ready(GIVE_UP) and engine.state == "ready"


def test_a_stall_the_freeze_watch_saw_postpones_the_deadline_by_its_length_only(
        engine: Lifecycle, clock: _Clock) -> None:
    """One stall late in the deadline, the freeze watch's heartbeat after it and no freeze
    noticed: the deadline comes ``STALL`` later than it would have, not a whole deadline
    after the stall (before, every gap started it again)."""
    deadline = 3.0
    engine.snapshot_deadline = deadline
    runs = _Runs(engine)
    engine.heartbeat(clock.monotonic(), 2.5)
    start = clock.monotonic()
    assert engine.snapshot_requested("gvisor").ok
    current = _next_slice(engine, None, runs.ran)
    for _ in range(3):  # 1.5 s of the 3 s deadline on time
        engine.heartbeat(clock.monotonic(), 2.5)
        current = _next_slice(engine, current, runs.ran)
    assert current is not None
    clock.gap += STALL
    _judging(engine, current, runs.ran)  # (before, it did not ask: a restart)
    engine.heartbeat(clock.monotonic(), 2.5)
    give_up = time.monotonic() + GIVE_UP
    while not runs.ran.is_set():  # keep the freeze watch alive meanwhile
        engine.heartbeat(clock.monotonic(), 2.5)
        assert time.monotonic() < give_up, "the deadline never ran"
        runs.ran.wait(0.1)
    [(reason, kind, detected)] = runs.runs
    assert (reason, kind) == ("snapshot-deadline", "restore")
    # restarted, it would come 1.5 + STALL + 3 s after the pass
    assert detected - start <= deadline + STALL + 0.7, detected - start


def test_a_freeze_the_watch_noticed_still_starts_the_deadline_again(
        engine: Lifecycle, clock: _Clock) -> None:
    """A freeze the freeze watch noticed when the deadline is nearly over, and its notice
    never comes (a detector that gave up): the restore detectors get a whole deadline
    from the freeze, and then the deadline runs the *restore* hooks (the freeze may have
    made this a clone). Before, the deadline ran the resume hooks on time, as if nothing
    had frozen — and the freeze's notice, had it come, ran the hooks a second time."""
    deadline = 1.0
    engine.snapshot_deadline = deadline
    runs = _Runs(engine)
    assert engine.snapshot_requested("gvisor").ok
    current = _next_slice(engine, None, runs.ran)  # 0.5 s slices: the second ends it
    current = _next_slice(engine, current, runs.ran)
    assert current is not None
    noticed = clock.monotonic()
    engine.freeze_noticed(noticed - 0.3, noticed)
    assert runs.ran.wait(GIVE_UP)
    [(reason, kind, detected)] = runs.runs
    assert (reason, kind) == ("snapshot-deadline", "restore")
    assert detected >= noticed + deadline
    assert engine.wait_ready(GIVE_UP)


def test_a_gap_the_watch_confirms_as_a_freeze_goes_past_the_bound(
        engine: Lifecycle, clock: _Clock) -> None:
    """Stalls used up the bound; then a gap the freeze watch confirms as a freeze (a
    checkpoint, CPU charged or not) still starts the deadline again from its end: the
    restore detectors get their whole deadline first. (A guard: before, every gap
    started it again, so this held already; the bound must not cut it.)"""
    deadline = 2.0
    engine.snapshot_deadline = deadline
    runs = _Runs(engine)
    assert not engine.restore_detected("control", kind="resume", key="k").deduplicated
    runs.runs.clear()
    runs.ran.clear()
    engine.heartbeat(clock.monotonic(), 2.5)
    assert engine.snapshot_requested("gvisor").ok
    current = _next_slice(engine, None, runs.ran)
    # in the first slice, a stall as long as the deadline: postponed to the bound (4 s
    # after the pass), woken 3 s after it
    clock.gap += deadline + 0.5
    clock.cpu += deadline + 0.5
    assert _judging(engine, current, runs.ran)
    engine.heartbeat(clock.monotonic(), 2.5)
    current = _next_slice(engine, current, runs.ran)
    assert current is not None, "the deadline ran before the freeze"
    clock.gap += STALL
    clock.cpu += STALL  # a freeze hidden in a busy stall: the watch's verdict counts
    assert _judging(engine, current, runs.ran)
    noticed = clock.monotonic()
    engine.freeze_noticed(noticed - STALL, noticed)
    assert _next_slice(engine, current, runs.ran) is not None
    # Its notice turns out a duplicate (it handles the freeze and runs nothing): only
    # the verdict holds the deadline back now.
    assert engine.restore_detected("control", kind="resume", key="k").deduplicated
    assert engine._freeze_noticed_at is None
    assert runs.ran.wait(GIVE_UP)
    [(reason, kind, detected)] = runs.runs
    assert (reason, kind) == ("snapshot-deadline", "restore")
    assert detected >= noticed + deadline


class _GatedLock:
    """The engine's run lock, which a notice thread takes only once ``gate`` is set: the
    notice is in flight (counted) but has not reached the lock when the deadline passes."""

    def __init__(self, lock: threading.Lock, gate: threading.Event) -> None:
        self._lock = lock
        self._gate = gate

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.current_thread().name == "notice":
            self._gate.wait(GIVE_UP)
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Deferred(logging.Handler):
    """Sets ``seen`` when the deadline logs that it waits for a notice in flight."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "in flight" in record.getMessage():
            self.seen.set()


@pytest.fixture
def deferred() -> Iterator[_Deferred]:
    handler = _Deferred()
    logger = logging.getLogger("rehydrate")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _deadline_thread() -> threading.Thread | None:
    return next((t for t in threading.enumerate()
                 if t.name == "rehydrate-snapshot-deadline"), None)


def _start_until(thread: threading.Thread, reached: Callable[[], object]) -> None:
    """Start the notice's ``thread`` and wait until ``reached()``: the engine counts it
    (``_notices``) or it waits for the freeze watch's verdict (``_verdict_waiters``)."""
    thread.start()
    give_up = time.monotonic() + GIVE_UP
    while not reached():
        assert time.monotonic() < give_up, "the notice never got that far"
        time.sleep(0.001)


def _assert_the_deadline_waits(deferred: _Deferred, runs: _Runs, while_: str) -> None:
    """The deadline passes with the notice still on its way: it must wait for it
    (``deferred`` sees it say so), not run the hooks itself."""
    assert deferred.seen.wait(GIVE_UP) or runs.ran.is_set(), "the deadline never passed"
    assert not runs.ran.is_set(), f"the deadline ran while {while_}"


def _duplicate_notice_in_flight(engine: Lifecycle
                                ) -> tuple[threading.Event, threading.Thread,
                                           threading.Thread]:
    """A before-snapshot pass, then a notice with the key ``k1`` (handled before: it will
    run nothing) counted and held back from the run lock until the returned gate is set.
    Returns (gate, the deadline's watch thread, the notice's thread)."""
    gate = threading.Event()
    engine._run_lock = _GatedLock(engine._run_lock, gate)  # type: ignore[assignment]
    assert engine.snapshot_requested("gvisor").ok
    watch = _deadline_thread()
    assert watch is not None
    thread = threading.Thread(target=lambda: engine.restore_detected(
        "control", kind="resume", key="k1"), name="notice")
    _start_until(thread, lambda: engine._notices)
    return gate, watch, thread


@pytest.mark.parametrize("notice", ["resume", "freeze-noticed"])
def test_a_notice_in_flight_when_the_deadline_passes_runs_the_hooks_once(
        engine: Lifecycle, deferred: _Deferred, notice: str) -> None:
    """The deadline passes while a notice is in flight: the platform's ``resume`` has been
    counted but not reached the run lock, or the freeze watch noticed a freeze whose
    notice (the clock jump's) comes only later. Before, the deadline ran the hooks (not
    an anchored run, so the notice was not its duplicate) and then the notice ran them
    again. Now the deadline waits for the notice, whose run ends the pass: the hooks run
    once, the notice's run."""
    deadline = 2.0  # the notice is counted well before it passes
    engine.snapshot_deadline = deadline
    runs = _Runs(engine)
    gate = threading.Event()
    engine._run_lock = _GatedLock(engine._run_lock, gate)  # type: ignore[assignment]
    assert engine.snapshot_requested("gvisor").ok
    watch = _deadline_thread()
    assert watch is not None
    reports: list[Any] = []
    if notice == "resume":
        kw: dict[str, Any] = {"kind": "resume"}
        reason = "control"
    else:
        current = None
        for _ in range(4):  # the last 0.5 s slice: the freeze's notice may take 2 s
            current = _next_slice(engine, current, runs.ran)
        since = time.monotonic()
        engine.freeze_noticed(since, time.monotonic())
        kw = {"kind": "restore", "since": since}
        reason = "clock-jump"
        gate.set()
    thread = threading.Thread(
        target=lambda: reports.append(engine.restore_detected(reason, **kw)), name="notice")
    if notice == "resume":
        _start_until(thread, lambda: engine._notices)
    # the deadline passes: it runs (before) or waits for the notice (now)
    _assert_the_deadline_waits(deferred, runs, "a notice was in flight")
    if notice == "resume":
        gate.set()
    else:
        thread.start()  # the freeze watch's notice comes after the deadline
    thread.join(GIVE_UP)
    watch.join(GIVE_UP)
    assert not watch.is_alive()
    assert [r[:2] for r in runs.runs] == [(reason, kw["kind"])]
    assert not reports[0].deduplicated
    assert engine.is_ready()


def test_a_duplicate_notice_in_flight_leaves_the_run_to_the_deadline(
        engine: Lifecycle, deferred: _Deferred) -> None:
    """The notice the deadline waited for runs nothing (the same key as one handled
    before): the deadline must still run — at once, not leave the process
    ``snapshotting`` for good."""
    engine.snapshot_deadline = 2.0  # the notice is counted well before it passes
    runs = _Runs(engine)
    first = engine.restore_detected("control", kind="resume", key="k1")
    assert not first.deduplicated
    del runs.runs[:]
    runs.ran.clear()
    gate, watch, thread = _duplicate_notice_in_flight(engine)
    _assert_the_deadline_waits(deferred, runs, "a notice was in flight")
    gate.set()
    thread.join(GIVE_UP)
    watch.join(GIVE_UP)
    assert not watch.is_alive()
    assert [r[:2] for r in runs.runs] == [("snapshot-deadline", "resume")]
    assert engine.is_ready()


class _Gaps(logging.Handler):
    """The snapshot deadline's verdicts on gaps, from its debug lines."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.verdicts: list[str] = []
        self.judged = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for verdict in ("freeze", "stall", "unknown"):
            if f"gap ({verdict})" in message:
                self.verdicts.append(verdict)
                self.judged.set()


@pytest.fixture
def gaps(deferred: _Deferred) -> Iterator[_Gaps]:  # deferred: the logger at DEBUG
    handler = _Gaps()
    logger = logging.getLogger("rehydrate")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_busy_threads_before_a_stop_do_not_make_it_a_stall(
        engine: Lifecycle, clock: _Clock, gaps: _Gaps) -> None:
    """Threads that do not hold the GIL (zlib, NumPy) kept every core busy through the
    on-time part of a slice, then the process was stopped (a checkpoint, SIGSTOP): no CPU
    during the gap. Before, their CPU time counted for the gap and it was judged a stall
    (postponed by its length only: the deadline could run the hooks before the clone's
    own restore notice). Now only CPU beyond what the cores could use on time counts: a
    gap it cannot tell from a freeze."""
    engine.snapshot_deadline = 30.0
    runs = _Runs(engine)
    assert engine.snapshot_requested("gvisor").ok
    current = _next_slice(engine, None, runs.ran)
    assert current is not None
    clock.gap += STALL
    clock.cpu += 0.5 * _lifecycle._cpus()  # busy cores on time, nothing in the gap
    assert gaps.judged.wait(GIVE_UP)
    assert gaps.verdicts == ["unknown"]


def test_a_freeze_while_the_deadline_waits_for_a_notice_is_a_gap(
        engine: Lifecycle, clock: _Clock, deferred: _Deferred, gaps: _Gaps) -> None:
    """The deadline passes while a duplicate notice is in flight (no freeze watch), and
    the process is frozen 10 s while the deadline waits for it. The notice runs nothing,
    the deadline runs: after that gap it runs the restore hooks (``frozen_for`` None), as
    after a gap in any slice. Before, the wait for the notice was not judged: the resume
    hooks ran with ``frozen_for`` 0.0 ("nothing froze")."""
    engine.snapshot_deadline = 2.0  # the notice is counted well before it passes
    seen: list[tuple[str, str, float | None]] = []
    ran = threading.Event()

    def hook(ctx: RestoreContext) -> None:
        seen.append((ctx.reason, ctx.kind, ctx.frozen_for))
        ran.set()

    engine.registry.after_restore(hook, name="t.hook")
    assert not engine.restore_detected("control", kind="resume", key="k1").deduplicated
    seen.clear()
    ran.clear()
    gate, watch, thread = _duplicate_notice_in_flight(engine)
    assert deferred.seen.wait(GIVE_UP) and not ran.is_set()
    clock.gap += 10.0  # frozen (a checkpoint) while the deadline waits for the notice
    assert gaps.judged.wait(GIVE_UP), "the wait for the notice was not judged"
    gate.set()
    thread.join(GIVE_UP)
    watch.join(GIVE_UP)
    assert seen == [("snapshot-deadline", "restore", None)], seen


def test_a_notice_waiting_for_the_freeze_watchs_verdict_is_in_flight(
        engine: Lifecycle, clock: _Clock, deferred: _Deferred) -> None:
    """``notify restore`` without a ``save`` asks the freeze watch when its freeze was
    (``freeze_since()``) and, with the heartbeat overdue, waits for the watch's next
    heartbeat before it reaches ``restore_detected``. The deadline passing in that wait
    must wait for the notice too: before, it ran the hooks, then the notice (the watch
    noticed a freeze) ran them again."""
    engine.snapshot_deadline = 1.0
    runs = _Runs(engine)
    engine.heartbeat(clock.monotonic(), 2.5, due=0.2)
    assert engine.snapshot_requested("gvisor").ok
    clock.gap += 0.5  # the heartbeat is overdue (past due, within its limit)
    reports: list[Any] = []

    def notice() -> None:
        since = engine.freeze_since()
        reports.append(engine.restore_detected("control", since=since))

    thread = threading.Thread(target=notice, name="notice")
    _start_until(thread, lambda: engine._verdict_waiters)
    # the deadline passes while the notice waits: it runs (before) or waits (now)
    _assert_the_deadline_waits(deferred, runs, "a notice waited for the verdict")
    now = clock.monotonic()
    engine.freeze_noticed(now - 0.6, now)  # the watch's verdict: frozen since
    thread.join(GIVE_UP)
    assert runs.ran.wait(GIVE_UP)
    assert [r[:2] for r in runs.runs] == [("control", "restore")]
    assert not reports[0].deduplicated


def _refuse_thread(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """``threading.Thread.start`` raises for threads called ``name`` (the pids limit)
    while the returned flag is true."""
    real_start = threading.Thread.start
    refusing = [True]

    def start(self: threading.Thread) -> None:
        if self.name == name and refusing[0]:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return refusing


def test_no_thread_for_the_snapshot_deadline_refuses_the_pass_before_any_hook(
        engine: Lifecycle, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the thread limit the deadline's thread, started after a successful pass, failed
    to start: the error went out past the hooks' run — no resume hooks, no deadline, the
    process ``snapshotting`` for good. Its thread now starts before any hook runs: when it
    cannot, the pass is refused with nothing done; once it can, the deadline bounds the
    pass as before."""
    engine.snapshot_deadline = 0.2
    snapshots: list[str] = []
    engine.registry.before_snapshot(lambda ctx: snapshots.append(ctx.reason), name="snap")
    runs = _Runs(engine)
    before = engine.state
    refusing = _refuse_thread(monkeypatch, "rehydrate-snapshot-deadline")
    with pytest.raises(RuntimeError, match=r"no thread to watch the snapshot deadline "
                                           r"\(RuntimeError: can't start new thread\); no "
                                           r"before-snapshot hook ran"):
        engine.snapshot_requested("control")
    assert snapshots == [] and engine.state == before != "snapshotting"
    refusing[0] = False
    assert engine.snapshot_requested("control").ok
    assert snapshots == ["control"] and engine.state == "snapshotting"
    assert runs.ran.wait(GIVE_UP), "the deadline never ran"
    assert [(reason, kind) for reason, kind, _ in runs.runs] == [("snapshot-deadline",
                                                                  "resume")]
    assert engine.wait_ready(GIVE_UP)


def test_the_deadline_thread_of_a_failed_pass_ends_without_a_run(
        engine: Lifecycle) -> None:
    """The deadline's thread starts before the hooks (it started after a successful pass,
    and a failed start left the pass with no deadline and no resume hooks): it is there
    while they run. For a pass that failed it is told to end, and nothing runs for that
    pass (its caller's carry-on, or await_answer, decides)."""
    engine.snapshot_deadline = 0.2
    during: list[threading.Thread] = []

    def fail(ctx: RestoreContext) -> None:
        during.extend(t for t in threading.enumerate()
                      if t.name == "rehydrate-snapshot-deadline")
        raise OSError("disk gone")

    engine.registry.before_snapshot(fail, name="fail")
    runs = _Runs(engine)
    assert not engine.snapshot_requested("control").ok
    [thread] = during  # started before the hooks
    thread.join(GIVE_UP)
    assert not thread.is_alive(), "the deadline thread of a failed pass lives on"
    assert runs.runs == [] and engine.state == "degraded"


def test_arming_the_deadline_returns_once_the_watch_sees_gaps(
        engine: Lifecycle, clock: _Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started before the hooks, the deadline's thread is told to watch after them. When
    that thread was slow to run, snapshot_requested() returned (and the platform froze
    the process) before the watch took its start: the freeze went by unseen, and the
    deadline ran the resume hooks where after a gap it runs the restore hooks (the
    freeze may have made a clone). arm() now returns once the watch sees gaps."""
    engine.snapshot_deadline = 1.0  # its first slice (0.5 s) has to see the gap below
    runs = _Runs(engine)
    slow = threading.Event()  # holds the deadline thread between its order and its watch

    class Asked(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            slow.set()  # arm() waits for the watch: the thread may go on
            return super().wait(timeout)

    class SlowThread(_lifecycle._DeadlineThread):
        def __init__(self, watch: Callable[..., None]) -> None:
            super().__init__(watch)
            self._watching = Asked()

        def _main(self) -> None:
            self._told.wait()
            slow.wait(GIVE_UP)
            super()._main()

    monkeypatch.setattr(_lifecycle, "_DeadlineThread", SlowThread)
    assert engine.snapshot_requested("gvisor").ok
    clock.gap += STALL  # the checkpoint's freeze, as soon as the pass returned
    slow.set()
    assert runs.ran.wait(GIVE_UP), "the deadline never ran"
    assert [(reason, kind) for reason, kind, _ in runs.runs] == [("snapshot-deadline",
                                                                  "restore")]


def test_arming_waits_for_a_deadline_thread_late_to_start_its_watch(
        engine: Lifecycle, clock: _Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race with the thread late by itself (the test above holds it inside the
    watch's start, where the old code's thread held the GIL and never lost it): the pass
    returned before the watch took its start, the freeze went by unseen, and the deadline
    ran the resume hooks."""
    engine.snapshot_deadline = 1.0
    runs = _Runs(engine)
    real = engine._deadline_main

    def late(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.2)  # the thread is late to take the watch's start (well inside arm()'s 1 s)
        real(*args, **kwargs)

    monkeypatch.setattr(engine, "_deadline_main", late)
    assert engine.snapshot_requested("gvisor").ok
    clock.gap += STALL  # the checkpoint's freeze, as soon as the pass returned
    assert runs.ran.wait(GIVE_UP), "the deadline never ran"
    assert [(reason, kind) for reason, kind, _ in runs.runs] == [("snapshot-deadline",
                                                                  "restore")]


def test_no_thread_to_watch_a_failed_pass_leaves_it_to_the_caller(
        engine: Lifecycle, monkeypatch: pytest.MonkeyPatch) -> None:
    """await_answer() cannot leave a failed pass to a checkpoint's answer when no thread
    can bound that wait: False, so its caller runs the resume hooks now."""
    engine.snapshot_deadline = 5.0

    def fail(ctx: RestoreContext) -> None:
        raise OSError("disk gone")

    engine.registry.before_snapshot(fail, name="fail")
    snap = engine.snapshot_requested("gvisor")
    assert not snap.ok
    _refuse_thread(monkeypatch, "rehydrate-snapshot-deadline")
    assert engine.await_answer(snap) is False
