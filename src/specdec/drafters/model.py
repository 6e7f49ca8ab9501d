"""Drafting with a small causal LM that shares the target's vocabulary (Leviathan et al.)."""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.backends.base import CausalLM, forward_after, rollback
from specdec.drafters.base import Draft, KeepGoing
from specdec.sampling import SamplingConfig, logits_to_probs, sample


class ModelDrafter:
    """Samples k tokens autoregressively from a draft model with its own KV cache."""

    name = "model"

    def __init__(self, model: CausalLM) -> None:
        self.model = model

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        keep_going: KeepGoing | None = None,
    ) -> Draft:
        if k <= 0:
            return Draft.empty(self.vocab_size)
        logits = forward_after(self.model, context)[-1]  # [V]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        while True:
            q = logits_to_probs(logits, sampling)  # [V]
            tokens.append(sample(q, generator))
            qs.append(q)
            if len(tokens) == k or (keep_going is not None and not keep_going(_confidence(q, logits, sampling))):
                break
            logits = self.model.forward(tokens[-1:])[-1]
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(qs))

    def observe(self, context: Sequence[int]) -> None:
        rollback(self.model, context)


def _confidence(q: torch.Tensor, logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """What a draft-length policy sees: the sampling distribution, or under greedy (a one-hot q
    that carries no confidence) the draft model's own softmax. [V]."""
    return torch.softmax(logits.float(), -1) if sampling.greedy else q
