"""ASGI middleware that keeps traffic away from a process that is not ready.

Wrap any ASGI application (Starlette, FastAPI, KServe's app, a bare ASGI callable)::

    from rehydrate.adapters.asgi import ReadinessGate

    app = ReadinessGate(FastAPI(...))

* ``GET /healthz``: 200 while the process is alive (a liveness probe must not restart a
  pod that is restoring);
* ``GET /readyz``: 200 when ready, else 503 with ``{"ready": false, "state": ...,
  "reason": ...}`` (the reason names failed hooks, never their error text) — point the
  readiness probe here; ``GET /readyz?wait=S`` holds the
  answer until the process is ready or ``S`` seconds (at most ``max_wait``) have passed:
  one request for a deploy script, a test or a benchmark to wait with, instead of a
  polling loop whose requests the event loop would have to answer while the restore
  hooks need the GIL;
* ``GET /rehydrate/status``: :func:`rehydrate.status` as JSON — a public view (states,
  names and outcomes; no addresses, paths or error text) unless ``status_detail=True``;
* every other request gets 503 with ``Retry-After`` while the engine is restoring,
  snapshotting or degraded;
* before a snapshot the gate's hook (``rehydrate.asgi.drain``, the first before-snapshot
  hook to run) waits until the requests already admitted have finished — new ones are
  refused from the moment the snapshot starts — and fails the snapshot when some are
  still running after ``drain_timeout`` seconds (their connections would be cut by the
  snapshot anyway) — a streaming response open that long too (``exempt`` it, or bound it);
* after a restore or resume requests are admitted again only once every required restore
  hook has succeeded (the gate asks :meth:`~rehydrate.Lifecycle.is_ready`, which says "not
  ready" in a clone from the moment it resumes until its hooks have run);
* lifespan: on startup the engine's detection is started (:func:`rehydrate.start`, with
  the server's event loop for ``async`` hooks), on shutdown stopped — by the last of the
  servers in the process whose gates share the engine;
* one server process per container: a worker whose control socket another process
  serves (a sibling of ``uvicorn --workers N``) would not hear ``rehydrate notify`` and
  would serve across a snapshot ungated — its lifespan startup fails, with one line,
  unless that process lets the socket go within ``control_grace`` seconds (the old worker
  of a reload: gunicorn's ``HUP`` starts the new worker first).

Pure ASGI 3: no Starlette dependency; works under uvicorn and with httpx's ASGI transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import select
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any, cast

from .. import Phase
from ..extensions import (
    MAX_SECONDS,
    check_seconds,
    fresh_lock_after_fork,
    resolve_engine,
    shown,
)
from ._readiness import public_status, readiness

if TYPE_CHECKING:
    from .. import Hook, Lifecycle
    from ..detect import Detector

__all__ = ["ASGIApp", "DrainTimeout", "ReadinessGate", "health_app"]

log = logging.getLogger("rehydrate.adapters.asgi")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
"""An ASGI 3 application: ``await app(scope, receive, send)``."""

_DRAIN_KEY = "rehydrate.asgi"
_DETECTION_KEY = "rehydrate.asgi.detection"
_DRAIN_GRACE = 5.0
"""Seconds the drain hook's timeout allows past ``drain_timeout`` (its own limit speaks
first, with the number of requests still in flight)."""
_RECHECK = 0.05
"""Seconds between readiness checks of a waiting ``/readyz?wait=``: a report wakes it at
once; this bounds the wait when readiness changes without one (a freeze that was no
restore)."""
_TRY_AGAIN_LATER = 1013  # WebSocket close code: "try again later"
_FIRST_LOOK = 0.05
_LAST_LOOK = 0.5
"""Seconds between two looks at a control socket another process serves, while the
startup waits for it to be let go (doubling from the first to the last): the holder's
exit wakes the wait at once where the kernel has ``pidfd_open``; a holder that only stops
serving is seen at the next look."""


class _NotLifespan(Exception):
    """Raised to an application that sent a non-lifespan message on the lifespan scope."""


class _StartupRefused(Exception):
    """Raised to an application whose lifespan startup the gate refused (the server was
    sent ``lifespan.startup.failed`` already)."""


class DrainTimeout(RuntimeError):
    """Requests were still in flight when the drain deadline passed (the snapshot fails)."""


class _Drain:
    """Per engine: requests in flight through every gate, and the before-snapshot hook
    that waits for them."""

    def __init__(self, engine: Lifecycle) -> None:
        # The per-request path takes no lock: list.append/pop are atomic under the GIL,
        # and len() of the list is the number in flight. The drain publishes that it
        # waits before it looks at the count; a request leaving looks at the count before
        # it looks for a waiter: whichever comes last sees the other.
        self._active: list[None] = []
        self._idle = threading.Event()
        self._waiting = False
        self._engine = engine
        self._hook: Hook | None = None
        self.timeout = 0.0

    def allow(self, drain_timeout: float) -> None:
        """Let the drain wait up to ``drain_timeout`` seconds (the longest any gate asks)."""
        if drain_timeout <= self.timeout and self._hook is not None:
            return
        timeout = max(self.timeout, drain_timeout)
        builtins = self._engine.builtins
        # Before a snapshot phases run in reverse and, within one, higher orders first:
        # APPLICATION with the highest order is the very first hook, so requests drain
        # before any other hook closes what they use. A finite hook timeout (the drain's
        # own limit speaks first) makes the pass's worst case known: `notify save` waits
        # for it (rehydrate._runner.worst_case). The new hook is registered before the
        # old one goes: a refusal keeps the drain there was.
        hook = builtins.register(
            self._wait, event="snapshot", phase=Phase.APPLICATION, order=1_000_000,
            name="rehydrate.asgi.drain", timeout=min(timeout + _DRAIN_GRACE, MAX_SECONDS))
        if self._hook is not None:
            builtins.unregister(self._hook)
        self._hook, self.timeout = hook, timeout

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def enter(self) -> None:
        self._active.append(None)

    def leave(self) -> None:
        self._active.pop()
        if self._waiting and not self._active:
            self._idle.set()

    def _wait(self) -> None:
        deadline = self.timeout
        self._idle.clear()
        self._waiting = True
        try:
            if not self._active:
                return
            log.info("snapshot: waiting for %d request(s) in flight", self.in_flight)
            t0 = time.monotonic()
            if not self._idle.wait(deadline):
                raise DrainTimeout(f"{self.in_flight} request(s) still in flight after "
                                   f"{deadline:g}s (drain_timeout)")
            log.info("snapshot: requests drained in %.2fs", time.monotonic() - t0)
        finally:
            self._waiting = False


class _Detection:
    """Per engine: the lifespans (of every gate on it) that have started detection, each
    with its server's event loop.

    Only the last one to shut down stops it: two servers in one process — the API and
    :func:`health_app` on a port of its own — share the engine, and the first to shut
    down stopped detection under the other, which served on deaf to restores. The async
    hooks run on the loop of the latest holder; when that one shuts down they move to a
    holder still running (they fell back to rehydrate's private loop, away from the
    surviving server's clients and locks)."""

    def __init__(self, engine: Lifecycle) -> None:
        self.engine = engine
        self.lock = threading.Lock()  # held across start()/stop(): holders and state agree
        fresh_lock_after_fork(self, "lock")  # a parent thread may hold it at fork()
        self.holders: list[tuple[asyncio.AbstractEventLoop, str | list[str | Detector]]] = []

    def hold(self, detectors: str | list[str | Detector],
             loop: asyncio.AbstractEventLoop) -> None:
        with self.lock:
            self.holders.append((loop, detectors))
            self.engine.start(detectors, loop=loop)

    def start_control(self, detectors: str | list[str | Detector],
                      loop: asyncio.AbstractEventLoop) -> None:
        """Start the control detector that could not start at :meth:`hold` (another
        process served its socket) — the gate's own instance when it gave one — while
        ``loop``'s lifespan still holds detection."""
        from ..detect.control import ControlDetector

        with self.lock:
            if (not self.engine.started or self.engine.detector("control") is not None
                    or not any(held is loop for held, _ in self.holders)):
                return
            own = [d for d in ([] if isinstance(detectors, str) else detectors)
                   if isinstance(d, ControlDetector)]
            try:
                self.engine.start([own[0] if own else "control"])
            except Exception:  # as hold(): logged; the caller sees the detector missing
                log.exception("rehydrate control detector did not start")

    def release(self, loop: asyncio.AbstractEventLoop) -> None:
        with self.lock:
            for i in range(len(self.holders) - 1, -1, -1):
                if self.holders[i][0] is loop:
                    del self.holders[i]
                    break
            if not self.holders:
                self.engine.stop()
                return
            if not self.engine.started:
                # the application stopped or closed the engine itself: moving the loop
                # with start() would start detection again behind its back
                return
            for other, _ in reversed(self.holders):
                if other is not loop and other.is_running() and not other.is_closed():
                    # "none" while running starts nothing more: it only moves the loop
                    # (its detectors were started, or their failure logged, by its hold)
                    self.engine.start("none", loop=other)
                    return


_PLAIN_WAIT = 1.0
"""Seconds a ``/readyz?wait`` waits before it also watches for its client leaving."""

def _route(path: str) -> str:
    """``path`` as the gate's endpoints are matched: without a trailing slash."""
    return path.rstrip("/") or "/"


def _app_path(scope: Scope) -> str:
    """The request path inside the application: without the ``root_path`` a proxy mounts
    it under (uvicorn ``--root-path``), which ASGI servers include in ``path``."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


class ReadinessGate:
    """ASGI middleware: health/readiness endpoints, 503 while not ready, drain before a
    snapshot, detection started and stopped with the server's lifespan.

    ``engine``: the :class:`~rehydrate.Lifecycle` to follow (default: the process's
    engine, the one ``rehydrate.after_restore`` & co. register with).
    ``retry_after``: seconds sent in ``Retry-After`` with every 503 (whole, at most a year).
    ``healthz`` / ``readyz`` / ``status``: the endpoint paths; ``None`` switches one off.
    ``status_detail``: the status endpoint shows the whole :func:`rehydrate.status`
    (other clients' TCP connections, connection peers, secret and file paths, the
    control socket, hook errors) — only for a port nobody else reaches. By default it
    shows a public view: states, names and outcomes, built without the ``/proc`` scan.
    ``/readyz`` and the 503 bodies never carry hook error text.
    ``exempt``: path prefixes passed to the application in every state and not counted as
    in flight (metrics, or an endpoint that itself calls
    :func:`rehydrate.trigger_snapshot` — the drain would wait for it).
    ``drain_timeout``: seconds the before-snapshot hook waits for requests in flight
    (with several gates on one engine, the longest of theirs).
    ``max_wait``: the longest ``GET /readyz?wait=S`` is held (longer waits are cut to it).
    Held waits are answered at the gate's lifespan shutdown, which uvicorn runs only once
    its open requests have ended: a ``SIGTERM`` waits for them up to ``max_wait`` — keep
    it below the pod's termination grace.
    ``lifespan``: start detection on ``lifespan.startup`` and stop it on shutdown
    (``detectors`` as for :func:`rehydrate.start`). Applications without lifespan support
    get it served by the gate; a server that runs no lifespan at all (``--lifespan off``,
    a mounted sub-application) gets one warning at the first request when detection is
    not running. A detector that fails to start is logged and the server serves on,
    except the control detector when another process of this user serves its socket
    (the workers of ``uvicorn --workers N`` share ``$REHYDRATE_CONTROL_SOCKET``): the
    startup then fails (``lifespan.startup.failed``, one line saying to run one worker
    per container) — that worker would not be drained or gated by ``rehydrate notify``.
    ``control_grace``: seconds that startup first waits for the other process to let the
    socket go — to exit, or to stop serving it — and then takes the socket over: on a
    reload (gunicorn's ``HUP``) the new worker starts while the old one still finishes
    its requests and holds the socket. A sibling that still serves it after that is
    refused; 0 refuses at once.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        engine: Lifecycle | None = None,
        retry_after: int = 1,
        healthz: str | None = "/healthz",
        readyz: str | None = "/readyz",
        status: str | None = "/rehydrate/status",
        status_detail: bool = False,
        exempt: Iterable[str] = (),
        drain_timeout: float = 30.0,
        max_wait: float = 60.0,
        lifespan: bool = True,
        detectors: str | Iterable[str | Detector] = "auto",
        control_grace: float = 5.0,
    ) -> None:
        # At most a year, like every other number of seconds: 10**400 was sent to every
        # refused client as a 401-digit Retry-After (one it honours never retries), and
        # from 4300 digits str() failed here with a message naming nothing.
        if (isinstance(retry_after, bool) or not isinstance(retry_after, int)
                or not 0 <= retry_after <= MAX_SECONDS):
            raise ValueError(f"retry_after must be a whole number of seconds >= 0 and at most "
                             f"{MAX_SECONDS:.0f} (a year), not "
                             f"{shown(retry_after)}")
        # At most a year: a huge one (10**400) was accepted and overflowed a wait later.
        drain_timeout = check_seconds(drain_timeout, "drain_timeout")
        max_wait = check_seconds(max_wait, "max_wait", zero_ok=True)
        self.control_grace = check_seconds(control_grace, "control_grace", zero_ok=True)
        # one string is one prefix: tuple("/metrics") would exempt "/", i.e. everything
        exempt = (exempt,) if isinstance(exempt, str) else tuple(exempt)
        if not all(isinstance(p, str) and p.startswith("/") for p in exempt):
            raise ValueError("exempt must be path prefixes starting with '/', not "
                             f"{shown(exempt)}")
        paths = [p for p in (healthz, readyz, status) if p is not None]
        # Compared as routed (without a trailing slash): "/health" and "/health/" are
        # one endpoint, and the later one answered for both.
        if not all(isinstance(p, str) and p.startswith("/") for p in paths) or \
                len({_route(p) for p in paths}) != len(paths):
            raise ValueError("healthz, readyz and status must be distinct paths starting "
                             f"with '/' (or None), not {shown(healthz)}, "
                             f"{shown(readyz)}, {shown(status)}")
        if not isinstance(status_detail, bool):
            raise TypeError(f"status_detail must be True or False, not "
                            f"{shown(status_detail)}")
        self.app = app
        self.status_detail = status_detail
        # resolved here: something else given as engine= (the function default_engine,
        # not its result) failed below with an AttributeError naming nothing
        self.engine = cast("Lifecycle", resolve_engine(engine))
        self.retry_after = retry_after
        self.exempt = exempt
        self.lifespan = lifespan
        self.detectors = _checked_detectors(detectors)
        self._routes: dict[str, Callable[[], tuple[int, dict[str, Any]]]] = {}
        for path, handler in ((healthz, self._healthz), (readyz, self._readyz),
                              (status, self._status)):
            if path is not None:
                self._routes[_route(path)] = handler  # matched without a trailing slash
        self._drain = self.engine.extension(_DRAIN_KEY, _Drain)
        self._detection = self.engine.extension(_DETECTION_KEY, _Detection)
        self._drain.allow(drain_timeout)
        self._retry_header = (b"retry-after", str(retry_after).encode())
        self.max_wait = float(max_wait)
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()
        self._closing = False
        """Set when the last of this gate's lifespans shuts down: held ``/readyz?wait``
        requests answer at once."""
        self._lifespans = 0  # this gate's lifespans started and not yet shut down
        self._lifespans_lock = threading.Lock()  # servers on two loops share the gate
        fresh_lock_after_fork(self, "_lifespans_lock")  # a parent thread may hold it
        self._listening = False
        self._lifespan_seen = False
        self._check_lifespan = lifespan  # until the first request (see below)

    # -- endpoints ---------------------------------------------------------------------

    def _healthz(self) -> tuple[int, dict[str, Any]]:
        return 200, {"alive": True}

    def _readyz(self) -> tuple[int, dict[str, Any]]:
        generation = self.engine.generation
        ready, state, reason = readiness(self.engine)
        if ready:
            return 200, {"ready": True, "state": state, "generation": generation}
        return 503, {"ready": False, "state": state, "generation": generation,
                     "reason": reason}

    def _status(self) -> tuple[int, dict[str, Any]]:
        if self.status_detail:
            return 200, self.engine.status().to_dict()
        return 200, public_status(self.engine)

    async def _wait_ready(self, seconds: float) -> None:
        """Return once the engine is ready or ``seconds`` have passed. Woken by the
        engine's reports (a listener, added at the first wait), rechecked every
        :data:`_RECHECK` seconds; costs the event loop nothing in between."""
        if not self._listening:
            self._listening = True
            self.engine.add_listener(self._wake_waiters)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not self.engine.is_ready() and not self._closing:
            left = deadline - loop.time()
            if left <= 0:
                return
            waiter = (loop, loop.create_future())
            self._waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter[1], min(left, _RECHECK))
            except asyncio.TimeoutError:
                pass
            finally:
                self._waiters.discard(waiter)

    def _wake_waiters(self, report: object) -> None:
        for loop, fut in list(self._waiters):
            with contextlib.suppress(RuntimeError):  # that loop closed meanwhile
                loop.call_soon_threadsafe(_resolve, fut)

    # -- ASGI ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if self._check_lifespan:
            self._warn_without_lifespan()
        path = _app_path(scope)
        # inline, not _route(): every request passes here
        handler = self._routes.get(path.rstrip("/") or "/") if kind == "http" else None
        if handler is not None:
            await self._own(scope, receive, send, handler)
            return
        if self.exempt and any(path == p or path.startswith(p.rstrip("/") + "/")
                               for p in self.exempt):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            # Long-lived: counted in flight, one open socket would fail every snapshot's
            # drain. Admitted only when ready; what it holds is the app's to close.
            if self.engine.is_ready():
                await self.app(scope, receive, send)
            else:
                await self._refuse(scope, send, receive)
            return
        drain = self._drain
        # Counted before readiness is read: a snapshot that starts after this check
        # finds the request in flight and waits for it.
        drain.enter()
        if not self.engine.is_ready():
            # not admitted: writing its 503 (to a client that reads slowly) must not
            # count as a request in flight, which would fail a snapshot's drain
            drain.leave()
            await self._refuse(scope, send, receive)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            drain.leave()

    async def _own(self, scope: Scope, receive: Receive, send: Send,
                   handler: Callable[[], tuple[int, dict[str, Any]]]) -> None:
        """One of the gate's own endpoints (``/readyz?wait=S`` first waits)."""
        if (handler == self._readyz and scope.get("query_string")
                and scope["method"] in ("GET", "HEAD")):
            wait = _wait_seconds(scope["query_string"])
            if isinstance(wait, str):
                await _respond(send, 400, {"error": wait}, [],
                               head=scope["method"] == "HEAD")
                return
            if wait > 0 and not await self._wait_unless_gone(receive,
                                                             min(wait, self.max_wait)):
                return  # the client went away: nobody to answer, nothing held any more
        await self._endpoint(scope, send, handler)

    async def _wait_unless_gone(self, receive: Receive, seconds: float) -> bool:
        """:meth:`_wait_ready`, cut short when the client disconnects (False then): a
        waiter whose client gave up must not hold a slot, nor the server's shutdown."""
        # The first second plainly: a restore usually ends within it, and the watcher's
        # two tasks would run on the loop the restore's async hooks share.
        first = min(seconds, _PLAIN_WAIT)
        await self._wait_ready(first)
        if seconds <= first or self.engine.is_ready() or self._closing:
            return True

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        waiting = asyncio.ensure_future(self._wait_ready(seconds - first))
        disconnect = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({waiting, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiting, disconnect):
                task.cancel()
        return not disconnect.done() or disconnect.cancelled()

    async def _endpoint(self, scope: Scope, send: Send,
                        handler: Callable[[], tuple[int, dict[str, Any]]]) -> None:
        if scope["method"] not in ("GET", "HEAD"):
            await _respond(send, 405, {"error": "method not allowed"},
                           [(b"allow", b"GET, HEAD")], head=False)
            return
        code, body = handler()
        await _respond(send, code, body, [self._retry_header] if code == 503 else [],
                       head=scope["method"] == "HEAD")

    async def _refuse(self, scope: Scope, send: Send, receive: Receive) -> None:
        if scope["type"] == "websocket":
            # Closed before the handshake, a server answers HTTP 403 — "do not retry".
            # Accepted and closed with 1013, the client sees "try again later".
            message = await receive()
            if message.get("type") == "websocket.connect":
                await send({"type": "websocket.accept"})
                await send({"type": "websocket.close", "code": _TRY_AGAIN_LATER,
                            "reason": "not ready"})
            return
        _, state, reason = readiness(self.engine)
        await _respond(send, 503, {"error": "not ready", "state": state, "reason": reason},
                       [self._retry_header], head=scope.get("method") == "HEAD")

    # -- lifespan ------------------------------------------------------------------------

    async def _startup(self) -> str | None:
        """Hold detection; the line refusing the startup when this process cannot get
        the control socket because another one serves it (else None)."""
        with self._lifespans_lock:
            self._lifespans += 1
            self._closing = False
        loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self._detection.hold, self.detectors, loop)
        except Exception:  # detection is an aid: a failure must not stop the server
            log.exception("rehydrate detection did not start")
        return await asyncio.to_thread(self._take_control, loop)

    def _take_control(self, loop: asyncio.AbstractEventLoop) -> str | None:
        """The refusal of the startup when another process of this user serves the
        control socket and still does after ``control_grace`` seconds; None when it
        never did (see :func:`_control_peer`), or let it go meanwhile and this process
        serves the socket now.

        A reload starts the new worker before the old one has stopped: gunicorn's
        ``HUP`` spawns it, then sends the old one ``SIGTERM``, which serves its requests
        in flight, shuts its lifespan down (the socket goes) and exits. Refused at the
        first look, the new worker failed to boot and gunicorn's master exited with it:
        a reload shut the server down."""
        from ..detect.control import serving_peer

        peer = _control_peer(self.engine, self.detectors)
        if peer is None:
            return None
        pid, path = peer
        if self.control_grace > 0:
            # a WARNING: it explains the detector's ERROR line just logged, and delays
            # the startup
            log.warning("another process (pid %d) serves the control socket %s: waiting up "
                        "to %gs for it to let the socket go (the old worker of a reload) "
                        "before refusing the startup", pid, path, self.control_grace)
        deadline = time.monotonic() + self.control_grace
        step = _FIRST_LOOK
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return _refusal(pid, path)
            _wait_exit(pid, min(left, step))
            step = min(step * 2, _LAST_LOOK)
            try:
                holder = serving_peer(path)
            except OSError:  # maybe live (a full backlog): never taken for a free socket
                continue
            if holder is not None:
                if holder[0] == os.getpid() or holder[1] not in (os.geteuid(), 0):
                    return None  # taken by this process or another user: as _control_peer
                pid = holder[0]  # one holder may hand the socket to another: follow it
                continue
            # Nobody serves it (or a dead process's socket is left there): started
            # only now, so no "could not start" ERROR is logged at every look.
            self._detection.start_control(self.detectors, loop)
            peer = _control_peer(self.engine, self.detectors)
            if peer is None:
                if self.engine.detector("control") is not None:
                    log.info("the control socket %s was let go: this process serves it",
                             path)
                return None
            pid, path = peer  # another process got it first

    async def _shutdown(self) -> None:
        # One gate served on two ports: the first server's shutdown made the other's
        # /readyz?wait=N answer 503 at once. Only the last one's answers them now.
        with self._lifespans_lock:
            self._lifespans -= 1
            self._closing = self._lifespans == 0
        if self._closing:
            self._wake_waiters(None)
        await asyncio.to_thread(self._detection.release, asyncio.get_running_loop())

    def _warn_without_lifespan(self) -> None:
        """At the first request: say it when no lifespan came to start detection.

        A server that does not run the lifespan protocol (``uvicorn --lifespan off``, a
        gate mounted as a sub-application: Starlette passes no lifespan to mounts) never
        calls the startup that starts detection, and the gate then stayed silently deaf
        to restores: ready for ever, whatever happened to the process."""
        self._check_lifespan = False
        if self._lifespan_seen or self.engine.started:
            return
        log.warning("ReadinessGate: a request came before any lifespan startup, and "
                    "rehydrate is not started: restores and snapshots are not detected. "
                    "Serve the gate as the top-level app with lifespan on (uvicorn "
                    "--lifespan on or auto), or pass lifespan=False and call "
                    "rehydrate.start() yourself")

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.lifespan:
            await self.app(scope, receive, send)
            return
        self._lifespan_seen = True
        received = False
        started = False  # this lifespan holds detection: released once, by it alone
        refused: str | None = None  # the startup was refused: the server was told so

        async def startup() -> bool:
            """Start (once); False when the startup is refused: then the server has been
            sent ``lifespan.startup.failed`` and detection is released again."""
            nonlocal started, refused
            if not started:
                started = True
                refusal = await self._startup()
                if refusal is not None:
                    refused = refusal
                    await shutdown()  # no shutdown message comes after a failed startup
                    await send({"type": "lifespan.startup.failed", "message": refusal})
                    return False
            return True

        async def shutdown() -> None:
            nonlocal started
            if started:
                started = False
                await self._shutdown()

        async def wrapped() -> Message:
            nonlocal received
            message = await receive()
            received = True
            if message["type"] == "lifespan.startup":
                if not await startup():
                    # the application's own startup must not run in a process refused
                    raise _StartupRefused(refused)
            elif message["type"] == "lifespan.shutdown":
                await shutdown()
            return message

        answered = False  # the application answered the startup (complete or failed)
        foreign = False  # it sent a message of another protocol: it does not speak lifespan

        async def watched(message: Message) -> None:
            nonlocal answered, foreign
            if refused is not None:
                return  # the server was answered: its report of our refusal is dropped
            if not str(message["type"]).startswith("lifespan."):
                # A lifespan-unaware app that read the startup message as a request and
                # answers it (http.response.start): not forwarded — the server would
                # raise inside it, and the gate would report its startup as failed.
                foreign = True
                raise _NotLifespan(f"{message['type']} sent on the lifespan scope")
            if message["type"].startswith("lifespan.startup."):
                answered = True
            if message["type"] == "lifespan.startup.failed":
                # The server exits without a shutdown message: stop what startup started.
                await shutdown()
            await send(message)

        try:
            await self.app(scope, wrapped, watched)
        except Exception:
            if refused is not None:
                return  # our _StartupRefused, or what the application made of it
            if foreign and not answered:
                await self._serve_lifespan_for(send, receive, startup, shutdown, started)
                return
            if received and started and not answered:
                # Its startup raised without saying so (a bare app; Starlette sends this
                # itself). Said for it, as Starlette does, the server exits ("startup
                # failed") instead of serving without lifespan, and detection stops: no
                # shutdown message would ever come to stop it.
                await watched({"type": "lifespan.startup.failed",
                               "message": traceback.format_exc()})
            if received:
                raise
        if refused is not None:
            return
        if foreign and not answered:  # it swallowed the refusal of its message
            await self._serve_lifespan_for(send, receive, startup, shutdown, started)
            return
        if not received:
            # The application does not speak lifespan (it raised or returned before
            # reading the first message): serve the protocol for it so detection starts.
            await self._own_lifespan(receive, send, startup, shutdown)
        elif started and answered:
            # It answered the startup and returned without waiting for the shutdown:
            # uvicorn takes that for the end of the lifespan and sends no shutdown, so
            # detection ran on after the server had exited. The gate waits for it.
            await self._own_lifespan(receive, send, startup, shutdown)

    async def _serve_lifespan_for(self, send: Send, receive: Receive,
                                  startup: Callable[[], Awaitable[bool]],
                                  shutdown: Callable[[], Awaitable[None]],
                                  started: bool) -> None:
        """The application answered the lifespan scope with another protocol's message:
        it does not speak lifespan, as a server alone would conclude ("lifespan
        unsupported") and serve it. The gate serves the protocol for it, so the server
        starts and its shutdown still stops detection."""
        log.debug("the application does not speak lifespan: the gate serves it")
        if started:  # the startup it read (and took for a request) started detection
            await send({"type": "lifespan.startup.complete"})
        await self._own_lifespan(receive, send, startup, shutdown)

    async def _own_lifespan(self, receive: Receive, send: Send,
                            startup: Callable[[], Awaitable[bool]],
                            shutdown: Callable[[], Awaitable[None]]) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if not await startup():
                    return  # refused: the server was sent lifespan.startup.failed
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


def health_app(*, engine: Lifecycle | None = None, **options: Any) -> ReadinessGate:
    """A server of its own for ``/healthz``, ``/readyz`` and ``/rehydrate/status`` (404
    for anything else), for processes whose traffic does not pass through a Python ASGI
    app — a supervisor next to ``vllm serve`` or an SGLang server::

        uvicorn.run(health_app(), host="0.0.0.0", port=8081)   # readinessProbe: :8081/readyz

    ``options`` as for :class:`ReadinessGate` (its lifespan starts detection);
    ``status_detail=True`` when the port is private and the status should show it all.
    """
    return ReadinessGate(_not_found, engine=engine, **options)


def _checked_detectors(detectors: object) -> str | list[str | Detector]:
    """``detectors`` as :func:`rehydrate.start` takes them, checked now: the lifespan
    startup only logs a failure to start a detector (it must not stop the server; a
    control socket another process serves is the exception), so a
    mistyped key was one log line and a server deaf to restores, serving a clone with
    its parent's state. Whether a detector is usable is still judged at startup, where
    it runs."""
    from .. import detect
    from ..detect import Detector

    if isinstance(detectors, str):
        if detectors in ("auto", "none"):
            return detectors
        keys: list[object] = [k.strip() for k in detectors.split(",") if k.strip()]
    elif isinstance(detectors, Iterable):
        keys = list(detectors)
    else:
        raise TypeError(f"detectors must be 'auto', 'none', or detector keys and Detector "
                        f"instances, not {type(detectors).__name__}")
    known = detect.catalogue_keys()
    checked: list[str | Detector] = []
    for key in keys:
        if not isinstance(key, Detector) and (not isinstance(key, str) or key not in known):
            raise ValueError(f"unknown detector {shown(key)} (known: "
                             f"{', '.join(known)})")
        checked.append(key)
    return detectors if isinstance(detectors, str) else checked


def _control_peer(engine: Lifecycle,
                  detectors: str | list[str | Detector]) -> tuple[int, str] | None:
    """``(pid, socket path)`` when this process must not serve: the control detector
    could not start because another process of this user (or root) serves its socket — a
    sibling of ``uvicorn --workers N`` (or ``gunicorn -w N``), which all read the same
    ``$REHYDRATE_CONTROL_SOCKET``. Only that worker hears ``rehydrate notify save``: the
    others kept admitting requests after the snapshot was prepared and served a clone
    with state from before it. None otherwise: the detector runs, was not asked for,
    failed for another reason (already an error line), or the socket is served by this
    very process (a second engine's gate beside the first: its own, logged, failure). A
    socket left by a dead process is replaced by the detector and does not get here."""
    if engine.detector("control") is not None:
        return None
    if "control" not in engine.status(fields=()).extra.get("detector_errors", {}):
        return None
    from ..detect.control import ControlDetector, serving_peer, socket_path

    own = [d.path for d in ([] if isinstance(detectors, str) else detectors)
           if isinstance(d, ControlDetector) and d.path]
    path = own[0] if own else socket_path()
    try:
        peer = serving_peer(path)
    except OSError:  # not connectable: a squatter's, already named in the error line
        return None
    if peer is None or peer[0] == os.getpid() or peer[1] not in (os.geteuid(), 0):
        return None  # nobody; this process; another user's (a squatter: its own error)
    return peer[0], path


def _refusal(pid: int, path: str) -> str:
    return (f"rehydrate: another process (pid {pid}) serves the control socket {path}, "
            "so this one would not hear rehydrate notify and would serve across a "
            "snapshot ungated: run one server process per container (no --workers N, or "
            "--workers 1) and scale with replicas; refusing to start")


def _wait_exit(pid: int, seconds: float) -> None:
    """Return when process ``pid`` exits, or after ``seconds``."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        # No pidfd here (an old kernel, a sandbox), a pid of another namespace, or one
        # gone already — whose socket a forked child may still serve (the peer's pid is
        # the listener's): a bounded step of the caller's loop, which looks again.
        time.sleep(seconds)
        return
    try:
        poller = select.poll()  # not select(): a descriptor above 1023 is fine
        poller.register(fd, select.POLLIN)  # readable once the process has exited
        poller.poll(seconds * 1000)
    finally:
        os.close(fd)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _wait_seconds(query: bytes) -> float | str:
    """The ``wait`` of a ``/readyz`` query string (0 without one), or why it is invalid."""
    from urllib.parse import parse_qs

    values = parse_qs(query.decode("latin-1")).get("wait")
    if not values:
        return 0.0
    try:
        wait = float(values[-1])
    except ValueError:
        wait = math.nan
    if not 0 <= wait < math.inf:
        return "wait must be a number of seconds >= 0"
    return wait


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "http":
        await _respond(send, 404, {"error": "not found"}, [],
                       head=scope.get("method") == "HEAD")
    elif scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1000})


async def _respond(send: Send, code: int, body: dict[str, Any],
                   headers: list[tuple[bytes, bytes]], *, head: bool) -> None:
    payload = json.dumps(body, default=str).encode()
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (b"cache-control", b"no-store"), *headers]})
    await send({"type": "http.response.body", "body": b"" if head else payload})
