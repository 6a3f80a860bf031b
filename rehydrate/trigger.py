"""Deprecated path of the private module ``rehydrate._trigger`` (no public replacement:
``rehydrate.trigger_snapshot(timeout=…)`` triggers with the default engine)."""

from ._moved import warn_moved

warn_moved(__name__, "use `rehydrate.trigger_snapshot(timeout=…)` for the default engine "
                     "(another function: no engine or proc=), or run `rehydrate trigger`")

# The old path re-exports the module's public names.
from ._trigger import *  # noqa: E402, F403
from ._trigger import __all__  # noqa: E402, F401 - star imports do not carry it
