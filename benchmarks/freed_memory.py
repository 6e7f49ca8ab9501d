"""What keeping freed memory (``specdec.memory``) is worth in a decode loop.

glibc's own defaults cannot be restored inside a process once changed (setting a threshold turns
off its dynamic adjustment), so this alternates whole processes: one with ``SPECDEC_MALLOC=system``
(glibc's defaults), one with freed memory kept, ``--rounds`` times each, every process running the
same generations (fixed seeds, so the very same tokens). Reports each method's time ratio and
writes freed-memory.json beside this file, or --out.

    python benchmarks/freed_memory.py [--threads 2] [--rounds 2] [--tokens 48]

``--target``/``--draft`` (default: the default pair, on torch) make a small run, e.g.
``--target smollm2-135m --draft smollm2-135m --rounds 1 --tokens 4``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tree_vs_chain import PROMPTS as ALL_PROMPTS  # benchmarks/ is on the path when run as a script

from specdec.packs import DEFAULT_DRAFT, DEFAULT_TARGET

PROMPTS = ALL_PROMPTS[:2]  # one code prompt, one prose prompt
METHODS = {
    "ar": {},
    "spec:block:policy=confidence": {"policy": "confidence"},
    "spec:tree": {"verify": "tree"},
}


def one_process(args: argparse.Namespace) -> None:
    """Run every generation once after a warm-up; print {method: seconds} and the tokens as JSON."""
    import torch

    from specdec import generate, models
    from specdec.build import as_backend
    from specdec.memory import keep_freed_memory

    keep_freed_memory()  # does nothing under SPECDEC_MALLOC=system
    torch.set_num_threads(args.threads)
    target_model, tokenizer = models.load(args.target, progress=False)
    draft_model, _ = models.load(args.draft, progress=False)
    target, draft = as_backend(target_model), as_backend(draft_model, "int8")
    seconds, tokens = {name: 0.0 for name in METHODS}, {}
    for counted in (False, True):
        for i, text in enumerate(PROMPTS):
            ids = tokenizer(text)["input_ids"]
            for name, options in METHODS.items():
                start = time.perf_counter()
                out = generate(target, ids, draft=None if name == "ar" else draft, temperature=args.temperature,
                               seed=i, max_new_tokens=args.tokens, eos_token_ids=[], **options).token_ids
                if counted:
                    seconds[name] += time.perf_counter() - start
                    tokens[f"{name} {i}"] = out
    print(json.dumps({"seconds": seconds, "tokens": tokens}))


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="a pack name or a model directory")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="a pack name or a model directory")
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--rounds", type=positive, default=2)
    parser.add_argument("--tokens", type=positive, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: freed-memory.json beside this script)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.temperature < 0:
        parser.error("--temperature must be 0 (greedy) or positive")
    if args.one:
        one_process(args)
        return
    runs = {"system": [], "kept": []}
    for r in range(args.rounds):
        for mode in (("system", "kept") if r % 2 == 0 else ("kept", "system")):
            env = dict(os.environ)
            env.pop("SPECDEC_MALLOC", None)
            if mode == "system":
                env["SPECDEC_MALLOC"] = "system"
            argv = [sys.executable, __file__, "--one", "--threads", str(args.threads), "--tokens", str(args.tokens),
                    "--temperature", str(args.temperature), "--target", args.target, "--draft", args.draft]
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"the {mode} process failed with status {done.returncode}:\n{done.stderr[-3000:]}")
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(mode, {k: round(v, 2) for k, v in runs[mode][-1]["seconds"].items()}, flush=True)
    first = runs["system"][0]["tokens"]
    same = all(run["tokens"] == first for mode in runs for run in runs[mode])
    result = {}
    for name in METHODS:
        system = sum(run["seconds"][name] for run in runs["system"])
        kept = sum(run["seconds"][name] for run in runs["kept"])
        result[name] = {"seconds_system": system, "seconds_kept": kept, "speed_up": system / kept}
        print(f"{name}: {system:.1f} s -> {kept:.1f} s, {system / kept:.3f}x", flush=True)
    print("identical tokens in every process:", same)
    command = (f"python benchmarks/freed_memory.py --threads {args.threads} --rounds {args.rounds} "
               f"--tokens {args.tokens} --temperature {args.temperature:g}")
    command += "".join(f" --{k} {v}" for k, v in (("target", args.target), ("draft", args.draft)) if v != parser.get_default(k))
    (args.out or Path(__file__).with_name("freed-memory.json")).write_text(json.dumps(
        {"methods": result, "identical_tokens": same, "prompts": len(PROMPTS), "command": command}, indent=1))


if __name__ == "__main__":
    main()
