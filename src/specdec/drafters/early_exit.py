"""Self-drafting by early exit: the target's first L layers, its final norm and its LM head.

No second model is loaded: the drafter runs the target's own layers through
:class:`~specdec.backends.hf_layers.HFLayeredCausalLM`, and the keys and values it writes into
layers 0..L-1 are exactly the ones the full model computes there. The verify pass (the engine's
``forward_after(target, context, draft)``) therefore runs layers 0..L-1 only for the last draft
token and picks up the hidden states the drafter left at layer L for the others.

Without training for it (LayerSkip, Elhoushi et al. 2024, trains the model to exit early), the
exit is only a good guess for L close to the model's depth. Greedy agreement of the exit with the
full model (first draft token, bf16, four short code and prose prompts):

- Qwen2.5-Coder-1.5B (28 layers): L = 14: 0.03, 21: 0.26, 24: 0.63, 26: 0.79, 27: 0.93.
- SmolLM2-135M (30 layers): L = 15: 0.09, 21: 0.21, 24: 0.32, 26: 0.41, 28: 0.45, 29: 0.53.

With c = L/N of the weights read per draft token, the speed-up formula (Leviathan et al. 2023)
predicts no speed-up for any L on these models (best: 0.98 at L = 27 on the 1.5B); the default,
two layers below the top, keeps most of the agreement. Tune ``exit_layer`` per model.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specdec.backends.base import LAYERS, rollback
from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.drafters.base import Draft, DraftCost, Drafter, KeepGoing, draft_chain
from specdec.drafters.registry import DrafterSpec
from specdec.options import Option, positive
from specdec.sampling import SamplingConfig

DEFAULT_EXIT_BELOW_TOP = 2  # the default exit: this many layers below the top


class LayerSubsetDrafter(Drafter):
    """Drafts with a fixed ascending subset of the target's layers, sharing the target's cache.

    q[i] is ``logits_to_probs`` of the subset's logits with the caller's sampling settings, the
    distribution token i is sampled from (:func:`~specdec.drafters.base.draft_chain`).
    """

    name = "layers"

    def __init__(self, target: HFLayeredCausalLM, layers: Sequence[int]) -> None:
        if not isinstance(target, HFLayeredCausalLM):
            raise ValueError(
                f"{type(self).__name__} runs part of the target and needs the layered backend "
                "(specdec.backends.hf_layers.HFLayeredCausalLM) as the target"
            )
        self.target = target
        self.layers = sorted(set(int(i) for i in layers))
        if not self.layers or self.layers[0] < 0 or self.layers[-1] >= target.num_layers:
            raise ValueError(f"layers must be a non-empty subset of 0..{target.num_layers - 1}")

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        keep_going: KeepGoing | None = None,
        source: str | None = None,
    ) -> Draft:
        seq = list(context)

        def next_logits(previous: int | None) -> torch.Tensor:  # [V]
            if previous is not None:
                seq.append(previous)
            return self.target.forward_layers(seq, self.layers, 1)[-1]

        try:
            return draft_chain(next_logits, k, sampling, generator, keep_going, self.vocab_size, len(context))
        finally:
            self.target.end_draft()

    def observe(self, context: Sequence[int]) -> None:
        rollback(self.target, context)

    def costs(self) -> dict[str, DraftCost]:
        return {self.name: DraftCost(layers=len(self.layers), of=self.target.num_layers)}

    def describe(self) -> dict:
        """The drafter's settings, for reports."""
        return {"name": self.name, "layers": len(self.layers), "of": self.target.num_layers}


class EarlyExitDrafter(LayerSubsetDrafter):
    """The target's first ``exit_layer`` layers propose tokens (default: all but the top two)."""

    name = "early-exit"

    def __init__(self, target: HFLayeredCausalLM, exit_layer: int | None = None) -> None:
        n = target.num_layers if isinstance(target, HFLayeredCausalLM) else 0
        if exit_layer is None:
            exit_layer = max(1, n - DEFAULT_EXIT_BELOW_TOP)
        if not 1 <= exit_layer < max(n, 2):
            raise ValueError(f"exit_layer must be in 1..{n - 1} for a {n}-layer target, got {exit_layer}")
        super().__init__(target, range(exit_layer))
        self.exit_layer = exit_layer

    def describe(self) -> dict:
        return {**super().describe(), "exit_layer": self.exit_layer}


def _create(target: HFLayeredCausalLM, draft: None, **options: Any) -> EarlyExitDrafter:
    return EarlyExitDrafter(target, **options)


EXIT_LAYER = Option("drafter", "exit_layer", positive, "a positive integer (a layer below the target's top)", None,
                    "--drafter early-exit: draft with the first L layers (default: all but two)", "--exit-layer")

SPEC = DrafterSpec(name="early-exit", create=_create, options=(EXIT_LAYER,), needs=frozenset({LAYERS}))
