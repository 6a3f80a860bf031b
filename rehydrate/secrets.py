"""Secrets kept out of snapshot images.

A :class:`Secret` holds its value in a ``bytearray`` that rehydrate owns. Before a snapshot
(the ``SECRETS`` phase of the before-snapshot pass) the buffer is overwritten with zeros;
after a restore or resume the value is loaded again from its source — the environment (as
refreshed from the new spec environment by the ``ENVIRONMENT`` phase, which runs first), a
file, or a callable. So the image written in between holds no copy rehydrate controls. A
secret's hooks are registered before its first load: a pass that comes while it is being
created wipes it too (it then loads on restore, like one created after the pass).

Reading:

* ``secret.get()`` returns a ``bytes`` **copy**. rehydrate cannot wipe that copy (Python
  ``bytes`` are immutable): drop it quickly, and prefer the context manager;
* ``with secret as view:`` (or ``with secret.view() as view``) yields a ``memoryview`` of
  the buffer itself — no copy. ``with secret:`` pairs exits with entries per context
  (thread or ``asyncio`` task): enter and leave it in the same one; generators
  interleaving in one context, and a view one task opens and another closes, use
  ``view()``. A wipe takes the value away first (new reads block or raise as while
  wiped), then waits up to ``wipe_wait`` seconds for the views open on that buffer to
  close before zeroing it (in a child of ``fork()``, only for those of the thread that
  forked); a reload waits only for the views of the value it replaced (not at all when
  this thread holds one: the last view zeroes it, a wipe waits for it). A read during a
  wipe by a thread holding a view of the value being wiped raises at once (blocking, it
  would keep that view open): ``asyncio`` code, whose tasks share one thread, passes
  ``on_wiped="raise"``. Only views of that same secret count: one holding a view of
  another secret blocks (and that secret's wipe zeroes it under the view at wipe_wait).

Reading while wiped (between the snapshot pass and the reload) either blocks until the
reload, up to ``timeout`` seconds (``on_wiped="block"``, the default), or raises
:class:`SecretUnavailable` at once (``on_wiped="raise"``) — at once also from a restore
hook that runs before the secret's reload (an earlier phase, or ``SECRETS`` with an order
below -200): that run starts the reload only after the hook returns; and at once from a
before-snapshot hook that runs after the secret's wipe in the same pass. Both know the
hook by its context and its thread (an async hook's: its event loop's): another thread (an
executor's worker, one it started with ``asyncio.to_thread``) blocks as outside hooks. ``repr``
and ``str`` never show the value.

Each secret gets its own built-in hooks, named ``rehydrate.secret:<name>``; a failed reload
(unreadable file, missing variable, a raising callable) fails that hook — ``required``
(default True) decides whether readiness suffers — and the secret stays unavailable with
the error as the reason. :meth:`Secret.reload` outside a restore keeps the previous value
when the source fails; when it succeeds after the restore hook failed, the process is
ready again (``engine.recovered()`` with that hook's own record: a user hook that happens
to share the name is not cleared by it).

A hook error (or a connection's, or an upstream's answer an adapter quotes) whose text
quotes the value of a loaded secret shows ``[redacted secret 'name']`` in its place, in
logs, reports, ``status()``, telemetry and readiness answers: the manager registers its
secrets with :func:`rehydrate.extensions.add_redactor`. Values shorter than 8 characters
are not looked for. A value a reload replaced is looked for until the end of that run
(an application's client may still quote it); a wiped one is not (see docs/identity.md).

What rehydrate cannot wipe: values in ``os.environ`` and the process's C environment
(``Secret.from_env`` reads from there — use ``from_file`` or ``from_callable`` for secrets
that must stay out of the image), and any copy the application made.

APIs that take a password (``tls.from_files(password=...)``) take it as a
:class:`SecretSource`: a :class:`Secret` or a callable is read each time the password is
needed and nothing is kept in between; plain ``bytes``/``bytearray``/``str`` are copied
into a buffer rehydrate keeps (and wipes on close) — so they are in snapshot images.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from ._config import MAX_SECONDS, seconds, shown
from ._disable import is_disabled
from ._files import read_regular
from ._hooks import Hook, Phase
from ._redact import replace_forms, value_forms
from ._runner import running_after
from ._threads import fresh_lock_after_fork
from .extensions import Probe, add_redactor, resolve_engine, running_before

if TYPE_CHECKING:
    from ._context import Report, RestoreContext
    from .extensions import Engine

__all__ = [
    "Secret",
    "SecretError",
    "SecretSource",
    "SecretUnavailable",
    "SecretsManager",
    "manager",
    "utf8_into",
]

log = logging.getLogger("rehydrate")

OnWiped = Literal["block", "raise"]
MAX_SECRET_BYTES = 16 * 1024 * 1024


_PENDING = ("a snapshot is pending (loaded now, the value would be in the image); it loads "
            "on restore/resume")
_RESTORED = ("a restore happened while this load ran: its value is the snapshot's, "
             "discarded (the restore loads the clone's own)")
_WIPED = "wiped before a snapshot; reloaded after restore/resume"
_CREATED_PENDING = "wiped: created while a snapshot was pending; loads on restore"
_CLOSED = "closed (Secret.close() was called: it is never loaded again)"


class SecretError(RuntimeError):
    """A secret's source could not be read. The message never contains the value."""


class SecretUnavailable(SecretError):
    """The secret is wiped (before a snapshot) or its last reload failed."""


def _read_file_into(path: str) -> bytearray:
    """Read ``path`` straight into a new bytearray (no intermediate ``bytes``): a regular
    file only, opened without blocking (a FIFO would hang the reload), at most
    :data:`MAX_SECRET_BYTES`."""
    try:
        return read_regular(path, MAX_SECRET_BYTES)
    except OSError as exc:
        raise SecretError(f"cannot read secret file {path}: {exc.strerror or exc}") from None


class Secret:
    """A value kept out of snapshot images. Create with :meth:`from_env`,
    :meth:`from_file` or :meth:`from_callable`.

    ``strip``: remove one trailing newline (files and commands usually end with one).
    Off by default: the value stays byte for byte what the source gave (a binary key
    must), trailing newline included — pass ``strip=True`` for a text token sent in a
    header or compared as a password.
    ``on_wiped``/``timeout``: what reading does while the value is wiped.
    ``required``: whether a failed reload after restore makes the process ``degraded``.
    """

    def __init__(
        self,
        loader: Callable[[], bytes | bytearray | str],
        *,
        name: str,
        source: str = "callable",
        on_wiped: OnWiped = "block",
        timeout: float = 10.0,
        required: bool = True,
        strip: bool = False,
        wipe_wait: float = 2.0,
        engine: Engine | None = None,
        load: bool = True,
        allow_empty: bool = False,
    ) -> None:
        if on_wiped not in ("block", "raise"):
            raise ValueError("on_wiped must be 'block' or 'raise'")
        # Checked before the value is loaded: a name the hooks refuse used to leave a
        # loaded, never-wiped buffer behind.
        if not isinstance(name, str) or not name or not name.isprintable():
            raise TypeError(f"secret name must be a non-empty string of printable "
                            f"characters, not {shown(name)}")
        if not callable(loader):
            raise TypeError(f"secret {name!r}: loader must be callable")
        # Here, under its own name: the registry checked it only as the wipe hook's
        # timeout (wipe_wait + 5 s), naming "timeout" and a value nobody passed.
        wipe_wait = seconds(wipe_wait, "wipe_wait", zero_ok=True)
        # and here, not at the first blocked read: a bad value raised there, in the
        # application's request, a TypeError from the clock arithmetic
        timeout = seconds(timeout, "timeout", zero_ok=True)
        self.name = name
        self.source = source
        self.on_wiped: OnWiped = on_wiped
        self.timeout = timeout
        self.required = required
        self.strip = strip
        self.allow_empty = allow_empty
        self.wipe_wait = wipe_wait
        self._loader = loader
        self._cond = threading.Condition()
        self._buf: bytearray | None = None
        self._form_cache: frozenset[str] | None = None
        """The value's forms (:meth:`_forms`), made at the first redaction of a text that
        mentions the value and dropped with it (wipe, reload, close). Text copies of the
        value, which nobody can zero: freed, they stay in the heap, and a snapshot image
        would hold them — so they are made only for a text that holds the value already."""
        self._previous: bytearray | None = None
        """A copy of the value a load replaced (a rotation): an application's client may
        still hold and quote the old value until it is refreshed. Kept only until the end
        of the run that rotated it (:meth:`SecretsManager._run_ended`), or the next wipe
        or close, then zeroed; never across a snapshot."""
        self._previous_forms: frozenset[str] | None = None
        """The forms of :attr:`_previous`, made as :attr:`_form_cache` is."""
        self._views: dict[int, int] = {}
        """Open views by buffer (``id``: a buffer with an open view is alive, held by the
        view), of every thread: a wipe or reload waits only for those of the buffer it
        retires, not for views of the value that replaced it."""
        self._retiring: dict[int, bytearray] = {}
        """Buffers taken out of ``_buf`` (no new view of them opens) whose open views have
        not all closed yet: the last view to close zeroes one, or its retirer does at
        ``wipe_wait``."""
        self._wipes = 0
        """Wipes waiting for views (by the lock; none in a forked child: they stayed in
        the parent): a read by a holder of one of those views fails at once."""
        self._local = threading.local()
        self._epoch = object()  # new in a forked child: the parent threads' views stay out
        # A parent thread may hold the lock at fork() or have a view open: in the child
        # the lock would be held for ever, and each wipe and reload would wait wipe_wait
        # for that view, which nobody there can close.
        fresh_lock_after_fork(self, "_cond", after=Secret._own_readers_only)
        self._reason = "not loaded yet"
        self._closed = False  # by _cond: once True, nothing loads and every read fails
        self.loads = 0
        """How many times the value was loaded."""
        self.last_error = ""
        """Why the latest failed load failed (the source's error, never the value)."""
        self._manager = manager(engine)
        self._hooks: tuple[Hook, ...] = ()
        """Its restore hook, then its before-snapshot hook (once registered)."""
        # Name and hooks before the value: a before-snapshot pass that starts once the
        # value is stored runs this secret's wipe hook, and one that started before makes
        # the load keep nothing. Registered after the load, a pass that came in between
        # (another thread's snapshot) left the value in the image.
        self._manager.add(self)
        if not load:
            return
        if self._manager.engine.snapshot_pending:
            # Loaded now, the value would be written into the coming snapshot image.
            self._reason = _CREATED_PENDING
            return
        try:
            self._load(keep_previous=False, raise_errors=True, creating=True)
        except BaseException:
            # Never made: nothing of it stays registered, and nothing keeps a value (its
            # restore hook may have loaded one meanwhile, and the object may live on in
            # the exception's traceback): closed and wiped first, or unregistered it
            # would hold the value through every later snapshot.
            try:
                with self._cond:
                    self._closed = True
                self.wipe()
            finally:
                self._manager.remove(self)
            raise

    # -- constructors ---------------------------------------------------------------

    @classmethod
    def from_env(cls, key: str, *, name: str | None = None, **kwargs: Any) -> Secret:
        """The value of environment variable ``key``, re-read after every restore (after
        the ``ENVIRONMENT`` phase applied the new spec environment).

        ``name`` defaults to ``key``. The name (never the value) is shown wherever the
        secret is: ``status()["secrets"]``, its ``rehydrate.secret:<name>`` hooks in a
        report — both in the readiness gate's public status view — log lines and
        ``[redacted secret 'NAME']``. Pass ``name=`` when the variable's name itself
        should not be shown (``DB_PASSWORD_PROD``: ``name="db"``)."""
        def load() -> bytes:
            value = os.environb.get(os.fsencode(key))
            if value is None:
                raise SecretError(f"environment variable {key} is not set")
            return value
        return cls(load, name=name or key, source=f"env:{key}", **kwargs)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, name: str | None = None,
                  **kwargs: Any) -> Secret:
        """The contents of ``path``, read straight into the secret's buffer."""
        p = os.fspath(path)

        def load() -> bytearray:
            return _read_file_into(p)
        return cls(load, name=name or os.path.basename(p), source=f"file:{p}", **kwargs)

    @classmethod
    def from_callable(cls, fn: Callable[[], bytes | bytearray | str], *,
                      name: str | None = None, **kwargs: Any) -> Secret:
        """Whatever ``fn()`` returns (``str`` is UTF-8 encoded). A returned ``bytearray`` is
        wiped after being copied into the secret's buffer."""
        if not callable(fn):
            raise TypeError(f"from_callable needs a callable returning the value, not "
                            f"{type(fn).__name__}")
        label = name or str(getattr(fn, "__name__", "secret"))
        return cls(fn, name=label, source="callable",
                   **kwargs)

    # -- loading / wiping ------------------------------------------------------------

    def _fetch(self) -> bytearray:
        value = self._loader()
        if isinstance(value, str):
            value = value.encode()
        if not isinstance(value, (bytes, bytearray)):
            raise SecretError(f"secret {self.name!r}: source returned {type(value).__name__}, "
                              "expected bytes, bytearray or str")
        buf = bytearray(value)
        if isinstance(value, bytearray):
            value[:] = bytes(len(value))
        if self.strip and buf.endswith(b"\n"):
            del buf[-1:]
            if buf.endswith(b"\r"):
                del buf[-1:]
        if not buf and not self.allow_empty:
            # A secret file caught half-written (truncated, then written) or a variable
            # set to nothing: served, every request went out with an empty token while
            # the process said ready.
            raise SecretError(f"secret {self.name!r}: {self.source} gave an empty value "
                              "(a file written halfway, a variable set to nothing?); pass "
                              "allow_empty=True if an empty value is valid")
        return buf

    def _load(self, *, keep_previous: bool, raise_errors: bool,
              creating: bool = False) -> bool:
        """Fetch the value and store it, unless a snapshot pass, a restore or close()
        came while it was fetched (then discarded). ``creating``: the first load, from
        the constructor — a pass or a restore that came meanwhile does not make it raise:
        after a pass the secret stays wiped until the restore, as one created after the
        pass; a restore ran this secret's own restore hook (registered before this load),
        whose load of the clone's value stands."""
        if self._closed:  # its hooks are gone: a value loaded now would never be wiped
            self.last_error = _CLOSED
            if raise_errors:
                raise SecretUnavailable(f"secret {self.name!r} is {_CLOSED}")
            return False
        reason: str | None = None
        engine = self._manager.engine
        generation = engine.generation  # before fetching: a source may take long
        began = time.monotonic()
        try:
            fresh = self._fetch()
        except Exception as exc:
            reason = str(exc) if isinstance(exc, SecretError) else (
                f"source of secret {self.name!r} failed: {type(exc).__name__}"
            )
        if reason is not None:
            # Handled out here, not in the except block: an error raised there would keep
            # the source's exception (its message, perhaps the value) as __context__.
            self.last_error = reason
            if not keep_previous and self._buf is not None:
                # A restored clone must not go on serving the snapshot's value. Readers
                # fail at once with the reason meanwhile: no reload is coming.
                self._wipe(reason)
            with self._cond:
                if not (keep_previous and self._buf is not None) and not self._closed:
                    self._reason = reason
                self._cond.notify_all()  # blocked readers now fail with the reason
            if raise_errors:
                raise SecretError(reason) from None
            return False
        with self._cond:
            # A before-snapshot pass that came while this load ran: keeping the value
            # would write it into the image. A restore since it began: the value is the
            # image's (every clone's), and the restore's own load has the clone's.
            restored = engine.generation != generation
            closed = self._closed  # close() came while the source was read
            pending = engine.snapshot_pending or restored or closed
            # The constructor's load overtaken by a pass or a restore: no error. Its
            # hooks cover both — the restore's load (or its failure) is what counts.
            created_pending = creating and pending and not closed
            if created_pending and not restored:
                self._reason = _CREATED_PENDING
            if not pending:
                old = self._buf
                if old is not None and old != fresh:  # a reload of the same value: none
                    self._clear_previous()
                    self._previous = bytearray(old)  # the copy is zeroed, unlike forms
                    self._previous_forms = self._form_cache
                self._form_cache = None
                self._buf = fresh  # a new buffer: views of the old one may still be open
                self.loads += 1
                self._reason = ""
                self._cond.notify_all()
                # Under this lock (a later run's hook for this secret takes it too), and
                # only when the failed run began before this load: a load begun earlier
                # (a resume keeps the generation) may hold what that run rejected. By
                # record, not name: a user hook named like this one is not this secret's.
                if self._hooks:
                    engine.recovered(self._hooks[0], since=began)
                if old is not None and self._holds(old):
                    # This thread (a task on its loop) holds a view of it, which cannot
                    # close while this reload waits: waiting would only end in zeroing
                    # the value under that view. Its last view zeroes it; a wipe waits.
                    self._retiring[id(old)] = old
                elif old is not None:
                    # In this block: a wipe that comes meanwhile finds it retiring and
                    # waits for it too, so no pass returns with the old value unzeroed.
                    self._retire(old, every=False,
                                 what="a view of the previous value; wiping it under them")
        if pending:
            _zero(fresh)
            why = _CLOSED if closed else _RESTORED if restored else _PENDING
            self.last_error = why
            if raise_errors and not created_pending:
                raise SecretError(f"secret {self.name!r}: {why}")
            return False
        return True

    def reload(self) -> bool:
        """Load the value again now. On failure the previous value is kept (one log line)
        and False returned. Between a before-snapshot pass and the next restore/resume it
        loads nothing (the value would be written into the image): False, one line. A
        success after this secret's restore hook failed in the last run forgets that
        failure (:meth:`~rehydrate.Lifecycle.recovered`, by the hook's record)."""
        if self._manager.engine.snapshot_pending:
            self.last_error = _PENDING
            log.warning("secret %s: not reloaded: %s", self.name, _PENDING)
            return False
        ok = self._load(keep_previous=True, raise_errors=False)
        if not ok:
            log.warning("secret %s: reload failed (%s); %s", self.name, self.last_error,
                        "keeping the previous value" if self.available
                        else "it stays unavailable")
        return ok

    def wipe(self) -> None:
        """Overwrite the value with zeros now: it is taken away first (a read from then on
        blocks or raises per ``on_wiped``), then zeroed once the views open on it have
        closed, waiting up to ``wipe_wait`` s for them. Returns once no buffer of this
        secret holds a value (one a reload is retiring included)."""
        self._wipe(_WIPED)

    def _wipe(self, reason: str) -> None:
        """:meth:`wipe`, with ``reason`` what reads say meanwhile (and after, unless
        closed)."""
        with self._cond:
            buf, self._buf = self._buf, None
            self._form_cache = None
            self._clear_previous()
            self._reason = _CLOSED if self._closed else reason
            self._cond.notify_all()  # after close(), blocked readers fail now, not at timeout
            self._wipes += 1
            try:
                self._retire(buf, every=True, what="a view; wiping under them")
            finally:
                self._wipes -= 1

    def _retire(self, buf: bytearray | None, *, every: bool, what: str) -> None:
        """With the lock held and ``buf`` out of ``_buf`` (no new view of it opens): zero
        it once its open views have closed, waiting up to ``wipe_wait`` for them and then
        zeroing it under them (one warning). ``every``: wait for (and zero) the buffers
        other calls are retiring too."""
        if buf is not None:
            if self._views.get(id(buf)):
                self._retiring[id(buf)] = buf
            else:
                _zero(buf)

        def done() -> bool:
            return not self._retiring if every else (
                buf is None or id(buf) not in self._retiring)

        if done() or self._cond.wait_for(done, self.wipe_wait):
            return
        left = (list(self._retiring.items()) if every or buf is None
                else [(id(buf), buf)])
        log.warning("secret %s: %d reader(s) still hold %s", self.name,
                    sum(self._views.get(k, 0) for k, _ in left), what)
        for k, b in left:
            del self._retiring[k]
            _zero(b)
        # A wipe waiting alongside (every=True) may have nothing left to wait for now.
        self._cond.notify_all()

    def _view_closed(self, key: int) -> None:
        """With the lock held: one view of buffer ``key`` closed; the last one of a
        retiring buffer zeroes it."""
        n = self._views.get(key, 0) - 1
        if n > 0:
            self._views[key] = n
            return
        self._views.pop(key, None)
        buf = self._retiring.pop(key, None)
        if buf is not None:
            _zero(buf)

    def _holds(self, *bufs: bytearray) -> bool:
        """With the lock held: whether this thread (with ``asyncio``, a task on its loop)
        has a view of one of ``bufs`` open."""
        mine = self._local.__dict__.get("reads")
        return (mine is not None and mine.epoch is self._epoch and mine.pid == os.getpid()
                and any(mine.open.get(id(b)) for b in bufs))

    @property
    def _readers(self) -> int:
        """Open views of every buffer, counted in this process."""
        return sum(self._views.values())

    @property
    def available(self) -> bool:
        return self._buf is not None

    # -- reading ---------------------------------------------------------------------

    def _wait(self) -> bytearray:
        """Called with the lock held: the buffer, waiting or raising per ``on_wiped``."""
        if self._buf is None:
            # "wiped…": a reload is coming (never for a closed secret: its reason says so)
            if self._reason.startswith("wiped") and self._hooks:
                early = running_before(self._hooks[0])
                if early is not None:  # the reload comes only once this hook returns
                    reload = self._hooks[0]
                    raise SecretUnavailable(
                        f"secret {self.name!r} is unavailable to hook {early.name!r} "
                        f"(phase {early.phase}, order {early.order}): it is wiped until "
                        f"its reload {reload.name!r} (phase {reload.phase}, order "
                        f"{reload.order}), which this run starts only after that hook "
                        f"returns; read it from a hook of a later phase, or of phase "
                        f"{reload.phase} with a higher order")
                late = running_after(self._hooks[1]) if len(self._hooks) > 1 else None
                if late is not None:  # nothing reloads it before this pass has ended
                    wipe = self._hooks[1]
                    raise SecretUnavailable(
                        f"secret {self.name!r} is unavailable to hook {late.name!r} "
                        f"(phase {late.phase}, order {late.order}): it is wiped for the "
                        f"snapshot by {wipe.name!r} (phase {wipe.phase}, order "
                        f"{wipe.order}), which this before-snapshot run ran earlier; read "
                        f"it from a hook of a later phase, or of phase {wipe.phase} with "
                        f"a higher order (before a snapshot they run before the wipe)")
            if self.on_wiped == "block" and self._reason.startswith("wiped"):
                deadline = time.monotonic() + self.timeout
                while self._buf is None and self._reason.startswith("wiped"):
                    # Checked at every wake: a wipe may begin while this read blocks.
                    if self._wipes and self._holds(*self._retiring.values()):
                        # A wipe waits for this thread's view (with asyncio: for a view
                        # of any task on this loop), which cannot close while this read
                        # blocks for the reload: the wipe would zero the buffer under it
                        # at wipe_wait.
                        raise SecretUnavailable(
                            f"secret {self.name!r} is unavailable ({self._reason}), and "
                            "this thread (or another task on its event loop) holds a view "
                            "of the value being wiped, which the wipe waits for: a read "
                            "blocking here until the reload would keep that view open. "
                            "Read through the view already open, or retry after the "
                            "reload (asyncio code: pass on_wiped='raise')")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            if self._buf is None:
                raise SecretUnavailable(f"secret {self.name!r} is unavailable: {self._reason}")
        return self._buf

    def get(self) -> bytes:
        """A copy of the value. rehydrate cannot wipe this copy: prefer ``with secret``."""
        with self._cond:
            return bytes(self._wait())

    def get_str(self, encoding: str = "utf-8") -> str:
        """The value decoded (also a copy rehydrate cannot wipe). A value that is not
        valid in ``encoding`` raises :class:`SecretError` naming the offset of the first
        bad byte (``UnicodeDecodeError`` would carry the whole value)."""
        value = self.get()
        try:
            return value.decode(encoding)
        except UnicodeDecodeError as exc:
            offset = exc.start
        # raised outside the handler: the original would stay attached as __context__
        raise SecretError(f"secret {self.name!r} is not valid {encoding} "
                          f"(byte at offset {offset})")

    @contextlib.contextmanager
    def view(self) -> Iterator[memoryview]:
        """A read-only ``memoryview`` of the value itself (no copy), valid inside the block."""
        mine = self._local.__dict__.get("reads")
        if mine is None:
            mine = self._local.__dict__["reads"] = _Reads(self._epoch)
        with self._cond:
            buf = self._wait()
            key = id(buf)
            self._views[key] = self._views.get(key, 0) + 1
            mine.open[key] = mine.open.get(key, 0) + 1
        mv = memoryview(buf).toreadonly()
        try:
            yield mv
        finally:
            mv.release()
            # Only this process's views count. A parent thread's view, in a child of
            # fork(), closes when CPython frees that thread's state (in the fork itself,
            # before the locks are new: no lock taken then) or at a later garbage
            # collection (after _own_readers_only() counted it out) — never counted down.
            if mine.epoch is self._epoch and mine.pid == os.getpid():
                with self._cond:
                    self._view_closed(key)
                    if mine.open[key] > 1:
                        mine.open[key] -= 1
                    else:
                        del mine.open[key]
                    self._cond.notify_all()

    def _own_readers_only(self) -> None:
        """In a forked child: count only the views of the thread that forked (the others'
        threads are not there to close theirs), and make the views opened before the
        fork by other threads not count when they close."""
        self._epoch = object()
        self._wipes = 0
        mine = self._local.__dict__.get("reads")
        if mine is None:
            self._views = {}
        else:
            mine.epoch, mine.pid = self._epoch, os.getpid()
            self._views = dict(mine.open)
        # A buffer a parent thread was retiring: that thread is not here to zero it. One
        # this thread still views is zeroed when that view closes.
        for k, b in list(self._retiring.items()):
            if not self._views.get(k):
                del self._retiring[k]
                _zero(b)

    def __enter__(self) -> memoryview:
        cm = self.view()
        mv = cm.__enter__()
        # Per context, not per thread: asyncio tasks interleave on one thread, and with a
        # thread's stack a task leaving its block closed the view another task held.
        _entered.set((*_entered.get(), (self, cm)))
        return mv

    def __exit__(self, *exc: object) -> None:
        stack = _entered.get()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is self:
                break
        else:
            raise RuntimeError(f"secret {self.name!r}: __exit__ without a matching "
                               "__enter__ in this context (`with secret:` is entered and "
                               "left in the same thread or asyncio task; for a view "
                               "opened in one task and closed in another use "
                               "secret.view())")
        cm = stack[i][1]
        _entered.set(stack[:i] + stack[i + 1:])
        cm.__exit__(None, None, None)

    def _forms(self, text: bytes) -> frozenset[str]:
        """How ``text`` (an error message, UTF-8) may quote the value
        (:func:`~rehydrate._redact.value_forms`), or the value a rotation replaced during
        the current run; none while it is wiped or closed. Made only when ``text``
        mentions the value (:func:`_mentioned`) — every failed hook asks, about every
        secret, and the forms are copies nobody can zero — then kept with the value until
        its wipe, reload or close (~20 forms per secret, made once)."""
        with self._cond:
            if self._closed:
                return frozenset()
            forms: frozenset[str] = frozenset()
            if self._buf is not None:
                if self._form_cache is None and _mentioned(self._buf, text):
                    self._form_cache = frozenset(value_forms(bytes(self._buf)))
                forms = self._form_cache or forms
            if self._previous is not None:
                if self._previous_forms is None and _mentioned(self._previous, text):
                    self._previous_forms = frozenset(value_forms(bytes(self._previous)))
                forms |= self._previous_forms or frozenset()
            return forms

    def _clear_previous(self) -> None:
        """Zero and forget the replaced value (under ``_cond``)."""
        if self._previous is not None:
            _zero(self._previous)
        self._previous = None
        self._previous_forms = None

    def _drop_previous(self) -> None:
        with self._cond:
            self._clear_previous()

    def __repr__(self) -> str:
        state = "loaded" if self._buf is not None else "unavailable"
        return f"<Secret {self.name!r} source={self.source} {state}>"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("Secret objects cannot be pickled")

    def close(self) -> None:
        """Wipe the value and stop managing this secret (idempotent). Reading it afterwards
        raises :class:`SecretUnavailable` saying it is closed, at once (also for
        ``on_wiped="block"``: no reload is coming), and nothing loads it again."""
        with self._cond:
            self._closed = True
        self.wipe()
        self._manager.remove(self)

    def __del__(self) -> None:
        # Dropped without close(): the buffer would stay in freed heap memory — and in
        # every snapshot image taken later. (No locks here: nobody else holds the object.)
        bufs = [getattr(self, "_buf", None), *getattr(self, "_retiring", {}).values()]
        for buf in bufs:
            if buf is not None:
                with contextlib.suppress(Exception):  # at interpreter exit globals may be gone
                    _zero(buf)


_entered: contextvars.ContextVar[tuple[tuple[Secret, contextlib.AbstractContextManager[
    memoryview]], ...]] = contextvars.ContextVar("rehydrate_secret_views", default=())
"""The views ``with secret:`` opened in this context, innermost last: each asyncio task
(and each thread) has its own, so its ``__exit__`` closes its own view. Immutable tuples:
a task's context is a copy of its creator's, and a list would be shared by both."""


class _Reads:
    """One thread's open views of a secret by buffer, and the process they count in. Not
    the thread-local dict itself: a view's generator holding that dict would make a cycle,
    keeping a dead thread's views open until a garbage collection."""

    __slots__ = ("epoch", "open", "pid")

    def __init__(self, epoch: object) -> None:
        self.open: dict[int, int] = {}
        self.epoch = epoch
        self.pid = os.getpid()


_ALNUM = re.compile(rb"[A-Za-z0-9]+")
_CORE_MIN = 6
"""A value whose longest run of ASCII letters and digits is shorter is taken to be
mentioned by every text (its forms are made): too short a run is found by chance."""


def _mentioned(value: bytearray, text: bytes) -> bool:
    """Whether ``text`` may quote ``value`` in one of its forms: every form (UTF-8,
    repr- and JSON-escaped, URL-encoded) keeps ASCII letters and digits as they are, so
    one that is in ``text`` has the value's longest such run in it. Looked up through a
    view of ``value``: no copy of it is made."""
    start, end = max((m.span() for m in _ALNUM.finditer(value)),
                     key=lambda span: span[1] - span[0], default=(0, 0))
    if end - start < _CORE_MIN:
        return True
    with memoryview(value) as view, view[start:end] as core:
        return text.find(core) >= 0


def _zero(buf: bytearray) -> None:
    n = len(buf)
    try:
        buf[:] = bytes(n)
    except BufferError:  # pragma: no cover - same-size assignment never resizes
        for i in range(n):
            buf[i] = 0


def utf8_into(text: str) -> bytearray:
    """``text`` encoded as UTF-8 straight into a new ``bytearray`` the caller wipes.

    Written out by hand because ``str.encode`` returns an immutable ``bytes`` copy that
    stays in freed memory (and so in a snapshot image) after use. A lone surrogate, which
    ``str.encode`` refuses too, is a ``ValueError`` (without the text)."""
    size = 0
    for ch in text:
        c = ord(ch)
        size += 1 if c < 0x80 else 2 if c < 0x800 else 3 if c < 0x10000 else 4
    out = bytearray(size)
    i = 0
    for ch in text:
        c = ord(ch)
        if c < 0x80:
            out[i] = c
            i += 1
        elif c < 0x800:
            out[i], out[i + 1] = 0xC0 | c >> 6, 0x80 | c & 0x3F
            i += 2
        elif c < 0x10000:
            if 0xD800 <= c < 0xE000:
                _zero(out)
                raise ValueError("text with a lone surrogate is not encodable as UTF-8")
            out[i], out[i + 1], out[i + 2] = (0xE0 | c >> 12, 0x80 | (c >> 6) & 0x3F,
                                              0x80 | c & 0x3F)
            i += 3
        else:
            out[i], out[i + 1], out[i + 2], out[i + 3] = (
                0xF0 | c >> 18, 0x80 | (c >> 12) & 0x3F, 0x80 | (c >> 6) & 0x3F,
                0x80 | c & 0x3F)
            i += 4
    return out


class SecretSource:
    """Where a value needed now and then (a private key's password) comes from, so that
    it is held only while it is used.

    * a :class:`Secret`: lent as a view of the secret's own buffer (no copy). The secret
      is wiped before a snapshot and reloaded after restore, before the ``SECRETS``-phase
      users that come after it (certificates) read it;
    * a callable returning ``bytes``, ``bytearray`` or ``str``: called at every use; the
      result is lent and wiped right after (a returned ``bytearray`` itself; ``bytes``
      and ``str`` results are copied into a buffer that is wiped — the callable's own
      object cannot be);
    * plain ``bytes``, ``bytearray`` or ``str``: copied now into a buffer rehydrate owns
      (the caller's object is not kept) and lent at every use until :meth:`wipe`
      (:attr:`spent` is then True and later uses get ``None``). That buffer has to
      survive a snapshot to be used after the restore, so the value is in every
      snapshot image: pass a :class:`Secret` or a callable to keep it out. The caller's
      own object cannot be wiped by rehydrate (``bytes``/``str`` are immutable).

    ``repr`` never shows the value; errors name the source, never the value.
    """

    def __init__(self, value: Secret | Callable[[], bytes | bytearray | str] | bytes
                 | bytearray | str, *, what: str = "password") -> None:
        self.what = what
        self._secret: Secret | None = None
        self._loader: Callable[[], bytes | bytearray | str] | None = None
        self._plain: bytearray | None = None
        if isinstance(value, Secret):
            self._secret, self.kind = value, "secret"
        elif isinstance(value, (bytes, bytearray)):
            self._plain, self.kind = bytearray(value), "plain"
        elif isinstance(value, str):
            try:
                self._plain = utf8_into(value)
            except ValueError as exc:
                raise ValueError(f"{what}: {exc}") from None
            self.kind = "plain"
        elif callable(value):
            self._loader, self.kind = value, "callable"
        else:
            raise TypeError(f"{what} must be a rehydrate.secrets.Secret, a callable "
                            "returning bytes, or bytes/bytearray/str, not "
                            f"{type(value).__name__}")
        self.spent = False
        """True once a plain value was wiped: it cannot be lent again."""

    @property
    def secret(self) -> Secret | None:
        """The :class:`Secret` behind this source, if it is one."""
        return self._secret

    def __repr__(self) -> str:
        detail = (f" {self._secret.name!r}" if self._secret is not None
                  else " spent" if self.spent else "")
        return f"<SecretSource {self.what}: {self.kind}{detail}>"

    def __reduce__(self) -> Any:
        raise TypeError("SecretSource objects cannot be pickled")

    @contextlib.contextmanager
    def lend(self) -> Iterator[memoryview | None]:
        """The value as a read-only ``memoryview`` for the block, released after it (a
        callable's result also wiped); ``None`` for a plain value already wiped. Raises
        :class:`SecretError` (one line naming the source, never the value) when the source
        fails."""
        if self._secret is not None:
            with self._secret.view() as view:  # SecretUnavailable is a SecretError
                yield view
            return
        if self._loader is None:
            if self._plain is None:
                yield None
                return
            with memoryview(self._plain).toreadonly() as kept:
                yield kept
            return
        buf = self._call()
        view = memoryview(buf).toreadonly()
        try:
            yield view
        finally:
            view.release()
            _zero(buf)

    def _call(self) -> bytearray:
        assert self._loader is not None
        reason = None
        try:
            value = self._loader()
        except Exception as exc:
            reason = (str(exc) if isinstance(exc, SecretError)
                      else f"the {self.what} callable failed: {type(exc).__name__}")
        if reason is not None:  # out here: no exception carries the source's message
            raise SecretError(reason)
        if isinstance(value, bytearray):
            return value  # handed over: wiped after use, like Secret.from_callable's
        if isinstance(value, bytes):
            return bytearray(value)
        if isinstance(value, str):
            try:
                return utf8_into(value)
            except ValueError as exc:
                raise SecretError(f"the {self.what} callable's result: {exc}") from None
        raise SecretError(f"the {self.what} callable returned {type(value).__name__}, "
                          "expected bytes, bytearray or str")

    def wipe(self) -> None:
        """Wipe a plain value now, used or not (nothing to do for the other kinds)."""
        buf, self._plain = self._plain, None
        if buf is not None:
            _zero(buf)
            self.spent = True

    def __del__(self) -> None:
        buf = getattr(self, "_plain", None)
        if buf is not None:
            with contextlib.suppress(Exception):  # at interpreter exit globals may be gone
                _zero(buf)


class SecretsManager:
    """The secrets of one engine: a wipe hook and a reload hook per secret."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.enabled = True
        self._lock = threading.Lock()
        fresh_lock_after_fork(self)  # a parent thread may hold it at fork()
        self._secrets: dict[int, weakref.ref[Secret]] = {}
        engine.add_status("secrets", self._status)
        engine.add_listener(self._run_ended)
        # Process-wide and held weakly: a hook of any engine may quote this engine's
        # secrets, and the registration ends with this manager.
        add_redactor(self._redact, weak=True)

    def _redact(self, text: str) -> str:
        """``text`` with the value of every loaded secret of this manager replaced by
        ``[redacted secret 'name']`` (the forms :func:`~rehydrate._redact.value_forms`
        lists; a value shorter than 8 characters is left alone)."""
        data = text.encode("utf-8", "surrogatepass")
        named = [(form, s.name) for s in self.secrets() for form in s._forms(data)]
        return replace_forms(text, named) if named else text

    def _run_ended(self, report: Report) -> None:
        """A run's report is out: the values its reloads replaced are no longer looked
        for (an application hook of that run may have quoted one; later, its clients
        hold the new value)."""
        for s in self.secrets():
            s._drop_previous()

    @property
    def active(self) -> bool:
        return self.enabled and not is_disabled("secrets")

    def _status(self) -> dict[str, Any]:
        return {s.name: {"source": s.source, "available": s.available}
                for s in self.secrets()}

    def secrets(self) -> list[Secret]:
        with self._lock:
            refs = list(self._secrets.values())
        return [s for s in (r() for r in refs) if s is not None]

    def add(self, secret: Secret, *, loaded_since: float | None = None) -> None:
        """Take ``secret``'s name and register its hooks: a :class:`ValueError` when
        another secret of the engine has the name. ``loaded_since``: ``time.monotonic()``
        when the load that gave it its value began (None: it has none yet; a load once
        the hooks are registered mends a failure under its name itself)."""
        key = id(secret)
        ref = weakref.ref(secret)
        name = secret.name
        with self._lock:  # the check and the claim as one: two threads, one name
            if any(s is not None and s.name == name
                   for s in (r() for r in self._secrets.values())):
                raise ValueError(f"a secret named {name!r} is already managed (status() "
                                 "and its hooks go by the name: give this one another "
                                 "name=)")
            self._secrets[key] = ref

        def on_restore(ctx: RestoreContext) -> None:
            s = ref()
            if s is None:
                return
            if not self.active and s.available:
                return
            # A clone restored without a before-snapshot pass still holds the image's value:
            # when its reload fails that value (perhaps revoked since) must not be served.
            # The original resuming keeps its own.
            s._load(keep_previous=ctx.kind != "restore", raise_errors=True)

        def on_snapshot() -> None:
            s = ref()
            if s is None:
                return
            if not self.active:
                log.info("secrets disabled: secret %s NOT wiped before snapshot", s.name)
                return
            s.wipe()

        hook_name = f"rehydrate.secret:{name}"
        b = self.engine.builtins
        try:
            secret._hooks = (b.register(on_restore, phase=Phase.SECRETS, order=-200,
                                        name=hook_name, required=secret.required,
                                        timeout=30.0),)
            secret._hooks += (b.register(on_snapshot, event="snapshot", phase=Phase.SECRETS,
                                         order=-200, name=hook_name,
                                         required=secret.required,
                                         timeout=min(secret.wipe_wait + 5.0,
                                                     MAX_SECONDS)),)
        except BaseException:
            self._forget(key, secret._hooks)  # a wipe_wait the registry refuses
            secret._hooks = ()
            raise
        weakref.finalize(secret, self._forget, key, secret._hooks)
        if loaded_since is not None:
            # Made again under the name of a secret closed after its restore hook failed:
            # this value mends that failure (see Lifecycle.recovered), which no reload of
            # the closed one can (its hooks are gone).
            self.engine.recovered(secret._hooks[0], since=loaded_since)

    def _forget(self, key: int, hooks: tuple[Hook, ...]) -> None:
        # The hooks first: once the name is free, a secret made under it must find the
        # failure it takes over unregistered.
        for h in hooks:
            self.engine.builtins.unregister(h)
        with self._lock:
            self._secrets.pop(key, None)

    def remove(self, secret: Secret) -> None:
        """Unregister ``secret``'s hooks and forget it. A failure of its restore hook is
        left for a secret made again under its name to mend (see
        :meth:`~rehydrate.Lifecycle.recovered`), or for the next restore run: closing is
        no sign that what failed works."""
        self._forget(id(secret), secret._hooks)


def manager(engine: Engine | None = None) -> SecretsManager:
    """The secrets manager of ``engine`` (default: the process-wide engine)."""
    return resolve_engine(engine).extension("secrets", SecretsManager)


key = "secrets"


def probe() -> Probe:
    """Always usable: secrets live in memory rehydrate can wipe."""
    return Probe(True)


def install(engine: Engine) -> None:
    """Attach the secrets manager to ``engine`` now (its functions also do on first use)."""
    manager(engine)
