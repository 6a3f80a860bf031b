"""ReadinessGate when another process serves the control socket: the workers of
``uvicorn --workers N`` all read one ``$REHYDRATE_CONTROL_SOCKET``, only the first gets
it, and the others served across a snapshot ungated. Driven with real second processes
(a rehydrate process holding the socket, a real ``uvicorn --workers 2``). A holder that
lets the socket go within ``control_grace`` (the old worker of a reload) is waited for."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rehydrate.adapters.asgi import ReadinessGate
from rehydrate.detect.control import serving_peer
from rehydrate.testing import isolated_engine

REPO = Path(__file__).resolve().parents[2]

# A sibling worker: a real rehydrate process serving the control socket at argv[1].
_HOLDER = """
import sys
import rehydrate
from rehydrate.detect.control import ControlDetector
assert rehydrate.start([ControlDetector(sys.argv[1])]) == ["control"]
print("serving", flush=True)
sys.stdin.read()
"""

# A process that died without removing its socket (a worker restarted after a crash).
_DEAD = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen()
os._exit(0)
"""

_REFUSAL = ("rehydrate: another process (pid {pid}) serves the control socket {path}, so "
            "this one would not hear rehydrate notify and would serve across a snapshot "
            "ungated: run one server process per container (no --workers N, or --workers "
            "1) and scale with replicas; refusing to start")


@pytest.fixture
def sock(monkeypatch: pytest.MonkeyPatch, rehydrate_environ: None) -> Iterator[str]:
    """``$REHYDRATE_CONTROL_SOCKET`` in a short private directory (AF_UNIX paths are
    limited to 108 bytes)."""
    directory = tempfile.mkdtemp(prefix="rh-gw-")
    path = os.path.join(directory, "control.sock")
    monkeypatch.setenv("REHYDRATE_CONTROL_SOCKET", path)
    yield path
    shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def held(path: str) -> Iterator[subprocess.Popen[str]]:
    """Another rehydrate process serving ``path``; it exits when its stdin is closed."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, path], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "serving"
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)


class Lifespan:
    """One lifespan of ``gate`` driven as a server would, on the test's loop."""

    def __init__(self, gate: ReadinessGate) -> None:
        self.sent: list[dict[str, Any]] = []
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.changed = asyncio.Event()
        self.task = asyncio.ensure_future(
            gate({"type": "lifespan", "asgi": {"version": "3.0"}}, self.queue.get,
                 self._send))

    async def _send(self, message: Any) -> None:
        self.sent.append(dict(message))
        self.changed.set()

    async def startup(self) -> dict[str, Any]:
        """The gate's answer to ``lifespan.startup``."""
        self.queue.put_nowait({"type": "lifespan.startup"})
        await asyncio.wait_for(self.changed.wait(), 30)
        return self.sent[0]

    async def shutdown(self) -> None:
        self.queue.put_nowait({"type": "lifespan.shutdown"})
        await asyncio.wait_for(self.task, 30)


def _apps(events: list[str]) -> dict[str, Any]:
    """Applications of each kind the gate wraps; each records its own startup."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        events.append("app startup")
        yield

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        events.append("app startup")
        await send({"type": message["type"] + ".complete"})

    async def unaware(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"

    return {"starlette": Starlette(lifespan=lifespan), "bare": bare, "unaware": unaware}


@pytest.mark.parametrize("kind", ["starlette", "bare", "unaware"])
async def test_a_gate_whose_control_socket_another_process_serves_refuses_to_start(
        rehydrate_engine: Any, sock: str, kind: str) -> None:
    """Before: the second worker logged that its control detector could not start and
    served on — not drained by ``rehydrate notify save``, and admitting requests after
    the snapshot was prepared. Now its startup fails with one line saying why (the
    application's own startup does not run) and its detection is released — once the
    other process has served the socket for ``control_grace`` more seconds."""
    events: list[str] = []
    gate = ReadinessGate(_apps(events)[kind], engine=rehydrate_engine, control_grace=0.5)
    with held(sock) as holder:
        pid = holder.pid
        lifespan = Lifespan(gate)
        started = time.monotonic()
        answer = await lifespan.startup()
        assert time.monotonic() - started >= 0.5  # the grace was waited out first
        assert answer == {"type": "lifespan.startup.failed",
                          "message": _REFUSAL.format(pid=pid, path=sock)}
        await asyncio.wait_for(lifespan.task, 30)  # done: a server sends nothing more
        assert lifespan.sent == [answer]
        assert events == []
        assert not rehydrate_engine.started
        assert serving_peer(sock) == (pid, os.geteuid())  # the sibling still serves


class _Announced(logging.Handler):
    """Sets ``event`` (on ``loop``) when the gate logs that it waits for the socket."""

    def __init__(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        super().__init__(logging.WARNING)
        self.loop, self.event = loop, event

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting up to 30s for it to let the socket go" in record.getMessage():
            self.loop.call_soon_threadsafe(self.event.set)


async def test_a_socket_let_go_during_the_grace_is_taken_over(rehydrate_engine: Any,
                                                              sock: str) -> None:
    """A reload (gunicorn's ``HUP``) starts the new worker while the old one still serves
    the socket, finishing its requests. Refused at the first look, the new worker failed
    to boot and gunicorn's master exited: the reload shut the server down. Now the
    startup waits for the holder and, when it exits within ``control_grace``, serves the
    socket itself and starts."""
    events: list[str] = []
    gate = ReadinessGate(_apps(events)["starlette"], engine=rehydrate_engine,
                         control_grace=30)
    waiting = asyncio.Event()
    announced = _Announced(asyncio.get_running_loop(), waiting)
    logging.getLogger("rehydrate.adapters.asgi").addHandler(announced)
    try:
        with held(sock) as holder:
            lifespan = Lifespan(gate)
            answer = asyncio.ensure_future(lifespan.startup())
            seen = asyncio.ensure_future(waiting.wait())
            await asyncio.wait({answer, seen}, timeout=30,
                               return_when=asyncio.FIRST_COMPLETED)
            # the gate found the socket served, and waits: no answer to the server yet
            assert seen.done() and not answer.done(), lifespan.sent
            assert serving_peer(sock) == (holder.pid, os.geteuid())
            assert holder.stdin is not None
            holder.stdin.close()  # the old worker exits
            assert holder.wait(30) == 0
            assert await answer == {"type": "lifespan.startup.complete"}
    finally:
        logging.getLogger("rehydrate.adapters.asgi").removeHandler(announced)
    assert events == ["app startup"]
    assert rehydrate_engine.detector("control") is not None
    assert "control" not in rehydrate_engine.status(fields=()).extra.get(
        "detector_errors", {})
    assert serving_peer(sock) == (os.getpid(), os.geteuid())
    await lifespan.shutdown()
    assert not rehydrate_engine.started
    assert not os.path.exists(sock)


async def test_no_grace_refuses_at_once(rehydrate_engine: Any, sock: str) -> None:
    """``control_grace=0``: refused at the first look, without waiting."""
    gate = ReadinessGate(_apps([])["unaware"], engine=rehydrate_engine, control_grace=0)
    with held(sock) as holder:
        answer = await Lifespan(gate).startup()
        assert answer == {"type": "lifespan.startup.failed",
                          "message": _REFUSAL.format(pid=holder.pid, path=sock)}
        assert serving_peer(sock) == (holder.pid, os.geteuid())


async def test_a_socket_left_by_a_dead_process_is_taken_over(rehydrate_engine: Any,
                                                            sock: str) -> None:
    """A worker restarted after a crash finds its predecessor's socket file: nobody
    listens there, so its control detector replaces it and the gate starts."""
    subprocess.run([sys.executable, "-c", _DEAD, sock], check=True, timeout=30)
    assert os.path.exists(sock) and serving_peer(sock) is None
    lifespan = Lifespan(ReadinessGate(_apps([])["unaware"], engine=rehydrate_engine))
    assert await lifespan.startup() == {"type": "lifespan.startup.complete"}
    assert rehydrate_engine.detector("control") is not None
    assert serving_peer(sock) == (os.getpid(), os.geteuid())
    await lifespan.shutdown()
    assert not rehydrate_engine.started


async def test_two_engines_in_one_process_both_start(rehydrate_engine: Any, sock: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Two gates on two engines in one process: the second engine cannot have the
    socket, this same process serves it — its failure is logged, as before, and the
    server is not refused."""
    other = isolated_engine()
    try:
        first = Lifespan(ReadinessGate(_apps([])["unaware"], engine=rehydrate_engine))
        assert await first.startup() == {"type": "lifespan.startup.complete"}
        with caplog.at_level(logging.ERROR):
            second = Lifespan(ReadinessGate(_apps([])["unaware"], engine=other))
            assert await second.startup() == {"type": "lifespan.startup.complete"}
        assert any("detector control could not start" in r.getMessage()
                   for r in caplog.records)
        assert rehydrate_engine.detector("control") is not None
        assert other.started and other.detector("control") is None
        await second.shutdown()
        await first.shutdown()
    finally:
        other.close()


def _uvicorn(tmp_path: Path, sock: str, workers: int) -> subprocess.Popen[str]:
    (tmp_path / "gated_app.py").write_text(
        "from rehydrate.adapters.asgi import ReadinessGate\n"
        "async def api(scope, receive, send):\n"
        "    assert scope['type'] == 'http'\n"
        "app = ReadinessGate(api)\n")
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "gated_app:app", "--host", "127.0.0.1",
         "--port", "0", "--workers", str(workers)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}",
                           "REHYDRATE_CONTROL_SOCKET": sock},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_uvicorn_with_two_workers_refuses_and_one_worker_serves(tmp_path: Path,
                                                                sock: str) -> None:
    """The real ``uvicorn --workers 2``: one worker gets the socket, the other's startup
    waits ``control_grace`` (5 s by default) for it and then fails with the one line
    naming the cause, and uvicorn stops (rather than serve with a worker no snapshot
    drains). ``--workers 1`` starts and serves the socket."""
    proc = _uvicorn(tmp_path, sock, 2)
    try:
        assert proc.stdout is not None
        lines, waited, refused = [], 0.0, 0.0
        for line in proc.stdout:
            lines.append(line)
            if "waiting up to 5s for it to let the socket go" in line:
                waited = time.monotonic()
            elif "refusing to start" in line:
                refused = time.monotonic()
        proc.wait(60)
    finally:
        proc.kill()
    output = "".join(lines)
    assert waited and refused, output
    # the grace, and a margin for a loaded machine: two live workers are still refused
    assert 5 <= refused - waited < 5 + 20, output
    refusals = [line for line in output.splitlines() if "refusing to start" in line]
    assert len(refusals) == 1, output
    assert "another process (pid " in refusals[0] and f"control socket {sock}," in refusals[0]
    assert "--workers 1" in refusals[0]
    assert "Application startup failed" in output

    proc = _uvicorn(tmp_path, sock, 1)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Application startup complete" in line:
                break
        assert "Application startup complete" in lines[-1], "".join(lines)
        assert serving_peer(sock) == (proc.pid, os.geteuid())
    finally:
        proc.terminate()
        rest, _ = proc.communicate(timeout=30)
    # uvicorn raises the SIGTERM again once shut down: the status says terminated
    assert "Application shutdown complete" in rest, rest
