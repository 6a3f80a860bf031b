"""The lifecycle engine: CRaC semantics, readiness, generations, de-duplication, queueing,
re-entrancy, event loops and status."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
import threading
import time

import pytest

import rehydrate
from rehydrate import EnvChanges, HookFailed, Phase, RestoreReport, SnapshotReport
from rehydrate.detect import Detector
from rehydrate.testing import isolated_engine, restored_environ

if sys.version_info >= (3, 11):
    from builtins import ExceptionGroup
else:  # pragma: no cover
    from exceptiongroup import ExceptionGroup

DEADLINE = 10.0


def user_hooks(report):
    return [h for h in report.hooks if not h.name.startswith("rehydrate.")]


def join_all(threads, timeout=DEADLINE):
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running: {alive}"


# -- run every hook; nested errors --------------------------------------------------------


def test_every_hook_runs_and_errors_are_nested(rehydrate_engine):
    reg = rehydrate_engine.registry
    calls = []
    boom = ValueError("boom")
    bang = KeyError("bang")
    late = RuntimeError("late")

    @reg.after_restore(name="first", phase=Phase.ENTROPY)
    def first():
        calls.append("first")
        raise boom

    @reg.after_restore(name="second", phase=Phase.SECRETS)
    def second():
        calls.append("second")

    @reg.after_restore(name="third", phase=Phase.CONNECTIONS, required=False)
    async def third():
        calls.append("third")
        raise bang

    @reg.after_restore(name="fourth")
    def fourth():
        calls.append("fourth")
        raise late

    report = rehydrate_engine.simulate_restore()
    assert calls == ["first", "second", "third", "fourth"]
    assert isinstance(report, RestoreReport)
    assert report.ok is False
    outcomes = {h.name: (h.outcome, h.error) for h in user_hooks(report)}
    assert outcomes == {"first": ("failed", boom), "second": ("ok", None),
                        "third": ("failed", bang), "fourth": ("failed", late)}
    assert [h.name for h in report.failed] == ["first", "third", "fourth"]

    err = report.error
    assert isinstance(err, HookFailed)
    assert isinstance(err, ExceptionGroup)
    assert list(err.exceptions) == [boom, bang, late]
    assert "3 restore hook(s) failed" in str(err)
    assert "in hook 'first' (entropy)" in boom.__notes__
    assert "in hook 'third' (connections)" in bang.__notes__
    assert "in hook 'fourth' (application)" in late.__notes__
    # the group behaves like any ExceptionGroup
    match, rest = err.split(KeyError)
    assert isinstance(match, HookFailed) and list(match.exceptions) == [bang]
    assert list(rest.exceptions) == [boom, late]
    with pytest.raises(ExceptionGroup):
        raise err
    assert report.to_dict()["error"].startswith("HookFailed")


def test_snapshot_failures_are_collected_too(rehydrate_engine):
    reg = rehydrate_engine.registry
    calls = []
    reg.before_snapshot(name="a", phase=Phase.CONNECTIONS)(lambda: calls.append("a"))

    @reg.before_snapshot(name="b")
    def b():
        calls.append("b")
        raise OSError("disk full")

    report = rehydrate_engine.simulate_snapshot()
    assert isinstance(report, SnapshotReport)
    assert report.kind == "snapshot" and report.event == "snapshot"
    assert calls == ["b", "a"]  # APPLICATION first before a snapshot
    assert not report.ok
    assert isinstance(report.error, HookFailed)
    assert rehydrate_engine.state == "degraded" and not rehydrate_engine.is_ready()


def test_report_fields(rehydrate_engine):
    rehydrate_engine.registry.after_restore(name="x")(lambda: None)
    report = rehydrate_engine.simulate_restore(reason="unit", frozen_for=3.5)
    assert report.ok and report.error is None
    assert report.reason == "unit" and report.kind == "restore" and report.generation == 1
    assert report.frozen_for == 3.5
    assert report.duration >= sum(h.duration for h in report.hooks) * 0.5
    assert abs(report.started_at - time.time()) < 60
    (x,) = user_hooks(report)
    assert (x.name, x.phase, x.outcome, x.error, x.attempts) == (
        "x", Phase.APPLICATION, "ok", None, 1)
    assert x.duration >= 0
    d = report.to_dict()
    json.dumps(d)
    assert d["hooks"][-1] == {"name": "x", "phase": "application", "outcome": "ok",
                              "duration": d["hooks"][-1]["duration"], "error": None,
                              "required": True, "attempts": 1}
    assert "x" in report.table() and "ok=True" in report.table()


def test_failures_are_logged_one_line_each(rehydrate_engine, caplog):
    reg = rehydrate_engine.registry

    @reg.after_restore(name="req")
    def req():
        raise ValueError("multi\nline\nmessage")

    @reg.after_restore(name="opt", required=False)
    def opt():
        raise ValueError("optional")

    with caplog.at_level(logging.INFO, logger="rehydrate"):
        rehydrate_engine.simulate_restore()
    failures = [r for r in caplog.records if "req" in r.getMessage() or "opt" in r.getMessage()]
    assert all(r.name == "rehydrate" for r in caplog.records)
    by_name = {("req" if "req" in r.getMessage() else "opt"): r for r in failures}
    assert by_name["req"].levelno == logging.ERROR
    assert by_name["opt"].levelno == logging.WARNING
    assert "\n" not in by_name["req"].getMessage()


def test_a_failure_is_logged_when_its_hook_ends_not_at_the_end_of_the_run(
        rehydrate_engine, caplog):
    """Every failure was logged only once the whole run was over: an operator watching
    a 30 s restore saw nothing of a hook that failed in its first second. Each line now
    comes when its hook ends — a failure, a timeout the supervisor gave up on, an async
    failure — and only then (not again at the end)."""
    reg = rehydrate_engine.registry
    release = threading.Event()
    seen_by_later_hooks: dict[str, list[str]] = {}

    def failures_so_far() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                and r.getMessage().startswith("restore hook ")]

    @reg.after_restore(name="fails", order=1)
    def fails():
        raise ValueError("boom")

    @reg.after_restore(name="after-fails", order=2)
    def after_fails():
        seen_by_later_hooks["after-fails"] = failures_so_far()

    @reg.after_restore(name="hangs", order=3, timeout=0.2, required=False)
    def hangs():
        release.wait(DEADLINE)

    @reg.after_restore(name="after-hangs", order=4)
    def after_hangs():
        seen_by_later_hooks["after-hangs"] = failures_so_far()

    @reg.after_restore(name="async-fails", order=5)
    async def async_fails():
        raise RuntimeError("async boom")

    @reg.after_restore(name="after-async", order=6)
    def after_async():
        seen_by_later_hooks["after-async"] = failures_so_far()

    try:
        with caplog.at_level(logging.INFO, logger="rehydrate"):
            report = rehydrate_engine.simulate_restore()
    finally:
        release.set()
    assert not report.ok
    fails_line = "restore hook fails failed: ValueError: boom"
    hangs_line = "restore hook hangs timeout: HookTimeout: hook 'hangs' timed out after 0.2s"
    async_line = "restore hook async-fails failed: RuntimeError: async boom"
    assert seen_by_later_hooks == {"after-fails": [fails_line],
                                   "after-hangs": [fails_line, hangs_line],
                                   "after-async": [fails_line, hangs_line, async_line]}
    assert failures_so_far() == [fails_line, hangs_line, async_line]  # once each
    levels = {r.getMessage(): r.levelno for r in caplog.records}
    assert levels[fails_line] == levels[async_line] == logging.ERROR
    assert levels[hangs_line] == logging.WARNING  # optional


# -- readiness ------------------------------------------------------------------------


def test_required_failure_degrades_until_a_later_successful_run(rehydrate_engine):
    reg = rehydrate_engine.registry
    broken = {"on": True}

    @reg.after_restore(name="flaky")
    def flaky():
        if broken["on"]:
            raise ConnectionError("db down")

    assert rehydrate_engine.state == "running" and rehydrate_engine.is_ready()

    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    assert rehydrate_engine.state == "degraded"
    assert not rehydrate_engine.is_ready()
    assert rehydrate_engine.wait_ready(timeout=0.05) is False
    st = rehydrate_engine.status()
    assert (st.state, st.ready, st.generation, st.last_report) == ("degraded", False, 1, report)

    report2 = rehydrate_engine.simulate_restore(kind="resume")  # still failing
    assert not report2.ok and rehydrate_engine.state == "degraded"

    broken["on"] = False
    report3 = rehydrate_engine.simulate_restore()
    assert report3.ok
    assert rehydrate_engine.state == "ready" and rehydrate_engine.is_ready()
    assert rehydrate_engine.wait_ready(timeout=0) is True
    assert rehydrate_engine.status().ready is True


def test_recovered_hooks_make_a_degraded_process_ready_without_a_new_run(
        rehydrate_engine, caplog):
    """The required hooks that failed in the last restore run each report, later, that
    they did their job another way: once none is left the process is ready again — no
    new restore needed. Anything else is a no-op that says False."""
    reg = rehydrate_engine.registry
    waiting = threading.Event()
    release = threading.Event()

    @reg.after_restore(name="db")
    def db():
        raise ConnectionError("db down")

    @reg.after_restore(name="cache", timeout=0.05)
    async def cache():
        await asyncio.sleep(10)

    @reg.after_restore(name="warm", required=False)
    def warm():
        raise RuntimeError("optional")

    assert rehydrate_engine.recovered("db") is False  # running: nothing to recover
    with pytest.raises(TypeError, match="hook's name"):
        rehydrate_engine.recovered(db)
    report = rehydrate_engine.simulate_restore()
    assert not report.ok and rehydrate_engine.state == "degraded"
    assert rehydrate_engine.recovered("warm") is False  # optional: never degraded it
    assert rehydrate_engine.recovered("elsewhere") is False
    caplog.set_level(logging.INFO, logger="rehydrate")
    assert rehydrate_engine.recovered("db") is False  # "cache" (a timeout) is left
    assert rehydrate_engine.state == "degraded" and not rehydrate_engine.is_ready()
    assert rehydrate_engine.recovered("db") is False  # once only
    assert rehydrate_engine.recovered("cache") is True
    assert rehydrate_engine.state == "ready" and rehydrate_engine.is_ready()
    assert rehydrate_engine.wait_ready(timeout=0) is True
    assert rehydrate_engine.recovered("cache") is False  # ready: nothing to recover
    messages = [r.getMessage() for r in caplog.records]
    assert "hook db recovered; still degraded by: cache" in messages
    assert "hook cache recovered; ready again" in messages

    # A new failed run starts over: the previous run's recoveries do not count.
    report = rehydrate_engine.simulate_restore(kind="resume")
    assert not report.ok and rehydrate_engine.state == "degraded"
    assert rehydrate_engine.recovered("db") is False
    assert rehydrate_engine.state == "degraded"

    # While a run is in progress a call makes nothing ready: it counts when the run ends,
    # and only for a hook that had failed in it by then ("db"; not "cache", still to come).
    reg.unregister("cache")
    @reg.after_restore(name="slow")
    def slow():
        waiting.set()
        assert release.wait(10)

    @reg.after_restore(name="cache")
    def cache_again():
        raise ConnectionError("cache down")

    run = threading.Thread(target=rehydrate_engine.simulate_restore)
    run.start()
    try:
        assert waiting.wait(10)
        assert rehydrate_engine.state == "restoring"
        assert rehydrate_engine.recovered("db") is False
        assert rehydrate_engine.recovered("cache") is False
        assert rehydrate_engine.state == "restoring" and not rehydrate_engine.is_ready()
    finally:
        release.set()
        run.join(10)
    assert rehydrate_engine.state == "degraded"  # "cache" failed after that call
    assert rehydrate_engine.recovered("db") is False  # counted during the run already
    assert rehydrate_engine.recovered("cache") is True


def test_recovered_counts_hooks_sharing_a_name_and_ignores_work_older_than_the_run(
        rehydrate_engine):
    reg = rehydrate_engine.registry
    for _ in range(2):
        @reg.after_restore(name="warm")
        def warm():
            raise RuntimeError("down")

    before = time.monotonic()
    assert not rehydrate_engine.simulate_restore().ok
    # work begun before the failed run cannot vouch for what that run rejected
    assert rehydrate_engine.recovered("warm", since=before) is False
    assert rehydrate_engine.recovered("warm", since=time.monotonic()) is False  # 1 of 2
    assert rehydrate_engine.state == "degraded"
    assert rehydrate_engine.recovered("warm") is True
    assert rehydrate_engine.state == "ready"


def test_a_recovery_during_the_run_counts_only_after_the_hook_failed(rehydrate_engine,
                                                                      caplog):
    """A certificate watcher reloads while later hooks of the same run still run: that
    recovery counts when the run ends (it fires once; dropped, the process stayed
    degraded for good). One made before the hook failed in this run, or by work begun
    before the run, does not: the hook's own outcome decides."""
    reg = rehydrate_engine.registry
    calls = []

    @reg.after_restore(phase="environment", name="early")
    def early():
        calls.append(rehydrate_engine.recovered("cert"))  # before "cert" failed: nothing

    @reg.after_restore(phase="secrets", name="cert")
    def cert():
        raise FileNotFoundError("not mounted yet")

    @reg.after_restore(phase="secrets", name="token")
    def token():
        raise FileNotFoundError("not mounted yet")

    @reg.after_restore(name="late")
    def late():
        calls.append(rehydrate_engine.recovered("cert"))
        calls.append(rehydrate_engine.recovered("token", since=-1.0))  # older than the run

    caplog.set_level(logging.INFO, logger="rehydrate")
    report = rehydrate_engine.simulate_restore()
    assert not report.ok and calls == [False, False, False]
    assert report.recovered == ("cert",) and not report.ready  # "token" is left
    assert rehydrate_engine.state == "degraded"
    assert rehydrate_engine.recovered("cert") is False  # counted already, during the run
    assert rehydrate_engine.recovered("token") is True
    assert rehydrate_engine.state == "ready"

    reg.unregister("token")
    calls.clear()
    report = rehydrate_engine.simulate_restore()
    assert not report.ok  # the report keeps what happened, and says it ended ready
    assert report.recovered == ("cert",) and report.ready
    assert report.to_dict()["recovered"] == ["cert"]
    assert rehydrate_engine.status().last_report is report
    assert rehydrate_engine.state == "ready" and rehydrate_engine.is_ready()
    assert any(r.getMessage().endswith("ready (recovered while the run went on: cert)")
               for r in caplog.records)


def test_a_failed_snapshot_pass_is_not_recovered_by_hook_name(rehydrate_engine):
    """Degraded by a before-snapshot pass: the process holds no keys until the next
    restore (snapshot pending), so no hook's recovery makes it ready."""
    reg = rehydrate_engine.registry

    @reg.before_snapshot(name="flush")
    def flush():
        raise OSError("disk full")

    assert not rehydrate_engine.simulate_snapshot().ok
    assert rehydrate_engine.state == "degraded"
    assert rehydrate_engine.recovered("flush") is False
    assert rehydrate_engine.state == "degraded" and rehydrate_engine.snapshot_pending


def test_optional_failure_is_reported_but_keeps_ready(rehydrate_engine):
    reg = rehydrate_engine.registry

    @reg.after_restore(name="warm-cache", required=False)
    def warm():
        raise RuntimeError("cache unreachable")

    report = rehydrate_engine.simulate_restore()
    assert report.ok
    assert [h.outcome for h in user_hooks(report)] == ["failed"]
    assert isinstance(report.error, HookFailed)  # still reported
    assert rehydrate_engine.state == "ready" and rehydrate_engine.is_ready()


def test_optional_timeout_keeps_ready_required_timeout_degrades(rehydrate_engine):
    reg = rehydrate_engine.registry
    release = threading.Event()
    reg.after_restore(name="slow-optional", timeout=0.1, required=False)(
        lambda: release.wait(DEADLINE))
    report = rehydrate_engine.simulate_restore()
    release.set()
    assert report.ok and rehydrate_engine.is_ready()
    assert user_hooks(report)[0].outcome == "timeout"

    release.clear()
    reg.clear()
    reg.after_restore(name="slow-required", timeout=0.1)(lambda: release.wait(DEADLINE))
    report = rehydrate_engine.simulate_restore()
    release.set()
    assert not report.ok and not rehydrate_engine.is_ready()
    assert rehydrate_engine.state == "degraded"


def test_wait_ready_blocks_while_restoring_and_states_inside_hooks(rehydrate_engine):
    reg = rehydrate_engine.registry
    entered = threading.Event()
    release = threading.Event()
    seen = {}

    @reg.after_restore
    def slow():
        seen["restore"] = (rehydrate_engine.state, rehydrate_engine.is_ready())
        entered.set()
        release.wait(DEADLINE)

    @reg.before_snapshot
    def snap():
        seen["snapshot"] = (rehydrate_engine.state, rehydrate_engine.is_ready())

    rehydrate_engine.simulate_snapshot()
    assert seen["snapshot"] == ("snapshotting", False)
    assert rehydrate_engine.state == "snapshotting"

    runner = threading.Thread(target=rehydrate_engine.simulate_restore)
    runner.start()
    assert entered.wait(DEADLINE)
    assert seen["restore"] == ("restoring", False)
    waited = {}
    waiter = threading.Thread(
        target=lambda: waited.setdefault("ok", rehydrate_engine.wait_ready(DEADLINE)))
    waiter.start()
    assert rehydrate_engine.wait_ready(timeout=0.05) is False  # still restoring
    assert "ok" not in waited
    release.set()
    join_all([runner, waiter])
    assert waited["ok"] is True
    assert rehydrate_engine.state == "ready"


# -- generations and status -------------------------------------------------------------


def test_generation_restore_increments_resume_and_snapshot_keep(rehydrate_engine):
    reg = rehydrate_engine.registry
    seen = []
    reg.after_restore(lambda ctx: seen.append((ctx.generation, ctx.kind, ctx.reason)))
    reg.before_snapshot(lambda ctx: seen.append((ctx.generation, ctx.kind, ctx.reason)))

    assert rehydrate_engine.generation == 0
    assert rehydrate_engine.simulate_snapshot().generation == 0
    assert rehydrate_engine.simulate_restore(kind="resume", reason="r0").generation == 0
    assert rehydrate_engine.simulate_restore(reason="r1").generation == 1
    assert rehydrate_engine.simulate_snapshot().generation == 1
    assert rehydrate_engine.simulate_restore(reason="r2").generation == 2
    assert rehydrate_engine.simulate_restore(kind="resume", reason="r3").generation == 2
    assert rehydrate_engine.restore_detected("gvisor").generation == 3
    assert rehydrate_engine.generation == rehydrate_engine.status().generation == 3
    assert seen == [
        (0, "snapshot", "simulated"),
        (0, "resume", "r0"),
        (1, "restore", "r1"),
        (1, "snapshot", "simulated"),
        (2, "restore", "r2"),
        (2, "resume", "r3"),
        (3, "restore", "gvisor"),
    ]


def test_generation_increments_even_when_hooks_fail(rehydrate_engine):
    @rehydrate_engine.registry.after_restore
    def fail():
        raise RuntimeError

    assert rehydrate_engine.simulate_restore().generation == 1
    assert rehydrate_engine.simulate_restore().generation == 2


def test_status_builds_only_the_fields_asked_for(rehydrate_engine):
    """status(fields=...): a view that shows a few published fields does not run the
    others' functions (the TCP connections field scans /proc on every call)."""
    built: list[str] = []
    for key in ("rht-a", "rht-b"):
        rehydrate_engine.add_status(key, lambda key=key: built.append(key) or key)
    st = rehydrate_engine.status(fields=())
    assert (st.state, "rht-a" in st, "rht-b" in st, built) == ("running", False, False, [])
    st = rehydrate_engine.status(fields="rht-a")  # one name, not its characters
    assert (st["rht-a"], "rht-b" in st, built) == ("rht-a", False, ["rht-a"])
    st = rehydrate_engine.status()
    assert (st["rht-a"], st["rht-b"]) == ("rht-a", "rht-b")


def test_status_to_dict_fields(rehydrate_engine):
    st = rehydrate_engine.status()
    d = st.to_dict()
    core = {k: d[k] for k in ("state", "generation", "ready", "detectors", "last_report")}
    assert core == {"state": "running", "generation": 0, "ready": True, "detectors": [],
                    "last_report": None}  # built-in managers may add their own fields
    rehydrate_engine.add_status("custom", lambda: {"answer": 42})
    rehydrate_engine.add_status("broken", lambda: 1 / 0)
    rehydrate_engine.registry.after_restore(name="h")(lambda: None)
    report = rehydrate_engine.simulate_restore(env={"STATUS_TEST_KEY": "s3cr3t-value"},
                                               reason="unit")
    st = rehydrate_engine.status()
    assert st.last_report is report
    d = st.to_dict()
    json.dumps(d)  # machine-readable as is
    assert {"state", "generation", "ready", "detectors", "last_report"} <= set(d)
    assert (d["state"], d["generation"], d["ready"], d["detectors"]) == ("ready", 1, True, [])
    assert d["custom"] == {"answer": 42}
    assert d["broken"].startswith("unavailable: ZeroDivisionError")
    last = d["last_report"]
    assert {"event", "ok", "generation", "reason", "kind", "duration", "hooks",
            "env_changes", "error", "frozen_for", "started_at"} <= set(last)
    assert (last["event"], last["ok"], last["reason"], last["kind"]) == (
        "restore", True, "unit", "restore")
    assert last["env_changes"] == {"added": ["STATUS_TEST_KEY"], "changed": [], "removed": []}
    assert "s3cr3t-value" not in json.dumps(d)  # names only, never values
    assert {"name", "phase", "outcome", "duration", "error"} <= set(last["hooks"][0])
    snap = rehydrate_engine.simulate_snapshot()
    assert rehydrate_engine.status().to_dict()["last_report"]["event"] == "snapshot"
    assert rehydrate_engine.status().last_report is snap


def test_status_to_dict_is_json_ready_with_keys_json_cannot_have(rehydrate_engine):
    """An extension's counters keyed by (host, port): json.dumps(status().to_dict(),
    default=str) raised (default= is never applied to keys), as did the ASGI gate's
    /rehydrate/status; only the control socket converted them. to_dict() now gives such
    keys as their str(), as the socket sent them, and leaves what JSON takes alone."""
    counters = {"plain": [1, 2]}
    rehydrate_engine.add_status("peers", lambda: {("db", 5432): 3, 7: {("a", None): "x"},
                                                  "list": [{(1, 2): True}, (3, 4)]})
    rehydrate_engine.add_status("counters", lambda: counters)
    looped: dict[str, object] = {}
    looped["self"] = looped
    d = rehydrate_engine.status().to_dict()
    assert d["peers"] == {"('db', 5432)": 3, 7: {"('a', None)": "x"},
                          "list": [{"(1, 2)": True}, (3, 4)]}
    assert d["counters"] is counters  # nothing to replace: not copied
    assert json.loads(json.dumps(d, default=str))["peers"]["7"] == {"('a', None)": "x"}
    rehydrate_engine.add_status("looped", lambda: looped)
    assert rehydrate_engine.status().to_dict()["looped"] is looped  # left to the encoder


def test_status_to_dict_takes_nesting_the_encoder_takes(rehydrate_engine):
    """to_dict() walked the extensions' fields recursively, two frames a level: a field
    nested 500 deep raised RecursionError where json.dumps(default=str) took 900. The
    walk is iterative: any depth, a deep key JSON cannot have still replaced, a deep
    field with none returned as it is."""
    plain = cur = {}
    for _ in range(5000):
        cur["x"] = cur = {}
    keyed = cur = {}
    for _ in range(5000):
        cur["x"] = cur = {}
    cur[("db", 5432)] = [{(1, 2): "y"}]
    shared = {("s",): 1}
    looped: dict[object, object] = {("k",): 1}
    looped["self"] = looped
    rehydrate_engine.add_status("plain", lambda: plain)
    rehydrate_engine.add_status("keyed", lambda: keyed)
    rehydrate_engine.add_status("shared", lambda: [shared, (shared, looped)])
    d = rehydrate_engine.status().to_dict()
    assert d["plain"] is plain
    leaf = d["keyed"]
    for _ in range(5000):
        leaf = leaf["x"]
    assert leaf == {"('db', 5432)": [{"(1, 2)": "y"}]}
    first, (second, loop_copy) = d["shared"]
    assert first is second == {"('s',)": 1}  # a shared field: one copy
    assert loop_copy == {"('k',)": 1, "self": looped}  # the loop left to the encoder


def test_listeners_get_every_report_and_a_failing_listener_is_contained(rehydrate_engine,
                                                                       caplog):
    got = []

    def bad(report):
        raise RuntimeError("listener bug")

    rehydrate_engine.add_listener(bad)
    rehydrate_engine.add_listener(got.append)
    with caplog.at_level(logging.ERROR, logger="rehydrate"):
        r1 = rehydrate_engine.simulate_restore()
        s1 = rehydrate_engine.simulate_snapshot()
    assert got == [r1, s1]
    assert any("listener" in r.getMessage() for r in caplog.records)
    rehydrate_engine.remove_listener(got.append)
    rehydrate_engine.simulate_restore()
    assert got == [r1, s1]


# -- once per event under concurrent triggers ------------------------------------------


def _hammer(engine, n, call):
    barrier = threading.Barrier(n)
    reports = [None] * n
    errors = []

    def work(i):
        try:
            barrier.wait(DEADLINE)
            reports[i] = call(i)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), name=f"trigger-{i}")
               for i in range(n)]
    for t in threads:
        t.start()
    join_all(threads)
    assert not errors
    return reports


def test_same_key_from_many_threads_runs_hooks_once(rehydrate_engine):
    runs = []
    lock = threading.Lock()

    @rehydrate_engine.registry.after_restore
    def count(ctx):
        with lock:
            runs.append(ctx.reason)
        time.sleep(0.01)  # widen the window in which duplicates arrive

    reports = _hammer(
        rehydrate_engine, 16,
        lambda i: rehydrate_engine.restore_detected(f"detector-{i % 4}", key="restore-42"))
    assert len(runs) == 1
    ran = [r for r in reports if not r.deduplicated]
    assert len(ran) == 1 and ran[0].reason == runs[0]
    assert {(r.generation, r.reason) for r in reports} == {(1, runs[0])}
    assert rehydrate_engine.generation == 1
    # a new event key is a new restore
    again = rehydrate_engine.restore_detected("gvisor", key="restore-43")
    assert again.generation == 2 and len(runs) == 2 and rehydrate_engine.generation == 2
    # an old key stays handled
    old = rehydrate_engine.restore_detected("gvisor", key="restore-42")
    assert old.deduplicated and old.generation == 1
    assert len(runs) == 2


def test_since_semantics_from_many_threads_runs_hooks_once(rehydrate_engine):
    runs = []

    @rehydrate_engine.registry.after_restore
    def count():
        runs.append(1)
        time.sleep(0.01)

    since = time.monotonic()  # every detector last saw the process before the "freeze"
    reports = _hammer(
        rehydrate_engine, 16,
        lambda i: rehydrate_engine.restore_detected(
            ["clock-jump", "gvisor", "identity", "signal"][i % 4], since=since))
    assert len(runs) == 1
    ran = [r for r in reports if not r.deduplicated]
    assert len(ran) == 1
    assert all(r.started_at == ran[0].started_at for r in reports)
    # every later notice is recorded on the report, with its reason
    confirmed = rehydrate_engine.status().last_report.confirmed_by
    assert len(confirmed) == 15
    assert sorted(confirmed + (ran[0].reason,)) == sorted(
        ["clock-jump", "gvisor", "identity", "signal"] * 4)
    assert rehydrate_engine.generation == 1

    # a notice whose `since` is before the last handled restore is that restore
    late = rehydrate_engine.restore_detected("clock-jump", since=since)
    assert late.deduplicated and late.started_at == ran[0].started_at and len(runs) == 1
    # a detector that saw the process after the last restore reports a new one
    since2 = time.monotonic()
    fresh = rehydrate_engine.restore_detected("clock-jump", since=since2)
    assert not fresh.deduplicated and len(runs) == 2 and fresh.generation == 2
    # no `since`, no key: every notice is a new event
    rehydrate_engine.restore_detected("manual")
    assert len(runs) == 3


def test_snapshot_key_runs_once(rehydrate_engine):
    runs = []
    rehydrate_engine.registry.before_snapshot(lambda: runs.append(1))
    reports = _hammer(rehydrate_engine, 8,
                      lambda i: rehydrate_engine.snapshot_requested("notify", key="save-1"))
    assert len(runs) == 1 and all(r is reports[0] for r in reports)


def test_distinct_restores_are_queued_not_interleaved(rehydrate_engine):
    active = 0
    max_active = 0
    intervals = []
    lock = threading.Lock()

    def make(tag):
        def hook(ctx):
            nonlocal active, max_active
            with lock:
                active += 1
                max_active = max(max_active, active)
                start = time.monotonic()
            time.sleep(0.005)
            with lock:
                active -= 1
                intervals.append((start, time.monotonic(), ctx))
        return hook

    reg = rehydrate_engine.registry
    reg.after_restore(make("a"), phase=Phase.ENTROPY)
    reg.after_restore(make("b"))
    reg.before_snapshot(make("s"))

    def call(i):
        if i % 3 == 2:
            return rehydrate_engine.simulate_snapshot(reason=f"s{i}")
        return rehydrate_engine.restore_detected(f"r{i}")

    reports = _hammer(rehydrate_engine, 9, call)
    assert max_active == 1
    restores = [r for r in reports if r.kind == "restore"]
    assert sorted(r.generation for r in restores) == list(range(1, 7))
    # each event's hooks form one contiguous block: no event starts inside another
    events = {}
    for start, end, ctx in intervals:  # one RestoreContext per event
        lo, hi = events.get(id(ctx), (start, end))
        events[id(ctx)] = (min(lo, start), max(hi, end))
    assert len(events) == 9
    # restores ran in the order their generations were assigned
    runs = sorted((lo, id_) for id_, (lo, _) in events.items())
    ctx_by_id = {id(ctx): ctx for _, _, ctx in intervals}
    gens = [ctx_by_id[i].generation for _, i in runs if ctx_by_id[i].kind == "restore"]
    assert gens == sorted(gens)
    spans = sorted(events.values())
    for (_, end1), (start2, _) in zip(spans, spans[1:]):
        assert start2 >= end1


def test_second_restore_waits_for_the_running_one(rehydrate_engine):
    entered = threading.Event()
    release = threading.Event()
    order = []

    @rehydrate_engine.registry.after_restore
    def hook(ctx):
        order.append(("start", ctx.reason))
        if ctx.reason == "first":
            entered.set()
            release.wait(DEADLINE)
        order.append(("end", ctx.reason))

    t1 = threading.Thread(target=rehydrate_engine.restore_detected, args=("first",))
    t1.start()
    assert entered.wait(DEADLINE)
    second_called = threading.Event()

    def second():
        second_called.set()
        rehydrate_engine.restore_detected("second")

    t2 = threading.Thread(target=second)
    t2.start()
    assert second_called.wait(DEADLINE)
    t2.join(0.1)
    assert t2.is_alive()  # blocked behind the first event
    assert order == [("start", "first")]
    # waiting means waiting entirely: no generation bump, no state change yet
    assert rehydrate_engine.generation == 1
    assert rehydrate_engine.state == "restoring"
    release.set()
    join_all([t1, t2])
    assert order == [("start", "first"), ("end", "first"), ("start", "second"),
                     ("end", "second")]


# -- registration during a run ---------------------------------------------------------


def test_hooks_registered_during_a_run_take_effect_from_the_next_event(rehydrate_engine):
    reg = rehydrate_engine.registry
    calls = []
    late_record = {}

    def late():
        calls.append("late")

    @reg.after_restore(phase=Phase.ENTROPY, name="registrar")
    def registrar():
        calls.append("registrar")
        if "late" not in late_record:
            late_record["late"] = reg.after_restore(name="late")(late)
            reg.unregister("victim")  # removing also waits for the next event

    reg.after_restore(name="victim")(lambda: calls.append("victim"))

    first = rehydrate_engine.simulate_restore()
    assert calls == ["registrar", "victim"]
    assert [h.name for h in user_hooks(first)] == ["registrar", "victim"]
    calls.clear()
    second = rehydrate_engine.simulate_restore()
    assert calls == ["registrar", "late"]
    assert [h.name for h in user_hooks(second)] == ["registrar", "late"]


def test_registration_from_another_thread_during_a_run(rehydrate_engine):
    reg = rehydrate_engine.registry
    entered = threading.Event()
    release = threading.Event()
    calls = []

    @reg.after_restore
    def blocker():
        calls.append("blocker")
        entered.set()
        release.wait(DEADLINE)

    t = threading.Thread(target=rehydrate_engine.simulate_restore)
    t.start()
    assert entered.wait(DEADLINE)
    reg.after_restore(name="added")(lambda: calls.append("added"))
    release.set()
    join_all([t])
    assert calls == ["blocker"]
    rehydrate_engine.simulate_restore()
    assert calls == ["blocker", "blocker", "added"]


# -- re-entrancy ------------------------------------------------------------------------


def _run_with_deadline(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(DEADLINE)
    assert not t.is_alive(), "deadlocked"
    return box["r"]


def test_starting_an_event_inside_a_hook_raises_instead_of_deadlocking(rehydrate_engine):
    reg = rehydrate_engine.registry
    caught = {}

    @reg.after_restore(name="nested-sync")
    def nested_sync():
        rehydrate_engine.simulate_restore()

    @reg.after_restore(name="nested-async")
    async def nested_async():
        rehydrate_engine.simulate_snapshot()

    @reg.after_restore(name="nested-to-thread")
    async def nested_to_thread():
        await asyncio.to_thread(rehydrate_engine.restore_detected, "x")

    @reg.after_restore(name="catching")
    def catching():
        try:
            rehydrate_engine.restore_detected("x", key="k")
        except RuntimeError as exc:
            caught["msg"] = str(exc)

    report = _run_with_deadline(rehydrate_engine.simulate_restore)
    results = {h.name: h for h in user_hooks(report)}
    for name in ("nested-sync", "nested-async", "nested-to-thread"):
        assert results[name].outcome == "failed", name
        assert isinstance(results[name].error, RuntimeError)
        assert "inside a hook" in str(results[name].error)
    assert results["catching"].outcome == "ok"
    assert "inside a hook" in caught["msg"]
    assert rehydrate_engine.generation == 1  # nothing nested ran
    # the engine is not wedged
    assert _run_with_deadline(rehydrate_engine.simulate_snapshot).kind == "snapshot"


def test_a_task_a_hook_left_running_may_wait_for_and_start_events(rehydrate_engine):
    """A worker a restore hook started (a matchmaker) and that runs on after it was
    refused wait_ready() and simulate_snapshot() as if it were the hook: "inside a hook
    would wait for its own event" — at the next restore, or any time later."""
    reg = rehydrate_engine.registry
    go, done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    async def worker() -> None:
        await asyncio.to_thread(go.wait, DEADLINE)
        try:
            seen["ready"] = await asyncio.to_thread(rehydrate_engine.wait_ready, DEADLINE)
            seen["snapshot"] = (await asyncio.to_thread(
                rehydrate_engine.simulate_snapshot)).ok
        except RuntimeError as exc:
            seen["error"] = str(exc)
        finally:
            done.set()

    @reg.after_restore(name="start-worker")
    async def start_worker() -> None:
        if "task" not in seen:
            seen["task"] = asyncio.get_running_loop().create_task(worker())

    assert _run_with_deadline(rehydrate_engine.simulate_restore).ok
    go.set()  # the hook has returned: its worker waits for readiness, then snapshots
    assert done.wait(DEADLINE)
    assert seen.get("error") is None
    assert seen["ready"] is True and seen["snapshot"] is True


def test_a_task_on_rehydrates_loop_may_not_block_it_waiting(rehydrate_engine):
    """A task a hook left on rehydrate's loop that calls the blocking wait_ready() while
    not ready, or starts an event there, would stop the async hooks those wait for (they
    run on that loop): refused with the way round, not a hang. wait_ready(0) cannot
    block: it answers."""
    reg = rehydrate_engine.registry
    go, done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    async def worker() -> None:
        await asyncio.to_thread(go.wait, DEADLINE)
        seen["poll"] = rehydrate_engine.wait_ready(0)  # cannot block: answered
        for name, call in (("wait", lambda: rehydrate_engine.wait_ready(DEADLINE)),
                           ("snapshot", rehydrate_engine.simulate_snapshot)):
            try:
                seen[name] = call()
            except RuntimeError as exc:
                seen[name] = str(exc)
        done.set()

    @reg.after_restore(name="start-worker")
    async def start_worker() -> None:
        seen["task"] = asyncio.get_running_loop().create_task(worker())

    @reg.after_restore(name="fails")
    def fails() -> None:
        raise OSError("down")

    report = _run_with_deadline(rehydrate_engine.simulate_restore)
    assert not report.ok and not rehydrate_engine.is_ready()  # degraded: wait_ready waits
    go.set()
    assert done.wait(DEADLINE)
    assert seen["poll"] is False
    for name in ("wait", "snapshot"):
        assert "asyncio.to_thread" in str(seen[name]), seen[name]


def test_wait_ready_inside_a_hook_raises(rehydrate_engine):
    reg = rehydrate_engine.registry

    @reg.after_restore(name="waits-sync")
    def waits_sync():
        rehydrate_engine.wait_ready()

    @reg.after_restore(name="waits-async")
    async def waits_async():
        rehydrate_engine.wait_ready(timeout=5)

    report = _run_with_deadline(rehydrate_engine.simulate_restore)
    for name in ("waits-sync", "waits-async"):
        res = next(h for h in report.hooks if h.name == name)
        assert res.outcome == "failed" and "its own event" in str(res.error)


def test_a_hook_may_drive_another_engine(rehydrate_engine):
    from rehydrate.testing import isolated_engine

    other = isolated_engine()
    calls = []
    other.registry.after_restore(lambda: calls.append("other"))

    @rehydrate_engine.registry.after_restore(name="drives-other")
    def drives_other():
        assert other.simulate_restore().ok
        assert other.wait_ready(timeout=1)

    @rehydrate_engine.registry.after_restore(name="drives-other-async")
    async def drives_other_async():
        await asyncio.to_thread(other.simulate_restore)

    try:
        report = _run_with_deadline(rehydrate_engine.simulate_restore)
        assert report.ok, report.table()
        assert calls == ["other", "other"] and other.generation == 2
    finally:
        other.close()


# -- event loops ----------------------------------------------------------------------


@pytest.fixture
def app_loop():
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    thread = threading.Thread(target=run, name="app-loop", daemon=True)
    thread.start()
    assert ready.wait(DEADLINE)
    yield loop, thread
    loop.call_soon_threadsafe(loop.stop)
    thread.join(DEADLINE)
    loop.close()


def test_async_hooks_run_on_the_loop_given_to_start(rehydrate_engine, app_loop):
    loop, thread = app_loop
    seen = {}

    @rehydrate_engine.registry.after_restore
    async def on_app_loop(ctx):
        seen["thread"] = threading.current_thread()
        seen["loop"] = asyncio.get_running_loop()

    @rehydrate_engine.registry.before_snapshot
    async def snap():
        seen["snap_loop"] = asyncio.get_running_loop()

    @rehydrate_engine.registry.after_restore
    def sync_hook():
        seen["sync_thread"] = threading.current_thread()

    assert rehydrate_engine.start(detectors="none", loop=loop) == []
    try:
        assert rehydrate_engine.simulate_restore().ok
        assert seen["thread"] is thread
        assert seen["loop"] is loop
        assert seen["sync_thread"].name == "rehydrate-hooks"  # sync hooks never touch it
        rehydrate_engine.simulate_snapshot()
        assert seen["snap_loop"] is loop
    finally:
        rehydrate_engine.stop()


def test_async_hooks_run_on_the_engine_loop_without_one(rehydrate_engine):
    seen = {}

    @rehydrate_engine.registry.after_restore
    async def hook():
        seen["thread"] = threading.current_thread()
        seen["loop"] = asyncio.get_running_loop()

    assert rehydrate_engine.simulate_restore().ok
    assert seen["thread"].name == "rehydrate-loop"
    assert seen["thread"] is not threading.current_thread()
    first_loop = seen["loop"]
    rehydrate_engine.simulate_restore()
    assert seen["loop"] is first_loop  # one private loop, reused


def test_event_started_on_the_app_loop_thread_does_not_deadlock(rehydrate_engine, app_loop):
    loop, thread = app_loop
    seen = {}

    @rehydrate_engine.registry.after_restore
    async def hook():
        seen["thread"] = threading.current_thread()

    rehydrate_engine.start(detectors="none", loop=loop)
    try:
        async def blocking_call_from_the_loop():
            return rehydrate_engine.simulate_restore()

        fut = asyncio.run_coroutine_threadsafe(blocking_call_from_the_loop(), loop)
        report = fut.result(DEADLINE)
        assert report.ok
        assert seen["thread"].name == "rehydrate-loop"  # fell back to the private loop
    finally:
        rehydrate_engine.stop()


def test_stopped_user_loop_falls_back_to_the_engine_loop(rehydrate_engine):
    loop = asyncio.new_event_loop()
    seen = {}

    @rehydrate_engine.registry.after_restore
    async def hook():
        seen["loop"] = asyncio.get_running_loop()

    try:
        rehydrate_engine.start(detectors="none", loop=loop)  # never run
        assert rehydrate_engine.simulate_restore().ok
        assert seen["loop"] is not loop
    finally:
        rehydrate_engine.stop()
        loop.close()


async def test_simulate_from_async_test_code(rehydrate_engine):
    """A test written as a coroutine can call the simulator (it blocks briefly)."""
    seen = []

    @rehydrate_engine.registry.after_restore
    async def hook():
        seen.append(asyncio.get_running_loop())

    report = await asyncio.to_thread(rehydrate_engine.simulate_restore)
    assert report.ok and seen and seen[0] is not asyncio.get_running_loop()


# -- on_env_change ----------------------------------------------------------------------


def test_on_env_change_runs_only_when_watched_keys_change(rehydrate_engine, monkeypatch):
    monkeypatch.setenv("ENVCHG_A", "1")
    reg = rehydrate_engine.registry
    calls = []

    @reg.on_env_change("ENVCHG_A", name="watch-a")
    def watch_a(ctx, changes):
        calls.append(("a", changes.to_dict()))

    @reg.on_env_change(name="watch-any")
    def watch_any(ctx, changes):
        calls.append(("any", changes.to_dict()))

    @reg.after_restore(name="plain")
    def plain(ctx):
        calls.append(("plain", ctx.env_changes.to_dict()))

    def outcomes(report):
        return {h.name: h.outcome for h in user_hooks(report)}

    # A unchanged (same value), B added: watch-a skipped, watch-any runs
    r = rehydrate_engine.simulate_restore(env={"ENVCHG_A": "1", "ENVCHG_B": "x"})
    assert outcomes(r) == {"watch-a": "skipped", "watch-any": "ok", "plain": "ok"}
    assert calls == [("any", {"added": ["ENVCHG_B"], "changed": [], "removed": []}),
                     ("plain", {"added": ["ENVCHG_B"], "changed": [], "removed": []})]
    skipped = next(h for h in r.hooks if h.name == "watch-a")
    assert skipped.attempts == 0 and skipped.error is None
    calls.clear()

    # nothing changes: both env hooks skipped, report still ok
    r = rehydrate_engine.simulate_restore(env={"ENVCHG_A": "1"})
    assert outcomes(r) == {"watch-a": "skipped", "watch-any": "skipped", "plain": "ok"}
    assert r.ok
    calls.clear()

    # A changed, B removed
    r = rehydrate_engine.simulate_restore(env={"ENVCHG_A": "2", "ENVCHG_B": None})
    assert outcomes(r) == {"watch-a": "ok", "watch-any": "ok", "plain": "ok"}
    assert calls[0] == ("a", {"added": [], "changed": ["ENVCHG_A"], "removed": []})
    assert calls[1] == ("any", {"added": [], "changed": ["ENVCHG_A"],
                                "removed": ["ENVCHG_B"]})
    assert r.env_changes.changed == ("ENVCHG_A",)
    assert os.environ["ENVCHG_A"] == "2" and "ENVCHG_B" not in os.environ


def test_on_env_change_takes_glob_patterns_like_protect(rehydrate_engine, monkeypatch):
    """``on_env_change("DB_*")`` matched a key literally named ``DB_*``: it never ran,
    though ``EnvRefresher(protect=...)`` takes globs."""
    monkeypatch.delenv("GLOBCHG_DB_URL", raising=False)
    monkeypatch.delenv("GLOBCHG_DB_USER", raising=False)
    reg = rehydrate_engine.registry
    calls = []

    @reg.on_env_change("GLOBCHG_DB_*", "GLOBCHG_K?", name="db")
    def db(ctx, changes):
        calls.append(changes.to_dict())

    @reg.on_env_change("GLOBCHG_db_*", name="lower")  # case-sensitive, as protect= is
    def lower(ctx, changes):
        calls.append("lower")

    r = rehydrate_engine.simulate_restore(env={"GLOBCHG_DB_URL": "x", "GLOBCHG_DB_USER": "u",
                                               "GLOBCHG_K1": "1", "GLOBCHG_KEY": "2",
                                               "GLOBCHG_OTHER": "y"})
    assert {h.name: h.outcome for h in user_hooks(r)} == {"db": "ok", "lower": "skipped"}
    assert calls == [{"added": ["GLOBCHG_DB_URL", "GLOBCHG_DB_USER", "GLOBCHG_K1"],
                      "changed": [], "removed": []}]
    calls.clear()
    r = rehydrate_engine.simulate_restore(env={"GLOBCHG_OTHER": "z"})
    assert {h.name: h.outcome for h in user_hooks(r)} == {"db": "skipped", "lower": "skipped"}
    assert calls == []
    assert EnvChanges(changed=("A", "B_1")).only(("B_*", "A")) == EnvChanges(
        changed=("A", "B_1"))


def test_environment_step_runs_first_and_hooks_see_its_changes(rehydrate_engine):
    seen = []

    @rehydrate_engine.registry.after_restore(phase=Phase.ENVIRONMENT)
    def env_phase_hook(ctx):
        seen.append(ctx.env_changes.added)

    report = rehydrate_engine.simulate_restore(env={"ORDER_CHECK_KEY": "1"})
    assert [h.name for h in report.hooks][0] == "rehydrate.env"
    assert seen == [("ORDER_CHECK_KEY",)]
    assert report.ok


def test_environment_step_runs_before_user_hooks_of_any_order(rehydrate_engine):
    """The refresh was at order -1 000 000 while user orders go to -1 000 000 000: an
    ENVIRONMENT hook at -5 000 000 saw the old environment, and an ``on_env_change`` hook
    at -2 000 000 ran before there were changes (reported ``skipped``)."""
    from rehydrate._hooks import ORDER_LIMIT

    seen = []
    reg = rehydrate_engine.registry

    @reg.after_restore(phase=Phase.ENVIRONMENT, order=-ORDER_LIMIT, name="lowest")
    def lowest(ctx):
        seen.append(("lowest", os.environ.get("ORDER_CHECK_LOW")))

    @reg.on_env_change("ORDER_CHECK_LOW", order=-2_000_000, name="rotate")
    def rotate(ctx, changes):
        seen.append(("rotate", changes.added))

    report = rehydrate_engine.simulate_restore(env={"ORDER_CHECK_LOW": "new"})
    assert [h.name for h in report.hooks][:3] == ["rehydrate.env", "lowest", "rotate"]
    assert seen == [("lowest", "new"), ("rotate", ("ORDER_CHECK_LOW",))]
    assert report.ok


def test_only_builtins_take_orders_below_the_user_range(rehydrate_engine):
    from rehydrate._hooks import BEFORE_USER_HOOKS, ORDER_LIMIT

    with pytest.raises(ValueError, match="order must be an int from -1000000000"):
        rehydrate_engine.registry.register(lambda: None, order=-ORDER_LIMIT - 1)
    hook = rehydrate_engine.builtins.register(lambda: None, order=BEFORE_USER_HOOKS - 1)
    rehydrate_engine.builtins.unregister(hook)
    with pytest.raises(ValueError, match="order must be an int from -2000000000"):
        rehydrate_engine.builtins.register(lambda: None, order=-2 * ORDER_LIMIT - 1)


def test_module_level_api_delegates_to_the_default_engine(monkeypatch):
    engine = rehydrate.default_engine
    calls = []
    monkeypatch.setattr(engine, "simulate_restore",
                        lambda **kw: calls.append(("restore", kw)) or "R")
    monkeypatch.setattr(engine, "simulate_snapshot",
                        lambda *a: calls.append(("snap", *a)) or "S")
    assert rehydrate.simulate_restore(env={"K": "v"}, reason="t") == "R"
    assert rehydrate.simulate_snapshot() == "S"
    assert rehydrate.simulate_snapshot(reason="docs") == "S"  # as docs/testing.md shows
    assert calls == [("restore", {"env": {"K": "v"}, "reason": "t", "kind": "restore",
                                  "frozen_for": None}),
                     ("snap", "simulated"), ("snap", "docs")]
    assert rehydrate.status().generation == engine.generation
    assert rehydrate.is_ready() == engine.is_ready()
    assert rehydrate.wait_ready(timeout=0) == engine.is_ready()


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"env": {"N": 5}}, TypeError),
    ({"env": {5: "x"}}, TypeError),
    ({"env": ["N=5"]}, TypeError),
    ({"env": {"A=B": "x"}}, ValueError),
    ({"reason": ""}, TypeError),
    ({"reason": None}, TypeError),
    ({"kind": "snapshot"}, ValueError),
    ({"frozen_for": -1}, ValueError),
    ({"frozen_for": "3"}, ValueError),
])
def test_simulate_restore_checks_its_arguments_before_any_hook_runs(rehydrate_engine, kwargs,
                                                                     error):
    ran = []
    rehydrate_engine.registry.after_restore(lambda: ran.append(1), name="user")
    with pytest.raises(error):
        rehydrate_engine.simulate_restore(**kwargs)
    assert ran == []
    assert rehydrate_engine.state == "running"
    assert rehydrate_engine.generation == 0
    assert rehydrate_engine.status().last_report is None


def test_simulate_snapshot_takes_a_reason_at_module_level_too(rehydrate_engine, monkeypatch):
    monkeypatch.setattr(rehydrate.extensions, "_default", rehydrate_engine)
    report = rehydrate.simulate_snapshot(reason="docs-example")
    assert report.reason == "docs-example"
    with pytest.raises(TypeError):
        rehydrate.simulate_snapshot(reason="")


def test_a_restore_is_logged_once_after_readiness_changed(rehydrate_engine, caplog):
    """Nothing is logged at INFO while the hooks run (a log line is I/O, to a pipe that
    may be full, and slow right after a restore); one line after the run says what
    happened — the environment's key names, never its values."""
    caplog.set_level(logging.DEBUG, logger="rehydrate")
    during: list[list[str]] = []
    at_listener: list[list[str]] = []

    def info() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]

    rehydrate_engine.registry.after_restore(lambda: during.append(info()))
    rehydrate_engine.add_listener(lambda report: at_listener.append(info()))
    with restored_environ():
        report = rehydrate_engine.simulate_restore(env={"RHT_LOGGED_TOKEN": "s3cret-value"},
                                                   frozen_for=4.0)
    assert report.ok
    assert during == [[]] and at_listener == [[]]  # the listener (readiness) comes first
    [line] = info()
    assert line.startswith("restore (reason simulated, generation 1, frozen for 4.0s): "
                           "hooks ran in "), line
    assert "ready" in line and "RHT_LOGGED_TOKEN" in line and "s3cret" not in line


def test_a_carry_on_resume_is_logged_as_not_frozen(rehydrate_engine, caplog):
    """A resume that followed no freeze (frozen_for 0.0) was logged "frozen for 0.0s", as
    if the process had been frozen for a moment."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    assert rehydrate_engine.restore_detected("control", kind="resume", anchor=False,
                                             frozen_for=0.0).ok
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert line.startswith("resume (reason control, generation 0, not frozen): "), line


def test_the_report_says_how_long_the_run_waited_after_the_notice(rehydrate_engine):
    """``notice_to_run``: from the detector's notice (``detected_at``) to the run's start —
    the part of resume -> ready that the report's ``duration`` does not cover."""
    noticed = time.monotonic() - 0.25  # the detector saw the restore a while ago
    report = rehydrate_engine.restore_detected("test", detected_at=noticed)
    assert report.notice_to_run is not None and 0.25 <= report.notice_to_run < 5
    assert report.to_dict()["notice_to_run"] == round(report.notice_to_run, 6)
    snap = rehydrate_engine.simulate_snapshot()
    assert snap.notice_to_run is not None and 0 <= snap.notice_to_run < 5


def test_a_confirmation_made_before_the_run_published_its_report_stays_in_status(
        rehydrate_engine, monkeypatch):
    """The run's report was stored for status() only when published, after the run lock:
    a duplicate notice confirmed in between (a clock jump's run, then gVisor's notice)
    found an older last report, and the late publish dropped the confirmation for good."""
    engine = rehydrate_engine
    held, release = threading.Event(), threading.Event()
    real_publish = engine._publish

    def publish_later(report):
        if threading.current_thread().name == "first-notice":
            held.set()
            release.wait(DEADLINE)  # descheduled between the run and its publish
        real_publish(report)

    monkeypatch.setattr(engine, "_publish", publish_later)
    first = threading.Thread(target=engine.restore_detected, args=("clock-jump",),
                             kwargs={"since": time.monotonic() - 2.0}, name="first-notice")
    first.start()
    try:
        assert held.wait(DEADLINE)
        assert engine.wait_ready(0)
        assert engine.status().last_report.reason == "clock-jump"  # with readiness
        later = engine.restore_detected("gvisor", since=time.monotonic() - 2.0)
        assert later.deduplicated and later.confirmed_by == ("gvisor",)
    finally:
        release.set()
        first.join(DEADLINE)
    last = engine.status().last_report
    assert (last.reason, last.confirmed_by) == ("clock-jump", ("gvisor",)), last


def test_a_restore_notice_queued_behind_a_run_keeps_the_process_not_ready(rehydrate_engine):
    """A notice arriving while another run is in progress waited for the run lock while
    that run ended in "ready": wait_ready() returned and requests were served with the
    state of before this restore, whose hooks had not run yet."""
    engine = rehydrate_engine
    gate, entered = threading.Event(), threading.Event()
    runs: list[str] = []

    @engine.registry.after_restore(name="app")
    def app(ctx) -> None:
        runs.append(ctx.reason)
        if ctx.reason == "first":
            entered.set()
            gate.wait(10)

    # The first run's listeners are called after its run lock is free: the second run may
    # be over by then, and ready is right. Ready while the second has not run is the bug.
    seen_at_first_report: list[bool] = []
    engine.add_listener(lambda r: seen_at_first_report.append(
        engine.is_ready() and "second" not in runs)
        if getattr(r, "reason", None) == "first" else None)
    first = threading.Thread(target=engine.restore_detected, args=("first",))
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=engine.restore_detected, args=("second",),
                              kwargs={"since": time.monotonic()})
    second.start()
    ready_when: list[list[str]] = []
    waiter = threading.Thread(target=lambda: (engine.wait_ready(10),
                                              ready_when.append(list(runs))))
    waiter.start()
    deadline = time.monotonic() + 10
    while engine._notices < 2 and time.monotonic() < deadline:  # the second is queued
        threading.Event().wait(0.005)
    assert not engine.is_ready()
    gate.set()
    for t in (first, second, waiter):
        t.join(10)
    assert runs == ["first", "second"]
    assert seen_at_first_report == [False], "ready between the two restores"
    assert ready_when == [["first", "second"]], "wait_ready() returned before the hooks"
    assert engine.is_ready()


def _restoring(engine):  # type: ignore[no-untyped-def]
    """A simulated restore whose hook blocks until the returned gate is set (the engine
    is ``restoring`` meanwhile), and the thread running it."""
    gate, entered = threading.Event(), threading.Event()

    @engine.registry.after_restore(name="slow")
    def slow() -> None:
        entered.set()
        gate.wait(10)

    run = threading.Thread(target=engine.simulate_restore)
    run.start()
    assert entered.wait(10)
    return gate, run


def test_wait_ready_timeouts_of_every_kind(rehydrate_engine):
    """inf or 1e10 raised OverflowError from inside threading, NaN blocked for ever and
    "1" raised a TypeError from inside threading — only when not ready. A year, infinity
    and more (no limit) still wait and return when the hooks ran."""
    engine = rehydrate_engine
    gate, run = _restoring(engine)
    try:
        assert engine.wait_ready(0.01) is False
        assert engine.wait_ready(0) is False
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            engine.wait_ready(float("nan"))
        with pytest.raises(TypeError, match="timeout must be a number of seconds"):
            engine.wait_ready("1")
        np = pytest.importorskip("numpy")
        assert engine.wait_ready(np.int64(0)) is False  # a number: refused as int64 before
        assert engine.wait_ready(np.float32(0.01)) is False
        results: list[bool] = []
        # no limit: None, infinity, more than a year, an int too big for a float (which
        # raised a bare OverflowError from math.isnan)
        waiters = [threading.Thread(target=lambda t=t: results.append(engine.wait_ready(t)))
                   for t in (None, 31_536_000, math.inf, 1e10, 10**5000)]
        for w in waiters:
            w.start()
    finally:
        gate.set()
    run.join(10)
    for w in waiters:
        w.join(10)
    assert results == [True] * 5


@pytest.mark.parametrize("timeout", [-1, -0.5, -math.inf, math.nan, -10**5000, "5", True,
                                     [1]],
                         ids=["-1", "-0.5", "-inf", "nan", "-huge-int", "str", "bool",
                              "list"])
@pytest.mark.parametrize("ready", [True, False], ids=["ready", "restoring"])
def test_wait_ready_refuses_a_bad_timeout_in_one_line(rehydrate_engine, timeout, ready):
    """``wait_ready(-1)`` returned True: every timeout goes through the one seconds rule —
    None, infinity or more than a year no limit, 0 do not wait, a negative, NaN or
    non-number a one-line error naming the argument — for the engine method and
    ``rehydrate.wait_ready`` alike, ready or not."""
    engine = rehydrate_engine
    gate, run = _restoring(engine) if not ready else (threading.Event(), None)
    try:
        assert engine.is_ready() is ready
        for call in (engine.wait_ready, rehydrate.wait_ready):
            if call is rehydrate.wait_ready and not ready:
                continue  # the module function runs the default engine, which is ready
            with pytest.raises((TypeError, ValueError)) as caught:
                call(timeout)
            message = str(caught.value)
            assert type(caught.value) is (TypeError if isinstance(timeout, (str, bool, list))
                                          else ValueError)
            assert "\n" not in message and len(message) < 200, message
            assert message.startswith("wait_ready(): timeout must be a number of seconds"), \
                message
            assert message.endswith("(None, infinity or more than a year: no limit)")
        assert engine.wait_ready(0) is ready
    finally:
        gate.set()
        if run is not None:
            run.join(10)
    assert engine.wait_ready(None) is True


def test_stop_and_close_are_refused_inside_a_hook(rehydrate_engine):
    """close() inside an async hook joined its own loop thread and left the engine unable
    to run any later event; stop() inside a hook run by the clock-jump detector stalled
    the hook 5 s joining the thread that waited for it."""
    engine = rehydrate_engine
    errors: list[str] = []

    @engine.registry.after_restore(name="sync-stop")
    def sync_stop() -> None:
        for call in (engine.stop, engine.close):
            try:
                call()
            except RuntimeError as exc:
                errors.append(str(exc))

    @engine.registry.after_restore(name="async-close")
    async def async_close() -> None:
        try:
            engine.close()
        except RuntimeError as exc:
            errors.append(str(exc))

    assert engine.simulate_restore().ok
    assert [e.split(" cannot")[0] for e in errors] == ["stop()", "close()", "close()"]
    assert engine.simulate_restore().ok and engine.is_ready()  # the engine still works


def test_a_repeated_keyed_notice_is_flagged_as_a_duplicate(rehydrate_engine):
    engine = rehydrate_engine
    first = engine.restore_detected("vmclock", key="vmclock:8")
    again = engine.restore_detected("control", key="vmclock:8")
    assert not first.deduplicated and again.deduplicated
    assert again.generation == first.generation == 1
    assert again.confirmed_by == ("control",)
    assert engine.status().last_report.confirmed_by == ("control",)


def test_close_from_another_thread_lets_a_run_in_progress_finish(rehydrate_engine):
    """Closed under a running event, its remaining hooks failed with "hook runner is
    closed" and the process ended degraded."""
    engine = rehydrate_engine
    gate, entered = threading.Event(), threading.Event()
    ran: list[str] = []

    @engine.registry.after_restore(name="first", phase=Phase.ENTROPY)
    def first() -> None:
        entered.set()
        gate.wait(10)

    @engine.registry.after_restore(name="second", phase=Phase.APPLICATION)
    async def second() -> None:
        ran.append("second")

    reports: list[RestoreReport] = []
    run = threading.Thread(target=lambda: reports.append(engine.simulate_restore()))
    run.start()
    assert entered.wait(10)
    closing = threading.Thread(target=engine.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()  # waiting for the run, not closing under it
    later = threading.Thread(target=lambda: reports.append(engine.simulate_restore()))
    later.start()  # an event arriving while close() runs
    gate.set()
    for t in (run, closing, later):
        t.join(15)
    assert [r.ok for r in reports] == [True, True], [r.table() for r in reports]
    assert ran == ["second", "second"]


def test_a_hook_registered_while_the_run_order_is_merged_runs_from_the_next_event(
        rehydrate_engine, monkeypatch):
    """Before: the engine read the user hooks, then the registry's version for its merge
    cache; a registration in between stored the old list under the new version, and the
    new hook was missing from every later event (until yet another registration)."""
    engine = rehydrate_engine
    ran: list[str] = []
    engine.registry.after_restore(name="early")(lambda: ran.append("early"))
    real = engine.registry.hooks
    calls = 0

    def hooks_then_register(event):
        nonlocal calls
        result = real(event)
        calls += 1
        if calls == 1:  # another thread registers right after this read
            engine.registry.after_restore(name="late")(lambda: ran.append("late"))
        return result

    monkeypatch.setattr(engine.registry, "hooks", hooks_then_register)
    assert [h.name for h in engine.hooks("restore")][-1] == "early"
    assert "late" in [h.name for h in engine.hooks("restore")]
    engine.simulate_restore()
    assert ran == ["early", "late"]


# -- start() called again -----------------------------------------------------------------


class _FailsOnce(Detector):
    """A detector whose first start fails (a squatted socket, later freed)."""

    key = "fails-once"

    def __init__(self) -> None:
        self.starts = 0

    def start(self, engine: object) -> None:
        self.starts += 1
        if self.starts == 1:
            raise OSError("busy")

    def stop(self) -> None:
        pass


def test_a_later_start_starts_the_detectors_it_lists(rehydrate_engine, monkeypatch):
    """A second start() returned the running keys and ignored its list: after the
    README's module-level ``rehydrate.start()``, a server's ``detectors=["signal"]`` (or
    a typo) changed nothing, without a word."""
    monkeypatch.delenv("REHYDRATE_MARKER_FILE", raising=False)
    engine = rehydrate_engine
    fresh = isolated_engine()
    try:
        with pytest.raises(ValueError) as on_first_call:
            fresh.start(["nope-typo"])
    finally:
        fresh.close()
    assert engine.start(["identity"]) == ["identity"]
    assert engine.start() == ["identity"]  # idempotent: "auto" starts nothing more
    assert engine.start("none") == ["identity"]
    with pytest.raises(ValueError) as on_later_call:
        engine.start(["signal", "nope-typo"])
    assert str(on_later_call.value) == str(on_first_call.value)
    assert "unknown detector 'nope-typo'" in str(on_later_call.value)
    with pytest.raises(RuntimeError, match="^detector file is not usable here"):
        engine.start(["signal", "file"])
    assert engine.status().detectors == ("identity",)  # refused before anything started
    assert engine.start(["identity", "signal"]) == ["identity", "signal"]
    running = engine.detector("signal")
    assert engine.start("signal,identity") == ["identity", "signal"]
    assert engine.detector("signal") is running  # left as it was, not started again


def test_a_later_start_retries_a_detector_that_failed_to_start(rehydrate_engine):
    det = _FailsOnce()
    assert rehydrate_engine.start([det]) == []
    assert "fails-once" in rehydrate_engine.status().extra["detector_errors"]
    assert rehydrate_engine.start([det]) == ["fails-once"] and det.starts == 2
    assert "detector_errors" not in rehydrate_engine.status().extra


def test_status_answers_in_and_get_like_a_mapping() -> None:
    """``status()["x"]`` works, so ``"x" in status()`` must too (it fell back to
    ``__getitem__(0)`` and raised ``KeyError: 0``)."""
    from rehydrate import Lifecycle, Registry
    from rehydrate.env import EnvRefresher

    eng = Lifecycle(Registry(), env=EnvRefresher(path=None), builtins=False)
    try:
        eng.add_status("mine", lambda: 1)
        st = eng.status()
        assert "state" in st and "mine" in st and "nothing" not in st
        assert st.get("mine") == 1 and st.get("nothing", "d") == "d"
        assert st.get("state") == st.state
    finally:
        eng.close()


def test_recovered_by_hook_record_forgets_only_that_hook(rehydrate_engine):
    """Two hooks share a name: recovered(record) forgets that very one's failure (what the
    built-in managers pass), never the other's; a name forgets one of them."""
    reg = rehydrate_engine.registry

    def down() -> None:
        raise ConnectionError("down")

    first = reg.register(down, name="cache")
    second = reg.register(down, name="cache")
    other = rehydrate.Registry().register(down, name="cache")  # never ran here
    assert first in reg and other not in reg and down not in reg
    assert not rehydrate_engine.simulate_restore().ok
    assert rehydrate_engine.recovered(other) is False
    assert rehydrate_engine.recovered(first) is False  # "second" is left
    assert rehydrate_engine.recovered(first) is False  # once only
    assert rehydrate_engine.state == "degraded"
    assert rehydrate_engine.recovered(second) is True
    assert rehydrate_engine.state == "ready"

    assert not rehydrate_engine.simulate_restore().ok
    assert rehydrate_engine.recovered("cache") is False
    assert rehydrate_engine.recovered(second) is True  # the name took "first"'s
    with pytest.raises(TypeError, match="Hook record"):
        rehydrate_engine.recovered(42)  # type: ignore[arg-type]


def test_a_builtin_record_takes_over_the_failure_of_an_unregistered_one(rehydrate_engine):
    """A built-in hook failed and was unregistered (its secret or certificate closed);
    one registered under its name since (made again) recovers that failure by its own
    record. Before, no record could ever name the removed one's failure: the process
    stayed degraded until the next restore whatever the new one did."""
    builtins = rehydrate_engine.builtins

    def down() -> None:
        raise ConnectionError("down")

    old = builtins.register(down, name="rehydrate.secret:db")
    assert not rehydrate_engine.simulate_restore().ok
    new = builtins.register(lambda: None, name="rehydrate.secret:db")
    # the failed one is still registered: its own reloads may yet mend it, not another's
    assert rehydrate_engine.recovered(new) is False
    builtins.unregister(old)
    assert rehydrate_engine.state == "degraded"  # unregistering is no recovery
    # only a registered built-in of that very name takes it over
    other = builtins.register(lambda: None, name="rehydrate.secret:cache")
    user = rehydrate_engine.registry.register(lambda: None, name="rehydrate.secret:db")
    closed = rehydrate.Registry().register(lambda: None, name="rehydrate.secret:db")
    for record in (other, user, closed):
        assert rehydrate_engine.recovered(record) is False
    assert rehydrate_engine.state == "degraded"
    assert rehydrate_engine.recovered(new) is True
    assert rehydrate_engine.state == "ready"
    assert rehydrate_engine.recovered(new) is False  # once only

    # while the run is going on: counted once the unregistered hook has failed in it
    builtins.unregister(new)
    first = builtins.register(down, name="rehydrate.tls:web", phase=Phase.SECRETS)
    again: list[rehydrate.Hook] = []

    @rehydrate_engine.registry.after_restore(name="later")
    def later() -> None:
        builtins.unregister(first)
        again.append(builtins.register(lambda: None, name="rehydrate.tls:web"))
        assert rehydrate_engine.recovered(again[0]) is False

    report = rehydrate_engine.simulate_restore()
    assert not report.ok and report.recovered == ("rehydrate.tls:web",)
    assert rehydrate_engine.state == "ready"
