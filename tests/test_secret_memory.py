"""No text copy of a managed secret's value is left in a live process after the
before-snapshot pass when no error ever quoted it: redacting a failed hook's error made
every secret's "forms" (the value as text, repr-escaped, JSON, URL-encoded) as Python
strings, which nobody can zero — freed, they stayed in the heap and so in the image.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from memscan import scan_child

HERE = Path(__file__).resolve().parent


def test_no_secret_text_left_after_failed_hooks_and_a_rotation(tmp_path: Path) -> None:
    first, rotated = (f"tok-{secrets.token_hex(600)}" for _ in range(2))
    path, rotated_path = tmp_path / "token", tmp_path / "token.new"
    path.write_text(first)
    rotated_path.write_text(rotated)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}  # this checkout's rehydrate
    found = scan_child([sys.executable, str(HERE / "secret_memory_child.py"), str(path),
                        str(rotated_path)],
                       {"first": first.encode(), "rotated": rotated.encode()},
                       env=env, cwd=str(HERE.parent))
    assert found == {"first": [], "rotated": []}, found
