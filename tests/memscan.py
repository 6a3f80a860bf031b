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


def scan_child(args: list[str], needles: dict[str, bytes], *, env: dict[str, str],
               cwd: str) -> dict[str, list[str]]:
    """Run ``args`` (a child that prints ``ready`` when it is to be scanned, then waits
    for a line on its stdin and exits 0), count ``needles`` in its memory then, and let
    it finish."""
    import subprocess

    child = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=cwd, env=env)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        assert line.strip() == "ready", f"child failed before the scan: {line!r}"
        found = count(child.pid, needles)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return found
