"""Drafting with a small causal LM that shares the target's vocabulary (Leviathan et al.)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from specdec.backends.base import CausalLM, common_prefix_len, forward_after, rollback
from specdec.drafters.base import Draft, DraftCost, Drafter, KeepGoing, draft_chain
from specdec.drafters.registry import DrafterSpec
from specdec.drafters.tree import DEFAULT_TREE, TreeDrafter
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



def _create(target: CausalLM, draft: CausalLM, **options: Any) -> ModelDrafter:
    if options:
        raise ValueError(f"the model drafter takes no options, got {', '.join(sorted(options))}")
    return ModelDrafter(draft)


def _tree(drafter: ModelDrafter, tree: Mapping[str, Any] | None) -> tuple[TreeDrafter, str]:
    """The draft model's token tree (:class:`~specdec.drafters.tree.TreeDrafter`; None: the
    confident tree, :data:`~specdec.drafters.tree.DEFAULT_TREE`), and its shape."""
    tree_drafter = TreeDrafter(drafter.model, **(DEFAULT_TREE if tree is None else tree))
    shape = {"static": "static", "confident": f"threshold={tree_drafter.threshold}",
             "dynamic": f"budget={tree_drafter.budget}",
             "sequoia": "sequoia" + (f":budget={tree_drafter.fixed_budget}" if tree_drafter.fixed_budget else "")
             }[tree_drafter.mode]
    return tree_drafter, shape


SPEC = DrafterSpec(name="model", create=_create, uses_draft_model=True, trees="also", tree=_tree, cls=ModelDrafter)
