"""MatchSessions (per-clone tokens) and UdpEndpoint (checked and re-bound after restore)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Callable

import pytest

from rehydrate.adapters.sessions import MatchSessions
from rehydrate.adapters.udp import UdpEndpoint
from rehydrate.secrets import SecretUnavailable


def test_tokens_verify_and_change_on_restore(rehydrate_engine):
    s = MatchSessions("m1", engine=rehydrate_engine)
    tok = s.token("alice")
    assert s.verify("alice", tok)
    assert not s.verify("bob", tok)
    assert not s.verify("alice", tok[:-1] + ("A" if tok[-1] != "A" else "B"))
    assert s.token("alice") == tok  # stable within one clone and epoch
    key = s.derive("chat")
    assert len(key) == 32 and s.derive("chat") == key and s.derive("voice") != key
    epoch = s.epoch
    assert rehydrate_engine.simulate_restore().ok
    assert s.epoch == epoch + 1
    assert s.token("alice") != tok
    assert not s.verify("alice", tok), "a token from before the restore must not verify"
    assert s.derive("chat") != key


def test_two_clones_get_different_tokens(rehydrate_engine):
    """Two restores of one state stand for two clones: each draws its own key."""
    s = MatchSessions("m2", engine=rehydrate_engine)
    seen = set()
    for _ in range(2):
        assert rehydrate_engine.simulate_restore().ok
        seen.add(s.token("player-1"))
    assert len(seen) == 2


def test_wiped_before_snapshot_never_blocks(rehydrate_engine):
    s = MatchSessions("m3", engine=rehydrate_engine)
    tok = s.token("alice")
    assert rehydrate_engine.simulate_snapshot().ok
    assert not s.available
    with pytest.raises(SecretUnavailable):
        s.token("alice")
    assert not s.verify("alice", tok)
    assert rehydrate_engine.simulate_restore(kind="resume").ok
    assert s.available and s.token("alice") != tok


def test_a_token_with_lone_surrogates_is_refused_not_an_exception(rehydrate_engine):
    """A client's JSON may escape a lone surrogate; json.loads gives a str that strict
    UTF-8 cannot encode. verify() must say False (the game replies "rejoin"), not raise
    out of the datagram handler."""
    s = MatchSessions("m5", engine=rehydrate_engine)
    good = s.token("p1")
    hostile = json.loads('{"token": "\\udcff' + good[1:] + '"}')["token"]
    assert not s.verify("p1", hostile)
    assert s.verify("p1", good)
    # A subject or purpose that came from the network the same way is keyed like any other:
    # stable, distinct from its neighbours, verifiable.
    odd = json.loads('"p\\ud800"')
    assert s.token(odd) == s.token(odd) != s.token("p")
    assert s.verify(odd, s.token(odd)) and not s.verify("p", s.token(odd))
    assert len(s.derive(odd)) == 32 and s.derive(odd) != s.derive("p")


def test_bad_key_size_is_refused(rehydrate_engine):
    with pytest.raises(ValueError, match="nbytes"):
        MatchSessions("m4", nbytes=8, engine=rehydrate_engine)


class Echo(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.made = 0
        self.lost = 0
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport):
        self.made += 1
        self.transport = transport

    def datagram_received(self, data, addr):
        self.received.append(data)
        self.transport.sendto(b"echo:" + data, addr)

    def connection_lost(self, exc):
        self.lost += 1


async def _roundtrip(addr, payload: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
        c.setblocking(False)
        c.connect(addr)
        await loop.sock_sendall(c, payload)
        return await asyncio.wait_for(loop.sock_recv(c, 2048), 5)


async def test_udp_endpoint_checked_after_restore_and_probes_hidden(rehydrate_engine):
    ep = UdpEndpoint(Echo, ("127.0.0.1", 0), engine=rehydrate_engine, name="t1")
    await ep.start()
    try:
        assert "rehydrate.udp.check:t1" in [h.name for h in rehydrate_engine.hooks("restore")]
        assert await _roundtrip(ep.address, b"hi") == b"echo:hi"
        report = await asyncio.to_thread(rehydrate_engine.simulate_restore)
        assert report.ok, report.table()
        assert ep.rebinds == 0
        assert ep.protocol.received == [b"hi"], "probe datagrams reached the game"
    finally:
        ep.close()


async def test_dead_udp_socket_is_bound_again(rehydrate_engine):
    """The socket's descriptor is pointed at another, unbound socket (what a restore
    that hands back a non-working socket looks like): the hook notices and re-binds at
    the same address; the game's protocol gets the new transport and keeps serving."""
    ep = UdpEndpoint(Echo, ("127.0.0.1", 0), engine=rehydrate_engine, name="t2",
                     probe_timeout=0.3)
    await ep.start()
    addr = ep.address
    try:
        fd = ep.transport.get_extra_info("socket").fileno()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
            os.dup2(other.fileno(), fd)  # the bound socket is gone; the port is free
        assert not await ep.check()
        report = await asyncio.to_thread(rehydrate_engine.simulate_restore)
        assert report.ok, report.table()
        assert ep.rebinds == 1
        assert ep.address == addr
        assert ep.protocol.made == 2 and ep.protocol.lost == 0
        assert await _roundtrip(addr, b"again") == b"echo:again"
    finally:
        ep.close()


async def test_rebind_uses_the_address_callable_again(rehydrate_engine):
    ports = []

    def where():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ("127.0.0.1", ports[-1])

    ep = UdpEndpoint(Echo, where, engine=rehydrate_engine, name="t3", probe_timeout=0.3)
    await ep.start()
    try:
        ep.transport.close()  # dead
        await asyncio.sleep(0)
        assert await ep.ensure()
        assert ep.address == ("127.0.0.1", ports[-1]) and len(ports) == 2
        assert await _roundtrip(ep.address, b"x") == b"echo:x"
    finally:
        ep.close()


async def test_a_closed_udp_endpoint_stays_closed_across_restores(rehydrate_engine):
    """close() did not stick: the next restore "re-bound" the closed endpoint on the same
    port and called the protocol's connection_made after its connection_lost."""
    ep = UdpEndpoint(Echo, ("127.0.0.1", 0), engine=rehydrate_engine, name="t-closed",
                     probe_timeout=0.2)
    await ep.start()
    ep.close()
    await asyncio.sleep(0)  # the loop runs the transport's close
    report = await asyncio.to_thread(rehydrate_engine.simulate_restore)
    assert report.ok, report.table()
    assert ep.rebinds == 0 and ep.protocol.made == 1 and ep.protocol.lost == 1
    await ep.start()  # started again: bound and checked again
    try:
        with pytest.raises(RuntimeError, match="is already started at"):
            await ep.start()
        assert ep.protocol.made == 2
    finally:
        ep.close()


async def test_check_and_ensure_before_start_or_after_close_say_so(rehydrate_engine):
    """ensure() before start() bound the socket itself, with no restore hook, and start()
    then said "already started": the endpoint was never checked after a restore."""
    ep = UdpEndpoint(Echo, ("127.0.0.1", 0), engine=rehydrate_engine, name="early")
    for call in (ep.check, ep.ensure):
        with pytest.raises(RuntimeError, match=rf"^UDP endpoint 'early' is not started: "
                                               rf"await start\(\) before {call.__name__}"):
            await call()
    assert ep.transport is None and ep.rebinds == 0 and ep.protocol.made == 0
    await ep.start()
    try:
        assert ep._hook is not None
        assert await ep.check() and not await ep.ensure()
    finally:
        ep.close()
    await asyncio.sleep(0)  # the loop runs the transport's close
    assert not await ep.check()  # closed: a failed check, as before
    # ensure() after close() bound the socket again while restores skip a closed endpoint
    with pytest.raises(RuntimeError, match=r"^UDP endpoint 'early' is closed: await start\(\) "
                                           r"before ensure\(\)"):
        await ep.ensure()
    assert ep.rebinds == 0 and ep.transport.is_closing()


def test_a_udp_endpoint_whose_loop_stopped_fails_its_hook_saying_so(rehydrate_engine):
    loop = asyncio.new_event_loop()
    ep = UdpEndpoint(Echo, ("127.0.0.1", 0), engine=rehydrate_engine, name="t-stopped")
    loop.run_until_complete(ep.start())  # the loop stops, but is not closed
    try:
        report = rehydrate_engine.simulate_restore()
        (hook,) = [h for h in report.hooks if h.name == "rehydrate.udp.check:t-stopped"]
        assert str(hook.error) == ("UDP endpoint 't-stopped': its event loop is not "
                                   "running, so its socket cannot be checked")
        assert hook.duration < 1.0  # it waited 9 s before, then said "timed out"
    finally:
        ep.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


async def test_a_restore_run_on_the_endpoints_own_loop_fails_its_hook_at_once(
        rehydrate_engine):
    """The hook waited ~9.5 s for the very loop blocked in simulate_restore(), then failed
    with a bare timeout (the engine runs an event from its loop's thread, with a warning)."""
    ep = UdpEndpoint(Echo, ("127.0.0.1", 0), engine=rehydrate_engine, name="t-own")
    await ep.start()
    try:
        report = rehydrate_engine.simulate_restore()  # on this loop's thread
        (hook,) = [h for h in report.hooks if h.name == "rehydrate.udp.check:t-own"]
        assert hook.outcome == "failed"
        assert "the restore was started on its event loop's thread" in str(hook.error)
        assert hook.duration < 1.0
        # from another thread, as the message says, the same endpoint checks fine
        report = await asyncio.to_thread(rehydrate_engine.simulate_restore)
        assert report.ok, report.table()
        assert await _roundtrip(ep.address, b"still") == b"echo:still"
    finally:
        ep.close()


@pytest.mark.parametrize("bad", [0, -1, float("inf"), 1e12, float("nan"), True, "1"])
def test_udp_probe_timeout_must_be_a_sensible_number(bad):
    with pytest.raises(ValueError, match="probe_timeout must be a number of seconds"):
        UdpEndpoint(Echo, ("127.0.0.1", 0), probe_timeout=bad)


def test_session_arguments_that_would_weaken_or_break_are_refused(rehydrate_engine):
    """``derive("x", 0)`` returned an empty key; ``token(123)`` an AttributeError."""
    s = MatchSessions("m-args", engine=rehydrate_engine)
    for bad in (0, 8, 8161, True, "32"):
        with pytest.raises(ValueError, match="length must be a whole number of bytes"):
            s.derive("x", bad)
    assert len(s.derive("x", 16)) == 16
    with pytest.raises(TypeError, match="subject must be a str"):
        s.token(123)
    with pytest.raises(TypeError, match="purpose must be a str"):
        s.derive(b"x")


def test_numpy_integers_are_whole_numbers_of_bytes(rehydrate_engine):
    import numpy as np

    s = MatchSessions("m6", nbytes=np.int64(32), engine=rehydrate_engine)
    assert len(s.derive("chat", np.int64(48))) == 48
    assert s.verify("p1", s.token("p1"))
    with pytest.raises(ValueError, match="nbytes"):
        MatchSessions("m7", nbytes=True, engine=rehydrate_engine)


def test_closed_sessions_say_so(rehydrate_engine):
    """After close() the calls raised "wiped before a snapshot; reloaded after
    restore/resume": no reload ever comes for closed sessions."""
    s = MatchSessions("m-closed", engine=rehydrate_engine)
    tok = s.token("alice")
    s.close()
    with pytest.raises(SecretUnavailable, match=r"sessions:m-closed' is unavailable: closed"):
        s.token("alice")
    with pytest.raises(SecretUnavailable, match="closed"):
        s.derive("chat")
    assert not s.verify("alice", tok)
    assert rehydrate_engine.simulate_restore().ok  # its hooks are gone: nothing reloads it
    assert not s.available


@pytest.mark.parametrize(("nbytes", "shown"), [(2**40, "1099511627776"), (1025, "1025"),
                                               (10**400, "1e+400"), (10**5000, "1e+5000")],
                         ids=["2**40", "1025", "1e400", "1e5000"])
def test_an_absurd_key_size_is_refused_up_front(rehydrate_engine, nbytes, shown):
    """``nbytes=2**40`` ran out of memory inside the key's source: one SecretError
    wrapping a MemoryError, after trying to allocate a terabyte."""
    with pytest.raises(ValueError) as info:
        MatchSessions("huge", nbytes=nbytes, engine=rehydrate_engine)
    assert str(info.value) == ("nbytes must be a whole number of bytes from 16 to 1024, "
                               f"not {shown}")
    s = MatchSessions("huge", nbytes=1024, engine=rehydrate_engine)  # the name stayed free
    assert s.verify("p", s.token("p"))


_NOT_HERE = "192.0.2.1"  # TEST-NET-1: never this host's address, so binding it fails


def _probe_fails(ep: UdpEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint's check says dead: ensure() re-binds."""
    async def dead() -> bool:
        return False

    monkeypatch.setattr(ep, "check", dead)


async def _assert_a_fixed_rebind_fails(engine, monkeypatch: pytest.MonkeyPatch, *,
                                       name: str, bound: str, moved_to: str,
                                       message: Callable[[int], str]) -> None:
    """An endpoint at the fixed address ``bound`` whose check fails once that address is
    ``moved_to``: ensure() raises ``message(port)`` (a regex) and keeps the old socket."""
    ep = UdpEndpoint(Echo, (bound, 0), engine=engine, name=name, probe_timeout=0.3)
    await ep.start()
    try:
        port = ep.address[1]
        _probe_fails(ep, monkeypatch)
        monkeypatch.setattr(ep, "_wanted", lambda: (moved_to, port))
        with pytest.raises(OSError, match=message(port)):
            await ep.ensure()
        assert not ep.transport.is_closing()
    finally:
        ep.close()


async def test_a_failed_rebind_to_a_new_address_keeps_the_old_socket_and_says_why(
        rehydrate_engine, monkeypatch):
    """The old socket was closed before the new bind, which then failed with a bare
    "[Errno 99] Cannot assign requested address": no endpoint, address or hint."""
    where = {"addr": ("127.0.0.1", 0)}
    ep = UdpEndpoint(Echo, lambda: where["addr"], engine=rehydrate_engine, name="moved",
                     probe_timeout=0.3)
    await ep.start()
    try:
        old, port = ep.transport, ep.address[1]
        where["addr"] = (_NOT_HERE, port)
        _probe_fails(ep, monkeypatch)
        with pytest.raises(OSError) as info:
            await ep.ensure()
        assert str(info.value) == (
            f"[Errno {info.value.errno}] UDP endpoint 'moved': binding again at "
            f"{_NOT_HERE}:{port} failed ({os.strerror(info.value.errno)}); local_addr() "
            "returned it: is it this host's address now?")
        assert ep.transport is old and not old.is_closing()
        assert await _roundtrip(("127.0.0.1", port), b"still") == b"echo:still"
    finally:
        ep.close()


async def test_a_failed_rebind_at_a_fixed_address_names_the_fix(rehydrate_engine,
                                                                 monkeypatch):
    await _assert_a_fixed_rebind_fails(
        rehydrate_engine, monkeypatch, name="static", bound="127.0.0.1",
        # what a clone in a new Pod meets: the fixed address is no longer the host's
        moved_to=_NOT_HERE,
        message=lambda port: (
            rf"UDP endpoint 'static': binding again at {_NOT_HERE}:{port} failed "
            rf".*; a fixed address: a clone in a new Pod has another IP; bind "
            rf"\('0\.0\.0\.0', {port}\) or pass local_addr as a callable"))


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


async def test_a_rebind_at_a_name_of_several_addresses_keeps_the_first(
        rehydrate_engine, monkeypatch):
    """local_addr() names a host that resolves to ::1 and 127.0.0.1 (a dual-stack Pod's
    name). The new socket is bound before the old one closes: asyncio, given the name,
    met ::1:P still held, went on to 127.0.0.1:P and bound there, where no client sends."""
    assert _ipv6_loopback(), "this test needs the IPv6 loopback"
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host == "game.test":
            return [(socket.AF_INET6, socket.SOCK_DGRAM, 17, "", ("::1", port, 0, 0)),
                    (socket.AF_INET, socket.SOCK_DGRAM, 17, "", ("127.0.0.1", port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    ep = UdpEndpoint(Echo, lambda: ("game.test", port), engine=rehydrate_engine,
                     name="dual", probe_timeout=0.3)
    await ep.start()
    try:
        assert ep.address == ("::1", port)
        _probe_fails(ep, monkeypatch)
        assert await ep.ensure()
        assert ep.address == ("::1", port)
    finally:
        ep.close()


async def test_a_failed_rebind_at_a_fixed_ipv6_address_brackets_it_and_hints_ipv6(
        rehydrate_engine, monkeypatch):
    """It said "binding again at 2001:db8::1:P" (one IPv6 address, as it reads) and
    hinted an IPv4-only wildcard."""
    assert _ipv6_loopback(), "this test needs the IPv6 loopback"
    await _assert_a_fixed_rebind_fails(
        rehydrate_engine, monkeypatch, name="v6", bound="::1", moved_to="2001:db8::1",
        message=lambda port: (
            rf"UDP endpoint 'v6': binding again at \[2001:db8::1\]:{port} failed "
            rf".*; a fixed address: a clone in a new Pod has another IP; bind "
            rf"\('::', {port}\) or pass local_addr as a callable"))
