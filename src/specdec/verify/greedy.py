"""Greedy verification: keep draft tokens while they equal the target's argmax."""

from __future__ import annotations

import torch

from specdec.sampling import argmax
from specdec.verify.base import Verifier, VerifyPlan, greedy_verdict


class GreedyVerifier(Verifier):
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
