"""The ``rehydrate`` command (also ``python -m rehydrate``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ._version import __version__

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def _print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import detect

    if getattr(args, "connections", False):
        from .connections import doctor_report

        data, text = doctor_report(args.pid)
        if args.json:
            _print_json(data)
        else:
            print(text)
        return EXIT_OK

    if getattr(args, "files", False):
        from .files import doctor_report as files_report

        data, text = files_report(args.pid, proc=args.proc)
        if args.json:
            _print_json(data)
        else:
            print(text)
        return EXIT_OK

    infos = detect.available()
    if args.json:
        _print_json({"version": __version__, "detectors": [i.to_dict() for i in infos]})
        return EXIT_OK
    if not infos:
        print("no detectors are known")
        return EXIT_OK
    width = max(len(i.name) for i in infos)
    for i in infos:
        mark = "yes" if i.usable else "no "
        auto = "auto" if (i.usable and i.auto) else "    "
        how = f" — {i.description}" if i.usable and i.description else ""
        print(f"{i.name.ljust(width)}  {mark}  {auto}  {i.reason}{how}")
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    from .fingerprint import main_check

    return main_check(args.manifest, as_json=args.json, root=args.root)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rehydrate",
        description="Inspect and drive snapshot/restore handling of rehydrate-enabled processes.",
    )
    parser.add_argument("--version", action="version", version=f"rehydrate {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = sub.add_parser("doctor", help="which detectors work here, and why not the others")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--connections", action="store_true",
                        help="list the established TCP connections of a process (what to "
                             "register with rehydrate.connections before a snapshot)")
    doctor.add_argument("--files", action="store_true",
                        help="list a process's descriptors on volumes the snapshot does not "
                             "hold (restored by path with no change check; a deleted one "
                             "makes a gVisor checkpoint fail)")
    doctor.add_argument("--pid", default="self",
                        help="process to inspect with --connections or --files (default: "
                             "this one)")
    doctor.add_argument("--proc", default="/proc", help=argparse.SUPPRESS)  # tests: fake /proc
    doctor.set_defaults(func=cmd_doctor)

    check = sub.add_parser(
        "check", help="is this node compatible with a snapshot manifest? (0 yes, 1 no, "
                      "2 unreadable manifest)")
    check.add_argument("manifest", help="manifest file written by rehydrate before a snapshot")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument("--root", default="/", help=argparse.SUPPRESS)  # tests: fake /proc
    check.set_defaults(func=cmd_check)

    from .control_client import add_commands  # notify, status, trigger (control socket)

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
