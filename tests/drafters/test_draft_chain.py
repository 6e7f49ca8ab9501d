"""One drafting loop for every chain drafter, and one meaning of the confidence a policy sees."""

from __future__ import annotations

import pytest
import torch

from specdec.backends.hf import HFCausalLM
from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.drafters.base import confidence, draft_chain
from specdec.drafters.early_exit import LayerSubsetDrafter
from specdec.drafters.layer_skip import LayerSkipDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import LONGEST_MATCH, NGramDrafter, lookup_confidence
from specdec.policies import ConfidenceStop
from specdec.sampling import SamplingConfig, sample
from tiny import tiny_llama

SAMPLINGS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.5),
    SamplingConfig(temperature=1.5),
    SamplingConfig(temperature=1.0, top_k=2),
    SamplingConfig(temperature=1.0, top_p=0.5),
    SamplingConfig(temperature=0.7, top_k=3, top_p=0.8),
]
THRESHOLD = 0.5
MODEL_THRESHOLD = 0.35  # the tiny model below is rarely surer than 0.5


def _rows(tops: list[float], vocab: int = 8) -> torch.Tensor:
    """Logits [len(tops), V] whose softmax puts ``top`` on token i % V and the rest evenly."""
    rows = torch.empty(len(tops), vocab)
    for i, top in enumerate(tops):
        rest = (1 - top) / (vocab - 1)
        probs = torch.full((vocab,), rest)
        probs[i % vocab] = top
        rows[i] = probs.log()
    return rows


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_keep_going_sees_the_drafts_own_probabilities_whatever_the_sampling(sampling):
    """The confidence is softmax(logits) at temperature 1 before filters: under greedy the one-hot
    q, under temperature 0.5 a sharpened q, under top-k a cut q would each cross 0.5 elsewhere."""
    tops = [0.9, 0.7, 0.6, 0.3, 0.95, 0.95]
    rows = _rows(tops)
    seen: list[torch.Tensor] = []
    policy = ConfidenceStop(k_max=6, threshold=THRESHOLD)
    it = iter(rows)
    draft = draft_chain(lambda _: next(it), 6, sampling, torch.Generator().manual_seed(0),
                        lambda c: seen.append(c) or policy.keep_going(c), vocab_size=8)
    assert len(draft) == 4  # stops after the token drawn where the draft's own top is 0.3
    assert [round(float(c.max()), 5) for c in seen] == tops[:4]
    replay = torch.Generator().manual_seed(0)
    assert [sample(q, replay) for q in draft.q] == draft.tokens.tolist()  # drawn from the q reported


def test_keep_going_is_asked_after_every_token_but_the_last():
    calls = []
    it = iter(_rows([0.9, 0.9, 0.9]))
    draft = draft_chain(lambda _: next(it), 3, SamplingConfig(), None, lambda c: calls.append(c) or True, 8)
    assert len(draft) == 3 and len(calls) == 2


def test_a_deterministic_drafter_reports_point_masses_and_draws_nothing():
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    tokens = iter([3, 1, 4])
    draft = draft_chain(lambda _: next(tokens), 3, SamplingConfig(temperature=1.0), gen, None, 6)
    assert draft.tokens.tolist() == [3, 1, 4]
    assert torch.equal(draft.q, torch.eye(6)[[3, 1, 4]])
    assert torch.equal(gen.get_state(), state)


def _wrappers(model):
    """The same draft model behind three drafters."""
    n = model.config.num_hidden_layers
    return {
        "model": ModelDrafter(HFCausalLM(model)),
        "layers": LayerSubsetDrafter(HFLayeredCausalLM(model), range(n)),
        "layer-skip": LayerSkipDrafter(HFLayeredCausalLM(model), skip=[]),
    }


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_the_confidence_policy_drafts_the_same_lengths_whatever_the_drafter_and_the_filters(sampling):
    """Under the same draft tokens, every drafter stops where the draft model's own softmax first
    falls below the threshold, whatever the sampling settings."""
    model = tiny_llama(22, vocab=16, layers=2, sharpness=20.0)  # top probabilities ~0.2 to 0.8
    lengths = set()
    for name, drafter in _wrappers(model).items():
        for seed, context in enumerate([[1, 2, 3, 4], [5, 9, 2], [7, 7, 0, 3], [11, 4], [2, 14, 6, 8, 1]]):
            seen = []
            policy = ConfidenceStop(k_max=8, threshold=MODEL_THRESHOLD)
            draft = drafter.propose(context, 8, sampling, torch.Generator().manual_seed(seed),
                                    lambda c: seen.append(c) or policy.keep_going(c))
            drafter.observe(context)
            tokens = draft.tokens.tolist()
            with torch.no_grad():
                logits = model(torch.tensor([context + tokens])).logits[0, len(context) - 1 :]  # [n + 1, V]
            own = confidence(logits[: len(tokens)])  # [n, V]: the model's softmax at each drafted position
            assert len(seen) == min(len(tokens), 7), (name, seed)
            assert torch.allclose(torch.stack(seen), own[: len(seen)], atol=1e-5), (name, seed)
            below = [i for i in range(len(tokens)) if float(own[i].max()) < MODEL_THRESHOLD]
            assert len(tokens) == (below[0] + 1 if below else 8), (name, seed)
            lengths.add(len(tokens))
    assert len(lengths) > 1  # the threshold cuts drafts at different places, not always at once


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_an_ngram_draft_is_as_sure_as_its_match_is_long_whatever_the_filters(sampling):
    context = [1, 2, 3, 1, 2, 3, 1]  # the suffix 1 2 3 1 occurred 3 tokens earlier: a 4-token match
    sure = lookup_confidence(4)
    assert sure == 0.5 and NGramDrafter(16).confidence(context) == sure
    for threshold, drafted in ((sure, [2, 3, 1, 2, 3]), (sure + 0.01, [2])):
        seen = []
        policy = ConfidenceStop(k_max=5, threshold=threshold)
        draft = NGramDrafter(16).propose(context, 5, sampling, None, lambda c: seen.append(c) or policy.keep_going(c))
        assert draft.tokens.tolist() == drafted
        assert [c.tolist() for c in seen] == [[sure]] * min(len(drafted), 4)  # asked after each token but the 5th
        assert torch.equal(draft.q, torch.eye(16)[drafted])  # the verifier still gets point masses


def test_a_lookups_confidence_grows_with_how_far_back_its_match_reaches():
    drafter = NGramDrafter(16, max_ngram=2, min_ngram=1)
    assert drafter.confidence([5, 6, 7]) is None  # nothing repeats
    assert drafter.confidence([5, 6, 5]) == lookup_confidence(1) == 0.0
    assert drafter.confidence([9, 5, 6, 7, 9, 5, 6]) == lookup_confidence(3)  # past max_ngram: 9 5 6
    periodic = [1, 2] * 20
    assert drafter.confidence(periodic) == lookup_confidence(LONGEST_MATCH)  # 38 tokens, counted up to 32
    assert lookup_confidence(20) == 0.9 and lookup_confidence(10) == 0.8
