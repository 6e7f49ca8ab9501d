"""Verification rules.

Notation, used everywhere in this project:

- ``p``: the **target** model's probabilities, after temperature / top-k / top-p processing.
  ``p[i]`` is the distribution of the token after the context and the first i draft tokens;
  a block of k drafts comes with k + 1 rows of ``p`` (the last one gives the bonus token).
- ``q``: the **draft**'s probabilities, processed with the same settings; ``q[i]`` is the
  distribution draft token i was sampled from (k rows). A deterministic drafter (n-gram lookup)
  has a point mass for ``q[i]``.
- A draft token is *accepted* if the output keeps it; on the first position not kept a *recovered*
  token is drawn from a residual distribution; if all k are kept a *bonus* token is drawn from
  ``p[k]``.

Each rule lives in its own module and produces a :class:`~specdec.verify.base.VerifyPlan`, the
exact law of its outcome, from which :func:`~specdec.verify.base.draw` samples. The coupled rule
(:mod:`specdec.verify.coupled`) is the exception in how it decides: under the Gumbel-max sampler
its outcome is a function of the target's logits and the public noise, and its plan is that
outcome's law given the draft, for the tests.
"""

from specdec.verify.base import Verdict, Verifier, VerifyPlan, draw
from specdec.verify.block import BlockVerifier
from specdec.verify.coupled import CoupledVerifier
from specdec.verify.greedy import GreedyVerifier
from specdec.verify.token import TokenVerifier
from specdec.verify.typical import TypicalVerifier

VERIFIERS: dict[str, type] = {
    "greedy": GreedyVerifier,
    "token": TokenVerifier,
    "block": BlockVerifier,
    "coupled": CoupledVerifier,  # for the Gumbel-max sampler: the output is plain decoding's, token for token
    "typical": TypicalVerifier,  # lossy: only when asked for by name
}


def make_verifier(name: str) -> Verifier:
    """Build a verifier by name; lossy rules must be asked for by their own names."""
    try:
        return VERIFIERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown verifier {name!r}; choose one of {', '.join(sorted(VERIFIERS))}"
        ) from None


__all__ = ["VERIFIERS", "Verdict", "Verifier", "VerifyPlan", "draw", "make_verifier"]
