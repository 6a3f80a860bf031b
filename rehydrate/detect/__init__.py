"""Event sources: each module notices one kind of snapshot/restore event.

Every detector has the same small interface (:class:`Detector`): a class-level
:meth:`~Detector.probe` saying whether it can work here (and why not), and
``start(engine)`` / ``stop()``. Detector modules are imported only when used, so
``import rehydrate`` stays light. ``start(detectors="auto")`` picks every detector whose
probe succeeds and that is on by default; ``rehydrate doctor`` prints every probe.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ..extensions import Engine

__all__ = ["CATALOGUE", "Detector", "DetectorInfo", "available", "load", "select"]


class Detector:
    """Base class of event sources.

    ``specificity`` ranks reasons when two detectors see the same restore: the generic
    ones (clock jump, identity change) defer briefly to a more specific running detector
    so that the report carries the most specific reason.
    """

    name: ClassVar[str] = "detector"
    specificity: ClassVar[int] = 0
    auto: ClassVar[bool] = True
    """Started by ``start(detectors="auto")`` when usable."""

    @classmethod
    def probe(cls) -> str | None:
        """``None`` when this detector can work here, else the reason it cannot."""
        return None

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

    def start(self, engine: Engine) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        """One line for ``rehydrate doctor`` about how this detector works here."""
        return (self.__doc__ or "").strip().splitlines()[0] if self.__doc__ else ""


# name -> "module:Class", imported lazily. Order = order of `doctor` output.
CATALOGUE: dict[str, str] = {
    "gvisor": "rehydrate.detect.gvisor:GVisorDetector",
    "control": "rehydrate.detect.control:ControlDetector",
    "snapstart": "rehydrate.detect.snapstart:SnapStartDetector",
    "vmclock": "rehydrate.detect.vmclock:VmClockDetector",
    "file": "rehydrate.detect.file:FileDetector",
    "signal": "rehydrate.detect.signal:SignalDetector",
    "clock-jump": "rehydrate.detect.clock_jump:ClockJumpDetector",
    "identity": "rehydrate.detect.identity:IdentityDetector",
}


@dataclass(frozen=True)
class DetectorInfo:
    name: str
    usable: bool
    auto: bool
    reason: str
    description: str

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "usable": self.usable, "auto": self.auto,
                "reason": self.reason, "description": self.description}


def load(name: str) -> type[Detector]:
    """The detector class for catalogue key ``name`` (imported now); ``ValueError`` names
    the known keys for an unknown one."""
    try:
        target = CATALOGUE[name]
    except KeyError:
        known = ", ".join(CATALOGUE) or "none"
        raise ValueError(f"unknown detector {name!r} (known: {known})") from None
    module, _, cls = target.partition(":")
    loaded: type[Detector] = getattr(importlib.import_module(module), cls)
    return loaded


def available() -> list[DetectorInfo]:
    """Every known detector, whether it works here and why (not)."""
    infos = []
    for name in CATALOGUE:
        try:
            cls = load(name)
            why = cls.probe()
        except Exception as exc:  # a broken probe must not break doctor
            infos.append(DetectorInfo(name, False, False, f"probe failed: {exc}", ""))
            continue
        doc = (cls.__doc__ or "").strip().splitlines()
        off = cls.auto_here()
        infos.append(DetectorInfo(
            name=name,
            usable=why is None,
            auto=off is None,
            reason=why or ("usable" + ("" if off is None else f"; {off}")),
            description=doc[0] if doc else "",
        ))
    return infos


def select(spec: str | Iterable[str | Detector]) -> list[Detector]:
    """Detectors to start for ``start(detectors=spec)``."""
    if spec == "none":
        return []
    if spec == "auto":
        chosen: list[Detector] = []
        for name in CATALOGUE:
            try:
                cls = load(name)
                if cls.auto_here() is None and (cls.probe() is None or cls.configured()):
                    chosen.append(cls())
            except Exception:  # noqa: S112 - a detector that fails its probe is skipped
                continue
        return chosen
    if isinstance(spec, str):
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    result: list[Detector] = []
    for item in spec:
        if isinstance(item, Detector):
            result.append(item)
            continue
        cls = load(item)
        why = cls.probe()
        if why is not None:
            raise RuntimeError(f"detector {item} is not usable here: {why}")
        result.append(cls())
    return result
