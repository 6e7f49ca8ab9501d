"""The planners' board: what each slot of a pool plans to put in the next shared pass.

A pool of slots (:mod:`specdec.serving.pool`) makes one :class:`Board` and gives each slot a
:class:`Seat` on it. A slot's planner (:class:`~specdec.policies.auto.AutoPolicy`) is handed its
slot's seat when it binds, posts its plan there each step (the rows its next verification adds to
the pass and the tokens it expects from them) and reads the sum of the other seats' plans: the
rows the others posted make its rows' marginal cost on the measured cost curve, and the tokens
they expect join its own in the pass's tokens per second. A draft length changes how fast an
answer comes, never which answer, so planning together keeps every answer equal to its answer alone.

Plans are kept by seat, not by thread: two slots driven from one thread do not see each other's
plan as their own.
"""

from __future__ import annotations

import threading


class Board:
    """The plans of one pool's seats: (rows, expected tokens) by seat."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[Seat, tuple[int, float]] = {}

    def seat(self) -> "Seat":
        """A new seat (a slot's place) on this board, with no plan posted."""
        return Seat(self)


class Seat:
    """One slot's place on a :class:`Board`: what a planner posts to and reads from."""

    def __init__(self, board: Board) -> None:
        self.board = board

    def post(self, rows: int, expected: float) -> None:
        """This slot will put ``rows`` rows in the next pass, expecting ``expected`` tokens from them."""
        with self.board._lock:
            self.board._plans[self] = (rows, expected)

    def others(self) -> tuple[int, float, int]:
        """(rows, expected tokens, slots drafting) the other seats posted for the next pass; (0, 0.0, 0) alone."""
        with self.board._lock:
            plans = [plan for seat, plan in self.board._plans.items() if seat is not self]
        return (sum(rows for rows, _ in plans), sum(expected for _, expected in plans),
                sum(rows > 1 for rows, _ in plans))

    def leave(self) -> None:
        """Take this seat's plan off the board (its slot's sequence ended)."""
        with self.board._lock:
            self.board._plans.pop(self, None)
