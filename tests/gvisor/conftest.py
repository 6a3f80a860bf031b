"""Fixtures for the real-gVisor tests.

``gvisor``: a :class:`~.harness.GVisorHarness` for one test, torn down (every
container killed and deleted) afterwards. When runsc cannot be used here the
test is skipped with the reason, or fails if ``REHYDRATE_REQUIRE_GVISOR=1``.
On failure the runsc debug logs and container output are attached to the
report (section "gvisor").
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .harness import GVisorHarness, find_runsc, runsc_available

_HARNESS_KEY = pytest.StashKey[GVisorHarness]()
_SKIPPED: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gvisor: runs workloads under real gVisor runsc (needs root and runsc)")


def _require() -> bool:
    return os.environ.get("REHYDRATE_REQUIRE_GVISOR", "") not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def runsc_path() -> str:
    """The runsc binary the gVisor tests use; skips (or fails) when unusable."""
    reason = runsc_available()
    if reason is not None:
        if _require():
            pytest.fail(f"REHYDRATE_REQUIRE_GVISOR=1 but gVisor is unusable: {reason}", pytrace=False)
        _SKIPPED.append(reason)
        pytest.skip(f"GVISOR TESTS SKIPPED: {reason} (set REHYDRATE_REQUIRE_GVISOR=1 to fail instead)")
    path = find_runsc()
    assert path is not None
    return path


@pytest.fixture
def gvisor(runsc_path: str, tmp_path, request: pytest.FixtureRequest) -> Iterator[GVisorHarness]:
    harness = GVisorHarness(tmp_path / "gvisor", runsc=runsc_path)
    request.node.stash[_HARNESS_KEY] = harness
    try:
        yield harness
    finally:
        harness.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    harness = item.stash.get(_HARNESS_KEY, None)
    if harness is not None and report.failed and report.when in ("setup", "call"):
        try:
            report.sections.append(("gvisor", harness.describe()))
        except Exception as exc:  # noqa: BLE001 - diagnostics must not hide the failure
            report.sections.append(("gvisor", f"could not collect runsc logs: {exc}"))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
    if _SKIPPED:
        terminalreporter.write_sep("!", "gVisor tests were SKIPPED", red=True, bold=True)
        terminalreporter.write_line(_SKIPPED[0])
