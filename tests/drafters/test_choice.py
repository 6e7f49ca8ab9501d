"""The ngram+model drafter (ChoiceDrafter) and the planner choosing between its drafters.

Greedy output equals the target's own chain whatever is chosen; at T=1 the output follows the
target's exact law while the planner switches drafters and lengths (chi-square with a stated
power); with injected cost curves the planner drafts from the lookup where it is free and right,
from the model elsewhere, and never when no draft can pay.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers import (
    ContextLM, CHEAP_ROWS, DEAR_ROWS, EDGE_ROWS, SAMPLES, SIGNIFICANCE, ar_tokens, chi_square_p_value, chi_square_power,
)
from tiny import noisy_copy, tiny_llama

from specdec import generate
from specdec.backends.hf import HFCausalLM
from specdec.build import make_drafter
from specdec.drafters import ChoiceDrafter, ModelDrafter
from specdec.drafters.ngram import lookup_confidence
from specdec.engine import speculative_steps
from specdec.policies.auto import AutoPolicy, summary_line
from specdec.costs import CostModel
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.stats import Step
from specdec.verify import make_verifier

REPEATING = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4]  # every 4-gram's continuation is known


# A repeating pattern: the lookup's match reaches 5 tokens back, so it drafts at once with a fair
# confidence (1 - 2/5), and again wherever a sampled token continues the pattern; elsewhere the
# draft model drafts.
LOOKUP_PROMPT = [1, 2, 1, 2, 1, 2, 1]


def exact_law(model, prompt: list[int], sampling: SamplingConfig, vocab: int, horizon: int) -> np.ndarray:
    """P(first ``horizon`` tokens after ``prompt``) under ``model``, by enumerating every prefix."""
    law = np.zeros([vocab] * horizon)
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=horizon):
            logits = model(torch.tensor([prompt + list(seq[:-1])])).logits[0, len(prompt) - 1 :]
            probs = logits_to_probs(logits.double(), sampling).numpy()  # [horizon, V]
            law[seq] = np.prod([probs[t, seq[t]] for t in range(horizon)])
    return law


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, vocab=16, sharpness=10.0)
    return target, noisy_copy(target, 0.3)


@pytest.mark.parametrize("policy", ["static", "cheap", "dear", "edge"])
@pytest.mark.parametrize("prompt", [REPEATING, [7, 3, 9]])
def test_greedy_output_is_the_targets_own_chain(pair, policy, prompt):
    target, draft = pair
    costs = {"cheap": CHEAP_ROWS, "dear": DEAR_ROWS, "edge": EDGE_ROWS}.get(policy)
    chosen = AutoPolicy(costs=costs) if costs else "static"
    out = generate(target, prompt, draft=draft, drafter="ngram+model", policy=chosen, max_new_tokens=30, temperature=0)
    assert out.token_ids == ar_tokens(target, prompt, 30)
    assert out.method.startswith("spec:ngram+model:block:")


def test_the_planner_takes_the_free_lookup_where_it_is_right_and_the_model_elsewhere(pair):
    target, draft = pair
    drafter = ChoiceDrafter.build(ModelDrafter(HFCausalLM(draft)))
    policy = AutoPolicy(costs=CostModel(list(CHEAP_ROWS.target), draft=0.3))
    backend = HFCausalLM(target)
    policy.bind(backend, drafter)  # as generate() does: the planner becomes the drafter's chooser
    steps = list(speculative_steps(backend, drafter, make_verifier("block"), policy, REPEATING,
                                   sampling=SamplingConfig(), max_new_tokens=40))
    state = policy.describe()
    assert set(state["drafters"]) == {"ngram", "text", "model"}  # the text lookup drafts under a grammar only
    assert drafter.used["text"] == 0
    assert state["drafters"]["ngram"]["draft_ms_per_token"] == 0.0  # a lookup costs nothing
    assert state["drafters"]["model"]["draft_ms_per_token"] == 300.0  # the injected draft cost
    assert drafter.used["ngram"] > 0 and drafter.used["model"] > 0  # both were chosen in one run
    assert sum(s.drafted for s in steps) > 0
    line = summary_line(state)
    assert "ngram " in line and "model " in line and line.startswith("planner: drafted ")


def test_no_draft_pays_so_every_step_is_plain_and_the_output_is_ar(pair):
    target, draft = pair
    drafter = ChoiceDrafter.build(ModelDrafter(HFCausalLM(draft)))
    policy = AutoPolicy(costs=DEAR_ROWS)
    backend = HFCausalLM(target)
    policy.bind(backend, drafter)  # as generate() does: the planner becomes the drafter's chooser
    steps = list(speculative_steps(backend, drafter, make_verifier("block"), policy, REPEATING,
                                   sampling=SamplingConfig(), max_new_tokens=20))
    assert all(s.drafted == 0 for s in steps) and drafter.used == {"ngram": 0, "text": 0, "model": 0}
    assert [t for s in steps for t in s.tokens] == ar_tokens(target, REPEATING, 20)
    assert policy.describe()["reason"].endswith("even a draft accepted in full does not pay: a 2-row pass costs "
                                                "2.00x a 1-row one and a draft token 0.00x")


def test_a_free_lookup_is_explored_before_its_prior_would_let_it_draft(pair):
    """Rows at 1.9x: at the prior alpha 0.6 no draft pays, at full acceptance one does; the lookup's
    first uses draft (at most 2 tokens) so its estimates can learn; the model's are never tried."""
    target, draft = pair
    drafter = ChoiceDrafter.build(ModelDrafter(HFCausalLM(draft)))
    policy = AutoPolicy(costs=CostModel([1.0 + 0.9 * (n - 1) for n in range(1, 17)], draft=0.5))
    backend = HFCausalLM(target)
    policy.bind(backend, drafter)  # as generate() does: the planner becomes the drafter's chooser
    steps = list(speculative_steps(backend, drafter, make_verifier("block"), policy, REPEATING,
                                   sampling=SamplingConfig(), max_new_tokens=30))
    drafted = [s.drafted for s in steps if s.drafted]
    assert drafter.used["model"] == 0 and drafter.used["ngram"] >= 3
    # the explored steps: up to EXPLORE_LENGTH tokens (keep_going may stop after the first)
    assert drafted[0] == 2 and all(1 <= d <= 2 for d in drafted)
    assert [t for s in steps for t in s.tokens] == ar_tokens(target, REPEATING, 30)


# A compute-bound backend's curve (llama.cpp, 4-bit weights, 2 cores): rows 2..16 cost 1.7-8.2x one.
COMPUTE_BOUND = [1.0, 1.71, 2.3, 2.83, 3.51, 4.09, 5.52, 6.95, 7.3, 7.65, 7.93, 8.22, 8.22, 8.22, 8.22, 8.22]


def test_a_lookups_length_follows_how_far_back_its_match_reaches(pair):
    """With rows this dear, a long match's continuation is copied in one long draft, a middling
    one's in a short draft, and a 4-token match's not at all; each draft's tokens are calibrated
    at its match's confidence, so full acceptances raise that confidence's chance only."""
    _, draft = pair
    drafter = ChoiceDrafter.build(ModelDrafter(HFCausalLM(draft)))
    policy = AutoPolicy(costs=CostModel(COMPUTE_BOUND, draft=0.6))
    policy.bind(HFCausalLM(draft), drafter)
    long, middling, short = lookup_confidence(32), lookup_confidence(10), lookup_confidence(4)
    for _ in range(3):  # three long copies, accepted in full: the lookup is no longer explored
        policy.next_k()
        assert policy.choose({"ngram": long, "model": None}) == ("ngram", 16)
        policy.update(Step(list(range(17)), 16, 16, 0.0, 0.1))
    ngram = policy._sources["ngram"].acceptance
    assert ngram.accept_chance(long) > 0.98 and ngram.accept_chance(short) == pytest.approx(0.55)
    policy.next_k()
    name, cap = policy.choose({"ngram": middling, "model": None})
    assert name == "ngram" and 1 <= cap <= 4
    policy.update(Step(list(range(cap + 1)), cap, cap, 0.0, 0.1))
    policy.next_k()
    assert policy.choose({"ngram": short, "model": None})[1] == 0  # neither drafts: a plain step


def test_a_lookup_whose_first_token_keeps_failing_stops_copying_however_well_its_copies_went(pair):
    """A copy's tokens stand or fall together: three 16-token copies accepted in full, then six
    long matches rejected at their first token (each copied passage ended where the target wrote
    something new). Counted token by token that is 45 accepts to 6 rejects, a chance of 0.89 at
    which a 16-token draft pays; counted as a first token and the tokens after it, the first
    token's chance is (1.9 + 3) / (2 + 9) = 0.45, and a 17-row pass at 8.2x a step does not
    pay for its 1 + 0.45 * 15.8 = 8.0 expected tokens: the planner takes a plain step."""
    _, draft = pair
    drafter = ChoiceDrafter.build(ModelDrafter(HFCausalLM(draft)))
    policy = AutoPolicy(costs=CostModel(COMPUTE_BOUND, draft=0.6))
    policy.bind(HFCausalLM(draft), drafter)
    long = lookup_confidence(32)
    for accepted in [16] * 3 + [0] * 6:
        policy.next_k()
        assert policy.choose({"ngram": long, "model": None}) == ("ngram", 16)
        policy.update(Step(list(range(accepted + 1)), 16, accepted, 0.0, 0.1))
    ngram = policy._sources["ngram"].acceptance
    assert ngram.lead_chance(long) == pytest.approx((2 * 0.95 + 3) / (2 + 9))
    assert ngram.accept_chance(long) == pytest.approx((2 * 0.95 + 45) / (2 + 45))  # the tokens after a first
    shown = policy.describe()["drafters"]["ngram"]  # stats.policy shows both tables
    assert shown["first_token_calibration"][9] == pytest.approx(ngram.lead_chance(long), abs=1e-3)
    assert shown["calibration"][9] == pytest.approx(ngram.accept_chance(long), abs=1e-3)
    policy.next_k()
    assert policy.choose({"ngram": long, "model": None})[1] == 0


@pytest.mark.parametrize("verify", ["token", "block"])
def test_sampled_output_follows_the_target_law_while_the_planner_switches_drafters(verify):
    vocab, horizon = 5, 3
    target = tiny_llama(0, vocab=vocab, sharpness=6.0)
    draft = noisy_copy(target, 0.5)
    sampling = SamplingConfig(temperature=1.0)
    law = exact_law(target, LOOKUP_PROMPT, sampling, vocab, horizon)
    # Stated power, as in test_engine: a deviation of Cohen's w = 0.15 is caught with prob. >= 0.95.
    assert chi_square_power(law, SAMPLES, effect=0.15) >= 0.95
    target_backend, draft_backend = ContextLM(target), ContextLM(draft)  # answers from memory: helpers.ContextLM
    counts = np.zeros_like(law)
    used = {"ngram": 0, "model": 0}
    for seed in range(SAMPLES):
        target_backend.reset()
        draft_backend.reset()
        drafter = ChoiceDrafter.build(ModelDrafter(draft_backend), max_ngram=2, min_ngram=1)
        policy = AutoPolicy(k_max=4, costs=CostModel(list(EDGE_ROWS.target), draft=0.1))
        policy.bind(target_backend, drafter)
        steps = list(speculative_steps(
            target_backend, drafter, make_verifier(verify), policy, LOOKUP_PROMPT, sampling=sampling,
            max_new_tokens=horizon, generator=torch.Generator().manual_seed(seed),
        ))
        counts[tuple(t for s in steps for t in s.tokens)] += 1
        for name in used:
            used[name] += drafter.used[name]
    assert used["ngram"] > SAMPLES // 10 and used["model"] > SAMPLES // 10  # both drafted, often
    assert chi_square_p_value(counts, law) > SIGNIFICANCE


def test_bad_uses_fail_clearly(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="needs a draft model"):
        generate(target, [1, 2, 3], drafter="ngram+model", max_new_tokens=2)
    with pytest.raises(ValueError, match="drafts its tree with the draft model or the heads"):
        generate(target, [1, 2, 3], draft=draft, drafter="ngram+model", verify="tree", max_new_tokens=2)
    with pytest.raises(ValueError, match=r"bad option for the ngram\+model drafter"):
        generate(target, [1, 2, 3], draft=draft, drafter="ngram+model", drafter_options={"width": 2}, max_new_tokens=2)
    with pytest.raises(ValueError, match="min_ngram"):
        ChoiceDrafter.build(ModelDrafter(HFCausalLM(draft)), min_ngram=5)
    with pytest.raises(ValueError, match="needs a draft model"):
        make_drafter("ngram+model", HFCausalLM(target))
