"""Reusable daemon threads for blocking calls made during a restore.

Starting a thread right after a gVisor restore costs milliseconds (measured under runsc:
10-50 ms, the sandbox sets up the new task's host context on its first run), while waking
a thread that already existed when the snapshot was taken costs little. So the blocking
calls of the restore path (reading the environment file, users' sync ``open``/``check``
of managed connections) run on :data:`blocking`, whose threads stay and wait for the next
call instead of exiting: a thread used before the snapshot serves the clone.

The pool is never bounded — a call never waits for a free thread: when every thread is
busy (a call stuck on a hung mount or peer) a new one starts; when none can start (the
process at its pids limit), the call raises at once instead of waiting. Whoever will need a thread
in a restore reserves one beforehand, by name (:meth:`~ThreadPool.reserve`): that many
idle threads (at most ``max_reserved``) are started and kept; other idle threads exit
after ``idle_exit`` seconds (beyond ``keep``). After ``fork()`` the child starts afresh.

A manager, handle or module registers with :func:`fresh_lock_after_fork` to get new
locks (``Lock``, ``RLock``, ``Condition``) in a forked child when a parent thread may have
held them, and to reset state counting the parent's other threads.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import concurrent.futures

__all__ = ["ThreadPool", "blocking"]

log = logging.getLogger("rehydrate")


class ThreadPool:
    """Unbounded pool of reusable daemon threads (see the module docstring)."""

    def __init__(self, name: str, keep: int = 2, idle_exit: float = 60.0,
                 max_reserved: int = 8) -> None:
        self.name = name
        self.keep = keep
        self.idle_exit = idle_exit
        self.max_reserved = max_reserved
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cv = threading.Condition(threading.Lock())
        self._jobs: collections.deque[tuple[concurrent.futures.Future[Any],
                                            Callable[..., Any], tuple[Any, ...]]]
        self._jobs = collections.deque()
        self._threads = 0
        self._idle = 0
        self._reserved: set[str] = set()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's threads are not here
            self._reset()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` on a pool thread; its future (which cannot be cancelled).

        ``RuntimeError`` (``can't start new thread``) when no thread is idle and none
        can be started (a pids limit, memory): the job is dropped, never run later, and
        the pool is as before — a later call starts its thread once the limit allows."""
        import concurrent.futures

        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()  # not cancellable: setting the result is safe
        self._check_fork()
        with self._cv:
            self._jobs.append((fut, fn, args))
            if self._idle >= len(self._jobs):
                self._cv.notify()
                return fut
            try:
                self._start_locked()
            except BaseException:
                # No thread could start (RuntimeError: a pids or memory limit): the job
                # is the caller's to retry or refuse, never run later by a thread that
                # frees up (the caller was told it failed). It is the last one queued,
                # and nobody took it: we held the lock since appending it.
                self._jobs.pop()
                raise
        return fut

    def reserve(self, key: str) -> None:
        """``key`` (the environment reader, a connection, the control socket's client)
        will want a thread at the same time as the others in a restore: keep one idle
        thread per distinct key (up to ``max_reserved``), started now — before a
        snapshot, so that the clone finds them waiting. Reserving a key again (another
        engine, a re-registered connection) adds nothing."""
        self._check_fork()
        with self._cv:
            self._reserved.add(key)
            while self._idle < self._wanted:
                try:
                    self._start_locked()
                except RuntimeError as exc:
                    # Ahead of need only: the call that needs a thread starts one then
                    # (or says it cannot). Failing here failed the reserving start():
                    # the control socket's, with its accept thread already running.
                    log.warning(
                        "%s: could not start a thread to keep in reserve: %s", self.name, exc)
                    return

    @property
    def _wanted(self) -> int:
        return min(len(self._reserved), self.max_reserved)

    @property
    def _kept(self) -> int:
        return max(self.keep, self._wanted)

    def _start_locked(self) -> None:
        """Start a thread (caller holds the lock); ``RuntimeError`` when none can start.

        Counted only once ``start()`` returned: a thread that never ran, counted idle,
        was a phantom that every later job waited for (``submit()`` notified it instead
        of starting a real one), for ever. The new thread cannot see the counts before
        they are right: its first step is to take the lock held here."""
        threading.Thread(target=self._work, name=self.name, daemon=True).start()
        # A starting thread counts as idle: it takes the next job without being woken.
        self._threads += 1
        self._idle += 1

    def _work(self) -> None:
        cv = self._cv  # a fork replaces it; this thread keeps serving its own pool state
        cv.acquire()
        try:
            while True:
                while not self._jobs:
                    woke = cv.wait(None if self._threads <= self._kept else self.idle_exit)
                    if not woke and not self._jobs and self._threads > self._kept:
                        self._threads -= 1
                        self._idle -= 1
                        return
                fut, fn, args = self._jobs.popleft()
                self._idle -= 1
                cv.release()
                error: BaseException | None = None
                result: Any = None
                try:
                    result = fn(*args)
                except BaseException as exc:  # the caller gets it, the thread lives on
                    error = exc
                # Idle again *before* the caller hears of its result: counted only after,
                # a caller that made its next call at once (this thread descheduled in
                # between) found no idle thread and started another one, which is what
                # the pool is there to avoid on the restore path. Its job waits at most
                # for this thread to finish publishing (the future's done-callbacks).
                with cv:
                    self._idle += 1
                try:
                    if error is None:
                        fut.set_result(result)
                    else:
                        fut.set_exception(error)
                finally:
                    del fut, fn, args, result, error  # drop references while idle
                    cv.acquire()
        finally:
            cv.release()


blocking = ThreadPool("rehydrate-io")
"""The process-wide pool for blocking calls of the restore path."""


_AfterFork = Callable[[Any], None]


class _Owner:
    """A registered owner, held weakly; keyed by ``id()``, not ``==``: two equal owners
    (two connections to one URL) each have their locks, and unhashable ones (a dataclass)
    can register."""

    __slots__ = ("after", "names", "ref")

    def __init__(self, ref: weakref.ref[Any]) -> None:
        self.ref = ref
        self.names: tuple[str, ...] = ()
        self.after: tuple[_AfterFork, ...] = ()


_LOCK_OWNERS: dict[int, _Owner] = {}
_owners_lock = threading.Lock()  # merges of two registrations; replaced in the child
_PLAIN_LOCK = type(threading.Lock())


def _forget_owner(key: int, ref: weakref.ref[Any]) -> None:
    # Called while the owner is being freed: its id cannot belong to another object yet,
    # unless that one registered after this ref's owner died (then the entry is not ours).
    entry = _LOCK_OWNERS.get(key)
    if entry is not None and entry.ref is ref:
        _LOCK_OWNERS.pop(key, None)


def fresh_lock_after_fork(owner: Any, *names: str, after: _AfterFork | None = None) -> None:
    """Give ``owner`` a new lock (its attribute ``_lock``, or each of ``names``) in every
    child of ``fork()`` where a parent thread may hold it: that thread does not exist in
    the child, which then waited for the lock for ever — its hooks timed out on every
    event, its ``close()`` or ``status()`` hung. Not only long holds (a new key generated
    under the key manager's, a managed file's reopen waiting on its volume): a thread can
    lose the GIL inside any critical section that calls something, or just after it got a
    contended lock, so a fork() can come while it holds even a short-lived one.

    * a ``threading.Lock`` is always replaced: who holds one cannot be told, so the
      forking thread's own hold is dropped too (its ``with`` releases the old lock on the
      way out, harmlessly);
    * an ``RLock`` only when :func:`held_by_another_thread`: the forking thread's own hold
      (a user callback that forks inside the critical section) is released as the child
      unwinds, which a new lock would refuse;
    * a ``threading.Condition`` always becomes a new one (the parent's threads waiting
      in it are not in the child: a ``notify()`` there would wake one of them instead of
      a waiter of the child), over a lock chosen by the two rules above. Build one that a
      thread may hold while it forks on an ``RLock`` (the default): over a plain ``Lock``
      the forking thread's hold is not kept, so its ``notify()`` or ``wait()`` inside
      that hold raises ``RuntimeError`` in the child. A lock shared by several names (a
      condition over the owner's ``_lock``) stays shared.

    A thread that forks from a signal handler while it waits in such a condition goes
    back, in the child, to waiting in the old one: nothing there notifies it, so it
    waits out its timeout.

    ``after(owner)`` then runs in the child, for state kept with the lock that counts the
    parent's other threads (a secret's open views): it must not hold a reference to
    ``owner`` (pass a function of the class, not a bound method), which is held weakly
    (``TypeError`` for an object that cannot be: a class with ``__slots__`` and no
    ``__weakref__``). Owners are told apart by identity, so equal or unhashable objects
    (dataclasses) register each on its own. A module can be an owner (its module-level
    locks, by name). Locks are set with ``object.__setattr__`` (a handle may forward
    attribute writes elsewhere). Registering an owner again adds its names and hook to
    those it has (a subclass and its base each registering theirs)."""
    key = id(owner)
    try:
        ref = weakref.ref(owner, lambda r: _forget_owner(key, r))
    except TypeError:
        raise TypeError(
            f"fresh_lock_after_fork: a {type(owner).__qualname__} object cannot be held "
            "weakly (a class with __slots__ needs '__weakref__' among them)") from None
    with _owners_lock:
        entry = _LOCK_OWNERS.get(key)
        if entry is None or entry.ref() is not owner:  # not registered, or a dead one's id
            entry = _LOCK_OWNERS[key] = _Owner(ref)
        entry.names += tuple(n for n in names or ("_lock",) if n not in entry.names)
        if after is not None and after not in entry.after:
            entry.after += (after,)


def held_by_another_thread(lock: Any) -> bool:
    """True when a thread other than the calling one holds the ``RLock`` ``lock`` (in a
    fork handler: a parent thread the child does not have)."""
    if lock.acquire(blocking=False):
        lock.release()
        return False
    return True


def _replacement(lock: Any, done: dict[int, Any]) -> Any:
    """The lock a forked child uses instead of ``lock`` (``lock`` itself when it is kept);
    ``done`` maps the locks already replaced in this child, so that a lock shared by two
    names (or owners) gets one replacement."""
    new = done.get(id(lock))
    if new is not None:
        return new
    if isinstance(lock, threading.Condition):
        new = threading.Condition(_replacement(lock._lock, done))  # type: ignore[attr-defined]
    elif isinstance(lock, _PLAIN_LOCK):
        new = threading.Lock()
    elif held_by_another_thread(lock):
        new = threading.RLock()
    else:
        new = lock
    done[id(lock)] = new
    return new


def _new_locks_in_child() -> None:
    global _owners_lock
    _owners_lock = threading.Lock()  # a parent thread may have been registering an owner
    error: Exception | None = None
    done: dict[int, Any] = {}
    keep = []  # the replaced locks stay alive while ``done`` is used: their ids are keys
    for entry in list(_LOCK_OWNERS.values()):
        owner = entry.ref()
        if owner is None:
            continue
        try:
            for name in entry.names:
                lock = getattr(owner, name)
                keep.append(lock)
                new = _replacement(lock, done)
                if new is not lock:
                    object.__setattr__(owner, name, new)
            for after in entry.after:
                after(owner)
        except Exception as exc:  # the other owners still get theirs
            error = error or exc
    del keep
    if error is not None:
        raise error  # reported ("Exception ignored in...") by the fork handler machinery


os.register_at_fork(after_in_child=_new_locks_in_child)
