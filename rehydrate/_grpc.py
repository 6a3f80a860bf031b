"""A gRPC channel stand-in whose real ``grpc.Channel`` is replaced after every restore.

gRPC channels cannot be re-pointed, and stubs capture their channel's multi-callables when
they are built. :class:`ManagedChannel` hands stubs lazy multi-callables that resolve to
the *current* channel on each call, so stubs built once keep working after a restore.
Imported only when :func:`rehydrate.connections.grpc_channel` is used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc  # type: ignore[import-untyped,unused-ignore]

__all__ = ["ManagedChannel"]


class _LazyMultiCallable:
    def __init__(self, owner: ManagedChannel, kind: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self._owner, self._kind, self._args, self._kwargs = owner, kind, args, kwargs
        self._gen = -1
        self._target: Any = None

    def _resolve(self) -> Any:
        channel, gen = self._owner.current()
        if gen != self._gen:
            self._target = getattr(channel, self._kind)(*self._args, **self._kwargs)
            self._gen = gen
        return self._target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolve()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # with_call, future
        return getattr(self._resolve(), name)


class ManagedChannel:
    """Looks like a ``grpc.Channel``; forwards to the current one made by ``factory``."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._channel: Any = factory()
        self._gen = 0

    def current(self) -> tuple[Any, int]:
        with self._lock:
            if self._channel is None:
                self._channel = self._factory()
                self._gen += 1
            return self._channel, self._gen

    def reset(self) -> None:
        self._swap(self._factory())

    def close_current(self) -> None:
        self._swap(None)

    def _swap(self, new: Any) -> None:
        """Make ``new`` current (None: create one lazily on next use); close the old one."""
        with self._lock:
            old, self._channel = self._channel, new
            self._gen += 1
        if old is not None:
            old.close()

    def wait_ready(self, timeout: float) -> None:
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
        self.current()[0].subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Callable[..., Any]) -> None:
        self.current()[0].unsubscribe(callback)

    def close(self) -> None:
        self.close_current()

    def __enter__(self) -> ManagedChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
