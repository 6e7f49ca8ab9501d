"""Sequoia trees: the dynamic program against brute force, the hardware-aware budget, the
positional acceptance vector, and the tree drafter's ``mode=sequoia`` (exact law under traversal
verification, greedy equality on torch and llama.cpp, Gumbel-seeded identity)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from specdec import SamplingConfig, generate
from specdec.backends.hf import HFCausalLM
from specdec.config import DecodeConfig
from specdec.drafters.tree import TreeDrafter, Trees
from specdec.engine import autoregressive_steps, speculative_steps, tree_steps
from specdec.policies import StaticK
from specdec.costs import CostModel
from specdec.sequoia import (
    PositionalAcceptance, expected_accepted, optimal_trees, prior_vector, sequoia_budget, sequoia_tree, tree_draft_cost,
)
from specdec.token_tree import TokenTree
from specdec.verify.tree import TreeVerifier
from helpers import THREADS, PROMPT, assert_same_law, cases, drafted_tree_joint, orderings, target_joint
from tiny import noisy_copy, tiny_llama

# --- the dynamic program -----------------------------------------------------------------------------


def all_forests(n: int, depth: int) -> list[list[tuple[int, ...]]]:
    """Every tree of at most ``n`` nodes and ``depth`` levels under a root whose nodes' children
    are rank prefixes (ranks 0..m-1), as rank paths."""
    if n == 0 or depth == 0:
        return [[]]

    def sizes(left: int, m: int):  # m subtree sizes >= 1 summing to at most left
        if m == 0:
            yield ()
            return
        for s in range(1, left - m + 2):
            for rest in sizes(left - s, m - 1):
                yield (s,) + rest

    found = []
    for m in range(n + 1):
        for split in sizes(n, m):
            for subs in itertools.product(*(all_forests(s - 1, depth - 1) for s in split)):
                paths = []
                for rank, sub in enumerate(subs):
                    paths += [(rank,)] + [(rank,) + path for path in sub]
                found.append(paths)
    return found


def vectors() -> list[list[float]]:
    rng = random.Random(7)
    out = [prior_vector(4), [0.9, 0.05, 0.03], [0.3, 0.3, 0.3], [0.5, 0.0, 0.2], [1.0, 0.0]]
    for _ in range(6):
        raw = [rng.random() for _ in range(rng.choice([2, 3, 4]))]
        scale = rng.random() / sum(raw)
        out.append([x * scale for x in raw])  # not sorted: the program needs no order
    return out


FORESTS = {(n, d): all_forests(n, d) for n in range(8) for d in (1, 2, 3, 7)}


@pytest.mark.parametrize("p", vectors(), ids=lambda p: ",".join(f"{x:.2f}" for x in p))
@pytest.mark.parametrize("depth", [None, 1, 2, 3])
def test_the_dynamic_program_finds_the_best_tree_of_every_budget(p, depth):
    """Against every rooted ordered tree of up to 7 nodes whose children are rank prefixes: the
    program's value is the best one, and its tree has that value, its budget and its depth."""
    trees = optimal_trees(p, 7, depth)
    for n in range(8):
        best = max(expected_accepted(forest, p) for forest in FORESTS[n, depth or 7])
        choices, value = trees[n]
        assert value == pytest.approx(best, abs=1e-12)
        assert expected_accepted(choices, p) == pytest.approx(value, abs=1e-12)
        assert len(choices) <= n and all(len(c) <= (depth or n) for c in choices)
        known = set(choices)
        assert all(c[:-1] in known or len(c) == 1 for c in choices)  # parents listed
        assert all(c[-1] == 0 or c[:-1] + (c[-1] - 1,) in known for c in choices)  # rank prefixes
        assert list(choices) == sorted(choices, key=lambda c: (len(c), c))


def test_the_expected_value_of_a_tree_is_the_sum_of_its_path_products():
    p = [0.5, 0.25]
    assert expected_accepted([(0,), (1,), (0, 0), (0, 1), (1, 0)], p) == pytest.approx(
        0.5 + 0.25 + 0.25 + 0.125 + 0.125)
    assert expected_accepted([(0,), (0, 0), (0, 0, 0)], [1.0]) == 3.0  # a chain that is always accepted
    assert expected_accepted([(0,), (1,), (2,)], [0.5, 0.25]) == 0.75  # a rank past the vector: never


def test_certain_acceptance_gives_a_chain_and_bad_input_is_refused():
    assert sequoia_tree([1.0, 0.0], 4) == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    assert sequoia_tree([0.9, 0.5], 3, depth=2) == ((0,), (1,), (0, 0))  # 0.9 + 0.5 + 0.81 beats 0.9 + 0.81 + 0.45
    assert sequoia_tree([0.6], 5, depth=1) == ((0,),)  # nothing to add past one rank at depth 1
    with pytest.raises(ValueError, match="budget"):
        optimal_trees([0.5], -1)
    with pytest.raises(ValueError, match="depth"):
        optimal_trees([0.5], 3, depth=0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        optimal_trees([1.5], 3)


# --- the hardware-aware budget -------------------------------------------------------------------------

ROWS = range(1, 33)


def test_the_budget_is_the_tree_with_the_most_tokens_per_second():
    p = prior_vector(8)
    costs = CostModel([1.0 + 0.03 * (n - 1) for n in ROWS], draft_rows=[0.1 + 0.01 * (n - 1) for n in ROWS])
    choices, tokens, rate = sequoia_budget(p, costs)
    draft = CostModel(costs.draft_rows)
    rates = [(1 + value) / (tree_draft_cost(c, draft) + costs.target_cost(len(c) + 1))
             for c, value in optimal_trees(p, 31, None)[1:]]
    assert rate == pytest.approx(max(rates)) and tokens == pytest.approx(1 + expected_accepted(choices, p))
    free = sequoia_budget(p, CostModel([1.0] * 32))  # rows and drafting free: the largest tree
    dear = sequoia_budget(p, CostModel([0.9 + 0.5 * (n - 1) for n in ROWS]))  # every row half a step
    assert len(free[0]) == 31 and len(dear[0]) < len(choices) < 31


def test_the_draft_cost_of_a_tree_is_one_pass_per_level():
    draft = CostModel([1.0, 1.5, 2.0, 2.5])
    # the root's pass (1 row), level 1: nodes (0,) and (1,) have children (2 rows), level 2: (0, 0) (1 row)
    assert tree_draft_cost([(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)], draft) == 1.0 + 1.5 + 1.0
    assert tree_draft_cost([(0,)], None) == 0.0


# --- the positional acceptance vector ------------------------------------------------------------------


def test_the_vector_starts_at_the_prior_and_moves_to_what_is_counted():
    acc = PositionalAcceptance(3, decay=1.0)
    assert acc.vector == pytest.approx(prior_vector(3))
    for step in range(400):  # rank 0 kept half the time, rank 1 a quarter, rank 2 never
        acc.record(3, [0, 1, None, 0][step % 4])
    assert acc.vector == pytest.approx([0.5, 0.25, 0.0], abs=0.01)
    acc.record(1, None)  # a node with one child counts a trial for rank 0 only
    assert acc.trials[0] == acc.trials[1] + 1


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, vocab=16, sharpness=10.0)
    return target, noisy_copy(target, 0.3)


def test_the_drafter_counts_the_ranks_the_verifier_kept(pair):
    """The drafter reads each step's outcome back from the output: with the target as its own draft
    under greedy decoding the first child is kept at every node down to the leaves."""
    target, _ = pair
    drafter = TreeDrafter(HFCausalLM(target), mode="sequoia", budget=6)
    steps = list(tree_steps(HFCausalLM(target), drafter, PROMPT, sampling=SamplingConfig(), max_new_tokens=40))
    assert drafter.acceptance.seen > len(steps)
    assert drafter.acceptance.hits[0] == pytest.approx(drafter.acceptance.trials[0])
    assert sum(drafter.acceptance.hits[1:]) == 0 and drafter.acceptance.vector[0] > 0.9
    assert drafter.rebuilds >= 2 and drafter.choices == sequoia_tree(drafter.acceptance.vector, 6, 16)
    assert len(drafter.choices[-1]) == 6  # a chain once the first child is always right


# --- exactness ---------------------------------------------------------------------------------------


def static_sampled_trees(q, context: tuple[int, ...], choices, room: int):
    """Every tree the sampled static drafter builds for ``choices`` (at most ``room`` levels), with
    its probability: each node's children drawn from q without replacement, as many as it has ranks
    (fewer where q's support is smaller; a missing rank drops its subtree)."""
    vocab = len(q(context))
    choices = [c for c in choices if len(c) <= room]
    if not choices:
        yield 1.0, TokenTree([], [], torch.zeros(1, vocab, dtype=torch.float64))
        return
    ranks_under: dict[tuple[int, ...], int] = {}
    for c in choices:
        ranks_under[c[:-1]] = max(ranks_under.get(c[:-1], 0), c[-1] + 1)

    def grow(frontier, tokens, parents, rows, prob):
        if not frontier:
            law = torch.zeros(1 + len(tokens), vocab, dtype=torch.float64)
            for node, row in rows.items():
                law[1 + node] = torch.tensor(row)
            yield prob, TokenTree(list(tokens), list(parents), law)
            return
        (node, path, ctx), rest = frontier[0], frontier[1:]
        width = ranks_under.get(path, 0)
        if width == 0:
            yield from grow(rest, tokens, parents, rows, prob)
            return
        row = q(ctx)
        for seq, p_seq in orderings(row, width):
            t, par, new = list(tokens), list(parents), []
            for rank, tok in enumerate(seq):
                t.append(tok)
                par.append(node)
                new.append((len(t) - 1, path + (rank,), ctx + (tok,)))
            yield from grow(rest + new, t, par, {**rows, node: row}, prob * p_seq)

    # The frontier is a queue: nodes are grown a level at a time, as the drafter grows them.
    yield from grow([(-1, (), context)], [], [], {}, 1.0)


def sequoia_trees_at(q, p_of):
    """Each step's Sequoia tree built for a vector ``p_of(seq)`` that depends on the output so far
    (as the drafter's counted vector does), its children sampled."""
    return lambda seq, room: static_sampled_trees(q, seq, sequoia_tree(p_of(seq), 5, depth=3), room)


@pytest.mark.parametrize("case", sorted(cases(4)))
def test_sampled_sequoia_trees_keep_the_target_law_exactly(case):
    """Traversal verification of Sequoia-shaped trees with sampled children (shapes that change
    with the output, as the counted vector does): the output law over 3 tokens equals the target's
    to 1e-9."""
    p, q = cases(4)[case]
    shapes = [[0.9, 0.05], [0.5, 0.3, 0.1], [0.3, 0.3, 0.3]]
    assert len({sequoia_tree(v, 5, depth=3) for v in shapes}) == 3  # three different shapes
    assert any(len(set(c[-1] for c in sequoia_tree(v, 5, depth=3))) > 1 for v in shapes)  # with forks
    joint = drafted_tree_joint(p, 3, sequoia_trees_at(q, lambda seq: shapes[sum(seq) % 3]))
    assert_same_law(joint, target_joint(p, 4, 3))


def test_a_sequoia_tree_whose_shape_follows_its_own_draws_is_caught():
    """Negative control: dropping the root's first drawn child (and its subtree) whenever it is
    token 0 (the shape then follows the dropped node's own draw, not earlier outcomes) biases the
    output, and the enumeration sees it."""
    p, q = cases(4)["random"]
    shape = sequoia_tree([0.5, 0.3], 4, depth=2)
    assert (1,) in shape and (0, 0) in shape

    def peeking(seq, room):
        for prob, tree in static_sampled_trees(q, seq, shape, room):
            if len(tree) and tree.tokens[0] == 0:
                kept = [i for i, path in enumerate(_paths(tree)) if path[0] != 0]
                index = {old: new for new, old in enumerate(kept)}
                yield prob, TokenTree([tree.tokens[i] for i in kept],
                                      [index[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in kept],
                                      tree.q[[0] + [1 + i for i in kept]])
            else:
                yield prob, tree

    with pytest.raises(AssertionError, match="laws differ"):
        assert_same_law(drafted_tree_joint(p, 3, peeking), target_joint(p, 4, 3))


def _paths(tree: TokenTree) -> list[tuple[int, ...]]:
    """Each node's rank path (its position among its parent's children, down from the root)."""
    kids = tree.child_lists()
    rank = {c: r for children in kids for r, c in enumerate(children)}
    return [tuple(rank[n] for n in tree.path(i)) for i in range(len(tree))]


@pytest.mark.parametrize("tree", [dict(mode="sequoia"), dict(mode="sequoia", budget=10, depth=4, width=3)],
                         ids=["budget-from-costs", "fixed-budget"])
def test_greedy_sequoia_equals_autoregressive(pair, tree):
    target, draft = pair
    ar = generate(target, PROMPT, max_new_tokens=40)
    spec = generate(target, PROMPT, draft=draft, verify="tree", tree=tree, max_new_tokens=40)
    assert spec.token_ids == ar.token_ids
    assert spec.stats.mean_accepted_per_forward > 1.0
    assert spec.method == str(DecodeConfig(drafter="model", verify="tree", tree=tree)) and spec.shape.startswith("sequoia")


def test_the_text_form_says_a_sequoia_tree(pair):
    target, draft = pair
    config = DecodeConfig.parse("spec:tree:mode=sequoia:budget=8")
    assert config.tree == {"mode": "sequoia", "budget": 8} and str(config) == "spec:tree:budget=8:mode=sequoia"
    result = generate(target, PROMPT, draft=draft, config=config, max_new_tokens=20)
    assert result.method == "spec:model:tree:budget=8:mode=sequoia" and result.shape == "sequoia:budget=8"
    for bad, message in (("threshold=0.5", "threshold shapes a confident tree"),
                         ("expand=2", "expand shapes the dynamic tree"),
                         ("choices=0|1", "choices fix a static tree")):
        with pytest.raises(ValueError, match=message):
            DecodeConfig.parse(f"spec:tree:mode=sequoia:{bad}")


CHEAP = CostModel([1.0 + 0.05 * (n - 1) for n in ROWS], draft_rows=[0.05 + 0.005 * (n - 1) for n in ROWS])


def test_cheap_rows_give_a_larger_tree_than_dear_ones(pair):
    target, draft = pair
    trees = {}
    for name, costs in (("cheap", CHEAP), ("dear", CostModel([0.9 * n for n in ROWS], draft_rows=[0.5] * 32))):
        drafter = TreeDrafter(HFCausalLM(draft), mode="sequoia", costs=costs)
        steps = list(tree_steps(HFCausalLM(target), drafter, PROMPT, sampling=SamplingConfig(), max_new_tokens=30))
        assert [t for s in steps for t in s.tokens] == generate(target, PROMPT, max_new_tokens=30).token_ids
        trees[name] = drafter.choices
    assert len(trees["cheap"]) > len(trees["dear"])


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_gumbel_seeded_sequoia_gives_plain_decodings_tokens(temperature, top_k):
    model = tiny_llama(3, vocab=16, layers=2, sharpness=4.0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    kept = 0
    for seed in (4, 5):
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, gumbel_seed=seed)
        expected = [t for s in autoregressive_steps(HFCausalLM(model), prompt, sampling=sampling, max_new_tokens=30)
                    for t in s.tokens]
        for options in (dict(costs=CHEAP), dict(budget=7)):
            drafter = TreeDrafter(HFCausalLM(noisy_copy(model, 0.3)), mode="sequoia", **options)
            steps = list(speculative_steps(HFCausalLM(model), Trees(drafter), TreeVerifier(), StaticK(1 << 30),
                                           prompt, sampling=sampling, max_new_tokens=30))
            assert [t for s in steps for t in s.tokens] == expected, (seed, options)
            kept += sum(s.accepted for s in steps)
    assert kept > 0


def test_sampled_sequoia_through_the_engine_draws_from_the_draft(pair):
    """Under multinomial sampling the drafter's trees carry the laws their children were drawn
    from and the vector is counted from the sampled outcomes."""
    target, draft = pair
    drafter = TreeDrafter(HFCausalLM(draft), mode="sequoia", costs=CHEAP)
    steps = list(tree_steps(HFCausalLM(target), drafter, PROMPT, sampling=SamplingConfig(temperature=1.0),
                            max_new_tokens=30, generator=torch.Generator().manual_seed(0)))
    assert sum(len(s.tokens) for s in steps) == 30 and drafter.acceptance.seen >= len(steps)
    assert all(0.0 <= x <= 1.0 for x in drafter.acceptance.vector)


# --- llama.cpp -----------------------------------------------------------------------------------------


def test_greedy_sequoia_on_the_smollm2_gguf_equals_plain_decoding():
    """On llama.cpp, with an unsure copy of the model as its draft (other branches are kept): a
    fixed budget through the API, and a budget chosen from cost curves through the engine."""
    from helpers import CONTEXT, _Unsure, _gguf

    from specdec.backends import llamacpp

    model = llamacpp.load_gguf(_gguf(), n_threads=THREADS, n_ctx=512, prefill_layout="repacked")
    draft = _Unsure(model.fork())
    expected = generate(model, CONTEXT, max_new_tokens=20, eos_token_ids=[]).token_ids
    spec = generate(model, CONTEXT, draft=draft, verify="tree", tree=dict(mode="sequoia", budget=12),
                    max_new_tokens=20, eos_token_ids=[])
    assert spec.token_ids == expected and spec.stats.accepted_tokens > 0
    drafter = TreeDrafter(draft, mode="sequoia", costs=CHEAP)
    steps = list(tree_steps(model, drafter, CONTEXT, sampling=SamplingConfig(), max_new_tokens=20))
    assert [t for s in steps for t in s.tokens] == expected
    assert np.mean([len(s.tokens) for s in steps]) > 1.0
