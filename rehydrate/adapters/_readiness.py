"""Why an engine is not ready, in one line: what readiness endpoints and 503 bodies show."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..extensions import Probe, redact, resolve_engine

if TYPE_CHECKING:
    from .. import Status
    from ..extensions import Engine

__all__ = ["not_ready_reason", "probe_import", "public_status", "readiness", "reason_of"]


def not_ready_reason(engine: Engine | None = None, *, detail: bool = True) -> str:
    """One line saying why ``engine`` (default: the default engine) is not ready, or ``""``.

    The state and, when degraded, which required hooks failed and how (error types and
    messages, as the hooks raised them: rehydrate's own put no environment values in
    theirs, an application's hook may). ``detail=False``: the failed hooks' names and
    outcomes without their error text — what the gate's ``/readyz`` and 503 bodies show
    to whoever reaches the port (an error message may name a secret file's path, an
    internal host, a rejected value).
    """
    return reason_of(resolve_engine(engine).status(fields=()), detail=detail)


def readiness(engine: Engine, *, detail: bool = False) -> tuple[bool, str, str]:
    """``(ready, state, reason)`` as ``engine.status()`` and :func:`reason_of` give them
    (the reason without error text unless ``detail``), without building the status's
    published fields: their diagnostics (the ``/proc`` scan of TCP connections, ...) cost
    milliseconds per call under gVisor, and a gate answers every request that arrives
    while the process is not ready — on the event loop and under the GIL that the
    restore hooks need."""
    if engine.is_ready():
        return True, engine.state, ""
    state = engine.state
    if state in ("running", "ready", "restoring"):  # frozen and resumed, or hooks running
        return False, "restoring", "restore hooks are running"
    # snapshotting / degraded: the reason needs the last report, and nothing published
    status = engine.status(fields=())
    return status.ready, status.state, reason_of(status, detail=detail)


def reason_of(status: Status, *, detail: bool = True) -> str:
    """:func:`not_ready_reason` for a :func:`rehydrate.status` already taken."""
    last = status.last_report
    if status.ready:
        reason = ""
    elif status.state == "restoring":
        reason = "restore hooks are running"
    elif status.state == "snapshotting":
        prepared = last is not None and last.kind == "snapshot" and last.ok
        reason = ("snapshot prepared; waiting for the restore or resume" if prepared
                  else "before-snapshot hooks are running")
    elif last is None:
        reason = status.state
    else:
        failed = [h for h in last.failed if h.required]
        reason = f"the last {last.event} did not succeed"
        if failed:
            parts = []
            for h in failed:
                error = h.to_dict()["error"] if detail else None  # "Type: message"
                parts.append(f"{h.name} {h.outcome}" + (f" ({error})" if error else ""))
            reason = f"{last.event} hook(s) failed: " + "; ".join(parts)
    return reason


def _connections(value: Any) -> Any:
    if not isinstance(value, list):
        return _UNAVAILABLE
    return [{k: c.get(k) for k in ("name", "state", "required", "attempts")}
            for c in value if isinstance(c, dict)]


def _secrets(value: Any) -> Any:
    if not isinstance(value, dict):
        return _UNAVAILABLE
    return {name: {"available": s.get("available")} for name, s in value.items()
            if isinstance(s, dict)}


def _keys(value: Any) -> Any:
    if not isinstance(value, dict):
        return _UNAVAILABLE
    return {name: {k: v.get(k) for k in ("algorithm", "generation", "dropped")}
            for name, v in value.items() if isinstance(v, dict)}


def _entropy(value: Any) -> Any:
    if not isinstance(value, dict):
        return _UNAVAILABLE
    return {"enabled": value.get("enabled"), "reseeded": value.get("reseeded")}


_UNAVAILABLE = "unavailable"
_PUBLIC_FIELDS: dict[str, Callable[[Any], Any]] = {
    "connections": _connections,
    "secrets": _secrets,
    "keys": _keys,
    "entropy": _entropy,
    "hung_hooks": lambda names: names if isinstance(names, list) else _UNAVAILABLE,
}
"""The published status fields the public view shows, each cut down to what says how
the process is doing (names, states, outcomes). An allowlist: a field not named here —
``tcp_connections`` (other clients' addresses), ``files`` (paths), ``control`` (the socket
path), ``tls``, ``network``, an application's own — is left out, and not even built."""


def public_status(engine: Engine) -> dict[str, Any]:
    """``engine.status().to_dict()`` as it may be shown to anyone who reaches the port:
    state, generation, readiness, detectors (a failed one's name, not its error), the
    last report's hooks with their names and outcomes (no error text, no environment
    variable names; its ``reason`` redacted of managed secrets), connections' names and
    states (no peers, addresses, sockets or errors), secrets' names and availability (no
    sources or paths), ephemeral keys, whether entropy was reseeded (not the instance
    id), hung hooks' names. Only these fields are built: no ``/proc`` scan per request."""
    status = engine.status(fields=_PUBLIC_FIELDS)
    report = status.last_report
    shown: dict[str, Any] = {
        "state": status.state,
        "generation": status.generation,
        "ready": status.ready,
        "detectors": list(status.detectors),
        "last_report": None,
    }
    if report is not None:
        full = report.to_dict()
        for key in ("env_changes", "error"):  # variable names; the run's error text
            full.pop(key, None)
        full["hooks"] = [{k: v for k, v in h.items() if k != "error"}
                         for h in full["hooks"]]
        if isinstance(full.get("reason"), str):
            # the caller's text (restore_detected(reason=...)): it may quote anything
            full["reason"] = redact(full["reason"])
        shown["last_report"] = full
    extra = status.extra
    if "detector_errors" in extra:
        shown["detector_errors"] = sorted(extra["detector_errors"])
    for key, cut in _PUBLIC_FIELDS.items():
        if key in extra:
            shown[key] = cut(extra[key])
    return shown


def probe_import(module: str, install: str) -> Probe:
    """Usable when ``module`` is importable (found, not imported: probing stays cheap)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return Probe(True)
    return Probe(False, f"{module} is not installed ({install})")
