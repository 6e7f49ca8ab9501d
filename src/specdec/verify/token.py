"""Token verification (Leviathan et al. 2023; Chen et al. 2023).

Draft token i is accepted with probability min(1, p[i](x_i) / q[i](x_i)), independently, up to the
first rejection; the recovered token is drawn from norm(max(0, p[i] - q[i])); if all k are accepted
the bonus token is drawn from p[k]. For a point-mass draft this accepts x with probability p(x) and
otherwise draws from p with x removed.
"""

from __future__ import annotations

import torch

from specdec.verify.base import Verifier, VerifyPlan, residual


class TokenVerifier(Verifier):
    name = "token"
    exact = True

    def plan(self, draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> VerifyPlan:
        """draft_tokens: [k]; q: [k, V]; p: [k + 1, V]."""
        k = draft_tokens.shape[0]
        rows = torch.arange(k)
        p_x = p[rows, draft_tokens].double()  # [k]
        q_x = q[rows, draft_tokens].double()  # [k]
        accept = torch.where(q_x > 0, (p_x / q_x).clamp(max=1.0), torch.zeros_like(q_x))  # [k]
        # P(n = i) = accept[0] * ... * accept[i-1] * (1 - accept[i]);  P(n = k) = prod(accept).
        survive = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(accept, 0)])  # [k+1]
        stop = torch.cat([1.0 - accept, torch.ones(1, dtype=torch.float64)])  # [k + 1]
        next_token_probs = torch.cat([residual(p[:k], q), p[k:]])  # [k + 1, V]
        return VerifyPlan(survive * stop, next_token_probs)
