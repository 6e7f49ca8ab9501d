"""Run benchmark methods on prompts: warm-up, interleaved order, repeats, timing.

Every method sees the same loaded models (a :class:`~specdec.models.Pair` per backend: the torch
one the run is given, and one per GGUF backend in the run's :class:`BenchBackends`), prompt tokens,
sampling settings, token budget and EOS handling. Runs are interleaved prompt by prompt (for each
repeat, for each prompt: A, B, C, ...) so that drift in the machine's speed falls on all methods
alike, and the order turns by one place from one prompt and repeat to the next (B, C, A, ...), so
that no method always runs first or right after a given other one.

Runs already made (by an interrupted invocation, :mod:`specdec.bench.resume`) can be handed in
as ``done``: they keep their place in the order and only the others run; ``on_sample`` sees
each run as it ends, so it can be saved at once.

Project methods run through :func:`specdec.stream` with token ids (no tokenizer, so no decoding
cost inside the timed region), on the pair of their backend (``backend=``); peers
(:mod:`specdec.bench.peers`) run through transformers' ``model.generate`` or the llama.cpp
binding's own model; the llama-server peers and project methods with ``via=serve`` through a
server process, over HTTP (:mod:`specdec.bench.servers`). Each run's wall time covers the whole
call, prefill included.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import specdec
from specdec.api import decode_text, eos_token_ids_of
from specdec import build as builder
from specdec.divergence import LogitsRecorder, decisive_position, explain
from specdec.measurements import batch_invariance
from specdec.backends.table import BY_NAME, LABELS, TORCH
from specdec.bench.methods import MethodSpec
from specdec.bench.peers import load_llamacpp_peer, run_peer
from specdec.bench.schema_check import check_output
from specdec.bench.servers import Servers, end_of_turn_token, run_server, server_key
from specdec.constraints import Constraints
from specdec.prompts import Prompt
from specdec.sampling import SamplingConfig
from specdec.bench.sample import Sample, median as _median
from specdec.models import Located, Pair, load_model, load_tokenizer, requantized_draft, trim_draft


WARMUP_SERVER_TOKENS = 8
CONTEXT_STEP = 256  # the GGUF models' contexts are rounded up to a multiple of this
DRAFT_ROOM = 32  # room past the token budget for the last step's draft tokens


@dataclass(frozen=True)
class GGUFs:
    """The GGUF files the methods of one GGUF backend run (located: :func:`specdec.models.locate`,
    a pack's joined and hash-checked): the target's, and the draft's where a method there drafts
    with a model."""

    target: Located
    draft: Located | None = None


@dataclass
class BenchBackends:
    """How a run's methods use their models beyond the torch :class:`~specdec.models.Pair` the run
    is given (whose ``target`` and ``draft`` are transformers models; ``draft`` is needed by
    draft-model methods only): the draft's weights there, the GGUFs of each GGUF backend a method,
    peer or server runs on, and the :class:`~specdec.models.Pair` of each, which :func:`run_bench`
    loads (:func:`load_gguf_pairs`) before the warm-up with a context long enough for the run's
    longest prompt plus its token budget, and keeps for every later method, prompt and temperature."""

    draft_weights: str = "int8"  # how draft-model methods run the draft (``make_backend(weights=...)``)
    ggufs: dict[str, GGUFs] = field(default_factory=dict)  # backend (llamacpp, gguf) -> the files it runs
    n_threads: int | None = None  # the GGUF models' threads (decode and batch); None: the backend's default
    servers: Servers | None = None  # llama-server peers and methods with ``via=serve``
    pairs: dict[str, Pair] = field(default_factory=dict)  # backend -> its loaded models (load_gguf_pairs)
    peers: dict[str, Any] = field(default_factory=dict)  # peer kind -> the llama.cpp binding's own model
    n_ctx: int = 0  # the context the GGUF models are loaded with
    draft_vocab: int | str | None = None  # how many ids a kernel draft's head scores (--draft-vocab; models.trim_draft)
    draft_quant: str | None = None  # the type a draft's layers are requantized to (--draft-quant; models.requantized_draft)

    def peer(self, method: MethodSpec) -> Any:
        """The llama.cpp binding's own model of a ``llamacpp-*`` peer on the target's GGUF (loaded on
        first use, the warm-up, with the run's context: :func:`specdec.bench.peers.load_llamacpp_peer`)."""
        if method.kind not in self.peers:
            self.peers[method.kind] = load_llamacpp_peer(self.ggufs[method.backend].target.path, self.n_ctx,
                                                         self.n_threads)
        return self.peers[method.kind]


def context_needed(prompt_lengths: Sequence[int], max_new_tokens: int) -> int:
    """Tokens a run's context must hold: the longest prompt, the budget and a last step's drafts."""
    return max(prompt_lengths) + max_new_tokens + DRAFT_ROOM


def load_gguf_pairs(backends: BenchBackends, methods: Sequence[MethodSpec], n_ctx: int, tokenizer: Any) -> None:
    """Load the models ``methods`` run on each GGUF backend of ``backends`` into its
    :class:`~specdec.models.Pair` (sharing ``tokenizer``), as every command loads a model
    (:func:`specdec.models.load_model`), with room for ``n_ctx`` tokens (rounded up to a multiple of
    :data:`CONTEXT_STEP`); models already loaded with that much room are kept. A draft that is the
    target's file shares its weights (``fork``)."""
    n_ctx = CONTEXT_STEP * math.ceil(n_ctx / CONTEXT_STEP)
    if n_ctx > backends.n_ctx:
        backends.pairs.clear()
        backends.peers.clear()
        backends.n_ctx = n_ctx
    for backend, files in backends.ggufs.items():
        mine = [m for m in methods if m.backend == backend and not m.is_server]  # servers load their own
        if any(not m.is_peer for m in mine) and backend not in backends.pairs:
            target = load_model(files.target, backend, n_threads=backends.n_threads, n_ctx=backends.n_ctx)
            backends.pairs[backend] = Pair(target, tokenizer, target_name=files.target.name, backend=backend,
                                           backend_why="asked for")
        pair = backends.pairs.get(backend)
        if any(m.needs_draft_model for m in mine) and pair is not None and pair.draft is None:
            if files.draft is None:
                names = ", ".join(m.name for m in mine if m.needs_draft_model)
                raise ValueError(f"methods {names} need a draft model's GGUF; give one (--draft)")
            same = files.draft.path == files.target.path
            located = files.draft if backends.draft_quant is None or same else requantized_draft(
                files.draft, files.draft.name, backends.draft_quant, backend, files.target.name)
            pair.draft = pair.target.fork() if same else load_model(located, backend, n_threads=backends.n_threads,
                                                                    n_ctx=backends.n_ctx)
            pair.draft_quant = None if same else backends.draft_quant
            pair.draft_name, pair.draft_backend = files.draft.name, backend
            if backends.draft_vocab is not None:
                pair.draft, pair.draft_vocab = trim_draft(pair.draft, load_tokenizer(files.draft), backends.draft_vocab,
                                                          backend, name=files.draft.name, cache_dir=files.draft.cache_dir)


ENDPOINTS = ("completions", "chat")
# A server's warm-up chat: no timed prompt begins with it (a server keeps the prompt it saw last).
WARMUP_MESSAGES = ({"role": "user", "content": "Count from one to twenty in words."},)


@dataclass(frozen=True)
class BenchSettings:
    """Settings shared by all methods of one run (one temperature)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    repeats: int = 1
    warmup_tokens: int = 16  # per method, on the first prompt, before timing; 0: no warm-up
    seed: int = 0
    ignore_eos: bool = True  # True: every run makes exactly max_new_tokens tokens
    # How server methods get chat prompts: "completions" (token ids, neutral sampling fields) or
    # "chat" (the messages to /v1/chat/completions, an OpenAI client's default fields): bench/servers.py
    endpoint: str = "completions"

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class BenchRun:
    """Everything one run measured; :mod:`specdec.bench.report` turns it into figures."""

    settings: BenchSettings
    methods: list[MethodSpec]  # those that ran to the end
    skipped: dict[str, str]  # method -> why it cannot run at this temperature
    failed: dict[str, str]  # method -> the error that stopped it
    prompts: list[Prompt]
    prompt_tokens: list[int]
    samples: list[Sample]
    seconds: float = 0.0  # this invocation's, warm-up and timed runs
    divergences: list[dict[str, Any]] = field(default_factory=list)  # see find_divergences
    resumed: int = 0  # samples made by an earlier invocation (handed in as ``done``)


def schedule(methods: Sequence[MethodSpec], n_prompts: int, repeats: int) -> Iterator[tuple[int, int, MethodSpec]]:
    """The timed order: (repeat, prompt, method), methods interleaved within each prompt, their
    order turned by ``repeat + prompt`` places: over ``len(methods)`` repeats of a prompt each
    method runs once in each place."""
    for repeat in range(repeats):
        for prompt in range(n_prompts):
            turn = (repeat + prompt) % len(methods) if methods else 0
            for method in [*methods[turn:], *methods[:turn]]:
                yield repeat, prompt, method


def run_bench(
    pair: Pair,
    methods: Sequence[MethodSpec],
    prompts: Sequence[Prompt],
    settings: BenchSettings,
    backends: BenchBackends | None = None,
    *,
    progress: bool = True,
    done: Mapping[tuple[str, int, int], Sample] | None = None,
    on_sample: Callable[[Sample], None] | None = None,
) -> BenchRun:
    """Warm every method up, then time every (repeat, prompt, method) in :func:`schedule` order.

    ``backends``: the draft's weights and the llama.cpp models (default: int8, no llama.cpp).
    ``done``: runs already made, by (method name, prompt, repeat); they are taken as they are, and
    a method with none left to run is not warmed up. ``on_sample``: called with each new run as it
    ends (outside the timed region).

    One function (past 60 lines) because the warm-up, the timed loop and the failure record share
    ``attempt`` and its ``failed`` map, and the garbage collector is frozen around the timed loop
    only: split up, the pieces would hand that state back and forth.
    """
    if not prompts:
        raise ValueError("no prompts to run")
    backends = backends if backends is not None else BenchBackends()
    skipped = {m.name: why for m in methods if (why := m.runs_at(settings.temperature))}
    runnable = [m for m in methods if m.name not in skipped]
    check_models(pair, runnable, backends)
    ids = [p.token_ids(pair.tokenizer) for p in prompts]
    load_gguf_pairs(backends, runnable, context_needed([len(x) for x in ids], settings.max_new_tokens), pair.tokenizer)
    eos = [] if settings.ignore_eos else sorted(eos_token_ids_of(pair.target, pair.tokenizer))
    order = list(schedule(runnable, len(prompts), settings.repeats))
    planned = {(m.name, p, r) for r, p, m in order}
    done = {key: x for key, x in (done or {}).items() if key in planned}
    warm = [m for m in runnable if any(key[0] == m.name for key in planned - done.keys())]  # runs left
    total = len(warm) * (settings.warmup_tokens > 0) + len(order) - len(done)
    bar = _progress(total, f"T={settings.temperature:g}", progress)
    failed: dict[str, str] = {}

    def attempt(method: MethodSpec, prompt_ids: list[int], max_new_tokens: int, seed: int,
                messages: Sequence[dict[str, str]] = (), shape: Prompt | None = None) -> Sample | None:
        """One run (``shape``: the prompt whose JSON schema the output follows, if it has one); a
        method that raises is reported and left out from then on (ar may not fail)."""
        if method.name in failed:
            return None
        try:
            return run_method(method, pair, backends, prompt_ids, settings.temperature, max_new_tokens, eos, seed,
                              messages=messages if settings.endpoint == "chat" else (),
                              schema=shape.schema if shape else None, schema_name=shape.schema_name if shape else "",
                              prediction=shape.prediction if shape and method.prediction else None)
        except Exception as e:
            if method.kind == "ar":
                raise
            failed[method.name] = f"{type(e).__name__}: {e}"
            return None

    start = time.perf_counter()
    if settings.warmup_tokens > 0:
        for method in warm:
            bar.set_postfix_str(f"warm-up {method.name}")
            # A server keeps the prompt it saw last: warmed up on the first prompt, it would not
            # prefill that prompt's timed run. Its warm-up prompt is one no timed prompt begins with.
            prompt = ids[0][-WARMUP_SERVER_TOKENS:][::-1] if method.is_server else ids[0]
            attempt(method, prompt, min(settings.warmup_tokens, settings.max_new_tokens), settings.seed,
                    WARMUP_MESSAGES if prompts[0].chat else (), prompts[0])  # its schema, if any: warms the grammar
            bar.update()
    samples = []
    # Freeze what exists (models, libraries) out of the collector's sight, so the collection
    # before each run is quick and no collection during a run walks the whole heap.
    gc.collect()
    gc.freeze()
    try:
        for place, (repeat, p, method) in enumerate(order):
            if (method.name, p, repeat) in done:
                samples.append(done[method.name, p, repeat])
                continue
            bar.set_postfix_str(f"r{repeat} {prompts[p].id} {method.name}")
            seed = settings.seed + 7919 * repeat + p
            gc.collect()
            sample = attempt(method, ids[p], settings.max_new_tokens, seed, prompts[p].messages, prompts[p])
            if sample is not None:
                sample.prompt, sample.repeat, sample.order = p, repeat, place
                samples.append(sample)
                if on_sample is not None:
                    on_sample(sample)
            bar.update()
    finally:
        gc.unfreeze()
        bar.close()
    seconds = time.perf_counter() - start
    ran = [m for m in runnable if m.name not in failed]
    kept = [x for x in samples if x.method not in failed]
    explained = settings.greedy or any(_coupled(m) for m in ran)
    divergences = find_divergences(pair, backends, ran, kept, prompts, ids, settings, eos) if explained else []
    return BenchRun(settings, ran, skipped, failed, list(prompts), [len(x) for x in ids], kept, seconds,
                    divergences, resumed=sum(x.method not in failed for x in done.values()))


def find_divergences(pair: Pair, backends: BenchBackends, methods: Sequence[MethodSpec],
                     samples: Sequence[Sample], prompts: Sequence[Prompt], ids: Sequence[list[int]],
                     settings: BenchSettings, eos: list[int]) -> list[dict[str, Any]]:
    """For each (method, prompt) whose greedy output differs from its backend's ar (first such
    repeat), the :func:`~specdec.divergence.explain` record, after untimed replays of both
    runs with the target's logits recorded (a peer's own passes are not recorded), and whether
    the target's backend is batch invariant (:func:`~specdec.measurements.batch_invariance`).
    ``replayed`` tells whether each replay reproduced the timed run's tokens (or why it failed).
    At a temperature above 0, the coupled methods (Gumbel-max sampler), whose text is a function
    of the seed: each against the first coupled method of its backend (``base``), with the
    margins of the noised scores."""
    by_name = {m.name: m for m in methods}
    runs = {(s.method, s.prompt, s.repeat): s for s in samples}
    first_coupled = {}  # backend -> the first coupled method on it, the others' reference
    for m in methods:
        if _coupled(m):
            first_coupled.setdefault(m.backend, m.name)

    def base_of(s: Sample) -> Sample | None:
        method = by_name[s.method]
        if settings.greedy:
            return runs.get((method.ar.name, s.prompt, s.repeat))
        reference = first_coupled.get(method.backend) if _coupled(method) else None
        return runs.get((reference, s.prompt, s.repeat)) if reference != s.method else None

    pairs, seen = [], set()  # (sample, its reference sample): the first differing repeat of each (method, prompt)
    for s in samples:
        method, base = by_name[s.method], base_of(s)
        if method.kind == "ar" or base is None or s.token_ids == base.token_ids or (s.method, s.prompt) in seen:
            continue
        seen.add((s.method, s.prompt))
        pairs.append((s, base))
    keep: dict[tuple[str, int], set[int]] = {}  # (method, prompt) -> positions whose whole rows to keep
    for s, base in pairs:
        at = decisive_position(ids[s.prompt], s.token_ids, base.token_ids)
        for name in (s.method, base.method):
            keep.setdefault((name, s.prompt), set()).add(at)
    recorded: dict[tuple[str, int], tuple[LogitsRecorder | None, bool | str]] = {}

    def replay(method: MethodSpec, sample: Sample) -> tuple[LogitsRecorder | None, bool | str]:
        if (method.name, sample.prompt) not in recorded:
            recorders: list[LogitsRecorder] = []

            def wrap(backend: Any) -> LogitsRecorder:
                recorders.append(LogitsRecorder(backend, keep=keep[method.name, sample.prompt]))
                return recorders[-1]

            try:
                again = _run_project(method, pair, backends, ids[sample.prompt], settings.temperature,
                                     len(sample.token_ids), eos, sample.seed, wrap=wrap,
                                     schema=prompts[sample.prompt].schema)
                recorded[method.name, sample.prompt] = (recorders[0], again.token_ids == sample.token_ids)
            except Exception as e:  # the explanation is a diagnosis: its failure must not stop the run
                recorded[method.name, sample.prompt] = (None, f"{type(e).__name__}: {e}")
        return recorded[method.name, sample.prompt]

    out = []
    for s, base in pairs:
        method = by_name[s.method]
        ar_recorder, ar_same = replay(by_name[base.method], base)
        recorder, same = (None, None) if method.is_peer else replay(method, s)
        backend = next((r.backend for r in (recorder, ar_recorder) if r is not None), None)
        try:
            invariance = batch_invariance(backend) if backend is not None else None
        except Exception:  # a diagnosis: an unmeasurable backend leaves the question open
            invariance = None
        gumbel = None if settings.greedy else SamplingConfig(settings.temperature, gumbel_seed=s.seed)
        found = explain(ids[s.prompt], s.token_ids, base.token_ids, recorder, ar_recorder, invariance, gumbel)
        texts = {f"{key}_text": pair.tokenizer.decode([getattr(found, key)])
                 for key in ("token", "ar_token") if getattr(found, key) is not None}
        # where the run ignores the end, ar samples an end-of-generation token and goes on, while a peer
        # asked to ignore the end (llama-server's ignore_eos) never samples one: not a rounding question
        ends = bool(method.is_peer and settings.ignore_eos
                    and found.ar_token in eos_token_ids_of(pair.target, pair.tokenizer))
        out.append({"method": s.method, "base": base.method, "prompt": s.prompt, "prompt_id": prompts[s.prompt].id,
                    "repeat": s.repeat, "replayed": {"ar": ar_same, "method": same}, "ar_token_ends": ends}
                   | found.to_dict() | texts)
    return out


def _coupled(method: MethodSpec) -> bool:
    """A project method under the Gumbel-max sampler: its text is a function of the seed."""
    return method.kind == "spec" and not method.is_peer and not method.is_server and method.config.gumbel


def check_models(pair: Pair, methods: Sequence[MethodSpec], backends: BenchBackends) -> None:
    """Each method's models are there, else a ValueError naming the methods and what to give."""
    on_torch = [m for m in methods if not BY_NAME[m.backend].runs_gguf]
    if on_torch and pair.target is None:
        raise ValueError(f"methods {', '.join(m.name for m in on_torch)} run on torch; load the target's weights")
    if any(m.needs_draft_model for m in on_torch) and pair.draft is None:
        names = ", ".join(m.name for m in on_torch if m.needs_draft_model)
        raise ValueError(f"methods {names} need a draft model; give one (--draft)")
    for backend in dict.fromkeys(m.backend for m in methods if BY_NAME[m.backend].runs_gguf and not m.is_server):
        if backend not in backends.ggufs:
            names = ", ".join(m.name for m in methods if m.backend == backend and not m.is_server)
            raise ValueError(f"methods {names} run on {LABELS[backend]} and need the target's GGUF; give a pack or "
                             "a .gguf file as the target")


def run_method(
    method: MethodSpec, pair: Pair, backends: BenchBackends, prompt_ids: list[int], temperature: float,
    max_new_tokens: int, eos: list[int], seed: int, messages: Sequence[dict[str, str]] = (),
    schema: dict[str, Any] | None = None, schema_name: str = "", prediction: str | None = None,
) -> Sample:
    """One timed generation; the returned sample's prompt/repeat/order are left at 0. messages: a
    server method sends these to the chat endpoint instead of ``prompt_ids`` (bench/servers.py).
    schema: the JSON schema the output follows (a server gets it with the request, the project's
    methods as :class:`~specdec.constraints.Constraints`; a library peer cannot follow one).
    prediction: the predicted output a server method sends with the request."""
    if method.is_server:
        if backends.servers is None:
            raise ValueError(f"{method.name} runs through a server; the run has none (BenchBackends.servers)")
        config = None if method.is_peer else str(method.config)
        return run_server(backends.servers, server_key(method), method.name, prompt_ids, temperature, max_new_tokens, eos, seed,
                          method=config, messages=messages,
                          tokenize=lambda text: list(pair.tokenizer(text, add_special_tokens=False)["input_ids"]),
                          schema=schema, schema_name=schema_name or "output", prediction=prediction,
                          end_of_turn=end_of_turn_token(pair.tokenizer, eos) if messages else None)
    if method.is_peer:
        if schema is not None:
            raise ValueError(f"{method.name} cannot constrain its output to a JSON schema")
        return run_peer(method, pair, backends.peer, prompt_ids, temperature, max_new_tokens, eos, seed)
    sample = _run_project(method, pair, backends, prompt_ids, temperature, max_new_tokens, eos, seed, schema=schema)
    if schema is not None:  # after the timed run: the tokens' own text (no clean-up rewriting its spaces)
        checked = check_output(decode_text(pair.tokenizer, sample.token_ids), schema)
        sample.json_parsed, sample.schema_valid = checked.parsed, checked.valid
    return sample


# ------------------------------------------------------------------------------------------
# The project's methods


def _run_project(method, pair, backends, prompt_ids, temperature, max_new_tokens, eos, seed,
                 wrap: Callable[[Any], Any] | None = None, schema: dict[str, Any] | None = None) -> Sample:
    """One run through :func:`specdec.stream`; ``wrap`` (untimed replays only) wraps the target's
    backend before the drafter is built on it; ``schema``: the JSON schema the output follows."""
    config = method.config.replace(temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                   seed=seed, eos_token_ids=eos, draft_weights=backends.draft_weights)
    start = time.perf_counter()
    # a GGUF backend's pair is loaded once: its caches are emptied (specdec.build does) so no run reuses an earlier prefix
    models = {TORCH: pair, **backends.pairs}[method.backend]
    target, draft = models.target, models.draft
    if not method.needs_draft_model:
        draft = None
    if wrap is not None:  # the recorder wraps the backend the drafter runs on
        target = wrap(builder.target_backend(config.drafter, target))
    tokens: list[int] = []
    drafted, accepted, draft_s, verify_s = [], [], [], []
    stats = None
    first: tuple[float, int] | None = None  # (seconds, tokens) of the first step
    shaped = {} if schema is None else {"constraints": Constraints(json_schema=schema), "tokenizer": pair.tokenizer}
    for event in specdec.stream(target, prompt_ids, draft=draft, config=config, **shaped):
        if first is None:
            first = (time.perf_counter() - start, len(event.token_ids))
        stats = event.stats  # cumulative; the per-step figures are its increments
        tokens += event.token_ids
        accepted.append(sum(event.from_draft))
        drafted.append(stats.drafted_tokens)
        draft_s.append(stats.draft_seconds)
        verify_s.append(stats.verify_seconds)
    seconds = time.perf_counter() - start
    drafted, draft_s, verify_s = _increments(drafted), _increments(draft_s), _increments(verify_s)
    per_token = [s / n for s, n in zip(draft_s[1:], drafted[1:]) if n > 0]
    return Sample(
        method=method.name, prompt=0, repeat=0, order=0, seed=seed, token_ids=tokens,
        seconds=seconds, target_forwards=stats.target_forwards if stats else 0,
        step_drafted=drafted if method.kind == "spec" else [],
        step_accepted=accepted if method.kind == "spec" else [],
        draft_seconds=sum(draft_s), verify_seconds=sum(verify_s),
        draft_token_seconds=_median(per_token), step_seconds=_median(verify_s[1:]),
        first_step_seconds=first[0] if first else None, first_step_tokens=first[1] if first else None,
        forced_tokens=stats.forced_tokens if stats else 0,
    )


def _increments(cumulative: list) -> list:
    return [b - a for a, b in zip([0, *cumulative], cumulative)]


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, dynamic_ncols=True)
