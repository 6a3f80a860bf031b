"""Platform fit (``rehydrate doctor``), the manifest's platform facts, and the scheduling
output of ``rehydrate check --labels / --affinity`` (validated with the kubernetes client's
models), against a stand-in GCE metadata server and a stand-in ``nvidia-smi``
(tests/gce_metadata.py, tests/standin_bin/nvidia-smi)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from gce_metadata import MetadataServer, TricklingServer
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.client import ApiClient, V1Affinity, V1ObjectMeta

from rehydrate import _nodefit as nodefit
from rehydrate import fingerprint as fp

STANDIN_BIN = Path(__file__).parent / "standin_bin"
ROOT = Path(__file__).resolve().parents[1]


def _gpu(name: str, mig: str = "[N/A]", driver: str = "535.104.05") -> dict[str, str]:
    return {"name": name, "driver_version": driver, "mig.mode.current": mig}


L4 = _gpu("NVIDIA L4")
A100_MIG = _gpu("NVIDIA A100-SXM4-40GB", mig="Enabled")
A100 = _gpu("NVIDIA A100-SXM4-40GB", mig="Disabled")

# (machine type, GPUs or None for no nvidia-smi, fit, the check that decides, its status)
SCENARIOS = {
    "E2": ("e2-standard-4", None, "no", "machine series", "blocked"),
    "N2": ("n2-standard-8", None, "yes", "machine series", "ok"),
    "G2 1xL4": ("g2-standard-8", [L4], "yes", "GPU", "ok"),
    "G2 2xL4": ("g2-standard-24", [L4, L4], "yes", "GPU", "ok"),
    "A100 MIG": ("a2-highgpu-1g", [A100_MIG], "no", "MIG", "blocked"),
    "A100 2x": ("a2-highgpu-2g", [A100, A100], "no", "GPU", "blocked"),
}


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Configure the stand-ins: returns set(machine_type, gpus); gVisor is emulated by a
    REHYDRATE_GVISOR_PROC directory (the runtime check passes)."""
    gvisor_proc = tmp_path / "gvisor"
    gvisor_proc.mkdir()
    monkeypatch.setenv("REHYDRATE_GVISOR_PROC", str(gvisor_proc))
    monkeypatch.setenv("REHYDRATE_GVISOR_VERSION", "release-20240729.0")
    servers: list[MetadataServer] = []

    def configure(machine_type: str, gpus: list[dict[str, str]] | None) -> dict[str, str]:
        srv = MetadataServer(machine_type).__enter__()
        servers.append(srv)
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        path = os.environ["PATH"]
        if gpus is not None:
            path = f"{STANDIN_BIN}{os.pathsep}{path}"
            monkeypatch.setenv("STANDIN_NVIDIA_GPUS", json.dumps(gpus))
        else:  # no nvidia-smi anywhere on PATH
            path = os.pathsep.join(p for p in path.split(os.pathsep)
                                   if not os.path.exists(os.path.join(p, "nvidia-smi")))
        monkeypatch.setenv("PATH", path)
        return dict(os.environ)

    yield configure
    for srv in servers:
        srv.__exit__()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_platform_fit(node, scenario: str) -> None:
    mtype, gpus, fit, check_name, status = SCENARIOS[scenario]
    node(mtype, gpus)
    result = nodefit.assess(nodefit.facts())
    checks = {c.name: c for c in result.checks}
    assert result.fit == fit, result
    assert checks[check_name].status == status, checks
    assert result.facts.machine_type == mtype
    assert result.facts.machine_series == mtype.split("-")[0]
    assert result.facts.gvisor and result.facts.gvisor_version == "release-20240729.0"
    assert len(result.facts.gpus or ()) == len(gpus or ())
    if status == "blocked":
        reason = checks[check_name].reason
        expected = {"E2": "E2 machine types", "A100 MIG": "Multi-Instance GPU",
                    "A100 2x": "only on L4"}[scenario]
        assert expected in reason, reason


def test_doctor_json_and_manifest_carry_the_same_facts(node) -> None:
    env = node("a2-highgpu-1g", [A100_MIG])
    out = subprocess.run([sys.executable, "-m", "rehydrate", "doctor", "--json"], env=env,
                         capture_output=True, text=True, timeout=60, check=True, cwd=ROOT)
    platform = json.loads(out.stdout)["platform"]
    assert platform["fit"] == "no"
    assert {"name": "MIG", "status": "blocked"}.items() <= next(
        c for c in platform["checks"] if c["name"] == "MIG").items()
    manifest = fp.fingerprint()
    assert manifest["platform"] == platform["facts"]
    assert manifest["machine_series"] == "a2"
    assert manifest["gpu_driver"] == "535.104.05", "from nvidia-smi without /proc/driver"
    text = subprocess.run([sys.executable, "-m", "rehydrate", "doctor"], env=env,
                          capture_output=True, text=True, timeout=60, check=True, cwd=ROOT)
    assert "GKE Pod snapshots on this node: no" in text.stdout
    assert "MIG" in text.stdout and "blocked" in text.stdout


def test_off_gce_is_silent_and_quick(monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{port}")
    t0 = time.perf_counter()
    assert nodefit.machine_type() is None
    assert time.perf_counter() - t0 < nodefit.METADATA_TIMEOUT + 0.5
    assert not [r for r in caplog.records if r.levelno >= 30 and "metadata" in r.getMessage()]
    checks = {c.name: c for c in nodefit.assess(nodefit.facts(nvidia_smi=False)).checks}
    assert checks["machine series"].status == "unknown"


def test_metadata_answer_without_google_header_is_not_gce(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with MetadataServer("n2-standard-8", impostor=True) as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        assert nodefit.machine_type() is None
        assert srv.requests == ["/computeMetadata/v1/instance/machine-type"]



def test_a_metadata_server_trickling_its_answer_is_cut_off_at_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """machine_type() had only a per-read timeout: a server sending a byte every 50 ms
    (its header never ends) held it — and fingerprint(), doctor, the save hook — for
    hours. The timeout now bounds the whole request."""
    with TricklingServer(interval=0.05) as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        result: list[str | None] = []
        caller = threading.Thread(
            target=lambda: result.append(nodefit.machine_type(timeout=0.5)), daemon=True)
        caller.start()
        caller.join(20)  # 0.5 s expected; a generous bound, not a timing measurement
        assert not caller.is_alive(), f"still reading after 20 s ({srv.sent} bytes came)"
        assert result == [None]
        assert srv.requests == 1


def test_a_hanging_name_lookup_of_the_metadata_host_is_cut_off_at_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GCE_METADATA_HOST given as a host name was resolved with no deadline: a resolver
    that never answered held machine_type() — and fingerprint(), doctor, the save hook —
    for as long as it hung. The lookup is inside the timeout now."""
    import socket

    real = socket.getaddrinfo
    release = threading.Event()
    asked: list[object] = []

    def hanging(host: object, *args: object, **kwargs: object) -> object:
        numeric = int(kwargs.get("flags", 0)) & socket.AI_NUMERICHOST  # type: ignore[call-overload]
        if host == "metadata.hangs.invalid" and not numeric:  # numeric: no DNS asked
            asked.append(host)
            release.wait(60)  # a resolver that does not answer (until the test ends)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    monkeypatch.setenv("GCE_METADATA_HOST", "metadata.hangs.invalid")
    result: list[str | None] = []
    caller = threading.Thread(
        target=lambda: result.append(nodefit.machine_type(timeout=0.3)), daemon=True)
    caller.start()
    try:
        caller.join(20)  # 0.3 s expected; a generous bound, not a timing measurement
        assert not caller.is_alive(), "still resolving after 20 s"
        assert result == [None] and asked == ["metadata.hangs.invalid"]
    finally:
        release.set()


def test_the_metadata_host_by_name_still_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup on a helper thread still connects to a host given by name (and port)."""
    with MetadataServer("n2-standard-8") as srv:
        port = srv.host.rsplit(":", 1)[1]
        monkeypatch.setenv("GCE_METADATA_HOST", f"localhost:{port}")
        assert nodefit.machine_type(timeout=10) == "n2-standard-8"


@pytest.mark.parametrize("status", [403, 404, 500, 503])
def test_metadata_error_answer_is_no_machine_type(monkeypatch: pytest.MonkeyPatch,
                                                  status: int) -> None:
    """The real metadata server's header on an error answer: still no machine type."""
    with MetadataServer("n2-standard-8", status=status) as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        assert nodefit.machine_type() is None
        assert srv.requests == ["/computeMetadata/v1/instance/machine-type"]


def test_the_gke_metadata_server_s_404_is_not_off_gce_and_the_override_gives_the_type(
        node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind GKE's metadata server (GKE_METADATA, which Pod snapshots need) the machine
    type is a 404: the check said "not on GCE (no answer ...)", an E2 node was never
    flagged and the manifest had no machine series, so --affinity never guarded it.
    The 404 is named now, and REHYDRATE_MACHINE_TYPE gives the type without the server."""
    node("e2-standard-4", None)  # gVisor and no nvidia-smi; its 200 server is not used
    with MetadataServer("e2-standard-4", status=404) as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        result = nodefit.assess(nodefit.facts())
        series = {c.name: c for c in result.checks}["machine series"]
        assert series.status == "unknown"
        assert "does not serve the machine type (HTTP 404" in series.reason, series
        assert "not on GCE" not in series.reason and "REHYDRATE_MACHINE_TYPE" in series.reason
        assert fp.fingerprint(nvidia_smi=False)["platform"]["machine_problem"] == series.reason

        monkeypatch.setenv("REHYDRATE_MACHINE_TYPE", "e2-standard-4")
        srv.requests.clear()
        result = nodefit.assess(nodefit.facts())
        assert srv.requests == [], "the override is the answer: no request"
        assert result.fit == "no"
        assert {c.name: c for c in result.checks}["machine series"].status == "blocked"
        manifest = fp.fingerprint(nvidia_smi=False)
        assert manifest["machine_series"] == "e2"
        assert "machine_problem" not in manifest["platform"]
        terms = nodefit.node_affinity(manifest)["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {"key": "rehydrate.io/machine-series", "operator": "In",
                "values": ["e2"]} in terms[0]["matchExpressions"]


@pytest.mark.parametrize("status", [400, 401, 404])
def test_another_cloud_s_metadata_error_is_off_gce_not_a_gke_hint(
        monkeypatch: pytest.MonkeyPatch, status: int) -> None:
    """AWS IMDS, Azure, OpenStack answer GCE's path with 404/401/400 and no
    Metadata-Flavor: that was taken for GKE's 404 and doctor (and the manifest's
    platform.machine_problem) told them to set a GKE variable. It is "not on GCE": the
    second request, to the root, is answered without Metadata-Flavor too."""
    with MetadataServer("n2-standard-8", impostor=True, status=status,
                        server="EC2ws") as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        node = nodefit.facts(nvidia_smi=False)
        assert srv.requests == ["/computeMetadata/v1/instance/machine-type",
                                "/computeMetadata/v1/"]
    assert node.machine_type is None
    assert node.machine_problem is not None
    assert node.machine_problem.startswith("not on GCE"), node.machine_problem
    assert "GKE" not in node.machine_problem
    assert "REHYDRATE_MACHINE_TYPE" not in node.machine_problem


def test_gke_s_server_header_alone_names_its_404(monkeypatch: pytest.MonkeyPatch) -> None:
    """GKE's metadata server also names itself in Server: with that header alone its 404
    is still GKE's (set REHYDRATE_MACHINE_TYPE), not "off GCE"."""
    with MetadataServer("n2-standard-8", impostor=True, status=404,
                        server="GKE Metadata Server") as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        node = nodefit.facts(nvidia_smi=False)
        assert srv.requests == ["/computeMetadata/v1/instance/machine-type"]
    assert node.machine_problem == ("the metadata server does not serve the machine type "
                                    "(HTTP 404; GKE's does not): set REHYDRATE_MACHINE_TYPE")


@pytest.mark.parametrize("status", [403, 404])
def test_gke_s_bare_error_answer_is_told_by_its_root(monkeypatch: pytest.MonkeyPatch,
                                                     status: int) -> None:
    """GKE's metadata server's published error answers carry neither Metadata-Flavor nor
    Server (only its 200s do): its 404 for the machine type was taken for another cloud's
    and doctor, and the manifest's platform.machine_problem, said "not on GCE" on the
    platform REHYDRATE_MACHINE_TYPE exists for. Its root answering 200 with
    Metadata-Flavor: Google makes the error Google's."""
    with MetadataServer("e2-standard-4", status=status, bare_errors=True,
                        server="GKE Metadata Server") as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        node = nodefit.facts(nvidia_smi=False)
        assert srv.requests == ["/computeMetadata/v1/instance/machine-type",
                                "/computeMetadata/v1/"]
        manifest = fp.fingerprint(nvidia_smi=False)
    assert node.machine_type is None
    assert node.machine_problem == (
        f"the metadata server does not serve the machine type (HTTP {status}; GKE's does "
        "not): set REHYDRATE_MACHINE_TYPE")
    assert manifest["platform"]["machine_problem"] == node.machine_problem


def test_a_bare_error_whose_root_is_not_google_s_is_not_on_gce(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bare 404 from a server whose root answers 200 without Metadata-Flavor (a
    captive proxy, another cloud) stays "not on GCE"."""
    with MetadataServer("n2-standard-8", impostor=True, status=404, bare_errors=True) as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        node = nodefit.facts(nvidia_smi=False)
        assert srv.requests == ["/computeMetadata/v1/instance/machine-type",
                                "/computeMetadata/v1/"]
    assert node.machine_problem is not None
    assert node.machine_problem.startswith("not on GCE"), node.machine_problem


def test_the_root_request_ends_by_the_same_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second request after a bare error gets no time of its own: METADATA_TIMEOUT
    bounds both (fingerprint(), doctor and the save hook wait on it)."""
    deadlines: list[float] = []
    real = nodefit._connect

    def spy(host: str, port: int, deadline: float) -> object:
        deadlines.append(deadline)
        return real(host, port, deadline)

    monkeypatch.setattr(nodefit, "_connect", spy)
    with MetadataServer("n2-standard-8", status=404, bare_errors=True) as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        assert nodefit.machine_type(timeout=10) is None
    assert len(deadlines) == 2 and deadlines[0] == deadlines[1], deadlines


def test_gke_s_server_header_alone_gives_no_machine_type_on_200(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 200 is believed only with Metadata-Flavor: Google (the Server header is a name
    any proxy could send; the machine type then goes into the manifest)."""
    with MetadataServer("n2-standard-8", impostor=True,
                        server="GKE Metadata Server") as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        assert nodefit.machine_type() is None


def test_a_bad_machine_type_override_is_unknown_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with MetadataServer("n2-standard-8") as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        monkeypatch.setenv("REHYDRATE_MACHINE_TYPE", "N2 Standard\n8")
        with caplog.at_level(logging.DEBUG, logger="rehydrate"):
            assert nodefit.machine_type() is None
            node = nodefit.facts(nvidia_smi=False)
        assert srv.requests == [], "a bad override is not silently replaced by the server"
    assert node.machine_series is None
    assert node.machine_problem == ("REHYDRATE_MACHINE_TYPE='N2 Standard\\n8' is not a GCE "
                                    "machine type")
    warned = [r for r in caplog.records if "REHYDRATE_MACHINE_TYPE" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, warned


@pytest.mark.parametrize("kind", ["impostor", "error", "bare error"])
def test_the_metadata_host_s_value_is_never_logged(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture,
                                                   kind: str) -> None:
    """GCE_METADATA_HOST is an environment value (not a rehydrate setting): the debug
    lines about a metadata server that is not GCE's named its value."""
    with MetadataServer("n2-standard-8", impostor=kind == "impostor",
                        status=200 if kind == "impostor" else 503,
                        bare_errors=kind == "bare error") as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        with caplog.at_level(logging.DEBUG, logger="rehydrate"):
            assert nodefit.machine_type() is None
    port = srv.host.rsplit(":", 1)[1]
    lines = [r.getMessage() for r in caplog.records if "metadata" in r.getMessage().lower()]
    assert lines and all("$GCE_METADATA_HOST" in line for line in lines), lines
    assert not [line for line in lines if srv.host in line or port in line], lines


# -- scheduling -------------------------------------------------------------------------

_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rehydrate", *args], env=env, check=False,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_labels_and_affinity_are_valid_kubernetes_yaml_and_match(node, tmp_path: Path) -> None:
    env = node("g2-standard-24", [L4, L4])
    manifest = tmp_path / "manifest.json"
    fp.write_manifest(fp.fingerprint(), manifest)

    labels_out = _cli("check", "--labels", env=env)
    assert labels_out.returncode == 0, labels_out.stderr
    patch = yaml.safe_load(labels_out.stdout)
    api = ApiClient()
    meta = api._ApiClient__deserialize(patch["metadata"], V1ObjectMeta)  # type: ignore[attr-defined]
    labels = meta.labels
    assert api.sanitize_for_serialization(meta) == patch["metadata"], "no unknown keys"
    for k, v in labels.items():
        assert _LABEL_KEY.fullmatch(k) and len(k.split("/")[-1]) <= 63, k
        assert _LABEL_VALUE.fullmatch(v) and len(v) <= 63, v
    assert labels["rehydrate.io/machine-series"] == "g2"
    assert labels["rehydrate.io/gpu-driver"] == "535.104.05"
    assert labels["rehydrate.io/gvisor-version"] == "release-20240729.0"
    assert labels["rehydrate.io/arch"] == nodefit.kube_arch()

    aff_out = _cli("check", str(manifest), "--affinity", env=env)
    assert aff_out.returncode == 0, aff_out.stderr
    doc = yaml.safe_load(aff_out.stdout)
    affinity = api._ApiClient__deserialize(doc["affinity"], V1Affinity)  # type: ignore[attr-defined]
    assert api.sanitize_for_serialization(affinity) == doc["affinity"], "no unknown keys"
    terms = affinity.node_affinity.required_during_scheduling_ignored_during_execution
    (term,) = terms.node_selector_terms
    required = {e.key: e.values for e in term.match_expressions}
    assert {e.operator for e in term.match_expressions} == {"In"}
    # The node labelled by the DaemonSet satisfies the affinity of its own snapshot.
    assert required == {k: [v] for k, v in labels.items()}
    assert json.loads(_cli("check", str(manifest), "--affinity", "--json", env=env).stdout) \
        == doc

    # Another node pool: the affinity excludes it.
    other = node("n2-standard-8", None)
    other_labels = yaml.safe_load(_cli("check", "--labels", env=other).stdout)
    assert other_labels["metadata"]["labels"]["rehydrate.io/machine-series"] == "n2"
    assert "rehydrate.io/gpu-driver" not in other_labels["metadata"]["labels"]


def test_labels_usage_errors(node) -> None:
    env = node("n2-standard-8", None)
    res = _cli("check", env=env)
    assert res.returncode == 2 and "MANIFEST" in res.stderr
    res = _cli("check", "--labels", "--node", env=env)
    assert res.returncode == 2 and "--labels" in res.stderr


def test_check_asks_the_metadata_server_only_when_the_snapshot_knew_its_series(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Off GCE the series is unknown at save time and never compared, so the check after a
    restore must not wait on a metadata server (where nothing answers it costs the whole
    timeout); a snapshot taken on GCE is checked against the node it lands on."""
    with MetadataServer("n2-standard-8") as srv:
        monkeypatch.setenv("GCE_METADATA_HOST", srv.host)
        _check_asks_only_when_known(srv)


def _check_asks_only_when_known(srv: MetadataServer) -> None:
    off_gce = fp.fingerprint(metadata=False, nvidia_smi=False)
    assert off_gce["machine_series"] is None
    srv.requests.clear()
    assert fp.check(off_gce, nvidia_smi=False) == []
    assert srv.requests == []

    on_gce = fp.fingerprint(nvidia_smi=False)
    assert on_gce["machine_series"] == "n2"
    srv.requests.clear()
    srv.machine_type = "e2-standard-8"
    mismatches = fp.check(on_gce, nvidia_smi=False)
    assert srv.requests == ["/computeMetadata/v1/instance/machine-type"]
    assert [(m.field, m.expected, m.actual) for m in mismatches] == [
        ("machine_series", "n2", "e2")]


def test_a_broken_nvidia_smi_makes_the_gpu_check_unknown_not_a_crash(node, monkeypatch,
                                                                     capsys) -> None:
    """nvidia-smi printing bytes that are not UTF-8 crashed doctor and fingerprint() with a
    UnicodeDecodeError; one that failed (a driver mismatch) or hung was reported as
    "no nvidia-smi: no GPU visible" — GPU ok on a GPU node with a broken driver."""
    node("g2-standard-8", [L4])
    monkeypatch.setenv("STANDIN_NVIDIA_BROKEN", "1")
    result = nodefit.assess(nodefit.facts())
    gpu = {c.name: c for c in result.checks}["GPU"]
    assert gpu.status == "unknown" and result.fit == "unknown"
    assert gpu.reason.startswith("nvidia-smi exited 9: ")
    assert "Driver/library version mismatch" in gpu.reason
    assert fp.fingerprint()["platform"]["gpu_problem"].startswith("nvidia-smi exited 9")
    from rehydrate._cli import main

    assert main(["doctor"]) == 0
    assert "nvidia-smi exited 9" in capsys.readouterr().out
    monkeypatch.delenv("STANDIN_NVIDIA_BROKEN")
    monkeypatch.setenv("STANDIN_NVIDIA_GPUS", "[]")  # exit 6: "No devices were found"
    gpu = {c.name: c for c in nodefit.assess(nodefit.facts()).checks}["GPU"]
    assert (gpu.status, gpu.reason) == ("ok", "nvidia-smi lists no GPU")


@pytest.mark.parametrize(("mtype", "series", "fit"), [
    ("custom-4-8192", "n1", "yes"),  # N1 custom types carry no series in their name
    ("custom-2-15360-ext", "n1", "yes"),
    ("n2-custom-4-8192", "n2", "yes"),
    ("e2-custom-4-8192", "e2", "no"),
])
def test_custom_machine_types_belong_to_their_series(node, mtype: str, series: str,
                                                     fit: str) -> None:
    """An N1 custom node (machine type "custom-4-8192") was recorded as series "custom":
    its label and the manifest disagreed with every n1 node of the same pool."""
    node(mtype, None)
    facts = nodefit.facts()
    assert (facts.machine_type, facts.machine_series) == (mtype, series)
    assert nodefit.assess(facts).fit == fit
    labels = nodefit.node_labels(fp.fingerprint(nvidia_smi=False))
    assert labels["rehydrate.io/machine-series"] == series


# -- to_yaml: what it writes, a YAML 1.1 reader (PyYAML, like kubectl) reads back ----------

def _same(a: object, b: object) -> bool:
    """Equal, with NaN equal to NaN and types kept (True is not 1, 1.0 is not 1)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)  # type: ignore[attr-defined]
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))  # type: ignore[arg-type]
    return a == b


def test_to_yaml_quotes_what_yaml_1_1_would_read_as_booleans_null_or_numbers() -> None:
    """Keys ``on``/``yes``/``no``/``null`` came out plain (YAML 1.1: True/False/None keys),
    NaN as ``NaN`` and 1e100 as ``1e+100`` (both strings to YAML), a character beyond
    U+FFFF as a JSON surrogate pair (two lone surrogates to YAML), a key longer than
    1024 characters as an implicit key (a parse error)."""
    data = {
        "on": 1, "yes": "x", "no": True, "null": None, "Off": "y", "True": 2, "~": 3,
        "labels": {"a": "on", "b": "1.0", "c": "yes", "d": "~", "e": "null", "f": "0x1F"},
        "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"),
        "big": 1e100, "small": 1e-05, "emoji": "😀", "😀": ["\u2028", "\x85", "\x7f"],
        "\u0100" * 300: {"nested": [1]},  # escaped, beyond YAML's 1024-character keys
    }
    out = nodefit.to_yaml(data)
    assert _same(yaml.safe_load(out), data), out
    # go-yaml v2 (kubectl) also reads y / n as booleans; PyYAML does not, so look.
    assert '"y": 1\n' in nodefit.to_yaml({"y": 1})
    assert '"N": 1\n' in nodefit.to_yaml({"N": 1})
    assert out.isascii()


_scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text())
_documents = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(data=st.dictionaries(st.text(), _documents, max_size=5))
def test_to_yaml_round_trips_through_a_real_yaml_parser(data: dict[str, object]) -> None:
    out = nodefit.to_yaml(data)
    assert _same(yaml.safe_load(out), data), out


def test_to_yaml_refuses_what_it_cannot_write() -> None:
    with pytest.raises(TypeError, match="keys must be strings"):
        nodefit.to_yaml({1: "x"})
    with pytest.raises(TypeError, match="cannot write a bytes"):
        nodefit.to_yaml({"k": b"x"})


def test_kube_arch_of_an_unknown_machine_is_not_the_checkers_own() -> None:
    """kube_arch("") fell back to platform.machine(): a manifest that recorded no
    architecture was labelled (and its affinity pinned) with the checker's."""
    import platform

    assert nodefit.kube_arch("") == ""
    assert nodefit.kube_arch() == nodefit.kube_arch(platform.machine())
    assert nodefit.kube_arch("aarch64") == "arm64"
    assert nodefit.node_labels({"arch": "", "machine_series": "n2"}) == {
        "rehydrate.io/machine-series": "n2"}


def test_affinity_without_any_scheduling_fact_is_an_error_not_an_empty_term(
        tmp_path: Path) -> None:
    """A manifest with no scheduling fact gave ``matchExpressions: []``, a term that
    Kubernetes matches against no node: the restoring Pod stayed Pending for ever."""
    with pytest.raises(ValueError, match="records no scheduling fact"):
        nodefit.node_affinity({"arch": "", "machine_series": None, "gvisor_version": None,
                               "gpu_driver": None})
    with pytest.raises(ValueError, match="records no scheduling fact"):
        nodefit.node_affinity({"arch": "???"})  # no valid label value left of it
    only_series = nodefit.node_affinity({"arch": "", "machine_series": "n2"})
    (term,) = only_series["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": "rehydrate.io/machine-series", "operator": "In", "values": ["n2"]}]

    manifest = fp.fingerprint(metadata=False, nvidia_smi=False)
    manifest.update(arch="", gvisor_version=None, gpu_driver=None, machine_series=None)
    path = tmp_path / "manifest.json"
    fp.write_manifest(manifest, path)
    env = dict(os.environ)  # --affinity reads only the manifest, not this node
    res = _cli("check", str(path), "--affinity", env=env)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.count("\n") == 1 and "records no scheduling fact" in res.stderr
    res = _cli("check", str(path), "--affinity", "--json", env=env)
    assert res.returncode == 2 and res.stderr == ""
    assert "records no scheduling fact" in json.loads(res.stdout)["error"]
