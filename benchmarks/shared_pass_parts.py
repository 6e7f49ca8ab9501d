"""Where the time of several requests decoded at once goes: the target's shared passes, the
draft's, and everything else (each sequence's drafting logic, sampling, verification and
bookkeeping in Python, and the threads' hand-offs).

For each number of sequences N and each method, :func:`specdec.generate_many` decodes N chat
prompts at once on the GGUF kernel (``--max-new-tokens`` each, end of text ignored), with the
kernel's shared-pass function wrapped to time every pass by the weights it ran. Prints, per run,
the wall time, the tokens per second, the seconds inside the target's and the draft's passes and
what is left, the passes and their mean rows; writes JSON with the machine record.

    python benchmarks/shared_pass_parts.py --sequences 1 4 8 --methods ar spec --temperature 0 1 \
        --out benchmarks/shared-pass-parts.json

Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import specdec.backends.shared as shared
from specdec import DecodeConfig, generate_many, models
from specdec.bench.machine import machine_record
from specdec.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default="sharegpt:8")
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--methods", nargs="+", default=["ar", "spec"])
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).with_name("shared-pass-parts.json")))
    args = parser.parse_args()
    pair = models.load_pair(args.target, args.draft, backend="gguf", n_threads=args.threads)
    machine = machine_record(args.threads, models.gguf_path(args.target))
    # a draft named as the target shares its weights: its passes are then counted as the target's
    roles = {id(pair.draft.weights): "draft", id(pair.target.weights): "target"}
    spent: dict[str, list[float]] = {}  # role -> [seconds, passes, rows]
    inner = shared.run_together

    def timed(pieces):
        start = time.perf_counter()
        out = inner(pieces)
        tally = spent.setdefault(roles.get(id(pieces[0][0].weights), "other"), [0.0, 0, 0])
        tally[0] += time.perf_counter() - start
        tally[1] += 1
        tally[2] += sum(len(piece.tokens) for _, piece in pieces)
        return out

    shared.run_together = timed
    prompts = load_prompts(args.prompts)
    texts = [pair.tokenizer.apply_chat_template(list(p.messages), tokenize=False, add_generation_prompt=True)
             for p in prompts]
    generate_many(pair.target, texts[:2], draft=pair.draft, tokenizer=pair.tokenizer,
                  max_new_tokens=8)  # untimed: the planner's cost curves measured or read
    runs = []
    for temperature in args.temperature:
        for method in args.methods:
            config = DecodeConfig.parse(method)
            for n in args.sequences:
                spent.clear()
                start = time.perf_counter()
                results = generate_many(pair.target, texts[:n], draft=pair.draft, tokenizer=pair.tokenizer,
                                        configs=[config] * n, max_new_tokens=args.max_new_tokens,
                                        temperature=temperature, seed=1, eos_token_ids=[],
                                        **({"sampler": "gumbel"} if temperature > 0 else {}))
                wall = time.perf_counter() - start
                tokens = sum(len(r.token_ids) for r in results)
                inside = sum(v[0] for v in spent.values())
                run = {"method": method, "temperature": temperature, "sequences": n, "wall_seconds": wall,
                       "tokens": tokens, "tokens_per_second": tokens / wall,
                       "passes": {role: {"seconds": v[0], "passes": v[1], "rows": v[2]} for role, v in spent.items()},
                       "outside_passes_seconds": wall - inside}
                runs.append(run)
                parts = ", ".join(f"{role} {v[0]:.2f} s in {v[1]} passes of {v[2] / max(v[1], 1):.1f} rows"
                                  for role, v in spent.items())
                print(f"T={temperature:g} {method:5s} N={n}: {wall:6.2f} s, {tokens / wall:5.1f} tok/s; {parts}; "
                      f"outside the passes {wall - inside:.2f} s ({(wall - inside) / wall:.0%})", flush=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "machine": machine,
                                          "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
