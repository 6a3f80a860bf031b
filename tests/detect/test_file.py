"""Marker-file detector with real file changes, through inotify and through polling."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import pytest
from detect_helpers import (
    REPO,
    Child,
    Recorder,
    recorded_reports,
    slow_restore_hook,
    wait_for,
)

from rehydrate._gvisor import running_under_gvisor
from rehydrate.detect.file import FileDetector


@pytest.fixture(params=["inotify", "polling"])
def mode(request):  # type: ignore[no-untyped-def]
    return request.param


def test_marker_written_is_a_restore(rehydrate_engine, tmp_path, mode):
    marker = tmp_path / "restored"
    rec = Recorder(rehydrate_engine)
    det = FileDetector(marker, polling=(mode == "polling"), interval=0.02, window=0)
    rehydrate_engine.start([det])

    # It appears with its content in one step (a hard link to a written file: an inotify
    # "created" event). Written in place, a watcher woken between the open and the write
    # sees an empty file and then a full one: two changes, two restores with window=0.
    tmp = tmp_path / "restored.tmp"
    tmp.write_text("restore 1\n")
    os.link(tmp, marker)
    tmp.unlink()
    calls = rec.wait(1)
    assert (calls[0]["reason"], calls[0]["kind"], calls[0]["generation"]) == \
        ("file", "restore", 1)

    tmp.write_text("restore 2\n")  # rewritten atomically (rename over it)
    os.replace(tmp, marker)
    rec.wait(2)
    assert rec.calls[1]["generation"] == 2

    checks = det.checks
    marker.unlink()  # deleting it is not a restore
    wait_for(lambda: det.checks > checks and det._state is None,
             what="the deletion to be looked at")
    assert len(rec.calls) == 2
    assert det.describe().endswith("inotify)" if mode == "inotify" else "0.02s)")


def test_a_burst_of_writes_is_one_restore(rehydrate_engine, tmp_path):
    marker = tmp_path / "state.json"
    marker.write_text("{}")
    rec = Recorder(rehydrate_engine)
    det = FileDetector(marker, polling=False, window=30)
    rehydrate_engine.start([det])
    with open(marker, "w") as f:  # truncate …
        f.flush()
        os.fsync(f.fileno())
        f.write('{"restored": true}')  # … then write
    rec.wait(1)
    wait_for(lambda: det._state is not None and det._state[1] > 2,
             what="the final content to be seen")
    rehydrate_engine.stop()
    assert len(rec.calls) == 1


def test_configuration(monkeypatch, tmp_path):
    monkeypatch.delenv("REHYDRATE_MARKER_FILE", raising=False)
    assert "REHYDRATE_MARKER_FILE is not set" in FileDetector.probe().reason
    with pytest.raises(ValueError):
        FileDetector()
    monkeypatch.setenv("REHYDRATE_MARKER_FILE", str(tmp_path / "nodir" / "m"))
    assert "does not exist" in FileDetector.probe().reason
    monkeypatch.setenv("REHYDRATE_MARKER_FILE", str(tmp_path / "m"))
    assert FileDetector.probe().usable

    monkeypatch.setenv("REHYDRATE_WATCH_POLLING", "1")
    monkeypatch.setenv("REHYDRATE_WATCH_INTERVAL", "0.1")
    det = FileDetector()
    assert (det.polling, det.interval, det.path) == (True, 0.1, str(tmp_path / "m"))
    monkeypatch.setenv("REHYDRATE_WATCH_POLLING", "0")
    assert FileDetector().polling is False
    monkeypatch.delenv("REHYDRATE_WATCH_POLLING")
    assert FileDetector().polling is running_under_gvisor()


def test_not_gvisor_here():
    if os.path.isdir("/proc/gvisor"):
        pytest.skip("running inside gVisor")
    assert running_under_gvisor() is False


@pytest.mark.gvisor
def test_gvisor_is_recognised_inside_runsc():
    """`runsc do` runs a command in a real gVisor sandbox over the host's filesystem."""
    runsc = shutil.which("runsc-trixie") or shutil.which("runsc")
    if os.geteuid() != 0 or runsc is None:
        reason = "needs root and runsc"
        if os.environ.get("REHYDRATE_REQUIRE_GVISOR") == "1":
            pytest.fail(f"REHYDRATE_REQUIRE_GVISOR=1 but {reason}")
        pytest.skip(reason)
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); "
            "from rehydrate._gvisor import running_under_gvisor as g; "
            "from rehydrate._nodefit import in_gvisor; "
            "print(g(), in_gvisor())")
    out = subprocess.run([runsc, "--network=none", "do", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True True"  # the detectors' check and the doctor's


IDLE_WATCHER = r"""
import json, sys, threading
from rehydrate import Lifecycle, Registry
from rehydrate.detect.file import FileDetector
from rehydrate.env import EnvRefresher

engine = Lifecycle(Registry(), env=EnvRefresher(path=None))
restored = threading.Event()
engine.registry.after_restore(lambda: restored.set(), name="rec")
det = FileDetector(sys.argv[1], polling=False, window=0)
engine.start([det])
print(json.dumps({"started": True}), flush=True)
assert restored.wait(10)
print(json.dumps({"restored": True, "checks": det.checks}), flush=True)
threading.Event().wait()  # idle until killed
"""


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_idle_inotify_watch_costs_no_cpu(tmp_path):
    """Reading the marker fires inotify open/close events; they must not wake the
    detector again, or it re-reads the file in a loop and spins a core (issue #13.3).
    Measured as the CPU time of a process that does nothing but watch."""
    marker = tmp_path / "restored"
    child = Child(IDLE_WATCHER.replace("sys.argv[1]", repr(str(marker))))
    try:
        assert child.next()["started"]
        marker.write_text("restore 1\n")
        checks = child.next()["checks"]
        cpu = _cpu_seconds(child.proc.pid)
        threading.Event().wait(1.0)  # a measurement window: the cost of one idle second
        used = _cpu_seconds(child.proc.pid) - cpu
        assert used < 0.1, f"{used:.2f}s of CPU in 1s of idle watching ({checks} checks)"
    finally:
        child.close()


def test_fifo_at_marker_path_does_not_block(rehydrate_engine, tmp_path):
    """A FIFO (or other non-regular file) at the marker path is no state and never blocks
    the marker thread (issue #13.13); a regular file written after it is still seen."""
    marker = tmp_path / "restored"
    rec = Recorder(rehydrate_engine)
    det = FileDetector(marker, polling=True, interval=0.02, window=0)
    rehydrate_engine.start([det])
    os.mkfifo(marker)
    wait_for(lambda: det.checks >= 1, what="the FIFO to be looked at")
    os.unlink(marker)
    marker.write_text("restore 1\n")
    rec.wait(1)


def test_a_removed_and_recreated_directory_is_watched_again(rehydrate_engine, tmp_path, mode,
                                                            caplog):
    """watchdog stops watching a directory that is removed: the detector used to go deaf
    for good without a word, and a marker written after the directory came back was
    never seen."""
    folder = tmp_path / "state"
    folder.mkdir()
    marker = folder / "restored"
    rec = Recorder(rehydrate_engine)
    det = FileDetector(marker, polling=(mode == "polling"), interval=0.02, window=0)
    with caplog.at_level(logging.INFO, logger="rehydrate"):
        rehydrate_engine.start([det])
        shutil.rmtree(folder)
        wait_for(lambda: "was removed; watching for it to come back" in caplog.text,
                 what="the removal to be noticed")
        folder.mkdir()
        wait_for(lambda: det.rewatches == 1, what="the directory to be watched again")
        tmp = tmp_path / "restored.tmp"
        tmp.write_text("restore 1\n")
        os.replace(tmp, marker)
        calls = rec.wait(1)
    assert (calls[0]["reason"], calls[0]["generation"]) == ("file", 1)
    assert f"marker file: watching {folder} again" in caplog.text


def test_a_marker_unreadable_for_a_while_is_no_restore(tmp_path):
    """chmod 000, then back, the content unchanged: the detector took the unreadable spell
    for "absent" and the marker's return for a new restore (new keys, a reseed)."""
    marker = tmp_path / "restored"
    marker.write_text("restore 1\n")
    script = f"""
import logging, os, sys, threading, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from rehydrate.detect.file import FileDetector
from rehydrate.testing import isolated_engine

def wait(cond):
    end = time.monotonic() + 10
    while not cond() and time.monotonic() < end:
        threading.Event().wait(0.01)
    assert cond()

engine = isolated_engine()
det = FileDetector({str(marker)!r}, polling=False, window=0)  # inotify sees a chmod
engine.start([det])
os.chmod({str(marker)!r}, 0)
wait(lambda: det.checks == 1)
os.chmod({str(marker)!r}, 0o644)
wait(lambda: det.checks == 2)
print("generation", engine.generation)
"""
    # as root, without the capabilities that read any file regardless of its mode
    prefix = (["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
              if os.geteuid() == 0 else [])
    proc = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=60, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["generation", "0"], proc.stderr
    assert proc.stderr.count("cannot be read (Permission denied); keeping its last state") == 1
    assert "is readable again" in proc.stderr


def test_polling_never_lists_the_directory(tmp_path):
    """The polling observer looks at the marker's own entry only (one lstat), so its cost
    does not grow with the directory — and a directory that may be searched but not
    listed (mode 0o111) works. It used to list the whole directory at every poll."""
    folder = tmp_path / "no-listing"
    folder.mkdir()
    marker = folder / "restored"
    script = f"""
import os, sys, threading, time
from rehydrate.detect.file import FileDetector
from rehydrate.testing import isolated_engine

engine = isolated_engine()
det = FileDetector({str(marker)!r}, polling=True, interval=0.02, window=0)
engine.start([det])
os.chmod({str(folder)!r}, 0o311)  # write + search, no read: cannot be listed
with open({str(marker) + ".tmp"!r}, "w") as f:
    f.write("restore 1")
os.replace({str(marker) + ".tmp"!r}, {str(marker)!r})
end = time.monotonic() + 10
while engine.generation == 0 and time.monotonic() < end:
    threading.Event().wait(0.01)
print("generation", engine.generation)
"""
    prefix = (["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
              if os.geteuid() == 0 else [])
    try:
        proc = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True,
                              text=True, timeout=60, cwd=REPO, check=False)
    finally:
        folder.chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["generation", "1"], proc.stderr


def test_a_restart_with_a_readable_marker_takes_the_next_change_as_news(rehydrate_engine,
                                                                       tmp_path):
    """Started while the marker could not be read (here: a FIFO), the detector takes the
    first readable state as its baseline; stopped and started again with a readable
    marker, that leftover must not swallow the next real change."""
    marker = tmp_path / "restored"
    os.mkfifo(marker)
    rec = Recorder(rehydrate_engine)
    det = FileDetector(marker, polling=True, interval=0.02, window=0)
    rehydrate_engine.start([det])
    rehydrate_engine.stop()
    marker.unlink()
    marker.write_text("restore 1\n")
    rehydrate_engine.start([det])
    tmp = tmp_path / "restored.tmp"
    tmp.write_text("restore 2\n")
    os.replace(tmp, marker)
    assert rec.wait(1)[0]["reason"] == "file"


def test_a_kubernetes_volume_update_is_seen(rehydrate_engine, tmp_path, mode):
    """A ConfigMap/Secret/downward-API volume (kubelet's AtomicWriter): ``marker`` is a
    symlink to ``..data/marker`` and an update swaps the ``..data`` symlink to a new
    versioned directory. No event names the marker itself: with inotify the detector
    slept through it."""
    vol = tmp_path / "podinfo"
    vol.mkdir()

    def version(name: str, content: str) -> None:
        (vol / name).mkdir()
        (vol / name / "marker").write_text(content)

    version("..2024_A", "gen-1")
    os.symlink("..2024_A", vol / "..data")
    os.symlink("..data/marker", vol / "marker")
    rec = Recorder(rehydrate_engine)
    det = FileDetector(vol / "marker", polling=(mode == "polling"), interval=0.02,
                       window=0)
    rehydrate_engine.start([det])
    version("..2024_B", "restored")
    os.symlink("..2024_B", vol / "..data_tmp")
    os.rename(vol / "..data_tmp", vol / "..data")
    shutil.rmtree(vol / "..2024_A")
    calls = rec.wait(1, timeout=10)
    assert (calls[0]["reason"], calls[0]["generation"]) == ("file", 1)

    version("..2024_C", "restored again")  # the next swap: watched through the new link
    os.symlink("..2024_C", vol / "..data_tmp")
    os.rename(vol / "..data_tmp", vol / "..data")
    rec.wait(2, timeout=10)
    assert rec.calls[1]["generation"] == 2


def test_a_directory_renamed_away_and_recreated_is_watched_again(rehydrate_engine,
                                                                 tmp_path, mode):
    """A renamed directory takes its inotify watch along: the detector watched the moved
    one (where nothing is written any more) and missed the marker in the new one."""
    folder = tmp_path / "state"
    folder.mkdir()
    marker = folder / "restored"
    rec = Recorder(rehydrate_engine)
    det = FileDetector(marker, polling=(mode == "polling"), interval=0.02, window=0)
    rehydrate_engine.start([det])
    os.rename(folder, tmp_path / "state.old")
    folder.mkdir()
    wait_for(lambda: det.rewatches == 1, timeout=10,
             what="the new directory to be watched")
    (tmp_path / "state.old" / "restored").write_text("old\n")  # the moved-away one
    tmp = tmp_path / "restored.tmp"
    tmp.write_text("restore 1\n")
    os.replace(tmp, marker)
    calls = rec.wait(1, timeout=10)
    assert (calls[0]["reason"], calls[0]["generation"]) == ("file", 1)
    rehydrate_engine.stop()  # joins the worker: everything it was woken for was read
    assert len(rec.calls) == 1


def _rest_of_the_burst_while_the_hooks_outlast_the_window(
        marker: os.PathLike[str], det: FileDetector, window: float) -> None:
    """Write the rest of a burst while the restore's hooks run, wait until it was
    reported, then until the hooks outlast the window (the condition of the bug)."""
    entered_at = time.monotonic()
    with open(marker, "a") as f:
        f.write("-1\n")
    wait_for(lambda: det._arrived is not None, what="the write to be reported")
    wait_for(lambda: time.monotonic() > entered_at + 2 * window, what="the window to pass")


def test_a_write_while_slow_hooks_run_is_the_same_restore(rehydrate_engine, tmp_path,
                                                          mode, monkeypatch):
    """The rest of a burst, written while the hooks of its restore still run, is dated
    when it was reported, not when the worker gets to it: hooks outlasting the window
    made it a second restore (a new instance ID)."""
    marker = tmp_path / "restored"
    window = 0.5
    entered, release, calls = slow_restore_hook(rehydrate_engine)
    reports = recorded_reports(rehydrate_engine, monkeypatch)
    det = FileDetector(marker, polling=(mode == "polling"), interval=0.02, window=window)
    rehydrate_engine.start([det])
    tmp = tmp_path / "restored.tmp"
    tmp.write_text("restored")
    os.replace(tmp, marker)
    try:
        assert entered.wait(5.0), "the hook did not run"
        _rest_of_the_burst_while_the_hooks_outlast_the_window(marker, det, window)
    finally:
        release.set()
    wait_for(lambda: len(reports) == 2, what="the second notice to be handled")
    assert calls == [1]
    assert reports[1].deduplicated


@pytest.mark.parametrize("layout", ["elsewhere", "configmap"])
def test_a_marker_linked_into_another_directory(rehydrate_engine, tmp_path, mode, layout):
    """A marker that is a symlink to a file in another directory changes there: with
    inotify on the marker's own directory alone, nothing was ever seen."""
    watch = tmp_path / "watch"
    watch.mkdir()
    if layout == "elsewhere":
        def target_dir(n: int) -> pathlib.Path:
            return tmp_path / f"state{n}"
    else:  # kubelet's layout: marker -> ..data/marker, ..data -> ..vN
        def target_dir(n: int) -> pathlib.Path:
            return watch / f"..v{n}"

    def point_to(n: int, content: str) -> None:
        target_dir(n).mkdir()
        (target_dir(n) / "marker").write_text(content)
        link, tmp = ((watch / "marker", watch / "marker.tmp") if layout == "elsewhere"
                     else (watch / "..data", watch / "..data.tmp"))
        os.symlink(target_dir(n) / "marker" if layout == "elsewhere" else f"..v{n}", tmp)
        os.replace(tmp, link)

    point_to(1, "0")
    if layout == "configmap":
        os.symlink("..data/marker", watch / "marker")
    rec = Recorder(rehydrate_engine)
    det = FileDetector(watch / "marker", polling=(mode == "polling"), interval=0.02,
                       window=0)
    rehydrate_engine.start([det])

    tmp = target_dir(1) / ".tmp"  # the target replaced atomically
    tmp.write_text("1")
    os.replace(tmp, target_dir(1) / "marker")
    rec.wait(1)
    # Edited in place (one write). Longer: polling compares size and mtime, and the
    # mtime may not have moved since the replace.
    with open(target_dir(1) / "marker", "r+") as f:
        f.write("22")
    rec.wait(2)

    point_to(2, "3")  # re-pointed: watched there from now on
    rec.wait(3)
    with open(target_dir(2) / "marker", "r+") as f:
        f.write("44")
    assert [c["generation"] for c in rec.wait(4)] == [1, 2, 3, 4]
    if mode == "inotify":
        assert set(det._extra) == {str(target_dir(2))}


def test_a_change_the_late_report_does_not_cover_is_dated_by_the_read(
        rehydrate_engine, tmp_path, monkeypatch):
    """A report that came while the hooks ran dates only the marker it saw: a new restore
    that rewrote the marker after that report, and before the worker read it, is not
    taken for the earlier burst (it would be lost: its own report then finds nothing
    new)."""
    from rehydrate.detect import file as file_module

    marker = tmp_path / "restored"
    window = 0.5
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_hook() -> None:
        calls.append(1)
        entered.set()
        if len(calls) == 1:
            assert release.wait(10.0)

    rehydrate_engine.registry.after_restore(slow_hook, required=False, timeout=30)
    reports = recorded_reports(rehydrate_engine, monkeypatch)
    det = FileDetector(marker, polling=False, window=window)
    rehydrate_engine.start([det])
    tmp = tmp_path / "restored.tmp"
    tmp.write_text("restored")
    os.replace(tmp, marker)
    armed = threading.Event()
    real_plan = file_module._watch_plan

    def plan_then_restore(path: str):  # type: ignore[no-untyped-def]
        # Runs after the worker took the pending report, before it reads the marker.
        if armed.is_set():
            armed.clear()
            tmp.write_text("restored again")
            os.replace(tmp, marker)
        return real_plan(path)

    monkeypatch.setattr(file_module, "_watch_plan", plan_then_restore)
    try:
        assert entered.wait(5.0), "the hook did not run"
        _rest_of_the_burst_while_the_hooks_outlast_the_window(marker, det, window)
        armed.set()
    finally:
        release.set()
    # The report is recorded when restore_detected() returns, after the hook ran: wait
    # for both (waiting for the hook alone raced the recording).
    wait_for(lambda: len(calls) == 2 and len(reports) == 2,
             what="the new restore to run and be reported")
    assert marker.read_text() == "restored again"
    assert not reports[1].deduplicated


OTHER_UID = 65534  # nobody


def _appear(directory: pathlib.Path, marker: pathlib.Path, text: str, uid: int) -> None:
    """The marker appears (or is replaced) in one step, owned by ``uid``: written aside,
    chowned, then renamed over it — the detector never sees it half made."""
    tmp = directory / ".marker.tmp"
    tmp.write_text(text)
    os.chown(tmp, uid, uid)
    os.replace(tmp, marker)


def test_a_marker_of_another_uid_is_ignored(root_required, rehydrate_engine, tmp_path, mode,
                                            caplog):
    """In a directory everyone may write in (sticky, like /tmp), another uid creating or
    changing the marker ran this process's restore hooks at will. A marker owned neither
    by this uid nor by root is ignored, with one warning per change of it (not per look);
    the platform's marker after it is still news. A symlink of another uid too."""
    assert os.geteuid() == 0, "chown to another uid needs root"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    marker = shared / "restored"
    rec = Recorder(rehydrate_engine)
    det = FileDetector(marker, polling=(mode == "polling"), interval=0.02, window=0)
    rehydrate_engine.start([det])
    warning = (f"marker file {marker} is owned by uid {OTHER_UID}, not by root, in a "
               "directory others may write in: ignored")

    def warnings() -> int:
        return sum(warning in r.getMessage() for r in caplog.records)

    caplog.set_level(logging.WARNING, logger="rehydrate")
    _appear(shared, marker, "fake restore 1\n", OTHER_UID)
    wait_for(lambda: warnings() == 1, what="the foreign marker to be ignored")
    checks = det.checks
    det._wake.set()  # another look at the unchanged marker (a poll, a spurious event)
    wait_for(lambda: det.checks > checks, what="another look")
    _appear(shared, marker, "fake restore 2\n", OTHER_UID)  # a change: warned again
    wait_for(lambda: warnings() == 2, what="the changed foreign marker to be ignored")
    assert rehydrate_engine.generation == 0 and rec.calls == []

    _appear(shared, marker, "restore 1\n", 0)  # the platform's (root's) marker
    assert rec.wait(1)[0]["reason"] == "file"

    target = tmp_path / "root-owned"
    target.write_text("restore 2\n")
    link = shared / ".link.tmp"
    link.symlink_to(target)
    os.lchown(link, OTHER_UID, OTHER_UID)
    checks = det.checks
    os.replace(link, marker)  # another uid's symlink to a file of root's
    wait_for(lambda: det.checks > checks and warnings() == 3,
             what="the foreign symlink to be ignored")
    assert len(rec.calls) == 1 and rehydrate_engine.generation == 1


def test_a_foreign_marker_there_at_start_is_no_baseline(root_required, rehydrate_engine,
                                                       tmp_path, caplog):
    """Another uid's marker present when the detector starts is not taken as the baseline
    (its owner could change it into a restore later), and is warned about once."""
    assert os.geteuid() == 0, "chown to another uid needs root"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    marker = shared / "restored"
    _appear(shared, marker, "fake\n", OTHER_UID)
    caplog.set_level(logging.WARNING, logger="rehydrate")
    det = FileDetector(marker, polling=True, interval=0.02, window=0)
    rehydrate_engine.start([det])
    assert det._state is None
    assert sum("is owned by uid 65534" in r.getMessage() for r in caplog.records) == 1


def test_a_marker_of_another_uid_in_a_directory_only_its_owner_writes_is_trusted(
        root_required, rehydrate_engine, tmp_path, mode, caplog):
    """Under a user namespace (rootless podman, Kubernetes ``hostUsers: false``) the
    platform's marker shows as owned by the overflow uid; on NFS with root_squash by
    nobody; from a sidecar by its uid. In a directory only its owner (here this uid) may
    write in, nobody else could have put it there: it is a restore, and no warning."""
    assert os.geteuid() == 0, "chown to another uid needs root"
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o755)
    marker = private / "restored"
    rec = Recorder(rehydrate_engine)
    det = FileDetector(marker, polling=(mode == "polling"), interval=0.02, window=0)
    rehydrate_engine.start([det])
    caplog.set_level(logging.WARNING, logger="rehydrate")
    _appear(private, marker, "restore 1\n", OTHER_UID)
    assert rec.wait(1)[0]["reason"] == "file"
    assert not [r for r in caplog.records if "is owned by uid" in r.getMessage()]


@pytest.mark.parametrize("dir_mode", [0o1777, 0o777, 0o775, 0o1755], ids=oct)
def test_a_directory_others_may_write_in_keeps_the_owner_check(root_required, tmp_path,
                                                              dir_mode):
    """World- or group-writable, or sticky: another user could have put the marker there."""
    from rehydrate.detect.file import _read_marker

    directory = tmp_path / "d"
    directory.mkdir()
    directory.chmod(dir_mode)
    marker = directory / "restored"
    _appear(directory, marker, "fake\n", OTHER_UID)
    state, foreign = _read_marker(str(marker), frozenset())
    assert state is not None and foreign == OTHER_UID
    assert _read_marker(str(marker), frozenset({OTHER_UID}))[1] is None  # named: trusted
    directory.chmod(0o755)
    assert _read_marker(str(marker), frozenset()) == (state, None)


def test_a_symlink_of_a_private_directory_to_a_foreign_file_in_a_shared_one_is_ignored(
        root_required, tmp_path):
    """Each owner is judged by the directory holding its entry: a trusted symlink leading
    to another uid's file in /tmp is that uid's to rewrite."""
    from rehydrate.detect.file import _read_marker

    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir()
    shared.mkdir()
    private.chmod(0o755)
    shared.chmod(0o1777)
    _appear(shared, shared / "target", "fake\n", OTHER_UID)
    (private / "restored").symlink_to(shared / "target")
    assert _read_marker(str(private / "restored"), frozenset())[1] == OTHER_UID
    os.chown(shared / "target", 0, 0)
    assert _read_marker(str(private / "restored"), frozenset())[1] is None


def test_marker_owners_setting(root_required, rehydrate_engine, tmp_path, monkeypatch,
                               caplog):
    """``REHYDRATE_MARKER_OWNERS`` names the platform's uid as seen here: its marker in a
    shared directory is a restore. A bad entry is one warning naming it, and left out;
    the warning about an untrusted owner names the trusted ones."""
    assert os.geteuid() == 0, "chown to another uid needs root"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    marker = shared / "restored"
    caplog.set_level(logging.WARNING, logger="rehydrate")
    monkeypatch.setenv("REHYDRATE_MARKER_OWNERS", f"1001, {OTHER_UID},nobody")
    det = FileDetector(marker, polling=True, interval=0.02, window=0)
    assert det.owners == {1001, OTHER_UID}
    assert [r.getMessage() for r in caplog.records] == [
        "REHYDRATE_MARKER_OWNERS: 'nobody' is not a uid (a number >= 0); ignored"]
    rec = Recorder(rehydrate_engine)
    rehydrate_engine.start([det])
    _appear(shared, marker, "restore 1\n", OTHER_UID)
    assert rec.wait(1)[0]["reason"] == "file"

    _appear(shared, marker, "fake\n", 1002)
    wait_for(lambda: any("is owned by uid 1002, not by root, uid 1001 or uid 65534, in a "
                         "directory others may write in" in r.getMessage()
                         for r in caplog.records), what="the untrusted owner's warning")
    assert len(rec.calls) == 1


def test_stop_in_a_forked_child_leaves_the_parents_watch(rehydrate_engine, tmp_path):
    """A child of fork() calling stop() on the parent's detector (an inherited shutdown
    handler) stopped its copy of the observer: that removed the watches of the inotify
    instance both processes share, and the parent heard no more marker writes."""
    from detect_helpers import in_forked_child

    marker = tmp_path / "restored"
    rec = Recorder(rehydrate_engine)
    det = FileDetector(marker, polling=False, window=0)
    rehydrate_engine.start([det])

    def child():  # type: ignore[no-untyped-def]
        det.stop()
        return {"forgotten": det._worker is None and det._observer is None}

    assert in_forked_child(child) == {"forgotten": True}
    tmp = tmp_path / "restored.tmp"
    tmp.write_text("restore 1\n")
    os.link(tmp, marker)
    calls = rec.wait(1)
    assert calls[0]["reason"] == "file"
    assert det._worker is not None and det._worker.is_alive()


def test_stop_in_a_forked_child_closes_its_copies_of_the_descriptors(
        rehydrate_engine, tmp_path):
    """The child's copies of the observer's inotify instance and wake-up pipe were left
    open for the child's life (a forked worker per request kept one of each); closing
    them removes none of the parent's watches."""
    from detect_helpers import in_forked_child

    def fds():  # type: ignore[no-untyped-def]
        return {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    marker = tmp_path / "restored"
    rec = Recorder(rehydrate_engine)
    before = fds()
    det = FileDetector(marker, polling=False, window=0)
    rehydrate_engine.start([det])
    added = {fd: target for fd, target in fds().items() if fd not in before}
    assert any("inotify" in target for target in added.values())

    def child():  # type: ignore[no-untyped-def]
        det.stop()
        now = fds()
        return {"still_open": sorted(fd for fd in added if now.get(fd) == added[fd])}

    assert in_forked_child(child) == {"still_open": []}
    tmp = tmp_path / "restored.tmp"
    tmp.write_text("restore 1\n")
    os.link(tmp, marker)
    assert rec.wait(1)[0]["reason"] == "file"  # the parent's watch is still there
