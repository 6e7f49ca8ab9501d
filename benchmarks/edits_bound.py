"""How much faster than the default method a prediction could make each request of an edit run,
at best, on this machine's measured pass costs; and how much faster the passes it did run make it.

Reads a ``specdec bench`` folder that ran a served ``spec`` method with and without
``prediction=yes`` (``benchmarks/edits.jsonl``) and a curve of what a pass of n rows costs, in
one-row passes (``benchmarks/kernel_paths.py --paths <one path> --rows 1,...,64``). For each request:

- ``default_units``, ``prediction_units``: the passes after the first one each method ran, each
  priced on the curve at its rows (1 + the tokens it drafted): a measure of the decoding work free
  of the machine's drift between the two requests (one run of one request moves by 10-30% here).
- ``curve_ratio``: the default's time over the prediction's with the default's decoding time scaled
  by ``prediction_units / default_units`` (the time to the first token, the same prompt's prefill,
  as measured for the default).
- ``bound_ratio``: the same for a prediction that could not do better: every token after the first
  drafted and accepted, in passes of the size with the least cost per row on the curve, counted
  fractionally (a lower bound on any drafter's decoding work on this curve).
- ``measured_ratio``: the prediction's tokens per second over the default's, as the bench timed them.

    python benchmarks/edits_bound.py --bench benchmarks/edits-learnt --curve benchmarks/kernel-rows.json

It reads files only; the curve should come from the same machine, idle.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def units(curve: dict[int, float], rows: int) -> float:
    """A pass of ``rows`` rows in one-row passes: the curve where it was measured, else linear
    between the measured sizes around it (past the largest, at its cost per row)."""
    if rows in curve:
        return curve[rows]
    sizes = sorted(curve)
    if rows > sizes[-1]:
        return curve[sizes[-1]] * rows / sizes[-1]
    below = max(n for n in sizes if n < rows)
    above = min(n for n in sizes if n > rows)
    return curve[below] + (curve[above] - curve[below]) * (rows - below) / (above - below)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", type=Path, required=True, help="a specdec bench folder with and without prediction=yes")
    parser.add_argument("--curve", type=Path, required=True, help="benchmarks/kernel_paths.py's JSON for one path")
    parser.add_argument("--path", default=None, help="the curve's path (default: its last)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = json.loads(args.curve.read_text())
    path = args.path or report["paths"][-1]
    curve = {int(n): float(x) for n, x in report["x_one_row"][path].items()}
    if 1 not in curve:
        parser.error(f"{args.curve}: the curve needs a one-row pass")
    best_rows = min(curve, key=lambda n: curve[n] / n)
    per_row = curve[best_rows] / best_rows
    samples: dict[int, dict[str, dict]] = {}
    for file in sorted(args.bench.glob("*/samples/*.json")):
        record = json.loads(file.read_text())
        method, sample = record["method"], record["sample"]
        if not method.startswith("spec") or not sample.get("step_drafted"):
            continue
        key = "prediction" if "prediction=yes" in method else "default"
        samples.setdefault(sample["prompt"], {}).setdefault(key, sample)  # the first repeat
    rows = []
    for prompt, pair in sorted(samples.items()):
        if set(pair) != {"default", "prediction"}:
            continue
        default, prediction = pair["default"], pair["prediction"]
        first, decode = default["first_step_seconds"], default["seconds"] - default["first_step_seconds"]
        done = {k: sum(units(curve, 1 + d) for d in s["step_drafted"][1:]) for k, s in pair.items()}
        after_first = default["new_tokens"] - default["first_step_tokens"]
        ideal = after_first * per_row
        total = default["seconds"]
        rows.append({
            "prompt": prompt, "new_tokens": default["new_tokens"], "first_seconds": round(first, 3),
            "decode_seconds": round(decode, 3), "prefill_share": round(first / total, 3),
            "default_passes": len(default["step_drafted"]), "prediction_passes": len(prediction["step_drafted"]),
            "default_units": round(done["default"], 2), "prediction_units": round(done["prediction"], 2),
            "ideal_units": round(ideal, 2),
            "curve_ratio": round(total / (first + decode * done["prediction"] / done["default"]), 3),
            "bound_ratio": round(total / (first + decode * ideal / done["default"]), 3),
            "measured_ratio": round(default["seconds"] / prediction["seconds"], 3),
            "identical": default["token_ids"] == prediction["token_ids"],
        })
    if not rows:
        parser.error(f"{args.bench}: no request ran both with and without the prediction")
    summary = {k: round(geomean([r[k] for r in rows]), 3) for k in ("curve_ratio", "bound_ratio", "measured_ratio")}
    out = {"bench": str(args.bench), "curve": str(args.curve), "path": path, "curve_x_one_row": curve,
           "cheapest_rows": best_rows, "cheapest_per_row": round(per_row, 4), "requests": rows,
           "geometric_means": summary, "all_identical": all(r["identical"] for r in rows),
           "command": f"python benchmarks/edits_bound.py --bench {args.bench} --curve {args.curve}"
                      + (f" --path {args.path}" if args.path else "") + (f" --out {args.out}" if args.out else "")}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"curve: {path}; the cheapest row in a pass of {best_rows} ({per_row:.3f} of a one-row pass)")
    print("| request | tokens | prefill share | passes default / prediction | units default / prediction / best "
          "| measured | on the curve | at best |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['prompt']} | {r['new_tokens']} | {r['prefill_share']:.2f} | {r['default_passes']} / "
              f"{r['prediction_passes']} | {r['default_units']:.0f} / {r['prediction_units']:.0f} / {r['ideal_units']:.0f} "
              f"| {r['measured_ratio']:.2f} | {r['curve_ratio']:.2f} | {r['bound_ratio']:.2f} |")
    print(f"| geometric mean | | | | | {summary['measured_ratio']:.2f} | {summary['curve_ratio']:.2f} "
          f"| {summary['bound_ratio']:.2f} |")


if __name__ == "__main__":
    main()
