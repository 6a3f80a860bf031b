"""Identity detector: the machine the process runs on changed under it.

A clone restored on another node (or into another Pod) usually sees a different hostname,
kernel ``boot_id`` or ``/etc/machine-id`` than the process it was snapshotted from. A
thread reads the three every ``interval`` seconds (default 2; three small file reads, so
the idle cost is negligible) and reports a restore (reason ``identity``) when a value it
had seen changes to another value. A value appearing for the first time or vanishing is
not a restore.

This is the least specific detector, but like every detector it runs the hooks at once
when it is the first to notice (no grace): a restore another detector reports later is
recognised as the same one and only confirms it (``confirmed_by``). ``grace`` (seconds,
default 0) lets more specific running detectors report first instead, at the price of
that much time with the hooks not yet run. Caveat: renaming the host of a running
process (``hostname new``) is reported as a restore too.

Configuration: ``REHYDRATE_IDENTITY_INTERVAL`` (seconds, default 2.0); ``root`` (tests)
reads ``<root>/proc/sys/kernel/hostname`` etc. instead of the real files.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import ClassVar

from .. import _config
from .._contract import Probe
from .._files import read_regular
from ._util import DeferringDetector

__all__ = ["SOURCES", "IdentityDetector", "read_identity"]

log = logging.getLogger("rehydrate")

DEFAULT_INTERVAL: float = _config.default("REHYDRATE_IDENTITY_INTERVAL")
DEFAULT_GRACE = 0.0

SOURCES: dict[str, str] = {
    "hostname": "proc/sys/kernel/hostname",
    "boot_id": "proc/sys/kernel/random/boot_id",
    "machine_id": "etc/machine-id",
}
"""Identity field -> path relative to the root directory."""

_MAX = 4096


def read_identity(root: str | os.PathLike[str] = "/") -> dict[str, str | None]:
    """The current identity values (``None`` for a source that cannot be read)."""
    base = os.fspath(root)
    values: dict[str, str | None] = {}
    for field, rel in SOURCES.items():
        try:  # without blocking: a FIFO there must not hold start() for ever
            data = read_regular(os.path.join(base, rel), _MAX, truncate=True)
        except OSError:
            values[field] = None
        else:
            values[field] = data.decode("utf-8", "replace").strip() or None
    if values["hostname"] is None and os.path.normpath(base) == "/":
        values["hostname"] = os.uname().nodename or None
    return values


class IdentityDetector(DeferringDetector):
    """Identity: hostname, kernel boot_id or /etc/machine-id changed (polled)."""

    key: ClassVar[str] = "identity"
    specificity: ClassVar[int] = 5
    auto: ClassVar[bool] = True

    def __init__(
        self,
        interval: float | None = None,
        *,
        root: str | os.PathLike[str] = "/",
        grace: float = DEFAULT_GRACE,
    ) -> None:
        self.interval = _config.seconds(
            interval if interval is not None
            else _config.number("REHYDRATE_IDENTITY_INTERVAL"),
            "interval")
        self.root = root
        self.grace = _config.seconds(grace, "grace", zero_ok=True)
        self.changes = 0
        self.polls = 0
        self._baseline: dict[str, str | None] = {}
        super().__init__()

    @classmethod
    def probe(cls) -> Probe:
        values = read_identity()
        if not any(values.values()):
            return Probe(False, "none of hostname, /proc/sys/kernel/random/boot_id or "
                         "/etc/machine-id is readable")
        return Probe(True)

    def describe(self) -> str:
        return f"reads hostname, boot_id and machine-id every {self.interval:g}s"

    def _prepare(self) -> None:
        self._baseline = read_identity(self.root)

    def _loop(self, stop: threading.Event) -> None:
        last = time.monotonic()
        while not stop.wait(self.interval):
            current = read_identity(self.root)
            self.polls += 1
            changed = [k for k, v in current.items()
                       if v is not None and self._baseline.get(k) not in (None, v)]
            # Keep values that vanished: a file briefly unreadable is not a new identity.
            self._baseline.update({k: v for k, v in current.items() if v is not None})
            if changed:
                self._report(changed, since=last, stop=stop)
                if stop.is_set():
                    return
            last = time.monotonic()

    def _report(self, changed: list[str], since: float, stop: threading.Event) -> None:
        engine = self._engine
        if engine is None:
            return
        log.info("identity: %s changed", ", ".join(changed))
        if not self._deferral.wait(since) or stop.is_set():
            return
        self.changes += 1
        try:
            engine.restore_detected("identity", kind="restore", since=since)
        except Exception:
            log.exception("identity: running the restore hooks failed")
