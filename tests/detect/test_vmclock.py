"""vmclock detector against a fake device: a regular file holding struct vmclock_abi.

The fake is written with explicit byte offsets from include/uapi/linux/vmclock-abi.h,
independently of the module's struct layout, so a layout mistake fails here.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from pathlib import Path

import pytest
from detect_helpers import Recorder, hold_dead_detector_threads, wait_for

from rehydrate.detect.vmclock import VmClockDetector, read_vmclock

MAGIC = 0x4B4C4356  # "VCLK"
GEN_PRESENT = 1 << 8
NOTIFY_PRESENT = 1 << 9


class FakeVmClock:
    """A page-sized file laid out like the vmclock device's page."""

    def __init__(self, path: Path, *, flags: int = GEN_PRESENT, generation: int = 7,
                 magic: int = MAGIC, version: int = 1, size: int = 4096) -> None:
        self.path = path
        page = bytearray(4096)
        struct.pack_into("<I", page, 0, magic)
        struct.pack_into("<I", page, 4, size)
        struct.pack_into("<H", page, 8, version)
        page[10] = 0xFF  # counter_id: VMCLOCK_COUNTER_INVALID
        page[11] = 0  # time_type UTC
        struct.pack_into("<I", page, 12, 2)  # seq_count (even: consistent)
        struct.pack_into("<Q", page, 16, 1)  # disruption_marker
        struct.pack_into("<Q", page, 24, flags)
        struct.pack_into("<Q", page, 104, generation)  # vm_generation_counter
        path.write_bytes(bytes(page))

    def _pwrite(self, offset: int, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def set_generation(self, value: int) -> None:
        self._pwrite(104, struct.pack("<Q", value))

    def set_disruption_marker(self, value: int) -> None:
        self._pwrite(16, struct.pack("<Q", value))

    def set_seq(self, value: int) -> None:
        self._pwrite(12, struct.pack("<I", value))

    def set_flags(self, value: int) -> None:
        self._pwrite(24, struct.pack("<Q", value))


def test_reads_vm_generation_counter_at_its_abi_offset(tmp_path):
    fake = FakeVmClock(tmp_path / "vmclock0", generation=0x1122334455667788,
                       flags=GEN_PRESENT | NOTIFY_PRESENT)
    clock = read_vmclock(str(fake.path))
    assert clock.vm_generation_counter == 0x1122334455667788
    assert clock.disruption_marker == 1
    assert clock.seq_count == 2
    assert clock.has_generation and clock.notifies


def test_probe_explains_why_not(tmp_path, monkeypatch):
    monkeypatch.delenv("REHYDRATE_VMCLOCK_PATH", raising=False)
    if not os.path.exists("/dev/vmclock0"):
        assert "no /dev/vmclock0" in VmClockDetector.probe().reason

    monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(tmp_path / "missing"))
    assert "no " in VmClockDetector.probe().reason

    FakeVmClock(tmp_path / "bad", magic=0x12345678)
    monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(tmp_path / "bad"))
    assert "bad magic" in VmClockDetector.probe().reason

    FakeVmClock(tmp_path / "v2", version=2)
    monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(tmp_path / "v2"))
    assert "version 2" in VmClockDetector.probe().reason

    FakeVmClock(tmp_path / "nogen", flags=0)
    monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(tmp_path / "nogen"))
    assert "VMCLOCK_FLAG_VM_GEN_COUNTER_PRESENT" in VmClockDetector.probe().reason

    FakeVmClock(tmp_path / "small", size=64)  # the flag set, the structure too short
    monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(tmp_path / "small"))
    assert "the structure is 64 bytes, too short" in VmClockDetector.probe().reason

    os.mkfifo(tmp_path / "fifo")  # opening it blocked doctor and start() for ever
    monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(tmp_path / "fifo"))
    assert "not a character device or regular file" in VmClockDetector.probe().reason
    with pytest.raises(OSError, match="not a character device or regular file"):
        read_vmclock(str(tmp_path / "fifo"))

    (tmp_path / "short").write_bytes(b"VCLK")
    monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(tmp_path / "short"))
    assert "short read" in VmClockDetector.probe().reason

    FakeVmClock(tmp_path / "good")
    monkeypatch.setenv("REHYDRATE_VMCLOCK_PATH", str(tmp_path / "good"))
    assert VmClockDetector.probe().usable


def test_generation_change_is_a_restore(rehydrate_engine, tmp_path):
    # NOTIFY_PRESENT on a regular file: poll() would always say "readable", so the
    # detector must fall back to re-reading at its interval.
    fake = FakeVmClock(tmp_path / "vmclock0", flags=GEN_PRESENT | NOTIFY_PRESENT)
    rec = Recorder(rehydrate_engine)
    det = VmClockDetector(str(fake.path), interval=0.02)
    rehydrate_engine.start([det])
    assert det.mode == "interval"
    wait_for(lambda: det.reads >= 3)
    assert rec.calls == []

    fake.set_disruption_marker(2)  # live migration: not a clone
    reads = det.reads
    wait_for(lambda: det.reads >= reads + 3)
    assert rec.calls == []

    fake.set_generation(8)
    calls = rec.wait(1)
    assert (calls[0]["reason"], calls[0]["kind"], calls[0]["generation"]) == \
        ("vmclock", "restore", 1)

    fake.set_seq(3)  # update in progress: the detector must not act on a torn copy
    fake.set_generation(9)
    reads = det.reads
    with pytest.raises(AssertionError):
        wait_for(lambda: det.reads > reads, timeout=0.3)
    fake.set_seq(4)
    rec.wait(2)
    assert rec.calls[1]["generation"] == 2
    assert det.generation == 9

    rehydrate_engine.stop()
    assert det.mode == "stopped"


def test_start_refuses_a_file_without_generation_counter(rehydrate_engine, tmp_path):
    fake = FakeVmClock(tmp_path / "vmclock0", flags=0)
    assert rehydrate_engine.start([VmClockDetector(str(fake.path))]) == []  # logged, skipped


def test_a_device_that_stops_reading_well_is_one_warning_not_one_a_second(
        rehydrate_engine, tmp_path, caplog):
    fake = FakeVmClock(tmp_path / "vmclock0")
    det = VmClockDetector(str(fake.path), interval=0.001)
    rehydrate_engine.start([det])
    wait_for(lambda: det.reads >= 1)
    good = fake.path.read_bytes()
    with caplog.at_level(logging.DEBUG, logger="rehydrate"):
        fake.path.write_bytes(b"VCLK")  # truncated: every read fails
        wait_for(lambda: det.read_failures >= 3, timeout=15)
        reads = det.reads
        fake.path.write_bytes(good)
        wait_for(lambda: det.reads > reads, timeout=15)
    failures = [r for r in caplog.records if "vmclock: cannot read" in r.getMessage()]
    assert [r.levelno for r in failures][:3] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert any(f"{fake.path} is readable again" in r.getMessage() for r in caplog.records)


def test_a_counter_without_its_present_flag_is_no_restore(rehydrate_engine, tmp_path, caplog):
    """vm_generation_counter means something only while VMCLOCK_FLAG_VM_GEN_COUNTER_PRESENT
    is set (vmclock-abi.h): a host without the feature — after a live migration — leaves
    the field 0. That, and the flag coming back with the value from before, are not
    restores; a different value once the flag is back is one."""
    fake = FakeVmClock(tmp_path / "vmclock0", generation=7)
    rec = Recorder(rehydrate_engine)
    det = VmClockDetector(str(fake.path), interval=0.01)
    rehydrate_engine.start([det])
    wait_for(lambda: det.reads >= 2)

    with caplog.at_level(logging.INFO, logger="rehydrate"):
        fake.set_flags(0)
        fake.set_generation(0)
        reads = det.reads
        wait_for(lambda: det.reads >= reads + 5)
        assert rec.calls == []
        fake.set_generation(7)
        fake.set_flags(GEN_PRESENT)
        reads = det.reads
        wait_for(lambda: det.reads >= reads + 5)
        assert rec.calls == []
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no longer provides vm_generation_counter" in m for m in messages) == 1
    assert any("provides vm_generation_counter again" in m for m in messages)

    fake.set_generation(8)
    assert [(c["reason"], c["generation"]) for c in rec.wait(1)] == [("vmclock", 1)]


def test_started_again_after_its_thread_died_it_leaks_no_descriptor(rehydrate_engine,
                                                                    tmp_path, monkeypatch):
    """start() after the thread died (without stop()) opened a new wake-up pipe over the
    old one: two descriptors leaked per restart."""
    import rehydrate.detect.vmclock as vmclock

    fake = FakeVmClock(tmp_path / "vmclock0")
    det = VmClockDetector(str(fake.path), interval=0.01)
    let_go = hold_dead_detector_threads(monkeypatch)  # start() meets it still finishing
    rehydrate_engine.start([det])
    real = vmclock._read_fd
    started = threading.Event()

    def broken(fd: int) -> object:
        if started.is_set():
            raise RuntimeError("garbled")
        return real(fd)

    monkeypatch.setattr(vmclock, "_read_fd", broken)
    fds = len(os.listdir("/proc/self/fd"))  # the thread's own device descriptor included
    started.set()
    wait_for(lambda: det.failure() is not None, what="the detector thread to die")
    started.clear()
    for _ in range(3):
        det.start(rehydrate_engine)
        wait_for(lambda: det.reads > 0 and det.failure() is None)
        assert len(os.listdir("/proc/self/fd")) == fds
        started.set()
        wait_for(lambda: det.failure() is not None, what="the detector thread to die")
        started.clear()
    let_go.set()
    rehydrate_engine.stop()
