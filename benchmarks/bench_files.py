"""Volume benchmarks: what managed handles and the audit add to a snapshot / restore pass,
and what ``rehydrate doctor``'s platform probe costs off GCE.

1. One before-snapshot pass plus one restore pass (``simulate_snapshot`` +
   ``simulate_restore``) on an engine with no managed handle, with 100 managed files, and
   with 100 files plus 10 SQLite databases in WAL mode — side by side, median of
   :data:`REPEAT` runs. Half of the files are changed between the passes (rename-over), so
   the restore reopens them from the start and calls ``on_change``.
2. The before-snapshot audit (``open_files()``: ``/proc/self/fd`` + ``mountinfo``) with
   500 extra descriptors open.
3. ``nodefit.facts()`` off GCE (the metadata server refuses at once) — the cost
   ``rehydrate doctor`` and the manifest pay when not on GCE.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N_FILES = 100
N_DB = 10
N_FDS = 500
REPEAT = 5


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} ms"


def _pass_times(n_files: int, n_db: int, d: Path) -> list[float]:
    from rehydrate import files
    from rehydrate.testing import isolated_engine

    engine = isolated_engine()
    handles: list[object] = []
    for i in range(n_files):
        p = d / f"f{i}.txt"
        p.write_text("line 1\nline 2\n")
        f = files.open(p, engine=engine, on_change=lambda h: None)
        f.readline()
        handles.append(f)
    for i in range(n_db):
        db = files.sqlite(d / f"db{i}.sqlite", engine=engine)
        db.execute("PRAGMA journal_mode=WAL")
        with db:
            db.execute("CREATE TABLE IF NOT EXISTS t (x)")
            db.execute("INSERT INTO t VALUES (1)")
        handles.append(db)
    times = []
    try:
        for _ in range(REPEAT):
            t0 = time.perf_counter()
            assert engine.simulate_snapshot().ok
            snapshot = time.perf_counter() - t0
            for i in range(0, n_files, 2):  # half of them replaced while "frozen"
                tmp = d / f"f{i}.new"
                tmp.write_text("new 1\n")
                os.replace(tmp, d / f"f{i}.txt")
            t1 = time.perf_counter()
            assert engine.simulate_restore().ok
            times.append(snapshot + time.perf_counter() - t1)
        return times
    finally:
        engine.close()


def run() -> list[tuple[str, str, str]]:
    from rehydrate import _nodefit as nodefit
    from rehydrate import files

    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        cases = [("no managed handle", 0, 0), (f"{N_FILES} files", N_FILES, 0),
                 (f"{N_FILES} files + {N_DB} WAL SQLite", N_FILES, N_DB)]
        for label, n_files, n_db in cases:
            d = base / label.replace(" ", "_").replace("+", "")
            d.mkdir()
            rows.append((f"snapshot + restore pass, {label}", _ms(_pass_times(n_files, n_db, d)),
                         "< 100 ms with 100 files" if n_files and not n_db else ""))
        held = [open(base / f"fd{i}", "w") for i in range(N_FDS)]  # noqa: SIM115
        try:
            times = []
            for _ in range(REPEAT):
                t0 = time.perf_counter()
                files.open_files()
                times.append(time.perf_counter() - t0)
        finally:
            for f in held:
                f.close()
        rows.append((f"audit: open_files() with {N_FDS} extra descriptors", _ms(times),
                     "< 50 ms"))
    with socket.socket() as s:  # nobody listens: refused at once, like most non-GCE hosts
        s.bind(("127.0.0.1", 0))
        os.environ["GCE_METADATA_HOST"] = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        times = []
        for _ in range(REPEAT):
            t0 = time.perf_counter()
            nodefit.facts(nvidia_smi=False)
            times.append(time.perf_counter() - t0)
    finally:
        del os.environ["GCE_METADATA_HOST"]
    rows.append(("nodefit.facts() off GCE (metadata refused)", _ms(times),
                 f"<< the {nodefit.METADATA_TIMEOUT:g} s timeout"))
    return rows


if __name__ == "__main__":  # the same table as `make bench`, for this module only
    from run import main  # benchmarks/ is on sys.path when a module runs as a script

    sys.exit(main([*sys.argv[1:], Path(__file__).stem]))
