"""URLs in messages. Private: nothing here is public API."""

from __future__ import annotations

__all__ = ["without_credentials"]


def without_credentials(url: str) -> str:
    """``scheme://host[:port]/path`` of ``url``: user info, query and fragment are where
    passwords and tokens go (``https://user:pw@host/x?api_key=...``), and a URL shown in
    a log line, an error, a report or ``status()`` must not carry them."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = host if parts.port is None else f"{host}:{parts.port}"
    except ValueError:
        return "<unparsable URL>"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
