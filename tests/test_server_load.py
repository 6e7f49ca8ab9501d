"""A bounded load test of ``specdec serve`` on a tiny model, over loopback only; it stops by itself.

1. Sixteen concurrent streaming clients: ten valid requests (greedy and seeded sampling, four
   methods, three lengths), three invalid ones and three that disconnect after their first chunk.
   Every valid request must get exactly the tokens :func:`specdec.generate` gives it alone, every
   invalid one its 400, every disconnected generation must stop within one step, and the metrics
   must account for every request.
2. Queue overflow: while one generation runs, 10 requests arrive at a server whose queue holds 4;
   exactly 6 are turned away with 429 and the 4 queued ones complete correctly.
3. Afterwards the first server still serves.

``python -m pytest -q -s tests/test_server_load.py`` prints the figures (requests, errors, time to
first token).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from specdec import generate
from helpers import Server, serve, tiny_pair, tiny_tokenizer

CLIENTS = 16
LONG = 480  # tokens: a generation that runs until its client leaves


@dataclass
class Valid:
    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None
    method: str
    want: list[int] = field(default_factory=list)
    want_text: str = ""


@dataclass
class Outcome:
    status: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    ttft: float | None = None
    done: bool = False
    error: dict | None = None


METHOD_KWARGS = {
    "spec:model:block:k=4:policy=static": dict(verify="block", k=4, policy="static"),
    "spec:model:token:k=2:policy=static": dict(verify="token", k=2, policy="static"),
    "ar": dict(draft=None),
    "spec:ngram:block:k=3:policy=static": dict(draft=None, drafter="ngram", verify="block", k=3, policy="static"),
}


def valid_requests(target: Any, draft: Any, tokenizer: Any) -> list[Valid]:
    methods = list(METHOD_KWARGS)
    requests = []
    for i in range(10):
        sampled = i % 2 == 1
        v = Valid(prompt=f"def task_{i}(x):", max_tokens=(16, 24, 32)[i % 3], temperature=1.0 if sampled else 0.0,
                  seed=100 + i if sampled else None, method=methods[i % len(methods)])
        kwargs = {"draft": draft, **METHOD_KWARGS[v.method]}
        sampler = "gumbel" if v.seed is not None else "multinomial"  # the server's choice for seeded requests
        result = generate(target, v.prompt, tokenizer=tokenizer, max_new_tokens=v.max_tokens,
                          temperature=v.temperature, seed=v.seed, sampler=sampler, **kwargs)
        v.want, v.want_text = result.token_ids, result.text
        requests.append(v)
    return requests


def body_of(v: Valid) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": v.prompt, "max_tokens": v.max_tokens, "temperature": v.temperature,
            "stream": True, "speculative": {"method": v.method}}
    if v.seed is not None:
        body["seed"] = v.seed
    return body


INVALID = [
    {"model": "tiny", "prompt": "x", "temperature": -1, "stream": True},
    {"model": "tiny", "prompt": "x", "stream": True, "best_of": 4},
    {"model": "tiny", "prompt": "x", "stream": True, "speculative": {"method": "spec:nope"}},
]


async def stream_request(http: httpx.AsyncClient, url: str, body: dict[str, Any], leave_after_first: bool = False) -> Outcome:
    start = time.perf_counter()
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return Outcome(response.status_code, error=json.loads(await response.aread())["error"])
        out = Outcome(200)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out.done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = chunk["error"]
                continue
            out.text += chunk["choices"][0]["text"]
            ids = chunk["speculative"].get("token_ids")
            if ids:
                out.ttft = out.ttft if out.ttft is not None else time.perf_counter() - start
                out.token_ids += ids
                if leave_after_first:
                    break  # leaving the block closes the connection
        return out


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def sixteen_clients(url: str, valid: list[Valid]) -> tuple[list[Outcome], list[Outcome], list[Outcome], float]:
    limits = httpx.Limits(max_connections=CLIENTS * 2)
    async with httpx.AsyncClient(trust_env=False, timeout=120, limits=limits) as http:
        leaving = {"model": "tiny", "prompt": "0", "max_tokens": LONG, "temperature": 0, "stream": True}
        tasks = ([stream_request(http, url, body_of(v)) for v in valid]
                 + [stream_request(http, url, body) for body in INVALID]
                 + [stream_request(http, url, leaving, leave_after_first=True) for _ in range(3)])
        assert len(tasks) == CLIENTS
        start = time.perf_counter()
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return results[:10], results[10:13], results[13:], wall


def wait_until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def metric(server: Server, name: str, **labels: str) -> float:
    return server.app.state.specdec.metrics.registry.get_sample_value(name, labels) or 0.0


def test_sixteen_concurrent_clients_then_overflow_then_still_serving():
    target, draft = tiny_pair()
    tokenizer = tiny_tokenizer()
    valid = valid_requests(target, draft, tokenizer)
    with serve(target, tokenizer, draft, max_queue=CLIENTS) as running:
        # 1. sixteen at once
        good, bad, left, wall = asyncio.run(sixteen_clients(running.url, valid))
        for v, got in zip(valid, good):
            assert got.status == 200 and got.done and got.error is None, got
            assert got.token_ids == v.want, f"{v.prompt}: not its own tokens"
            assert got.text == v.want_text
        for body, got in zip(INVALID, bad):
            assert got.status == 400 and got.error["param"] in ("temperature", "best_of", "speculative.method"), got
        for got in left:
            assert got.status == 200 and not got.done and len(got.token_ids) < LONG
        wait_until(lambda: len(running.engine.history) == 13)  # 10 valid and 3 that left (invalid never queue)
        stopped = [job for job in running.engine.history if job.outcome == "cancelled"]
        assert len(stopped) == 3
        assert all(job.steps - job.steps_at_stop <= 1 and job.steps < LONG for job in stopped)
        wait_until(lambda: metric(running, "specdec_requests_total", endpoint="/v1/completions", outcome="cancelled") == 3)
        assert metric(running, "specdec_requests_total", endpoint="/v1/completions", outcome="ok") == 10
        assert metric(running, "specdec_requests_total", endpoint="/v1/completions", outcome="bad_request") == 3
        generated = sum(len(v.want) for v in valid) + sum(job.tokens for job in stopped)
        assert metric(running, "specdec_generated_tokens_total") == generated

        # 2. overflow, on a server whose queue holds 4
        with serve(target, tokenizer, draft, max_queue=4) as small:
            statuses, queued_ok = asyncio.run(overflow(small.url, valid[:10]))
            assert sorted(statuses) == [200] * 4 + [429] * 6, statuses
            assert queued_ok == 4
            assert metric(small, "specdec_requests_total", endpoint="/v1/completions", outcome="queue_full") == 6

        # 3. the first server still serves
        again = asyncio.run(_one(running.url, valid[0]))
        assert again.token_ids == valid[0].want
        assert httpx.get(running.url + "/health", trust_env=False).status_code == 200
        assert metric(running, "specdec_queue_length") == 0

    ttfts = sorted(got.ttft for got in good)
    print(f"\nload: {CLIENTS} concurrent streaming clients ({len(good)} valid, {len(bad)} invalid, "
          f"{len(left)} leaving after the first chunk) in {wall:.2f} s; errors: {len(bad)} x 400, 0 lost, 0 crossed; "
          f"time to first token p50 {percentile(ttfts, 50):.3f} s, p95 {percentile(ttfts, 95):.3f} s, "
          f"max {ttfts[-1]:.3f} s; overflow: 10 requests at a queue of 4 behind a running one -> 4 served, 6 x 429")


async def _one(url: str, v: Valid) -> Outcome:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        return await stream_request(http, url, body_of(v))


async def overflow(url: str, valid: list[Valid]) -> tuple[list[int], int]:
    """One long generation runs; 10 requests arrive; then the long one's client leaves."""
    async with httpx.AsyncClient(trust_env=False, timeout=120, limits=httpx.Limits(max_connections=32)) as http:
        body = {"model": "tiny", "prompt": "0", "max_tokens": LONG, "temperature": 0, "stream": True}
        async with http.stream("POST", url + "/v1/completions", json=body) as long_running:
            assert long_running.status_code == 200
            lines = long_running.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break  # it is generating
            tasks = [asyncio.create_task(stream_request(http, url, body_of(v))) for v in valid]
            # the 429s come at once; the queued requests wait for the long generation
            while sum(t.done() for t in tasks) < 6:
                await asyncio.sleep(0.01)
            rejected = [t.result() for t in tasks if t.done()]
            assert all(r.status == 429 and r.error["code"] == "queue_full" for r in rejected), rejected
        results = await asyncio.gather(*tasks)  # the long one's client has left: the queue drains
    queued_ok = sum(1 for v, r in zip(valid, results) if r.status == 200 and r.token_ids == v.want)
    return [r.status for r in results], queued_ok
