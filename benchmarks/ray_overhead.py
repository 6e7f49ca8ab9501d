"""What Ray Serve costs and gives on one machine: ``specdec serve`` alone against the same models
deployed on a local Ray Serve (``specdec.cluster``), with one replica of all the threads (the Ray
path's overhead) and with one replica per thread (what a second replica costs and gives).

The three are started side by side on the same files (each idle while another answers) and timed
in turns, the order rotating each round, so that machine drift falls on all. In each turn
``--clients`` clients send their share of the prompts at once, each request streaming
``--max-tokens`` tokens from the chat endpoint, greedy, end of text ignored. A turn's figures:
aggregate tokens per second (every completion token over the turn's wall time) and the median
time to first token. Every answer is compared with ``specdec serve``'s. Prints the medians over
the rounds and writes JSON with every turn and the machine record.

    python benchmarks/ray_overhead.py --rounds 3 --out benchmarks/ray-overhead.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ray
from ray import serve

from specdec.bench.machine import machine_record
from specdec.bench.servers import chat_request_body, free_port
from specdec.models import gguf_path
from specdec.prompts import load_prompts
from specdec.ray import app as ray_app


def start_serve(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "specdec", "serve", "--target", args.target, "--draft", args.draft,
            "--backend", "gguf", "--threads", str(args.threads), "--parallel", str(args.clients),
            "--port", str(port), "--log-level", "warning"]
    log = open(Path(tempfile.gettempdir()) / "ray-overhead.serve.log", "w")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"specdec serve exited ({process.returncode}); see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("specdec serve did not start in 600 s")


def deploy(name: str, replicas: int, args: argparse.Namespace, port: int) -> tuple[str, float]:
    """One Ray Serve application of ``replicas`` replicas sharing ``args.threads`` threads and
    ``args.clients`` slots; its URL and the seconds it took to deploy."""
    started = time.monotonic()
    serve.run(ray_app({"target": args.target, "draft": args.draft, "backend": "gguf", "replicas": replicas,
                       "threads": args.threads // replicas, "parallel": max(1, args.clients // replicas)}),
              name=name, route_prefix=f"/{name}")
    return f"http://127.0.0.1:{port}/{name}", time.monotonic() - started


def ask(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = chat_request_body(messages, 0.0, max_tokens, seed=0, ignore_eos=True)
    sent = time.perf_counter()
    first, text, tokens = None, [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900, trust_env=False) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - sent
                text.append(piece)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"seconds": time.perf_counter() - sent, "first_token": first, "tokens": tokens, "text": "".join(text)}


def turn(url: str, prompts: list, args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        answers = list(pool.map(lambda p: ask(url, list(p.messages), args.max_tokens), prompts))
    wall = time.perf_counter() - started
    return {"wall": wall, "tokens_per_second": sum(a["tokens"] for a in answers) / wall,
            "first_token_median": statistics.median(a["first_token"] for a in answers), "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prompts", default="sharegpt:8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).with_name("ray-overhead.json")))
    args = parser.parse_args()
    machine = machine_record(args.threads, gguf_path(args.target))
    prompts = load_prompts(args.prompts)
    startup: dict[str, float] = {}
    started = time.monotonic()
    ray.init(num_cpus=2 * args.threads, include_dashboard=False, log_to_driver=False)  # room for both apps
    startup["ray_init"] = time.monotonic() - started
    port = free_port()
    started = time.monotonic()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    startup["serve_start"] = time.monotonic() - started
    started = time.monotonic()
    process, alone = start_serve(args)
    startup["specdec_serve"] = time.monotonic() - started
    try:
        urls = {"serve": alone}
        for name, replicas in (("ray-1x%d" % args.threads, 1), ("ray-%dx1" % args.threads, args.threads)):
            urls[name], startup[f"deploy_{name}"] = deploy(name, replicas, args, port)
        print(f"started: {json.dumps({k: round(v, 1) for k, v in startup.items()})}", flush=True)
        for url in urls.values():  # untimed warm-up
            ask(url, [{"role": "user", "content": "Say hello."}], 8)
        turns = []
        names = list(urls)
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                result = turn(urls[name], prompts, args)
                turns.append({"round": round_, "server": name, **result})
                print(f"round {round_} {name}: {result['tokens_per_second']:.2f} tok/s, first token "
                      f"{result['first_token_median'] * 1000:.0f} ms (median)", flush=True)
    finally:
        process.terminate()
        process.wait()
        serve.shutdown()
        ray.shutdown()
    reference = {(t["round"], i): a["text"] for t in turns if t["server"] == "serve" for i, a in enumerate(t["answers"])}
    summary = {name: {
        "tokens_per_second_median": statistics.median(t["tokens_per_second"] for t in turns if t["server"] == name),
        "first_token_ms_median": 1000 * statistics.median(t["first_token_median"] for t in turns if t["server"] == name),
        "answers_equal_serve": sum(a["text"] == reference[(t["round"], i)] for t in turns if t["server"] == name
                                   for i, a in enumerate(t["answers"])),
        "answers": sum(len(t["answers"]) for t in turns if t["server"] == name)} for name in names}
    print(json.dumps({"startup_seconds": startup, "summary": summary}, indent=1))
    Path(args.out).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "machine": machine,
                                          "load_average": Path("/proc/loadavg").read_text().split()[:3],
                                          "startup_seconds": startup, "summary": summary, "turns": turns}, indent=1))


if __name__ == "__main__":
    main()
