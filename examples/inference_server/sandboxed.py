"""The example server under real gVisor: cold start, checkpoint, restored clones.

Shared by its runsc test (``tests/gvisor/test_inference_server.py``), ``make demo`` and
``make bench-restore``. It drives ``runsc`` through the test tree's harness
(``tests/gvisor/harness.py``: host ``/`` read-only as the sandbox root, so this
virtualenv runs inside unchanged; ``--network=none``).

Inside each sandbox run three processes: the server (``app.py``), its upstream quota
service (``upstream.py``, started by the server) and the prober (``client.py watch``),
which times the first correct response. What is emulated is what Debian's runsc lacks:
``/proc/gvisor/spec_environ`` is a bind-mounted file (``REHYDRATE_GVISOR_PROC``), one per
clone, holding that clone's environment (its new ``API_KEY``). With no
``/proc/gvisor/checkpoint`` to answer "restore", the in-process notice of a restore is
the clock jump (``CLOCK_MONOTONIC`` includes the time frozen); its grace period, which
waits for a more specific notice, is off (``REHYDRATE_CLOCK_GRACE=0``) because none will
come here — on GKE the gVisor waiter answers at once instead. Before the checkpoint,
``rehydrate notify save`` runs inside the sandbox, as gVisor's save-restore-exec runs it.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.gvisor.harness import (  # noqa: E402 - the repository root must be importable first
    Container,
    GVisorHarness,
    Mount,
    runsc_available,
    supports_uncompressed_checkpoint,
)

__all__ = ["Clone", "ExampleSandbox", "runsc_available"]

PROC = "/etc/rehydrate-gvisor"  # REHYDRATE_GVISOR_PROC inside the sandbox
SOCKET = "/var/tmp/rehydrate.sock"
PYTHON = sys.executable  # the virtualenv's: visible inside, the sandbox root is the host's /
REHYDRATE = str(Path(sys.executable).parent / "rehydrate")
MIN_FROZEN = 2.5  # seconds from checkpoint to restore: above the clock-jump threshold
CLOCK_THRESHOLD = 1.0


def _write_environ(path: Path, env: dict[str, str]) -> None:
    path.write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


@dataclass
class Clone:
    """A restored copy of the server and what its restore looked like."""

    container: Container
    api_key: str
    restore_called_at: float
    """Wall time just before ``runsc restore`` ran."""
    restore_returned_at: float
    first_response: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    rerun: dict[str, Any] = field(default_factory=dict)
    """The report of the same hooks run again (:meth:`ExampleSandbox.rerun_hooks`)."""

    upstream_health: float | None = None
    """:meth:`upstream_health_time`, taken by :meth:`ExampleSandbox.wait_restored`."""

    def upstream_health_time(self) -> float | None:
        """Seconds the (restored) upstream spent answering the health checks of this
        clone's restore run, by its own ``UPSTREAM_TIMINGS`` records (waiting for a
        worker + handling); None when it kept none (an older example)."""
        path = self.container.result_file("upstream.jsonl")
        if not path.exists() or not self.report:
            return None
        start = float(self.report["started_at"])
        end = start + float(self.report["duration"])
        return sum(r["queued_s"] + r["handled_s"]
                   for r in self.container.records("upstream.jsonl")
                   if r.get("path") == "/healthz" and start <= r["t"] <= end)

    @property
    def to_first_response(self) -> float:
        """Seconds from ``runsc restore`` to the clone's first correct response."""
        return float(self.first_response["t"]) - self.restore_called_at


class ExampleSandbox:
    """Runs the example server in gVisor sandboxes made by one :class:`GVisorHarness`."""

    def __init__(self, harness: GVisorHarness, workdir: Path,
                 on_event: Callable[[str], None] | None = None,
                 rehydrate_tree: Path | None = None) -> None:
        self.harness = harness
        self.workdir = workdir
        self.rehydrate_tree = rehydrate_tree
        """Run rehydrate and this example from that checkout inside the sandboxes
        (``PYTHONPATH``, its ``examples/inference_server``) instead of this one: ``make
        bench-restore BASELINE=...`` measures an older commit beside this one."""
        self.example = (rehydrate_tree / "examples" / "inference_server"
                        if rehydrate_tree is not None else HERE)
        self.upstream_token = secrets.token_urlsafe(16)
        self.on_event = on_event or (lambda line: None)
        self._count = 0
        self._frozen_at = 0.0

    # -- environment -------------------------------------------------------------------

    def spec_env(self, api_key: str) -> dict[str, str]:
        """What the platform gives a sandbox: the app's settings and the emulation knobs."""
        return {
            "API_KEY": api_key,
            "UPSTREAM_TOKEN": self.upstream_token,
            "HF_HUB_OFFLINE": "1",
            "REHYDRATE_GVISOR_PROC": PROC,
            "REHYDRATE_CONTROL_SOCKET": SOCKET,
            "REHYDRATE_CLOCK_THRESHOLD": str(CLOCK_THRESHOLD),
            "REHYDRATE_CLOCK_GRACE": "0",
            "REHYDRATE_CONNECT_DEADLINE": "60",
            "UPSTREAM_TIMINGS": "/results/upstream.jsonl",
            **({"PYTHONPATH": str(self.rehydrate_tree)} if self.rehydrate_tree else {}),
        }

    def _proc_mount(self, name: str, env: dict[str, str]) -> Mount:
        self._count += 1
        d = self.workdir / f"proc-{self._count}-{name}"
        d.mkdir(parents=True)
        _write_environ(d / "spec_environ", env)
        return Mount(PROC, d)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, api_key: str, name: str = "server") -> Container:
        """``runsc run`` the server, its upstream and the prober; returns at once."""
        env = self.spec_env(api_key)
        command = (f"{PYTHON} {self.example / 'client.py'} watch --env-file "
                   f"{PROC}/spec_environ --out /results/probe.jsonl & exec {PYTHON} "
                   f"{self.example / 'app.py'} "
                   f"--with-upstream --events /results/events.jsonl")
        return self.harness.run(["/bin/sh", "-c", command], env=env,
                                mounts=[self._proc_mount(name, env)], name=name,
                                timeout=120)

    def wait_first_response(self, c: Container, timeout: float = 180.0,
                            progress: bool = False) -> dict[str, Any]:
        """The prober's record of the first correct response (waits for it); with
        ``progress`` the server's events (model loading, ...) go to ``on_event`` meanwhile."""
        deadline = time.monotonic() + timeout
        shown = 0
        while True:
            if progress:
                events = c.records("events.jsonl")
                for ev in events[shown:]:
                    self.on_event(_describe(ev))
                shown = len(events)
            left = deadline - time.monotonic()
            try:
                return c.wait_for("probe.jsonl", _is_first_response,
                                  timeout=min(1.0, left) if progress else left)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise

    def client(self, c: Container, *args: str, timeout: float = 60) -> dict[str, Any]:
        """Run ``client.py ARGS`` inside the sandbox; its JSON answer."""
        proc = c.exec([PYTHON, str(self.example / "client.py"), *args], timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"client {args} exited {proc.returncode}: {proc.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(proc.stdout)
        return result

    def notify(self, c: Container, action: str) -> dict[str, Any]:
        """``rehydrate notify ACTION --json`` inside the sandbox (save-restore-exec)."""
        # A tree on PYTHONPATH (make bench-restore BASELINE=…, and this tree beside it)
        # runs its own entry point: the virtualenv's script names this tree's, which an
        # older tree may lack (console_main came in 2026-12).
        cmd = ([PYTHON, "-m", "rehydrate"] if self.rehydrate_tree is not None else [REHYDRATE])
        proc = c.exec([*cmd, "notify", action, "--json"], timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"notify {action} exited {proc.returncode}: "
                               f"{proc.stdout[-1000:]} {proc.stderr[-1000:]}")
        result: dict[str, Any] = json.loads(proc.stdout)
        return result

    def rerun_hooks(self, clone: Clone) -> dict[str, Any]:
        """The same hooks run again in a restored clone: what they cost once the clone's
        restored memory has been touched. Returns that run's report.

        A ``notify resume`` right after the restore only confirms it (no freeze since the
        hooks ran), so this asks the control socket to *simulate* a resume instead."""
        # a baseline tree (make bench-restore BASELINE=…) may predate the public import
        code = ("import json\n"
                "try:\n    from rehydrate import request\n"
                "except ImportError:\n    from rehydrate._control_client import request\n"
                "print(json.dumps(request('simulate', event='resume', timeout=120)))")
        proc = clone.container.exec([PYTHON, "-c", code], timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"simulate resume exited {proc.returncode}: {proc.stderr[-1000:]}")
        reply: dict[str, Any] = json.loads(proc.stdout)
        if "report" not in reply:
            raise RuntimeError(f"simulate resume: {reply.get('error', reply)}")
        report: dict[str, Any] = reply["report"]
        return report

    def checkpoint(self, c: Container) -> tuple[Path, float]:
        """``notify save`` then ``runsc checkpoint``; the image and the checkpoint seconds
        (the save hooks included). Memory pages are written uncompressed when this runsc
        can (trixie's): restoring them is several times faster than inflating them."""
        t0 = time.monotonic()
        self.notify(c, "save")
        self._frozen_at = time.time()
        compression = "none" if supports_uncompressed_checkpoint(self.harness.runsc) else None
        image = c.checkpoint(compression=compression)
        return image, time.monotonic() - t0

    def restore(self, image: Path, template: Container, api_key: str,
                name: str = "clone") -> Clone:
        """``runsc restore`` a clone whose environment carries a new ``API_KEY``."""
        env = self.spec_env(api_key)
        mount = self._proc_mount(name, env)
        while time.time() - self._frozen_at < MIN_FROZEN:
            time.sleep(0.05)  # the clock-jump threshold needs this much freeze
        called = time.time()
        container = self.harness.restore(image, template, name=name, env=env, mounts=[mount],
                                         timeout=120)
        return Clone(container, api_key, called, time.time())

    def wait_restored(self, clone: Clone, timeout: float = 120.0) -> Clone:
        """Wait for the clone's first correct response and its restore report."""
        clone.first_response = clone.container.wait_for("probe.jsonl", _is_first_response,
                                                        timeout=timeout)
        rec = clone.container.wait_for(
            "events.jsonl",
            lambda r: r.get("event") == "report" and r["report"]["kind"] == "restore",
            timeout=timeout)
        clone.report = rec["report"]
        clone.upstream_health = clone.upstream_health_time()
        return clone


def _is_first_response(rec: dict[str, Any]) -> bool:
    return rec.get("event") == "first-response"


def _describe(ev: dict[str, Any]) -> str:
    kind = ev.get("event")
    if kind == "loading-model":
        return f"loading {ev.get('model')} (torch + sentence-transformers, inside gVisor)..."
    if kind == "model-loaded":
        return f"model loaded in {ev.get('seconds')} s; starting uvicorn"
    if kind == "serving":
        return "server starting on 127.0.0.1:8000 (inside the sandbox)"
    if kind == "report":
        rep = ev.get("report", {})
        return f"{rep.get('event')} report: ok={rep.get('ok')}"
    return str(kind)


def image_bytes(image: Path) -> int:
    """Total size of a checkpoint image directory."""
    return sum(p.stat().st_size for p in image.rglob("*") if p.is_file())


def new_key() -> str:
    """A fresh API key (what a platform's secret manager would hand a clone)."""
    return "sk-" + secrets.token_urlsafe(18)


def is_app_hook(name: str) -> bool:
    """The application's own hooks (anything not built into rehydrate)."""
    return not name.startswith("rehydrate.")


def rehydrate_share(report: dict[str, Any]) -> float:
    """Seconds of a restore run that were rehydrate's own: the run's duration minus the
    application's hooks (here the warm-up canary and the key-rotation callback)."""
    app = sum(float(h["duration"]) for h in report["hooks"] if is_app_hook(h["name"]))
    return float(report["duration"]) - app


def hook_table(report: dict[str, Any]) -> str:
    """Every hook of a report: phase, duration, outcome (what the demo prints per clone)."""
    rows = [("hook", "phase", "ms", "outcome")]
    rows += [(h["name"], h["phase"], f"{h['duration'] * 1000:.1f}",
              h["outcome"] + (f" ({h['error']})" if h.get("error") else ""))
             for h in report["hooks"]]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}"
                     for r in rows)
