"""The full engine on tiny random transformers: greedy equality, rollback, statistics, bad input."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from specdec import SamplingConfig, generate, stream
from specdec.backends.base import forward_after
from specdec.backends.hf import HFCausalLM
from specdec.drafters.model import ModelDrafter
from specdec.engine import speculative_steps
from specdec.policies import StaticK
from specdec.verify import make_verifier
from helpers import ContextLM, HORIZON, PROMPT, SAMPLES, SIGNIFICANCE, assert_sampled_law, chi_square_p_value, exact_target_law
from tiny import noisy_copy, tiny_llama


@pytest.fixture(scope="module")
def pair():
    """A target and a noisy copy of it as draft: drafts are accepted often, rejected often."""
    target = tiny_llama(0, vocab=16, sharpness=10.0)
    return target, noisy_copy(target, 0.3)


# --- greedy equality -----------------------------------------------------------------------------


@pytest.mark.parametrize("verify", ["greedy", "token", "block"])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_speculative_equals_autoregressive(pair, verify: str, k: int) -> None:
    target, draft = pair
    ar = generate(target, PROMPT, max_new_tokens=40)
    spec = generate(target, PROMPT, draft=draft, verify=verify, k=k, policy="static", max_new_tokens=40)
    assert spec.token_ids == ar.token_ids
    assert len(spec.token_ids) == 40
    assert 0 < spec.stats.accepted_tokens < spec.stats.drafted_tokens  # both outcomes exercised


@pytest.mark.parametrize("verify", ["greedy", "token", "block"])
def test_draft_equal_to_target_accepts_every_token(pair, verify: str) -> None:
    target, _ = pair
    result = generate(target, PROMPT, draft=target, verify=verify, k=4, policy="static", max_new_tokens=25)
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.target_forwards == 5  # 25 tokens, 4 drafted + 1 bonus per forward
    assert result.token_ids == generate(target, PROMPT, max_new_tokens=25).token_ids


@pytest.mark.parametrize("verify", ["greedy", "token", "block"])
def test_eos_inside_a_draft_stops_there(pair, verify: str) -> None:
    target, _ = pair
    ar_full = generate(target, PROMPT, max_new_tokens=30).token_ids
    eos = ar_full[9]  # the 10th token becomes EOS
    first = ar_full.index(eos)
    ar = generate(target, PROMPT, max_new_tokens=30, eos_token_ids=[eos])
    # draft = target accepts everything, so EOS arrives inside an accepted draft block
    spec = generate(target, PROMPT, draft=target, verify=verify, k=4, policy="static", max_new_tokens=30,
                    eos_token_ids=[eos])
    assert ar.token_ids == ar_full[: first + 1]
    assert spec.token_ids == ar.token_ids
    assert spec.stats.new_tokens == first + 1


def test_streaming_yields_the_same_tokens(pair) -> None:
    target, draft = pair
    events = list(stream(target, PROMPT, draft=draft, k=3, policy="static", max_new_tokens=20))
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == generate(target, PROMPT, max_new_tokens=20).token_ids
    assert all(len(e.from_draft) == len(e.token_ids) and not e.from_draft[-1] for e in events)


# --- rollback ------------------------------------------------------------------------------------


def test_caches_after_rejection_match_a_fresh_forward(pair) -> None:
    target_model, draft_model = pair
    target, draft = HFCausalLM(target_model), HFCausalLM(draft_model)
    steps = speculative_steps(
        target, ModelDrafter(draft), make_verifier("block"), StaticK(4), PROMPT,
        sampling=SamplingConfig(temperature=1.0), max_new_tokens=60,
        generator=torch.Generator().manual_seed(0),
    )
    context = list(PROMPT)
    rejections = 0
    for step in steps:
        context += step.tokens
        rejections += step.accepted < step.drafted
        for backend, model in ((target, target_model), (draft, draft_model)):
            # the cache holds a prefix of the output, no rejected token
            assert backend.tokens == context[: len(backend.tokens)]
            assert backend._cache.get_seq_length() == len(backend.tokens)
    assert rejections > 0
    for backend, model in ((target, target_model), (draft, draft_model)):
        cached = forward_after(backend, context)[-1]
        with torch.no_grad():
            fresh = model(torch.tensor([context])).logits[0, -1]
        torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)


# --- the output law, statistically ---------------------------------------------------------------

@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("top_k", [0, 3])
def test_output_follows_target_law(verify: str, top_k: int) -> None:
    assert_sampled_law(top_k, verify=verify, k=2, policy="static")


def test_chi_square_catches_the_draft_law() -> None:
    """Negative control: samples from the draft instead of the target are rejected."""
    vocab = 5
    target = tiny_llama(0, vocab=vocab, sharpness=6.0)
    draft = noisy_copy(target, 0.5)
    sampling = SamplingConfig(temperature=1.0)
    law = exact_target_law(target, sampling, vocab)
    counts = np.zeros_like(law)
    draft_lm = ContextLM(draft)  # answers from memory, as in assert_sampled_law
    for seed in range(SAMPLES // 3):
        r = generate(draft_lm, PROMPT, temperature=1.0, max_new_tokens=HORIZON, seed=seed, eos_token_ids=[])
        counts[tuple(r.token_ids)] += 1
    assert chi_square_p_value(counts, law) < SIGNIFICANCE


def test_same_seed_same_output(pair) -> None:
    target, draft = pair
    kw = dict(draft=draft, verify="block", k=3, policy="static", temperature=1.0, max_new_tokens=20, seed=7)
    assert generate(target, PROMPT, **kw).token_ids == generate(target, PROMPT, **kw).token_ids


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k=0), "k .* positive"),
        (dict(k=-2), "k .* positive"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(verify="nope"), "unknown verifier"),
        (dict(verify="greedy", temperature=1.0), "greedy verification"),
    ],
)
def test_bad_options_raise(pair, kwargs, message) -> None:
    target, draft = pair
    with pytest.raises(ValueError, match=message):
        generate(target, PROMPT, draft=draft, **kwargs)


def test_vocabulary_mismatch_raises(pair) -> None:
    target, _ = pair
    other = tiny_llama(2, vocab=20)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(target, PROMPT, draft=other)


def test_empty_prompt_raises(pair) -> None:
    target, draft = pair
    with pytest.raises(ValueError, match="empty"):
        generate(target, [], draft=draft)


def test_prompt_longer_than_context_raises() -> None:
    target = tiny_llama(0, vocab=16, context=32)
    with pytest.raises(ValueError, match="context"):
        generate(target, list(range(16)) * 2, draft=target)


def test_generation_stops_at_the_context_limit() -> None:
    target = tiny_llama(0, vocab=16, context=32)
    result = generate(target, PROMPT * 8, draft=target, k=4, policy="static", max_new_tokens=100, eos_token_ids=[])
    assert len(result.token_ids) == 32 - 24


def test_lossy_rule_is_marked_in_the_result(pair) -> None:
    target, draft = pair
    exact = generate(target, PROMPT, draft=draft, verify="block", max_new_tokens=5)
    lossy = generate(target, PROMPT, draft=draft, verify="typical", temperature=1.0, seed=0, max_new_tokens=5)
    assert exact.exact and exact.method == "spec:ngram+model:block:k=4:policy=auto"
    assert not lossy.exact and lossy.method == "spec:ngram+model:typical:k=4:policy=auto"  # exact tells, not the name
