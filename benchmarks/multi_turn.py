"""Multi-turn conversations against each server: every request re-sends the history.

Conversations of 4 turns (MT-Bench's two turns and two follow-ups; the `edit` task and three
follow-up edits: `specdec.prompts.load_conversations`) run on `specdec serve` (the default
method, and `--draft none`), on llama.cpp's own `llama-server` (built by
`benchmarks/build_llama_server.sh`) and on `llama-server --spec-default`, each its own process on
the default pair's GGUFs with the same threads, called by one client
(`specdec.bench.conversations`). Writes every turn's figures as JSON and prints per server the
whole conversations' tokens per second and the turns' time to first token, against llama-server.

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

SERVERS = {  # name in the report -> Servers key
    "specdec serve": "specdec:llamacpp:spec",
    "specdec serve --draft none": "specdec:llamacpp:ar",
    "llama-server": "llama-server",
    "llama-server --spec-default": "llama-server-spec-default",
}


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values))


def is_gguf(name: str) -> bool:
    return name in packs.PACKS or (Path(name).suffix.lower() == ".gguf" and Path(name).expanduser().is_file())


def gguf_of(name: str) -> Path:
    """The GGUF a pack name or .gguf path stands for (a pack's joined and hash-checked)."""
    return packs.gguf_file(name, progress=False) if name in packs.PACKS else Path(name).expanduser()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="a pack name or a .gguf file (default: %(default)s)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="a pack name or a .gguf file (default: %(default)s)")
    parser.add_argument("--conversations", default="mtbench:4,edit:4", help="sets and counts: mtbench, edit")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
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
    target = packs.PACKS.get(args.target)
    target_gguf = gguf_of(args.target)
    tokenizer = models._gguf_tokenizer(target, target_gguf, None)  # the GGUF's own: no torch conversion needed
    servers = Servers(target_gguf, gguf_of(args.draft),
                      ["--target", args.target, "--draft", args.draft], n_threads=args.threads, n_ctx=DEFAULT_CTX)
    keys = list(SERVERS.values())
    try:
        runs = run_all(servers, keys, conversations, tokenizer, max_tokens=args.max_tokens,
                       temperature=args.temperature,
                       on_run=lambda r: print(f"{r.conversation} {r.server}: {r.seconds:.2f} s, {r.new_tokens} tokens, "
                                              f"first token {[round(t.first_token_seconds, 2) for t in r.turns]} s, "
                                              f"cached {[t.cached_tokens for t in r.turns]}", file=sys.stderr))
    finally:
        servers.close()
    by = defaultdict(dict)
    for r in runs:
        by[r.server][r.conversation] = r
    ref = by["llama-server"]
    summary = {}
    for name, key in SERVERS.items():
        mine = by[key]
        speed = [(mine[c].new_tokens / mine[c].seconds) / (ref[c].new_tokens / ref[c].seconds) for c in mine]
        second = [mine[c].turns[1].first_token_seconds for c in mine]
        later = [t.first_token_seconds for c in mine for t in mine[c].turns[1:]]
        summary[name] = {
            "tokens_per_second": sum(r.new_tokens for r in mine.values()) / sum(r.seconds for r in mine.values()),
            "vs_llama_server": geomean(speed), "worst_vs_llama_server": min(speed),
            "second_turn_first_token_seconds": sum(second) / len(second),
            "later_turns_first_token_seconds": sum(later) / len(later),
            "cached_share_later_turns": sum(t.cached_tokens or 0 for c in mine for t in mine[c].turns[1:])
            / sum(t.prompt_tokens for c in mine for t in mine[c].turns[1:]),
        }
    lines = ["| server | tokens/s over the conversations | vs llama-server (geomean per conversation) | worst | "
             "2nd turn: time to first token (s) | turns 2-4: time to first token (s) | turns 2-4: prompt tokens reused |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in summary.items():
        lines.append(f"| `{name}` | {s['tokens_per_second']:.1f} | {s['vs_llama_server']:.2f}x | "
                     f"{s['worst_vs_llama_server']:.2f}x | {s['second_turn_first_token_seconds']:.2f} | "
                     f"{s['later_turns_first_token_seconds']:.2f} | {100 * s['cached_share_later_turns']:.0f}% |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": shlex.join(["python", "benchmarks/multi_turn.py", *sys.argv[1:]]),
                       "settings": vars(args), "servers": SERVERS, "summary": summary,
                       "runs": [r.to_dict() for r in runs]}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
