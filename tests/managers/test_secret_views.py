"""Secret views: ``with secret:`` per context, wipes and reloads that wait only for the
views of the buffer they retire, and reads that no reload can serve in time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import pytest

from rehydrate import Phase
from rehydrate.extensions import running_before
from rehydrate.secrets import Secret, SecretUnavailable


def test_with_secret_in_overlapping_asyncio_tasks_closes_each_task_s_own_view(
        rehydrate_engine):
    """The views ``with secret:`` opened were kept per thread: task A leaving its block
    while task B (same thread) was inside its own closed B's view ("operation forbidden
    on released memoryview object")."""
    s = Secret.from_callable(lambda: b"token-value-1234", name="tok",
                             engine=rehydrate_engine)

    async def main() -> bytes:
        a_in, b_in, a_out = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def a() -> None:
            with s:
                a_in.set()
                await b_in.wait()
            a_out.set()

        async def b() -> bytes:
            await a_in.wait()
            with s as view:
                b_in.set()
                await a_out.wait()  # A left its block while B is inside its own
                return bytes(view)

        _, got = await asyncio.gather(a(), b())
        return got

    assert asyncio.run(main()) == b"token-value-1234"
    assert s._readers == 0


def test_with_secret_nests_across_secrets_and_refuses_an_unmatched_exit(rehydrate_engine):
    one = Secret.from_callable(lambda: b"first-value", name="one", engine=rehydrate_engine)
    two = Secret.from_callable(lambda: b"second-value", name="two", engine=rehydrate_engine)
    with one as v1, two as v2:
        assert (bytes(v1), bytes(v2)) == (b"first-value", b"second-value")
    assert one._readers == two._readers == 0
    with pytest.raises(RuntimeError, match="'one': __exit__ without a matching __enter__"):
        one.__exit__(None, None, None)


class _Holder:
    """A thread holding a view of ``secret`` until released."""

    def __init__(self, secret: Secret) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.seen: list[bytes] = []
        self.thread = threading.Thread(target=self._run, args=(secret,), daemon=True)
        self.thread.start()
        assert self.entered.wait(10)

    def _run(self, secret: Secret) -> None:
        with secret.view() as view:
            self.buffer = view.obj
            self.entered.set()
            self.release.wait(30)
            self.seen.append(bytes(view))

    def done(self) -> None:
        self.release.set()
        self.thread.join(10)


def _wait_until(secret: Secret, predicate) -> bool:
    """Wait on the secret's own condition (notified when a wipe or reload takes its
    buffer away): no polling."""
    with secret._cond:
        return secret._cond.wait_for(predicate, 10)


def test_a_reload_waits_only_for_views_of_the_value_it_replaces(rehydrate_engine, caplog):
    """Before: one count of open views for every buffer — a reload waited ``wipe_wait``
    for views of the *new* value too and then warned "reader(s) still hold a view of
    the previous value" (a busy service: every reload took the full ``wipe_wait``)."""
    values = iter([b"first-value", b"second-value"])
    s = Secret.from_callable(lambda: next(values), name="tok", wipe_wait=30,
                             engine=rehydrate_engine)
    old = _Holder(s)
    reloaded: list[bool] = []
    reloading = threading.Thread(target=lambda: reloaded.append(s.reload()), daemon=True)
    reloading.start()
    try:
        # swapped, then waiting for the old value's view
        assert _wait_until(s, lambda: s._buf is not None and s._buf is not old.buffer)
        with s.view() as new:  # a view of the new value, open across the old one's close
            assert bytes(new) == b"second-value"
            old.done()
            reloading.join(10)
            assert not reloading.is_alive() and reloaded == [True]
            assert bytes(new) == b"second-value"
    finally:
        old.done()
        reloading.join(30)
    assert old.seen == [b"first-value"] and not any(old.buffer)
    assert "still hold" not in caplog.text
    assert s._readers == 0 and not s._retiring


def test_a_wipe_takes_the_value_away_before_it_waits_for_open_views(rehydrate_engine,
                                                                    caplog):
    """Before: a wipe waited for every open view with the value still served — new
    views kept opening, so under load it always waited the full ``wipe_wait`` and then
    zeroed the buffer under readers that saw zeros inside their view."""
    s = Secret.from_callable(lambda: b"token-value-0123", name="tok", wipe_wait=30,
                             on_wiped="raise", engine=rehydrate_engine)
    held = _Holder(s)
    wiping = threading.Thread(target=rehydrate_engine.simulate_snapshot, daemon=True)
    wiping.start()
    try:
        assert _wait_until(s, lambda: not s.available)  # taken away while the view is open
        with pytest.raises(SecretUnavailable, match="wiped before a snapshot"):
            s.get()  # no new reader of the value being wiped
        assert any(held.buffer)  # not zeroed under the open view
    finally:
        held.done()
        wiping.join(10)
    assert not wiping.is_alive()
    assert held.seen == [b"token-value-0123"] and not any(held.buffer)
    assert "still hold" not in caplog.text


def test_a_wipe_during_a_reload_returns_only_once_the_replaced_value_is_zeroed(
        rehydrate_engine):
    """A wipe that comes while a reload waits for the views of the value it replaced
    waits for those too: a before-snapshot pass leaves no buffer holding a value."""
    values = iter([b"first-value", b"second-value"])
    s = Secret.from_callable(lambda: next(values), name="tok", wipe_wait=30,
                             engine=rehydrate_engine)
    old = _Holder(s)
    reloading = threading.Thread(target=s.reload, daemon=True)
    reloading.start()
    wiping = None
    try:
        assert _wait_until(s, lambda: s._buf is not None and s._buf is not old.buffer)
        new = s._buf
        wiping = threading.Thread(target=s.wipe, daemon=True)
        wiping.start()
        assert _wait_until(s, lambda: not s.available)
        assert new is not None and not any(new)  # no view of it: zeroed at once
        wiping.join(0.2)
        assert wiping.is_alive()  # still waiting for the old value's view
        assert any(old.buffer)
    finally:
        old.done()
        reloading.join(10)
        if wiping is not None:
            wiping.join(10)
    assert wiping is not None and not wiping.is_alive()
    assert old.seen == [b"first-value"] and not any(old.buffer)


def test_a_view_still_open_at_wipe_wait_is_wiped_under_with_one_warning(rehydrate_engine,
                                                                        caplog):
    s = Secret.from_callable(lambda: b"token-value-0123", name="tok", wipe_wait=0.05,
                             engine=rehydrate_engine)
    held = _Holder(s)
    try:
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            s.wipe()  # the view outlives wipe_wait: zeroed under it
        assert not any(held.buffer)
    finally:
        held.done()
    assert held.seen == [bytes(16)]
    assert [r.getMessage() for r in caplog.records if "still hold" in r.getMessage()] == [
        "secret tok: 1 reader(s) still hold a view; wiping under them"]
    assert s._readers == 0 and not s._retiring


@pytest.mark.parametrize(("phase", "order", "is_async"), [
    (Phase.ENVIRONMENT, 0, False), (Phase.ENTROPY, 0, True), (Phase.SECRETS, -300, False)])
def test_a_restore_hook_that_runs_before_the_secret_s_reload_fails_at_once(
        rehydrate_engine, phase, order, is_async):
    """Before: the read blocked ``timeout`` seconds (10 by default) for a reload that
    this run could start only after the reading hook returned, then failed with
    "wiped before a snapshot; reloaded after restore/resume"."""
    s = Secret.from_callable(lambda: b"token-value-0123", name="tok", timeout=60,
                             engine=rehydrate_engine)
    got: list[bytes] = []

    if is_async:
        async def early() -> None:
            got.append(s.get())
    else:
        def early() -> None:
            got.append(s.get())

    @rehydrate_engine.registry.after_restore(phase=Phase.SECRETS, name="later")
    def later() -> None:  # order 0: after the reload (order -200)
        got.append(s.get())

    rehydrate_engine.registry.after_restore(early, phase=phase, order=order, name="early",
                                            timeout=5)
    assert rehydrate_engine.simulate_snapshot().ok
    report = rehydrate_engine.simulate_restore()
    outcomes = {h.name: h.outcome for h in report.hooks}
    assert outcomes["early"] == "failed" and outcomes["rehydrate.secret:tok"] == "ok"
    [error] = [h.error for h in report.hooks if h.name == "early"]
    assert str(error) == (
        f"secret 'tok' is unavailable to hook 'early' (phase {phase}, order {order}): it "
        "is wiped until its reload 'rehydrate.secret:tok' (phase secrets, order -200), "
        "which this run starts only after that hook returns; read it from a hook of a "
        "later phase, or of phase secrets with a higher order")
    assert got == [b"token-value-0123"]  # the later hook reads the reloaded value


def test_running_before_names_the_running_hook_only_while_its_run_waits_for_it(
        rehydrate_engine):
    """What a hook may wait for from a later hook of its run: that later hook runs only
    once it has returned — unless the run gave up on it at its timeout and went on."""
    registry = rehydrate_engine.registry
    seen: dict[str, object] = {}
    go, noted = threading.Event(), threading.Event()

    def last() -> None:
        seen["last"] = running_before(last_hook)

    def first() -> None:
        seen["first"] = running_before(last_hook)

    def hung() -> None:
        go.wait(30)
        seen["hung"] = running_before(last_hook)
        noted.set()

    first_hook = registry.register(first, phase=Phase.ENVIRONMENT, name="first")
    registry.register(hung, phase=Phase.ENTROPY, name="hung", timeout=0.1)
    last_hook = registry.register(last, phase=Phase.APPLICATION, name="last")
    assert running_before(last_hook) is None  # outside hooks
    outcomes = [h.outcome for h in rehydrate_engine.simulate_restore().hooks
                if h.name in ("first", "hung", "last")]
    assert outcomes == ["ok", "timeout", "ok"]
    go.set()
    assert noted.wait(10)
    assert seen == {"first": first_hook, "hung": None, "last": None}


def test_a_context_a_hook_handed_on_does_not_keep_its_run_alive(rehydrate_engine):
    """A thread or task started with a hook's context keeps that hook's call object;
    once the hook returned it must not keep the run (the event's context with its
    environment values, every result) alive into later snapshot images."""
    import contextvars
    import gc
    import weakref

    registry = rehydrate_engine.registry
    refs: list[weakref.ref[object]] = []
    release = threading.Event()
    kept: list[threading.Thread] = []

    def starts_a_worker(ctx) -> None:
        refs.append(weakref.ref(ctx))
        worker = threading.Thread(target=contextvars.copy_context().run,
                                  args=(release.wait, 30), daemon=True)
        worker.start()
        kept.append(worker)

    registry.register(starts_a_worker, phase=Phase.APPLICATION, name="starts-a-worker")
    try:
        assert rehydrate_engine.simulate_restore(env={"DB_PASSWORD": "x"}).ok
        rehydrate_engine.simulate_snapshot()
        gc.collect()
        assert refs and refs[0]() is None, "the run's context outlived it"
    finally:
        release.set()
        for worker in kept:
            worker.join(10)


def test_an_asyncio_read_during_a_wipe_of_a_view_another_task_holds_fails_at_once(
        rehydrate_engine, caplog):
    """Before: task R's blocking read (during the wipe) stopped the event loop, so task H
    could never close the view the wipe waited for: the wipe waited the full
    ``wipe_wait`` and zeroed the buffer under H, and R failed only at ``timeout``."""
    s = Secret.from_callable(lambda: b"token-value-0123", name="tok", wipe_wait=30,
                             timeout=5, engine=rehydrate_engine)
    wiping = threading.Thread(target=rehydrate_engine.simulate_snapshot, daemon=True)

    async def main() -> tuple[bytes, str]:
        h_in, r_done = asyncio.Event(), asyncio.Event()

        async def h() -> bytes:
            with s as view:  # held across an await, e.g. a request in flight
                h_in.set()
                await r_done.wait()
                return bytes(view)

        async def r() -> str:
            await h_in.wait()
            wiping.start()
            assert await asyncio.to_thread(_wait_until, s, lambda: not s.available)
            try:
                s.get()
            except SecretUnavailable as exc:
                return str(exc)
            finally:
                r_done.set()
            return "read the value"

        return await asyncio.gather(h(), r())

    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        held, error = asyncio.run(main())
        wiping.join(10)
    assert error == (
        "secret 'tok' is unavailable (wiped before a snapshot; reloaded after "
        "restore/resume), and this thread (or another task on its event loop) holds a "
        "view of the value being wiped, which the wipe waits for: a read blocking here "
        "until the reload would keep that view open. Read through the view already open, "
        "or retry after the reload (asyncio code: pass on_wiped='raise')")
    assert held == b"token-value-0123"  # not zeroed under the view
    assert not wiping.is_alive() and "still hold" not in caplog.text
    assert s._readers == 0 and not s._retiring


def test_a_nested_read_in_a_view_during_a_wipe_fails_at_once(rehydrate_engine, caplog):
    """Before: a read inside ``with secret as view:`` while a wipe waited for that very
    view blocked until ``timeout``; the wipe zeroed the buffer under the view meanwhile."""
    s = Secret.from_callable(lambda: b"token-value-0123", name="tok", wipe_wait=30,
                             timeout=5, engine=rehydrate_engine)
    wiping = threading.Thread(target=s.wipe, daemon=True)
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        with s as view:
            wiping.start()
            assert _wait_until(s, lambda: not s.available)
            with pytest.raises(SecretUnavailable, match="holds a view of the value being wiped"):
                s.get()
            with (pytest.raises(SecretUnavailable, match="holds a view of the value being wiped"),
                  s.view()):
                pass
            assert bytes(view) == b"token-value-0123"
        wiping.join(10)
    assert not wiping.is_alive() and "still hold" not in caplog.text
    assert s._readers == 0 and not s._retiring


def test_with_secret_left_in_another_task_names_view_and_view_may_be(rehydrate_engine):
    """``with secret:`` pairs its exit with the entry of the same context; a view opened
    by one task and closed by another (an ExitStack a startup task fills and a shutdown
    task closes) is what ``secret.view()`` is for, and the error says so."""
    s = Secret.from_callable(lambda: b"token-value-0123", name="tok",
                             engine=rehydrate_engine)

    async def main(cm) -> bytes:
        stack = contextlib.ExitStack()
        views: list[memoryview] = []

        async def startup() -> None:
            views.append(stack.enter_context(cm))

        await asyncio.create_task(startup())
        got = bytes(views[0])
        await asyncio.create_task(asyncio.to_thread(stack.close))  # another task, thread
        return got

    with pytest.raises(RuntimeError, match=r"same thread or asyncio task; .* use "
                                           r"secret\.view\(\)"):
        asyncio.run(main(s))
    assert asyncio.run(main(s.view())) == b"token-value-0123"
    assert s._readers == 0


class _ExpiresOnCue(threading.Condition):
    """A secret's condition whose wait in ``thread`` times out when the test says so (and
    not before, nor when notified): no sleeping for a real ``wipe_wait``."""

    def __init__(self) -> None:
        super().__init__()
        self.thread: threading.Thread | None = None
        self.waiting, self.expire = threading.Event(), threading.Event()

    def wait_for(self, predicate, timeout=None):
        if threading.current_thread() is not self.thread:
            return super().wait_for(predicate, timeout)
        self.waiting.set()
        self.release()  # held once, by the reload; waiting, not notified
        try:
            self.expire.wait(30)
        finally:
            self.acquire()
        return predicate()


def test_a_wipe_waiting_alongside_a_reload_returns_once_that_reload_zeroes_at_wipe_wait(
        rehydrate_engine, caplog):
    """Before: a reload whose ``wipe_wait`` ran out zeroed the old value under its view
    without notifying, so a wipe waiting alongside for that same buffer waited its own
    full ``wipe_wait`` although nothing was left to zero."""
    values = iter([b"first-value", b"second-value"])
    s = Secret.from_callable(lambda: next(values), name="tok", wipe_wait=60,
                             engine=rehydrate_engine)
    cond = s._cond = _ExpiresOnCue()
    old = _Holder(s)
    cond.thread = reloading = threading.Thread(target=s.reload, daemon=True)
    wiping = threading.Thread(target=s.wipe, daemon=True)
    try:
        reloading.start()
        assert cond.waiting.wait(10)  # the reload waits for the old value's view
        wiping.start()
        # the wipe took the new value: it waits (the lock released) for the old one's view
        assert _wait_until(s, lambda: not s.available)
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            cond.expire.set()  # the reload's wipe_wait is over; nobody else notifies
        reloading.join(10)
        wiping.join(10)
        assert not wiping.is_alive(), "the wipe waited its own wipe_wait"
        assert not any(old.buffer)
        assert "still hold a view of the previous value" in caplog.text
    finally:
        old.done()
        reloading.join(10)
        wiping.join(70)
    assert s._readers == 0 and not s._retiring


@pytest.mark.parametrize(("on_wiped", "is_async"), [("block", False), ("block", True),
                                                    ("raise", False)])
def test_a_before_snapshot_hook_that_runs_after_the_secret_s_wipe_fails_at_once(
        rehydrate_engine, on_wiped, is_async):
    """Before: a before-snapshot hook of a phase that runs after the wipe (entropy,
    environment: reversed before a snapshot) blocked ``timeout`` for a reload that comes
    only after the restore, then failed with "reloaded after restore/resume"."""
    s = Secret.from_callable(lambda: b"token-value-0123", name="tok", timeout=60,
                             on_wiped=on_wiped, engine=rehydrate_engine)
    got: list[bytes] = []
    registry = rehydrate_engine.registry

    if is_async:
        async def late() -> None:
            got.append(s.get())
    else:
        def late() -> None:
            got.append(s.get())

    @registry.before_snapshot(phase=Phase.SECRETS, order=-100, name="early")
    def early() -> None:  # runs before the wipe (order -200) before a snapshot
        got.append(s.get())

    registry.before_snapshot(late, phase=Phase.ENTROPY, name="late", timeout=5)
    report = rehydrate_engine.simulate_snapshot()
    outcomes = {h.name: h.outcome for h in report.hooks}
    assert outcomes["late"] == "failed" and outcomes["early"] == "ok"
    [error] = [h.error for h in report.hooks if h.name == "late"]
    assert str(error) == (
        "secret 'tok' is unavailable to hook 'late' (phase entropy, order 0): it is wiped "
        "for the snapshot by 'rehydrate.secret:tok' (phase secrets, order -200), which "
        "this before-snapshot run ran earlier; read it from a hook of a later phase, or of "
        "phase secrets with a higher order (before a snapshot they run before the wipe)")
    assert got == [b"token-value-0123"]


def test_a_reload_by_a_thread_holding_a_view_of_the_old_value_does_not_wait_for_it(
        rehydrate_engine, caplog):
    """Before: ``reload()`` inside ``with secret as view:`` (a token refreshed on a 401)
    waited ``wipe_wait`` for that very view, which could not close meanwhile, then
    zeroed the old value under it (in ``asyncio``: the whole loop stalled)."""
    values = iter([b"first-value", b"second-value", b"third-value"])
    s = Secret.from_callable(lambda: next(values), name="tok", wipe_wait=0.5,
                             engine=rehydrate_engine)
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        with s as view:
            old = s._buf
            assert s.reload()
            assert bytes(view) == b"first-value"  # not zeroed under the view
            assert s.get() == b"second-value"
            # retiring: a wipe that came now would wait for it
            assert old is not None and id(old) in s._retiring
        assert old is not None and not any(old)  # the last view zeroed it
        assert not s._retiring and s._readers == 0

        async def main() -> bytes:
            go = asyncio.Event()

            async def h() -> bytes:
                with s as view:  # another task's view, held across an await
                    go.set()
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
                    return bytes(view)

            async def r() -> None:
                await go.wait()
                assert s.reload()

            held, _ = await asyncio.gather(h(), r())
            return held

        assert asyncio.run(main()) == b"second-value"
    assert s.get() == b"third-value"
    assert "still hold" not in caplog.text
    assert not s._retiring and s._readers == 0


class _NotesWaits(threading.Condition):
    """A secret's condition that tells when a read starts blocking on it."""

    def __init__(self, settled: threading.Event) -> None:
        super().__init__()
        self.settled = settled

    def wait(self, timeout=None):
        self.settled.set()
        return super().wait(timeout)


@pytest.mark.parametrize("is_async", [False, True])
def test_a_thread_an_early_restore_hook_starts_and_leaves_blocks_for_the_reload(
        rehydrate_engine, is_async):
    """Before: a thread the hook started with its context (``asyncio.to_thread``, a
    ``copy_context()`` thread) and did not wait for failed at once, "unavailable to hook
    ...", although its blocking read held nothing up: the reload came once the hook
    returned. Only the hook's own thread (an async hook's loop) fails at once."""
    import contextvars

    s = Secret.from_callable(lambda: b"token-value-0123", name="tok", timeout=60,
                             engine=rehydrate_engine)
    settled, done = threading.Event(), threading.Event()
    got: list[object] = []
    kept: list[object] = []

    def connect() -> None:  # a client's blocking setup, in a worker thread
        try:
            got.append(s.get())
        except SecretUnavailable as exc:
            got.append(str(exc))
            settled.set()
        finally:
            done.set()

    if is_async:
        async def restart_pool() -> None:
            kept.append(asyncio.create_task(asyncio.to_thread(connect)))  # not awaited
            assert await asyncio.to_thread(settled.wait, 10)
    else:
        def restart_pool() -> None:
            worker = threading.Thread(target=contextvars.copy_context().run,
                                      args=(connect,), daemon=True)
            worker.start()
            kept.append(worker)
            assert settled.wait(10)

    rehydrate_engine.registry.after_restore(restart_pool, phase=Phase.ENVIRONMENT,
                                            name="restart-pool")
    assert rehydrate_engine.simulate_snapshot().ok
    s._cond = _NotesWaits(settled)  # the worker's read is blocking: the hook returns
    report = rehydrate_engine.simulate_restore()
    assert report.ok, [(h.name, h.outcome, h.error) for h in report.hooks]
    assert done.wait(10)
    assert got == [b"token-value-0123"]


def test_a_read_by_a_view_holder_while_a_failed_restore_load_wipes_names_the_failure(
        rehydrate_engine, caplog):
    """Before: the wipe of a restored clone's value whose source failed showed reads
    "wiped before a snapshot" (the holder: "being wiped for a snapshot"), although no
    snapshot was coming and no reload either; they now fail at once with the source's
    error, as after that wipe."""
    state = {"fail": False}

    def source() -> bytes:
        if state["fail"]:
            raise OSError("vault unreachable")
        return b"token-value-0123"

    s = Secret.from_callable(source, name="tok", wipe_wait=30, timeout=60,
                             engine=rehydrate_engine)
    state["fail"] = True
    restoring = threading.Thread(target=rehydrate_engine.simulate_restore, daemon=True)
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        with s as view:
            restoring.start()
            assert _wait_until(s, lambda: not s.available)  # wiping: it waits for the view
            with pytest.raises(SecretUnavailable) as caught:
                s.get()
            assert bytes(view) == b"token-value-0123"
        restoring.join(10)
    assert not restoring.is_alive()
    assert str(caught.value) == (
        "secret 'tok' is unavailable: source of secret 'tok' failed: OSError")
    assert "still hold" not in caplog.text and not s._retiring


def test_a_plain_hook_returning_a_coroutine_reads_early_and_fails_at_once(rehydrate_engine):
    """A hook registered as a plain function that returns a coroutine (``lambda:
    reconnect()``) is awaited on the hook loop: a read there, before the secret's reload,
    fails at once as in the hook itself instead of blocking the run for ``timeout``."""
    s = Secret.from_callable(lambda: b"token-value-0123", name="tok",
                             engine=rehydrate_engine, timeout=30)
    out: dict[str, BaseException | bytes] = {}

    async def reconnect() -> None:
        try:
            out["read"] = s.get()
        except SecretUnavailable as exc:
            out["read"] = exc

    rehydrate_engine.registry.after_restore(
        phase=Phase.ENVIRONMENT, name="reconnect")(lambda: reconnect())  # noqa: PLW0108 - a plain function returning a coroutine
    rehydrate_engine.simulate_snapshot()
    report = rehydrate_engine.simulate_restore()
    assert {h.name: h.outcome for h in report.hooks}["reconnect"] == "ok"
    assert isinstance(out["read"], SecretUnavailable)
    assert "hook 'reconnect'" in str(out["read"])
