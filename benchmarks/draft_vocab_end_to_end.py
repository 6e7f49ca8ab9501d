"""The trimmed draft head end to end: plain decoding, the default method with the draft's full head
and with its head trimmed to the most frequent ids (``--draft-vocab``), alternated on chat.

The per-token figures (``draft_vocab.py``) say what a draft token costs with each head and how
often the trimmed draft still agrees with the target; this script measures what a user gets: the
whole default method (planner, drafts, verification) with each draft on the same loaded target,
tokens per second with one client (``generate``, one prompt at a time) and with four
(``generate_many``, four prompts sharing each pass, as ``specdec serve --parallel 4`` runs them).
For each round the three run in an order that turns by one place from round to round, so machine
drift falls on all; per prompt (one client) or per group of four (four clients) it reports the
median tokens per second of each, the per-round ratios trimmed / full and full / ar, the target
forwards and the tokens drafted and kept, and whether every answer is plain decoding's. Greedy,
or at T > 0 the Gumbel-max sampler with one seed per prompt (so all three draw the same text).

    python benchmarks/draft_vocab_end_to_end.py --prompts sharegpt:8 --rounds 2 --max-new-tokens 64 \\
        --temperature 0 1 --out benchmarks/draft-vocab-end-to-end.json

``--draft-quant q4_0`` makes the cheaper draft's layers requantized as well (``specdec.requantize``;
``--draft-vocab all`` with it: requantized only); the report's ``trimmed`` is that cheaper draft.

Run it on an idle machine; the planner's measurements of each draft are made on first use (the
warm-up), as for a user.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from specdec import DecodeConfig, generate, generate_many, models
from specdec.bench.machine import machine_record
from specdec.cli.common import draft_vocab
from specdec.memory import keep_freed_memory
from specdec.prompts import load_prompts

METHODS = ("ar", "full", "trimmed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=models.DEFAULT_TARGET)
    parser.add_argument("--draft", default=models.DEFAULT_DRAFT)
    parser.add_argument("--draft-vocab", type=draft_vocab, default=models.DRAFT_VOCAB,
                        help="ids the trimmed head scores ('all': every id)")
    parser.add_argument("--draft-quant", default=None, help="the cheaper draft's layers requantized to this type (q4_0)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default="sharegpt:8", help="prompt sets, as specdec bench takes them")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("draft-vocab-end-to-end.json")))
    args = parser.parse_args()
    keep_freed_memory()
    prompts = load_prompts(args.prompts)
    pair = models.load_pair(args.target, args.draft, backend="gguf", n_threads=args.threads)
    target, tokenizer = pair.target, pair.tokenizer
    cheaper = pair.draft
    if args.draft_quant is not None:  # the same file's layers requantized, loaded as the CLI loads it
        located = models.requantized_draft(models.locate(args.draft, backend="gguf"), args.draft, args.draft_quant,
                                           "gguf", args.target)
        cheaper = models.load_model(located, "gguf", n_threads=args.threads)
    trimmed, kept = models.trim_draft(cheaper, tokenizer, args.draft_vocab, "gguf", eos_ids=target.generation_config.eos_token_id)
    drafts = {"full": pair.draft, "trimmed": trimmed}
    ids = [tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True) if p.chat
           else tokenizer(p.text)["input_ids"] for p in prompts]

    def settings(temperature: float, index: int) -> dict:
        extra = dict(sampler="gumbel", seed=index) if temperature > 0 else {}
        return dict(max_new_tokens=args.max_new_tokens, eos_token_ids=[], temperature=temperature, **extra)

    def run(method: str, group: list[int], temperature: float) -> dict:
        """The group's prompts (one: generate; several: generate_many) by one method: wall time and stats."""
        draft = drafts.get(method)
        t0 = time.perf_counter()
        if len(group) == 1:
            i = group[0]
            results = [generate(target, ids[i], draft=draft, config=DecodeConfig() if draft else None,
                                **settings(temperature, i))]
        else:
            configs = [DecodeConfig.parse("ar" if draft is None else "spec").replace(**settings(temperature, i))
                       for i in group]
            results = generate_many(target, [ids[i] for i in group], draft=draft, configs=configs)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "tokens": [r.token_ids for r in results],
                "new_tokens": sum(len(r.token_ids) for r in results),
                "forwards": sum(r.stats.target_forwards for r in results),
                "drafted": sum(r.stats.drafted_tokens for r in results),
                "accepted": sum(r.stats.accepted_tokens for r in results)}

    rows = []
    warm: set[int] = set()
    for temperature in args.temperature:
        for clients in args.clients:
            groups = [list(range(i, min(i + clients, len(ids)))) for i in range(0, len(ids), clients)]
            for group in groups:
                if clients not in warm:  # warm-up, once per group size: page faults, the planner's measurements
                    warm.add(clients)
                    for method in METHODS:
                        run(method, group, temperature)
                runs: dict[str, list[dict]] = {m: [] for m in METHODS}
                for round_ in range(args.rounds):
                    turn = round_ % len(METHODS)
                    for method in METHODS[turn:] + METHODS[:turn]:
                        runs[method].append(run(method, group, temperature))
                rate = {m: [r["new_tokens"] / r["seconds"] for r in runs[m]] for m in METHODS}
                trim_full = [t / f for t, f in zip(rate["trimmed"], rate["full"])]
                full_ar = [f / a for f, a in zip(rate["full"], rate["ar"])]
                plain = runs["ar"][0]["tokens"]
                row = {"temperature": temperature, "clients": clients,
                       "prompts": [prompts[i].id for i in group],
                       "tokens_per_second": {m: statistics.median(rate[m]) for m in METHODS},
                       "trimmed_over_full": trim_full, "full_over_ar": full_ar,
                       **{f"{m}_{k}": runs[m][-1][k] for m in METHODS for k in ("forwards", "drafted", "accepted")},
                       "identical": all(r["tokens"] == plain for m in METHODS for r in runs[m])}
                rows.append(row)
                print(f"T={temperature:g} clients={clients} {','.join(row['prompts'])}: tok/s ar "
                      f"{row['tokens_per_second']['ar']:.2f} full {row['tokens_per_second']['full']:.2f} "
                      f"trimmed {row['tokens_per_second']['trimmed']:.2f}; trimmed/full "
                      f"{statistics.median(trim_full):.3f} ({min(trim_full):.3f}-{max(trim_full):.3f}); kept/drafted "
                      f"full {row['full_accepted']}/{row['full_drafted']} trimmed {row['trimmed_accepted']}/"
                      f"{row['trimmed_drafted']}; identical {'yes' if row['identical'] else 'NO'}", flush=True)
    summary = []
    for temperature in args.temperature:
        for clients in args.clients:
            mine = [r for r in rows if r["temperature"] == temperature and r["clients"] == clients]
            ratios = [x for r in mine for x in r["trimmed_over_full"]]
            line = {"temperature": temperature, "clients": clients,
                    "trimmed_over_full_geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)),
                    "trimmed_over_full_range": [min(ratios), max(ratios)],
                    "full_over_ar_geomean": math.exp(statistics.fmean(
                        math.log(x) for r in mine for x in r["full_over_ar"])),
                    "acceptance_full": sum(r["full_accepted"] for r in mine) / max(1, sum(r["full_drafted"] for r in mine)),
                    "acceptance_trimmed": sum(r["trimmed_accepted"] for r in mine) / max(1, sum(r["trimmed_drafted"] for r in mine)),
                    "drafted_full": sum(r["full_drafted"] for r in mine),
                    "drafted_trimmed": sum(r["trimmed_drafted"] for r in mine),
                    "identical": all(r["identical"] for r in mine)}
            summary.append(line)
            print(json.dumps(line), flush=True)
    Path(args.out).write_text(json.dumps({
        "command": "python " + " ".join(sys.argv), "machine": machine_record(args.threads, models.gguf_path(args.target)),
        "draft_vocab": kept, "draft_quant": args.draft_quant, "load_average": Path("/proc/loadavg").read_text().split()[:3],
        "summary": summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
