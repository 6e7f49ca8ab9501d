"""Cost of one cached target forward over n new tokens: PyTorch's bf16 linear layers and SDPA
attention against specdec's kernels (``--kernels torch`` against ``--kernels auto``).

Interleaved: for each repeat, each n, both kernels are timed back to back on the same loaded model,
so machine drift falls on both. Prints a Markdown table of median milliseconds and of the cost
relative to a 1-token forward; writes forward-cost.json beside this file, or --out.

    python benchmarks/forward_cost.py [--model qwen2.5-coder-1.5b] [--threads 2] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a pack name or a model directory (run on torch)")
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--repeats", type=positive, default=5)
    parser.add_argument("--context", type=positive, default=200, help="tokens cached before the timed passes")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: forward-cost.json beside this script)")
    args = parser.parse_args()
    # torch and the models only now: --help and a wrong argument answer at once
    import torch

    from specdec import kernels, models
    from specdec.backends.hf import HFCausalLM

    torch.set_num_threads(args.threads)
    model, _ = models.load(args.model, dtype="bfloat16", progress=False, kernels="torch")
    backend = HFCausalLM(model)
    gen = torch.Generator().manual_seed(0)
    backend.forward(torch.randint(100, 20000, (args.context,), generator=gen).tolist(), 1)
    sizes = [1, 2, 3, 5, 8, 12, 16]
    times: dict[str, dict[int, list[float]]] = {"torch": {n: [] for n in sizes}, "specdec": {n: [] for n in sizes}}
    for _ in range(args.repeats):
        for n in sizes:
            for name in ("torch", "specdec"):
                if name == "specdec":
                    kernels.accelerate(model)
                    kernels.use_invariant_attention(model)
                else:
                    kernels.restore(model)
                    model.config._attn_implementation = "sdpa"
                new = torch.randint(100, 20000, (n,), generator=gen).tolist()
                t0 = time.perf_counter()
                backend.forward(new, n)
                times[name][n].append(time.perf_counter() - t0)
                backend.trim(args.context)
    med = {k: {n: statistics.median(v) * 1000 for n, v in d.items()} for k, d in times.items()}
    lines = ["| new tokens | torch (ms) | × 1-token | specdec kernels (ms) | × 1-token |", "|---|---|---|---|---|"]
    for n in sizes:
        t, s = med["torch"][n], med["specdec"][n]
        lines.append(f"| {n} | {t:.0f} | {t / med['torch'][1]:.2f} | {s:.0f} | {s / med['specdec'][1]:.2f} |")
    table = "\n".join(lines)
    print(table)
    out = args.out or Path(__file__).with_name("forward-cost.json")
    out.write_text(json.dumps({
        "model": args.model, "threads": args.threads, "repeats": args.repeats, "context": args.context,
        "median_ms": med, "kernel": kernels.status(), "torch": torch.__version__,
        "command": f"python benchmarks/forward_cost.py --model {args.model} --threads {args.threads} --repeats {args.repeats}"
                   + (f" --context {args.context}" if args.context != parser.get_default("context") else ""),
        "table": table,
    }, indent=1))


if __name__ == "__main__":
    main()
