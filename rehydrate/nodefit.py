"""Deprecated path of the private module ``rehydrate._nodefit`` (no public replacement)."""

from ._moved import warn_moved

warn_moved(__name__, "run `rehydrate doctor` (the platform fit) and `rehydrate check "
                     "--labels` / `--affinity` (node labels, nodeAffinity)")

# The old path re-exports the module's public names.
from ._nodefit import *  # noqa: E402, F403
from ._nodefit import __all__  # noqa: E402, F401 - star imports do not carry it
