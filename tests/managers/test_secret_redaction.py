"""A managed secret's value quoted in a hook's error is redacted where the error is
recorded: not in the log, the report, ``status()``, the telemetry span or a readiness
gate's answer."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import pickle
import socket
import sys
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import rehydrate
from rehydrate import RedactedError, connections, extensions, telemetry
from rehydrate._redact import WITHHELD, value_forms
from rehydrate.adapters._readiness import reason_of
from rehydrate.adapters._server import redact as server_redact
from rehydrate.adapters.asgi import ReadinessGate
from rehydrate.secrets import Secret

MARK = "SECRETMARKER-tok3n"
SHOWN = "[redacted secret 'token']"


@pytest.fixture
def spans(rehydrate_engine: rehydrate.Lifecycle) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.instrument(rehydrate_engine, tracer_provider=tp)
    yield exporter
    tp.shutdown()


@pytest.fixture
def token(rehydrate_engine: rehydrate.Lifecycle, tmp_path: Any) -> Iterator[Secret]:
    path = tmp_path / "token"
    path.write_text(MARK + "\n")  # the usual trailing newline, kept (strip=False)
    s = Secret.from_file(path, engine=rehydrate_engine)
    assert s.get() == (MARK + "\n").encode()
    yield s
    s.close()


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A port that accepts connections (into its backlog): httpx connects, then h11
    refuses the header before anything is sent."""
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()


def _reaching(root: object) -> list[str]:
    """The paths from ``root`` to a text or bytes holding the value: through everything
    the garbage collector sees it refer to (args, ``__dict__``, slots, tracebacks and
    their frames' locals, causes, contexts, members)."""
    import types

    seen: set[int] = set()
    found: list[str] = []
    todo: list[tuple[object, str]] = [(root, "error")]
    while todo:
        obj, path = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, str):
            if MARK in obj:
                found.append(path)
            continue
        if isinstance(obj, (bytes, bytearray)):
            if MARK.encode() in obj:
                found.append(path)
            continue
        if isinstance(obj, (types.ModuleType, type, types.FunctionType, Secret)):
            continue  # the code, the secret's own holder: not the error's
        refs = list(gc.get_referents(obj))
        if isinstance(obj, types.FrameType):
            refs.extend(obj.f_locals.values())
        if isinstance(obj, BaseException):
            refs.extend((obj.__traceback__, obj.__cause__, obj.__context__))
        todo.extend((r, f"{path}->{type(r).__name__}") for r in refs if r is not None)
    return found


def _assert_cleared(error: BaseException) -> None:
    """``error`` keeps no traceback (its frames would hold the hook's locals), only where it
    failed as text, which a span's ``exception.stacktrace`` shows."""
    from rehydrate._redact import redacted_stacktrace

    assert error.__traceback__ is None
    stack = redacted_stacktrace(error)
    assert stack is not None and stack.startswith("Traceback (most recent call last):\n")
    assert '  File "' in stack, stack


def _everywhere(engine: rehydrate.Lifecycle, report: rehydrate.Report,
                exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture,
                ) -> dict[str, str]:
    assert report.error is not None
    return {
        "log": "\n".join(r.getMessage() for r in caplog.records),
        "report table": report.table(),
        "report dict": json.dumps(report.to_dict()),
        "report traceback": "".join(traceback.format_exception(report.error)),
        "status": json.dumps(engine.status().to_dict(), default=str),
        "span": "".join(s.to_json() for s in exporter.get_finished_spans()),
        "readiness": reason_of(engine.status()),
    }


def test_an_httpx_header_error_quoting_the_token_is_redacted_everywhere(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret, spans: InMemorySpanExporter,
        listening_port: int, caplog: pytest.LogCaptureFixture) -> None:
    """The security review's case: h11's ``Illegal header value b'Bearer <token>\\n'``
    went into every one of these (and the ASGI gate's public 503 body)."""
    @rehydrate_engine.registry.after_restore(name="register-with-api")
    def register() -> None:
        with httpx.Client() as c:
            c.get(f"http://127.0.0.1:{listening_port}/register",
                  headers={"Authorization": "Bearer " + token.get_str()})

    caplog.set_level(logging.WARNING, logger="rehydrate")
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    for where, text in _everywhere(rehydrate_engine, report, spans, caplog).items():
        assert "SECRETMARKER" not in text, where
        assert SHOWN in text, where
    error = report.hooks[-1].error
    assert isinstance(error, RedactedError) and isinstance(error, httpx.LocalProtocolError)
    assert error.original_name == "LocalProtocolError"
    assert error.original_type == "httpx.LocalProtocolError"
    assert str(error) == f"Illegal header value b'Bearer {SHOWN}'"
    # the span's status names the type raised, as the report and the log line do
    [span] = [s for s in spans.get_finished_spans() if s.name.endswith("register-with-api")]
    assert span.status.description == f"LocalProtocolError: {error}"
    # nothing of the original is kept to be formatted (or snapshotted) later: h11's
    # error it was raised from stands redacted too, both with their tracebacks' frames
    # and without their locals
    assert isinstance(error.__cause__, RedactedError)
    assert error.__cause__.original_name == "LocalProtocolError"
    assert str(error.__cause__) == str(error)
    _assert_cleared(error)
    _assert_cleared(error.__cause__)
    assert _reaching(report.error) == []


def test_the_asgi_gate_answers_without_the_token(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    @rehydrate_engine.registry.after_restore(name="echo")
    def echo() -> None:
        raise RuntimeError(f"upstream rejected {token.get()!r}")

    assert not rehydrate_engine.simulate_restore().ok

    async def app(scope: Any, receive: Any, send: Any) -> None:  # never reached
        raise AssertionError

    async def get() -> httpx.Response:
        # the full status (opted in) is where the gate still shows hook errors' text
        gate = ReadinessGate(app, engine=rehydrate_engine, status_detail=True,
                             lifespan=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate),
                                     base_url="http://x") as c:
            return await c.get("/rehydrate/status")

    response = asyncio.run(get())
    assert "SECRETMARKER" not in response.text
    assert SHOWN in response.text


@pytest.mark.parametrize("form", [
    pytest.param(lambda v: v, id="text, newline included"),
    pytest.param(lambda v: v.strip(), id="text, stripped"),
    pytest.param(lambda v: repr(v.encode()), id="bytes repr"),
    pytest.param(lambda v: repr(("'" + v).encode()), id="bytes repr, double quotes"),
    pytest.param(repr, id="str repr"),
    pytest.param(lambda v: json.dumps({"token": v}), id="json"),
    pytest.param(lambda v: "https://api/x?token=" + v.strip(), id="url query"),
])
def test_each_form_of_the_value_is_redacted(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret, spans: InMemorySpanExporter,
        caplog: pytest.LogCaptureFixture, form: Any) -> None:
    quoted = form(token.get_str())
    assert MARK in quoted

    @rehydrate_engine.registry.after_restore(name="quotes")
    def quotes() -> None:
        raise ValueError(f"refused {quoted} (try again)")

    caplog.set_level(logging.WARNING, logger="rehydrate")
    report = rehydrate_engine.simulate_restore()
    for where, text in _everywhere(rehydrate_engine, report, spans, caplog).items():
        assert "SECRETMARKER" not in text, where
        # a URL's query string is left out whole, whatever it holds
        assert ("https://api/x (try again)" if "?token=" in quoted else SHOWN) in text, where
    assert report.hooks[-1].to_dict()["error"].startswith("ValueError: refused ")


class AppError(Exception):
    """An application's own error type (module-qualified in ``exception.type``)."""


def _plain_and_quoting_failures(engine: rehydrate.Lifecycle, token: Secret,
                                spans: InMemorySpanExporter,
                                kind: type[Exception]) -> dict[str, Any]:
    """A restore where hook ``plain`` raises ``kind`` with a message that quotes nothing
    and hook ``quoting`` the same with the token in it: the attributes of each hook span's
    exception event, by hook name."""
    @engine.registry.after_restore(name="plain", required=False)
    def plain() -> None:
        raise kind("request failed: timeout")

    @engine.registry.after_restore(name="quoting", required=False)
    def quoting() -> None:
        raise kind("request failed: " + token.get_str())

    engine.simulate_restore()
    return {s.name: next(e for e in s.events if e.name == "exception").attributes
            for s in spans.get_finished_spans() if s.name in ("plain", "quoting")}


@pytest.mark.parametrize("kind", [RuntimeError, AppError])
def test_the_span_names_the_type_raised_as_for_an_unredacted_error(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret, spans: InMemorySpanExporter,
        kind: type[Exception]) -> None:
    """The exception event's ``exception.type`` was the stand-in's,
    ``rehydrate._redact.RedactedRuntimeError``: the same failure grouped apart depending
    on whether its message happened to quote a secret."""
    events = _plain_and_quoting_failures(rehydrate_engine, token, spans, kind)
    assert events["quoting"]["exception.type"] == events["plain"]["exception.type"]
    assert events["plain"]["exception.type"].endswith(kind.__qualname__)
    assert events["quoting"]["exception.message"] == f"request failed: {SHOWN}"
    assert "SECRETMARKER" not in json.dumps(dict(events["quoting"]))


def _record_exception_before_1_25(self: Any, exception: BaseException,
                                  attributes: Any = None, timestamp: Any = None,
                                  escaped: bool = False) -> None:
    """``Span.record_exception`` of opentelemetry-sdk 1.20 to 1.24: the bare class name."""
    attrs = {"exception.type": exception.__class__.__name__,
             "exception.message": str(exception), "exception.stacktrace": "",
             "exception.escaped": str(escaped)}
    attrs.update(attributes or {})
    self.add_event(name="exception", attributes=attrs, timestamp=timestamp)


@pytest.mark.parametrize("kind", [RuntimeError, AppError])
def test_the_span_names_the_type_raised_as_an_older_sdk_names_it(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret, spans: InMemorySpanExporter,
        kind: type[Exception], monkeypatch: pytest.MonkeyPatch) -> None:
    """SDKs before 1.25 name an application's error by its bare class name: the redacted
    one's module-qualified name grouped it apart from the same error unredacted."""
    from opentelemetry.sdk.trace import Span

    monkeypatch.setattr(Span, "record_exception", _record_exception_before_1_25)
    monkeypatch.setattr(telemetry, "_type_naming", {})

    events = _plain_and_quoting_failures(rehydrate_engine, token, spans, kind)
    assert events["plain"]["exception.type"] == kind.__name__
    assert events["quoting"]["exception.type"] == kind.__name__


def test_a_cause_or_a_note_quoting_the_token_is_not_kept(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """httpx raises its own error ``from`` h11's: a traceback (telemetry's
    ``record_exception``, ``logging.exception``) prints the cause's message too."""
    @rehydrate_engine.registry.after_restore(name="chained")
    def chained() -> None:
        try:
            raise ValueError(token.get_str())
        except ValueError as exc:
            err = ConnectionError("the API refused the request")
            if hasattr(err, "add_note"):
                err.add_note(f"sent {token.get_str().strip()}")
            raise err from exc

    report = rehydrate_engine.simulate_restore()
    error = report.hooks[-1].error
    # the type raised, kept: isinstance() and except* still work
    assert isinstance(error, ConnectionError) and isinstance(error, RedactedError)
    assert error.original_type == "builtins.ConnectionError"
    assert str(error) == "the API refused the request"
    assert isinstance(error.__cause__, ValueError)
    assert str(error.__cause__) == SHOWN
    assert report.error is not None
    formatted = "".join(traceback.format_exception(report.error))
    assert "SECRETMARKER" not in formatted
    assert SHOWN in formatted and "raise err from exc" not in formatted  # no traceback
    if hasattr(error, "add_note"):
        assert error.__notes__[0] == f"sent {SHOWN}"
    assert _reaching(report.error) == []
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert back.original_name == "ConnectionError"


def test_an_error_with_its_own_str_shows_what_it_showed_redacted(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """A ``__str__`` of its own that quotes the value from elsewhere: the stand-in
    shows that text redacted (its own ``__str__`` is not run again), and a local class,
    which unpickling could not find, is pickled as a plain RedactedError."""
    value = token.get_str()

    class Quoting(Exception):
        def __str__(self) -> str:
            return f"token {value} refused"

    @rehydrate_engine.registry.after_restore(name="quoting")
    def quoting() -> None:
        try:
            raise ValueError(value)
        except ValueError as exc:
            raise Quoting() from exc

    error = rehydrate_engine.simulate_restore().hooks[-1].error
    assert isinstance(error, RedactedError) and isinstance(error, Quoting)
    assert error.original_name == "Quoting"
    assert str(error) == f"token {SHOWN} refused"
    assert isinstance(error.__cause__, ValueError) and error.__context__ is error.__cause__
    _assert_cleared(error)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is RedactedError
    assert (str(back), back.original_name, back.original_type) == (
        str(error), error.original_name, error.original_type)


def test_an_error_without_the_value_is_kept_as_raised(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    raised = KeyError("token")  # the secret's name is fine to show

    @rehydrate_engine.registry.after_restore(name="plain")
    def plain() -> None:
        raise raised

    report = rehydrate_engine.simulate_restore()
    assert report.hooks[-1].error is raised


def test_a_value_shorter_than_four_characters_is_not_redacted(
        rehydrate_engine: rehydrate.Lifecycle) -> None:
    """Replacing every ``abc`` (or ``1``) of every message would make errors unreadable,
    and a secret that short is guessed faster than read."""
    short = Secret.from_callable(lambda: b"abc\n", name="short", engine=rehydrate_engine)
    raised = ValueError("abc is not a valid abc")

    @rehydrate_engine.registry.after_restore(name="short-quoted")
    def quoted() -> None:
        raise raised

    try:
        assert value_forms(b"abc\n") == set()
        assert rehydrate_engine.simulate_restore().hooks[-1].error is raised
    finally:
        short.close()


def test_a_wiped_or_closed_secret_is_no_longer_looked_for(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    text = f"quoted {MARK}"
    assert extensions.redact(text) == f"quoted {SHOWN}"
    assert rehydrate_engine.simulate_snapshot().ok  # wiped: nothing held to compare with
    assert extensions.redact(text) == text
    assert rehydrate_engine.simulate_restore().ok
    assert extensions.redact(text) == f"quoted {SHOWN}"
    token.close()
    assert extensions.redact(text) == text


def test_the_secrets_of_another_engine_are_redacted_too(token: Secret) -> None:
    """The registry is process-wide: a hook of any engine may quote any secret."""
    from rehydrate.testing import isolated_engine

    other = isolated_engine()
    try:
        @other.registry.after_restore(name="elsewhere")
        def elsewhere() -> None:
            raise RuntimeError(f"bad token {MARK}")

        assert str(other.simulate_restore().hooks[-1].error) == f"bad token {SHOWN}"
    finally:
        other.close()


def test_a_failing_redactor_withholds_the_whole_message(
        rehydrate_engine: rehydrate.Lifecycle, caplog: pytest.LogCaptureFixture) -> None:
    def broken(text: str) -> str:
        raise LookupError(text)  # its message quotes the text: never logged

    remove = extensions.add_redactor(broken)
    try:
        @rehydrate_engine.registry.after_restore(name="any")
        def any_hook() -> None:
            raise ValueError("whatever it says")

        caplog.set_level(logging.WARNING, logger="rehydrate")
        error = rehydrate_engine.simulate_restore().hooks[-1].error
        assert str(error) == WITHHELD
        assert "whatever it says" not in caplog.text
        assert "LookupError" in caplog.text
    finally:
        remove()
    assert extensions.redact("whatever it says") == "whatever it says"


def test_a_redactor_is_held_until_removed_and_weakly_only_when_asked() -> None:
    """A bound method of an object nobody else holds stays registered (it was dropped at
    the next garbage collection); ``weak=True`` holds it by its object; a slotted
    object's method, which cannot be referred to weakly, registers by default."""
    class Holder:
        def hide(self, text: str) -> str:
            return text.replace("hidden-value", "[gone]")

    class Slotted:
        __slots__ = ()

        def hide(self, text: str) -> str:
            return text.replace("slotted-value", "[gone]")

    remove = extensions.add_redactor(Holder().hide)
    remove_slotted = extensions.add_redactor(Slotted().hide)
    try:
        gc.collect()
        assert extensions.redact("a hidden-value") == "a [gone]"
        assert extensions.redact("a slotted-value") == "a [gone]"
    finally:
        remove()
        remove_slotted()
    assert extensions.redact("a hidden-value") == "a hidden-value"

    holder = Holder()
    remove = extensions.add_redactor(holder.hide, weak=True)
    try:
        assert extensions.redact("a hidden-value") == "a [gone]"
        del holder
        gc.collect()
        assert extensions.redact("a hidden-value") == "a hidden-value"
    finally:
        remove()
    with pytest.raises(TypeError, match="weakly"):
        extensions.add_redactor(Slotted().hide, weak=True)


def test_the_adapters_redact_managed_secrets_through_the_same_registry(
        token: Secret) -> None:
    """An upstream's answer quoting the token (an echoing gateway) loses it before an
    adapter logs or serves it, as a hook error does."""
    answer = f'{{"detail": "bad key {token.get_str().strip()}"}}'
    assert server_redact(answer, patterns=False) == f'{{"detail": "bad key {SHOWN}"}}'


def test_a_connection_error_quoting_the_token_is_redacted_in_its_status(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """A connection's ``last_error`` (``status()``, its log lines) is made from its own
    errors, outside the hook runner."""
    def check(conn: object) -> None:
        raise ConnectionError(f"the API refused {token.get()!r}")

    connections.register("api", open=lambda: "conn", check=check, deadline=0.2,
                         required=False, engine=rehydrate_engine)
    rehydrate_engine.simulate_restore()
    assert connections.manager(rehydrate_engine).wait_background(10)
    status = json.dumps(rehydrate_engine.status().to_dict(), default=str)
    assert "SECRETMARKER" not in status
    [conn] = rehydrate_engine.status().extra["connections"]
    assert conn["last_error"] == f"ConnectionError: the API refused b'{SHOWN}'"


def test_an_error_quoting_a_common_word_secret_keeps_its_type(
        rehydrate_engine: rehydrate.Lifecycle) -> None:
    """A password that is a common word ("postgres"): an unrelated error quoting the word
    is redacted in a copy of the same type — errno, isinstance and except* still work."""
    db = Secret.from_callable(lambda: b"postgres", name="db_password",
                              engine=rehydrate_engine)
    shown = "[redacted secret 'db_password']"

    @rehydrate_engine.registry.after_restore(name="warm", required=False)
    def warm() -> None:
        raise ConnectionRefusedError(111, "could not connect to postgres at db:5432")

    @rehydrate_engine.registry.after_restore(name="open")
    def open_file() -> None:
        raise FileNotFoundError(2, "no such file", "/etc/postgres/pass", None,
                                "/run/postgres")

    try:
        report = rehydrate_engine.simulate_restore()
        warm_error, open_error = (h.error for h in report.hooks[-2:])
        assert isinstance(warm_error, ConnectionRefusedError)
        assert isinstance(warm_error, ConnectionError) and warm_error.errno == 111
        assert str(warm_error) == f"[Errno 111] could not connect to {shown} at db:5432"
        assert isinstance(open_error, FileNotFoundError) and open_error.errno == 2
        assert (open_error.filename, open_error.filename2) == (
            f"/etc/{shown}/pass", f"/run/{shown}")
        assert "postgres" not in str(open_error) + repr(open_error)
        back = pickle.loads(pickle.dumps(open_error))
        assert type(back) is type(open_error) and (back.errno, back.filename2) == (
            2, f"/run/{shown}")
        assert report.error is not None
        matched, _ = report.error.split(ConnectionError)  # what except* does
        assert matched is not None and matched.exceptions == (warm_error,)
    finally:
        db.close()


def test_values_shorter_than_eight_characters_are_not_looked_for() -> None:
    assert value_forms(b"admin\n") == set()
    assert value_forms(b"hunter2") == set()
    assert "postgres" in value_forms(b"postgres")


def test_a_substring_equal_to_the_value_is_redacted(token: Secret) -> None:
    """By substring, not by word: text containing the value contains the value."""
    assert extensions.redact(f"http://{MARK}-exporter:9187") == f"http://{SHOWN}-exporter:9187"


def test_an_unformattable_error_is_walked_on_to_its_cause(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("nope")

    @rehydrate_engine.registry.after_restore(name="unprintable")
    def unprintable() -> None:
        try:
            raise ConnectionError(f"auth failed for token {MARK}")
        except ConnectionError as exc:
            raise Unprintable() from exc

    report = rehydrate_engine.simulate_restore()
    assert report.error is not None
    formatted = "".join(traceback.format_exception(report.error))
    assert "SECRETMARKER" not in formatted
    assert f"auth failed for token {SHOWN}" in formatted


def test_an_args_value_hidden_by_a_custom_str_is_redacted(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    class AuthError(Exception):
        def __str__(self) -> str:
            return "authentication failed"

    @rehydrate_engine.registry.after_restore(name="auth")
    def auth() -> None:
        raise AuthError(MARK)

    report = rehydrate_engine.simulate_restore()
    error = report.hooks[-1].error
    assert isinstance(error, AuthError) and error.args == (SHOWN,)
    assert str(error) == "authentication failed"
    assert "SECRETMARKER" not in repr(report) + repr(error)


def report_group() -> BaseException:
    """An ExceptionGroup (the backport's on 3.10, as the engine's reports use)."""
    from rehydrate._context import HookFailed
    return HookFailed.__mro__[1]("x", [ValueError()])  # type: ignore[no-any-return]


def test_the_first_member_of_a_large_group_is_redacted(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """A TaskGroup of 120 calls: the first member, which a traceback shows first, was
    beyond the walk's bound (it went from the last member)."""
    group_type = type(report_group())
    @rehydrate_engine.registry.after_restore(name="fan-out")
    async def fan_out() -> None:
        async def call(i: int) -> None:
            if i == 0:
                raise PermissionError(f"401 for Bearer {MARK}")
            raise TimeoutError(f"shard {i} timed out")

        results = await asyncio.gather(*(call(i) for i in range(120)),
                                       return_exceptions=True)
        # what a TaskGroup raises, built here: asyncio.TaskGroup is 3.11+
        raise group_type("unhandled errors in a TaskGroup", results)

    report = rehydrate_engine.simulate_restore()
    error = report.hooks[-1].error
    assert isinstance(error, group_type) and len(error.exceptions) == 120
    assert all(isinstance(m, (PermissionError, TimeoutError)) for m in error.exceptions)
    assert str(error.exceptions[0]) == f"401 for Bearer {SHOWN}"
    assert report.error is not None
    assert "SECRETMARKER" not in "".join(traceback.format_exception(report.error))


def test_the_forms_are_made_once_per_load(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every redaction made ~20 forms per secret anew (each failed hook, each text)."""
    import rehydrate.secrets as secrets_module

    made: list[bytes] = []

    def counting(value: bytes) -> set[str]:
        made.append(value)
        return value_forms(value)

    monkeypatch.setattr(secrets_module, "value_forms", counting)
    assert token.reload()  # a load: the forms are made at the next redaction
    made.clear()
    for _ in range(3):
        assert extensions.redact(f"a {MARK}") == f"a {SHOWN}"
    assert len(made) == 1
    (tmp_path / "token").write_text("SECRETMARKER-rotated\n")
    assert token.reload()
    assert extensions.redact("a SECRETMARKER-rotated") == f"a {SHOWN}"
    assert len(made) == 2  # the new value's; the replaced value's forms were kept
    assert rehydrate_engine.simulate_snapshot().ok  # the wipe drops them
    assert token._form_cache is None and token._previous_forms is None
    assert token._previous is None


def test_no_forms_are_made_for_a_text_that_does_not_mention_the_value(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every failed hook's error is redacted over every secret: the forms (text copies
    nobody can zero, left in the heap and so in a snapshot image) were made for each
    secret at the first failure, whatever the error said. Now only for a text that holds
    the value's longest run of letters and digits (every form keeps it as it is)."""
    import rehydrate.secrets as secrets_module

    made: list[bytes] = []

    def counting(value: bytes) -> set[str]:
        made.append(value)
        return value_forms(value)

    monkeypatch.setattr(secrets_module, "value_forms", counting)
    assert token.reload()
    assert extensions.redact("upstream refused the connection") == (
        "upstream refused the connection")
    assert extensions.redact("tok3n alone") == "tok3n alone"  # a shorter run of it
    assert made == [] and token._form_cache is None
    # the replaced value of a rotation: kept as a copy rehydrate zeroes, its forms made
    # only for a text that mentions it
    (tmp_path / "token").write_text("ROTATEDvalue-9x\n")
    assert token.reload()
    previous = token._previous
    assert previous is not None and bytes(previous) == (MARK + "\n").encode()
    assert extensions.redact("nothing here") == "nothing here" and made == []
    assert extensions.redact(f"old {MARK!r}") == f"old '{SHOWN}'"
    assert made == [(MARK + "\n").encode()]  # the old value's only
    rehydrate_engine.simulate_restore(kind="resume")  # the run's end drops the old value
    assert token._previous is None and previous == bytearray(len(previous)), "zeroed"
    assert extensions.redact(f"old {MARK}") == f"old {MARK}"


def test_a_value_with_no_long_run_of_letters_is_looked_for_in_every_text(
        rehydrate_engine: rehydrate.Lifecycle, tmp_path: Any) -> None:
    """Too short a run would be found by chance: such a value is redacted as before."""
    path = tmp_path / "symbols"
    path.write_text("a!b@c#d$e%f^g&h*")
    secret = Secret.from_file(path, engine=rehydrate_engine)
    try:
        assert extensions.redact("x a!b@c#d$e%f^g&h* y") == "x [redacted secret 'symbols'] y"
        assert secret._form_cache is not None
    finally:
        secret.close()


def test_a_value_replaced_by_the_restore_is_redacted_until_the_run_ends(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret, tmp_path: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """Rotated while the process was checkpointed (no before-snapshot pass: the image
    still held the old value): an application hook of the restore quoting the value
    its client still holds is redacted; after the run the old value is not looked for."""
    old = token.get_str()
    (tmp_path / "token").write_text("SECRETMARKER-rotated\n")

    @rehydrate_engine.registry.after_restore(name="refresh-client")
    def refresh() -> None:
        raise PermissionError(f"401 from api: token {old} revoked")

    caplog.set_level(logging.WARNING, logger="rehydrate")
    report = rehydrate_engine.simulate_restore()
    assert token.get() == b"SECRETMARKER-rotated\n"
    error = report.hooks[-1].error
    assert isinstance(error, PermissionError)
    assert str(error) == f"401 from api: token {SHOWN} revoked"
    assert "SECRETMARKER" not in caplog.text
    assert "SECRETMARKER" not in json.dumps(rehydrate_engine.status().to_dict(), default=str)
    assert extensions.redact(old) == old  # the run is over: only the new value
    assert extensions.redact("SECRETMARKER-rotated") == SHOWN


def _vault_issuer(token: Secret) -> Any:
    """An issuer that signs with a throwaway CA, or (``fail``) raises quoting its token."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ca")])
    now = dt.datetime.now(dt.timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(1)
          .not_valid_before(now - dt.timedelta(days=1))
          .not_valid_after(now + dt.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))

    class VaultIssuer:
        fail = False

        def issue(self, csr: Any) -> Any:
            if self.fail:
                raise PermissionError(f"vault: permission denied for token {token.get_str()}")
            cert = (x509.CertificateBuilder().subject_name(csr.subject).issuer_name(ca_name)
                    .public_key(csr.public_key()).serial_number(x509.random_serial_number())
                    .not_valid_before(now - dt.timedelta(days=1))
                    .not_valid_after(now + dt.timedelta(days=10))
                    .add_extension(x509.SubjectAlternativeName([x509.DNSName("svc.local")]),
                                   critical=False)
                    .sign(ca_key, hashes.SHA256()))
            return cert, [ca]

    return VaultIssuer()


def test_a_certificate_error_quoting_a_secret_is_redacted_in_status_and_renew(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret,
        caplog: pytest.LogCaptureFixture) -> None:
    """An issuer's error quoting its Vault token: the certificate's ``last_error``
    (``status()["tls"]``), the error renew() raises and the ``material`` error."""
    from rehydrate import tls

    issuer = _vault_issuer(token)
    cert = tls.issued("web", issuer, common_name="svc.local", sans=["svc.local"],
                      engine=rehydrate_engine)
    issuer.fail = True
    caplog.set_level(logging.WARNING, logger="rehydrate")
    assert not rehydrate_engine.simulate_restore().ok
    status = json.dumps(rehydrate_engine.status().to_dict(), default=str)
    assert "SECRETMARKER" not in status and SHOWN in status
    with pytest.raises(tls.CertificateError) as caught:
        cert.renew()
    assert "SECRETMARKER" not in "".join(traceback.format_exception(caught.value))
    assert SHOWN in str(caught.value)
    assert isinstance(caught.value.__cause__, PermissionError)  # kept, redacted
    assert cert.last_error is not None and "SECRETMARKER" not in cert.last_error
    assert "SECRETMARKER" not in caplog.text
    assert rehydrate_engine.simulate_snapshot().ok
    cert._material = None  # no material: its error quotes last_error
    with pytest.raises(tls.CertificateError) as no_material:
        cert.material  # noqa: B018
    assert "SECRETMARKER" not in str(no_material.value)
    assert SHOWN in str(no_material.value)


def test_the_public_status_redacts_the_last_reports_reason(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """The reason is the caller's text (``restore_detected(reason=...)``), served to
    anyone reaching the port."""
    from rehydrate.adapters._readiness import public_status

    assert rehydrate_engine.simulate_restore(reason=f"webhook with token {MARK}").ok
    shown = public_status(rehydrate_engine)["last_report"]["reason"]
    assert shown == f"webhook with token {SHOWN}"


def test_no_link_keeps_a_traceback_whose_frames_hold_the_value(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """The value in a local of a frame the error passed through (a plain function's, a
    finished coroutine's) or of a clean cause's frame was kept alive by the report, into
    a later snapshot image: each link of the recorded chain keeps its traceback (where it
failed) without its frames' locals."""
    def connect(value: str) -> None:
        header = "Bearer " + value  # noqa: F841 - the local a frame would keep
        raise ConnectionRefusedError(111, "Connection refused")  # quotes nothing

    @rehydrate_engine.registry.after_restore(name="login")
    def login() -> None:
        value = token.get_str().strip()
        try:
            connect(value)
        except OSError as exc:
            raise RuntimeError(f"login with {value} failed") from exc

    async def send(value: str) -> None:
        header = "Bearer " + value
        await asyncio.sleep(0)
        raise ConnectionError(f"refused {header}")

    @rehydrate_engine.registry.after_restore(name="async-login")
    async def async_login() -> None:
        await send(token.get_str().strip())

    report = rehydrate_engine.simulate_restore()
    login_error, async_error = (h.error for h in report.hooks[-2:])
    assert isinstance(login_error, RuntimeError)
    assert str(login_error) == f"login with {SHOWN} failed"
    cause = login_error.__cause__
    assert isinstance(cause, ConnectionRefusedError) and cause.errno == 111
    assert isinstance(async_error, ConnectionError)
    for error in (login_error, cause, async_error):
        _assert_cleared(error)
    assert report.error is not None
    assert _reaching(report.error) == []


def test_no_attribute_of_the_raised_error_is_kept(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """requests' HTTPError kept its response (the URL with the token) and request (the
    Authorization header), CalledProcessError its bytes output, SystemExit its code."""
    import subprocess
    import sys

    import requests
    from requests.adapters import BaseAdapter

    class Refusing(BaseAdapter):
        def send(self, request: Any, **kw: Any) -> requests.Response:
            r = requests.Response()
            r.status_code, r.reason, r.url = 401, "Unauthorized", request.url
            r._content, r.request = b'{"error": "invalid token"}', request
            return r

        def close(self) -> None:
            pass

    @rehydrate_engine.registry.after_restore(name="requests")
    def call_api() -> None:
        value = token.get_str().strip()
        with requests.Session() as session:
            session.mount("https://", Refusing())
            session.get("https://api.example/v1/register", params={"access_token": value},
                        headers={"Authorization": "Bearer " + value}).raise_for_status()

    @rehydrate_engine.registry.after_restore(name="cli")
    def cli() -> None:
        value = token.get_str().strip()
        raise subprocess.CalledProcessError(3, ["login", value], output=value.encode())

    @rehydrate_engine.registry.after_restore(name="exits")
    def exits() -> None:
        sys.exit(f"fatal: token {token.get_str().strip()} rejected")

    report = rehydrate_engine.simulate_restore()
    http, called, exited = (h.error for h in report.hooks[-3:])
    assert isinstance(http, requests.HTTPError) and not hasattr(http, "response")
    # the URL's query string, the token in it, is left out whole
    assert str(http).endswith("for url: https://api.example/v1/register")
    assert isinstance(called, subprocess.CalledProcessError)
    assert str(called) == (f"Command '['login', '{SHOWN}']' returned non-zero exit "
                           "status 3.")
    assert not hasattr(called, "output")
    assert isinstance(exited.__cause__, SystemExit)
    assert exited.__cause__.code == f"fatal: token {SHOWN} rejected"
    assert report.error is not None
    assert _reaching(report.error) == []
    assert "SECRETMARKER" not in "".join(traceback.format_exception(report.error))


def test_the_raised_type_is_not_run_again(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """A copy re-ran the type's ``__init__`` on the unredacted args (its side effects —
    a log line quoting them — with it) and lost its slots' values to what ``__init__``
    sets from the args alone; the stand-in is made by the built-in constructor only."""
    made: list[str] = []

    class ApiError(Exception):
        __slots__ = ("status",)

        def __init__(self, message: str, status: int = 0) -> None:
            made.append(message)
            super().__init__(message)
            self.status = status

    @rehydrate_engine.registry.after_restore(name="slots")
    def slots() -> None:
        raise ApiError(f"token {token.get_str().strip()} rejected", status=401)

    report = rehydrate_engine.simulate_restore()
    error = report.hooks[-1].error
    assert len(made) == 1  # by the hook
    assert isinstance(error, ApiError) and str(error) == f"token {SHOWN} rejected"
    assert not hasattr(error, "status")  # nothing copied: not a false 0 either
    assert report.error is not None
    assert _reaching(report.error) == []


def test_a_type_that_cannot_stand_redacted_is_a_plain_redacted_error(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """A built-in whose constructor the redacted args do not fit: a plain RedactedError
    for that link, its cause still made the same way."""
    @rehydrate_engine.registry.after_restore(name="decode")
    def decode() -> None:
        try:
            raise ValueError(token.get_str())
        except ValueError as exc:
            raise UnicodeDecodeError("utf-8", token.get(), 0, 1, "bad") from exc

    error = rehydrate_engine.simulate_restore().hooks[-1].error
    assert type(error) is RedactedError and error.original_name == "UnicodeDecodeError"
    assert isinstance(error.__cause__, ValueError) and str(error.__cause__) == SHOWN
    assert _reaching(error) == []


def test_a_stand_in_raised_again_stands_for_the_type_first_raised(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """A hook that raises from a recorded error (a retry wrapper): its stand-in is made
    again as one of the type first raised, not of the stand-in's own kind."""
    @rehydrate_engine.registry.after_restore(name="first")
    def first() -> None:
        raise ConnectionError(f"refused {MARK}")

    recorded = rehydrate_engine.simulate_restore().hooks[-1].error

    @rehydrate_engine.registry.after_restore(name="again")
    def again() -> None:
        raise RuntimeError(f"gave up on {MARK}") from recorded

    error = rehydrate_engine.simulate_restore().hooks[-1].error
    cause = error.__cause__
    assert type(cause) is type(recorded) and isinstance(cause, ConnectionError)
    assert cause.original_name == "ConnectionError"


def test_a_dropped_type_is_not_kept_alive_by_its_redacted_kind(token: Secret) -> None:
    """The kind made for a type refers to it (its base): held strongly by the cache, it
    kept every such type — a plugin's, one made per call — for the process's life."""
    import weakref

    from rehydrate._redact import redact_error

    class Dropped(Exception):
        pass

    error = redact_error(Dropped(f"refused {MARK}"))
    assert isinstance(error, Dropped) and isinstance(error, RedactedError)
    gone = weakref.ref(Dropped)
    del Dropped, error
    gc.collect()
    assert gone() is None


def test_a_suspended_generator_that_handed_the_error_on_is_not_closed(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret) -> None:
    """A library's reader that caught an error and handed it on (a future, a queue)
    reads on: its frame is in the error's traceback, and clearing a suspended frame
    closes its generator or coroutine."""
    def reader() -> Iterator[BaseException]:
        while True:
            try:
                raise ConnectionError(f"read failed for {MARK}")
            except ConnectionError as exc:
                yield exc

    stream = reader()
    handed = next(stream)

    @rehydrate_engine.registry.after_restore(name="awaits-the-reader")
    def awaits() -> None:
        raise handed

    error = rehydrate_engine.simulate_restore().hooks[-1].error
    assert isinstance(error, ConnectionError) and MARK not in str(error)
    assert isinstance(next(stream), ConnectionError)  # still reading, not closed


class _Response:
    status = 401


class _ForwardingError(Exception):
    """A client error forwarding unknown attributes to its response (a common shape)."""

    def __init__(self, msg: str, response: _Response) -> None:
        super().__init__(msg)
        self.response = response

    def __getattr__(self, name: str) -> Any:
        return getattr(self.response, name)


class _GroupLikeError(Exception):
    @property
    def exceptions(self) -> Any:  # what the walk asks every error for
        raise KeyError("exceptions")


@pytest.mark.parametrize("make", [
    pytest.param(lambda: _ForwardingError(f"GET /v1?token={MARK} -> 401", _Response()),
                 id="getattr forwarding to its response"),
    pytest.param(lambda: _GroupLikeError(f"auth failed for token {MARK}"),
                 id="an attribute that raises"),
])
def test_an_error_whose_attributes_misbehave_is_redacted_and_the_run_goes_on(
        rehydrate_engine: rehydrate.Lifecycle, token: Secret,
        caplog: pytest.LogCaptureFixture, make: Any) -> None:
    """The stand-in inherited the type's ``__getattr__``, which forwarded to a response it
    does not have: every attribute lookup recursed, the hook worker died logging the raw
    error (the value in clear), the hook became a timeout and the async hooks after it in
    the batch never ran; an attribute raising something else than AttributeError broke
    the redaction the same way."""
    ran: list[str] = []

    @rehydrate_engine.registry.after_restore(name="bad", timeout=5)
    async def bad() -> None:
        raise make()

    @rehydrate_engine.registry.after_restore(name="after")
    async def after() -> None:
        ran.append("after")

    with caplog.at_level(logging.DEBUG):
        report = rehydrate_engine.simulate_restore()
    outcomes = {h.name: h.outcome for h in report.hooks}
    assert outcomes["bad"] == "failed" and outcomes["after"] == "ok", report.table()
    assert ran == ["after"]
    error = next(h.error for h in report.hooks if h.name == "bad")
    assert isinstance(error, RedactedError)
    assert MARK not in caplog.text and MARK not in report.table()
    assert MARK not in "".join(traceback.format_exception(error))


def test_a_url_password_or_query_token_in_a_hook_error_is_left_out(
        rehydrate_engine: rehydrate.Lifecycle, spans: InMemorySpanExporter,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """No secret managed: a hook calling the URL of an environment variable failed with
    its password and api_key in the log line, the report (``status --json``) and the span,
    as requests and httpx's ``raise_for_status()`` quote it."""
    import requests
    from requests.adapters import BaseAdapter

    url = "https://svc:pw-SECRETMARKER@api.example/v1/reload?api_key=SECRETMARKER-q"
    monkeypatch.setenv("RHT_MODEL_URL", url)

    class Refusing(BaseAdapter):
        def send(self, request: Any, **kw: Any) -> requests.Response:
            raise requests.ConnectionError(
                f"Max retries exceeded with url: {request.path_url} (refused)")

        def close(self) -> None:
            pass

    @rehydrate_engine.registry.after_restore(name="with_httpx")
    def with_httpx() -> None:
        request = httpx.Request("GET", os.environ["RHT_MODEL_URL"])
        httpx.Response(401, request=request).raise_for_status()

    @rehydrate_engine.registry.after_restore(name="with_requests")
    def with_requests() -> None:
        with requests.Session() as session:
            session.mount("https://", Refusing())
            session.get(os.environ["RHT_MODEL_URL"])

    caplog.set_level(logging.WARNING, logger="rehydrate")
    report = rehydrate_engine.simulate_restore()
    assert not report.ok
    for where, text in _everywhere(rehydrate_engine, report, spans, caplog).items():
        assert "SECRETMARKER" not in text, where
    shown = {h.name: h.to_dict()["error"] for h in report.hooks[-2:]}
    assert shown["with_httpx"].startswith(
        "HTTPStatusError: Client error '401 Unauthorized' for url "
        "'https://api.example/v1/reload'")
    assert shown["with_requests"] == (
        "ConnectionError: Max retries exceeded with url: /v1/reload (refused)")
    # the types raised still match
    assert isinstance(report.hooks[-2].error, httpx.HTTPStatusError)
    assert isinstance(report.hooks[-1].error, requests.ConnectionError)


class _Kept(RuntimeError):
    """A type of its own: an instance can be referred to weakly (a built-in's cannot)."""


def test_an_error_scrubbed_of_a_url_query_keeps_where_it_failed(
        rehydrate_engine: rehydrate.Lifecycle, spans: InMemorySpanExporter) -> None:
    """No secret managed: an ordinary ``?page=2`` made the error a stand-in without a
    traceback, and the span's ``exception.stacktrace`` lost the hook's frame. It keeps
    where it failed as text (no frame: a token in one of its locals stays unreachable),
    and the error raised, with the token in its message, is not kept."""
    raised: list[weakref.ref[_Kept]] = []

    def fetch(url: str) -> None:
        error = _Kept(f"GET {url} failed: 503")
        raised.append(weakref.ref(error))
        raise error

    @rehydrate_engine.registry.after_restore(name="fetch-page", required=False)
    def fetch_page() -> None:
        api_token = MARK  # noqa: F841 - the local a frame would keep
        sys._getframe().f_locals  # noqa: B018 - as a debugger or a log formatter reads them
        fetch(f"https://api.example.com/v1/items?page=2&token={MARK}")

    report = rehydrate_engine.simulate_restore()
    error = report.hooks[-1].error
    assert isinstance(error, RedactedError) and isinstance(error, _Kept)
    assert str(error) == "GET https://api.example.com/v1/items failed: 503"
    _assert_cleared(error)
    from rehydrate._redact import redacted_stacktrace

    shown = redacted_stacktrace(error)
    assert shown is not None
    assert "in fetch_page" in shown and "in fetch\n" in shown and MARK not in shown
    assert shown.endswith("_Kept: GET https://api.example.com/v1/items failed: 503\n")
    [span] = [s for s in spans.get_finished_spans() if s.name.endswith("fetch-page")]
    [event] = [e for e in span.events if e.name == "exception"]
    stacktrace = str(event.attributes["exception.stacktrace"])  # type: ignore[index]
    assert "in fetch_page" in stacktrace and MARK not in stacktrace
    assert _reaching(error) == []
    gc.collect()
    assert raised[0]() is None


def test_a_generator_the_error_was_thrown_into_and_that_reads_on_is_not_closed(
        rehydrate_engine: rehydrate.Lifecycle) -> None:
    """A consumer that takes errors at its ``yield`` (``gen.throw()``) and hands them on
    is suspended at that same ``yield``, where the error went through its frame:
    clearing the frame would close it."""
    handed: list[BaseException] = []

    def consumer() -> Iterator[None]:
        while True:
            try:
                yield
            except ConnectionError as exc:
                handed.append(exc)

    stream = consumer()
    next(stream)
    stream.throw(ConnectionError(f"read failed for https://db/x?token={MARK}"))

    @rehydrate_engine.registry.after_restore(name="re-raises", required=False)
    def re_raises() -> None:
        raise handed[0]

    error = rehydrate_engine.simulate_restore().hooks[-1].error
    assert isinstance(error, ConnectionError) and MARK not in str(error)
    assert error.__traceback__ is None  # no frame kept: where it failed is text
    stream.throw(ConnectionError("again"))  # still reading, not closed
    assert len(handed) == 2


async def _get(url: str, headers: dict[str, str]) -> None:
    raise ConnectionError(f"GET {url} failed: 503")


def test_an_async_hook_re_raising_keeps_no_local_reachable(
        rehydrate_engine: rehydrate.Lifecycle) -> None:
    """An async hook that logs and re-raises (``except …: await …; raise``): its finished
    frame stood where the re-raise left it, was taken for a suspended one and left
    uncleared, and a frame kept below it held it — and the token in its locals — through
    ``f_back``."""
    @rehydrate_engine.registry.after_restore(name="register-with-api", required=False)
    async def register_with_api() -> None:
        headers = {"Authorization": MARK}
        try:
            await _get("https://api.example.com/v1/register?page=2", headers)
        except ConnectionError:
            await asyncio.sleep(0)
            raise

    error = rehydrate_engine.simulate_restore().hooks[-1].error
    assert isinstance(error, RedactedError)
    gc.collect()
    assert _reaching(error) == []
    from rehydrate._redact import redacted_stacktrace

    shown = redacted_stacktrace(error)
    assert shown is not None and "in register_with_api" in shown and "in _get" in shown


def _connect(dsn: str) -> None:
    raise ConnectionError(f"could not connect to {dsn}")


def test_a_source_line_quoting_a_password_is_redacted_in_the_stack(
        rehydrate_engine: rehydrate.Lifecycle, spans: InMemorySpanExporter) -> None:
    """The stack kept as text shows each frame's source line: one quoting a DSN with its
    password showed the password in the span's ``exception.stacktrace``, the message
    being scrubbed."""
    @rehydrate_engine.registry.after_restore(name="db", required=False)
    def db() -> None:
        _connect("postgresql://app:s3cretpw@db.internal/x")

    error = rehydrate_engine.simulate_restore().hooks[-1].error
    assert isinstance(error, RedactedError) and "s3cretpw" not in str(error)
    from rehydrate._redact import redacted_stacktrace

    shown = redacted_stacktrace(error)
    assert shown is not None and "in db" in shown and "s3cretpw" not in shown
    [span] = [s for s in spans.get_finished_spans() if s.name.endswith("db")]
    [event] = [e for e in span.events if e.name == "exception"]
    assert "s3cretpw" not in str(event.attributes["exception.stacktrace"])  # type: ignore[index]


def test_a_redacted_error_of_a_local_class_keeps_its_stack_when_pickled(
        rehydrate_engine: rehydrate.Lifecycle) -> None:
    """A local class is pickled as a plain RedactedError, which kept only the notes: the
    unpickled error had lost where it failed."""
    class Local(Exception):
        pass

    @rehydrate_engine.registry.after_restore(name="local", required=False)
    def local() -> None:
        raise Local("GET https://api.example.com/x?token=abc failed")

    error = rehydrate_engine.simulate_restore().hooks[-1].error
    from rehydrate._redact import redacted_stacktrace

    back = pickle.loads(pickle.dumps(error))
    assert type(back) is RedactedError
    shown = redacted_stacktrace(back)
    assert shown is not None and "in local" in shown and "token=abc" not in shown


class _ProxyError(Exception):
    """An API error forwarding attribute lookups to its payload, a dict."""

    def __init__(self, msg: str, data: dict[str, Any]) -> None:
        super().__init__(msg)
        self.data = data

    def __getattr__(self, name: str) -> Any:
        return self.data[name]


def test_an_error_whose_getattr_raises_keyerror_is_shown_without_a_secret(
        rehydrate_engine: rehydrate.Lifecycle) -> None:
    """Its ``__notes__`` lookup raised ``KeyError``, and the whole message was withheld
    (``not shown: redacting it failed with KeyError``) with nothing to redact."""
    raised = _ProxyError("upstream said 503", {"code": 503})

    @rehydrate_engine.registry.after_restore(name="proxy", required=False)
    def proxy() -> None:
        raise raised

    report = rehydrate_engine.simulate_restore()
    assert report.hooks[-1].error is raised
    assert report.hooks[-1].to_dict()["error"] == "_ProxyError: upstream said 503"
