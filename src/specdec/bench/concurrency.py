"""Several clients at once: ``specdec bench --concurrency 1 4 8``.

For each concurrency N and each server of the run (``specdec serve --parallel N`` with a method as
its default, ``llama-server -np N``: :class:`~specdec.bench.servers.Servers`), the server is
started alone on the machine, N client threads each send their share of the prompts (client c
the prompts c, c + N, c + 2N, ... in turn: :func:`shares`), all starting together once every
client's untimed warm-up request has been answered, and the server is stopped again. A chat prompt
goes as its messages to ``/v1/chat/completions`` with the fields an OpenAI client sends
(:func:`~specdec.bench.servers.chat_request_body`), a raw-text prompt as its text to
``/v1/completions`` with the same fields (:func:`completion_request_body`): each server samples
with its own defaults, as its users get it. Prompt p is sent with the seed ``seed + p`` at every N.
A ``specdec serve`` method with ``prediction=yes`` also sends each prompt's predicted output (OpenAI's
Predicted Outputs, :mod:`specdec.bench.servers`), and its answers carry the usage's accepted and
rejected prediction tokens.

Figures of one (server, N) run (:func:`figures`): the aggregate tokens per second (every
completion token over the wall time from the first request sent to the last answer's end), and
the 50th and 95th percentiles (:func:`percentile`) of the request time (send to the stream's end),
of the time to the first token (send to the first chunk that carries a token or text) and of the
inter-token latency, over every token after each request's first chunk (:func:`token_gaps`: each
chunk's wait since the one before, divided among its tokens, as the server's
``specdec_inter_token_latency_seconds`` counts it); each answer in results.json carries its own
request's percentiles of it too.

Identity (:func:`identity`): each answer at N against the same server's answer to the same
request at N = 1 (the run always includes N = 1): token ids where the stream carries them
(``specdec serve``'s), else the text (llama-server's chat stream carries text only). ``specdec
serve`` promises an answer identical to the request's answer alone, greedy and seeded (its
Gumbel-max sampler); llama-server promises nothing of the sort, and its count says how often it
holds.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import httpx

from specdec.bench.methods import MethodSpec
from specdec.bench.runner import WARMUP_MESSAGES
from specdec.bench.servers import (
    REQUEST_SECONDS, Completion, Servers, chat_request_body, predicted_output, prediction_counts, server_key,
)
from specdec.prompts import Prompt

# The servers --concurrency compares when --methods names none: plain decoding and the default
# method through specdec serve on the GGUF kernel (the one backend that decodes requests at once),
# and llama.cpp's own server.
DEFAULT_METHODS = "ar:backend=gguf:via=serve,spec:backend=gguf:via=serve,llama-server"
PERCENTILES = (50, 95)
# Each client's untimed first request (no timed prompt begins with it: a server keeps the prompt it
# saw last): on the chat endpoint where the run sends chat prompts, else on completions.
WARMUP_CHAT = Prompt("warm-up", "chat", messages=WARMUP_MESSAGES)
WARMUP_TEXT = Prompt("warm-up", "text", text="One, two, three, four,")
REFERENCE = "llama-server"  # the server each row's tokens per second is compared with, at the same N


@dataclass(frozen=True)
class ConcurrencySettings:
    """What every (server, N) run shares. ``levels``: the concurrencies, ascending, 1 first."""

    levels: tuple[int, ...]
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    warmup_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.levels or min(self.levels) < 1:
            raise ValueError(f"concurrency levels must be positive, got {list(self.levels)}")
        object.__setattr__(self, "levels", tuple(sorted({1, *self.levels})))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Answer:
    """One request of a run: when it was sent (seconds after the run's start), how long it took,
    when its first token came (seconds after it was sent; None: no token came), its tokens."""

    prompt: int
    client: int
    sent: float
    seconds: float
    first_token: float | None
    tokens: int  # completion tokens
    token_ids: list[int] = field(default_factory=list)  # empty where the stream carries none
    text: str = ""
    token_gaps: list[float] = field(default_factory=list)  # inter-token latencies, seconds (token_gaps)
    prediction_accepted: int | None = None  # the usage's prediction tokens (None: no prediction sent)
    prediction_rejected: int | None = None

    @property
    def end(self) -> float:
        return self.sent + self.seconds


# ------------------------------------------------------------------------------------------
# The arithmetic


def shares(n_prompts: int, clients: int) -> list[list[int]]:
    """Client c's prompts, in the order it sends them: c, c + clients, c + 2 clients, ..."""
    return [list(range(c, n_prompts, clients)) for c in range(clients)]


def percentile(values: Sequence[float], q: int) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between the two nearest ranks
    (numpy's default): rank q (n - 1) / 100 of the sorted values, counted from 0."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    whole, part = divmod(q * (len(ordered) - 1), 100)
    if part == 0:
        return ordered[whole]
    return ordered[whole] + (ordered[whole + 1] - ordered[whole]) * part / 100


def token_gaps(arrivals: Sequence[tuple[float, int]]) -> list[float]:
    """Inter-token latencies of a stream whose chunks came at ``arrivals`` ((seconds, tokens) each):
    every chunk after the first waited since the one before, that wait divided among its tokens,
    one value per token (a speculative step's several tokens share its wait)."""
    gaps: list[float] = []
    for (before, _), (at, tokens) in zip(arrivals, arrivals[1:]):
        gaps += [(at - before) / tokens] * tokens
    return gaps


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """The :data:`PERCENTILES` of ``values`` (None where there are none)."""
    return {f"p{q}": percentile(values, q) if values else None for q in PERCENTILES}


def figures(answers: Sequence[Answer]) -> dict[str, Any]:
    """A run's figures: requests, tokens, wall seconds (first send to last answer's end), aggregate
    tokens per second, and the percentiles of the request time, the time to the first token and the
    inter-token latency (over the tokens of every request)."""
    wall = max(a.end for a in answers) - min(a.sent for a in answers)
    tokens = sum(a.tokens for a in answers)
    firsts = [a.first_token for a in answers if a.first_token is not None]
    return {
        "requests": len(answers), "tokens": tokens, "wall_seconds": wall,
        "tokens_per_second": tokens / wall if wall > 0 else math.inf,
        "request_seconds": spread([a.seconds for a in answers]),
        "first_token_seconds": spread(firsts),
        "inter_token_seconds": spread([g for a in answers for g in a.token_gaps]),
    }


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter one's length where one is the
    other's start); None where they are equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def identity(answers: Sequence[Answer], alone: Sequence[Answer]) -> dict[str, Any]:
    """Each answer against the answer to the same prompt in ``alone`` (the N = 1 run): by token
    ids where both carry them, else by text. ``{"identical", "total", "differ": [{"prompt",
    "position", "unit"}]}``, position counted in tokens or characters (``unit``)."""
    reference = {a.prompt: a for a in alone}
    differ = []
    for answer in sorted(answers, key=lambda a: a.prompt):
        solo = reference[answer.prompt]
        by_ids = bool(answer.token_ids and solo.token_ids)
        position = (first_difference(answer.token_ids, solo.token_ids) if by_ids
                    else first_difference(answer.text, solo.text))
        if position is not None:
            differ.append({"prompt": answer.prompt, "position": position, "unit": "token" if by_ids else "character"})
    return {"identical": len(answers) - len(differ), "total": len(answers), "differ": differ}


# ------------------------------------------------------------------------------------------
# The clients


def run_clients(clients: int, n_prompts: int, send: Callable[[int, int], Answer],
                warm_up: Callable[[int], None] | None = None) -> list[Answer]:
    """``clients`` threads, client c calling ``send(c, p)`` for each prompt p of its share
    (:func:`shares`) in turn. Each first calls ``warm_up(c)``; the sends start once every client is
    warm, and each answer's ``sent`` is counted from that moment. The answers by prompt; the first
    error of any client is raised once all have stopped (the others stop at their next request)."""
    start: list[float] = []
    barrier = threading.Barrier(clients, action=lambda: start.append(time.perf_counter()))
    answers: list[Answer] = []
    errors: list[BaseException] = []

    def client(c: int) -> None:
        try:
            if warm_up is not None:
                warm_up(c)
            barrier.wait()
            for p in shares(n_prompts, clients)[c]:
                if errors:
                    return
                sent = time.perf_counter() - start[0]
                answer = send(c, p)
                answer.sent = sent
                answers.append(answer)
        except threading.BrokenBarrierError:
            pass  # another client failed before the start
        except BaseException as err:  # noqa: BLE001 -- handed to the caller
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=client, args=(c,), name=f"bench-client-{c}") for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sorted(answers, key=lambda a: a.prompt)


def completion_request_body(text: str, temperature: float, max_new_tokens: int, seed: int,
                            ignore_eos: bool, prediction: str | None = None) -> dict[str, Any]:
    """A raw-text prompt as an OpenAI client sends it to ``/v1/completions``: the text, the token
    budget, the temperature and the seed, streamed with usage (and ``ignore_eos`` where the run
    makes every completion its full length; ``prediction``: the predicted output)."""
    body: dict[str, Any] = {"prompt": text, "max_tokens": max_new_tokens, "temperature": temperature, "seed": seed,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body | predicted_output(prediction)


def request(prompt: Prompt, settings: ConcurrencySettings, seed: int, max_new_tokens: int | None = None,
            prediction: bool = False) -> tuple[str, dict[str, Any]]:
    """(path, body) of ``prompt``'s request: chat prompts to the chat endpoint, raw text to completions;
    ``prediction``: with the prompt's predicted output, where it has one."""
    n = settings.max_new_tokens if max_new_tokens is None else max_new_tokens
    predicted = prompt.prediction if prediction else None
    if prompt.chat:
        return "/v1/chat/completions", chat_request_body(prompt.messages, settings.temperature, n, seed,
                                                         settings.ignore_eos, prompt.schema,
                                                         prompt.schema_name or "output", predicted)
    return "/v1/completions", completion_request_body(prompt.text, settings.temperature, n, seed, settings.ignore_eos,
                                                      predicted)


def answer_of(done: Completion, prompt: int, client: int) -> Answer:
    """An :class:`Answer` (sent at 0) from a streamed completion: its tokens counted from the
    stream's token ids, else its usage, else llama-server's ``timings``."""
    if done.token_ids:
        tokens = len(done.token_ids)
    elif "completion_tokens" in done.usage:
        tokens = int(done.usage["completion_tokens"])
    elif "predicted_n" in done.timings:
        tokens = int(done.timings["predicted_n"])
    else:
        raise RuntimeError("a server's answer says neither its token ids nor how many tokens it made")
    arrivals = [at for at, _ in done.arrivals[:1]] + done.text_arrivals[:1]
    chunks = done.arrivals or [(at, 1) for at in done.text_arrivals]  # a text-only stream: a token a chunk
    kept, rejected = prediction_counts(done)
    return Answer(prompt=prompt, client=client, sent=0.0, seconds=done.seconds,
                  first_token=min(arrivals) if arrivals else None, tokens=tokens,
                  token_ids=list(done.token_ids), text=done.text, token_gaps=token_gaps(chunks),
                  prediction_accepted=kept, prediction_rejected=rejected)


def measure(servers: Servers, method: MethodSpec, prompts: Sequence[Prompt], settings: ConcurrencySettings,
            clients: int) -> dict[str, Any]:
    """One (server, N) run: the server started alone with ``clients`` slots, the clients' requests,
    the server stopped. ``{"method", "concurrency", "argv", "answers"}``."""
    servers.stop()
    servers.parallel = clients
    key = server_key(method)
    process = servers.server(key)
    pool = [httpx.Client(timeout=REQUEST_SECONDS, limits=httpx.Limits(max_keepalive_connections=0))
            for _ in range(clients)]
    warm_prompt = WARMUP_CHAT if any(p.chat for p in prompts) else WARMUP_TEXT

    def warm_up(c: int) -> None:
        if settings.warmup_tokens:
            path, body = request(warm_prompt, settings, settings.seed, min(settings.warmup_tokens,
                                                                           settings.max_new_tokens))
            servers.complete(key, body, path, client=pool[c])

    def send(c: int, p: int) -> Answer:
        path, body = request(prompts[p], settings, settings.seed + p, prediction=method.prediction)
        return answer_of(servers.complete(key, body, path, client=pool[c]), p, c)

    try:
        answers = run_clients(clients, len(prompts), send, warm_up)
    finally:
        for client in pool:
            client.close()
        servers.stop()
    return {"method": method.name, "concurrency": clients, "argv": process.argv,
            "answers": [asdict(a) for a in answers]}


def run(servers: Servers, methods: Sequence[MethodSpec], prompts: Sequence[Prompt], settings: ConcurrencySettings,
        *, done: dict[tuple[str, int], dict[str, Any]] | None = None,
        on_run: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Every (server, N) run, N ascending and the servers in turn at each N (:func:`measure`);
    ``done``: runs already made, by (method name, N), taken as they are; ``on_run``: sees each new one."""
    done = done or {}
    made = []
    for n in settings.levels:
        for method in methods:
            cell = done.get((method.name, n))
            if cell is None:
                cell = measure(servers, method, prompts, settings, n)
                if on_run is not None:
                    on_run(cell)
            made.append(cell)
    return made


def answers_of(cell: dict[str, Any]) -> list[Answer]:
    return [Answer(**a) for a in cell["answers"]]


def results(cells: Sequence[dict[str, Any]], settings: ConcurrencySettings, prompts: Sequence[Prompt],
            env: dict[str, Any], models: dict[str, Any], skipped: dict[str, str] | None = None) -> dict[str, Any]:
    """The whole run as plain data (results.json): each (server, N) run with its figures, its
    identity to the same server's N = 1 answers, and its answers."""
    alone = {c["method"]: answers_of(c) for c in cells if c["concurrency"] == 1}
    runs = []
    for cell in cells:
        answers = answers_of(cell)
        row = {"method": cell["method"], "concurrency": cell["concurrency"], "argv": cell["argv"],
               **figures(answers)}
        if cell["concurrency"] > 1 and cell["method"] in alone:
            row["identity"] = identity(answers, alone[cell["method"]])
        runs.append(row | {"answers": [a | {"inter_token_seconds": spread(a.get("token_gaps") or [])}
                                       for a in cell["answers"]]})
    reference = {r["concurrency"]: r["tokens_per_second"] for r in runs if r["method"] == REFERENCE}
    for row in runs:
        if row["concurrency"] in reference and row["method"] != REFERENCE:
            row[f"vs_{REFERENCE}"] = row["tokens_per_second"] / reference[row["concurrency"]]
    return {
        "environment": env,
        "models": models,
        "settings": {"concurrency": list(settings.levels), "temperature": settings.temperature,
                     "greedy": settings.greedy, "max_new_tokens": settings.max_new_tokens, "seed": settings.seed,
                     "eos": "ignored" if settings.ignore_eos else "stops", "warmup_tokens": settings.warmup_tokens,
                     "requests": "chat prompts as messages to /v1/chat/completions, raw text to /v1/completions, "
                                 "with an OpenAI client's default fields; prompt p seeded seed + p"},
        "prompts": [p.to_dict() for p in prompts],
        "skipped": dict(skipped or {}),
        "runs": runs,
    }
