"""URLs in messages. Private: nothing here is public API."""

from __future__ import annotations

import re

__all__ = ["scrub_urls", "without_credentials"]

_USER_INFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^\s/?#'\"<>]*@")
"""``scheme://user:password@``: the user info of a URL, wherever it stands in a text."""
_QUERY = re.compile(r"(?<=[^\s'\"<>?])\?[^\s'\"<>()?#=]*=[^\s'\"<>()]*")
"""``/path?name=value&...`` glued to what precedes it (not a question in prose): a
query string, up to the next space, quote or parenthesis."""


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


def scrub_urls(text: str) -> str:
    """``text`` (a library's error message) without the user info and the query strings
    of the URLs it quotes, as :func:`without_credentials` shows one URL: requests and
    urllib3 quote the request's path with its query (``url: /health?api_key=...``), a
    driver its DSN (``postgresql://app:pw@db/orders``)."""
    return _QUERY.sub("", _USER_INFO.sub(r"\1", text))
