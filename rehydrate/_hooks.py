"""Phases, hook records, the registry and its decorators.

This module only *marks and stores* hooks; :mod:`rehydrate._lifecycle` calls them.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar, overload

from . import _config
from ._threads import fresh_lock_after_fork

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_RETRIES",
    "ORDER_LIMIT",
    "Hook",
    "HookFn",
    "Phase",
    "Registry",
    "default_registry",
]

HookFn = Callable[..., Any]
F = TypeVar("F", bound=HookFn)

DEFAULT_TIMEOUT = 30.0
"""Seconds a hook may run before it is reported as ``timeout``."""

ORDER_LIMIT = 1_000_000_000
"""A hook's ``order`` is an int from ``-ORDER_LIMIT`` to ``ORDER_LIMIT`` (the built-in hooks
use up to two million either way, and :data:`BEFORE_USER_HOOKS`). Unbounded,
``order=10**5000`` was accepted and then broke ``repr()`` of the hook and of every report
naming it (past 4300 digits Python refuses to turn an int into text)."""
BEFORE_USER_HOOKS = -ORDER_LIMIT - 1_000_000
"""The order of a built-in hook that runs before every user hook of its phase whatever
their ``order`` (the environment refresh): below the range user hooks may take, which
only ``engine.builtins`` accepts (to ``-2 * ORDER_LIMIT``). At -1 000 000, the refresh ran
after a user hook with ``order=-5_000_000``, which saw the old environment."""
_BUILTIN_ORDER_LIMIT = 2 * ORDER_LIMIT
MAX_RETRIES = 1000
"""The most ``retries`` a hook may have: a run's deadline ends retries anyway, and a run
without one would retry a hook that keeps failing (every 5 s at most) for about 80 minutes
— a larger number is a mistake, not a policy."""

Event = Literal["restore", "snapshot"]


class Phase(enum.IntEnum):
    """Restore phases, in the order they run after a restore (reversed before a snapshot)."""

    ENVIRONMENT = 10
    ENTROPY = 20
    SECRETS = 30
    NETWORK = 40
    CONNECTIONS = 50
    APPLICATION = 60

    def __str__(self) -> str:
        return self.name.lower()


def _as_phase(phase: Phase | str) -> Phase:
    """``phase`` as a :class:`Phase`: a member, its value, or its name in any case
    (``"connections"``, as ``str(Phase.CONNECTIONS)`` spells it)."""
    if isinstance(phase, str):
        try:
            return Phase[phase.strip().upper()]
        except KeyError:
            names = ", ".join(str(p) for p in Phase)
            raise ValueError(f"phase must be a Phase or one of {names}, not "
                             f"{_config.shown(phase)}") from None
    return Phase(phase)


class Hook:
    """One registered hook. Immutable: re-registering creates a new record.

    (A plain slotted class rather than a dataclass: ``import rehydrate`` then needs neither
    :mod:`dataclasses` nor :mod:`inspect`.)
    """

    __slots__ = ("arity", "env_keys", "event", "fn", "is_async", "name", "order", "phase",
                 "required", "retries", "seq", "timeout")

    fn: HookFn
    event: Event
    phase: Phase
    order: int
    timeout: float
    required: bool
    name: str
    retries: int
    seq: int
    """Registration sequence number: breaks ties in ``order`` deterministically."""
    env_keys: tuple[str, ...] | None
    """Set for ``on_env_change`` hooks: the keys watched, names or glob patterns (empty
    tuple: any key)."""
    is_async: bool
    arity: int
    """How many positional arguments the hook takes (0, 1 = context, 2 = context + changes)."""

    _FIELDS = ("fn", "event", "phase", "order", "timeout", "required", "name", "retries",
               "seq", "env_keys", "is_async", "arity")

    def __init__(self, fn: HookFn, event: Event, phase: Phase, order: int, timeout: float,  # noqa: PLR0917
                 required: bool, name: str, retries: int, seq: int,
                 env_keys: tuple[str, ...] | None = None, is_async: bool = False,
                 arity: int = 0) -> None:
        values = (fn, event, phase, order, timeout, required, name, retries, seq, env_keys,
                  is_async, arity)
        for attr, value in zip(self._FIELDS, values, strict=True):
            object.__setattr__(self, attr, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Hook is immutable: cannot assign to {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Hook is immutable: cannot delete {name!r}")

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, attr) for attr in self._FIELDS)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{attr}={getattr(self, attr)!r}" for attr in self._FIELDS)
        return f"Hook({fields})"

    def sort_key(self) -> tuple[int, int, int]:
        return (int(self.phase), self.order, self.seq)


def is_glob(key: str) -> bool:
    """Whether an ``on_env_change`` key is a glob pattern (``DB_*``) rather than a name."""
    return any(c in key for c in "*?[")


_ANY_ARITY = -1
"""``_arity`` of a function taking ``*args``: it gets every argument its kind of hook has."""


def _arity(fn: HookFn) -> int:
    import inspect  # on first registration, not with ``import rehydrate``

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: call with no argument
        return 0
    n = 0
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            n = _ANY_ARITY  # keyword-only parameters may still follow: checked below
        elif (p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
              and p.default is p.empty and n != _ANY_ARITY):
            n += 1
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty:  # hooks get positional ones
            raise TypeError(f"hook {_default_name(fn)} has a required keyword-only "
                            f"parameter {p.name!r}; hooks are called with positional "
                            "arguments only")
    return n


def _is_generator(fn: HookFn) -> bool:
    import inspect

    call = getattr(type(fn), "__call__", None)  # noqa: B004 - a callable object's method
    return any(inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f)
               for f in (fn, call) if f is not None)


def _is_async(fn: HookFn) -> bool:
    import inspect

    target = getattr(fn, "__call__", None)  # noqa: B004 - callable objects with async __call__
    return inspect.iscoroutinefunction(fn) or (
        target is not None and inspect.iscoroutinefunction(target)
    )


def _same_function(registered: object, given: object) -> bool:
    if registered is given:
        return True
    try:
        return bool(registered == given)
    except Exception:  # an __eq__ that fails (or returns an array) matches nothing
        return False


def _default_name(fn: HookFn) -> str:
    while isinstance(fn, functools.partial):  # else every partial is "functools.partial"
        fn = fn.func
    module = getattr(fn, "__module__", None) or ""
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qual}" if module else qual


class Registry:
    """An isolated set of hooks.

    The module-level decorators (``rehydrate.after_restore`` …) use one default registry;
    tests and libraries that want isolation create their own. Registration is thread-safe.
    A run takes a snapshot of the hooks when it starts, so a hook registered while hooks
    are running takes effect from the next event.
    """

    _order_limit = ORDER_LIMIT
    """``order`` may be from ``-_order_limit`` to ``_order_limit``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: dict[int, Hook] = {}
        self._seq = itertools.count()
        self._version = 0
        self._cache: dict[Event, tuple[int, tuple[Hook, ...]]] = {}
        # A parent thread may hold it at fork() (a restore run reading the hooks): the
        # child's next event waited for it for ever.
        fresh_lock_after_fork(self, after=_forget_cached_lists)

    # -- registration --------------------------------------------------------------

    def register(
        self,
        fn: HookFn,
        *,
        event: Event = "restore",
        phase: Phase | str = Phase.APPLICATION,
        order: int = 0,
        timeout: float | None = DEFAULT_TIMEOUT,
        required: bool = True,
        name: str | None = None,
        retries: int = 0,
        env_keys: Iterable[str] | None = None,
    ) -> Hook:
        """Register ``fn`` and return its record (pass it to :meth:`unregister`)."""
        if not callable(fn):
            raise TypeError(f"hook must be callable, got {type(fn).__name__}")
        if _is_generator(fn):
            # calling one only builds a generator: the body would never run
            raise TypeError(f"hook {_default_name(fn)} is a generator function; a hook "
                            "must be a plain or async function")
        if event not in ("restore", "snapshot"):
            raise ValueError(f"event must be 'restore' or 'snapshot', not {_config.shown(event)}")
        phase = _as_phase(phase)
        if timeout is not None and timeout != math.inf:
            # Capped at a year: the runner's thread wait for a longer (finite) timeout
            # overflowed, and every restore run of the engine ended in that error.
            try:
                _config.seconds(timeout, "timeout")
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{exc} (None or math.inf: no limit)") from None
        if not isinstance(required, bool):
            raise TypeError(f"required must be True or False, not {_config.shown(required)}")
        if name is not None and (not isinstance(name, str) or not name.strip()
                                 or not name.isprintable()):
            raise TypeError(f"name must be a non-empty printable str, not {_config.shown(name)}")
        limit = self._order_limit
        for what, value, low, high in (("order", order, -limit, limit),
                                       ("retries", retries, 0, MAX_RETRIES)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{what} must be an int, not {type(value).__name__}")
            if not low <= value <= high:
                raise ValueError(f"{what} must be an int from {low} to {high}, not "
                                 f"{_config.shown(value)}")
        if env_keys is not None:
            if isinstance(env_keys, (str, bytes)):  # else one key per character
                raise TypeError(f"env_keys must be a list of key names, not one "
                                f"{type(env_keys).__name__} (write [{env_keys!r}])")
            env_keys = tuple(env_keys)
            if not all(isinstance(k, str) and k for k in env_keys):
                raise TypeError(f"env_keys must be non-empty str key names, not "
                                f"{_config.shown(env_keys)}")
            if event != "restore":  # a snapshot run changes no environment: always skipped
                raise ValueError("env_keys applies to restore hooks only")
            patterns = [k for k in env_keys if is_glob(k)]
            if patterns:
                import fnmatch

                for pattern in patterns:  # compiled now, before a snapshot, not in a clone
                    fnmatch.fnmatchcase("", pattern)
        arity = _arity(fn)
        max_arity = 2 if env_keys is not None else 1
        if arity == _ANY_ARITY:  # f(*args), a Mock, a generic wrapper
            arity = max_arity
        if arity > max_arity:
            raise TypeError(
                f"hook {_default_name(fn)} takes {arity} required arguments; "
                f"hooks take at most {max_arity} (the RestoreContext"
                + (" and the changes)" if max_arity == 2 else ")")
            )
        with self._lock:
            hook = Hook(
                fn=fn,
                event=event,
                phase=phase,
                order=int(order),
                timeout=float(timeout) if timeout is not None else float("inf"),
                required=bool(required),
                name=name or _default_name(fn),
                retries=int(retries),
                seq=next(self._seq),
                env_keys=tuple(env_keys) if env_keys is not None else None,
                is_async=_is_async(fn),
                arity=arity,
            )
            self._hooks[hook.seq] = hook
            self._version += 1
        return hook

    def unregister(self, hook: Hook | HookFn | str) -> int:
        """Remove hooks by record, function or name. Returns how many were removed."""
        with self._lock:
            if isinstance(hook, Hook):  # this very record: seq numbers restart per registry
                doomed = [hook.seq] if self._hooks.get(hook.seq) is hook else []
            elif isinstance(hook, str):
                doomed = [s for s, h in self._hooks.items() if h.name == hook]
            else:  # == too: ``obj.method`` is a new bound-method object at every access
                doomed = [s for s, h in self._hooks.items() if _same_function(h.fn, hook)]
            for s in doomed:
                del self._hooks[s]
            if doomed:
                self._version += 1
            return len(doomed)

    def clear(self) -> None:
        with self._lock:
            self._hooks.clear()
            self._version += 1

    # -- decorators ----------------------------------------------------------------

    @overload
    def after_restore(self, fn: F, /) -> F: ...
    @overload
    def after_restore(
        self,
        fn: None = None,
        /,
        *,
        phase: Phase | str = ...,
        order: int = ...,
        timeout: float | None = ...,
        required: bool = ...,
        name: str | None = ...,
        retries: int = ...,
    ) -> Callable[[F], F]: ...

    def after_restore(
        self,
        fn: F | None = None,
        /,
        *,
        phase: Phase | str = Phase.APPLICATION,
        order: int = 0,
        timeout: float | None = DEFAULT_TIMEOUT,
        required: bool = True,
        name: str | None = None,
        retries: int = 0,
    ) -> F | Callable[[F], F]:
        """Run the function after a restore (and after a resume of the original process)."""
        return self._decorator(fn, event="restore", phase=phase, order=order, timeout=timeout,
                               required=required, name=name, retries=retries)

    @overload
    def before_snapshot(self, fn: F, /) -> F: ...
    @overload
    def before_snapshot(
        self,
        fn: None = None,
        /,
        *,
        phase: Phase | str = ...,
        order: int = ...,
        timeout: float | None = ...,
        required: bool = ...,
        name: str | None = ...,
        retries: int = ...,
    ) -> Callable[[F], F]: ...

    def before_snapshot(
        self,
        fn: F | None = None,
        /,
        *,
        phase: Phase | str = Phase.APPLICATION,
        order: int = 0,
        timeout: float | None = DEFAULT_TIMEOUT,
        required: bool = True,
        name: str | None = None,
        retries: int = 0,
    ) -> F | Callable[[F], F]:
        """Run the function before a snapshot is taken (phases in reverse order)."""
        return self._decorator(fn, event="snapshot", phase=phase, order=order, timeout=timeout,
                               required=required, name=name, retries=retries)

    def on_env_change(
        self,
        *keys: str | HookFn,
        phase: Phase | str = Phase.ENVIRONMENT,
        order: int = 0,
        timeout: float | None = DEFAULT_TIMEOUT,
        required: bool = True,
        name: str | None = None,
        retries: int = 0,
    ) -> Any:
        """Run the function after a restore when any of ``keys`` changed (no keys: any).

        A key may be a glob pattern (``"DB_*"``; ``*``, ``?`` and ``[...]`` as in
        :func:`fnmatch.fnmatchcase`, case-sensitive, like ``EnvRefresher(protect=...)``).
        The hook receives ``(ctx, changes)`` (or fewer arguments); ``changes`` lists only
        the watched keys that changed. It runs right after the environment refresh unless
        another ``phase`` is given, and is reported ``skipped`` when nothing it watches
        changed.
        """
        options: dict[str, Any] = {"phase": phase, "order": order, "timeout": timeout,
                                   "required": required, "name": name, "retries": retries}
        if len(keys) == 1 and callable(keys[0]):  # bare @on_env_change
            return self._decorator(keys[0], env_keys=(), **options)
        for k in keys:
            if not isinstance(k, str) or not k:
                raise TypeError("on_env_change keys must be non-empty strings")
        names = tuple(k for k in keys if isinstance(k, str))
        return self._decorator(None, env_keys=names, **options)

    def _decorator(self, fn: F | None, /, **options: Any) -> F | Callable[[F], F]:
        """What the decorators return: ``fn`` registered (bare use), or a decorator that
        registers its function with ``options`` (use with arguments)."""

        def deco(f: F) -> F:
            self.register(f, **options)
            return f

        return deco(fn) if fn is not None else deco

    # -- reading -------------------------------------------------------------------

    def hooks(self, event: Event) -> tuple[Hook, ...]:
        """The hooks for ``event`` in the order they run.

        Restore: phases forward, ``order`` ascending, registration order on ties.
        Snapshot: the exact reverse of that.
        """
        if event not in ("restore", "snapshot"):
            # A misspelt event ("after_restore") matched no hook and read as "none
            # registered".
            raise ValueError(f"event must be 'restore' or 'snapshot', not {_config.shown(event)}")
        with self._lock:
            cached = self._cache.get(event)
            if cached is not None and cached[0] == self._version:
                return cached[1]
            selected = sorted(
                (h for h in self._hooks.values() if h.event == event), key=Hook.sort_key
            )
            if event == "snapshot":
                selected.reverse()
            result = tuple(selected)
            self._cache[event] = (self._version, result)
            return result

    @property
    def version(self) -> int:
        """Changes whenever a hook is added or removed."""
        return self._version

    def __len__(self) -> int:
        with self._lock:
            return len(self._hooks)

    def __contains__(self, hook: object) -> bool:
        """Whether this very :class:`Hook` record is registered here (not an equal one:
        sequence numbers restart per registry)."""
        if not isinstance(hook, Hook):
            return False
        with self._lock:
            return self._hooks.get(hook.seq) is hook

    def __repr__(self) -> str:
        return f"<rehydrate.Registry hooks={len(self)}>"


def _forget_cached_lists(registry: Registry) -> None:
    # In a child of fork(), whose registry lock is a new one: the parent thread that held
    # it may have stopped between adding a hook and bumping the version, so the cached
    # lists are dropped and rebuilt from the hooks.
    registry._cache = {}


class _BuiltinRegistry(Registry):
    """``engine.builtins``: also takes orders past ``±ORDER_LIMIT``, for built-in hooks
    that must run before (or after) every user hook of their phase."""

    _order_limit = _BUILTIN_ORDER_LIMIT


default_registry = Registry()
"""The registry of the module-level decorators (``rehydrate.after_restore`` …), run by
``rehydrate.default_engine``."""


# Users import these from ``rehydrate``: reprs, tracebacks and the API reference say so.
for _public in (Hook, Phase, Registry):
    _public.__module__ = "rehydrate"
del _public
