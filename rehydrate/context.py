"""Deprecated path of the private module ``rehydrate._context`` (import from ``rehydrate``)."""

from ._moved import warn_moved

warn_moved(__name__)

# The old path re-exports the module's public names.
from ._context import *  # noqa: E402, F403
from ._context import __all__  # noqa: E402, F401 - star imports do not carry it
