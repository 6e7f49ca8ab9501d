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
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections import defaultdict

from specdec import packs
from specdec.backends.llamacpp import DEFAULT_CTX
from specdec.bench.conversations import run_all
from specdec.bench.servers import Servers
from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.prompts import load_conversations

SERVERS = {  # name in the report -> Servers key
    "specdec serve": "specdec:llamacpp:spec",
    "specdec serve --draft none": "specdec:llamacpp:ar",
    "llama-server": "llama-server",
    "llama-server --spec-default": "llama-server-spec-default",
}


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", default="mtbench:4,edit:4")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(packs.pack_dir(DEFAULT_TARGET)))
    conversations = load_conversations(args.conversations)
    servers = Servers(packs.gguf_file(DEFAULT_TARGET), packs.gguf_file(DEFAULT_DRAFT),
                      ["--target", DEFAULT_TARGET, "--draft", DEFAULT_DRAFT], n_threads=args.threads, n_ctx=DEFAULT_CTX)
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
