"""Greedy verification: keep draft tokens while they equal the target's argmax."""

from __future__ import annotations

import torch

from specdec.sampling import argmax
from specdec.verify.base import Verdict, VerifyPlan


class GreedyVerifier:
    """Exact for greedy decoding (temperature 0): the output is the target's argmax chain."""

    name = "greedy"
    exact = True

    def plan(self, draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> VerifyPlan:
        """draft_tokens: [k]; q: [k, V] (unused); p: [k + 1, V]. The outcome is deterministic."""
        k = draft_tokens.shape[0]
        accepted = greedy_verdict(draft_tokens.tolist(), p).accepted
        accept_len_probs = torch.zeros(k + 1, dtype=torch.float64)
        accept_len_probs[accepted] = 1.0
        next_token_probs = torch.zeros_like(p)
        next_token_probs[torch.arange(k + 1), argmax(p)] = 1.0
        return VerifyPlan(accept_len_probs, next_token_probs)


def greedy_verdict(draft_tokens: list[int], logits: torch.Tensor) -> Verdict:
    """The outcome of every exact rule under greedy decoding, from the target's raw logits.

    draft_tokens: k ids; logits: [k + 1, V]. Greedy makes the target's law a point mass on its
    argmax chain, and each exact rule (greedy, token, block) then keeps exactly the draft tokens
    that equal the argmax, in order, and appends the argmax after them -- with probability 1, as
    ``tests/test_verify_exact.py`` checks against each rule's plan. One argmax per row is all it takes:
    no [k + 1, V] probabilities, residuals or draws (several milliseconds at a 150k vocabulary).
    Ties go to the lowest id, as in :func:`~specdec.sampling.logits_to_probs`.
    """
    choice = argmax(logits).tolist()  # [k + 1]
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == choice[accepted]:
        accepted += 1
    return Verdict(accepted, choice[accepted])
