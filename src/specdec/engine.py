"""The decode loops: speculative (draft -> verify -> append -> roll back) and autoregressive.

Both are generators of :class:`~specdec.stats.Step`, so callers can stream, stop on a string, or
collect. They hold no tokenizer and no framework types: models come in as
:class:`~specdec.backends.base.CausalLM`.
"""

from __future__ import annotations

import time
from typing import Collection, Iterator, Sequence

import torch

from specdec.backends.base import CausalLM, forward_after, rollback
from specdec.constraints import UNPROCESSED, LogitProcessor, Unprocessed, with_forced
from specdec.drafters.base import Drafter
from specdec.drafters.tree import TreeDrafter, Trees
from specdec.policies import DraftLengthPolicy, StaticK
from specdec.sampling import SamplingConfig, next_token
from specdec.stats import Step
from specdec.verify.base import Verifier
from specdec.verify.tree import TreeVerifier

# A tree's depth is its drafter's to decide: the policy beside a tree lets it use all the room left.
TREE_ROOM = 1 << 30


class NonFiniteLogitsError(RuntimeError):
    """The target computed a logit that is NaN or +infinity (or a row of -infinity), which no
    token can be drawn from: its weights are damaged (e.g. a corrupt GGUF file). ``source``: the
    file (or model name) the target runs; ``position``: the context length the row follows."""

    hint = "check the file's size and sha256 against its source, or download it (or reinstall the pack) again"

    def __init__(self, source: str, position: int) -> None:
        self.source, self.position = source, position
        self.message = (f"{source}: the model computed non-finite logits (NaN or infinity) after {position} tokens; "
                        "its weights are likely damaged")
        super().__init__(f"{self.message}; {self.hint}")


def model_source(model: CausalLM) -> str:
    """The file or name ``model``'s weights come from, for messages: a GGUF backend's file, a
    transformers model's name or folder, else the backend's class."""
    inner = getattr(model, "backend", None)  # a wrapper around a backend (e.g. one that records logits)
    if inner is not None and inner is not model:
        return model_source(inner)
    path = getattr(getattr(model, "weights", None), "path", None)
    if path is not None:
        return str(path)
    config = getattr(getattr(model, "model", model), "config", None)
    return str(getattr(config, "_name_or_path", "") or type(model).__name__)


def check_finite(logits: torch.Tensor, target: CausalLM, position: int) -> None:
    """Stop with :class:`NonFiniteLogitsError` where a row of the target's ``logits`` (as the model
    computed them, before any processing) has a NaN or +infinity, or no finite entry: each row's
    maximum is NaN, +infinity or -infinity exactly then (one reduction over the rows, read once)."""
    if not bool(torch.isfinite(logits.amax(dim=-1)).all()):
        raise NonFiniteLogitsError(model_source(target), position)


def speculative_steps(
    target: CausalLM,
    drafter: Drafter,
    verifier: Verifier,
    policy: DraftLengthPolicy,
    prompt: Sequence[int],
    *,
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
    processor: LogitProcessor | Unprocessed = UNPROCESSED,
) -> Iterator[Step]:
    """Generate up to ``max_new_tokens`` after ``prompt``; the output follows the target's law.

    Each step: the policy plans the draft from what the drafter offers (:meth:`DraftLengthPolicy.plan`),
    the drafter proposes a chain of up to k tokens or a token tree at most k deep, one target forward
    scores the context's new tokens and every draft node, the verifier keeps a path and appends one
    token, and both caches are trimmed back to the output. (A chain is the tree whose node i's
    parent is i - 1.)

    With a ``processor`` (:class:`~specdec.constraints.LogitProcessor`: a grammar, penalties, a
    logit bias; by default :data:`~specdec.constraints.UNPROCESSED`, the target's logits as they
    are) every row the target scores is processed with its own prefix before the verifier
    reads it, so the output follows the processed target law; tokens the grammar forces are
    drafted first at no model cost, forbidden draft tokens are cut where that keeps the law, and
    the generation ends where the grammar is complete.
    """
    context = list(prompt)
    limit = _context_limit(target, len(context), max_new_tokens)
    produced = 0
    while produced < limit:
        room = limit - produced - 1  # the step always appends one token of the target's
        t0 = time.perf_counter()
        forced = processor.forced(room)
        after = context + forced if forced else context  # forced tokens come first, then the drafter's
        plan = policy.plan(drafter.sources(after), drafter.behind(after), room - len(forced))  # which source, how far
        k = min(plan.k, room - len(forced))
        draft = drafter.propose(after, k, sampling, generator, plan.keep_going, plan.source)
        proposed = len(draft)
        draft = processor.screen(with_forced(forced, draft, drafter.vocab_size), sampling)
        t1 = time.perf_counter()
        logits = draft.score(target, context)  # [1 + N, V]: after the context, after each draft node
        check_finite(logits, target, len(context))
        logits = processor.apply(logits, context, draft)  # [1 + N, V], each row after its own prefix
        verdict = verifier.verdict(draft, logits, sampling, generator, len(context))
        t2 = time.perf_counter()
        path = draft.path(verdict.accepted - 1)  # the draft nodes kept, first to last
        draft.keep(target, len(context), path)
        new = _cut_at_eos(draft.tokens_on(path) + [verdict.next_token], eos_ids)
        new = new[: processor.advance(new)]
        logprobs = None
        if processor.top_logprobs is not None:
            rows = [0] + [1 + node for node in path]  # the row each new token was drawn from
            logprobs = processor.logprobs(logits[rows[: len(new)]], new)
        context += new
        produced += len(new)
        rollback(target, context)
        drafter.observe(context)
        accepted = min(len(path), len(new))
        kept_forced = min(accepted, len(forced))
        step = Step(new, len(draft), accepted, t1 - t0, t2 - t1, logprobs, kept_forced, plan.source, proposed)
        # The policy learns from its drafter's tokens only (not the forced ones before them).
        tested = proposed if kept_forced == len(forced) else 0
        policy.update(Step(new, tested, min(tested, accepted - kept_forced), t1 - t0, t2 - t1))
        yield step
        if (eos_ids and new[-1] in eos_ids) or processor.finished:
            return


def tree_steps(
    target: CausalLM,
    drafter: TreeDrafter,
    prompt: Sequence[int],
    *,
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
    processor: LogitProcessor | Unprocessed = UNPROCESSED,
) -> Iterator[Step]:
    """:func:`speculative_steps` with a token tree each step (``drafter.propose_tree``), verified
    by :class:`~specdec.verify.tree.TreeVerifier`; the target's cache keeps only the accepted path."""
    return speculative_steps(target, Trees(drafter), TreeVerifier(), StaticK(TREE_ROOM), prompt, sampling=sampling,
                             max_new_tokens=max_new_tokens, eos_ids=eos_ids, generator=generator, processor=processor)


def autoregressive_steps(
    target: CausalLM,
    prompt: Sequence[int],
    *,
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
    processor: LogitProcessor | Unprocessed = UNPROCESSED,
) -> Iterator[Step]:
    """The baseline: one target forward and one sampled token per step, same backend and sampler
    (and the same processing of the target's logits, :func:`speculative_steps`)."""
    context = list(prompt)
    limit = _context_limit(target, len(context), max_new_tokens)
    for _ in range(limit):
        t0 = time.perf_counter()
        logits = forward_after(target, context)[-1:]  # [1, V]
        check_finite(logits, target, len(context))
        logits = processor.apply(logits, context)
        token = next_token(logits[0], sampling, generator, len(context))
        processor.advance([token])
        logprobs = processor.logprobs(logits, [token]) if processor.top_logprobs is not None else None
        context.append(token)
        yield Step([token], 0, 0, 0.0, time.perf_counter() - t0, logprobs)
        if token in eos_ids or processor.finished:
            return


def _context_limit(target: CausalLM, prompt_len: int, max_new_tokens: int) -> int:
    """How many tokens may be generated: the request, capped by the model's context."""
    if target.max_context is None:
        return max_new_tokens
    return max(0, min(max_new_tokens, target.max_context - prompt_len))


def _cut_at_eos(tokens: list[int], eos_ids: Collection[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens
