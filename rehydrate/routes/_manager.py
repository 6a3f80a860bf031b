"""The routes manager: capture before a snapshot, re-apply and verify after restore."""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .._context import RestoreContext
from .._hooks import Phase
from .._threads import fresh_lock_after_fork

if TYPE_CHECKING:
    from ..extensions import Engine
from ._iptables import IptablesRules, _apply_iptables, missing_iptables_tools
from ._model import (
    _T,
    PYROUTE2_MISSING,
    NetworkError,
    NetworkUnavailable,
    Route,
    _describe,
    _pyroute2_available,
    _rtnetlink_available,
    cap_net_admin_missing,
    has_cap_net_admin,
    nft_binary,
    nft_missing,
)
from ._netlink import (
    _CREATE_ONLY,
    _Encoder,
    _off_loop,
    _route_msg,
    _Rtnl,
    read_routes,
    unruled_tables,
)
from ._nftables import (
    NftCommands,
    NftPlan,
    NftTable,
    _nft,
    made_handles,
    read_table,
    read_tables,
    rule_marks,
)

log = logging.getLogger("rehydrate")



_KINDS = ("routes", "nftables", "iptables", "ip6tables")


def _missing_for(kind: str, cap: bool) -> list[str]:
    """What stops re-applying one kind of state here, CAP_NET_ADMIN aside."""
    if kind == "routes":
        return ([PYROUTE2_MISSING] if not _pyroute2_available() else
                [] if _rtnetlink_available() else
                ["rtnetlink (NETLINK_ROUTE sockets are not supported here)"])
    if kind != "nftables":
        return missing_iptables_tools(kind)
    if nft_binary() is None:
        return [nft_missing()]
    if cap:  # without it, nft fails whatever else is there
        try:
            _nft(["list", "tables"])
        except NetworkUnavailable as exc:
            return [f"nftables support ({exc})"]
        except Exception as exc:
            return [f"a working nft ({_describe(exc)})"]
    return []


def missing_prerequisites(*, routes: bool = True, nft: bool = True,
                          iptables: bool = False, ip6tables: bool = False) -> list[str]:
    """What stops re-applying the given kinds of state here (empty: nothing): routes,
    nftables rulesets, iptables or ip6tables rules (``iptables``, ``iptables-save``
    and ``iptables-restore``, on PATH or in /usr/sbin or /sbin)."""
    kinds = [k for k, wanted in zip(_KINDS, (routes, nft, iptables, ip6tables),
                                    strict=True) if wanted]
    cap = has_cap_net_admin()
    missing = [cap_net_admin_missing()] if kinds and not cap else []
    for kind in kinds:
        missing.extend(_missing_for(kind, cap))
    return missing


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
    tables_skipped: int = 0
    """Captured tables not re-applied: a table of that name existed after the restore."""
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
                "tables": self.tables, "tables_skipped": self.tables_skipped,
                "iptables_rules": self.iptables_rules,
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


def _read_parts(tables: Iterable[str] | None, required: bool,
                declared: frozenset[str] = frozenset()) -> _Parts:
    """Read the routes and nftables tables; ``declared`` holds the labels of the tables
    declared with :func:`~rehydrate.routes.nftables` (which take the place of their
    capture: no note about not capturing them)."""
    parts = _Parts()
    try:
        skipped: list[str] = []
        parts.routes = tuple(replace(r, required=required)
                             for r in read_routes(user_only=True, skipped=skipped))
        parts.notes.extend(skipped)
    except Exception as exc:
        parts.failed["routes"] = f"routes: {_describe(exc)}"
        if _prerequisite_missing(exc):
            parts.unavailable.add("routes")
    nft_tables: list[NftTable] = []
    notes: list[str] = []
    try:
        wanted = {" ".join(t.split()) for t in tables} if tables is not None else None
        found: set[str] = set()
        for t in read_tables():
            if wanted is not None and t.label not in wanted and t.name not in wanted:
                continue
            found.update((t.label, t.name))
            if t.uses_xt():
                notes.append(f"nftables table {t.label} holds iptables-nft rules; "
                             "declare them with rehydrate.routes.iptables()")
                continue
            blind = t.unlisted_devices()
            if blind:  # re-creating it would fail "Missing `device'" at every restore
                if t.label in declared:  # declared already, as the note would ask
                    continue
                notes.append(f"nftables table {t.label} not captured: nft lists its chain(s) "
                             f"{', '.join(blind)} without their device; declare it with "
                             "rehydrate.routes.nftables(), each such chain with its \"dev\"")
                continue
            nft_tables.append(replace(t, required=required))
        notes.extend(f"nftables table {w} does not exist here (nothing captured for it)"
                     for w in sorted(wanted or ()) if w not in found)
    except Exception as exc:
        parts.failed["nftables"] = f"nftables: {_describe(exc)}"
        if _prerequisite_missing(exc):
            parts.unavailable.add("nftables")
    else:
        parts.tables = tuple(nft_tables)
        parts.notes.extend(notes)
    return parts


class RoutesManager:
    """Per-engine declarations, the last capture, and the NETWORK-phase hooks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        self.routes: list[Route] = []
        self.rulesets: list[NftTable | NftCommands] = []
        self.iptables: list[IptablesRules] = []
        self.capture: Capture | None = None
        self._capture_spec: tuple[tuple[str, ...] | None, bool] | None = None
        self._unavailable_at_capture: frozenset[str] = frozenset()
        self.last: ApplyResult | None = None
        # the keys of the captured routes and the labels of the captured tables that the
        # last apply() could not re-apply: kept by the next capture while still absent
        self._failed_routes: frozenset[tuple[Any, ...]] = frozenset()
        self._failed_tables: frozenset[str] = frozenset()
        self._encoder = _Encoder()
        self._missing_warned = False  # pyroute2 missing: said once, at the first route
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
            warn = not self._missing_warned and not _pyroute2_available()
            self._missing_warned |= warn
        if warn:  # said here, where it is deployed, not first in a restored clone's report
            log.warning("route %s declared, but it cannot be re-applied after a restore "
                        "without %s", r.dst, PYROUTE2_MISSING)

    def add_ruleset(self, items: Sequence[NftTable | NftCommands]) -> None:
        with self._lock:
            # a table declared again replaces the earlier declaration of it: a listed
            # table, or a command set all of whose tables are declared again (and an
            # identical command set declared again is the same declaration)
            labels = set().union(*(_labels(t) for t in items))
            for x in self.rulesets:  # the same declaration: what was learnt of it holds
                if isinstance(x, NftCommands):
                    for t in items:
                        if isinstance(t, NftCommands) and t == x:
                            t.listed.update(x.listed)
            self.rulesets = [x for x in self.rulesets
                             if x not in items and not (_labels(x) and _labels(x) <= labels)]
            self.rulesets.extend(items)

    def add_iptables(self, rules: IptablesRules) -> None:
        with self._lock:
            self.iptables.append(rules)

    def take_capture(self, tables: Iterable[str] | None, required: bool) -> Capture:
        spec = (tuple(tables) if tables is not None else None, required)
        parts = _read_parts(spec[0], required, self._declared_labels())
        cap = Capture(parts.routes or (), parts.tables or (), time.time(), parts.problems())
        for p in cap.problems:
            log.warning("network capture: %s", p)
        _warn_unruled(cap.routes)
        with self._lock:
            self._capture_spec = spec
            self._unavailable_at_capture = frozenset(parts.unavailable)
            self.capture = cap
        self._prepare()
        return cap

    def _declared_labels(self) -> frozenset[str]:
        with self._lock:
            return frozenset().union(*(_labels(t) for t in self.rulesets))

    def _prepare(self) -> None:
        """Encode the route messages of the declarations and the capture now (before
        the snapshot), so that a restore only sends them."""
        with self._lock:
            # (route, create-only) as _apply_routes sends them: the flag is in the message
            todo = [*((r, False) for r in self.routes),
                    *((r, True) for r in (self.capture.routes if self.capture else ()))]
        if not todo or not _pyroute2_available():
            return

        def encode() -> None:
            rtnl = _Rtnl()
            try:
                by_name = {v: k for k, v in rtnl.links().items()}
            finally:
                rtnl.close()
            msgs = []
            for r, create_only in todo:
                try:
                    msgs.append(_route_msg(r, by_name, create_only=create_only))
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
        parts = _read_parts(tables, required, self._declared_labels())
        with self._lock:
            prev = self.capture
            baseline = self._unavailable_at_capture
            failed_routes, failed_tables = self._failed_routes, self._failed_tables
        problems: list[str] = []
        # A captured route or table whose re-apply failed at the last restore (its device
        # came up late, …) is absent now through that failure, not because its owner
        # removed it: dropping it here would make the next restore report ok without it.
        if prev is not None and parts.routes is not None:
            fresh = {r.key() for r in parts.routes}
            lost = [r for r in prev.routes if r.key() in failed_routes and r.key() not in fresh]
            # ... unless its device is gone too: removed on purpose (a tunnel taken down
            # for good), the route would fail every restore from now on
            gone = [r for r in lost if r.dev is not None and not _device_exists(r.dev)]
            for r in gone:
                log.warning("network capture before the snapshot: route %s: not re-applied "
                            "after the last restore and its device %s no longer exists; "
                            "dropped from the capture", r, r.dev)
            lost = [r for r in lost if r not in gone]
            parts.routes += tuple(lost)
            problems.extend(f"route {r}: not re-applied after the last restore and still "
                            "absent; kept in the capture" for r in lost)
        if prev is not None and parts.tables is not None:
            fresh_labels = {t.label for t in parts.tables}
            lost_tables = [t for t in prev.tables
                           if t.label in failed_tables and t.label not in fresh_labels]
            parts.tables += tuple(lost_tables)
            problems.extend(f"nftables table {t.label}: not re-applied after the last "
                            "restore and still absent; kept in the capture"
                            for t in lost_tables)

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
        """Re-apply declarations and the capture now; read back and compare.

        Each kind — routes, nftables rulesets, iptables rules, ip6tables rules — is
        applied when its own prerequisites are there: one that is missing fails (or,
        when every item of the kind is optional, warns about) that kind alone, in one
        line, and the others are applied."""
        with self._lock:
            declared = list(self.routes)
            rulesets = list(self.rulesets)
            ipt = list(self.iptables)
            cap = self.capture
        captured_routes = list(cap.routes) if cap else []
        captured_tables = list(cap.tables) if cap else []
        declared_labels = set().union(*(_labels(t) for t in rulesets))
        tables: list[NftTable | NftCommands] = [
            t for t in captured_tables if t.label not in declared_labels]
        # declarations of a table take the place of its capture: these labels are unique
        captured_labels = {t.label for t in tables if isinstance(t, NftTable)}
        tables.extend(rulesets)
        result = ApplyResult()
        t0 = time.perf_counter()
        kinds: dict[str, Sequence[Route | NftTable | NftCommands | IptablesRules]] = {
            "routes": [*declared, *captured_routes], "nftables": tables,
            "iptables": [r for r in ipt if not r.ipv6],
            "ip6tables": [r for r in ipt if r.ipv6]}
        kinds = {k: items for k, items in kinds.items() if items}
        # captured items not re-applied this time (until shown otherwise: all of them)
        failed_routes = {r.key() for r in captured_routes} - {r.key() for r in declared}
        failed_tables = set(captured_labels)
        if not kinds:
            # still the last apply: status() kept the one before, errors and all
            self.last = result
            self._set_failed(failed_routes, failed_tables)
            return result
        for kind in self._blocked(kinds, result):
            del kinds[kind]
        if "routes" not in kinds:
            declared, captured_routes = [], []
        if "nftables" not in kinds:
            tables = []
        ipt = [r for r in ipt if r.tool in kinds]
        routes_part, tables_part = ApplyResult(), ApplyResult()
        if declared or captured_routes:
            # routes (rtnetlink, on a thread of their own) and nftables tables (nft
            # subprocesses, here) do not depend on each other: apply them concurrently
            with ThreadPoolExecutor(1, thread_name_prefix="rehydrate-routes") as pool:
                routes_done = pool.submit(self._apply_routes, declared, captured_routes,
                                          routes_part, failed_routes)
                self._apply_tables(tables, captured_labels, tables_part, failed_tables)
                try:
                    routes_done.result()
                except Exception as exc:
                    req = any(r.required for r in [*declared, *captured_routes])
                    routes_part.errors.append(("routes", req, _describe(exc)))
        else:
            self._apply_tables(tables, captured_labels, tables_part, failed_tables)
        result.routes, result.routes_skipped = routes_part.routes, routes_part.routes_skipped
        result.tables, result.tables_skipped = tables_part.tables, tables_part.tables_skipped
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
            # a missing prerequisite ("network") says what it is about itself
            log.log(logging.ERROR if req else logging.WARNING, "network: %s",
                    err if what == "network" else f"{what}: {err}")
        self.last = result
        self._set_failed(failed_routes, failed_tables)
        return result

    def _set_failed(self, routes: set[tuple[Any, ...]], tables: set[str]) -> None:
        with self._lock:
            self._failed_routes, self._failed_tables = frozenset(routes), frozenset(tables)

    @staticmethod
    def _blocked(kinds: dict[str, Sequence[Route | NftTable | NftCommands | IptablesRules]],
                 result: ApplyResult) -> list[str]:
        """The kinds whose prerequisites are missing, each with one error in ``result``
        (``network``), required when one of the kind's own items is. Without
        CAP_NET_ADMIN no kind can be applied: one error for all (one for the required
        kinds, one for the optional ones)."""
        cap = has_cap_net_admin()
        missing = {k: _missing_for(k, cap) for k in kinds}
        required = {k: any(x.required for x in items) for k, items in kinds.items()}
        if cap:
            groups = [[k] for k in kinds if missing[k]]
        else:
            groups = [g for g in ([k for k in kinds if required[k]],
                                  [k for k in kinds if not required[k]]) if g]
        for group in groups:
            what = dict.fromkeys([] if cap else [cap_net_admin_missing()])
            for k in group:
                what.update(dict.fromkeys(missing[k]))
            counts = " and ".join(_count(k, len(kinds[k])) for k in group)
            result.errors.append(("network", any(required[k] for k in group),
                                  f"cannot re-apply {counts}: missing {', '.join(what)}"))
        return [k for g in groups for k in g]

    def _apply_tables(self, tables: list[NftTable | NftCommands], captured: set[str],
                      result: ApplyResult, failed: set[str]) -> None:
        """Apply the nftables items; ``captured`` holds the labels of the captured tables,
        ``failed`` those not (yet) re-applied or found: each one that is leaves it.

        A captured table is re-created only where no table of its name exists: one that
        exists after the restore or resume (the original process's, kept by a resume;
        one the platform or another owner made since) belongs to whoever has it now,
        with its counters and the elements its rules added, and stays as found. A
        declared table (listed objects) is the declaration's: replaced where it differs
        from it, left untouched where it already matches (counters and dynamic set
        elements kept). Command rulesets are applied again every time, after the
        tables, but their rules in chains of tables they do not create only where those
        chains do not hold them in place already, planned for all of them at once
        (:class:`NftPlan`)."""
        existing: dict[str, NftTable] | None = None
        sets = [t for t in tables if isinstance(t, NftCommands)]
        # the tables as read since a transaction here last changed them (None: absent):
        # each listed once while nothing here changes it (see _apply_nft)
        seen: dict[tuple[str, str], NftTable | None] = {}
        if any(isinstance(t, NftTable) for t in tables):
            try:
                listing = read_tables()
            except Exception as exc:  # then applying finds out
                log.debug("network: nftables tables not read before applying: %s",
                          _describe(exc))
            else:
                existing = {t.label: t for t in listing}
                seen = {(t.family, t.name): t for t in listing}
                seen.update((label, None) for s in sets for label in s.foreign_tables()
                            if label not in seen)
        for t in tables:
            if not isinstance(t, NftTable):
                continue
            if existing is not None and t.label in existing:
                have = existing[t.label]
                if t.label in captured:
                    _table_left_alone(t, have, result)
                    failed.discard(t.label)
                    continue
                if t.same_as(have):
                    result.tables += 1
                    result.in_force.append(f"nftables {t.label}")
                    continue
            if self._apply_nft(t, result, seen, create_only=t.label in captured):
                failed.discard(t.label)
        # the command sets after the tables (which they may add rules to, and which
        # depend on no command set), their rules in others' chains planned for all of
        # them at once, on the chains as the tables left them
        # (one JSON cannot write is left to fail alone: nftables() refuses such a set,
        # but add_ruleset() takes any, and the declared dicts stay the caller's to change)
        joint = [t for t in sets if _encodable(t)]
        # the plan from the chains as they are now, not as the listing taken before
        # the tables' transactions had them (another owner may have changed them)
        for label in {x for s in joint for x in s.foreign_tables()}:
            seen.pop(label, None)
        plan: NftPlan | None = None
        if joint:
            try:
                plan = NftPlan(joint, _foreign(seen, *joint))
            except Exception as exc:  # then each set is planned on its own
                log.debug("network: nftables command sets not planned together: %s",
                          _describe(exc))
        for t in sets:
            i = next((n for n, x in enumerate(joint) if x is t), None)
            self._apply_nft(t, result, seen,
                            plan=(plan, i) if plan is not None and i is not None else None)

    def _apply_routes(self, declared: list[Route], captured: list[Route],
                      result: ApplyResult, failed: set[tuple[Any, ...]]) -> None:
        """Apply the routes; ``failed`` holds the keys of the captured ones not (yet)
        re-applied or found: each one that is leaves it."""
        try:
            backend = _Rtnl()
        except Exception as exc:
            req = any(r.required for r in [*declared, *captured])
            result.errors.append(("routes", req, _describe(exc)))
            return
        try:
            by_name = {v: k for k, v in backend.links().items()}
            current_keys = {r.key(): r for r in read_routes(backend=backend)}
            # (route, create-only): a declaration replaces whatever has its key; a
            # captured route is only added where nothing has its key (see _left_alone)
            todo: list[tuple[Route, bool]] = [(r, False) for r in declared]
            declared_keys = {r.key() for r in declared}
            for r in captured:
                if r.key() in declared_keys:
                    continue
                have = current_keys.get(r.key())
                if have is not None:
                    _left_alone(r, have)
                    result.routes_skipped += 1
                    failed.discard(r.key())
                    continue
                todo.append((r, True))
            # routes without a gateway (on-link) first: gateways may depend on them
            todo.sort(key=lambda item: item[0].gateway is not None)
            ready: list[tuple[Route, dict[str, Any]]] = []
            for r, create_only in todo:
                try:
                    ready.append((r, _route_msg(r, by_name, create_only=create_only)))
                except NetworkError as exc:
                    result.errors.append((f"route {r}", r.required, str(exc)))
                except Exception as exc:  # a Route no declaration checked: only this one
                    result.errors.append((f"route {r}", r.required, _describe(exc)))
            errors = backend.replace([msg for _, msg in ready], self._encoder) if ready else []
            applied: list[Route] = []
            taken: list[Route] = []  # captured, but something got its key first
            for (r, msg), failure in zip(ready, errors, strict=True):
                if failure is None:
                    applied.append(r)
                    continue
                if msg.get(_CREATE_ONLY) and getattr(failure, "errno", None) == errno.EEXIST:
                    taken.append(r)
                    result.routes_skipped += 1
                    failed.discard(r.key())
                    continue
                err = _describe(failure)
                if "Operation not permitted" in err:
                    err += " (needs CAP_NET_ADMIN)"
                result.errors.append((f"route {r}", r.required, err))
            if applied or taken:
                after: dict[tuple[int, str, int], list[Route]] = {}
                for x in read_routes(backend=backend):
                    after.setdefault(x.key()[:3], []).append(x)
                for r in taken:
                    _left_alone(r, next((x for x in after.get(r.key()[:3], ())
                                         if x.key() == r.key()), None))
                for r in applied:
                    if any(r.matches(x) for x in after.get(r.key()[:3], ())):
                        result.routes += 1
                        failed.discard(r.key())
                    else:
                        result.errors.append((f"route {r}", r.required,
                                              "not in the routing table after applying"))
        finally:
            backend.close()

    def _apply_nft(self, t: NftTable | NftCommands, result: ApplyResult,
                   seen: dict[tuple[str, str], NftTable | None], *,
                   create_only: bool = False, plan: tuple[NftPlan, int] | None = None
                   ) -> bool:
        """Apply one nftables item: True when it is in force (or, captured, left as
        found). ``seen``: the tables read since a transaction last changed them
        (:func:`_foreign`), kept up to date here. ``plan``: the engine's command sets'
        :class:`NftPlan`, and which of them ``t`` is (None: ``t`` planned on its own)."""
        absent: list[str] = []
        planned: list[tuple[dict[str, Any], int | None]] = []
        handles: list[int | None] | None = None
        marks: dict[tuple[str, str], int] | None = None
        joint: NftPlan | None = None
        i = 0
        if isinstance(t, NftTable):
            what = f"nftables table {t.label}"
            labels = [(t.family, t.name)]
        else:
            what = f"nftables ruleset ({', '.join(t.touched()) or 'no table named'})"
            labels = t.tables()
        try:
            if isinstance(t, NftTable):
                cmds = t.commands(create_only=create_only)
            else:
                # in the try: a set that cannot be planned fails alone
                joint, i = plan if plan is not None else (NftPlan([t], _foreign(seen, t)), 0)
                absent = [f"{fam} {name}" for fam, name in t.foreign_tables()
                          if joint.absent(fam, name)]
                planned = joint.planned(i)
                cmds = [cmd for cmd, _ in planned]
            if cmds and not isinstance(t, NftTable) and any(n is not None for _, n in planned):
                # the rules it makes in others' tables are found after the transaction
                # above these marks (never from an echo: a big set's overflows nft's
                # socket with ENOBUFS after the kernel committed): the later sets add
                # theirs beside them, and their listed forms are looked up by them
                marks = rule_marks(_foreign(seen, t))
            if cmds:  # else a set's rules are all in their chains already
                # what it may change is read again, even if it fails: a table's
                # transaction changes that table alone, a command set's any
                if isinstance(t, NftTable):
                    seen.pop((t.family, t.name), None)
                else:
                    seen.clear()
                _nft(["-j", "-f", "-"], json.dumps({"nftables": cmds}))
        except Exception as exc:
            if create_only and isinstance(t, NftTable) and "File exists" in str(exc):
                # made between the read and the transaction: the kernel refused ours
                _table_left_alone(t, None, result)
                return True
            err = _describe(exc)
            if absent:  # nft itself says only "No such file or directory"
                some = len(absent) > 1
                err += (f" (table{'s' if some else ''} {', '.join(absent)} "
                        f"{'do' if some else 'does'} not exist: the set adds rules to "
                        f"{'them' if some else 'it'} without creating "
                        f"{'them' if some else 'it'}; whatever makes "
                        f"{'them' if some else 'it'} must run before rehydrate.routes)")
            result.errors.append((what, t.required, err))
            self._nft_in_force(labels, result, "not applied: what was there before stays",
                               seen)
            return False
        try:
            if isinstance(t, NftTable):
                back = seen[(t.family, t.name)] = read_table(t.family, t.name)
                if back is None:
                    raise NetworkError("table missing after applying")
                if not t.same_as(back):
                    raise NetworkError("read back differs from what was applied")
            else:
                after = None
                if marks is not None:
                    after = _foreign(seen, t)
                    handles = made_handles(planned, marks, after)
                if joint is not None:
                    joint.done(i, planned, handles)
                for fam, name in t.tables():
                    seen[(fam, name)] = read_table(fam, name)
                    if seen[(fam, name)] is None:
                        raise NetworkError(f"table {fam} {name} missing after applying")
                if after is not None and handles is not None:
                    _learn_listed(t, what, planned, handles, after)
        except Exception as exc:
            result.errors.append((what, t.required, _describe(exc)))
            self._nft_in_force(labels, result, "applied, but differs from the declaration",
                               seen)
            return False
        result.tables += 1
        result.in_force.extend(f"nftables {fam} {name}" for fam, name in labels)
        return True

    @staticmethod
    def _nft_in_force(labels: Iterable[tuple[str, str]], result: ApplyResult,
                      note: str, seen: dict[tuple[str, str], NftTable | None]) -> None:
        """After a failed nftables item: which of its tables are there anyway (``nft``
        applies one transaction atomically, so a table is there from before or not)."""
        for label in labels:
            try:
                if label not in seen:
                    seen[label] = read_table(*label)
            except Exception:  # noqa: S112 - reading back is best effort here
                continue
            if seen[label] is not None:
                result.in_force.append(f"nftables {label[0]} {label[1]} ({note})")


def _learn_listed(t: NftCommands, what: str, sent: list[tuple[dict[str, Any], int | None]],
                  handles: list[int | None],
                  after: dict[tuple[str, str], NftTable | None]) -> None:
    """After a command set added rules to chains it does not own (``after``: those
    read back, ``handles``: of the rules made): say (WARNING, once per rule) which of
    its rules ``nft`` lists otherwise than written -- never found in their chain by
    their written form, they would be added again on every resume; the listed form is
    their key from now on (:meth:`NftCommands.learn_listed`)."""
    try:
        said = t.learn_listed(sent, handles, after)
    except Exception as exc:  # only the check of the listed forms lost
        log.debug("%s: rules not read back for their listed forms: %s", what, _describe(exc))
        return
    for line in said:
        log.warning("%s: %s", what, line)


def _device_exists(name: str) -> bool:
    try:
        socket.if_nametoindex(name)
    except OSError:
        return False
    return True


def _warn_unruled(routes: Sequence[Route]) -> None:
    """One WARNING when captured routes sit in tables no ``ip rule`` looks up: rules
    are neither captured nor re-applied, so a platform that drops them leaves those
    routes doing nothing, and this one already does."""
    try:
        unruled = unruled_tables(routes)
    except Exception as exc:  # only a warning lost
        log.debug("network capture: ip rules not read: %s", _describe(exc))
        return
    if unruled:
        names = ", ".join(f"{'inet6 ' if fam == socket.AF_INET6 else ''}table {t}"
                          for fam, t in unruled)
        log.warning("network capture: routes captured in %s, which no ip rule looks up "
                    "(ip rules are not captured nor re-applied: add them after a "
                    "restore yourself)", names)


def _encodable(cmds: NftCommands) -> bool:
    try:
        json.dumps(list(cmds.commands), allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _foreign(seen: dict[tuple[str, str], NftTable | None], *sets: NftCommands
             ) -> dict[tuple[str, str], NftTable | None]:
    """The tables command sets add rules to without creating them, as they are now:
    from ``seen`` (read since the last transaction), else read now and noted there
    (one that cannot be read is left out: its rules are added as written)."""
    out: dict[tuple[str, str], NftTable | None] = {}
    for fam, name in dict.fromkeys(x for cmds in sets for x in cmds.foreign_tables()):
        if (fam, name) not in seen:
            try:
                seen[(fam, name)] = read_table(fam, name)
            except Exception as exc:  # then applying finds out
                log.debug("network: nftables table %s %s not read before applying: %s",
                          fam, name, _describe(exc))
                continue
        out[(fam, name)] = seen[(fam, name)]
    return out


def _left_alone(captured: Route, have: Route | None) -> None:
    """Say (INFO) that a captured route is not re-applied because a route with its key
    (destination, table, metric, tos, source prefix) exists after the restore: made by
    the platform, a routing daemon or the application since, whatever its protocol. That
    one is newer than the capture and belongs to whoever made it; replacing it would
    take it from its owner (a daemon that owns routes by protocol would find its route
    gone). Same-key routes are exclusive in the kernel, so the captured one stays out."""
    if have is None:  # one a Route cannot express (multipath …) has the key
        log.info("route %s: a route with its key exists after the restore (multipath or "
                 "otherwise not expressible); leaving it", captured)
    elif not captured.matches(have):
        log.info("route %s: %s exists after the restore (the platform or a routing "
                 "daemon re-created it); leaving it", captured, have)


def _table_left_alone(captured: NftTable, have: NftTable | None,
                      result: ApplyResult) -> None:
    """Say (INFO) that a captured table is not re-applied because a table of its name
    exists after the restore or resume, and count it: as for routes, the one there
    now belongs to whoever has it (the process itself after a resume, with the rules
    another owner added since, its counters and its sets' elements), and replacing it
    with the capture would roll all of that back."""
    result.tables_skipped += 1
    result.in_force.append(f"nftables {captured.label} (existing: left as found)")
    if have is not None and captured.same_as(have):
        log.info("nftables table %s exists after the restore, as captured; leaving it",
                 captured.label)
    else:
        log.info("nftables table %s exists after the restore and differs from its "
                 "capture (changed since, by whoever owns it); leaving it", captured.label)


def _labels(t: NftTable | NftCommands) -> set[str]:
    """The labels (``inet app``) of the tables a declaration replaces."""
    return {t.label} if isinstance(t, NftTable) else t.labels


_KIND_NAMES = {"routes": "route(s)", "nftables": "nftables ruleset(s)",
               "iptables": "iptables ruleset(s)", "ip6tables": "ip6tables ruleset(s)"}


def _count(kind: str, n: int) -> str:
    return f"{n} {_KIND_NAMES[kind]}"


def _summary(result: ApplyResult) -> str:
    req = [(w, e) for w, r, e in result.errors if r]
    if len(req) == 1 and req[0][0] == "network":
        return req[0][1]
    # a missing prerequisite's message says what it is about ("cannot re-apply …")
    head = "; ".join(e if w == "network" else f"{w}: {e}" for w, e in req[:5])
    more = f" (and {len(req) - 5} more)" if len(req) > 5 else ""
    return f"{len(req)} required network item(s) not re-applied: {head}{more}"
