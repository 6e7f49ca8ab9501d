"""Explain a greedy output that leaves its backend's ``ar``: where, which tokens, how close a call.

Under greedy decoding an exact method reproduces ``ar`` token for token, unless the target's
logits at some position differ between the two runs' forward passes: a backend whose batched
kernels round differently from its one-token steps (llama.cpp's, for one) can flip a near-tie.
For the first differing position the bench reports both tokens and the target's top-2 logit
margin there as each pass computed it: ``ar``'s one-token step, and the row of the method's own
verification pass that chose the token. A margin near 0 is a near-tie that rounding can flip; a
wide margin points at a bug.

The margins come from replaying both runs untimed with a :class:`LogitsRecorder` around the
target's backend (greedy runs are deterministic, so a replay makes the same passes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Row:
    """The target's top two logits at one input position, as one pass computed them."""

    token: int  # the input token at this position
    top: tuple[int, int]  # the two highest-scoring next tokens, best first
    logits: tuple[float, float]  # their logits

    @property
    def margin(self) -> float:
        return self.logits[0] - self.logits[1]


class LogitsRecorder:
    """A :class:`~specdec.backends.base.CausalLM` that passes everything to ``backend`` and keeps,
    per absolute input position, the top-2 logits of every row a pass returned for it, in order.

    Under greedy decoding the last row computed for a position holding the kept token is the one
    that chose the next token: once that token is kept, the position is never fed again (the cache
    keeps it). Matching the token sets apart a token tree's siblings at the same position.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.rows: dict[int, list[Row]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def forward(self, tokens: Sequence[int], num_logits: int = 0, *, attend: torch.Tensor | None = None,
                positions: Sequence[int] | None = None) -> torch.Tensor:
        start = len(self.backend.tokens)
        logits = self.backend.forward(tokens, num_logits, attend=attend, positions=positions)  # [rows, V]
        where = list(positions) if positions is not None else list(range(start, start + len(tokens)))
        rows = logits.shape[0]
        top = torch.topk(logits.float(), 2, dim=-1)
        for i in range(rows):
            j = len(tokens) - rows + i
            self.rows.setdefault(where[j], []).append(
                Row(int(tokens[j]), (int(top.indices[i, 0]), int(top.indices[i, 1])),
                    (float(top.values[i, 0]), float(top.values[i, 1]))))
        return logits

    def row(self, position: int, token: int) -> Row | None:
        """The last row computed at ``position`` with ``token`` as its input, if any."""
        return next((r for r in reversed(self.rows.get(position, [])) if r.token == token), None)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's length if one is a prefix of
    the other), or None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Divergence:
    """Where a greedy output first leaves ``ar``'s, and the target's top-2 margin there in each pass
    (None where that pass was not recorded, e.g. inside a peer's library)."""

    position: int  # index among the new tokens
    token: int | None  # the method's token there (None: its output ended first)
    ar_token: int | None
    margin: float | None = None
    top: tuple[int, int] | None = None
    ar_margin: float | None = None
    ar_top: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def explain(prompt: Sequence[int], tokens: Sequence[int], ar_tokens: Sequence[int],
            recorder: LogitsRecorder | None, ar_recorder: LogitsRecorder | None) -> Divergence | None:
    """The first divergence of ``tokens`` from ``ar_tokens`` (new tokens after ``prompt``), with the
    margins each run's :class:`LogitsRecorder` saw at the input position whose row chose that
    token (None for a run not recorded); None if the outputs are equal."""
    position = first_difference(tokens, ar_tokens)
    if position is None:
        return None
    context = list(prompt) + list(tokens[:position])  # the same in both runs
    at, token = len(context) - 1, context[-1]  # the input whose row chose new token `position`
    mine, theirs = (r.row(at, token) if r is not None else None for r in (recorder, ar_recorder))
    return Divergence(
        position,
        tokens[position] if position < len(tokens) else None,
        ar_tokens[position] if position < len(ar_tokens) else None,
        margin=mine.margin if mine else None, top=mine.top if mine else None,
        ar_margin=theirs.margin if theirs else None, ar_top=theirs.top if theirs else None,
    )
