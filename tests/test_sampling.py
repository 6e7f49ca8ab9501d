"""Sampling: temperature, top-k, top-p, greedy, and the checks on their values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.sampling import SamplingConfig, argmax, logits_to_probs, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0], dtype=torch.float64)


def test_greedy_is_one_hot_on_argmax() -> None:
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=0.0))
    assert probs.tolist() == [0, 0, 0, 0, 1]


def test_temperature_scales_logits() -> None:
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=2.0))
    torch.testing.assert_close(probs, torch.softmax(LOGITS / 2.0, -1))


def test_top_k_keeps_the_k_largest() -> None:
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    expected = torch.zeros(5, dtype=torch.float64)
    expected[[0, 4]] = torch.softmax(LOGITS[[0, 4]], -1)
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("top_p, kept", [(0.5, [4]), (0.9, [4, 0, 1]), (1.0, [4, 0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float, kept: list[int]) -> None:
    full = torch.softmax(LOGITS, -1)  # sorted: 4 (.61), 0 (.22), 1 (.08), 2 (.05), 3 (.01)
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=top_p))
    expected = torch.zeros(5, dtype=torch.float64)
    expected[kept] = full[kept] / full[kept].sum()
    torch.testing.assert_close(probs, expected)


def test_top_k_then_top_p_per_row() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.8))
    for row, lg in zip(probs, logits):
        torch.testing.assert_close(row, logits_to_probs(lg, SamplingConfig(1.0, 3, 0.8)))
    assert ((probs > 0).sum(-1) <= 3).all()


def test_sample_never_draws_zero_probability_and_is_seeded() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    draws = [sample(probs, torch.Generator().manual_seed(s)) for s in range(50)]
    assert set(draws) == {1, 3}
    again = [sample(probs, torch.Generator().manual_seed(s)) for s in range(50)]
    assert draws == again


def test_sample_follows_the_distribution() -> None:
    """Chi-square goodness of fit, 20000 draws from an unnormalised 6-token law with a zero.

    At level 1e-3 the test rejects a sampler off by Cohen's w = 0.05 (e.g. 0.02 of mass moved
    between two tokens of mass 0.1 gives w ~ 0.063) with power > 0.99 (computed below)."""
    from scipy import stats

    weights = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.25, 0.25])  # sum 4: not normalised
    gen = torch.Generator().manual_seed(7)
    n = 20000
    counts = torch.bincount(torch.tensor([sample(weights, gen) for _ in range(n)]), minlength=6)
    assert counts[1] == 0
    expected = (weights / weights.sum() * n)[weights > 0]
    observed = counts[weights > 0].double()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    critical = stats.chi2.ppf(1 - 1e-3, dof)
    assert stats.ncx2.sf(critical, dof, n * 0.05**2) > 0.99  # the stated power
    assert chi2 < critical


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_is_torchs_ties_to_the_lowest_id(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (5, 151936), generator=gen).to(dtype)  # [5, V] many ties
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    assert argmax(logits).tolist() == [int(row.argmax()) for row in logits]
    assert int(argmax(logits[2])) == int(torch.nonzero(logits[2] == logits[2].max())[0])
    assert int(argmax(logits[:, ::2][1])) == int(logits[:, ::2][1].argmax())  # a strided view
    assert argmax(logits).dtype == torch.int64


def test_sample_draws_the_same_as_an_out_of_place_cumulative_sum() -> None:
    """The in-place cumulative sum gives the same sums, so the same seeded draws."""
    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(3 * torch.randn(151936, generator=gen), 0)
    cdf = torch.cumsum(probs.to(torch.float64), 0)
    for seed in range(20):
        u = torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * cdf[-1]
        expected = int(torch.searchsorted(cdf, u, right=True))
        assert sample(probs, torch.Generator().manual_seed(seed)) == expected
    for given in (probs, probs.double()):
        before = given.clone()
        sample(given, gen)
        assert torch.equal(given, before)  # the caller's probabilities are untouched


def test_sample_edge_cases() -> None:
    one_hot = torch.zeros(151936)
    one_hot[151935] = 1.0
    assert sample(one_hot, torch.Generator().manual_seed(0)) == 151935
    last = torch.tensor([0.0, 1e-30, 0.0])
    assert sample(last, None) == 1
    with pytest.raises(ValueError, match="no positive mass"):
        sample(torch.zeros(4), None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
    ],
)
def test_bad_values_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_the_gumbel_candidate_filter_finds_the_whole_vocabularys_largest_keys():
    """On a 152k vocabulary the sampler computes exact keys only for the filter's candidates; the
    tokens it returns are those of every token's key ranked (ties to the lowest id), for peaked,
    spread, partly masked and flat rows and 1 to 4 tokens drawn."""
    from specdec import sampling

    assert sampling._filter() is not None  # the filter is built here (a C compiler is present)
    rng = np.random.default_rng(7)
    vocab = 151936
    for trial in range(60):
        scores = rng.standard_normal(vocab) * rng.uniform(0.5, 6.0)
        if trial % 3 == 0:
            scores[rng.integers(0, vocab, 50)] += 10.0  # a few dominant tokens
        if trial % 5 == 0:
            scores[rng.random(vocab) < 0.5] = -np.inf  # half the vocabulary outside the support
        if trial % 7 == 0:
            scores[:] = 0.0  # flat: more candidates than the cap, every key computed
        seed, position, count = int(rng.integers(0, 2**63)), int(rng.integers(0, 5000)), int(rng.integers(1, 5))
        keys = scores - sampling._vocabulary_noise(seed, position, vocab)
        expected = [int(i) for i in np.argsort(-keys, kind="stable")[:count]]
        assert sampling.gumbel_max(scores, seed, position, count) == expected, trial
    spread = rng.standard_normal(vocab) * 3.0
    candidates = sampling._candidates(spread, 5, 123, 1)
    assert candidates is not None and 1 <= len(candidates) < vocab // 100  # exact keys for a few tokens only


@pytest.mark.parametrize("vocab", [64, 151936])  # every key computed; the candidate filter (vocab >= 4096)
def test_gumbel_max_draws_no_token_where_none_is_asked_for(vocab):
    """A dynamic tree asks a node with no room left for zero children: the answer is no token (on a
    large vocabulary this once reached the candidate filter, which failed on a zero count)."""
    from specdec import sampling

    scores = np.random.default_rng(3).standard_normal(vocab)
    assert sampling.gumbel_max(scores, 2, 40, count=0) == []
    assert len(sampling.gumbel_max(scores, 2, 40, count=3)) == 3
