"""Where a plain-decoding step's time goes on the llama.cpp backend, as `specdec serve` runs it.

Runs `specdec.stream` (plain decoding, greedy, with the tokenizer, as the server calls it) on the
default target's GGUF and times, per generated token: llama.cpp's `llama_decode`, the rest of the
backend's forward (filling the batch, reading the logits row into numpy), the sampler
(`specdec.sampling.next_token`) and the stream's text (detokenising, stop strings), and what is
left of the step (the engine, the stats). Then it runs the same generation on a second thread,
first after the main thread has decoded (the threads of two OpenMP pools outnumber the cores) and
then in a fresh process where that thread is the only one to decode, which is how `specdec serve`
runs its models.

    python benchmarks/request_path.py --tokens 128 --threads 2 --out benchmarks/request-path.json

``--model`` takes another pack or a .gguf file (default: the default target), e.g.
``--model smollm2-135m`` for a small run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from specdec import packs
from specdec.packs import DEFAULT_TARGET
from specdec.prompts import load_prompts


def timed(owner, name, totals):
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0

    setattr(owner, name, wrapper)
    return inner


def breakdown(model, tokenizer, prompt, tokens):
    import specdec
    import specdec.api as api_module
    import specdec.engine as engine
    from specdec.backends import llamacpp

    totals = defaultdict(float)
    api = llamacpp._api()
    saved = [(api, "llama_decode", timed(api, "llama_decode", totals)),
             (llamacpp.LlamaCppCausalLM, "_decode", timed(llamacpp.LlamaCppCausalLM, "_decode", totals)),
             (api_module._Run, "_advance_text", timed(api_module._Run, "_advance_text", totals))]
    saved.append((engine, "next_token", timed(engine, "next_token", totals)))
    try:
        arrivals, first = [], {}
        for _ in specdec.stream(model, prompt, tokenizer=tokenizer, max_new_tokens=tokens, temperature=0.0,
                                eos_token_ids=[]):
            arrivals.append(time.perf_counter())
            first = first or dict(totals)  # what the first step (the prefill) took is left out
    finally:
        for owner, name, inner in saved:
            setattr(owner, name, inner)
    steps = len(arrivals) - 1
    step_ms = 1000 * (arrivals[-1] - arrivals[0]) / steps
    return {"step_ms": step_ms, "ms": {k: 1000 * (v - first.get(k, 0.0)) / steps for k, v in totals.items()}}


def decode_ms(model, prompt, tokens):
    import specdec

    arrivals = []
    for _ in specdec.stream(model, prompt, max_new_tokens=tokens, temperature=0.0, eos_token_ids=[]):
        arrivals.append(time.perf_counter())
    return 1000 * (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


def on_thread(fn, *args):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    return out[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET, help="a pack name or a .gguf file (run on llama.cpp)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--only-thread", metavar="IDS", help=argparse.SUPPRESS)  # the fresh-process run, on the prompt's ids
    args = parser.parse_args()
    if args.tokens < 2 or args.threads < 1:
        parser.error("--tokens takes 2 or more (a step follows the first token), --threads 1 or more")
    if args.model not in packs.PACKS and not (Path(args.model).suffix.lower() == ".gguf" and Path(args.model).is_file()):
        parser.error(f"--model: {args.model} is neither a pack ({', '.join(packs.PACKS)}) nor a .gguf file")
    # torch and the models only now: --help and a wrong argument answer at once
    import torch

    from specdec import models
    from specdec.backends import llamacpp

    torch.set_num_threads(args.threads)
    gguf = models.gguf_path(args.model, progress=False)
    if args.only_thread:  # the prompt's ids come from the parent: no tokenizer to read
        model = llamacpp.load_gguf(gguf, n_threads=args.threads, prefill_layout="repacked")
        print(json.dumps([on_thread(decode_ms, model, json.loads(args.only_thread), args.tokens) for _ in range(2)]))
        return 0
    tokenizer = models.load_tokenizer(args.model)  # the GGUF's own: no torch-converted pack needed
    prompt = load_prompts("humaneval:1")[0].token_ids(tokenizer)
    model = llamacpp.load_gguf(gguf, n_threads=args.threads, prefill_layout="repacked")
    decode_ms(model, prompt, 16)  # warm-up
    main_runs = [breakdown(model, tokenizer, prompt, args.tokens) for _ in range(2)]
    second = [on_thread(decode_ms, model, prompt, args.tokens) for _ in range(2)]
    done = subprocess.run([sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens), "--threads",
                           str(args.threads), "--only-thread", json.dumps(prompt)], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the fresh process failed with status {done.returncode}:\n{done.stderr[-3000:]}")
    fresh = json.loads(done.stdout.strip().splitlines()[-1])
    best = min(main_runs, key=lambda r: r["step_ms"])
    parts = best["ms"]
    known = parts["_decode"] + parts["next_token"] + parts["_advance_text"]
    result = {
        "command": " ".join(["python", "benchmarks/request_path.py", *sys.argv[1:]]),
        "model": args.model, "threads": args.threads, "tokens": args.tokens, "prompt_tokens": len(prompt),
        "main_thread_step_ms": [round(r["step_ms"], 2) for r in main_runs],
        "per_token_ms": {
            "llama_decode": round(parts["llama_decode"], 3),
            "batch_and_logits_copy": round(parts["_decode"] - parts["llama_decode"], 3),
            "sampling": round(parts["next_token"], 3),
            "text": round(parts["_advance_text"], 3),
            "rest_of_step": round(best["step_ms"] - known, 3),
        },
        "step_ms": round(best["step_ms"], 2),
        "second_thread_after_main_step_ms": [round(x, 2) for x in second],
        "only_thread_step_ms": [round(x, 2) for x in fresh],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
