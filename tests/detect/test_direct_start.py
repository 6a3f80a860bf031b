"""A built-in detector started directly (``det.start(engine)``, outside an engine's own
``start()``) refuses a second engine the way the engines do.

It used to return silently (or, for the SnapStart bridge, to bridge to both engines and
forget the first): the caller believed it now watched for the second engine while every
report went on to the first.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rehydrate import Lifecycle, Registry
from rehydrate.detect import Detector
from rehydrate.env import EnvRefresher

ELSEWHERE = "already runs on another engine"


def _vmclock_page(path: Path) -> None:
    """A regular file laid out like the vmclock page (include/uapi/linux/vmclock-abi.h)."""
    page = bytearray(4096)
    struct.pack_into("<I", page, 0, 0x4B4C4356)  # magic "VCLK"
    struct.pack_into("<I", page, 4, 4096)  # size
    struct.pack_into("<H", page, 8, 1)  # version
    page[10] = 0xFF  # counter_id: invalid
    struct.pack_into("<I", page, 12, 2)  # seq_count, even
    struct.pack_into("<Q", page, 24, 1 << 8)  # flags: VM_GENERATION_COUNTER present
    struct.pack_into("<Q", page, 104, 7)  # vm_generation_counter
    path.write_bytes(bytes(page))


def _make(key: str, tmp_path: Path, sock_dir: Path | None = None) -> Detector:
    if key == "file":
        from rehydrate.detect.file import FileDetector
        return FileDetector(str(tmp_path / "marker"), polling=True, interval=60, window=0)
    if key == "identity":
        from rehydrate.detect.identity import SOURCES, IdentityDetector
        for field, rel in SOURCES.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(f"{field}-1\n")
        return IdentityDetector(interval=60.0, root=tmp_path)
    if key == "clock-jump":
        from rehydrate.detect.clock_jump import ClockJumpDetector
        return ClockJumpDetector(interval=60.0, threshold=1.5)
    if key == "vmclock":
        from rehydrate.detect.vmclock import VmClockDetector
        _vmclock_page(tmp_path / "vmclock0")
        return VmClockDetector(str(tmp_path / "vmclock0"), interval=60.0)
    if key == "signal":
        from rehydrate.detect.signal import SignalDetector
        return SignalDetector("USR2")
    if key == "gvisor":
        from rehydrate.detect.gvisor import GVisorDetector
        (tmp_path / "gvisor").mkdir()
        os.mkfifo(tmp_path / "gvisor" / "checkpoint")
        return GVisorDetector(str(tmp_path / "gvisor"))
    if key == "control":
        from rehydrate.detect.control import ControlDetector
        assert sock_dir is not None
        return ControlDetector(str(sock_dir / "c.sock"))
    assert key == "snapstart"
    from rehydrate.detect.snapstart import SnapStartDetector
    return SnapStartDetector()


def _engine_of(det: Detector) -> Any:
    """The engine ``det`` reports to now, read from its own state."""
    if det.key == "signal":
        return det._run.engine if det._run else None  # type: ignore[attr-defined]
    if det.key == "control":
        return det.server.engine if det.server else None  # type: ignore[attr-defined]
    return det._engine  # type: ignore[attr-defined]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # AF_UNIX paths are limited to 108 bytes: pytest's tmp_path can be longer (a long
    # --basetemp), and the control socket could then not be bound at all.
    d = Path(tempfile.mkdtemp(prefix="rh-direct-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def engines() -> Iterator[Callable[[], Lifecycle]]:
    made: list[Lifecycle] = []

    def make() -> Lifecycle:
        made.append(Lifecycle(Registry(), env=EnvRefresher(path=None), extensions=[]))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.fixture
def clean_snapstart() -> Iterator[None]:
    import snapshot_restore_py as srp
    before, after = list(srp.get_before_snapshot()), list(srp.get_after_restore())
    yield
    srp.get_before_snapshot()[:] = before
    srp.get_after_restore()[:] = after


@pytest.mark.parametrize("key", ["file", "identity", "clock-jump", "vmclock", "signal",
                                 "gvisor", "control", "snapstart"])
def test_a_directly_started_detector_refuses_a_second_engine(
        key: str, tmp_path: Path, short_dir: Path, engines: Callable[[], Lifecycle],
        clean_snapstart: None) -> None:
    det = _make(key, tmp_path, short_dir)
    first, second = engines(), engines()
    det.start(first)
    try:
        with pytest.raises(RuntimeError) as refused:
            det.start(second)
        message = str(refused.value)
        assert ELSEWHERE in message and "\n" not in message
        assert type(det).__qualname__ in message
        assert _engine_of(det) is first  # still reporting to the first, untouched
        if key == "snapstart":
            from rehydrate.detect import snapstart
            assert [e for e in snapstart._engines if e is second] == []
        # The same engine again: what it did before (a no-op, or its own "already
        # running"), never the other-engine refusal.
        try:
            det.start(first)
        except RuntimeError as exc:
            assert ELSEWHERE not in str(exc)
        assert _engine_of(det) is first
    finally:
        det.stop()
    det.start(second)  # stopped: the second engine may have it now
    try:
        assert _engine_of(det) is second
    finally:
        det.stop()


def test_an_engine_starting_a_detector_started_directly_elsewhere_says_so(
        tmp_path: Path, engines: Callable[[], Lifecycle]) -> None:
    """The engine's own claim knows only detectors engines started: one started directly
    for another engine passed it, and the engine listed it as watching while every
    report went to the other. Now the detector's refusal lands in detector_errors."""
    det = _make("file", tmp_path)
    first, second = engines(), engines()
    det.start(first)
    try:
        assert second.start([det]) == []
        error = second.status().extra["detector_errors"]["file"]
        assert ELSEWHERE in error and "\n" not in error
        assert _engine_of(det) is first
    finally:
        det.stop()
