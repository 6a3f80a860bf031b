"""Smoke tests proving the gVisor harness: run, exec, checkpoint, restore clones."""

from __future__ import annotations

import hashlib
import secrets
import sys
import time
from pathlib import Path

import pytest

from .harness import (
    GVisorHarness,
    Mount,
    image_contains,
    read_jsonl,
    wait_for_file,
)

SPEC_ENVIRON = "/etc/rehydrate-test/spec_environ"  # stands in for /proc/gvisor/spec_environ

# Appends one JSON line every 0.2 s to /results/counter.jsonl: a counter, both
# clocks, the current content of the emulated spec_environ, and a digest of a
# marker that lives only in the process's heap (decoded from hex at start).
COUNTER = f"""
import hashlib, json, os, sys, time
marker = bytes.fromhex(os.environ.get("MARKER_HEX", ""))
out = open("/results/counter.jsonl", "a", buffering=1)
i = 0
while True:
    try:
        with open({SPEC_ENVIRON!r}, "rb") as f:
            env = f.read().decode()
    except OSError as exc:
        env = "error: %s" % exc
    out.write(json.dumps({{
        "i": i, "mono": time.monotonic(), "wall": time.time(), "env": env,
        "pid": os.getpid(), "marker_sha": hashlib.sha256(marker).hexdigest(),
        "python": sys.executable, "prefix": sys.prefix,
    }}) + "\\n")
    i += 1
    time.sleep(0.2)
"""


def _write_spec_environ(path: Path, **env: str) -> None:
    path.write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


@pytest.mark.gvisor
def test_checkpoint_restore_into_clones(gvisor: GVisorHarness, tmp_path: Path) -> None:
    spec_environ = tmp_path / "spec_environ"
    _write_spec_environ(spec_environ, GEN="original")
    orig = gvisor.run(
        [sys.executable, "-c", COUNTER],
        mounts=[Mount(SPEC_ENVIRON, spec_environ)],
        name="counter",
    )
    rec = orig.wait_for("counter.jsonl", lambda r: r["i"] >= 3, timeout=30)
    assert rec["env"] == "GEN=original\0"
    assert rec["pid"] == 1
    assert rec["prefix"] == sys.prefix, "the sandbox must run the test's own (virtualenv) Python"

    t0 = time.monotonic()
    image = orig.checkpoint()
    checkpoint_s = time.monotonic() - t0
    frozen_at = time.monotonic()
    assert orig.status() != "running"
    last = orig.records("counter.jsonl")[-1]

    # Emulate a new spec environment: rewrite the bind-mounted file in place for
    # clones 0 and 1; clone 2 gets a different host file at the same path.
    _write_spec_environ(spec_environ, GEN="restored", API_KEY="new")
    own = tmp_path / "spec_environ_clone2"
    _write_spec_environ(own, GEN="clone2")

    # Freeze for a known while so that the clock step is well above noise.
    while time.monotonic() - frozen_at < 1.0:
        time.sleep(0.05)

    restore_s = []
    clones = []
    for k in range(3):
        mounts = [Mount(SPEC_ENVIRON, own)] if k == 2 else []
        t0 = time.monotonic()
        clones.append(gvisor.restore(image, orig, name=f"clone{k}", mounts=mounts))
        restore_s.append(time.monotonic() - t0)

    expected = ["GEN=restored\0API_KEY=new\0"] * 2 + ["GEN=clone2\0"]
    steps = []
    for clone, env in zip(clones, expected):
        rec = clone.wait_for("counter.jsonl", lambda r: r["i"] >= last["i"] + 3, timeout=30)
        first = clone.records("counter.jsonl")[0]
        # The counter continues from the checkpointed memory, not from zero.
        assert first["i"] == last["i"] + 1, (first, last)
        assert rec["pid"] == 1 and rec["marker_sha"] == last["marker_sha"]
        assert rec["env"] == env, clone.id
        steps.append((first["mono"] - last["mono"], first["wall"] - last["wall"]))
    assert len({c.results for c in clones}) == 3

    # Observation (DESIGN §4): CLOCK_MONOTONIC inside a clone includes the time frozen.
    for mono_step, wall_step in steps:
        assert mono_step > 1.0, steps
        assert abs(mono_step - wall_step) < 0.5, steps
    print(
        f"\nrunsc={gvisor.runsc} checkpoint={checkpoint_s:.2f}s "
        f"restore={','.join(f'{s:.2f}' for s in restore_s)}s "
        f"image={sum(f.stat().st_size for f in image.iterdir()) / 1e6:.1f}MB "
        f"monotonic steps={','.join(f'{m:.2f}' for m, _ in steps)}s "
        f"wall steps={','.join(f'{w:.2f}' for _, w in steps)}s"
    )


@pytest.mark.gvisor
def test_exec_runs_inside_the_running_sandbox(gvisor: GVisorHarness) -> None:
    c = gvisor.run(
        [
            sys.executable,
            "-c",
            "import time; open('/results/ready', 'w').write('1'); time.sleep(600)",
        ],
        env={"WHO": "workload"},
        name="sleeper",
    )
    wait_for_file(c.result_file("ready"), timeout=30, alive=c.dead_reason)

    proc = c.exec(["/bin/sh", "-c", 'echo "hello $WHO from $(hostname)"; echo oops >&2; exit 3'])
    assert proc.returncode == 3
    assert proc.stdout == "hello workload from rehydrate-test\n"
    assert proc.stderr == "oops\n"

    # Same sandbox: the workload is PID 1 there, and /results is shared.
    code = "import os; print(open('/proc/1/cmdline').read().count('sleep(600)'), os.environ['WHO'])"
    proc = c.exec(
        [sys.executable, "-c", code], env={"WHO": "exec", "PATH": "/usr/bin:/bin"}, check=True
    )
    assert proc.stdout.split() == ["1", "exec"]
    proc = c.exec(["/bin/sh", "-c", "echo from-exec > /results/exec.txt"], check=True)
    assert c.result_file("exec.txt").read_text() == "from-exec\n"


@pytest.mark.gvisor
def test_uncompressed_image_exposes_memory(
    gvisor_uncompressed: GVisorHarness, tmp_path: Path
) -> None:
    gvisor = gvisor_uncompressed
    marker = b"REHYDRATE-TEST-MARKER-" + secrets.token_hex(16).encode()
    spec_environ = tmp_path / "spec_environ"
    _write_spec_environ(spec_environ, GEN="original")
    orig = gvisor.run(
        [sys.executable, "-c", COUNTER],
        env={"MARKER_HEX": marker.hex()},  # the raw marker exists only in the heap
        mounts=[Mount(SPEC_ENVIRON, spec_environ)],
        name="marker",
    )
    orig.wait_for("counter.jsonl", lambda r: r["i"] >= 2, timeout=30)

    plain = orig.checkpoint(tmp_path / "plain", compression="none", leave_running=True)
    assert (plain / "pages.img").exists()
    assert image_contains(plain, marker) >= 1
    assert image_contains(plain, b"REHYDRATE-TEST-MARKER-" + secrets.token_hex(16).encode()) == 0

    # The original keeps running after -leave-running ...
    n = len(orig.records("counter.jsonl"))
    orig.wait_for("counter.jsonl", lambda r: r["i"] >= n + 1, timeout=30)
    # ... and the default (flate) compression hides the marker from grep.
    packed = orig.checkpoint(tmp_path / "packed")
    assert image_contains(packed, marker) == 0

    # An uncompressed image restores like any other.
    clone = gvisor.restore(plain, orig, name="plain-clone")
    rec = clone.wait_for("counter.jsonl", lambda r: True, timeout=30)
    assert rec["marker_sha"] == hashlib.sha256(marker).hexdigest()


# ----------------------------------------------------------- pure helpers (no runsc)


def test_read_jsonl_skips_nul_hole_and_partial_line(tmp_path: Path) -> None:
    f = tmp_path / "r.jsonl"
    f.write_bytes(b"\0" * 100 + b'{"i": 1}\nnot json\n[1]\n{"i": 2}\n{"i": 3')
    assert read_jsonl(f) == [{"i": 1}, {"i": 2}]
    assert read_jsonl(tmp_path / "missing") == []


def test_image_contains_counts_across_files(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.img").write_bytes(b"xxNEEDLExxNEEDLENEEDLE")
    (tmp_path / "sub" / "b.img").write_bytes(b"NEEDLE")
    (tmp_path / "empty.img").write_bytes(b"")
    assert image_contains(tmp_path, b"NEEDLE") == 4
    assert image_contains(tmp_path, b"HAYSTACK") == 0


CAPS = r"""
for line in open("/proc/self/status"):
    if line.startswith(("CapEff:", "CapBnd:")):
        print(line.split()[0], int(line.split()[1], 16) >> 12 & 1)  # CAP_NET_ADMIN
"""


@pytest.mark.gvisor
def test_capabilities_are_added_to_the_sandboxed_process(gvisor: GVisorHarness) -> None:
    """``capabilities=`` gives the process capabilities ``runsc spec``'s default set lacks
    (CAP_NET_ADMIN, to change routes), and only when asked."""
    plain = gvisor.run_once([sys.executable, "-c", CAPS], name="caps-plain")
    admin = gvisor.run_once([sys.executable, "-c", CAPS], name="caps-admin",
                            capabilities=["NET_ADMIN", "CAP_NET_ADMIN"])
    assert (plain.returncode, admin.returncode) == (0, 0), (plain.stderr, admin.stderr)
    assert plain.stdout.split() == ["CapEff:", "0", "CapBnd:", "0"], plain.stdout
    assert admin.stdout.split() == ["CapEff:", "1", "CapBnd:", "1"], admin.stdout
    spec = gvisor.make_spec(["true"], results_source=Path("/nonexistent"),
                            capabilities=["net_admin"])
    assert spec["process"]["capabilities"]["bounding"].count("CAP_NET_ADMIN") == 1
    with pytest.raises(ValueError, match="not a capability name: 'NET ADMIN'"):
        gvisor.run_once(["true"], capabilities=["NET ADMIN"])
    with pytest.raises(TypeError, match="not one string"):
        gvisor.run_once(["true"], capabilities="NET_ADMIN")
