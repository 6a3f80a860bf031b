"""The check shared by the vLLM and SGLang adapters' redaction tests: a key that a gateway
echoes back is shown nowhere (not a test module)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest

from rehydrate.adapters import not_ready_reason
from rehydrate.adapters._server import ServerError
from tests.inference_standins import API_KEY, EchoingGateway


def assert_the_key_is_shown_nowhere(
        engine: Any, adapter: Any, gateway: EchoingGateway,
        caplog: pytest.LogCaptureFixture, call: Callable[[], object],
        error: type[ServerError]) -> tuple[Any, Any]:
    """With ``adapter`` installed on ``engine`` behind ``gateway``: a snapshot, a restore,
    ``call()`` (which must raise ``error``) and a probe, logged at DEBUG. The gateway saw
    the key every time (so it was there to echo), yet the log, /readyz's reason, the
    status, the error and its reason, the probe's reason and the reports carry none of
    it, and the error says where it was cut. Returns the snapshot's and the restore's
    reports, whose outcome depends on the adapter."""
    caplog.set_level(logging.DEBUG)
    snap = engine.simulate_snapshot()
    report = engine.simulate_restore()
    with pytest.raises(error) as raised:
        call()
    probe = adapter.probe()
    assert gateway.seen and all(API_KEY in seen for seen in gateway.seen)  # it was echoed
    shown = {"log": caplog.text, "not ready": not_ready_reason(engine),
             "status": json.dumps(engine.status().to_dict(), default=str),
             "error": str(raised.value), "reason": raised.value.reason,
             "probe": probe.reason, "reports": snap.table() + report.table()}
    assert {what: text for what, text in shown.items() if API_KEY[:4] in str(text)} == {}
    assert "[redacted]" in str(raised.value)
    return snap, report
