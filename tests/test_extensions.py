"""The extension contract: Lifecycle(extensions=...), probes, start listeners, defaults."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import rehydrate
from rehydrate import Lifecycle, Phase, Registry
from rehydrate.env import EnvRefresher
from rehydrate.extensions import (
    DEFAULT_EXTENSIONS,
    Engine,
    Extension,
    Probe,
    load_extension,
    resolve_engine,
)


@dataclass
class Recorder:
    """An extension that registers one hook, one status field and one start listener."""

    key: str = "recorder"
    usable: bool = True
    ran: list[str] = field(default_factory=list)
    started: list[Engine] = field(default_factory=list)

    def probe(self) -> Probe:
        return Probe(self.usable, "" if self.usable else "no recorder device here")

    def install(self, engine: Engine) -> None:
        engine.builtins.register(lambda: self.ran.append("restore"), phase=Phase.NETWORK,
                                 name="test.recorder", timeout=5.0)
        engine.add_status("recorder", lambda: len(self.ran))
        engine.add_start_listener(self.started.append)


def _engine(**kw: object) -> Lifecycle:
    return Lifecycle(Registry(), env=EnvRefresher(path=None), **kw)  # type: ignore[arg-type]


def test_default_extensions_are_installed_in_order():
    engine = _engine()
    try:
        assert engine.installed == ["env", "entropy", "telemetry", "fingerprint", "files"]
        assert [load_extension(n).key for n in DEFAULT_EXTENSIONS] == engine.installed
        names = [h.name for h in engine.builtins.hooks("restore")]
        assert "rehydrate.env" in names and "rehydrate.entropy" in names
    finally:
        engine.close()


def test_builtins_false_installs_nothing():
    engine = _engine(builtins=False)
    try:
        assert engine.installed == []
        assert engine.builtins.hooks("restore") == ()
    finally:
        engine.close()


def test_explicit_extension_hooks_status_and_start_listener():
    rec = Recorder()
    assert isinstance(rec, Extension)
    engine = _engine(extensions=[rec])
    try:
        assert engine.installed == ["recorder"]
        report = engine.simulate_restore()
        assert report.ok
        assert [h.name for h in report.hooks] == ["test.recorder"]
        assert rec.ran == ["restore"]
        assert engine.status().to_dict()["recorder"] == 1
        assert rec.started == []
        engine.start(detectors="none")
        engine.start(detectors="none")  # idempotent: listeners run on the first start only
        assert rec.started == [engine]
    finally:
        engine.close()


def test_unusable_extension_is_skipped_with_its_reason(caplog):
    rec = Recorder(usable=False)
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        engine = _engine(extensions=[rec])
    try:
        assert engine.installed == []
        assert engine.simulate_restore().hooks == ()
        assert "recorder not installed: no recorder device here" in caplog.text
    finally:
        engine.close()


def test_extensions_by_dotted_name(monkeypatch):
    mod = types.ModuleType("rehydrate_test_ext")
    mod.EXT = Recorder(key="dotted")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rehydrate_test_ext", mod)
    engine = _engine(extensions=["rehydrate.env", "rehydrate_test_ext:EXT"])
    try:
        assert engine.installed == ["env", "dotted"]
    finally:
        engine.close()


def test_explicit_bad_extension_raises_a_clear_error(monkeypatch):
    with pytest.raises(ModuleNotFoundError):
        _engine(extensions=["rehydrate_no_such_module"])
    monkeypatch.setitem(sys.modules, "rehydrate_not_ext", types.ModuleType("rehydrate_not_ext"))
    with pytest.raises(TypeError, match="rehydrate_not_ext is not an extension"):
        _engine(extensions=["rehydrate_not_ext"])


def test_a_failing_start_listener_is_logged_and_the_others_run(caplog):
    rec = Recorder()
    engine = _engine(extensions=[rec])

    def boom(_engine: Engine) -> None:
        raise RuntimeError("listener broke")

    engine._start_listeners.insert(0, boom)
    try:
        with caplog.at_level(logging.ERROR, logger="rehydrate"):
            engine.start(detectors="none")
        assert rec.started == [engine]
        assert "start listener" in caplog.text
    finally:
        engine.close()


def test_resolve_engine():
    engine = _engine(builtins=False)
    try:
        assert resolve_engine(engine) is engine
        assert resolve_engine(None) is rehydrate.default_engine
    finally:
        engine.close()


def test_a_dotted_name_of_a_class_is_instantiated(monkeypatch):
    mod = types.ModuleType("rehydrate_test_cls")
    mod.Rec = Recorder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rehydrate_test_cls", mod)
    ext = load_extension("rehydrate_test_cls:Rec")
    assert isinstance(ext, Recorder) and ext.key == "recorder"


# What the default extensions and the detectors need only when a feature is used (a
# manifest, a volume, a mapping, a control request): creating the engine and starting
# the default detectors must not import them.
LAZY_FOR_FIRST_USE = ("json", "hashlib", "ipaddress", "urllib", "pathlib", "mmap")


def test_engine_creation_and_first_start_leave_feature_modules_unimported():
    code = ("import sys, rehydrate\n"
            "rehydrate.after_restore(lambda: None)\n"
            "assert rehydrate.status().to_dict()['files'] is not None\n"
            "assert rehydrate.start()\n"
            "rehydrate.stop()\n"
            f"print(' '.join(m for m in {LAZY_FOR_FIRST_USE!r} if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REHYDRATE_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [], f"first use imported {out.stdout.strip()}"


@pytest.mark.parametrize("key", ["state", "generation", "ready", "detectors", "last_report"])
def test_an_extension_cannot_replace_a_core_status_field(rehydrate_engine, key):
    """Before: ``add_status("state", ...)`` replaced the engine's state in
    ``status().to_dict()`` — what the CLI, the control socket and /readyz show."""
    with pytest.raises(ValueError, match=f"status field {key!r} is the engine's own"):
        rehydrate_engine.add_status(key, lambda: "overridden")
    assert rehydrate_engine.status().to_dict()[key] != "overridden"


@pytest.mark.parametrize("key", ["detector_errors", "hung_hooks"])
def test_an_extension_cannot_replace_the_engines_other_status_fields(rehydrate_engine, key):
    """Before: ``add_status("detector_errors", ...)`` hid a dead detector and
    ``add_status("hung_hooks", ...)`` the engine's abandoned hook threads."""
    with pytest.raises(ValueError, match=f"status field {key!r} is the engine's own"):
        rehydrate_engine.add_status(key, lambda: "overridden")
    assert rehydrate_engine.status().to_dict().get(key) != "overridden"


def test_an_extension_cannot_replace_another_extensions_status_field(rehydrate_engine):
    """Before: a third-party manager's ``add_status("keys", ...)`` silently replaced what
    the key manager publishes. The same owner may add its field again (a detector
    started again, a new instance of the same class)."""
    import rehydrate.keys as keys

    keys.ephemeral("s", engine=rehydrate_engine)
    with pytest.raises(ValueError, match=r"status field 'keys' is added already by "
                                         r"rehydrate\.keys\.KeyManager; (tests\.)?test_extensions "
                                         r"cannot replace it"):
        rehydrate_engine.add_status("keys", lambda: ["my", "pool", "keys"])
    assert "s" in rehydrate_engine.status()["keys"]

    class Pool:
        def __init__(self, n: int) -> None:
            self.n = n

        def status(self) -> int:
            return self.n

    rehydrate_engine.add_status("pool", Pool(1).status)
    rehydrate_engine.add_status("pool", Pool(2).status)  # the same owner: replaced
    assert rehydrate_engine.status()["pool"] == 2


class _OwnerA:
    @classmethod
    def status(cls) -> str:
        return "A"


class _OwnerB:
    @classmethod
    def status(cls) -> str:
        return "B"


def _status_a() -> str:
    return "a"


def test_classmethods_and_partials_of_two_owners_do_not_replace_each_others_field(
        rehydrate_engine):
    """Before: every classmethod's owner was "builtins.type" and every partial's
    "functools", so two extensions' classmethods (or partials) replaced each other's
    field silently, and a refusal named "builtins.type"."""
    import functools

    rehydrate_engine.add_status("cm", _OwnerA.status)
    with pytest.raises(ValueError, match=r"added already by (tests\.)?test_extensions\._OwnerA; "
                                         r"(tests\.)?test_extensions\._OwnerB cannot"):
        rehydrate_engine.add_status("cm", _OwnerB.status)
    rehydrate_engine.add_status("cm", _OwnerA.status)  # the same owner: replaced
    rehydrate_engine.add_status("partial", functools.partial(_status_a))
    with pytest.raises(ValueError, match=r"by (tests\.)?test_extensions; builtins cannot"):
        rehydrate_engine.add_status("partial", functools.partial(str, "b"))
    assert rehydrate_engine.status()["cm"] == "A"
    assert rehydrate_engine.status()["partial"] == "a"


class _HalfInstall:
    """Attaches one of everything, then fails."""

    key = "half"
    closed = False

    def probe(self) -> Probe:
        return Probe(True)

    def install(self, engine: Lifecycle) -> None:
        ran = self.ran = []
        engine.builtins.register(lambda: ran.append("builtin"), name="half.builtin")
        engine.registry.register(lambda: ran.append("user"), name="half.user")
        engine.add_status("half", lambda: "attached")
        engine.add_listener(lambda report: ran.append("listener"))
        half = self

        class Manager:
            def close(self) -> None:
                half.closed = True

        engine.extension("half", lambda e: Manager())
        raise RuntimeError("install failed midway")


def test_an_extension_whose_install_fails_leaves_nothing_attached() -> None:
    """Before: the hooks (and status fields, listeners …) an extension had attached before
    its ``install()`` raised stayed, and ran at every event although it was reported as
    not installed — and, for an explicitly requested one, in the caller's own registry."""
    registry = Registry()
    half = _HalfInstall()
    with pytest.raises(RuntimeError, match="install failed midway"):
        Lifecycle(registry, extensions=[half], env=EnvRefresher(path=None))
    assert len(registry) == 0 and half.closed

    engine = Lifecycle(Registry(), env=EnvRefresher(path=None))
    try:
        other = _HalfInstall()
        engine._install_extensions([other], explicit=False)  # as for a default extension
        assert "half" not in engine.installed and other.closed
        report = engine.simulate_restore()
        assert other.ran == []
        assert [h.name for h in report.hooks if h.name.startswith("half")] == []
        assert "half" not in engine.status().to_dict()
    finally:
        engine.close()


def test_an_extension_listed_twice_is_refused_not_installed_twice(caplog):
    """Lifecycle(extensions=["rehydrate.env", "rehydrate.env"]) installed the manager
    twice: its hook ran twice at every restore and `installed` listed "env" twice,
    although a key is unique per engine."""
    twice = _engine(extensions=["rehydrate.env", "rehydrate.env"])
    try:  # the same spec again is the one installed already: once, no error
        assert twice.installed == ["env"]
    finally:
        twice.close()
    rec = Recorder()
    with pytest.raises(ValueError, match=r"extension 'recorder' is installed already"):
        _engine(extensions=[rec, Recorder()])
    # Among the defaults (logged, not raised), the first copy stays, once.
    engine = _engine(extensions=None, builtins=True)
    try:
        caplog.set_level(logging.WARNING, logger="rehydrate")
        engine._install_extensions(["rehydrate.env"], explicit=False)
        assert engine.installed.count("env") == 1
        engine._install_extensions([Recorder(key="env")], explicit=False)  # another one
        assert engine.installed.count("env") == 1
        assert "extension 'env' is installed already" in caplog.text
        names = [h.name for h in engine.simulate_restore().hooks]
        assert names.count("rehydrate.env") == 1
    finally:
        engine.close()


def test_an_extension_whose_probe_or_key_is_malformed_gets_a_clear_error():
    """probe() returning True failed with "'bool' object has no attribute 'usable'"."""

    class BoolProbe(Recorder):
        def probe(self) -> Probe:
            return True  # type: ignore[return-value]

    with pytest.raises(TypeError, match=r"extension 'recorder': probe\(\) must return a "
                                        r"Probe, not bool"):
        _engine(extensions=[BoolProbe()])
    with pytest.raises(TypeError, match=r"key must be a non-empty str, not None"):
        _engine(extensions=[Recorder(key=None)])  # type: ignore[arg-type]


def test_a_detector_class_given_instead_of_an_instance_is_named():
    """Lifecycle(extensions=[ControlDetector]) passed the protocol check (a class has
    key and probe) and failed in install() with "missing 1 required positional argument:
    'engine'"; GVisorDetector was skipped quietly wherever its probe said no."""
    from rehydrate.detect.control import ControlDetector
    from rehydrate.detect.gvisor import GVisorDetector

    for cls in (ControlDetector, GVisorDetector):
        with pytest.raises(TypeError, match=rf"{cls.__name__} is a class, not an extension "
                                            rf"object: pass an instance .*'{cls.__module__}:"):
            _engine(extensions=[cls])
        with pytest.raises(TypeError, match="is a class"):
            load_extension(cls)  # type: ignore[arg-type]
    # The dotted name of a class is still instantiated.
    assert isinstance(load_extension("rehydrate.detect.control:ControlDetector"),
                      ControlDetector)


def test_an_unusable_extension_listed_explicitly_is_a_warning_a_default_one_info(caplog):
    """Listed by the user, it was wanted: an INFO line (below most applications' level)
    left an adapter silently out of every snapshot and restore."""
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        engine = _engine(extensions=[Recorder(usable=False)])
        engine._install_extensions([Recorder(key="quiet", usable=False)], explicit=False)
    try:
        levels = {r.getMessage().split()[1]: r.levelno for r in caplog.records
                  if "not installed" in r.getMessage()}
        assert levels == {"recorder": logging.WARNING, "quiet": logging.INFO}
        assert engine.installed == []
    finally:
        engine.close()


_LEFT_OUT = "installs only the extensions listed"


def _left_out_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if _LEFT_OUT in r.getMessage()]


def test_an_explicit_list_that_leaves_the_defaults_out_says_so_at_info(caplog):
    """``Lifecycle(extensions=[adapter])`` read like ``start(extensions=[adapter])``, which
    adds to the defaults; it replaces them, and a clone kept its parent's PRNG state and
    environment without a word."""
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        engine = _engine(extensions=[Recorder()])
    try:
        assert engine.installed == ["recorder"]  # the pinned semantics: the list replaces
        [line] = _left_out_lines(caplog)
        assert line.levelno == logging.INFO
        assert ("not the default ones env, entropy, telemetry, fingerprint, files"
                in line.getMessage())
        assert "extensions=[*DEFAULT_EXTENSIONS, ...]" in line.getMessage()
    finally:
        engine.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        engine = _engine(extensions=iter(["rehydrate.env", Recorder()]))
    try:
        assert engine.installed == ["env", "recorder"]
        [line] = _left_out_lines(caplog)
        assert "the default ones entropy, telemetry, fingerprint, files (" in line.getMessage()
    finally:
        engine.close()


@pytest.mark.parametrize("kw", [
    {"extensions": []},  # a deliberate "nothing"
    {"extensions": [Recorder()], "builtins": False},  # said so
    {"extensions": [*DEFAULT_EXTENSIONS, Recorder()]},  # the documented spelling
])
def test_an_explicit_list_that_opts_out_or_keeps_the_defaults_says_nothing(caplog, kw):
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        engine = _engine(**kw)
    try:
        assert _left_out_lines(caplog) == []
    finally:
        engine.close()


def test_both_documented_spellings_of_an_engine_with_an_adapter_keep_the_defaults():
    """docs/game-servers.md and docs/inference.md: an engine of one's own with an adapter
    is ``Lifecycle(extensions=[*DEFAULT_EXTENSIONS, adapter])`` or ``Lifecycle()`` then
    ``install(adapter)``; either reseeds the PRNG and refreshes the environment."""
    listed = _engine(extensions=[*DEFAULT_EXTENSIONS, Recorder()])
    added = _engine()
    try:
        assert added.install(Recorder()) == ["recorder"]
        for engine in (listed, added):
            assert engine.installed == [*(load_extension(n).key for n in DEFAULT_EXTENSIONS),
                                        "recorder"]
            names = [h.name for h in engine.simulate_restore().hooks]
            assert {"rehydrate.env", "rehydrate.entropy", "test.recorder"} <= set(names)
    finally:
        listed.close()
        added.close()


def test_every_lifecycle_with_extensions_the_docs_show_keeps_the_defaults():
    """A ``Lifecycle(extensions=[adapter])`` shown in the docs or a docstring as the way
    to an engine with an adapter dropped the environment refresh, the reseeding, … ; one
    that names a concrete extension lists ``*DEFAULT_EXTENSIONS`` first."""
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *(root / "docs").rglob("*.md"),
             *(root / "examples").rglob("*.md"), *(root / "rehydrate").rglob("*.py")]
    shown = re.compile(r"Lifecycle\([^\n)]*?extensions=\[\s*([^\]\n]*)")
    bad = [f"{page.relative_to(root)}: {m.group(0)}"
           for page in pages for m in shown.finditer(page.read_text())
           if m.group(1).strip() not in ("", "...", "…")
           and not m.group(1).lstrip().startswith("*DEFAULT_EXTENSIONS")]
    assert bad == [], "\n".join(bad)


def test_install_adds_extensions_to_a_running_engine_with_the_probe_honoured(caplog):
    engine = _engine(builtins=False)
    try:
        rec = Recorder()
        with caplog.at_level(logging.WARNING, logger="rehydrate"):
            assert engine.install(rec, Recorder(key="absent", usable=False)) == ["recorder"]
        assert "extension absent not installed: no recorder device here" in caplog.messages
        assert [h.name for h in engine.simulate_restore().hooks] == ["test.recorder"]
        with pytest.raises(ValueError, match="'recorder' is installed already"):
            engine.install(Recorder())
    finally:
        engine.close()


def test_module_start_with_extensions_extends_the_process_wide_engine(monkeypatch):
    """``Lifecycle(extensions=[...])`` then ``rehydrate.start()`` (as the docs showed)
    builds a second engine that start() never runs: start(extensions=) is the way."""
    import rehydrate.extensions as extensions_module

    engine = _engine()
    monkeypatch.setattr(extensions_module, "_default", engine)
    rec = Recorder()
    try:
        assert rehydrate.start(detectors="none", extensions=[rec]) == []
        assert rec.started == [engine]  # installed before the start: its listener ran
        assert engine.installed[-1] == "recorder"
        report = rehydrate.simulate_restore(reason="t")
        assert "test.recorder" in [h.name for h in report.hooks]
        assert rehydrate.status()["recorder"] == 1
        with pytest.raises(ValueError, match="installed already"):
            rehydrate.start(extensions=[Recorder()])  # another one with that key
        # the same one again (a fixture, an app factory run twice): nothing more
        assert rehydrate.start(detectors="none", extensions=[rec]) == []
        assert engine.installed.count("recorder") == 1 and rec.started == [engine]
    finally:
        engine.close()


def test_an_extension_installed_after_start_gets_its_start_listener_called() -> None:
    """Its hooks and status fields were attached, but a start listener it added never
    ran (start() calls them once): the fingerprint's reads REHYDRATE_MANIFEST."""
    engine = _engine(builtins=False)
    try:
        engine.start("none")
        rec = Recorder()
        assert engine.install(rec) == ["recorder"]
        assert rec.started == [engine]
    finally:
        engine.close()


def test_a_detector_extension_given_to_start_starts_with_the_others(monkeypatch):
    from rehydrate.detect import Detector

    class Doorbell(Detector):
        key = "doorbell"
        runs = 0

        def start(self, engine: Engine) -> None:
            type(self).runs += 1

        def stop(self) -> None:
            pass

    engine = _engine()
    try:
        assert engine.start(detectors="none", extensions=[Doorbell()]) == ["doorbell"]
        assert Doorbell.runs == 1 and engine.status().detectors == ("doorbell",)
    finally:
        engine.close()


def test_a_start_listener_of_an_extension_installed_after_start_may_install_more() -> None:
    """It ran inside install(), under its lock: one that installed another extension
    waited for that lock for ever. It runs once install() is done now."""
    import threading

    class Outer:
        key = "outer"

        def probe(self) -> Probe:
            return Probe(True)

        def install(self, engine: Engine) -> None:
            engine.add_start_listener(lambda e: e.install(Recorder()))  # type: ignore[attr-defined]

    engine = _engine(builtins=False)
    try:
        engine.start("none")
        worker = threading.Thread(target=lambda: engine.install(Outer()), daemon=True)
        worker.start()
        worker.join(10.0)
        assert not worker.is_alive(), "install() never returned"
        assert engine.installed == ["outer", "recorder"]
    finally:
        engine.close()


def test_the_start_listener_of_an_extension_that_failed_to_install_never_runs() -> None:
    ran: list[str] = []

    class Broken:
        key = "broken"

        def probe(self) -> Probe:
            return Probe(True)

        def install(self, engine: Engine) -> None:
            engine.add_start_listener(lambda e: ran.append("listener"))
            raise RuntimeError("install failed")

    engine = _engine(builtins=False)
    try:
        engine.start("none")
        with pytest.raises(RuntimeError, match="install failed"):
            engine.install(Broken())
        assert engine.installed == [] and ran == []
    finally:
        engine.close()


def test_in_hook_is_true_in_sync_and_async_hooks_of_any_engine_and_false_outside() -> None:
    """Adapters ask this (kserve lets a restore hook reload a gated model) instead of
    reading the engine's private context variable."""
    import asyncio

    from rehydrate.extensions import in_hook

    seen: list[tuple[str, bool]] = []

    def sync_hook() -> None:
        seen.append(("sync", in_hook()))

    async def async_hook() -> None:
        seen.append(("async", in_hook()))
        # a task the hook starts inherits its context: still the hook's work
        seen.append(("task", await asyncio.create_task(_async_in_hook())))

    engine = _engine(builtins=False)
    try:
        engine.registry.register(sync_hook, phase=Phase.APPLICATION, name="test.sync")
        engine.registry.register(async_hook, phase=Phase.APPLICATION, name="test.async")
        assert in_hook() is False
        assert engine.simulate_restore().ok
        assert in_hook() is False
    finally:
        engine.close()
    assert sorted(seen) == [("async", True), ("sync", True), ("task", True)]


async def _async_in_hook() -> bool:
    from rehydrate.extensions import in_hook

    return in_hook()


def test_in_hook_is_false_in_what_a_hook_started_once_the_hook_returned() -> None:
    """A task or thread a hook starts with its context and leaves running (a matchmaking
    worker started by a restore hook) inherited the marker for good: the Agones adapter
    failed its calls at the next snapshot as if a hook made them."""
    import asyncio
    import contextvars
    import threading

    from rehydrate.extensions import in_hook

    seen: list[tuple[str, bool]] = []
    go, both = threading.Event(), threading.Event()

    def record(what: str) -> None:
        seen.append((what, in_hook()))
        if len(seen) == 2:
            both.set()

    def later() -> None:
        go.wait(10)
        record("thread")

    async def worker() -> None:
        await asyncio.to_thread(go.wait, 10)
        record("task")

    def sync_hook() -> None:
        ctx = contextvars.copy_context()
        threading.Thread(target=ctx.run, args=(later,), daemon=True).start()

    async def async_hook() -> None:
        worker_task = asyncio.get_running_loop().create_task(worker())
        async_hook.task = worker_task  # type: ignore[attr-defined]  # kept referenced

    engine = _engine(builtins=False)
    try:
        engine.registry.register(sync_hook, phase=Phase.APPLICATION, name="test.sync")
        engine.registry.register(async_hook, phase=Phase.APPLICATION, name="test.async")
        assert engine.simulate_restore().ok
        go.set()
        assert both.wait(10), seen
    finally:
        engine.close()
    assert sorted(seen) == [("task", False), ("thread", False)]


def test_before_user_hooks_runs_a_builtin_hook_before_the_lowest_user_order() -> None:
    from rehydrate._hooks import ORDER_LIMIT
    from rehydrate.extensions import BEFORE_USER_HOOKS

    engine = _engine(builtins=False)
    try:
        engine.registry.register(lambda: None, phase=Phase.ENVIRONMENT, order=-ORDER_LIMIT,
                                 name="test.lowest-user")
        engine.builtins.register(lambda: None, phase=Phase.ENVIRONMENT,
                                 order=BEFORE_USER_HOOKS, name="test.builtin")
        assert [h.name for h in engine.simulate_restore().hooks] == [
            "test.builtin", "test.lowest-user"]
        with pytest.raises(ValueError, match="order must be an int"):
            engine.registry.register(lambda: None, order=BEFORE_USER_HOOKS)
    finally:
        engine.close()


def test_check_seconds_and_shown_refuse_a_bad_argument_in_one_bounded_line() -> None:
    from rehydrate.extensions import MAX_SECONDS, check_seconds, shown

    assert check_seconds(2, "deadline") == 2.0
    assert check_seconds(0, "max_wait", zero_ok=True) == 0.0
    assert check_seconds(MAX_SECONDS, "deadline") == MAX_SECONDS
    with pytest.raises(TypeError, match=r"^deadline must be a number of seconds > 0 .*, not bool"):
        check_seconds(True, "deadline")
    for bad in (0, -1, float("nan"), float("inf"), MAX_SECONDS + 1, 10**5000):
        with pytest.raises(ValueError, match=r"^deadline must be a number of seconds > 0") as e:
            check_seconds(bad, "deadline")
        assert len(str(e.value)) < 150
    assert shown(10**5000) == "1e+5000"
    assert shown("x" * 100) == repr("x" * 100)[:57] + "..."
    assert shown([10**5000]) == "[1e+5000]"


@pytest.mark.parametrize("bad", [
    rehydrate.extensions.default_engine, rehydrate, Lifecycle, Registry(), "engine", 0],
    ids=["default_engine-function", "module", "class", "registry", "str", "int"])
def test_resolve_engine_refuses_what_is_no_engine_in_one_line(bad):
    """resolve_engine() accepted anything: passed on, it failed later inside an extension
    with an AttributeError naming nothing the caller wrote."""
    from rehydrate.extensions import shown

    with pytest.raises(TypeError) as exc:
        resolve_engine(bad)
    message = str(exc.value)
    assert message.startswith("engine must be a rehydrate engine (a rehydrate.Lifecycle, "
                              "e.g. rehydrate.default_engine) or None, not ")
    assert shown(bad) in message and "\n" not in message
    said = "rehydrate.extensions.default_engine is the function that returns it: call it"
    assert (said in message) == (bad is rehydrate.extensions.default_engine)
