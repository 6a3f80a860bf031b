"""The Agones SDK sidecar across snapshots and restores.

:class:`AgonesAdapter` talks to the SDK sidecar's REST gateway (``http://localhost:PORT``,
``AGONES_SDK_HTTP_PORT``, default 9358) with httpx, from one background thread running an
asyncio loop of its own, so the game's loop (or lack of one) never delays a health ping.

* ``install()`` (or ``rehydrate.start(extensions=[adapter])``; in an engine of one's own
  ``Lifecycle(extensions=[*DEFAULT_EXTENSIONS, adapter])``) registers the hooks and starts
  the health loop (``POST /health`` every ``health_interval`` seconds) and the watch loop
  (``GET /watch/gameserver``, NDJSON).
* Before a snapshot (hook ``rehydrate.agones.pause``, ``CONNECTIONS`` phase): both loops
  stop and the HTTP connections close — the whole Pod freezes, the sidecar too.
* After a restore or resume (hook ``rehydrate.agones.resync``): a new HTTP client; the
  health loop restarts with an immediate ping; ``GET /gameserver`` is fetched (retried
  with backoff until ``deadline``) and compared with what was known; every label and
  annotation set through the adapter is applied again; the watch loop restarts. A
  sidecar that does not answer within ``deadline``, or refuses ``GET /gameserver`` (a
  4xx but 408/429: at once), fails the hook with a clear reason, so the server stays not
  ready; the resync then goes on in the background (backoff up to 5 s, a refusal
  retried like an outage, never a second hook failure) until the sidecar gives the
  GameServer, and the hook counts as recovered (``engine.recovered``).
* When the engine is ready again after that restore, ``POST /ready`` goes out — only if
  :meth:`AgonesAdapter.ready` had been called before and the GameServer is not already
  ``Ready``, ``Allocated`` or ``Reserved`` (or ``RequestReady`` / ``Shutdown``). A
  successful run whose report finds the engine not ready yet (a duplicate notice of the
  same restore still queued: it reports nothing) waits for readiness instead. It is
  retried until answered, decided again before every attempt (the state the watch saw
  last, :meth:`~AgonesAdapter.shutdown`); ``allocate()``, ``reserve()`` and
  ``shutdown()`` stop it (none goes out while their request is in flight), and a refusal
  (4xx but 408/429) ends it. Not sent either after one of those calls made since the
  restore began or ended since (answered or failed), nor while the state known from
  before one is stale (until a GameServer in the state it made, or another GameServer,
  is seen; for a call that waited for the restore, or made before any GameServer was
  seen, the first one seen after it is its own; one made before any was seen is
  forgotten at the next pause); a pending deferred :meth:`~AgonesAdapter.ready` of the
  game's own is not replaced by it, nor lost when a pause cancels its retries. Never
  sent while paused for a snapshot (a Ready handed over as the pause came): the
  restore's is decided again by the report of the run that ends the pause, the game's
  own is deferred again.
* Between the pause and the restore, ``allocate()``, ``reserve()``, ``shutdown()`` and
  ``gameserver()`` wait for the restore (each at most ``deadline``, the freeze not
  counted, side by side): nothing is in flight or pooled in the image. From a rehydrate
  hook (while it runs: not a task it left running) they fail at once
  (:class:`AgonesError`): the restore cannot come while that hook runs. The background
  resync of a failed restore does not run while paused.

Health and watch errors are logged (the first of a streak as a warning) and retried with
backoff; they never fail a hook.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import numbers
import os
import random
import re
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import httpx

from rehydrate import Phase
from rehydrate.extensions import (
    BEFORE_USER_HOOKS,
    MAX_SECONDS,
    Engine,
    Probe,
    check_seconds,
    fresh_lock_after_fork,
    in_hook,
    redact,
    resolve_engine,
    shown,
)

from . import _bodies
from ._readiness import reason_of
from ._server import abandon

if TYPE_CHECKING:
    from rehydrate import Report, RestoreContext

__all__ = ["DEFAULT_PORT", "AgonesAdapter", "AgonesError", "AgonesUnavailable"]

log = logging.getLogger("rehydrate.agones")

# Retry jitter from the OS's generator, not the module-level one: a library must not
# advance the application's seeded ``random`` stream, and clones must not retry in lockstep.
_JITTER = random.SystemRandom()

T = TypeVar("T")

DEFAULT_PORT = 9358
"""The SDK sidecar's HTTP port when ``$AGONES_SDK_HTTP_PORT`` is not set."""
PORT_ENV = "AGONES_SDK_HTTP_PORT"

# States in which a restored server must not (or need not) ask to be Ready again.
_NO_READY_STATES = frozenset({"Ready", "RequestReady", "Allocated", "Reserved", "Shutdown"})
# The states that make the game's own deferred ready() needless or wrong: from Allocated or
# Reserved it is how a game returns its server to the pool after a match (Agones' reuse of
# an Allocated GameServer), so it goes out.
_NO_ASKED_READY_STATES = frozenset({"Ready", "RequestReady", "Shutdown"})

_CLOSED = "AgonesAdapter closed while this call waited for the sidecar"

# The state each superseding call puts the GameServer in: until a GameServer in that
# state (or another GameServer) is seen, the state known from before the call is stale.
_CALL_STATES = {"/allocate": "Allocated", "/reserve": "Reserved", "/shutdown": "Shutdown"}

# A call made while paused waits for the restore in slices of this many seconds: the
# freeze of the snapshot (counted by the monotonic clock, DESIGN.md) shows as one long
# slice, and counts as one, so a clone woken after any freeze does not find the deadline
# spent.
_WAIT_SLICE = 0.25

# Agones stores a key as the Kubernetes label or annotation key ``agones.dev/sdk-<key>``:
# ``sdk-<key>`` must be a Kubernetes name (at most 63 characters, alphanumerics at both
# ends, ``-_.`` inside). Checked here because a key stored while paused for a snapshot is
# only sent after the restore, when nobody is left to see the sidecar refuse it.
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_MAX_NAME = 63
_KEY_PREFIX = "sdk-"


class AgonesError(RuntimeError):
    """A request to the Agones SDK sidecar failed (the message names the request)."""


class AgonesUnavailable(AgonesError):
    """The sidecar did not answer within the deadline."""


def _port(port: int | None) -> int:
    if port is None:
        raw = os.environ.get(PORT_ENV, "").strip()
        if not raw:
            return DEFAULT_PORT
        # Agones' variable, not a rehydrate setting: its value is not rehydrate's to
        # repeat (environment values never are; key names only), so the error names the
        # variable and the rule. Digits only, at most 5: int() would take "+9_358".
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 5
                and 0 < int(raw) < 65536):
            raise ValueError(f"{PORT_ENV} must be a port number 1-65535 (its value is not "
                             "shown: environment values never are)")
        return int(raw)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"Agones SDK port must be an int in 1..65535, not "
                         f"{shown(port)}")
    return port


def _backoff(attempt: int, cap: float) -> float:
    """Exponential backoff with jitter for retry ``attempt`` (1-based): in [d/2, d]."""
    d: float = min(cap, 0.05 * 2.0 ** min(attempt - 1, 16))
    return d / 2 + _JITTER.uniform(0, d / 2)


def _check_metadata(kind: str, key: object, value: object) -> None:
    """ValueError (one line, never the value) for what the sidecar would refuse."""
    if not isinstance(key, str) or not key or not isinstance(value, str):
        raise ValueError(f"{kind} key and value must be strings (key non-empty)")
    name = _KEY_PREFIX + key
    if len(name) > _MAX_NAME or not _NAME.fullmatch(name):
        shown = key if len(key) <= 80 else key[:80] + "..."
        raise ValueError(
            f"{kind} key {shown!r} is not valid: Agones stores it as agones.dev/sdk-<key>, "
            f"so it must be at most {_MAX_NAME - len(_KEY_PREFIX)} characters of letters, "
            "digits, '-', '_' and '.', ending with a letter or digit")
    if kind == "label" and (len(value) > _MAX_NAME or not _LABEL_VALUE.fullmatch(value)):
        raise ValueError(
            f"label value for {key!r} is not a valid Kubernetes label value ({len(value)} "
            f"characters): at most {_MAX_NAME} letters, digits, '-', '_' and '.', "
            "beginning and ending with a letter or digit (or empty)")


def _reserve_seconds(seconds: object) -> str:
    """``seconds`` for ``POST /reserve`` (an int64 as a string), else ``ValueError``.

    Checked here because ``int()`` took anything: a negative number (Agones reserves for
    ever for anything not above 0, like 0), ``True`` (1 s), ``"10"``, 2.9 (cut to 2), and
    NaN or infinity failed with an error naming neither the argument nor the rule."""
    rule = (f"reserve(): seconds must be a whole number from 0 (until allocated) to "
            f"{MAX_SECONDS:.0f} (a year)")
    if isinstance(seconds, float) and seconds.is_integer():
        seconds = int(seconds)  # 30.0: a whole number
    if (isinstance(seconds, bool) or not isinstance(seconds, numbers.Integral)
            or not 0 <= int(seconds) <= MAX_SECONDS):
        raise ValueError(f"{rule}, not {shown(seconds)}")
    return str(int(seconds))


def _refusal(exc: BaseException) -> int | None:
    """The HTTP status when the sidecar refused the request itself (a 4xx other than
    408 and 429): sending the same request again cannot succeed."""
    cause = exc.__cause__ if isinstance(exc, AgonesError) else exc
    if isinstance(cause, httpx.HTTPStatusError):
        code = cause.response.status_code
        if 400 <= code < 500 and code not in (408, 429):
            return code
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Streak:
    """Logs the first failure of a streak as a warning, the rest at debug, and the end."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures = 0

    def failed(self, exc: BaseException) -> None:
        self.failures += 1
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        log.log(level, "Agones %s failed (%d in a row, retrying): %s", self.what,
                self.failures, _describe(exc))

    def ok(self) -> None:
        if self.failures:
            log.info("Agones %s works again after %d failure(s)", self.what, self.failures)
        self.failures = 0


class AgonesAdapter:
    """The Agones SDK sidecar, kept in step with rehydrate's snapshots and restores.

    ``port``: the sidecar's HTTP port (default ``$AGONES_SDK_HTTP_PORT``, else 9358).
    ``health_interval``: seconds between health pings (Agones' default ``periodSeconds``
    is 5, so 2 leaves room for two misses). ``deadline``: how long a restore waits for the
    sidecar to answer before it fails (the server then stays not ready).
    ``request_timeout``: per request. ``engine``: default, the process-wide engine.
    ``transport``: an httpx transport (tests).

    Sync methods block the caller; the ``a``-prefixed twins (:meth:`aready` …) await the
    same requests from any asyncio loop. Failed requests raise :class:`AgonesError`.
    """

    key = "agones"

    def __init__(
        self,
        port: int | None = None,
        health_interval: float = 2.0,
        *,
        engine: Engine | None = None,
        deadline: float = 10.0,
        request_timeout: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._port_arg = port
        self.port = _port(port)
        self.base_url = f"http://localhost:{self.port}"
        # At most a year: deadline=10**400 failed with an OverflowError naming nothing.
        self.health_interval = check_seconds(health_interval, "health_interval")
        self.deadline = check_seconds(deadline, "deadline")
        self.request_timeout = check_seconds(request_timeout, "request_timeout")
        self._engine_arg = engine
        self.engine: Engine | None = None
        self._transport = transport

        self._labels: dict[str, str] = {}
        self._annotations: dict[str, str] = {}
        self._want_ready = False
        self._ready_deferred = False  # ready() came while not ready; guarded by _lock
        self._ready_waiter = False  # a thread waits for readiness to send it; by _lock
        self._ready_asked = False  # a deferred Ready is ready()'s own; by _lock
        # Bumped by allocate()/reserve()/shutdown() (under _lock): a Ready decided before
        # one of them (a retry after a restore, a deferred ready()) is not sent after it.
        self._ready_epoch = 0
        # _ready_epoch when the latest restore began (under _lock): its Ready is decided
        # against that, so a call made while it ran (a restore hook's or a game thread's
        # allocate() once ready, before the report) is not followed by a Ready.
        self._restore_epoch = 0
        # After allocate()/reserve()/shutdown() was answered: the GameServer's identity
        # then ((None, None): the first one seen is its own) and the state it goes to.
        # The state known from before is stale (the watch follows the cluster late) until
        # a GameServer in that state, or another one, is seen; meanwhile no Ready is
        # decided on it.
        self._expected: tuple[tuple[Any, Any], str] | None = None
        self._ready_gate = asyncio.Lock()  # held while a POST /ready is in flight
        self._resumed = asyncio.Event()  # clear between the before-snapshot pause and
        self._resumed.set()  # the restore: the SDK calls made meanwhile wait for it
        # The kind of run whose resync missed its deadline: finished in the background.
        self._resync_kind: str | None = None
        self._recover_task: asyncio.Task[None] | None = None
        self._paused = False  # between the before-snapshot pause and the restore
        self._gameserver: dict[str, Any] | None = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.last_health_ack: float | None = None
        """``time.monotonic()`` of the latest acknowledged health ping."""
        self.health_acks = 0
        self.reason = "not installed"
        """Why the adapter is not in step with the sidecar ("" when it is)."""

        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._ready_task: asyncio.Task[None] | None = None
        self._ready_task_asked = False  # _ready_task sends the game's own ready()
        self._hooks: tuple[Any, ...] = ()
        # Kept across loop restarts: a streak of errors spanning a restore logs one warning.
        self._health_streak = _Streak("health ping")
        self._watch_streak = _Streak("GameServer watch")
        self._watch_skipped = False  # a watch line was skipped since the last GameServer
        self._watch_ends = 0  # streams that delivered and ended since the last change
        self._installed = False
        self._closed = False

    # -- the adapter's own loop ------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise RuntimeError("AgonesAdapter is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=self._run_loop, args=(loop,),
                                          name="rehydrate-agones", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_forever()
        if self._closed:
            # close() from a listener (this thread) cannot close a loop that runs it
            loop.close()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        try:
            loop = self._ensure_loop()
        except RuntimeError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking AgonesAdapter call from the adapter's own thread "
                               "(an on_change listener) would wait for ever: use the "
                               "a-prefixed twin with asyncio.ensure_future")
        fut = self._submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.CancelledError:
            if self._closed:  # close() failed it: not a timeout, nor a cancellation
                raise AgonesError(_CLOSED) from None
            raise
        except concurrent.futures.TimeoutError:
            if self._closed:
                # its loop may be closed: cancelling logged "Event loop is closed"
                raise AgonesError(_CLOSED) from None
            fut.cancel()
            raise AgonesUnavailable(
                f"Agones sidecar at {self.base_url} did not answer within {timeout:g}s"
            ) from None

    async def _await(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = self._submit(coro)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)  # Python 3.11+
            caller_cancelled = cancelling() if cancelling is not None else not fut.cancelled()
            if self._closed and fut.cancelled() and not caller_cancelled:
                raise AgonesError(_CLOSED) from None
            raise

    def _http(self) -> httpx.AsyncClient:
        """The current client (runs on the adapter's loop)."""
        if self._client is None:
            # Plain HTTP to localhost: no TLS, so no CA bundle to load (that costs ~100 ms,
            # on the restore path), and never through a proxy from the environment.
            self._client = httpx.AsyncClient(
                base_url=self.base_url, timeout=self.request_timeout,
                verify=False,  # noqa: S501 - http://localhost only: there is no TLS
                trust_env=False, transport=self._transport,
                headers={"content-type": "application/json", "accept-encoding": "identity"})
        return self._client

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            # The peer may be gone or hung: nothing to flush, never wait on it for long.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.aclose(), 1.0)

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                       timeout: float | None = None) -> dict[str, Any]:
        try:
            resp = await _bodies.request(  # at most MAX_BODY bytes of the answer
                self._http(), method, path, json=body,
                timeout=self.request_timeout if timeout is None else timeout)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            raise AgonesError(f"{method} {path} to the Agones sidecar at {self.base_url} "
                              f"failed: {_describe(exc)}") from exc
        if not resp.content:
            return {}
        try:  # also "[[[[…" nested deeper than json parses: RecursionError escaped the hook
            data = _bodies.loads(resp.content)
        except ValueError:
            raise AgonesError(f"{method} {path}: the Agones sidecar answered "
                              "something that is not JSON") from None
        return data if isinstance(data, dict) else {}

    async def _retry(self, method: str, path: str, body: dict[str, Any] | None,
                     until: float) -> dict[str, Any]:
        """The request, retried with backoff until the monotonic time ``until``; a refusal
        (4xx but 408 and 429) is raised at once: it would only be refused again."""
        attempt = 0
        # what the answers said, from any attempt: the last may only have had a sliver of
        # time and timed out
        answered: str | None = None
        while True:
            attempt += 1
            try:
                left = max(0.01, until - time.monotonic())
                return await self._request(method, path, body,
                                           timeout=min(self.request_timeout, left))
            except AgonesError as exc:
                if _refusal(exc) is not None:
                    raise
                if isinstance(exc.__cause__, httpx.HTTPStatusError):
                    answered = "kept refusing"
                elif exc.__cause__ is None:  # an answer, but not JSON
                    answered = answered or "kept answering what is not JSON to"
                left = until - time.monotonic()
                if left <= 0:
                    what = answered or "did not answer"
                    raise AgonesUnavailable(
                        f"Agones sidecar at {self.base_url} {what} {method} {path} "
                        f"within the {self.deadline:g}s deadline ({attempt} attempts; "
                        f"last: {_describe(exc.__cause__ or exc)})") from None
                await asyncio.sleep(min(left, _backoff(attempt, 1.0)))

    # -- install / close -------------------------------------------------------------

    def probe(self) -> Probe:
        """Usable wherever httpx is (a core dependency); says which sidecar it talks to."""
        origin = ("the port argument" if self._port_arg is not None
                  else f"${PORT_ENV}" if os.environ.get(PORT_ENV, "").strip()
                  else "the default port")
        return Probe(True, f"Agones SDK sidecar at {self.base_url} ({origin})")

    def install(self, engine: Engine | None = None) -> None:
        """Register the hooks in the engine and start the health and watch loops
        (idempotent)."""
        # before anything is marked: a wrong engine= (TypeError) left the adapter
        # "installed", and every later install() a silent no-op
        eng = resolve_engine(engine if engine is not None else self._engine_arg)
        with self._lock:
            if self._closed:
                raise RuntimeError("AgonesAdapter is closed")
            if self._installed:
                return
            self._installed = True
        self.engine = eng
        b = eng.builtins
        timeout = self.deadline + 10.0
        self._hooks = (
            # First of all restore hooks (before the environment refresh and every user
            # hook): the health window is what a restore most risks, and the connections
            # phase may wait long for other peers before the resync.
            b.register(self._on_restore_ping, phase=Phase.ENVIRONMENT,
                       order=BEFORE_USER_HOOKS - 1_000_000,
                       timeout=self.request_timeout + 5.0, name="rehydrate.agones.ping"),
            b.register(self._on_restore, phase=Phase.CONNECTIONS, timeout=timeout,
                       name="rehydrate.agones.resync"),
            b.register(self._on_snapshot, event="snapshot", phase=Phase.CONNECTIONS,
                       timeout=self.request_timeout + 5.0, name="rehydrate.agones.pause"),
        )
        eng.add_listener(self._on_report)
        eng.add_status("agones", self.status)
        self.reason = ""
        self._call(self._start_loops(), timeout=10.0)  # no I/O: only a busy machine waits

    def close(self) -> None:
        """Stop the loops, close the connections, detach from the engine (idempotent).
        Calls still waiting for the sidecar (a restore's resync included) fail at once
        with ``AgonesError`` saying the adapter was closed. From an :meth:`on_change`
        listener (the adapter's own thread) it returns without waiting: the loop stops
        once the listener returns."""
        with self._lock:
            if self._closed:
                return
            # First: nothing submitted from now on (a deferred Ready, a call) may start.
            self._closed = True
            loop, thread = self._loop, self._thread
        try:
            if loop is not None and thread is not None:
                if threading.current_thread() is thread:
                    # Waiting for the loop here would wait for this very call (it stalled
                    # 10 s, then "cannot join current thread"); _run_loop closes the loop.
                    loop.create_task(self._shutdown(stop=True))
                else:
                    with contextlib.suppress(Exception):
                        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
                    loop.call_soon_threadsafe(loop.stop)
                    thread.join(10)
                    if not thread.is_alive():
                        loop.close()
        finally:
            # Also when stopping failed: hooks left registered failed every later
            # snapshot and restore ("AgonesAdapter is closed").
            if self.engine is not None:
                for hook in self._hooks:
                    self.engine.builtins.unregister(hook)
                with contextlib.suppress(ValueError):
                    self.engine.remove_listener(self._on_report)
            self.reason = "closed"

    async def aclose(self) -> None:
        """:meth:`close` without blocking the caller's loop."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> AgonesAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loops -----------------------------------------------------------------------

    async def _start_loops(self) -> None:
        await self._stop_loops(keep_client=True)
        self._health_task = asyncio.create_task(self._health_loop())
        self._watch_task = asyncio.create_task(self._watch_loop())

    async def _shutdown(self, stop: bool = False) -> None:
        """close(): the loops, then every call still waiting (its caller gets ``_CLOSED``
        now, not a timeout after the loop stopped under it), then the loop itself."""
        await self._stop_loops()
        me = asyncio.current_task()
        waiting = [t for t in asyncio.all_tasks() if t is not me]
        for t in waiting:
            t.cancel()
        for t in waiting:
            with contextlib.suppress(BaseException):
                await t
        await self._drop_client()  # a call may have made one again meanwhile
        if stop:
            asyncio.get_running_loop().stop()

    async def _stop_loops(self, keep_client: bool = False) -> None:
        tasks = [t for t in (self._health_task, self._watch_task, self._ready_task,
                             self._recover_task) if t]
        self._health_task = self._watch_task = self._ready_task = None
        self._recover_task = None
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        if not keep_client:
            await self._drop_client()

    async def _health_loop(self) -> None:
        streak = self._health_streak
        while True:
            try:
                await self._request("POST", "/health", {})
            except AgonesError as exc:
                streak.failed(exc.__cause__ or exc)
                await asyncio.sleep(min(self.health_interval, _backoff(streak.failures, 1.0)))
                continue
            streak.ok()
            self.last_health_ack = time.monotonic()
            self.health_acks += 1
            await asyncio.sleep(self.health_interval)

    async def _watch_loop(self) -> None:
        streak = self._watch_streak
        timeout = httpx.Timeout(self.request_timeout, read=None)  # the stream idles
        while True:
            answered = delivered = False
            try:
                resp = await self._open_watch(timeout)
                try:
                    resp.raise_for_status()
                    answered = True
                    # bounded: a stream that never sends a newline must not grow a line
                    # in memory for ever (a ValueError, retried like any stream error)
                    async for line in _bodies.lines(resp):
                        if self._watched(line):
                            # Not the 200 itself: grpc-gateway answers a watch that fails
                            # with 200, an {"error": ...} line and the end; taken for a
                            # working stream, it reset the backoff and the watch spun.
                            streak.ok()
                            delivered = True
                finally:
                    await resp.aclose()
                if not delivered:
                    raise AgonesError("the watch stream ended")
                # It worked, then ended (a sidecar restarted, a proxy's idle timeout): no
                # failure, but said once until the GameServer changes again.
                self._watch_ends += 1
                log.log(logging.INFO if self._watch_ends == 1 else logging.DEBUG,
                        "Agones watch stream ended: watching again")
            except (httpx.HTTPError, AgonesError, ValueError) as exc:
                streak.failed(exc)
            delay = _backoff(max(streak.failures, 1), 5.0)
            if answered:
                # A real sidecar keeps the stream open: one answered and then ended (an
                # error line, or even after a GameServer) must not be asked again many
                # times a second.
                delay = max(delay, self.health_interval)
            await asyncio.sleep(delay)

    async def _open_watch(self, timeout: httpx.Timeout) -> httpx.Response:
        """The watch response, whose headers must come within ``request_timeout`` (only
        its body may idle). Not ``asyncio.wait_for``: before Python 3.12 it can swallow
        the cancellation that stops this loop before a snapshot."""
        client = self._http()
        request = client.build_request("GET", "/watch/gameserver", timeout=timeout)
        send = asyncio.ensure_future(client.send(request, stream=True))
        try:
            done, _ = await asyncio.wait({send}, timeout=self.request_timeout)
        except BaseException:
            # Stopped (close(), the before-snapshot pause) maybe in the very step the
            # request failed (a sidecar down): its error, never read, was logged at ERROR
            # with a long httpx traceback ("Task exception was never retrieved").
            abandon(send)
            raise
        if not done:
            abandon(send)
            raise AgonesError(f"GET /watch/gameserver: no answer within "
                              f"{self.request_timeout:g}s")
        return send.result()

    def _watched(self, line: str) -> bool:
        """True when ``line`` delivered a GameServer. An ``{"error": ...}`` line (how
        grpc-gateway fails a stream it already answered with 200) is an ``AgonesError``;
        another line that is no GameServer is skipped, with one warning until a
        GameServer arrives again."""
        if not line.strip():
            return False
        try:  # _bodies.loads: a line nested too deep for json ended the watch loop
            data = _bodies.loads(line)
        except ValueError:
            data = None
        if isinstance(data, dict) and "error" in data and "result" not in data:
            raise AgonesError(f"the watch stream sent an error{_stream_error(data['error'])}")
        result = data.get("result") if isinstance(data, dict) else None
        if not _gameserver_shaped(result):
            level = logging.DEBUG if self._watch_skipped else logging.WARNING
            self._watch_skipped = True
            log.log(level, "Agones watch stream: ignoring a line that is not "
                    "{\"result\": {...}} (%d bytes)", len(line))
            return False
        self._watch_skipped = False
        self._set_gameserver(result)
        return True

    def _set_gameserver(self, gs: dict[str, Any]) -> None:
        expected = self._expected
        if expected is not None:
            seen = _identity(gs)
            if gs["status"]["state"] == expected[1] or (
                    expected[0] != (None, None) and seen != expected[0]):
                self._expected = None
            elif expected[0] == (None, None):
                # Called before any GameServer was seen: the first one seen is the one
                # the call was made for (a call waiting in the pause goes out to the
                # sidecar of the Pod restored, a clone's included), not another one.
                self._expected = (seen, expected[1])
        if gs == self._gameserver:
            return  # every (re)opened watch stream repeats the current one first
        self._gameserver = gs
        self._watch_ends = 0
        for fn in list(self._listeners):
            try:
                fn(gs)
            except Exception:
                log.exception("GameServer listener %r failed", fn)

    # -- hooks -----------------------------------------------------------------------

    def _on_snapshot(self) -> None:
        self._call(self._pause(), timeout=self.request_timeout + 4.0)

    async def _pause(self) -> None:
        self._paused = True
        self._resumed.clear()
        if self._expected is not None and self._expected[0] == (None, None):
            # A call made before any GameServer was seen went to this Pod's: the first
            # one seen after the restore may be a clone's, in a new Pod, which it never
            # reached (taken for its target, the clone was never asked to be Ready).
            self._expected = None
        task = self._ready_task
        if (task is not None and not task.done() and self._ready_task_asked
                and self.engine is not None):
            # The game's own ready() still retried: pending again, not lost with the task
            # _stop_loops cancels (sent once rehydrate is ready after the restore).
            self._defer_ready(self.engine, asked=True)
        # A resync still owed to a failed restore is not run from the image: the restore
        # or resume after this snapshot runs one of its own.
        self._resync_kind = None
        await self._stop_loops()

    async def _wait_restored(self, what: str, hook: bool = False) -> None:
        """A call between the before-snapshot pause and the restore waits for the
        restore (at most ``deadline``, not counting the freeze): sent at once, it left a
        request in flight or a connection pooled in the image. ``hook``: the call comes
        from a rehydrate hook, which the restore it would wait for cannot follow."""
        if not self._paused:
            return
        if hook:
            raise AgonesError(
                f"{what} from a rehydrate hook while the adapter is paused for a snapshot "
                "(hook rehydrate.agones.pause ran): the restore it would wait for cannot "
                "come before this hook returns; read known_gameserver, or make the call "
                "in a before-snapshot hook that runs before the pause (APPLICATION phase)")
        log.info("%s while paused for a snapshot: sent after the restore", what)
        loop = asyncio.get_running_loop()
        resumed = asyncio.ensure_future(self._resumed.wait())
        left = self.deadline
        try:
            while not resumed.done():
                if left <= 0:
                    raise AgonesUnavailable(
                        f"{what}: the adapter is paused for a snapshot and no restore or "
                        f"resume came within the {self.deadline:g}s deadline")
                step = min(left, _WAIT_SLICE)
                began = loop.time()
                # asyncio.wait, not wait_for: before Python 3.12 wait_for can swallow the
                # cancellation of close()
                await asyncio.wait({resumed}, timeout=step)
                # The freeze of the snapshot passes as one long slice: counted as one.
                left -= min(loop.time() - began, step)
        finally:
            resumed.cancel()

    def _on_restore_ping(self) -> None:
        self._call(self._restart_health(), timeout=self.request_timeout + 4.0)

    async def _restart_health(self) -> None:
        """A new client (pooled connections died with the freeze) and the health loop
        pinging at once; the resync later reuses both."""
        await self._stop_loops()
        with self._lock:
            self._restore_epoch = self._ready_epoch
        self._paused = False
        self._resumed.set()
        self._health_task = asyncio.create_task(self._health_loop())

    def _on_restore(self, ctx: RestoreContext) -> None:
        self.reason = "restoring: waiting for the Agones sidecar"
        self._resync_kind = None
        try:
            # _resync keeps to the deadline itself; this only bounds a stuck loop
            self._call(self._resync(ctx.kind), timeout=self.deadline + 5.0)
        except AgonesError as exc:
            if self._closed:
                raise
            self.reason = redact(str(exc))  # shown in status(): a managed secret never is
            # Not heard in time, or GET /gameserver refused: finished in the background
            # once the sidecar gives the GameServer (_on_report starts it, when the engine
            # has counted this failure, so it can be forgotten). A refusal left the known
            # GameServer, the labels and the annotations stale until the next restore.
            self._resync_kind = ctx.kind
            raise

    async def _resync(self, kind: str) -> None:
        until = time.monotonic() + self.deadline
        if self._health_task is None or self._health_task.done():
            await self._restart_health()  # the ping hook did not run (removed, disabled)
        try:
            await self._sync(kind, until)
        finally:
            # Also after a missed deadline: the stream retries on its own and shows the
            # GameServer again once the sidecar answers. Not once closed: a task left
            # pending on a stopped loop.
            if not self._closed:
                if self._watch_task is not None:
                    self._watch_task.cancel()
                self._watch_task = asyncio.create_task(self._watch_loop())
        self.reason = ""

    async def _sync(self, kind: str, until: float) -> None:
        """The GameServer fetched and compared, every label and annotation applied."""
        before = self._gameserver
        gs = self._checked(await self._retry("GET", "/gameserver", None, until))
        _compare(before, gs, kind)
        self._set_gameserver(gs)
        for what, store in (("label", self._labels),
                            ("annotation", self._annotations)):
            for item in list(store.items()):
                await self._reapply(what, item, until, kind)

    async def _start_recovery(self, kind: str) -> None:
        if self._paused or self._closed:
            # Paused for a snapshot since the failed run's report was published: its
            # requests would be in the image; the next restore resyncs anyway.
            return
        if self._recover_task is not None:
            self._recover_task.cancel()
        self._recover_task = asyncio.create_task(self._finish_resync(kind))

    async def _finish_resync(self, kind: str) -> None:
        """The resync whose deadline the sidecar missed, or whose ``GET /gameserver`` it
        refused, retried until the sidecar gives the GameServer; then the hook's failure
        is forgotten (``engine.recovered``), so the process is ready again (and asks to be
        Ready when it must) without waiting for another restore. Its failures are logged,
        never a hook's: a refusal is retried like an outage (a sidecar that answers 403 or
        404 while its GameServer is being set up gives it later), with backoff capped at
        5 s. Cancelled by a new pause or restore, and by close()."""
        log.info("Agones resync after the %s: retrying in the background until the "
                 "sidecar gives the GameServer", kind)
        attempt = 0
        while True:
            if self._paused:
                return  # _pause cancels this task too; never a request from the image
            attempt += 1
            began = time.monotonic()
            try:
                await self._sync(kind, began + self.deadline)
                break
            except AgonesError as exc:
                log.debug("Agones resync after the %s still failing (%d attempts): %s",
                          kind, attempt, _describe(exc.__cause__ or exc))
            await asyncio.sleep(_backoff(attempt, 5.0))
        self._resync_kind = None
        self.reason = ""
        log.info("Agones sidecar answers again: the resync after the %s is done", kind)
        eng = self.engine
        if eng is not None and len(self._hooks) > 1:
            # since: a newer run that failed after this attempt began is not taken back
            eng.recovered(self._hooks[1], since=began)

    async def _reapply(self, what: str, item: tuple[str, str], until: float,
                       kind: str) -> None:
        key, value = item
        store = self._labels if what == "label" else self._annotations
        try:
            await self._retry("PUT", f"/metadata/{what}", {"key": key, "value": value},
                              until)
        except AgonesError as exc:
            code = _refusal(exc)
            if code is None:
                raise
            # Refused now means refused after every restore: keeping it would fail each
            # resync (and so keep the server from Ready) for one bad key.
            if store.get(key) == value:
                del store[key]
            log.warning("Agones sidecar refused %s %r after the %s (HTTP %d): dropped, "
                        "the others are applied", what, key, kind, code)

    def _on_report(self, report: Report) -> None:
        if report.kind == "snapshot":
            return
        kind = self._resync_kind
        if kind is not None and not report.ok:
            # Now that the engine counted the resync's failure, a success can forget it.
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self._submit(self._start_recovery(kind))
        if not self._want_ready:
            return
        eng = self.engine
        if eng is None:
            return
        if report.ok and not eng.is_ready():
            # A second notice of this same restore (the clock-jump detector and
            # ``rehydrate notify restore`` both saw it) is queued behind the run: it runs
            # nothing and publishes no report, so readiness returns without one. Dropping
            # the Ready here left a clone's new GameServer Scheduled for good.
            log.info("restore done, but rehydrate is not ready yet (%s): Ready goes out "
                     "when it is", reason_of(eng.status()))
            self._defer_ready(eng, asked=False)  # this report decides, by the state
            return
        if not eng.is_ready():
            # Degraded: a required hook failed. It may recover without a new run (a
            # secret or certificate that arrives late, ``engine.recovered()``), which
            # publishes no report either: Ready goes out then.
            log.warning("not marking the GameServer Ready yet: rehydrate is not ready (%s); "
                        "Ready goes out if it becomes ready", reason_of(eng.status()))
            self._defer_ready(eng, asked=False)
            return
        with self._lock:
            self._ready_deferred = False  # this report decides, by the GameServer's state
            asked, self._ready_asked = self._ready_asked, False  # ... or ready()'s own
            epoch = self._ready_epoch if asked else self._restore_epoch
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self._submit(self._ready_after_restore(asked=asked, epoch=epoch))

    def _defer_ready(self, eng: Engine, *, asked: bool) -> None:
        """Send Ready once ``eng`` is ready: readiness can come back without a report (a
        late heartbeat judged a busy stall, not a restore; a duplicate restore notice that
        ran nothing), and a report alone was awaited. ``asked``: as for
        :meth:`_ready_after_restore`; once the game's own ready() is deferred, it stays
        so until sent or superseded (a restore's report deferring it again must not turn
        it into a Ready an Allocated server skips: it was dropped)."""
        with self._lock:
            if self._closed:
                return
            self._ready_deferred = True
            self._ready_asked = self._ready_asked or asked
            if self._ready_waiter:
                return
            self._ready_waiter = True
        threading.Thread(target=self._wait_then_ready, args=(eng,), daemon=True,
                         name="rehydrate-agones-ready").start()

    def _wait_then_ready(self, eng: Engine) -> None:
        while True:
            with self._lock:
                if self._closed or not self._ready_deferred:
                    self._ready_waiter = False
                    return
            if eng.wait_ready(0.5):  # bounded, so that close() is noticed
                with self._lock:
                    self._ready_waiter = False
                    if self._closed or not self._ready_deferred:
                        return
                    self._ready_deferred = False
                    asked, self._ready_asked = self._ready_asked, False
                    # The game's own ready() is superseded by a later call (which clears
                    # _ready_asked); a restore's Ready by any call since it began.
                    epoch = self._ready_epoch if asked else self._restore_epoch
                with contextlib.suppress(RuntimeError):  # closed meanwhile
                    self._submit(self._deferred_ready(eng, asked, epoch))
                return

    async def _deferred_ready(self, eng: Engine, asked: bool, epoch: int) -> None:
        if not self._want_ready:
            return  # shutdown() since
        if not eng.is_ready():
            self._defer_ready(eng, asked=asked)  # not ready again already: wait once more
            return
        await self._ready_after_restore(asked=asked, epoch=epoch)

    def _ready_unwanted(self, asked: bool, epoch: int) -> str | None:
        """Why the Ready decided with ``epoch`` must not be sent (now), else None."""
        if self._closed:
            return "the adapter is closed"
        if not self._want_ready:
            return "shutdown() was called since"
        if epoch != self._ready_epoch or (self._expected is not None and not asked):
            # ... or before the restore began, and the GameServer is not seen in the
            # state it went to yet: the state known is stale
            return "allocate(), reserve() or shutdown() was called since"
        state = (self._gameserver or {}).get("status", {}).get("state", "")
        if state in (_NO_ASKED_READY_STATES if asked else _NO_READY_STATES):
            return f"the GameServer is {state}"
        if not state and not asked:  # never Ready blind: an Allocated one would be allocated twice
            return "the GameServer's state is unknown"
        return None

    async def _ready_after_restore(self, asked: bool = False, epoch: int = 0) -> None:
        """``asked``: ready() itself was deferred, not a restore: an unknown state (no
        GameServer fetched yet) does not stop it, as it would not have stopped ready(),
        and neither do ``Allocated`` or ``Reserved`` (the game returns its server to the
        pool). ``epoch``: :attr:`_ready_epoch` when it was decided. Before every attempt
        the decision is made again, on the state the watch stream saw last."""
        current = self._ready_task
        if current is not None and not current.done():
            if self._ready_task_asked and not asked:
                # The game's own ready() is pending (the readiness waiter took it before
                # this report did): it goes out in every state this one would, and more.
                # Replacing it lost the Ready of an Allocated server the game returned.
                log.debug("the restore's Ready is left to the pending deferred ready()")
                return
            current.cancel()
        self._ready_task = asyncio.current_task()
        self._ready_task_asked = asked
        what = "the deferred ready()" if asked else "after the restore"
        state = (self._gameserver or {}).get("status", {}).get("state", "")
        attempt = 0
        try:
            while True:
                attempt += 1
                async with self._ready_gate:  # allocate() waits for an attempt in flight
                    why = self._ready_unwanted(asked, epoch)
                    if why is not None:
                        level = (logging.WARNING if why.endswith("unknown") and attempt == 1
                                 else logging.INFO)
                        log.log(level, "not asking to be Ready (%s): %s", what, why)
                        return
                    if self._paused:
                        # Handed over before a snapshot's pause came (a report that found
                        # rehydrate ready just before the pass began): sent now, it is a
                        # request in the image, and a clone's GameServer never hears it.
                        self._keep_ready_for_restore(asked, what)
                        return
                    try:
                        await self._request("POST", "/ready", {})
                        if asked:
                            self._expected = None  # the game's call is the newer one
                        log.info("GameServer marked Ready again (%s; was %s)", what,
                                 state or "unknown")
                        return
                    except AgonesError as exc:
                        code = _refusal(exc)
                        if code is not None:
                            # Sent again it would only be refused again, for ever.
                            log.warning("Agones sidecar refused POST /ready (%s) with HTTP "
                                        "%d: not asked again before the next restore",
                                        what, code)
                            return
                        level = logging.WARNING if attempt == 1 else logging.DEBUG
                        log.log(level, "POST /ready (%s) failed (retrying): %s", what,
                                _describe(exc.__cause__ or exc))
                await asyncio.sleep(_backoff(attempt, 5.0))
        finally:
            if self._ready_task is asyncio.current_task():
                self._ready_task = None

    def _keep_ready_for_restore(self, asked: bool, what: str) -> None:
        """A Ready decided while paused for a snapshot, kept for after the restore: the
        game's own ready() is deferred again (sent once rehydrate is ready after it); the
        restore's is decided again by the report of the run that ends the pause (every
        run that resumes the adapter reports, and ``_want_ready`` still holds)."""
        eng = self.engine
        if asked and eng is not None:
            log.info("%s: paused for a snapshot, sent once rehydrate is ready after the "
                     "restore", what)
            self._defer_ready(eng, asked=True)
        else:
            log.info("not asking to be Ready (%s) while paused for a snapshot: decided "
                     "again after the restore", what)

    async def _supersede_ready(self, what: str) -> None:
        """allocate(), reserve() or shutdown(): a Ready decided before (retried after a
        restore, or deferred) is not sent after it — it marked an Allocated server Ready,
        and a second match landed on it. An attempt already in flight is answered first
        (the caller then holds the gate across its own request), so that the sidecar
        never sees it after this call."""
        with self._lock:
            self._ready_epoch += 1
            dropped = self._ready_deferred
            self._ready_deferred = self._ready_asked = False
        task, self._ready_task = self._ready_task, None
        if task is not None and not task.done():
            dropped = True
            if not self._ready_gate.locked():
                task.cancel()
        if dropped:
            log.info("%s: the pending Ready is not sent", what)

    # -- the SDK ---------------------------------------------------------------------

    async def _ready(self) -> None:
        eng = self.engine
        if eng is not None and not eng.is_ready():
            # A restore is running or failed: Ready goes out when rehydrate is ready.
            self._want_ready = True
            log.info("ready() while rehydrate is not ready: deferred until it is")
            self._defer_ready(eng, asked=True)
            return
        try:
            await self._request("POST", "/ready", {})
        except AgonesError as exc:
            if _refusal(exc) is None:
                # Not heard (a sidecar starting after the game, say): still wanted, so a
                # restore asks for it; sending it now again is the caller's choice.
                self._want_ready = True
            raise
        self._want_ready = True
        self._expected = None  # the game's own Ready is newer than any earlier call

    async def _metadata(self, kind: str, key: str, value: str) -> None:
        _check_metadata(kind, key, value)
        if self._paused:
            # Between the pause and the restore a request would open a connection that
            # the snapshot freezes; the resync PUTs every remembered one anyway.
            (self._labels if kind == "label" else self._annotations)[key] = value
            log.debug("%s %s set while paused for a snapshot: sent after the restore",
                      kind, key)
            return
        store = self._labels if kind == "label" else self._annotations
        try:
            await self._request("PUT", f"/metadata/{kind}", {"key": key, "value": value})
        except AgonesError as exc:
            if _refusal(exc) is None:
                store[key] = value  # not heard: still wanted, as for ready()
            raise
        store[key] = value

    def ready(self) -> None:
        """``POST /ready``: this server can take players. Remembered: after a restore the
        adapter asks again when the GameServer needs it — also when this call failed
        without an answer (``AgonesError``; not when the sidecar refused it with a 4xx).
        Not retried here: a game whose sidecar may start after it calls again. While
        rehydrate is not ready (a snapshot, a restore running or failed) it is deferred
        and sent once it is — also to an ``Allocated`` or ``Reserved`` GameServer (the
        game returns it to the pool), not to a ``Ready``, ``RequestReady`` or
        ``Shutdown`` one, nor after a later :meth:`allocate`, :meth:`reserve` or
        :meth:`shutdown`."""
        self._call(self._ready())

    async def aready(self) -> None:
        await self._await(self._ready())

    def set_label(self, key: str, value: str) -> None:
        """``PUT /metadata/label`` (stored as ``agones.dev/sdk-<key>``); re-applied after
        every restore, also when this call failed without an answer (as for
        :meth:`ready`)."""
        self._call(self._metadata("label", key, value))

    async def aset_label(self, key: str, value: str) -> None:
        await self._await(self._metadata("label", key, value))

    def set_annotation(self, key: str, value: str) -> None:
        """``PUT /metadata/annotation`` (stored as ``agones.dev/sdk-<key>``); re-applied
        after every restore."""
        self._call(self._metadata("annotation", key, value))

    async def aset_annotation(self, key: str, value: str) -> None:
        await self._await(self._metadata("annotation", key, value))

    async def _simple(self, path: str, body: dict[str, Any] | None = None,
                      hook: bool = False) -> None:
        what = f"POST {path}"
        state = _CALL_STATES[path]
        await self._supersede_ready(what)
        waited, before = False, None
        while True:
            if self._paused:
                waited, before = True, self._gameserver  # known from before the restore
            # Not under the gate: a hook's call fails at once, and each caller waits its
            # own deadline, not behind another's.
            await self._wait_restored(what, hook)
            # Held across the request: a Ready attempt (decided before this call, or not
            # yet seeing it in the epoch) is either answered before it or decided after.
            async with self._ready_gate:
                if self._paused:
                    continue  # paused again while queued for the gate
                try:
                    await self._request("POST", path, {} if body is None else body)
                finally:
                    with self._lock:
                        # Answered or not (a 503 may have been applied): a Ready decided
                        # before it ended, the restore's included when the call waited
                        # for that restore, is not sent after it.
                        self._ready_epoch += 1
                gs = self._gameserver
                if waited and gs is before:
                    # Sent to the Pod restored, maybe a clone's in a new Pod: the first
                    # GameServer seen is its target, not another one.
                    self._expected = ((None, None), state)
                elif (gs or {}).get("status", {}).get("state") == state:
                    self._expected = None  # seen in that state already: nothing stale
                else:
                    self._expected = (_identity(gs), state)
                return

    def allocate(self) -> None:
        """``POST /allocate``: mark this server Allocated (self-allocation). A Ready still
        pending (retried after a restore, or a deferred :meth:`ready`) is not sent after
        it, nor a restore's Ready decided on the state known before it (stale until the
        watch or a fetch shows the GameServer ``Allocated``). Between the before-snapshot
        pause and the restore it waits for the restore (at most ``deadline``, not
        counting the freeze, then :class:`AgonesUnavailable`); from a rehydrate hook then
        (while it runs) it raises :class:`AgonesError` at once."""
        self._call(self._simple("/allocate", hook=in_hook()))

    async def aallocate(self) -> None:
        await self._await(self._simple("/allocate", hook=in_hook()))

    def reserve(self, seconds: int) -> None:
        """``POST /reserve``: Reserved for ``seconds`` (0: until allocated), a whole number
        up to a year. A pending Ready and the snapshot pause: as for :meth:`allocate`."""
        body = {"seconds": _reserve_seconds(seconds)}
        self._call(self._simple("/reserve", body, hook=in_hook()))

    async def areserve(self, seconds: int) -> None:
        body = {"seconds": _reserve_seconds(seconds)}
        await self._await(self._simple("/reserve", body, hook=in_hook()))

    def shutdown(self) -> None:
        """``POST /shutdown``: ask Agones to shut this server down. The adapter no longer
        asks to be Ready after a restore. A pending Ready and the snapshot pause: as for
        :meth:`allocate`."""
        self._want_ready = False
        self._call(self._simple("/shutdown", hook=in_hook()))

    async def ashutdown(self) -> None:
        self._want_ready = False
        await self._await(self._simple("/shutdown", hook=in_hook()))

    def gameserver(self) -> dict[str, Any]:
        """``GET /gameserver``: the GameServer as the sidecar sees it (snake_case JSON).
        Between the before-snapshot pause and the restore it waits for the restore (at
        most ``deadline``, not counting the freeze; from a rehydrate hook it raises
        :class:`AgonesError` at once); :attr:`known_gameserver` answers without a
        request."""
        return self._call(self._get_gameserver(in_hook()))

    async def agameserver(self) -> dict[str, Any]:
        return await self._await(self._get_gameserver(in_hook()))

    async def _get_gameserver(self, hook: bool = False) -> dict[str, Any]:
        await self._wait_restored("GET /gameserver", hook)
        gs = self._checked(await self._request("GET", "/gameserver"))
        self._set_gameserver(gs)
        return gs

    def _checked(self, gs: dict[str, Any]) -> dict[str, Any]:
        if not _gameserver_shaped(gs):
            raise AgonesError(f"GET /gameserver: the Agones sidecar at {self.base_url} "
                              "answered something that is not a GameServer (object_meta "
                              "must be an object and status.state a string)")
        return gs

    def on_change(self, fn: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]],
                                                                          None]:
        """Call ``fn(gameserver)`` for every change of the GameServer the watch stream (or
        a fetch) delivers — not again for one equal to the latest, as every reopened
        stream repeats it; usable as a decorator. Runs on the adapter's thread: keep it
        short."""
        self._listeners.append(fn)
        return fn

    @property
    def known_gameserver(self) -> dict[str, Any] | None:
        """The latest GameServer seen (watch stream or fetch), without a request."""
        return self._gameserver

    def status(self) -> dict[str, Any]:
        """What ``rehydrate status`` shows under ``agones``."""
        gs = self._gameserver or {}
        meta, st = gs.get("object_meta", {}), gs.get("status", {})
        ack = self.last_health_ack
        return {
            "sidecar": self.base_url,
            "gameserver": meta.get("name"),
            "state": st.get("state"),
            "ready_requested": self._want_ready,
            "health_acks": self.health_acks,
            "last_health_ack_age": None if ack is None else round(time.monotonic() - ack, 3),
            "reason": self.reason,
        }


def _stream_error(err: object) -> str:
    """The status codes of grpc-gateway's ``{"error": {...}}`` (its message is not
    repeated: a sidecar's text of any length)."""
    if not isinstance(err, dict):
        return ""
    codes = [f"{name} {err[key]}" for key, name in (("http_code", "HTTP"),
                                                    ("grpc_code", "gRPC code"))
             if type(err.get(key)) is int]
    return f" ({', '.join(codes)})" if codes else ""


def _gameserver_shaped(gs: object) -> TypeGuard[dict[str, Any]]:
    """An object whose ``object_meta`` is an object and whose ``status.state`` is a
    non-empty string: every GameServer has one, and the adapter decides on it (an empty
    answer taken for a GameServer of unknown state once marked an Allocated one Ready)."""
    if not isinstance(gs, dict) or not isinstance(gs.get("object_meta", {}), dict):
        return False
    status = gs.get("status")
    return isinstance(status, dict) and isinstance(status.get("state"), str) and bool(
        status["state"])


def _identity(gs: dict[str, Any] | None) -> tuple[Any, Any]:
    meta = (gs or {}).get("object_meta", {})
    return meta.get("name"), meta.get("uid")


def _compare(before: dict[str, Any] | None, after: dict[str, Any], kind: str) -> None:
    """Log what changed in the GameServer across the snapshot (name, uid, state)."""
    def ident(gs: dict[str, Any] | None) -> tuple[Any, Any, Any]:
        gs = gs or {}
        meta, st = gs.get("object_meta", {}), gs.get("status", {})
        return meta.get("name"), meta.get("uid"), st.get("state")

    old, new = ident(before), ident(after)
    if before is None:
        log.info("after %s: GameServer %s (%s)", kind, new[0], new[2])
    elif old[:2] != new[:2]:
        log.info("after %s: a new GameServer %s (uid %s, %s); was %s (uid %s, %s)",
                 kind, new[0], new[1], new[2], *old)
    elif old[2] != new[2]:
        log.info("after %s: GameServer %s went %s -> %s", kind, new[0], old[2], new[2])
    if new[2] == "Unhealthy":
        log.warning("after %s: GameServer %s is Unhealthy: Agones will replace it",
                    kind, new[0])
