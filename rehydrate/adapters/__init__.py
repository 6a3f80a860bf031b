"""Integrations with application servers and game servers: one module per integration.

``rehydrate.adapters.asgi``
    :class:`~rehydrate.adapters.asgi.ReadinessGate`, ASGI middleware (Starlette, FastAPI,
    KServe's app …): health and readiness endpoints, 503 while not ready, drains requests
    before a snapshot.
``rehydrate.adapters.vllm`` / ``rehydrate.adapters.sglang``
    Put an inference engine to sleep (release its GPU memory) before a snapshot, wake it
    and check one generation after a restore.
``rehydrate.adapters.kserve``
    :func:`~rehydrate.adapters.kserve.install`: KServe's server and model readiness follow
    rehydrate's.
``rehydrate.adapters.agones``
    :class:`~rehydrate.adapters.agones.AgonesAdapter`: the Agones SDK sidecar (health pings,
    ``Ready``, labels and annotations) across snapshots and restores.
``rehydrate.adapters.gameloop``
    :class:`~rehydrate.adapters.gameloop.TickClock`: a fixed-step clock that never replays
    the seconds a process spent frozen.
``rehydrate.adapters.sessions``
    :class:`~rehydrate.adapters.sessions.MatchSessions`: session tokens and per-match
    secrets that differ in every clone.
``rehydrate.adapters.udp``
    :class:`~rehydrate.adapters.udp.UdpEndpoint`: an asyncio UDP socket checked (and
    re-bound when dead) after every restore.

Each module imports its framework (or talks to its server) only when used.
:func:`not_ready_reason` is the one line adapters give for "not ready"; what they show to
clients (``ReadinessGate``'s ``/readyz`` and 503 bodies) is its ``detail=False`` form,
which names failed hooks without their error text.
"""

from __future__ import annotations

from ._readiness import not_ready_reason

__all__ = ["not_ready_reason"]
