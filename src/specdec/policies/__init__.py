"""Draft-length policies: how many tokens to draft each step.

The protocol they share is in :mod:`specdec.policies.base`; the policies themselves are in
:mod:`specdec.policies.rules` (``static``, ``heuristic``, ``confidence``),
:mod:`specdec.policies.theory` (``theory``) and :mod:`specdec.policies.auto` (``auto``, the default:
the planner, which drafts the length with the most expected tokens per second from this machine's
measured costs); the last two learn from :mod:`specdec.policies.estimates`. :func:`make_policy`
builds one by name.
"""

from __future__ import annotations

from specdec.policies.auto import AutoPolicy
from specdec.drafters.base import DEFAULT_K_MAX, DEFAULT_THRESHOLD
from specdec.policies.base import DraftLengthPolicy, Plan, check_k
from specdec.policies.estimates import AcceptanceEstimates
from specdec.policies.rules import ConfidenceStop, HeuristicK, StaticK
from specdec.policies.theory import TheoryK

__all__ = [
    "DEFAULT_K_MAX", "DEFAULT_THRESHOLD", "POLICIES", "AcceptanceEstimates", "AutoPolicy", "ConfidenceStop",
    "DraftLengthPolicy", "HeuristicK", "Plan", "StaticK", "TheoryK", "check_k", "make_policy",
]

POLICIES = ("static", "heuristic", "confidence", "theory", "auto")  # auto: specdec.policies.auto.AutoPolicy


def make_policy(
    name: str, k: int, *, k_max: int | None = None, threshold: float | None = None
) -> DraftLengthPolicy:
    """Build a policy by name.

    k: the static length (``static``) or the starting length (``heuristic``, ``theory``; ``auto``
    plans every step's length itself, 0 included, from measured costs: :mod:`specdec.policies.auto`).
    k_max: the longest draft an adaptive policy may ask for (default max(k, 16)); for
    ``confidence`` it is the length drafted when the draft stays confident. threshold: the
    ``confidence`` policy's stopping threshold on the draft's top probability (default 0.8).
    """
    check_k(k)
    if k_max is None:
        k_max = max(k, DEFAULT_K_MAX)
    check_k(k_max)
    if name == "static":
        return StaticK(k)
    if name == "heuristic":
        return HeuristicK(k, k_max)
    if name == "confidence":
        return ConfidenceStop(k_max, DEFAULT_THRESHOLD if threshold is None else threshold)
    if name == "theory":
        return TheoryK(k, k_max)
    if name == "auto":
        return AutoPolicy(k_max)
    raise ValueError(f"unknown draft-length policy {name!r}; choose one of {', '.join(POLICIES)}")
