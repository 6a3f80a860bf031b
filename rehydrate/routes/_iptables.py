"""iptables rules: quoting, existence checks, re-application."""

from __future__ import annotations

import logging
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
    for table, chains, rule_list in parsed:
        existing = _chain_policies(tools, table)
        out_lines.append(f"*{table}")
        # With --noflush, a chain line for a user chain that exists flushes it, so those
        # are left out; for a built-in chain (its policy is not "-") it only sets the
        # policy, which is kept: ":INPUT DROP" is part of the rules.
        out_lines.extend(c for c in chains if c.split()[0][1:] not in existing
                         or (existing[c.split()[0][1:]] != "-" and _policy(c) != "-"))
        out_lines.extend(iptables_join(argv) for argv in rule_list
                         if not (argv[1] in existing and _rule_exists(tools, table, argv)))
        out_lines.append("COMMIT")
    proc = _run([tools.restore, "--noflush", "-w"], "\n".join(out_lines) + "\n")
    err = " ".join(proc.stderr.split()) if proc.returncode != 0 else None
    if err is not None and ("Permission denied" in err or "not permitted" in err):
        raise NetworkUnavailable(f"{tool}-restore: {err} (needs CAP_NET_ADMIN)")
    in_force: dict[str, tuple[int, int]] = {}
    missing: list[str] = []
    for table, chains, rule_list in parsed:
        now = _chain_policies(tools, table)
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
