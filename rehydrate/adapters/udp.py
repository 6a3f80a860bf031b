"""An asyncio UDP endpoint that is checked after every restore and re-bound when dead.

A restored process keeps its sockets, but not necessarily a working one: a clone in a new
Pod has a new Pod IP, so a socket bound to the old address receives nothing, and a
platform may hand back a socket that no longer delivers. Nothing errors; players just
time out. :class:`UdpEndpoint` wraps ``loop.create_datagram_endpoint``: after every
restore or resume (hook ``rehydrate.udp.check:<name>``, ``NETWORK`` phase) it sends a probe
datagram with a random nonce to its own address from a fresh socket and waits for it to
arrive; when it does not within ``probe_timeout``, the socket is closed and bound again —
to ``local_addr()`` evaluated anew when it is a callable (e.g. reading ``POD_IP``, which
the ``ENVIRONMENT`` phase has refreshed by then). Probe datagrams never reach the game's
protocol. After a re-bind the protocol's ``connection_made`` is called again. The transport
it gets (and :meth:`UdpEndpoint.start` returns) is the endpoint's own, the same object every
time: it sends through whichever socket is bound, so the one the game holds never goes
stale; a send while no socket is open (the old one closed before the new one is bound at
its very address) is dropped with a ``DEBUG`` line, as UDP may drop any datagram. Its
write-buffer limits and paused reading are applied to each new socket; datagrams read
while the game has paused reading (by a check, or drained from a replaced socket) are kept
and delivered after ``resume_reading()``, in the order read, and dropped with the socket
(``close()``, ``abort()``, the socket lost, a new ``start()``). Where the socket's
transport cannot pause reading (Python 3.10's raises ``NotImplementedError``), the socket
is read on and the endpoint keeps what the paused game does not read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import ipaddress
import logging
import numbers
import os
import socket
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from rehydrate import Phase
from rehydrate.extensions import Engine, loop_blocked, resolve_engine, shown

__all__ = ["UdpEndpoint"]

log = logging.getLogger("rehydrate.udp")

Address = tuple[str, int]
_Where = tuple[Any, ...]
"""An address to bind: ``(host, port)``, or a full IPv6 socket name ``(host, port,
flowinfo, scope_id)`` (a link-local address needs its scope id)."""
_WILDCARDS = ("0.0.0.0", "::", "")  # noqa: S104 - recognising a wildcard bind
_PROBE = b"\0rehydrate-udp-probe\0"
_MAX_PROBE_TIMEOUT = 3600.0  # a probe waits for one datagram to itself: an hour is absurd
_BUSY_WAIT = 5.0
"""Seconds a check waits beyond ``probe_timeout`` while the socket keeps delivering
datagrams queued ahead of its probe (the hook waits ``probe_timeout`` + 9 s)."""
_DRAIN_MAX = 100_000  # datagrams taken from a socket about to be closed: its queue, no flood
_HELD_MAX = 4 << 20
"""Bytes of datagrams kept for a game that paused reading (read by a check, or drained
from a socket being replaced); beyond it they are dropped, as a full socket buffer would."""
_HELD_OVERHEAD = 256
"""Bytes each kept datagram counts beyond its payload (its tuple, bytes object and address:
~215 bytes in CPython), as the kernel charges a socket buffer per packet: without it a
flood of empty datagrams was kept without limit."""


@runtime_checkable
class _FlowControl(Protocol):
    """What asyncio's datagram transports have beyond ``DatagramTransport``'s API."""

    def is_reading(self) -> bool: ...
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def get_write_buffer_size(self) -> int: ...
    def get_write_buffer_limits(self) -> tuple[int, int]: ...
    def set_write_buffer_limits(self, high: int | None = None,
                                low: int | None = None) -> None: ...


def _flow(transport: asyncio.BaseTransport | None) -> _FlowControl | None:
    return transport if isinstance(transport, _FlowControl) else None


def _pausable(transport: asyncio.BaseTransport | None) -> _FlowControl | None:
    """``transport`` when it can really pause reading. Python 3.10's datagram transport
    has the methods only from ``asyncio.ReadTransport``, where they raise
    ``NotImplementedError``: the endpoint then keeps a paused game's datagrams itself."""
    flow = _flow(transport)
    if flow is None:
        return None
    for name in ("pause_reading", "resume_reading", "is_reading"):
        if getattr(type(flow), name, None) is getattr(asyncio.ReadTransport, name):
            return None
    return flow


_ADDRESS_RULE = ("a (host, port) tuple — host a str, bytes or None, port a whole number from "
                 "0 to 65535 (also as a string of digits) — or an IPv6 (host, port, "
                 "flowinfo, scope_id)")


def _address(value: object) -> _Where | None:
    """``value`` as an address to bind (a list, as a JSON config gives it, as a tuple), or
    None when it is not one. asyncio's own errors for those named neither the endpoint nor
    the rule: ``"10.0.0.5:7777"`` said "AF_INET6 address must be tuple", a 3-tuple that the
    host name did not resolve, and ``True`` as the port bound port 1."""
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, tuple) or len(value) not in (2, 4):
        return None
    host, port = value[0], value[1]
    if port is None:
        port = 0  # asyncio binds None as any port
    elif isinstance(port, str) and port.strip().isdigit():
        port = int(port)  # read from the environment: ("0.0.0.0", os.environ["PORT"])
    if (not (host is None or isinstance(host, (str, bytes))) or isinstance(port, bool)
            or not isinstance(port, numbers.Integral) or not 0 <= int(port) <= 65535):
        return None
    return (host, int(port), *value[2:])


def _described(value: object) -> str:
    """What ``value`` is, not what it says (an address read from the environment)."""
    kind = type(value).__name__
    if isinstance(value, (tuple, list)):
        # a port may be shown: an int's value is no secret worth the confusion
        parts = (str(v) if type(v) is int else type(v).__name__ for v in value[:4])
        return f"a {kind} of {len(value)}: " + ", ".join(parts)
    return f"a {kind}"


def _write_limits(high: int | None, low: int | None) -> tuple[int, int]:
    """``(low, high)`` as asyncio computes them, for a limit set while no socket is open."""
    if high is None:
        high = 64 * 1024 if low is None else 4 * low
    if low is None:
        low = high // 4
    if not high >= low >= 0:
        raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
    return low, high


class _Filter(asyncio.DatagramProtocol):
    """Passes datagrams to the game's protocol, except the endpoint's own probes."""

    def __init__(self, endpoint: UdpEndpoint) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.DatagramTransport) -> None:  # type: ignore[override]
        self.transport = transport
        endpoint = self.endpoint
        # The stable transport sends through the new socket from here on, before the game
        # hears of it (it may send from connection_made itself).
        endpoint._attach(transport)
        # What the game set on the transport it holds applies to every socket behind it;
        # here asyncio has not started reading the new one yet.
        flow = endpoint._flow
        if flow is not None:
            low, high = endpoint._write_limits
            flow.set_write_buffer_limits(high=high, low=low)
        reader = endpoint._reader
        if reader is not None and not endpoint._reading:
            reader.pause_reading()
        if endpoint._writing_paused:
            # the full buffer was the old socket's: the new one has room
            endpoint._writing_paused = False
            endpoint.protocol.resume_writing()
        endpoint.protocol.connection_made(endpoint._stable)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        endpoint = self.endpoint
        if data.startswith(_PROBE):
            waiter = endpoint._probes.get(data)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
        if self.transport is endpoint.transport:
            endpoint._received += 1  # the socket being checked reads: see check()
        # Read by a check (or a socket that cannot pause): the game gets it on resume.
        # While older ones are kept, it waits behind them, resumed or not.
        if not endpoint._reading or endpoint._held:
            endpoint._hold(data, addr)
            return
        endpoint.protocol.datagram_received(data, addr)

    def error_received(self, exc: Exception) -> None:
        self.endpoint.protocol.error_received(exc)

    # Only the current socket's: the game sends through no other.
    def pause_writing(self) -> None:
        if self.transport is self.endpoint.transport and not self.endpoint._writing_paused:
            self.endpoint._writing_paused = True
            self.endpoint.protocol.pause_writing()

    def resume_writing(self) -> None:
        if self.transport is self.endpoint.transport and self.endpoint._writing_paused:
            self.endpoint._writing_paused = False
            self.endpoint.protocol.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        endpoint = self.endpoint
        # A re-bind's old socket is not the end of the endpoint; close() during a re-bind
        # is, for the socket it closed.
        if not endpoint._rebinding or (endpoint._closed
                                       and self.transport is endpoint.transport):
            # Lost without close()/abort() (which drop them): a resume_reading() before
            # the next start() handed them over after the game's connection_lost.
            endpoint._drop_held()
            endpoint.protocol.connection_lost(exc)


class _StableTransport(asyncio.DatagramTransport):
    """The transport the game holds (``start()``'s value, ``connection_made``'s argument):
    it sends through the endpoint's current socket, so that it stays usable across a
    re-bind. A send while no socket is open (between closing the old socket and binding
    the new one at the same address) is dropped with a ``DEBUG`` line — UDP may drop any
    datagram — where the closed asyncio transport raised an internal ``AttributeError``.

    Flow control (write-buffer limits, ``pause_reading()``) is the endpoint's state,
    applied to every socket bound for it, so that it survives a re-bind."""

    def __init__(self, endpoint: UdpEndpoint) -> None:
        super().__init__()
        self._endpoint = endpoint

    def _current(self) -> asyncio.DatagramTransport | None:
        transport = self._endpoint.transport
        return None if transport is None or transport.is_closing() else transport

    def sendto(self, data: Any, addr: Any = None) -> None:
        transport = self._current()
        if transport is None:
            log.debug("UDP endpoint %s: no open socket (closed, or being bound again): "
                      "datagram of %d bytes dropped", self._endpoint.name, len(data))
            return
        transport.sendto(data, addr)

    def abort(self) -> None:
        self._endpoint._closed = True
        self._endpoint._drop_held()  # as aborting a socket drops what it holds
        transport = self._endpoint.transport
        if transport is not None:
            transport.abort()

    def close(self) -> None:
        self._endpoint.close()

    def is_closing(self) -> bool:
        transport = self._endpoint.transport
        return (self._endpoint._closed or transport is None
                or (transport.is_closing() and not self._endpoint._rebinding))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        transport = self._endpoint.transport
        return default if transport is None else transport.get_extra_info(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._endpoint.protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        raise NotImplementedError("a UdpEndpoint's protocol is the one it was made with")

    # Flow control: the state is the endpoint's, applied to every socket bound for it.

    def get_write_buffer_size(self) -> int:
        flow = self._endpoint._flow
        return 0 if flow is None else flow.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._endpoint._write_limits

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        limits = _write_limits(high, low)
        self._endpoint._write_limits = limits
        flow = self._endpoint._flow
        if flow is not None and self._current() is not None:
            flow.set_write_buffer_limits(high=limits[1], low=limits[0])

    def is_reading(self) -> bool:
        return self._endpoint._reading and not self.is_closing()

    def pause_reading(self) -> None:
        endpoint = self._endpoint
        if not endpoint._reading:
            return
        reader = endpoint._reader
        if (reader is not None and self._current() is not None
                and not endpoint._checking):  # a check reads until it ends
            reader.pause_reading()
        endpoint._reading = False

    def resume_reading(self) -> None:
        endpoint = self._endpoint
        if endpoint._reading:
            return
        if endpoint._held and endpoint.loop is not None:
            # not from within the game's own call; the socket is read again after them
            endpoint.loop.call_soon(endpoint._deliver_held)
        else:
            endpoint._resume_socket()
        endpoint._reading = True


class UdpEndpoint:
    """A UDP socket for ``protocol_factory`` at ``local_addr`` (a ``(host, port)`` pair,
    or a callable returning one, evaluated at every bind). Anything else (``"host:port"``,
    a port that is no whole number from 0 to 65535, ``True`` included) is a
    ``ValueError`` naming the endpoint — here, or from the bind when the callable returned
    it (its type is named, not its value); a list (a JSON config's) is taken as a tuple.

    ``await endpoint.start()`` binds it on the running loop and registers the restore
    hook with ``engine`` (default: the process-wide engine). ``check()`` probes it,
    ``ensure()`` probes and re-binds when dead (both ``RuntimeError`` before ``start()``),
    ``close()`` closes it.
    """

    def __init__(
        self,
        protocol_factory: Callable[[], asyncio.DatagramProtocol],
        local_addr: Address | Callable[[], Address],
        *,
        name: str = "game",
        probe_timeout: float = 0.5,
        engine: Engine | None = None,
    ) -> None:
        if (isinstance(probe_timeout, bool) or not isinstance(probe_timeout, (int, float))
                or not 0 < probe_timeout <= _MAX_PROBE_TIMEOUT):
            raise ValueError(f"probe_timeout must be a number of seconds > 0 and at most "
                             f"{_MAX_PROBE_TIMEOUT:.0f}, not {shown(probe_timeout)}")
        if not callable(local_addr):
            where = _address(local_addr)
            if where is None:
                raise ValueError(f"UDP endpoint {name!r}: local_addr must be {_ADDRESS_RULE}, "
                                 f"or a callable returning one, not {shown(local_addr)}")
            local_addr = where
        self.protocol = protocol_factory()
        self._local_addr: _Where | Callable[[], Address] = local_addr
        self.name = name
        self.probe_timeout = float(probe_timeout)
        self._engine_arg = engine
        self.transport: asyncio.DatagramTransport | None = None
        """The current socket's asyncio transport (replaced by a re-bind): send through
        the one :meth:`start` returns instead."""
        self._flow: _FlowControl | None = None
        self._reader: _FlowControl | None = None
        """``transport``'s flow control, and whether it can really pause reading, decided
        once per socket by :meth:`_attach`: a runtime Protocol's ``isinstance`` looks up
        every method on each call, and they were asked at every pause, resume and check."""
        self._stable = _StableTransport(self)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._probes: dict[bytes, asyncio.Future[None]] = {}
        self._received = 0
        """Datagrams the game got from the current socket (a check's sign of progress)."""
        self._rebind_done: asyncio.Future[bool | None] | None = None
        """While :meth:`ensure` binds again: its outcome, for a concurrent ``ensure()``."""
        self._hook: Any = None
        self._engine: Engine | None = None
        self._closed = False
        self._reading = True
        """Whether the game reads (``pause_reading()`` on its transport clears it)."""
        self._checking = 0
        self._held: deque[tuple[bytes, Any]] = deque()
        self._held_bytes = 0
        self._write_limits = _write_limits(None, None)
        self._writing_paused = False
        self.rebinds = 0
        """How many times the socket was bound again after a failed check."""

    @property
    def _rebinding(self) -> bool:
        """Whether :meth:`ensure` is binding the socket again."""
        return self._rebind_done is not None

    @property
    def address(self) -> Address:
        """The bound ``(host, port)``."""
        if self.transport is None:
            raise RuntimeError(f"UDP endpoint {self.name!r} is not started")
        host, port = self.transport.get_extra_info("sockname")[:2]
        return str(host), int(port)

    def _wanted(self) -> _Where:
        return self._returned(self._local_addr()) if callable(
            self._local_addr) else self._local_addr

    def _returned(self, value: object) -> _Where:
        """What a callable ``local_addr`` returned, as an address, else ``ValueError``."""
        where = _address(value)
        if where is None:
            # Its type, not its value: it is often read from the environment.
            raise ValueError(f"UDP endpoint {self.name!r}: local_addr() returned "
                             f"{_described(value)}, not {_ADDRESS_RULE}")
        return where

    async def _open(self, addr: _Where) -> asyncio.DatagramTransport:
        loop = asyncio.get_running_loop()
        if len(addr) <= 2:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _Filter(self), local_addr=addr)
            return transport
        # A full IPv6 name (a link-local address's scope id): asyncio takes a 2-tuple only.
        sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.bind(addr)
            transport, _ = await loop.create_datagram_endpoint(lambda: _Filter(self),
                                                               sock=sock)
        except BaseException:
            sock.close()
            raise
        return transport

    def _attach(self, transport: asyncio.DatagramTransport) -> None:
        """Make ``transport`` the current socket's (``self.transport`` is set here only)."""
        self.transport = transport
        self._flow = _flow(transport)
        self._reader = _pausable(transport)

    def _bound(self, transport: asyncio.DatagramTransport) -> None:
        self._attach(transport)
        self.loop = asyncio.get_running_loop()
        if not callable(self._local_addr):
            # port 0 meant "any": bind again where the clients already send. The whole
            # name: (host, port) alone lost a link-local address's scope id (EINVAL).
            self._local_addr = tuple(transport.get_extra_info("sockname"))

    async def start(self) -> asyncio.DatagramTransport:
        """Bind the socket and register the restore hook (once). Returns the endpoint's
        transport — the one the protocol's ``connection_made`` gets too —, which sends
        through whichever socket is bound, across re-binds. A host name in ``local_addr``
        that does not resolve raises ``socket.gaierror`` naming the endpoint and the name;
        a failed bind (a port in use, an address this host does not have) an ``OSError``
        with its errno, naming the endpoint and the address (nothing is bound then)."""
        if self.transport is not None and not self.transport.is_closing():
            raise RuntimeError(f"UDP endpoint {self.name!r} is already started at "
                               f"{self.address}")
        # before binding: a wrong engine= (TypeError) left a socket bound and no restore
        # hook, and the next start() said "already started"
        engine = (self._engine if self._engine is not None
                  else resolve_engine(self._engine_arg))
        was_closed, self._closed = self._closed, False
        # a new connection for the game, as asyncio's fresh transport was; limits are kept
        self._reading, self._writing_paused = True, False
        self._drop_held()  # the last session's, not this one's
        try:
            addr = self._wanted()
            try:
                self._bound(await self._open(addr))
            except socket.gaierror as exc:
                # a bare "[Errno -2] Name or service not known" named neither
                raise socket.gaierror(exc.errno, f"UDP endpoint {self.name!r}: the host "
                                                 f"name {addr[0]!r} in local_addr does not "
                                                 f"resolve ({exc.strerror or exc})") from exc
            except OSError as exc:
                # a bare "[Errno 98] Address already in use" named neither the endpoint
                # nor the port (asyncio's datagram endpoint says no more than the kernel)
                raise self._bind_failed(addr, exc, again=False) from exc
        except BaseException:
            # closed it stays: the next restore's hook re-bound an endpoint whose start()
            # had raised, and the game got connection_made after its connection_lost
            self._closed = was_closed
            raise
        if self._hook is None:
            self._engine = engine
            ref = weakref.ref(self)

            def check_udp_socket() -> None:
                endpoint = ref()
                if endpoint is not None:
                    endpoint._ensure_from_hook()

            self._hook = engine.builtins.register(
                check_udp_socket, phase=Phase.NETWORK, timeout=self.probe_timeout + 10.0,
                name=f"rehydrate.udp.check:{self.name}")
            weakref.finalize(self, engine.builtins.unregister, self._hook)
        return self._stable

    def _ensure_from_hook(self) -> None:
        loop = self.loop
        if self._closed or loop is None or self.transport is None or loop.is_closed():
            return  # closed by the application: nothing to keep working
        if not loop.is_running():
            raise RuntimeError(f"UDP endpoint {self.name!r}: its event loop is not running, "
                               "so its socket cannot be checked")
        if loop_blocked(loop):
            # The check needs that loop, which is blocked waiting for this very hook (a
            # simulate_restore() or trigger_snapshot() called on it): it would only time
            # out (~9 s) and fail anyway.
            raise RuntimeError(
                f"UDP endpoint {self.name!r}: the restore was started on its event loop's "
                "thread, which waits for it, so its socket cannot be checked; start it "
                "from another thread (e.g. await asyncio.to_thread(...))")
        limit = self.probe_timeout + 9.0
        fut = asyncio.run_coroutine_threadsafe(self.ensure(), loop)
        try:
            fut.result(limit)
        except concurrent.futures.TimeoutError:
            # Not cancelled: cancelling between closing the old socket and binding the new
            # one would leave none; left to finish, a late re-bind still recovers it.
            raise RuntimeError(f"UDP endpoint {self.name!r}: its event loop did not check "
                               f"the socket within {limit:g}s") from None

    async def check(self) -> bool:
        """True when a datagram sent to the socket's address arrives within
        ``probe_timeout`` (False once closed). ``RuntimeError`` before :meth:`start`.

        asyncio reads one datagram per pass of the loop, so a probe queued behind a
        backlog of the game's datagrams may take longer: while the socket keeps delivering
        datagrams, the check sends a fresh probe (the first may have met a full buffer)
        and waits another ``probe_timeout``, up to 5 s more in all. Datagrams alone are no
        proof — a socket left at an old Pod IP still delivers what was queued in it before
        the checkpoint —: only a probe is. A wildcard bind is probed on loopback, a
        dual-stack ``::`` one at ``::1`` and at ``127.0.0.1`` (IPv6 may be off on
        loopback). A socket the game paused reading is read for the check; the game's
        datagrams read meanwhile are kept until it calls ``resume_reading()``."""
        transport = self.transport
        if transport is None:
            raise self._not_started("check")
        if transport.is_closing():
            return False
        name = transport.get_extra_info("sockname")
        host, port = str(name[0]), int(name[1])
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # the whole name: a link-local address is reached only with its scope id
        targets: list[tuple[int, _Where]] = [(family, tuple(name))]
        if host in _WILDCARDS:  # a wildcard bind answers on loopback
            targets = [(family, ("::1" if family == socket.AF_INET6 else "127.0.0.1", port))]
            if family == socket.AF_INET6 and self._dual_stack(transport):
                # IPv4 clients reach it too, and ::1 may be unusable (IPv6 disabled on
                # loopback, as in many IPv4-only clusters): a probe fails only where none
                # can be sent
                targets.append((socket.AF_INET, ("127.0.0.1", port)))
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        nonces: list[bytes] = []
        give_up = loop.time() + self.probe_timeout + _BUSY_WAIT
        with contextlib.ExitStack() as stack:
            # A game that paused reading would have its healthy socket taken for dead:
            # the check reads it, keeping the game's datagrams until it resumes.
            # registered first: a resume_reading() that raised left the count raised,
            # and pause_reading() never paused the socket again
            self._checking += 1
            reader = self._reader  # transport's: no await since it was read
            stack.callback(self._checked, reader)
            if reader is not None:
                reader.resume_reading()
            probes = []
            for fam, dest in targets:
                try:
                    probe = stack.enter_context(socket.socket(fam, socket.SOCK_DGRAM))
                except OSError:
                    continue
                probe.setblocking(False)
                probes.append((probe, dest))
            try:
                while True:
                    sent = False
                    for probe, dest in probes:
                        nonce = _PROBE + os.urandom(16)
                        nonces.append(nonce)
                        self._probes[nonce] = waiter  # any of them arriving is the proof
                        try:
                            probe.sendto(nonce, dest)
                        except OSError as exc:
                            log.debug("UDP endpoint %s: probe to %s not sent: %s",
                                      self.name, dest[0], exc)
                        else:
                            sent = True
                    if not sent:
                        return False
                    seen = self._received
                    try:
                        await asyncio.wait_for(asyncio.shield(waiter), self.probe_timeout)
                        return True
                    except asyncio.TimeoutError:
                        if (self._received == seen or transport is not self.transport
                                or loop.time() >= give_up):
                            return False
            finally:
                for nonce in nonces:
                    self._probes.pop(nonce, None)
        return False  # pragma: no cover - the loop above returns

    def _checked(self, reader: _FlowControl | None) -> None:
        """A check of the socket ``reader`` reads has ended (that socket may have been
        replaced since)."""
        self._checking -= 1
        if reader is not None and not self._reading and not self._checking:
            reader.pause_reading()

    def _hold(self, data: bytes, addr: Any) -> None:
        cost = len(data) + _HELD_OVERHEAD
        if self._held_bytes + cost > _HELD_MAX:
            log.debug("UDP endpoint %s: reading paused and %d bytes kept: datagram of %d "
                      "bytes dropped", self.name, self._held_bytes, len(data))
            return
        self._held.append((data, addr))
        self._held_bytes += cost

    def _drop_held(self) -> None:
        self._held.clear()
        self._held_bytes = 0

    def _deliver_held(self) -> None:
        """The datagrams kept while the game did not read, then the socket read again."""
        while self._held and self._reading:
            data, addr = self._held.popleft()
            self._held_bytes -= len(data) + _HELD_OVERHEAD
            try:
                self.protocol.datagram_received(data, addr)
            except Exception:
                log.exception("UDP endpoint %s: the protocol's datagram_received failed",
                              self.name)
        if self._reading:
            self._resume_socket()

    def _resume_socket(self) -> None:
        reader = self._reader
        if reader is not None and not self._closed:
            reader.resume_reading()

    @staticmethod
    def _dual_stack(transport: asyncio.DatagramTransport) -> bool:
        """Whether an IPv6 socket takes IPv4 datagrams too (``IPV6_V6ONLY`` off)."""
        sock = transport.get_extra_info("socket")
        try:
            return not sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
        except (AttributeError, OSError):
            return False

    async def ensure(self) -> bool:
        """Check the socket; re-bind it when the check fails. True when it was re-bound;
        False, nothing bound, also when :meth:`close` came while it checked (or resolved a
        host name) or another ``ensure()`` bound the socket again meanwhile (one still
        binding it is waited for, and its error raised here too).
        The new socket is bound before the old one is closed (unless the old one holds
        that very address), so a failed bind leaves the old one open; a host name (from
        a callable ``local_addr``) is bound at its first address of the old socket's
        family, and only there. Raises ``OSError`` naming the endpoint, the address and
        what to do when binding again fails (the hook then fails, and the process is not
        ready; ``socket.gaierror`` when the host name does not resolve), ``RuntimeError``
        before :meth:`start`, after :meth:`close` and when a callable ``local_addr`` raises
        (naming the endpoint; the old socket is kept)."""
        if self.transport is None:
            # It bound the socket itself, with no restore hook, and start() then said
            # "already started": the endpoint was never checked after a restore.
            raise self._not_started("ensure")
        if self._closed:
            # it bound again a socket nothing checks any more (restores skip a closed one)
            raise RuntimeError(f"UDP endpoint {self.name!r} is closed: await start() "
                               "before ensure()")
        old = self.transport
        if await self.check():
            return False
        running = self._rebind_done
        if running is not None and self.transport is old and not self._closed:
            # Another ensure() is binding it again: its failure is this one's too (the
            # restore's hook said ok, and the process ready, with the socket dead).
            if await asyncio.shield(running) is None:
                # that call was cancelled mid-way (the application's own wait_for()):
                # nothing bound, and the socket is still dead — this one starts over
                return await self.ensure()
            return False
        if self._closed or self._rebinding or self.transport is not old:
            # close() while the check waited: binding again would hand the game a socket
            # after its connection_lost and keep the port after close(); or another
            # ensure() has bound it again: the new socket is not the dead one.
            return False
        where = None
        with contextlib.suppress(Exception):
            where = self.address
        log.warning("UDP socket %s at %s does not receive after the restore: binding again",
                    self.name, where)
        done = self._rebind_done = asyncio.get_running_loop().create_future()
        try:
            rebound = await self._rebind(old)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                # only this call was cancelled: one waiting on it was not, and binds again
                # itself (None: "start over")
                done.set_result(None)
            else:
                done.set_exception(exc)
                done.exception()  # retrieved: no "never retrieved" log when nobody waits
            raise
        else:
            done.set_result(rebound)
        finally:
            self._rebind_done = None
        if not rebound:
            return False
        self.rebinds += 1
        log.info("UDP socket %s bound again at %s", self.name, self.address)
        return True

    async def _rebind(self, old: asyncio.DatagramTransport) -> bool:
        """The new socket bound before the old one is closed, so that a failed bind (a
        fixed address the host no longer has) leaves the old one as it was; only when the
        old one holds the very address (the same address and port, or a wildcard bind) is
        it closed first. False, with nothing bound, when :meth:`close` came meanwhile."""
        wanted = self._local_addr
        if callable(wanted):
            try:
                value = wanted()
            except Exception as exc:
                # a bare KeyError: 'POD_IP' said neither what was called nor for what
                raise RuntimeError(f"UDP endpoint {self.name!r}: local_addr() raised "
                                   f"{shown(exc)}, so the socket cannot be bound "
                                   "again") from exc
            addr = self._returned(value)
        else:
            addr = self._wanted()
        try:
            at = await self._first_address(addr, old)
            if self._closed:  # while the host name resolved
                return False
            try:
                new = await self._open(at)
            except OSError as exc:
                # Only the old socket's own bind may be closed to make room: a port
                # another socket took stays taken, and the old one stays as it was.
                if exc.errno != errno.EADDRINUSE or not self._holds(old, at):
                    raise
                self._drain(old)
                old.close()
                await asyncio.sleep(0)  # let the loop drop the old reader before binding
                if self._closed:
                    return False
                new = await self._open(at)
        except OSError as exc:
            raise self._bind_failed(addr, exc) from exc
        self._bound(new)
        self._drain(old)
        old.close()
        await asyncio.sleep(0)  # the old transport's connection_lost, while _rebinding
        return True

    @staticmethod
    def _holds(old: asyncio.DatagramTransport, at: _Where) -> bool:
        """Whether ``old``'s socket is bound where binding ``at`` conflicts with it: the
        same port, at the same address or with either a wildcard. Asked of the socket
        itself (a dead one may be bound elsewhere, or nowhere, by now)."""
        sock = old.get_extra_info("socket")
        try:
            name = sock.getsockname()
        except (AttributeError, OSError):
            return False
        if name[1] != at[1]:
            return False
        mine, wanted = str(name[0]), str(at[0])
        if mine in _WILDCARDS or wanted in _WILDCARDS:
            return True
        try:
            return (ipaddress.ip_address(mine.split("%", 1)[0])
                    == ipaddress.ip_address(wanted.split("%", 1)[0]))
        except ValueError:
            return mine == wanted

    def _drain(self, old: asyncio.DatagramTransport) -> None:
        """Hand the game the datagrams still queued in ``old``, about to be closed: a
        socket judged dead may still hold what clients sent before it stopped receiving,
        which closing it threw away."""
        sock = old.get_extra_info("socket")
        if sock is None or old.is_closing():
            return
        try:
            dup = socket.socket(fileno=os.dup(sock.fileno()))
        except OSError:
            return
        with dup:
            dup.setblocking(False)
            for _ in range(_DRAIN_MAX):
                try:
                    data, addr = dup.recvfrom(65536)
                except OSError:  # BlockingIOError: the queue is empty
                    return
                if data.startswith(_PROBE):
                    continue
                if not self._reading or self._held:  # after those kept, in order
                    self._hold(data, addr)
                    continue
                try:
                    self.protocol.datagram_received(data, addr)
                except Exception:
                    log.exception("UDP endpoint %s: the protocol's datagram_received failed",
                                  self.name)

    @staticmethod
    async def _first_address(addr: _Where, old: asyncio.DatagramTransport) -> _Where:
        """The one address a host name in ``addr`` stands for: the first it resolves to
        of the old socket's family (else the first). Given the name, asyncio tries every
        address in turn: the first (``::1``) was still held by the old socket, so the new
        one went to the next (``127.0.0.1``) where no client sends."""
        host, port = addr[0], addr[1]
        if host == "":
            return addr
        if host is not None:  # None: the loopback addresses, as getaddrinfo() has it
            try:
                ipaddress.ip_address(str(host).split("%", 1)[0])
            except ValueError:
                pass
            else:
                return addr  # an address already: nothing to choose
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_DGRAM)
        if not infos:
            raise OSError(errno.EADDRNOTAVAIL, f"{host} resolves to no address")
        sock = old.get_extra_info("socket")
        family = getattr(sock, "family", None)
        first = next((i for i in infos if i[0] == family), infos[0])
        return str(first[4][0]), port

    def _bind_failed(self, addr: _Where, exc: OSError, *, again: bool = True) -> OSError:
        """``exc`` with the endpoint, the address and what to do (a bare "[Errno 99]
        Cannot assign requested address" said none of them), chosen by its errno.
        ``again``: a re-bind after a restore (else :meth:`start`'s first bind)."""
        host = str(addr[0])
        v6 = ":" in host
        hint: str | None = None
        if isinstance(exc, socket.gaierror):
            hint = "the host name does not resolve"
            if callable(self._local_addr):
                hint += " (local_addr() returned it)"
        elif exc.errno == errno.EADDRINUSE:
            hint = "the port is taken by another socket"
        elif exc.errno != errno.EADDRNOTAVAIL or host in _WILDCARDS:
            pass  # not "no such address here": an IP change is not the cause
        elif not again:
            hint = "not an address of this host"
        elif callable(self._local_addr):
            hint = "local_addr() returned it: is it this host's address now?"
        else:
            wildcard = "::" if v6 else "0.0.0.0"  # noqa: S104 - the fix the hint names
            hint = (f"a fixed address: a clone in a new Pod has another IP; bind "
                    f"({wildcard!r}, {addr[1]}) or pass local_addr as a callable "
                    f"(e.g. lambda: (os.environ['POD_IP'], {addr[1]})), evaluated at "
                    f"every bind")
        # [2001:db8::1]:7777, not 2001:db8::1:7777 (which reads as one IPv6 address)
        where = f"[{host}]:{addr[1]}" if v6 else f"{host}:{addr[1]}"
        reason = exc.strerror or str(exc) or type(exc).__name__
        tail = "" if hint is None else f"; {hint}"
        # a gaierror stays one, for a caller that tells a name apart from a bind
        kind = socket.gaierror if isinstance(exc, socket.gaierror) else OSError
        binding = "binding again" if again else "binding"
        return kind(exc.errno, f"UDP endpoint {self.name!r}: {binding} at {where} "
                               f"failed ({reason}){tail}")

    def _not_started(self, what: str) -> RuntimeError:
        return RuntimeError(f"UDP endpoint {self.name!r} is not started: await start() "
                            f"before {what}()")

    def close(self) -> None:
        """Close the socket (the protocol's ``connection_lost`` is called); restores no
        longer check or re-bind it, until :meth:`start` binds it again."""
        self._closed = True
        self._drop_held()  # as closing a socket drops what it holds
        if self.transport is not None:
            self.transport.close()
