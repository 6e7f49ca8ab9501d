"""Explain a greedy output that leaves its backend's ``ar``: where, which tokens, and why.

Under greedy decoding an exact method reproduces ``ar`` token for token, unless the target's
logits at some position differ between the two runs' forward passes: a backend whose batched
kernels round differently from its one-token steps (llama.cpp's repacked Q4_K weights, for one)
can flip a near-tie. For the first differing position the report gives both tokens, the target's
top-2 logit margin there as each pass computed it (``ar``'s one-token step, and the row of the
method's own verification pass that chose the token), and the largest difference between those
two rows' logits. Whether the backend's passes are batch invariant for this model is measured
(:func:`specdec.measurements.batch_invariance`, cached): where they are, the two rows must be
equal, and a divergence of specdec's own method is reported as a defect, never as rounding. A
peer's (another tool's generation in the bench) is the peer's own: its passes are not specdec's.

The rows come from replaying both runs untimed with a :class:`LogitsRecorder` around the
target's backend (greedy runs are deterministic, so a replay makes the same passes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Collection, Mapping, Sequence

import numpy as np
import torch

from specdec.sampling import SamplingConfig, filtered_logits, gumbel_max, gumbel_noise


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

    def __init__(self, backend: Any, keep: Collection[int] = ()) -> None:
        """keep: absolute positions whose whole rows are kept too (:meth:`full_row`)."""
        self.backend = backend
        self.rows: dict[int, list[Row]] = {}
        self.whole_rows_at = set(keep)  # not `keep`: that is the CausalLM method trees call
        self.full: dict[tuple[int, int], torch.Tensor] = {}  # (position, token) -> logits [V]

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
            if where[j] in self.whole_rows_at:
                self.full[where[j], int(tokens[j])] = logits[i].float().clone()
        return logits

    def row(self, position: int, token: int) -> Row | None:
        """The last row computed at ``position`` with ``token`` as its input, if any."""
        return next((r for r in reversed(self.rows.get(position, [])) if r.token == token), None)

    def full_row(self, position: int, token: int) -> torch.Tensor | None:
        """The last whole row [V] computed at a kept ``position`` with ``token`` as its input."""
        return self.full.get((position, token))


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
    logit_gap: float | None = None  # max |logit| difference between the two rows that chose the tokens
    batch_invariant: bool | None = None  # the backend's, measured (None: not measured)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decisive_position(prompt: Sequence[int], tokens: Sequence[int], ar_tokens: Sequence[int]) -> int | None:
    """The absolute input position whose row chose the first differing new token (None: no difference):
    what a :class:`LogitsRecorder` should ``keep`` to give :func:`explain` the logit gap."""
    position = first_difference(tokens, ar_tokens)
    return None if position is None else len(prompt) + position - 1


def explain(prompt: Sequence[int], tokens: Sequence[int], ar_tokens: Sequence[int],
            recorder: LogitsRecorder | None, ar_recorder: LogitsRecorder | None,
            invariance: Mapping[str, Any] | None = None, gumbel: SamplingConfig | None = None) -> Divergence | None:
    """The first divergence of ``tokens`` from ``ar_tokens`` (new tokens after ``prompt``), with the
    margins each run's :class:`LogitsRecorder` saw at the input position whose row chose that
    token (None for a run not recorded), the largest logit difference between the two rows where
    both recorders kept them whole, and ``invariance`` (:func:`specdec.measurements.batch_invariance`)
    of the target's backend; None if the outputs are equal. ``gumbel``: two runs of the Gumbel-max
    sampler with these settings, whose tokens are the argmax of the noised scores (logits / T plus the
    position's noise): the margins and top-2 are then those scores', from the whole rows."""
    position = first_difference(tokens, ar_tokens)
    if position is None:
        return None
    context = list(prompt) + list(tokens[:position])  # the same in both runs
    at, token = len(context) - 1, context[-1]  # the input whose row chose new token `position`
    mine, theirs = (r.row(at, token) if r is not None else None for r in (recorder, ar_recorder))
    whole = [r.full_row(at, token) if r is not None else None for r in (recorder, ar_recorder)]
    if gumbel is not None:
        mine, theirs = (_noised_row(row, token, gumbel, at + 1) if row is not None else None for row in whole)
    gap = float((whole[0] - whole[1]).abs().max()) if whole[0] is not None and whole[1] is not None else None
    return Divergence(
        position,
        tokens[position] if position < len(tokens) else None,
        ar_tokens[position] if position < len(ar_tokens) else None,
        margin=mine.margin if mine else None, top=mine.top if mine else None,
        ar_margin=theirs.margin if theirs else None, ar_top=theirs.top if theirs else None,
        logit_gap=gap, batch_invariant=None if invariance is None else bool(invariance["invariant"]),
    )


def _noised_row(logits: torch.Tensor, token: int, sampling: SamplingConfig, position: int) -> Row:
    """The top two of the Gumbel-max sampler's scores for one row ([V]) at ``position``, as the
    sampler ranks them (:func:`~specdec.sampling.gumbel_max`)."""
    scores = filtered_logits(logits.double(), sampling).numpy()  # [V]
    top = gumbel_max(scores, sampling.gumbel_seed, position, count=2)
    noised = list(scores[top] - gumbel_noise(sampling.gumbel_seed, position, np.array(top)))
    if len(top) == 1:  # a support of one token: nothing to tie with
        top, noised = top * 2, noised + [-np.inf]
    return Row(token, (top[0], top[1]), (float(noised[0]), float(noised[1])))


def cause(d: Mapping[str, Any], *, peer: bool = False) -> str:
    """What a divergence record (:meth:`Divergence.to_dict`) says about why, from what was measured.
    ``peer``: the output is another tool's (a bench peer), whose passes specdec neither ran nor
    recorded: its difference is its own, whatever the batch invariance of specdec's backend; where the
    reference's token ends the output in a run that ignores the end (``ar_token_ends``), the peer was
    asked never to sample it."""
    if peer and d.get("ar_token_ends"):
        return ("there the reference chose an end-of-generation token and, as the run ignores the end, went on; "
                "a peer asked to ignore the end (llama-server's ignore_eos) never samples such a token and takes "
                "another: the difference is the request's, not a rounding")
    if peer:
        return ("the peer's own passes (its library's, not recorded) need not be batch invariant: its multi-token "
                "rows can round differently from plain decoding's one-token steps, which can flip a near-tie "
                "(a margin near 0); the difference is the peer's, not specdec's")
    gap = d.get("logit_gap")
    differ = (f"the verification pass's logits there differ from the one-token step's by up to {gap:.3g}"
              if gap is not None else None)
    if d.get("batch_invariant"):
        return ("a defect: this backend's multi-token passes compute bit-identical rows to its one-token steps "
                "(measured), so the runs must agree" + (f", yet {differ}" if differ else "") + "; please report it")
    if d.get("batch_invariant") is False:
        return ("this backend's multi-token passes round differently from its one-token steps (measured)"
                + (f"; here {differ}" if differ else "") + ", which can flip a near-tie (a margin near 0)")
    return "a margin near 0 is a near-tie that rounding in batched kernels can flip; a wide one points at a bug"
