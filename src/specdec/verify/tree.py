"""Tree verification: one rule for trees whose children were sampled from the draft, one for trees
whose children were chosen deterministically.

Sampled children (``tree.q`` given; SpecInfer's multi-step speculative sampling with children drawn
without replacement, as in Jeon et al.'s recursive speculative decoding): at node u the target's
law is p_u and the children x_1, x_2, ... were drawn from q_u without replacement. Child x_i is
accepted with probability min(1, p'(x_i) / q'(x_i)); on a rejection p' becomes the residual
norm(max(0, p' - q')) and q' loses x_i (renormalised), starting from p' = p_u, q' = q_u. Given the
children before it, x_i is a draw from q', so each check is a rejection-sampling step whose
output, with the later checks standing in for a draw from the residual, follows p'; if every
child is rejected the token is drawn from the last p'. The output follows p_u exactly.

Deterministic children (``tree.q`` is None):

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
from specdec.verify.base import VerifyPlan, residual


class TreeVerifier:
    name = "tree"
    exact = True

    def plan_tree(self, tree: TokenTree, p: torch.Tensor) -> VerifyPlan:
        """tree: N nodes; p: [1 + N, V] target probabilities at the root and after each node."""
        p = p / p.sum(-1, keepdim=True)
        if tree.q is not None:
            return _plan_sampled(tree, p)
        n = len(tree)
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


def _plan_sampled(tree: TokenTree, p: torch.Tensor) -> VerifyPlan:
    """Recursive rejection over each node's sampled children (module docstring). p: [1 + N, V]."""
    n = len(tree)
    q = tree.q.to(p.dtype)  # [1 + N, V]
    reach = [1.0] + [0.0] * n  # probability that the output follows the path to each node
    end = torch.zeros(1 + n, dtype=torch.float64)
    rest = p.clone()  # row u: the law of the token drawn at u when every child is rejected
    kids: list[list[int]] = [[] for _ in range(1 + n)]
    for i, par in enumerate(tree.parents):
        kids[par + 1].append(i)
    for u in range(1 + n):
        if reach[u] <= 0.0:
            continue  # never reached: its row is never read
        pu, qu, stay = p[u], q[u], 1.0  # p', q', P(every child so far rejected)
        for child in kids[u]:
            x = tree.tokens[child]
            px, qx = float(pu[x]), float(qu[x])
            accept = min(1.0, px / qx) if qx > 0.0 else float(px > 0.0)
            reach[1 + child] = reach[u] * stay * accept
            stay *= 1.0 - accept
            if stay <= 0.0:
                break
            pu = residual(pu, qu)
            pu = pu / pu.sum()
            qu = qu.clone()
            qu[x] = 0.0
            if float(qu.sum()) <= 0.0:
                break
            qu = qu / qu.sum()
        end[u] = reach[u] * stay
        rest[u] = pu
    return VerifyPlan(end / end.sum(), rest)
