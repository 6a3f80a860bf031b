"""Redaction of sensitive values from error text. Private: extensions use it through
:func:`rehydrate.extensions.add_redactor` and :func:`rehydrate.extensions.redact`.

The engine core knows nothing of what is sensitive (it must not import the secrets
manager, see docs/architecture.md): a manager that holds sensitive values registers a
*redactor* here, a function from text to text, and the engine passes every hook error
through :func:`redact_error` where the error is recorded — before its text reaches a log
line, a report, ``status()``, a telemetry span or a readiness gate's answer.

The registry is process-wide, not per engine: a hook of any engine may quote the value of
a secret another engine manages.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import copy
import inspect
import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ._context import RedactedError
from ._threads import fresh_lock_after_fork

__all__ = ["MIN_REDACTED_LENGTH", "add_redactor", "redact", "redact_error", "value_forms"]

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
    notes = getattr(e, "__notes__", None)
    if isinstance(notes, list):
        yield from (n for n in notes if isinstance(n, str))
    yield from (v for v in _str_attrs(e).values())


_OS_ATTRS = ("strerror", "filename", "filename2")
"""``OSError``'s text attributes: not in its ``__dict__``, shown by its ``str()``."""


def _str_attrs(e: BaseException) -> dict[str, str]:
    found = {k: v for k, v in getattr(e, "__dict__", {}).items()
             if isinstance(v, str) and k != "__notes__"}
    if isinstance(e, OSError):
        found.update((k, v) for k in _OS_ATTRS if isinstance(v := getattr(e, k, None), str))
    return found


def _links(e: BaseException) -> list[BaseException]:
    """What formatting ``e`` shows after (or before) its own text: its group's members,
    first one first (a traceback shows the first 15), then its cause and context."""
    members = getattr(e, "exceptions", None)
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
    return all(redact(t) == t for t in _texts(exc))


_BUSY = object()


def _redacted(e: BaseException, memo: dict[int, object]) -> BaseException | None:
    """``e`` when nothing of it or of what it links to needs redacting, else a copy of
    the same type with its texts redacted and its links replaced by their own redacted
    versions; None when that cannot be made (a cycle, a type that cannot be copied)."""
    if id(e) in memo:
        got = memo[id(e)]
        return got if isinstance(got, BaseException) else None  # None: busy (a cycle)
    if len(memo) >= WALK_LIMIT:
        return None
    memo[id(e)] = _BUSY
    out: BaseException | None = None
    try:
        cause = None if e.__cause__ is None else _redacted(e.__cause__, memo)
        context = None if e.__context__ is None else _redacted(e.__context__, memo)
        members = getattr(e, "exceptions", None)
        new_members = None
        if isinstance(members, tuple):
            new_members = [m if not isinstance(m, BaseException) else _redacted(m, memo)
                           for m in members]
        if ((e.__cause__ is not None and cause is None)
                or (e.__context__ is not None and context is None)
                or (new_members is not None and any(m is None for m in new_members))):
            return None
        relinked = (cause is not e.__cause__ or context is not e.__context__
                    or (new_members is not None and isinstance(members, tuple)
                        and any(a is not b for a, b in zip(new_members, members, strict=True))))
        if not relinked and all(redact(t) == t for t in _own_texts(e)):
            out = e
            return out
        out = _copy(e, new_members if relinked else None)
        if out is None:
            return None
        out.__cause__ = cause
        out.__context__ = context
        out.__suppress_context__ = e.__suppress_context__
        if e.__traceback__ is not None:
            # Where it failed stays readable; the frames' locals (the hook's, the value
            # among them perhaps) are dropped, not kept alive by the report.
            _clear_locals(e.__traceback__)
            out.__traceback__ = e.__traceback__
        return out
    finally:
        memo[id(e)] = out


_SUSPENDABLE = (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
                | inspect.CO_ITERABLE_COROUTINE)


def _clear_locals(tb: types.TracebackType | None) -> None:
    """Drop the local variables of the finished plain-function frames of ``tb``. Not a
    generator's or a coroutine's: clearing one that is suspended closes it (a library's
    reader task that caught the error, handed it on in a future and reads on); nor an
    executing one (the runner's own, another thread's): ``clear()`` refuses those."""
    while tb is not None:
        frame = tb.tb_frame
        if not frame.f_code.co_flags & _SUSPENDABLE:
            with contextlib.suppress(RuntimeError):
                frame.clear()
        tb = tb.tb_next


def _copy(e: BaseException, members: list[Any] | None) -> BaseException | None:
    """A copy of ``e`` of the same type with its args, notes and string attributes
    redacted (``members``: its group's members in place of its own); None when it
    cannot be made."""
    try:
        own = getattr(e, "exceptions", None)
        if isinstance(own, tuple):  # an exception group: its message is not in its args
            parts = members if members is not None else list(own)
            message = getattr(e, "message", "")
            if type(e) in _GROUPS:  # BaseExceptionGroup() picks ExceptionGroup itself
                out = _GROUPS[0](redact(message), parts)  # type: ignore[call-arg,unused-ignore]
            else:
                out = e.derive(parts)  # type: ignore[attr-defined]
                out.__dict__.update(vars(e))
        else:
            out = copy.copy(e)
        if type(out) is not type(e):
            return None
        if not isinstance(own, tuple):
            out.args = tuple(redact(a) if isinstance(a, str) else a for a in e.args)
        for k, v in _str_attrs(out).items():
            setattr(out, k, redact(v))
        notes = getattr(e, "__notes__", None)
        if isinstance(notes, list):
            # what add_note() sets (3.11+), and what a traceback prints on every version
            vars(out)["__notes__"] = [redact(n) if isinstance(n, str) else n for n in notes]
    except Exception:
        return None
    return out


_GROUPS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(builtins, "BaseExceptionGroup", None),
                getattr(builtins, "ExceptionGroup", None)) if t is not None)


def _show(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"{type(exc).__name__} (its message could not be formatted)"


def redact_error(exc: Exception) -> Exception:
    """``exc`` itself when no registered redactor finds anything in what formatting it
    shows (its message, ``repr()``, args, notes and string attributes, and those of its
    causes, contexts and group members), else a copy of the same type with each found
    value replaced — args, notes, string attributes (``OSError.strerror``, ``filename``),
    causes, contexts and members likewise redacted; its traceback kept with the locals
    of its plain-function frames cleared (they hold the hook's, the value among them
    perhaps, and a report lives on into later snapshot images; see
    :func:`_clear_locals`) — so that ``isinstance``, ``errno`` and ``except*`` still
    work on it. When no such copy can be made, or the copy still shows
    the value (a ``__str__`` of its own), a :class:`~rehydrate.RedactedError` in its
    place: the redacted message and notes and the original type's name, without cause,
    context or traceback."""
    if not _live():  # the usual case: no secret managed, nothing to look for
        return exc
    if _clean(exc):
        return exc
    try:
        copied = _redacted(exc, {})
    except RecursionError:
        copied = None
    if isinstance(copied, Exception) and type(copied) is type(exc) and _clean(copied):
        return copied
    out = RedactedError(redact(_show(exc)), type(exc))
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        vars(out)["__notes__"] = [redact(n) for n in notes if isinstance(n, str)]
    return out


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
