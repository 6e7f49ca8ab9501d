"""Explain where a greedy speculative output differs from greedy decoding on the same backend.

Under greedy decoding an exact method reproduces the target's own tokens, provided every pass
computes the target's logits as a one-token step would. A backend whose batched kernels round
differently (llama.cpp's repacked CPU kernels, for one) can flip the argmax where the top two
logits nearly tie. :func:`first_divergence` reports the first differing position, the two tokens
and the target's top-2 logit margin there as each pass computed it: a margin of a few hundredths
is a near-tie decided by rounding; a wide margin that the speculative pass overturned points to a
verification bug.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

Row = Callable[[int], torch.Tensor]  # position -> the target's logits [V] there, as a pass computed them


@dataclass(frozen=True)
class Divergence:
    """position: index into the generated tokens. *_margin: top-1 minus top-2 logit of the target's
    row at that position in each run (None where the row was not given); *_gap: that row's logit of
    the run's own token minus the other run's token."""

    position: int
    spec_token: int
    ar_token: int
    spec_margin: float | None = None
    ar_margin: float | None = None
    spec_gap: float | None = None
    ar_gap: float | None = None

    def describe(self) -> str:
        text = f"first difference at new token {self.position}: {self.spec_token} (speculative) vs {self.ar_token} (ar)"
        if self.ar_margin is not None or self.spec_margin is not None:
            text += "; target's top-2 logit margin there: " + ", ".join(
                f"{name} {value:.4g}" for name, value in (("ar", self.ar_margin), ("speculative", self.spec_margin))
                if value is not None
            )
        return text


def top2_margin(row: torch.Tensor) -> float:
    """Top-1 minus top-2 logit of ``row`` [V]."""
    top = torch.topk(row.float(), 2).values
    return float(top[0] - top[1])


def first_divergence(
    spec: Sequence[int], ar: Sequence[int], spec_row: Row | None = None, ar_row: Row | None = None
) -> Divergence | None:
    """None when one token list is a prefix of the other (no differing position), else the
    first difference, with the margins read from ``spec_row`` / ``ar_row`` where given."""
    position = next((i for i, (a, b) in enumerate(zip(spec, ar)) if a != b), None)
    if position is None:
        return None
    s, a = int(spec[position]), int(ar[position])

    def read(row: Row | None, own: int, other: int) -> tuple[float | None, float | None]:
        if row is None:
            return None, None
        logits = row(position)  # [V]
        return top2_margin(logits), float(logits[own] - logits[other])

    spec_margin, spec_gap = read(spec_row, s, a)
    ar_margin, ar_gap = read(ar_row, a, s)
    return Divergence(position, s, a, spec_margin, ar_margin, spec_gap, ar_gap)
