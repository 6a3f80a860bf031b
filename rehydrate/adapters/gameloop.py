"""A fixed-step game clock that never replays the time a process spent frozen.

The accumulator of Glenn Fiedler's "Fix Your Timestep!": the simulation advances in
ticks of exactly ``1 / rate_hz`` seconds, and each frame the loop asks :meth:`TickClock.due`
how many ticks to run now. Fiedler clamps a long frame (0.25 s) to avoid the "spiral of
death"; after a snapshot restore the unclamped frame is the snapshot's *age* — seconds or
days, since ``CLOCK_MONOTONIC`` includes the time frozen — and a naive loop would run
thousands of ticks in a burst. :class:`TickClock` instead runs at most ``max_catch_up``
ticks for such a frame and records the seconds it dropped in :attr:`TickClock.last_jump`,
so the game can resynchronise its clients instead::

    clock = TickClock(30, max_catch_up=2)
    while running:
        for _ in range(clock.due()):
            world.step(clock.dt)
        if clock.last_jump:
            world.resync_clients(skipped=clock.last_jump)
        render(alpha=clock.alpha)
        await asyncio.sleep(clock.until_next())

The clock also rebases itself when the rehydrate engine runs a restore (or resume): the
next :meth:`~TickClock.due` is treated as a jump even when the frame looked short — on
platforms whose monotonic clock does not include the time frozen, or when the loop was
not running across the freeze. When the loop already took a jump since the previous
snapshot or restore event, no more than :data:`SAW_FREEZE_WINDOW` seconds before the
restore's hooks began (it saw the freeze first), the restore does not add a second one; an
older jump (a level load) does not count. A resume run that followed no freeze
(``RestoreContext.frozen_for == 0``: the before-snapshot hooks failed, the checkpoint was
aborted before it began, or the snapshot deadline passed) does not rebase either: the
loop ran on throughout, and a jump would only drop a frame and resync every client for
nothing. When the engine cannot tell (``frozen_for`` is ``None``), it rebases.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
import weakref
from collections.abc import Callable

from rehydrate import Phase, RestoreContext
from rehydrate.extensions import (
    BEFORE_USER_HOOKS,
    Engine,
    fresh_lock_after_fork,
    resolve_engine,
    shown,
)

__all__ = ["TickClock"]

# Float products like 0.3 * 10 land a hair below the integer they mean.
_EPSILON = 1e-9
_MAX_RATE = 1e6  # ticks per second; far above any game, far below float overflow
_MAX_FRAME = 3600.0  # a longer "normal" frame would replay hours of ticks in one burst
SAW_FREEZE_WINDOW = 5.0
"""A jump the loop took at most this many seconds before a restore's hooks began is taken
to be the loop seeing that restore's freeze (the run begins within moments of the resume,
however the restore is noticed); an older one — a level load — is not."""


def _number(value: object, high: float, rule: str) -> float:
    """``value`` as a float in (0, ``high``], else ``ValueError`` "``rule``, not …".
    ``numbers.Real``: NumPy's scalars (a rate from a config array) are numbers too; a
    bool is not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{rule}, not {shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # 10**400: float() raised this, naming no parameter
        number = math.inf
    if not 0 < number <= high:
        raise ValueError(f"{rule}, not {shown(value)}")
    return number


def _count(value: object, rule: str) -> int:
    """``value`` as an int >= 0 (a NumPy integer too, a bool not), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ValueError(f"{rule}, not {shown(value)}")
    return int(value)


class TickClock:
    """A fixed-step clock: :meth:`due` says how many ticks of ``1 / rate_hz`` s to simulate.

    ``max_catch_up``: the most ticks one call returns after a jump (a frame longer than
    ``max_frame`` seconds, or the first call after a restore); the rest of the owed time is
    dropped and reported in :attr:`last_jump`. ``clock``: seconds, never decreasing in
    normal operation (a step backwards owes nothing). ``engine``: the rehydrate engine
    whose restore events rebase the clock (default: the process-wide one);
    ``rebase_on_restore=False`` attaches to none.

    Thread-safe: the game loop calls :meth:`due` while a restore hook may call
    :meth:`rebase` from the engine's thread.
    """

    def __init__(
        self,
        rate_hz: float,
        *,
        max_catch_up: int = 0,
        max_frame: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        engine: Engine | None = None,
        rebase_on_restore: bool = True,
    ) -> None:
        self.rate_hz = _number(rate_hz, _MAX_RATE, "rate_hz must be a number > 0 and at "
                               f"most {_MAX_RATE:g}")  # refuses NaN
        catch_up = _count(max_catch_up, "max_catch_up must be an int >= 0")
        max_frame = _number(max_frame, _MAX_FRAME, "max_frame must be a number of seconds "
                            f"> 0 and at most {_MAX_FRAME:g}")  # refuses NaN and infinity
        self.dt = 1.0 / self.rate_hz
        """Seconds per tick."""
        self.max_catch_up = catch_up
        self.max_frame = float(max_frame)
        self._clock = clock
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        now = clock()
        self._last = now
        self._origin = now  # tick 0 of the current epoch
        self._issued = 0  # ticks returned since _origin
        self._rebase = False
        self.last_jump = 0.0
        """Seconds the latest :meth:`due` call dropped (0.0 when it dropped nothing)."""
        self.ticks = 0
        """Ticks returned so far."""
        self.jumps = 0
        """Calls that were treated as a jump."""
        self.dropped = 0.0
        """Seconds dropped by all jumps so far."""
        self._jumps_mark = 0  # jumps at the latest snapshot or restore event
        self._last_jump_at = -math.inf
        if rebase_on_restore:
            self._attach(resolve_engine(engine))

    def _attach(self, engine: Engine) -> None:
        ref = weakref.ref(self)

        def rebase_tick_clock(ctx: RestoreContext) -> None:
            clock = ref()
            if clock is not None:
                # frozen_for 0: a carry-on resume, nothing froze (None: not known, rebase).
                clock._on_event(restore=ctx.frozen_for != 0)

        def mark_tick_clock() -> None:
            clock = ref()
            if clock is not None:
                clock._on_event(restore=False)

        # Among the first hooks of a restore run: whether the loop already saw the freeze is
        # judged as the run begins, not after the earlier phases — a reconnect in the
        # CONNECTIONS phase may take up to its deadline (30 s), which would age the
        # loop's own jump past SAW_FREEZE_WINDOW and make a second one. The application's
        # hooks (and everything else) then see a rebased clock.
        b = engine.builtins
        hooks = (
            b.register(rebase_tick_clock, phase=Phase.ENVIRONMENT, order=BEFORE_USER_HOOKS,
                       timeout=5.0, name="rehydrate.gameloop.tick_clock"),
            b.register(mark_tick_clock, event="snapshot", phase=Phase.APPLICATION,
                       order=-1_000_000, timeout=5.0, name="rehydrate.gameloop.tick_clock"),
        )
        for hook in hooks:
            weakref.finalize(self, b.unregister, hook)

    def _on_event(self, *, restore: bool) -> None:
        """Rebase on a restore (``restore``: an event that followed a freeze, or may have)
        — unless the loop already took a jump since the previous snapshot or restore event
        (it saw the freeze first: one resync is enough). Any event starts a new count."""
        with self._lock:
            saw_it = (self.jumps != self._jumps_mark
                      and self._clock() - self._last_jump_at <= SAW_FREEZE_WINDOW)
            if restore and not saw_it:
                self._rebase = True
            self._jumps_mark = self.jumps

    def due(self) -> int:
        """The number of ticks to simulate now (0 or more)."""
        with self._lock:
            now = self._clock()
            elapsed = now - self._last
            self._last = now
            if elapsed < 0:  # the clock stepped back: nothing is owed, restart the phase
                self._origin, self._issued = now, 0
                self.last_jump = 0.0
                return 0
            owed = max(0, math.floor((now - self._origin) * self.rate_hz + _EPSILON)
                       - self._issued)
            if elapsed > self.max_frame or self._rebase:
                n = min(owed, self.max_catch_up)
                # Everything owed beyond those n ticks, including the partial tick.
                jump = max(0.0, (now - self._origin) - (self._issued + n) * self.dt)
                self._origin, self._issued = now, 0
                self._rebase = False
                self.last_jump = jump
                self._last_jump_at = now
                self.jumps += 1
                self.dropped += jump
            else:
                n = owed
                self._issued += n
                self.last_jump = 0.0
            self.ticks += n
            return n

    def rebase(self) -> None:
        """Treat the next :meth:`due` call as a jump (done on every rehydrate restore or
        resume that followed a freeze, or may have)."""
        with self._lock:
            self._rebase = True

    @property
    def alpha(self) -> float:
        """How far (0 ≤ alpha < 1) the latest call is into the next tick: for rendering
        interpolated between the last two simulated states."""
        with self._lock:
            frac = (self._last - self._origin) * self.rate_hz - self._issued
        return min(max(frac, 0.0), 1.0 - _EPSILON)

    def until_next(self) -> float:
        """Seconds from the latest :meth:`due` call until the next tick is due."""
        return (1.0 - self.alpha) * self.dt

    def __repr__(self) -> str:
        return (f"TickClock({self.rate_hz:g} Hz, max_catch_up={self.max_catch_up}, "
                f"max_frame={self.max_frame:g}, ticks={self.ticks}, jumps={self.jumps})")
