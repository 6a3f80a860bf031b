"""Platform fit: can GKE Pod snapshots work on this node, and where may a snapshot restore?

GKE's documentation lists node limits that end in a silent cold start or a failed snapshot:
no E2 machine types, more than one GPU in a Pod only on L4, no Multi-Instance GPU, and only
under GKE Sandbox (gVisor). :func:`facts` gathers what this node shows:

* the machine type: ``REHYDRATE_MACHINE_TYPE`` when set (GKE's metadata server, in front
  of every Pod of a Pod-snapshot node pool, answers 404 for it), else from the GCE
  metadata server (``/computeMetadata/v1/instance/machine-type`` with
  ``Metadata-Flavor: Google``; host ``$GCE_METADATA_HOST`` as Google's own libraries read
  it, else ``169.254.169.254``; :data:`METADATA_TIMEOUT`, no proxy, silent off GCE);
* GPUs, driver and MIG mode from ``nvidia-smi`` when it is installed;
* whether this is gVisor and, where visible (``REHYDRATE_GVISOR_VERSION``), its version.

:func:`assess` turns them into ``rehydrate doctor``'s verdict; :func:`node_labels` and
:func:`node_affinity` give a DaemonSet the labels to put on nodes and a restoring Pod the
``nodeAffinity`` that lands it only on nodes matching a manifest; :func:`to_yaml` prints
them as Kubernetes YAML.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from . import _config, _dns
from ._gvisor import running_under_gvisor

__all__ = [
    "LABEL_PREFIX",
    "METADATA_TIMEOUT",
    "NVIDIA_SMI_TIMEOUT",
    "Check",
    "Gpu",
    "NodeFacts",
    "assess",
    "facts",
    "gpus",
    "in_gvisor",
    "kube_arch",
    "machine_type",
    "node_affinity",
    "node_labels",
    "render",
    "to_yaml",
]

log = logging.getLogger("rehydrate")

METADATA_TIMEOUT = 0.5
"""Seconds for the whole metadata exchange — connect, send, and every read of the answer,
and of the root's when an error answer comes without Google's headers (the server answers
in milliseconds on GCE)."""
NVIDIA_SMI_TIMEOUT = 3.0
LABEL_PREFIX = "rehydrate.io/"
"""Prefix of the node labels :func:`node_labels` proposes and :func:`node_affinity` uses."""

def in_gvisor(root: str = "/") -> bool:
    """True inside a gVisor sandbox (:func:`rehydrate._gvisor.running_under_gvisor` under
    ``root``); on the real root a ``REHYDRATE_GVISOR_PROC`` stand-in counts as gVisor."""
    proc = _config.text("REHYDRATE_GVISOR_PROC") if root == "/" else None
    return running_under_gvisor(root, marker=proc)


class _DeadlineSocket(socket.socket):
    """A connected socket whose every send and receive ends by one ``deadline`` (a
    ``time.monotonic()``): a plain socket timeout applies to each read, so a server
    sending a byte at a time never trips it."""

    deadline = 0.0

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.settimeout(left)

    def recv_into(self, *args: Any, **kwargs: Any) -> int:  # what makefile() reads with
        self._arm()
        return super().recv_into(*args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        self._arm()
        return super().recv(*args, **kwargs)

    def sendall(self, *args: Any, **kwargs: Any) -> None:
        self._arm()
        super().sendall(*args, **kwargs)


def _connect(host: str, port: int, deadline: float) -> _DeadlineSocket:
    """A connection to ``host``:``port`` (each address in turn, as
    ``socket.create_connection``) whose lookup, connect and every later send and receive
    end by ``deadline``."""
    error: OSError = TimeoutError("timed out")
    # the lookup too: GCE_METADATA_HOST may be a host name, and a resolver that does not
    # answer held fingerprint(), doctor and the save hook for as long as it liked
    addresses = _dns.resolve(host, port, deadline, thread_name="rehydrate-metadata-dns")
    for family, kind, proto, _, address in addresses:
        sock = _DeadlineSocket(family, kind, proto)
        sock.deadline = deadline
        try:
            sock._arm()
            sock.connect(address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error


_MACHINE_TYPE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_WARNED_OVERRIDES: set[str] = set()
"""Bad ``REHYDRATE_MACHINE_TYPE`` values already warned about: fingerprint(), check and
doctor each ask, and one bad value is one line."""


def machine_type(timeout: float = METADATA_TIMEOUT) -> str | None:
    """This VM's GCE machine type (``n2-standard-8``), or None off GCE (silently).
    ``REHYDRATE_MACHINE_TYPE``, when set, is the answer (the metadata server is not
    asked): a Pod behind the GKE metadata server gets 404 for the machine type.
    ``timeout`` bounds the whole exchange, the name lookup of a ``GCE_METADATA_HOST``
    given as a host name included, and so does the second request (``/computeMetadata/v1/``)
    that tells whether an error answer without Google's headers is Google's: GKE's
    metadata server sends its errors bare."""
    return _machine_type(timeout)[0]


def _machine_type(timeout: float) -> tuple[str | None, str | None]:
    """:func:`machine_type` and, when it is None although something answered, why
    (:attr:`NodeFacts.machine_problem`): None for no answer at all (off GCE)."""
    override = _config.text("REHYDRATE_MACHINE_TYPE")
    if override is not None:
        return _overridden(override)
    import http.client  # imported late, as _get does

    configured = os.environ.get("GCE_METADATA_HOST")
    host = configured or "169.254.169.254"
    # GCE_METADATA_HOST is another platform's variable: logs name it, never its value
    where = "$GCE_METADATA_HOST" if configured else host
    deadline = time.monotonic() + timeout
    try:
        status, flavor, server, body = _get(host, "/computeMetadata/v1/instance/machine-type",
                                            deadline)
        # A real metadata server says so in a header: a captive proxy answering 200, or
        # another cloud's (AWS IMDS, Azure, OpenStack) answering 404 for GCE's path, is not
        # one. GKE's names itself in Server too, but its published error answers carry
        # neither header: for a bare error ask its root, as google-auth's is_on_gce does,
        # within the same deadline. A machine type is taken only with the flavor.
        google = flavor == "Google" or (status != 200 and server == "GKE Metadata Server")
        if not google and status != 200:
            root_status, root_flavor, _, _ = _get(host, "/computeMetadata/v1/", deadline)
            google = root_status == 200 and root_flavor == "Google"
    except (http.client.HTTPException, OSError, ValueError) as exc:
        log.debug("GCE metadata server not reachable (%s): not on GCE", type(exc).__name__)
        return None, None
    if not google:
        log.debug("no GCE machine type from %s (HTTP %d, not Google's metadata server)",
                  where, status)
        return None, ("not on GCE (the metadata server's address answered without "
                      "Metadata-Flavor: Google)")
    if status != 200:
        log.debug("GCE metadata server at %s answered %d: no machine type", where, status)
        # GKE's metadata server (workload metadata GKE_METADATA, which Pod snapshots
        # need) answers 404 here: an answer, so not "off GCE", only no machine type.
        return None, (f"the metadata server does not serve the machine type (HTTP {status}; "
                      "GKE's does not): set REHYDRATE_MACHINE_TYPE")
    name = body.strip().rsplit("/", 1)[-1]  # projects/NUM/machineTypes/NAME
    if not _MACHINE_TYPE.fullmatch(name):
        return None, "the metadata server's answer is not a machine type"
    return name, None


def _get(host: str, path: str, deadline: float) -> tuple[int, str | None, str | None, str]:
    """``GET path`` from the metadata server at ``host`` with ``Metadata-Flavor: Google``,
    all of it (lookup, connect, send, read) ending by ``deadline``: its status, its
    ``Metadata-Flavor`` and ``Server`` headers, and up to 4 KiB of its body."""
    # http.client, not urllib.request: the same request without urllib's opener machinery
    # (and its imports: ~15 ms of fingerprint()'s first call); it never uses a proxy.
    import http.client

    conn = http.client.HTTPConnection(host)
    try:
        # Resolving, connecting, sending the request and reading the answer all end
        # by the same deadline (conn.connect() would resolve without one).
        conn.sock = _connect(conn.host, conn.port, deadline)
        conn.request("GET", path, headers={"Metadata-Flavor": "Google"})
        resp = conn.getresponse()
        return (resp.status, resp.getheader("Metadata-Flavor"), resp.getheader("Server"),
                resp.read(4096).decode("utf-8", "replace"))
    finally:
        conn.close()


def _overridden(override: str) -> tuple[str | None, str | None]:
    """:func:`_machine_type` for a set ``REHYDRATE_MACHINE_TYPE``: a bad one is unknown
    (warned about once), not replaced by the metadata server's answer."""
    if _MACHINE_TYPE.fullmatch(override):
        return override, None
    # A rehydrate setting, not an environment secret: its value may be shown (repr:
    # escaped, one line).
    shown = repr(override[:64])
    if override not in _WARNED_OVERRIDES:
        _WARNED_OVERRIDES.add(override)
        log.warning("REHYDRATE_MACHINE_TYPE=%s is not a GCE machine type "
                    "(like n2-standard-8); the machine series is unknown", shown)
    return None, f"REHYDRATE_MACHINE_TYPE={shown} is not a GCE machine type"


def _series(mtype: str | None) -> str | None:
    """The machine series of a machine type: its first word (``n2-standard-8``: ``n2``,
    ``e2-custom-4-8192``: ``e2``) — except N1's custom types, named ``custom-CPUS-MEM``
    without a series (GCE's custom machine type names), which are ``n1``."""
    if not mtype:
        return None
    first = mtype.split("-", 1)[0]
    return "n1" if first == "custom" else first


@dataclass(frozen=True)
class Gpu:
    """One GPU as ``nvidia-smi`` lists it."""

    name: str
    driver: str | None
    mig: bool | None
    """MIG mode currently enabled (None: not a MIG-capable GPU, ``[N/A]``)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``doctor --json``, the manifest's ``platform``)."""
        return {"name": self.name, "driver": self.driver, "mig": self.mig}


class GpuQueryFailed(RuntimeError):
    """``nvidia-smi`` is there but did not answer (a broken driver): GPUs are unknown."""


_NO_DEVICES = 6  # nvidia-smi's exit status for "No devices were found"


def gpus(timeout: float = NVIDIA_SMI_TIMEOUT) -> list[Gpu] | None:
    """The GPUs ``nvidia-smi`` lists (name, driver, MIG mode); None without nvidia-smi.
    :class:`GpuQueryFailed` when it fails or hangs: that is no "no GPU"."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,driver_version,mig.mode.current", "--format=csv,noheader"],
            capture_output=True, text=True, encoding="utf-8", errors="replace",
            timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise GpuQueryFailed(f"nvidia-smi did not answer: {exc}") from None
    if out.returncode == _NO_DEVICES:
        return []
    if out.returncode != 0:
        said = " ".join((out.stderr or out.stdout).split())[:200]
        raise GpuQueryFailed(f"nvidia-smi exited {out.returncode}: {said}")
    found = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0]:
            continue
        name, driver, mig = parts
        found.append(Gpu(name, None if driver.startswith("[") else driver,
                         {"enabled": True, "disabled": False}.get(mig.lower())))
    return found


def kube_arch(machine: str | None = None) -> str:
    """``machine`` (default: this node's ``platform.machine()``) as Kubernetes spells it
    (``kubernetes.io/arch``). An empty ``machine`` (unknown: ``platform.machine()``
    gives ``""`` where it cannot tell) stays ``""`` — never the caller's own architecture:
    a manifest recorded elsewhere is not labelled with the checker's."""
    m = platform.machine() if machine is None else machine
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386",
            "ppc64le": "ppc64le", "s390x": "s390x"}.get(m, m.lower())


@dataclass(frozen=True)
class NodeFacts:
    """What this node shows about snapshot support."""

    machine_type: str | None
    machine_series: str | None
    gpus: tuple[Gpu, ...] | None
    """None: no ``nvidia-smi`` here (no GPU, or not visible)."""
    gvisor: bool
    gvisor_version: str | None
    arch: str
    gpu_problem: str | None = None
    """Why the GPUs are unknown (``nvidia-smi`` failed); ``gpus`` is None then."""
    machine_problem: str | None = None
    """Why the machine type is unknown although the metadata server answered (GKE's
    answers 404) or ``REHYDRATE_MACHINE_TYPE`` is bad; None too when nothing answered
    (off GCE) or it was not asked."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``doctor --json``, the manifest's ``platform``)."""
        out = {"machine_type": self.machine_type, "machine_series": self.machine_series,
               "gpus": None if self.gpus is None else [g.to_dict() for g in self.gpus],
               "gvisor": self.gvisor, "gvisor_version": self.gvisor_version,
               "arch": self.arch}
        if self.gpu_problem is not None:
            out["gpu_problem"] = self.gpu_problem
        if self.machine_problem is not None:
            out["machine_problem"] = self.machine_problem
        return out


def facts(*, metadata: bool = True, nvidia_smi: bool = True, root: str = "/") -> NodeFacts:
    """Gather :class:`NodeFacts` (``metadata`` / ``nvidia_smi`` False: skip that source)."""
    mtype, machine_problem = _machine_type(METADATA_TIMEOUT) if metadata else (None, None)
    problem = None
    try:
        found = gpus() if nvidia_smi else None
    except GpuQueryFailed as exc:
        found, problem = None, str(exc)
    return NodeFacts(mtype, _series(mtype), None if found is None else tuple(found),
                     in_gvisor(root), _config.text("REHYDRATE_GVISOR_VERSION"),
                     kube_arch(), problem, machine_problem)


@dataclass(frozen=True)
class Check:
    """One line of the verdict: ``ok``, ``blocked`` (snapshots cannot work) or ``unknown``."""

    name: str
    status: Literal["ok", "blocked", "unknown"]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``doctor --json``, the manifest's ``platform``)."""
        return {"name": self.name, "status": self.status, "reason": self.reason}


@dataclass(frozen=True)
class Fit:
    """:func:`assess`'s answer: ``fit`` is ``yes``, ``no`` (a check blocked) or ``unknown``."""

    fit: Literal["yes", "no", "unknown"]
    checks: tuple[Check, ...]
    facts: NodeFacts = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``doctor --json``, the manifest's ``platform``)."""
        return {"fit": self.fit, "checks": [c.to_dict() for c in self.checks],
                "facts": self.facts.to_dict()}


_L4 = re.compile(r"\bL4\b")


def assess(node: NodeFacts) -> Fit:
    """Whether GKE Pod snapshots can work on ``node``, one :class:`Check` per limit."""
    checks = []
    if node.machine_series is None:
        checks.append(Check("machine series", "unknown", node.machine_problem
                            or "not on GCE (no answer from the metadata server)"))
    elif node.machine_series == "e2":
        checks.append(Check("machine series", "blocked",
                            f"{node.machine_type}: E2 machine types do not support Pod "
                            "snapshots"))
    else:
        checks.append(Check("machine series", "ok", f"{node.machine_type}"))
    if node.gpu_problem is not None:
        checks.append(Check("GPU", "unknown", f"{node.gpu_problem}: the GPUs cannot be "
                            "checked"))
    elif node.gpus is None:
        checks.append(Check("GPU", "ok", "no nvidia-smi: no GPU visible"))
    elif not node.gpus:
        checks.append(Check("GPU", "ok", "nvidia-smi lists no GPU"))
    else:
        names = sorted({g.name for g in node.gpus})
        desc = f"{len(node.gpus)} x {', '.join(names)}"
        mig = [i for i, g in enumerate(node.gpus) if g.mig]
        if len(node.gpus) > 1 and not all(_L4.search(g.name) for g in node.gpus):
            checks.append(Check("GPU", "blocked", f"{desc}: more than one GPU is supported "
                                "only on L4"))
        else:
            checks.append(Check("GPU", "ok", desc))
        if mig:
            checks.append(Check("MIG", "blocked", "Multi-Instance GPU mode is enabled on "
                                f"GPU {', '.join(map(str, mig))}: not supported"))
        else:
            checks.append(Check("MIG", "ok", "MIG mode off"))
    if node.gvisor:
        version = node.gvisor_version or ("not visible inside the sandbox (set "
                                          "REHYDRATE_GVISOR_VERSION, e.g. from a node label)")
        checks.append(Check("runtime", "ok", f"gVisor, version {version}"))
    else:
        checks.append(Check("runtime", "blocked", "not gVisor: Pod snapshots need GKE "
                            "Sandbox (runtimeClassName: gvisor)"))
    statuses = {c.status for c in checks}
    fit: Literal["yes", "no", "unknown"] = (
        "no" if "blocked" in statuses else "unknown" if "unknown" in statuses else "yes")
    return Fit(fit, tuple(checks), node)


# -- scheduling: labels and affinity ----------------------------------------------------

_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")


def _label_value(value: str) -> str | None:
    """``value`` as a valid label value (invalid characters become ``_``), or None."""
    v = re.sub(r"[^A-Za-z0-9._-]", "_", value)[:63].strip("._-")
    return v if v and _LABEL_VALUE.fullmatch(v) else None


def _scheduling_facts(src: Mapping[str, Any]) -> dict[str, str]:
    """label key → value for the fields a restore depends on (from a manifest or facts)."""
    pairs = {
        "machine-series": src.get("machine_series"),
        "arch": kube_arch(src["arch"]) if isinstance(src.get("arch"), str) else None,
        "gvisor-version": src.get("gvisor_version"),
        "gpu-driver": src.get("gpu_driver"),
    }
    out = {}
    for key, value in pairs.items():
        if isinstance(value, str) and (v := _label_value(value)) is not None:
            out[LABEL_PREFIX + key] = v
    return out


def node_labels(manifest_like: Mapping[str, Any]) -> dict[str, str]:
    """The labels a DaemonSet should put on this node (``manifest_like``: this node's
    :func:`rehydrate.fingerprint` manifest)."""
    return _scheduling_facts(manifest_like)


def node_affinity(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The ``affinity`` of a Pod that should restore ``manifest``'s snapshot: required
    node labels matching every scheduling fact the manifest recorded.

    ``ValueError`` when it recorded none (no machine series, architecture, gVisor version
    or GPU driver that makes a label value): Kubernetes reads a term without expressions
    as matching no node, and leaving the term out would let the Pod land anywhere — both
    silently, so neither is printed."""
    exprs = [{"key": k, "operator": "In", "values": [v]}
             for k, v in _scheduling_facts(manifest).items()]
    if not exprs:
        raise ValueError("the manifest records no scheduling fact (machine series, arch, "
                         "gVisor version or GPU driver): no nodeAffinity can select its "
                         "nodes")
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": exprs}]}}}


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
# YAML 1.1 — what kubectl and the API server read (sigs.k8s.io/yaml, go-yaml v2), and
# PyYAML — resolves these plain words (in any of their usual cases) to booleans or null:
# a key spelt like one (a label value reaching a key, ``on:``) is quoted.
_YAML11_WORDS = frozenset({"y", "yes", "n", "no", "true", "false", "on", "off", "null"})
# In a double-quoted scalar only printable ASCII other than ``"`` and ``\`` stays as is.
_NEEDS_ESCAPE = re.compile(r'[^\x20\x21\x23-\x5b\x5d-\x7e]')
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


_IMPLICIT_KEY_MAX = 1024
"""YAML reads a ``key: value`` key of at most 1024 characters (PyYAML and go-yaml enforce it)."""


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    o = ord(ch)
    # YAML's own escapes, not JSON's: JSON writes a character beyond U+FFFF as a
    # surrogate pair, which YAML reads back as two lone surrogates.
    return f"\\x{o:02x}" if o <= 0xFF else f"\\u{o:04x}" if o <= 0xFFFF else f"\\U{o:08x}"


def _quoted(text: str) -> str:
    """``text`` as a YAML double-quoted scalar (ASCII only: any encoding reads it)."""
    return '"' + _NEEDS_ESCAPE.sub(_escape, text) + '"'


def _key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"to_yaml: mapping keys must be strings, not {type(key).__name__}")
    if _PLAIN_KEY.fullmatch(key) and key.lower() not in _YAML11_WORDS:
        return key
    return _quoted(key)


def _scalar(value: object) -> str:
    """A scalar that YAML 1.1 and 1.2 read back as the same value and type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _quoted(value)
    raise TypeError(f"to_yaml: cannot write a {type(value).__name__}")


def _float(value: float) -> str:
    if math.isnan(value):
        return ".nan"  # json.dumps writes NaN / Infinity: strings to YAML
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    text = repr(float(value))
    mantissa, e, exponent = text.partition("e")
    # YAML 1.1 floats need a dot: 1e+100 would be the string "1e+100".
    return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text


def to_yaml(data: Any, indent: int = 0) -> str:
    """Block-style YAML for dicts, lists, strings, numbers, booleans and None — the
    subset Kubernetes objects need — that a YAML 1.1 reader (kubectl) and a YAML 1.2
    one read back as ``data``: strings double-quoted, keys YAML would take for a boolean
    or null (``on``, ``no``, ``null``…) quoted, NaN and infinities as ``.nan`` / ``.inf``,
    a key longer than YAML allows in ``key: value`` as an explicit ``? key``.
    ``TypeError`` for anything else (or a key that is not a string)."""
    pad = "  " * indent
    if isinstance(data, Mapping):
        if not data:
            return pad + "{}\n"
        lines = []
        for k, v in data.items():
            key = _key(k)
            if len(key) < _IMPLICIT_KEY_MAX:
                head = f"{pad}{key}:"
            else:  # too long for a plain "key: value": an explicit "? key" then ": value"
                lines.append(f"{pad}? {key}\n")
                head = f"{pad}:"
            if isinstance(v, (Mapping, list, tuple)) and v:
                lines.append(f"{head}\n{to_yaml(v, indent + 1)}")
            else:
                lines.append(f"{head} {to_yaml(v).strip()}\n")
        return "".join(lines)
    if isinstance(data, (list, tuple)):
        if not data:
            return pad + "[]\n"
        lines = []
        for item in data:
            body = to_yaml(item, indent + 1)
            lines.append(f"{pad}- {body.lstrip()}")
        return "".join(lines)
    return pad + _scalar(data) + "\n"


def render(obj: Mapping[str, Any], *, as_json: bool = False) -> str:
    """A Kubernetes object fragment as YAML (or indented JSON), ending with a newline."""
    import json

    return json.dumps(obj, indent=2) + "\n" if as_json else to_yaml(obj)
