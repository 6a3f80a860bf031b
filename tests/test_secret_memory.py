"""No text copy of a managed secret's value is left in a live process after the
before-snapshot pass when no error ever quoted it: redacting a failed hook's error made
every secret's "forms" (the value as text, repr-escaped, JSON, URL-encoded) as Python
strings, which nobody can zero — freed, they stayed in the heap and so in the image.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from memscan import count

HERE = Path(__file__).resolve().parent


def test_no_secret_text_left_after_failed_hooks_and_a_rotation(tmp_path: Path) -> None:
    first, rotated = (f"tok-{secrets.token_hex(600)}" for _ in range(2))
    path, rotated_path = tmp_path / "token", tmp_path / "token.new"
    path.write_text(first)
    rotated_path.write_text(rotated)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}  # this checkout's rehydrate
    child = subprocess.Popen([sys.executable, str(HERE / "secret_memory_child.py"),
                              str(path), str(rotated_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=HERE.parent, env=env)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        assert line.strip() == "ready", f"child failed before the scan: {line!r}"
        found = count(child.pid, {"first": first.encode(), "rotated": rotated.encode()})
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert found == {"first": [], "rotated": []}, found
