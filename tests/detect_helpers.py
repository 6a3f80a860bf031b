"""Shared helpers for the generic detector tests (not a test module)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import queue
import select
import subprocess
import sys
import threading
import time
import tty
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rehydrate.detect import Detector

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def threads_started() -> Iterator[list[str]]:
    """The names of the threads started inside the ``with`` block (``Thread.start`` is
    wrapped meanwhile): a restore must find the threads it needs already waiting."""
    started: list[str] = []
    real_start = threading.Thread.start

    def recording_start(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    threading.Thread.start = recording_start  # type: ignore[method-assign]
    try:
        yield started
    finally:
        threading.Thread.start = real_start  # type: ignore[method-assign]


def wait_for(cond: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``cond`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def hold_dead_detector_threads(monkeypatch: Any) -> threading.Event:
    """A detector thread that died stays alive (its ``failure()`` already reported) until
    the returned event is set: the moment a ``start()`` made as soon as the failure shows
    meets it still running. Set the event when done."""
    from rehydrate.detect import _util

    let_go = threading.Event()
    real_run = _util.DetectorThread._run

    def run_then_linger(thread: Any) -> None:
        real_run(thread)
        if thread.error is not None:
            let_go.wait(30)

    monkeypatch.setattr(_util.DetectorThread, "_run", run_then_linger)
    return let_go


class Recorder:
    """A restore (and snapshot) hook that records what it was told."""

    def __init__(self, engine: Any) -> None:
        self.calls: list[dict[str, Any]] = []
        self.snapshots: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        engine.registry.after_restore(self._restore, name="test.recorder")
        engine.registry.before_snapshot(self._snapshot, name="test.recorder-snap")

    def _restore(self, ctx: Any) -> None:
        with self._cond:
            self.calls.append({"reason": ctx.reason, "kind": ctx.kind,
                               "generation": ctx.generation, "frozen_for": ctx.frozen_for,
                               "at": time.monotonic()})
            self._cond.notify_all()

    def _snapshot(self, ctx: Any) -> None:
        with self._cond:
            self.snapshots.append({"reason": ctx.reason, "kind": ctx.kind})
            self._cond.notify_all()

    def wait(self, n: int = 1, timeout: float = 5.0) -> list[dict[str, Any]]:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.calls) >= n, timeout)
        assert ok, f"expected {n} restore hook call(s) within {timeout}s, got {self.calls}"
        return self.calls


class Child:
    """A Python child process that prints JSON lines; read them with deadlines."""

    def __init__(self, code: str, env: dict[str, str] | None = None) -> None:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=full_env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def next(self, timeout: float = 10.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child said nothing within {timeout}s") from None
        if line is None:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"child exited ({self.proc.wait()}): {err[-2000:]}")
        record: dict[str, Any] = json.loads(line)
        return record

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def in_forked_child(fn: Callable[[], dict[str, Any]], deadline: float = 10.0
                    ) -> dict[str, Any]:
    """Fork; run ``fn`` in the child and return the JSON-able dict it returned.

    The child dies by ``SIGALRM`` after ``deadline`` seconds instead of hanging the test,
    and by ``SIGKILL`` from the parent a little later (a child hung inside ``fork()``
    itself, in an at-fork handler, never sets its alarm); an exception in it fails the
    test with its repr. (A fork needs no interpreter the child may execute — tests that
    drop to uid 65534 rely on that.)
    """
    import select
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            signal.alarm(max(1, int(deadline)))
            os.write(w, json.dumps(fn()).encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(w, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    end = time.monotonic() + deadline + 5
    data = b""
    with os.fdopen(r, "rb", buffering=0) as fh:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fh], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                data += b" (killed: no end by the deadline)"
                break
            chunk = fh.read(65536)
            if not chunk:
                break
            data += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, (os.waitstatus_to_exitcode(status), data)
    result: dict[str, Any] = json.loads(data)
    return result


def slow_restore_hook(engine: Any) -> tuple[threading.Event, threading.Event, list[int]]:
    """An optional restore hook on ``engine`` that sets ``entered`` and blocks until
    ``release`` (at most 10 s): hooks that outlast a detector's window. Returns
    (entered, release, one entry per run of the hook)."""
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_hook() -> None:
        calls.append(1)
        entered.set()
        assert release.wait(10.0)

    engine.registry.after_restore(slow_hook, required=False, timeout=30)
    return entered, release, calls


def recorded_reports(engine: Any, monkeypatch: Any) -> list[Any]:
    """The reports of every ``restore_detected()`` call on ``engine``, in order."""
    reports: list[Any] = []
    real = engine.restore_detected

    def recording(*args: Any, **kwargs: Any) -> Any:
        report = real(*args, **kwargs)
        reports.append(report)
        return report

    monkeypatch.setattr(engine, "restore_detected", recording)
    return reports


class FakeSpecific(Detector):
    """A stand-in for a more specific detector (the gVisor waiter): the test fires it."""

    key = "fake-specific"
    specificity = 100

    def start(self, engine) -> None:  # type: ignore[no-untyped-def]
        self.engine = engine

    def stop(self) -> None:
        pass


class FakePlatform:
    """gVisor's side of a pty standing in for /proc/gvisor/checkpoint (``proc``/checkpoint):
    reads the ``1`` triggers, writes answers."""

    def __init__(self, proc: Path, reply: bytes | None = b"restore\n") -> None:
        self.master, self.slave = pty.openpty()
        tty.setraw(self.slave)  # no echo, no line discipline: bytes pass unchanged
        os.symlink(os.ttyname(self.slave), proc / "checkpoint")
        self.reply = reply
        self.triggers: list[bytes] = []
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self.master, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            data = os.read(self.master, 64)
            self.triggers.append(data)
            if self.reply is not None:
                os.write(self.master, self.reply)

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(5)
        for fd in (self.master, self.slave, self._stop_r, self._stop_w):
            os.close(fd)
