"""``rehydrate notify``'s fast path (rehydrate._notify): a real control socket, what it
imports, and the command lines it takes itself versus those argparse answers."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from one_answer import OneAnswer

from rehydrate import Lifecycle, Registry
from rehydrate import __main__ as entry
from rehydrate._control_client import notify_parser
from rehydrate._notify import Options, parse
from rehydrate._runner import ASYNC_GRACE, BACKOFF_BASE, worst_case
from rehydrate.detect.control import ControlDetector
from rehydrate.env import EnvRefresher

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]

# What a notifier must not import: each costs milliseconds inside a sandbox (see
# rehydrate/_notify.py), and the engine's modules would mean the whole package loads.
HEAVY = {"argparse", "json", "re", "socket", "typing", "dataclasses", "logging", "threading",
         "enum", "asyncio", "glob", "struct", "selectors", "inspect"}
LIGHT = {"rehydrate", "rehydrate.__main__", "rehydrate._version", "rehydrate._notify",
         "rehydrate._config", "rehydrate._socket_path"}


@pytest.fixture
def sock_path(rehydrate_environ: None) -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="rh-notify-")  # AF_UNIX paths: pytest's tmp_path is too long
    yield os.path.join(d, "ctl.sock")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def engine(sock_path: str) -> Iterator[Lifecycle]:
    eng = Lifecycle(Registry(), env=EnvRefresher(path=None))
    assert eng.start([ControlDetector(sock_path)]) == ["control"]
    yield eng
    eng.close()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE", "CRTOOLS_SCRIPT_ACTION",
                        "REHYDRATE_CONTROL_SOCKET", "PYTHONPROFILEIMPORTTIME")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _imported(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime ARGV…``: the process and every module it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], env=_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    modules = set()
    rest = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:"):
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                modules.add(name)
        else:
            rest.append(line)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout,
                                       "\n".join(rest)), modules


FORMS = {
    "python -m rehydrate notify": (["-m", "rehydrate", "notify"], ["-c", "import runpy"]),
    "rehydrate notify": ([str(BIN / "rehydrate"), "notify"], ["-c", "pass"]),
    "rehydrate-notify": ([str(BIN / "rehydrate-notify")], ["-c", "pass"]),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_the_notifier_runs_the_hooks_and_imports_only_light_modules(
        form: str, engine: Lifecycle, sock_path: str) -> None:
    argv, baseline = FORMS[form]
    if argv[0] != "-m":
        script = Path(argv[0])
        if not script.exists() or "rehydrate.__main__" not in script.read_text():
            pytest.fail(f"{script} is missing or from before the entry points moved to "
                        "rehydrate.__main__: pip install -e . (re)writes the scripts")
    ran = []
    engine.registry.after_restore(name="app")(lambda ctx: ran.append(ctx.reason))
    proc, modules = _imported([*argv, "restore", "--socket", sock_path])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("restore: ok (restore kind=restore reason=control "), proc
    assert ran == ["control"]

    _, before = _imported(baseline)  # what the interpreter (and runpy for -m) load anyway
    assert not (modules - before) & HEAVY, sorted((modules - before) & HEAVY)
    ours = {m for m in modules if m == "rehydrate" or m.startswith("rehydrate.")}
    assert ours <= LIGHT, sorted(ours - LIGHT)


@pytest.mark.parametrize("caller", ["save-restore-exec", "by hand"])
def test_a_save_says_whether_it_runs_inside_a_gvisor_checkpoint(
        caller: str, sock_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gVisor's save-restore-exec (``GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE=save``) sends
    ``"in_checkpoint": true``: its failure aborts a checkpoint whose ``error`` answer is
    then due. ``notify save`` by hand does not. Still only light modules either way."""
    from rehydrate.detect.control import ControlServer

    eng = Lifecycle(Registry(), env=EnvRefresher(path=None))
    seen: list[dict[str, object]] = []
    real = ControlServer._dispatch

    def record(self: ControlServer, cmd: str, req: dict[str, object],
               **kw: object) -> dict[str, object]:
        seen.append(dict(req))
        return real(self, cmd, req, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ControlServer, "_dispatch", record)
    try:
        assert eng.start([ControlDetector(sock_path)]) == ["control"]
        env = _env()
        if caller == "by hand":
            argv = [str(BIN / "rehydrate-notify"), "save", "--socket", sock_path]
        else:
            argv = [str(BIN / "rehydrate-notify"), "--socket", sock_path]
            env["GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE"] = "save"
        proc = subprocess.run([sys.executable, "-X", "importtime", *argv], env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
                   if line.startswith("import time:")}
        assert not modules & {"json", "re"}, sorted(modules & {"json", "re"})
    finally:
        eng.close()
    # "budget": the save waits as long as the process says its hooks may take
    expected = ({"cmd": "prepare-snapshot", "in_checkpoint": True, "budget": True}
                if caller == "save-restore-exec" else {"cmd": "prepare-snapshot",
                                                       "budget": True})
    assert seen == [expected]


def test_a_failing_check_of_the_imports_is_possible() -> None:
    """The check above can fail: the argparse CLI (any other command) loads what it bans."""
    proc, modules = _imported(["-m", "rehydrate", "doctor", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert {"argparse", "rehydrate._cli"} <= modules


def test_de_duplicated_flag_and_json_on_the_fast_path(engine: Lifecycle,
                                                      sock_path: str) -> None:
    def clock_jump_after_a_save() -> None:
        assert entry.main(["notify", "save", "--socket", sock_path]) == 0
        # the freeze began after the save: the clock jump's notice runs the hooks
        report = engine.restore_detected("clock-jump", since=time.monotonic())
        assert not report.deduplicated

    clock_jump_after_a_save()
    proc, _ = _imported(["-m", "rehydrate", "notify", "restore", "--socket", sock_path])
    assert proc.returncode == 0, proc.stderr
    assert "reason=clock-jump" in proc.stdout and "de-duplicated" in proc.stdout, proc.stdout

    clock_jump_after_a_save()
    proc, _ = _imported(["-m", "rehydrate", "notify", "--json", "restore",
                         f"--socket={sock_path}", "--timeout", "30"])
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    assert reply["deduplicated"] is True and reply["report"]["confirmed_by"] == ["control"]
    assert engine.generation == 2  # two restores, each ran once


def test_unreachable_and_untrusted_exit_codes_are_kept(sock_path: str,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    assert entry.main(["notify", "restore", "--socket", sock_path + ".none"]) == 3
    err = capsys.readouterr().err
    assert "cannot reach" in err and len(err.strip().splitlines()) == 1
    assert entry.notify_main(["restore", "--socket", sock_path + ".none", "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_a_server_of_another_pid_is_refused_before_anything_is_sent(
        engine: Lifecycle, sock_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    ran = []
    engine.registry.after_restore(name="app")(lambda: ran.append(1))
    code = entry.main(["notify", "restore", "--socket", sock_path,
                       "--expect-pid", str(os.getpid() + 1)])
    assert code == 4 and ran == []
    assert "not trusting" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--timeout", "0"], "timeout must be a number of seconds > 0 and at most 31536000"),
    (["--timeout", "inf"], "at most"),
    (["--timeout", "1e400"], "at most"),
    (["--timeout", "nan"], "must be a number of seconds > 0"),
    (["--timeout=soon"], "not a number"),
    (["bogus"], "invalid choice"),
    (["restore", "save"], "unrecognized arguments"),
    (["--expect-uid", "-1"], "must be >= 0"),
    (["--sock"], "expected one argument"),  # an abbreviation: argparse's call
])
def test_bad_command_lines_get_argparse_usage_errors(
        argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(argv) is None
    for run in (lambda: entry.main(["notify", *argv]), lambda: entry.notify_main(argv)):
        with pytest.raises(SystemExit) as exc:
            run()
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: rehydrate") and words in err, err


def test_help_is_argparse_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        entry.main(["notify", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rehydrate notify") and "--expect-uid" in out


# What CRIU puts in $CRTOOLS_SCRIPT_ACTION (criu/action-scripts.c, action_names[])
CRIU_ACTIONS = ["pre-dump", "post-dump", "pre-restore", "post-restore", "network-lock",
                "network-unlock", "setup-namespaces", "post-setup-namespaces", "post-resume",
                "pre-resume", "orphan-pts-master", "query-ext-files"]


def test_the_help_maps_each_criu_action_as_notify_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The help said "pre-dump -> save, post-resume -> restore, others: exit 0": it left
    out post-dump, which sends ``resume`` without waiting for the reply."""
    from rehydrate._notify import _resolve_action

    [action] = [a for a in notify_parser()._actions if a.dest == "action"]
    said = {m[1]: m[2] for m in re.finditer(r"([a-z-]+) -> (\w+(?: \(not waited for\))?)",
                                            action.help or "")}
    assert action.help and action.help.endswith(", others: exit 0)")
    monkeypatch.delenv("GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE", raising=False)
    done = {}
    for criu in CRIU_ACTIONS:
        monkeypatch.setenv("CRTOOLS_SCRIPT_ACTION", criu)
        notice, problem, wait, _ = _resolve_action(None)
        assert problem is None
        if notice is not None:
            done[criu] = notice + ("" if wait else " (not waited for)")
    assert said == done


TOKENS = ["save", "resume", "restore", "bogus", "--json", "--json=1", "--socket", "/s",
          "--socket=/t", "--timeout", "5", "--timeout=0.5", "0", "-1", "nan", "--expect-uid",
          "--expect-pid=7", "12", "--sock", "--", "-h", "=", ""]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=6))
def test_the_fast_parser_agrees_with_argparse(argv: list[str]) -> None:
    """Every command line the fast path takes, argparse reads the same way; one it does not
    take goes to argparse (which may still accept it, e.g. an abbreviation)."""
    fast = parse(argv)
    if fast is None:
        return
    slow = notify_parser().parse_args(argv)  # SystemExit (a failure) if it refuses them
    for field in Options.__slots__:
        assert getattr(fast, field) == getattr(slow, field), (argv, field)


def test_timeout_bounds_the_whole_reply_not_each_read(sock_path: str,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """Before: the socket timeout restarted at every chunk, so a server trickling one
    byte at a time (hung mid-reply) held ``notify --timeout 1`` — and a CRIU action
    script waiting on it — without any limit."""
    import socket
    import threading

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(1)
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            end = time.monotonic() + 15  # without the limit the client waits this long
            while not stop.wait(0.05) and time.monotonic() < end:  # never a newline
                try:
                    conn.sendall(b" ")
                except OSError:  # the client gave up: what this test wants
                    return

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    try:
        t0 = time.monotonic()
        code = entry.main(["notify", "restore", "--socket", sock_path, "--timeout", "1"])
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        server.join(10)
        srv.close()
    assert code == 3
    assert f"no reply from {sock_path} within 1s" in capsys.readouterr().err
    assert elapsed < 10, elapsed  # 1 s and the interpreter's own pace; before: for ever


def test_trigger_timeout_bounds_the_client_s_wait_too(sock_path: str,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Before: ``rehydrate trigger --timeout 1`` sent the limit to the process and then
    waited for ever itself: a process that never replied held it without any limit."""
    import socket
    import threading

    from rehydrate import _control_client

    monkeypatch.setattr(_control_client, "TRIGGER_MARGIN", 0.5, raising=False)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(1)
    stop = threading.Event()
    asked: list[bytes] = []

    def hang() -> None:
        conn, _ = srv.accept()
        with conn:
            asked.append(conn.recv(65536))
            stop.wait(15)  # without the limit the client waits this long, then fails

    server = threading.Thread(target=hang, daemon=True)
    server.start()
    try:
        code = entry.main(["trigger", "--socket", sock_path, "--timeout", "1"])
    finally:
        stop.set()
        server.join(10)
        srv.close()
    assert json.loads(asked[0]) == {"cmd": "trigger", "timeout": 1.0}
    assert code == 3
    assert f"no reply from {sock_path} within 1.5s" in capsys.readouterr().err


@pytest.mark.parametrize("notifier", [["-m", "rehydrate", "notify"],
                                      ["-c", "from rehydrate.__main__ import notify_main; "
                                             "raise SystemExit(notify_main())"],
                                      # an abbreviated option: the argparse CLI's path
                                      ["-m", "rehydrate", "notify", "--time", "30"],
                                      # the program itself on its argparse path
                                      [str(BIN / "rehydrate-notify"), "--time", "30"]],
                         ids=["fast", "rehydrate-notify", "argparse",
                              "rehydrate-notify-argparse"])
def test_stdout_that_cannot_be_written_does_not_change_the_notice_s_exit_status(
        notifier: list[str], engine: Lifecycle, sock_path: str) -> None:
    """Before: the fast path printed a traceback and exited 1 ("a required hook failed")
    when stdout was full, although the hooks had run; a reader gone (``| head``) too, and
    still in ``rehydrate-notify`` on its argparse path (``--time 30``); and a notifier
    started with fd 1 closed (``sys.stdout`` is None) must exit 0 as well."""
    ran: list[int] = []
    engine.registry.after_restore(name="app")(lambda: ran.append(1))
    argv = [sys.executable, *notifier, "restore", "--socket", sock_path, "--json"]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(argv, env=_env(), stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=60, check=False)
    assert ran == [1]
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "rehydrate: notify restore: the answer could not be written to stdout (No space "
        "left on device); exit status 0 is the notice's"]

    for extra in ([], ["--json"]):  # started with fd 1 closed: sys.stdout is None
        proc = subprocess.run(argv[:-1] + extra, env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=60, check=False,
                              preexec_fn=lambda: os.close(1))
        assert proc.returncode == 0 and proc.stderr == "", (extra, proc.stderr)
    assert ran == [1, 1, 1]

    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before the answer comes
    proc = subprocess.run(argv, env=_env(), stdout=writer, stderr=subprocess.PIPE, text=True,
                          timeout=60, check=False)
    os.close(writer)
    assert ran == [1, 1, 1, 1]
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["doctor"]])
def test_other_commands_whose_stdout_cannot_be_written_say_so_in_one_line(
        command: list[str], engine: Lifecycle, sock_path: str) -> None:
    """Before: stdout on a full disk gave an OSError traceback, and fd 1 closed an
    AttributeError traceback (``sys.stdout`` is None) with exit 1."""
    env = {**_env(), "REHYDRATE_CONTROL_SOCKET": sock_path}
    argv = [sys.executable, "-m", "rehydrate", *command]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(argv, env=env, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"rehydrate: {command[0]}: the output could not be written to stdout (No space "
        "left on device)"]
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=60, check=False, preexec_fn=lambda: os.close(1))
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.parametrize(("value", "shown"), [(10**400, "1e+400"), (-(10**400), "-1e+400"),
                                              (10**5000, "1e+5000"), (2**64, "1.84e+19")],
                         ids=["1e400", "-1e400", "1e5000", "2**64"])
def test_a_huge_timeout_is_shown_shortened(value: int, shown: str) -> None:
    """``timeout=10**400`` was echoed as a 401-digit number; from 4300 digits Python
    refused to print it at all and the error named neither the timeout nor the rule."""
    from rehydrate._notify import timeout_value
    from rehydrate._trigger import trigger_snapshot

    for refuse in (timeout_value, lambda v: trigger_snapshot(timeout=v)):
        with pytest.raises(ValueError) as info:
            refuse(value)
        message = str(info.value)
        assert message.startswith("timeout must be a number of seconds > 0 and at most")
        assert message.endswith(f", not {shown}") and len(message) < 120


@pytest.mark.parametrize("value", [-10**5000, -1, 0, float("nan"), "5"],
                         ids=["-1e5000", "-1", "0", "nan", "str"])
def test_request_refuses_a_bad_timeout_before_connecting(engine: Lifecycle, sock_path: str,
                                                         value: object) -> None:
    """``request(timeout=10**5000)`` raised a bare OverflowError (the deadline sum), -1 or
    0 a "no reply within -1s" after connecting, NaN waited for ever: one line, nothing
    sent (a server is listening and would have answered)."""
    from rehydrate._control_client import request

    with pytest.raises((TypeError, ValueError),
                       match=r"^request\(\): timeout must be a number of seconds > 0, .*"
                             r"\(None, infinity or more than a year: no limit\)$"):
        request("status", socket_path=sock_path, timeout=value)
    for no_limit in (None, float("inf"), 10**5000):  # 10**5000: a bare OverflowError before
        assert request("status", socket_path=sock_path, timeout=no_limit)["ok"] is True


def test_ordinary_timeouts_are_still_shown_exactly() -> None:
    from rehydrate._notify import timeout_value

    for value, shown in ((0, "0"), (-5, "-5"), (31_536_001, "31536001"), (1e300, "1e+300"),
                         (10**16 - 1, "9999999999999999")):
        with pytest.raises(ValueError, match=rf", not {re.escape(shown)}$"):
            timeout_value(value)


@pytest.mark.parametrize("answer", [b'{"ok": "false"}\n', b'{"ok": 1, "report": {}}\n',
                                    b'{"ok": null}\n', b'{"ok": [true]}\n'])
@pytest.mark.parametrize("command", [["notify", "save"], ["status"], ["trigger"]])
def test_a_reply_whose_ok_is_not_a_boolean_is_unexpected_not_a_success(
        sock_path: str, answer: bytes, command: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: any truthy "ok" was a success — `{"ok": "false"}` made `notify save` exit 0
    ("save: ok"), and the platform took the checkpoint without the hooks having run."""
    server = OneAnswer(sock_path, answer)
    try:
        code = entry.main([*command, "--socket", sock_path])
    finally:
        server.close()
    out, err = capsys.readouterr()
    assert code == 3, (out, err)
    assert err == f"rehydrate: {' '.join(command)}: unexpected reply from {sock_path}\n"
    assert "ok" not in out


@pytest.mark.parametrize("command", [["notify", "save"], ["status"], ["trigger"]])
def test_an_error_from_the_socket_is_printed_as_one_line(
        sock_path: str, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A server's error holding a newline or a terminal escape was printed raw: a second,
    forged "rehydrate:" line on stderr, or colours and cursor moves on the terminal."""
    answer = (b'{"ok": false, "error": "bad\\nrehydrate: notify save: ok\\u001b[2K"}\n')
    server = OneAnswer(sock_path, answer)
    try:
        code = entry.main([*command, "--socket", sock_path])
    finally:
        server.close()
    _, err = capsys.readouterr()
    assert code == 1
    assert err == f"rehydrate: {' '.join(command)}: bad\\nrehydrate: notify save: ok\\x1b[2K\n"


def test_status_text_shows_each_field_on_its_own_line(
        sock_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = {"state": "running\nready:       True", "generation": 3, "ready": False,
              "detectors": ["control\x1b[8m"], "last_report": None,
              "detector_errors": {"gvisor": "no /proc/gvisor\nNOT RUNNING: none"}}
    answer = json.dumps({"ok": True, "pid": 42, "status": status}).encode() + b"\n"
    server = OneAnswer(sock_path, answer)
    try:
        assert entry.main(["status", "--socket", sock_path]) == 0
    finally:
        server.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["pid:         42",
                     "state:       running\\nready:       True",
                     "generation:  3",
                     "ready:       False",
                     "detectors:   control\\x1b[8m",
                     "last_report: none",
                     "NOT RUNNING: gvisor: no /proc/gvisor\\nNOT RUNNING: none"]


@pytest.mark.parametrize("case", ["status of another shape", "notify without an action",
                                  "gVisor mode not an action", "CRIU without a socket"])
def test_json_failures_without_a_reply_still_print_json(case: str, sock_path: str) -> None:
    """Before: these left stdout empty under ``--json`` (no JSON at all for the machine
    reading it), while an unreachable process printed ``{"ok": false, "error": …}``."""
    env = _env()
    server = None
    if case == "status of another shape":
        server = OneAnswer(sock_path, b'{"ok": true, "pid": 5, "status": "x"}\n')
        argv, code = [str(BIN / "rehydrate"), "status", "--json", "--socket", sock_path], 3
        said = "the process answered a status of an unexpected shape (str)"
    elif case == "notify without an action":
        argv, code = [str(BIN / "rehydrate"), "notify", "--json"], 2
        said = "notify needs save, resume or restore"
    elif case == "gVisor mode not an action":
        env["GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE"] = "bogus-value"
        argv, code = [str(BIN / "rehydrate-notify"), "--json"], 2
        said = "GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE is not save, resume or restore"
    else:
        env["CRTOOLS_SCRIPT_ACTION"] = "pre-dump"
        argv, code = [str(BIN / "rehydrate-notify"), "--json"], 3
        said = "no control socket named"
    try:
        proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True,
                              text=True, timeout=60, check=False)
    finally:
        if server is not None:
            server.close()
    assert proc.returncode == code, proc
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["ok"] is False and answer["error"].startswith(said), answer
    assert answer["error"] in proc.stderr
    assert "bogus-value" not in proc.stdout + proc.stderr  # environment values never shown


def test_a_socket_path_that_is_a_fifo_or_a_device_is_named_as_such(sock_path: str) -> None:
    """Before: a FIFO (or a device) given as --socket read "… exists and is not a socket,
    not a socket"."""
    os.mkfifo(sock_path)
    for path, kind in ((sock_path, "a FIFO"), (os.devnull, "a character device")):
        proc = subprocess.run([sys.executable, str(BIN / "rehydrate-notify"), "save",
                               "--socket", path], env=_env(), capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 3, proc
        assert proc.stderr == (f"rehydrate: notify save: cannot reach the process at {path}: "
                               f"{path} exists and is {kind}, not a socket\n"), proc.stderr


def test_a_stale_socket_and_a_full_backlog_are_named_as_such(sock_path: str) -> None:
    """Before: "Connection refused" for the socket file a dead process left, and "Resource
    temporarily unavailable" once a backlog that stayed full had been waited out."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()
    proc = subprocess.run([sys.executable, str(BIN / "rehydrate-notify"), "save", "--socket",
                           sock_path], env=_env(), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 3, proc
    assert proc.stderr == (f"rehydrate: notify save: cannot reach the process at {sock_path}: "
                           "nobody listens there (connection refused): a socket file left "
                           "by a process that exited or stopped serving it\n"), proc.stderr
    os.unlink(sock_path)
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # listens, never accepts
    hung.bind(sock_path)
    hung.listen(0)
    queued = []
    try:
        while True:  # fill its backlog
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            queued.append(c)
            try:
                c.connect(sock_path)
            except BlockingIOError:
                break
        proc = subprocess.run([sys.executable, str(BIN / "rehydrate-notify"), "save",
                               "--socket", sock_path, "--timeout", "0.5"], env=_env(),
                              capture_output=True, text=True, timeout=60, check=False)
    finally:
        for c in queued:
            c.close()
        hung.close()
    assert proc.returncode == 3, proc
    assert proc.stderr == (f"rehydrate: notify save: cannot reach the process at {sock_path}: "
                           "the process accepted no connection in time (its listen backlog "
                           "stayed full): hung or overloaded\n"), proc.stderr


def _post_dump(sock: str, *argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``rehydrate-notify`` as CRIU runs it at ``post-dump`` (no argument, the action in
    the environment), with the modules it imported."""
    env = _env()
    env.update(CRTOOLS_SCRIPT_ACTION="post-dump", REHYDRATE_CONTROL_SOCKET=sock)
    proc = subprocess.run([sys.executable, "-X", "importtime", str(BIN / "rehydrate-notify"),
                           *argv], env=env, capture_output=True, text=True, timeout=30,
                          check=False)
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")}
    rest = "\n".join(line for line in proc.stderr.splitlines()
                     if not line.startswith("import time:"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, rest), modules


def test_post_dump_sends_resume_and_does_not_wait_for_the_reply(sock_path: str) -> None:
    """At CRIU's ``post-dump`` the tasks are frozen: the notifier queues a ``resume`` for
    the process (read when ``--leave-running`` lets it go on) and exits 0 at once. The
    stand-in here is such a process: it listens, never accepts while the notifier runs,
    and never replies. Before: post-dump exited without sending anything, and the
    original stayed ``snapshotting`` after a short ``--leave-running`` dump."""
    import socket

    frozen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    frozen.bind(sock_path)
    frozen.listen(8)
    try:
        proc, modules = _post_dump(sock_path)
        # The tasks "run again": the connection and the request were queued by the
        # kernel; the client is gone (end of input after the request line).
        frozen.settimeout(5)
        conn, _ = frozen.accept()
        with conn:
            conn.settimeout(5)
            got = b""
            while chunk := conn.recv(65536):
                got += chunk
    finally:
        frozen.close()
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc
    assert json.loads(got) == {"cmd": "resume"} and got.endswith(b"\n"), got
    _, before = _imported(["-c", "pass"])
    assert not (modules - before) & HEAVY, sorted((modules - before) & HEAVY)


@pytest.mark.parametrize("where", ["missing", "stale", "not a socket"])
def test_post_dump_exits_0_quietly_when_the_process_cannot_be_reached(
        where: str, sock_path: str) -> None:
    """A non-zero exit at post-dump makes CRIU fail the dump and leave the tasks running;
    CRIU logs the script's stderr. Nothing to resume there: exit 0, say nothing."""
    import socket

    if where == "stale":  # a socket file nobody listens on (ECONNREFUSED)
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(sock_path)
        stale.close()
    elif where == "not a socket":
        Path(sock_path).write_text("")
    t0 = time.monotonic()
    proc, _ = _post_dump(sock_path)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc
    assert time.monotonic() - t0 < 20


def test_post_dump_reaches_a_real_process_that_acts_on_it(engine: Lifecycle,
                                                          sock_path: str) -> None:
    """End to end with a running control server: the resume ends the pending pass."""
    import threading

    ran = []
    done = threading.Event()

    @engine.registry.after_restore(name="app")
    def app(ctx) -> None:  # type: ignore[no-untyped-def]
        ran.append((ctx.kind, ctx.reason))
        done.set()

    assert entry.main(["notify", "save", "--socket", sock_path]) == 0
    assert engine.status().state == "snapshotting"
    proc, _ = _post_dump(sock_path)
    assert proc.returncode == 0 and proc.stderr == "", proc
    assert done.wait(10)
    # the hook ran; the run ends (ready) a moment after it
    assert engine.wait_ready(10), engine.status().state
    assert ran == [("resume", "control")]
    assert engine.status().state == "ready"


# -- notify save follows the process's budget ---------------------------------------------


def test_save_waits_as_long_as_the_before_snapshot_hooks_may_take(
        engine: Lifecycle, sock_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``notify save`` gave up at its fixed default (120 s) while the hooks, each
    within its own limit (a drain of 25 s of 30, an engine's sleep of 97 s of 120), still
    ran: exit 3, the checkpoint aborted. Now the process announces its budget and the
    client waits for it. Scaled down: a default of 0.2 s, a hook of 0.6 s within its 5 s."""
    import rehydrate._notify as notify_mod

    monkeypatch.setattr(notify_mod, "DEFAULT_TIMEOUT", 0.2)
    done = threading.Event()

    @engine.registry.before_snapshot(name="slow-but-in-time", timeout=5)
    def slow() -> None:
        done.wait(0.6)  # past the client's default, well within the hook's own limit

    # The reply itself: the budget line first, then the usual one.
    reply = notify_mod.request("prepare-snapshot", socket_path=sock_path, timeout=0.2,
                               follow_budget=True)
    assert reply["ok"] is True and reply["report"]["ok"] is True
    engine.restore_detected("control", kind="resume")
    assert entry.main(["notify", "save", "--socket", sock_path]) == 0


def test_the_budget_line_comes_first_and_only_when_asked(engine: Lifecycle,
                                                         sock_path: str) -> None:
    import socket

    engine.registry.before_snapshot(name="a", timeout=7, retries=1)(lambda: None)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(sock_path)
        conn.sendall(b'{"cmd": "prepare-snapshot", "budget": true, "id": 5}\n')
        lines = conn.makefile("rb")
        first = json.loads(lines.readline())
        assert first["pending"] is True and first["id"] == 5 and "ok" not in first
        # every hook's limit: here two attempts of 7 s, each with the async grace, and
        # the backoff between them, beside the built-in hooks'
        # (and the restore hooks: a failed pass runs the resume hooks before it replies)
        assert first["budget"] == pytest.approx(
            worst_case(engine.hooks("snapshot")) + worst_case(engine.hooks("restore")))
        assert worst_case([h for h in engine.hooks("snapshot") if h.name == "a"]) == \
            pytest.approx(2 * (7 + ASYNC_GRACE) + BACKOFF_BASE)
        reply = json.loads(lines.readline())
        assert reply["ok"] is True and reply["id"] == 5
        conn.sendall(b'{"cmd": "resume"}\n{"cmd": "prepare-snapshot"}\n')  # not asked
        assert json.loads(lines.readline())["ok"] is True
        assert "report" in json.loads(lines.readline())
        conn.sendall(b'{"cmd": "prepare-snapshot", "budget": 1}\n')
        assert "budget" in json.loads(lines.readline())["error"]


def test_a_hook_without_a_limit_counts_the_old_default_in_the_budget(
        engine: Lifecycle, sock_path: str) -> None:
    """``rehydrate.connections`` bounds itself and has no hook limit: the budget was null
    for every process with a managed connection, and ``notify save`` kept its 120 s."""
    import socket

    from rehydrate import connections
    from rehydrate._runner import UNBOUNDED_ALLOWANCE

    connections.register("db", open=object, close=lambda v: None, engine=engine)
    engine.registry.before_snapshot(name="slow", timeout=100)(lambda: None)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(sock_path)
        conn.sendall(b'{"cmd": "prepare-snapshot", "budget": true}\n')
        first = json.loads(conn.makefile("rb").readline())
    assert isinstance(first["budget"], float)
    assert first["budget"] >= 100 + 2 * UNBOUNDED_ALLOWANCE  # its two hooks' allowance
    assert first["budget"] == pytest.approx(
        worst_case(engine.hooks("snapshot")) + worst_case(engine.hooks("restore")))


def test_save_against_a_process_that_announces_no_budget(
        sock_path: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An older process ignores ``"budget"`` and sends its reply: that is the reply."""
    served = OneAnswer(sock_path, b'{"ok": true, "report": {}}\n')
    try:
        assert entry.main(["notify", "save", "--socket", sock_path]) == 0
    finally:
        served.close()
    assert capsys.readouterr().out.startswith("save: ok")


def test_save_reads_the_reply_after_the_budget_line(sock_path: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget longer than the default moves the client's limit; the reply after it
    decides the exit status. Without --timeout only: an operator's limit stays his."""
    import socket

    import rehydrate._notify as notify_mod

    monkeypatch.setattr(notify_mod, "DEFAULT_TIMEOUT", 0.2)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(2)
    requests: list[bytes] = []

    def serve() -> None:
        for _ in range(2):
            conn, _ = srv.accept()
            with conn:
                requests.append(conn.recv(65536))
                conn.sendall(b'{"pending": true, "budget": 30}\n')
                time.sleep(0.6)  # past the default: only the budget keeps the client
                with contextlib.suppress(OSError):
                    conn.sendall(b'{"ok": true, "report": {}}\n')

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        assert entry.main(["notify", "save", "--socket", sock_path]) == 0
        assert entry.main(["notify", "save", "--socket", sock_path, "--timeout", "0.2"]) == 3
    finally:
        server.join(10)
        srv.close()
    assert b'"budget": true' in requests[0] and b"budget" not in requests[1]


# -- CRIU: the notices go to the tree being dumped, never to a guessed socket ------------


def _criu_notify(action: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``rehydrate-notify`` as CRIU runs it: no argument, the action in the environment."""
    full = _env()
    full.update(env, CRTOOLS_SCRIPT_ACTION=action)
    return subprocess.run([sys.executable, str(BIN / "rehydrate-notify"), "--timeout", "5"],
                          env=full, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("action", "code"), [("pre-dump", 3), ("post-resume", 3),
                                              ("post-dump", 0)])
def test_a_criu_action_never_picks_the_only_socket_in_the_default_directory(
        action: str, code: int, rehydrate_environ: None) -> None:
    """Without $REHYDRATE_CONTROL_SOCKET the only socket in the default directory may be
    any other rehydrate process's: dumping an unrelated process then ran that one's
    before-snapshot and resume hooks. Under CRIU the socket must be named: one line,
    nothing sent (pre-dump fails, aborting the dump; post-dump still exits 0)."""
    import socket

    xdg = tempfile.mkdtemp(prefix="rh-xdg-")
    try:
        os.mkdir(os.path.join(xdg, "rehydrate"), 0o700)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # another app's socket
        other.bind(os.path.join(xdg, "rehydrate", "4242.sock"))
        other.listen(8)
        other.setblocking(False)
        with other:
            proc = _criu_notify(action, {"XDG_RUNTIME_DIR": xdg})
            with pytest.raises(BlockingIOError):
                other.accept()  # no connection was queued: nothing sent to it
    finally:
        shutil.rmtree(xdg, ignore_errors=True)
    assert proc.returncode == code, proc
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "REHYDRATE_CONTROL_SOCKET" in proc.stderr


def test_a_criu_action_refuses_a_server_outside_the_dumped_tree(engine: Lifecycle,
                                                                sock_path: str) -> None:
    """CRIU names the root of the tree it dumps ($CRTOOLS_INIT_PID): a socket served by
    a process outside that tree (a wrong $REHYDRATE_CONTROL_SOCKET) is refused before
    anything is sent (exit 4); one served by that task or a descendant is used."""
    ran: list[str] = []
    engine.registry.before_snapshot(lambda: ran.append("snapshot"), name="app")
    outsider = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                stdin=subprocess.PIPE)
    try:
        proc = _criu_notify("pre-dump", {"REHYDRATE_CONTROL_SOCKET": sock_path,
                                         "CRTOOLS_INIT_PID": str(outsider.pid)})
    finally:
        outsider.communicate(timeout=30)
    assert proc.returncode == 4, proc
    assert "not in the process tree of pid" in proc.stderr and ran == []
    # The server's own pid, and an ancestor of it (a wrapper that started the app):
    for root in (os.getpid(), os.getppid()):
        proc = _criu_notify("pre-dump", {"REHYDRATE_CONTROL_SOCKET": sock_path,
                                         "CRTOOLS_INIT_PID": str(root)})
        assert proc.returncode == 0, proc
        engine.restore_detected("test", kind="resume", anchor=False, frozen_for=0.0)
    assert ran == ["snapshot", "snapshot"]


def test_the_summary_names_hooks_that_recovered_during_the_run() -> None:
    """A run ended ready because its failed hook recovered while it went on: "ok" next
    to ok=False and "failed: db" read as a contradiction without it."""
    from rehydrate._notify import summary

    line = summary({"event": "restore", "kind": "restore", "reason": "control",
                    "generation": 1, "ok": False, "duration": 0.01, "recovered": ["db"],
                    "hooks": [{"name": "db", "outcome": "failed", "required": True}]})
    assert line.endswith("failed: db, recovered during the run: db")


def _no_escape(call: Callable[[], int]) -> int:
    try:
        return call()
    except KeyboardInterrupt:  # pytest would end the whole session on it
        pytest.fail("KeyboardInterrupt escaped the entry point")


@pytest.fixture
def self_kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, object]]:
    """The entry point's SIGINT to itself, recorded instead of ending pytest."""
    import signal

    done: list[tuple[str, int, object]] = []
    monkeypatch.setattr(signal, "signal", lambda sig, how: done.append(("signal", sig, how)))
    monkeypatch.setattr(os, "kill", lambda pid, sig: done.append(("kill", sig, pid)))
    return done


def _killed_by_sigint(done: list[tuple[str, int, object]]) -> bool:
    import signal

    return done == [("signal", signal.SIGINT, signal.SIG_DFL),
                    ("kill", signal.SIGINT, os.getpid())]


@pytest.mark.parametrize("entry_point", ["main", "notify_main", "console_main",
                                         "notify_console_main"])
def test_ctrl_c_on_the_notifier_is_one_line_and_exit_130(
        entry_point: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], self_kills: list[tuple[str, int, object]]
) -> None:
    """Ctrl-C while the process was busy in its hooks printed a ~20-line
    KeyboardInterrupt traceback. After the line the program ends by SIGINT (130 only
    when the signal did not end it); main() and notify_main(), called from a program of
    its own, return 130 and leave the program alive."""
    import rehydrate._notify

    def interrupted(options: Options) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(rehydrate._notify, "notify", interrupted)
    args = ["save", "--socket", "/nonexistent/ctl.sock"]
    program = entry_point.endswith("console_main")
    if entry_point.startswith("notify"):
        monkeypatch.setattr(sys, "argv", ["rehydrate-notify", *args])
        call = {"notify_main": lambda: entry.notify_main(args),
                "notify_console_main": entry.notify_console_main}[entry_point]
    else:
        monkeypatch.setattr(sys, "argv", ["rehydrate", "notify", *args])
        call = {"main": lambda: entry.main(["notify", *args]),
                "console_main": entry.console_main}[entry_point]
    code = _no_escape(call)
    assert code == entry.EXIT_INTERRUPTED == 130
    assert capsys.readouterr() == ("", "rehydrate: interrupted\n")
    assert _killed_by_sigint(self_kills) if program else self_kills == []


@pytest.mark.parametrize("argv", [["status"], ["notify", "--help"], ["doctor"]])
def test_ctrl_c_on_the_other_commands_is_one_line_and_exit_130(
        argv: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], self_kills: list[tuple[str, int, object]]
) -> None:
    import rehydrate._cli

    def interrupted(args: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(rehydrate._cli, "run", interrupted)
    assert _no_escape(lambda: entry.main(argv)) == 130
    assert capsys.readouterr() == ("", "rehydrate: interrupted\n")
    assert self_kills == []
    monkeypatch.setattr(sys, "argv", ["rehydrate", *argv])
    assert _no_escape(entry.console_main) == 130
    assert capsys.readouterr() == ("", "rehydrate: interrupted\n")
    assert _killed_by_sigint(self_kills)


def _interrupted_while_waiting_for_the_reply(sock_path: str, args: list[str], *,
                                             group: bool = False) -> tuple[int, str, str]:
    """Runs ``args`` (a notifier of a process at ``sock_path`` that never answers) and
    sends it SIGINT once the whole request has arrived, so the notifier is waiting for the
    reply: the returncode, stdout and stderr. ``group``: in a session of its own, the
    signal sent to the whole group as a terminal's Ctrl-C is."""
    import signal

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(1)
    listener.settimeout(30)
    proc = subprocess.Popen(args, env=_env(), cwd=REPO, start_new_session=group,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def send(sig: int) -> None:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)

    try:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(30)
            got = b""
            while not got.endswith(b"\n"):  # the whole request: the notifier now waits
                chunk = conn.recv(4096)
                assert chunk, got
                got += chunk
            send(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
    finally:
        listener.close()
        if proc.poll() is None:
            send(signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def test_ctrl_c_in_main_called_by_a_program_returns_130_to_it(sock_path: str) -> None:
    """main() ended its caller by SIGINT on Ctrl-C: a program calling it on its main
    thread died with it. It returns 130 now; the console scripts (pyproject) and
    ``python -m rehydrate`` end by SIGINT (the shell-script test below)."""
    import re

    pyproject = (REPO / "pyproject.toml").read_text()  # no tomllib on 3.10
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)\n\n", pyproject, re.M | re.S)
    assert scripts is not None
    assert scripts[1].splitlines() == [
        'rehydrate = "rehydrate.__main__:console_main"',
        'rehydrate-notify = "rehydrate.__main__:notify_console_main"']
    host = ("from rehydrate.__main__ import main; "
            f"rc = main(['notify', 'save', '--socket', {sock_path!r}, '--timeout', '60']); "
            "print('host got', rc)")
    ended = _interrupted_while_waiting_for_the_reply(sock_path, [sys.executable, "-c", host])
    assert ended == (0, "host got 130\n", "rehydrate: interrupted\n")


def test_sigint_while_notify_waits_for_the_reply(sock_path: str) -> None:
    """A real SIGINT, sent once the request has reached a process that never answers."""
    import signal

    ended = _interrupted_while_waiting_for_the_reply(
        sock_path, [sys.executable, "-m", "rehydrate", "notify", "save", "--socket",
                    sock_path, "--timeout", "60"])
    # ended by the signal itself, as Python ends on an uncaught KeyboardInterrupt
    assert ended == (-signal.SIGINT, "", "rehydrate: interrupted\n")


def test_ctrl_c_stops_the_shell_script_that_ran_notify(sock_path: str) -> None:
    """Ctrl-C reaches the whole foreground group: the script and the notifier. A notifier
    that exits 130 normally tells bash it handled the signal itself, and the script
    went on to its next command; one ended by SIGINT makes bash stop too."""
    import signal

    script = (f'"{sys.executable}" -m rehydrate notify save --socket "{sock_path}" '
              '--timeout 60; echo "went-on $?"')
    returncode, out, err = _interrupted_while_waiting_for_the_reply(
        sock_path, ["bash", "-c", script], group=True)  # a terminal's Ctrl-C: the whole group
    assert "went-on" not in out
    assert (returncode, err) == (-signal.SIGINT, "rehydrate: interrupted\n")
