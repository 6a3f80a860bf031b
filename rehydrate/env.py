"""Environment refresh: read a ``KEY=VALUE\\0…`` file, diff it against ``os.environ``, apply.

A restored gVisor process keeps the environment it was frozen with; the environment the
container was restored with is readable only from ``/proc/gvisor/spec_environ``. The same
logic serves any platform that mounts the new environment as a file.

Values are never logged; only key names.
"""

from __future__ import annotations

import contextvars
import fnmatch
import functools
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from . import _config
from ._context import EnvChanges
from ._contract import Probe
from ._files import read_regular
from ._hooks import BEFORE_USER_HOOKS, Phase
from ._threads import fresh_lock_after_fork

if TYPE_CHECKING:
    import hashlib

    from ._context import RestoreContext
    from ._contract import Engine

__all__ = [
    "KEEP",
    "MAX_ENVIRON_BYTES",
    "MAX_ENVIRON_ENTRIES",
    "NEVER_FROM_FILE",
    "EnvError",
    "EnvRefresher",
    "Policy",
    "check_overlay",
    "diff",
    "parse_environ",
    "read_environ",
]

log = logging.getLogger("rehydrate")

Policy = Literal["update", "replace", "off"]
"""How a new environment file is applied (``REHYDRATE_ENV_POLICY``; docs/concepts.md)."""
POLICIES: tuple[Policy, ...] = ("update", "replace", "off")

MAX_ENVIRON_BYTES = 4 * 1024 * 1024
"""Larger files are refused: Linux itself caps argv+envp well below this."""

MAX_ENVIRON_ENTRIES = 32_768
"""Files with more entries are refused: each new key is a ``putenv`` that scans the whole
environment (quadratic: 10,000 new keys took 0.3 s here, 30,000 more 3.7 s), and a run
past the hook's timeout would be abandoned with ``os.environ`` half changed."""

NEVER_FROM_FILE: tuple[str, ...] = ("REHYDRATE_*", "LD_*", "GCONV_PATH", "GLIBC_TUNABLES",
                                    "PYTHON*")
"""Glob patterns of keys an environment file never sets, changes or removes: rehydrate's
own configuration (a file must not pick the ``nft`` binary the next restore runs), and
the dynamic loader's and the interpreter's variables, which choose code that child
processes run (``LD_PRELOAD``, ``PYTHONPATH``, ``PYTHONSTARTUP`` …). Such keys in a file
are ignored with one warning naming them, once per restore (or resume) and file however
many engines refresh from it."""

KEEP: tuple[str, ...] = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "TMPDIR",
                         "LANG", "LANGUAGE", "LC_*", "TZ", "HOSTNAME", "TERM")
"""Glob patterns of process-critical keys a refresh never removes (policy ``replace``,
or ``update`` when the new file lacks a key the previous one had). A file may still
change their values."""


class EnvError(ValueError):
    """The environment file could not be read or parsed; nothing was applied."""


def _name(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


_BOM = "\ufeff".encode()


def parse_environ(data: bytes, *, nul_only: bool = False) -> dict[bytes, bytes]:
    """Parse ``KEY=VALUE\\0KEY=VALUE\\0…`` (``/proc/PID/environ``, gVisor's
    ``spec_environ``). A repeated key: the last one wins. Data without any NUL is one
    entry per line (``env`` output, a hand-written file): ``KEY=VALUE\\n`` must not set a
    value ending in a newline, nor ``A=1\\nB=2`` one variable ``A`` holding both.

    In line mode a line may end in CRLF (the ``\r`` is not part of the value), blank
    lines and lines starting with ``#`` (after optional white space) are comments, and a
    key with white space in it (``export A=1``: a shell script, not an environment file)
    is refused. Nothing else of dotenv syntax applies: quotes and ``#`` after a value are
    part of the value (``Q="x"`` sets ``"x"`` with its quotes).

    In NUL mode every entry ends in a NUL, the last one too (gVisor writes one after each
    entry, as ``/proc/PID/environ`` does): data ending otherwise was cut short — a writer
    stopped mid-value, or is still writing — and is refused whole; ``nul_only`` (a file
    named ``spec_environ``) refuses data without any NUL too (cut inside its first
    entry). A leading UTF-8 byte order mark (an editor's) is no part of the first key.

    Raises :class:`EnvError` (naming the entry, never its value) for an entry without
    ``=``, an empty key, NUL-separated data whose last entry is not NUL-terminated, a
    file with no entries at all or more than :data:`MAX_ENVIRON_ENTRIES`, so that a
    half-written or corrupt file is never applied. Bytes that are not UTF-8 are kept as
    bytes.
    """
    if len(data) > MAX_ENVIRON_BYTES:
        raise EnvError(f"larger than the {MAX_ENVIRON_BYTES} bytes accepted")
    if data.startswith(_BOM):
        # Kept, it made the first key "\ufeffAPI_KEY": API_KEY itself was then removed.
        data = data[len(_BOM):]
    separator = b"\0" if b"\0" in data else b"\n"
    if nul_only and separator != b"\0" and data:
        # gVisor's file: a cut inside its first entry leaves no NUL at all, and read as
        # one line the cut value was applied.
        raise EnvError("no NUL-terminated entry (truncated in its first entry?)")
    if separator == b"\0" and not data.endswith(b"\0"):
        # Applied, "DB_URL=postgres://db/ne" of a file cut mid-value was set, and under
        # policy update every key after the cut was removed, with the process ready.
        raise EnvError("last entry not NUL-terminated (truncated, or still being written?)")
    result: dict[bytes, bytes] = {}
    entries = 0
    for index, entry in enumerate(data.split(separator), start=1):
        if not entry:
            continue  # the trailing NUL, or an empty slot between two NULs
        entries += 1
        if entries > MAX_ENVIRON_ENTRIES:
            raise EnvError(f"more than {MAX_ENVIRON_ENTRIES} entries")
        line = entry[:-1] if separator == b"\n" and entry.endswith(b"\r") else entry
        if separator == b"\n" and (not line.strip() or line.lstrip().startswith(b"#")):
            # A comment or blank line of a hand-written file: before, "# note=x" failed the
            # whole refresh (a key with white space) and "#KEY=x" set a key "#KEY".
            entries -= 1
            continue
        key, sep, value = line.partition(b"=")
        if not sep:
            raise EnvError(f"entry {index} has no '='")
        if not key:
            raise EnvError(f"entry {index} has an empty key")
        if separator == b"\n" and key.split() != [key]:
            raise EnvError(f"entry {index}: the key has white space in it (a shell line "
                           "such as 'export KEY=value'? one KEY=value per line)")
        result[key] = value
    if not result:
        raise EnvError("no KEY=VALUE entries")
    return result


def read_environ(path: str | os.PathLike[str]) -> dict[bytes, bytes]:
    """Read and parse an environment file; :class:`EnvError` on any problem.

    Only a regular file is read, opened without blocking (a FIFO at the path would
    otherwise hang the engine until a writer appears), and at most
    :data:`MAX_ENVIRON_BYTES` of it.
    """
    try:
        data = bytes(read_regular(path, MAX_ENVIRON_BYTES))
    except OSError as exc:
        raise EnvError(f"cannot read {os.fspath(path)}: {exc.strerror or exc}") from None
    try:
        # gVisor's spec_environ (or a stand-in of it) is always NUL-separated
        return parse_environ(data, nul_only=os.path.basename(path) == "spec_environ")
    except EnvError as exc:
        raise EnvError(f"{os.fspath(path)}: {exc}") from None


READ_TIMEOUT = 5.0


def _blake2b() -> type[hashlib.blake2b]:
    """BLAKE2b, from CPython's ``_blake2`` (0.2 ms to import) rather than ``hashlib``
    (2-3 ms, most of it OpenSSL's ``_hashlib``, which a refresh does not need); first
    called by :meth:`EnvRefresher.baseline`, i.e. before the snapshot."""
    try:
        from _blake2 import blake2b
    except ImportError:  # pragma: no cover - an interpreter without the builtin module
        from hashlib import blake2b
    return blake2b


def _read_within(path: str, timeout: float | None, *, cut: bool = False
                 ) -> dict[bytes, bytes]:
    """:func:`read_environ` on a pool thread, waited for at most ``timeout`` seconds
    (``None``: as long as it takes).

    An ``open()`` or ``read()`` on a hung network mount blocks in the kernel whatever the
    flags: the engine's constructor, ``simulate_snapshot()`` or a restore must not block
    with it. The worker, abandoned, holds no lock and ends whenever the mount answers.
    The thread is one of :data:`~rehydrate._threads.blocking`'s: the one that read the
    file before the snapshot reads it in the clone (no thread start right after restore).
    """
    import concurrent.futures

    from ._threads import blocking

    try:
        return blocking.submit(read_environ, path).result(timeout)  # type: ignore[no-any-return]
    except concurrent.futures.TimeoutError:
        why = (", the time the rehydrate.env hook had left for it" if cut
               else "")
        shown = f"{timeout:.2g}" if cut else f"{timeout:g}"  # not 9.49997s
        raise EnvError(f"{path}: no answer within {shown}s{why} (a hung mount?)") from None


def diff(
    current: Mapping[bytes, bytes],
    new: Mapping[bytes, bytes],
    remove: Iterable[bytes] = (),
) -> EnvChanges:
    """Names of keys ``new`` adds or changes relative to ``current``, and of ``remove``."""
    added = sorted(_name(k) for k in new if k not in current)
    changed = sorted(_name(k) for k, v in new.items() if k in current and current[k] != v)
    removed = sorted(_name(k) for k in remove if k in current and k not in new)
    return EnvChanges(tuple(added), tuple(changed), tuple(removed))


@dataclass
class EnvRefresher:
    """The built-in ``ENVIRONMENT`` step.

    ``policy``:
      * ``update`` (default): set every key of the new file; remove a key the previous file
        had and the new one lacks; leave keys that never came from the file alone.
      * ``replace``: make the process environment exactly the file.
      * ``off``: never apply the file (an overlay is still applied).
    ``protect``: glob patterns of keys never overwritten or removed (the default engine's
    come from ``$REHYDRATE_ENV_PROTECT``, see :meth:`from_config`; an engine given an
    ``EnvRefresher`` of its own uses only that one's ``protect``).

    A key in the file gets the file's value at every refresh, even when the application
    changed it since the previous file (a resume too): one warning per refresh names such
    keys. What a refresh returns is what it changed in ``os.environ`` together with what
    the file changed since the one this refresher applied last, so that a second engine's
    refresher, finding ``os.environ`` already updated by the first, reports it as well
    (with what the first one reset of the application's own values: :class:`_Event`).
    Engines may share one refresher: each engine's refresh counts once per restore, and
    the second one's, finding the file applied already, applies nothing, warns nothing
    and reports what the first one's reported. A direct call (no engine's hook: an
    ``after_restore`` hook re-reading a file that arrives late) after an engine's
    refresh of the same restore reports only what it changed itself since; what it
    changes is news to an engine refreshing later in that restore.
    An overlay counts as what the refresher applied last for the keys the file holds: a
    later refresh resetting its value is no "application's own value" to warn about.

    The refresher keeps no value of the file: only a keyed hash of each (BLAKE2b, with a
    random key of this refresher's), enough to tell equality, so that a secret the
    application deleted from ``os.environ`` is not kept in every snapshot image by it.
    Only a high-entropy value is protected so: the key is in the image too, and a short
    value (a PIN) is found by hashing guesses offline. The hash is there to tell "the
    application changed it" apart, not to keep a secret.

    An overlay that removes a key of the file leaves it the file's: a later file without
    it removes it again (update), when the application set it since.

    Whatever the policy, a file never sets, changes or removes :data:`NEVER_FROM_FILE`
    keys (``REHYDRATE_*``, ``LD_*``, ``PYTHON*`` …), a refresh never removes :data:`KEEP`
    keys (``PATH``, ``HOME`` …), and a file that was configured (``path=`` or
    ``$REHYDRATE_ENV_FILE``) but is missing is an :class:`EnvError`. Overlays
    (``simulate_restore(env=...)``) are the caller's explicit choice: only ``protect``
    applies to them.
    """

    path: str | None = "auto"
    """The environment file; ``"auto"``: :func:`default_path` at each use; None: no file."""
    policy: Policy = "update"
    protect: tuple[str, ...] = ()
    read_timeout: float | None = READ_TIMEOUT
    """Seconds a read of the file may take (a hung mount): then :class:`EnvError`.
    ``None``: no limit (the read waits for the mount however long it takes). In the
    engine's ``rehydrate.env`` hook the read also ends :data:`APPLY_MARGIN` before the
    hook's timeout or the run's deadline: what answers later is never applied."""

    def __post_init__(self) -> None:
        # Checked here: an int was taken (os.stat reads it as a file descriptor) and the
        # engine's constructor then failed deep in os.open with a TypeError.
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"path must be a file path (str), 'auto' or None, not "
                            f"{type(self.path).__name__}: {_config.shown(self.path)}")
        if self.policy not in POLICIES:
            raise ValueError(f"env policy must be one of {POLICIES}, not "
                             f"{_config.shown(self.policy)}")
        self.protect = _checked_protect(self.protect)
        # Checked here, not at the restore: NaN, 0 or a negative number made every
        # refresh "no answer within nans", infinity an OverflowError in the hook. None
        # stays "no limit", as it always was (Future.result(None) waits however long).
        if self.read_timeout is not None:
            self.read_timeout = _config.seconds(self.read_timeout, "read_timeout")
        # The file the last refresh applied (or the baseline), key -> value: its keys tell
        # which ones a later file removes, its values which keys the application changed
        # since (a refresh resets those: one warning) and what the platform changed even
        # when another engine's refresher already applied it to os.environ.
        # Key -> keyed hash of the value, never the value (see _digest).
        self._previous: dict[bytes, bytes] | None = None
        # Random per refresher, kept in memory: the refresh that stores a hash and the one
        # that compares (in a clone, after a fork) use the same key; only hashes and this
        # key are in a snapshot image, never a value.
        self._hash_key = os.urandom(32)
        # The setting a warning names for keeping a key: the default engine's refresher
        # takes REHYDRATE_ENV_PROTECT (from_config), any other only protect=.
        self._protect_setting = "EnvRefresher(protect=...)"
        # Where this refresher stands in the process's sequence of restores (_Event): the
        # event of its last refresh and the restore it last announced (restored()), per
        # engine (_Position), and when it last took a baseline (made, a snapshot).
        self._direct = _Position()
        self._engines: weakref.WeakKeyDictionary[object, _Position] = (
            weakref.WeakKeyDictionary())
        # The last event an engine's refresh of this refresher joined, and the last one a
        # direct call joined with no engine's refresh before it (_Event.join): a direct
        # call is part of an engine's restore only after that engine's refresh.
        self._engine_event = -1
        self._alone_event = -1
        self._baselined = _EVENT.tick()
        # What the last refresh of the file reported, and in which event: the second
        # engine sharing this refresher finds its file applied already (and the previous
        # file, which told what it removed, replaced), and reports the same.
        self._reported: tuple[int, EnvChanges] = (-1, EnvChanges())

    @classmethod
    def from_config(cls) -> EnvRefresher:
        """A refresher configured as the default engine's: ``path="auto"``
        (``$REHYDRATE_ENV_FILE``, else ``$REHYDRATE_GVISOR_PROC/spec_environ``, at each
        use), ``policy`` from ``$REHYDRATE_ENV_POLICY`` and ``protect`` from
        ``$REHYDRATE_ENV_PROTECT`` (one warning per pattern that cannot be meant), read
        now. ``Lifecycle(env=EnvRefresher.from_config())`` is what an engine given no
        ``env`` gets; an engine given ``EnvRefresher(...)`` of its own ignores both
        variables, and its reset warning names ``protect=`` instead."""
        value = _config.choice("REHYDRATE_ENV_POLICY")
        policy: Policy = next((p for p in POLICIES if p == value), "update")
        refresher = cls(policy=policy, protect=_config.items("REHYDRATE_ENV_PROTECT"))
        refresher._protect_setting = "REHYDRATE_ENV_PROTECT"
        return refresher

    def _protect_not_applied(self) -> str:
        """A note for the reset warning when REHYDRATE_ENV_PROTECT is set but this
        refresher is not the default engine's: it was ignored without a word."""
        if self._protect_setting == "REHYDRATE_ENV_PROTECT":
            return ""
        if not _config.items("REHYDRATE_ENV_PROTECT"):
            return ""
        return ("; REHYDRATE_ENV_PROTECT is set but applies only to an engine without an "
                "EnvRefresher of its own")

    def _position(self, engine: object | None = None) -> _Position:
        """Where ``engine`` (default: the one refreshing now, :data:`_ENGINE`) stands: two
        engines sharing this refresher each refresh once per restore, so its second
        refresh of a restore is no next restore (its warnings came twice, and the second
        engine was told of no change)."""
        engine = _ENGINE.get() if engine is None else engine
        if engine is None:
            return self._direct
        try:
            return self._engines.setdefault(engine, _Position())
        except TypeError:  # not weakly referenceable: counted as a direct call
            return self._direct

    def _digest(self, value: bytes) -> bytes:
        return _blake2b()(value, key=self._hash_key, digest_size=16).digest()

    def _digests(self, entries: Mapping[bytes, bytes]) -> dict[bytes, bytes]:
        blake2b, key = _blake2b(), self._hash_key
        return {k: blake2b(v, key=key, digest_size=16).digest() for k, v in entries.items()}

    def _protected(self, key: bytes) -> bool:
        return _matches(key, self.protect)

    def resolved_path(self) -> str | None:
        return default_path() if self.path == "auto" else self.path

    def configured(self) -> bool:
        """True when the file was named (``path=`` or ``$REHYDRATE_ENV_FILE``), not the
        gVisor default: a named file that is missing is an error, the default is not."""
        if self.path == "auto":
            return bool(_config.text("REHYDRATE_ENV_FILE"))
        return self.path is not None

    def baseline(self) -> None:
        """Remember which keys the file holds now, so a later refresh can tell removals.

        Also compiles the key patterns a refresh matches against, so a clone does not."""
        for patterns in (NEVER_FROM_FILE, KEEP, self.protect):
            _pattern(tuple(patterns))
        self._baselined = _EVENT.tick()
        # Loaded before the snapshot even without a file now: a clone's first refresh that
        # finds one (a mount only the clones have) hashes, and must import nothing then.
        _blake2b()
        path = self.resolved_path()
        if path is None or not _present(path):
            return
        from ._threads import blocking

        blocking.reserve("env")  # the thread a clone's refresh reads the file on
        if self._previous is not None:
            return
        try:
            self._previous = self._digests(_read_within(path, self.read_timeout))
        except EnvError:
            self._previous = None

    def refresh(self, overlay: Mapping[str, str | None] | None = None) -> EnvChanges:
        """Apply the new environment; returns what changed (names only).

        ``overlay`` (from a simulator or a detector) is applied instead of the file,
        whatever the policy: each key is set, a ``None`` value removes it. Raises
        :class:`EnvError` when the file cannot be used; ``os.environ`` is then left exactly
        as it was.
        """
        if overlay is not None:
            # Before the policy: ``off`` is about the file, and an overlay is the caller's
            # explicit choice (a test under REHYDRATE_ENV_POLICY=off saw no change at all).
            with _EVENT.applying:
                return self._apply_overlay(overlay)
        if self.policy == "off":
            return EnvChanges()
        path = self.resolved_path()
        if path is None:
            return EnvChanges()
        if not _present(path):
            if self.configured():
                raise EnvError(f"{path}: the configured environment file does not exist")
            if self.path == "auto":
                _warn_missing_in_set_proc(path)
            return EnvChanges()
        # Read outside the lock: a read stuck on a hung mount (its hook abandoned at the
        # timeout) must not hold the lock every later refresh needs.
        timeout, cut = self._read_timeout_now()
        new = _read_within(path, timeout, cut=cut)
        # Compare, apply and record as one step across all refreshers (every engine's):
        # another engine's refresher comparing after this one applied but joining the
        # event before it recorded saw os.environ already updated and no earlier change,
        # and missed the platform's change (its on_env_change hooks skipped).
        warnings: list[tuple[object, ...]] = []
        try:
            with _EVENT.applying:
                return self._apply_file(new, path, warnings)
        finally:
            # Logged with the lock released: a slow or blocking handler (a log shipper,
            # a full pipe) held it, and every other engine's refresh waited on it.
            for message, *args in warnings:
                log.warning(message, *args)

    def _read_timeout_now(self) -> tuple[float | None, bool]:
        """The read's timeout, and whether the engine's hook cut it (:data:`_READ_BY`).

        Within the ``rehydrate.env`` hook the read ends before the hook's own timeout
        (or the run's deadline): a read that answered after the hook was abandoned
        applied the file then, behind the failed report, and the keys it changed were
        reported to no ``on_env_change`` hook, at that restore or any later one."""
        until = _READ_BY.get()
        if until is None:
            return self.read_timeout, False
        left = max(until - time.monotonic(), 0.001)
        if self.read_timeout is not None and self.read_timeout <= left:
            return self.read_timeout, False
        return left, True

    def _apply_overlay(self, overlay: Mapping[str, str | None]) -> EnvChanges:
        check_overlay(overlay)  # all first: never apply half of it
        env = os.environb
        sets = {
            os.fsencode(k): os.fsencode(v)
            for k, v in overlay.items()
            if v is not None and not self._protected(os.fsencode(k))
        }
        removes = [
            os.fsencode(k)
            for k, v in overlay.items()
            if v is None and not self._protected(os.fsencode(k))
        ]
        changes = diff(env, sets, removes)
        _EVENT.join(self)
        for k, v in sets.items():
            env[k] = v
        for k in removes:
            env.pop(k, None)
        _EVENT.record(changes)
        previous = self._previous
        if previous is not None:
            # The platform's value now, for a key the file holds: a later refresh that
            # resets it warned "the application's own value" (the platform set it). A key
            # only the overlay has stays out: the next file would remove it (update).
            for k, v in sets.items():
                if k in previous:
                    previous[k] = self._digest(v)
            # A key of the file the overlay removed is still the file's: a later file
            # without it removes it again when the application set it since (what the
            # previous file had, as docs/concepts.md says), and reports no removal when
            # it is gone already (the overlay's own env_changes did).
            for k in removes:
                if k in previous:
                    previous[k] = _ABSENT
        return changes

    def _apply_file(self, new: dict[bytes, bytes], path: str,
                    warnings: list[tuple[object, ...]]) -> EnvChanges:
        """Compare, apply and record (under ``_EVENT.applying``); the warnings to log,
        ``(message, *args)`` with key names only, are appended to ``warnings``."""
        env = os.environb
        # a key the process already has with the same value is no attempt: no warning
        # (gVisor's spec_environ repeats the container's REHYDRATE_* / PYTHON* settings)
        # names escaped when not printable: a key with a newline must not forge a log line
        ignored = sorted(_name(k) for k, v in new.items()
                         if _matches(k, NEVER_FROM_FILE) and env.get(k) != v)
        candidates = env if self.policy == "replace" else (self._previous or ())
        removes = [k for k in candidates
                   if k not in new and not _matches(k, NEVER_FROM_FILE)
                   and not _matches(k, KEEP) and not self._protected(k)]
        sets = {k: v for k, v in new.items()
                if not self._protected(k) and not _matches(k, NEVER_FROM_FILE)}
        previous = self._previous
        applied = changes = diff(env, sets, removes)  # what this refresh does to os.environ
        earlier, aside = _EVENT.join(self)
        # Once per restore (or resume) and file, however many engines read it: their
        # refreshes of one file ignore the same keys.
        if ignored and _EVENT.first_warning(("ignored", path, *ignored)):
            warnings.append(("environment file %s: ignored %s (rehydrate's configuration "
                             "and loader/interpreter variables never come from the "
                             "refreshed environment)", path, _names_text(ignored)))
        if previous is not None:
            # What the platform changed since the file this refresher last applied: another
            # engine's refresher of the same restore may have applied it to os.environ
            # already, and this engine's on_env_change hooks must see it all the same.
            present = {k: v for k, v in previous.items() if v != _ABSENT}
            changes = _union(changes, diff(present, self._digests(sets), removes))
            # The application's own value of a key the file holds (PATH to a venv, a tuned
            # OMP_NUM_THREADS) is reset here, as the policy says; said, not silently.
            # A key the process lacks is not counted: whether the application deleted it
            # or the process never had it (a file written for the clones), nobody can tell.
            overridden = sorted(
                _name(k) for k in (*sets, *removes)
                if k in previous and k in env and env[k] != sets.get(k)
                and self._digest(env[k]) != previous[k])
            if overridden:
                warnings.append((
                    "environment file %s: the refresh replaced the application's own value "
                    "of %s (changed since the previous file) with the file's: a key in the "
                    "file gets the file's value, one only the previous file had is removed; "
                    "protect a key to keep the application's value (%s)%s", path,
                    _names_text(overridden), self._protect_setting,
                    self._protect_not_applied()))
        if earlier is not None:
            # What an earlier refresher of this restore (another engine's) did to
            # os.environ that this file does too: the application's own PATH that the
            # first engine reset was no change for the second, whose on_env_change hooks
            # for it were skipped. Each key as the kind it was to os.environ.
            gone = set(removes)
            changes = _union(changes, EnvChanges(*(
                tuple(sorted(_name(k) for k in keys
                             if (env.get(k) == sets[k] if k in sets
                                 else k in gone and k not in env)))
                for keys in earlier)))
        for k, v in sets.items():
            if env.get(k) != v:
                env[k] = v
        for k in removes:
            env.pop(k, None)
        self._previous = self._digests(new)
        _EVENT.record(applied)
        event, reported = self._reported
        if event != _EVENT.number:
            self._reported = (_EVENT.number, changes)
        elif aside:
            # A direct call after an engine's refresh of this restore: that refresh's
            # report is no news to it (the engine's env_changes had it), yet what this
            # call changed is news to an engine sharing this refresher that refreshes
            # later in the restore.
            self._reported = (_EVENT.number, _union(changes, reported))
        else:
            # This refresher applied a file in this restore already, for another engine:
            # what it reported then is this engine's news too (a key it removed is in no
            # previous file any more).
            changes = _union(changes, reported)
            self._reported = (_EVENT.number, changes)
        return changes


_ABSENT = b""
"""In a refresher's previous file: a key of it that an overlay removed (no digest is
empty)."""


class _Position:
    """Where one engine's use of a refresher stands in :class:`_Event`'s sequence."""

    __slots__ = ("event", "restore")

    def __init__(self) -> None:
        self.event = -1
        self.restore = -1


class _Event:
    """The names (never values) of the ``os.environ`` keys the refreshes of the current
    restore added, changed and removed, process-wide: a second engine's refresher reports
    a key the first one changed to the value its own file holds too.

    Each engine refreshes once per restore or resume, so a refresher that refreshes again
    for the same engine (:class:`_Position`: engines may share one; direct calls are
    another position, see :meth:`join`) begins the next event, and so does one whose
    baseline (a before-snapshot pass) or creation came after the current event began: a
    later engine, or the first engine of the next restore whose predecessor refreshed
    elsewhere, never takes an old event's names for this one's. A refresher that missed an
    event (no file then) and joins a later one is told what changed meanwhile: news to it
    too.

    ``applying`` is held by each refresh over its compare, apply and record, so that no
    other refresher sees ``os.environ`` changed by one whose names are not recorded yet;
    nothing is logged while it is held (a blocking handler would hold up every engine).
    ``restore`` numbers the restores the same way (:func:`restored`, per engine run)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.applying = threading.Lock()
        self._clock = 0
        self.number = 0
        self.began = 0
        self.restore = 0
        self.restore_began = 0
        self.changed: tuple[set[bytes], set[bytes], set[bytes]] = (set(), set(), set())
        self._warned: set[tuple[str, ...]] = set()
        # A parent thread may hold either at fork() (a refresh in progress).
        fresh_lock_after_fork(self, "_lock", "applying")

    def tick(self) -> int:
        with self._lock:
            self._clock += 1
            return self._clock

    def join(self, refresher: EnvRefresher
             ) -> tuple[tuple[frozenset[bytes], ...] | None, bool]:
        """``refresher`` refreshes now: the keys the earlier refreshes of this event
        added, changed and removed (None: there were none, or they are no news to it),
        and whether this is a direct call aside an engine's refresh of this event.

        A direct call (no engine in :data:`_ENGINE`) after one of ``refresher``'s engines
        refreshed in this event is part of that restore (an ``after_restore`` hook
        re-reading a late file): it stays in the event, so that a later engine is told of
        its changes, but takes none of the event's names (that engine's refresh reported
        them: returned again, they read as the call's own). A direct call with no engine's
        refresh before it (at startup) is no part of the next restore: an engine of
        ``refresher`` joining its event begins the next one, as a second direct call
        does."""
        with self._lock:
            position = refresher._position()
            direct = position is refresher._direct
            stale = refresher._baselined > self.began
            aside = direct and not stale and refresher._engine_event == self.number
            if not aside and (stale or position.event == self.number
                              or (not direct and refresher._alone_event == self.number)):
                self._clock += 1
                self.number += 1
                self.began = self._clock
                for names in self.changed:
                    names.clear()
                self._warned.clear()
            position.event = self.number
            if not direct:
                refresher._engine_event = self.number
            elif not aside:
                refresher._alone_event = self.number
            if aside or not any(self.changed):
                return None, aside
            return tuple(frozenset(names) for names in self.changed), aside

    def restored(self, refresher: EnvRefresher, engine: object | None = None) -> bool:
        """``engine`` (``refresher``'s) begins a restore run: True when that is a new
        restore, not one another engine's run already announced."""
        with self._lock:
            position = refresher._position(engine)
            new = (position.restore == self.restore
                   or refresher._baselined > self.restore_began)
            if new:
                self._clock += 1
                self.restore += 1
                self.restore_began = self._clock
            position.restore = self.restore
            return new

    def first_warning(self, what: tuple[str, ...]) -> bool:
        """True the first time in the current event: the warning ``what`` names is due."""
        with self._lock:
            if what in self._warned:
                return False
            self._warned.add(what)
            return True

    def record(self, changes: EnvChanges) -> None:
        with self._lock:
            seen = set().union(*self.changed)
            for names, these in zip(self.changed,
                                    (changes.added, changes.changed, changes.removed),
                                    strict=True):
                names.update(k for k in map(os.fsencode, these) if k not in seen)


_EVENT = _Event()

_ENGINE: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "rehydrate_env_engine", default=None)
"""The engine whose ``rehydrate.env`` hook is refreshing (None: a direct call)."""

_READ_BY: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "rehydrate_env_read_by", default=None)
"""``time.monotonic()`` by which the ``rehydrate.env`` hook's read must have answered
(None: a direct call, only ``read_timeout`` applies)."""

HOOK_TIMEOUT = 10.0
"""The ``rehydrate.env`` hook's timeout, in seconds."""

APPLY_MARGIN = 0.1
"""Seconds of the hook's time (or the run's) kept for applying what was read (half of
it when less than that is left twice over): applying takes microseconds, and a slow but
healthy mount under a short run deadline must not lose its read to the margin."""


def _union(first: EnvChanges, second: EnvChanges) -> EnvChanges:
    """The keys of both; a key in ``first`` keeps its kind there (what happened to
    ``os.environ``), one only in ``second`` takes its kind from it."""
    seen = first.keys
    return EnvChanges(
        tuple(sorted({*first.added, *(k for k in second.added if k not in seen)})),
        tuple(sorted({*first.changed, *(k for k in second.changed if k not in seen)})),
        tuple(sorted({*first.removed, *(k for k in second.removed if k not in seen)})))


def _names_text(names: Iterable[str]) -> str:
    """Key names for a warning: shortened as everywhere (:func:`~rehydrate._config.
    shown_names`), escaped when not printable (a key with a newline must not forge a log
    line)."""
    return ", ".join(n if n.isprintable() else ascii(n) for n in _config.shown_names(names))


_warned_missing: set[tuple[int, str]] = set()
"""(pid, path) already warned about: a forked child (same memory, another pid) warns
once too, and :func:`restored` empties it, so that a clone restored from an image taken
after the warning (same pid under gVisor) warns once as well."""


def restored(refresher: EnvRefresher | None = None, engine: object | None = None) -> None:
    """A restore began (a new process from a snapshot image): its "once" warnings are due
    again. Called by the engine at each restore run (not a resume) with its refresher and
    itself: the second engine of the same restore (:meth:`_Event.restored`), sharing the
    refresher or not, clears nothing, or the warning came once per engine."""
    if refresher is None or _EVENT.restored(refresher, engine):
        _warned_missing.clear()


def _warn_missing_in_set_proc(path: str) -> None:
    """One warning per process and restore (per path) when ``REHYDRATE_GVISOR_PROC`` names
    a directory of its own and ``spec_environ`` is not in it: the runsc recipe
    bind-mounts a clone's environment there, and a file of another name (or an empty
    mount) left the clone with the original's environment, ready, without a word. Not an
    error: the default ``/proc/gvisor`` is absent off gVisor, and a directory may serve
    only ``checkpoint``."""
    proc = _config.text("REHYDRATE_GVISOR_PROC")
    if not proc or os.path.normpath(proc) == "/proc/gvisor":
        return
    seen = (os.getpid(), path)
    if seen in _warned_missing:
        return
    _warned_missing.add(seen)
    log.warning("environment file %s does not exist: REHYDRATE_GVISOR_PROC names %s, and "
                "the refresh reads only the file named spec_environ there (the environment "
                "is left as it is; warned once per process and restore)", path, proc)


def _checked_protect(protect: object) -> tuple[str, ...]:
    """``protect`` as a tuple of glob patterns; ``TypeError`` (one line) otherwise.

    A single string was taken as a sequence of one-character patterns: ``protect="DB_*"``
    protected every key (its ``*``), so a refresh silently changed nothing, and a
    non-string pattern failed only at the restore."""
    if isinstance(protect, (str, bytes)):
        raise TypeError(f"protect must be a tuple of glob patterns, not a "
                        f"{type(protect).__name__}: protect=({_config.shown(protect)},)")
    try:
        patterns: tuple[object, ...] = tuple(protect)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"protect must be a tuple of glob patterns, not "
                        f"{type(protect).__name__}") from None
    checked: list[str] = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"protect patterns must be non-empty str, not "
                            f"{_config.shown(pattern)}")
        checked.append(pattern)
    return tuple(checked)


def _matches(key: bytes, patterns: Iterable[str]) -> bool:
    return _pattern(tuple(patterns)).match(_name(key)) is not None


@functools.lru_cache(maxsize=64)
def _pattern(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One compiled regular expression for a tuple of glob patterns (``fnmatchcase``
    semantics). Compiled when the engine takes its baseline, i.e. before a snapshot:
    compiling them in a clone is tens of milliseconds of first-touch work under gVisor."""
    if not patterns:
        return re.compile(r"(?!)")  # matches nothing
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def _name_only(name: str) -> str:
    """A key for a message, never what follows an ``=``: a whole ``KEY=VALUE`` pair given
    as the key would otherwise put the value into the error (and the logs)."""
    key, sep, _ = name.partition("=")
    # shown(), not repr(): a multi-megabyte key made a multi-megabyte error (and log line)
    return _config.shown(key) + (" (followed by '=' and a value, not shown)" if sep else "")


def check_overlay(overlay: object) -> None:
    """Raise (``TypeError`` for a wrong type, :class:`EnvError` for a bad entry) unless
    ``overlay`` maps ``str`` names to ``str`` values or ``None``; names only in messages."""
    if not isinstance(overlay, Mapping):
        raise TypeError(f"env must be a mapping of names to str or None, "
                        f"not {type(overlay).__name__}")
    for name, value in overlay.items():
        if not isinstance(name, str):
            raise TypeError(f"env keys must be str, not {type(name).__name__}")
        shown = _name_only(name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"env value for {shown} must be a str or None, "
                            f"not {type(value).__name__}")
        if not name or "=" in name or "\0" in name or (value is not None and "\0" in value):
            raise EnvError(f"invalid environment entry {shown} (empty key, '=' or NUL)")
        try:  # what applying it does: a lone surrogate would fail there, half applied
            os.fsencode(name)
            if value is not None:
                os.fsencode(value)
        except UnicodeEncodeError:
            raise EnvError(f"invalid environment entry {_config.shown(name)} (not "
                           "encodable for the environment)") from None


def _present(path: str) -> bool:
    """False only when the file is really absent: a file we may not read is an error."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # e.g. EACCES on a parent directory: read_environ will say so
    return True


def default_path() -> str:
    """``$REHYDRATE_ENV_FILE``, else ``$REHYDRATE_GVISOR_PROC/spec_environ``."""
    explicit = _config.text("REHYDRATE_ENV_FILE")
    if explicit:
        return explicit
    proc = _config.text("REHYDRATE_GVISOR_PROC") or "/proc/gvisor"
    return os.path.join(proc, "spec_environ")


def check_file() -> dict[str, object]:
    """``rehydrate doctor``'s look at the environment file the default engine would read:
    ``path``, whether it was ``configured`` (``$REHYDRATE_ENV_FILE``), the ``policy``,
    the number of ``entries`` when it parses, and the ``problem`` (an
    :class:`EnvError`'s text: the file and the entry, never a value) — ``None`` when there
    is none — with ``fails_restore`` true when it would fail a restore's ``rehydrate.env``
    hook. The default gVisor file missing is no problem (not on gVisor); one missing from
    a directory ``$REHYDRATE_GVISOR_PROC`` names is, though a restore only warns."""
    policy = _config.choice("REHYDRATE_ENV_POLICY")
    path = default_path()
    configured = bool(_config.text("REHYDRATE_ENV_FILE"))
    out: dict[str, object] = {"path": path, "configured": configured, "policy": policy,
                              "present": False, "entries": None, "problem": None,
                              "fails_restore": False}
    if policy == "off":
        return out  # never read: nothing it holds can fail a restore
    if not _present(path):
        proc = _config.text("REHYDRATE_GVISOR_PROC")
        if configured:
            out["problem"] = f"{path}: the configured environment file does not exist"
            out["fails_restore"] = True
        elif proc and os.path.normpath(proc) != "/proc/gvisor":
            out["problem"] = (f"{path} does not exist: REHYDRATE_GVISOR_PROC names {proc}, "
                              "and the refresh reads only the file named spec_environ there")
        return out
    out["present"] = True
    try:
        out["entries"] = len(_read_within(path, READ_TIMEOUT))
    except EnvError as exc:
        out["problem"] = str(exc)
        out["fails_restore"] = True
    return out


# -- extension: the engine's environment refresh ----------------------------------------

key = "env"


def probe() -> Probe:
    """Always usable: without an environment file only an explicit overlay is applied."""
    return Probe(True)


def install(engine: Engine) -> None:
    """Register ``rehydrate.env``: the restore hook that applies ``engine.env``, before
    every user hook (whatever their ``order``)."""

    def refresh_environment(ctx: RestoreContext) -> None:
        # The key names are logged with the run's summary line, after readiness changed.
        left = ctx.time_left()
        budget = HOOK_TIMEOUT if left is None else min(HOOK_TIMEOUT, left)
        token = _ENGINE.set(engine)  # engines sharing one refresher: whose refresh this is
        # Half of what is left when that is short: a margin eating it all failed even a
        # read of a local file.
        read_by = _READ_BY.set(time.monotonic() + budget - min(APPLY_MARGIN, budget / 2))
        try:
            ctx.env_changes = engine.env.refresh(ctx.env)
        finally:
            _READ_BY.reset(read_by)
            _ENGINE.reset(token)

    engine.builtins.register(refresh_environment, phase=Phase.ENVIRONMENT,
                             order=BEFORE_USER_HOOKS, name="rehydrate.env",
                             timeout=HOOK_TIMEOUT)
