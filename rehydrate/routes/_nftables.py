"""nftables rulesets: read with ``nft -j``, compared, re-applied as one batch."""

from __future__ import annotations

import json
import logging
import subprocess
from collections import Counter
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from ._model import NFT_TIMEOUT, NetworkError, NetworkUnavailable, nft_binary, nft_missing

log = logging.getLogger("rehydrate")


def _nft(args: Sequence[str], stdin: str | None = None) -> str:
    binary = nft_binary()
    if binary is None:
        raise NetworkUnavailable(f"missing {nft_missing()}")
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


_ADD_RANK = {"table": 0, "chain": 1, "element": 3, "rule": 4}  # any other kind: 2


def _add_rank(obj: Mapping[str, Any]) -> int:
    """Where an object goes in a batch that adds a table back: the table, its chains, its
    sets/maps/flowtables/stateful objects, separate elements, then the rules."""
    return _ADD_RANK.get(next(iter(obj)), 2)


def _strip(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k != "handle"}


def _normalize_expr(value: Any) -> Any:
    """Drop what changes by itself (counter values, an anonymous quota's bytes used,
    elements' ``expires``) so read-backs compare equal."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "counter" and isinstance(v, dict) and ("packets" in v or "bytes" in v):
                out[k] = {kk: vv for kk, vv in v.items() if kk not in ("packets", "bytes")}
            elif k == "counter" and v is None:
                out[k] = {}
            elif k == "quota" and isinstance(v, dict):  # an anonymous quota's bytes used
                out[k] = {kk: vv for kk, vv in v.items() if kk not in ("used", "used_unit")}
            elif k == "expires":
                continue
            else:
                out[k] = _normalize_expr(v)
        return out
    if isinstance(value, list):
        return [_normalize_expr(v) for v in value]
    return value


def _flags(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value] if isinstance(value, list) else []


def _dynamic_sets(objects: Sequence[Mapping[str, Any]]) -> set[str]:
    """Names of the sets rules fill (``update @s { … }``, ``add @s``, meters)."""
    names: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            target = value.get("set")
            if (isinstance(target, dict) and isinstance(target.get("set"), str)
                    and target.get("op") in ("add", "update", "delete")):
                names.add(target["set"].lstrip("@"))
            meter = value.get("meter")
            if isinstance(meter, dict) and isinstance(meter.get("name"), str):
                names.add(meter["name"])
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for obj in objects:
        if "rule" in obj:
            walk(obj["rule"])
    return names


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

    def commands(self, *, create_only: bool = False) -> list[dict[str, Any]]:
        """Replace the table atomically: ensure it exists, delete it, add it back. With
        ``create_only`` (a captured table), create it instead: the transaction fails
        with EEXIST, changing nothing, where a table of that name exists."""
        ident = {"family": self.family, "name": self.name}
        cmds: list[dict[str, Any]] = [] if create_only else [
            {"add": {"table": dict(ident)}}, {"delete": {"table": dict(ident)}}]
        # in dependency order, not the order ``nft -j list`` prints (maps and sets before
        # chains): a verdict map's ``jump c`` needs chain c, a rule needs its sets
        for obj in sorted(self.objects, key=_add_rank):
            ((kind, body),) = obj.items()
            verb = "create" if create_only and kind == "table" else "add"
            cmds.append({verb: {kind: _strip(body)}})
        return cmds

    def canonical(self) -> list[tuple[str, Any]]:
        """Objects without handles and what changes by itself, for comparison: counter
        values (of rules and of named counter objects), a quota's bytes used, elements'
        ``expires`` countdowns, and the elements of sets the datapath fills or expires
        (``flags timeout``/``dynamic``, the target of an ``update @set``/``add @set``
        rule or a meter)."""
        dynamic = _dynamic_sets(self.objects)
        out = []
        for obj in self.objects:
            for kind, raw in obj.items():
                body = _strip(raw)
                if kind in ("set", "map") and (
                        body.get("name") in dynamic
                        or {"timeout", "dynamic"} & set(_flags(body.get("flags")))):
                    body.pop("elem", None)
                elif kind == "quota":
                    body.pop("used", None)
                elif kind == "counter":  # a named counter object: its values run on
                    body.pop("packets", None)
                    body.pop("bytes", None)
                out.append((kind, _normalize_expr(body)))
        return out

    def same_as(self, have: NftTable) -> bool:
        """Whether ``have`` (read from the kernel) matches this table, compared as
        :meth:`canonical` does. A chain of ``have`` bound to a device it does not list
        (:meth:`unlisted_devices`: ``nft -j`` 1.0.6 leaves an ingress/egress chain's
        device out) matches this table's chain of its name whatever device that names:
        the listing cannot tell devices apart."""
        mine, theirs = self.canonical(), have.canonical()
        if mine == theirs:
            return True
        blind = set(have.unlisted_devices())
        if not blind:
            return False
        mine = [(kind, {k: v for k, v in body.items() if k != "dev"})
                if kind == "chain" and body.get("name") in blind else (kind, body)
                for kind, body in mine]
        return mine == theirs

    def unlisted_devices(self) -> list[str]:
        """The chains hooked to ``ingress``/``egress`` listed without their device
        (``dev``), which such a chain always has: ``nft -j list`` (nftables 1.0.6)
        leaves it out, and the table cannot be re-created from such a listing."""
        return [str(body.get("name")) for obj in self.objects
                for kind, body in obj.items()
                if kind == "chain" and isinstance(body, Mapping)
                and body.get("hook") in ("ingress", "egress") and "dev" not in body]

    def uses_xt(self) -> bool:
        """Whether a rule holds an ``xt`` compat expression (iptables-nft's), which nft
        cannot apply: looked for as an expression, not as text (a comment ``"xt"``)."""
        return any(_has_xt(body.get("expr")) for obj in self.objects
                   for kind, body in obj.items()
                   if kind == "rule" and isinstance(body, Mapping))

    def to_json(self) -> dict[str, Any]:
        return {"nftables": [dict(o) for o in self.objects]}


def _has_xt(value: Any) -> bool:
    """Whether an expression list holds an ``{"xt": …}`` expression at any depth."""
    if isinstance(value, Mapping):
        return "xt" in value or any(_has_xt(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_xt(v) for v in value)
    return False


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
        field = "name" if kind == "table" else "table"
        missing = [f for f in ("family", field) if f not in body]
        if missing:
            raise ValueError(f"nftables {kind} item has no {' or '.join(map(repr, missing))}")
        key = (str(body["family"]), str(body[field]))
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
    listed: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """The key (:func:`_rule_key`) of each of its rules that ``nft`` lists otherwise
    than written, to the listed one (:meth:`learn_listed`)."""

    def tables(self) -> list[tuple[str, str]]:
        out = []
        for cmd in self.commands:
            for verb, body in cmd.items():
                if verb in ("add", "create") and isinstance(body, Mapping) and "table" in body:
                    t = body["table"]
                    label = (str(t["family"]), str(t["name"]))
                    if label not in out:
                        out.append(label)
        return out

    def touched(self) -> list[str]:
        """The labels of every table the commands name (made, flushed, added to …), to
        name the ruleset in messages."""
        out: list[str] = []
        for cmd in self.commands:
            for body in cmd.values():
                if not isinstance(body, Mapping):
                    continue
                for kind, obj in body.items():
                    if not isinstance(obj, Mapping):
                        continue
                    name = obj.get("name") if kind == "table" else obj.get("table")
                    label = f"{obj.get('family', '?')} {name}"
                    if name is not None and label not in out:
                        out.append(label)
        return out

    @property
    def labels(self) -> set[str]:
        return {f"{f} {n}" for f, n in self.tables()}

    def foreign_tables(self) -> list[tuple[str, str]]:
        """The tables the commands add or insert rules into without creating them."""
        own = set(self.tables())
        out: list[tuple[str, str]] = []
        for cmd in self.commands:
            for verb, body in cmd.items():
                target = _rule_target(verb, body)
                if target is not None and target[:2] not in own and target[:2] not in out:
                    out.append(target[:2])
        return out

    def rule_key(self, rule: Mapping[str, Any]) -> str:
        """:func:`_rule_key` of one of the set's rules, or the form ``nft`` lists it in
        when it was seen to list it otherwise (:meth:`learn_listed`)."""
        key = _rule_key(rule)
        return self.listed.get(key, key)

    def batch(self, existing: Mapping[tuple[str, str], NftTable | None] | None = None,
              siblings: Sequence[NftCommands] = ()) -> list[dict[str, Any]]:
        """The commands, after emptying each table they create (``add table`` +
        ``delete table``, as :meth:`NftTable.commands` does): applied again on every
        restore and resume, they replace their tables instead of adding their rules
        once more (and the captured copy of such a table is not applied beside them).

        ``existing`` holds the tables they add rules to without creating them (from
        :meth:`foreign_tables`) as they are now. For each chain of those that exists,
        the set's ``add``/``insert rule`` commands are kept in the order and at the
        positions they put their rules (:func:`_chain_plan`): where the chain already
        holds them just so (a resume, or the captured copy of that table re-created
        first), they are left out, so nothing is added twice and their counters run
        on; otherwise the rules of the chain taken for theirs (same expression and
        comment, compared as :meth:`NftTable.canonical` does) are deleted by handle
        and all of them added back where the commands put them, in this one batch.
        After a command of the set that flushes or deletes that chain (or its table,
        or a rule of it), the rules that follow are added as written.

        ``siblings``: the engine's other command sets. The rules of a chain they take
        for theirs (as this set does, in their order, before this one) are not
        looked at: two sets inserting into one chain are each in place beside the
        other, instead of moving each other back and forth on every resume."""
        return [cmd for cmd, _ in self.planned(existing, siblings)]

    def planned(self, existing: Mapping[tuple[str, str], NftTable | None] | None = None,
                siblings: Sequence[NftCommands] = ()
                ) -> list[tuple[dict[str, Any], int | None]]:
        """:meth:`batch`, each ``add``/``insert rule`` command into a table the set does
        not create with the number of the command of the set it stands for."""
        own = set(self.tables())
        present: dict[tuple[str, str, str], list[tuple[int, str]]] = {}
        for label, table in (existing or {}).items():
            if table is None or label in own:
                continue
            for obj in table.objects:
                chain, rule = obj.get("chain"), obj.get("rule")
                if isinstance(chain, Mapping) and isinstance(chain.get("name"), str):
                    present.setdefault((label[0], label[1], chain["name"]), [])
                elif (isinstance(rule, Mapping) and isinstance(rule.get("chain"), str)
                      and isinstance(rule.get("handle"), int)):
                    present.setdefault((label[0], label[1], rule["chain"]), []).append(
                        (rule["handle"], _rule_key(rule)))
        theirs: dict[tuple[str, str, str], set[int]] = {}
        for chain, listed in present.items():
            taken = theirs.setdefault(chain, set())
            for other in siblings:
                if other is self:
                    continue
                for cmd in other.commands:
                    for verb, body in cmd.items():
                        if _rule_target(verb, body) == chain:
                            handle = _claim(verb, body["rule"], other.rule_key(body["rule"]),
                                            listed, taken)
                            if handle is not None:
                                taken.add(handle)
        live = set(present)
        groups: dict[tuple[str, str, str], list[int]] = {}
        for i, cmd in enumerate(self.commands):
            for verb, body in cmd.items():
                target = _rule_target(verb, body)
                if target is not None:
                    if target in live:
                        groups.setdefault(target, []).append(i)
                elif verb in ("flush", "delete", "destroy", "replace"):
                    _forget(body, live)
        # a chain's commands go where its last one was: what they need is made by then
        placed: dict[int, list[tuple[dict[str, Any], int | None]]] = {}
        dropped: set[int] = set()
        for chain, idxs in groups.items():
            rules = [(verb, body["rule"]) for i in idxs
                     for verb, body in self.commands[i].items()]
            plan = _chain_plan(chain, rules, [self.rule_key(r) for _, r in rules],
                               present[chain], theirs[chain])
            if plan is not None:
                dropped.update(idxs)
                placed[idxs[-1]] = [(cmd, None if n is None else idxs[n]) for cmd, n in plan]
        cmds: list[tuple[dict[str, Any], int | None]] = []
        for family, name in self.tables():
            ident = {"family": family, "name": name}
            cmds += [({"add": {"table": dict(ident)}}, None),
                     ({"delete": {"table": dict(ident)}}, None)]
        for i, cmd in enumerate(self.commands):
            if i in placed:
                cmds += placed[i]
            elif i not in dropped:
                target = next((t for v, b in cmd.items()
                               if (t := _rule_target(v, b)) is not None), None)
                cmds.append((dict(cmd), i if target is not None and target[:2] not in own
                             else None))
        return cmds

    def learn_listed(self, sent: Sequence[tuple[dict[str, Any], int | None]],
                     before: Mapping[tuple[str, str], NftTable | None],
                     after: Mapping[tuple[str, str], NftTable | None]) -> list[str]:
        """After ``sent`` (from :meth:`planned`) was applied: find, in each table the set
        adds rules to without creating it, the rule each of its ``add``/``insert rule``
        commands made (``nft`` numbers a table's new rules in the order of the
        transaction, above every handle it had ``before``), and remember, for a rule
        ``nft`` lists otherwise than written (``ct state == ["established",
        "related"]`` is listed as ``{"|": [...]}``), the listed form as its key: else it
        is never found in its chain, and is added again on every resume. Returns one
        message per rule newly seen so (to warn about). Where the new rules do not
        pair up one to one with the commands (another owner added rules meanwhile),
        nothing is learnt."""
        said: list[str] = []
        for label, was in before.items():
            now = after.get(label)
            if was is None or now is None or label in set(self.tables()):
                continue
            # the table's own handle is numbered apart (one count for every table)
            top = max((h for obj in was.objects for kind, body in obj.items()
                       if kind != "table" and isinstance(body, Mapping)
                       and isinstance(h := body.get("handle"), int)), default=0)
            made = sorted((body for obj in now.objects
                           if isinstance(body := obj.get("rule"), Mapping)
                           and isinstance(body.get("handle"), int) and body["handle"] > top),
                          key=lambda r: int(r["handle"]))
            ours = [(body["rule"], n) for cmd, n in sent if n is not None
                    for verb, body in cmd.items()
                    if (t := _rule_target(verb, body)) is not None and t[:2] == label]
            if len(made) != len(ours) or any(
                    got.get("chain") != rule["chain"]
                    for got, (rule, _) in zip(made, ours, strict=True)):
                log.debug("nftables ruleset: the rules made in %s %s do not pair up with "
                          "the set's commands; their listed forms not looked at", *label)
                continue
            for got, (rule, n) in zip(made, ours, strict=True):
                written, listed = _rule_key(rule), _rule_key(got)
                if self.listed.get(written, written) == listed:
                    continue
                self.listed[written] = listed
                shown = json.dumps(_normalize_expr(got.get("expr")))
                said.append(f"command {n + 1} (rule in {rule['family']} {rule['table']} "
                            f"chain {rule['chain']}): nft lists its rule otherwise than "
                            f"written, as expr {shown}; write it so (its place in the "
                            "chain is checked against that listed form from now on)")
        return said


_POSITION_FIELDS = ("handle", "index", "position")


def _claim(verb: str, rule: Mapping[str, Any], key: str,
           present: Sequence[tuple[int, str]], claimed: Container[int]) -> int | None:
    """The handle of the rule of ``present`` taken for ``rule``'s: the first unclaimed one
    with its key (for a plain ``add``, which nft appends: the last one)."""
    hits = [h for h, k in present if k == key and h not in claimed]
    if not hits:
        return None
    appended = verb == "add" and not any(f in rule for f in _POSITION_FIELDS)
    return hits[-1] if appended else hits[0]


def _chain_plan(chain: tuple[str, str, str], rules: Sequence[tuple[str, Mapping[str, Any]]],
                keys: Sequence[str], present: Sequence[tuple[int, str]],
                theirs: Container[int] = frozenset()
                ) -> list[tuple[dict[str, Any], int | None]] | None:
    """What to send for a command set's ``add``/``insert rule`` commands (``rules``, as
    (verb, rule), with their ``keys``) into one chain that holds ``present`` ((handle,
    rule key) in chain order) now: ``[]`` when the chain holds their rules already where
    they put them, else the deletion of the rules taken for theirs and the rules added
    back at those places, each with the number of the rule it is (None: a deletion);
    None when a position cannot be worked out (an index past the end, a handle not
    there): then they are sent as written.

    Where they go is worked out on the chain without the rules taken for theirs, as
    ``nft`` would on first applying them there: ``insert`` at the head, ``add`` at the
    end, ``index``/``handle`` relative to the rules there. Other owners' rules after
    the last rule taken for theirs were appended since, and stay after them (a resume
    does not move the set's rules behind them) -- but only while the rule the set puts
    last is there: when it went missing, the rules after the set's survivors may be
    rules it went in before, and the set is laid out on the whole chain as it is (so a
    rule appended since may end up before a rule put back at the end). The rules taken
    for theirs are, command by command, the first unclaimed rule with its expression
    and comment (for a plain ``add``: the last one), whoever added it: identical rules
    cannot be told apart. Rules are added back before the next rule not theirs
    (``insert`` with its ``handle``, each in turn), else appended: ``nft`` resolves an
    ``index`` on the chain as it was before the batch's deletions, and several ``add``
    after one handle do not land in order.

    ``theirs``: the handles of the rules the engine's other command sets take for
    theirs. They are never taken for this set's, and the chain is in place when it
    is without them: they stay where they are, and the set's rules added back go where
    ``nft`` would put them beside them."""
    family, table, name = chain
    claimed: dict[int, int] = {}  # handle -> the command it stands for
    for n, (verb, rule) in enumerate(rules):
        handle = _claim(verb, rule, keys[n],
                        [(h, k) for h, k in present if h not in theirs], claimed)
        if handle is not None:
            claimed[handle] = n
    missing = Counter(keys) - Counter(keys[n] for n in claimed.values())
    # ("other", handle) or ("ours", command number), in chain order
    end = max((i for i, (h, _) in enumerate(present) if h in claimed), default=-1)
    others = [("other", h) for h, _ in present if h not in claimed]
    trailing = [("other", h) for h, _ in present[end + 1:]] if claimed else []
    layout = _laid_out(rules, others[:len(others) - len(trailing)]) if trailing else None
    last = next((x for kind, x in reversed(layout or []) if kind == "ours"), None)
    if layout is not None and last is not None and not missing[keys[last]]:
        layout += trailing
    else:
        layout = _laid_out(rules, others)
        if layout is None:
            return None
    key_of = dict(present)
    if not missing and [
            key_of[x] if kind == "other" else keys[x] for kind, x in layout
            if kind == "ours" or x not in theirs
    ] == [k for h, k in present if h not in theirs]:
        return []
    ident = {"family": family, "table": table, "chain": name}
    out: list[tuple[dict[str, Any], int | None]] = [
        ({"delete": {"rule": {**ident, "handle": h}}}, None)
        for h, _ in present if h in claimed]
    for i, (kind, n) in enumerate(layout):
        if kind != "ours":
            continue
        body = {k: v for k, v in rules[n][1].items() if k not in _POSITION_FIELDS}
        anchor = next((x for k, x in layout[i + 1:] if k == "other"), None)
        out.append(({"add": {"rule": body}} if anchor is None
                    else {"insert": {"rule": {**body, "handle": anchor}}}, n))
    return out


def _laid_out(rules: Sequence[tuple[str, Mapping[str, Any]]],
              base: Sequence[tuple[str, int]]) -> list[tuple[str, int]] | None:
    """``base`` with each rule's ``("ours", number)`` where ``nft`` would put it."""
    layout = list(base)
    for n, (verb, rule) in enumerate(rules):
        at = _position(verb, rule, layout)
        if at is None:
            return None
        layout.insert(at, ("ours", n))
    return layout


def _position(verb: str, rule: Mapping[str, Any], layout: list[tuple[str, int]]
              ) -> int | None:
    """Where ``nft`` puts the rule of an ``add``/``insert`` in a chain laid out as
    ``layout``: ``add`` after, ``insert`` before the rule at its ``index`` or with its
    ``handle``/``position``; without either at the end or the head."""
    after = verb == "add"
    index = rule.get("index")
    handle = rule.get("handle", rule.get("position"))
    if isinstance(index, int) and not isinstance(index, bool):
        return index + after if 0 <= index < len(layout) else None
    if handle is not None:
        at = next((i for i, x in enumerate(layout) if x == ("other", handle)), None)
        return None if at is None else at + after
    return len(layout) if after else 0


def _rule_target(verb: str, body: Any) -> tuple[str, str, str] | None:
    """(family, table, chain) of an ``add``/``insert rule`` command, else None."""
    if verb not in ("add", "insert") or not isinstance(body, Mapping):
        return None
    rule = body.get("rule")
    if not isinstance(rule, Mapping) or not all(
            isinstance(rule.get(f), str) for f in ("family", "table", "chain")):
        return None
    return str(rule["family"]), str(rule["table"]), str(rule["chain"])


def _rule_key(rule: Mapping[str, Any]) -> str:
    """A rule's expression (canonical, counter values aside) and comment: another
    owner's rule with the same expression but its own comment is not this one."""
    return json.dumps([_normalize_expr(rule.get("expr")), rule.get("comment")],
                      sort_keys=True)


def _forget(body: Any, live: set[tuple[str, str, str]]) -> None:
    """Drop the chains a flush/delete/replace command empties or changes from ``live``
    (where unsure, every chain of the table or ruleset: their rules are then added as
    written)."""
    if not isinstance(body, Mapping):
        return
    for kind, raw in body.items():
        obj = raw if isinstance(raw, Mapping) else {}
        fam = obj.get("family")
        if kind == "ruleset":
            gone = {k for k in live if fam is None or k[0] == fam}
        elif kind == "table":
            gone = {k for k in live if k[:2] == (fam, obj.get("name"))}
        elif kind == "chain":
            gone = {k for k in live if k == (fam, obj.get("table"), obj.get("name"))}
        elif kind == "rule":
            gone = {k for k in live if k == (fam, obj.get("table"), obj.get("chain"))}
        else:
            continue
        live -= gone
