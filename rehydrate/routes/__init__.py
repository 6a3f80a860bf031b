"""Routes and firewall rules, re-applied after a restore (``NETWORK`` phase).

Snapshot platforms do not restore user-added routes nor iptables/nftables rules (GKE Pod
snapshots say so; a gVisor restore rebuilds the network stack). This module re-creates
them, either from declarations or from a capture taken before the snapshot:

* :func:`route` declares a route (destination, gateway, device, table, metric, source;
  protocol, tos, IPv6 source prefix, realm), applied as ``ip route replace`` does —
  idempotent, protocol ``static`` unless it names one — with pyroute2
  (the ``routes`` extra): every route is one pyroute2 ``rtmsg`` (``RTM_NEWROUTE``,
  ``NLM_F_CREATE | NLM_F_REPLACE``; a captured route ``NLM_F_CREATE | NLM_F_EXCL``),
  encoded by pyroute2 before the snapshot (by :func:`capture` and the before-snapshot
  hook) and kept; after a restore all of them go out in one ``sendto``
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
  restore they are re-applied with no declaration at all, each route as it was captured
  (its protocol — ``boot``, ``bird`` … —, tos, IPv6 source prefix, realm, metrics …). A
  captured route is only added where no route with its key (destination, table, metric,
  tos, source prefix) exists after the restore: one that the platform or a routing
  daemon re-created since, whatever its protocol, is newer and stays (the kernel
  refuses ours: create-only); a declared route replaces it. Likewise a captured
  nftables table is only re-created where no table of its name exists (``nft create
  table``): after a resume the process's own table, with what other owners added and
  its counters and sets, stays as found. A declared table is replaced where it differs
  from its declaration and left untouched where it matches.

Routes (over rtnetlink, on a worker thread) and nftables tables (``nft`` subprocesses)
are applied concurrently. Everything applied is read back and compared (routes: one
pyroute2 dump). Each kind (routes, nftables rulesets, iptables rules, ip6tables rules)
is applied where its own prerequisites are there: without pyroute2, without the ``nft``
binary or nftables (gVisor implements only part of iptables), without the iptables
binaries, that kind alone fails in **one** message naming what is missing, required
when one of its own items is; without CAP_NET_ADMIN one message covers every kind.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._config import shown
from ..extensions import Probe, resolve_engine
from ._iptables import IptablesRules as IptablesRules
from ._iptables import iptables_join as iptables_join
from ._iptables import iptables_split as iptables_split
from ._manager import ApplyResult, Capture, RoutesManager, missing_prerequisites
from ._model import (
    _FAMILIES,
    _FAMILY_NAMES,
    _PROTO_NAMES,
    _TYPE_CODES,
    _UINT32,
    PYROUTE2_MISSING,
    NetworkError,
    NetworkUnavailable,
    Route,
    _checked_fields,
    _default_scope,
    _pyroute2_available,
)
from ._model import (
    has_cap_net_admin as has_cap_net_admin,
)
from ._model import (
    nft_binary as nft_binary,
)
from ._netlink import _route_msg as _route_msg
from ._netlink import _Rtnl as _Rtnl
from ._netlink import read_routes
from ._nftables import NftCommands as NftCommands
from ._nftables import NftTable as NftTable
from ._nftables import _tables_from_listing, read_table
from ._nftables import read_tables as read_tables

if TYPE_CHECKING:
    from ..extensions import Engine

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
    proto: int | str | None = None,
    tos: int = 0,
    from_prefix: str | None = None,
    realm: int | str | None = None,
    required: bool = True,
    family: int | str | None = None,
    engine: Engine | None = None,
) -> Route:
    """Declare a route re-applied (``replace``) after every restore. Nothing is applied
    now; a route with the same key (family, destination, table, metric, tos, source
    prefix) replaces the earlier one. ``family`` (``"inet"``/``"inet6"``, 4/6 or
    ``socket.AF_INET*``) is taken from the addresses when not given; ``"default"``
    alone is IPv4, ``"::/0"`` (or ``family="inet6"``, or a ``from_prefix``) the IPv6
    default route.

    As ``ip route`` spells them: ``proto`` is the route's protocol, a number 0-255 or
    its iproute2 name (``"bird"``, ``"zebra"`` …; default ``static``); ``tos`` (IPv4)
    the DS field the route matches (``0x10``); ``from_prefix`` (IPv6) a source prefix
    (``ip -6 route … from fd00:1::/64``); ``realm`` (IPv4) a destination realm (``5``
    or ``"5"``), ``"3/5"`` for source/destination realms, or the ``RTA_FLOW`` value
    (:attr:`Route.realm`)."""
    if type not in _TYPE_CODES:
        raise ValueError(f"route type must be one of {sorted(_TYPE_CODES)}")
    fam = _FAMILIES.get(family.lower() if isinstance(family, str) else family)
    if fam is None:
        raise ValueError(f"route family must be 'inet' or 'inet6', not {shown(family)}")
    r = _checked_route(dst, gateway=gateway, dev=dev, table=table, metric=metric, src=src,
                       kind=type, scope=scope, required=required, family=fam, proto=proto,
                       tos=tos, from_prefix=from_prefix, realm=realm)
    manager(engine).add_route(r)
    return r


_PROTO_CODES = {v: k for k, v in _PROTO_NAMES.items()}


def _checked_route(dst: object, *, gateway: object, dev: object, table: object,
                   metric: object, src: object, kind: str, scope: object, required: object,
                   family: int, proto: object = None, tos: object = 0,
                   from_prefix: object = None, realm: object = None) -> Route:
    """The declared route with its addresses in canonical form (as the kernel reports
    them, so that reading back compares equal), metric 0 as the kernel stores it and
    the type's default scope as none;
    ``ValueError``/``TypeError`` naming the field for anything the kernel would refuse
    or misread — checked here, so that one bad route cannot fail every route later."""
    import ipaddress

    what = _checked_fields(dst, gateway=gateway, src=src, from_prefix=from_prefix, dev=dev,
                           table=table, metric=metric, scope=scope, required=required)
    assert isinstance(dst, str)  # checked above
    net = None
    if dst != "default":
        try:
            net = ipaddress.ip_network(dst.strip())
        except ValueError as exc:
            raise ValueError(f"{what}: not a network address ({exc})") from None
    addresses = {}
    for name, value in (("gateway", gateway), ("src", src)):
        if value is None:
            continue
        assert isinstance(value, str)  # checked above
        try:
            addresses[name] = ipaddress.ip_address(value.strip())
        except ValueError as exc:
            raise ValueError(f"{what}: {name}: {exc}") from None
    versions = {a.version for a in [*([net] if net else []), *addresses.values()]}
    if len(versions) > 1:
        raise ValueError(f"{what}: mixes IPv4 and IPv6 addresses")
    implied = {4: socket.AF_INET, 6: socket.AF_INET6}[versions.pop()] if versions else None
    if family and implied is not None and implied != family:
        raise ValueError(f"{what}: its address is not of family {_FAMILY_NAMES[family]}")
    tos = 0 if tos is None else tos  # no tos, as for the other fields
    source = _source_prefix(what, from_prefix)
    # a source prefix exists only on IPv6 routes: `default from fd00:1::/64` is IPv6
    family = family or implied or (socket.AF_INET6 if source else socket.AF_INET)
    # an IPv6 route has no scope (the kernel keeps none, and reads back universe, 0)
    ipv4_only = [name for name, given in (("tos", tos != 0), ("realm", realm not in (None, 0)),
                                          ("scope", scope not in (None, 0)))
                 if given]
    if source is not None and family != socket.AF_INET6:
        raise ValueError(f"{what}: from_prefix (a source prefix) is for IPv6 routes only "
                         "(the kernel ignores it on IPv4)")
    if ipv4_only and family != socket.AF_INET:
        raise ValueError(f"{what}: {ipv4_only[0]} is for IPv4 routes only"
                         + (" (the kernel ignores it on IPv6)"
                            if ipv4_only[0] in ("realm", "scope") else ""))
    # the kernel refuses a tos with either ECN bit set ("ECN bits must be 0")
    if type(tos) is not int or not 0 <= tos <= 255 or tos & 3:
        raise ValueError(f"{what}: tos must be a whole number 0-255 with the two ECN bits "
                         f"clear (a DS field such as 0x10 or 0xb8), not {shown(tos)}")
    if metric == 0:  # the kernel's default metric: none stored (IPv4), 1024 (IPv6)
        metric = 1024 if family == socket.AF_INET6 else None
    gw, sr = addresses.get("gateway"), addresses.get("src")
    # the scope ip-route gives such a route anyway (253, link, for `dev` alone: what
    # `ip route` prints) is read back as no scope, as a captured route's is
    if scope is not None and scope == _default_scope(kind, None if gw is None else str(gw),
                                                     family):
        scope = None
    r = Route("default" if net is None else str(net), None if gw is None else str(gw),
              dev, table, metric, None if sr is None else str(sr),  # type: ignore[arg-type]
              kind, scope, required, family,  # type: ignore[arg-type]
              proto=_protocol(what, proto), tos=tos, from_prefix=source,
              realm=_realm(what, realm))
    # what the kernel refuses at every restore for want of a device (ENODEV, "Egress
    # device not specified"): refused here, where it is written
    if dev is None and kind == "local":
        raise ValueError(f"{what}: a local route needs a dev (the kernel refuses one "
                         "without: No such device)")
    if dev is None and kind == "unicast" and gw is None:
        raise ValueError(f"{what}: a route needs a gateway or a dev (the kernel refuses "
                         "one with neither: No such device)")
    # IPv4 refuses a device or gateway on these types at every restore; IPv6 drops them
    # (the route reads back on "lo"), so the read-back failed every restore
    if kind not in ("unicast", "local") and (dev is not None or gw is not None):
        given = " and ".join(n for n, v in (("dev", dev), ("gateway", gw)) if v is not None)
        raise ValueError(f"{what}: {'an' if kind[0] in 'aeiou' else 'a'} {kind} route takes no "
                         f"{given} (the kernel refuses it on IPv4 and drops it on IPv6)")
    if dev is None and kind == "unicast" and gw is not None and gw.is_link_local \
            and gw.version == 6:
        raise ValueError(f"{what}: the link-local gateway {gw} needs a dev (the kernel "
                         "refuses it without one: Egress device not specified)")
    return r


def _source_prefix(what: str, value: object) -> str | None:
    """An IPv6 source prefix in the kernel's spelling (host bits refused, as for the
    destination)."""
    import ipaddress

    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{what}: from_prefix must be a prefix string such as "
                        f"'fd00:1::/64', not {_type_name(value)}")
    try:
        net = ipaddress.ip_network(value.strip())
    except ValueError as exc:
        raise ValueError(f"{what}: from_prefix: not a network address ({exc})") from None
    if net.version != 6:
        raise ValueError(f"{what}: from_prefix (a source prefix) is for IPv6 routes only "
                         "(the kernel ignores it on IPv4)")
    return str(net)


def _protocol(what: str, value: object) -> int | None:
    """A route protocol as its number: 0-255, or the name iproute2 gives it."""
    if value is None or (type(value) is int and 0 <= value <= 255):
        return value
    code = _PROTO_CODES.get(value.strip().lower()) if isinstance(value, str) else None
    if code is None:
        raise ValueError(f"{what}: proto must be a whole number 0-255 or one of "
                         f"{', '.join(sorted(_PROTO_CODES))}, not {shown(value)}")
    return code


def _realm(what: str, value: object) -> int | None:
    """The ``RTA_FLOW`` value of ``realm 5`` (5), ``realms 3/5`` (0x30005) or of an
    ``RTA_FLOW`` number given as such."""
    if value is None or (type(value) is int and 0 <= value <= _UINT32):
        return value or None
    if isinstance(value, str):
        parts = value.strip().split("/")
        if len(parts) <= 2 and all(p.isascii() and p.isdigit() and int(p) <= 0xFFFF for p in parts):
            flow = int(parts[0]) << 16 | int(parts[1]) if len(parts) == 2 else int(parts[0])
            return flow or None  # realm 0 is no realm, as the kernel reports it
    raise ValueError(f"{what}: realm must be a realm 0-65535, 'source/destination' realms "
                     f"such as '3/5', or a whole number 0-{_UINT32} (RTA_FLOW), not {shown(value)}")


def _type_name(value: object) -> str:
    return type(value).__name__


def nftables(
    ruleset: Mapping[str, Any] | Sequence[Mapping[str, Any]] | str,
    *,
    required: bool = True,
    engine: Engine | None = None,
) -> list[str]:
    """Declare an nftables JSON ruleset re-applied after every restore.

    Give it as ``nft -j list table …`` prints it (tables with their chains, sets and
    rules: each table is then replaced atomically and read back for comparison), or as
    JSON commands (``{"nftables": [{"add": …}, …]}``, applied as written, except that
    their rules in chains of tables they do not create are sent only where those chains
    do not hold them in place already: :meth:`NftCommands.batch`; a rule there that nft
    lists otherwise than written is said once, with the form to write, and found by that
    form from then on). Returns the labels of the tables it manages. A listing with a
    table of iptables-nft rules (``xt`` compat expressions, which nft cannot apply) is a
    ``ValueError``: declare those rules with :func:`iptables`; so is a table with an
    ``ingress``/``egress`` chain without its ``"dev"`` (as ``nft -j list`` 1.0.6 prints
    it), which nft cannot create; so is a ruleset holding a value JSON cannot write (a
    Python ``set``, ``NaN``), and an ``add``/``create table`` command without the
    table's ``"family"`` and ``"name"``.
    """
    data: Any = json.loads(ruleset) if isinstance(ruleset, str) else ruleset
    if isinstance(data, Sequence):
        data = {"nftables": list(data)}
    items = data.get("nftables") if isinstance(data, Mapping) else None
    if not isinstance(items, list):
        raise ValueError("an nftables JSON ruleset is an object with an 'nftables' list")
    try:  # sent to nft as JSON on every restore: refused here, not there
        json.dumps(items, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the nftables ruleset cannot be written as JSON: {exc}") from exc
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
        # nft cannot apply xt compat expressions: such a table would fail every restore
        xt = [t.label for t in decl if isinstance(t, NftTable) and t.uses_xt()]
        if xt:
            raise ValueError(f"nftables table(s) {', '.join(xt)} hold iptables-nft rules "
                             "(xt compat expressions), which nft cannot re-apply; leave "
                             "them out and declare those rules with "
                             "rehydrate.routes.iptables()")
        # `nft -j list` (1.0.6) leaves an ingress/egress chain's device out, and nft
        # cannot create the chain without it: every restore where the table is gone
        # would fail "Missing `device'"
        blind = [f"{t.label} (chain(s) {', '.join(t.unlisted_devices())})" for t in decl
                 if isinstance(t, NftTable) and t.unlisted_devices()]
        if blind:
            raise ValueError(f"nftables table(s) {'; '.join(blind)}: ingress/egress "
                             "chain(s) without their device (\"dev\", which nft -j list "
                             "leaves out), which nft cannot create; give each such chain "
                             "its \"dev\"")
    if not decl:
        raise ValueError("the nftables ruleset declares nothing (no table, no command)")
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
    re-applied with ``--noflush`` after every restore; rules that exist are not doubled,
    and a missing one goes back before the declared rules of its chain that follow it.
    ``rules`` is a str (bytes: ``TypeError``)."""
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
    snapshot; they are re-applied after each restore as they were captured (protocol,
    tos, source prefix, realm … included), where no route with the same key was made
    since (a captured nftables table: where no table of its name exists, after a
    restore or a resume). Never raises: what could not be read, or a route that cannot
    be re-applied whole (an encapsulation, a nexthop object), is listed in
    ``Capture.problems`` (and logged); ``tables`` given as one string is a
    ``TypeError`` (it would be taken letter by letter and capture nothing).

    Calling it again starts afresh from what is there now: this is how to drop a
    captured route or table that the capture before each snapshot keeps while its
    re-apply failed (named in ``Capture.problems``; a route whose device is gone is
    dropped by itself)."""
    if isinstance(tables, str):
        raise TypeError(f"tables is a list of 'family name' strings, not one string "
                        f"(write [{tables!r}])")
    return manager(engine).take_capture(tables, required)


def apply(*, engine: Engine | None = None) -> ApplyResult:
    """Re-apply everything declared and captured now (what the restore hook does)."""
    return manager(engine).apply()
