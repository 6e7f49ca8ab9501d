"""The offline tuner for the layer-skip drafter: which layers to skip for a model.

:func:`search_skip_set` runs on a few calibration prompts: a greedy search grows the skip set one
layer at a time, guided by how often the skipping model's greedy token agrees with the target's,
then measures the real speed-up of the best few sets with the engine and keeps the fastest.
:func:`search_and_save` stores the result where
:class:`~specdec.drafters.layer_skip.LayerSkipDrafter` finds it
(:func:`~specdec.drafters.layer_skip.save_skip_set`). Nothing here runs while decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.drafters.layer_skip import LayerSkipDrafter, save_skip_set
from specdec.engine import autoregressive_steps, speculative_steps
from specdec.paths import model_key
from specdec.policies import StaticK
from specdec.sampling import SamplingConfig
from specdec.theory import expected_speedup, optimal_k
from specdec.verify import make_verifier

# A few short calibration prompts (code and prose) for the search when none are given.
CALIBRATION_PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import numpy as np\n\ndef normalize(x):\n    \"\"\"Scale each row of x to unit length.\"\"\"\n",
    "Explain in a few sentences why the sky is blue.\n",
    "Write a short email to a colleague asking to move our meeting to Friday.\n",
)


@dataclass
class SkipSearchResult:
    """The chosen skip set and how it was measured (greedy decoding, calibration prompts).

    speedup: autoregressive seconds / speculative seconds for the same tokens; alpha: accepted /
    drafted tokens; k: the static draft length used; path: every set tried, in order, with its
    agreement (the first draft token's greedy agreement with the target), predicted and measured
    speed-up.
    """

    model: str
    skip: list[int]
    speedup: float
    alpha: float
    k: int
    num_layers: int
    seconds: float
    path: list[dict[str, Any]] = field(default_factory=list)


def search_skip_set(
    target: Any,
    prompts: Sequence[Sequence[int]],
    *,
    time_budget: float = 300.0,
    new_tokens: int = 32,
    candidates_per_round: int = 6,
    measure_top: int = 3,
    k_max: int = 8,
    log: Callable[[str], None] | None = None,
) -> SkipSearchResult:
    """Find the skip set with the best measured greedy speed-up on ``prompts`` (token ids).

    1. Decode ``new_tokens`` greedily with the full target (the reference and the baseline time).
    2. Grow a skip set one layer per round (:func:`_grow`). Each round tries the
       ``candidates_per_round`` layers whose output changes the hidden state least (1 - cosine,
       measured once) and keeps the one whose first draft token agrees most often with the
       target's next token on the reference text, drafted as the engine drafts it: over the full
       model's cache of the context (:class:`_ContextKV`, all positions in one pass per set).
    3. Predict each set's speed-up from Leviathan et al. (2023)'s formula (alpha = that
       agreement, c = the share of the weights it reads per token), measure the ``measure_top``
       best with the engine (greedy verification, static k = the predicted optimum), each beside
       a fresh timing of the baseline (:func:`_measure`), and keep the fastest.

    ``time_budget`` (seconds) bounds the whole search: step 2 stops at 60% of it, step 3 measures
    as many sets as fit. ``log`` receives progress lines.
    """
    say = log or (lambda _: None)
    began = time.perf_counter()
    backend = target if isinstance(target, HFLayeredCausalLM) else HFLayeredCausalLM(target)
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("the search needs at least one non-empty calibration prompt")
    ar_seconds, references, _, _ = _decode(backend, prompts, new_tokens)
    say(f"autoregressive: {ar_seconds:.1f} s for {sum(map(len, references))} tokens")
    deadline = began + 0.6 * time_budget
    path = _grow(backend, prompts, references, candidates_per_round, k_max, deadline, say)
    if not path:
        raise ValueError("the time budget ran out before any skip set was tried; give more time")
    chosen = _measure(backend, prompts, new_tokens, path, measure_top, began + time_budget, ar_seconds, say)
    backend.reset()
    return SkipSearchResult(
        model=model_key(backend.model),
        skip=chosen["skip"],
        speedup=chosen["measured"],
        alpha=chosen["alpha"],
        k=chosen["k"],
        num_layers=backend.num_layers,
        seconds=time.perf_counter() - began,
        path=path,
    )


def _decode(
    backend: HFLayeredCausalLM, prompts: list[list[int]], new_tokens: int, drafter: Any = None, k: int = 1
) -> tuple[float, list[list[int]], int, int]:
    """Greedy decoding of every prompt, autoregressive or with ``drafter``: (seconds, outputs,
    drafted, accepted)."""
    greedy = SamplingConfig()
    seconds, outs, drafted, accepted = 0.0, [], 0, 0
    for p in prompts:
        backend.reset()
        t0 = time.perf_counter()
        if drafter is None:
            steps = autoregressive_steps(backend, p, sampling=greedy, max_new_tokens=new_tokens)
        else:
            steps = speculative_steps(backend, drafter, make_verifier("greedy"), StaticK(k), p,
                                      sampling=greedy, max_new_tokens=new_tokens)
        out: list[int] = []
        for step in steps:
            out += step.tokens
            drafted += step.drafted
            accepted += step.accepted
        seconds += time.perf_counter() - t0
        outs.append(out)
    return seconds, outs, drafted, accepted


def _grow(
    backend: HFLayeredCausalLM, prompts: list[list[int]], references: list[list[int]],
    candidates_per_round: int, k_max: int, deadline: float, say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Step 2 of :func:`search_skip_set`: every skip set tried, with its agreement and prediction."""
    n = backend.num_layers
    texts = [p + r for p, r in zip(prompts, references)]
    contexts = [_ContextKV.of(backend.model, seq) for seq in texts]

    def agreement(skip: set[int]) -> float:
        layers = [i for i in range(n) if i not in skip]
        hits = total = 0
        for p, r, seq, kv in zip(prompts, references, texts, contexts):
            if r:
                guess = kv.first_draft_logits(backend, seq, layers, len(p) - 1)[:-1].argmax(-1)  # [len(r)]
                hits += int((guess == torch.tensor(r)).sum())
                total += len(r)
        return hits / total if total else 0.0

    cost = _cost_model(backend)
    order = _layer_order(backend, texts)
    skip: set[int] = set()
    path: list[dict[str, Any]] = []
    while len(skip) < n - 1 and time.perf_counter() < deadline:
        scored = []
        for i in [i for i in order if i not in skip][:candidates_per_round]:
            scored.append((agreement(skip | {i}), i))
            if time.perf_counter() > deadline:
                break
        best_agreement, best = max(scored)
        skip = skip | {best}
        c = cost(skip)
        k = optimal_k(best_agreement, c, k_max)
        predicted = expected_speedup(min(best_agreement, 0.999), k, c)
        path.append({"skip": sorted(skip), "agreement": best_agreement, "c": c, "k": k, "predicted": predicted})
        say(f"skip {sorted(skip)}: agreement {best_agreement:.2f}, predicted speed-up {predicted:.2f}")
        if best_agreement < 0.2:
            break
    return path


def _measure(
    backend: HFLayeredCausalLM, prompts: list[list[int]], new_tokens: int, path: list[dict[str, Any]],
    measure_top: int, deadline: float, ar_seconds: float, say: Callable[[str], None],
) -> dict[str, Any]:
    """Step 3 of :func:`search_skip_set`: time the best predicted sets; the fastest entry of ``path``."""
    chosen: dict[str, Any] | None = None
    for entry in sorted(path, key=lambda e: -e["predicted"])[:measure_top]:
        if chosen is not None and time.perf_counter() + 2.4 * ar_seconds > deadline:
            break
        # Time the baseline again right beside each set: a shared machine's speed drifts.
        baseline, _, _, _ = _decode(backend, prompts, new_tokens)
        drafter = LayerSkipDrafter(backend, entry["skip"])
        seconds, _, drafted, accepted = _decode(backend, prompts, new_tokens, drafter, entry["k"])
        entry["measured"] = baseline / seconds if seconds > 0 else 0.0
        entry["alpha"] = accepted / drafted if drafted else 0.0
        say(f"measured skip {entry['skip']} k={entry['k']}: speed-up {entry['measured']:.2f}, alpha {entry['alpha']:.2f}")
        if chosen is None or entry["measured"] > chosen["measured"]:
            chosen = entry
    assert chosen is not None
    return chosen


def search_and_save(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str] = CALIBRATION_PROMPTS,
    **options: Any,
) -> tuple[SkipSearchResult, Path]:
    """Run :func:`search_skip_set` on text prompts and save the result for this model."""
    ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    result = search_skip_set(model, ids, **options)
    return result, save_skip_set(model, result)


class _ContextKV:
    """The full model's keys and values for a whole calibration text, to score skip sets with.

    :meth:`first_draft_logits` gives, at every position t at once, the skipping model's logits
    for token t + 1 when it drafts there as the engine makes it: attending to the full
    model's entries for positions < t and to its own for t. That is the first draft token of a
    step, whose agreement with the target is the acceptance rate alpha under greedy decoding.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values

    @classmethod
    @torch.inference_mode()
    def of(cls, model: Any, seq: Sequence[int]) -> "_ContextKV":
        from transformers import DynamicCache

        cache = DynamicCache()
        model(torch.tensor([list(seq)], device=model.device), past_key_values=cache, use_cache=True)
        return cls([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])

    def update(self, keys, values, layer_idx, cache_kwargs=None):  # the part of Cache attention uses
        return (
            torch.cat([self.keys[layer_idx], keys], dim=-2),
            torch.cat([self.values[layer_idx], values], dim=-2),
        )

    @torch.inference_mode()
    def first_draft_logits(
        self, backend: HFLayeredCausalLM, seq: Sequence[int], layers: list[int], start: int = 0
    ) -> torch.Tensor:
        """Logits [len(seq) - start, V]: the skipping model's first draft at positions start.., each
        over the full model's entries for the positions before it (one drafting point does not
        see another's entries, so they are computed side by side). ``seq``: the text these
        entries were made from."""
        base = backend.model.model
        total = len(seq)
        device = backend.device
        hidden = base.embed_tokens(torch.tensor([list(seq[start:])], device=device))  # [1, q, H]
        t = torch.arange(start, total, device=device)  # [q]
        cos_sin = base.rotary_emb(hidden, t[None])
        # query t sees the full model's keys j < t and its own key: [q, total + q]
        allowed = torch.cat(
            [torch.arange(total, device=device)[None, :] < t[:, None], torch.eye(len(t), dtype=torch.bool)],
            dim=1,
        )
        if backend.model.config._attn_implementation == "sdpa":
            mask = allowed[None, None]
        else:
            mask = torch.zeros(allowed.shape, dtype=hidden.dtype).masked_fill_(
                ~allowed, torch.finfo(hidden.dtype).min
            )[None, None]
        for i in layers:
            hidden = backend._layers[i](
                hidden, attention_mask=mask, position_ids=t[None], past_key_values=self,
                use_cache=True, cache_position=t, position_embeddings=cos_sin,
            )
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        return backend.model.lm_head(base.norm(hidden))[0]  # [q, V]


def _cost_model(backend: HFLayeredCausalLM) -> Callable[[set[int]], float]:
    """c(skip): the share of a token's weight reads the skipping model does (layers + LM head)."""
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in backend._layers]
    head = backend.model.lm_head.weight.numel()
    full = sum(per_layer) + head
    return lambda skip: (full - sum(per_layer[i] for i in skip)) / full


@torch.inference_mode()
def _layer_order(backend: HFLayeredCausalLM, texts: Sequence[Sequence[int]]) -> list[int]:
    """Layers ordered by how little they change the hidden state (1 - cosine, mean over tokens)."""
    change = torch.zeros(backend.num_layers)
    for seq in texts:
        out = backend.model(torch.tensor([list(seq)]), output_hidden_states=True, use_cache=False)
        states = out.hidden_states  # num_layers + 1 of [1, n, H]; the last one is after the norm
        for i in range(backend.num_layers - 1):
            cos = torch.nn.functional.cosine_similarity(states[i][0].float(), states[i + 1][0].float(), -1)
            change[i] += float((1 - cos).mean())
        change[-1] = float("inf")  # its output is normalised in hidden_states; keep the last layer
    return sorted(range(backend.num_layers), key=lambda i: float(change[i]))
