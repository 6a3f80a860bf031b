"""httpx transports whose connection pool can be rebuilt under a client that stays the same.

httpx supports custom transports as public API (``httpx.Client(transport=...)``). A
:class:`ReconnectingTransport` forwards every request to an inner ``httpx.HTTPTransport``
and :meth:`~ReconnectingTransport.reset` swaps a fresh one in (closing the old pool), so
application code keeps its one ``httpx.Client`` object — with its base URL, headers, auth,
cookies, event hooks — across restores. Imported only when an httpx helper is used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import importlib.util
import logging
import ssl
import sys
import threading
from typing import Any

import httpx

from ._loop_roles import is_blocked, is_private
from ._loops import LoopClosed, LoopStopped, run_quietly
from ._redact import describe_scrubbed
from ._threads import fresh_lock_after_fork
from ._urls import without_credentials

_LOOP_CLOSED = ("the event loop its requests ran on is closed: its pooled connections cannot be "
                "closed")

__all__ = ["AsyncReconnectingTransport", "ReconnectingTransport", "make_async_client",
           "make_client", "shown"]

log = logging.getLogger("rehydrate")

TRANSPORT_KWARGS = ("verify", "cert", "trust_env", "http1", "http2", "limits", "proxy",
                    "retries", "local_address", "uds")
"""``httpx.Client`` options that configure its transport: they go to the inner one."""


def _remember_missing_sniffio() -> None:
    """httpcore's async locks run ``import sniffio`` on every acquire, and sniffio is no
    longer installed with httpx/anyio: each is then a failed import that stats every
    ``sys.path`` entry — right after a gVisor restore, walks through the gofer that
    measured tens of milliseconds of a connection's reopen. When sniffio cannot be found
    now, record that the way the import system itself does (``None`` in
    ``sys.modules``): every later ``import sniffio`` fails at once, as it would have
    after the search. Done when the helper builds its client, i.e. before a snapshot."""
    if "sniffio" not in sys.modules and importlib.util.find_spec("sniffio") is None:
        sys.modules["sniffio"] = None  # type: ignore[assignment]


def shown(url: httpx.URL) -> str:
    """``url`` for messages (:func:`rehydrate._urls.without_credentials`): a client's
    default ``params`` land in the query (``?api_key=...``)."""
    return without_credentials(str(url))


def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    transport = {k: kwargs.pop(k) for k in TRANSPORT_KWARGS if k in kwargs}
    if "trust_env" in transport:
        kwargs["trust_env"] = transport["trust_env"]
    if "transport" in kwargs:
        raise TypeError("the rehydrate httpx helpers provide the transport themselves")
    return kwargs, transport


def _reuse_ssl_context(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Build the SSL context once: loading the CA bundle costs tens of milliseconds of
    CPU, far more than reconnecting, so every rebuilt pool shares it."""
    verify = kwargs.get("verify", True)
    if isinstance(verify, ssl.SSLContext):
        return kwargs
    out = dict(kwargs)
    cert = out.pop("cert", None)
    trust_env = out.get("trust_env", True)
    if cert is None:
        out["verify"] = httpx.create_ssl_context(verify=verify, trust_env=trust_env)
    else:  # deprecated by httpx, still honoured
        out["verify"] = httpx.create_ssl_context(verify=verify, cert=cert,
                                                 trust_env=trust_env)
    return out


def _env_mounts(client_kwargs: dict[str, Any], transport_kwargs: dict[str, Any],
                make: Any) -> list[Any]:
    """httpx mounts the proxies of ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` (and the
    exceptions of ``NO_PROXY``) only when it builds the transport itself, never with
    ``transport=``, which the helpers always pass: a managed client went straight to
    every host. Mount them here as httpx would (same map, ``mounts=`` given by the
    caller win), each a reconnecting transport through that proxy (``make(proxy=...)``),
    reset with the client's own; returns those transports."""
    if not transport_kwargs.get("trust_env", True) or "proxy" in transport_kwargs:
        return []  # as httpx: an explicit proxy replaces the environment's
    from httpx._utils import get_environment_proxies  # what httpx.Client itself reads

    env = get_environment_proxies()
    if not env:
        return []
    mounts: dict[str, Any] = {
        pattern: None if url is None else make(proxy=url, **transport_kwargs)
        for pattern, url in env.items()
    }
    mounts.update(client_kwargs.get("mounts") or {})
    client_kwargs["mounts"] = mounts
    return [t for t in mounts.values() if isinstance(t, (ReconnectingTransport,
                                                         AsyncReconnectingTransport))]


def _close_mounts(client: httpx.Client | httpx.AsyncClient | None) -> None:
    """Transports mounted by the caller (``mounts=``) have their own pools."""
    mounts = getattr(client, "_mounts", None) or {}
    for t in mounts.values():
        if isinstance(t, httpx.HTTPTransport):
            t.close()


class ReconnectingTransport(httpx.BaseTransport):
    """A sync transport whose inner ``httpx.HTTPTransport`` is replaced by :meth:`reset`."""

    def __init__(self, **transport_kwargs: Any) -> None:
        self._kwargs = _reuse_ssl_context(transport_kwargs)
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        self._inner = httpx.HTTPTransport(**self._kwargs)
        self.client: httpx.Client | None = None
        self.proxies: list[ReconnectingTransport] = []
        """The environment's proxy mounts (:func:`_env_mounts`), reset with this one."""
        self.generation = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._inner.handle_request(request)

    def reset(self) -> None:
        """Swap in a fresh pool; the old one (dead connections after a restore) is closed."""
        fresh = httpx.HTTPTransport(**self._kwargs)
        with self._lock:
            old, self._inner = self._inner, fresh
            self.generation += 1
        try:
            old.close()
            _close_mounts(self.client)
        except Exception as exc:  # closing sockets the platform already cut
            # scrubbed as every other connection message: a transport's error may quote
            # the URL it was closing, user:password@ and ?api_key= included
            log.debug("closing the previous httpx pool: %s", describe_scrubbed(exc))
        for proxy in self.proxies:
            proxy.reset()

    def close_pool(self) -> None:
        """Close every pooled connection (before a snapshot); the pool stays usable."""
        self._inner.close()
        _close_mounts(self.client)
        for proxy in self.proxies:
            proxy.close_pool()

    def close(self) -> None:
        self._inner.close()


class AsyncReconnectingTransport(httpx.AsyncBaseTransport):
    """The ``AsyncClient`` counterpart. The pool belongs to the event loop that uses it,
    so closing it is scheduled on that loop."""

    def __init__(self, **transport_kwargs: Any) -> None:
        self._kwargs = _reuse_ssl_context(transport_kwargs)
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        self._inner = httpx.AsyncHTTPTransport(**self._kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the current pool's connections belong to (None: none opened yet)."""
        self._home: asyncio.AbstractEventLoop | None = None
        """The loop the application last sent a request on, kept across :meth:`reset`,
        also through the caller's mounts (:meth:`saw_request`). Made from a coroutine:
        that one until then, most likely the client's."""
        with contextlib.suppress(RuntimeError):
            self._home = asyncio.get_running_loop()
        self.proxies: list[AsyncReconnectingTransport] = []
        """The environment's proxy mounts (:func:`_env_mounts`), reset with this one."""
        self.client: httpx.AsyncClient | None = None
        """For the transports mounted by the caller (``mounts=``), closed with the pool."""
        self.generation = 0
        self.retired = False
        """Closed for good by :meth:`retire`: requests raise, no pool is opened again."""
        self._mount_closes: list[concurrent.futures.Future[None]] = []
        """The closes of the caller's mounted pools the last :meth:`reset` scheduled."""
        self._detached: list[tuple[httpx.AsyncHTTPTransport, asyncio.AbstractEventLoop]] = []
        """Pools taken out while their loop was stopped (:meth:`_detach`), each with that
        loop, not closed yet: :meth:`_close_detached` closes them there; those of a loop
        closed since are let go of (:meth:`_drop_stale`)."""

    def _mounted(self) -> list[httpx.AsyncHTTPTransport]:
        mounts = getattr(self.client, "_mounts", None) or {}
        return [t for t in mounts.values() if isinstance(t, httpx.AsyncHTTPTransport)]

    def _mounts_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the caller's mounted pools belong to: the application's, as far as
        this transport saw it (else the running one)."""
        if self._home is not None:
            return self._home
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            return None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.retired:
            raise RuntimeError("Cannot send a request, as the client has been closed "
                               "(its rehydrate connection was replaced).")
        self._loop = self._home = asyncio.get_running_loop()
        return await self._inner.handle_async_request(request)

    def retire(self) -> None:
        """Close for good, without awaiting: what ``AsyncClient.aclose()`` does, for a
        registration replaced from sync code or another loop. Requests raise as on a
        closed client; the pools are closed on the loop their connections belong to
        (as :meth:`reset` does), since nothing will close them before a snapshot."""
        self.retired = True
        for proxy in self.proxies:
            proxy.retired = True
        self.reset()

    def reset(self) -> None:
        fresh = httpx.AsyncHTTPTransport(**self._kwargs)
        with self._lock:
            old, self._inner = self._inner, fresh
            self.generation += 1
            loop, self._loop = self._loop, None
        # a stopped loop (run_until_complete between two calls) too: it runs the close
        # when the application runs it again (run_quietly), nothing else can close
        # those sockets; closed by the application unrun, it drops the close silently
        if loop is not None and not loop.is_closed():
            _forget(old.aclose(), loop)
        with self._lock:
            detached, self._detached = self._detached, []
        # taken out before the snapshot: their connections were cut since, and the
        # close scheduled for them does not run once the restore has opened again
        for pool, on in detached:
            if not on.is_closed():
                _forget(pool.aclose(), on)
        for proxy in self.proxies:
            proxy.reset()
        # the sync transport closes the caller's mounts too: they kept the sockets from
        # before the restore. Their connections belong to the application's loop.
        home = self._mounts_loop()
        if home is not None and not home.is_closed():
            closes = [_forget(mount.aclose(), home) for mount in self._mounted()]
            self._mount_closes = [f for f in closes if f is not None]

    def _stopped_loop(self) -> asyncio.AbstractEventLoop | None:
        """The stopped (neither running nor closed) loop some of the pools belong to:
        the application drives it with ``run_until_complete`` between two calls. Or one
        whose thread waits for the lifecycle event this close is part of (the
        application called ``simulate_snapshot()`` on it): a close sent there and waited
        for ran only once the event had given up on it (``close() took longer than
        5s``), so it is left to run there, as on a stopped loop."""
        with self._lock:
            loops = [self._loop, self._mounts_loop() if self._mounted() else None]
        for proxy in self.proxies:
            loops.append(proxy._stopped_loop())
        for loop in loops:
            if loop is not None and not loop.is_closed() and (
                    not loop.is_running() or is_blocked(loop)):
                return loop
        return None

    def _detach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Swap in fresh pools for those (this one's, its proxies') whose connections
        belong to ``loop``, stopped: the application's next request cannot take one of
        theirs before the close scheduled there runs (it runs after whatever the
        application runs first). The pools swapped out are set to close a connection
        when its request ends (:func:`_keep_none`) and kept for :meth:`_close_detached`
        (or, after a restore, :meth:`reset`)."""
        with self._lock:
            if self._loop is loop:
                old, self._inner = self._inner, httpx.AsyncHTTPTransport(**self._kwargs)
                self.generation += 1
                self._loop = None
                _keep_none(old)
                self._detached.append((old, loop))
        for proxy in self.proxies:
            proxy._detach(loop)

    def _drop_stale(self) -> bool:
        """Let go of the pools :meth:`_detach` took out (this one's, its proxies') whose
        loop was closed before it ran their close (nothing can close their sockets any
        more: "Event loop is closed" there failed the next close on another loop). True
        when one still held a connection."""
        with self._lock:
            stale = [t for t, on in self._detached if on.is_closed()]
            if stale:
                self._detached = [d for d in self._detached if not d[1].is_closed()]
        held = any(_holds(t) for t in stale)
        for proxy in self.proxies:
            held = proxy._drop_stale() or held
        return held

    async def _close_detached(self) -> None:
        """The close :meth:`close_pool` has its stopped loop run: the idle connections
        of every pool :meth:`_detach` took out there so far (one in use is closed when
        its request ends; another loop's are not this one's to close), and those of the
        caller's mounts (not swappable: one in use there goes back to that pool)."""
        here = asyncio.get_running_loop()
        errors = await self._close_taken(here)
        if self._mounts_loop() is here:
            errors += [e for e in [await _guard(_close_idle(m)) for m in self._mounted()]
                       if e is not None]
        if errors:
            raise errors[0]

    async def _close_taken(self, here: asyncio.AbstractEventLoop) -> list[BaseException]:
        """:meth:`_close_detached` of the pools taken out on ``here``; each stays listed
        until its close has returned: one ``here`` never finished (closed meanwhile)
        counts as left open (:meth:`_drop_stale`)."""
        with self._lock:
            mine = [t for t, on in self._detached if on is here]
        errors = []
        for pool in mine:
            exc = await _guard(_close_idle(pool))
            with self._lock:
                self._detached = [d for d in self._detached if d[0] is not pool]
            if exc is not None:
                errors.append(exc)
        for proxy in self.proxies:
            errors += await proxy._close_taken(here)
        return errors

    async def close_pool(self) -> None:
        here = asyncio.get_running_loop()
        stale = self._drop_stale()
        stopped = self._stopped_loop()
        if stopped is not None and stopped is not here:
            # only that loop can close their sockets: the connection schedules a close
            # there, of pools taken out now (its next request gets a fresh one)
            self._detach(stopped)
            raise LoopStopped(stopped, "its requests ran on", self._close_detached,
                              dropped=_LOOP_CLOSED if stale else None)
        for proxy in self.proxies:
            await proxy.close_pool()
        home = self._mounts_loop()
        for mount in self._mounted():
            if home is here:
                await mount.aclose()
            elif home is not None and home.is_running():
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(mount.aclose(),
                                                                           home))
        with self._lock:
            inner, loop = self._inner, self._loop
        if loop is not None and loop.is_closed():
            # asyncio.run() returned: the pool's sockets are still open (ESTABLISHED)
            # but nothing can close them through their loop any more
            stale = _holds(inner) or stale
        elif loop is here:
            await inner.aclose()
        elif loop is not None and loop.is_running():
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(inner.aclose(), loop))
        if stale:
            raise LoopClosed(_LOOP_CLOSED)

    async def probe(self, request: httpx.Request) -> None:
        """Send ``request`` (built by the client: base URL and default headers applied);
        < 500 counts as healthy. On the loop the application sends its requests on (the
        hooks run there when the engine was given that loop: ``ReadinessGate`` does), it
        goes through the client's fresh pool, whose connection the application's first
        request then reuses; on any other loop, whose connections the application's loop
        could not use, through a short-lived transport of the same configuration."""
        running = asyncio.get_running_loop()
        with self._lock:
            inner, pooled = self._inner, running is self._home
            if pooled:
                self._loop = running
        if pooled:
            await self._send(inner, request)
        else:
            async with httpx.AsyncHTTPTransport(**self._kwargs) as transport:
                await self._send(transport, request)

    async def probe_mount(self, mount: httpx.AsyncBaseTransport,
                          request: httpx.Request) -> None:
        """:meth:`probe` for a URL the client sends through a transport the caller
        mounted (``mounts=``: a proxy, a different TLS setup), which is what the
        application's requests to it go through: checked through anything else, a down
        proxy passed the check and every request failed. Its pool belongs to the
        application's loop, and a connection the check left there from another loop
        failed the application's next request through it ("bound to a different event
        loop"): sent there only (here when the hooks run on it, else submitted to it).

        When that loop cannot send it — not known (no request of the client seen yet,
        and the hooks run on rehydrate's own loop), closed, or its thread waits for this
        very event (nothing sent there runs before the check's deadline) — the check
        goes through a short-lived copy of the mount (:func:`_private_copy`: the same
        proxy, TLS and socket setup, a pool of its own), closed after it; a mount that
        cannot be copied (not an ``httpx.AsyncHTTPTransport``) is bypassed, the check
        sent straight to the server (its failure says so). A loop only stopped
        (``run_until_complete`` between two calls) may run again within the deadline:
        the check fails, saying so, and is retried."""
        here = asyncio.get_running_loop()
        home = self._home
        if home is None and not is_private(here):
            home = here  # the hooks run on the application's loop (start(loop=...))
        # after the closes reset() scheduled for the mounts: one still under way took
        # the check's connection out of the pool with the dead ones
        closes = [asyncio.wrap_future(f) for f in self._mount_closes if not f.done()]
        if home is here:
            if closes:
                await asyncio.wait(closes)  # never raises, nor cancels them
            await self._send(mount, request)
            return
        if home is None or home.is_closed() or is_blocked(home):
            await self._probe_copy(mount, request)
            return
        if not home.is_running():
            raise ConnectionError(
                f"{shown(request.url)} goes through a transport given in mounts=, whose "
                "connections belong to the application's event loop, which is not "
                "running: it cannot be checked there")
        if closes:
            await asyncio.wait(closes)
        # cancelled (the deadline) here, the task there is cancelled too
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            self._send(mount, request), home))

    async def _probe_copy(self, mount: httpx.AsyncBaseTransport,
                          request: httpx.Request) -> None:
        """:meth:`probe_mount` when the application's loop cannot send the check: through
        a copy of ``mount`` whose connections are this loop's and closed here (sent
        through the mount itself, from this loop, it left one in the mount's pool for
        the application's next request, on another loop, to fail on; and the pool
        itself is no thread's to share: its requests, connections and their events are
        the application's loop's). ``Connection: close`` on the check through the mount
        would have httpcore close an HTTP/1.1 connection after the response, but not
        keep the check's request out of that shared queue, nor apply to HTTP/2."""
        twin = _private_copy(mount)
        if twin is None:
            try:
                await self.probe(request)
            except Exception as exc:
                raise ConnectionError(
                    f"checked straight, bypassing the transport given in mounts= for "
                    f"{shown(request.url)} (a {type(mount).__name__} cannot be copied, and "
                    "the application's event loop, where its connections belong, is not "
                    "known, closed, or waiting for this restore): "
                    f"{type(exc).__name__}: {exc}") from exc
            return
        try:
            await self._send(twin, request)
        finally:
            await twin.aclose()

    async def saw_request(self, request: httpx.Request) -> None:
        """The client's request event hook: the loop its requests run on, also those
        that go through the caller's mounts, which this transport never sees."""
        self._home = asyncio.get_running_loop()

    @staticmethod
    async def _send(transport: httpx.AsyncBaseTransport, request: httpx.Request) -> None:
        r = await transport.handle_async_request(request)
        try:
            await r.aread()
        finally:
            await r.aclose()
        if r.status_code >= 500:
            raise ConnectionError(f"{shown(request.url)} answered {r.status_code}")

    async def aclose(self) -> None:
        await self._inner.aclose()


def _private_copy(transport: httpx.AsyncBaseTransport) -> httpx.AsyncHTTPTransport | None:
    """A copy of ``transport`` (an ``httpx.AsyncHTTPTransport``, a subclass too) that
    shares its configuration — proxy, SSL context, HTTP versions, retries, local
    address, socket options, network backend — but not its mutable state: httpcore
    keeps that in the pool's request queue and connection list, which the copy starts
    empty. None for a transport of another kind, or a pool of another shape."""
    import httpcore

    pool = getattr(transport, "_pool", None)
    if not isinstance(transport, httpx.AsyncHTTPTransport) or not isinstance(
            pool, httpcore.AsyncConnectionPool) or not isinstance(
            getattr(pool, "_connections", None), list) or not isinstance(
            getattr(pool, "_requests", None), list):
        return None
    twin_pool = copy.copy(pool)
    twin_pool._connections = []
    twin_pool._requests = []
    twin = copy.copy(transport)
    twin._pool = twin_pool
    return twin


def _keep_none(transport: httpx.AsyncHTTPTransport) -> None:
    """A pool swapped out: none of its connections goes back to it idle, so that one a
    request in flight still uses is closed when that request ends (httpcore closes the
    idle ones beyond ``max_keepalive_connections``), not left open until the garbage
    collector takes it."""
    pool = getattr(transport, "_pool", None)
    if isinstance(getattr(pool, "_max_keepalive_connections", None), int):
        pool._max_keepalive_connections = 0  # type: ignore[union-attr]


def _holds(transport: httpx.AsyncHTTPTransport) -> bool:
    """Whether the pool of ``transport`` holds a connection not closed (one of another
    shape: assumed so)."""
    conns = getattr(getattr(transport, "_pool", None), "connections", None)
    if not isinstance(conns, list):
        return True
    return any(not c.is_closed() for c in conns)


async def _close_idle(transport: httpx.AsyncHTTPTransport) -> None:
    """Close the idle connections of a pool swapped out, sparing those a request is in
    flight on (the application's task suspended in it while its loop was stopped):
    :func:`_keep_none` has them closed when their request ends. A pool of another shape
    is closed whole."""
    conns = getattr(getattr(transport, "_pool", None), "connections", None)
    if not isinstance(conns, list):
        await transport.aclose()
        return
    for conn in conns:
        if conn.is_idle():
            await conn.aclose()


async def _guard(coro: Any) -> BaseException | None:
    try:
        await coro
    except Exception as exc:
        return exc
    return None


def _forget(coro: Any, loop: asyncio.AbstractEventLoop) -> concurrent.futures.Future[Any] | None:
    """Run ``coro`` (a pool's close) on ``loop`` (:func:`~rehydrate._loops.run_quietly`),
    not waited for: its outcome is retrieved, never raised; a loop closed in between
    closes nothing (None). Returns its future."""
    try:
        fut = run_quietly(loop, coro)
    except RuntimeError:  # closed since it was checked (run_quietly closed the coroutine)
        return None
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


def make_client(kwargs: dict[str, Any]) -> tuple[httpx.Client, ReconnectingTransport]:
    client_kwargs, transport_kwargs = _split(dict(kwargs))
    transport = ReconnectingTransport(**transport_kwargs)
    # transport._kwargs: the proxies share its SSL context
    transport.proxies = _env_mounts(client_kwargs, transport._kwargs, ReconnectingTransport)
    client = httpx.Client(transport=transport, **client_kwargs)
    transport.client = client
    return client, transport


def make_async_client(
    kwargs: dict[str, Any],
) -> tuple[httpx.AsyncClient, AsyncReconnectingTransport]:
    _remember_missing_sniffio()
    client_kwargs, transport_kwargs = _split(dict(kwargs))
    transport = AsyncReconnectingTransport(**transport_kwargs)
    transport.proxies = _env_mounts(client_kwargs, transport._kwargs,
                                    AsyncReconnectingTransport)
    if client_kwargs.get("mounts"):
        # Requests through the caller's mounts never reach this transport: only a hook
        # tells which loop they run on. Without mounts the transport records it itself,
        # and the application's requests are spared an awaited hook each.
        hooks = dict(client_kwargs.get("event_hooks") or {})
        hooks["request"] = [transport.saw_request, *hooks.get("request", [])]
        client_kwargs["event_hooks"] = hooks
    client = httpx.AsyncClient(transport=transport, **client_kwargs)
    transport.client = client
    return client, transport
