"""The deprecation warning of the import paths that became private modules.

``rehydrate.lifecycle`` and its siblings were public paths until the engine's modules got a
leading underscore; each old path is now a two-line module that warns and re-exports the
private module's ``__all__``, so existing imports keep working for a release.
"""

from __future__ import annotations

__all__ = ["warn_moved"]


def warn_moved(old: str) -> None:
    """Warn that module ``old`` (``rehydrate.X``) is the deprecated path of ``rehydrate._X``."""
    import warnings

    new = "rehydrate._" + old.rpartition(".")[2]
    warnings.warn(f"{old} is deprecated: it is private now ({new}); import its public names "
                  "from rehydrate (e.g. `from rehydrate import Lifecycle`)",
                  DeprecationWarning, stacklevel=3)
