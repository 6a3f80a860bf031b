"""A clone of a clone under real runsc: original → A → B.

GKE Pod snapshots and CRIU users snapshot a restored pod again: clone A (restored from
the original's image) is checkpointed later, and clone B is restored from A's image.
B's memory is A's: A's restore report, A's freeze watch, A's ``notify save``, A's key
and instance id. DESIGN.md: "two real restores (a clone that is checkpointed and
restored again) are still two", and "readiness never lies in a clone".

Configurations (the ones users deploy), each checked at every level:

* clock-jump only, no notify at all (with and without the control socket configured);
* ``notify save`` before each checkpoint, then only the clock jump notices the restore;
* A checkpointed with ``--leave-running`` (trixie's runsc) after ``notify save``: A comes
  back ready by itself and keeps serving; B is restored from that image.

In each: A's restore hooks ran once (generation 1, kind ``restore``); B's ran exactly once
for B's restore (generation 2, kind ``restore``); B's ``is_ready()`` loop never saw True
before B's hook ran; B's instance id and managed key differ from A's and the original's;
``status()`` generation and state are right in every process. Where a control socket
is configured, a late ``notify restore`` to B (after the clock jump ran B's hooks) is a
duplicate of B's restore — B's report, generation 2 — not of A's, and runs nothing.

And one where ``notify restore`` is the restore notice at both levels and reaches B
before B's clock-jump thread has woken (held by the workload): it used to be taken for
A's restore, and B's hooks never ran.

``/proc/gvisor`` is emulated as for test_restore_path (``spec_environ`` only; see
restore_helpers).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .harness import Container, GVisorHarness, Mount
from .restore_helpers import (
    GAP,
    PROC,
    REHYDRATE,
    SOCKET,
    frozen_until,
    hook_runs,
    notify,
    restored,
    status_until,
    write_spec_environ,
)

# test_restore_path's workload, plus what tells the processes of a chain apart: the
# instance id and a managed key, read when the process starts, in each restore hook and
# once ready again; its status at those moments; a main-loop counter (still serving?).
WORKLOAD = f"""
import json, os, threading, time
import rehydrate, rehydrate.keys

out = open("/results/ev.jsonl", "a", buffering=1)
# A workload of some size (a model): its dump freezes it for longer than a tiny process's
ballast = os.urandom(int(os.environ.get("BALLAST_MB", "0")) << 20)
lock = threading.Lock()
hooks = []  # time.monotonic() at which each restore hook ran
key = rehydrate.keys.ephemeral("session", "ed25519")
loops = 0

def emit(**rec):
    with lock:
        out.write(json.dumps(rec) + "\\n")

def identity():
    st = rehydrate.status()
    key.wait(30)
    return dict(instance_id=rehydrate.instance_id(), key=key.public_bytes_raw().hex(),
                status_generation=st.generation, status_state=st.state, app=os.environ["APP"])

@rehydrate.after_restore(name="app.after_restore")
def after_restore(ctx):
    hooks.append(time.monotonic())
    emit(event="hook", reason=ctx.reason, kind=ctx.kind, generation=ctx.generation,
         n=len(hooks), at=hooks[-1], detected_at=ctx.detected_at, frozen_for=ctx.frozen_for,
         instance_id=rehydrate.instance_id(), key=key.public_bytes_raw().hex())

detectors = rehydrate.start()
clock = rehydrate.default_engine.detector("clock-jump")
rehydrate.default_engine.add_status("test_loops", lambda: loops)
rehydrate.default_engine.add_status("test_clock_ticks", lambda: clock.ticks)
if os.environ.get("HOLD_CLOCK"):
    # Test instrumentation: in a clone whose /proc/gvisor stand-in holds a "hold" file,
    # the clock-jump thread's first wake-up waits until /var/tmp/release exists — the
    # platform's notice comes before that thread has run (descheduled, GIL, a log write).
    hold = os.path.join(os.environ["REHYDRATE_GVISOR_PROC"], "hold")
    sleeper = clock._sleeper
    sleep = sleeper.sleep

    def held(nap):
        late = sleep(nap)
        while os.path.exists(hold) and not os.path.exists("/var/tmp/release"):
            time.sleep(0.01)
        return late

    sleeper.sleep = held
emit(event="ready", detectors=detectors, **identity())
last = time.monotonic()
while True:
    time.sleep(0.001)
    loops += 1
    now = time.monotonic()
    if now - last > {GAP}:  # this loop was frozen: the process has just resumed
        ready = rehydrate.is_ready()
        after = time.monotonic()
        lie = ready and not any(last < h < after for h in list(hooks))
        ok = rehydrate.wait_ready(timeout=30)
        emit(event="resumed", lie=lie, ready_at_once=ready, ok=ok, gap=now - last,
             frozen_at=last, returned_at=time.monotonic(), state=rehydrate.status().state,
             **identity())
    last = now
"""


@dataclass
class Chain:
    """One original and the clones restored from it, then from its clone."""

    name: str
    socket: bool
    orig: Container
    start: dict[str, Any]
    a: Container | None = None
    b: Container | None = None
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per level, the identity record once ready ("original", "A", "B")."""


def _start(gvisor: GVisorHarness, tmp_path: Path, name: str, *, socket: bool,
           ballast_mb: int = 0, extra_env: dict[str, str] | None = None) -> Chain:
    proc = tmp_path / f"proc-{name}"
    write_spec_environ(proc, {"APP": "original"})
    env = {"APP": "original", "REHYDRATE_GVISOR_PROC": PROC, **(extra_env or {})}
    if socket:
        env["REHYDRATE_CONTROL_SOCKET"] = SOCKET
    if ballast_mb:  # the leave-running checkpoint freezes A long enough to be seen
        env["BALLAST_MB"] = str(ballast_mb)
    c = gvisor.run([sys.executable, "-c", WORKLOAD], env=env, mounts=[Mount(PROC, proc)],
                   name=name)
    return Chain(name, socket, c, {})


def _ready(chain: Chain) -> None:
    rec = chain.orig.wait_for("ev.jsonl", lambda r: r["event"] == "ready", timeout=90)
    assert ("control" in rec["detectors"]) is chain.socket, rec
    assert "clock-jump" in rec["detectors"], rec
    assert (rec["status_generation"], rec["status_state"]) == (0, "running"), rec
    chain.start = rec
    chain.seen["original"] = rec


def _status(c: Container) -> dict[str, Any]:
    proc = c.exec([REHYDRATE, "status", "--json"], timeout=60)
    assert proc.returncode == 0, (c.id, proc.stdout, proc.stderr)
    status: dict[str, Any] = json.loads(proc.stdout)
    return status


def _save(c: Container, generation: int) -> None:
    """``notify save`` (what save-restore-exec runs before a checkpoint)."""
    reply = notify(c, "save")
    assert reply["ok"] is True, reply
    st = _status(c)
    assert (st["state"], st["generation"], st["ready"]) == ("snapshotting", generation, False), (
        c.id, st)


def _restore(gvisor: GVisorHarness, tmp_path: Path, template: Container, name: str, *,
             hold: bool = False) -> Container:
    proc = tmp_path / f"proc-{name}"
    write_spec_environ(proc, {"APP": name})
    if hold:  # see HOLD_CLOCK in the workload
        (proc / "hold").touch()
    assert template.image is not None
    return gvisor.restore(template.image, template, name=name, mounts=[Mount(PROC, proc)])


def _resumed(c: Container, generation: int, chain: Chain, level: str) -> dict[str, Any]:
    """The clone's readiness checks (``restore_helpers.restored``), its hook runs
    (one, for this restore, at this generation) and its status once ready."""
    rec = restored(c)
    assert [r for r in c.records("ev.jsonl") if r["event"] == "resumed" and r["lie"]] == []
    assert rec["app"] == c.id.rsplit("-", 2)[0], (rec, c.id)  # its own spec_environ
    assert [(r["reason"], r["kind"], r["generation"]) for r in hook_runs(c)] == [
        ("clock-jump", "restore", generation)], (level, hook_runs(c))
    assert (rec["status_generation"], rec["status_state"]) == (generation, "ready"), rec
    hook = hook_runs(c)[0]
    assert (hook["instance_id"], hook["key"]) == (rec["instance_id"], rec["key"]), (hook, rec)
    if chain.socket:
        st = _status(c)
        assert (st["state"], st["generation"], st["ready"]) == ("ready", generation, True), st
        assert (st["last_report"]["reason"], st["last_report"]["generation"]) == (
            "clock-jump", generation), st
    chain.seen[level] = rec
    return rec


def _distinct(chain: Chain) -> None:
    """Every process of the chain has its own instance id and managed key."""
    for what in ("instance_id", "key"):
        values = {level: rec[what] for level, rec in chain.seen.items()}
        assert len(set(values.values())) == len(values), (chain.name, what, values)


def _late_notify(b: Container) -> None:
    """A ``notify restore`` to B after B's clock jump ran its hooks: B's restore, again."""
    last = _status(b)["last_report"]
    reply = notify(b, "restore")
    assert reply["deduplicated"] is True, reply
    report = reply["report"]
    assert (report["reason"], report["kind"], report["generation"]) == (
        "clock-jump", "restore", 2), reply
    assert report["started_at"] == last["started_at"], (reply, last)
    assert report["confirmed_by"] == ["control"], reply
    assert len(hook_runs(b)) == 1, hook_runs(b)
    st = _status(b)
    assert (st["state"], st["generation"], st["ready"]) == ("ready", 2, True), st
    assert st["last_report"]["confirmed_by"] == ["control"], st


def _checkpoint_all(chains: list[Chain], attr: str) -> None:
    """Checkpoint ``chain.<attr>`` of every chain, then let every one stay frozen long
    enough for its clone's clock jump (a restore, not a stall)."""
    for chain in chains:
        getattr(chain, attr).checkpoint()
    frozen_until(time.monotonic())


@pytest.mark.gvisor
def test_chain_clock_jump_only(gvisor_uncompressed: GVisorHarness, tmp_path: Path) -> None:
    """No notify at any level; one chain without the control socket, one with it (no
    request until the late ``notify restore`` to B)."""
    gvisor = gvisor_uncompressed
    chains = [_start(gvisor, tmp_path, "plain", socket=False),
              _start(gvisor, tmp_path, "sock", socket=True)]
    for chain in chains:
        _ready(chain)
    _checkpoint_all(chains, "orig")
    for chain in chains:
        chain.a = _restore(gvisor, tmp_path, chain.orig, f"{chain.name}-A")
    for chain in chains:
        assert chain.a is not None
        _resumed(chain.a, 1, chain, "A")
    _checkpoint_all(chains, "a")
    for chain in chains:
        assert chain.a is not None
        chain.b = _restore(gvisor, tmp_path, chain.a, f"{chain.name}-B")
    for chain in chains:
        assert chain.a is not None and chain.b is not None
        _resumed(chain.b, 2, chain, "B")
        _distinct(chain)
        assert len(hook_runs(chain.a)) == 1, hook_runs(chain.a)
    sock = chains[1]
    assert sock.b is not None
    _late_notify(sock.b)


@pytest.mark.gvisor
def test_chain_notify_save_then_only_the_clock_jump(
        gvisor_uncompressed: GVisorHarness, tmp_path: Path) -> None:
    """``notify save`` before each checkpoint, no notice after either restore: A and B
    each wake with a snapshot pending and only their clock jump sees the restore."""
    gvisor = gvisor_uncompressed
    chain = _start(gvisor, tmp_path, "save", socket=True)
    _ready(chain)
    _save(chain.orig, 0)
    _checkpoint_all([chain], "orig")
    chain.a = _restore(gvisor, tmp_path, chain.orig, "save-A")
    _resumed(chain.a, 1, chain, "A")
    _save(chain.a, 1)
    _checkpoint_all([chain], "a")
    chain.b = _restore(gvisor, tmp_path, chain.a, "save-B")
    _resumed(chain.b, 2, chain, "B")
    _distinct(chain)
    assert len(hook_runs(chain.a)) == 1, hook_runs(chain.a)
    _late_notify(chain.b)


@pytest.mark.gvisor
def test_chain_leave_running_clone_of_a_clone(
        gvisor_uncompressed: GVisorHarness, tmp_path: Path) -> None:
    """A gets ``notify save`` and ``runsc checkpoint --leave-running``: it is ready again by
    itself (its clock jump ends the snapshot: kind ``restore``, generation 2, a fresh
    identity — without a notice it cannot tell it is not a clone) and keeps serving; B,
    restored from that image, runs its hooks once at generation 2 with its own identity."""
    gvisor = gvisor_uncompressed
    # 64 MB that do not compress: A's leave-running dump freezes it for long enough that
    # the clock jump sees it (as with a real model; see test_restore_path).
    chain = _start(gvisor, tmp_path, "leave", socket=True, ballast_mb=64)
    _ready(chain)
    _save(chain.orig, 0)
    _checkpoint_all([chain], "orig")
    a = chain.a = _restore(gvisor, tmp_path, chain.orig, "leave-A")
    _resumed(a, 1, chain, "A")
    _save(a, 1)
    a.checkpoint(leave_running=True)
    # A comes back by itself: no notify resume.
    deadline = time.monotonic() + 5.0
    while len(hook_runs(a)) < 2:
        assert time.monotonic() < deadline, ("A is not ready 5 s after the checkpoint",
                                             _status(a), hook_runs(a))
        time.sleep(0.05)
    assert [(r["reason"], r["kind"], r["generation"]) for r in hook_runs(a)] == [
        ("clock-jump", "restore", 1), ("clock-jump", "restore", 2)], hook_runs(a)
    st = _status(a)
    assert (st["state"], st["generation"], st["ready"]) == ("ready", 2, True), st
    again = hook_runs(a)[1]
    chain.seen["A after its checkpoint"] = again

    frozen_until(time.monotonic())
    b = chain.b = _restore(gvisor, tmp_path, a, "leave-B")
    _resumed(b, 2, chain, "B")
    _distinct(chain)
    _late_notify(b)
    # A kept serving through all that, unaffected by B: same runs, still ready, its main
    # loop still turning.
    before = _status(a)
    after = status_until(a, lambda s: s["test_loops"] > before["test_loops"])
    assert (after["state"], after["generation"], after["ready"]) == ("ready", 2, True), after
    assert len(hook_runs(a)) == 2, hook_runs(a)
    # (a dump that froze A's loop for more than GAP: it was not ready before its hook ran)
    assert [r for r in a.records("ev.jsonl") if r["event"] == "resumed" and r["lie"]] == []


@pytest.mark.gvisor
def test_chain_notify_restore_before_the_clock_jump_thread_wakes(
        gvisor_uncompressed: GVisorHarness, tmp_path: Path) -> None:
    """The platform's ``notify restore`` is the restore notice at both levels (no ``notify
    save``); the clock jump's threshold (20 s) is above these freezes, so for its thread
    each one is only a gap. In B the notice comes before that thread has woken (held by
    the workload). B's memory is A's, and the last freeze A's watch had recorded was the
    one before A's restore: B's notice was taken for A's restore (``deduplicated``,
    generation 1) and B's hooks never ran — A's key and instance id in B. Now the
    heartbeat, overdue by more than a sleep and the gap slack, makes it a new restore."""
    gvisor = gvisor_uncompressed
    chain = _start(gvisor, tmp_path, "early", socket=True,
                   extra_env={"REHYDRATE_CLOCK_THRESHOLD": "20", "HOLD_CLOCK": "1"})
    _ready(chain)
    _checkpoint_all([chain], "orig")
    a = chain.a = _restore(gvisor, tmp_path, chain.orig, "early-A")
    reply = notify(a, "restore")
    assert reply["deduplicated"] is False, reply
    assert [(r["reason"], r["kind"], r["generation"]) for r in hook_runs(a)] == [
        ("control", "restore", 1)], hook_runs(a)
    chain.seen["A"] = hook_runs(a)[0]
    _checkpoint_all([chain], "a")
    b = chain.b = _restore(gvisor, tmp_path, a, "early-B", hold=True)
    reply = notify(b, "restore")
    assert reply["deduplicated"] is False, ("B's restore taken for A's", reply)
    assert (reply["report"]["reason"], reply["report"]["generation"]) == ("control", 2), reply
    assert [(r["reason"], r["kind"], r["generation"]) for r in hook_runs(b)] == [
        ("control", "restore", 2)], hook_runs(b)
    chain.seen["B"] = hook_runs(b)[0]
    _distinct(chain)
    # B's clock-jump thread wakes: a gap, not a restore; a second notice is B's restore.
    ticks = _status(b)["test_clock_ticks"]
    assert b.exec(["/bin/touch", "/var/tmp/release"], timeout=60).returncode == 0
    status_until(b, lambda st: st["test_clock_ticks"] > ticks + 1)
    again = notify(b, "restore")
    assert again["deduplicated"] is True, again
    assert (again["report"]["reason"], again["report"]["generation"]) == ("control", 2), again
    st = _status(b)
    assert (st["state"], st["generation"], st["ready"]) == ("ready", 2, True), st
    assert len(hook_runs(b)) == 1 and len(hook_runs(a)) == 1, (hook_runs(a), hook_runs(b))
