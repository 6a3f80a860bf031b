"""The built-in ``ENTROPY`` phase: reseed pseudo-random generators, renew the instance ID.

A restored clone starts with its parent's memory, hence with the parent's PRNG states:
without this phase every clone draws the same "random" numbers. On every restore (and
resume) the engine's ``rehydrate.entropy`` hook, installed in every
:class:`~rehydrate.Lifecycle` by default:

* reseeds the :mod:`random` module's global generator from ``os.urandom``, and every
  ``random.Random`` instance registered with :func:`register`;
* reseeds NumPy's legacy global ``RandomState`` and registered ``numpy.random.Generator``
  / ``RandomState`` objects — only when NumPy is already imported (never imported here);
  a ``Generator`` gets a fresh seed sequence too (NumPy >= 2.0), so its ``spawn()``
  children differ between clones;
* reseeds torch's CPU generator (and every CUDA device's, when CUDA is initialised) and
  registered ``torch.Generator`` objects — only when torch is already imported;
* resets :mod:`tempfile`'s candidate-name sequence, which re-seeds itself only when the
  PID changes (a restored process keeps its PID);
* mixes fresh kernel entropy into the :mod:`ssl` module's OpenSSL generator
  (``ssl.RAND_add``) when :mod:`ssl` is imported;
* regenerates :func:`instance_id`.

A child of ``os.fork()`` gets a new :func:`instance_id` too (a forked worker is another
process); the generators need nothing there (CPython reseeds :mod:`random` in the child).

``REHYDRATE_DISABLE=entropy`` (or :attr:`EntropyManager.enabled` = False) turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._disable import is_disabled
from ._hooks import Phase
from ._threads import fresh_lock_after_fork
from .extensions import Probe, resolve_engine

if TYPE_CHECKING:
    from .extensions import Engine

__all__ = [
    "EntropyManager",
    "instance_id",
    "manager",
    "on_instance_id_change",
    "register",
    "reseed",
    "unregister",
]

log = logging.getLogger("rehydrate")

_id_lock = threading.Lock()
# a parent thread may hold it at fork() (a restore run renewing the ID, in os.urandom)
fresh_lock_after_fork(sys.modules[__name__], "_id_lock")
_instance_id = str(uuid.uuid4())
_id_listeners: list[Callable[[str], None]] = []


def instance_id() -> str:
    """This process's instance ID: a UUIDv4, regenerated on every restore (not on resume)
    and in the child of every ``os.fork()``.

    Use it for OpenTelemetry's ``service.instance.id``, log fields, lease owners … — any
    identifier that must differ between clones of one snapshot.

    Process-wide, like the global generators: every engine's restore run renews it (also
    an isolated engine's ``simulate_restore()``), and every engine reports the same value.
    """
    return _instance_id


def on_instance_id_change(fn: Callable[[str], None]) -> Callable[[str], None]:
    """Call ``fn(new_id)`` whenever :func:`instance_id` changes (usable as a decorator).

    After ``os.fork()`` the child calls it from its fork handler, in the thread that
    forked: only that thread exists there, so ``fn`` must not wait for a lock another
    thread of the parent may have held (as in any ``os.register_at_fork`` handler)."""
    _id_listeners.append(fn)
    return fn


def _renew_instance_id() -> str:
    global _instance_id
    with _id_lock:
        _instance_id = str(uuid.uuid4())  # uuid4 reads os.urandom: fresh in every clone
        new = _instance_id
    _notify(new)
    return new


def _notify(new: str) -> None:
    for fn in list(_id_listeners):
        try:
            fn(new)
        except Exception:
            log.exception("instance_id listener %r failed", fn)


def _after_fork_in_child() -> None:
    global _instance_id
    # The child is another process: it gets its own ID (os.urandom, one syscall) — pool
    # workers reported the parent's as service.instance.id. (Its locks are new already:
    # fresh_lock_after_fork's handler was registered before this one.)
    if is_disabled("entropy"):  # the kill switch keeps the ID, as on restore
        return
    _instance_id = str(uuid.uuid4())
    _notify(_instance_id)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _seed_bytes(n: int = 32) -> bytes:
    return os.urandom(n)


def _seed_int(bits: int) -> int:
    return int.from_bytes(os.urandom((bits + 7) // 8), "big") & ((1 << bits) - 1)


_strong_logged: set[str] = set()
"""Type names already reported as held strongly (log once per type)."""


class _Ref:
    """A weak reference when the object allows one, a strong one otherwise.

    ``random.Random`` and ``torch.Generator`` allow weak references; NumPy's ``Generator``,
    ``RandomState`` and bit generators do not (Cython types without ``__weakref__``), so
    they are held strongly."""

    __slots__ = ("_obj", "_weak")

    def __init__(self, obj: object, strong: bool = False) -> None:
        self._weak: weakref.ref[Any] | None = None
        self._obj: object | None = obj
        if not strong:
            with contextlib.suppress(TypeError):  # no weakref support: keep it strongly
                self._weak, self._obj = weakref.ref(obj), None

    def get(self) -> Any:
        return self._weak() if self._weak is not None else self._obj

    @property
    def weak(self) -> bool:
        return self._weak is not None


def _kind(obj: object) -> str:
    if isinstance(obj, random.Random):
        return "random"
    mod = type(obj).__module__ or ""
    name = type(obj).__name__
    if mod.startswith("numpy"):
        if name == "Generator":
            return "numpy-generator"
        if name == "RandomState":
            return "numpy-randomstate"
    if mod.startswith("torch") and name == "Generator":
        return "torch-generator"
    if callable(obj):
        return "callable"
    raise TypeError(
        f"cannot reseed {type(obj).__name__}: register a random.Random, "
        "numpy.random.Generator/RandomState, torch.Generator or a callable taking seed bytes"
    )


def _reseed_object(kind: str, obj: Any) -> None:
    if kind == "random":
        obj.seed(_seed_bytes())
    elif kind == "numpy-generator":
        np = sys.modules["numpy"]
        bg = obj.bit_generator
        fresh = type(bg)(np.random.SeedSequence(_seed_int(128)))
        if isinstance(bg.__getstate__(), tuple):
            # NumPy >= 2.0 pickles (state, seed sequence) and takes both back: the seed
            # sequence too, which spawn() derives children from — kept, every clone's
            # gen.spawn() gave the parent's children.
            bg.__setstate__((fresh.state, fresh.seed_seq))
        else:
            bg.state = fresh.state
            if hasattr(bg, "spawn"):
                _warn_spawn_kept(np)
    elif kind == "numpy-randomstate":
        # seed() accepts only MT19937; a RandomState may wrap any bit generator, whose
        # kind is kept: a fresh one of the same kind lends its state (set_state takes it).
        np = sys.modules["numpy"]
        name = obj.get_state(legacy=False)["bit_generator"]
        bit_generator = getattr(np.random, name, None)
        if bit_generator is None:
            raise TypeError(f"cannot reseed a RandomState over {name}: not a numpy.random "
                            "bit generator; register a callable that reseeds it")
        obj.set_state(bit_generator(np.random.SeedSequence(_seed_int(128))).state)
    elif kind == "torch-generator":
        obj.manual_seed(_seed_int(63))
    else:  # callable
        obj(_seed_bytes())


_spawn_warned = False


def _warn_spawn_kept(np: Any) -> None:
    """Once per process: NumPy 1.25/1.26 have ``spawn()`` but no way to replace a bit
    generator's seed sequence (read-only, and not part of its pickled state)."""
    global _spawn_warned
    if not _spawn_warned:
        _spawn_warned = True
        log.warning("entropy: numpy %s cannot reseed a registered Generator's seed "
                    "sequence; its spawn() children repeat in every clone (numpy >= 2.0 "
                    "reseeds them)", getattr(np, "__version__", "?"))


class EntropyManager:
    """Per-engine reseeding. Created for every engine; see :func:`manager`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.enabled = True
        """False turns the whole phase into a no-op (as ``REHYDRATE_DISABLE=entropy``)."""
        self._lock = threading.Lock()
        # a parent thread may hold it at fork(): the child's entropy hook timed out
        fresh_lock_after_fork(self)
        self._objects: dict[object, tuple[str, _Ref]] = {}
        """Keyed by id() for generators, by the callable itself (bound methods compare
        equal) for callables."""
        self.last: list[str] = []
        """What the last run reseeded (names), for status and tests."""
        engine.builtins.register(self._on_restore, phase=Phase.ENTROPY, order=-1_000_000,
                                 name="rehydrate.entropy", timeout=10.0)
        engine.add_status("entropy", lambda: {"enabled": self.active, "reseeded": self.last,
                                              "instance_id": instance_id()})

    @property
    def active(self) -> bool:
        return self.enabled and not is_disabled("entropy")

    def register(self, obj: object) -> object:
        """Reseed ``obj`` on every restore. Returns ``obj``.

        Accepted: ``random.Random`` (and subclasses), ``numpy.random.Generator``,
        ``numpy.random.RandomState``, ``torch.Generator``, or any callable taking 32 seed
        bytes. ``random.Random`` and ``torch.Generator`` objects are held weakly (dropping
        them unregisters them); NumPy generators do not support weak references and, like
        callables, are held strongly until :meth:`unregister` (one debug line says so).
        """
        kind = _kind(obj)
        ref = _Ref(obj, strong=kind == "callable")
        if kind != "callable" and not ref.weak:
            name = f"{type(obj).__module__}.{type(obj).__qualname__}"
            if name not in _strong_logged:
                _strong_logged.add(name)
                log.debug("entropy: %s objects do not support weak references; registered "
                          "ones are held strongly until unregister()", name)
        key: object = id(obj)
        if kind == "callable":  # by equality where it can be (bound methods), else by id
            with contextlib.suppress(TypeError):
                key = (hash(obj), obj)[1]
        with self._lock:
            self._objects[key] = (kind, ref)
        return obj

    def unregister(self, obj: object) -> None:
        with self._lock:
            self._objects.pop(id(obj), None)
            with contextlib.suppress(TypeError):  # unhashable: was keyed by id()
                self._objects.pop(obj, None)

    def _on_restore(self, ctx: Any) -> None:
        if not self.active:
            log.info("entropy phase disabled: generators NOT reseeded")
            self.last = []
            return
        done = reseed_globals()
        if ctx is None or getattr(ctx, "kind", "restore") == "restore":
            _renew_instance_id()
            done.append("instance_id")
        errors: list[BaseException] = []
        with self._lock:
            items = list(self._objects.items())
        for key, (kind, ref) in items:
            obj = ref.get()
            if obj is None:
                with self._lock:
                    self._objects.pop(key, None)
                continue
            try:
                _reseed_object(kind, obj)
            except Exception as exc:
                errors.append(exc)
            else:
                done.append(kind)
        self.last = done
        if errors:
            raise RuntimeError(
                f"{len(errors)} registered generator(s) could not be reseeded: "
                + "; ".join(f"{type(e).__name__}: {e}" for e in errors)
            )

    def reseed(self) -> list[str]:
        """Reseed now (what the restore hook does, without renewing the instance ID)."""
        class _Resume:
            kind = "resume"
        self._on_restore(_Resume())
        return list(self.last)


def reseed_globals() -> list[str]:
    """Reseed the process-wide generators this module knows about. Returns their names."""
    done = []
    random.seed(_seed_bytes())
    done.append("random")
    tf = sys.modules.get("tempfile")
    if tf is not None and hasattr(tf, "_name_sequence"):
        # _RandomNameSequence re-seeds only when os.getpid() changes; dropping it makes the
        # next mkstemp/mkdtemp build a fresh one seeded from os.urandom.
        with getattr(tf, "_once_lock", threading.Lock()):
            tf._name_sequence = None  # type: ignore[attr-defined]
        done.append("tempfile")
    ssl = sys.modules.get("ssl")
    if ssl is not None and hasattr(ssl, "RAND_add"):
        ssl.RAND_add(_seed_bytes(), 32.0)
        done.append("ssl")
    np = sys.modules.get("numpy")
    if np is not None and hasattr(np, "random"):
        try:
            np.random.seed(np.frombuffer(_seed_bytes(32), dtype=np.uint32))
            done.append("numpy")
        except Exception as exc:  # a half-imported or unusual numpy must not break restore
            log.warning("numpy global generator not reseeded: %s", exc)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "random"):
        try:
            torch.random.default_generator.manual_seed(_seed_int(63))
            done.append("torch")
            cuda = getattr(torch, "cuda", None)
            if cuda is not None and cuda.is_initialized():
                for i in range(cuda.device_count()):
                    cuda.default_generators[i].manual_seed(_seed_int(63))
                done.append("torch.cuda")
        except Exception as exc:
            log.warning("torch generators not reseeded: %s", exc)
    return done


def manager(engine: Engine | None = None) -> EntropyManager:
    """The entropy manager of ``engine`` (default: the process-wide engine)."""
    return resolve_engine(engine).extension("entropy", EntropyManager)


def register(obj: object, *, engine: Engine | None = None) -> object:
    """Reseed ``obj`` (a generator or a callable) on every restore; see
    :meth:`EntropyManager.register`."""
    return manager(engine).register(obj)


def unregister(obj: object, *, engine: Engine | None = None) -> None:
    """Stop reseeding ``obj``."""
    manager(engine).unregister(obj)


def reseed(*, engine: Engine | None = None) -> list[str]:
    """Reseed every known generator now."""
    return manager(engine).reseed()


key = "entropy"


def probe() -> Probe:
    """Always usable: generators that are not imported are simply not reseeded."""
    return Probe(True)


def install(engine: Engine) -> None:
    """Attach the ``rehydrate.entropy`` hook (every engine has it by default)."""
    manager(engine)
