"""SGLang: GPU memory released through the snapshot, resumed and checked after a restore.

::

    from rehydrate.adapters import sglang

    sglang.install("http://127.0.0.1:30000")                      # all memory
    sglang.install("http://127.0.0.1:30000", tags=["kv_cache"])   # or some of it

Before a snapshot (hook ``rehydrate.sglang.release``, right after the ASGI gate's drain):
``GET /server_info`` — a warning when it shows the memory saver off
(``--enable-memory-saver`` missing: the calls then only log on the server and the GPU
memory stays allocated) — then ``POST /pause_generation`` with ``{}`` (SGLang's default
mode, ``abort``: requests still running are aborted, new ones wait), then ``POST
/release_memory_occupation`` with ``{"tags": [...]}`` (or ``{}``: everything). After a
restore or resume (hook ``rehydrate.sglang.resume``, the first application hook): ``POST
/resume_memory_occupation`` with the same body — skipped when this process never sent a
release (an earlier snapshot attempt failed before it, or SGLang refused the release);
after an unanswered release a "not released" refusal counts as resumed — then ``POST
/continue_generation`` (when this process paused it; also after a resume that went
unanswered), then ``GET /health_generate``, which generates one token, as the canary
(retried while it answers 503, as SGLang does while it starts up).

SGLang 0.5 dies of a resume of memory not released (its scheduler's ``KeyError`` ends
the server) and no endpoint says what is released, so the adapter goes by what reached
the server: SGLang performs the calls it received, in order. A release or resume that
went unanswered — no answer, the connection lost after sending, a gateway's 504 (or
Envoy's 503 "disconnect/reset before headers" for other reset reasons) — counts as performed:
an unanswered release still owes its resume, an unanswered resume is never sent again
(the continue and the canary, which run after it, follow it, and a passing canary
confirms it). A gateway's 502, Envoy's 503 "connection termination" / "remote reset" /
"no healthy upstream", or a 503 that is not JSON, counts as not passed on
(:func:`not_passed_on`): retried like a 503, and a release that
ends on it owes nothing — the rare one after SGLang performed the call then sends it
twice, which kills SGLang as well (a second release: torch_memory_saver exits). Memory
still released (its resume failed on SGLang's own answer, or found no connection in
time) is not released again by the next release (a WARNING). A resume that never reached
SGLang says nothing of its memory: every try refused (no HTTP status at all) counts as
SGLang gone with it — a restarted one has nothing released, and skipping the release
snapshotted the GPU memory, so each clone's resume killed SGLang — and a gateway's "not
passed on" answers alone (a 502, Envoy's 503 "no healthy upstream", a 503 page that is
not JSON) leave the resume owed but the next release sent. Tries that found no
connection in time, or got a gateway's own 401 / 403 / 407 (not SGLang's answer: a
401 other than SGLang's ``{"error": "Unauthorized"}``), say nothing either way: the
memory counts as still released, and whether the next release is sent stays as the
resume before decided. A pause re-sent after a gateway's 502 / 504 and then refused
still counts as performed: its continue stays owed — unless the refusal would have met
the first try too (a 404 / 405: no such endpoint; SGLang's own API-key 401).

Every call is retried on connection errors and 5xx until ``deadline`` (a GET also on a
timeout; a release or resume is never sent again once it may have reached the server);
the hook then fails with the server's last answer. A 200 whose JSON says ``"success":
false`` fails with the server's message. SGLang asserts an idle scheduler when it
releases memory (and dies of that assertion too): the pause makes it so for requests
that reach the server past any gate — on SGLang 0.5; 0.4.x's pause returns without
waiting for the running batch, so a drain in front of it still matters there; a server
without the pause endpoints (404) gets one INFO line, and then only a drain in front of
it — the :class:`~rehydrate.adapters.asgi.ReadinessGate` — keeps it idle.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import httpx

from ..extensions import Probe, shown
from . import _bodies
from ._readiness import probe_import
from ._server import (
    ENVOY_RESET,
    ServerAdapter,
    ServerError,
    Unconfirmed,
    answer_text,
    json_or_empty,
    sync_variant,
)

if TYPE_CHECKING:
    from ..extensions import Engine

__all__ = ["SGLangAdapter", "ServerError", "install", "probe"]

log = logging.getLogger("rehydrate.adapters.sglang")

TAGS = ("weights", "kv_cache", "cuda_graph")

NOT_RELEASED = re.compile(
    r"\b(not|never) (been |yet |currently |actually )?(released|paused)\b"
    r"|\bnot in (a |the )?released state\b"
    r"|\bnothing (is |was |has been )?(to resume|released)\b"
    r"|\balready (resumed|occupied)\b",
    re.IGNORECASE)
"""A resume refused because nothing is released. Lenient: SGLang's wording differs between
versions and the memory saver backends ("not released", "has not been released", "memory
occupation was not released", "already resumed"), and a resume that was wanted must not
fail over a phrasing; only a resume that is owed after a confirmed release fails on it."""


def probe() -> Probe:
    """Usable in-process when ``sglang`` is installed (a server is probed with
    :meth:`SGLangAdapter.probe`)."""
    return probe_import("sglang",
                        "pip install sglang; a server is probed with SGLangAdapter.probe()")


class SGLangAdapter(ServerAdapter):
    """Releases one SGLang server's GPU memory before a snapshot and resumes it after.

    ``url``: the server's base URL. ``tags``: what to release (``weights``, ``kv_cache``,
    ``cuda_graph``; default everything). ``canary``: check ``/health_generate`` after
    resuming. ``api_key``: sent as a bearer token — SGLang's ``--admin-api-key`` when it
    has one, which alone opens its memory and pause endpoints (:data:`ADMIN_OPTIONAL`),
    else its ``--api-key``. ``deadline``: seconds each of release and resume may take,
    retries included.
    """

    kind = "sglang"
    title = "SGLang"
    snapshot_action = "release"
    restore_action = "resume"

    def __init__(self, url: str, *, tags: Iterable[str] | None = None, canary: bool = True,
                 api_key: str | None = None, deadline: float = 120.0,
                 request_timeout: float = 30.0) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url must be a string, not {type(url).__name__}")
        if isinstance(tags, str):
            tags = [tags]  # one tag: list("kv_cache") would be eight one-letter tags
        elif tags is not None and not isinstance(tags, Iterable):
            raise TypeError(f"tags must be a list of tag names, not {type(tags).__name__}")
        if not isinstance(canary, bool):
            raise TypeError(f"canary must be True or False, not {shown(canary)}")
        chosen = None if tags is None else list(tags)
        unknown = [t for t in chosen or () if t not in TAGS]
        if unknown:
            raise ValueError(f"unknown memory tag(s) {', '.join(map(shown, unknown))}; "
                             f"SGLang knows {', '.join(TAGS)}")
        super().__init__(url, api_key=api_key, deadline=deadline,
                         request_timeout=request_timeout)
        self.tags = chosen
        self.canary = canary
        self.released = False
        """True from the moment a release is sent until a resume succeeded (or SGLang
        refused that release: it then goes back to what it was): a clone restored from the
        snapshot remembers it, so a resume is sent only when a release may have happened."""
        self.unconfirmed = False
        """True when the last release went unanswered: it is taken as performed (it
        reached SGLang), but a server that refuses the resume with "not released" then
        says it was not, which is no failure."""
        self.unheard = False
        """True when the last resume failed without an answer from SGLang itself but with
        a gateway's "not passed on" for some try (nginx's 502 "connection refused", Envoy's
        503 "no healthy upstream"): SGLang may be gone, and the one restarted in its place
        has nothing released, so the next release is sent even though ``released`` is
        still set. Tries that say nothing of SGLang (no connection in time, a gateway's
        own 401 / 403 / 407) leave it as it was."""
        self.paused = False
        """True from the moment a pause is sent until a continue succeeded (or SGLang
        refused the pause): a continue is sent only when generation may be paused."""

    @property
    def restore_extra(self) -> float:
        # the continue and the canary after an unanswered resume (see resume_async)
        return self.request_timeout

    def __repr__(self) -> str:
        return f"SGLangAdapter({self.url}, tags={self.tags})"

    @property
    def _body(self) -> dict[str, Any]:
        return {"tags": self.tags} if self.tags else {}

    async def release_async(self) -> None:
        """Release the server's GPU memory (the before-snapshot hook)."""
        until = time.monotonic() + self.deadline
        async with self.client() as c:
            await self._warn_without_memory_saver(c)
            await self._pause(c, until)
            if self.released and not self.unheard:
                # A second release of memory already released ends SGLang
                # (torch_memory_saver: "Cannot pause allocation that is not active").
                # A WARNING: the snapshot then keeps whatever GPU memory is not released.
                log.warning("SGLang at %s: its memory is still released (the last resume "
                            "did not happen); not released again", self.url)
                return
            before = self.released, self.unconfirmed, self.unheard
            # before sending: a release performed but answered late still needs its resume
            self.released = self.unconfirmed = True
            self.unheard = False
            try:
                r = await self.call(c, "POST", "/release_memory_occupation", until=until,
                                    json=self._body, unsent=not_passed_on)
                _check_success(r)
            except Unconfirmed:
                raise
            except ServerError:
                # Answered with a refusal (an error status or "success": false), or never
                # sent: nothing was released, so no resume is owed for this attempt.
                self.released, self.unconfirmed, self.unheard = before
                log.info("SGLang did not release its memory (the release was refused or "
                         "never sent)%s", "" if self.released else
                         ": the next resume only checks generation")
                raise
            self.unconfirmed = False
        log.info("SGLang memory released (%s)", ", ".join(self.tags or ["all"]))

    async def resume_async(self) -> None:
        """Resume the memory released before and check one generation (the after-restore
        hook)."""
        until = time.monotonic() + self.deadline
        resumed = self.released
        async with self.client() as c:
            unanswered: Unconfirmed | None = None
            if resumed:
                try:
                    unanswered = await self._resume(c, until)
                except ServerError:
                    if self.paused:  # continued on released memory, generation would fail
                        log.warning("SGLang at %s stays paused: its memory was not "
                                    "resumed, so generation is not continued (the next "
                                    "resume continues it)", self.url)
                    raise
            else:
                log.info("SGLang memory was not released by this process; not resumed")
            if unanswered is not None:
                log.warning("SGLang at %s: the resume went unanswered (%s); taken as "
                            "performed, not sent again: the continue and the canary "
                            "confirm it", self.url, unanswered)
                # It may have used up the deadline, and SGLang's /health_generate takes
                # over a second: the calls that confirm it get request_timeout of their own
                until = max(until, time.monotonic() + self.request_timeout)
            try:
                await self._continue_and_check(c, until, unanswered)
            except ServerError as exc:
                if unanswered is None or exc is unanswered:
                    raise
                raise exc from unanswered
        if unanswered is not None:
            log.info("SGLang's resume went unanswered, but it generates")
        elif resumed:
            log.info("SGLang memory resumed%s", " and generating" if self.canary else "")
        elif self.canary:
            log.info("SGLang generating")

    async def _continue_and_check(self, client: httpx.AsyncClient, until: float,
                                  unanswered: Unconfirmed | None) -> None:
        if self.paused:
            # After the resume — generation continued on released memory would fail —
            # also an unanswered one: SGLang takes the calls in order, so the continue
            # runs after it, and skipped, generation stayed paused for good.
            try:
                await self._continue(client, until)
            except ServerError as exc:
                log.warning("SGLang at %s stays paused: /continue_generation failed "
                            "(%s); the next resume sends it again", self.url, exc)
                raise
        if self.canary:
            # after an unanswered resume, also its confirmation: the generation runs
            # after the resume, on the memory it brought back
            await self.call(client, "GET", "/health_generate", until=until)
        elif unanswered is not None:
            raise unanswered

    async def _resume(self, client: httpx.AsyncClient,
                      until: float) -> Unconfirmed | None:
        """The resume; the :class:`Unconfirmed` error when it went unanswered — counted
        as performed all the same (see the module's notes): never sent again."""
        unanswered = None
        try:
            r = await self.call(client, "POST", "/resume_memory_occupation", until=until,
                                json=self._body, unsent=not_passed_on)
            _check_success(r)
        except Unconfirmed as exc:
            # It reached SGLang, which performs what it received, in order; sent again,
            # a resume of memory already resumed kills SGLang 0.5 (its scheduler's
            # KeyError ends the server).
            unanswered = exc
        except ServerError as exc:
            # after an unanswered release, "not released" is the state we want — from
            # SGLang itself, not a gateway's refusal that happens to say so
            if not (self.unconfirmed and exc.answered and exc.reason
                    and NOT_RELEASED.search(exc.reason)):
                self._resume_failed(exc)
                raise
            log.info("SGLang says its memory is not released (the last release went "
                     "unanswered): nothing to resume")
        self.released = self.unconfirmed = self.unheard = False
        return unanswered

    def _resume_failed(self, exc: ServerError) -> None:
        if exc.unreachable:
            # Nothing listened at the URL: a process that died keeps no released memory,
            # and the one restarted in its place has nothing released. Still set, the
            # flag skipped the next release: a snapshot with the GPU memory held, and
            # every clone's resume of memory never released killed SGLang (KeyError).
            log.warning("SGLang at %s was unreachable for the resume (%s): taken as gone "
                        "with its released memory; the next snapshot sends the release again",
                        self.url, exc)
            self.released = self.unconfirmed = self.unheard = False
        elif exc.answered:
            # Only SGLang's own answer says its memory is still released...
            self.unheard = False
        elif exc.unforwarded:
            # ...and only a gateway's "not passed on" says SGLang may be gone (a
            # restarted one has nothing released).
            self.unheard = True
        # Otherwise the tries say neither — no connection in time (a partitioned SGLang
        # may still hold its memory released, and a second release ends it), a gateway's
        # own authentication refusal — and what was known before stands.

    async def _pause(self, client: httpx.AsyncClient, until: float) -> None:
        before = self.paused
        # before sending: a pause performed but answered late still needs its continue
        self.paused = True
        try:
            # {}: SGLang's default mode, abort — the only one that leaves the scheduler
            # idle (retract and in_place keep the requests queued or in the batch);
            # sent again after a gateway's 502/504: a second pause changes nothing
            await self.call(client, "POST", "/pause_generation", until=until, json={},
                            resend=True)
        except Unconfirmed:
            raise
        except ServerError as exc:
            self.paused = before  # refused or never sent: nothing was paused
            if exc.status not in MISSING:
                raise
            log.info("SGLang at %s has no /pause_generation (HTTP %s): generation is not "
                     "paused before the release; only a drain in front of the server "
                     "(ReadinessGate) keeps its scheduler idle", self.url, exc.status)

    async def _continue(self, client: httpx.AsyncClient, until: float) -> None:
        try:
            await self.call(client, "POST", "/continue_generation", until=until, json={},
                            resend=True)
        except Unconfirmed:
            raise
        except ServerError as exc:
            if exc.status not in MISSING:
                raise
            log.info("SGLang at %s has no /continue_generation (HTTP %s): not continued",
                     self.url, exc.status)
        self.paused = False

    def key_fix(self, path: str) -> str:
        if path not in ADMIN_OPTIONAL:
            return super().key_fix(path)
        # With --admin-api-key set, SGLang takes only that key on these endpoints: the
        # --api-key that works for generation is refused, and "pass api_key= matching
        # its --api-key" sent the user to the key already passed.
        return ("pass api_key= matching its --admin-api-key if it has one (SGLang then "
                "takes only that key on its memory and pause endpoints), else its --api-key")

    release = sync_variant(release_async)
    resume = sync_variant(resume_async)
    before_snapshot = release_async
    after_restore = resume_async

    async def _warn_without_memory_saver(self, client: httpx.AsyncClient) -> None:
        try:
            r = await self.quick_get(client, "/server_info")
        except httpx.HTTPError as exc:
            log.debug("SGLang /server_info: %s", type(exc).__name__)
            return
        except ServerError as exc:  # an answer trickling in: only a warning was at stake
            log.debug("SGLang /server_info: %s", exc)
            return
        if r.is_success and json_or_empty(r).get("enable_memory_saver") is False:
            log.warning("SGLang runs without --enable-memory-saver: release/resume of GPU "
                        "memory do nothing (the snapshot keeps the GPU state)")


ENVOY_CLOSED = re.compile(
    r"disconnect/reset before headers\..*reset reason: (connection termination|remote reset)",
    re.IGNORECASE | re.DOTALL)
"""Envoy's / Istio's 503 for an upstream connection that closed or was reset under the
request (flags UC): mostly a pooled keep-alive connection SGLang (uvicorn, 5 s idle) had
just closed, which the request never reached (istio/istio#55138) — nginx's 502 for the
same event."""


NO_UPSTREAM = re.compile(r"no healthy upstream", re.IGNORECASE)
"""Envoy's / Istio's 503 for a cluster without a ready endpoint (flag UH): SGLang's Pod
not ready, or restarting."""


def not_passed_on(response: httpx.Response, reason: str) -> bool:
    """Whether a gateway's answer to a release or resume counts as not passed on (retried
    like a 503): a 502; Envoy's 503 for a closed or reset connection
    (:data:`ENVOY_CLOSED`) or for no healthy upstream (:data:`NO_UPSTREAM`); any other
    503 whose body is not JSON (ingress-nginx's "503 Service Temporarily Unavailable"
    page) — SGLang's own errors are JSON. nginx's usual 502s — no connection (refused), a
    reused connection SGLang had closed, SGLang gone — and Envoy's "connection
    termination" / "remote reset" all leave a running SGLang without the call (a
    restarted one has nothing released), and no status endpoint tells otherwise. Taken
    as performed, they made the next resume one of memory never released, which kills
    SGLang 0.5; a gateway's 503 page taken as SGLang's answer skipped the next release
    of a restarted SGLang, and its clone's resume killed it. Either reading kills SGLang
    when it is wrong (a second release or resume ends it too), so the likelier one is
    taken."""
    status = response.status_code
    if status == 502:
        return True
    if status != 503:
        return False
    if ENVOY_CLOSED.search(reason) or NO_UPSTREAM.search(reason):
        return True
    # Envoy's other resets keep their own reading (_server.gateway_lost / _unforwarded)
    return not ENVOY_RESET.search(reason) and not _is_json(response)


def _is_json(response: httpx.Response) -> bool:
    try:
        _bodies.loads(response.content)
    except ValueError:  # also an empty body
        return False
    return True


ADMIN_OPTIONAL = frozenset({"/pause_generation", "/continue_generation",
                            "/release_memory_occupation", "/resume_memory_occupation"})
"""The endpoints the adapter calls that SGLang marks ``AuthLevel.ADMIN_OPTIONAL`` (its
``srt/utils/auth.py``): with ``--admin-api-key`` set only that key opens them, with only
``--api-key`` that one. ``/server_info`` takes the ``--api-key``, ``/health_generate``
none; SGLang answers a refused key with 401 ``{"error": "Unauthorized"}``."""


MISSING = frozenset({404, 405})
"""A server without the endpoint (SGLang before the pause endpoints, a gateway routing
only some paths): the pause and continue are skipped, not failed."""


def _check_success(response: httpx.Response) -> None:
    body = json_or_empty(response)
    if body.get("success") is False:
        message = answer_text(response, str(body.get("message") or "no message"))
        # the URL: one engine may drive two SGLang servers
        raise ServerError(f"sglang POST {response.request.url}: the server says it failed: "
                          f"{message}",
                          reason=message, answered=True)


def install(url: str, *, engine: Engine | None = None, tags: Iterable[str] | None = None,
            canary: bool = True, api_key: str | None = None,
            deadline: float = 120.0, request_timeout: float = 30.0) -> SGLangAdapter:
    """Create an :class:`SGLangAdapter` for ``url`` and attach its hooks to ``engine``."""
    adapter = SGLangAdapter(url, tags=tags, canary=canary, api_key=api_key, deadline=deadline,
                            request_timeout=request_timeout)
    adapter.install(engine)
    return adapter
