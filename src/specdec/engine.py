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
from specdec.drafters.base import Drafter
from specdec.drafters.tree import TreeDrafter
from specdec.policies import DraftLengthPolicy
from specdec.sampling import SamplingConfig, logits_to_probs, next_token
from specdec.stats import Step
from specdec.tree import forward_tree, keep_path
from specdec.verify.base import Verdict, Verifier, draw
from specdec.verify.greedy import greedy_verdict
from specdec.verify.tree import TreeVerifier


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
) -> Iterator[Step]:
    """Generate up to ``max_new_tokens`` after ``prompt``; the output follows the target's law.

    Each step: the drafter proposes k tokens, one target forward scores the context's new tokens
    and the k drafts, the verifier keeps a prefix and appends one token, and both caches are
    trimmed back to the output.
    """
    context = list(prompt)
    limit = _context_limit(target, len(context), max_new_tokens)
    produced = 0
    while produced < limit:
        room = limit - produced - 1  # the step always appends one token of the target's
        k = min(policy.next_k(), room)
        t0 = time.perf_counter()
        draft = drafter.propose(context, k, sampling, generator, policy.keep_going)
        t1 = time.perf_counter()
        draft_tokens = draft.tokens.tolist()
        logits = forward_after(target, context, draft_tokens)  # [k + 1, V]
        if not draft_tokens:  # a plain step: with no draft every verifier's law is the target's next-token law
            verdict = Verdict(0, next_token(logits[-1], sampling, generator))
        elif sampling.greedy and verifier.exact:  # the argmax chain: no probabilities needed
            verdict = greedy_verdict(draft_tokens, logits)
        else:
            p = logits_to_probs(logits, sampling)  # [k + 1, V]
            verdict = draw(verifier.plan(draft.tokens, draft.q, p), generator)
        t2 = time.perf_counter()
        new = _cut_at_eos(draft_tokens[: verdict.accepted] + [verdict.next_token], eos_ids)
        context += new
        produced += len(new)
        rollback(target, context)
        drafter.observe(context)
        step = Step(new, len(draft_tokens), min(verdict.accepted, len(new)), t1 - t0, t2 - t1)
        policy.update(step)
        yield step
        if eos_ids and new[-1] in eos_ids:
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
) -> Iterator[Step]:
    """Like :func:`speculative_steps` with a token tree: one target forward scores every node,
    the tree verifier picks a path, and the target's cache keeps only that path."""
    verifier = TreeVerifier()
    context = list(prompt)
    limit = _context_limit(target, len(context), max_new_tokens)
    produced = 0
    while produced < limit:
        t0 = time.perf_counter()
        tree = drafter.propose_tree(context, sampling, max_depth=limit - produced - 1, generator=generator)
        t1 = time.perf_counter()
        p = logits_to_probs(forward_tree(target, context, tree), sampling)  # [1 + N, V]
        verdict = draw(verifier.plan_tree(tree, p), generator)
        t2 = time.perf_counter()
        path = tree.path(verdict.accepted - 1)
        keep_path(target, len(context), path)
        new = _cut_at_eos([tree.tokens[i] for i in path] + [verdict.next_token], eos_ids)
        context += new
        produced += len(new)
        rollback(target, context)
        drafter.observe(context)
        yield Step(new, len(tree), min(len(path), len(new)), t1 - t0, t2 - t1)
        if eos_ids and new[-1] in eos_ids:
            return


def autoregressive_steps(
    target: CausalLM,
    prompt: Sequence[int],
    *,
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
) -> Iterator[Step]:
    """The baseline: one target forward and one sampled token per step, same backend and sampler."""
    context = list(prompt)
    limit = _context_limit(target, len(context), max_new_tokens)
    for _ in range(limit):
        t0 = time.perf_counter()
        token = next_token(forward_after(target, context)[-1], sampling, generator)
        context.append(token)
        yield Step([token], 0, 0, 0.0, time.perf_counter() - t0)
        if token in eos_ids:
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
