"""What the cluster's ingress and router cost per request: the CPU time the ingress process
(``SpecdecIngress``) spends per request and per token, non-streamed and streamed, and the time of
the prefix router's two calls to its tree (match, insert) per request.

Two replicas of SmolLM2-135M (one thread, 4 slots each) on a local Ray; ``--requests`` completions
of ``--max-tokens`` tokens from 8 clients at once (end of text ignored). A small fast model makes
many steps per second, so the ingress's share shows. Writes JSON with the machine record.

    python benchmarks/ray_ingress_cost.py --out benchmarks/ray-ingress-cost.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ray
from ray import serve
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTreeActor

from specdec import cluster
from specdec.bench.machine import machine_record
from specdec.bench.servers import free_port
from specdec.models import gguf_path
from specdec.ray import app


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ask(url: str, i: int, stream: bool, max_tokens: int) -> None:
    body = {"prompt": f"Story number {i}:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    with httpx.Client(trust_env=False, timeout=300) as http:
        if stream:
            with http.stream("POST", url + "/v1/completions", json=body) as response:
                for _ in response.iter_lines():
                    pass
        else:
            http.post(url + "/v1/completions", json=body).raise_for_status()


def tree_calls(rounds: int = 200) -> float:
    """Milliseconds of the router's two tree calls per request (a prefix match, an insert)."""
    tree = PrefixTreeActor.options(num_cpus=0).remote()
    ray.get(tree.add_tenants.remote(["a", "b"], time.time()))
    text = "".join(chr(0x10000 + t) for t in range(300))
    for i in range(20):
        ray.get(tree.insert.remote(text[:100 + i * 10], "ab"[i % 2], time.time()))
    started = time.monotonic()
    for i in range(rounds):
        ray.get(tree.prefix_match.remote(text[:150 + i % 100], ["a", "b"]))
        ray.get(tree.insert.remote(text[:150 + i % 100], "a", time.time()))
    return (time.monotonic() - started) / rounds * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).with_name("ray-ingress-cost.json")))
    args = parser.parse_args()
    machine = machine_record(1, gguf_path("smollm2-135m"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app({"target": "smollm2-135m", "draft": "none", "backend": "gguf", "threads": 1, "parallel": 4,
                   "replicas": 2}), name=cluster.APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    listing = subprocess.run(["ps", "-eo", "pid,cmd"], capture_output=True, text=True).stdout
    pid = next(int(line.split()[0]) for line in listing.splitlines() if "SpecdecIngress" in line)
    rows = []
    try:
        for stream in (False, True):
            ask(url, 0, stream, 8)  # untimed warm-up
            before, started = cpu_seconds(pid), time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: ask(url, i, stream, args.max_tokens), range(1, args.requests + 1)))
            used, wall = cpu_seconds(pid) - before, time.monotonic() - started
            tokens = args.requests * args.max_tokens
            rows.append({"stream": stream, "requests": args.requests, "tokens": tokens, "wall_seconds": wall,
                         "ingress_cpu_seconds": used, "ingress_cpu_ms_per_request": 1000 * used / args.requests,
                         "ingress_cpu_ms_per_token": 1000 * used / tokens})
            print(json.dumps(rows[-1]), flush=True)
        tree_ms = tree_calls()
        print(f"router tree calls: {tree_ms:.2f} ms per request", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    Path(args.out).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "machine": machine,
                                          "load_average": Path("/proc/loadavg").read_text().split()[:3],
                                          "ingress": rows, "router_tree_calls_ms_per_request": tree_ms}, indent=1))


if __name__ == "__main__":
    main()
