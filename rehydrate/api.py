"""Deprecated path of the private module ``rehydrate._api`` (import from ``rehydrate``)."""

from ._moved import warn_moved

warn_moved(__name__)

# The old path re-exports the module's public names.
from ._api import *  # noqa: E402, F403
from ._api import __all__  # noqa: E402, F401 - star imports do not carry it
