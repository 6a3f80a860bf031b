"""``fork()`` after ``start()`` (issue #13.6): the child gets a clean, stopped engine that
never touches the parent's resources; a child forked while a hook runs is not wedged."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from detect_helpers import in_forked_child

from rehydrate import Lifecycle, Registry
from rehydrate._control_client import request
from rehydrate.detect.control import ControlDetector
from rehydrate.env import EnvRefresher

DEADLINE = 10.0


@pytest.fixture
def engine(rehydrate_engine: Lifecycle) -> Lifecycle:
    return rehydrate_engine


@pytest.fixture
def sock_path() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="rh-fork-")
    yield os.path.join(d, "ctl.sock")
    shutil.rmtree(d, ignore_errors=True)


def test_child_has_a_stopped_engine_and_leaves_the_parents_socket_alone(
        engine: Lifecycle, sock_path: str) -> None:
    calls: list[int] = []
    engine.registry.after_restore(lambda ctx: calls.append(ctx.generation), name="rec")
    assert engine.start([ControlDetector(sock_path)]) == ["control"]

    def child() -> dict:  # type: ignore[type-arg]
        listed = list(engine.status().detectors)
        engine.stop()  # used to unlink the parent's socket
        engine.close()
        report = Lifecycle(Registry(), env=EnvRefresher(path=None)).simulate_restore()
        return {"detectors": listed, "pid": os.getpid(), "ok": report.ok}

    out = in_forked_child(child, DEADLINE)
    assert out["detectors"] == [] and out["ok"]
    assert os.path.exists(sock_path)
    reply = request("status", socket_path=sock_path, timeout=DEADLINE)
    assert reply["ok"] and reply["pid"] == os.getpid()
    assert reply["status"]["detectors"] == ["control"]
    assert engine.simulate_restore().ok and calls == [1]  # the parent carries on


def test_a_child_forked_while_a_hook_runs_is_not_wedged(engine: Lifecycle) -> None:
    entered, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def slow(ctx) -> None:  # type: ignore[no-untyped-def]
        runs.append(os.getpid())
        if not entered.is_set():
            entered.set()
            release.wait(DEADLINE)

    engine.registry.after_restore(slow, name="slow")
    parent_run = threading.Thread(target=engine.simulate_restore, daemon=True)
    parent_run.start()
    assert entered.wait(DEADLINE)
    try:
        def child() -> dict:  # type: ignore[type-arg]
            state = engine.status().state
            report = engine.simulate_restore()  # hung on the parent's locks before
            return {"state_after_fork": state, "ok": report.ok,
                    "ran_here": runs.count(os.getpid()), "ready": engine.is_ready()}

        out = in_forked_child(child, DEADLINE)
    finally:
        release.set()
        parent_run.join(DEADLINE)
    assert out == {"state_after_fork": "degraded", "ok": True, "ran_here": 1,
                   "ready": True}, out
    assert not parent_run.is_alive() and engine.status().state == "ready"


def test_a_child_forked_while_the_default_engine_is_being_created_is_not_wedged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread creating the default engine holds its lock; a child forked meanwhile
    inherited the lock held by a thread it does not have, and its first use of rehydrate
    (``default_engine()``) waited for ever."""
    import rehydrate.extensions as extensions

    monkeypatch.setattr(extensions, "_default", None)  # not created yet in this process
    # what a thread inside default_engine()'s creation holds
    release, creator = _held_by_a_parent_thread(lambda: extensions._lock)
    try:
        def child() -> dict:  # type: ignore[type-arg]
            engine = extensions.default_engine()  # hung on the inherited lock before
            return {"same": extensions.default_engine() is engine}

        out = in_forked_child(child, DEADLINE)
    finally:
        release.set()
        creator.join(DEADLINE)
    assert out == {"same": True}


def test_child_forgets_the_restore_deadlines_of_the_parents_detectors(
        engine: Lifecycle) -> None:
    budgets: list[float | None] = []
    engine.registry.after_restore(lambda ctx: budgets.append(ctx.deadline), name="rec")
    engine.set_restore_deadline("snapstart", 5.0)  # as the parent's SnapStart bridge does

    def child() -> dict:  # type: ignore[type-arg]
        engine.simulate_restore()
        return {"deadline": budgets[-1]}

    assert in_forked_child(child, DEADLINE) == {"deadline": None}
    engine.simulate_restore()
    assert budgets[-1] is not None  # the parent keeps its bridge's bound


def _held_by_a_parent_thread(get_lock) -> tuple[threading.Event, threading.Thread]:  # type: ignore[no-untyped-def]
    """A parent thread inside ``with get_lock():`` (a lock, a secret's view: any context
    manager) until the returned event is set (what a restore run or a renewal is doing at
    the moment of fork())."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with get_lock():
            holding.set()
            release.wait(DEADLINE)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert holding.wait(DEADLINE)
    return release, holder


@contextlib.contextmanager
def _parent_thread_holding(get_lock) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """While inside: a parent thread holds ``get_lock()`` (:func:`_held_by_a_parent_thread`);
    released and joined on the way out."""
    release, holder = _held_by_a_parent_thread(get_lock)
    try:
        yield
    finally:
        release.set()
        holder.join(DEADLINE)


@pytest.mark.parametrize("which", ["registry", "builtins", "entropy-id", "entropy-manager",
                                   "tls-manager", "keys-manager", "secrets-manager",
                                   "files-manager", "fingerprint-manager", "ephemeral-key",
                                   "secret"])
def test_a_child_forked_while_a_parent_thread_holds_a_lock_restores(
        engine: Lifecycle, which: str, tmp_path: Path) -> None:
    """Only the engine's own locks were new in the child: one of these held by a parent
    thread at fork() hung the child's restore (hooks()), its status() (the files
    manager's) or timed a hook out on every snapshot or restore (the entropy, files and
    fingerprint managers', a key's or a secret's condition)."""
    from rehydrate import entropy, files, fingerprint, keys, secrets, tls

    tls.self_signed("web", engine=engine)
    key = keys.ephemeral("session", engine=engine)  # its hook takes the key manager's lock
    secret = secrets.Secret.from_callable(lambda: b"v", name="token", engine=engine)
    files.open(tmp_path / "data", "w", engine=engine)  # its hooks take the files manager's
    fingerprint.configure(engine=engine)  # its before-snapshot hook takes its manager's
    engine.registry.after_restore(lambda: None, name="app")
    lock = {"registry": lambda: engine.registry._lock,
            "builtins": lambda: engine.builtins._lock,
            "entropy-id": lambda: entropy._id_lock,
            "entropy-manager": lambda: entropy.manager(engine)._lock,
            "tls-manager": lambda: tls.manager(engine)._lock,
            "keys-manager": lambda: keys.manager(engine)._lock,
            "secrets-manager": lambda: secrets.manager(engine)._lock,
            "files-manager": lambda: files.manager(engine)._lock,
            "fingerprint-manager": lambda: fingerprint.manager(engine)._lock,
            "ephemeral-key": lambda: key._cond,
            "secret": lambda: secret._cond}[which]
    generation = key.generation
    with _parent_thread_holding(lock):
        def child() -> dict:  # type: ignore[type-arg]
            engine.status()
            reports = [engine.simulate_snapshot(), engine.simulate_restore(),
                       engine.simulate_restore()]
            key.wait(DEADLINE)
            return {"outcomes": sorted({h.outcome for r in reports for h in r.hooks}),
                    "rotations": key.generation - generation, "secret": secret.get_str()}

        out = in_forked_child(child, DEADLINE)
    assert out == {"outcomes": ["ok"], "rotations": 2, "secret": "v"}


@pytest.mark.parametrize("form", ["view", "with"])
def test_a_child_forked_while_a_parent_thread_reads_a_secret_wipes_and_reloads_it(
        engine: Lifecycle, form: str) -> None:
    """A parent thread inside ``with secret.view():`` at fork(): its view stayed counted
    in the child, where nobody could close it, so every wipe and reload there waited
    ``wipe_wait`` for it (the snapshot hook timed out with a long one). (``with secret:``
    keeps its view in a thread-local, which CPython frees in the child: that view closes
    there, and must not count down — see the next test.)"""
    from rehydrate import secrets

    secret = secrets.Secret.from_callable(lambda: b"v", name="token", wipe_wait=60.0,
                                          engine=engine)
    release, reader = _held_by_a_parent_thread(
        lambda: secret.view() if form == "view" else secret)
    try:
        def child() -> dict:  # type: ignore[type-arg]
            reports = [engine.simulate_snapshot(), engine.simulate_restore()]
            reloaded = secret.reload()
            return {"outcomes": sorted({h.outcome for r in reports for h in r.hooks}),
                    "reloaded": reloaded, "value": secret.get_str()}

        out = in_forked_child(child, DEADLINE)
    finally:
        release.set()
        reader.join(DEADLINE)
    assert out == {"outcomes": ["ok"], "reloaded": True, "value": "v"}
    assert secret._readers == 0  # the parent's view was its own, and is closed


@pytest.mark.parametrize("also_held", [False, True])
def test_a_parent_threads_secret_view_closing_in_the_child_is_not_counted_down(
        engine: Lifecycle, also_held: bool) -> None:
    """A parent thread inside ``with secret:`` at fork(): its view's generator kept the
    thread-local dict in a cycle, so it closed only at the child's next garbage
    collection — after the count had been reset — and took the count to -1: every wipe
    then waited ``wipe_wait`` ("-1 reader(s)"), and a view the child opened itself was
    wiped under it. Closed in the fork itself (no cycle), it must not take the lock
    either, which another parent thread may hold (``also_held``)."""
    import gc

    from rehydrate import secrets

    secret = secrets.Secret.from_callable(lambda: b"v", name="token", wipe_wait=60.0,
                                          engine=engine)
    reading, release = threading.Event(), threading.Event()

    def read() -> None:
        with secret:
            reading.set()
            release.wait(DEADLINE)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert reading.wait(DEADLINE)
    if also_held:
        release2, holder = _held_by_a_parent_thread(lambda: secret._cond)
    try:
        def child() -> dict:  # type: ignore[type-arg]
            gc.collect()
            after_gc = secret._readers
            with secret:
                inside = secret._readers
            secret.wipe()  # waited wipe_wait (past the deadline) with a count of -1
            return {"after_gc": after_gc, "inside": inside, "after": secret._readers,
                    "reloaded": secret.reload()}

        out = in_forked_child(child, DEADLINE)
    finally:
        release.set()
        reader.join(DEADLINE)
        if also_held:
            release2.set()
            holder.join(DEADLINE)
    assert out == {"after_gc": 0, "inside": 1, "after": 0, "reloaded": True}, out
    assert secret._readers == 0


def test_a_secret_view_of_the_forking_thread_stays_counted_in_the_child(
        engine: Lifecycle) -> None:
    """The forking thread's own open view is the child's too: a wipe there waits for it,
    and closing it (the child unwinding its ``with``) leaves no count behind."""
    from rehydrate import secrets

    secret = secrets.Secret.from_callable(lambda: b"v", name="token", wipe_wait=60.0,
                                          engine=engine)
    with secret:
        def child() -> dict:  # type: ignore[type-arg]
            readers = secret._readers
            secret.__exit__(None, None, None)  # what leaving the `with` does in the child
            return {"readers": readers, "after": secret._readers,
                    "ok": engine.simulate_snapshot().ok}

        out = in_forked_child(child, DEADLINE)
    assert out == {"readers": 1, "after": 0, "ok": True}


def test_a_child_forked_while_a_parent_thread_retires_a_secret_value_zeroes_it(
        engine: Lifecycle) -> None:
    """A reload waiting for a parent thread's view of the value it replaced at fork():
    neither thread is in the child, so nothing there would zero that buffer, and the
    child's wipe would wait ``wipe_wait`` for it. It is zeroed in the fork."""
    from rehydrate import secrets

    values = iter([b"first-value", b"second-value", b"third-value"])
    secret = secrets.Secret.from_callable(lambda: next(values), name="token",
                                          wipe_wait=60.0, engine=engine)
    old = secret._buf
    assert old is not None
    release, reader = _held_by_a_parent_thread(secret.view)
    reloading = threading.Thread(target=secret.reload, daemon=True)
    reloading.start()
    try:
        with secret._cond:  # swapped, then waiting for the parent thread's view
            assert secret._cond.wait_for(lambda: secret._buf is not old, DEADLINE)

        def child() -> dict:  # type: ignore[type-arg]
            zeroed = not any(old)
            secret.wipe()
            return {"zeroed": zeroed, "ok": engine.simulate_snapshot().ok}

        out = in_forked_child(child, DEADLINE)
    finally:
        release.set()
        reader.join(DEADLINE)
        reloading.join(DEADLINE)
    assert out == {"zeroed": True, "ok": True}
    assert not any(old)  # in the parent, once the view closed


def test_a_child_forked_by_a_secret_view_holder_during_a_wipe_reads_as_wiped(
        engine: Lifecycle) -> None:
    """The wipe waiting for the forking thread's view stayed in the parent: in the child
    nothing waits for that view, so a read there is an ordinary read of a wiped secret
    (it said the wipe waited for the view, "read through the view already open")."""
    from rehydrate import secrets

    secret = secrets.Secret.from_callable(lambda: b"v", name="token", wipe_wait=60.0,
                                          timeout=0, engine=engine)
    wiping = threading.Thread(target=secret.wipe, daemon=True)
    with secret:
        wiping.start()
        with secret._cond:  # taken away, the wipe waits for this view
            assert secret._cond.wait_for(lambda: not secret.available, DEADLINE)

        def child() -> str:
            try:
                secret.get()
            except secrets.SecretUnavailable as exc:
                return str(exc)
            return "read the value"

        out = in_forked_child(child, DEADLINE)
    wiping.join(DEADLINE)
    assert not wiping.is_alive()
    assert out == ("secret 'token' is unavailable: wiped before a snapshot; reloaded "
                   "after restore/resume")


@pytest.mark.parametrize("which", ["instruments", "exporter"])
def test_a_child_forked_while_a_parent_thread_holds_a_telemetry_lock_records_its_events(
        engine: Lifecycle, which: str) -> None:
    """The telemetry observer's instruments lock (held around the meter provider's calls)
    held by a parent thread at fork() hung the child's every event; a restorable
    exporter's lock timed out the child's identity hook, so its exporters were never
    rebuilt."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rehydrate import telemetry

    exporter = telemetry.restorable_span_exporter(InMemorySpanExporter)
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    mp = MeterProvider(metric_readers=[InMemoryMetricReader()])
    tel = telemetry.instrument(engine, tracer_provider=tp, meter_provider=mp)
    telemetry.refresh_on_restore(tp, mp, exporters=[exporter], engine=engine,
                                 flush_timeout=1.0)
    lock = {"instruments": lambda: tel._gen_lock, "exporter": lambda: exporter._lock}[which]
    release, holder = _held_by_a_parent_thread(lock)
    try:
        def child() -> dict:  # type: ignore[type-arg]
            reports = [engine.simulate_snapshot(), engine.simulate_restore()]
            return {"outcomes": sorted({h.outcome for r in reports for h in r.hooks}),
                    "rebuilds": exporter.rebuilds,
                    "spans": [s.name for s in exporter.inner.get_finished_spans()]}

        out = in_forked_child(child, DEADLINE)
    finally:
        release.set()
        holder.join(DEADLINE)
        tp.shutdown()
        mp.shutdown()
    assert out["outcomes"] == ["ok"] and out["rebuilds"] == 1, out
    assert out["spans"][-1] == "rehydrate.restore", out  # the rebuilt exporter got it


@pytest.mark.parametrize("which", ["runner", "snapstart", "adapters"])
def test_a_child_forked_while_a_parent_thread_holds_a_module_lock_is_not_wedged(
        engine: Lifecycle, which: str) -> None:
    """Module-level locks held by a parent thread at fork() were held for ever in the
    child: an event started from an event loop's thread (the runner's blocked-loops
    lock), ``start(["snapstart"])`` (the bridge's) or an inference adapter's
    ``install()`` (its installed-hooks lock) hung there."""
    import asyncio

    import rehydrate._loop_roles as loop_roles
    import rehydrate.adapters._server as server
    import rehydrate.detect.snapstart as snapstart
    from rehydrate.adapters import vllm

    def use() -> Any:
        if which == "runner":
            async def from_the_loop() -> bool:
                engine.start([], loop=asyncio.get_running_loop())  # the application's
                return engine.simulate_restore().ok  # blocks that loop's thread

            return asyncio.run(from_the_loop())
        if which == "snapstart":
            return engine.start(["snapstart"])
        adapter = vllm.install("http://127.0.0.1:9", engine=engine)
        return [h.name for h in engine.builtins.hooks("restore")
                if h.fn == adapter.after_restore]

    lock = {"runner": lambda: loop_roles._blocked_lock, "snapstart": lambda: snapstart._lock,
            "adapters": lambda: server._installed_lock}[which]
    with _parent_thread_holding(lock):
        out = in_forked_child(lambda: {"used": use()}, DEADLINE)
    assert out == {"used": {"runner": True, "snapstart": ["snapstart"],
                            "adapters": ["rehydrate.vllm.wake"]}[which]}


def _managed_handle(kind: str, engine: Lifecycle, tmp_path: Path) -> Any:
    from rehydrate import files

    path = tmp_path / f"data.{kind}"
    if kind == "sqlite":
        return files.sqlite(path, engine=engine)
    path.write_bytes(b"0123456789")
    if kind == "mmap":
        return files.mmap(path, engine=engine)
    handle = files.open(path, "rb", engine=engine)
    handle.read(4)
    return handle


@pytest.mark.parametrize("kind", ["file", "sqlite", "mmap"])
def test_a_child_forked_while_a_parent_thread_holds_a_managed_handle_uses_it(
        engine: Lifecycle, kind: str, tmp_path: Path) -> None:
    """A parent thread inside a handle's critical section at fork() (the reopen hook
    waiting on a slow volume, a close() checkpointing SQLite): the child's snapshot pass
    timed out closing that handle, its restores never reopened it, and its close() of
    the handle it inherited waited for ever."""
    handle = _managed_handle(kind, engine, tmp_path)
    with _parent_thread_holding(lambda: handle._lock):
        def child() -> dict:  # type: ignore[type-arg]
            reports = [engine.simulate_snapshot(), engine.simulate_restore()]
            suspended = handle.suspended
            handle.close()
            return {"outcomes": sorted({h.outcome for r in reports for h in r.hooks}),
                    "suspended": suspended}

        out = in_forked_child(child, DEADLINE)
    assert out == {"outcomes": ["ok"], "suspended": False}
    assert engine.simulate_snapshot().ok and handle.suspended  # the parent's is its own
    assert engine.simulate_restore().ok and not handle.suspended


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_a_child_forked_by_the_thread_holding_a_handle_lock_can_release_it(
        engine: Lifecycle, kind: str, tmp_path: Path) -> None:
    """The forking thread's own hold (an ``on_connect`` that forks, under the reopen) is
    not another thread's: the handle keeps its lock, so the child's unwinding releases
    it — a new lock there made that release raise."""
    handle = _managed_handle(kind, engine, tmp_path)
    before = handle._lock
    with handle._lock:
        def child() -> dict:  # type: ignore[type-arg]
            same = handle._lock is before
            handle._lock.release()  # what leaving the `with` does in the child
            return {"same_lock": same, "ok": engine.simulate_snapshot().ok}

        out = in_forked_child(child, DEADLINE)
    assert out == {"same_lock": True, "ok": True}


def test_a_child_forked_by_the_thread_holding_a_key_condition_can_release_it(
        engine: Lifecycle) -> None:
    """A condition gets a new one in the child (the parent's waiters are not there), but
    over the same reentrant lock when the forking thread holds it (a rotation listener
    that forks): the child can notify under that hold and its unwinding releases it."""
    from rehydrate import keys

    key = keys.ephemeral("session", engine=engine)
    generation = key.generation
    with key._cond:
        before = key._cond

        def child() -> dict:  # type: ignore[type-arg]
            key._cond.notify_all()  # needs the lock: refused unless the hold is kept
            before.__exit__(None, None, None)  # what leaving the `with` does in the child
            key.rotate()
            return {"new": key._cond is not before, "rotations": key.generation - generation}

        out = in_forked_child(child, DEADLINE)
    assert out == {"new": True, "rotations": 1}


def test_a_child_forked_while_a_parent_thread_creates_a_key_makes_its_own(
        engine: Lifecycle, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new key's first pair is made under the key manager's lock, the handle registered
    only with it: the child, whose creating thread is gone, gets a fresh lock, does not
    see that key and makes its own."""
    from rehydrate import keys

    real = keys.generate_private_key
    entered, release = threading.Event(), threading.Event()

    def slow(algorithm: str) -> Any:
        if threading.current_thread().name == "creator":
            entered.set()
            assert release.wait(30)
        return real(algorithm)

    monkeypatch.setattr(keys, "generate_private_key", slow)
    made: list[keys.EphemeralKey] = []
    creator = threading.Thread(target=lambda: made.append(keys.ephemeral(
        "session", engine=engine)), name="creator", daemon=True)
    creator.start()
    try:
        assert entered.wait(DEADLINE)

        def child() -> dict:  # type: ignore[type-arg]
            gone = keys.get("session", engine=engine) is None
            key = keys.ephemeral("session", engine=engine)
            return {"gone": gone, "generation": key.generation}

        out = in_forked_child(child, DEADLINE)
    finally:
        release.set()
        creator.join(DEADLINE)
    assert out == {"gone": True, "generation": 1}
    assert made[0].generation == 1 and keys.get("session", engine=engine) is made[0]


def test_a_child_forked_from_a_handler_interrupting_a_key_s_creation_makes_its_own(
        engine: Lifecycle, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler that forks (and does its work in the child) may interrupt the
    forking thread's own ``ephemeral()``. Before: that key was registered as being created
    by this very thread, which the child never returns to: ``get()`` of its name waited
    for ever."""
    from rehydrate import keys

    real = keys.generate_private_key
    out: list[dict] = []  # type: ignore[type-arg]
    parent = os.getpid()

    def handler_forks(algorithm: str) -> Any:
        if not out and os.getpid() == parent:  # once; the child makes its own key too
            def child() -> dict:  # type: ignore[type-arg]
                gone = keys.get("session", engine=engine) is None
                key = keys.ephemeral("session", engine=engine)
                return {"gone": gone, "generation": key.generation, "dropped": key.dropped}

            out.append(in_forked_child(child, DEADLINE))
        return real(algorithm)

    monkeypatch.setattr(keys, "generate_private_key", handler_forks)
    made = keys.ephemeral("session", engine=engine)
    assert out == [{"gone": True, "generation": 1, "dropped": False}]
    assert made.generation == 1 and keys.get("session", engine=engine) is made


def test_fresh_lock_after_fork_covers_module_locks_and_resets_state() -> None:
    """The one mechanism for extensions: named locks of any owner (a module here), and a
    hook for state that counts the parent's threads."""
    import types

    from rehydrate.extensions import fresh_lock_after_fork

    module = types.ModuleType("an_extension")
    module._lock = threading.Lock()  # type: ignore[attr-defined]
    module._cond = threading.Condition(threading.Lock())  # type: ignore[attr-defined]
    module.busy = 3  # type: ignore[attr-defined]

    def forget(owner: Any) -> None:
        owner.busy = 0

    fresh_lock_after_fork(module, "_lock", "_cond", after=forget)
    release, holder = _held_by_a_parent_thread(lambda: module._lock)
    release2, holder2 = _held_by_a_parent_thread(lambda: module._cond)
    try:
        def child() -> dict:  # type: ignore[type-arg]
            with module._lock, module._cond:
                return {"busy": module.busy}

        out = in_forked_child(child, DEADLINE)
    finally:
        release.set()
        release2.set()
        holder.join(DEADLINE)
        holder2.join(DEADLINE)
    assert out == {"busy": 0} and module.busy == 3


def test_a_renewal_running_at_fork_is_abandoned_in_the_child(engine: Lifecycle) -> None:
    """A parent thread renewing (an issuer's round trip, under the renew lock) at fork():
    the child's certificate hook timed out and renew() blocked for ever."""
    from rehydrate import tls

    cert = tls.self_signed("web", engine=engine)
    serial = cert.serial
    with _parent_thread_holding(lambda: cert._renew_lock):
        def child() -> dict:  # type: ignore[type-arg]
            error = cert.last_error
            renewed = cert.renew().serial
            report = engine.simulate_restore()
            return {"error": error, "renewed": renewed != serial, "ok": report.ok,
                    "restored": cert.serial not in (serial, renewed)}

        out = in_forked_child(child, DEADLINE)
    assert out == {"error": "a renewal running at fork() was abandoned in this process",
                   "renewed": True, "ok": True, "restored": True}
    assert cert.last_error is None and cert.serial == serial  # the parent's is its own


def test_a_child_forked_while_a_parent_thread_builds_a_server_context_can_renew(
        engine: Lifecycle) -> None:
    """A parent thread building an attached context's fresh context at fork() (under
    the lock shared by every attached context): the child's renewals waited for ever."""
    import ssl

    from rehydrate import tls

    cert = tls.self_signed("web", engine=engine)
    cert.server_context()
    serial = cert.serial
    with _parent_thread_holding(lambda: tls._SWAP_LOCK):
        def child() -> dict:  # type: ignore[type-arg]
            renewed = cert.renew().serial
            ctx = cert.attach(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
            return {"renewed": renewed != serial,
                    "current": cert.current_server_context(ctx) is not ctx}

        out = in_forked_child(child, DEADLINE)
    assert out == {"renewed": True, "current": True}


def test_a_child_forked_by_the_thread_holding_a_certificate_lock_can_release_it(
        engine: Lifecycle) -> None:
    """The forking thread's own hold (a renewal listener that forks) is not another
    thread's: the lock is kept, so the child's unwinding releases it."""
    from rehydrate import tls

    cert = tls.self_signed("web", engine=engine)
    with cert._renew_lock:
        before = cert._renew_lock

        def child() -> dict:  # type: ignore[type-arg]
            return {"same_lock": cert._renew_lock is before, "error": cert.last_error}

        out = in_forked_child(child, DEADLINE)
    assert out == {"same_lock": True, "error": None}


def test_a_child_forked_while_a_parent_thread_adds_a_certificate_can_add_it(
        engine: Lifecycle, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name a parent thread was adding at fork() stayed busy in the child, where nobody
    finishes that add: an add of the name there waited for ever."""
    from rehydrate import tls

    entered, release = threading.Event(), threading.Event()
    produce = tls.SelfSignedCertificate.produce

    def blocked(self: tls.SelfSignedCertificate) -> tls.Material:
        if not entered.is_set():
            entered.set()
            assert release.wait(DEADLINE)
        return produce(self)

    monkeypatch.setattr(tls.SelfSignedCertificate, "produce", blocked)
    adder = threading.Thread(target=tls.self_signed, args=("web",),
                             kwargs={"engine": engine}, daemon=True)
    adder.start()
    try:
        assert entered.wait(DEADLINE)

        def child() -> dict:  # type: ignore[type-arg]
            cert = tls.self_signed("web", engine=engine)
            return {"managed": tls.manager(engine).get("web") is cert,
                    "restored": engine.simulate_restore().ok}

        out = in_forked_child(child, DEADLINE)
    finally:
        release.set()
        adder.join(DEADLINE)
    assert out == {"managed": True, "restored": True}
    assert tls.manager(engine).get("web") is not None  # the parent's add went on


def test_a_forked_child_gets_its_own_instance_id() -> None:
    """A forked worker is another process: it kept the parent's instance_id(), which
    telemetry reports as service.instance.id."""
    from rehydrate import entropy

    seen: list[str] = []
    listener = entropy.on_instance_id_change(seen.append)
    try:
        parent_id = entropy.instance_id()

        def child() -> dict:  # type: ignore[type-arg]
            return {"id": entropy.instance_id(), "told": seen}

        out = in_forked_child(child, DEADLINE)
    finally:
        entropy._id_listeners.remove(listener)
    assert out["id"] != parent_id and out["told"] == [out["id"]], out
    assert entropy.instance_id() == parent_id and seen == []


def test_with_entropy_disabled_a_forked_child_keeps_the_instance_id(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``REHYDRATE_DISABLE=entropy`` keeps instance_id() on restore (a control run): a
    fork renewed it all the same, and telemetry reported the new one."""
    from rehydrate import entropy

    monkeypatch.setenv("REHYDRATE_DISABLE", "entropy")
    parent_id = entropy.instance_id()
    out = in_forked_child(lambda: {"id": entropy.instance_id()}, DEADLINE)
    assert out == {"id": parent_id}


def test_fresh_lock_after_fork_tells_owners_apart_by_identity() -> None:
    """Owners were keys of a WeakKeyDictionary: of two equal owners (two connections to
    one URL) only the first kept its registration, a dataclass was refused as
    unhashable, and a class with ``__slots__`` got a bare "cannot create weak
    reference"."""
    import dataclasses

    from rehydrate.extensions import fresh_lock_after_fork

    class Conn:
        def __init__(self, url: str) -> None:
            self.url = url
            self._lock = threading.Lock()
            fresh_lock_after_fork(self)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Conn) and other.url == self.url

        def __hash__(self) -> int:
            return hash(self.url)

    @dataclasses.dataclass
    class Pool:
        name: str

        def __post_init__(self) -> None:
            self._lock = threading.Lock()
            fresh_lock_after_fork(self)

    class Slotted:
        __slots__ = ("_lock",)

    with pytest.raises(TypeError, match="Slotted object cannot be held weakly"):
        fresh_lock_after_fork(Slotted())
    owners: list[Any] = [Conn("db"), Conn("db"), Pool("p")]
    assert owners[0] == owners[1]
    releases = [_held_by_a_parent_thread(lambda o=o: o._lock) for o in owners[1:]]
    try:
        out = in_forked_child(lambda: {"free": [o._lock.acquire(timeout=DEADLINE / 4)
                                                for o in owners[1:]]}, DEADLINE)
    finally:
        for release, holder in releases:
            release.set()
            holder.join(DEADLINE)
    assert out == {"free": [True, True]}
    assert owners[0]._lock is not owners[1]._lock
    from rehydrate import _threads

    registered = len(_threads._LOCK_OWNERS)
    owners.clear()
    assert len(_threads._LOCK_OWNERS) == registered - 3  # held weakly, forgotten when freed


def test_fresh_lock_after_fork_merges_registrations_and_keeps_shared_locks_shared() -> None:
    """Registering an owner again (a subclass after its base) replaced the base's names
    and hook; a condition over the owner's ``_lock`` got a lock of its own in the child,
    no longer excluding the ``_lock`` holders."""
    from rehydrate.extensions import fresh_lock_after_fork

    class Base:
        def __init__(self) -> None:
            self._lock = threading.RLock()
            self.base_busy = 1
            fresh_lock_after_fork(self, after=Base.reset)

        def reset(self) -> None:
            self.base_busy = 0

    class Sub(Base):
        def __init__(self) -> None:
            super().__init__()
            self._cond = threading.Condition(self._lock)
            self.sub_busy = 1
            fresh_lock_after_fork(self, "_cond", after=Sub.reset_sub)

        def reset_sub(self) -> None:
            self.sub_busy = 0

    owner = Sub()
    with _parent_thread_holding(lambda: owner._lock):
        def child() -> dict:  # type: ignore[type-arg]
            free = owner._lock.acquire(timeout=DEADLINE / 4)
            return {"free": free, "shared": owner._cond._lock is owner._lock,
                    "busy": [owner.base_busy, owner.sub_busy]}

        out = in_forked_child(child, DEADLINE)
    assert out == {"free": True, "shared": True, "busy": [0, 0]}, out


def _lock_owner(kind: str, engine: Lifecycle) -> tuple[Any, str]:
    """One more kind of object a forked child may use, and its lock's attribute."""
    if kind in ("routes-manager", "routes-encoder"):
        from rehydrate import routes

        manager = routes.manager(engine)
        return (manager, "_lock") if kind == "routes-manager" else (manager._encoder, "_lock")
    if kind in ("httpx", "httpx-async"):
        from rehydrate._httpx import AsyncReconnectingTransport, ReconnectingTransport

        return (ReconnectingTransport if kind == "httpx" else AsyncReconnectingTransport)(), "_lock"
    if kind == "grpc":
        from rehydrate._grpc import ManagedChannel

        return ManagedChannel(object), "_lock"
    if kind == "gameloop":
        from rehydrate.adapters.gameloop import TickClock

        return TickClock(60.0), "_lock"
    if kind == "agones":
        from rehydrate.adapters.agones import AgonesAdapter

        return AgonesAdapter(9, engine=engine), "_lock"
    from rehydrate.adapters.asgi import ReadinessGate

    gate = ReadinessGate(lambda *a: None, engine=engine)  # type: ignore[arg-type]
    return (gate, "_lifespans_lock") if kind == "asgi-gate" else (gate._detection, "lock")


@pytest.mark.parametrize("kind", ["routes-manager", "routes-encoder", "httpx", "httpx-async",
                                  "grpc", "gameloop", "agones", "asgi-gate",
                                  "asgi-detection"])
def test_a_child_forked_while_a_parent_thread_holds_a_connection_or_adapter_lock_gets_it(
        engine: Lifecycle, kind: str) -> None:
    """The routes manager's (and its netlink encoder's), the reconnecting httpx
    transports', a managed gRPC channel's and the game-loop, Agones and ASGI adapters'
    locks were not renewed: held by a parent thread at fork(), they were held for ever
    in the child (its route hooks, requests, channel calls, ticks and lifespans hung)."""
    owner, name = _lock_owner(kind, engine)
    with _parent_thread_holding(lambda: getattr(owner, name)):
        def child() -> dict:  # type: ignore[type-arg]
            return {"free": getattr(owner, name).acquire(timeout=DEADLINE / 4)}

        out = in_forked_child(child, DEADLINE)
    assert out == {"free": True}


def test_a_childs_start_starts_the_installed_detectors_again(engine: Lifecycle) -> None:
    """Before: the child forgot its installed detectors but kept their keys in
    ``installed``: ``start()`` left them out, ``start(extensions=[det])`` did nothing, a
    new instance was "installed already" and ``start(["tick"])`` an "unknown detector"."""
    from rehydrate.detect import Detector

    class Tick(Detector):
        """Tick: records its starts."""

        key = "tick"

        def __init__(self) -> None:
            self.starts: list[int] = []

        def start(self, engine: object) -> None:
            self.starts.append(os.getpid())

        def stop(self) -> None:
            pass

    tick = Tick()
    assert engine.start("none", extensions=[tick]) == ["tick"]

    def child() -> dict:  # type: ignore[type-arg]
        before = list(engine.status().detectors)
        running = engine.start("none")
        again = engine.start(["tick"])
        return {"before": before, "running": running, "again": again,
                "in_child": tick.starts[-1] == os.getpid(), "starts": len(tick.starts)}

    out = in_forked_child(child, DEADLINE)
    assert out == {"before": [], "running": ["tick"], "again": ["tick"], "in_child": True,
                   "starts": 2}
    assert engine.status().detectors == ("tick",) and len(tick.starts) == 1


def test_an_installed_marker_file_detector_watches_again_in_the_child(
        engine: Lifecycle, tmp_path: Path) -> None:
    """An installed built-in instance is started again in the child too: the marker-file
    detector took its parent's worker for its own and was listed as running, deaf."""
    from detect_helpers import Recorder

    from rehydrate.detect.file import FileDetector

    marker = tmp_path / "restored"
    det = FileDetector(marker, interval=0.02, window=0)
    assert engine.start("none", extensions=[det]) == ["file"]

    def child() -> dict:  # type: ignore[type-arg]
        rec = Recorder(engine)
        running = engine.start("none")
        tmp = tmp_path / "restored.tmp"
        tmp.write_text("restore 1\n")
        os.link(tmp, marker)  # it appears with its content in one step
        calls = rec.wait(1)
        return {"running": running, "reason": calls[0]["reason"],
                "threads": sorted(t.name for t in threading.enumerate()
                                  if t.name == "rehydrate-marker-file")}

    out = in_forked_child(child, DEADLINE)
    assert out == {"running": ["file"], "reason": "file",
                   "threads": ["rehydrate-marker-file"]}
    assert engine.detector("file") is det


def _open_fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, gone
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


@pytest.mark.parametrize("how", ["engine", "direct"])
@pytest.mark.parametrize("kind", ["file", "vmclock", "gvisor", "control"])
def test_a_child_closes_its_copies_of_the_parents_detector_descriptors(
        engine: Lifecycle, tmp_path: Path, sock_path: str, kind: str, how: str) -> None:
    """The child forgets the parent's detectors without stopping them, and nothing closed
    its copies of their descriptors: every forked worker kept an inotify instance, the
    vmclock device, stop pipes and the control socket open for its whole life. Started
    directly (not through an engine), the file and vmclock detectors started again in
    the child replaced the parent's without closing those copies."""
    from rehydrate.detect import Detector

    det: Detector
    if kind == "file":
        from rehydrate.detect.file import FileDetector

        det = FileDetector(tmp_path / "restored", polling=False)
    elif kind == "vmclock":
        from detect.test_vmclock import FakeVmClock

        from rehydrate.detect.vmclock import VmClockDetector

        FakeVmClock(tmp_path / "vmclock")
        det = VmClockDetector(str(tmp_path / "vmclock"), interval=0.02)
    elif kind == "gvisor":
        from rehydrate.detect.gvisor import GVisorDetector

        os.mkfifo(tmp_path / "checkpoint")  # the stand-in for /proc/gvisor/checkpoint
        det = GVisorDetector(str(tmp_path))
    else:
        det = ControlDetector(sock_path)
    before = _open_fds()
    if how == "engine":
        assert engine.start([det]) == [kind]
    else:
        det.start(engine)
    theirs = {fd: target for fd, target in _open_fds().items() if before.get(fd) != target}
    assert theirs  # what the detector holds open

    def child() -> dict:  # type: ignore[type-arg]
        if how == "direct":
            if kind in ("file", "vmclock"):  # the others refuse: they serve the parent
                det.start(engine)
            det.stop()
        now = _open_fds()
        return {"kept": sorted(target for fd, target in theirs.items()
                               if now.get(fd) == target)}

    try:
        assert in_forked_child(child, DEADLINE) == {"kept": []}
        assert det.failure() is None  # the parent's goes on
        if kind == "control":
            assert request("status", socket_path=sock_path, timeout=DEADLINE)["ok"]
    finally:
        if how == "direct":
            det.stop()


def test_an_installed_control_detector_says_in_the_child_that_it_serves_the_parent(
        engine: Lifecycle, sock_path: str) -> None:
    """Started again in the child, an installed control detector refuses loudly and says
    why (it said only "already running"); the parent's socket is left alone."""
    assert engine.start("none", extensions=[ControlDetector(sock_path)]) == ["control"]

    def child() -> dict:  # type: ignore[type-arg]
        running = engine.start("none")
        return {"running": running,
                "error": engine.status().to_dict()["detector_errors"]["control"]}

    out = in_forked_child(child, DEADLINE)
    assert out["running"] == []
    assert out["error"] == (f"this control detector serves the parent process "
                            f"({os.getpid()}) at {sock_path}; a child of fork() needs a "
                            "ControlDetector of another path")
    reply = request("status", socket_path=sock_path, timeout=DEADLINE)
    assert reply["ok"] and reply["pid"] == os.getpid()


def test_an_installed_gvisor_waiter_says_in_the_child_that_it_serves_the_parent(
        engine: Lifecycle, tmp_path: Path) -> None:
    """Started again in the child, an installed gVisor waiter said "this gVisor waiter is
    already running": the child had no waiter and was told it had one."""
    from rehydrate.detect.gvisor import GVisorDetector

    os.mkfifo(tmp_path / "checkpoint")  # the stand-in for /proc/gvisor/checkpoint
    waiter = GVisorDetector(str(tmp_path))
    assert engine.start("none", extensions=[waiter]) == ["gvisor"]

    def child() -> dict:  # type: ignore[type-arg]
        running = engine.start("none")
        return {"running": running,
                "error": engine.status().to_dict()["detector_errors"]["gvisor"]}

    out = in_forked_child(child, DEADLINE)
    assert out == {"running": [], "error": (
        f"this gVisor waiter serves the parent process ({os.getpid()}); a child of fork() "
        "needs a GVisorDetector of its own (engine.install(GVisorDetector()))")}
    assert engine.detector("gvisor") is waiter and waiter.running


def _lock_user(kind: str, engine: Lifecycle, tmp_path: Path) -> tuple[Any, Any, Any]:
    """A lock a parent thread may hold at fork() (its getter), what a forked child does
    that takes it, and what the parent does afterwards to clean up."""
    from rehydrate import connections

    def nothing() -> None:
        pass

    if kind == "unregistered-connection":
        # a parent thread inside unregister() (retiring it, out of the manager already)
        # while the forking thread runs its open: the open asks whether its run is live
        conn = connections.register("db", open=lambda: None, engine=engine)
        run = conn._epoch
        connections.unregister("db", engine=engine)
        return lambda: conn._lock, lambda: conn._live(run), nothing
    if kind == "connection-manager":
        connections.register("db", open=lambda: None, engine=engine)
        return (lambda: connections.manager(engine)._lock,
                lambda: connections.unregister("db", engine=engine), nothing)
    if kind == "managed-socket":
        sock = connections.ManagedSocket(("127.0.0.1", 9))
        return lambda: sock._lock, sock.close, nothing
    if kind == "opener":
        from rehydrate.connections import _Opener

        opener = _Opener()
        return lambda: opener._lock, opener.stop, nothing
    if kind == "deferring-detector":
        from rehydrate.detect._util import DeferringDetector

        class Idle(DeferringDetector):
            """Idle: a generic detector that watches nothing."""

            key = "idle-test"
            grace = 0.0

            def _loop(self, stop: threading.Event) -> None:
                stop.wait()

        idle = Idle()

        def start_and_stop() -> bool:
            idle.start(engine)
            alive = idle._thread is not None and idle._thread.alive
            idle.stop()
            return alive

        return lambda: idle._lock, start_and_stop, nothing
    if kind == "signal-detector":
        from rehydrate.detect.signal import SignalDetector

        sig = SignalDetector("SIGUSR2")  # not running: its fork handler never saw it

        def start_and_stop_signal() -> int:
            sig.start(engine)
            sig.stop()
            return sig.received

        return lambda: sig._lock, start_and_stop_signal, nothing
    if kind == "vmclock-detector":
        from rehydrate.detect.vmclock import VmClockDetector

        vmclock = VmClockDetector(str(tmp_path / "vmclock"))
        return lambda: vmclock._lock, vmclock.stop, nothing
    if kind == "control-server":
        import socket

        from rehydrate.detect.control import ControlServer

        # a server with a socket, but none bound and no thread: its stop() in the child
        # leaves the parent alone (a started one's stop pokes the parent's)
        server = ControlServer(engine, str(tmp_path / "ctl.sock"))
        server._sock = socket.socket(socket.AF_UNIX)
        return lambda: server._lock, server.stop, server._sock.close
    if kind in ("trigger-deadline-watch", "gvisor-waiter"):
        import dataclasses

        from rehydrate._trigger import DEADLINE_REASON, _DeadlineWatch
        from rehydrate.detect.gvisor import GVisorDetector

        waiter = GVisorDetector(str(tmp_path)) if kind == "gvisor-waiter" else None
        snap = engine.simulate_snapshot()
        # a trigger waiting for gVisor's answer (with a running waiter, or reading it)
        watch = _DeadlineWatch(engine, snap, waiter)
        late = dataclasses.replace(snap, kind="restore", reason=DEADLINE_REASON)

        def hear_the_deadline_run() -> bool:
            watch._heard(late)  # what the child's snapshot deadline run tells it
            return watch.gave_up("") is not None

        held = (lambda: watch._lock) if waiter is None else (lambda: waiter._cond)
        return held, hear_the_deadline_run, watch.close
    if kind == "environment":
        from rehydrate import env
        from rehydrate.env import EnvRefresher

        refresher = EnvRefresher(path=None)  # not an engine's: no engine renewed it
        # every refresher's refresh takes the process-wide one (compare, apply, record)
        return (lambda: env._EVENT.applying,
                lambda: refresher.refresh(overlay={"REHYDRATE_FORK_TEST": "1"}).added,
                nothing)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["unregistered-connection", "connection-manager",
                                  "managed-socket", "opener", "deferring-detector",
                                  "signal-detector", "vmclock-detector", "control-server",
                                  "trigger-deadline-watch", "gvisor-waiter",
                                  "environment"])
def test_a_child_forked_while_a_parent_thread_holds_a_detector_or_connection_lock_uses_it(
        engine: Lifecycle, kind: str, tmp_path: Path) -> None:
    """Renewed in the child only when a fork handler knew of them (a manager's registered
    connections, a running signal detector): a connection out of its manager, a managed
    socket, an open_now opener, the detectors' start()/stop() locks, the control server's,
    a gVisor trigger's deadline watch and the waiter it notifies, and a standalone
    environment refresher held by a parent thread at fork() were held for ever in the
    child."""
    lock, use, cleanup = _lock_user(kind, engine, tmp_path)
    release, holder = _held_by_a_parent_thread(lock)
    try:
        out = in_forked_child(lambda: {"used": use()}, DEADLINE)
    finally:
        release.set()
        holder.join(DEADLINE)
        cleanup()
    assert out == {"used": {"unregistered-connection": False, "connection-manager": True,
                            "managed-socket": None, "opener": None,
                            "deferring-detector": True, "signal-detector": 0,
                            "vmclock-detector": None, "control-server": None,
                            "trigger-deadline-watch": True, "gvisor-waiter": True,
                            "environment": ["REHYDRATE_FORK_TEST"]}[kind]}, out


@pytest.mark.parametrize("which", ["state", "start", "extensions", "install", "claims",
                                   "certificate"])
def test_a_child_forked_while_a_parent_thread_holds_an_engine_lock_uses_it(
        engine: Lifecycle, which: str) -> None:
    """The engine's other locks, the detector claims' and a certificate handle's, held by a
    parent thread at fork() (a start() or install() in progress, a state change, a
    certificate's context being built): the child's state, start(), extension(),
    install() and server_context() must not wait for them."""
    from rehydrate import _lifecycle as lifecycle
    from rehydrate import tls
    from rehydrate.detect import Detector

    class Tick(Detector):
        """Tick: watches nothing."""

        key = "tick"

        def start(self, engine: object) -> None:
            pass

        def stop(self) -> None:
            pass

    cert = tls.self_signed("web", engine=engine)
    lock = {"state": lambda: engine._cond, "start": lambda: engine._start_lock,
            "extensions": lambda: engine._ext_lock, "install": lambda: engine._install_lock,
            "claims": lambda: lifecycle._RUNNING_ON_LOCK,
            "certificate": lambda: cert._lock}[which]

    def use() -> Any:
        if which == "state":
            return engine.simulate_restore().ok and engine.is_ready()
        if which == "start":
            return engine.start("none")
        if which == "extensions":
            return engine.extension("fork-test", lambda e: "made")
        if which == "install":
            return engine.install(Tick())
        if which == "claims":
            return engine.start("none", extensions=[Tick()])
        return cert.server_context() is not None

    with _parent_thread_holding(lock):
        out = in_forked_child(lambda: {"used": use()}, DEADLINE)
    assert out == {"used": {"state": True, "start": [], "extensions": "made",
                            "install": ["tick"], "claims": ["tick"],
                            "certificate": True}[which]}, out


def test_a_child_forked_while_a_parent_thread_registers_a_hook_rebuilds_the_hook_list() -> None:
    """A parent thread stopped by the fork between adding a hook and bumping the
    registry's version (under its lock): the child's lock is new, and its cached hook
    list, which that version still matched, is dropped rather than served without the
    hook."""
    registry = Registry()
    registry.after_restore(lambda: None, name="first")
    assert [h.name for h in registry.hooks("restore")] == ["first"]  # cached
    registry.after_restore(lambda: None, name="second")
    registry._version -= 1  # what the stopped thread had not done yet
    with _parent_thread_holding(lambda: registry._lock):
        out = in_forked_child(
            lambda: {"hooks": [h.name for h in registry.hooks("restore")]}, DEADLINE)
    assert out == {"hooks": ["first", "second"]}
