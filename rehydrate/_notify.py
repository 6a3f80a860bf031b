"""The control-socket client (:mod:`rehydrate.detect.control`), light enough for ``notify``.

``rehydrate notify [save|resume|restore]`` is built to be run by platforms:

* gVisor's save-restore-exec binary: without an argument it reads
  ``GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE`` (``save``, ``resume``, ``restore``);
* a CRIU ``--action-script``: it reads ``CRTOOLS_SCRIPT_ACTION``; ``pre-dump`` means save,
  ``post-resume`` means restore, ``post-dump`` sends ``resume`` without waiting for the
  reply (:func:`post`: the tasks are frozen until CRIU lets them go on, with
  ``--leave-running``, or kills them), and every other action exits 0 at once without
  contacting the process. CRIU names one tree: the socket must be named
  (``$REHYDRATE_CONTROL_SOCKET`` or ``--socket``; the default directory's only socket
  may be another process's), and with ``$CRTOOLS_INIT_PID`` set its server must be
  that task or a descendant of it.

It exits 0 when the process's hooks succeeded, 1 when the report is not ok (a required
hook failed: the platform should abort the checkpoint), 3 when the process cannot be
reached, 4 when the socket is not trusted, 2 on usage errors.

Trust: the client talks only to a server run by its own uid or by root (``SO_PEERCRED``
of the listening socket, checked before anything is sent) — or, for a socket the operator
named (``--socket``, ``$REHYDRATE_CONTROL_SOCKET``), by the uid owning that socket file —
and finds sockets on its own only in a default directory owned by its uid with mode 0700,
like the server requires.
A socket of another user could otherwise answer ``ok`` to ``notify save`` without running
any hook, and the checkpoint would go ahead.

Why this module imports so little: ``notify`` runs inside the sandbox at every checkpoint
and restore, where each module imported costs a millisecond or more (measured under runsc:
``socket`` 12-32 ms with ``enum``/``selectors``, ``json`` 17 ms with ``re``, ``argparse``
25 ms once it formats anything). So it reads its command line itself
(:func:`parse`; anything unusual goes to the argparse CLI, which words errors and help),
talks through the C modules ``_socket`` and ``_json`` that the ``socket`` and ``json``
modules wrap, and imports ``json`` only to print ``--json`` output or to send a request
with fields. ``rehydrate.control_client`` is the argparse side (``status``, ``trigger``,
``--help``) on top of this module.
"""

from __future__ import annotations

import _json
import _socket
import os
import stat
import sys
import time

from . import _config
from ._socket_path import ENV_SOCKET, default_socket_dir

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["ControlError", "Options", "UntrustedSocket", "find_socket", "notify", "parse",
           "post", "request"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_UNTRUSTED = 4

MAX_REPLY = 64 * 1024 * 1024
DEFAULT_TIMEOUT = 120.0
"""How long ``notify`` waits for a reply without ``--timeout``; ``notify save`` waits
longer when the process announces a longer budget for its before-snapshot hooks."""
BUDGET_MARGIN = 10.0
"""Seconds ``notify save`` waits past the budget the process announced: the reply's way
back, a busy machine, a run of the engine's still finishing when the request came."""

GVISOR_MODE = "GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE"
CRIU_ACTION = "CRTOOLS_SCRIPT_ACTION"
CRIU_INIT_PID = "CRTOOLS_INIT_PID"
"""Set by CRIU for its action scripts: the pid of the tree's root task (measured with
CRIU 4.1 at ``pre-dump``, ``post-dump`` and ``post-resume``)."""
NOTIFY_CMD = {"save": "prepare-snapshot", "resume": "resume", "restore": "restore"}
"""``notify`` action -> control command."""
_CRIU = {"pre-dump": "save", "post-resume": "restore"}
_CRIU_POSTED = {"post-dump": "resume"}
"""CRIU actions whose notice is sent without waiting for the reply (see :func:`post`)."""
POST_TIMEOUT = 1.0
"""How long :func:`post` may take to connect and send (the tasks never read meanwhile)."""
_UCRED = 12  # struct ucred: pid, uid, gid (three C ints)


class ControlError(RuntimeError):
    """The process could not be reached, or its reply was unreadable."""


class UntrustedSocket(ControlError):
    """The socket, or the directory it was found in, belongs to another user."""


# -- trust -------------------------------------------------------------------------------


def _check_dir(directory: str) -> None:
    """Refuse a default socket directory that is not ours alone (what the server checks)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != me or st.st_mode & 0o077:
        found = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
                 f"uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"
                 + ("" if stat.S_ISDIR(st.st_mode) else ", not a directory"))
        raise UntrustedSocket(
            f"not trusting {directory}: it must be a directory owned by uid {me} with mode "
            f"0700 (found {found}); remove it, or pass --socket")


def _check_peer(sock: _socket.socket, path: str, named: bool,
                expect_uid: int | None = None, expect_pid: int | None = None,
                *, expect_tree: int | None = None) -> None:
    """Refuse a server that is neither our uid nor root, or not the one pinned.

    One exception, for root running ``notify`` for a workload of another uid (a CRIU action
    script, save-restore-exec in a pod with ``runAsUser``): when the operator named the
    socket (``--socket`` or ``$REHYDRATE_CONTROL_SOCKET``), a server of uid U is trusted if
    U owns the socket file and the directory holding it is owned by U or root and writable
    by nobody else — a place only U (or root) could have put a socket. Another user who
    created that directory first passes this test too: ``expect_uid`` / ``expect_pid``
    (``--expect-uid`` / ``--expect-pid``) pin the server, and any other one is refused.
    ``expect_tree`` (CRIU's ``$CRTOOLS_INIT_PID``): the server must be that process or a
    descendant of it — the tree being dumped or restored, not some other process.
    """
    cred = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, _UCRED)
    pid, uid = (int.from_bytes(cred[i:i + 4], sys.byteorder, signed=True) for i in (0, 4))
    if expect_uid is not None and uid != expect_uid:
        raise UntrustedSocket(f"not trusting {path}: it is served by uid {uid} (pid {pid}), "
                              f"expected uid {expect_uid}")
    if expect_pid is not None and pid != expect_pid:
        raise UntrustedSocket(f"not trusting {path}: it is served by pid {pid} (uid {uid}), "
                              f"expected pid {expect_pid}")
    if expect_tree is not None and not _in_tree(pid, expect_tree):
        raise UntrustedSocket(f"not trusting {path}: it is served by pid {pid} (uid {uid}), "
                              f"which is not in the process tree of pid {expect_tree} "
                              f"(${CRIU_INIT_PID}: the tree CRIU is dumping or restoring)")
    me = os.geteuid()
    if expect_uid is not None or uid in (me, 0) or (named and _placed_by(uid, path)):
        return
    raise UntrustedSocket(f"not trusting {path}: it is served by uid {uid} (pid {pid}); "
                          f"only uid {me} or root may answer (or, for a socket named with "
                          f"--socket, its owner when its directory is private to that owner; "
                          f"pin it with --expect-uid)")


def _in_tree(pid: int, root: int) -> bool:
    """Whether ``pid`` is ``root`` or a descendant of it (parents read from ``/proc``; a
    process that cannot be read there is not known to be in the tree)."""
    for _ in range(4096):  # bounded: a parent chain is never this long
        if pid == root:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat_line = f.read()
            # after the command name, which may hold spaces and parentheses itself
            pid = int(stat_line[stat_line.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _placed_by(uid: int, path: str) -> bool:
    try:
        sock_st = os.lstat(path)
        dir_st = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return (sock_st.st_uid == uid and dir_st.st_uid in (uid, 0)
            and not dir_st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def find_socket(explicit: str | None = None) -> str:
    """The socket to talk to: ``explicit``, ``$REHYDRATE_CONTROL_SOCKET``, or the only one
    in the default directory. When that directory holds several, those that refuse a
    connection (a process that died without removing its socket) are not counted."""
    if explicit is not None:
        if not explicit:  # ``--socket "$SOCK"`` with SOCK unset: not "find one for me"
            raise ControlError("the socket path given is empty (an unset variable?)")
        return os.path.normpath(explicit)
    env = _config.text(ENV_SOCKET)
    if env:
        # as the server binds it (``..`` taken lexically): through a directory that does
        # not exist, ``a/missing/../ctl.sock`` would not reach the server's ``a/ctl.sock``
        return os.path.normpath(env)
    directory = default_socket_dir()
    _check_dir(directory)
    try:  # what the glob ``*.sock`` matches: no hidden names (the server's temporary ones)
        names = os.listdir(directory)
    except OSError:  # missing or unreadable: no socket found there, as glob would say
        names = []
    found = sorted(os.path.join(directory, n) for n in names
                   if n.endswith(".sock") and not n.startswith("."))
    stale = 0
    if len(found) > 1:
        live = [f for f in found if not _refused(f)]
        stale, found = len(found) - len(live), live
    if len(found) == 1:
        return found[0]
    if not found and stale:
        raise ControlError(f"no control socket: {ENV_SOCKET} is not set and nobody listens "
                           f"at the {stale} sockets in {directory} (left by processes that "
                           "exited; pass --socket)")
    if not found:
        raise ControlError(f"no control socket: {ENV_SOCKET} is not set and {directory} has "
                           "none (set it for the process and here, or pass --socket)")
    raise ControlError(f"{len(found)} control sockets in {directory}: pass --socket "
                       f"(one of {', '.join(os.path.basename(f) for f in found)})")


def _refused(path: str) -> bool:
    """Whether nobody listens at the socket ``path`` (``ECONNREFUSED``, or gone). Anything
    else — a server slow to accept, a socket this uid may not connect to — may be live,
    and is counted. Nothing is sent: the trust checks come with the request."""
    import errno

    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as exc:
        return exc.errno in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()
    return False


# -- one request -------------------------------------------------------------------------


def request(cmd: str, *, socket_path: str | None = None, timeout: float | None = DEFAULT_TIMEOUT,
            fields: dict[str, Any] | None = None, expect_uid: int | None = None,
            expect_pid: int | None = None, follow_budget: bool = False,
            expect_tree: int | None = None, **more: Any) -> dict[str, Any]:
    """Send one request and return the reply (a dict with at least ``ok``).

    ``fields`` and keyword arguments become request fields (use ``fields`` for names that
    clash with this function's own, e.g. the ``timeout`` of ``trigger``); ``timeout`` is how
    long this client waits for the reply (None: as long as it takes).

    ``follow_budget`` (``prepare-snapshot``): ask the process for the longest its
    before-snapshot hooks may take under their own limits, and wait that long plus
    :data:`BUDGET_MARGIN` when it is longer than ``timeout``. A process that does not
    announce one (an older rehydrate, a hook without a limit) leaves ``timeout`` as it is.

    Raises :class:`ControlError` when the socket cannot be reached, the reply does not
    come within ``timeout`` seconds, or it is not a JSON object; :class:`UntrustedSocket`
    (before sending anything) when the server runs as neither this uid nor root, or is not
    the uid ``expect_uid`` / the pid ``expect_pid`` (pins: a server of that uid is then
    trusted even when it is neither this uid nor root), or is not ``expect_tree`` or one
    of its descendants.
    """
    # one line before any connect: a huge int overflowed the deadline sum, a negative
    # one timed out at once, NaN never did
    timeout = _config.optional_seconds(timeout, "request(): timeout", zero_ok=False)
    named = bool(socket_path or _config.text(ENV_SOCKET))
    path = find_socket(socket_path)
    if follow_budget:
        more["budget"] = True
    payload = _encode({"cmd": cmd, **(fields or {}), **more})
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.005
    while True:
        reply = _exchange(path, payload, deadline, timeout,
                          lambda sock: _check_peer(sock, path, named, expect_uid, expect_pid,
                                                   expect_tree=expect_tree),
                          follow_budget=follow_budget)
        # "busy": the server refused the connection before reading it (every slot runs
        # a request, or no thread could start to serve it): nothing ran, so asking
        # again is safe
        if reply is not _BUSY:
            return reply
        if deadline is not None and time.monotonic() + delay > deadline:
            raise ControlError(f"{path} stayed busy (too many clients, or no thread to "
                               f"serve one) for {timeout:g}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)



# Users import these from ``rehydrate``: reprs, tracebacks and the API reference say so.
for _public in (ControlError, UntrustedSocket, request):
    _public.__module__ = "rehydrate"
del _public

_BUSY: dict[str, Any] = {"ok": False, "error": "busy"}


def _encode(req: dict[str, Any]) -> bytes:
    """One request line. ``{"cmd": …}`` with nothing but flags set to true (every
    ``notify``) needs no encoder module."""
    if isinstance(req["cmd"], str) and all(
            isinstance(k, str) and (k == "cmd" or v is True) for k, v in req.items()):
        enc = _json.encode_basestring_ascii
        return ("{" + ", ".join(f"{enc(k)}: {enc(v) if k == 'cmd' else 'true'}"
                                for k, v in req.items()) + "}\n").encode()
    import json

    return json.dumps(req).encode() + b"\n"


class _Decoding:
    """The settings ``json.loads`` gives its C scanner: plain dicts, lists, floats, ints."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"NaN": float("nan"), "Infinity": float("inf"),
                      "-Infinity": float("-inf")}.__getitem__


# typeshed names the context's type make_scanner; the C code only reads these attributes
_scan = _json.make_scanner(_Decoding())  # type: ignore[arg-type]


def _decode(line: bytes) -> object:
    """``json.loads(line)`` through the C scanner that ``json`` itself uses, without
    importing ``json`` (and ``re``): ValueError when ``line`` is not one JSON value."""
    text = line.decode().strip()
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("extra data after the JSON value")
    return value


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def not_a_socket(path: str) -> str | None:
    """Why ``path`` cannot be a control socket although something is there, else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    kind = next((name for test, name in kinds if test(mode)), "another kind of file")
    return f"{path} exists and is {kind}, not a socket"


def _unreachable(path: str, exc: OSError) -> str:
    """Why connecting to ``path`` failed, as the user can act on it. The bare error read
    "Connection refused" for a socket file a process left when it died, and "Resource
    temporarily unavailable" after a full backlog had been waited out for the whole
    timeout."""
    why = not_a_socket(path)
    if why:
        return why
    if isinstance(exc, ConnectionRefusedError):
        return ("nobody listens there (connection refused): a socket file left by a "
                "process that exited or stopped serving it")
    if isinstance(exc, BlockingIOError):
        return ("the process accepted no connection in time (its listen backlog stayed "
                "full): hung or overloaded")
    return exc.strerror or str(exc)


def _connect(sock: _socket.socket, path: str, deadline: float | None) -> None:
    """Connect, waiting out a full listen backlog (``EAGAIN``) until ``deadline``."""
    delay = 0.002
    while True:
        sock.settimeout(_remaining(deadline))
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _budget(line: bytes) -> float | bool | None:
    """What a ``{"pending": true, "budget": S}`` line announced: S (None: no limit), or
    False when ``line`` is no such notice (then it is the reply)."""
    try:
        notice = _decode(line)
    except (ValueError, RecursionError):
        return False
    if not isinstance(notice, dict) or notice.get("pending") is not True or "ok" in notice:
        return False
    value = notice.get("budget")
    if (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value <= _config.MAX_SECONDS):
        return float(value)
    return None


def _exchange(path: str, payload: bytes, deadline: float | None, timeout: float | None,
              check: Callable[[_socket.socket], None], *,
              follow_budget: bool = False) -> dict[str, Any]:
    """One connection: connect, ``check`` the peer, send, read one reply line.

    ``follow_budget``: a budget notice may come first (see :func:`request`); it moves
    ``deadline`` later when the budget is longer, and the reply is the line after it."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        try:
            _connect(sock, path, deadline)
        except OSError as exc:
            why = _unreachable(path, exc)
            raise ControlError(f"cannot reach the process at {path}: {why}") from None
        check(sock)
        sock.settimeout(_remaining(deadline))
        buf = bytearray()
        try:
            try:  # noqa: SIM105 - contextlib is one more module for every notifier
                sock.sendall(payload)
            except (BrokenPipeError, ConnectionResetError):
                # The server answered and closed before reading anything: a "busy"
                # refusal (every slot taken, or no thread to serve this client). Its
                # line is still there to read, and says to ask again.
                pass
            while True:
                # The limit is on the whole reply: a socket timeout alone restarts at every
                # chunk, and a server trickling bytes held the command without any limit.
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError
                sock.settimeout(_remaining(deadline))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                if b"\n" in chunk:  # only the new chunk: rescanning it all was quadratic
                    if not follow_budget:
                        break
                    follow_budget = False  # one notice at most
                    head, _, rest = bytes(buf).partition(b"\n")
                    budget = _budget(head)
                    if budget is False:
                        break  # no notice (an older process): this is the reply
                    if isinstance(budget, float) and deadline is not None:
                        wait = time.monotonic() + budget + BUDGET_MARGIN
                        if wait > deadline:
                            # the error then names the whole wait, not the default
                            timeout = (timeout or 0.0) + (wait - deadline)
                            deadline = wait
                    buf = bytearray(rest)
                    if b"\n" in rest:
                        break
                if len(buf) > MAX_REPLY:
                    raise ControlError("reply too large")
        except TimeoutError:
            raise ControlError(f"no reply from {path} within {timeout:g}s") from None
        except OSError as exc:
            if not buf:
                raise ControlError(f"connection to {path} failed: "
                                   f"{exc.strerror or exc}") from None
    finally:
        sock.close()
    line = bytes(buf.split(b"\n", 1)[0])
    if not line:
        raise ControlError(f"{path} closed the connection without a reply")
    try:
        reply = _decode(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError too
        raise ControlError(f"unreadable reply from {path}") from None
    # "ok" is a JSON boolean in every reply: anything else ("false", 1) is garbage, not a
    # verdict — read as truthy, a save notice said ok and the checkpoint went ahead.
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise ControlError(f"unexpected reply from {path}")
    if reply.get("ok") is False and str(reply.get("error", "")).startswith("busy:"):
        return _BUSY
    return reply


def post(cmd: str, *, socket_path: str | None = None, expect_uid: int | None = None,
         expect_pid: int | None = None, timeout: float = POST_TIMEOUT,
         expect_tree: int | None = None) -> None:
    """Send one request and do not wait for its reply: for a process that is frozen now
    and reads it when it runs again (CRIU's ``post-dump``: ``--leave-running`` lets it go
    on; a plain dump kills it, and the request with it).

    The kernel queues the connection on the listening socket and the request in the
    connection's buffer without the process running; the server acts on a complete
    request line whose client has gone, and its reply, undeliverable, is dropped. The
    socket is checked like :func:`request`'s before anything is sent. Raises
    :class:`ControlError` (:class:`UntrustedSocket`) when it cannot be sent.
    """
    named = bool(socket_path or _config.text(ENV_SOCKET))
    path = find_socket(socket_path)
    payload = _encode({"cmd": cmd})
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        try:
            # One attempt: a full backlog is not drained while the process is frozen.
            sock.connect(path)
        except OSError as exc:
            why = _unreachable(path, exc)
            raise ControlError(f"cannot reach the process at {path}: {why}") from None
        _check_peer(sock, path, named, expect_uid, expect_pid, expect_tree=expect_tree)
        try:
            sock.sendall(payload)
        except OSError as exc:
            raise ControlError(f"connection to {path} failed: {exc.strerror or exc}") from None
    finally:
        # Nothing unread on this side: the close is an orderly end of input after the
        # request, not a reset, and the queued request stays readable.
        sock.close()


# -- the commands' output ----------------------------------------------------------------


# One escaping for every line shown: the control client's output here, the engine's log
# lines and reports (_context.describe_error).
one_line = _config.one_line


def err(message: str) -> None:
    """One line on stderr, prefixed ``rehydrate:``."""
    print(f"rehydrate: {one_line(message)}", file=sys.stderr)


def dump(data: object) -> None:
    """``data`` as indented JSON on stdout (``--json``)."""
    import json

    if sys.stdout is None:  # started with fd 1 closed: nobody reads it
        return
    json.dump(data, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def json_error(message: str) -> None:
    """``{"ok": false, "error": message}`` on stdout, for ``--json``: machines read stdout,
    and an empty one is no JSON at all. Said on stderr already by the caller: an output
    that cannot be written is left to the exit status, a reader gone to the entry point."""
    try:
        dump({"ok": False, "error": message})
    except BrokenPipeError:
        raise
    except OSError:
        pass


def summary(report: object) -> str:
    """One line for a report dict: event, kind, reason, generation, ok, hooks, failures
    (a reply of another shape — another rehydrate version — is said to be one)."""
    if not report:
        return "none"
    if not isinstance(report, dict):
        return f"a report of an unexpected shape ({type(report).__name__})"
    hooks = [h for h in as_list(report.get("hooks")) if isinstance(h, dict)]
    bad = [h for h in hooks if h.get("outcome") in ("failed", "timeout")]
    failed = [str(h.get("name")) for h in bad if h.get("required", True)]
    optional = [str(h.get("name")) for h in bad if not h.get("required", True)]
    text = (f"{report.get('event')} kind={report.get('kind')} reason={report.get('reason')} "
            f"generation={report.get('generation')} ok={report.get('ok')} "
            f"{len(hooks)} hook(s) in {_number(report.get('duration')) * 1000:.1f} ms")
    if failed:
        text += f", failed: {', '.join(failed)}"
    recovered = [str(n) for n in as_list(report.get("recovered"))]
    if recovered:  # failed, then recovered while the run went on: it ended ready
        text += f", recovered during the run: {', '.join(recovered)}"
    if optional:  # reported, but they do not make the report fail
        text += f", optional hook(s) failed (not fatal): {', '.join(optional)}"
    return text


def as_list(value: object) -> list[Any]:
    """``value`` when a reply gave a list, else empty (a reply is data, not trusted code)."""
    return value if isinstance(value, list) else []


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def call(cmd: str, *, label: str, socket_path: str | None, timeout: float | None,
         as_json: bool, expect_uid: int | None, expect_pid: int | None,
         fields: dict[str, Any] | None = None, follow_budget: bool = False,
         expect_tree: int | None = None) -> tuple[dict[str, Any] | None, int]:
    """Send ``cmd`` for a CLI command: (reply, exit code), the reply None when there is
    none. A failure is one line on stderr prefixed with ``label`` (and, with ``as_json``,
    ``{"ok": false, "error": …}`` on stdout when there is no reply). ``follow_budget``,
    ``expect_tree``: as for :func:`request`."""
    try:
        reply = request(cmd, socket_path=socket_path, timeout=timeout, fields=fields,
                        expect_uid=expect_uid, expect_pid=expect_pid,
                        follow_budget=follow_budget, expect_tree=expect_tree)
    except ControlError as exc:
        err(f"{label}: {exc}")
        if as_json:
            json_error(str(exc))
        return None, EXIT_UNTRUSTED if isinstance(exc, UntrustedSocket) else EXIT_UNREACHABLE
    if not reply.get("ok"):
        err(f"{label}: {reply.get('error') or 'failed'}")
        return reply, EXIT_FAILED
    return reply, EXIT_OK


# -- notify ------------------------------------------------------------------------------


class Options:
    """A ``notify`` command line: what :func:`parse` reads (the argparse CLI fills the same
    fields). ``timeout`` None: no ``--timeout`` given — :data:`DEFAULT_TIMEOUT`, and for
    ``save`` the process's announced budget when that is longer."""

    __slots__ = ("action", "expect_pid", "expect_uid", "json", "socket", "timeout")

    def __init__(self, action: str | None = None, *, socket: str | None = None,
                 timeout: float | None = None, json: bool = False,
                 expect_uid: int | None = None, expect_pid: int | None = None) -> None:
        self.action = action
        self.socket = socket
        self.timeout = timeout
        self.json = json
        self.expect_uid = expect_uid
        self.expect_pid = expect_pid


def timeout_value(value: object, what: str = "timeout") -> float:
    """A timeout: :func:`rehydrate._config.seconds`, every refusal a ``ValueError`` (what a
    command line or a control request answers as a bad argument)."""
    try:
        return _config.seconds(value, what)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def positive(text: str) -> float:
    """``--timeout``: :func:`timeout_value` of a command-line word."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    return timeout_value(value)


def ident(text: str) -> int:
    """``--expect-uid`` / ``--expect-pid``: an integer >= 0 (ValueError otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if value < 0:
        raise ValueError("must be >= 0")
    return value


_VALUED: dict[str, tuple[str, Callable[[str], object]]] = {
    "--socket": ("socket", str), "--timeout": ("timeout", positive),
    "--expect-uid": ("expect_uid", ident), "--expect-pid": ("expect_pid", ident)}


def parse(argv: list[str]) -> Options | None:
    """The options of a plain ``notify`` command line (after ``notify``), or None for
    anything else — ``--help``, an abbreviated or unknown option, a bad value, a second
    action — which the argparse CLI then answers exactly as it always did."""
    opts = Options()
    args = iter(argv)
    for arg in args:
        if arg == "--json":
            opts.json = True
            continue
        if arg in NOTIFY_CMD and opts.action is None:
            opts.action = arg
            continue
        name, eq, value = arg.partition("=")
        if name not in _VALUED:
            return None
        if not eq:
            value = next(args, "-")
            if value.startswith("-"):  # argparse's call: a value or an option
                return None
        field, convert = _VALUED[name]
        try:
            setattr(opts, field, convert(value))
        except ValueError:
            return None
    return opts


def _resolve_action(arg: str | None) -> tuple[str | None, str | None, bool, str | None]:
    """(action, None, wait, criu), (None, None, True, criu) for "nothing to do", or (None,
    usage error, True, None). ``wait``: False when the notice is sent without waiting for
    the reply; ``criu``: the CRIU action it came from (None: not a CRIU action script)."""
    if arg:
        return arg, None, True, None
    mode = os.environ.get(GVISOR_MODE)
    if mode:
        if mode in NOTIFY_CMD:
            return mode, None, True, None
        # gVisor's own values are the three above; anything else is an environment
        # value that is not rehydrate's to repeat (key names only)
        return None, (f"{GVISOR_MODE} is not save, resume or restore (its value is not "
                      "shown: environment values never are)"), True, None
    action = os.environ.get(CRIU_ACTION)
    if action:
        if action in _CRIU_POSTED:
            return _CRIU_POSTED[action], None, False, action
        return _CRIU.get(action), None, True, action
    return None, (f"notify needs save, resume or restore (or {GVISOR_MODE} / {CRIU_ACTION} "
                  "in the environment)"), True, None


def _criu_tree() -> int | None:
    """The root of the tree CRIU dumps or restores (``$CRTOOLS_INIT_PID``), or None."""
    try:
        pid = int(os.environ.get(CRIU_INIT_PID) or "")
    except ValueError:  # unset or not a number: no check to make (the value is not shown)
        return None
    return pid if pid > 1 else None


def _post_notice(action: str, opts: Options, tree: int | None = None) -> int:
    """CRIU's ``post-dump``: the ``resume`` notice, not waited for; always exit 0.

    A non-zero exit at ``post-dump`` makes CRIU fail the dump and leave the tasks running
    whatever was asked, so nothing here may fail it. A process that is gone or cannot be
    reached has nobody to resume; CRIU logs the script's stderr, so that says nothing.
    """
    try:
        post(NOTIFY_CMD[action], socket_path=opts.socket, expect_uid=opts.expect_uid,
             expect_pid=opts.expect_pid, timeout=min(opts.timeout or POST_TIMEOUT,
                                                     POST_TIMEOUT), expect_tree=tree)
    except UntrustedSocket as exc:  # worth a line: another user's socket at that path now
        err(f"notify {action} (post-dump): {exc}")
    except ControlError:
        pass
    return EXIT_OK


def notify(opts: Options) -> int:
    """Run ``rehydrate notify``: the exit status (see the module docstring)."""
    action, problem, wait, criu = _resolve_action(opts.action)
    if problem:
        err(problem)
        if opts.json:
            json_error(problem)
        return EXIT_USAGE
    if action is None:
        return EXIT_OK  # a CRIU action at which the process is frozen or not involved
    tree = None
    if criu is not None:
        # CRIU dumps or restores one given tree: the only socket in the default directory
        # may be any other rehydrate process's, whose hooks would then run for this dump.
        if opts.socket is None and not _config.text(ENV_SOCKET):
            problem = (f"no control socket named: set {ENV_SOCKET} in CRIU's environment "
                       "or pass --socket (for a CRIU action script the default directory "
                       "is not searched: its socket may be another process's)")
            err(f"notify {action} (CRIU {criu}): {problem}")
            if opts.json:
                json_error(problem)
            # post-dump: a non-zero exit fails the dump (see _post_notice)
            return EXIT_UNREACHABLE if wait else EXIT_OK
        tree = _criu_tree()
    if not wait:
        return _post_notice(action, opts, tree)
    # Run by gVisor's save-restore-exec, a failure here aborts the checkpoint in progress,
    # and gVisor answers that abort ("error") to the process's waiter: the process may then
    # take that answer for this save's (see "in_checkpoint" in rehydrate.detect.control).
    # A save run by hand has no checkpoint behind it, whose answer could be expected.
    fields = ({"in_checkpoint": True}
              if action == "save" and os.environ.get(GVISOR_MODE) == "save" else None)
    # Without --timeout, a save waits as long as the process says its before-snapshot
    # hooks may take (a drain, then an engine's sleep): giving up earlier aborted a
    # checkpoint whose hooks were each within their own limits.
    reply, code = call(NOTIFY_CMD[action], label=f"notify {action}", socket_path=opts.socket,
                       timeout=DEFAULT_TIMEOUT if opts.timeout is None else opts.timeout,
                       as_json=opts.json, expect_uid=opts.expect_uid,
                       expect_pid=opts.expect_pid, fields=fields,
                       follow_budget=action == "save" and opts.timeout is None,
                       expect_tree=tree)
    try:
        if reply is not None and opts.json:
            dump(reply)
        elif code == EXIT_OK and reply is not None:
            dedup = (" — de-duplicated: this restore had already run, nothing ran again"
                     if reply.get("deduplicated") else "")
            print(one_line(f"{action}: ok ({summary(reply.get('report'))}){dedup}"))
        if sys.stdout is not None:  # None: started with fd 1 closed (print() writes nothing)
            sys.stdout.flush()
    except BrokenPipeError:
        raise  # the reader is gone: the entry point answers that (exit 141)
    except OSError as exc:
        # The exit status tells the platform how the notice went (1 would say a required
        # hook failed); a full disk under stdout does not change that.
        err(f"notify {action}: the answer could not be written to stdout "
            f"({exc.strerror or exc}); exit status {code} is the notice's")
    return code
