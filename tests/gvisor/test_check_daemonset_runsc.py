"""``rehydrate check`` run the way docs/snapshot-lifecycle.md says a DaemonSet runs it
(issue 13 item 19), under real gVisor: the workload, in one sandbox, writes its snapshot
manifest (with an ``env.*`` key) to a shared directory; the "DaemonSet", in another sandbox
of the same node with another image (no site-packages: another distribution set) and
another environment (no ``API_KEY``), checks it and prints the node's labels.

A full ``check`` calls the node incompatible for exactly the workload-level fields (that
was the bug: every node "incompatible"); ``check --node`` says compatible; the labels the
DaemonSet prints for its node satisfy the ``nodeAffinity`` printed from the manifest.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from .harness import GVisorHarness, Mount

SHARED = "/shared"
GVISOR_VERSION = "release-20240729.0"  # a DaemonSet sets it, e.g. from a node label


@pytest.mark.gvisor
def test_daemonset_check_in_another_sandbox(gvisor: GVisorHarness, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    mount = Mount(SHARED, shared, readonly=False)
    wrote = gvisor.run_once(
        [sys.executable, "-c",
         "from rehydrate.fingerprint import fingerprint, write_manifest;"
         f"write_manifest(fingerprint(env_keys=['API_KEY']), '{SHARED}/manifest.json')"],
        env={"API_KEY": "workload-secret", "REHYDRATE_GVISOR_VERSION": GVISOR_VERSION},
        mounts=[mount], name="workload")
    assert wrote.returncode == 0, wrote.stderr
    manifest = json.loads((shared / "manifest.json").read_text())
    assert manifest["gvisor"] is True and manifest["gvisor_version"] == GVISOR_VERSION

    def daemonset(*args: str) -> tuple[int, str, str]:
        proc = gvisor.run_once(
            [sys.executable, "-S", "-m", "rehydrate", "check", *args],
            env={"REHYDRATE_GVISOR_VERSION": GVISOR_VERSION}, mounts=[mount],
            name="daemonset")
        return proc.returncode, proc.stdout, proc.stderr

    code, out, err = daemonset(f"{SHARED}/manifest.json", "--json")
    assert code == 1, (out, err)
    assert {m["field"] for m in json.loads(out)["mismatches"]} == {
        "env.API_KEY", "distributions"}, out

    code, out, err = daemonset(f"{SHARED}/manifest.json", "--node")
    assert code == 0, (out, err)
    assert out.strip() == f"compatible with {SHARED}/manifest.json (node-level fields)"

    code, out, err = daemonset("--labels")
    assert code == 0, err
    labels = yaml.safe_load(out)["metadata"]["labels"]
    assert labels["rehydrate.io/gvisor-version"] == GVISOR_VERSION
    code, out, err = daemonset(f"{SHARED}/manifest.json", "--affinity")
    assert code == 0, err
    (term,) = yaml.safe_load(out)["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    required = {e["key"]: e["values"] for e in term["matchExpressions"]}
    assert required == {k: [v] for k, v in labels.items()}, (required, labels)
