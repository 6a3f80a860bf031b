"""Fixtures for the real-gVisor tests.

``gvisor``: a :class:`~.harness.GVisorHarness` for one test, torn down (every
container killed and deleted) afterwards, even when the test fails.
``gvisor_uncompressed``: the same, with a runsc that supports
``checkpoint --compression=none`` (trixie's), for grepping memory images.

When runsc cannot be used here the test is skipped with the reason (and a
banner at the end of the run), or fails if ``REHYDRATE_REQUIRE_GVISOR=1``.
On failure the runsc debug logs and container output are attached to the
report (section "gvisor").
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from .harness import (
    DEFAULT_RUNSC_CANDIDATES,
    GVisorHarness,
    find_runsc,
    runsc_available,
    supports_uncompressed_checkpoint,
)

_HARNESS_KEY = pytest.StashKey[GVisorHarness]()
_SKIP_REASONS: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gvisor: needs root and runsc (real checkpoint/restore)")


def gvisor_required() -> bool:
    return os.environ.get("REHYDRATE_REQUIRE_GVISOR", "").lower() not in ("", "0", "false", "no")


def unusable(reason: str) -> NoReturn:
    """Skip loudly, or fail when REHYDRATE_REQUIRE_GVISOR=1."""
    if gvisor_required():
        pytest.fail(f"REHYDRATE_REQUIRE_GVISOR=1 but gVisor is unusable: {reason}", pytrace=False)
    if reason not in _SKIP_REASONS:
        _SKIP_REASONS.append(reason)
    pytest.skip(f"GVISOR TEST SKIPPED: {reason} (REHYDRATE_REQUIRE_GVISOR=1 makes this a failure)")


@pytest.fixture(scope="session")
def runsc_path() -> str:
    """The runsc binary the gVisor tests use (probed once per session)."""
    reason = runsc_available()
    if reason is not None:
        unusable(reason)
    path = find_runsc()
    assert path is not None
    return path


@pytest.fixture(scope="session")
def runsc_uncompressed_path(runsc_path: str) -> str:
    """A runsc with ``checkpoint --compression=none``."""
    if supports_uncompressed_checkpoint(runsc_path):
        return runsc_path
    for cand in DEFAULT_RUNSC_CANDIDATES:
        path = find_runsc(cand)
        if path and supports_uncompressed_checkpoint(path) and runsc_available(path) is None:
            return path
    unusable(
        f"no runsc with checkpoint --compression=none ({runsc_path} lacks it); "
        "run scripts/install-runsc.sh"
    )


def _harness(request: pytest.FixtureRequest, workdir: Path, runsc: str) -> Iterator[GVisorHarness]:
    harness = GVisorHarness(workdir, runsc=runsc)
    request.node.stash[_HARNESS_KEY] = harness
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture
def gvisor(
    runsc_path: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[GVisorHarness]:
    yield from _harness(request, tmp_path / "gvisor", runsc_path)


@pytest.fixture
def gvisor_uncompressed(
    runsc_uncompressed_path: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[GVisorHarness]:
    yield from _harness(request, tmp_path / "gvisor", runsc_uncompressed_path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    harness = item.stash.get(_HARNESS_KEY, None)
    if harness is not None and report.failed and report.when in ("setup", "call"):
        try:
            report.sections.append(("gvisor", harness.describe()))
        except Exception as exc:  # noqa: BLE001 - diagnostics must not hide the failure
            report.sections.append(("gvisor", f"could not collect runsc logs: {exc}"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _SKIP_REASONS:
        terminalreporter.write_sep("!", "gVisor tests were SKIPPED", red=True, bold=True)
        for reason in _SKIP_REASONS:
            terminalreporter.write_line(reason)
