"""Drafting with a small causal LM that shares the target's vocabulary (Leviathan et al.)."""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.backends.base import CausalLM, common_prefix_len, forward_after, rollback
from specdec.drafters.base import Draft, DraftCost, Drafter, KeepGoing, draft_chain
from specdec.sampling import SamplingConfig


class ModelDrafter(Drafter):
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
        source: str | None = None,
    ) -> Draft:
        def next_logits(previous: int | None) -> torch.Tensor:  # [V]
            if previous is None:
                return forward_after(self.model, context)[-1]
            return self.model.forward([previous])[-1]

        return draft_chain(next_logits, k, sampling, generator, keep_going, self.vocab_size, len(context))

    def observe(self, context: Sequence[int]) -> None:
        rollback(self.model, context)

    def costs(self) -> dict[str, DraftCost]:
        return {self.name: DraftCost(model=self.model)}  # a draft model's one-row pass per token

    def behind(self, context: Sequence[int]) -> dict[str, int]:
        """The draft is fed only when it drafts: the tokens since then are its catch-up."""
        lag = len(context) - common_prefix_len(self.model.tokens, context) - 1
        return {self.name: lag} if lag > 0 else {}

