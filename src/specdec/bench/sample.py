"""One timed run of one benchmark method on one prompt (what the runner and the peers return)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence


@dataclass
class Sample:
    """One timed run of one method on one prompt.

    step_drafted[i] / step_accepted[i]: draft tokens proposed / kept at target forward i (empty
    when unknown). drafted_total / accepted_total: the run's totals where only they are known
    (llama-server reports no per-step counts). draft_token_seconds: median time to draft one token (steps after the first);
    step_seconds: median time of one target step after the first (the prefill).
    first_step_seconds / first_step_tokens: wall time from the start to the end of the first
    target forward (the prompt's prefill in every model, and the first step's drafting) and the
    tokens that step produced; the rest of the run is the decoding that speculation speeds up.
    json_parsed / schema_valid: on a prompt with a JSON schema, whether the output parses as JSON
    and follows the schema (:mod:`specdec.bench.schema_check`); None without a schema.
    forced_tokens: the generated tokens a grammar forced (drafted at no model cost), where the
    method reports them (specdec's own methods and servers); None where unknown.
    reported_tokens: where ``token_ids`` are the streamed text tokenised again (llama-server's chat
    stream carries text only), how many tokens the server says it generated (its usage's
    ``completion_tokens``): what speed counts, as the text can tokenise to fewer or more tokens.
    prediction_accepted / prediction_rejected: where the request sent a predicted output, the
    tokens drafted from it that the answer kept and those it did not, as the server's usage reports
    them (``completion_tokens_details``); None where no prediction was sent.
    """

    method: str
    prompt: int
    repeat: int
    order: int
    seed: int
    token_ids: list[int]
    seconds: float
    target_forwards: int
    step_drafted: list[int] = field(default_factory=list)
    step_accepted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_token_seconds: float | None = None
    step_seconds: float | None = None
    first_step_seconds: float | None = None
    first_step_tokens: int | None = None
    drafted_total: int | None = None
    accepted_total: int | None = None
    json_parsed: bool | None = None
    schema_valid: bool | None = None
    forced_tokens: int | None = None
    reported_tokens: int | None = None
    prediction_accepted: int | None = None
    prediction_rejected: int | None = None

    @property
    def new_tokens(self) -> int:
        return self.reported_tokens if self.reported_tokens is not None else len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"new_tokens": self.new_tokens}


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None
