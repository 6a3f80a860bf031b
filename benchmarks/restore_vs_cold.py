"""Restore vs cold start of the example inference server under real gVisor
(``make bench-restore``; needs root and runsc, ~2 minutes on a quiet host).

Each run is timed to the *first correct response*: the prober inside the sandbox
(``examples/inference_server/client.py watch``) gets a 200 from ``POST /v1/embed`` with
the sandbox's current API key and the cold server's embedding.

* **cold start**: ``runsc run`` of the server (torch + sentence-transformers import,
  all-MiniLM-L6-v2 load, uvicorn) until that first correct response; ``--runs`` times
  (default 3), each in a fresh sandbox;
* **checkpoint**: ``rehydrate notify save`` (inside the sandbox) + ``runsc checkpoint`` of
  the last cold server, and the image's size;
* **restore**: ``runsc restore`` of a clone with a new API key until its first correct
  response (its restore hooks have run: env re-read, reseed, secrets reloaded, signing key
  regenerated, upstream reconnected and checked, warm-up canary), ``--clones`` times
  (default 8) from the same image; then the same hooks once more in that clone (a resume
  simulated through its control socket: a ``notify resume`` right after the restore only
  confirms it), for what they cost when the restored memory is no longer touched first.

With ``--baseline-tree DIR`` (a checkout of an older commit) that checkout's example
server also runs, on that checkout's rehydrate (``PYTHONPATH`` inside the sandboxes):
one cold start and checkpoint, then its clones restored alternately with this tree's,
and its share and hooks shown beside this tree's.

Rehydrate's own share is read from each clone's restore report: the run's duration minus
the application's hooks (the canary embedding and the key-rotation callback). Part of it
is the upstream quota service answering the connection's health check: inside the
sandbox that service is restored together with the server, so its first request after
the restore is slow too; its own timings (``UPSTREAM_TIMINGS``) give that part, shown
beside the share and subtracted in the next row — the share itself is not adjusted. The
run's duration leaves out what came before it: from the detector's notice to the run's
start (the report's ``notice_to_run``), shown with the share counted from the notice. The table
shows medians (min-max); the figure (SVG, written by hand: no plotting dependency) has
cold vs restore bars and the median restore's waterfall (runsc restore, each hook, first
response). The last line is ``restore to first response: N.N(x) faster than cold start`` (with
a multiplication sign).
Goals: at least 20x; rehydrate's share under 50 ms.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_SVG = HERE / "out" / "restore_vs_cold.svg"
GOAL_SPEEDUP = 20.0
GOAL_SHARE = 0.050
DEFAULT_CLONES = 8


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sandboxed = _load("inference_server_sandboxed", ROOT / "examples/inference_server/sandboxed.py")
run_table = _load("_bench_run", HERE / "run.py").table


def _spread(values: list[float], unit: float = 1.0, fmt: str = "{:.2f}") -> str:
    med = statistics.median(values)
    lo, hi = min(values), max(values)
    return (f"{fmt.format(med * unit)} ({fmt.format(lo * unit)}-{fmt.format(hi * unit)}, "
            f"n={len(values)})")


def measure(runs: int, workdir: Path, baseline: Path | None = None,
            clones: int | None = None) -> dict[str, Any]:
    harness = sandboxed.GVisorHarness(workdir / "gvisor", debug_log=False)
    # With a baseline, this tree's rehydrate is put on PYTHONPATH as the baseline's is, so
    # that both sides import it the same way (else it comes from the virtualenv's path).
    sandbox = sandboxed.ExampleSandbox(harness, workdir,
                                       rehydrate_tree=ROOT if baseline is not None else None)
    try:
        colds: list[float] = []
        server = None
        for i in range(runs):
            print(f"cold start {i + 1}/{runs} ...", file=sys.stderr, flush=True)
            t0 = time.time()
            server = sandbox.start(sandboxed.new_key(), name=f"cold{i}")
            colds.append(sandbox.wait_first_response(server)["t"] - t0)
            if i < runs - 1:
                harness.kill(server)
                harness.delete(server)
        assert server is not None
        print("checkpoint ...", file=sys.stderr, flush=True)
        image, checkpoint_s = sandbox.checkpoint(server)
        old = None
        if baseline is not None:  # the same server on the older rehydrate, one cold start
            print(f"baseline ({baseline}): cold start + checkpoint ...", file=sys.stderr,
                  flush=True)
            old_box = sandboxed.ExampleSandbox(harness, workdir / "baseline",
                                               rehydrate_tree=baseline)
            old_server = old_box.start(sandboxed.new_key(), name="basecold")
            old_box.wait_first_response(old_server)
            old = (old_box, old_server, old_box.checkpoint(old_server)[0])
        restored, old_clones = [], []
        n = clones or runs
        for i in range(n):  # alternating: load drifting during the run hits both alike
            print(f"restore {i + 1}/{n} ...", file=sys.stderr, flush=True)
            # Which tree goes first alternates too (same commit on both sides, this tree
            # always first: its share measured 1.34x the other's; see the example README).
            if old is not None and i % 2:
                old_clones.append(_clone(harness, old[0], old[2], old[1], f"baseclone{i}"))
            restored.append(_clone(harness, sandbox, image, server, f"clone{i}"))
            if old is not None and not i % 2:
                old_clones.append(_clone(harness, old[0], old[2], old[1], f"baseclone{i}"))
        return {"cold": colds, "checkpoint": checkpoint_s,
                "image_bytes": sandboxed.image_bytes(image), "clones": restored,
                "baseline": old_clones, "runsc": harness.runsc}
    finally:
        harness.close()


def _clone(harness: Any, sandbox: Any, image: Path, server: Any, name: str) -> Any:
    """One restored clone, its report, the same hooks re-run in it; then it is removed."""
    clone = sandbox.wait_restored(sandbox.restore(image, server, sandboxed.new_key(),
                                                  name=name))
    try:
        if not clone.report["ok"]:
            raise RuntimeError(f"{name} restore failed:\n{sandboxed.hook_table(clone.report)}")
        clone.rerun = sandbox.rerun_hooks(clone)
    finally:
        harness.kill(clone.container)
        harness.delete(clone.container)
    return clone


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    clones = m["clones"]
    restore = [c.to_first_response for c in clones]
    runsc = [c.restore_returned_at - c.restore_called_at for c in clones]
    hooks = [c.report["duration"] for c in clones]
    share = [sandboxed.rehydrate_share(c.report) for c in clones]
    app = [h - s for h, s in zip(hooks, share, strict=True)]
    cold, med_restore = statistics.median(m["cold"]), statistics.median(restore)
    speedup = cold / med_restore
    return [
        ("cold start -> first correct response (s)", _spread(m["cold"]), ""),
        ("checkpoint: notify save + runsc checkpoint (s)", f"{m['checkpoint']:.2f}", ""),
        ("checkpoint image (MB)", f"{m['image_bytes'] / 1e6:.0f}", ""),
        ("restore -> first correct response (s)", _spread(restore), ""),
        ("  runsc restore returned (s)", _spread(runsc), ""),
        ("  restore hooks, whole run (ms)", _spread(hooks, 1000, "{:.0f}"), ""),
        ("  rehydrate's own share (ms)", _spread(share, 1000, "{:.0f}"),
         f"< {GOAL_SHARE * 1000:.0f}"),
        *_builtin_rows(clones),
        *_upstream_rows(clones),
        *_notice_rows(clones),
        ("  application hooks: canary, key callback (ms)", _spread(app, 1000, "{:.0f}"), ""),
        ("same hooks run again in the clone (simulated resume):", "", ""),
        ("  rehydrate's own share (ms)",
         _spread([sandboxed.rehydrate_share(c.rerun) for c in clones], 1000, "{:.0f}"),
         f"< {GOAL_SHARE * 1000:.0f}"),
        ("  application hooks (ms)",
         _spread([c.rerun["duration"] - sandboxed.rehydrate_share(c.rerun) for c in clones],
                 1000, "{:.0f}"), ""),
        *_baseline_rows(m),
        ("reduction vs cold start", f"{(1 - med_restore / cold) * 100:.1f} %", "platform: 89 %"),
        ("speed-up (cold / restore, medians)", f"{speedup:.1f}x", f">= {GOAL_SPEEDUP:.0f}x"),
    ]


def _baseline_rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The same restores on the older rehydrate (``--baseline-tree``), side by side."""
    old = m["baseline"]
    if not old:
        return []
    new_share = statistics.median(sandboxed.rehydrate_share(c.report) for c in m["clones"])
    old_share = statistics.median(sandboxed.rehydrate_share(c.report) for c in old)
    return [
        (f"baseline tree {m['baseline_tree']} (its example and rehydrate, same clones):",
         "", ""),
        ("  restore -> first correct response (s)",
         _spread([c.to_first_response for c in old]), ""),
        ("  rehydrate's own share (ms)",
         _spread([sandboxed.rehydrate_share(c.report) for c in old], 1000, "{:.0f}"),
         f"this tree: {new_share / old_share:.2f}x"),
        *[("  " + name, value, goal) for name, value, goal in _builtin_rows(old)],
        *[("  " + name, value, goal) for name, value, goal in _notice_rows(old)],
        ("  same hooks run again: rehydrate's own share (ms)",
         _spread([sandboxed.rehydrate_share(c.rerun) for c in old], 1000, "{:.0f}"), ""),
    ]


def _notice_rows(clones: list[Any]) -> list[tuple[str, str, str]]:
    """What the run's duration leaves out: from the detector's notice to the run's start
    (``notice_to_run`` in the report; older trees do not record it)."""
    waited = [c.report.get("notice_to_run") for c in clones]
    if any(w is None for w in waited):
        return []
    total = [w + sandboxed.rehydrate_share(c.report) for c, w in zip(clones, waited,
                                                                      strict=True)]
    return [
        ("    notice -> run start, before the hooks (ms)", _spread(waited, 1000, "{:.1f}"), ""),
        ("    rehydrate's own share from the notice (ms)", _spread(total, 1000, "{:.0f}"),
         ""),
    ]


def _upstream_rows(clones: list[Any]) -> list[tuple[str, str, str]]:
    """How much of the connections hook was the upstream answering its health check, by
    the upstream's own timings: inside the sandbox it is restored with the server and
    pays its own first touches; a real upstream outside the snapshot would not."""
    times = [c.upstream_health for c in clones]
    if any(t is None for t in times):
        return []
    share = [sandboxed.rehydrate_share(c.report) - t for c, t in zip(clones, times, strict=True)]
    return [
        ("      connections: the restored upstream answering /healthz (ms)",
         _spread(times, 1000, "{:.1f}"), ""),
        ("    rehydrate's own share without that answer (ms)", _spread(share, 1000, "{:.0f}"),
         ""),
    ]


def _builtin_rows(clones: list[Any]) -> list[tuple[str, str, str]]:
    """rehydrate's share broken down: each built-in hook, and the engine's own dispatch
    (the run's duration minus every hook's)."""
    names = [h["name"] for h in clones[0].report["hooks"] if not sandboxed.is_app_hook(h["name"])]
    out = []
    for name in names:
        per = [next(h["duration"] for h in c.report["hooks"] if h["name"] == name)
               for c in clones]
        out.append((f"    {name} (ms)", _spread(per, 1000, "{:.1f}"), ""))
    dispatch = [c.report["duration"] - sum(h["duration"] for h in c.report["hooks"])
                for c in clones]
    out.append(("    engine dispatch between hooks (ms)", _spread(dispatch, 1000, "{:.1f}"), ""))
    return out


# --------------------------------------------------------------------------- the figure

_COLORS = {"cold": "#9e9e9e", "runsc": "#90caf9", "notice": "#cfd8dc", "rehydrate": "#1e88e5",
           "app": "#fb8c00", "response": "#43a047"}


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def svg(m: dict[str, Any]) -> str:
    """Cold vs restore bars, then the median restore's waterfall."""
    clones = sorted(m["clones"], key=lambda c: c.to_first_response)
    median = clones[len(clones) // 2]
    cold = statistics.median(m["cold"])
    restore = median.to_first_response
    width, left, right = 900, 260, 40
    plot = width - left - right
    out: list[str] = []

    def rect(x: float, y: float, w: float, h: float, color: str, title: str) -> None:
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 1.0):.1f}" height="{h}" '
                   f'fill="{color}"><title>{_esc(title)}</title></rect>')

    def text(x: float, y: float, s: str, anchor: str = "start", size: int = 12,
             weight: str = "normal") -> None:
        out.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                   f'font-weight="{weight}">{_esc(s)}</text>')

    # -- bars: cold vs restore, same scale
    text(20, 28, f"Example inference server under runsc: first correct response "
         f"({cold / restore:.1f}x faster restored)", size=15, weight="bold")
    scale = plot / cold
    y = 50
    rect(left, y, cold * scale, 26, _COLORS["cold"], f"cold start {cold:.2f} s")
    text(left - 10, y + 18, f"cold start (median of {len(m['cold'])})", "end")
    text(left + cold * scale - 5, y + 18, f"{cold:.1f} s", "end")
    y += 40
    rect(left, y, restore * scale, 26, _COLORS["rehydrate"], f"restore {restore:.2f} s")
    text(left - 10, y + 18, "restore (median clone)", "end")
    text(left + restore * scale + 6, y + 18, f"{restore:.2f} s")

    # -- waterfall of the median restore, its own scale (seconds from `runsc restore`)
    y += 60
    text(20, y, "Median restore, from `runsc restore` to the first correct response",
         size=14, weight="bold")
    y += 14
    t0 = median.restore_called_at
    rep = median.report
    end = max(restore, rep["started_at"] + rep["duration"] - t0) * 1.05
    wscale = plot / end
    lanes: list[tuple[str, float, float, str]] = [
        ("runsc restore (platform)", 0.0, median.restore_returned_at - t0, _COLORS["runsc"])]
    at = rep["started_at"] - t0
    for h in rep["hooks"]:
        color = _COLORS["app"] if sandboxed.is_app_hook(h["name"]) else _COLORS["rehydrate"]
        lanes.append((f"{h['name']} ({h['phase']})", at, h["duration"], color))
        at += h["duration"]
    lanes.append(("first correct response", restore, 0.0, _COLORS["response"]))
    for name, start, dur, color in lanes:
        rect(left + start * wscale, y, dur * wscale if dur else 3, 18, color,
             f"{name}: {start * 1000:.0f} ms + {dur * 1000:.1f} ms")
        text(left - 10, y + 13, name, "end", size=11)
        label = f"{dur * 1000:.1f} ms" if dur else f"at {start:.2f} s"
        text(left + (start + dur) * wscale + 5, y + 13, label, size=11)
        y += 24
    # axis
    y += 6
    out.append(f'<line x1="{left}" y1="{y}" x2="{left + plot}" y2="{y}" stroke="#555"/>')
    step = 0.25 if end <= 2.5 else 0.5 if end <= 5 else 1.0
    tick = 0.0
    while tick <= end:
        x = left + tick * wscale
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#555"/>')
        text(x, y + 16, f"{tick:g} s", "middle", size=10)
        tick += step
    y += 28
    share = sandboxed.rehydrate_share(rep)
    text(20, y, f"blue: rehydrate ({share * 1000:.0f} ms in this run) \N{MIDDLE DOT} orange: "
         f"the application's hooks \N{MIDDLE DOT} light blue: runsc restore \N{MIDDLE DOT} "
         f"green: first response", size=11)
    text(20, y + 16, "the gap before the first hook: the restore being noticed (clock jump)",
         size=11)
    height = y + 34
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif">'
            f'<rect width="100%" height="100%" fill="white"/>')
    return "\n".join([head, *out, "</svg>"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="restore vs cold start under runsc")
    parser.add_argument("--runs", type=int, default=3, help="runs of each (at least 3)")
    parser.add_argument("--clones", type=int, default=DEFAULT_CLONES,
                        help=f"clones restored from the image (default {DEFAULT_CLONES}: "
                             "one clone's share spans 22-135 ms on a quiet 2-core host, "
                             "so medians of 3 swing by tens of ms)")
    parser.add_argument("--svg", type=Path, default=DEFAULT_SVG, help="where the figure goes")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="a checkout of an older commit (e.g. `git worktree add DIR "
                             "COMMIT`): its rehydrate serves the same example in clones "
                             "restored alternately with this tree's, shown side by side")
    args = parser.parse_args(argv)
    if args.runs < 3 or args.clones < 3:
        parser.error("--runs and --clones must be at least 3 (medians)")
    reason = sandboxed.runsc_available()
    if reason is not None:
        print(f"restore_vs_cold: cannot run without runsc: {reason}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rehydrate-bench-restore-") as tmp:
        baseline = args.baseline_tree.resolve() if args.baseline_tree else None
        m = measure(args.runs, Path(tmp), baseline, args.clones)
        m["baseline_tree"] = baseline
    table_rows = rows(m)
    print(run_table([(f"restore_vs_cold ({Path(m['runsc']).name})", table_rows, None,
                      time.perf_counter() - t0)]))
    args.svg.parent.mkdir(parents=True, exist_ok=True)
    args.svg.write_text(svg(m))
    print(f"figure: {args.svg}")
    speedup = statistics.median(m["cold"]) / statistics.median(
        [c.to_first_response for c in m["clones"]])
    print(f"restore to first response: {speedup:.1f}\N{MULTIPLICATION SIGN} faster than cold start")
    return 0


if __name__ == "__main__":
    sys.exit(main())
