"""Managed connections: fixes of a review (health checks that answer False, runs
superseded mid-restore, stale errors, secrets in library errors, httpx mounts and paused
loops, SQLAlchemy engines the helper cannot manage)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rehydrate import connections


def _hook_error(report) -> str:  # type: ignore[no-untyped-def]
    hook = next(h for h in report.hooks if h.name == "rehydrate.connections")
    return str(hook.error or "")


def _status(engine, name):  # type: ignore[no-untyped-def]
    return next(c for c in engine.status().extra["connections"] if c["name"] == name)


class _Client:
    def is_healthy(self) -> bool:
        return False


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_check_that_returns_false_fails_the_attempt(rehydrate_engine, kind):
    """A health probe that answers rather than raises (elasticsearch's ``es.ping()``, an
    ``is_healthy()``) returned False and the connection counted as reopened: report ok,
    process ready, every request then failing."""
    if kind == "sync":
        def check(c):  # type: ignore[no-untyped-def]
            return c.is_healthy()
    else:
        async def check(c):  # type: ignore[no-untyped-def]
            return c.is_healthy()
    connections.register("svc", open=_Client, check=check, deadline=0.3,
                         engine=rehydrate_engine)
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    assert not rehydrate_engine.is_ready()
    assert "check() returned False" in _hook_error(report)
    assert _status(rehydrate_engine, "svc")["state"] == "failed"


@pytest.mark.parametrize("answer", [None, True, 0, "", []])
def test_a_check_returning_anything_but_false_passes(rehydrate_engine, answer):
    """Only ``False`` itself is a failure: a check returning None (most), a result row,
    0 or an empty list (a cursor's rows) passes as before."""
    connections.register("svc", open=_Client, check=lambda c: answer, deadline=0.3,
                         engine=rehydrate_engine)
    assert rehydrate_engine.simulate_restore().ok


@pytest.mark.parametrize("how", ["unregister", "replace"])
def test_unregistering_a_connection_during_a_restore_does_not_fail_it(rehydrate_engine, how):
    """``unregister()`` (or a ``replace=True`` registration) of a connection while a
    restore reopened it counted that superseded run as a missed deadline: the report
    failed with "old-db after 5s and 1 attempt(s), last error: none" (in 0.6 s) and the
    process stayed not ready."""
    started, release = threading.Event(), threading.Event()

    def slow_open() -> object:
        started.set()
        release.wait(10)
        return object()

    connections.register("old-db", open=slow_open, deadline=30, engine=rehydrate_engine)
    reports = []
    restore = threading.Thread(
        target=lambda: reports.append(rehydrate_engine.simulate_restore()))
    restore.start()
    try:
        assert started.wait(10)
        if how == "unregister":
            assert connections.unregister("old-db", engine=rehydrate_engine)
        else:
            connections.register("old-db", open=object, replace=True,
                                 engine=rehydrate_engine)
    finally:
        release.set()
        restore.join(30)
    [report] = reports
    assert report.ok, report.table()
    assert rehydrate_engine.is_ready()
    names = [c["name"] for c in rehydrate_engine.status().extra["connections"]]
    if how == "unregister":
        assert names == []
    else:  # the new registration is opened by the next restore, as any new one
        assert _status(rehydrate_engine, "old-db")["state"] == "registered"
        assert rehydrate_engine.simulate_restore().ok
        assert _status(rehydrate_engine, "old-db")["state"] == "open"


@pytest.mark.parametrize("how", ["replace", "unregister"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_connection_superseded_during_a_restore_stops_holding_it(rehydrate_engine,
                                                                    http_srv, kind, how):
    """A client replaced (``replace=True``) or unregistered while a restore waited for its
    health check to a peer that accepts and never answers held that restore, and
    readiness, until the old connection's deadline (30 s by default): its run stopped
    only at its next step, after the check's call returned."""
    import socket

    make = connections.httpx_client if kind == "sync" else connections.httpx_async_client
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nobody ever answers
        old = make("api", base_url=f"http://127.0.0.1:{silent.getsockname()[1]}",
                   check_url="/health", timeout=None, deadline=60,
                   engine=rehydrate_engine)
        conn = connections.get("api", engine=rehydrate_engine)
        reports = []
        restore = threading.Thread(
            target=lambda: reports.append(rehydrate_engine.simulate_restore()))
        restore.start()
        # the check's request is under way (a sync one: on its thread)
        deadline = time.monotonic() + 10
        while conn.step != "check" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert conn.step == "check"
        if how == "replace":
            new = make("api", base_url=http_srv.url, check_url="/health",
                       engine=rehydrate_engine, replace=True)
        else:
            assert connections.unregister("api", engine=rehydrate_engine)
        restore.join(10)
        assert not restore.is_alive(), "the restore still waits for the superseded check"
    [report] = reports
    assert report.ok, report.table()
    assert rehydrate_engine.is_ready()
    if how == "replace":  # the new registration opens at the next restore, as any new one
        assert rehydrate_engine.simulate_restore().ok
        assert _status(rehydrate_engine, "api")["state"] == "open"
        if kind == "sync":
            new.close()
    if kind == "sync":
        old.close()


def test_an_earlier_restores_error_is_not_reported_again(rehydrate_engine):
    """``last_error`` was never cleared when a run started: a restore whose open hung
    reported the previous restore's error followed by "(open was still running at the
    deadline)", and each later one appended that note once more."""
    refuse, release = [True], threading.Event()

    def open_() -> object:
        if refuse[0]:
            raise ConnectionRefusedError("refused in restore 1")
        release.wait(10)  # the peer hangs from restore 2 on
        return object()

    connections.register("db", open=open_, deadline=0.3, engine=rehydrate_engine)
    try:
        first = rehydrate_engine.simulate_restore()
        assert "refused in restore 1" in _hook_error(first)
        refuse[0] = False
        for _ in range(2):
            report = rehydrate_engine.simulate_restore()
            error = _hook_error(report)
            assert "refused in restore 1" not in error, error
            assert error.count("still running at the deadline") == 1, error
        last = _status(rehydrate_engine, "db")["last_error"]
        assert last == "(open was still running at the deadline)", last
    finally:
        release.set()


@pytest.mark.parametrize("hooks_on_app_loop", [False, True])
async def test_async_httpx_check_goes_through_the_callers_mount(rehydrate_engine, http_srv,
                                                               hooks_on_app_loop):
    """``mounts={"http://": AsyncHTTPTransport(proxy=...)}`` (httpx's way to route through
    a proxy) with the proxy down: every request of the application failed, but the health
    check went through the client's own pool, straight to the server, and the restore
    reported the connection open and the process ready. The sync helper failed it."""
    import httpx
    from netservers import refused_port

    loop = asyncio.get_running_loop()
    if hooks_on_app_loop:
        rehydrate_engine.start("none", loop=loop)
    with refused_port() as port:
        client = connections.httpx_async_client(
            "api", base_url=http_srv.url, check_url="/health", deadline=0.5,
            mounts={"http://": httpx.AsyncHTTPTransport(proxy=f"http://127.0.0.1:{port}")},
            engine=rehydrate_engine)
        report = await loop.run_in_executor(None, rehydrate_engine.simulate_restore)
        assert not report.ok
        assert "ConnectError" in _status(rehydrate_engine, "api")["last_error"]
        with pytest.raises(httpx.ConnectError):  # what the check stands for
            await client.get("/x")
    await client.aclose()


@pytest.mark.parametrize("hooks_on_app_loop", [False, True])
async def test_async_httpx_check_through_a_working_mount_passes_on_the_apps_loop(
        rehydrate_engine, http_srv, hooks_on_app_loop):
    """Through a mount that works, the check passes and leaves its connection in that
    mount's pool, made on the application's loop (sent there when the hooks run on
    another): the application's next request through it works."""
    import httpx

    loop = asyncio.get_running_loop()
    if hooks_on_app_loop:
        rehydrate_engine.start("none", loop=loop)
    mount = httpx.AsyncHTTPTransport()
    client = connections.httpx_async_client(
        "api", base_url=http_srv.url, check_url="/health", deadline=5,
        mounts={"http://": mount}, engine=rehydrate_engine)
    report = await loop.run_in_executor(None, rehydrate_engine.simulate_restore)
    assert report.ok, report.table()
    assert len(mount._pool.connections) == 1  # the check's, through the mount
    assert (await client.get("/after")).text == "/after"
    await client.aclose()


def test_async_httpx_check_through_a_mount_of_a_stopped_loop_fails_saying_why(
        rehydrate_engine, http_srv):
    """The mount's pool belongs to the application's loop; while that loop does not run
    (``run_until_complete`` between two calls) the check cannot be sent there, and sent
    from the hooks' loop it would leave a connection of that loop in the pool."""
    import httpx

    loop = asyncio.new_event_loop()
    try:
        async def make():  # type: ignore[no-untyped-def]
            return connections.httpx_async_client(
                "api", base_url=http_srv.url, check_url="/health", deadline=0.3,
                mounts={"http://": httpx.AsyncHTTPTransport()}, engine=rehydrate_engine)

        client = loop.run_until_complete(make())
        report = rehydrate_engine.simulate_restore()
        assert not report.ok
        error = _status(rehydrate_engine, "api")["last_error"]
        assert "mounts=" in error and "is not running" in error, error
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()


@pytest.fixture
def app_loop():  # type: ignore[no-untyped-def]
    """The application's event loop, run by a thread of its own, as a server's is."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _on(loop, coro):  # type: ignore[no-untyped-def]
    return asyncio.run_coroutine_threadsafe(coro, loop).result(10)


def _module_level_client(engine, url, mount, deadline=5.0):  # type: ignore[no-untyped-def]
    """Made outside any loop (at import), every request through the caller's mount."""
    import httpx

    return connections.httpx_async_client(
        "api", base_url=url, check_url="/health", deadline=deadline,
        mounts={"all://": mount or httpx.AsyncHTTPTransport(retries=2)}, engine=engine)


def test_async_httpx_mount_check_leaves_no_connection_of_rehydrates_loop(
        rehydrate_engine, http_srv, app_loop):
    """A client made at import whose requests all go through a mount (``retries=2``): its
    loop was unknown, the check went through the mount from rehydrate's loop and left
    that loop's connection in the mount's pool, and the application's first request
    after every restore failed (``RuntimeError: <asyncio.locks.Event ...> is bound to a
    different event loop``). Its requests now tell the loop, and the check is sent there."""
    import httpx

    mount = httpx.AsyncHTTPTransport(retries=2)
    client = _module_level_client(rehydrate_engine, http_srv.url, mount)
    assert _on(app_loop, client.get("/before")).text == "/before"
    assert rehydrate_engine.simulate_snapshot().ok
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert len(mount._pool.connections) == 1  # the check's, made on the app's loop
    for path in ("/after", "/again"):
        assert _on(app_loop, client.get(path)).text == path
    _on(app_loop, client.aclose())


async def test_httpx_async_client_keeps_the_callers_event_hooks(rehydrate_engine,
                                                                http_srv):
    """With mounts= the helper's request hook (which loop the requests run on: the
    mounts' requests never reach its transport) runs before the caller's own, which still
    all run; without mounts there is no such hook (the transport records the loop)."""
    import httpx

    for name, extra, hooks in (("api", {}, 1),
                               ("mounted", {"mounts": {"all://": httpx.AsyncHTTPTransport()}},
                                2)):
        seen: list[str] = []

        async def on_request(request, seen=seen):  # type: ignore[no-untyped-def]
            seen.append(f"request {request.url.path}")

        async def on_response(response, seen=seen):  # type: ignore[no-untyped-def]
            seen.append(f"response {response.status_code}")

        client = connections.httpx_async_client(
            name, base_url=http_srv.url, engine=rehydrate_engine,
            event_hooks={"request": [on_request], "response": [on_response]}, **extra)
        assert (await client.get("/x")).text == "/x"
        assert seen == ["request /x", "response 200"]
        assert len(client.event_hooks["request"]) == hooks, name
        await client.aclose()


class _EgressProxy:
    """A forward HTTP proxy on loopback that answers the absolute-form requests it gets
    itself (keep-alive): the only route to ``http://internal.invalid``, which does not
    resolve. ``paths``: the paths asked for, in order."""

    URL = "http://internal.invalid"

    def __init__(self) -> None:
        import http.server
        import socketserver

        paths = self.paths = []  # type: ignore[var-annotated]

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                from urllib.parse import urlsplit

                path = urlsplit(self.path).path
                paths.append(path)
                body = path.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def egress_proxy():  # type: ignore[no-untyped-def]
    proxy = _EgressProxy()
    yield proxy
    proxy.stop()


def _idle_pool(mount) -> None:  # type: ignore[no-untyped-def]
    """Nothing of the check's loop left in the mount's pool: no connection, no request
    (whose event would be set from that loop's thread)."""
    assert mount._pool.connections == []
    assert mount._pool._requests == []


def test_async_httpx_mount_check_with_the_apps_loop_unknown_goes_through_the_mount(
        rehydrate_engine, egress_proxy, app_loop):
    """No request seen yet (a snapshot taken right after startup) and the hooks on
    rehydrate's loop: the check went straight to the server, bypassing the proxy mounted,
    and failed for a server only that proxy reaches (before that, it went through the
    mount from rehydrate's loop, and the application's first request failed on the
    connection it left there). It goes through a copy of the mount, whose connection it
    closes: the restore passes, and the application's requests on their own loop work."""
    import httpx

    mount = httpx.AsyncHTTPTransport(proxy=egress_proxy.url)
    client = _module_level_client(rehydrate_engine, egress_proxy.URL, mount, deadline=3)
    assert rehydrate_engine.simulate_snapshot().ok
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert egress_proxy.paths == ["/health"]
    _idle_pool(mount)
    for path in ("/first", "/second"):
        assert _on(app_loop, client.get(path)).text == path
    _on(app_loop, client.aclose())


def test_async_httpx_mount_check_with_the_apps_loop_unknown_fails_with_its_proxy(
        rehydrate_engine, http_srv, app_loop):
    """A proxy mounted that is down fails the check, as it fails every request: checked
    straight to the server, the restore passed."""
    import httpx
    from netservers import refused_port

    with refused_port() as port:
        mount = httpx.AsyncHTTPTransport(proxy=f"http://127.0.0.1:{port}")
        client = _module_level_client(rehydrate_engine, http_srv.url, mount, deadline=0.5)
        report = rehydrate_engine.simulate_restore()
        assert not report.ok
        assert "ConnectError" in _status(rehydrate_engine, "api")["last_error"]
        _idle_pool(mount)
        with pytest.raises(httpx.ConnectError):  # what the check stands for
            _on(app_loop, client.get("/x"))
    _on(app_loop, client.aclose())


def test_async_httpx_mount_check_bypassing_a_mount_says_so(rehydrate_engine, egress_proxy,
                                                            app_loop):
    """A mount that is not an ``httpx.AsyncHTTPTransport`` cannot be copied: with the
    application's loop unknown, the check goes straight to the server, and its failure
    read as the server being down, not as the mount being bypassed."""
    import httpx
    from netservers import refused_port

    class Wrapper(httpx.AsyncBaseTransport):  # a mount of the caller's own kind
        def __init__(self, inner: httpx.AsyncHTTPTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return await self.inner.handle_async_request(request)

        async def aclose(self) -> None:
            await self.inner.aclose()

    with refused_port() as port:  # the server: only the proxy reaches it
        client = connections.httpx_async_client(
            "api", base_url=f"http://127.0.0.1:{port}", check_url="/health", deadline=0.3,
            mounts={"all://": Wrapper(httpx.AsyncHTTPTransport(proxy=egress_proxy.url))},
            engine=rehydrate_engine)
        report = rehydrate_engine.simulate_restore()
        assert not report.ok
        error = _status(rehydrate_engine, "api")["last_error"]
        assert "bypassing the transport given in mounts=" in error, error
        assert "ConnectError" in error, error
        assert egress_proxy.paths == []
        assert _on(app_loop, client.get("/x")).text == "/x"
    _on(app_loop, client.aclose())


def test_async_httpx_mount_check_with_the_apps_loop_unknown_after_restore_works(
        rehydrate_engine, http_srv, app_loop):
    """The same through a mount that works: the application's first request after the
    restore (the first ever) works, on a connection of its own loop."""
    import httpx

    mount = httpx.AsyncHTTPTransport()
    client = _module_level_client(rehydrate_engine, http_srv.url, mount)
    assert rehydrate_engine.simulate_restore().ok
    assert mount._pool.connections == []
    assert _on(app_loop, client.get("/first")).text == "/first"
    assert _on(app_loop, client.get("/second")).text == "/second"
    _on(app_loop, client.aclose())


def test_async_httpx_mount_check_on_the_apps_loop_given_to_start_goes_through_it(
        rehydrate_engine, http_srv, app_loop):
    """With the hooks on the application's loop (``start(loop=...)``, as ``ReadinessGate``
    does), the check goes through the mount there even before the client's first
    request: a proxy mounted that is down fails it."""
    import httpx
    from netservers import refused_port

    rehydrate_engine.start("none", loop=app_loop)
    with refused_port() as port:
        client = _module_level_client(
            rehydrate_engine, http_srv.url,
            httpx.AsyncHTTPTransport(proxy=f"http://127.0.0.1:{port}"), deadline=0.5)
        report = rehydrate_engine.simulate_restore()
        assert not report.ok
        assert "ConnectError" in _status(rehydrate_engine, "api")["last_error"]
    _on(app_loop, client.aclose())


def test_async_httpx_mount_check_with_the_apps_loop_closed_goes_through_the_mount(
        rehydrate_engine, egress_proxy):
    """The loop the client's requests ran on is closed (``asyncio.run`` returned): no
    check can be sent there ever (one that said so was retried until the deadline), and
    one sent straight to the server failed for a server only the mounted proxy reaches.
    It goes through a copy of the mount, as with that loop unknown."""
    import httpx

    mount = httpx.AsyncHTTPTransport(proxy=egress_proxy.url)

    async def use():  # type: ignore[no-untyped-def]
        client = connections.httpx_async_client(
            "api", base_url=egress_proxy.URL, check_url="/health", deadline=2,
            mounts={"all://": mount}, engine=rehydrate_engine)
        assert (await client.get("/x")).text == "/x"

    asyncio.run(use())
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert egress_proxy.paths == ["/x", "/health"]


async def test_async_httpx_mount_check_from_a_restore_on_the_apps_loop_does_not_retry(
        rehydrate_engine, egress_proxy):
    """``simulate_restore()`` called on the application's loop (a pytest-asyncio test, a
    Jupyter cell): that loop waits for the restore, a check sent there could not run, and
    it was retried until the deadline, then failed. It goes through a copy of the mount
    (sent straight to the server, it failed for a server only the mounted proxy reaches),
    and leaves nothing in the mount's pool for this loop's next request to trip on."""
    import httpx

    mount = httpx.AsyncHTTPTransport(proxy=egress_proxy.url)
    client = connections.httpx_async_client(
        "api", base_url=egress_proxy.URL, check_url="/health", deadline=3,
        mounts={"all://": mount}, engine=rehydrate_engine)
    assert (await client.get("/before")).text == "/before"
    assert rehydrate_engine.simulate_snapshot().ok
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert egress_proxy.paths == ["/before", "/health"]
    assert (await client.get("/after")).text == "/after"
    await client.aclose()


@pytest.mark.parametrize("which", ["async_engine", "its_sync_engine"])
def test_sqlalchemy_engine_refuses_an_async_engine_at_registration(rehydrate_engine, which):
    """An ``AsyncEngine`` was accepted, then every snapshot and restore failed
    ("'AsyncConnection' object does not support the context manager protocol",
    "coroutine 'AsyncEngine.dispose' was never awaited"); its ``sync_engine`` fails the
    same way (its pool needs the asyncio extension's greenlet). No async driver needed to
    see it: a sync SQLite engine whose dialect says it is async wraps into a real one."""
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import AsyncEngine

    sync = sa.create_engine("sqlite://")
    sync.dialect.is_async = True
    async_engine = AsyncEngine(sync)
    given = async_engine if which == "async_engine" else async_engine.sync_engine
    with pytest.raises(TypeError, match="not an AsyncEngine"):
        connections.sqlalchemy_engine("db", given, engine=rehydrate_engine)
    assert connections.get("db", engine=rehydrate_engine) is None


def _established_to(port: int) -> list[str]:
    return [c.remote for c in connections.established_tcp()
            if c.outbound and c.remote.endswith(f":{port}")]


@pytest.mark.parametrize("given_to_start", [False, True])
async def test_httpx_async_snapshot_started_on_the_apps_own_loop_thread(
        rehydrate_engine, http_srv, given_to_start, caplog):
    """``simulate_snapshot()`` called on the thread of the loop the client sends on (that
    loop blocked until it returns): the pool's close was sent there and waited for, ran
    only after the snapshot had given up (``close() took longer than 5s``, report not
    ok), and the next restore waited a second more on it. Now it is left to run there,
    as on a stopped loop: the snapshot passes at once, the close runs as soon as the loop
    gets control back, and restores and requests go on."""
    loop = asyncio.get_running_loop()
    if given_to_start:
        rehydrate_engine.start("none", loop=loop)
    client = connections.httpx_async_client("api", base_url=http_srv.url,
                                            check_url="/health", deadline=5,
                                            engine=rehydrate_engine)
    assert (await client.get("/a")).text == "/a"
    assert _established_to(http_srv.port)
    snap = rehydrate_engine.simulate_snapshot()  # blocks this loop's thread
    assert snap.ok, snap.table()
    conn = connections.get("api", engine=rehydrate_engine)
    assert conn is not None and conn._pending is not None, conn.to_dict()
    await asyncio.wrap_future(conn._pending[1])  # runs now that the loop has control
    assert conn.state == "closed", conn.to_dict()
    assert not _established_to(http_srv.port)
    report = rehydrate_engine.simulate_restore()  # blocking too
    assert report.ok, report.table()
    assert conn.state == "open", conn.to_dict()
    assert (await client.get("/b")).text == "/b"
    late = [r.getMessage() for r in caplog.records
            if "hung" in r.getMessage() or "took longer" in r.getMessage()]
    assert late == []
    await client.aclose()


@pytest.fixture
def redis_srv():  # type: ignore[no-untyped-def]
    from netservers import redis_binary, redis_server

    if redis_binary() is None:
        pytest.fail("redis-server is not installed (scripts/setup-system.sh installs it)")
    srv = redis_server()
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


@pytest.mark.parametrize("given_to_start", [False, True])
async def test_redis_asyncio_snapshot_started_on_the_apps_own_loop_thread(
        rehydrate_engine, redis_srv, given_to_start):
    """The same for a ``redis.asyncio`` client: its ``disconnect()`` was sent to the
    blocked loop and the snapshot failed after ``CLOSE_TIMEOUT``. The idle connections
    are taken out of the pool at once and disconnected there when the loop runs again."""
    import redis.asyncio as aredis

    loop = asyncio.get_running_loop()
    if given_to_start:
        rehydrate_engine.start("none", loop=loop)
    client = connections.redis_client("cache", aredis.Redis(port=redis_srv.port),
                                      deadline=5, engine=rehydrate_engine)
    assert await client.set("k", "v")
    assert _established_to(redis_srv.port)
    snap = rehydrate_engine.simulate_snapshot()  # blocks this loop's thread
    assert snap.ok, snap.table()
    conn = connections.get("cache", engine=rehydrate_engine)
    assert conn is not None and conn._pending is not None, conn.to_dict()
    await asyncio.wrap_future(conn._pending[1])
    assert conn.state == "closed", conn.to_dict()
    assert not _established_to(redis_srv.port)
    report = rehydrate_engine.simulate_restore()
    assert report.ok, report.table()
    assert await client.get("k") == b"v"
    await client.aclose()


def test_credentials_in_a_libraries_error_reach_neither_report_status_nor_log(
        rehydrate_engine, caplog):
    """A ``register()`` whose check uses requests to a peer that is down: urllib3's error
    quotes the request's path with its query (``url: /health?api_key=...``), and the
    key went into the report's error, ``status()`` and the WARNING. So did the password
    of a DSN a driver quotes. Only rehydrate's own secrets were taken out."""
    import logging

    import requests
    from netservers import refused_port

    key, password = "sk_live_0123456789abcdef", "pw-0123456789"
    caplog.set_level(logging.INFO, logger="rehydrate")
    session = requests.Session()
    with refused_port() as port:
        def check(s):  # type: ignore[no-untyped-def]
            s.get(f"http://127.0.0.1:{port}/health?api_key={key}", timeout=5)

        def open_db() -> object:
            raise ConnectionError(f"could not connect to postgresql://app:{password}@"
                                  f"127.0.0.1:{port}/orders")

        connections.register("billing", open=lambda: session, check=check, deadline=0.2,
                             engine=rehydrate_engine)
        connections.register("db", open=open_db, deadline=0.2, engine=rehydrate_engine)
        connections.register("metrics", open=lambda: session, check=check, deadline=0.2,
                             required=False, engine=rehydrate_engine)
        report = rehydrate_engine.simulate_restore()
        assert connections.manager(rehydrate_engine).wait_background(10)
    session.close()
    error = _hook_error(report)
    assert not report.ok
    shown = [error, str(rehydrate_engine.status().extra["connections"]), caplog.text]
    for text in shown:
        assert key not in text and password not in text, text
    # what the message is about is still there
    assert "url: /health " in error and f"postgresql://127.0.0.1:{port}/orders" in error


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:",
                                 "sqlite:///file::memory:?cache=shared&uri=true"])
def test_sqlalchemy_engine_keeps_an_in_memory_sqlite_database(rehydrate_engine, caplog, url):
    """``create_engine("sqlite://")``: every snapshot's ``dispose()`` discarded the
    database (its only copy is its connection), from rehydrate's thread, with SQLAlchemy
    ERROR tracebacks ("SQLite objects created in a thread can only be used in that same
    thread"), while the report said ok."""
    import logging

    import sqlalchemy as sa

    caplog.set_level(logging.WARNING)
    db = connections.sqlalchemy_engine("mem", sa.create_engine(url),
                                       engine=rehydrate_engine)
    with db.begin() as c:
        c.exec_driver_sql("CREATE TABLE t (x)")
        c.exec_driver_sql("INSERT INTO t VALUES (42)")
    for _ in range(2):
        assert rehydrate_engine.simulate_snapshot().ok
        assert rehydrate_engine.simulate_restore().ok
        with db.connect() as c:
            assert c.exec_driver_sql("SELECT x FROM t").scalar() == 42
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert _status(rehydrate_engine, "mem")["state"] == "open"
    db.dispose()


def test_sqlalchemy_engine_still_disposes_a_sqlite_file_database(rehydrate_engine,
                                                                 tmp_path):
    """A file database on SQLAlchemy's default pool is disposed of as before (its file
    handles are released before a snapshot)."""
    import sqlalchemy as sa

    path = tmp_path / "t.db"
    db = connections.sqlalchemy_engine("file", sa.create_engine(f"sqlite:///{path}"),
                                       engine=rehydrate_engine)
    with db.begin() as c:
        c.exec_driver_sql("CREATE TABLE t (x)")

    def handles() -> int:
        import os

        return sum(os.path.realpath(f"/proc/self/fd/{f}") == str(path)
                   for f in os.listdir("/proc/self/fd"))

    assert handles() == 1
    assert rehydrate_engine.simulate_snapshot().ok
    assert handles() == 0
    db.dispose()


def test_sync_httpx_check_to_a_silent_peer_ends_with_its_run(rehydrate_engine):
    """With the client's ``timeout=None``, the check's GET to a peer that accepts and
    never answers waited for good on its thread after the run had given up on it (one
    more stuck thread per restore). Its waits are capped by the run's deadline, as
    ``tcp_socket``'s connect is."""
    import concurrent.futures
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nobody ever answers
        port = silent.getsockname()[1]
        client = connections.httpx_client("api", base_url=f"http://127.0.0.1:{port}",
                                          check_url="/health", timeout=None, deadline=0.3,
                                          engine=rehydrate_engine)
        report = rehydrate_engine.simulate_restore()
        assert not report.ok
        conn = connections.get("api", engine=rehydrate_engine)
        with conn._lock:  # none: it timed out by itself just before the run gave up
            calls = list(conn._calls)
        _, running = concurrent.futures.wait(calls, timeout=10)
        assert not running, "the check's thread is still waiting for the silent peer"
        client.close()


_SECRETS_SCRUBBED = [  # (library error, shown as)
    ("Could not parse SQLAlchemy URL from string 'oracle+cx_oracle://scott:tiger@db:1521/o'",
     "Could not parse SQLAlchemy URL from string 'oracle+cx_oracle://db:1521/o'"),
    # a raw "@" in the password (not percent-encoded): "ss" showed after the first one
    ("could not connect to postgresql://bob:pa@ss@db/x",
     "could not connect to postgresql://db/x"),
    ("redis://:s3@cr@t@cache:6379/0 refused", "redis://cache:6379/0 refused"),
    # ... also after a "/" or "#" past an "@" in it: a path holding an "@" goes with it
    ("postgresql://bob:p@ss/word@db/x failed", "postgresql://db/x failed"),
    ("postgresql://bob:s3cr@t#1@db/x failed", "postgresql://db/x failed"),
    ("error at https://u:pw@api.internal/users/bob@example.com: 404",
     "error at https://example.com: 404"),
    ("Could not parse SQLAlchemy URL from string 'ibm_db_sa://u:s3cret@h:50000/sample'",
     "Could not parse SQLAlchemy URL from string 'ibm_db_sa://h:50000/sample'"),
    ("postgresql+psycopg2://app:pw@db/orders", "postgresql+psycopg2://db/orders"),
    ("HTTP://USER:PASS@host/ down", "HTTP://host/ down"),
    ("connection to app:hunter2@db:5432 failed", "connection to db:5432 failed"),
    ("svc:Zk9/q+Xw@127.0.0.1:1 refused", "127.0.0.1:1 refused"),
    ("invalid dsn: host=db user=app password=hunter2 dbname=orders",
     "invalid dsn: host=db user=app password=[redacted] dbname=orders"),
    ("dsn: host=db password='two words' port=5432", "dsn: host=db password=[redacted] port=5432"),
    ("Server=db;UID=sa;PWD=s3cret;Database=x", "Server=db;UID=sa;PWD=[redacted];Database=x"),
    ("redis://default:pa/ss@cache:6379/0 refused", "redis://cache:6379/0 refused"),
    ("redis://:p#ss@cache:6379/0 refused", "redis://cache:6379/0 refused"),
    ("wss://x.io/socket?sig=ab(c)d closed", "wss://x.io/socket closed"),
    ("GET https://api.example.com/v1/x?token=abc123&y=2 returned 500",
     "GET https://api.example.com/v1/x returned 500"),
    ("request to /x?token=abc failed, retry", "request to /x failed, retry"),
    ("url: /health?api_key=K1 (Caused by NewConnectionError('...'))",
     "url: /health (Caused by NewConnectionError('...'))"),
    ("mongodb+srv://u:p@cluster0.example.net/?retryWrites=true&w=majority",
     "mongodb+srv://cluster0.example.net/"),
    # an IPv6 host is no user name: the query string went with the host
    ("GET http://[::1]:8080/?email=bob@example.com failed", "GET http://[::1]:8080/ failed"),
    ("redis://:p[w]@[::1]:6379/0 refused", "redis://[::1]:6379/0 refused"),
    ("connection to app:pw@[::1]:5432 failed", "connection to [::1]:5432 failed"),
    # a password in double quotes, or quoted with an escaped quote in it (libpq)
    ('password="hunter2" host=db', "password=[redacted] host=db"),
    ("host=db password='it\\'s secret' user=app", "host=db password=[redacted] user=app"),
    ('dsn: PWD="a \\" b";Server=db', "dsn: PWD=[redacted];Server=db"),
    # the ")" closing a call a password= is an argument of stays (a ")" inside goes)
    ("bad config Config(host='db', password=None)",
     "bad config Config(host='db', password=[redacted])"),
    ("connect(password=pw)x) failed", "connect(password=[redacted]) failed"),
    # a raw password as long as a token (a JWT of an identity provider)
    ("redis://default:" + "e/" * 600 + "@cache:6379/0 refused", "redis://cache:6379/0 refused"),
]

_TEXTS_KEPT = [  # no credential in them: shown as they are
    "UPDATE t SET a=?,b=? WHERE id=?",
    "DELETE FROM kv WHERE k=?;v=1",
    "INSERT INTO t VALUES (?,?)",
    "UPDATE users SET password=? WHERE id=?",
    "UPDATE users SET password = %s",
    "UPDATE users SET password=%(pw)s WHERE id=:id",
    "Is the server up? Retry=3",
    "expected 'a' or 'b'?got=c",
    "see https://sqlalche.me/e/20/e3q8 for details",
    "user bob@example.com not found",
    "write to mailto:bob@example.com",
    "https://example.com:8080/users/bob@example.com",
    "git@github.com:org/repo.git",
    "at 12:30:01 job@worker",
    "connection to server at \"db\" (10.0.0.1), port 5432 failed",
    # an address after a word and a colon, an image's digest: no host:port after the "@"
    "sip:alice@example.com unreachable",
    "invalid email:alice@example.com",
    "image nginx:1.25@sha256:deadbeef not found",
    "image nginx:1.25@sha256:0123abcd not found",
    "GET http://[::1]:8080/users/bob@example.com failed",
]


@pytest.mark.parametrize(("text", "shown"), _SECRETS_SCRUBBED)
def test_scrub_urls_removes_the_credentials_libraries_quote(text, shown):
    """Schemes with "_" (``ibm_db_sa``), an address without a scheme (libpq's
    ``app:pw@db:5432``), a key=value DSN's ``password=``, raw passwords holding "/" or
    "#", a query value holding "(": each reached the report, ``status()`` and the log."""
    from rehydrate._urls import scrub_urls

    assert scrub_urls(text) == shown


@pytest.mark.parametrize("unit", ["PLAINTEXT://b0:9092,", "a-"])
def test_scrub_urls_takes_time_in_proportion_to_the_text(unit):
    """A hook error quoting a Kafka client's ``bootstrap.servers`` (thousands of
    ``PLAINTEXT://host:port,`` and no "@") took 5 s to record at 88 KiB, 31 s at 364 KiB:
    each scheme scanned on to the end of the text; so did a scheme looked for at each
    "-" of a long ``a-b-c-…``. Measured against the same scrub of a sixteenth of the
    text, on the same machine: 16 times longer, not 256."""
    import time

    from rehydrate._urls import scrub_urls

    def fastest(text: str) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            scrub_urls(text)
            times.append(time.perf_counter() - started)
        return min(times)

    small = unit * (200 * 1024 // len(unit) // 16)
    assert fastest(small * 16) < 50 * fastest(small)


@pytest.mark.parametrize("text", _TEXTS_KEPT)
def test_scrub_urls_leaves_texts_without_credentials_alone(text):
    """SQL placeholders were taken for query strings (``a=?,b=?`` became ``a=``)."""
    from rehydrate._urls import scrub_urls

    assert scrub_urls(text) == text


def test_sync_redis_ping_to_a_silent_peer_ends_with_its_run(rehydrate_engine):
    """With the client's ``socket_timeout=None``, the check's ``PING`` to a peer that
    accepts and never answers waited for good on its thread after the run had given up on
    it: one more stuck thread per restore. Its waits are capped by the run's deadline;
    the application's client keeps its own settings."""
    import concurrent.futures
    import socket
    import time

    import redis

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshakes; nobody ever answers
        port = silent.getsockname()[1]
        r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=None)
        connections.redis_client("cache", r, deadline=0.3, engine=rehydrate_engine)
        conn = connections.get("cache", engine=rehydrate_engine)
        threads = []
        for _ in range(3):
            started = time.monotonic()
            report = rehydrate_engine.simulate_restore()
            assert not report.ok
            assert time.monotonic() - started < 5  # the run ended at its deadline
            with conn._lock:
                calls = list(conn._calls)
            _, running = concurrent.futures.wait(calls, timeout=5)
            assert not running, "the check's thread is still waiting for the silent peer"
            threads.append(threading.active_count())
        assert threads[0] == threads[1] == threads[2]
        assert r.connection_pool.connection_kwargs["socket_timeout"] is None
        r.close()


def test_httpx_pool_reset_debug_line_hides_the_urls_credentials(caplog):
    """Closing the old pool at a restore logged the transport's raw error at DEBUG: one
    that quotes the URL it was closing carried its ``user:password@`` (and query) into
    the log. It is scrubbed as every other connection message is."""
    import logging

    from rehydrate._httpx import make_client

    url = "http://app:s3cretpw@127.0.0.1:9/x?api_key=tok3n"
    client, transport = make_client({"base_url": url})
    try:
        def close() -> None:
            raise OSError(f"error closing connection to {url}")

        transport._inner.close = close  # type: ignore[method-assign]
        with caplog.at_level(logging.DEBUG, logger="rehydrate"):
            transport.reset()
        lines = [r.getMessage() for r in caplog.records
                 if "closing the previous httpx pool" in r.getMessage()]
        assert lines, "the failed close was not logged"
        assert all("s3cretpw" not in line and "tok3n" not in line for line in lines), lines
        assert "127.0.0.1:9" in lines[0]  # still says what it was closing
    finally:
        client.close()


@pytest.mark.parametrize("timeout", [-1, float("nan"), "5"])
def test_wait_background_refuses_a_bad_timeout(rehydrate_engine, timeout):
    """A negative or NaN timeout returned at once as if it were 0 (a string: a bare
    "unsupported operand" TypeError), where every other public wait refuses it."""
    with pytest.raises((ValueError, TypeError), match=r"wait_background\(\): timeout"):
        connections.manager(rehydrate_engine).wait_background(timeout)


def test_wait_background_on_the_loop_running_the_reopens_raises(rehydrate_engine):
    """Called on the event loop that runs the optional reopens it waits for (the hooks'
    loop: the application's under ``start(loop=...)``), it blocked them: it waited out
    its whole timeout and said False (with ``None``, it hung for good)."""
    release = asyncio.Event()

    async def open_() -> object:
        await release.wait()
        return object()

    connections.register("metrics", open=open_, required=False, deadline=60,
                         engine=rehydrate_engine)
    assert rehydrate_engine.simulate_restore().ok
    mgr = connections.manager(rehydrate_engine)
    loop = rehydrate_engine.hook_loop()

    async def wait(timeout: float) -> bool:
        return mgr.wait_background(timeout)

    with pytest.raises(RuntimeError, match="asyncio.to_thread"):
        asyncio.run_coroutine_threadsafe(wait(0.5), loop).result(10)
    # a look without waiting is fine there
    assert asyncio.run_coroutine_threadsafe(wait(0), loop).result(10) is False
    loop.call_soon_threadsafe(release.set)
    assert mgr.wait_background(10)
    assert _status(rehydrate_engine, "metrics")["state"] == "open"
