"""Shared test setup. The tests are grouped like the code:

* ``tests/test_*.py`` — the engine and its contract: hooks, lifecycle, runner, extensions,
  configuration, layering, public API, CLI, leaks, fork safety;
* ``tests/detect/`` — one file per detector (named after its catalogue key) plus selection;
* ``tests/managers/`` — one file per built-in manager (env, entropy, keys, tls, secrets,
  connections, routes, telemetry, fingerprint, files);
* ``tests/adapters/`` — one file per adapter (asgi, vllm, sglang, kserve, agones, …);
* ``tests/gvisor/`` — real ``runsc`` checkpoint/restore (root; see its conftest.py).

Helpers shared across groups (``detect_helpers``, ``netservers``, the stand-ins) live in
``tests/`` itself, importable from every group.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:  # the helper modules, from tests/<group>/ too
    sys.path.insert(0, _TESTS)


@pytest.fixture(autouse=True)
def _config_warnings_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees a bad ``REHYDRATE_*`` value warned about: the configuration warns
    once per process for each (a value read at every event), whatever test read it first."""
    from rehydrate import _config

    monkeypatch.setattr(_config, "_WARNED_ENTRIES", set())
    monkeypatch.setattr(_config, "_WARNED_VALUES", set(), raising=False)


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port every connect to is refused, reserved for the test (see
    :func:`netservers.refused_port`)."""
    from netservers import refused_port as reserve

    with reserve() as port:
        yield port


@pytest.fixture
def root_required() -> None:
    """Root only (files or clients of another uid): skipped as a user, a failure where
    ``REHYDRATE_REQUIRE_ROOT_TESTS=1`` (CI) says root is there."""
    if os.geteuid() != 0:
        if os.environ.get("REHYDRATE_REQUIRE_ROOT_TESTS") == "1":
            pytest.fail("REHYDRATE_REQUIRE_ROOT_TESTS=1 but not running as root")
        pytest.skip("needs root (files or clients of another uid)")
