"""Exactness of the verification rules, by exact enumeration (no sampling).

For toy context-dependent target (p) and draft (q) distributions over a vocabulary of 3-4 tokens,
the speculative outer loop is unrolled exactly: every draft block is weighted by its probability
under q, every verifier outcome (n, y) by its probability under the verifier's plan, until the
horizon. The resulting law of the generated sequence must equal the target's joint law to 1e-9.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch

from specdec.verify import VERIFIERS, draw, make_verifier
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.verify.base import VerifyPlan
from specdec.verify.greedy import greedy_verdict
from helpers import Dist, assert_same_law, cases, dirichlet, outcomes, point_mass, target_joint


def speculative_joint(
    verifier_name: str, p: Dist, q: Dist, vocab: int, horizon: int, k: int
) -> dict[tuple[int, ...], float]:
    """The exact law of the first ``horizon`` tokens of speculative decoding.

    Mirrors the engine: k is capped so that a step never passes the horizon. The mass on each
    output prefix is pushed forward shortest prefix first, so each prefix is expanded once.
    """
    verifier = make_verifier(verifier_name)
    mass: dict[tuple[int, ...], float] = {(): 1.0}
    for length in range(horizon):
        for seq in [s for s in mass if len(s) == length]:
            weight = mass.pop(seq)
            k_step = min(k, horizon - length - 1)
            for draft in itertools.product(range(vocab), repeat=k_step):
                q_rows = [q(seq + draft[:i]) for i in range(k_step)]
                draft_prob = float(np.prod([q_rows[i][draft[i]] for i in range(k_step)]))
                if draft_prob == 0.0:
                    continue
                p_rows = [p(seq + draft[:i]) for i in range(k_step + 1)]
                plan = verifier.plan(
                    torch.tensor(draft, dtype=torch.long),
                    torch.tensor(np.array(q_rows).reshape(k_step, vocab)),
                    torch.tensor(np.array(p_rows)),
                )
                for n, y, prob in outcomes(plan):
                    out = seq + draft[:n] + (y,)
                    mass[out] = mass.get(out, 0.0) + weight * draft_prob * prob
    return mass


V = 4
CASES = sorted(cases(V))


@pytest.mark.parametrize("verifier", ["token", "block", "coupled"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_output_law_equals_target_law(verifier: str, case: str, k: int) -> None:
    # k = 4 needs a horizon of 5 to draft 4 tokens at once; a vocabulary of 3 keeps that small.
    vocab, horizon = (V, 4) if k <= 3 else (3, 5)
    p, q = cases(vocab)[case]
    law = speculative_joint(verifier, p, q, vocab, horizon, k)
    assert_same_law(law, target_joint(p, vocab, horizon))


@pytest.mark.parametrize("verifier", ["token", "block", "coupled"])
def test_vocab_of_three(verifier: str) -> None:
    p, q = dirichlet("p3", 3), dirichlet("q3", 3, zeros=1)
    assert_same_law(speculative_joint(verifier, p, q, 3, 4, 3), target_joint(p, 3, 4))


@pytest.mark.parametrize("verifier", sorted(VERIFIERS))
def test_greedy_distributions_give_the_argmax_chain(verifier: str) -> None:
    """With one-hot p and q (temperature 0) every rule outputs the target's argmax chain."""
    p, q = point_mass("p", V), point_mass("q", V)
    law = speculative_joint(verifier, p, q, V, 4, 3)
    assert_same_law(law, target_joint(p, V, 4))


@pytest.mark.parametrize("verifier", sorted(n for n, cls in VERIFIERS.items() if cls.exact))
def test_greedy_verdict_is_each_exact_rules_outcome(verifier: str) -> None:
    """The loop's shortcut under greedy decoding (greedy_verdict from raw logits) is the outcome
    each exact rule's plan gives with probability 1: the matching prefix, then the argmax; for
    point-mass and for spread-out drafts q, matching all, some or none of the argmax chain."""
    rule, gen, seen = make_verifier(verifier), torch.Generator().manual_seed(0), set()
    for trial in range(300):
        k = 1 + trial % 4
        logits = torch.randn(k + 1, 5, generator=gen)  # [k + 1, V]
        chain = logits.argmax(dim=-1)
        draft = torch.where(torch.rand(k, generator=gen) < 0.6, chain[:k], torch.randint(0, 5, (k,), generator=gen))
        q = torch.softmax(torch.randn(k, 5, generator=gen), -1) if trial % 2 else torch.nn.functional.one_hot(draft, 5).float()
        plan = rule.plan(draft, q, logits_to_probs(logits, SamplingConfig()))
        verdict = greedy_verdict(draft.tolist(), logits)
        assert plan.accept_len_probs[verdict.accepted] == 1.0, (trial, plan.accept_len_probs)
        row = plan.next_token_probs[verdict.accepted]
        assert row[verdict.next_token] > 0 and row.sum() == row[verdict.next_token]
        seen.add((k, verdict.accepted))
    assert all((k, n) in seen for k in range(1, 5) for n in range(k + 1))  # every outcome came up


def test_a_wrong_rule_is_caught() -> None:
    """The harness has teeth: accepting every draft token yields the draft's law, not the target's."""

    class AcceptAll:
        def plan(self, draft_tokens, q, p):  # noqa: ANN001
            k = draft_tokens.shape[0]
            accept = torch.zeros(k + 1, dtype=torch.float64)
            accept[k] = 1.0
            return VerifyPlan(accept, p)

    p, q = cases(V)["random"]
    VERIFIERS["accept-all"] = AcceptAll
    try:
        law = speculative_joint("accept-all", p, q, V, 3, 2)
    finally:
        del VERIFIERS["accept-all"]
    with pytest.raises(AssertionError):
        assert_same_law(law, target_joint(p, V, 3))


# --- the two-token example of Sun et al. 2024 and the optimality of block verification ---------


def expected_accepted(verifier_name: str, p: Dist, q: Dist, vocab: int, k: int) -> float:
    """E[number of draft tokens accepted] in one step with k drafts, exactly."""
    verifier = make_verifier(verifier_name)
    total = 0.0
    for draft in itertools.product(range(vocab), repeat=k):
        q_rows = [q(draft[:i]) for i in range(k)]
        draft_prob = float(np.prod([q_rows[i][draft[i]] for i in range(k)]))
        if draft_prob == 0.0:
            continue
        p_rows = [p(draft[:i]) for i in range(k + 1)]
        plan = verifier.plan(
            torch.tensor(draft), torch.tensor(np.array(q_rows)), torch.tensor(np.array(p_rows))
        )
        total += draft_prob * float((plan.accept_len_probs * torch.arange(k + 1)).sum())
    return total


def constant(dist: list[float]) -> Dist:
    return lambda context: np.array(dist)


@pytest.mark.parametrize("verifier, expected", [("token", Fraction(10, 9)), ("block", Fraction(11, 9)),
                                                ("coupled", Fraction(10, 9))])
def test_sun_et_al_two_token_example(verifier: str, expected: Fraction) -> None:
    """Sun et al. 2024: M_b(A)=1/3, M_b(B)=2/3 (target p); M_s(A)=2/3, M_s(B)=1/3 (draft q); gamma = 2."""
    got = expected_accepted(verifier, constant([1 / 3, 2 / 3]), constant([2 / 3, 1 / 3]), 2, 2)
    assert got == pytest.approx(float(expected), abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_block_accepts_at_least_as_many_as_token(seed: int, k: int) -> None:
    p, q = dirichlet(f"p{seed}", 3), dirichlet(f"q{seed}", 3, zeros=seed % 2)
    block = expected_accepted("block", p, q, 3, k)
    token = expected_accepted("token", p, q, 3, k)
    assert block >= token - 1e-12
    if k == 1:  # one draft token: the two rules coincide
        assert block == pytest.approx(token, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_coupled_acceptance_is_the_closed_form_and_at_most_tokens(seed: int, k: int) -> None:
    """With the same p and q at every position, coupled verification keeps each draft token with
    probability a = sum_v p_v q_v / sum_u max(p_u q_v, q_u p_v) (Daliri et al. 2024), so
    E[accepted] = a + a^2 + ... + a^k; token verification's a is 1 - TV >= that."""
    from specdec.verify.coupled import acceptance

    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(3)), rng.dirichlet(np.ones(3))
    a = acceptance(p, q)
    got = expected_accepted("coupled", constant(list(p)), constant(list(q)), 3, k)
    assert got == pytest.approx(sum(a**i for i in range(1, k + 1)), abs=1e-12)
    assert got <= expected_accepted("token", constant(list(p)), constant(list(q)), 3, k) + 1e-12


# --- block verification against the reference code of Sun et al. 2024 -------------------------


def reference_block_law(ps: np.ndarray, qs: np.ndarray, drafts: list[int]) -> dict[tuple[int, int], float]:
    """The law of (n, y) under Sun et al. 2024's appendix code for Algorithm 2, enumerated exactly.

    That code walks i = 0..gamma (q padded with a zero row): with ``keep`` the running acceptance
    probability, it draws from weights max(0, keep * p[i] - q[i]) plus a "reject" weight 1 - keep;
    a drawn token replaces the output by drafts[:i] + [token]. The last step that draws a token wins.
    """
    gamma, vocab = qs.shape
    qs = np.vstack([qs, np.zeros((1, vocab))])
    keep = 1.0
    step_laws = []  # per step i: (law over tokens, probability of "reject")
    for i in range(gamma + 1):
        weights = np.maximum(0.0, ps[i] * keep - qs[i])
        reject = 1.0 - keep
        z = weights.sum() + reject
        step_laws.append((weights / z, reject / z) if z > 0 else (np.zeros(vocab), 1.0))
        if i < gamma:
            keep = min(1.0, ps[i, drafts[i]] / qs[i, drafts[i]] * keep)
    law = {}
    for i, (tokens, _) in enumerate(step_laws):
        later_reject = np.prod([step_laws[j][1] for j in range(i + 1, gamma + 1)])
        for y in range(vocab):
            if tokens[y] > 0:
                law[(i, y)] = tokens[y] * later_reject
    return law


@pytest.mark.parametrize("seed", range(20))
def test_block_plan_matches_the_papers_reference_code(seed: int) -> None:
    rng = np.random.default_rng(seed)
    gamma, vocab = 1 + seed % 5, 4
    ps = rng.dirichlet(np.full(vocab, 0.5), size=gamma + 1)
    qs = rng.dirichlet(np.full(vocab, 0.5), size=gamma)
    drafts = [int(rng.choice(vocab, p=qs[i])) for i in range(gamma)]
    plan = make_verifier("block").plan(torch.tensor(drafts), torch.tensor(qs), torch.tensor(ps))
    ours = {(n, y): pr for n, y, pr in outcomes(plan)}
    ref = reference_block_law(ps, qs, drafts)
    assert sum(ref.values()) == pytest.approx(1.0, abs=1e-12)
    keys = set(ours) | set(ref)
    assert max(abs(ours.get(k_, 0.0) - ref.get(k_, 0.0)) for k_ in keys) <= 1e-12


def test_typical_acceptance_is_lossy_and_says_so() -> None:
    """The lossy rule is marked lossy, and its law really differs from the target's."""
    verifier = make_verifier("typical")
    assert verifier.exact is False
    p, q = cases(V)["random"]
    law = speculative_joint("typical", p, q, V, 3, 2)
    with pytest.raises(AssertionError, match="laws differ"):
        assert_same_law(law, target_joint(p, V, 3))


@pytest.mark.parametrize("verifier", ["token", "block"])
def test_float32_near_equal_drafts_give_a_valid_plan(verifier: str) -> None:
    """Regression: float32 p and q that almost agree (a model drafting for itself in a batched
    forward) once made block verification's h exceed 1 by rounding and a probability negative."""
    gen = torch.Generator().manual_seed(0)
    rule = make_verifier(verifier)
    for _ in range(300):
        k, vocab = 4, 1000
        p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 3, -1)  # float32
        q = torch.softmax(torch.log(p[:k]) + torch.randn(k, vocab, generator=gen) * 1e-4, -1)
        draft = torch.multinomial(q, 1, generator=gen)[:, 0]
        plan = rule.plan(draft, q, p)
        assert (plan.accept_len_probs >= 0).all() and (plan.next_token_probs >= 0).all()
        assert float(plan.accept_len_probs.sum()) == pytest.approx(1.0, abs=1e-9)
        draw(plan, gen)  # samplable


def adaptive_joint(verifier_name: str, p: Dist, q: Dist, vocab: int, horizon: int, k_max: int, stop) -> dict:
    """Like :func:`speculative_joint` with a draft length chosen as drafting goes: after drafting
    token i from q_i, drafting stops if ``stop(q_i, x_i)`` (a draft-length policy, which may look
    at the law and at the token drawn), or at ``k_max`` or the horizon."""
    verifier = make_verifier(verifier_name)
    mass: dict[tuple[int, ...], float] = {(): 1.0}

    def drafts(seq, prefix, prob, cap):
        if len(prefix) == cap:
            yield prefix, prob
            return
        row = q(seq + prefix)
        for x in range(vocab):
            if row[x] == 0.0:
                continue
            if stop(row, x) or len(prefix) + 1 == cap:
                yield prefix + (x,), prob * row[x]
            else:
                yield from drafts(seq, prefix + (x,), prob * row[x], cap)

    for length in range(horizon):
        for seq in [s for s in mass if len(s) == length]:
            weight = mass.pop(seq)
            for draft, draft_prob in drafts(seq, (), 1.0, min(k_max, horizon - length - 1)):
                k = len(draft)
                q_rows = np.array([q(seq + draft[:i]) for i in range(k)]).reshape(k, vocab)
                p_rows = np.array([p(seq + draft[:i]) for i in range(k + 1)])
                plan = verifier.plan(torch.tensor(draft, dtype=torch.long), torch.tensor(q_rows), torch.tensor(p_rows))
                for n, y, prob in outcomes(plan):
                    out = seq + draft[:n] + (y,)
                    mass[out] = mass.get(out, 0.0) + weight * draft_prob * prob
    return mass


STOPS = {
    "confidence-0.5": lambda row, x: row.max() < 0.5,  # the confidence policy: the law's top probability
    "confidence-0.7": lambda row, x: row.max() < 0.7,
    "drawn-token-0.3": lambda row, x: row[x] < 0.3,  # on the token just drawn (the confident tree's rule)
}


@pytest.mark.parametrize("case", sorted(cases(4)))
@pytest.mark.parametrize("verifier_name", ["token", "block"])
@pytest.mark.parametrize("stop", sorted(STOPS))
def test_adaptive_draft_lengths_keep_the_rules_exact(case: str, verifier_name: str, stop: str) -> None:
    """The adaptive policies choose k while drafting, from the draft's probabilities and draws;
    token and block verification stay exact for such stopping rules (k_max 3, horizon 4)."""
    p, q = cases(4)[case]
    assert_same_law(adaptive_joint(verifier_name, p, q, 4, 4, 3, STOPS[stop]), target_joint(p, 4, 4))
