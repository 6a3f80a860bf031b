"""Managed files, SQLite connections and shared mappings on volumes the snapshot does not hold.

A checkpoint holds the process's memory and its tmpfs / root file system, but not its
persistent volumes: ``runsc restore`` finds every open volume file again **by its path**,
with no size, mtime or inode check. A file replaced meanwhile (rename-over, a swapped
volume) is silently read from the old offset in the middle of the new file; a file that
is gone makes the whole restore fail; a deleted file held open makes the checkpoint fail
(see docs/volumes.md for the measurements).

Handles made here are closed before a snapshot and reopened after a restore or resume:

* :func:`open` — a file object; reopened at the same position when size, ``st_mtime_ns``
  and ``st_ctime_ns`` are unchanged, else with ``.changed`` set and ``on_change`` called,
  at offset 0 (a handle that writes in place, ``w``/``x``/``+`` modes other than ``a``:
  at the end, so its next write does not overwrite another writer's data) — never a
  silent read from the middle of another file;
* :func:`sqlite` — a ``sqlite3`` connection; the WAL is checkpointed and the connection
  closed before the snapshot (a transaction still open, or a cursor not read to its end,
  is refused), so no ``-wal`` / ``-shm`` descriptor is in the image;
* :func:`mmap` — a ``MAP_SHARED`` mapping; flushed and unmapped before, remapped after;
* :func:`volume` — a volume's identity file; after a restore a different volume is
  reported and every handle on it treated as changed.

A file that is gone after a restore fails the ``rehydrate.files.reopen`` hook with its
path (required by default: the process stays ``degraded``). In a child of ``fork()`` a
handle's lock (and the manager's) that a parent thread held is replaced, so the child's
hooks and ``close()`` do not wait for rehydrate's locks held by a thread it does not have.
The file object's own lock is CPython's, not replaced: a parent thread inside a read or
write of a buffered file at the fork leaves it held in the child, where the snapshot hook
then fails on that handle ("reentrant call inside <_io.BufferedWriter>") and ``close()``
hangs — write to a file a child will use from the forking thread only, or open it in the
child.

Every engine also runs the ``rehydrate.files.audit`` before-snapshot hook, last: it lists
the descriptors still open on volumes (:func:`open_files`, ``rehydrate doctor --files``),
warns about unmanaged ones and, under gVisor, **fails the pass naming the path** when a
deleted file is held open on a volume — gVisor cannot checkpoint that, and a failed
``rehydrate notify save`` keeps the platform from trying. Mounts the snapshot holds are
the root file system, tmpfs and the kernel's pseudo file systems, plus the mount points
listed in ``REHYDRATE_HELD_MOUNTS`` (comma-separated, e.g. an ``emptyDir`` backed by
the sandbox's own memory).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import re
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _config
from ._files import kind_name, read_regular
from ._hooks import BEFORE_USER_HOOKS, Phase
from ._threads import fresh_lock_after_fork
from .extensions import Probe, resolve_engine

# mmap, secrets and the gVisor check are imported where a mapping, a volume or the audit
# needs them: this module is a default extension, loaded with every engine.
if TYPE_CHECKING:
    import mmap as _mmap
    import sqlite3

    from ._context import Report, RestoreContext
    from ._hooks import Hook
    from .extensions import Engine

__all__ = [
    "HELD_FSTYPES",
    "IDENTITY_FILE",
    "FileGone",
    "FilesManager",
    "ManagedConnection",
    "ManagedFile",
    "ManagedMap",
    "MountInfo",
    "OpenFile",
    "ReopenFailed",
    "SnapshotRefused",
    "Volume",
    "audit",
    "doctor_report",
    "install",
    "manager",
    "mmap",
    "mounts",
    "open",
    "open_files",
    "sqlite",
    "volume",
]

log = logging.getLogger("rehydrate")

IDENTITY_FILE = ".rehydrate-volume"
"""Name of the identity file :func:`volume` keeps at the root of a registered volume."""

HELD_FSTYPES = frozenset({
    "tmpfs", "ramfs", "proc", "sysfs", "devpts", "devtmpfs", "mqueue", "cgroup", "cgroup2",
    "securityfs", "debugfs", "tracefs", "pstore", "bpf", "configfs", "fusectl",
    "binfmt_misc", "hugetlbfs", "nsfs", "autofs", "efivarfs", "overlay",
})
"""File system types whose content the snapshot holds (memory-backed or pseudo)."""

_DELETED = " (deleted)"

_TMP_ATTEMPTS = 8
"""Random temporary names tried for a new identity file before giving up."""

_REOPEN_TIMEOUT = 30.0
"""Default timeout of the ``rehydrate.files.reopen`` hook, in seconds (``reopen_timeout``)."""


class FileGone(FileNotFoundError):
    """A managed file (or its volume) is missing after a restore; the message names it."""


class ReopenFailed(RuntimeError):
    """Managed handles could not be reopened after a restore or resume (``on_change``
    raised, a mapping no longer fits its file …); the message names each."""


class SnapshotRefused(RuntimeError):
    """A before-snapshot pass cannot safely go on (open transaction, deleted file …)."""


# -- identity ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Identity:
    size: int
    mtime_ns: int
    ctime_ns: int
    kind: int = stat.S_IFREG
    """``stat.S_IFMT`` of the mode: a file that became a FIFO is another file."""

    @classmethod
    def of(cls, path: str) -> _Identity:
        return cls.from_stat(os.stat(path))

    @classmethod
    def from_stat(cls, st: os.stat_result) -> _Identity:
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, stat.S_IFMT(st.st_mode))


def _file_key(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def _stat_after_restore(path: str) -> _Identity:
    try:
        return _Identity.of(path)
    except FileNotFoundError:
        raise FileGone(f"managed file {path} is gone after the restore (deleted, moved, or "
                       "its volume is not mounted)") from None


# -- handles ----------------------------------------------------------------------------


def _quote_ident(name: str) -> str:
    """An SQL identifier, quoted (an attached database's schema name)."""
    return '"' + name.replace('"', '""') + '"'


OnChange = Callable[[Any], object]


class _PassStopped(Exception):
    """A late reopen pass met a before-snapshot pass begun after it: it stops."""


class _Handle:
    """What every managed handle shares: path, change tracking, registration."""

    _kind = "handle"

    def __init__(self, path: str | os.PathLike[str], engine: Engine | None,
                 on_change: OnChange | None, required: bool) -> None:
        # Always text: a bytes path broke status() (JSON) and the volume checks of the
        # reopen hook, which then left every other handle closed.
        object.__setattr__(self, "path", os.path.abspath(os.fsdecode(path)))
        object.__setattr__(self, "changed", False)
        object.__setattr__(self, "on_change", on_change)
        object.__setattr__(self, "required", required)
        object.__setattr__(self, "_lock", threading.RLock())
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork() (a slow reopen)
        object.__setattr__(self, "_identity", None)
        object.__setattr__(self, "_opened_key", None)
        object.__setattr__(self, "_closed_by_user", False)
        object.__setattr__(self, "_suspended", False)
        object.__setattr__(self, "_reopen_ask", None)
        object.__setattr__(self, "_manager", manager(engine))

    path: str
    """Absolute path of the managed file."""
    changed: bool
    """True when the last reopen found another file (or volume) than the one closed."""
    on_change: OnChange | None
    required: bool
    _lock: threading.RLock
    _identity: _Identity | None
    _opened_key: tuple[int, int] | None
    """(st_dev, st_ino) of the file the handle opened, set by each subclass when it opens."""
    _closed_by_user: bool
    _suspended: bool
    _reopen_ask: float | None
    """The ``reopen_timeout`` this handle asked (None: none)."""
    _manager: FilesManager

    def _register(self) -> None:
        self._manager._add(self)

    # subclasses: _close_now() closes the underlying object, _open_now(same) reopens it
    def _close_now(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _open_now(self, same: bool) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _suspend(self) -> bool:
        """Before a snapshot: close, remembering what was closed; True when this call
        closed it (a ``SnapshotRefused`` raised with it closed anyway closed it too)."""
        with self._lock:
            if self._closed_by_user or self._suspended:
                return False
            failed: Exception | None = None
            try:
                self._close_now()
            except SnapshotRefused:
                raise
            except Exception as exc:
                if not self._is_closed():
                    raise SnapshotRefused(f"managed {self._kind} {self.path} could not be "
                                          f"closed: {type(exc).__name__}: {exc}") from exc
                # The close failed but closed the object anyway: carry on as suspended so
                # the restore or resume reopens it — otherwise the application's handle
                # stayed closed for good — and refuse the pass below.
                failed = exc
            object.__setattr__(self, "_suspended", True)
            try:
                st = os.stat(self.path)
            except OSError:
                st = None  # already gone: the snapshot is safe, the reopen reports it
            ident: _Identity | None = None
            if st is not None and self._opened_key not in (None, _file_key(st)):
                # The path names another file than the one the handle had open (renamed
                # over, a rotated log, a ConfigMap symlink swap) before the snapshot: the
                # stat would describe the new file, and the reopen would seek it to the
                # old file's position as "unchanged". An unknown identity makes the
                # reopen treat it as changed.
                log.info("managed %s %s was replaced before the snapshot: reopened as "
                         "changed after it", self._kind, self.path)
            elif st is not None:
                # Stat after the close, so the size and times include its last write-back.
                ident = _Identity.from_stat(st)
            object.__setattr__(self, "_identity", ident)
            if failed is not None:
                raise SnapshotRefused(f"managed {self._kind} {self.path} could not be closed: "
                                      f"{type(failed).__name__}: {failed}") from failed
            return True

    def _is_closed(self) -> bool:
        """After a failed ``_close_now``: True when the underlying object is closed anyway."""
        return False

    def _resume(self, volume_changed: bool, stale: Callable[[], bool] = lambda: False
                ) -> bool:
        """After a restore or resume: reopen; True when the file changed. ``stale``:
        True once a before-snapshot pass began after this reopen pass (checked under the
        handle's lock, which that pass's close takes too)."""
        with self._lock:
            if self._closed_by_user or not self._suspended:
                return False
            if stale():
                raise _PassStopped
            now = _stat_after_restore(self.path)
            expected = self._identity.kind if self._identity is not None else stat.S_IFREG
            if now.kind not in (stat.S_IFREG, expected):
                # A FIFO put at the path while frozen: open() waited for a writer for
                # ever, the reopen hook timed out holding this handle's lock, the handles
                # after it stayed closed, and no later restore ran the hook again.
                raise ReopenFailed(f"managed {self._kind} {self.path} is now "
                                   f"{kind_name(now.kind)}, not a regular file: not reopened "
                                   "(opening it could wait for ever)")
            same = not volume_changed and now == self._identity
            self._open_now(same)
            object.__setattr__(self, "_suspended", False)
            object.__setattr__(self, "changed", not same)
        if not same:
            log.info("managed %s %s changed while frozen: reopened %s", self._kind,
                     self.path, self._changed_position())
            if self.on_change is not None:
                self.on_change(self)
        return not same

    def _changed_position(self) -> str:
        """Where a reopen of a changed file starts, for the log line."""
        return "from the start"

    def _close_for_good(self) -> None:
        self._close_now()

    def close(self) -> None:
        """Close for good: no longer reopened after a restore."""
        with self._lock:
            object.__setattr__(self, "_closed_by_user", True)
            if not self._suspended:
                self._close_for_good()
            object.__setattr__(self, "_suspended", False)
        self._manager._remove(self)

    @property
    def suspended(self) -> bool:
        """True between the before-snapshot close and the reopen after restore/resume."""
        return self._suspended

    def describe(self) -> dict[str, Any]:
        """What ``status()["files"]`` shows for this handle."""
        return {"kind": self._kind, "path": self.path, "changed": self.changed,
                "suspended": self._suspended, "required": self.required}

    # The handle stands for the current file object / connection / mapping.
    def _target(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not set yet (__init__ failed): no recursion
            raise AttributeError(name)
        return getattr(self._target(), name)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> Any:
        self.close()


def _unseekable(path: str, kind: str) -> str:
    return (f"rehydrate.files.open manages seekable files: {path} is {kind} that cannot "
            "seek, so it cannot be reopened where it was; open it with the built-in open()")


def _reopen_mode(mode: str) -> str:
    """The mode that reopens a file without truncating or refusing it."""
    if "w" in mode or "x" in mode:
        return mode.replace("w", "r").replace("x", "r").replace("+", "") + "+"
    return mode


class ManagedFile(_Handle):
    """A file object closed before a snapshot and reopened after restore or resume.

    Attribute access goes to the current file object (``read``, ``write``, ``seek`` …);
    while the snapshot is pending it is closed (``ValueError: I/O operation on closed
    file``). A mode that creates or truncates (``w``, ``x``) reopens as ``r+``. A changed
    file is reopened at offset 0, or at its end when the mode writes in place (``w``,
    ``x``, ``r+``, ``w+``, ``x+``) or only appends (``a``: ``tell()`` is where its next
    write lands; an ``a+`` reader reads from the start).
    """

    _kind = "file"

    def __init__(self, path: str | os.PathLike[str], mode: str, *, engine: Engine | None,
                 on_change: OnChange | None, required: bool, open_kwargs: dict[str, Any]
                 ) -> None:
        super().__init__(path, engine, on_change, required)
        try:
            kind = stat.S_IFMT(os.stat(self.path).st_mode)
        except OSError:
            kind = stat.S_IFREG  # to be created (or open() names the problem)
        if kind in (stat.S_IFIFO, stat.S_IFSOCK):
            # Not seekable: the before-snapshot close asked tell() and refused every
            # snapshot, and a FIFO's reopen would wait for a writer. Before opening it: a
            # FIFO's open() waits too.
            raise ValueError(_unseekable(self.path, kind_name(kind)))
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "_kwargs", open_kwargs)
        object.__setattr__(self, "_pos", 0)
        # The handle owns the file object and closes it (snapshot or close()).
        f = builtins.open(self.path, mode, **open_kwargs)  # noqa: SIM115
        if not f.seekable():  # a terminal, a character device that cannot seek
            kind = stat.S_IFMT(os.fstat(f.fileno()).st_mode)
            f.close()
            raise ValueError(_unseekable(self.path, kind_name(kind)))
        self._set_file(f)
        self._register()

    mode: str
    _kwargs: dict[str, Any]
    _pos: int
    _file: Any

    def _set_file(self, f: Any) -> None:
        try:
            key: tuple[int, int] | None = _file_key(os.fstat(f.fileno()))
        except (OSError, ValueError, AttributeError):  # pragma: no cover - no descriptor
            key = None
        object.__setattr__(self, "_opened_key", key)
        object.__setattr__(self, "_file", f)

    def _close_now(self) -> None:
        f = self._file
        if not f.closed:
            # Flush first: a write-back error (volume full) then leaves the file open and
            # usable, and the pass is refused; close() would report it with the file
            # already closed and its buffer lost.
            if f.writable():
                f.flush()
            object.__setattr__(self, "_pos", f.tell())
            f.close()

    def _is_closed(self) -> bool:
        return bool(self._file.closed)

    def _open_now(self, same: bool) -> None:
        f = builtins.open(self.path, _reopen_mode(self.mode), **self._kwargs)  # noqa: SIM115
        if same:
            # "a"/"a+" too: an "a+" reader continues where it read (O_APPEND still sends
            # every write to the end).
            f.seek(self._pos)
        elif self._writes_in_place():
            # Another writer's file: at offset 0 the next write overwrote its head and
            # left the rest behind it. At the end it adds to what is there.
            f.seek(0, os.SEEK_END)
        elif "a" in self.mode and "+" in self.mode:
            # open() put the file at its end; an "a+" reader reads the changed file from
            # the start (its writes still go to the end: O_APPEND). A plain "a" stays at
            # the end: tell() is where its next write lands (an append log's index).
            f.seek(0)
        self._set_file(f)

    def _writes_in_place(self) -> bool:
        """A mode whose writes go where the position is (not ``a``: O_APPEND)."""
        return "a" not in self.mode and any(c in self.mode for c in "wx+")

    def _changed_position(self) -> str:
        at_end = self._writes_in_place() or ("a" in self.mode and "+" not in self.mode)
        return "at its end" if at_end else "from the start"

    def fileno(self) -> int:
        """The current descriptor (a new one after every reopen)."""
        return int(self._file.fileno())

    def _target(self) -> Any:
        return self._file

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        # readline(), not next(file): a text file's next() disables tell() until EOF
        # ("telling position disabled by next() call"), which the before-snapshot close
        # needs — a `for line in f: ... break` would refuse every snapshot. Iterating the
        # handle (not the file object) also follows it to the file reopened after one.
        line = self._file.readline()
        if not line:
            raise StopIteration
        return line

    def __repr__(self) -> str:
        return f"<rehydrate.files.ManagedFile {self.path!r} mode={self.mode!r}>"


_SESSION_PRAGMAS = ("foreign_keys", "recursive_triggers", "query_only", "busy_timeout")
"""Per-connection ``PRAGMA`` s read before the close and set again on the new connection."""

_QUIET = (("authorizer",), ("progress",), ("trace",))
"""The callbacks passed over while rehydrate inspects and closes a connection."""

_SQL_TOKEN = re.compile(r"""
    (?P<skip>\s+|--[^\n]*|/\*.*?(?:\*/|\Z))
  | (?P<str>'(?:[^']|'')*'?)
  | (?P<ident>"(?:[^"]|"")*"?|`(?:[^`]|``)*`?|\[[^\]]*\]?)
  | (?P<param>\?\d*|[:@$]\w+)
  | (?P<word>\w+)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
"""SQL as SQLite reads it: blanks and comments, a string literal, a quoted identifier,
a parameter, a word, anything else (one character)."""


_ATTACH_WORD = re.compile(r"\b(?:at|de)tach\b", re.IGNORECASE)
"""A statement that may attach or detach a database (not one on an ``attachments``
table)."""


def _sql_tokens(sql: str) -> list[tuple[str, str]]:
    """``sql``'s tokens (kind, text), without blanks and comments."""
    out = []
    for m in _SQL_TOKEN.finditer(sql):
        kind = m.lastgroup
        if kind is not None and kind != "skip":
            out.append((kind, m.group()))
    return out


def _unquote(text: str) -> str:
    """A string literal or a quoted identifier, unquoted."""
    if text[:1] in ("'", '"', "`"):
        q = text[0]
        body = text[1:-1] if len(text) > 1 and text.endswith(q) else text[1:]
        return body.replace(q * 2, q)
    if text[:1] == "[":
        return text[1:-1] if text.endswith("]") else text[1:]
    return text


def _attaches(sql: str, parameters: Any) -> dict[str, object]:
    """The ``ATTACH [DATABASE] <literal or parameter> AS <name>`` statements of ``sql``:
    what each attached, by schema name (lower case); None for an argument that is not
    a literal or a bound parameter."""
    tokens = _sql_tokens(sql)
    found: dict[str, object] = {}
    anonymous = 0  # the number a bare ? stands for: one more than the largest before it
    for i, (kind, text) in enumerate(tokens):
        if kind == "param" and text[0] == "?":
            anonymous = int(text[1:]) if text[1:] else anonymous + 1
        if kind != "word" or text.upper() != "ATTACH":
            continue
        j = i + 1
        if j < len(tokens) and tokens[j][0] == "word" and tokens[j][1].upper() == "DATABASE":
            j += 1
        if j + 2 >= len(tokens) or tokens[j + 1][0] != "word" or tokens[j + 1][1].upper() != "AS":
            continue
        (arg_kind, arg_text), (name_kind, name_text) = tokens[j], tokens[j + 2]
        if name_kind not in ("word", "ident", "str"):
            continue
        arg: object = None
        if arg_kind in ("str", "ident"):  # "file:…": a string when no column has its name
            arg = _unquote(arg_text)
        elif arg_kind == "param":
            try:
                if arg_text[0] != "?":
                    arg = parameters[arg_text[1:]]
                else:
                    arg = parameters[(int(arg_text[1:]) if arg_text[1:] else anonymous + 1) - 1]
            except (LookupError, TypeError, ValueError):
                arg = None  # not resolved: attached again by path
        found[_unquote(name_text).lower()] = arg
    return found


def _has_rows(conn: sqlite3.Connection, schema: str, table: str | None = None) -> bool:
    """Whether ``table`` of ``schema`` (None: any of its tables but SQLite's own) holds a
    row."""
    if table is None:
        tables = [str(row[0]) for row in _rows(conn,
            f"SELECT name FROM {_quote_ident(schema)}.sqlite_master "  # noqa: S608 - quoted
            "WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'")]
    else:
        tables = [table]
    # Names quoted as identifiers: a name cannot end the quoting.
    return any(_rows(conn, f"SELECT EXISTS (SELECT 1 FROM {_quote_ident(schema)}."  # noqa: S608
                           f"{_quote_ident(name)})")[0][0] for name in tables)


def _statement_running(exc: sqlite3.OperationalError) -> bool:
    """Whether ``exc`` is SQLITE_LOCKED: a statement of the connection itself is still
    running (``sqlite_errorcode`` is Python 3.11's; the message is SQLite's)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code == 6 if code is not None else str(exc) == "database table is locked"


def _pragma_values(conn: sqlite3.Connection) -> dict[str, int]:
    """The connection's values of :data:`_SESSION_PRAGMAS`."""
    return {name: int(_rows(conn, f"PRAGMA {name}")[0][0]) for name in _SESSION_PRAGMAS}


def _rows(conn: sqlite3.Connection, sql: str) -> list[tuple[Any, ...]]:
    """``sql``'s rows as tuples of text and numbers, whatever ``row_factory`` and
    ``text_factory`` the application set on the connection (a dict row factory refused
    every snapshot)."""
    cur = conn.cursor()
    cur.row_factory = None  # the cursor's own: the connection's stays for other threads
    try:
        return [tuple(v.decode("utf-8", "replace") if isinstance(v, bytes) else v
                      for v in row) for row in cur.execute(sql)]
    finally:
        cur.close()


def _connection_state(conn: sqlite3.Connection, *, with_files: bool = False
                      ) -> tuple[frozenset[tuple[str, str]], frozenset[str],
                                 list[tuple[str, str]]]:
    """A connection's TEMP objects (type, name), its in-memory attachments, and (with
    ``with_files``) its attachments from a file (schema, file)."""
    # sqlite_*: SQLite's own (temp.sqlite_sequence stays after its AUTOINCREMENT table
    # was dropped and cannot be dropped itself: it refused every snapshot).
    temp = frozenset((str(kind), str(name)) for kind, name in _rows(conn,
        "SELECT type, name FROM temp.sqlite_master WHERE name NOT LIKE 'sqlite\\_%' "
        "ESCAPE '\\'"))
    attached = [(str(row[1]), str(row[2])) for row in _rows(conn, "PRAGMA database_list")
                if row[1] not in ("main", "temp")]
    return (temp, frozenset(schema for schema, file in attached if not file),
            [(schema, file) for schema, file in attached if file] if with_files else [])


def _autocommit_off(conn: sqlite3.Connection) -> bool:
    """Whether ``conn`` was made with Python 3.12's ``autocommit=False`` (PEP 249's
    transactions: one is open at all times, begun again by every commit and rollback)."""
    return getattr(conn, "autocommit", None) is False


_PROBE_WAIT = 0.1
"""Seconds the write probe waits for another connection's short write to end."""
_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6


def _writing(conn: sqlite3.Connection) -> str | None:
    """What holds a write lock on one of ``conn``'s database files (its own uncommitted
    writes, or another connection writing now), or None when nothing does.

    SQLite does not say whether a transaction has written; a second connection that
    can begin a write transaction on every file (then rolls it back) shows that none
    does. A probe that fails otherwise is reported as what it found: the caller refuses
    rather than guesses."""
    import sqlite3

    files_ = [str(row[2]) for row in _rows(conn, "PRAGMA database_list")
              if row[1] != "temp" and row[2]]
    for file in files_:
        try:
            probe = sqlite3.connect(file, timeout=_PROBE_WAIT, isolation_level=None,
                                    check_same_thread=False)
        except sqlite3.Error as exc:
            return f"{file} could not be checked: {exc}"
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
        except sqlite3.OperationalError as exc:
            code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
            return (f"{file} is being written" if code in (_SQLITE_BUSY, _SQLITE_LOCKED)
                    else f"{file} could not be checked: {exc}")
        finally:
            probe.close()
    return None


@contextlib.contextmanager
def _autocommit_on(conn: sqlite3.Connection) -> Iterator[None]:
    """A connection made with ``autocommit=False`` in autocommit mode meanwhile (the
    open transaction committed): rehydrate's statements run outside it, since in one
    ``PRAGMA foreign_keys`` does nothing, ``ATTACH`` is refused and a read snapshot stops
    the WAL checkpoint. Only for a transaction that wrote nothing (:func:`_writing`)."""
    if not _autocommit_off(conn):
        yield
        return
    conn.autocommit = True  # type: ignore[attr-defined]  # Python 3.12+ (checked above)
    try:
        yield
    finally:
        conn.autocommit = False  # type: ignore[attr-defined]


@contextlib.contextmanager
def _own_statements(threads: set[int]) -> Iterator[None]:
    """rehydrate's own statements on this thread: the application's authorizer,
    progress handler and trace callback pass over them (see :func:`_quiet_callback`)."""
    ident = threading.get_ident()
    if ident in threads:  # nested: the outer one takes it out
        yield
        return
    threads.add(ident)
    try:
        yield
    finally:
        threads.discard(ident)


def _quiet_callback(method: str, fn: Callable[..., Any],
                    threads: set[int]) -> Callable[..., Any]:
    """``fn`` (an authorizer, progress handler or trace callback), passed over for the
    statements rehydrate runs itself (SQLite calls it on the thread running the
    statement, so another thread's statements meanwhile are still checked)."""
    # ``threads`` is empty but while rehydrate runs its own statements: the check costs a
    # truth test, with no call, on every thread. A threading.local read with a default
    # went through an AttributeError on each call on a thread that never set it (a
    # progress handler made a query ~4x slower on a web server's worker thread).
    get_ident = threading.get_ident
    if method == "set_authorizer":
        import sqlite3

        allow = sqlite3.SQLITE_OK

        def authorizer(*args: Any) -> Any:
            return allow if threads and get_ident() in threads else fn(*args)
        return authorizer
    if method == "set_progress_handler":
        def progress() -> Any:
            return 0 if threads and get_ident() in threads else fn()
        return progress

    def trace(statement: str) -> None:
        if not (threads and get_ident() in threads):
            fn(statement)
    return trace


_CALLBACK_ARGS = {"set_authorizer": "authorizer_callback",
                  "set_progress_handler": "progress_handler",
                  "set_trace_callback": "trace_callback"}
"""The connection methods whose callback rehydrate's own statements pass over, and the
keyword name of that callback."""


def _quiet_factory(base: Any, threads: set[int]) -> Any:
    """A subclass of the connection class ``base`` whose callbacks, however they are set
    (through the handle, in ``on_connect``, on a kept reference), pass over rehydrate's
    own statements; None when ``base`` is not a class that can be subclassed so."""
    import sqlite3

    if not (isinstance(base, type) and issubclass(base, sqlite3.Connection)):
        return None

    def quiet(method: str) -> Callable[..., None]:
        keyword = _CALLBACK_ARGS[method]

        def setter(self: sqlite3.Connection, *args: Any, **kwargs: Any) -> None:
            if args and args[0] is not None:
                args = (_quiet_callback(method, args[0], threads), *args[1:])
            elif kwargs.get(keyword) is not None:
                kwargs[keyword] = _quiet_callback(method, kwargs[keyword], threads)
            getattr(base, method)(self, *args, **kwargs)
        setter.__name__ = method
        return setter

    return type(base.__name__, (base,), {
        "__module__": base.__module__, "_rehydrate_quiet": True,
        **{method: quiet(method) for method in _CALLBACK_ARGS}})


class ManagedConnection(_Handle):
    """A ``sqlite3`` connection closed before a snapshot and reopened after.

    Attribute access goes to the current connection; attributes set on the handle
    (``row_factory``, ``isolation_level`` …) are set again on every new connection, then
    ``on_connect(conn)`` runs on SQLite's defaults, then the ``PRAGMA`` s
    ``foreign_keys``, ``recursive_triggers``, ``query_only`` and ``busy_timeout`` that
    it left at their defaults get the values they had at the close (one it changed
    keeps its value; one it set to the default is not told apart from one it did not
    set). Then the databases that were
    attached from a file are attached again (by the URI an ``ATTACH`` through the
    handle's ``execute``/``executescript`` named, else by path), and the
    ``create_function`` / ``create_aggregate`` / ``create_window_function`` /
    ``create_collation`` / ``set_authorizer`` / ``set_progress_handler`` /
    ``set_trace_callback`` calls made through the handle are made again. A snapshot is
    refused while the connection has ``TEMP`` objects or an attached in-memory database
    that ``on_connect`` did not make, or rows in a ``TEMP`` table or in-memory database
    it made (they would be lost; SQLite's own ``sqlite_*`` tables do not count).
    rehydrate's own statements pass over the authorizer, progress handler and trace
    callback, whether set through the handle, in ``on_connect`` or on any reference to
    the connection (on rehydrate's own thread only: they still check and see every other
    thread's statements). ``with handle:`` is the connection's transaction context.
    Cursors do not outlive a snapshot.
    """

    _kind = "sqlite"

    def __init__(self, path: str | os.PathLike[str], *, engine: Engine | None,
                 on_change: OnChange | None, required: bool,
                 on_connect: Callable[[sqlite3.Connection], object] | None,
                 connect_kwargs: dict[str, Any]) -> None:
        if os.fspath(path) == ":memory:" or connect_kwargs.get("uri"):
            raise ValueError("rehydrate.files.sqlite manages a database file by path: an "
                             "in-memory database is held by the snapshot, and URIs are not "
                             "supported")
        super().__init__(path, engine, on_change, required)
        # rehydrate closes and reopens the connection from its hook thread.
        connect_kwargs["check_same_thread"] = False
        internal: set[int] = set()
        import sqlite3

        # The connection's own class makes the callbacks pass over rehydrate's statements:
        # an authorizer on_connect set on the connection it was given refused the
        # PRAGMA and sqlite_master reads of every open, close and reopen.
        quiet = _quiet_factory(connect_kwargs.get("factory", sqlite3.Connection), internal)
        if quiet is not None:
            connect_kwargs["factory"] = quiet
        object.__setattr__(self, "_kwargs", connect_kwargs)
        object.__setattr__(self, "_on_connect", on_connect)
        object.__setattr__(self, "_attrs", {})
        object.__setattr__(self, "_calls", {})
        object.__setattr__(self, "_pragmas", {})
        object.__setattr__(self, "_attached", [])
        object.__setattr__(self, "_attach_args", {})
        object.__setattr__(self, "_made", (frozenset(), frozenset(), []))
        object.__setattr__(self, "_internal", internal)
        object.__setattr__(self, "_conn", self._connect())
        self._register()

    _kwargs: dict[str, Any]
    _on_connect: Callable[[sqlite3.Connection], object] | None
    _attrs: dict[str, Any]
    _calls: dict[tuple[Any, ...], tuple[str, tuple[Any, ...], dict[str, Any]]]
    """Registration calls made through the handle, by what they register (a later call
    for the same function name and arity, collation or callback replaces the earlier)."""
    _pragmas: dict[str, int]
    _attached: list[tuple[str, str, str]]
    """(schema name, file, what attaches it: the file or its URI) of the databases
    attached from a file at the close."""
    _attach_args: dict[str, str | None]
    """The URI an ``ATTACH`` through the handle named, by schema name (lower case); None:
    attached by a plain path."""
    _made: tuple[frozenset[tuple[str, str]], frozenset[str], list[tuple[str, str]]]
    """The TEMP objects and in-memory attachments on_connect made (not refused)."""
    _internal: set[int]
    """The threads (by ident) running rehydrate's own statements on the connection."""
    _conn: sqlite3.Connection

    def _connect(self) -> sqlite3.Connection:
        import sqlite3

        try:
            conn: sqlite3.Connection = sqlite3.connect(self.path, **self._kwargs)
        except sqlite3.OperationalError as exc:  # "unable to open database file": which?
            raise sqlite3.OperationalError(f"{self.path}: {exc}") from exc
        # sqlite3 does not give its descriptor: stat the path just after connecting (the
        # file sqlite3 opened, unless it was replaced in between).
        try:
            key: tuple[int, int] | None = _file_key(os.stat(self.path))
        except OSError:
            key = None
        object.__setattr__(self, "_opened_key", key)
        for k, v in self._attrs.items():
            setattr(conn, k, v)
        try:
            # on_connect runs on SQLite's defaults, as on the first connection: set before
            # it, a saved query_only=ON failed its migration and foreign_keys=ON made a
            # table rebuild cascade deletes. A saved value is set after it unless
            # on_connect changed that PRAGMA (the restored clone's configuration wins).
            with _own_statements(self._internal):
                defaults = _pragma_values(conn) if self._pragmas else {}
            if self._on_connect is not None:
                self._on_connect(conn)
            with _own_statements(self._internal), contextlib.ExitStack() as autocommit:
                # Not when on_connect left writes uncommitted: autocommit would commit them.
                if not (conn.in_transaction and _writing(conn)):
                    autocommit.enter_context(_autocommit_on(conn))
                if self._pragmas:
                    now = _pragma_values(conn)
                    for name, value in self._pragmas.items():
                        if now.get(name) == defaults.get(name) and now.get(name) != value:
                            conn.execute(f"PRAGMA {name} = {int(value)}")  # ours; ints
                # What on_connect made lives in every connection it makes: only what was
                # added after it would be lost at a close.
                made = _connection_state(conn)
                self._restore_session(conn)
        except BaseException:
            conn.close()  # not half made: the handle stays suspended, nothing held open
            raise
        object.__setattr__(self, "_made", made)
        return conn

    def _restore_session(self, conn: sqlite3.Connection) -> None:
        """What the closed connection had beyond its file and PRAGMAs: ATTACHes, then the
        registrations (last: an authorizer of a connection class rehydrate could not
        derive from could refuse the ATTACH statements, a trace callback would see them)."""
        present = {row[1] for row in _rows(conn, "PRAGMA database_list")}
        for schema, file, target in self._attached:
            if schema in present:
                continue  # attached again by on_connect
            if not os.path.isfile(file):
                # ATTACH would make a new, empty database there and hide the loss.
                raise ReopenFailed(f"SQLite database {self.path}: attached database "
                                   f"{schema!r} ({file}) is gone: not attached again")
            conn.execute("ATTACH DATABASE ? AS " + _quote_ident(schema), (target,))
        for method, args, kwargs in self._calls.values():
            getattr(conn, method)(*args, **kwargs)

    # ATTACH statements run through the handle: a URI's parameters (mode=ro,
    # immutable=1) are not in PRAGMA database_list, which names the file only.
    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        """``sqlite3.Connection.execute``; an ``ATTACH`` of a URI is attached again by
        that URI after a snapshot."""
        before = self._schemas(sql)
        try:
            return self._conn.execute(sql, parameters)
        finally:
            self._note_attach(sql, parameters, before)

    def executemany(self, sql: str, parameters: Iterable[Any], /) -> sqlite3.Cursor:
        """``sqlite3.Connection.executemany``."""
        return self._conn.executemany(sql, parameters)

    def executescript(self, sql_script: str, /) -> sqlite3.Cursor:
        """``sqlite3.Connection.executescript``; an ``ATTACH`` of a URI literal is attached
        again by that URI after a snapshot."""
        before = self._schemas(sql_script)
        try:
            return self._conn.executescript(sql_script)
        finally:  # a script that failed half-way may have attached some
            self._note_attach(sql_script, (), before)

    def _schemas(self, sql: str) -> frozenset[str] | None:
        """The schema names (lower case) before a statement that may attach or detach
        one; None for any other statement, or when they cannot be read."""
        if _ATTACH_WORD.search(sql) is None:
            return None
        try:
            with _own_statements(self._internal):  # the app's authorizer may deny the PRAGMA
                return frozenset(str(row[1]).lower()
                                 for row in _rows(self._conn, "PRAGMA database_list"))
        except Exception:  # not known (a closed connection): nothing is noted
            return None

    def _note_attach(self, sql: str, parameters: Any, before: frozenset[str] | None) -> None:
        """After ``sql``: the URI of each schema it attached, as its ``ATTACH`` named it
        (a schema that was already there, whose ATTACH failed, is not noted); a schema
        it detached is forgotten."""
        if before is None:
            return
        after = self._schemas(sql)
        if after is None:
            return
        for schema in before - after:
            self._attach_args.pop(schema, None)
        for schema, arg in _attaches(sql, parameters).items():
            if schema in after - before:
                self._attach_args[schema] = (
                    arg if isinstance(arg, str) and arg[:5].lower() == "file:" else None)

    def _record(self, key: tuple[Any, ...], method: str, *args: Any, **kwargs: Any) -> None:
        # The connection's own class wraps the callback (a factory that is not a
        # sqlite3.Connection subclass: wrapped here, for the calls made through the handle).
        if (key in _QUIET and args[0] is not None
                and not getattr(self._conn, "_rehydrate_quiet", False)):
            args = (_quiet_callback(method, args[0], self._internal), *args[1:])
        getattr(self._conn, method)(*args, **kwargs)
        self._calls[key] = (method, args, kwargs)

    def create_function(self, name: str, narg: int, func: Callable[..., Any] | None, *,
                        deterministic: bool = False) -> None:
        """``sqlite3.Connection.create_function``, made again on every new connection."""
        kwargs = {"deterministic": True} if deterministic else {}
        self._record(("function", name.lower(), narg), "create_function", name, narg, func,
                     **kwargs)

    def create_aggregate(self, name: str, n_arg: int, aggregate_class: Any) -> None:
        """``sqlite3.Connection.create_aggregate``, made again on every new connection."""
        self._record(("function", name.lower(), n_arg), "create_aggregate", name, n_arg,
                     aggregate_class)

    def create_window_function(self, name: str, num_params: int, aggregate_class: Any,
                               /) -> None:
        """``sqlite3.Connection.create_window_function``, made again on every new
        connection."""
        self._record(("function", name.lower(), num_params), "create_window_function", name,
                     num_params, aggregate_class)

    def create_collation(self, name: str, collation: Callable[[str, str], int] | None,
                         /) -> None:
        """``sqlite3.Connection.create_collation``, made again on every new connection."""
        self._record(("collation", name.lower()), "create_collation", name, collation)

    def set_authorizer(self, authorizer_callback: Callable[..., int] | None) -> None:
        """``sqlite3.Connection.set_authorizer``, set again on every new connection."""
        self._record(("authorizer",), "set_authorizer", authorizer_callback)

    def set_progress_handler(self, progress_handler: Callable[[], int | None] | None,
                             n: int) -> None:
        """``sqlite3.Connection.set_progress_handler``, set again on every new connection."""
        self._record(("progress",), "set_progress_handler", progress_handler, n)

    def set_trace_callback(self, trace_callback: Callable[[str], object] | None) -> None:
        """``sqlite3.Connection.set_trace_callback``, set again on every new connection."""
        self._record(("trace",), "set_trace_callback", trace_callback)

    def _close_now(self) -> None:
        conn = self._conn
        if conn.in_transaction and not _autocommit_off(conn):
            raise SnapshotRefused(
                f"SQLite database {self.path} has a transaction open: commit or roll it "
                "back before the snapshot (its -wal/-shm files would be in the image)")
        # rehydrate's own statements below run without the application's callbacks: an
        # authorizer that denies reading sqlite_master refused every snapshot, and a
        # trace callback saw them. Passed over on this thread only: cleared on the
        # connection, they let another thread's statements through unchecked meanwhile.
        with _own_statements(self._internal):
            # autocommit=False keeps a transaction open at all times: refused only when
            # it may have written. One that did not is ended for the statements below
            # (its read snapshot would stop the checkpoint).
            writing = _writing(conn) if conn.in_transaction else None
            if writing is not None:
                raise SnapshotRefused(
                    f"SQLite database {self.path} has a transaction open that may hold "
                    f"uncommitted writes ({writing}): commit or roll it back before the "
                    "snapshot")
            with _autocommit_on(conn):
                pragmas, files_ = self._checkpoint_for_close(conn)
            conn.close()
        object.__setattr__(self, "_pragmas", pragmas)
        object.__setattr__(self, "_attached", [
            (schema, file, self._attach_target(schema, file)) for schema, file in files_])

    def _checkpoint_for_close(self, conn: sqlite3.Connection
                              ) -> tuple[dict[str, int], list[tuple[str, str]]]:
        """Refuses a close that would lose what lives only in the connection, then moves
        the WAL into the database; returns the session PRAGMAs and the attached files."""
        import sqlite3

        temp, memory, files_ = _connection_state(conn, with_files=True)
        made_temp, made_memory, _ = self._made
        # What on_connect made is made again by it, empty: a view, trigger or index
        # is whole again, a table or in-memory database only while it holds no row
        # (the rows the application put in one were lost without a word).
        lost = [f"TEMP {kind} {name}" for kind, name in sorted(temp - made_temp)] + [
            f"rows in TEMP table {name}" for kind, name in sorted(temp & made_temp)
            if kind == "table" and _has_rows(conn, "temp", name)] + [
            f"attached in-memory database {schema}"
            for schema in sorted(memory - made_memory)] + [
            f"rows in attached in-memory database {schema}"
            for schema in sorted(memory & made_memory) if _has_rows(conn, schema)]
        if lost:
            raise SnapshotRefused(
                f"SQLite database {self.path} would lose {', '.join(lost)} (they live "
                "in the connection, which is closed for the snapshot): drop, empty or "
                "detach them before it")
        pragmas = _pragma_values(conn)
        # Moves the WAL into the database so the host sees every committed row (every
        # attached database's too: no schema named).
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.OperationalError as exc:
            if not _statement_running(exc):
                raise
            # A cursor kept half read (self.cur.execute(...).fetchone()) refused every
            # snapshot with SQLite's bare "database table is locked".
            raise SnapshotRefused(
                f"SQLite database {self.path} has a statement still running (a cursor "
                "not read to its end): fetch its rows or close() it before the "
                "snapshot") from exc
        return pragmas, files_

    def _attach_target(self, schema: str, file: str) -> str:
        """What attaches ``schema`` again: the URI its ``ATTACH`` through the handle
        named, when it names this very file, else the file's path."""
        uri = self._attach_args.get(schema.lower())
        if uri is None:
            return file
        from urllib.parse import unquote, urlsplit

        parts = urlsplit(uri)
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path:
            return file
        same = os.path.realpath(path) == os.path.realpath(file)
        return uri if same else file

    def _open_now(self, same: bool) -> None:
        object.__setattr__(self, "_conn", self._connect())

    def _close_for_good(self) -> None:
        self._conn.close()  # sqlite3's close(): an open transaction is rolled back

    def _target(self) -> Any:
        return self._conn

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._conn, name, value)
        self._attrs[name] = value

    def __enter__(self) -> sqlite3.Connection:
        return self._conn.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._conn.__exit__(*exc)

    def __repr__(self) -> str:
        return f"<rehydrate.files.ManagedConnection {self.path!r}>"


class ManagedMap(_Handle):
    """A ``MAP_SHARED`` mapping of a file, flushed and unmapped before a snapshot and
    remapped after (slicing, ``len``, ``flush`` … go to the current ``mmap.mmap``).

    ``length=0`` maps the whole file, whatever its size after a restore; a fixed length
    that no longer fits the file fails the reopen hook naming the path (touching a
    truncated shared mapping kills the process). The handle is not a buffer itself:
    :attr:`mapping` is the current ``mmap.mmap`` for what needs one. Release
    ``memoryview`` s of it before a snapshot: an exported buffer cannot be unmapped.
    ``ACCESS_COPY`` is refused (its private changes would not survive the unmap).
    """

    _kind = "mmap"

    def __init__(self, path: str | os.PathLike[str], *, length: int, access: int, offset: int,
                 engine: Engine | None, on_change: OnChange | None, required: bool
                 ) -> None:
        import mmap as _mmap

        if access == _mmap.ACCESS_COPY:
            # Its changes live only in the process's private pages, which the unmap
            # before every snapshot discarded: a plain resume came back without them.
            raise ValueError(f"rehydrate.files.mmap: an ACCESS_COPY mapping of "
                             f"{os.fsdecode(path)} would lose its private changes at every "
                             "snapshot (it is unmapped and mapped again): use ACCESS_WRITE, "
                             "ACCESS_READ, or read the file into a bytearray, which the "
                             "snapshot holds")
        super().__init__(path, engine, on_change, required)
        object.__setattr__(self, "length", length)
        object.__setattr__(self, "access", access)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "_map", self._map_now())
        self._register()

    length: int
    access: int
    offset: int
    _map: _mmap.mmap

    def _map_now(self) -> _mmap.mmap:
        import mmap as _mmap

        mode = "rb" if self.access in (_mmap.ACCESS_READ, _mmap.ACCESS_COPY) else "r+b"
        with builtins.open(self.path, mode) as f:
            st = os.fstat(f.fileno())
            object.__setattr__(self, "_opened_key", _file_key(st))
            size = st.st_size
            if self.length and size < self.offset + self.length:
                raise ReopenFailed(f"managed mapping of {self.path}: the file has {size} "
                                   f"bytes, the mapping needs {self.offset + self.length}")
            return _mmap.mmap(f.fileno(), self.length, access=self.access, offset=self.offset)

    def _close_now(self) -> None:
        import mmap as _mmap

        m = self._map
        if not m.closed:
            if self.access in (_mmap.ACCESS_WRITE, _mmap.ACCESS_DEFAULT):
                m.flush()
            m.close()

    def _is_closed(self) -> bool:
        return bool(self._map.closed)

    def _open_now(self, same: bool) -> None:
        object.__setattr__(self, "_map", self._map_now())

    def _target(self) -> Any:
        return self._map

    @property
    def mapping(self) -> _mmap.mmap:
        """The current ``mmap.mmap``: what takes a buffer (``memoryview``,
        ``struct.pack_into``, ``re``, ``bytes()``) needs it, the handle is not one. A new
        object after every snapshot: fetch it again each time rather than keeping it, and
        release views of it before a snapshot (an exported buffer cannot be unmapped)."""
        return self._map

    def __getitem__(self, key: Any) -> Any:
        return self._map[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._map[key] = value

    def __len__(self) -> int:
        return len(self._map)

    def __repr__(self) -> str:
        return f"<rehydrate.files.ManagedMap {self.path!r} length={self.length}>"


class Volume:
    """A registered volume: its identity file is compared after every restore."""

    def __init__(self, mount_point: str, on_change: OnChange | None) -> None:
        self.mount_point = os.path.abspath(mount_point)
        self._listeners: list[Callable[[], OnChange | None]] = []
        """Every ``on_change`` given for this volume, in order: a bound method weakly
        (a component dropped stops being called, and is not kept alive by the volume),
        anything else strongly (a lambda given inline has no other owner)."""
        self._listen(on_change)
        self._reopen_ask: float | None = None
        """The largest ``reopen_timeout`` asked for this volume (None: none)."""
        self._unreadable: int | None = None
        """errno of the last failed read of the identity file (warned once), or None."""
        self.identity: str | None = self._read_or_create()
        self.changed = False
        """True when the last restore found another volume (or none) at the mount point."""
        self._before: str | None = self.identity

    @property
    def identity_file(self) -> str:
        """Path of the volume's identity file."""
        return os.path.join(self.mount_point, IDENTITY_FILE)

    def _read(self) -> str | None:
        # Never blocks (a FIFO put there) and reads only a small regular file.
        try:
            data = read_regular(self.identity_file, 256, truncate=True)
        except FileNotFoundError:
            self._unreadable = None
            return None
        except PermissionError as exc:
            # Another user's file (mode 0600 from a pod with another runAsUser): as if
            # missing. Raised, it failed files.volume() and then every before-snapshot
            # pass before any handle was closed. (A FIFO or a directory there is still
            # an error: a misconfiguration, named.)
            if self._unreadable != exc.errno:
                log.warning("volume %s: identity file %s unreadable (%s: %s); treated as "
                            "missing: a swapped volume is detected only by its files' size "
                            "and times", self.mount_point, self.identity_file,
                            errno.errorcode.get(exc.errno or 0, exc.errno),
                            exc.strerror or exc)
            self._unreadable = exc.errno
            return None
        self._unreadable = None
        return data.decode("ascii", "replace").strip() or None

    def _read_or_create(self) -> str | None:
        if not os.path.isdir(self.mount_point):
            what = "is not a directory" if os.path.exists(self.mount_point) else "does not exist"
            raise FileGone(f"volume {self.mount_point} {what}")
        ident = self._read()
        if ident is not None or self._unreadable is not None:
            return ident  # unreadable: warned, and there is one already
        try:
            self._create()
        except OSError as exc:
            log.warning("volume %s: no identity file (%s); a swapped volume is detected "
                        "only by its files' size and times", self.mount_point,
                        exc.strerror or exc)
            return None
        ident = self._read()
        if ident is None and self._unreadable is None:
            log.warning("volume %s: identity file %s is empty; a swapped volume is detected "
                        "only by its files' size and times", self.mount_point,
                        self.identity_file)
        return ident

    def _create(self) -> None:
        """Write a new identity through a temporary file of our own, linked into place."""
        import secrets

        token = secrets.token_hex(16)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        for _ in range(_TMP_ATTEMPTS):
            # A random name, not the PID: a temporary file left by a killed run (PID 1 in
            # every container) or being written by a clone of this very process (same
            # PID) is another writer's, neither reused nor deleted.
            tmp = f"{self.identity_file}.{secrets.token_hex(8)}.tmp"
            try:
                fd = os.open(tmp, flags, 0o666)
            except FileExistsError:
                continue
            break
        else:
            raise OSError(errno.EEXIST, f"no free temporary file name in {_TMP_ATTEMPTS} tries")
        try:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(token + "\n")
            with contextlib.suppress(FileExistsError):
                os.link(tmp, self.identity_file)  # never replaces an identity written meanwhile
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # ours: O_EXCL made it

    def _suspend(self) -> None:
        self._before = self._read()

    def _check(self) -> bool:
        """After restore/resume: True (and a warning) when the volume is another one."""
        now = self._read() if os.path.isdir(self.mount_point) else None
        if self._before is not None and now != self._before:
            self.changed = True
            log.warning("volume %s is not the volume of the snapshot (identity %s, was %s): "
                        "its managed handles are reopened as changed",
                        self.mount_point, now or "missing", self._before)
            if now is None and os.path.isdir(self.mount_point):
                now = self._read_or_create()
            self.identity = now
            errors: list[str] = []
            for cb in self._callbacks():
                # Every component hears of it, whichever callback failed before it.
                try:
                    cb(self)
                except Exception as exc:
                    errors.append(f"on_change {_callable_name(cb)}: "
                                  f"{type(exc).__name__}: {exc}")
            if errors:
                raise ReopenFailed("; ".join(errors))
            return True
        self.changed = False
        return False

    @property
    def on_change(self) -> OnChange | None:
        """The first ``on_change`` given for this volume that is still alive."""
        live = self._callbacks()
        return live[0] if live else None

    def _callbacks(self) -> list[OnChange]:
        return [cb for cb in (ref() for ref in list(self._listeners)) if cb is not None]

    def _listen(self, on_change: OnChange | None) -> None:
        """A :func:`volume` call for this volume (under the manager's lock): its
        ``on_change`` is called too."""
        # Pruned here, not while the reopen hook reads the list: no registration is lost.
        self._listeners = [ref for ref in self._listeners if ref() is not None]
        if on_change is None or any(cb == on_change for cb in self._callbacks()):
            return
        ref: Callable[[], OnChange | None]
        try:
            # A bound method held strongly kept its object (a per-tenant store, a
            # request's cache) alive for good, and called it at every swap.
            ref = weakref.WeakMethod(on_change)
        except TypeError:  # a function, a lambda, a callable object
            def ref() -> OnChange:
                return on_change
        self._listeners.append(ref)

    def contains(self, path: str) -> bool:
        """True when ``path`` lies on this volume, as given or with symbolic links
        resolved (a volume registered as ``/data -> /mnt/disk1`` and a handle opened as
        ``/mnt/disk1/a.txt``, or the other way round)."""
        if _under(path, self.mount_point):
            return True
        return _under(os.path.realpath(path), os.path.realpath(self.mount_point))

    def describe(self) -> dict[str, Any]:
        """What ``status()["files"]`` shows for this handle."""
        return {"mount_point": self.mount_point, "identity": self.identity,
                "changed": self.changed}


# -- the audit --------------------------------------------------------------------------


@dataclass(frozen=True)
class MountInfo:
    """One line of ``/proc/PID/mountinfo``."""

    mount_point: str
    fstype: str
    source: str
    held: bool
    """True when the snapshot holds the content (root file system, tmpfs, pseudo fs)."""


@dataclass(frozen=True)
class OpenFile:
    """A descriptor open on a volume (a mount the snapshot does not hold)."""

    fd: int
    path: str
    deleted: bool
    mount_point: str
    fstype: str
    managed: bool | None = None
    """Whether a rehydrate handle manages it (None: unknown, another process)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``doctor --files --json``, ``status()``)."""
        return {"fd": self.fd, "path": self.path, "deleted": self.deleted,
                "mount_point": self.mount_point, "fstype": self.fstype,
                "managed": self.managed}


def _under(path: str, point: str) -> bool:
    return path == point or path.startswith(point.rstrip("/") + "/")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _held_from_env() -> tuple[str, ...]:
    return tuple(os.path.abspath(p) for p in _config.items("REHYDRATE_HELD_MOUNTS"))


def mounts(pid: int | str = "self", *, proc: str = "/proc",
           held: Iterable[str] | None = None) -> list[MountInfo]:
    """The mounts of process ``pid``, each marked held by the snapshot or not.

    ``held``: extra mount points the snapshot holds (default ``$REHYDRATE_HELD_MOUNTS``).
    """
    extra = set(_held_from_env() if held is None else (os.path.abspath(h) for h in held))
    out = []
    with builtins.open(f"{proc}/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            left, sep, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if not sep or len(fields) < 5 or len(rest) < 2:
                continue
            point = _unescape(fields[4])
            fstype = rest[0]
            held_ = point == "/" or fstype in HELD_FSTYPES or point in extra
            out.append(MountInfo(point, fstype, _unescape(rest[1]), held_))
    return out


def _mount_of(path: str, table: list[MountInfo]) -> MountInfo | None:
    best: MountInfo | None = None
    for m in table:
        p = m.mount_point
        if (path == p or path.startswith(p.rstrip("/") + "/")) and (
                best is None or len(p) >= len(best.mount_point)):
            best = m  # later lines over-mount earlier ones at the same point
    return best


def _unlinked(link: str, target: str) -> bool:
    """Whether the file behind ``link`` (a ``/proc/PID/fd`` entry whose ``target`` ends in
    " (deleted)") is deleted, or a live file whose name merely ends that way."""
    try:
        st = os.stat(link)  # follows the fd's magic link to the open file itself
    except OSError:
        return True  # closed meanwhile, or not ours to stat: the kernel's suffix is all
    if st.st_nlink == 0:
        return True
    # Linked somewhere; it is live under this name only when the name is this file (a
    # file deleted at its path but hard-linked elsewhere, or a link count a network file
    # system reports stale, is still deleted for a checkpoint that reopens by path).
    try:
        return not os.path.samestat(st, os.stat(target))
    except OSError:
        return True


def open_files(pid: int | str = "self", *, proc: str = "/proc",
               held: Iterable[str] | None = None) -> list[OpenFile]:
    """Descriptors of process ``pid`` open on volumes (mounts the snapshot does not hold),
    from ``/proc/PID/fd`` and ``/proc/PID/mountinfo``; deleted files are flagged (a live file
    whose name ends in " (deleted)" is not)."""
    table = mounts(pid, proc=proc, held=held)
    fd_dir = f"{proc}/{pid}/fd"
    out = []
    for name in sorted(os.listdir(fd_dir), key=lambda n: int(n) if n.isdigit() else -1):
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor, for one)
        if not target.startswith("/"):
            continue  # pipe:[…], socket:[…], anon_inode:…, host:[…]
        deleted = target.endswith(_DELETED) and _unlinked(f"{fd_dir}/{name}", target)
        path = target[: -len(_DELETED)] if deleted else target
        m = _mount_of(path, table)
        if m is None or m.held:
            continue
        out.append(OpenFile(int(name), path, deleted, m.mount_point, m.fstype))
    return out


# -- the per-engine manager -------------------------------------------------------------


class FilesManager:
    """Per-engine handles and volumes, their hooks, and the before-snapshot audit."""

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        self._handles: dict[int, weakref.ref[_Handle]] = {}
        self._volumes: list[Volume] = []
        self._fail_on_deleted: bool | None = None
        self.last_audit: list[OpenFile] = []
        self._reopen_timeout = _REOPEN_TIMEOUT
        self._reopen_floor = _REOPEN_TIMEOUT
        """The largest :meth:`allow_reopen` asked (for good), and at least the default."""
        self._reopen_hook: Hook | None = None
        self._asking: dict[int, weakref.ref[_Handle]] = {}
        """The open handles that asked a ``reopen_timeout``, by id."""
        self._snapshot_passes = 0
        """Before-snapshot passes begun: a late reopen pass stops once it changed."""
        self._reopened_at: int | None = None
        """``_snapshot_passes`` when the last reopen pass reopened every handle (None: one
        is running, or the last failed or stopped)."""
        self._pass_running = False
        """A reopen pass is running and has not given up: a restore or resume run that
        finds it still running (HookStillRunning) is left to it."""
        self._closed_by: tuple[int, list[weakref.ref[_Handle]]] = (0, [])
        """The handles the latest before-snapshot pass closed (they were open), and that
        pass's number."""
        self._refused_at: int | None = None
        """``_snapshot_passes`` of the latest before-snapshot pass that was refused (by any
        hook) after closing the handles."""
        self.proc = "/proc"
        """Where ``self/fd`` and ``self/mountinfo`` are read (tests point it at a fake tree)."""
        self._hooked = False
        # ENVIRONMENT runs last before a snapshot, and an order below the user range last
        # in it (lower runs later before a snapshot): every hook has closed its files.
        engine.builtins.register(self._audit_hook, event="snapshot", phase=Phase.ENVIRONMENT,
                                 order=BEFORE_USER_HOOKS, name="rehydrate.files.audit",
                                 timeout=10.0)
        engine.add_status("files", self.status)

    @property
    def fail_on_deleted(self) -> bool:
        """Fail the before-snapshot pass on a deleted file open on a volume (default: under
        gVisor, where the checkpoint itself would fail; elsewhere a warning). Decided at
        the first audit, not when the engine is made."""
        if self._fail_on_deleted is None:
            from ._gvisor import running_under_gvisor

            self._fail_on_deleted = running_under_gvisor()
        return self._fail_on_deleted

    @fail_on_deleted.setter
    def fail_on_deleted(self, value: bool) -> None:
        self._fail_on_deleted = value

    def _hook_in(self) -> None:
        """Register the close/reopen hooks with the first handle or volume."""
        engine = self._engine()
        if self._hooked or engine is None:
            return
        self._hooked = True
        b = engine.builtins
        b.register(self._before_snapshot, event="snapshot", phase=Phase.CONNECTIONS,
                   order=1_000_000, name="rehydrate.files.close", timeout=30.0)
        self._reopen_hook = self._register_reopen(self._reopen_timeout)
        engine.add_listener(self._on_report)

    def _register_reopen(self, timeout: float) -> Hook:
        engine = self._engine()
        assert engine is not None
        return engine.builtins.register(
            self._after_restore, event="restore", phase=Phase.CONNECTIONS, order=-1_000_000,
            name="rehydrate.files.reopen", timeout=timeout)

    @property
    def reopen_timeout(self) -> float:
        """Timeout of the ``rehydrate.files.reopen`` hook: the largest ``reopen_timeout``
        asked by a handle still open, a volume or :meth:`allow_reopen`, and never less
        than the 30 s default."""
        return self._reopen_timeout

    def allow_reopen(self, reopen_timeout: float) -> None:
        """Let the ``rehydrate.files.reopen`` hook run up to ``reopen_timeout`` seconds
        (every handle's reopen and ``on_change``, one after another) for as long as this
        manager lives — a handle's ``reopen_timeout`` counts only while it is open.
        ``ValueError``/``TypeError`` for a value that is not a number of seconds > 0 and
        at most a year."""
        timeout = _config.seconds(reopen_timeout, "reopen_timeout")
        with self._lock:
            self._reopen_floor = max(self._reopen_floor, timeout)
        self._apply_reopen_timeout()

    def _ask_reopen(self, owner: _Handle | Volume, reopen_timeout: float | None) -> None:
        """``owner`` (made: a failed open asks nothing) asks ``reopen_timeout`` seconds."""
        if reopen_timeout is None:
            return
        with self._lock:
            if isinstance(owner, Volume):  # a volume stays registered: its largest ask stays
                owner._reopen_ask = max(owner._reopen_ask or 0.0, reopen_timeout)
            elif id(owner) in self._handles:  # not closed meanwhile
                object.__setattr__(owner, "_reopen_ask", reopen_timeout)
                self._asking[id(owner)] = weakref.ref(owner)
        self._apply_reopen_timeout()

    def _apply_reopen_timeout(self) -> None:
        """Register the reopen hook again when the largest ask changed (up or down: a
        closed handle's ask no longer counts; a handle dropped without close() counts
        until the next handle is opened or closed). Counted and applied under the lock:
        counted outside, a close() racing an open() wrote back the ask before it."""
        with self._lock:
            asks = [v._reopen_ask for v in self._volumes]
            for key, ref in list(self._asking.items()):
                h = ref()
                if h is None:
                    del self._asking[key]  # dropped without close()
                else:
                    asks.append(h._reopen_ask)
            timeout = max([self._reopen_floor] + [a for a in asks if a is not None])
            if timeout == self._reopen_timeout:
                return
            old = self._reopen_hook
            if old is not None:
                # The new hook before the old one goes: a refusal keeps the hook there was.
                engine = self._engine()
                if engine is None:
                    return
                self._reopen_hook = self._register_reopen(timeout)
                engine.builtins.unregister(old)
            self._reopen_timeout = timeout

    # registry
    def _add(self, handle: _Handle) -> None:
        key = id(handle)
        handles = self._handles

        def forget(ref: weakref.ref[_Handle]) -> None:
            # Runs inside garbage collection, maybe under self._lock: no lock here (the
            # GIL makes the check-and-pop safe enough; a reused id holds another ref).
            if handles.get(key) is ref:
                handles.pop(key, None)

        with self._lock:
            handles[key] = weakref.ref(handle, forget)
            self._hook_in()
        if self._asking:  # one may have been dropped: its ask ends here
            self._apply_reopen_timeout()

    def _remove(self, handle: _Handle) -> None:
        with self._lock:
            self._handles.pop(id(handle), None)
            asked = self._asking.pop(id(handle), None) is not None
        if asked or self._asking:
            self._apply_reopen_timeout()

    def handles(self) -> list[_Handle]:
        """The live managed handles, in registration order."""
        with self._lock:
            refs = list(self._handles.values())
        return [h for h in (r() for r in refs) if h is not None]

    def add_volume(self, mount_point: str | os.PathLike[str],
                   on_change: OnChange | None) -> Volume:
        """Register the volume at ``mount_point`` (once: a second call returns it, adding
        its ``on_change``, if another, to those called)."""
        point = os.path.abspath(os.fspath(mount_point))
        with self._lock:
            for v in self._volumes:
                if v.mount_point == point:
                    v._listen(on_change)
                    return v
        vol = Volume(point, on_change)  # outside the lock: it reads and writes the volume
        with self._lock:
            for v in self._volumes:
                if v.mount_point == point:  # another thread registered it meanwhile
                    v._listen(on_change)
                    return v
            self._volumes.append(vol)
            self._hook_in()
        return vol

    def volumes(self) -> list[Volume]:
        """The registered volumes."""
        with self._lock:
            return list(self._volumes)

    def status(self) -> dict[str, Any]:
        """``status()["files"]``: handles, volumes and the last audit."""
        return {"handles": [h.describe() for h in self.handles()],
                "volumes": [v.describe() for v in self.volumes()],
                "last_audit": [f.to_dict() for f in self.last_audit]}

    # hooks
    def _before_snapshot(self) -> None:
        with self._lock:
            self._snapshot_passes += 1
            passes = self._snapshot_passes
        closed: list[weakref.ref[_Handle]] = []
        errors: list[Exception] = []
        for vol in self.volumes():
            try:
                vol._suspend()
            except Exception as exc:  # the handles are closed all the same
                errors.append(SnapshotRefused(f"volume {vol.mount_point}: "
                                              f"{type(exc).__name__}: {exc}"))
        for h in reversed(self.handles()):
            try:
                if h._suspend():
                    closed.append(weakref.ref(h))
            except Exception as exc:
                if h._suspended:  # closed all the same
                    closed.append(weakref.ref(h))
                errors.append(exc)
        with self._lock:
            self._closed_by = (passes, closed)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise SnapshotRefused("managed handles could not be closed: " + "; ".join(
                str(e) if isinstance(e, SnapshotRefused) else f"{type(e).__name__}: {e}"
                for e in errors))

    def _after_restore(self, ctx: RestoreContext) -> None:
        with self._lock:
            self._pass_running = True
        try:
            self._reopen_pass(ctx)
        finally:
            with self._lock:
                self._pass_running = False

    def _reopen_pass(self, ctx: RestoreContext) -> None:
        on_behalf = False
        while True:
            began = time.monotonic()
            with self._lock:
                passes = self._snapshot_passes
                self._reopened_at = None  # reopening: not every handle is open

            def stale(passes: int = passes) -> bool:
                # A pass that outlived its timeout, still running when the next snapshot
                # began: reopening a handle that snapshot had closed put its descriptor
                # in the image.
                return self._snapshot_passes != passes

            try:
                self._reopen_all(ctx.kind, stale)
                with self._lock:
                    # Checked again once every handle is done: a snapshot that began
                    # inside the last handle's on_change closed handles this pass had
                    # reopened, and the pass went on to mend the run after it (ready with
                    # every handle closed). One that begins after this closes them itself.
                    if stale():
                        raise _PassStopped
                    self._reopened_at = passes
                engine, hook = self._engine(), self._reopen_hook
                if engine is not None and hook is not None:
                    self._recovered(engine, hook, began)
                if not stale():
                    return
                # A snapshot and a run after it came between the check and the mend: that
                # run may have been mended with its handles closed; reopened for it below.
            except _PassStopped:
                pass
            with self._lock:
                # Decided under the lock _on_report takes: a run that began after this
                # finds the pass given up and reopens for itself; one before it is owed.
                owed = self._owed()
                if not owed:
                    self._pass_running = False
            if not owed:
                log.info("rehydrate.files.reopen: a snapshot began while this reopen pass "
                         "ran late: stopped; the next restore or resume reopens the handles "
                         "left")
                if on_behalf:
                    return  # the run it worked for ended long ago: not a failure of it
                raise ReopenFailed("reopen pass stopped: a snapshot began while it ran")
            # The restore or resume of that snapshot found this pass still running
            # (HookStillRunning) and reopened nothing: nothing else would until the next
            # snapshot. Its reopen is done here, on its behalf.
            log.info("rehydrate.files.reopen: a snapshot began and ended while this reopen "
                     "pass ran late: reopening again for the restore or resume after it")
            on_behalf = True

    def _owed(self) -> bool:
        """After a late pass stopped: True when a restore or resume run began after the
        snapshot that stopped it (runs and passes take turns: a run in progress, or a
        finished one reported after that pass) — its own reopen hook found this pass
        still running, or has yet to run and finds every handle open."""
        engine = self._engine()
        if engine is None:
            return False
        status = engine.status(fields=())  # state and report: no published field
        if status.state == "restoring":
            return True
        last = status.last_report
        return (status.state in ("ready", "degraded") and last is not None
                and last.kind != "snapshot")

    def _on_report(self, report: Report) -> None:
        """A restore or resume run that found the reopen pass still running
        (HookStillRunning), with no snapshot since: when that pass reopened every handle,
        mended (the pass's own :meth:`_recovered` ran while that run was still going,
        before the run had failed the hook, or before it ended); when it had given up
        (stopped by a snapshot, its thread not ended yet), every handle is reopened here
        for that run; when it is still running and the snapshot before that run was
        refused, the handles that snapshot closed are reopened here at once (they were
        open before it; the pass reopens the rest when it is done)."""
        from ._context import HookStillRunning

        hook, engine = self._reopen_hook, self._engine()
        if hook is None or engine is None:
            return
        if report.kind == "snapshot":
            if not report.ok and any(r.name == "rehydrate.files.close"
                                     for r in report.hooks):
                with self._lock:
                    self._refused_at = self._snapshot_passes
            return
        if report.ok or not any(r.name == hook.name and isinstance(r.error, HookStillRunning)
                                for r in report.hooks):
            return
        # The count first: a before-snapshot pass that begins once it is read makes the
        # reopen below stale(). Read after the pending check, it took in a pass whose
        # close ran in between (every handle reopened while that snapshot was pending).
        with self._lock:
            passes = self._snapshot_passes
        if getattr(engine, "snapshot_pending", False):
            return  # a newer before-snapshot pass: a handle reopened now is in its image
        with self._lock:
            if self._reopened_at == passes:
                mend: str | None = "recovered"
            elif not self._pass_running:
                mend = "all"
            elif self._refused_at == passes and self._closed_by[0] == passes:
                mend = "refused"
            else:
                mend = None  # the pass reopens for this run when it is done
            closed = [h for h in (r() for r in self._closed_by[1]) if h is not None]
        if mend == "recovered":
            engine.recovered(hook)
        elif mend is not None:
            self._reopen_for(report, engine, hook, passes,
                             None if mend == "all" else closed)

    def _reopen_for(self, report: Report, engine: Engine, hook: Hook, passes: int,
                    handles: list[_Handle] | None) -> None:
        """Reopen for the run of ``report``, whose reopen hook could not start: ``handles``
        (None: every volume and handle, then the hook's failure in that run mended). In a
        thread of its own, waited for as long as the hook's timeout: an ``on_change`` does
        not hold the caller (the control socket's reply) for ever."""

        def stale() -> bool:
            return self._snapshot_passes != passes

        def run() -> None:
            try:
                if handles is not None:
                    for h in handles:
                        h._resume(False, stale)
                    log.info("rehydrate.files.reopen: the refused snapshot's %d closed "
                             "handle(s) reopened for the %s; the late reopen pass reopens "
                             "the rest when it is done", len(handles), report.kind)
                    return
                self._reopen_all(report.kind, stale)
                with self._lock:
                    if stale():
                        return
                    self._reopened_at = passes
                engine.recovered(hook)
            except _PassStopped:
                pass  # a snapshot began: its own resume or restore reopens them
            except Exception as exc:
                log.warning("rehydrate.files.reopen: reopening for the %s that found the "
                            "reopen pass still running failed: %s: %s", report.kind,
                            type(exc).__name__, exc)

        worker = threading.Thread(target=run, name="rehydrate-files-reopen", daemon=True)
        worker.start()
        worker.join(self._reopen_timeout)

    @staticmethod
    def _recovered(engine: Engine, hook: Hook, began: float) -> None:
        """A pass that outlived the hook's timeout (a slow on_change) reopened every
        handle after the run had ended degraded: nothing else would ever make the process
        ready again. Within the run this is a no-op (the hook has not failed); since=: a
        run begun after this pass is not mended by it — unless all that run did to this
        hook was find this very pass still running (HookStillRunning): it rejected
        nothing, and no snapshot came between (the pass would have stopped). Such a run
        still going is mended when it ends (``recovered()`` during a run counts for a hook
        that already failed in it; :meth:`_on_report` for one that fails it later)."""
        from ._context import HookStillRunning

        if engine.recovered(hook, since=began):
            return
        status = engine.status(fields=())  # state and report: no published field
        if status.state == "restoring":
            engine.recovered(hook)
            return
        last = status.last_report
        if status.state != "degraded" or last is None:
            return
        if any(r.name == hook.name and isinstance(r.error, HookStillRunning)
               for r in last.hooks):
            engine.recovered(hook)

    def _reopen_all(self, kind: str, stale: Callable[[], bool]) -> None:
        changed_volumes: list[Volume] = []
        failures: list[str] = []
        gone: list[str] = []
        for vol in self.volumes():
            if stale():
                raise _PassStopped
            try:
                if vol._check():
                    changed_volumes.append(vol)
            except Exception as exc:
                # Its identity is unknown (unreadable) or its on_change failed: its handles
                # are reopened as changed, and every other handle is reopened anyway.
                changed_volumes.append(vol)
                failures.append(f"volume {vol.mount_point}: {type(exc).__name__}: {exc}")
        for h in self.handles():
            on_changed = any(v.contains(h.path) for v in changed_volumes)
            try:
                h._resume(on_changed, stale)
            except _PassStopped:
                raise
            except Exception as exc:
                if isinstance(exc, FileGone):
                    gone.append(h.path)
                msg = str(exc) if isinstance(exc, (FileGone, ReopenFailed)) else (
                    f"{h.path}: {type(exc).__name__}: {exc}")
                if h.required:
                    failures.append(msg)
                else:
                    log.warning("optional managed %s not reopened after %s: %s", h._kind,
                                kind, msg)
        if failures:
            text = "; ".join(failures)
            raise FileGone(text) if len(gone) == len(failures) else ReopenFailed(text)

    def audit(self) -> list[OpenFile]:
        """Descriptors of this process on volumes, marked managed or not."""
        return _mark_managed(open_files(proc=self.proc), self.status())

    def _audit_hook(self) -> None:
        try:
            found = self.audit()
        except OSError as exc:  # no /proc here (not Linux, a locked-down sandbox)
            log.info("before-snapshot audit of open files skipped: %s", exc.strerror or exc)
            return
        self.last_audit = found
        deleted = [f for f in found if f.deleted]
        unmanaged = [f for f in found if not f.managed and not f.deleted]
        if unmanaged:
            log.warning("before snapshot: %d descriptor(s) open on volumes the snapshot does "
                        "not hold, not managed by rehydrate.files (restored by path, with no "
                        "change check): %s", len(unmanaged),
                        ", ".join(f"{f.path} (fd {f.fd})" for f in unmanaged))
        wal = sorted({f.path[:-4] for f in unmanaged if f.path.endswith(("-wal", "-shm"))})
        if wal:
            log.warning("before snapshot: SQLite database(s) %s in WAL mode held open "
                        "unmanaged: if the host's last connection closes before the restore, "
                        "SQLite deletes the -wal/-shm files and the restore fails; open them "
                        "with rehydrate.files.sqlite()", ", ".join(wal))
        if not deleted:
            return
        text = ", ".join(f"{f.path} (fd {f.fd} on {f.mount_point})" for f in deleted)
        if self.fail_on_deleted:
            raise SnapshotRefused(f"deleted file(s) held open on a volume: {text}; gVisor "
                                  "cannot checkpoint them — close them before the snapshot")
        log.warning("before snapshot: deleted file(s) held open on a volume: %s (gVisor "
                    "would refuse to checkpoint this)", text)


def manager(engine: Engine | None = None) -> FilesManager:
    """The :class:`FilesManager` of ``engine`` (default: the default engine)."""
    return resolve_engine(engine).extension("files", FilesManager)


key = "files"


def probe() -> Probe:
    """Always usable: the audit reads ``/proc/self``, and reports nothing when it cannot."""
    return Probe(True)


def install(engine: Engine) -> None:
    """Attach the manager (and so the before-snapshot audit) to ``engine``."""
    manager(engine)


# -- public constructors ----------------------------------------------------------------


def open(  # the pinned name, rehydrate.files.open, shadows the builtin on purpose
    path: str | os.PathLike[str],
    mode: str = "r",
    *,
    engine: Engine | None = None,
    on_change: OnChange | None = None,
    required: bool = True,
    reopen_timeout: float | None = None,
    **open_kwargs: Any,
) -> ManagedFile:
    """Open ``path`` like :func:`builtins.open`, closed before a snapshot and reopened after.

    After a restore or resume the file is reopened at the same position when its size,
    ``st_mtime_ns`` and ``st_ctime_ns`` match those recorded before the snapshot (and its
    volume is the same); otherwise with ``.changed`` True and ``on_change(handle)``
    called, at offset 0 — or, for a mode that writes in place (``w``, ``x``, ``r+``,
    ``w+``, ``x+``), at the end of the file, so the next write adds to it instead of
    overwriting its head (``seek(0)`` in ``on_change`` to read it from the start), and
    for ``a`` at the end too (``a+``: at offset 0, its writes still appended). A
    file gone after restore fails the ``rehydrate.files.reopen`` hook with its path
    (``required=False``: a warning). ``reopen_timeout``: see :func:`volume`. A file
    that cannot seek (a FIFO, a socket, a terminal) cannot be reopened where it was: it
    is refused with ``ValueError`` (a FIFO before it is opened, which would wait for a
    writer).
    """
    ask = _reopen_seconds(reopen_timeout)
    f = ManagedFile(path, mode, engine=engine, on_change=on_change, required=required,
                    open_kwargs=open_kwargs)
    f._manager._ask_reopen(f, ask)
    return f


def sqlite(
    path: str | os.PathLike[str],
    *,
    engine: Engine | None = None,
    on_change: OnChange | None = None,
    on_connect: Callable[[sqlite3.Connection], object] | None = None,
    required: bool = True,
    reopen_timeout: float | None = None,
    **connect_kwargs: Any,
) -> ManagedConnection:
    """A managed ``sqlite3`` connection to the database file ``path``.

    Before a snapshot it checkpoints the WAL and closes (refusing, with the path, while a
    transaction is open; with Python 3.12's ``autocommit=False``, which keeps one open,
    while it may have written), so no ``-wal``/``-shm`` file is held in the image; after a
    restore or resume it reconnects (``.changed`` when the file changed meanwhile). The
    connection is made with ``check_same_thread=False`` (rehydrate closes it from its own
    thread). A volume must have one writer at a time: host and sandbox writing together
    corrupt SQLite, snapshot or not. ``reopen_timeout``: see :func:`volume`.

    ``on_connect(conn)`` runs for every new connection: set there every ``PRAGMA`` other
    than ``foreign_keys``, ``recursive_triggers``, ``query_only`` and ``busy_timeout``
    (``synchronous``, ``cache_size`` …) and load extensions there — the connection is
    made again at every snapshot, and those are lost with the old one. ``factory``, when
    given, must be a ``sqlite3.Connection`` subclass for callbacks set outside the handle
    to pass over rehydrate's own statements (see :class:`ManagedConnection`).
    """
    ask = _reopen_seconds(reopen_timeout)
    conn = ManagedConnection(path, engine=engine, on_change=on_change, required=required,
                             on_connect=on_connect, connect_kwargs=dict(connect_kwargs))
    conn._manager._ask_reopen(conn, ask)
    return conn


def mmap(
    path: str | os.PathLike[str],
    length: int = 0,
    *,
    access: int | None = None,
    offset: int = 0,
    engine: Engine | None = None,
    on_change: OnChange | None = None,
    required: bool = True,
    reopen_timeout: float | None = None,
) -> ManagedMap:
    """A managed shared mapping of ``path`` (``length=0``: the whole file; ``access``:
    ``mmap.ACCESS_WRITE`` unless given, ``ACCESS_COPY`` refused with ``ValueError``);
    unmapped before a snapshot, remapped after, with the same change check as
    :func:`open`. ``reopen_timeout``: see :func:`volume`."""
    import mmap as _mmap

    ask = _reopen_seconds(reopen_timeout)
    m = ManagedMap(path, length=length, access=_mmap.ACCESS_WRITE if access is None else access,
                   offset=offset, engine=engine, on_change=on_change, required=required)
    m._manager._ask_reopen(m, ask)
    return m


def volume(
    mount_point: str | os.PathLike[str],
    *,
    engine: Engine | None = None,
    on_change: OnChange | None = None,
    reopen_timeout: float | None = None,
) -> Volume:
    """Register the volume mounted at ``mount_point``: an identity file
    (:data:`IDENTITY_FILE`, a random token) is created there if missing; after a restore a
    different or missing identity is reported (warning, ``status()["files"]``,
    ``on_change(volume)``) and every managed handle under it is reopened as changed.
    Registering a volume again returns the same :class:`Volume`; its ``on_change`` (if
    another) is called as well, after the earlier ones. A bound method is held weakly
    (the volume does not keep its object alive; a dropped object is not called), any
    other callable strongly. Handles lie under the volume by their path as given or with
    symbolic links resolved.

    ``reopen_timeout`` (here and on :func:`open`, :func:`sqlite`, :func:`mmap`): seconds
    the ``rehydrate.files.reopen`` hook may take — every volume check, reopen and
    ``on_change``, one after another — the largest asked by a handle still open (until
    its ``close()``) or a volume, never less than the 30 s default; a call that fails
    asks nothing. A pass that outlives it fails the restore run (the process is
    ``degraded``); when it then completes without a failure the process is ready again.
    A snapshot that begins meanwhile stops it before its next handle or after its last;
    when that snapshot's restore or resume has begun by then, the pass reopens the
    handles again on its behalf.
    """
    ask = _reopen_seconds(reopen_timeout)
    mgr = manager(engine)
    vol = mgr.add_volume(mount_point, on_change)
    mgr._ask_reopen(vol, ask)
    return vol


def _reopen_seconds(reopen_timeout: float | None) -> float | None:
    """A ``reopen_timeout`` argument, checked before anything is made."""
    return None if reopen_timeout is None else _config.seconds(reopen_timeout,
                                                                "reopen_timeout")


def audit(*, engine: Engine | None = None) -> list[OpenFile]:
    """This process's descriptors on volumes, each marked managed or not."""
    return manager(engine).audit()


def _callable_name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


def _mark_managed(found: list[OpenFile], status: Mapping[str, Any]) -> list[OpenFile]:
    """``found`` with ``managed`` set from a files status (``status()["files"]``): a
    handle's file (and SQLite's ``-wal``/``-shm``/``-journal``) and volume identity files.
    A suspended handle holds no descriptor: one open on its path is someone else's."""
    managed: set[str] = set()
    for h in status.get("handles") or ():
        if h.get("suspended") is True:
            # The audit runs after rehydrate.files.close: counted, every managed path
            # hid the application's own second descriptor on it (a plain
            # sqlite3.connect to a managed WAL database) from the warning.
            continue
        for path in _both(str(h.get("path"))):
            managed.update((path, path + "-wal", path + "-shm", path + "-journal"))
    for v in status.get("volumes") or ():
        managed.update(_both(os.path.join(str(v.get("mount_point")), IDENTITY_FILE)))
    return [OpenFile(f.fd, f.path, f.deleted, f.mount_point, f.fstype, f.path in managed)
            for f in found]


def _both(path: str) -> tuple[str, str]:
    """``path`` as given and with its symbolic links resolved: a descriptor's link in
    ``/proc`` names the real path (a handle opened through ``/data -> /mnt/disk1``)."""
    return path, os.path.realpath(path)


def doctor_report(pid: int | str = "self", *, proc: str = "/proc",
                  status: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """``rehydrate doctor --files``: (JSON data, text) about process ``pid``'s descriptors
    on volumes (mounts a snapshot does not hold); ``status``: that process's
    ``status()["files"]``, to mark the descriptors its handles manage."""
    try:
        found = open_files(pid, proc=proc)
    except OSError as exc:
        msg = f"cannot list the descriptors of process {pid}: {exc.strerror or exc}"
        return {"pid": str(pid), "files": [], "error": msg}, msg
    if status is not None:
        found = _mark_managed(found, status)
    data: dict[str, Any] = {"pid": str(pid), "files": [f.to_dict() for f in found]}
    if not found:
        return data, f"process {pid}: no descriptors open on volumes the snapshot does not hold"
    lines = [f"process {pid}: {len(found)} descriptor(s) on volumes the snapshot does not "
             "hold (reopened by path on restore, without any change check, unless managed "
             "with rehydrate.files)",
             f"  {'FD':>4}  {'MOUNT':<16}  {'FS':<6}  {'MANAGED':<7}  PATH"]
    for f in found:
        note = "  DELETED: gVisor cannot checkpoint this" if f.deleted else ""
        managed = "?" if f.managed is None else "yes" if f.managed else "no"
        lines.append(f"  {f.fd:>4}  {f.mount_point:<16}  {f.fstype:<6}  {managed:<7}  "
                     f"{f.path}{note}")
    return data, "\n".join(lines)

