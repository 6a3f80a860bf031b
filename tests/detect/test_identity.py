"""Identity detector: hostname, boot_id, machine-id changes under a test root directory."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

from detect_helpers import FakeSpecific, Recorder, hold_dead_detector_threads, wait_for

from rehydrate.detect.identity import SOURCES, IdentityDetector, read_identity


def make_root(tmp_path: Path, **values: str) -> Path:
    root = tmp_path / "root"
    for field, rel in SOURCES.items():
        if field in values:
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(values[field] + "\n")
    return root


def test_reads_the_real_identity_here():
    values = read_identity()
    assert values["hostname"]
    assert values["boot_id"] and len(values["boot_id"]) == 36
    assert IdentityDetector.probe().usable


def test_boot_id_change_is_a_restore(rehydrate_engine, tmp_path):
    root = make_root(tmp_path, hostname="pod-a", boot_id=str(uuid.uuid4()),
                     machine_id="0" * 32)
    rec = Recorder(rehydrate_engine)
    det = IdentityDetector(interval=0.02, root=root)
    rehydrate_engine.start([det])
    wait_for(lambda: det.polls >= 3)
    assert rec.calls == []

    (root / SOURCES["boot_id"]).write_text(str(uuid.uuid4()) + "\n")
    calls = rec.wait(1)
    assert (calls[0]["reason"], calls[0]["kind"], calls[0]["generation"]) == \
        ("identity", "restore", 1)

    (root / SOURCES["hostname"]).write_text("pod-b\n")
    rec.wait(2)
    assert rec.calls[1]["generation"] == 2
    assert det.changes == 2


def test_the_first_notice_runs_the_hooks_without_waiting_for_a_specific_detector(
        rehydrate_engine, tmp_path, caplog):
    """No grace (the restore-path rule): with a more specific detector running that has
    not reported, an identity change runs the hooks at once instead of giving it a
    second first — a second in which the clone would serve with its old identity."""
    root = make_root(tmp_path, hostname="pod-a")
    rec = Recorder(rehydrate_engine)
    det = IdentityDetector(interval=0.02, root=root)
    rehydrate_engine.start([FakeSpecific(), det])
    wait_for(lambda: det.polls >= 3)
    caplog.set_level(logging.DEBUG, logger="rehydrate")
    (root / SOURCES["hostname"]).write_text("pod-b\n")
    assert rec.wait(1)[0]["reason"] == "identity"
    assert not [r for r in caplog.records if "to report first" in r.getMessage()]


def test_appearing_or_vanishing_values_are_not_restores(rehydrate_engine, tmp_path):
    root = make_root(tmp_path, hostname="pod-a", boot_id="b1")
    rec = Recorder(rehydrate_engine)
    det = IdentityDetector(interval=0.02, root=root)
    rehydrate_engine.start([det])
    wait_for(lambda: det.polls >= 2)

    mid = root / SOURCES["machine_id"]
    mid.parent.mkdir(parents=True, exist_ok=True)
    mid.write_text("1" * 32 + "\n")  # appears: systemd-firstboot, not a clone
    polls = det.polls
    wait_for(lambda: det.polls >= polls + 3)
    (root / SOURCES["hostname"]).unlink()  # briefly unreadable
    polls = det.polls
    wait_for(lambda: det.polls >= polls + 3)
    (root / SOURCES["hostname"]).write_text("pod-a\n")  # back, unchanged
    polls = det.polls
    wait_for(lambda: det.polls >= polls + 3)
    assert rec.calls == []


def test_interval_from_environment(monkeypatch):
    monkeypatch.setenv("REHYDRATE_IDENTITY_INTERVAL", "7.5")
    assert IdentityDetector().interval == 7.5
    monkeypatch.setenv("REHYDRATE_IDENTITY_INTERVAL", "x")
    assert IdentityDetector().interval == 2.0


def test_a_fifo_among_the_identity_sources_is_no_value_not_a_hang(tmp_path):
    """``/etc/machine-id`` as a FIFO held ``start()`` waiting for a writer."""
    import os

    root = make_root(tmp_path, hostname="h1", boot_id="b1")
    (root / SOURCES["machine_id"]).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(root / SOURCES["machine_id"])
    assert read_identity(root) == {"hostname": "h1", "boot_id": "b1", "machine_id": None}


def test_started_again_after_its_thread_died_it_leaves_no_listener_behind(
        rehydrate_engine, tmp_path, monkeypatch):
    """start() after the thread died (without stop()) attached a new deferral and left
    the old one's report listener on the engine: one more per restart, never removed."""
    import rehydrate.detect.identity as identity
    from rehydrate.detect._util import Deferral

    def deferrals() -> int:
        return sum(isinstance(getattr(fn, "__self__", None), Deferral)
                   for fn in rehydrate_engine._listeners)

    root = make_root(tmp_path, hostname="pod-a", boot_id="b1", machine_id="0" * 32)
    det = IdentityDetector(interval=0.02, root=root)
    let_go = hold_dead_detector_threads(monkeypatch)  # start() meets it still finishing
    rehydrate_engine.start([det])
    assert deferrals() == 1

    real = identity.read_identity

    def broken(root: object = "/") -> dict[str, str | None]:
        raise RuntimeError("unreadable")

    monkeypatch.setattr(identity, "read_identity", broken)
    wait_for(lambda: det.failure() is not None, what="the detector thread to die")
    monkeypatch.setattr(identity, "read_identity", real)

    for _ in range(3):
        det.start(rehydrate_engine)
        assert det.failure() is None
        assert deferrals() == 1
    let_go.set()
    rec = Recorder(rehydrate_engine)
    (root / SOURCES["boot_id"]).write_text("b2\n")
    assert [c["reason"] for c in rec.wait(1)] == ["identity"]
    rehydrate_engine.stop()
    assert deferrals() == 0
