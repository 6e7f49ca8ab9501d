"""What a cached pass of n rows costs on each of the GGUF kernel's paths, in one process.

The model is loaded once; for every pass size and round, each path runs the same pass in turn
(``specdec.backends.gguf.running_path``), so that the machine's drift falls on all of them, and
the cache is rolled back to the same ``--context`` tokens before each. Minimum over ``--rounds``
rounds. Each path's outputs are checked against the first path's, bit for bit (every path gives
the same bits: docs/kernels.md, "Paths").

    python benchmarks/kernel_paths.py --paths avx512vnni,amx --rounds 7 --out benchmarks/kernel-paths.json

Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or a pack name (default: the default target)")
    parser.add_argument("--paths", default="avx512vnni,amx", help="the kernel's paths to compare, comma-separated")
    parser.add_argument("--rows", default="1,8,16,32,64", help="pass sizes, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=100, help="tokens cached before each timed pass")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("kernel-paths.json"))
    args = parser.parse_args()
    import torch

    from specdec import models
    from specdec.backends import gguf as native
    from specdec.bench.machine import machine_record, read_speed

    torch.set_num_threads(args.threads)
    paths = [p for p in args.paths.split(",") if p]
    have = native.available_paths()
    missing = [p for p in paths if p not in have]
    if missing:
        parser.error(f"this CPU (or this build) lacks the path(s) {', '.join(missing)}; it runs {', '.join(have)}")
    rows = [int(n) for n in args.rows.split(",")]
    name = args.model or models.DEFAULT_TARGET
    model = native.load_gguf_native(models.gguf_path(name), n_threads=args.threads,
                                    n_ctx=args.context + max(rows) + 16)
    ids = [(17 + 7919 * i) % model.vocab_size for i in range(args.context + max(rows))]
    model.reset()
    model.forward(ids[: args.context], num_logits=1)
    best: dict[str, dict[int, float]] = {p: {} for p in paths}
    for _ in range(args.rounds):
        for n in rows:
            first = None
            for p in paths:
                with native.running_path(p, model.lib):
                    model.trim(args.context)
                    start = time.perf_counter()
                    logits = model.forward(ids[args.context: args.context + n], num_logits=n)
                    took = time.perf_counter() - start
                if first is None:
                    first = logits
                elif not torch.equal(logits, first):
                    raise SystemExit(f"the {p} path's logits differ from the {paths[0]} path's on a pass of {n} rows")
                best[p][n] = min(best[p].get(n, float("inf")), took)
    ms = {p: {n: round(1000 * t, 2) for n, t in times.items()} for p, times in best.items()}
    report = {
        "model": name, "threads": args.threads, "context": args.context, "rounds": args.rounds, "paths": paths,
        "ms": ms, "x_one_row": {p: {n: round(t / times[rows[0]], 3) for n, t in times.items()} for p, times in ms.items()},
        "identical_logits": True, "memory_read": read_speed(args.threads),
        "machine": machine_record(args.threads, None, why_no_target="measured here"),
        "load_average_at_start": list(os.getloadavg()),
        "command": f"python benchmarks/kernel_paths.py --paths {args.paths} --rows {args.rows} --rounds {args.rounds}"
                   f" --threads {args.threads} --out {args.out}",
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("| rows | " + " | ".join(f"{p} ms (x its 1 row)" for p in paths) + f" | {paths[0]} / {paths[-1]} |")
    print("|---:|" + "---:|" * (len(paths) + 1))
    for n in rows:
        cells = " | ".join(f"{ms[p][n]:.1f} ({report['x_one_row'][p][n]:.2f})" for p in paths)
        print(f"| {n} | {cells} | {ms[paths[0]][n] / ms[paths[-1]][n]:.2f} |")


if __name__ == "__main__":
    main()
