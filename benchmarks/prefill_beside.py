"""A short request beside a long prompt's prefill, through ``specdec serve --parallel N``, with the
shared passes' budget off (every pass carries a whole 64-row chunk of the prompt) and on, in turn.

Each round sends, for each setting in turn: the short request alone (a greedy completion of
``--short-tokens`` tokens, end of text ignored), then a cold prompt of ``--long-tokens`` tokens
(its numbers differ every time, so that no cache holds it) and, ``--delay`` seconds later, the short
request again. Both are streamed; per request the script records the time from sending to the last
chunk, to the first chunk, and the inter-token latencies (each chunk's wait since the previous
chunk divided among its tokens). The server runs in this process (uvicorn on a thread), the
budget switched between runs on its shared passes (:attr:`specdec.backends.shared.SharedPasses.budget`;
``--budgets``: none, and the default, unless told otherwise).

    python benchmarks/prefill_beside.py --target smollm2-135m --draft smollm2-135m --parallel 4 \
        --rounds 2 --out benchmarks/prefill-beside.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from specdec import models
from specdec.backends.shared import PASS_BUDGET
from specdec.bench.concurrency import spread, token_gaps
from specdec.bench.machine import machine_record
from specdec.models import Pair
from specdec.server.app import ServerOptions, create_app
from specdec.server.requests import method_config

SHORT_PROMPT = "def fibonacci(n):"


def stream(url: str, body: dict) -> dict:
    """Send a streamed completion; its seconds, first-chunk seconds, tokens and inter-token latencies."""
    sent = time.perf_counter()
    arrivals = []
    with httpx.Client(trust_env=False, timeout=600) as http:
        with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{response.status_code}: {response.read().decode()}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                ids = (chunk.get("speculative") or {}).get("token_ids") or []
                if ids:
                    arrivals.append((time.perf_counter() - sent, len(ids)))
    gaps = token_gaps(arrivals)
    return {"seconds": time.perf_counter() - sent, "first_token": arrivals[0][0] if arrivals else None,
            "tokens": sum(n for _, n in arrivals), "inter_token_seconds": spread(gaps)}


def long_prompt(tokenizer, tokens: int, salt: int) -> list[int]:
    """``tokens`` token ids of a list of numbers that no earlier prompt began with."""
    text = f"Series {salt}: " + ", ".join(str(salt * 100003 + 7 * k) for k in range(tokens))
    return tokenizer(text)["input_ids"][:tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=3000)
    parser.add_argument("--short-tokens", type=int, default=48)
    parser.add_argument("--delay", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budgets", nargs="+", default=["none", str(PASS_BUDGET)],
                        help="the budgets run in turn in each round: none (whole 64-row chunks) or a multiple")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    budgets = [None if b == "none" else float(b) for b in args.budgets]

    pair = models.load_pair(args.target, args.draft, backend="gguf", n_threads=args.threads)
    served = Pair(pair.target, pair.tokenizer, pair.draft, target_name=args.target, draft_name=args.draft,
                  backend="gguf")
    app = create_app(served, ServerOptions(method_config("spec", True), parallel=args.parallel))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    passes = app.state.specdec.engine.pool.passes
    short = {"prompt": SHORT_PROMPT, "max_tokens": args.short_tokens, "temperature": 0, "ignore_eos": True}
    long_tokens = None
    stream(url, {**short, "max_tokens": 4})  # warm-up (and the cost curves, measured at start)

    runs = []
    salt = 1
    for round_ in range(args.rounds):
        for budget in budgets:
            passes.budget = budget
            alone = stream(url, short)
            prompt = long_prompt(pair.tokenizer, args.long_tokens, salt)
            salt += 1
            long_tokens = len(prompt)
            got: dict = {}
            sender = threading.Thread(target=lambda: got.update(long=stream(url, {"prompt": prompt, "max_tokens": 8,
                                                                                   "temperature": 0})))
            sender.start()
            time.sleep(args.delay)
            got["short"] = stream(url, short)
            sender.join()
            run = {"round": round_, "budget": budget, "short_alone": alone, "short_beside": got["short"],
                   "long": got["long"]}
            runs.append(run)
            if args.out:  # after each run: what ran is kept, should the process end early
                args.out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1) + "\n")
            print(f"round {round_} budget {budget}: short alone {alone['seconds']:.2f} s, beside the prompt "
                  f"{got['short']['seconds']:.2f} s (inter-token p50 {got['short']['inter_token_seconds']['p50']}, "
                  f"p95 {got['short']['inter_token_seconds']['p95']}); the prompt's first token "
                  f"{got['long']['first_token']:.2f} s", file=sys.stderr, flush=True)
    server.should_exit = True

    def median(budget, key, field):
        return statistics.median(r[key][field] for r in runs if r["budget"] == budget)

    summary = {str(b): {"short_alone_seconds": median(b, "short_alone", "seconds"),
                        "short_beside_seconds": median(b, "short_beside", "seconds"),
                        "long_first_token_seconds": median(b, "long", "first_token")} for b in budgets}
    machine = machine_record(args.threads, None, why_no_target="not measured here")
    record = {"command": " ".join(sys.argv), "machine": machine,
              "target": args.target, "draft": args.draft,
              "threads": args.threads, "parallel": args.parallel, "long_prompt_tokens": long_tokens,
              "short_tokens": args.short_tokens, "delay_seconds": args.delay, "pass_budget": PASS_BUDGET,
              "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
