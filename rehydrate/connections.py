"""Managed external connections: closed before a snapshot, reopened concurrently after.

A restore (or a resume of the original process after a snapshot) finds every outbound TCP
connection already terminated by the platform. Connections registered here are closed
before a snapshot (reverse registration order, ``CONNECTIONS`` phase) and, after a
restore or resume, reopened **all at once**: each one by the same retry loop, a task on
the hook's event loop (``async`` functions are awaited there, sync ones run on a fresh
thread, a sync ``open`` and ``check`` together), with exponential backoff with jitter,
until it succeeds or its deadline passes. A stale connection's ``close`` gets at most
:data:`CLOSE_TIMEOUT` or half the deadline; a hung one is abandoned and named in the
error. The restore run returns only when every *required* connection reopened or missed
its deadline; one that missed it makes the report fail (the process stays ``degraded``,
not ready) and the error names the connection and its last error. *Optional* ones
(``required=False``) reopen in the background, bounded by their own deadline: they never
hold the run or readiness (outcome in ``status()``, a failure logged once); a snapshot
stops such a reopen before closing them, and ``engine.close()`` closes one it stops.

Only what may be open is closed: a ``close`` that takes the value is not called without
one (never opened, every open failed). An ``async`` close runs on the event loop its
value was opened on; once that loop is closed it is tried on the hooks' loop, bounded,
and if it fails there the value is dropped with one warning, the connection counting as
closed (see ``Connection._drop``); while that loop is only stopped the close is left to
run there when the application runs it again (``Connection._close_later``).

Registration never blocks on, nor raises for, an unreachable peer.

Ready-made helpers (their libraries are imported only when a helper is used):
:func:`httpx_client`, :func:`httpx_async_client`, :func:`sqlalchemy_engine`,
:func:`redis_client`, :func:`grpc_channel`, :func:`tcp_socket`.

``established_tcp()`` lists the process's established TCP connections (from
``/proc/<pid>/net/tcp{,6}`` and the socket inodes of ``/proc/<pid>/fd``) so that
connections opened outside rehydrate, which it cannot reach, can at least be seen.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
import math
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from . import _backoff, _config, _dns
from ._context import RestoreContext
from ._hooks import Phase
from ._loop_roles import is_blocked
from ._loops import LoopClosed, LoopStopped, run_quietly
from ._redact import describe_scrubbed
from ._runner import _submit
from ._threads import fresh_lock_after_fork
from ._urls import without_credentials
from .extensions import Probe, resolve_engine

if TYPE_CHECKING:
    from .extensions import Engine

__all__ = [
    "DEFAULT_DEADLINE",
    "Connection",
    "ConnectionManager",
    "ConnectionsNotReady",
    "ManagedSocket",
    "TcpConnection",
    "connections",
    "established_tcp",
    "get",
    "grpc_channel",
    "httpx_async_client",
    "httpx_client",
    "manager",
    "redis_client",
    "register",
    "sqlalchemy_engine",
    "tcp_socket",
    "unregister",
]

log = logging.getLogger("rehydrate")

DEFAULT_DEADLINE: float = _config.default("REHYDRATE_CONNECT_DEADLINE")
"""Seconds a connection may take to reopen after a restore (``REHYDRATE_CONNECT_DEADLINE``)."""
BACKOFF_BASE = 0.05
BACKOFF_MAX = 1.0
CLOSE_TIMEOUT = 5.0
"""Seconds one ``close`` may take before a snapshot before it is reported as failed."""
LATE_GRACE = 0.25
"""Seconds past its deadline an attempt still running is given before it is abandoned."""
RUN_DEADLINE_MARGIN = 2 * LATE_GRACE
"""Seconds before a restore run's deadline (``RestoreContext.deadline``) at which the
connections' own deadlines end: the hook then reports which connections missed it."""

State = Literal["registered", "opening", "open", "closing", "closed", "reconnecting", "failed"]


class ConnectionsNotReady(ConnectionError):
    """Required connections did not reopen (or close) in time; the message names them."""

    def __init__(self, message: str, names: Iterable[str]) -> None:
        super().__init__(message)
        self.names = tuple(names)


def _arity(fn: Callable[..., Any]) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0
    n = 0
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            return 1
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty:
            n += 1
    return n


def _required_args(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` cannot be called without (0 when unknown)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               and p.default is p.empty for p in params)


def _is_async(fn: Callable[..., Any] | None) -> bool:
    if fn is None:
        return False
    call = getattr(fn, "__call__", None)  # noqa: B004
    return inspect.iscoroutinefunction(fn) or (
        call is not None and inspect.iscoroutinefunction(call)
    )


_describe = describe_scrubbed
"""``"Type: message"`` on one line: how a connection's error is shown (its ``last_error``
in ``status()``, log lines, the restore's failure); see :func:`describe_scrubbed`."""


def backoff_delay(attempt: int, base: float = BACKOFF_BASE, cap: float = BACKOFF_MAX) -> float:
    """Exponential backoff with jitter for retry ``attempt`` (1-based): in [d/2, d]."""
    return _backoff.backoff_delay(attempt - 1, base, cap)


def env_deadline() -> float:
    """``REHYDRATE_CONNECT_DEADLINE`` in seconds, else :data:`DEFAULT_DEADLINE`."""
    return _config.number("REHYDRATE_CONNECT_DEADLINE")


class Connection:
    """One managed connection. Returned by :func:`register`; ``value`` is what ``open``
    last returned (when it returned something)."""

    def __init__(  # noqa: PLR0917
        self,
        name: str,
        open: Callable[..., Any] | None,
        close: Callable[..., Any] | None,
        check: Callable[..., Any] | None,
        required: bool,
        deadline: float | None,
        value: Any = None,
    ) -> None:
        if deadline is not None:
            deadline = _config.seconds(deadline, f"connection {name!r}: deadline")
        # Checked here: a function of the wrong shape failed with a TypeError at every
        # attempt until the deadline, at every restore.
        for label, fn, most in (("open", open, 0), ("close", close, 1), ("check", check, 1)):
            if fn is None:
                continue
            if not callable(fn):
                raise TypeError(f"connection {name!r}: {label} must be callable")
            needs = _required_args(fn)
            if needs > most:
                takes = "no argument" if most == 0 else "at most one argument (the value)"
                raise TypeError(f"connection {name!r}: {label} is called with {takes}, but "
                                f"{getattr(fn, '__qualname__', fn)!r} requires {needs}")
        self.name = name
        self.open_fn = open
        self.close_fn = close
        self.check_fn = check
        self.required = bool(required)
        self.deadline = deadline
        self.value = value
        self.state: State = "registered"
        self.last_error: str | None = None
        self.attempts = 0
        self.last_duration: float | None = None
        self._lock = threading.Lock()
        # registered or not (unregistered, replaced): a helper's object may still use it
        fresh_lock_after_fork(self)
        self._epoch = 0
        """Bumped by every reopen/close run: an abandoned attempt sees it is stale."""
        self.step: str | None = None
        """What the current run is doing (named when it is still running at the deadline)."""
        self.deadline_at: float | None = None
        """``time.monotonic()`` by which the current reopen run must be done (an ``open``
        that blocks, such as :func:`tcp_socket`'s connect, caps its timeout with it)."""
        self.peers: tuple[str, ...] = ()
        """``host:port`` of the peer(s), when known (helpers fill it in, ``register(peers=)``
        for your own): ``rehydrate doctor --connections`` marks sockets to them managed."""
        self._sockets: Callable[[], Iterable[socket.socket]] | None = None
        """The sockets this connection holds, when rehydrate holds them itself (a
        :func:`tcp_socket`): ``doctor --connections`` then marks those sockets, not every
        socket to the same peer. None: not known (a client's own pool), peers it is."""
        self._on_replaced: Callable[[], None] | None = None
        """What a ``replace=True`` registration of the same name does instead of running
        ``close``: close for good the object a helper made and handed out (a
        ``ManagedChannel``, an httpx client, a ``ManagedSocket``). Quick, never blocks."""
        self._subject: object = None
        """The caller's own object a helper manages (a SQLAlchemy engine, a redis
        client); for :func:`register`, ``value``. Registered again with ``replace=True``
        it is handed over, not closed."""
        self._resource: Callable[[], object] | None = None
        """What ``close`` acts on, when that is not the subject itself but something
        other objects can share (a redis client's ``connection_pool``, a SQLAlchemy
        engine's ``pool``), read when a ``replace=True`` registration compares: a new
        registration over the same one is a handover too, since closing it would cut
        the new object's connections."""
        self._replaced_close: threading.Thread | concurrent.futures.Future[None] | None = None
        """The background ``close`` a ``replace=True`` registration started (tests wait
        for it): a thread for a sync ``close``, the future of the one scheduled on the
        hooks' event loop for an async one."""
        self._released = False
        """``value`` was closed by rehydrate and no ``open`` or successful reopen run has
        given it back since (a ``close`` that takes the value: see :meth:`_holds`)."""
        self._calls: set[concurrent.futures.Future[Any]] = set()
        """Calls of the user's sync functions running on a thread right now (a cancelled
        run abandons them; a snapshot waits for a background reopen's, see
        :meth:`ConnectionManager._settle`)."""
        self._background: _Background | None = None
        """The reopen of an optional connection that a restore run left going."""
        self._opener: _Opener | None = None
        """The thread running the first open of an ``open_now`` registration with a sync
        ``open`` (None once that open has stopped)."""
        self._given_up: int | None = None
        """The epoch of a run abandoned at its deadline (see :meth:`_keep`)."""
        self._waits: set[threading.Event | _LoopEvent] = set()
        """Events of :meth:`_watch`, set when the run they belong to ends."""
        self._closing: concurrent.futures.Future[None] | None = None
        """Done when the background close of a (re)open the engine's close stopped has
        ended (tests wait for it)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The event loop the ``async`` open that made ``value`` ran on (None after a
        sync one): an ``async`` close is awaited there (see :meth:`_close_loop`), left
        there while it is stopped, tried elsewhere once it is closed (see
        :meth:`close_async`)."""
        self._any_loop = False
        """The ``async`` close finds the loop what it closes belongs to by itself (the
        helpers' for ``httpx.AsyncClient`` and ``redis.asyncio``), and does what can be
        done when that loop has stopped: called from any loop (it raises
        :class:`~rehydrate._loops.LoopClosed` for what it cannot close)."""
        self._dropped = False
        """``value`` was let go of unclosed (see :meth:`_drop`); until an open replaces it."""
        self._pending: tuple[Any, concurrent.futures.Future[None], Coroutine[Any, Any, None],
                             asyncio.AbstractEventLoop] | None = None
        """A close scheduled on the value's stopped event loop, not run yet (see
        :meth:`_close_later`): the value it closes, its future, its coroutine and that
        loop."""
        self._opens = 0
        """Bumped by every open kept (see :meth:`_keep`)."""
        self._ended = False
        """The engine closed it: no run comes after (see :meth:`_disposes`)."""
        self._in_flight: tuple[Any, concurrent.futures.Future[None]] | None = None
        """The value a ``close`` call is closing right now, and a future done (with its
        outcome) when that call has really returned: a second close of the same value
        waits for it instead of closing it again at the same time."""

    def _watch(self, epoch: int) -> threading.Event:
        """An event set when run ``epoch`` is no longer :meth:`_live` (already set if it
        is not): a wait of its own (:func:`tcp_socket`'s name lookup) ends then rather
        than hold a snapshot, which waits for a background open's call, or a thread."""
        ended = threading.Event()
        self._add_watch(epoch, ended)
        return ended

    def _watch_here(self, epoch: int) -> _LoopEvent:
        """:meth:`_watch` for a wait on the running event loop."""
        ended = _LoopEvent(asyncio.get_running_loop())
        self._add_watch(epoch, ended)
        return ended

    def _add_watch(self, epoch: int, ended: threading.Event | _LoopEvent) -> None:
        with self._lock:
            if epoch != self._epoch or epoch == self._given_up:
                ended.set()
            else:
                self._waits.add(ended)

    def _unwatch(self, ended: threading.Event | _LoopEvent) -> None:
        with self._lock:
            self._waits.discard(ended)

    def _wake_waits(self) -> None:
        """The current run just ended (under ``_lock``): wake what :meth:`_watch` gave."""
        for ended in self._waits:
            ended.set()
        self._waits.clear()

    def _closes(self) -> object:
        """What closing this registration would close (see ``_resource``)."""
        if self._resource is not None:
            try:  # a wrapper or double without the attribute: the subject stands for it
                shared = self._resource()
            except Exception:  # any failure means "not known"
                shared = None
            if shared is not None:
                return shared
        return self._subject if self._subject is not None else self.value

    def effective_deadline(self) -> float:
        return self.deadline if self.deadline is not None else env_deadline()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "required": self.required,
            "deadline": self.effective_deadline(),
            "attempts": self.attempts,
            "last_error": self.last_error,
            "duration": None if self.last_duration is None else round(self.last_duration, 6),
            "peers": list(self.peers),
            "sockets": None if self._sockets is None else [
                ident for sock in self._sockets() if (ident := _socket_ident(sock))],
        }

    def __repr__(self) -> str:
        return f"<rehydrate.Connection {self.name!r} {self.state}>"

    # -- calling the user's functions -------------------------------------------------

    def _args(self, fn: Callable[..., Any]) -> tuple[Any, ...]:
        return (self.value,) if _arity(fn) >= 1 else ()

    def _holds(self) -> bool:
        """Whether ``close`` may have something open to close. A ``close`` that takes the
        value has nothing when there is no value (never opened, its opens failed or
        returned nothing) — ``close(None)`` failed every snapshot of a connection
        registered without ``open_now`` — and nothing new when rehydrate already closed
        that value and nothing opened since. One that takes no argument closes what it
        knows of itself (a helper's pool, your own closure): always called."""
        if self.close_fn is None:
            return False
        if _arity(self.close_fn) == 0:
            return True
        with self._lock:
            return self.value is not None and not self._released

    def _set(self, epoch: int, **fields: Any) -> bool:
        with self._lock:
            if epoch != self._epoch:
                return False
            for k, v in fields.items():
                setattr(self, k, v)
            return True

    def _current(self, epoch: int) -> bool:
        with self._lock:
            return epoch == self._epoch

    def _live(self, epoch: int) -> bool:
        """Whether what run ``epoch``'s ``open`` returns now is kept: no newer run (a
        snapshot, a restore, unregister(), the engine's close) took over and its deadline
        did not give up on it."""
        with self._lock:
            return epoch == self._epoch and epoch != self._given_up

    def _keep(self, epoch: int, value: Any,
              loop: asyncio.AbstractEventLoop | None = None) -> bool:
        """Put what run ``epoch``'s ``open`` returned in place, in one step with the
        check that the run is still :meth:`_live` (an open finishing late on its thread
        otherwise installed its object after a close, or under a ``failed`` state).
        ``None`` leaves the previous value: a close that takes the value would only
        close that stale one again. ``loop``: the one an ``async`` open ran on."""
        with self._lock:
            if epoch != self._epoch or epoch == self._given_up:
                return False
            if value is not None:
                self.value, self._released, self._loop = value, False, loop
                self._dropped = False
            elif loop is not None:  # a close without argument closes what it made there
                self._loop, self._dropped = loop, False
            self._opens += 1
            return True

    def _close_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop an ``async`` close must be awaited on: the one the ``async``
        open that made the value ran on, while it runs. What such an open makes (asyncio
        streams, an asyncpg or aiohttp pool) belongs to that loop: closed from another it
        failed with "attached to a different loop" (or "Event loop is closed"), touched
        its transport from a foreign thread and left the socket open. None: any loop,
        also when that loop's thread is waiting for the lifecycle event this close is
        part of (``simulate_snapshot()`` called on it): submitted there, the close only
        started once the event had given up on it, after ``CLOSE_TIMEOUT``."""
        loop = self._loop
        if (not _is_async(self.close_fn) or loop is None or loop.is_closed()
                or not loop.is_running() or is_blocked(loop)):
            return None
        return loop

    def _retire(self) -> tuple[int, State]:
        """No longer managed: a run still in progress (a background open) stops.
        Returns the new epoch (no run has it) and the state the stopped run left."""
        with self._lock:
            self._epoch += 1
            self._wake_waits()
            return self._epoch, self.state

    def _go_on(self, epoch: int) -> int | None:
        """The epoch of a run going on where run ``epoch`` stopped (same state), or None
        when that one is no longer current."""
        with self._lock:
            if epoch != self._epoch:
                return None
            self._epoch += 1
            self._wake_waits()
            return self._epoch

    def _begin(self, state: State) -> tuple[int, State]:
        """Start a new run (older runs become stale); returns (epoch, previous state)."""
        with self._lock:
            self._epoch += 1
            self._wake_waits()
            self.step = None
            # an earlier run's error (and its "still running at the deadline" note) is not
            # this one's: kept, it was reported again, and grew, at every later restore
            self.last_error = None
            self._ended = False  # the engine is in use again
            prev, self.state = self.state, state
            return self._epoch, prev

    # the retry loop (one for sync and async functions) --------------------------------

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Await ``fn``: a coroutine function on this loop, a sync one on its own thread."""
        if _is_async(fn):
            return await _guarded_async(fn, *args)
        return await self._on_thread(_guarded, fn, *args)

    async def _on_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """:func:`_in_thread`, the call kept in ``_calls`` until it has really returned
        (cancelling the caller abandons it, and it goes on)."""
        return await asyncio.wrap_future(self._start_on_thread(fn, *args))

    def _start_on_thread(self, fn: Callable[..., Any],
                         *args: Any) -> concurrent.futures.Future[Any]:
        from ._threads import blocking

        fut = blocking.submit(fn, *args)
        with self._lock:
            self._calls.add(fut)

        def ended(f: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                self._calls.discard(f)

        fut.add_done_callback(ended)
        return fut

    async def close_async(self, *, again: bool = True) -> concurrent.futures.Future[None] | None:
        """Call ``close``: a sync one on a thread, an async one on the loop the value was
        opened on (:meth:`_close_loop`). While a close of the same value is running (a
        background reopen's close after a failed attempt, still running on its thread
        when the engine's close came), this waits for it and shares its outcome: the
        value is closed once. ``again=False``: nothing to do either when that close has
        already returned (see :meth:`_holds`), checked in the same step.

        When the loop the value was opened on no longer runs (unless the close finds its
        loop itself, ``_any_loop``): *closed* (as ``asyncio.run`` leaves it), the close
        is tried here, bounded, and the value dropped with one warning if that fails
        (:meth:`_close_stranded`); only *stopped* (``run_until_complete`` between two
        calls), the close is scheduled there, to run once the application runs that loop
        again, and not waited for: the future of that call is returned
        (:meth:`_close_later`) — a helper's close raises
        :class:`~rehydrate._loops.LoopStopped` for that. A close so scheduled whose loop
        was closed since, unrun, is tried as on a closed loop (:meth:`_reclaim`). None
        otherwise, once the close has returned."""
        fn = self.close_fn
        if fn is None:
            return None
        self._reclaim()
        if _is_async(fn) and not self._any_loop:
            with self._lock:
                opened_on = self._loop
            if opened_on is not None and not opened_on.is_closed() and (
                    not opened_on.is_running()):
                later = self._close_later(opened_on, fn, again)
                if later is not None or not opened_on.is_closed():
                    return later
            if opened_on is not None and opened_on.is_closed():
                await self._close_stranded(fn, again)
                return None
        try:
            await self._close(fn, again)
        except LoopClosed as exc:  # a helper's close: its pool's loop is closed
            self._drop(str(exc))
        except LoopStopped as exc:  # a helper's close: its pool's loop is only stopped
            if exc.dropped is not None:
                self._drop(exc.dropped)
            return self._close_later(exc.loop, exc.close or fn, again)
        return None

    async def _close(self, fn: Callable[..., Any], again: bool, *,
                     where: str | None = None) -> None:
        """Call ``close`` (see :meth:`close_async`); ``where``: the loop to await an async
        one on is this one, and a failure is raised as it is (:meth:`_close_stranded`)."""
        with self._lock:
            value, running = self.value, self._in_flight
            if not again and _arity(fn) >= 1 and (value is None or self._released):
                return
            if running is not None and running[0] is value:
                waiting: concurrent.futures.Future[None] | None = running[1]
            else:
                waiting = None
                ended: concurrent.futures.Future[None] = concurrent.futures.Future()
                ended.set_running_or_notify_cancel()  # a waiter's cancel leaves it be
                self._in_flight = (value, ended)
        if waiting is not None:
            await asyncio.wrap_future(waiting)
            return
        args = self._args(fn)

        def finish(exc: BaseException | None) -> None:
            with self._lock:
                if self._in_flight is not None and self._in_flight[1] is ended:
                    self._in_flight = None
                if exc is None and self.value is value:  # not replaced by an open since
                    self._released = True
            if exc is None:
                ended.set_result(None)
            else:
                ended.set_exception(exc)

        def returned(call: concurrent.futures.Future[Any] | asyncio.Future[Any]) -> None:
            finish(RuntimeError("stopped before it returned") if call.cancelled()
                   else call.exception())

        started = False
        try:
            if not _is_async(fn):
                call: concurrent.futures.Future[Any] = self._start_on_thread(_guarded, fn, *args)
                call.add_done_callback(returned)
                started = True
                await asyncio.wrap_future(call)
                return
            home, opened_on = (None, None) if where else (self._close_loop(), self._loop)
            if home is None or home is asyncio.get_running_loop():
                task = asyncio.ensure_future(_guarded_async(fn, *args))
                task.add_done_callback(returned)
                started = True
                try:
                    await task
                except Exception as exc:
                    if home is None and opened_on is not None:
                        # one line, not the Task repr of "attached to a different loop"
                        why = ("is waiting for this lifecycle event (started on its "
                               "thread)" if is_blocked(opened_on) else "has stopped")
                        raise RuntimeError(
                            f"the event loop it was opened on {why}; close() failed "
                            f"on another: {_describe(exc)}") from None
                    raise
                return
            call = _submit(home, lambda: _guarded_async(fn, *args))
            call.add_done_callback(returned)
            started = True
            await asyncio.wrap_future(call)
        except BaseException as exc:
            if not started:  # no call to report its end: this is it
                finish(exc)
            raise

    async def _close_stranded(self, fn: Callable[..., Any], again: bool) -> None:
        """Try an ``async`` close whose value's event loop is closed (``asyncio.run``
        returned) here, on the loop the hooks run on. One that does not touch that loop
        (a plain socket, ``await asyncio.to_thread(sock.close)``) closes the connection;
        one that does (asyncio streams, an asyncpg or aiohttp pool) fails at once
        ("Event loop is closed", "attached to a different loop") or waits for good: it
        is given :data:`CLOSE_TIMEOUT` less :data:`LATE_GRACE` (at least half of it: so
        that it ends before the caller's own bound), then the value is dropped
        (:meth:`_drop`). Never raises: that value cannot hold up a snapshot."""
        with self._lock:
            if self._dropped:
                return  # let go of already; it stays so until an open replaces it
        limit = max(CLOSE_TIMEOUT / 2, CLOSE_TIMEOUT - LATE_GRACE)
        why = "the event loop it was opened on is closed and its async close() "
        try:
            await asyncio.wait_for(self._close(fn, again, where="here"), limit)
        except asyncio.TimeoutError:
            self._drop(f"{why}did not return on another within {limit:g}s")
        except Exception as exc:
            self._drop(f"{why}failed on another: {_describe(exc)}")

    def _close_later(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any],
                     again: bool) -> concurrent.futures.Future[None] | None:
        """Schedule an ``async`` close on ``loop``, the stopped (not closed) loop the value
        was opened on: a loop driven by ``run_until_complete`` between two calls. Its
        selector holds the value's transports, so nothing else releases them (not the
        garbage collector) until the application runs that loop again — which runs this
        close after whatever the application runs first there (a helper's close takes
        what it closes out of the application's reach before raising ``LoopStopped``) —
        or closes it (the close is then closed unrun, and :meth:`_unrun` told:
        :func:`~rehydrate._loops.run_quietly`). Returns the call's future, not waited for
        (the same one while it is pending for the same value); the value counts as
        released, so a restore opens a new one rather than wait. None: nothing to close
        (``again=False``), or ``loop`` was closed in between. A close without argument is
        not run if an open succeeded since: it would close what that open made; nor is one
        with the value, when that open returned that same object again (a long-lived
        client reconnected: its ``open`` is what closes the socket it held before)."""
        takes_value = _arity(fn) >= 1
        with self._lock:
            value, pending, opens = self.value, self._pending, self._opens
            if pending is not None and pending[0] is value and not pending[1].done():
                return pending[1]
            if not again and takes_value and (value is None or self._released):
                return None
        args = (value,) if takes_value else ()

        async def later() -> None:
            with self._lock:
                # an open since replaced what this closes — or reopened the same object
                # (a long-lived client reconnected): closing it would cut the new one
                stale = self._opens != opens and (not takes_value or self.value is value)
            if stale:
                log.info("connection %s: its close() scheduled on its stopped event loop "
                         "did not run: opened again since", self.name)
                return
            await _guarded_async(fn, *args)

        coro = later()
        try:
            fut: concurrent.futures.Future[None] = run_quietly(
                loop, coro, on_unrun=lambda: self._unrun(coro))
        except RuntimeError:  # closed in between (run_quietly closed the coroutine)
            return None
        with self._lock:
            self._pending = (value, fut, coro, loop)
            if takes_value and self.value is value:
                self._released = True
        log.info("connection %s: its event loop is stopped: close() scheduled there, to "
                 "run when the application runs that loop again", self.name)
        return fut

    def _unrun(self, coro: Coroutine[Any, Any, None]) -> None:
        """The close :meth:`_close_later` scheduled (``coro``) was closed before it ended:
        the application closed that loop without running it again, or ran it only long
        enough to start it (its task destroyed pending). After the engine's close
        (which did not wait for it), nothing comes to :meth:`_reclaim` it: the value is
        let go of with the one warning and a ``closing`` connection says ``closed``,
        instead of staying ``closing`` in silence. Before it, left to :meth:`_reclaim`.
        Called by whatever dropped that close (see :func:`~rehydrate._loops.run_quietly`):
        any thread, a garbage collection while this thread holds the lock (then left to
        :meth:`_reclaim`), the interpreter's shutdown."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            pending = self._pending
            if pending is None or pending[2] is not coro:
                return  # reclaimed already, or another close took its place
            if not self._ended:
                # the next restore or engine.close() reclaims it, trying the close
                # again as for a closed loop: one that needs no loop still closes it
                return
            self._pending = None
            if pending[0] is self.value:
                self._released = self._dropped = True
            if self.state == "closing":
                self.state, self.step = "closed", None
        finally:
            self._lock.release()
        log.warning("connection %s: not closed: the event loop it was opened on was "
                    "closed before the close scheduled there ran; dropped", self.name)

    def _reclaim(self) -> bool:
        """The close :meth:`_close_later` scheduled will never run: the application closed
        that loop without running it again. Without this the value stayed ``closing``
        for good, counted as released (so no later close tried it), its socket open, and
        the coroutine was reported "never awaited". The coroutine is closed; the value,
        if still the current one, counts as not closed again, so that the caller's close
        goes through :meth:`_close_stranded` (or a helper's ``LoopClosed``) and, failing
        that, :meth:`_drop` (one warning); one an open replaced since is let go of with
        the same warning. True when there was such a close."""
        with self._lock:
            pending = self._pending
            if pending is None or pending[1].done() or not pending[3].is_closed():
                return False
            self._pending = None
            current = pending[0] is self.value
            if current and not self._dropped:
                self._released = False
        coro = pending[2]
        # Only one its loop never started: one that did is suspended in its Task, and
        # closing it runs the application's cleanup (a `finally`) against the closed
        # loop — "Event loop is closed" raised out of a restore and engine.close().
        if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            coro.close()
        if not current:
            log.warning("connection %s: not closed: the event loop it was opened on was "
                        "closed before the close scheduled there ran; dropped", self.name)
        return True

    def _closed_later(self, epoch: int, fut: concurrent.futures.Future[None]) -> None:
        """Run ``epoch`` (a snapshot's, the engine's close) left the close to
        :meth:`_close_later`: ``closing`` until it has run, then ``closed`` (``failed``,
        with one warning, if it failed) — unless a newer run took over meanwhile."""
        self._set(epoch, state="closing",
                  step="close (scheduled on its stopped event loop)")

        def ended(f: concurrent.futures.Future[None]) -> None:
            with self._lock:
                if self._pending is not None and self._pending[1] is f:
                    self._pending = None
            exc = RuntimeError("cancelled") if f.cancelled() else f.exception()
            if exc is None:
                self._set(epoch, state="closed", step=None)
            elif self._set(epoch, state="failed", step=None,
                           last_error=f"close() on its event loop failed: {_describe(exc)}"):
                log.warning("connection %s: close() on its event loop failed: %s",
                            self.name, _describe(exc))

        fut.add_done_callback(ended)

    def _drop(self, why: str) -> None:
        """Let go of a value whose ``async`` close cannot run: ``why`` says so (its event
        loop is closed and the close failed, or hung, on another; a helper's pool belongs
        to a closed loop). The value counts as closed (a snapshot goes on; what it holds
        is cut by the platform at a snapshot, released by the garbage collector), one
        WARNING names the connection — never the value — once, and the next restore
        opens a new value as after any close."""
        with self._lock:
            first = not self._released and not self._dropped
            self._released = self._dropped = True
        if first:
            log.warning("connection %s: not closed: %s; dropped (the next restore opens "
                        "it anew)", self.name, why)

    async def _release(self, epoch: int, what: str, limit: float,
                       after: str | None = None) -> None:
        """Best-effort close of a dead connection (the platform already cut it): a close
        still running after ``limit`` seconds is abandoned and recorded as hung (after
        ``after``, the error that made it necessary, which stays the one to read)."""
        self._set(epoch, step=what)
        try:
            await asyncio.wait_for(self.close_async(again=False), limit)
        except asyncio.TimeoutError:
            msg = f"{what} hung (no return within {limit:.2g}s)"
            self._set(epoch, last_error=f"{after} ({msg})" if after else msg)
            log.warning("connection %s: %s; reopening anyway", self.name, msg)
        except Exception as exc:
            log.debug("connection %s: %s: %s", self.name, what, _describe(exc))

    async def _attempt(self, epoch: int, call: Callable[..., Awaitable[Any]],
                       opened: list[bool]) -> None:
        """One ``open`` then ``check``, each called through ``call``. ``opened`` gets
        True when this attempt's ``open`` returned something ``close`` may release."""
        if self.open_fn is not None:
            self._set(epoch, step="open")
            if _is_async(self.open_fn):
                token = _RUN.set((self, epoch))
                try:
                    value = await call(self.open_fn)
                finally:
                    _RUN.reset(token)
                kept = self._keep(epoch, value, asyncio.get_running_loop())
                if not kept and self._disposes(value):
                    assert self.close_fn is not None
                    try:
                        await call(self.close_fn,
                                   *((value,) if _arity(self.close_fn) >= 1 else ()))
                    except Exception as exc:
                        log.debug("connection %s: closing a superseded open: %s",
                                  self.name, _describe(exc))
            else:
                # Kept or closed on the open's own thread, in the same call: awaited from
                # the loop, a call abandoned there (a snapshot, the engine's close, the
                # deadline) still ends on its thread, and what it returned was dropped.
                value, kept = await call(self._open_and_keep, epoch)
            if not kept:
                # A newer run (a snapshot, a restore) or unregister() took over while this
                # open ran, or its deadline gave up on it: what it opened is nobody's.
                raise _Superseded
            opened[0] = value is not None or (self.close_fn is not None
                                              and _arity(self.close_fn) == 0)
        if self.check_fn is not None:
            self._set(epoch, step="check")
            healthy = await call(self.check_fn, *self._args(self.check_fn))
            # a client's own health probe that answers rather than raises (elasticsearch's
            # ping(), a custom is_healthy()): False is "not healthy", not "returned"
            if healthy is False:
                raise ConnectionError("check() returned False")

    def _disposes(self, value: Any) -> bool:
        """Whether an open's ``value`` that no run keeps can be closed: by a ``close``
        that takes it. One without an argument closes what the connection holds now,
        perhaps a newer run's (a helper such as :func:`tcp_socket` discards its own), so
        it is called only once the engine has closed (no run ever comes after): an open
        still running on its thread at ``engine.close()`` then leaves nothing open."""
        if self.close_fn is None:
            return False
        if _arity(self.close_fn) >= 1:
            return value is not None
        with self._lock:
            return self._ended

    def _open_and_keep(self, epoch: int) -> tuple[Any, bool]:
        """Run a sync ``open`` for run ``epoch`` and :meth:`_keep` what it returns, or
        close it when the run is over (on this thread, which may have been abandoned)."""
        assert self.open_fn is not None
        token = _RUN.set((self, epoch))
        try:
            value = _guarded(self.open_fn)
        finally:
            _RUN.reset(token)
        if self._keep(epoch, value):
            return value, True
        if self._disposes(value):
            assert self.close_fn is not None
            args = (value,) if _arity(self.close_fn) >= 1 else ()
            try:
                if _is_async(self.close_fn):  # no loop runs here: one of its own
                    asyncio.run(_guarded_async(self.close_fn, *args))
                else:
                    _guarded(self.close_fn, *args)
            except Exception as exc:
                log.debug("connection %s: closing a superseded open: %s",
                          self.name, _describe(exc))
        return value, False

    async def reopen(self, epoch: int, deadline_at: float, close_first: bool = True) -> bool:
        """Close the stale connection (if still open), then open + check with backoff until
        both succeed or ``deadline_at`` passed (the first attempt always runs)."""
        start = time.monotonic()
        self._set(epoch, deadline_at=deadline_at)
        # a close left on a loop closed since: tried again (or dropped) now, not never
        if close_first and (self._reclaim() or self._holds()):
            # at most half the time left: a hung close must leave time to reopen
            await self._release(epoch, "close of the stale connection",
                                min(CLOSE_TIMEOUT, max(0.0, deadline_at - start) / 2))
        # Sync open and check run back to back on one thread: a hop through the event loop
        # between them waits for the GIL behind every other connection's thread.
        one_thread = not (_is_async(self.open_fn) or _is_async(self.check_fn))
        attempt = 0
        while self._current(epoch):
            attempt += 1
            self._set(epoch, attempts=attempt)
            opened = [False]
            try:
                if one_thread:
                    attempt_coro = self._attempt(epoch, _inline, opened)
                    try:
                        started = self._start_on_thread(_run_inline, attempt_coro)
                    except BaseException:
                        # No thread took it (the pids limit): never to run, and left
                        # unclosed it was a "never awaited" RuntimeWarning per retry.
                        attempt_coro.close()
                        raise
                    await asyncio.wrap_future(started)
                else:
                    await self._attempt(epoch, self._call, opened)
            except _Superseded:
                return False
            except Exception as exc:
                error = _describe(exc)
                self._set(epoch, last_error=error)
                # Only what this attempt's open() made (its check then failed): after a
                # failed open() the value is the stale one, already released, and its
                # close (a goodbye to a peer that is gone) may hang. Bounded like the
                # stale close, a hung one must leave time for the next attempts; past
                # the deadline a prompt close still gets the grace the guard allows.
                if opened[0] and self.close_fn is not None:
                    remaining = max(0.0, deadline_at - time.monotonic())
                    await self._release(epoch, "close after a failed attempt",
                                        min(CLOSE_TIMEOUT, max(remaining, LATE_GRACE) / 2),
                                        after=error)
            else:
                # in use again (a value= given without open, reopened by its check)
                return self._set(epoch, state="open", last_error=None, step=None,
                                 last_duration=time.monotonic() - start, _released=False)
            remaining = deadline_at - time.monotonic()
            if remaining <= 0 or not self._current(epoch):
                return False
            await asyncio.sleep(min(backoff_delay(attempt), remaining))
        return False


@dataclass
class _Background:
    """An optional connection's reopen left running by a restore run: its task, the loop
    it runs on, and a future done when the task is."""

    loop: asyncio.AbstractEventLoop
    task: asyncio.Future[bool] | concurrent.futures.Future[None]
    """The run's task; for an ``open_now`` open not yet started on ``loop``, the future
    of its start (cancelled: it never starts)."""
    done: concurrent.futures.Future[None]
    pid: int = 0
    """The process it runs in: after ``fork()`` a child has the parent's runs, which
    never run there."""
    handed_to: asyncio.AbstractEventLoop | None = None
    """The loop it goes on on after its own ended (see ``_move_background``): ``done``
    once the run there is in place."""

    def ended(self) -> bool:
        """Nothing is left to wait for: done, or it can never be (its loop is closed,
        or is the parent's after ``fork()``)."""
        loop = self.handed_to or self.loop
        return self.done.done() or self.pid != os.getpid() or loop.is_closed()


class _Opener:
    """The thread (with an event loop of its own) of an ``open_now`` registration's
    first sync open: its task, once started, and a future done when that task has
    returned (``asyncio.run`` may then still wait for its default executor, whose
    thread an abandoned ``asyncio.to_thread`` call of an async ``check`` holds). Stopped
    (by the engine's close, a newer run, unregister()), it makes no further attempt and
    its backoff sleep ends at once; a call already on its thread goes on (see
    :meth:`Connection._open_and_keep`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The child drops it from its connection (its thread is the parent's), but a thread
        # that forks from a signal handler between reading ``conn._opener`` and stop()
        # goes on to stop() it there.
        fresh_lock_after_fork(self)
        self._stopped = False
        self._task: asyncio.Future[Any] | None = None
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def enter(self) -> bool:
        """Called first by its task: False when it was stopped before it started."""
        task = asyncio.current_task()
        with self._lock:
            if self._stopped:
                return False
            self._task = task
            return True

    def stop(self) -> None:
        """Cancel its task, from any thread."""
        with self._lock:
            self._stopped = True
            task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed: it has ended
                task.get_loop().call_soon_threadsafe(task.cancel)


class _LoopEvent:
    """What :meth:`Connection._watch` sets, for a wait on an event loop: ``future`` (of
    that loop) is done once it is set, from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[None] = loop.create_future()

    def set(self) -> None:
        def done() -> None:
            if not self.future.done():
                self.future.set_result(None)

        with contextlib.suppress(RuntimeError):  # its loop is closed: no one waits
            self.future.get_loop().call_soon_threadsafe(done)


class _Superseded(Exception):
    """A newer run of the same connection took over while an attempt was running."""


_RUN: contextvars.ContextVar[tuple[Connection, int] | None] = contextvars.ContextVar(
    "rehydrate_connection_run", default=None)
"""The connection and run (epoch) an ``open`` being called belongs to: a helper that puts
its object in place itself (:class:`ManagedSocket`) keeps it only while that run is live."""


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a sync ``fn`` right here (a coroutine that never suspends)."""
    return _guarded(fn, *args)


def _escaped(exc: BaseException, fn: Callable[..., Any]) -> Exception:
    """What to record for a ``BaseException`` that is no ``Exception`` (``SystemExit``,
    ``KeyboardInterrupt``) out of the user's function: that connection's failure. Let
    through, it would end the event loop thread every connection's reopen runs on, and
    the restore would never finish."""
    return RuntimeError(f"{getattr(fn, '__qualname__', 'the function')} raised {exc!r}")


def _guarded(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a sync user function; see :func:`_escaped`."""
    try:
        return fn(*args)
    except Exception:
        raise
    except BaseException as exc:
        raise _escaped(exc, fn) from exc


async def _guarded_async(fn: Callable[..., Any], *args: Any) -> Any:
    """Await a coroutine function of the user's; see :func:`_escaped`. A
    ``CancelledError`` it raises by itself (its task was not cancelled) is its failure
    too; a cancellation of this task (a superseding run, a deadline) goes on."""
    try:
        return await fn(*args)
    except Exception:
        raise
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python 3.11+
        if cancelling is None or cancelling():
            raise
        raise _escaped(exc, fn) from exc
    except GeneratorExit:
        # this coroutine is being closed (its loop was closed with it pending): one
        # that raises anything else "ignored GeneratorExit", an error out of close()
        raise
    except BaseException as exc:
        raise _escaped(exc, fn) from exc


def _run_inline(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run, on the calling thread, a coroutine that awaits nothing but :func:`_inline`."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("an inline coroutine suspended")


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` on a thread of :data:`~rehydrate._threads.blocking` (never a bounded
    executor: N calls must be able to run at the same time; its threads outlive the call,
    so a clone reuses the one that closed the connection before the snapshot). Cancelling
    the caller abandons the call; its result is dropped."""
    from ._threads import blocking

    return await asyncio.wrap_future(blocking.submit(fn, *args))


class ConnectionManager:
    """The per-engine set of managed connections and the two built-in hooks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        self._conns: dict[str, Connection] = {}
        engine.builtins.register(self._before_snapshot, event="snapshot",
                                 phase=Phase.CONNECTIONS, name="rehydrate.connections",
                                 timeout=None)
        engine.builtins.register(self._after_restore, event="restore",
                                 phase=Phase.CONNECTIONS, name="rehydrate.connections",
                                 timeout=None)
        engine.add_status("connections", self.status)
        engine.add_status("tcp_connections", _status_tcp)
        _MANAGERS.add(self)

    def _after_fork_in_child(self) -> None:
        """In a child of ``fork()``: the threads and event loops running (re)opens stayed
        in the parent, so nothing here ever ends them. Forget them (``wait_background``
        waited, and every snapshot stalled, for them for good) and say what is true: the
        connection is not open (``failed``; the next restore reopens it, releasing what
        it holds first). Its lock and the connections' are new already
        (:func:`~rehydrate._threads.fresh_lock_after_fork`)."""
        for conn in self._conns.values():
            conn._calls = set()
            conn._background = None
            conn._opener = None  # its thread stayed in the parent
            conn._in_flight = None  # that close runs in the parent: it never ends here
            conn._pending = None  # nor does one scheduled on the parent's loop
            conn._loop = None  # nor does the parent's event loop run here
            if conn.state in ("reconnecting", "opening"):
                conn._epoch += 1  # what the parent's run left is no one's to finish
                conn.state, conn.step = "failed", None
                conn.last_error = "the process forked while it (re)opened"

    # -- registry -------------------------------------------------------------------

    def register(self, conn: Connection, open_now: bool = False,
                 replace: bool = False) -> Connection:
        """Add ``conn``; ``ValueError`` when its name is taken, unless ``replace``."""
        with self._lock:
            if conn.name in self._conns and not replace:
                raise ValueError(f"connection {conn.name!r} is already registered "
                                 "(pass replace=True to replace it)")
            old = self._conns.pop(conn.name, None)
            self._conns[conn.name] = conn  # re-registering a name moves it to the end
        if old is not None:
            old._retire()
            self._cancel_background(old)
            self._close_replaced(old, conn)
            log.info("connection %s replaced; the new callbacks replace the old", conn.name)
        if any(f is not None and not _is_async(f)
               for f in (conn.open_fn, conn.close_fn, conn.check_fn)):
            from ._threads import blocking

            # a thread for the sync callbacks exists before a snapshot
            blocking.reserve(f"connection:{conn.name}")
        if open_now:
            self._open_in_background(conn)
        return conn

    def unregister(self, name: str) -> bool:
        """Stop managing ``name`` (an open still retrying in the background stops too)."""
        with self._lock:
            conn = self._conns.pop(name, None)
        if conn is None:
            return False
        conn._retire()
        self._cancel_background(conn)
        return True

    def discard(self, conn: Connection) -> bool:
        """Stop managing ``conn`` if its name is still its own: a helper's object closed
        for good frees its name, but not the registration that replaced it."""
        with self._lock:
            if self._conns.get(conn.name) is not conn:
                return False
            del self._conns[conn.name]
        conn._retire()
        self._cancel_background(conn)
        return True

    def close(self) -> None:
        """The engine is closing: background (re)opens stop, and are waited for until
        they have (at most :data:`CLOSE_TIMEOUT` in all, then a warning naming the
        connection): a cancelled task the engine's loop never got to run again was
        destroyed pending when it stopped that loop ("Task was destroyed but it is
        pending!"), and an ``open_now`` sync open's thread went on retrying. An open
        connection stays as it is; one still (re)opening was left saying so for good: it
        is closed instead — what it holds released in the background
        (:data:`CLOSE_TIMEOUT`), then ``closed`` (``failed`` when that close fails) — and
        what an ``open`` still running on its thread returns later is closed, not kept
        (that call is not waited for: it may hang), by a ``close`` without argument too
        (see :meth:`Connection._disposes`). An ``async`` close runs on the loop the value
        was opened on, waited for here too since the engine stops its own loop next;
        on a stopped one it is left to run there (``closing`` until it has, see
        :meth:`Connection._close_later`). Nothing is waited for on this thread's own
        loop (it runs once this returns), nor on a loop that is not running or whose
        thread waits for a lifecycle event: it could not get there in time."""
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        waits: list[concurrent.futures.Future[None]] = []
        stopping: list[tuple[Connection, concurrent.futures.Future[None]]] = []
        for conn in self.all():
            with conn._lock:
                conn._ended = True  # before _retire: an open returning late sees it
            epoch, state = conn._retire()  # in one step: a run ending now changes neither
            run = self._cancel_background(conn)
            if run is not None and not run.ended():
                loop = run.handed_to or run.loop
                if loop is not here and loop.is_running() and not is_blocked(loop):
                    stopping.append((conn, run.done))
            with conn._lock:
                opener = conn._opener
            if opener is not None:
                stopping.append((conn, opener.done))
            # every close left on a loop closed since, unrun: one a restore made stale
            # (the connection is open again) otherwise stayed pending for good
            reclaimed = conn._reclaim()
            stranded = state == "closing" and reclaimed
            if state in ("opening", "reconnecting") or stranded:
                scheduled = self._close_stopped(
                    conn, epoch, "the engine closed while it (re)opened" if not stranded
                    else "its event loop was closed before the close scheduled there ran")
                # not from that loop's own thread (the application's): it runs the close
                # once this returns, and the engine does not stop it
                if scheduled is not None and scheduled[1] is not here:
                    waits.append(scheduled[0])
        if waits or stopping:
            _, late = concurrent.futures.wait(waits + [f for _, f in stopping],
                                              CLOSE_TIMEOUT + LATE_GRACE)
            for fut in waits:
                if fut in late:  # its loop is blocked: recorded as a close that hung
                    fut.cancel()
            for conn, fut in stopping:
                if fut in late:
                    log.warning("connection %s: its background open did not stop within "
                                "%gs of the engine's close", conn.name, CLOSE_TIMEOUT)

    def _close_stopped(self, conn: Connection, epoch: int, why: str) -> tuple[
            concurrent.futures.Future[None], asyncio.AbstractEventLoop] | None:
        """Close ``conn``, whose (re)open the engine's close stopped, without blocking
        the close. An ``async`` close is scheduled on the loop the value was opened on
        while that runs (returned: :meth:`close` waits for it before the engine stops the
        hooks' loop); any other runs on a thread of its own with a loop of its own."""
        if not conn._holds():
            conn._set(epoch, state="closed", step=None)
            return None
        conn._set(epoch, state="closing", step=f"close ({why})")
        ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        conn._closing = ended

        def failed(msg: str) -> None:
            if conn._set(epoch, state="failed", step=None,
                         last_error=f"{why}; closing it failed: {msg}"):
                log.warning("connection %s: %s; closing it failed: %s", conn.name, why, msg)

        def outcome(exc: BaseException | None) -> None:
            if exc is None:
                conn._set(epoch, state="closed", step=None)
            else:
                failed(f"close() took longer than {CLOSE_TIMEOUT:g}s"
                       if isinstance(exc, asyncio.TimeoutError) else _describe(exc))
            ended.set_result(None)

        home = conn._close_loop()
        if home is not None:
            async def bounded() -> None:
                await asyncio.wait_for(conn.close_async(again=False), CLOSE_TIMEOUT)

            def done(fut: concurrent.futures.Future[None]) -> None:
                outcome(asyncio.TimeoutError() if fut.cancelled() else fut.exception())

            try:
                fut = _submit(home, bounded)
            except RuntimeError:  # that loop closed in between: the fallback below
                pass
            else:
                fut.add_done_callback(done)
                return fut, home

        def run() -> None:
            try:
                later = asyncio.run(asyncio.wait_for(conn.close_async(again=False),
                                                     CLOSE_TIMEOUT))
            except Exception as exc:
                outcome(exc)
            else:
                if later is None:
                    outcome(None)
                else:  # runs when the application runs its stopped loop again
                    conn._closed_later(epoch, later)
                    ended.set_result(None)

        thread = threading.Thread(target=run, name=f"rehydrate-close-{conn.name}",
                                  daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # no new thread (interpreter shutdown)
            conn._set(epoch, state="failed", step=None,
                      last_error=f"{why}; not closed: {_describe(exc)}")
            ended.set_result(None)
        return None

    def get(self, name: str) -> Connection | None:
        with self._lock:
            return self._conns.get(name)

    def all(self) -> list[Connection]:
        with self._lock:
            return list(self._conns.values())

    def status(self) -> list[dict[str, Any]]:
        return [c.to_dict() for c in self.all()]

    def _close_replaced(self, old: Connection, new: Connection) -> None:
        """Close the connection a ``replace=True`` registration replaced: unmanaged, it
        kept its sockets (and pool threads) open, entered a snapshot with them and was
        never reopened after a restore, so code still holding it used a dead connection.
        A helper's own object is closed for good at once (``_on_replaced``); otherwise
        ``close`` runs in the background (registration never blocks), bounded as before a
        snapshot. The caller's object registered again under the name is handed over."""
        subject = old._closes()
        if subject is not None and subject is new._closes():
            return
        if old._on_replaced is not None:
            try:
                old._on_replaced()
            except Exception as exc:  # the new one is registered: that stands
                log.warning("connection %s replaced; closing the one it replaces "
                            "failed: %s", old.name, _describe(exc))
            return
        if old.close_fn is None:
            return

        def failed(exc: BaseException) -> None:
            msg = (f"close() took longer than {CLOSE_TIMEOUT:g}s"
                   if isinstance(exc, asyncio.TimeoutError) else _describe(exc))
            log.warning("connection %s replaced; closing the one it replaces "
                        "failed: %s", old.name, msg)

        async def close() -> None:
            await asyncio.wait_for(old.close_async(), CLOSE_TIMEOUT)

        if _is_async(old.close_fn):
            # On the loop a before-snapshot pass would await it on (the application's
            # under start(loop=...)): what an async close releases (asyncio streams, an
            # asyncpg or aiohttp pool) belongs to that loop, and fails on any other with
            # "attached to a different loop". Scheduled, never awaited here: the caller
            # may be that loop's own thread.
            def done(fut: concurrent.futures.Future[None]) -> None:
                if fut.cancelled():
                    failed(RuntimeError("its event loop stopped first"))
                elif (exc := fut.exception()) is not None:
                    failed(exc)

            try:
                fut = asyncio.run_coroutine_threadsafe(close(), self.engine.hook_loop())
            except RuntimeError as exc:  # that loop closed in between
                failed(exc)
                return
            fut.add_done_callback(done)
            old._replaced_close = fut
            return

        def run() -> None:
            try:
                asyncio.run(close())
            except Exception as exc:
                failed(exc)

        old._replaced_close = threading.Thread(
            target=run, name=f"rehydrate-close-{old.name}", daemon=True)
        old._replaced_close.start()

    def _open_in_background(self, conn: Connection) -> None:
        epoch, _ = conn._begin("opening")
        deadline_at = time.monotonic() + conn.effective_deadline()
        if _is_async(conn.open_fn):
            # On the hooks' loop, where a snapshot's close (and a restore's) are awaited:
            # what an async open makes (asyncio streams, a pool) belongs to the loop it
            # ran on, and one of its own, closed once the open returned, left it open
            # into the snapshot with a close that could only fail ("Event loop is
            # closed"). A snapshot stops and waits for it as for an optional reopen.
            target = self.engine.hook_loop()
            # In place before the loop gets to it: wait_background() returned at once
            # while the open had not started, and engine.close() could not stop it.
            # Done once the real run replaced it (or it was cancelled first).
            pending = _Background(target, concurrent.futures.Future(),
                                  concurrent.futures.Future(), os.getpid())

            async def start() -> None:
                with conn._lock:
                    if conn._background is not pending:
                        return  # cancelled (its run retired) while it waited
                self._start_background(conn, epoch, deadline_at, stale=False, first=True)

            def started(_: concurrent.futures.Future[None]) -> None:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    pending.done.set_result(None)

            with conn._lock:
                conn._background = pending
            try:
                pending.task = _submit(target, start)
            except RuntimeError:  # that loop closed in between: a thread of its own
                with conn._lock:
                    if conn._background is pending:
                        conn._background = None
                pending.done.set_result(None)
            else:
                pending.task.add_done_callback(started)
                return

        opener = _Opener()

        def finished() -> None:
            with conn._lock:
                if conn._opener is opener:
                    conn._opener = None
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                opener.done.set_result(None)

        async def main() -> None:
            try:
                if not opener.enter():
                    return  # stopped before its thread got here
                try:
                    ok = await conn.reopen(epoch, deadline_at, close_first=False)
                except asyncio.CancelledError:
                    return  # stopped (see _Opener): whatever stopped it says how it ended
                except Exception as exc:  # never let a background open escape
                    conn._set(epoch, last_error=_describe(exc))
                    ok = False
                if not ok and conn._set(epoch, state="failed"):
                    log.warning("connection %s did not open within %gs: %s", conn.name,
                                conn.effective_deadline(), conn.last_error)
            finally:
                # Done here, not once asyncio.run() returns: its shutdown waits for the
                # default executor, whose thread an abandoned ``asyncio.to_thread`` call
                # of the check may hold for good (engine.close() waited on every call).
                finished()

        def run() -> None:
            try:
                asyncio.run(main())
            finally:
                finished()

        with conn._lock:
            conn._opener = opener
        thread = threading.Thread(target=run, name=f"rehydrate-open-{conn.name}", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no new thread (interpreter shutdown): it never opens
            finished()
            conn._set(epoch, state="failed", step=None,
                      last_error="no thread could be started to open it")

    # -- hooks ------------------------------------------------------------------------

    async def _before_snapshot(self, ctx: RestoreContext) -> None:
        conns = self.all()
        # An optional connection still reopening in the background stops first: an open
        # finishing after its close would take a live socket into the snapshot.
        await self._settle(conns)
        errors: list[tuple[Connection, str]] = []
        unclosed: list[str] = []  # dropped, or their close waits for their stopped loop
        for conn in reversed(conns):
            epoch, _ = conn._begin("closing")
            takes_value = conn.close_fn is not None and _arity(conn.close_fn) >= 1
            with conn._lock:
                has_value, released = conn.value is not None, conn._released
            if takes_value and not has_value:
                # never opened, or every open failed: close(None) has nothing to close
                conn._set(epoch, state="closed")
                continue
            later = None
            try:
                if conn.close_fn is not None:
                    later = await asyncio.wait_for(conn.close_async(), CLOSE_TIMEOUT)
            except Exception as exc:
                msg = (f"close() took longer than {CLOSE_TIMEOUT:g}s"
                       if isinstance(exc, asyncio.TimeoutError) else _describe(exc))
                if takes_value and released:
                    # Closed by rehydrate already and not reopened since (its reopen
                    # failed): whatever it was connected to is gone; closed again in case
                    # the application used it meanwhile, but its failure is no reason to
                    # hold up the snapshot.
                    log.info("connection %s: closing the value closed before failed "
                             "again: %s", conn.name, msg)
                    conn._set(epoch, state="closed")
                    continue
                conn._set(epoch, state="failed", last_error=msg)
                errors.append((conn, msg))
            else:
                if later is not None:
                    conn._closed_later(epoch, later)
                else:
                    conn._set(epoch, state="closed")
                with conn._lock:
                    if later is not None or conn._dropped:
                        unclosed.append(conn.name)
        left = [c for c in established_tcp() if c.outbound and not c.loopback]
        if left:
            # those not closed above may be among them: "outside" would point elsewhere
            whose = ("opened outside rehydrate.connections, or held by connection(s) "
                     f"left unclosed above: {', '.join(reversed(unclosed))}"
                     if unclosed else "opened outside rehydrate.connections")
            log.warning(
                "%d outbound TCP connection(s) still established before the snapshot "
                "(%s; the platform will cut them): %s",
                len(left), whose, ", ".join(c.remote for c in left[:10]))
        required = [(c, m) for c, m in errors if c.required]
        for c, m in errors:
            if not c.required:
                log.warning("optional connection %s did not close: %s", c.name, m)
        if required:
            raise ConnectionsNotReady(
                "could not close required connection(s) before the snapshot: "
                + "; ".join(f"{c.name} ({m})" for c, m in required),
                [c.name for c, _ in required],
            )

    async def _after_restore(self, ctx: RestoreContext) -> None:
        # Optional connections reopen in the background: a dead metrics sink must not
        # hold readiness for its whole deadline.
        await self.reopen_all(until=ctx.deadline, wait_optional=False)

    async def reopen_all(self, *, until: float | None = None,
                         wait_optional: bool = True) -> dict[str, bool]:
        """Reopen every managed connection concurrently; raise if a required one missed
        its deadline. Returns name -> reopened.

        ``until``: a ``time.monotonic()`` moment the whole run must end by (the restore
        run's deadline, e.g. SnapStart's): every connection's deadline is cut so that
        this returns — naming the connections that missed it — just before then, instead
        of the hook being stopped there without a word about which peer was slow.

        ``wait_optional=False`` (what the restore hook does): optional connections
        (``required=False``) are reopened in the background on this event loop, bounded
        by their own deadline only (``until`` is the run's, which does not wait for
        them), their outcome in ``status()`` and, for a failure, one warning; they are
        not in the result. A snapshot stops such a reopen before it closes them."""
        conns = self.all()
        if not conns:
            return {}
        now = time.monotonic()
        # room for an attempt's LATE_GRACE and for raising the error before ``until``
        cap = math.inf if until is None else max(now, until - RUN_DEADLINE_MARGIN)
        tasks: list[asyncio.Future[bool]] = []
        plans: list[tuple[Connection, int, float]] = []
        for conn in conns:
            background = not wait_optional and not conn.required
            deadline_at = min(now + conn.effective_deadline(),
                              math.inf if background else cap)
            epoch, prev = conn._begin("reconnecting")
            self._cancel_background(conn)  # a previous run's: stale now
            stale = prev != "closed"  # not closed before a snapshot: release it first
            if background:
                self._start_background(conn, epoch, deadline_at, stale)
                continue
            plans.append((conn, epoch, deadline_at))
            tasks.append(asyncio.ensure_future(
                self._guard(conn, epoch, deadline_at, stale)))
        results = await asyncio.gather(*tasks)
        outcome: dict[str, bool] = {}
        missed: list[tuple[Connection, str]] = []
        for (conn, epoch, deadline_at), ok in zip(plans, results, strict=True):
            if not ok and not conn._current(epoch) and self.get(conn.name) is not conn:
                # unregister() or a replace=True registration took it over mid-run: no
                # longer managed, it is not this run's to miss (its name may be the new
                # registration's, opened by the next restore or its open_now)
                continue
            outcome[conn.name] = ok
            if not ok:
                conn._set(epoch, state="failed")
                within = (f"{deadline_at - now:.1f}s (cut to the restore run's deadline)"
                          if deadline_at < now + conn.effective_deadline()
                          else f"{conn.effective_deadline():g}s")
                if conn.required:  # named in the hook's error, which the engine logs
                    missed.append((conn, within))
                else:
                    _log_optional_missed(conn, within)
        if missed:
            raise ConnectionsNotReady(
                "required connection(s) not reopened before their deadline: "
                + "; ".join(f"{c.name}{_to(c)} after {within} and {c.attempts} "
                            f"attempt(s), last error: {c.last_error or 'none'}"
                            for c, within in missed),
                [c.name for c, _ in missed],
            )
        return outcome

    def wait_background(self, timeout: float | None = None) -> bool:
        """Block until the optional connections a restore left reopening in the
        background (and the first ``async`` open of an ``open_now`` registration) are
        done (reopened or failed: see ``status()``); False when
        ``timeout`` seconds passed first (as for ``wait_ready()``: ``None``, infinity or
        more than a year, no limit; a negative, NaN or non-number one is a one-line
        ``ValueError``/``TypeError``). Called on the event loop that runs one of them (the
        hooks' loop: the application's under ``start(loop=...)``), a wait is a
        ``RuntimeError``: blocking that loop would hold the reopens it waits for. A
        reopen whose loop ended goes on on the hooks' loop (waited for there) or is
        ``failed``; one that can never end (its loop was closed with it pending, or it
        is the parent's after ``fork()``) is not waited for."""
        timeout = _config.optional_seconds(timeout, "wait_background(): timeout")
        end = None if timeout is None else time.monotonic() + timeout
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        while True:
            with self._lock:
                conns = list(self._conns.values())
            # A run handed over to another loop is done only once its successor is in
            # place: looked for again.
            runs = [run for c in conns
                    if (run := c._background) is not None and not run.ended()]
            if not runs:
                return True
            if timeout != 0 and here is not None and any(
                    (run.handed_to or run.loop) is here for run in runs):
                # it waited out its whole timeout (with None: for good) and said False
                raise RuntimeError("wait_background() cannot block the event loop the "
                                   "reopens it waits for run on; call it through "
                                   "asyncio.to_thread()")
            pending = [run.done for run in runs]
            left = None if end is None else max(0.0, end - time.monotonic())
            _, waiting = concurrent.futures.wait(pending, left)
            if waiting:
                return False

    def _start_background(self, conn: Connection, epoch: int, deadline_at: float,
                          stale: bool, *, first: bool = False) -> None:
        """Reopen an optional connection as a task of this loop, not awaited (``first``:
        the first open of an ``open_now`` registration)."""
        moved = False

        async def run() -> bool:
            nonlocal moved
            try:
                ok = await self._guard(conn, epoch, deadline_at, stale)
            except asyncio.CancelledError:
                # Not cancelled by a newer run (a restore, a snapshot, unregister: they
                # start a new epoch first) but by its event loop ending: the application's
                # server shut down, or the asgi gate handed the hooks to another loop.
                if conn._current(epoch):
                    moved = self._move_background(conn, epoch, deadline_at, loop, done,
                                                  first=first)
                raise
            if not ok and conn._set(epoch, state="failed"):
                _log_missed(conn, f"{conn.effective_deadline():g}s", first)
            return ok

        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(run())
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def finished(t: asyncio.Future[bool]) -> None:
            if not t.cancelled() and t.exception() is not None:  # never expected
                log.warning("connection %s: background reopen: %s", conn.name,
                            _describe(t.exception()))  # type: ignore[arg-type]
            if not moved:  # else done once the run that goes on is in place
                done.set_result(None)

        task.add_done_callback(finished)
        with conn._lock:
            conn._background = _Background(loop, task, done, os.getpid())

    def _move_background(self, conn: Connection, epoch: int, deadline_at: float,
                         dying: asyncio.AbstractEventLoop,
                         done: concurrent.futures.Future[None], *, first: bool = False) -> bool:
        """A background reopen's event loop is ending: go on on the loop the hooks run
        on now, if that is another (True: ``done`` is resolved once the new run is in
        place, so :meth:`wait_background` never sees neither), else record that it
        stopped, ``failed`` with one warning (it would say ``reconnecting`` for good)."""
        target = self.engine.hook_loop()
        if target is not dying and not target.is_closed():
            async def again() -> None:
                try:
                    # A run of its own: an attempt of the ended one still running on its
                    # thread (a tcp_socket connect) then cannot replace what this one opens.
                    new = conn._go_on(epoch)
                    if new is not None:
                        self._start_background(conn, new, deadline_at, stale=False,
                                               first=first)
                finally:
                    done.set_result(None)

            with conn._lock:
                if conn._background is not None and conn._background.done is done:
                    conn._background.handed_to = target
            coro = again()
            try:
                asyncio.run_coroutine_threadsafe(coro, target)
            except RuntimeError:  # that loop closed in between
                coro.close()
            else:
                return True
        if conn._set(epoch, state="failed", step=None, last_error="its event loop stopped"):
            _log_missed(conn, "the life of its event loop", first)
        return False

    def _cancel_background(self, conn: Connection) -> _Background | None:
        """Cancel ``conn``'s background reopen, if any (from any thread); returns it. A
        sync call it was waiting for goes on (see :meth:`_settle`). The thread of an
        ``open_now`` sync open is stopped too (``conn._opener`` until it has ended)."""
        with conn._lock:
            run, conn._background = conn._background, None
            opener = conn._opener
        if opener is not None:
            opener.stop()
        if run is None or run.done.done():
            return run
        if isinstance(run.task, concurrent.futures.Future):  # not started: thread-safe
            run.task.cancel()
            return run
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is run.loop:
            run.task.cancel()
        else:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nothing runs
                run.loop.call_soon_threadsafe(run.task.cancel)
        return run

    async def _settle(self, conns: Iterable[Connection]) -> None:
        """Stop the background (re)opens of ``conns`` (an optional connection's reopen,
        ``open_now``/``tcp_socket``'s first open) and wait, at most :data:`CLOSE_TIMEOUT`
        in all, until they ended, including a sync ``open`` or ``check`` still running
        on its thread: what it opens (a socket a ``tcp_socket`` connect puts in place)
        would otherwise appear after the close."""
        waits: list[tuple[Connection, _Background | None]] = []
        for conn in conns:
            opening = conn.state == "opening"
            conn._retire()  # the run makes no further attempt; what it opens is not kept
            run = self._cancel_background(conn)
            if run is not None or opening:
                waits.append((conn, run))
        if not waits:
            return
        end = time.monotonic() + CLOSE_TIMEOUT
        here = asyncio.get_running_loop()
        # Only a run on this loop is waited for as a task: another loop may be closed,
        # the parent's (after fork()), or blocked by this event's caller; stale (retired)
        # and cancelled, it makes no further attempt, and its sync call is waited below.
        runs = [asyncio.wrap_future(r.done) for _, r in waits
                if r is not None and r.loop is here]
        if runs:
            await asyncio.wait(runs, timeout=CLOSE_TIMEOUT)
        for conn, _ in waits:
            with conn._lock:
                calls = list(conn._calls)
            left = end - time.monotonic()
            if calls and left > 0:
                waiting = [asyncio.wrap_future(c) for c in calls]
                done, pending = await asyncio.wait(waiting, timeout=left)
                for f in done:  # its outcome is the abandoned run's: not ours to raise
                    _retrieved(f)
                for f in pending:  # nor when it ends later ("never retrieved" otherwise)
                    f.add_done_callback(_retrieved)
            with conn._lock:
                busy = conn.step if conn._calls else None
            if busy is not None:
                log.warning("connection %s: its background open's %s still runs after "
                            "%gs; closing anyway", conn.name, busy, CLOSE_TIMEOUT)

    async def _guard(self, conn: Connection, epoch: int, deadline_at: float,
                     stale: bool) -> bool:
        """Run the retry loop; an attempt still running :data:`LATE_GRACE` after the
        deadline, or when the run is superseded (see :meth:`Connection._watch`), is
        abandoned (a sync call's thread finishes on its own, unheeded)."""
        wait = max(0.0, deadline_at - time.monotonic()) + LATE_GRACE
        reopen = asyncio.ensure_future(conn.reopen(epoch, deadline_at, stale))
        # Superseded (unregister(), a replace=True registration, the engine's close): no
        # longer this restore's to wait for. Its reopen stopped only at its next step, so
        # an open or check still running (a peer that accepts and never answers) held
        # the restore, and readiness, until the old connection's deadline.
        superseded = False

        def stop(_: object) -> None:
            nonlocal superseded
            if not reopen.done():
                superseded = True
                reopen.cancel()  # a sync call on its thread goes on, unheeded

        ended = conn._watch_here(epoch)
        ended.future.add_done_callback(stop)
        try:
            return await asyncio.wait_for(reopen, wait)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)  # Python 3.11+
            if not superseded or (cancelling is not None and cancelling()):
                raise  # this run itself was cancelled
            return False
        except asyncio.TimeoutError:
            with conn._lock:
                running = conn.step if conn._epoch == epoch else None
                if conn._epoch == epoch:  # what the abandoned attempt opens is not kept
                    conn._given_up = epoch
                    conn._wake_waits()
            note = f"({running or 'an attempt'} was still running at the deadline)"
            conn._set(epoch, last_error=f"{conn.last_error} {note}" if conn.last_error
                      else note)
            return False
        except Exception as exc:
            conn._set(epoch, last_error=_describe(exc))
            return False
        finally:
            conn._unwatch(ended)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark ``fut``'s exception retrieved: it belongs to an abandoned run."""
    if not fut.cancelled():
        fut.exception()


_MANAGERS: weakref.WeakSet[ConnectionManager] = weakref.WeakSet()
"""Every connection manager of this process, reset in the child after ``fork()``."""


def _reset_managers_in_child() -> None:
    for m in list(_MANAGERS):
        m._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_managers_in_child)


def _log_missed(conn: Connection, within: str, first: bool) -> None:
    if first:
        log.warning("connection %s%s did not open within %s: %s", conn.name, _to(conn),
                    within, conn.last_error)
    else:
        _log_optional_missed(conn, within)


def _log_optional_missed(conn: Connection, within: str) -> None:
    log.warning("optional connection %s%s not reopened within %s: %s",
                conn.name, _to(conn), within, conn.last_error)


def _to(conn: Connection) -> str:
    """`` (to host:port)`` when the peer is known: which server was down, in one line."""
    return f" (to {', '.join(conn.peers)})" if conn.peers else ""


def manager(engine: Engine | None = None) -> ConnectionManager:
    """The connection manager of ``engine`` (default: the process-wide engine)."""
    return resolve_engine(engine).extension("connections", ConnectionManager)


key = "connections"


def probe() -> Probe:
    """Always usable: connections are reopened with the clients' own APIs."""
    return Probe(True)


def install(engine: Engine) -> None:
    """Attach the connections manager to ``engine`` now (its functions also do on first use)."""
    manager(engine)


def register(
    name: str,
    open: Callable[..., Any] | None = None,
    close: Callable[..., Any] | None = None,
    check: Callable[..., Any] | None = None,
    *,
    required: bool = True,
    deadline: float | None = None,
    engine: Engine | None = None,
    value: Any = None,
    open_now: bool = False,
    replace: bool = False,
    peers: Iterable[str | tuple[str, int]] = (),
) -> Connection:
    """Manage a connection: ``close`` runs before a snapshot; after a restore or resume
    ``open`` then ``check`` run (concurrently with every other connection) with backoff
    until both succeed or ``deadline`` seconds passed (default ``REHYDRATE_CONNECT_DEADLINE``
    or 30 s). ``close`` and ``check`` may take one argument: the current ``value`` (what
    ``open`` returned last, or ``value=``). A ``check`` fails by raising or by returning
    ``False`` (any other result passes). Any of them may be ``async``. An ``async``
    ``close`` is awaited on the event loop the ``async`` ``open`` that made the value ran
    on. Once that loop is closed (``asyncio.run`` returned) it is tried on the hooks'
    loop, at most ``CLOSE_TIMEOUT``; if it fails or hangs there the value is dropped
    unclosed, with one warning naming the connection, the connection counts as ``closed``
    (a snapshot goes on) and the next restore opens it anew. While that loop is only
    stopped (driven by ``run_until_complete``) the close is scheduled on it and not
    waited for: ``closing`` until the application runs that loop again.

    Never blocks and never contacts the peer, unless ``open_now=True``: then the first
    ``open`` runs in the background (with the same backoff; an ``async`` one on the hooks'
    event loop, where ``close`` is awaited); registration still returns
    at once and never raises for an unreachable peer. Without it (and without
    ``value=``) the first restore opens it; until then a ``close`` that takes the value
    is not called (there is none), so snapshots before it succeed.

    ``required=False``: reopened in the background after a restore, never holding the
    run or readiness; its failure is in ``status()`` and one warning.

    A name already registered with the engine raises ``ValueError`` (a second
    registration used to replace the first silently) unless ``replace=True``; the helpers
    below take ``replace`` too.

    ``replace=True`` closes the connection it replaces: its ``close`` runs (with its
    value) in the background, bounded as before a snapshot — unless the new registration
    is given the same ``value``. To hand the same connection to new callbacks without
    closing it, ``unregister(name)`` first.

    ``peers``: the ``host:port`` (or ``(host, port)``) this connection talks to, so that
    ``rehydrate doctor --connections`` marks its sockets as managed (the helpers below
    fill it in from the client's configuration).
    """
    conn = _connection(name, open, close, check, required=required, deadline=deadline,
                       value=value, peers=peers)
    return manager(engine).register(conn, open_now=open_now, replace=replace)


def _connection(
    name: str,
    open: Callable[..., Any] | None = None,
    close: Callable[..., Any] | None = None,
    check: Callable[..., Any] | None = None,
    *,
    required: bool = True,
    deadline: float | None = None,
    value: Any = None,
    peers: Iterable[str | tuple[str, int]] = (),
    subject: object = None,
    resource: Callable[[], object] | None = None,
    on_replaced: Callable[[], None] | None = None,
    sockets: Callable[[], Iterable[socket.socket]] | None = None,
    any_loop: bool = False,
) -> Connection:
    """A checked :class:`Connection`, not registered yet (the helpers set what a
    ``replace=True`` registration does to their object before it can happen)."""
    if not isinstance(name, str) or not name or not name.isprintable():
        raise TypeError(f"connection name must be a non-empty string of printable "
                        f"characters, not {_config.shown(name)}")
    if isinstance(peers, (str, bytes)):  # one peer, not one per character
        raise TypeError(f"connection {name!r}: peers is a list of host:port, not one "
                        f"string (write [{peers!r}])")
    conn = Connection(name, open, close, check, required, deadline, value)
    conn.peers = tuple(p if isinstance(p, str) else _fmt(*p) for p in peers)
    conn._subject = subject
    conn._resource = resource
    conn._on_replaced = on_replaced
    conn._sockets = sockets
    conn._any_loop = any_loop
    return conn


def unregister(name: str, *, engine: Engine | None = None) -> bool:
    """Stop managing the connection ``name``; False when there was none."""
    return manager(engine).unregister(name)


def get(name: str, *, engine: Engine | None = None) -> Connection | None:
    """The managed connection registered as ``name``, or ``None``."""
    return manager(engine).get(name)


def connections(*, engine: Engine | None = None) -> list[Connection]:
    """Every managed connection of ``engine``."""
    return manager(engine).all()


# --------------------------------------------------------------------------------------
# Helpers for common clients
# --------------------------------------------------------------------------------------

def httpx_client(
    name: str,
    *,
    check_url: str | None = None,
    required: bool = True,
    deadline: float | None = None,
    engine: Engine | None = None,
    replace: bool = False,
    **client_kwargs: Any,
) -> Any:
    """An ``httpx.Client`` whose connection pool is rebuilt after every restore.

    Callers keep this one client object: it sends through a
    :class:`rehydrate._httpx.ReconnectingTransport`, a public-API httpx transport that
    swaps a fresh ``httpx.HTTPTransport`` in underneath (and closes the old pool before a
    snapshot). Transport options (``verify``, ``cert``, ``http1``, ``http2``, ``limits``,
    ``trust_env``, ``retries``, ``local_address``, ``uds``) go to that inner transport.
    With ``check_url`` the reopen sends a GET there through the new pool (status < 500
    counts as healthy; the client's auth flow and event hooks are not involved), which
    also leaves one live connection in it.
    """
    from ._httpx import make_client, shown

    client, transport = make_client(client_kwargs)

    def check() -> None:
        # Straight to the new pool (base URL and default headers applied; no auth flow,
        # redirects or event hooks): any answer below 500 means the peer is back.
        # Each wait capped by the run's deadline, as tcp_socket's connect is: with the
        # client's timeout=None a peer that accepts and never answers held this thread
        # (one more per restore) for good once the run had given up on it.
        request = client.build_request("GET", check_url,  # type: ignore[arg-type]
                                       timeout=_capped_timeout(client.timeout,
                                                               conn.deadline_at))
        # through the proxy the client would use for that URL (HTTP_PROXY, NO_PROXY)
        response = client._transport_for_url(request.url).handle_request(request)
        try:
            response.read()
        finally:
            response.close()
        if response.status_code >= 500:
            raise ConnectionError(f"{shown(request.url)} answered {response.status_code}")

    _prebuild(name, client, check_url)
    # replaced (replace=True): closed as httpx closes a client (requests then raise)
    conn = _connection(name, open=transport.reset, close=transport.close_pool,
                       check=check if check_url else None, required=required,
                       deadline=deadline, peers=_url_peers(client.base_url),
                       on_replaced=client.close)
    manager(engine).register(conn, replace=replace)
    return client


def _cap(deadline_at: float) -> Callable[[float | None], float]:
    """A wait (None: no limit) made no longer than what is left until ``deadline_at``
    (a ``time.monotonic()``) plus :data:`LATE_GRACE`, the time an attempt is given past
    the deadline."""
    left = max(0.0, deadline_at - time.monotonic()) + LATE_GRACE
    return lambda wait: left if wait is None else min(wait, left)


def _capped_timeout(timeout: Any, deadline_at: float | None) -> Any:
    """``timeout`` (an ``httpx.Timeout``) with each of its waits capped by
    :func:`_cap` (``deadline_at`` None: as it is)."""
    if deadline_at is None:
        return timeout
    import httpx

    cap = _cap(deadline_at)
    return httpx.Timeout(connect=cap(timeout.connect), read=cap(timeout.read),
                         write=cap(timeout.write), pool=cap(timeout.pool))


def _prebuild(name: str, client: Any, check_url: str | None) -> None:
    """Build the health check's request once now and drop it: the first build runs
    httpx's URL parsing, header merging and ABC instance checks for the first time
    (~10 ms of first-touch work in a gVisor clone). The clone still builds its own from
    the client's then-current base URL and headers. A URL that cannot be built is a
    ``ValueError`` now: it would fail every attempt of every restore until the deadline."""
    if check_url is None:
        return
    import httpx

    # Shown without user info, query and fragment (a password, an api_key=...): the
    # error reaches the application's log and its crash report.
    url = check_url.decode("utf-8", "replace") if isinstance(check_url, bytes) else str(
        check_url)
    shown_url = without_credentials(url)
    try:
        request = client.build_request("GET", check_url)
    except (httpx.InvalidURL, httpx.UnsupportedProtocol, TypeError, ValueError) as exc:
        why = _describe(exc)
        for quoted in {url, repr(url), repr(check_url)}:  # httpx's TypeError quotes it
            why = why.replace(quoted, repr(shown_url))
        raise ValueError(f"connection {name!r}: check_url {shown_url!r} is not a usable "
                         f"URL ({why})") from None
    if not request.url.host:
        raise ValueError(f"connection {name!r}: check_url {shown_url!r} names no host "
                         "(give the client a base_url, or an absolute URL)")


def _url_peers(url: Any) -> tuple[str, ...]:
    """``host:port`` of an httpx base URL (none without one)."""
    if not url.host:
        return ()
    return (_fmt(url.host, url.port or (443 if url.scheme == "https" else 80)),)


def httpx_async_client(
    name: str,
    *,
    check_url: str | None = None,
    required: bool = True,
    deadline: float | None = None,
    engine: Engine | None = None,
    replace: bool = False,
    **client_kwargs: Any,
) -> Any:
    """An ``httpx.AsyncClient`` whose pool is rebuilt after every restore (see
    :func:`httpx_client`). The pool's connections belong to the event loop the
    application sends on. When the hooks run on that loop (the engine was started with
    it: ``rehydrate.start(loop=...)``, as ``ReadinessGate`` does), the health check
    (``check_url``, relative to ``base_url`` and with the client's default headers, as in
    :func:`httpx_client`) goes through the new pool, and the application's first request
    after the restore reuses its connection; otherwise it uses a separate short-lived
    transport and the new pool fills on the application's loop. A ``check_url`` the
    client sends through a transport given in ``mounts=`` (a proxy) is checked through
    that transport, on the application's loop (the one the client's last request ran
    on); when that loop is not known, closed, or waiting for this very restore, the
    check goes through a short-lived copy of that transport, with a pool of its own
    (one that is not an ``httpx.AsyncHTTPTransport`` cannot be copied: the check goes
    straight to the server then, and its error says so), and while that loop is only
    stopped the check fails and is retried."""
    from ._httpx import AsyncReconnectingTransport, make_async_client

    client, transport = make_async_client(client_kwargs)

    async def check() -> None:
        request = client.build_request("GET", check_url)  # type: ignore[arg-type]
        # through the proxy the client would use for that URL (HTTP_PROXY, NO_PROXY)
        via = client._transport_for_url(request.url)
        if isinstance(via, AsyncReconnectingTransport):
            await via.probe(request)
        else:  # a transport the caller mounted for that URL: what requests go through
            await transport.probe_mount(via, request)

    async def reset() -> None:  # non-blocking: runs on the loop, no thread hop
        transport.reset()

    _prebuild(name, client, check_url)
    # replaced (replace=True): requests raise, the pools close on their own loop
    conn = _connection(name, open=reset, close=transport.close_pool,
                       check=check if check_url else None, required=required,
                       deadline=deadline, peers=_url_peers(client.base_url),
                       on_replaced=transport.retire, any_loop=True)
    manager(engine).register(conn, replace=replace)
    return client


def sqlalchemy_engine(
    name: str,
    sa_engine: Any,
    *,
    check: bool = True,
    required: bool = True,
    deadline: float | None = None,
    engine: Engine | None = None,
    replace: bool = False,
) -> Any:
    """Manage a SQLAlchemy ``Engine``: ``dispose()`` before a snapshot; after a restore
    ``dispose(close=False)`` (the platform already cut the sockets: drop them without
    talking to the server) and, with ``check``, ``SELECT 1`` on a fresh connection.

    An ``AsyncEngine`` (``create_async_engine``), or the ``sync_engine`` of one, is a
    ``TypeError`` here: its ``dispose()`` is a coroutine and its connections belong to
    the event loop that uses them, so every snapshot and restore failed ("'AsyncConnection'
    object does not support the context manager protocol", "coroutine ... never
    awaited"). Register it with :func:`register` and ``async`` functions instead.

    A SQLite engine in memory (``sqlite://``), or on a single-connection pool
    (``StaticPool``, ``SingletonThreadPool``), is registered with nothing to do: it has
    no socket a snapshot cuts, and ``dispose()`` discarded the in-memory database."""
    if _async_sqlalchemy(sa_engine):
        raise TypeError(
            f"connection {name!r}: sqlalchemy_engine() manages a sync Engine, not an "
            "AsyncEngine (or an async driver's sync_engine): register it with "
            "connections.register(name, close=async_engine.dispose, check=<an async "
            "SELECT 1>), on the event loop the application uses it on "
            "(rehydrate.start(loop=...))")

    if _in_process_sqlite(sa_engine):
        # No socket for a snapshot to cut, and dispose() would discard an in-memory
        # database (from rehydrate's thread, with SQLAlchemy's ERROR tracebacks about
        # objects created in another thread): managed as a connection with nothing to do.
        log.info("connection %s: a SQLite database in this process (in memory, or one "
                 "connection per thread): nothing to close before a snapshot or reopen "
                 "after it", name)
        conn = _connection(name, required=required, deadline=deadline,
                           subject=sa_engine, resource=lambda: sa_engine.pool)
        manager(engine).register(conn, replace=replace)
        return sa_engine

    def ping() -> None:
        with sa_engine.connect() as c:
            c.exec_driver_sql("SELECT 1")

    url = getattr(sa_engine, "url", None)
    host, port = getattr(url, "host", None), getattr(url, "port", None)
    conn = _connection(name, open=lambda: sa_engine.dispose(close=False),
                       close=sa_engine.dispose, check=ping if check else None,
                       required=required, deadline=deadline,
                       peers=[(host, port)] if host and port else (), subject=sa_engine,
                       # engine.execution_options() makes an engine sharing this pool
                       resource=lambda: sa_engine.pool)
    manager(engine).register(conn, replace=replace)
    return sa_engine


def _async_sqlalchemy(sa_engine: Any) -> bool:
    """Whether ``sa_engine`` is SQLAlchemy's asyncio flavour: an ``AsyncEngine``, or an
    ``Engine`` of an async driver (an ``AsyncEngine``'s ``sync_engine``, whose pool
    needs a greenlet the asyncio extension provides)."""
    ext = sys.modules.get("sqlalchemy.ext.asyncio")  # not imported: none was made
    if ext is not None and isinstance(sa_engine, ext.AsyncEngine):
        return True
    return getattr(getattr(sa_engine, "dialect", None), "is_async", False) is True


def _in_process_sqlite(sa_engine: Any) -> bool:
    """Whether ``sa_engine`` is SQLite whose connections must not be disposed of: an
    in-memory database (``sqlite://``, ``:memory:``, ``file::memory:``, ``mode=memory``)
    lives only as long as its connection, and a single-connection pool (``StaticPool``,
    ``SingletonThreadPool``) holds connections another thread may not close."""
    url = getattr(sa_engine, "url", None)
    try:
        if url is None or url.get_backend_name() != "sqlite":
            return False
        database = url.database or ""
        memory = (database in ("", ":memory:") or database.startswith("file::memory:")
                  or url.query.get("mode") == "memory")
    except Exception:  # not a SQLAlchemy URL: managed as before
        return False
    pool = sys.modules.get("sqlalchemy.pool")
    single = pool is not None and isinstance(
        getattr(sa_engine, "pool", None), (pool.StaticPool, pool.SingletonThreadPool))
    return memory or single


_REDIS_LOOP_CLOSED = ("the event loop its commands ran on is closed: its pooled connections "
                      "cannot be closed")


class _AsyncRedisPool:
    """The event loop a ``redis.asyncio`` client's connections belong to, and what may be
    done with them from the loop the hooks run on.

    Their streams, and the pool's lock, belong to the application's loop: a
    ``disconnect()`` awaited on rehydrate's own loop (an engine started without
    ``loop=``) fails with "attached to a different loop", which refused every snapshot,
    and a ``PING`` there put a connection of that loop into the application's pool, which
    its next command then failed on. Like :class:`rehydrate._httpx.AsyncReconnectingTransport`
    this remembers the loop the application last took a connection on, sends
    ``disconnect()`` there, and checks on a short-lived connection of its own when the
    hooks run on another loop."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pool = client.connection_pool
        self.home: asyncio.AbstractEventLoop | None = None
        self.detached: list[tuple[Any, asyncio.AbstractEventLoop]] = []
        """Idle connections taken out of the pool while their loop (``home`` then) was
        stopped, each with that loop: :meth:`disconnect_detached` disconnects them there;
        those of a loop closed since are let go of (:meth:`_drop_stale`)."""
        # registered from a coroutine: most likely the loop the client is used on
        with contextlib.suppress(RuntimeError):
            self.home = asyncio.get_running_loop()
        take = self.pool.get_connection

        async def get_connection(*args: Any, **kwargs: Any) -> Any:
            # every command, pipeline and pubsub of the client takes its connection here
            self.home = asyncio.get_running_loop()
            return await take(*args, **kwargs)

        self.pool.get_connection = get_connection

    async def disconnect(self) -> None:
        home, running = self.home, asyncio.get_running_loop()
        stale = self._drop_stale()
        if home is None or home is running:
            await self.pool.disconnect()
        elif home.is_running() and not is_blocked(home):
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self.pool.disconnect(), home))
        elif home.is_closed():
            # nothing can talk to streams of a closed loop any more: forget them (their
            # sockets stay open until the garbage collector takes them: said once)
            pool = self.pool
            stale = any(getattr(c, "is_connected", True) for c in (
                *getattr(pool, "_available_connections", [None]),
                *getattr(pool, "_in_use_connections", ()))) or stale
            pool.reset()
        else:
            # run_until_complete between two calls, or its thread waiting for this very
            # event (sent there and waited for, the disconnect ran only once the event
            # had given up on it): only that loop can close them, so the connection
            # schedules a disconnect there — of what is detached now only
            raise LoopStopped(home, "its commands ran on", self.detach(home),
                              dropped=_REDIS_LOOP_CLOSED if stale else None)
        if stale:
            raise LoopClosed(_REDIS_LOOP_CLOSED)

    def _drop_stale(self) -> bool:
        """Let go of the detached connections whose loop was closed before it ran their
        disconnect (nothing can disconnect them any more: "Event loop is closed" there
        failed the next close on another loop). True when one was still connected."""
        stale = [c for c, on in self.detached if on.is_closed()]
        if stale:
            self.detached = [d for d in self.detached if not d[1].is_closed()]
        return any(getattr(c, "is_connected", True) for c in stale)

    def detach(self, home: asyncio.AbstractEventLoop) -> Callable[[], Coroutine[Any, Any, None]]:
        """Take the pool's idle connections out of it, here, while ``home`` is stopped:
        a disconnect scheduled there runs only after whatever the application runs
        first, whose command would have been sent on one of them and then cut (redis-py
        retried it: an INCR applied twice; without retries a ``ConnectionError`` for a
        command applied). Returns the disconnect to schedule there; connections in use
        (a task suspended with one) are left alone. Of a pool without redis-py's
        ``_available_connections`` list, the idle connections are disconnected there."""
        pool = self.pool
        idle = getattr(pool, "_available_connections", None)
        if not isinstance(idle, list):
            return lambda: pool.disconnect(inuse_connections=False)
        # one assignment: get_connection() pops from whichever list it finds there
        pool._available_connections = []
        self.detached.extend((c, home) for c in idle)
        return self.disconnect_detached

    async def disconnect_detached(self) -> None:
        """Disconnect the connections :meth:`detach` took out of the pool on this loop
        (every one so far: a disconnect scheduled earlier that runs first takes them
        all); another loop's are not this one's to disconnect. Each stays listed until
        its disconnect has returned: one this loop never finished (closed meanwhile)
        counts as left open (:meth:`_drop_stale`)."""
        here = asyncio.get_running_loop()
        conns = [c for c, on in self.detached if on is here]
        # one after the other, not gathered: a loop closed while this is under way
        # destroys one started disconnect, not children never awaited
        exc: Exception | None = None
        for c in conns:
            try:
                await c.disconnect()
            except Exception as e:  # the others still
                exc = exc or e
        self.detached = [d for d in self.detached if not any(d[0] is c for c in conns)]
        if exc is not None:
            raise exc

    async def reopen(self) -> None:
        """After a restore: the pool's connections were cut; on a stopped loop they are
        taken out of the pool now and disconnected when the application runs that loop
        again (closed unrun, nothing is said: see :func:`~rehydrate._loops.run_quietly`)
        — never a reason to fail the open."""
        try:
            await self.disconnect()
        except LoopStopped as exc:
            try:
                fut = run_quietly(exc.loop, (exc.close or self.pool.disconnect)())
            except RuntimeError:  # closed since: nothing can close them any more
                return
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def ping(self) -> None:
        if asyncio.get_running_loop() is self.home:
            # the application's loop: the check's connection stays in the pool for it
            ok = await self.client.ping()
        else:
            import redis.asyncio as aredis

            pool = aredis.ConnectionPool(connection_class=self.pool.connection_class,
                                         **self.pool.connection_kwargs)
            try:
                ok = await aredis.Redis(connection_pool=pool).ping()
            finally:
                await pool.disconnect()
        if not ok:
            raise ConnectionError("PING failed")


def redis_client(
    name: str,
    client: Any,
    *,
    check: bool = True,
    required: bool = True,
    deadline: float | None = None,
    engine: Engine | None = None,
    replace: bool = False,
) -> Any:
    """Manage a redis-py client (sync or ``redis.asyncio``): its pool is disconnected
    before a snapshot and reset after a restore, then ``PING``-ed when ``check``.

    A ``redis.asyncio`` client's connections belong to the event loop the application
    sends its commands on: ``disconnect()`` is sent to that loop (the last one a command
    ran on, or the one ``redis_client`` was called from) — scheduled there when it is
    only stopped (``run_until_complete`` between two calls), to run when the application
    runs it again (``closing`` meanwhile); when
    the hooks run on another loop (the engine was started without ``loop=``) the
    ``PING`` goes over a short-lived connection of its own and the pool refills on the
    application's first command. A sync client's ``PING`` goes over a short-lived
    connection of its own too, its waits capped by the run's deadline (a peer that
    accepts and never answers, with ``socket_timeout=None``, held the check's thread for
    good); the client's own pool and settings are left as they are."""
    pool = client.connection_pool
    ping: Callable[[], Any]
    disconnect: Callable[[], Any]
    reopen: Callable[[], Any]
    if inspect.iscoroutinefunction(pool.disconnect):
        apool = _AsyncRedisPool(client)
        ping, disconnect, reopen = apool.ping, apool.disconnect, apool.reopen
    else:
        def sping() -> None:
            if not _capped_redis_ping(client, conn.deadline_at):
                raise ConnectionError("PING failed")

        # a bound disconnect() takes no required argument: called as is
        ping, disconnect = sping, pool.disconnect
        reopen = disconnect
    kw = getattr(pool, "connection_kwargs", {})
    peers = () if "path" in kw else ((kw.get("host", "localhost"), kw.get("port", 6379)),)
    conn: Connection = _connection(name, open=reopen, close=disconnect,
                       check=ping if check else None, required=required, deadline=deadline,
                       peers=peers, subject=client,
                       # Redis(connection_pool=pool): clients sharing one pool
                       resource=lambda: pool, any_loop=True)
    manager(engine).register(conn, replace=replace)
    return client


def _capped_redis_ping(client: Any, deadline_at: float | None) -> Any:
    """``client.ping()`` (a sync redis-py client), its waits capped by ``deadline_at``
    (a ``time.monotonic()``; None: through the client's pool, as the application's
    commands go) through :func:`_cap`, as :func:`_capped_timeout` caps httpx's.

    redis-py has no per-command timeout that covers the connect and its handshake
    (``HELLO``, ``AUTH``, ``CLIENT SETINFO``), so the capped ``PING`` goes over a
    short-lived connection of its own, built from the pool's settings with the socket
    timeouts capped and no retries (their sleeps would outlast the cap; the run retries
    itself): the client's pool and settings stay as the application made them."""
    if deadline_at is None:
        return client.ping()
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    pool = client.connection_pool
    kw = dict(pool.connection_kwargs)
    cap = _cap(deadline_at)
    kw.update(socket_timeout=cap(kw.get("socket_timeout")), retry=Retry(NoBackoff(), 0))
    if "path" not in kw:  # redis-py 5's unix socket connection takes no connect timeout
        # redis-py's own fallback: no connect timeout of its own means socket_timeout's
        connect_timeout = kw.get("socket_connect_timeout") or kw.get("socket_timeout")
        kw["socket_connect_timeout"] = cap(connect_timeout)
    own = redis.ConnectionPool(connection_class=pool.connection_class, **kw)
    try:
        return redis.Redis(connection_pool=own).ping()
    finally:
        own.disconnect()


def grpc_channel(
    name: str,
    factory: Callable[[], Any],
    *,
    check: bool = True,
    required: bool = True,
    deadline: float | None = None,
    engine: Engine | None = None,
    replace: bool = False,
    peers: Iterable[str | tuple[str, int]] = (),
) -> Any:
    """A gRPC channel whose underlying ``grpc.Channel`` is replaced after every restore.

    ``factory()`` creates a synchronous channel (``grpc.insecure_channel(...)`` …); a
    ``grpc.aio`` channel (or an async factory) is refused with ``TypeError``: its
    ``close()`` cannot be awaited on rehydrate's threads. Stubs built on the
    returned object keep working: each call goes to the current channel. The check waits
    for ``grpc.channel_ready_future``. The target is hidden in ``factory``: pass
    ``peers=["host:port"]`` for ``rehydrate doctor --connections`` to mark its sockets.

    ``replace=True`` closes the channel previously returned for ``name``. Unmanaged, it
    would go on working until a snapshot, which it would enter with its connections open
    and leave without a new channel in any clone; its stubs raise ``ValueError`` at once
    instead, as for a closed ``grpc.Channel``. Build stubs on the new channel.
    """
    from ._grpc import ManagedChannel

    managed = ManagedChannel(factory)
    mgr = manager(engine)
    try:
        conn = mgr.register(
            _connection(name, open=managed.reset, close=managed.close_current,
                        required=required, deadline=deadline, peers=peers,
                        on_replaced=managed.close),
            replace=replace)
    except BaseException:
        managed.close()  # refused (a name taken, bad peers): its channel was made already
        raise
    # closed for good, it frees its name (the next grpc_channel(name) was refused)
    managed.on_close = lambda: mgr.discard(conn)
    if check:
        conn.check_fn = lambda: managed.wait_ready(
            max(0.05, min(5.0, conn.effective_deadline())))
    return managed


def _connect(address: Any, timeout: float | None, family: int = socket.AF_INET,
             proto: int = 0) -> socket.socket:
    """A TCP socket connected to ``address``, a sockaddr as ``getaddrinfo`` returns it
    (with an IPv6 one's flow info and scope id), ``timeout`` set before the connect."""
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


class ManagedSocket:
    """A TCP client socket that is reconnected after every restore.

    Keep this object; ``sock`` is the current ``socket.socket`` (attribute access such as
    ``sendall``/``recv`` is forwarded to it). Raises ``ConnectionError`` while not connected.
    """

    def __init__(self, address: tuple[str, int], timeout: float | None = 5.0) -> None:
        self.address = address
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        # a parent thread may hold it at fork() (a close, a connect putting its socket in)
        fresh_lock_after_fork(self)
        self._closes = 0
        """Bumped by every close: a connect that a close overtook keeps no socket."""
        self._final = False
        """Closed for good (:meth:`close_for_good`): no later connect keeps its socket."""
        self._options: dict[tuple[int, int], tuple[Any, ...]] = {}
        """The arguments of every :meth:`setsockopt`, by (level, option): set again on
        each new socket (the last call for an option wins)."""

    @property
    def sock(self) -> socket.socket:
        s = self._sock
        if s is None and self._final:
            raise ConnectionError(f"socket to {self.address[0]}:{self.address[1]} is "
                                  "closed for good (its connection was replaced)")
        if s is None:
            raise ConnectionError(f"socket to {self.address[0]}:{self.address[1]} is not "
                                  "connected (yet)")
        return s

    def connect(self, deadline_at: float | None = None, *,
                current: Callable[[], bool] | None = None,
                run_ended: threading.Event | None = None) -> socket.socket:
        """Connect (with ``timeout``, but never past ``deadline_at``, a
        ``time.monotonic()``): a connect abandoned at the deadline otherwise kept its
        thread and file descriptor for the whole timeout (minutes of SYN retries with
        ``timeout=None`` to a peer that drops packets), once per restore.

        ``current``: whether the run this connect belongs to is still the live one,
        asked when its socket would be put in place (:func:`tcp_socket` passes it): a
        connect of an older run finishing late closes its socket instead of replacing
        a newer run's. ``run_ended``: set when that run ends; a name lookup still
        waited for is abandoned then."""
        with self._lock:
            closes = self._closes
        new = self._open(deadline_at, run_ended)
        # Checked and kept in one step: a close (a snapshot's, after waiting for this
        # connect as long as it may) between the two would otherwise be missed, and the
        # socket it came too late for kept, live, in the snapshot.
        with self._lock:
            ended = current is not None and not current()
            overtaken = self._final or self._closes != closes or ended
            if not overtaken:
                self._set_options(new)  # under the lock: a setsockopt meanwhile is in
            old, self._sock = (new, self._sock) if overtaken else (self._sock, new)
        if old is not None:
            old.close()  # the one replaced, or this one when a close overtook it
        if overtaken and self._final:
            return self.sock  # raises: closed for good
        if ended:
            raise ConnectionError(f"socket to {self.address[0]}:{self.address[1]}: "
                                  "connected for a run that has ended")
        if overtaken:
            raise ConnectionError(f"socket to {self.address[0]}:{self.address[1]} was "
                                  "closed while it connected")
        return new

    def _open(self, deadline_at: float | None,
              ended: threading.Event | None = None) -> socket.socket:
        """Look the host up and connect to its addresses in order, all within
        ``deadline_at``: ``socket.create_connection``'s lookup takes no timeout, and a
        resolver that did not answer held the attempt (and its thread) past the run's
        deadline, recorded only as an open "still running at the deadline"."""
        host, port = self.address
        start = time.monotonic()
        lookup_by = deadline_at
        if lookup_by is None and self.timeout is not None:
            lookup_by = start + self.timeout
        if lookup_by is None:  # no run's deadline and no timeout: nothing bounds it
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        else:
            lookup_by = max(lookup_by, start + 0.01)  # as the connect: never 0 s
            try:
                infos = _dns.resolve(host, port, lookup_by, wake=ended,
                                     thread_name="rehydrate-dns-tcp_socket")
            except InterruptedError:  # ended: what it says is nobody's to read
                raise ConnectionError(f"name lookup of {host!r} abandoned: its run "
                                      "ended") from None
            except TimeoutError:
                raise TimeoutError(f"name lookup of {host!r} did not answer within "
                                   f"{lookup_by - start:.2g}s") from None
        error: OSError | None = None
        # in order, each once (an address listed for two protocols); the whole sockaddr,
        # as getaddrinfo gave it: an IPv6 link-local one ("fe80::1%eth0") needs its scope
        # id, and rebuilt as (host, port) its connect failed with EINVAL
        tried: dict[Any, Any] = {}
        for info in infos:
            tried.setdefault(info[4], info)
        for info in tried.values():
            timeout = self.timeout
            if deadline_at is not None:
                left = deadline_at - time.monotonic()
                if left <= 0 and error is not None:
                    break  # the first address is always tried (as the first attempt)
                left = max(0.01, left)
                timeout = left if timeout is None else min(timeout, left)
            try:
                new = _connect(info[4], timeout, info[0], info[2])
            except OSError as exc:
                error = exc
                continue
            if timeout != self.timeout:
                new.settimeout(self.timeout)  # the cap is for the connect only
            return new
        if error is None:
            raise OSError(f"name lookup of {host!r} returned no address")
        raise error

    def _set_options(self, new: socket.socket) -> None:
        try:
            for args in self._options.values():
                new.setsockopt(*args)
        except OSError as exc:
            new.close()
            raise OSError(exc.errno, f"socket to {self.address[0]}:{self.address[1]}: "
                          f"a socket option set before could not be set again: "
                          f"{exc.strerror or exc}") from exc

    def setsockopt(self, level: int, optname: int, value: int | bytes | None,
                   optlen: int | None = None) -> None:
        """``socket.setsockopt`` on the current socket, set again on every new one (a
        restore's reconnect; a plain ``sock.setsockopt`` lasts only as long as that
        socket). Before the first connect: kept, set on it."""
        args: tuple[Any, ...] = ((level, optname, value) if optlen is None
                                 else (level, optname, value, optlen))
        with self._lock:
            s = self._sock
            if s is not None:
                s.setsockopt(*args)  # raises for a bad option: then not kept
            self._options[(level, optname)] = args

    def _held(self) -> list[socket.socket]:
        """The socket in place, if any (what ``doctor --connections`` marks)."""
        s = self._sock
        return [] if s is None else [s]

    def close(self) -> None:
        with self._lock:
            self._closes += 1
        self._swap(None)

    def close_for_good(self) -> None:
        """Close, and refuse every later connect: a ``replace=True`` registration of its
        name replaced it, and a connect still running (a background open) would
        otherwise leave an open socket in an object nothing manages."""
        with self._lock:
            self._final = True
        self._swap(None)

    def _swap(self, new: socket.socket | None) -> None:
        old: socket.socket | None
        with self._lock:
            if self._final and new is not None:
                old = new  # closed for good: a late connect's socket is closed, not kept
            else:
                old, self._sock = self._sock, new
        if old is not None:
            old.close()

    def __getattr__(self, item: str) -> Any:
        return getattr(self.sock, item)


def _check_address(address: object) -> None:
    """Refuse at registration what a connect would fail on (or, for a port above 65535,
    silently wrap into another port) in the background for the whole deadline."""
    if (not isinstance(address, tuple) or len(address) != 2
            or not isinstance(address[0], str) or isinstance(address[1], bool)
            or not isinstance(address[1], int) or not 1 <= address[1] <= 65535):
        # port 0 is "any" for a bind; a connect to it is refused every time
        raise ValueError("address must be (host, port) with a port 1-65535, not "
                         f"{_config.shown(address)}")


def tcp_socket(
    name: str,
    address: tuple[str, int],
    *,
    timeout: float | None = 5.0,
    check: Callable[[socket.socket], Any] | None = None,
    required: bool = True,
    deadline: float | None = None,
    engine: Engine | None = None,
    replace: bool = False,
) -> ManagedSocket:
    """A raw TCP client socket managed by rehydrate. The first connect runs in the
    background (registration never blocks); ``check(sock)`` may verify e.g. a greeting.
    ``address``: ``(host, port)``, port 1-65535 (``ValueError`` otherwise, at once);
    ``timeout``: the socket timeout in seconds > 0 (``None``, infinity or more than a
    year: none); checked here — the socket module refused a bad one only at the
    connect, in the background."""
    _check_address(address)
    timeout = _config.optional_seconds(timeout, "tcp_socket(): timeout", zero_ok=False)
    ms = ManagedSocket(address, timeout)
    chk = (lambda: check(ms.sock)) if check is not None else None
    managed: list[Connection] = []

    def connect() -> socket.socket:  # capped by the deadline of the run it is part of
        run = _RUN.get()
        if not managed or run is None or run[0] is not managed[0]:
            return ms.connect(managed[0].deadline_at if managed else None)
        conn, epoch = run
        ended = conn._watch(epoch)
        try:
            return ms.connect(conn.deadline_at, current=lambda: conn._live(epoch),
                              run_ended=ended)
        finally:
            conn._unwatch(ended)

    managed.append(manager(engine).register(
        _connection(name, open=connect, close=ms.close, check=chk, required=required,
                    deadline=deadline, peers=[address], on_replaced=ms.close_for_good,
                    sockets=ms._held),
        replace=replace))
    manager(engine)._open_in_background(managed[0])  # now that connect() can see it
    return ms


# --------------------------------------------------------------------------------------
# What is established right now (what the user may have forgotten to register)
# --------------------------------------------------------------------------------------

_TCP_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
    "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
    "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}


@dataclass(frozen=True)
class TcpConnection:
    local: str
    remote: str
    state: str
    loopback: bool
    outbound: bool
    """False when the local port is one of the namespace's listening ports (accepted)."""
    inode: int

    def to_dict(self) -> dict[str, Any]:
        return {"local": self.local, "remote": self.remote, "state": self.state,
                "loopback": self.loopback, "outbound": self.outbound}


def _decode_addr(hexaddr: str) -> tuple[str, int]:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def _fmt(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host.startswith("::ffff:"):
        host = host[7:]
    return host.startswith("127.") or host == "::1"


def _socket_inodes(pid: str) -> set[int]:
    out: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for fd in names:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def established_tcp(pid: int | str = "self", *, states: Iterable[str] = ("ESTABLISHED",)
                    ) -> list[TcpConnection]:
    """TCP connections owned by process ``pid`` in the given states (not listeners).

    Reads ``/proc/<pid>/net/tcp`` and ``tcp6`` (the process's network namespace) and keeps
    the sockets whose inode is one of the process's file descriptors. ``outbound`` is
    False for connections accepted on a port the namespace listens on.
    """
    wanted = set(states)
    inodes = _socket_inodes(str(pid))
    rows: list[tuple[str, int, str, int, str, int]] = []
    listening: set[int] = set()
    for fname in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{fname}", encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            try:
                lhost, lport = _decode_addr(parts[1])
                rhost, rport = _decode_addr(parts[2])
                inode = int(parts[9])
            except ValueError:
                continue
            state = _TCP_STATES.get(parts[3].upper(), parts[3])
            if state == "LISTEN":
                listening.add(lport)
                continue
            if state in wanted and inode in inodes:
                rows.append((lhost, lport, rhost, rport, state, inode))
    return [
        TcpConnection(_fmt(lh, lp), _fmt(rh, rp), st, _is_loopback(rh), lp not in listening,
                      ino)
        for lh, lp, rh, rp, st, ino in rows
    ]


def _status_tcp() -> list[dict[str, Any]]:
    return [c.to_dict() for c in established_tcp()]


_PEER_LOOKUP_TIMEOUT = 2.0
"""Seconds ``doctor --connections`` gives the name lookups of all managed peers together:
``getaddrinfo`` has no timeout of its own, and a resolver that did not answer hung the
command (the sockets it lists are already known; only the managed marks wait for names)."""


def _resolved(peers: Iterable[str], deadline: float,
              late: list[str] | None = None) -> set[tuple[str, int]]:
    """(address, port) pairs a list of ``host:port`` peers resolves to (best effort), the
    lookups ended by ``deadline`` (a ``time.monotonic()``); the peers whose lookup did not
    answer by then are appended to ``late``."""
    out: set[tuple[str, int]] = set()
    for peer in peers:
        host, _, port = peer.rpartition(":")
        host = host.strip("[]")
        try:
            infos = _dns.resolve(host, int(port), deadline)
        except TimeoutError:
            if late is not None:
                late.append(peer)
            continue
        except (OSError, ValueError):
            continue
        for info in infos:
            addr = str(info[4][0])
            out.add((addr.removeprefix("::ffff:"), int(port)))
    return out


def _socket_ident(sock: socket.socket) -> dict[str, Any] | None:
    """What ``doctor --connections`` recognises a socket by in ``/proc/PID/net/tcp``: its
    inode, and its local and remote ``host:port`` (where an inode is not comparable);
    None for a socket closed meanwhile."""
    try:
        fd = sock.fileno()
        if fd < 0:
            return None
        inode = os.fstat(fd).st_ino
        local = sock.getsockname()
        remote = sock.getpeername()
    except OSError:
        return None
    return {"inode": inode, "local": _fmt(str(local[0]), int(local[1])),
            "remote": _fmt(str(remote[0]), int(remote[1]))}


def _endpoint(text: object) -> tuple[str, int] | None:
    """``host:port`` as comparable (an IPv4-mapped or scoped IPv6 address as
    ``/proc/net/tcp6`` shows it); None for anything else (the status is data)."""
    if not isinstance(text, str):
        return None
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        return None
    return host.strip("[]").partition("%")[0].removeprefix("::ffff:"), number


def _owns(conn: TcpConnection, sockets: Iterable[object]) -> bool:
    """Whether ``conn`` is one of a managed connection's own ``sockets`` (its status
    entries): the same inode, or the same local and remote address."""
    local, remote = _endpoint(conn.local), _endpoint(conn.remote)
    for ident in sockets:
        if not isinstance(ident, Mapping):
            continue
        inode = ident.get("inode")
        if type(inode) is int and inode and inode == conn.inode:
            return True
        if local is not None and (_endpoint(ident.get("local")), _endpoint(
                ident.get("remote"))) == (local, remote):
            return True
    return False


def _managed_by(conn: TcpConnection, managed: Sequence[Mapping[str, Any]],
                peers: dict[str, set[tuple[str, int]]]) -> tuple[str, str] | None:
    """(name, how) of the managed connection ``conn`` belongs to: ``socket`` when it is
    one a connection holds itself (a ``tcp_socket``'s); else ``peer`` when it goes to
    the peer of one whose sockets rehydrate cannot see (a client's pool) — a guess,
    since any other socket to that peer looks the same. A connection whose sockets are
    known is never matched by its peer: a socket to it that is not one of them is one
    opened outside rehydrate, exactly what the command is there to show."""
    for m in managed:
        sockets = m.get("sockets")
        if isinstance(sockets, list) and _owns(conn, sockets):
            return str(m.get("name")), "socket"
    key = _endpoint(conn.remote)
    for m in managed:
        if isinstance(m.get("sockets"), list):
            continue
        if key in peers.get(str(m.get("name")), ()):
            return str(m.get("name")), "peer"
    return None


def doctor_report(pid: int | str = "self",
                  managed: Sequence[Mapping[str, Any]] | None = None,
                  ) -> tuple[dict[str, Any], str]:
    """``rehydrate doctor --connections``: (JSON data, text) about process ``pid``'s
    established TCP connections, outbound non-loopback ones first.

    ``managed``: that process's managed connections (``status()["connections"]``): a
    socket one of them holds (its ``sockets``) is marked with the connection's name
    (``managed_by``: ``socket``); for a connection whose sockets are not known
    (``sockets`` null: a client's own pool), a socket to one of its ``peers`` is
    (``managed_by``: ``peer``, "probably"). None: not known (the process is not the one
    behind the control socket).
    """
    deadline = time.monotonic() + _PEER_LOOKUP_TIMEOUT
    late: list[str] = []
    # only the peers of connections matched by peer are looked up
    peers = {str(m.get("name")): _resolved(m.get("peers") or (), deadline, late)
             for m in managed or () if not isinstance(m.get("sockets"), list)}
    conns = sorted(established_tcp(pid), key=lambda c: (c.loopback, not c.outbound, c.remote))
    rows = []
    for c in conns:
        row = c.to_dict()
        found = None if managed is None else _managed_by(c, managed, peers)
        row["managed"], row["managed_by"] = found or (None, None)
        rows.append(row)
    data: dict[str, Any] = {"pid": str(pid), "connections": rows,
                            "managed": None if managed is None else [dict(m) for m in managed],
                            "peers_not_resolved": late}
    from ._notify import one_line

    # Names, states and peers come from the process's answer: data, escaped (one_line),
    # or a name holding a newline or a terminal escape would forge the lines after it.
    lines = []
    if managed is not None:
        names = ", ".join(one_line(f"{m.get('name')} ({m.get('state')})")
                          for m in managed) or "none"
        lines.append(f"process {pid}: managed connections: {names}")
    if late:
        lines.append(f"peer names not resolved within {_PEER_LOOKUP_TIMEOUT:g} s (sockets to "
                     f"them are not marked managed): {one_line(', '.join(late))}")
    if not conns:
        lines.append(f"process {pid}: no established TCP connections")
        return data, "\n".join(lines)
    lines.append(f"process {pid}: {len(conns)} established TCP connection(s); outbound ones "
                 "are cut by a snapshot/restore unless registered with rehydrate.connections")
    width = max(len(c.remote) for c in conns)
    for c, row in zip(conns, rows, strict=True):
        marks = ["outbound" if c.outbound else "inbound"]
        if c.loopback:
            marks.append("loopback (survives a snapshot)")
        if row["managed_by"] == "peer":
            marks.append(f"probably managed: {one_line(row['managed'])} (same peer)")
        elif row["managed"] is not None:
            marks.append(f"managed: {one_line(row['managed'])}")
        elif managed is not None and c.outbound and not c.loopback:
            marks.append("NOT managed: cut by a restore")
        lines.append(f"  {c.remote.ljust(width)}  from {c.local}  {', '.join(marks)}")
    if managed is None:
        lines.append("(which of them are managed is known only for the process behind the "
                     "control socket: run without --pid)")
    return data, "\n".join(lines)
