"""Token trees: data, exact law of tree verification, and the tree engine on tiny models."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specdec import SamplingConfig, generate
from specdec.backends.base import forward_after
from specdec.backends.hf import HFCausalLM
from specdec.drafters.tree import DEFAULT_CHOICES, TreeDrafter
from specdec.engine import tree_steps
from specdec.token_tree import TokenTree, forward_tree
from specdec.verify.tree import TreeVerifier
from helpers import (
    PROMPT, Dist, assert_same_law, assert_sampled_law, cases, drafted_tree_joint, orderings, outcomes, target_joint,
)
from tiny import noisy_copy, tiny_llama

# --- tree data -----------------------------------------------------------------------------------

TREE = TokenTree(tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 0, 2])


def test_tree_structure() -> None:
    assert TREE.depths == [1, 1, 2, 2, 3]
    assert TREE.child_lists() == [[0, 1], [2, 3], [], [4], [], []]
    assert TREE.path(4) == [0, 2, 4] and TREE.path(-1) == []
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(TREE.ancestry(), expected)


def test_bad_trees_raise() -> None:
    with pytest.raises(ValueError, match="after their parents"):
        TokenTree([1, 2], [1, -1])
    with pytest.raises(ValueError, match="prefixes"):
        TreeDrafter(None, choices=[(0,), (1, 0)])
    with pytest.raises(ValueError, match="budget"):
        TreeDrafter(None, budget=0)


def test_tree_logits_match_plain_forwards() -> None:
    """Row 1 + i of the tree forward equals a causal forward over the context and node i's path."""
    model = tiny_llama(0, vocab=16)
    backend = HFCausalLM(model)
    context = [1, 2, 3, 4]
    forward_after(backend, context[:2])  # part of the context already cached
    logits = forward_tree(backend, context, TREE)
    with torch.no_grad():
        for row, node in enumerate([-1] + list(range(len(TREE)))):
            seq = context + [TREE.tokens[i] for i in TREE.path(node)]
            fresh = model(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(logits[row], fresh, atol=1e-5, rtol=1e-5)


# --- the exact law of tree verification ------------------------------------------------------------


def top_tree(q: Dist, context: tuple[int, ...], widths: list[int]) -> TokenTree:
    """A deterministic tree from the draft: at depth d every node gets its widths[d] likeliest children."""
    tokens, parents, frontier = [], [], [(-1, context)]
    for width in widths:
        nxt = []
        for node, ctx in frontier:
            for tok in np.argsort(-q(ctx), kind="stable")[:width]:
                tokens.append(int(tok))
                parents.append(node)
                nxt.append((len(tokens) - 1, ctx + (int(tok),)))
        frontier = nxt
    return TokenTree(tokens, parents)


def tree_joint(p: Dist, q: Dist, horizon: int, widths: list[int]) -> dict:
    return drafted_tree_joint(p, horizon, lambda seq, room: [(1.0, top_tree(q, seq, widths[:room]))])


@pytest.mark.parametrize("case", sorted(cases(4)))
@pytest.mark.parametrize("widths", [[1, 1, 1], [2, 1, 1], [3, 2, 1], [4, 4, 4]])
def test_tree_output_law_equals_target_law(case: str, widths: list[int]) -> None:
    p, q = cases(4)[case]
    assert_same_law(tree_joint(p, q, 4, widths), target_joint(p, 4, 4))


def sampled_trees(q: Dist, context: tuple[int, ...], widths: list[int], expand: int | None):
    """Every tree the sampled drafter can build, with its probability: at each level the ``expand``
    new nodes with the largest path probability (all if None) get widths[level] children drawn
    from q without replacement (the expansion depends on drawn values, as in the dynamic drafter)."""
    vocab = len(q(context))

    def grow(tokens, parents, score, rows, frontier, level, prob):
        if level == len(widths) or not frontier:
            law = torch.zeros(1 + len(tokens), vocab, dtype=torch.float64)
            for node, row in rows.items():
                law[1 + node] = torch.tensor(row)
            yield prob, TokenTree(list(tokens), list(parents), law)
            return
        ctxs = [context + tuple(tokens[i] for i in TokenTree(tokens, parents).path(node)) for node in frontier]
        choices = [orderings(q(ctx), widths[level]) for ctx in ctxs]
        for combo in itertools.product(*choices):
            t, par, sc, rw, p_all, new = list(tokens), list(parents), list(score), dict(rows), prob, []
            for node, ctx, (seq, p_seq) in zip(frontier, ctxs, combo):
                rw[node] = q(ctx)
                p_all *= p_seq
                base = sc[node] if node >= 0 else 1.0
                for tok in seq:
                    t.append(tok)
                    par.append(node)
                    sc.append(base * q(ctx)[tok])
                    new.append(len(t) - 1)
            nxt = sorted(new, key=lambda i: -sc[i])[:expand] if expand is not None else new
            yield from grow(t, par, sc, rw, nxt, level + 1, p_all)

    yield from grow([], [], [], {}, [-1], 0, 1.0)


def sampled_tree_joint(p: Dist, q: Dist, horizon: int, widths: list[int], expand: int | None) -> dict:
    return drafted_tree_joint(p, horizon, lambda seq, room: sampled_trees(q, seq, widths[:room], expand))


@pytest.mark.parametrize("case", sorted(cases(4)))
@pytest.mark.parametrize("widths,expand", [([1, 1], None), ([2, 1], None), ([4, 1], None), ([3, 2], 1), ([2, 2], 1)])
def test_sampled_tree_output_law_equals_target_law(case: str, widths: list[int], expand: int | None) -> None:
    """Children drawn without replacement, traversal verification: the output law is the
    target's exactly, for whole-vocabulary widths and for expansions chosen by the drawn values."""
    p, q = cases(4)[case]
    assert_same_law(sampled_tree_joint(p, q, 3, widths, expand), target_joint(p, 4, 3))


def confident_trees(q: Dist, context: tuple[int, ...], threshold: float, width: int, depth: int):
    """Every tree the confident drafter (``TreeDrafter(threshold=...)``, sampled) can build, with
    its probability: at a node whose q has a top probability of at least ``threshold`` one child
    is drawn and drafted on (whichever token it is); otherwise ``width`` children are drawn
    without replacement and the tree ends."""
    vocab = len(q(context))
    if depth <= 0:  # no room left: the drafter proposes nothing
        yield 1.0, TokenTree([], [], torch.zeros(1, vocab, dtype=torch.float64))
        return

    def grow(tokens, parents, rows, node, ctx, level, prob):
        row = q(ctx)
        sure = row.max() >= threshold
        for seq, p_seq in orderings(row, 1 if sure else width):
            t, par = tokens + list(seq), parents + [node] * len(seq)
            rw = {**rows, node: row}
            if sure and level < depth:
                yield from grow(t, par, rw, len(tokens), ctx + (seq[0],), level + 1, prob * p_seq)
                continue
            law = torch.zeros(1 + len(t), vocab, dtype=torch.float64)
            for at, r in rw.items():
                law[1 + at] = torch.tensor(r)
            yield prob * p_seq, TokenTree(t, par, law)

    yield from grow([], [], {}, -1, context, 1, 1.0)


@pytest.mark.parametrize("case", sorted(cases(4)))
@pytest.mark.parametrize("threshold,width", [(0.3, 2), (0.5, 4), (0.7, 2)])
def test_confident_tree_output_law_equals_target_law(case: str, threshold: float, width: int) -> None:
    """The confident tree's shape depends on the draft's probabilities and on the drawn children
    (which child is drafted on): the output law is still the target's exactly."""
    p, q = cases(4)[case]
    assert_same_law(confident_tree_joint(p, q, 3, confident_trees, threshold, width), target_joint(p, 4, 3))


def test_a_tree_that_drops_a_drawn_child_is_caught() -> None:
    """Negative control: drafting like the confident tree but dropping a drawn sibling the draft
    gives less than 0.3 (its count is then no longer fixed before the draws) biases the output,
    and the enumeration sees it."""

    def dropping(q, context, threshold, width, depth):
        for prob, tree in confident_trees(q, context, threshold, width, depth):
            keep = [i for i in range(len(tree)) if i == 0 or tree.q[1 + tree.parents[i]][tree.tokens[i]] >= 0.3]
            if len(keep) == len(tree) or any(tree.parents[i] >= 0 for i in range(len(tree))):
                yield prob, tree
                continue
            yield prob, TokenTree([tree.tokens[i] for i in keep], [-1] * len(keep), tree.q[: 1 + len(keep)])

    p, q = cases(4)["random"]
    with pytest.raises(AssertionError, match="laws differ"):
        assert_same_law(confident_tree_joint(p, q, 3, dropping, 0.9, 4), target_joint(p, 4, 3))


def test_a_wrong_parent_weight_is_caught(monkeypatch) -> None:
    """Negative control for the verifier: giving a parent the residual mass S itself as its chance,
    instead of S / (S + 1 - w), looks plausible token by token and biases the output; the
    enumeration sees it."""
    import specdec.verify.tree as tree_rules

    monkeypatch.setattr(tree_rules, "_folded_weight", lambda mass, w: min(1.0, mass))
    p, q = cases(4)["random"]
    with pytest.raises(AssertionError, match="laws differ"):
        assert_same_law(sampled_tree_joint(p, q, 3, [2, 1], None), target_joint(p, 4, 3))


def confident_tree_joint(p: Dist, q: Dist, horizon: int, trees, threshold: float, width: int) -> dict:
    """The exact law of the output when each step drafts one of ``trees`` (``confident_trees``'s signature)."""
    return drafted_tree_joint(p, horizon, lambda seq, room: trees(q, seq, threshold, width, room))


def test_sampled_siblings_accept_more_than_one_child() -> None:
    """At the root (weight 1) traversal verification checks siblings as recursive rejection does:
    when the first drawn child is rejected, the second is checked against the residual with the
    first removed from q, so the pair is accepted more often than one child."""
    p = torch.tensor([[0.2, 0.8, 0.0], [1, 0, 0], [1, 0, 0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.1, 0.4], [0, 0, 0], [0, 0, 0]], dtype=torch.float64)
    plan = TreeVerifier().plan_tree(TokenTree([0, 1], [-1, -1], q), p)  # drew 0, then 1
    # child 0: min(1, 0.2/0.5) = 0.4; then P = norm(max(0, p - q)) = (0, 1, 0), the root's weight
    # S / (S + 1 - 1) = 1, Q = (0, 0.2, 0.8); child 1: min(1, 1 * 1/0.2) = 1, so it takes the
    # remaining 0.6 and nothing ends at the root.
    assert plan.accept_len_probs.tolist() == pytest.approx([0.0, 0.4, 0.6])
    alone = TreeVerifier().plan_tree(TokenTree([0], [-1], q[:2]), p[:2])
    assert alone.accept_len_probs.tolist() == pytest.approx([0.6, 0.4])


def test_sampled_trees_get_block_verification_along_paths() -> None:
    """A sampled chain is verified as block verification verifies it (which here keeps the whole
    chain more than twice as often as token-by-token rejection would); a sibling drafted beside
    the chain's first token only takes mass from the outcome that keeps nothing."""
    from specdec.verify.block import BlockVerifier
    from specdec.verify.token import TokenVerifier

    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 4, generator=gen, dtype=torch.float64), -1)  # [1 + N, V]
    q = torch.softmax(torch.randn(3, 4, generator=gen, dtype=torch.float64), -1)
    chain = torch.tensor([1, 2])
    plan = TreeVerifier().plan_tree(TokenTree([1, 2], [-1, 0], q), p)
    block = BlockVerifier().plan(chain, q[:2], p)
    token = TokenVerifier().plan(chain, q[:2], p)
    assert torch.allclose(plan.accept_len_probs, block.accept_len_probs)
    assert float(plan.accept_len_probs[-1]) > 2 * float(token.accept_len_probs[-1])
    # The same chain with a second root child (token 3, a leaf) drawn after it: the chain's two
    # nodes are visited first, with block verification's chances; the sibling comes after them.
    rows_q = torch.cat([q[:2], torch.zeros(2, 4, dtype=torch.float64)])  # [1 + 3, V]
    rows_p = torch.cat([p, p[:1]])  # row 3: after the sibling (any law; only its bonus reads it)
    forked = TreeVerifier().plan_tree(TokenTree([1, 2, 3], [-1, 0, -1], rows_q), rows_p)
    got = forked.accept_len_probs  # by node: root, chain node 0, chain node 1, sibling
    assert torch.allclose(got[[1, 2]], block.accept_len_probs[[1, 2]])
    assert float(got[0] + got[3]) == pytest.approx(float(block.accept_len_probs[0]))
    assert float(got[3]) > 0.0


def test_tree_verification_is_greedy_on_one_hot() -> None:
    """One-hot p: the longest path matching the argmax is kept, then the bonus token."""
    tree = TokenTree([3, 1, 2, 0], [-1, -1, 1, 2])
    p = torch.zeros(5, 4, dtype=torch.float64)
    p[0, 1] = p[2, 2] = p[3, 0] = p[4, 3] = 1.0  # root -> 1 (node 1) -> 2 (node 2) -> 0 (node 3) -> 3
    plan = TreeVerifier().plan_tree(tree, p)
    assert outcomes(plan) == [(4, 3, 1.0)]


def test_the_greedy_shortcut_is_the_plans_one_outcome() -> None:
    """Greedy decoding reads one argmax per row (greedy_tree_verdict); on random trees and logits
    with ties it gives the plan's only outcome from one-hot rows, the tokens and node alike."""
    from specdec.sampling import SamplingConfig, logits_to_probs
    from specdec.verify.tree import greedy_tree_verdict

    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        n = int(torch.randint(0, 9, (), generator=gen))
        parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(n)]
        tokens = torch.randint(0, 5, (n,), generator=gen).tolist()
        logits = torch.randint(0, 3, (1 + n, 5), generator=gen).double()  # small integers: ties
        tree = TokenTree(tokens, parents)
        if any(len({tokens[c] for c in kids}) < len(kids) for kids in tree.child_lists()):
            continue  # siblings with one token: no drafter builds them
        plan = TreeVerifier().plan_tree(tree, logits_to_probs(logits, SamplingConfig()))
        (node, token, prob), = outcomes(plan)
        assert prob == pytest.approx(1.0)
        verdict = greedy_tree_verdict(tree, logits)
        assert (verdict.accepted, verdict.next_token) == (node, token)


# --- the tree engine on tiny models ----------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, vocab=16, sharpness=10.0)
    return target, noisy_copy(target, 0.3)


TREES = {
    "static-default": dict(choices=DEFAULT_CHOICES),
    "static-chain": dict(choices=[(0,), (0, 0), (0, 0, 0)]),
    "dynamic": dict(),
    "dynamic-small": dict(depth=3, width=2, expand=2, budget=5),
    "confident": dict(threshold=0.6, width=2, depth=8),
}


@pytest.mark.parametrize("shape", sorted(TREES))
def test_greedy_tree_equals_autoregressive(pair, shape: str) -> None:
    target, draft = pair
    ar = generate(target, PROMPT, max_new_tokens=40)
    spec = generate(target, PROMPT, draft=draft, verify="tree", tree=TREES[shape], max_new_tokens=40)
    assert spec.token_ids == ar.token_ids
    assert spec.stats.mean_accepted_per_forward > 1.0


def test_tree_with_draft_equal_to_target_keeps_whole_chain(pair) -> None:
    target, _ = pair
    spec = generate(target, PROMPT, draft=target, verify="tree", tree=TREES["static-chain"], max_new_tokens=20)
    assert spec.stats.target_forwards == 5  # 3 drafted + 1 bonus per forward
    assert spec.token_ids == generate(target, PROMPT, max_new_tokens=20).token_ids


def test_tree_beats_chain_in_tokens_per_forward(pair) -> None:
    target, draft = pair
    chain = generate(target, PROMPT, draft=draft, verify="tree", tree=TREES["static-chain"], max_new_tokens=60)
    tree = generate(target, PROMPT, draft=draft, verify="tree", tree=TREES["static-default"], max_new_tokens=60)
    assert tree.stats.mean_accepted_per_forward > chain.stats.mean_accepted_per_forward


def test_target_cache_keeps_only_the_accepted_path(pair) -> None:
    target_model, draft_model = pair
    target = HFCausalLM(target_model)
    steps = tree_steps(
        target, TreeDrafter(HFCausalLM(draft_model)), PROMPT, sampling=SamplingConfig(temperature=1.0),
        max_new_tokens=40, generator=torch.Generator().manual_seed(0),
    )
    context = list(PROMPT)
    for step in steps:
        context += step.tokens
        assert target.tokens == context[:-1]
        assert target._cache.get_seq_length() == len(context) - 1
    cached = forward_after(target, context)[-1]
    with torch.no_grad():
        fresh = target_model(torch.tensor([context])).logits[0, -1]
    torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", ["static-default", "dynamic-small", "confident"])
def test_tree_output_follows_target_law(shape: str) -> None:
    assert_sampled_law(verify="tree", tree=TREES[shape])


def test_the_default_tree_is_the_confident_tree(pair) -> None:
    target, draft = pair
    default = generate(target, PROMPT, draft=draft, verify="tree", max_new_tokens=12)
    assert default.method == "spec:model:tree" and default.shape == "threshold=0.8"
    dynamic = generate(target, PROMPT, draft=draft, verify="tree", tree={}, max_new_tokens=12)
    assert dynamic.method == "spec:model:tree:mode=dynamic" and dynamic.shape == "budget=16"
    with pytest.raises(ValueError, match="threshold"):
        TreeDrafter(None, threshold=1.5)
    with pytest.raises(ValueError, match="fixed shape"):
        TreeDrafter(None, threshold=0.5, choices=[(0,)])
