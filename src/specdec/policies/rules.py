"""Draft-length policies that follow a fixed rule, with no estimates of acceptance or cost.

- ``static``: always k.
- ``heuristic``: grow k by 2 after a fully accepted draft, shrink it by 1 after a rejection
  (the schedule transformers calls "heuristic").
- ``confidence``: draft up to k_max but stop as soon as the draft's top probability falls below a
  threshold (adaptive thresholding on per-token confidence).
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DEFAULT_K_MAX, DEFAULT_THRESHOLD
from specdec.policies.base import DraftLengthPolicy, check_k
from specdec.stats import Step


class StaticK(DraftLengthPolicy):
    """Always draft k tokens."""

    name = "static"

    def __init__(self, k: int) -> None:
        check_k(k)
        self.k = k

    def next_k(self) -> int:
        return self.k

    def keep_going(self, q: torch.Tensor) -> bool:
        return True

    def update(self, step: Step) -> None:
        pass

    def describe(self) -> dict:
        return {"name": self.name, "k": self.k}


class HeuristicK(DraftLengthPolicy):
    """Start at k; after a fully accepted draft draft ``grow`` more, after a rejection ``shrink`` fewer."""

    name = "heuristic"

    def __init__(self, k: int, k_max: int = DEFAULT_K_MAX, grow: int = 2, shrink: int = 1) -> None:
        check_k(k)
        check_k(k_max)
        self.k_max = max(k, k_max)
        self.k = k
        self.grow, self.shrink = grow, shrink

    def next_k(self) -> int:
        return self.k

    def keep_going(self, q: torch.Tensor) -> bool:
        return True

    def update(self, step: Step) -> None:
        if step.drafted == 0:
            return
        if step.accepted >= step.drafted:
            self.k = min(self.k_max, self.k + self.grow)
        else:
            self.k = max(1, self.k - self.shrink)

    def describe(self) -> dict:
        return {"name": self.name, "k": self.k, "k_max": self.k_max}


class ConfidenceStop(DraftLengthPolicy):
    """Draft up to ``k_max`` tokens; stop after a token whose top draft probability is below ``threshold``."""

    name = "confidence"

    def __init__(self, k_max: int = DEFAULT_K_MAX, threshold: float = DEFAULT_THRESHOLD) -> None:
        check_k(k_max)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"the confidence threshold must be in [0, 1], got {threshold}")
        self.k_max = k_max
        self.threshold = threshold
        self._drafted = 0
        self._steps = 0

    def next_k(self) -> int:
        return self.k_max

    def keep_going(self, q: torch.Tensor) -> bool:
        return float(q.max()) >= self.threshold

    def update(self, step: Step) -> None:
        self._drafted += step.drafted
        self._steps += 1

    def describe(self) -> dict:
        mean = self._drafted / self._steps if self._steps else 0.0
        return {
            "name": self.name,
            "k_max": self.k_max,
            "threshold": self.threshold,
            "mean_drafted": mean,
        }
