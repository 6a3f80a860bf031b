"""1,000 simulated snapshot/restore cycles leave thread count and open file descriptors
unchanged (after one warm-up cycle), with sync, async and env-change hooks."""

from __future__ import annotations

import asyncio
import gc
import os
import threading

import pytest

from rehydrate import Phase
from rehydrate.testing import isolated_engine

CYCLES = 1000


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def assert_nothing_leaked(threads_before, fds_before):
    """No thread or fd appeared, and neither count grew. (Threads or fds that other
    tests left behind may go away meanwhile; that must not fail this test.)"""
    threads_after, fds_after = threads(), open_fds()
    new_threads = sorted(t.name for t in threads_after - threads_before)
    assert not new_threads, f"threads started and still alive: {new_threads}"
    assert len(threads_after) <= len(threads_before)
    new_fds = {fd: _target(fd) for fd in fds_after - fds_before}
    assert not new_fds, f"file descriptors opened and still open: {new_fds}"
    assert len(fds_after) <= len(fds_before)


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def settle():
    gc.collect()


@pytest.fixture
def app_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="app-loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.mark.parametrize("where", ["engine-loop", "app-loop"])
def test_thousand_cycles_leak_no_threads_or_fds(where, request):
    engine = isolated_engine()
    calls = {"sync": 0, "async": 0, "env": 0, "snap": 0}
    reg = engine.registry

    @reg.after_restore(phase=Phase.ENTROPY)
    def sync_hook(ctx):
        calls["sync"] += 1

    @reg.after_restore(phase=Phase.CONNECTIONS, timeout=5.0)
    async def async_hook(ctx):
        await asyncio.sleep(0)
        calls["async"] += 1

    failed_once = set()

    @reg.after_restore(retries=1)
    async def flaky_async(ctx):  # fails its first attempt every 97th restore: a retry
        if ctx.generation % 97 == 0 and ctx.generation not in failed_once:
            failed_once.add(ctx.generation)
            raise RuntimeError("occasional failure")

    @reg.on_env_change("RHT_LEAK_KEY")
    def env_hook(ctx, changes):
        calls["env"] += 1

    @reg.before_snapshot
    async def snap_async():
        calls["snap"] += 1

    reg.before_snapshot(lambda: None)

    try:
        if where == "app-loop":
            engine.start(detectors="none", loop=request.getfixturevalue("app_loop"))

        def cycle(i):
            engine.simulate_snapshot()
            engine.simulate_restore(env={"RHT_LEAK_KEY": str(i % 2)})

        cycle(0)  # warm-up: starts the worker thread and (maybe) the engine's loop
        settle()
        threads_before, fds_before = threads(), open_fds()
        for i in range(1, CYCLES + 1):
            cycle(i)
        settle()
        assert_nothing_leaked(threads_before, fds_before)
        assert engine.generation == CYCLES + 1
        assert calls["sync"] == calls["async"] == calls["snap"] == CYCLES + 1
        assert calls["env"] == CYCLES + 1  # the value flips every cycle
        assert engine.is_ready()
        assert len(failed_once) == (CYCLES + 1) // 97
    finally:
        engine.stop()
        engine.close()
        os.environ.pop("RHT_LEAK_KEY", None)


def test_engines_created_and_closed_leak_nothing():
    def use_one():
        engine = isolated_engine()

        @engine.registry.after_restore
        async def a():
            pass

        engine.registry.after_restore(lambda: None)
        engine.simulate_restore()
        engine.close()

    use_one()
    settle()
    threads_before, fds_before = threads(), open_fds()
    for _ in range(50):
        use_one()
    settle()
    assert_nothing_leaked(threads_before, fds_before)
