"""The control socket's commands in the ``rehydrate`` CLI: ``notify``, ``status``, ``trigger``.

The client itself — the trust rules, :func:`request`, ``notify``'s exit codes — lives in
:mod:`rehydrate._notify`, which imports next to nothing so that ``rehydrate notify`` starts
fast inside a sandbox; this module is the argparse side: the sub-commands, their help, and
the usage errors of a command line the fast path did not take.
"""

from __future__ import annotations

import argparse
from typing import Any

from ._notify import (
    CRIU_ACTION,
    DEFAULT_TIMEOUT,
    EXIT_OK,
    EXIT_UNREACHABLE,
    GVISOR_MODE,
    NOTIFY_CMD,
    ControlError,
    Options,
    UntrustedSocket,
    as_list,
    call,
    dump,
    err,
    find_socket,
    ident,
    json_error,
    notify,
    one_line,
    positive,
    request,
    summary,
)
from ._socket_path import ENV_SOCKET, default_socket_dir

__all__ = ["ControlError", "UntrustedSocket", "add_commands", "find_socket", "notify_main",
           "request"]


def _call(cmd: str, args: argparse.Namespace, *, label: str | None = None,
          timeout: float | None = None, fields: dict[str, Any] | None = None,
          ) -> tuple[dict[str, Any] | None, int]:
    """:func:`rehydrate._notify.call` with the connection options of ``args``."""
    return call(cmd, label=label or cmd, socket_path=args.socket, timeout=timeout,
                as_json=getattr(args, "json", False), expect_uid=args.expect_uid,
                expect_pid=args.expect_pid, fields=fields)


def cmd_notify(args: argparse.Namespace) -> int:
    return notify(Options(args.action, socket=args.socket, timeout=args.timeout,
                          json=args.json, expect_uid=args.expect_uid,
                          expect_pid=args.expect_pid))


def cmd_status(args: argparse.Namespace) -> int:
    reply, code = _call("status", args, timeout=args.timeout)
    if reply is None or code != EXIT_OK:
        if reply is not None and args.json:  # machines read stdout: the refusal goes there
            dump(reply)
        return code
    status = reply.get("status") or {}
    if not isinstance(status, dict):
        problem = (f"the process answered a status of an unexpected shape "
                   f"({type(status).__name__}): another rehydrate version?")
        err(f"status: {problem}")
        if args.json:
            json_error(problem)
        return EXIT_UNREACHABLE
    if args.json:
        dump(status)
        return EXIT_OK
    # Each field one line (one_line): what the process answered is data, and a value
    # holding a newline or a terminal escape would otherwise forge the lines after it.
    lines = [f"pid:         {reply.get('pid')}",
             f"state:       {status.get('state')}",
             f"generation:  {status.get('generation')}",
             f"ready:       {status.get('ready')}",
             f"detectors:   {', '.join(map(str, as_list(status.get('detectors')))) or 'none'}",
             f"last_report: {summary(status.get('last_report'))}"]
    errors = status.get("detector_errors")
    lines += [f"NOT RUNNING: {name}: {why}"
              for name, why in sorted((errors if isinstance(errors, dict) else {}).items(),
                                      key=lambda item: str(item[0]))]
    for line in lines:
        print(one_line(line))
    return EXIT_OK


TRIGGER_MARGIN = DEFAULT_TIMEOUT
"""Seconds ``rehydrate trigger --timeout S`` waits for the reply beyond ``S`` (the
process's limit on gVisor's answer): the before-snapshot and the resume or restore hooks
run around that wait — as long as ``notify`` gives them by default."""


def cmd_trigger(args: argparse.Namespace) -> int:
    fields = {"timeout": args.timeout} if args.timeout is not None else None
    # The process bounds only the wait for gVisor's answer: this client bounds the whole
    # reply too, or a process that never answers (hung, or not rehydrate) holds it forever.
    limit = None if args.timeout is None else args.timeout + TRIGGER_MARGIN
    reply, code = _call("trigger", args, timeout=limit, fields=fields)
    if reply is not None and args.json:
        dump(reply)
    elif reply is not None and reply.get("answer"):
        print(one_line(str(reply["answer"])))
    return code


def _positive(text: str) -> float:
    try:
        return positive(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _id(text: str) -> int:
    try:
        return ident(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def notify_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``rehydrate-notify`` (the options of ``rehydrate notify``)."""
    parser = argparse.ArgumentParser(prog="rehydrate-notify", description=(
        "Tell the running process a snapshot is coming / it was resumed or restored."))
    _notify_arguments(parser)
    return parser


def notify_main(argv: list[str] | None = None) -> int:
    """``rehydrate-notify`` through argparse: what :func:`rehydrate.__main__.notify_main`
    (the program) falls back to for ``--help`` and command lines it does not take as they
    are; the same answers as ``rehydrate notify``."""
    return cmd_notify(notify_parser().parse_args(argv))


def _common(p: argparse.ArgumentParser, timeout: float | None, *,
            help: str | None = None) -> None:
    p.add_argument("--socket", metavar="PATH",
                   help=f"control socket (default: ${ENV_SOCKET}, else the only socket "
                        f"in {default_socket_dir()})")
    p.add_argument("--timeout", type=_positive, default=timeout, metavar="S",
                   help=help or ("seconds to wait for the reply" + (
                       f" (default {timeout:g})" if timeout else " (default: no limit)")))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--expect-uid", type=_id, metavar="UID",
                   help="talk only to a process of this uid (refuse any other, exit 4); "
                        "root notifying a workload of another uid should pin it")
    p.add_argument("--expect-pid", type=_id, metavar="PID",
                   help="talk only to this process (refuse any other, exit 4)")


def _notify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=sorted(NOTIFY_CMD),
                   help=f"default: ${GVISOR_MODE}, else ${CRIU_ACTION} (pre-dump -> "
                        "save, post-dump -> resume (not waited for), post-resume -> "
                        "restore, others: exit 0)")
    # default None: notify() tells "not given" (save follows the process's budget) apart
    _common(p, None, help=f"seconds to wait for the reply (default {DEFAULT_TIMEOUT:g}); save "
                     "without it waits longer when the process announces a longer budget "
                     "for its before-snapshot hooks")


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
    _common(trigger, None, help=(
        "seconds the process waits for gVisor's answer; this client waits for the reply "
        f"that plus {TRIGGER_MARGIN:g} s for the hooks (default: no limit)"))
    trigger.set_defaults(func=cmd_trigger)
