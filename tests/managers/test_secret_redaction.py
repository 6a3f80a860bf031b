"""A managed secret's value quoted in a hook's error is redacted where the error is
recorded: not in the log, the report, ``status()``, the telemetry span or a readiness
gate's answer."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import pickle
import socket
import traceback
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
    assert isinstance(error, RedactedError)
    assert error.original_name == "LocalProtocolError"
    assert error.original_type == "httpx.LocalProtocolError"
    assert str(error) == f"Illegal header value b'Bearer {SHOWN}'"
    # the span's status names the type raised, as the report and the log line do
    [span] = [s for s in spans.get_finished_spans() if s.name.endswith("register-with-api")]
    assert span.status.description == f"LocalProtocolError: {error}"
    # nothing of the original is kept to be formatted (or snapshotted) later
    assert error.__cause__ is None and error.__context__ is None
    assert error.__traceback__ is None


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
        assert SHOWN in text, where
    assert report.hooks[-1].to_dict()["error"].startswith("ValueError: refused ")


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
    assert isinstance(error, RedactedError)
    assert str(error) == "the API refused the request"
    assert error.original_name == "ConnectionError"
    assert report.error is not None
    assert "SECRETMARKER" not in "".join(traceback.format_exception(report.error))
    if hasattr(error, "add_note"):
        assert error.__notes__[0] == f"sent {SHOWN}"
    back = pickle.loads(pickle.dumps(error))
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


def test_a_bound_method_redactor_is_held_weakly() -> None:
    class Holder:
        def hide(self, text: str) -> str:
            return text.replace("hidden-value", "[gone]")

    holder = Holder()
    remove = extensions.add_redactor(holder.hide)
    try:
        assert extensions.redact("a hidden-value") == "a [gone]"
        del holder
        gc.collect()
        assert extensions.redact("a hidden-value") == "a hidden-value"
    finally:
        remove()


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
