"""The ``rehydrate`` command (also ``python -m rehydrate``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TextIO

from . import _config
from ._version import __version__

if TYPE_CHECKING:
    from . import detect
    from ._nodefit import Fit

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

DOCTOR_TIMEOUT = 10.0
"""``doctor --connections`` / ``--files``: seconds to wait for the control socket's
status reply (``--timeout``), as ``rehydrate status`` does by default."""


def _print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


__all__ = ["OutputFailed", "build_parser", "check_manifest", "main", "run"]


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import detect

    if getattr(args, "connections", False):
        return _doctor_connections(args)

    if getattr(args, "files", False):
        return _doctor_files(args)

    from ._nodefit import assess, facts

    infos = detect.available()
    fit = assess(facts())
    settings = _config.effective()
    from .env import check_file

    environment = check_file()
    if args.json:
        _print_json({"version": __version__, "detectors": [i.to_dict() for i in infos],
                     "platform": fit.to_dict(), "environment": environment,
                     "configuration": settings})
        return EXIT_OK
    print(detectors_table(infos) if infos else "no detectors are known")
    _print_fit(fit)
    _print_environment(environment)
    _print_settings(settings)
    return EXIT_OK


def _print_environment(found: dict[str, Any]) -> None:
    """The environment file a restore would apply, and the problem that would fail its
    ``rehydrate.env`` hook (a configured file missing, a malformed one): before, doctor
    said nothing and the first restore came up degraded."""
    path = found["path"]
    if found["policy"] == "off":
        line = f"{path}: not applied (REHYDRATE_ENV_POLICY=off)"
    elif found["problem"]:
        line = f"PROBLEM: {found['problem']} " + (
            "(a restore's rehydrate.env hook would fail and leave the process degraded)"
            if found["fails_restore"] else "(a restore would keep the environment as it is)")
    elif found["present"]:
        line = f"{path}: {found['entries']} entries, applied at each restore"
    else:
        line = f"{path}: absent (not on gVisor): no refresh from a file"
    print()
    print(_config.one_line(f"environment file: {line}"))


def _doctor_connections(args: argparse.Namespace) -> int:
    """``doctor --connections``: by default the process behind the control socket (the
    one a platform would notify), with its managed connections marked."""
    from .connections import doctor_report

    def managed(status: dict[str, Any]) -> list[dict[str, Any]]:
        # The reply is data: entries of another shape are left out, not a traceback.
        # "sockets": a list (those the connection holds, maybe none) or not known.
        return [{**m, "peers": [p for p in _list(m.get("peers")) if isinstance(p, str)],
                 "sockets": ([s for s in m["sockets"] if isinstance(s, dict)]
                             if isinstance(m.get("sockets"), list) else None)}
                for m in _list(status.get("connections")) if isinstance(m, dict)]

    return _doctor_process(args, "--connections", lambda pid, status: doctor_report(
        pid, None if status is None else managed(status)))


def _doctor_files(args: argparse.Namespace) -> int:
    """``doctor --files``: by default the process behind the control socket, with the
    descriptors its ``rehydrate.files`` handles own marked managed."""
    from .files import doctor_report

    def handles(status: dict[str, Any]) -> dict[str, Any] | None:
        files = status.get("files")
        if not isinstance(files, dict):
            return None  # not known: nothing is marked managed
        return {k: [e for e in _list(files.get(k)) if isinstance(e, dict)]
                for k in ("handles", "volumes")}

    return _doctor_process(args, "--files", lambda pid, status: doctor_report(
        pid, proc=args.proc, status=None if status is None else handles(status)))


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _pid_arg(text: str) -> str:
    """``--pid``: ``self`` or a process ID (a whole number > 0)."""
    if text == "self" or (text.isascii() and text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"not a process ID (a number > 0) or 'self': {text!r}")


def _doctor_process(
    args: argparse.Namespace, option: str,
    report: Callable[[str, dict[str, Any] | None], tuple[dict[str, Any], str]],
) -> int:
    """Run ``report(pid, status)`` for ``--pid`` or, by default, the process answering on
    the control socket; ``status`` is that process's ``status()`` when ``pid`` is it."""
    from ._control_client import ControlError, request
    from ._notify import err

    reply: dict[str, Any] | None = None
    problem: str | None = None
    try:
        reply = request("status", socket_path=args.socket, timeout=args.timeout)
    except ControlError as exc:
        problem = str(exc)
    else:
        if not reply.get("ok"):
            problem = str(reply.get("error") or "status failed")
    server_pid = reply.get("pid") if reply is not None and problem is None else None
    if server_pid is not None and (type(server_pid) is not int or server_pid <= 0):
        # "self" made the command inspect itself, "1/../../x" a path under /proc.
        problem = f"its status reply names no process ID: pid {_config.shown(server_pid)}"
        server_pid = None
    status_shape = reply.get("status") if reply is not None and problem is None else None
    if server_pid is not None and not isinstance(status_shape, (dict, type(None))):
        problem = (f"its status reply is of an unexpected shape "
                   f"({type(status_shape).__name__}): another rehydrate version?")
        server_pid = None
    pid = args.pid
    if pid is None:
        if server_pid is None:
            message = (f"doctor {option}: no rehydrate process answers on the control "
                       f"socket ({problem}); name one with --pid PID (or --pid self)")
            err(message)  # one line: problem may be the process's own error text
            if args.json:
                _print_json({"ok": False, "error": message})
            return EXIT_FAILED
        pid = str(server_pid)
    if pid != "self" and not os.path.isdir(os.path.join(args.proc, str(pid))):
        message = f"doctor {option}: no process {pid} here"
        print(f"rehydrate: {message}", file=sys.stderr)
        if args.json:
            _print_json({"ok": False, "error": message})
        return EXIT_FAILED
    status = None
    if server_pid is not None and str(pid) == str(server_pid) and reply is not None:
        status = reply.get("status") or {}
    data, text = report(str(pid), status)
    if data.get("error"):
        # escaped as every other doctor line: the error quotes an exception's text
        err(f"doctor {option}: {data['error']}")
        if args.json:
            _print_json(data)
        return EXIT_FAILED
    if args.json:
        _print_json(data)
    else:
        print(text)
    return EXIT_OK


def detectors_table(infos: Sequence[detect.DetectorInfo]) -> str:
    """``rehydrate doctor``'s text: one row per detector under column headers, and what
    the START column means."""
    rows = [("DETECTOR", "USABLE", "START", "WHY / HOW")]
    for i in infos:
        start = "-" if not i.usable else "auto" if i.auto else "on request"
        how = f" — {i.description}" if i.usable and i.description else ""
        rows.append((i.name, "yes" if i.usable else "no", start, i.reason + how))
    widths = [max(len(r[k]) for r in rows) for k in range(3)]
    lines = ["  ".join(r[k].ljust(widths[k]) for k in range(3)) + "  " + r[3] for r in rows]
    lines.append("")
    lines.append('START: "auto" = started by rehydrate.start() (detectors="auto"); "on request" '
                 '= usable, but started only when named, e.g. start(["signal"]); "-" = not '
                 "usable here")
    return "\n".join(lines)


def _print_fit(fit: Fit) -> None:
    print(f"\nGKE Pod snapshots on this node: {fit.fit}")
    width = max(len(c.name) for c in fit.checks)
    for c in fit.checks:
        # A reason may quote nvidia-smi (its error text, a GPU's name) or the metadata
        # server: escaped, so that a terminal escape or a newline there cannot forge lines.
        print(_config.one_line(f"  {c.name.ljust(width)}  {c.status:<7}  {c.reason}"))


def _print_settings(settings: list[dict[str, object]]) -> None:
    """The variables set in the environment with their effective values (a bad value shows
    the default it fell back to, after the warning line); the rest only counted."""
    chosen = [s for s in settings if s["source"] == "environment"]
    print()
    print(f"configuration: {len(chosen)} REHYDRATE_* variable(s) set, "
          f"{len(settings) - len(chosen)} at their defaults (docs/configuration.md)")
    from ._notify import one_line

    width = max((len(str(s["name"])) for s in chosen), default=0)
    for s in chosen:
        word = "warning:" if _config.entries_kept(str(s["name"])) else "ignored"
        bad = f"  ({word} {s['problem']})" if s["problem"] else ""
        # The library's own settings (paths, numbers, names: none holds a secret), shown;
        # escaped, so that a newline or a terminal escape in one cannot forge lines.
        print(one_line(f"  {str(s['name']).ljust(width)}  {s['value']}{bad}"))


def cmd_check(args: argparse.Namespace) -> int:
    if args.labels:
        if args.manifest or args.affinity or args.node or args.env_from:
            print("rehydrate check: --labels describes this node; it takes no manifest "
                  "or other option", file=sys.stderr)
            return EXIT_USAGE
        return print_node_labels(as_json=args.json, root=args.root)
    if not args.manifest:
        print("rehydrate check: a MANIFEST is needed (or --labels)", file=sys.stderr)
        return EXIT_USAGE
    return check_manifest(args.manifest, as_json=args.json, root=args.root,
                          scope="node" if args.node else "all", env_file=args.env_from,
                          affinity=args.affinity)


def check_manifest(path: str, *, as_json: bool = False, root: str = "/",
                   scope: Literal["all", "node"] = "all", env_file: str | None = None,
                   affinity: bool = False) -> int:
    """``rehydrate check MANIFEST``: 0 compatible, 1 mismatches (listed), 2 unreadable or
    invalid manifest (one line on stderr, or ``{"compatible": false, "scope": …, "error": …,
    "mismatches": []}`` with ``as_json``: the same keys as the other answers).

    ``scope="node"`` compares only what a node-level checker shares with the workload
    (and the ``env.*`` keys when ``env_file`` is given); ``env_file`` supplies the
    workload's environment for ``env.*``; ``affinity`` prints
    the ``nodeAffinity`` for Pods restoring this manifest (YAML) instead of checking.
    """
    from . import fingerprint

    try:
        manifest = fingerprint.load_manifest(path)
        if affinity:
            from ._nodefit import node_affinity, render

            sys.stdout.write(render({"affinity": node_affinity(manifest)}, as_json=as_json))
            return 0
        environ = fingerprint._read_workload_env(env_file) if env_file else None
        mismatches = fingerprint.check(manifest, root, scope=scope, environ=environ)
    except (TypeError, ValueError) as exc:  # ManifestError is a ValueError
        doing = "make a nodeAffinity for" if affinity else "compare"
        msg = str(exc) if isinstance(exc, fingerprint.ManifestError) else (
            f"cannot {doing} manifest {path}: {type(exc).__name__}: {exc}")
        if as_json:
            json.dump({"compatible": False, "scope": scope, "error": " ".join(msg.split()),
                       "mismatches": []}, sys.stdout)
            sys.stdout.write("\n")
        else:
            # The manifest's path and the exception's text (a name in a directory listing,
            # a message quoting the file) may hold a newline or a terminal escape: escaped,
            # so that they cannot forge lines or drive the terminal.
            print(f"rehydrate check: {_config.one_line(msg)}", file=sys.stderr)
        return 2
    what = ("" if scope != "node" else " (node-level fields and env.* keys)" if env_file
            else " (node-level fields)")
    if as_json:
        json.dump({"compatible": not mismatches, "scope": scope,
                   "mismatches": [m.to_dict() for m in mismatches]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif mismatches:
        print(_config.one_line(f"incompatible: {len(mismatches)} mismatch(es) with {path}{what}"))
        for m in mismatches:
            print(f"  {m.describe()}")
    else:
        print(_config.one_line(f"compatible with {path}{what}"))
    return 1 if mismatches else 0


def print_node_labels(*, as_json: bool = False, root: str = "/") -> int:
    """``rehydrate check --labels``: this node's scheduling labels as a Node patch (YAML)."""
    from . import fingerprint
    from ._nodefit import node_labels, render

    patch = {"metadata": {"labels": node_labels(fingerprint.fingerprint(root=root))}}
    sys.stdout.write(render(patch, as_json=as_json))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rehydrate",
        description="Inspect and drive snapshot/restore handling of rehydrate-enabled processes.",
    )
    parser.add_argument("--version", action="version", version=f"rehydrate {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=summary)

    doctor = add("doctor", "whether Pod snapshots can work on this node, which detectors "
                           "work here and why not the others; with "
                           "--connections / --files, what a snapshot would cut or reopen")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--connections", action="store_true",
                        help="list the established TCP connections of a process (what to "
                             "register with rehydrate.connections before a snapshot)")
    doctor.add_argument("--files", action="store_true",
                        help="list a process's descriptors on volumes the snapshot does not "
                             "hold (restored by path with no change check; a deleted one "
                             "makes a gVisor checkpoint fail)")
    doctor.add_argument("--pid", default=None, type=_pid_arg,
                        help="process to inspect with --connections / --files (\"self\": "
                             "this command; default: the process behind the control "
                             "socket)")
    doctor.add_argument("--socket", metavar="PATH",
                        help="control socket of the process --connections / --files "
                             "inspects "
                             "(default: $REHYDRATE_CONTROL_SOCKET, else the only socket in "
                             "the default directory)")
    from ._control_client import _positive

    doctor.add_argument("--timeout", type=_positive, default=DOCTOR_TIMEOUT, metavar="S",
                        help="seconds --connections / --files waits for the status reply "
                             "on the control socket (default "
                             f"{DOCTOR_TIMEOUT:g}); with --pid, a socket that does not "
                             "answer in time only leaves nothing marked managed")
    doctor.add_argument("--proc", default="/proc", help=argparse.SUPPRESS)  # tests: fake /proc
    doctor.set_defaults(func=cmd_doctor)

    check = add("check", "is this node compatible with a snapshot manifest? (exit 0 yes, "
                         "1 no, 2 unreadable manifest); --labels / --affinity print the "
                         "Kubernetes node labels and nodeAffinity for scheduling restores")
    check.add_argument("manifest", nargs="?",
                       help="manifest file written by rehydrate before a snapshot")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument("--node", action="store_true",
                       help="compare only node-level fields (CPU, kernel, gVisor, GPU "
                            "driver, machine series; with --env-from the env.* keys too): "
                            "for a checker that is not the workload, e.g. a DaemonSet")
    check.add_argument("--env-from", metavar="FILE",
                       help="the workload's environment (KEY=VALUE per line or "
                            "NUL-separated, like /proc/PID/environ) for the env.* keys "
                            "(default: this process's environment)")
    check.add_argument("--labels", action="store_true",
                       help="print this node's scheduling labels as a Node patch (YAML) "
                            "for a DaemonSet to apply")
    check.add_argument("--affinity", action="store_true",
                       help="print the nodeAffinity (YAML) a Pod restoring MANIFEST "
                            "should carry to land only on matching labelled nodes")
    check.add_argument("--root", default="/", help=argparse.SUPPRESS)  # tests: fake /proc
    check.set_defaults(func=cmd_check)

    from ._control_client import add_commands  # notify, status, trigger (control socket)

    add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return EXIT_USAGE
    result: int = args.func(args)
    return result


class OutputFailed(OSError):
    """Writing a command's output to stdout failed (a full disk, an I/O error)."""


class _Output:
    """``sys.stdout`` while :func:`run` runs a command: a failed write or flush raises
    :class:`OutputFailed`, told apart from the command's own ``OSError``; a reader gone
    stays :class:`BrokenPipeError` (the entry point's exit 141)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(exc.errno, exc.strerror) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(exc.errno, exc.strerror) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def run(argv: Sequence[str]) -> int:
    """:func:`main` as the ``rehydrate`` program runs it: its output flushed before it
    returns (a reader gone raises :class:`BrokenPipeError` here, not at exit), and an
    output that cannot be written (stdout on a full disk) one line on stderr instead of a
    traceback. ``notify`` keeps its exit status (the notice's: 1 would tell the platform
    to abort the checkpoint); any other command exits 1 (it did not deliver what it was
    run for). Started with fd 1 closed (``sys.stdout`` is None), the output goes nowhere.
    """
    real = sys.stdout
    stream = real if real is not None else open(os.devnull, "w")  # noqa: SIM115
    sys.stdout = _Output(stream)
    code: int | None = None
    try:
        code = main(argv)
        sys.stdout.flush()
    except OutputFailed as exc:
        if code is None or (code == EXIT_OK and argv[:1] != ["notify"]):
            code = EXIT_FAILED
        from ._notify import err

        err(f"{argv[0] if argv else 'rehydrate'}: the output could not be written to "
            f"stdout ({exc.strerror or exc})")
        if real is not None:  # the interpreter flushes what is buffered once more at exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, real.fileno())
            os.close(devnull)
    finally:
        sys.stdout = real
        if real is None:
            stream.close()
    return code
