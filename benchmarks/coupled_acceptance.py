"""What coupling costs in acceptance, on the default pair's real distributions, without sampling noise.

For each position of fixed texts, the target's law p and the draft's q at temperature T give the
acceptance probability of one draft token exactly: rejection sampling (token verification, and
block verification's first position) keeps it with probability 1 - TV(p, q); coupled verification
(the Gumbel-max sampler, shared noise) with sum_v p_v q_v / sum_u max(p_u q_v, q_u p_v) (Daliri,
Musco and Suresh 2024), between (1 - TV) / (1 + TV) and 1 - TV, summed over the whole vocabulary
(``specdec.verify.coupled.acceptance``). The texts are the prompts of a bench set with the target's
own continuation (plain Gumbel-max decoding at T = 1, seed 0), so the contexts are the ones the
sampler meets. Writes a JSON file.

    python benchmarks/coupled_acceptance.py --prompts humaneval:4,mtbench:4,edit:4 --tokens 96 \
        --temperatures 0.7 1 1.5 --threads 2 --out benchmarks/coupled-acceptance.json

``--target``/``--draft`` take other packs or .gguf files (default: the default pair), e.g.
``--target smollm2-135m --draft smollm2-135m`` for a small run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from specdec import packs
from specdec.prompts import load_prompts

if TYPE_CHECKING:
    import numpy as np


def acceptances(p: np.ndarray, q: np.ndarray) -> tuple[float, float]:
    """(1 - TV, the coupled acceptance) for one position."""
    import numpy as np

    from specdec.verify.coupled import acceptance

    return float(np.minimum(p, q).sum()), acceptance(p, q)


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text}")
    return value


def temperature(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"takes a temperature, 0 (greedy) or more, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=packs.DEFAULT_TARGET, help="a pack name or a .gguf file (run on llama.cpp)")
    parser.add_argument("--draft", default=packs.DEFAULT_DRAFT, help="a pack name or a .gguf file (run on llama.cpp)")
    parser.add_argument("--prompts", default="humaneval:4,mtbench:4,edit:4")
    parser.add_argument("--tokens", type=positive, default=96, help="new tokens per text")
    parser.add_argument("--temperatures", type=temperature, nargs="+", default=[0.7, 1.0, 1.5])
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/coupled-acceptance.json"))
    args = parser.parse_args()
    try:
        prompts = load_prompts(args.prompts)
    except ValueError as e:
        parser.error(f"--prompts: {e}")
    # torch and the models only now: --help and a wrong argument answer at once
    from specdec import generate, models
    from specdec.sampling import SamplingConfig, logits_to_probs

    start = time.perf_counter()
    target, tokenizer = models.load(args.target, backend="llamacpp", n_threads=args.threads, progress=False)
    draft, _ = models.load(args.draft, backend="llamacpp", n_threads=args.threads, progress=False)
    rows: dict[float, list[tuple[float, float]]] = {t: [] for t in args.temperatures}
    per_prompt = []
    for prompt in prompts:
        ids = prompt.token_ids(tokenizer)
        text = generate(target, ids, sampler="gumbel", temperature=1.0, seed=0, max_new_tokens=args.tokens,
                        eos_token_ids=[]).token_ids
        logits = {}
        for name, model in (("p", target), ("q", draft)):
            model.reset()
            logits[name] = model.forward(ids + text[:-1], num_logits=len(text)).double()  # [tokens, V]
        entry = {"prompt": prompt.id}
        for t in args.temperatures:
            law = SamplingConfig(temperature=t)
            p, q = logits_to_probs(logits["p"], law).numpy(), logits_to_probs(logits["q"], law).numpy()
            found = [acceptances(p[i], q[i]) for i in range(len(text))]
            rows[t] += found
            entry[f"T={t:g}"] = {"rejection": statistics.fmean(r for r, _ in found),
                                 "coupled": statistics.fmean(c for _, c in found)}
        per_prompt.append(entry)
        print(entry, flush=True)
    summary = {}
    for t, found in rows.items():
        rejection = statistics.fmean(r for r, _ in found)
        coupled = statistics.fmean(c for _, c in found)
        tv = [1 - r for r, _ in found]
        summary[f"T={t:g}"] = {
            "positions": len(found),
            "rejection_alpha": rejection,  # mean of 1 - TV
            "coupled_alpha": coupled,
            "coupled_over_rejection": coupled / rejection,
            "bound_alpha": statistics.fmean((1 - d) / (1 + d) for d in tv),  # mean of (1 - TV) / (1 + TV)
        }
    out = {"command": "python benchmarks/coupled_acceptance.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items()),
           "target": args.target, "draft": args.draft, "backend": "llamacpp",
           "summary": summary, "prompts": per_prompt, "seconds": time.perf_counter() - start}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
