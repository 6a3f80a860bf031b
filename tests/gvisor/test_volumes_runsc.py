"""rehydrate.files under real gVisor: a host directory bind-mounted read-write at ``/vol``
stands in for a persistent volume (runsc reopens its files by path on restore, with no
change check), one checkpoint, two clones (issue 14).

Before the checkpoint, ``rehydrate notify save`` (run in the sandbox, as save-restore-exec
runs it) must fail while the workload holds a deleted file open on the volume — naming the
path, exit non-zero, so the platform never attempts that checkpoint, which gVisor cannot
take — and succeed once it is closed. Between checkpoint and restore the host replaces one
file by rename, rewrites another in place and, through SQLite, adds a row to the
workload's WAL database and closes its last connection (SQLite deletes ``-wal``/``-shm``).
Clone 1 restores onto that volume; clone 2 onto another volume with the same file names.
Each must restore, see every managed file as changed and read it from its first line
(never from the old offset in the middle of the new file), and see the host's rows; the
shared mapping is remapped onto the new file. Clone 3 restores onto the volume with a
managed file deleted: the restore itself succeeds (unmanaged, gVisor would fail it naming
nothing) and ``notify restore`` fails naming the file.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

from rehydrate.files import IDENTITY_FILE

from .harness import Container, GVisorHarness, Mount

SOCKET = "/var/tmp/rehydrate.sock"  # on the sandbox's tmpfs
HOLD_FLAG = "/var/tmp/hold-deleted"  # exists: the workload holds /vol/scratch open, deleted
REHYDRATE = str(Path(sys.executable).parent / "rehydrate")

WORKLOAD = f"""
import json, os
import rehydrate
from rehydrate import files

out = open("/results/events.jsonl", "a", buffering=1)

def emit(**rec):
    out.write(json.dumps(rec) + "\\n")

vol = files.volume("/vol")
a = files.open("/vol/a.txt")  # replaced by rename on the host
b = files.open("/vol/b.txt")  # rewritten in place on the host
first = [a.readline(), b.readline()]
ring = files.mmap("/vol/ring.bin")  # MAP_SHARED, whole file
ring[0:6] = b"before"
db = files.sqlite("/vol/app.db")
db.execute("PRAGMA journal_mode=WAL")
with db:
    db.execute("CREATE TABLE IF NOT EXISTS t (who TEXT)")
    db.execute("INSERT INTO t VALUES ('sandbox')")
held = None

@rehydrate.before_snapshot(name="app.scratch")
def scratch():
    global held
    if os.path.exists({HOLD_FLAG!r}):
        held = open("/vol/scratch", "w")
        os.unlink("/vol/scratch")
    elif held is not None:
        held.close()
        held = None

@rehydrate.after_restore(name="app.report")
def report(ctx):
    emit(event="after", kind=ctx.kind, generation=ctx.generation,
         vol_changed=vol.changed, vol_identity=vol.identity,
         a_changed=a.changed, a_line=a.readline(), b_changed=b.changed, b_line=b.readline(),
         ring_changed=ring.changed, ring=ring[:].decode(),
         db_changed=db.changed, rows=[r[0] for r in db.execute("SELECT who FROM t ORDER BY rowid")])

detectors = rehydrate.start()
emit(event="ready", first=first, detectors=detectors, identity=vol.identity)
while True:
    import time
    time.sleep(3600)
"""


def _rehydrate(c: Container, *args: str) -> Any:
    return c.exec([REHYDRATE, *args], timeout=60)


def _status(c: Container) -> dict[str, Any]:
    proc = _rehydrate(c, "status", "--json")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    status: dict[str, Any] = json.loads(proc.stdout)
    return status


def _after(c: Container, kind: str) -> dict[str, Any]:
    return c.wait_for("events.jsonl", lambda r: r["event"] == "after" and r["kind"] == kind,
                      timeout=60)


@pytest.mark.gvisor
def test_managed_volume_files_across_checkpoint_and_restore(
    gvisor: GVisorHarness, tmp_path: Path
) -> None:
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "a.txt").write_text("a1\na2\na3\na4\n")
    (vol / "b.txt").write_text("b1\nb2\nb3\nb4\n")
    (vol / "ring.bin").write_bytes(b"\0" * 8)
    orig = gvisor.run([sys.executable, "-c", WORKLOAD],
                      env={"REHYDRATE_CONTROL_SOCKET": SOCKET},
                      mounts=[Mount("/vol", vol, readonly=False)], name="vol")
    ready = orig.wait_for("events.jsonl", lambda r: r["event"] == "ready", timeout=60)
    assert ready["first"] == ["a1\n", "b1\n"]
    identity = (vol / IDENTITY_FILE).read_text().strip()
    assert ready["identity"] == identity

    # -- a deleted file held open on the volume: notify save fails naming it, and the
    #    workload carries on (resume hooks ran: files reopened where they were).
    orig.exec(["/bin/touch", HOLD_FLAG], check=True)
    refused = _rehydrate(orig, "notify", "save")
    assert refused.returncode == 1, (refused.returncode, refused.stdout, refused.stderr)
    assert "rehydrate.files.audit" in refused.stderr and "/vol/scratch" in refused.stderr, \
        refused.stderr
    resumed = _after(orig, "resume")
    assert (resumed["a_changed"], resumed["a_line"], resumed["b_line"]) == (
        False, "a2\n", "b2\n"), "unchanged files reopen at the same position"
    # doctor --files inspects the process behind the control socket by default.
    doctor = _rehydrate(orig, "doctor", "--files", "--json")
    assert doctor.returncode == 0, doctor.stderr
    listed = {f["path"]: f for f in json.loads(doctor.stdout)["files"]}
    assert (listed["/vol/scratch"]["deleted"], listed["/vol/scratch"]["managed"]) == (
        True, False), listed
    assert listed["/vol/a.txt"]["managed"] is True and listed["/vol/ring.bin"]["managed"]
    assert listed["/results/events.jsonl"]["managed"] is False, "unmanaged, on a volume"
    assert orig.status() == "running"

    # -- closed again: notify save succeeds, then the real checkpoint.
    orig.exec(["/bin/rm", HOLD_FLAG], check=True)
    saved = _rehydrate(orig, "notify", "save", "--json")
    assert saved.returncode == 0, (saved.returncode, saved.stdout, saved.stderr)
    assert json.loads(saved.stdout)["ok"] is True
    assert not (vol / "app.db-wal").exists(), "the WAL was checkpointed and closed"
    assert (vol / "ring.bin").read_bytes() == b"before\0\0", "the mapping was flushed"
    image = orig.checkpoint()

    # -- another volume with the same file names (taken before the host's changes).
    other = tmp_path / "other"
    shutil.copytree(vol, other)
    (other / IDENTITY_FILE).write_text("another-volume\n")
    (other / "a.txt").write_text("other-a1\nother-a2\n")
    gone = tmp_path / "gone"  # the same volume with a managed file deleted
    shutil.copytree(vol, gone)
    (gone / "a.txt").unlink()
    # -- the host changes the volume while the workload is frozen.
    (vol / "a.new").write_text("A1 new\nA2 new\n")
    (vol / "a.new").replace(vol / "a.txt")
    with open(vol / "b.txt", "r+") as f:  # same inode
        f.write("B1 in place\n")
    host = sqlite3.connect(vol / "app.db")
    with host:
        host.execute("INSERT INTO t VALUES ('host')")
    host.close()
    assert not (vol / "app.db-wal").exists(), "the host's last connection removed the WAL"
    (vol / "ring.new").write_bytes(b"host-ring-12")  # a longer file, renamed over the old
    (vol / "ring.new").replace(vol / "ring.bin")

    clone = gvisor.restore(image, orig, name="same-vol",
                           mounts=[Mount("/vol", vol, readonly=False)])
    swapped = gvisor.restore(image, orig, name="swapped-vol",
                             mounts=[Mount("/vol", other, readonly=False)])
    for c in (clone, swapped):
        notified = _rehydrate(c, "notify", "restore")
        assert notified.returncode == 0, (notified.stdout, notified.stderr)
    # Unmanaged, gVisor fails such a restore with "no such file or directory" naming
    # nothing; managed, the restore succeeds and the reopen hook names the file.
    lost = gvisor.restore(image, orig, name="gone-file",
                          mounts=[Mount("/vol", gone, readonly=False)])
    failed = _rehydrate(lost, "notify", "restore")
    assert failed.returncode == 1, (failed.stdout, failed.stderr)
    assert ("rehydrate.files.reopen (FileGone: managed file /vol/a.txt is gone after the "
            "restore") in failed.stderr, failed.stderr
    assert _status(lost)["state"] == "degraded"

    rec = _after(clone, "restore")
    assert rec["vol_changed"] is False and rec["vol_identity"] == identity, rec
    assert (rec["a_changed"], rec["a_line"]) == (True, "A1 new\n"), "rename-over: from start"
    assert (rec["b_changed"], rec["b_line"]) == (True, "B1 in place\n"), "in place: from start"
    assert rec["rows"] == ["sandbox", "host"], "the host's row, no -wal/-shm needed"
    assert rec["db_changed"] is True
    assert (rec["ring_changed"], rec["ring"]) == (True, "host-ring-12"), "remapped, new size"

    rec = _after(swapped, "restore")
    assert rec["vol_changed"] is True and rec["vol_identity"] == "another-volume", rec
    assert (rec["a_changed"], rec["a_line"]) == (True, "other-a1\n"), rec
    assert (rec["b_changed"], rec["b_line"]) == (True, "b1\n"), \
        "same content, another volume: still reread from the start"
    assert rec["rows"] == ["sandbox"], rec
