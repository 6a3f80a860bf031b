"""The Makefile's own setup steps (what `make test` and `make demo` do first on a fresh
machine), run in a copy of the Makefile in a temporary directory."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_make_recreates_a_virtualenv_left_without_pip(tmp_path):
    """Debian's ``python3 -m venv`` without python3-venv fails but leaves ``.venv/bin/python``
    behind; the Makefile used to take that for a virtualenv, and every later ``make test`` /
    ``make demo`` failed with "No module named pip" until someone ran ``make clean``."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    debian = tmp_path / "python3-without-venv"
    debian.write_text(
        "#!/bin/sh\n"
        f'{sys.executable} -m venv --without-pip "$3"\n'
        'echo "The virtual environment was not created successfully because ensurepip is '
        'not available." >&2\nexit 1\n')
    debian.chmod(0o755)
    first = subprocess.run(["make", "-s", "venv", f"PYTHON={debian}"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode != 0
    assert ("cannot create .venv with '" + str(debian) + " -m venv' (Debian/Ubuntu: apt-get "
            "install python3-venv)") in first.stderr
    assert (tmp_path / ".venv" / "bin" / "python").exists()  # what Debian leaves behind
    # python3-venv installed: the next run makes the virtualenv again instead of using it
    again = subprocess.run(["make", "-s", "venv", f"PYTHON={sys.executable}"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr
    pip = subprocess.run([str(tmp_path / ".venv" / "bin" / "python"), "-m", "pip", "--version"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert pip.returncode == 0, pip.stderr


def _plan(tmp_path, target: str) -> list[str]:
    """The commands ``make target`` would run (``-n``), in a copy of the Makefile."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    plan = subprocess.run(["make", "-n", "-B", target], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert plan.returncode == 0, plan.stderr
    return plan.stdout.splitlines()


def test_torch_comes_from_the_cpu_index_before_the_extras(tmp_path):
    """pyproject.toml pins torch==X; from PyPI alone that is the CUDA build (GBs of
    nvidia-* packages) on Linux. It was the CPU build only on a machine whose pip
    configuration offered a +cpu wheel."""
    text = (REPO / "pyproject.toml").read_text()
    pins = set(re.findall(r'"(torch==[^"]+)"', text))
    assert len(pins) == 1, pins  # the examples and dev extras pin the same torch
    [pin] = pins
    for stamp, extra in ((".venv/.examples-stamp", "'.[examples]'"),
                         (".venv/.installed-stamp", "'.[dev]'")):
        lines = _plan(tmp_path, stamp)
        [torch] = [i for i, line in enumerate(lines) if f"'{pin}'" in line]
        [extras] = [i for i, line in enumerate(lines) if line.endswith(f"-e {extra}")]
        assert torch < extras, lines
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines[torch]
        # only torch from there: every other package from the configured indexes
        assert "--no-deps" in lines[torch]


def test_make_help_lists_every_target(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    phony = next(line for line in (REPO / "Makefile").read_text().splitlines()
                 if line.startswith(".PHONY:")).split()[1:]
    done = subprocess.run(["make", "-s", "help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    listed = [line.split()[1] for line in done.stdout.splitlines()]
    assert sorted(listed) == sorted(phony)


def test_an_unreadable_torch_pin_stops_the_install_naming_it(tmp_path):
    """The pin is read from pyproject.toml by sed; formatted otherwise (``"torch >= 2"``)
    it came out empty and pip failed with "Invalid requirement: ''". Spaces around ``==``
    are read; anything else stops the torch install with the reason, and only it."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[x]\nexamples = [\n    "torch == 2.13.0",\n]\n')
    plan = subprocess.run(["make", "-n", "-B", ".venv/.examples-stamp"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert plan.returncode == 0, plan.stderr
    assert "'torch==2.13.0'" in plan.stdout
    pyproject.write_text('[x]\nexamples = [\n    "torch>=2",\n]\n')
    for stamp in (".venv/.examples-stamp", ".venv/.installed-stamp"):
        plan = subprocess.run(["make", "-n", "-B", stamp], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60, check=False)
        assert plan.returncode != 0
        assert "cannot read the torch pin from pyproject.toml" in plan.stderr
        assert "pip install --no-deps" not in plan.stdout
    done = subprocess.run(["make", "-s", "help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
