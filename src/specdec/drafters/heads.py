"""Drafting with trained heads on the target's own hidden state (Medusa / blockwise parallel).

The target backend keeps the final hidden state of every cached position (``keep_hidden=True``).
At a step whose context ends in token x_{j+1}, the hidden state h_j that predicted x_{j+1} is
already cached (the last verification pass computed it), so drafting costs K small blocks and one
pass of the trimmed LM head over K rows: no transformer layer runs.

Exactness: q[i] is ``logits_to_probs`` of head i's logits with the caller's sampling settings and
token i is drawn from it; q[i] depends on the context only (through h_j), never on the other draft
tokens, which the verifier's promise allows. Outside the trimmed vocabulary q is zero.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch

from specdec import kernels
from specdec.backends.base import HIDDEN_STATES, forward_after
from specdec.backends.hf import HFCausalLM
from specdec.drafters.base import Draft, Drafter, KeepGoing, draft_chain
from specdec.drafters.tree import DEFAULT_CHOICES
from specdec.drafters.medusa import MedusaHeads, TrimmedLMHead, feature_target_head, load_heads_for
from specdec.drafters.registry import DrafterSpec
from specdec.options import Option, nonempty
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.token_tree import TokenTree, top_children


class HeadsDrafter(Drafter):
    """Proposes up to K tokens from the heads; ``target`` must be built with ``keep_hidden=True``."""

    name = "heads"

    def __init__(self, target: HFCausalLM, heads: MedusaHeads,
                 choices: Sequence[tuple[int, ...]] | None = None) -> None:
        head = feature_target_head(target, heads.config, "heads")
        self.target = target
        self.heads = copy.deepcopy(heads).to(head.weight.dtype)  # the caller's module stays as it was
        kernels.accelerate(self.heads)  # bf16 blocks through the fast kernel, where it runs
        self.lm_head = TrimmedLMHead(head.weight, heads.kept)
        self.choices = self._fitting(DEFAULT_CHOICES if choices is None else choices)

    @classmethod
    def load(cls, target: HFCausalLM, path: str | None = None) -> "HeadsDrafter":
        """The drafter with heads read from ``path`` (default: those shipped for the target)."""
        return cls(target, load_heads_for(target.model, path))

    def _fitting(self, choices: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The rank paths no deeper than the heads reach, parents first."""
        fitting = sorted({tuple(c) for c in choices if 0 < len(c) <= self.heads.config.num_heads},
                         key=lambda c: (len(c), c))
        if not fitting:
            raise ValueError("no tree choice fits the number of heads")
        return fitting

    def with_choices(self, choices: Sequence[tuple[int, ...]]) -> "HeadsDrafter":
        """This drafter with another static tree (:meth:`propose_tree`); the heads are shared."""
        other = copy.copy(self)
        other.choices = self._fitting(choices)
        return other

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
        k = min(k, self.heads.config.num_heads)
        if k <= 0 or len(context) < 2:
            return Draft.empty(self.vocab_size)
        h = self._hidden_before_last(context)  # [H]
        logits = self.lm_head.logits(self.heads.features(h, k))  # [k, V], -inf outside the kept ids
        rows = iter(logits)  # head i's logits do not depend on the draft tokens before i
        return draft_chain(lambda _: next(rows), k, sampling, generator, keep_going, self.vocab_size, len(context))

    @torch.inference_mode()
    def propose_tree(
        self,
        context: Sequence[int],
        sampling: SamplingConfig,
        max_depth: int,
        generator: torch.Generator | None = None,
    ) -> TokenTree:
        """A Medusa tree: the node with child-rank path (r_1, ..., r_d) holds head d's r_d-th most
        likely token. The tree is a function of the context alone (``generator`` is not used), and
        the tree verifier checks it with its rule for deterministic children.

        ``self.choices`` (default: :data:`~specdec.drafters.tree.DEFAULT_CHOICES` cut to the number
        of heads) lists the paths.
        """
        depth = min(max_depth, self.heads.config.num_heads, max(len(c) for c in self.choices))
        if depth <= 0 or len(context) < 2:
            return TokenTree([], [])
        h = self._hidden_before_last(context)
        ranking = sampling if not sampling.greedy else SamplingConfig(temperature=1.0)  # ranks only
        probs = logits_to_probs(self.lm_head.logits(self.heads.features(h, depth)), ranking)  # [depth, V]
        widest = [1 + max((c[d] for c in self.choices if len(c) > d), default=-1) for d in range(depth)]
        top = [top_children(probs[d], widest[d]) for d in range(depth)]
        tokens: list[int] = []
        parents: list[int] = []
        node_of: dict[tuple[int, ...], int] = {}
        for path in self.choices:  # parents come first: sorted by length
            if len(path) > depth or path[-1] >= len(top[len(path) - 1]):
                continue
            parent = node_of.get(path[:-1], -1) if len(path) > 1 else -1
            if len(path) > 1 and path[:-1] not in node_of:
                continue
            node_of[path] = len(tokens)
            tokens.append(top[len(path) - 1][path[-1]][0])
            parents.append(parent)
        return TokenTree(tokens, parents)

    def _hidden_before_last(self, context: Sequence[int]) -> torch.Tensor:
        """h_j [H] for j = len(context) - 2, running the target over the context if it is not cached."""
        n = len(context) - 1
        if len(self.target.tokens) < n or list(self.target.tokens[:n]) != list(context[:n]):
            forward_after(self.target, context[:n])
        return self.target.hidden[n - 1]

    def observe(self, context: Sequence[int]) -> None:
        """Nothing to forget: the target's cache is rolled back by the engine."""

    def describe(self) -> dict:
        c = self.heads.config
        return {"name": self.name, "heads": c.num_heads, "kept_tokens": c.kept_tokens, "of": c.vocab_size}


def _create(target: HFCausalLM, draft: None, **options: Any) -> HeadsDrafter:
    return HeadsDrafter.load(target, **options)


def _tree(drafter: HeadsDrafter, tree: Mapping[str, Any] | None) -> tuple[HeadsDrafter, str]:
    """A static Medusa tree: the heads' default rank paths, or the ``choices`` given."""
    tree = dict(tree or {})
    if tree.pop("mode", "static") != "static" or set(tree) - {"choices"}:
        raise ValueError(f"the {drafter.name} drafter's tree is static and takes only 'choices'")
    return (drafter.with_choices(tree["choices"]) if "choices" in tree else drafter), "static"


# The trained heads' folder, which the EAGLE head's drafter takes too.
HEADS_PATH = Option("drafter", "path", nonempty, "a folder", None,
                    "--drafter heads or eagle: a folder from 'specdec train-heads' (default: the one shipped for the "
                    "target)", "--heads")

SPEC = DrafterSpec(name="heads", create=_create, options=(HEADS_PATH,), needs=frozenset({HIDDEN_STATES}), trees="also",
                   tree=_tree, cls=HeadsDrafter, static_tree=True)
