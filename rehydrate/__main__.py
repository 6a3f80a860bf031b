"""Entry points: ``rehydrate`` (also ``python -m rehydrate``) and ``rehydrate-notify``
(the programs: :func:`console_main`, :func:`notify_console_main`; to call from Python:
:func:`main`, :func:`notify_main`).

``notify`` runs inside the sandbox at every checkpoint and restore, where each imported
module costs a millisecond or more: a well-formed ``notify`` command line goes straight to
the light client (:mod:`rehydrate._notify`, no argparse). Everything else — the other
commands, ``--help``, a command line to explain — goes to the argparse CLI.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing itself is not imported: see rehydrate/_notify.py
if TYPE_CHECKING:
    from collections.abc import Callable

EXIT_READER_GONE = 141
"""``rehydrate status --json | head``: the reader closed the pipe. Like a shell tool
killed by SIGPIPE (128 + 13), without a traceback."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (``SIGINT``) while a command waits (a process busy in its hooks): one line
(``rehydrate: interrupted``) instead of a traceback, and :func:`main` returns this. The
programs (:func:`console_main`) then end *by* ``SIGINT`` instead (what Python does for an
uncaught ``KeyboardInterrupt``), which a shell reports as 130 (128 + 2)."""


def main(argv: list[str] | None = None) -> int:
    """``rehydrate COMMAND …``, from Python: the exit status is returned, 130 on Ctrl-C
    (the calling program goes on)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return _interrupted()


def console_main() -> int:
    """The ``rehydrate`` program (``python -m rehydrate`` too): :func:`main`, except that
    Ctrl-C ends the process by ``SIGINT``."""
    return _as_program(_main)


def _main(argv: list[str] | None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["notify"]:
        code = _fast_notify(args[1:])
        if code is not None:
            return code
    from ._cli import run

    try:
        return run(args)  # flushes stdout: a reader gone shows here, not at exit
    except BrokenPipeError:
        return _reader_gone()


def _as_program(run: Callable[[list[str] | None], int]) -> int:
    try:
        return run(None)
    except KeyboardInterrupt:
        _interrupted()
    import os
    import signal

    # A plain exit 130 tells a calling shell script that this program handled the Ctrl-C
    # itself: bash then runs the script's next command (`rehydrate notify save; echo
    # went-on` went on). Dying of the signal makes the script stop as well. Only here, in
    # the program: a program calling main() itself was killed by it.
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except (OSError, ValueError):  # not the main thread (run by something else)
        pass
    return EXIT_INTERRUPTED


def _interrupted() -> int:
    # Nothing is flushed at exit after a program's SIGINT: what is written goes out now.
    for stream, line in ((sys.stdout, ""), (sys.stderr, "rehydrate: interrupted\n")):
        try:
            stream.write(line)
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or None: the status says it
            pass
    return EXIT_INTERRUPTED


def _reader_gone() -> int:
    import os

    # The interpreter flushes stdout once more at exit: point it at /dev/null first.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_READER_GONE


def notify_main(argv: list[str] | None = None) -> int:
    """``rehydrate-notify [save|resume|restore] [options]``: ``rehydrate notify`` as a
    program of its own, for platforms that take one executable path and no arguments (a
    CRIU ``--action-script``, a save-restore-exec argv you would rather not split). From
    Python, like :func:`main`: 130 returned on Ctrl-C."""
    try:
        return _notify_main(argv)
    except KeyboardInterrupt:
        return _interrupted()


def notify_console_main() -> int:
    """The ``rehydrate-notify`` program: :func:`notify_main`, except that Ctrl-C ends the
    process by ``SIGINT``."""
    return _as_program(_notify_main)


def _notify_main(argv: list[str] | None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    code = _fast_notify(args)
    if code is not None:
        return code
    from ._control_client import notify_main as explained

    try:
        return explained(args)  # ``rehydrate-notify resume --js | head``: argparse's path
    except BrokenPipeError:
        return _reader_gone()


def _fast_notify(argv: list[str]) -> int | None:
    from ._notify import notify, parse

    options = parse(argv)
    if options is None:
        return None
    try:
        return notify(options)
    except BrokenPipeError:  # ``notify … --json | head -1``
        return _reader_gone()


if __name__ == "__main__":
    raise SystemExit(console_main())
