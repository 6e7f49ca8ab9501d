"""Multi-turn conversations against each server: every request re-sends the history.

Conversations of 4 turns (MT-Bench's two turns and two follow-ups; the `edit` task and three
follow-up edits: `specdec.prompts.load_conversations`) run on `specdec serve` (each method of
``--methods`` on each backend of ``--backends``, one server each, with that method as its
default; ``ar`` runs with ``--draft none``), on llama.cpp's own `llama-server` (built by
`benchmarks/build_llama_server.sh`) and on `llama-server --spec-default` (``--peers``), each its
own process on the default pair's GGUFs with the same threads, called by one client
(`specdec.bench.conversations`). A server's retrieval datastore is fed by its own outputs
(`specdec serve` without ``--datastore``), so a retrieval method sees the earlier turns and
conversations it answered. Writes every turn's figures as JSON and prints per server the whole
conversations' tokens per second against llama-server and against plain decoding on the same
backend, the tokens per target pass, the turns' time to first token and, greedy, whether each
answer equals plain decoding's on the same backend.

    python benchmarks/multi_turn.py --conversations mtbench:4,edit:4 --max-tokens 128 --threads 2 \\
        --out benchmarks/multi-turn.json

It needs llama-server: build it with `benchmarks/build_llama_server.sh`, or name a binary in
$SPECDEC_LLAMA_SERVER; without one it stops, before loading anything, saying so. ``--target`` and
``--draft`` take other packs or .gguf files (default: the default pair), e.g. ``--target
smollm2-135m --draft smollm2-135m --conversations mtbench:1 --max-tokens 8`` for a small run.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections import defaultdict
from pathlib import Path

from specdec import packs
from specdec.packs import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.prompts import load_conversations

PEERS = {"llama-server": "llama-server", "llama-server-spec-default": "llama-server --spec-default"}


def server_names(methods: list[str], backends: list[str], peers: list[str], ray: int = 0) -> dict[str, str]:
    """Name in the report -> :class:`~specdec.bench.servers.Servers` key. ``ray``: also each method
    on ``specdec serve --ray`` with that many replicas, once with the prefix router and once with
    ``--router load``."""
    names = {}
    for backend in backends:
        for method in methods:
            words = "--draft none" if method == "ar" else f"--method {method}"
            names[f"specdec serve --backend {backend} {words}"] = f"specdec:{backend}:{method}"
            if ray:
                for router, suffix in (("", ""), (" --router load", "/load")):
                    names[f"specdec serve --ray --replicas {ray}{router} --backend {backend} {words}"] = \
                        f"specdec:{backend}:{method}:ray={ray}{suffix}"
    return {**names, **{PEERS[p]: p for p in peers}}


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values))


def is_gguf(name: str) -> bool:
    return name in packs.PACKS or (Path(name).suffix.lower() == ".gguf" and Path(name).expanduser().is_file())


def summarize(runs: list[dict], names: dict[str, str], temperature: float) -> dict[str, dict]:
    """Per server (its name in the report): the figures the table prints, from the runs' records.
    Answers are compared with plain decoding's on the same backend only when greedy: at T > 0 each
    server draws its own samples (the multinomial sampler), equal in law, not token for token."""
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in runs:
        by[r["server"]][r["conversation"]] = r

    def rate(r):
        return r["new_tokens"] / r["seconds"]

    ref = by["llama-server"]
    summary = {}
    for name, key in names.items():
        mine = by[key]
        plain = by.get(f"specdec:{key.split(':')[1]}:ar") if key.startswith("specdec:") else None
        speed = [rate(mine[c]) / rate(ref[c]) for c in mine]
        turns = [t for c in mine for t in mine[c]["turns"]]
        later = [t for c in mine for t in mine[c]["turns"][1:]]
        summary[name] = {
            "tokens_per_second": sum(r["new_tokens"] for r in mine.values()) / sum(r["seconds"] for r in mine.values()),
            "vs_llama_server": geomean(speed), "worst_vs_llama_server": min(speed),
            "vs_plain": geomean([rate(mine[c]) / rate(plain[c]) for c in mine]) if plain else None,
            "tokens_per_pass": (sum(t["new_tokens"] for t in turns) / sum(t["new_tokens"] - t["accepted"] for t in turns)
                                if key.startswith("specdec:") else None),
            "answers_equal_plain": (sum(a == b for c in mine for a, b in zip(mine[c]["answers"], plain[c]["answers"])),
                                    sum(len(mine[c]["answers"]) for c in mine)) if plain and temperature == 0 else None,
            "second_turn_first_token_seconds": sum(mine[c]["turns"][1]["first_token_seconds"] for c in mine) / len(mine),
            "later_turns_first_token_seconds": sum(t["first_token_seconds"] for t in later) / len(later),
            "cached_share_later_turns": sum(t["cached_tokens"] or 0 for t in later) / sum(t["prompt_tokens"] for t in later),
        }
    return summary


def table(summary: dict[str, dict]) -> str:
    def fmt(value, form):
        return "–" if value is None else form(value)

    lines = ["| server | tokens/s over the conversations | vs llama-server (geomean per conversation) | worst | "
             "vs plain, same backend | tokens per target pass | answers equal plain (greedy) | "
             "2nd turn: time to first token (s) | turns 2-4: time to first token (s) | turns 2-4: prompt tokens reused |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in summary.items():
        lines.append(f"| `{name}` | {s['tokens_per_second']:.1f} | {s['vs_llama_server']:.2f}x | "
                     f"{s['worst_vs_llama_server']:.2f}x | {fmt(s['vs_plain'], lambda v: f'{v:.2f}x')} | "
                     f"{fmt(s['tokens_per_pass'], lambda v: f'{v:.2f}')} | "
                     f"{fmt(s['answers_equal_plain'], lambda v: f'{v[0]}/{v[1]}')} | "
                     f"{s['second_turn_first_token_seconds']:.2f} | "
                     f"{s['later_turns_first_token_seconds']:.2f} | {100 * s['cached_share_later_turns']:.0f}% |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="a pack name or a .gguf file (default: %(default)s)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="a pack name or a .gguf file (default: %(default)s)")
    parser.add_argument("--conversations", default="mtbench:4,edit:4", help="sets and counts: mtbench, edit")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default="spec,ar",
                        help="specdec serve's methods, one server each (default: %(default)s)")
    parser.add_argument("--backends", default="llamacpp", help="their backends: llamacpp, gguf (default: %(default)s)")
    parser.add_argument("--peers", default="llama-server,llama-server-spec-default",
                        help=f"llama-server's configurations: {', '.join(PEERS)} (default: %(default)s)")
    parser.add_argument("--ray", type=int, default=0, metavar="REPLICAS",
                        help="also run each method on specdec serve --ray with this many replicas (the threads "
                             "divided among them), with the prefix router and with --router load (default: none)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--report", default=None, metavar="JSON",
                        help="print the table of a run this script saved (--out), and run nothing")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        print(table(summarize(saved["runs"], saved["servers"], saved["settings"]["temperature"])))
        return 0
    methods, backends = args.methods.split(","), args.backends.split(",")
    peers = [p for p in args.peers.split(",") if p]
    if "llama-server" not in peers or set(peers) - set(PEERS) or set(backends) - {"llamacpp", "gguf"}:
        parser.error(f"--peers takes llama-server (the reference) and optionally the others of {', '.join(PEERS)}; "
                     "--backends takes llamacpp and gguf")
    from specdec.config import DecodeConfig
    for method in methods:
        try:
            DecodeConfig.parse(method)
        except ValueError as e:
            parser.error(f"--methods: {method}: {e}")
    # Every argument is checked before any model, tokenizer or server loads.
    if args.max_tokens < 1 or args.threads < 1 or args.temperature < 0:
        parser.error("--max-tokens and --threads take positive integers, --temperature 0 (greedy) or more")
    for flag, name in (("--target", args.target), ("--draft", args.draft)):
        if not is_gguf(name):
            parser.error(f"{flag}: {name} is neither a pack ({', '.join(packs.PACKS)}) nor a .gguf file; "
                         "every server here runs GGUF files on llama.cpp")
    try:
        conversations = load_conversations(args.conversations)
    except ValueError as e:
        parser.error(f"--conversations: {e}")
    # the servers' client and the models only now: --help and a wrong argument answer at once
    from specdec import models
    from specdec.backends.llamacpp import DEFAULT_CTX
    from specdec.bench.conversations import run_all
    from specdec.bench.servers import ServerMissing, Servers, llama_server_binary

    try:
        llama_server_binary()
    except ServerMissing as e:
        parser.error(f"{e} (this script compares specdec serve with llama-server)")
    target_gguf = models.gguf_path(args.target, progress=False)
    tokenizer = models.load_tokenizer(args.target)  # the GGUF's own: no torch conversion needed
    servers = Servers(target_gguf, models.gguf_path(args.draft, progress=False),
                      ["--target", args.target, "--draft", args.draft], n_threads=args.threads, n_ctx=DEFAULT_CTX)
    names = server_names(methods, backends, peers, args.ray)
    keys = list(names.values())
    try:
        runs = run_all(servers, keys, conversations, tokenizer, max_tokens=args.max_tokens,
                       temperature=args.temperature,
                       on_run=lambda r: print(f"{r.conversation} {r.server}: {r.seconds:.2f} s, {r.new_tokens} tokens, "
                                              f"first token {[round(t.first_token_seconds, 2) for t in r.turns]} s, "
                                              f"cached {[t.cached_tokens for t in r.turns]}", file=sys.stderr,
                                              flush=True))
    finally:
        servers.close()
    summary = summarize([r.to_dict() for r in runs], names, args.temperature)
    print(table(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": shlex.join(["python", "benchmarks/multi_turn.py", *sys.argv[1:]]),
                       "settings": vars(args), "servers": names, "summary": summary,
                       "runs": [r.to_dict() for r in runs]}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
