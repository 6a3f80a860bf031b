"""Where the control socket lives: shared by the server and ``rehydrate notify``.

Light (``os`` and the configuration table): ``rehydrate notify`` runs inside a sandbox at every
checkpoint and restore, and under gVisor each module it imports costs milliseconds
(measured: importing the server module for these three names cost 96 ms of the
notifier's start under runsc).
"""

from __future__ import annotations

import os

from . import _config

__all__ = ["ENV_SOCKET", "default_socket_dir", "socket_path"]

ENV_SOCKET = "REHYDRATE_CONTROL_SOCKET"
"""The variable naming the control socket's path (server and clients read the same one)."""


def default_socket_dir() -> str:
    """``$XDG_RUNTIME_DIR/rehydrate`` when that directory exists, else ``/tmp/rehydrate-<uid>``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return os.path.join(xdg, "rehydrate")
    return f"/tmp/rehydrate-{os.getuid()}"  # noqa: S108 - private 0700 dir, ownership checked


def socket_path(pid: int | None = None) -> str:
    """``$REHYDRATE_CONTROL_SOCKET``, else ``<default_socket_dir()>/<pid>.sock``."""
    explicit = _config.text(ENV_SOCKET)
    if explicit:
        return explicit
    return os.path.join(default_socket_dir(), f"{pid or os.getpid()}.sock")
