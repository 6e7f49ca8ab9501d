"""The peers: other libraries' own generation on the same models, prompts and settings.

transformers' ``generate`` (plain, with an assistant model, with prompt lookup) on the torch
models, and the llama.cpp binding's own model on the target's GGUF (``llamacpp-ar``). Each run's
wall time covers the whole call, prefill included, as for the project's methods. Hooks on the
target's forward (transformers) count target forwards and recover, from the cache length each
forward starts at, how many tokens each forward drafted and kept -- so peers get the same per-step
figures as the project's methods.
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from specdec.backends.llamacpp import DEFAULT_BATCH
from specdec.bench.methods import PEERS, MethodSpec
from specdec.bench.sample import Sample, median as _median
from specdec.models import Pair


def run_peer(method: MethodSpec, pair: Pair, llamacpp_peer: Callable[[MethodSpec], Any], prompt_ids: list[int],
             temperature: float, max_new_tokens: int, eos: list[int], seed: int) -> Sample:
    """One timed generation by a peer: transformers' on the ``pair``'s models, ``llamacpp-ar`` on
    the binding's own model of the target's GGUF (``llamacpp_peer(method)``, :func:`load_llamacpp_peer`)."""
    if PEERS[method.kind].tool == "llama-cpp-python":
        return _run_llamacpp_peer(method, llamacpp_peer(method), prompt_ids, temperature, max_new_tokens, eos, seed)
    return _run_hf_peer(method, pair, prompt_ids, temperature, max_new_tokens, eos, seed)


# ------------------------------------------------------------------------------------------
# transformers' generate



def _run_hf_peer(method, pair, prompt_ids, temperature, max_new_tokens, eos, seed) -> Any:
    from transformers import GenerationConfig

    greedy = temperature == 0.0
    target, assistant = pair.target, None
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=temperature if not greedy else 1.0,
        top_k=0 if not greedy else None,
        top_p=1.0,
        # transformers' prompt lookup needs some EOS id: with EOS ignored, give one past the
        # vocabulary, which no model can produce.
        eos_token_id=eos or [_vocab_size(target)],
        pad_token_id=eos[0] if eos else _pad_id(pair),
    )
    k = method.k or PEERS[method.kind].default_k  # None: transformers' own default
    kwargs: dict[str, Any] = {}
    assistant_config = None
    if method.kind == "hf-assisted":
        assistant = pair.draft
        assistant_config = GenerationConfig()  # transformers' defaults, fresh for every run
        if k is not None:
            assistant_config.num_assistant_tokens = k
        kwargs["assistant_model"] = assistant
    elif method.kind == "hf-prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = k
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
    if PEERS[method.kind].drafter is None:  # plain decoding: no draft steps
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


def _pad_id(pair: Pair) -> int:
    pad = getattr(pair.tokenizer, "pad_token_id", None)
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


# ------------------------------------------------------------------------------------------
# The llama.cpp binding's own model


def load_llamacpp_peer(path: str | Path, n_ctx: int, n_threads: int | None) -> Any:
    """The binding's own ``llama_cpp.Llama`` on the GGUF ``path``, for the ``llamacpp-*`` peers, with
    room for ``n_ctx`` tokens on ``n_threads`` threads (None: the binding's default).

    The binding's own settings (flash attention off, repacked weights for every pass) with the
    backend's prefill batch: a context of at least DEFAULT_BATCH tokens, since the binding batches
    its prefill by min(n_ctx, 512). The backend leaves flash attention to llama.cpp (on for the CPU)
    and prefills long prompts on the file's layout where that is faster
    (specdec.backends.llamacpp.choose_prefill_layout), so near-ties can round apart."""
    from llama_cpp import Llama  # the optional binding: imported when a peer first runs

    return Llama(str(path), n_ctx=max(n_ctx, DEFAULT_BATCH), n_threads=n_threads or None,
                 n_threads_batch=n_threads or None, n_batch=DEFAULT_BATCH, flash_attn=False, verbose=False)


def _run_llamacpp_peer(method, llm, prompt_ids, temperature, max_new_tokens, eos, seed) -> Sample:
    """``llamacpp-ar``: llama-cpp-python's own ``Llama.generate`` (``llm``) on the target's GGUF, the
    same binding and llama.cpp build the backend runs. Its sampler chain is set to plain sampling
    (greedy at temperature 0, else softmax(logits / T) with top-k, top-p, min-p, typical and the
    repetition penalty switched off), seeded with ``seed``. The cache is emptied first, so the
    prompt is prefilled every time (no prefix reuse between repeats)."""
    llm.set_seed(seed if seed is not None else 0)
    llm.reset()
    tokens: list[int] = []
    step_times: list[float] = []
    start = last = time.perf_counter()
    first = None
    for token in llm.generate(list(prompt_ids), temp=temperature, top_k=0, top_p=1.0, min_p=0.0,
                              typical_p=1.0, repeat_penalty=1.0, reset=True):
        now = time.perf_counter()
        if first is None:
            first = now  # the prefill and the first token
        else:
            step_times.append(now - last)
        last = now
        tokens.append(int(token))
        if len(tokens) >= max_new_tokens or tokens[-1] in eos:
            break
    seconds = time.perf_counter() - start
    first = first if first is not None else last
    return Sample(
        method=method.name, prompt=0, repeat=0, order=0, seed=seed, token_ids=tokens,
        seconds=seconds, target_forwards=len(tokens), verify_seconds=seconds,
        step_seconds=_median(step_times), first_step_seconds=first - start, first_step_tokens=1,
    )


