"""What one decoding step costs through each backend, and what int8 draft weights cost in agreement.

For the default target and draft: the milliseconds of a cached one-token forward through
transformers (``HFCausalLM``), through the lean backend with the model's bf16 weights, and (the
draft only) through the lean backend with int8 weights; interleaved, so drift falls on all. Then
how often each draft's greedy token equals the target's on the target's own greedy continuations
of a few prompts written here (not benchmark prompts). Prints a Markdown table and writes
draft-cost.json beside this file, or --out.

    python benchmarks/draft_cost.py [--threads 2] [--repeats 5] [--tokens 64]

``--target``/``--draft`` (default: the default pair) and ``--prompts`` (how many of the prompts
below) make a small run, e.g. ``--target smollm2-135m --draft smollm2-135m --prompts 1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdec import packs

PROMPTS = (
    "def merge_sorted(a, b):\n",
    "import json\n\ndef load_config(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "Explain the difference between a process and a thread.\n",
)


def step_ms(backend, context: list[int], steps: int) -> float:
    """Median milliseconds of a one-token cached forward after ``context``."""
    backend.trim(len(context))
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        backend.forward([1000 + i], 1)
        times.append(time.perf_counter() - t0)
    backend.trim(len(context))
    return statistics.median(times) * 1000


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=packs.DEFAULT_TARGET, help="a pack name or a model directory")
    parser.add_argument("--draft", default=packs.DEFAULT_DRAFT, help="a pack name or a model directory")
    parser.add_argument("--prompts", type=positive, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--repeats", type=positive, default=5)
    parser.add_argument("--tokens", type=positive, default=64)
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: draft-cost.json beside this script)")
    args = parser.parse_args()
    if args.prompts > len(PROMPTS):
        parser.error(f"--prompts: there are {len(PROMPTS)} prompts")
    # torch and the models only now: --help and a wrong argument answer at once
    import torch

    from specdec import generate, models
    from specdec.backends.hf import HFCausalLM
    from specdec.backends.lean import LeanCausalLM

    torch.set_num_threads(args.threads)
    target, tokenizer = models.load(args.target, progress=False)
    draft, _ = models.load(args.draft, progress=False)
    context = torch.randint(100, 20000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    backends = {
        "target, transformers": HFCausalLM(target),
        "target, lean bf16": LeanCausalLM(target),
        "draft, transformers": HFCausalLM(draft),
        "draft, lean bf16": LeanCausalLM(draft),
        "draft, lean int8": LeanCausalLM(draft, weights="int8"),
    }
    for backend in backends.values():
        backend.forward(context, 1)
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(args.repeats):
        for name, backend in backends.items():
            times[name].append(step_ms(backend, context, 5))
    ms = {name: statistics.median(v) for name, v in times.items()}

    agree = {"lean bf16": 0, "lean int8": 0}
    total = 0
    for text in PROMPTS[:args.prompts]:
        ids = tokenizer(text)["input_ids"]
        out = generate(target, ids, max_new_tokens=args.tokens, eos_token_ids=[]).token_ids
        for name, weights in (("lean bf16", "bf16"), ("lean int8", "int8")):
            logits = LeanCausalLM(draft, weights=weights).forward(ids + out[:-1])[len(ids) - 1 :]  # [len(out), V]
            agree[name] += int((logits.argmax(-1) == torch.tensor(out)).sum())
        total += len(out)
    agreement = {name: n / total for name, n in agree.items()}

    ar = ms["target, lean bf16"]
    lines = ["| forward of one token | ms | × target step (lean) |", "|---|---:|---:|"]
    lines += [f"| {name} | {m:.1f} | {m / ar:.2f} |" for name, m in ms.items()]
    lines += ["", f"Greedy agreement with the target over {total} tokens: draft bf16 {agreement['lean bf16']:.3f}, "
              f"draft int8 {agreement['lean int8']:.3f}."]
    table = "\n".join(lines)
    print(table)
    command = f"python benchmarks/draft_cost.py --threads {args.threads} --repeats {args.repeats} --tokens {args.tokens}"
    command += "".join(f" --{k} {v}" for k, v in (("target", args.target), ("draft", args.draft), ("prompts", args.prompts))
                       if v != parser.get_default(k))
    (args.out or Path(__file__).with_name("draft-cost.json")).write_text(json.dumps({
        "median_ms": ms, "agreement": agreement, "tokens": total, "context": len(context),
        "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__, "command": command,
        "table": table,
    }, indent=1))


if __name__ == "__main__":
    main()
