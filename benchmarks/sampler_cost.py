"""What one sampled token costs the sampler, per row of a 152k vocabulary, interleaved: inversion
with a generator (the default sampler, ``next_token``), the Gumbel-max sampler at a position it
has not seen (the position's noise is computed) and at one it has (the noise is cached, as when
the verifier reads a row the draft drew at), with and without a top-k filter. Writes a JSON file.

    python benchmarks/sampler_cost.py --rounds 5 --rows 200 --out benchmarks/sampler-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

VOCAB = 151936  # the Qwen2.5 pair's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=200, help="rows per timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/sampler-cost.json"))
    args = parser.parse_args()
    if min(args.rounds, args.rows, args.threads) < 1:
        parser.error("--rounds, --rows and --threads take positive integers")
    import torch  # only now: --help and a wrong argument answer at once

    from specdec.sampling import SamplingConfig, gumbel_token, next_token

    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3  # [rows, V]
    generator = torch.Generator().manual_seed(0)
    fresh = iter(range(10**9))  # positions never used before
    cases = {}
    for label, top_k in (("whole vocabulary", 0), ("top_k=40", 40)):
        multinomial = SamplingConfig(temperature=1.0, top_k=top_k)
        gumbel = SamplingConfig(temperature=1.0, top_k=top_k, gumbel_seed=1)
        cases[f"inversion, {label}"] = lambda row, c=multinomial: next_token(row, c, generator)
        cases[f"Gumbel-max, new position, {label}"] = lambda row, c=gumbel: gumbel_token(row, c, next(fresh))
        cases[f"Gumbel-max, cached position, {label}"] = lambda row, c=gumbel: gumbel_token(row, c, 7)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, draw in cases.items():  # interleaved: each round times every case once
            start = time.perf_counter()
            for row in logits:
                draw(row)
            times[name].append(1000 * (time.perf_counter() - start) / args.rows)
    result = {name: {"ms_per_row_median": statistics.median(t), "ms_per_row": t} for name, t in times.items()}
    args.out.write_text(json.dumps({"command": f"python benchmarks/sampler_cost.py --rounds {args.rounds} "
                                               f"--rows {args.rows} --threads {args.threads}",
                                    "vocab": VOCAB, "cases": result}, indent=1) + "\n")
    for name, r in result.items():
        print(f"{name:45s} {r['ms_per_row_median']:.3f} ms")


if __name__ == "__main__":
    main()
