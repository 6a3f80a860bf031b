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
        """(family, name) of each table the commands add or create; ``ValueError`` for
        such a command without both (nft refuses it too: "Object item not found")."""
        out = []
        for n, cmd in enumerate(self.commands):
            for verb, body in cmd.items():
                if verb in ("add", "create") and isinstance(body, Mapping) and "table" in body:
                    t = body["table"]
                    if not isinstance(t, Mapping) or not all(
                            isinstance(t.get(k), str) for k in ("family", "name")):
                        raise ValueError(f"nftables command {n} ({verb} table) needs a "
                                         "\"family\" and a \"name\" string, such as "
                                         "{\"family\": \"inet\", \"name\": \"app\"}")
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

    def batch(self, existing: Mapping[tuple[str, str], NftTable | None] | None = None
              ) -> list[dict[str, Any]]:
        """The commands, after emptying each table they create (``add table`` +
        ``delete table``, as :meth:`NftTable.commands` does): applied again on every
        restore and resume, they replace their tables instead of adding their rules
        once more (and the captured copy of such a table is not applied beside them).

        ``existing`` holds the tables they add rules to without creating them (from
        :meth:`foreign_tables`) as they are now. For each chain of those that exists,
        the set's ``add``/``insert rule`` commands are kept in the order and at the
        positions they put their rules (:class:`NftPlan`, here for this set alone):
        where the chain already holds them just so (a resume, or the captured copy of
        that table re-created first), they are left out, so nothing is added twice and
        their counters run on; otherwise the rules of the chain taken for theirs (same
        expression and comment, compared as :meth:`NftTable.canonical` does) are
        deleted by handle and all of them added back where the commands put them, in
        this one batch. After a command of the set that flushes or deletes that chain
        (or its table, or a rule of it), the rules that follow are added as written."""
        return [cmd for cmd, _ in self.planned(existing)]

    def planned(self, existing: Mapping[tuple[str, str], NftTable | None] | None = None
                ) -> list[tuple[dict[str, Any], int | None]]:
        """:meth:`batch`, each ``add``/``insert rule`` command into a table the set does
        not create with the number of the command of the set it stands for."""
        return NftPlan([self], existing or {}).planned(0)

    def learn_listed(self, sent: Sequence[tuple[dict[str, Any], int | None]],
                     handles: Sequence[int | None],
                     after: Mapping[tuple[str, str], NftTable | None]) -> list[str]:
        """After ``sent`` (from :meth:`planned`) was applied, ``handles`` being the
        handle of the rule each of its ``add``/``insert rule`` commands made, in order
        (:func:`made_handles`): find each rule made in a table the set adds rules to without
        creating it in ``after`` (those tables read back), and remember, for a rule
        ``nft`` lists otherwise than written (``ct state == ["established",
        "related"]`` is listed as ``{"|": [...]}``), the listed form as its key: else it
        is never found in its chain, and is added again on every resume. Returns one
        message per rule newly seen so (to warn about)."""
        said: list[str] = []
        made = [(body["rule"], n) for cmd, n in sent for verb, body in cmd.items()
                if _rule_target(verb, body) is not None]
        if len(made) != len(handles):  # not what was sent: nothing to pair them by
            return said
        listed_by: dict[tuple[str, str, int], Mapping[str, Any]] = {
            (label[0], label[1], body["handle"]): body
            for label, table in after.items() if table is not None
            for obj in table.objects
            if isinstance(body := obj.get("rule"), Mapping)
            and isinstance(body.get("handle"), int)}
        for (rule, n), handle in zip(made, handles, strict=True):
            if n is None or handle is None:
                continue
            got = listed_by.get((rule["family"], rule["table"], handle))
            if got is None:
                continue
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


def rule_marks(tables: Mapping[tuple[str, str], NftTable | None]) -> dict[tuple[str, str], int]:
    """The highest rule handle of each table read (0: none, or the table absent), noted
    before a transaction: a table's handles only grow, so the rules it makes there are
    those above the mark (:func:`made_handles`)."""
    return {label: max((body["handle"] for obj in (table.objects if table else ())
                        if isinstance(body := obj.get("rule"), Mapping)
                        and isinstance(body.get("handle"), int)), default=0)
            for label, table in tables.items()}


def made_handles(sent: Sequence[tuple[dict[str, Any], int | None]],
                 marks: Mapping[tuple[str, str], int],
                 after: Mapping[tuple[str, str], NftTable | None]
                 ) -> list[int | None] | None:
    """The handles of the rules ``sent``'s ``add``/``insert rule`` commands made, in
    order (None for one into a table not marked: one the set creates or that could
    not be read), found in
    ``after`` (those tables read back) as the rules above their table's mark
    (:func:`rule_marks`): a transaction numbers the rules it makes in the order of its
    commands. None when they do not pair up with the commands (a table not read, or
    rules another owner added or deleted meanwhile): then they stay unknown."""
    made = [target[:2] for cmd, _ in sent for verb, body in cmd.items()
            if (target := _rule_target(verb, body)) is not None]
    new: dict[tuple[str, str], list[int]] = {}
    for label, mark in marks.items():
        table = after.get(label)
        if table is None:
            continue
        new[label] = sorted(body["handle"] for obj in table.objects
                            if isinstance(body := obj.get("rule"), Mapping)
                            and isinstance(body.get("handle"), int)
                            and body["handle"] > mark)
    if any(len(handles) != sum(1 for label in made if label == table)
           for table, handles in new.items()):
        return None
    out: list[int | None] = []
    for label in made:
        if label not in marks:
            out.append(None)
        elif label not in new:
            return None
        else:
            out.append(new[label].pop(0))
    return out


Chain = tuple[str, str, str]


@dataclass
class _JointChain:
    """One chain of a table the command sets add rules to without creating it."""

    rules: list[tuple[int, int, str, Mapping[str, Any]]]
    """Their ``add``/``insert rule`` commands into it, in declaration order: (set,
    command number in the set, verb, rule)."""
    present: list[tuple[int, str]]
    layout: list[tuple[str, int]] | None = None
    """Where every rule goes: ``("other", handle)`` or ``("ours", rule number)`` in
    chain order; None when the chain holds them in place already."""
    written: bool = False  # a position cannot be worked out: sent as written
    kept: set[int] = field(default_factory=set)  # the sets whose rules there stay
    handles: dict[int, int] = field(default_factory=dict)  # rule -> handle taken for it
    placed: dict[int, int] = field(default_factory=dict)  # rule -> handle, added back

    def anchor(self, kind: str, x: int) -> int | None:
        """The handle of the layout's ``(kind, x)`` where a set's rules are added back:
        a rule not the sets', one of a set whose rules stay, or one an earlier set
        added back; else None (a later set's rule is deleted and added back after, an
        earlier set's not added back is not where it goes)."""
        if kind == "other":
            return x
        return self.handles.get(x) if self.rules[x][0] in self.kept else self.placed.get(x)


class NftPlan:
    """Where an engine's command sets (``sets``, in declaration order) put their
    ``add``/``insert rule`` rules in the chains of tables none of them creates, as
    those are now (``existing``): planned once for all the sets, as ``nft`` lays the
    chain out applying every set in turn (:func:`_plan_chain`), and sent one set at a
    time (:meth:`planned`, one ``nft`` transaction per set; :meth:`done` after each).
    A chain that holds every set's rules in place gets nothing; else each set
    deletes the rules taken for its own and adds them back at their places, before
    the next rule that is not the sets' or that an earlier set added back."""

    def __init__(self, sets: Sequence[NftCommands],
                 existing: Mapping[tuple[str, str], NftTable | None]) -> None:
        self.sets = list(sets)
        created = {label for s in self.sets for label in s.tables()}
        self._missing = {label for label, table in existing.items()
                         if table is None and label not in created}
        present: dict[Chain, list[tuple[int, str]]] = {}
        for label, table in existing.items():
            if table is None or label in created:
                continue
            for obj in table.objects:
                chain, rule = obj.get("chain"), obj.get("rule")
                if isinstance(chain, Mapping) and isinstance(chain.get("name"), str):
                    present.setdefault((label[0], label[1], chain["name"]), [])
                elif (isinstance(rule, Mapping) and isinstance(rule.get("chain"), str)
                      and isinstance(rule.get("handle"), int)):
                    present.setdefault((label[0], label[1], rule["chain"]), []).append(
                        (rule["handle"], _rule_key(rule)))
        live = set(present)
        rules: dict[Chain, list[tuple[int, int, str, Mapping[str, Any]]]] = {}
        for i, cmds in enumerate(self.sets):
            for n, cmd in enumerate(cmds.commands):
                for verb, body in cmd.items():
                    target = _rule_target(verb, body)
                    if target is not None:
                        if target in live:
                            rules.setdefault(target, []).append((i, n, verb, body["rule"]))
                    elif verb in ("flush", "delete", "destroy", "replace"):
                        _forget(body, live)  # what follows, in any set: as written
        self.chains = {
            chain: _plan_chain(rs, [self.sets[i].rule_key(r) for i, _, _, r in rs],
                               present[chain])
            for chain, rs in rules.items()}

    def absent(self, family: str, name: str) -> bool:
        """Whether the table was found not to exist (and no set creates it)."""
        return (family, name) in self._missing

    def planned(self, i: int) -> list[tuple[dict[str, Any], int | None]]:
        """The commands of set ``i`` to send (:meth:`NftCommands.batch`), each
        ``add``/``insert rule`` command into a table it does not create with the number
        of the command of the set it stands for."""
        cmds_of = self.sets[i]
        own = set(cmds_of.tables())
        placed: dict[int, list[tuple[dict[str, Any], int | None]]] = {}
        dropped: set[int] = set()
        for (family, table, name), c in self.chains.items():
            mine = [j for j, r in enumerate(c.rules) if r[0] == i]
            if not mine or c.written:
                continue
            idxs = [c.rules[j][1] for j in mine]
            dropped.update(idxs)
            if c.layout is None or i in c.kept:
                continue
            ident = {"family": family, "table": table, "chain": name}
            gone = {c.handles[j] for j in mine if j in c.handles}
            out: list[tuple[dict[str, Any], int | None]] = [
                ({"delete": {"rule": {**ident, "handle": h}}}, None)
                for h, _ in c.present if h in gone]
            for pos, (kind, j) in enumerate(c.layout):
                if kind != "ours" or c.rules[j][0] != i:
                    continue
                body = {k: v for k, v in c.rules[j][3].items() if k not in _POSITION_FIELDS}
                anchor = next((h for k, x in c.layout[pos + 1:]
                               if (h := c.anchor(k, x)) is not None), None)
                out.append(({"add": {"rule": body}} if anchor is None
                            else {"insert": {"rule": {**body, "handle": anchor}}},
                            c.rules[j][1]))
            # a chain's commands go where its last one was: what they need is made by then
            placed[idxs[-1]] = out
        cmds: list[tuple[dict[str, Any], int | None]] = []
        for family, name in cmds_of.tables():
            ident = {"family": family, "name": name}
            cmds += [({"add": {"table": dict(ident)}}, None),
                     ({"delete": {"table": dict(ident)}}, None)]
        for n, cmd in enumerate(cmds_of.commands):
            if n in placed:
                cmds += placed[n]
            elif n not in dropped:
                target = next((t for v, b in cmd.items()
                               if (t := _rule_target(v, b)) is not None), None)
                cmds.append((dict(cmd), n if target is not None and target[:2] not in own
                             else None))
        return cmds

    def done(self, i: int, sent: Sequence[tuple[dict[str, Any], int | None]],
             handles: Sequence[int | None] | None) -> None:
        """After set ``i``'s commands (``sent``, from :meth:`planned`) were applied:
        ``handles`` of the rules they made (:func:`made_handles`), or None when they were
        not applied or what nft made is unknown (then the later sets do not add their
        rules relative to set ``i``'s)."""
        made = [n for cmd, n in sent for verb, body in cmd.items()
                if _rule_target(verb, body) is not None]
        rule_of: dict[int, tuple[_JointChain, int]] = {}
        for chain in self.chains.values():
            for j, (si, n, _, _) in enumerate(chain.rules):
                if si == i and chain.layout is not None and not chain.written:
                    rule_of[n] = (chain, j)
        if handles is None or len(handles) != len(made):
            return
        for number, handle in zip(made, handles, strict=True):
            if number is not None and handle is not None and number in rule_of:
                chain, j = rule_of[number]
                chain.placed[j] = handle


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


def _plan_chain(rules: Sequence[tuple[int, int, str, Mapping[str, Any]]],
                keys: Sequence[str], present: Sequence[tuple[int, str]]) -> _JointChain:
    """Plan the command sets' ``add``/``insert rule`` commands (``rules``, as (set,
    command number, verb, rule), in declaration order, with their ``keys``) into one
    chain that holds ``present`` ((handle, rule key) in chain order) now: in place
    when it holds their rules already where they put them; else where each goes; or
    sent as written when a position cannot be worked out (an index past the end, a
    handle not there).

    Where they go is worked out on the chain without the rules taken for theirs, as
    ``nft`` would on first applying the sets there in order: ``insert`` at the head,
    ``add`` at the end, ``index``/``handle`` relative to the rules there (an earlier
    set's among them, a later set's not yet). Other owners' rules after the last rule
    taken for theirs were appended since, and stay after them (a resume does not move
    the sets' rules behind them) -- but only while the rule put last is there: when
    it went missing, the rules after the survivors may be rules it went in before,
    and the sets are laid out on the whole chain as it is (so a rule appended since
    may end up before a rule put back at the end). The rules taken for theirs are,
    command by command in declaration order across the sets, the first unclaimed
    rule with its expression and comment (for a plain ``add``: the last one),
    whoever added it: identical rules cannot be told apart."""
    verbs = [(verb, rule) for _, _, verb, rule in rules]
    claimed: dict[int, int] = {}  # handle -> the rule it stands for
    for n, (verb, rule) in enumerate(verbs):
        handle = _claim(verb, rule, keys[n], present, claimed)
        if handle is not None:
            claimed[handle] = n
    chain = _JointChain(list(rules), list(present),
                        handles={n: h for h, n in claimed.items()})
    missing = Counter(keys) - Counter(keys[n] for n in claimed.values())
    # ("other", handle) or ("ours", rule number), in chain order
    end = max((i for i, (h, _) in enumerate(present) if h in claimed), default=-1)
    others = [("other", h) for h, _ in present if h not in claimed]
    trailing = [("other", h) for h, _ in present[end + 1:]] if claimed else []
    layout = _laid_out(verbs, others[:len(others) - len(trailing)]) if trailing else None
    last = next((x for kind, x in reversed(layout or []) if kind == "ours"), None)
    if layout is not None and last is not None and not missing[keys[last]]:
        layout += trailing
    else:
        layout = _laid_out(verbs, others)
        if layout is None:
            chain.written = True
            return chain
    key_of = dict(present)
    # a missing rule is in the layout, not in the chain: never in place
    if [key_of[x] if kind == "other" else keys[x] for kind, x in layout
            ] != [k for _, k in present]:
        chain.layout = layout
        # a set whose rules are all there, in place beside the rules not the sets'
        # and those of the sets kept so far, keeps them (and their counters): rule by
        # rule, not by key (a missing one is in the layout only), as the rules added
        # back go before a kept one by its handle, which must be where the layout has it
        for k in dict.fromkeys(i for i, _, _, _ in rules):
            trial = chain.kept | {k}
            if [("other", h) if h not in claimed else ("ours", claimed[h])
                    for h, _ in present
                    if h not in claimed or rules[claimed[h]][0] in trial
                    ] == [(kind, x) for kind, x in layout
                          if kind == "other" or rules[x][0] in trial]:
                chain.kept = trial
    return chain


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
