"""Whether the coupled methods of a bench run drew the same text: under the Gumbel-max sampler the
output is a function of the prompt, the seed and the sampling options, so every coupled method on
one backend should give the same tokens for a prompt (the bench seeds each prompt the same way for
every method). Prints, per backend, how many prompts agree and where the others part.

    python benchmarks/coupled_text.py benchmarks/coupled/t1
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a bench run's temperature folder, e.g. benchmarks/coupled/t1")
    args = parser.parse_args()
    if not (args.run / "samples").is_dir():
        parser.error(f"{args.run} holds no samples/ folder: give a bench run's temperature folder (greedy/, t1/, ...)")
    outputs: dict[tuple[str, int], dict[str, list[int]]] = defaultdict(dict)
    for path in sorted((args.run / "samples").glob("*.json")):
        record = json.loads(path.read_text())
        method, sample = record["method"], record["sample"]
        if ":coupled" not in method:
            continue
        backend = "llamacpp" if "backend=llamacpp" in method else "torch"
        outputs[backend, sample["prompt"]][method] = sample["token_ids"]
    for backend in sorted({b for b, _ in outputs}):
        prompts = sorted(p for b, p in outputs if b == backend)
        same = 0
        for prompt in prompts:
            runs = outputs[backend, prompt]
            texts = {tuple(ids) for ids in runs.values()}
            if len(texts) == 1:
                same += 1
                continue
            first = min(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                        for x in texts for y in texts if x != y)
            print(f"{backend} prompt {prompt}: {len(texts)} different texts from {len(runs)} methods, "
                  f"first difference at new token {first}")
        methods = sorted({m for p in prompts for m in outputs[backend, p]})
        print(f"{backend}: {same}/{len(prompts)} prompts gave one text across {', '.join(methods)}")


if __name__ == "__main__":
    main()
