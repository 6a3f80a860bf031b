"""Redaction of sensitive values from error text. Private: extensions use it through
:func:`rehydrate.extensions.add_redactor` and :func:`rehydrate.extensions.redact`.

The engine core knows nothing of what is sensitive (it must not import the secrets
manager, see docs/architecture.md): a manager that holds sensitive values registers a
*redactor* here, a function from text to text, and the engine passes every hook error
through :func:`redact_error` where the error is recorded — before its text reaches a log
line, a report, ``status()``, a telemetry span or a readiness gate's answer. That also
leaves out the user info and query strings of the URLs a hook error quotes (a password or
an ``api_key=`` from ``DATABASE_URL``, which no manager knows), as a connection's errors.

The registry is process-wide, not per engine: a hook of any engine may quote the value of
a secret another engine manages.
"""

from __future__ import annotations

import builtins
import collections
import logging
import sys
import threading
import traceback
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ._context import RedactedError
from ._threads import fresh_lock_after_fork
from ._urls import scrub_urls

__all__ = ["MIN_REDACTED_LENGTH", "add_redactor", "redact", "redact_error", "redacted_stacktrace",
           "value_forms"]

log = logging.getLogger("rehydrate")

Redactor = Callable[[str], str]

MIN_REDACTED_LENGTH = 8
"""A value shorter than this (whitespace stripped) is not looked for: replacing every
``1``, ``on`` or ``admin`` in an error message would make it unreadable and hide nothing
worth hiding — such a value is guessed faster than read. A value is looked for as a
substring, not as a whole word: a text containing it (``postgres`` in
``postgres-exporter``) contains the value, and redacting it there shows nothing false."""

WITHHELD = "[message withheld: a redactor failed]"
"""The whole text, when a redactor raised: what it would have removed is not known."""

WALK_LIMIT = 1000
"""How many exceptions of one error's chain and groups are looked at (a pathological
chain must not hang a run); the ones a traceback shows first are looked at first."""

_lock = threading.Lock()
_redactors: dict[int, Callable[[], Redactor | None]] = {}
"""Redactor getters by registration number: a weakly held redactor's getter is a weak
reference (None once its object is gone), a strongly held one's returns the function."""
_next = 0
fresh_lock_after_fork(sys.modules[__name__])  # a parent thread may hold it at fork()


def add_redactor(fn: Redactor, *, weak: bool = False) -> Callable[[], None]:
    """Register ``fn(text) -> text``, which returns ``text`` without the values it knows
    to be sensitive; returns the function that unregisters it. ``fn`` is held until then;
    with ``weak=True`` it is held weakly (a bound method by its object: the object's end
    unregisters it — what a manager registering its own method wants, so as not to be
    kept alive by it; a :class:`TypeError` when the object cannot be referred to weakly).
    ``fn`` must not log what it removes, and must be quick (it runs for every failed
    hook)."""
    global _next
    if not callable(fn):
        raise TypeError(f"a redactor must be callable, not {type(fn).__name__}")
    getter: Callable[[], Redactor | None]
    if weak:
        try:
            if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
                getter = weakref.WeakMethod(fn)
            else:
                getter = weakref.ref(fn)
        except TypeError:
            raise TypeError(
                f"add_redactor(weak=True): a {type(getattr(fn, '__self__', fn)).__name__} "
                "cannot be referred to weakly (no __weakref__ slot); register it with "
                "weak=False and call the returned function to unregister it") from None
    else:
        def getter() -> Redactor | None:
            return fn
    with _lock:
        key = _next
        _next += 1
        _redactors[key] = getter

    def remove() -> None:
        with _lock:
            _redactors.pop(key, None)
    return remove


def _live() -> list[Redactor]:
    with _lock:
        getters = list(_redactors.items())
    found = []
    for key, getter in getters:
        fn = getter()
        if fn is None:
            with _lock:
                _redactors.pop(key, None)
        else:
            found.append(fn)
    return found


def redact(text: str) -> str:
    """``text`` passed through every registered redactor. When one raises, the whole text
    is replaced by :data:`WITHHELD` (one warning naming the exception's type, never its
    message: that could quote the text)."""
    for fn in _live():
        try:
            text = fn(text)
        except Exception as exc:
            log.warning("redactor %s failed (%s): an error message was withheld",
                        getattr(fn, "__qualname__", type(fn).__name__), type(exc).__name__)
            return WITHHELD
    return text


def _hide(text: str) -> str:
    """``text`` without the user info and query strings of the URLs it quotes
    (:func:`~rehydrate._urls.scrub_urls`), then :func:`redact`-ed: what a hook error is
    recorded without. A hook reading ``DATABASE_URL`` or calling ``https://…?api_key=…``
    fails with the password or the token in its message (requests, httpx's
    ``raise_for_status()``, a driver's DSN), and no secret manager knows that value. URLs
    first: the query scrub runs to a space or a quote, and cut a ``[redacted secret
    'name']`` that replaced a value in a query in two."""
    return redact(scrub_urls(text))


def _get(e: BaseException, name: str, default: Any = None) -> Any:
    """``getattr(e, name, default)``, also when the lookup raises something else than
    :class:`AttributeError` (a ``__getattr__`` forwarding to a dict raises ``KeyError``):
    a part that cannot be read shows nothing, and the rest of the error is still shown."""
    try:
        return getattr(e, name, default)
    except Exception:
        return default


def _own_texts(e: BaseException) -> Iterator[str]:
    """The texts of ``e`` itself a report, a log line or a traceback may show: ``str()``
    and ``repr()`` (a custom ``__str__`` may hide what ``repr()`` and ``args`` show), its
    string args, notes and string attributes (``OSError.filename``, a library's
    ``.response_text``)."""
    for show in (str, repr):
        try:
            yield show(e)
        except Exception:  # noqa: S112 - unformattable: it shows nothing of its own
            continue
    yield from (a for a in e.args if isinstance(a, str))
    notes = _get(e, "__notes__")
    if isinstance(notes, list):
        yield from (n for n in notes if isinstance(n, str))
    attributes = _get(e, "__dict__")
    if isinstance(attributes, dict):
        yield from (v for k, v in attributes.items() if isinstance(v, str) and k != "__notes__")
    if isinstance(e, OSError):
        yield from (v for k in ("strerror", "filename", "filename2")
                    if isinstance(v := _get(e, k), str))


def _links(e: BaseException) -> list[BaseException]:
    """What formatting ``e`` shows after (or before) its own text: its group's members,
    first one first (a traceback shows the first 15), then its cause and context."""
    members = _get(e, "exceptions")
    found = [m for m in members if isinstance(m, BaseException)] if isinstance(
        members, tuple) else []
    found.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return found


def _texts(exc: BaseException) -> Iterator[str]:
    """The texts that formatting ``exc`` may show: its own (:func:`_own_texts`) and those
    of its causes, contexts and (exception groups) members — what a traceback prints —
    breadth first, so that the bound meets only what a traceback would show last. An
    exception whose ``str()`` fails is walked on: its cause and notes are printed."""
    seen: set[int] = set()
    todo = collections.deque([exc])
    while todo and len(seen) < WALK_LIMIT:
        e = todo.popleft()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield from _own_texts(e)
        todo.extend(_links(e))


def _clean(exc: BaseException) -> bool:
    return all(_hide(t) == t for t in _texts(exc))


def _group_types() -> tuple[type[BaseException], ...]:
    if hasattr(builtins, "BaseExceptionGroup"):
        return (builtins.BaseExceptionGroup,)
    try:  # 3.10: the backport the engine's own reports use
        from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # pragma: no cover - a dependency on 3.10
        return ()
    return (BaseExceptionGroup,)  # type: ignore[no-any-return,unused-ignore]


_GROUPS = _group_types()
"""``BaseExceptionGroup``, the root of every exception group, where there is one."""

_kinds: weakref.WeakKeyDictionary[
    type[BaseException], weakref.ref[type[BaseException]] | None] = weakref.WeakKeyDictionary()
"""The redacted kind made for each original type (None where none could be made), both
held weakly: a type a test or a plugin makes and drops is not kept alive by the kind
made for it (which refers to it as its base), only by the errors of that kind."""
_kinds_lock = threading.Lock()
fresh_lock_after_fork(sys.modules[__name__], "_kinds_lock")


def _native(t: type[BaseException]) -> type[BaseException]:
    """The built-in exception type ``t`` is laid out as (``OSError`` for ``OSError``'s
    subclasses, ``BaseException`` for most): the one whose ``__new__`` and ``__init__``
    are C code that reads nothing but the args given; for a group, ``BaseExceptionGroup``,
    the backport's on 3.10)."""
    for group in _GROUPS:
        if issubclass(t, group):
            return group
    for base in t.__mro__:
        if base.__module__ == "builtins" and issubclass(base, BaseException):
            return base
    return BaseException  # pragma: no cover - every exception type has one


def _rebuild(original: type[BaseException], args: tuple[Any, ...],
             state: dict[str, Any]) -> BaseException:
    """What unpickling a redacted error gives: the same kind, made the same way."""
    out = _make(original, args, None, str(args[0]) if args else "")
    vars(out).update(state)
    return out


def _importable(t: type) -> bool:
    found: Any = sys.modules.get(t.__module__)
    for part in t.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is t


def _kind(original: type[BaseException]) -> type[BaseException] | None:
    """``Redacted<Name>(RedactedError, original)``: an instance is an instance of the
    type raised (``isinstance``, ``except``, ``except*`` and ``ExceptionGroup.split()``
    see it as one), whose ``str()`` and ``repr()`` are the built-in ones of its native
    layout (the original's own ``__str__`` may read attributes a redacted error does not
    have, or quote the value from elsewhere). None when no such type can be made (a
    layout conflict, a final type, a metaclass that refuses)."""
    with _kinds_lock:
        if original in _kinds:
            ref = _kinds[original]
            if ref is None or (made := ref()) is not None:
                return None if ref is None else made
    native = _native(original)

    def __reduce__(self: BaseException) -> tuple[Any, ...]:
        if _importable(original):
            # an OSError's filenames are not in its args: its constructor's args are
            args = self.args if isinstance(self, _GROUPS) else _args(self, native)
            return (_rebuild, (original, args, dict(vars(self))))
        # a local class cannot be looked up where it is unpickled: its plain stand-in
        state = {k: v for k, v in vars(self).items()
                 if k in ("__notes__", "redacted_stack")}
        return (RedactedError, (_show(self), getattr(self, "original_name", ""),
                                getattr(self, "original_type", "")), state)

    def __str__(self: BaseException) -> str:
        shown = vars(self).get("redacted_message")
        return shown if isinstance(shown, str) else native.__str__(self)

    try:
        made = types.new_class(
            f"Redacted{original.__name__}", (RedactedError, original), None,
            lambda ns: ns.update({
                "__module__": __name__, "__str__": __str__,
                "__repr__": native.__repr__, "__reduce__": __reduce__,
                # the type's own attribute hooks forward to what a stand-in does not
                # have (a client error's `__getattr__` to its response): they recursed
                "__getattr__": _no_attribute,
                "__getattribute__": object.__getattribute__,
                "__slots__": (), "_redacts": original}))
    except Exception:
        with _kinds_lock:
            _kinds[original] = None
        return None
    with _kinds_lock:
        # another thread's, made meanwhile, wins: one kind per type
        ref = _kinds.get(original)
        if ref is not None and (other := ref()) is not None:
            return other
        _kinds[original] = weakref.ref(made)
    return made


def _args(e: BaseException, native: type[BaseException]) -> tuple[Any, ...]:
    """``e``'s args redacted, as the native constructor takes them: an ``OSError``'s
    ``errno`` (and ``winerror``) kept as numbers, so that ``.errno`` still works; every
    other arg as its redacted ``str()``."""
    def text(a: Any) -> str:
        try:
            return _hide(a if isinstance(a, str) else str(a))
        except Exception:
            return f"[unformattable {type(a).__name__}]"

    if issubclass(native, OSError) and isinstance(e, OSError) and isinstance(e.errno, int):
        out: list[Any] = [e.errno, text(e.strerror)]
        filename2 = _get(e, "filename2")
        winerror = _get(e, "winerror")
        if e.filename is not None or filename2 is not None:
            out.append(None if e.filename is None else text(e.filename))
            out.append(winerror if isinstance(winerror, int) else None)
            if filename2 is not None:
                out.append(text(filename2))
        return tuple(out)
    return tuple(text(a) for a in e.args)


def _make(original: type[BaseException], args: tuple[Any, ...],
          members: list[BaseException] | None, shown: str) -> BaseException:
    """An instance of :func:`_kind` of ``original`` made by the native type's C
    constructor alone (never the original's ``__init__`` or ``__new__``: they would run
    again, on what was raised), or a plain :class:`RedactedError` showing ``shown``."""
    kind = _kind(original)
    if kind is not None:
        native = _native(original)
        full = (args[0] if args else "", members) if members is not None else args
        try:
            out = native.__new__(kind, *full)
            native.__init__(out, *full)
        except Exception:  # noqa: S110 - a layout the args do not fit: the plain kind
            pass
        else:
            vars(out).update(original_name=original.__name__, original_type=(
                f"{original.__module__}.{original.__qualname__}"))
            return out
    return RedactedError(shown, original)


def _fresh(e: BaseException, memo: dict[int, BaseException | None]) -> BaseException | None:
    """A redacted stand-in for ``e`` and its links, made of nothing of the original but
    redacted text and numbers, and where it failed as text (:func:`_stack`): no
    traceback (its frames hold the hook's locals), no attribute (a response, a request,
    bytes output), no slot. None for a link already being made (a cycle) or beyond the
    walk's bound: that link is left out."""
    if id(e) in memo:
        return memo[id(e)]
    if len(memo) >= WALK_LIMIT:
        return None
    memo[id(e)] = None
    # a stand-in made before (in a chain a hook raised again) stands for its original
    original = vars(type(e)).get("_redacts", type(e))
    members = _get(e, "exceptions")
    group = isinstance(members, tuple) and isinstance(e, _GROUPS)
    if group:
        assert isinstance(members, tuple)
        made = [m for m in (_fresh(m, memo) for m in members
                            if isinstance(m, BaseException)) if m is not None]
        try:
            text = _hide(str(getattr(e, "message", "")))
        except Exception:
            text = ""
        out = (_make(original, (text,), made, _hide(_show(e))) if made
               else RedactedError(_hide(_show(e)), original))
    else:
        native = _native(original)
        out = _make(original, _args(e, native), None, _hide(_show(e)))
        if type(e).__str__ is not native.__str__ and isinstance(out, RedactedError):
            # its own __str__ (CalledProcessError's, from attributes the stand-in does
            # not have): what it showed, redacted, rather than the bare args
            vars(out)["redacted_message"] = _hide(_show(e))
    if isinstance(e, RedactedError):
        vars(out).update(original_name=e.original_name, original_type=e.original_type)
    notes = _get(e, "__notes__")
    if isinstance(notes, list):
        vars(out)["__notes__"] = [_hide(n) for n in notes if isinstance(n, str)]
    memo[id(e)] = out
    out.__cause__ = None if e.__cause__ is None else _fresh(e.__cause__, memo)
    out.__context__ = None if e.__context__ is None else _fresh(e.__context__, memo)
    out.__suppress_context__ = e.__suppress_context__
    vars(out)["redacted_stack"] = _stack(e.__traceback__)
    return out


STACK_FRAMES = 64
"""The innermost frames a redacted error's stack keeps (a deep recursion is cut)."""


def _stack(tb: types.TracebackType | None) -> tuple[tuple[str, int, str], ...]:
    """Where an error failed: ``(file, line, function)`` of each frame of ``tb``, the
    innermost :data:`STACK_FRAMES` — text only. The traceback itself is not kept: its
    frames hold the hook's locals (the value among them perhaps, and a report lives on
    into later snapshot images), a frame can only be emptied by ``clear()``, which
    refuses a running one and closes a suspended generator, and a kept frame keeps its
    callers' frames alive through ``f_back``."""
    frames = [(f.f_code.co_filename, lineno, f.f_code.co_name)
              for f, lineno in traceback.walk_tb(tb)]
    return tuple(frames[-STACK_FRAMES:])


def redacted_stacktrace(err: BaseException) -> str | None:
    """A redacted error's traceback as :func:`traceback.format_exception` would print it
    (its source lines read now), from the stack :func:`redact_error` kept as text; None
    for any other error, or one that kept no stack."""
    if not isinstance(err, RedactedError):
        return None
    frames = vars(err).get("redacted_stack")
    if not frames:
        return None
    summary = traceback.StackSummary.from_list(
        [traceback.FrameSummary(f, n, name) for f, n, name in frames])
    name = err.original_type.removeprefix("builtins.")
    text = _show(err)
    # redacted as the message is: a source line may quote a URL with its password
    return _hide("Traceback (most recent call last):\n" + "".join(summary.format())
                 + (f"{name}: {text}\n" if text else f"{name}\n"))


def _show(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"{type(exc).__name__} (its message could not be formatted)"


def _no_attribute(self: BaseException, name: str) -> Any:
    raise AttributeError(name)


def redact_error(exc: Exception) -> Exception:
    """``exc`` itself when no registered redactor finds anything in what formatting it shows
    (its message, ``repr()``, args, notes and string attributes, and those of its causes,
    contexts and group members), nor any URL's user info or query string
    (:func:`~rehydrate._urls.scrub_urls`, which leaves them out). Else a fresh chain,
    nothing of it copied from the original: each link an instance of ``Redacted<Name>``, a
    subclass of both :class:`~rehydrate.RedactedError` and the type raised (so
    ``isinstance``, ``except*`` and an ``OSError``'s ``errno`` still work), made from the
    redacted args alone — no traceback on any link (the frames hold the hook's locals, the
    value among them perhaps, and a report lives on into later snapshot images): where it
    failed is kept as text (:func:`redacted_stacktrace`), none of the original's other
    attributes (a response, a request, bytes output), notes redacted; causes, contexts and
    group members made the same way, the clean ones too. A link whose type cannot be
    subclassed or made so is a plain :class:`~rehydrate.RedactedError`."""
    try:
        if _clean(exc):
            return exc
        try:
            out = _fresh(exc, {})
        except RecursionError:
            out = None
        if isinstance(out, Exception) and _clean(out):
            return out
        plain = RedactedError(_hide(_show(exc)), type(exc))
        vars(plain)["redacted_stack"] = _stack(exc.__traceback__)
        notes = _get(exc, "__notes__")
        if isinstance(notes, list):
            vars(plain)["__notes__"] = [_hide(n) for n in notes if isinstance(n, str)]
        return plain
    except Exception as broken:  # an error type whose attributes raise: show nothing of it
        return RedactedError(f"{type(exc).__name__} (not shown: redacting it failed with "
                             f"{type(broken).__name__})", type(exc))


def _bytes_inner(value: bytes, quote_char: str) -> str:
    """What ``repr()`` shows of ``value`` inside a bytes literal quoted with
    ``quote_char`` (the quote Python picks depends on the whole literal, not on the value:
    ``b'Bearer <value>'``)."""
    out = []
    for c in value:
        ch = chr(c)
        if ch in ("\\", quote_char):
            out.append("\\" + ch)
        elif ch in "\t\n\r":
            out.append({"\t": "\\t", "\n": "\\n", "\r": "\\r"}[ch])
        elif 32 <= c < 127:
            out.append(ch)
        else:
            out.append(f"\\x{c:02x}")
    return "".join(out)


def value_forms(value: bytes) -> set[str]:
    """The ways an error message may spell ``value``: as text (UTF-8), inside a bytes or
    str ``repr()`` (``b'…\\n'``, either quote), JSON-escaped and URL-encoded — each for
    the value as it is and with surrounding whitespace stripped (a token read with its
    trailing newline is sent, and quoted, both ways). Empty when the stripped value is
    shorter than :data:`MIN_REDACTED_LENGTH`."""
    forms: set[str] = set()
    if len(value.strip()) < MIN_REDACTED_LENGTH:
        return forms
    # here, not at import: the runner imports this module, and `import rehydrate` +
    # start() load nothing a secret-free process does not use
    import json
    from urllib.parse import quote, quote_plus

    for base in {value, value.strip()}:
        forms.update(_bytes_inner(base, q) for q in "'\"")
        try:
            text = base.decode("utf-8")
        except UnicodeDecodeError:
            continue
        inner = repr(text)[1:-1]
        forms.update((text, inner, inner.replace("'", "\\'"), inner.replace('"', '\\"'),
                      json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1],
                      quote(text, safe=""), quote_plus(text, safe="")))
    return {f for f in forms if len(f) >= MIN_REDACTED_LENGTH}


def replace_forms(text: str, named: Iterable[tuple[str, str]]) -> str:
    """``text`` with each form of ``named`` (``(form, name)`` pairs) replaced by
    ``[redacted secret 'name']``, the longest forms first (a stripped form inside a longer
    one must not leave the rest of the longer one behind)."""
    for form, name in sorted(named, key=lambda p: len(p[0]), reverse=True):
        if form in text:
            text = text.replace(form, f"[redacted secret {name!r}]")
    return text


def describe_scrubbed(exc: BaseException) -> str:
    """``"Type: message"`` on one line, without the value of any managed secret the message
    quotes (a header of a health check), nor the user info and query strings of the URLs it
    quotes (a password, an ``api_key=``): how a connection's error is shown."""
    text = " ".join(scrub_urls(redact(str(exc))).split())
    if text.endswith("attached to a different loop"):
        # "Task <Task pending name=... coro=<...> cb=[...]> got Future <...> attached to a
        # different loop": hundreds of characters saying one thing
        text = "a future of another event loop was awaited (attached to a different loop)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
