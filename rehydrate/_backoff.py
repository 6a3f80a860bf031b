"""Exponential backoff with jitter: how long the engine and the managers wait between
retries (a hook's ``retries``, a connection that does not reopen yet)."""

from __future__ import annotations

import random

__all__ = ["backoff_delay"]

# The OS's generator, not the module-level one: a library must not advance the
# application's seeded ``random`` stream, and clones restored from one snapshot share that
# stream's state, so they would retry in lockstep.
_JITTER = random.SystemRandom()


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Seconds before retry ``attempt`` (0-based): uniform in [d/2, d], where
    d = min(cap, base * 2**attempt)."""
    d: float = min(cap, base * 2.0 ** min(max(attempt, 0), 64))
    return d / 2 + _JITTER.uniform(0, d / 2)
