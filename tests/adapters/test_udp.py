"""UdpEndpoint: the game's transport across a re-bind, busy sockets, restores that block
the endpoint's loop, and re-binds that cannot happen where expected. Real UDP sockets on
loopback throughout."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from detect_helpers import FakePlatform, wait_for

from rehydrate._trigger import trigger_snapshot
from rehydrate.adapters.udp import UdpEndpoint, _pausable
from rehydrate.detect.gvisor import GVisorDetector


class Game(asyncio.DatagramProtocol):
    """Holds the transport it was given, as a game does, and echoes every datagram."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.received: list[bytes] = []
        self.made = 0
        self.lost = 0
        self.got = asyncio.Event()

    def connection_made(self, transport):
        self.made += 1
        self.transport = transport

    def datagram_received(self, data, addr):
        self.received.append(data)
        self.got.set()
        self.transport.sendto(b"echo:" + data, addr)

    def connection_lost(self, exc):
        self.lost += 1


_SOCKET_TYPE = asyncio.selector_events._SelectorDatagramTransport
"""The type of the asyncio transport of an endpoint's socket (on the tests' loop)."""


def _fail_first_check(ep: UdpEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket still holds its port but is judged dead once (what the hook is for)."""
    real = ep.check
    calls: list[int] = []

    async def check() -> bool:
        calls.append(1)
        return False if len(calls) == 1 else await real()

    monkeypatch.setattr(ep, "check", check)


@contextlib.asynccontextmanager
async def _started(engine: Any, name: str, protocol: Callable[[], Any] = Game, *,
                   probe_timeout: float = 0.3, local_addr: Any = ("127.0.0.1", 0),
                   ) -> AsyncIterator[tuple[UdpEndpoint, asyncio.DatagramTransport]]:
    """A started endpoint (on loopback unless told) and the transport start() returned;
    closed after."""
    ep = UdpEndpoint(protocol, local_addr, engine=engine, name=name,
                     probe_timeout=probe_timeout)
    transport = await ep.start()
    try:
        yield ep, transport
    finally:
        ep.close()


def _socket_reads(ep: UdpEndpoint) -> bool:
    """Whether the endpoint's socket is read, asked of its asyncio transport where that can
    pause reading. Python 3.10's cannot (its is_reading() raises NotImplementedError): the
    socket is read on and the endpoint keeps what a paused game does not read, so there the
    endpoint's own transport answers."""
    flow = _pausable(ep.transport)
    return (flow if flow is not None else ep._stable).is_reading()


async def _recv(sock: socket.socket) -> bytes:
    return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 2048), 5)


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
async def test_the_game_sends_through_a_rebind_at_the_same_address(
        rehydrate_engine, monkeypatch, caplog, host):
    """The old socket is closed before the new one is bound at its address: a send from
    the game in that gap raised asyncio's internal AttributeError ('NoneType' object has no
    attribute 'call_exception_handler'); it is dropped with a DEBUG line, and the
    transport the game holds then sends through the new socket."""
    ep = UdpEndpoint(Game, (host, 0), engine=rehydrate_engine, name="gap", probe_timeout=0.3)
    returned = await ep.start()
    game = ep.protocol
    assert game.transport is returned
    _fail_first_check(ep, monkeypatch)
    real_open = ep._open
    in_gap: list[bool] = []

    async def open_in_gap(addr):
        if ep.transport.is_closing():  # the old one closed, the new one not yet bound
            in_gap.append(True)
            game.transport.sendto(b"in the gap", ("127.0.0.1", 9))
        return await real_open(addr)

    monkeypatch.setattr(ep, "_open", open_in_gap)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        client.bind(("127.0.0.1", 0))
        client.setblocking(False)
        with caplog.at_level(logging.DEBUG, logger="rehydrate.udp"):
            assert await ep.ensure()
        assert in_gap == [True]
        assert "no open socket (closed, or being bound again): datagram of 10 bytes " \
               "dropped" in caplog.text
        assert game.made == 2 and game.lost == 0 and game.transport is returned
        assert not returned.is_closing()
        game.transport.sendto(b"after", client.getsockname())
        assert await _recv(client) == b"after"
        returned.sendto(b"returned", client.getsockname())
        assert await _recv(client) == b"returned"
    ep.close()
    await asyncio.sleep(0)
    assert returned.is_closing() and game.lost == 1


async def test_the_transport_start_returns_sends_after_a_rebind(rehydrate_engine):
    """docs/game-servers.md keeps `transport = await endpoint.start()`: after a re-bind
    that transport was the closed old one, and its sendto raised AttributeError."""
    async with _started(rehydrate_engine, "kept") as (ep, transport):
        old = ep.transport
        old.close()  # dead
        await asyncio.sleep(0)
        report = await asyncio.to_thread(rehydrate_engine.simulate_restore)
        assert report.ok, report.table()
        assert ep.rebinds == 1 and ep.transport is not old
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.bind(("127.0.0.1", 0))
            client.setblocking(False)
            transport.sendto(b"state", client.getsockname())
            assert await _recv(client) == b"state"
            assert transport.get_extra_info("sockname") == ep.transport.get_extra_info(
                "sockname")


class SlowFirst(Game):
    """The game's first datagram takes longer than the probe's wait (a level load, a
    burst of inputs): the loop's clock is moved on past the probe's timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.advance: Callable[[], None] = lambda: None

    def datagram_received(self, data, addr):
        if not self.received:
            self.advance()
        super().datagram_received(data, addr)


async def test_a_busy_healthy_socket_is_not_bound_again(rehydrate_engine, monkeypatch):
    """asyncio reads one datagram per loop pass, so the probe waited behind the game's
    backlog; past probe_timeout the socket was judged dead, re-bound, and the datagrams
    still queued in it were lost."""
    loop = asyncio.get_running_loop()
    real_time = loop.time
    offset = [0.0]
    monkeypatch.setattr(loop, "time", lambda: real_time() + offset[0])
    async with _started(rehydrate_engine, "busy", SlowFirst) as (ep, _):
        game = ep.protocol

        def advance() -> None:
            offset[0] += 1.0  # the probe's timeout is due when this datagram is handled

        game.advance = advance
        n = 50
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            for i in range(n):  # queued in the socket, ahead of the probe
                client.sendto(b"in%d" % i, ep.address)
        assert not await ep.ensure()  # the probe is sent before the loop reads any
        assert ep.rebinds == 0
        assert game.received == [b"in%d" % i for i in range(n)]


async def test_datagrams_queued_in_a_socket_judged_dead_reach_the_game(
        rehydrate_engine, monkeypatch):
    """A socket judged dead is closed to bind its address again: what clients had queued
    in it was thrown away."""
    async with _started(rehydrate_engine, "queued") as (ep, _):
        game = ep.protocol

        async def dead() -> bool:
            return False

        monkeypatch.setattr(ep, "check", dead)
        n = 30
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            for i in range(n):
                client.sendto(b"q%d" % i, ep.address)
        assert await ep.ensure()
        assert game.received == [b"q%d" % i for i in range(n)]


async def test_datagrams_alone_do_not_prove_a_socket_works(rehydrate_engine, monkeypatch):
    """A socket left at an old address still delivers what was queued in it before the
    checkpoint: a check that took any datagram for proof would keep it for good."""
    async with _started(rehydrate_engine, "stale", probe_timeout=0.2) as (ep, _):
        game = ep.protocol
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            for i in range(5):
                client.sendto(b"old%d" % i, ep.address)
        # its probes go nowhere (what a socket at an address no longer the host's sees)
        real_sendto = socket.socket.sendto
        nowhere = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        nowhere.bind(("127.0.0.1", 0))

        def probe_lost(self, data, *args):
            if data.startswith(b"\0rehydrate-udp-probe\0"):
                return real_sendto(self, data, nowhere.getsockname())
            return real_sendto(self, data, *args)

        monkeypatch.setattr(socket.socket, "sendto", probe_lost)
        with nowhere:
            assert not await ep.check()
        assert game.received == [b"old%d" % i for i in range(5)]


async def test_a_trigger_on_the_endpoints_own_loop_fails_its_hook_at_once(
        rehydrate_engine, tmp_path):
    """trigger_snapshot() from the game's coroutine with the gVisor waiter running: the
    loop's thread sits in the trigger while the waiter's thread runs the restore hooks;
    the check waited ~9.5 s for that loop, and the process was left degraded."""
    proc = tmp_path / "gvisor"
    proc.mkdir()
    (proc / "spec_environ").write_bytes(b"RHT_UDP_A=1\0")
    platform = FakePlatform(proc)  # answers every trigger with restore
    reports: list[Any] = []
    rehydrate_engine.add_listener(reports.append)
    ep = UdpEndpoint(Game, ("127.0.0.1", 0), engine=rehydrate_engine, name="t-trig")
    await ep.start()
    try:
        waiter = GVisorDetector(str(proc))
        assert rehydrate_engine.start([waiter]) == ["gvisor"]
        wait_for(lambda: waiter.status()["waiting"], what="the waiter to open the file")
        assert trigger_snapshot(rehydrate_engine, timeout=30) == "restore"  # on the loop
        (restore,) = [r for r in reports if r.kind == "restore"]
        (hook,) = [h for h in restore.hooks if h.name == "rehydrate.udp.check:t-trig"]
        assert hook.outcome == "failed"
        assert "the restore was started on its event loop's thread" in str(hook.error)
        assert hook.duration < 1.0
    finally:
        rehydrate_engine.stop()
        platform.close()
        ep.close()


def _kill(ep: UdpEndpoint) -> None:
    """Point the endpoint's descriptor at a new unbound socket: the bound one is gone (a
    restore that hands back a socket that no longer delivers), its port free."""
    sock = ep.transport.get_extra_info("socket")
    with socket.socket(sock.family, socket.SOCK_DGRAM) as other:
        os.dup2(other.fileno(), sock.fileno())


_E = TypeVar("_E", bound=BaseException)


async def _rebind_fails(ep: UdpEndpoint, expected: type[_E]) -> _E:
    """What ensure() raises when the dead socket cannot be bound again: the old one kept
    as it was."""
    old = ep.transport
    with pytest.raises(expected) as info:
        await ep.ensure()
    assert ep.transport is old and not old.is_closing()
    return info.value


async def test_a_port_another_socket_took_is_left_to_it_and_said_so(rehydrate_engine):
    """The old socket is dead and another holds its port: EADDRINUSE was taken to mean the
    old socket held it, which was closed (the game got neither connection_lost nor a new
    transport), and the error blamed an IP change."""
    async with _started(rehydrate_engine, "taken", probe_timeout=0.2) as (ep, _):
        port = ep.address[1]
        game = ep.protocol
        _kill(ep)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as thief:
            thief.bind(("127.0.0.1", port))
            error = await _rebind_fails(ep, OSError)
        assert str(error) == (
            f"[Errno {error.errno}] UDP endpoint 'taken': binding again at "
            f"127.0.0.1:{port} failed ({os.strerror(error.errno)}); the port is "
            "taken by another socket")
        assert game.made == 1 and game.lost == 0


async def test_a_local_addr_callable_that_raises_names_the_endpoint(rehydrate_engine,
                                                                     monkeypatch):
    """lambda: (os.environ["POD_IP"], 7777) after a restore without POD_IP: the hook
    failed with a bare KeyError: 'POD_IP'."""
    monkeypatch.setenv("RHT_UDP_POD_IP", "127.0.0.1")
    async with _started(rehydrate_engine, "env", probe_timeout=0.2,
                        local_addr=lambda: (os.environ["RHT_UDP_POD_IP"], 0)) as (ep, _):
        _kill(ep)
        monkeypatch.delenv("RHT_UDP_POD_IP")
        error = await _rebind_fails(ep, RuntimeError)
        assert str(error) == ("UDP endpoint 'env': local_addr() raised "
                              "KeyError('RHT_UDP_POD_IP'), so the socket cannot be "
                              "bound again")
        assert isinstance(error.__cause__, KeyError)


def _in_netns(setup: str, code: str) -> dict[str, Any]:
    """Run ``code`` (Python printing one JSON line) in a new network namespace (root, as
    in CI) after the shell commands ``setup``."""
    script = f"{setup} && exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True,
                          text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


_LINK_LOCAL = '''
import asyncio, json, os, socket
from rehydrate.testing import isolated_engine
from rehydrate.adapters.udp import UdpEndpoint, _pausable

async def main():
    engine = isolated_engine()
    ep = UdpEndpoint(asyncio.DatagramProtocol, ("fe80::1%lo", 0), engine=engine,
                     name="ll", probe_timeout=0.3)
    await ep.start()
    first = await ep.check()
    sock = ep.transport.get_extra_info("socket")
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as other:
        os.dup2(other.fileno(), sock.fileno())  # dead, its address free
    report = await asyncio.to_thread(engine.simulate_restore)
    out = {"first": first, "ok": report.ok, "rebinds": ep.rebinds,
           "errors": [str(h.error) for h in report.hooks if h.error],
           "name": list(ep.transport.get_extra_info("sockname")),
           "after": await ep.check()}
    ep.close()
    engine.close()
    print(json.dumps(out))

asyncio.run(main())
'''


def test_a_link_local_address_is_bound_again_with_its_scope(rehydrate_engine):
    """The address kept for re-binds was (host, port): a link-local address lost its scope
    id, the re-bind failed with EINVAL, and the hint blamed an IP change."""
    out = _in_netns("ip link set lo up && ip -6 addr add fe80::1/64 dev lo nodad",
                    _LINK_LOCAL)
    assert out["first"] and out["ok"], out["errors"]
    assert out["rebinds"] == 1 and out["name"][0] == "fe80::1" and out["name"][3] != 0
    assert out["after"]


_V6_OFF = '''
import asyncio, json
from rehydrate.testing import isolated_engine
from rehydrate.adapters.udp import UdpEndpoint, _pausable

async def main():
    engine = isolated_engine()
    ep = UdpEndpoint(asyncio.DatagramProtocol, ("::", 0), engine=engine, name="v6off",
                     probe_timeout=0.3)
    await ep.start()
    checked = await ep.check()
    report = await asyncio.to_thread(engine.simulate_restore)
    out = {"checked": checked, "ok": report.ok, "rebinds": ep.rebinds}
    ep.close()
    engine.close()
    print(json.dumps(out))

asyncio.run(main())
'''


def test_a_dual_stack_wildcard_with_ipv6_off_on_loopback_checks_over_ipv4(
        rehydrate_engine):
    """Bound to '::' where loopback has no IPv6 (many IPv4-only clusters): the probe to ::1
    could not be sent, so every restore re-bound a socket IPv4 clients reached fine — a
    false warning, and queued datagrams lost each time."""
    out = _in_netns("ip link set lo up && echo 1 > /proc/sys/net/ipv6/conf/lo/disable_ipv6",
                    _V6_OFF)
    assert out == {"checked": True, "ok": True, "rebinds": 0}


class FlowGame(Game):
    """Records the flow-control calls asyncio makes on the game's protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.flow: list[str] = []

    def connection_made(self, transport):
        super().connection_made(transport)
        self.flow.append("made")

    def pause_writing(self):
        self.flow.append("pause")

    def resume_writing(self):
        self.flow.append("resume")


async def test_flow_control_on_the_game_transport_across_a_rebind(rehydrate_engine,
                                                                  monkeypatch):
    """The endpoint's transport forwarded only sendto/close/...: get_write_buffer_size(),
    the write-buffer limits and pause/resume_reading() raised AttributeError where
    asyncio's transport had them. They work before and after a re-bind, and the limits
    set survive it."""
    async with _started(rehydrate_engine, "flow") as (ep, transport):
        assert transport.get_write_buffer_size() == 0
        assert transport.get_write_buffer_limits() == (16384, 65536)
        assert transport.is_reading()
        transport.set_write_buffer_limits(high=4096)
        assert transport.get_write_buffer_limits() == (1024, 4096)
        assert ep.transport.get_write_buffer_limits() == (1024, 4096)
        with pytest.raises(ValueError, match="must be >= low"):
            transport.set_write_buffer_limits(high=1, low=2)
        assert transport.get_write_buffer_limits() == (1024, 4096)
        transport.pause_reading()
        assert not transport.is_reading() and not _socket_reads(ep)
        transport.resume_reading()
        assert transport.is_reading() and _socket_reads(ep)

        old = ep.transport
        _fail_first_check(ep, monkeypatch)
        assert await ep.ensure()
        assert ep.transport is not old
        assert ep.transport.get_write_buffer_limits() == (1024, 4096)
        assert transport.get_write_buffer_limits() == (1024, 4096)
        assert transport.get_write_buffer_size() == 0
        assert transport.is_reading() and _socket_reads(ep)
        transport.set_write_buffer_limits(high=8192, low=0)
        assert ep.transport.get_write_buffer_limits() == (0, 8192)
        transport.pause_reading()
        assert not transport.is_reading() and not _socket_reads(ep)
        transport.resume_reading()
        assert transport.is_reading() and _socket_reads(ep)
    await asyncio.sleep(0)
    assert not transport.is_reading() and transport.get_write_buffer_size() == 0
    transport.pause_reading()  # on a closed endpoint: remembered, no socket to pause
    assert await ep.start() is transport  # a new connection reads, as asyncio's did
    try:
        assert transport.is_reading() and _socket_reads(ep)
        assert ep.transport.get_write_buffer_limits() == (0, 8192)
    finally:
        ep.close()


async def test_a_paused_endpoint_stays_paused_across_a_rebind(rehydrate_engine, monkeypatch):
    """The new socket was read at once: a game that paused reading got datagrams
    (queued in the old socket, drained to it, or new) before it called resume_reading()."""
    async with _started(rehydrate_engine, "paused") as (ep, transport):
        game = ep.protocol
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.bind(("127.0.0.1", 0))
            client.setblocking(False)
            transport.pause_reading()
            client.sendto(b"queued in the old socket", ep.address)
            _fail_first_check(ep, monkeypatch)  # judged dead without reading it
            old = ep.transport
            assert await ep.ensure()
            assert ep.transport is not old and game.made == 2
            assert not transport.is_reading() and not _socket_reads(ep)
            client.sendto(b"sent to the new socket", ep.address)
            # the check reads the socket (the probe arrives after that datagram) and
            # keeps what it reads for the game
            assert not await ep.ensure()
            assert game.received == []
            assert not _socket_reads(ep)
            game.got.clear()
            transport.resume_reading()
            assert game.received == []  # not from within the game's own call
            await asyncio.wait_for(game.got.wait(), 5)  # both kept, handed over at once
            assert game.received == [b"queued in the old socket", b"sent to the new socket"]
            assert transport.is_reading() and _socket_reads(ep)
            game.got.clear()
            client.sendto(b"after", ep.address)
            await asyncio.wait_for(game.got.wait(), 5)
            assert game.received[-1] == b"after"


async def test_a_paused_healthy_endpoint_is_not_rebound(rehydrate_engine):
    """A game that paused reading had its probe left unread: the healthy socket was
    taken for dead and bound again at every restore."""
    async with _started(rehydrate_engine, "idle") as (ep, transport):
        transport.pause_reading()
        old = ep.transport
        assert not await ep.ensure()
        assert ep.rebinds == 0 and ep.transport is old and not _socket_reads(ep)


async def test_pause_and_resume_writing_reach_the_game(rehydrate_engine, monkeypatch):
    """The endpoint's protocol dropped asyncio's pause_writing()/resume_writing(): a game
    kept sending into a full buffer. A re-bind leaves the full buffer with the old socket,
    so a paused game is resumed before it hears of the new one."""
    async with _started(rehydrate_engine, "writes", FlowGame) as (ep, _):
        game = ep.protocol
        filter_ = ep.transport.get_protocol()
        filter_.pause_writing()  # what asyncio calls above the high limit
        filter_.pause_writing()
        filter_.resume_writing()
        assert game.flow == ["made", "pause", "resume"]
        filter_.pause_writing()
        _fail_first_check(ep, monkeypatch)
        assert await ep.ensure()
        assert game.flow == ["made", "pause", "resume", "pause", "resume", "made"]
        filter_.resume_writing()  # the old socket's: no longer the game's
        filter_.pause_writing()
        assert game.flow[-1] == "made"


async def test_a_transport_that_cannot_pause_reading_is_read_and_kept_for_the_game(
        rehydrate_engine, monkeypatch):
    """Python 3.10's datagram transport has pause/resume_reading() and is_reading() only
    from asyncio.ReadTransport, where they raise NotImplementedError: every check raised,
    the restore hook failed and the process was never ready; the game's own pause raised
    too. The endpoint keeps a paused game's datagrams itself, in order, across a re-bind."""
    # As on Python 3.10 (is_reading() kept: Python 3.11's own reader calls it), before the
    # socket is bound: the endpoint asks a socket once whether it can pause.
    for name in ("pause_reading", "resume_reading"):
        monkeypatch.setattr(_SOCKET_TYPE, name, getattr(asyncio.ReadTransport, name))
    async with _started(rehydrate_engine, "py310") as (ep, transport):
        game = ep.protocol
        assert type(ep.transport) is _SOCKET_TYPE
        with pytest.raises(NotImplementedError):
            ep.transport.pause_reading()
        assert await ep.check()
        report = await asyncio.to_thread(rehydrate_engine.simulate_restore)
        assert report.ok
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.bind(("127.0.0.1", 0))
            transport.pause_reading()
            assert not transport.is_reading()
            client.sendto(b"one", ep.address)
            assert await ep.check()  # the probe arrives after it: read, and kept
            assert ep._checking == 0
            _fail_first_check(ep, monkeypatch)
            assert await ep.ensure()  # the new socket's connection_made does not pause it
            client.sendto(b"two", ep.address)
            assert await ep.check()
            assert game.received == []
            game.got.clear()
            transport.resume_reading()
            await asyncio.wait_for(game.got.wait(), 5)
            assert game.received == [b"one", b"two"] and transport.is_reading()


@pytest.mark.parametrize("ending", ["abort", "socket lost"])
async def test_datagrams_kept_for_a_paused_game_end_with_its_socket(rehydrate_engine, ending):
    """Datagrams kept while the game paused survived abort() (close() dropped them) and
    were handed to the game of the next start(), as if sent to the new connection."""
    async with _started(rehydrate_engine, "aborted") as (ep, transport):
        game = ep.protocol
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.bind(("127.0.0.1", 0))
            transport.pause_reading()
            client.sendto(b"old session", ep.address)
            assert await ep.check()  # read by the check, kept for the game
            if ending == "abort":
                transport.abort()
                transport.resume_reading()
                await asyncio.sleep(0)  # a pass of the loop: where kept ones are handed over
                assert game.received == []
            else:  # the socket itself gone: start() may bind again
                ep.transport.abort()
                await asyncio.sleep(0)  # connection_lost
            assert await ep.start() is transport and transport.is_reading()
            transport.pause_reading()
            transport.resume_reading()
            client.sendto(b"new session", ep.address)
            await asyncio.wait_for(game.got.wait(), 5)
            assert game.received == [b"new session"]


class Numbered(asyncio.DatagramProtocol):
    """Records the numbers it receives; ``done`` is set at ``expected`` of them."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.expected = 0
        self.done = asyncio.Event()

    def datagram_received(self, data, addr):
        self.got.append(int(data))
        if len(self.got) == self.expected:
            self.done.set()


async def test_a_game_resumed_during_a_check_gets_its_datagrams_in_order(rehydrate_engine):
    """A datagram read in the loop pass the game resumed in reached it ahead of those the
    check had kept: [10, 0, 1, ...]."""
    async with _started(rehydrate_engine, "order", Numbered, probe_timeout=0.5) as (ep, transport):
        game = ep.protocol
        game.expected = 200
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            transport.pause_reading()
            for i in range(game.expected):
                client.sendto(b"%d" % i, ep.address)
            check = asyncio.ensure_future(ep.check())
            while len(ep._held) < 10:  # one datagram read per pass of the loop
                await asyncio.sleep(0)
            transport.resume_reading()
            assert await check
            await asyncio.wait_for(game.done.wait(), 5)
            assert game.got == list(range(game.expected))


async def test_datagrams_drained_while_kept_ones_wait_come_after_them(rehydrate_engine):
    """Draining a socket delivered at once once the game had resumed, ahead of the
    datagrams kept for it and not yet handed over."""
    async with _started(rehydrate_engine, "drain", Numbered, probe_timeout=0.5) as (ep, transport):
        game = ep.protocol
        game.expected = 6
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            transport.pause_reading()
            for i in range(5):
                client.sendto(b"%d" % i, ep.address)
            assert await ep.check()  # read ahead of the probe, kept
            client.sendto(b"5", ep.address)  # left in the paused socket
            transport.resume_reading()  # the kept ones are handed over on the next pass
            ep._drain(ep.transport)  # as a re-bind drains the socket it replaces
            await asyncio.wait_for(game.done.wait(), 5)
            assert game.got == list(range(6))


async def test_a_failing_pause_or_resume_leaves_the_endpoint_as_it_was(rehydrate_engine,
                                                                       monkeypatch):
    """A transport's pause_reading() that raised left the game marked paused, its socket
    read; a resume_reading() raising in a check left the check counted for ever, so the
    game's pause_reading() never paused the socket again."""
    socket_type = _SOCKET_TYPE
    if socket_type.pause_reading is asyncio.ReadTransport.pause_reading:
        # Python 3.10's cannot pause reading at all: give it the flow control of 3.11's,
        # before the socket is bound (the endpoint asks a socket once whether it can pause)
        paused: set[int] = set()
        monkeypatch.setattr(socket_type, "pause_reading", lambda self: paused.add(id(self)))
        monkeypatch.setattr(socket_type, "resume_reading", lambda self: paused.discard(id(self)))
        monkeypatch.setattr(socket_type, "is_reading", lambda self: id(self) not in paused)
    async with _started(rehydrate_engine, "raising") as (ep, transport):
        assert type(ep.transport) is socket_type and _pausable(ep.transport) is not None
        real_pause, real_resume = socket_type.pause_reading, socket_type.resume_reading

        def broken(self):
            raise OSError("broken")

        monkeypatch.setattr(socket_type, "pause_reading", broken)
        with pytest.raises(OSError, match="broken"):
            transport.pause_reading()
        assert transport.is_reading()
        monkeypatch.setattr(socket_type, "pause_reading", real_pause)
        monkeypatch.setattr(socket_type, "resume_reading", broken)
        with pytest.raises(OSError, match="broken"):
            await ep.check()
        monkeypatch.setattr(socket_type, "resume_reading", real_resume)
        transport.pause_reading()
        assert not transport.is_reading() and not _socket_reads(ep)


async def test_datagrams_kept_for_a_paused_game_go_with_a_lost_socket(rehydrate_engine):
    """The socket lost without close() or abort(): the datagrams kept for the paused game
    stayed until the next start(), and a resume_reading() in between handed them to the
    game after its connection_lost."""
    async with _started(rehydrate_engine, "lost") as (ep, transport):
        game = ep.protocol
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            transport.pause_reading()
            client.sendto(b"before the loss", ep.address)
            assert await ep.check()  # read by the check, kept for the game
            assert ep._held
            ep.transport.abort()  # the socket's own transport: not the endpoint's abort()
            await asyncio.sleep(0)  # connection_lost
            assert game.lost == 1 and not ep._held
            transport.resume_reading()
            await asyncio.sleep(0)  # a pass of the loop: where kept ones are handed over
            assert game.received == []


async def test_empty_datagrams_kept_for_a_paused_game_are_bounded(rehydrate_engine):
    """Kept datagrams counted their payload only: a flood of empty ones (0 bytes each,
    ~215 in memory) was kept without limit while the game did not read."""
    from rehydrate.adapters.udp import _HELD_MAX

    async with _started(rehydrate_engine, "flood") as (ep, _transport):
        for _ in range(_HELD_MAX // 100):
            ep._hold(b"", ("127.0.0.1", 9))
        assert 0 < len(ep._held) <= _HELD_MAX // 200
        ep._drop_held()


async def test_a_host_name_that_does_not_resolve_names_the_endpoint(rehydrate_engine):
    """start() with a host name that does not resolve raised a bare "[Errno -2] Name or
    service not known": neither the endpoint nor the name."""
    ep = UdpEndpoint(Game, ("rehydrate-nowhere.invalid", 0), engine=rehydrate_engine,
                     name="named")
    with pytest.raises(socket.gaierror) as info:
        await ep.start()
    assert str(info.value) == (
        f"[Errno {info.value.errno}] UDP endpoint 'named': the host name "
        f"'rehydrate-nowhere.invalid' in local_addr does not resolve "
        f"({info.value.__cause__.strerror})")
    assert "\n" not in str(info.value) and ep.transport is None


async def test_a_rebind_at_a_host_name_that_does_not_resolve_says_so(rehydrate_engine):
    """local_addr() returned a host name that no longer resolves: the hook failed with the
    resolver's words and no hint of what was wrong."""
    host = ["127.0.0.1"]
    async with _started(rehydrate_engine, "renamed", probe_timeout=0.2,
                        local_addr=lambda: (host[0], 0)) as (ep, _):
        _kill(ep)
        host[0] = "rehydrate-nowhere.invalid"
        error = await _rebind_fails(ep, socket.gaierror)
        assert str(error) == (
            f"[Errno {error.errno}] UDP endpoint 'renamed': binding again at "
            f"rehydrate-nowhere.invalid:0 failed ({error.__cause__.strerror}); the "
            "host name does not resolve (local_addr() returned it)")


async def test_a_close_while_the_restore_checks_binds_nothing_again(rehydrate_engine):
    """The game closed its endpoint (shutting down) while a restore's check of a dead
    socket waited for its probe: the check then bound the socket again — the game got
    connection_made after its connection_lost, the port stayed taken after close(), and
    start() said "already started"."""
    ep = UdpEndpoint(Game, ("127.0.0.1", 0), engine=rehydrate_engine, name="closing",
                     probe_timeout=0.3)
    await ep.start()
    addr = ep.address
    game = ep.protocol
    _kill(ep)
    checking = asyncio.Event()
    real_check = ep.check

    async def check() -> bool:
        checking.set()
        return await real_check()

    ep.check = check  # type: ignore[method-assign]
    ensured = asyncio.create_task(ep.ensure())
    await checking.wait()
    ep.close()
    assert await ensured is False
    assert (game.made, game.lost, ep.rebinds) == (1, 1, 0)
    assert ep.transport is not None and ep.transport.is_closing()
    await asyncio.sleep(0)  # the closed transport lets go of its socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        other.bind(addr)  # free: close() let go of the port


async def test_a_close_while_a_rebind_resolves_its_host_binds_nothing(rehydrate_engine,
                                                                       monkeypatch):
    """close() while a re-bind resolved local_addr()'s host name: the socket was bound
    all the same, after the game's connection_lost."""
    async with _started(rehydrate_engine, "resolving", probe_timeout=0.2,
                        local_addr=lambda: ("localhost", 0)) as (ep, _):
        game = ep.protocol
        _kill(ep)
        real = ep._first_address

        async def first_address(addr: Any, old: Any) -> Any:
            ep.close()  # the game shuts down meanwhile
            return await real(addr, old)

        monkeypatch.setattr(ep, "_first_address", first_address)
        assert await ep.ensure() is False
        assert (game.made, game.lost, ep.rebinds) == (1, 1, 0)


async def test_two_checks_at_once_rebind_a_dead_socket_once(rehydrate_engine):
    """The game's own ensure() while the restore's ran on the same dead socket: both
    bound it again, the second dropping the socket the first had just bound."""
    async with _started(rehydrate_engine, "twice", probe_timeout=0.2) as (ep, _):
        game = ep.protocol
        _kill(ep)
        results = await asyncio.gather(ep.ensure(), ep.ensure())
        assert sorted(results) == [False, True]
        assert (game.made, ep.rebinds) == (2, 1)
        assert await ep.check()


async def test_a_port_in_use_at_start_names_the_endpoint_and_the_address(rehydrate_engine):
    """A second server on the game's port: start() raised asyncio's bare "[Errno 98]
    Address already in use", naming neither the endpoint nor the port."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as first:
        first.bind(("127.0.0.1", 0))
        port = first.getsockname()[1]
        ep = UdpEndpoint(Game, ("127.0.0.1", port), engine=rehydrate_engine, name="second")
        with pytest.raises(OSError) as info:
            await ep.start()
    error = info.value
    assert error.errno == errno.EADDRINUSE
    assert str(error) == (f"[Errno {error.errno}] UDP endpoint 'second': binding at "
                          f"127.0.0.1:{port} failed ({os.strerror(error.errno)}); the port "
                          "is taken by another socket")
    assert ep.transport is None
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(ep.close)
        await ep.start()  # the port free again: the same endpoint binds
        assert ep.address == ("127.0.0.1", port)


async def test_a_failed_start_after_close_leaves_the_endpoint_closed(rehydrate_engine):
    """start() after close() whose bind fails (the port taken meanwhile): the endpoint
    counted as open again, so the next restore's hook re-bound it and the game got
    connection_made for a start() that had raised."""
    ep = UdpEndpoint(Game, ("127.0.0.1", 0), engine=rehydrate_engine, name="reopened")
    await ep.start()
    address = ep.address
    ep.close()
    await asyncio.sleep(0)  # the transport's connection_lost
    game = ep.protocol
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as thief:
        thief.bind(address)
        with pytest.raises(OSError):
            await ep.start()
    report = await asyncio.to_thread(rehydrate_engine.simulate_restore)
    assert report.ok, report.table()
    assert (game.made, game.lost, ep.rebinds) == (1, 1, 0)


async def test_an_address_this_host_lacks_at_start_says_so(rehydrate_engine):
    """start() at an address the host does not have: a bare "[Errno 99] Cannot assign
    requested address"."""
    ep = UdpEndpoint(Game, ("192.0.2.1", 0), engine=rehydrate_engine, name="elsewhere")
    with pytest.raises(OSError) as info:
        await ep.start()
    assert info.value.errno == errno.EADDRNOTAVAIL
    assert str(info.value) == (
        f"[Errno {info.value.errno}] UDP endpoint 'elsewhere': binding at 192.0.2.1:0 "
        f"failed ({os.strerror(errno.EADDRNOTAVAIL)}); not an address of this host")
    assert ep.transport is None


@pytest.mark.parametrize("local_addr", ["127.0.0.1:7777", ("127.0.0.1", True),
                                        ("127.0.0.1", 70000), ("127.0.0.1", 0, 0), None])
def test_a_local_addr_that_is_no_address_is_refused_at_once(rehydrate_engine, local_addr):
    """"127.0.0.1:7777" reached start() as "bind(): AF_INET6 address must be tuple", a
    3-tuple as a host name that "does not resolve", None as "object of type 'NoneType'
    has no len()", and ("127.0.0.1", True) bound port 1."""
    with pytest.raises(ValueError) as info:
        UdpEndpoint(Game, local_addr, engine=rehydrate_engine, name="typo")
    assert str(info.value).startswith(
        "UDP endpoint 'typo': local_addr must be a (host, port) tuple — host a str, bytes "
        "or None, port a whole number from 0 to 65535 (also as a string of digits) — or an IPv6 "
        "(host, port, flowinfo, scope_id), or a callable returning one, not ")


async def test_a_local_addr_list_from_a_json_config_binds(rehydrate_engine):
    """["127.0.0.1", 0] (a JSON config's address) raised asyncio's "2-tuple is expected"."""
    async with _started(rehydrate_engine, "json", local_addr=["127.0.0.1", 0]) as (ep, _):
        assert ep.address[0] == "127.0.0.1"


async def test_a_port_read_from_the_environment_as_a_string_binds(rehydrate_engine,
                                                                  monkeypatch):
    """("0.0.0.0", os.environ["GAME_PORT"]) bound before local_addr was checked, and must
    still: refused, every game configured from its environment stopped starting."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("GAME_PORT", str(port))
    async with _started(rehydrate_engine, "from-env",
                        local_addr=("127.0.0.1", os.environ["GAME_PORT"])) as (ep, _):
        assert ep.address == ("127.0.0.1", port)
    monkeypatch.setenv("GAME_PORT", "0")  # any port: the first one may not be free yet
    async with _started(rehydrate_engine, "from-env-callable",
                        local_addr=lambda: ["127.0.0.1", os.environ["GAME_PORT"]]) as (ep, _):
        assert ep.address[0] == "127.0.0.1" and ep.address[1] > 0


async def test_a_check_waiting_for_anothers_failed_rebind_fails_too(rehydrate_engine):
    """The restore's check and the game's own ensure() on the same dead socket, whose
    re-bind fails: the second returned False (nothing to do), so the restore's hook said
    ok and the process ready with the socket dead."""
    where: list[Any] = [("127.0.0.1", 0)]
    async with _started(rehydrate_engine, "both-fail", probe_timeout=0.2,
                        local_addr=lambda: where[0]) as (ep, _):
        _kill(ep)
        where[0] = ("rehydrate-nowhere.invalid", 0)
        results = await asyncio.gather(ep.ensure(), ep.ensure(), return_exceptions=True)
        assert [type(r) for r in results] == [socket.gaierror, socket.gaierror], results
        assert ep.rebinds == 0


async def test_a_cancelled_ensure_leaves_the_one_waiting_on_it_uncancelled(
        rehydrate_engine, monkeypatch):
    """One ensure() cancelled mid-re-bind (the application's own ``wait_for()``) while
    another (the restore's hook) waited on it: the waiter, never cancelled, raised
    CancelledError; then, given False, it said ok with the socket still dead. It binds
    again itself."""
    async with _started(rehydrate_engine, "cut") as (ep, _):
        async def dead() -> bool:
            return False

        binding = asyncio.Event()
        calls: list[int] = []

        async def slow_rebind(old: Any) -> bool:
            calls.append(1)
            if len(calls) == 1:
                binding.set()
                await asyncio.Event().wait()  # until cancelled
            return True

        monkeypatch.setattr(ep, "check", dead)
        monkeypatch.setattr(ep, "_rebind", slow_rebind)
        first = asyncio.ensure_future(ep.ensure())
        await binding.wait()
        second = asyncio.ensure_future(ep.ensure())
        for _ in range(5):  # the second's check, then its wait on the first's re-bind
            await asyncio.sleep(0)
        first.cancel()  # the application's own wait_for() gave up on it
        # the other (the restore's hook) binds again itself: the socket was still dead
        assert await second is True and len(calls) == 2
        with pytest.raises(asyncio.CancelledError):
            await first


async def test_a_local_addr_callable_returning_no_address_says_what_it_returned(
        rehydrate_engine):
    """lambda: os.environ["GAME_ADDR"] ("10.0.0.5:7777"): the hook failed with asyncio's
    "AF_INET6 address must be tuple, not str". The value itself (read from the
    environment) is not shown, only its type."""
    value: list[Any] = [("127.0.0.1", 0)]
    async with _started(rehydrate_engine, "returned", probe_timeout=0.2,
                        local_addr=lambda: value[0]) as (ep, _):
        _kill(ep)
        value[0] = "10.9.8.7:7777"
        error = await _rebind_fails(ep, ValueError)
        assert str(error) == (
            "UDP endpoint 'returned': local_addr() returned a str, not a (host, port) "
            "tuple — host a str, bytes or None, port a whole number from 0 to 65535 (also as a "
            "string of digits) — or an IPv6 (host, port, flowinfo, scope_id)")
        value[0] = ("127.0.0.1", 70000)
        error = await _rebind_fails(ep, ValueError)
        assert "returned a tuple of 2: str, 70000, not" in str(error)
