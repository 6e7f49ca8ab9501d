"""Prefill of a long prompt: PyTorch's kernels, specdec's batch-invariant kernels for every row,
and specdec's default (the prompt but its last token through PyTorch's kernels, see
:func:`specdec.backends.base.prefill`; the last token and every later step on the invariant ones).

Interleaved: for each repeat the three ways are timed back to back on the same loaded model, each
from an empty cache, through :func:`specdec.backends.base.forward_after` (what ar and every
speculative method call first). The prompt is real code: this repository's own Python source,
tokenized and cut to --tokens. Prints a Markdown table of median seconds; writes prefill.json
beside this file, or --out.

    python benchmarks/prefill.py [--model qwen2.5-coder-1.5b] [--tokens 2048] [--threads 2] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

WAYS = ("torch kernels", "invariant kernels for every row", "specdec default (fast prefill)")


def prompt_ids(tokenizer, tokens: int) -> list[int]:
    source = Path(__file__).resolve().parents[1] / "src" / "specdec"
    text = "\n\n".join(p.read_text() for p in sorted(source.rglob("*.py")))
    ids = tokenizer(text)["input_ids"]
    if len(ids) < tokens:
        raise SystemExit(f"only {len(ids)} tokens of source text; ask for fewer with --tokens")
    return ids[:tokens]


def time_way(model, way: str, ids: list[int]) -> float:
    from specdec import kernels
    from specdec.backends.base import forward_after
    from specdec.backends.hf import HFCausalLM
    from specdec.backends.lean import make_backend

    if way == "torch kernels":
        kernels.restore(model)
        model.config._attn_implementation = "sdpa"
        backend = HFCausalLM(model)
    else:
        kernels.accelerate(model)
        kernels.use_invariant_attention(model)
        backend = make_backend(model)
    saved = kernels.PREFILL_ROWS
    kernels.PREFILL_ROWS = 10**9 if way == "invariant kernels for every row" else saved
    try:
        start = time.perf_counter()
        forward_after(backend, ids)
        return time.perf_counter() - start
    finally:
        kernels.PREFILL_ROWS = saved


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a pack name or a model directory (run on torch)")
    parser.add_argument("--tokens", type=positive, default=2048)
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: prefill.json beside this script)")
    parser.add_argument("--skip-invariant", action="store_true",
                        help="leave out the invariant-kernels-for-every-row way (the slowest by far)")
    args = parser.parse_args()
    ways = [w for w in WAYS if not (args.skip_invariant and w == WAYS[1])]
    # torch and the models only now: --help and a wrong argument answer at once
    import torch

    from specdec import kernels, models

    torch.set_num_threads(args.threads)
    model, tokenizer = models.load(args.model, dtype="bfloat16", progress=False, kernels="auto")
    ids = prompt_ids(tokenizer, args.tokens)
    for way in ways:  # untimed: first calls set up oneDNN's and the kernels' state
        time_way(model, way, ids[:256])
    times: dict[str, list[float]] = {way: [] for way in ways}
    for repeat in range(args.repeats):
        for way in ways:
            times[way].append(time_way(model, way, ids))
            print(f"repeat {repeat}: {way}: {times[way][-1]:.2f} s", flush=True)
    med = {way: statistics.median(t) for way, t in times.items()}
    base = med["torch kernels"]
    lines = [f"| {args.tokens}-token prefill, {args.model} | median s | × torch |", "|---|---|---|"]
    lines += [f"| {way} | {med[way]:.2f} | {med[way] / base:.2f} |" for way in ways]
    table = "\n".join(lines)
    print(table)
    out = args.out or Path(__file__).with_name("prefill.json")
    out.write_text(json.dumps({
        "model": args.model, "tokens": args.tokens, "threads": args.threads, "repeats": args.repeats,
        "seconds": times, "median_seconds": med, "kernel": kernels.status(), "torch": torch.__version__,
        "command": f"python benchmarks/prefill.py --model {args.model} --tokens {args.tokens} "
                   f"--threads {args.threads} --repeats {args.repeats}" + (" --skip-invariant" if args.skip_invariant else ""),
        "table": table,
    }, indent=1))


if __name__ == "__main__":
    main()
