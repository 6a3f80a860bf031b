"""The lifecycle engine: state machine, generations, running phases, reports, readiness.

Every event — a detector noticing a restore, ``rehydrate notify``, a simulator — ends up in
:meth:`Lifecycle.restore_detected` or :meth:`Lifecycle.snapshot_requested`. Events run one
at a time (a restore arriving while hooks run waits its turn), and two notices of the same
restore run the hooks once.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from . import _config
from . import env as env_module
from ._context import (
    HookFailed,
    HookResult,
    Kind,
    Report,
    RestoreContext,
    RestoreReport,
    SnapshotReport,
    describe_error,
)
from ._contract import (
    DEFAULT_EXTENSIONS,
    NO_DEADLINE_THREAD,
    Engine,
    Extension,
    Probe,
    load_extension,
    refuse_another_engine,
)
from ._hooks import Hook, Registry, _BuiltinRegistry
from ._loop_roles import blocking, running_loop
from ._runner import HookRunner, LoopThread, Observer, running_hook_of
from ._threads import fresh_lock_after_fork
from .env import EnvRefresher, check_overlay

if TYPE_CHECKING:
    import asyncio

    from .detect import Detector

__all__ = ["Lifecycle", "State", "Status"]

log = logging.getLogger("rehydrate")

T = TypeVar("T")

State = Literal["running", "snapshotting", "restoring", "ready", "degraded"]

_SEEN_KEYS = 256
_ON_HOOK_LOOP = ("{} cannot block rehydrate's event loop: the async hooks it waits for run "
                 "there; call it through asyncio.to_thread()")
NOTICE_WINDOW: float = _config.default("REHYDRATE_SIGNAL_WINDOW")
"""A restore notice that cannot tell when its freeze was (no ``since``, no ``key``, no
``notify save`` before it) is the last restore only when that ran less than this many
seconds before the notice, besides nothing having frozen since by the freeze watch. The
watch cannot see every freeze (a guest clock carried over, as on Firecracker or in a CRIU
time namespace, shows no jump; a freeze shorter than its gap slack never shows), and
nothing in the process tells a freeze it missed from a late notice: taken alone, its
answer (its first heartbeat) made every later restore a duplicate and a clone kept its
parent's keys. The signal detector's window (and the marker-file detector's default); a
platform whose notice may come later says which restore it is about (``key=``, ``notify save``)."""
_PASSES = 16
"""Before-snapshot passes remembered for notices that name one (``undoes``)."""


class _Fault:
    """One failure of a required hook in a restore/resume run (see
    :meth:`Lifecycle.recovered`): compared by identity, as hooks may share a name."""

    __slots__ = ("builtin", "hook", "name")

    def __init__(self, name: str, hook: Hook | None, builtin: bool) -> None:
        self.name = name
        self.hook = hook
        """The record that failed (None only if the runner did not say which)."""
        self.builtin = builtin
        """It is in ``engine.builtins`` (a built-in manager's hook)."""


def _pick(faults: Sequence[_Fault], hook: str | Hook,
          builtins: Sequence[Hook] = ()) -> _Fault | None:
    """The failure ``recovered(hook)`` forgets: that very record's, or by name one of a
    hook of that name — a user's hook before a built-in one, which the built-in managers
    recover by record (a user hook named like one, ``rehydrate.secret:db``, was cleared
    by that secret's reload and a built-in's failure by the user's call).

    ``builtins``: the registered built-in hooks. A built-in record with no failure of its
    own takes over a built-in failure of its name whose record is no longer registered:
    the secret or certificate that failed was closed and one made under its name since,
    whose loads are the only ones that can still mend it (the closed one's hook is gone,
    and no reload could ever name its record: the process stayed degraded until the next
    restore)."""
    if isinstance(hook, str):
        named = [f for f in faults if f.name == hook]
        return next((f for f in named if not f.builtin), named[0] if named else None)
    own = next((f for f in faults if f.hook is hook), None)
    if own is not None or not any(h is hook for h in builtins):
        return own
    return next((f for f in faults if f.builtin and f.name == hook.name
                 and f.hook is not None and not any(h is f.hook for h in builtins)), None)


@dataclass
class _Pass:
    """The latest before-snapshot pass and the run that ended it (see ``undoes`` in
    :meth:`Lifecycle.restore_detected`)."""

    started: float
    """``time.monotonic()`` when its hooks began."""
    undone_by: RestoreReport | None = None
    """The first restore or resume run after it: its hooks reopened what the pass closed."""
    abort_announced: bool = False
    """That run was a carry-on that told the platform to abort the pass's checkpoint
    (``notify save`` failed): the platform's answer that the checkpoint failed is due."""
    abort_answered: bool = False
    """The platform's answer to that announced abort came (it was confirmed)."""
    report: SnapshotReport | None = None
    """The before-snapshot pass's report (see :meth:`Lifecycle.pass_started`)."""
    settled: bool = False
    """Its checkpoint is over, or there never was one (a resume or restore notice, a
    carry-on that announced no abort, an answer that it failed): no answer is owed for it
    any more. The snapshot deadline's run does not settle a pass — its checkpoint may
    still be in flight and answered later."""


class _DeadlineThread:
    """The snapshot deadline's thread, started before a before-snapshot pass's hooks and
    told after them whether to watch (:meth:`arm`) or end (:meth:`cancel`).

    The constructor raises when no thread can start (``RuntimeError: can't start new
    thread`` at a pids limit): the caller then runs no hook."""

    def __init__(self, watch: Callable[..., None]) -> None:
        self._watch = watch
        self._told = threading.Event()
        self._watching = threading.Event()
        self._job: tuple[int, float] | None = None
        threading.Thread(target=self._main, name="rehydrate-snapshot-deadline",
                         daemon=True).start()

    def arm(self, seq: int, deadline: float) -> None:
        """Watch the pass ``seq``: the deadline counts from now (the hooks' end). Returns
        once the watch has taken its start (at most a second): returning at once let the
        caller go on to the checkpoint (a freeze) before the watch took its start, and
        the frozen time went by unseen — the deadline ran the resume hooks where, after
        a gap, it runs the restore hooks."""
        self._job = (seq, deadline)
        self._told.set()
        self._watching.wait(1.0)

    def cancel(self) -> None:
        self._told.set()

    def _main(self) -> None:
        self._told.wait()  # always told: arm() or cancel() follows every pass
        if self._job is not None:
            self._watch(*self._job, started=self._watching.set)


@dataclass(frozen=True)
class Status:
    """What :meth:`Lifecycle.status` returns: ``state``, ``generation``, ``ready``, the running
    ``detectors``, the ``last_report``, and in ``extra`` the fields managers publish;
    :meth:`to_dict` is what ``rehydrate status --json`` prints. ``status()["files"]``
    reads a field by name: a core one as its attribute (``status()["state"]`` is
    ``status().state``), any other from ``extra`` (``KeyError`` when nothing publishes
    it, e.g. ``detector_errors`` while every detector asked for runs)."""

    state: State
    generation: int
    ready: bool
    detectors: tuple[str, ...]
    last_report: Report | None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        # The docs and the CLI's JSON name fields this way: status()["detector_errors"]
        # was a TypeError while every page showed it.
        if key in _CORE_STATUS:
            return getattr(self, key)
        return self.extra[key]

    def __contains__(self, key: object) -> bool:
        # without it, `in` fell back to __getitem__(0), (1) ... and raised KeyError: 0
        return key in _CORE_STATUS or key in self.extra

    def get(self, key: str, default: Any = None) -> Any:
        """``status()[key]``, or ``default`` when nothing publishes ``key``."""
        if key in _CORE_STATUS:
            return getattr(self, key)
        return self.extra.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "state": self.state,
            "generation": self.generation,
            "ready": self.ready,
            "detectors": list(self.detectors),
            "last_report": self.last_report.to_dict() if self.last_report else None,
        }
        # JSON-ready means json.dumps(..., default=str) works: it does not apply
        # default= to keys, and an extension's counters keyed by (host, port) made every
        # status --json, gated /rehydrate/status and dumps() of this raise.
        out.update((name, _json_keys(value)) for name, value in self.extra.items())
        return out


_JSON_KEY_TYPES = (str, int, float, type(None))
"""Dict keys JSON takes (``bool`` is an ``int``)."""
_CONTAINERS = (dict, list, tuple)


def _json_keys(value: Any) -> Any:
    """``value`` with every dict key JSON cannot have (a tuple) replaced by its ``str()``,
    as ``default=str`` does for values; keys JSON takes (``str``, ``int``, ``float``,
    ``None``) are left to it. Only the containers on the way to such a key are copied;
    with none (the common case) ``value`` itself is returned, after one scan. A container
    that contains itself is left as it is, for the encoder to refuse. Iterative: nesting
    as deep as the encoder takes (and deeper) raises no ``RecursionError`` here."""
    if not isinstance(value, _CONTAINERS) or not _has_json_bad_key(value):
        return value
    return _with_json_keys(value)


def _has_json_bad_key(value: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> bool:
    # Called on every status --json and gated /rehydrate/status: the per-item tests run
    # in C (map/compress), and a container with no container in it is never recorded.
    stack: list[Any] = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if not all(map(isinstance, item, itertools.repeat(_JSON_KEY_TYPES))):
                return True
            members: Iterable[Any] = item.values()
        else:
            members = item
        inner = list(itertools.compress(
            members, map(isinstance, members, itertools.repeat(_CONTAINERS))))
        if inner and id(item) not in seen:  # a container seen before: shared, or a loop
            seen.add(id(item))
            stack.extend(inner)
    return False


def _with_json_keys(value: Any) -> Any:
    """The copy :func:`_json_keys` returns, built bottom-up with an explicit stack."""
    done: dict[int, Any] = {}  # id of a container: what replaces it
    above: set[int] = set()  # the containers on the way down to the current one
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, expanded = stack.pop()
        if not expanded:
            if id(item) in done or id(item) in above:  # shared, or contains itself
                continue
            above.add(id(item))
            stack.append((item, True))
            members = item.values() if isinstance(item, dict) else item
            stack.extend((m, False) for m in members if isinstance(m, _CONTAINERS))
            continue
        above.discard(id(item))
        if isinstance(item, dict):
            pairs = [(k if isinstance(k, _JSON_KEY_TYPES) else str(k), done.get(id(v), v))
                     for k, v in item.items()]
            same = all(k is old_k and v is old_v
                       for (k, v), (old_k, old_v) in zip(pairs, item.items(), strict=True))
            done[id(item)] = item if same else dict(pairs)
        else:
            members = [done.get(id(m), m) for m in item]
            same = all(a is b for a, b in zip(members, item, strict=True))
            done[id(item)] = item if same else members
    return done[id(value)]


_CORE_STATUS = frozenset({"state", "generation", "ready", "detectors", "last_report"})
"""The fields of :meth:`Status.to_dict` that are not extensions' (``add_status``)."""
_ENGINE_STATUS = _CORE_STATUS | {"detector_errors", "hung_hooks"}
"""Every field the engine itself publishes: refused to ``add_status``."""


def _status_owner(fn: Callable[[], Any]) -> str:
    """Who added a status field, for :meth:`Lifecycle.add_status`: the class of a bound
    method's object (a classmethod's own class), else the module that defined ``fn`` (a
    ``functools.partial``'s function)."""
    while isinstance(fn, functools.partial):
        fn = fn.func  # a partial's own module is functools: every partial was one owner
    obj = getattr(fn, "__self__", None)
    if obj is not None and not isinstance(obj, types.ModuleType):
        # a classmethod is bound to its class: type() of that was "builtins.type" for all
        cls = obj if isinstance(obj, type) else type(obj)
        return f"{cls.__module__}.{cls.__qualname__}"
    return str(getattr(fn, "__module__", None) or type(fn).__qualname__)


class Lifecycle:
    """Runs hooks for snapshot and restore events and tracks readiness.

    ``registry``: the user hooks (a fresh one when omitted). Extensions (the environment
    refresh, entropy, telemetry, keys, connections …) register their hooks in their own
    registry, :attr:`builtins`, merged with the user hooks at run time.

    ``extensions``: what to install, as :class:`~rehydrate.extensions.Extension` objects or
    dotted names (default: :data:`~rehydrate.extensions.DEFAULT_EXTENSIONS`; with
    ``builtins=False``, none). A list *replaces* the defaults — unlike
    ``rehydrate.start(extensions=[...])``, which adds to the process-wide engine's: list
    them too (``extensions=[*DEFAULT_EXTENSIONS, adapter]``) or call :meth:`install` on a
    ``Lifecycle()``. A non-empty list that leaves defaults out is logged once at ``INFO``
    naming them, unless ``builtins=False`` says none is wanted. An extension whose probe
    says it is not usable here is skipped with one log line (``WARNING`` when it was
    listed explicitly, ``INFO`` for a default); one that fails to load or install raises
    when it was asked for explicitly and is logged when it is a default. :meth:`install`
    adds extensions later (to the process-wide engine too:
    ``rehydrate.start(extensions=[...])``).
    """

    def __init__(
        self,
        registry: Registry | None = None,
        *,
        env: EnvRefresher | None = None,
        builtins: bool = True,
        extensions: Iterable[str | Extension] | None = None,
        snapshot_deadline: float | None = None,
    ) -> None:
        # Checked here: a wrong object failed later, once per extension, as "could not be
        # installed: ... has no attribute 'hooks'" and the engine was made all the same.
        if registry is not None and not isinstance(registry, Registry):
            raise TypeError(f"Lifecycle(registry=...) takes a rehydrate.Registry, not "
                            f"{type(registry).__name__}")
        if env is not None and not isinstance(env, EnvRefresher):
            raise TypeError(f"Lifecycle(env=...) takes a rehydrate.env.EnvRefresher, not "
                            f"{type(env).__name__}")
        self.registry = registry if registry is not None else Registry()
        self.snapshot_deadline = (_positive_or_none(snapshot_deadline, "snapshot_deadline")
                                  if snapshot_deadline is not None
                                  else _deadline_from_env())
        """Seconds after a successful before-snapshot run without a restore or resume
        after which the resume hooks run anyway (``None``: wait for ever); a freeze
        meanwhile starts it again, a stall postpones it by its length, both at most one
        more deadline in all unless the freeze watch confirmed the freeze, and then it
        runs the restore hooks (see :meth:`_deadline_main`). Default:
        ``$REHYDRATE_SNAPSHOT_DEADLINE``, else :data:`DEFAULT_SNAPSHOT_DEADLINE`."""
        self.notice_window = _config.number("REHYDRATE_SIGNAL_WINDOW")
        """Seconds after a restore was detected during which a notice that cannot tell
        when its freeze was (``notify restore`` without a ``notify save``) may be that
        restore (see :meth:`notice_since`): ``$REHYDRATE_SIGNAL_WINDOW``, the signal and
        marker-file detectors' window, else :data:`NOTICE_WINDOW` (2 s). Raise it where
        the platform's notice comes later than that after the restore."""
        self.builtins: Registry = _BuiltinRegistry()
        self.env = env if env is not None else EnvRefresher.from_config()
        self._loop_thread = LoopThread()
        self._runner = HookRunner(self._loop_thread)
        self._runner.on_failed = self._hook_failed
        self._user_loop: asyncio.AbstractEventLoop | None = None
        self._observers: list[Observer] = []
        self._listeners: list[Callable[[Report], None]] = []

        self._cond = threading.Condition()
        self._state: State = "running"
        self._faults: list[_Fault] | None = None
        """The failures of required hooks in the last restore/resume run not recovered
        yet, while the process is ``degraded`` by that run (see :meth:`recovered`); None
        in any other state."""
        self._run_began = -math.inf  # time.monotonic() when the last restore run began
        self._run_failed: list[_Fault] = []
        """Required hooks failed so far in the restore run in progress."""
        self._run_recovered: list[_Fault] = []
        """Of those, the ones :meth:`recovered` since their failure, in that run."""
        self._generation = 0
        self._last_report: Report | None = None
        self._extra_status: dict[str, Callable[[], Any]] = {}
        self._restore_deadlines: dict[str, float] = {}
        """Source -> seconds every restore/resume run must end within (see
        :meth:`set_restore_deadline`)."""
        self._extensions: dict[str, Any] = {}
        self._ext_lock = threading.Lock()
        self._install_lock = threading.Lock()  # not _ext_lock: an install calls extension()
        self._installing = threading.local()
        """``active`` while this thread runs :meth:`install` (start listeners wait)."""
        self._start_listeners: list[Callable[[Engine], None]] = []
        self._installed_from: dict[str, object] = {}
        """key -> what it was installed from (an object or a dotted name): the same one
        listed again is no second copy."""
        self.installed: list[str] = []
        """Keys of the extensions installed in this engine, in installation order."""

        self._run_lock = threading.Lock()
        self._seen: collections.OrderedDict[str, Report] = collections.OrderedDict()
        self._last_restore_at: float | None = None
        self._last_snapshot_at = -math.inf
        """``time.monotonic()`` of the last before-snapshot pass: a restore handled before
        it is never the restore a later notice is about."""
        self._last_restore_report: RestoreReport | None = None
        self._pass: _Pass | None = None
        """The latest before-snapshot pass (the last of :attr:`_passes`)."""
        self._passes: collections.deque[_Pass] = collections.deque(maxlen=_PASSES)
        """The latest passes, oldest first: a late notice names the pass it is about,
        which may be older than the latest (a checkpoint retried before the waiter read
        the earlier attempt's answer)."""
        self._late_answer: tuple[float, _Pass | None] | None = None
        """The latest platform answer that came after a newer pass had begun (arrival, the
        pass it settled): the original's resume. A restore notice of the same freeze
        (the clock jump's) that was detected before that newer pass is its duplicate."""
        self._event_seq = 0  # +1 per run (under _run_lock); ends a snapshot deadline watch

        # Freeze watch (see heartbeat()): fed by a watcher thread, read by is_ready().
        self._beat: float | None = None
        self._beat_limit = math.inf
        self._beat_due = math.inf
        self._beat_seq = 0
        """Counts heartbeats and noticed freezes: a notice waiting for the watcher's
        verdict wakes on the next one."""
        self._verdict_waiters = 0
        self._gap_since: float | None = None
        self._freeze_noticed_at: float | None = None
        self._freezes = 0
        """Counts :meth:`freeze_noticed` calls: the snapshot deadline's verdict on a gap."""
        self._run_ended = -math.inf
        """``time.monotonic()`` at the end of the last restore/resume run: the process ran
        then. Not a heartbeat (a run can span a freeze: a clone made mid-run ends its
        parent's run before its watcher woke), only a bound on when a freeze the watch has
        not judged yet began (see :meth:`freeze_since`)."""

        self._detectors: list[Detector] = []
        self._notices = 0
        """Restore notices being handled or waiting for the run lock (never ready then)."""
        self._arriving: tuple[Callable[[], bool], ...] = ()
        """Checks of detectors whose notice arrives before they can report it (a signal
        handler hands it to a worker thread): True while one has arrived and not been
        handed to :meth:`restore_detected` yet (see :meth:`add_arrival_check`)."""
        self._detector_errors: dict[str, str] = {}
        """Detectors asked for that failed to start, and why (shown by status())."""
        self._installed_detectors: dict[str, Detector] = {}
        """Detectors installed as extensions (add_detector): started by every start()."""
        self._started = False
        self._start_lock = threading.Lock()
        # Held by a parent thread at fork() (a hook running, a start() in progress), these
        # were held for ever in the child: a child forked while a hook ran hung on its next
        # event. (``env`` registers its own.)
        fresh_lock_after_fork(self, "_cond", "_run_lock", "_start_lock", "_ext_lock",
                              "_install_lock")
        self._merged: tuple[tuple[int, ...], dict[str, tuple[Hook, ...]]] | None = None
        # one entry per abandoned hook thread still running (at most one per hook function);
        # a lambda: close() replaces the runner
        self._extra_status["hung_hooks"] = lambda: self._runner.hung_hooks()  # noqa: PLW0108
        if extensions is not None:
            extensions = list(extensions)  # read twice: an iterator would be spent
            listed: set[str] = set()
            self._install_extensions(extensions, explicit=True, listed=listed)
            if extensions and builtins:
                self._say_defaults_left_out(listed)
        elif builtins:
            self._install_extensions(DEFAULT_EXTENSIONS, explicit=False)
        # What the environment file holds now: a later refresh removes keys it drops,
        # even when start() is never called (trigger_snapshot, notify-only setups).
        self.env.baseline()
        _ENGINES.add(self)

    def _after_fork_in_child(self) -> None:
        """In a child of ``fork()``: become a clean, stopped engine.

        Only the forking thread exists in the child: detector threads, the hook worker and
        the engine's event loop stayed in the parent, and any lock one of them held is held
        for ever here. So the child gets fresh locks (:func:`fresh_lock_after_fork`, whose
        handler runs before this one) and a fresh runner, forgets the parent's detectors
        *without stopping them* (stopping would unlink the parent's control socket or close
        its descriptors' resources) once each closed its copies of their descriptors
        (:meth:`~rehydrate.detect.Detector.forget_in_child`), and an event the parent was
        running is not finished here: its state becomes ``degraded``. Hooks, generation and
        reports stay. ``start()`` in the child starts its own detectors — the installed
        ones (:meth:`add_detector`) again.
        """
        self._loop_thread = LoopThread()
        self._runner = HookRunner(self._loop_thread)
        self._runner.on_failed = self._hook_failed
        self._user_loop = None
        for d in self._detectors:
            forget = getattr(d, "forget_in_child", None)  # detectors not derived from Detector
            if forget is None:
                continue
            try:
                forget()
            except Exception:
                log.exception("detector %s: forget_in_child() failed", d.key)
        self._detectors = []
        self._detector_errors = {}
        self._notices = 0  # the parent's threads waiting with a notice are not here
        self._arriving = ()  # so are the parent's signal workers
        # _installed_detectors stay: the child's start() starts them again (forgotten, an
        # installed detector was lost for good — start(extensions=[det]) was a no-op, a new
        # instance "installed already", its key "unknown").
        self._restore_deadlines = {}  # set by those detectors (the SnapStart bridge)
        self._started = False
        # The parent's clock-jump thread is not here: its heartbeat would go stale and
        # make the child look frozen for ever.
        self._beat, self._beat_limit, self._freeze_noticed_at = None, math.inf, None
        self._beat_due = math.inf
        self._verdict_waiters = 0  # the parent's notice threads are not here either
        if self._state in ("snapshotting", "restoring"):
            self._state = "degraded"
            self._faults = None

    # -- built-ins -------------------------------------------------------------------

    def _install_extensions(self, specs: Iterable[str | Extension], *,
                            explicit: bool, listed: set[str] | None = None) -> None:
        from . import detect

        for spec in specs:
            try:
                ext = load_extension(spec)
                key = ext.key
                if not isinstance(key, str) or not key:
                    raise TypeError(f"extension {_config.shown(spec)}: key must be a "
                                    f"non-empty str, not {_config.shown(key)}")
                if listed is not None:
                    listed.add(key)
                prev = self._installed_from.get(key)
                if key in self.installed and (prev is spec or prev is ext or (
                        isinstance(prev, str) and prev == spec)):
                    # the same extension again (start(extensions=[x]) run twice, a test
                    # fixture, an app factory): installed already, nothing to do
                    log.debug("extension %s is installed already", key)
                    continue
                if key in self.installed:
                    # A key is unique per engine: a second copy registered every hook
                    # twice (a manager) or silently replaced the first (a detector).
                    raise ValueError(f"extension {key!r} is installed already in this "
                                     "engine (listed twice?)")
                # A detector instance answers for its own configuration (a FileDetector
                # given a path); its class-level probe() only knows the environment.
                probe = (ext.probe_instance() if isinstance(ext, detect.Detector)
                         else ext.probe())
                if not isinstance(probe, Probe):
                    raise TypeError(f"extension {key!r}: probe() must return a Probe, not "
                                    f"{type(probe).__name__}")
                if not probe.usable:
                    # One the user listed was wanted: an INFO line under the usual WARNING
                    # level left a vLLM never put to sleep nor woken without a word.
                    log.log(logging.WARNING if explicit else logging.INFO,
                            "extension %s not installed: %s", ext.key, probe.reason)
                    continue
                self._install_or_undo(ext)
            except Exception as exc:
                if explicit:
                    raise
                log.warning("extension %s could not be installed: %s", spec, exc)
                continue
            self.installed.append(ext.key)
            self._installed_from[ext.key] = spec

    @staticmethod
    def _say_defaults_left_out(listed: set[str]) -> None:
        """One INFO line naming the default extensions an explicit ``extensions=`` list
        left out. The list replaces the defaults, and an adapter listed alone read like
        ``start(extensions=[adapter])``, which adds to them: a clone then kept
        its parent's PRNG state and environment without a word. ``extensions=[]`` and
        ``builtins=False`` say no default is wanted, and say nothing."""
        if not log.isEnabledFor(logging.INFO):
            return  # naming them means importing the modules the list left out
        keys = []
        for spec in DEFAULT_EXTENSIONS:
            try:
                keys.append(load_extension(spec).key)
            except Exception:  # a default that cannot load is named as it is listed
                keys.append(spec)
        missing = [k for k in keys if k not in listed]
        if missing:
            log.info("Lifecycle(extensions=[...]) installs only the extensions listed, not "
                     "the default ones %s (add them: extensions=[*DEFAULT_EXTENSIONS, ...]; "
                     "builtins=False says none is wanted)", ", ".join(missing))

    def install(self, *extensions: str | Extension) -> list[str]:
        """Install ``extensions`` (objects or dotted names) in this engine now, as
        ``Lifecycle(extensions=[...])`` does for the ones listed there: each is probed, one
        that is not usable here is skipped with a ``WARNING`` line, one that fails to load
        or install raises (and so does a key installed already). Returns the keys it
        installed.

        The way to extend the process-wide engine that the module-level functions drive:
        ``rehydrate.default_engine.install(adapter)``, or
        ``rehydrate.start(extensions=[adapter])``. A ``Lifecycle(extensions=[...])`` is an
        engine of its own: ``rehydrate.start()`` never runs its extensions."""
        with self._install_lock:
            before, listeners = len(self.installed), len(self._start_listeners)
            self._installing.active = True
            try:
                self._install_extensions(extensions, explicit=True)
            finally:
                self._installing.active = False
            added = self._start_listeners[listeners:]  # of the ones that installed
            keys = self.installed[before:]
        if self._started:
            # after start(): their start listeners run now, outside the lock (one may
            # install more) and only once their extension installed
            for fn in added:
                self._call_start_listener(fn)
        return keys

    def _install_or_undo(self, ext: Extension) -> None:
        """``ext.install(self)``; when it raises, what it had attached already (hooks,
        status fields, observers, listeners, per-engine instances, detectors) is taken
        off again — a half-installed extension's hooks ran at every event, and its
        detector watched, although it was "not installed"."""
        hooks = {r: {h.seq for e in ("restore", "snapshot") for h in r.hooks(e)}
                 for r in (self.builtins, self.registry)}
        lists: list[tuple[list[Any], list[Any]]] = [
            (lst, list(lst)) for lst in (self._observers, self._listeners,
                                         self._start_listeners)]
        status, instances = set(self._extra_status), set(self._extensions)
        detectors = dict(self._installed_detectors)
        try:
            ext.install(self)
        except BaseException:
            replaced = self._undo_detectors(detectors)
            for registry, before in hooks.items():
                for event in ("restore", "snapshot"):
                    for h in registry.hooks(event):
                        if h.seq not in before:
                            registry.unregister(h)
            for lst, old in lists:
                # By identity, not by length: a running detector it replaced was stopped
                # (its listener went), so cutting back to the old length dropped entries
                # that were there before and kept the failed extension's.
                kept = {id(x) for x in old}
                lst[:] = [x for x in lst if id(x) in kept]
            # after the lists are cut: its start() adds its listeners again
            self._restart_detectors(replaced)
            for key in set(self._extra_status) - status:
                del self._extra_status[key]
            for key in set(self._extensions) - instances:
                instance = self._extensions.pop(key)
                close = getattr(instance, "close", None)
                if callable(close):
                    with contextlib.suppress(Exception):
                        close()
            raise

    def _undo_detectors(self, before: dict[str, Detector]) -> list[Detector]:
        """Put the installed detectors back as they were before a failed ``install()``:
        one it added is stopped (when it runs) and removed; returns the ones it replaced,
        to run again (:meth:`_restart_detectors`)."""
        stopped, replaced = [], []
        with self._start_lock:
            for key, det in list(self._installed_detectors.items()):
                if before.get(key) is det:
                    continue
                if key in before:
                    self._installed_detectors[key] = before[key]
                    replaced.append(before[key])
                else:
                    del self._installed_detectors[key]
                if any(running is det for running in self._detectors):
                    self._detectors.remove(det)
                    stopped.append(det)
                self._detector_errors.pop(key, None)
        for det in stopped:  # outside the lock: its thread may be waiting for it
            self._stop_detector(det)
        return replaced

    def _restart_detectors(self, replaced: list[Detector]) -> None:
        """Start again the installed detectors a failed ``install()`` had replaced."""
        with self._start_lock:
            for det in replaced:
                if self._started and self.detector(det.key) is None:
                    self._start_detector(det)

    def extension(self, key: str, factory: Callable[[Lifecycle], T]) -> T:
        """The per-engine instance of an extension, created by ``factory`` on first use.

        Managers (keys, secrets, connections, routes, telemetry …) attach themselves this
        way: the factory typically registers the manager's hooks in :attr:`builtins`. An
        instance with a ``close()`` method has it called by :meth:`close` (work it runs in
        the background ends with the engine).
        """
        with self._ext_lock:
            if key not in self._extensions:
                self._extensions[key] = factory(self)
            ext: T = self._extensions[key]
            return ext

    # -- observation -----------------------------------------------------------------

    def add_observer(self, observer: Observer) -> None:
        """Per-hook callbacks (telemetry). Cheap when none is added."""
        self._observers.append(observer)

    def remove_observer(self, observer: Observer) -> None:
        self._observers.remove(observer)

    def add_listener(self, fn: Callable[[Report], None]) -> None:
        """Called with every finished report (after readiness was updated)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[Report], None]) -> None:
        self._listeners.remove(fn)

    def add_status(self, key: str, fn: Callable[[], Any]) -> None:
        """Add a field to :meth:`status` (managers publish their state this way).

        The engine's own fields (``state``, ``generation``, ``ready``, ``detectors``,
        ``last_report``, ``detector_errors``, ``hung_hooks``) are refused, and so is a
        field another extension added (a ``ValueError`` naming both): an extension's field
        replaced them in ``status().to_dict()`` — what the CLI, the control socket and
        ``/readyz`` show — so a dead detector or another manager's state vanished without a
        word. The same owner may add its field again (a detector's ``start()`` after a
        ``stop()``, a new instance of the same class): the owner is the class of a bound
        method's object (a classmethod's class), else the module that defined ``fn`` (for
        a ``functools.partial``, its function's).
        """
        if key in _ENGINE_STATUS:
            raise ValueError(f"status field {key!r} is the engine's own; choose another name")
        old = self._extra_status.get(key)
        if old is not None and _status_owner(old) != _status_owner(fn):
            raise ValueError(f"status field {key!r} is added already by {_status_owner(old)}; "
                             f"{_status_owner(fn)} cannot replace it: choose another name")
        self._extra_status[key] = fn

    def set_restore_deadline(self, source: str, seconds: float | None) -> None:
        """Bound every restore or resume run of this engine, whichever detector noticed
        it, to ``seconds`` from its notice while ``source`` asks for it (``None``: no longer).

        For platforms that end a restore taking longer (the SnapStart bridge sets it:
        a clock jump noticed before Lambda's runtime hook must not run past Lambda's
        limit, since that hook waits for it). The tightest of the sources and of the
        notice's own ``deadline`` applies; see ``deadline`` in :meth:`restore_detected`.
        """
        if seconds is not None:
            seconds = _config.seconds(seconds, f"{source} restore deadline")
        with self._cond:
            if seconds is None:
                self._restore_deadlines.pop(source, None)
            else:
                self._restore_deadlines[source] = seconds

    def _deadline_at(self, detected: float, deadline: float | None) -> float | None:
        """The ``time.monotonic()`` a run noticed at ``detected`` must end by, or None."""
        with self._cond:
            limits = list(self._restore_deadlines.values())
        if deadline is not None:
            limits.append(deadline)
        return detected + min(limits) if limits else None

    def add_start_listener(self, fn: Callable[[Engine], None]) -> None:
        """Called with this engine once :meth:`start` has started the detectors (the first
        call only), or at once when it is added after that; a listener that raises is
        logged and does not stop the others."""
        self._start_listeners.append(fn)
        if self._started and not getattr(self._installing, "active", False):
            # added after start(): it would never run, and what it reads at start (the
            # fingerprint's REHYDRATE_MANIFEST) never be read. During install() it runs
            # when that extension has installed (see install()).
            self._call_start_listener(fn)

    def _call_start_listener(self, fn: Callable[[Engine], None]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("start listener %r failed", fn)

    # -- state -----------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def state(self) -> State:
        return self._state

    @property
    def last_restore_at(self) -> float | None:
        """``time.monotonic()`` when the last *anchored* restore or resume was detected
        (simulated and "carry on" runs excluded; see :meth:`restore_detected`)."""
        return self._last_restore_at

    @property
    def started(self) -> bool:
        """True between :meth:`start` and :meth:`stop` (or :meth:`close`)."""
        return self._started

    @property
    def snapshot_pending(self) -> bool:
        """True between a before-snapshot pass and the next restore or resume: managers
        must not create secret material then (it would be written into the image)."""
        last = self._last_report
        return self._state == "snapshotting" or (
            self._state == "degraded" and last is not None and last.kind == "snapshot")

    def is_ready(self) -> bool:
        """True in the original before any snapshot and after a successful restore run.

        False from the moment a clone resumes until that restore's hooks ran: besides the
        state, it checks the freeze watch (when one runs, see :meth:`heartbeat`) — a
        heartbeat older than its limit means the process was frozen and the detectors
        have not caught up yet — and it asks the detectors whose notice arrives on one
        thread and is reported from another (the signal detector: its handler hands the
        signal to a worker) whether one is on its way. Costs one clock read and one call
        per such detector.
        """
        # The arrival checks first: a detector's check turns False when the engine counts
        # its notice (``_notices``), so read after it, ``_notices`` cannot miss that notice
        # — read before, a switch between the two reads saw neither.
        if self._arriving and any(check() for check in self._arriving):
            return False
        if (self._notices or self._verdict_waiters or self._state not in ("running", "ready")
                or self._freeze_noticed_at is not None):
            return False
        beat = self._beat
        return beat is None or time.monotonic() - beat <= self._beat_limit

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until ready (True) or until ``timeout`` seconds passed (False).

        From inside one of this engine's hooks it raises ``RuntimeError`` while not ready:
        readiness comes only after the hook itself has finished; so does a call that would
        wait (``timeout`` not 0) on rehydrate's own event loop, where the async hooks it
        waits for run. ``timeout``: seconds, 0
        (do not wait); ``None``, infinity or more than a year: no limit. A negative, NaN
        or non-number timeout is a one-line ``ValueError``/``TypeError`` at once, ready
        or not.
        """
        timeout = _config.optional_seconds(timeout, "wait_ready(): timeout")
        if not self.is_ready():
            if running_hook_of(self._runner):
                raise RuntimeError("wait_ready() inside a hook would wait for its own event")
            if timeout != 0 and self._loop_thread.is_current():
                raise RuntimeError(_ON_HOOK_LOOP.format("wait_ready()"))
        with self._cond:  # every change of readiness notifies (runs, heartbeats after a gap)
            return self._cond.wait_for(self.is_ready, timeout)

    def status(self, fields: Iterable[str] | None = None) -> Status:
        """The state, generation, readiness, detectors and last report, and in ``extra``
        the fields extensions publish (``add_status``) and ``detector_errors``.

        ``fields``: build only these published fields (None: all). A field's function can
        be costly (``tcp_connections`` scans ``/proc``): a view that shows a few of them
        asks for those alone."""
        wanted = (None if fields is None
                  else frozenset((fields,) if isinstance(fields, str) else fields))
        extra: dict[str, Any] = {}
        errors = dict(self._detector_errors)
        for d in list(self._detectors):
            try:
                report = getattr(d, "failure", None)  # detectors not derived from Detector
                failure = report() if report is not None else None
            except Exception as exc:  # a detector's report must never break status()
                failure = f"unavailable: {type(exc).__name__}"
            if failure:
                errors[d.key] = failure
        if errors:
            extra["detector_errors"] = errors
        for key, fn in list(self._extra_status.items()):
            if wanted is not None and key not in wanted:
                continue
            try:
                extra[key] = fn()
            except Exception as exc:  # a status field must never break status()
                extra[key] = f"unavailable: {type(exc).__name__}"
        ready = self.is_ready()
        state = self._state
        if not ready and (state in ("running", "ready") or (
                state == "snapshotting" and self._frozen_since_beat())):
            state = "restoring"  # frozen and resumed: the detectors have not caught up yet
        return Status(
            state=state,
            generation=self._generation,
            ready=ready,
            detectors=tuple(d.key for d in self._detectors),
            last_report=self._last_report,
            extra=extra,
        )

    def add_arrival_check(self, check: Callable[[], bool]) -> None:
        """Readiness asks ``check()`` (cheap, no locks: it may be called from anywhere):
        True while a notice has arrived that the detector has not handed to
        :meth:`restore_detected` yet. A signal handler only wakes a worker thread, which
        may wait for the GIL for a while; until it calls in, the engine would otherwise say
        ready in a clone the signal was about."""
        with self._cond:
            self._arriving = (*self._arriving, check)

    def remove_arrival_check(self, check: Callable[[], bool]) -> None:
        """Forget a check :meth:`add_arrival_check` added (no error when it is not there)."""
        with self._cond:
            self._arriving = tuple(c for c in self._arriving if c != check)
            self._cond.notify_all()

    def arrival_handed(self) -> None:
        """A detector's arrival check turned False without a run (a duplicate, its stop):
        wake :meth:`wait_ready`."""
        with self._cond:
            self._cond.notify_all()

    def _frozen_since_beat(self) -> bool:
        """The freeze watch says the process was frozen and has not caught up (a clone
        just resumed after ``notify save``): its last heartbeat is older than its limit,
        or it noticed a freeze not handled yet."""
        beat = self._beat
        return self._freeze_noticed_at is not None or (
            beat is not None and time.monotonic() - beat > self._beat_limit)

    def _set_state(self, state: State) -> None:
        with self._cond:
            self._state = state
            self._faults = None  # a pass, or a run cut short: nothing a hook could mend
            self._cond.notify_all()

    def recovered(self, hook: str | Hook, *, since: float | None = None) -> bool:
        """A required hook that failed in the last restore/resume run has since done its
        job another way — its certificate reloaded by the file watcher, its secret
        reloaded, the connection it could not open opened by the application: forget that
        failure. Once none of that run's failures is left, the process is ``ready`` again
        (one ``INFO`` line) instead of ``degraded`` until the next restore.

        ``hook``: the hook's name as reports show it, or the :class:`~rehydrate.Hook`
        record its registration returned. A name forgets one failure of a hook of that
        name (hooks sharing a name that failed together each need their own call),
        preferring a hook of ``engine.registry`` to a built-in one; a record forgets only
        that very hook's failure — how the built-in certificate and secret managers call
        it when a reload succeeds, so a user hook named like one of theirs
        (``rehydrate.secret:db``) is never cleared by their reloads. A record of
        :attr:`builtins` also forgets a built-in failure of its name whose hook has been
        unregistered since (a secret or certificate closed after its hook failed, then made
        again under its name: the new one's loads stand for it). ``since``:
        ``time.monotonic()`` when the work that recovered it began; when the failed run
        began after that, the work may hold what that run rejected and nothing is
        forgotten. Returns True when this call made the process ready. During a restore
        run it returns False and counts only for a hook that has already failed in that
        run: the run then ends ``ready`` when every failure of it recovered. Otherwise it
        does nothing (False): not degraded, degraded by a before-snapshot pass or by a
        run cut short, or a hook that did not fail in that run.
        """
        if not isinstance(hook, (str, Hook)):
            raise TypeError(f"recovered(): hook must be a hook's name (str) or its Hook "
                            f"record, not {type(hook).__name__}")
        name = hook if isinstance(hook, str) else hook.name
        # before _cond: the registry takes its own lock
        builtins = self.builtins.hooks("restore") if isinstance(hook, Hook) else ()
        with self._cond:
            if since is not None and since < self._run_began:
                return False
            if self._state == "restoring":
                # Its hook failed earlier in this run: counted when the run ends (a
                # watcher that reloads a certificate while later hooks still run fires
                # once; dropped, the process stayed degraded for good).
                mended = self._run_recovered
                fault = _pick([f for f in self._run_failed
                               if not any(f is m for m in mended)], hook, builtins)
                if fault is not None:
                    mended.append(fault)
                return False
            faults = self._faults
            fault = (_pick(faults, hook, builtins) if self._state == "degraded" and faults
                     else None)
            if faults is None or fault is None:
                return False
            faults.remove(fault)  # by identity: a _Fault compares as an object
            if faults:
                left = ", ".join(sorted({f.name for f in faults}))
            else:
                self._state = "ready"
                self._faults = None
                self._cond.notify_all()
        if faults:
            log.info("hook %s recovered; still degraded by: %s", name, left)
            return False
        log.info("hook %s recovered; ready again", name)
        return True

    def _hook_failed(self, hook: Hook, result: HookResult) -> None:
        """The runner recorded a failed or timed-out required hook (any run)."""
        builtin = hook in self.builtins  # before _cond: the registry takes its own lock
        with self._cond:
            if self._state == "restoring":
                self._run_failed.append(_Fault(result.name, hook, builtin))

    # -- freeze watch ----------------------------------------------------------------

    def heartbeat(self, now: float, limit: float, *, gap_since: float | None = None,
                  due: float | None = None) -> None:
        """A freeze watcher (the clock-jump detector's thread) saw the process running.

        ``now``: its ``time.monotonic()`` reading; ``limit``: seconds after which a missing
        heartbeat means the process was frozen (:meth:`is_ready` then says False until the
        watcher caught up); ``gap_since``: the previous heartbeat, when this one came
        noticeably late — a freeze too short to be reported as a restore, which still
        makes a later notice without a time of its own a new restore (see
        :meth:`freeze_since`); ``due`` (at most ``limit``, the default): seconds after
        which a missing heartbeat may hide such a gap that the watcher has not seen yet.
        """
        with self._cond:
            beat = self._beat
            # by the clock now too: a waiter may have judged the beat stale after the
            # watcher read ``now`` (GIL, a log write in between), and waits to be woken
            stale = beat is not None and max(now, time.monotonic()) - beat > self._beat_limit
            if beat is None and self._gap_since is None:
                self._gap_since = now  # no freeze seen since the watch began
            if gap_since is not None:
                self._gap_since = gap_since
            self._beat, self._beat_limit = now, limit
            self._beat_due = limit if due is None else min(due, limit)
            self._beat_seq += 1
            if stale or self._verdict_waiters:
                self._cond.notify_all()

    def freeze_noticed(self, since: float, now: float) -> None:
        """A freeze watcher saw a freeze that began after ``since``: not ready until a
        restore (or resume) run handled it."""
        with self._cond:
            self._freeze_noticed_at = now
            self._freezes += 1
            self._gap_since = since
            self._beat = now
            self._beat_seq += 1
            self._cond.notify_all()

    def heartbeat_stopped(self) -> None:
        """The freeze watcher stopped: readiness no longer checks its heartbeat."""
        with self._cond:
            self._beat, self._beat_limit, self._beat_due = None, math.inf, math.inf
            self._freeze_noticed_at = None
            self._cond.notify_all()

    def freeze_since(self) -> float | None:
        """For a notice that cannot tell when its freeze was (``notify restore`` without a
        ``save`` before it): a ``time.monotonic()`` moment before the latest freeze this
        engine knows of, or None when no freeze watch runs.

        A restore already run after that moment is the notice's restore (nothing froze
        since); a freeze not noticed yet (the heartbeat is overdue right now) makes it new.

        Overdue means later than the watcher's ``due`` (its sleep and the gap slack), not
        only past the readiness limit: in a clone of a clone the last freeze the watch knows
        of is the one before the parent's restore (the clone's memory is the parent's), so
        a notice that comes before the watcher has woken from a freeze shorter than that
        limit was taken for the parent's restore, and the clone's hooks never ran. The
        watcher beats while a run is in progress too (it hands its notices to a thread of
        their own), so this holds during and right after a run: a clone checkpointed while
        its parent's hooks ran wakes with a freeze noticed and being handled — the
        parent's — and a stale heartbeat; its notice is not the parent's restore unless the
        watcher's verdict says nothing froze since (a stall).

        Overdue but not yet stale (past ``due``, within the limit) is ambiguous: a short
        freeze, or a watcher that waited for the GIL (a long C call), for a CPU on a loaded
        host or for a blocked log write. The notice then waits — at most until the
        heartbeat would be stale — for the watcher's next heartbeat, which weighs exactly
        that (a gap, a freeze noticed, or a stall that is neither): taken as a freeze, a
        stall made a late duplicate notice run the hooks a second time.
        """
        with self._cond:
            if self._beat is None:
                return None
            now = time.monotonic()
            if now - self._beat <= self._beat_due:
                return self._gap_since
            # The process surely ran then: a freeze not judged yet began later (a run that
            # ended after the last heartbeat is not this notice's restore). Only a bound:
            # a run may have spanned a freeze (a clone made mid-run ends its parent's run
            # before its watcher wakes), so a recent end still waits for the verdict.
            seen = max(self._beat, self._run_ended)
            if self._freeze_noticed_at is not None:
                # A freeze is being handled and the watch is late: a freeze since (a clone
                # made mid-run), or only the watcher not scheduled yet — its next beat says
                # which (it wakes at once from an overdue sleep).
                return self._watch_verdict(seen, self._beat_limit)
            overdue = now - seen
            if overdue > self._beat_limit:
                return seen  # stale: frozen since, for all the watch can tell
            return self._watch_verdict(seen, self._beat_limit - overdue)

    def notice_since(self, at: float) -> float | None:
        """``since`` for a restore notice read at ``at`` (``time.monotonic()``) that cannot
        tell when its freeze was and has no ``notify save`` before it: the freeze watch's
        word (:meth:`freeze_since`) bounded to :attr:`notice_window` before ``at`` — the
        watch may have missed the freeze, and a clone must never keep its parent's keys
        (a late duplicate runs the hooks again instead). None when no freeze watch runs."""
        freeze = self.freeze_since()
        return None if freeze is None else max(freeze, at - self.notice_window)

    def _watch_verdict(self, seen: float, timeout: float) -> float | None:
        """:meth:`freeze_since` for an overdue heartbeat, called with ``_cond`` held: wait
        for the watcher's next one. A freeze noticed or a gap moves ``_gap_since`` past
        ``seen`` (a new restore); a stall leaves it where it was; no heartbeat within
        ``timeout`` means frozen since ``seen``, for all the watch can tell."""
        end = time.monotonic() + timeout
        noticed = self._freeze_noticed_at  # a freeze being handled already is no verdict
        self._verdict_waiters += 1
        try:
            while True:
                came = self._cond.wait_for(functools.partial(self._beat_moved, self._beat_seq),
                                           max(0.0, end - time.monotonic()))
                if self._beat is None:
                    return None
                if not came:
                    return seen
                if self._freeze_noticed_at not in (None, noticed):
                    return self._gap_since
                # a verdict only from a heartbeat that saw the process run after the
                # overdue stretch (not one read before a freeze and delivered late)
                if time.monotonic() - self._beat <= self._beat_due:
                    return self._gap_since
        finally:
            self._verdict_waiters -= 1
            self._cond.notify_all()

    def _beat_moved(self, seq: int) -> bool:
        """A heartbeat or a noticed freeze since ``seq``, or the watch stopped."""
        return self._beat_seq != seq or self._beat is None

    # -- hooks -----------------------------------------------------------------------

    def hooks(self, event: Literal["restore", "snapshot"]) -> tuple[Hook, ...]:
        """Built-in and user hooks for ``event``, in run order."""
        # The key is read before the lists: a registration in between then leaves the
        # merge under the older version, and the next call merges again (read after, the
        # new version would keep a merge without the new hook for good). ids too:
        # ``engine.registry`` may be swapped for another registry at the same version.
        key = (id(self.registry), self.registry.version, id(self.builtins),
               self.builtins.version)
        user = self.registry.hooks(event)
        builtin = self.builtins.hooks(event)
        if not builtin:
            return user
        if not user:
            return builtin
        merged = self._merged
        if merged is None or merged[0] != key:
            merged = (key, {})
            self._merged = merged
        cached = merged[1].get(event)
        if cached is None:
            tagged = [(h.sort_key(), 0, h) for h in builtin] + [(h.sort_key(), 1, h) for h in user]
            tagged.sort(key=lambda t: (t[0][0], t[0][1], t[1], t[0][2]))
            ordered = [t[2] for t in tagged]
            if event == "snapshot":
                ordered.reverse()
            cached = tuple(ordered)
            merged[1][event] = cached
        return cached

    # -- events ----------------------------------------------------------------------

    def restore_detected(
        self,
        reason: str,
        *,
        kind: Literal["restore", "resume"] = "restore",
        since: float | None = None,
        key: str | None = None,
        frozen_for: float | None = None,
        env: Mapping[str, str | None] | None = None,
        detected_at: float | None = None,
        anchor: bool = True,
        undoes: float | None = None,
        abort: Literal["announced", "answered"] | None = None,
        deadline: float | None = None,
        older_than: float | None = None,
        counted: Callable[[], None] | None = None,
    ) -> RestoreReport:
        """Run the restore (or resume) hooks for an event a detector noticed.

        ``counted``: called (under the engine's lock, so without blocking or raising)
        once the notice counts for readiness — from then on the engine says not ready
        until the run is over: a detector whose own arrival check (:meth:`add_arrival_check`)
        said so until now hands over there, with no moment in between.

        ``deadline``: seconds from the notice (``detected_at``) by which the whole run must
        be over — for platforms that kill a restore taking longer (Lambda SnapStart: 10 s).
        The wait for a run in progress counts; a hook still running at the deadline is
        reported ``timeout`` and the hooks after it are reported ``timeout`` without being
        started (:class:`~rehydrate.HookTimeout` says which); hooks see it as
        :attr:`RestoreContext.deadline`. None (the default): only per-hook timeouts and
        the deadlines set with :meth:`set_restore_deadline` (the tightest applies).

        Duplicate suppression: ``key`` names the event (the same key runs once); ``since``
        is the ``time.monotonic()`` at which the detector last saw the process before the
        freeze — if another *anchored* restore was detected after that moment, this notice
        is the same restore and its report is returned without running anything.

        ``anchor``: True (the default) when the notice is about a real freeze (a restore,
        or a resume after a checkpoint): only such runs are remembered for ``since``.
        Runs that follow no freeze pass False — :meth:`simulate_restore` (and the control
        socket's ``simulate``), and the "carry on" resume runs made when no checkpoint
        happened (before-snapshot hooks failed, the trigger failed, the platform went
        away). They never make a later real restore look handled: a clone must always
        get its reseed, new keys and new environment. Those that know no freeze happened
        also pass ``frozen_for=0.0`` (hooks such as the game loop's tick clock then do
        not treat the run as a freeze); ``None`` means "not known".

        Choosing ``since``: a detector must pass a moment *before the freeze* that is as
        late as it can honestly know, because every anchored restore detected after it
        counts as this one. Two notices of ONE restore are always both detected after the
        restore itself, so any ``since`` between "last seen before the freeze" and "the
        restore" merges them. A notice that arrives within moments of the restore
        (gVisor's ``restore`` answer, which the kernel delivers as the process resumes)
        may also clamp its ``since`` to "arrival minus a short window" (bounded below by
        when it started waiting): a descriptor opened hours ago must not swallow a real
        restore because some other restore — or a false alarm — was handled in between.
        ``since=None`` (not known) and no ``key``: for an anchored notice the engine asks
        its freeze watch (:meth:`freeze_since`, fed by the clock-jump detector) — the
        notice is the last restore when nothing froze since that restore ran AND that
        restore was detected less than :attr:`notice_window` (2 s) before this notice
        (:meth:`notice_since`): a doorbell rung right after the clock-jump detector
        handled the freeze runs nothing; one rung later runs again — the watch may have
        missed a freeze (a guest clock carried over, a freeze shorter than its slack), and
        a clone must never keep its parent's keys. With no
        freeze watch running, with a ``key``, or for ``anchor=False``, it never
        deduplicates by time. A detector that knows better passes its own ``since``.
        ``math.inf`` never deduplicates by time.

        ``undoes``: the notice ends, without a checkpoint of it completing, the first
        before-snapshot pass that began at or after this ``time.monotonic()`` moment — a
        carry-on run (``notify save`` failed or its client went away), or a platform's
        answer that the checkpoint failed (a waiter's descriptor is answered for the first
        checkpoint to end after it was opened). When a newer pass has begun since that one
        (the checkpoint was retried before this notice was handled), nothing runs: the
        resume hooks would undo the newer pass, whose own notice runs them; the notice
        confirms the run that undid its pass, if any. Every run undoes the latest pass
        (its hooks reopen what the pass closed), so when a run already followed that pass
        this notice only confirms it (its reason goes into that report's
        ``confirmed_by``; nothing runs) — with one exception: ``abort="answered"`` (the
        platform says the checkpoint failed: gVisor's ``error``) confirms only a run made
        with ``abort="announced"`` (a carry-on that told the platform to abort, so that
        it is known nothing was paused in between); after any other run — a carry-on that
        expected no checkpoint at all, the snapshot deadline — the hooks run again. With
        no pass after ``undoes``, or one not undone yet, the hooks run (exactly once: a
        later notice for the same pass is then the duplicate).

        A platform's word that the original carried on — a ``resume`` notice (anchored,
        no ``undoes``) or an answer that the checkpoint failed (``abort="answered"``) — is
        about a checkpoint that was over when it arrived (``detected_at``): a
        before-snapshot pass that began after that moment belongs to a later checkpoint
        (a ``trigger_snapshot()`` retried after one timed out, whose checkpoint is still
        pending). Such a notice runs nothing when the latest pass began after it: the
        resume hooks would end that pass and say ready while its checkpoint is pending;
        that pass's own notice runs them. The pass the notice is about (the latest that
        began before it) is settled, and a run that already undid it is confirmed.
        ``older_than``: an earlier moment from which on the notice is known to be about
        no pass (the gVisor waiter's answer that came while a ``trigger_snapshot()`` had
        begun and not yet written its ``1``: that trigger's checkpoint had not started).
        Never for a ``restore`` notice: a clone always runs its restore hooks.
        """
        if kind not in ("restore", "resume"):  # else hooks would run as kind "bogus"
            raise ValueError(f"kind must be 'restore' or 'resume', not {_config.shown(kind)}")
        if abort not in (None, "announced", "answered"):
            raise ValueError(f"abort must be None, 'announced' or 'answered', not "
                             f"{_config.shown(abort)}")
        if deadline is not None:
            deadline = _config.seconds(deadline, "deadline")
        if older_than is not None and (isinstance(older_than, bool)
                                       or not isinstance(older_than, (int, float))
                                       or math.isnan(older_than)):
            raise ValueError(f"older_than must be None or a time.monotonic() moment, not "
                             f"{_config.shown(older_than)}")
        detected = time.monotonic() if detected_at is None else detected_at
        # A platform's word that a checkpoint is over (resume, or failed): about no pass
        # that began after it arrived. Not a restore (a clone always runs its hooks), not
        # a carry-on (it names its own pass) nor a simulated run.
        answer = kind == "resume" and (abort == "answered"
                                       or (anchor and abort is None and undoes is None))
        horizon = (None if not answer else detected if older_than is None
                   else min(detected, older_than))
        self._check_not_inside_hook()
        # Not ready from the moment a notice arrives, also while it waits for a run in
        # progress (which would otherwise end in "ready" with this restore still to run).
        with self._cond:
            self._notices += 1
            if counted is not None:
                counted()
        try:
            if since is None and key is None and anchor:
                # A notice that cannot tell when its freeze was (an outside detector that
                # passes neither since nor key): the freeze watch's word, as for `notify
                # restore` without a save. With since=None it ran the hooks a second time
                # for a freeze the clock-jump detector had handled moments before.
                since = self.notice_since(detected)
            with self._run_lock:
                if key is not None and key in self._seen:
                    log.debug("restore notice %s from %s: already handled", key, reason)
                    seen: RestoreReport = self._seen[key]  # type: ignore[assignment]
                    if seen is self._last_restore_report:
                        return self._confirm(seen, reason, detected)
                    return dataclasses.replace(seen, deduplicated=True)
                latest = self._pass
                handled = self._handled_already(reason, since, detected, answer=answer)
                if handled is not None:
                    return handled
                late = horizon is not None and latest is not None and latest.started > horizon
                if late and horizon is not None:
                    # The latest pass began after this answer arrived: it is a later
                    # checkpoint's (pending), and the resume hooks would end it. The
                    # answer settles the pass it is about.
                    ended = self._answered_pass(horizon, undoes)
                else:
                    ended = None if undoes is None else self._named_pass(undoes, abort)
                if (ended is not None and ended is not latest and abort == "answered"
                        and not late and latest is not None and latest.started <= detected):
                    # Every newer pass began before the answer arrived (gVisor answers as
                    # the checkpoint ends, and a retry can only begin after that): they
                    # are the answered checkpoint's own (a trigger's pass, then its
                    # save-restore-exec pass) or passes no checkpoint followed, not a
                    # retry. The answer is about the latest pass.
                    ended = latest
                if late or (ended is not None and ended is not latest):
                    # About an earlier attempt, and a newer pass has closed things since
                    # (its checkpoint is pending, or was answered on its own): running
                    # the resume hooks now would undo that pass, not this one.
                    if late:
                        self._late_answer = (detected, ended)
                    return self._superseded(ended, reason, settle=late)
                undone = self._undone_already(ended, undoes, abort)
                if undone is not None:
                    if abort == "answered":
                        answered = ended if ended is not None else self._pass
                        if answered is not None:
                            answered.abort_answered = answered.settled = True
                    return self._confirm_carry_on(undone, reason)
                report = self._run_restore(reason, kind, frozen_for, env, detected,
                                           deadline_at=self._deadline_at(detected, deadline))
                if ended is not None and ended.undone_by is report:
                    ended.abort_announced = abort == "announced"
                if self._pass is not None and abort != "announced":
                    # whether or not its hooks started: no answer is owed for it now
                    self._pass.settled = True
                if anchor:
                    self._last_restore_at = detected
                    self._last_restore_report = report
                if key is not None:
                    self._remember(key, report)
        finally:
            with self._cond:
                self._notices -= 1
                self._cond.notify_all()
        self._publish(report)
        _log_run(report)
        return report

    def _handled_already(self, reason: str, since: float | None, detected: float, *,
                         answer: bool) -> RestoreReport | None:
        """The report of a notice whose freeze was handled already (run nothing), else
        None. Under ``_run_lock``."""
        if since is None:
            return None
        last_at, last = self._last_restore_at, self._last_restore_report
        latest = self._pass
        # Judged against the passes that existed when the notice was DETECTED: its freeze
        # came after the latest of them (a clone of that pass's snapshot, or the original
        # resuming from it); a pass begun since (queued on the lock, a retry in a clone)
        # says nothing about it.
        then: _Pass | None = latest
        if latest is not None and detected < latest.started:
            then = next((p for p in reversed(self._passes) if p.started <= detected), None)
            if then is None and len(self._passes) == self._passes.maxlen:
                return None  # older than the history: not known, so run (a clone must)
        snap_then = then.started if then is not None else -math.inf
        # Not the last restore when a before-snapshot pass ran after it: this is a clone of
        # that newer snapshot, however far back the notice's window goes.
        if (last is not None and last_at is not None and last_at > since
                and last_at > snap_then):
            return self._confirm(last, reason, detected)
        late_answer = self._late_answer
        if (not answer and then is not latest and late_answer is not None
                and late_answer[1] is then and since < late_answer[0]):
            # The same freeze as a platform answer about the same pass that came too late
            # to run (the original's resume, after a retried trigger's pass began):
            # running now would end that newer pass while its checkpoint is pending.
            return self._superseded(late_answer[1], reason)
        return None

    def _confirm(self, last: RestoreReport, reason: str, detected: float) -> RestoreReport:
        """A later notice of the restore ``last`` ran for: record it, run nothing.

        Under ``_run_lock``. The stored report gains ``reason`` in ``confirmed_by``; the
        notice gets a copy flagged ``deduplicated``.
        """
        log.info("restore notice from %s is the restore already handled (reason %s)",
                 reason, last.reason)
        confirmed = self._record_confirmation(last, reason)
        with self._cond:
            # Up to this notice only: a freeze noticed after it (a clone made while the
            # run it waited for went on) is not this restore's, and keeps readiness False.
            self._freeze_handled(detected)
        return dataclasses.replace(confirmed, deduplicated=True)

    def pass_started(self, report: SnapshotReport) -> float | None:
        """``time.monotonic()`` when the before-snapshot pass that produced ``report``
        began — the ``undoes=`` of a carry-on about exactly that pass (a moment taken
        before asking for the pass may precede another pass that got the engine first).
        None once the engine no longer keeps that pass (it keeps the last 16)."""
        passes = tuple(self._passes)  # copied at once: a pass may begin meanwhile
        return next((p.started for p in reversed(passes) if p.report is report), None)

    def pass_ended(self, report: SnapshotReport) -> RestoreReport | None:
        """The restore or resume run that ended the before-snapshot pass that produced
        ``report`` (its hooks reopened what the pass closed), None while that pass is
        pending — or once the engine no longer keeps it (it keeps the last 16). Set
        before the run is published: a report listener that hears of the run finds it."""
        passes = tuple(self._passes)  # copied at once: a pass may begin meanwhile
        return next((p.undone_by for p in reversed(passes) if p.report is report), None)

    def _named_pass(self, undoes: float, abort: str | None) -> _Pass | None:
        """The pass a notice with ``undoes`` is about: the first that began at or after
        that moment and can still be owed an answer (a platform answers a waiter's
        descriptor for the first checkpoint to end after it was opened; a later pass
        belongs to a later checkpoint). None when no pass began since. Under
        ``_run_lock``."""
        passes = self._passes
        if not passes or passes[-1].started < undoes:
            return None
        # Only a pass that can still be owed the platform's answer: the latest one or an
        # unsettled one. A settled pass (a failed trigger_snapshot, a hand-run `notify
        # save` + `resume`, a simulated snapshot, an answered abort) is answered by
        # nobody: naming it made a later checkpoint's `error` look superseded, and that
        # checkpoint's pass stayed closed.
        # A carry-on (not a platform's answer) names its own pass, settled or not: its
        # ``undoes`` is the moment just before that pass began.
        return next(p for p in passes if p.started >= undoes and (
            p is passes[-1] or not p.settled or abort != "answered"))

    def _undone_already(self, ended: _Pass | None, undoes: float | None,
                        abort: str | None) -> RestoreReport | None:
        """The run that already undid the pass a notice is about (the notice then only
        confirms it), or None. Under ``_run_lock``."""
        if ended is not None:
            if ended.undone_by is not None and (abort != "answered" or (
                    ended.abort_announced and not ended.abort_answered)):
                return ended.undone_by
            return None
        latest = self._pass
        if (undoes is not None and abort == "answered" and latest is not None
                and latest.abort_announced and not latest.abort_answered):
            # The waiter reopened its descriptor after the latest pass began (it was
            # busy with the previous attempt's answer): the abort that pass's carry-on
            # announced is still unanswered, and this is its answer (it ran the hooks
            # twice). Only save-restore-exec announces aborts, and under it every
            # checkpoint has a pass, so no other checkpoint's answer can be meant.
            return latest.undone_by
        return None

    def _answered_pass(self, horizon: float, undoes: float | None) -> _Pass | None:
        """The pass an answer that arrived at ``horizon`` is about: the latest that began
        by then (and at or after ``undoes``, the answered descriptor's open), if any.
        Under ``_run_lock``."""
        return next((p for p in reversed(self._passes) if p.started <= horizon
                     and (undoes is None or p.started >= undoes)), None)

    def _superseded(self, ended: _Pass | None, reason: str, *,
                    settle: bool = False) -> RestoreReport:
        """A notice for a before-snapshot pass (or a checkpoint without one: ``None``)
        that a newer pass has followed: run nothing (the newer pass's own notice runs the
        hooks). ``settle``: the notice says that pass's checkpoint is over. Under
        ``_run_lock``."""
        log.info("%s notice for an earlier checkpoint than the latest before-snapshot "
                 "pass (begun since; its checkpoint is pending): nothing run for it", reason)
        if ended is None:
            return RestoreReport(ok=True, generation=self._generation, reason=reason,
                                 kind="resume", duration=0.0, hooks=(),
                                 started_at=time.time(), deduplicated=True)
        if settle:
            ended.settled = True
        if ended.undone_by is not None:
            run = self._record_confirmation(ended.undone_by, reason)
            return dataclasses.replace(run, deduplicated=True)
        # That pass was never undone, and the newer pass closed things again: there is no
        # run to point at; an empty report says nothing ran.
        return RestoreReport(ok=True, generation=self._generation, reason=reason,
                             kind="resume", duration=0.0, hooks=(), started_at=time.time(),
                             deduplicated=True)

    def _confirm_carry_on(self, run: RestoreReport, reason: str) -> RestoreReport:
        """A notice for a before-snapshot pass that ``run`` already undid (see ``undoes``
        in :meth:`restore_detected`): record it, run nothing. Under ``_run_lock``.

        Unlike :meth:`_confirm` it marks no freeze handled: nothing froze (a freeze the
        watch noticed meanwhile still gets its own run).
        """
        log.info("%s notice for the before-snapshot pass that the %s run (reason %s) already "
                 "undid: nothing run again", reason, run.kind, run.reason)
        return dataclasses.replace(self._record_confirmation(run, reason), deduplicated=True)

    def _record_confirmation(self, report: RestoreReport, reason: str) -> RestoreReport:
        """``report`` with ``reason`` added to ``confirmed_by``, put wherever the engine
        keeps ``report`` (so ``status()`` and the next duplicate see it). Under
        ``_run_lock``."""
        confirmed = dataclasses.replace(report, confirmed_by=(*report.confirmed_by, reason))
        if self._last_restore_report is report:
            self._last_restore_report = confirmed
        for done in self._passes:
            if done.undone_by is report:
                done.undone_by = confirmed
        with self._cond:
            if self._last_report is report:
                self._last_report = confirmed
        return confirmed

    def _freeze_handled(self, detected: float) -> None:
        """A restore run (or a recognised duplicate) covers a freeze noticed before
        ``detected``. Under ``_cond``."""
        noticed = self._freeze_noticed_at
        if noticed is not None and noticed <= detected:
            self._freeze_noticed_at = None
            self._cond.notify_all()

    def snapshot_requested(
        self, reason: str = "simulated", *, key: str | None = None
    ) -> SnapshotReport:
        """Run the before-snapshot hooks (phases in reverse) and return their report.

        After a successful run the state stays ``snapshotting`` (not ready) until a
        restore or resume run. With :attr:`snapshot_deadline` set, the resume hooks run
        (with a warning) when neither came within that many seconds — the restore hooks
        when the process was frozen or stalled meanwhile. A freeze starts the deadline
        again from its end, a stall postpones it by its length; unless the freeze watch
        confirmed the freeze, by at most one more deadline in all. A notice in flight
        when it passes runs the hooks instead (see :meth:`_deadline_main`).

        The deadline's thread starts before the hooks: when none can start (a pids
        limit), ``RuntimeError`` is raised and no hook runs — the checkpoint is to be
        aborted, the state is unchanged.
        """
        self._check_not_inside_hook()
        with self._run_lock:
            if key is not None and key in self._seen:
                return self._seen[key]  # type: ignore[return-value]
            deadline = self.snapshot_deadline
            # Its thread starts before any hook runs: a start that fails then (the pids
            # limit) refuses the pass with nothing to undo. Started after a successful
            # pass, its failure raised past the hooks' run: no resume hooks, no deadline,
            # ``snapshotting`` for good.
            watch = None
            if deadline is not None:
                try:
                    watch = _DeadlineThread(self._deadline_main)
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"{NO_DEADLINE_THREAD} ({describe_error(exc)}); "
                        "no before-snapshot hook ran: the checkpoint should be "
                        "aborted") from exc
            try:
                report = self._run_snapshot(reason)
                if key is not None:
                    self._remember(key, report)
            except BaseException:
                if watch is not None:
                    watch.cancel()
                raise
            if watch is not None:
                if report.ok:
                    watch.arm(self._event_seq, deadline)  # type: ignore[arg-type]
                else:
                    watch.cancel()
        self._publish(report)
        return report

    def await_answer(self, report: SnapshotReport) -> bool:
        """The resume hooks for the failed before-snapshot pass that produced ``report``
        are left to a checkpoint's answer still due (the gVisor trigger's: a run now would
        say ready while that checkpoint is pending): bound that wait like a successful
        pass's. With :attr:`snapshot_deadline` set, the resume (after a freeze: restore)
        hooks run when neither a restore nor a resume came within that many seconds;
        with it off, the answer is waited for as long as it takes (as after a successful
        pass).

        False when the wait cannot be left to the answer: ``report`` is not the latest
        pass, or a run followed it already — the caller then runs its carry-on (it only
        confirms that run). A failed pass nobody calls this for keeps no watch: it stays
        ``degraded`` until the next run (the caller's carry-on, as before)."""
        self._check_not_inside_hook()
        with self._run_lock:
            latest = self._pass
            if latest is None or latest.report is not report or latest.undone_by is not None:
                return False
            if self.snapshot_deadline is not None:
                try:
                    self._watch_deadline(self._event_seq, self.snapshot_deadline,
                                         failed=True)
                except RuntimeError as exc:  # no thread (the pids limit): nothing to bound it
                    log.warning("snapshot deadline: no thread to watch the failed pass "
                                "(%s); its resume hooks run now", describe_error(exc))
                    return False
        return True

    def _watch_deadline(self, seq: int, deadline: float, *, failed: bool = False) -> None:
        threading.Thread(target=self._deadline_main, args=(seq, deadline, failed),
                         name="rehydrate-snapshot-deadline", daemon=True).start()

    def _deadline_main(self, seq: int, deadline: float, failed: bool = False, *,
                       started: Callable[[], None] | None = None) -> None:
        """Resume hooks when the snapshot ``seq`` saw neither restore nor resume in time.

        ``failed``: the pass failed (state ``degraded``) and its resume hooks were left to
        a checkpoint's answer (:meth:`await_answer`). ``started``: called once the first
        slice has taken its start — from then on a gap is seen.

        Waits on the engine's condition (no polling) in slices of at most 0.5 s. A slice
        that ends more than ``_FROZEN_STEP`` late is a gap, judged by :meth:`_gap_verdict`:

        * a *freeze* the freeze watch noticed (a checkpoint: the restore detectors' run
          ends the watch) starts the deadline again from its end;
        * a *stall* — the process ran meanwhile: the freeze watch's heartbeats saw it run
          through the gap and noticed no freeze, or (no watch) its CPU time advanced by at
          least half the gap beyond what all its CPUs could use in the on-time part, a busy
          call holding the GIL — postpones it by the stall's
          length only;
        * a gap nothing can tell from a freeze (no freeze watch, little CPU used: a
          checkpoint, a job-control stop, a C call sleeping with the GIL held) starts it
          again too, but never past the *bound*.

        The bound: stalls and unconfirmed gaps postpone the deadline by at most one more
        ``deadline`` in all — the time lost inside unconfirmed gaps (possibly frozen) is
        not counted, a stall's is. Before, every gap started the deadline again, and a
        process whose main thread held the GIL for 1.5 s once per deadline never got it:
        ``snapshotting`` (a gated server answering 503) for good. Only freezes the watch
        confirmed go past the bound.

        When the deadline passes while a restore or resume notice is being handled or
        waits for the run lock, the run waits for it; while a freeze the watch noticed
        since the pass is not handled yet, for its notice — at most one ``deadline``
        after the freeze was noticed (a noticed freeze starts the deadline again). Then
        it runs only when no run ended the pass meanwhile (before, the deadline's run
        and then the notice's both ran the hooks); a notice judged a duplicate that ran
        nothing leaves it to the deadline.

        After any gap or noticed freeze the hooks that run are the *restore* hooks: it
        may have been a checkpoint that made this process a clone (a freeze can hide
        inside a stall), and a fresh identity is the safe side.
        """
        start = time.monotonic()
        end = start + deadline
        bound = end + deadline
        freezes_then = self._freezes
        froze = deferred = False
        while True:
            now = time.monotonic()
            if started is not None:
                started()
                started = None
            if now >= end:
                freezes, cpu = self._freezes, time.process_time()
                report = self._deadline_run(seq, deadline, start, failed=failed,
                                            froze=froze or self._freezes != freezes_then,
                                            last_slice=now, deferred=deferred)
                if report is _DEFERRED:
                    deferred = True
                    # The wait for the notice is a slice too: a gap in it (a freeze while
                    # the notice was in flight) must count like one in any other slice.
                    woke = time.monotonic()
                    late = woke - now - 0.5
                    if late > _FROZEN_STEP:
                        verdict = self._gap_verdict(seq, late, cpu, woke,
                                                   freezes=freezes, on_time=0.5)
                        if verdict is None:
                            return
                        froze = True
                        log.debug("snapshot deadline: a %.2fs gap (%s) while it waited for "
                                  "a notice in flight", late, verdict)
                    continue
                if isinstance(report, RestoreReport):
                    self._publish(report)
                    _log_run(report)
                return
            step = min(end - now, 0.5)
            freezes = self._freezes
            cpu = time.process_time()
            with self._cond:
                if self._cond.wait_for(lambda: self._event_seq != seq, step):
                    return
            woke = time.monotonic()
            late = woke - now - step
            if late <= _FROZEN_STEP:
                continue
            verdict = self._gap_verdict(seq, late, cpu, woke, freezes=freezes,
                                       on_time=step)
            if verdict is None:
                return  # a run ended the pass meanwhile
            froze = True
            if verdict == "freeze":
                # A checkpoint: the restore detectors get a whole deadline from its end
                # (their run ends the watch).
                end = time.monotonic() + deadline
                bound = max(bound, end)
            elif verdict == "stall":
                # The process ran: the stall counts towards the bound, and postpones the
                # deadline by its length only (threads that waited for the GIL with a
                # notice get their turn).
                end = min(end + late, bound)
            else:
                # Maybe frozen: the gap itself does not count; a fresh deadline from
                # here, but no further than the bound.
                bound += late
                end = min(time.monotonic() + deadline, bound)
            log.debug("snapshot deadline: a %.2fs gap (%s); the deadline is now in %.2fs",
                      late, verdict, end - time.monotonic())

    def _gap_verdict(self, seq: int, late: float, cpu: float, woke: float, *,
                     freezes: int, on_time: float) -> Literal["freeze", "stall", "unknown"] | None:
        """What a deadline slice that ended ``late`` seconds late (at ``woke``) saw.

        With a freeze watch running, its verdict: ``freeze`` when it noticed one since
        its count was ``freezes``, ``stall`` when a heartbeat read after ``woke`` came
        without one (the watcher judged the gap on its first wake-up after it, before
        that heartbeat). Otherwise — or when no such heartbeat comes within the watch's
        limit — the process CPU time since ``cpu``, less what all its CPUs could have
        used in the ``on_time`` seconds of the wait before the gap: at least half the gap
        is a ``stall``, less is ``unknown``. CPU time does not advance while the process is
        frozen or stopped (nor while a thread sleeps in a C call holding the GIL:
        unknown then); one that went back (a restore that did not carry it over) is no
        stall either. None: a run ended the pass meanwhile.
        """
        with self._cond:
            if self._beat is not None:
                give_up = time.monotonic() + self._beat_limit
                self._verdict_waiters += 1  # heartbeats wake this wait (not ready anyway)
                try:
                    self._cond.wait_for(
                        lambda: (self._event_seq != seq or self._freezes != freezes
                                 or self._beat is None or self._beat >= woke),
                        max(0.0, give_up - time.monotonic()))
                finally:
                    self._verdict_waiters -= 1
                    self._cond.notify_all()
            if self._event_seq != seq:
                return None
            if self._freezes != freezes:
                return "freeze"
            if self._beat is not None and self._beat >= woke:
                return "stall"
        # Only CPU beyond what every core could have used in the on-time part of the
        # wait (``on_time`` seconds) counts: busy threads that do not hold the GIL (zlib,
        # NumPy) otherwise made a job-control stop of a second or two look like a stall.
        used = time.process_time() - cpu - on_time * _cpus()
        return "stall" if used >= _STALL_CPU * late else "unknown"

    def _deadline_run(self, seq: int, deadline: float, start: float, *, failed: bool,
                      froze: bool, last_slice: float,
                      deferred: bool) -> RestoreReport | object | None:
        """The snapshot deadline (armed at ``start``) passed: run the hooks — unless a run
        ended the pass (None), or a notice is in flight or a freeze noticed since
        ``start`` is not handled yet (:data:`_DEFERRED`, after waiting for that for at
        most a slice: the watch calls again)."""
        def in_flight() -> bool:
            # _verdict_waiters: a notice that cannot tell when its freeze was (``notify
            # restore`` without ``save``) waits in freeze_since() for the freeze watch's
            # verdict before it is counted in _notices (at most the watch's limit).
            noticed = self._freeze_noticed_at
            return bool(self._notices or self._verdict_waiters) or (
                noticed is not None and noticed >= start
                and time.monotonic() < noticed + deadline)

        with self._cond:
            if self._event_seq != seq:
                return None
            if in_flight():
                if not deferred:  # once: the wait may last as long as a notice's run
                    log.debug("snapshot deadline: a restore or resume notice is in flight, "
                              "or a freeze was noticed; waiting for it")
                self._cond.wait_for(lambda: self._event_seq != seq or not in_flight(), 0.5)
                return _DEFERRED
        with self._run_lock:
            # No run since the pass (seq): its state is still the pass's own.
            if self._event_seq != seq or self._state not in (
                    ("snapshotting", "degraded") if failed else ("snapshotting",)):
                return None
            with self._cond:
                if in_flight():  # it came while this thread waited for the lock
                    return _DEFERRED
            detected = time.monotonic()
            # Every slice of the watch ended on time: nothing froze, and hooks that act
            # only on a freeze (the game's tick clock) must know it (frozen_for 0). A
            # gap since the last slice (a freeze just now, unnoticed yet): unknown.
            frozen_for = 0.0 if not froze and detected - last_slice <= _FROZEN_STEP else None
            kind: Literal["restore", "resume"] = "restore" if froze else "resume"
            log.warning("no restore or resume within %gs of the before-snapshot hooks%s "
                        "(snapshot_deadline): the platform seems to have given up; running "
                        "the %s hooks", deadline, " (or of a freeze since)" if froze else "",
                        kind)
            return self._run_restore("snapshot-deadline", kind, frozen_for, None,
                                     detected, deadline_at=self._deadline_at(detected, None))

    def simulate_restore(
        self,
        env: Mapping[str, str | None] | None = None,
        reason: str = "simulated",
        kind: Literal["restore", "resume"] = "restore",
        frozen_for: float | None = None,
    ) -> RestoreReport:
        """Run the real engine for a restore, synchronously, and return the report.

        ``env`` is applied like a new spec environment (a ``None`` value removes the key).
        A simulated run is not a freeze anchor: a later real restore notice is never taken
        for it (see ``anchor`` in :meth:`restore_detected`).

        The arguments are checked before any hook runs: ``TypeError`` / ``ValueError``
        (:class:`~rehydrate.env.EnvError` for a bad ``env`` entry) and nothing ran.
        """
        _check_simulated(env, reason, kind, frozen_for)
        return self.restore_detected(reason, kind=kind, env=env, frozen_for=frozen_for,
                                     anchor=False)

    def simulate_snapshot(self, reason: str = "simulated") -> SnapshotReport:
        """Run the real before-snapshot hooks synchronously and return the report."""
        _check_reason(reason)
        return self.snapshot_requested(reason)

    def _remember(self, key: str, report: Report) -> None:
        self._seen[key] = report
        while len(self._seen) > _SEEN_KEYS:
            self._seen.popitem(last=False)

    def _check_not_inside_hook(self) -> None:
        if running_hook_of(self._runner):
            raise RuntimeError(
                "a lifecycle event cannot be started from inside a hook "
                "(it would wait for itself)"
            )
        if self._loop_thread.is_current():
            raise RuntimeError(_ON_HOOK_LOOP.format("a lifecycle event"))

    def hook_loop(self) -> asyncio.AbstractEventLoop:
        """The loop async hooks run on (see :meth:`_loop_for_this_call`), for work
        scheduled there without waiting: no deadlock to avoid, so the application's loop
        even when called on its own thread."""
        loop = self._user_loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            return loop
        return self._loop_thread.get()

    def _loop_for_this_call(
        self,
    ) -> tuple[asyncio.AbstractEventLoop | None, asyncio.AbstractEventLoop | None]:
        """The loop this event's async hooks run on (None: rehydrate's own), and the
        application's loop when it was refused because this call blocks its thread."""
        loop = self._user_loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return None, None
        import asyncio  # already loaded: a user loop exists

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            # Blocking the loop's own thread while waiting for hooks scheduled on it would
            # deadlock; use the private loop for this event instead.
            log.warning("lifecycle event started on the application's event loop thread; "
                        "async hooks run on rehydrate's own loop for this event")
            return None, loop
        return loop, None

    def _run_restore(
        self,
        reason: str,
        kind: Literal["restore", "resume"],
        frozen_for: float | None,
        env: Mapping[str, str | None] | None,
        detected: float,
        *,
        deadline_at: float | None = None,
    ) -> RestoreReport:
        generation = self._generation + 1 if kind == "restore" else self._generation
        if kind == "restore":
            env_module.restored(self.env, self)
        self._event_seq += 1
        ctx = RestoreContext(generation=generation, reason=reason, kind=kind,
                             frozen_for=frozen_for, detected_at=detected,
                             env=dict(env) if env is not None else None,
                             deadline=deadline_at)
        with self._cond:
            self._generation = generation
            self._state = "restoring"
            self._faults = None
            self._run_began = time.monotonic()
            self._run_failed = []
            self._run_recovered = []
            self._cond.notify_all()
        # Logged at INFO only once the run is over (_log_run): a log line is I/O — to a
        # pipe that may be full — and in a restored clone the first one is slow besides
        # (measured under runsc: 3-40 ms); readiness must not wait for either.
        log.debug("%s detected (reason %s, generation %d)", kind, reason, generation)
        results, duration, started, waited, ok, error = self._run_or_degrade("restore", ctx)
        report = RestoreReport(ok=ok, generation=generation, reason=reason, kind=kind,
                               duration=duration, hooks=tuple(results), started_at=started,
                               error=error, env_changes=ctx.env_changes, frozen_for=frozen_for,
                               notice_to_run=waited)
        if self._pass is not None and self._pass.undone_by is None and _reopened(report):
            self._pass.undone_by = report  # its hooks reopened what the pass closed
        with self._cond:
            self._state = "ready" if ok else "degraded"
            if ok:
                self._faults = None
            else:
                faults = _run_faults(results, self._run_failed)
                recovered = self._run_recovered
                mended = sorted(f.name for f in faults if any(f is m for m in recovered))
                faults = [f for f in faults if not any(f is m for m in recovered)]
                if faults:
                    self._faults = faults
                else:  # every failure recovered while later hooks ran
                    self._state = "ready"
                    self._faults = None
                if mended:  # the report says so: the platform's notice answers ready
                    undone = self._pass is not None and self._pass.undone_by is report
                    report = dataclasses.replace(report, recovered=tuple(mended))
                    if undone:
                        self._pass.undone_by = report  # type: ignore[union-attr]
            # With readiness, under the run lock: stored only when published (after the
            # lock), a duplicate notice confirmed in between found an older last report,
            # and the late publish then dropped its confirmation from status() for good;
            # wait_ready() returned with the previous report still the last one.
            self._last_report = report
            self._run_ended = time.monotonic()
            self._freeze_handled(detected)
            self._cond.notify_all()
        if self._observers:
            _notify_observers(tuple(self._observers), "event_finished", ctx, report)
        return report

    def _run_snapshot(self, reason: str) -> SnapshotReport:
        self.env.baseline()  # the environment file as the snapshot will remember it
        self._event_seq += 1
        self._last_snapshot_at = time.monotonic()
        this_pass = self._pass = _Pass(self._last_snapshot_at)
        self._passes.append(this_pass)
        ctx = RestoreContext(generation=self._generation, reason=reason, kind="snapshot",
                             detected_at=time.monotonic())
        self._set_state("snapshotting")
        log.info("preparing for snapshot (reason %s)", reason)
        results, duration, started, waited, ok, error = self._run_or_degrade("snapshot", ctx)
        report = SnapshotReport(ok=ok, generation=self._generation, reason=reason,
                                kind="snapshot", duration=duration, hooks=tuple(results),
                                started_at=started, error=error, notice_to_run=waited)
        this_pass.report = report
        with self._cond:
            self._last_report = report  # under the run lock, as a restore's (_run_restore)
        if not ok:
            self._set_state("degraded")
        if self._observers:
            _notify_observers(tuple(self._observers), "event_finished", ctx, report)
        return report

    def _run_or_degrade(
        self, event: Literal["restore", "snapshot"], ctx: RestoreContext,
    ) -> tuple[list[HookResult], float, float, float, bool, HookFailed | None]:
        """:meth:`_run` and its summary (ok, the errors); when the caller is interrupted
        while waiting (Ctrl-C in a ``simulate_restore()``), or the summary fails, the state
        becomes ``degraded`` — never left ``restoring`` or ``snapshotting`` — and the
        exception propagates."""
        try:
            results, duration, started, waited = self._run(event, ctx)
            ok, error = _summarise(results, ctx.kind)
        except BaseException as exc:
            self._set_state("degraded")
            log.error("%s run interrupted (%s): its hooks did not all finish; state degraded "
                      "until the next successful run", ctx.kind, type(exc).__name__)
            if self._observers:
                # no report, so no event_finished: telemetry's event span stayed open
                _notify_observers(tuple(self._observers), "event_interrupted", ctx, exc)
            raise
        return results, duration, started, waited, ok, error

    def _run(self, event: Literal["restore", "snapshot"],
             ctx: RestoreContext) -> tuple[list[HookResult], float, float, float]:
        """The hooks' results, the run's duration, its wall-clock start and the seconds
        from the notice (``ctx.detected_at``) to that start."""
        hooks = self.hooks(event)
        observers = tuple(self._observers)
        if observers:
            _notify_observers(observers, "event_started", ctx)
        started = time.time()
        waited = max(0.0, time.monotonic() - ctx.detected_at)
        t0 = time.perf_counter()
        loop, refused = self._loop_for_this_call()
        # Recorded for the hooks: work they await on the refused loop (an async close of
        # what was opened there) would wait for this very call to return. So would work
        # awaited on any loop this thread runs, one never given to start() too (an
        # httpx.AsyncClient's pool, used on it, was closed there: 5 s, then a failure).
        with blocking(refused or running_loop()):
            results = self._runner.run(hooks, ctx, loop, observers)
        return results, time.perf_counter() - t0, started, waited

    def _publish(self, report: Report) -> None:
        """Tell the listeners of a run's report (stored for status() by the run itself)."""
        for listener in list(self._listeners):
            try:
                listener(report)
            except Exception:
                log.exception("report listener %r failed", listener)

    # -- detectors -------------------------------------------------------------------

    def start(
        self,
        detectors: str | Iterable[str | Detector] = "auto",
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        extensions: Iterable[str | Extension] = (),
    ) -> list[str]:
        """Start background detection.

        ``extensions``: installed first, as by :meth:`install` (probed; an unusable one is
        skipped with a ``WARNING``, a failing one raises before anything starts; a
        detector among them starts with the others).

        ``detectors``: ``"auto"`` (every detector usable here that is on by default),
        ``"none"``, or keys / :class:`~rehydrate.detect.Detector` instances; detectors
        installed as extensions (:meth:`add_detector`) start too, in place of a selected
        one with the same key, and their keys may be listed (they need no catalogue
        line). ``loop``: run ``async`` hooks on this (the application's)
        event loop. Returns the keys of the detectors now running. The same key string,
        or the same instance, listed more than once starts once, the first listed, with
        one ``WARNING`` (differently configured instances sharing a key each start); a
        ``detectors`` of another type, or an entry that is neither a key nor a
        ``Detector``, is a ``TypeError``.

        A later call while detection runs (a module-level ``rehydrate.start()``, then a
        server adapter's ``detectors=[...]``) checks its keys as the first call does — an
        unknown key is the same ``ValueError``, an unusable one the same ``RuntimeError``,
        before anything starts — and starts the listed detectors that are not running;
        those already running are left as they are. ``"auto"`` (the default) and
        ``"none"`` start nothing more then: ``start()`` stays idempotent. A ``loop``
        given to a later call still becomes the loop async hooks run on.
        """
        from . import detect

        # Before anything is installed or started: a TypeError for start(5), and a key
        # or instance listed twice dropped (with a warning) rather than started twice.
        detectors = detect.requested(detectors)
        # Outside _start_lock: a detector's install() calls add_detector, which takes it.
        self.install(*extensions)
        with self._start_lock:
            if loop is not None:
                self._user_loop = loop
            if self._started:
                return self._start_more(detectors)
            self.env.baseline()
            self._runner.prestart()  # prepared before any snapshot, not in the clone
            installed = self._installed_detectors
            if not isinstance(detectors, str):
                # an installed detector's key names it (it may be in no catalogue)
                detectors = [d for d in detectors if isinstance(d, detect.Detector)
                             or d not in installed]
            chosen = [*installed.values(),
                      *(d for d in detect.select(detectors) if d.key not in installed)]
            self._detectors = []
            self._detector_errors = {}
            for d in chosen:
                self._start_detector(d)
            self._started = True
            for listener in list(self._start_listeners):
                try:
                    listener(self)
                except Exception:
                    log.exception("start listener %r failed", listener)
            running = [d.key for d in self._detectors]
            log.info("rehydrate started; detectors: %s", ", ".join(running) or "none")
            return running

    def _start_more(self, detectors: str | Iterable[str | Detector]) -> list[str]:
        """:meth:`start` while detection runs (under ``_start_lock``): the listed
        detectors that are not running yet. Before, a second call returned the running
        keys and ignored its list — a typo or a server's ``detectors=["signal"]`` after a
        module-level ``start()`` left the process deaf to the restores it was set up for,
        without a word."""
        from . import detect

        items = detect.requested(detectors)
        if isinstance(items, str):  # "auto" or "none"
            return [d.key for d in self._detectors]
        for item in items:  # every key checked before anything starts, as on the first call
            if not isinstance(item, detect.Detector) and item not in self._installed_detectors:
                detect.load(item)
        wanted: list[str | detect.Detector] = []
        ready: list[detect.Detector] = []  # installed ones: the install probed them
        for item in items:
            key = item.key if isinstance(item, detect.Detector) else item
            running = self.detector(key)
            if running is None:
                installed = self._installed_detectors.get(key)
                if installed is not None:
                    ready.append(installed)
                else:
                    wanted.append(item)
            elif running is not item and isinstance(item, detect.Detector):
                log.warning("detector %s already runs; start() left it in place and did not "
                            "start the other instance with that key", key)
        started = []
        for d in [*ready, *detect.select(wanted)]:  # raises for an unusable one, as the first call
            self._start_detector(d)
            if any(running is d for running in self._detectors):
                started.append(d.key)
        running_keys = [d.key for d in self._detectors]
        if started:
            log.info("rehydrate detectors started: %s; running: %s", ", ".join(started),
                     ", ".join(running_keys))
        return running_keys

    def _start_detector(self, d: Detector) -> None:
        """Start ``d`` into :attr:`_detectors`; a failure is loud: a detector that was
        asked for and is missing (a squatted control socket) must show in logs and
        ``status()["detector_errors"]``, not fade away."""
        if any(running is d for running in self._detectors):
            return  # the same instance listed twice (start([d, d])): it runs once
        try:
            _claim(d, self)
            try:
                d.start(self)
            except BaseException:
                _release(d, self)
                raise
        except Exception as exc:
            log.error("detector %s could not start: %s", d.key, exc)
            self._detector_errors[d.key] = str(exc) or type(exc).__name__
            return
        self._detectors.append(d)
        self._detector_errors.pop(d.key, None)  # a later start() that got it going

    def _stop_detector(self, d: Detector) -> None:
        try:
            d.stop()
        except Exception:
            log.exception("detector %s did not stop cleanly", d.key)
        finally:
            _release(d, self)

    def add_detector(self, detector: Detector) -> None:
        """Install ``detector`` (what :meth:`Detector.install
        <rehydrate.detect.Detector.install>` calls): every :meth:`start` starts it — now,
        when this engine runs already, and again in a child of ``fork()`` — its key may
        be listed in ``start([...])``, :meth:`status` lists it and :meth:`stop` stops it.
        It replaces an installed detector with the same key (stopping it when it runs).
        When the extension's ``install()`` raises afterwards, the detector is stopped and
        taken off again (one it replaced is back)."""
        with self._start_lock:
            self._installed_detectors[detector.key] = detector
            old = self.detector(detector.key)
            if not self._started or old is detector:
                return
            elsewhere = _runs_elsewhere(detector, self)
            if elsewhere is not None:  # refused before stopping ours: we keep one running
                log.error("detector %s could not start: %s", detector.key, elsewhere)
                self._detector_errors[detector.key] = elsewhere
                return
            if old is not None:
                self._detectors.remove(old)
            self._start_detector(detector)
        if old is not None:  # outside the lock: its thread may be waiting for it
            self._stop_detector(old)

    def stop(self) -> None:
        """Stop the detectors (hooks stay registered). Idempotent. Refused from inside a
        hook (``RuntimeError``): the detector that started the event waits for it, so
        stopping it there would wait for itself."""
        if running_hook_of(self._runner):
            raise RuntimeError("stop() cannot be called from inside a hook (the detector "
                               "running this event waits for it); call it afterwards")
        with self._start_lock:
            detectors, self._detectors = self._detectors, []
            self._detector_errors = {}
            self._started = False
        for d in detectors:
            self._stop_detector(d)

    def detector(self, key: str) -> Detector | None:
        """The running detector with this key, if any."""
        return next((d for d in self._detectors if d.key == key), None)

    def specific_detectors(self, than: int) -> Sequence[Detector]:
        """Running detectors whose reason is more specific than ``than``."""
        return [d for d in self._detectors if d.specificity > than]

    def close(self) -> None:
        """Stop detectors, close the per-engine extension instances that have ``close()``
        (newest first) and stop the engine's threads (for tests and interpreter exit).
        Refused from inside a hook, like :meth:`stop` (it would close the thread and event
        loop the hook runs on)."""
        if running_hook_of(self._runner):
            raise RuntimeError("close() cannot be called from inside a hook (it would stop "
                               "the thread the hook runs on); call it afterwards")
        self.stop()
        with self._ext_lock:
            instances = list(self._extensions.values())
        for instance in reversed(instances):
            close = getattr(instance, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    log.exception("closing extension %s failed", type(instance).__name__)
        with self._cond:  # ends a snapshot deadline watch
            self._event_seq += 1
            self._cond.notify_all()
        # Let a run in progress finish first (bounded: a hung hook must not hold close()):
        # closed under it, its remaining hooks failed with "hook runner is closed".
        finishing = self._run_lock.acquire(timeout=CLOSE_WAIT)
        if not finishing:
            log.warning("close(): a lifecycle event still runs after %gs; closing under it",
                        CLOSE_WAIT)
        try:
            self._runner.close()
            self._loop_thread.close()
            self._runner = HookRunner(self._loop_thread)
            self._runner.on_failed = self._hook_failed
        finally:
            if finishing:
                self._run_lock.release()


CLOSE_WAIT = 10.0
"""Seconds :meth:`Lifecycle.close` waits for a lifecycle event in progress to finish."""


_ENGINES: weakref.WeakSet[Lifecycle] = weakref.WeakSet()
"""Every engine of this process, reset in the child after ``fork()``."""

_RUNNING_ON: dict[int, tuple[Detector, weakref.ref[Lifecycle]]] = {}
"""``id(detector)`` -> the detector and the engine that started it, while it runs."""
_RUNNING_ON_LOCK = threading.Lock()
fresh_lock_after_fork(sys.modules[__name__], "_RUNNING_ON_LOCK")  # a start() may hold it


def _claim(d: Detector, engine: Lifecycle) -> None:
    """Record that ``engine`` starts ``d``; ``RuntimeError`` when another engine runs it.

    A detector instance reports to the one engine its ``start()`` got: started by a second
    engine, it said "already running" (or nothing) and went on reporting to the first,
    while the second listed it as watching. Refused here, for every detector — the
    built-in ones and any written against the extension contract."""
    with _RUNNING_ON_LOCK:
        elsewhere = _runs_elsewhere(d, engine)
        if elsewhere is not None:
            raise RuntimeError(elsewhere)
        _RUNNING_ON[id(d)] = (d, weakref.ref(engine))


def _runs_elsewhere(d: Detector, engine: Lifecycle) -> str | None:
    """Why ``engine`` cannot start ``d`` (another engine runs it), else ``None``."""
    held = _RUNNING_ON.get(id(d))
    owner = held[1]() if held is not None and held[0] is d else None
    try:
        refuse_another_engine(d, owner, engine)
    except RuntimeError as exc:
        return str(exc)
    return None


def _release(d: Detector, engine: Lifecycle) -> None:
    with _RUNNING_ON_LOCK:
        held = _RUNNING_ON.get(id(d))
        if held is not None and held[0] is d:
            owner = held[1]()
            if owner is None or owner is engine:
                del _RUNNING_ON[id(d)]


def _reset_engines_in_child() -> None:
    # Every engine forgets its detectors in the child (the threads stayed in the parent):
    # so do the claims.
    _RUNNING_ON.clear()
    for engine in list(_ENGINES):
        engine._after_fork_in_child()
    if _ENGINES:
        log.debug("fork(): %d engine(s) reset in child %d", len(_ENGINES), os.getpid())


os.register_at_fork(after_in_child=_reset_engines_in_child)


_FROZEN_STEP = 1.5
"""A wait that ends this much later than asked: the process was frozen or stalled
meanwhile (see :meth:`Lifecycle._deadline_main`)."""

_DEFERRED = object()
"""What the snapshot deadline's run attempt returns when a notice in flight defers it."""

_STALL_CPU = 0.5
"""A gap during which the process used CPU time for at least this fraction of its length
was a stall, not a freeze (a busy thread held the GIL)."""


def _cpus() -> int:
    """CPUs this process may run on (what its threads' CPU time can grow by per second)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _check_reason(reason: object) -> None:
    if not isinstance(reason, str) or not reason:
        raise TypeError(f"reason must be a non-empty str, not {_config.shown(reason)}")


def _check_simulated(env: object, reason: object, kind: object, frozen_for: object) -> None:
    """Reject bad :meth:`Lifecycle.simulate_restore` arguments before any hook runs."""
    if env is not None:
        check_overlay(env)
    _check_reason(reason)
    if kind not in ("restore", "resume"):
        raise ValueError(f"kind must be 'restore' or 'resume', not {_config.shown(kind)}")
    if frozen_for is not None and (
            isinstance(frozen_for, bool) or not isinstance(frozen_for, (int, float))
            or not 0 <= frozen_for < float("inf")):
        raise ValueError(f"frozen_for must be None or a finite number of seconds >= 0, "
                         f"not {_config.shown(frozen_for)}")


def _positive_or_none(value: float, what: str) -> float:
    # At most a year, as the variable: 10**400 (or 1e300) was accepted, and the deadline
    # watch's thread then died of an OverflowError — no resume ever ran.
    return _config.seconds(value, what)


DEFAULT_SNAPSHOT_DEADLINE: float = _config.default("REHYDRATE_SNAPSHOT_DEADLINE")
"""The last resort after a before-snapshot pass when no restore, resume or checkpoint
freeze is ever noticed (``REHYDRATE_SNAPSHOT_DEADLINE``; ``off`` disables it)."""


def _deadline_from_env() -> float | None:
    return _config.optional_number("REHYDRATE_SNAPSHOT_DEADLINE")


def _notify_observers(observers: Sequence[Observer], method: str, *args: Any) -> None:
    """Call the optional per-event observer ``method`` (see ``EventObserver``)."""
    for o in observers:
        fn = getattr(o, method, None)
        if fn is None:
            continue
        try:
            fn(*args)
        except Exception:  # an observer must never break an event
            log.exception("observer %r failed in %s", o, method)


def _add_note(exc: BaseException, note: str) -> None:
    """PEP 678 note; on 3.10 the ``__notes__`` list directly (shown by ``exceptiongroup``)."""
    # Never raises: a hook's exception may carry anything as __notes__ (a tuple makes
    # add_note raise TypeError), and this runs before the state leaves "restoring".
    with contextlib.suppress(Exception):
        notes = getattr(exc, "__notes__", None)
        if isinstance(notes, list) and note in notes:
            return
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        elif isinstance(notes, list):  # pragma: no cover - Python 3.10
            notes.append(note)
        else:  # pragma: no cover - a type refusing new attributes: no note
            exc.__notes__ = [note]  # type: ignore[attr-defined,unused-ignore]


def _reopened(report: RestoreReport) -> bool:
    """Whether ``report``'s run may have reopened what a before-snapshot pass closed: it
    started a hook, or had none to start. A run whose deadline had passed before any hook
    began (each reported ``timeout``, never started), or whose hooks all still ran in
    threads abandoned earlier, did not: a later notice for that pass must run them."""
    runnable = [h for h in report.hooks if h.outcome != "skipped"]
    return not runnable or any(h.attempts > 0 for h in runnable)


def _log_run(report: RestoreReport) -> None:
    """The one INFO line of a restore or resume run, written after readiness changed."""
    frozen = ("" if report.frozen_for is None else ", not frozen" if report.frozen_for == 0
              else f", frozen for {report.frozen_for:.1f}s")
    env = report.env_changes
    shown = env.shown()  # a key of megabytes, or 20,000 keys: a line of megabytes
    changes = (f"; environment refreshed: added={shown['added']} "
               f"changed={shown['changed']} removed={shown['removed']}" if env else "")
    state = ("ready" if report.ok else
             f"ready (recovered while the run went on: {', '.join(report.recovered)})"
             if report.ready else "degraded")
    log.info("%s (reason %s, generation %d%s): hooks ran in %.0f ms, %s%s", report.kind,
             report.reason, report.generation, frozen, report.duration * 1000, state, changes)


def _run_faults(results: Sequence[HookResult], failed: Sequence[_Fault]) -> list[_Fault]:
    """The failures of a run's required hooks: each failed result with the record the
    runner named when it failed (see :meth:`Lifecycle._hook_failed`), or by name alone
    should it not have."""
    pool = list(failed)
    faults = []
    for r in results:
        if r.required and r.outcome in ("failed", "timeout"):
            fault = next((f for f in pool if f.name == r.name), None)
            if fault is None:
                fault = _Fault(r.name, None, builtin=False)
            else:
                pool.remove(fault)
            faults.append(fault)
    return faults


def _summarise(results: Sequence[HookResult], kind: Kind) -> tuple[bool, HookFailed | None]:
    # No log line per failed hook here: the runner wrote it when that hook ended.
    errors = [r.error for r in results if r.error is not None]
    for r in results:
        if r.error is not None:
            _add_note(r.error, f"in hook {r.name!r} ({r.phase})")
    ok = not any(r.required and r.outcome in ("failed", "timeout") for r in results)
    error = HookFailed(f"{len(errors)} {kind} hook(s) failed", errors) if errors else None
    return ok, error




# Users import these from ``rehydrate``: reprs, tracebacks and the API reference say so.
for _public in (Lifecycle, Status):
    _public.__module__ = "rehydrate"
del _public
