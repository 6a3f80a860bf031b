"""The routing table over rtnetlink (pyroute2): read, and re-add in batches."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from .._threads import fresh_lock_after_fork
from ._model import (
    _BATCH,
    _PREF_CODES,
    _SEQ_BASE,
    _SKIP_PROTOS,
    _T,
    _TYPE_CODES,
    PYROUTE2_MISSING,
    RT_TABLE_COMPAT,
    RT_TABLE_LOCAL,
    RT_TABLE_MAIN,
    RTNH_F_ONLINK,
    RTNL_TIMEOUT,
    RTPROT_STATIC,
    NetworkError,
    NetworkUnavailable,
    Route,
    _default_scope,
    _make_route,
    _not_expressible,
)

log = logging.getLogger("rehydrate")


def _off_loop(fn: Callable[[], _T]) -> _T:
    """Run ``fn`` here, or on a short-lived thread when this thread runs an asyncio loop
    (pyroute2's synchronous ``IPRoute`` drives an event loop of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    with ThreadPoolExecutor(1, thread_name_prefix="rehydrate-rtnetlink") as pool:
        return pool.submit(fn).result()


class _Rtnl:
    """One rtnetlink socket, pyroute2's ``IPRoute`` (no multicast groups, so nothing but
    answers arrives; extended ACKs, so the kernel says why it refused a route).

    Dumps use pyroute2's API. Replacing routes does not go through ``IPRoute.route()``:
    its per-call request machinery costs about 0.5 ms per route (``IPBatch``, which
    compiles through the same machinery, too): 90-110 ms for 200 routes. Each
    route is instead one pyroute2 ``rtmsg`` (``RTM_NEWROUTE`` with ``NLM_F_CREATE |
    NLM_F_REPLACE``, what ``route("replace", ...)`` sends, or ``NLM_F_CREATE |
    NLM_F_EXCL``, ``route("add", ...)``, for a captured route), encoded by pyroute2 into one
    buffer that goes out in one ``sendto``; the answers are decoded by pyroute2's parser.
    Not thread-safe; close it when done.
    """

    def __init__(self) -> None:
        try:
            from pyroute2 import IPRoute  # type: ignore[import-untyped,unused-ignore]
        except ImportError as exc:
            raise NetworkUnavailable(f"missing {PYROUTE2_MISSING}") from exc
        try:
            self.ipr: Any = IPRoute(groups=0, ext_ack=True)
        except OSError as exc:
            # gVisor's netlink has no NETLINK_EXT_ACK (ENOPROTOOPT): without it the
            # kernel's errors come without their explanation, nothing else is lost
            if exc.errno != errno.ENOPROTOOPT:
                raise
            self.ipr = IPRoute(groups=0)
        self._links: dict[int, str] | None = None

    def close(self) -> None:
        self.ipr.close()

    def links(self) -> dict[int, str]:
        if self._links is None:
            self._links = {int(m["index"]): str(m.get_attr("IFLA_IFNAME"))
                           for m in self.ipr.get_links()}
        return self._links

    def routes(self, skipped: list[tuple[str, int, int]] | None = None) -> list[Route]:
        """Every expressible IPv4/IPv6 route of the namespace (one dump of every family
        and table), its protocol included; each other one is added to ``skipped`` as
        (why it is left out, table, protocol)."""
        links = self.links()
        out: list[Route] = []
        for m in self.ipr.get_routes():
            family = int(m["family"])
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            table = m.get_attr("RTA_TABLE")
            t = int(table if table is not None else m["table"])
            r = _make_route(
                family=family, dst=m.get_attr("RTA_DST"), dst_len=int(m["dst_len"]),
                table=t, scope=int(m["scope"]), kind=int(m["type"]),
                gateway=_gateway(m), oif=m.get_attr("RTA_OIF"),
                priority=m.get_attr("RTA_PRIORITY"), prefsrc=m.get_attr("RTA_PREFSRC"),
                multipath=m.get_attr("RTA_MULTIPATH") is not None, links=links,
                flags=int(m["flags"]), metrics=m.get_attr("RTA_METRICS"),
                pref=m.get_attr("RTA_PREF"), proto=int(m["proto"]), tos=int(m["tos"]),
                src=m.get_attr("RTA_SRC"), src_len=int(m["src_len"]),
                flow=m.get_attr("RTA_FLOW"))
            if r is not None:
                out.append(r)
                dropped = _not_kept(m)
                if dropped and skipped is not None:  # said, not silently re-applied without
                    skipped.append((f"route {r} captured without its {', '.join(dropped)} "
                                    "(not re-applied)", t, int(m["proto"])))
            elif skipped is not None:
                skipped.append((_not_expressible(
                    dst=m.get_attr("RTA_DST"), dst_len=int(m["dst_len"]), table=t,
                    kind=int(m["type"]), multipath=m.get_attr("RTA_MULTIPATH") is not None,
                    family=family), t, int(m["proto"])))
        return out

    def replace(self, msgs: Sequence[Mapping[str, Any]],
                encoder: _Encoder | None = None) -> list[Exception | None]:
        """Send one ``RTM_NEWROUTE`` (create | replace, or create | excl when the message
        is create-only) per message (rtmsg fields and ``attrs``), in batches of one
        ``sendto`` each; return one error (or None) per message. ``encoder`` may hold
        messages encoded earlier (before the snapshot).

        Only the last message of a batch asks for an ACK: the kernel handles a batch in
        order within ``sendto`` and answers every failed message with an error anyway,
        so once that ACK arrives every error of the batch has arrived before it.
        """
        enc = encoder or _Encoder()
        results: list[Exception | None] = [None] * len(msgs)
        for start in range(0, len(msgs), _BATCH):
            chunk = msgs[start:start + _BATCH]
            seqs: dict[int, int] = {}
            parts: list[bytes] = []
            last = (-1, -1)  # (seq, index) of the message that asks for the ACK
            for i, fields in enumerate(chunk, start):
                ack = i == start + len(chunk) - 1
                try:
                    seq, data = enc.encode(fields, ack=ack)
                    if seq in seqs:  # the same message twice in one batch: a fresh copy
                        seq, data = enc.encode(fields, ack=ack, cached=False)
                except Exception as exc:  # e.g. an address that is not one
                    results[i] = exc
                    continue
                seqs[seq] = i
                parts.append(data)
                last = (seq, i)
            if not parts:
                continue
            if last[1] != start + len(chunk) - 1:  # the last one failed to encode
                del seqs[last[0]]
                seq, parts[-1] = enc.encode(msgs[last[1]], ack=True, cached=False)
                seqs[seq] = last[1]
                last = (seq, last[1])
            try:
                self.ipr.sendto(b"".join(parts), (0, 0))
                self._collect(seqs, last[0], results)
            except Exception as exc:
                for i in seqs.values():
                    if results[i] is None:
                        results[i] = exc
        return results

    def _collect(self, seqs: Mapping[int, int], last: int,
                 results: list[Exception | None]) -> None:
        """Read answers until the ACK of sequence number ``last``; store each error at
        ``results[seqs[seq]]``."""
        from pyroute2.netlink import NLMSG_ERROR  # type: ignore[import-untyped,unused-ignore]

        deadline = time.monotonic() + RTNL_TIMEOUT
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no rtnetlink answer within {RTNL_TIMEOUT:g} s")
            # the socket is non-blocking (pyroute2 hands it to asyncio)
            readable, _, _ = select.select([self.ipr], [], [], remaining)
            if not readable:
                continue
            try:
                data = self.ipr.recv(1 << 20)
            except BlockingIOError:
                continue
            for kind, seq, err in self._answers(data):
                if kind != NLMSG_ERROR or seq not in seqs:
                    continue
                if err is not None:
                    results[seqs[seq]] = err
                if seq == last:
                    return

    def _answers(self, data: bytes) -> list[tuple[int, int, OSError | None]]:
        """(type, sequence number, error) of each answer in ``data``, as pyroute2 decodes
        them; where pyroute2's parser fails, from the netlink headers themselves.

        It fails on gVisor's answers: their NLMSG_ERROR carries the request's header but
        not its body (as with NETLINK_CAP_ACK, yet without the NLM_F_CAPPED flag), and
        pyroute2 reads the body the header's length promises, past the end."""
        try:
            return [(int(m["header"]["type"]), int(m["header"]["sequence_number"]),
                     None if m["header"].get("error") is None
                     else _os_error(m["header"]["error"]))
                    for m in self.ipr.marshal.parse(data)]
        except struct.error:
            return _raw_answers(data)


def _raw_answers(data: bytes) -> list[tuple[int, int, OSError | None]]:
    """(type, sequence number, error) of each netlink message in ``data``: an nlmsghdr is
    u32 length, u16 type, u16 flags, u32 sequence number, u32 port; an NLMSG_ERROR body
    starts with the negative errno (0: an ACK). No extended-ACK text (gVisor sends none)."""
    from pyroute2.netlink import NLMSG_ERROR  # type: ignore[import-untyped,unused-ignore]

    out: list[tuple[int, int, OSError | None]] = []
    off = 0
    while off + 16 <= len(data):
        length, kind, _, seq, _ = struct.unpack_from("=IHHII", data, off)
        if length < 16:
            break
        err = None
        if kind == NLMSG_ERROR and off + 20 <= len(data):
            code = -struct.unpack_from("=i", data, off + 16)[0]
            if code:
                err = OSError(code, os.strerror(code))
        out.append((kind, seq, err))
        off += (length + 3) & ~3  # NLMSG_ALIGN
    return out


def _os_error(err: BaseException) -> OSError:
    """pyroute2's NetlinkError (code, extended-ACK text) as an OSError with strerror."""
    code = int(getattr(err, "code", 0) or getattr(err, "errno", 0) or 0)
    text = os.strerror(code) if code else str(err)
    detail = err.args[1] if len(err.args) > 1 else None
    if detail and detail != text:
        text = f"{text} ({detail})"
    return OSError(code, text)


# a key of a route message's fields that is no rtmsg field: send it create-only
# (NLM_F_CREATE | NLM_F_EXCL, ``ip route add``) instead of create-or-replace
_CREATE_ONLY = "create_only"


def _msg_key(fields: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple((k, tuple(v) if k == "attrs" else v) for k, v in sorted(fields.items()))


class _Encoder:
    """``RTM_NEWROUTE`` messages encoded by pyroute2 (``rtmsg``), kept between applies.

    pyroute2 spends about 0.2 ms of Python encoding one route message, so the messages
    of the captured and declared routes are encoded before the snapshot (by
    :func:`capture` and the before-snapshot hook) and only sent after the restore. Each
    message has its own sequence number (unique in the process), which is how an error
    finds its route. A message whose interface index changed is simply a new message.
    """

    _MAX = 8192

    def __init__(self) -> None:
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        self._cache: dict[tuple[Any, ...], tuple[int, bytes]] = {}
        self._next = _SEQ_BASE

    def _seq(self) -> int:
        with self._lock:
            seq = self._next
            self._next = _SEQ_BASE + (self._next - _SEQ_BASE + 1) % 0x60000000
            return seq

    def encode(self, fields: Mapping[str, Any], *, ack: bool = False,
               cached: bool = True) -> tuple[int, bytes]:
        key = _msg_key(fields)
        if cached and not ack:
            with self._lock:
                hit = self._cache.get(key)
            if hit is not None:
                return hit
        from pyroute2.netlink import (  # type: ignore[import-untyped,unused-ignore]
            NLM_F_ACK,
            NLM_F_CREATE,
            NLM_F_EXCL,
            NLM_F_REPLACE,
            NLM_F_REQUEST,
        )
        from pyroute2.netlink.rtnl import RTM_NEWROUTE  # type: ignore[import-untyped,unused-ignore]
        from pyroute2.netlink.rtnl.rtmsg import rtmsg  # type: ignore[import-untyped,unused-ignore]

        seq = self._seq()
        m = rtmsg()
        for k, v in fields.items():
            if k == _CREATE_ONLY:
                continue
            # pyroute2 rewrites the list in place; a structured attribute is kept as a
            # tuple of pairs (hashable: the cache key) and given in pyroute2's form
            m[k] = [(n, _nla_value(n, x)) for n, x in v] if k == "attrs" else v
        m["header"]["type"] = RTM_NEWROUTE
        m["header"]["flags"] = (NLM_F_REQUEST | NLM_F_CREATE
                                | (NLM_F_EXCL if fields.get(_CREATE_ONLY) else NLM_F_REPLACE)
                                | (NLM_F_ACK if ack else 0))
        m["header"]["sequence_number"] = seq
        m.encode()
        data = bytes(m.data)
        if cached and not ack:
            with self._lock:
                if len(self._cache) >= self._MAX:
                    self._cache.clear()
                self._cache[key] = (seq, data)
        return seq, data

    def warm(self, msgs: Iterable[Mapping[str, Any]]) -> None:
        """Encode ``msgs`` now; forget messages not among them."""
        keep: dict[tuple[Any, ...], tuple[int, bytes]] = {}
        for fields in msgs:
            key = _msg_key(fields)
            with self._lock:
                hit = self._cache.get(key)
            try:
                keep[key] = hit if hit is not None else self.encode(fields, cached=False)
            except Exception:  # noqa: S112 - reported when applied
                continue
        with self._lock:
            self._cache = keep


def _nla_value(name: str, value: Any) -> Any:
    """An attribute value as pyroute2 encodes it: RTA_VIA's (family, addr) pairs as its
    dict, a nested attribute's (RTA_METRICS) pairs as ``{"attrs": [...]}``."""
    if not isinstance(value, tuple):
        return value
    return dict(value) if name == "RTA_VIA" else {"attrs": list(value)}


def _gateway(m: Any) -> str | None:
    """The route's gateway: RTA_GATEWAY, or RTA_VIA's address (an IPv4 route through an
    IPv6 gateway, ``via inet6 fe80::1``, as BGP unnumbered sets up: RFC 5549)."""
    gateway = m.get_attr("RTA_GATEWAY")
    if gateway is None:
        via = m.get_attr("RTA_VIA")
        if isinstance(via, Mapping) and via.get("addr"):
            gateway = via["addr"]
    return None if gateway is None else str(gateway)


RTA_NH_ID = 30  # pyroute2 0.9 does not know it: it decodes it as ("UNKNOWN", {type 30})


def _not_kept(m: Any) -> list[str]:
    """What a kernel route has that a :class:`Route` does not carry (so a re-applied copy
    lacks it): named in ``Capture.problems`` instead of dropped without a word.

    An encapsulation (``encap mpls|seg6|ip …``) has many kinds, each its own nested
    attributes; a nexthop object (``nhid``) is a kernel object of its own that a restore
    loses too (the kernel also reports its gateway and device, so the route is re-applied
    through them, without the object)."""
    nh_id = m.get_attr("RTA_NH_ID") is not None or any(
        name == "UNKNOWN" and isinstance(value, Mapping)
        and value.get("header", {}).get("type") == RTA_NH_ID
        for name, value in m["attrs"])
    return [name for name, present in (
        ("encapsulation", m.get_attr("RTA_ENCAP") is not None),
        ("nexthop object", nh_id),
    ) if present]


def read_routes(*, user_only: bool = False, backend: _Rtnl | None = None,
                skipped: list[str] | None = None) -> list[Route]:
    """The routes of the current network namespace (IPv4 and IPv6, every table).

    ``user_only``: what :func:`capture` keeps — not the ``local`` table, not protocols
    ``kernel``/``ra``/``dhcp``. ``skipped`` gets one note per route (among those) that
    a :class:`Route` cannot express (multipath, broadcast …), and one per route read
    without something it has (an encapsulation, a nexthop object). Each route carries
    its protocol, tos, IPv6 source prefix and realm. Needs pyroute2 (the ``routes``
    extra).
    """
    def left_out(table: int | None, proto: int) -> bool:
        return user_only and (table == RT_TABLE_LOCAL or proto in _SKIP_PROTOS)

    def read(b: _Rtnl) -> list[Route]:
        others: list[tuple[str, int, int]] = []
        found = [r for r in b.routes(others) if not left_out(r.table, r.proto or 0)]
        if skipped is not None:
            skipped.extend(why for why, table, proto in others if not left_out(table, proto))
        return found

    if backend is not None:
        return read(backend)

    def own() -> list[Route]:
        b = _Rtnl()
        try:
            return read(b)
        finally:
            b.close()

    return _off_loop(own)


_FR_ACT_TO_TBL = 1


def unruled_tables(routes: Iterable[Route]) -> list[tuple[int, int]]:
    """(family, table) of each table of ``routes`` that no ``ip rule`` of its family
    looks up: its routes do nothing. Empty where a rule selects tables by device
    (``l3mdev``, VRFs), which can point to any table."""
    wanted = {(r.family, r.table or RT_TABLE_MAIN) for r in routes}
    if not wanted:
        return []

    def own() -> list[tuple[int, int]]:
        b = _Rtnl()
        try:
            ruled: set[tuple[int, int]] = set()
            for m in b.ipr.get_rules():
                if m.get_attr("FRA_L3MDEV"):
                    return []
                if int(m["action"]) == _FR_ACT_TO_TBL:
                    table = m.get_attr("FRA_TABLE")
                    ruled.add((int(m["family"]), int(table if table is not None
                                                     else m["table"])))
            return sorted(wanted - ruled)
        finally:
            b.close()

    return _off_loop(own)


def _route_msg(r: Route, links_by_name: Mapping[str, int], *,
               create_only: bool = False) -> dict[str, Any]:
    """The ``rtmsg`` fields and attributes of ``ip route replace`` for this route (of
    ``ip route add``, refused where a route with the same key exists, if
    ``create_only``): its protocol (``static`` when it has none), tos, source prefix and
    realm included."""
    n = r.normalized()
    table = n.table or RT_TABLE_MAIN
    # by default link scope for `ip route add PREFIX dev DEV`, host scope for a local
    # route, as ip-route gives them
    scope = n.scope if n.scope is not None else _default_scope(n.type, n.gateway, n.family)
    addr, _, plen = ("" if n.dst == "default" else n.dst).partition("/")
    # RTA_TABLE only for a table rtm_table cannot hold (> 255), as iproute2 does: gVisor
    # refuses a route with RTA_TABLE (EOPNOTSUPP)
    attrs: list[tuple[str, Any]] = [("RTA_TABLE", table)] if table > 255 else []
    if addr:
        attrs.append(("RTA_DST", addr))
    if n.gateway is not None:
        if n.family == socket.AF_INET and ":" in n.gateway:  # via inet6 (RFC 5549)
            attrs.append(("RTA_VIA", (("family", socket.AF_INET6), ("addr", n.gateway))))
        else:
            attrs.append(("RTA_GATEWAY", n.gateway))
    if n.dev is not None:
        if n.dev not in links_by_name:
            # most often made by a hook that runs too late: after this one
            raise NetworkError(f"device {n.dev!r} does not exist (a restore hook that "
                               "creates it must run before rehydrate.routes: phase "
                               "NETWORK with order < 0, or an earlier phase)")
        attrs.append(("RTA_OIF", links_by_name[n.dev]))
    if n.metric is not None:
        attrs.append(("RTA_PRIORITY", n.metric))
    if n.src is not None:
        attrs.append(("RTA_PREFSRC", n.src))
    if n.metrics:
        attrs.append(("RTA_METRICS", tuple((f"RTAX_{k.upper()}", v) for k, v in n.metrics)))
    if n.pref is not None and n.family == socket.AF_INET6:
        attrs.append(("RTA_PREF", _PREF_CODES[n.pref]))
    src_addr, _, src_len = (n.from_prefix or "").partition("/")
    if src_addr:
        attrs.append(("RTA_SRC", src_addr))
    if n.realm:
        attrs.append(("RTA_FLOW", n.realm))
    fields = {"family": n.family, "dst_len": int(plen) if plen else 0,
              "src_len": int(src_len) if src_len else 0, "tos": n.tos,
              "table": table if table < 256 else RT_TABLE_COMPAT,
              "proto": RTPROT_STATIC if n.proto is None else n.proto,
              "scope": scope, "type": _TYPE_CODES.get(n.type, 1),
              "flags": RTNH_F_ONLINK if n.onlink else 0, "attrs": attrs}
    if create_only:
        fields[_CREATE_ONLY] = True
    return fields


