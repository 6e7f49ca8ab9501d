"""Drafting with a one-layer autoregressive head on the target's features (EAGLE).

The target backend keeps the final hidden state of every cached position (``keep_hidden=True``).
For a context x_0 .. x_{n-1} the target has computed h_0 .. h_{n-2}; the head's cache holds the
pairs (h_t, x_{t+1}) it has already read. Drafting (1) feeds the pairs it has not read yet, true
features from the target, (2) turns the last predicted feature into q[0] and draws d_1, then
(3) feeds the pair (ĥ, d_i) to get q[i], k times. The drafted pairs are then cut from the head's
cache; pairs built on tokens that were later rejected are cut at the next call (the cache
remembers which tokens it was built on).

Exactness: q[i] is ``logits_to_probs`` of the head's logits with the caller's sampling settings,
token i is drawn from it, and q[i] depends on the context and d_1 .. d_i only. Outside the trimmed
vocabulary q is zero.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from specdec import kernels
from specdec.backends.base import HIDDEN_STATES, forward_after
from specdec.backends.hf import HFCausalLM
from specdec.drafters.base import Draft, Drafter, KeepGoing, draft_chain
from specdec.drafters.medusa import TrimmedLMHead, feature_target_head
from specdec.drafters.eagle_head import EagleCache, EagleHead, load_eagle_for
from specdec.drafters.heads import HEADS_PATH
from specdec.drafters.registry import DrafterSpec
from specdec.sampling import SamplingConfig


class EagleDrafter(Drafter):
    """Proposes k tokens with the head; ``target`` must be built with ``keep_hidden=True``."""

    name = "eagle"

    def __init__(self, target: HFCausalLM, head: EagleHead) -> None:
        out = feature_target_head(target, head.config, "eagle")
        self.target = target
        self.head = copy.deepcopy(head).to(out.weight.dtype)  # the caller's module stays as it was
        kernels.accelerate(self.head)  # bf16 layers through the fast kernel, where it runs
        self.lm_head = TrimmedLMHead(out.weight, head.kept)
        self.embed = target.model.get_input_embeddings()
        self.cache = EagleCache()
        self._read: list[int] = []  # the tokens the cached pairs were built on

    @classmethod
    def load(cls, target: HFCausalLM, path: str | None = None) -> "EagleDrafter":
        """The drafter with the head read from ``path`` (default: the one shipped for the target)."""
        return cls(target, load_eagle_for(target.model, path))

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @torch.inference_mode()
    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        keep_going: KeepGoing | None = None,
        source: str | None = None,
    ) -> Draft:
        n = len(context)
        if k <= 0 or n < 2:
            return Draft.empty(self.vocab_size)
        feature = self._catch_up(context)  # [H]: ĥ_{n-1}, whose LM head output guesses x_n
        read = len(self.cache)  # = n - 1 pairs, all from true features

        def next_logits(previous: int | None) -> torch.Tensor:  # [V], -inf outside the kept ids
            nonlocal feature
            if previous is not None:  # feed the pair (ĥ, d_i) for the next feature
                emb = self.embed(torch.tensor([previous], device=feature.device))  # [1, H]
                feature = self.head(feature[None], emb, len(self.cache), self.cache)[0]
            return self.lm_head.logits(feature)

        draft = draft_chain(next_logits, k, sampling, generator, keep_going, self.vocab_size, len(context))
        self.cache.crop(read)
        return draft

    def _catch_up(self, context: Sequence[int]) -> torch.Tensor:
        """Feed the head the pairs (h_t, x_{t+1}), t < n - 1, it has not read; return its last output."""
        n = len(context)
        if len(self.target.tokens) < n - 1 or list(self.target.tokens[: n - 1]) != list(context[: n - 1]):
            forward_after(self.target, context[: n - 1])
        keep = 0  # pairs still valid: pair t needs x_0 .. x_{t+1} unchanged
        limit = min(len(self._read), n, len(self.cache) + 1)
        while keep < limit and self._read[keep] == context[keep]:
            keep += 1
        pairs = max(0, min(keep - 1, n - 2))  # leave at least the last pair to recompute
        self.cache.crop(pairs)
        hidden = self.target.hidden[pairs : n - 1]  # [T, H]
        emb = self.embed(torch.tensor(list(context[pairs + 1 : n]), device=hidden.device))  # [T, H]
        out = self.head(hidden, emb, pairs, self.cache)  # [T, H]
        self._read = list(context)
        return out[-1]

    def observe(self, context: Sequence[int]) -> None:
        """Nothing to do: pairs built on rejected tokens are found and cut at the next call."""

    def describe(self) -> dict:
        c = self.head.config
        return {"name": self.name, "layers": 1, "kept_tokens": c.kept_tokens, "of": c.vocab_size}


def _create(target: HFCausalLM, draft: None, **options: Any) -> EagleDrafter:
    return EagleDrafter.load(target, **options)


SPEC = DrafterSpec(name="eagle", create=_create, options=(HEADS_PATH,), needs=frozenset({HIDDEN_STATES}))
