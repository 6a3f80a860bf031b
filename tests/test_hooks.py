"""The hook registry: decorators, options, ordering, isolation, thread safety."""

from __future__ import annotations

import functools
import math
import threading
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rehydrate
from rehydrate import Phase, Registry, RestoreContext
from rehydrate._hooks import DEFAULT_TIMEOUT
from rehydrate.testing import isolated_engine


def names(report):
    return [h.name for h in report.hooks if not h.name.startswith("rehydrate.")]


# -- registration --------------------------------------------------------------------


def test_bare_decorator_with_arguments_and_plain_registration():
    reg = Registry()

    @reg.after_restore
    def bare():
        pass

    @reg.after_restore(phase=Phase.CONNECTIONS, order=10, timeout=5.0, required=False,
                       name="db", retries=2)
    async def configured(ctx):
        pass

    def plain():
        pass

    record = reg.register(plain, event="snapshot", phase=Phase.NETWORK)

    assert callable(bare) and bare.__name__ == "bare"  # decorators return the function
    restore = {h.name: h for h in reg.hooks("restore")}
    assert set(restore) == {f"{__name__}.{bare.__qualname__}", "db"}
    db = restore["db"]
    assert (db.phase, db.order, db.timeout, db.required, db.retries, db.is_async) == (
        Phase.CONNECTIONS, 10, 5.0, False, 2, True)
    assert reg.hooks("snapshot") == (record,)
    assert record.phase is Phase.NETWORK and record.event == "snapshot"


def test_defaults():
    reg = Registry()

    @reg.after_restore
    def hook():
        pass

    (h,) = reg.hooks("restore")
    assert h.phase is Phase.APPLICATION
    assert h.order == 0
    assert h.timeout == DEFAULT_TIMEOUT == 30.0
    assert h.required is True
    assert h.retries == 0
    assert h.name == f"{__name__}.test_defaults.<locals>.hook"
    assert h.is_async is False and h.arity == 0


def test_before_snapshot_decorator_bare_and_with_arguments():
    reg = Registry()

    @reg.before_snapshot
    def a():
        pass

    @reg.before_snapshot(phase=Phase.CONNECTIONS, name="close-db")
    def b(ctx):
        pass

    assert [h.name for h in reg.hooks("snapshot")] == [
        f"{__name__}.{a.__qualname__}", "close-db"]  # APPLICATION before CONNECTIONS
    assert reg.hooks("restore") == ()


def test_module_level_decorators_use_the_default_registry():
    before = len(rehydrate.default_registry)

    @rehydrate.after_restore(name="test-module-level")
    def hook():
        pass

    @rehydrate.before_snapshot
    def snap():
        pass

    @rehydrate.on_env_change("SOME_KEY")
    def env_hook(ctx, changes):
        pass

    try:
        assert len(rehydrate.default_registry) == before + 3
        assert rehydrate.default_engine.registry is rehydrate.default_registry
        assert "test-module-level" in [h.name for h in rehydrate.default_registry.hooks("restore")]
    finally:
        assert rehydrate.unregister("test-module-level") == 1
        assert rehydrate.unregister(snap) == 1
        assert rehydrate.unregister(env_hook) == 1
    assert len(rehydrate.default_registry) == before


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"timeout": 0}, ValueError),
        ({"timeout": -1.0}, ValueError),
        ({"timeout": float("nan")}, ValueError),
        ({"timeout": float("-inf")}, ValueError),
        ({"retries": -1}, ValueError),
        ({"retries": 1.5}, TypeError),
        ({"retries": True}, TypeError),
        ({"retries": "2"}, TypeError),
        ({"order": 0.5}, TypeError),
        ({"order": False}, TypeError),
        ({"order": "1"}, TypeError),
        ({"order": None}, TypeError),
        ({"event": "boot"}, ValueError),
        ({"timeout": True}, TypeError),
        ({"timeout": "5"}, TypeError),
        ({"required": "no"}, TypeError),
        ({"required": 0}, TypeError),
        ({"name": 5}, TypeError),  # report.table() would fail on it later
        ({"name": ["x"]}, TypeError),
        ({"name": ""}, TypeError),
        ({"name": "a\nb"}, TypeError),  # one report row, one log line
    ],
)
def test_invalid_options_are_refused(kwargs, exc):
    reg = Registry()
    with pytest.raises(exc):
        reg.register(lambda: None, **kwargs)
    assert len(reg) == 0


@pytest.mark.parametrize("decorator", ["after_restore", "before_snapshot", "on_env_change"])
def test_decorators_refuse_bad_options_with_a_clear_message(decorator):
    reg = Registry()
    deco = getattr(reg, decorator)
    keys = ("K",) if decorator == "on_env_change" else ()
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds > 0 .*nan"):
        deco(*keys, timeout=float("nan"))(lambda: None)
    with pytest.raises(TypeError, match="order must be an int, not bool"):
        deco(*keys, order=True)(lambda: None)
    with pytest.raises(TypeError, match="retries must be an int, not float"):
        deco(*keys, retries=2.0)(lambda: None)
    assert len(reg) == 0


@pytest.mark.parametrize(("option", "value", "shown"), [
    ("order", 10**5000, "1e+5000"),  # was accepted; repr(hook) then raised "Exceeds the limit"
    ("order", -(10**9) - 1, "-1000000001"),
    ("order", 10**9 + 1, "1000000001"),
    ("retries", 10**5000, "1e+5000"),  # was accepted: retried until the run's deadline
    ("retries", 1001, "1001"),
    ("retries", -1, "-1"),
], ids=lambda v: v if isinstance(v, str) else "")  # no str() of a 5000-digit int
def test_order_and_retries_out_of_range_are_refused_in_one_line(option, value, shown):
    reg = Registry()
    kept = reg.register(lambda: None, name="kept")
    for register in (lambda: reg.register(lambda: None, **{option: value}),
                     lambda: reg.after_restore(**{option: value})(lambda: None),
                     lambda: reg.on_env_change("K", **{option: value})(lambda: None)):
        with pytest.raises(ValueError) as info:
            register()
        message = str(info.value)
        low, high = ("-1000000000", "1000000000") if option == "order" else ("0", "1000")
        assert message == f"{option} must be an int from {low} to {high}, not {shown}"
        assert "\n" not in message and len(message) < 120
    assert reg.hooks("restore") == (kept,)  # the previous state kept


def test_order_and_retries_at_their_limits_are_accepted():
    reg = Registry()
    low = reg.register(lambda: None, name="low", order=-(10**9), retries=0)
    high = reg.register(lambda: None, name="high", order=10**9, retries=1000)
    assert (low.order, high.order, high.retries) == (-(10**9), 10**9, 1000)
    assert "order=1000000000" in repr(high)


def test_a_finite_timeout_beyond_a_year_is_refused_and_infinity_means_no_limit():
    """Before: ``timeout=1e10`` was accepted, and every restore run then ended in the
    runner's ``OverflowError`` (a thread wait that long overflows) with the engine
    degraded. ``None`` and ``math.inf`` still mean no limit."""
    reg = Registry()
    with pytest.raises(ValueError, match=r"at most 31536000 \(a year\), not 10000000000.0 "
                                         r"\(None or math.inf: no limit\)"):
        reg.after_restore(timeout=1e10)(lambda: None)
    with pytest.raises(TypeError, match="timeout must be a number of seconds > 0"):
        reg.after_restore(timeout="5")(lambda: None)
    assert len(reg) == 0
    reg.after_restore(timeout=None, name="none")(lambda: None)
    reg.after_restore(timeout=math.inf, name="inf")(lambda: None)
    reg.after_restore(timeout=31_536_000, name="year")(lambda: None)
    assert sorted(h.timeout for h in reg.hooks("restore")) == [31_536_000.0, math.inf, math.inf]


def test_nan_timeout_no_longer_means_no_limit():
    """Before: ``nan <= 0`` is False, so NaN was accepted and the hook never timed out."""
    engine = isolated_engine()
    try:
        with pytest.raises(ValueError):
            engine.registry.after_restore(timeout=float("nan"), name="nan")(lambda: None)
        assert [h.name for h in engine.registry.hooks("restore")] == []
    finally:
        engine.close()


def test_non_callable_and_too_many_arguments_are_refused():
    reg = Registry()
    with pytest.raises(TypeError, match="callable"):
        reg.register("not a function")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="at most 1"):
        reg.after_restore(lambda a, b: None)
    with pytest.raises(TypeError, match="at most 2"):
        reg.on_env_change("K")(lambda a, b, c: None)
    with pytest.raises(TypeError):
        reg.on_env_change("")
    assert len(reg) == 0


def test_timeout_none_means_no_limit():
    reg = Registry()
    reg.register(lambda: None, timeout=None)
    (h,) = reg.hooks("restore")
    assert h.timeout == float("inf")


# -- arity and async detection ---------------------------------------------------------


def test_hook_arity_zero_one_and_env_change_two(rehydrate_engine):
    reg = rehydrate_engine.registry
    seen = {}

    @reg.after_restore
    def zero():
        seen["zero"] = ()

    @reg.after_restore
    def one(ctx):
        seen["one"] = ctx

    @reg.after_restore
    async def one_async(ctx: RestoreContext):
        seen["one_async"] = ctx

    @reg.after_restore
    def defaulted(ctx, extra=None):  # a defaulted parameter is not filled
        seen["defaulted"] = (ctx, extra)

    @reg.on_env_change("WATCHED_A")
    def two(ctx, changes):
        seen["two"] = (ctx, changes)

    @reg.on_env_change("WATCHED_A")
    def env_one(ctx):
        seen["env_one"] = ctx

    report = rehydrate_engine.simulate_restore(env={"WATCHED_A": "1", "OTHER_B": "2"})
    assert report.ok, report.table()
    ctx = seen["one"]
    assert isinstance(ctx, RestoreContext)
    assert seen["zero"] == ()
    assert seen["one_async"] is ctx  # one context per event, shared by its hooks
    assert seen["defaulted"] == (ctx, None)
    assert seen["env_one"] is ctx
    two_ctx, changes = seen["two"]
    assert two_ctx is ctx
    assert changes.added == ("WATCHED_A",)  # only the watched keys
    assert "OTHER_B" in ctx.env_changes.added


def test_var_positional_and_mocks_get_every_argument(rehydrate_engine):
    reg = rehydrate_engine.registry
    restore_mock = mock.Mock()
    env_mock = mock.Mock()
    got = []
    reg.register(restore_mock)
    reg.on_env_change(env_mock)
    reg.after_restore(lambda *args: got.append(args))
    report = rehydrate_engine.simulate_restore(env={"VARPOS_KEY": "x"})
    assert report.ok, report.table()
    (ctx,) = restore_mock.call_args.args
    assert isinstance(ctx, RestoreContext)
    assert env_mock.call_args.args == (ctx, ctx.env_changes)
    assert got == [(ctx,)]


def test_async_detection_for_callables_and_partials():
    reg = Registry()

    class AsyncCallable:
        async def __call__(self, ctx):
            pass

    async def coro_fn(ctx, tag):
        pass

    a = reg.register(AsyncCallable())
    b = reg.register(functools.partial(coro_fn, tag="x"))
    c = reg.register(lambda: None)
    assert a.is_async and a.arity == 1
    assert b.is_async and b.arity == 1
    assert not c.is_async


# -- unregister -------------------------------------------------------------------------


def test_unregister_by_record_function_and_name(rehydrate_engine):
    reg = rehydrate_engine.registry
    calls = []

    def f():
        calls.append("f")

    rec_f = reg.register(f)
    reg.register(f, name="f-again")
    rec_g = reg.register(lambda: calls.append("g"), name="g")
    reg.register(lambda: calls.append("h"), name="h")

    assert reg.unregister(rec_g) == 1
    assert reg.unregister(rec_g) == 0  # already gone
    assert reg.unregister("h") == 1
    assert reg.unregister("nope") == 0
    rehydrate_engine.simulate_restore()
    assert sorted(calls) == ["f", "f"]
    assert reg.unregister(f) == 2  # by function: every registration of it
    assert reg.unregister(rec_f) == 0
    calls.clear()
    rehydrate_engine.simulate_restore()
    assert calls == []
    assert len(reg) == 0


def test_clear_and_version():
    reg = Registry()
    v0 = reg.version
    reg.register(lambda: None)
    assert reg.version != v0
    v1 = reg.version
    reg.clear()
    assert reg.version != v1 and len(reg) == 0 and reg.hooks("restore") == ()


# -- isolation ------------------------------------------------------------------------


def test_registries_are_isolated():
    r1, r2 = Registry(), Registry()
    e1, e2 = isolated_engine(), isolated_engine()
    e1.registry, e2.registry = r1, r2
    calls = []
    try:
        r1.after_restore(lambda: calls.append("r1"))
        r2.after_restore(lambda: calls.append("r2"))
        r2.before_snapshot(lambda: calls.append("r2-snap"))
        assert len(r1) == 1 and len(r2) == 2
        assert r1.hooks("snapshot") == ()
        e1.simulate_restore()
        assert calls == ["r1"]
        e2.simulate_restore()
        e2.simulate_snapshot()
        assert calls == ["r1", "r2", "r2-snap"]
        assert e1.generation == 1 and e2.generation == 1
        before = len(rehydrate.default_registry)
        r1.clear()
        assert len(r2) == 2 and len(rehydrate.default_registry) == before
    finally:
        e1.close()
        e2.close()


def test_fixture_engine_does_not_share_the_default_registry(rehydrate_engine):
    assert rehydrate_engine.registry is not rehydrate.default_registry
    assert rehydrate_engine is not rehydrate.default_engine
    assert len(rehydrate_engine.registry) == 0


# -- thread safety ----------------------------------------------------------------------


def test_concurrent_registration_is_thread_safe():
    reg = Registry()
    threads_n, per_thread = 8, 150
    barrier = threading.Barrier(threads_n)

    def work(t):
        barrier.wait()
        for i in range(per_thread):
            reg.register(lambda: None, name=f"t{t}-{i}", order=i % 3)
            if i % 10 == 0:
                reg.hooks("restore")  # readers interleaved with writers

    threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hooks = reg.hooks("restore")
    assert len(reg) == len(hooks) == threads_n * per_thread
    assert len({h.seq for h in hooks}) == len(hooks)
    assert [h.sort_key() for h in hooks] == sorted(h.sort_key() for h in hooks)
    # each thread's registrations keep their relative order within one `order` value
    for t in range(threads_n):
        for o in range(3):
            mine = [int(h.name.split("-")[1]) for h in hooks
                    if h.name.startswith(f"t{t}-") and h.order == o]
            assert mine == sorted(mine)


# -- ordering (property-based) ---------------------------------------------------------

hook_specs = st.lists(
    st.tuples(st.sampled_from(list(Phase)), st.integers(-3, 3), st.booleans()),
    min_size=0,
    max_size=25,
)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=hook_specs, builtin_specs=hook_specs)
def test_ordering_rules_in_both_directions(specs, builtin_specs):
    """Restore: phases forward, ``order`` ascending, ties in registration order.
    Before a snapshot: the exact reverse. Built-in hooks merge into the same order
    (a built-in runs before a user hook with the same phase and order on restore)."""
    engine = isolated_engine()
    engine.builtins.clear()  # the environment step is irrelevant here
    calls: list[str] = []

    def make(label, is_async):
        if is_async:
            async def hook():
                calls.append(label)
            return hook
        return lambda: calls.append(label)

    expected_restore = []
    try:
        for i, (phase, order, is_async) in enumerate(builtin_specs):
            label = f"b{i}"
            for event in ("restore", "snapshot"):
                engine.builtins.register(make(label, is_async), event=event, phase=phase,
                                         order=order, name=label)
            expected_restore.append(((int(phase), order, 0, i), label))
        for i, (phase, order, is_async) in enumerate(specs):
            label = f"u{i}"
            engine.registry.after_restore(phase=phase, order=order, name=label)(
                make(label, is_async))
            engine.registry.before_snapshot(phase=phase, order=order, name=label)(
                make(label, is_async))
            expected_restore.append(((int(phase), order, 1, i), label))
        expected = [label for _, label in sorted(expected_restore)]

        report = engine.simulate_restore()
        assert calls == expected
        assert [h.name for h in report.hooks] == expected
        calls.clear()
        snap = engine.simulate_snapshot()
        assert calls == expected[::-1]
        assert [h.name for h in snap.hooks] == expected[::-1]
        # the registry alone orders the same way
        user = [label for label in expected if label.startswith("u")]
        assert [h.name for h in engine.registry.hooks("restore")] == user
        assert [h.name for h in engine.registry.hooks("snapshot")] == user[::-1]
    finally:
        engine.close()


def test_ordering_example_from_the_design():
    reg = Registry()
    reg.register(lambda: None, name="app-1")
    reg.register(lambda: None, name="conn-10", phase=Phase.CONNECTIONS, order=10)
    reg.register(lambda: None, name="conn-0", phase=Phase.CONNECTIONS)
    reg.register(lambda: None, name="app-2")
    reg.register(lambda: None, name="env", phase=Phase.ENVIRONMENT)
    reg.register(lambda: None, name="entropy-neg", phase=Phase.ENTROPY, order=-5)
    reg.register(lambda: None, name="secrets", phase=Phase.SECRETS)
    reg.register(lambda: None, name="net", phase=Phase.NETWORK)
    for h in reg.hooks("restore"):
        reg.register(h.fn, event="snapshot", phase=h.phase, order=h.order, name=h.name)
    restore = [h.name for h in reg.hooks("restore")]
    assert restore == ["env", "entropy-neg", "secrets", "net", "conn-0", "conn-10",
                       "app-1", "app-2"]
    assert [h.name for h in reg.hooks("snapshot")] == restore[::-1]
    assert [p.name for p in Phase] == ["ENVIRONMENT", "ENTROPY", "SECRETS", "NETWORK",
                                       "CONNECTIONS", "APPLICATION"]


# -- on_env_change ----------------------------------------------------------------------


def test_on_env_change_forms():
    reg = Registry()

    @reg.on_env_change
    def any_key(ctx, changes):
        pass

    @reg.on_env_change()
    def any_key_too():
        pass

    @reg.on_env_change("A", "B", phase=Phase.APPLICATION, name="ab")
    def ab(ctx, changes):
        pass

    hooks = {h.name: h for h in reg.hooks("restore")}
    assert hooks[f"{__name__}.{any_key.__qualname__}"].env_keys == ()
    assert hooks[f"{__name__}.{any_key_too.__qualname__}"].env_keys == ()
    assert hooks["ab"].env_keys == ("A", "B")
    assert hooks["ab"].phase is Phase.APPLICATION
    assert hooks[f"{__name__}.{any_key.__qualname__}"].phase is Phase.ENVIRONMENT
    assert hooks[f"{__name__}.{any_key.__qualname__}"].arity == 2


def test_swapping_the_engine_registry_takes_effect(rehydrate_engine):
    """The merged built-in + user order is not cached across registries."""
    calls = []
    first, second = Registry(), Registry()
    first.register(lambda: calls.append("first"))
    second.register(lambda: calls.append("second"))  # same version as `first`
    assert first.version == second.version
    rehydrate_engine.registry = first
    rehydrate_engine.simulate_restore()
    rehydrate_engine.registry = second
    rehydrate_engine.simulate_restore()
    assert calls == ["first", "second"]


def test_generator_functions_are_refused_their_body_would_never_run():
    def gen():
        yield

    async def agen():
        yield

    reg = Registry()
    for fn in (gen, agen):
        with pytest.raises(TypeError, match="is a generator function"):
            reg.register(fn)
    assert len(reg) == 0


def test_unregister_by_record_removes_only_that_record():
    """Before: a record matched by its seq number alone, and seq numbers restart in every
    registry: unregistering another registry's record removed an unrelated hook."""
    mine, other = Registry(), Registry()
    kept = mine.register(lambda: None, name="kept")
    foreign = other.register(lambda: None, name="foreign")
    assert kept.seq == foreign.seq
    assert mine.unregister(foreign) == 0
    assert [h.name for h in mine.hooks("restore")] == ["kept"]
    assert mine.unregister(kept) == 1 and len(mine) == 0


def test_unregister_by_bound_method_removes_its_registrations():
    """Before: ``unregister(obj.method)`` compared with ``is`` and every attribute access
    makes a new bound-method object, so nothing was removed."""
    class Pool:
        def reconnect(self) -> None: ...

    a, b = Pool(), Pool()
    reg = Registry()
    reg.after_restore(a.reconnect)
    reg.after_restore(b.reconnect)
    assert reg.unregister(a.reconnect) == 1
    assert [h.fn for h in reg.hooks("restore")] == [b.reconnect]


def test_a_partial_is_named_after_the_function_it_wraps():
    def reconnect(pool: str) -> None: ...

    reg = Registry()
    hook = reg.register(functools.partial(functools.partial(reconnect), "db"))
    assert hook.name.endswith("test_a_partial_is_named_after_the_function_it_wraps."
                              "<locals>.reconnect"), hook.name


class _GeneratorCall:
    def __call__(self):
        yield  # calling the object only builds a generator: the body never runs


class _AsyncGeneratorCall:
    async def __call__(self):
        yield


def _keyword_only(*, ctx) -> None: ...


def _star_keyword_only(*args, flag) -> None: ...


@pytest.mark.parametrize(("fn", "options", "error", "message"), [
    (_keyword_only, {}, TypeError, "required keyword-only parameter 'ctx'"),
    (_star_keyword_only, {}, TypeError, "required keyword-only parameter 'flag'"),
    (_GeneratorCall(), {}, TypeError, "is a generator function"),
    (_AsyncGeneratorCall(), {}, TypeError, "is a generator function"),
    (lambda ctx, changes: None, {"env_keys": "API_KEY"}, TypeError,
     "env_keys must be a list of key names, not one str (write ['API_KEY'])"),
    (lambda ctx, changes: None, {"env_keys": ["API_KEY", 3]}, TypeError,
     "env_keys must be non-empty str key names"),
    (lambda ctx, changes: None, {"env_keys": ["API_KEY"], "event": "snapshot"}, ValueError,
     "env_keys applies to restore hooks only"),
])
def test_hooks_that_would_fail_or_never_run_in_the_clone_are_refused(fn, options, error,
                                                                     message):
    """Before, each was accepted: a required keyword-only parameter failed with TypeError
    at every restore; a callable object whose ``__call__`` is a generator was reported
    ``ok`` with its body never run; ``env_keys="API_KEY"`` watched the keys A, P, I …;
    ``env_keys`` on a snapshot hook made it ``skipped`` at every snapshot."""
    reg = Registry()
    with pytest.raises(error) as caught:
        reg.register(fn, **options)
    assert message in str(caught.value)
    assert len(reg) == 0


def test_a_phase_may_be_named_in_any_case() -> None:
    """``phase="connections"`` was refused with "'connections' is not a valid Phase",
    though ``str(Phase.CONNECTIONS)`` spells it so (and reports show it so)."""
    reg = Registry()

    @reg.after_restore(phase="connections")
    def reconnect() -> None: ...

    @reg.before_snapshot(phase=" Network ")
    def close() -> None: ...

    @reg.on_env_change("API_KEY", phase="SECRETS")
    def rotate() -> None: ...

    assert reg.hooks("restore")[0].phase is Phase.SECRETS
    assert reg.hooks("restore")[1].phase is Phase.CONNECTIONS
    assert reg.hooks("snapshot")[0].phase is Phase.NETWORK
    assert reg.register(lambda: None, phase=Phase.ENTROPY).phase is Phase.ENTROPY
    with pytest.raises(ValueError, match="^phase must be a Phase or one of environment, "
                       "entropy, secrets, network, connections, application, not 'conections'$"):
        reg.after_restore(phase="conections")(lambda: None)


def test_hooks_refuses_an_unknown_event() -> None:
    """``hooks("after_restore")`` matched no hook and read as "none registered"."""
    reg = Registry()
    reg.after_restore(lambda: None, name="app")
    with pytest.raises(ValueError, match="event must be 'restore' or 'snapshot'"):
        reg.hooks("after_restore")  # type: ignore[arg-type]
    assert [h.name for h in reg.hooks("restore")] == ["app"]


def test_isolated_engine_takes_an_environment_file(tmp_path, rehydrate_environ) -> None:  # type: ignore[no-untyped-def]
    """``isolated_engine(path=...)`` was a TypeError (path passed twice)."""
    from rehydrate.testing import isolated_engine

    env_file = tmp_path / "app.env"
    env_file.write_text("APP_FROM_FILE=yes\n")
    engine = isolated_engine(path=str(env_file), policy="update")
    try:
        assert engine.simulate_restore().ok
        import os

        assert os.environ["APP_FROM_FILE"] == "yes"
    finally:
        engine.close()
    engine = isolated_engine()
    assert engine.env.path is None
    engine.close()


def test_isolated_engine_passes_engine_options_to_the_engine() -> None:
    """Every option went to EnvRefresher: ``isolated_engine(builtins=False)`` raised
    "EnvRefresher.__init__() got an unexpected keyword argument", so no isolated engine
    could skip the built-ins (the process-global reseed among them)."""
    engine = isolated_engine(builtins=False, snapshot_deadline=5)
    try:
        assert engine.installed == [] and not engine.builtins.hooks("restore")
        assert engine.snapshot_deadline == 5
        assert engine.env.path is None
    finally:
        engine.close()
    with pytest.raises(TypeError, match=r"^isolated_engine\(\) got an unexpected keyword "
                       r"argument 'bogus' \(engine options: builtins, extensions, "
                       r"snapshot_deadline; environment refresh: path, policy, protect"):
        isolated_engine(bogus=1)


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"registry": "oops"}, r"^Lifecycle\(registry=\.\.\.\) takes a rehydrate\.Registry, not str$"),
    ({"env": {"path": None}}, r"^Lifecycle\(env=\.\.\.\) takes a rehydrate\.env\.EnvRefresher, "
                              r"not dict$"),
])
def test_lifecycle_refuses_a_registry_or_env_of_the_wrong_type(
        kwargs: dict[str, object], expected: str, caplog: pytest.LogCaptureFixture) -> None:
    """``Lifecycle(registry="oops")`` was accepted, logging one misleading "extension ...
    could not be installed: 'str' object has no attribute 'hooks'" line per built-in."""
    with pytest.raises(TypeError, match=expected):
        rehydrate.Lifecycle(**kwargs)  # type: ignore[arg-type]
    assert not [r for r in caplog.records if "could not be installed" in r.getMessage()]
