"""Control socket: platforms and operators tell the process about snapshots directly.

A Unix stream socket at ``$REHYDRATE_CONTROL_SOCKET`` (default, when the detector is
asked for without it: ``$XDG_RUNTIME_DIR/rehydrate/<pid>.sock``, or
``/tmp/rehydrate-<uid>/<pid>.sock`` without ``XDG_RUNTIME_DIR``). The socket is created
mode 0600 (bound at its path and chmod-ed before ``listen()``), a parent
directory it creates is 0700, and every client's credentials (``SO_PEERCRED``) are
checked: only the same uid or root may talk to it; anyone else gets an error reply and
is disconnected.

Protocol: line-delimited JSON, one request per line (terminated by ``\\n``, at most
:data:`MAX_LINE` bytes), one reply line per request, several requests per connection::

    -> {"cmd": "status"}
    <- {"ok": true, "status": {"state": "running", "generation": 0, ...}, "pid": 42}
    -> {"cmd": "prepare-snapshot"}
    <- {"ok": true, "report": {...SnapshotReport.to_dict()...}}

Commands: ``status``; ``prepare-snapshot`` (run the before-snapshot hooks, reply when
they finished; when a required one failed the resume hooks run and the reply is
``ok: false``: the platform should abort the checkpoint; with ``"budget": true`` a line
``{"pending": true, "budget": S}`` comes first, S the longest the hooks may take under
their own limits, so that the client waits that long); ``resume`` / ``restore`` (run
the resume / restore hooks); ``simulate`` (``"event"``: ``restore`` (default),
``resume`` or ``snapshot``, optional ``"env"``: ``{"KEY": "value" | null}``);
``trigger`` (gVisor: :func:`~rehydrate.trigger_snapshot`, optional
``"timeout"``; the reply carries ``"answer"``). Every reply has ``"ok"``; failures carry
``"error"`` (one line); a request's ``"id"`` (any JSON value, ``null`` too) is echoed.
Garbage, oversize lines, unknown commands and incomplete requests get an error reply and
the server keeps serving; so does a client no thread can be started for (a pids limit:
``busy``, the client retries), and a reply JSON cannot encode (keys that are not strings
are sent as their ``str()``; one that fails even so is ``reply not encodable: ...``). A
complete request line is acted on also when its client has gone (CRIU's ``post-dump``
notice, queued while the process was frozen); the reply it cannot get is dropped
quietly.

Duplicate suppression: a ``restore``/``resume`` notice is the restore already handled
when no freeze happened since that restore ran. It passes ``since`` = the later of the
last successful ``prepare-snapshot`` on this socket (the freeze came after it; the notice
consumes the prepare) and the engine's freeze watch
(:meth:`~rehydrate._lifecycle.Lifecycle.freeze_since`: the clock-jump detector's heartbeat
knows when the process last froze, even briefly), so a ``notify restore`` after the clock
jump ran the hooks — with or without ``notify save`` — only confirms that run (the reply
says ``"deduplicated": true`` and the report lists ``control`` in ``confirmed_by``), while
a clone that is checkpointed and restored again still runs them again. Without a
prepare, the watch's word is bounded by the window of the signal detector (2 s): only a
restore detected that shortly before the notice is taken for it — the watch cannot see a
freeze whose guest clock was carried over (Firecracker), and two real restores must never
be one run. Without a freeze
watch (the clock-jump detector not running) and without a prepare, a notice cannot know
when the freeze was: it passes ``since`` = the engine's last anchored restore (or the
socket's start), so it is never taken for an earlier restore (at worst the hooks run
twice, never zero times). ``simulate`` runs and the resume runs below are not freeze
anchors. A ``resume`` notice is about a checkpoint that was over when the request came
(``detected_at`` = the moment it was read, or, for the first request on a connection,
the moment the connection was accepted if earlier): a before-snapshot pass that began
after that (while the notice waited, or asked for on a connection accepted after it — a
CRIU ``post-dump`` resume queued while the process was frozen, then the next dump's
``pre-dump`` save, served first) is a later checkpoint's, and the notice runs nothing for
it.

If the reply to ``prepare-snapshot`` cannot be delivered (the client went away, e.g.
the platform's timeout killed ``rehydrate notify``), the platform aborts the
checkpoint, so the resume hooks run at once.

These carry-on runs undo the pass once, whichever notice comes first: the platform's
answer that the aborted checkpoint failed (gVisor's ``error``, to the gVisor waiter)
only confirms such a run when the request said ``"in_checkpoint": true`` (``rehydrate
notify`` run by gVisor's save-restore-exec: its failure aborts the checkpoint in
progress, whose failure gVisor answers; a save run by hand has no checkpoint behind it,
and a later ``error`` is another checkpoint's), and a carry-on for a pass that answer
already undid only confirms the answer's run (``undoes`` in
:meth:`~rehydrate._lifecycle.Lifecycle.restore_detected`).

Started by ``start(detectors="auto")`` only when ``REHYDRATE_CONTROL_SOCKET`` is set;
otherwise on request (``start(detectors=[..., "control"])``) at the default path.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import math
import os
import select
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .. import _config
from .._context import Report, describe_error
from .._contract import NO_DEADLINE_THREAD, Probe, own_pass_started, refuse_another_engine
from .._notify import not_a_socket, timeout_value
from .._runner import worst_case
from .._socket_path import ENV_SOCKET, default_socket_dir, socket_path
from .._threads import blocking, fresh_lock_after_fork
from . import Detector, probe_of

if TYPE_CHECKING:
    from ..extensions import Engine

__all__ = [
    "COMMANDS",
    "ENV_SOCKET",
    "MAX_LINE",
    "ControlDetector",
    "ControlServer",
    "default_socket_dir",
    "serving_peer",
    "socket_path",
    "squatter",
    "untrusted_dir",
]

log = logging.getLogger("rehydrate")

MAX_LINE = 64 * 1024
"""Longest request line accepted (bytes, without the newline)."""
MAX_CLIENTS = 32
LOG_EVERY = 10.0
"""A failure that repeats (an exhausted descriptor table, no thread for a client) is one
log line per this many seconds, with the count since the last line."""
ACCEPT_PAUSE = 0.1
"""After a failed ``accept()`` (``EMFILE``): the wait before the next one, not a spin."""
NOTICE_WAIT = 0.2
"""With no thread to serve a connection: how long its first request may take to come
when it was not there on accept, to tell a ``resume``/``restore`` notice (served on the
accept thread) from a request that is answered ``busy``."""
NOTICE_REPLY_TIMEOUT = 1.0
"""With no thread to serve a connection: how long the accept thread may take to send the
reply of the notice it served (a client that does not read must not hold it)."""
IDLE_TIMEOUT = 10.0
"""A connection with no complete request for this long is closed (a client sends its
request at once; one that does not only holds a slot)."""
COMMANDS = ("status", "prepare-snapshot", "resume", "restore", "simulate", "trigger")
"""The requests the control socket serves (``{"cmd": ...}``; docs/control-socket.md)."""

_CRED = struct.Struct("3i")

_PREPARED_AT = "_prepared_at"
_NO_ID: Any = object()
"""A request without ``"id"`` (``"id": null`` is an id, echoed as any other JSON value)."""
"""Key under which ``prepare-snapshot``'s reply carries its pass's start to the reply's
delivery (removed before sending)."""


def _dir_problem(directory: str) -> str | None:
    """Why a socket cannot be created in ``directory`` (None: it can, or can be made)."""
    probe = directory
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    if probe == directory:
        return untrusted_dir(directory)
    return None


def untrusted_dir(directory: str) -> str | None:
    """Why another user could replace a socket in ``directory`` (None: nobody could).

    A safe directory is owned by this uid or root and is writable by nobody else, or is
    sticky (``/tmp``: others cannot rename or remove what this uid created). A directory
    of another user is never safe: its owner can swap the socket at any time.
    """
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None  # created 0700 by this uid
    except OSError as exc:
        return f"{directory} cannot be inspected: {exc.strerror or exc}"
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory (a symbolic link or a file)"
    if st.st_uid not in (me, 0):
        return (f"{directory} is owned by uid {st.st_uid} (mode {mode:04o}), not by uid {me} "
                "or root: its owner could replace the socket")
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        return (f"{directory} is writable by other users (mode {mode:04o}) and not sticky: "
                "they could replace the socket")
    return None


def _make_dirs(directory: str) -> None:
    """Create ``directory`` and each missing parent with mode 0700 (less what the umask
    takes away from the owner: never more). ``os.makedirs(mode=)`` gives that mode to the
    last directory only; the parents it made got the umask's 0755, readable by all."""
    parent = os.path.dirname(directory)
    if parent != directory and not os.path.exists(parent):
        _make_dirs(parent)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        if not os.path.isdir(directory):
            raise


def _private_dir(directory: str, *, check_owner: bool) -> None:
    """Create ``directory`` 0700 if missing (each missing parent too); refuse one another
    user could write in (and, with ``check_owner``, one that is not this uid's own 0700
    directory)."""
    try:
        _make_dirs(directory)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create {directory}: {exc.strerror}") from None
    problem = untrusted_dir(directory)
    if problem:
        raise PermissionError(f"not serving the control socket there: {problem}; use a "
                              f"directory of this uid (mode 0700) in {ENV_SOCKET}")
    if not check_owner:
        return
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{directory} must be a directory owned by uid {os.geteuid()} with mode 0700 "
            f"(found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); remove it or "
            f"set {ENV_SOCKET}")


def serving_peer(path: str, timeout: float = 1.0) -> tuple[int, int] | None:
    """``(pid, uid)`` of the process listening at the socket ``path``; None when nobody is.

    Only a refused connection (``ECONNREFUSED``) or a vanished path (``ENOENT``) means
    nobody listens. Any other failure raises :class:`OSError`: a socket this uid may not
    connect to (``EACCES``: another user's, mode 0600), or one whose server does not
    accept in time (``EAGAIN``: its backlog is full; a timeout), may well be live, and a
    live socket must never be taken for a stale one and replaced.
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(timeout)
    try:
        probe.connect(path)
        pid, uid, _gid = _CRED.unpack(
            probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return None
        raise
    finally:
        probe.close()
    return pid, uid


def _busy(exc: OSError) -> bool:
    """``exc`` says a server is there but did not accept in time (not a refusal)."""
    return isinstance(exc, TimeoutError) or exc.errno in (errno.EAGAIN, errno.EINPROGRESS)


def _unreachable(path: str, owner: int, exc: OSError) -> str:
    """One line on a socket at ``path`` (of uid ``owner``) that cannot be connected to."""
    why = "no answer in time" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
    line = f"{path} is a socket of uid {owner} that this uid cannot connect to ({why})"
    if owner not in (os.geteuid(), 0):
        line += (": another user squats the control socket; rehydrate notify would not "
                 "reach this process")
    return line


def squatter(path: str) -> str | None:
    """A description of the process of another user serving ``path``, if one does — or
    of a socket there that this uid cannot connect to (whoever owns it, it is no socket
    ``rehydrate notify`` of this uid could reach, and it may be live: never replaced)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    try:
        peer = serving_peer(path)
    except OSError as exc:
        if _busy(exc) and st.st_uid in (os.geteuid(), 0):
            return None  # a busy server of this uid (or root's): as when it answers
        return _unreachable(path, st.st_uid, exc)
    if peer is None or peer[1] in (os.geteuid(), 0):
        return None
    return (f"{path} is already served by uid {peer[1]} (pid {peer[0]}): another user "
            "squats the control socket; rehydrate notify would reach it, not this process")


def _drain(conn: socket.socket) -> None:
    """Before closing: read (and drop) what the client already sent, briefly.

    Closing a socket with unread input makes the kernel send a reset, and the client may
    then never read the error reply that was sent just before.
    """
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(1.0)
        for _ in range(16):
            if not conn.recv(65536):
                break


class _BadRequest(ValueError):
    pass


class _Throttle:
    """Rate limit for the log lines of a failure that repeats (see :data:`LOG_EVERY`)."""

    def __init__(self) -> None:
        self.clock = time.monotonic
        self._last = -math.inf
        self._count = 0

    def due(self) -> int:
        """Count one failure; how many to report in a line now (0: not yet)."""
        self._count += 1
        now = self.clock()
        if now - self._last < LOG_EVERY:
            return 0
        self._last, count, self._count = now, self._count, 0
        return count


def _times(count: int) -> str:
    return "" if count <= 1 else f" ({count} times since the last line)"


def _encode_reply(reply: Mapping[str, Any]) -> bytes:
    """One reply line. One that cannot be JSON (a status field referring to itself;
    keys JSON cannot have are ``status().to_dict()``'s to replace) becomes a one-line
    error: the client gets an answer, never a closed connection."""
    import json

    try:
        text = json.dumps(reply, default=str, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        log.error("control socket: a reply could not be encoded as JSON: %s",
                  describe_error(exc))
        failed: dict[str, Any] = {"ok": False,
                                  "error": f"reply not encodable: {describe_error(exc)}"}
        if "id" in reply:  # the request's id, valid JSON already (it came as JSON)
            failed["id"] = reply["id"]
        text = json.dumps(failed, default=str, separators=(",", ":"))
    return text.encode() + b"\n"


@contextlib.contextmanager
def _directory_lock(directory: str) -> Iterator[None]:
    """Hold ``flock`` on ``directory`` (the socket's, private to this uid): one instance
    at a time checks for a live socket at a path there and binds it. Best effort where
    directories cannot be locked (some sandboxes): the window is then what it was."""
    import fcntl

    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    # Held by something else for long (a program of its own, a child
                    # forked while a start held it): go on without it — losing the
                    # control detector would be worse than the race the lock closes.
                    log.warning("control socket: %s stayed locked for %gs; starting "
                                "without the lock", directory, LOCK_TIMEOUT)
                    break
                time.sleep(0.005)
            except OSError:  # not supported here
                break
        yield
    finally:
        os.close(fd)  # releases the lock


LOCK_TIMEOUT = 5.0
"""How long :class:`ControlServer` waits for another instance starting in its directory."""


_SERVING: weakref.WeakSet[ControlServer] = weakref.WeakSet()
"""Control servers listening in this process (or in the parent it was forked from)."""


@atexit.register
def _unlink_at_exit() -> None:
    # A process exiting without stop() (a recycled worker, a script) left its socket: the
    # client's scan of the default directory then counted it with the live ones. Only the
    # process that bound it: a forked child exiting normally inherits this handler and the
    # server object, never the ownership.
    pid = os.getpid()
    for server in list(_SERVING):
        if server._bound_by == pid and server._sock is not None:
            # Closing the stop pipe wakes the accept thread, which ends: as asked, not
            # a failure to report (detector_errors, an ERROR line at every exit).
            server._stopping = True
            server._unlink_own()


class ControlServer:
    """The socket server; :class:`ControlDetector` runs one per engine."""

    def __init__(self, engine: Engine, path: str | None = None) -> None:
        self.engine = engine
        # Normalised and absolute: the directories are created for this path, so the bind
        # must use it too (``a/missing/../ctl.sock`` made ``a`` and then failed to bind
        # through the missing ``a/missing``), and a chdir() cannot move where stop()
        # removes the socket.
        self.path = os.path.abspath(path or socket_path())
        self._sock: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._bound_by = -1
        """The pid that bound the socket: only that process removes it at exit."""
        self._thread: threading.Thread | None = None
        self._stop_r = self._stop_w = -1
        self._stopping = False
        self._lock = threading.Lock()
        # A parent thread (the accept loop, a client's) may hold it at fork(): stop() takes
        # it, in a child too (an installed control detector the child stops itself).
        fresh_lock_after_fork(self)
        self._conns: dict[socket.socket, list[float | None]] = {}
        """Open connections -> [time of their last request or of the accept, or inf while
        a request runs (the idlest one is closed when a new client needs its slot); the
        accept's time when a request was queued already then, else None]."""
        self._started_at = 0.0
        self._last_prepare: float | None = None
        self._notices = 0  # restore/resume notices received (see prepare-snapshot)
        """A successful prepare-snapshot not yet followed by a restore/resume notice."""
        self.served = 0
        self.refused = 0
        self.evicted = 0
        """Idle connections closed to make room for a new client."""
        self._evict_logged = -math.inf
        self._accept_failures = _Throttle()
        self._submit_failures = _Throttle()
        self.failure: str | None = None
        """Why the accept thread ended while the server was not being stopped."""

    # -- setup -----------------------------------------------------------------------

    def start(self) -> None:
        if self._sock is not None:
            raise RuntimeError("control server already running")
        directory = os.path.dirname(self.path)
        _private_dir(directory, check_owner=directory == default_socket_dir())
        # Here, not at import (start("auto") imports every detector to probe): json is
        # loaded before any snapshot, so a clone's first request does not import it.
        import json  # noqa: F401

        with _directory_lock(directory):
            self._refuse_live_socket()
            try:
                sock = self._bind_and_listen()
            except OSError as exc:
                # bind()'s errors name no path ("[Errno 2] No such file or directory",
                # "AF_UNIX path too long"): the start error in logs and status must
                if exc.errno is None:
                    raise OSError(f"cannot listen at {self.path}: {exc}") from None
                raise OSError(exc.errno,
                              f"cannot listen at {self.path}: {exc.strerror}") from None
        sock.setblocking(False)
        self._listening(sock)

    def _bind_and_listen(self) -> socket.socket:
        """Bind at the path (a stale socket there removed), 0600, listen. Under the
        directory's lock: another instance starting at the same path meanwhile would
        take this socket, bound and not listening yet, for a stale one and remove it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        # Bound at its final path, not under a temporary name renamed into place: CRIU
        # dumps a listening socket with the address it was bound to and restores it
        # there, so a renamed socket would come back unreachable at the real path.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket (_refuse_live_socket checked it)
        bound = False
        try:
            sock.bind(self.path)
            bound = True
            os.chmod(self.path, 0o600)  # before listen(): nobody can connect in between
            sock.listen(socket.SOMAXCONN)  # a burst of clients waits, not EAGAIN
        except OSError:
            sock.close()
            if bound:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        self._bound_by = os.getpid()
        _SERVING.add(self)
        return sock

    def _listening(self, sock: socket.socket) -> None:
        """Serve ``sock`` (bound and listening) on the accept thread."""
        self._sock = sock
        self._stopping = False
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._started_at = time.monotonic()
        self.failure = None
        self._thread = threading.Thread(target=self._accept_thread, name="rehydrate-control",
                                        daemon=True)
        self._thread.start()
        blocking.reserve("control")  # for a client, maybe a clone's `notify restore`
        log.info("control socket listening at %s", self.path)

    def _refuse_live_socket(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{self.path} exists and is not a socket; not replacing it")
        try:
            peer = serving_peer(self.path)
        except OSError as exc:  # maybe live: never replaced
            raise FileExistsError(f"{_unreachable(self.path, st.st_uid, exc)}; refusing to "
                                  "start") from None
        if peer is None:
            return  # stale: nobody listens; start() replaces it
        pid, uid = peer
        if uid not in (os.geteuid(), 0):
            raise FileExistsError(f"{squatter(self.path) or self.path}; refusing to start")
        raise FileExistsError(f"another process (pid {pid}) is serving {self.path}")

    def stop(self, timeout: float = 5.0) -> None:
        sock, thread = self._sock, self._thread
        if sock is None:
            return
        if self._bound_by != os.getpid():
            self._forget_in_child()
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        sock.close()
        self._sock = None
        self._thread = None
        _SERVING.discard(self)
        self._unlink_own()

    def _forget_in_child(self) -> None:
        """stop() in a child of fork() (an inherited shutdown handler): the server is
        the parent's. Writing to the stop pipe would end the parent's accept thread, a
        shutdown() of a connection would cut the parent's client, and the socket file
        is the parent's: only this process's copies of the descriptors are closed."""
        sock, self._sock, self._thread = self._sock, None, None
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()  # a copy: the parent's connection stays open
        if sock is not None:
            sock.close()
        _SERVING.discard(self)
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._stop_r = self._stop_w = -1

    def _unlink_own(self) -> None:
        """Remove the socket file when it is still the one this server bound."""
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except OSError:
            pass
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._stop_r = self._stop_w = -1

    # -- serving ---------------------------------------------------------------------

    def _accept_thread(self) -> None:
        # Nobody is served any more, and the socket still accepts into its backlog: the
        # clients wait out their timeouts. status()["detector_errors"] must say so.
        try:
            self._accept_loop()
        except BaseException as exc:
            log.exception("control socket: the accept thread died; no client is served")
            self.failure = f"its accept thread died: {type(exc).__name__}: {exc}"
            return
        if not self._stopping:
            log.error("control socket: the accept thread ended; no client is served")
            self.failure = "its accept thread ended"

    def _accept_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while not self._stopping:
            events = poller.poll()
            if any(fd == self._stop_r for fd, _ in events):
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                if self._stopping:
                    return
                count = self._accept_failures.due()  # EMFILE fails every ACCEPT_PAUSE
                if count:
                    log.error("control socket accept failed: %s%s", exc.strerror or exc,
                              _times(count))
                select.select([self._stop_r], [], [], ACCEPT_PAUSE)  # e.g. EMFILE: no spin
                continue
            accepted = time.monotonic()
            # The accept's moment dates the first request only when that request was
            # queued already (CRIU's post-dump notice, sent while the process was frozen);
            # one a client sends later, after idling, is dated when it is read.
            try:
                queued: float | None = accepted if conn.recv(
                    1, socket.MSG_PEEK | socket.MSG_DONTWAIT) else None
            except OSError:  # nothing there yet (EAGAIN), or the client is gone
                queued = None
            conn.setblocking(True)
            with self._lock:
                busy = len(self._conns) >= MAX_CLIENTS and not self._evict_idlest()
                if not busy:
                    self._conns[conn] = [accepted, queued]
            if busy:
                self._send(conn, {"ok": False, "error": "busy: too many clients"})
                conn.close()
                continue
            # a reusable thread: one started right after a gVisor restore (the
            # `notify restore` that races the clock jump) costs milliseconds
            try:
                blocking.submit(self._serve, conn)
            except Exception as exc:
                # No thread could start (the process at its pids limit): the loop goes on
                # — ending it here left the socket dead for good.
                notice = self._notice_pending(conn)
                if notice is not None:
                    self._serve_notice(conn, notice, exc)
                else:
                    self._refuse_unserved(conn, exc)

    def _notice_pending(self, conn: socket.socket) -> bytes | None:
        """When the first request on ``conn`` — there already, or within
        :data:`NOTICE_WAIT` — is a ``resume`` or ``restore`` notice: the bytes up to its
        newline (blank lines before it included), read without consuming them
        (``MSG_PEEK``); otherwise None."""
        import json

        give_up = time.monotonic() + NOTICE_WAIT
        while True:
            try:
                data = conn.recv(MAX_LINE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                data = None
            except OSError:
                return None
            if data == b"":
                return None  # gone without a request
            if data is not None:
                blank = len(data) - len(data.lstrip())  # blank lines: keep-alives
                line, newline, _ = data[blank:].partition(b"\n")
                if newline:
                    try:
                        req = json.loads(line.decode("utf-8"))
                    except (ValueError, UnicodeDecodeError, RecursionError):
                        req = None
                    notice = isinstance(req, dict) and req.get("cmd") in ("resume", "restore")
                    return data[:blank + len(line) + 1] if notice else None
            left = give_up - time.monotonic()
            if left <= 0:
                return None
            # partial data makes the connection readable at once: wait in short steps
            watched = [self._stop_r] if data else [self._stop_r, conn.fileno()]
            ready, _, _ = select.select(watched, [], [], min(left, 0.01) if data else left)
            if self._stop_r in ready:
                return None

    def _serve_notice(self, conn: socket.socket, notice: bytes, exc: Exception) -> None:
        """Serve, on the accept thread, the ``resume``/``restore`` notice (``notice``: its
        bytes, peeked by :meth:`_notice_pending`) of a connection no thread can serve,
        then close it. Refused ``busy``, CRIU's post-dump ``resume`` (sent with
        :func:`post`: its client is gone, nobody retries) was lost, and the process
        stayed ``snapshotting`` until the deadline. The accept loop waits meanwhile, for
        the notice's run and at most :data:`NOTICE_REPLY_TIMEOUT` more for its reply;
        nothing else the connection sent is served (it went on serving every pipelined
        request there — a ``prepare-snapshot`` ran its hooks — and a client that did not
        read its replies held the accept thread ~10 s). Once stop() began it is closed
        unanswered, as a connection served on a thread of its own is; the thread
        shortage is logged (and counted) all the same."""
        with self._closing(conn):
            stopping = self._stopping
            count = self._submit_failures.due()
            if count:
                log.error("control socket: no thread to serve a client (%s); its resume or "
                          "restore notice is %s%s", describe_error(exc),
                          "closed unanswered: the socket is stopping" if stopping
                          else "served on the accept thread", _times(count))
            if stopping:
                return
            with self._lock:
                state = self._conns.get(conn)
            conn.settimeout(NOTICE_REPLY_TIMEOUT)
            if self._peer_allowed(conn, drain=False):
                # End of input: what the client sends from now on fails (EPIPE), and
                # what it sent already is all there is to drop below.
                conn.shutdown(socket.SHUT_RD)
                conn.recv(len(notice), socket.MSG_DONTWAIT)  # there: it was peeked
                self._answer(conn, notice, queued=state[1] if state is not None else None)
                # Dropped without waiting: left unread, the close would reset the
                # connection (ECONNRESET) where the client is to see its end.
                while conn.recv(65536, socket.MSG_DONTWAIT):
                    pass

    def _refuse_unserved(self, conn: socket.socket, exc: Exception) -> None:
        with self._lock:
            self._conns.pop(conn, None)
        count = self._submit_failures.due()
        if count:
            log.error("control socket: no thread to serve a client (%s); answered "
                      "busy%s", describe_error(exc), _times(count))
        # Not drained as a refused peer is: the accept loop must not wait on a client.
        self._send(conn, {"ok": False, "error": "busy: no thread to serve this client"})
        conn.close()

    def _evict_idlest(self) -> bool:
        """Close the connection idle the longest (none is running a request) to make room
        for a new client: idle connections, however many, never lock ``notify`` out.
        Caller holds the lock."""
        idle = [(state[0], id(c), c) for c, state in self._conns.items()
                if state[0] != float("inf")]
        if not idle:
            return False
        _, _, victim = min(idle)
        del self._conns[victim]
        self.evicted += 1
        now = time.monotonic()
        if now - self._evict_logged >= 10.0:  # a flood is one line per 10 s, not per client
            self._evict_logged = now
            log.warning("control socket: %d clients; closing the idlest connections to serve "
                        "new ones (%d so far)", MAX_CLIENTS, self.evicted)
        with contextlib.suppress(OSError):
            victim.shutdown(socket.SHUT_RDWR)  # its thread sees EOF and closes it
        return True

    def _activity(self, conn: socket.socket, running: bool) -> None:
        with self._lock:
            state = self._conns.get(conn)
            if state is not None:
                state[0] = float("inf") if running else time.monotonic()

    def _serve(self, conn: socket.socket) -> None:
        with self._closing(conn):
            self._serve_conn(conn)

    @contextlib.contextmanager
    def _closing(self, conn: socket.socket) -> Iterator[None]:
        """Serve ``conn`` in the ``with`` block, then close it: its errors end the
        connection, never the thread serving it."""
        try:
            yield
        except OSError as exc:
            if not self._stopping:  # else stop() shut it down
                log.info("control client connection ended: %s", exc.strerror or exc)
        except Exception:  # pragma: no cover - a bug must not kill the server
            log.exception("control client handler failed")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _peer_allowed(self, conn: socket.socket, *, drain: bool = True) -> bool:
        pid, uid, _gid = _CRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        me = os.geteuid()
        if uid in (me, 0):
            return True
        self.refused += 1
        log.warning("control socket: refused a client with uid %d (pid %d); only uid %d "
                    "and root may connect", uid, pid, me)
        self._send(conn, {"ok": False, "error": f"permission denied: uid {uid} may not use "
                                                f"this socket (only uid {me} or root)"})
        if drain:  # not on the accept thread: a trickling client would hold it
            _drain(conn)
        return False

    def _serve_conn(self, conn: socket.socket) -> None:
        with self._lock:
            state = self._conns.get(conn)
        # When the connection was accepted: its first request was sent by then, or soon
        # after (see "queued" in _dispatch).
        accepted = state[1] if state is not None else None
        if not self._peer_allowed(conn):
            return
        idle_limit = IDLE_TIMEOUT
        deadline = time.monotonic() + idle_limit  # for the next complete request
        buf = b""
        discarding = False
        while not self._stopping:
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    break
                line, buf = buf[:nl], buf[nl + 1:]
                if discarding:  # the tail of an oversize line
                    discarding = False
                    continue
                if len(line) > MAX_LINE:
                    self._oversize(conn, len(line))
                    continue
                self._activity(conn, running=True)
                try:
                    if not self._answer(conn, line, queued=accepted):
                        return
                finally:
                    self._activity(conn, running=False)
                accepted = None  # later requests on the connection: when they are read
                deadline = time.monotonic() + idle_limit
            if discarding:
                buf = b""
            elif len(buf) > MAX_LINE:
                self._oversize(conn, len(buf))
                discarding, buf = True, b""
            try:
                # the whole request must come in time, however slowly its bytes trickle
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = conn.recv(65536)
            except TimeoutError:
                self._send(conn, {"ok": False, "error": f"no complete request within "
                                                        f"{idle_limit:g}s; closing"})
                return
            if not chunk:
                with self._lock:  # evicted: this server closed it, already logged (rate-limited)
                    evicted = conn not in self._conns
                if buf.strip() and not discarding and not evicted:
                    log.warning("control client disconnected mid-request (%d bytes without "
                                "a newline); ignored", len(buf))
                    self._send(conn, {"ok": False, "error": "incomplete request: end of "
                                                            "input before the newline"})
                return
            buf += chunk

    def _oversize(self, conn: socket.socket, size: int) -> None:
        log.warning("control socket: request line over %d bytes refused", MAX_LINE)
        self._send(conn, {"ok": False, "error": f"request too large: more than {MAX_LINE} "
                                                f"bytes without a newline ({size}+ seen)"})

    def _answer(self, conn: socket.socket, line: bytes, *,
                queued: float | None = None) -> bool:
        """Handle one request line; False when the client is gone. ``queued``: when the
        connection of its first request was accepted."""
        import json  # here, not at import: start("auto") imports every detector to probe

        if not line.strip():
            return True  # blank lines are keep-alives
        req_id: Any = _NO_ID
        req: Mapping[str, Any] = {}
        cmd = "?"
        received = time.monotonic()  # before a prepare-snapshot's pass began
        try:
            # UTF-8 only: json.loads(bytes) would guess UTF-16/32 from the first bytes and
            # answer garbage with a codec error
            req = json.loads(line.decode("utf-8"))
            if not isinstance(req, dict):
                raise _BadRequest("a request must be a JSON object")
            req_id = req.get("id", _NO_ID)
            if isinstance(req_id, float) and not math.isfinite(req_id):
                # echoed as NaN/Infinity, the reply would not be JSON to a strict parser
                req_id = _NO_ID
                raise _BadRequest('"id" must be a string or a finite number')
            cmd = req.get("cmd")  # type: ignore[assignment]
            if not isinstance(cmd, str):
                raise _BadRequest('a request needs "cmd" (a string)')
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            # JSONDecodeError is a ValueError; nesting deeper than the parser's recursion
            # limit is a RecursionError: bad input too, one line, no traceback
            if isinstance(exc, _BadRequest):
                reply = _bad_request(str(exc))
            elif isinstance(exc, RecursionError):
                reply = _bad_request("not valid JSON (nested too deeply)")
            elif isinstance(exc, UnicodeDecodeError):
                reply = _bad_request(f"not UTF-8 (byte 0x{line[exc.start]:02x} at "
                                     f"{exc.start})")
            else:
                reply = _bad_request(f"not valid JSON ({describe_error(exc)})")
        else:
            # Outside the parsing above: a ValueError from a command is no JSON error.
            try:
                if cmd == "prepare-snapshot" and _wants_budget(req):
                    # Before the hooks: the client waits as long as they may take. A
                    # client gone already is the undeliverable reply's case (below).
                    self._send(conn, self._budget_notice(req_id))
                reply = self._dispatch(cmd, req, received=received, queued=queued)
            except _BadRequest as exc:
                reply = _bad_request(str(exc))
            except Exception as exc:
                if type(exc) is RuntimeError and str(exc).startswith(NO_DEADLINE_THREAD):
                    # expected at the pids limit, and the reply says it all: no traceback
                    log.error("control command %s refused: %s", cmd, describe_error(exc))
                else:
                    log.exception("control command %s failed", cmd)
                reply = {"ok": False, "error": describe_error(exc)}
        own = reply.pop(_PREPARED_AT, None)  # internal: never sent
        if req_id is not _NO_ID:
            reply["id"] = req_id
        self.served += 1
        if cmd == "prepare-snapshot" and reply.get("ok"):
            undoes = own if isinstance(own, float) else received
            return self._deliver_prepared(conn, reply, undoes, _in_checkpoint(req))
        return self._send(conn, reply)

    def _deliver_prepared(self, conn: socket.socket, reply: Mapping[str, Any],
                          received: float, in_checkpoint: bool) -> bool:
        """Send a successful prepare-snapshot's reply; when it cannot be delivered, the
        platform aborts the checkpoint, so the resume hooks run now."""
        if self._send(conn, reply):
            return True
        log.warning("the client of prepare-snapshot went away before the reply; the "
                    "platform aborts the checkpoint, so the resume hooks run now")
        self._last_prepare = None  # no checkpoint follows it
        # The platform aborts before it pauses anything: nothing froze. Inside a gVisor
        # checkpoint, its answer that the checkpoint failed ("error") confirms this run
        # (abort="announced"); if that answer came first and ran the hooks, this run is the
        # confirmation.
        self.engine.restore_detected("control", kind="resume", anchor=False,
                                     frozen_for=0.0, undoes=received,
                                     abort="announced" if in_checkpoint else None)
        return False

    def _budget_notice(self, req_id: Any) -> dict[str, Any]:
        """The line a ``prepare-snapshot`` asking for ``"budget"`` gets before its reply:
        the longest its before-snapshot hooks may run under their own limits, and the
        restore hooks after them (a failed pass runs the resume hooks before it replies).
        It has no ``"ok"``: a client that asked for it but reads only one line takes it
        for no reply, never for a success."""
        budget: float | None
        try:
            engine = self.engine
            budget = sum(worst_case([*engine.registry.hooks(event), *engine.builtins.hooks(event)])
                         for event in ("snapshot", "restore"))
        except Exception:  # an engine of another shape: the client keeps its own limit
            log.debug("control socket: no snapshot budget", exc_info=True)
            budget = None
        notice: dict[str, Any] = {"pending": True, "budget": budget}
        if req_id is not _NO_ID:
            notice["id"] = req_id
        return notice

    @staticmethod
    def _send(conn: socket.socket, reply: Mapping[str, Any]) -> bool:
        data = _encode_reply(reply)
        try:
            conn.sendall(data, socket.MSG_NOSIGNAL)
        except OSError:
            return False
        return True

    # -- commands --------------------------------------------------------------------

    def _since(self, received: float | None = None) -> float:
        """``since`` for a restore/resume notice read at ``received`` (see the module
        docstring)."""
        if self._last_prepare is not None:
            return max(self._last_prepare, self.engine.freeze_since() or 0.0)
        # The freeze watch's answer bounded in time (Lifecycle.notice_since): alone, a
        # watch blind to this platform's freezes (a guest clock carried over: Firecracker)
        # made every later `notify restore` the first one's duplicate, and a clone kept
        # its parent's keys.
        since = self.engine.notice_since(time.monotonic() if received is None else received)
        if since is not None:
            return since
        return max(self._started_at, self.engine.last_restore_at or 0.0)

    def _dispatch(self, cmd: str, req: Mapping[str, Any], *,
                  received: float | None = None,
                  queued: float | None = None) -> dict[str, Any]:
        """Serve one request; ``received``: ``time.monotonic()`` when it was read;
        ``queued``: when its connection was accepted (the first request of one)."""
        engine = self.engine
        if cmd == "status":
            return {"ok": True, "status": engine.status().to_dict(), "pid": os.getpid()}
        if cmd == "prepare-snapshot":
            _in_checkpoint(req)  # a bad value is refused before any hook runs
            prepared, notices = time.monotonic(), self._notices
            snap = engine.snapshot_requested("control")
            # Carry-ons name this pass exactly: `prepared` may precede a pass that got
            # the engine first (and was resumed), which they would then only confirm.
            own = own_pass_started(engine, snap, prepared)
            out: dict[str, Any] = {"ok": snap.ok, "report": snap.to_dict(),
                                   _PREPARED_AT: own}
            # A restore/resume notice that came while the hooks ran consumed this prepare
            # already: recording it now would make the next real restore a "duplicate".
            self._last_prepare = prepared if snap.ok and self._notices == notices else None
            if not snap.ok:
                failed = _failed_hooks(snap)
                # `notify save` exits non-zero: the platform aborts before it pauses
                # anything, so nothing froze. Its answer that the checkpoint failed
                # (gVisor's "error") then only confirms this run (abort="announced"); if
                # that answer came first (the platform's timeout killed the notifier
                # while the hooks ran) and ran the resume hooks, this confirms that run.
                # Only inside a checkpoint (gVisor's save-restore-exec) is that answer
                # due: after a save run by hand, a later "error" is another checkpoint's,
                # which may have paused the sandbox, and runs the hooks.
                resume = engine.restore_detected(
                    "control", kind="resume", anchor=False, frozen_for=0.0,
                    undoes=own, abort="announced" if _in_checkpoint(req) else None)
                out["resume_report"] = resume.to_dict()
                already = (f" (run already, for the {resume.reason} notice)"
                           if resume.deduplicated else "")
                ran = (f"the resume hooks ran{already}" if resume.ready else
                       f"the resume hooks failed too{already} ({_failed_hooks(resume)}): "
                       "degraded")
                out["error"] = (f"before-snapshot hook(s) failed: {failed}; {ran}, the "
                                "checkpoint should be aborted")
            return out
        if cmd in ("resume", "restore"):
            kind: Literal["restore", "resume"] = "restore" if cmd == "restore" else "resume"
            self._notices += 1
            since = self._since(received)
            self._last_prepare = None  # consumed: the next notice is about a later freeze
            # A resume is about a checkpoint that was over when the request came: a
            # before-snapshot pass begun since (while this waited for the freeze watch's
            # verdict or for a run) is a later checkpoint's, which it must not end. A
            # restore keeps the moment of its run (a clone always runs its hooks).
            # The first request of a connection was on its way when the connection was
            # accepted: connections are accepted in the order they came, so a pass asked
            # for on a connection accepted later (the next dump's `pre-dump` save) is a
            # later checkpoint's, also when its request was read first (CRIU's post-dump
            # `resume`, queued while the process was frozen, read by a thread that ran
            # late).
            at = None
            if kind == "resume":
                at = received if queued is None or received is None else min(received, queued)
            report = engine.restore_detected("control", kind=kind, since=since,
                                             detected_at=at)
            # ready, not ok: a run whose failed hooks all recovered while it went on
            # left the process ready, and the platform must not fail the restore for it
            out = {"ok": report.ready, "report": report.to_dict(),
                   "deduplicated": report.deduplicated}
            if not report.ready:
                failed = _failed_hooks(report)
                out["error"] = f"{kind} hook(s) failed: {failed}"
            return out
        if cmd == "simulate":
            return self._simulate(req)
        if cmd == "trigger":
            return self._trigger(req)
        raise _BadRequest(f"unknown command {cmd[:64]!r} (known: {', '.join(COMMANDS)})")

    def _simulate(self, req: Mapping[str, Any]) -> dict[str, Any]:
        event = req.get("event", "restore")
        env = req.get("env")
        if env is not None:
            from ..env import check_overlay  # the engine's own rule, checked up front

            try:
                check_overlay(env)
            except (TypeError, ValueError):
                raise _BadRequest('"env" must map key names to strings or null') from None
        if event == "snapshot":
            report: Any = self.engine.simulate_snapshot()
        elif event in ("restore", "resume"):
            report = self.engine.simulate_restore(env=env, kind=event)
        else:
            raise _BadRequest('"event" must be "restore", "resume" or "snapshot"')
        return {"ok": report.ready, "report": report.to_dict()}

    def _trigger(self, req: Mapping[str, Any]) -> dict[str, Any]:
        from .._trigger import trigger_snapshot
        from .gvisor import GVisorError

        timeout = req.get("timeout")
        if timeout is not None:
            try:
                timeout = timeout_value(timeout, '"timeout"')
            except ValueError as exc:  # checked before any hook runs or anything is written
                raise _BadRequest(str(exc)) from None
        try:
            answer = trigger_snapshot(self.engine, timeout=timeout)
        except (GVisorError, TimeoutError) as exc:
            return {"ok": False, "error": str(exc)}
        last = self.engine.status().last_report
        return {"ok": answer != "error", "answer": answer,
                "report": last.to_dict() if last else None,
                **({"error": "the checkpoint failed"} if answer == "error" else {})}

    def info(self) -> dict[str, Any]:
        return {"socket": self.path, "served": self.served, "refused": self.refused,
                "evicted": self.evicted}


def _bad_request(what: str) -> dict[str, Any]:
    log.warning("control socket: bad request: %s", what)
    return {"ok": False, "error": f"bad request: {what}"}


class ControlDetector(Detector):
    """Control socket: `rehydrate notify` / platforms announce snapshots and restores."""

    key: ClassVar[str] = "control"
    specificity: ClassVar[int] = 90
    auto: ClassVar[bool] = True

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.server: ControlServer | None = None

    @classmethod
    def probe(cls) -> Probe:
        path = socket_path()
        why = (_dir_problem(os.path.dirname(os.path.abspath(path))) or not_a_socket(path)
               or squatter(path))
        return Probe(why is None, why or "")

    def probe_instance(self) -> Probe:
        if self.path is None:
            return probe_of(type(self))
        # A path of its own is checked by start(), loudly: an ERROR line and
        # status()["detector_errors"] name the foreign owner or the squatter.
        return Probe(True, f"checked when started: {self.path}")

    @classmethod
    def configured(cls) -> bool:
        return bool(_config.text(ENV_SOCKET))

    @classmethod
    def auto_here(cls) -> str | None:
        if _config.text(ENV_SOCKET):
            return None
        where = os.path.join(default_socket_dir(), "<pid>.sock")
        return f"off unless asked for or {ENV_SOCKET} is set (would listen at {where})"

    def describe(self) -> str:
        return f"listens at {self.path or socket_path()}"

    def failure(self) -> str | None:
        server = self.server
        return None if server is None else server.failure

    def start(self, engine: Engine) -> None:
        if self.server is not None:
            refuse_another_engine(self, self.server.engine, engine)
            owner = self.server._bound_by
            if owner not in (-1, os.getpid()):  # an installed instance, in a fork's child
                raise RuntimeError(f"this control detector serves the parent process "
                                   f"({owner}) at {self.server.path}; a child of fork() "
                                   "needs a ControlDetector of another path")
            raise RuntimeError("this control detector is already running")
        server = ControlServer(engine, self.path)
        server.start()
        self.server = server
        engine.add_status("control", server.info)

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    def forget_in_child(self) -> None:
        # The server stays: start() here refuses it as the parent's.
        server = self.server
        if server is not None and server._bound_by != os.getpid():
            server._forget_in_child()


def _in_checkpoint(req: Mapping[str, Any]) -> bool:
    """A ``prepare-snapshot``'s ``"in_checkpoint"``: true when it runs inside a checkpoint
    that its failure aborts and whose failure the platform answers (gVisor's
    save-restore-exec: ``error`` to the waiter); absent or false when run by hand."""
    value = req.get("in_checkpoint", False)
    if not isinstance(value, bool):
        raise _BadRequest('"in_checkpoint" must be true or false')
    return value


def _wants_budget(req: Mapping[str, Any]) -> bool:
    """A ``prepare-snapshot``'s ``"budget"``: true asks for the budget line before the
    reply (see :meth:`ControlServer._budget_notice`)."""
    value = req.get("budget", False)
    if not isinstance(value, bool):
        raise _BadRequest('"budget" must be true or false')
    return value


def _failed_hooks(report: Report) -> str:
    """The failed required hooks with their errors: the platform's log then says what to
    fix (e.g. the path of a deleted file held open on a volume, or of one gone)."""
    return "; ".join(f"{h.name} ({describe_error(h.error)})" if h.error else h.name
                     for h in report.failed if h.required)
