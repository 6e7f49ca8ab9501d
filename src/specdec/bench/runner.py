"""Run benchmark methods on prompts: warm-up, interleaved order, repeats, timing.

Every method sees the same loaded models, prompt tokens, sampling settings, token budget and EOS
handling. Runs are interleaved prompt by prompt (for each repeat, for each prompt: A, B, C, ...)
so that drift in the machine's speed falls on all methods alike.

Project methods run through :func:`specdec.stream` with token ids (no tokenizer, so no decoding
cost inside the timed region); peers run through transformers' ``model.generate``. Each run's
wall time covers the whole call, prefill included. Forward hooks on the peers' models count target
forwards and recover, from the cache length each forward starts at, how many tokens each
forward drafted and kept -- so peers get the same per-step figures as the project's methods.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import torch

import specdec
from specdec.api import eos_token_ids_of
from specdec.backends.lean import make_backend
from specdec.bench.methods import PROMPT_LOOKUP_K, MethodSpec
from specdec.bench.prompts import Prompt
from specdec.drafters import Drafter, make_drafter, target_backend
from specdec.policies import make_policy


@dataclass
class BenchModels:
    """The loaded models every method shares. ``draft`` is needed by draft-model methods only."""

    target: Any
    tokenizer: Any
    draft: Any = None
    target_name: str = "target"
    draft_name: str | None = None
    draft_weights: str = "int8"  # how draft-model methods run the draft (``make_backend(weights=...)``)


@dataclass(frozen=True)
class BenchSettings:
    """Settings shared by all methods of one run (one temperature)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    repeats: int = 1
    warmup_tokens: int = 16  # per method, on the first prompt, before timing; 0: no warm-up
    seed: int = 0
    ignore_eos: bool = True  # True: every run makes exactly max_new_tokens tokens

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Sample:
    """One timed run of one method on one prompt.

    step_drafted[i] / step_accepted[i]: draft tokens proposed / kept at target forward i (empty
    when unknown). draft_token_seconds: median time to draft one token (steps after the first);
    step_seconds: median time of one target step after the first (the prefill).
    first_step_seconds / first_step_tokens: wall time from the start to the end of the first
    target forward (the prompt's prefill in every model, and the first step's drafting) and the
    tokens that step produced; the rest of the run is the decoding that speculation speeds up.
    """

    method: str
    prompt: int
    repeat: int
    order: int
    seed: int
    token_ids: list[int]
    seconds: float
    target_forwards: int
    step_drafted: list[int] = field(default_factory=list)
    step_accepted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_token_seconds: float | None = None
    step_seconds: float | None = None
    first_step_seconds: float | None = None
    first_step_tokens: int | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"new_tokens": self.new_tokens}


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
    seconds: float = 0.0


def schedule(methods: Sequence[MethodSpec], n_prompts: int, repeats: int) -> Iterator[tuple[int, int, MethodSpec]]:
    """The timed order: (repeat, prompt, method), methods interleaved within each prompt."""
    for repeat in range(repeats):
        for prompt in range(n_prompts):
            for method in methods:
                yield repeat, prompt, method


def run_bench(
    models: BenchModels,
    methods: Sequence[MethodSpec],
    prompts: Sequence[Prompt],
    settings: BenchSettings,
    *,
    progress: bool = True,
) -> BenchRun:
    """Warm every method up, then time every (repeat, prompt, method) in :func:`schedule` order."""
    if not prompts:
        raise ValueError("no prompts to run")
    skipped = {m.name: why for m in methods if (why := m.runs_at(settings.temperature))}
    runnable = [m for m in methods if m.name not in skipped]
    if any(m.needs_draft_model for m in runnable) and models.draft is None:
        names = ", ".join(m.name for m in runnable if m.needs_draft_model)
        raise ValueError(f"methods {names} need a draft model; give one (--draft)")
    ids = [p.token_ids(models.tokenizer) for p in prompts]
    eos = [] if settings.ignore_eos else sorted(eos_token_ids_of(models.target, models.tokenizer))
    total = len(runnable) * (settings.warmup_tokens > 0) + settings.repeats * len(prompts) * len(runnable)
    bar = _progress(total, f"T={settings.temperature:g}", progress)
    failed: dict[str, str] = {}

    def attempt(method: MethodSpec, prompt_ids: list[int], max_new_tokens: int, seed: int) -> Sample | None:
        """One run; a method that raises is reported and left out from then on (ar may not fail)."""
        if method.name in failed:
            return None
        try:
            return run_method(method, models, prompt_ids, settings.temperature, max_new_tokens, eos, seed)
        except Exception as e:
            if method.kind == "ar":
                raise
            failed[method.name] = f"{type(e).__name__}: {e}"
            return None

    start = time.perf_counter()
    if settings.warmup_tokens > 0:
        for method in runnable:
            bar.set_postfix_str(f"warm-up {method.name}")
            attempt(method, ids[0], min(settings.warmup_tokens, settings.max_new_tokens), settings.seed)
            bar.update()
    samples = []
    # Freeze what exists (models, libraries) out of the collector's sight, so the collection
    # before each run is quick and no collection during a run walks the whole heap.
    gc.collect()
    gc.freeze()
    try:
        for order, (repeat, p, method) in enumerate(schedule(runnable, len(prompts), settings.repeats)):
            bar.set_postfix_str(f"r{repeat} {prompts[p].id} {method.name}")
            seed = settings.seed + 7919 * repeat + p
            gc.collect()
            sample = attempt(method, ids[p], settings.max_new_tokens, seed)
            if sample is not None:
                sample.prompt, sample.repeat, sample.order = p, repeat, order
                samples.append(sample)
            bar.update()
    finally:
        gc.unfreeze()
        bar.close()
    ran = [m for m in runnable if m.name not in failed]
    kept = [x for x in samples if x.method not in failed]
    return BenchRun(settings, ran, skipped, failed, list(prompts), [len(x) for x in ids], kept,
                    time.perf_counter() - start)


def run_method(
    method: MethodSpec, models: BenchModels, prompt_ids: list[int], temperature: float,
    max_new_tokens: int, eos: list[int], seed: int,
) -> Sample:
    """One timed generation; the returned sample's prompt/repeat/order are left at 0."""
    if method.is_peer:
        return _run_peer(method, models, prompt_ids, temperature, max_new_tokens, eos, seed)
    return _run_project(method, models, prompt_ids, temperature, max_new_tokens, eos, seed)


# ------------------------------------------------------------------------------------------
# The project's methods


def _run_project(method, models, prompt_ids, temperature, max_new_tokens, eos, seed) -> Sample:
    kwargs: dict[str, Any] = dict(
        temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
        seed=seed, eos_token_ids=eos,
    )
    start = time.perf_counter()
    target = models.target
    if method.kind == "spec":
        target, kwargs["drafter"] = _build_drafter(method, models)
        kwargs.update(verify=method.verifier, k=method.k)
        if method.is_tree:
            kwargs["tree"] = method.tree_options
        else:
            kwargs["policy"] = make_policy(method.policy, method.k, **method.policy_options)
    tokens: list[int] = []
    drafted, accepted, draft_s, verify_s = [], [], [], []
    stats = None
    first: tuple[float, int] | None = None  # (seconds, tokens) of the first step
    for event in specdec.stream(target, prompt_ids, **kwargs):
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
    )


def _build_drafter(method: MethodSpec, models: BenchModels) -> tuple[Any, Drafter]:
    """(target backend, drafter) for a spec method: fresh caches, built as the API builds them;
    drafters that run part of the target get the layered backend."""
    target = target_backend(method.drafter, models.target)
    draft = make_backend(models.draft, weights=models.draft_weights) if method.drafter == "model" else None
    return target, make_drafter(method.drafter, target, draft, **method.drafter_options)


def _increments(cumulative: list) -> list:
    return [b - a for a, b in zip([0, *cumulative], cumulative)]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


# ------------------------------------------------------------------------------------------
# Peers: transformers' generate


def _run_peer(method, models, prompt_ids, temperature, max_new_tokens, eos, seed) -> Sample:
    from transformers import GenerationConfig

    greedy = temperature == 0.0
    target, assistant = models.target, None
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=temperature if not greedy else 1.0,
        top_k=0 if not greedy else None,
        top_p=1.0,
        # transformers' prompt lookup needs some EOS id: with EOS ignored, give one past the
        # vocabulary, which no model can produce.
        eos_token_id=eos or [_vocab_size(target)],
        pad_token_id=eos[0] if eos else _pad_id(models),
    )
    kwargs: dict[str, Any] = {}
    assistant_config = None
    if method.kind == "hf-assisted":
        assistant = models.draft
        assistant_config = GenerationConfig()  # transformers' defaults, fresh for every run
        if method.k is not None:
            assistant_config.num_assistant_tokens = method.k
        kwargs["assistant_model"] = assistant
    elif method.kind == "hf-prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = method.k or PROMPT_LOOKUP_K
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.device)
    target_calls: list[tuple[int, int, float]] = []
    draft_calls: list[tuple[int, int, float]] = []
    target_ends: list[float] = []  # perf_counter at the end of each target forward
    with _generation_config(target, config), _generation_config(assistant, assistant_config), \
            _forward_timer(target, target_calls, target_ends), _forward_timer(assistant, draft_calls):
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        seconds = time.perf_counter() - start
    tokens = out[0, len(prompt_ids):].tolist()
    drafted, accepted = _steps_from_forwards(target_calls, len(prompt_ids), len(tokens))
    tokens = tokens[:max_new_tokens]  # prompt lookup can overshoot by part of its last step
    if method.kind == "hf-ar":
        drafted, accepted = [], []
    target_times = [t for _, _, t in target_calls]
    return Sample(
        method=method.name, prompt=0, repeat=0, order=0, seed=seed, token_ids=tokens,
        seconds=seconds, target_forwards=len(target_calls),
        step_drafted=drafted, step_accepted=accepted,
        draft_seconds=sum(t for _, _, t in draft_calls), verify_seconds=sum(target_times),
        draft_token_seconds=_median([t for _, _, t in draft_calls[1:]]),
        step_seconds=_median(target_times[1:]),
        first_step_seconds=target_ends[0] - start if target_ends else None,
        first_step_tokens=min(len(tokens), 1 + (accepted[0] if accepted else 0)) if target_ends else None,
    )


def _vocab_size(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _pad_id(models: BenchModels) -> int:
    pad = getattr(models.tokenizer, "pad_token_id", None)
    return pad if isinstance(pad, int) else 0


def _steps_from_forwards(calls: list[tuple[int, int, float]], prompt_len: int, new_tokens: int) -> tuple[list[int], list[int]]:
    """Per target forward (start position, tokens fed): draft tokens proposed and kept.

    transformers keeps every output token but the newest in the target's cache, so forward i
    starts at s_i = C_i - 1, where C_i is the output length before it (C_0 is the prompt length and
    the first forward starts at 0). It feeds the C_i - s_i uncached tokens and then the drafts,
    and the kept drafts are what the output grew by, minus the one token the target adds.
    Returns empty lists if the forwards do not fit this pattern.
    """
    drafted, accepted = [], []
    context = prompt_len
    for i, (start, fed, _) in enumerate(calls):
        following = calls[i + 1][0] + 1 if i + 1 < len(calls) else prompt_len + new_tokens
        n = fed - (context - start)
        a = following - context - 1
        if n < 0 or not 0 <= a <= n:
            return [], []
        drafted.append(n)
        accepted.append(a)
        context = following
    return drafted, accepted


@contextlib.contextmanager
def _generation_config(model: Any, config: Any) -> Iterator[None]:
    """Give ``model`` exactly ``config`` for one call, so nothing from its saved defaults (or
    state transformers mutates during assisted generation) leaks between runs."""
    if model is None or config is None:
        yield
        return
    saved = model.generation_config
    model.generation_config = copy.deepcopy(config)
    try:
        yield
    finally:
        model.generation_config = saved


@contextlib.contextmanager
def _forward_timer(model: Any, calls: list[tuple[int, int, float]], ends: list[float] | None = None) -> Iterator[None]:
    """Record (cache length at start, tokens fed, seconds) for each forward of ``model``, and in
    ``ends`` the ``perf_counter`` at the end of each."""
    if model is None:
        yield
        return
    started: list[tuple[int, int, float]] = []

    def before(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        fed = int(ids.shape[-1]) if ids is not None else 0
        position = kwargs.get("cache_position")
        if position is not None and position.numel():
            cached = int(position[0])
        else:
            cache = kwargs.get("past_key_values")
            cached = int(cache.get_seq_length()) if cache is not None else 0
        started.append((cached, fed, time.perf_counter()))

    def after(module, args, kwargs, output):
        cached, fed, t0 = started.pop()
        end = time.perf_counter()
        calls.append((cached, fed, end - t0))
        if ends is not None:
            ends.append(end)

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, dynamic_ncols=True)
