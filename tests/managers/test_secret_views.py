"""Secret views: ``with secret:`` per context, wipes and reloads that wait only for the
views of the buffer they retire, and reads that no reload can serve in time."""

from __future__ import annotations

import asyncio

import pytest

from rehydrate.secrets import Secret


def test_with_secret_in_overlapping_asyncio_tasks_closes_each_task_s_own_view(
        rehydrate_engine):
    """The views ``with secret:`` opened were kept per thread: task A leaving its block
    while task B (same thread) was inside its own closed B's view ("operation forbidden
    on released memoryview object")."""
    s = Secret.from_callable(lambda: b"token-value-1234", name="tok",
                             engine=rehydrate_engine)

    async def main() -> bytes:
        a_in, b_in, a_out = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def a() -> None:
            with s:
                a_in.set()
                await b_in.wait()
            a_out.set()

        async def b() -> bytes:
            await a_in.wait()
            with s as view:
                b_in.set()
                await a_out.wait()  # A left its block while B is inside its own
                return bytes(view)

        _, got = await asyncio.gather(a(), b())
        return got

    assert asyncio.run(main()) == b"token-value-1234"
    assert s._readers == 0


def test_with_secret_nests_across_secrets_and_refuses_an_unmatched_exit(rehydrate_engine):
    one = Secret.from_callable(lambda: b"first-value", name="one", engine=rehydrate_engine)
    two = Secret.from_callable(lambda: b"second-value", name="two", engine=rehydrate_engine)
    with one as v1, two as v2:
        assert (bytes(v1), bytes(v2)) == (b"first-value", b"second-value")
    assert one._readers == two._readers == 0
    with pytest.raises(RuntimeError, match="'one': __exit__ without a matching __enter__"):
        one.__exit__(None, None, None)
