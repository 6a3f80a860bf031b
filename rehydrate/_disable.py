"""``REHYDRATE_DISABLE``: switch built-in identity managers off (tests' control cases).

``REHYDRATE_DISABLE`` is a comma-separated list of manager or phase names: ``entropy``,
``keys``, ``tls``, ``secrets`` (``secrets`` names the whole ``SECRETS`` phase: keys, TLS
certificates and :class:`~rehydrate.secrets.Secret` values). ``all`` disables every one.
It is read each time a hook runs, after the environment refresh, so a clone's new
environment can set it too.
"""

from __future__ import annotations

from . import _config

__all__ = ["is_disabled"]


def is_disabled(*names: str) -> bool:
    """True when any of ``names`` (or ``all``) is listed in ``$REHYDRATE_DISABLE``."""
    raw = _config.items("REHYDRATE_DISABLE")
    if not raw:
        return False
    listed = {part.lower() for part in raw}
    return "all" in listed or any(n in listed for n in names)
