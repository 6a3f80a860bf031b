"""The core CLI: ``--version``, ``doctor`` (text and ``--json``), usage errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rehydrate
from rehydrate import _cli as cli


def run(*args, entry="module"):
    if entry == "script":
        exe = Path(sys.executable).with_name("rehydrate")
        if not exe.exists():
            found = shutil.which("rehydrate")
            if found is None:  # pragma: no cover - the dev install always has it
                pytest.fail("the `rehydrate` console script is not installed")
            exe = Path(found)
        cmd = [str(exe), *args]
    else:
        cmd = [sys.executable, "-m", "rehydrate", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("entry", ["module", "script"])
def test_version(entry):
    proc = run("--version", entry=entry)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"rehydrate {rehydrate.__version__}"
    assert proc.stderr == ""


def test_doctor_json_parses_and_lists_every_catalogued_detector():
    proc = run("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["version"] == rehydrate.__version__
    detectors = data["detectors"]
    assert isinstance(detectors, list)
    from rehydrate import detect

    assert [d["name"] for d in detectors] == detect.catalogue_keys()
    for d in detectors:
        assert {"name", "usable", "auto", "reason", "description"} <= set(d)
        assert isinstance(d["usable"], bool) and isinstance(d["auto"], bool)
        assert isinstance(d["reason"], str) and d["reason"]  # always says why (not)


def test_doctor_text_has_one_line_per_detector():
    proc = run("doctor")
    assert proc.returncode == 0, proc.stderr
    from rehydrate import detect

    lines = proc.stdout.splitlines()
    for name in detect.catalogue_keys():
        assert any(line.startswith(name) for line in lines), name


def test_doctor_in_process_matches(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == rehydrate.__version__


def test_no_command_prints_usage_and_exits_2(capsys):
    assert cli.main([]) == cli.EXIT_USAGE == 2
    assert "usage: rehydrate" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error():
    proc = run("frobnicate")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_doctor_text_has_column_headers_and_explains_the_start_column():
    proc = run("doctor")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["DETECTOR", "USABLE", "START", "WHY", "/", "HOW"]
    from rehydrate import detect

    count = len(detect.catalogue_keys())
    rows = {line.split()[0]: line.split()[1:3] for line in lines[1:count + 1]}
    assert set(rows) == set(detect.catalogue_keys())
    for usable, start in rows.values():  # no blank column: every row says something
        assert (usable, start) in (("yes", "auto"), ("yes", "on"), ("no", "-")), rows
    assert rows["signal"] == ["yes", "on"]  # "on request": usable, off unless named
    legend = [line for line in lines if line.startswith("START:")]
    assert legend and '"auto" = started by rehydrate.start()' in legend[0]
    assert '"on request"' in legend[0]


def _subparsers(parser):
    import argparse

    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_every_subcommand_help_has_a_description_and_names_its_defaults():
    import argparse

    for name, sub in _subparsers(cli.build_parser()).items():
        assert sub.description, f"rehydrate {name} --help has no one-line description"
        for action in sub._actions:
            if action.help in (None, argparse.SUPPRESS) or isinstance(
                    action, (argparse._HelpAction, argparse._StoreTrueAction)):
                continue
            if action.option_strings and action.default is not None:  # stated
                assert "default" in action.help.lower(), f"rehydrate {name} {action.dest}"
    proc = run("notify", "--help")
    assert "tell the running process a snapshot is coming" in proc.stdout
    assert "(default 120)" in proc.stdout


def test_a_failed_optional_hook_is_called_optional_in_the_summary():
    from rehydrate._notify import summary as _summary

    report = {"event": "restore", "kind": "restore", "reason": "control", "generation": 1,
              "ok": True, "duration": 0.01, "hooks": [
                  {"name": "warm-cache", "outcome": "failed", "required": False},
                  {"name": "db", "outcome": "ok", "required": True}]}
    text = _summary(report)
    assert text.endswith("optional hook(s) failed (not fatal): warm-cache"), text
    assert ", failed:" not in text
    report["ok"] = False
    report["hooks"].append({"name": "api", "outcome": "timeout", "required": True})
    assert ", failed: api, optional hook(s) failed (not fatal): warm-cache" in _summary(report)


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """``rehydrate doctor --json | head -1``: the pipe's reader is gone before the output
    is written — exit 141 (as SIGPIPE would), no traceback."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "rehydrate", "doctor", "--json"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=60, check=False)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


@pytest.mark.parametrize("option", ["--connections", "--files"])
def test_doctor_refuses_a_pid_that_is_not_one(option, capsys):
    for bad in ("abc", "-1", "0", "²"):  # "²".isdigit(), int("²") fails
        with pytest.raises(SystemExit) as exc:
            cli.main(["doctor", option, "--pid", bad])
        assert exc.value.code == 2
        assert "not a process ID" in capsys.readouterr().err
    assert cli.main(["doctor", option, "--pid", "999999999"]) == 1  # no such process
    err = capsys.readouterr().err
    assert err == f"rehydrate: doctor {option}: no process 999999999 here\n"


@pytest.fixture
def short_sock():
    import tempfile

    d = tempfile.mkdtemp(prefix="rh-cli-")  # AF_UNIX paths: pytest's tmp_path is too long
    yield os.path.join(d, "ctl.sock")
    shutil.rmtree(d, ignore_errors=True)


def _doctor_answered(answer: bytes, short_sock: str, capsys: pytest.CaptureFixture[str],
                     *commands: list[str]) -> tuple[list[int], str, str]:
    """Each doctor command line against a control socket that answers ``answer`` once per
    connection: their exit codes, then what they printed (out, err)."""
    from one_answer import OneAnswer

    server = OneAnswer(short_sock, answer)
    try:
        codes = [cli.main([*args, "--socket", short_sock]) for args in commands]
    finally:
        server.close()
    out, err = capsys.readouterr()
    return codes, out, err


@pytest.mark.parametrize("option", ["--connections", "--files"])
@pytest.mark.parametrize("pid", ['"self"', '"1/../../tmp"', "0", "true", "1.5", "[1]"])
def test_doctor_refuses_a_socket_pid_that_is_not_one(option, pid, short_sock, capsys):
    """The pid of the status reply was used as it came: "self" made doctor inspect the
    command itself, "1/../../tmp" a path under /proc, both reported as the process."""
    answer = b'{"ok": true, "pid": %s, "status": {}}\n' % pid.encode()
    [code], out, err = _doctor_answered(answer, short_sock, capsys, ["doctor", option])
    assert code == 1 and out == ""
    assert err.startswith(f"rehydrate: doctor {option}: no rehydrate process answers on the "
                          "control socket (its status reply names no process ID: pid ")
    assert err.count("\n") == 1


@pytest.mark.parametrize("option", ["--connections", "--files"])
@pytest.mark.parametrize("status", [
    '[1]', '"up"',
    '{"files": "garbage", "connections": 5}',
    '{"files": {"handles": [1, "x"], "volumes": 3}, "connections": [1, {"name": "db", '
    '"peers": 5}]}',
    '{"files": {"handles": [{"path": 7}], "volumes": [{"mount_point": null}]}, '
    '"connections": [{"name": "db", "peers": [5, "127.0.0.1:5432"]}]}',
    '{"connections": [{"name": "db", "sockets": 5}, {"name": "feed", "sockets": '
    '[1, {"inode": "x", "local": 7, "remote": null}, {"inode": true}]}]}',
])
def test_doctor_reads_a_status_of_another_shape_without_a_traceback(
        option, status, short_sock, capsys):
    """A status reply of another shape (another rehydrate version, garbage) ended doctor
    --files / --connections with a traceback ('str' object has no attribute 'get')."""
    answer = b'{"ok": true, "pid": %d, "status": %s}\n' % (os.getpid(), status.encode())
    [code], out, err = _doctor_answered(answer, short_sock, capsys, ["doctor", option])
    if status.startswith("{"):  # read as far as it goes: no managed handle is known
        assert code == 0 and err == "" and f"process {os.getpid()}" in out
    else:
        assert code == 1 and out == ""
        assert "its status reply is of an unexpected shape" in err and err.count("\n") == 1


FORGED = "no\x1b[2J\x1b]0;owned\x07\nrehydrate: forged line"
FORGED_SHOWN = "no\\x1b[2J\\x1b]0;owned\\x07\\nrehydrate: forged line"


@pytest.mark.parametrize("option", ["--connections", "--files"])
def test_doctor_escapes_the_control_sockets_error(option, short_sock, capsys):
    """The error a control socket answers goes out on one line, its terminal escapes and
    newline shown escaped."""
    answer = json.dumps({"ok": False, "error": FORGED}).encode() + b"\n"
    [code], out, err = _doctor_answered(answer, short_sock, capsys, ["doctor", option])
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "\x1b" not in err and "\x07" not in err
    assert f"control socket ({FORGED_SHOWN})" in err


def test_doctor_files_escapes_the_error_of_its_report(short_sock, monkeypatch, capsys):
    """``doctor --files``'s own error (listing the descriptors of the process behind the
    control socket failed) was printed as the exception said it: a newline there forged a
    second line, a terminal escape reached the terminal."""
    from rehydrate import files

    def failing(pid, **kwargs):
        raise OSError(FORGED)  # no errno: the message is the exception's text

    monkeypatch.setattr(files, "open_files", failing)
    answer = b'{"ok": true, "pid": %d, "status": {}}\n' % os.getpid()
    [code, json_code], out, err = _doctor_answered(
        answer, short_sock, capsys, ["doctor", "--files"], ["doctor", "--files", "--json"])
    assert code == json_code == 1
    line = (f"rehydrate: doctor --files: cannot list the descriptors of process "
            f"{os.getpid()}: {FORGED_SHOWN}\n")
    assert err == line * 2  # one line each, escaped
    assert json.loads(out)["error"].endswith(FORGED)  # JSON carries it as it is


@pytest.mark.parametrize("option", ["--connections", "--files"])
def test_doctor_waits_for_a_hung_socket_only_as_long_as_timeout(option, short_sock):
    """Before: doctor --files / --connections waited 10 s for a control socket that
    accepts and never answers, with no option to shorten it (even with --pid given)."""
    import socket
    import time

    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(short_sock)
    hung.listen(8)  # connections wait in the backlog: never accepted, never answered
    try:
        start = time.monotonic()
        with_pid = run("doctor", option, "--socket", short_sock, "--pid", "self",
                       "--timeout", "0.3", entry="script")
        without = run("doctor", option, "--socket", short_sock, "--timeout", "0.3",
                      entry="script")
        took = time.monotonic() - start
    finally:
        hung.close()
    assert with_pid.returncode == 0 and with_pid.stderr == "", with_pid
    assert with_pid.stdout.startswith("process self: "), with_pid.stdout
    assert without.returncode == 1 and without.stdout == ""
    assert without.stderr == (f"rehydrate: doctor {option}: no rehydrate process answers on "
                              f"the control socket (no reply from {short_sock} within 0.3s)"
                              "; name one with --pid PID (or --pid self)\n"), without.stderr
    assert took < 9, took  # two runs, each well under the 10 s default
    bad = run("doctor", option, "--timeout", "0", entry="script")
    assert bad.returncode == 2 and "--timeout" in bad.stderr, bad


SECRET_VALUE = "v4lue-that-doctor-must-never-show"


def _doctor(capsys, *args):
    assert cli.main(["doctor", *args]) == 0
    return capsys.readouterr().out


def test_doctor_shows_a_configured_environment_file_that_is_missing_or_malformed(
        tmp_path, monkeypatch, capsys):
    """Doctor said nothing, and the first restore came up degraded."""
    monkeypatch.delenv("REHYDRATE_ENV_POLICY", raising=False)
    missing = str(tmp_path / "absent.env")
    monkeypatch.setenv("REHYDRATE_ENV_FILE", missing)
    (line,) = [x for x in _doctor(capsys).splitlines() if x.startswith("environment file:")]
    assert "PROBLEM" in line and missing in line and "does not exist" in line
    assert "degraded" in line

    malformed = tmp_path / "app.env"
    malformed.write_text(f"API_KEY={SECRET_VALUE}\nJUST A LINE\n")
    monkeypatch.setenv("REHYDRATE_ENV_FILE", str(malformed))
    out = _doctor(capsys)
    (line,) = [x for x in out.splitlines() if x.startswith("environment file:")]
    assert "PROBLEM" in line and f"{malformed}: entry 2" in line
    assert SECRET_VALUE not in out
    found = json.loads(_doctor(capsys, "--json"))["environment"]
    assert found["problem"].startswith(f"{malformed}: entry 2") and found["fails_restore"]
    assert found["configured"] is True and found["present"] is True
    assert SECRET_VALUE not in json.dumps(found)

    malformed.write_text(f"API_KEY={SECRET_VALUE}\nOTHER=1\n")  # fixed: counted, no problem
    found = json.loads(_doctor(capsys, "--json"))["environment"]
    assert found["problem"] is None and found["entries"] == 2


def test_doctor_finds_no_problem_in_the_default_gvisor_file_missing(monkeypatch, capsys):
    monkeypatch.delenv("REHYDRATE_ENV_FILE", raising=False)
    monkeypatch.delenv("REHYDRATE_GVISOR_PROC", raising=False)
    monkeypatch.delenv("REHYDRATE_ENV_POLICY", raising=False)
    if os.path.exists("/proc/gvisor/spec_environ"):  # pragma: no cover - under gVisor
        pytest.fail("this test runs outside gVisor")
    found = json.loads(_doctor(capsys, "--json"))["environment"]
    assert found == {"path": "/proc/gvisor/spec_environ", "configured": False,
                     "policy": "update", "present": False, "entries": None,
                     "problem": None, "fails_restore": False}
    (line,) = [x for x in _doctor(capsys).splitlines() if x.startswith("environment file:")]
    assert "PROBLEM" not in line and "absent" in line


def test_doctor_names_a_gvisor_proc_directory_without_spec_environ(
        tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("REHYDRATE_ENV_FILE", raising=False)
    monkeypatch.delenv("REHYDRATE_ENV_POLICY", raising=False)
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(tmp_path))
    found = json.loads(_doctor(capsys, "--json"))["environment"]
    assert str(tmp_path / "spec_environ") in found["problem"]
    assert found["fails_restore"] is False  # a restore warns, it does not fail
    (tmp_path / "spec_environ").write_bytes(b"A=1\0B=2")  # cut short: refused
    found = json.loads(_doctor(capsys, "--json"))["environment"]
    assert "not NUL-terminated" in found["problem"] and found["fails_restore"]


@pytest.mark.parametrize("answer", ["error", "gpu name"])
def test_doctor_escapes_what_nvidia_smi_says(answer, tmp_path):
    """Before: the GPU line quoted nvidia-smi's error text (or a GPU's name) raw — colours,
    a carriage return or a cursor move reached the terminal; every other line is escaped."""
    standin = tmp_path / "nvidia-smi"
    if answer == "error":
        standin.write_text('#!/bin/sh\nprintf "bad\\033[31mRED\\033[0m\\r\\n" >&2; exit 9\n')
        env = {**os.environ}
    else:
        shutil.copy(Path(__file__).parent / "standin_bin" / "nvidia-smi", standin)
        env = {**os.environ, "STANDIN_NVIDIA_GPUS": json.dumps(
            [{"name": "NVIDIA L4\x1b[31m\x07", "driver_version": "535.104.05",
              "mig.mode.current": "[N/A]"}])}
    standin.chmod(0o755)
    env["PATH"] = f"{tmp_path}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    exe = Path(sys.executable).with_name("rehydrate")
    proc = subprocess.run([str(exe), "doctor"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout, repr(proc.stdout)
    gpu = [line for line in proc.stdout.splitlines() if line.startswith("  GPU ")]
    assert len(gpu) == 1 and "\\x1b[31m" in gpu[0], proc.stdout
