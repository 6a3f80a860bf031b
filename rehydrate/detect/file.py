"""Marker-file detector: a file the platform (re)writes on restore changed.

Some platforms (Modal-style memory snapshots) or wrappers announce a restore by writing a
state file; any platform that mounts files can do it from a post-restore step. Name the
file in ``REHYDRATE_MARKER_FILE``; when it appears, or its content, size, inode or
modification time change, that is a restore (reason ``file``). Deleting it is not.

The directory holding the file is watched with watchdog (imported on first use):
inotify natively, and a polling observer under gVisor, where inotify does not see
changes made to a bind mount from outside the sandbox. ``REHYDRATE_WATCH_POLLING=1``
forces polling (other container runtimes, network file systems), ``=0`` forces inotify;
``REHYDRATE_WATCH_INTERVAL`` is the polling interval (default 0.5 s). The polling
observer lists only the marker's own entry of the directory, so its cost does not grow
with the directory.

A burst of writes (truncate, then write) is one notice: a restore handled in the
``window`` seconds before the change (default 2, ``REHYDRATE_MARKER_WINDOW``) is taken to
be the same restore. ``REHYDRATE_MARKER_KIND``: ``restore`` (default) or ``resume``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .. import _config
from .._contract import Probe
from .._files import READ_ONLY_EVENTS, open_regular
from .._gvisor import running_under_gvisor
from . import Detector
from ._util import checked_kind, env_kind, positive

if TYPE_CHECKING:
    from ..extensions import Engine

__all__ = ["FileDetector", "marker_state"]

log = logging.getLogger("rehydrate")

DEFAULT_INTERVAL: float = _config.default("REHYDRATE_WATCH_INTERVAL")
_READ_LIMIT = 1 << 20

State = tuple[int, int, int, str] | None
"""(inode, size, mtime_ns, sha256 of the first MiB) or None when the file is absent."""


def marker_state(path: str) -> State:
    """The marker's identity and content hash; None when absent or not a regular file.

    Opened without blocking and only when regular: a FIFO put at the path must not hold
    the detector thread for ever.
    """
    import hashlib  # here, not at import: start("auto") imports every detector to probe

    try:
        fd = open_regular(path)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            digest = hashlib.sha256(f.read(_READ_LIMIT)).hexdigest()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.debug("marker file %s unreadable: %s", path, exc)
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, digest)


class FileDetector(Detector):
    """File: the marker file in REHYDRATE_MARKER_FILE changed (watchdog)."""

    key: ClassVar[str] = "file"
    specificity: ClassVar[int] = 50
    auto: ClassVar[bool] = True

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        polling: bool | None = None,
        interval: float | None = None,
        kind: Literal["restore", "resume"] | None = None,
        window: float | None = None,
    ) -> None:
        raw = os.fspath(path) if path is not None else _config.text("REHYDRATE_MARKER_FILE")
        if not raw:
            raise ValueError("no marker file: pass path= or set REHYDRATE_MARKER_FILE")
        self.path = os.path.abspath(raw)
        if polling is None:
            polling = _config.flag("REHYDRATE_WATCH_POLLING")
        self.polling = running_under_gvisor() if polling is None else polling
        self.interval = positive(
            interval if interval is not None
            else _config.number("REHYDRATE_WATCH_INTERVAL"),
            "interval")
        self.kind: Literal["restore", "resume"] = (
            checked_kind(kind) if kind is not None else env_kind("REHYDRATE_MARKER_KIND"))
        self.window = positive(window if window is not None
                               else _config.number("REHYDRATE_MARKER_WINDOW"), "window",
                               zero_ok=True)
        self.changes = 0
        self.checks = 0
        self._state: State = None
        self._engine: Engine | None = None
        self._observer: Any = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()

    @classmethod
    def probe(cls) -> Probe:
        path = _config.text("REHYDRATE_MARKER_FILE")
        if not path:
            return Probe(False, "REHYDRATE_MARKER_FILE is not set (name the file your "
                         "platform writes on restore)")
        if importlib.util.find_spec("watchdog") is None:
            return Probe(False, "the watchdog package is not installed")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return Probe(False, f"the marker file's directory {parent} does not exist")
        return Probe(True)

    def describe(self) -> str:
        how = f"polling every {self.interval:g}s" if self.polling else "inotify"
        return f"watches {self.path} ({how})"

    def start(self, engine: Engine) -> None:
        with self._lock:
            if self._worker is not None:
                return
            parent = os.path.dirname(self.path)
            if not os.path.isdir(parent):
                raise RuntimeError(f"the marker file's directory {parent} does not exist")
            self._engine = engine
            self._state = marker_state(self.path)
            self._stopping.clear()
            self._wake.clear()
            observer = self._make_observer(parent)
            observer.start()
            self._observer = observer
            self._worker = threading.Thread(target=self._work, name="rehydrate-marker-file",
                                            daemon=True)
            self._worker.start()

    def stop(self) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
            observer, self._observer = self._observer, None
            self._stopping.set()
            self._wake.set()
        if observer is not None:
            observer.stop()
            observer.join(5.0)
        if worker is not None:
            worker.join(5.0)

    def _make_observer(self, parent: str) -> Any:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler

        target = self.path
        wake = self._wake

        class _Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in READ_ONLY_EVENTS:
                    return
                paths = (event.src_path, getattr(event, "dest_path", ""))
                if any(os.fsdecode(p) == target for p in paths if p):
                    wake.set()

        observer: Any
        if self.polling:
            from watchdog.observers.polling import PollingObserverVFS

            name = os.path.basename(self.path)

            def only_marker(directory: str | None) -> Iterator[os.DirEntry[str]]:
                with os.scandir(directory) as entries:
                    return iter([e for e in entries if e.name == name])

            observer = PollingObserverVFS(os.stat, only_marker,
                                          polling_interval=self.interval)
        else:
            from watchdog.observers import Observer

            observer = Observer()
        observer.schedule(_Handler(), parent, recursive=False)
        observer.name = "rehydrate-marker-watch"
        observer.daemon = True
        return observer

    def _work(self) -> None:
        while True:
            self._wake.wait()
            if self._stopping.is_set():
                return
            self._wake.clear()
            noticed = time.monotonic()
            state = marker_state(self.path)
            self.checks += 1
            previous, self._state = self._state, state
            if state is None or state == previous:
                continue
            self.changes += 1
            engine = self._engine
            if engine is None:
                continue
            log.info("marker file %s %s", self.path,
                     "appeared" if previous is None else "changed")
            try:
                engine.restore_detected("file", kind=self.kind, since=noticed - self.window)
            except Exception:
                log.exception("marker file: running the restore hooks failed")


MarkerFileDetector = FileDetector
"""Former name of :class:`FileDetector` (named after its catalogue key now)."""
