"""start("auto") picks what is usable here; doctor names every detector with a reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from detect_helpers import REPO, wait_for

from detect.test_vmclock import FakeVmClock
from rehydrate.detect import available, catalogue_keys, load, select
from rehydrate.detect.clock_jump import ClockJumpDetector
from rehydrate.detect.file import FileDetector
from rehydrate.detect.identity import IdentityDetector
from rehydrate.detect.signal import SignalDetector
from rehydrate.detect.vmclock import VmClockDetector

INTERVAL = 60.0

GENERIC = ("clock-jump", "identity", "vmclock", "signal", "file", "snapstart")


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch):  # type: ignore[no-untyped-def]
    for name in ("REHYDRATE_MARKER_FILE", "REHYDRATE_VMCLOCK_PATH"):
        monkeypatch.delenv(name, raising=False)


def test_catalogue_has_every_generic_detector():
    for name in GENERIC:
        cls = load(name)
        assert cls.key == name
        assert (cls.__doc__ or "").strip()


def test_auto_picks_what_is_usable_here(rehydrate_engine, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_LAMBDA_FUNCTION_NAME", raising=False)
    monkeypatch.delenv("AWS_LAMBDA_INITIALIZATION_TYPE", raising=False)
    names = [d.key for d in select("auto")]
    assert {"clock-jump", "identity"} <= set(names)
    assert "snapstart" not in names  # importable here, but this is not Lambda
    assert "signal" not in names  # usable, but off unless asked for
    assert "file" not in names  # no marker file configured
    if not os.path.exists("/dev/vmclock0"):
        assert "vmclock" not in names

    monkeypatch.setenv("REHYDRATE_MARKER_FILE", str(tmp_path / "marker"))
    monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(FakeVmClock(tmp_path / "vmclock0").path))
    monkeypatch.setenv("AWS_LAMBDA_INITIALIZATION_TYPE", "snap-start")
    running = rehydrate_engine.start("auto")
    try:
        assert {"clock-jump", "identity", "snapstart", "file", "vmclock"} <= set(running)
        assert set(running) == set(rehydrate_engine.status().detectors)
    finally:
        rehydrate_engine.stop()
    assert rehydrate_engine.status().detectors == ()


def test_explicit_unusable_detector_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="file is not usable here: REHYDRATE_MARKER_FILE"):
        select(["file"])


def test_an_unusable_detector_instance_is_refused_as_its_key_is(rehydrate_engine):
    """An instance skipped the probe: started and listed as running on a host without
    what it listens to, where the same detector by key raised."""
    from rehydrate.detect import Detector
    from rehydrate.extensions import Probe

    class Doorbell(Detector):
        key = "doorbell"
        started = 0

        @classmethod
        def probe(cls) -> Probe:
            return Probe(False, "no doorbell here")

        def start(self, engine):
            type(self).started += 1

        def stop(self):
            pass

    with pytest.raises(RuntimeError, match="detector doorbell is not usable here: no doorbell"):
        select([Doorbell()])
    with pytest.raises(RuntimeError, match="detector doorbell is not usable here"):
        rehydrate_engine.start(detectors=["clock-jump", Doorbell()])
    assert Doorbell.started == 0 and rehydrate_engine.status().detectors == ()
    rehydrate_engine.start(detectors="none")
    with pytest.raises(RuntimeError, match="detector doorbell is not usable here"):
        rehydrate_engine.start(detectors=[Doorbell()])  # a later call: the same check
    assert Doorbell.started == 0
    rehydrate_engine.stop()


def test_a_detector_instance_with_its_own_path_is_probed_on_that_path(tmp_path,
                                                                      monkeypatch):
    """The class probe reads the environment; an instance given a path answers for it."""
    monkeypatch.delenv("REHYDRATE_MARKER_FILE", raising=False)
    assert select([FileDetector(tmp_path / "marker")])  # no REHYDRATE_MARKER_FILE needed
    with pytest.raises(RuntimeError, match="file is not usable here: the marker file's "
                                           "directory .*missing does not exist"):
        select([FileDetector(tmp_path / "missing" / "marker")])
    # a device of its own is checked by its start(), which reports to status() as before
    assert select([VmClockDetector(str(tmp_path / "absent"))])


def test_available_gives_every_detector_a_reason():
    infos = {i.name: i for i in available()}
    assert set(infos) == set(catalogue_keys())
    for info in infos.values():
        assert info.reason, info
    assert infos["clock-jump"].usable and infos["clock-jump"].auto
    assert infos["signal"].usable and "off unless asked" in infos["signal"].reason
    assert not infos["file"].usable and "REHYDRATE_MARKER_FILE" in infos["file"].reason


def _doctor(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("REHYDRATE_MARKER_FILE", None)
    env.pop("REHYDRATE_VMCLOCK_PATH", None)
    out = subprocess.run([sys.executable, "-m", "rehydrate", "doctor", *args],
                         capture_output=True, text=True, env=env, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_doctor_names_every_detector_and_why():
    text = _doctor()
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    for name in catalogue_keys():
        assert name in lines, text
    assert "no /dev/vmclock0" in lines["vmclock"] or os.path.exists("/dev/vmclock0")
    assert "REHYDRATE_MARKER_FILE is not set" in lines["file"]
    assert "off unless asked for" in lines["signal"]

    data = json.loads(_doctor("--json"))
    by_name = {d["name"]: d for d in data["detectors"]}
    assert set(by_name) == set(catalogue_keys())
    assert all(d["reason"] for d in by_name.values())


def test_auto_detectors_stop_without_waiting_out_their_interval(rehydrate_engine,
                                                                 monkeypatch):
    """stop() wakes the detector threads instead of waiting for their next check: with
    checks 60 s apart, a detector that slept its interval out would hold stop() for a
    minute."""
    for name in ("REHYDRATE_CLOCK_INTERVAL", "REHYDRATE_IDENTITY_INTERVAL",
                 "REHYDRATE_VMCLOCK_INTERVAL", "REHYDRATE_WATCH_INTERVAL"):
        monkeypatch.setenv(name, str(INTERVAL))
    t0 = time.monotonic()
    started = rehydrate_engine.start("auto")
    assert "clock-jump" in started, started
    rehydrate_engine.stop()
    assert not rehydrate_engine.status().detectors
    assert time.monotonic() - t0 < INTERVAL / 2


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: FileDetector("/tmp/m", window="x"), TypeError,
     "window must be a number of seconds >= 0 and at most 31536000 (a year), not str"),
    (lambda: FileDetector("/tmp/m", window=-1), ValueError, "window must be a number"),
    (lambda: FileDetector("/tmp/m", kind="bogus"), ValueError,
     "kind must be 'restore' or 'resume', not 'bogus'"),
    (lambda: SignalDetector(kind="bogus"), ValueError, "kind must be 'restore' or 'resume'"),
    (lambda: SignalDetector(window=float("nan")), ValueError, "window must be a number"),
    (lambda: IdentityDetector(grace="x"), TypeError, "grace must be a number of seconds"),
    (lambda: ClockJumpDetector(grace=-1), ValueError, "grace must be a number of seconds"),
    (lambda: ClockJumpDetector(interval="1"), TypeError, "interval must be a number"),
    (lambda: ClockJumpDetector(interval=True), TypeError, "interval must be a number"),
])
def test_bad_detector_arguments_are_refused_when_constructed(make, error, message):
    """Accepted, they failed later in the detector's thread: every change logged "running
    the restore hooks failed" with a TypeError, or the identity thread died, or the hooks
    ran as kind "bogus" without a new generation."""
    with pytest.raises(error) as caught:
        make()
    assert message in str(caught.value)


def test_restore_detected_refuses_an_unknown_kind(rehydrate_engine):
    with pytest.raises(ValueError, match="kind must be 'restore' or 'resume', not 'bogus'"):
        rehydrate_engine.restore_detected("test", kind="bogus")
    assert rehydrate_engine.generation == 0 and rehydrate_engine.is_ready()


def test_a_configured_detector_that_cannot_work_is_a_loud_error_not_absent(
        rehydrate_engine, tmp_path, monkeypatch):
    """REHYDRATE_MARKER_FILE in a directory that does not exist, or REHYDRATE_VMCLOCK_PATH
    at something that is no vmclock: start("auto") left both out without a word."""
    monkeypatch.setenv("REHYDRATE_MARKER_FILE", str(tmp_path / "missing" / "marker"))
    garbage = tmp_path / "vmclock"
    garbage.write_bytes(b"not a vmclock structure")
    monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(garbage))
    started = rehydrate_engine.start("auto")
    assert "file" not in started and "vmclock" not in started
    errors = rehydrate_engine.status().to_dict()["detector_errors"]
    assert f"the marker file's directory {tmp_path / 'missing'} does not exist" in \
        errors["file"]
    assert "not a vmclock structure" in errors["vmclock"]


def test_a_detector_whose_thread_died_is_shown_in_status(rehydrate_engine, tmp_path):
    """A detector thread that dies logs the exception once; status() kept listing the
    detector as if it still watched."""
    det = IdentityDetector(interval=0.01, root=tmp_path)

    def broken(stop):
        raise RuntimeError("cannot read the identity")

    det._loop = broken  # what any unexpected error in the loop does
    assert rehydrate_engine.start([det]) == ["identity"]
    wait_for(lambda: not det._thread.alive, what="the thread to end")
    errors = rehydrate_engine.status().to_dict()["detector_errors"]
    assert errors == {"identity": "its thread died: RuntimeError: cannot read the identity"}
    rehydrate_engine.stop()
    assert "detector_errors" not in rehydrate_engine.status().to_dict()


def test_a_key_string_or_instance_listed_twice_is_selected_once_the_first_wins(caplog):
    first, second = ClockJumpDetector(interval=INTERVAL), ClockJumpDetector(interval=INTERVAL)
    assert [type(d) for d in select("clock-jump, clock-jump")] == [ClockJumpDetector]
    assert select([first, second, first]) == [first, second]
    assert [r.getMessage() for r in caplog.records] == [
        "detectors: clock-jump listed more than once; each starts once (the first listed)"
    ] * 2


@pytest.mark.parametrize("later", [False, True], ids=["first-start", "later-start"])
def test_the_same_instance_twice_starts_once_two_instances_both(rehydrate_engine, caplog,
                                                                later):
    """The same instance listed twice starts once; two instances with one key are two
    detectors (configured differently, they watch different things) and both start."""
    import threading

    first, second = ClockJumpDetector(interval=INTERVAL), ClockJumpDetector(interval=INTERVAL)
    if later:
        rehydrate_engine.start("none")
    try:
        assert rehydrate_engine.start([first, first, second]) == ["clock-jump", "clock-jump"]
        assert rehydrate_engine.detector("clock-jump") is first
        assert [t.name for t in threading.enumerate()].count("rehydrate-clock-jump") == 2
        assert caplog.text.count("clock-jump listed more than once") == 1
    finally:
        rehydrate_engine.stop()


@pytest.mark.parametrize(("spec", "message"), [
    (5, "detectors must be 'auto', 'none', detector keys .* not int$"),
    (None, "detectors must be .* not NoneType$"),
    (b"signal", "detectors must be .* not bytes$"),
    (["clock-jump", 5], r"detectors: each entry must be a detector key \(str\) or a "
                        r"Detector instance, not int \(5\)$"),
])
def test_a_detectors_argument_of_another_type_is_a_type_error_naming_it(
        rehydrate_engine, spec, message):
    """``start(5)`` raised ``TypeError: 'int' object is not iterable``, naming nothing."""
    with pytest.raises(TypeError, match=message):
        rehydrate_engine.start(spec)
    assert not rehydrate_engine.started
    rehydrate_engine.start("none")
    with pytest.raises(TypeError, match=message):
        rehydrate_engine.start(spec)  # a later call: the same check
    assert rehydrate_engine.status().detectors == ()
    rehydrate_engine.stop()
