"""Run every ``benchmarks/bench_*.py`` module's ``run()`` and print one table.

``make bench`` calls this. Usage: ``python benchmarks/run.py [--json] [NAME ...]`` where
``NAME`` selects modules by substring (``core`` runs ``bench_core.py``). Each module is
imported from its file and its rows ``(name, measured, goal)`` are printed under the
module's name; a module that fails prints one error row and the others still run. The
exit status is non-zero when any module failed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

Row = tuple[str, str, str]


def discover(selected: list[str]) -> list[Path]:
    paths = sorted(HERE.glob("bench_*.py"))
    if selected:
        paths = [p for p in paths if any(s in p.stem for s in selected)]
    return paths


def run_module(path: Path) -> tuple[list[Row], str | None, float]:
    t0 = time.perf_counter()
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        rows = [tuple(str(c) for c in row) for row in module.run()]
        for row in rows:
            if len(row) != 3:
                raise ValueError(f"run() returned a row of {len(row)} columns: {row!r}")
        return rows, None, time.perf_counter() - t0  # type: ignore[return-value]
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        return [], f"{type(exc).__name__}: {exc}", time.perf_counter() - t0


def table(sections: list[tuple[str, list[Row], str | None, float]]) -> str:
    head = ("benchmark", "measured", "goal")
    body: list[tuple[str, str, str]] = []
    for name, rows, error, seconds in sections:
        body.append((f"[{name}]  ({seconds:.1f} s)", "", ""))
        if error is not None:
            body.append(("  FAILED", error, ""))
        body.extend((f"  {r[0]}", r[1], r[2]) for r in rows)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    selected = [a for a in argv if not a.startswith("-")]
    paths = discover(selected)
    if not paths:
        print(f"no benchmarks match {selected}", file=sys.stderr)
        return 2
    sections = []
    for path in paths:
        print(f"running {path.name} ...", file=sys.stderr, flush=True)
        rows, error, seconds = run_module(path)
        sections.append((path.stem, rows, error, seconds))
    if as_json:
        print(json.dumps({name: {"rows": rows, "error": error, "seconds": round(seconds, 2)}
                          for name, rows, error, seconds in sections}, indent=2))
    else:
        print(table(sections))
    return 1 if any(error for _, _, error, _ in sections) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
