"""Every detector is an extension: ``key``, ``probe() -> Probe`` and ``install(engine)``."""

from __future__ import annotations

import logging
import os
import string
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rehydrate import Lifecycle, Registry, detect
from rehydrate.detect import (
    DETECTORS,
    Detector,
    available,
    catalogue_keys,
    key_of,
    load,
    probe_of,
)
from rehydrate.env import EnvRefresher
from rehydrate.extensions import Extension, Probe


def _unusable(key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Probe]:
    """Make detector ``key`` unusable the way a real host would; the probe to call."""
    cls = load(key)
    if key == "gvisor":
        monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path / "no-gvisor"))
    elif key == "control":
        (tmp_path / "file").write_text("")  # the socket's directory is a regular file
        monkeypatch.setenv("REHYDRATE_CONTROL_SOCKET", str(tmp_path / "file" / "c.sock"))
    elif key == "snapstart":
        monkeypatch.setitem(sys.modules, "snapshot_restore_py", None)  # not importable
    elif key == "vmclock":
        monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(tmp_path / "vmclock0"))
    elif key == "file":
        monkeypatch.delenv("REHYDRATE_MARKER_FILE", raising=False)
    elif key == "signal":  # asked from another thread than the main one
        def off_main() -> Probe:
            out: list[Probe] = []
            t = threading.Thread(target=lambda: out.append(cls.probe()))
            t.start()
            t.join()
            return out[0]
        return off_main
    elif key == "clock-jump":
        def no_clock(clk_id: int) -> float:
            raise OSError(22, "Invalid argument")
        monkeypatch.setattr(time, "clock_gettime", no_clock)
    elif key == "identity":
        monkeypatch.setattr(sys.modules[cls.__module__], "read_identity",
                            lambda: dict.fromkeys(("hostname", "boot_id", "machine_id")))
    else:  # a new detector: add how a host makes it unusable here
        pytest.fail(f"no unusable setup for detector {key!r}")
    return cls.probe


@pytest.mark.parametrize("key", catalogue_keys())
def test_each_detector_is_an_extension(key: str, tmp_path: Path) -> None:
    cls = load(key)
    assert cls.key == key
    kwargs = {"file": {"path": tmp_path / "marker"}}.get(key, {})
    detector = cls(**kwargs)
    assert isinstance(detector, Extension)
    assert detector.key == key
    assert isinstance(detector.probe(), Probe)


@pytest.mark.parametrize("key", catalogue_keys())
def test_each_probe_says_why_not_in_one_readable_line(
        key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        rehydrate_environ: None) -> None:
    found = _unusable(key, tmp_path, monkeypatch)()
    assert isinstance(found, Probe) and not found.usable
    reason = found.reason
    assert len(reason) > 15 and "\n" not in reason, reason
    assert set(reason) <= set(string.printable) | {"—"}, reason
    assert not reason.startswith(("<", "None", "Traceback")), reason
    if key != "signal":  # doctor shows the same reason (signal: doctor runs on main)
        [info] = [i for i in available() if i.name == key]
        assert not info.usable and info.reason == reason


class Recording(Detector):
    """Recording: a detector that only records start and stop."""

    key = "recording"

    def __init__(self) -> None:
        self.events: list[str] = []

    def start(self, engine: Any) -> None:
        self.events.append("start")

    def stop(self) -> None:
        self.events.append("stop")


@pytest.fixture
def bare_engine() -> Any:
    engines: list[Lifecycle] = []

    def make(extensions: list[Any]) -> Lifecycle:
        engines.append(Lifecycle(Registry(), env=EnvRefresher(path=None),
                                 extensions=extensions))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def test_an_installed_detector_runs_with_every_start(bare_engine: Any) -> None:
    rec = Recording()
    engine = bare_engine([rec])
    assert engine.installed == ["recording"]
    assert rec.events == []  # installing starts nothing
    assert engine.start("none") == ["recording"]
    assert engine.status().detectors == ("recording",)
    engine.stop()
    assert rec.events == ["start", "stop"] and engine.status().detectors == ()
    assert engine.start("none") == ["recording"]  # still installed after a stop
    assert rec.events == ["start", "stop", "start"]


def test_an_installed_detector_takes_the_place_of_a_selected_one(bare_engine: Any) -> None:
    class Identity(Recording):
        key = "identity"

    mine = Identity()
    engine = bare_engine([mine])
    assert engine.start(["identity", "clock-jump"]) == ["identity", "clock-jump"]
    assert engine.detector("identity") is mine


def test_installing_into_a_running_engine_starts_at_once(bare_engine: Any) -> None:
    engine = bare_engine([])
    engine.start("none")
    rec = Recording()
    rec.install(engine)
    assert rec.events == ["start"] and engine.detector("recording") is rec
    assert engine.status().detectors == ("recording",)


def test_installing_the_same_key_into_a_running_engine_replaces_the_running_one(
        bare_engine: Any) -> None:
    engine = bare_engine([])
    engine.start("none")
    first, second = Recording(), Recording()
    first.install(engine)
    first.install(engine)  # the same object again: nothing restarts
    second.install(engine)
    assert first.events == ["start", "stop"] and second.events == ["start"]
    assert engine.detector("recording") is second
    assert engine.status().detectors == ("recording",)
    engine.stop()
    assert second.events == ["start", "stop"] and first.events == ["start", "stop"]


def test_a_real_detector_by_dotted_name(bare_engine: Any, rehydrate_environ: None) -> None:
    spec = next(s for s in DETECTORS if key_of(s) == "clock-jump")
    engine = bare_engine([spec])
    assert engine.installed == ["clock-jump"]
    assert engine.start("none") == ["clock-jump"]
    assert any(t.name == "rehydrate-clock-jump" for t in threading.enumerate())
    engine.stop()
    assert not any(t.name == "rehydrate-clock-jump" and t.is_alive()
                   for t in threading.enumerate())


def test_an_unusable_detector_is_not_installed_and_says_why(
        bare_engine: Any, tmp_path: Path, rehydrate_environ: None,
        caplog: pytest.LogCaptureFixture) -> None:
    os.environ["REHYDRATE_GVISOR_PROC"] = str(tmp_path / "none")
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        engine = bare_engine(["rehydrate.detect.gvisor:GVisorDetector"])
    assert engine.installed == []
    assert f"extension gvisor not installed: {tmp_path / 'none'}" in caplog.text


def test_the_former_detector_interface_still_works_with_warnings() -> None:
    with pytest.warns(DeprecationWarning, match="name the detector with `key`"):
        class Old(Detector):
            name = "old"

            @classmethod
            def probe(cls) -> Any:  # the former shape: a reason or None
                return "no old device here"

    assert Old.key == "old"
    with pytest.warns(DeprecationWarning, match="must return a rehydrate.extensions.Probe"):
        assert probe_of(Old) == Probe(False, "no old device here")
    with pytest.warns(DeprecationWarning, match="Detector.name is deprecated"):
        assert Old().name == "old"
    with pytest.warns(DeprecationWarning, match="CATALOGUE is deprecated"):
        catalogue = detect.CATALOGUE
    assert list(catalogue) == catalogue_keys()
    assert catalogue["clock-jump"] == "rehydrate.detect.clock_jump:ClockJumpDetector"
    with pytest.raises(TypeError):  # read-only: adding a detector there would do nothing
        catalogue["mine"] = "pkg.mine:MineDetector"  # type: ignore[index]


class Reporting(Recording):
    """Recording, and which engine each start() got (where its reports would go)."""

    key = "reporting"

    def __init__(self) -> None:
        super().__init__()
        self.engines: list[Any] = []

    def start(self, engine: Any) -> None:
        super().start(engine)
        self.engines.append(engine)


def test_one_detector_instance_is_refused_by_a_second_engine(bare_engine: Any,
                                                            caplog: Any) -> None:
    """A detector started by a second engine while the first ran it: the second listed it
    as running, but it went on reporting to the first (the built-in ones said "already
    running", or nothing at all). One instance serves one engine at a time."""
    det = Reporting()
    first, second = bare_engine([]), bare_engine([])
    assert first.start([det]) == ["reporting"]
    with caplog.at_level(logging.ERROR, logger="rehydrate"):
        assert second.start([det]) == []
    assert second.status().detectors == ()
    error = second.status().extra["detector_errors"]["reporting"]
    assert "already runs on another engine" in error and "\n" not in error
    assert "already runs on another engine" in caplog.text
    second.add_detector(det)  # installing it there is refused the same way
    assert second.detector("reporting") is None and det.engines == [first]
    assert first.status().detectors == ("reporting",)

    first.stop()  # released: now the second engine may have it
    second.stop()
    assert second.start([det]) == ["reporting"] and det.engines == [first, second]
    assert first.start([det]) == []


def test_a_built_in_detector_is_refused_by_a_second_engine(bare_engine: Any,
                                                          tmp_path: Path) -> None:
    from rehydrate.detect.identity import SOURCES, IdentityDetector

    for field, rel in SOURCES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"{field}-1\n")
    det = IdentityDetector(interval=60.0, root=tmp_path)
    first, second = bare_engine([]), bare_engine([])
    try:
        assert first.start([det]) == ["identity"]
        assert second.start([det]) == []
        assert "another engine" in second.status().extra["detector_errors"]["identity"]
    finally:
        first.stop()
        second.stop()


def test_the_same_instance_listed_twice_runs_once(bare_engine: Any) -> None:
    det = Reporting()
    engine = bare_engine([])
    assert engine.start([det, det]) == ["reporting"]
    assert det.events == ["start"] and "detector_errors" not in engine.status().extra
    engine.stop()
    assert det.events == ["start", "stop"]


def test_a_refused_replacement_leaves_the_running_detector_in_place(bare_engine: Any) -> None:
    """add_detector() of an instance another engine runs must not stop the detector with
    that key this engine runs: it would be left with neither."""
    mine, theirs = Reporting(), Reporting()
    engine, other = bare_engine([]), bare_engine([])
    assert engine.start([mine]) == ["reporting"] and other.start([theirs]) == ["reporting"]
    engine.add_detector(theirs)
    assert engine.detector("reporting") is mine and mine.events == ["start"]
    assert "another engine" in engine.status().extra["detector_errors"]["reporting"]
    assert theirs.engines == [other]


class Configured(Recording):
    """Configured: usable only as an instance given its own configuration."""

    key = "configured"

    @classmethod
    def probe(cls) -> Probe:
        return Probe(False, "REHYDRATE_CONFIGURED is not set")

    def probe_instance(self) -> Probe:
        return Probe(True)


def test_a_detector_instance_given_as_an_extension_is_probed_as_an_instance(
        bare_engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Before: ``start(extensions=[FileDetector(path)])`` and ``Lifecycle(extensions=[...,
    FileDetector(path)])`` asked the class's probe ("REHYDRATE_MARKER_FILE is not set")
    and left the detector out with a WARNING, while ``detectors=[...]`` ran it."""
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        engine = bare_engine([Configured()])
        assert engine.installed == ["configured"]
        assert engine.start("none") == ["configured"]
        other = bare_engine([])
        assert other.start("none", extensions=[Configured()]) == ["configured"]
    assert "not installed" not in caplog.text


def test_an_installed_detectors_key_may_be_listed_in_start(bare_engine: Any) -> None:
    """Before: ``start(["recording"])`` raised "unknown detector" for an installed
    detector outside the catalogue, on the first call and on a later one."""
    rec = Recording()
    engine = bare_engine([rec])
    assert engine.start(["recording", "clock-jump"]) == ["recording", "clock-jump"]
    assert engine.start(["recording"]) == ["recording", "clock-jump"]
    engine.stop()
    assert engine.start("recording") == ["recording"]
    with pytest.raises(ValueError, match="unknown detector 'nothing'"):
        engine.start(["recording", "nothing"])


class _FailsAfterItsDetector:
    """An adapter that brings its own detector, then fails to install."""

    key = "composite"

    def __init__(self, detector: Detector) -> None:
        self.detector = detector

    def probe(self) -> Probe:
        return Probe(True)

    def install(self, engine: Any) -> None:
        self.detector.install(engine)
        raise RuntimeError("framework not configured")


@pytest.mark.parametrize("started_first", [False, True])
def test_a_failed_install_takes_its_detector_off_again(bare_engine: Any,
                                                       started_first: bool) -> None:
    """Before: an extension whose ``install()`` raised after ``add_detector`` left that
    detector installed — started by every later ``start()``, or running already."""
    engine = bare_engine([])
    if started_first:
        engine.start("none")
    rec = Recording()
    with pytest.raises(RuntimeError, match="framework not configured"):
        engine.install(_FailsAfterItsDetector(rec))
    assert "composite" not in engine.installed
    assert engine.start("none") == [] and engine.detector("recording") is None
    assert rec.events == (["start", "stop"] if started_first else [])
    with pytest.raises(ValueError, match="unknown detector"):
        engine.start(["recording"])


def test_a_failed_install_puts_back_the_detector_it_replaced(bare_engine: Any) -> None:
    first = Recording()
    engine = bare_engine([first])
    engine.start("none")
    second = Recording()
    with pytest.raises(RuntimeError, match="framework not configured"):
        engine.install(_FailsAfterItsDetector(second))
    assert engine.detector("recording") is first
    assert first.events == ["start", "stop", "start"] and second.events == ["start", "stop"]
    engine.stop()
    assert engine.start("none") == ["recording"] and engine.detector("recording") is first


class _InstanceProbe(Recording):
    """Instance probe: ``probe`` written as an instance method, as the Extension
    protocol shows it."""

    key = "instance-probe"

    def probe(self) -> Probe:  # type: ignore[override]
        return Probe(True)


def test_a_probe_written_as_an_instance_method(bare_engine: Any) -> None:
    """Before: ``start(extensions=[det])`` worked and ``start(detectors=[det])`` raised
    "probe() missing 1 required positional argument: 'self'"; a key (doctor, "auto")
    now says what is wrong instead of failing in the call."""
    engine = bare_engine([])
    assert engine.start([_InstanceProbe()]) == ["instance-probe"]
    assert bare_engine([_InstanceProbe()]).start("none") == ["instance-probe"]
    with pytest.raises(TypeError, match=r"_InstanceProbe.probe\(\) must be a classmethod"):
        probe_of(_InstanceProbe)


def test_a_catalogue_entry_start_auto_cannot_use_is_named_not_skipped_silently(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Before: an entry appended to ``DETECTORS`` whose key is not its module's name was
    left out of ``start("auto")`` without a word."""
    monkeypatch.setattr(detect, "DETECTORS",
                        [*DETECTORS, f"{__name__}:Recording"])  # key "recording"
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        chosen = detect.select("auto")
    assert all(d.key != "recording" for d in chosen)
    key = key_of(f"{__name__}:Recording")
    assert f'detector {key} skipped by start("auto")' in caplog.text
    assert "key is its module's name" in caplog.text


class _Doorbell(Recording):
    """Doorbell: the test rings it; its notice passes no ``since``, as the docs showed."""

    key = "doorbell"
    specificity = 50

    def start(self, engine: Any) -> None:
        self.engine = engine

    def ring(self) -> Any:
        return self.engine.restore_detected("doorbell")


def test_an_outside_notice_without_since_after_the_clock_jump_run_is_that_restore(
        rehydrate_engine: Lifecycle) -> None:
    """Before: a doorbell rung right after a freeze the clock-jump detector had handled
    ran every hook a second time (runs [clock-jump 1, doorbell 2]): a notice without
    ``since`` never deduplicated. Now the engine asks its freeze watch, as for ``notify
    restore`` without a save: nothing froze since that run, so it is that restore."""
    engine = rehydrate_engine
    runs: list[tuple[str, int]] = []
    engine.registry.after_restore(lambda ctx: runs.append((ctx.reason, ctx.generation)),
                                  name="test.runs")
    bell = _Doorbell()
    assert engine.start("none", extensions=[bell]) == ["doorbell"]
    # The freeze watch as the clock-jump detector feeds it (its own clock is real time),
    # for a freeze handled moments ago (within the 2 s window before the ring).
    t = time.monotonic() - 0.5
    engine.heartbeat(t - 10, 1.0)  # the watch began
    engine.heartbeat(t - 3, 1.0)  # the last heartbeat before the freeze
    engine.freeze_noticed(t - 3, t)
    engine.restore_detected("clock-jump", since=t - 3, detected_at=t)
    engine.heartbeat(time.monotonic(), 1.0)  # the watch goes on

    dup = bell.ring()
    assert dup.deduplicated and (dup.reason, dup.generation) == ("clock-jump", 1)
    assert engine.status().last_report.confirmed_by == ("doorbell",)
    assert bell.ring().deduplicated  # still no freeze since
    assert runs == [("clock-jump", 1)]

    # A new freeze the watch noticed, rung before the clock jump's notice: the bell's
    # notice runs it, the clock jump's is the duplicate.
    now = time.monotonic()
    engine.freeze_noticed(now - 0.5, now)
    assert not bell.ring().deduplicated
    assert engine.restore_detected("clock-jump", since=now - 0.5).deduplicated
    assert runs == [("clock-jump", 1), ("doorbell", 2)]


def test_an_outside_notice_without_since_and_no_freeze_watch_runs(
        rehydrate_engine: Lifecycle) -> None:
    """Without a freeze watch the engine cannot tell: every such notice runs."""
    bell = _Doorbell()
    assert rehydrate_engine.start("none", extensions=[bell]) == ["doorbell"]
    assert [bell.ring().generation for _ in range(2)] == [1, 2]


def test_an_outside_notice_without_since_after_the_window_runs_although_the_watch_saw_nothing(
        rehydrate_engine: Lifecycle) -> None:
    """Before: with a freeze watch that cannot see the freezes (the guest clock carried
    over, as on Firecracker: heartbeats without a gap), every notice after the first was
    deduplicated by the watch's first heartbeat — clone B kept clone A's keys and said
    ready. A restore handled more than the window (2 s) before the notice is not it."""
    engine = rehydrate_engine
    bell = _Doorbell()
    assert engine.start("none", extensions=[bell]) == ["doorbell"]
    now = time.monotonic()
    engine.heartbeat(now - 10, 30.0)  # the watch began; it never sees a gap
    first = engine.restore_detected("doorbell", detected_at=now - 3)  # clone A, 3 s ago
    assert (first.deduplicated, first.generation) == (False, 1)
    engine.heartbeat(time.monotonic(), 30.0)
    second = bell.ring()  # clone B
    assert (second.deduplicated, second.generation) == (False, 2)
    # a late duplicate of B's notice within the window is still B's
    assert bell.ring().deduplicated and engine.status().generation == 2


def test_a_keyed_notice_without_since_is_not_deduplicated_by_the_freeze_watch(
        rehydrate_engine: Lifecycle) -> None:
    """Before: ``key=`` without ``since=`` asked the freeze watch too, so a NEW key right
    after a restore was taken for it by time; only the key tells (the docs said so)."""
    engine = rehydrate_engine
    engine.start("none")
    engine.heartbeat(time.monotonic(), 30.0)  # a freeze watch that saw no freeze
    assert not engine.restore_detected("counter", key="restore-1").deduplicated
    second = engine.restore_detected("counter", key="restore-2")
    assert (second.deduplicated, second.generation) == (False, 2)
    assert engine.restore_detected("counter", key="restore-2").deduplicated


class _Listening(Recording):
    """Listening: a running detector with a report listener, as the built-ins have."""

    def start(self, engine: Any) -> None:
        super().start(engine)
        self.engine = engine
        engine.add_listener(self.heard)

    def stop(self) -> None:
        super().stop()
        self.engine.remove_listener(self.heard)

    def heard(self, report: Any) -> None:
        self.events.append(f"heard {report.kind}")


def test_a_failed_install_keeps_the_replaced_detectors_listener_not_its_own(
        bare_engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Before: the replaced detector was started again (its listener re-added at the end)
    and then the listener list was cut back to its old length, dropping that listener and
    keeping the failed extension's; the next stop() logged a traceback."""
    first = _Listening()
    engine = bare_engine([first])
    engine.start("none")
    theirs: list[Any] = []

    class Fails:
        key = "fails"

        def probe(self) -> Probe:
            return Probe(True)

        def install(self, engine: Any) -> None:
            engine.add_listener(theirs.append)
            _Listening().install(engine)
            raise RuntimeError("framework not configured")

    with pytest.raises(RuntimeError, match="framework not configured"):
        engine.install(Fails())
    assert engine.detector("recording") is first
    engine.simulate_snapshot()
    assert first.events[-1] == "heard snapshot" and theirs == []
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        engine.stop()
    assert "Traceback" not in caplog.text and "failed to stop" not in caplog.text
    assert first.events[-1] == "stop"
