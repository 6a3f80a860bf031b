"""rehydrate's quick demo (``make demo-quick``; ``make demo`` runs the inference server's):
a workload told about a snapshot and a restore through the real control socket, by the
real ``rehydrate notify`` command — the same path gVisor's save-restore-exec and CRIU
action scripts use.

No snapshot platform is needed: the process is not actually frozen, it is *told* it was
(``notify save``, then ``notify restore``), and everything it does about it is real —
environment re-read from a spec_environ file, RNG reseeded, instance ID and ephemeral key
regenerated, a secret wiped before the "snapshot" and reloaded after, hooks run phase by
phase, readiness flipped. (``tests/gvisor/`` does the same under real ``runsc
checkpoint/restore``.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import rehydrate
from rehydrate import Phase, RestoreContext

db_connected = True


@rehydrate.before_snapshot(phase=Phase.CONNECTIONS, name="close-db")
def close_db() -> None:
    global db_connected
    db_connected = False


@rehydrate.after_restore(phase=Phase.CONNECTIONS, name="reconnect-db", timeout=5.0)
async def reconnect_db(ctx: RestoreContext) -> None:
    global db_connected
    await asyncio.sleep(0.01)  # stands in for a real reconnect
    db_connected = True


@rehydrate.on_env_change("API_KEY", name="rotate-api-client")
def rotate_client(ctx: RestoreContext, changes: rehydrate.EnvChanges) -> None:
    pass  # rebuild the API client here; `changes` holds key names, never values


@rehydrate.after_restore(name="warm-cache", required=False)
def warm_cache() -> None:
    raise RuntimeError("cache backend unreachable (optional hook: reported, not fatal)")


def write_environ(path: Path, env: dict[str, str]) -> None:
    path.write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


def notify(action: str) -> None:
    """Run the real CLI client in a separate process, as a platform would."""
    cmd = [sys.executable, "-m", "rehydrate", "notify", action]
    print(f"$ rehydrate notify {action}")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in (done.stdout + done.stderr).splitlines():
        print(f"  {line}")
    print(f"  (exit {done.returncode})")


def show(title: str, key: rehydrate.keys.EphemeralKey,
         secret: rehydrate.secrets.Secret) -> None:
    status = rehydrate.status()
    pub = "dropped" if key.dropped else key.public_bytes_raw().hex()[:16]
    print(f"{title}: state={status.state} generation={status.generation} "
          f"ready={status.ready}")
    print(f"  instance_id={rehydrate.instance_id()}  session key={pub}  "
          f"secret={f'{len(secret.get())} bytes loaded' if secret.available else 'wiped'}  "
          f"db connected={db_connected}  random draw={random.random():.6f}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="  [log] %(levelname)s %(message)s",
                        stream=sys.stdout)
    # Removed at the end: its spec_environ holds the API key values.
    with tempfile.TemporaryDirectory(prefix="rehydrate-demo-") as tmp:
        try:
            run(Path(tmp))
        finally:
            rehydrate.stop()  # the control socket lives in the directory


def run(workdir: Path) -> None:
    spec = workdir / "spec_environ"
    write_environ(spec, {"API_KEY": "first-key", "MODEL_URL": "file:///models/a"})
    os.environ.update({"API_KEY": "first-key", "MODEL_URL": "file:///models/a",
                       "REHYDRATE_ENV_FILE": str(spec),
                       "REHYDRATE_CONTROL_SOCKET": str(workdir / "control.sock")})

    key = rehydrate.keys.ephemeral("session", algorithm="ed25519")
    secret = rehydrate.secrets.Secret.from_env("API_KEY")
    print("detectors:", ", ".join(rehydrate.start(detectors=["control"])))
    show("before", key, secret)
    print()

    notify("save")
    print(rehydrate.status().last_report.table())  # type: ignore[union-attr]
    show("after the before-snapshot hooks", key, secret)
    print()

    # The platform restores a clone with a new environment: one key changed, one added,
    # one removed. gVisor would expose it as /proc/gvisor/spec_environ.
    write_environ(spec, {"API_KEY": "second-key", "REGION": "europe-west4"})
    notify("restore")
    print(rehydrate.status().last_report.table())  # type: ignore[union-attr]
    show("after restore", key, secret)
    print(f"  environment now: API_KEY changed={os.environ['API_KEY'] != 'first-key'}, "
          f"REGION set={'REGION' in os.environ}, MODEL_URL removed="
          f"{'MODEL_URL' not in os.environ}")


if __name__ == "__main__":
    main()
