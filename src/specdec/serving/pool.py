"""A pool of slots: several sequences decoded at once, their passes sharing each pass of the weights.

A :class:`Slot` is one sequence's models: a fork of the target and of the draft (each with its own
cache) whose forward passes run in the pool's :class:`~specdec.backends.shared.SharedPasses`, and
its seat on the pool's one :class:`~specdec.serving.board.Board`, which its planner is handed
when it binds. Only models whose passes can be shared make a pool
(:func:`specdec.backends.shared.shares_passes`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from specdec.backends.shared import SharedPasses, shares_passes
from specdec.costs import pass_costs
from specdec.serving.board import Board, Seat


@dataclass(frozen=True)
class Slot:
    """One sequence's place in a pool: caches of the target and of the draft (None without one)
    whose passes run in the pool's passes, and its seat on the pool's board."""

    target: Any
    draft: Any
    seat: Seat


class Pool:
    """``size`` slots on ``target`` (and ``draft``) whose passes are shared. ``observer``: told of
    every pass (:meth:`specdec.serving.engine.Observer.shared_pass`), or None. A ``ValueError``
    where the models cannot share passes."""

    def __init__(self, target: Any, draft: Any, size: int, observer: Any = None) -> None:
        if not shares_passes(target, draft):
            raise ValueError("several requests at once need the models on specdec's GGUF kernel (--backend gguf), "
                             "whose shared passes give each request its answer alone; this backend serves one at a time")
        self.observer = observer
        # prompts prefilled within each pass's budget, on the cost curves the planner measures
        self.passes = SharedPasses(own_thread=False, observe=self._observe if observer is not None else None,
                                   costs=pass_costs)
        self.board = Board()
        self.slots = [Slot(self.passes.slot(target), self.passes.slot(draft) if draft is not None else None,
                           self.board.seat()) for _ in range(size)]
        # the slots' draft models, by id: a draft on the target's own weights shares the target's passes
        self._drafts = {id(slot.draft) for slot in self.slots if slot.draft is not None}

    def prepare(self) -> None:
        """Read (or measure, once per machine) the cost curves the passes' budget weighs, on the
        thread that will run the passes."""
        self.passes.prepare([self.slots[0].target, self.slots[0].draft])

    def serve(self) -> None:
        """Run the slots' passes on this thread until :meth:`close`."""
        self.passes.serve()

    def close(self) -> None:
        self.passes.close()

    @contextlib.contextmanager
    def member(self, slot: Slot) -> Iterator[None]:
        """Within the block, ``slot``'s sequence takes part in the passes (on this thread); after
        it, its plan is off the board."""
        try:
            with self.passes.member():
                yield
        finally:
            slot.seat.leave()

    def _observe(self, pieces: list[tuple[Any, int]]) -> None:
        """One pass: counted for each model whose rows it holds (a draft that is the target's own
        weights shares the target's passes; its rows are still the draft's)."""
        for model in ("target", "draft"):
            rows = [n for slot_model, n in pieces if (id(slot_model) in self._drafts) == (model == "draft")]
            if rows:
                self.observer.shared_pass(model, sum(rows), len(rows))
