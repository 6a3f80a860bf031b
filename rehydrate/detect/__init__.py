"""Event sources: each module notices one kind of snapshot/restore event.

Every detector is an extension (:class:`~rehydrate.extensions.Extension`): a ``key`` (its
catalogue key, also the ``reason`` of the restores it reports), a class-level
:meth:`~Detector.probe` returning a :class:`~rehydrate.extensions.Probe` (can it work
here, and if not, why not), and ``install(engine)``, which hands it to the engine
(started by the engine's ``start()``, listed in ``status()``, stopped by ``stop()``).
The engine drives it with ``start(engine)`` / ``stop()``.

:data:`DETECTORS` lists the built-in ones as dotted names, imported only when used, so
``import rehydrate`` stays light. ``start(detectors="auto")`` picks every detector whose
probe succeeds and that is on by default; ``rehydrate doctor`` prints every probe. A
detector outside rehydrate is enabled by instance (``start(extensions=[...])``,
``start(detectors=[...])``): ``"auto"`` and ``doctor`` know only :data:`DETECTORS` (no
entry-point group).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import types
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .._contract import Probe

if TYPE_CHECKING:
    from ..extensions import Engine

__all__ = ["DETECTORS", "Detector", "DetectorInfo", "available", "catalogue_keys", "key_of", "load",
           "probe_of", "select"]


class _DeprecatedName:
    """``Detector.name``: the former spelling of :attr:`Detector.key`."""

    def __get__(self, obj: object, owner: type[Detector]) -> str:
        warnings.warn("Detector.name is deprecated; use Detector.key", DeprecationWarning,
                      stacklevel=2)
        return owner.key


class Detector:
    """Base class of event sources; every detector is an extension.

    ``specificity`` ranks reasons when two detectors see the same restore: the generic
    ones (clock jump, identity change) defer briefly to a more specific running detector
    so that the report carries the most specific reason.

    A subclass sets :attr:`key`, overrides :meth:`probe` (a classmethod: it is asked
    before any instance exists), :meth:`start` and :meth:`stop`.
    """

    key: ClassVar[str] = "detector"
    """The catalogue key: ``start(["<key>"])``, ``status()["detectors"]``, the reason of
    the restores it reports, and the module name (``-`` as ``_``)."""
    specificity: ClassVar[int] = 0
    auto: ClassVar[bool] = True
    """Started by ``start(detectors="auto")`` when usable."""

    name: ClassVar[Any] = _DeprecatedName()
    """Deprecated spelling of :attr:`key` (a ``DeprecationWarning`` when read)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if isinstance(own.get("name"), str) and "key" not in own:
            # a detector written against the former interface: `name = "mine"`
            warnings.warn(f"{cls.__qualname__}: name the detector with `key`, not `name` "
                          "(deprecated)", DeprecationWarning, stacklevel=2)
            cls.key = own["name"]
            cls.name = _DeprecatedName()

    @classmethod
    def probe(cls) -> Probe:
        """Whether this detector can work here; when not, ``reason`` says why in one line."""
        return Probe(True)

    def probe_instance(self) -> Probe:
        """Whether this instance can work here: :meth:`probe` unless the instance was
        configured otherwise (a detector given its own path probes that path).
        ``start(detectors=[instance])`` and ``start(extensions=[instance])`` ask this, as
        they ask :meth:`probe` for a key. It calls ``self.probe()``, so a ``probe`` written
        as an instance method (the :class:`~rehydrate.extensions.Extension` protocol's
        shape) works for an instance; only a key (``start("auto")``, ``rehydrate
        doctor``) needs the classmethod."""
        return _as_probe(self.probe(), type(self))

    @classmethod
    def auto_here(cls) -> str | None:
        """``None`` when ``start("auto")`` starts this detector here (if usable), else why not.

        Defaults to :attr:`auto`; a detector may decide from its configuration (the control
        socket starts automatically only when ``REHYDRATE_CONTROL_SOCKET`` is set).
        """
        return None if cls.auto else "off unless asked for"

    @classmethod
    def configured(cls) -> bool:
        """True when the user configured this detector explicitly (e.g. its environment
        variable is set): ``start("auto")`` then starts it even when :meth:`probe` says it
        cannot work, so that the failure is loud (an ERROR line and
        ``status()["detector_errors"]``), not a detector that silently is not there."""
        return False

    def install(self, engine: Engine) -> None:
        """Hand this detector to ``engine`` (the extension contract): every
        ``engine.start()`` starts it — at once when the engine runs already — whatever
        ``detectors=`` selects, ``status()`` lists it and ``engine.stop()`` stops it."""
        engine.add_detector(self)

    def start(self, engine: Engine) -> None:
        """Begin watching; report events with ``engine.restore_detected()`` /
        ``engine.snapshot_requested()`` — a restore with ``since=`` (when this detector
        last saw the process before the freeze) or ``key=``, so that a restore another
        detector noticed too runs once (without either, the engine asks its freeze
        watch). Called by the engine; raise when it cannot start. In a child of
        ``fork()`` an installed instance is started again (its threads stayed in the
        parent). An instance serves one engine at a time: the engines refuse to start one that
        another engine runs (so a detector need not check that itself). The built-in
        detectors refuse it too when started directly, outside an engine (the same
        ``RuntimeError`` line)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop watching (idempotent). Called by the engine."""
        raise NotImplementedError

    def forget_in_child(self) -> None:
        """In a child of ``fork()``, for a detector the parent had started: the engine
        forgets it without stopping it (its threads stayed in the parent, and stopping
        could touch what the parent still uses: a socket file, inotify watches, the
        other end of a stop pipe). Close this process's copies of its descriptors here,
        and nothing of the parent's; they stayed open for the child's whole life. Runs
        in an at-fork handler: no waiting. The default does nothing."""

    def failure(self) -> str | None:
        """Why this started detector no longer watches (its thread died), else ``None``.
        ``status()["detector_errors"]`` shows it: a detector that stopped must not look
        as if it still watched."""
        return None

    def describe(self) -> str:
        """One line for ``rehydrate doctor`` about how this detector works here."""
        return (self.__doc__ or "").strip().splitlines()[0] if self.__doc__ else ""


DETECTORS: list[str] = [
    "rehydrate.detect.gvisor:GVisorDetector",
    "rehydrate.detect.control:ControlDetector",
    "rehydrate.detect.snapstart:SnapStartDetector",
    "rehydrate.detect.vmclock:VmClockDetector",
    "rehydrate.detect.file:FileDetector",
    "rehydrate.detect.signal:SignalDetector",
    "rehydrate.detect.clock_jump:ClockJumpDetector",
    "rehydrate.detect.identity:IdentityDetector",
]
"""The known detectors as dotted names (``"package.module:Class"``), imported only when
used; the order is that of ``rehydrate doctor``. A detector's key is its module's name
with ``_`` as ``-`` (:func:`key_of`). Adding a detector is one module and one line here."""


def key_of(spec: str) -> str:
    """The catalogue key of a :data:`DETECTORS` entry, without importing it:
    ``"rehydrate.detect.clock_jump:ClockJumpDetector"`` → ``"clock-jump"``."""
    return spec.partition(":")[0].rpartition(".")[2].replace("_", "-")


def catalogue_keys() -> list[str]:
    """The catalogue keys of :data:`DETECTORS`, in order."""
    return [key_of(spec) for spec in DETECTORS]


def __getattr__(name: str) -> Any:
    if name == "CATALOGUE":  # the former key -> "module:Class" dict
        warnings.warn("rehydrate.detect.CATALOGUE is deprecated; use rehydrate.detect.DETECTORS "
                      "(dotted names) and rehydrate.detect.catalogue_keys()", DeprecationWarning,
                      stacklevel=2)
        return types.MappingProxyType({key_of(spec): spec for spec in DETECTORS})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class DetectorInfo:
    """One row of ``rehydrate doctor``: whether a detector works here and why (not)."""

    name: str
    usable: bool
    auto: bool
    reason: str
    description: str

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (``rehydrate doctor --json``)."""
        return {"name": self.name, "usable": self.usable, "auto": self.auto,
                "reason": self.reason, "description": self.description}


def load(key: str) -> type[Detector]:
    """The detector class for catalogue key ``key`` (imported now); ``ValueError`` names
    the known keys for an unknown one."""
    spec = next((s for s in DETECTORS if key_of(s) == key), None)
    if spec is None:
        known = ", ".join(catalogue_keys()) or "none"
        from .._config import shown

        raise ValueError(f"unknown detector {shown(key)} (known: {known})")
    module, _, attr = spec.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Detector)) or cls.key != key:
        raise TypeError(f"{spec} is not a Detector with key {key!r} (a DETECTORS entry's "
                        "key is its module's name, '_' as '-'; a detector of another key "
                        "is passed to start(detectors=[...]) or start(extensions=[...]))")
    return cls


def probe_of(cls: type[Detector]) -> Probe:
    """``cls.probe()`` as a :class:`~rehydrate.extensions.Probe`; a detector written
    against the former interface (a reason string, or ``None`` when usable) still works,
    with a ``DeprecationWarning``. A ``probe`` written as an instance method is a
    ``TypeError`` saying so: a class is probed before any instance exists."""
    if isinstance(inspect.getattr_static(cls, "probe", None), types.FunctionType):
        raise TypeError(f"{cls.__qualname__}.probe() must be a classmethod to probe the "
                        "class (start(\"auto\"), rehydrate doctor, a key in start([...])): "
                        "add @classmethod, or pass an instance (start(detectors=[...]) or "
                        "start(extensions=[...]) ask the instance)")
    return _as_probe(cls.probe(), cls)


def _as_probe(found: object, cls: type[Detector]) -> Probe:
    """A probe's answer as a :class:`~rehydrate.extensions.Probe` (see :func:`probe_of`)."""
    if isinstance(found, Probe):
        return found
    if found is None or isinstance(found, str):
        warnings.warn(f"{cls.__qualname__}.probe() must return a rehydrate.extensions.Probe, "
                      "not a reason string or None (deprecated)", DeprecationWarning,
                      stacklevel=3)
        return Probe(found is None, found or "")
    raise TypeError(f"{cls.__qualname__}.probe() returned {type(found).__name__}, not a Probe")


def available() -> list[DetectorInfo]:
    """Every known detector, whether it works here and why (not)."""
    infos = []
    for key in catalogue_keys():
        try:
            cls = load(key)
            found = probe_of(cls)
        except Exception as exc:  # a broken probe must not break doctor
            infos.append(DetectorInfo(key, False, False, f"probe failed: {exc}", ""))
            continue
        doc = (cls.__doc__ or "").strip().splitlines()
        off = cls.auto_here()
        if found.usable:
            reason = "; ".join(r for r in ("usable", found.reason, off) if r)
        else:
            reason = found.reason or "not usable here"
        infos.append(DetectorInfo(
            name=key,
            usable=found.usable,
            auto=off is None,
            reason=reason,
            description=doc[0] if doc else "",
        ))
    return infos


def requested(spec: object) -> str | list[str | Detector]:
    """``start(detectors=spec)`` checked and put in one shape: ``"auto"``, ``"none"``, or
    the listed keys and :class:`Detector` instances (a ``str`` is split at commas). A
    true repeat — the same key string again, or the same instance object again — is
    dropped with one ``WARNING`` (the first listed wins): started twice, a detector raced
    itself for its resource (the control socket refused its own process) or restored the
    wrong signal handler on ``stop()``. Differently configured instances sharing a key
    (``SignalDetector("SIGUSR1")`` and ``SignalDetector("SIGUSR2")``, two control
    sockets) each start, as does a key next to an instance with that key: they watch
    different things (a second signal detector for a signal already watched then fails
    to start, a detector error naming the signal). Anything else is a ``TypeError``
    naming ``detectors`` (``start(5)`` said only "'int' object is not iterable")."""
    if isinstance(spec, str) and spec in ("auto", "none"):
        return spec
    if isinstance(spec, str):
        items: list[object] = [s.strip() for s in spec.split(",") if s.strip()]
    elif isinstance(spec, Iterable) and not isinstance(spec, (bytes, bytearray)):
        items = list(spec)
    else:
        raise TypeError("detectors must be 'auto', 'none', detector keys (a str, comma-"
                        "separated, or an iterable) or Detector instances, not "
                        f"{type(spec).__name__}")
    kept: list[str | Detector] = []
    repeated: list[str] = []
    for item in items:
        if isinstance(item, Detector):
            key = item.key
            again = any(k is item for k in kept)
        elif isinstance(item, str):
            key = item
            again = any(isinstance(k, str) and k == item for k in kept)
        else:
            from .._config import shown

            raise TypeError("detectors: each entry must be a detector key (str) or a "
                            f"Detector instance, not {type(item).__name__} ({shown(item)})")
        if not again:
            kept.append(item)
        elif key not in repeated:
            repeated.append(key)
    if repeated:
        logging.getLogger("rehydrate").warning(
            "detectors: %s listed more than once; each starts once (the first listed)",
            ", ".join(repeated))
    return kept


def select(spec: str | Iterable[str | Detector]) -> list[Detector]:
    """Detectors to start for ``start(detectors=spec)`` (checked by :func:`requested`:
    a key string or instance listed again dropped)."""
    spec = requested(spec)
    if spec == "auto":
        chosen: list[Detector] = []
        for key in catalogue_keys():
            try:
                cls = load(key)
                if cls.auto_here() is None and (probe_of(cls).usable or cls.configured()):
                    chosen.append(cls())
            except Exception as exc:
                # skipped, but named: an entry appended to DETECTORS whose key is not its
                # module's name was left out without a word
                logging.getLogger("rehydrate").warning(
                    "detector %s skipped by start(\"auto\"): %s", key, exc)
                continue
        return chosen
    if isinstance(spec, str):  # "none"
        return []
    result: list[Detector] = []
    for item in spec:
        # An instance is probed as its key is: one started on a host without what it
        # listens to was listed as running and never heard a restore.
        if isinstance(item, Detector):
            found = item.probe_instance()
            if not isinstance(found, Probe):
                raise TypeError(f"{type(item).__qualname__}.probe_instance() returned "
                                f"{type(found).__name__}, not a Probe")
            if not found.usable:
                raise RuntimeError(f"detector {item.key} is not usable here: {found.reason}")
            result.append(item)
            continue
        cls = load(item)
        found = probe_of(cls)
        if not found.usable:
            raise RuntimeError(f"detector {item} is not usable here: {found.reason}")
        result.append(cls())
    return result



if TYPE_CHECKING:
    from ..extensions import Extension

    def _a_detector_is_an_extension(d: Detector) -> Extension:
        return d  # mypy --strict fails here when Detector drifts from the contract
