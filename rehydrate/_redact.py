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

import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator

from ._context import RedactedError
from ._threads import fresh_lock_after_fork

__all__ = ["MIN_REDACTED_LENGTH", "add_redactor", "redact", "redact_error", "value_forms"]

log = logging.getLogger("rehydrate")

Redactor = Callable[[str], str]

MIN_REDACTED_LENGTH = 4
"""A value shorter than this (whitespace stripped) is not looked for: replacing every
``1`` or ``on`` in an error message would make it unreadable and hide nothing worth
hiding — such a value is guessed faster than read."""

WITHHELD = "[message withheld: a redactor failed]"
"""The whole text, when a redactor raised: what it would have removed is not known."""

_lock = threading.Lock()
_redactors: dict[int, Callable[[], Redactor | None]] = {}
"""Redactor getters by registration number: a bound method's getter is a weak reference
(None once its object is gone), a plain function's returns the function."""
_next = 0
fresh_lock_after_fork(sys.modules[__name__])  # a parent thread may hold it at fork()


def add_redactor(fn: Redactor) -> Callable[[], None]:
    """Register ``fn(text) -> text``, which returns ``text`` without the values it knows
    to be sensitive; returns the function that unregisters it. A bound method is held
    weakly (its object's end unregisters it): a manager registers its own method and is
    not kept alive by it. ``fn`` must not log what it removes, and must be quick (it runs
    for every failed hook)."""
    global _next
    if not callable(fn):
        raise TypeError(f"a redactor must be callable, not {type(fn).__name__}")
    getter: Callable[[], Redactor | None]
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        getter = weakref.WeakMethod(fn)
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


def _texts(exc: BaseException) -> Iterator[str]:
    """The texts that formatting ``exc`` may show: its message and notes, and those of its
    causes, contexts and (exception groups) members — what a traceback prints."""
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < 100:  # a bound: a pathological chain must not hang a run
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        try:
            yield str(e)
        except Exception:  # noqa: S112 - unformattable: it shows nothing of its own
            continue
        notes = getattr(e, "__notes__", None)
        if isinstance(notes, list):
            yield from (n for n in notes if isinstance(n, str))
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
        members = getattr(e, "exceptions", None)
        if isinstance(members, tuple):
            todo.extend(m for m in members if isinstance(m, BaseException))


def redact_error(exc: Exception) -> Exception:
    """``exc`` itself when no registered redactor finds anything in its text (its own
    message, notes, causes and contexts), else a :class:`~rehydrate.RedactedError` in its
    place: the redacted message and notes and the original type's name, without the
    original's cause, context and traceback — each would show, or keep alive for a later
    snapshot image, what was redacted (the traceback's frames hold the hook's locals)."""
    if not _live():  # the usual case: no secret managed, nothing to look for
        return exc
    texts = list(_texts(exc))
    if all(redact(t) == t for t in texts):
        return exc
    out = RedactedError(redact(str(exc)), type(exc))
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        # what add_note() sets (3.11+), and what a traceback prints on every version
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
