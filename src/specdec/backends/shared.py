"""Several sequences' forward passes run as one pass of the weights (continuous batching).

Each sequence decodes on its own thread with its own loop (the engine's, unchanged: its drafter,
verifier, policy, grammar and stop strings) and its own caches: a :class:`~specdec.backends.gguf.GGUFCausalLM`
fork of the target (and of the draft) per sequence, a *slot*. A slot's forward does not compute:
it hands its piece of a pass to :class:`SharedPasses` and waits. One thread, the executor, runs
what the slots handed in as one pass per set of weights (:func:`~specdec.backends.gguf.run_together`):
the target's rows of every sequence that is verifying, the draft's rows of every sequence that is
drafting, and the next chunk of each prompt being prefilled (a long prompt goes in pieces of
:data:`~specdec.backends.gguf.MAX_PASS_ROWS` rows, so that it does not stall the others).

The executor runs a pass once every slot taking part has handed in its piece, or once the first
piece has waited :attr:`SharedPasses.wait` seconds (a slot busy with its own work, or done with its
steps, does not hold the others up). Which pieces share a pass changes only the speed: the kernel
computes each row as the sequence's own pass would, bit for bit, so a request's answer does not
depend on what else is being served.

The slots plan their drafts together (:class:`Board`): each slot's planner
(:class:`~specdec.policies.auto.AutoPolicy`) posts the rows its next verification adds to the pass
and the tokens it expects from them, and weighs its own draft against the whole pass: the rows the
others posted make its rows' marginal cost (on the measured cost curve, where an extra row of a
4-row pass costs far less than the second row of a 1-row pass), and the tokens they expect join
its own in the pass's tokens per second. A draft length changes how fast an answer comes, never
which answer (greedy, or the seeded Gumbel-max sampler), so planning together keeps every answer
equal to its answer alone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from specdec.backends.gguf import GGUFCausalLM, Piece, run_together

WAIT_SECONDS = 0.01  # how long a piece waits for the other slots' before its pass runs without them
# The default number of slots: the fewest sequences whose shared pass makes at least this share of
# the most tokens per second any pass of up to the measured rows makes (see default_slots).
SLOTS_SHARE = 0.9
# ... and at most this many: each of n one-row sequences decodes at T(1) / T(n) of its speed alone
# (the 1.5B target on a 2-core AVX2 EPYC: 0.26 at 8 rows, 0.19 at 16, for 1.45x more tokens per
# second in all), and every slot holds a cache: past 8, a request waits too long for what it adds.
MAX_DEFAULT_SLOTS = 8


@dataclass
class _Call:
    model: GGUFCausalLM
    piece: Piece
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class Board:
    """What each slot plans to put in the next shared pass: (rows, expected tokens), by slot.

    A slot's planner posts its plan each step (:meth:`post`) and reads the sum of the other
    slots' (:meth:`others`); a slot that leaves (:meth:`SharedPasses.member` ends) is taken off."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[int, tuple[int, float]] = {}

    def post(self, rows: int, expected: float) -> None:
        """This thread's slot will put ``rows`` rows in the next pass, expecting ``expected`` tokens from them."""
        with self._lock:
            self._plans[threading.get_ident()] = (rows, expected)

    def others(self) -> tuple[int, float, int]:
        """(rows, expected tokens, slots drafting) the other slots posted for the next pass; (0, 0.0, 0) alone."""
        me = threading.get_ident()
        with self._lock:
            plans = [plan for slot, plan in self._plans.items() if slot != me]
        return (sum(rows for rows, _ in plans), sum(expected for _, expected in plans),
                sum(rows > 1 for rows, _ in plans))

    def leave(self) -> None:
        with self._lock:
            self._plans.pop(threading.get_ident(), None)


@dataclass
class PassStats:
    """Totals of the passes run: how many, their rows, and how many sequences shared each."""

    passes: int = 0
    rows: int = 0
    sequences: int = 0

    def to_dict(self) -> dict[str, float]:
        return {"passes": self.passes, "rows": self.rows, "sequences": self.sequences,
                "rows_per_pass": self.rows / self.passes if self.passes else 0.0,
                "sequences_per_pass": self.sequences / self.passes if self.passes else 0.0}


class SharedPasses:
    """The executor of the slots' passes (see the module docstring). Use :meth:`slot` to make a
    sequence's model and :meth:`member` around the thread that decodes with it."""

    def __init__(self, wait: float = WAIT_SECONDS, *, own_thread: bool = True,
                 observe: Callable[[list[tuple[GGUFCausalLM, int]]], None] | None = None) -> None:
        """``own_thread``: run the passes on a thread of its own; False: the caller runs :meth:`serve`
        on the thread it wants the passes on (the server's model thread). ``observe(pieces)`` is told
        of every pass run: each sequence in it (its slot's model) and its rows."""
        self.wait = wait
        self.observe = observe
        self.stats = PassStats()
        self.board = Board()
        self._cond = threading.Condition()
        self._members = 0
        self._pending: list[_Call] = []
        self._closed = False
        if own_thread:
            threading.Thread(target=self.serve, name="specdec-passes", daemon=True).start()

    def slot(self, model: GGUFCausalLM) -> GGUFCausalLM:
        """A new sequence on ``model``'s weights (an empty cache) whose passes run here."""
        fork = model.fork()
        fork.passes = self
        return fork

    @contextlib.contextmanager
    def member(self) -> Iterator[None]:
        """Within the block, this thread's slot takes part: passes wait for its piece (up to :attr:`wait`),
        and its torch operations run on this thread alone (:func:`torch_on_one_thread`)."""
        with self._cond:
            self._members += 1
        try:
            with torch_on_one_thread():
                yield
        finally:
            self.board.leave()
            with self._cond:
                self._members -= 1
                self._cond.notify_all()

    def run(self, model: GGUFCausalLM, piece: Piece) -> torch.Tensor:
        """``piece`` of ``model``'s pass, run in the next shared pass: its logits [piece.want, V]."""
        call = _Call(model, piece)
        with self._cond:
            if self._closed:
                raise RuntimeError("the shared passes were closed")
            self._pending.append(call)
            self._cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.logits

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def serve(self) -> None:
        """Run the passes handed in, until :meth:`close`."""
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed and not self._pending:
                    return
                deadline = time.monotonic() + self.wait
                while len(self._pending) < self._members and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                calls, self._pending = self._pending, []
            self._execute(calls)

    def _execute(self, calls: list[_Call]) -> None:
        """One pass per set of weights, each sequence's first piece in it (a sequence hands in one
        piece at a time, but an exception's leftovers are kept apart)."""
        groups: dict[int, list[_Call]] = {}
        for call in calls:
            groups.setdefault(id(call.model.weights), []).append(call)
        for group in groups.values():
            try:
                results = run_together([(c.model, c.piece) for c in group])
            except BaseException as err:  # handed to every caller of this pass
                for c in group:
                    c.error = err
                    c.done.set()
                continue
            self.stats.passes += 1
            self.stats.rows += sum(len(c.piece.tokens) for c in group)
            self.stats.sequences += len(group)
            if self.observe is not None:
                self.observe([(c.model, len(c.piece.tokens)) for c in group])
            for c, logits in zip(group, results):
                c.logits = logits
                c.done.set()


_torch_lock = threading.Lock()
_torch_users = 0
_torch_threads = 0


@contextlib.contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """Within the block, torch's operations on this thread (a slot's sampling and verification) run
    on it alone, not on an OpenMP team of their own; after the last such block ends, torch's
    thread count is what it was before the first began.

    torch and the GGUF kernel share one OpenMP runtime (torch ships the ``libgomp.so.1`` the kernel
    links). A thread that runs a parallel torch operation gets a team of its own, and once the
    runtime manages more threads than the machine has cores it stops spinning between parallel
    regions: every one of the kernel's hundreds of regions a pass then waits for its threads to
    wake. Measured on the 1.5B target, 2 threads, one sequence of 64 tokens: the kernel's passes
    took 3.4-3.9 s from a slot whose torch ran two threads, 2.4-2.5 s from one whose torch ran one,
    2.5-2.7 s for the same sequence decoded without slots."""
    global _torch_users, _torch_threads
    with _torch_lock:
        if _torch_users == 0:
            _torch_threads = torch.get_num_threads()
        _torch_users += 1
    torch.set_num_threads(1)  # this thread's OpenMP threads (and the count a thread started now takes)
    try:
        yield
    finally:
        with _torch_lock:
            _torch_users -= 1
            if _torch_users == 0:
                torch.set_num_threads(_torch_threads)


def default_slots(curve: list[float], share: float = SLOTS_SHARE, most: int = MAX_DEFAULT_SLOTS) -> int:
    """How many sequences to decode at once, from a target's cost curve (``curve[n - 1]``: seconds
    of a pass of n rows): n sequences of one row each make n / curve[n - 1] tokens per second, which
    grows with n while rows are cheaper than passes; the fewest n within ``share`` of the best n of
    the curve, so that slots are added only while they still pay (more slots keep more requests
    waiting on each pass, and each holds a cache), and at most ``most``."""
    rates = [n / seconds for n, seconds in enumerate(curve, start=1)]
    best = max(rates)
    return min(most, next(n for n, rate in enumerate(rates, start=1) if rate >= share * best))


def shares_passes(model: Any) -> bool:
    """Whether ``model`` is a slot of :class:`SharedPasses`."""
    return getattr(model, "passes", None) is not None
