"""vLLM: the engine sleeps through the snapshot and is woken, and checked, after a restore.

A snapshot of a process holding a vLLM engine should not contain its GPU state (the KV
cache is garbage in a clone, the weights are better restored from CPU memory or reloaded),
and vLLM's ``/health`` says 200 whether the engine sleeps or not — requests sent to a
sleeping engine are queued, not refused — so readiness must come from rehydrate::

    from rehydrate.adapters import vllm

    vllm.install("http://127.0.0.1:8000")          # the OpenAI server, dev mode
    vllm.install(llm)                              # or an in-process LLM / AsyncLLM

Before a snapshot (hook ``rehydrate.vllm.sleep``, right after the ASGI gate's drain):
``POST /sleep?level=N`` (``LLM.sleep(level)`` in-process), then ``GET /is_sleeping`` must
say true. After a restore or resume (hook ``rehydrate.vllm.wake``, the first application
hook): level 0/1 ``POST /wake_up``; level 2 — whose weights were discarded —
``POST /wake_up?tags=weights``, ``POST /collective_rpc {"method": "reload_weights"}``,
``POST /wake_up?tags=kv_cache`` (what ``vllm snapshot restore`` does); then ``/is_sleeping``
must say false (anything still asleep is woken with a plain ``/wake_up``), and a one-token
canary generation must succeed before the hook does. An engine already awake is not woken
again (the canary still runs).

Every call is retried on connection errors and 5xx until ``deadline`` (a GET also on a
timeout). A POST is never sent again once it may have reached the server — after a lost
answer ``/is_sleeping`` decides whether it happened, asked until the deadline for a
sleep — except after a gateway's 502 / 504: a sleep or wake-up is then sent again (vLLM
does nothing for a sleep of a sleeping engine or a wake-up of an awake tag, and at level 2
``/is_sleeping`` cannot tell whether the weights woke), a reload is not. A sleep never
seen performed is remembered: the next wake sends ``wake_up`` even when ``/is_sleeping``
says awake (vLLM runs it after the sleep); an in-process call given up at a deadline
(its thread goes on) is waited for by the next hook's first call, within that hook's
deadline. The hook then fails with the server's last answer. A server without the
dev-mode endpoints (404: ``VLLM_SERVER_DEV_MODE=1`` missing) or without sleep mode
(``--enable-sleep-mode``, CUDA / ROCm / XPU only) fails at once with that fix in the
message — also after a gateway's 502 / 504 for an earlier try, which such an answer
says was not performed either — and so does a canary refused with 400 / 404 / 405 (a
pooling model, which cannot generate: ``canary=False``). Responses are parsed leniently:
older servers answer an empty 200, some say ``tags_woken``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import httpx

from ..extensions import Probe, shown
from ._readiness import probe_import
from ._server import (
    MIN_TRY,
    ServerAdapter,
    ServerError,
    Unconfirmed,
    answer_text,
    call_maybe_async,
    json_or_empty,
    server_reason,
    sync_variant,
    within,
)

if TYPE_CHECKING:
    from collections.abc import Generator

    from ..extensions import Engine

__all__ = ["ServerError", "VLLMAdapter", "install", "probe"]

log = logging.getLogger("rehydrate.adapters.vllm")

LEVELS = (0, 1, 2)
MODES = ("abort", "wait", "keep")


def probe() -> Probe:
    """Usable for an in-process engine when ``vllm`` is installed (a server is probed with
    :meth:`VLLMAdapter.probe`)."""
    return probe_import("vllm", "pip install vllm; a server is probed with VLLMAdapter.probe()")


class VLLMAdapter(ServerAdapter):
    """Puts one vLLM engine to sleep before a snapshot and wakes it after a restore.

    ``target``: the server's base URL (``http://host:port``, dev mode) or an in-process
    ``vllm.LLM`` / ``AsyncLLM`` (anything with ``sleep``, ``wake_up``, ``collective_rpc``
    and ``generate``). ``level``: sleep level 0, 1 (weights to CPU RAM, KV cache dropped)
    or 2 (both dropped; reloaded after restore). ``mode``: ``abort`` / ``wait`` / ``keep``
    for requests in flight (vLLM ≥ 0.33; omitted: the server's default). ``model``: the
    model name for the canary (default: the first of ``/v1/models``). ``canary``: run the
    one-token generation after waking (``False`` for a pooling — embedding — model, which
    cannot generate). ``api_key``: sent as a bearer token.
    ``deadline``: seconds each of sleep and wake may take, retries included.
    """

    kind = "vllm"
    title = "vLLM"
    snapshot_action = "sleep"
    restore_action = "wake"

    def __init__(self, target: str | Any, *, level: int = 1, mode: str | None = None,
                 model: str | None = None, canary: bool = True, canary_prompt: str = "Hello",
                 api_key: str | None = None, deadline: float = 120.0,
                 request_timeout: float = 10.0) -> None:
        if isinstance(level, bool) or not isinstance(level, int) or level not in LEVELS:
            raise ValueError(f"level must be one of 0, 1, 2, not {shown(level)}")
        if not isinstance(canary, bool):
            raise TypeError(f"canary must be True or False, not {shown(canary)}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)} (or None), not {shown(mode)}")
        in_process = not isinstance(target, str)
        if in_process:
            missing = [m for m in ("sleep", "wake_up") if not callable(getattr(target, m, None))]
            if missing:
                raise TypeError(f"target must be a URL or a vLLM LLM/AsyncLLM; "
                                f"{type(target).__name__} has no {', '.join(missing)}()")
        super().__init__(None if in_process else target, api_key=api_key, deadline=deadline,
                         request_timeout=request_timeout)
        self.llm: Any = target if in_process else None
        if in_process:
            # One adapter per engine object, as one per URL (see ServerAdapter.install).
            self.key = f"rehydrate.adapters.vllm:{type(target).__name__}@{id(target):#x}"
        self.level = level
        self.mode = mode
        self.model = model
        self.canary = canary
        self.canary_prompt = canary_prompt
        self._running: tuple[str, concurrent.futures.Future[None]] | None = None
        """An in-process ``sleep()`` / ``wake_up()`` / reload given up at a hook's deadline
        that may still run (its worker thread goes on): the next in-process call waits
        for it (:meth:`_InProcess._after_running`)."""
        self.sleep_unconfirmed = False
        """True from the moment a sleep is sent until the engine is seen asleep (or
        woken, or it refused the sleep outright: a 4xx, or an answer :meth:`hint`
        recognises — after a gateway's 502 / 504 only a refusal every try met alike, see
        :meth:`ServerAdapter.call`): one that ended otherwise — unanswered, a gateway's
        502 / 504, an in-process sleep() past the deadline — may still be performed (a
        gateway's 504 while vLLM works on it, a worker thread that goes on), so the next
        wake sends wake_up even to an engine that says it is awake (the wake_up then runs
        after the sleep)."""

    def __repr__(self) -> str:
        target = self.url or type(self.llm).__name__
        return f"VLLMAdapter({target}, level={self.level})"

    # -- public operations ---------------------------------------------------------------

    async def sleep_async(self) -> None:
        """Put the engine to sleep and confirm it sleeps (the before-snapshot hook)."""
        until = time.monotonic() + self.deadline
        async with self._session() as s:
            if await s.is_sleeping(until) is True:
                log.info("vLLM already sleeps; not put to sleep again")
                self.sleep_unconfirmed = False
                return
            # Before sending, cleared only once the engine is seen asleep: a sleep may be
            # performed, or still be under way, whatever ends the call — no answer, a
            # gateway's 504, an in-process sleep() past the deadline (its thread goes on)
            # — and until the engine says so the next wake wakes anyway.
            before, self.sleep_unconfirmed = self.sleep_unconfirmed, True
            try:
                await s.sleep(until)
            except Unconfirmed:
                # the engine's state decides, asked until the deadline
                if not await self._sleeps_by(s, until):
                    raise
                log.info("vLLM sleep went unanswered but the engine sleeps")
            except ServerError as exc:
                if exc.status is not None:
                    # Refused outright (a 4xx, "sleep mode is not enabled"): nothing was
                    # put to sleep, and flagged, the next wake reloaded the weights of an
                    # awake engine (level 2). No answer by the deadline keeps the flag.
                    self.sleep_unconfirmed = before
                raise
            if await s.is_sleeping(until) is False:
                raise ServerError(f"vllm{self._at}: the engine accepted sleep but says it is awake")
            self.sleep_unconfirmed = False
        log.info("vLLM engine asleep (level %d)", self.level)

    @staticmethod
    async def _sleeps_by(s: _Session, until: float) -> bool:
        """Whether the engine says it sleeps before ``until`` (asked at least once)."""
        attempt = 0
        while True:
            sleeping = await s.is_sleeping(until)
            if sleeping is not False:  # None: an engine that cannot tell
                return sleeping is True
            left = until - time.monotonic()
            if left <= 0:
                return False
            attempt += 1
            await asyncio.sleep(min(0.05 * 2 ** min(attempt - 1, 5), 1.0, left))

    async def wake_async(self) -> None:
        """Wake the engine, confirm it is awake, run the canary (the after-restore hook)."""
        until = time.monotonic() + self.deadline
        async with self._session() as s:
            if await s.is_sleeping(until) is False and not self.sleep_unconfirmed:
                log.info("vLLM already awake; not woken again")
            else:
                if self.sleep_unconfirmed:
                    # a sleep that went unanswered may still be performed: vLLM takes the
                    # calls in order, so a wake_up sent now runs after it (and does
                    # nothing on an engine that stays awake)
                    log.info("vLLM's last sleep went unanswered: woken whatever "
                             "/is_sleeping says")
                if self.level == 2:
                    # An unconfirmed weights wake-up or reload fails the hook: the engine
                    # still sleeps (kv_cache) either way, so /is_sleeping cannot tell
                    # whether it happened; the next wake starts over from /is_sleeping.
                    await self._wake(s, ["weights"], until)
                    await s.reload_weights(until)
                    await self._wake(s, ["kv_cache"], until)
                else:
                    await self._wake(s, None, until)
                if await s.is_sleeping(until) is True:
                    await self._wake(s, None, until)  # whatever the tags above did not wake
                    if await s.is_sleeping(until) is True:
                        raise ServerError(f"vllm{self._at}: the engine still sleeps after wake_up")
                self.sleep_unconfirmed = False
            if self.canary:
                await s.canary(until)
        log.info("vLLM engine awake%s", " and answering" if self.canary else "")

    @staticmethod
    async def _wake(s: _Session, tags: list[str] | None, until: float) -> None:
        try:
            await s.wake_up(tags, until)
        except Unconfirmed:
            # no answer, but the engine may be awake (or still waking: not woken twice)
            if await s.is_sleeping(until) is not False:
                raise
            log.info("vLLM wake_up went unanswered but the engine is awake")

    sleep = sync_variant(sleep_async)
    wake = sync_variant(wake_async)
    before_snapshot = sleep_async
    after_restore = wake_async

    def probe(self) -> Probe:
        if self.llm is not None:  # nothing to ask: no event loop needed
            return Probe(True, f"in-process {type(self.llm).__name__}")
        return super().probe()

    async def probe_async(self) -> Probe:  # noqa: PLR0911 - one return per answer
        """Usable when the server answers ``/health`` and has the dev-mode endpoints (or
        the in-process engine can sleep)."""
        if self.llm is not None:
            return Probe(True, f"in-process {type(self.llm).__name__}")
        found, healthy = await self._probe_health()
        if not healthy:
            return found
        try:
            async with self.client() as c:
                r = await self.quick_get(c, "/is_sleeping")
        except httpx.HTTPError as exc:
            return self.not_yet(f"/is_sleeping: {type(exc).__name__}")
        except ServerError as exc:
            return self.not_yet(f"/is_sleeping: {exc}")
        if r.status_code == 404:
            return Probe(False, f"{self.url} has no /is_sleeping: start vLLM with "
                                "VLLM_SERVER_DEV_MODE=1")
        if r.status_code >= 500 or r.status_code in (408, 429):  # as for /health
            return self.not_yet(f"/is_sleeping answers HTTP {r.status_code}")
        if r.status_code in (401, 403, 407):  # as for /health: whose refusal it is
            return Probe(False, self.refused("/is_sleeping", r))
        if not r.is_success or not isinstance(json_or_empty(r).get("is_sleeping"), bool):
            # a gateway's page or another server: the hooks would fail on it
            return Probe(False, f"{self.url}/is_sleeping answers HTTP {r.status_code} "
                                f"without a true/false is_sleeping: is it a vLLM server?")
        return Probe(True, f"{self.url} answers, sleep endpoints present")

    def hint(self, path: str, response: httpx.Response, reason: str) -> str | None:
        if response.status_code == 404 and path in ("/sleep", "/wake_up", "/is_sleeping",
                                                    "/collective_rpc"):
            return "start the vLLM server with VLLM_SERVER_DEV_MODE=1 (the sleep endpoints " \
                   "exist only in dev mode)"
        if "sleep mode" in reason.lower():
            return "start vLLM with --enable-sleep-mode (CUDA, ROCm or XPU only)"
        if path == "/v1/completions" and response.status_code in (400, 404, 405):
            # vLLM serving a pooling model (embeddings, scores, classification) refuses
            # completions (400, or 404 where the route is not mounted): every restore
            # would fail here although the engine is awake
            return ("the canary generates one token, which a pooling (embedding) model "
                    "cannot: pass canary=False for pooling models (or model= naming a "
                    "model the server serves)")
        return None

    def _session(self) -> _Session:
        if self.llm is not None:
            return _InProcess(self)
        return _Http(self)


class _Session:
    """One sleep or wake operation's calls, over HTTP or in-process."""

    def __init__(self, adapter: VLLMAdapter) -> None:
        self.a = adapter

    async def __aenter__(self) -> _Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def is_sleeping(self, until: float) -> bool | None:
        raise NotImplementedError

    async def sleep(self, until: float) -> None:
        raise NotImplementedError

    async def wake_up(self, tags: list[str] | None, until: float) -> None:
        raise NotImplementedError

    async def reload_weights(self, until: float) -> None:
        raise NotImplementedError

    async def canary(self, until: float) -> None:
        raise NotImplementedError


class _Http(_Session):
    async def __aenter__(self) -> _Session:
        self.client = self.a.client()
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(None, None, None)

    async def is_sleeping(self, until: float) -> bool | None:
        r = await self.a.call(self.client, "GET", "/is_sleeping", until=until)
        value = json_or_empty(r).get("is_sleeping")
        if not isinstance(value, bool):
            # every vLLM with the endpoint answers {"is_sleeping": bool}: anything else (a
            # proxy's page, another server) cannot confirm a sleep the snapshot relies on
            raise ServerError(f"vllm GET {self.a.url}/is_sleeping: no true/false "
                              f"is_sleeping in the answer ({server_reason(r)}); is "
                              f"{self.a.url} a vLLM server?")
        return value

    async def sleep(self, until: float) -> None:
        params: dict[str, Any] = {"level": self.a.level}
        if self.a.mode is not None:
            params["mode"] = self.a.mode
        # resend: vLLM's sleep does nothing on an engine already asleep, so a gateway's
        # 502 / 504 is no reason to stop; what happened is checked with /is_sleeping
        await self.a.call(self.client, "POST", "/sleep", until=until, params=params,
                          resend=True)

    async def wake_up(self, tags: list[str] | None, until: float) -> None:
        # resend: vLLM's wake_up of a tag already awake does nothing — at level 2
        # /is_sleeping (still true: kv_cache) cannot tell whether the weights woke
        r = await self.a.call(self.client, "POST", "/wake_up", until=until,
                              params={"tags": tags} if tags else None, resend=True)
        body = json_or_empty(r)  # {"status": ..., "tags": ...}, {"tags_woken": ...} or {}
        log.debug("vLLM wake_up%s: %s", f" {tags}" if tags else "",
                  answer_text(r, str(body.get("status") or body.get("tags_woken") or "ok")))

    async def reload_weights(self, until: float) -> None:
        await self.a.call(self.client, "POST", "/collective_rpc", until=until,
                          json={"method": "reload_weights"})

    async def canary(self, until: float) -> None:
        model = self.a.model
        if model is None:
            r = await self.a.call(self.client, "GET", "/v1/models", until=until)
            data = json_or_empty(r).get("data")
            first = data[0] if isinstance(data, list) and data else None
            if not isinstance(first, dict) or not isinstance(first.get("id"), str):
                what = ("lists no model" if data == [] else
                        'answered no model list (expected {"data": [{"id": ...}]})')
                raise ServerError(f"vllm canary: {self.a.url}/v1/models {what} (pass model=)")
            model = first["id"]
        # resend: a gateway's 502/504 or a cut connection on one generated token leaves
        # nothing to undo, and only an answer confirms the engine generates
        r = await self.a.call(self.client, "POST", "/v1/completions", until=until,
                              json={"model": model, "prompt": self.a.canary_prompt,
                                    "max_tokens": 1, "temperature": 0}, resend=True,
                              resend_when_cut=True)
        if not json_or_empty(r).get("choices"):
            raise ServerError(f"vllm canary: {self.a.url}/v1/completions answered no choices "
                              f"({answer_text(r, r.text, 200)!r})")


class _InProcess(_Session):
    async def _call(self, what: str, until: float, fn: Any, *args: Any,
                    track: bool = False, **kwargs: Any) -> Any:
        await self._after_running(what, until)
        # a worker thread cannot be stopped: given up at the deadline, it ends on its own
        seconds = max(until - time.monotonic(), MIN_TRY)
        finished = None
        if track:
            call, finished = _tracked(fn, *args, **kwargs)
        else:
            call = call_maybe_async(fn, *args, **kwargs)
        try:
            return await within(call, seconds,
                                f"vllm {what}: not finished within {seconds:.3g}s (the "
                                f"{self.a.deadline:g}s deadline)")
        finally:
            if finished is not None and not finished.done():
                self.a._running = (what, finished)

    async def _after_running(self, what: str, until: float) -> None:
        """Wait until the engine call an earlier hook gave up on has ended, at most until
        ``until``. With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` an ``LLM`` runs each call in
        the caller's thread: a wake_up beside a sleep still running was over before the
        sleep, which then left a process reported ready on a sleeping engine."""
        running = self.a._running
        if running is None:
            return
        name, finished = running
        if not finished.done():
            log.info("vLLM's %s, given up at an earlier deadline, still runs: %s waits for "
                     "it", name, what)
            loop = asyncio.get_running_loop()
            ended = asyncio.Event()

            def done(_: object) -> None:
                with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                    loop.call_soon_threadsafe(ended.set)

            finished.add_done_callback(done)
            seconds = max(until - time.monotonic(), MIN_TRY)
            try:
                await asyncio.wait_for(ended.wait(), seconds)
            except asyncio.TimeoutError:
                raise ServerError(
                    f"vllm {what}: the engine's {name}, given up at an earlier deadline, "
                    f"is still running after another {seconds:.3g}s (the "
                    f"{self.a.deadline:g}s deadline); not called beside it, which could "
                    f"leave the engine asleep — the next hook waits for it again") from None
        if self.a._running is running:
            self.a._running = None

    async def is_sleeping(self, until: float) -> bool | None:
        llm = self.a.llm
        fn = getattr(llm, "is_sleeping", None) or getattr(
            getattr(llm, "llm_engine", None), "is_sleeping", None)
        if fn is None:
            return None
        value = await self._call("is_sleeping()", until, fn)
        return value if isinstance(value, bool) else None

    async def sleep(self, until: float) -> None:
        kwargs: dict[str, Any] = {"level": self.a.level}
        if self.a.mode is not None:
            kwargs["mode"] = self.a.mode
        await self._call("sleep()", until, self.a.llm.sleep, track=True, **kwargs)

    async def wake_up(self, tags: list[str] | None, until: float) -> None:
        if tags:
            await self._call(f"wake_up({tags})", until, self.a.llm.wake_up, track=True,
                             tags=tags)
        else:
            await self._call("wake_up()", until, self.a.llm.wake_up, track=True)

    async def reload_weights(self, until: float) -> None:
        await self._call("collective_rpc(reload_weights)", until, self.a.llm.collective_rpc,
                         "reload_weights", track=True)

    async def canary(self, until: float) -> None:
        llm = self.a.llm
        params = _sampling_params()
        if inspect.isasyncgenfunction(llm.generate):  # AsyncLLM: an async generator
            async def collect() -> list[Any]:
                return [out async for out in llm.generate(
                    self.a.canary_prompt, params,
                    request_id=f"rehydrate-canary-{uuid.uuid4()}")]
            seconds = max(until - time.monotonic(), MIN_TRY)
            outputs = await within(collect(), seconds, f"vllm canary generate(): not "
                                   f"finished within {seconds:.3g}s (the "
                                   f"{self.a.deadline:g}s deadline)")
        else:
            outputs = await self._call("canary generate()", until, llm.generate,
                                       [self.a.canary_prompt], params)
        if not outputs:
            raise ServerError("vllm canary: generate() returned no output")


def _tracked(fn: Any, *args: Any, **kwargs: Any
             ) -> tuple[Any, concurrent.futures.Future[None]]:
    """An awaitable of ``fn(*args, **kwargs)`` and a future that ends when the call itself
    ends — not when a waiter gives up on it: a sync call goes on in its worker thread, an
    awaitable (of a coroutine function, or one a sync call returned) is shielded from the
    cancellation at the deadline (an ``AsyncLLM``'s engine core goes on with the request
    anyway). An awaitable a sync call returns after the loop that waited has ended
    (``asyncio.run`` of a sync twin, given up at its deadline) is awaited by nobody: the
    call has ended then too, its rest never runs."""
    finished: concurrent.futures.Future[None] = concurrent.futures.Future()
    finished.set_running_or_notify_cancel()  # running: no waiter can cancel it

    def settle() -> None:
        # the worker thread (dropping an unawaited handover) or the loop may settle it
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if not finished.done():
                finished.set_result(None)

    def call() -> Any:
        # a sync call ends in its worker thread, whatever becomes of the loop that waited
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            settle()
            raise
        if inspect.isawaitable(result):
            return _Handover(result, settle, getattr(fn, "__qualname__", "engine call"))
        settle()
        return result

    # a coroutine function's call just makes its coroutine: no worker thread for that
    task = asyncio.ensure_future(call() if inspect.iscoroutinefunction(fn)
                                 else call_maybe_async(call))
    # an outcome nobody awaits any more is collected, not logged as never retrieved
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return asyncio.shield(task), finished


class _Handover:
    """The awaitable a sync engine call returned, handed from its worker thread to the
    loop that waits for it: ``settle`` runs when it has been awaited to its end, or when
    it is dropped unawaited — the loop that waited ended first, and a never-started
    coroutine's ``close()`` skips its ``finally``, so without this the call never counted
    as ended and every later engine call waited a whole deadline for it."""

    def __init__(self, aw: Any, settle: Any, name: str) -> None:
        self._aw, self._settle, self._name = aw, settle, name
        self._started = False

    async def _run(self) -> Any:
        return await self._aw

    def __await__(self) -> Generator[Any, None, Any]:
        self._started = True
        try:
            # through a coroutine, not self._aw.__await__(): a generator-based coroutine
            # (@types.coroutine) is awaitable but has no __await__
            return (yield from self._run().__await__())
        finally:
            self._settle()

    def __del__(self) -> None:
        if self._started:
            return
        log.warning("vLLM's %s: the awaitable it returned was never awaited (the event "
                    "loop that waited for it ended first); the rest of the call did not run",
                    self._name)
        if inspect.iscoroutine(self._aw):
            self._aw.close()  # never started: runs nothing, and no "never awaited" warning
        self._settle()


def _sampling_params() -> Any:
    """``SamplingParams(max_tokens=1)`` when vLLM is importable, else None (its default)."""
    try:
        from vllm import SamplingParams  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return SamplingParams(max_tokens=1, temperature=0)


def install(target: str | Any, *, engine: Engine | None = None, level: int = 1,
            mode: str | None = None, model: str | None = None, canary: bool = True,
            api_key: str | None = None, deadline: float = 120.0,
            request_timeout: float = 10.0) -> VLLMAdapter:
    """Create a :class:`VLLMAdapter` for ``target`` and attach its hooks to ``engine``."""
    adapter = VLLMAdapter(target, level=level, mode=mode, model=model, canary=canary,
                          api_key=api_key, deadline=deadline, request_timeout=request_timeout)
    adapter.install(engine)
    return adapter
