"""Why an engine is not ready, in one line: what readiness endpoints and 503 bodies show."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..extensions import Probe, resolve_engine

if TYPE_CHECKING:
    from .. import Status
    from ..extensions import Engine

__all__ = ["not_ready_reason", "probe_import", "readiness", "reason_of"]


def not_ready_reason(engine: Engine | None = None) -> str:
    """One line saying why ``engine`` (default: the default engine) is not ready, or ``""``.

    What readiness probes and 503 bodies show: the state and, when degraded, which
    required hooks failed and how (error types and messages only — never values from the
    environment, which hooks do not put in their errors).
    """
    return reason_of(resolve_engine(engine).status())


def readiness(engine: Engine) -> tuple[bool, str, str]:
    """``(ready, state, reason)`` as ``engine.status()`` and :func:`reason_of` give them,
    without building a whole status while a restore runs: its diagnostic fields (the
    ``/proc`` scan of TCP connections, ...) cost milliseconds per call under gVisor, and a
    gate answers every request that arrives during the restore — on the event loop and
    under the GIL that the restore hooks need."""
    if engine.is_ready():
        return True, engine.state, ""
    state = engine.state
    if state in ("running", "ready", "restoring"):  # frozen and resumed, or hooks running
        return False, "restoring", "restore hooks are running"
    status = engine.status()  # snapshotting / degraded: the reason needs the last report
    return status.ready, status.state, reason_of(status)


def reason_of(status: Status) -> str:
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
                error = h.to_dict()["error"]  # "Type: message" on one line
                parts.append(f"{h.name} {h.outcome}" + (f" ({error})" if error else ""))
            reason = f"{last.event} hook(s) failed: " + "; ".join(parts)
    return reason


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
