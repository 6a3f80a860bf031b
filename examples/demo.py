"""A tiny workload: hooks in several phases, a simulated snapshot and restore.

Run with ``make demo``. Nothing here needs a snapshot platform: the simulators drive the
real engine exactly as a detector would.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random

import rehydrate
from rehydrate import Phase, RestoreContext

connection_open = True


@rehydrate.before_snapshot(phase=Phase.CONNECTIONS, name="close-db")
def close_db() -> None:
    global connection_open
    connection_open = False


@rehydrate.after_restore(phase=Phase.CONNECTIONS, name="reconnect-db", timeout=5.0)
async def reconnect_db(ctx: RestoreContext) -> None:
    global connection_open
    await asyncio.sleep(0.01)  # pretend to reconnect
    connection_open = True


@rehydrate.after_restore(phase=Phase.ENTROPY, name="reseed-local-rng")
def reseed() -> None:
    random.seed(os.urandom(16))


@rehydrate.on_env_change("API_KEY", name="rotate-api-client")
def rotate_client(ctx: RestoreContext, changes: rehydrate.EnvChanges) -> None:
    print(f"  [hook] API_KEY {'added' if 'API_KEY' in changes.added else 'changed'}; "
          f"rebuilding the client (value not shown)")


@rehydrate.after_restore(name="warm-cache", required=False)
def warm_cache() -> None:
    raise RuntimeError("cache backend unreachable (optional: reported, not fatal)")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="  [log] %(levelname)s %(message)s")
    print("state before:", rehydrate.status().state)
    snap = rehydrate.simulate_snapshot()
    print(snap.table())
    print("connection open after snapshot hooks:", connection_open)
    print()
    report = rehydrate.simulate_restore(env={"API_KEY": "fresh-secret"})
    print(report.table())
    status = rehydrate.status()
    print()
    print(f"state={status.state} generation={status.generation} ready={status.ready} "
          f"connection open={connection_open} env changes={report.env_changes.to_dict()}")


if __name__ == "__main__":
    main()
