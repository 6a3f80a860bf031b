"""URLs in messages. Private: nothing here is public API."""

from __future__ import annotations

import re

__all__ = ["scrub_urls", "without_credentials"]

_PORT = r"(?!\d+(?:[/?#]|$))"
"""Not ``:8080/`` (a port, then a path): what follows a colon in ``host:port/a@b``."""
_END = r"\s'\"<>"
"""What ends a URL quoted in a message: a space or a quote."""

_SCRUBS: list[tuple[re.Pattern[str], str]] = [
    # scheme://user:password@ (scheme: oracle+cx_oracle, ibm_db_sa): a raw password may
    # hold "/", "#" or "@", so it runs to the URL's last "@" (pa@ss showed "ss" after the
    # first one; p@ss/word cannot be told from a path holding an "@", which is removed
    # with it: too much shown is a leak, too much removed is not), unless a space or a
    # quote comes first; a
    # user name holds no "[" (http://[::1]:8080/?email=bob@example.com: an IPv6 host).
    # Nor past the next "://": with no "@" after it, each scheme of a list of thousands
    # (Kafka's PLAINTEXT://b0:9092,...) scanned on to the end of the text, quadratic; a
    # scheme starts after no scheme character (not at each "-" of a long a-b-c-...)
    (re.compile(rf"(?<![\w+.-])([A-Za-z][\w+.-]*://)(?:[^{_END}/?#@:\[\]]*:{_PORT}"
                rf"(?:(?!://)[^{_END}])*"
                rf"|[^{_END}/?#@:\[\]]*)@"), r"\1"),
    # user:password@host:port without a scheme (libpq's "connection to app:pw@db:5432");
    # a user alone (bob@example.com) is no secret, nor is an address after a word and a
    # colon (sip:alice@example.com, email:bob@x.org) or an image's digest
    # (nginx:1.25@sha256:...): only a host and a port after the "@" tell an address
    (re.compile(rf"(?<![\w.+:/@-])(?!mailto:)[\w.+-]+:{_PORT}[^{_END}@:]+@"
                r"(?=(?:[\w.-]+|\[[\dA-Fa-f:.]+\]):\d+\b)"), ""),
    # password=... of a key=value DSN (libpq, ODBC's PWD=...;), not a SQL placeholder;
    # quoted in either quote, with a backslash escaping one (libpq's 'it\'s'); a raw one
    # does not end in ")": Config(password=None) keeps the parenthesis it closes
    (re.compile(r"\b(password|passwd|pwd|sslpassword)\s*=\s*"
                r"(?!\?|%s|%\(|:\w|\$\d)('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
                r"|\{[^}]*\}|[^\s;'\"]*[^\s;'\")])",
                re.IGNORECASE), r"\1=[redacted]"),
    # /path?name=value... glued to a path (not a question in prose, not "a=?" of SQL):
    # a query string and fragment, up to a space, a quote, or a ")" it did not open
    (re.compile(rf"(?<=[\w/.~%-])\?[\w.~%+-]*=(?:[^{_END}()]|\([^{_END}()]*\))*"), ""),
]
"""What :func:`scrub_urls` removes (or replaces), in this order."""


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
    driver its DSN (``postgresql://app:pw@db/orders``, ``host=db password=pw``), libpq
    the address it tried (``app:pw@db:5432``). A heuristic: it errs on the side of
    removing, but leaves SQL placeholders (``a=?,b=?``) and addresses (``bob@host``)."""
    for pattern, replacement in _SCRUBS:
        text = pattern.sub(replacement, text)
    return text
