"""The deprecation warning of the import paths that became private modules.

``rehydrate.lifecycle`` and its siblings were public paths until the engine's modules got a
leading underscore; each old path is now a two-line module that warns and re-exports the
private module's ``__all__``, so existing imports keep working for a release.
"""

from __future__ import annotations

__all__ = ["warn_moved"]

_SHOWN = 4
"""Names a warning lists before "and N more"."""


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def warn_moved(old: str, instead: str = "") -> None:
    """Warn that module ``old`` (``rehydrate.X``) is the deprecated path of ``rehydrate._X``.

    The advice is worked out from the names, not written once for every module: "import
    its public names from rehydrate" was wrong for names not there (every name of
    ``rehydrate.nodefit``, ``rehydrate.lifecycle.State``). Names ``rehydrate`` exports as
    the very same object are named as importable from there; the others as having no
    public replacement, with ``instead`` (what to use in their place) when there is
    something."""
    import importlib
    import warnings

    new = "rehydrate._" + old.rpartition(".")[2]
    module = importlib.import_module(new)
    names = list(module.__all__)
    package = importlib.import_module("rehydrate")
    exported = set(package.__all__)
    # The name alone is not enough: rehydrate.trigger_snapshot is another function than
    # rehydrate._trigger's (no engine, no proc=), and the advice to import it from
    # rehydrate ended in a TypeError.
    public = [n for n in names
              if n in exported and getattr(package, n) is getattr(module, n)]
    private = [n for n in names if n not in public]
    advice = []
    if public:
        which = "its names" if not private else _listed(public)
        advice.append(f"import {which} from rehydrate (`from rehydrate import {public[0]}`)")
    if private:
        which = "none of its names has a" if not public else (
            f"{_listed(private)} {'has no' if len(private) == 1 else 'have no'}")
        advice.append(f"{which} public replacement" + (f": {instead}" if instead else ""))
    warnings.warn(f"{old} is deprecated: it is private now ({new}); " + "; ".join(advice),
                  DeprecationWarning, stacklevel=3)
