"""Configuration by environment: every ``REHYDRATE_*`` variable, declared once, parsed one way.

:data:`VARIABLES` is the table — name, type, default, one-line meaning — that
``docs/configuration.md`` and ``rehydrate doctor`` show. Code reads a variable only through
the typed getters here (:func:`text`, :func:`number`, :func:`flag`, :func:`choice`,
:func:`items`); reading an undeclared name raises ``KeyError`` and ``tests/test_config.py``
fails on any ``REHYDRATE_*`` name in the code that the table does not declare.

A bad value never stops the process: one warning line names the variable and the value
(these are settings, not secrets; the value is shortened) and the default is used.
Variables are read when the component that uses them starts, not at import.

Adding a variable is one line in :data:`VARIABLES` (plus its row in docs/configuration.md).
"""

from __future__ import annotations

import os

# Only ``os`` at import: ``rehydrate notify`` reads its socket path here inside a sandbox at
# every checkpoint and restore, where dataclasses, typing, logging and math cost ~40 ms to
# import (measured under runsc). They load when a warning or a number needs them.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any, Literal

    Type = Literal["text", "path", "number", "seconds", "flag", "choice", "list", "signal"]
    """``text``/``path``: the string (empty = unset); ``signal``: a signal name or number
    that can be caught, as its name (``SIGUSR2``); ``number``/``seconds``: a finite float
    ``>= minimum`` (``off``/``none`` mean "off" where ``off_ok``); ``flag``:
    1/true/yes/on/enabled or 0/false/no/off/disabled; ``choice``: one of ``choices``
    (case-insensitive);
    ``list``: comma-separated, blanks dropped (with ``choices``: entries not among them
    are ignored, each with one warning)."""

__all__ = ["SIGNAL_RULE", "VARIABLES", "Variable", "choice", "default", "effective", "entries_kept",
           "flag", "items", "number", "one_line", "optional_number", "optional_seconds",
           "refused_signal", "seconds", "shown", "signal_from_text", "signal_label", "signal_name",
           "signal_number", "text"]


MAX_SECONDS = 31_536_000.0
"""A year: the most any ``seconds`` setting (or timeout) may be. A longer wait is a mistake,
and from about 2**33 s the platform's clocks and thread waits overflow."""


def _real(value: object) -> float | int | None:
    """``value`` as an ``int`` or ``float`` when it is a real number other than a bool —
    also a NumPy scalar or a ``Fraction`` (``numbers.Real``): refused, ``wait_ready(
    np.int64(5))`` said "must be a number of seconds …, not int64". None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    import numbers

    if isinstance(value, numbers.Integral):
        return int(value)
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # Fraction(10**5000): past any limit, its sign kept
        return float("-inf") if value < 0 else float("inf")


def seconds(value: object, what: str, *, zero_ok: bool = False) -> float:
    """``value`` as a float when it is a number of seconds: a real number (not a bool;
    a NumPy scalar too), > 0 (``zero_ok``: >= 0) and at most :data:`MAX_SECONDS`;
    otherwise ``TypeError`` (not a number) or ``ValueError`` (NaN, infinity, out of
    range) naming ``what``.

    The one rule for arguments in seconds (detector settings, timeouts, deadlines), checked
    where the value enters — a constructor, a command line, a control request — and not
    later in a thread, which an exception there would end.
    """
    rule = (f"{what} must be a number of seconds {'>= 0' if zero_ok else '> 0'} and at most "
            f"{MAX_SECONDS:.0f} (a year)")
    number = _real(value)
    if number is None:
        raise TypeError(f"{rule}, not {type(value).__name__}")
    if not ((number >= 0 if zero_ok else number > 0) and number <= MAX_SECONDS):
        raise ValueError(f"{rule}, not {shown(value)}")
    return float(number)


def optional_seconds(value: object, what: str, *, zero_ok: bool = True) -> float | None:
    """A public ``timeout=`` argument (``wait_ready``, ``EphemeralKey.wait``,
    ``tcp_socket``, ``request``): ``None``, infinity or more than a year (a huge int too)
    mean no limit (``None``); 0 is "do not wait" (unless ``zero_ok`` is False); a
    negative, NaN or non-number is a one-line ``ValueError``/``TypeError`` naming the
    argument (a NumPy scalar or a ``Fraction`` is a number: :func:`_real`). Before,
    ``10**5000`` reached ``math.isnan`` or the thread wait as a bare ``OverflowError``,
    and a negative timeout returned at once as if it were 0.

    Not :func:`seconds`' rule: infinity and more than a year meant no limit before that
    rule came, and were kept so when it briefly refused them. The error says so, not
    "at most a year" (which it said while accepting ``10**30``)."""
    if value is None:
        return None
    rule = f"{what} must be a number of seconds {'>= 0' if zero_ok else '> 0'}"
    no_limit = "(None, infinity or more than a year: no limit)"
    number = _real(value)
    if number is None:
        raise TypeError(f"{rule}, not {type(value).__name__} {no_limit}")
    # int against float compares exactly: no OverflowError for 10**5000
    if number > MAX_SECONDS:
        return None
    if not (number >= 0 if zero_ok else number > 0):  # NaN is neither
        raise ValueError(f"{rule}, not {shown(value)} {no_limit}")
    return float(number)


def shown(value: object) -> str:
    """``value`` for a one-line error message: its ``repr``, but an integer too long to
    read as ``1e+400`` (its repr would be hundreds of digits, and from 4300 digits Python
    refuses to make one: the error became "Exceeds the limit … for integer string
    conversion", naming neither the argument nor the rule), and any other repr cut to
    60 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**16:
        import math

        exponent = int(math.log10(abs(value)))  # exact enough: ints convert to log10 fine
        mantissa = value / 10**exponent  # true division of ints: a float, no overflow
        if abs(mantissa) >= 10:  # log10 rounded up across a power of ten
            exponent, mantissa = exponent + 1, mantissa / 10
        return f"{mantissa:.3g}e+{exponent}"
    try:
        text = repr(value)
    except Exception:  # a message about a bad value must not fail itself
        # a huge int inside a tuple/list/dict (an address, a key list) fails the same
        # way, and so may a caller's own __repr__: show the container, ints shortened
        text = _repr_short_ints(value)
    return text if len(text) <= 60 else text[:57] + "..."


NAMES_SHOWN = 20
"""At most this many names of a list in a log line, a status or a warning."""


def shown_names(names: Iterable[str], limit: int = NAMES_SHOWN) -> list[str]:
    """``names`` for a log line or a status: at most ``limit`` of them, each cut to 60
    characters as :func:`shown` cuts a repr, and then one entry ``"... (+N more)"`` for
    the rest. A restored environment may bring 20,000 keys or a key of megabytes: listed
    whole, one log line and every ``status --json`` grew to megabytes."""
    out: list[str] = []
    more = 0
    for name in names:
        if len(out) < limit:
            out.append(name if len(name) <= 60 else name[:57] + "...")
        else:
            more += 1
    if more:
        out.append(f"... (+{more} more)")
    return out


def one_line(text: str) -> str:
    """``text`` with every character that is not printable shown as an escape (``\\n``,
    ``\\x1b``): what a reply or an error carries is printed or logged as one line, and
    cannot forge further lines or send terminal control sequences."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _repr_short_ints(value: object) -> str:
    """``repr(value)`` through :mod:`reprlib` (which shortens containers and survives a
    failing ``__repr__``), its integers spelled as :func:`shown` spells them: ``reprlib``
    itself calls ``repr()`` on them, which fails past 4300 digits."""
    import reprlib

    class ShortInts(reprlib.Repr):
        def repr_int(self, x: int, level: int) -> str:
            return shown(x)

    return ShortInts().repr(value)


class Variable:
    """One ``REHYDRATE_*`` setting (read-only by convention).

    ``minimum``: numbers: the smallest accepted value; ``positive`` additionally excludes
    it. ``off_ok``: numbers: ``off`` or ``none`` mean "off" (``None``); ``0`` is not
    "off" but a number like any other (a bad one where ``positive``: before, ``0`` was
    "off" while ``0.0`` was a bad value). ``choices``: ``choice``: the accepted values;
    ``list``: the accepted entries (case-insensitive). ``key_patterns``: ``list``: glob
    patterns of environment keys; an entry that cannot be meant (white space, ``;`` or
    quotes in it, all ``*``, lower case matching no key but one in another case, unless
    it matches a conventionally lower-case key: :data:`LOWER_CASE_KEYS`) is kept
    and warned about, once each (:func:`_pattern_problem`).
    """

    __slots__ = ("choices", "default", "key_patterns", "meaning", "minimum", "name", "off_ok",
                 "positive", "type")

    def __init__(self, name: str, type: Type, default: Any, meaning: str, *,
                 choices: tuple[str, ...] = (), minimum: float = 0.0, positive: bool = False,
                 off_ok: bool = False, key_patterns: bool = False) -> None:
        self.name = name
        self.key_patterns = key_patterns
        self.type = type
        self.default = default
        self.meaning = meaning
        self.choices = choices
        self.minimum = minimum
        self.positive = positive
        self.off_ok = off_ok

    def __repr__(self) -> str:
        return f"Variable({self.name!r}, {self.type!r}, default={self.default!r})"


_V = Variable
VARIABLES: tuple[Variable, ...] = (
    # engine
    _V("REHYDRATE_ENV_POLICY", "choice", "update", "how the new environment file is applied: update, replace or off", choices=("update", "replace", "off")),  # noqa: E501
    _V("REHYDRATE_ENV_FILE", "path", None, "the environment file read after restore (default: $REHYDRATE_GVISOR_PROC/spec_environ)"),  # noqa: E501
    _V("REHYDRATE_ENV_PROTECT", "list", (), "glob patterns of environment keys the refresh never overwrites or removes (comma-separated; the default engine's EnvRefresher(protect=...)), e.g. PATH,OMP_NUM_THREADS", key_patterns=True),  # noqa: E501
    _V("REHYDRATE_SNAPSHOT_DEADLINE", "seconds", 300.0, "the last resort: run the resume hooks when no restore or resume came this long after the before-snapshot hooks (a freeze meanwhile starts it again, a stall postpones it by its length — by at most one more deadline in all unless the freeze watch confirmed the freeze — and then the restore hooks run; off: wait for ever)", positive=True, off_ok=True),  # noqa: E501
    _V("REHYDRATE_DISABLE", "list", (), "built-in identity managers to turn off: entropy, keys, tls, secrets (the whole SECRETS phase), all (these four)", choices=("entropy", "keys", "tls", "secrets", "all")),  # noqa: E501
    # detectors
    _V("REHYDRATE_GVISOR_PROC", "path", "/proc/gvisor", "gVisor's checkpoint/spec_environ directory (tests point it at a stand-in)"),  # noqa: E501
    _V("REHYDRATE_CONTROL_SOCKET", "path", None, "the control socket path; setting it starts the control detector with start('auto'), which fails loudly for a directory or path another user controls"),  # noqa: E501
    _V("REHYDRATE_CLOCK_INTERVAL", "seconds", 0.5, "clock-jump detector: seconds between checks", minimum=0.001),  # noqa: E501
    _V("REHYDRATE_CLOCK_THRESHOLD", "seconds", 2.0, "clock-jump detector: a monotonic step beyond the expected sleep by more than this is a restore", minimum=0.001),  # noqa: E501
    _V("REHYDRATE_CLOCK_PENDING_THRESHOLD", "seconds", 0.1, "clock-jump detector: while a snapshot is pending, it wakes every fifth of this, and a freeze longer than this is the checkpoint (ends it with the restore hooks); at most REHYDRATE_CLOCK_THRESHOLD", minimum=0.001),  # noqa: E501
    _V("REHYDRATE_CLOCK_GRACE", "seconds", 0.0, "clock-jump detector: how long it lets a more specific detector report first (0: the first notice runs the hooks at once)"),  # noqa: E501
    _V("REHYDRATE_CLOCK_BUSY_CHECK", "flag", None, "clock-jump detector: tell a busy or GIL-stalled process from a frozen one (default: on)"),  # noqa: E501
    _V("REHYDRATE_IDENTITY_INTERVAL", "seconds", 2.0, "identity detector: seconds between checks", minimum=0.001),  # noqa: E501
    _V("REHYDRATE_VMCLOCK_PATH", "path", "/dev/vmclock0", "vmclock detector: the VMClock device"),
    _V("REHYDRATE_VMCLOCK_INTERVAL", "seconds", 0.5, "vmclock detector: seconds between reads when the device cannot notify", minimum=0.001),  # noqa: E501
    _V("REHYDRATE_MARKER_FILE", "path", None, "file detector: the file the platform writes on restore (in a directory others may write in — group- or world-writable, or sticky — a marker of another uid than this process's, root or REHYDRATE_MARKER_OWNERS is ignored)"),  # noqa: E501
    _V("REHYDRATE_MARKER_OWNERS", "list", (), "file detector: more uids trusted to own the marker in a directory others may write in (comma-separated; the platform's uid as seen here, e.g. 65534 under a user namespace)"),  # noqa: E501
    _V("REHYDRATE_MARKER_KIND", "choice", "restore", "file detector: what a marker means, restore or resume", choices=("restore", "resume")),  # noqa: E501
    _V("REHYDRATE_MARKER_WINDOW", "seconds", 2.0, "file detector: a restore handled this recently is the same restore"),  # noqa: E501
    _V("REHYDRATE_WATCH_POLLING", "flag", None, "file detector: poll instead of inotify (default: poll under gVisor)"),  # noqa: E501
    _V("REHYDRATE_WATCH_INTERVAL", "seconds", 0.5, "file detector: seconds between polls", minimum=0.001),  # noqa: E501
    _V("REHYDRATE_SIGNAL", "signal", "SIGUSR2", "signal detector: the signal (name, number or SIGRTMIN+n) that means restore; not KILL, STOP, CHLD, PIPE, WINCH, TTIN, TTOU, TSTP, URG or a fault signal (SEGV, BUS, FPE, ILL)"),  # noqa: E501
    _V("REHYDRATE_SIGNAL_WINDOW", "seconds", 2.0, "signal detector and a notice without notify save: a restore detected this recently may be the same restore"),  # noqa: E501
    _V("REHYDRATE_SIGNAL_KIND", "choice", "restore", "signal detector: what the signal means, restore or resume", choices=("restore", "resume")),  # noqa: E501
    _V("REHYDRATE_SNAPSTART_DEADLINE", "seconds", 8.0, "snapstart: seconds the whole after-restore run may take (Lambda allows 10); hooks still running then are reported timeout and the runtime hook fails", positive=True),  # noqa: E501
    # managers
    _V("REHYDRATE_CONNECT_DEADLINE", "seconds", 30.0, "connections: default seconds for a managed connection to reopen after restore", positive=True),  # noqa: E501
    _V("REHYDRATE_NFT", "path", None, "routes: the nft binary (default: nft on PATH)"),
    _V("REHYDRATE_WATCH", "choice", "auto", "tls: how certificate files are watched: auto, poll or inotify", choices=("auto", "poll", "polling", "inotify", "native")),  # noqa: E501
    _V("REHYDRATE_HELD_MOUNTS", "list", (), "files: extra mount points the snapshot holds (comma-separated)"),  # noqa: E501
    _V("REHYDRATE_TELEMETRY", "flag", True, "telemetry: 0/off turns spans and metrics off"),
    _V("REHYDRATE_MANIFEST", "path", None, "fingerprint: where the snapshot manifest is written and read"),  # noqa: E501
    _V("REHYDRATE_EXPECT_RESTORE", "flag", False, "fingerprint: this process should have been restored (a cold start is a snapshot miss)"),  # noqa: E501
    _V("REHYDRATE_FINGERPRINT_ENV", "list", (), "fingerprint (only with REHYDRATE_MANIFEST or REHYDRATE_EXPECT_RESTORE): environment keys whose change makes a snapshot incompatible"),  # noqa: E501
    _V("REHYDRATE_FINGERPRINT_STRICT", "flag", False, "fingerprint (only with REHYDRATE_MANIFEST or REHYDRATE_EXPECT_RESTORE): a node mismatch after restore fails readiness"),  # noqa: E501
    _V("REHYDRATE_GVISOR_VERSION", "text", None, "fingerprint: the node's gVisor version (gVisor does not show it inside the sandbox)"),  # noqa: E501
    _V("REHYDRATE_MACHINE_TYPE", "text", None, "fingerprint and platform fit: the node's GCE machine type (e.g. n2-standard-8), used instead of asking the metadata server (GKE's metadata server, which Pod snapshots need, does not serve it)"),  # noqa: E501
)

_BY_NAME = {v.name: v for v in VARIABLES}
_TRUE = ("1", "true", "yes", "on", "enabled")
_FALSE = ("0", "false", "no", "off", "disabled")
_FLAG_RULE = f"{', '.join(_TRUE)} or {', '.join(_FALSE)}"
"""What a bad ``flag`` value's warning says is accepted: every spelling, not "1 or 0"
(``disabled`` was accepted but ``enabled`` a bad value, the warning naming neither)."""


def _declared(name: str, *types: Type) -> Variable:
    try:
        var = _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared configuration variable "
                       "(add it to rehydrate/_config.py VARIABLES)") from None
    if types and var.type not in types:
        raise TypeError(f"{name} is declared as {var.type}, not {' or '.join(types)}")
    return var


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _raw(var: Variable) -> str | None:
    raw = os.environ.get(var.name)
    return None if raw is None or not raw.strip() else raw


def _parse(var: Variable, raw: str) -> tuple[Any, str | None]:  # noqa: PLR0911 - one per type
    """``(value, None)``, or ``(default, what was expected)`` for a bad value."""
    value = raw.strip()
    if var.type in ("text", "path"):
        return value, None
    if var.type == "signal":
        try:
            signum = signal_from_text(value)
        except ValueError:
            signum = None
        if signum is None or refused_signal(signum) is not None:
            return var.default, SIGNAL_RULE
        return signal_label(signum), None
    if var.type == "list":
        entries = tuple(part.strip() for part in value.split(",") if part.strip())
        if var.key_patterns:
            problems = [p for p in map(_pattern_problem, entries) if p is not None]
            return entries, "; ".join(problems) or None
        if not var.choices:
            return entries, None
        unknown = _unknown_entries(var, entries)
        kept = tuple(e for e in entries if e not in unknown)
        if not unknown:
            return kept, None
        listed = ", ".join(_short(e) for e in unknown)
        return kept, (f"{listed} {'is' if len(unknown) == 1 else 'are'} not one of "
                      + ", ".join(var.choices))
    low = value.lower()
    if var.type == "flag":
        if low in _TRUE:
            return True, None
        if low in _FALSE:
            return False, None
        return var.default, _FLAG_RULE
    if var.type == "choice":
        if low in var.choices:
            return low, None
        return var.default, "one of " + ", ".join(var.choices)
    if var.off_ok and low in ("off", "none"):
        return None, None
    import math

    try:
        number = float(low)
    except ValueError:
        number = math.nan
    at_most = MAX_SECONDS if var.type == "seconds" else math.inf
    if math.isfinite(number) and (number > var.minimum if var.positive
                                  else number >= var.minimum) and number <= at_most:
        return number, None
    rule = f"> {var.minimum:g}" if var.positive else f">= {var.minimum:g}"
    if var.type == "seconds":
        rule += f" and <= {MAX_SECONDS:.0f} (a year)"
    return var.default, f"a finite number {rule}" + (" (or off)" if var.off_ok else "")


def _unknown_entries(var: Variable, entries: tuple[str, ...]) -> list[str]:
    """The entries of a ``list`` variable with ``choices`` that are not among them."""
    return [e for e in entries if e.lower() not in var.choices]


LOWER_CASE_KEYS = ("http_proxy", "https_proxy", "ftp_proxy", "no_proxy", "all_proxy")
"""Keys conventionally lower case (curl, wget, requests read them so): a protect
pattern that matches one is no case mistake, even beside its upper-case twin."""


def _pattern_problem(pattern: str) -> str | None:
    """What is wrong with an entry of a ``key_patterns`` list, or None. The same text is
    the warning (after the variable's name) and ``rehydrate doctor``'s problem: before,
    ``PATH OMP_*`` or ``PATH;OMP_*`` protected nothing, ``*`` everything, silently."""
    if any(c.isspace() or c in ";\"'" for c in pattern):
        return (f"{_short(pattern)} has white space, ';' or quotes in it, which no key "
                "has: patterns are comma-separated (PATH,OMP_*), without quotes")
    if not pattern.strip("*"):
        return (f"{_short(pattern)} matches every key: the refresh changes no key from the "
                "environment file")
    if pattern != pattern.upper():
        import fnmatch

        keys = list(os.environ)
        # A lower-case key by convention (http_proxy beside HTTP_PROXY) is meant as it is,
        # whether the process has it now or only the environment file does.
        if not any(fnmatch.fnmatchcase(k, pattern) for k in (*keys, *LOWER_CASE_KEYS)):
            folded = pattern.lower()
            other = next((k for k in keys if fnmatch.fnmatchcase(k.lower(), folded)), None)
            if other is not None:
                return (f"{_short(pattern)} matches no key, but {_short(other)} differs "
                        "only in case: keys are case-sensitive")
    return None


def entries_kept(name: str) -> bool:
    """Whether a bad entry of ``name`` still applies (``key_patterns``: it is kept and
    warned about) rather than being ignored: how ``rehydrate doctor`` words its problem."""
    return _declared(name).key_patterns


def _short(raw: str) -> str:
    """``raw`` as a warning shows it: its ``repr``, the first 40 characters."""
    return repr(raw if len(raw) <= 40 else raw[:37] + "...")


_WARNED_ENTRIES: set[tuple[str, str]] = set()
"""Unknown list entries already warned about: ``REHYDRATE_DISABLE`` is read at every
event, and one typo must not add a line to every restore."""
_WARNED_VALUES: set[tuple[str, str]] = set()
"""Bad values already warned about, by variable: ``REHYDRATE_TELEMETRY`` (and others) are
read at every event, and one bad value must not add a line to every event. A new bad
value is news: it is warned about once too."""


def _get(name: str, *types: Type) -> Any:
    var = _declared(name, *types)
    raw = _raw(var)
    if raw is None:
        return var.default
    value, problem = _parse(var, raw)
    if problem is None:
        return value
    import logging

    logger = logging.getLogger("rehydrate")
    if var.key_patterns:  # kept as given: each bad one is a line, once
        for entry in value:
            entry_problem = _pattern_problem(entry)
            if entry_problem is not None and (name, entry) not in _WARNED_ENTRIES:
                _WARNED_ENTRIES.add((name, entry))
                logger.warning("%s: %s", name, entry_problem)
        return value
    if var.type == "list":  # the known entries apply: each unknown one is a line, once
        for entry in _unknown_entries(var, tuple(p.strip() for p in raw.split(",") if p.strip())):
            if (name, entry) not in _WARNED_ENTRIES:
                _WARNED_ENTRIES.add((name, entry))
                logger.warning("%s: %s is not one of %s; ignored", name, _short(entry),
                               ", ".join(var.choices))
        return value
    if (name, raw) not in _WARNED_VALUES:
        _WARNED_VALUES.add((name, raw))
        logger.warning("%s=%s is not %s; using the default (%s)", name, _short(raw), problem,
                       _show(var.default))
    return value


def text(name: str) -> str | None:
    """A ``text`` or ``path`` variable: its value, or the default when unset or empty."""
    value: str | None = _get(name, "text", "path")
    return value


def signal_name(name: str) -> str:
    """A ``signal`` variable: the name of the signal it names (``SIGUSR2``), else the
    default."""
    value: str = _get(name, "signal")
    return value


SIGNAL_RULE = ("a signal name or number that can be caught (not KILL, STOP, CHLD, PIPE, WINCH, "
               "TTIN, TTOU, TSTP, URG or a fault signal: SEGV, BUS, FPE, ILL)")
"""What a ``signal`` variable must be (the warning for a bad value names it)."""

_REFUSED_SIGNALS = {
    "SIGKILL": "cannot be caught",
    "SIGSTOP": "cannot be caught",
    # sent by the kernel for ordinary events: each would run the restore hooks
    "SIGCHLD": "is sent whenever a child process ends",
    "SIGPIPE": "is sent whenever a write to a pipe or socket finds its reader gone",
    "SIGWINCH": "is sent whenever the terminal window changes size",
    # the terminal's job control: taken, a background job reading its terminal was
    # signalled again at every retry of the read (a busy loop of restores), and neither
    # stopped the process as SIG_DFL does
    "SIGTTIN": "is sent whenever a background process reads from its terminal",
    "SIGTTOU": "is sent whenever a background process writes to its terminal or "
               "changes its settings",
    "SIGTSTP": "is sent whenever the terminal's suspend key (Ctrl-Z) is pressed",
    "SIGURG": "is sent whenever urgent (out-of-band) data arrives on a socket",
    # a handler cannot return from a real fault: Python's runs only after the faulting
    # instruction, which faults again
    "SIGSEGV": "is a fault signal (a real fault would loop)",
    "SIGBUS": "is a fault signal (a real fault would loop)",
    "SIGFPE": "is a fault signal (a real fault would loop)",
    "SIGILL": "is a fault signal (a real fault would loop)",
}


def refused_signal(signum: int) -> str | None:
    """Why the signal detector cannot use ``signum`` (``"SIGKILL cannot be caught"``), or
    ``None``."""
    label = signal_label(signum)
    reason = _REFUSED_SIGNALS.get(label)
    return None if reason is None else f"{label} {reason}"


def signal_label(signum: int) -> str:
    """The name of ``signum``: ``SIGUSR2``; a real-time signal without a name of its own
    as ``SIGRTMIN+n``."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        rtmin = getattr(signal, "SIGRTMIN", None)
        if rtmin is not None and rtmin < signum <= signal.SIGRTMAX:
            return f"SIGRTMIN+{signum - rtmin}"
        return f"signal {signum}"


def signal_from_text(text: str) -> int:
    """``"USR2"``, ``"SIGUSR2"`` or ``"12"`` -> ``signal.SIGUSR2`` (a ``signal.Signals``);
    a real-time signal by number (``"35"``) or as ``RTMIN+n`` / ``RTMAX-n`` (a plain
    ``int`` where ``signal.Signals`` has no member). ``ValueError`` when it names no
    signal of this platform (``signal.valid_signals()``)."""
    import signal

    name = text.strip().upper()
    name = name if name.startswith("SIG") else "SIG" + name
    base, sign, offset = name.partition("+") if "+" in name else name.partition("-")
    try:
        if name[3:].isdigit():
            signum = int(name[3:])
        elif sign and base in ("SIGRTMIN", "SIGRTMAX") and offset.strip().isdigit():
            step = int(offset)
            signum = signal.Signals[base] + (step if sign == "+" else -step)
        else:
            return signal.Signals[name]
    except (KeyError, ValueError):
        raise ValueError(f"unknown signal {text!r}") from None
    return signal_number(signum, text)


def signal_number(signum: int, shown: object) -> int:
    """``signum`` as a ``signal.Signals`` member where there is one, else the ``int``;
    ``ValueError`` naming ``shown`` when this platform has no such signal."""
    import signal

    if signum not in signal.valid_signals():
        raise ValueError(f"unknown signal {shown!r}")
    try:
        return signal.Signals(signum)
    except ValueError:
        return signum


def number(name: str) -> float:
    """A ``number``/``seconds`` variable with a default (see :func:`optional_number`)."""
    value = optional_number(name)
    if value is None:
        raise TypeError(f"{name} has no default; read it with optional_number()")
    return value


def optional_number(name: str) -> float | None:
    """A ``number``/``seconds`` variable; ``None`` for "off" (``off_ok``) or no default."""
    value: float | None = _get(name, "number", "seconds")
    return value


def flag(name: str) -> bool | None:
    """A ``flag`` variable: True/False for the usual spellings, else the default."""
    value: bool | None = _get(name, "flag")
    return value


def choice(name: str) -> str:
    """A ``choice`` variable, lower-cased; the default when unset or not a choice."""
    value: str = _get(name, "choice")
    return value


def items(name: str) -> tuple[str, ...]:
    """A ``list`` variable: the comma-separated entries, stripped, blanks dropped."""
    value: tuple[str, ...] = _get(name, "list")
    return value


def default(name: str) -> Any:
    """The declared default of ``name`` (modules name their defaults through this)."""
    return _declared(name).default


def effective() -> list[dict[str, Any]]:
    """Every variable with its effective value, where it came from and, for a bad value,
    what was expected (``rehydrate doctor``). Logs nothing."""
    out = []
    for var in VARIABLES:
        raw = _raw(var)
        value, problem = (var.default, None) if raw is None else _parse(var, raw)
        # "off" set on purpose is not the same as a variable never set
        shown = "off" if value is None and var.off_ok and raw is not None else _show(value)
        if raw is not None and problem is not None and var.type != "list":
            problem = f"{raw[:40]!r} is not {problem}"
        out.append({"name": var.name, "type": var.type, "value": shown,
                    "default": _show(var.default),
                    "source": "default" if raw is None else "environment",
                    "problem": problem, "meaning": var.meaning})
    return out
