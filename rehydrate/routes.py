"""Routes and firewall rules, re-applied after a restore (``NETWORK`` phase).

Snapshot platforms do not restore user-added routes nor iptables/nftables rules (GKE Pod
snapshots say so; a gVisor restore rebuilds the network stack). This module re-creates
them, either from declarations or from a capture taken before the snapshot:

* :func:`route` declares a route (destination, gateway, device, table, metric, source),
  applied as ``ip route replace`` does — idempotent — with pyroute2 (the ``routes``
  extra): every route is one pyroute2 ``rtmsg`` (``RTM_NEWROUTE``, ``NLM_F_CREATE |
  NLM_F_REPLACE``), encoded by pyroute2 before the snapshot (by :func:`capture` and the
  before-snapshot hook) and kept; after a restore all of them go out in one ``sendto``
  on an ``IPRoute`` socket and pyroute2 decodes the errors, reported per route. (Measured
  in a netns, replacing 200 routes: ``IPRoute.route("replace", ...)`` one by one ~93 ms,
  ``IPBatch`` + one send ~101 ms, ``AsyncIPRoute`` + ``asyncio.gather`` ~87 ms, this
  batch ~38 ms when encoded on the spot and ~2 ms pre-encoded; see docs/network.md.)
* :func:`nftables` declares an nftables JSON ruleset (the form ``nft -j list`` prints, or
  a list of JSON commands), applied atomically with ``nft -j -f -``; a table given as
  objects is replaced as a whole (``add``/``delete``/re-``add`` in one transaction).
* :func:`iptables` declares ``iptables-restore`` text, applied with ``--noflush``; rules
  that already exist (``iptables -C``) are not appended twice.
* :func:`capture` records the user-added routes (every table except ``local``; protocol
  not ``kernel``, ``ra`` or ``dhcp`` — so not the kernel's link and address routes, nor
  router advertisements or DHCP leases that the platform re-creates) and the nftables
  tables of the current network namespace, now and again before every snapshot; after a
  restore they are re-applied with no declaration at all. A captured route whose
  destination the platform already re-created differently is left to the platform.

Routes (over rtnetlink, on a worker thread) and nftables tables (``nft`` subprocesses)
are applied concurrently. Everything applied is read back and compared (routes: one
pyroute2 dump). Without CAP_NET_ADMIN, without pyroute2,
without the ``nft`` binary, or where the platform lacks nftables (gVisor implements only
part of iptables), the restore hook fails with **one** message naming what is missing;
whether that makes the process not ready follows the usual ``required`` semantics.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from . import _config
from .context import RestoreContext
from .extensions import Probe, resolve_engine
from .hooks import Phase

if TYPE_CHECKING:
    from .extensions import Engine

__all__ = [
    "ApplyResult",
    "Capture",
    "NetworkError",
    "NetworkUnavailable",
    "Route",
    "RoutesManager",
    "apply",
    "capture",
    "iptables",
    "manager",
    "missing_prerequisites",
    "nftables",
    "read_routes",
    "read_table",
    "route",
]

log = logging.getLogger("rehydrate")

CAP_NET_ADMIN = 12
NETLINK_ROUTE = 0
RTPROT_STATIC = 4
RT_TABLE_COMPAT = 252
RT_TABLE_MAIN = 254
RT_TABLE_LOCAL = 255
_SKIP_PROTOS = {2: "kernel", 9: "ra", 16: "dhcp"}
_ROUTE_TYPES = {1: "unicast", 6: "blackhole", 7: "unreachable", 8: "prohibit"}
_TYPE_CODES = {v: k for k, v in _ROUTE_TYPES.items()}
NFT_TIMEOUT = 20.0
RTNL_TIMEOUT = 10.0
_BATCH = 256  # routes per sendto (a route message is at most ~120 bytes)
_SEQ_BASE = 0x10000000  # our batch's sequence numbers, far from pyroute2's own

_T = TypeVar("_T")


class NetworkError(RuntimeError):
    """Some routes or rules could not be re-applied or did not read back as applied."""


class NetworkUnavailable(NetworkError):
    """A prerequisite is missing (capability, binary, module, kernel support)."""


# --------------------------------------------------------------------------------------
# Prerequisites
# --------------------------------------------------------------------------------------

def has_cap_net_admin() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def nft_binary() -> str | None:
    configured = _config.text("REHYDRATE_NFT")
    if configured is not None:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("nft") or next(
        (p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None)


PYROUTE2_MISSING = "pyroute2 (pip install 'rehydrate[routes]')"


def _pyroute2_available() -> bool:
    try:
        import pyroute2  # type: ignore[import-untyped,unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return True


def _rtnetlink_available() -> bool:
    try:
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE).close()
    except OSError as exc:
        return exc.errno not in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT)
    return True


def missing_prerequisites(*, routes: bool = True, nft: bool = True,
                          iptables: bool = False) -> list[str]:
    """What stops re-applying the given kinds of state here (empty: nothing)."""
    missing: list[str] = []
    cap = has_cap_net_admin()
    if (routes or nft or iptables) and not cap:
        missing.append(f"CAP_NET_ADMIN (uid {os.geteuid()} runs without it)")
    if routes and not _pyroute2_available():
        missing.append(PYROUTE2_MISSING)
    elif routes and not _rtnetlink_available():
        missing.append("rtnetlink (NETLINK_ROUTE sockets are not supported here)")
    if nft:
        binary = nft_binary()
        if binary is None:
            missing.append("the nft binary (install nftables, or set REHYDRATE_NFT)")
        elif cap:
            try:
                _nft(["list", "tables"])
            except NetworkUnavailable as exc:
                missing.append(f"nftables support ({exc})")
            except Exception as exc:
                missing.append(f"a working nft ({_describe(exc)})")
    if iptables:
        for b in ("iptables-restore", "iptables"):
            if shutil.which(b) is None and not os.access(f"/usr/sbin/{b}", os.X_OK):
                missing.append(f"the {b} binary")
    return missing


# --------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------

_FAMILY_NAMES: dict[int, str] = {socket.AF_INET: "inet", socket.AF_INET6: "inet6"}
_FAMILIES: dict[object, int] = {
    None: 0, socket.AF_INET: socket.AF_INET, socket.AF_INET6: socket.AF_INET6,
    4: socket.AF_INET, 6: socket.AF_INET6, "inet": socket.AF_INET, "inet6": socket.AF_INET6,
    "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}


def _family_of_text(r: Route) -> int | None:
    """The family the route's addresses imply (None for ``default`` without addresses)."""
    for probe in (r.dst, r.gateway, r.src):
        if probe is not None and probe != "default":
            return socket.AF_INET6 if ":" in probe else socket.AF_INET
    return None


@dataclass(frozen=True)
class Route:
    """One route. ``dst`` is ``"default"`` or a prefix such as ``"10.0.0.0/24"``.

    ``family`` is ``socket.AF_INET`` or ``socket.AF_INET6``; left out (0), it is taken
    from the addresses (``"::/0"`` is IPv6) and is IPv4 for ``"default"`` without one.
    It is a field, not a guess from the text, so it survives :meth:`normalized` (which
    writes ``::/0`` as ``default``) and routes read from the kernel keep their family.
    """

    dst: str
    gateway: str | None = None
    dev: str | None = None
    table: int | None = None
    metric: int | None = None
    src: str | None = None
    type: str = "unicast"
    scope: int | None = None
    required: bool = field(default=True, compare=False)
    family: int = 0

    def __post_init__(self) -> None:
        family = int(self.family) or _family_of_text(self) or socket.AF_INET
        if family not in _FAMILY_NAMES:
            raise ValueError(f"route family must be AF_INET or AF_INET6, not {self.family!r}")
        object.__setattr__(self, "family", family)

    @property
    def family_name(self) -> str:
        return _FAMILY_NAMES[self.family]

    def normalized(self) -> Route:
        dst = self.dst
        if dst in ("default", "0.0.0.0/0", "::/0"):
            dst = "default"
        elif "/" not in dst:
            dst = f"{dst}/{128 if self.family == socket.AF_INET6 else 32}"
        return replace(self, dst=dst, table=self.table or RT_TABLE_MAIN)

    def key(self) -> tuple[int, str, int, int | None]:
        """What the kernel identifies a route by (family, destination, table, metric)."""
        n = self.normalized()
        return (n.family, n.dst, n.table or RT_TABLE_MAIN, n.metric)

    def matches(self, other: Route) -> bool:
        """``other`` (read back from the kernel) satisfies this (possibly partial) route."""
        a, b = self.normalized(), other.normalized()
        if (a.family, a.dst, a.table, a.type) != (b.family, b.dst, b.table, b.type):
            return False
        return all(getattr(a, f) is None or getattr(a, f) == getattr(b, f)
                   for f in ("gateway", "dev", "metric", "src", "scope"))

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in (("dst", self.dst), ("gateway", self.gateway),
                                  ("dev", self.dev), ("table", self.table),
                                  ("metric", self.metric), ("src", self.src),
                                  ("family", self.family_name), ("type", self.type),
                                  ("scope", self.scope)) if v is not None}

    def __str__(self) -> str:
        parts = [self.dst]
        for label, v in (("via", self.gateway), ("dev", self.dev), ("table", self.table),
                         ("metric", self.metric), ("src", self.src)):
            if v is not None:
                parts.append(f"{label} {v}")
        if self.type != "unicast":
            parts.insert(0, self.type)
        if self.family == socket.AF_INET6:  # as `ip -6 route` would need it spelled out
            parts.insert(0, "inet6")
        return " ".join(str(p) for p in parts)


def _make_route(*, family: int, dst: str | None, dst_len: int, table: int, scope: int,
                kind: int, gateway: str | None, oif: int | None, priority: int | None,
                prefsrc: str | None, multipath: bool, links: Mapping[int, str]
                ) -> Route | None:
    """A kernel route as a :class:`Route`; None when not expressible (multipath,
    local/broadcast/multicast types)."""
    rtype = _ROUTE_TYPES.get(kind)
    if rtype is None or multipath:
        return None
    dst_s = "default" if dst is None or dst_len == 0 else f"{dst}/{dst_len}"
    default_scope = 253 if (rtype == "unicast" and gateway is None
                            and family == socket.AF_INET) else 0
    # the kernel reports IPv6 blackhole/unreachable/prohibit routes on "lo", but refuses
    # a device for these types when they are added
    dev = links.get(oif) if oif is not None and rtype == "unicast" else None
    return Route(
        dst=dst_s, gateway=gateway, dev=dev, table=table, metric=priority, src=prefsrc,
        type=rtype, scope=None if scope == default_scope else scope, family=family,
    )


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
    NLM_F_REPLACE``, what ``route("replace", ...)`` sends), encoded by pyroute2 into one
    buffer that goes out in one ``sendto``; the answers are decoded by pyroute2's parser.
    Not thread-safe; close it when done.
    """

    def __init__(self) -> None:
        try:
            from pyroute2 import IPRoute
        except ImportError as exc:
            raise NetworkUnavailable(f"missing {PYROUTE2_MISSING}") from exc
        self.ipr: Any = IPRoute(groups=0, ext_ack=True)
        self._links: dict[int, str] | None = None

    def close(self) -> None:
        self.ipr.close()

    def links(self) -> dict[int, str]:
        if self._links is None:
            self._links = {int(m["index"]): str(m.get_attr("IFLA_IFNAME"))
                           for m in self.ipr.get_links()}
        return self._links

    def routes(self) -> list[tuple[Route, int]]:
        """Every expressible IPv4/IPv6 route of the namespace (one dump of every family
        and table) and its protocol number."""
        links = self.links()
        out: list[tuple[Route, int]] = []
        for m in self.ipr.get_routes():
            family = int(m["family"])
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            table = m.get_attr("RTA_TABLE")
            r = _make_route(
                family=family, dst=m.get_attr("RTA_DST"), dst_len=int(m["dst_len"]),
                table=int(table if table is not None else m["table"]),
                scope=int(m["scope"]), kind=int(m["type"]),
                gateway=m.get_attr("RTA_GATEWAY"), oif=m.get_attr("RTA_OIF"),
                priority=m.get_attr("RTA_PRIORITY"), prefsrc=m.get_attr("RTA_PREFSRC"),
                multipath=m.get_attr("RTA_MULTIPATH") is not None, links=links)
            if r is not None:
                out.append((r, int(m["proto"])))
        return out

    def replace(self, msgs: Sequence[Mapping[str, Any]],
                encoder: _Encoder | None = None) -> list[Exception | None]:
        """Send one ``RTM_NEWROUTE`` (create | replace) per message (rtmsg fields and
        ``attrs``), in batches of one ``sendto`` each; return one error (or None) per
        message. ``encoder`` may hold messages encoded earlier (before the snapshot).

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
            for m in self.ipr.marshal.parse(data):
                seq = int(m["header"]["sequence_number"])
                if m["header"]["type"] != NLMSG_ERROR or seq not in seqs:
                    continue
                err = m["header"].get("error")
                if err is not None:
                    results[seqs[seq]] = _os_error(err)
                if seq == last:
                    return


def _os_error(err: BaseException) -> OSError:
    """pyroute2's NetlinkError (code, extended-ACK text) as an OSError with strerror."""
    code = int(getattr(err, "code", 0) or getattr(err, "errno", 0) or 0)
    text = os.strerror(code) if code else str(err)
    detail = err.args[1] if len(err.args) > 1 else None
    if detail and detail != text:
        text = f"{text} ({detail})"
    return OSError(code, text)


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
            NLM_F_REPLACE,
            NLM_F_REQUEST,
        )
        from pyroute2.netlink.rtnl import RTM_NEWROUTE  # type: ignore[import-untyped,unused-ignore]
        from pyroute2.netlink.rtnl.rtmsg import rtmsg  # type: ignore[import-untyped,unused-ignore]

        seq = self._seq()
        m = rtmsg()
        for k, v in fields.items():
            m[k] = list(v) if k == "attrs" else v  # pyroute2 rewrites the list in place
        m["header"]["type"] = RTM_NEWROUTE
        m["header"]["flags"] = (NLM_F_REQUEST | NLM_F_CREATE | NLM_F_REPLACE
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


def read_routes(*, user_only: bool = False, backend: _Rtnl | None = None) -> list[Route]:
    """The routes of the current network namespace (IPv4 and IPv6, every table).

    ``user_only``: what :func:`capture` keeps — not the ``local`` table, not protocols
    ``kernel``/``ra``/``dhcp``. Needs pyroute2 (the ``routes`` extra).
    """
    def read(b: _Rtnl) -> list[Route]:
        return [r for r, proto in b.routes()
                if not (user_only and (r.table == RT_TABLE_LOCAL or proto in _SKIP_PROTOS))]

    if backend is not None:
        return read(backend)

    def own() -> list[Route]:
        b = _Rtnl()
        try:
            return read(b)
        finally:
            b.close()

    return _off_loop(own)


def _route_msg(r: Route, links_by_name: Mapping[str, int]) -> dict[str, Any]:
    """The ``rtmsg`` fields and attributes of ``ip route replace`` for this route."""
    n = r.normalized()
    table = n.table or RT_TABLE_MAIN
    if n.scope is not None:
        scope = n.scope
    elif n.type == "unicast" and n.gateway is None and n.family == socket.AF_INET:
        scope = 253  # link scope, as `ip route add PREFIX dev DEV` does
    else:
        scope = 0
    addr, _, plen = ("" if n.dst == "default" else n.dst).partition("/")
    attrs: list[tuple[str, Any]] = [("RTA_TABLE", table)]
    if addr:
        attrs.append(("RTA_DST", addr))
    if n.gateway is not None:
        attrs.append(("RTA_GATEWAY", n.gateway))
    if n.dev is not None:
        if n.dev not in links_by_name:
            raise NetworkError(f"route {r}: device {n.dev!r} does not exist")
        attrs.append(("RTA_OIF", links_by_name[n.dev]))
    if n.metric is not None:
        attrs.append(("RTA_PRIORITY", n.metric))
    if n.src is not None:
        attrs.append(("RTA_PREFSRC", n.src))
    return {"family": n.family, "dst_len": int(plen) if plen else 0,
            "table": table if table < 256 else RT_TABLE_COMPAT, "proto": RTPROT_STATIC,
            "scope": scope, "type": _TYPE_CODES.get(n.type, 1), "attrs": attrs}


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------------------
# nftables
# --------------------------------------------------------------------------------------

def _nft(args: Sequence[str], stdin: str | None = None) -> str:
    binary = nft_binary()
    if binary is None:
        raise NetworkUnavailable("the nft binary is missing (install nftables, or set "
                                 "REHYDRATE_NFT)")
    proc = subprocess.run([binary, *args], input=stdin, capture_output=True, text=True,
                          timeout=NFT_TIMEOUT, check=False)
    if proc.returncode != 0:
        err = " ".join(proc.stderr.split()) or f"exit status {proc.returncode}"
        if any(s in err for s in ("Operation not permitted", "Permission denied")):
            raise NetworkUnavailable(f"nft {' '.join(args[:3])}: {err} (needs CAP_NET_ADMIN)")
        if any(s in err for s in ("not supported", "Protocol not supported",
                                  "Could not process rule: No such file or directory"
                                  " (netlink)")):
            raise NetworkUnavailable(f"nftables is not supported here: {err}")
        raise NetworkError(f"nft {' '.join(args[:3])}: {err}")
    return proc.stdout


_OBJ_KINDS = ("table", "chain", "set", "map", "flowtable", "counter", "quota", "ct helper",
              "limit", "ct timeout", "ct expectation", "secmark", "synproxy", "element",
              "rule")


def _strip(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k != "handle"}


def _normalize_expr(value: Any) -> Any:
    """Drop what changes by itself (counter values) so read-backs compare equal."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "counter" and isinstance(v, dict) and ("packets" in v or "bytes" in v):
                out[k] = {kk: vv for kk, vv in v.items() if kk not in ("packets", "bytes")}
            elif k == "counter" and v is None:
                out[k] = {}
            else:
                out[k] = _normalize_expr(v)
        return out
    if isinstance(value, list):
        return [_normalize_expr(v) for v in value]
    return value


@dataclass(frozen=True)
class NftTable:
    """One nftables table as the list of objects ``nft -j list table`` prints."""

    family: str
    name: str
    objects: tuple[Mapping[str, Any], ...]
    required: bool = field(default=True, compare=False)

    @property
    def label(self) -> str:
        return f"{self.family} {self.name}"

    def commands(self) -> list[dict[str, Any]]:
        """Replace the table atomically: ensure it exists, delete it, add it back."""
        ident = {"family": self.family, "name": self.name}
        cmds: list[dict[str, Any]] = [{"add": {"table": dict(ident)}},
                                      {"delete": {"table": dict(ident)}}]
        for obj in self.objects:
            ((kind, body),) = obj.items()
            cmds.append({"add": {kind: _strip(body)}})
        return cmds

    def canonical(self) -> list[tuple[str, Any]]:
        """Objects without handles and counter values, for comparison."""
        return [(kind, _normalize_expr(_strip(body)))
                for obj in self.objects for kind, body in obj.items()]

    def uses_xt(self) -> bool:
        return '"xt"' in json.dumps(self.objects)

    def to_json(self) -> dict[str, Any]:
        return {"nftables": [dict(o) for o in self.objects]}


def _tables_from_listing(data: Mapping[str, Any], required: bool = True) -> list[NftTable]:
    """Group the objects of an ``nft -j list`` document by table."""
    order: list[tuple[str, str]] = []
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for obj in data.get("nftables", []):
        if not isinstance(obj, Mapping) or len(obj) != 1:
            raise ValueError("each nftables item must be one object")
        ((kind, body),) = obj.items()
        if kind == "metainfo":
            continue
        if kind not in _OBJ_KINDS or not isinstance(body, Mapping):
            raise ValueError(f"unexpected nftables item {kind!r}")
        if kind == "table":
            key = (str(body["family"]), str(body["name"]))
        else:
            key = (str(body["family"]), str(body["table"]))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(obj)
    tables = []
    for key in order:
        objs = groups[key]
        if not any("table" in o for o in objs):
            objs.insert(0, {"table": {"family": key[0], "name": key[1]}})
        tables.append(NftTable(key[0], key[1], tuple(objs), required))
    return tables


def read_table(family: str, name: str) -> NftTable | None:
    """The table as nft lists it now, or None when it does not exist."""
    try:
        out = _nft(["-j", "list", "table", family, name])
    except NetworkUnavailable:
        raise
    except NetworkError as exc:
        if "No such file or directory" in str(exc):
            return None
        raise
    tables = _tables_from_listing(json.loads(out))
    return tables[0] if tables else None


def read_tables() -> list[NftTable]:
    """Every table of the current network namespace's ruleset."""
    return _tables_from_listing(json.loads(_nft(["-j", "list", "ruleset"])))


@dataclass(frozen=True)
class NftCommands:
    """A declared ruleset in command form (``[{"add": …}, {"flush": …}]``): applied as is,
    verified by checking its tables exist."""

    commands: tuple[Mapping[str, Any], ...]
    required: bool = field(default=True, compare=False)

    def tables(self) -> list[tuple[str, str]]:
        out = []
        for cmd in self.commands:
            for verb, body in cmd.items():
                if verb in ("add", "create") and isinstance(body, Mapping) and "table" in body:
                    t = body["table"]
                    out.append((str(t["family"]), str(t["name"])))
        return out


# --------------------------------------------------------------------------------------
# iptables
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IptablesRules:
    text: str
    ipv6: bool = False
    required: bool = field(default=True, compare=False)

    @property
    def tool(self) -> str:
        return "ip6tables" if self.ipv6 else "iptables"

    def parsed(self) -> list[tuple[str, list[str], list[list[str]]]]:
        """[(table, chain lines, rule argv lists)] from iptables-restore text."""
        out: list[tuple[str, list[str], list[list[str]]]] = []
        table: str | None = None
        chains: list[str] = []
        rules: list[list[str]] = []
        for raw in self.text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("*"):
                table, chains, rules = line[1:], [], []
            elif line == "COMMIT":
                if table is None:
                    raise ValueError("COMMIT outside a table")
                out.append((table, chains, rules))
                table = None
            elif line.startswith(":"):
                chains.append(line)
            elif line.startswith(("-A ", "-I ")):
                rules.append(iptables_split(line))
            else:
                raise ValueError(f"unsupported iptables-restore line: {line[:60]!r}")
        if table is not None:
            raise ValueError(f"table {table} has no COMMIT")
        return out


def iptables_split(line: str) -> list[str]:
    """Split one rule line the way ``iptables-restore`` does (not a shell's way).

    A double quote opens and closes a quoted part; inside one, a backslash makes the next
    character literal (``\\"``, ``\\\\``); outside, backslashes and single quotes are
    plain characters. Whitespace outside quotes separates arguments.
    """
    args: list[str] = []
    current: list[str] = []
    started = quoted = escaped = False
    for ch in line:
        if quoted:
            if escaped:
                current.append(ch)
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            else:
                current.append(ch)
        elif ch == '"':
            quoted = started = True
        elif ch in " \t":
            if started:
                args.append("".join(current))
                current, started = [], False
        else:
            current.append(ch)
            started = True
    if quoted:
        raise ValueError(f"unterminated double quote in iptables rule: {line[:60]!r}")
    if started:
        args.append("".join(current))
    return args


def iptables_join(argv: Sequence[str]) -> str:
    """The rule line ``iptables-restore`` parses back into exactly ``argv``: arguments
    with whitespace, a double quote or a backslash (or empty ones) are double-quoted,
    with ``"`` and ``\\`` escaped by a backslash. ``shlex.join`` quotes with single
    quotes, which ``iptables-restore`` takes literally (``Bad argument `the'``)."""
    out = []
    for arg in argv:
        if "\n" in arg or "\r" in arg:
            raise ValueError("an iptables argument cannot contain a newline")
        if arg and not any(c in arg for c in ' \t"\\'):
            out.append(arg)
        else:
            out.append('"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return " ".join(out)


def _run(argv: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), input=stdin, capture_output=True, text=True,
                          timeout=NFT_TIMEOUT, check=False)


def _rule_exists(tool: str, table: str, argv: list[str]) -> bool:
    spec = ["-C", *argv[1:]]
    if argv[0] == "-I":  # -I CHAIN [pos] rule...: drop a numeric position
        spec = ["-C", argv[1], *(argv[3:] if len(argv) > 2 and argv[2].isdigit()
                                 else argv[2:])]
    return _run([tool, "-w", "-t", table, *spec]).returncode == 0


def _apply_iptables(rules: IptablesRules) -> tuple[dict[str, tuple[int, int]], str | None]:
    """Apply ``rules``; return what is in force afterwards, read back rule by rule —
    ``{table: (rules in force, rules declared)}`` — and the problem (None when every
    rule is in force).

    ``iptables-restore`` commits table by table: when ``nat`` fails, ``filter`` may
    already be in force, so the outcome is read back, never inferred from the exit code.
    """
    tool = rules.tool
    parsed = rules.parsed()
    out_lines: list[str] = []
    for table, chains, rule_list in parsed:
        saved = _run([f"{tool}-save", "-t", table])
        existing = {line.split()[0][1:] for line in saved.stdout.splitlines()
                    if line.startswith(":")} if saved.returncode == 0 else set()
        out_lines.append(f"*{table}")
        out_lines.extend(c for c in chains if c.split()[0][1:] not in existing)
        out_lines.extend(iptables_join(argv) for argv in rule_list
                         if not (argv[1] in existing and _rule_exists(tool, table, argv)))
        out_lines.append("COMMIT")
    proc = _run([f"{tool}-restore", "--noflush", "-w"], "\n".join(out_lines) + "\n")
    err = " ".join(proc.stderr.split()) if proc.returncode != 0 else None
    if err is not None and ("Permission denied" in err or "not permitted" in err):
        raise NetworkUnavailable(f"{tool}-restore: {err} (needs CAP_NET_ADMIN)")
    in_force: dict[str, tuple[int, int]] = {}
    missing: list[str] = []
    for table, _, rule_list in parsed:
        have = 0
        for argv in rule_list:
            if _rule_exists(tool, table, argv):
                have += 1
            else:
                missing.append(f"-t {table} {iptables_join(argv)}")
        done, total = in_force.get(table, (0, 0))
        in_force[table] = (done + have, total + len(rule_list))
    if not missing and err is None:
        return in_force, None
    counts = ", ".join(f"{t} {n}/{total}" for t, (n, total) in in_force.items())
    problem = f"rules in force: {counts}"
    if missing:
        problem += f"; {len(missing)} missing, e.g. {missing[0]}"
    if err is not None:
        problem += f"; {tool}-restore --noflush: {err}"
    return in_force, problem


# --------------------------------------------------------------------------------------
# Capture and the manager
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Capture:
    """User-added routes and nftables tables of one network namespace at one moment."""

    routes: tuple[Route, ...]
    tables: tuple[NftTable, ...]
    taken_at: float
    problems: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"routes": [r.to_dict() for r in self.routes],
                "tables": {t.label: t.to_json() for t in self.tables},
                "taken_at": self.taken_at, "problems": list(self.problems)}


@dataclass
class ApplyResult:
    routes: int = 0
    routes_skipped: int = 0
    tables: int = 0
    iptables_rules: int = 0
    """Declared iptables rules in force after applying (read back with ``-C``)."""
    duration: float = 0.0
    errors: list[tuple[str, bool, str]] = field(default_factory=list)
    """(what, required, message) for each item that failed."""
    in_force: list[str] = field(default_factory=list)
    """What was read back in force after applying, failed items included: ``nftables
    inet app``, ``iptables filter: 2/2 rule(s)`` … (a failed item may be partly or,
    from before, wholly in force)."""

    @property
    def ok(self) -> bool:
        return not any(req for _, req, _ in self.errors)

    def to_dict(self) -> dict[str, Any]:
        return {"routes": self.routes, "routes_skipped": self.routes_skipped,
                "tables": self.tables, "iptables_rules": self.iptables_rules,
                "in_force": list(self.in_force),
                "duration": round(self.duration, 6),
                "errors": [{"what": w, "required": r, "error": e} for w, r, e in self.errors]}


@dataclass
class _Parts:
    """What one capture could read: each part is None when reading it failed."""

    routes: tuple[Route, ...] | None = None
    tables: tuple[NftTable, ...] | None = None
    failed: dict[str, str] = field(default_factory=dict)
    """part ("routes"/"nftables") -> the problem that stopped reading it"""
    unavailable: set[str] = field(default_factory=set)
    """parts that failed because a prerequisite is missing (not a transient error)"""
    notes: list[str] = field(default_factory=list)
    """problems of single items (a table skipped)"""

    def problems(self) -> tuple[str, ...]:
        out = [self.failed["routes"]] if "routes" in self.failed else []
        out.extend(self.notes)
        if "nftables" in self.failed:
            out.append(self.failed["nftables"])
        return tuple(out)


def _prerequisite_missing(exc: BaseException) -> bool:
    return isinstance(exc, NetworkUnavailable) or (
        isinstance(exc, OSError) and exc.errno in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT))


def _read_parts(tables: Iterable[str] | None, required: bool) -> _Parts:
    parts = _Parts()
    try:
        parts.routes = tuple(replace(r, required=required)
                             for r in read_routes(user_only=True))
    except Exception as exc:
        parts.failed["routes"] = f"routes: {_describe(exc)}"
        if _prerequisite_missing(exc):
            parts.unavailable.add("routes")
    nft_tables: list[NftTable] = []
    notes: list[str] = []
    try:
        wanted = {" ".join(t.split()) for t in tables} if tables is not None else None
        for t in read_tables():
            if wanted is not None and t.label not in wanted and t.name not in wanted:
                continue
            if t.uses_xt():
                notes.append(f"nftables table {t.label} holds iptables-nft rules; "
                             "declare them with rehydrate.routes.iptables()")
                continue
            nft_tables.append(replace(t, required=required))
    except Exception as exc:
        parts.failed["nftables"] = f"nftables: {_describe(exc)}"
        if _prerequisite_missing(exc):
            parts.unavailable.add("nftables")
    else:
        parts.tables, parts.notes = tuple(nft_tables), notes
    return parts


class RoutesManager:
    """Per-engine declarations, the last capture, and the NETWORK-phase hooks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self.routes: list[Route] = []
        self.rulesets: list[NftTable | NftCommands] = []
        self.iptables: list[IptablesRules] = []
        self.capture: Capture | None = None
        self._capture_spec: tuple[tuple[str, ...] | None, bool] | None = None
        self._unavailable_at_capture: frozenset[str] = frozenset()
        self.last: ApplyResult | None = None
        self._encoder = _Encoder()
        engine.builtins.register(self._after_restore, event="restore", phase=Phase.NETWORK,
                                 name="rehydrate.routes", timeout=60.0)
        engine.builtins.register(self._before_snapshot, event="snapshot",
                                 phase=Phase.NETWORK, name="rehydrate.routes.capture",
                                 timeout=30.0, required=False)
        engine.add_status("network", self.status)

    def status(self) -> dict[str, Any]:
        with self._lock:
            cap = self.capture
            return {
                "declared_routes": len(self.routes),
                "declared_rulesets": len(self.rulesets) + len(self.iptables),
                "captured_routes": len(cap.routes) if cap else 0,
                "captured_tables": [t.label for t in cap.tables] if cap else [],
                "last_apply": self.last.to_dict() if self.last else None,
            }

    # -- declarations ---------------------------------------------------------------

    def add_route(self, r: Route) -> None:
        with self._lock:
            self.routes = [x for x in self.routes if x.key() != r.key()] + [r]

    def add_ruleset(self, items: Sequence[NftTable | NftCommands]) -> None:
        with self._lock:
            labels = {t.label for t in items if isinstance(t, NftTable)}
            self.rulesets = [x for x in self.rulesets
                             if not (isinstance(x, NftTable) and x.label in labels)]
            self.rulesets.extend(items)

    def add_iptables(self, rules: IptablesRules) -> None:
        with self._lock:
            self.iptables.append(rules)

    def take_capture(self, tables: Iterable[str] | None, required: bool) -> Capture:
        spec = (tuple(tables) if tables is not None else None, required)
        parts = _read_parts(spec[0], required)
        cap = Capture(parts.routes or (), parts.tables or (), time.time(), parts.problems())
        for p in cap.problems:
            log.warning("network capture: %s", p)
        with self._lock:
            self._capture_spec = spec
            self._unavailable_at_capture = frozenset(parts.unavailable)
            self.capture = cap
        self._prepare()
        return cap

    def _prepare(self) -> None:
        """Encode the route messages of the declarations and the capture now (before
        the snapshot), so that a restore only sends them."""
        with self._lock:
            todo = [*self.routes, *(self.capture.routes if self.capture else ())]
        if not todo or not _pyroute2_available():
            return

        def encode() -> None:
            rtnl = _Rtnl()
            try:
                by_name = {v: k for k, v in rtnl.links().items()}
            finally:
                rtnl.close()
            msgs = []
            for r in todo:
                try:
                    msgs.append(_route_msg(r, by_name))
                except NetworkError:
                    continue  # its device is not there (yet): encoded when applied
            self._encoder.warm(msgs)

        try:
            _off_loop(encode)
        except Exception as exc:  # only a lost optimisation: applying encodes anyway
            log.debug("network: route messages not pre-encoded: %s", _describe(exc))

    # -- hooks ----------------------------------------------------------------------

    def _before_snapshot(self, ctx: RestoreContext) -> None:
        with self._lock:
            spec = self._capture_spec
        if spec is not None:
            self._recapture(*spec)
        # import pyroute2 (a few hundred ms, once) and encode the route messages now,
        # not in the restore
        self._prepare()

    def _recapture(self, tables: tuple[str, ...] | None, required: bool) -> None:
        """Capture again before a snapshot, part by part: a part (routes, nftables
        tables) that cannot be read now keeps what the previous capture read, the other
        part is replaced. A part whose prerequisite was already missing at
        :func:`capture` (no ``nft`` binary, no nftables as on gVisor) is simply empty:
        :func:`capture` reported that once."""
        parts = _read_parts(tables, required)
        with self._lock:
            prev = self.capture
            baseline = self._unavailable_at_capture
        problems: list[str] = []

        def keep(part: str, fresh: tuple[_T, ...] | None, before: tuple[_T, ...]) -> tuple[_T, ...]:
            if fresh is not None:
                return fresh
            if part in parts.unavailable and part in baseline:
                return ()
            problems.append(parts.failed[part])
            return before

        routes = keep("routes", parts.routes, prev.routes if prev else ())
        problems.extend(parts.notes)
        nft_tables = keep("nftables", parts.tables, prev.tables if prev else ())
        seen = set(prev.problems) if prev else set()
        for p in problems:
            if p in seen:
                continue  # said at the previous capture already
            kept = ("; keeping the routes captured before" if p.startswith("routes: ") else
                    "; keeping the tables captured before" if p.startswith("nftables: ")
                    else "")
            log.warning("network capture before the snapshot: %s%s", p, kept)
        cap = Capture(routes, nft_tables, time.time(), tuple(problems))
        with self._lock:
            self.capture = cap

    def _after_restore(self, ctx: RestoreContext) -> None:
        result = self.apply(log_errors=False)  # the engine logs the hook's one failure
        if not result.ok:
            raise NetworkError(_summary(result))

    def apply(self, *, log_errors: bool = True) -> ApplyResult:
        """Re-apply declarations and the capture now; read back and compare."""
        with self._lock:
            declared = list(self.routes)
            rulesets = list(self.rulesets)
            ipt = list(self.iptables)
            cap = self.capture
        captured_routes = list(cap.routes) if cap else []
        captured_tables = list(cap.tables) if cap else []
        declared_labels = {t.label for t in rulesets if isinstance(t, NftTable)}
        tables: list[NftTable | NftCommands] = [
            t for t in captured_tables if t.label not in declared_labels]
        tables.extend(rulesets)
        result = ApplyResult()
        t0 = time.perf_counter()
        if not (declared or captured_routes or tables or ipt):
            return result
        missing = missing_prerequisites(routes=bool(declared or captured_routes),
                                        nft=bool(tables), iptables=bool(ipt))
        if missing:
            items = _count(declared, captured_routes, tables, ipt)
            required = any(x.required for x in [*declared, *captured_routes, *tables, *ipt])
            msg = f"cannot re-apply {items}: missing {', '.join(missing)}"
            if log_errors:
                log.error("network: %s", msg)
            result.errors.append(("network", required, msg))
            self.last = result
            return result
        routes_part, tables_part = ApplyResult(), ApplyResult()
        if declared or captured_routes:
            # routes (rtnetlink, on a thread of their own) and nftables tables (nft
            # subprocesses, here) do not depend on each other: apply them concurrently
            with ThreadPoolExecutor(1, thread_name_prefix="rehydrate-routes") as pool:
                routes_done = pool.submit(self._apply_routes, declared, captured_routes,
                                          routes_part)
                for t in tables:
                    self._apply_nft(t, tables_part)
                try:
                    routes_done.result()
                except Exception as exc:
                    req = any(r.required for r in [*declared, *captured_routes])
                    routes_part.errors.append(("routes", req, _describe(exc)))
        else:
            for t in tables:
                self._apply_nft(t, tables_part)
        result.routes, result.routes_skipped = routes_part.routes, routes_part.routes_skipped
        result.tables = tables_part.tables
        result.errors.extend(routes_part.errors + tables_part.errors)
        result.in_force.extend(tables_part.in_force)
        for rules in ipt:
            try:
                in_force, problem = _apply_iptables(rules)
            except Exception as exc:
                result.errors.append((f"{rules.tool} rules", rules.required, _describe(exc)))
                continue
            result.iptables_rules += sum(n for n, _ in in_force.values())
            result.in_force.extend(f"{rules.tool} {t}: {n}/{total} rule(s)"
                                   for t, (n, total) in in_force.items())
            if problem is not None:
                result.errors.append((f"{rules.tool} rules", rules.required, problem))
        result.duration = time.perf_counter() - t0
        for what, req, err in result.errors:
            if req and not log_errors:
                continue
            log.log(logging.ERROR if req else logging.WARNING, "network: %s: %s", what, err)
        self.last = result
        return result

    def _apply_routes(self, declared: list[Route], captured: list[Route],
                      result: ApplyResult) -> None:
        try:
            backend = _Rtnl()
        except Exception as exc:
            req = any(r.required for r in [*declared, *captured])
            result.errors.append(("routes", req, _describe(exc)))
            return
        try:
            by_name = {v: k for k, v in backend.links().items()}
            current_keys = {r.key(): r for r in read_routes(backend=backend)}
            todo: list[Route] = list(declared)
            declared_keys = {r.key() for r in declared}
            for r in captured:
                if r.key() in declared_keys:
                    continue
                have = current_keys.get(r.key())
                if have is not None:
                    if not r.matches(have):
                        log.info("route %s: the platform re-created %s; leaving it", r, have)
                    result.routes_skipped += 1
                    continue
                todo.append(r)
            # routes without a gateway (on-link) first: gateways may depend on them
            todo.sort(key=lambda r: r.gateway is not None)
            ready: list[tuple[Route, dict[str, Any]]] = []
            for r in todo:
                try:
                    ready.append((r, _route_msg(r, by_name)))
                except NetworkError as exc:
                    result.errors.append((f"route {r}", r.required, str(exc)))
            errors = backend.replace([msg for _, msg in ready], self._encoder) if ready else []
            applied: list[Route] = []
            for (r, _), failure in zip(ready, errors, strict=True):
                if failure is None:
                    applied.append(r)
                    continue
                err = _describe(failure)
                if "Operation not permitted" in err:
                    err += " (needs CAP_NET_ADMIN)"
                result.errors.append((f"route {r}", r.required, err))
            if applied:
                after: dict[tuple[int, str, int], list[Route]] = {}
                for x in read_routes(backend=backend):
                    after.setdefault(x.key()[:3], []).append(x)
                for r in applied:
                    if any(r.matches(x) for x in after.get(r.key()[:3], ())):
                        result.routes += 1
                    else:
                        result.errors.append((f"route {r}", r.required,
                                              "not in the routing table after applying"))
        finally:
            backend.close()

    def _apply_nft(self, t: NftTable | NftCommands, result: ApplyResult) -> None:
        if isinstance(t, NftTable):
            what = f"nftables table {t.label}"
            cmds = t.commands()
        else:
            what = "nftables ruleset"
            cmds = [dict(c) for c in t.commands]
        labels = ([(t.family, t.name)] if isinstance(t, NftTable) else t.tables())
        try:
            _nft(["-j", "-f", "-"], json.dumps({"nftables": cmds}))
        except Exception as exc:
            result.errors.append((what, t.required, _describe(exc)))
            self._nft_in_force(labels, result, "not applied: what was there before stays")
            return
        try:
            if isinstance(t, NftTable):
                back = read_table(t.family, t.name)
                if back is None:
                    raise NetworkError("table missing after applying")
                if back.canonical() != t.canonical():
                    raise NetworkError("read back differs from what was applied")
            else:
                for fam, name in t.tables():
                    if read_table(fam, name) is None:
                        raise NetworkError(f"table {fam} {name} missing after applying")
        except Exception as exc:
            result.errors.append((what, t.required, _describe(exc)))
            self._nft_in_force(labels, result, "applied, but differs from the declaration")
            return
        result.tables += 1
        result.in_force.extend(f"nftables {fam} {name}" for fam, name in labels)

    @staticmethod
    def _nft_in_force(labels: Iterable[tuple[str, str]], result: ApplyResult,
                      note: str) -> None:
        """After a failed nftables item: which of its tables are there anyway (``nft``
        applies one transaction atomically, so a table is there from before or not)."""
        for fam, name in labels:
            try:
                present = read_table(fam, name) is not None
            except Exception:  # noqa: S112 - reading back is best effort here
                continue
            if present:
                result.in_force.append(f"nftables {fam} {name} ({note})")


def _count(declared: list[Route], captured: list[Route],
           tables: Sequence[NftTable | NftCommands], ipt: list[IptablesRules]) -> str:
    parts = []
    if declared or captured:
        parts.append(f"{len(declared) + len(captured)} route(s)")
    if tables:
        parts.append(f"{len(tables)} nftables ruleset(s)")
    if ipt:
        parts.append(f"{len(ipt)} iptables ruleset(s)")
    return " and ".join(parts)


def _summary(result: ApplyResult) -> str:
    req = [(w, e) for w, r, e in result.errors if r]
    if len(req) == 1 and req[0][0] == "network":
        return req[0][1]
    head = "; ".join(f"{w}: {e}" for w, e in req[:5])
    more = f" (and {len(req) - 5} more)" if len(req) > 5 else ""
    return f"{len(req)} required network item(s) not re-applied: {head}{more}"


# --------------------------------------------------------------------------------------
# Module-level API
# --------------------------------------------------------------------------------------

def manager(engine: Engine | None = None) -> RoutesManager:
    """The routes manager of ``engine`` (default: the process-wide engine)."""
    return resolve_engine(engine).extension("routes", RoutesManager)


key = "routes"


def probe() -> Probe:
    """Usable with pyroute2 (``pip install 'rehydrate[routes]'``); nftables/iptables rules
    also need their binaries and ``CAP_NET_ADMIN`` when applied."""
    return Probe(True) if _pyroute2_available() else Probe(False, f"missing {PYROUTE2_MISSING}")


def install(engine: Engine) -> None:
    """Attach the routes manager to ``engine`` now (its functions also do on first use)."""
    manager(engine)


def route(  # noqa: PLR0917 - the order ip-route users expect
    dst: str,
    gateway: str | None = None,
    dev: str | None = None,
    table: int | None = None,
    metric: int | None = None,
    src: str | None = None,
    *,
    type: str = "unicast",
    scope: int | None = None,
    required: bool = True,
    family: int | str | None = None,
    engine: Engine | None = None,
) -> Route:
    """Declare a route re-applied (``replace``) after every restore. Nothing is applied
    now; a route with the same family, destination, table and metric replaces the
    earlier one. ``family`` (``"inet"``/``"inet6"``, 4/6 or ``socket.AF_INET*``) is
    taken from the addresses when not given; ``"default"`` alone is IPv4, ``"::/0"``
    (or ``family="inet6"``) the IPv6 default route."""
    if type not in _TYPE_CODES:
        raise ValueError(f"route type must be one of {sorted(_TYPE_CODES)}")
    fam = _FAMILIES.get(family.lower() if isinstance(family, str) else family)
    if fam is None:
        raise ValueError(f"route family must be 'inet' or 'inet6', not {family!r}")
    r = Route(dst, gateway, dev, table, metric, src, type, scope, required, fam)
    implied = socket.AF_INET6 if ":" in dst else socket.AF_INET
    if dst != "default" and implied != r.family:
        raise ValueError(f"route {dst}: its address is not of family {_FAMILY_NAMES[r.family]}")
    r.normalized()
    manager(engine).add_route(r)
    return r


def nftables(
    ruleset: Mapping[str, Any] | Sequence[Mapping[str, Any]] | str,
    *,
    required: bool = True,
    engine: Engine | None = None,
) -> list[str]:
    """Declare an nftables JSON ruleset re-applied after every restore.

    Give it as ``nft -j list table …`` prints it (tables with their chains, sets and
    rules: each table is then replaced atomically and read back for comparison), or as
    JSON commands (``{"nftables": [{"add": …}, …]}``, applied as written). Returns the
    labels of the tables it manages.
    """
    data: Any = json.loads(ruleset) if isinstance(ruleset, str) else ruleset
    if isinstance(data, Sequence):
        data = {"nftables": list(data)}
    items = data.get("nftables") if isinstance(data, Mapping) else None
    if not isinstance(items, list):
        raise ValueError("an nftables JSON ruleset is an object with an 'nftables' list")
    commands = [i for i in items if isinstance(i, Mapping) and len(i) == 1
                and next(iter(i)) in ("add", "create", "insert", "replace", "flush",
                                      "delete", "destroy", "reset")]
    decl: list[NftTable | NftCommands]
    if commands and len(commands) == len(items):
        cmd = NftCommands(tuple(commands), required)
        decl = [cmd]
        labels = [f"{f} {n}" for f, n in cmd.tables()]
    elif commands:
        raise ValueError("mix of nftables commands and listed objects; use one form")
    else:
        decl = list(_tables_from_listing(data, required))
        labels = [t.label for t in decl if isinstance(t, NftTable)]
    manager(engine).add_ruleset(decl)
    return labels


def iptables(
    rules: str,
    *,
    ipv6: bool = False,
    required: bool = True,
    engine: Engine | None = None,
) -> None:
    """Declare ``iptables-restore`` text (``*table`` / ``:CHAIN`` / ``-A`` / ``COMMIT``)
    re-applied with ``--noflush`` after every restore; rules that exist are not doubled."""
    decl = IptablesRules(rules, ipv6, required)
    decl.parsed()  # validate now, apply later
    manager(engine).add_iptables(decl)


def capture(
    *,
    tables: Iterable[str] | None = None,
    required: bool = True,
    engine: Engine | None = None,
) -> Capture:
    """Record the user-added routes and nftables tables (all, or ``tables`` such as
    ``["inet myapp"]``) of the current network namespace now and again before every
    snapshot; they are re-applied after each restore. Never raises: what could not be
    read is listed in ``Capture.problems`` (and logged)."""
    return manager(engine).take_capture(tables, required)


def apply(*, engine: Engine | None = None) -> ApplyResult:
    """Re-apply everything declared and captured now (what the restore hook does)."""
    return manager(engine).apply()
