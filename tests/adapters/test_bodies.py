"""rehydrate.adapters._bodies: answers read within bounds, JSON too deep is "not JSON"."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator

import httpx
import pytest

from rehydrate.adapters._bodies import MAX_BODY, TRUNCATED, lines, loads, request


class Endless:
    """A body that never ends: 64 KiB chunks for as long as anyone reads."""

    def __init__(self, chunk: bytes = b"x" * 65536) -> None:
        self.chunk = chunk
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            self.sent += len(self.chunk)
            yield self.chunk
            await asyncio.sleep(0)


def _client(handler: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://peer", transport=httpx.MockTransport(handler))


def test_a_body_without_end_is_cut_at_the_cap() -> None:
    body = Endless()

    async def main() -> httpx.Response:
        async with _client(lambda request: httpx.Response(500, content=body)) as c:
            return await request(c, "GET", "/health")

    r = asyncio.run(main())
    assert r.status_code == 500 and len(r.content) == MAX_BODY and r.extensions[TRUNCATED]
    assert body.sent <= MAX_BODY + len(body.chunk)  # the rest was never even produced
    assert r.text == "x" * MAX_BODY


def test_a_small_answer_is_whole_and_decoded() -> None:
    packed = gzip.compress(b'{"is_sleeping": true}')

    async def main() -> httpx.Response:
        def answer(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, content=packed, headers={"content-encoding": "gzip",
                                                                "x-kept": "yes"})
        async with _client(answer) as c:
            return await request(c, "GET", "/is_sleeping", params={"a": "1"})

    r = asyncio.run(main())
    assert r.json() == {"is_sleeping": True} and not r.extensions[TRUNCATED]
    assert r.headers["x-kept"] == "yes" and "content-encoding" not in r.headers
    assert r.request.url == "http://peer/is_sleeping?a=1"
    r.raise_for_status()


def test_json_nested_too_deep_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        loads(b"[" * 100_000 + b"]" * 100_000)
    assert loads(b'{"a": [1]}') == {"a": [1]}


def test_lines_are_split_and_an_endless_one_refused() -> None:
    async def collect(content: object, limit: int = MAX_BODY) -> list[str]:
        async with _client(lambda request: httpx.Response(200, content=content)) as c:
            r = await c.send(c.build_request("GET", "/watch"), stream=True)
            try:
                return [line async for line in lines(r, limit)]
            finally:
                await r.aclose()

    assert asyncio.run(collect(b'{"a": 1}\r\n\n{"b": 2}\n{"c"')) == [
        '{"a": 1}', "", '{"b": 2}', '{"c"']
    body = Endless(b"y" * 1000)
    with pytest.raises(ValueError, match="a line longer than 4096 characters"):
        asyncio.run(collect(body, limit=4096))
    assert body.sent <= 4096 + 1000
