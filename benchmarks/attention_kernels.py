"""Why a batch-invariant GGUF gets a bf16 KV cache on llama.cpp: rows against one-token steps, and the cost.

llama.cpp's CPU flash attention runs a tiled kernel for passes of 64 rows or more and a split-KV
kernel for one-token steps over a KV view of 512 cells or more, both only for an f16 (or f32)
cache; with a bf16 cache every pass takes the per-row kernel (docs/backends.md). For each cache
type this counts, over random token ids, the rows of passes of ``--rows`` tokens after
``--contexts`` cached tokens whose logits differ from one-token steps at all, then times, side by
side (the cache types alternating, the fastest of ``--repeats``), a prefill of ``--length`` tokens
and a one-token step after it.

    python benchmarks/attention_kernels.py --model smollm2-135m --threads 2 --out benchmarks/attention-kernels.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path


def positive_ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",")]
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a pack name or a .gguf file (default: smollm2-135m)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=positive_ints, default=[0, 300, 560], help="cached tokens before each pass")
    parser.add_argument("--rows", type=positive_ints, default=[16, 64, 128], help="tokens per pass")
    parser.add_argument("--length", type=int, default=1000, help="tokens prefilled before the timed step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.threads <= 0 or args.length <= 0 or args.repeats <= 0 or 0 in args.rows:
        parser.error("--threads, --length, --repeats and every --rows value must be positive")

    from specdec import packs
    from specdec.backends.llamacpp import KV_TYPES, GGUFWeights, LlamaCppCausalLM

    path = packs.gguf_file(args.model, progress=False) if args.model in packs.PACKS else Path(args.model)
    weights = GGUFWeights(path)
    longest = max(max(args.contexts) + max(args.rows), args.length + 1)
    models = {kv: LlamaCppCausalLM(weights, n_threads=args.threads, n_ctx=longest + 8, kv_type=kv) for kv in KV_TYPES}
    rng = random.Random(0)
    ids = [rng.randrange(weights.vocab_size) for _ in range(longest)]
    differing: dict[str, dict[str, int]] = {}
    for kv, model in models.items():
        model.reset()
        steps = [model.forward([t])[0] for t in ids[: max(args.contexts) + max(args.rows)]]
        counts = {}
        for context in args.contexts:
            for rows in args.rows:
                model.reset()
                if context:
                    model.forward(ids[:context], num_logits=1)
                got = model.forward(ids[context : context + rows])
                counts[f"{context}+{rows}"] = sum(not bool((got[i] == steps[context + i]).all()) for i in range(rows))
        differing[kv] = counts
        print(kv, "rows differing from one-token steps:", counts, flush=True)
    seconds: dict[str, dict[str, list[float]]] = {kv: {"prefill": [], "step": []} for kv in models}
    for repeat in range(args.repeats):
        for kv in (list(models) if repeat % 2 == 0 else list(models)[::-1]):
            model = models[kv]
            model.reset()
            t0 = time.perf_counter()
            model.forward(ids[: args.length], num_logits=1)
            t1 = time.perf_counter()
            model.forward([ids[args.length]])
            t2 = time.perf_counter()
            seconds[kv]["prefill"].append(t1 - t0)
            seconds[kv]["step"].append(t2 - t1)
    fastest = {kv: {k: min(v) for k, v in s.items()} for kv, s in seconds.items()}
    ratios = {k: fastest["bf16"][k] / fastest["f16"][k] for k in ("prefill", "step")}
    print("fastest seconds:", fastest)
    print("bf16 / f16:", {k: round(v, 3) for k, v in ratios.items()})
    if args.out is not None:
        rows_tried = sum(args.rows) * len(args.contexts)
        args.out.write_text(json.dumps({
            "command": " ".join(["python", "benchmarks/attention_kernels.py", *sys.argv[1:]]),
            "model": path.name, "threads": args.threads, "rows_tried": rows_tried, "differing": differing,
            "length": args.length, "fastest_seconds": fastest, "bf16_over_f16": ratios}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
