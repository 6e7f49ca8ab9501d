"""Cascade drafting: the vertical cascade drafts the draft model's own chain (same tokens, same q
rows) in fewer passes; the horizontal cascade goes on with the lookup where the planner stops the
draft model; both keep the target's output (greedy equality on torch and llama.cpp, Gumbel-seeded
identity)."""

from __future__ import annotations

import pytest
import torch

from specdec import SamplingConfig, generate
from specdec.backends.hf import HFCausalLM
from specdec.build import make_drafter
from specdec.config import DecodeConfig
from specdec.drafters.cascade import CascadeDrafter, _draw, guess_rule
from specdec.drafters.model import ModelDrafter
from specdec.engine import autoregressive_steps, speculative_steps
from specdec.policies import StaticK
from specdec.policies.auto import AutoPolicy
from specdec.costs import CostModel
from specdec.verify import make_verifier
from helpers import THREADS, CHEAP_ROWS
from tiny import noisy_copy, tiny_llama

PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3]  # repeats itself: the lookup proposes


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(3, vocab=16, layers=2, sharpness=4.0)
    return target, noisy_copy(target, 0.3)


SETTINGS = {"greedy": SamplingConfig(), "gumbel": SamplingConfig(temperature=1.0, gumbel_seed=11),
            "gumbel-topk": SamplingConfig(temperature=0.7, top_k=5, gumbel_seed=12)}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_vertical_cascade_drafts_the_draft_models_own_chain(pair, name):
    """Same tokens and the same q rows as the model drafter, for every context along a generated
    text, in fewer draft-model passes than tokens (the lookup's proposals the draft agreed with)."""
    target, draft = pair
    sampling = SETTINGS[name]
    text = PROMPT + [t for s in autoregressive_steps(HFCausalLM(target), PROMPT, sampling=SamplingConfig(),
                                                     max_new_tokens=24) for t in s.tokens]
    cascade, plain = CascadeDrafter(HFCausalLM(draft)), ModelDrafter(HFCausalLM(draft))
    drafted = 0
    for end in range(len(PROMPT), len(text), 3):
        context = text[:end]
        want = plain.propose(context, 8, sampling, None)
        got = cascade.propose(context, 8, sampling, None, source="model")
        assert got.tokens.tolist() == want.tokens.tolist(), end
        torch.testing.assert_close(got.q, want.q, rtol=0, atol=0)
        drafted += len(got)
    assert cascade.passes < drafted and cascade.used["vertical"] > 0
    assert cascade.used["model"] + cascade.used["vertical"] == drafted


def test_under_sampling_each_token_is_drawn_from_the_draft_models_q(pair):
    """With a generator, each drafted token's q row is the draft model's law after the context and
    the tokens before it (computed here one pass per token)."""
    _, draft = pair
    cascade = CascadeDrafter(HFCausalLM(draft))
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(temperature=0.5)
    for _ in range(20):
        got = cascade.propose(PROMPT, 8, sampling, gen, source="model")
        tokens = got.tokens.tolist()
        with torch.no_grad():
            logits = draft(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1: len(PROMPT) - 1 + len(tokens)]
        torch.testing.assert_close(got.q, torch.softmax(logits.float() / 0.5, -1), rtol=1e-5, atol=1e-6)
    assert cascade.used["vertical"] > 0


def test_keeping_the_lookups_guess_with_chance_q_draws_from_q():
    """The rule inside the vertical cascade: keep the guess with probability q(guess), else draw
    from q without it. Its law is q exactly, for every guess (of mass 0, some, all); and the drafter
    draws by it (over 3,000 draws each token's frequency is q's within 5 standard errors)."""
    gen = torch.Generator().manual_seed(3)
    for q in (torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), -1),
              torch.tensor([0.5, 0.0, 0.5, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)):
        for guess in range(len(q)):
            keep, rest = guess_rule(q, guess)
            law = (1.0 - keep) * rest / rest.sum()
            law[guess] += keep
            assert torch.allclose(law, q, rtol=0, atol=1e-12), (q, guess)
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, -2.0])
    q = torch.softmax(logits, -1)
    n, counts = 3000, torch.zeros(5)
    for _ in range(n):
        token, row = _draw(logits, 3, SamplingConfig(temperature=1.0), gen, 0)
        counts[token] += 1
    assert torch.equal(row, q)
    assert ((counts / n - q).abs() < 5 * (q * (1 - q) / n).sqrt()).all(), (counts / n, q)


def test_greedy_cascade_equals_plain_decoding(pair):
    target, draft = pair
    ar = generate(target, PROMPT, max_new_tokens=50)
    for method in (dict(drafter="cascade", k=4, policy="static"), dict(drafter="cascade", k=8, policy="static"),
                   dict(drafter="cascade", policy=AutoPolicy(costs=CHEAP_ROWS)),
                   dict(config=DecodeConfig.parse("spec:cascade:block:max_ngram=3:min_ngram=2"))):
        spec = generate(target, PROMPT, draft=draft, max_new_tokens=50, **method)
        assert spec.token_ids == ar.token_ids, method
        assert spec.stats.mean_accepted_per_forward > 1.0
        assert spec.method.startswith("spec:cascade:block")


# Rows nearly free, a draft token a fifth of a step: the planner drafts with the model while its
# tokens pay and stops it where they stop paying, which is where the lookup takes over.
PRICEY_DRAFT = CostModel([1.0 + 0.02 * (n - 1) for n in range(1, 17)], draft=0.2)


def test_the_horizontal_cascade_goes_on_with_the_lookup_where_the_planner_stops_the_model(pair):
    target, draft = pair
    backend = HFCausalLM(target)
    drafter = make_drafter("cascade", backend, HFCausalLM(draft), min_ngram=2)
    policy = AutoPolicy(costs=PRICEY_DRAFT)
    policy.bind(backend, drafter)
    steps = list(speculative_steps(backend, drafter, make_verifier("block"), policy, PROMPT,
                                   sampling=SamplingConfig(), max_new_tokens=60))
    assert [t for s in steps for t in s.tokens] == generate(target, PROMPT, max_new_tokens=60).token_ids
    assert drafter.used["horizontal"] > 0 and drafter.used["model"] > 0
    assert set(policy.describe()["drafters"]) == {"ngram", "model"}  # the planner weighs both sources


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8)])
def test_gumbel_seeded_cascade_gives_plain_decodings_tokens(pair, settings):
    target, draft = pair
    kept = 0
    for seed in (0, 2**64 - 1):
        sampling = SamplingConfig(**settings, gumbel_seed=seed)
        expected = [t for s in autoregressive_steps(HFCausalLM(target), PROMPT, sampling=sampling, max_new_tokens=30)
                    for t in s.tokens]
        for policy in (StaticK(4), StaticK(8), AutoPolicy(costs=CHEAP_ROWS), AutoPolicy(costs=PRICEY_DRAFT)):
            backend = HFCausalLM(target)
            drafter = make_drafter("cascade", backend, HFCausalLM(draft))
            policy.bind(backend, drafter)
            steps = list(speculative_steps(backend, drafter, make_verifier("coupled"), policy, PROMPT,
                                           sampling=sampling, max_new_tokens=30))
            assert [t for s in steps for t in s.tokens] == expected, (seed, policy.name)
            kept += sum(s.accepted for s in steps)
    assert kept > 0


def test_sampled_cascade_runs_through_the_api_with_a_seed(pair):
    target, draft = pair
    runs = [generate(target, PROMPT, draft=draft, drafter="cascade", temperature=1.0, seed=5, max_new_tokens=30)
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 30 and runs[0].exact


def test_bad_cascade_options_are_named():
    with pytest.raises(ValueError, match="bad option for the cascade drafter"):
        make_drafter("cascade", None, HFCausalLM(tiny_llama(0)), depth=3)
    with pytest.raises(ValueError, match="the cascade drafter needs a draft model"):
        make_drafter("cascade", None, None)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        make_drafter("cascade", None, HFCausalLM(tiny_llama(0)), max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="threshold"):
        DecodeConfig.parse("spec:cascade:threshold=0.5")


def test_greedy_cascade_on_the_smollm2_gguf_equals_plain_decoding():
    from helpers import CONTEXT, _Unsure, _gguf

    from specdec.backends import llamacpp

    model = llamacpp.load_gguf(_gguf(), n_threads=THREADS, n_ctx=512, prefill_layout="repacked")
    draft = _Unsure(model.fork(), scale=1.0)
    expected = generate(model, CONTEXT, max_new_tokens=24, eos_token_ids=[]).token_ids
    for method in (dict(k=4, policy="static"), dict(policy=AutoPolicy(costs=PRICEY_DRAFT))):
        spec = generate(model, CONTEXT, draft=draft, drafter="cascade", max_new_tokens=24, eos_token_ids=[], **method)
        assert spec.token_ids == expected, method
        assert spec.stats.accepted_tokens > 0
