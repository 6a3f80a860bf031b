"""Deprecated path of ``rehydrate._control_client`` (import from ``rehydrate``)."""

from ._moved import warn_moved

warn_moved(__name__, "run `rehydrate notify` (the command), or call "
                     "`rehydrate.__main__.notify_main(argv)` from Python (it returns the "
                     "exit status)")

# The old path re-exports the module's public names.
from ._control_client import *  # noqa: E402, F403
from ._control_client import __all__  # noqa: E402, F401 - star imports do not carry it
