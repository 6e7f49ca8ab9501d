"""Typical acceptance (Medusa; Cai et al. 2024). LOSSY: the output does not follow the target's law.

A draft token x is kept while p(x) > min(epsilon, delta * exp(-H(p))), H the entropy of the target
distribution at that position; the first token that fails is replaced by the target's argmax, and
after a fully kept draft the bonus token is the argmax too. It exists only for users who ask for it
by name (``--verify typical``); every report marks it lossy.
"""

from __future__ import annotations

import torch

from specdec.verify.base import Verifier, VerifyPlan


class TypicalVerifier(Verifier):
    name = "typical"
    exact = False

    def __init__(self, epsilon: float = 0.3, delta: float = 0.09) -> None:
        self.epsilon, self.delta = epsilon, delta

    def plan(self, draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> VerifyPlan:
        """draft_tokens: [k]; q: [k, V] (unused); p: [k + 1, V]. The outcome is deterministic."""
        k = draft_tokens.shape[0]
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [k + 1]
        threshold = torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)  # [k + 1]
        ok = p[torch.arange(k), draft_tokens] > threshold[:k]  # [k]
        accepted = int(ok.long().cumprod(0).sum()) if k else 0
        accept_len_probs = torch.zeros(k + 1, dtype=torch.float64)
        accept_len_probs[accepted] = 1.0
        next_token_probs = torch.zeros_like(p)
        next_token_probs[torch.arange(k + 1), p.argmax(-1)] = 1.0
        return VerifyPlan(accept_len_probs, next_token_probs)
