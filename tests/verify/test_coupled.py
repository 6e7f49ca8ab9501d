"""The Gumbel-max sampler and coupled verification: same seed, same text, whatever drafts.

- The noise is a function of (seed, position, token) alone; Gumbel-max draws follow softmax (a
  chi-square test) and the shared-noise pair (target, draft) follows the coupling's exact joint law.
- The coupling's joint law has the marginals p and q exactly, its diagonal mass is the closed form,
  and it lies between (1 - TV) / (1 + TV) and 1 - TV.
- By equality: on tiny torch models, every drafter (draft model, n-gram, early exit, layer skip,
  heads, EAGLE), chains of k = 1, 4 and 8, the planner and every tree produce exactly the tokens of
  plain Gumbel-max decoding with the same seed, at T = 0.7, 1 and 1.5, with top-k and top-p; a
  different seed gives different text. (The same on the SmolLM2 GGUF: ``test_llamacpp.py``.)
The exact enumeration of the coupled rule's output law is in ``test_verify_exact.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import DecodeConfig, generate
from specdec.backends.hf import HFCausalLM
from specdec.build import make_drafter
from specdec.config import ConfigError
from specdec.drafters.model import ModelDrafter
from specdec.drafters.tree import TreeDrafter, Trees
from specdec.engine import autoregressive_steps, speculative_steps
from specdec.policies import StaticK
from specdec.policies.auto import AutoPolicy
from specdec.sampling import SamplingConfig, gumbel_max, gumbel_noise, gumbel_token, next_token
from specdec.verify import make_verifier
from specdec.verify.coupled import acceptance, coupling_joint
from specdec.verify.tree import TreeVerifier
from helpers import CHEAP_ROWS, SIGNIFICANCE, assert_sampled_law, chi_square_p_value, chi_square_power, drafter_for
from tiny import noisy_copy, tiny_llama

SAMPLINGS = [dict(temperature=t, **f) for t in (0.7, 1.0, 1.5) for f in ({}, {"top_k": 5}, {"top_p": 0.8})]
SAMPLING_IDS = [f"T{s['temperature']}-" + ("topk" if "top_k" in s else "topp" if "top_p" in s else "full")
                for s in SAMPLINGS]


# --- the noise -------------------------------------------------------------------------------------


def test_the_noise_of_a_token_depends_on_the_seed_the_position_and_the_token_only():
    ids = np.array([0, 7, 151935, 3])
    full = gumbel_noise(5, 12, np.arange(151936))
    assert np.array_equal(gumbel_noise(5, 12, ids), full[ids])  # a subset's noise is the whole row's
    assert np.all(np.isfinite(full))
    for other in (gumbel_noise(6, 12, ids), gumbel_noise(5, 13, ids)):
        assert not np.any(other == full[ids])
    # the top-k path (noise for the support only) and the full path draw the same token
    scores = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    cut = scores.masked_fill(scores < scores.topk(20).values[-1], float("-inf"))  # 20 of 4096: the support path
    wide = scores.masked_fill(scores < scores.topk(1024).values[-1], float("-inf"))  # the whole-row path
    for position in range(50):
        assert gumbel_max(cut, 9, position) == gumbel_max(cut.numpy().copy(), 9, position)
        ranked = gumbel_max(wide, 9, position, count=3)
        assert len(set(ranked)) == 3 and ranked[0] == gumbel_max(wide, 9, position)[0]


def test_gumbel_max_draws_follow_softmax():
    """Chi-square over 20000 positions of one seed: each draw is from softmax(scores). Power: a
    deviation of Cohen's w = 0.05 is caught with probability >= 0.99 at SIGNIFICANCE."""
    law = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.03, 0.01])
    n = 20000
    assert chi_square_power(law, n, effect=0.05) >= 0.99
    counts = np.bincount([gumbel_max(np.log(law), 3, t)[0] for t in range(n)], minlength=len(law))
    assert chi_square_p_value(counts, law) > SIGNIFICANCE
    skewed = np.bincount([gumbel_max(np.log(law) * 1.2, 3, t)[0] for t in range(n)], minlength=len(law))
    assert chi_square_p_value(skewed, law) < SIGNIFICANCE  # negative control: a sharper law is caught


# --- the coupling's law ----------------------------------------------------------------------------


def _pairs():
    rng = np.random.default_rng(0)
    for vocab in (2, 3, 5, 8):
        for _ in range(6):
            p, q = rng.dirichlet(np.full(vocab, 0.6)), rng.dirichlet(np.full(vocab, 0.6))
            yield p, q
    p = rng.dirichlet(np.ones(5))
    q = rng.dirichlet(np.ones(5))
    q[[0, 3]] = 0.0
    yield p, q / q.sum()  # a draft with zeros
    pz = p.copy()
    pz[1] = 0.0
    yield pz / pz.sum(), rng.dirichlet(np.ones(5))  # a target with zeros (top-k / top-p)
    yield p, np.eye(5)[2]  # a point-mass draft (n-gram lookup)
    yield p, p  # a draft equal to the target


@pytest.mark.parametrize("p,q", list(_pairs()))
def test_the_couplings_joint_law_has_marginals_p_and_q_and_the_closed_form_diagonal(p, q):
    joint = coupling_joint(p, q)
    assert np.abs(joint.sum(axis=1) - p).max() < 1e-12  # off-diagonal integrals and diagonal agree
    assert np.abs(joint.sum(axis=0) - q).max() < 1e-12
    accepted = acceptance(p, q)
    assert abs(accepted - (1.0 - (joint.sum() - np.trace(joint)))) < 1e-12
    tv = 0.5 * np.abs(p - q).sum()
    assert (1 - tv) / (1 + tv) - 1e-12 <= accepted <= 1 - tv + 1e-12  # Daliri et al.'s bound; rejection's 1 - TV
    if np.count_nonzero(q) == 1:
        assert abs(accepted - (1 - tv)) < 1e-12  # a point-mass draft loses nothing against rejection


@pytest.mark.parametrize("p,q", list(_pairs()))
def test_the_fast_agreement_is_the_closed_form_term_by_term(p, q):
    from specdec.verify.coupled import agreement

    direct = [p[v] * q[v] / np.maximum(p * q[v], q * p[v]).sum() if p[v] * q[v] > 0 else 0.0 for v in range(len(p))]
    assert np.abs(agreement(p, q) - direct).max() < 1e-15


def test_shared_noise_draws_pairs_from_the_couplings_joint_law():
    """The pair (target's Gumbel-max token, draft's) drawn with the real noise over 20000 positions
    against the exact joint law: chi-square, w = 0.05 caught with probability >= 0.99."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.3, 0.3, 0.1, 0.3])
    law = coupling_joint(p, q)
    n = 20000
    assert chi_square_power(law, n, effect=0.05) >= 0.99
    counts = np.zeros_like(law)
    for t in range(n):
        counts[gumbel_max(np.log(p), 11, t)[0], gumbel_max(np.log(q), 11, t)[0]] += 1
    assert chi_square_p_value(counts, law) > SIGNIFICANCE
    assert abs(np.trace(counts) / n - acceptance(p, q)) < 4 * np.sqrt(0.25 / n)


def test_the_engines_gumbel_sampler_follows_the_target_law():
    """Through the engine (coupled speculative decoding, k = 2): the first tokens over many seeds
    against the exact law (power stated in :func:`test_engine.assert_sampled_law`)."""
    assert_sampled_law(drafter="model", sampler="gumbel", k=2, policy="static")


# --- equality with plain decoding ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, vocab=16, layers=2, sharpness=4.0)


PROMPT_REPEATS = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # repeats itself: the n-gram lookup drafts


def plain(model, sampling: SamplingConfig, n: int = 30) -> list[int]:
    steps = autoregressive_steps(HFCausalLM(model), PROMPT_REPEATS, sampling=sampling, max_new_tokens=n)
    return [t for s in steps for t in s.tokens]


def spec(target, drafter, policy, sampling: SamplingConfig, n: int = 30) -> tuple[list[int], int, int]:
    steps = list(speculative_steps(target, drafter, make_verifier("coupled"), policy, PROMPT_REPEATS,
                                   sampling=sampling, max_new_tokens=n))
    return [t for s in steps for t in s.tokens], sum(s.drafted for s in steps), sum(s.accepted for s in steps)


@pytest.mark.parametrize("settings", SAMPLINGS, ids=SAMPLING_IDS)
def test_every_chain_drafter_and_length_gives_plain_decodings_tokens(model, settings):
    seeds = (0, 1, 2**64 - 1)
    outputs = set()
    for seed in seeds:
        sampling = SamplingConfig(**settings, gumbel_seed=seed)
        expected = plain(model, sampling)
        outputs.add(tuple(expected))
        accepted = rejected = 0
        for name in ("model", "ngram", "early-exit", "layer-skip", "heads", "eagle"):
            for k in (1, 4, 8):
                target, drafter = drafter_for(name, model)
                tokens, drafted, kept = spec(target, drafter, StaticK(k), sampling)
                assert tokens == expected, (seed, name, k)
                accepted, rejected = accepted + kept, rejected + drafted - kept
        target = HFCausalLM(model)  # the planner with the default drafter, ngram+model
        drafter = make_drafter("ngram+model", target, HFCausalLM(noisy_copy(model, 0.3)))
        tokens, drafted, _ = spec(target, drafter, AutoPolicy(costs=CHEAP_ROWS), sampling)
        assert tokens == expected, (seed, "planner")
        assert drafted > 0
        assert accepted > 0 and rejected > 0  # both outcomes were exercised
    assert len(outputs) == len(seeds)  # another seed, another text


@pytest.mark.parametrize("settings", SAMPLINGS, ids=SAMPLING_IDS)
def test_every_tree_gives_plain_decodings_tokens(model, settings):
    for seed in (4, 5):
        sampling = SamplingConfig(**settings, gumbel_seed=seed)
        expected = plain(model, sampling)
        kept = 0
        for shape in ({"mode": "confident", "threshold": 0.5}, {"mode": "dynamic"},
                      {"choices": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]}):
            target = HFCausalLM(model)
            drafter = TreeDrafter(HFCausalLM(noisy_copy(model, 0.3)), **shape)
            steps = list(speculative_steps(target, Trees(drafter), TreeVerifier(), StaticK(1 << 30), PROMPT_REPEATS,
                                           sampling=sampling, max_new_tokens=30))
            assert [t for s in steps for t in s.tokens] == expected, (seed, shape)
            kept += sum(s.accepted for s in steps)
        assert kept > 0


def test_through_the_api_every_method_gives_the_text_of_ar_with_the_same_seed(model):
    draft = noisy_copy(model, 0.3)
    common = dict(temperature=1.0, top_p=0.9, sampler="gumbel", seed=123, max_new_tokens=30, eos_token_ids=[])
    expected = generate(model, PROMPT_REPEATS, **common)
    assert expected.method == "ar"
    for method in (dict(draft=draft), dict(draft=draft, k=8, policy="static"), dict(drafter="ngram"),
                   dict(draft=draft, verify="tree"), dict(draft=draft, verify="token", k=3, policy="static")):
        result = generate(model, PROMPT_REPEATS, **method, **common)
        assert result.token_ids == expected.token_ids, method
        assert result.exact and result.stats.gumbel_seed == 123, result.method
        assert ("coupled" in result.method) == (method.get("verify") != "tree"), result.method  # a tree names no chain rule
    named = generate(model, PROMPT_REPEATS, draft=draft, verify="coupled", k=3, policy="static",
                     **{k: v for k, v in common.items() if k != "sampler"})  # the coupled rule brings its sampler
    assert named.token_ids == expected.token_ids
    with pytest.raises(ValueError, match="coupled verification .* verifies Gumbel-max draws, but sampler is multinomial"):
        generate(model, PROMPT_REPEATS, draft=draft, verify="coupled", **{**common, "sampler": "multinomial"})
    assert generate(model, PROMPT_REPEATS, **{**common, "seed": 124}).token_ids != expected.token_ids
    unseeded = [generate(model, PROMPT_REPEATS, **{**common, "seed": None}) for _ in range(2)]
    assert unseeded[0].token_ids != unseeded[1].token_ids  # no seed: fresh noise each call
    again = generate(model, PROMPT_REPEATS, draft=draft, **{**common, "seed": unseeded[0].stats.gumbel_seed})
    assert again.token_ids == unseeded[0].token_ids  # the seed drawn is reported, and draws the text again
    assert expected.stats.gumbel_seed == 123
    assert generate(model, PROMPT_REPEATS, **{**common, "sampler": "multinomial"}).stats.gumbel_seed is None


@pytest.mark.parametrize("settings", SAMPLINGS[:3], ids=SAMPLING_IDS[:3])
def test_a_draft_equal_to_the_target_drafts_with_the_same_noise_and_is_always_kept(model, settings):
    result = generate(model, PROMPT_REPEATS, draft=model, drafter="model", sampler="gumbel", seed=9, k=4,
                      policy="static", max_new_tokens=25, eos_token_ids=[], **settings)
    assert result.stats.acceptance_rate == 1.0 and result.stats.target_forwards == 5


def test_a_plain_step_and_a_verified_row_draw_the_same_token():
    """next_token, the coupled rule and the tree walk read one function of (logits, seed, position)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 2
    sampling = SamplingConfig(temperature=1.0, top_k=10, gumbel_seed=77)
    tokens = [gumbel_token(logits[i], sampling, 40 + i) for i in range(3)]
    assert tokens == [next_token(logits[i], sampling, None, 40 + i) for i in range(3)]
    from specdec.drafters.base import Draft

    draft = Draft(torch.tensor(tokens[:2]), torch.zeros(2, 50))
    verdict = make_verifier("coupled").verdict(draft, logits, sampling, None, 40)
    assert (verdict.accepted, verdict.next_token) == (2, tokens[2])
    wrong = Draft(torch.tensor([tokens[0], (tokens[1] + 1) % 50]), torch.zeros(2, 50))
    verdict = make_verifier("coupled").verdict(wrong, logits, sampling, None, 40)
    assert (verdict.accepted, verdict.next_token) == (1, tokens[1])


# --- the option ------------------------------------------------------------------------------------


def test_the_sampler_option_and_its_rules():
    assert DecodeConfig(sampler="gumbel").chain_verifier == "coupled"
    assert DecodeConfig(verify="coupled").gumbel and DecodeConfig(verify="coupled").sampling.gumbel_seed is None
    assert DecodeConfig(verify="coupled", seed=4).sampling.gumbel_seed == 4
    assert DecodeConfig(sampler="gumbel", verify="greedy").chain_verifier == "greedy"
    assert DecodeConfig(seed=4).sampling.gumbel_seed is None  # multinomial: the generator takes the seed
    assert DecodeConfig(seed=np.uint64(2**63), sampler="gumbel").sampling.gumbel_seed == 2**63  # numpy ints too
    assert str(DecodeConfig.parse("spec:model:coupled:k=3")) == "spec:model:coupled:k=3:policy=auto"
    with pytest.raises(ValueError, match="unknown sampler 'gumbal'; choose one of multinomial, gumbel"):
        DecodeConfig(sampler="gumbal")
    with pytest.raises(ConfigError, match="typical"):
        DecodeConfig(sampler="gumbel", verify="typical")
    with pytest.raises(ValueError, match="Gumbel-max sampler needs the token's position"):
        next_token(torch.zeros(4), SamplingConfig(temperature=1.0, gumbel_seed=1), None)
    with pytest.raises(ValueError, match="gumbel_seed"):
        SamplingConfig(temperature=1.0, gumbel_seed=-1)
    drafter = ModelDrafter(HFCausalLM(tiny_llama(0)))
    with pytest.raises(ValueError, match="Gumbel-max sampler"):
        make_verifier("coupled").verdict(drafter.propose([1, 2], 2, SamplingConfig(temperature=1.0), None),
                                         torch.zeros(3, 16), SamplingConfig(temperature=1.0), None, 2)
