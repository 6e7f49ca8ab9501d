"""Several sequences' forward passes run as one pass of the weights (continuous batching).

Each sequence decodes on its own thread with its own loop (the engine's, unchanged: its drafter,
verifier, policy, grammar and stop strings) and its own caches: a :class:`~specdec.backends.gguf.GGUFCausalLM`
fork of the target (and of the draft) per sequence, a *slot*. A slot's forward does not compute:
it hands its piece of a pass to :class:`SharedPasses` and waits. One thread, the executor, runs
what the slots handed in as one pass per set of weights (:func:`~specdec.backends.gguf.run_together`):
the target's rows of every sequence that is verifying, the draft's rows of every sequence that is
drafting, and the next rows of each prompt being prefilled.

A pass has a budget (:attr:`SharedPasses.budget`, a multiple of what its decoding rows cost alone,
as vLLM's scheduler gives each step one budget of rows that decodes and prompt chunks share):
decoding and verification rows go in whole, then each prompt being prefilled, oldest first, adds
as many rows as keep the pass within ``budget`` times the cost of those rows alone, read from the
weights' measured cost curve (``costs``: the planner's, carried to
:data:`~specdec.backends.gguf.MAX_PASS_ROWS` rows); the rest of its piece waits for the next pass
(:meth:`~specdec.backends.gguf.Piece.split`: the same numbers). Where no decoding rows are in the
pass but another slot is busy, the prompts' rows are kept to ``budget - 1`` one-row passes (as
beside one decoding row), so that a slot handing its step in just after the pass began does not
wait for a whole chunk of a prompt. Prompts
alone (every slot prefilling) go :data:`~specdec.backends.gguf.MAX_PASS_ROWS` rows a pass. A short
request's pass beside a long prompt so costs at most ``budget`` times its rows alone, and a step
that misses a pass waits for one held to ``budget - 1`` one-row passes (by the curve, at most about
``2 * budget - 1`` times a token's time alone; measured: docs/server.md), while the prompt advances
every pass (at least one row). A sequence stopped while its piece waits
(:func:`~specdec.backends.gguf.stop_when`) is dropped before the next pass, its caches holding the
rows already run.

The executor runs a pass once every slot taking part has handed in its piece, or once the first
piece has waited :attr:`SharedPasses.wait` seconds (a slot busy with its own work, or done with its
steps, does not hold the others up). Which pieces share a pass changes only the speed: the kernel
computes each row as the sequence's own pass would, bit for bit, so a request's answer does not
depend on what else is being served.

The slots themselves, their planners' board and the threads that drive them are the serving
engine's (:mod:`specdec.serving`); this module only runs the passes they hand in.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from specdec import kernels
from specdec.backends.gguf import GGUFCausalLM, Piece, Stopped, run_together, stop_event

WAIT_SECONDS = 0.01  # how long a piece waits for the other slots' before its pass runs without them
# A pass that carries prompt rows beside decoding rows costs at most this many times what its
# decoding rows cost alone (on the measured cost curve; see the module docstring): each decoding
# sequence's steps then take at most about this many times their time alone while a prompt is
# prefilled beside them, and a step that misses a pass waits for one more pass (2 * budget - 1 per
# token by the cost curve). Measured with SmolLM2 on an idle machine (docs/server.md, "Several requests at
# once"): a 48-token request beside a 3,000-token prompt took 6.9x its time alone at 3, 55x with
# whole 64-row chunks; the prompt's first token came no later (40.2 s against 41.6 s).
PASS_BUDGET = 3.0
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
    piece: Piece  # the rows still to run
    prefill: bool = False  # a prompt's rows whose logits are not read (kernels.prefilling): they may wait
    stop: Any = None  # the sequence's stop event (gguf.stop_when), or None
    parts: list[torch.Tensor] = field(default_factory=list)  # the logits of the rows already run
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None

    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()


@dataclass
class PassStats:
    """Totals of the passes run: how many, their rows, and how many sequences shared each."""

    passes: int = 0
    rows: int = 0
    sequences: int = 0
    prompt_rows: int = 0  # of the rows, those of prompts being prefilled
    held: int = 0  # prompt rows the budget kept out of a pass (counted once per pass they waited)

    def to_dict(self) -> dict[str, float]:
        return {"passes": self.passes, "rows": self.rows, "sequences": self.sequences,
                "prompt_rows": self.prompt_rows, "held": self.held,
                "rows_per_pass": self.rows / self.passes if self.passes else 0.0,
                "sequences_per_pass": self.sequences / self.passes if self.passes else 0.0}


class SharedPasses:
    """The executor of the slots' passes (see the module docstring). Use :meth:`slot` to make a
    sequence's model and :meth:`member` around the thread that decodes with it."""

    def __init__(self, wait: float = WAIT_SECONDS, *, own_thread: bool = True,
                 observe: Callable[[list[tuple[GGUFCausalLM, int]]], None] | None = None,
                 budget: float | None = PASS_BUDGET,
                 costs: Callable[[GGUFCausalLM], list[float]] | None = None) -> None:
        """``own_thread``: run the passes on a thread of its own; False: the caller runs :meth:`serve`
        on the thread it wants the passes on (the server's model thread). ``observe(pieces)`` is told
        of every pass run: each sequence in it (its slot's model) and its rows. ``budget``: a pass
        with prompt rows costs at most this multiple of its decoding rows alone (> 1), on the curves
        ``costs(model)`` gives: seconds of a pass of 1..n rows on ``model``'s weights (the server's and
        :func:`specdec.generate_many`'s: :func:`specdec.costs.row_costs` to MAX_PASS_ROWS rows, the
        planner's measurement). Without ``costs``, or with ``budget`` None, every prompt piece goes
        whole (MAX_PASS_ROWS rows)."""
        if budget is not None and not budget > 1:
            raise ValueError(f"a pass's budget is a multiple of its decoding rows' cost, above 1; got {budget!r}")
        self.wait = wait
        self.observe = observe
        self.budget = budget
        self._costs = costs
        self._curves: dict[int, list[float]] = {}  # id(weights) -> its cost curve
        self.stats = PassStats()
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
            with self._cond:
                self._members -= 1
                self._cond.notify_all()

    def run(self, model: GGUFCausalLM, piece: Piece) -> torch.Tensor:
        """``piece`` of ``model``'s pass, run in the next shared pass (a prompt's piece perhaps over
        several): its logits [piece.want, V]. Raises :class:`~specdec.backends.gguf.Stopped` where
        this thread's :func:`~specdec.backends.gguf.stop_when` event is set before its last rows ran."""
        call = _Call(model, piece, prefill=kernels.prefilling(), stop=stop_event())
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

    def prepare(self, models: list[GGUFCausalLM | None]) -> None:
        """Read (or measure, once per machine) the cost curves of ``models``' weights now, on the
        thread that will run the passes, rather than at the first pass that needs them."""
        if self.budget is not None and self._costs is not None:
            for model in models:
                if model is not None:
                    self._curve(model)

    def serve(self) -> None:
        """Run the passes handed in, until :meth:`close`. Should a pass raise out of here (an
        interrupt), every piece waiting, and every piece handed in after, gets the error."""
        calls: list[_Call] = []
        try:
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
                    members = self._members
                waiting = self._execute(calls, members)
                with self._cond:
                    self._pending[:0] = waiting  # the prompts' rest, first in line for the next pass
        except BaseException as err:
            with self._cond:
                self._closed = True
                left = {id(c): c for c in calls + self._pending if not c.done.is_set()}
                calls, self._pending = list(left.values()), []
            for c in calls:
                c.error = RuntimeError(f"the shared passes stopped: {err!r}")
                c.done.set()
            raise

    def _curve(self, model: GGUFCausalLM) -> list[float]:
        curve = self._curves.get(id(model.weights))
        if curve is None:
            curve = [float(t) for t in self._costs(model)]
            if not curve or any(not t > 0 for t in curve):
                raise ValueError(f"a cost curve must be positive seconds for 1..n rows, got {curve!r}")
            self._curves[id(model.weights)] = curve
        return curve

    def _cost(self, model: GGUFCausalLM, rows: int) -> float:
        """Seconds of a pass of ``rows`` rows on ``model``'s weights (0 for none); past the curve's
        end, along its last segment."""
        t = self._curve(model)
        if rows <= len(t):
            return t[rows - 1] if rows > 0 else 0.0
        slope = t[-1] - t[-2] if len(t) > 1 else t[-1]
        return t[-1] + slope * (rows - len(t))

    def _rows(self, calls: list[_Call], members: int) -> list[int]:
        """How many rows of each call's piece go in this pass (see the module docstring)."""
        whole = [len(c.piece.tokens) for c in calls]
        prompts = [i for i, c in enumerate(calls) if c.prefill and whole[i] > 1]
        if self.budget is None or self._costs is None or not prompts:
            return whole
        used: dict[int, int] = {}  # rows in the pass so far, by weights
        model: dict[int, GGUFCausalLM] = {}  # a sequence on those weights (for their cost curve)
        for i, c in enumerate(calls):
            if i not in prompts:
                w = id(c.model.weights)
                used[w], model[w] = used.get(w, 0) + whole[i], c.model
        alone = sum(self._cost(model[w], rows) for w, rows in used.items())  # the decoding rows' passes
        if alone == 0:
            if members <= len(prompts):  # every slot is prefilling: nobody waits on these passes
                return whole
            alone = self._cost(calls[prompts[0]].model, 1)  # a busy slot may hand a one-row step in now
        left = (self.budget - 1) * alone
        rows = list(whole)
        for n, i in enumerate(prompts):
            c, w = calls[i], id(calls[i].model.weights)
            base = used.get(w, 0)
            before = self._cost(c.model, base)
            take = 0
            while take < whole[i] and self._cost(c.model, base + take + 1) - before <= left:
                take += 1
            if take == 0 and n == 0:
                take = 1  # the oldest prompt advances every pass
            left -= self._cost(c.model, base + take) - before
            used[w] = base + take
            rows[i] = take
        return rows

    def _execute(self, calls: list[_Call], members: int) -> list[_Call]:
        """One pass per set of weights, each sequence's piece in it (a sequence hands in one piece at
        a time, but an exception's leftovers are kept apart), a prompt's piece perhaps only its first
        rows (:meth:`_rows`). Returns the calls whose rows are not all run, in order."""
        live = []
        for c in calls:
            if c.stopped():  # its sequence was stopped while its piece waited: its cache keeps the rows run
                c.error = Stopped("the generation was stopped")
                c.done.set()
            else:
                live.append(c)
        try:
            rows = self._rows(live, members)
        except BaseException as err:  # a cost curve could not be measured: handed to the callers
            for c in live:
                c.error = err
                c.done.set()
            return []
        groups: dict[int, list[tuple[_Call, Piece, Piece | None]]] = {}
        waiting = []
        for c, n in zip(live, rows):
            if n == 0:
                waiting.append(c)
                self.stats.held += len(c.piece.tokens)
                continue
            head, rest = (c.piece, None) if n == len(c.piece.tokens) else c.piece.split(n)
            groups.setdefault(id(c.model.weights), []).append((c, head, rest))
        for group in groups.values():
            try:
                results = run_together([(c.model, head) for c, head, _ in group])
            except BaseException as err:  # handed to every caller of this pass
                for c, _, _ in group:
                    c.error = err
                    c.done.set()
                continue
            n_rows = sum(len(head.tokens) for _, head, _ in group)
            self.stats.passes += 1
            self.stats.rows += n_rows
            self.stats.sequences += len(group)
            self.stats.prompt_rows += sum(len(head.tokens) for c, head, _ in group if c.prefill)
            self.stats.held += sum(len(rest.tokens) for _, _, rest in group if rest is not None)
            if self.observe is not None:
                self.observe([(c.model, len(head.tokens)) for c, head, _ in group])
            for (c, _, rest), logits in zip(group, results):
                c.parts.append(logits)
                if rest is not None:
                    c.piece = rest
                    waiting.append(c)
                else:
                    c.logits = torch.cat(c.parts) if len(c.parts) > 1 else c.parts[0]
                    c.done.set()
        order = {id(c): k for k, c in enumerate(live)}
        return sorted(waiting, key=lambda c: order[id(c)])


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


def shares_passes(target: Any, draft: Any = None) -> bool:
    """Whether ``target`` (and ``draft``, where given) can decode in slots whose passes are shared:
    only specdec's GGUF kernel computes a row of a shared pass as the sequence's own pass would, so
    only there does an answer not depend on the others. The one place that asks."""
    return isinstance(target, GGUFCausalLM) and (draft is None or isinstance(draft, GGUFCausalLM))
