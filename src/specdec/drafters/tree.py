"""Draft token trees with a draft model: static (Medusa-style choices), confident (a chain that
forks where the draft is unsure), dynamic (EAGLE-2-style) or Sequoia (Chen et al. 2024: the static
shape with the most expected accepted tokens for the measured positional acceptance vector, its
node budget chosen from the measured cost curves; :mod:`specdec.sequoia`).

Under greedy decoding, children are the draft's most likely tokens at their parent, so the tree
is a deterministic function of the context. Under sampling, each node's children are drawn from
the draft's sampling law there without replacement (their number fixed before they are drawn) and
the tree carries those laws, which :class:`~specdec.verify.tree.TreeVerifier` needs (traversal
verification). The draft scores each depth of the tree in one forward pass with a tree mask, then its
cache is rolled back to the context.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specdec.backends.base import CausalLM, forward_after, rollback
from specdec.costs import ASSUMED_ROW_COST, CostModel, row_costs
from specdec.drafters.base import DEFAULT_K_MAX, DEFAULT_THRESHOLD, Drafter, KeepGoing
from specdec.sampling import SamplingConfig, gumbel_max, logits_to_probs
from specdec.sequoia import (
    DEFAULT_RANKS, SEQUOIA_MAX_BUDGET, SEQUOIA_ROWS, PositionalAcceptance, sequoia_budget, sequoia_tree,
)
from specdec.token_tree import TokenTree, sample_children, top_children

# The tree that --verify tree drafts unless told otherwise: the confident tree with the confidence
# policy's threshold (the best tree measured on the default pair).
DEFAULT_TREE: dict = {"mode": "confident", "threshold": 0.8}

# A Sequoia tree is built again once an entry of the positional acceptance vector has moved this
# far from the vector it was built for (the dynamic program takes 5-25 ms for budgets of 16-32
# nodes in Python, so it is not run every step).
REBUILD_CHANGE = 0.02

# A small Medusa-style tree: each tuple is the path of child ranks from the root.
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,),
    (0, 0), (0, 1), (1, 0), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0),
)


def parse_choices(text: str) -> tuple[tuple[int, ...], ...]:
    """A static tree written as text: ``default`` (:data:`DEFAULT_CHOICES`) or rank paths joined
    by ``|``, ranks within a path by ``.``: ``0|1|0.0`` is the root's two likeliest (under
    sampling: first two drawn) children and the first child's first child."""
    if text == "default":
        return DEFAULT_CHOICES
    try:
        paths = tuple(tuple(int(r) for r in path.split(".")) for path in text.split("|"))
    except ValueError:
        raise ValueError(
            f"tree choices {text!r}: write 'default' or rank paths like 0|1|0.0 (paths joined by '|', "
            "ranks by '.')"
        ) from None
    known = set(paths)
    for path in paths:  # ranks count from 0 at each node, so a rank r needs ranks 0 .. r-1 beside it
        if any(r < 0 for r in path):
            raise ValueError(f"tree choices {text!r}: ranks count from 0, got the path {_dotted(path)}")
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in known:
            raise ValueError(f"tree choices {text!r}: the path {_dotted(path)} needs its elder sibling "
                             f"{_dotted(path[:-1] + (path[-1] - 1,))} listed too (ranks at a node run 0, 1, 2, ...)")
    return paths


def _dotted(path: tuple[int, ...]) -> str:
    return ".".join(map(str, path))


class TreeDrafter:
    """Builds a token tree under the context with a draft model, by one of three algorithms
    (``mode``, :data:`TREE_MODES`).

    Static: ``choices`` lists every node as its path of child ranks (under sampling, rank r is
    the r-th child drawn). Confident (``threshold`` given): the confidence policy's chain with a
    fork where it stops; at each node the draft's top probability decides: at least ``threshold``,
    one child, which is drafted on (under sampling even if the draw was not the top token, as the
    confidence policy's chain does); below it, ``width`` children and the tree ends there (at
    most ``depth`` levels, ``budget`` nodes).
    Sequoia: the static tree of :func:`specdec.sequoia.sequoia_tree` for the positional acceptance
    vector counted from this drafter's verified steps (:meth:`observe`; ``width`` ranks, a prior
    until enough are seen), at most ``depth`` levels, ``budget`` nodes; without a budget, the tree of
    1..31 nodes with the most expected tokens per second on the measured cost curves
    (:func:`~specdec.sequoia.sequoia_budget`; :meth:`bind` measures them, ``costs`` injects them).
    Dynamic: at each of ``depth`` levels, the ``expand``
    best new nodes (by the product of draft probabilities along their path) get ``width``
    children; under greedy decoding they are the most likely ones and finally the ``budget`` best
    nodes overall are kept (a child never scores above its parent, so the kept set is a tree);
    under sampling they are drawn, and children stop being added once ``budget`` nodes exist (a
    drawn child is never dropped: that would bias the draws the verifier relies on).
    """

    name = "tree"

    def __init__(
        self,
        model: CausalLM,
        *,
        mode: str | None = None,
        choices: Sequence[tuple[int, ...]] | None = None,
        depth: int | None = None,
        width: int | None = None,
        expand: int | None = None,
        budget: int | None = None,
        threshold: float | None = None,
        costs: CostModel | None = None,
    ) -> None:
        """mode: one of :data:`TREE_MODES`; left out, ``choices`` make a static tree, a
        ``threshold`` a confident one, neither a dynamic one. A confident tree without a threshold
        takes the confidence policy's (0.8), a static one without choices
        :data:`DEFAULT_CHOICES`. depth and width default to 16 (the confidence policy's k_max)
        and 2 for a confident tree, 5 and 4 for a dynamic one, 16 levels and 8 ranks for a Sequoia
        tree. budget: 16 nodes, except for a Sequoia tree (there: chosen by the cost curves).
        costs: a Sequoia tree's cost curves (the target's rows, the draft's in ``draft_rows``)
        instead of measuring them in :meth:`bind`."""
        mode, choices, threshold = _resolve_mode(mode, choices, threshold)
        confident, sequoia = mode == "confident", mode == "sequoia"
        if expand is not None and sequoia:
            raise ValueError("expand shapes the dynamic tree; the sequoia tree takes none")
        if costs is not None and not sequoia:
            raise ValueError(f"cost curves choose a Sequoia tree's budget; the {mode} tree takes none")
        self.fixed_budget = budget if sequoia else None  # None: a Sequoia budget chosen by the cost curves
        budget = (SEQUOIA_MAX_BUDGET if sequoia else 16) if budget is None else budget
        expand = 4 if expand is None else expand
        depth = (DEFAULT_K_MAX if confident or sequoia else 5) if depth is None else depth
        width = (2 if confident else DEFAULT_RANKS if sequoia else 4) if width is None else width
        for label, value in (("depth", depth), ("width", width), ("expand", expand), ("budget", budget)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"tree {label} must be a positive integer, got {value!r}")
        if choices is not None:
            choices = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
            known = set(choices)
            if not choices or any(not c or (len(c) > 1 and c[:-1] not in known) for c in choices):
                raise ValueError("tree choices must be non-empty rank paths whose prefixes are listed too")
            depth = len(choices[-1])
        if threshold is not None and not 0.0 <= threshold <= 1.0:
            raise ValueError(f"the tree's confidence threshold must be in [0, 1], got {threshold}")
        self.mode = mode
        self.threshold = threshold
        self.model = model
        self.choices = choices
        self.depth, self.width, self.expand, self.budget = depth, width, expand, budget
        self.costs = costs
        # A Sequoia tree's state: the positional acceptance vector, the tree built for it, and the
        # last tree proposed (context length, tokens, parents, rank paths), read back in observe().
        self.acceptance = PositionalAcceptance(width) if sequoia else None
        self._built_for: list[float] | None = None
        self._proposed: tuple[int, list[int], list[int], list[tuple[int, ...]]] | None = None
        self.rebuilds = 0  # Sequoia trees built

    def bind(self, target: CausalLM) -> None:
        """A Sequoia tree whose budget the cost curves choose: measure the target's and the draft's
        passes of 1..32 rows (or read them from the planner's cache, :func:`~specdec.costs.row_costs`)."""
        if self.mode != "sequoia" or self.fixed_budget is not None or self.costs is not None:
            return
        target_curve, source = row_costs(target, SEQUOIA_ROWS)
        draft_curve, _ = row_costs(self.model, SEQUOIA_ROWS)
        self.costs = CostModel(target_curve, source=source, draft_rows=draft_curve)

    def sequoia_choices(self) -> tuple[tuple[int, ...], ...]:
        """The Sequoia tree for the current positional acceptance vector (built again only once
        the vector has moved by :data:`REBUILD_CHANGE`)."""
        p = self.acceptance.vector
        if self._built_for is None or max(abs(a - b) for a, b in zip(p, self._built_for)) > REBUILD_CHANGE:
            if self.fixed_budget is not None:
                self.choices = sequoia_tree(p, self.fixed_budget, self.depth)
            else:
                costs = self.costs or CostModel([1.0 + ASSUMED_ROW_COST * n for n in range(SEQUOIA_ROWS)],
                                                source="assumed (not measured)")
                self.choices = sequoia_budget(p, costs, depth=self.depth)[0]
            self.choices = self.choices or ((0,),)  # every rank never kept: still draft one token
            self._built_for = p
            self.rebuilds += 1
        return self.choices

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def propose_tree(
        self,
        context: Sequence[int],
        sampling: SamplingConfig,
        max_depth: int,
        generator: torch.Generator | None = None,
    ) -> TokenTree:
        """A tree of depth at most ``max_depth`` under ``context`` (empty if max_depth is 0)."""
        sampled = not sampling.greedy
        # Greedy ranks by the plain softmax (the verifier never reads it); sampling draws from its law.
        law = sampling if sampled else SamplingConfig(temperature=1.0)
        if self.mode == "confident":
            return self._propose_confident(context, law, sampled, min(self.depth, max_depth), generator)
        if self.mode == "sequoia":
            depth = len(self.sequoia_choices()[-1])
            return self._propose_levels(context, law, sampled, min(depth, max_depth), generator)
        return self._propose_levels(context, law, sampled, min(self.depth, max_depth), generator)

    def _propose_levels(
        self, context: Sequence[int], law: SamplingConfig, sampled: bool, depth: int,
        generator: torch.Generator | None,
    ) -> TokenTree:
        """The static and the dynamic trees (class docstring), grown a level at a time."""
        tokens: list[int] = []
        parents: list[int] = []
        ranks: list[tuple[int, ...]] = []  # each node's path of child ranks
        score: list[float] = []  # product of draft probabilities along each node's path
        drawn_from: dict[int, torch.Tensor] = {}  # sampled trees: node -> law of its children [V]
        if depth <= 0:
            return TokenTree([], [], torch.zeros(1, self.vocab_size) if sampled else None)
        frontier, probs = [-1], logits_to_probs(forward_after(self.model, context), law)  # [1, V]
        fed: list[int] = []  # tree nodes in the draft's cache after the context, in cache order
        for level in range(1, depth + 1):
            new = []
            for node, row in zip(frontier, probs):
                prefix, base = (ranks[node], score[node]) if node >= 0 else ((), 1.0)
                child_ranks = self._ranks(prefix, room=self.budget - len(tokens) if sampled else None)
                if sampled:
                    picks = _draw_children(row, len(child_ranks), law, generator, len(context) + level - 1)
                    if picks:
                        drawn_from[node] = row
                    children = [(r, tok, float(row[tok])) for r, tok in zip(child_ranks, picks)]
                else:
                    top = top_children(row, 1 + max(child_ranks, default=-1))
                    children = [(r, *top[r]) for r in child_ranks if r < len(top)]
                for r, tok, prob in children:
                    tokens.append(tok)
                    parents.append(node)
                    ranks.append(prefix + (r,))
                    score.append(base * prob)
                    new.append(len(tokens) - 1)
            if self.mode == "dynamic":
                frontier = sorted(new, key=lambda i: -score[i])[: self.expand]
            else:
                frontier = [i for i in new if any(len(c) > level and c[:level] == ranks[i] for c in self.choices)]
            if level == depth or not frontier or (sampled and self.mode == "dynamic" and len(tokens) >= self.budget):
                break
            probs = logits_to_probs(self._feed(context, parents, tokens, fed, frontier), law)
        rollback(self.model, context)
        if self.acceptance is not None:
            self._proposed = (len(context), tokens, parents, ranks)
        if sampled:
            return self._sampled_tree(tokens, parents, drawn_from)
        if len(tokens) > self.budget and self.mode == "dynamic":
            return _prune(tokens, parents, score, self.budget)
        return TokenTree(tokens, parents)

    def _propose_confident(
        self, context: Sequence[int], law: SamplingConfig, sampled: bool, depth: int,
        generator: torch.Generator | None,
    ) -> TokenTree:
        """The confident tree (class docstring): a chain while the draft is sure, a fork where it
        is not. A node's number of children is fixed by its own distribution before they are
        drawn, and whether a child is drafted on depends only on its path, as the sampled tree's
        verifier requires."""
        tokens: list[int] = []
        parents: list[int] = []
        drawn_from: dict[int, torch.Tensor] = {}  # sampled trees: node -> law of its children [V]
        fed: list[int] = []  # nodes in the draft's cache after the context, in cache order
        node = -1
        row = logits_to_probs(forward_after(self.model, context), law)[-1] if depth > 0 else None  # [V]
        for level in range(1, depth + 1):
            sure = float(row.max()) >= self.threshold
            count = min(1 if sure else self.width, self.budget - len(tokens))
            if sampled:
                picks = _draw_children(row, count, law, generator, len(context) + level - 1)
                if picks:
                    drawn_from[node] = row
            else:
                picks = [tok for tok, _ in top_children(row, count)]
            for tok in picks:
                tokens.append(tok)
                parents.append(node)
            if not (sure and picks and level < depth and len(tokens) < self.budget):
                break
            node = len(tokens) - 1
            row = logits_to_probs(self._feed(context, parents, tokens, fed, [node]), law)[-1]
        rollback(self.model, context)
        return self._sampled_tree(tokens, parents, drawn_from) if sampled else TokenTree(tokens, parents)

    def _sampled_tree(self, tokens: list[int], parents: list[int], drawn_from: dict[int, torch.Tensor]) -> TokenTree:
        """The tree with its draft laws: row 1 + u of q [1 + N, V] is the law node u's children
        were drawn from (zeros for a node without children)."""
        q = torch.zeros(1 + len(tokens), self.vocab_size)  # [1 + N, V]
        for node, row in drawn_from.items():
            q[1 + node] = row
        return TokenTree(tokens, parents, q)

    def observe(self, context: Sequence[int]) -> None:
        rollback(self.model, context)
        if self._proposed is not None:
            self._count_outcome(context)

    def _count_outcome(self, context: Sequence[int]) -> None:
        """A Sequoia tree's verified step, read from the output: down the path the verifier kept,
        each node with children offered their ranks, and the child whose token came next (if any)
        was the one accepted (:meth:`PositionalAcceptance.record`)."""
        start, tokens, parents, ranks = self._proposed
        self._proposed = None
        kids: dict[int, list[int]] = {}
        for i, par in enumerate(parents):
            kids.setdefault(par, []).append(i)
        node, at = -1, start
        while node in kids and at < len(context):
            hit = next((i for i in kids[node] if tokens[i] == context[at]), None)
            self.acceptance.record(len(kids[node]), None if hit is None else ranks[hit][-1])
            if hit is None:
                return
            node, at = hit, at + 1

    def _ranks(self, prefix: tuple[int, ...], room: int | None) -> list[int]:
        """The child ranks a node with rank path ``prefix`` gets, at most ``room`` (dynamic trees)."""
        if self.choices is not None:
            return sorted(c[-1] for c in self.choices if c[:-1] == prefix)
        return list(range(self.width if room is None else max(0, min(self.width, room))))

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


class Trees(Drafter):
    """A drafter of token trees (:class:`TreeDrafter`, or the heads' static Medusa tree: anything
    with ``propose_tree``) seen as the engine sees every drafter: each step's draft is a
    :class:`~specdec.token_tree.TokenTree` at most k levels deep, k being the room left (the tree's own
    shape, not a draft-length policy, decides how much is drafted)."""

    def __init__(self, drafter: "TreeDrafter | Any") -> None:
        self.drafter = drafter
        self.name = drafter.name

    @property
    def vocab_size(self) -> int:
        return self.drafter.vocab_size

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        keep_going: KeepGoing | None = None,
        source: str | None = None,
    ) -> TokenTree:
        return self.drafter.propose_tree(context, sampling, max_depth=k, generator=generator)

    def observe(self, context: Sequence[int]) -> None:
        self.drafter.observe(context)


TREE_MODES = ("confident", "dynamic", "sequoia", "static")


def _resolve_mode(
    mode: str | None, choices: Sequence[tuple[int, ...]] | None, threshold: float | None
) -> tuple[str, Sequence[tuple[int, ...]] | None, float | None]:
    """(mode, choices, threshold) with the mode named and its defaults filled in."""
    if mode is None:
        if threshold is not None and choices is not None:
            raise ValueError("a static tree (choices) has a fixed shape; a threshold shapes a confident tree")
        mode = "static" if choices is not None else "confident" if threshold is not None else "dynamic"
    if mode not in TREE_MODES:
        raise ValueError(f"unknown tree mode {mode!r}; choose one of {', '.join(TREE_MODES)}")
    if choices is not None and mode != "static":
        raise ValueError(f"tree choices fix a static tree's shape; the {mode} tree takes none")
    if threshold is not None and mode != "confident":
        raise ValueError(f"a threshold shapes a confident tree; the {mode} tree takes none")
    if mode == "static" and choices is None:
        choices = DEFAULT_CHOICES
    if mode == "confident" and threshold is None:
        threshold = DEFAULT_THRESHOLD
    return mode, choices, threshold


def _prune(tokens: list[int], parents: list[int], score: list[float], budget: int) -> TokenTree:
    """Keep the ``budget`` best-scoring nodes (ancestor-closed), parents first."""
    kept = sorted(sorted(range(len(tokens)), key=lambda i: (-score[i], i))[:budget])
    index = {old: new for new, old in enumerate(kept)}
    return TokenTree([tokens[i] for i in kept], [index[parents[i]] if parents[i] >= 0 else -1 for i in kept])


def _draw_children(
    q: torch.Tensor, count: int, sampling: SamplingConfig, generator: torch.Generator | None, position: int
) -> list[int]:
    """Up to ``count`` distinct children drawn from the draft's law ``q`` ([V]) at ``position``:
    without replacement with ``generator`` (:func:`sample_children`), or under the Gumbel-max
    sampler the ``count`` largest of log q + the position's noise (Gumbel-top-k), whose first is
    the draft's own Gumbel-max token, the one most likely to be the target's there."""
    if sampling.coupled:
        return gumbel_max(torch.log(q.double()), sampling.gumbel_seed, position, count)
    return sample_children(q, count, generator)

