"""Token trees: plain data, the attention mask that verifies one in a single forward pass, and
the bookkeeping that keeps only the accepted path in a KV cache (SpecInfer, Medusa, EAGLE-2).

The root of a tree is the position after the context; node i holds one draft token. Nodes are
stored parents first (a node's parent has a smaller index), siblings in their drafting order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.backends.base import CausalLM, prefill


@dataclass(frozen=True)
class TokenTree:
    """tokens: [N] draft token ids; parents: [N] parent node index, -1 for the root's children.

    q: None when the children were chosen deterministically (e.g. the draft's top tokens);
    otherwise [1 + N, V], row 0 the draft law the root's children were drawn from, row 1 + i the
    one node i's children were drawn from, each node's children drawn from it without
    replacement, in their order here, and their number fixed before they were drawn.
    """

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a tree needs one parent per token")
        if any(not -1 <= par < i for i, par in enumerate(self.parents)):
            raise ValueError("tree nodes must come after their parents")
        if self.q is not None and self.q.shape[0] != 1 + len(self.tokens):
            raise ValueError(f"a sampled tree needs 1 + N draft rows, got {self.q.shape[0]} for N = {len(self)}")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Depth of each node: 1 for the root's children."""
        depth: list[int] = []
        for par in self.parents:
            depth.append(1 if par < 0 else depth[par] + 1)
        return depth

    def child_lists(self) -> list[list[int]]:
        """Every node's children at once: entry 1 + u lists node u's (entry 0 the root's), in drafting order."""
        kids: list[list[int]] = [[] for _ in range(1 + len(self))]
        for i, par in enumerate(self.parents):
            kids[par + 1].append(i)
        return kids

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node`` (empty for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def tokens_on(self, path: Sequence[int]) -> list[int]:
        return [self.tokens[i] for i in path]

    def score(self, target: CausalLM, context: Sequence[int]) -> torch.Tensor:
        """The target's logits at the root and after each node: [1 + N, V] (:func:`forward_tree`)."""
        return forward_tree(target, context, self)

    def keep(self, target: CausalLM, context_len: int, path: Sequence[int]) -> None:
        """Keep only the context and the accepted ``path`` in the target's cache (:func:`keep_path`)."""
        keep_path(target, context_len, path)

    def ancestry(self) -> torch.Tensor:
        """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
        n = len(self)
        sees = torch.zeros(n, n, dtype=torch.bool)
        for i, par in enumerate(self.parents):
            if par >= 0:
                sees[i] = sees[par]
            sees[i, i] = True
        return sees


def forward_tree(model: CausalLM, context: Sequence[int], tree: TokenTree) -> torch.Tensor:
    """Score the whole tree in one forward pass: logits [1 + N, V].

    Row 0 is the distribution after the context, row 1 + i the one after node i's path. The
    uncached tail of the context is fed causally before the tree; each node sees the context and
    its ancestors only, at position len(context) - 1 + depth.
    """
    keep = prefill(model, context)
    tail = list(context[keep:])
    m, n = len(tail), len(tree)
    attend = torch.zeros(m + n, keep + m + n, dtype=torch.bool)  # [new, cached + new]
    attend[:, :keep] = True
    attend[:m, keep : keep + m] = torch.ones(m, m, dtype=torch.bool).tril()
    attend[m:, keep : keep + m] = True
    attend[m:, keep + m :] = tree.ancestry()
    positions = list(range(keep, len(context))) + [len(context) - 1 + d for d in tree.depths]
    return model.forward(tail + tree.tokens, num_logits=1 + n, attend=attend, positions=positions)


def keep_path(model: CausalLM, context_len: int, path: Sequence[int]) -> None:
    """After :func:`forward_tree`: keep the context and the accepted ``path`` nodes in the cache."""
    model.keep(list(range(context_len)) + [context_len + i for i in path])


def top_children(probs: torch.Tensor, count: int) -> list[tuple[int, float]]:
    """The ``count`` most likely tokens of ``probs`` ([V]) with their probabilities, best first."""
    values, ids = torch.topk(probs, min(count, probs.shape[-1]))
    return [(int(t), float(v)) for t, v in zip(ids, values) if v > 0]


def sample_children(q: torch.Tensor, count: int, generator: torch.Generator | None) -> list[int]:
    """Draw up to ``count`` distinct tokens from ``q`` ([V]) without replacement, in draw order:
    each draw follows q renormalised over the tokens not drawn yet. Fewer if q has fewer
    non-zero tokens."""
    count = min(count, int((q > 0).sum()))
    if count <= 0:
        return []
    return torch.multinomial(q.float(), count, replacement=False, generator=generator).tolist()
