"""Draft-length policies: static, heuristic, confidence, theory."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama

from specdec.backends.hf import HFCausalLM
from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.drafters.early_exit import EarlyExitDrafter
from specdec.drafters.ngram import NGramDrafter
from specdec.engine import speculative_steps
from specdec.policies import (
    POLICIES,
    ConfidenceStop,
    HeuristicK,
    StaticK,
    TheoryK,
    make_policy,
)
from specdec.sampling import SamplingConfig
from specdec.stats import Step
from specdec.theory import optimal_k
from specdec.verify import make_verifier


def step(drafted: int, accepted: int, draft_seconds: float = 0.0, verify_seconds: float = 0.1) -> Step:
    tokens = [0] * (min(accepted, drafted) + 1)
    return Step(tokens, drafted, accepted, draft_seconds, verify_seconds)


def test_make_policy_knows_every_name_and_rejects_others():
    for name in POLICIES:
        policy = make_policy(name, 4)
        assert policy.name == name and policy.describe()["name"] == name
        assert policy.next_k() >= 1
    with pytest.raises(ValueError, match="unknown draft-length policy"):
        make_policy("oracle", 4)
    with pytest.raises(ValueError, match="positive integer"):
        make_policy("heuristic", 0)
    with pytest.raises(ValueError, match="threshold"):
        make_policy("confidence", 4, threshold=1.5)
    assert make_policy("theory", 4, k_max=6).describe()["k_max"] == 6
    assert make_policy("static", 3).next_k() == 3


def test_heuristic_grows_after_full_acceptance_and_shrinks_after_rejection():
    policy = HeuristicK(4, k_max=9)
    policy.update(step(4, 4))
    assert policy.next_k() == 6
    policy.update(step(6, 6))
    policy.update(step(8, 8))
    assert policy.next_k() == 9  # capped
    policy.update(step(9, 2))
    assert policy.next_k() == 8
    for _ in range(20):
        policy.update(step(policy.next_k(), 0))
    assert policy.next_k() == 1  # never below 1
    policy.update(step(0, 0))  # nothing drafted: nothing learnt
    assert policy.next_k() == 1
    policy.update(step(1, 1))
    assert policy.describe() == {"name": "heuristic", "k": 3, "k_max": 9}


def test_confidence_stops_below_the_threshold():
    policy = ConfidenceStop(k_max=8, threshold=0.5)
    assert policy.next_k() == 8
    assert policy.keep_going(torch.tensor([0.2, 0.5, 0.3]))
    assert not policy.keep_going(torch.tensor([0.3, 0.45, 0.25]))
    policy.update(step(3, 2))
    policy.update(step(5, 5))
    assert policy.describe()["mean_drafted"] == 4.0


@pytest.mark.parametrize("threshold,drafted", [(1.0, 1), (0.0, 6)])
def test_confidence_policy_controls_a_real_drafter(threshold, drafted):
    backend = HFLayeredCausalLM(tiny_llama(20, vocab=16, layers=3))
    policy = make_policy("confidence", 2, k_max=6, threshold=threshold)
    steps = speculative_steps(
        backend, EarlyExitDrafter(backend, exit_layer=2), make_verifier("greedy"), policy, [1, 2, 3],
        sampling=SamplingConfig(), max_new_tokens=12,
    )
    first = next(iter(steps))
    assert first.drafted == drafted


def test_theory_estimates_alpha_from_tested_positions_and_c_from_timings():
    policy = TheoryK(2, k_max=10, decay=1.0, prior_weight=1e-9)
    # verify seconds = 0.1 + 0.01 * drafted; draft seconds = 0.02 per drafted token
    history = [(4, 4), (4, 1), (2, 2), (6, 3), (3, 0), (5, 5), (1, 1), (6, 2)]
    for drafted, accepted in history:
        policy.update(step(drafted, accepted, 0.02 * drafted, 0.1 + 0.01 * drafted))
    accepted = sum(a for _, a in history)
    tested = accepted + sum(a < d for d, a in history)
    assert policy.alpha == pytest.approx(accepted / tested)
    assert policy.c_draft == pytest.approx(0.2)
    assert policy.c_verify == pytest.approx(0.1)
    assert policy.c == pytest.approx(0.3)
    state = policy.describe()
    assert state["k_iid"] == optimal_k(policy.alpha, policy.c, 10)
    assert state["alpha"] == pytest.approx(policy.alpha) and state["c"] == pytest.approx(0.3)
    assert state["k"] == policy.next_k() and state["steps"] == len(history)
    # rate: tokens per no-draft verify second (v0 = 0.1)
    tokens = sum(min(a, d) + 1 for d, a in history)
    seconds = sum(0.02 * d + 0.1 + 0.01 * d for d, _ in history)
    assert policy.rate == pytest.approx(tokens / (seconds / 0.1))


def test_theory_drafts_long_when_drafting_is_free_and_short_when_it_is_dear():
    free = TheoryK(4, k_max=12)
    dear = TheoryK(4, k_max=12)
    for i in range(40):
        drafted = 4 + i % 3
        free.update(step(drafted, drafted if i % 5 else drafted - 2, 1e-5, 0.15))
        dear.update(step(drafted, 1 if i % 2 else 0, 0.08 * drafted, 0.15))
    assert free.c < 0.01 and free.next_k() == 12
    assert dear.alpha < 0.5 and dear.next_k() <= 2


def test_theory_follows_a_change_in_acceptance():
    policy = TheoryK(4, k_max=12)
    for _ in range(60):
        policy.update(step(policy.next_k(), policy.next_k(), 0.001, 0.15))
    high = policy.next_k()
    for _ in range(60):
        policy.update(step(policy.next_k(), 0, 0.001, 0.15))
    assert high == 12 and policy.next_k() < high and policy.alpha < 0.5


def test_adaptive_policies_run_in_the_engine_and_report_their_state():
    target = HFCausalLM(tiny_llama(21, vocab=16, layers=2, sharpness=3.0))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    for name in POLICIES:
        target.reset()
        policy = make_policy(name, 3)
        steps = list(
            speculative_steps(
                target, NGramDrafter(16), make_verifier("greedy"), policy, prompt,
                sampling=SamplingConfig(), max_new_tokens=20,
            )
        )
        assert sum(len(s.tokens) for s in steps) == 20
        state = policy.describe()
        assert state["name"] == name
        if name == "theory":
            assert 0.0 <= state["alpha"] <= 1.0 and state["c"] >= 0.0


def test_static_policy_is_unchanged():
    policy = StaticK(5)
    policy.update(step(5, 0))
    assert policy.next_k() == 5 and policy.keep_going(torch.tensor([0.01, 0.99]))
    assert policy.describe() == {"name": "static", "k": 5}


def test_theory_calibrates_confidence_and_stops_where_a_token_does_not_pay_for_itself():
    policy = TheoryK(4, k_max=8)
    sure, unsure = torch.tensor([0.95, 0.05]), torch.tensor([0.35, 0.33, 0.32])
    for _ in range(50):  # confident tokens are accepted, the unconfident one is rejected
        policy.next_k()
        for q in (sure, sure, unsure):
            policy.keep_going(q)
        policy.update(step(3, 2, 0.02 * 3, 0.1))
    assert policy.accept_chance(0.95) > 0.9 and policy.accept_chance(0.35) < 0.1
    assert policy.c == pytest.approx(0.2) and policy.rate > 1.5
    policy.next_k()
    assert policy.keep_going(sure)  # gain ~0.97 * alpha >= c * rate
    assert not policy.keep_going(unsure)  # the draft so far is now unlikely to survive
    policy.next_k()  # a new step forgets the last one's draft
    assert policy.keep_going(sure)
    assert 2 <= policy.next_k() <= 8  # the cap: every token as sure as the surest bin


def test_theory_drafts_nothing_extra_when_a_token_costs_more_than_it_can_gain():
    policy = TheoryK(4, k_max=8)
    for _ in range(30):
        policy.next_k()
        policy.keep_going(torch.tensor([0.9, 0.1]))
        policy.update(step(1, 1, 1.2, 0.1))  # a draft token costs 12 target steps
    assert policy.c > 10 and policy.next_k() == 1
    assert not policy.keep_going(torch.tensor([0.99, 0.01]))
