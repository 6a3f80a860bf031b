"""Snapshot manifest: drift detection, `rehydrate check`, miss detection."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import rehydrate
from rehydrate import env as fp_env
from rehydrate import fingerprint as fp
from rehydrate._cli import check_manifest

ROOT = Path(__file__).resolve().parents[2]

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse sse2 avx avx2 avx512f amx_tile

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse sse2 avx avx2 avx512f amx_tile
"""
NVIDIA = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  "
          "Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0\n")


def make_root(base: Path, *, cpuinfo: str = CPUINFO, kernel: str = "6.1.0-18-cloud-amd64",
              nvidia: str | None = NVIDIA, gvisor: bool = False) -> Path:
    (base / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
    (base / "proc/cpuinfo").write_text(cpuinfo)
    (base / "proc/sys/kernel/osrelease").write_text(kernel + "\n")
    nv = base / "proc/driver/nvidia/version"
    if nvidia is None:
        nv.unlink(missing_ok=True)
    else:
        nv.parent.mkdir(parents=True, exist_ok=True)
        nv.write_text(nvidia)
    if gvisor:
        (base / "proc/gvisor").mkdir(exist_ok=True)
    return base


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rehydrate", *args], capture_output=True,
                          text=True, timeout=60, check=False, env=env, cwd=ROOT)


def test_manifest_fields_from_fake_proc(tmp_path):
    root = make_root(tmp_path, gvisor=True)
    m = fp.fingerprint(root=root)
    json.dumps(m)  # JSON-serialisable
    assert m["cpu_vendor"] == "GenuineIntel"
    assert m["cpu_model"].startswith("Intel(R) Xeon(R) Platinum 8481C")
    assert m["cpu_flags"] == sorted(["fpu", "sse", "sse2", "avx", "avx2", "avx512f", "amx_tile"])
    assert m["kernel_release"] == "6.1.0-18-cloud-amd64"
    assert m["gpu_driver"] == "535.104.05"
    assert m["gvisor"] is True
    assert m["python"] == platform.python_version()
    assert m["arch"] == platform.machine()
    assert m["distributions"].startswith("sha256:") and m["distributions_count"] > 5
    # the contract's spelling: rehydrate.fingerprint(...) is callable
    assert {k: v for k, v in rehydrate.fingerprint(root=root).items() if k != "env"} == {
        k: v for k, v in m.items() if k != "env"}


def test_real_node_manifest_has_platform_release_and_no_per_process_fields(monkeypatch):
    monkeypatch.setenv("MODEL_URL", "https://models.example/v7")
    m = fp.fingerprint(env_keys=["MODEL_URL", "ABSENT_KEY"])
    assert m["kernel_release"] == platform.release()
    text = json.dumps(m)
    assert "models.example" not in text  # env values never in clear
    assert m["env"]["keys"]["ABSENT_KEY"] is None
    assert m["env"]["keys"]["MODEL_URL"].startswith("sha256:")
    assert str(os.getpid()) not in json.dumps({k: v for k, v in m.items() if k != "env"})
    # same salt, another process: identical manifest (no PID, no timestamps)
    salt = m["env"]["salt"]
    code = ("import json,sys; from rehydrate.fingerprint import fingerprint; "
            f"print(json.dumps(fingerprint(['MODEL_URL','ABSENT_KEY'], salt={salt!r})))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=60, env=dict(os.environ))
    assert json.loads(other.stdout) == m


def test_drift_in_fake_proc_is_reported_field_by_field(tmp_path):
    root = make_root(tmp_path)
    manifest = fp.fingerprint(root=root)
    assert fp.check(manifest, root) == []

    make_root(tmp_path, kernel="6.8.0-1015-gcp",
              nvidia=NVIDIA.replace("535.104.05", "550.54.15"),
              cpuinfo=CPUINFO.replace(" amx_tile", "").replace(" avx512f", " avx512f avx_vnni"))
    mism = {m.field: m for m in fp.check(manifest, root)}
    assert set(mism) == {"kernel_release", "gpu_driver", "cpu_flags"}
    assert (mism["gpu_driver"].expected, mism["gpu_driver"].actual) == ("535.104.05", "550.54.15")
    assert mism["kernel_release"].actual == "6.8.0-1015-gcp"
    assert mism["cpu_flags"].expected == ["amx_tile"]  # extra flags (avx_vnni) are fine
    field, reason = fp.most_likely_reason(fp.check(manifest, root))
    assert field == "gpu_driver" and "550.54.15" in reason

    make_root(tmp_path, cpuinfo=CPUINFO.replace("8481C", "8581C"), nvidia=None)
    mism = {m.field: m for m in fp.check(manifest, root)}
    assert mism["gpu_driver"].actual is None
    assert "cpu_model" in mism


def test_env_key_change_is_a_mismatch(monkeypatch):
    monkeypatch.setenv("MODEL_REVISION", "r1")
    manifest = fp.fingerprint(env_keys=["MODEL_REVISION"])
    assert fp.check(manifest) == []
    monkeypatch.setenv("MODEL_REVISION", "r2")
    (m,) = fp.check(manifest)
    assert m.field == "env.MODEL_REVISION"
    assert "r1" not in json.dumps(m.to_dict()) and "r2" not in json.dumps(m.to_dict())


def test_check_cli_exit_codes_and_json(tmp_path):
    # a fresh manifest written by another process passes on the same node
    path = tmp_path / "m.json"
    subprocess.run([sys.executable, "-c",
                    "import sys; from rehydrate.fingerprint import fingerprint, write_manifest;"
                    f"write_manifest(fingerprint(), {str(path)!r})"],
                   check=True, timeout=60, cwd=ROOT)
    ok = run_cli("check", str(path), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"compatible": True, "scope": "all", "mismatches": []}
    assert run_cli("check", str(path)).returncode == 0

    manifest = json.loads(path.read_text())
    manifest["gvisor_version"] = "release-20250101.0"
    manifest["python"] = "3.9.0"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(manifest))
    res = run_cli("check", str(bad), "--json")
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["compatible"] is False
    assert out["mismatches"] == [
        {"field": "gvisor_version", "expected": "release-20250101.0", "actual": None},
        {"field": "python", "expected": "3.9.0", "actual": platform.python_version()},
    ]
    text = run_cli("check", str(bad))
    assert text.returncode == 1 and "gvisor_version" in text.stdout

    # fake proc root (hidden --root option): drift seen by the CLI too
    root = make_root(tmp_path / "node")
    fp.write_manifest(fp.fingerprint(root=root), tmp_path / "fake.json")
    make_root(tmp_path / "node", nvidia=NVIDIA.replace("535.104.05", "550.54.15"))
    res = run_cli("check", str(tmp_path / "fake.json"), "--json", "--root", str(root))
    assert res.returncode == 1
    assert [m["field"] for m in json.loads(res.stdout)["mismatches"]] == ["gpu_driver"]

    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    for p in ("missing.json", "garbage.json", "other.json"):
        res = run_cli("check", str(tmp_path / p), "--json")
        assert res.returncode == 2, p
        assert json.loads(res.stdout)["compatible"] is False
        assert run_cli("check", str(tmp_path / p)).returncode == 2


def _broken_manifests() -> dict[str, object]:
    good = fp.fingerprint(env_keys=["HOME"])
    out: dict[str, object] = {
        "empty": {"schema": 1},  # truncated: nothing to compare is not "compatible"
        "cpu_flags_int": {"schema": 1, "cpu_flags": 5},
        "schema_true": {**good, "schema": True},
        "a_list": [good],
        "cpu_flags_not_str": {**good, "cpu_flags": ["sse", 2]},
        "cpu_flags_str": {**good, "cpu_flags": "sse sse2"},
        "gvisor_str": {**good, "gvisor": "yes"},
        "python_int": {**good, "python": 3},
        "salt_int": {**good, "env": {"salt": 5, "keys": {}}},
        "env_keys_list": {**good, "env": {"salt": "ab", "keys": ["HOME"]}},
        "env_hash_int": {**good, "env": {"salt": "ab", "keys": {"HOME": 1}}},
        "env_list": {**good, "env": []},
    }
    for field in (*fp._COMPARED, "env"):
        if field not in fp._OPTIONAL:  # a field added later may be missing in old manifests
            out[f"without_{field}"] = {k: v for k, v in good.items() if k != field}
    return out


def test_incomplete_or_mistyped_manifest_is_invalid_not_compatible(tmp_path):
    good = fp.fingerprint(env_keys=["HOME"])
    assert fp.check(good) == []
    for name, manifest in _broken_manifests().items():
        with pytest.raises(fp.ManifestError):
            fp.check(manifest)  # type: ignore[arg-type]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(manifest))
        with pytest.raises(fp.ManifestError) as info:
            fp.load_manifest(path)
        assert str(path) in str(info.value), name
        if name.startswith("without_"):
            assert name[len("without_"):] in str(info.value)
    with pytest.raises(fp.ManifestError, match="cpu_flags"):
        fp.check({**good, "cpu_flags": 5})


def test_check_cli_exit_2_for_invalid_manifest_with_one_readable_line(tmp_path):
    for name, manifest in (("empty", {"schema": 1}), ("flags", {"schema": 1, "cpu_flags": 5})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(manifest))
        res = run_cli("check", str(path), "--json")
        assert res.returncode == 2, (name, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr
        out = json.loads(res.stdout)
        assert out["compatible"] is False and out["mismatches"] == []
        assert out["scope"] == "all"  # the keys of every other answer, and "error"
        assert "invalid rehydrate manifest" in out["error"] and "\n" not in out["error"]
        res = run_cli("check", str(path))
        assert res.returncode == 2, (name, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr and res.stdout == ""
        (line,) = res.stderr.strip().splitlines()
        assert line.startswith("rehydrate check: ") and str(path) in line
    assert "cpu_flags" in line


def test_check_escapes_a_manifest_path_with_a_terminal_escape_or_a_newline(tmp_path):
    """A manifest whose name holds a terminal escape (and a newline): its error went out
    with the escape as it was (only whitespace was collapsed), and so did the answer for a
    readable one; now escaped, on one line, as every other check and doctor line."""
    name = "m\x1b[2J\x1b]0;owned\x07\nrehydrate check: compatible.json"
    shown = "m\\x1b[2J\\x1b]0;owned\\x07\\nrehydrate check: compatible.json"
    bad = tmp_path / name
    bad.write_text('{"schema": 1, "cpu_flags": 5}')
    res = run_cli("check", str(bad))
    assert res.returncode == 2 and res.stdout == "", res
    (line,) = res.stderr.splitlines()
    assert res.stderr.endswith("\n") and "\x1b" not in line and "\x07" not in line
    assert line.startswith(f"rehydrate check: {tmp_path}/{shown}: invalid rehydrate manifest")
    assert json.loads(run_cli("check", str(bad), "--json").stdout)["error"].startswith(
        f"{tmp_path}/{name.replace(chr(10), ' ')}: ")  # JSON: as it is, on one line

    good = tmp_path / name.replace("compatible", "good")
    fp.write_manifest(fp.fingerprint(), good)
    res = run_cli("check", str(good))
    assert res.returncode == 0 and res.stderr == "", res
    assert res.stdout == f"compatible with {tmp_path}/{shown.replace('compatible', 'good')}\n"


def test_check_exit_2_for_a_manifest_nested_too_deeply_and_an_oversized_env_file(
        tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert check_manifest(str(deep)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "nested too deeply" in line and str(deep) in line
    manifest = tmp_path / "m.json"
    fp.write_manifest(fp.fingerprint(env_keys=["HOME"]), manifest)
    env_file = tmp_path / "big.env"  # what a 1 MiB read used to cut short, then compare
    env_file.write_bytes(b"PAD=" + b"x" * (fp_env.MAX_ENVIRON_BYTES + 10) + b"\nHOME=/x\n")
    assert check_manifest(str(manifest), env_file=str(env_file)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "larger than" in line and str(env_file) in line


def test_main_check_maps_errors_from_comparing_to_exit_2(tmp_path, monkeypatch, capsys):
    path = tmp_path / "m.json"
    fp.write_manifest(fp.fingerprint(), path)

    def broken(manifest, root="/", **kwargs):
        raise TypeError("unhashable type: 'dict'\nsecond line")

    monkeypatch.setattr(fp, "check", broken)
    assert check_manifest(str(path), as_json=True) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["compatible"] is False and "TypeError" in out["error"]
    assert check_manifest(str(path)) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert "TypeError" in line and str(path) in line


def test_different_package_set_in_a_second_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin/python"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}
    code = ("import json; from rehydrate.fingerprint import fingerprint; "
            "print(json.dumps(fingerprint()))")
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60,
                         check=False, env=env)
    assert res.returncode == 0, res.stderr
    theirs = json.loads(res.stdout)
    ours = fp.fingerprint()
    assert theirs["distributions"] != ours["distributions"]
    assert theirs["distributions_count"] < ours["distributions_count"]
    assert theirs["python"] == ours["python"] and theirs["kernel_release"] == ours["kernel_release"]
    path = tmp_path / "venv-manifest.json"
    path.write_text(json.dumps(theirs))
    out = run_cli("check", str(path), "--json")
    assert out.returncode == 1
    assert [m["field"] for m in json.loads(out.stdout)["mismatches"]] == ["distributions"]


def test_manifest_written_before_snapshot_and_checked_after_restore(rehydrate_engine, tmp_path,
                                                                    caplog):
    engine = rehydrate_engine
    root = make_root(tmp_path / "node")
    path = tmp_path / "vol" / "manifest.json"
    fp.configure(path=path, root=root, engine=engine)
    assert engine.simulate_snapshot().ok
    written = fp.load_manifest(path)
    assert written["gpu_driver"] == "535.104.05"
    # shown with the environment's key names only (none configured here)
    assert engine.status().extra["fingerprint"]["manifest"] == {**written,
                                                                 "env": {"keys": []}}

    # restore on a node with the same properties: compatible
    report = engine.simulate_restore()
    assert report.ok
    assert engine.status().extra["fingerprint"]["compatible"] is True

    # restore on an upgraded node: reported, but not fatal unless strict
    make_root(tmp_path / "node", nvidia=NVIDIA.replace("535.104.05", "550.54.15"))
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        report = engine.simulate_restore()
    assert report.ok
    st = engine.status().extra["fingerprint"]
    assert st["compatible"] is False
    assert st["mismatches"] == [{"field": "gpu_driver", "expected": "535.104.05",
                                 "actual": "550.54.15"}]
    lines = [r.getMessage() for r in caplog.records if "differs from the snapshot" in r.message]
    assert len(lines) == 1 and "gpu_driver" in lines[0]

    fp.configure(strict=True, engine=engine)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        report = engine.simulate_restore()
    assert not report.ok
    (hook,) = [h for h in report.hooks if h.name == "rehydrate.fingerprint.check"]
    assert hook.outcome == "failed" and hook.required
    assert isinstance(hook.error, fp.FingerprintMismatch)
    # one line for one fact: the engine's for the failed hook (was also a WARNING)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "gpu_driver" in r.message]
    assert len(said) == 1 and said[0][0] == "ERROR" and "FingerprintMismatch" in said[0][1]
    assert engine.state == "degraded" and not engine.is_ready()
    # a resume (same node, same process) is not checked
    assert engine.simulate_restore(kind="resume").ok


def test_manifest_embedded_in_status_only(rehydrate_engine):
    engine = rehydrate_engine
    fp.configure(engine=engine)
    engine.simulate_snapshot()
    st = engine.status().to_dict()["fingerprint"]
    assert st["path"] is None and st["manifest"]["schema"] == fp.SCHEMA
    json.dumps(st)


_MISS = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import rehydrate
rehydrate.start(detectors="none")
print(json.dumps(rehydrate.status().to_dict().get("fingerprint")))
"""


def _start(env_extra: dict[str, str]) -> tuple[dict | None, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REHYDRATE_")}
    env.update(env_extra)
    res = subprocess.run([sys.executable, "-c", _MISS], capture_output=True, text=True,
                         timeout=60, check=False, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def test_miss_detected_when_manifest_exists_and_process_starts_cold(tmp_path):
    path = tmp_path / "manifest.json"
    # the first Pod: no manifest yet, no miss
    st, err = _start({"REHYDRATE_MANIFEST": str(path)})
    assert st is not None and st["snapshot_miss"] is None
    assert "snapshot-miss" not in err

    # a snapshot was taken on a node with another GPU driver; this Pod started cold
    manifest = fp.fingerprint()
    manifest["gpu_driver"] = "535.104.05"
    fp.write_manifest(manifest, path)
    st, err = _start({"REHYDRATE_MANIFEST": str(path)})
    miss = st["snapshot_miss"]
    assert miss["field"] == "gpu_driver"
    assert "535.104.05" in miss["reason"]
    assert miss["expected_by"] == f"manifest {path}"
    assert err.count("snapshot-miss") == 1 and "gpu_driver" in err

    # the same node's manifest: the snapshot itself must be missing
    fp.write_manifest(fp.fingerprint(), path)
    st, _ = _start({"REHYDRATE_MANIFEST": str(path)})
    assert st["snapshot_miss"]["field"] is None
    assert "not found" in st["snapshot_miss"]["reason"]


def test_miss_declared_by_environment_without_manifest():
    st, err = _start({"REHYDRATE_EXPECT_RESTORE": "1"})
    assert st["snapshot_miss"]["expected_by"] == "REHYDRATE_EXPECT_RESTORE"
    assert "cause unknown" in st["snapshot_miss"]["reason"]
    assert "snapshot-miss" in err
    st, err = _start({})
    assert st is None and "snapshot-miss" not in err


@pytest.mark.parametrize("manifest", [False, True])
def test_fingerprint_env_and_strict_alone_say_once_that_they_do_nothing(
        rehydrate_engine, monkeypatch, caplog, tmp_path, manifest):
    """Before: REHYDRATE_FINGERPRINT_STRICT / _ENV without REHYDRATE_MANIFEST (or
    EXPECT_RESTORE) were ignored without a word: a changed key passed the restore."""
    engine = rehydrate_engine
    monkeypatch.setenv("REHYDRATE_FINGERPRINT_STRICT", "1")
    monkeypatch.setenv("REHYDRATE_FINGERPRINT_ENV", "RHT_FP_MODEL")
    monkeypatch.setenv("RHT_FP_MODEL", "s3://bucket/private-path")
    if manifest:
        monkeypatch.setenv("REHYDRATE_MANIFEST", str(tmp_path / "manifest.json"))
    with caplog.at_level(logging.WARNING, logger="rehydrate"):
        engine.start(detectors="none")
        engine.stop()
    lines = [r for r in caplog.records if "REHYDRATE_FINGERPRINT" in r.getMessage()]
    if manifest:  # configured by them: nothing to say
        assert lines == [] and engine.status().extra["fingerprint"]["strict"] is True
        return
    assert [r.levelname for r in lines] == ["WARNING"]
    assert ("REHYDRATE_FINGERPRINT_ENV and REHYDRATE_FINGERPRINT_STRICT set without "
            "REHYDRATE_MANIFEST or REHYDRATE_EXPECT_RESTORE: ignored") in lines[0].getMessage()
    assert "private-path" not in caplog.text and "RHT_FP_MODEL" not in caplog.text
    assert engine.status().extra.get("fingerprint") is None


def test_no_miss_after_a_restore(rehydrate_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("REHYDRATE_EXPECT_RESTORE", "1")
    engine = rehydrate_engine
    engine.simulate_restore()  # generation 1: this process was restored
    engine.start(detectors="none")
    assert engine.status().extra["fingerprint"]["snapshot_miss"] is None
    engine.stop()


def test_import_stays_light():
    assert "rehydrate.fingerprint" in sys.modules  # imported by this test module
    res = subprocess.run([sys.executable, "-c",
                          "import sys, rehydrate; rehydrate.fingerprint(); "
                          "rehydrate.telemetry.resource_attributes(); "
                          "print(sorted(m for m in sys.modules "
                          "if m.startswith('opentelemetry')))"],
                         capture_output=True, text=True, check=True, timeout=60)
    assert res.stdout.strip() == "[]"
    assert rehydrate.Lifecycle  # noqa: B018


def test_distribution_list_matches_importlib_metadata():
    import importlib.metadata as md

    expected: dict[str, str] = {}
    for d in md.distributions(path=fp.installed_paths()):
        expected.setdefault(fp._norm(d.metadata["Name"]), d.version)
    assert fp.distributions() == sorted(f"{n}=={v}" for n, v in expected.items())


def test_packages_next_to_the_script_or_in_the_cwd_do_not_split_workload_and_check(
        tmp_path):
    """Before: the manifest counted the distributions in the workload's script directory
    (``pip install --target /app``), ``rehydrate check`` those in its own first
    ``sys.path`` entry (the script's bin directory; the current directory under ``python
    -m``): the same node was "incompatible: distributions"."""
    app = tmp_path / "app"
    (app / "bar-2.0.dist-info").mkdir(parents=True)
    manifest = tmp_path / "manifest.json"
    (app / "main.py").write_text(
        "import json, sys\nfrom rehydrate.fingerprint import fingerprint\n"
        "print(sys.path[0])\n"
        "with open(sys.argv[1], 'w') as f:\n    json.dump(fingerprint(), f)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("REHYDRATE_CONTROL_SOCKET", None)
    wrote = subprocess.run([sys.executable, str(app / "main.py"), str(manifest)], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert wrote.returncode == 0, wrote.stderr
    assert wrote.stdout.strip() == str(app)  # the workload's sys.path[0]: bar is there
    elsewhere = tmp_path / "proj"
    (elsewhere / "foo-1.0.dist-info").mkdir(parents=True)
    script = Path(sys.executable).with_name("rehydrate")
    for argv, cwd in (([str(script)], app), ([sys.executable, "-m", "rehydrate"], elsewhere),
                      ([sys.executable, "-m", "rehydrate"], app)):
        proc = subprocess.run([*argv, "check", str(manifest)], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=60, check=False)
        assert (proc.returncode, proc.stdout) == (0, f"compatible with {manifest}\n"), (
            argv, cwd, proc.stdout, proc.stderr)


def test_check_from_a_daemonset_compares_node_fields_only(tmp_path):
    """Issue 13 item 19, run as a DaemonSet runs it: the workload writes the manifest with
    its environment and image; the checker is another process in another image (no
    site-packages: another distribution set) and environment (no API_KEY)."""
    manifest = tmp_path / "manifest.json"
    workload_env = {**os.environ, "API_KEY": "workload-secret"}
    subprocess.run([sys.executable, "-c",
                    "from rehydrate.fingerprint import fingerprint, write_manifest;"
                    f"write_manifest(fingerprint(env_keys=['API_KEY']), {str(manifest)!r})"],
                   check=True, timeout=60, cwd=ROOT, env=workload_env)
    daemonset_env = {k: v for k, v in os.environ.items() if k != "API_KEY"}
    daemonset_env["PYTHONPATH"] = str(ROOT)

    def daemonset(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-S", "-m", "rehydrate", "check", *args],
                              capture_output=True, text=True, timeout=60, check=False,
                              env=daemonset_env, cwd=tmp_path)

    full = daemonset(str(manifest), "--json")
    assert full.returncode == 1, (full.stdout, full.stderr)
    assert {m["field"] for m in json.loads(full.stdout)["mismatches"]} == {
        "env.API_KEY", "distributions"}, "what a DaemonSet cannot share with the workload"

    node = daemonset(str(manifest), "--node")
    assert node.returncode == 0, (node.stdout, node.stderr)
    assert node.stdout.strip() == f"compatible with {manifest} (node-level fields)"

    env_file = tmp_path / "workload.env"  # the workload's environment, given explicitly
    env_file.write_text("API_KEY=workload-secret\nOTHER=1\n")
    explicit = daemonset(str(manifest), "--env-from", str(env_file), "--json")
    assert [m["field"] for m in json.loads(explicit.stdout)["mismatches"]] == [
        "distributions"]
    env_file.write_bytes(b"API_KEY=other\0")  # NUL-separated, like /proc/PID/environ
    changed = daemonset(str(manifest), "--env-from", str(env_file), "--json")
    assert "env.API_KEY" in {m["field"] for m in json.loads(changed.stdout)["mismatches"]}
    env_file.write_text("garbage without equals sign\n")
    bad = daemonset(str(manifest), "--env-from", str(env_file))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and str(env_file) in bad.stderr
    # a FIFO is refused at once (it waited for a writer for ever); /proc/PID/environ works
    fifo = tmp_path / "workload.fifo"
    os.mkfifo(fifo)
    refused = daemonset(str(manifest), "--env-from", str(fifo))
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert refused.stderr.strip().splitlines() == [
        f"rehydrate check: cannot read environment file {fifo}: not a regular file (a FIFO)"]
    own = daemonset(str(manifest), "--env-from", f"/proc/{os.getpid()}/environ", "--json")
    assert own.returncode in (0, 1) and "mismatches" in json.loads(own.stdout)


def test_missing_cpu_flag_names_the_flag(tmp_path):
    m = fp.fingerprint()
    m["cpu_flags"] = sorted([*m["cpu_flags"], "avx512_imaginary"])
    path = tmp_path / "m.json"
    fp.write_manifest(m, path)
    res = run_cli("check", str(path), "--node")
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "  cpu_flags: this node lacks avx512_imaginary" in res.stdout.splitlines()
    assert "[]" not in res.stdout


def test_a_manifest_path_that_is_no_regular_file_is_one_error_not_a_hang(tmp_path, capsys):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer for ever
    with pytest.raises(fp.ManifestError, match=r"not a regular file \(a FIFO\)"):
        fp.load_manifest(fifo)
    assert check_manifest(str(fifo)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "a FIFO" in line and str(fifo) in line
    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (2 << 20) + b"{}")
    with pytest.raises(fp.ManifestError, match="larger than"):
        fp.load_manifest(huge)


def test_a_directory_configured_as_the_manifest_is_named_not_taken_for_a_miss(tmp_path):
    folder = tmp_path / "manifests"
    folder.mkdir()
    st, err = _start({"REHYDRATE_MANIFEST": str(folder)})
    assert st is not None and st["snapshot_miss"] is None
    assert "snapshot-miss" not in err
    assert f"fingerprint: {folder} is not a file" in err


def test_write_manifest_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    for name in (f".manifest.json.{os.getpid()}.tmp", ".manifest.json.tmp"):
        (tmp_path / name).symlink_to(victim)  # the names a predictable writer would use
    fp.write_manifest({"schema": fp.SCHEMA}, path)
    assert victim.read_text() == "keep me"
    assert not path.is_symlink() and json.loads(path.read_text()) == {"schema": fp.SCHEMA}
    assert oct(path.stat().st_mode & 0o777) == oct(0o644 & ~_umask())
    # salted hashes of environment values: readable by the owner only
    hashed = tmp_path / "hashed.json"
    fp.write_manifest({"schema": fp.SCHEMA, "env": {"salt": "s", "keys": {"K": "sha256:x"}}},
                      hashed)
    assert oct(hashed.stat().st_mode & 0o777) == oct(0o600 & ~_umask())
    # a rename that fails leaves no temporary file behind
    target = tmp_path / "taken"
    (target / "inside").mkdir(parents=True)
    with pytest.raises(OSError):
        fp.write_manifest({"schema": fp.SCHEMA}, target)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".taken")) == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_configure_checks_every_argument_before_changing_anything(rehydrate_engine, tmp_path):
    engine = rehydrate_engine
    root = make_root(tmp_path / "node")
    manager = fp.configure(env_keys=["HOME"], root=root, engine=engine)
    for bad in ({"strict": "no"}, {"expect_restore": "no"}, {"env_keys": "API_KEY"},
                {"env_keys": ["A", 1]}, {"strict": True, "env_keys": "X"}):
        with pytest.raises(TypeError, match="fingerprint: "):
            fp.configure(**bad, path=tmp_path / "other.json", engine=engine)
        assert (manager.strict, manager.expect_restore, manager.env_keys, manager.path) == (
            False, False, ("HOME",), None), bad
    assert engine.simulate_snapshot().ok
    report = engine.simulate_restore()  # the check hook is still registered
    assert [h.outcome for h in report.hooks if h.name == "rehydrate.fingerprint.check"] == [
        "ok"]
    assert engine.status().extra["fingerprint"]["compatible"] is True
    with pytest.raises(TypeError, match=r"not one string \('HOME': write \['HOME'\]\)"):
        fp.fingerprint("HOME")


def test_configure_refuses_a_bad_root_or_path_before_changing_anything(rehydrate_engine,
                                                                        tmp_path):
    """configure(path=..., env_keys=..., root=5) set the path and the keys, then raised on
    the root: the manager was left half-configured (a manifest written elsewhere)."""
    engine = rehydrate_engine
    manager = fp.configure(path=tmp_path / "m1.json", env_keys=["A"], engine=engine)
    for bad in ({"root": 5}, {"root": b"/"}, {"path": 3.5}, {"path": b"/tmp/x.json"}):
        with pytest.raises(TypeError, match=r"fingerprint: (root|path) must be a"):
            fp.configure(**{"path": tmp_path / "m2.json", "env_keys": ["B"], **bad},
                         engine=engine)
        assert (manager.path, manager.env_keys, manager.root) == (
            tmp_path / "m1.json", ("A",), "/"), bad


def test_a_misspelt_scope_is_refused_not_taken_for_all(tmp_path):
    """scope="nodes" compared every field (Python, packages, env.*): a DaemonSet checker
    then called every node incompatible without a word about the typo."""
    root = make_root(tmp_path / "node")
    manifest = fp.fingerprint(root=root)
    other = dict(manifest, python="0.0.0")
    assert fp.compare(manifest, other, scope="node") == []
    for bad in ("nodes", "ALL", None):
        with pytest.raises(ValueError, match=r"scope must be 'all' or 'node', not "):
            fp.compare(manifest, other, scope=bad)
        with pytest.raises(ValueError, match=r"scope must be 'all' or 'node'"):
            fp.check(manifest, root, scope=bad)


def test_env_mismatches_are_described_by_key_name_only(rehydrate_engine, monkeypatch,
                                                        caplog):
    """The log line (and the strict hook's error) of an env.* mismatch printed the
    salted hashes of the values; the salt sits in the manifest, so a low-entropy value
    could be recovered from the log. They name the key and what changed, nothing more."""
    engine = rehydrate_engine
    monkeypatch.setenv("RHT_FP_TOKEN", "1234")
    monkeypatch.delenv("RHT_FP_GONE", raising=False)
    monkeypatch.setenv("RHT_FP_LEFT", "x")
    fp.configure(env_keys=["RHT_FP_TOKEN", "RHT_FP_GONE", "RHT_FP_LEFT"], strict=True,
                 engine=engine)
    assert engine.simulate_snapshot().ok
    hashes = set(fp.manager(engine).manifest["env"]["keys"].values())
    caplog.set_level(logging.WARNING, logger="rehydrate")
    report = engine.simulate_restore(env={"RHT_FP_TOKEN": "5678", "RHT_FP_GONE": "now",
                                          "RHT_FP_LEFT": None})
    (hook,) = [h for h in report.hooks if h.name == "rehydrate.fingerprint.check"]
    assert hook.outcome == "failed"
    said = caplog.text + str(hook.error)
    leaked = [h for h in hashes - {None} if h[len("sha256:"):][:16] in said]
    assert not leaked and "sha256" not in said
    for text in ("env.RHT_FP_TOKEN: value differs from the snapshot's",
                 "env.RHT_FP_GONE: unset in the snapshot, set on this node",
                 "env.RHT_FP_LEFT: set in the snapshot, unset on this node"):
        assert text in caplog.text and text in str(hook.error)


def test_status_and_check_json_show_env_key_names_never_hashes(rehydrate_engine,
                                                              monkeypatch, tmp_path):
    """status()["fingerprint"] (the manifest and the mismatches) and `rehydrate check
    --json` showed the salted hashes of environment values with the salt beside them: a
    low-entropy value ("true", a 4-digit PIN) was guessed offline in a few thousand
    tries. They show the key names, and for a mismatch whether the key was changed, added
    or removed; the manifest file still compares across processes."""
    import hashlib

    engine = rehydrate_engine
    monkeypatch.setenv("RHT_FP_PIN", "1234")
    monkeypatch.setenv("RHT_FP_FLAG", "true")
    monkeypatch.setenv("RHT_FP_GONE", "x")
    monkeypatch.delenv("RHT_FP_NEW", raising=False)
    keys = ["RHT_FP_PIN", "RHT_FP_FLAG", "RHT_FP_GONE", "RHT_FP_NEW"]
    path = tmp_path / "manifest.json"
    fp.configure(path=path, env_keys=keys, engine=engine)
    assert engine.simulate_snapshot().ok
    written = fp.load_manifest(path)
    salt = written["env"]["salt"]

    def guessable(text: str) -> list[str]:
        """The salt and the hashes (of the old values and the new) found in ``text``."""
        values = (("RHT_FP_PIN", "1234"), ("RHT_FP_FLAG", "true"), ("RHT_FP_GONE", "x"),
                  ("RHT_FP_PIN", "5678"), ("RHT_FP_FLAG", "false"), ("RHT_FP_NEW", "y"))
        digests = [hashlib.sha256(f"{salt}\0{k}\0{v}".encode()).hexdigest()
                   for k, v in values]
        assert digests[0] == written["env"]["keys"]["RHT_FP_PIN"][len("sha256:"):]
        return [d for d in (salt, *digests) if d[:16] in text]

    shown = engine.status().extra["fingerprint"]["manifest"]
    assert shown["env"] == {"keys": sorted(keys)}
    assert guessable(json.dumps(engine.status().to_dict()["fingerprint"])) == []

    report = engine.simulate_restore(env={"RHT_FP_PIN": "5678", "RHT_FP_FLAG": "false",
                                          "RHT_FP_GONE": None, "RHT_FP_NEW": "y"})
    assert report.ok
    status = engine.status().to_dict()["fingerprint"]
    assert guessable(json.dumps(status)) == []
    by_field = {m["field"]: m for m in status["mismatches"]}
    assert by_field == {
        "env.RHT_FP_FLAG": {"field": "env.RHT_FP_FLAG", "expected": "set", "actual": "set",
                            "change": "changed"},
        "env.RHT_FP_GONE": {"field": "env.RHT_FP_GONE", "expected": "set",
                            "actual": "unset", "change": "removed"},
        "env.RHT_FP_NEW": {"field": "env.RHT_FP_NEW", "expected": "unset", "actual": "set",
                           "change": "added"},
        "env.RHT_FP_PIN": {"field": "env.RHT_FP_PIN", "expected": "set", "actual": "set",
                           "change": "changed"},
    }

    # another process, the workload's new environment given explicitly: the persisted
    # manifest still compares, and its JSON answer names keys only
    env_file = tmp_path / "workload.env"
    env_file.write_text("RHT_FP_PIN=5678\nRHT_FP_FLAG=true\nRHT_FP_GONE=x\n")
    out = run_cli("check", str(path), "--node", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "rehydrate", "check", str(path), "--env-from",
                          str(env_file), "--json"], capture_output=True, text=True,
                         timeout=60, check=False, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1, out.stdout + out.stderr
    answer = json.loads(out.stdout)
    assert guessable(out.stdout) == []
    env_mismatches = [m for m in answer["mismatches"] if m["field"].startswith("env.")]
    assert env_mismatches == [{"field": "env.RHT_FP_PIN", "expected": "set",
                               "actual": "set", "change": "changed"}]


def test_a_huge_schema_value_is_not_echoed_whole(tmp_path, capsys):
    """A file with {"schema": "<300 KB>"} made `rehydrate check` print a 300 KB line: the
    error quoted the whole value."""
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"schema": "A" * 300_000}))
    assert check_manifest(str(path)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "schema is 'AAAA" in line and str(path) in line
    assert len(line) < 200 + len(str(path)), len(line)


def test_write_manifest_syncs_the_file_before_the_rename_and_the_directory_after(
        tmp_path, monkeypatch):
    """The manifest was renamed into place without an fsync of the file or of its
    directory: after a node crash the path could name an empty file (or the old one)."""
    path = tmp_path / "meta" / "manifest.json"
    fp.write_manifest({"schema": fp.SCHEMA, "old": True}, path)
    synced: list[tuple[str, str | None]] = []  # (what was synced, the manifest then)
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        real_fsync(fd)
        target = os.readlink(f"/proc/self/fd/{fd}")
        shown = "directory" if target == str(path.parent) else (
            "new file" if Path(target).name.startswith(".manifest.json.") else target)
        synced.append((shown, path.read_text()))

    monkeypatch.setattr(os, "fsync", recording_fsync)
    fp.write_manifest({"schema": fp.SCHEMA, "new": True}, path)
    old, new = (json.dumps({"schema": fp.SCHEMA, k: True}, indent=2, sort_keys=True) + "\n"
                for k in ("old", "new"))
    assert synced == [("new file", old), ("directory", new)]


def test_write_manifest_keeps_the_old_manifest_when_the_sync_fails(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "manifest.json"
    fp.write_manifest({"schema": fp.SCHEMA, "old": True}, path)
    before = path.read_text()

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        fp.write_manifest({"schema": fp.SCHEMA, "new": True}, path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"], "no temporary left"

    # A filesystem that cannot sync a directory (EINVAL) still gets the manifest written.
    def no_dir_sync(fd: int) -> None:
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", no_dir_sync)
    fp.write_manifest({"schema": fp.SCHEMA, "new": True}, path)
    assert json.loads(path.read_text()) == {"schema": fp.SCHEMA, "new": True}


def test_check_shows_control_characters_in_key_names_and_values_escaped(tmp_path, capsys):
    """An env key name with a newline printed across two lines of `rehydrate check`
    (and of the log line): the second line looked like a mismatch of its own; an escape
    sequence in one recoloured or hid the terminal's text."""
    keys = ["A\n  env.FAKE: unset in the snapshot", "B\x1b[2K", "C\u2028D"]
    manifest = fp.fingerprint(env_keys=keys, environ=dict.fromkeys(keys, "x"))
    manifest["gvisor_version"] = "release-1\nforged"
    path = tmp_path / "manifest.json"
    fp.write_manifest(manifest, path)
    assert check_manifest(str(path)) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 1 + 4, out  # the heading, then one line per mismatch
    assert "  env.'A\\n  env.FAKE: unset in the snapshot': set in the snapshot, unset on " \
           "this node" in lines
    assert "  env.'B\\x1b[2K': set in the snapshot, unset on this node" in lines
    assert "  env.'C\\u2028D': set in the snapshot, unset on this node" in lines
    assert any(line.startswith("  gvisor_version: snapshot 'release-1\\nforged', this node")
               for line in lines), out
    assert "\x1b" not in out and "\u2028" not in out
    # printable names stay as they are
    assert fp.Mismatch("env.API_KEY", "unset", "set").describe() == (
        "env.API_KEY: unset in the snapshot, set on this node")


def test_check_node_with_env_from_compares_the_workloads_env_keys_too(tmp_path, capsys):
    """``check MANIFEST --node --env-from FILE``: the file is the workload's environment,
    so its env.* keys are compared too — before, --node ignored the file and said
    "compatible" for a workload missing a key the snapshot recorded."""
    manifest = tmp_path / "m.json"
    fp.write_manifest(fp.fingerprint(env_keys=["API_KEY"], environ={"API_KEY": "s3cret"}),
                      manifest)
    env_file = tmp_path / "workload.env"
    env_file.write_text("OTHER=1\n")  # API_KEY missing in the workload
    assert check_manifest(str(manifest), scope="node", env_file=str(env_file),
                          as_json=True) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["scope"] == "node"
    assert out["mismatches"] == [{"field": "env.API_KEY", "expected": "set", "change": "removed",
                                  "actual": "unset"}]
    assert "s3cret" not in json.dumps(out)
    env_file.write_text("API_KEY=s3cret\n")
    assert check_manifest(str(manifest), scope="node", env_file=str(env_file)) == 0
    assert capsys.readouterr().out.strip() == (
        f"compatible with {manifest} (node-level fields and env.* keys)")
    # without the file a node-level checker still leaves the env.* keys alone
    assert check_manifest(str(manifest), scope="node") == 0
