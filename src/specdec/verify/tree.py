"""Tree verification: one rule for trees whose children were sampled from the draft, one for trees
whose children were chosen deterministically.

Sampled children (``tree.q`` given): *traversal verification* (Weng et al., "Traversal Verification
for Speculative Tree Decoding", NeurIPS 2025), block verification (``specdec.verify.block``, Sun et
al.) generalised from a chain to a tree. Each node u carries a target law P_u (at first p_u), a
draft law Q_u (at first q_u, the law its children were drawn from without replacement) and a
weight w_u: w = 1 at the root and w_c = min(1, w_u P_u(c) / Q_u(c)) for a child c of u, the
chance that the path to c survives as a whole, judged on the whole path's p/q rather than token by
token. Nodes are visited leaves first, children before their parent and siblings in drafting order
(post-order). The visited node v ends the verification with probability w_v: its path is kept and
the appended token is drawn from P_v. Otherwise v is dropped and its parent u absorbs it: with
r = max(0, w_u P_u - Q_u) and S = sum(r), P_u becomes r / S, w_u becomes S / (S + 1 - w_u), Q_u
loses v's token (renormalised: the law u's next child was drawn from), and the weights of u's
remaining subtrees are recomputed from them. If every node is dropped the root ends it.

On a chain this is block verification run from the deepest position back: w at the leaf is its
keep probability, and S / (S + 1 - w) is block verification's chance of accepting a position.
Weng et al. prove their traversal lossless for trees whose children were drawn without
replacement; this implementation of it is checked by exact enumeration of the output law for every
sampled shape the drafters build, beside a negative control with a wrong parent weight.
Unlike checking siblings token by token (SpecInfer's recursive rejection), a path keeps block
verification's gain: a token the draft over-weights does not cost the path if later tokens make up
for it. The rule needs each node's number of children fixed before they are drawn.

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

from specdec.sampling import SamplingConfig, argmax, logits_to_probs
from specdec.token_tree import TokenTree
from specdec.verify.base import Verdict, Verifier, VerifyPlan, draw
from specdec.verify.coupled import coupled_walk


class TreeVerifier(Verifier):
    name = "tree"
    exact = True

    def verdict(
        self,
        draft: TokenTree,
        logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        position: int | None = None,
    ) -> Verdict:
        """The drawn outcome for a tree from the target's logits at the root and after each node
        ([1 + N, V]): outcome 0 ends at the root, outcome 1 + i at node i (its whole path kept).
        Under the Gumbel-max sampler, the coupled walk (:func:`~specdec.verify.coupled.coupled_walk`:
        the tree's draft laws are not read) at the context's length ``position``."""
        if sampling.coupled:
            return coupled_walk(draft.tokens, draft.child_lists(), logits, sampling, position)
        if sampling.greedy and draft.q is None:
            return greedy_tree_verdict(draft, logits)
        return draw(self.plan_tree(draft, logits_to_probs(logits, sampling)), generator)

    def plan_tree(self, tree: TokenTree, p: torch.Tensor) -> VerifyPlan:
        """tree: N nodes; p: [1 + N, V] target probabilities at the root and after each node."""
        p = p / p.sum(-1, keepdim=True)
        if tree.q is not None:
            return _plan_sampled(tree, p)
        n = len(tree)
        reach = [1.0] + [0.0] * n  # probability that the output follows the path to each node
        end = torch.zeros(1 + n, dtype=torch.float64)
        rest = p.clone()  # row u: p_u without u's children (the recovered token's law)
        kids = tree.child_lists()
        for u in range(1 + n):
            row = p[u]
            for child in kids[u]:
                mass = float(row[tree.tokens[child]])
                reach[1 + child] = reach[u] * mass
                rest[u, tree.tokens[child]] = 0.0
            end[u] = reach[u] * max(0.0, 1.0 - sum(float(row[tree.tokens[c]]) for c in kids[u]))
        empty = rest.sum(-1) <= 0  # every token a child: only reached w.p. 0; keep the row drawable
        if bool(empty.any()):
            rest[empty] = p[empty]
        return VerifyPlan(end / end.sum(), rest)


def greedy_tree_verdict(tree: TokenTree, logits: torch.Tensor) -> Verdict:
    """The outcome of :meth:`TreeVerifier.plan_tree` under greedy decoding, its only one: from the
    root, move to the child that is the target's argmax while there is one, then append the argmax
    (ties to the lowest id, as :func:`~specdec.sampling.logits_to_probs`). logits: [1 + N, V]. One
    argmax per row instead of [1 + N, V] probabilities and a draw (milliseconds at a large vocabulary)."""
    choice = argmax(logits).tolist()  # [1 + N]
    kids = tree.child_lists()
    row = 0  # plan row: 0 the root, 1 + i node i
    while True:
        nxt = next((1 + c for c in kids[row] if int(tree.tokens[c]) == choice[row]), None)
        if nxt is None:
            return Verdict(row, choice[row])
        row = nxt


def _folded_weight(mass: float, w: float) -> float:
    """A node's weight once a child is dropped into it: S / (S + 1 - w), with S the residual mass
    sum(max(0, w P - Q)) and w its weight before (block verification's chance of ending there)."""
    return mass / (mass + (1.0 - w)) if mass > 0.0 else 0.0


def _plan_sampled(tree: TokenTree, p: torch.Tensor) -> VerifyPlan:
    """Traversal verification of a tree with sampled children (module docstring). p: [1 + N, V],
    normalised, the caller's own copy: its rows become the plan's appended-token laws."""
    n = len(tree)
    kids = tree.child_lists()
    # Only nodes with children have laws that change; each keeps P_u, and the draft law unnormalised
    # (Q_u = drawn[u] / left[u]). The weights are Python floats; every probability formed from them
    # stays in [0, 1] whatever the rounding of p's dtype.
    law = {u: p[u] for u in range(1 + n) if kids[u]}  # row u: P_u [V]
    drawn = {u: tree.q[u].to(p.dtype, copy=True) for u in law}  # row u: Q_u * left[u] [V]
    left = {u: float(drawn[u].sum()) for u in law}
    weight = [1.0] + [0.0] * n  # w, by plan row (0 the root, 1 + i node i)
    dropped = [False] * (1 + n)

    def reweigh(u: int) -> None:
        """Recompute the weights of row u's remaining subtrees from w_u, P_u and Q_u."""
        for c in kids[u]:
            if dropped[1 + c]:
                continue
            tok = tree.tokens[c]
            qc = float(drawn[u][tok]) / left[u]
            weight[1 + c] = min(1.0, weight[u] * float(law[u][tok]) / qc) if qc > 0.0 else 0.0
            reweigh(1 + c)

    order: list[int] = []  # plan rows, children before parents, siblings in drafting order

    def visit(u: int) -> None:
        for c in kids[u]:
            visit(1 + c)
        order.append(u)

    reweigh(0)
    visit(0)
    end = torch.zeros(1 + n, dtype=torch.float64)
    stay = 1.0  # P(every node visited so far was dropped)
    for v in order[:-1]:  # the root, last, ends it if nothing else did
        end[v] = stay * weight[v]
        stay *= 1.0 - weight[v]
        dropped[v] = True
        u, tok = 1 + tree.parents[v - 1], tree.tokens[v - 1]
        w = weight[u]
        if w > 0.0:
            r = torch.mul(law[u], w * left[u]).sub_(drawn[u]).clamp_min_(0.0)  # [V]: left * max(0, w P_u - Q_u)
            total = float(r.sum())
            mass = total / left[u]  # S
            if total > 0.0:
                law[u] = r.div_(total)
            weight[u] = _folded_weight(mass, w)
        left[u] -= float(drawn[u][tok])
        drawn[u][tok] = 0.0
        if left[u] <= 0.0:
            left[u] = 1.0  # no draft mass left: u has no child left to weigh
        reweigh(u)
    end[0] = stay
    for u, row in law.items():  # the appended token's law at each node: P_u as left when u was visited
        p[u] = row
    return VerifyPlan(end / end.sum(), p)
