"""Why an engine is not ready, in one line: what readiness endpoints and 503 bodies show."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..extensions import Probe, resolve_engine

if TYPE_CHECKING:
    from .. import Status
    from ..extensions import Engine

__all__ = ["not_ready_reason", "probe_import", "reason_of"]


def not_ready_reason(engine: Engine | None = None) -> str:
    """One line saying why ``engine`` (default: the default engine) is not ready, or ``""``.

    What readiness probes and 503 bodies show: the state and, when degraded, which
    required hooks failed and how (error types and messages only — never values from the
    environment, which hooks do not put in their errors).
    """
    return reason_of(resolve_engine(engine).status())


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
