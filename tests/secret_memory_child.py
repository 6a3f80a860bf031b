"""Child process for tests/test_secret_memory.py: a file secret, hooks that fail with
errors that do not quote it (their redaction runs over every managed secret), a rotation,
then the before-snapshot pass; then wait to be scanned.

argv: SECRET_FILE ROTATED_FILE (moved over the first for the rotation). The values are
written by the test; this process reads them only through the Secret (straight into
wiped buffers)."""

from __future__ import annotations

import gc
import os
import sys

import rehydrate
from rehydrate.secrets import Secret

path, rotated = sys.argv[1], sys.argv[2]
engine = rehydrate.Lifecycle()
secret = Secret.from_file(path, engine=engine)
with secret as value:
    assert len(value) > 8


@engine.registry.after_restore(name="flaky", required=False)
def flaky() -> None:
    raise ConnectionError("upstream refused the connection (not quoting any secret)")


def flaky_failed(report: rehydrate.Report) -> bool:
    return any(h.name == "flaky" and h.outcome == "failed" for h in report.hooks)


for _ in range(3):  # failed hooks: each error is redacted
    assert flaky_failed(engine.simulate_restore())
os.replace(rotated, path)  # rotated: the replaced value is looked for until the run ends
assert secret.reload()
assert flaky_failed(engine.simulate_restore())
report = engine.simulate_snapshot()
assert report.ok, report
gc.collect()
print("ready", flush=True)
sys.stdin.readline()
engine.close()
