"""Count copies of byte strings in a live process's memory (``/proc/PID/mem``).

Not a test module. Used to prove that key material is gone from a process after the
before-snapshot pass: what the scan finds is what a snapshot image would hold.
"""

from __future__ import annotations

import re


def regions(pid: int) -> list[tuple[int, int, str]]:
    """Readable, writable private mappings (heap, anonymous, stacks, data): where copies
    of data made at run time live. Read-only file mappings hold no secrets."""
    out = []
    with open(f"/proc/{pid}/maps") as fh:
        for line in fh:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            perms = fields[1]
            name = fields[5] if len(fields) > 5 else "[anon]"
            if perms.startswith("rw") and name not in ("[vvar]", "[vsyscall]", "[vdso]"):
                out.append((lo, hi, name))
    return out


def count(pid: int, needles: dict[str, bytes]) -> dict[str, list[str]]:
    """For each needle, the mapping names where a copy was found (one entry per copy)."""
    found: dict[str, list[str]] = {k: [] for k in needles}
    patterns = {k: re.compile(re.escape(v)) for k, v in needles.items()}
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for lo, hi, name in regions(pid):
            try:
                mem.seek(lo)
                data = mem.read(hi - lo)
            except OSError:
                continue
            for key, pat in patterns.items():
                found[key].extend(name for _ in pat.finditer(data))
    return found
