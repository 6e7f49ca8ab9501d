"""What the default method costs where it cannot draft: plain decoding and the default, alternated.

On a prompt whose output repeats nothing and which the draft model would not pay for, the planner
drafts (almost) nothing, and the default's steps are plain steps plus its bookkeeping: the lookup's
index, the planner's choice, the verifier's verdict on a draft of none. This script measures that
bookkeeping where it matters, on the GGUF backends at the default pair's cost: for each prompt it
runs plain decoding (``ar``) and the default method in pairs, the order swapped from pair to pair
so that machine drift falls on both, and reports for each prompt the median of the per-pair ratios
default / ar (wall time and, separately, the time inside the target's forward passes), the target
forwards, and the drafted and accepted tokens. A ratio near 1.00 with as many forwards means the
default costs nothing beyond its drafts; the spread of the pair ratios says how far one pair moves.

    python benchmarks/default_overhead.py --prompts mtbench:3,humaneval:3 --pairs 8 --temperature 0 [--out FILE]

``--target`` / ``--draft`` take pack names or .gguf files (default: the default pair); ``--backend``
``gguf`` (specdec's kernel) or ``llamacpp``. Chat prompts go through the target's chat template.
T > 0 runs sample with the Gumbel-max sampler and one seed, so ``ar`` and the default draw the
same text and compare like with like. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from specdec import DecodeConfig, generate, models
from specdec.memory import keep_freed_memory
from specdec.prompts import load_prompts


class PassTimer:
    """Wraps a model's ``forward`` and adds up the seconds spent inside it."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        self._forward = model.forward
        model.forward = self

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._forward(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=models.DEFAULT_TARGET, help="a pack name or a .gguf file")
    parser.add_argument("--draft", default=models.DEFAULT_DRAFT, help="a pack name or a .gguf file")
    parser.add_argument("--backend", choices=models.GGUF_BACKENDS, default="gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default="mtbench:3,humaneval:3", help="prompt sets, as specdec bench takes them")
    parser.add_argument("--pairs", type=int, default=8, help="ar/default pairs per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", default=None, help="JSON file (default: default-overhead.json beside this script)")
    args = parser.parse_args()
    if args.pairs < 1 or args.max_new_tokens < 1 or args.temperature < 0:
        parser.error("--pairs and --max-new-tokens must be positive and --temperature >= 0")
    keep_freed_memory()
    prompts = load_prompts(args.prompts)
    pair = models.load_pair(args.target, args.draft, backend=args.backend, n_threads=args.threads)
    target, draft, tokenizer = pair.target, pair.draft, pair.tokenizer
    timer = PassTimer(target)
    sampling = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=[], temperature=args.temperature)
    if args.temperature > 0:
        sampling |= dict(sampler="gumbel", seed=0)

    def run(method: str, ids: list[int]) -> dict:
        target.trim(0)
        draft.trim(0)
        timer.seconds = 0.0
        t0 = time.perf_counter()
        if method == "ar":
            result = generate(target, ids, **sampling)
        else:
            result = generate(target, ids, draft=draft, config=DecodeConfig(), **sampling)
        seconds = time.perf_counter() - t0
        s = result.stats
        return {"seconds": seconds, "pass_seconds": timer.seconds, "forwards": s.target_forwards,
                "drafted": s.drafted_tokens, "accepted": s.accepted_tokens, "tokens": result.token_ids}

    rows = []
    for prompt in prompts:
        ids = (tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True) if prompt.chat
               else tokenizer(prompt.text)["input_ids"])
        run("ar", ids)  # warm-up: the first run of a prompt pays for page faults
        runs = {"ar": [], "default": []}
        for i in range(args.pairs):
            for method in (("ar", "default") if i % 2 == 0 else ("default", "ar")):
                runs[method].append(run(method, ids))
        wall = [d["seconds"] / a["seconds"] for a, d in zip(runs["ar"], runs["default"])]
        passes = [d["pass_seconds"] / a["pass_seconds"] for a, d in zip(runs["ar"], runs["default"])]
        same = all(r["tokens"] == runs["ar"][0]["tokens"] for r in runs["ar"] + runs["default"])
        last = runs["default"][-1]
        row = {"prompt": prompt.id, "wall_ratio_median": statistics.median(wall), "wall_ratios": wall,
               "pass_ratio_median": statistics.median(passes), "pass_ratios": passes,
               "ar_forwards": runs["ar"][-1]["forwards"], "default_forwards": last["forwards"],
               "drafted": last["drafted"], "accepted": last["accepted"], "identical": same}
        rows.append(row)
        print(f"{prompt.id:24s} default/ar wall {row['wall_ratio_median']:.3f} "
              f"(pairs {min(wall):.3f}-{max(wall):.3f}), passes {row['pass_ratio_median']:.3f}; forwards "
              f"{row['default_forwards']} vs {row['ar_forwards']}; drafted {row['drafted']}, kept {row['accepted']}; "
              f"identical {'yes' if same else 'NO'}", flush=True)
    out = Path(args.out) if args.out else Path(__file__).with_name("default-overhead.json")
    out.write_text(json.dumps({
        "command": "python benchmarks/default_overhead.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None),
        "machine": platform.processor() or platform.machine(), "backend": pair.backend, "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
