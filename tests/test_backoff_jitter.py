"""Retry jitter must come from the OS, not from the module-level ``random``.

A library that draws its jitter from ``random`` advances the application's seeded stream
(a reconnect would change a reproducible simulation's numbers) and, in clones restored
from one snapshot, every copy would retry in lockstep until the entropy hook reseeds.
"""

from __future__ import annotations

import random

import pytest

from rehydrate._runner import backoff_delay as runner_backoff
from rehydrate.adapters.agones import _backoff as agones_backoff
from rehydrate.connections import backoff_delay as connection_backoff

BACKOFFS = {
    "runner": runner_backoff,
    "connections": lambda attempt: connection_backoff(attempt + 1),
    "agones": lambda attempt: agones_backoff(attempt + 1, 5.0),
}


@pytest.mark.parametrize("name", sorted(BACKOFFS))
def test_backoff_leaves_the_applications_random_stream_alone(name: str) -> None:
    random.seed(1234)
    state = random.getstate()
    delays = [BACKOFFS[name](attempt % 6) for attempt in range(200)]
    assert random.getstate() == state
    assert len(set(delays)) > 100, "jitter still varies"


@pytest.mark.parametrize("name", sorted(BACKOFFS))
def test_backoff_jitter_differs_even_when_the_module_generator_is_reset(name: str) -> None:
    """Two clones share the module generator's state; their jitter must still differ."""
    random.seed(99)
    first = [BACKOFFS[name](3) for _ in range(20)]
    random.seed(99)
    second = [BACKOFFS[name](3) for _ in range(20)]
    assert first != second
