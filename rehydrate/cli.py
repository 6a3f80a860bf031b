"""Deprecated path of the private module ``rehydrate._cli`` (no public replacement)."""

from ._moved import warn_moved

warn_moved(__name__, "run the `rehydrate` command (`python -m rehydrate`), or call "
                     "`rehydrate.__main__.main(argv)` from Python (it returns the exit "
                     "status)")

# The old path re-exports the module's public names.
from ._cli import *  # noqa: E402, F403
from ._cli import __all__  # noqa: E402, F401 - star imports do not carry it
