"""Is this process inside a gVisor sandbox? The one check, for detectors, managers and the
platform facts alike (bottom layer: it imports nothing of rehydrate)."""

from __future__ import annotations

import os

__all__ = ["GVISOR_BUILD", "running_under_gvisor"]

GVISOR_BUILD = "Sun Jan 10 15:06:54 PST 2016"
"""The build date in gVisor's fixed fake ``/proc/version`` (``Linux version 4.4.0 #1 SMP
Sun Jan 10 15:06:54 PST 2016``)."""


def running_under_gvisor(root: str = "/", *, marker: str | None = None) -> bool:
    """Best-effort: is this process (or the tree at ``root``) inside a gVisor sandbox?

    Checks, cheapest first: the ``marker`` directory exists (default ``<root>/proc/gvisor``,
    present under runsc with application-driven checkpointing); ``/proc/version`` is
    gVisor's fixed fake; ``/proc/self/cgroup`` lists gVisor's own ``job`` controller.
    Verified with runsc 20240729, whose sandbox has no ``/proc/gvisor``.
    """
    if os.path.isdir(marker or os.path.join(root, "proc/gvisor")):
        return True
    try:
        with open(os.path.join(root, "proc/version"), encoding="utf-8",
                  errors="replace") as f:
            if GVISOR_BUILD in f.read(512):
                return True
    except OSError:
        pass
    try:
        with open(os.path.join(root, "proc/self/cgroup"), encoding="utf-8",
                  errors="replace") as f:
            return any(line.split(":")[1:2] == ["job"] for line in f.read(8192).splitlines())
    except OSError:
        return False
