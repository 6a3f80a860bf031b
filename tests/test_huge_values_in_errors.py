"""A caller's bad value in an error message: one readable line naming the parameter.

Validators formatted the value with ``repr()``: a huge int (``10**5000``) then raised
Python's own ``ValueError: Exceeds the limit (4300 digits) for integer string
conversion`` — naming neither the parameter nor the rule — instead of the error they
meant to give. Every one now goes through :func:`rehydrate._config.shown`. One case per
module that checks a caller's value; each also checks that nothing was registered.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

import rehydrate
from rehydrate import _config

H = 10**5000  # str(H) raises ValueError past sys.get_int_max_str_digits() (4300)


def test_shown_never_fails_on_a_huge_int_anywhere_in_the_value():
    assert _config.shown(H) == "1e+5000"
    assert _config.shown(-H) == "-1e+5000"
    assert _config.shown(("127.0.0.1", H)) == "('127.0.0.1', 1e+5000)"
    assert _config.shown([H]) == "[1e+5000]"
    assert _config.shown({"k": H}) == "{'k': 1e+5000}"

    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    assert _config.shown(Broken()).startswith("<Broken instance at")
    assert _config.shown("x" * 100) == repr("x" * 100)[:57] + "..."
    assert _config.shown(5) == "5"


def _engine() -> Any:
    return rehydrate.testing.isolated_engine()


def _gameloop_rate(e: Any) -> None:
    from rehydrate.adapters.gameloop import TickClock
    TickClock(rate_hz=H)


def _gameloop_catch_up(e: Any) -> None:
    from rehydrate.adapters.gameloop import TickClock
    TickClock(rate_hz=60, max_catch_up=-H)


def _asgi(e: Any) -> None:
    from rehydrate.adapters.asgi import ReadinessGate
    ReadinessGate(lambda *a: None, engine=e, retry_after=-H)


def _asgi_exempt(e: Any) -> None:
    from rehydrate.adapters.asgi import ReadinessGate
    ReadinessGate(lambda *a: None, engine=e, exempt=[H])


def _route(**kw: Any):
    def make(e: Any) -> None:
        from rehydrate import routes
        routes.route("10.9.0.0/16", engine=e, **{"dev": "eth0", **kw})
    return make


def _route_model(e: Any) -> None:
    from rehydrate.routes import Route
    Route("10.9.0.0/16", None, "eth0", None, None, None, "unicast", None, True,
          socket.AF_INET, proto=H)


def _tcp(e: Any) -> None:
    from rehydrate import connections
    connections.tcp_socket("feed", ("127.0.0.1", H), engine=e)


def _connection_name(e: Any) -> None:
    from rehydrate import connections
    connections.register(H, open=lambda: None, engine=e)  # type: ignore[arg-type]


def _hook(**kw: Any):
    def make(e: Any) -> None:
        e.registry.register(lambda: None, **kw)
    return make


def _simulate(**kw: Any):
    def make(e: Any) -> None:
        e.simulate_restore(**kw)
    return make


def _extension(e: Any) -> None:
    from rehydrate._contract import load_extension
    load_extension(H)  # type: ignore[arg-type]


def _checked_kind(e: Any) -> None:
    from rehydrate.detect._util import checked_kind
    checked_kind(H)  # type: ignore[arg-type]


def _vllm(**kw: Any):
    def make(e: Any) -> None:
        from rehydrate.adapters.vllm import VLLMAdapter
        VLLMAdapter("http://127.0.0.1:9", **kw)
    return make


def _sglang(**kw: Any):
    def make(e: Any) -> None:
        from rehydrate.adapters.sglang import SGLangAdapter
        SGLangAdapter("http://127.0.0.1:9", **kw)
    return make


def _udp(e: Any) -> None:
    import asyncio

    from rehydrate.adapters.udp import UdpEndpoint
    UdpEndpoint(asyncio.DatagramProtocol, ("127.0.0.1", 0), probe_timeout=H, engine=e)


def _agones(e: Any) -> None:
    from rehydrate.adapters.agones import AgonesAdapter
    AgonesAdapter(port=H, engine=e)


def _key(**kw: Any):
    def make(e: Any) -> None:
        from rehydrate import keys
        keys.ephemeral(**{"name": "k", **kw}, engine=e)
    return make


def _secret(e: Any) -> None:
    from rehydrate.secrets import Secret
    Secret(lambda: b"x", name=H, engine=e)  # type: ignore[arg-type]


def _tls_sans(e: Any) -> None:
    from rehydrate import tls
    tls.self_signed("web", sans=[H], engine=e)  # type: ignore[list-item]


def _tls_name(e: Any) -> None:
    from rehydrate import tls
    tls.self_signed(H, engine=e)  # type: ignore[arg-type]


def _env(e: Any) -> None:
    from rehydrate.env import EnvRefresher
    EnvRefresher(policy=H)  # type: ignore[arg-type]


def _fingerprint(e: Any) -> None:
    from rehydrate import fingerprint
    fingerprint.compare({}, {}, scope=H)  # type: ignore[arg-type]


def _detector_key(e: Any) -> None:
    from rehydrate import detect
    detect.load(H)  # type: ignore[arg-type]


CASES = [
    ("gameloop rate_hz", _gameloop_rate, "rate_hz"),
    ("gameloop max_catch_up", _gameloop_catch_up, "max_catch_up"),
    ("asgi retry_after", _asgi, "retry_after"),
    ("asgi exempt", _asgi_exempt, "exempt"),
    ("routes table", _route(table=H), "table"),
    ("routes metric", _route(metric=H), "metric"),
    ("routes scope", _route(scope=H), "scope"),
    ("routes tos", _route(tos=H), "tos"),
    ("routes proto", _route(proto=H), "proto"),
    ("routes realm", _route(realm=H), "realm"),
    ("routes family", _route(family=H), "family"),
    ("routes dev", _route(dev=H), "dev"),
    ("routes model", _route_model, "proto"),
    ("connections address", _tcp, "address"),
    ("connections name", _connection_name, "connection name"),
    ("hooks event", _hook(event=H), "event"),
    ("hooks required", _hook(required=H), "required"),
    ("hooks name", _hook(name=H), "name"),
    ("hooks env_keys", _hook(env_keys=[H]), "env_keys"),
    ("lifecycle kind", _simulate(kind=H), "kind"),
    ("lifecycle reason", _simulate(reason=H), "reason"),
    ("lifecycle frozen_for", _simulate(frozen_for=-H), "frozen_for"),
    ("contract extension", _extension, "extension"),
    ("detect kind", _checked_kind, "kind"),
    ("detect key", _detector_key, "detector"),
    ("vllm level", _vllm(level=H), "level"),
    ("vllm canary", _vllm(canary=H), "canary"),
    ("vllm mode", _vllm(mode=H), "mode"),
    ("sglang canary", _sglang(canary=H), "canary"),
    ("sglang tags", _sglang(tags=[H]), "tag"),
    ("udp probe_timeout", _udp, "probe_timeout"),
    ("agones port", _agones, "port"),
    ("keys algorithm", _key(algorithm=H), "algorithm"),
    ("keys name", _key(name=H), "name"),
    ("secrets name", _secret, "secret name"),
    ("tls sans", _tls_sans, "sans"),
    ("tls name", _tls_name, "certificate name"),
    ("env policy", _env, "policy"),
    ("fingerprint scope", _fingerprint, "scope"),
]


@pytest.mark.parametrize("make, parameter", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_huge_int_gives_the_validators_own_one_line_error(make, parameter):
    engine = _engine()
    try:
        with pytest.raises((ValueError, TypeError)) as caught:
            make(engine)
        message = str(caught.value)
        assert "Exceeds the limit" not in message, message
        assert "\n" not in message and len(message) < 400, message
        assert parameter in message, message
        assert "1e+5000" in message, message
        status = engine.status().extra
        # the previous good state is kept: nothing half-registered
        assert not status.get("connections"), status.get("connections")
        assert not engine.registry.hooks("restore") and not engine.registry.hooks("snapshot")
    finally:
        engine.close()
