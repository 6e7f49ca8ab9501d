"""Sequoia trees (Chen et al. 2024, "Sequoia: Scalable, Robust, and Hardware-aware Speculative
Decoding"): the token tree of a given node budget with the most expected accepted tokens.

The model. A node's children are ranked in the draft's order (under greedy decoding its likeliest
tokens, under sampling the order they were drawn in, without replacement). The *positional
acceptance vector* p_0, p_1, ... gives the chance that the verifier accepts the child of rank k,
whatever node it hangs from (the paper's positional acceptance assumption). A node is reached when
every child on its path was the accepted one, with chance the product of the p's of the ranks on
its path, so a tree's expected number of accepted draft tokens is

    E(T) = sum over nodes v of prod_{ranks r on the path to v} p_r

and a step that verifies it yields 1 + E(T) tokens on average (the verifier adds one token).

The dynamic program. A tree is written as its *choices*: every node's path of child ranks from
the root, the form :class:`~specdec.drafters.tree.TreeDrafter` drafts as a static tree; a node's
children are always ranks 0, 1, ..., m - 1. With G(n, d) the best E over forests of at most n
nodes and at most d levels under one node, and B_i(n, d) the best over the children of ranks
i, i + 1, ... holding at most n nodes together:

    B_i(n, d) = max(0, max_{1 <= s <= n} p_i (1 + G(s - 1, d - 1)) + B_{i+1}(n - s, d))
    G(n, d) = B_0(n, d),   G(n, 0) = 0,   B_K(n, d) = 0 (no rank beyond the vector)

(the child of rank i gets a subtree of s nodes, itself included). One table fills every budget
up to n at once in O(K n^2 d) steps for K ranks; :func:`optimal_trees` returns each budget's tree.

Where the budget comes from (the hardware-aware part): :func:`sequoia_budget` weighs each
budget's 1 + E against its draft and verify costs on the measured cost curves (:mod:`specdec.costs`,
the planner's). Where p comes from is :class:`PositionalAcceptance`: counted from verification
outcomes, with a prior until enough steps are seen.
"""

from __future__ import annotations

from typing import Sequence

from specdec.costs import CostModel

Choices = tuple[tuple[int, ...], ...]

# The positional acceptance vector assumed before any step is seen: the draft's first choice
# accepted 60% of the time, each later rank half as often as the one before it (0.15, 0.075, ...).
DEFAULT_RANKS = 8
PRIOR_FIRST = 0.6
PRIOR_SECOND = 0.15


def prior_vector(ranks: int = DEFAULT_RANKS) -> list[float]:
    """The prior positional acceptance vector of ``ranks`` entries (the module's constants)."""
    return [PRIOR_FIRST] + [PRIOR_SECOND * 0.5 ** (k - 1) for k in range(1, ranks)]


def expected_accepted(choices: Sequence[tuple[int, ...]], p: Sequence[float]) -> float:
    """E(T): the expected number of accepted draft tokens of the tree ``choices`` under the
    positional acceptance vector ``p`` (ranks past its end are never accepted)."""
    total = 0.0
    for path in choices:
        reach = 1.0
        for rank in path:
            reach *= p[rank] if rank < len(p) else 0.0
        total += reach
    return total


def optimal_trees(p: Sequence[float], max_budget: int, depth: int | None = None) -> list[tuple[Choices, float]]:
    """For every budget n = 0..max_budget, (the tree of at most n nodes and at most ``depth``
    levels with the most expected accepted tokens under ``p``, that E). Choices are listed parents
    first (by depth, then rank path); a tree holds fewer than n nodes only where more would add
    nothing. Ties go to the smaller subtree for the lower rank."""
    if isinstance(max_budget, bool) or not isinstance(max_budget, int) or max_budget < 0:
        raise ValueError(f"the tree budget must be an integer >= 0, got {max_budget!r}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth <= 0):
        raise ValueError(f"the tree depth must be a positive integer, got {depth!r}")
    probs = [float(x) for x in p]
    if any(not 0.0 <= x <= 1.0 for x in probs):
        raise ValueError(f"acceptance probabilities must be in [0, 1], got {probs}")
    n_max, ranks = max_budget, len(probs)
    levels = n_max if depth is None else min(depth, n_max)
    best = [[0.0] * (n_max + 1)]  # best[d][n] = G(n, d)
    take: list[list[list[int]]] = [[]]  # take[d][i][n]: nodes given to the child of rank i (0: none)
    for d in range(1, levels + 1):
        below = best[d - 1]
        subtree = [0.0] + [1.0 + below[s - 1] for s in range(1, n_max + 1)]  # [n_max + 1]: 1 + G(s - 1, d - 1)
        after = [0.0] * (n_max + 1)  # B_{i+1}(., d)
        rows: list[list[int]] = [[]] * ranks
        for i in range(ranks - 1, -1, -1):
            value, pick = [0.0] * (n_max + 1), [0] * (n_max + 1)
            pi = probs[i]
            for n in range(1, n_max + 1):
                top, arg = 0.0, 0
                for s in range(1, n + 1):
                    v = pi * subtree[s] + after[n - s]
                    if v > top + 1e-15:
                        top, arg = v, s
                value[n], pick[n] = top, arg
            after, rows[i] = value, pick
        best.append(after)
        take.append(rows)

    def grow(prefix: tuple[int, ...], n: int, d: int, out: list[tuple[int, ...]]) -> None:
        for i in range(ranks):
            if n <= 0 or d <= 0:
                return
            s = take[d][i][n]
            if s == 0:
                return
            out.append(prefix + (i,))
            grow(prefix + (i,), s - 1, d - 1, out)
            n -= s

    trees = []
    for n in range(n_max + 1):
        out: list[tuple[int, ...]] = []
        grow((), n, levels, out)
        trees.append((tuple(sorted(out, key=lambda c: (len(c), c))), best[levels][n] if levels else 0.0))
    return trees


def sequoia_tree(p: Sequence[float], budget: int, depth: int | None = None) -> Choices:
    """The tree of at most ``budget`` nodes (and ``depth`` levels) with the most expected accepted
    tokens under the positional acceptance vector ``p`` (:func:`optimal_trees`)."""
    return optimal_trees(p, budget, depth)[budget][0]


# The most nodes a Sequoia tree whose budget the cost curves choose may hold, and the rows of the
# curves measured for it (its verify pass scores the root and every node).
SEQUOIA_MAX_BUDGET = 31
SEQUOIA_ROWS = SEQUOIA_MAX_BUDGET + 1


def tree_draft_cost(choices: Sequence[tuple[int, ...]], draft: CostModel | None) -> float:
    """Seconds a draft model with the cost curve ``draft`` (None: a free drafter) takes to draft
    the static tree ``choices`` as :class:`~specdec.drafters.tree.TreeDrafter` does: a one-row
    pass after the context, then one pass per level over that level's nodes that have children."""
    if draft is None or not choices:
        return 0.0
    parents: dict[int, set[tuple[int, ...]]] = {}
    for path in choices:
        if len(path) > 1:
            parents.setdefault(len(path) - 1, set()).add(path[:-1])
    return draft.target_cost(1) + sum(draft.target_cost(len(nodes)) for nodes in parents.values())


def sequoia_budget(
    p: Sequence[float], costs: CostModel, *, max_budget: int = SEQUOIA_MAX_BUDGET, depth: int | None = None,
) -> tuple[tuple[tuple[int, ...], ...], float, float]:
    """The hardware-aware Sequoia tree (Chen et al. 2024): among the optimal trees of every budget
    n = 1..max_budget for the positional acceptance vector ``p`` (:func:`optimal_trees`),
    the one with the most expected tokens per second, (1 + E(n)) / (draft(n) + target(n + 1 rows)):
    the target's pass from ``costs.target``, the draft's level passes from ``costs.draft_rows``
    (:func:`tree_draft_cost`; None: drafting taken as free). Ties go to the smaller tree.
    Returns (its choices, 1 + E, expected tokens per second)."""
    draft = CostModel(costs.draft_rows) if costs.draft_rows else None
    best: tuple[tuple[tuple[int, ...], ...], float, float] = ((), 1.0, 0.0)
    for choices, value in optimal_trees(p, max_budget, depth)[1:]:
        if not choices:
            continue
        rate = (1.0 + value) / (tree_draft_cost(choices, draft) + costs.target_cost(len(choices) + 1))
        if rate > best[2] * (1.0 + 1e-12):
            best = (choices, 1.0 + value, rate)
    return best


class PositionalAcceptance:
    """The positional acceptance vector, counted from verification outcomes.

    Each verified step walks the accepted path: every node on it that had children contributes a
    trial to each of its children's ranks, and a hit to the rank of the child that was accepted
    (none where the verifier appended a token of its own there). p_k = (hits_k + w prior_k) /
    (trials_k + w): the prior (:func:`prior_vector`) with weight w until enough trials are seen.
    Older outcomes fade by ``decay`` per recorded node, so the vector follows the text.
    """

    def __init__(self, ranks: int = DEFAULT_RANKS, *, prior: Sequence[float] | None = None,
                 prior_weight: float = 4.0, decay: float = 0.99) -> None:
        if ranks <= 0:
            raise ValueError(f"the number of ranks must be positive, got {ranks}")
        self.prior = list(prior) if prior is not None else prior_vector(ranks)
        if len(self.prior) != ranks:
            raise ValueError(f"the prior needs {ranks} entries, got {len(self.prior)}")
        if not 0.0 < decay <= 1.0 or prior_weight <= 0.0:
            raise ValueError("decay must be in (0, 1] and the prior's weight positive")
        self.prior_weight, self.decay = prior_weight, decay
        self.hits = [0.0] * ranks
        self.trials = [0.0] * ranks
        self.seen = 0  # nodes recorded

    def record(self, offered: int, accepted: int | None) -> None:
        """A node had ``offered`` children (ranks 0..offered - 1); the verifier kept the child of
        rank ``accepted`` (None: none of them)."""
        d = self.decay
        self.hits = [h * d for h in self.hits]
        self.trials = [t * d for t in self.trials]
        for k in range(min(offered, len(self.trials))):
            self.trials[k] += 1.0
        if accepted is not None and accepted < len(self.hits):
            self.hits[accepted] += 1.0
        self.seen += 1

    @property
    def vector(self) -> list[float]:
        """p_k for every rank k."""
        w = self.prior_weight
        return [(h + w * q) / (t + w) for h, t, q in zip(self.hits, self.trials, self.prior)]


__all__ = ["Choices", "PositionalAcceptance", "expected_accepted", "optimal_trees", "prior_vector", "sequoia_tree"]
