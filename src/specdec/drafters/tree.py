"""Draft token trees with a draft model: static (Medusa-style choices) or dynamic (EAGLE-2-style).

Children are the draft's most likely tokens at their parent, so the tree is a deterministic
function of the context, which is what :class:`~specdec.verify.tree.TreeVerifier` needs for
exactness. The draft scores each depth of the tree in one forward pass with a tree mask, then its
cache is rolled back to the context.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.backends.base import CausalLM, forward_after, rollback
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.tree import TokenTree, top_children

# A small Medusa-style tree: each tuple is the path of child ranks from the root.
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,),
    (0, 0), (0, 1), (1, 0), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0),
)


class TreeDrafter:
    """Builds a token tree under the context with a draft model.

    Static: ``choices`` lists every node as its path of child ranks. Dynamic (``choices=None``):
    at each of ``depth`` levels, the ``expand`` best new nodes (by the product of draft
    probabilities along their path) get their ``width`` most likely children; finally the
    ``budget`` best nodes overall are kept (a child never scores above its parent, so the kept
    set is a tree).
    """

    name = "tree"

    def __init__(
        self,
        model: CausalLM,
        *,
        choices: Sequence[tuple[int, ...]] | None = None,
        depth: int = 5,
        width: int = 4,
        expand: int = 4,
        budget: int = 16,
    ) -> None:
        for label, value in (("depth", depth), ("width", width), ("expand", expand), ("budget", budget)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"tree {label} must be a positive integer, got {value!r}")
        if choices is not None:
            choices = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
            known = set(choices)
            if not choices or any(not c or (len(c) > 1 and c[:-1] not in known) for c in choices):
                raise ValueError("tree choices must be non-empty rank paths whose prefixes are listed too")
            depth = len(choices[-1])
        self.model = model
        self.choices = choices
        self.depth, self.width, self.expand, self.budget = depth, width, expand, budget

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def propose_tree(self, context: Sequence[int], sampling: SamplingConfig, max_depth: int) -> TokenTree:
        """A tree of depth at most ``max_depth`` under ``context`` (empty if max_depth is 0)."""
        # Only for ranking: the verifier never reads these, so greedy ranks by the plain softmax.
        ranking = sampling if not sampling.greedy else SamplingConfig(temperature=1.0)
        tokens: list[int] = []
        parents: list[int] = []
        ranks: list[tuple[int, ...]] = []  # each node's path of child ranks
        score: list[float] = []  # product of draft probabilities along each node's path
        depth = min(self.depth, max_depth)
        if depth <= 0:
            return TokenTree([], [])
        frontier, probs = [-1], logits_to_probs(forward_after(self.model, context), ranking)  # [1, V]
        fed: list[int] = []  # tree nodes in the draft's cache after the context, in cache order
        for level in range(1, depth + 1):
            new = []
            for node, row in zip(frontier, probs):
                prefix, base = (ranks[node], score[node]) if node >= 0 else ((), 1.0)
                for r, (tok, prob) in enumerate(top_children(row, self._width(prefix))):
                    if self.choices is not None and prefix + (r,) not in self.choices:
                        continue
                    tokens.append(tok)
                    parents.append(node)
                    ranks.append(prefix + (r,))
                    score.append(base * prob)
                    new.append(len(tokens) - 1)
            if self.choices is None:
                frontier = sorted(new, key=lambda i: -score[i])[: self.expand]
            else:
                frontier = [i for i in new if any(len(c) > level and c[:level] == ranks[i] for c in self.choices)]
            if level == depth or not frontier:
                break
            probs = logits_to_probs(self._feed(context, parents, tokens, fed, frontier), ranking)
        rollback(self.model, context)
        if len(tokens) > self.budget and self.choices is None:
            return _prune(tokens, parents, score, self.budget)
        return TokenTree(tokens, parents)

    def observe(self, context: Sequence[int]) -> None:
        rollback(self.model, context)

    def _width(self, prefix: tuple[int, ...]) -> int:
        if self.choices is None:
            return self.width
        return 1 + max((c[-1] for c in self.choices if c[:-1] == prefix), default=-1)

    def _feed(
        self, context: Sequence[int], parents: list[int], tokens: list[int], fed: list[int], nodes: list[int]
    ) -> torch.Tensor:
        """Feed ``nodes`` to the draft (each sees the context and its fed ancestors): logits [len, V]."""
        ctx = len(context)
        slot = {node: ctx + i for i, node in enumerate(fed)}
        attend = torch.zeros(len(nodes), ctx + len(fed) + len(nodes), dtype=torch.bool)
        attend[:, :ctx] = True
        positions = []
        for row, node in enumerate(nodes):
            attend[row, ctx + len(fed) + row] = True
            depth, up = 1, parents[node]
            while up >= 0:
                attend[row, slot[up]] = True
                depth, up = depth + 1, parents[up]
            positions.append(ctx - 1 + depth)
        fed.extend(nodes)
        return self.model.forward([tokens[i] for i in nodes], attend=attend, positions=positions)


def _prune(tokens: list[int], parents: list[int], score: list[float], budget: int) -> TokenTree:
    """Keep the ``budget`` best-scoring nodes (ancestor-closed), parents first."""
    kept = sorted(sorted(range(len(tokens)), key=lambda i: (-score[i], i))[:budget])
    index = {old: new for new, old in enumerate(kept)}
    return TokenTree([tokens[i] for i in kept], [index[parents[i]] if parents[i] >= 0 else -1 for i in kept])
