"""``make demo``: the example embedding server cold-started, checkpointed and restored
into two clones with a changed API key, under real gVisor.

As root with runsc (``make demo`` installs it): the server runs in a ``runsc`` sandbox;
the demo shows the model loading, times the cold start to the first correct response,
runs ``rehydrate notify save`` and ``runsc checkpoint`` (time, image size), restores two
clones, each with a new ``API_KEY``, checks that each rejects the old key and serves the
new one the cold server's embeddings, and prints a table: cold start, checkpoint, restore
to first correct response, the reduction, rehydrate's own share, and each clone's
restore report (every hook: phase, duration, outcome).

Otherwise: one line says why, and the same server runs in this process with a simulated
restore (nothing is frozen, so nothing is faster; what rehydrate does is the same).
``python examples/inference_server/demo.py --simulate`` forces that mode.

A failure ends the demo with one line (``demo failed: ...``, exit status 1; ``--verbose``
adds the traceback); Ctrl-C with exit status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"inference_server_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def say(line: str = "") -> None:
    print(line, flush=True)


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {a:<{width}}  {b}" for a, b in rows)


# --------------------------------------------------------------------------- under runsc


def run_gvisor(sandboxed: Any, clones: int) -> None:
    with tempfile.TemporaryDirectory(prefix="rehydrate-demo-") as tmp:
        harness = sandboxed.GVisorHarness(Path(tmp) / "gvisor", debug_log=False)
        try:
            _gvisor_scenario(sandboxed, harness, Path(tmp), clones)
        finally:
            harness.close()


def _gvisor_scenario(sandboxed: Any, harness: Any, workdir: Path, n_clones: int) -> None:
    sandbox = sandboxed.ExampleSandbox(harness, workdir, on_event=lambda s: say(f"  {s}"))
    say(f"runsc: {harness.runsc} (--network=none; requests come from inside the sandbox)")
    say("\n[1] cold start: runsc run the server (+ its upstream and a prober)")
    cold_key = sandboxed.new_key()
    t0 = time.time()
    server = sandbox.start(cold_key, name="cold")
    first = sandbox.wait_first_response(server, progress=True)
    cold_s = first["t"] - t0
    say(f"  first correct response after {cold_s:.1f} s "
        f"(instance {first['instance_id'][:8]}, 384-dim embedding)")

    say("\n[2] checkpoint: rehydrate notify save (drain, wipe secrets, drop keys, close the "
        "upstream pool), then runsc checkpoint")
    image, checkpoint_s = sandbox.checkpoint(server)
    size = sandboxed.image_bytes(image)
    say(f"  {checkpoint_s:.1f} s, image {size / 1e6:.0f} MB")

    clones = []
    for k in range(n_clones):
        say(f"\n[3.{k + 1}] restore clone {k + 1} with a new API_KEY in its environment")
        clone = sandbox.wait_restored(sandbox.restore(image, server, sandboxed.new_key(),
                                                      name=f"clone{k}"))
        c = clone.container
        old = sandbox.client(c, "embed", "--key", cold_key, "restore me in a second")
        new = sandbox.client(c, "embed", "--key", clone.api_key, "restore me in a second")
        same = new["status"] == 200 and new["body"]["embeddings"][0] == first["embedding"]
        seen = clone.first_response["seen_before"]
        say(f"  first correct response {clone.to_first_response:.2f} s after runsc restore "
            f"(runsc restore itself: {clone.restore_returned_at - clone.restore_called_at:.2f}"
            f" s; the prober got {seen['503']} x 503 while the hooks ran, "
            f"{seen['401']} x 401)")
        say(f"  old API key -> {old['status']}, new API key -> {new['status']}; "
            f"instance {new['instance_id'][:8]}; embedding equal to the cold server's: {same}")
        clones.append(clone)

    restores = [c.to_first_response for c in clones]
    shares = [sandboxed.rehydrate_share(c.report) for c in clones]
    med = statistics.median(restores)
    rows = [("cold start -> first correct response", f"{cold_s:.2f} s"),
            ("checkpoint (notify save + runsc checkpoint)",
             f"{checkpoint_s:.2f} s, image {size / 1e6:.0f} MB"),
            *[(f"restore clone {k + 1} -> first correct response",
               f"{c.to_first_response:.2f} s") for k, c in enumerate(clones)],
            ("reduction vs cold start (median clone)", f"{(1 - med / cold_s) * 100:.1f} % "
             f"({cold_s / med:.1f}x faster)"),
            ("rehydrate's own share of the restore",
             ", ".join(f"{s * 1000:.0f} ms" for s in shares)
             + " (restore run minus the app's hooks)")]
    say("\n== summary\n" + table(rows))
    for k, c in enumerate(clones):
        r = c.report
        say(f"\nclone {k + 1} restore report: ok={r['ok']} reason={r['reason']} "
            f"generation={r['generation']} changed={r['env_changes']['changed']} "
            f"in {r['duration'] * 1000:.0f} ms")
        say(sandboxed.hook_table(r))


# --------------------------------------------------------------------------- simulated


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _serving(app_module: Any, workdir: Path) -> Iterator[tuple[Any, int]]:
    """The server in this process (uvicorn on a thread) and its upstream beside it."""
    import uvicorn

    import rehydrate

    os.environ["REHYDRATE_CONTROL_SOCKET"] = str(workdir / "control.sock")
    up_port = _free_port()
    upstream = app_module.start_upstream(up_port)
    server = None
    try:
        app_module.wait_upstream(upstream, up_port)
        service = app_module.InferenceService(f"http://127.0.0.1:{up_port}",
                                              app_module.EventLog(None))
        # port 0: uvicorn binds a free port itself (one picked here and bound later could
        # be taken meanwhile by another process); asked once it listens
        config = uvicorn.Config(app_module.create_app(service), host="127.0.0.1", port=0,
                                log_level="warning", lifespan="on")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 300  # the model loads during the startup
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        (listener,) = [sock for srv in server.servers for sock in srv.sockets]
        yield service, int(listener.getsockname()[1])
    finally:
        if server is not None:
            server.should_exit = True
        app_module.stop_upstream(upstream)
        rehydrate.stop()


def run_simulated(clones: int) -> None:
    import rehydrate

    app_module = _load("app")
    client = _load("client")
    key = "demo-key-0"
    os.environ.update({"API_KEY": key, "UPSTREAM_TOKEN": "demo-upstream-token"})
    with tempfile.TemporaryDirectory(prefix="rehydrate-demo-") as tmp:
        say("\n[1] cold start: load the model, start uvicorn and the upstream")
        t0 = time.monotonic()
        with _serving(app_module, Path(tmp)) as (_service, port):
            client.PORT = port
            first = _first_response(client, key)
            say(f"  first correct response after {time.monotonic() - t0:.1f} s "
                f"(instance {first['instance_id'][:8]})")
            for k in range(clones):
                new_key = f"demo-key-{k + 1}"
                say(f"\n[2.{k + 1}] simulated snapshot, then restore with a new API_KEY")
                rehydrate.simulate_snapshot()
                report = rehydrate.simulate_restore(env={"API_KEY": new_key},
                                                    reason="simulated")
                old = client.embed(key, ["restore me in a second"])
                new = client.embed(new_key, ["restore me in a second"])
                say(f"  old API key -> {old['status']}, new API key -> {new['status']}; "
                    f"instance {new['instance_id'][:8]}; embedding equal to the cold "
                    f"server's: {new['body']['embeddings'] == first['body']['embeddings']}")
                say(report.table())
                key = new_key


def _first_response(client: Any, key: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer: dict[str, Any] = client.embed(key, ["restore me in a second"])
            if answer["status"] == 200:
                return answer
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the server never answered")
        time.sleep(0.05)


def _clones(text: str) -> int:
    # int()'s ValueError made argparse say "invalid _clones value: 'abc'", naming this
    # function instead of what the option takes
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, not {text}")
    return n


def one_line(text: str, limit: int = 300) -> str:
    """The last non-empty line of ``text`` (where a runsc log or a server's traceback puts
    the cause), at most ``limit`` characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def runsc_unusable(sandboxed: Any) -> str | None:
    """Why this demo cannot use runsc here, in one line; None when it can."""
    if sys.platform.startswith("linux") and os.geteuid() != 0:
        return "runsc needs root; as root, `make demo` runs the server under gVisor"
    reason: str | None = sandboxed.runsc_available()
    return None if reason is None else one_line(reason) or "runsc failed its check"


def main(argv: list[str] | None = None) -> int:
    """Run the demo: 0 when it ran, 1 when it failed (one line on stderr: ``--verbose``
    adds the traceback), 130 when interrupted (Ctrl-C)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="never use runsc")
    parser.add_argument("--clones", type=_clones, default=2, help="clones to restore (>= 1)")
    parser.add_argument("--verbose", action="store_true",
                        help="print the traceback when the demo fails")
    args = parser.parse_args(argv)
    try:
        _run(args.simulate, args.clones)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        detail = str(exc)
        # A single line names the error type; several are a server's or runsc's output
        # (two nested tracebacks when printed whole), whose last line is the cause.
        summary = (one_line(detail) if "\n" in detail.strip()
                   else f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__)
        print(f"demo failed: {summary}" + ("" if args.verbose else
              " (examples/inference_server/demo.py --verbose prints the traceback)"),
              file=sys.stderr, flush=True)
        return 1
    return 0


def _run(simulate: bool, clones: int) -> None:
    say("rehydrate demo: an embedding server (FastAPI + all-MiniLM-L6-v2) snapshotted and "
        "restored into clones")
    if not simulate:
        sandboxed = _load("sandboxed")
        reason = runsc_unusable(sandboxed)
        if reason is None:
            run_gvisor(sandboxed, clones)
            return
        say(f"runsc unusable here ({reason}): running the same server in this process "
            "with a simulated restore instead")
    else:
        say("--simulate: running the server in this process with a simulated restore")
    run_simulated(clones)


if __name__ == "__main__":
    sys.exit(main())
