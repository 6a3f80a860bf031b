"""``REHYDRATE_DISABLE``: switch built-in identity managers off (tests' control cases).

``REHYDRATE_DISABLE`` is a comma-separated list of manager or phase names: ``entropy``,
``keys``, ``tls``, ``secrets`` (``secrets`` names the whole ``SECRETS`` phase: keys, TLS
certificates and :class:`~rehydrate.secrets.Secret` values). ``all`` disables every one.
Any other entry (a typo: ``entrop``) is ignored with one warning line, once per entry,
that lists the accepted names; ``rehydrate doctor`` shows it as ignored.

It is read each time a manager's hook runs, from the process's environment as it is
then: what the process started with, what the application set in ``os.environ``, or a
``simulate_restore(env=...)`` overlay. A clone's refreshed environment file never sets
it: the refresh leaves every ``REHYDRATE_*`` key as the process started with it.
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
