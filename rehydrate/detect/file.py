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
observer looks only at the marker's own entry of the directory (one ``lstat``, never a
listing), so its cost does not grow with the directory.

A marker in a directory others may put files in — writable by its group or by everyone,
or sticky (``/tmp``) — is ignored when another uid than this process's (effective) uid,
root or one listed in ``REHYDRATE_MARKER_OWNERS`` owns it (the file, or a symlink put at
its name; each judged by the directory holding it), with one warning naming its path
and owner per change of it: anyone could create it there and run this process's restore
hooks at will. Neither news nor a baseline: the last marker of a trusted owner stays
the one changes are measured against. In a directory only its owner may write in, every
entry was put there by that owner or root, so any owner is trusted: under a user
namespace (rootless podman, Kubernetes ``hostUsers: false``), on NFS with
``root_squash`` or from a platform sidecar of its own uid, the platform's marker shows
another owner (the overflow uid 65534, the sidecar's uid) and is still a restore. A
platform that writes the marker into a shared directory names its uid as seen here in
``REHYDRATE_MARKER_OWNERS`` (comma-separated), or writes it as this process's uid or root.

A marker that is there but cannot be read (permissions, not a regular file) keeps its
last state, with one warning: becoming readable again unchanged is no restore. When the
marker's directory is removed, the detector says so and watches it again once it is
back (with inotify the directory above is watched too: a directory renamed away takes
its watch along, and a new one put in its place is watched again). The marker may be a
symlink: a change of any entry of its directory that resolving it passes through wakes
the detector too — a Kubernetes ConfigMap, Secret, downward-API or projected volume
updates ``marker -> ..data/marker`` by swapping the ``..data`` symlink, with no event
about the marker's own name. With inotify the directories holding the other symlinks
it resolves through and the file it ends at are watched as well (again whenever the
links change): a marker linked to a file elsewhere changes there. Polling needs none
of that (its ``stat`` follows the link). Setting ``REHYDRATE_MARKER_FILE`` makes ``start("auto")``
start the detector even when it cannot work, so that the reason is an error
(``status()["detector_errors"]``).

A burst of writes (truncate, then write) is one notice: a restore handled in the
``window`` seconds before the change (default 2, ``REHYDRATE_MARKER_WINDOW``) is taken to
be the same restore. A change is dated when its event arrived, not when the worker reads
it (after the hooks of a restore in progress, which may take longer than the window);
a read that finds a marker other than the one the event saw (inode, size, mtime) is
about a later change, dated by the read. ``REHYDRATE_MARKER_KIND``: ``restore``
(default) or ``resume``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .. import _config
from .._contract import Probe, refuse_another_engine
from .._files import READ_ONLY_EVENTS, open_regular
from .._gvisor import running_under_gvisor
from .._threads import fresh_lock_after_fork
from . import Detector
from ._util import checked_kind, env_kind

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
    try:
        return _read_state(path)
    except OSError as exc:
        log.debug("marker file %s unreadable: %s", path, exc)
        return None


def _read_state(path: str) -> State:
    """:func:`marker_state`, with ``OSError`` for a marker that is there but cannot be
    read (permissions, not a regular file): that is no news about a restore."""
    return _read_marker(path, frozenset())[0]


_SHARED = stat.S_IWGRP | stat.S_IWOTH | stat.S_ISVTX


def _shared(directory: str) -> bool:
    """Whether users besides the directory's owner (and root) may put entries in it:
    writable by its group or by everyone, or sticky. A directory that cannot be looked at
    counts as shared: the owner check then applies, as it did for every marker before."""
    try:
        return bool(os.stat(directory).st_mode & _SHARED)
    except OSError:
        return True


def _read_marker(path: str, owners: frozenset[int]) -> tuple[State, int | None]:
    """``(state, foreign)``: :func:`_read_state`'s state, and the uid owning the marker
    when another user could have put it there — its own name (a symlink put there) or
    the file read, in a directory others may write in (:func:`_shared`), owned by
    neither this process's (effective) uid, root nor one of ``owners`` — else None."""
    import hashlib  # here, not at import: start("auto") imports every detector to probe

    try:
        link_owner = os.lstat(path).st_uid
        fd = open_regular(path)
    except FileNotFoundError:
        return None, None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        digest = hashlib.sha256(f.read(_READ_LIMIT)).hexdigest()
    state = (st.st_ino, st.st_size, st.st_mtime_ns, digest)
    trusted = {os.geteuid(), 0, *owners}
    # Each owner is judged by the directory holding its entry: a symlink of a private
    # directory may lead to a file in /tmp, and the file's owner may rewrite it at will.
    if link_owner not in trusted and _shared(os.path.dirname(path)):
        return state, link_owner
    if st.st_uid not in trusted and _shared(os.path.dirname(os.path.realpath(path))):
        return state, st.st_uid
    return state, None


def _uids(entries: Iterable[object], what: str) -> frozenset[int]:
    """The uids of ``entries`` (ints, or their decimal spelling); each other entry is
    one warning naming it and ``what``, and left out: a bad setting never stops the
    process."""
    uids: set[int] = set()
    for entry in entries:
        if isinstance(entry, str) and entry.strip().isascii() and entry.strip().isdigit():
            uids.add(int(entry))
        elif isinstance(entry, int) and not isinstance(entry, bool) and entry >= 0:
            uids.add(entry)
        else:
            log.warning("%s: %s is not a uid (a number >= 0); ignored", what,
                        _config.shown(entry))
    return frozenset(uids)


def _resolution(path: str) -> tuple[frozenset[str], str]:
    """(visited, end): every path reading ``path`` passes through (the path itself, the
    symlinks and directories its resolution visits, the file it ends at), and that file.
    A Kubernetes ConfigMap, Secret or downward-API volume is ``marker -> ..data/marker``
    with ``..data`` a symlink to a versioned directory; an update swaps ``..data`` (a
    rename over it) and fires no event about ``marker`` itself."""
    seen = {path}
    current = path
    for _ in range(40):  # the kernel's limit of symlinks in one resolution
        prefix, link = os.sep, None
        for part in current.strip(os.sep).split(os.sep):
            prefix = os.path.join(prefix, part)
            seen.add(prefix)
            if os.path.islink(prefix):
                link = prefix
                break
        if link is None:
            break
        try:
            target = os.readlink(link)
        except OSError:
            break
        rest = os.path.relpath(current, link)
        current = os.path.normpath(os.path.join(os.path.dirname(link), target, rest))
    return frozenset(seen), current


def _watch_plan(path: str) -> tuple[frozenset[str], frozenset[str]]:
    """(directories, entries): the directories holding a symlink the resolution of
    ``path`` follows or the file it ends at, and the entries of those directories it
    passes through. A marker linked to a file elsewhere changes there, where a watch on
    its own directory sees nothing."""
    visited, end = _resolution(path)
    dirs = {os.path.dirname(path), os.path.dirname(end)}
    dirs.update(os.path.dirname(p) for p in visited if os.path.islink(p))
    # Not the watched directories themselves: a change of any file in them would wake
    # the detector (watchdog reports it as a change of the directory too).
    return (frozenset(dirs),
            frozenset(p for p in visited if os.path.dirname(p) in dirs and p not in dirs))


def _stat_key(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class _Named:
    """The one field of an ``os.DirEntry`` that watchdog's polling snapshot reads."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


_FD_ATTRS = ("_inotify_fd", "_kill_r", "_kill_w")
"""The descriptors watchdog's inotify wrapper holds: the instance and its wake-up pipe."""


def _close_copies(observer: Any) -> None:
    """Close, in a child of fork(), its copies of the descriptors of the parent's
    ``observer`` (a recent watchdog keeps its inotify wrapper on the observer, older ones
    on each emitter's buffer; a polling observer has none). Never ``inotify_rm_watch``:
    the watches belong to the instance both processes share, and would be removed from
    the parent's too."""
    if observer is None:
        return
    holders = [getattr(observer, "_inotify_fd", None)]
    with contextlib.suppress(Exception):  # a watchdog that keeps them otherwise
        for emitter in list(observer.emitters):
            holders.append(getattr(getattr(emitter, "_inotify", None), "_inotify", None))
    for holder in holders:
        for name in _FD_ATTRS:
            fd = getattr(holder, name, None)
            if isinstance(fd, int) and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                # a later close() of the copy must not close what reuses the number
                setattr(holder, name, -1)


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
        owners: Iterable[int] | None = None,
    ) -> None:
        raw = os.fspath(path) if path is not None else _config.text("REHYDRATE_MARKER_FILE")
        if not raw:
            raise ValueError("no marker file: pass path= or set REHYDRATE_MARKER_FILE")
        self.path = os.path.abspath(raw)
        if polling is None:
            polling = _config.flag("REHYDRATE_WATCH_POLLING")
        self.polling = running_under_gvisor() if polling is None else polling
        self.interval = _config.seconds(
            interval if interval is not None
            else _config.number("REHYDRATE_WATCH_INTERVAL"),
            "interval")
        self.kind: Literal["restore", "resume"] = (
            checked_kind(kind) if kind is not None else env_kind("REHYDRATE_MARKER_KIND"))
        self.window = _config.seconds(window if window is not None
                               else _config.number("REHYDRATE_MARKER_WINDOW"), "window",
                               zero_ok=True)
        self.owners = (_uids(owners, "owners") if owners is not None
                       else _uids(_config.items("REHYDRATE_MARKER_OWNERS"),
                                  "REHYDRATE_MARKER_OWNERS"))
        """Uids trusted to own the marker besides this process's and root, in a
        directory others may write in (a platform's uid seen through a user namespace)."""
        self.changes = 0
        self.checks = 0
        self._state: State = None
        self._ignored: State = None
        """The marker last ignored for its owner (warned about once per change)."""
        self._unreadable = False
        self._adopt = False
        self._engine: Engine | None = None
        self._observer: Any = None
        self._wake = threading.Event()
        self._lost = threading.Event()
        self._handler: Any = None
        self._watched: tuple[int, int] | None = None
        """(device, inode) of the directory watched (None: it went away)."""
        self._through: frozenset[str] = frozenset()
        """Entries of the watched directories whose change can change what it reads."""
        self._dirs: frozenset[str] = frozenset()
        """The directories holding the marker, the symlinks it resolves through and the
        file it ends at."""
        self._extra: dict[str, tuple[Any, tuple[int, int] | None]] = {}
        """Directories watched besides the marker's and the one above (inotify): their
        watchdog watch and (device, inode) when scheduled."""
        self._arrived: tuple[float, tuple[int, int, int] | None] | None = None
        """When the latest change not yet looked at was reported (time.monotonic()), and
        the marker's (inode, size, mtime_ns) then."""
        self._arrival_lock = threading.Lock()
        self.rewatches = 0
        self._stopping = threading.Event()
        self._worker: threading.Thread | None = None
        self._worker_pid = 0
        self._lock = threading.Lock()
        # the worker takes both: a child forked meanwhile must not wait for them for ever
        fresh_lock_after_fork(self, "_lock", "_arrival_lock")

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

    def probe_instance(self) -> Probe:
        # its own path: REHYDRATE_MARKER_FILE may be unset
        if importlib.util.find_spec("watchdog") is None:
            return Probe(False, "the watchdog package is not installed")
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            return Probe(False, f"the marker file's directory {parent} does not exist")
        return Probe(True)

    @classmethod
    def configured(cls) -> bool:
        return bool(_config.text("REHYDRATE_MARKER_FILE"))

    def describe(self) -> str:
        how = f"polling every {self.interval:g}s" if self.polling else "inotify"
        return f"watches {self.path} ({how})"

    def start(self, engine: Engine) -> None:
        with self._lock:
            # A worker of the parent of a fork is not here (an installed detector is
            # started again in the child): taken for running, the child's detector was
            # listed as watching and heard nothing. Its observer is left alone, as the
            # engine leaves the parent's detectors.
            if self._worker is not None and self._worker_pid == os.getpid():
                refuse_another_engine(self, self._engine, engine)
                return
            self._forget_parents()  # started directly in a child, not through an engine
            parent = os.path.dirname(self.path)
            if not os.path.isdir(parent):
                raise RuntimeError(f"the marker file's directory {parent} does not exist")
            self._engine = engine
            self._ignored = None
            try:
                state, foreign = _read_marker(self.path, self.owners)
                if foreign is not None:
                    self._ignore(state, foreign)
                    state = None  # no baseline from it: the platform's marker is news
                self._state, self._unreadable, self._adopt = state, False, False
            except OSError as exc:
                # No baseline yet: the first state read is taken as it, not as news.
                log.warning("marker file %s cannot be read (%s); its first readable state "
                            "is taken as the baseline", self.path, exc.strerror or exc)
                self._state, self._unreadable, self._adopt = None, True, True
            self._dirs, self._through = _watch_plan(self.path)
            self._stopping.clear()
            self._wake.clear()
            self._lost.clear()
            self._arrived = None
            observer = self._make_observer(parent)
            observer.start()
            self._observer = observer
            # Once it runs: scheduled before, a directory that cannot be watched would
            # make observer.start() fail.
            self._watch_targets(observer)
            self._worker = threading.Thread(target=self._work, name="rehydrate-marker-file",
                                            daemon=True)
            self._worker_pid = os.getpid()
            self._worker.start()

    def stop(self) -> None:
        with self._lock:
            if self._worker is not None and self._worker_pid != os.getpid():
                # A child of fork() (an inherited shutdown handler): the worker and the
                # observer are the parent's.
                self._forget_parents()
                return
            worker, self._worker = self._worker, None
            observer, self._observer = self._observer, None
            self._stopping.set()
            self._wake.set()
        if observer is not None:
            observer.stop()
            observer.join(5.0)
        if worker is not None:
            worker.join(5.0)

    def forget_in_child(self) -> None:
        with self._lock:
            self._forget_parents()

    def _forget_parents(self) -> None:
        """In a child of fork(): forget the parent's worker and observer. Stopping the
        observer here would remove the watches of the inotify instance both processes
        share, and the events are threading ones of this process: only forgotten — but
        its copies of the observer's descriptors are closed (closing a copy removes no
        watch of the parent's), or every forked worker kept an inotify instance and a
        pipe open for its life."""
        if self._worker is not None and self._worker_pid != os.getpid():
            _close_copies(self._observer)
            self._worker = self._observer = None

    def _make_observer(self, parent: str) -> Any:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler

        wake, lost = self._wake, self._lost
        detector = self

        def note() -> None:
            # Dated on arrival, not when the worker gets to it: a write made while the
            # hooks of the restore it belongs to still run must fall in that restore's
            # window, however long the hooks take.
            # The marker's identity then: a read that finds another one is about a change
            # made after this report, and that is dated by the read. Looked at before
            # the clock is read: the time must not predate what the stat saw (a thread
            # switch in between would date a later change by this earlier moment).
            seen = _stat_key(detector.path)
            arrived = (time.monotonic(), seen)
            with detector._arrival_lock:
                detector._arrived = arrived
                wake.set()

        class _Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in READ_ONLY_EVENTS:
                    return
                paths = [os.fsdecode(p) for p in
                         (event.src_path, getattr(event, "dest_path", "")) if p]
                if event.is_directory and parent in paths and event.event_type in (
                        "deleted", "moved", "created"):
                    if event.event_type == "created" or parent != paths[0]:
                        # Another directory took its place: news unless it is the one
                        # watched already (watched again after it went away).
                        if _identity(parent) == detector._watched:
                            return
                    else:
                        # It went away (watchdog stops watching it) or was renamed away
                        # (the watch follows the moved directory).
                        detector._watched = None
                    lost.set()
                    note()
                    return
                through = detector._through
                if any(p in through for p in paths):
                    note()

        observer: Any
        if self.polling:
            from watchdog.observers.polling import PollingObserverVFS

            name = os.path.basename(self.path)

            entry = _Named(name)

            def only_marker(directory: str | None) -> Iterator[os.DirEntry[str]]:
                # One lstat, never a listing: the cost does not grow with the directory.
                # (watchdog reads only .name of what this returns.)
                there = os.path.lexists(os.path.join(directory or ".", name))
                return iter([entry] if there else [])  # type: ignore[list-item]

            observer = PollingObserverVFS(os.stat, only_marker,
                                          polling_interval=self.interval)
        else:
            from watchdog.observers import Observer

            observer = Observer()
        self._handler = _Handler()
        self._schedule(observer, parent)
        observer.name = "rehydrate-marker-watch"
        observer.daemon = True
        return observer

    def _schedule(self, observer: Any, parent: str) -> None:
        self._watched = _identity(parent)
        observer.schedule(self._handler, parent, recursive=False)
        above = os.path.dirname(parent)
        if not self.polling and above != parent:
            # inotify: a watch follows its directory's inode, and a directory renamed
            # away fires nothing watchdog reports; the watch on the directory above sees
            # the rename (and a new directory put in its place).
            try:
                observer.schedule(self._handler, above, recursive=False)
            except OSError as exc:  # not readable: a rename away goes unseen
                log.debug("marker file: cannot watch %s (%s)", above, exc)
        self._extra = {}

    def _watch_targets(self, observer: Any) -> None:
        """inotify: watch the directories a symlinked marker resolves through (a link in
        another directory, the file it ends at), and only those — again when the links
        change, or a directory is replaced. Polling needs none: its ``stat`` follows the
        link. Under ``_lock``, with the observer running."""
        if self.polling:
            return
        parent = os.path.dirname(self.path)
        wanted = self._dirs - {parent, os.path.dirname(parent)}
        for directory, (watch, identity) in list(self._extra.items()):
            if directory not in wanted or _identity(directory) != identity:
                with contextlib.suppress(KeyError, OSError):  # its emitter may be gone
                    observer.unschedule(watch)
                del self._extra[directory]
        for directory in sorted(wanted - self._extra.keys()):
            identity = _identity(directory)
            if identity is None:
                continue  # not there (a dangling link): re-resolved when the link changes
            try:
                watch = observer.schedule(self._handler, directory, recursive=False)
            except OSError as exc:
                log.debug("marker file: cannot watch %s (%s)", directory, exc)
                continue
            self._extra[directory] = (watch, identity)

    def _work(self) -> None:
        while True:
            self._wake.wait()
            if self._stopping.is_set():
                return
            with self._arrival_lock:
                self._wake.clear()
                arrived, self._arrived = self._arrived, None
            if self._lost.is_set():
                if not self._watch_again():
                    return
                arrived = None  # it may have waited long for the directory
            noticed = time.monotonic()
            self._dirs, self._through = _watch_plan(self.path)
            with self._lock:
                # Before the read: a change made after it then wakes the detector.
                if self._observer is not None:
                    self._watch_targets(self._observer)
            try:
                state, foreign = _read_marker(self.path, self.owners)
            except OSError as exc:
                # Keep the last state: a marker made unreadable for a moment and then
                # readable again, unchanged, must not count as a new restore.
                self.checks += 1
                if not self._unreadable:
                    log.warning("marker file %s cannot be read (%s); keeping its last state",
                                self.path, exc.strerror or exc)
                self._unreadable = True
                continue
            if self._unreadable:
                log.info("marker file %s is readable again", self.path)
                self._unreadable = False
            self.checks += 1
            if foreign is not None:
                # Neither news nor a baseline: the last trusted state stays.
                self._ignore(state, foreign)
                continue
            self._ignored = None
            previous, self._state = self._state, state
            if self._adopt:
                self._adopt = False
                continue
            if state is None or state == previous:
                continue
            if arrived is not None and arrived[1] == state[:3]:
                noticed = arrived[0]
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


    def _ignore(self, state: State, owner: int) -> None:
        """A marker another user could have put there, owned by an untrusted uid: in a
        directory others may write in (``/tmp``, sticky), anyone could create it and make
        this process run its restore hooks (new keys, reconnections, a readiness gap) at
        will. One warning per change of it, not per look."""
        if state == self._ignored:
            return
        self._ignored = state
        euid = os.geteuid()
        trusted = ([f"uid {euid}"] if euid else []) + ["root"] + [
            f"uid {uid}" for uid in sorted(self.owners - {euid, 0})]
        who = ", ".join(trusted[:-1]) + " or " + trusted[-1] if len(trusted) > 1 else "root"
        log.warning("marker file %s is owned by uid %d, not by %s, in a directory others "
                    "may write in: ignored (another user could fake a restore with it; "
                    "REHYDRATE_MARKER_OWNERS names a platform's uid to trust)", self.path,
                    owner, who)

    def _watch_again(self) -> bool:
        """The marker's directory went away, and watchdog with it: wait for the directory
        to be back, then watch it again (False: the detector is stopping meanwhile)."""
        self._lost.clear()
        parent = os.path.dirname(self.path)
        watched = self._watched
        if watched is not None and _identity(parent) == watched:
            return True  # the directory there is the one watched already
        log.warning("marker file: its directory %s was removed; watching for it to come "
                    "back", parent)
        while not self._stopping.wait(self.interval):
            if not os.path.isdir(parent):
                continue
            with self._lock:
                observer = self._observer
                if observer is None:
                    return False
                try:
                    observer.unschedule_all()
                    self._schedule(observer, parent)
                except OSError:
                    continue  # not there (yet)
            self.rewatches += 1
            log.info("marker file: watching %s again", parent)
            return True
        return False


MarkerFileDetector = FileDetector
"""Former name of :class:`FileDetector` (named after its catalogue key now)."""
