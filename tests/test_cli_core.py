"""The core CLI: ``--version``, ``doctor`` (text and ``--json``), usage errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rehydrate
from rehydrate import cli


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

    assert [d["name"] for d in detectors] == list(detect.CATALOGUE)
    for d in detectors:
        assert {"name", "usable", "auto", "reason", "description"} <= set(d)
        assert isinstance(d["usable"], bool) and isinstance(d["auto"], bool)
        assert isinstance(d["reason"], str) and d["reason"]  # always says why (not)


def test_doctor_text_has_one_line_per_detector():
    proc = run("doctor")
    assert proc.returncode == 0, proc.stderr
    from rehydrate import detect

    lines = proc.stdout.splitlines()
    for name in detect.CATALOGUE:
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
