"""Closed forms from the speculative decoding analysis (Leviathan et al. 2023, section 3).

alpha is the expected acceptance rate of one draft token, alpha = E_x[sum_v min(p(v|x), q(v|x))];
k the number of drafted tokens; c the cost of one draft step relative to one target step.
"""

from __future__ import annotations

import torch


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_v min(p, q) per row: the chance token verification accepts a draft from q. [..., V] -> [...]."""
    return torch.minimum(p, q).sum(-1)


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens per target forward] = (1 - alpha^(k+1)) / (1 - alpha), assuming i.i.d. acceptance."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Wall-clock improvement over autoregressive decoding: (1 - alpha^(k+1)) / ((1 - alpha)(kc + 1))."""
    return expected_tokens_per_step(alpha, k) / (k * c + 1.0)


def optimal_k(alpha: float, c: float, k_max: int = 16) -> int:
    """The k in 1..k_max that maximises :func:`expected_speedup` (ties go to the smaller k)."""
    return max(range(1, k_max + 1), key=lambda k: (expected_speedup(alpha, k, c), -k))
