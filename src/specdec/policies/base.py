"""What every draft-length policy shares: the protocol the engine calls, the plan it returns, and
the limits on draft lengths.

Each step the engine makes one call, :meth:`DraftLengthPolicy.plan`: given the sources the
drafter can draft from now, the policy returns a :class:`Plan` (which source, at most how many
tokens, and a ``keep_going`` test that may stop the draft sooner). A policy sees each
:class:`~specdec.stats.Step` after it is taken; ``describe`` reports its state (for ``theory``
its estimates), which the API copies into ``GenerationStats.policy``.

The policies: ``static``, ``heuristic`` and ``confidence`` in :mod:`specdec.policies.rules`,
``theory`` in :mod:`specdec.policies.theory`, and the default, ``auto``, the planner in
:mod:`specdec.policies.auto`. The last two learn from :class:`~specdec.policies.estimates.AcceptanceEstimates`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from specdec.drafters.base import KeepGoing
from specdec.options import MAX_INT
from specdec.stats import Step



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

    def bind(self, target: Any, drafter: Any, seat: Any = None) -> None:
        """Learn what the target and the drafter cost before the first step (the planner measures
        them: :meth:`specdec.policies.auto.AutoPolicy.bind`); other policies need nothing. ``seat``:
        a slot's :class:`~specdec.serving.board.Seat` where its passes are shared with other
        sequences (the planner plans with the other slots'), else None."""

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


def check_k(k: int) -> None:
    """Refuse a draft length that is not a positive integer up to :data:`MAX_INT`."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= MAX_INT:
        raise ValueError(f"k (tokens drafted per step) must be a positive integer up to {MAX_INT}, got {k!r}")
