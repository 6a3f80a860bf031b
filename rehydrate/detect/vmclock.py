"""vmclock detector: the hypervisor's ``vm_generation_counter`` in ``/dev/vmclock0``.

Linux's ``ptp_vmclock`` driver (6.13+) exposes the hypervisor's vmclock page as
``/dev/vmclock0`` (``read()``/``pread()`` return a consistent copy, ``mmap`` maps it). The
structure is ``struct vmclock_abi`` from ``include/uapi/linux/vmclock-abi.h``; when its
flag ``VMCLOCK_FLAG_VM_GEN_COUNTER_PRESENT`` (bit 8) is set, the hypervisor changes
``vm_generation_counter`` (the little-endian u64 at byte offset 104) every time the VM
is loaded from a snapshot — Firecracker does. Live migration only changes
``disruption_marker``, which this detector ignores: migration is not a clone.

Waiting: when the device also sets ``VMCLOCK_FLAG_NOTIFICATION_PRESENT`` (bit 9, newer
kernels and hypervisors), ``poll()`` reports ``POLLIN`` once ``seq_count`` changed since
this descriptor's last read, so the thread blocks in ``poll()`` and costs nothing while
waiting. Otherwise (older kernels return ``POLLHUP``; a regular file is always
"readable") it re-reads the 112-byte structure every ``interval`` seconds (default 0.5).

Configuration: ``REHYDRATE_VMCLOCK_PATH`` (default ``/dev/vmclock0``),
``REHYDRATE_VMCLOCK_INTERVAL``. A regular file standing in for the device (tests, a
wrapper that mirrors the page) must be rewritten in place: the detector keeps the one
descriptor it opened, as it does the device's, so a file replaced by rename (write a
temporary file, then ``os.replace()``) is never read again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .. import _config
from .._contract import Probe, refuse_another_engine
from .._threads import fresh_lock_after_fork
from . import Detector, probe_of
from ._util import DEFAULT_WINDOW, DetectorThread, thread_failure

if TYPE_CHECKING:
    from ..extensions import Engine

__all__ = [
    "FLAG_NOTIFICATION_PRESENT",
    "FLAG_VM_GEN_COUNTER_PRESENT",
    "LAYOUT",
    "MAGIC",
    "VmClock",
    "VmClockDetector",
    "VmClockError",
    "default_path",
    "read_vmclock",
]

log = logging.getLogger("rehydrate")

DEFAULT_PATH: str = _config.default("REHYDRATE_VMCLOCK_PATH")
DEFAULT_INTERVAL: float = _config.default("REHYDRATE_VMCLOCK_INTERVAL")
TICK = 60.0
"""In poll mode, wake this often anyway to refresh the de-duplication reference time."""

MAGIC = 0x4B4C4356  # "VCLK"
"""``struct vmclock_abi``'s ``magic``: a page that does not start with it is no vmclock."""
FLAG_VM_GEN_COUNTER_PRESENT = 1 << 8
"""``flags`` bit: the hypervisor maintains ``vm_generation_counter``."""
FLAG_NOTIFICATION_PRESENT = 1 << 9
"""``flags`` bit: the device notifies (``poll()``) when the counter changes."""

# struct vmclock_abi, little endian, 112 bytes:
#   0 magic u32, 4 size u32, 8 version u16, 10 counter_id u8, 11 time_type u8,
#  12 seq_count u32, 16 disruption_marker u64, 24 flags u64, 32 pad[2],
#  34 clock_status u8, 35 leap_second_smearing_hint u8, 36 tai_offset_sec s16,
#  38 leap_indicator u8, 39 counter_period_shift u8, 40 counter_value u64,
#  48 counter_period_frac_sec u64, 56 …esterror_rate u64, 64 …maxerror_rate u64,
#  72 time_sec u64, 80 time_frac_sec u64, 88 time_esterror_nanosec u64,
#  96 time_maxerror_nanosec u64, 104 vm_generation_counter u64.
LAYOUT = struct.Struct("<IIHBBIQQ2sBBhBBQQQQQQQQQ")
"""The 112 bytes of ``struct vmclock_abi`` as read from the device (little endian)."""
assert LAYOUT.size == 112
GENERATION_OFFSET = 104


class VmClockError(OSError):
    """The file is not a usable vmclock structure."""


@dataclass(frozen=True)
class VmClock:
    """The fields of one consistent read of ``struct vmclock_abi`` that the detector uses."""

    magic: int
    size: int
    version: int
    seq_count: int
    disruption_marker: int
    flags: int
    vm_generation_counter: int

    @property
    def has_generation(self) -> bool:
        return bool(self.flags & FLAG_VM_GEN_COUNTER_PRESENT) and self.size >= LAYOUT.size

    @property
    def notifies(self) -> bool:
        return bool(self.flags & FLAG_NOTIFICATION_PRESENT)


def default_path() -> str:
    """``$REHYDRATE_VMCLOCK_PATH``, else ``/dev/vmclock0``."""
    return _config.text("REHYDRATE_VMCLOCK_PATH") or DEFAULT_PATH


def _parse(data: bytes) -> VmClock:
    if len(data) < LAYOUT.size:
        raise VmClockError(f"short read: {len(data)} bytes, struct vmclock_abi has "
                           f"{LAYOUT.size}")
    f = LAYOUT.unpack_from(data)
    clock = VmClock(magic=f[0], size=f[1], version=f[2], seq_count=f[5],
                    disruption_marker=f[6], flags=f[7], vm_generation_counter=f[-1])
    if clock.magic != MAGIC:
        raise VmClockError(f"bad magic 0x{clock.magic:08x} (want 0x{MAGIC:08x} 'VCLK')")
    if clock.version != 1:
        raise VmClockError(f"unknown vmclock version {clock.version}")
    return clock


def _read_fd(fd: int, attempts: int = 1000) -> VmClock:
    """One consistent copy (``seq_count`` even and unchanged across the copy)."""
    for _ in range(attempts):
        first = _parse(os.pread(fd, LAYOUT.size, 0))
        if first.seq_count & 1:
            continue  # an update is in progress
        again = os.pread(fd, 4, 12)
        if len(again) == 4 and struct.unpack("<I", again)[0] == first.seq_count:
            return first
    raise VmClockError("seq_count never settled (update in progress)")


def _open(path: str) -> int:
    """Open the device (or a regular file standing in for it) without blocking: a FIFO
    at the configured path would otherwise hold ``doctor`` and ``start()`` for ever."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISCHR(mode) or stat.S_ISREG(mode)):
        os.close(fd)
        raise VmClockError("not a character device or regular file")
    return fd


def read_vmclock(path: str | None = None) -> VmClock:
    """Read and validate the vmclock structure at ``path`` (default: the device)."""
    fd = _open(path or default_path())
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


class VmClockDetector(Detector):
    """vmclock: the hypervisor bumped vm_generation_counter in /dev/vmclock0."""

    key: ClassVar[str] = "vmclock"
    specificity: ClassVar[int] = 80
    auto: ClassVar[bool] = True

    def __init__(self, path: str | None = None, interval: float | None = None) -> None:
        self._path_arg = path
        self.path = path or default_path()
        self.interval = _config.seconds(
            interval if interval is not None
            else _config.number("REHYDRATE_VMCLOCK_INTERVAL"),
            "interval")
        self.mode = "stopped"
        """``poll`` (kernel notifications), ``interval`` (re-reading) or ``stopped``."""
        self.generation: int | None = None
        self.reads = 0
        self.read_failures = 0
        self._engine: Engine | None = None
        self._thread: DetectorThread | None = None
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._fd: int | None = None
        """The device descriptor the thread reads (it closes it when it ends)."""
        self._pid = 0
        """The process that started the thread (a child of fork() has not got it)."""
        self._lock = threading.Lock()
        # a parent thread may hold it at fork() (a start() or stop()): the child's start()
        # of an installed instance waited for it for ever
        fresh_lock_after_fork(self)

    @classmethod
    def probe(cls) -> Probe:
        why = cls._probe_path(default_path())
        return Probe(why is None, why or "")

    def probe_instance(self) -> Probe:
        if self._path_arg is None:
            return probe_of(type(self))
        # A device of its own is checked by start(), loudly (status detector_errors).
        return Probe(True, f"checked when started: {self.path}")

    @staticmethod
    def _probe_path(path: str) -> str | None:
        if not os.path.exists(path):
            return (f"no {path} (needs a hypervisor with a vmclock device, e.g. Firecracker, "
                    "and the Linux ptp_vmclock driver, 6.13+)")
        try:
            clock = read_vmclock(path)
        except VmClockError as exc:
            return f"{path} is not a vmclock structure: {exc}"
        except OSError as exc:
            return f"cannot read {path}: {exc.strerror or exc}"
        if clock.size < LAYOUT.size:
            return (f"{path}: the structure is {clock.size} bytes, too short to hold "
                    f"vm_generation_counter ({LAYOUT.size} needed)")
        if not clock.has_generation:
            return (f"{path}: the hypervisor does not provide vm_generation_counter "
                    "(VMCLOCK_FLAG_VM_GEN_COUNTER_PRESENT unset)")
        return None

    def failure(self) -> str | None:
        return thread_failure(self._thread)

    @classmethod
    def configured(cls) -> bool:
        # another path than the default device: someone meant this detector to run
        return bool(_config.text("REHYDRATE_VMCLOCK_PATH") != DEFAULT_PATH)

    def describe(self) -> str:
        return f"watches vm_generation_counter in {self.path} ({self.mode})"

    def start(self, engine: Engine) -> None:
        with self._lock:
            if self._thread is not None and self._thread.alive:
                refuse_another_engine(self, self._engine, engine)
                return
            self._forget_parents()  # started directly in a child, not through an engine
            why = self._probe_path(self.path)
            if why is not None:
                raise RuntimeError(why)
            fd = _open(self.path)
            try:
                clock = _read_fd(fd)
                notify = clock.notifies and stat.S_ISCHR(os.fstat(fd).st_mode)
            except BaseException:
                os.close(fd)
                raise
            self._engine = engine
            self.generation = clock.vm_generation_counter
            # Started again after its thread died, without stop(): that thread's wake-up
            # pipe is still open (two descriptors leaked per restart).
            for old in (self._wake_r, self._wake_w):
                if old is not None:
                    os.close(old)
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self.mode = "poll" if notify else "interval"
            self._fd, self._pid = fd, os.getpid()
            self._thread = DetectorThread("rehydrate-vmclock",
                                          lambda stop: self._loop(stop, fd))
            self._thread.start()

    def forget_in_child(self) -> None:
        with self._lock:
            self._forget_parents()

    def _forget_parents(self) -> None:
        """In a child of fork(): the thread is the parent's; close this process's copies
        of its device descriptor and wake-up pipe (kept open for the child's life)."""
        if self._pid in (0, os.getpid()):
            return
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._wake_r = self._wake_w = None
        self._thread, self._pid, self.mode = None, 0, "stopped"

    def stop(self) -> None:
        with self._lock:
            if self._pid not in (0, os.getpid()):
                # a child of fork() (an inherited shutdown handler): nothing to wake here
                self._forget_parents()
                return
            thread, self._thread = self._thread, None
            if thread is not None:
                thread.stop_event.set()
                if self._wake_w is not None:
                    with contextlib.suppress(OSError):
                        os.write(self._wake_w, b"x")
        if thread is not None:
            thread.stop()
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                if fd is not None:
                    os.close(fd)
            self._wake_r = self._wake_w = None
            self.mode = "stopped"

    # -- the thread ------------------------------------------------------------------

    def _loop(self, stop: threading.Event, fd: int) -> None:
        try:
            last = time.monotonic()
            failing = False
            absent = False  # the hypervisor stopped providing vm_generation_counter
            poller: select.poll | None = None
            if self.mode == "poll" and self._wake_r is not None:
                poller = select.poll()
                poller.register(fd, select.POLLIN | select.POLLPRI)
                poller.register(self._wake_r, select.POLLIN)
            while not stop.is_set():
                if poller is not None:
                    events = dict(poller.poll(int(TICK * 1000)))
                    if stop.is_set():
                        return
                    if events.get(fd, 0) & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        log.info("vmclock: %s does not notify; re-reading every %gs",
                                 self.path, self.interval)
                        self.mode = "interval"
                        poller = None
                elif stop.wait(self.interval):
                    return
                try:
                    clock = _read_fd(fd)  # also re-arms poll() for this descriptor
                except OSError as exc:
                    # one warning per spell of failures, not one a second for ever
                    log.log(logging.DEBUG if failing else logging.WARNING,
                            "vmclock: cannot read %s: %s; retrying", self.path, exc)
                    failing = True
                    self.read_failures += 1
                    if stop.wait(max(self.interval, 1.0)):
                        return
                    continue
                if failing:
                    log.info("vmclock: %s is readable again", self.path)
                    failing = False
                self.reads += 1
                if not clock.has_generation:
                    # The ABI defines the counter only while the flag says it is there; a
                    # host without the feature (after a live migration) leaves it 0, and
                    # that is no new generation. The last real value stays the reference.
                    if not absent:
                        log.warning("vmclock: %s no longer provides vm_generation_counter "
                                    "(flag unset); ignoring it until it does", self.path)
                        absent = True
                    last = time.monotonic()
                    continue
                if absent:
                    log.info("vmclock: %s provides vm_generation_counter again", self.path)
                    absent = False
                gen = clock.vm_generation_counter
                if gen != self.generation:
                    previous, self.generation = self.generation, gen
                    self._report(previous, gen, since=max(last, time.monotonic() - DEFAULT_WINDOW))
                last = time.monotonic()
        finally:
            # Forgotten while still open, so that no other descriptor has its number: a
            # child forked later must not close that one as the device's copy.
            with self._lock:
                if self._fd == fd:
                    self._fd = None
            os.close(fd)

    def _report(self, previous: int | None, gen: int, since: float) -> None:
        engine = self._engine
        if engine is None:
            return
        log.info("vmclock: vm_generation_counter changed (%s -> %s)", previous, gen)
        try:
            engine.restore_detected("vmclock", kind="restore", since=since,
                                    key=f"vmclock:{gen}")
        except Exception:
            log.exception("vmclock: running the restore hooks failed")
