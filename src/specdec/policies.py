"""Draft-length policies: how many tokens to draft next."""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.stats import Step


class DraftLengthPolicy(Protocol):
    name: str

    def next_k(self) -> int:
        """How many tokens to draft in the next step (>= 0)."""
        ...

    def keep_going(self, q: torch.Tensor) -> bool:
        """Given the draft distribution just sampled from ([V]), whether to draft another token."""
        ...

    def update(self, step: Step) -> None:
        """Learn from the step just taken."""
        ...

    def describe(self) -> dict:
        """The policy's current state, for the statistics."""
        ...


class StaticK:
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


def check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"k (tokens drafted per step) must be a positive integer, got {k!r}")


def make_policy(name: str, k: int) -> DraftLengthPolicy:
    """Build a policy by name; ``k`` is the static length or the starting/maximum length."""
    policies = {"static": StaticK}
    try:
        return policies[name](k)
    except KeyError:
        raise ValueError(
            f"unknown draft-length policy {name!r}; choose one of {', '.join(sorted(policies))}"
        ) from None
