"""`make demo` must keep working: run the demo and check what it claims to show."""

import os
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def test_demo_runs_snapshot_and_restore_through_the_control_socket():
    env = {k: v for k, v in os.environ.items() if not k.startswith("REHYDRATE_")}
    done = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
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
