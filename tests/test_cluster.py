"""``specdec serve --ray``: the server's application on Ray Serve over two replicas of SmolLM2-135M's
GGUF on specdec's kernel, one thread each, on a local Ray of 2 CPUs. Every answer equals the one
server's (the kernel's rows do not depend on their neighbours, their slot or their replica); a
conversation stays on the replica whose prompt cache holds it; a replica killed under load costs
no request its answer, or answers 503 with Retry-After; a bad configuration ends with one line.

The tests share one deployment (a minute to start on 2 cores) and run in file order.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from helpers import PACK, Server, assert_one_line_error, run_main

from specdec import packs

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'specdec[ray]')")
serve = pytest.importorskip("ray.serve")

from specdec import cluster  # noqa: E402  (after the skip: it needs Ray Serve)
from specdec.cli.serve import default_method, load_engine, server_options  # noqa: E402
from specdec.ray import app as ray_app, parse  # noqa: E402
from specdec.server.app import Served, app_for  # noqa: E402
from specdec.server.metrics import Metrics  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]

METHOD = "spec:ngram:block"  # drafts from the prompt and the output: speculation with the target alone
ARGS = {"target": PACK, "draft": "none", "backend": "gguf", "method": METHOD, "threads": 1, "parallel": 2,
        "replicas": 2, "max_tokens": 256}


@pytest.fixture(scope="module")
def local_ray():
    if packs.missing_parts(packs.PACKS[PACK]):
        pytest.skip(f"pack {PACK} is not installed")
    cluster.patient_proxy()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def deployed(local_ray):
    started = time.monotonic()
    serve.run(ray_app(ARGS), name=cluster.APP, route_prefix="/")
    print(f"deployed two replicas in {time.monotonic() - started:.1f} s")
    yield local_ray


@pytest.fixture(scope="module")
def alone():
    """The one server the cluster's answers are compared with: the same options, one slot."""
    args = parse({**ARGS, "parallel": 1})
    metrics = Metrics()
    engine = load_engine(args, metrics)
    options = server_options(args, default_method(args), None, engine.parallel, engine.datastore)
    with Server(app_for(Served.of(engine.pair), options, engine, metrics)) as server:
        yield server.url


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=timeout) as http:
        return http.post(url + path, json=body)


def _stream(url: str, path: str, body: dict[str, Any]) -> tuple[str, list[Any], httpx.Headers]:
    """The streamed text (content or completion text), the events, and the headers."""
    events = []
    with httpx.Client(trust_env=False, timeout=120) as http:
        with http.stream("POST", url + path, json={**body, "stream": True}) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
            headers = response.headers
    text = "".join((c.get("delta", {}).get("content") or c.get("text") or "") for e in events for c in e.get("choices", []))
    return text, events, headers


# ------------------------------------------------------------------------------------------------
# Without a cluster


def test_serve_run_arguments_are_specdec_serves_options():
    args = parse({"target": PACK, "draft": "none", "parallel": 3, "min_replicas": 1, "max-replicas": "4",
                  "no_prompt_cache": "true", "seeded_sampler": "multinomial", "datastore_max_tokens": "false"})
    assert (args.target, args.draft, args.parallel, args.min_replicas, args.max_replicas) == (PACK, None, 3, 1, 4)
    assert args.prompt_cache is False and args.seeded_sampler == "multinomial"
    with pytest.raises(ValueError, match="unrecognized arguments: --shards 2"):
        ray_app({"shards": 2})


def test_the_scale_of_the_options():
    fixed = cluster.Scale.of(parse({"replicas": 3, "threads": 2, "parallel": 4}))
    assert fixed.deployment() == {"ray_actor_options": {"num_cpus": 2}, "max_ongoing_requests": 20,
                                  "max_queued_requests": 16, "num_replicas": 3}
    auto = cluster.Scale.of(parse({"min_replicas": 1, "max_replicas": 4, "threads": 1, "parallel": 2}))
    config = auto.deployment()["autoscaling_config"]
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (1, 4, 1)
    assert config.target_ongoing_requests == 2 and auto.imbalance == 2  # a replica's slots
    assert fixed.router == "prefix" and cluster.Scale.of(parse({"router": "load"})).router == "load"
    from specdec.cli.common import CLIError

    with pytest.raises(CLIError, match="--router: invalid choice: 'random'"):
        parse({"router": "random"})


def test_the_router_reads_a_prompts_tokens_and_only_exact_requests_are_sent_again():
    from specdec.config import DecodeConfig
    from specdec.serving import Work

    request = cluster.Request.of(Work([0, 1, 0xD800, 49151], DecodeConfig()))
    assert len(request.prompt) == 4 and request.prompt.encode("utf-8")  # one character per token, no surrogates
    assert cluster.Request.of(Work([], DecodeConfig())).prompt  # the router divides by its length
    assert cluster.replayable(Work([1], DecodeConfig(temperature=0.0)))
    assert cluster.replayable(Work([1], DecodeConfig(temperature=1.0, seed=3)))
    assert not cluster.replayable(Work([1], DecodeConfig(temperature=1.0)))


class Dying:
    """A deployment handle over local engines standing for replicas: each call goes to the next
    replica by name, and the replicas in ``die_after`` die (as Ray reports a killed replica) after
    handing out that many steps."""

    def __init__(self, engine: Any, die_after: dict[str, int]) -> None:
        self.engine, self.die_after, self.calls = engine, die_after, []

    def options(self, **_: Any) -> "Dying":
        return self

    async def remote(self, request: Any) -> Any:
        from ray.exceptions import ActorDiedError

        name = "abc"[len(self.calls)]
        self.calls.append(name)
        yield "replica", name
        steps = 0
        async for kind, payload in self.engine.stream(request.work):
            if kind == "step" and steps == self.die_after.get(name, -1):
                raise ActorDiedError()
            steps += kind == "step"
            yield kind, payload


@pytest.fixture(scope="module")
def tiny_engine():
    from helpers import tiny_pair, tiny_tokenizer
    from specdec.models import Pair
    from specdec.serving import Engine

    target, _ = tiny_pair()
    engine = Engine(Pair(target, tiny_tokenizer(), target_name="tiny"))
    engine.start()
    yield engine
    engine.close()


def _behind(engine: Any, die_after: dict[str, int]) -> Server:
    from specdec.server.requests import method_config

    handle = Dying(engine, die_after)
    server = Server(cluster.ingress_app(Served.of(engine.pair), cluster.ServerOptions(method_config("ar", False)),
                                        handle))
    server.handle = handle
    return server


@pytest.mark.parametrize("stream", [False, True])
def test_a_greedy_request_whose_replica_dies_gets_its_whole_answer_from_another(tiny_engine, stream):
    body = {"prompt": "abc", "max_tokens": 12, "temperature": 0}
    with _behind(tiny_engine, {}) as server:
        expected = _post(server.url, "/v1/completions", body).json()["choices"][0]["text"]
    with _behind(tiny_engine, {"a": 3}) as server:
        if stream:
            text, events, headers = _stream(server.url, "/v1/completions", body)
            replica = events[-1]["speculative"]["replica"]
        else:
            response = _post(server.url, "/v1/completions", body)
            text, replica = response.json()["choices"][0]["text"], response.headers["x-specdec-replica"]
        assert server.handle.calls == ["a", "b"] and replica == "b"
        assert text == expected  # the steps already sent were not sent twice
        assert _metric(server.url, "specdec_replica_lost_requests_total", then="resent") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_sampled_request_without_a_seed_whose_replica_dies_gets_a_503_never_half_an_answer(tiny_engine, stream):
    body = {"prompt": "abc", "max_tokens": 12, "temperature": 1.0}
    with _behind(tiny_engine, {"a": 3}) as server:
        if stream:
            text, events, headers = _stream(server.url, "/v1/completions", body)
            error = events[-1]["error"]
            assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"])
        else:
            response = _post(server.url, "/v1/completions", body)
            assert response.status_code == 503 and response.headers["retry-after"] == str(cluster.LOST_RETRY_AFTER)
            error = response.json()["error"]
        assert error["code"] == "unavailable" and "lost (a)" in error["message"]
        assert server.handle.calls == ["a"]


def test_a_replica_lost_again_and_again_ends_with_a_503(tiny_engine):
    with _behind(tiny_engine, {"a": 1, "b": 1, "c": 1}) as server:
        response = _post(server.url, "/v1/completions", {"prompt": "abc", "max_tokens": 12, "temperature": 0})
        assert response.status_code == 503 and "so were the 2 it was sent to again" in response.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------
# Bad configuration: one line each


def test_a_ray_address_that_does_not_answer_is_one_line(capsys):
    code, out, err = run_main(["serve", "--ray", "--ray-address", f"127.0.0.1:{_free_port()}", "--target", PACK,
                               "--draft", "none"], capsys)
    assert code == 1
    assert_one_line_error(err, contains="no Ray head answers there")


def test_cluster_options_without_ray_are_refused(capsys):
    code, out, err = run_main(["serve", "--replicas", "2", "--target", PACK, "--draft", "none"], capsys)
    assert code == 2
    assert_one_line_error(err, contains="--replicas is an option of a cluster")


def test_more_replicas_than_cpus_is_one_line(local_ray):
    args = parse({**ARGS, "replicas": 3, "ray_address": ray.get_runtime_context().gcs_address})
    with pytest.raises(cluster.ClusterError, match=r"3 replica\(s\) of 1 CPU\(s\) need 3 CPUs, and the Ray cluster has 2"):
        cluster.run(ray_app({**ARGS, "replicas": 3}), args, deploying=lambda: None, ready=lambda: None)


def test_a_model_that_does_not_load_on_a_replica_is_one_line_not_retried_forever(local_ray):
    bad = {**ARGS, "target": "/nowhere/model.gguf", "replicas": 1}
    args = parse({**bad, "ray_address": ray.get_runtime_context().gcs_address})
    started = time.monotonic()
    with pytest.raises(cluster.ClusterError) as caught:
        cluster.run(ray_app(bad), args, deploying=lambda: None, ready=lambda: pytest.fail("deployed"))
    assert caught.value.message.startswith("replica ") and "cannot serve: " in caught.value.message
    assert "\n" not in caught.value.message and "nowhere" in caught.value.message
    assert time.monotonic() - started < 120
    assert cluster.APP not in serve.status().applications  # deleted, not left retrying


# ------------------------------------------------------------------------------------------------
# Answers


REQUESTS = [
    ("/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1, "seed": 7}),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24,
                              "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A city, as JSON."}], "max_tokens": 24,
                              "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "city", "schema": {"type": "object", "properties": {"name": {"type": "string"}},
                                                             "required": ["name"]}}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                              "max_tokens": 32, "temperature": 0, "tool_choice": "required", "tools": [
                                  {"type": "function", "function": {"name": "weather", "parameters": {
                                      "type": "object", "properties": {"city": {"type": "string"}}}}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 16,
                              "temperature": 0, "logprobs": True, "top_logprobs": 2}),
]


def _answer(body: dict[str, Any]) -> Any:
    """What must be equal: the choices (text, tool calls but their random ids, log-probabilities,
    finish reason) and the tokens counted."""
    for choice in body["choices"]:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id")
    return body["choices"], body["usage"]["completion_tokens"]


@pytest.mark.parametrize("path, body", REQUESTS, ids=[f"{'chat' if 'chat' in p else 'completion'}-{i}" for i, (p, _) in enumerate(REQUESTS)])
def test_every_answer_equals_the_one_servers(deployed, alone, path, body):
    theirs = _post(alone, path, body)
    ours = _post(deployed, path, body)
    assert theirs.status_code == ours.status_code == 200, ours.text
    assert _answer(ours.json()) == _answer(theirs.json())
    replica = ours.headers["x-specdec-replica"]
    assert ours.json()["speculative"]["replica"] == replica
    assert "x-specdec-replica" not in theirs.headers and "replica" not in theirs.json()["speculative"]


def test_a_streamed_answer_equals_the_one_servers(deployed, alone):
    path, body = REQUESTS[3]
    text, events, headers = _stream(deployed, path, body)
    assert text == _post(alone, path, body).json()["choices"][0]["message"]["content"]
    assert events[-1]["speculative"]["replica"] == headers["x-specdec-replica"]


def test_errors_are_the_servers(deployed, alone):
    for body in ({"prompt": "x", "max_tokens": 100000}, {"prompt": "x", "model": "other"}, {"prompt": 5}):
        ours, theirs = _post(deployed, "/v1/completions", body), _post(alone, "/v1/completions", body)
        assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json())


# ------------------------------------------------------------------------------------------------
# Routing


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", trust_env=False).text
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(want + " "))


def test_a_conversation_stays_on_one_replica_and_hits_its_prompt_cache(deployed):
    def converse(opening: str, chat: bool) -> tuple[set[str], list[int]]:
        """Four turns, each prompt the last one with its answer and a new question after it."""
        messages, prompt, replicas, cached = [{"role": "user", "content": opening}], opening, set(), []
        for turn in range(4):
            body = {"messages": messages} if chat else {"prompt": prompt}
            response = _post(deployed, "/v1/chat/completions" if chat else "/v1/completions",
                             {**body, "max_tokens": 12, "temperature": 0})
            assert response.status_code == 200
            replicas.add(response.headers["x-specdec-replica"])
            cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            choice = response.json()["choices"][0]
            said = choice["message"]["content"] if chat else choice["text"]
            messages += [{"role": "assistant", "content": said}, {"role": "user", "content": f"And then {turn}?"}]
            prompt += f"{said}\nAnd then {turn}?\n"
        return replicas, cached

    first, cached = converse("Tell me a story about a lighthouse keeper and a storm.", chat=True)
    assert len(first) == 1 and all(c > 0 for c in cached[1:]), (first, cached)
    (replica,) = first
    time.sleep(2 * cluster.STATUS_PERIOD + 1)  # the replicas' reports reach the router
    assert _metric(deployed, "specdec_replica_prompt_cache_hits_total", replica=replica) >= 3
    assert _metric(deployed, "specdec_router_choices_total", choice="prefix") >= 4
    # another prefix (no chat template: a chat's system prompt is a prefix every chat shares)
    second, cached = converse("Haiku about mountains in winter:", chat=False)
    assert len(second) == 1 and all(c > 0 for c in cached[1:]), (second, cached)


# ------------------------------------------------------------------------------------------------
# A replica lost


def test_a_killed_replica_costs_no_greedy_request_its_answer(deployed, alone):
    body = {"prompt": "def quicksort(arr):", "max_tokens": 96, "temperature": 0}
    expected = _post(alone, "/v1/completions", body).json()["choices"][0]["text"]
    victim = _post(deployed, "/v1/completions", {**body, "max_tokens": 1}).headers["x-specdec-replica"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_post, deployed, "/v1/completions", body, 180) for _ in range(4)]
        time.sleep(1.5)  # under way on the replica the prefix leads to
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{cluster.APP}#{cluster.ENGINE}#{victim}", namespace="serve"))
        killed = time.monotonic()
        answers = [f.result(timeout=180) for f in futures]
    for response in answers:
        if response.status_code == 503:
            assert int(response.headers["retry-after"]) > 0 and response.json()["error"]["code"] == "unavailable"
        else:
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected
            assert response.headers["x-specdec-replica"] == response.json()["speculative"]["replica"]
    assert sum(r.status_code == 200 for r in answers) >= 1
    resent = _metric(deployed, "specdec_replica_lost_requests_total", then="resent")
    unavailable = _metric(deployed, "specdec_replica_lost_requests_total", then="unavailable")
    print(f"after the kill: {[r.status_code for r in answers]}, {resent:g} resent, {unavailable:g} answered 503")
    assert resent + unavailable >= 1 and unavailable == sum(r.status_code == 503 for r in answers)
    after = _post(deployed, "/v1/completions", body)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected
    while _running(cluster.APP) < 2:
        assert time.monotonic() - killed < 120, "the killed replica did not come back"
        time.sleep(1)
    print(f"a new replica ran {time.monotonic() - killed:.0f} s after the kill")


# ------------------------------------------------------------------------------------------------
# Autoscaling (last: it replaces the two replicas)


def _running(app: str) -> int:
    return serve.status().applications[app].deployments[cluster.ENGINE].replica_states.get("RUNNING", 0)


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(deployed):
    serve.delete(cluster.APP)  # its replicas hold the 2 CPUs
    serve.run(ray_app({**ARGS, "replicas": 1, "min_replicas": 1, "max_replicas": 2, "parallel": 1}),
              name="autoscaled", route_prefix="/")
    assert _running("autoscaled") == 1
    body = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    stop = threading.Event()

    def client() -> None:  # one request under way at a time, until told to stop
        while not stop.is_set():
            assert _post(deployed, "/v1/completions", body, 300).status_code == 200

    loaded = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # 3 requests under way for 1 slot
        clients = [pool.submit(client) for _ in range(3)]
        try:
            while _running("autoscaled") < 2:
                assert time.monotonic() - loaded < 150, "no second replica under load"
                time.sleep(1)
        finally:
            stop.set()
        up = time.monotonic() - loaded
        for done in clients:
            done.result(timeout=300)
    idle = time.monotonic()
    while _running("autoscaled") > 1:
        assert time.monotonic() - idle < 150, "the second replica stayed without load"
        time.sleep(1)
    print(f"autoscaling: 2 replicas {up:.0f} s after the load began, 1 again {time.monotonic() - idle:.0f} s after it ended")
    serve.delete("autoscaled")
