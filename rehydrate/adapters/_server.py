"""What the inference-server adapters (vLLM, SGLang) share: HTTP calls retried within a
deadline that fail with the server's own reason, sync and asyncio entry points, and the
two hooks they attach to an engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import re
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import httpx

from .. import Phase, extensions
from ..extensions import Probe, check_seconds, fresh_lock_after_fork, resolve_engine
from . import _bodies

if TYPE_CHECKING:
    import ssl

    from .. import Hook, Registry
    from ..extensions import Engine

__all__ = ["ServerAdapter", "ServerError", "Unconfirmed", "answer_text", "call_maybe_async",
           "redact", "run_sync", "sync_variant", "within"]

log = logging.getLogger("rehydrate.adapters")

T = TypeVar("T")

SNAPSHOT_ORDER = 900_000
"""Before a snapshot: right after the ASGI gate's drain (1_000_000), before every other
hook — the engine goes to sleep once no request can reach it any more."""
RESTORE_ORDER = -900_000
"""After a restore: the first ``APPLICATION`` hook, so user hooks (warm-ups) find the
engine awake; the environment, keys and connections phases have run before."""


_installed: weakref.WeakKeyDictionary[Registry, dict[str, tuple[Hook, Hook]]] = (
    weakref.WeakKeyDictionary())
"""The hooks of the adapter installed per server (``ServerAdapter.key``), per engine
(its ``builtins`` registry): one server gets one pair, whoever installs it again."""
_installed_lock = threading.Lock()
# install() in a forked child takes it (and a parent thread holds it around the
# registry and logging calls).
fresh_lock_after_fork(sys.modules[__name__], "_installed_lock")


MIN_TRY = 0.5
"""Seconds the first attempt of a call gets even when the deadline is (nearly) used up."""


class ServerError(RuntimeError):
    """An inference server refused a call or never answered it within the deadline; the
    message carries the server's own reason (``reason``: that alone, when it answered)."""

    def __init__(self, message: str, *, reason: str | None = None,
                 status: int | None = None, answered: bool | None = None,
                 unreachable: bool = False, unforwarded: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status
        """The HTTP status the server answered with, when that is the failure."""
        self.answered = status is not None if answered is None else answered
        """Whether the server itself answered a try (not only a gateway saying it did not
        pass the call on, nor no answer at all)."""
        self.unreachable = unreachable
        """Whether every try failed to connect (``httpx.ConnectError``: refused, no route):
        nothing listened at the URL — with a direct URL, the server process was gone."""
        self.unforwarded = unforwarded
        """Whether some try got a gateway's answer that it did not pass the call on (see
        :meth:`ServerAdapter.call`'s ``unsent``): the gateway was reached, the server behind
        it was not — unlike tries that found no connection at all, which say nothing of
        the server."""


class Unconfirmed(ServerError):
    """A state-changing call that reached the server but got no (complete) answer, or a
    gateway's 502 / 504 for it: the server may have performed it, or may still be
    performing it — the caller checks the state instead where it can. A call without
    ``resend`` is not sent again after it; one with ``resend`` (harmless to repeat) was
    sent again after a gateway's 502 / 504 until the deadline ended or a try was refused
    (by an answer that does not say every try was refused alike: see
    :meth:`ServerAdapter.call`), and this says an earlier try may have been performed all
    the same."""


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

NOT_THERE = frozenset({404, 405, 501})
"""No such endpoint or method (SGLang before the pause endpoints, vLLM without dev mode):
an answer every try of the call would have got, so none of them was performed."""

GATEWAY_LOST = frozenset({502, 504})
"""A gateway's answer for a request it may have passed on: its upstream timed out (504) or
broke off (502) — possibly after performing it. A 503 is not among them: a server's own
503 (starting, overloaded) and a gateway's (no healthy upstream) both say the request
was not handled, and it is retried like any other 5xx — except Envoy's / Istio's
(:data:`ENVOY_RESET`)."""

ENVOY_RESET = re.compile(r"disconnect/reset before headers", re.IGNORECASE)
"""Envoy's (and Istio's) 503 "upstream connect error or disconnect/reset before headers.
reset reason: connection termination" (flags UC / UR): the upstream connection died,
possibly after the request was forwarded — counted as a 502 / 504, unless the reason says
it never connected (:data:`ENVOY_NOT_SENT`)."""

ENVOY_NOT_SENT = re.compile(
    r"reset reason: (local |remote )?(connection (failure|timeout)|overflow"
    r"|refused stream reset)", re.IGNORECASE)
"""Envoy's reset reasons for a request never forwarded: no connection (refused, timed
out), its circuit breaker's overflow, or an HTTP/2 ``REFUSED_STREAM`` (which by RFC 9113
says the stream was not processed)."""


def gateway_unforwarded(status: int, reason: str) -> bool:
    """Whether ``status`` / ``reason`` is Envoy's 503 for a request it never forwarded
    (:data:`ENVOY_NOT_SENT`): the gateway's answer, not the server's."""
    return status == 503 and bool(ENVOY_RESET.search(reason)) and \
        bool(ENVOY_NOT_SENT.search(reason))


def gateway_lost(status: int, reason: str) -> bool:
    """Whether a gateway's answer ``status`` / ``reason`` leaves open that the server
    behind it performed the request (:data:`GATEWAY_LOST`, :data:`ENVOY_RESET`)."""
    if status in GATEWAY_LOST:
        return True
    return status == 503 and bool(ENVOY_RESET.search(reason)) and \
        not ENVOY_NOT_SENT.search(reason)

# failures after the request may have reached the server (a state-changing call is not
# re-sent after these); every other transport error means it was never sent
SENT_ERRORS = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError, httpx.WriteError,
               httpx.RemoteProtocolError)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("called from a running event loop: await the *_async variant instead")


def sync_variant(method: Callable[[Any], Coroutine[Any, Any, None]]) -> Callable[[Any], None]:
    """The synchronous twin of an ``async`` method without arguments (``sleep`` of
    ``sleep_async``)."""

    def sync(self: Any) -> None:
        run_sync(method(self))

    sync.__doc__ = f":meth:`{method.__name__}` from synchronous code."
    sync.__name__ = method.__name__.removesuffix("_async")
    sync.__qualname__ = method.__qualname__.removesuffix("_async")
    return sync


async def call_maybe_async(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``: awaited when async, in a worker thread when sync (an in-process engine's
    sleep or wake-up takes seconds and must not block the event loop)."""
    import inspect

    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await _in_daemon_thread(fn, *args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


async def _in_daemon_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``asyncio.to_thread`` on a thread of its own: a call given up at its deadline must
    not hold ``asyncio.run`` (which joins the default executor's threads) until it ends."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def run() -> None:
        try:
            outcome = (True, context.run(fn, *args, **kwargs))
        except Exception as exc:
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="rehydrate-engine-call", daemon=True).start()
    return await future


async def within(aw: Awaitable[T], seconds: float, what: str) -> T:
    """``aw``, or :class:`ServerError` ``what`` once ``seconds`` have passed. Unlike
    ``asyncio.wait_for`` it never takes the awaited call's own ``TimeoutError`` for its
    own."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except BaseException:  # the caller was cancelled (a hook timeout): so is the call
        abandon(task)
        raise
    if not done:
        abandon(task)
        raise ServerError(what)
    return task.result()


def abandon(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and collect its outcome whenever it comes (else asyncio logs "Task
    exception was never retrieved" for a request that failed as its client closed). One
    that is done already — it failed in the very step its waiter was cancelled — is
    collected now: its loop may be stopped before a callback would run."""
    if task.done():
        if not task.cancelled():
            task.exception()
        return
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


REDACTED = "[redacted]"

_CREDENTIAL_HEADERS = ("authorization", "proxy-authorization", "x-api-key", "api-key", "cookie")

_HEADER_VALUE = re.compile(
    r"""\b((?:proxy-)?authorization|x-api-key|api[-_]?key|access[-_]?token|cookie)"""
    r"""(["']?\s*[:=]\s*["']?)((?:(?:bearer|basic|token)\s+)?"""
    r"""(?!(?:required|missing|invalid|expired|malformed|unknown|undefined|provided)\b)"""
    r"""[^\s"',;&]{8,})""",
    re.IGNORECASE)
"""A credential quoted as a header or field (``Authorization: Bearer …``,
``"x-api-key": "…"``, ``api_key=…``): the value, scheme included, is hidden — any of 8+
characters but the words a server's explanation puts there (``api_key: missing``,
``x-api-key: required``)."""

_SCHEME_TOKEN = re.compile(
    r"\b(bearer|basic)(\s+)(?!(?:realm|scope|error|token|auth\w*|required|credentials?)\b)"
    r"(?:(?=[A-Za-z.~:]*[0-9\-_+/=])[A-Za-z0-9\-._~+/=:]{8,}|[A-Za-z.]{16,})",
    re.IGNORECASE)
"""``Bearer <token>`` / ``Basic <credentials>`` quoted without a header name (8+
characters with a digit or ``-_+/=``, or 16+ letters); the words a server's own
explanation puts there (``Bearer realm=…``, ``Basic authentication``, ``Bearer tokens
expired``) stay."""

_URL = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")
"""A URL: its scheme starts where no scheme character precedes (not at every position of
a long ``a.a.a…`` run, which made the search quadratic in the body's length)."""


def _redact_url(match: re.Match[str]) -> str:
    url = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@?#]*@", r"\1", match.group(0))
    base, sep, query = url.partition("?")
    if not sep:
        return url
    # query parameters carry tokens and signatures (presigned URLs): names stay, values go
    return base + "?" + re.sub(r"=[^&#]*", "=" + REDACTED, query)


def redact(text: str, secrets: Iterable[str] = (), *, patterns: bool = True) -> str:
    """``text`` without ``secrets`` (the adapter's own key, verbatim), the values of the
    managed secrets (:func:`rehydrate.extensions.redact`: the mechanism hook errors go
    through) nor what looks like a credential: ``Bearer <token>``, ``Authorization: …``,
    user info and query values of URLs. For anything a server answered that ends up in a
    log, a status or an error: a gateway that echoes the request (its ``Authorization``
    header in a 401 body) would otherwise publish the adapter's key. ``patterns=False``:
    only ``secrets`` and the managed secrets."""
    text = extensions.redact(text)
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    if not patterns:
        return text
    text = _URL.sub(_redact_url, text)
    text = _HEADER_VALUE.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    return _SCHEME_TOKEN.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)


def request_secrets(response: httpx.Response) -> list[str]:
    """The credentials ``response``'s request carried: header values and their token part
    (``Bearer sk-…`` gives both), and those of the environment's proxies
    (:func:`proxy_secrets`), so an answer quoting any of them can be redacted."""
    found = proxy_secrets()
    try:
        headers = response.request.headers
    except RuntimeError:  # a response built without a request
        return found
    for name in _CREDENTIAL_HEADERS:
        for value in headers.get_list(name):
            found.append(value)
            found.extend(part for part in value.split()[1:] if len(part) >= 4)
    return found


def proxy_secrets() -> list[str]:
    """The credentials in the proxy URLs of the environment (``HTTP_PROXY``,
    ``HTTPS_PROXY``, ``ALL_PROXY``, read as httpx reads them): the user info as written
    and decoded, the password (4+ characters) and the base64 token of httpx's
    ``Proxy-Authorization: Basic …``. httpx sends that header on the proxy connection,
    not among the request's headers, and a proxy's 407 quoting it — or the bare token,
    which no pattern tells from a word — published the proxy's password."""
    import base64
    from urllib.parse import unquote, urlsplit
    from urllib.request import getproxies

    found: list[str] = []
    for scheme, value in getproxies().items():
        if scheme == "no" or not value:
            continue
        netloc = urlsplit(value if "://" in value else f"http://{value}").netloc
        userinfo, at, _ = netloc.rpartition("@")
        if not at or not userinfo:
            continue
        user, _, password = userinfo.partition(":")
        decoded = f"{unquote(user)}:{unquote(password)}"
        found += [userinfo, decoded,
                  base64.b64encode(decoded.encode("utf-8")).decode("ascii")]
        found += [p for p in (password, unquote(password)) if len(p) >= 4]
    return found


def answer_text(response: httpx.Response, text: str, limit: int = 300) -> str:
    """``text``, taken from what ``response`` says, fit to quote: on one printable line,
    without the request's credentials or anything looking like one, at most ``limit``
    characters."""
    # The request's own credentials go everywhere (one linear pass each, after the white
    # space is collapsed, so that none is cut in half first); the patterns only over what
    # can be shown, with a margin: a 1 MB error page must not cost the hook its deadline.
    text = redact(" ".join(text.split()), request_secrets(response), patterns=False)
    text = redact(text[:limit * 4])
    # One printable line: the reason goes into logs, status and 503 bodies, where a
    # server's escape sequences (ANSI colours, a terminal title) have no business.
    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    # cut after redacting: a key cut in half would no longer be recognised
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return text


PAGE_READ = 64 * 1024
"""Characters of an HTML error page read for its words: its title and message come first."""

_TAG = re.compile(r"<[^<>]*>")
"""A tag: linear (a ``<`` without its ``>`` stops the match at the next ``<``)."""
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
"""Tag names in lower case, every index kept (``str.lower()`` makes ``İ`` two characters)."""


_BLOCKS = (("<!--", "-->"), ("<script", "</script"), ("<style", "</style"))
"""What an error page shows no word of: comments, scripts, styles (start, end)."""


def _opens(lower: str, at: int, start: str) -> bool:
    """Whether ``start`` at ``at`` opens its block: a comment always, a tag only by its
    whole name (``<stylesheet>`` is no ``<style``)."""
    if start == "<!--":
        return True
    after = lower[at + len(start):at + len(start) + 1]
    return after in ("", ">", "/") or after.isspace()


def _without_blocks(text: str) -> str:
    """``text`` without its comments, scripts and styles, in one scan from left to right
    (a ``<!--`` inside a script is the script's; an unclosed block runs to the end),
    found with ``str.find``: a regex (``<!--.*?-->``) scans to the end of the text from
    every unclosed start — quadratic on a hostile page, as :mod:`html.parser` is (seconds
    for 16 KiB of ``<a <a <a``)."""
    lower = text.translate(_ASCII_LOWER)
    kept: list[str] = []
    at = 0
    found = {start: lower.find(start) for start, _ in _BLOCKS}
    while True:
        for start, _ in _BLOCKS:  # the next whole opening of each kind from ``at`` on
            pos = found[start]
            while pos >= 0 and (pos < at or not _opens(lower, pos, start)):
                pos = lower.find(start, max(pos + 1, at))
            found[start] = pos
        opened = [(pos, start, end) for start, end in _BLOCKS
                  if (pos := found[start]) >= 0]
        if not opened:
            kept.append(text[at:])
            return " ".join(kept)
        pos, start, end = min(opened)
        kept.append(text[at:pos])
        # "<!-->" and "<!--->" are whole (empty) comments: the end is looked for from the
        # opening's second character on
        closed = lower.find(end, pos + (2 if start == "<!--" else len(start)))
        if closed < 0:
            return " ".join(kept)
        at = lower.find(">", closed + len(end) - 1) + 1 or len(text)


def page_text(response: httpx.Response) -> str:
    """The words of an HTML error page (``Content-Type: text/html``) — its title, then
    its text without tags, scripts, styles or comments — or ``""`` for an answer that is
    no HTML page. A gateway's page (Cloudflare's, Google's load balancer's) opens with
    hundreds of characters of markup and CSS: quoted as it came, the 300 characters a
    reason keeps ended before the words saying what went wrong."""
    if "html" not in response.headers.get("content-type", "").lower():
        return ""
    import html

    page = _without_blocks(response.text[:PAGE_READ])
    lower = page.translate(_ASCII_LOWER)
    title = ""
    opened = lower.find("<title")
    if opened >= 0 and (inside := lower.find(">", opened) + 1):
        closed = lower.find("</title", inside)
        title = page[inside:closed if closed >= 0 else len(page)]
        page = page[:opened] + " " + (page[closed:] if closed >= 0 else "")

    def words(text: str) -> str:
        return " ".join(html.unescape(_TAG.sub(" ", text)).split())

    title, body = words(title), words(page)
    if title and body.startswith(title):  # nginx repeats its title as the heading
        body = body[len(title):].strip()
    return f"{title}: {body}" if title and body else title or body


def server_reason(response: httpx.Response) -> str:
    """The server's explanation from an error response, on one line, credentials
    redacted (:func:`answer_text`); an HTML page's words (:func:`page_text`), not its
    markup."""
    text = ""
    try:
        body = _bodies.loads(response.content)
    except ValueError:  # not JSON, or nested deeper than json can parse
        body = None
    if isinstance(body, Mapping):
        for key in ("message", "detail", "error", "reason"):
            value = body.get(key)
            if isinstance(value, Mapping):  # OpenAI style: {"error": {"message": ...}}
                value = value.get("message", value)
            if value:
                text = str(value)
                break
    if not text:
        text = page_text(response) or response.text
    return answer_text(response, text) or "empty body"


class ServerAdapter:
    """Base of the HTTP inference-server adapters: one server, a deadline for every hook,
    one before-snapshot and one after-restore hook.

    An adapter is an :class:`~rehydrate.extensions.Extension`:
    ``rehydrate.start(extensions=[VLLMAdapter(url)])`` (or, in an engine of one's own,
    ``Lifecycle(extensions=[*DEFAULT_EXTENSIONS, VLLMAdapter(url)])``: a list replaces the
    defaults) installs it unless :meth:`probe` finds a
    server that answers and cannot serve it (then a ``WARNING`` says why); a server that
    does not answer *yet* (still loading its model) is no reason to skip it: the adapter
    is installed, and its hooks fail with the server's reason if it still does not answer
    at the snapshot or restore, as after :meth:`install`, which attaches it
    unconditionally.
    """

    kind: ClassVar[str]
    """``vllm`` / ``sglang``: hook names are ``rehydrate.<kind>.<action>``."""
    title: ClassVar[str]
    """``vLLM`` / ``SGLang``: the server in a message."""
    snapshot_action: ClassVar[str]
    restore_action: ClassVar[str]
    health_path: ClassVar[str] = "/health"

    def __init__(self, url: str | None, *, api_key: str | None, deadline: float,
                 request_timeout: float) -> None:
        # At most a year: deadline=10**400 was accepted and every hook then failed with
        # an OverflowError ("int too large to convert to float") naming no argument.
        deadline = check_seconds(deadline, "deadline")
        request_timeout = check_seconds(request_timeout, "request_timeout")
        if url is not None:
            _check_url(url)
        self.url = url.rstrip("/") if url is not None else None
        self.deadline = deadline
        self.request_timeout = request_timeout
        api_key = _checked_api_key(api_key)
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._ssl: ssl.SSLContext | None = None
        self.key = f"rehydrate.adapters.{self.kind}:{self.url or id(self)}"
        """Unique per adapter: one engine may drive several servers."""

    @property
    def _at(self) -> str:
        """`` at <url>`` for a message about this server (nothing for an in-process one)."""
        return f" at {self.url}" if self.url is not None else ""

    # -- hooks ---------------------------------------------------------------------------

    @property
    def restore_extra(self) -> float:
        """Seconds the after-restore hook may run past ``deadline`` by design (its hook
        timeout grows by as much)."""
        return 0.0

    def install(self, engine: Engine | None = None) -> None:
        """Attach the before-snapshot and after-restore hooks to ``engine`` (default: the
        process's engine). Both are required: a failure fails the snapshot (the platform
        aborts it) or leaves the process degraded (not ready).

        Once per server and engine: installing this adapter again, or another one for the
        same server (``install(url)`` called twice, or next to ``Lifecycle(extensions=…)``),
        replaces the hooks attached before — two pairs would put the server to sleep twice
        and wake it twice, and a second SGLang resume is refused."""
        eng = resolve_engine(engine)
        b = eng.builtins
        timeout = self.deadline + 5.0  # the adapter's own deadline speaks first
        with _installed_lock:
            per_server = _installed.setdefault(b, {})
            previous = per_server.pop(self.key, ())
            for hook in previous:
                b.unregister(hook)
            if previous:
                log.info("%s adapter for %s installed again: it replaces the one before",
                         self.kind, self.url or "an in-process engine")
            snapshot_name = f"rehydrate.{self.kind}.{self.snapshot_action}"
            restore_name = f"rehydrate.{self.kind}.{self.restore_action}"
            # A second server of this kind on the engine (a generator and a reranker):
            # its hooks name it, or a report, /readyz and the log could not tell which
            # server failed. The first keeps the plain names that probes and alerts match.
            taken = {h.name for hooks in per_server.values() for h in hooks}
            if (previous and previous[0].name != snapshot_name) or snapshot_name in taken:
                suffix = f"[{self._where()}]"
                snapshot_name += suffix
                restore_name += suffix
            per_server[self.key] = (
                b.register(self.before_snapshot, event="snapshot", phase=Phase.APPLICATION,
                           order=SNAPSHOT_ORDER, timeout=timeout, name=snapshot_name),
                b.register(self.after_restore, event="restore", phase=Phase.APPLICATION,
                           order=RESTORE_ORDER, timeout=timeout + self.restore_extra,
                           name=restore_name),
            )

    def _where(self) -> str:
        """This server in a hook name: ``host:port`` (with the URL's path, a proxy's
        prefix), or the in-process engine's object id."""
        if self.url is None:
            return f"in-process {id(self)}"
        return self.url.split("://", 1)[-1]

    async def before_snapshot(self) -> None:
        """What the before-snapshot hook does."""
        raise NotImplementedError

    async def after_restore(self) -> None:
        """What the after-restore hook does."""
        raise NotImplementedError

    # -- HTTP ----------------------------------------------------------------------------

    def client(self) -> httpx.AsyncClient:
        """A client for one operation (hooks may run on different event loops)."""
        assert self.url is not None
        if self._ssl is None:  # building one costs milliseconds: once per adapter
            self._ssl = httpx.create_ssl_context()
        # A proxy from HTTP_PROXY cannot reach this host's loopback (its own is another):
        # a server on 127.0.0.1 / localhost is called directly, as Go's ProxyFromEnvironment
        # does — a Pod with an egress proxy configured otherwise "does not answer".
        # No compression: the answers are small, and a compressed one could inflate far
        # beyond the bytes read before the cut (_bodies.request).
        return httpx.AsyncClient(base_url=self.url,
                                 headers={**self._headers, "accept-encoding": "identity"},
                                 verify=self._ssl, trust_env=not _is_loopback(self.url))

    def hint(self, path: str, response: httpx.Response, reason: str) -> str | None:
        """A fix to suggest when ``response`` means retrying is pointless (None: retry 5xx)."""
        return None

    def key_fix(self, path: str) -> str:
        """What to do about the server's own refusal of the API key on ``path``."""
        return "pass api_key= matching its --api-key"

    def refused_access(self, path: str, response: httpx.Response,
                       reason: str) -> tuple[str, bool] | None:
        """For an authentication refusal (401, 403, 407) of ``path``: what the error says
        after ``HTTP <status>`` (``reason``: the response's :func:`server_reason`), and
        whether the server itself gave it. The server's own is its ``--api-key`` check's
        401 ``{"error": "Unauthorized"}`` (vLLM's and SGLang's middleware; the fix:
        :meth:`key_fix`); a 407, or a 401 / 403 with any other body, is a proxy's or
        gateway's own answer — the call never reached the server, and the answer says
        nothing of its state."""
        status = response.status_code
        if status == 407:
            return (f" from a proxy between this process and {self.title}, not {self.title}"
                    f" (Proxy Authentication Required: {reason}) — the call did not reach "
                    f"{self.title}; give the proxy its credentials (HTTPS_PROXY / "
                    f"HTTP_PROXY) or exempt the host with NO_PROXY", False)
        if status not in (401, 403):
            return None
        if status == 401 and json_or_empty(response).get("error") == "Unauthorized":
            return (f": Unauthorized — {self.title} refused the API key: "
                    f"{self.key_fix(path)}", True)
        return (f" from a gateway in front of {self.title}, not {self.title} (its own "
                f"authentication: {reason}) — the call did not reach "
                f"{self.title}; give the adapter credentials the gateway accepts (api_key= "
                f"is sent as a bearer token) or point url= at {self.title} itself", False)

    @staticmethod
    def _refused_any_try(response: httpx.Response, hint: str | None,
                         access: tuple[str, bool] | None) -> bool:
        """Whether a refusal would have met every try of the call alike, so that none was
        performed: no such endpoint or method (:data:`NOT_THERE`), an answer :meth:`hint`
        recognises (a setting the server lacks: vLLM's "Sleep mode is not enabled"), or the
        server's own API-key check. A gateway's own refusal, or any other, says nothing of
        an earlier try the server behind it got."""
        return response.status_code in NOT_THERE or hint is not None or (
            access is not None and access[1])

    async def call(self, client: httpx.AsyncClient, method: str, path: str, *,
                   until: float, params: Mapping[str, Any] | None = None,
                   json: Any = None, resend: bool = False, resend_when_cut: bool = False,
                   unsent: Callable[[httpx.Response, str], bool] | None = None
                   ) -> httpx.Response:
        """``method path`` until ``until`` (``time.monotonic()``).

        A ``GET`` is retried on transport errors, timeouts and 5xx, each try cut at
        ``request_timeout``. A state-changing ``POST`` (sleep, wake-up, reload, release,
        resume: seconds to minutes) gets what is left of the deadline to answer in one try
        and is sent again only when it certainly was not performed — no connection, or the
        server's own error answer (500, 503, …); after it was sent and no answer came, or a
        gateway answered 502 / 504 for it (its upstream may have performed it: a proxy's
        timeout shorter than a reload), it raises :class:`Unconfirmed`. ``resend``: a
        ``POST`` that may be performed twice (a canary generation, a pause, vLLM's sleep
        and wake-up, which do nothing on an engine already asleep / awake) is sent again
        after a 502 / 504 as well — and raises :class:`Unconfirmed` when the deadline
        ends after one. ``resend_when_cut``: a ``POST`` whose answer is the only
        confirmation there is (a canary) is sent again when its connection was lost before
        the answer too (not after no answer came: the try had the whole deadline).
        ``unsent(response, reason)``: true for a gateway's answer taken as
        "not passed on" for this call, retried like a 503 (SGLang's 502, see its
        adapter). A 4xx, or an answer :meth:`hint` recognises, fails at once — as
        :class:`Unconfirmed` when an earlier try got a 502 / 504 (``resend``): the refusal
        does not undo that try — unless it would have met that try too (no such endpoint
        or method, an answer :meth:`hint` recognises, the server's own API-key 401): then
        neither was performed, and it is a plain :class:`ServerError`. An authentication
        refusal says whose it is (:meth:`refused_access`).

        Raises :class:`ServerError` naming the call and the server's last reason.
        """
        attempt = 0
        last = ""
        lost = False  # a try a gateway answered 502 / 504 for: it may have been performed
        answered = False  # a try the server itself answered (see ServerError.answered)
        refused = True  # every try so far failed to connect (ServerError.unreachable)
        unforwarded = False  # a gateway said it did not pass a try on (ServerError's)
        # the server's URL: one engine may drive two servers of a kind (a generator and
        # a reranker), and the message must say which one failed
        what = f"{method} {self.url}{path}"
        safe = method.upper() in SAFE_METHODS
        while True:
            remaining = until - time.monotonic()
            if remaining <= 0 and attempt:
                # re-sent after a 502 / 504 (resend): any of those tries may have been
                # performed, so the caller checks the state as after any lost answer
                raise (Unconfirmed if lost else ServerError)(
                    f"{self.kind} {what}: {last} (gave up after the {self.deadline:g}s "
                    f"deadline)" + ("; a gateway's 502 / 504 came for it: the server "
                                    "may have performed it" if lost else ""),
                    answered=answered, unreachable=refused, unforwarded=unforwarded)
            # every call is tried at least once, even when earlier calls used up the deadline
            budget = max(remaining, MIN_TRY)
            per_try = min(self.request_timeout, budget)
            # re-sending a slow state-changing call would queue a second one behind it
            read = per_try if safe else budget
            try:
                # httpx's timeout bounds each read: an answer trickling in would hold the try
                # At most MAX_BODY bytes of the answer: a proxy streaming for ever (cut
                # at the deadline) or a huge error page must not fill memory.
                response = await within(
                    _bodies.request(client, method, path, params=params, json=json,
                                    timeout=httpx.Timeout(per_try, read=read)),
                    read, f"no answer within {read:.3g}s")
            except ServerError as exc:  # within()'s: the request was sent
                last = str(exc)
                refused = False
                if not safe:
                    raise Unconfirmed(f"{self.kind} {what}: {last}; not sent again: the "
                                      f"server may have performed it") from None
            except SENT_ERRORS as exc:
                refused = False
                timed_out = isinstance(exc, httpx.TimeoutException)
                if timed_out:
                    last = f"no answer within {read:.3g}s"
                else:
                    last = f"connection lost before the answer ({type(exc).__name__})"
                if not safe and (timed_out or not resend_when_cut):
                    raise Unconfirmed(f"{self.kind} {what}: {last}; not sent again: the "
                                      f"server may have performed it") from None
            except httpx.TimeoutException:  # connect / pool: the request was never sent
                last = f"no connection within {per_try:.3g}s"
                refused = False  # a host that does not answer may still run the server
            except httpx.LocalProtocolError as exc:
                # never its message: it quotes the offending header, i.e. the API key
                raise ServerError(f"{self.kind} {what}: the request could not be sent "
                                  f"({type(exc).__name__})") from None
            except httpx.TransportError as exc:
                refused = refused and isinstance(exc, httpx.ConnectError)
                last = f"unreachable ({type(exc).__name__}: {exc})" if str(exc) else \
                    f"unreachable ({type(exc).__name__})"
            except httpx.DecodingError:
                # answered, but garbled (a proxy's wrong Content-Encoding): it will stay so
                raise (ServerError if safe else Unconfirmed)(
                    f"{self.kind} {what}: unreadable answer (DecodingError)") from None
            else:
                if response.is_success:
                    return response
                if response.is_redirect or 300 <= response.status_code < 400:
                    location = response.headers.get("location")
                    where = f" to {_shown(location)}" if location else ""
                    raise ServerError(f"{self.kind} {what}: HTTP {response.status_code} "
                                      f"redirect{where} — point url= at the server itself "
                                      f"(redirects are not followed)")
                reason = server_reason(response)
                last = f"HTTP {response.status_code}: {reason}"
                refused = False
                passed_over = unsent is not None and unsent(response, reason)
                not_sent = passed_over or gateway_unforwarded(response.status_code, reason)
                access = self.refused_access(path, response, reason)
                # a gateway's own refusal is not the server's answer, and not a "did not
                # pass it on" that says the server may be gone either
                answered = answered or (not not_sent and (access is None or access[1]))
                unforwarded = unforwarded or not_sent
                if not safe and gateway_lost(response.status_code, reason) and not passed_over:
                    lost = True
                if lost and not resend:
                    raise Unconfirmed(f"{self.kind} {what}: {last}; not sent again: the "
                                      f"server behind the gateway may have performed it "
                                      f"(point url= at the server, or give the gateway a "
                                      f"timeout above the {self.deadline:g}s deadline)",
                                      reason=reason, status=response.status_code)
                hint = self.hint(path, response, reason)
                if access is not None:
                    message = f"{self.kind} {what}: HTTP {response.status_code}{access[0]}"
                elif hint is not None or response.status_code in (501, 505) or (
                        400 <= response.status_code < 500
                        and response.status_code not in (408, 429)):
                    message = f"{self.kind} {what}: {last}" + (f" — {hint}" if hint else "")
                else:
                    message = ""
                if message:
                    # Re-sent after a gateway's 502 / 504 (resend): a refusal now does not
                    # undo the earlier try, which may have been performed — read as never
                    # performed, a pause was forgotten and SGLang stayed paused for good.
                    # Unless the refusal would have met that try as well: then it was not
                    # performed either, and taken as maybe performed, SGLang without the
                    # pause endpoints failed every snapshot and restore on one 502, and
                    # vLLM without sleep mode held the snapshot for the whole deadline.
                    maybe = lost and not self._refused_any_try(response, hint, access)
                    raise (Unconfirmed if maybe else ServerError)(
                        message + ("; an earlier try got a gateway's 502 / 504: the server "
                                   "may have performed it" if maybe else ""),
                        reason=reason, status=response.status_code, answered=answered,
                        unforwarded=unforwarded)
            log.debug("%s %s: %s; retrying", self.kind, what, last)
            attempt += 1
            await asyncio.sleep(min(0.05 * 2 ** min(attempt - 1, 5), 1.0,
                                    max(until - time.monotonic(), 0)))

    async def quick_get(self, client: httpx.AsyncClient, path: str) -> httpx.Response:
        """One ``GET path`` (a probe, a look at the server's settings), cut at
        ``min(request_timeout, 5)`` seconds as a whole: httpx's timeout bounds each read
        only, and an answer trickling in a byte at a time (a broken proxy) held ``start()``
        for ever. :class:`ServerError` ``no complete answer within Ns`` then; httpx's
        errors as they are."""
        seconds = min(self.request_timeout, 5.0)
        return await within(_bodies.request(client, "GET", path, timeout=seconds), seconds,
                            f"no complete answer within {seconds:.3g}s")

    def not_yet(self, why: str) -> Probe:
        """The probe of a server that does not answer yet, or answers it is not ready (one
        still loading its model): usable. Skipping the adapter left a snapshot that never
        put the server to sleep and a restore that ended ready without waking it, with an
        INFO line only; installed, its hooks fail with the server's own reason."""
        log.info("%s server at %s is not ready yet (%s): the adapter is installed anyway; "
                 "its hooks fail if it is still not ready at a snapshot or restore",
                 self.kind, self.url, why)
        return Probe(True, f"{self.url} is not ready yet ({why}): installed anyway")

    async def probe_async(self) -> Probe:
        """Usable when the server answers its health endpoint, or does not answer yet
        (:meth:`not_yet`); not usable when it answers with a client error (4xx: not this
        kind of server, not configured for it, or an authentication refusal: whose, as
        :meth:`refused_access` says)."""
        return (await self._probe_health())[0]

    async def _probe_health(self) -> tuple[Probe, bool]:
        """:meth:`probe_async`'s answer, and whether the server answered healthy (a
        subclass asks it more then)."""
        assert self.url is not None
        try:
            async with self.client() as c:
                r = await self.quick_get(c, self.health_path)
        except httpx.HTTPError as exc:
            return self.not_yet(f"does not answer: {type(exc).__name__}"), False
        except ServerError as exc:
            return self.not_yet(str(exc)), False
        if r.is_success:
            return Probe(True, f"{self.url}{self.health_path} answers {r.status_code}"), True
        if r.status_code >= 500 or r.status_code in (408, 429):
            return self.not_yet(f"{self.url}{self.health_path} answers HTTP {r.status_code}: "
                                f"{server_reason(r)}"), False
        return Probe(False, self.refused(self.health_path, r)), False

    def refused(self, path: str, response: httpx.Response) -> str:
        """Why ``path``'s client error (4xx) makes the server not usable, an authentication
        refusal worded as the hooks' calls word it (:meth:`refused_access`: the server's
        own ``--api-key`` check, or a gateway's or proxy's, which the call never passed)."""
        reason = server_reason(response)
        access = self.refused_access(path, response, reason)
        said = access[0] if access is not None else f": {reason}"
        return f"{self.url}{path} answers HTTP {response.status_code}{said}"

    def probe(self) -> Probe:
        """:meth:`probe_async` from synchronous code, also inside a running event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.probe_async())
        # Lifecycle(extensions=[...]) probes synchronously, and is often built in an async
        # main or next to an AsyncLLM: the probe gets a loop of its own on a thread
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rehydrate-probe") as p:
            return p.submit(asyncio.run, self.probe_async()).result()


def _is_loopback(url: str) -> bool:
    """True when ``url``'s host is this machine's loopback: ``localhost`` (and names
    under ``.localhost``, RFC 6761), 127.0.0.0/8 or ``::1``."""
    import ipaddress

    host = httpx.URL(url).host.rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _shown(url: str) -> str:
    """``url`` for a message: without user info, query and fragment (where passwords and
    tokens go), even when it does not parse."""
    url = re.split(r"[?#]", url, maxsplit=1)[0]
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)?[^/@]*@", r"\1", url)


def _check_url(url: str) -> None:
    """``ValueError`` for a base URL no adapter can use; the URL shows up in keys, probes,
    logs and errors, so it must carry no secret, and a message quotes none."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, not {_shown(url)!r}")
    if "?" in url or "#" in url:
        raise ValueError(f"url must not contain a query or fragment (the part after ? or # "
                         f"is not shown): give the server root, and a token as api_key=, "
                         f"not {_shown(url)!r}")
    if not _has_host_and_port(url):
        raise ValueError(f"url must name a host (and a port 1-65535, if any), "
                         f"not {_shown(url)!r}")
    if httpx.URL(url).userinfo:
        raise ValueError("url must not contain credentials: pass api_key= instead")
    if httpx.URL(url).path.rstrip("/").endswith("/v1"):
        # every endpoint would be /v1/<endpoint>: 404s read as "dev mode is off"
        raise ValueError(f"url must be the server root, not the OpenAI base URL: drop the "
                         f"/v1 from {_shown(url)!r}")


def _has_host_and_port(url: str) -> bool:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        return False
    return bool(parsed.host) and " " not in url and (
        parsed.port is None or 0 < parsed.port <= 65535)


def _checked_api_key(api_key: str | None) -> str | None:
    """The key without surrounding whitespace (one read from a file ends in a newline);
    ``ValueError`` — never quoting the key — for one no HTTP header can carry."""
    if api_key is None:
        return None
    if not isinstance(api_key, str):
        raise TypeError(f"api_key must be a str, not {type(api_key).__name__}")
    key = api_key.strip()
    if not key or not all("!" <= ch <= "~" for ch in key):
        raise ValueError("api_key must be visible ASCII characters (no spaces, newlines or "
                         "control characters inside); the value is not shown")
    return key


def json_or_empty(response: httpx.Response) -> Mapping[str, Any]:
    """The JSON object of a response, or ``{}`` for the empty (or non-object) 200 some
    server versions answer."""
    if not response.content.strip():
        return {}
    try:
        body = _bodies.loads(response.content)
    except ValueError:  # also "[[[[..." deeper than json parses, and a body cut short
        return {}
    return body if isinstance(body, Mapping) else {}


