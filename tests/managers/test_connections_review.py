"""Managed connections: fixes of a review (health checks that answer False, runs
superseded mid-restore, stale errors, secrets in library errors, httpx mounts and paused
loops, SQLAlchemy engines the helper cannot manage)."""

from __future__ import annotations

import threading

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
