"""Running estimates of how often draft tokens are accepted: overall, per draft position, and per
level of the draft's confidence (what the ``theory`` and ``auto`` policies plan from)."""

from __future__ import annotations

from specdec.stats import Step


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
