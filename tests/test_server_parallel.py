"""``specdec serve --parallel N`` on the GGUF kernel: several requests decode at once, their passes
sharing each pass of the weights, and every answer is the one the request gets alone -- greedy or
seeded, streamed or whole, any method, with stop strings, logprobs and JSON schemas, beside requests
that arrive at other moments and clients that leave mid-stream.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import httpx
import pytest

from specdec import models, packs
from specdec.backends.shared import default_slots
from specdec.server.app import ServerOptions, create_app
from specdec.models import Pair
from specdec.server.requests import method_config
from helpers import THREADS, Server, tiny_pair, tiny_tokenizer

PACK = "smollm2-135m"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
REQUESTS = [
    ("/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 40, "temperature": 0}),
    ("/v1/completions", {"prompt": "1, 2, 3, 4,", "max_tokens": 30, "temperature": 0, "stop": ["10,"],
                         "speculative": {"method": "spec:model:tree"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24,
                              "temperature": 1.0, "seed": 7}),
    ("/v1/completions", {"prompt": "import os\n", "max_tokens": 20, "temperature": 0.7, "top_k": 20, "seed": 3,
                         "logprobs": 2, "speculative": {"method": "spec:model:block:k=4:policy=static"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Alice is 30. Give her as JSON."}],
                              "max_tokens": 40, "temperature": 0,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}),
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 32, "temperature": 0, "stream": True,
                         "speculative": {"method": "ar"}}),
]


@pytest.fixture(scope="module")
def pair():
    if packs.missing_parts(packs.PACKS[PACK]):
        pytest.skip(f"pack {PACK} is not installed")
    return models.load_pair(PACK, PACK, backend="gguf", n_threads=THREADS)


@pytest.fixture(scope="module")
def server(pair):
    served = Pair(pair.target, pair.tokenizer, pair.draft, target_name=PACK, draft_name=PACK, backend="gguf")
    app = create_app(served, ServerOptions(method_config("spec", True), parallel=3))
    with Server(app) as running:
        yield running


def ask(server: Server, endpoint: str, body: dict, leave_after: int | None = None) -> dict:
    """The answer's token ids and text (a stream's joined; with ``leave_after``, the client leaves
    after that many chunks and what it got is returned)."""
    body = {**body, "model": PACK}
    with httpx.Client(trust_env=False, timeout=300) as http:
        if not body.get("stream"):
            answer = http.post(server.url + endpoint, json=body).json()
            choice = answer["choices"][0]
            text = choice.get("text", (choice.get("message") or {}).get("content"))
            usage = answer["usage"]  # (how much of the prompt a slot had cached depends on what it served before)
            return {"text": text, "tokens": (usage["prompt_tokens"], usage["completion_tokens"]),
                    "logprobs": choice.get("logprobs"), "finish": choice["finish_reason"]}
        text, chunks = "", 0
        with http.stream("POST", server.url + endpoint, json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                if data["choices"]:
                    text += data["choices"][0].get("text") or ""
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    break
        return {"text": text}


def test_concurrent_requests_get_their_answers_alone(server):
    alone = [ask(server, endpoint, body) for endpoint, body in REQUESTS]  # one at a time
    rng = random.Random(5)
    got: dict[int, dict] = {}

    def client(i: int, delay: float) -> None:
        time.sleep(delay)
        got[i] = ask(server, *REQUESTS[i])

    def leaver(delay: float) -> None:  # a client that leaves mid-stream: its slot is freed, the others go on
        time.sleep(delay)
        got["left"] = ask(server, "/v1/completions", {"prompt": "0", "max_tokens": 200, "temperature": 0,
                                                      "stream": True}, leave_after=3)

    threads = [threading.Thread(target=client, args=(i, rng.uniform(0, 0.4))) for i in range(len(REQUESTS))]
    threads.append(threading.Thread(target=leaver, args=(0.1,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(alone):
        assert got[i] == want, (i, REQUESTS[i])
    metrics = httpx.get(server.url + "/metrics", trust_env=False).text

    def counter(name: str) -> float:
        return float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith(name + '{model="target"}')))

    assert counter("specdec_shared_pass_sequences_total") > counter("specdec_shared_passes_total") > 0  # shared
    assert "specdec_queue_wait_seconds_count" in metrics
    listed = httpx.get(server.url + "/v1/models", trust_env=False).json()
    assert listed["data"][0]["speculative"]["parallel"] == 3


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", trust_env=False).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_during_a_long_prefill_frees_its_slot_before_the_prompt_is_done(server, pair, stream):
    """A cold prompt of 3,000 tokens, prefilled 64 rows a pass; its client closes the connection once
    the first passes ran: the server stops the prefill within a pass or a few (the stop is seen
    between passes), counts the request cancelled and frees the slot, long before the prompt's end."""
    text = f"Count ({stream}): " + ", ".join(str(7 * k + int(stream)) for k in range(1500))
    prompt = pair.tokenizer(text)["input_ids"][:3000]  # token ids: a prompt no slot has seen
    n = len(prompt)
    assert n == 3000
    body = json.dumps({"model": PACK, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}).encode()
    before = ask(server, *REQUESTS[0])
    rows = metric(server, "specdec_shared_pass_rows_total")
    outcome = 'specdec_requests_total{endpoint="/v1/completions",outcome="cancelled"}'
    cancelled = metric(server, outcome)
    client = socket.create_connection(("127.0.0.1", server.port))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 120
    while metric(server, "specdec_shared_pass_rows_total") < rows + 128:  # two passes of the prompt ran
        assert time.monotonic() < deadline, "the prefill did not begin"
        time.sleep(0.02)
    client.close()
    while metric(server, "specdec_running") > 0:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.02)
    ran = metric(server, "specdec_shared_pass_rows_total") - rows
    assert ran < n / 2, f"{ran} of the prompt's {n} rows ran after its client left"
    while metric(server, outcome) < cancelled + 1:
        assert time.monotonic() < deadline, "the request was not counted cancelled"
        time.sleep(0.02)
    # the freed slot (the next one taken) answers as before: its caches held part of the prompt, rolled back
    assert ask(server, *REQUESTS[0]) == before


def test_the_default_slots_are_the_fewest_within_a_tenth_of_the_best_pass():
    # n sequences of one row make n / curve[n - 1] tokens per second
    assert default_slots([float(n) for n in range(1, 17)]) == 1  # a row costs a pass: one slot
    assert default_slots([1.0] * 16) == 8  # rows free: 15 of 16 is within a tenth, but at most 8
    assert default_slots([1.0] * 16, most=16) == 15
    curve = [1, 1.25, 1.6, 2.0, 2.4, 2.8, 3.2, 3.5, 3.9, 4.3, 4.7, 5.1, 5.5, 5.9, 6.3, 6.6]
    # rates 1, 1.6, 1.875, 2.0, 2.083, 2.143, 2.1875, ...; the best 16 / 6.6 = 2.424, 0.9 x = 2.18
    assert default_slots(curve) == 7


def test_serve_chooses_its_slots_from_the_cost_curve_and_the_memory(monkeypatch, capsys):
    from specdec.cli import serve as cli_serve

    class Kernel:
        cache_bytes = 100 << 20
        max_context = 4096

    curve = [1, 1.25, 1.6, 2.0, 2.4, 2.8, 3.2, 3.5, 3.9, 4.3, 4.7, 5.1, 5.5, 5.9, 6.3, 6.6]
    monkeypatch.setattr(cli_serve, "row_costs", lambda model, rows: (curve[:rows], "cache"))
    served = Pair(Kernel(), tiny_tokenizer(), Kernel(), target_name="kernel")
    monkeypatch.setattr(cli_serve, "available_memory", lambda: 10 << 30)
    assert cli_serve.choose_slots(served) == 7
    assert "--parallel 7: 7 sequences in a pass make 2.19x the tokens per second of one (a pass of 16: 2.42x" in capsys.readouterr().err
    monkeypatch.setattr(cli_serve, "available_memory", lambda: 650 << 20)  # three slots of 200 MiB
    assert cli_serve.choose_slots(served) == 3
    target, draft = tiny_pair()  # not the kernel: one request at a time
    assert cli_serve.choose_slots(Pair(target, tiny_tokenizer(), draft, target_name="tiny")) == 1
