"""Stand-ins for vLLM's and SGLang's servers (they need a GPU) and vLLM's in-process engines.

Each implements the documented endpoints of DESIGN §4 as a plain ASGI app served by a real
uvicorn on loopback (``tests.asgi_server.serve``), keeps the engine's memory state, logs
every call, and can be told to fail the ways the real servers do: 500s (transient or for
good), hangs, no dev mode (404), sleep mode / memory saver off, the empty 200 of older
servers, ``tags_woken``, requests running on an SGLang scheduler that must be idle, an
SGLang without the pause endpoints. Where the real server dies (SGLang's scheduler on a
resume of memory not released, torch_memory_saver on a second release of memory already
released, or a release with requests running), the stand-in stops
serving too (``crashed``), so no test passes on an answer the real server never gives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

TAGS = ("weights", "kv_cache", "scheduling")


class StandIn:
    """Routing, the call log and the faults shared by both stand-ins."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.fail: dict[str, int] = {}  # path -> transient 500s to answer first
        self.broken: dict[str, tuple[int, str]] = {}  # path -> (status, message) for good
        self.hang: dict[str, float] = {}  # path -> seconds to wait before answering
        # paths performed at once but never answered: the connection is held until the
        # client gives up (a slow reload, a lost answer) -- the state has changed regardless
        self.unanswered: set[str] = set()
        self.canaries = 0
        # path -> connections to cut once the call was performed, before its answer (a
        # kept-alive connection the server or a proxy closed under the request)
        self.cut: dict[str, int] = {}
        # why the server died (SGLang's scheduler ends the whole server on an exception):
        # from then on every connection is cut before an answer
        self.crashed: str | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = await _body(receive)
        path, query = scope["path"], scope["query_string"].decode()
        if path.startswith("/stand-in/"):  # the tests' own controls, not logged
            await _json(send, 200, self.control(path, json.loads(body) if body else None))
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        refused = self.refuse_key(path, headers.get("authorization"))
        if refused is not None:  # the server's key middleware: the call goes no further
            await _json(send, *refused)
            return
        self.log.append(f"{scope['method']} {path}" + (f"?{query}" if query else ""))
        if self.crashed is not None:
            await _cut(send)
            return
        if path in self.hang:
            await asyncio.sleep(self.hang[path])
        if self.fail.get(path):
            self.fail[path] -= 1
            status, payload = 500, {"message": "transient engine error"}
        elif path in self.broken:
            status, text = self.broken[path]
            payload = {"object": "error", "message": text, "type": "InternalServerError",
                       "code": status}
        else:
            status, payload = self.route(scope["method"], path, parse_qs(query),
                                         json.loads(body) if body else None)
        if self.crashed is not None:
            await _cut(send)
            return
        if self.cut.get(path):
            self.cut[path] -= 1
            await _cut(send)
            return
        if path in self.unanswered:
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        await _json(send, status, payload)

    def refuse_key(self, path: str, authorization: str | None) -> tuple[int, Any] | None:
        """The answer of the server's API-key middleware to ``path`` (None: let it in)."""
        return None

    def control(self, path: str, body: Any) -> Any:
        """``/stand-in/fault`` sets ``fail[path] = count``; ``/stand-in/state`` reports."""
        if path == "/stand-in/fault":
            self.fail[body["path"]] = body["count"]
        return {"log": self.log, "canaries": self.canaries, "fail": self.fail,
                **self.state()}

    def state(self) -> dict[str, Any]:
        return {}

    def route(self, method: str, path: str, query: dict[str, list[str]],
              body: Any) -> tuple[int, Any]:
        raise NotImplementedError


async def _cut(send: Any) -> None:
    """End the connection before a complete answer (a Content-Length never met): the
    client sees it cut, as from a server that died or a gateway that dropped it."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"100")]})
    await send({"type": "http.response.body", "body": b"{", "more_body": True})
    raise ConnectionAbortedError("the stand-in cut the connection")


async def _body(receive: Any) -> bytes:
    """The request's whole body, however many messages it comes in."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def _json(send: Any, status: int, payload: Any) -> None:
    raw = b"" if payload is None else json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": raw})


def trickling(behind: Any, path: str, stop: threading.Event, ended: threading.Event) -> Any:
    """``behind`` (a stand-in), but ``path`` answers 200 and then a byte every 20 ms until
    ``stop`` (at most 10 s): httpx's per-read timeout never fires. ``ended`` is set once
    that answer is over."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != path:
            await behind(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            for _ in range(500):
                if stop.is_set():
                    break
                await send({"type": "http.response.body", "body": b" ", "more_body": True})
                await asyncio.sleep(0.02)
            await send({"type": "http.response.body", "body": b""})
        finally:
            ended.set()

    return app


class EchoingGateway:
    """A gateway in front of a stand-in that echoes the request's ``Authorization`` header
    in its answers, as some do in a 401 body: ``answer(path, authorization)`` gives the
    ``(status, body)`` for a path — a ``str`` body is sent as plain text, anything else as
    JSON — or None to pass the request on to ``behind``."""

    def __init__(self, answer: Any, behind: Any = None) -> None:
        self.answer = answer
        self.behind = behind
        self.seen: list[str] = []  # the Authorization headers received

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode()
        self.seen.append(authorization)
        answered = self.answer(scope["path"], authorization)
        if answered is None:
            await self.behind(scope, receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        status, body = answered
        if isinstance(body, str):
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": body.encode()})
        else:
            await _json(send, status, body)


class LosingGateway:
    """A gateway in front of a stand-in whose upstream timeout is shorter than some calls:
    for ``paths`` it lets the stand-in perform the call, drops its answer and answers
    ``status`` itself (nginx's and envoy's 504, or a 502 after the upstream broke off) —
    ``times`` times per path (None: always). ``performed=False``: the call is not passed
    on at all (a 503 "no healthy upstream"). Other paths pass through."""

    MESSAGES = {502: "upstream prematurely closed connection", 503: "no healthy upstream",
                504: "upstream request timeout"}

    def __init__(self, behind: Any, paths: set[str], *, status: int = 504,
                 times: int | None = None, performed: bool = True,
                 message: str | None = None) -> None:
        self.behind, self.paths, self.status = behind, paths, status
        self.message = message or self.MESSAGES.get(status, "gateway")
        self.performed = performed
        self.left = {path: times for path in paths}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"]
        left = self.left.get(path, 0)
        if path not in self.paths or left == 0:
            await self.behind(scope, receive, send)
            return
        if left is not None:
            self.left[path] = left - 1

        async def lost(message: Any) -> None:  # the answer came after the gateway gave up
            pass

        if self.performed:
            await self.behind(scope, receive, lost)
        else:
            while (await receive()).get("more_body"):
                pass
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": self.message.encode()})


def retry_refused_after_a_504(standin: Any, path: str) -> tuple[EchoingGateway, list[str]]:
    """A gateway in front of ``standin`` whose first try at ``path`` is performed and its
    answer lost (a 504), and whose re-sent tries are refused (403, an RBAC denial): the
    gateway, and the tries at ``path`` that reached it."""
    tries: list[str] = []

    def answer(asked: str, auth: str) -> tuple[int, Any] | None:
        if asked != path:
            return None
        tries.append(asked)
        return None if len(tries) == 1 else (403, "RBAC: access denied")

    return EchoingGateway(answer, behind=LosingGateway(standin, {path}, status=504,
                                                       times=1)), tries


class SlowUpstream:
    """A gateway with an upstream ``timeout`` in front of a stand-in that performs the
    state-changing calls (``POST``) one at a time, in order, as vLLM's engine core and
    SGLang's scheduler do: the first call to each of ``slow`` (path -> seconds) takes that
    long. A call the upstream does not finish within ``timeout`` is answered 504 — or,
    ``drop=True``, the connection is cut before the answer — while the upstream goes on
    performing it. :attr:`settled` is set whenever no call is left in the upstream."""

    def __init__(self, behind: Any, slow: dict[str, float], *, timeout: float = 0.2,
                 drop: bool = False) -> None:
        self.behind, self.slow, self.timeout, self.drop = behind, dict(slow), timeout, drop
        self.lock: asyncio.Lock | None = None
        self.pending: set[asyncio.Task[Any]] = set()
        self.settled = threading.Event()
        self.settled.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["method"] != "POST":
            await self.behind(scope, receive, send)
            return
        if self.lock is None:
            self.lock = asyncio.Lock()
        lock = self.lock
        body = await _body(receive)
        answer: list[Any] = []
        delay = self.slow.pop(scope["path"], 0.0)

        async def upstream() -> None:
            async def replay() -> Any:
                return {"type": "http.request", "body": body, "more_body": False}

            async def keep(message: Any) -> None:
                answer.append(message)

            async with lock:
                await asyncio.sleep(delay)
                await self.behind(scope, replay, keep)

        task = asyncio.get_running_loop().create_task(upstream())
        self.pending.add(task)
        self.settled.clear()

        def done(task: asyncio.Task[Any]) -> None:
            self.pending.discard(task)
            if not self.pending:
                self.settled.set()

        task.add_done_callback(done)
        try:
            await asyncio.wait_for(asyncio.shield(task), self.timeout)
        except asyncio.TimeoutError:
            if self.drop:
                await _cut(send)
            await _json(send, 504, {"message": "upstream request timeout"})
            return
        for message in answer:
            await send(message)


class VLLMStandIn(StandIn):
    """vLLM 0.33's OpenAI server in dev mode with ``--enable-sleep-mode``."""

    def __init__(self, *, dev_mode: bool = True, sleep_mode: bool = True,
                 legacy: bool = False, tags_woken: bool = False) -> None:
        super().__init__()
        self.dev_mode, self.sleep_mode = dev_mode, sleep_mode
        self.legacy, self.tags_woken = legacy, tags_woken
        self.asleep: set[str] = set()
        self.weights = "gpu"  # gpu | cpu (level 1) | discarded (level 2) | garbage

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)

    def state(self) -> dict[str, Any]:
        return {"sleeping": self.sleeping, "weights": self.weights}

    def route(self, method: str, path: str, query: dict[str, list[str]],
              body: Any) -> tuple[int, Any]:
        dev = {"/sleep", "/wake_up", "/is_sleeping", "/collective_rpc"}
        if path in dev and not self.dev_mode:
            return 404, {"detail": "Not Found"}
        if (method, path) == ("GET", "/health"):
            return 200, None  # ignores sleep, as vLLM's does
        if (method, path) == ("GET", "/is_sleeping"):
            return 200, {"is_sleeping": self.sleeping}
        if (method, path) == ("POST", "/sleep"):
            return self._sleep(int(query.get("level", ["1"])[0]))
        if (method, path) == ("POST", "/wake_up"):
            return self._wake(query.get("tags") or list(TAGS))
        if (method, path) == ("POST", "/collective_rpc"):
            if body != {"method": "reload_weights"}:
                return 400, {"message": f"unexpected rpc {body!r}"}
            if "weights" in self.asleep:
                return 500, {"message": "weights memory is not allocated (still asleep)"}
            self.weights = "gpu"
            return 200, {"results": [None]}
        if (method, path) == ("GET", "/v1/models"):
            return 200, {"object": "list", "data": [{"id": "stand-in/model"}]}
        if (method, path) == ("POST", "/v1/completions"):
            if self.sleeping:
                return 503, {"message": "the engine is sleeping"}
            if self.weights != "gpu":
                return 500, {"message": f"NaN in logits: weights are {self.weights}"}
            assert body["max_tokens"] == 1 and body["model"] == "stand-in/model", body
            self.canaries += 1
            return 200, {"choices": [{"index": 0, "text": " world"}]}
        return 404, {"detail": "Not Found"}

    def _sleep(self, level: int) -> tuple[int, Any]:
        if not self.sleep_mode:
            return 500, {"object": "error", "type": "InternalServerError", "code": 500,
                         "message": "Sleep mode is not enabled in the model config"}
        if self.asleep:  # vLLM's executor: "Executor is already sleeping." and nothing else
            return 200, None if self.legacy else {"status": "sleeping", "level": level}
        self.asleep = set(TAGS)
        self.weights = {0: "gpu", 1: "cpu", 2: "discarded"}[level]
        return 200, None if self.legacy else {"status": "sleeping", "level": level}

    def _wake(self, tags: list[str]) -> tuple[int, Any]:
        woken = [t for t in tags if t in self.asleep]
        self.asleep -= set(tags)
        if "weights" in woken:
            # level 1 weights come back from CPU RAM; level 2 memory comes back empty
            self.weights = "gpu" if self.weights in ("gpu", "cpu") else "garbage"
        if self.legacy:
            return 200, None
        if self.tags_woken:
            return 200, {"tags_woken": woken}
        return 200, {"status": "sleeping" if self.sleeping else "awake", "tags": woken}


class SGLangStandIn(StandIn):
    """SGLang 0.5's HTTP server (``--enable-memory-saver`` unless told otherwise)."""

    MEMORY = ("weights", "kv_cache", "cuda_graph")

    PAUSE_MODES = ("abort", "retract", "in_place")

    # SGLang's AuthLevel.ADMIN_OPTIONAL endpoints among those the adapter calls
    ADMIN_OPTIONAL = ("/pause_generation", "/continue_generation",
                      "/release_memory_occupation", "/resume_memory_occupation")

    def __init__(self, *, memory_saver: bool = True, pause_endpoints: bool = True,
                 api_key: str | None = None, admin_api_key: str | None = None) -> None:
        super().__init__()
        self.memory_saver = memory_saver
        # --api-key / --admin-api-key, checked as SGLang's decide_request_auth does
        self.api_key, self.admin_api_key = api_key, admin_api_key
        # False: a server without /pause_generation and /continue_generation (404)
        self.pause_endpoints = pause_endpoints
        self.released: set[str] = set()
        # requests the scheduler is generating (sent to the server directly, past any
        # gate): SGLang asserts there are none when it releases or resumes memory
        self.running = 0
        self.aborted = 0  # requests a pause in abort mode ended
        self.paused = False
        self.starting = 0  # /health_generate answers 503 this many more times
        self.refuse: str | None = None  # 200 {"success": false, "message": refuse}
        # path -> message: that call alone is answered 200 {"success": false, "message": …}
        self.refused: dict[str, str] = {}
        # the message of a 400 refusing a resume of memory not released (a server or
        # memory saver backend that refuses it); None: SGLang 0.5, which dies of it
        self.not_released: str | None = None

    def refuse_key(self, path: str, authorization: str | None) -> tuple[int, Any] | None:
        """SGLang's key middleware (``srt/utils/auth.py``): ``/health*`` is open; an
        ADMIN_OPTIONAL endpoint takes only the admin key when there is one, else the API
        key; every other endpoint the API key (if any). A refusal is 401 ``Unauthorized``."""
        if path.startswith("/health"):
            return None
        if path in self.ADMIN_OPTIONAL and self.admin_api_key:
            wanted: str | None = self.admin_api_key
        else:
            wanted = self.api_key
        if wanted is None or authorization == f"Bearer {wanted}":
            return None
        return 401, {"error": "Unauthorized"}

    def route(self, method: str, path: str, query: dict[str, list[str]],
              body: Any) -> tuple[int, Any]:
        if (method, path) == ("GET", "/health"):
            return 200, None
        if (method, path) == ("GET", "/server_info"):
            return 200, {"model_path": "stand-in/model", "enable_memory_saver": self.memory_saver}
        if (method, path) == ("GET", "/health_generate"):
            if self.starting:
                self.starting -= 1
                return 503, None
            if self.paused:
                # its generation waits behind the pause until SGLang's health check gives
                # up (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s) and answers 503: here at once
                return 503, {"message": "health check timed out: generation is paused"}
            if self.released:
                return 500, {"message": f"generation failed: {sorted(self.released)} released"}
            self.canaries += 1
            return 200, None
        if method == "POST" and path in ("/pause_generation", "/continue_generation"):
            return self._pause_or_continue(path, body)
        if method == "POST" and path in ("/release_memory_occupation",
                                         "/resume_memory_occupation"):
            if not isinstance(body, dict):
                return 422, {"detail": "a JSON body is required"}
            if self.running:
                # the scheduler asserts it is idle; the AssertionError ends the server
                self.crashed = "AssertionError: release/resume with requests running"
                return 500, None
            if self.refuse is not None:
                return 200, {"success": False, "message": self.refuse}
            if path in self.refused:
                return 200, {"success": False, "message": self.refused[path]}
            tags = set(body.get("tags") or self.MEMORY)
            if not self.memory_saver:
                return 200, None  # SGLang only logs a warning then
            if path == "/release_memory_occupation":
                if tags & self.released:
                    # torch_memory_saver's pause of a region already paused: "Cannot
                    # pause allocation that is not active", then exit(1)
                    self.crashed = ("torch_memory_saver: Cannot pause allocation that is "
                                    "not active")
                    return 500, None
                self.released |= tags
            else:
                if not tags <= self.released:
                    if self.not_released is None:
                        # SGLang 0.5: offload_tags.remove(tag) raises KeyError in the
                        # scheduler, whose exception ends the server (SIGQUIT)
                        self.crashed = f"KeyError: {sorted(tags - self.released)[0]!r}"
                        return 500, None
                    return 400, {"message": self.not_released}
                self.released -= tags
            return 200, None
        return 404, {"detail": "Not Found"}

    def _pause_or_continue(self, path: str, body: Any) -> tuple[int, Any]:
        """SGLang's ``PauseGenerationReqInput`` (``mode``: abort — the default — ends the
        running requests; retract and in_place keep them) and ``ContinueGenerationReqInput``
        (no fields): a JSON object body is required, as for every FastAPI body model."""
        if not self.pause_endpoints:
            return 404, {"detail": "Not Found"}
        if not isinstance(body, dict):
            return 422, {"detail": "a JSON body is required"}
        if path == "/continue_generation":
            self.paused = False
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        mode = body.get("mode", "abort")
        if mode not in self.PAUSE_MODES:
            return 422, {"detail": f"Invalid mode: {mode!r}. Expected one of "
                                   f"{list(self.PAUSE_MODES)}."}
        if mode == "abort":
            self.aborted += self.running
            self.running = 0
        self.paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}


class FakeLLM:
    """Duck-typed ``vllm.LLM``: sync ``sleep``/``wake_up``/``collective_rpc``/``generate``
    and ``llm_engine.is_sleeping()``, over the same state machine as the server."""

    def __init__(self) -> None:
        self.engine = VLLMStandIn()
        self.calls: list[str] = []
        self.llm_engine = _LLMEngine(self)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(f"sleep({level})")
        status, _ = self.engine._sleep(level)
        assert status == 200

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(f"wake_up({tags})")
        self.engine._wake(tags or list(TAGS))
        return not self.engine.sleeping

    def collective_rpc(self, method: str) -> list[Any]:
        self.calls.append(f"collective_rpc({method})")
        status, body = self.engine.route("POST", "/collective_rpc", {}, {"method": method})
        if status != 200:
            raise RuntimeError(body["message"])
        return [None]

    def generate(self, prompts: list[str], sampling_params: Any = None) -> list[str]:
        self.calls.append("generate")
        status, body = self.engine.route("POST", "/v1/completions", {},
                                         {"max_tokens": 1, "model": "stand-in/model"})
        if status != 200:
            raise RuntimeError(body["message"])
        return [" world" for _ in prompts]


class FakeAsyncLLM(FakeLLM):
    """Duck-typed ``vllm.AsyncLLM``: the same methods as coroutines, ``generate`` an async
    generator taking a ``request_id``."""

    async def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:  # type: ignore[override]
        FakeLLM.sleep(self, level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:  # type: ignore[override]
        return FakeLLM.wake_up(self, tags)

    async def collective_rpc(self, method: str) -> list[Any]:  # type: ignore[override]
        return FakeLLM.collective_rpc(self, method)

    async def generate(self, prompt: str, sampling_params: Any,  # type: ignore[override]
                       request_id: str) -> AsyncIterator[str]:
        assert request_id
        for text in FakeLLM.generate(self, [prompt], sampling_params):
            yield text


class SlowSleepLLM(FakeLLM):
    """A ``vllm.LLM`` under ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: each call runs in its
    caller's thread, and nothing orders a ``wake_up`` after a ``sleep`` still running in
    another. The sleep (``is_sleeping()`` says True once it has ended, as vLLM's) takes
    until :attr:`go` is set; :attr:`slept` is set when it has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.slept = threading.Event()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        try:
            if self.go.wait(30):
                super().sleep(level, mode)
        finally:
            self.slept.set()


class SlowSleepAsyncLLM(FakeAsyncLLM):
    """:class:`SlowSleepLLM` as an ``AsyncLLM``: the sleep is the engine's work, done
    whether or not its caller still awaits it (cancelling the coroutine does not stop
    it), and a ``wake_up`` meanwhile is not ordered after it."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.slept = threading.Event()

    def _sleep_now(self, level: int, mode: str) -> None:
        try:
            if self.go.wait(30):
                FakeLLM.sleep(self, level, mode)
        finally:
            self.slept.set()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        work: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            try:
                self._sleep_now(level, mode)
            finally:
                work.set_result(None)

        threading.Thread(target=run, daemon=True).start()
        await asyncio.wrap_future(work)


class _LLMEngine:
    """``LLM.llm_engine``: where the sync engine answers ``is_sleeping()``."""

    def __init__(self, llm: FakeLLM) -> None:
        self.llm = llm

    def is_sleeping(self) -> bool:
        self.llm.calls.append("is_sleeping")
        return self.llm.engine.sleeping


API_KEY = "sk-live-SECRETKEY2"
"""The adapters' key in the redaction tests: its first four characters (``sk-l``) appear
in nothing else, so a key cut short in a quoted reason still shows."""

GATEWAY_ECHOES: dict[str, Any] = {
    # authorization -> (status, body): how gateways quote the request back
    "json 401": lambda auth: (401, {"detail": f"invalid credentials: {auth}"}),
    "text 401 quoting the header": lambda auth: (
        401, f"Unauthorized. Request headers: Authorization: {auth}; accept: */*"),
    "bare token in an OpenAI-style 403": lambda auth: (
        403, {"error": {"message": f"key {auth.split()[-1]} revoked"}}),
    "token where the reason is cut": lambda auth: (401, {"detail": "x" * 285 + " " + auth}),
    "token in a URL's query": lambda auth: (
        401, {"detail": f"log in at https://gw.example/login?token={auth.split()[-1]}&a=1"}),
    "5xx echoing the token until the deadline": lambda auth: (
        502, {"message": f"upstream refused {auth}"}),
}
