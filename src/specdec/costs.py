"""What a target forward of n new rows costs on this machine, measured once and cached.

The planner (:mod:`specdec.policies.auto`) weighs expected tokens against these curves, a Sequoia
tree's budget is chosen on them (:func:`specdec.sequoia.sequoia_budget`) and lookahead decoding
sizes its window by them: a :class:`CostModel` holds the seconds of a pass of 1..n rows (and a
draft model's per-token and catch-up costs), :func:`measure_rows` times them, and
:func:`row_costs` reads them from the cache (keyed by :func:`~specdec.measurements.cost_key`:
machine, backend, model, dtype, threads) or measures and writes them.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

try:
    import fcntl
except ImportError:  # not on Windows: measurements there are not serialized
    fcntl = None  # type: ignore[assignment]

import torch

from specdec.backends.gguf import MAX_PASS_ROWS
from specdec.measurements import cache_file, cost_key
from specdec.paths import load_measurement, save_measurement

# The longest verify pass measured: the default k_max (drafters.base.DEFAULT_K_MAX, 16) drafts and
# the pass's own row. Measured, not extrapolated: on the GGUF kernel a pass of more than 16 rows
# decodes each weight block again for the rows past the 16th, so the 17th row costs about three
# times the one before it (docs/server.md, "How many rows a pass carries").
MAX_ROWS = 17
GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 17)  # row counts timed; the rest interpolated
REPEATS = (3, 7)  # sweeps of the grid: 3, or up to 7 while within MEASURE_SECONDS (1 if one takes longer)
MEASURE_SECONDS = 4.0
DUMMY_CONTEXT = 32  # tokens prefilled before timing, so the rows attend to a context
CACHE_FORMAT = 1  # bump when what is measured changes: older cache files are measured again
# Before any measurement (a policy or a tree never bound to its models): a verify row is assumed to
# cost a tenth of a one-row pass and drafting to be free; the planner learns both from the steps' timings.
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
    with _one_at_a_time(path):  # replicas started together on one machine measure in turn, the later ones read the cache
        saved = None if refresh else load_measurement(path, key, CACHE_FORMAT)
        if saved is not None:
            try:
                curve = [float(v) for v in saved["seconds"]]
                if len(curve) >= max_rows and all(v > 0 for v in curve):
                    return curve[:max_rows], "cache"
            except (KeyError, TypeError, ValueError):
                pass  # malformed: measure
        # a slot's passes are shared with other sequences' (specdec.backends.shared): time a pass of
        # its own, on a fresh cache of the same weights
        alone = model.fork() if getattr(model, "passes", None) is not None else model
        curve = measure_rows(alone, max_rows)
        if not plausible(curve):  # disturbed: measure again and keep each count's faster time
            again = measure_rows(alone, max_rows)
            curve = list(itertools.accumulate(map(min, curve, again), max))  # still non-decreasing
        if plausible(curve):  # a curve still disturbed serves this run, and is measured again next time
            save_measurement(path, {"format": CACHE_FORMAT, "key": key, "seconds": curve})
    return curve, "measured"


SLACK = 1.25  # how far past n one-row passes a measured pass of n rows may cost and still be believed


def plausible(curve: Sequence[float]) -> bool:
    """Whether a measured curve can be the machine's own: a pass of n rows never costs more than n
    one-row passes (``SLACK`` for timing noise), whatever the kernel. Other work on the machine
    during a measurement breaks that: two replicas measuring at once on 2 cores made a pass of 2
    rows cost 2.8 one-row passes, and a planner that believed it would never draft."""
    return all(seconds <= SLACK * n * curve[0] for n, seconds in enumerate(curve, start=1))


@contextlib.contextmanager
def _one_at_a_time(path: Path) -> Iterator[None]:
    """Hold an exclusive lock beside ``path`` (where file locks exist and the cache is writable)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def pass_costs(model: Any) -> list[float]:
    """Seconds of a pass of 1..MAX_PASS_ROWS rows on ``model``'s weights (:func:`row_costs`, the
    planner's measurement carried to the longest piece of a prompt): the curve the shared passes'
    budget is read from (:class:`specdec.backends.shared.SharedPasses`)."""
    return row_costs(model, MAX_PASS_ROWS)[0]
