"""The planner (``policy="auto"``): each step, draft the length -- 0 included -- that maximises
expected tokens per second on this machine, with these weights and this pair.

Whether speculation pays is a property of the machine: on a memory-bound backend (bf16 weights on
two cores) five verified rows cost about 1.2x one, and a draft chain gains; on a compute-bound one
(4-bit weights) every extra row costs about half a step, and a plain target step is fastest. So the
planner measures, once per machine, backend, model, dtype and thread count (:func:`cost_key`;
results cached as JSON under the cache directory), what a target forward of n new rows costs for
n = 1..16 and what a drafted token costs, and weighs those costs against running acceptance
estimates (:class:`~specdec.policies.AcceptanceEstimates`, shared with the ``theory`` policy).

The model of a step that drafts k tokens (k = 0: a plain target step of one row):

- cost T(k) = draft(k) + target(k + 1): k drafted tokens at the draft's per-token cost, then one
  verify pass of k + 1 rows at the measured curve. A draft model's token is measured like a
  target row; a drafter that runs some of the target's layers costs their share of a one-row
  pass; other drafters (n-gram lookup, heads) are taken as free.
- expected tokens E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j, where a_j is the measured chance that
  draft position j is accepted given the ones before it were. That is token verification's
  formula (Leviathan et al. 2023) with per-position rates. The rates are measured from the steps
  actually verified, so under block verification (Sun et al. 2024) they already hold its gain at
  the lengths drafted so far; block verification accepts at least what token verification does
  for every draft, so for other lengths E(k) is a lower bound.

Each step :meth:`AutoPolicy.plan` (through ``next_k``) takes the k in 0..k_max that maximises E(k)
/ T(k) (ties to the shorter). If that is 0 the step is a plain target step. Otherwise it returns a
cap (the longest draft that could pay if every token were as sure as the most confident calibration
bin) and ``keep_going`` decides token by token: after drafting token i, whose calibrated chance
(from the draft's own top probability) makes the whole draft so far survive with P_i, it drafts on
iff for some m > i the expected extra tokens P_i (a + a^2 + ... + a^(m-i)) pay for the extra time
T(m) - T(i) at the planned rate R* = E(k*) / T(k*) (the optimal-stopping rule for tokens per
second; a = the chance of token i: the next tokens are expected to be as predictable as this one).
With a cost curve that grows linearly that is the one-token test "P_i a >= R* (draft cost + one
more verify row)".

Where the draft's confidence is known before drafting -- the n-gram lookup's, from how far back
its match reaches (:func:`~specdec.drafters.ngram.lookup_confidence`; a
:class:`~specdec.drafters.choice.ChoiceDrafter` offers it with the lookup among its sources, and
:meth:`AutoPolicy.choose` weighs each source) -- every
a_j is that confidence's calibrated chance, the best k is the cap, and every token drafted is
calibrated at it: a long repeated passage is copied in one long draft, a short match's
continuation is drafted short or not at all.

The choice depends only on the cost curves (fixed once measured: the cache holds the measured
values) and on the outcomes of earlier steps, never on a step's own timing, so a seed still fixes
the output. (``adapt_costs=True`` also learns the draft's cost and a scale of the target curve
from the steps' timings -- closer to the truth as the context grows, but no longer reproducible.)

A draft model is fed only when it drafts, so after plain steps or steps drafted by the lookup its
cache lags behind the output (at its first draft, by the whole prompt): before its first draft
token it must feed those tokens (:meth:`~specdec.drafters.base.Drafter.behind`), a pass the
planner prices from the draft model's own cost curve. That catch-up serves every later step that
drafts from it, so a step is charged the share its expected tokens take of the tokens left to
generate: T(k) + C * E(k) / room. A draft model that does not pay per step is never caught up.

The same curves size two other shapes. A Sequoia tree (Chen et al. 2024; ``mode=sequoia`` without
a budget) holds the node budget n whose optimal tree (:mod:`specdec.sequoia`) has the most
expected tokens per second, (1 + E(n)) / (draft(n) + target(n + 1 rows)) (:func:`sequoia_budget`,
curves of up to :data:`SEQUOIA_ROWS` rows). The cascade drafter
(:mod:`specdec.drafters.cascade`) offers the lookup and its cascaded draft model as two sources,
weighed as for ``ngram+model``, its model tokens priced as full draft-model passes (an upper bound:
the vertical cascade saves some); where :meth:`AutoPolicy.keep_going` stops the draft model, the
lookup continues the chain for free (the horizontal cascade's switch position).

When no draft would pay even if it were always accepted, the planner never drafts and the output
is the target's own autoregressive chain. When a draft could pay but the estimates say it does
not, it drafts one token -- a probe, so the estimates can recover when the text becomes
predictable -- once the plain steps since the last probe have taken 1 / :data:`PROBE_SHARE` times
what the probe costs beyond a plain step (its draft token, its verify row and any catch-up): the
probes cost at most that share of the time. With a draft model that lags by a whole prompt, that
is hundreds of steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from specdec.drafters.base import DraftCost, Drafter
from specdec.measurements import cache_file, cost_key
from specdec.paths import load_measurement, save_measurement
from specdec.policies.base import DEFAULT_K_MAX, DraftLengthPolicy, Plan, check_k
from specdec.policies.estimates import AcceptanceEstimates
from specdec.sequoia import optimal_trees
from specdec.stats import Step

MAX_ROWS = 16  # the longest verify pass measured (k_max drafts + 1)
GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)  # row counts timed; the rest interpolated
REPEATS = (3, 7)  # sweeps of the grid: 3, or up to 7 while within MEASURE_SECONDS (1 if one takes longer)
MEASURE_SECONDS = 4.0
DUMMY_CONTEXT = 32  # tokens prefilled before timing, so the rows attend to a context
PROBE_SHARE = 0.03  # the most of the plain steps' time one-token probes may cost (see the module doc)
# Where the planner chooses between drafters, a free one (a lookup: its draft costs nothing, but it
# can draft only where the context repeats) is explored: until its first token has been tested
# EXPLORE_TESTS times, a step where it can draft and a full acceptance would pay drafts up to
# EXPLORE_LENGTH tokens, whatever the prior says.
EXPLORE_TESTS = 3
EXPLORE_LENGTH = 2
CACHE_FORMAT = 1  # bump when what is measured changes: older cache files are measured again
# Before any measurement (a policy never bound to its models): a verify row is assumed to cost a
# tenth of a one-row pass and drafting to be free; both are learnt from the steps' timings.
ASSUMED_ROW_COST = 0.1


@dataclass
class CostModel:
    """What a step costs. target[n - 1]: seconds for a target forward of n new rows (logits for
    all n); draft: seconds per drafted token (None: not known yet); draft_rows[n - 1]: seconds for
    a draft model's pass of n rows, what catching it up costs (None: no catch-up is priced).
    source says where they came from."""

    target: list[float]
    draft: float | None = None
    source: str = "injected"
    draft_source: str = "injected"
    draft_rows: list[float] | None = None

    def __post_init__(self) -> None:
        if not self.target or any(not t > 0 for t in self.target):
            raise ValueError(f"the target cost curve must be positive seconds for 1..n rows, got {self.target!r}")
        if self.draft is not None and not self.draft >= 0:
            raise ValueError(f"the draft cost must be seconds >= 0 per token, got {self.draft!r}")

    def target_cost(self, rows: int) -> float:
        """Seconds for ``rows`` new rows; past the curve, extended along its last segment."""
        t = self.target
        if rows <= len(t):
            return t[rows - 1]
        slope = t[-1] - t[-2] if len(t) > 1 else t[-1]
        return t[-1] + slope * (rows - len(t))

    def relative(self, rows: int) -> float:
        """A ``rows``-row pass in units of a one-row pass."""
        return self.target_cost(rows) / self.target[0]


@dataclass
class _Source:
    """One drafter the planner may draft from: its acceptance estimates and its cost per token."""

    acceptance: AcceptanceEstimates
    draft: float | None  # seconds per drafted token; None: the CostModel's draft cost
    label: str = ""  # where that cost came from
    chosen: int = 0  # steps this drafter was planned to draft in
    rows: CostModel | None = None  # a draft model's passes of n rows: what catching it up costs


# ------------------------------------------------------------------------------------------------
# Measuring, and the cache


def measure_rows(model: Any, max_rows: int = MAX_ROWS, *, repeats: tuple[int, int] = REPEATS) -> list[float]:
    """Seconds of a forward pass of n new rows, logits for all n, for n = 1..max_rows.

    Times the row counts of :data:`GRID` after a short dummy context in sweeps over the grid (so
    drift hits every n alike; ``repeats[0]`` sweeps, more up to ``repeats[1]`` while within
    :data:`MEASURE_SECONDS`, fewer (at least one) where a sweep takes a large part of it), keeps each count's fastest time (other work on the machine
    only ever adds time, and a median of a few is still thrown by it: on a loaded 2-core machine
    the medians of three were out by 10x), interpolates the other counts and makes the curve
    non-decreasing. The cache is rolled back by absolute length: what ``model`` held before is
    untouched, nothing after it is kept.
    """
    saved = len(model.tokens)
    room = (model.max_context - saved) if model.max_context is not None else DUMMY_CONTEXT + max_rows
    max_rows = max(1, min(max_rows, room - 1))
    vocab = model.vocab_size
    ids = [(17 + 7919 * i) % vocab for i in range(DUMMY_CONTEXT + max_rows)]
    context, rows = ids[: max(0, min(DUMMY_CONTEXT, room - max_rows))], ids[DUMMY_CONTEXT:]
    grid = sorted({n for n in GRID if n < max_rows} | {max_rows})
    times: dict[int, list[float]] = {n: [] for n in grid}
    try:
        if context:
            model.forward(context, num_logits=1)
        base = saved + len(context)
        model.forward(rows[:1], num_logits=1)  # warm-up
        model.trim(base)
        began = time.perf_counter()
        for sweep in range(repeats[1]):
            projected = (time.perf_counter() - began) * (sweep + 1) / max(sweep, 1)  # after one more sweep
            if sweep > 0 and projected > (2 if sweep < repeats[0] else 1) * MEASURE_SECONDS:
                break  # the first repeats[0] sweeps may take twice the budget, later ones only the budget
            for n in grid:
                t0 = time.perf_counter()
                model.forward(rows[:n], num_logits=n)
                times[n].append(time.perf_counter() - t0)
                model.trim(base)
    finally:
        model.trim(saved)
    fastest = [min(times[n]) for n in grid]
    curve = [float(v) for v in torch.tensor(_interpolate(grid, fastest, max_rows)).cummax(0).values]
    return [max(v, 1e-9) for v in curve]


def _interpolate(xs: Sequence[int], ys: Sequence[float], n: int) -> list[float]:
    """Piecewise-linear values at 1..n from points (xs ascending, xs[0] = 1, xs[-1] = n)."""
    out = []
    for x in range(1, n + 1):
        j = next(i for i, v in enumerate(xs) if v >= x)
        if xs[j] == x:
            out.append(ys[j])
        else:
            w = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
            out.append(ys[j - 1] + w * (ys[j] - ys[j - 1]))
    return out


def row_costs(model: Any, max_rows: int = MAX_ROWS, *, cache_dir: str | Path | None = None,
              refresh: bool = False) -> tuple[list[float], str]:
    """``model``'s cost curve for 1..max_rows rows and where it came from (``cache`` or ``measured``).

    Reads the cache file for :func:`cost_key` when it holds a curve at least that long (and
    ``refresh`` is false); otherwise measures with :func:`measure_rows` and writes it (atomically;
    an unwritable cache only costs the measurement next time).
    """
    key = cost_key(model)
    path = cache_file(key, cache_dir)
    saved = None if refresh else load_measurement(path, key, CACHE_FORMAT)
    if saved is not None:
        try:
            curve = [float(v) for v in saved["seconds"]]
            if len(curve) >= max_rows and all(v > 0 for v in curve):
                return curve[:max_rows], "cache"
        except (KeyError, TypeError, ValueError):
            pass  # malformed: measure
    curve = measure_rows(model, max_rows)
    save_measurement(path, {"format": CACHE_FORMAT, "key": key, "seconds": curve})
    return curve, "measured"


# ------------------------------------------------------------------------------------------------
# The policy


def best_length(alphas: Sequence[float], times: Sequence[float]) -> tuple[int, float, float]:
    """(k, E(k), E(k) / times[k]) for the k in 0..len(times) - 1 with the most expected tokens per
    second (ties to the shorter). alphas[j]: the chance draft token j is accepted given the ones
    before it were; times[k]: the seconds of a step that drafts k tokens."""
    best = (0, 1.0, 1.0 / times[0])
    expected, reach = 1.0, 1.0
    for k in range(1, len(times)):
        reach *= alphas[k - 1]
        expected += reach
        rate = expected / times[k]
        if rate > best[2] * (1.0 + 1e-12):
            best = (k, expected, rate)
    return best


# The most nodes a Sequoia tree whose budget the cost curves choose may hold, and the rows of the
# curves measured for it (its verify pass scores the root and every node).
SEQUOIA_MAX_BUDGET = 31
SEQUOIA_ROWS = SEQUOIA_MAX_BUDGET + 1


def tree_draft_cost(choices: Sequence[tuple[int, ...]], draft: CostModel | None) -> float:
    """Seconds a draft model with the cost curve ``draft`` (None: a free drafter) takes to draft
    the static tree ``choices`` as :class:`~specdec.drafters.tree.TreeDrafter` does: a one-row
    pass after the context, then one pass per level over that level's nodes that have children."""
    if draft is None or not choices:
        return 0.0
    parents: dict[int, set[tuple[int, ...]]] = {}
    for path in choices:
        if len(path) > 1:
            parents.setdefault(len(path) - 1, set()).add(path[:-1])
    return draft.target_cost(1) + sum(draft.target_cost(len(nodes)) for nodes in parents.values())


def sequoia_budget(
    p: Sequence[float], costs: CostModel, *, max_budget: int = SEQUOIA_MAX_BUDGET, depth: int | None = None,
) -> tuple[tuple[tuple[int, ...], ...], float, float]:
    """The hardware-aware Sequoia tree (Chen et al. 2024): among the optimal trees of every budget
    n = 1..max_budget for the positional acceptance vector ``p`` (:func:`specdec.sequoia.optimal_trees`),
    the one with the most expected tokens per second, (1 + E(n)) / (draft(n) + target(n + 1 rows)):
    the target's pass from ``costs.target``, the draft's level passes from ``costs.draft_rows``
    (:func:`tree_draft_cost`; None: drafting taken as free). Ties go to the smaller tree.
    Returns (its choices, 1 + E, expected tokens per second)."""
    draft = CostModel(costs.draft_rows) if costs.draft_rows else None
    best: tuple[tuple[tuple[int, ...], ...], float, float] = ((), 1.0, 0.0)
    for choices, value in optimal_trees(p, max_budget, depth)[1:]:
        if not choices:
            continue
        rate = (1.0 + value) / (tree_draft_cost(choices, draft) + costs.target_cost(len(choices) + 1))
        if rate > best[2] * (1.0 + 1e-12):
            best = (choices, 1.0 + value, rate)
    return best


class AutoPolicy(DraftLengthPolicy):
    """Draft the length (0 included) with the most expected tokens per second; see the module doc.

    costs: a :class:`CostModel` to use instead of measuring (tests inject curves). Without it,
    :meth:`bind` measures the target's rows and the draft model's token (or reads them from the
    cache), and a policy never bound assumes a row costs :data:`ASSUMED_ROW_COST` of a pass.
    adapt_costs: learn the draft's seconds per token and a scale of the target curve from the
    steps' timings (off by default: the choices, and so a seeded output, would then depend on
    timing noise). The acceptance estimates
    (per position, per confidence level) are :class:`~specdec.policies.AcceptanceEstimates`.
    """

    name = "auto"

    def __init__(
        self,
        k_max: int = DEFAULT_K_MAX,
        *,
        costs: CostModel | None = None,
        adapt_costs: bool = False,
        decay: float = 0.95,
        prior_alpha: float = 0.6,
        prior_weight: float = 2.0,
        cache_dir: str | Path | None = None,
    ) -> None:
        check_k(k_max)
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.k_max = k_max
        self.costs = costs
        self.adapt_costs = adapt_costs
        self.decay = decay
        self.cache_dir = cache_dir
        self._estimates = dict(decay=decay, prior_alpha=prior_alpha, prior_weight=prior_weight, positions=k_max)
        # The drafters it plans for: one ("draft"), or each choice of a drafter that offers several
        # (a ChoiceDrafter: the n-gram lookup and the draft model), each with its own estimates.
        self._sources: dict[str, _Source] = {"draft": _Source(AcceptanceEstimates(**self._estimates), None)}
        self._current = "draft"
        self._foreseen: float | None = None  # this step's draft confidence where known before drafting
        self._choosing = False  # bound to a drafter that asks choose() which of its drafters to use
        # adapt_costs: decayed sums of draft seconds and tokens, verify seconds and the curve's prediction.
        self._draft_seconds = self._drafted = self._verify_seconds = self._verify_predicted = 0.0
        self._times: list[float] = []  # this step's T(0..k_max)
        self._rate = 0.0  # R*: the planned tokens per second this step's drafting must beat
        self._cap = 0
        self._reach = 1.0
        self._drafted_now = 0
        self._plain_time = 0.0  # planned seconds of the plain steps since the last draft
        self._behind: dict[str, int] = {}  # this step's catch-up per source (see plan)
        self._room: int | None = None
        self._last_drafted = 0
        self._steps = self._probes = 0
        self._planned: dict[int, int] = {}
        self._drafted_hist: dict[int, int] = {}
        self._reasons: dict[int, str] = {}

    @property
    def acceptance(self) -> AcceptanceEstimates:
        """The running acceptance estimates of the drafter this step drafts from."""
        return self._sources[self._current].acceptance

    def bind(self, target: Any, drafter: Drafter) -> None:
        """Measure, or read from the cache, the target's cost per 1..16 rows and each of the
        drafter's sources' cost per token (:meth:`~specdec.drafters.base.Drafter.costs`; see the
        module doc). Done once; injected costs stay. A drafter with several sources (a
        :class:`~specdec.drafters.choice.ChoiceDrafter`) makes the planner choose the source as
        well as the length each step, each source with its own costs and estimates."""
        costs = drafter.costs()
        injected = self.costs is not None
        if not injected:
            curve, source = row_costs(target, MAX_ROWS, cache_dir=self.cache_dir)
            draft, draft_source, rows = self._draft_cost(next(iter(costs.values())), curve[0])
            self.costs = CostModel(curve, draft, source, draft_source, rows.target if rows is not None else None)
        if self.costs.draft_rows and any(cost.model is not None for cost in costs.values()):
            self._sources["draft"].rows = CostModel(self.costs.draft_rows)
        if len(costs) > 1:
            self._sources = {name: _Source(AcceptanceEstimates(**self._estimates), None) for name in costs}
            for name, cost in costs.items():
                entry = self._sources[name]
                if cost.model is not None and injected:
                    entry.draft, entry.label = self.costs.draft or 0.0, self.costs.draft_source
                    entry.rows = CostModel(self.costs.draft_rows) if self.costs.draft_rows else None
                else:
                    entry.draft, entry.label, entry.rows = self._draft_cost(cost, self.costs.target[0])
            self._current, self._choosing = next(iter(costs)), True

    def _draft_cost(self, cost: DraftCost, one_row: float) -> tuple[float, str, CostModel | None]:
        """(seconds per drafted token, where that came from, a draft model's cost curve) for one source."""
        if cost.model is not None:
            curve, source = row_costs(cost.model, MAX_ROWS, cache_dir=self.cache_dir)
            return curve[0], "measured", CostModel(curve, source=source)
        if cost.layers and cost.of:
            return one_row * cost.layers / cost.of, f"{cost.layers} of {cost.of} target layers", None
        return 0.0, "taken as free", None

    def _ensure_costs(self) -> CostModel:
        if self.costs is None:  # never bound: an assumed curve in units of a one-row pass
            curve = [1.0 + ASSUMED_ROW_COST * n for n in range(MAX_ROWS)]
            self.costs = CostModel(curve, 0.0, "assumed (not measured)", "taken as free")
        return self.costs

    @property
    def draft_cost(self) -> float:
        """Seconds per drafted token: learnt from the steps once there are some, else the measured one."""
        if self.adapt_costs and self._drafted > 0 and not self._choosing:
            return self._draft_seconds / self._drafted
        own = self._sources[self._current].draft
        return own if own is not None else (self._ensure_costs().draft or 0.0)

    @property
    def scale(self) -> float:
        """Verify seconds the steps took over what the curve predicted for them (1 before any)."""
        if self.adapt_costs and self._verify_predicted > 0:
            return self._verify_seconds / self._verify_predicted
        return 1.0

    def step_times(self) -> list[float]:
        """T(k) for k = 0..k_max: k drafted tokens and a verify pass of k + 1 rows, in seconds."""
        costs, d, s = self._ensure_costs(), self.draft_cost, self.scale
        return [k * d + s * costs.target_cost(k + 1) for k in range(self.k_max + 1)]

    def catch_up(self) -> float:
        """Seconds the current source needs before its first draft token: a draft model feeding
        the tokens it is behind by (:meth:`~specdec.drafters.base.Drafter.behind`), priced from
        its cost curve beyond the one row every draft feeds; 0 for other sources."""
        source = self._sources[self._current]
        lag = self._behind.get(self._current, 0) if self._choosing else sum(self._behind.values())
        if lag <= 0 or source.rows is None:
            return 0.0
        curve = source.rows.target  # past it, a long pass is priced at the longest measured pass's cost per row
        rows = lag + 1
        return (curve[rows - 1] if rows <= len(curve) else curve[-1] * rows / len(curve)) - curve[0]

    def _charged(self, times: list[float], alphas: Sequence[float]) -> list[float]:
        """T(k) plus the catch-up's share for k >= 1: C * E(k) / room (see the module doc)."""
        catch_up = self.catch_up()
        if catch_up == 0.0:
            return times
        room = max(self._room if self._room is not None else 1, 1)
        out, expected, reach = [times[0]], 1.0, 1.0
        for k in range(1, len(times)):
            reach *= alphas[k - 1]
            expected += reach
            out.append(times[k] + catch_up * min(expected / room, 1.0))
        return out

    def plan(self, sources: Mapping[str, float | None], behind: Mapping[str, int] | None = None,
             room: int | None = None) -> Plan:
        """This step's source and length: with one source, :meth:`next_k`; with several,
        :meth:`choose` weighs every source offered now. ``behind`` and ``room`` price a draft
        model's catch-up (see the module doc)."""
        self._behind, self._room = dict(behind or {}), room
        k = self.next_k()
        if self._choosing:
            source, k = self.choose(sources)
            return Plan(source, k, self.keep_going)
        return Plan(next(iter(sources)), k, self.keep_going)

    def next_k(self) -> int:
        self._foreseen = None
        if self._choosing:  # the source is not known yet: choose() plans once it is
            self._reach, self._drafted_now, self._cap = 1.0, 0, 0
            return self.k_max
        return self._plan()

    def choose(self, available: Mapping[str, float | None]) -> tuple[str, int]:
        """Which of ``available`` (the drafter's sources that can draft now, in its order of
        preference, each with its draft's confidence where that is known before drafting) to
        draft from, and at most how many tokens: the one whose best length has the most expected
        tokens per second (ties to the earlier)."""
        best, best_rate = next(iter(available)), -1.0
        for name, sure in available.items():
            self._current = name
            alphas = self._alphas(sure)
            rate = best_length(alphas, self._charged(self.step_times(), alphas))[2]
            if rate > best_rate * (1.0 + 1e-12):
                best, best_rate = name, rate
        self._current, self._foreseen = best, available[best]
        cap = self._plan()
        self._sources[best].chosen += cap > 0
        return best, cap

    def _alphas(self, sure: float | None) -> list[float]:
        """The chance of each draft position given the ones before it were accepted: where the
        draft's confidence is known before drafting (a lookup's match), the calibrated chance of
        such a draft's first token, then of each token after an accepted one; else the
        per-position estimates."""
        if sure is None:
            return self.acceptance.position_alphas(self.k_max)
        rest = min(self.acceptance.accept_chance(sure), 0.999)
        return [min(self.acceptance.lead_chance(sure), 0.999)] + [rest] * (self.k_max - 1)

    def _plan(self) -> int:
        """Plan this step for the current drafter: the cap ``keep_going`` drafts up to (0: plain)."""
        self.acceptance.start_step()
        self._reach, self._drafted_now = 1.0, 0
        alphas, plain = self._alphas(self._foreseen), self.step_times()
        self._times = times = self._charged(plain, alphas)
        k, expected, rate = best_length(alphas, times)
        could = best_length([0.999] * self.k_max, plain)[0]  # a draft accepted in full, caught up
        probe = plain[1] - plain[0] + self.catch_up()  # a probe's cost beyond a plain step
        if k == 0 and could > 0 and self._exploring():
            self._cap, self._rate = min(could, EXPLORE_LENGTH), 1.0 / times[0]
            self._probes += 1
            self._reasons[0] = self._named(f"exploring: drafting up to {self._cap} tokens to learn how often they are accepted")
        elif k == 0 and could > 0 and self._plain_time * PROBE_SHARE >= probe:
            self._cap, self._rate = 1, 1.0 / times[0]  # one token at the plain rate: never more
            self._probes += 1
        elif k == 0:
            self._cap = 0
            self._reasons[0] = self._named(self._why_not(could == 0, alphas[0]))
        else:  # the cap; where every token's confidence is foreseen, the planned length itself
            top = k if self._foreseen is not None else best_length([self.acceptance.top_chance()] * self.k_max,
                                                                  times)[0]
            self._cap, self._rate = max(k, top), rate
            self._reasons[k] = self._named(self._why(k, expected, alphas[0]))
        self._plain_time = self._plain_time + times[0] if self._cap == 0 else 0.0
        self._planned[k] = self._planned.get(k, 0) + 1
        return self._cap

    def _exploring(self) -> bool:
        """Whether this step explores the current drafter (see :data:`EXPLORE_TESTS`)."""
        source = self._sources[self._current]
        return self._choosing and source.draft == 0.0 and source.acceptance.tested(0) < EXPLORE_TESTS

    def _named(self, reason: str) -> str:
        """A reason, naming the drafter it was weighed for where the planner chooses drafters."""
        return f"{self._current} drafter, {reason}" if self._choosing else reason

    def _ratios(self) -> tuple[float, float]:
        """(a 2-row pass, a draft token) in units of a one-row pass."""
        one = self.scale * self._ensure_costs().target_cost(1)
        return self._ensure_costs().relative(2), self.draft_cost / one

    def _why_not(self, never: bool, alpha: float) -> str:
        rows, draft = self._ratios()
        if never:
            return (f"k=0: even a draft accepted in full does not pay: a 2-row pass costs {rows:.2f}x "
                    f"a 1-row one and a draft token {draft:.2f}x")
        return (f"k=0: a 2-row pass costs {rows:.2f}x a 1-row one, a draft token {draft:.2f}x, "
                f"and alpha={alpha:.2f} does not pay for it")

    def _why(self, k: int, expected: float, alpha: float) -> str:
        rows, draft = self._ratios()
        gain = expected / self._times[k] * self._times[0]
        return (f"k={k}: {expected:.2f} expected tokens for {self._times[k] / self._times[0]:.2f}x a plain "
                f"step, {gain:.2f}x its tokens per second (alpha={alpha:.2f}; a 2-row pass costs {rows:.2f}x "
                f"a 1-row one, a draft token {draft:.2f}x)")

    def keep_going(self, q: torch.Tensor) -> bool:
        if self._foreseen is not None:  # planned knowing every token's confidence: draft to the cap
            return True
        chance = self.acceptance.see(float(q.max()))
        self._drafted_now += 1
        i = self._drafted_now
        self._reach *= chance
        gain, reach = 0.0, self._reach
        for m in range(i + 1, min(self._cap, len(self._times) - 1) + 1):
            reach *= chance  # the next tokens are expected to be as predictable as this one
            gain += reach
            extra = self._times[m] - self._times[i]
            if extra <= 0.0 or gain >= self._rate * extra:
                return True
        return False

    def update(self, step: Step) -> None:
        first = self._steps == 0
        self._steps += 1
        self.acceptance.record(step, self._foreseen)
        self._drafted_hist[step.drafted] = self._drafted_hist.get(step.drafted, 0) + 1
        if self.adapt_costs and not first:  # the first step's timings include the prompt's prefill
            d = self.decay
            # A draft after a plain step also catches the draft model up on the tokens it missed.
            if step.drafted > 0 and self._last_drafted > 0:
                self._draft_seconds = d * self._draft_seconds + step.draft_seconds
                self._drafted = d * self._drafted + step.drafted
            self._verify_seconds = d * self._verify_seconds + step.verify_seconds
            self._verify_predicted = d * self._verify_predicted + self._ensure_costs().target_cost(step.drafted + 1)
        self._last_drafted = step.drafted

    def describe(self) -> dict:
        costs = self._ensure_costs()
        common = max(self._planned, key=lambda k: (self._planned[k], -k)) if self._planned else None
        return {
            "name": self.name,
            "k_max": self.k_max,
            "costs": {
                "source": costs.source,
                "target_ms": [round(1000 * costs.target_cost(n), 3) for n in range(1, MAX_ROWS + 1)],
                "draft_ms_per_token": round(1000 * self.draft_cost, 3),
                "draft_source": costs.draft_source if not (self.adapt_costs and self._drafted > 0) else "learnt online",
                "verify_scale": round(self.scale, 3),
            },
            "alpha": self.acceptance.alpha,
            "alpha_by_position": [round(a, 3) for a in self.acceptance.position_alphas(self.k_max)],
            "calibration": self.acceptance.calibration(),
            **({"drafters": {
                name: {"draft_ms_per_token": round(1000 * (e.draft or 0.0), 3), "draft_source": e.label,
                       "steps": e.chosen, "alpha": e.acceptance.alpha,
                       "calibration": e.acceptance.calibration(),
                       "first_token_calibration": e.acceptance.lead_calibration(),
                       "alpha_by_position": [round(a, 3) for a in e.acceptance.position_alphas(self.k_max)]}
                for name, e in self._sources.items()}} if self._choosing else {}),
            "planned": {str(k): n for k, n in sorted(self._planned.items())},
            "drafted": {str(k): n for k, n in sorted(self._drafted_hist.items())},
            "reasons": {str(k): r for k, r in sorted(self._reasons.items())},
            "reason": self._reasons.get(common, "no step planned yet"),
            "probes": self._probes,
            "steps": self._steps,
        }


def summary_line(state: dict) -> str:
    """One line from :meth:`AutoPolicy.describe`: what it drafted, the costs it used, and why."""
    costs = state["costs"]
    ms = costs["target_ms"]
    drafted = ", ".join(f"k={k} x{n}" for k, n in state["drafted"].items()) or "no steps"
    if "drafters" in state:  # a choice of drafters: how often each drafted, at what cost and alpha
        drafted += " (" + ", ".join(
            f"{name} {d['steps']} steps, {d['draft_ms_per_token']:.1f} ms/token, alpha {d['alpha']:.2f}"
            for name, d in state["drafters"].items()) + ")"
    curve = ", ".join(f"{n} rows {ms[n - 1] / ms[0]:.2f}x" for n in (2, 4, 8, 16) if n <= len(ms))
    scale = costs["verify_scale"]
    steps = f", verify steps take {scale:.2f}x that" if abs(scale - 1.0) > 0.005 else ""
    draft = "" if "drafters" in state else (
        f"draft {costs['draft_ms_per_token']:.1f} ms/token ({costs['draft_source']}); alpha {state['alpha']:.2f}; ")
    return (f"planner: drafted {drafted}; target pass {ms[0]:.1f} ms for 1 row{steps}, {curve} ({costs['source']}); "
            f"{draft}{state['reason']}")
