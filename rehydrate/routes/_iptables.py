"""iptables rules: quoting, existence checks, re-application."""

from __future__ import annotations

import itertools
import logging
import secrets
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from ._model import NFT_TIMEOUT, NetworkUnavailable, tool_path

log = logging.getLogger("rehydrate")


@dataclass(frozen=True)
class IptablesRules:
    text: str
    ipv6: bool = False
    required: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        # bytes split into bytes lines, and failed deep in the parser with a message
        # about startswith()
        if not isinstance(self.text, str):
            hint = " (decode it: rules.decode())" if isinstance(self.text, bytes) else ""
            raise TypeError("iptables rules are iptables-restore text (a str), not "
                            f"{type(self.text).__name__}{hint}")

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


def iptables_tools(tool: str) -> dict[str, str | None]:
    """``{name: path}`` of the three binaries applying ``tool``'s (``iptables`` or
    ``ip6tables``) rules needs, None for one not found. They are run by these paths:
    found in /usr/sbin when PATH lacks it, as the check that they exist finds them."""
    return {name: tool_path(name) for name in (tool, f"{tool}-save", f"{tool}-restore")}


def missing_iptables_tools(tool: str) -> list[str]:
    return [f"the {name} binary" for name, path in iptables_tools(tool).items()
            if path is None]


@dataclass(frozen=True)
class _Tools:
    """The paths of ``iptables``, ``iptables-save`` and ``iptables-restore`` (or ip6)."""

    name: str
    check: str
    save: str
    restore: str

    @classmethod
    def resolve(cls, tool: str) -> _Tools:
        paths = iptables_tools(tool)
        missing = [name for name, path in paths.items() if path is None]
        if missing:
            raise NetworkUnavailable(
                f"missing {', '.join(f'the {name} binary' for name in missing)}")
        check, save, restore = paths.values()
        assert check is not None and save is not None and restore is not None
        return cls(tool, check, save, restore)


def _rule_exists(tools: _Tools, table: str, argv: list[str]) -> bool:
    spec = ["-C", *argv[1:]]
    if argv[0] == "-I":  # -I CHAIN [pos] rule...: drop a numeric position
        spec = ["-C", argv[1], *(argv[3:] if len(argv) > 2 and argv[2].isdigit()
                                 else argv[2:])]
    return _run([tools.check, "-w", "-t", table, *spec]).returncode == 0


def _policy(chain_line: str) -> str:
    """The policy of a ``:CHAIN POLICY [p:b]`` line (``-`` for a user chain)."""
    parts = chain_line.split()
    return parts[1] if len(parts) > 1 else "-"


def _chain_policies(tools: _Tools, table: str) -> dict[str, str]:
    """``{chain: policy}`` of ``table`` as it is now (``-`` for user chains)."""
    saved = _run([tools.save, "-t", table])
    if saved.returncode != 0:
        return {}
    return {line.split()[0][1:]: _policy(line) for line in saved.stdout.splitlines()
            if line.startswith(":")}


def _apply_iptables(rules: IptablesRules) -> tuple[dict[str, tuple[int, int]], str | None]:
    """Apply ``rules``; return what is in force afterwards, read back rule by rule —
    ``{table: (rules in force, rules declared)}`` — and the problem (None when every
    rule is in force).

    ``iptables-restore`` commits table by table: when ``nat`` fails, ``filter`` may
    already be in force, so the outcome is read back, never inferred from the exit code.
    """
    tool = rules.tool
    tools = _Tools.resolve(tool)
    parsed = rules.parsed()
    out_lines: list[str] = []
    placements: list[_Placement] = []
    for n, (table, chains, rule_list) in enumerate(parsed):
        existing = _chain_policies(tools, table)
        out_lines.append(f"*{table}")
        # With --noflush, a chain line for a user chain that exists flushes it, so those
        # are left out; for a built-in chain (its policy is not "-") it only sets the
        # policy, which is kept: ":INPUT DROP" is part of the rules.
        out_lines.extend(c for c in chains if c.split()[0][1:] not in existing
                         or (existing[c.split()[0][1:]] != "-" and _policy(c) != "-"))
        present = [argv[1] in existing and _rule_exists(tools, table, argv)
                   for argv in rule_list]
        # a table given twice: the second part's positions would be counted before the
        # first part's rules go in, so its missing rules are appended
        placed = (_Placement(tools, table) if any(t == table for t, _, _ in parsed[:n])
                  else _Placement.plan(tools, table, rule_list, present,
                                       [c.split()[0][1:] for c in chains
                                        if c.split()[0][1:] not in existing]))
        placements.append(placed)
        for i, argv in enumerate(rule_list):
            if present[i]:
                continue
            at = placed.insert_at.get(i)
            out_lines.append(iptables_join(argv if at is None else
                                           ["-I", argv[1], str(at), *argv[2:]]))
        out_lines.append("COMMIT")
    proc = _run([tools.restore, "--noflush", "-w"], "\n".join(out_lines) + "\n")
    err = " ".join(proc.stderr.split()) if proc.returncode != 0 else None
    if err is not None and ("Permission denied" in err or "not permitted" in err):
        raise NetworkUnavailable(f"{tool}-restore: {err} (needs CAP_NET_ADMIN)")
    in_force: dict[str, tuple[int, int]] = {}
    missing: list[str] = []
    for (table, chains, rule_list), placed in zip(parsed, placements, strict=True):
        now = _chain_policies(tools, table)
        missing.extend(f"-t {table} {chain}: the declared rules are not in their declared "
                       "order" for chain in placed.out_of_order())
        for line in chains:
            chain, policy = line.split()[0][1:], _policy(line)
            if policy != "-" and now.get(chain, policy) != policy:
                missing.append(f"-t {table} -P {chain} {policy} (the policy is "
                               f"{now[chain]})")
        have = 0
        for argv in rule_list:
            if _rule_exists(tools, table, argv):
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


@dataclass
class _Placement:
    """Where the missing ``-A`` rules of a table go so that the declared rules of each
    chain stay in their declared order: appended, a rule declared before one that is
    there would come after it (``ACCEPT`` re-appended behind a ``DROP``). Each goes in
    (``-I CHAIN N``) just before the first declared rule after it that is there; rules
    that are there are not moved, nor anything else in the chain.

    Positions come from comparing rules as ``iptables-save`` prints them: the declared
    rules are added to a scratch chain of the table (no rule jumps to it, so no packet
    meets them) and read back in that canonical form. Only done for a chain where a
    rule is missing before one that is there."""

    tools: _Tools
    table: str
    insert_at: dict[int, int] = field(default_factory=dict)
    """index in the declared rules -> position (1-based) to insert that rule at"""
    chains: dict[str, list[str]] = field(default_factory=dict)
    """chain -> its declared rules in canonical form, for the order check afterwards"""

    @classmethod
    def plan(cls, tools: _Tools, table: str, rule_list: list[list[str]],
             present: list[bool], new_chains: Sequence[str] = ()) -> _Placement:
        """``new_chains``: the user chains the rules declare that do not exist yet (the
        same transaction creates them), which a rule may jump to."""
        placed = cls(tools, table)
        by_chain: dict[str, list[int]] = {}
        for i, argv in enumerate(rule_list):
            by_chain.setdefault(argv[1], []).append(i)
        todo = {chain: idx for chain, idx in by_chain.items()
                # a declared -I has a place of its own: its chain is left as before
                if all(rule_list[i][0] == "-A" for i in idx)
                and any(not present[i] and any(present[j] for j in idx if j > i)
                        for i in idx)}
        if not todo:
            return placed
        canon = _canonical(tools, table, [rule_list[i] for idx in todo.values() for i in idx],
                           new_chains)
        if canon is None:
            # said once here: the missing rules are appended, their order unchecked
            log.warning("%s -t %s: the declared order of chain(s) %s was not checked "
                        "(the rules could not be read back in canonical form); missing "
                        "rules are appended", tools.name, table, ", ".join(sorted(todo)))
            return placed
        by_index = dict(zip([i for idx in todo.values() for i in idx], canon, strict=True))
        current = _chain_rules(tools, table)
        for chain, idx in todo.items():
            lines: list[str | None] = list(current.get(chain, []))
            pos = 0  # just past the last declared rule placed so far
            for k, i in enumerate(idx):
                if present[i]:
                    if by_index[i] in lines[pos:]:
                        pos = lines.index(by_index[i], pos) + 1
                    continue
                nxt = next((j for j in idx[k + 1:] if present[j]), None)
                if nxt is None or by_index[nxt] not in lines[pos:]:
                    lines.append(None)  # appended, as before
                    continue
                at = lines.index(by_index[nxt], pos)
                lines.insert(at, None)
                placed.insert_at[i] = at + 1
                pos = at + 1
            placed.chains[chain] = [by_index[i] for i in idx]
        return placed

    def out_of_order(self) -> list[str]:
        """The chains planned here whose declared rules are not, read back now, in
        their declared order."""
        if not self.chains:
            return []
        current = _chain_rules(self.tools, self.table)
        wrong = []
        for chain, declared in self.chains.items():
            there = current.get(chain, [])
            lines = iter(there)
            # a rule that is missing is reported as such, not as out of order
            if not all(any(line == rule for line in lines)
                       for rule in declared if rule in there):
                wrong.append(chain)
        return wrong


def _chain_rules(tools: _Tools, table: str) -> dict[str, list[str]]:
    """``{chain: [rule, …]}`` of ``table`` now, each rule as ``iptables-save`` prints it
    without its ``-A CHAIN``."""
    saved = _run([tools.save, "-t", table])
    out: dict[str, list[str]] = {}
    for line in saved.stdout.splitlines() if saved.returncode == 0 else ():
        if line.startswith("-A "):
            parts = line.split(None, 2)
            out.setdefault(parts[1], []).append(parts[2] if len(parts) > 2 else "")
    return out


_JUMPS = frozenset({"-j", "--jump", "-g", "--goto"})


def _canonical(tools: _Tools, table: str, rule_list: list[list[str]],
               new_chains: Sequence[str] = ()) -> list[str] | None:
    """``rule_list`` as ``iptables-save`` prints those rules (without ``-A CHAIN``), by
    way of a scratch chain of ``table`` made and removed here; None where that fails.
    A jump to one of ``new_chains`` (declared, not there yet) goes to a scratch stand-in
    for it, named back in what is read: the real one is not created before the rules
    are, and without it the scratch transaction failed ("Chain ... does not exist")."""
    # not the pid: processes of containers sharing a network namespace may share it
    scratch = f"RHORDER-{secrets.token_hex(4)}"
    targets = {t for argv in rule_list
               for flag, t in itertools.pairwise(argv) if flag in _JUMPS}
    stand_in = {name: f"{scratch}-{k}"
                for k, name in enumerate(c for c in dict.fromkeys(new_chains) if c in targets)}
    back = {v: k for k, v in stand_in.items()}

    def aimed(argv: list[str]) -> list[str]:
        return [stand_in.get(a, a) if i and argv[i - 1] in _JUMPS else a
                for i, a in enumerate(argv)]

    text = "".join([f"*{table}\n:{scratch} - [0:0]\n",
                    *(f":{s} - [0:0]\n" for s in stand_in.values()),
                    *(iptables_join(["-A", scratch, *aimed(argv)[2:]]) + "\n"
                      for argv in rule_list),
                    "COMMIT\n"])
    try:
        if _run([tools.restore, "--noflush", "-w"], text).returncode != 0:
            return None
        got = [" ".join(back.get(word, word) for word in line.split(" "))
               for line in _chain_rules(tools, table).get(scratch, [])]
    finally:
        _run([tools.check, "-w", "-t", table, "-F", scratch])
        for chain in (scratch, *stand_in.values()):
            _run([tools.check, "-w", "-t", table, "-X", chain])
    return got if len(got) == len(rule_list) else None
