"""A gRPC channel stand-in whose real ``grpc.Channel`` is replaced after every restore.

gRPC channels cannot be re-pointed, and stubs capture their channel's multi-callables when
they are built. :class:`ManagedChannel` hands stubs lazy multi-callables that resolve to
the *current* channel on each call, so stubs built once keep working after a restore.
Imported only when :func:`rehydrate.connections.grpc_channel` is used.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc  # type: ignore[import-untyped,unused-ignore]

from ._threads import fresh_lock_after_fork

__all__ = ["ManagedChannel"]


_CLOSED = "Cannot invoke RPC on closed channel!"
"""grpc's own message for a call on a closed channel (``ValueError``)."""

POLLER_WAIT = 2.0
"""The most :func:`_close` waits for grpc's connectivity poller to end (it wakes every
0.2 s; longer only when someone else is still subscribed — then it closes anyway)."""


def _close(channel: Any, callbacks: list[Callable[..., Any]]) -> None:
    """Close ``channel``, on which ``callbacks`` are subscribed: unsubscribe them first and
    let grpc's connectivity poller thread notice and end, then close.

    grpc's own ``close()`` unsubscribes too, but its poller may already be past its "any
    subscribers?" check and then calls into the closed channel: an unhandled
    ``ValueError: Cannot invoke RPC: Channel closed!`` in a grpc thread (grpc issue
    18995) — at every restore and every close of a channel an application subscribed
    to, most often right after a state change (the poller is then between its check and
    its call). The poller ends at its next wake-up once nothing is subscribed."""
    if callbacks:
        for callback in callbacks:
            try:
                channel.unsubscribe(callback)
            except Exception:  # noqa: S112 - not subscribed there (or not a grpc channel)
                continue
        # grpc's private poller state: without it (another grpc version, a stand-in),
        # the channel is closed at once, as before
        state = getattr(channel, "_connectivity_state", None)
        until = time.monotonic() + POLLER_WAIT
        while getattr(state, "polling", False) is True and time.monotonic() < until:
            time.sleep(0.005)
    channel.close()


class _LazyMultiCallable:
    def __init__(self, owner: ManagedChannel, kind: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self._owner, self._kind, self._args, self._kwargs = owner, kind, args, kwargs
        # (generation, multi-callable of that generation's channel), replaced as one
        # object: with two attributes, two threads resolving across a restore could
        # leave the old channel's callable stored under the new generation — every later
        # call then went to the closed channel until the next restore. A stale pair
        # written last only costs one rebuild. No lock: calls do not wait on each other.
        self._cached: tuple[int, Any] = (-1, None)

    def _resolve(self) -> Any:
        channel, gen = self._owner.current()
        cached_gen, target = self._cached
        if cached_gen != gen:
            target = getattr(channel, self._kind)(*self._args, **self._kwargs)
            self._cached = (gen, target)
        return target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolve()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # with_call, future
        return getattr(self._resolve(), name)


def _made(factory: Callable[[], Any]) -> Any:
    """``factory()``, refused with ``TypeError`` when it is no synchronous channel: a
    ``grpc.aio`` channel's ``close()`` is a coroutine that rehydrate's threads cannot await
    (it went into the snapshot open, its "close" reported ok) and a new one cannot be made
    off its event loop (every restore failed with "no current event loop")."""
    channel = factory()
    if inspect.iscoroutine(channel):
        channel.close()  # an async factory's: no "was never awaited" warning for it
        what = "a coroutine (an async def factory)"
    elif isinstance(channel, grpc.aio.Channel):
        what = "a grpc.aio channel"
    else:
        return channel
    raise TypeError(
        f"grpc_channel() manages synchronous grpc channels; its factory returned {what}. "
        "rehydrate closes and makes channels on its own threads, where a grpc.aio "
        "channel can be neither closed (close() must be awaited) nor made (no event "
        "loop). Return grpc.insecure_channel()/secure_channel(), or manage the aio "
        "channel in your own async hooks (await close() before the snapshot, make a "
        "new one after a restore).")


class ManagedChannel:
    """Looks like a ``grpc.Channel``; forwards to the current one made by ``factory``.

    Connectivity subscriptions follow the current channel: a callback subscribed once is
    subscribed again on every channel made after a restore. :meth:`close` is final, as
    for a ``grpc.Channel``: calls raise ``ValueError`` and a restore does not reopen it.
    """

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        self._subscriptions: list[tuple[Callable[..., Any], bool]] = []
        self._closed = False
        self.on_close: Callable[[], object] | None = None
        """Called once, by the first :meth:`close`: frees the connection's name."""
        self._channel: Any = _made(factory)
        self._gen = 0

    def current(self) -> tuple[Any, int]:
        with self._lock:
            if self._closed:
                raise ValueError(_CLOSED)
            if self._channel is None:
                self._channel = self._adopt(_made(self._factory))
                self._gen += 1
            return self._channel, self._gen

    def _adopt(self, channel: Any) -> Any:
        """``channel`` with the current subscriptions (under ``_lock``)."""
        for callback, try_to_connect in self._subscriptions:
            channel.subscribe(callback, try_to_connect)
        return channel

    def reset(self) -> None:
        if self._closed:
            return  # closed by the application: a restore does not bring it back
        self._swap(_made(self._factory))

    def close_current(self) -> None:
        self._swap(None)

    def _swap(self, new: Any) -> None:
        """Make ``new`` current (None: create one lazily on next use); close the old one."""
        with self._lock:
            callbacks = [callback for callback, _ in self._subscriptions]
            if self._closed and new is not None:
                old, new = new, None  # closed meanwhile: the new channel is not used
                callbacks = []  # never adopted: nothing of ours subscribed on it
            else:
                old, self._channel = self._channel, (None if new is None
                                                     else self._adopt(new))
                self._gen += 1
        if old is not None:
            _close(old, callbacks)

    def wait_ready(self, timeout: float) -> None:
        if self._closed:
            return  # closed by the application: nothing to wait for
        channel, _ = self.current()
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise ConnectionError(f"gRPC channel not ready within {timeout:g}s") from None

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _LazyMultiCallable(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _LazyMultiCallable(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _LazyMultiCallable(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _LazyMultiCallable(self, "stream_stream", args, kwargs)

    def subscribe(self, callback: Callable[..., Any], try_to_connect: bool = False) -> None:
        """Subscribe ``callback`` to the current channel's connectivity, and to every
        channel that replaces it (a restore makes a new one)."""
        with self._lock:
            if self._closed:
                raise ValueError(_CLOSED)
            self._subscriptions.append((callback, try_to_connect))
            if self._channel is not None:
                self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Callable[..., Any]) -> None:
        with self._lock:
            self._subscriptions = [s for s in self._subscriptions if s[0] != callback]
            if self._channel is not None:
                self._channel.unsubscribe(callback)

    def close(self) -> None:
        """Close for good (``grpc.Channel.close``): later calls raise ``ValueError``, the
        restore hooks neither reopen it nor wait for it, and its name is free for a new
        ``grpc_channel()``."""
        with self._lock:
            first, self._closed = not self._closed, True
            old, self._channel = self._channel, None
            callbacks = [callback for callback, _ in self._subscriptions]
            self._subscriptions.clear()
        try:
            if old is not None:
                _close(old, callbacks)
        finally:
            if first and self.on_close is not None:
                self.on_close()

    def __enter__(self) -> ManagedChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
