"""What one decoding step did, and the totals a run reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.constraints import TokenLogprob


@dataclass(frozen=True)
class Step:
    """One target forward pass and its outcome.

    tokens: the ids appended to the output this step (the first ``accepted`` came from the draft,
    the rest from the target), already cut at EOS and at the token limit.
    logprobs: one per token where log-probabilities were asked for (:mod:`specdec.constraints`).
    forced: how many of the accepted draft tokens were tokens a grammar forced.
    source: the drafter's source the step's own draft tokens came from (``ngram``, ``model``,
    ``prediction``, ...; None where it drafted none), and ``proposed`` how many it drafted (the
    forced tokens before them not counted).
    """

    tokens: list[int]
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float
    logprobs: "list[TokenLogprob] | None" = None
    forced: int = 0
    source: str | None = None
    proposed: int = 0

    @property
    def from_draft(self) -> list[bool]:
        """For each appended token, whether it was a draft token the target accepted."""
        return [i < self.accepted for i in range(len(self.tokens))]


@dataclass
class GenerationStats:
    """Totals over a run. ``acceptance_rate`` = accepted draft tokens / drafted tokens."""

    new_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    seconds: float = 0.0
    # accepted_at[i] / drafted_at[i]: how often draft position i was accepted when it was drafted.
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    policy: dict[str, Any] = field(default_factory=dict)
    # Set where the model's context left room for fewer new tokens than max_new_tokens: that room.
    truncated_to: int | None = None
    prompt_cached: int = 0  # prompt tokens found in the target's cache (DecodeConfig.prompt_cache), not prefilled
    # The Gumbel-max sampler's seed (drawn where none was given): seed=this draws the same text again.
    gumbel_seed: int | None = None
    forced_tokens: int = 0  # generated tokens a grammar forced (drafted at no model cost, accepted)
    # The drafter's own tokens by the source that drafted them (forced tokens not counted): how many
    # were drafted, and how many of those the output kept.
    drafted_by: dict[str, int] = field(default_factory=dict)
    accepted_by: dict[str, int] = field(default_factory=dict)

    def add(self, step: Step) -> None:
        self.new_tokens += len(step.tokens)
        self.forced_tokens += step.forced
        self.target_forwards += 1
        self.drafted_tokens += step.drafted
        self.accepted_tokens += step.accepted
        self.draft_seconds += step.draft_seconds
        self.verify_seconds += step.verify_seconds
        grow = step.drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(step.drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < step.accepted
        if step.source is not None and step.proposed:
            self.drafted_by[step.source] = self.drafted_by.get(step.source, 0) + step.proposed
            kept = min(step.proposed, max(0, step.accepted - step.forced))
            self.accepted_by[step.source] = self.accepted_by.get(step.source, 0) + kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_per_forward(self) -> float:
        """Tokens produced per target forward pass (1 for autoregressive decoding)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_per_forward=self.mean_accepted_per_forward,
            tokens_per_second=self.tokens_per_second,
            acceptance_by_position=self.acceptance_by_position,
        )
        return out
