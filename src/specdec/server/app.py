"""The FastAPI application: OpenAI-style completions and chat over one loaded model pair.

Endpoints: ``GET /health`` (never needs the key), ``GET /metrics`` (Prometheus text),
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /`` (a page
that streams a completion and colours each token by where it came from).

In front of every route, :class:`~specdec.server.guard.Guard` checks the ``Host`` header and reads
the body within its size limit and read timeout. A generation request is checked (body, model,
method, then the prompt: its length in characters, and its tokens, tokenized on a thread so the
event loop keeps serving) before it joins the queue, waits for the single worker
(:mod:`specdec.server.worker`), and is answered either as one JSON object or,
with ``"stream": true``, as server-sent events ending with ``data: [DONE]``. The response is only
started once the generation has produced its first tokens, so an error found when the generation
is built (a prompt longer than the context, a drafter option the drafter refuses) still gets its
4xx status. The bodies, each chunk's non-standard ``speculative`` object among them, are built by
:mod:`specdec.server.responses`; every error is answered as :mod:`specdec.server.errors` spells
it. The chunks' text is :func:`specdec.stream`'s, which holds back text that may yet begin a stop
string, so the streamed text never shows part of one and adds up to the non-streamed text.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import importlib.resources
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import specdec
from specdec.api import MethodError, decode_text, eos_token_ids_of
from specdec.backends.gguf import GGUFCausalLM
from specdec.backends.shared import SharedPasses
from specdec.datastore import MAX_MATCH
from specdec.config import DecodeConfig
from specdec.constraints import ConstraintError
from specdec.costs import pass_costs
from specdec.server import errors, requests as rq
from specdec.server.errors import APIError
from specdec.server.guard import LOOPBACK_HOSTS, MAX_BODY_BYTES, READ_TIMEOUT_SECONDS, Guard
from specdec.build import as_backend, is_backend
from specdec.drafters import registry as drafters
from specdec.models import Pair
from specdec.server.logprobs import TokenText
from specdec.server.metrics import Metrics
from specdec.server.prompt_cache import DEFAULT_BUDGET_MIB, PromptCache
from specdec.server.requests import ChatBody, CompletionBody, Generation
from specdec.server.responses import Answer, sse, summary
from specdec.server.worker import Job, ModelThread, QueueFull, Scheduler, Slot

BodyModel = TypeVar("BodyModel", CompletionBody, ChatBody)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
GRACE_SECONDS = 0.5  # past a request's deadline, how long to wait for the worker to notice it
POLL_SECONDS = 0.25  # how often a waiting non-streamed request checks that its client is still there


@dataclass
class ServerOptions:
    method: DecodeConfig  # used when a request names none
    max_queue: int = 16
    request_timeout: float = 600.0
    api_key: str | None = None
    max_tokens: int = 2048  # the most a request may ask for; also the chat default
    allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS  # the Host names answered; None: any
    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout: float = READ_TIMEOUT_SECONDS  # seconds for a request's headers to arrive, and again for its body
    prompt_cache: bool = True  # keep the models' caches between requests (DecodeConfig.prompt_cache)
    prompt_cache_bytes: int = DEFAULT_BUDGET_MIB << 20  # saved caches of earlier requests (server.prompt_cache)
    seeded_sampler: str = "gumbel"  # the sampler of a request with a seed and no sampler (rq.choose_method)
    datastore: Any = None  # a specdec.datastore.Datastore each finished output is added to (the retrieval drafter's)
    parallel: int = 1  # requests decoded at once, their passes shared (slots; the GGUF kernel only)


def create_app(models: Pair, options: ServerOptions, thread: ModelThread | None = None) -> FastAPI:
    """The application; its worker starts and stops with the app's lifespan. ``thread``: the
    thread the models were loaded on, which runs every generation (default: a new one)."""
    metrics = Metrics()
    scheduler = Scheduler(options.max_queue, metrics, thread, make_slots(models, options.parallel, metrics))
    state = _State(models, options, metrics, scheduler, rq.has_fim_tokens(models.tokenizer),
                   eos_token_ids_of(models.target, models.tokenizer),
                   rq.PromptLimits.of(models.target, models.tokenizer),
                   PromptCache(options.prompt_cache_bytes) if options.prompt_cache and is_backend(models.target) else None,
                   TokenText(models.tokenizer))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        scheduler.close()

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specdec = state
    app.add_middleware(Guard, hosts=options.allowed_hosts, max_body_bytes=options.max_body_bytes,
                       read_timeout=options.read_timeout)
    _add_error_handlers(app, metrics)
    app.include_router(_public_routes(state))
    app.include_router(_private_routes(state), dependencies=[Depends(_key_check(options.api_key, metrics))])
    return app


def make_slots(models: Pair, parallel: int, metrics: Metrics | None = None) -> list[Slot] | None:
    """``parallel`` slots whose passes are shared (None for one request at a time). ValueError
    where the models cannot share passes: only specdec's GGUF kernel computes a row of a shared pass
    as the sequence's own pass would, so only there does an answer not depend on the others."""
    if parallel < 1:
        raise ValueError(f"parallel must be at least 1, got {parallel}")
    if parallel == 1:
        return None
    if not isinstance(models.target, GGUFCausalLM) or not (models.draft is None or isinstance(models.draft, GGUFCausalLM)):
        raise ValueError("several requests at once need the models on specdec's GGUF kernel (--backend gguf), "
                         "whose shared passes give each request its answer alone; this backend serves one at a time")
    drafts: set[int] = set()  # the slots' draft models, by id: a draft on the target's own weights shares its passes

    def observe(pieces: list[tuple[Any, int]]) -> None:
        """One pass: counted for each model whose rows it holds (a draft that is the target's own
        weights shares the target's passes; its rows are still the draft's)."""
        if metrics is None:
            return
        for model in ("target", "draft"):
            rows = [n for slot_model, n in pieces if (id(slot_model) in drafts) == (model == "draft")]
            if rows:
                metrics.shared_pass(model, sum(rows), len(rows))

    passes = SharedPasses(own_thread=False, observe=observe, costs=pass_costs)
    slots = [Slot(passes.slot(models.target), passes.slot(models.draft) if models.draft is not None else None, passes)
             for _ in range(parallel)]
    drafts.update(id(slot.draft) for slot in slots if slot.draft is not None)
    return slots


@dataclass
class _State:
    models: Pair
    options: ServerOptions
    metrics: Metrics
    scheduler: Scheduler
    fim: bool
    eos: set[int]
    limits: rq.PromptLimits
    prompt_cache: PromptCache | None = None
    token_text: TokenText | None = None
    held: dict[str, Any] = field(default_factory=dict)  # transformers models' backends, kept for the prompt cache
    cache_lock: threading.Lock = field(default_factory=threading.Lock)  # the prompt cache, between slots

    def backends(self, method: DecodeConfig) -> tuple[Any, Any]:
        """The target (and draft) a generation runs on. With the prompt cache, a transformers
        model is wrapped once and the wrapper kept, so its cache outlives the request; a drafter
        that reads the target's layers or hidden states gets a fresh wrapper of its own kind."""
        target, draft = self.models.target, self.models.draft
        if not self.options.prompt_cache or is_backend(target) or drafters.needs(method.drafter):
            return target, draft
        if "target" not in self.held:
            self.held["target"] = as_backend(target)
        if draft is not None and not is_backend(draft) and "draft" not in self.held:
            self.held["draft"] = as_backend(draft, self.models.draft_weights)
        return self.held["target"], self.held.get("draft", draft)


def _public_routes(state: _State) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    return router


def _private_routes(state: _State) -> APIRouter:
    router = APIRouter()
    models, options = state.models, state.options
    html, policy = _page()

    @router.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(html, headers={"Content-Security-Policy": policy, "X-Frame-Options": "DENY"})

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": models.target_name, "object": "model", "created": 0, "owned_by": "specdec",
            "speculative": {"method": str(options.method), "seeded_sampler": options.seeded_sampler,
                            "draft": models.draft_name,
                            "draft_weights": models.draft_weights if models.draft is not None else None,
                            "parallel": options.parallel},
        }]}

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(request, CompletionBody)
        _check_model(body.model, models.target_name)
        method = rq.choose_method(body, options.method, models.draft is not None, options.seeded_sampler)
        max_tokens = _max_tokens(body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens", options)
        _check_stream_options(body)
        if isinstance(body.prompt, str):
            state.limits.check_chars(len(body.prompt) + len(body.suffix or ""), "prompt")
        constraints = await run_in_threadpool(_constraints, state, body)
        ids = await run_in_threadpool(rq.completion_ids, body, models.tokenizer, state.fim)
        state.limits.check_ids(ids, "prompt")
        gen = rq.infill_ends(_generation("completion", ids, body, method, max_tokens, constraints), body,
                             models.tokenizer, state.eos)
        return await _serve(state, request, gen)

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _body(request, ChatBody)
        _check_model(body.model, models.target_name)
        method = rq.choose_method(body, options.method, models.draft is not None, options.seeded_sampler)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        asked, field = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens
                        else (body.max_tokens, "max_tokens"))
        max_tokens = _max_tokens(asked or options.max_tokens, field, options)
        _check_stream_options(body)
        body.check_fields()
        state.limits.check_chars(sum(m.chars() for m in body.messages), "messages")
        constraints = await run_in_threadpool(_constraints, state, body)
        ids = await run_in_threadpool(rq.chat_prompt, body, models.tokenizer)
        state.limits.check_ids(ids, "messages")
        return await _serve(state, request, _generation("chat", ids, body, method, max_tokens, constraints))

    return router


def _page() -> tuple[str, str]:
    """The page, and a Content-Security-Policy that lets it run its own inline script and style
    (by their hashes) and talk to this server, and nothing else (no framing either)."""
    html = importlib.resources.files("specdec.server").joinpath("page.html").read_text("utf-8")

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    policy = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
              "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, policy


async def _body(request: Request, model: type[BodyModel]) -> BodyModel:
    """The request's body read as JSON whatever its Content-Type says, as llama-server reads it
    (``curl -d`` sends JSON as a form), then checked as ``model``: an :class:`APIError` naming the
    field, or saying the body is not JSON (and what it was sent as, where that was not JSON) or
    nests deeper than :data:`~specdec.server.requests.MAX_JSON_DEPTH`."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request needs a JSON object body")
    try:
        value = json.loads(raw)
    except RecursionError:  # arrays or objects nested deeper than Python's parser recurses
        raise rq.too_deep() from None
    except ValueError:
        sent = request.headers.get("content-type", "")
        said = "" if not sent or "json" in sent.lower() else f" (it was sent as Content-Type: {sent})"
        raise APIError(400, f"the request body is not valid JSON{said}; send a JSON object") from None
    rq.check_depth(value)
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise errors.validation_error(err.errors(), model) from None


def _check_stream_options(body: Any) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options goes with \"stream\": true", param="stream_options")


def _generation(kind: str, ids: list[int], body: Any, method: DecodeConfig, max_tokens: int,
                constraints: Any) -> Generation:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Generation(kind, ids, len(ids), method, rq.sampling_kwargs(body, max_tokens), body.stream,
                      include_usage, list(body.stop or []), constraints, rq.logprobs_of(body),
                      isinstance(body, ChatBody) and body.calls_tools,
                      body.speculative.policy_state if body.speculative is not None else "short")


def _constraints(state: _State, body: Any) -> Any:
    """The request's :class:`~specdec.constraints.Constraints` (None where it asks for none), checked
    against the model's vocabulary and tokenizer: a bad schema, grammar (one that admits no finite
    output, or exceeds the grammar engine's limits at its first tokens), penalty or ``logit_bias``
    key is an :class:`APIError` naming the request's field. A chat's tools' ``parameters`` schemas are
    checked each on its own, so the error names the tool."""
    asked = rq.constraint_fields(body)
    if isinstance(body, ChatBody) and body.calls_tools:
        for i, tool in enumerate(body.tools or []):
            if tool.function.parameters is not None:
                _check(rq.ConstraintFields({"json_schema": tool.function.parameters},
                                           {"json_schema": f"tools.{i}.function.parameters"}), state)
    return _check(asked, state) if asked.any else None


def _check(asked: rq.ConstraintFields, state: _State) -> Any:
    try:
        constraints = asked.build()
        constraints.check(state.limits.vocab_size, state.models.tokenizer, sorted(state.eos))
    except ConstraintError as err:
        param = asked.param(err.field)
        raise APIError(400, f"{param}: {str(err).removeprefix(err.field + ': ')}", param=param) from None
    except ImportError as err:  # llguidance, for a schema or grammar
        param = next(iter(asked.params.values()), None)
        raise APIError(400, f"{param}: this server cannot constrain output: {err.name} is not installed "
                            f"(pip install {err.name})", param=param) from None
    return constraints


def _check_model(asked: str | None, served: str) -> None:
    if asked is not None and asked != served:
        raise APIError(404, f"model: the model {asked!r} does not exist; this server serves {served!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")


def _max_tokens(asked: int, field: str, options: ServerOptions) -> int:
    if asked > options.max_tokens:
        raise APIError(400, f"{field}: {asked} is more than this server allows ({options.max_tokens}, "
                            "its --max-tokens)", param=field)
    return asked


# ------------------------------------------------------------------------------------------------
# Running a generation and answering it


async def _serve(state: _State, request: Request, gen: Generation) -> Response:
    endpoint = request.url.path
    job = _job(state, gen)
    try:
        state.scheduler.submit(job)
    except QueueFull:
        raise APIError(429, f"the queue is full ({state.options.max_queue} requests waiting); retry later",
                       code="queue_full", type="rate_limit_error",
                       headers={"Retry-After": str(state.scheduler.retry_after())}) from None
    watch = _Watch(request)
    first = await _next(job, watch)
    if first is None:  # the client went away while waiting
        state.metrics.outcome(endpoint, "cancelled")
        return Response(status_code=499)
    if first[0] == "error":
        raise first[1]
    answer = Answer(gen, state.models.target_name, state.token_text)
    if gen.stream:
        return StreamingResponse(_events(state, job, first, answer, endpoint),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    message = first
    while message is not None and message[0] == "step":  # the whole text comes with "done"
        message = await _next(job, watch)
    if message is None:
        state.metrics.outcome(endpoint, "cancelled")
        return Response(status_code=499)
    if message[0] == "error":
        raise message[1]
    state.metrics.outcome(endpoint, "ok")
    return JSONResponse(answer.whole(message[1][1]))


def _job(state: _State, gen: Generation) -> Job:
    models, tokenizer = state.models, state.models.tokenizer
    kwargs = rq.method_kwargs(gen.method, models.draft, models.draft_weights)

    def start(slot: Slot | None) -> Any:
        if state.prompt_cache is not None and not isinstance(gen.prompt, str):
            with state.cache_lock:
                state.prompt_cache.prepare(slot.target if slot is not None else models.target, gen.prompt)
        target, draft = (slot.target, slot.draft) if slot is not None else state.backends(gen.method)
        uses_draft = kwargs["draft"] is not None
        extra = {**({"constraints": gen.constraints} if gen.constraints is not None else {}),
                 **({"logprobs": gen.logprobs} if gen.logprobs is not None else {})}
        try:
            return specdec.stream(target, gen.prompt, tokenizer=tokenizer,
                                  **{**kwargs, "draft": draft if uses_draft else None},
                                  **gen.sampling, prompt_cache=state.options.prompt_cache, **extra)
        except MethodError as err:  # e.g. a drafter that needs layers or hidden states the backend does not give
            raise APIError(400, f"speculative.method: {gen.method}: {err}", param="speculative.method") from None

    def decode(ids: list[int]) -> str:
        return decode_text(tokenizer, ids)

    def finish(ids: list[int], text: str, stats: Any, logprobs: list[Any] | None) -> dict[str, Any]:
        cached = stats.prompt_cached if stats is not None else 0
        state.metrics.prompt_tokens.labels(source="cached").inc(cached)
        state.metrics.prompt_tokens.labels(source="computed").inc(gen.prompt_tokens - cached)
        if state.options.datastore is not None and ids:  # the output, after the prompt's last tokens it followed
            tail = list(gen.prompt[-MAX_MATCH:]) if not isinstance(gen.prompt, str) else []
            state.options.datastore.add(tail + list(ids))
        return {**summary(gen, ids, text, stats, decode, state.eos, models.backend), "logprobs": logprobs, "ids": ids}

    return Job(start, decode, finish, time.monotonic() + state.options.request_timeout, asyncio.get_running_loop())


class _Watch:
    """Whether a client waiting for a whole answer is still there, asked at most every POLL_SECONDS
    (steps arrive far more often; a streaming response is cancelled by the server itself instead)."""

    def __init__(self, request: Request) -> None:
        self.request, self.asked = request, time.monotonic()

    async def gone(self) -> bool:
        if time.monotonic() - self.asked < POLL_SECONDS:
            return False
        self.asked = time.monotonic()
        return await self.request.is_disconnected()


async def _next(job: Job, watch: _Watch | None) -> tuple[str, Any] | None:
    """The job's next message; None if the watched client disconnected. Past the deadline (and a
    grace for the worker to report it) the job is stopped and a timeout error returned."""
    while True:
        left = job.deadline + GRACE_SECONDS - time.monotonic()
        if left <= 0:
            job.stop()
            return "error", errors.timed_out()
        if watch is not None and await watch.gone():
            job.stop()
            return None
        try:
            return await asyncio.wait_for(job.out.get(), min(left, POLL_SECONDS) if watch else left)
        except asyncio.TimeoutError:
            pass


async def _events(state: _State, job: Job, first: tuple[str, Any], answer: Answer,
                  endpoint: str) -> AsyncIterator[str]:
    """Server-sent events; if the client goes away, the server cancels this generator and the
    ``finally`` stops the job. A finished request is counted before its last event leaves, so a
    client that has read ``[DONE]`` finds it in /metrics."""
    outcome: str | None = "cancelled"
    try:
        message: tuple[str, Any] | None = first
        while message is not None:
            kind, payload = message
            if kind == "step":
                yield sse(answer.chunk(payload))
            elif kind == "done":
                last = [sse(chunk) for chunk in answer.last_chunks(*payload)]
                state.metrics.outcome(endpoint, "ok")
                outcome = None
                for event in last:
                    yield event
                yield "data: [DONE]\n\n"
                return
            else:
                state.metrics.outcome(endpoint, errors.outcome(payload))
                outcome = None
                yield sse(payload.body())
                yield "data: [DONE]\n\n"
                return
            message = await _next(job, None)
    finally:
        job.stop()
        if outcome is not None:
            state.metrics.outcome(endpoint, outcome)


# ------------------------------------------------------------------------------------------------
# Keys and errors


def _key_check(api_key: str | None, metrics: Metrics) -> Any:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header[:7].lower() == "bearer ":
            given = header[7:].strip()
        else:  # a browser opening the page cannot send a header: GET /?key=KEY
            given = request.query_params.get("key", "") if request.url.path == "/" else ""
        if not given or not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    return check


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error answered as OpenAI's JSON (:mod:`specdec.server.errors`), and counted by route."""

    def answer(request: Request, err: APIError) -> Response:
        route = request.scope.get("route")
        metrics.outcome(route.path if route is not None else "other", errors.outcome(err))
        return Response(err.json(), status_code=err.status, media_type="application/json", headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> Response:
        return answer(request, err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        return answer(request, errors.validation_error(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        return answer(request, errors.route_error(err.status_code, str(err.detail), request.method, request.url.path))

    @app.exception_handler(Exception)
    async def fault(request: Request, err: Exception) -> Response:
        return answer(request, errors.internal_error())
