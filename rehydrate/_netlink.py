"""A minimal rtnetlink client (stdlib only): dump links and routes, replace routes in bulk.

Used by :mod:`rehydrate.routes` as its default backend because re-applying hundreds of
routes must take milliseconds: every route is one ``RTM_NEWROUTE`` with
``NLM_F_CREATE | NLM_F_REPLACE`` — exactly what pyroute2's ``route("replace", ...)`` and
``ip route replace`` send — and all of them go out in one batch, then the ACKs are
collected. (pyroute2 0.9 spends about a millisecond of Python per route.)
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWROUTE, RTM_GETROUTE = 24, 26
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK = 0x1, 0x2, 0x4
NLM_F_DUMP = 0x300
NLM_F_REPLACE, NLM_F_CREATE = 0x100, 0x400
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PRIORITY, RTA_PREFSRC = 1, 4, 5, 6, 7
RTA_MULTIPATH, RTA_TABLE = 9, 15
IFLA_IFNAME = 3
RTPROT_STATIC = 4

_NLMSGHDR = struct.Struct("=IHHII")
_RTMSG = struct.Struct("=BBBBBBBBI")
_IFINFOMSG = struct.Struct("=BxHiII")
_RTATTR = struct.Struct("=HH")
_BATCH_BYTES = 200_000


def _align(n: int) -> int:
    return (n + 3) & ~3


def _attr(kind: int, data: bytes) -> bytes:
    length = _RTATTR.size + len(data)
    return _RTATTR.pack(length, kind) + data + b"\0" * (_align(length) - length)


def _attrs(buf: bytes, off: int, end: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    while off + _RTATTR.size <= end:
        length, kind = _RTATTR.unpack_from(buf, off)
        if length < _RTATTR.size:
            break
        out[kind & 0x3FFF] = buf[off + _RTATTR.size: off + length]
        off += _align(length)
    return out


@dataclass(frozen=True)
class RawRoute:
    family: int
    dst: str | None
    dst_len: int
    table: int
    proto: int
    scope: int
    type: int
    gateway: str | None
    oif: int | None
    priority: int | None
    prefsrc: str | None
    multipath: bool


class NetlinkError(OSError):
    pass


class Netlink:
    """One NETLINK_ROUTE socket. Not thread-safe; close it when done."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
            self.sock.bind((0, 0))
        except OSError:
            self.sock.close()
            raise
        self._seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Netlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _messages(self) -> Iterator[tuple[int, int, int, bytes]]:
        """(type, flags, seq, payload) of each message received, forever."""
        while True:
            buf = self.sock.recv(1 << 20)
            off = 0
            while off + _NLMSGHDR.size <= len(buf):
                length, mtype, flags, seq, _ = _NLMSGHDR.unpack_from(buf, off)
                if length < _NLMSGHDR.size:
                    break
                yield mtype, flags, seq, buf[off + _NLMSGHDR.size: off + length]
                off += _align(length)

    def _dump(self, mtype: int, body: bytes) -> list[tuple[int, bytes]]:
        seq = self._next()
        msg = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), mtype, NLM_F_REQUEST | NLM_F_DUMP,
                             seq, 0) + body
        self.sock.send(msg)
        out: list[tuple[int, bytes]] = []
        for rtype, _flags, rseq, payload in self._messages():
            if rseq != seq:
                continue
            if rtype == NLMSG_DONE:
                return out
            if rtype == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", payload)
                if code:
                    raise NetlinkError(-code, os.strerror(-code))
                return out
            out.append((rtype, payload))
        return out  # pragma: no cover - the generator never ends by itself

    def links(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for rtype, payload in self._dump(RTM_GETLINK, _IFINFOMSG.pack(0, 0, 0, 0, 0)):
            if rtype != RTM_NEWLINK:
                continue
            _fam, _type, index, _flags, _change = _IFINFOMSG.unpack_from(payload)
            name = _attrs(payload, _IFINFOMSG.size, len(payload)).get(IFLA_IFNAME)
            if name is not None:
                out[index] = name.rstrip(b"\0").decode()
        return out

    def routes(self, family: int) -> list[RawRoute]:
        out: list[RawRoute] = []
        body = _RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0)
        for rtype, payload in self._dump(RTM_GETROUTE, body):
            if rtype != RTM_NEWROUTE:
                continue
            fam, dst_len, _src_len, _tos, table, proto, scope, kind, _flags = \
                _RTMSG.unpack_from(payload)
            a = _attrs(payload, _RTMSG.size, len(payload))

            def addr(key: int, fam: int = fam, a: dict[int, bytes] = a) -> str | None:
                raw = a.get(key)
                return socket.inet_ntop(fam, raw) if raw is not None else None

            def u32(key: int, a: dict[int, bytes] = a) -> int | None:
                raw = a.get(key)
                return int(struct.unpack("=I", raw[:4])[0]) if raw is not None else None

            out.append(RawRoute(
                family=fam, dst=addr(RTA_DST), dst_len=dst_len,
                table=u32(RTA_TABLE) or table, proto=proto, scope=scope, type=kind,
                gateway=addr(RTA_GATEWAY), oif=u32(RTA_OIF), priority=u32(RTA_PRIORITY),
                prefsrc=addr(RTA_PREFSRC), multipath=RTA_MULTIPATH in a))
        return out

    def replace_routes(self, routes: Sequence[dict[str, Any]]) -> list[OSError | None]:
        """Send one ``RTM_NEWROUTE`` (create | replace) per route, in batches; return one
        error (or None) per route. Keys: family, dst, dst_len, table, type, scope, and
        optionally gateway, oif, priority, prefsrc."""
        results: list[OSError | None] = [None] * len(routes)
        pending: dict[int, int] = {}
        batch: list[bytes] = []
        size = 0
        for i, r in enumerate(routes):
            msg = self._route_msg(r)
            pending[self._seq] = i
            batch.append(msg)
            size += len(msg)
            if size >= _BATCH_BYTES:
                self._send_and_ack(b"".join(batch), pending, results)
                batch, size = [], 0
        if batch:
            self._send_and_ack(b"".join(batch), pending, results)
        return results

    def _route_msg(self, r: dict[str, Any]) -> bytes:
        fam = int(r["family"])
        table = int(r.get("table", 254))
        body = _RTMSG.pack(fam, int(r["dst_len"]), 0, 0, table if table < 256 else 252,
                           int(r.get("proto", RTPROT_STATIC)),
                           int(r.get("scope", 0)), int(r.get("type", 1)), 0)
        attrs = [_attr(RTA_TABLE, struct.pack("=I", table))]
        if r.get("dst") is not None and int(r["dst_len"]) > 0:
            attrs.append(_attr(RTA_DST, socket.inet_pton(fam, r["dst"])))
        if r.get("gateway") is not None:
            attrs.append(_attr(RTA_GATEWAY, socket.inet_pton(fam, r["gateway"])))
        if r.get("oif") is not None:
            attrs.append(_attr(RTA_OIF, struct.pack("=I", int(r["oif"]))))
        if r.get("priority") is not None:
            attrs.append(_attr(RTA_PRIORITY, struct.pack("=I", int(r["priority"]))))
        if r.get("prefsrc") is not None:
            attrs.append(_attr(RTA_PREFSRC, socket.inet_pton(fam, r["prefsrc"])))
        payload = body + b"".join(attrs)
        seq = self._next()
        return _NLMSGHDR.pack(_NLMSGHDR.size + len(payload), RTM_NEWROUTE,
                              NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
                              seq, 0) + payload

    def _send_and_ack(self, data: bytes, pending: dict[int, int],
                      results: list[OSError | None]) -> None:
        self.sock.send(data)
        waiting = set(pending)
        for rtype, _flags, seq, payload in self._messages():
            if rtype == NLMSG_ERROR and seq in waiting:
                (code,) = struct.unpack_from("=i", payload)
                if code:
                    e = -code
                    results[pending[seq]] = OSError(e, os.strerror(e))
                waiting.discard(seq)
                del pending[seq]
                if not waiting:
                    return


def available() -> bool:
    try:
        Netlink().close()
    except OSError as exc:
        return exc.errno not in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT)
    return True
