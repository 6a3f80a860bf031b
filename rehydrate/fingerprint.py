"""Snapshot compatibility manifest (``rehydrate.fingerprint()``) and snapshot-miss detection.

A platform restores a snapshot only on a node that matches it (GKE: gVisor version, GPU
driver version, machine series, the distilled Pod spec); otherwise the Pod cold-starts
and nothing errors. The manifest records what a restore depends on, so that:

* before a snapshot it is written where the deployment says (``path``, or only kept in
  memory and shown in ``status()["fingerprint"]``) — the ``rehydrate.fingerprint.save``
  before-snapshot hook;
* after a restore the clone compares it with the node it woke up on and reports every
  difference (one log line, ``status()["fingerprint"]["mismatches"]``, the telemetry
  counter ``rehydrate.fingerprint.mismatches``); with ``strict=True`` the
  ``rehydrate.fingerprint.check`` hook is required and fails readiness;
* when the deployment declared that a restore was expected (``REHYDRATE_EXPECT_RESTORE=1``
  or a manifest present at ``path``) but the process started cold, :meth:`Lifecycle.start`
  reports a ``snapshot-miss`` (log line, status, counter ``rehydrate.snapshot.misses``)
  with the most likely reason taken from the manifest diff;
* ``rehydrate check MANIFEST`` answers "would this node restore that snapshot?".

The manifest has no per-process field (PID, time, instance ID): a fresh manifest passes
``check`` on the node that wrote it. Environment values are stored only as salted
SHA-256 hashes, in the manifest itself (the file, :func:`fingerprint`'s dict): the salt
must be beside them, because another process — a cold start, ``rehydrate check`` in an
init container — recomputes them from its own environment, and there is no secret it
could share with the process that wrote them. A hash of a low-entropy value can be
guessed by whoever reads the file, so list keys whose *change* matters, not secrets you
need to hide. Nothing rehydrate shows carries them: ``status()``, mismatches (``rehydrate
check --json``, logs, reports) name the keys and whether each was changed, added or
removed.

Configuration by environment: ``REHYDRATE_MANIFEST`` (path), ``REHYDRATE_EXPECT_RESTORE``
(``1``: this Pod should have been restored), ``REHYDRATE_FINGERPRINT_ENV`` (comma-separated
keys), ``REHYDRATE_FINGERPRINT_STRICT`` (``1``), ``REHYDRATE_GVISOR_VERSION`` (the node's
gVisor version, e.g. from a node label; gVisor does not show its version inside the
sandbox).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sys
import threading
import types
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from . import _config
from ._hooks import Phase
from ._threads import fresh_lock_after_fork
from .extensions import Probe, resolve_engine

# hashlib, json, pathlib, platform and secrets are imported where a manifest is made or
# read: this module is a default extension, loaded with every engine.
if TYPE_CHECKING:
    from pathlib import Path

    from ._context import RestoreContext
    from ._nodefit import NodeFacts
    from .extensions import Engine

__all__ = [
    "NODE_FIELDS",
    "SCHEMA",
    "FingerprintManager",
    "FingerprintMismatch",
    "ManifestError",
    "Mismatch",
    "check",
    "compare",
    "configure",
    "engine_started",
    "fingerprint",
    "load_manifest",
    "manager",
    "most_likely_reason",
    "write_manifest",
]

log = logging.getLogger("rehydrate")

SCHEMA = 1
"""The manifest format version written as ``schema``."""

# Fields compared by check(), in the order a miss is most likely explained by them
# (GKE: gVisor and GPU driver versions and the machine series are part of the match).
_COMPARED = ("gvisor_version", "gpu_driver", "machine_series", "arch", "cpu_vendor",
             "cpu_model", "cpu_flags", "gvisor", "kernel_release", "python",
             "python_implementation", "distributions")
NODE_FIELDS = frozenset(_COMPARED[:9])
"""Fields a checker on the node sees as the workload would (``check --node``); the
others (Python, distributions, ``env.*``) belong to the workload's image and environment."""
Scope = Literal["all", "node"]
_OPTIONAL = frozenset({"machine_series"})  # added after schema 1 shipped: may be absent


class ManifestError(ValueError):
    """The manifest cannot be read or is not a rehydrate manifest."""


class FingerprintMismatch(RuntimeError):
    """The node differs from the snapshot's manifest (raised by the strict check hook)."""


@dataclass(frozen=True)
class Mismatch:
    """One field where this node differs from the manifest: what was recorded, what is here."""

    field: str
    expected: Any
    actual: Any
    """For an ``env.*`` field: ``"set"`` or ``"unset"``, never a value or a hash of one."""

    @property
    def change(self) -> str | None:
        """``env.*`` fields: ``"changed"``, ``"added"`` (set on this node only) or
        ``"removed"`` (set in the snapshot only); None for the other fields."""
        if not self.field.startswith("env."):
            return None
        if self.expected == "unset":
            return "added"
        return "removed" if self.actual == "unset" else "changed"

    def to_dict(self) -> dict[str, Any]:
        out = {"field": self.field, "expected": self.expected, "actual": self.actual}
        change = self.change
        if change is not None:
            out["change"] = change
        return out

    def describe(self) -> str:
        """One line (a key name or value with a newline or other control character is
        shown escaped and quoted, ``env.'A\\nB'``)."""
        if self.field == "cpu_flags":
            return f"cpu_flags: this node lacks {_short(self.expected)}"
        if self.field.startswith("env."):
            # Key name only (compare() keeps no value or hash of one in a Mismatch): this
            # text goes to the log, the strict hook's error and the report.
            name = "env." + _printable(self.field[4:])
            return {"added": f"{name}: unset in the snapshot, set on this node",
                    "removed": f"{name}: set in the snapshot, unset on this node",
                    }.get(self.change or "", f"{name}: value differs from the snapshot's")
        return (f"{_printable(self.field)}: snapshot {_short(self.expected)}, "
                f"this node {_short(self.actual)}")


def _printable(text: str) -> str:
    """``text`` as is when every character prints, else quoted with escapes (``repr``):
    a manifest's key names and values reach terminal and log lines, where a newline or an
    escape sequence would forge another line or hide this one."""
    return text if text.isprintable() else repr(text)


def _short(v: Any) -> str:
    if isinstance(v, list):
        return " ".join(_printable(str(x)) for x in v) if v else "[]"
    return "none" if v is None else _printable(str(v))


# -- collecting ----------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _cpu(root: Path) -> dict[str, Any]:
    """Vendor, model and flags of the first CPU in ``/proc/cpuinfo`` (x86 and Arm keys)."""
    text = _read(root / "proc/cpuinfo") or ""
    first: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if first:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            first.setdefault(key.strip().lower(), value.strip())
    vendor = first.get("vendor_id") or first.get("cpu implementer")
    model = first.get("model name") or (
        f"{first.get('cpu implementer', '?')}/{first.get('cpu part', '?')}"
        if "cpu part" in first else None)
    flags = (first.get("flags") or first.get("features") or "").split()
    return {"cpu_vendor": vendor, "cpu_model": model, "cpu_flags": sorted(set(flags))}


def _kernel_release(root: Path) -> str:
    import platform

    if os.fspath(root) == "/":
        return platform.release()
    fake = _read(root / "proc/sys/kernel/osrelease")
    return fake.strip() if fake is not None else platform.release()


_NVRM = r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+(?:\.\d+)+)"  # compiled (and cached) by re when used


def _gpu_driver(root: Path, node: NodeFacts) -> str | None:
    text = _read(root / "proc/driver/nvidia/version")
    if text:
        m = re.search(_NVRM, text) or re.search(r"(\d+\.\d+(?:\.\d+)?)", text)
        if m:
            return m.group(1)
    return next((g.driver for g in node.gpus or () if g.driver), None)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _metadata_fields(path: Path) -> tuple[str | None, str | None]:
    """``Name`` and ``Version`` from a METADATA / PKG-INFO file (headers only)."""
    meta = path / "METADATA" if path.suffix == ".dist-info" else (
        path / "PKG-INFO" if path.is_dir() else path)
    name = version = None
    try:
        with open(meta, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # end of the headers
                if line.startswith("Name:"):
                    name = line[5:].strip()
                elif line.startswith("Version:"):
                    version = line[8:].strip()
    except OSError:
        return None, None
    return name, version


def installed_paths() -> list[str]:
    """The ``sys.path`` entries :func:`distributions` reads by default: ``PYTHONPATH`` and
    the interpreter's own (the standard library onward: site-packages, the user site,
    ``.pth`` entries) — not the script's directory or the current directory that the
    interpreter puts first, nor entries a program put before the standard library.

    Those differ between the workload and a ``rehydrate check`` run as another program
    (its first entry is the ``rehydrate`` script's directory), or from another
    directory (``python -m``: the current one): counted, a workload whose packages sit
    next to its script (``pip install --target /app``) was called incompatible with
    itself on the node that wrote its manifest."""
    stdlib = os.path.dirname(getattr(os, "__file__", None) or "")
    try:
        first = sys.path.index(stdlib)
    except ValueError:  # an embedded or frozen interpreter: only "" can be told apart
        first = 0
    pythonpath = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p}
    return [entry for i, entry in enumerate(sys.path)
            if entry and (i >= first or os.path.abspath(entry) in pythonpath)]


def distributions(paths: Iterable[str] | None = None) -> list[str]:
    """Sorted ``name==version`` of the installed distributions found in ``paths``
    (default: :func:`installed_paths`, ``sys.path`` without the script's directory).

    The same directories ``importlib.metadata`` searches (``*.dist-info``, ``*.egg-info``),
    read from directory names where possible and from metadata headers otherwise —
    without importing ``importlib.metadata`` (whose import alone costs ~15 ms). The
    first entry of a name on the path wins, as for imports.
    """
    seen: dict[str, str] = {}
    for entry in installed_paths() if paths is None else paths:
        try:
            names = os.listdir(entry or ".")
        except OSError:  # missing directory, zip file …
            continue
        for fname in sorted(names):
            if fname.endswith(".dist-info"):
                stem = fname[: -len(".dist-info")]
            elif fname.endswith(".egg-info"):
                stem = fname[: -len(".egg-info")]
            else:
                continue
            name = version = None
            if fname.endswith(".dist-info") and stem.count("-") == 1:
                name, version = stem.split("-")
            else:
                from pathlib import Path

                name, version = _metadata_fields(Path(entry or ".", fname))
            if not name or not version:
                log.debug("distribution %s in %s skipped: no name or version", fname, entry)
                continue
            seen.setdefault(_norm(name), version)
    return sorted(f"{n}=={v}" for n, v in seen.items())


def _hash_env(salt: str, key: str, value: str | None) -> str | None:
    import hashlib

    if value is None:
        return None
    h = hashlib.sha256(f"{salt}\0{key}\0{value}".encode("utf-8", "surrogateescape"))
    return "sha256:" + h.hexdigest()


def _key_names(env_keys: Iterable[str]) -> tuple[str, ...]:
    """``env_keys`` as a tuple of key names; ``TypeError`` for one string (it would be
    taken letter by letter) or for anything that is not a string."""
    if isinstance(env_keys, (str, bytes)):
        raise TypeError(f"fingerprint: env_keys is a list of key names, not one string "
                        f"({env_keys!r}: write [{env_keys!r}])")
    keys = tuple(env_keys)
    bad = [k for k in keys if not isinstance(k, str)]
    if bad:
        raise TypeError(f"fingerprint: env_keys must be strings, not {type(bad[0]).__name__}")
    return keys


def _path_arg(what: str, value: str | os.PathLike[str]) -> str:
    """``value`` as a str path; ``TypeError`` naming ``what`` for anything else (bytes
    too: the manifest path and root are text, like the rest of the configuration)."""
    try:
        text = os.fspath(value)
    except TypeError:
        raise TypeError(f"fingerprint: {what} must be a path (str or os.PathLike), not "
                        f"{type(value).__name__}") from None
    if not isinstance(text, str):
        raise TypeError(f"fingerprint: {what} must be a str path, not {type(text).__name__}")
    return text


def fingerprint(
    env_keys: Iterable[str] = (),
    root: str | os.PathLike[str] = "/",
    *,
    nvidia_smi: bool | None = None,
    metadata: bool | None = None,
    salt: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The manifest of what a restore depends on, as a JSON-serialisable dict.

    ``env_keys``: environment keys whose values must match (stored as salted hashes,
    never in clear). ``root``: where ``proc/…`` is read (tests point it at a fake tree).
    ``nvidia_smi``: ask ``nvidia-smi`` for GPUs (and the driver when
    ``/proc/driver/nvidia/version`` is absent); ``metadata``: ask the GCE metadata server
    for the machine type (both default to True only for the real root). ``platform``
    holds the node facts ``rehydrate doctor`` judges (``rehydrate._nodefit.facts``). No
    per-process field is included.
    """
    import hashlib
    import platform
    import secrets
    from pathlib import Path

    from ._nodefit import facts

    env_keys = _key_names(env_keys)
    r = Path(root)
    real = r == Path("/")
    env = os.environ if environ is None else environ
    salt = salt if salt is not None else secrets.token_hex(8)
    dists = distributions()
    node = facts(metadata=real if metadata is None else metadata,
                 nvidia_smi=real if nvidia_smi is None else nvidia_smi, root=os.fspath(r))
    manifest: dict[str, Any] = {
        "schema": SCHEMA,
        "arch": platform.machine(),
        **_cpu(r),
        "kernel_release": _kernel_release(r),
        "gvisor": node.gvisor,
        "gvisor_version": node.gvisor_version,
        "gpu_driver": _gpu_driver(r, node),
        "machine_series": node.machine_series,
        "platform": node.to_dict(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "distributions": "sha256:" + hashlib.sha256("\n".join(dists).encode()).hexdigest(),
        "distributions_count": len(dists),
        "env": {"salt": salt,
                "keys": {k: _hash_env(salt, k, env.get(k)) for k in sorted(set(env_keys))}},
    }
    return manifest


# -- comparing -----------------------------------------------------------------------


# The type every compared field must have (``None``: the value may be null). A manifest
# missing one of them, or holding another type, is invalid — never "compatible".
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "arch": (str,),
    "cpu_vendor": (str, type(None)),
    "cpu_model": (str, type(None)),
    "cpu_flags": (list,),
    "kernel_release": (str,),
    "gvisor": (bool,),
    "gvisor_version": (str, type(None)),
    "gpu_driver": (str, type(None)),
    "python": (str,),
    "python_implementation": (str,),
    "distributions": (str,),
    "machine_series": (str, type(None)),
}
assert set(_FIELD_TYPES) == set(_COMPARED)


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _validate(manifest: Any) -> dict[str, Any]:
    """``manifest`` as a dict when it is a complete schema-1 manifest, else :class:`ManifestError`.

    Every compared field and ``env`` (``{"salt": str, "keys": {str: str | null}}``) must
    be present with its type: a truncated or hand-edited manifest must not pass ``check``.
    """
    if not isinstance(manifest, Mapping):
        raise ManifestError(f"not a rehydrate manifest: a JSON {_type_name(manifest)}, "
                            "not an object")
    schema = manifest.get("schema")
    if type(schema) is not int or schema != SCHEMA:
        # At most 60 characters of it: the line is printed, and the file may hold 1 MB.
        shown = repr(schema)
        shown = shown if len(shown) <= 60 else shown[:59] + "…"
        raise ManifestError(f"not a rehydrate manifest (schema {SCHEMA}): schema is {shown}")
    problems: list[str] = []
    missing = [f for f in (*_COMPARED, "env") if f not in manifest and f not in _OPTIONAL]
    if missing:
        problems.append("missing field(s) " + ", ".join(missing))
    for f, types_ in _FIELD_TYPES.items():
        if f not in manifest:
            continue
        v = manifest[f]
        if f == "cpu_flags":
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                problems.append(f"'cpu_flags' must be a list of strings, not {_type_name(v)}"
                                + (" with other items" if isinstance(v, list) else ""))
        elif not isinstance(v, types_):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types_)
            problems.append(f"'{f}' must be {want}, not {_type_name(v)}")
    env = manifest.get("env")
    if "env" in manifest:
        if not isinstance(env, Mapping):
            problems.append(f"'env' must be an object, not {_type_name(env)}")
        else:
            if not isinstance(env.get("salt"), str):
                problems.append(f"'env.salt' must be str, not {_type_name(env.get('salt'))}")
            keys = env.get("keys")
            if not isinstance(keys, Mapping):
                problems.append(f"'env.keys' must be an object, not {_type_name(keys)}")
            elif not all(isinstance(v, (str, type(None))) for v in keys.values()):
                problems.append("'env.keys' values must be hashes (str) or null")
    count = manifest.get("distributions_count")
    if count is not None and (type(count) is not int):
        problems.append(f"'distributions_count' must be int, not {_type_name(count)}")
    if problems:
        raise ManifestError("invalid rehydrate manifest: " + "; ".join(problems))
    return dict(manifest)


_MANIFEST_LIMIT = 1 << 20
"""The largest manifest file read (a real one is a few KB): a FIFO, device or huge file at
the configured path is an error, never a hang or a memory blow-up."""


def load_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a manifest file; :class:`ManifestError` when it cannot be used."""
    import json

    from ._files import read_regular

    try:
        data = json.loads(read_regular(path, _MANIFEST_LIMIT).decode())
    except RecursionError:
        raise ManifestError(f"cannot read manifest {os.fspath(path)}: not a manifest "
                            "(JSON nested too deeply)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"cannot read manifest {os.fspath(path)}: "
                            f"{type(exc).__name__}: {exc}") from exc
    try:
        return _validate(data)
    except ManifestError as exc:
        raise ManifestError(f"{os.fspath(path)}: {exc}") from None


def write_manifest(manifest: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``manifest`` atomically and durably (temporary file synced to disk, renamed
    over ``path``, then the directory synced): after a crash ``path`` holds the old
    manifest or the new one, never an empty or partial file. An error before the rename
    leaves the old one; a failed sync of the directory after it raises with the new one in
    place (not yet durable)."""
    import json
    import secrets
    from pathlib import Path

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    # A new file of a random name (O_EXCL): a symlink planted at a predictable temporary
    # name would have the manifest written through it. Owner-only when it holds salted
    # hashes of environment values (a low-entropy value is found by guessing against
    # them), else 0o644; both less the umask.
    env = manifest.get("env")
    mode = 0o600 if isinstance(env, Mapping) and env.get("keys") else 0o644
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            # On disk before the rename: a crash after it could otherwise leave the new
            # name on an empty file (the rename reached the journal, the data did not).
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_dir(p.parent)


# A filesystem that cannot sync a directory (EINVAL: some FUSE and network ones) or a
# directory writable but not readable (EACCES on the open): nothing more can be done.
_DIR_SYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EACCES})


def _sync_dir(directory: Path) -> None:
    """Sync ``directory`` so that a rename in it survives a crash (the new entry is
    directory data, not the file's)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno not in _DIR_SYNC_UNSUPPORTED:
            raise
        log.debug("cannot sync directory %s (%s): the manifest's rename is not synced",
                  directory, os.strerror(exc.errno or 0))


def _check_scope(scope: object) -> None:
    # A misspelt scope ("nodes") compared everything: a DaemonSet checker then reported
    # every node incompatible (its own Python and packages) without saying why.
    if scope not in ("all", "node"):
        raise ValueError(f"fingerprint: scope must be 'all' or 'node', "
                         f"not {_config.shown(scope)}")


def compare(expected: Mapping[str, Any], actual: Mapping[str, Any], *,
            scope: Scope = "all") -> list[Mismatch]:
    """Every field where ``actual`` (this node) cannot restore ``expected``'s snapshot.

    CPU flags mismatch only when the snapshot's node had flags this one lacks (extra
    flags are harmless); ``expected`` lists the missing ones. Environment keys compare
    by hash (``actual`` must be computed with the manifest's salt, as :func:`check` does).
    The machine series compares only when both sides know it (on GCE).
    ``scope="node"``: only :data:`NODE_FIELDS` (no Python, distributions or ``env.*``).
    """
    _check_scope(scope)
    out: list[Mismatch] = []
    for f in _COMPARED:
        if f not in expected or (scope == "node" and f not in NODE_FIELDS):
            continue
        e, a = expected.get(f), actual.get(f)
        if f == "machine_series" and (e is None or a is None):
            continue
        if f == "cpu_flags":
            missing = sorted(set(e or ()) - set(a or ()))
            if missing:
                out.append(Mismatch(f, missing, []))
        elif e != a:
            out.append(Mismatch(f, e, a))
    if scope == "node":
        return out
    e_env = (expected.get("env") or {}).get("keys") or {}
    a_env = (actual.get("env") or {}).get("keys") or {}
    for k in sorted(e_env):
        if e_env[k] != a_env.get(k):
            # Only whether the key is set: a salted hash (its salt is in the manifest)
            # of a low-entropy value ("true", a short PIN) is guessed offline, and a
            # mismatch goes to status(), `rehydrate check --json`, logs and reports.
            out.append(Mismatch(f"env.{k}", _presence(e_env[k]), _presence(a_env.get(k))))
    return out


def _presence(digest: object) -> str:
    return "unset" if digest is None else "set"


def _public_view(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` as rehydrate shows it (``status()["fingerprint"]["manifest"]``): the
    ``env`` part is the key names only — no salt, no hashes of values."""
    out = dict(manifest)
    env = manifest.get("env")
    if isinstance(env, Mapping):
        keys = env.get("keys")
        out["env"] = {"keys": sorted(keys) if isinstance(keys, Mapping) else []}
    return out


def check(
    manifest: Mapping[str, Any], root: str | os.PathLike[str] = "/",
    *, nvidia_smi: bool | None = None, metadata: bool | None = None,
    scope: Scope = "all", environ: Mapping[str, str] | None = None,
) -> list[Mismatch]:
    """Compare ``manifest`` with this node (empty list: compatible).

    ``scope="node"``: only what a checker running elsewhere on the node (a DaemonSet)
    shares with the workload — not its Python, distributions or environment; with
    ``environ`` (the workload's environment, given explicitly) the ``env.*`` keys too.
    ``environ``: the workload's environment for the ``env.*`` keys (default: this
    process's). ``metadata`` (default): ask the GCE metadata server only when the
    manifest records a machine series. :class:`ManifestError` when ``manifest`` is not a
    complete manifest.
    """
    from pathlib import Path

    _check_scope(scope)  # before the node is examined (nvidia-smi, metadata server)
    m = _validate(manifest)
    env = m["env"]
    if metadata is None:
        # The machine series compares only when both sides know it, so a snapshot taken
        # off GCE never needs the metadata server — where nothing answers, asking would
        # add its whole timeout to every restore.
        metadata = m.get("machine_series") is not None and Path(root) == Path("/")
    current = fingerprint(env_keys=env["keys"].keys(), root=root, nvidia_smi=nvidia_smi,
                          metadata=metadata, salt=env["salt"], environ=environ)
    if scope == "node" and environ is not None:
        # The workload's environment was given: the checker's own is not what is
        # compared any more, so the env.* keys are the workload's to check (ignoring
        # them said "compatible" for a workload missing a key the snapshot needs).
        return compare(m, current, scope="node") + [
            x for x in compare(m, current) if x.field.startswith("env.")]
    return compare(m, current, scope=scope)


def most_likely_reason(mismatches: list[Mismatch]) -> tuple[str | None, str]:
    """(field, one-line reason) for a snapshot miss, from a manifest diff."""
    if not mismatches:
        return None, ("this node matches the manifest: the snapshot was probably not found "
                      "(deleted, expired by retention, or the Pod spec changed)")
    first = mismatches[0]  # compare() lists fields most likely to explain a miss first
    more = f" (+{len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
    return first.field, first.describe() + more


# -- the manager ---------------------------------------------------------------------


def _env_flag(name: str) -> bool:
    return bool(_config.flag(name))


class FingerprintManager:
    """Per-engine manifest writing, checking after restore, and miss detection."""

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)
        self.path: Path | None = None
        self.env_keys: tuple[str, ...] = ()
        self.strict = False
        self.expect_restore = False
        self.root = "/"
        self.manifest: dict[str, Any] | None = None
        """The manifest written before the last snapshot (kept in memory across restore)."""
        self.mismatches: list[Mismatch] = []
        self.compatible: bool | None = None
        self.snapshot_miss: dict[str, Any] | None = None
        self._miss_checked = False
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        engine.builtins.register(self._save, event="snapshot", phase=Phase.ENVIRONMENT,
                                 order=-1_000_000, name="rehydrate.fingerprint.save",
                                 required=False, timeout=15.0)
        self._check_hook = engine.builtins.register(
            self._check_after_restore, event="restore", phase=Phase.ENVIRONMENT,
            order=-900_000, name="rehydrate.fingerprint.check", required=False, timeout=15.0)
        engine.add_status("fingerprint", self.status)
        _managed.add(engine)

    def configure(self, *, path: str | os.PathLike[str] | None = None,
                  env_keys: Iterable[str] | None = None, strict: bool | None = None,
                  expect_restore: bool | None = None,
                  root: str | os.PathLike[str] | None = None) -> FingerprintManager:
        # Everything is checked before anything changes: a bad argument leaves the
        # manager (and its registered check hook) as it was.
        keys = None if env_keys is None else _key_names(env_keys)
        for what, value in (("strict", strict), ("expect_restore", expect_restore)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"fingerprint: {what} must be True or False, not "
                                f"{type(value).__name__}")
        new_path = None if path is None else _path_arg("path", path)
        new_root = None if root is None else _path_arg("root", root)
        if new_path is not None:
            from pathlib import Path

            self.path = Path(new_path)
        if keys is not None:
            self.env_keys = keys
        if new_root is not None:
            self.root = new_root
        if expect_restore is not None:
            self.expect_restore = expect_restore
        if strict is not None and strict != self.strict:
            self.strict = strict
            engine = self._engine()
            if engine is not None:  # re-register the check hook as (not) required
                engine.builtins.unregister(self._check_hook)
                self._check_hook = engine.builtins.register(
                    self._check_after_restore, event="restore", phase=Phase.ENVIRONMENT,
                    order=-900_000, name="rehydrate.fingerprint.check", required=strict,
                    timeout=15.0)
        return self

    def status(self) -> dict[str, Any]:
        return {
            "path": os.fspath(self.path) if self.path else None,
            "strict": self.strict,
            "manifest": None if self.manifest is None else _public_view(self.manifest),
            "compatible": self.compatible,
            "mismatches": [m.to_dict() for m in self.mismatches],
            "snapshot_miss": self.snapshot_miss,
        }

    # hooks
    def _save(self) -> None:
        manifest = fingerprint(self.env_keys, self.root)
        with self._lock:
            self.manifest = manifest
        if self.path is not None:
            write_manifest(manifest, self.path)
            log.info("snapshot manifest written to %s", self.path)

    def _check_after_restore(self, ctx: RestoreContext) -> None:
        if ctx.kind != "restore":
            return  # a resume is the same process on the same node
        manifest = self.manifest
        if manifest is None and self.path is not None and self.path.exists():
            try:
                manifest = load_manifest(self.path)
            except ManifestError as exc:
                log.warning("fingerprint not checked after restore: %s", exc)
                return
        if manifest is None:
            log.debug("fingerprint not checked after restore: no manifest")
            return
        mismatches = check(manifest, self.root)
        self.mismatches = mismatches
        self.compatible = not mismatches
        if not mismatches:
            return
        text = "; ".join(m.describe() for m in mismatches)
        from . import telemetry

        telemetry.record_fingerprint_mismatch([m.field for m in mismatches],
                                              engine=self._engine())
        if self.strict:  # the engine logs the required hook's failure: its one line
            raise FingerprintMismatch(f"node differs from the snapshot manifest: {text}")
        log.warning("restored on a node that differs from the snapshot's: %s", text)

    # miss detection
    def detect_miss(self) -> dict[str, Any] | None:
        """At start (a cold start): report a snapshot miss when a restore was expected."""
        engine = self._engine()
        if engine is None or engine.generation != 0:
            return None
        by: str | None = None
        if self.expect_restore or _env_flag("REHYDRATE_EXPECT_RESTORE"):
            by = "REHYDRATE_EXPECT_RESTORE"
        elif self.path is not None and self.path.is_file():
            by = f"manifest {self.path}"
        elif self.path is not None and self.path.exists():
            log.warning("fingerprint: %s is not a file; no snapshot manifest is read from "
                        "it (check REHYDRATE_MANIFEST or configure(path=...))", self.path)
        if by is None:
            return None
        manifest: dict[str, Any] | None = None
        problem = None
        if self.path is not None and self.path.exists():
            try:
                manifest = load_manifest(self.path)
            except ManifestError as exc:
                problem = str(exc)
        if manifest is not None:
            mismatches = check(manifest, self.root)
            field, reason = most_likely_reason(mismatches)
        else:
            mismatches, field = [], None
            reason = ("no manifest to compare with "
                      f"({problem or 'none configured or found'}): cause unknown")
        self.snapshot_miss = {"expected_by": by, "field": field, "reason": reason,
                              "mismatches": [m.to_dict() for m in mismatches]}
        if manifest is not None:
            self.compatible = not mismatches
            self.mismatches = mismatches
        log.warning("snapshot-miss: a restore was expected (%s) but the process started "
                    "cold; most likely reason: %s", by, reason)
        from . import telemetry

        telemetry.record_snapshot_miss(reason, field, [m.field for m in mismatches],
                                       engine=engine)
        return self.snapshot_miss


_managed: weakref.WeakSet[Engine] = weakref.WeakSet()


def configure(
    *,
    path: str | os.PathLike[str] | None = None,
    env_keys: Iterable[str] | None = None,
    strict: bool | None = None,
    expect_restore: bool | None = None,
    root: str | os.PathLike[str] | None = None,
    engine: Engine | None = None,
) -> FingerprintManager:
    """Enable manifest writing (before snapshot), checking (after restore), miss detection.

    ``path``: where the manifest is written before a snapshot and read at start (put it on
    a volume that outlives the Pod to detect misses by its presence); without it the
    manifest is only kept in memory and shown (environment key names only) in
    ``status()["fingerprint"]["manifest"]``.
    ``strict``: a node mismatch after restore fails the required
    ``rehydrate.fingerprint.check`` hook (the process stays ``degraded``).
    """
    return manager(engine).configure(path=path, env_keys=env_keys, strict=strict,
                         expect_restore=expect_restore, root=root)


def manager(engine: Engine | None = None) -> FingerprintManager:
    """The fingerprint manager of ``engine`` (default: the process-wide engine), created
    (with its hooks) on first use; :func:`configure` also configures it."""
    return resolve_engine(engine).extension("fingerprint", FingerprintManager)


key = "fingerprint"


def probe() -> Probe:
    """Always usable; it does nothing until configured (or ``REHYDRATE_MANIFEST`` is set)."""
    return Probe(True)


def install(engine: Engine) -> None:
    """Run :func:`engine_started` when ``engine`` starts; the manager itself (its hooks)
    is created only by :func:`configure` or the environment."""
    engine.add_start_listener(engine_started)


def engine_started(engine: Engine) -> None:
    """Start listener: environment configuration and miss detection."""
    path = _config.text("REHYDRATE_MANIFEST")
    env_keys = _config.items("REHYDRATE_FINGERPRINT_ENV")
    strict = _env_flag("REHYDRATE_FINGERPRINT_STRICT")
    if path or _env_flag("REHYDRATE_EXPECT_RESTORE"):
        configure(path=path or None, env_keys=env_keys or None, strict=strict or None,
                  engine=engine)
    elif env_keys or strict:
        # Read only with one of those: alone they configure nothing, and a check the
        # operator thinks is on would silently pass.
        log.warning("fingerprint: %s set without REHYDRATE_MANIFEST or "
                    "REHYDRATE_EXPECT_RESTORE: ignored (set one of those, or call "
                    "rehydrate.fingerprint.configure())",
                    " and ".join(n for n, on in (("REHYDRATE_FINGERPRINT_ENV", env_keys),
                                                 ("REHYDRATE_FINGERPRINT_STRICT", strict))
                                 if on))
    if engine not in _managed:
        return
    mgr = engine.extension("fingerprint", FingerprintManager)
    with mgr._lock:
        if mgr._miss_checked:
            return
        mgr._miss_checked = True
    try:
        mgr.detect_miss()
    except Exception:
        log.exception("snapshot-miss detection failed")


def _read_workload_env(path: str) -> dict[str, str]:
    """A workload's environment from ``path``: ``KEY=VALUE`` entries separated by NULs
    (``/proc/PID/environ``, gVisor's ``spec_environ``) or by newlines (``env`` output)."""
    from ._files import read_regular
    from .env import MAX_ENVIRON_BYTES, EnvError, parse_environ

    try:  # not blocking on a FIFO (it waited for a writer for ever); /proc files are regular
        data = bytes(read_regular(path, MAX_ENVIRON_BYTES + 1,  # one more: larger is refused
                                  truncate=True))
    except OSError as exc:
        raise ManifestError(f"cannot read environment file {path}: "
                            f"{exc.strerror or exc}") from None
    try:
        parsed = parse_environ(data)
    except EnvError as exc:
        raise ManifestError(f"environment file {path}: {exc}") from None
    return {k.decode("utf-8", "surrogateescape"): v.decode("utf-8", "surrogateescape")
            for k, v in parsed.items()}


class _CallableModule(types.ModuleType):
    """Makes ``rehydrate.fingerprint(...)`` (the contract's spelling) call :func:`fingerprint`
    while ``rehydrate.fingerprint.check`` & co. stay reachable on the module."""

    def __call__(self, env_keys: Iterable[str] = (),
                 root: str | os.PathLike[str] = "/", **kwargs: Any) -> dict[str, Any]:
        return fingerprint(env_keys, root, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
