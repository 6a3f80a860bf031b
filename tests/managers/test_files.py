"""rehydrate.files on the host: managed handles across simulated snapshot/restore runs,
the volume identity, and the before-snapshot audit (fake /proc trees for mounts the host
does not have). The real-gVisor behaviour is in tests/gvisor/test_volumes_runsc.py."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import sqlite3
import sys
import threading
from pathlib import Path

import pytest

from rehydrate import Lifecycle, files
from rehydrate._cli import main as cli_main


@pytest.fixture
def engine():
    eng = Lifecycle()
    try:
        yield eng
    finally:
        eng.close()


def _hook(report, name):
    return next(h for h in report.hooks if h.name == name)


def _real_fds_on_a_volume(engine: Lifecycle, tmp_path: Path) -> Path:
    """``tmp_path/vol``, a volume to the audit (a mountinfo that says so) over the real
    ``/proc/self/fd``, deleted files refused as under gVisor."""
    vol = tmp_path / "vol"
    vol.mkdir()
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(
        "16 15 0:17 / / ro - 9p none ro,trans=fd\n"
        f"20 16 0:20 / {vol} rw - 9p none rw,trans=fd\n")
    os.symlink("/proc/self/fd", proc / "self" / "fd")
    mgr = files.manager(engine)
    mgr.proc = str(proc)
    mgr.fail_on_deleted = True
    return vol


def _replace(path: Path, text: str) -> None:
    """Rename-over: a new inode at the same path, as editors and deploy tools do."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_the_audit_runs_after_every_user_hook_whatever_its_order(engine,
                                                                   tmp_path: Path) -> None:
    """Before a snapshot the open-file audit must come after every hook that may close a
    file — also a user hook in its phase with an order below the built-ins' old -2e6 (it
    ran after the audit, which refused the deleted file that hook was about to close).
    The real /proc/self/fd, with a mountinfo that makes ``vol`` a volume."""
    vol = _real_fds_on_a_volume(engine, tmp_path)
    scratch = open(vol / "scratch", "w")  # noqa: SIM115 — the hook under test closes it
    (vol / "scratch").unlink()

    @engine.registry.before_snapshot(phase="environment", order=-999_000_000,
                                     name="app.close_scratch")
    def close_scratch() -> None:
        scratch.close()

    try:
        report = engine.simulate_snapshot()
    finally:
        scratch.close()
    names = [h.name for h in report.hooks]
    assert names.index("app.close_scratch") < names.index("rehydrate.files.audit"), names
    assert report.ok, report.table()


def test_unchanged_file_reopens_at_the_same_position(engine, tmp_path: Path) -> None:
    p = tmp_path / "data.txt"
    p.write_text("one\ntwo\nthree\n")
    f = files.open(p, engine=engine)
    assert f.readline() == "one\n"
    assert engine.simulate_snapshot().ok
    assert f.suspended
    with pytest.raises(ValueError):
        f.readline()  # closed while the snapshot is pending
    report = engine.simulate_restore()
    assert report.ok, report.error
    assert (f.changed, f.readline()) == (False, "two\n")


@pytest.mark.parametrize("how", ["rename-over", "in-place"])
def test_changed_file_reopens_from_the_start(engine, tmp_path: Path, how: str) -> None:
    p = tmp_path / "data.txt"
    p.write_text("old 1\nold 2\nold 3\n")
    seen = []
    f = files.open(p, engine=engine, on_change=seen.append)
    f.readline()
    assert engine.simulate_snapshot().ok
    if how == "rename-over":
        _replace(p, "new 1\nnew 2\n")
    else:
        with open(p, "r+") as w:  # same inode, new content
            w.write("NEW 1\nNEW 2\nNEW 3\n")
    assert engine.simulate_restore().ok
    assert f.changed is True
    assert seen == [f]
    assert f.readline() == ("new 1\n" if how == "rename-over" else "NEW 1\n")


def test_write_mode_reopens_without_truncating(engine, tmp_path: Path) -> None:
    p = tmp_path / "out.log"
    f = files.open(p, "w", engine=engine)
    f.write("before\n")
    assert engine.simulate_snapshot().ok
    assert p.read_text() == "before\n", "flushed by the close"
    assert engine.simulate_restore(kind="resume").ok
    f.write("after\n")
    f.close()
    assert p.read_text() == "before\nafter\n"
    assert f not in files.manager(engine).handles()
    with files.open(p, "a", engine=engine) as g:  # a context manager closes for good
        g.write("more\n")
    assert g.closed and g not in files.manager(engine).handles()


@pytest.mark.parametrize("mode", ["w", "x", "w+", "r+"])
def test_a_changed_file_written_in_place_reopens_at_its_end(engine, tmp_path: Path,
                                                            mode: str) -> None:
    """Another writer added to the file while frozen: the handle's next write must not
    overwrite the head of it (reopened r+ at offset 0, it did)."""
    p = tmp_path / "report.csv"
    if mode == "r+":
        p.write_text("")
    seen: list[object] = []
    out = files.open(p, mode, engine=engine, on_change=lambda h: seen.append(h.tell()))
    out.write("id,value\n1,aaaa\n")
    assert engine.simulate_snapshot().ok
    with open(p, "a") as host:
        host.write("2,host\n")
    assert engine.simulate_restore().ok
    assert out.changed
    assert seen == [len("id,value\n1,aaaa\n2,host\n")], "at the end already in on_change"
    out.write("3,app\n")
    out.flush()
    assert p.read_text() == "id,value\n1,aaaa\n2,host\n3,app\n"


def test_a_changed_file_read_or_appended_reopens_from_the_start(engine,
                                                                tmp_path: Path) -> None:
    p = tmp_path / "log.txt"
    p.write_text("one\n")
    r = files.open(p, engine=engine)
    a = files.open(p, "a+", engine=engine)
    r.readline()
    a.seek(0)
    assert a.readline() == "one\n"
    assert engine.simulate_snapshot().ok
    _replace(p, "new\n")
    assert engine.simulate_restore().ok
    assert (r.changed, r.tell(), a.changed) == (True, 0, True)
    # "a+" too: open() put it at the end, where its reader read nothing of the new file.
    assert (a.tell(), a.readline()) == (0, "new\n")
    a.write("more\n")  # O_APPEND: to the end
    a.flush()
    assert p.read_text() == "new\nmore\n"


def test_a_changed_file_in_plain_append_mode_tells_where_its_next_write_lands(
        engine, tmp_path: Path) -> None:
    """Reopened at 0 like an "a+" reader: tell() gave offsets where no write landed (an
    append-only journal indexing its records)."""
    p = tmp_path / "journal.log"
    p.write_text("")
    log = files.open(p, "a", engine=engine)
    log.write("rec1\n")
    log.flush()
    assert engine.simulate_snapshot().ok
    with open(p, "a") as other:
        other.write("other writer\n")
    assert engine.simulate_restore(kind="resume").ok
    at = log.tell()
    log.write("rec2\n")
    log.flush()
    assert log.changed and at == p.read_text().index("rec2") == len("rec1\nother writer\n")


def test_gone_file_fails_the_reopen_hook_naming_it(engine, tmp_path: Path) -> None:
    p = tmp_path / "gone.txt"
    p.write_text("x")
    optional = tmp_path / "optional.txt"
    optional.write_text("y")
    handles = [files.open(p, engine=engine),  # held: a dropped handle is forgotten
               files.open(optional, engine=engine, required=False)]
    assert engine.simulate_snapshot().ok
    p.unlink()
    optional.unlink()
    report = engine.simulate_restore()
    assert not report.ok
    hook = _hook(report, "rehydrate.files.reopen")
    assert hook.outcome == "failed"
    assert str(p) in str(hook.error) and str(optional) not in str(hook.error)
    assert engine.status().state == "degraded"
    assert [h.suspended for h in handles] == [True, True]


def test_sqlite_wal_host_rows_seen_after_restore(engine, tmp_path: Path) -> None:
    db = tmp_path / "app.db"
    connected = []
    conn = files.sqlite(db, engine=engine, on_connect=connected.append)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.row_factory = sqlite3.Row
    with conn:
        conn.execute("CREATE TABLE t (who TEXT)")
        conn.execute("INSERT INTO t VALUES ('app')")

    # A transaction still open refuses the snapshot, naming the database; nothing is lost.
    conn.execute("INSERT INTO t VALUES ('pending')")
    report = engine.simulate_snapshot()
    assert not report.ok
    err = str(_hook(report, "rehydrate.files.close").error)
    assert str(db) in err and "transaction" in err
    conn.rollback()
    assert engine.simulate_restore(kind="resume").ok
    assert [r["who"] for r in conn.execute("SELECT who FROM t")] == ["app"]

    assert engine.simulate_snapshot().ok
    assert not (tmp_path / "app.db-wal").exists() and not (tmp_path / "app.db-shm").exists()
    host = sqlite3.connect(db)  # the host writes while the sandbox is frozen, then closes
    with host:
        host.execute("INSERT INTO t VALUES ('host')")
    host.close()
    assert engine.simulate_restore().ok
    rows = conn.execute("SELECT who FROM t ORDER BY rowid").fetchall()
    assert [r["who"] for r in rows] == ["app", "host"], "row_factory set again"
    assert conn.changed is True
    assert len(connected) == 2, "on_connect for the first and every new connection"
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("wal", [False, True])
def test_sqlite_cursor_left_half_read_refuses_the_snapshot_saying_so(engine, tmp_path: Path,
                                                                     wal: bool) -> None:
    """A cursor kept half read (a DAO's self.cur) refused every snapshot with SQLite's
    bare "database table is locked", naming nothing the application could act on."""
    db = files.sqlite(tmp_path / "app.db", engine=engine)
    if wal:
        db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (x)")
    db.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(3)])
    db.commit()
    cur = db.cursor()
    assert cur.execute("SELECT x FROM t ORDER BY x").fetchone() == (0,)
    report = engine.simulate_snapshot()
    error = _hook(report, "rehydrate.files.close").error
    assert isinstance(error, files.SnapshotRefused), repr(error)
    assert str(error) == (f"SQLite database {tmp_path / 'app.db'} has a statement still "
                          "running (a cursor not read to its end): fetch its rows or "
                          "close() it before the snapshot")
    assert engine.simulate_restore(kind="resume").ok
    assert cur.fetchone() == (1,), "nothing lost: the connection stayed open"
    cur.close()
    assert engine.simulate_snapshot().ok


def test_sqlite_refuses_memory_databases(engine) -> None:
    with pytest.raises(ValueError, match="in-memory"):
        files.sqlite(":memory:", engine=engine)


def test_mmap_remapped_with_change_check(engine, tmp_path: Path) -> None:
    p = tmp_path / "shared.bin"
    p.write_bytes(b"\0" * 16)
    m = files.mmap(p, engine=engine)
    m[0:5] = b"hello"
    assert engine.simulate_snapshot().ok
    assert p.read_bytes()[:5] == b"hello", "flushed before unmapping"
    assert engine.simulate_restore().ok
    assert (m.changed, m[0:5]) == (False, b"hello")

    assert engine.simulate_snapshot().ok
    _replace(p, "x" * 32)
    assert engine.simulate_restore().ok
    assert m.changed and len(m) == 32 and m[0:2] == b"xx"

    fixed = files.mmap(p, 32, engine=engine)
    assert engine.simulate_snapshot().ok
    p.write_bytes(b"short")  # truncated: touching the old length would kill the process
    report = engine.simulate_restore()
    assert not report.ok
    assert str(p) in str(_hook(report, "rehydrate.files.reopen").error)
    fixed.close()


def test_swapped_volume_marks_its_handles_changed(engine, tmp_path: Path) -> None:
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "a.txt").write_text("a\nb\n")
    v = files.volume(vol, engine=engine)
    ident = (vol / files.IDENTITY_FILE).read_text().strip()
    assert v.identity == ident and len(ident) == 32
    assert files.volume(vol, engine=engine) is v
    f = files.open(vol / "a.txt", engine=engine)
    f.readline()
    assert engine.simulate_snapshot().ok
    # Another volume with the same file names; the file's own times are set back, so only
    # the identity file tells the volumes apart.
    st = (vol / "a.txt").stat()
    (vol / files.IDENTITY_FILE).write_text("another-volume\n")
    os.utime(vol / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert engine.simulate_restore().ok
    assert v.changed and v.identity == "another-volume"
    assert f.changed and f.readline() == "a\n"
    status = engine.status().extra["files"]
    assert status["volumes"] == [{"mount_point": str(vol), "identity": "another-volume",
                                  "changed": True}]


def _identity_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == 30 and "a swapped volume is detected only" in r.getMessage()]


def test_a_leftover_temporary_identity_file_is_neither_reused_nor_deleted(
        engine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A temporary file named after the PID, left by a run killed mid-create (PID 1 in a
    container) or being written by a same-PID clone, made the volume go without identity
    (so a swap was never reported), silently, and was deleted from under its writer."""
    vol = tmp_path / "vol"
    vol.mkdir()
    leftover = vol / f"{files.IDENTITY_FILE}.{os.getpid()}.tmp"
    leftover.write_text("another writer's\n")
    v = files.volume(vol, engine=engine)
    ident = (vol / files.IDENTITY_FILE).read_text().strip()
    assert v.identity == ident and len(ident) == 32
    assert leftover.read_text() == "another writer's\n"
    assert sorted(os.listdir(vol)) == sorted([files.IDENTITY_FILE, leftover.name])
    assert _identity_warnings(caplog) == []


def test_identity_temporary_names_are_random_and_a_taken_one_is_skipped(
        engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import secrets

    real = secrets.token_hex
    names = iter(["taken", "free"])
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: next(names) if n == 8 else real(n))
    vol = tmp_path / "vol"
    vol.mkdir()
    taken = vol / f"{files.IDENTITY_FILE}.taken.tmp"
    taken.write_text("another writer's\n")
    v = files.volume(vol, engine=engine)
    assert v.identity is not None and len(v.identity) == 32
    assert next(names, None) is None, "the taken name was skipped for another"
    assert taken.read_text() == "another writer's\n"
    assert sorted(os.listdir(vol)) == sorted([files.IDENTITY_FILE, taken.name])

    # Every name taken: no identity, said in one line.
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: "taken" if n == 8 else real(n))
    vol2 = tmp_path / "vol2"
    vol2.mkdir()
    (vol2 / f"{files.IDENTITY_FILE}.taken.tmp").write_text("")
    assert files.volume(vol2, engine=engine).identity is None
    warnings = _identity_warnings(caplog)
    assert warnings == [f"volume {vol2}: no identity file (no free temporary file name in "
                        f"{files._TMP_ATTEMPTS} tries); a swapped volume is detected only "
                        "by its files' size and times"], warnings


def test_an_empty_identity_file_is_warned_about(
        engine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / files.IDENTITY_FILE).write_text("")
    assert files.volume(vol, engine=engine).identity is None
    warnings = _identity_warnings(caplog)
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert f"identity file {vol / files.IDENTITY_FILE} is empty" in warnings[0]
    assert (vol / files.IDENTITY_FILE).read_text() == "", "never replaced"


def _fake_proc(root: Path, vol: Path, fds: dict[int, str]) -> Path:
    """A /proc tree with ``self/mountinfo`` declaring ``vol`` a 9p volume, ``self/fd``."""
    proc = root / "proc"
    (proc / "self" / "fd").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(
        "16 15 0:17 / / ro - 9p none ro,trans=fd\n"
        "23 16 0:23 / /var/tmp rw - tmpfs none rw\n"
        f"20 16 0:20 / {str(vol).replace(' ', chr(92) + '040')} rw - 9p none rw,trans=fd\n")
    for fd, target in fds.items():
        os.symlink(target, proc / "self" / "fd" / str(fd))
    return proc


def test_open_files_lists_volume_descriptors(tmp_path: Path) -> None:
    vol = tmp_path / "my vol"
    proc = _fake_proc(tmp_path, vol, {
        0: "host:[1]", 3: f"{vol}/db.sqlite", 4: "/var/tmp/x (deleted)",
        5: f"{vol}/scratch (deleted)", 6: "/usr/lib/libc.so", 7: "socket:[99]"})
    found = files.open_files(proc=str(proc))
    assert [(f.fd, f.path, f.deleted, f.mount_point) for f in found] == [
        (3, f"{vol}/db.sqlite", False, str(vol)), (5, f"{vol}/scratch", True, str(vol))]
    assert files.open_files(proc=str(proc), held=[str(vol)]) == []


def test_audit_fails_the_snapshot_on_a_deleted_volume_file(
        engine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    vol = tmp_path / "vol"
    vol.mkdir()
    mgr = files.manager(engine)
    mgr.proc = str(_fake_proc(tmp_path, vol, {9: f"{vol}/scratch (deleted)",
                                               10: f"{vol}/other.txt",
                                               11: f"{vol}/app.db-wal"}))
    mgr.fail_on_deleted = True
    report = engine.simulate_snapshot()
    assert not report.ok
    err = str(_hook(report, "rehydrate.files.audit").error)
    assert f"{vol}/scratch" in err and "other.txt" not in err
    assert [f["path"] for f in engine.status().extra["files"]["last_audit"]] == [
        f"{vol}/scratch", f"{vol}/other.txt", f"{vol}/app.db-wal"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == 30]
    assert any(f"{vol}/other.txt (fd 10)" in w for w in warnings), warnings
    assert any(f"SQLite database(s) {vol}/app.db in WAL mode" in w for w in warnings)

    mgr.fail_on_deleted = False  # outside gVisor: a warning only
    assert engine.simulate_snapshot().ok


def test_a_live_file_named_like_a_deleted_one_is_not_deleted(
        engine, tmp_path: Path) -> None:
    """The kernel marks a deleted file by appending " (deleted)" to its fd's link; a live
    file whose name ends that way failed the snapshot (under gVisor) naming another path.
    The real /proc/self/fd, with a mountinfo that makes ``vol`` a volume."""
    vol = _real_fds_on_a_volume(engine, tmp_path)
    with open(vol / "report (deleted)", "w") as live:
        assert engine.simulate_snapshot().ok
        [found] = engine.status().extra["files"]["last_audit"]
        assert (found["fd"], found["path"], found["deleted"]) == (
            live.fileno(), f"{vol}/report (deleted)", False)

        # Really deleted: a plain name, a name ending in " (deleted)", and a file still
        # hard-linked elsewhere (its link count is 1, the name it was opened by is gone).
        held = [open(vol / name, "w") for name in ("gone", "x (deleted)", "linked")]
        os.link(vol / "linked", vol / "other-name")
        for name in ("gone", "x (deleted)", "linked"):
            os.unlink(vol / name)
        try:
            report = engine.simulate_snapshot()
            assert not report.ok
            err = str(_hook(report, "rehydrate.files.audit").error)
            for f, name in zip(held, ("gone", "x (deleted)", "linked")):
                assert f"{vol}/{name} (fd {f.fileno()} on {vol})" in err, err
            assert "report" not in err, err
        finally:
            for f in held:
                f.close()


def test_doctor_files_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vol = tmp_path / "vol"
    proc = _fake_proc(tmp_path, vol, {5: f"{vol}/scratch (deleted)"})
    assert cli_main(["doctor", "--files", "--pid", "self", "--proc", str(proc)]) == 0
    text = capsys.readouterr().out
    assert f"{vol}/scratch" in text and "DELETED" in text
    assert cli_main(["doctor", "--files", "--pid", "self", "--json", "--proc", str(proc)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["files"][0]["deleted"] is True


def test_on_change_error_fails_the_reopen_naming_the_file(engine, tmp_path: Path) -> None:
    p = tmp_path / "cfg.txt"
    p.write_text("a\n")

    def boom(handle):
        raise RuntimeError("cannot rebuild")

    f = files.open(p, engine=engine, on_change=boom)
    assert engine.simulate_snapshot().ok
    _replace(p, "b\n")
    report = engine.simulate_restore()
    error = _hook(report, "rehydrate.files.reopen").error
    assert isinstance(error, files.ReopenFailed) and not report.ok
    assert f"{p}: RuntimeError: cannot rebuild" in str(error)
    assert f.read() == "b\n", "reopened before on_change ran"


@pytest.mark.parametrize("trouble", ["on_change raises", "identity file is a directory"])
def test_a_volume_problem_fails_the_reopen_naming_it_and_every_handle_is_reopened(
        engine, tmp_path: Path, trouble: str) -> None:
    vol, other = tmp_path / "vol", tmp_path / "other"
    vol.mkdir()
    other.mkdir()
    (vol / "a.txt").write_text("a\n")
    (other / "b.txt").write_text("b\n")

    def boom(volume):
        raise RuntimeError("cannot rebuild")

    files.volume(vol, engine=engine,
                 on_change=boom if trouble == "on_change raises" else None)
    a = files.open(vol / "a.txt", engine=engine)
    b = files.open(other / "b.txt", engine=engine)
    assert engine.simulate_snapshot().ok
    identity = vol / files.IDENTITY_FILE
    identity.unlink()
    if trouble == "on_change raises":
        identity.write_text("another-volume\n")
    else:
        identity.mkdir()
    report = engine.simulate_restore()
    error = _hook(report, "rehydrate.files.reopen").error
    assert isinstance(error, files.ReopenFailed) and not report.ok
    assert f"volume {vol}: " in str(error)
    assert a.read() == "a\n" and b.read() == "b\n", "every handle reopened all the same"


def test_user_close_of_sqlite_with_open_transaction_and_file_gone_before_snapshot(
        engine, tmp_path: Path) -> None:
    conn = files.sqlite(tmp_path / "x.db", engine=engine)
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (1)")  # implicit transaction left open
    conn.close()  # like sqlite3: closes (and rolls back), never refuses
    assert conn not in files.manager(engine).handles()

    p = tmp_path / "early.txt"
    p.write_text("x")
    f = files.open(p, engine=engine)
    p.unlink()  # gone before the snapshot: nothing is held, so the snapshot is fine
    assert engine.simulate_snapshot().ok
    report = engine.simulate_restore()
    assert not report.ok and str(p) in str(_hook(report, "rehydrate.files.reopen").error)
    assert f.suspended


def test_dropped_handles_are_forgotten(engine, tmp_path: Path) -> None:
    import gc

    p = tmp_path / "x.txt"
    p.write_text("x")
    mgr = files.manager(engine)
    for _ in range(50):
        files.open(p, engine=engine)  # dropped at once
    gc.collect()
    assert mgr.handles() == [] and len(mgr._handles) == 0


def test_no_proc_skips_the_audit_and_doctor_says_why(
        engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files.manager(engine).proc = str(tmp_path / "no-proc")
    assert engine.simulate_snapshot().ok, "no /proc: nothing to audit, never a failure"
    assert cli_main(["doctor", "--files", "--pid", "999999999"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rehydrate: doctor --files: no process 999999999 here"], err


def test_a_volume_or_database_that_cannot_be_used_is_named(engine, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(files.FileGone, match=f"volume {afile} is not a directory$"):
        files.volume(afile, engine=engine)
    with pytest.raises(files.FileGone, match=f"volume {tmp_path / 'missing'} does not exist$"):
        files.volume(tmp_path / "missing", engine=engine)
    import sqlite3

    with pytest.raises(sqlite3.OperationalError, match=f"^{tmp_path / 'no' / 'x.db'}: "):
        files.sqlite(tmp_path / "no" / "x.db", engine=engine)


def test_a_volume_identity_file_that_is_no_regular_file_is_named_never_waited_on(
        engine, tmp_path: Path) -> None:
    """A FIFO as ``.rehydrate-volume`` held ``volume()`` (and, put there later, every
    snapshot's hook until its timeout, leaving a thread stuck) waiting for a writer."""
    fifo_vol, dir_vol = tmp_path / "fifo-vol", tmp_path / "dir-vol"
    fifo_vol.mkdir()
    dir_vol.mkdir()
    os.mkfifo(fifo_vol / files.IDENTITY_FILE)
    (dir_vol / files.IDENTITY_FILE).mkdir()
    for vol, kind in ((fifo_vol, "a FIFO"), (dir_vol, "a directory")):
        with pytest.raises(OSError, match=rf"not a regular file \({kind}\)"):
            files.volume(vol, engine=engine)
    vol = tmp_path / "vol"
    vol.mkdir()
    files.volume(vol, engine=engine)
    (vol / files.IDENTITY_FILE).unlink()
    os.mkfifo(vol / files.IDENTITY_FILE)
    done = concurrent.futures.ThreadPoolExecutor(1).submit(engine.simulate_snapshot)
    report = done.result(timeout=20)  # the hook's own timeout is 30 s
    assert not report.ok
    error = _hook(report, "rehydrate.files.close").error
    assert "a FIFO" in str(error) and str(vol / files.IDENTITY_FILE) in str(error)


def test_a_bytes_path_is_managed_as_text(engine, tmp_path: Path) -> None:
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "a.txt").write_text("a\n")
    (vol / "b.txt").write_text("b\n")
    files.volume(vol, engine=engine)
    a = files.open(os.fsencode(vol / "a.txt"), engine=engine)
    b = files.open(vol / "b.txt", engine=engine)
    assert a.path == str(vol / "a.txt")
    json.dumps(engine.status().to_dict())  # used to fail on the bytes path
    assert engine.simulate_snapshot().ok
    ident = vol / files.IDENTITY_FILE
    ident.write_text("another-volume\n")  # a swapped volume: every handle is checked
    report = engine.simulate_restore()
    assert report.ok, report.table()
    assert a.read() == "a\n" and b.read() == "b\n" and a.changed and b.changed


@pytest.mark.parametrize("kind", ["file", "mmap", "sqlite"])
def test_a_file_replaced_before_the_snapshot_reopens_as_changed(
        engine, tmp_path: Path, kind: str) -> None:
    # Renamed over while the handle still held the old file (atomic config update, log
    # rotation, ConfigMap symlink swap) and then left alone: the identity saved before
    # the snapshot used to be the new file's, so the restore found it "unchanged" and
    # read it from the old file's position.
    p = tmp_path / "data"
    seen = []
    if kind == "sqlite":
        with sqlite3.connect(p) as c:
            c.execute("CREATE TABLE t (v)")
        c.close()
        h: files._Handle = files.sqlite(p, engine=engine, on_change=seen.append)
        new = tmp_path / "new.db"
        with sqlite3.connect(new) as c:
            c.execute("CREATE TABLE u (v)")
        c.close()
        os.replace(new, p)
    else:
        p.write_text("OLD-LINE-1\nOLD-LINE-2\n")
        if kind == "file":
            f = files.open(p, engine=engine, on_change=seen.append)
            assert f.readline() == "OLD-LINE-1\n"
            h = f
        else:
            h = files.mmap(p, engine=engine, on_change=seen.append)
        _replace(p, "NEW CONTENT: another file\nnew 2\n")
    assert engine.simulate_snapshot().ok
    assert engine.simulate_restore().ok
    assert h.changed is True and seen == [h]
    if kind == "file":
        assert f.readline() == "NEW CONTENT: another file\n"
    h.close()


def test_partial_iteration_of_a_text_file_does_not_refuse_the_snapshot(
        engine, tmp_path: Path) -> None:
    # next() on a text file object disables its tell() until EOF, which the close before
    # the snapshot needs: the whole pass was refused.
    p = tmp_path / "lines.txt"
    p.write_text("header\nrow1\nrow2\nrow3\n")
    f = files.open(p, engine=engine)
    assert next(f) == "header\n"
    for line in f:
        assert line == "row1\n"
        break
    report = engine.simulate_snapshot()
    assert report.ok, report.table()
    assert engine.simulate_restore().ok
    assert f.changed is False
    assert list(f) == ["row2\n", "row3\n"]
    with pytest.raises(StopIteration):
        next(f)


def test_an_append_plus_reader_reopens_at_its_position(engine, tmp_path: Path) -> None:
    p = tmp_path / "journal.log"
    p.write_text("e1\ne2\ne3\n")
    f = files.open(p, "a+", engine=engine)
    f.seek(0)
    assert f.readline() == "e1\n"
    assert engine.simulate_snapshot().ok
    assert engine.simulate_restore().ok
    assert (f.changed, f.readline()) == (False, "e2\n")
    f.write("e4\n")  # O_APPEND: still to the end
    f.close()
    assert p.read_text() == "e1\ne2\ne3\ne4\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_write_back_error_before_the_snapshot_leaves_the_file_usable(engine) -> None:
    # /dev/full stands in for a full volume. A binary file's close() used to meet the
    # error after closing the file: the pass was refused but the handle was never
    # reopened, closed for good under the application.
    f = files.open("/dev/full", "wb", engine=engine)
    f.write(b"buffered record\n")
    report = engine.simulate_snapshot()
    assert not report.ok
    assert "No space left" in str(_hook(report, "rehydrate.files.close").error)
    assert engine.simulate_restore(kind="resume").ok
    assert not f.closed and not f.suspended
    f.write(b"next record\n")


class _CloseFailsAfterClosing:
    """A file object whose close() closes it and then reports an error (as an NFS close
    can)."""

    def __init__(self, f: object) -> None:
        self.f = f

    def __getattr__(self, name: str) -> object:
        return getattr(self.f, name)

    def close(self) -> None:
        self.f.close()  # type: ignore[attr-defined]
        raise OSError(5, "Input/output error")


def test_a_close_that_fails_after_closing_is_reopened_by_the_resume(
        engine, tmp_path: Path) -> None:
    p = tmp_path / "out.bin"
    f = files.open(p, "wb", engine=engine)
    f.write(b"one\n")
    object.__setattr__(f, "_file", _CloseFailsAfterClosing(f._file))
    report = engine.simulate_snapshot()
    assert not report.ok
    assert "Input/output error" in str(_hook(report, "rehydrate.files.close").error)
    assert engine.simulate_restore(kind="resume").ok
    assert not f.closed and not f.suspended and f.changed is False
    f.write(b"two\n")
    f.close()
    assert p.read_bytes() == b"one\ntwo\n"


@pytest.mark.parametrize("mode", ["r", "a", "rb"])
def test_a_file_replaced_by_a_fifo_while_frozen_fails_its_reopen_without_waiting(
        engine, tmp_path: Path, mode: str) -> None:
    """A managed file that is a FIFO after the restore: open() waited for a writer for
    ever — the reopen hook timed out holding the handle's lock, the handles after it stayed
    closed, and later restores never ran the hook again (it was still running)."""
    fifo, after = tmp_path / "fifo-now.txt", tmp_path / "after.txt"
    fifo.write_text("x\n")
    after.write_text("y\n")
    replaced = files.open(fifo, mode, engine=engine)
    later = files.open(after, engine=engine)  # reopened after it, in registration order
    assert engine.simulate_snapshot().ok
    fifo.unlink()
    os.mkfifo(fifo)
    reports: list = []
    runner = threading.Thread(target=lambda: reports.append(engine.simulate_restore()),
                              daemon=True)
    runner.start()
    runner.join(20)  # at once expected; the hook's own timeout is 30 s
    if runner.is_alive():  # let the stuck open() finish so the engine can close
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        runner.join(60)
        pytest.fail("the reopen waited on the FIFO")
    hook = _hook(reports[0], "rehydrate.files.reopen")
    assert hook.outcome == "failed"
    assert str(hook.error) == (f"managed file {fifo} is now a FIFO, not a regular file: "
                               "not reopened (opening it could wait for ever)")
    assert replaced.suspended and not later.suspended and later.readline() == "y\n"
    fifo.unlink()  # the file is back: the next restore reopens it, from the start
    fifo.write_text("new\n")
    assert engine.simulate_restore().ok
    assert replaced.changed and not replaced.suspended
    if "r" in mode:
        assert replaced.readline() in ("new\n", b"new\n")


@pytest.fixture
def short_reopen(monkeypatch: pytest.MonkeyPatch):
    """An engine whose rehydrate.files.reopen hook times out after 0.3 s by default (a
    handle cannot ask less than the default), and a record of its late passes."""
    monkeypatch.setattr(files, "_REOPEN_TIMEOUT", 0.3)
    eng = Lifecycle()
    mgr = files.manager(eng)
    real = mgr._after_restore
    ended = threading.Event()
    errors: list[BaseException | None] = []

    def after_restore(ctx):  # the hook is registered with the first handle: after this
        try:
            real(ctx)
        except BaseException as exc:
            errors.append(exc)
            raise
        else:
            errors.append(None)
        finally:
            ended.set()

    mgr._after_restore = after_restore  # type: ignore[method-assign]
    try:
        yield eng, ended, errors
    finally:
        eng.close()


@dataclasses.dataclass
class _SlowChange:
    """Managed handles snapshotted, and ``big.idx`` among them changed since with an
    on_change that blocks until ``release``: the next restore's reopen pass times out
    inside it and goes on late."""

    engine: Lifecycle
    handles: list[files.ManagedFile]
    inside: threading.Event  # set once the on_change runs
    release: threading.Event  # lets it return

    def restore_into_the_late_pass(self) -> None:
        """A restore whose reopen times out, its pass left inside the on_change."""
        assert not self.engine.simulate_restore().ok
        assert self.inside.wait(20)


def _slow_change(engine: Lifecycle, tmp_path: Path, *names: str) -> _SlowChange:
    """Handles on ``names`` in that order (``big.idx`` the slow one), each file holding its
    stem and a newline, then a snapshot and ``big.idx`` rewritten."""
    inside, release = threading.Event(), threading.Event()

    def slow(h: files.ManagedFile) -> None:
        inside.set()
        release.wait(30)

    handles = []
    for name in names:
        (tmp_path / name).write_text("old\n" if name == "big.idx" else f"{Path(name).stem}\n")
        handles.append(files.open(tmp_path / name, engine=engine,
                                  on_change=slow if name == "big.idx" else None))
    assert engine.simulate_snapshot().ok
    (tmp_path / "big.idx").write_text("new content\n")
    return _SlowChange(engine, handles, inside, release)


def _hold_the_pass_thread(mgr: files.FilesManager) -> threading.Event:
    """Keep the reopen pass's thread alive after the pass is done, until the event
    returned is set: a run that meets the hook then finds it still running."""
    inner = mgr._after_restore
    hold = threading.Event()

    def after_restore(ctx):  # the pass is done; its thread has not ended yet
        try:
            inner(ctx)
        finally:
            hold.wait(30)

    mgr._after_restore = after_restore  # type: ignore[method-assign]
    return hold


def _stop_the_late_pass(late: _SlowChange, ended: threading.Event) -> None:
    """A late pass stopped by a snapshot before any run came after it (nothing owed)."""
    late.restore_into_the_late_pass()
    assert late.engine.simulate_snapshot().ok
    late.release.set()
    assert ended.wait(20)


def test_a_reopen_pass_that_outlives_its_timeout_makes_the_process_ready_when_done(
        short_reopen, tmp_path: Path) -> None:
    """A slow on_change made rehydrate.files.reopen time out; its thread reopened every
    handle later, but the process stayed degraded for good."""
    engine, ended, _ = short_reopen
    late = _slow_change(engine, tmp_path, "big.idx", "b.txt")
    a, b = late.handles
    try:
        report = engine.simulate_restore()
        assert _hook(report, "rehydrate.files.reopen").outcome == "timeout"
        assert engine.status().state == "degraded"
    finally:
        late.release.set()
    assert engine.wait_ready(20), engine.status().state
    assert (a.changed, b.suspended, b.readline()) == (True, False, "b\n")


def test_a_snapshot_during_a_late_reopen_pass_stops_that_pass(short_reopen,
                                                              tmp_path: Path) -> None:
    """The late pass went on reopening handles the snapshot had just closed: their
    descriptors were in the image."""
    engine, ended, errors = short_reopen
    late = _slow_change(engine, tmp_path, "big.idx", "b.txt")
    a, b = late.handles
    try:
        late.restore_into_the_late_pass()
        report = engine.simulate_snapshot()  # the late pass is inside a's on_change
        assert report.ok, report.error
    finally:
        late.release.set()
    assert ended.wait(20)
    assert isinstance(errors[-1], files.ReopenFailed), errors
    assert "a snapshot began while it ran" in str(errors[-1])
    assert a.suspended and b.suspended and b._file.closed, "nothing open in the image"
    ended.clear()
    assert engine.simulate_restore(kind="resume").ok
    assert ended.wait(20)
    assert engine.status().state == "ready"
    assert (a.suspended, b.suspended, b.readline()) == (False, False, "b\n")


def test_a_late_reopen_pass_also_mends_a_notice_that_found_it_still_running(
        short_reopen, tmp_path: Path) -> None:
    """A second restore/resume notice while the late pass ran failed with
    HookStillRunning; the pass then succeeded, but its recovered() was refused (that run
    began after the pass): degraded for good."""
    engine, ended, _ = short_reopen
    late = _slow_change(engine, tmp_path, "big.idx", "b.txt")
    a, b = late.handles
    try:
        assert not engine.simulate_restore().ok
        report = engine.simulate_restore(kind="resume")
        error = _hook(report, "rehydrate.files.reopen").error
        assert type(error).__name__ == "HookStillRunning", repr(error)
        assert engine.status().state == "degraded"
    finally:
        late.release.set()
    assert engine.wait_ready(20), engine.status().state
    assert not a.suspended and not b.suspended


def test_a_late_reopen_pass_does_not_mend_another_hooks_failure(short_reopen,
                                                               tmp_path: Path) -> None:
    engine, ended, _ = short_reopen
    late = _slow_change(engine, tmp_path, "big.idx")
    (a,) = late.handles

    def reload() -> None:
        raise RuntimeError("no")

    engine.registry.register(reload, name="app.reload")
    try:
        assert not engine.simulate_restore().ok
        ended.clear()
        assert not engine.simulate_restore(kind="resume").ok
    finally:
        late.release.set()
    assert ended.wait(20)
    assert engine.status().state == "degraded", "still degraded by app.reload"
    assert engine.recovered("app.reload") and not a.suspended


def test_a_reopen_pass_that_failed_late_leaves_the_process_degraded(short_reopen,
                                                                    tmp_path: Path) -> None:
    engine, ended, errors = short_reopen
    late = _slow_change(engine, tmp_path, "big.idx", "gone.txt")
    kept = late.handles
    (tmp_path / "gone.txt").unlink()
    try:
        engine.simulate_restore()
    finally:
        late.release.set()
    assert ended.wait(20)  # the late pass ended, failing on gone.txt
    assert isinstance(errors[-1], files.FileGone), errors
    assert engine.status().state == "degraded"
    assert kept[0].changed


def test_a_snapshot_inside_the_last_handles_on_change_stops_the_late_pass(
        short_reopen, tmp_path: Path) -> None:
    """The late pass was in the LAST handle's on_change when a snapshot closed every
    handle: with no handle left to check, it completed, mended the resume's
    HookStillRunning, and the process was ready with every handle closed."""
    engine, ended, errors = short_reopen
    late = _slow_change(engine, tmp_path, "a.txt", "big.idx")  # big.idx the last
    a, big = late.handles
    try:
        late.restore_into_the_late_pass()
        assert engine.simulate_snapshot().ok
        assert a.suspended and big.suspended
        report = engine.simulate_restore(kind="resume")
        error = _hook(report, "rehydrate.files.reopen").error
        assert type(error).__name__ == "HookStillRunning", repr(error)
    finally:
        late.release.set()
    assert ended.wait(20)
    assert errors[-1] is None, errors  # reopened again for the resume, after stopping
    assert engine.status().state == "ready"
    assert (a.suspended, big.suspended, a.readline()) == (False, False, "a\n")


def test_a_resume_that_found_the_late_pass_running_is_reopened_by_it(
        short_reopen, tmp_path: Path) -> None:
    """A checkpoint and its resume while the late pass was in a slow on_change: the
    resume found it still running, the pass then stopped at the next handle (a snapshot
    had begun), and every handle stayed closed until the next snapshot."""
    engine, ended, errors = short_reopen
    late = _slow_change(engine, tmp_path, "big.idx", "b.txt")
    a, b = late.handles
    try:
        late.restore_into_the_late_pass()
        assert engine.simulate_snapshot().ok
        report = engine.simulate_restore(kind="resume")
        assert not report.ok and engine.status().state == "degraded"
    finally:
        late.release.set()
    assert ended.wait(20)
    assert errors[-1] is None, errors
    assert engine.status().state == "ready"
    assert (a.suspended, b.suspended, b.readline()) == (False, False, "b\n")


def test_a_late_pass_ending_during_the_run_that_found_it_running_mends_that_run(
        short_reopen, tmp_path: Path) -> None:
    """The late pass completed while the resume that found it still running ran its
    later hooks: recovered(since=) refused (that run began after the pass) and the
    fallback saw no degraded state yet: degraded for good with every handle open."""
    engine, ended, _ = short_reopen
    late = _slow_change(engine, tmp_path, "big.idx", "b.txt")
    a, b = late.handles

    def warm_cache() -> None:  # after rehydrate.files.reopen in the resume run
        late.release.set()
        assert ended.wait(20)

    try:
        assert not engine.simulate_restore().ok
        ended.clear()
        engine.registry.register(warm_cache, name="app.warm")
        report = engine.simulate_restore(kind="resume")
    finally:
        late.release.set()
    error = _hook(report, "rehydrate.files.reopen").error
    assert type(error).__name__ == "HookStillRunning", repr(error)
    assert report.recovered == ("rehydrate.files.reopen",)  # mended within the run
    assert engine.status().state == "ready"
    assert not a.suspended and not b.suspended


def test_a_run_that_fails_the_hook_after_the_late_pass_mended_is_mended_at_its_end(
        short_reopen, tmp_path: Path) -> None:
    """The pass had reopened every handle and looked for a failure to mend before the
    run reached the hook, whose thread had not ended yet: HookStillRunning after the
    mend, and degraded for good."""
    engine, ended, _ = short_reopen
    mgr = files.manager(engine)
    inner = mgr._after_restore
    done, hold = threading.Event(), threading.Event()

    def after_restore(ctx):  # done with every handle, the thread not ended yet
        try:
            inner(ctx)
        finally:
            done.set()
            hold.wait(30)

    mgr._after_restore = after_restore  # type: ignore[method-assign]
    late = _slow_change(engine, tmp_path, "big.idx")
    (a,) = late.handles

    def early() -> None:  # before rehydrate.files.reopen in the resume run
        late.release.set()
        assert done.wait(20)

    try:
        assert not engine.simulate_restore().ok
        engine.registry.register(early, phase="environment", name="app.early")
        engine.registry.register(hold.set, name="app.late")
        report = engine.simulate_restore(kind="resume")
    finally:
        late.release.set()
        hold.set()
    error = _hook(report, "rehydrate.files.reopen").error
    assert type(error).__name__ == "HookStillRunning", repr(error)
    assert engine.status().state == "ready"
    assert not a.suspended


def test_a_snapshot_refused_during_a_late_pass_leaves_the_handles_it_closed_open(
        short_reopen, tmp_path: Path) -> None:
    """A before-snapshot pass refused (by another hook) while a late reopen pass was in
    a slow on_change: the resume after it found the pass still running and reopened
    nothing, so the handles that were open before the refused snapshot stayed closed
    until that on_change returned (for good, were it hung)."""
    engine, ended, errors = short_reopen
    late = _slow_change(engine, tmp_path, "a.txt", "big.idx", "b.txt")
    a, big, b = late.handles

    def refuse() -> None:
        raise RuntimeError("not now")

    try:
        late.restore_into_the_late_pass()  # a.txt and big.idx open, b.txt not yet
        engine.registry.register(refuse, event="snapshot", phase="environment",
                                 name="app.refuse")
        snap = engine.simulate_snapshot()
        assert not snap.ok and _hook(snap, "rehydrate.files.close").outcome == "ok"
        report = engine.simulate_restore(kind="resume")  # as the control socket does
        error = _hook(report, "rehydrate.files.reopen").error
        assert type(error).__name__ == "HookStillRunning", repr(error)
        assert not ended.is_set(), "the late pass is still in big.idx's on_change"
        assert (a.suspended, big.suspended, b.suspended) == (False, False, True)
        assert a.readline() == "a\n" and big.readline() == "new content\n"
    finally:
        late.release.set()
    assert ended.wait(20)
    assert errors[-1] is None, errors
    assert engine.status().state == "ready"
    assert (b.suspended, b.readline()) == (False, "b\n")


def test_a_resume_in_the_moment_the_stopped_late_pass_ends_is_reopened(
        short_reopen, tmp_path: Path) -> None:
    """The late pass stopped at a snapshot with no run after it yet (nothing owed), and
    a resume came before its thread had ended: HookStillRunning, and every handle stayed
    closed (degraded) until the next restore or resume."""
    engine, ended, errors = short_reopen
    mgr = files.manager(engine)
    hold = _hold_the_pass_thread(mgr)
    late = _slow_change(engine, tmp_path, "big.idx", "b.txt")
    big, b = late.handles
    try:
        _stop_the_late_pass(late, ended)
        assert isinstance(errors[-1], files.ReopenFailed), errors  # stopped, nothing owed
        report = engine.simulate_restore(kind="resume")
        error = _hook(report, "rehydrate.files.reopen").error
        assert type(error).__name__ == "HookStillRunning", repr(error)
        assert engine.status().state == "ready"
        assert (big.suspended, b.suspended, b.readline()) == (False, False, "b\n")
    finally:
        late.release.set()
        hold.set()


def test_no_reopen_for_a_run_while_a_newer_snapshot_is_pending(short_reopen,
                                                              tmp_path: Path) -> None:
    """A run's report that found the reopen hook still running, handed over while a
    newer before-snapshot pass is pending (its checkpoint to come): reopening for that
    run then would put the descriptors in the image."""
    from types import SimpleNamespace

    from rehydrate._context import HookStillRunning

    engine, ended, errors = short_reopen
    late = _slow_change(engine, tmp_path, "big.idx", "b.txt")
    big, b = late.handles
    try:
        _stop_the_late_pass(late, ended)
        assert isinstance(errors[-1], files.ReopenFailed), errors
        assert engine.snapshot_pending
        stale_run = SimpleNamespace(kind="resume", ok=False, hooks=[SimpleNamespace(
            name="rehydrate.files.reopen", error=HookStillRunning("still running"))])
        files.manager(engine)._on_report(stale_run)  # type: ignore[arg-type]
        assert big.suspended and b.suspended, "nothing reopened into the image"
    finally:
        late.release.set()
    assert engine.simulate_restore(kind="resume").ok
    assert (big.suspended, b.suspended, b.readline()) == (False, False, "b\n")


def test_no_reopen_when_a_snapshot_begins_during_the_pending_check(
        short_reopen, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's report read the pass count after checking snapshot_pending: a new
    before-snapshot pass whose close ran between the two was taken as the baseline
    (stale() stayed False), and every handle was reopened while that snapshot was
    pending (its descriptors in the image)."""
    engine, ended, errors = short_reopen
    mgr = files.manager(engine)
    hold = _hold_the_pass_thread(mgr)
    late = _slow_change(engine, tmp_path, "big.idx", "b.txt")
    big, b = late.handles
    real = type(engine).snapshot_pending
    armed = [False]

    def snapshot_pending(self):
        pending = real.fget(self)
        if armed[0] and not pending:
            armed[0] = False
            # The next snapshot's close, on another thread, just after this read.
            mgr._before_snapshot()
        return pending

    try:
        _stop_the_late_pass(late, ended)
        assert isinstance(errors[-1], files.ReopenFailed), errors  # stopped, nothing owed
        monkeypatch.setattr(type(engine), "snapshot_pending", property(snapshot_pending))
        armed[0] = True
        report = engine.simulate_restore(kind="resume")
        error = _hook(report, "rehydrate.files.reopen").error
        assert type(error).__name__ == "HookStillRunning", repr(error)
        assert not armed[0], "the new pass ran inside the check"
        assert big.suspended and b.suspended, "nothing reopened into the pending image"
    finally:
        late.release.set()
        hold.set()


@pytest.mark.parametrize(("bad", "error", "shown"), [
    (0, ValueError, "not 0"), (-1, ValueError, "not -1"), (float("nan"), ValueError, "not nan"),
    ("10", TypeError, "not str")])
def test_a_bad_reopen_timeout_is_refused_before_anything_is_made(
        engine, tmp_path: Path, bad: object, error: type[Exception], shown: str) -> None:
    (tmp_path / "a.txt").write_text("a\n")
    with pytest.raises(error) as caught:
        files.open(tmp_path / "a.txt", engine=engine, reopen_timeout=bad)  # type: ignore[arg-type]
    assert str(caught.value) == ("reopen_timeout must be a number of seconds > 0 and at most "
                                 f"31536000 (a year), {shown}")
    assert files.manager(engine).handles() == []


def test_reopen_timeout_is_the_largest_ask_of_the_open_handles_and_never_below_30s(
        engine, tmp_path: Path) -> None:
    """A first ask below 30 s shrank the hook's timeout for every other handle, an ask
    counted for good even when its open failed or its handle was closed."""
    mgr = files.manager(engine)
    (tmp_path / "a.txt").write_text("a\n")

    def timeouts() -> list[float]:
        return [h.timeout for h in engine.builtins.hooks("restore")
                if h.name == "rehydrate.files.reopen"]

    files.open(tmp_path / "a.txt", engine=engine)
    small = files.open(tmp_path / "a.txt", engine=engine, reopen_timeout=5)
    assert (mgr.reopen_timeout, timeouts()) == (30.0, [30.0])
    with pytest.raises(FileNotFoundError):
        files.open(tmp_path / "missing.txt", engine=engine, reopen_timeout=90)
    assert mgr.reopen_timeout == 30.0, "a failed open asks nothing"
    big = files.open(tmp_path / "a.txt", engine=engine, reopen_timeout=120)
    bigger = files.sqlite(tmp_path / "app.db", engine=engine, reopen_timeout=200)
    assert (mgr.reopen_timeout, timeouts()) == (200.0, [200.0])
    bigger.close()
    assert (mgr.reopen_timeout, timeouts()) == (120.0, [120.0])
    big.close()
    small.close()
    assert (mgr.reopen_timeout, timeouts()) == (30.0, [30.0])
    files.volume(tmp_path, engine=engine, reopen_timeout=60)
    files.volume(tmp_path, engine=engine, reopen_timeout=40)
    assert (mgr.reopen_timeout, timeouts()) == (60.0, [60.0]), "a volume's largest ask stays"


def test_a_close_racing_an_open_does_not_write_back_an_older_reopen_timeout(
        engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The asks were counted outside the manager's lock: a close() that counted them
    before an open(reopen_timeout=120) applied its older count after it."""
    mgr = files.manager(engine)
    (tmp_path / "a.txt").write_text("a\n")
    small = files.open(tmp_path / "a.txt", engine=engine, reopen_timeout=40)
    counted, opened = threading.Event(), threading.Event()
    real = mgr.handles

    def handles():  # the closer has counted; the opener goes first
        found = real()
        if threading.current_thread().name == "closer":
            counted.set()
            assert opened.wait(20)
        return found

    monkeypatch.setattr(mgr, "handles", handles)

    def close() -> None:
        try:
            small.close()
        finally:
            counted.set()

    closer = threading.Thread(target=close, name="closer")
    closer.start()
    try:
        assert counted.wait(20)
        big = files.open(tmp_path / "a.txt", engine=engine, reopen_timeout=120)
    finally:
        opened.set()
        closer.join(20)
    assert (mgr.reopen_timeout, big._reopen_ask) == (120.0, 120.0)


def test_a_dropped_handles_reopen_timeout_ends_at_the_next_open(engine,
                                                                 tmp_path: Path) -> None:
    """Only a handle that asked a reopen_timeout itself made the asks counted again."""
    import gc

    mgr = files.manager(engine)
    (tmp_path / "a.txt").write_text("a\n")
    dropped = files.open(tmp_path / "a.txt", engine=engine, reopen_timeout=600)
    assert mgr.reopen_timeout == 600.0
    del dropped
    gc.collect()
    kept = files.open(tmp_path / "a.txt", engine=engine)
    assert mgr.reopen_timeout == 30.0 and kept.readline() == "a\n"


def _snapshot_and_restore(engine: Lifecycle, kind: str) -> None:
    """A simulated snapshot and a restore of ``kind`` (restore or resume), both ok."""
    report = engine.simulate_snapshot()
    assert report.ok, report.error
    assert engine.simulate_restore(kind=kind).ok


def _unreadable(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """``path`` unreadable as for another user (the tests may run as root)."""
    real = files.read_regular

    def read_regular(p, *args, **kwargs):
        if os.fspath(p) == str(path):
            raise PermissionError(13, "Permission denied", os.fspath(p))
        return real(p, *args, **kwargs)

    monkeypatch.setattr(files, "read_regular", read_regular)


def test_an_unreadable_identity_file_is_as_missing_with_one_warning(
        engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Another user's identity file (mode 0600) made files.volume() raise
    PermissionError; one that became unreadable later refused every snapshot with a bare
    PermissionError, before any handle was closed."""
    early, late = tmp_path / "early", tmp_path / "late"
    early.mkdir()
    late.mkdir()
    (early / files.IDENTITY_FILE).write_text("someone-else\n")
    _unreadable(monkeypatch, early / files.IDENTITY_FILE)
    assert files.volume(early, engine=engine).identity is None
    files.volume(late, engine=engine)
    (late / "a.txt").write_text("a\n")
    f = files.open(late / "a.txt", engine=engine)
    _unreadable(monkeypatch, late / files.IDENTITY_FILE)
    for _ in range(2):
        report = engine.simulate_snapshot()
        assert report.ok, report.error
        assert f.suspended
        assert engine.simulate_restore(kind="resume").ok
    assert f.read() == "a\n" and not f.changed
    warnings = _identity_warnings(caplog)
    assert len(warnings) == 2, warnings  # one per volume, not one per pass
    for vol, w in zip((early, late), warnings, strict=True):
        assert w.startswith(f"volume {vol}: identity file {vol / files.IDENTITY_FILE} "
                            "unreadable (EACCES: Permission denied); treated as missing"), w
    assert (early / files.IDENTITY_FILE).read_text() == "someone-else\n", "never replaced"


def test_a_volume_that_cannot_be_checked_is_named_and_the_handles_are_closed_anyway(
        engine, tmp_path: Path) -> None:
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "a.txt").write_text("a\n")
    files.volume(vol, engine=engine)
    f = files.open(vol / "a.txt", engine=engine)
    (vol / files.IDENTITY_FILE).unlink()
    (vol / files.IDENTITY_FILE).mkdir()
    report = engine.simulate_snapshot()
    error = _hook(report, "rehydrate.files.close").error
    assert isinstance(error, files.SnapshotRefused), repr(error)
    assert str(error).startswith(f"volume {vol}: OSError: "), str(error)
    assert "not a regular file (a directory)" in str(error) and "\n" not in str(error)
    assert f.suspended, "the handles are closed all the same (the resume reopens them)"
    assert engine.simulate_restore(kind="resume") is not None
    assert not f.suspended


def test_sqlite_registrations_and_session_pragmas_survive_a_snapshot(engine,
                                                                    tmp_path: Path) -> None:
    """Functions, collations, the authorizer and PRAGMA foreign_keys set through the
    handle were lost at every snapshot, even a plain resume."""
    db = files.sqlite(tmp_path / "app.db", engine=engine)
    db.create_function("slug", 1, lambda s: "old")
    db.create_function("slug", 1, lambda s: s.lower().replace(" ", "-"), deterministic=True)

    class Total:
        def __init__(self) -> None:
            self.n = 0

        def step(self, v: int) -> None:
            self.n += v

        def value(self) -> int:
            return self.n

        def inverse(self, v: int) -> None:
            self.n -= v

        def finalize(self) -> int:
            return self.n

    db.create_aggregate("total2", 1, Total)
    db.create_window_function("wtotal", 1, Total)
    db.create_collation("backwards", lambda a, b: (a < b) - (a > b))
    denied: list[str] = []

    def authorizer(action, arg1, arg2, dbname, source):
        if arg1 == "secret":
            denied.append(arg1)
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    db.execute("CREATE TABLE t (x)")
    db.execute("CREATE TABLE secret (x)")
    db.executemany("INSERT INTO t VALUES (?)", [(1,), (2,), (3,)])
    db.commit()
    db.set_authorizer(authorizer)
    db.execute("PRAGMA foreign_keys = ON")
    db.execute("PRAGMA busy_timeout = 1234")

    def state() -> tuple[object, ...]:
        with pytest.raises(sqlite3.DatabaseError):
            db.execute("SELECT * FROM secret")
        return (db.execute("SELECT slug('Hello World')").fetchone()[0],
                db.execute("SELECT total2(x) FROM t").fetchone()[0],
                db.execute("SELECT wtotal(x) OVER (ORDER BY x) FROM t").fetchall(),
                db.execute("SELECT CAST(x AS TEXT) AS s FROM t ORDER BY s COLLATE backwards"
                           ).fetchall(),
                db.execute("PRAGMA foreign_keys").fetchone()[0],
                db.execute("PRAGMA busy_timeout").fetchone()[0])

    before = state()
    assert before == ("hello-world", 6, [(1,), (3,), (6,)], [("3",), ("2",), ("1",)], 1,
                      1234)
    for kind in ("resume", "restore"):
        _snapshot_and_restore(engine, kind)
        assert state() == before, kind
    assert denied == ["secret"] * 3


def test_sqlite_refuses_a_snapshot_that_would_lose_temp_objects_or_memory_attachments(
        engine, tmp_path: Path) -> None:
    db = files.sqlite(tmp_path / "app.db", engine=engine)
    db.execute("CREATE TEMP TABLE session (k, v)")
    db.execute("INSERT INTO session VALUES ('user', 42)")
    db.execute("ATTACH DATABASE ':memory:' AS scratch")
    db.commit()
    report = engine.simulate_snapshot()
    error = _hook(report, "rehydrate.files.close").error
    assert isinstance(error, files.SnapshotRefused) and "\n" not in str(error)
    assert str(error).startswith(
        f"SQLite database {tmp_path / 'app.db'} would lose TEMP table session, attached "
        "in-memory database scratch"), str(error)
    assert engine.simulate_restore(kind="resume").ok
    assert db.execute("SELECT v FROM session").fetchone() == (42,), "nothing was lost"
    db.execute("DROP TABLE session")
    db.execute("DETACH DATABASE scratch")
    report = engine.simulate_snapshot()
    assert report.ok, report.error


def test_sqlite_attached_database_files_are_attached_again(engine, tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "cache.db") as c:
        c.execute("CREATE TABLE kv (k, v)")
        c.execute("INSERT INTO kv VALUES ('a', 1)")
    c.close()
    db = files.sqlite(tmp_path / "app.db", engine=engine)
    db.execute("ATTACH DATABASE ? AS \"my cache\"", (str(tmp_path / "cache.db"),))
    db.execute('INSERT INTO "my cache".kv VALUES (\'b\', 2)')
    db.commit()
    assert engine.simulate_snapshot().ok
    assert engine.simulate_restore(kind="resume").ok
    assert db.execute('SELECT k FROM "my cache".kv ORDER BY k').fetchall() == [("a",), ("b",)]
    assert engine.simulate_snapshot().ok
    (tmp_path / "cache.db").unlink()
    report = engine.simulate_restore()
    error = _hook(report, "rehydrate.files.reopen").error
    assert isinstance(error, files.ReopenFailed), repr(error)
    assert f"attached database 'my cache' ({tmp_path / 'cache.db'}) is gone" in str(error)
    assert db.suspended and not (tmp_path / "cache.db").exists(), "never made empty"


def test_a_handle_opened_through_a_symlink_is_managed_in_the_audit(engine,
                                                                   tmp_path: Path) -> None:
    """/data -> /mnt/disk1: the descriptor's /proc link names the real path, which the
    handle's path did not match (managed: False in audit and doctor)."""
    vol = _real_fds_on_a_volume(engine, tmp_path)
    os.symlink(vol, tmp_path / "data")
    (vol / "index.txt").write_text("x\n")
    (vol / "app.db").touch()
    files.volume(tmp_path / "data", engine=engine)
    f = files.open(tmp_path / "data" / "index.txt", engine=engine)
    db = files.sqlite(tmp_path / "data" / "app.db", engine=engine)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (x)")
    found = {o.path: o.managed for o in files.audit(engine=engine)}
    assert found.get(str(vol / "index.txt")) is True, found
    assert found.get(str(vol / "app.db")) is True, found
    assert found.get(str(vol / "app.db-wal")) is True, found
    assert all(found.values()), found
    assert f and db


def test_the_audit_warns_about_a_second_unmanaged_connection_to_a_managed_database(
        engine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The audit runs after rehydrate.files.close: every managed handle is closed then,
    so a descriptor on its path is the application's own (a plain sqlite3.connect to the
    same WAL database). It was marked managed and the WAL warning never came."""
    vol = _real_fds_on_a_volume(engine, tmp_path)
    db = files.sqlite(vol / "app.db", engine=engine)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (x)")
    db.commit()
    other = sqlite3.connect(vol / "app.db")
    try:
        other.execute("INSERT INTO t VALUES (1)")
        other.commit()
        with caplog.at_level("WARNING", logger="rehydrate"):
            report = engine.simulate_snapshot()
        assert report.ok, report.table()
        last = files.manager(engine).last_audit
        assert {f.path for f in last} >= {str(vol / "app.db"), str(vol / "app.db-wal")}
        assert not any(f.managed for f in last), last
        assert f"SQLite database(s) {vol / 'app.db'} in WAL mode held open unmanaged" in (
            caplog.text)
    finally:
        other.close()
    assert engine.simulate_restore(kind="resume").ok
    found = {o.path: o.managed for o in files.audit(engine=engine)}
    assert found.get(str(vol / "app.db")) is True, "reopened: its own descriptor again"


def test_every_component_registering_a_volume_hears_of_its_change(engine,
                                                                  tmp_path: Path) -> None:
    """A second files.volume(same path, on_change=cb2) dropped cb2 silently."""
    calls: list[str] = []

    def cache(v: files.Volume) -> None:
        calls.append("cache")
        raise RuntimeError("cannot rebuild the cache")

    v1 = files.volume(tmp_path, engine=engine, on_change=cache)
    v2 = files.volume(tmp_path, engine=engine, on_change=lambda v: calls.append("index"))
    v3 = files.volume(str(tmp_path) + "/", engine=engine, on_change=cache)  # the same again
    v4 = files.volume(tmp_path, engine=engine)
    assert v1 is v2 is v3 is v4 and files.manager(engine).volumes() == [v1]
    assert engine.simulate_snapshot().ok
    (tmp_path / files.IDENTITY_FILE).write_text("another-volume\n")
    report = engine.simulate_restore()
    assert calls == ["cache", "index"], "each once, the second despite the first failing"
    error = str(_hook(report, "rehydrate.files.reopen").error)
    assert f"volume {tmp_path}: " in error and "cannot rebuild the cache" in error, error


def test_a_fifo_is_refused_before_it_is_opened(engine,
                                                                   tmp_path: Path) -> None:
    """A managed FIFO made every snapshot fail with "not seekable" (and its open waited
    for a writer)."""
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # so an open() for reading returns
    try:
        with pytest.raises(ValueError, match=rf"^rehydrate.files.open manages seekable "
                                             rf"files: {fifo} is a FIFO that cannot seek"):
            files.open(fifo, engine=engine)
    finally:
        os.close(writer)
    assert files.manager(engine).handles() == []
    assert engine.simulate_snapshot().ok


def test_an_access_copy_mapping_is_refused(engine, tmp_path: Path) -> None:
    """Its private changes were dropped by the unmap before every snapshot."""
    import mmap

    p = tmp_path / "model.bin"
    p.write_bytes(bytes(16))
    with pytest.raises(ValueError, match="ACCESS_COPY mapping of .*model.bin would lose"):
        files.mmap(p, access=mmap.ACCESS_COPY, engine=engine)
    assert files.manager(engine).handles() == []


def test_a_managed_mapping_gives_its_current_mmap_for_buffer_users(engine,
                                                                   tmp_path: Path) -> None:
    import mmap
    import struct

    p = tmp_path / "ring.bin"
    p.write_bytes(bytes(16))
    ring = files.mmap(p, engine=engine)
    before = ring.mapping
    assert isinstance(before, mmap.mmap)
    struct.pack_into("<I", ring.mapping, 0, 7)
    assert engine.simulate_snapshot().ok
    assert engine.simulate_restore(kind="resume").ok
    assert ring.mapping is not before and before.closed
    assert struct.unpack_from("<I", ring.mapping, 0) == (7,)
    with memoryview(ring.mapping) as view:
        assert bytes(view[:4]) == struct.pack("<I", 7)


def test_sqlite_temp_objects_and_memory_attachments_made_by_on_connect_are_kept(
        engine, tmp_path: Path) -> None:
    """on_connect makes them again for every connection: they refused every snapshot."""
    def on_connect(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS main.events (id INTEGER PRIMARY KEY, at)")
        conn.execute("CREATE TEMP VIEW IF NOT EXISTS recent AS "
                     "SELECT * FROM main.events ORDER BY at DESC LIMIT 10")
        conn.execute("ATTACH DATABASE ':memory:' AS scratch")
        conn.execute("CREATE TABLE scratch.work (x)")

    db = files.sqlite(tmp_path / "app.db", engine=engine, on_connect=on_connect)
    db.execute("INSERT INTO events (at) VALUES (1)")
    db.commit()
    for kind in ("restore", "resume"):
        _snapshot_and_restore(engine, kind)
        assert db.execute("SELECT count(*) FROM recent").fetchone() == (1,)
        assert db.execute("SELECT count(*) FROM scratch.work").fetchone() == (0,)
    db.execute("CREATE TEMP TABLE session (k)")
    db.execute("ATTACH DATABASE ':memory:' AS mine")
    error = _hook(engine.simulate_snapshot(), "rehydrate.files.close").error
    assert str(error).startswith(f"SQLite database {tmp_path / 'app.db'} would lose TEMP "
                                 "table session, attached in-memory database mine ("), error


def test_sqlite_row_and_text_factories_do_not_change_rehydrates_own_queries(
        engine, tmp_path: Path) -> None:
    """A dict row_factory set on the handle refused every snapshot (KeyError: 1), and
    text_factory=bytes made TEMP names bytes."""
    db = files.sqlite(tmp_path / "app.db", engine=engine)
    db.row_factory = lambda cur, row: {d[0]: v for d, v in zip(cur.description, row)}
    db.text_factory = bytes
    db.execute("CREATE TABLE t (x)")
    db.commit()
    for kind in ("resume", "restore"):
        _snapshot_and_restore(engine, kind)
    assert db.execute("SELECT count(*) AS n FROM t").fetchone() == {"n": 0}
    db.execute("CREATE TEMP TABLE session (k)")
    error = _hook(engine.simulate_snapshot(), "rehydrate.files.close").error
    assert "would lose TEMP table session (" in str(error), error


def test_a_leftover_temp_sqlite_sequence_does_not_refuse_snapshots(engine,
                                                                   tmp_path: Path) -> None:
    """A dropped TEMP AUTOINCREMENT table leaves temp.sqlite_sequence, which cannot be
    dropped: every snapshot was refused for the connection's life."""
    db = files.sqlite(tmp_path / "app.db", engine=engine)
    db.execute("CREATE TEMP TABLE scratch (id INTEGER PRIMARY KEY AUTOINCREMENT, v)")
    db.execute("INSERT INTO scratch (v) VALUES (1)")
    db.execute("DROP TABLE scratch")
    db.commit()
    assert db.execute("SELECT name FROM temp.sqlite_master").fetchall() == [
        ("sqlite_sequence",)]
    report = engine.simulate_snapshot()
    assert report.ok, report.error


def test_sqlite_internal_statements_run_without_the_applications_callbacks(
        engine, tmp_path: Path) -> None:
    """An authorizer that lets user queries read only the app's tables refused every
    snapshot (sqlite_master), and a trace callback saw rehydrate's own statements."""
    db = files.sqlite(tmp_path / "app.db", engine=engine)
    db.execute("CREATE TABLE items (x)")
    db.commit()
    denied: list[str] = []
    readable = {"items"}

    def authorizer(action, arg1, arg2, dbname, source):
        if action == sqlite3.SQLITE_READ and arg1 not in readable:
            denied.append(arg1)
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    seen: list[str] = []
    db.set_authorizer(authorizer)
    db.set_trace_callback(seen.append)
    db.set_progress_handler(lambda: 1, 1)  # would interrupt every statement
    db.set_progress_handler(None, 1)
    db.set_progress_handler(lambda: 0, 1)
    for kind in ("resume", "restore"):
        _snapshot_and_restore(engine, kind)
    assert seen == [] and denied == []
    assert db.execute("SELECT count(*) FROM items").fetchone() == (0,)
    assert seen == ["SELECT count(*) FROM items"], "set again after the snapshot"
    readable.add("sqlite_temp_master")
    db.execute("CREATE TEMP TABLE session (k)")  # a refused snapshot: the connection stays
    assert not engine.simulate_snapshot().ok
    assert engine.simulate_restore(kind="resume").ok
    seen.clear()
    with pytest.raises(sqlite3.DatabaseError, match="prohibited|not authorized"):
        db.execute("SELECT * FROM sqlite_master")
    assert denied == ["sqlite_master"] and seen == [], "the callbacks are set again"


def test_sqlite_callback_wrappers_call_nothing_but_the_applications_callback(
        engine, tmp_path: Path) -> None:
    """The pass-over check read a threading.local with a default: on a thread that never
    ran rehydrate's statements (a web server's worker), each call of a progress handler
    set in on_connect went through an AttributeError (a query ~4x slower than plain
    sqlite3). Between rehydrate's own statements, the wrappers make no call of their own
    on any thread: they only call the application's callback."""
    calls: list[str] = []

    def on_connect(conn: sqlite3.Connection) -> None:
        conn.set_authorizer(lambda *args: calls.append("authorizer") or sqlite3.SQLITE_OK)
        conn.set_progress_handler(lambda: calls.append("progress") or 0, 10)
        conn.set_trace_callback(lambda sql: calls.append("trace"))

    db = files.sqlite(tmp_path / "app.db", engine=engine, on_connect=on_connect)
    made: dict[str, list[str]] = {}

    def query(name: str) -> None:
        def profile(frame, event, arg):
            if event == "c_call" and frame.f_code.co_qualname.startswith(
                    "_quiet_callback.<locals>."):
                made.setdefault(name, []).append(
                    f"{frame.f_code.co_name}: {getattr(arg, '__name__', arg)}")
        sys.setprofile(profile)  # this thread's
        try:
            db.execute("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
                       "WHERE x < 1000) SELECT sum(x) FROM c").fetchone()
        finally:
            sys.setprofile(None)

    query("the thread that opened the handle")
    worker = threading.Thread(target=query, args=("another thread",))
    worker.start()
    worker.join(20)
    assert {"authorizer", "progress", "trace"} <= set(calls), "the wrappers ran"
    assert made == {}


def test_sqlite_callbacks_stay_on_for_other_threads_while_the_close_runs(
        engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The close cleared the authorizer on the live connection while it ran its own
    statements: another thread's query in that window was not checked."""
    db = files.sqlite(tmp_path / "app.db", engine=engine)
    db.execute("CREATE TABLE secrets (v)")
    db.execute("INSERT INTO secrets VALUES ('s3cr3t')")
    db.commit()
    seen: list[str] = []
    db.set_authorizer(lambda action, arg1, *rest: (
        sqlite3.SQLITE_DENY if arg1 == "secrets" else sqlite3.SQLITE_OK))
    db.set_trace_callback(seen.append)
    db.execute("CREATE TEMP TABLE session (k)")  # the snapshot is refused: the connection stays
    inside, done = threading.Event(), threading.Event()
    real = files._connection_state

    def connection_state(conn, **kwargs):
        inside.set()
        assert done.wait(20)
        return real(conn, **kwargs)

    monkeypatch.setattr(files, "_connection_state", connection_state)
    reports: list = []
    snapshot = threading.Thread(target=lambda: reports.append(engine.simulate_snapshot()))
    snapshot.start()
    try:
        assert inside.wait(20)
        seen.clear()
        for run in (db.execute, db.cursor().execute):
            with pytest.raises(sqlite3.DatabaseError, match="prohibited|not authorized"):
                run("SELECT v FROM secrets")
        db.execute("SELECT count(*) FROM session")
    finally:
        done.set()
        snapshot.join(20)
    assert seen == ["SELECT count(*) FROM session"], "traced, but not rehydrate's own"
    assert not reports[0].ok
    assert engine.simulate_restore(kind="resume").ok


def test_sqlite_uri_attachment_is_attached_again_by_its_uri(engine, tmp_path: Path) -> None:
    """ATTACH 'file:...?mode=ro' came back writable: attached again by plain path."""
    with sqlite3.connect(tmp_path / "ro.db") as c:
        c.execute("CREATE TABLE t (x)")
    c.close()
    with sqlite3.connect(tmp_path / "ro2.db") as c:
        c.execute("CREATE TABLE t (x)")
    c.close()
    db = files.sqlite(tmp_path / "app.db", engine=engine)
    db.execute(f"ATTACH DATABASE 'file:{tmp_path}/ro.db?mode=ro' AS ro")
    db.execute('ATTACH ? AS "other ro"', (f"file:{tmp_path}/ro2.db?mode=ro",))
    db.executescript(f"ATTACH '{tmp_path}/ro.db' AS rw;")  # a path: read-write
    for _ in range(2):
        assert engine.simulate_snapshot().ok
        assert engine.simulate_restore(kind="resume").ok
        for schema in ("ro", '"other ro"'):
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                db.execute(f"INSERT INTO {schema}.t VALUES (1)")
            db.rollback()
        db.execute("INSERT INTO rw.t VALUES (1)")
        db.commit()


def test_sqlite_attach_statements_are_read_as_sqlite_reads_them(engine,
                                                                 tmp_path: Path) -> None:
    """A double-quoted file name, a schema name as a string, a comment inside, were
    missed (attached again read-write); a URI in a comment was taken for the ATTACH's
    (attached again read-only); a DETACH left the URI noted for a later ATTACH."""
    with sqlite3.connect(tmp_path / "ro.db") as c:
        c.execute("CREATE TABLE t (x)")
    c.close()
    ro = f"file:{tmp_path}/ro.db?mode=ro"
    db = files.sqlite(tmp_path / "app.db", engine=engine)
    db.execute(f'ATTACH "{ro}" AS dq')
    db.execute(f"ATTACH '{ro}' AS 'sq'")
    db.execute(f"ATTACH /* read-only */ DATABASE '{ro}' AS cmt")
    db.execute("ATTACH :uri AS [named]", {"uri": ro})
    db.execute(f"ATTACH '{tmp_path}/ro.db' AS rw -- was: ATTACH '{ro}' AS rw")
    db.executescript(f"ATTACH '{ro}' AS again; DETACH DATABASE again;")
    db.cursor().execute("ATTACH ? AS again", (str(tmp_path / "ro.db"),))  # read-write
    with pytest.raises(sqlite3.OperationalError, match="already in use"):
        db.execute("ATTACH ? AS rw", (ro,))  # failed: rw stays read-write

    def writable(schema: str) -> bool:
        try:
            db.execute(f"INSERT INTO {schema}.t VALUES (1)")
        except sqlite3.OperationalError as exc:
            assert "readonly" in str(exc)
            return False
        finally:
            db.rollback()
        return True

    schemas = ("dq", "sq", "cmt", "named", "rw", "again")
    expected = [False, False, False, False, True, True]
    assert [writable(s) for s in schemas] == expected
    assert engine.simulate_snapshot().ok
    assert engine.simulate_restore(kind="resume").ok
    assert [writable(s) for s in schemas] == expected


def test_on_connect_pragmas_win_over_those_saved_at_the_close(engine,
                                                              tmp_path: Path) -> None:
    """The saved values were set after on_connect: the restored clone's configuration
    was overridden by the original's. (A PRAGMA on_connect leaves at SQLite's default
    is not told from one it does not set: the saved value is set.)"""
    cfg = {"busy": 1000}

    def on_connect(conn: sqlite3.Connection) -> None:
        conn.execute(f"PRAGMA busy_timeout = {cfg['busy']}")
        conn.execute("PRAGMA foreign_keys = ON")

    db = files.sqlite(tmp_path / "app.db", engine=engine, on_connect=on_connect)
    db.execute("PRAGMA recursive_triggers = ON")  # on_connect does not set it: kept
    db.execute("PRAGMA foreign_keys = OFF")  # on_connect sets it again: its value
    assert engine.simulate_snapshot().ok
    cfg.update(busy=30000)
    assert engine.simulate_restore().ok
    assert [db.execute(f"PRAGMA {p}").fetchone()[0]
            for p in ("busy_timeout", "foreign_keys", "recursive_triggers")] == [30000, 1, 1]


@pytest.mark.parametrize("pragma", ["foreign_keys", "query_only"])
def test_saved_pragmas_are_set_after_on_connect_not_before(engine, tmp_path: Path,
                                                           pragma: str) -> None:
    """Set before on_connect, a saved query_only=ON failed its writes (the reopen failed)
    and foreign_keys=ON made its table rebuild cascade the children's deletion."""
    def on_connect(conn: sqlite3.Connection) -> None:
        conn.executescript("""
            CREATE TABLE IF NOT EXISTS parent (id INTEGER PRIMARY KEY);
            CREATE TABLE IF NOT EXISTS child (
                id INTEGER PRIMARY KEY, pid REFERENCES parent(id) ON DELETE CASCADE);
            INSERT OR IGNORE INTO parent VALUES (1);
            INSERT OR IGNORE INTO child VALUES (10, 1);
            BEGIN;
            CREATE TABLE parent_new (id INTEGER PRIMARY KEY);
            INSERT INTO parent_new SELECT id FROM parent;
            DROP TABLE parent;
            ALTER TABLE parent_new RENAME TO parent;
            COMMIT;""")  # a rebuild migration: safe with foreign keys off, the default

    db = files.sqlite(tmp_path / "app.db", engine=engine, on_connect=on_connect)
    db.execute(f"PRAGMA {pragma} = ON")
    for kind in ("resume", "restore"):
        assert engine.simulate_snapshot().ok
        report = engine.simulate_restore(kind=kind)
        assert report.ok, report.error
        assert db.execute("SELECT count(*) FROM child").fetchone() == (1,)
        assert db.execute(f"PRAGMA {pragma}").fetchone() == (1,)


def test_sqlite_rows_in_temp_tables_made_by_on_connect_refuse_the_snapshot(
        engine, tmp_path: Path) -> None:
    """TEMP tables and in-memory databases made by on_connect were let through by name:
    the rows the application put in them were lost without a word."""
    def on_connect(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TEMP TABLE IF NOT EXISTS cart (item)")
        conn.execute("CREATE INDEX IF NOT EXISTS temp.cart_item ON cart (item)")
        conn.execute("ATTACH ':memory:' AS scratch")
        conn.execute("CREATE TABLE scratch.work (x)")

    db = files.sqlite(tmp_path / "app.db", engine=engine, on_connect=on_connect)
    db.execute("INSERT INTO cart VALUES ('book')")
    db.execute("INSERT INTO scratch.work VALUES (42)")
    db.commit()
    error = _hook(engine.simulate_snapshot(), "rehydrate.files.close").error
    assert str(error).startswith(
        f"SQLite database {tmp_path / 'app.db'} would lose rows in TEMP table cart, rows "
        "in attached in-memory database scratch ("), error
    assert engine.simulate_restore(kind="resume").ok
    assert db.execute("SELECT count(*) FROM cart").fetchone() == (1,), "kept"
    db.execute("DELETE FROM cart")
    db.execute("DELETE FROM scratch.work")
    db.commit()
    report = engine.simulate_snapshot()
    assert report.ok, report.error


def test_a_volume_holds_bound_method_callbacks_weakly(engine, tmp_path: Path) -> None:
    """One Store per tenant registering store.on_swap: the volume kept every one alive
    and called all of them at every swap."""
    import gc
    import weakref

    calls: list[int] = []

    class Store:
        def __init__(self, i: int) -> None:
            self.i = i
            files.volume(tmp_path, engine=engine, on_change=self.on_swap)

        def on_swap(self, vol: files.Volume) -> None:
            calls.append(self.i)

    kept = Store(0)
    dropped = weakref.ref(Store(1))
    inline: list[str] = []
    vol = files.volume(tmp_path, engine=engine, on_change=lambda v: inline.append("x"))
    gc.collect()
    assert dropped() is None, "not kept alive by the volume"
    assert vol.on_change == kept.on_swap
    assert engine.simulate_snapshot().ok
    (tmp_path / files.IDENTITY_FILE).write_text("another-volume\n")
    assert engine.simulate_restore().ok
    assert (calls, inline) == ([0], ["x"]), "a lambda given inline is held strongly"


def test_a_volume_through_a_symlink_covers_handles_opened_by_the_real_path(
        engine, tmp_path: Path) -> None:
    real = tmp_path / "disk1"
    real.mkdir()
    os.symlink(real, tmp_path / "data")
    (real / "a.txt").write_text("a\n")
    (real / "b.txt").write_text("b\n")
    by_real = files.open(real / "a.txt", engine=engine)
    by_link = files.open(tmp_path / "data" / "b.txt", engine=engine)
    vol = files.volume(tmp_path / "data", engine=engine)
    assert engine.simulate_snapshot().ok
    (real / files.IDENTITY_FILE).write_text("another-volume\n")
    assert engine.simulate_restore().ok
    assert (vol.changed, by_real.changed, by_link.changed) == (True, True, True)
    assert vol.contains(str(real / "a.txt")) and not vol.contains(str(tmp_path / "a.txt"))


@pytest.mark.parametrize("factory", [None, "subclass"])
def test_sqlite_callbacks_set_in_on_connect_pass_over_rehydrates_statements(
        engine, tmp_path: Path, factory: str | None) -> None:
    """An authorizer on_connect set on the connection it was given applied to
    rehydrate's own statements: its PRAGMA and sqlite_master reads failed the first
    open, and every close and reopen (the ATTACH made again too)."""
    with sqlite3.connect(tmp_path / "ref.db") as c:
        c.execute("CREATE TABLE r (x)")
    c.close()
    strict = {"on": False}
    denied: list[object] = []
    seen: list[str] = []

    def authorizer(action, arg1, arg2, dbname, source):
        if strict["on"] and (action in (sqlite3.SQLITE_PRAGMA, sqlite3.SQLITE_ATTACH)
                             or (action == sqlite3.SQLITE_READ
                                 and arg1 not in ("items", "r"))):
            denied.append(arg1)
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    def on_connect(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS items (x)")
        conn.set_authorizer(authorizer)
        conn.set_trace_callback(seen.append)
        conn.set_progress_handler(lambda: 1 if strict["on"] else 0, 1)

    class Mine(sqlite3.Connection):
        pass

    kwargs = {"factory": Mine} if factory else {}
    strict["on"] = True
    db = files.sqlite(tmp_path / "app.db", engine=engine, on_connect=on_connect, **kwargs)
    assert denied == [] and seen == []
    strict["on"] = False
    db.execute("ATTACH ? AS ref", (str(tmp_path / "ref.db"),))
    strict["on"] = True
    seen.clear()
    for kind in ("resume", "restore"):
        _snapshot_and_restore(engine, kind)
    assert denied == [] and seen == [], "rehydrate's statements pass over the callbacks"
    assert not db.suspended and isinstance(db._conn, Mine if factory else sqlite3.Connection)
    with pytest.raises(sqlite3.OperationalError, match="interrupted"):
        db.execute("SELECT count(*) FROM ref.r")  # the app's progress handler still on
    strict["on"] = False
    assert db.execute("SELECT count(*) FROM ref.r").fetchone() == (0,), "attached again"
    strict["on"] = True
    db.set_progress_handler(None, 1)
    with pytest.raises(sqlite3.DatabaseError, match="prohibited|not authorized"):
        db.execute("PRAGMA user_version")  # the app's authorizer still checks the app
    assert denied == ["user_version"]
    assert "SELECT count(*) FROM ref.r" in seen


def test_sqlite_autocommit_off_snapshots_unless_it_wrote(tmp_path: Path) -> None:
    """Python 3.12's autocommit=False keeps a transaction open at all times: every
    snapshot was refused; a reconnect set foreign_keys inside that transaction (where it
    does nothing) and could not ATTACH in it. Here with the mode emulated on 3.11."""
    from tests.managers.sqlite_autocommit_scenario import EmulatedAutocommitOff, run

    run(tmp_path, factory=EmulatedAutocommitOff)


def _pythons_with_autocommit() -> list[str]:
    import glob
    import shutil

    found = [p for p in (shutil.which(f"python3.{minor}") for minor in range(12, 16)) if p]
    found += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3")))
    working = []
    for python in found:
        import subprocess

        probe = subprocess.run([python, "-c", "import sqlite3, sys; "
                                "sys.exit(sys.version_info < (3, 12))"],
                               check=False, capture_output=True)
        if probe.returncode == 0:
            working.append(python)
    return working[:1]


def test_sqlite_autocommit_off_on_a_real_python_3_12(tmp_path: Path) -> None:
    """The same scenario with the real autocommit=False of a Python 3.12+ on this
    machine (pyenv's)."""
    import subprocess

    pythons = _pythons_with_autocommit()
    if not pythons:
        pytest.skip("no Python 3.12+ on this machine")
    repo = Path(__file__).resolve().parents[2]
    script = repo / "tests" / "managers" / "sqlite_autocommit_scenario.py"
    done = subprocess.run([pythons[0], str(script), str(tmp_path)], check=False,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")
