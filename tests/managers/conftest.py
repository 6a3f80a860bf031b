"""Fixtures shared by the manager tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from netservers import Server, uvicorn_server


@pytest.fixture
def http_srv() -> Iterator[Server]:
    """A uvicorn server on loopback for the test, killed afterwards."""
    srv = uvicorn_server()
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()
