"""Routes and rules as values, the errors, and what applying them needs here."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from .. import _config

if TYPE_CHECKING:
    pass

log = logging.getLogger("rehydrate")


CAP_NET_ADMIN = 12
NETLINK_ROUTE = 0
RTPROT_BOOT = 3  # what `ip route add` gives a route; `ip route` leaves it unsaid
RTPROT_STATIC = 4  # what route() declarations are applied with
RT_TABLE_COMPAT = 252
RT_TABLE_MAIN = 254
RT_TABLE_LOCAL = 255
_IPV6_DEFAULT_METRIC = 1024
_SKIP_PROTOS = {2: "kernel", 9: "ra", 16: "dhcp"}
# the names iproute2 gives route protocols (/usr/share/iproute2/rt_protos), for str() and
# to_dict(); a captured route keeps its number whatever it is
_PROTO_NAMES = {0: "unspec", 1: "redirect", 2: "kernel", 3: "boot", 4: "static", 8: "gated",
                9: "ra", 10: "mrt", 11: "zebra", 12: "bird", 13: "dnrouted", 14: "xorp",
                15: "ntk", 16: "dhcp", 17: "mrouted", 18: "keepalived", 42: "babel",
                99: "openr", 186: "bgp", 187: "isis", 188: "ospf", 189: "rip", 192: "eigrp"}
_ROUTE_TYPES = {1: "unicast", 2: "local", 6: "blackhole", 7: "unreachable", 8: "prohibit",
                9: "throw"}
_TYPE_CODES = {v: k for k, v in _ROUTE_TYPES.items()}
# the types a route of ours cannot be (named in the note of a route not captured)
_OTHER_TYPES = {0: "unspec", 3: "broadcast", 4: "anycast", 5: "multicast", 10: "nat",
                11: "xresolve"}
RT_SCOPE_HOST = 254
RT_SCOPE_LINK = 253
RTNH_F_ONLINK = 4
# RTA_PREF (IPv6 route preference, RFC 4191): medium (0) is the kernel's default
_PREFS = {3: "low", 0: "medium", 1: "high"}
_PREF_CODES = {v: k for k, v in _PREFS.items()}
NFT_TIMEOUT = 20.0
RTNL_TIMEOUT = 10.0
_BATCH = 256  # routes per sendto (a route message is at most ~120 bytes)
_SEQ_BASE = 0x10000000  # our batch's sequence numbers, far from pyroute2's own

_T = TypeVar("_T")


class NetworkError(RuntimeError):
    """Some routes or rules could not be re-applied or did not read back as applied."""


class NetworkUnavailable(NetworkError):
    """A prerequisite is missing (capability, binary, module, kernel support)."""


def has_cap_net_admin() -> bool:
    """CAP_NET_ADMIN in effect *over this network namespace*: the capability, held in
    the user namespace that owns the network namespace (or one of its ancestors). Root
    of a user namespace made without a network namespace of its own (``unshare -Ur``)
    holds it in its set but not over the network namespace it joined."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return (bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
                            and _netns_in_scope())
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


_NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1)


def _netns_in_scope() -> bool:
    """False when the network namespace is owned by a user namespace outside this
    process's own (the kernel then refuses ``NS_GET_USERNS`` with EPERM, and our
    capabilities do not reach it); True otherwise, also where that cannot be told (an
    older kernel, a sandbox without namespace files)."""
    try:
        fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        owner = fcntl.ioctl(fd, _NS_GET_USERNS)
    except OSError as exc:
        return exc.errno != errno.EPERM
    finally:
        os.close(fd)
    os.close(owner)
    return True


def cap_net_admin_missing() -> str:
    """What :func:`has_cap_net_admin` found missing, in the words of an error message."""
    if not _netns_in_scope():
        return (f"CAP_NET_ADMIN over this network namespace (uid {os.geteuid()} runs in "
                "a user namespace that does not own it)")
    return f"CAP_NET_ADMIN (uid {os.geteuid()} runs without it)"


def tool_path(name: str) -> str | None:
    """The executable ``name`` on PATH, else in /usr/sbin or /sbin (which a user's or a
    service's PATH often leaves out): the path to run it by."""
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None)


def nft_binary() -> str | None:
    configured = _config.text("REHYDRATE_NFT")
    if configured is not None:
        return configured if os.access(configured, os.X_OK) else None
    return tool_path("nft")


def nft_missing() -> str:
    """What is missing when :func:`nft_binary` found none, naming REHYDRATE_NFT's value
    when that is what points nowhere."""
    configured = _config.text("REHYDRATE_NFT")
    if configured is not None:
        return f"the nft binary REHYDRATE_NFT names ({configured}: not an executable file)"
    return "the nft binary (install nftables, or set REHYDRATE_NFT)"


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


_UINT32 = 2**32 - 1


def _checked_fields(dst: object, *, gateway: object, src: object, from_prefix: object,
                    dev: object, table: object, metric: object, scope: object,
                    required: object) -> str:
    """``route 'dst'`` (the prefix of every message about the route) once the fields that
    need no address parsing are of the right type and range: ``TypeError``/``ValueError``
    naming the field otherwise, the value through :func:`rehydrate._config.shown`. One
    rule for :func:`rehydrate.routes.route` and a :class:`Route` built directly."""
    if not isinstance(dst, str):
        raise TypeError(f"route destination must be a string such as '10.0.0.0/24' or "
                        f"'default', not {type(dst).__name__}")
    what = f"route {_config.shown(dst)}"
    for name, value in (("gateway", gateway), ("src", src)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{what}: {name} must be an address string, not "
                            f"{type(value).__name__}")
    if from_prefix is not None and not isinstance(from_prefix, str):
        raise TypeError(f"{what}: from_prefix must be a prefix string such as "
                        f"'fd00:1::/64', not {type(from_prefix).__name__}")
    if dev is not None and (not isinstance(dev, str) or not dev or len(dev) > 15
                            or any(c.isspace() or c == "/" for c in dev)):
        raise ValueError(f"{what}: dev must be a network device name (1-15 characters, "
                         f"no spaces or '/'), not {_config.shown(dev)}")
    for name, value, low, high in (("table", table, 1, _UINT32), ("metric", metric, 0, _UINT32),
                                   ("scope", scope, 0, 255)):
        if value is not None and (type(value) is not int or not low <= value <= high):
            raise ValueError(f"{what}: {name} must be a whole number {low}-{high}, not "
                             f"{_config.shown(value)}")
    if not isinstance(required, bool):
        raise TypeError(f"{what}: required must be True or False, not "
                        f"{type(required).__name__}")
    return what


@dataclass(frozen=True)
class Route:
    """One route. ``dst`` is ``"default"`` or a prefix such as ``"10.0.0.0/24"``.

    ``family`` is ``socket.AF_INET`` or ``socket.AF_INET6``; left out (0), it is taken
    from the addresses (``"::/0"`` is IPv6) and is IPv4 for ``"default"`` without one.
    It is a field, not a guess from the text, so it survives :meth:`normalized` (which
    writes ``::/0`` as ``default``) and routes read from the kernel keep their family.

    ``onlink`` is the nexthop flag of ``ip route … onlink`` (the gateway is on the link
    even though no prefix of the device covers it); ``metrics`` the route's
    ``RTA_METRICS`` as sorted (name, value) pairs in pyroute2's names without the
    ``RTAX_`` prefix, lower case (``(("advmss", 1360), ("mtu", 1400))``; ``lock`` is the
    bit mask of the locked ones); ``pref`` an IPv6 route's preference (``"low"``,
    ``"high"``; None is the kernel's default, ``"medium"``).

    ``proto`` is the route's protocol number (``ip route … proto``: 3 ``boot``, what
    ``ip route add`` gives, 4 ``static``, 12 ``bird`` …): a captured route keeps the one
    the kernel reported, so that whoever owns routes by protocol (a routing daemon, a
    DHCP client) still recognises it after re-application; None (a declaration that
    names none) is applied as ``static`` and accepts any protocol when compared. ``tos`` (IPv4: the
    route matches only packets with this DS field) and ``from_prefix`` (IPv6: a source
    prefix, ``ip -6 route … from fd00:1::/64``) are part of what the kernel identifies a
    route by, like the destination. ``realm`` is the route's ``RTA_FLOW`` (IPv4) as the
    kernel keeps it, ``source realm << 16 | destination realm`` (``ip route … realm 5``
    is 5, ``realms 3/5`` is 0x30005).
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
    onlink: bool = False
    metrics: tuple[tuple[str, int | str], ...] = ()
    pref: str | None = None
    proto: int | None = None
    tos: int = 0
    from_prefix: str | None = None
    realm: int | None = None

    def __post_init__(self) -> None:
        # A Route built directly gets the checks of route() that need no parsing: a
        # non-string dst ended in "argument of type 'int' is not iterable", a bad table
        # or metric only when the route was applied, with every other route.
        what = _checked_fields(self.dst, gateway=self.gateway, src=self.src,
                               from_prefix=self.from_prefix, dev=self.dev, table=self.table,
                               metric=self.metric, scope=self.scope, required=self.required)
        if self.type not in _TYPE_CODES:
            raise ValueError(f"{what}: type must be one of {sorted(_TYPE_CODES)}, not "
                             f"{_config.shown(self.type)}")
        if isinstance(self.family, bool) or not isinstance(self.family, int):
            raise TypeError(f"{what}: family must be socket.AF_INET or AF_INET6, not "
                            f"{type(self.family).__name__}")
        if not isinstance(self.onlink, bool):
            raise TypeError(f"{what}: onlink must be True or False, not "
                            f"{type(self.onlink).__name__}")
        family = int(self.family) or _family_of_text(self) or socket.AF_INET
        if family not in _FAMILY_NAMES:
            raise ValueError("route family must be AF_INET or AF_INET6, not "
                             f"{_config.shown(self.family)}")
        object.__setattr__(self, "family", family)
        for name, value, high in (("proto", self.proto, 255), ("tos", self.tos, 255),
                                  ("realm", self.realm, 2**32 - 1)):
            if value is not None and (type(value) is not int or not 0 <= value <= high):
                raise ValueError(f"{what}: {name} must be a whole number "
                                 f"0-{high}, not {_config.shown(value)}")
        # what the kernel refuses (tos on IPv6) or, worse, silently drops (a source
        # prefix on IPv4, a realm on IPv6): refused here, by name
        if family == socket.AF_INET6 and self.tos:
            raise ValueError(f"{what}: tos is for IPv4 routes only")
        if family == socket.AF_INET and self.from_prefix is not None:
            raise ValueError(f"{what}: a source prefix (from) is for IPv6 routes "
                             "only (the kernel ignores it on IPv4)")
        if family == socket.AF_INET6 and self.realm:
            raise ValueError(f"{what}: realm is for IPv4 routes only (the kernel "
                             "ignores it on IPv6)")
        object.__setattr__(self, "metrics", tuple(sorted(
            (str(k).lower().removeprefix("rtax_"), v) for k, v in self.metrics)))
        if self.pref is not None and self.pref not in _PREF_CODES:
            raise ValueError(f"route pref must be one of {sorted(_PREF_CODES)}, "
                             f"not {_config.shown(self.pref)}")

    @property
    def family_name(self) -> str:
        return _FAMILY_NAMES[self.family]

    def normalized(self) -> Route:
        dst = self.dst
        if dst in ("default", "0.0.0.0/0", "::/0"):
            dst = "default"
        elif "/" not in dst:
            dst = f"{dst}/{128 if self.family == socket.AF_INET6 else 32}"
        # no metric is what the kernel stores as 0 (IPv4: none) or 1024 (IPv6), as
        # route() does for metric=0: a declared IPv6 route without one is the same route
        # as its captured copy (metric 1024)
        metric = self.metric
        if self.family == socket.AF_INET6 and not metric:
            metric = _IPV6_DEFAULT_METRIC
        elif self.family == socket.AF_INET and metric == 0:
            metric = None
        pref = None if self.pref == "medium" else self.pref
        # a source prefix of length 0 is no source prefix (the kernel reports none)
        from_prefix = self.from_prefix
        if from_prefix is not None and from_prefix.endswith("/0"):
            from_prefix = None
        return replace(self, dst=dst, table=self.table or RT_TABLE_MAIN, metric=metric,
                       pref=pref, from_prefix=from_prefix, realm=self.realm or None)

    def key(self) -> tuple[int, str, int, int | None, int, str | None]:
        """What the kernel identifies a route by: family, destination, table, metric (no
        metric is the kernel's default: none for IPv4, 1024 for IPv6), tos (IPv4) and
        source prefix (IPv6). Two routes with the same key cannot both exist: adding
        one replaces (or, create-only, is refused by) the other."""
        n = self.normalized()
        return (n.family, n.dst, n.table or RT_TABLE_MAIN, n.metric, n.tos, n.from_prefix)

    def matches(self, other: Route) -> bool:
        """``other`` (read back from the kernel) satisfies this (possibly partial) route:
        the same family, destination, table, type, tos and source prefix, and each
        attribute this route sets (None: any)."""
        a, b = self.normalized(), other.normalized()
        if ((a.family, a.dst, a.table, a.type, a.tos, a.from_prefix)
                != (b.family, b.dst, b.table, b.type, b.tos, b.from_prefix)):
            return False
        return (all(getattr(a, f) is None or getattr(a, f) == getattr(b, f)
                    for f in ("gateway", "dev", "metric", "src", "scope", "pref", "proto",
                              "realm"))
                and (not a.onlink or b.onlink) and set(a.metrics) <= set(b.metrics))

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in (("dst", self.dst), ("gateway", self.gateway),
                                  ("dev", self.dev), ("table", self.table),
                                  ("metric", self.metric), ("src", self.src),
                                  ("family", self.family_name), ("type", self.type),
                                  ("scope", self.scope), ("pref", self.pref),
                                  ("onlink", self.onlink or None),
                                  ("metrics", dict(self.metrics) or None),
                                  ("proto", None if self.proto is None
                                   else _PROTO_NAMES.get(self.proto, self.proto)),
                                  ("tos", self.tos or None),
                                  ("from", self.from_prefix), ("realm", self.realm))
                if v is not None}

    def __str__(self) -> str:
        """As ``ip route`` spells it (protocol ``boot``, its default, left unsaid)."""
        parts = [self.dst]
        if self.from_prefix is not None:
            parts.append(f"from {self.from_prefix}")
        if self.tos:
            parts.append(f"tos {self.tos:#04x}")
        via = self.gateway
        if via is not None and self.family == socket.AF_INET and ":" in via:
            via = f"inet6 {via}"  # an IPv4 route through an IPv6 gateway, as ip spells it
        for label, v in (("via", via), ("dev", self.dev), ("table", self.table),
                         ("metric", self.metric), ("src", self.src)):
            if v is not None:
                parts.append(f"{label} {v}")
        if self.proto is not None and self.proto != RTPROT_BOOT:
            parts.append(f"proto {_PROTO_NAMES.get(self.proto, self.proto)}")
        if self.realm:
            parts.append(f"realms {self.realm >> 16}/{self.realm & 0xFFFF}"
                         if self.realm >> 16 else f"realm {self.realm}")
        if self.onlink:
            parts.append("onlink")
        parts.extend(f"{k} {v}" for k, v in self.metrics)
        if self.pref is not None:
            parts.append(f"pref {self.pref}")
        if self.type != "unicast":
            parts.insert(0, self.type)
        if self.family == socket.AF_INET6:  # as `ip -6 route` would need it spelled out
            parts.insert(0, "inet6")
        return " ".join(str(p) for p in parts)


def _make_route(*, family: int, dst: str | None, dst_len: int, table: int, scope: int,
                kind: int, gateway: str | None, oif: int | None, priority: int | None,
                prefsrc: str | None, multipath: bool, links: Mapping[int, str],
                flags: int = 0, metrics: Any = None, pref: int | None = None,
                proto: int | None = None, tos: int = 0, src: str | None = None,
                src_len: int = 0, flow: int | None = None) -> Route | None:
    """A kernel route as a :class:`Route`; None when not expressible (multipath,
    broadcast/anycast/multicast/nat types: see :func:`_not_expressible`)."""
    rtype = _ROUTE_TYPES.get(kind)
    if rtype is None or multipath:
        return None
    dst_s = "default" if dst is None or dst_len == 0 else f"{dst}/{dst_len}"
    default_scope = _default_scope(rtype, gateway, family)
    # the kernel reports IPv6 blackhole/unreachable/prohibit/throw routes on "lo", but
    # refuses a device for these types when they are added
    dev = (links.get(oif) if oif is not None and rtype in ("unicast", "local")
           else None)
    return Route(
        dst=dst_s, gateway=gateway, dev=dev, table=table, metric=priority, src=prefsrc,
        type=rtype, scope=None if scope == default_scope else scope, family=family,
        onlink=bool(flags & RTNH_F_ONLINK),
        metrics=tuple((k, v) for k, v in (metrics or {}).get("attrs", ())),
        # medium, the default, is left out (as for a route declared without one)
        pref=None if not pref or family != socket.AF_INET6 else _PREFS.get(pref),
        proto=proto, tos=tos, realm=flow or None,
        from_prefix=f"{src}/{src_len}" if src is not None and src_len else None,
    )


def _default_scope(rtype: str, gateway: str | None, family: int) -> int:
    """The scope ``ip route add`` gives a route of this type (IPv6 routes have none)."""
    if family != socket.AF_INET:
        return 0
    if rtype == "local":
        return RT_SCOPE_HOST
    return RT_SCOPE_LINK if rtype == "unicast" and gateway is None else 0


def _not_expressible(*, dst: str | None, dst_len: int, table: int, kind: int,
                     multipath: bool, family: int) -> str:
    """Why a kernel route :func:`_make_route` cannot express is not captured, naming it
    (a ``Capture.problems`` note)."""
    dst_s = "default" if dst is None or dst_len == 0 else f"{dst}/{dst_len}"
    what = " ".join(p for p in (
        "inet6" if family == socket.AF_INET6 else "",
        "" if multipath else _OTHER_TYPES.get(kind, f"type {kind}"),
        dst_s, f"table {table}") if p)
    why = ("multipath routes are not supported" if multipath
           else f"{_OTHER_TYPES.get(kind, f'type {kind}')} routes are not supported")
    return f"route {what} not captured: {why}"


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
