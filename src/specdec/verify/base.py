"""What every verifier returns, and how its outcome is drawn.

A verifier looks at one draft block and returns a :class:`VerifyPlan`: the *exact* conditional
distribution of its random outcome given the draft. The outcome is a pair (n, y): keep the first n
draft tokens (*accepted*) and append one more token y, drawn from ``next_token_probs[n]``. When
n < k, y is the *recovered* token (drawn from a residual distribution); when n = k, y is the *bonus*
token (drawn from the target's distribution after the whole draft).

Keeping the distribution explicit is what lets the tests enumerate it exactly, and lets every rule
share one sampler (:func:`draw`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specdec.sampling import SamplingConfig, argmax, logits_to_probs, next_token, sample

if TYPE_CHECKING:
    from specdec.drafters.base import Draft


@dataclass(frozen=True)
class VerifyPlan:
    """The distribution of a verifier's outcome given one draft block of length k.

    accept_len_probs: [k + 1] float64, P(n = i) for i = 0..k; sums to 1.
    next_token_probs: [k + 1, V] float32; row i is the law of the appended token when n = i
        (rows may be unnormalised; a row whose n has probability 0 is never read).
    """

    accept_len_probs: torch.Tensor
    next_token_probs: torch.Tensor


@dataclass(frozen=True)
class Verdict:
    """A drawn outcome: keep ``accepted`` draft tokens, then append ``next_token``."""

    accepted: int
    next_token: int


class Verifier(Protocol):
    """A verification rule.

    ``exact`` is False only for lossy rules that a user asks for by name; reports must mark them.
    A class that subclasses this protocol inherits :meth:`verdict` for chain drafts.
    """

    name: str
    exact: bool

    def plan(self, draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> VerifyPlan:
        """draft_tokens: [k] int64; q: [k, V] draft probs; p: [k + 1, V] target probs."""
        ...

    def verdict(
        self,
        draft: "Draft",
        logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        position: int | None = None,
    ) -> Verdict:
        """The drawn outcome for one draft, from the target's logits after the context and after
        each draft token ([k + 1, V]); ``position`` is the context's length, the absolute position
        of the first draft token (the Gumbel-max sampler keys its noise by it). The plan's law,
        drawn by :func:`draw`. Two shortcuts with the same law: no draft is a plain step (every
        rule's law is then the target's next-token law), and an exact rule under greedy decoding
        keeps the argmax chain (:func:`greedy_verdict`)."""
        tokens = draft.tokens.tolist()
        if not tokens:
            return Verdict(0, next_token(logits[-1], sampling, generator, position))
        if sampling.greedy and self.exact:
            return greedy_verdict(tokens, logits)
        p = logits_to_probs(logits, sampling)  # [k + 1, V]
        return draw(self.plan(draft.tokens, draft.q, p), generator)


def greedy_verdict(draft_tokens: list[int], logits: torch.Tensor) -> Verdict:
    """The outcome of every exact rule under greedy decoding, from the target's raw logits.

    draft_tokens: k ids; logits: [k + 1, V]. Greedy makes the target's law a point mass on its
    argmax chain, and each exact rule (greedy, token, block) then keeps exactly the draft tokens
    that equal the argmax, in order, and appends the argmax after them -- with probability 1, as
    ``tests/verify/test_verify_exact.py`` checks against each rule's plan. One argmax per row is all it takes:
    no [k + 1, V] probabilities, residuals or draws (several milliseconds at a 150k vocabulary).
    Ties go to the lowest id, as in :func:`~specdec.sampling.logits_to_probs`.
    """
    choice = argmax(logits).tolist()  # [k + 1]
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == choice[accepted]:
        accepted += 1
    return Verdict(accepted, choice[accepted])


def draw(plan: VerifyPlan, generator: torch.Generator | None) -> Verdict:
    """Draw (n, y) from ``plan``: first the number accepted, then the appended token."""
    accepted = sample(plan.accept_len_probs, generator)
    return Verdict(accepted, sample(plan.next_token_probs[accepted], generator))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), row-wise, falling back to p on rows with no residual mass.

    p, q: [..., V]. A row with no mass left is only reached with probability 0 in exact arithmetic;
    the fallback keeps rounding from producing an all-zero row that cannot be sampled.
    """
    res = (p - q).clamp_min_(0.0)
    empty = res.sum(dim=-1, keepdim=True) <= 0.0
    return torch.where(empty, p, res)
