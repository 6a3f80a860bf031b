"""Every adapter's ``engine=``: something that is no engine is a one-line TypeError
naming it, raised before anything is attached, bound or marked.

The journey that found it: ``rehydrate.extensions.default_engine`` is a *function*
(``rehydrate.default_engine`` the engine object); given uncalled, each adapter failed later
with an AttributeError from its own insides (``'function' object has no attribute
'builtins'``), and a UdpEndpoint was left bound with no restore hook.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from rehydrate import extensions
from rehydrate.adapters import kserve, sglang, vllm
from rehydrate.adapters.agones import AgonesAdapter
from rehydrate.adapters.asgi import ReadinessGate, health_app
from rehydrate.adapters.gameloop import TickClock
from rehydrate.adapters.sessions import MatchSessions
from rehydrate.adapters.udp import UdpEndpoint

WRONG = extensions.default_engine  # the function, not the engine it returns
SAID = ("engine must be a rehydrate engine (a rehydrate.Lifecycle, e.g. "
        "rehydrate.default_engine) or None, not <function default_engine")


async def _app(scope: Any, receive: Any, send: Any) -> None: ...


USES: dict[str, Callable[[], object]] = {
    "ReadinessGate": lambda: ReadinessGate(_app, engine=WRONG),  # type: ignore[arg-type]
    "health_app": lambda: health_app(engine=WRONG),  # type: ignore[arg-type]
    "TickClock": lambda: TickClock(60, engine=WRONG),  # type: ignore[arg-type]
    "MatchSessions": lambda: MatchSessions(engine=WRONG),  # type: ignore[arg-type]
    "vllm.install": lambda: vllm.install("http://127.0.0.1:1", engine=WRONG),  # type: ignore[arg-type]
    "VLLMAdapter.install": lambda: vllm.VLLMAdapter("http://127.0.0.1:1").install(WRONG),  # type: ignore[arg-type]
    "sglang.install": lambda: sglang.install("http://127.0.0.1:1", engine=WRONG),  # type: ignore[arg-type]
    "kserve.install": lambda: kserve.install(object(), engine=WRONG),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("use", list(USES.values()), ids=list(USES))
def test_an_adapter_given_the_default_engine_function_says_so(use: Callable[[], object]):
    with pytest.raises(TypeError) as exc:
        use()
    assert str(exc.value).startswith(SAID)
    assert "call it, or pass rehydrate.default_engine" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_an_agones_adapter_with_a_wrong_engine_is_not_left_marked_installed():
    """install() marked the adapter installed before resolving the engine: after the
    TypeError every later install() returned at once, doing nothing."""
    a = AgonesAdapter(1, 60.0, engine=WRONG)  # type: ignore[arg-type]
    try:
        for _ in range(2):
            with pytest.raises(TypeError, match="^engine must be a rehydrate engine"):
                a.install()
        assert a.engine is None
    finally:
        a.close()


async def test_a_udp_endpoint_with_a_wrong_engine_binds_nothing():
    """start() bound the socket, then failed resolving the engine: a socket bound with no
    restore hook, and the next start() said "already started"."""
    ep = UdpEndpoint(asyncio.DatagramProtocol, ("127.0.0.1", 0), name="wrong-engine",
                     engine=WRONG)  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(TypeError, match="^engine must be a rehydrate engine"):
            await ep.start()
        assert ep.transport is None and ep._hook is None
