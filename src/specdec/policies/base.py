"""Draft-length policies: how many tokens to draft next (termination conditions for drafting).

- ``static``: always k.
- ``heuristic``: grow k by 2 after a fully accepted draft, shrink it by 1 after a rejection
  (the schedule transformers calls "heuristic").
- ``confidence``: draft up to k_max but stop as soon as the draft's top probability falls below a
  threshold (adaptive thresholding on per-token confidence).
- ``theory``: keep running estimates of the acceptance rate alpha, of the cost ratio c and of
  the acceptance chance at each level of draft confidence, and draft while one more token is
  expected to pay for itself: the token-by-token form of maximising the speed-up
  (1 - alpha^(k+1)) / ((1 - alpha)(kc + 1)) of Leviathan et al. 2023 (:func:`specdec.theory.optimal_k`
  when every token has the same alpha).

Each step the engine makes one call, :meth:`DraftLengthPolicy.plan`: given the sources the
drafter can draft from now, the policy returns a :class:`Plan` (which source, at most how many
tokens, and a ``keep_going`` test that may stop the draft sooner). A policy sees each
:class:`~specdec.stats.Step` after it is taken; ``describe`` reports its state (for ``theory``
its estimates), which the API copies into ``GenerationStats.policy``. The default policy,
``auto``, is the planner in :mod:`specdec.policies.auto`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from specdec.drafters.base import KeepGoing
from specdec.stats import Step
from specdec.theory import optimal_k

MAX_INT = 2**31 - 1  # the largest count an option takes (draft lengths, tree sizes); beyond it, an error
DEFAULT_K_MAX = 16  # the longest draft an adaptive policy tries unless told otherwise
# The confidence policy's default: stop after a token the draft gives less than 0.8. (transformers
# uses 0.4; with a 0.5B draft at c ~ 0.5 target steps per token that drafted 7 tokens a step at 52%
# acceptance on our probe prompts, slower than ar.)
DEFAULT_THRESHOLD = 0.8


@dataclass(frozen=True)
class Plan:
    """One step's drafting: at most ``k`` tokens (0: a plain target step) from ``source`` (one of
    the drafter's :meth:`~specdec.drafters.base.Drafter.sources`); ``keep_going`` is asked after
    each drafted token but the last and may stop the draft there (None: draft all k)."""

    source: str
    k: int
    keep_going: KeepGoing | None = None


@runtime_checkable
class DraftLengthPolicy(Protocol):
    """How much to draft, and from which source. A class that subclasses this protocol inherits
    :meth:`plan` (the first source offered, :meth:`next_k` tokens, its own :meth:`keep_going`) and
    a :meth:`bind` that needs nothing."""

    name: str

    def plan(self, sources: Mapping[str, float | None], behind: Mapping[str, int] | None = None,
             room: int | None = None) -> Plan:
        """The engine's one call each step. sources: what the drafter can draft from now, in its
        order of preference, each with its draft's confidence where that is known before drafting.
        behind: the tokens a source must catch up on before it drafts
        (:meth:`~specdec.drafters.base.Drafter.behind`). room: the tokens the output may still
        grow by after this step's target token (None: unknown). Only the planner reads the last two."""
        return Plan(next(iter(sources)), self.next_k(), self.keep_going)

    def bind(self, target: Any, drafter: Any) -> None:
        """Learn what the target and the drafter cost before the first step (the planner measures
        them: :meth:`specdec.policies.auto.AutoPolicy.bind`); other policies need nothing."""

    def next_k(self) -> int:
        """How many tokens to draft in the next step (>= 0)."""
        ...

    def keep_going(self, q: torch.Tensor) -> bool:
        """Given the draft's confidence at the token just drafted ([V]), whether to draft another.

        Every drafter passes the same thing (:func:`specdec.drafters.base.confidence`): the draft
        model's own probabilities, the softmax of its logits at temperature 1 before top-k/top-p,
        whatever the sampling settings (for the n-gram lookup, whose q is a point mass, the
        strength of its match, :func:`~specdec.drafters.ngram.lookup_confidence`). Not the
        sampling law q, which is one-hot under greedy decoding and reshaped by the filters.
        Asked after every draft token but the last of the k asked for.
        """
        ...

    def update(self, step: Step) -> None:
        """Learn from the step just taken."""
        ...

    def describe(self) -> dict:
        """The policy's current state, for the statistics."""
        ...


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


class AcceptanceEstimates:
    """Running estimates of how often draft tokens are accepted (shared by ``theory`` and ``auto``).

    alpha: each step tests ``accepted`` positions that passed and, if the draft was cut short, one
    that failed (positions after it were never tested), so alpha = sum accepted / sum (accepted +
    [rejected]). Per position i (0-based): the same ratio over the steps that tested position i,
    i.e. the chance that draft token i is accepted given that tokens 0..i-1 were. Calibration: per
    bin of the draft's top probability (``see`` records it while drafting), accepted / tested.
    alpha and the positions decay by ``decay`` per drafting step (the estimates follow a drifting
    workload); the calibration table does not. Priors count as ``prior_weight`` observations
    (``prior_alpha`` for alpha and the positions, a bin's own confidence for the bin).

    A draft whose confidence is foreseen (a lookup copying a match) is not one trial per token:
    its tokens stand or fall together, and where a copied passage ends the first token fails
    however long the match was. Its first token is calibrated in a table of its own
    (:meth:`lead_chance`), the tokens after it in the shared one (:meth:`accept_chance`: the
    chance of a token given the ones before it were accepted), so a 16-token copy accepted in
    full does not outweigh fifteen first tokens rejected.
    """

    BINS = 10  # calibration bins of the draft's top probability, equal width on [0, 1]

    def __init__(self, *, decay: float, prior_alpha: float, prior_weight: float, positions: int) -> None:
        self.decay = decay
        self._prior_weight = prior_weight
        self._accepted = prior_alpha * prior_weight  # decayed sum of accepted positions
        self._tested = prior_weight  # decayed sum of tested positions
        self._prior_alpha = prior_alpha
        self._pos_accepted = [0.0] * positions  # the same, per draft position, without the prior
        self._pos_tested = [0.0] * positions
        centres = [(b + 0.5) / self.BINS for b in range(self.BINS)]
        self._bin_accepted = [prior_weight * m for m in centres]  # not decayed
        self._bin_tested = [prior_weight] * self.BINS
        self._lead_accepted = list(self._bin_accepted)  # the same for a foreseen draft's first token
        self._lead_tested = list(self._bin_tested)
        self._confidences: list[float] = []  # top draft probabilities seen in the current step

    def start_step(self) -> None:
        """A new step starts: forget the confidences seen while drafting the last one."""
        self._confidences = []

    def see(self, confidence: float) -> float:
        """Record the top draft probability of the token just drafted; return its calibrated chance."""
        self._confidences.append(confidence)
        return self.accept_chance(confidence)

    def record(self, step: Step, foreseen: float | None = None) -> None:
        """Learn from a step's outcome and the confidences seen while drafting it, or, where every
        token's confidence was known before drafting (a lookup's match), ``foreseen`` for each."""
        if foreseen is not None:
            self._confidences = [foreseen] * step.drafted
        d = self.decay
        if step.drafted > 0:
            rejected = 1.0 if step.accepted < step.drafted else 0.0
            self._accepted = d * self._accepted + step.accepted
            self._tested = d * self._tested + step.accepted + rejected
            for i in range(len(self._pos_tested)):
                tested = i < step.drafted and i <= step.accepted
                self._pos_tested[i] = d * self._pos_tested[i] + tested
                self._pos_accepted[i] = d * self._pos_accepted[i] + (i < step.accepted)
        for i, confidence in enumerate(self._confidences[: step.accepted + 1]):
            if i < step.drafted:
                b = self._bin(confidence)
                tested, accepted = ((self._lead_tested, self._lead_accepted) if foreseen is not None and i == 0
                                    else (self._bin_tested, self._bin_accepted))
                tested[b] += 1.0
                accepted[b] += float(i < step.accepted)
        self._confidences = []

    def _bin(self, confidence: float) -> int:
        return min(self.BINS - 1, max(0, int(confidence * self.BINS)))

    def accept_chance(self, confidence: float) -> float:
        """Calibrated chance that a draft token whose draft top probability is ``confidence`` is accepted."""
        b = self._bin(confidence)
        return self._bin_accepted[b] / self._bin_tested[b]

    def lead_chance(self, confidence: float) -> float:
        """Calibrated chance that the first token of a draft whose confidence was foreseen is accepted."""
        b = self._bin(confidence)
        return self._lead_accepted[b] / self._lead_tested[b]

    @property
    def alpha(self) -> float:
        """Estimated chance that a draft token is accepted given the ones before it were."""
        return min(self._accepted / self._tested, 0.999) if self._tested > 0 else 0.0

    def position_alphas(self, n: int) -> list[float]:
        """Estimated chance that draft token i (0-based) is accepted given tokens 0..i-1 were, for
        i < n (positions past the table share the last one's estimate).

        Each position's counts are shrunk towards the estimate of the position before it (the
        first towards ``prior_alpha``) with ``prior_weight`` observations' worth, so a position
        never tested reads like the one before it: a draft that only ever tested its first token
        (short probes) is not held at the prior further on."""
        out, prior, w = [], self._prior_alpha, self._prior_weight
        for i in range(n):
            j = min(i, len(self._pos_tested) - 1)
            if i == j and self._pos_tested[j] + w > 0:
                prior = (self._pos_accepted[j] + w * prior) / (self._pos_tested[j] + w)
            out.append(min(prior, 0.999))
        return out

    def tested(self, i: int) -> float:
        """How many times draft position i has been tested (decayed), without the prior."""
        return self._pos_tested[min(i, len(self._pos_tested) - 1)]

    def top_chance(self) -> float:
        """The chance of the most confident calibration bin with data (alpha before any), below 1."""
        seen = [b for b in range(self.BINS) if self._bin_tested[b] >= self._prior_weight + 1.0]
        top = max((self._bin_accepted[b] / self._bin_tested[b] for b in seen), default=self.alpha)
        return min(top, 0.999)

    def calibration(self) -> list[float]:
        """Each bin's acceptance chance, rounded, for reports."""
        return [round(self._bin_accepted[b] / self._bin_tested[b], 3) for b in range(self.BINS)]

    def lead_calibration(self) -> list[float]:
        """Each bin's chance for the first token of a draft whose confidence was foreseen, rounded."""
        return [round(self._lead_accepted[b] / self._lead_tested[b], 3) for b in range(self.BINS)]


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


def check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= MAX_INT:
        raise ValueError(f"k (tokens drafted per step) must be a positive integer up to {MAX_INT}, got {k!r}")
