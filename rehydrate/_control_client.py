"""Client of the control socket (:mod:`rehydrate.detect.control`) and the CLI commands on it.

``rehydrate notify [save|resume|restore]`` is built to be run by platforms:

* gVisor's save-restore-exec binary: without an argument it reads
  ``GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE`` (``save``, ``resume``, ``restore``);
* a CRIU ``--action-script``: it reads ``CRTOOLS_SCRIPT_ACTION``; ``pre-dump`` means save,
  ``post-resume`` means restore, every other action exits 0 at once without contacting
  the process (at ``post-dump`` and ``post-restore`` the tasks are frozen and would never
  answer).

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
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

from . import _config
from ._socket_path import ENV_SOCKET, default_socket_dir

__all__ = ["ControlError", "UntrustedSocket", "add_commands", "find_socket", "notify_main",
           "request"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_UNTRUSTED = 4

MAX_REPLY = 64 * 1024 * 1024
DEFAULT_TIMEOUT = 120.0

GVISOR_MODE = "GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE"
CRIU_ACTION = "CRTOOLS_SCRIPT_ACTION"
_NOTIFY_CMD = {"save": "prepare-snapshot", "resume": "resume", "restore": "restore"}
_CRIU = {"pre-dump": "save", "post-resume": "restore"}
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ControlError(RuntimeError):
    """The process could not be reached, or its reply was unreadable."""


class UntrustedSocket(ControlError):
    """The socket, or the directory it was found in, belongs to another user."""


def _check_dir(directory: str) -> None:
    """Refuse a default socket directory that is not ours alone (what the server checks)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != me or st.st_mode & 0o077:
        raise UntrustedSocket(
            f"not trusting {directory}: it must be a directory owned by uid {me} with mode "
            f"0700 (found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); remove it, "
            "or pass --socket")


def _check_peer(sock: socket.socket, path: str, named: bool,
                expect_uid: int | None = None, expect_pid: int | None = None) -> None:
    """Refuse a server that is neither our uid nor root, or not the one pinned.

    One exception, for root running ``notify`` for a workload of another uid (a CRIU action
    script, save-restore-exec in a pod with ``runAsUser``): when the operator named the
    socket (``--socket`` or ``$REHYDRATE_CONTROL_SOCKET``), a server of uid U is trusted if
    U owns the socket file and the directory holding it is owned by U or root and writable
    by nobody else — a place only U (or root) could have put a socket. Another user who
    created that directory first passes this test too: ``expect_uid`` / ``expect_pid``
    (``--expect-uid`` / ``--expect-pid``) pin the server, and any other one is refused.
    """
    pid, uid, _gid = _CRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if expect_uid is not None and uid != expect_uid:
        raise UntrustedSocket(f"not trusting {path}: it is served by uid {uid} (pid {pid}), "
                              f"expected uid {expect_uid}")
    if expect_pid is not None and pid != expect_pid:
        raise UntrustedSocket(f"not trusting {path}: it is served by pid {pid} (uid {uid}), "
                              f"expected pid {expect_pid}")
    me = os.geteuid()
    if expect_uid is not None or uid in (me, 0) or (named and _placed_by(uid, path)):
        return
    raise UntrustedSocket(f"not trusting {path}: it is served by uid {uid} (pid {pid}); "
                          f"only uid {me} or root may answer (or, for a socket named with "
                          f"--socket, its owner when its directory is private to that owner; "
                          f"pin it with --expect-uid)")


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
    in the default directory."""
    if explicit:
        return explicit
    env = _config.text(ENV_SOCKET)
    if env:
        return env
    directory = default_socket_dir()
    _check_dir(directory)
    found = sorted(glob.glob(os.path.join(glob.escape(directory), "*.sock")))
    if len(found) == 1:
        return found[0]
    if not found:
        raise ControlError(f"no control socket: {ENV_SOCKET} is not set and {directory} has "
                           "none (set it for the process and here, or pass --socket)")
    raise ControlError(f"{len(found)} control sockets in {directory}: pass --socket "
                       f"(one of {', '.join(os.path.basename(f) for f in found)})")


def request(cmd: str, *, socket_path: str | None = None, timeout: float | None = DEFAULT_TIMEOUT,
            fields: dict[str, Any] | None = None, expect_uid: int | None = None,
            expect_pid: int | None = None, **more: Any) -> dict[str, Any]:
    """Send one request and return the reply (a dict with at least ``ok``).

    ``fields`` and keyword arguments become request fields (use ``fields`` for names that
    clash with this function's own, e.g. the ``timeout`` of ``trigger``); ``timeout`` is how
    long this client waits for the reply (None: as long as it takes).

    Raises :class:`ControlError` when the socket cannot be reached, the reply does not
    come within ``timeout`` seconds, or it is not a JSON object; :class:`UntrustedSocket`
    (before sending anything) when the server runs as neither this uid nor root, or is not
    the uid ``expect_uid`` / the pid ``expect_pid`` (pins: a server of that uid is then
    trusted even when it is neither this uid nor root).
    """
    named = bool(socket_path or _config.text(ENV_SOCKET))
    path = find_socket(socket_path)
    payload = json.dumps({"cmd": cmd, **(fields or {}), **more}).encode() + b"\n"
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.005
    while True:
        reply = _exchange(path, payload, deadline, timeout,
                          lambda sock: _check_peer(sock, path, named, expect_uid, expect_pid))
        # "busy": the server refused the connection before reading it (every slot runs
        # a request): nothing ran, so asking again is safe
        if reply is not _BUSY:
            return reply
        if deadline is not None and time.monotonic() + delay > deadline:
            raise ControlError(f"{path} stayed busy (too many clients) for {timeout:g}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


_BUSY: dict[str, Any] = {"ok": False, "error": "busy"}


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def _connect(sock: socket.socket, path: str, deadline: float | None) -> None:
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


def _exchange(path: str, payload: bytes, deadline: float | None, timeout: float | None,
              check: Callable[[socket.socket], None]) -> dict[str, Any]:
    """One connection: connect, ``check`` the peer, send, read one reply line."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        try:
            _connect(sock, path, deadline)
        except OSError as exc:
            raise ControlError(f"cannot reach the process at {path}: "
                               f"{exc.strerror or exc}") from None
        check(sock)
        sock.settimeout(_remaining(deadline))
        buf = b""
        try:
            sock.sendall(payload)
            while b"\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
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
    line = buf.split(b"\n", 1)[0]
    if not line:
        raise ControlError(f"{path} closed the connection without a reply")
    try:
        reply = json.loads(line)
    except ValueError:
        raise ControlError(f"unreadable reply from {path}") from None
    if not isinstance(reply, dict) or "ok" not in reply:
        raise ControlError(f"unexpected reply from {path}")
    if reply.get("ok") is False and str(reply.get("error", "")).startswith("busy:"):
        return _BUSY
    return reply


# -- CLI -------------------------------------------------------------------------------


def _err(message: str) -> None:
    print(f"rehydrate: {message}", file=sys.stderr)


def _dump(data: object) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def _summary(report: dict[str, Any] | None) -> str:
    if not report:
        return "none"
    hooks = report.get("hooks") or []
    bad = [h for h in hooks if h.get("outcome") in ("failed", "timeout")]
    failed = [str(h.get("name")) for h in bad if h.get("required", True)]
    optional = [str(h.get("name")) for h in bad if not h.get("required", True)]
    text = (f"{report.get('event')} kind={report.get('kind')} reason={report.get('reason')} "
            f"generation={report.get('generation')} ok={report.get('ok')} "
            f"{len(hooks)} hook(s) in {float(report.get('duration') or 0) * 1000:.1f} ms")
    if failed:
        text += f", failed: {', '.join(failed)}"
    if optional:  # reported, but they do not make the report fail
        text += f", optional hook(s) failed (not fatal): {', '.join(optional)}"
    return text


def _resolve_action(arg: str | None) -> tuple[str | None, str | None]:
    """(action, None), (None, None) for "nothing to do", or (None, usage error)."""
    if arg:
        return arg, None
    mode = os.environ.get(GVISOR_MODE)
    if mode:
        if mode in _NOTIFY_CMD:
            return mode, None
        return None, f"{GVISOR_MODE}={mode!r} is not save, resume or restore"
    action = os.environ.get(CRIU_ACTION)
    if action:
        return _CRIU.get(action), None
    return None, (f"notify needs save, resume or restore (or {GVISOR_MODE} / {CRIU_ACTION} "
                  "in the environment)")


def _call(cmd: str, args: argparse.Namespace, *, label: str | None = None,
          timeout: float | None = None, fields: dict[str, Any] | None = None,
          ) -> tuple[dict[str, Any] | None, int]:
    """Send ``cmd`` for a CLI command: (reply, exit code), the reply None when there is
    none. Failures are printed as one line prefixed with ``label`` (default ``cmd``)."""
    label = label or cmd
    try:
        reply = request(cmd, socket_path=args.socket, timeout=timeout, fields=fields,
                        expect_uid=args.expect_uid, expect_pid=args.expect_pid)
    except ControlError as exc:
        _err(f"{label}: {exc}")
        if getattr(args, "json", False):  # machines read stdout: say it there too
            _dump({"ok": False, "error": str(exc)})
        return None, EXIT_UNTRUSTED if isinstance(exc, UntrustedSocket) else EXIT_UNREACHABLE
    if not reply.get("ok"):
        _err(f"{label}: {reply.get('error') or 'failed'}")
        return reply, EXIT_FAILED
    return reply, EXIT_OK


def cmd_notify(args: argparse.Namespace) -> int:
    action, problem = _resolve_action(args.action)
    if problem:
        _err(problem)
        return EXIT_USAGE
    if action is None:
        return EXIT_OK  # a CRIU action at which the process is frozen or not involved
    reply, code = _call(_NOTIFY_CMD[action], args, label=f"notify {action}",
                        timeout=args.timeout)
    if reply is not None and args.json:
        _dump(reply)
    elif code == EXIT_OK and reply is not None:
        dedup = (" — de-duplicated: this restore had already run, nothing ran again"
                 if reply.get("deduplicated") else "")
        print(f"{action}: ok ({_summary(reply.get('report'))}){dedup}")
    return code


def cmd_status(args: argparse.Namespace) -> int:
    reply, code = _call("status", args, timeout=args.timeout)
    if reply is None or code != EXIT_OK:
        return code
    status = reply.get("status") or {}
    if args.json:
        _dump(status)
        return EXIT_OK
    print(f"pid:         {reply.get('pid')}")
    print(f"state:       {status.get('state')}")
    print(f"generation:  {status.get('generation')}")
    print(f"ready:       {status.get('ready')}")
    print(f"detectors:   {', '.join(status.get('detectors') or []) or 'none'}")
    print(f"last_report: {_summary(status.get('last_report'))}")
    for name, why in sorted((status.get("detector_errors") or {}).items()):
        print(f"NOT RUNNING: {name}: {why}")
    return EXIT_OK


def cmd_trigger(args: argparse.Namespace) -> int:
    fields = {"timeout": args.timeout} if args.timeout is not None else None
    reply, code = _call("trigger", args, timeout=None, fields=fields)  # waits for the answer
    if reply is not None and args.json:
        _dump(reply)
    elif reply is not None and reply.get("answer"):
        print(reply["answer"])
    return code


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def notify_main(argv: list[str] | None = None) -> int:
    """``rehydrate-notify``: ``rehydrate notify`` as a program of its own.

    For platforms that take one executable path and no arguments (a CRIU
    ``--action-script``, a save-restore-exec argv you would rather not split).
    """
    parser = argparse.ArgumentParser(prog="rehydrate-notify", description=(
        "Tell the running process a snapshot is coming / it was resumed or restored."))
    _notify_arguments(parser)
    return cmd_notify(parser.parse_args(argv))


def _common(p: argparse.ArgumentParser, timeout: float | None) -> None:
    p.add_argument("--socket", metavar="PATH",
                   help=f"control socket (default: ${ENV_SOCKET}, else the only socket "
                        f"in {default_socket_dir()})")
    p.add_argument("--timeout", type=_positive, default=timeout, metavar="S",
                   help="seconds to wait for the reply"
                        + (f" (default {timeout:g})" if timeout else " (default: no limit)"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--expect-uid", type=_id, metavar="UID",
                   help="talk only to a process of this uid (refuse any other, exit 4); "
                        "root notifying a workload of another uid should pin it")
    p.add_argument("--expect-pid", type=_id, metavar="PID",
                   help="talk only to this process (refuse any other, exit 4)")


def _notify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=sorted(_NOTIFY_CMD),
                   help=f"default: ${GVISOR_MODE}, else ${CRIU_ACTION} (pre-dump -> "
                        "save, post-resume -> restore, others: exit 0)")
    _common(p, DEFAULT_TIMEOUT)


def add_commands(sub: Any) -> None:
    """Add ``notify``, ``status`` and ``trigger`` to the ``rehydrate`` sub-parsers."""

    def add(name: str, summary: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = sub.add_parser(name, help=summary,
                                                         description=summary)
        return parser

    notify = add("notify", "tell the running process a snapshot is coming / it was resumed "
                           "or restored (for gVisor save-restore-exec and CRIU action scripts)")
    _notify_arguments(notify)
    notify.set_defaults(func=cmd_notify)

    status = add("status", "state, generation, readiness of the running process")
    _common(status, 10.0)
    status.set_defaults(func=cmd_status)

    trigger = add("trigger", "ask the running process to checkpoint itself (gVisor "
                             "application-driven checkpoint)")
    _common(trigger, None)
    trigger.set_defaults(func=cmd_trigger)
