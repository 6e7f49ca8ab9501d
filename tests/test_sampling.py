"""Sampling: temperature, top-k, top-p, greedy, and the checks on their values."""

from __future__ import annotations

import pytest
import torch

from specdec.sampling import SamplingConfig, logits_to_probs, sample

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
