"""The figures of a :class:`~specdec.bench.runner.BenchRun`: per method, its speeds, acceptance and identity.

Definitions (per method, over all its timed runs):

- ``tokens_per_second``: total new tokens / total wall time; ``ms_per_token``: its inverse in ms.
- ``speedup_vs_ar``: tokens_per_second / ar's tokens_per_second, where ar is the target alone on
  the method's own backend (``ar`` on torch, ``ar:backend=llamacpp`` on llama.cpp; transformers'
  peers count as torch, llama.cpp's as llamacpp) -- the ratio of total time for the same tokens
  when the token counts are equal (they are when EOS is ignored).
  ``speedup_vs_ar_geomean``: geometric mean over prompts of the same ratio per prompt. Per prompt,
  with several repeats, the ratio is of the median of each run's tokens per second: a run slowed
  by other work on the machine (llama.cpp's spinning threads can take 50x longer when the cores
  are busy) moves a median of three or more runs little and a total a lot.
- ``speedup_vs_llamacpp_ar`` (when ``llamacpp-ar`` ran): the same ratio against the llama.cpp
  binding's own generation on the target's GGUF, whatever the method's backend; ``..._geomean`` and
  ``..._min`` over prompts, and ``..._by_set`` per prompt set (geometric means);
  ``decode_speedup_vs_llamacpp_ar``: the same for decoding alone (after the first step, below).
- ``decode_speedup_vs_ar``: the same ratio for decoding alone: each run's tokens and time after
  its first step (the first target forward, which prefills the prompt; for draft-model methods the
  draft's prefill comes before it). ``first_step_seconds``: the mean time to that point. With
  prompts of a few hundred tokens and 64 new ones, prefill is a large share of a run, and it is
  the same work with or without speculation (plus the draft's own prefill).
- ``mean_accepted_per_forward``: new tokens / target forward passes (1 for ar).
- ``acceptance_rate``: accepted draft tokens / drafted tokens. ``alpha``: accepted / (accepted +
  rejections), the per-token acceptance probability the closed forms assume (a step that keeps
  all its drafts has no rejection; ``acceptance_rate`` undercounts alpha because tokens after the
  first rejection are drafted but never tested).
- ``cost_ratio_c``: median time to draft one token / median time of one ar target step (prefill
  excluded). ``predicted_speedup``: :func:`specdec.theory.expected_speedup` of alpha, the mean
  number of drafts per step and c. ``verify_step_ratio``: median target step of the method /
  median ar step (what a k-token verification costs next to a 1-token step; the formula takes 1).
- ``identical_to_ar_fraction`` (greedy runs): the share of prompts whose output equals the same
  backend's ar token for token in every repeat. ``divergences``: for each run that differs, the
  first differing position, the two tokens, and the target's top-2 logit margin there as ar's
  pass and as the method's own pass computed it (see :mod:`specdec.divergence`): a margin
  near 0 is a near-tie that kernel rounding can flip, a wide one points at a verification bug.
  At a temperature above 0 the coupled methods (Gumbel-max sampler, same seed) must give one text
  on a backend: each that differs from the first coupled method of its backend (``base``) gets the
  same record, with the margins of the noised scores that chose the tokens.

Per request, for each method that sent the prompts' predicted outputs (``prediction=yes``,
:func:`prediction_figures`): every method's tokens per second on that prompt (the median over its
repeats), the prediction tokens the server drafted and kept (``accepted``) or drafted and did not
keep (``rejected``) as its usage counts them (means over the repeats), the time to the first token
and its share of the request (what the prompt's prefill takes), and whether the answer equals ar's
in every repeat (greedy runs); over the requests, the geometric mean of the method's tokens per
second against each other method's (against the same method without the prediction first).

For a token tree, drafted tokens are tree nodes and accepted ones the kept path, and no
prediction is made (the closed form is for a chain). Lossy methods carry ``exact: false`` and
are marked LOSSY in the table.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from typing import Any, Sequence

from specdec.backends.base import common_prefix_len
from specdec.bench.methods import MethodSpec
from specdec.bench.runner import BenchRun
from specdec.bench.sample import Sample, median
from specdec.theory import expected_speedup


def summarize(run: BenchRun) -> dict[str, dict[str, Any]]:
    """Per method name, the figures listed in the module docstring."""
    by_method: dict[str, list[Sample]] = defaultdict(list)
    for s in run.samples:
        by_method[s.method].append(s)
    summary = {}
    for method in run.methods:
        samples = by_method.get(method.name, [])
        ar = by_method.get(method.ar.name, [])
        ar_runs = {(s.prompt, s.repeat): s for s in ar}
        ar_step = median([s.step_seconds for s in ar if s.step_seconds is not None])
        summary[method.name] = _method_summary(method, samples, ar, ar_runs, _tps(ar), ar_step, run)
        decode, ar_decode = _decode_tps(samples), _decode_tps(ar)
        firsts = [s.first_step_seconds for s in samples if s.first_step_seconds is not None]
        summary[method.name].update(
            decode_tokens_per_second=decode,
            decode_speedup_vs_ar=decode / ar_decode if decode and ar_decode else None,
            first_step_seconds=statistics.fmean(firsts) if firsts and len(firsts) == len(samples) else None,
            divergences=[d for d in run.divergences if d["method"] == method.name],
        )
        summary[method.name].update(_against_llamacpp_ar(samples, by_method.get("llamacpp-ar", []), run))
    _compare_with_peers(run.methods, summary)
    return summary


def _against_llamacpp_ar(samples: Sequence[Sample], base: Sequence[Sample], run: BenchRun) -> dict[str, Any]:
    """Speed-ups against the llama.cpp binding's own generation: overall, per prompt and per prompt set."""
    mine, theirs = _tps(samples), _tps(base)
    decode, base_decode = _decode_tps(samples), _decode_tps(base)
    per_prompt = _per_prompt_ratios(samples, base)
    by_set: dict[str, list[float]] = defaultdict(list)
    for prompt, ratio in per_prompt.items():
        by_set[run.prompts[prompt].set].append(math.log(ratio))
    logs = [math.log(r) for r in per_prompt.values()]
    return {
        "speedup_vs_llamacpp_ar": mine / theirs if mine and theirs else None,
        "speedup_vs_llamacpp_ar_geomean": math.exp(statistics.fmean(logs)) if logs else None,
        "speedup_vs_llamacpp_ar_min": min(per_prompt.values()) if per_prompt else None,
        "speedup_vs_llamacpp_ar_by_set": {k: math.exp(statistics.fmean(v)) for k, v in by_set.items()} or None,
        "decode_speedup_vs_llamacpp_ar": decode / base_decode if decode and base_decode else None,
    }


def _per_prompt_ratios(samples: Sequence[Sample], base: Sequence[Sample]) -> dict[int, float]:
    """Per prompt index: the median over its repeats of a run's tokens per second / the same for ``base``."""
    ratios = {}
    for prompt in sorted({s.prompt for s in samples}):
        mine = _median_tps([s for s in samples if s.prompt == prompt])
        theirs = _median_tps([s for s in base if s.prompt == prompt])
        if mine > 0 and theirs > 0:
            ratios[prompt] = mine / theirs
    return ratios


def _method_summary(method, samples, ar, ar_runs, ar_tps, ar_step, run) -> dict[str, Any]:
    tokens = sum(s.new_tokens for s in samples)
    seconds = sum(s.seconds for s in samples)
    forwards = sum(s.target_forwards for s in samples)
    tps = tokens / seconds if seconds > 0 else 0.0
    out: dict[str, Any] = {
        "kind": "peer" if method.is_peer else "project",
        "exact": method.exact,
        "spec": method.record(),
        "runs": len(samples),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tps,
        "ms_per_token": 1000 * seconds / tokens if tokens else None,
        "ar": method.ar.name,
        "speedup_vs_ar": tps / ar_tps if ar_tps else None,
        "speedup_vs_ar_geomean": _geomean_speedup(samples, ar),
        "target_forwards": forwards,
        "mean_accepted_per_forward": tokens / forwards if forwards else None,
    }
    out.update(_acceptance(samples))
    draft_s = sum(s.draft_seconds for s in samples)
    verify_s = sum(s.verify_seconds for s in samples)
    out.update(
        draft_seconds=draft_s,
        verify_seconds=verify_s,
        other_seconds=max(0.0, seconds - draft_s - verify_s),
        draft_fraction=draft_s / seconds if seconds else None,
        verify_fraction=verify_s / seconds if seconds else None,
    )
    draft_token = median([s.draft_token_seconds for s in samples if s.draft_token_seconds is not None])
    step = median([s.step_seconds for s in samples if s.step_seconds is not None])
    c = draft_token / ar_step if draft_token is not None and ar_step else None
    out["cost_ratio_c"] = c
    out["verify_step_ratio"] = step / ar_step if step is not None and ar_step else None
    alpha, k = out["alpha"], out["mean_drafted_per_step"]
    chain = not method.is_tree  # the closed form describes a chain of k drafts, not a tree
    out["predicted_speedup"] = (
        expected_speedup(alpha, k, c) if chain and None not in (alpha, k, c) and k > 0 else None
    )
    out.update(_identity(samples, ar_runs, run.settings.greedy))
    return out


def _decode_tps(samples: Sequence[Sample]) -> float | None:
    """Tokens per second after the first step, over all runs; None if some run lacks its first step."""
    if not samples or any(s.first_step_seconds is None or s.first_step_tokens is None for s in samples):
        return None
    seconds = sum(s.seconds - s.first_step_seconds for s in samples)
    tokens = sum(s.new_tokens - s.first_step_tokens for s in samples)
    return tokens / seconds if seconds > 0 else None


def _tps(samples: Sequence[Sample]) -> float:
    seconds = sum(s.seconds for s in samples)
    return sum(s.new_tokens for s in samples) / seconds if seconds > 0 else 0.0


def _median_tps(samples: Sequence[Sample]) -> float:
    """The median over ``samples`` of a run's tokens per second (0 for none)."""
    return statistics.median(_tps([s]) for s in samples) if samples else 0.0


def _geomean_speedup(samples: Sequence[Sample], ar: Sequence[Sample]) -> float | None:
    ratios = [math.log(r) for r in _per_prompt_ratios(samples, ar).values()]
    return math.exp(statistics.fmean(ratios)) if ratios else None


def _acceptance(samples: Sequence[Sample]) -> dict[str, Any]:
    """Acceptance figures from the per-step counts; None when some run lacks them. Runs that report
    only their totals (llama-server) give the totals and the acceptance rate alone."""
    keys = ("drafted_tokens", "accepted_tokens", "acceptance_rate", "alpha", "mean_drafted_per_step",
            "acceptance_by_position", "accepted_per_step_histogram")
    if samples and all(not s.step_drafted and s.drafted_total is not None for s in samples):
        total_d, total_a = sum(s.drafted_total for s in samples), sum(s.accepted_total or 0 for s in samples)
        return dict.fromkeys(keys) | {"drafted_tokens": total_d, "accepted_tokens": total_a,
                                      "acceptance_rate": total_a / total_d if total_d else None}
    if not samples or any(not s.step_drafted for s in samples):
        return dict.fromkeys(keys)
    drafted = [d for s in samples for d in s.step_drafted]
    accepted = [a for s in samples for a in s.step_accepted]
    total_d, total_a = sum(drafted), sum(accepted)
    rejections = sum(a < d for a, d in zip(accepted, drafted))
    at_d, at_a = [0] * max(drafted, default=0), [0] * max(drafted, default=0)
    for a, d in zip(accepted, drafted):
        for i in range(d):
            at_d[i] += 1
            at_a[i] += i < a
    histogram = Counter(accepted)
    return {
        "drafted_tokens": total_d,
        "accepted_tokens": total_a,
        "acceptance_rate": total_a / total_d if total_d else None,
        "alpha": total_a / (total_a + rejections) if total_a + rejections else None,
        "mean_drafted_per_step": total_d / len(drafted) if drafted else None,
        "acceptance_by_position": [a / d if d else None for a, d in zip(at_a, at_d)],
        "accepted_per_step_histogram": [histogram.get(i, 0) for i in range(max(histogram, default=-1) + 1)],
    }


def _identity(samples, ar_runs, greedy: bool) -> dict[str, Any]:
    """How many prompts' outputs equal ar's (greedy runs only: sampled outputs differ by design)."""
    if not greedy or not ar_runs:
        return {"identical_to_ar_fraction": None, "identical_prompts": None, "mean_common_prefix_with_ar": None}
    same: dict[int, bool] = {}
    prefixes = []
    for s in samples:
        base = ar_runs.get((s.prompt, s.repeat))
        if base is None:
            continue
        same[s.prompt] = same.get(s.prompt, True) and s.token_ids == base.token_ids
        prefixes.append(common_prefix_len(s.token_ids, base.token_ids))
    return {
        "identical_to_ar_fraction": sum(same.values()) / len(same) if same else None,
        "identical_prompts": f"{sum(same.values())}/{len(same)}",
        "mean_common_prefix_with_ar": statistics.fmean(prefixes) if prefixes else None,
    }


def _compare_with_peers(methods: Sequence[MethodSpec], summary: dict[str, dict[str, Any]]) -> None:
    """Each project method against the fastest peer of its kind measured in the same run."""
    for method in methods:
        if method.is_peer:
            continue
        rivals = [m.name for m in methods if m.is_peer and m.kind == method.peer]
        speeds = [(summary[r]["speedup_vs_ar"] or 0.0, r) for r in rivals]
        mine = summary[method.name]
        if not speeds:
            mine.update(peer=None, peer_speedup_vs_ar=None, vs_peer=None)
            continue
        best, name = max(speeds)
        mine.update(
            peer=name,
            peer_speedup_vs_ar=best,
            vs_peer=(mine["speedup_vs_ar"] or 0.0) / best if best else None,
        )


def prediction_figures(run: BenchRun) -> dict[str, dict[str, Any]]:
    """Per method with ``prediction=yes``, its figures per request and its geometric means against
    the other methods (see the module docstring); empty where no method sent a prediction."""
    by_method: dict[str, list[Sample]] = defaultdict(list)
    for s in run.samples:
        by_method[s.method].append(s)
    out = {}
    for method in (m for m in run.methods if m.prediction):
        mine = by_method.get(method.name, [])
        others = [m.name for m in run.methods if m.name != method.name]
        without = method.without_prediction.name
        others.sort(key=lambda name: name != without)  # the same method without the prediction first
        ar_runs = {(s.prompt, s.repeat): s for s in by_method.get(method.ar.name, [])}
        requests = []
        for prompt in sorted({s.prompt for s in mine}):
            runs = [s for s in mine if s.prompt == prompt]
            firsts = [s.first_step_seconds for s in runs if s.first_step_seconds is not None]
            same = [s.token_ids == ar_runs[s.prompt, s.repeat].token_ids for s in runs
                    if (s.prompt, s.repeat) in ar_runs]
            requests.append({
                "prompt": prompt, "prompt_id": run.prompts[prompt].id, "prompt_tokens": run.prompt_tokens[prompt],
                "new_tokens": statistics.fmean(s.new_tokens for s in runs),
                "tokens_per_second": {name: _median_tps([s for s in by_method.get(name, []) if s.prompt == prompt])
                                      for name in [method.name, *others]},
                "accepted": _mean_of([s.prediction_accepted for s in runs]),
                "rejected": _mean_of([s.prediction_rejected for s in runs]),
                "first_token_seconds": statistics.fmean(firsts) if firsts else None,
                "prefill_share": statistics.fmean(s.first_step_seconds / s.seconds for s in runs
                                                  if s.first_step_seconds is not None and s.seconds > 0)
                if firsts else None,
                "identical_to_ar": all(same) if run.settings.greedy and same else None,
            })
        out[method.name] = {
            "without_prediction": without if without in by_method else None,
            "ar": method.ar.name,
            "requests": requests,
            "geomean_vs": {name: _geomean_speedup(mine, by_method.get(name, [])) for name in others},
        }
    return out


def _mean_of(values: Sequence[int | None]) -> float | None:
    """The mean of the values, None where any is unknown."""
    return statistics.fmean(values) if values and None not in values else None
