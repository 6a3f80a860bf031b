"""The control socket and ``rehydrate notify/status/trigger``, over real Unix sockets."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pty
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import tty
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from detect_helpers import in_forked_child, wait_for

from rehydrate import Lifecycle, Registry, detect
from rehydrate._control_client import ControlError, UntrustedSocket, find_socket, request
from rehydrate.detect import control
from rehydrate.detect.control import MAX_LINE, ControlDetector, ControlServer
from rehydrate.env import EnvRefresher

DEADLINE = 5.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # AF_UNIX paths are limited to 108 bytes: pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="rh-ctl-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def engine(rehydrate_environ: None) -> Iterator[Lifecycle]:
    eng = Lifecycle(Registry(), env=EnvRefresher(path=None))
    yield eng
    eng.close()


@pytest.fixture
def sock_path(short_dir: Path) -> str:
    return str(short_dir / "ctl.sock")


@pytest.fixture
def server(engine: Lifecycle, sock_path: str) -> ControlServer:
    det = ControlDetector(sock_path)
    assert engine.start([det]) == ["control"]
    assert det.server is not None
    return det.server


class Calls:
    def __init__(self, eng: Lifecycle) -> None:
        self.items: list[tuple[str, str, int, str]] = []

        @eng.registry.after_restore(name="rec")
        def on_restore(ctx):  # type: ignore[no-untyped-def]
            self.items.append(("restore-hook", ctx.kind, ctx.generation, ctx.reason))

        @eng.registry.before_snapshot(name="rec-snap")
        def on_snapshot(ctx):  # type: ignore[no-untyped-def]
            self.items.append(("snapshot-hook", ctx.kind, ctx.generation, ctx.reason))


class Conn:
    """A raw client: send bytes, read reply lines."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(DEADLINE)
        self.sock.connect(path)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> dict:  # type: ignore[type-arg]
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError(self.buf)
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, obj: object) -> dict:  # type: ignore[type-arg]
        self.send(json.dumps(obj).encode() + b"\n")
        return self.reply()

    def close(self) -> None:
        self.sock.close()


# -- socket setup ------------------------------------------------------------------------


def test_socket_is_0600_and_created_dirs_0700(engine: Lifecycle, short_dir: Path) -> None:
    """Every directory created for the socket is 0700, not just the last one: the
    parents got the umask's 0755 (``os.makedirs(mode=)`` applies to the leaf only)."""
    path = short_dir / "sub" / "dir" / "ctl.sock"
    det = ControlDetector(str(path))
    umask = os.umask(0o022)
    try:
        engine.start([det])
    finally:
        os.umask(umask)
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(short_dir / "sub").st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["ctl.sock"]  # no temp name left
    engine.stop()
    assert not path.exists()  # removed on stop


def test_control_listed_twice_serves_once_without_an_error(
        engine: Lifecycle, sock_path: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """``start(["control", "control"])`` started a second server that found the first
    one's socket live: an ERROR that another process — this one — serves it, and a
    ``detector_errors`` entry for a detector that runs."""
    monkeypatch.setenv("REHYDRATE_CONTROL_SOCKET", sock_path)
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert engine.start(["control", "control"]) == ["control"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "detector_errors" not in engine.status().extra
    assert request("status", socket_path=sock_path)["ok"] is True
    engine.stop()
    assert not os.path.exists(sock_path)


def test_two_control_detectors_on_different_paths_both_serve(
        engine: Lifecycle, short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two instances of one key were taken for a repeat: the second socket never served."""
    one, two = str(short_dir / "one.sock"), str(short_dir / "two.sock")
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        assert engine.start([ControlDetector(one), ControlDetector(two)]) \
            == ["control", "control"]
    assert "more than once" not in caplog.text
    assert request("status", socket_path=one)["ok"] is True
    assert request("status", socket_path=two)["ok"] is True
    engine.stop()
    assert not os.path.exists(one) and not os.path.exists(two)


def test_a_dotdot_path_through_a_missing_directory_binds_where_it_was_created(
        engine: Lifecycle, short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``a/missing/../ctl.sock``: the directories were made for the normalised path (``a``)
    but bind() used the raw one, through ``a/missing``: ``[Errno 2] No such file or
    directory`` and no server. The client reaching the same variable finds it too."""
    raw = str(short_dir / "a" / "missing" / ".." / "ctl.sock")
    monkeypatch.setenv("REHYDRATE_CONTROL_SOCKET", raw)
    assert engine.start(["control"]) == ["control"]
    assert "detector_errors" not in engine.status().to_dict()
    assert stat.S_ISSOCK(os.stat(short_dir / "a" / "ctl.sock").st_mode)
    assert not (short_dir / "a" / "missing").exists()
    assert request("status")["ok"] is True  # $REHYDRATE_CONTROL_SOCKET, as given
    engine.stop()
    assert not (short_dir / "a" / "ctl.sock").exists()


def test_a_bind_failure_names_the_path(engine: Lifecycle, short_dir: Path) -> None:
    """bind()'s errors name no path ("AF_UNIX path too long", "[Errno 2] ..."): the
    start error in the log and in status did not say which socket failed."""
    path = str(short_dir / ("d" * 120) / "ctl.sock")
    assert engine.start([ControlDetector(path)]) == []
    error = engine.status().to_dict()["detector_errors"]["control"]
    assert error.startswith(f"cannot listen at {path}: "), error


def test_stale_socket_replaced_live_one_and_plain_file_refused(
    engine: Lifecycle, short_dir: Path
) -> None:
    path = short_dir / "ctl.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # a socket file nobody listens on
    first = ControlServer(engine, str(path))
    first.start()
    try:
        assert request("status", socket_path=str(path))["ok"]
        second = ControlServer(engine, str(path))
        with pytest.raises(FileExistsError, match="another process"):
            second.start()
        assert request("status", socket_path=str(path))["ok"]  # the first one still serves
    finally:
        first.stop()
    plain = short_dir / "plain"
    plain.write_text("keep me")
    with pytest.raises(FileExistsError, match="not a socket"):
        ControlServer(engine, str(plain)).start()
    assert plain.read_text() == "keep me"


def test_auto_start_only_with_the_environment_variable(
    monkeypatch: pytest.MonkeyPatch, sock_path: str
) -> None:
    monkeypatch.delenv("REHYDRATE_CONTROL_SOCKET", raising=False)
    assert "control" not in [d.key for d in detect.select("auto")]
    info = {i.name: i for i in detect.available()}["control"]
    assert info.usable and not info.auto and "REHYDRATE_CONTROL_SOCKET" in info.reason
    monkeypatch.setenv("REHYDRATE_CONTROL_SOCKET", sock_path)
    assert "control" in [d.key for d in detect.select("auto")]
    info = {i.name: i for i in detect.available()}["control"]
    assert info.usable and info.auto


# -- commands ----------------------------------------------------------------------------


def test_status(server: ControlServer, engine: Lifecycle, sock_path: str) -> None:
    reply = request("status", socket_path=sock_path)
    assert reply["ok"] and reply["pid"] == os.getpid()
    status = reply["status"]
    for key in ("state", "generation", "ready", "detectors", "last_report"):
        assert key in status
    assert status["state"] == "running" and status["generation"] == 0
    assert status["detectors"] == ["control"]
    assert status["control"]["socket"] == sock_path
    engine.simulate_restore()
    status = request("status", socket_path=sock_path)["status"]
    assert status["generation"] == 1 and status["last_report"]["reason"] == "simulated"


def test_prepare_snapshot_replies_after_hooks(server: ControlServer, engine: Lifecycle,
                                              sock_path: str) -> None:
    calls = Calls(engine)
    release = threading.Event()

    @engine.registry.before_snapshot(name="slow")
    def slow() -> None:
        release.wait(DEADLINE)

    result: dict = {}  # type: ignore[type-arg]
    t = threading.Thread(target=lambda: result.update(
        request("prepare-snapshot", socket_path=sock_path, id=7)))
    t.start()
    time.sleep(0.1)  # the reply must not come while a hook still runs
    assert result == {}
    release.set()
    t.join(DEADLINE)
    assert result["ok"] and result["id"] == 7
    assert result["report"]["event"] == "snapshot"
    assert {h["name"] for h in result["report"]["hooks"]} == {"slow", "rec-snap",
                                                               "rehydrate.files.audit"}
    assert calls.items == [("snapshot-hook", "snapshot", 0, "control")]


def test_prepare_snapshot_failure_runs_resume_hooks(server: ControlServer, engine: Lifecycle,
                                                    sock_path: str) -> None:
    calls = Calls(engine)

    @engine.registry.before_snapshot(name="flush-db")
    def flush() -> None:
        raise RuntimeError("disk full")

    reply = request("prepare-snapshot", socket_path=sock_path)
    assert reply["ok"] is False
    assert "flush-db" in reply["error"]
    assert reply["resume_report"]["kind"] == "resume"
    # The platform aborts before pausing anything: the run says nothing froze (it said
    # None, "not known", like a real resume, and the game's tick clock jumped).
    assert reply["resume_report"]["frozen_for"] == 0.0
    assert ("restore-hook", "resume", 0, "control") in calls.items


def test_restore_and_resume(server: ControlServer, engine: Lifecycle, sock_path: str) -> None:
    calls = Calls(engine)
    reply = request("restore", socket_path=sock_path)
    assert reply["ok"] and reply["report"]["kind"] == "restore"
    assert reply["report"]["reason"] == "control" and reply["report"]["generation"] == 1
    reply = request("resume", socket_path=sock_path)
    assert reply["ok"] and reply["report"]["kind"] == "resume"
    # A real resume (after a checkpoint left running): frozen, for how long not known.
    assert reply["report"]["frozen_for"] is None
    assert calls.items == [("restore-hook", "restore", 1, "control"),
                           ("restore-hook", "resume", 1, "control")]


def test_failed_restore_hook_makes_reply_not_ok(server: ControlServer, engine: Lifecycle,
                                               sock_path: str) -> None:
    @engine.registry.after_restore(name="reconnect")
    def reconnect() -> None:
        raise ConnectionError("db down")

    reply = request("restore", socket_path=sock_path)
    assert reply["ok"] is False and "reconnect" in reply["error"]


def test_restore_notice_after_clock_jump_runs_hooks_once(
    server: ControlServer, engine: Lifecycle, sock_path: str
) -> None:
    calls = Calls(engine)
    assert request("prepare-snapshot", socket_path=sock_path)["ok"]
    # ... frozen, restored: the clock-jump detector notices first (its last wake-up
    # was before the freeze) ...
    engine.restore_detected("clock-jump", since=time.monotonic() - 0.5)
    # ... then the platform's `rehydrate notify restore` arrives.
    reply = request("restore", socket_path=sock_path)
    assert reply["ok"] and reply["report"]["reason"] == "clock-jump"
    assert [c[:3] for c in calls.items if c[0] == "restore-hook"] == [
        ("restore-hook", "restore", 1)]
    # A later restore (a clone of the clone, no prepare-snapshot) is a new event.
    reply = request("restore", socket_path=sock_path)
    assert reply["report"]["generation"] == 2 and reply["report"]["reason"] == "control"
    reply = request("restore", socket_path=sock_path)
    assert reply["report"]["generation"] == 3


def test_simulate(server: ControlServer, engine: Lifecycle, sock_path: str,
                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="rehydrate")
    reply = request("simulate", socket_path=sock_path,
                    env={"REHYDRATE_T_SECRET": "hunter2-value", "REHYDRATE_T_GONE": None})
    assert reply["ok"] and reply["report"]["reason"] == "simulated"
    assert reply["report"]["env_changes"]["added"] == ["REHYDRATE_T_SECRET"]
    assert os.environ["REHYDRATE_T_SECRET"] == "hunter2-value"
    assert "hunter2-value" not in caplog.text
    assert request("simulate", socket_path=sock_path, event="snapshot")["report"]["event"] == \
        "snapshot"
    bad = request("simulate", socket_path=sock_path, env={"A": 1})
    assert not bad["ok"] and "env" in bad["error"]
    bad = request("simulate", socket_path=sock_path, event="explode")
    assert not bad["ok"] and "event" in bad["error"]
    before = (engine.state, engine.generation)
    bad = request("simulate", socket_path=sock_path, env={"A": "lone \ud800"})
    assert not bad["ok"] and bad["error"].startswith("bad request"), bad
    assert (engine.state, engine.generation) == before  # nothing ran


@contextlib.contextmanager
def fake_checkpoint(proc: Path, answer: bytes, timeout: float) -> Iterator[None]:
    """``proc/checkpoint`` is a pty, as gVisor's; while inside, the platform side reads
    the "1" a trigger writes and answers ``answer``."""
    proc.mkdir()
    master, slave = pty.openpty()
    tty.setraw(slave)
    os.symlink(os.ttyname(slave), proc / "checkpoint")

    def platform() -> None:
        ready, _, _ = select.select([master], [], [], timeout)
        if ready and os.read(master, 8) == b"1":
            os.write(master, answer + b"\n")

    t = threading.Thread(target=platform)
    t.start()
    try:
        yield
    finally:
        t.join(timeout)
        os.close(master)
        os.close(slave)


def test_trigger_through_the_socket(server: ControlServer, engine: Lifecycle, sock_path: str,
                                    short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = short_dir / "gvisor"
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(proc))
    with fake_checkpoint(proc, b"resume", DEADLINE):
        reply = request("trigger", socket_path=sock_path, timeout=DEADLINE)
    assert reply["ok"] and reply["answer"] == "resume"
    assert reply["report"]["kind"] == "resume"
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(short_dir / "missing"))
    reply = request("trigger", socket_path=sock_path)
    assert not reply["ok"] and "not found" in reply["error"]


# -- bad input ---------------------------------------------------------------------------


def test_garbage_json_gets_error_and_connection_keeps_serving(server: ControlServer,
                                                              sock_path: str) -> None:
    c = Conn(sock_path)
    try:
        for garbage in (b"this is not json\n", b"{\"cmd\": \n", b"\xff\xfe\x00\n",
                        b"[1, 2]\n", b"{\"nocmd\": 1}\n", b"{\"cmd\": 5}\n"):
            c.send(garbage)
            reply = c.reply()
            assert reply["ok"] is False and reply["error"].startswith("bad request"), garbage
            if garbage.startswith(b"\xff"):  # json.loads guessed UTF-16 from these bytes
                assert reply["error"] == "bad request: not UTF-8 (byte 0xff at 0)", reply
        assert c.ask({"cmd": "status"})["ok"]
    finally:
        c.close()


def test_a_bad_trigger_timeout_is_refused_before_anything_runs(
        server: ControlServer, engine: Lifecycle, sock_path: str, short_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN, infinity, a bool, a string, a negative or absurd number: a bad request, before
    any before-snapshot hook runs or anything is written to the checkpoint file."""
    proc = short_dir / "gvisor"
    proc.mkdir()
    (proc / "checkpoint").write_text("")
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(proc))
    ran: list[int] = []
    engine.registry.before_snapshot(name="app")(lambda: ran.append(1))
    c = Conn(sock_path)
    try:
        for bad in (b"NaN", b"Infinity", b"true", b"-1", b"1e12", b'"5"'):
            c.send(b'{"cmd": "trigger", "timeout": ' + bad + b"}\n")
            reply = c.reply()
            assert reply["ok"] is False, (bad, reply)
            assert reply["error"].startswith(
                'bad request: "timeout" must be a number of seconds > 0 and at most'), (bad, reply)
    finally:
        c.close()
    assert ran == [] and (proc / "checkpoint").read_text() == ""


def test_a_failing_command_is_not_called_bad_json(server: ControlServer, engine: Lifecycle,
                                                  sock_path: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("something inside the command")

    monkeypatch.setattr(engine, "status", broken)
    c = Conn(sock_path)
    try:
        reply = c.ask({"cmd": "status"})
    finally:
        c.close()
    assert reply["ok"] is False and "not valid JSON" not in reply["error"]
    assert "something inside the command" in reply["error"]


def test_status_json_prints_a_failed_reply_on_stdout(server: ControlServer, engine: Lifecycle,
                                                     sock_path: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``status --json`` printed nothing on stdout when the process answered
    ``ok: false`` (``notify --json`` and ``trigger --json`` did): a script parsing stdout
    got empty input."""
    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("something inside the command")

    monkeypatch.setattr(engine, "status", broken)
    r = cli("status", "--json", "--socket", sock_path)
    assert r.returncode == 1
    assert json.loads(r.stdout) == {"ok": False,
                                    "error": "ValueError: something inside the command"}
    assert r.stderr.strip().splitlines() == [
        "rehydrate: status: ValueError: something inside the command"]


def test_unknown_command(server: ControlServer, sock_path: str) -> None:
    reply = request("reboot", socket_path=sock_path, id="x1")
    assert reply == {"ok": False, "id": "x1",
                     "error": "bad request: unknown command 'reboot' (known: status, "
                              "prepare-snapshot, resume, restore, simulate, trigger)"}


@pytest.mark.parametrize("req_id", [None, False, 0, "", [1, {"a": None}], {"k": [None]}],
                         ids=["null", "false", "0", "empty", "list", "object"])
def test_any_json_request_id_is_echoed_null_too(server: ControlServer, sock_path: str,
                                                 req_id: object) -> None:
    """``"id": null`` got a reply without ``"id"``: the docs say any JSON value is echoed,
    and a client matching replies by id found none. A request without one gets none."""
    c = Conn(sock_path)
    try:
        assert c.ask({"cmd": "status", "id": req_id})["id"] == req_id
        assert c.ask({"cmd": "nope", "id": req_id})["id"] == req_id  # an error reply too
        assert "id" not in c.ask({"cmd": "status"})
        budget = c.ask({"cmd": "prepare-snapshot", "budget": True, "id": req_id})
        assert budget["pending"] is True and budget["id"] == req_id
        reply = c.reply()
        assert reply["ok"] is True and reply["id"] == req_id
        assert c.ask({"cmd": "resume", "id": req_id})["id"] == req_id
    finally:
        c.close()


@pytest.mark.parametrize("bad", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_non_finite_request_id_gets_a_strict_json_reply(server: ControlServer,
                                                          sock_path: str, bad: bytes) -> None:
    """Before: the id was echoed as ``NaN``, which a strict JSON parser refuses."""
    c = Conn(sock_path)
    try:
        c.send(b'{"cmd": "status", "id": ' + bad + b"}\n")
        while b"\n" not in c.buf:
            chunk = c.sock.recv(65536)
            assert chunk, c.buf
            c.buf += chunk
    finally:
        c.close()
    raw = c.buf.split(b"\n", 1)[0]
    reply = json.loads(raw, parse_constant=lambda name: pytest.fail(f"{name} in {raw!r}"))
    assert reply == {"ok": False,
                     "error": 'bad request: "id" must be a string or a finite number'}


def test_oversize_line_refused_and_server_keeps_serving(server: ControlServer,
                                                       sock_path: str) -> None:
    c = Conn(sock_path)
    try:
        big = b'{"cmd": "status", "pad": "' + b"x" * (MAX_LINE + 10_000) + b'"}\n'
        c.send(big + b'{"cmd": "status"}\n')
        first = c.reply()
        assert first["ok"] is False and "too large" in first["error"]
        assert c.reply()["ok"]  # the next request on the same connection works
    finally:
        c.close()
    # A huge line with no newline at all, then the client leaves.
    c = Conn(sock_path)
    c.send(b"y" * (3 * MAX_LINE))
    assert "too large" in c.reply()["error"]
    c.close()
    assert request("status", socket_path=sock_path)["ok"]


def test_line_exactly_at_the_limit_is_accepted(server: ControlServer, sock_path: str) -> None:
    head = b'{"cmd": "status", "pad": "'
    line = head + b"x" * (MAX_LINE - len(head) - 2) + b'"}'
    assert len(line) == MAX_LINE
    c = Conn(sock_path)
    try:
        c.send(line + b"\n")
        assert c.reply()["ok"]
    finally:
        c.close()


def test_client_disconnecting_mid_request(server: ControlServer, sock_path: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rehydrate")
    c = Conn(sock_path)
    c.send(b'{"cmd": "sta')
    c.sock.shutdown(socket.SHUT_WR)  # end of input before the newline: still readable
    reply = c.reply()
    assert reply["ok"] is False and "incomplete request" in reply["error"]
    c.close()
    c = Conn(sock_path)
    c.send(b'{"cmd": "restore"')  # and gone for good: nothing runs
    c.close()
    wait_for(lambda: len([r for r in caplog.records if "mid-request" in r.getMessage()]) == 2,
             what="the log lines")
    assert request("status", socket_path=sock_path)["status"]["generation"] == 0


def test_prepare_client_gone_before_reply_runs_resume_hooks(
    server: ControlServer, engine: Lifecycle, sock_path: str
) -> None:
    calls = Calls(engine)
    started, release = threading.Event(), threading.Event()

    @engine.registry.before_snapshot(name="slow")
    def slow() -> None:
        started.set()
        release.wait(DEADLINE)

    c = Conn(sock_path)
    c.send(b'{"cmd": "prepare-snapshot"}\n')
    assert started.wait(DEADLINE)
    c.close()  # the platform's timeout killed `rehydrate notify save`
    release.set()
    wait_for(lambda: ("restore-hook", "resume", 0, "control") in calls.items,
             what="the resume hooks")
    # the run's report is published a moment after its hooks (and readiness)
    wait_for(lambda: getattr(engine.status().last_report, "kind", None) == "resume",
             what="the resume run's report")
    status = request("status", socket_path=sock_path)
    assert status["ok"]
    assert status["status"]["last_report"]["frozen_for"] == 0.0, "nothing froze"


def test_concurrent_clients(server: ControlServer, engine: Lifecycle, sock_path: str) -> None:
    n = 12
    replies: list[dict] = []  # type: ignore[type-arg]
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def client(i: int) -> None:
        try:
            barrier.wait(DEADLINE)
            cmd = "simulate" if i % 2 else "status"
            replies.append(request(cmd, socket_path=sock_path, id=i))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE * 2)
    assert not errors
    assert sorted(r["id"] for r in replies) == list(range(n))
    assert all(r["ok"] for r in replies)
    assert engine.status().generation == n // 2  # every simulated restore ran, one at a time


def _client_as_nobody(path: str) -> dict:  # type: ignore[type-arg]
    """Fork a child that drops to uid/gid 65534, connects, asks for status."""

    def client() -> dict:  # type: ignore[type-arg]
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(path)
        except OSError as exc:
            return {"connect_error": exc.errno}
        s.sendall(b'{"cmd": "status"}\n')
        data = b""
        while b"\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        return {"reply": data.decode(), "closed": s.recv(4096) == b"", "uid": os.getuid()}

    return in_forked_child(client)


@pytest.mark.root
def test_other_uid_is_refused(root_required: None, server: ControlServer, sock_path: str,
                              short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rehydrate")
    os.chmod(short_dir, 0o755)  # let uid 65534 reach the socket's directory

    def as_nobody() -> dict:  # type: ignore[type-arg]
        return _client_as_nobody(sock_path)

    # Mode 0600: the kernel refuses the connection outright.
    assert as_nobody() == {"connect_error": 13}
    # Even if the socket's mode were loosened, SO_PEERCRED refuses the client.
    os.chmod(sock_path, 0o666)
    out = as_nobody()
    reply = json.loads(out["reply"])
    assert reply["ok"] is False and "permission denied: uid 65534" in reply["error"]
    assert out["closed"] and out["uid"] == 65534
    assert server.refused == 1
    assert any("refused a client with uid 65534" in r.getMessage() for r in caplog.records)
    assert request("status", socket_path=sock_path)["ok"]  # root (same uid) still served


# -- the client trusts only a server of its own uid or root -----------------------------


class ForeignServer:
    """A server run by uid 65534 (a forked child drops to it before it listens) that
    answers ``{"ok": true}`` to anything, and reports what each connection sent."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "evil.sock")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: serve until killed
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.bind(self.path)
                s.listen(8)
                os.write(w, b'{"ready": true}\n')
                while True:
                    c, _ = s.accept()
                    c.settimeout(DEADLINE)
                    data = b""
                    try:
                        while b"\n" not in data:
                            chunk = c.recv(4096)
                            if not chunk:
                                break
                            data += chunk
                        c.sendall(b'{"ok": true, "report": {"event": "snapshot", "ok": true}}\n')
                    except OSError:
                        pass
                    c.close()
                    os.write(w, json.dumps({"received": data.decode(errors="replace")})
                             .encode() + b"\n")
            finally:
                os._exit(1)
        os.close(w)
        self.pid = pid
        self._pipe = r
        self._buf = b""
        assert self._next() == {"ready": True}

    def _next(self) -> dict:  # type: ignore[type-arg]
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._pipe], [], [], DEADLINE)
            assert ready, "the foreign server said nothing"
            chunk = os.read(self._pipe, 4096)
            assert chunk, "the foreign server died"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]

    def close(self) -> list[dict]:  # type: ignore[type-arg]
        """Stop the server; what each connection before this call sent."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a last one, as
                s.settimeout(DEADLINE)  # a marker: the records before it are complete
                s.connect(self.path)
                s.sendall(b"end\n")
                s.recv(4096)
            records = []
            while (rec := self._next()) != {"received": "end\n"}:
                records.append(rec)
            return records
        finally:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
            os.close(self._pipe)


@pytest.fixture
def foreign_dir(root_required: None, short_dir: Path) -> Path:
    """``<short_dir>/rehydrate``, owned by uid 65534 and writable by all: the default
    socket directory when ``XDG_RUNTIME_DIR`` is ``short_dir``."""
    os.chmod(short_dir, 0o755)
    d = short_dir / "rehydrate"
    d.mkdir()
    os.chown(d, 65534, 65534)
    os.chmod(d, 0o777)
    return d


@pytest.mark.root
def test_client_refuses_a_server_of_another_uid(foreign_dir: Path) -> None:
    srv = ForeignServer(foreign_dir)
    try:
        r = cli("notify", "save", "--socket", srv.path)
        assert r.returncode == 4, (r.stdout, r.stderr)
        assert r.stdout == ""
        assert "served by uid 65534" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        r = cli("status", env={"REHYDRATE_CONTROL_SOCKET": srv.path})
        assert r.returncode == 4 and "served by uid 65534" in r.stderr
        with pytest.raises(UntrustedSocket, match="served by uid 65534"):
            request("prepare-snapshot", socket_path=srv.path)
    finally:
        records = srv.close()
    assert records == [{"received": ""}] * 3  # it connected, then sent nothing


@pytest.mark.root
def test_client_refuses_a_default_dir_of_another_uid(foreign_dir: Path,
                                                     short_dir: Path) -> None:
    """The reviewer's repro: root's ``notify save`` found uid 65534's socket in the
    default directory and exited 0 without any hook having run."""
    srv = ForeignServer(foreign_dir)
    env = {"XDG_RUNTIME_DIR": str(short_dir)}
    try:
        r = cli("notify", "save", env=env)
        assert r.returncode == 4, (r.stdout, r.stderr)
        assert "found uid 65534, mode 0777" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        os.chmod(foreign_dir, 0o700)  # private, but someone else's
        r = cli("notify", "save", env=env)
        assert r.returncode == 4 and "found uid 65534, mode 0700" in r.stderr
    finally:
        records = srv.close()
    assert records == []  # never contacted


def test_client_finds_a_socket_only_in_a_private_default_dir(
    engine: Lifecycle, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REHYDRATE_CONTROL_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_dir))
    calls = Calls(engine)
    assert engine.start([ControlDetector()]) == ["control"]  # <short_dir>/rehydrate/<pid>.sock
    env = {"XDG_RUNTIME_DIR": str(short_dir)}
    r = cli("notify", "save", env=env)
    assert r.returncode == 0, r.stderr
    assert calls.items[-1][0] == "snapshot-hook"
    n = len(calls.items)
    os.chmod(short_dir / "rehydrate", 0o755)
    try:
        r = cli("notify", "save", env=env)
    finally:
        os.chmod(short_dir / "rehydrate", 0o700)
    assert r.returncode == 4, (r.stdout, r.stderr)
    assert "mode 0755" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert len(calls.items) == n


# -- the CLI -----------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items()
            if k not in ("GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE", "CRTOOLS_SCRIPT_ACTION",
                         "REHYDRATE_CONTROL_SOCKET")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "rehydrate", *args], env=full, cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)


def test_notify_cli_exit_codes(server: ControlServer, engine: Lifecycle, sock_path: str,
                               short_dir: Path) -> None:
    calls = Calls(engine)
    env = {"REHYDRATE_CONTROL_SOCKET": sock_path}

    r = cli("notify", "save", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("save: ok")
    assert calls.items[-1][:2] == ("snapshot-hook", "snapshot")

    r = cli("notify", env={**env, "GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE": "restore"})
    assert r.returncode == 0, r.stderr
    assert calls.items[-1][:3] == ("restore-hook", "restore", 1)

    r = cli("notify", "--json", env={**env, "GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE": "resume"})
    assert r.returncode == 0 and json.loads(r.stdout)["report"]["kind"] == "resume"

    r = cli("notify", env={**env, "CRTOOLS_SCRIPT_ACTION": "pre-dump"})
    assert r.returncode == 0 and calls.items[-1][0] == "snapshot-hook"
    n = len(calls.items)
    r = cli("notify", env={**env, "CRTOOLS_SCRIPT_ACTION": "post-resume"})
    assert r.returncode == 0 and calls.items[-1][:3] == ("restore-hook", "restore", 2)
    assert len(calls.items) == n + 1

    served = server.served
    for action in ("post-restore", "pre-restore", "network-lock",
                   "network-unlock", "setup-namespaces"):
        r = cli("notify", env={**env, "CRTOOLS_SCRIPT_ACTION": action})
        assert r.returncode == 0 and r.stdout == "", (action, r.stderr)
    # ... even with no process to reach, and without contacting the running one.
    r = cli("notify", env={"REHYDRATE_CONTROL_SOCKET": str(short_dir / "none.sock"),
                           "CRTOOLS_SCRIPT_ACTION": "post-dump"})
    assert r.returncode == 0
    assert server.served == served

    r = cli("notify", env={**env, "GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE": "explode"})
    # the variable named, its value not repeated (environment values never are)
    assert r.returncode == 2 and "GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE is not save" in r.stderr
    assert "explode" not in r.stderr
    r = cli("notify", env=env)
    assert r.returncode == 2


def test_notify_save_with_failing_required_hook_exits_nonzero(
    server: ControlServer, engine: Lifecycle, sock_path: str
) -> None:
    @engine.registry.before_snapshot(name="close-db", required=True)
    def close_db() -> None:
        raise RuntimeError("still in a transaction")

    r = cli("notify", env={"REHYDRATE_CONTROL_SOCKET": sock_path,
                           "GVISOR_SAVE_RESTORE_AUTO_EXEC_MODE": "save"})
    assert r.returncode == 1
    assert "close-db" in r.stderr and len(r.stderr.strip().splitlines()) == 1

    @engine.registry.before_snapshot(name="optional", required=False)
    def optional() -> None:
        raise RuntimeError("meh")

    engine.registry.unregister("close-db")
    r = cli("notify", "save", "--socket", sock_path)
    assert r.returncode == 0, r.stderr


def test_notify_unreachable(short_dir: Path) -> None:
    r = cli("notify", "restore", "--socket", str(short_dir / "nobody.sock"), "--timeout", "2")
    assert r.returncode == 3
    assert "cannot reach" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_status_cli(server: ControlServer, engine: Lifecycle, sock_path: str) -> None:
    engine.simulate_restore()
    r = cli("status", "--json", env={"REHYDRATE_CONTROL_SOCKET": sock_path})
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    expected = engine.status().to_dict()
    for key in ("state", "generation", "ready", "detectors", "last_report"):
        assert data[key] == json.loads(json.dumps(expected[key]))
    r = cli("status", "--socket", sock_path)
    assert r.returncode == 0 and "generation:  1" in r.stdout and "state:       ready" in r.stdout


def test_trigger_cli(server: ControlServer, engine: Lifecycle, sock_path: str,
                     short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = short_dir / "gvisor"
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(proc))  # read by the serving process
    with fake_checkpoint(proc, b"restore", 30):
        r = cli("trigger", "--socket", sock_path, "--timeout", "30")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "restore"
    assert engine.status().generation == 1
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(short_dir / "missing"))
    r = cli("trigger", "--socket", sock_path)
    assert r.returncode == 1 and "not found" in r.stderr


def test_doctor_lists_gvisor_and_control() -> None:
    r = cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    rows = {d["name"]: d for d in json.loads(r.stdout)["detectors"]}
    assert rows["gvisor"]["reason"]
    assert rows["control"]["reason"]
    if not os.path.exists("/proc/gvisor/checkpoint"):
        assert not rows["gvisor"]["usable"] and "gVisor" in rows["gvisor"]["reason"]
    r = cli("doctor")
    assert "gvisor" in r.stdout and "control" in r.stdout


def test_a_path_that_is_not_a_socket_is_named_as_such(short_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    regular = short_dir / "regular"
    regular.write_text("")
    for path, kind in ((regular, "a regular file"), (short_dir, "a directory")):
        with pytest.raises(ControlError, match=f"exists and is {kind}, not a socket"):
            request("status", socket_path=str(path))
        monkeypatch.setenv("REHYDRATE_CONTROL_SOCKET", str(path))
        probe = ControlDetector.probe()
        assert not probe.usable and f"exists and is {kind}" in probe.reason, probe


def test_request_client_errors(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REHYDRATE_CONTROL_SOCKET", raising=False)
    with pytest.raises(ControlError, match="cannot reach"):
        request("status", socket_path=str(short_dir / "x.sock"))
    # A server that accepts and never answers: the client's timeout applies.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(short_dir / "mute.sock"))
    listener.listen(1)
    try:
        with pytest.raises(ControlError, match="no reply"):
            request("status", socket_path=str(short_dir / "mute.sock"), timeout=0.3)
    finally:
        listener.close()


# -- review fixes: which earlier runs a notice may be a duplicate of -----------------------


def test_restore_only_the_clock_saw_does_not_hide_a_later_notify_restore(
    server: ControlServer, engine: Lifecycle, sock_path: str
) -> None:
    calls = Calls(engine)
    # Restore #1, noticed only by the clock jump (no prepare-snapshot on this socket).
    engine.restore_detected("clock-jump", since=time.monotonic())
    # Later: a short freeze (no clock jump) and the operator's `notify restore`.
    reply = request("restore", socket_path=sock_path)
    assert (reply["report"]["reason"], reply["report"]["generation"]) == ("control", 2)
    assert [c[3] for c in calls.items] == ["clock-jump", "control"]


def test_notify_restore_with_a_blind_freeze_watch_is_a_new_restore_after_the_window(
    server: ControlServer, engine: Lifecycle, sock_path: str
) -> None:
    """Before: a freeze watch that sees no freeze (the guest clock carried over, as on
    Firecracker) answered its first heartbeat, so every ``notify restore`` after the
    first only confirmed it: clone B kept clone A's keys and said ready. A run more than
    the window (2 s) before the notice is not its restore; one within it still is."""
    calls = Calls(engine)
    now = time.monotonic()
    engine.heartbeat(now - 10, 30.0)  # the watch began; it never sees a gap
    engine.restore_detected("control", since=now - 4, detected_at=now - 3)  # clone A
    engine.heartbeat(time.monotonic(), 30.0)
    reply = request("restore", socket_path=sock_path)  # clone B
    assert not reply["deduplicated"] and reply["report"]["generation"] == 2
    # the platform's duplicate of B's notice, moments later
    reply = request("restore", socket_path=sock_path)
    assert reply["deduplicated"] and reply["report"]["generation"] == 2
    assert [c[2] for c in calls.items if c[0] == "restore-hook"] == [1, 2]


def test_a_longer_notice_window_merges_a_notify_restore_that_comes_later(
    server: ControlServer, engine: Lifecycle, sock_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A platform whose notice comes more than 2 s after the restore (a notifier slow to
    start in a loaded sandbox) ran the hooks twice for one restore, and nothing let it
    say its notices come later: REHYDRATE_SIGNAL_WINDOW is the engine's window too."""
    monkeypatch.setenv("REHYDRATE_SIGNAL_WINDOW", "10")
    assert Lifecycle(builtins=False).notice_window == 10.0
    engine.notice_window = 10.0
    calls = Calls(engine)
    now = time.monotonic()
    engine.heartbeat(now - 10, 30.0)
    engine.restore_detected("clock-jump", since=now - 4, detected_at=now - 3)
    engine.heartbeat(time.monotonic(), 30.0)
    reply = request("restore", socket_path=sock_path)  # 3 s after the restore
    assert reply["deduplicated"] and reply["report"]["generation"] == 1, reply
    assert [c[2] for c in calls.items if c[0] == "restore-hook"] == [1]


def test_a_notify_restore_after_the_window_runs_even_when_the_watch_saw_freezes(
    server: ControlServer, engine: Lifecycle, sock_path: str
) -> None:
    """A watch that has seen freezes before (a SIGSTOP, a long host stall, the parent's
    own restore, remembered in the clone's memory) may still miss this restore's (a
    freeze shorter than its slack, a clock kept continuous): nothing tells that from a
    late notice, so a run more than the window before the notice is not its restore
    whatever the watch says. A longer window for such a watch kept a clone on its
    parent's keys; a duplicate within the window is still merged."""
    calls = Calls(engine)
    now = time.monotonic()
    engine.heartbeat(now - 100, 30.0)
    engine.freeze_noticed(now - 20, now - 12)  # the watch saw the parent's freeze
    engine.restore_detected("clock-jump", since=now - 20, detected_at=now - 12)
    engine.heartbeat(time.monotonic(), 30.0)  # the clone's short freeze went unseen
    reply = request("restore", socket_path=sock_path)  # the clone's notice
    assert not reply["deduplicated"] and reply["report"]["generation"] == 2, reply
    reply = request("restore", socket_path=sock_path)  # its duplicate, moments later
    assert reply["deduplicated"] and reply["report"]["generation"] == 2, reply
    assert [c[2] for c in calls.items if c[0] == "restore-hook"] == [1, 2]


def test_prepare_is_consumed_by_the_first_notice(server: ControlServer, engine: Lifecycle,
                                                 sock_path: str) -> None:
    calls = Calls(engine)
    assert request("prepare-snapshot", socket_path=sock_path)["ok"]
    engine.restore_detected("clock-jump", since=time.monotonic() - 0.5)
    assert request("restore", socket_path=sock_path)["report"]["reason"] == "clock-jump"
    # A second restore, again only the clock saw it, then a notice with no new prepare.
    engine.restore_detected("clock-jump", since=time.monotonic())
    reply = request("restore", socket_path=sock_path)
    assert (reply["report"]["reason"], reply["report"]["generation"]) == ("control", 3)
    assert [c[3] for c in calls.items if c[0] == "restore-hook"] == [
        "clock-jump", "clock-jump", "control"]


def test_simulate_and_carry_on_resumes_do_not_hide_a_restore(
    server: ControlServer, engine: Lifecycle, sock_path: str
) -> None:
    calls = Calls(engine)
    fail = True

    @engine.registry.before_snapshot(name="flush")
    def flush() -> None:
        if fail:
            raise RuntimeError("disk full")

    since = time.monotonic()  # e.g. the gVisor waiter's descriptor, opened long ago
    assert request("simulate", socket_path=sock_path)["ok"]
    assert request("prepare-snapshot", socket_path=sock_path)["ok"] is False  # carry on
    assert engine.last_restore_at is None
    report = engine.restore_detected("gvisor", since=since)
    assert (report.reason, report.generation) == ("gvisor", 2)
    assert [c[3] for c in calls.items if c[0] == "restore-hook"] == [
        "simulated", "control", "gvisor"]


@pytest.mark.root
def test_root_client_trusts_a_named_socket_in_its_owners_private_dir(
        foreign_dir: Path) -> None:
    """Root notifying a workload of another uid: allowed only for a socket the operator
    named, owned by that uid, in a directory writable by that uid alone."""
    os.chmod(foreign_dir, 0o700)
    srv = ForeignServer(foreign_dir)
    try:
        r = cli("notify", "save", "--socket", srv.path)
        assert r.returncode == 0, (r.stdout, r.stderr)
        # found on its own (not named), the same socket is still refused
        r = cli("notify", "save", env={"XDG_RUNTIME_DIR": str(foreign_dir.parent)})
        assert r.returncode == 4, (r.stdout, r.stderr)
    finally:
        records = srv.close()
    # "budget": notify save asks how long the hooks may take (this server answers at once)
    assert records == [{"received": '{"cmd": "prepare-snapshot", "budget": true}\n'}]


def test_json_commands_say_an_unreachable_process_on_stdout(short_dir: Path) -> None:
    missing = str(short_dir / "nobody-here.sock")
    for args in (("status", "--json"), ("notify", "save", "--json"), ("trigger", "--json")):
        r = cli(*args, "--socket", missing)
        assert r.returncode == 3, (args, r.stdout, r.stderr)
        reply = json.loads(r.stdout)
        assert reply["ok"] is False and "cannot reach" in reply["error"], args


def test_an_empty_socket_path_and_a_symlinked_default_dir_are_named(short_dir: Path) -> None:
    """Before: ``--socket ""`` (an unset variable) quietly searched the default directory,
    and a default directory that is a symbolic link was reported as "mode 0777"."""
    r = cli("status", "--socket", "")
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert r.stderr == "rehydrate: status: the socket path given is empty (an unset variable?)\n"
    r = cli("notify", "save", "--socket", "")
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "the socket path given is empty" in r.stderr
    target = short_dir / "elsewhere"
    target.mkdir(mode=0o700)
    (short_dir / "rehydrate").symlink_to(target)
    r = cli("status", env={"XDG_RUNTIME_DIR": str(short_dir)})
    assert r.returncode == 4, (r.stdout, r.stderr)
    assert f"not trusting {short_dir}/rehydrate: it must be a directory owned by uid " in r.stderr
    assert "(found a symbolic link); remove it, or pass --socket" in r.stderr


# -- impostors: a directory or a path another user got first (issue #13.2) ---------------


@pytest.mark.root
def test_workload_refuses_a_socket_dir_another_user_owns_or_can_write(
        foreign_dir: Path, engine: Lifecycle, short_dir: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """uid 65534 owns the directory (mode 0777, then 0700): it could swap the socket at any
    time, so the workload refuses to serve there, loudly (log, status)."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    for mode in (0o777, 0o700):
        os.chmod(foreign_dir, mode)
        path = str(foreign_dir / "ctl.sock")
        assert engine.start([ControlDetector(path)]) == []
        errors = engine.status().to_dict()["detector_errors"]
        assert "owned by uid 65534" in errors["control"], errors
        assert not os.path.exists(path)
        engine.stop()
    assert any(r.levelno == logging.ERROR and "owned by uid 65534" in r.getMessage()
               for r in caplog.records)
    group_writable = short_dir / "shared"
    group_writable.mkdir(mode=0o770)
    os.chmod(group_writable, 0o770)
    assert engine.start([ControlDetector(str(group_writable / "ctl.sock"))]) == []
    assert "writable by other users (mode 0770)" in \
        engine.status().to_dict()["detector_errors"]["control"]
    engine.stop()
    sticky = short_dir / "sticky"  # like /tmp: others cannot rename what we create
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    assert engine.start([ControlDetector(str(sticky / "ctl.sock"))]) == ["control"]
    assert "detector_errors" not in engine.status().to_dict()


@pytest.mark.root
def test_a_squatted_socket_path_is_a_loud_failure(
        foreign_dir: Path, engine: Lifecycle, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reviewer's repro: uid 65534 serves the path first. The workload does not carry on
    quietly: the detector is not running, status and the log say why, doctor says it."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    srv = ForeignServer(foreign_dir)
    os.chmod(foreign_dir, 0o755)  # not even the directory check is needed: the path is live
    try:
        det = ControlDetector(srv.path)
        with pytest.raises(FileExistsError, match="served by uid 65534"):
            ControlServer(engine, srv.path)._refuse_live_socket()
        assert engine.start([det]) == []
        error = engine.status().to_dict()["detector_errors"]["control"]
        assert "owned by uid 65534" in error or "served by uid 65534" in error
        assert any(r.levelno == logging.ERROR and "control" in r.getMessage()
                   for r in caplog.records)
        r = cli("doctor", env={"REHYDRATE_CONTROL_SOCKET": srv.path})
        row = next(line for line in r.stdout.splitlines() if line.startswith("control"))
        assert " no " in row and "uid 65534" in row, r.stdout
        engine.stop()
        # configured by the environment and started with "auto", as a workload does: the
        # failing probe must not make the detector silently absent
        monkeypatch.setenv("REHYDRATE_CONTROL_SOCKET", srv.path)
        assert "control" not in engine.start("auto")
        assert "uid 65534" in engine.status().to_dict()["detector_errors"]["control"]
    finally:
        srv.close()


@pytest.mark.root
def test_notify_pins_the_server_uid_and_pid(foreign_dir: Path) -> None:
    """Root's notify for a workload of another uid can pin it: the impostor who created the
    workload's private directory first is refused (exit 4), nothing is sent to it."""
    os.chmod(foreign_dir, 0o700)
    srv = ForeignServer(foreign_dir)
    try:
        r = cli("notify", "save", "--socket", srv.path, "--expect-uid", "4242")
        assert r.returncode == 4, (r.stdout, r.stderr)
        assert "served by uid 65534" in r.stderr and "expected uid 4242" in r.stderr
        r = cli("notify", "save", "--socket", srv.path, "--expect-pid", str(srv.pid + 100000))
        assert r.returncode == 4 and "expected pid" in r.stderr, r.stderr
        with pytest.raises(UntrustedSocket, match="expected uid 0"):
            request("status", socket_path=srv.path, expect_uid=0)
        r = cli("notify", "save", "--socket", srv.path, "--expect-uid", "65534",
                "--expect-pid", str(srv.pid))
        assert r.returncode == 0, (r.stdout, r.stderr)
    finally:
        records = srv.close()
    assert records == [{"received": ""}] * 3 + [
        {"received": '{"cmd": "prepare-snapshot", "budget": true}\n'}]


def test_deeply_nested_json_is_one_log_line_not_a_traceback(
        server: ControlServer, sock_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """Issue #13.13: nesting past the parser's recursion limit logged a traceback at ERROR
    for every request."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    c = Conn(sock_path)
    try:
        for payload in (b"[" * 60000, b'{"cmd": ' + b"[" * 30000 + b"]" * 30000 + b"}"):
            c.send(payload + b"\n")
            reply = c.reply()
            assert reply["ok"] is False and "nested too deeply" in reply["error"], reply
        assert c.ask({"cmd": "status"})["ok"]  # the connection keeps serving
    finally:
        c.close()
    records = [r for r in caplog.records if "bad request" in r.getMessage()]
    assert len(records) == 2
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in records)
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)


# -- idle connections and floods (issue #13.9) --------------------------------------------


def test_a_notify_gets_through_a_flood_of_idle_clients(
        server: ControlServer, engine: Lifecycle, sock_path: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """300 same-uid clients connect and say nothing: they used to take every slot (and
    overflow a backlog of 16: EAGAIN), so notify was answered "busy" for minutes."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    calls = Calls(engine)
    flood: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(sock_path)
            except BlockingIOError:
                refused += 1
            flood.append(s)
        assert refused == 0, f"{refused} of 300 connects hit a full backlog"
        reply = request("prepare-snapshot", socket_path=sock_path, timeout=DEADLINE)
        assert reply["ok"], reply
        r = cli("notify", "resume", "--socket", sock_path)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert [c[0] for c in calls.items] == ["snapshot-hook", "restore-hook"]
        assert server.evicted >= 300 - 32
        evictions = [r for r in caplog.records if "idlest" in r.getMessage()]
        assert len(evictions) == 1  # one line for the whole flood
    finally:
        for s in flood:
            s.close()


def test_evicted_half_sent_clients_are_closed_without_a_line_each(
        server: ControlServer, sock_path: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the eviction warning was one line per 10 s, but every evicted client that
    had sent part of a request then logged "disconnected mid-request" (and was sent a
    reply about it): a flood still wrote a line per client."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    ended = threading.Semaphore(0)
    real = ControlServer._serve

    def counted(self: ControlServer, conn: socket.socket) -> None:
        try:
            real(self, conn)
        finally:
            ended.release()

    monkeypatch.setattr(ControlServer, "_serve", counted)
    flood = []
    try:
        for _ in range(120):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock_path)
            s.sendall(b'{"cmd": "st')  # half a request, never finished
            flood.append(s)
        wait_for(lambda: server.evicted >= 120 - 32, timeout=DEADLINE, what="evictions")
        for _ in range(server.evicted):  # each evicted client's handler has returned
            assert ended.acquire(timeout=DEADLINE)
        # (the clients still connected log theirs when they hang up: that line is right)
        lines = [r.getMessage() for r in caplog.records if r.name == "rehydrate"]
    finally:
        for s in flood:
            s.close()
    assert not [m for m in lines if "mid-request" in m], len(lines)
    assert len([m for m in lines if "idlest" in m]) == 1


def test_a_request_must_arrive_within_the_idle_limit(
        server: ControlServer, sock_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that trickles a request byte by byte (or sends nothing) is closed once the
    idle limit passes, however often single bytes arrive."""

    monkeypatch.setattr(control, "IDLE_TIMEOUT", 0.5)
    c = Conn(sock_path)
    try:
        assert c.ask({"cmd": "status"})["ok"]  # a complete request resets the limit
        started = time.monotonic()
        c.send(b'{"cmd": "status"')  # never completed: a byte every 50 ms after it
        answered = False
        while not answered and time.monotonic() - started < 3.0:
            answered = bool(select.select([c.sock], [], [], 0.05)[0])
            if not answered:
                c.send(b" ")
        assert answered, "a trickling client was never closed"
        reply = c.reply()
        assert reply["ok"] is False and "no complete request within 0.5s" in reply["error"]
        assert time.monotonic() - started < DEADLINE
        with pytest.raises(EOFError):
            c.reply()
    finally:
        c.close()


@contextlib.contextmanager
def _fake_server(path: str, reply: bytes) -> Iterator[None]:
    """A server on ``path`` that answers every request with ``reply`` (another rehydrate
    version, or a bug): what the client makes of replies of the wrong shape."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(reply + b"\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)
        listener.close()


@pytest.mark.parametrize("reply", [
    b'{"ok": true, "status": "x", "report": 5}',
    b'{"ok": true, "status": {"detectors": 5, "detector_errors": [1], "last_report": 7}}',
    b'{"ok": true, "status": {"last_report": {"hooks": 3, "duration": "slow"}}}',
    b'{"ok": true, "report": {"hooks": [1, {"outcome": "failed"}]}}',
    b'{"ok": true, "report": 5}',
    b"[" * 100_000 + b"]" * 100_000,
])
def test_replies_of_an_unexpected_shape_are_one_line_not_a_traceback(
        short_dir: Path, capsys: pytest.CaptureFixture[str], reply: bytes) -> None:
    from rehydrate.__main__ import main

    path = str(short_dir / "fake.sock")
    with _fake_server(path, reply):
        for argv in (["status", "--socket", path], ["notify", "restore", "--socket", path]):
            code = main(argv)  # no exception escapes
            out, err = capsys.readouterr()
            assert code in (0, 2, 3), (argv, code, out, err)
            assert "Traceback" not in err and len(err.splitlines()) <= 1, err


def test_a_restore_notice_during_a_slow_save_leaves_no_stale_prepare(
        server: ControlServer, engine: Lifecycle, sock_path: str) -> None:
    """``notify restore`` arriving while ``notify save`` still ran its hooks: the save
    recorded its prepare after the notice had consumed it, and the next real restore was
    taken for a duplicate — its hooks ran zero times."""
    calls = Calls(engine)
    entered, release = threading.Event(), threading.Event()

    @engine.registry.before_snapshot(name="slow")
    def slow() -> None:
        entered.set()
        release.wait(DEADLINE)

    saved: dict = {}  # type: ignore[type-arg]
    t = threading.Thread(target=lambda: saved.update(
        request("prepare-snapshot", socket_path=sock_path)))
    t.start()
    assert entered.wait(DEADLINE)
    restored: dict = {}  # type: ignore[type-arg]
    r = threading.Thread(target=lambda: restored.update(
        request("restore", socket_path=sock_path)))
    r.start()
    deadline = time.monotonic() + DEADLINE
    while server.engine._notices < 1 and time.monotonic() < deadline:  # queued behind it
        threading.Event().wait(0.005)
    release.set()
    t.join(DEADLINE)
    r.join(DEADLINE)
    assert saved["ok"] and restored["ok"] and not restored["deduplicated"]
    reply = request("restore", socket_path=sock_path)  # the next real restore
    assert reply["ok"] and not reply["deduplicated"], reply
    assert [c[3] for c in calls.items if c[0] == "restore-hook"] == ["control", "control"]


def test_a_failed_save_whose_resume_fails_too_says_so(server: ControlServer,
                                                     engine: Lifecycle,
                                                     sock_path: str) -> None:
    @engine.registry.before_snapshot(name="flush-db")
    def flush() -> None:
        raise RuntimeError("disk full")

    @engine.registry.after_restore(name="reopen-db")
    def reopen() -> None:
        raise RuntimeError("still full")

    reply = request("prepare-snapshot", socket_path=sock_path)
    assert reply["ok"] is False
    assert ("the resume hooks failed too (reopen-db (RuntimeError: still full)): degraded"
            in reply["error"])
    assert engine.status().state == "degraded"


def test_a_resume_whose_client_is_gone_runs_once_and_quietly(
    server: ControlServer, engine: Lifecycle, sock_path: str,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CRIU's post-dump: `rehydrate notify` queues ``resume`` while the tasks are frozen
    and exits; the process reads it when it runs again (``--leave-running``), its client
    long gone. The complete request line is acted on, the undeliverable reply is dropped
    without a word, and the resume ends the pending pass."""
    caplog.set_level(logging.DEBUG, logger="rehydrate")
    calls = Calls(engine)
    env = {"REHYDRATE_CONTROL_SOCKET": sock_path}
    assert cli("notify", env={**env, "CRTOOLS_SCRIPT_ACTION": "pre-dump"}).returncode == 0
    frozen = threading.Event()
    real = ControlServer._peer_allowed

    def after_the_freeze(self: ControlServer, conn: socket.socket) -> bool:
        assert frozen.wait(DEADLINE)
        return real(self, conn)

    monkeypatch.setattr(ControlServer, "_peer_allowed", after_the_freeze)
    served = server.served
    r = cli("notify", env={**env, "CRTOOLS_SCRIPT_ACTION": "post-dump"})
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    assert server.served == served  # not read yet: the client exited without a reply
    frozen.set()  # CRIU lets the tasks go on
    wait_for(lambda: server.served == served + 1, what="the queued request")
    monkeypatch.undo()
    assert [c for c in calls.items if c[0] == "restore-hook"] == [
        ("restore-hook", "resume", 0, "control")]
    status = request("status", socket_path=sock_path)["status"]
    assert status["state"] == "ready" and status["generation"] == 0
    noisy = [r.getMessage() for r in caplog.records
             if r.levelno >= logging.WARNING or "connection ended" in r.getMessage()]
    assert noisy == []


@pytest.mark.parametrize("first", ["clock-jump", "post-dump"])
def test_post_dump_resume_and_the_clock_jump_run_the_hooks_once(
    first: str, server: ControlServer, engine: Lifecycle, sock_path: str
) -> None:
    """A ``--leave-running`` dump long enough for the clock-jump detector: it and the
    post-dump ``resume`` are one event, whichever is handled first."""
    calls = Calls(engine)
    env = {"REHYDRATE_CONTROL_SOCKET": sock_path}
    assert cli("notify", env={**env, "CRTOOLS_SCRIPT_ACTION": "pre-dump"}).returncode == 0
    before_freeze = time.monotonic()  # the clock-jump detector's last wake-up

    def clock_jump() -> None:
        engine.restore_detected("clock-jump", since=before_freeze)

    def post_dump() -> None:
        n = server.served
        assert cli("notify", env={**env, "CRTOOLS_SCRIPT_ACTION": "post-dump"}).returncode == 0
        wait_for(lambda: server.served == n + 1, what="the queued resume")

    for notice in ((clock_jump, post_dump) if first == "clock-jump" else
                   (post_dump, clock_jump)):
        notice()
    runs = [c for c in calls.items if c[0] == "restore-hook"]
    expected = (("restore-hook", "restore", 1, "clock-jump") if first == "clock-jump" else
                ("restore-hook", "resume", 0, "control"))
    assert runs == [expected]
    assert request("status", socket_path=sock_path)["status"]["state"] == "ready"
    # A later restore (a copy restored from the image) is another event: it runs.
    reply = request("restore", socket_path=sock_path)
    assert reply["ok"] and not reply["deduplicated"]


def test_a_queued_post_dump_resume_does_not_end_the_next_dump_s_pass(
    server: ControlServer, engine: Lifecycle, sock_path: str,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dump A's post-dump ``resume`` is queued before dump B's ``pre-dump`` save connects;
    when the save is served first (the resume's thread read it late), the resume is
    still about A's pass: it runs nothing, and B's pass stays open for B's freeze (its
    own post-dump ``resume`` ends it). Before: the resume, judged by when it was read,
    ended B's pass before B froze the process — B's image held what the before-snapshot
    hooks had closed."""
    calls = Calls(engine)
    env = {"REHYDRATE_CONTROL_SOCKET": sock_path}

    def action(name: str) -> None:
        r = cli("notify", env={**env, "CRTOOLS_SCRIPT_ACTION": name})
        assert r.returncode == 0, (name, r.stderr)

    action("pre-dump")  # dump A
    late, release, first = threading.Event(), threading.Event(), threading.Event()
    real = ControlServer._peer_allowed

    def slow_first(self: ControlServer, conn: socket.socket) -> bool:
        if not first.is_set():  # dump A's post-dump resume: read late
            first.set()
            late.set()
            assert release.wait(DEADLINE)
        return real(self, conn)

    monkeypatch.setattr(ControlServer, "_peer_allowed", slow_first)
    real_accept = socket.socket.accept

    def accept_when_queued(self: socket.socket) -> tuple[socket.socket, Any]:
        # CRIU runs post-dump while the process is frozen: its accept loop runs only
        # once the request is queued. Here it runs all along and could accept between
        # the notifier's connect and its send; wait for the request as a thaw would.
        conn, addr = real_accept(self)
        if not first.is_set():
            assert select.select([conn], [], [], DEADLINE)[0], "no request came"
        return conn, addr

    monkeypatch.setattr(socket.socket, "accept", accept_when_queued)
    served = server.served
    action("post-dump")  # dump A ends; its resume is queued
    assert late.wait(DEADLINE)  # accepted, not read yet
    action("pre-dump")  # dump B's save, served first
    assert engine.status().state == "snapshotting"
    release.set()
    wait_for(lambda: server.served == served + 2, what="dump A's resume")
    monkeypatch.undo()
    assert engine.status().state == "snapshotting", "B's pass was ended before B froze"
    assert [c for c in calls.items if c[0] == "restore-hook"] == []
    action("post-dump")  # dump B ends
    wait_for(lambda: server.served == served + 3, what="dump B's resume")
    assert [c for c in calls.items if c[0] == "restore-hook"] == [
        ("restore-hook", "resume", 0, "control")]
    assert engine.status().state == "ready"


def test_two_instances_starting_at_one_path_never_take_each_others_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second instance starting while the first has bound its socket and not yet
    listens: unlocked, it took that socket for a stale one, removed it and bound its own
    — the first then listened on a deleted name, and its stop() removed the second's
    live socket. Under the directory's lock the second waits, then finds the first
    serving and refuses to start."""
    from rehydrate import Lifecycle

    path = str(tmp_path / "c.sock")
    os.chmod(tmp_path, 0o700)
    engines = [Lifecycle(builtins=False), Lifecycle(builtins=False)]
    first, second = (control.ControlServer(e, path) for e in engines)
    outcome: list[object] = []

    def start_second() -> None:
        try:
            second.start()
            outcome.append("started")
        except Exception as exc:
            outcome.append(exc)

    real_chmod = os.chmod

    def chmod_then_race(p: object, mode: int, *args: object, **kw: object) -> None:
        real_chmod(p, mode, *args, **kw)  # type: ignore[arg-type]
        if p == path and not outcome:
            monkeypatch.setattr(control.os, "chmod", real_chmod)
            racer = threading.Thread(target=start_second)
            racer.start()
            racer.join(2.0)  # unlocked, it is done by now; locked, it waits for us

    monkeypatch.setattr(control.os, "chmod", chmod_then_race)
    try:
        first.start()
        wait_for(lambda: bool(outcome), 10.0)
        assert isinstance(outcome[0], FileExistsError), outcome
        st = os.stat(path)
        assert first._inode == (st.st_dev, st.st_ino)  # its own socket, still there
        assert control.serving_peer(path) is not None
    finally:
        second.stop()
        first.stop()
        for e in engines:
            e.close()
    assert not os.path.exists(path)


def test_a_resume_sent_late_on_an_idle_connection_ends_the_pass(server, engine,
                                                                 sock_path) -> None:
    """A client connects first and idles, a ``pre-dump`` save starts a pass, then the
    client's first request, ``resume``, comes: it is dated when read (after the pass),
    not at the accept — dated at the accept, it was taken for an earlier checkpoint's
    and ended nothing (the process stayed ``snapshotting``)."""
    idle = socket.socket(socket.AF_UNIX)
    try:
        idle.connect(sock_path)
        wait_for(lambda: len(server._conns) == 1, 10.0)  # accepted, nothing queued
        r = cli("notify", env={"REHYDRATE_CONTROL_SOCKET": sock_path,
                               "CRTOOLS_SCRIPT_ACTION": "pre-dump"})
        assert r.returncode == 0, r.stderr
        assert engine.status().state == "snapshotting"
        idle.sendall(b'{"cmd": "resume"}\n')
        reply = json.loads(idle.makefile().readline())
    finally:
        idle.close()
    assert reply["ok"] and not reply.get("deduplicated"), reply
    assert engine.status().state == "ready"


# -- a socket this uid cannot connect to is never taken for a stale one ------------------


def _start_as(uid: int, path: str, engine: Lifecycle) -> dict[str, Any]:
    """In a child dropped to ``uid``: what squatter(), doctor's probe (the path set in
    $REHYDRATE_CONTROL_SOCKET) and ControlServer.start() say about ``path``."""

    def child() -> dict[str, Any]:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.environ["REHYDRATE_CONTROL_SOCKET"] = path
        info = {i.name: i for i in detect.available()}["control"]
        try:
            ControlServer(engine, path).start()
            started = "started"
        except OSError as exc:
            started = f"{type(exc).__name__}: {exc}"
        return {"squatter": control.squatter(path), "usable": info.usable,
                "reason": info.reason, "start": started}

    return in_forked_child(child)


@pytest.mark.root
def test_a_0600_socket_of_another_uid_in_a_sticky_dir_is_a_squatter(
        root_required: None, short_dir: Path, engine: Lifecycle) -> None:
    """The reviewer's repro: uid 65534 serves a 0600 socket in /tmp-like dir; uid 65533's
    doctor said "usable" and its start() failed with EPERM (it had taken the socket for a
    stale one and tried to unlink it)."""
    os.chmod(short_dir, 0o755)
    sticky = short_dir / "pub"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    srv = ForeignServer(sticky)
    try:
        os.chmod(srv.path, 0o600)
        before = os.lstat(srv.path)
        out = _start_as(65533, srv.path, engine)
        line = (f"{srv.path} is a socket of uid 65534 that this uid cannot connect to "
                "(Permission denied): another user squats the control socket")
        assert out["squatter"].startswith(line), out
        assert not out["usable"] and out["reason"].startswith(line), out
        assert out["start"].startswith(f"FileExistsError: {line}"), out
        assert out["start"].endswith("refusing to start") and "\n" not in out["start"]
        after = os.lstat(srv.path)
        assert (after.st_ino, after.st_uid) == (before.st_ino, 65534)
    finally:
        srv.close()


@pytest.mark.root
def test_a_live_root_socket_in_the_users_own_dir_is_never_replaced(
        root_required: None, short_dir: Path, engine: Lifecycle) -> None:
    """The reviewer's repro: root listens (0600) in uid 65533's own 0700 directory; uid
    65533's start() deleted it and bound its own there."""
    os.chmod(short_dir, 0o755)
    own = short_dir / "u"
    own.mkdir(mode=0o700)
    os.chown(own, 65533, 65533)
    path = str(own / "a.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.bind(path)
        os.chmod(path, 0o600)
        live.listen(4)
        before = os.lstat(path).st_ino
        out = _start_as(65533, path, engine)
        line = f"{path} is a socket of uid 0 that this uid cannot connect to (Permission denied)"
        assert out["start"] == f"FileExistsError: {line}; refusing to start", out
        assert out["squatter"] == line and not out["usable"], out
        assert os.lstat(path).st_ino == before
        assert control.serving_peer(path) == (os.getpid(), 0)  # still root's, still live
    finally:
        live.close()


def test_a_busy_live_socket_is_not_taken_for_a_stale_one(engine: Lifecycle,
                                                          short_dir: Path) -> None:
    """A server whose accept backlog is full refuses a non-blocking connect with EAGAIN:
    it is live (busy), and was deleted and replaced as if nobody listened."""
    path = str(short_dir / "busy.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen(0)
    queued = []
    try:
        while True:  # fill the backlog
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            queued.append(c)
            try:
                c.connect(path)
            except BlockingIOError:
                break
        before = os.lstat(path).st_ino
        with pytest.raises(FileExistsError, match="cannot connect to .*refusing to start"):
            ControlServer(engine, path).start()
        assert os.lstat(path).st_ino == before
        assert control.squatter(path) is None  # this uid's own server, only busy
    finally:
        for c in queued:
            c.close()
        live.close()


def _cert_recovering_during_the_run(engine: Lifecycle) -> None:
    """A required "cert" hook that fails, and a later hook of the same run that reports
    it recovered (what a certificate watcher reloading meanwhile does)."""
    @engine.registry.after_restore(phase="secrets", name="cert")
    def cert() -> None:
        raise FileNotFoundError("not mounted yet")

    @engine.registry.after_restore(name="late")
    def late() -> None:
        engine.recovered("cert")


def test_a_restore_whose_failures_recovered_during_the_run_answers_ok(
        server: ControlServer, engine: Lifecycle, sock_path: str) -> None:
    """Every failed hook recovered while the run went on: the process ended ready, so
    ``notify restore`` must not tell the platform the restore failed (it exited 1, and
    save-restore-exec or SnapStart failed a restore that had recovered)."""
    _cert_recovering_during_the_run(engine)

    reply = request("restore", socket_path=sock_path)
    assert reply["ok"] is True and "error" not in reply, reply
    assert reply["report"]["ok"] is False and reply["report"]["recovered"] == ["cert"]
    assert engine.is_ready()
    r = cli("notify", "restore", env={"REHYDRATE_CONTROL_SOCKET": sock_path})
    assert r.returncode == 0, (r.stdout, r.stderr)


def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on: what a process that died without stop() left."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


def test_a_process_exiting_without_stop_removes_its_socket(short_dir: Path) -> None:
    """It left the socket file: the client's scan then counted it with the live ones."""
    path = short_dir / "exit.sock"
    code = ("import rehydrate; from rehydrate.detect.control import ControlDetector; "
            f"rehydrate.start([ControlDetector({str(path)!r})]); "
            f"import os; assert os.path.exists({str(path)!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, check=False, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert not path.exists()


def test_a_forked_child_at_exit_leaves_the_parents_socket(server: ControlServer,
                                                          sock_path: str) -> None:
    """A child inherits the exit handler and the server object, not the socket: its
    normal exit must not remove the parent's."""
    def child() -> dict[str, Any]:
        control._unlink_at_exit()  # what the child's interpreter runs at a normal exit
        return {"exists": os.path.exists(sock_path)}

    assert in_forked_child(child) == {"exists": True}
    assert request("status", socket_path=sock_path)["ok"]


def test_exit_leaves_a_socket_another_server_bound_at_the_path(server: ControlServer,
                                                               sock_path: str) -> None:
    os.unlink(sock_path)
    _stale_socket(Path(sock_path))  # another process's now
    control._unlink_at_exit()
    assert os.path.exists(sock_path)
    os.unlink(sock_path)


def test_the_directory_scan_skips_sockets_nobody_listens_on(
    engine: Lifecycle, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One live process and a socket left by one that exited: "2 control sockets …: pass
    --socket"."""
    monkeypatch.delenv("REHYDRATE_CONTROL_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_dir))
    assert engine.start([ControlDetector()]) == ["control"]  # <short_dir>/rehydrate/<pid>.sock
    live = short_dir / "rehydrate" / f"{os.getpid()}.sock"
    _stale_socket(short_dir / "rehydrate" / "1.sock")
    env = {"XDG_RUNTIME_DIR": str(short_dir)}
    r = cli("status", env=env)
    assert r.returncode == 0, r.stderr
    assert find_socket() == str(live)
    engine.stop()
    _stale_socket(short_dir / "rehydrate" / "2.sock")
    r = cli("status", env=env)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "nobody listens at the 2 sockets" in r.stderr


def test_simulate_answers_ready_for_a_run_whose_failures_recovered(
        server: ControlServer, engine: Lifecycle, sock_path: str) -> None:
    _cert_recovering_during_the_run(engine)

    reply = request("simulate", socket_path=sock_path)
    assert reply["ok"] is True and reply["report"]["recovered"] == ["cert"], reply


def test_stop_in_a_forked_child_leaves_the_parents_server(engine: Lifecycle,
                                                         sock_path: str) -> None:
    """A child of fork() calling stop() on the parent's detector (an inherited shutdown
    handler) wrote to the shared stop pipe and removed the parent's socket file: the
    parent's accept thread ended while the engine still listed the detector."""
    det = ControlDetector(sock_path)
    assert engine.start([det]) == ["control"]
    server = det.server
    assert server is not None
    thread = server._thread
    held = socket.socket(socket.AF_UNIX)  # a client connected before the fork
    held.connect(sock_path)
    try:
        def child() -> dict[str, Any]:
            det.stop()
            return {"forgotten": det.server is None and server._sock is None,
                    "exists": os.path.exists(sock_path)}

        assert in_forked_child(child) == {"forgotten": True, "exists": True}
        assert os.path.exists(sock_path)
        assert request("status", socket_path=sock_path)["ok"]
        assert thread is not None and thread.is_alive() and det.server is server
        held.sendall(b'{"cmd": "status"}\n')  # not shut down by the child
        assert held.recv(6) == b'{"ok":'
    finally:
        held.close()


# -- failures of the server itself ---------------------------------------------------------


def _no_thread_to_serve(engine: Lifecycle, sock_path: str,
                        monkeypatch: pytest.MonkeyPatch) -> ControlServer:
    """A control server started while its pool can start no thread (the pids limit): it
    starts all the same, its reserved thread missing. Setting ``threading.Thread.start``
    back ends the shortage."""
    from rehydrate._threads import ThreadPool

    pool = ThreadPool("rh-ctl-pool", keep=0)
    monkeypatch.setattr(control, "blocking", pool)
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == pool.name:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    det = ControlDetector(sock_path)
    assert engine.start([det]) == ["control"]
    assert det.server is not None
    return det.server


def test_a_client_no_thread_can_serve_is_answered_busy_and_the_socket_lives_on(
        engine: Lifecycle, sock_path: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The process at its pids limit for a moment: the pool's submit() raised in the
    accept loop, which caught only OSError — its thread died, silently, and the socket
    never served again (clients queued in the backlog until their timeouts)."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    real_start = threading.Thread.start
    server = _no_thread_to_serve(engine, sock_path, monkeypatch)
    c = Conn(sock_path)
    try:
        # answered on accept, before any request is read (one sent now could meet EPIPE)
        assert c.reply() == {"ok": False, "error": "busy: no thread to serve this client"}
        with contextlib.suppress(ConnectionResetError):  # closed after the answer
            assert c.sock.recv(1) == b""
    finally:
        c.close()
    assert not server._conns
    monkeypatch.setattr(server._submit_failures, "clock", lambda: 0.0)  # one instant
    with pytest.raises(ControlError, match=r"stayed busy \(too many clients, or no thread "
                                           r"to serve one\) for 0.3s"):
        request("status", socket_path=sock_path, timeout=0.3)  # retried while refused
    monkeypatch.setattr(threading.Thread, "start", real_start)  # the burst is over
    assert request("status", socket_path=sock_path, timeout=DEADLINE)["ok"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["control socket: no thread to serve a client (RuntimeError: can't "
                      "start new thread); answered busy"]
    assert "detector_errors" not in engine.status().extra


def test_a_save_with_no_thread_for_its_deadline_runs_no_hook_and_is_refused(
        server: ControlServer, engine: Lifecycle, sock_path: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """`notify save` at the thread limit: the before-snapshot hooks ran, then the snapshot
    deadline's thread could not start, and the error reply skipped the failed pass's
    carry-on — no resume hooks, no deadline: ``snapshotting`` for good. That thread now
    starts before the hooks: the save is refused with no hook run, and the state is left
    as it was. The refusal is logged in one line (it came with a full traceback)."""
    calls = Calls(engine)
    engine.snapshot_deadline = 30.0
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "rehydrate-snapshot-deadline":
            raise RuntimeError("can't start new thread")
        real_start(self)

    before = engine.status().state
    monkeypatch.setattr(threading.Thread, "start", start)
    reply = request("prepare-snapshot", socket_path=sock_path, timeout=DEADLINE)
    assert reply["ok"] is False
    assert reply["error"].startswith("RuntimeError: no thread to watch the snapshot "
                                     "deadline"), reply
    assert calls.items == []
    assert engine.status().state == before != "snapshotting"
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == f"control command prepare-snapshot refused: {reply['error']}"
    assert record.exc_info is None
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert request("prepare-snapshot", socket_path=sock_path, timeout=DEADLINE)["ok"]
    assert engine.status().state == "snapshotting"
    assert request("resume", socket_path=sock_path, timeout=DEADLINE)["ok"]
    assert engine.status().ready


def test_a_posted_resume_no_thread_can_serve_is_served_on_the_accept_thread(
        engine: Lifecycle, sock_path: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """CRIU's post-dump `resume` is sent with post(): its client is gone at once. With no
    thread to serve it (the pids limit) it was answered busy to nobody and dropped — the
    process stayed ``snapshotting`` until the deadline. A resume or restore notice is
    now served on the accept thread; other requests are still answered busy."""
    from rehydrate._notify import post

    calls = Calls(engine)
    server = _no_thread_to_serve(engine, sock_path, monkeypatch)
    listening = server._sock
    real_accept = socket.socket.accept
    sent = threading.Event()

    def accept(self: socket.socket) -> tuple[socket.socket, Any]:
        if self is listening:  # as while the process is frozen: the notice is queued
            assert sent.wait(DEADLINE)
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    assert engine.snapshot_requested("control").ok
    assert engine.status().state == "snapshotting"
    caplog.set_level(logging.INFO, logger="rehydrate")
    post("resume", socket_path=sock_path)
    sent.set()
    wait_for(lambda: engine.status().ready, what="the posted resume's run")
    assert [item[:2] for item in calls.items] == [("snapshot-hook", "snapshot"),
                                                  ("restore-hook", "resume")]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["control socket: no thread to serve a client (RuntimeError: can't "
                      "start new thread); its resume or restore notice is served on the "
                      "accept thread"]
    monkeypatch.setattr(server._submit_failures, "clock", lambda: 0.0)  # one instant
    with pytest.raises(ControlError, match=r"stayed busy"):
        request("status", socket_path=sock_path, timeout=0.3)


def _read_to_end(conn: socket.socket) -> bytes:
    conn.settimeout(DEADLINE)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_only_the_notice_is_served_on_the_accept_thread(
        engine: Lifecycle, sock_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no thread to serve it, a connection whose first request is a resume had every
    request it sent served on the accept thread: a prepare-snapshot pipelined after the
    resume ran the before-snapshot hooks, and the process was ``snapshotting`` again.
    Only the notice is served now; the connection then ends (its reply, then EOF)."""
    server = _no_thread_to_serve(engine, sock_path, monkeypatch)
    calls = Calls(engine)
    assert engine.snapshot_requested("control").ok
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(sock_path)
        conn.sendall(b'\n{"cmd":"resume","id":1}\n{"cmd":"prepare-snapshot","id":2}\n'
                     b'{"cmd":"status","id":3}\n')
        replies = [json.loads(line) for line in _read_to_end(conn).splitlines()]
    assert [(r["id"], r["ok"]) for r in replies] == [(1, True)]
    assert [item[:2] for item in calls.items] == [("snapshot-hook", "snapshot"),
                                                  ("restore-hook", "resume")]
    assert engine.status().state != "snapshotting" and engine.status().ready
    assert server.served == 1


def test_a_notice_read_as_stop_begins_is_not_served_on_the_accept_thread(
        engine: Lifecycle, sock_path: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A connection served on a thread of its own answers nothing once stop() began; the
    resume notice the accept thread serves (no thread to serve it) ran its hooks all the
    same, while stop() waited for that thread. It is now closed unanswered, as there,
    and the thread shortage is still logged, as for a connection answered busy (it went
    unreported)."""
    caplog.set_level(logging.INFO, logger="rehydrate")
    server = _no_thread_to_serve(engine, sock_path, monkeypatch)
    calls = Calls(engine)
    assert engine.snapshot_requested("control").ok
    real_pending = server._notice_pending
    stopper = threading.Thread(target=engine.stop)

    def pending(conn: socket.socket) -> bytes | None:
        notice = real_pending(conn)
        stopper.start()  # it waits for this thread, which goes on once stop() began
        assert select.select([server._stop_r], [], [], DEADLINE)[0]
        return notice

    monkeypatch.setattr(server, "_notice_pending", pending)
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(sock_path)
        conn.sendall(b'{"cmd":"resume"}\n')
        try:
            unanswered = _read_to_end(conn) == b""
        except ConnectionResetError:  # closed with the request unread
            unanswered = True
        assert unanswered
    stopper.join(DEADLINE)
    assert not stopper.is_alive()
    assert [item[:2] for item in calls.items] == [("snapshot-hook", "snapshot")]
    assert engine.status().state == "snapshotting"
    assert server.served == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["control socket: no thread to serve a client (RuntimeError: can't "
                      "start new thread); its resume or restore notice is closed "
                      "unanswered: the socket is stopping"]


def test_a_notice_client_that_does_not_read_holds_the_accept_thread_a_second(
        engine: Lifecycle, sock_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The accept thread sent the reply of the notice it served with no time limit of
    its own (and served whatever followed): a client that never read held it, and every
    other client waited. The reply now gets NOTICE_REPLY_TIMEOUT; then the connection
    is closed and the next client is answered."""
    server = _no_thread_to_serve(engine, sock_path, monkeypatch)
    monkeypatch.setattr(control, "NOTICE_REPLY_TIMEOUT", 0.1)
    real_dispatch = server._dispatch

    def dispatch(cmd: str, req: Any, **kwargs: Any) -> dict[str, Any]:
        # more than the socket buffers take: the send blocks on a client that never reads
        return {**real_dispatch(cmd, req, **kwargs), "pad": "x" * (16 << 20)}

    monkeypatch.setattr(server, "_dispatch", dispatch)
    with socket.socket(socket.AF_UNIX) as idle, socket.socket(socket.AF_UNIX) as other:
        idle.connect(sock_path)
        idle.sendall(b'{"cmd":"resume"}\n')  # and never reads
        other.connect(sock_path)
        other.sendall(b'{"cmd":"status"}\n')
        other.settimeout(DEADLINE)  # the accept thread is free long before
        assert json.loads(other.recv(65536)) == {
            "ok": False, "error": "busy: no thread to serve this client"}


def test_an_accept_thread_that_dies_shows_in_detector_errors(
        engine: Lifecycle, sock_path: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The control detector kept looking as if it served when its accept thread was
    gone: status() listed it and said nothing."""
    import types

    class BrokenPoller:
        def register(self, fd: int, events: int) -> None:
            pass

        def poll(self) -> list[tuple[int, int]]:
            raise RuntimeError("poller broke")

    monkeypatch.setattr(control, "select", types.SimpleNamespace(
        poll=BrokenPoller, POLLIN=select.POLLIN, select=select.select))
    det = ControlDetector(sock_path)
    assert engine.start([det]) == ["control"]
    wait_for(lambda: "control" in engine.status().extra.get("detector_errors", {}),
             what="the dead accept thread in detector_errors")
    assert engine.status().extra["detector_errors"] == {
        "control": "its accept thread died: RuntimeError: poller broke"}
    assert "the accept thread died" in caplog.text
    engine.stop()
    assert "detector_errors" not in engine.status().extra


def test_a_status_field_with_keys_json_cannot_have_still_gets_a_reply(
        server: ControlServer, engine: Lifecycle, sock_path: str) -> None:
    """An extension's counters keyed by (host, port): json.dumps raised in the server, the
    client got no reply (exit 3) and doctor failed, while status() in the process worked.
    Such keys are sent as their str(), as values that are not JSON are; a reply that
    cannot be JSON at all is a one-line error, and the connection goes on."""
    engine.add_status("peers", lambda: {("db", 5432): 3, 7: {("a", None): "x"}})
    reply = request("status", socket_path=sock_path, timeout=DEADLINE)
    assert reply["ok"], reply
    assert reply["status"]["peers"] == {"('db', 5432)": 3, "7": {"('a', None)": "x"}}
    r = cli("status", "--socket", sock_path)
    assert r.returncode == 0, (r.stdout, r.stderr)

    looped: dict[str, Any] = {}
    looped["self"] = looped
    engine.add_status("looped", lambda: looped)
    c = Conn(sock_path)
    try:
        reply = c.ask({"cmd": "status", "id": 9})
        assert reply["ok"] is False and reply["id"] == 9
        assert reply["error"].startswith("reply not encodable: ")
        assert "\n" not in reply["error"]
        assert c.ask({"cmd": "nope"})["error"].startswith("bad request: unknown command")
    finally:
        c.close()


def test_a_failing_accept_is_one_log_line_per_ten_seconds(
        server: ControlServer, sock_path: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """EMFILE made accept() fail every 0.1 s, each time one ERROR line: 600 a minute."""
    import errno

    caplog.set_level(logging.INFO, logger="rehydrate")
    listening = server._sock
    real_accept = socket.socket.accept
    failures = [12]

    def accept(self: socket.socket) -> tuple[socket.socket, Any]:
        if self is listening and failures[0] > 0:
            failures[0] -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_accept(self)

    seconds = iter(range(1000, 2000, 2))  # each failure 2 s after the previous one
    monkeypatch.setattr(server._accept_failures, "clock", lambda: float(next(seconds)))
    monkeypatch.setattr(control, "ACCEPT_PAUSE", 0.001)
    monkeypatch.setattr(socket.socket, "accept", accept)
    assert request("status", socket_path=sock_path, timeout=DEADLINE)["ok"]
    assert failures == [0]
    lines = [r.getMessage() for r in caplog.records if "accept failed" in r.getMessage()]
    assert lines == ["control socket accept failed: Too many open files",
                     "control socket accept failed: Too many open files (5 times since "
                     "the last line)",
                     "control socket accept failed: Too many open files (5 times since "
                     "the last line)"]


def test_the_accept_thread_ending_at_exit_is_no_failure(server: ControlServer) -> None:
    """At interpreter exit without stop(), the socket's removal closes the stop pipe,
    which wakes the accept thread: it ends as asked, with no ERROR line or
    detector_errors entry (nor spins on the closed descriptor)."""
    thread = server._thread
    assert thread is not None
    control._unlink_at_exit()
    thread.join(DEADLINE)
    assert not thread.is_alive()
    assert server.failure is None


def test_a_busy_answer_sent_before_the_request_is_read_and_retried(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server refusing a client at once ("busy") closes before the client has sent its
    request: the client's send failed (EPIPE) and it gave up ("connection ... failed:
    Broken pipe") instead of reading the answer and asking again."""
    from rehydrate import _notify

    path = str(short_dir / "busy.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(DEADLINE)
    refused = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        conn.sendall(b'{"ok": false, "error": "busy: no thread to serve this client"}\n')
        conn.close()
        refused.set()
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b'{"ok": true, "status": {}, "pid": 1}\n')

    real_check = _notify._check_peer

    def check_after_the_refusal(sock: socket.socket, *args: Any, **kwargs: Any) -> None:
        refused.wait(DEADLINE)  # the first connection: closed by the server already
        real_check(sock, *args, **kwargs)

    monkeypatch.setattr(_notify, "_check_peer", check_after_the_refusal)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        assert request("status", socket_path=path, timeout=DEADLINE)["ok"] is True
    finally:
        t.join(DEADLINE)
        listener.close()
