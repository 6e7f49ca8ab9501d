"""Coupled verification (Daliri, Musco and Suresh 2024, "Coupling without Communication and
Drafter-Invariant Speculative Decoding").

Every token is drawn by Gumbel-max with public noise: the target's token at absolute position t is
x_t = argmax_v(log p_t(v) + G_{t,v}), where G_{t,.} depends on (seed, t) alone
(:func:`specdec.sampling.gumbel_max`). A draft token y_t drawn with the same noise from q_t
(argmax_v(log q_t(v) + G_{t,v})) is kept while it equals x_t; the first mismatch appends x_t. The
output is then exactly the sequence plain decoding draws with the same noise -- whatever the
drafter, the draft length, the tree or the policy -- and so follows the target's law.

For one position, X = argmax(log p + G) and Y = argmax(log q + G) are an exponential race
(X = argmin E_v / p_v, Y = argmin E_v / q_v with E_v = exp(-G_v) standard exponentials), whose
joint law has a closed form on the diagonal,

    P(X = Y = v) = p_v q_v / sum_u max(p_u q_v, q_u p_v),

and an integral off it (:func:`coupling_joint`). The acceptance probability sum_v P(X = Y = v) is
at least (1 - TV) / (1 + TV) (TV the total variation distance of p and q), below the
1 - TV of rejection sampling when q is spread out, equal to it for a point-mass draft
(greedy drafts, n-gram lookup).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from specdec.sampling import SamplingConfig, gumbel_token
from specdec.verify.base import Verdict, Verifier, VerifyPlan

if TYPE_CHECKING:
    from specdec.drafters.base import Draft


class CoupledVerifier(Verifier):
    """Keep draft tokens while they equal the target's Gumbel-max token at their position."""

    name = "coupled"
    exact = True

    def verdict(
        self,
        draft: "Draft",
        logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        position: int | None = None,
    ) -> Verdict:
        """logits: [k + 1, V] after the context and after each draft token; ``position``: the
        context's length (the absolute position of the first draft token). A chain is the tree
        whose node i's parent is i - 1: :func:`coupled_walk`. No draft, and greedy decoding, take
        the shortcuts every rule shares (:meth:`Verifier.verdict`)."""
        k = len(draft)
        if k == 0 or sampling.greedy:
            return super().verdict(draft, logits, sampling, generator, position)
        if not sampling.coupled:
            raise ValueError("coupled verification checks the Gumbel-max sampler's draws; sample with a gumbel_seed")
        return coupled_walk(draft.tokens.tolist(), [[i] for i in range(k)] + [[]], logits, sampling, position)

    def plan(self, draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> VerifyPlan:
        """The law of the outcome given draft tokens that were drawn by Gumbel-max from q with the
        noise the target's tokens use (draft_tokens: [k]; q: [k, V]; p: [k + 1, V]). Given the
        draft, the noise of different positions stays independent, so position i is kept with
        probability P(X = Y = y_i) / q_i(y_i), and on a mismatch the appended token has law
        P(X = . , Y = y_i) off the diagonal. O(V^3) per position: for toy vocabularies (the
        exactness tests); decoding uses :meth:`verdict`."""
        k = int(draft_tokens.shape[0])
        vocab = p.shape[-1]
        keep, rows = [], torch.zeros(k + 1, vocab, dtype=torch.float64)
        for i, y in enumerate(draft_tokens.tolist()):
            pi, qi = p[i].double().numpy(), q[i].double().numpy()
            # P(X = y | Y = y) = 1 / sum_u max(p_u q_y / p_y, q_u) for q normalised: written so that
            # a point-mass p on y keeps y with probability exactly 1.
            keep.append(min(1.0, float(qi.sum() / np.maximum(pi * (qi[y] / pi[y]), qi).sum())) if pi[y] > 0 else 0.0)
            column = coupling_joint(pi / pi.sum(), qi / qi.sum())[:, y]  # P(X = ., Y = y)
            column[y] = 0.0
            rows[i] = torch.from_numpy(column) if column.sum() > 0 else p[i].double()
        rows[k] = p[k].double()
        survive = np.concatenate([[1.0], np.cumprod(keep)])  # [k + 1]
        stop = np.concatenate([1.0 - np.asarray(keep, dtype=np.float64), [1.0]])  # [k + 1]
        return VerifyPlan(torch.from_numpy(survive * stop), rows)


def coupled_walk(tokens: Sequence[int], kids: Sequence[Sequence[int]], logits: torch.Tensor,
                 sampling: SamplingConfig, position: int | None) -> Verdict:
    """The coupled rule on a chain or a tree of draft ``tokens``: from the root, take the target's
    Gumbel-max token at the node's position (``position``, the context's length, plus the node's
    depth) and move to the child that drafted it, until no child did; that token is appended.
    ``kids[0]`` lists the root's children, ``kids[1 + i]`` node i's; logits: [1 + N, V], row 0
    the root's, row 1 + i node i's. Returns Verdict(1 + the last node kept, or 0, the token)."""
    if position is None:
        raise ValueError("coupled verification needs the draft's position")
    row = depth = 0
    while True:
        token = gumbel_token(logits[row], sampling, position + depth)
        child = next((c for c in kids[row] if tokens[c] == token), None)
        if child is None:
            return Verdict(row, token)
        row, depth = 1 + child, depth + 1


def acceptance(p: np.ndarray, q: np.ndarray) -> float:
    """P(X = Y) for the Gumbel-max coupling of p and q ([V] float64 each): the closed form summed
    over v, in O(V log V) (:func:`agreement`)."""
    return float(agreement(p, q).sum())


def agreement(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """P(X = Y = v) = p_v q_v / sum_u max(p_u q_v, q_u p_v) for every v ([V] float64). With the
    tokens ordered by r_u = p_u / q_u, max(p_u q_v, q_u p_v) is p_u q_v where r_u >= r_v and
    q_u p_v below, so the sum is q_v * (p's mass from v's rank up) + p_v * (q's mass below it):
    two cumulative sums, not V sums over V."""
    ratio = np.divide(p, q, out=np.full_like(p, np.inf), where=q > 0)
    order = np.argsort(ratio, kind="stable")
    p_up = np.cumsum(p[order][::-1])[::-1]  # p's mass at ranks >= i
    q_below = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])  # q's mass at ranks < i
    total = np.empty_like(p)
    total[order] = q[order] * p_up + p[order] * q_below
    both = (p > 0) & (q > 0)
    return np.divide(p * q, total, out=np.zeros_like(p), where=both)


def coupling_joint(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """J[a, b] = P(X = a, Y = b) for X = argmax(log p + G), Y = argmax(log q + G) with one
    shared Gumbel vector G; p, q: [V] float64 distributions. [V, V] float64.

    The diagonal is the closed form (module docstring). Off it, with E_a = x and E_b = r x,
    X = a and Y = b ask r > p_b / p_a and r < q_b / q_a, and every other token u must lose both
    races: E_u > x max(p_u / p_a, r q_u / q_b). Integrating x out leaves
    J[a, b] = integral dr / L(r)^2 over that interval, L(r) = 1 + r + sum_u max(p_u / p_a, r q_u / q_b):
    piecewise linear in r, integrated exactly piece by piece."""
    joint = np.diag(agreement(p, q))
    for a in np.flatnonzero(p > 0):
        for b in np.flatnonzero(q > 0):
            if a != b:
                joint[a, b] = _off_diagonal(p, q, int(a), int(b))
    return joint


def _off_diagonal(p: np.ndarray, q: np.ndarray, a: int, b: int) -> float:
    lo = p[b] / p[a]
    hi = q[b] / q[a] if q[a] > 0 else np.inf
    if not lo < hi:
        return 0.0
    others = [u for u in range(p.shape[0]) if u not in (a, b)]
    slope_of = {u: q[u] / q[b] for u in others}  # the term's slope once the q race binds
    level_of = {u: p[u] / p[a] for u in others}  # its value while the p race binds
    cuts = sorted({level_of[u] / slope_of[u] for u in others if slope_of[u] > 0 and level_of[u] > 0} | {lo})
    edges = [r for r in cuts if lo <= r < hi] + [hi]
    total = 0.0
    for r0, r1 in zip(edges, edges[1:]):
        mid = r0 + 1.0 if np.isinf(r1) else (r0 + r1) / 2
        alpha, beta = 1.0, 1.0  # L(r) = alpha + beta r on this piece
        for u in others:
            if level_of[u] >= mid * slope_of[u]:
                alpha += level_of[u]
            else:
                beta += slope_of[u]
        upper = 0.0 if np.isinf(r1) else 1.0 / (alpha + beta * r1)
        total += (1.0 / (alpha + beta * r0) - upper) / beta
    return total
