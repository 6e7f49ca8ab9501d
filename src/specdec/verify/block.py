"""Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding").

Decides on the whole draft block jointly and is optimal among valid verifiers (their Theorem 2).
With ``keep[0] = 1`` and ``keep[i] = min(1, keep[i-1] * p[i-1](x_i) / q[i-1](x_i))`` (the
probability that the first i drafts survive), position i < k has residual mass
``r[i] = sum_x max(0, keep[i] * p[i](x) - q[i](x))`` and position k has ``r[k] = keep[k]``.
Algorithm 2 accepts position i with probability ``h[i] = r[i] / (r[i] + 1 - keep[i])``
independently and keeps the *longest* accepted prefix, so
``P(n = i) = h[i] * prod_{j > i} (1 - h[j])``. The appended token is drawn from
``norm(max(0, keep[n] * p[n] - q[n]))`` (with q[k] = 0, i.e. p[k] for the bonus).
"""

from __future__ import annotations

import torch

from specdec.verify.base import Verifier, VerifyPlan


class BlockVerifier(Verifier):
    name = "block"
    exact = True

    def plan(self, draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> VerifyPlan:
        """draft_tokens: [k]; q: [k, V]; p: [k + 1, V]."""
        k = draft_tokens.shape[0]
        rows = torch.arange(k)
        p_x = p[rows, draft_tokens].double()  # [k]
        q_x = q[rows, draft_tokens].double()  # [k]
        ratio = torch.where(q_x > 0, p_x / q_x, torch.zeros_like(q_x)).tolist()
        keep = [1.0]
        for r in ratio:
            keep.append(min(1.0, keep[-1] * r))
        keep_t = torch.tensor(keep, dtype=torch.float64)  # [k + 1]
        # The [k, V] work runs in p's dtype, in place in the plan's own rows; the per-position masses
        # and h in float64. h stays in [0, 1] however the masses round (mass >= 0, keep <= 1).
        next_token_probs = torch.empty(k + 1, p.shape[-1], dtype=p.dtype)  # [k + 1, V]
        keep_col = keep_t[:k, None].to(p.dtype)  # [k, 1]
        res = torch.mul(p[:k], keep_col, out=next_token_probs[:k])  # [k, V]: keep p ...
        res.sub_(q.to(p.dtype)).clamp_min_(0.0)  # ... then max(0, keep p - q)
        res_mass = res.sum(-1)  # [k]
        empty = res_mass <= 0
        if bool(empty.any()):  # reached with probability 0; keep the row drawable (as residual())
            res[empty] = p[:k][empty] * keep_col[empty]
        next_token_probs[k] = p[k]  # the bonus token's law
        residual_mass = res_mass.double()  # [k]
        mass = torch.cat([residual_mass, keep_t[k:]])  # [k + 1]
        denom = mass + (1.0 - keep_t)
        h = torch.where(denom > 0, mass / denom, torch.zeros_like(mass)).clamp(0.0, 1.0)  # [k + 1]
        h[0] = 1.0  # keep[0] = 1: position 0 is accepted whenever no longer prefix is
        # P(n = i) = h[i] * prod_{j > i} (1 - h[j])
        none_after = torch.flip(torch.cumprod(torch.flip(1.0 - h, [0]), 0), [0])  # prod_{j >= i}
        none_after = torch.cat([none_after[1:], torch.ones(1, dtype=torch.float64)])
        return VerifyPlan(h * none_after, next_token_probs)
