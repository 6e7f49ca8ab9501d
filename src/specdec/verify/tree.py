"""Tree verification for trees whose children are chosen deterministically from the draft.

At a node, the target's distribution there is p_u. Each child is a point-mass draft; checking the
children one by one (accept child c with probability p'(c), else remove c from p' and renormalise)
is the multi-draft rejection rule for point masses, and it amounts to: draw x from p_u; if x is a
child, move to it; otherwise x is the recovered token. So the output at every position is drawn
from the target exactly, whatever tree the drafter built, as long as the tree is a function of the
context alone (not of random draws). Under greedy decoding (one-hot p) this follows the longest
path that matches the target's argmax and adds the bonus token.

The plan indexes outcomes by node: outcome 0 ends at the root (no draft kept), outcome 1 + i ends
at node i (its whole path kept); ``next_token_probs`` gives the appended token in each case.
"""

from __future__ import annotations

import torch

from specdec.tree import TokenTree
from specdec.verify.base import VerifyPlan


class TreeVerifier:
    name = "tree"
    exact = True

    def plan_tree(self, tree: TokenTree, p: torch.Tensor) -> VerifyPlan:
        """tree: N nodes; p: [1 + N, V] target probabilities at the root and after each node."""
        n = len(tree)
        p = p / p.sum(-1, keepdim=True)
        reach = [1.0] + [0.0] * n  # probability that the output follows the path to each node
        end = torch.zeros(1 + n, dtype=torch.float64)
        rest = p.clone()  # row u: p_u without u's children (the recovered token's law)
        kids = [[] for _ in range(1 + n)]
        for i, par in enumerate(tree.parents):
            kids[par + 1].append(i)
        for u in range(1 + n):
            row = p[u]
            for child in kids[u]:
                mass = float(row[tree.tokens[child]])
                reach[1 + child] = reach[u] * mass
                rest[u, tree.tokens[child]] = 0.0
            end[u] = reach[u] * max(0.0, 1.0 - sum(float(row[tree.tokens[c]]) for c in kids[u]))
        empty = rest.sum(-1, keepdim=True) <= 0  # every token a child: only reached w.p. 0
        return VerifyPlan(end / end.sum(), torch.where(empty, p, rest))
