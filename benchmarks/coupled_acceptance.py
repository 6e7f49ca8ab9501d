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
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from specdec import generate, models
from specdec.prompts import load_prompts
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.verify.coupled import acceptance


def acceptances(p: np.ndarray, q: np.ndarray) -> tuple[float, float]:
    """(1 - TV, the coupled acceptance) for one position."""
    return float(np.minimum(p, q).sum()), acceptance(p, q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="humaneval:4,mtbench:4,edit:4")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per text")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/coupled-acceptance.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    target, tokenizer = models.load(models.DEFAULT_TARGET, backend="llamacpp", n_threads=args.threads, progress=False)
    draft, _ = models.load(models.DEFAULT_DRAFT, backend="llamacpp", n_threads=args.threads, progress=False)
    rows: dict[float, list[tuple[float, float]]] = {t: [] for t in args.temperatures}
    per_prompt = []
    for prompt in load_prompts(args.prompts):
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
           "target": models.DEFAULT_TARGET, "draft": models.DEFAULT_DRAFT, "backend": "llamacpp",
           "summary": summary, "prompts": per_prompt, "seconds": time.perf_counter() - start}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
