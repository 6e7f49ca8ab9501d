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

A sampled chain, or a chain whose last node forks into leaves (the confident tree's shapes), is
verified as a block instead (``specdec.verify.block``, Sun et al.): the chain and the fork's first
child form one block, since block verification keeps more of a longer block than token-by-token
rejection does; where the block ends at the chain's last node, the fork's other children are
checked against the law of the token block verification appends there (:func:`_plan_chain_fork`).
So such a tree keeps at least what the chain of its first children would.

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
from specdec.verify.block import BlockVerifier


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
        kids = tree.child_lists()
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
    """Sampled children (module docstring). p: [1 + N, V]. A chain, or a chain whose last node
    forks into leaves (the confident tree's shapes), gets block verification along the chain."""
    shape = _chain_and_fork(tree)
    if shape is not None:
        return _plan_chain_fork(tree, p, *shape)
    n = len(tree)
    q = tree.q.to(p.dtype)  # [1 + N, V]
    reach = [1.0] + [0.0] * n  # probability that the output follows the path to each node
    end = torch.zeros(1 + n, dtype=torch.float64)
    rest = p.clone()  # row u: the law of the token drawn at u when every child is rejected
    kids = tree.child_lists()
    for u in range(1 + n):
        if reach[u] <= 0.0:
            continue  # never reached: its row is never read
        chances, stay, rest[u] = _recursive_rejection(p[u], q[u], [tree.tokens[c] for c in kids[u]])
        for child, chance in zip(kids[u], chances):
            reach[1 + child] = reach[u] * chance
        end[u] = reach[u] * stay
    return VerifyPlan(end / end.sum(), rest)


def _recursive_rejection(pu: torch.Tensor, qu: torch.Tensor, tokens: list[int]) -> tuple[list[float], float, torch.Tensor]:
    """Check children ``tokens``, drawn from ``qu`` without replacement, one after another against
    ``pu`` ([V] each). Returns each child's chance of being the one accepted, the chance that none
    is, and the law of the token drawn then (the last residual)."""
    chances, stay = [], 1.0  # stay: P(every child so far rejected)
    for x in tokens:
        px, qx = float(pu[x]), float(qu[x])
        accept = min(1.0, px / qx) if qx > 0.0 else float(px > 0.0)
        chances.append(stay * accept)
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
    chances += [0.0] * (len(tokens) - len(chances))
    return chances, stay, pu


def _chain_and_fork(tree: TokenTree) -> tuple[list[int], list[int]] | None:
    """(chain, fork) when the tree is a chain of nodes, each its parent's only child, whose last
    node (or the root) has ``fork`` as its children, all of them leaves (a pure chain has an empty
    fork); None for any other shape."""
    kids = tree.child_lists()
    chain, node = [], -1
    while len(kids[node + 1]) == 1:
        node = kids[node + 1][0]
        chain.append(node)
    fork = kids[node + 1]
    if any(kids[1 + f] for f in fork) or len(chain) + len(fork) != len(tree):
        return None
    return chain, fork


def _plan_chain_fork(tree: TokenTree, p: torch.Tensor, chain: list[int], fork: list[int]) -> VerifyPlan:
    """Block verification of the chain and the fork's first child as one block (each token drawn
    from its parent's law); where it keeps the whole chain but not that child, recursive rejection
    over the fork's other children for the token it would draw.

    Exact: block verification's outcome follows the target's law for the block. Where it ends at
    the chain's last node, it appends a token drawn from a law r that it computes (given the
    block); the fork's other children, drawn from the draft there without replacement after the
    first, are checked one by one against r exactly as the module docstring checks siblings
    against p, so the appended token is still a draw from r, and after a kept child the bonus is
    the target's next token there. So the other children only change how that token is drawn,
    and each one kept adds a bonus token."""
    q = tree.q.to(p.dtype)  # [1 + N, V]
    tips = [0] + [1 + c for c in chain]  # plan rows: the root, then each chain node
    block_nodes = chain + fork[:1]
    rows = tips + [1 + f for f in fork[:1]]  # [j + 1]: the target's law after each block prefix
    tokens = torch.tensor([tree.tokens[c] for c in block_nodes], dtype=torch.long)  # [j]
    block = BlockVerifier().plan(tokens, q[tips[: len(block_nodes)]], p[rows])  # j + 1 outcomes
    end = torch.zeros(1 + len(tree), dtype=torch.float64)
    rest = p.clone()
    for i, row in enumerate(rows):
        end[row] = block.accept_len_probs[i]
        rest[row] = block.next_token_probs[i].to(p.dtype)
    if len(fork) > 1:
        tip, first = tips[-1], tree.tokens[fork[0]]
        law = rest[tip] / rest[tip].sum()  # r: the token block verification appends at the tip
        others = q[tip].clone()
        others[first] = 0.0
        others = others / others.sum()  # the law the second child was drawn from
        chances, stay, rest[tip] = _recursive_rejection(law, others, [tree.tokens[f] for f in fork[1:]])
        for f, chance in zip(fork[1:], chances):
            end[1 + f] = end[tip] * chance  # the bonus after f is drawn from p[1 + f], its row
        end[tip] = end[tip] * stay
    return VerifyPlan(end / end.sum(), rest)
