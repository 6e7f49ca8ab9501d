"""Greedy verification: keep draft tokens while they equal the target's argmax."""

from __future__ import annotations

import torch

from specdec.verify.base import VerifyPlan


class GreedyVerifier:
    """Exact for greedy decoding (temperature 0): the output is the target's argmax chain."""

    name = "greedy"
    exact = True

    def plan(self, draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> VerifyPlan:
        """draft_tokens: [k]; q: [k, V] (unused); p: [k + 1, V]. The outcome is deterministic."""
        k = draft_tokens.shape[0]
        target_choice = p.argmax(dim=-1)  # [k + 1]
        mismatch = (draft_tokens != target_choice[:k]).nonzero()
        accepted = int(mismatch[0]) if mismatch.numel() else k
        accept_len_probs = torch.zeros(k + 1, dtype=torch.float64)
        accept_len_probs[accepted] = 1.0
        next_token_probs = torch.zeros_like(p)
        next_token_probs[torch.arange(k + 1), target_choice] = 1.0
        return VerifyPlan(accept_len_probs, next_token_probs)
