"""What the trimmed vocabulary of trained draft heads saves and what it costs.

Saves: the time of the drafter's LM head, full (V rows) against trimmed (the kept rows of the
shipped heads), on 1 and 4 feature rows, interleaved, median of ``--repeats`` rounds.
Costs: a drafter that scores only the kept ids can never propose another token, so the share of
the target's own tokens outside the kept set bounds the acceptance lost per drafted position.
Measured on the tokens the target produced in a benchmark run (``--results``, ``ar`` samples).

    python benchmarks/trimmed_head.py --results benchmarks/default-pair-bf16-draft-and-heads/greedy/results.json \
        --results benchmarks/default-pair-bf16-draft-and-heads/t1/results.json --repeats 30 --out benchmarks/trimmed-head.json

The heads are those shipped for ``--target`` (the default target's), or ``--heads DIR`` (heads
trained with ``specdec train-heads``) for another target, e.g. ``--target smollm2-135m --heads DIR``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="a pack name or a model directory (run on torch)")
    parser.add_argument("--heads", default=None, metavar="DIR",
                        help="draft heads for the target (default: the heads shipped for it)")
    parser.add_argument("--results", action="append", default=[], help="a bench results.json (repeatable)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/trimmed-head.json")
    args = parser.parse_args()
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads take positive integers")
    for path in args.results:
        if not Path(path).is_file():
            parser.error(f"--results: no such file {path}")
    if args.heads is not None and not Path(args.heads).is_dir():
        parser.error(f"--heads: no such folder {args.heads}")
    # torch and the models only now: --help and a wrong argument answer at once
    import torch

    from specdec import kernels, models
    from specdec.drafters.medusa import TrimmedLMHead, load_heads_for

    torch.set_num_threads(args.threads)
    model, _ = models.load(args.target, dtype=torch.bfloat16)
    heads = load_heads_for(model, args.heads)
    weight = model.get_output_embeddings().weight  # [V, H]
    full = TrimmedLMHead(weight, torch.arange(weight.shape[0]))
    trimmed = TrimmedLMHead(weight, heads.kept)
    timings: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in (1, 4):
            h = torch.randn(rows, weight.shape[1], dtype=torch.bfloat16)
            samples: dict[str, list[float]] = {"full": [], "trimmed": []}
            for _ in range(args.repeats):
                for name, head in (("full", full), ("trimmed", trimmed)):  # interleaved
                    began = time.perf_counter()
                    head.logits(h)
                    samples[name].append((time.perf_counter() - began) * 1000)
            timings[f"{rows} row(s)"] = {name: round(statistics.median(s), 3) for name, s in samples.items()}
    kept = set(heads.kept.tolist())
    coverage = {}
    for path in args.results:
        data = json.loads(Path(path).read_text())
        tokens = [t for s in data["samples"] if s["method"] == "ar" for t in s["token_ids"]]
        inside = sum(t in kept for t in tokens)
        coverage[path] = {"temperature": data["settings"]["temperature"], "tokens": len(tokens),
                          "in_kept_set": round(inside / max(1, len(tokens)), 4)}
    report = {"target": args.target, "vocab": int(weight.shape[0]), "kept": len(kept),
              "kernels": kernels.status(), "threads": args.threads,
              "lm_head_ms_median": timings, "target_tokens_in_kept_set": coverage,
              "command": "python benchmarks/trimmed_head.py " + " ".join(
                  f"--results {p}" for p in args.results) + f" --repeats {args.repeats} --out {args.out}"
                  + (f" --target {args.target}" if args.target != parser.get_default("target") else "")
                  + (f" --heads {args.heads}" if args.heads else "")}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
