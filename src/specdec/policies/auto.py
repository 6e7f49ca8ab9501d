"""The planner (``policy="auto"``): each step, draft the length -- 0 included -- that maximises
expected tokens per second on this machine, with these weights and this pair.

:meth:`AutoPolicy.plan` weighs expected tokens E(k) = 1 + sum_i prod_{j<=i} a_j (per-position
acceptance rates, :class:`~specdec.policies.AcceptanceEstimates`) against the step's cost T(k) =
draft(k) + target(k + 1 rows) on the curves :mod:`specdec.costs` measures once per
machine, backend, model, dtype and thread count; ``keep_going`` stops a draft token by token
(optimal stopping at the planned rate); a draft model's catch-up is charged to the steps it
serves; probes cost at most :data:`PROBE_SHARE` of the plain steps' time; the same curves size a
Sequoia tree (:func:`specdec.sequoia.sequoia_budget`) and weigh the cascade's two sources. The whole model of a
step, and why each choice is exact (it never depends on a step's own timing), is in
docs/theory.md, "The planner's model of a step".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from specdec.drafters.base import DEFAULT_K_MAX, DraftCost, Drafter
from specdec.policies.base import DraftLengthPolicy, Plan, check_k
from specdec.costs import ASSUMED_ROW_COST, MAX_ROWS, CostModel, row_costs
from specdec.policies.estimates import AcceptanceEstimates
from specdec.stats import Step

PROBE_SHARE = 0.03  # the most of the plain steps' time one-token probes may cost (docs/theory.md, "The planner's model of a step")
# Where the planner chooses between drafters, a free one (a lookup: its draft costs nothing, but it
# can draft only where the context repeats) is explored: until its first token has been tested
# EXPLORE_TESTS times, a step where it can draft and a full acceptance would pay drafts up to
# EXPLORE_LENGTH tokens, whatever the prior says.
EXPLORE_TESTS = 3
EXPLORE_LENGTH = 2


@dataclass
class _Source:
    """One drafter the planner may draft from: its acceptance estimates and its cost per token."""

    acceptance: AcceptanceEstimates
    draft: float | None  # seconds per drafted token; None: the CostModel's draft cost
    label: str = ""  # where that cost came from
    chosen: int = 0  # steps this drafter was planned to draft in
    rows: CostModel | None = None  # a draft model's passes of n rows: what catching it up costs


# ------------------------------------------------------------------------------------------------
# The policy


def best_length(alphas: Sequence[float], times: Sequence[float], others: float = 0.0) -> tuple[int, float, float]:
    """(k, E(k), (others + E(k)) / times[k]) for the k in 0..len(times) - 1 with the most expected
    tokens per second (ties to the shorter). alphas[j]: the chance draft token j is accepted given
    the ones before it were; times[k]: the seconds of a step that drafts k tokens; ``others``: the
    tokens other sequences expect from the same pass (a shared pass: the rate weighed is the pass's)."""
    best = (0, 1.0, (others + 1.0) / times[0])
    expected, reach = 1.0, 1.0
    for k in range(1, len(times)):
        reach *= alphas[k - 1]
        expected += reach
        rate = (others + expected) / times[k]
        if rate > best[2] * (1.0 + 1e-12):
            best = (k, expected, rate)
    return best


class AutoPolicy(DraftLengthPolicy):
    """Draft the length (0 included) with the most expected tokens per second; see docs/theory.md, "The planner's model of a step".

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
        # A slot of a pool (specdec.serving): its seat on the pool's board, where its plans go, and
        # what the other slots posted for this step's pass (rows, expected tokens, slots drafting).
        self._seat: Any = None
        self._others: tuple[int, float, int] = (0, 0.0, 0)
        self._shared_steps = 0
        self._shared_rows = 0

    @property
    def acceptance(self) -> AcceptanceEstimates:
        """The running acceptance estimates of the drafter this step drafts from."""
        return self._sources[self._current].acceptance

    def bind(self, target: Any, drafter: Drafter, seat: Any = None) -> None:
        """Measure, or read from the cache, the target's cost per 1..16 rows and each of the
        drafter's sources' cost per token (:meth:`~specdec.drafters.base.Drafter.costs`; see the
        planner's model in docs/theory.md). Done once; injected costs stay. A drafter with several sources (a
        :class:`~specdec.drafters.choice.ChoiceDrafter`) makes the planner choose the source as
        well as the length each step, each source with its own costs and estimates. ``seat``: the
        slot's :class:`~specdec.serving.board.Seat` where its passes are shared with other
        sequences: each step's plan is posted there, and weighed against the other seats' plans."""
        costs = drafter.costs()
        self._seat = seat
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
        """T(k) for k = 0..k_max: k drafted tokens and a verify pass of k + 1 rows, in seconds; in a
        shared pass, the pass with the other slots' rows, and a draft token at its marginal cost in
        a draft pass the other drafting slots share (docs/theory.md, "The planner's model of a step")."""
        costs, d, s = self._ensure_costs(), self.draft_cost, self.scale
        rows, _, drafting = self._others
        draft_rows = self._sources[self._current].rows
        if drafting and draft_rows is not None:
            d = draft_rows.target_cost(drafting + 1) - draft_rows.target_cost(drafting)
        return [k * d + s * costs.target_cost(rows + k + 1) for k in range(self.k_max + 1)]

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
        """T(k) plus the catch-up's share for k >= 1: C * E(k) / room (docs/theory.md, "The planner's model of a step")."""
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
        model's catch-up (docs/theory.md, "The planner's model of a step")."""
        self._behind, self._room = dict(behind or {}), room
        k = self.next_k()
        if self._choosing:
            source, k = self.choose(sources)
            return Plan(source, k, self.keep_going)
        return Plan(next(iter(sources)), k, self.keep_going)

    def next_k(self) -> int:
        self._foreseen = None
        self._others = self._seat.others() if self._seat is not None else (0, 0.0, 0)
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
            rate = best_length(alphas, self._charged(self.step_times(), alphas), self._others[1])[2]
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
        others = self._others[1]
        k, expected, rate = best_length(alphas, times, others)
        could = best_length([0.999] * self.k_max, plain, others)[0]  # a draft accepted in full, caught up
        probe = plain[1] - plain[0] + self.catch_up()  # a probe's cost beyond a plain step
        if k == 0 and could > 0 and self._exploring():
            self._cap, self._rate = min(could, EXPLORE_LENGTH), (others + 1.0) / times[0]
            self._probes += 1
            self._reasons[0] = self._named(f"exploring: drafting up to {self._cap} tokens to learn how often they are accepted")
        elif k == 0 and could > 0 and self._plain_time * PROBE_SHARE >= probe:
            self._cap, self._rate = 1, (others + 1.0) / times[0]  # one token at the plain rate: never more
            self._probes += 1
        elif k == 0:
            self._cap = 0
            self._reasons[0] = self._named(self._why_not(could == 0, alphas[0]))
        else:  # the cap; where every token's confidence is foreseen, the planned length itself
            top = k if self._foreseen is not None else best_length([self.acceptance.top_chance()] * self.k_max,
                                                                  times, others)[0]
            self._cap, self._rate = max(k, top), rate
            self._reasons[k] = self._named(self._why(k, expected, alphas[0]))
        self._plain_time = self._plain_time + times[0] if self._cap == 0 else 0.0
        self._planned[k] = self._planned.get(k, 0) + 1
        if self._seat is not None:
            self._seat.post(k + 1, expected)
            self._shared_steps += self._others[0] > 0
            self._shared_rows += self._others[0]
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
            predicted = self._ensure_costs().target_cost(self._others[0] + step.drafted + 1)
            self._verify_predicted = d * self._verify_predicted + predicted
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
            **({"shared_pass": {"steps_with_others": self._shared_steps,
                                "other_rows_per_step": round(self._shared_rows / max(self._steps, 1), 3)}}
               if self._seat is not None else {}),
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
