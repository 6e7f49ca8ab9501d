"""The FastAPI application: OpenAI-style completions and chat over one loaded model pair.

Endpoints: ``GET /health`` (never needs the key), ``GET /metrics`` (Prometheus text),
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /`` (a page
that streams a completion and colours each token by where it came from).

In front of every route, :class:`~specdec.server.guard.Guard` checks the ``Host`` header and reads
the body within its size limit and read timeout. A generation request is checked (body, model,
method, then the prompt: its length in characters, and its tokens, tokenized on a thread so the
event loop keeps serving) before it is handed to the serving engine (:mod:`specdec.serving`) as a
:class:`~specdec.serving.Work`, and is answered either as one JSON object or,
with ``"stream": true``, as server-sent events ending with ``data: [DONE]``. The response is only
started once the generation has produced its first tokens, so an error found when the generation
is built (a prompt longer than the context, a drafter option the drafter refuses) still gets its
4xx status (the engine's errors are answered as :func:`specdec.server.errors.engine_error` maps
them). The bodies, each chunk's non-standard ``speculative`` object among them, are built by
:mod:`specdec.server.responses`; every error is answered as :mod:`specdec.server.errors` spells
it. The chunks' text is :func:`specdec.stream`'s, which holds back text that may yet begin a stop
string, so the streamed text never shows part of one and adds up to the non-streamed text.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import importlib.resources
import json
import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.api import decode_text, eos_token_ids_of
from specdec.config import DecodeConfig
from specdec.constraints import ConstraintError
from specdec.server import errors, requests as rq
from specdec.server.errors import APIError
from specdec.server.guard import LOOPBACK_HOSTS, MAX_BODY_BYTES, READ_TIMEOUT_SECONDS, Guard
from specdec.models import Pair
from specdec.server.logprobs import TokenText
from specdec.server.metrics import Metrics
from specdec.server.requests import ChatBody, CompletionBody, Generation
from specdec.server.responses import Answer, sse, summary
from specdec.serving import Engine, Finished, Handle, ModelThread, QueueFull, ShuttingDown, Work
from specdec.serving.engine import DEFAULT_PROMPT_CACHE_BYTES

BodyModel = TypeVar("BodyModel", CompletionBody, ChatBody)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
REPLICA_HEADER = "x-specdec-replica"  # names the replica of a cluster (specdec.cluster) that answered
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
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES  # saved caches of earlier requests (serving.prompt_cache)
    seeded_sampler: str = "gumbel"  # the sampler of a request with a seed and no sampler (rq.choose_method)
    datastore: Any = None  # a specdec.datastore.Datastore each finished output is added to (the retrieval drafter's)
    parallel: int = 1  # requests decoded at once, their passes shared (slots; the GGUF kernel only)


@dataclass(frozen=True)
class Served:
    """What the HTTP side knows of the pair it serves, without its weights: the names clients see,
    the tokenizer it checks and counts prompts with, whether a draft model is loaded, where the
    target runs, its end tokens and the limits a prompt must fit. It pickles: a cluster's ingress
    (:mod:`specdec.cluster`) has it from a replica."""

    tokenizer: Any
    target_name: str
    draft_name: str | None
    has_draft: bool
    draft_weights: str
    backend: str
    eos: frozenset[int]
    limits: rq.PromptLimits
    draft_vocab: int | None = None  # how many ids the draft's head scores (None: every one)
    draft_quant: str | None = None  # the type the draft's layers were requantized to (None: the file's)

    @classmethod
    def of(cls, models: Pair) -> "Served":
        return cls(models.tokenizer, models.target_name, models.draft_name, models.draft is not None,
                   models.draft_weights, models.backend, frozenset(eos_token_ids_of(models.target, models.tokenizer)),
                   rq.PromptLimits.of(models.target, models.tokenizer), models.draft_vocab,
                   models.draft_quant)


def create_app(models: Pair, options: ServerOptions, thread: ModelThread | None = None) -> FastAPI:
    """The application serving ``models`` with an engine of its own (:func:`app_for`). ``thread``:
    the thread the models were loaded on, which runs every generation (default: a new one). A
    ``ValueError`` where ``options.parallel`` asks for slots the models cannot share passes in."""
    metrics = Metrics()
    engine = Engine(models, parallel=options.parallel, max_queue=options.max_queue,
                    prompt_cache_bytes=options.prompt_cache_bytes if options.prompt_cache else None,
                    datastore=options.datastore, observer=metrics, thread=thread)
    return app_for(Served.of(models), options, engine, metrics)


def app_for(models: Served, options: ServerOptions, engine: Any, metrics: Metrics) -> FastAPI:
    """The application answering with ``engine``, which starts and stops with the app's lifespan.
    ``engine`` is what takes each request's :class:`~specdec.serving.Work`: a local
    :class:`~specdec.serving.Engine`, or a cluster's replicas behind a handle
    (:class:`specdec.cluster.Replicas`); its ``open(work)`` returns a handle whose ``next`` gives
    the request's messages, whose ``stop`` stops it, and whose ``served_by`` names the replica
    that answers (None for a local engine). ``metrics`` is the engine's observer, or fed as one."""
    state = _State(models, options, metrics, engine, rq.has_fim_tokens(models.tokenizer), set(models.eos),
                   models.limits, TokenText(models.tokenizer))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.close()

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specdec = state
    app.add_middleware(Guard, hosts=options.allowed_hosts, max_body_bytes=options.max_body_bytes,
                       read_timeout=options.read_timeout)
    _add_error_handlers(app, metrics)
    app.include_router(_public_routes(state))
    app.include_router(_private_routes(state), dependencies=[Depends(_key_check(options.api_key, metrics))])
    return app


@dataclass
class _State:
    models: Served
    options: ServerOptions
    metrics: Metrics
    engine: Any  # an Engine, or what app_for takes as one
    fim: bool
    eos: set[int]
    limits: rq.PromptLimits
    token_text: TokenText | None = None


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
                            "draft_weights": models.draft_weights if models.has_draft else None,
                            "draft_vocab": models.draft_vocab,
                            "draft_quant": models.draft_quant,
                            "parallel": options.parallel},
        }]}

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(request, CompletionBody)
        _check_model(body.model, models.target_name)
        method = rq.choose_method(body, options.method, models.has_draft, options.seeded_sampler)
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
        method = rq.choose_method(body, options.method, models.has_draft, options.seeded_sampler)
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
                      body.speculative.policy_state if body.speculative is not None else "short", body.predicted)


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
    try:
        handle = state.engine.open(_work(state, gen))
    except QueueFull as err:
        raise APIError(429, f"the queue is full ({state.options.max_queue} requests waiting); retry later",
                       code="queue_full", type="rate_limit_error",
                       headers={"Retry-After": str(err.retry_after)}) from None
    except ShuttingDown as err:
        raise errors.engine_error(err, gen.method) from None
    watch = _Watch(request)
    first = await _next(handle, watch)
    if first is None:  # the client went away while waiting
        state.metrics.outcome(endpoint, "cancelled")
        return Response(status_code=499)
    if first[0] == "error":
        raise errors.engine_error(first[1], gen.method)
    answer = Answer(gen, state.models.target_name, state.token_text)
    if gen.stream:
        return StreamingResponse(_events(state, gen, handle, first, answer, endpoint),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **_replica_header(handle)})
    message = first
    while message is not None and message[0] == "step":  # the whole text comes with "done"
        message = await _next(handle, watch)
    if message is None:
        state.metrics.outcome(endpoint, "cancelled")
        return Response(status_code=499)
    if message[0] == "error":
        raise errors.engine_error(message[1], gen.method)
    state.metrics.outcome(endpoint, "ok")
    return JSONResponse(answer.whole(_summary(state, gen, message[1], handle)), headers=_replica_header(handle))


def _work(state: _State, gen: Generation) -> Work:
    """The request as the engine takes it: its method with the pair's draft weights, its sampling
    and the server's prompt cache setting, its constraints and log-probabilities, its time allowed."""
    try:
        config = gen.method.replace(draft_weights=state.models.draft_weights, **gen.sampling,
                                    prompt_cache=state.options.prompt_cache)
    except (ValueError, TypeError) as err:  # the library's promise for bad input
        raise APIError(400, str(err)) from None
    return Work(gen.prompt, config, gen.constraints, gen.logprobs, state.options.request_timeout, gen.prediction)


def _summary(state: _State, gen: Generation, done: Finished, handle: Handle) -> dict[str, Any]:
    """What a finished generation adds to its answer (:func:`specdec.server.responses.summary`);
    its ``speculative`` object names the replica that answered, where a cluster's did."""
    tokenizer = state.models.tokenizer
    stats = summary(gen, done.token_ids, done.text, done.stats, lambda ids: decode_text(tokenizer, ids), state.eos,
                    state.models.backend)
    if handle.served_by is not None:
        stats["speculative"] = {**stats["speculative"], "replica": handle.served_by}
    return {**stats, "logprobs": done.logprobs, "ids": done.token_ids}


def _replica_header(handle: Handle) -> dict[str, str]:
    """The header naming the replica that answers, where a cluster's does (``x-specdec-replica``)."""
    return {REPLICA_HEADER: handle.served_by} if handle.served_by is not None else {}


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


async def _next(handle: Handle, watch: _Watch | None) -> tuple[str, Any] | None:
    """The request's next message; None if the watched client disconnected. Past the deadline the
    engine's handle stops the request and returns a timeout error."""
    while True:
        if watch is not None and await watch.gone():
            handle.stop()
            return None
        message = await handle.next(POLL_SECONDS if watch is not None else None)
        if message is not None:
            return message


async def _events(state: _State, gen: Generation, handle: Handle, first: tuple[str, Any], answer: Answer,
                  endpoint: str) -> AsyncIterator[str]:
    """Server-sent events; if the client goes away, the server cancels this generator and the
    ``finally`` stops the request. A finished request is counted before its last event leaves, so a
    client that has read ``[DONE]`` finds it in /metrics."""
    outcome: str | None = "cancelled"
    try:
        message: tuple[str, Any] | None = first
        while message is not None:
            kind, payload = message
            if kind == "step":
                yield sse(answer.chunk(payload))
            elif kind == "done":
                last = [sse(chunk) for chunk in answer.last_chunks(payload.held, _summary(state, gen, payload, handle))]
                state.metrics.outcome(endpoint, "ok")
                outcome = None
                for event in last:
                    yield event
                yield "data: [DONE]\n\n"
                return
            else:
                err = errors.engine_error(payload, gen.method)
                state.metrics.outcome(endpoint, errors.outcome(err))
                outcome = None
                yield sse(err.body())
                yield "data: [DONE]\n\n"
                return
            message = await _next(handle, None)
    finally:
        handle.stop()
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
