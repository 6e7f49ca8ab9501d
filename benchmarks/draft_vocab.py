"""What a trimmed draft vocabulary saves and what it costs, on specdec's GGUF kernel.

Saves: the draft token's cost relative to a one-row step of the target, with the draft's full head
and with heads trimmed to the most frequent ``--sizes`` ids (``specdec.draft_vocab``: ranked on
Python's own source and documentation), and the head's own milliseconds; one-token cached steps
after a 200-token context, every model in turn in each round (interleaved, so drift falls on all),
median (and least) of ``--rounds`` rounds' medians of ``--steps`` steps.
Costs: a draft that scores only the kept ids can never propose another token. On held-out text
(the target's own greedy tokens in benchmark runs, ``--results``: ``ar`` samples on the kernel,
prompts the ranking never saw) it reports the subset's coverage (share of the target's tokens it
holds) and the greedy agreement of the draft with the target (draft argmax = target token, on the
target's continuation) with the full head and with each trimmed one: the acceptance a greedy chain
can have.

    python benchmarks/draft_vocab.py --results benchmarks/servers-chat-gguf/greedy/results.json \\
        --results benchmarks/default-pair-gguf-vs-llama-server/greedy/results.json --out benchmarks/draft-vocab.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from specdec import packs

SIZES = (8192, 16384, 32768, 65536)
RESULTS = ("benchmarks/servers-chat-gguf/greedy/results.json",
           "benchmarks/default-pair-gguf-vs-llama-server/greedy/results.json")


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text}")
    return value


def cpu_flags() -> list[str]:
    """The CPU's vector extensions the kernel's paths read (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx2", "avx512", "avx_vnni", "amx")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=packs.DEFAULT_TARGET)
    parser.add_argument("--draft", default=packs.DEFAULT_DRAFT)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="kept ids of each trimmed head, comma-separated")
    parser.add_argument("--results", action="append", default=None, help="a bench results.json (repeatable)")
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--rounds", type=positive, default=15)
    parser.add_argument("--steps", type=positive, default=4)
    parser.add_argument("--samples", type=positive, default=12, help="at most this many prompts of each results file")
    parser.add_argument("--draft-quant", default=None,
                        help="also the draft with its layers requantized to this type (q4_0; specdec.requantize), "
                             "with its full head and each trimmed one")
    parser.add_argument("--corpus-chars", type=positive, default=None,
                        help="characters of the ranking's corpus (default: specdec.draft_vocab.CORPUS_CHARS)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/draft-vocab.json"))
    args = parser.parse_args()
    sizes = [int(v) for v in args.sizes.split(",")]
    results = args.results or list(RESULTS)
    for path in results:
        if not Path(path).is_file():
            parser.error(f"--results: no such file {path}")
    # torch and the models only now: --help and a wrong argument answer at once
    import torch

    from specdec.memory import keep_freed_memory

    from specdec import draft_vocab, models, prompts
    from specdec.backends.gguf import kernel_path
    from specdec.backends.hf import eos_token_ids
    from specdec.bench.machine import read_speed

    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the specdec command does: vocabulary-sized tensors every step (specdec.memory)
    target, tokenizer = models.load(args.target, backend="gguf", n_threads=args.threads, n_ctx=2048)
    draft, _ = models.load(args.draft, backend="gguf", n_threads=args.threads, n_ctx=2048)
    vocab = draft.vocab_size
    began = time.perf_counter()
    ranking = draft_vocab.ranking(tokenizer, vocab, chars=args.corpus_chars, progress=True)
    ranking_seconds = time.perf_counter() - began
    always = draft_vocab.always_kept(tokenizer, [*eos_token_ids(target), *eos_token_ids(draft)])
    subsets = {size: draft_vocab.subset(ranking, size, always) for size in sizes}
    drafts = {"all": draft, **{str(size): draft.trimmed(ids) for size, ids in subsets.items()}}
    bases = {"": draft}  # the models whose held-out agreement is computed, by the prefix of their names
    if args.draft_quant:
        located = models.requantized_draft(models.locate(args.draft, backend="gguf"), args.draft, args.draft_quant,
                                           "gguf", args.target)
        requantized = models.load_model(located, "gguf", n_threads=args.threads, n_ctx=2048)
        prefix = f"{args.draft_quant} "
        bases[prefix] = requantized
        drafts.update({f"{prefix}all": requantized,
                       **{f"{prefix}{size}": requantized.trimmed(ids) for size, ids in subsets.items()}})

    # -- cost: one-token steps, interleaved ----------------------------------------------------
    context = torch.randint(100, 20000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    timed = {"target": target, **{f"draft, {name}": model for name, model in drafts.items()}}
    for model in timed.values():
        model.forward(context, 1)
    steps: dict[str, list[float]] = {name: [] for name in timed}
    heads: dict[str, list[float]] = {name: [] for name in drafts}
    w = draft.weights
    normed = torch.randn(1, w.hidden)
    out = torch.empty(1, vocab)
    for _ in range(args.rounds):
        for name, model in timed.items():
            times = []
            for i in range(args.steps):
                t0 = time.perf_counter()
                model.forward([1000 + i], 1)
                times.append(time.perf_counter() - t0)
            model.trim(len(context))
            steps[name].append(statistics.median(times) * 1000)
        for name, model in drafts.items():
            t0 = time.perf_counter()
            if model.head is None:
                model.weights.head(model.lib, normed, out, 1, False, model.n_threads)
            else:
                model.head(model.lib, normed, out, 1, model.n_threads)
            heads[name].append((time.perf_counter() - t0) * 1000)
    ms = {name: round(statistics.median(v), 3) for name, v in steps.items()}
    least = {name: round(min(v), 3) for name, v in steps.items()}  # the round least disturbed by other work
    head_ms = {name: round(statistics.median(v), 3) for name, v in heads.items()}
    ratio = {name.removeprefix("draft, "): round(m / ms["target"], 3) for name, m in ms.items() if name != "target"}
    ratio_least = {name.removeprefix("draft, "): round(m / least["target"], 3) for name, m in least.items()
                   if name != "target"}

    # -- what it costs: coverage and greedy agreement on held-out text --------------------------
    sets: dict[str, dict[str, prompts.Prompt]] = {}
    held_out: dict[str, dict] = {}
    for path in results:
        data = json.loads(Path(path).read_text())
        listed = data["prompts"]
        seen: set[int] = set()
        tokens_all: list[int] = []
        agree = {name: 0 for name in drafts}
        positions = 0
        for sample in data["samples"]:
            if not sample["method"].split(":")[0] == "ar" or "backend=gguf" not in sample["method"] \
                    or "via=" in sample["method"] or sample["prompt"] in seen or len(seen) >= args.samples:
                continue
            seen.add(sample["prompt"])
            info = listed[sample["prompt"]]
            if info["set"] not in sets:
                sets[info["set"]] = {p.id: p for p in prompts.load_set(info["set"])}
            prompt_ids = sets[info["set"]][info["id"]].token_ids(tokenizer)
            out_ids = list(sample["token_ids"])
            tokens_all += out_ids
            truth = torch.tensor(out_ids)
            for prefix, base in bases.items():
                base.reset()
                logits = base.forward(prompt_ids + out_ids[:-1])[len(prompt_ids) - 1:]  # [len(out), V]
                agree[f"{prefix}all"] += int((logits.argmax(-1) == truth).sum())
                for size, ids in subsets.items():
                    index = torch.tensor(ids)
                    agree[f"{prefix}{size}"] += int((index[logits[:, index].argmax(-1)] == truth).sum())
            positions += len(out_ids)
        held_out[path] = {
            "prompts": len(seen), "tokens": len(tokens_all),
            "coverage": {str(size): round(draft_vocab.coverage(tokens_all, ids), 4) for size, ids in subsets.items()},
            "greedy_agreement": {name: round(n / max(1, positions), 4) for name, n in agree.items()},
        }

    report = {
        "target": args.target, "draft": args.draft, "vocab": vocab, "threads": args.threads,
        "kernel_path": kernel_path(draft.lib), "cpu_flags": cpu_flags(), "machine": platform.machine(),
        "memory_read": read_speed(args.threads), "load_average_at_start": list(os.getloadavg()),
        "ranking": {"corpus": ranking.corpus, "ids_seen": ranking.seen, "seconds": round(ranking_seconds, 1),
                    "always_kept": len(always)},
        "step_ms_median": ms, "step_ms_min": least, "head_ms_median": head_ms, "draft_token_over_target_step": ratio,
        "draft_token_over_target_step_min": ratio_least,
        "held_out": held_out, "rounds": args.rounds, "steps": args.steps,
        "command": "python benchmarks/draft_vocab.py " + " ".join(f"--results {p}" for p in results)
                   + f" --sizes {args.sizes} --threads {args.threads} --rounds {args.rounds} --steps {args.steps}"
                   + f" --samples {args.samples} --out {args.out}"
                   + "".join(f" --{k.replace('_', '-')} {v}" for k, v in (("target", args.target), ("draft", args.draft),
                                                                         ("corpus_chars", args.corpus_chars),
                                                                         ("draft_quant", args.draft_quant))
                             if v != parser.get_default(k)),
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
