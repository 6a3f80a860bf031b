"""TickClock: the fixed-step accumulator, jumps, restore rebasing (hypothesis properties)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rehydrate.adapters.gameloop import TickClock
from tests.detect_helpers import wait_for


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def _clock(fake: FakeClock, rate: float, catch_up: int, max_frame: float) -> TickClock:
    return TickClock(rate, max_catch_up=catch_up, max_frame=max_frame, clock=fake,
                     rebase_on_restore=False)


rates = st.sampled_from([1.0, 10.0, 20.0, 30.0, 60.0, 64.0, 128.0, 7.3])
frames = st.floats(min_value=0.0, max_value=0.25, allow_nan=False)
jumps = st.floats(min_value=0.2501, max_value=100_000.0, allow_nan=False)
# A step: ("frame", seconds) — normal frame; ("jump", seconds) — a freeze; ("rebase",) —
# a restore event seen by the clock.
steps = st.lists(
    st.one_of(
        st.tuples(st.just("frame"), frames),
        st.tuples(st.just("jump"), jumps),
        st.tuples(st.just("rebase"), st.just(0.0)),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(rate=rates, catch_up=st.integers(0, 5), script=steps)
def test_ticks_bounded_and_time_conserved(rate, catch_up, script):
    """Every call: ordinary frames run at most one frame's worth of ticks (+1 for the
    carried partial tick) and drop nothing; jumps and rebased calls run at most
    max_catch_up and drop the rest; simulated + dropped + pending time == elapsed time."""
    fake = FakeClock()
    start = fake.now
    clock = _clock(fake, rate, catch_up, 0.25)
    per_frame_max = math.floor(0.25 * rate) + 1
    rebased = False
    for kind, seconds in script:
        if kind == "rebase":
            clock.rebase()
            rebased = True
            continue
        fake.now += seconds
        n = clock.due()
        assert n >= 0
        if kind == "jump" or rebased:
            assert n <= catch_up, (kind, seconds, n)
            assert clock.last_jump >= 0.0
            if kind == "jump":
                # at least the frozen time beyond what was caught up is dropped
                assert clock.last_jump >= seconds - (catch_up + 1) / rate - 1e-6
        else:
            assert n <= per_frame_max, (seconds, n)
            assert clock.last_jump == 0.0
        rebased = False
    elapsed = fake.now - start
    pending = clock.alpha * clock.dt
    assert clock.ticks * clock.dt + clock.dropped + pending == pytest.approx(
        elapsed, abs=1e-6 * max(1.0, elapsed))


@settings(max_examples=200, deadline=None)
@given(rate=rates, script=st.lists(frames, max_size=300))
def test_steady_frames_run_exactly_the_elapsed_ticks(rate, script):
    """Without jumps, the total number of ticks is the elapsed time over the tick length
    (frame times do not matter: no drift, nothing lost or added)."""
    fake = FakeClock()
    start = fake.now
    clock = _clock(fake, rate, 0, 0.25)
    total = 0
    for seconds in script:
        fake.now += seconds
        total += clock.due()
    expected = (fake.now - start) * rate
    assert math.floor(expected - 1e-6) <= total <= math.floor(expected + 1e-6)
    assert clock.jumps == 0 and clock.dropped == 0.0


@settings(max_examples=100, deadline=None)
@given(rate=rates, catch_up=st.integers(0, 5),
       back=st.floats(min_value=1e-6, max_value=1e6, allow_nan=False))
def test_a_clock_stepping_back_owes_nothing(rate, catch_up, back):
    fake = FakeClock()
    clock = _clock(fake, rate, catch_up, 0.25)
    fake.now += 0.1
    clock.due()
    fake.now -= back
    assert clock.due() == 0
    assert clock.last_jump == 0.0
    total = 0
    for _ in range(math.ceil(1.0 / rate / 0.2)):  # one tick later it counts again
        fake.now += min(0.2, 1.0 / rate)
        total += clock.due()
    assert total == 1


def test_freeze_is_not_replayed():
    fake = FakeClock()
    clock = _clock(fake, 30, 2, 0.25)
    fake.now += 0.1
    assert clock.due() == 3
    fake.now += 3600.0  # frozen for an hour
    assert clock.due() == 2
    assert clock.last_jump == pytest.approx(3600.0 + 0.1 - 3 / 30 - 2 / 30, abs=1e-6)
    fake.now += 1 / 30
    assert clock.due() == 1
    assert clock.last_jump == 0.0
    assert (clock.jumps, clock.ticks) == (1, 6)


def test_restore_event_rebases_the_clock(rehydrate_engine):
    fake = FakeClock()
    rehydrate_engine.registry.after_restore(lambda: None, phase="environment",
                                            order=-1_000_000_000, name="user-lowest")
    clock = TickClock(20, max_catch_up=0, clock=fake, engine=rehydrate_engine)
    names = [h.name for h in rehydrate_engine.hooks("restore")]
    # right after the environment refresh, before any user hook whatever its order
    assert names[:3] == ["rehydrate.env", "rehydrate.gameloop.tick_clock", "user-lowest"]
    fake.now += 0.1
    assert clock.due() == 2
    assert rehydrate_engine.simulate_restore().ok
    fake.now += 0.1  # a short frame: only the restore event makes it a jump
    assert clock.due() == 0
    assert clock.last_jump == pytest.approx(0.1)
    fake.now += 0.1
    assert clock.due() == 2


def test_a_freeze_seen_by_the_loop_is_not_rebased_twice(rehydrate_engine):
    fake = FakeClock()
    clock = TickClock(20, max_catch_up=1, clock=fake, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    fake.now += 30.0  # frozen; the loop runs before the restore hooks do
    assert clock.due() == 1 and clock.jumps == 1
    fake.now += 0.05
    assert clock.due() == 1
    assert rehydrate_engine.simulate_restore().ok
    fake.now += 0.1
    assert clock.due() == 2, "the restore made an ordinary frame a second jump"
    assert clock.last_jump == 0.0 and clock.jumps == 1
    # the next restore with no jump seen by the loop rebases again
    assert rehydrate_engine.simulate_restore().ok
    fake.now += 0.1
    assert clock.due() == 1 and clock.jumps == 2


def test_a_slow_restore_phase_does_not_make_the_freeze_a_second_jump(rehydrate_engine):
    """The loop saw the freeze; then a CONNECTIONS hook took 8 s (a reconnect within its
    30 s deadline) while the loop ran on. Judged when the APPLICATION phase came, the
    loop's jump was older than SAW_FREEZE_WINDOW: a second jump for one restore, which
    with max_catch_up=0 dropped a tick and asked the game to resync its clients again."""
    from rehydrate import Phase

    fake = FakeClock()
    clock = TickClock(30, clock=fake, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    fake.now += 3600.0  # frozen; the loop runs before the restore hooks do
    assert clock.due() == 0 and clock.jumps == 1

    @rehydrate_engine.registry.after_restore(phase=Phase.CONNECTIONS, name="slow-reconnect")
    def slow_reconnect() -> None:
        for _ in range(240):  # 8 s of ordinary frames meanwhile
            fake.now += 1 / 30
            assert clock.due() == 1

    assert rehydrate_engine.simulate_restore().ok
    fake.now += 1 / 30
    assert clock.due() == 1, "the restore made an ordinary frame a second jump"
    assert (clock.jumps, clock.last_jump) == (1, 0.0)


def test_a_level_load_long_before_the_restore_does_not_stop_the_rebase(rehydrate_engine):
    """A long frame any time before a restore (a level load) with no before-snapshot event
    was taken for the loop seeing the freeze: the restore did not rebase at all."""
    fake = FakeClock()
    clock = TickClock(20, max_catch_up=0, clock=fake, engine=rehydrate_engine)
    fake.now += 3.0  # a level load
    assert clock.due() == 0 and clock.jumps == 1
    for _ in range(200):  # then ten seconds of ordinary frames
        fake.now += 0.05
        assert clock.due() == 1
    assert rehydrate_engine.simulate_restore().ok  # no snapshot event came before it
    fake.now += 0.05
    assert clock.due() == 0 and clock.jumps == 2, "the restore must rebase the clock"


@pytest.mark.parametrize(("kind", "frozen_for", "jumps"), [
    ("resume", 0.0, False),   # a carry-on resume: nothing froze
    ("resume", None, True),   # a resume after a real checkpoint, freeze length unknown
    ("resume", 2.5, True),
    ("restore", None, True),  # a clone
    ("restore", 40.0, True),
])
def test_only_a_run_after_a_freeze_rebases(rehydrate_engine, kind, frozen_for, jumps):
    """A resume run that followed no freeze (frozen_for 0.0) forced a jump anyway: a
    frame dropped and every client told to resync for nothing. Unknown (None) still
    rebases, as does any known freeze."""
    fake = FakeClock()
    clock = TickClock(30, max_catch_up=2, clock=fake, engine=rehydrate_engine)
    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.restore_detected("test", kind=kind, frozen_for=frozen_for,
                                             anchor=False).ok
    fake.now += 0.1  # an ordinary frame: three ticks owed
    if jumps:
        assert clock.due() == 2 and clock.jumps == 1
        assert clock.last_jump == pytest.approx(0.1 - 2 / 30)
    else:
        assert clock.due() == 3, "a run that followed no freeze made the frame a jump"
        assert (clock.jumps, clock.last_jump, clock.dropped) == (0, 0.0, 0.0)


def test_snapshot_deadline_resume_does_not_jump(rehydrate_engine):
    """The snapshot deadline ran the resume hooks although the process was never frozen
    (the platform gave up): the tick clock forced a jump."""
    fake = FakeClock()
    clock = TickClock(30, max_catch_up=2, clock=fake, engine=rehydrate_engine)
    rehydrate_engine.snapshot_deadline = 0.05
    assert rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.wait_ready(timeout=30)
    # the deadline's report is published just after its run made the process ready
    wait_for(lambda: rehydrate_engine.status().last_report.reason == "snapshot-deadline",
             30, what="the snapshot deadline's report")
    last = rehydrate_engine.status().last_report
    assert (last.reason, last.kind, last.frozen_for) == ("snapshot-deadline", "resume", 0.0)
    fake.now += 0.1
    assert clock.due() == 3 and clock.jumps == 0
    # A real restore afterwards still rebases.
    assert rehydrate_engine.simulate_restore().ok
    fake.now += 0.1
    assert clock.due() == 2 and clock.jumps == 1


def test_hook_goes_away_with_the_clock(rehydrate_engine):
    import gc

    clock = TickClock(20, engine=rehydrate_engine)
    assert any(h.name == "rehydrate.gameloop.tick_clock"
               for h in rehydrate_engine.hooks("restore"))
    del clock
    gc.collect()
    assert not any(h.name == "rehydrate.gameloop.tick_clock"
                   for h in rehydrate_engine.hooks("restore"))


def test_alpha_and_until_next():
    fake = FakeClock()
    clock = _clock(fake, 10, 0, 0.25)
    fake.now += 0.25
    assert clock.due() == 2
    assert clock.alpha == pytest.approx(0.5)
    assert clock.until_next() == pytest.approx(0.05)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rate_hz": 0}, "rate_hz"),
    ({"rate_hz": float("nan")}, "rate_hz"),
    ({"rate_hz": 30, "max_catch_up": -1}, "max_catch_up"),
    ({"rate_hz": 30, "max_catch_up": 1.5}, "max_catch_up"),
    ({"rate_hz": 30, "max_frame": 0}, "max_frame"),
    ({"rate_hz": 30, "max_frame": float("nan")}, "max_frame"),
    ({"rate_hz": 30, "max_frame": float("inf")}, "max_frame"),  # 108,000 ticks in a burst
    ({"rate_hz": True}, "rate_hz"),
    ({"rate_hz": 1e300}, "rate_hz"),  # due() raised OverflowError
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TickClock(**kwargs, rebase_on_restore=False)


def test_numpy_numbers_are_numbers():
    """A rate read from a config array is a NumPy scalar: it was refused as "must be a
    number > 0 …, not np.int64(30)"."""
    import numpy as np

    fake = FakeClock()
    clock = TickClock(np.int64(30), max_catch_up=np.int64(2), max_frame=np.float32(0.25),
                      clock=fake, rebase_on_restore=False)
    assert (clock.rate_hz, clock.max_catch_up) == (30.0, 2)
    assert type(clock.max_catch_up) is int and type(clock.rate_hz) is float
    fake.now += 0.1
    assert clock.due() == 3
    fake.now += 60.0
    assert clock.due() == 2
