"""Lookahead decoding (Fu et al. 2024): Jacobi iteration on a window of guessed future tokens, the
n-grams it produces collected in a pool and verified, with no draft model.

Each step the target scores one token tree (:class:`LookaheadTree`, one pass with tree attention):

- the *window*: W guessed tokens for the positions after the context, as a chain under the root.
  The target's greedy prediction after each window token is the next Jacobi iterate of the guess
  one position further (Santilli et al. 2023); the window is also a candidate like any other
  branch, so a window that has converged to the target's own continuation is accepted whole;
- the *candidates*: up to G n-grams from the pool whose first token is the context's last token,
  their n - 1 remaining tokens as branches (merged into a trie with the window).

After the step (:meth:`LookaheadDrafter.observe`) the window becomes the new iterates shifted by the
tokens the step appended, and the n-grams are read off the last n - 1 iterations along the
diagonal: a guess, the target's prediction after it, the prediction after that one in the next
iteration, and so on, each token predicted with the one before it as the last input. They are
added to the pool (keyed by their first token, the G most recent kept per key).

How this relates to the paper: the paper's lookahead branch holds the last n - 1 iterations as a
2D window and re-feeds them all each step, with a mask that makes each token see its diagonal;
here the window is one iteration (a chain: Jacobi decoding itself) and the older iterations are
kept from earlier steps' outputs, so a pass costs W + G(n - 1) rows instead of W(n - 1) + G(n - 1),
and the diagonal n-grams are the same tokens the paper's window would hold when the window does
not move. Verification is the tree verifier's (the tree depends only on earlier steps, never on
this step's draws, so it is exact under every sampling setting and under the Gumbel-max sampler).

W, n and G are options (``window=``, ``ngram=``, ``candidates=``). Left out, they come from the
target's measured row-cost curve (:func:`~specdec.costs.row_costs`): the largest tree whose
pass costs at most :data:`ROW_SLACK` more than a two-row pass (the rows past the fixed cost of
verifying anything that come nearly free), split between the window and the candidates; and the
drafter stops drafting (plain steps, with a probe every :data:`BACKOFF` steps) while the tokens
per step it measures do not pay for that pass (its cost in one-row steps, from the same curve).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from specdec.backends.base import CausalLM
from specdec.costs import MAX_ROWS, row_costs
from specdec.drafters.base import Drafter, KeepGoing
from specdec.drafters.registry import DrafterSpec
from specdec.options import Option, integer_from, positive
from specdec.sampling import SamplingConfig
from specdec.token_tree import TokenTree, forward_tree

DEFAULT_WINDOW = 5
DEFAULT_NGRAM = 4
DEFAULT_CANDIDATES = 3
ROW_SLACK = 0.25  # left to choose: the largest tree whose pass costs at most 1.25 two-row passes
BACKOFF = 16  # while lookahead does not pay: plain steps between probes
DECAY = 0.8  # of the running tokens-per-step estimate
WARMUP = 8  # drafting steps before the estimate is judged (the pool fills over the first n - 1)


@dataclass(frozen=True)
class LookaheadTree(TokenTree):
    """A token tree whose first ``window`` nodes are the Jacobi window (a chain under the root);
    scoring it hands the target's logits to ``scored`` (the drafter's next iteration)."""

    window: int = 0
    scored: Callable[[Sequence[int], torch.Tensor], None] | None = field(default=None, compare=False)

    def score(self, target: CausalLM, context: Sequence[int]) -> torch.Tensor:
        logits = forward_tree(target, context, self)  # [1 + N, V]
        if self.scored is not None:
            self.scored(context, logits)
        return logits


def _positive(label: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"the lookahead drafter's {label} must be an integer >= {low}, got {value!r}")
    return value


class LookaheadDrafter(Drafter):
    """Lookahead decoding's tree each step (module doc). window: W guesses; ngram: n, the length
    of the pool's n-grams (first token and n - 1 proposed); candidates: G pool entries per step.
    costs: the target's seconds per pass of 1..16 rows (tests inject a curve); measured when
    needed (W, n or G left out), else unused."""

    name = "lookahead"

    def __init__(self, target: CausalLM, *, window: int | None = None, ngram: int | None = None,
                 candidates: int | None = None, costs: Sequence[float] | None = None) -> None:
        self.target = target
        self.auto = window is None and ngram is None and candidates is None
        self.ngram = _positive("ngram", DEFAULT_NGRAM if ngram is None else ngram, 2)
        self.window = _positive("window", DEFAULT_WINDOW if window is None else window)
        self.candidates = _positive("candidates", DEFAULT_CANDIDATES if candidates is None else candidates, 0)
        self._costs = list(costs) if costs is not None else None
        self._shaped = not self.auto
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> continuations, most recent first
        self._guess: list[int] = []  # the window: guesses for the positions after the context
        self._fresh: list[bool] = []  # whether each guess is an iterate (else a filler)
        self._history: deque = deque()  # the last n - 1 iterations: (guesses, fresh, outputs, shift)
        self._pending: tuple[int, list[int], list[bool], list[int]] | None = None
        self._rate = 1.0  # running tokens per step while drafting
        self._off = 0  # plain steps left before the next probe
        self._drafted = 0  # steps that drafted (the estimate is judged after WARMUP of them)
        self.steps = self.plain_steps = self.collected = 0

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    # -- the tree ------------------------------------------------------------------------------------

    def propose(self, context: Sequence[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None,
                keep_going: KeepGoing | None = None, source: str | None = None) -> TokenTree:
        """This step's tree at most ``k`` levels deep (:meth:`propose_tree`)."""
        return self.propose_tree(context, sampling, k, generator)

    def propose_tree(self, context: Sequence[int], sampling: SamplingConfig, max_depth: int,
                     generator: torch.Generator | None = None) -> TokenTree:
        """This step's tree: the window and the pool's candidates after ``context`` (module doc),
        at most ``max_depth`` levels; an empty tree (a plain step) while lookahead does not pay."""
        self._shape()
        self.steps += 1
        if max_depth <= 0 or not context or self._paused():
            self._pending = None
            self.plain_steps += 1
            return TokenTree([], [])
        if len(self._guess) < self.window:  # fillers: the context's own last tokens
            fill = list(context[-(self.window - len(self._guess)):])
            fill += [int(context[-1])] * (self.window - len(self._guess) - len(fill))
            self._guess += fill
            self._fresh += [False] * len(fill)
        width = min(self.window, max_depth)
        tokens: list[int] = []
        parents: list[int] = []
        children: list[dict[int, int]] = [{}]  # entry 1 + u: node u's children by token

        def add(branch: Sequence[int]) -> None:
            at = -1
            for tok in branch[:max_depth]:
                node = children[at + 1].get(tok)
                if node is None:
                    node = children[at + 1][tok] = len(tokens)
                    tokens.append(tok)
                    parents.append(at)
                    children.append({})
                at = node

        add(self._guess[:width])  # the window first: nodes 0 .. width - 1 are its chain
        for candidate in self.pool.get(int(context[-1]), ())[: self.candidates]:
            add(candidate)
        self._pending = (len(context), self._guess[:width], self._fresh[:width], [])
        return LookaheadTree(tokens, parents, window=width, scored=self._scored)

    def _scored(self, context: Sequence[int], logits: torch.Tensor) -> None:
        """The window's next iterate: the target's greedy prediction at the root and after each
        window node ([width + 1] token ids)."""
        if self._pending is None or self._pending[0] != len(context):
            return
        width = len(self._pending[1])
        rows = logits[: width + 1]  # the window's nodes are 0 .. width - 1: rows 1 .. width
        self._pending[3].extend(int(t) for t in rows.argmax(-1).tolist())

    def observe(self, context: Sequence[int]) -> None:
        """The step appended ``len(context) - start`` tokens: collect the diagonal n-grams, shift
        the window by that many positions, and update the tokens-per-step estimate."""
        pending, self._pending = self._pending, None
        if pending is None or not pending[3] or len(context) <= pending[0]:
            if pending is not None and len(context) <= pending[0]:  # cut back: start afresh
                self._guess, self._fresh, self._history = [], [], deque()
            return
        start, guess, fresh, out = pending
        shift = len(context) - start
        self._rate = DECAY * self._rate + (1.0 - DECAY) * shift
        self._history.append((guess, fresh, out, shift))
        while len(self._history) > max(self.ngram - 1, 1):
            self._history.popleft()
        self._collect()
        self._guess = out[shift:]
        self._fresh = [True] * len(self._guess)
        self._drafted += 1
        if self.auto and self._drafted > WARMUP and self._rate < self._cost():
            self._off = BACKOFF

    def _collect(self) -> None:
        """Add the n-grams ending in the newest iteration's outputs to the pool (module doc)."""
        history = list(self._history)
        last = len(history) - 1
        guess, _, out, _ = history[last]
        for j in range(len(guess)):
            if j + 1 >= len(out):
                break
            gram = [out[j + 1], guess[j]]  # read backwards: the prediction, then its last input
            t, i = last, j
            while len(gram) < self.ngram and t > 0 and history[t][1][i]:
                prev_guess, _, _, prev_shift = history[t - 1]
                i = i + prev_shift - 1  # guess i of iteration t was output i + shift of t - 1
                if i >= len(prev_guess):
                    break
                gram.append(prev_guess[i])
                t -= 1
            if len(gram) == self.ngram:
                gram.reverse()
                self._remember(gram[0], tuple(gram[1:]))

    def _remember(self, first: int, rest: tuple[int, ...]) -> None:
        entries = self.pool.setdefault(first, [])
        if rest in entries:
            entries.remove(rest)
        else:
            self.collected += 1
        entries.insert(0, rest)
        del entries[max(self.candidates, 1):]

    # -- when it pays ------------------------------------------------------------------------------

    def _paused(self) -> bool:
        if self._off > 0:
            self._off -= 1
            return True
        return False

    def _curve(self) -> list[float]:
        if self._costs is None:
            self._costs = list(row_costs(self.target, MAX_ROWS)[0])
        return self._costs

    def _cost(self) -> float:
        """A pass of the full tree's rows in one-row steps."""
        curve = self._curve()
        rows = min(1 + self.window + self.candidates * (self.ngram - 1), len(curve))
        return curve[rows - 1] / curve[0]

    def _shape(self) -> None:
        """Left to choose: the largest tree (window + candidates x (n - 1) nodes, plus the root's
        row) whose pass costs at most 1 + :data:`ROW_SLACK` times a two-row pass (past the fixed
        cost of verifying anything, the rows that come nearly free), half of it the window."""
        if self._shaped:
            return
        self._shaped = True
        curve = self._curve()
        two = curve[1] if len(curve) > 1 else curve[0]
        rows = max((r for r in range(2, len(curve) + 1) if curve[r - 1] <= (1.0 + ROW_SLACK) * two), default=2)
        nodes = rows - 1
        self.window = max(1, (nodes + 1) // 2)
        self.candidates = (nodes - self.window) // (self.ngram - 1)

    def describe(self) -> dict:
        return {"name": self.name, "window": self.window, "ngram": self.ngram, "candidates": self.candidates,
                "pool": sum(len(v) for v in self.pool.values()), "steps": self.steps, "plain_steps": self.plain_steps}


def _create(target: CausalLM, draft: None, **options: Any) -> LookaheadDrafter:
    return LookaheadDrafter(target, **options)


def _tree(drafter: LookaheadDrafter, tree: Mapping[str, Any] | None) -> tuple[LookaheadDrafter, str]:
    """The Jacobi window and the pool's n-grams: the drafter proposes its trees itself, shaped by
    its own options (the config refuses tree options for it)."""
    return drafter, f"window={drafter.window}:ngram={drafter.ngram}:candidates={drafter.candidates}"


OPTIONS = (
    Option("drafter", "window", positive, "a positive integer", None,
           "--drafter lookahead: W, the guessed tokens of the Jacobi window (default: from measured costs)",
           "--lookahead-window"),
    Option("drafter", "ngram", integer_from(2), "an integer >= 2", None,
           "--drafter lookahead: n, the length of the n-grams pooled and verified (default: 4)",
           "--lookahead-ngram"),
    Option("drafter", "candidates", integer_from(0), "an integer >= 0", None,
           "--drafter lookahead: G, the pooled n-grams verified per step (default: from measured costs)",
           "--lookahead-candidates"),
)

# Its trees are its own, shaped by its options alone: it takes no tree option.
SPEC = DrafterSpec(name="lookahead", create=_create, options=OPTIONS, trees="only", tree=_tree, cls=LookaheadDrafter,
                   tree_keys=())
