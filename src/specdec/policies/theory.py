"""The ``theory`` draft-length policy: keep running estimates of the acceptance rate alpha, of the
cost ratio c and of the acceptance chance at each level of draft confidence, and draft while one
more token is expected to pay for itself: the token-by-token form of maximising the speed-up
(1 - alpha^(k+1)) / ((1 - alpha)(kc + 1)) of Leviathan et al. 2023 (:func:`specdec.theory.optimal_k`
when every token has the same alpha).
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DEFAULT_K_MAX
from specdec.policies.base import DraftLengthPolicy, check_k
from specdec.policies.estimates import AcceptanceEstimates
from specdec.stats import Step
from specdec.theory import optimal_k


class TheoryK(DraftLengthPolicy):
    """Draft the length that maximises expected tokens per unit of time, from running estimates.

    Leviathan et al. (2023)'s speed-up (1 - alpha^(k+1)) / ((1 - alpha)(kc + 1)) is E[tokens per
    step] over the step's cost when every draft token is accepted with the same chance alpha. Here the chance of
    the i-th draft token, a_i, is read from the draft's own confidence (its top probability, mapped
    to an acceptance chance by a running calibration table), so E[tokens] = 1 + sum_i prod_{j<=i}
    a_j and the length is chosen token by token: after drafting token i (the chance that the whole
    draft so far is accepted is P_i = prod_{j<=i} a_j), draft another iff its expected gain
    P_i * a_{i+1} is at least its cost c times the rate R the policy achieves (tokens per
    no-draft target step, measured), with a_{i+1} taken to be a_i (confidence comes in stretches:
    the next token is expected to be as predictable as this one). That is the optimal-stopping
    rule for maximising tokens / time (continue while the marginal rate beats the average); with
    a_i = alpha it drafts :func:`~specdec.theory.optimal_k` (up to the marginal test's rounding).

    alpha: each step tests ``accepted`` positions that passed and, if the draft was cut short, one
    that failed (positions after it were never tested), so alpha = sum accepted /
    sum (accepted + [rejected]). c: the cost of one more drafted token relative to a target step
    with no draft, ``c = c_draft + c_verify``, where c_draft = draft seconds per drafted token and
    c_verify = extra verify seconds per drafted token (a weighted least-squares line of verify
    seconds against the number drafted; the slope is near 0 where verification costs the same for
    any k). Both divide by the line's intercept. All sums decay by ``decay`` per step, so the
    estimates follow a drifting workload; the priors count as ``prior_weight`` observations
    (alpha's prior is ``prior_alpha``; a calibration bin's prior is its own confidence).

    ``next_k`` is the cap: the longest draft the rule would allow if every token were as likely
    to be accepted as the most confident calibration bin with data says (alpha before any data),
    and never more than ``k_max``. R is floored at 1, the rate of not drafting at all.
    """

    name = "theory"

    def __init__(
        self,
        k: int,
        k_max: int = DEFAULT_K_MAX,
        *,
        decay: float = 0.95,
        prior_alpha: float = 0.6,
        prior_weight: float = 2.0,
    ) -> None:
        check_k(k)
        check_k(k_max)
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.k_max = max(k, k_max)
        self.k = k
        self.decay = decay
        self.acceptance = AcceptanceEstimates(
            decay=decay, prior_alpha=prior_alpha, prior_weight=prior_weight, positions=self.k_max
        )
        self._draft_seconds = 0.0
        self._drafted = 0.0
        # Decayed sums for verify_seconds ~ v0 + v1 * drafted: weight, x, y, xx, xy.
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._tokens = 0.0  # decayed sum of tokens produced
        self._seconds = 0.0  # decayed sum of step seconds (draft + verify)
        self._steps = 0
        self._reach = 1.0  # P_i: chance the current step's draft so far is all accepted

    def next_k(self) -> int:
        self.acceptance.start_step()  # a new step starts
        self._reach = 1.0
        return self.k

    def keep_going(self, q: torch.Tensor) -> bool:
        chance = self.acceptance.see(float(q.max()))
        self._reach *= chance
        # The next token is expected to be as predictable as this one (confidence runs in stretches).
        return self._reach * chance >= self.c * self.rate

    def update(self, step: Step) -> None:
        d = self.decay
        self._steps += 1
        self.acceptance.record(step)
        if step.drafted > 0:
            self._draft_seconds = d * self._draft_seconds + step.draft_seconds
            self._drafted = d * self._drafted + step.drafted
        self._reach = 1.0
        x, y = float(step.drafted), step.verify_seconds
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y
        self._tokens = d * self._tokens + len(step.tokens)
        self._seconds = d * self._seconds + step.draft_seconds + step.verify_seconds
        self.k = self._cap()

    def accept_chance(self, confidence: float) -> float:
        """Calibrated chance that a draft token whose draft top probability is ``confidence`` is accepted."""
        return self.acceptance.accept_chance(confidence)

    def _cap(self) -> int:
        top = self.acceptance.top_chance()
        cost = self.c * self.rate
        k, reach = 1, top
        while k < self.k_max and reach * top >= cost:
            k, reach = k + 1, reach * top
        return k

    @property
    def alpha(self) -> float:
        """Estimated chance that a draft token is accepted given the ones before it were."""
        return self.acceptance.alpha

    @property
    def rate(self) -> float:
        """Tokens per no-draft target step that the policy achieves, at least 1 (what not drafting gives)."""
        v0, _ = self.verify_line()
        if self._seconds <= 0 or v0 <= 0:
            return 1.0
        return max(1.0, self._tokens / (self._seconds / v0))

    def verify_line(self) -> tuple[float, float]:
        """(v0, v1): verify seconds ~ v0 + v1 * drafted, v1 >= 0; (0, 0) before any step."""
        if self._w == 0:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        sxx = self._xx / self._w - mx * mx
        slope = (self._xy / self._w - mx * my) / sxx if sxx > 0.25 else 0.0  # needs some spread in k
        slope = max(0.0, slope)
        # A noisy fit can put the intercept near 0 and blow up c: a step without a draft costs at
        # least half of an average step.
        return max(my - slope * mx, 0.5 * my, 1e-9), slope

    @property
    def c_draft(self) -> float:
        v0, _ = self.verify_line()
        if self._drafted == 0 or v0 <= 0:
            return 0.0
        return self._draft_seconds / self._drafted / v0

    @property
    def c_verify(self) -> float:
        v0, v1 = self.verify_line()
        return v1 / v0 if v0 > 0 else 0.0

    @property
    def c(self) -> float:
        """Estimated cost of one drafted token relative to a target step with no draft."""
        return self.c_draft + self.c_verify

    def describe(self) -> dict:
        return {
            "name": self.name,
            "k": self.k,
            "k_max": self.k_max,
            "alpha": self.alpha,
            "c": self.c,
            "c_draft": self.c_draft,
            "c_verify": self.c_verify,
            "rate": self.rate,
            "k_iid": optimal_k(self.alpha, self.c, self.k_max),
            "calibration": self.acceptance.calibration(),
            "steps": self._steps,
        }
