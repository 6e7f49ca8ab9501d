"""One client against ``specdec serve`` with its default slots and with ``--parallel 1``.

A server with slots (``--parallel N``, the default on the GGUF kernel) runs each request's passes
through the shared-pass executor even when the request is alone. This measures what that costs a
single client: both servers are started side by side on the same files (each idle while the other
answers), and the prompts are sent to one and then the other, alternating which goes first, so
that machine drift falls on both. Each request streams ``--max-tokens`` tokens from the chat
endpoint, greedy, end of text ignored; a request's speed is its completion tokens over its time from sending to the
stream's end. Prints each server's median tokens per second, the ratio of the paired requests'
speeds (median and a bootstrap 95% interval), whether the answers are identical, and writes JSON
with every request and the machine record (:func:`specdec.bench.machine.machine_record`).

    python benchmarks/one_client_slots.py --prompts sharegpt:8 --repeats 2 --out benchmarks/one-client-slots.json

Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specdec.bench.machine import machine_record
from specdec.bench.servers import chat_request_body, free_port
from specdec.models import gguf_path
from specdec.prompts import load_prompts

SERVERS = {"default": [], "parallel-1": ["--parallel", "1"]}


def start(name: str, extra: list[str], args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "specdec", "serve", "--target", args.target, "--draft", args.draft,
            "--backend", "gguf", "--threads", str(args.threads), "--port", str(port), "--log-level", "warning",
            *extra]
    log = open(Path(tempfile.gettempdir()) / f"one-client-slots.{name}.log", "w")  # the server's own lines
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name}: specdec serve exited ({process.returncode}); see its log")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{name}: specdec serve did not start in 600 s")


def ask(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = chat_request_body(messages, 0.0, max_tokens, seed=0, ignore_eos=True)  # every answer its full length
    sent = time.perf_counter()
    text, tokens = [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600, trust_env=False) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    seconds = time.perf_counter() - sent
    return {"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds, "text": "".join(text)}


def bootstrap(ratios: list[float], draws: int = 10000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default="sharegpt:8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(Path(__file__).with_name("one-client-slots.json")))
    args = parser.parse_args()
    machine = machine_record(args.threads, gguf_path(args.target))
    prompts = load_prompts(args.prompts)
    servers = {name: start(name, extra, args) for name, extra in SERVERS.items()}
    try:
        for name, (_, url) in servers.items():  # untimed warm-up
            ask(url, [{"role": "user", "content": "Say hello."}], 8)
        rows = []
        for repeat in range(args.repeats):
            for i, prompt in enumerate(prompts):
                order = list(SERVERS) if (i + repeat) % 2 == 0 else list(SERVERS)[::-1]
                row = {"prompt": prompt.id, "repeat": repeat, "first": order[0]}
                for name in order:
                    row[name] = ask(servers[name][1], list(prompt.messages), args.max_tokens)
                rows.append(row)
                print(f"{prompt.id} #{repeat}: " + ", ".join(f"{n} {row[n]['tokens_per_second']:.2f} tok/s"
                                                            for n in SERVERS), flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait()
    ratios = [r["default"]["tokens_per_second"] / r["parallel-1"]["tokens_per_second"] for r in rows]
    low, high = bootstrap(ratios)
    summary = {
        "median_tokens_per_second": {n: statistics.median(r[n]["tokens_per_second"] for r in rows) for n in SERVERS},
        "ratio_default_to_parallel_1": {"median": statistics.median(ratios), "bootstrap_95": [low, high]},
        "identical_text": sum(r["default"]["text"] == r["parallel-1"]["text"] for r in rows), "requests": len(rows),
    }
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "machine": machine,
                                          "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
