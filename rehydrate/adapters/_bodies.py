"""Reading what an HTTP peer answered, within bounds: what every HTTP adapter shares.

The adapters talk to servers — and to whatever sits in front of them — while a restore
runs. A broken proxy streaming a body without end, or a huge error page, must not fill the
process's memory then; and an answer nested deeper than the JSON parser's recursion limit
(``[[[[…``) must count as "not JSON", not raise ``RecursionError`` — which ``json`` raises
instead of ``ValueError`` — out of a hook or a background loop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

__all__ = ["MAX_BODY", "TRUNCATED", "lines", "loads", "request"]

MAX_BODY = 1 << 20
"""Bytes of an answer read at most (1 MiB). What the adapters use of an answer — a state,
a reason, a model list, a GameServer — takes a few KiB; the rest of a longer body is left
unread (its connection is closed, not reused)."""

TRUNCATED = "rehydrate.truncated"
"""``response.extensions[TRUNCATED]``: True when :func:`request` cut the body short."""

_NOT_CARRIED = frozenset({"content-encoding", "content-length", "transfer-encoding"})
"""Headers describing the body as sent: the body kept is decoded (and perhaps cut)."""


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``; an answer nested too deep for the parser is a ``ValueError``
    like any other that is not JSON (``json`` raises ``RecursionError`` for it)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None


async def request(client: httpx.AsyncClient, method: str, url: str, *,
                  limit: int = MAX_BODY, **kwargs: Any) -> httpx.Response:
    """``await client.request(method, url, **kwargs)``, reading at most ``limit`` bytes of
    the (decoded) body: a longer one is cut there, marked by ``extensions[TRUNCATED]``.

    The answer is a complete ``httpx.Response`` (``.json()``, ``.text``, ``.content``,
    ``raise_for_status()`` work) whose body is what was read. A compressed body is
    inflated chunk by chunk as it arrives, and the cut applies to what that gives (the
    adapters ask for no compression: their answers are small).
    """
    sent = client.build_request(method, url, **kwargs)
    response = await client.send(sent, stream=True)
    body = bytearray()
    cut = False
    try:
        async for chunk in response.aiter_bytes():
            room = limit - len(body)
            body += chunk[:room]
            if len(chunk) > room:
                cut = True
                break
    finally:
        await response.aclose()
    headers = [(k, v) for k, v in response.headers.multi_items()
               if k.lower() not in _NOT_CARRIED]
    return httpx.Response(response.status_code, headers=headers, content=bytes(body),
                          request=sent, extensions={**response.extensions, TRUNCATED: cut},
                          default_encoding=response.default_encoding)


async def lines(response: httpx.Response, limit: int = MAX_BODY) -> AsyncIterator[str]:
    """The lines of a streamed ``response`` (``aiter_lines()``, ``\n``-separated, a
    trailing ``\r`` dropped), ``ValueError`` for one longer than ``limit`` characters: a
    stream that never sends a newline grew one line in memory for ever."""
    pending: list[str] = []
    size = 0
    async for text in response.aiter_text():
        *ends, rest = text.split("\n")
        for part in ends:
            pending.append(part)
            line = "".join(pending)
            pending, size = [], 0
            yield line.removesuffix("\r")
        pending.append(rest)
        size += len(rest)
        if size > limit:
            raise ValueError(f"a line longer than {limit} characters (no newline)")
    if size:
        yield "".join(pending).removesuffix("\r")
