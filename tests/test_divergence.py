import pytest
import torch

from specdec.divergence import first_divergence, top2_margin


def test_identical_or_prefix_outputs_have_no_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2], [1, 2, 3]) is None


def test_the_first_difference_and_each_pass_margin_are_reported():
    ar_rows = {2: torch.tensor([0.0, 5.0, 4.99, 1.0])}  # a near-tie between tokens 1 and 2
    spec_rows = {2: torch.tensor([0.0, 4.98, 5.0, 1.0])}  # rounding flipped it
    d = first_divergence([7, 8, 2, 9], [7, 8, 1, 3], spec_row=spec_rows.__getitem__, ar_row=ar_rows.__getitem__)
    assert (d.position, d.spec_token, d.ar_token) == (2, 2, 1)
    assert d.ar_margin == pytest.approx(0.01, abs=1e-6) and d.spec_margin == pytest.approx(0.02, abs=1e-6)
    assert d.ar_gap == pytest.approx(0.01, abs=1e-6) and d.spec_gap == pytest.approx(0.02, abs=1e-6)
    assert "new token 2" in d.describe() and "ar 0.01" in d.describe()


def test_without_rows_only_the_tokens_are_reported():
    d = first_divergence([5, 6], [5, 4])
    assert d.spec_margin is None and d.ar_margin is None
    assert d.describe() == "first difference at new token 1: 6 (speculative) vs 4 (ar)"


def test_top2_margin():
    assert top2_margin(torch.tensor([1.0, 3.0, 2.5])) == pytest.approx(0.5)
