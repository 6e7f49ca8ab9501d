"""``specdec serve`` on a tiny model built in code, driven by the official ``openai`` client over loopback.

Under greedy decoding (and when sampling with a seed) the server's output must be the very tokens
:func:`specdec.generate` gives with the same settings; errors are OpenAI-shaped 4xx naming the field.
A real-model test (SmolLM2, marked slow) closes the file.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from specdec import generate, models, packs
from specdec.server.requests import method_config
from specdec.server.app import ServerOptions, create_app
from specdec.models import Pair
from helpers import THREADS, Server, running_stream, serve, sse_events, tiny_pair, tiny_tokenizer, wait_for


# ------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def pair():
    target, draft = tiny_pair()
    return target, draft, tiny_tokenizer()


@pytest.fixture(scope="module")
def server(pair):
    target, draft, tokenizer = pair
    with serve(target, tokenizer, draft) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def reference(pair, prompt, **kwargs):
    """specdec.generate with the test server's method, spec:model:block:k=4:policy=static (block verification, k=4, static policy)."""
    target, draft, tokenizer = pair
    defaults = dict(draft=draft, tokenizer=tokenizer, verify="block", k=4, policy="static")
    return generate(target, prompt, **{**defaults, **kwargs})


# ------------------------------------------------------------------------------------------------
# Completions and chat: the same tokens as specdec.generate


def test_models_lists_the_served_model(client):
    listed = client.models.list()
    assert [m.id for m in listed.data] == ["tiny"]
    assert listed.data[0].speculative == {"method": "spec:model:block:k=4:policy=static", "seeded_sampler": "gumbel",
                                            "draft": "tiny-draft", "draft_weights": "int8", "draft_vocab": None,
                                            "draft_quant": None, "parallel": 1}


def test_greedy_completion_equals_generate(pair, client):
    want = reference(pair, "def quicksort(arr):", max_new_tokens=24, temperature=0)
    got = client.completions.create(model="tiny", prompt="def quicksort(arr):", max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 24 == len(want.token_ids)
    assert got.usage.prompt_tokens == len(pair[2]("def quicksort(arr):")["input_ids"])
    spec = got.speculative
    assert spec["method"] == "spec:model:block:k=4:policy=static" and spec["exact"] is True and spec["policy"] == "static"
    assert spec["target_forwards"] == want.stats.target_forwards
    assert spec["accepted_tokens"] == want.stats.accepted_tokens
    assert spec["drafted_tokens"] == want.stats.drafted_tokens
    assert spec["tokens_per_forward"] == pytest.approx(24 / want.stats.target_forwards)


def test_streamed_completion_equals_generate_token_by_token(pair, client):
    want = reference(pair, "class Stack:", max_new_tokens=32, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="class Stack:", max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    steps = [c for c in chunks if c.choices and (c.speculative or {}).get("token_ids")]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [t for c in steps for t in c.speculative["token_ids"]] == want.token_ids
    assert len(steps) == want.stats.target_forwards  # one chunk per target forward
    assert sum(sum(c.speculative["from_draft"]) for c in steps) == want.stats.accepted_tokens
    assert sum(c.speculative["drafted"] for c in steps) == want.stats.drafted_tokens
    for c in steps:
        draft_kept = sum(c.speculative["from_draft"])
        assert c.speculative["from_draft"] == [True] * draft_kept + [False] * (len(c.speculative["token_ids"]) - draft_kept)
        assert 0 <= c.speculative["draft_chars"] <= len(c.choices[0].text)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32


def test_stream_ends_with_done(server):
    body = {"prompt": "x = ", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, trust_env=False) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_equals_generate_with_the_seed(pair, client):
    """A seeded request draws by Gumbel-max and verifies by coupling (--seeded-sampler gumbel): its
    text is plain decoding's with that seed, whatever the method; "sampler": "multinomial" asks
    for the generator-seeded draws and the method's own rule instead."""
    target, _, tokenizer = pair
    settings = dict(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    plain = generate(target, "import os", tokenizer=tokenizer, sampler="gumbel", **settings)
    assert plain.method == "ar"
    texts = set()
    for method in (None, "ar", "spec:ngram:block:k=3:policy=static", "spec:model:token:k=2:policy=static", "spec:tree"):
        extra = {} if method is None else {"speculative": {"method": method}}
        got = client.completions.create(model="tiny", prompt="import os", max_tokens=20, temperature=1.0, top_p=0.9,
                                        seed=7, extra_body=extra)
        texts.add(got.choices[0].text)
        assert got.speculative["sampler"] == "gumbel" and got.speculative["exact"] and got.speculative["gumbel_seed"] == 7
        assert method in ("ar", "spec:tree") or ":coupled:" in got.speculative["method"], got.speculative["method"]
    assert texts == {plain.text}
    want = reference(pair, "import os", **settings)  # block verification, draws from the seeded generator
    got = client.completions.create(model="tiny", prompt="import os", max_tokens=20, temperature=1.0, top_p=0.9,
                                    seed=7, extra_body={"sampler": "multinomial"})
    assert got.choices[0].text == want.text and got.speculative["sampler"] == "multinomial"
    assert ":block:" in got.speculative["method"] and got.speculative["gumbel_seed"] is None


def test_the_seeded_sampler_is_the_servers_choice(pair):
    target, draft, tokenizer = pair
    want = reference(pair, "import os", max_new_tokens=12, temperature=1.0, seed=3)
    with serve(target, tokenizer, draft, seeded_sampler="multinomial") as running:
        got = running.client().completions.create(model="tiny", prompt="import os", max_tokens=12, temperature=1.0,
                                                  seed=3)
        assert got.choices[0].text == want.text and got.speculative["sampler"] == "multinomial"
        bad = httpx.post(f"{running.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 2, "sampler": "gumbel", "speculative": {"method": "spec:typical"}}, trust_env=False)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampler"
        bad = httpx.post(f"{running.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 2, "sampler": "multinomial", "speculative": {"method": "spec:coupled"}}, trust_env=False)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampler"
        bad = httpx.post(f"{running.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "sampler": "gumbal"}, trust_env=False)
        assert bad.status_code == 400 and "sampler" in bad.text


def test_the_answer_names_the_sampler_that_chose_its_tokens(client):
    """Greedy is the argmax, whatever the method's sampler: not a multinomial draw."""
    def sampler(**settings: Any) -> str:
        return client.completions.create(model="tiny", prompt="import os", max_tokens=4, **settings).speculative["sampler"]

    assert sampler(temperature=0) == "greedy"
    assert sampler(temperature=0, seed=7) == "greedy"  # a seed changes nothing at temperature 0
    assert sampler(temperature=1.0) == "multinomial"
    assert sampler(temperature=1.0, seed=7) == "gumbel"


def test_the_answer_says_whether_its_tokens_are_plain_decodings_on_the_backend(pair, client):
    """``exact``: the rule keeps the target's law; ``token_identical``: greedy and seeded output is
    also plain decoding's token for token on the target's backend, which is not so on llama.cpp,
    whose ``caveat`` says what may differ."""
    from specdec.backends.table import BY_NAME
    from specdec.config import DecodeConfig
    from specdec.server.responses import speculative_stats

    spec = client.completions.create(model="tiny", prompt="import os", max_tokens=4, temperature=0).speculative
    assert (spec["exact"], spec["token_identical"], spec["caveat"]) == (True, True, None)
    method = DecodeConfig.parse("spec")
    on_llamacpp = speculative_stats(method, None, temperature=0, backend="llamacpp")
    assert (on_llamacpp["exact"], on_llamacpp["token_identical"]) == (True, False)
    assert on_llamacpp["caveat"] == BY_NAME["llamacpp"].caveat
    assert "near-ties" in on_llamacpp["caveat"] and "cached prompt" in on_llamacpp["caveat"]
    on_kernel = speculative_stats(method, None, temperature=0, backend="gguf")
    assert (on_kernel["token_identical"], on_kernel["caveat"]) == (True, None)
    lossy = speculative_stats(DecodeConfig.parse("spec:typical"), None, temperature=0, backend="gguf")
    assert (lossy["exact"], lossy["token_identical"]) == (False, False)
    target, draft, tokenizer = pair
    served = Pair(target, tokenizer, draft, target_name="tiny", draft_name="tiny-draft", backend="llamacpp")
    with Server(create_app(served, ServerOptions(method_config("ar", True)))) as running:
        got = running.client().completions.create(model="tiny", prompt="import os", max_tokens=4, temperature=0)
    assert (got.speculative["token_identical"], got.speculative["caveat"]) == (False, BY_NAME["llamacpp"].caveat)


def test_chat_equals_generate_on_the_chat_template(pair, client):
    target, draft, tokenizer = pair
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    want = reference(pair, ids, max_new_tokens=20, temperature=0)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_request_picks_its_method(pair, client):
    for method, kwargs in [("spec:model:token:k=2:policy=static", dict(verify="token", k=2)), ("ar", dict(draft=None, policy="auto")),
                           ("spec:model:block:k=3:policy=heuristic", dict(k=3, policy="heuristic")),
                           ("spec:ngram:block:k=3:policy=static", dict(draft=None, drafter="ngram", k=3))]:
        want = reference(pair, "while True:", max_new_tokens=16, temperature=0, **kwargs)
        got = client.completions.create(model="tiny", prompt="while True:", max_tokens=16, temperature=0,
                                        extra_body={"speculative": {"method": method}})
        assert got.choices[0].text == want.text, method
        assert got.speculative["method"] == str(method_config(method, True))
        assert got.speculative["target_forwards"] == want.stats.target_forwards, method


def test_stop_strings_end_the_text_as_generate_does(pair, client):
    free = reference(pair, "for i in", max_new_tokens=24, temperature=0).text
    stop = free[8:10]
    want = reference(pair, "for i in", max_new_tokens=24, temperature=0, stop=[stop])
    got = client.completions.create(model="tiny", prompt="for i in", max_tokens=24, temperature=0, stop=stop)
    assert got.choices[0].text == want.text and stop not in got.choices[0].text
    assert got.choices[0].finish_reason == "stop"


def test_fill_in_the_middle_wraps_prompt_and_suffix_in_fim_tokens(pair, client):
    prompt, suffix = "def add(a, b):\n    ", "\n    return c\n"
    want = reference(pair, f"<|fim_prefix|>{prompt}<|fim_suffix|>{suffix}<|fim_middle|>", max_new_tokens=12,
                     temperature=0, stop=["\n    return c"])  # the middle ends where the suffix's line is written
    got = client.completions.create(model="tiny", prompt=prompt, suffix=suffix, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens == len(prompt) + len(suffix) + 3  # bytes and the three FIM tokens


@pytest.mark.parametrize("suffix, lead", [
    ("\n    return c\n", "\n    return c"),  # the suffix's one line with text, after its line break
    (")\n    print(x)\n\nmain()\n", ")\n    print(x)"),  # its first two lines with text
    ("\n\n", ""), ("", ""),
])
def test_a_middle_ends_at_the_suffixs_first_lines(suffix, lead):
    from specdec.server import requests as rq

    assert rq._suffix_lead(suffix) == lead


def test_a_middle_ends_at_fim_end_tokens_and_the_suffix_unless_eos_is_ignored():
    from specdec.server import requests as rq

    vocab = {"<|endoftext|>": 7, "<|fim_pad|>": 9, "<|file_sep|>": 11, "<|im_end|>": 4}

    class Vocab:
        def get_vocab(self):
            return vocab

    def body(**fields):
        return rq.CompletionBody.model_validate({"prompt": "def add(a, b):\n    ", **fields})

    gen = rq.Generation("completion", [1, 2], 2, None, {"max_new_tokens": 8, "stop": ["END"]}, stop=["END"])
    ended = rq.infill_ends(gen, body(suffix="\n    return c\n", stop="END"), Vocab(), {4})
    assert ended.sampling["eos_token_ids"] == [4, 7, 9, 11]
    assert ended.stop == ended.sampling["stop"] == ["END", "\n    return c"]
    assert rq.infill_ends(gen, body(suffix=")"), Vocab(), {4}).stop == ["END"]  # no whole line: no stop string
    assert rq.infill_ends(gen, body(), Vocab(), {4}) is gen  # no suffix
    assert rq.infill_ends(gen, body(suffix="x\ny", ignore_eos=True), Vocab(), {4}) is gen


@pytest.mark.slow
def test_the_default_targets_middle_ends_before_the_suffix():
    """Qwen2.5-Coder-Instruct writes past the middle, through the suffix and into a next function;
    the server's answer is the middle alone, as the docs' example shows."""
    from specdec.server import requests as rq

    pack = packs.PACKS[models.DEFAULT_TARGET]
    if packs.missing_parts(pack):
        pytest.skip(f"pack {pack.name} is not installed")
    pair = models.load_pair(pack.name, None, backend="gguf", n_threads=THREADS)
    body = rq.CompletionBody.model_validate({"prompt": "def add(a, b):\n    ", "suffix": "\n    return c\n",
                                             "max_tokens": 32, "temperature": 0})
    ids = rq.completion_prompt(body, pair.tokenizer, fim=True)
    gen = rq.infill_ends(rq.Generation("completion", ids, len(ids), None, rq.sampling_kwargs(body, 32)), body,
                         pair.tokenizer, set(pair.target.generation_config.eos_token_id or []))
    free = generate(pair.target, ids, tokenizer=pair.tokenizer, max_new_tokens=32, temperature=0, eos_token_ids=[])
    assert "return c\n\ndef" in free.text  # on its own it runs on past the middle
    kwargs = {k: v for k, v in gen.sampling.items() if k not in ("max_new_tokens",)}
    middle = generate(pair.target, ids, tokenizer=pair.tokenizer, max_new_tokens=32, **kwargs)
    assert middle.text == "c = a + b"


def test_fill_in_the_middle_without_fim_tokens_is_a_400():
    target, _ = tiny_pair()
    with serve(target, tiny_tokenizer(fim=False)) as running:
        with pytest.raises(openai.BadRequestError) as err:
            running.client().completions.create(model="tiny", prompt="a", suffix="b", max_tokens=2)
    assert err.value.body["param"] == "suffix" and "fill-in-the-middle" in err.value.body["message"]


# ------------------------------------------------------------------------------------------------
# Errors: OpenAI's shape, a 4xx naming the field


@pytest.mark.parametrize("extra, param, words", [
    ({"logprobs_please": True}, "logprobs_please", "unknown field"),
    ({"n": 2}, "n", "n must be 1"),
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"temperature": "0.5"}, "temperature", "valid number"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 100000}, "max_tokens", "--max-tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"echo": True}, "echo", "not supported"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"prompt": ["one", "two"]}, "prompt", "one prompt per request"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [1, 2, 100000]}, "prompt", "outside the vocabulary"),
    ({"speculative": {"method": "spec:bogus:k=4"}}, "speculative.method", "unknown verifier"),
    ({"speculative": {"method": "hf-assisted"}}, "speculative.method", "unknown method"),
    ({"speculative": {"method": "spec:model:greedy:k=4:policy=static"}, "temperature": 1.0}, "speculative.method", "greedy"),
    ({"speculative": {"methd": "ar"}}, "speculative.methd", "unknown field"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
])
def test_bad_completion_requests_get_a_400_naming_the_field(server, extra, param, words):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, trust_env=False)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "hi"}], "messages.0.role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content"),
    ([{"role": "user", "content": "hi", "tool_call_id": "1"}], "messages.0.tool_call_id"),
])
def test_bad_chat_requests_get_a_400_naming_the_field(server, messages, param):
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}, trust_env=False)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_the_openai_client_sees_the_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"best_of": 3})
    assert err.value.body["param"] == "best_of"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "tiny" in err.value.body["message"]


def test_malformed_bodies_and_unknown_endpoints(server):
    bad_json = httpx.post(server.url + "/v1/completions", content=b"{not json", trust_env=False,
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    not_object = httpx.post(server.url + "/v1/completions", json=[1, 2], trust_env=False)
    assert not_object.status_code == 400 and not_object.json()["error"]["message"]
    missing = httpx.post(server.url + "/v1/completions", json={"max_tokens": 2}, trust_env=False)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    nowhere = httpx.get(server.url + "/v1/engines", trust_env=False)
    assert nowhere.status_code == 404 and nowhere.json()["error"]["code"] == "not_found"
    wrong_verb = httpx.get(server.url + "/v1/completions", trust_env=False)
    assert wrong_verb.status_code == 405 and "GET" in wrong_verb.json()["error"]["message"]


def test_a_json_body_is_read_whatever_its_content_type_says(pair, server):
    """llama-server reads the body as JSON whatever its Content-Type (``curl -d`` sends a form's);
    a body that is not JSON is told so, with the type it was sent as."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "temperature": 0}
    expected = reference(pair, "x", max_new_tokens=3, temperature=0).text
    for headers in ({}, {"content-type": "application/x-www-form-urlencoded"}, {"content-type": "text/plain"}):
        response = httpx.post(server.url + "/v1/completions", content=json.dumps(body).encode(), headers=headers,
                              trust_env=False)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected, (headers, response.text)
    chat = httpx.post(server.url + "/v1/chat/completions", headers={"content-type": "text/plain"}, trust_env=False,
                      content=json.dumps({"messages": [{"role": "usr", "content": "hi"}]}).encode())
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages.0.role", chat.text  # read, then checked
    form = httpx.post(server.url + "/v1/completions", content=b"prompt=x", trust_env=False,
                      headers={"content-type": "application/x-www-form-urlencoded"})
    message = form.json()["error"]["message"]
    assert form.status_code == 400 and "not valid JSON" in message and "application/x-www-form-urlencoded" in message


@pytest.mark.parametrize("extra, param, words", [
    ({"json_schema": {"$ref": "#"}}, "json_schema", "admits no finite JSON value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}},
     "response_format.json_schema.schema", "admits no finite JSON value"),
    ({"grammar": 'start: "a"{1000000}'}, "grammar", "exceeds llguidance's limits"),
])
def test_grammars_the_engine_cannot_complete_get_a_400_before_generating(server, extra, param, words):
    """Not an empty answer "finished" by the grammar, nor a 500 from the engine's limits."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, trust_env=False)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and words in error["message"], error


def test_api_key_guards_everything_but_health(pair):
    target, draft, tokenizer = pair
    with serve(target, tokenizer, api_key="s3cret") as running:
        assert httpx.get(running.url + "/health", trust_env=False).status_code == 200
        for path in ("/", "/metrics", "/v1/models"):
            response = httpx.get(running.url + path, trust_env=False)
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            running.client("wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
        got = running.client("s3cret").completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
        assert got.usage.completion_tokens == 2
        assert httpx.get(running.url + "/?key=s3cret", trust_env=False).status_code == 200
        assert httpx.get(running.url + "/metrics?key=s3cret", trust_env=False).status_code == 401  # page only


# ------------------------------------------------------------------------------------------------
# The queue, disconnects, timeouts, metrics


def test_full_queue_answers_429_and_a_disconnect_stops_the_generation_within_one_step(pair):
    target, _, tokenizer = pair
    with serve(target, tokenizer, max_queue=0) as running:
        with running_stream(running):
            with pytest.raises(openai.RateLimitError) as err:
                running.client().completions.create(model="tiny", prompt="x", max_tokens=2)
            assert err.value.body["code"] == "queue_full"
        wait_for(lambda: len(running.engine.history) == 1)
        job = running.engine.history[0]
        assert job.outcome == "cancelled" and job.steps < 480
        assert job.steps - job.steps_at_stop <= 1  # at most the step under way when the client left
        got = running.client().completions.create(model="tiny", prompt="x", max_tokens=2)  # served again
        assert got.usage.completion_tokens == 2
        metrics = httpx.get(running.url + "/metrics", trust_env=False).text
        assert 'specdec_requests_total{endpoint="/v1/completions",outcome="queue_full"} 1.0' in metrics
        assert 'specdec_requests_total{endpoint="/v1/completions",outcome="cancelled"} 1.0' in metrics


class _Slow:
    """The tiny target's backend, at least 10 ms a forward: 480 tokens take over 4.8 s on any machine."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, *args, **kwargs):
        time.sleep(0.01)
        return self.backend.forward(*args, **kwargs)


def test_a_non_streaming_client_that_leaves_stops_its_generation(pair):
    from specdec.backends.lean import make_backend

    target, _, tokenizer = pair
    with serve(_Slow(make_backend(target)), tokenizer) as running:
        body = {"prompt": "0", "max_tokens": 480, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(running.url + "/v1/completions", json=body, trust_env=False, timeout=0.5)
        wait_for(lambda: len(running.engine.history) == 1)
        job = running.engine.history[0]
        assert job.outcome == "cancelled" and job.steps < 480 and job.steps - job.steps_at_stop <= 1


def test_queued_requests_run_in_arrival_order(pair):
    target, _, tokenizer = pair
    with serve(target, tokenizer, max_queue=4) as running:
        results: dict[int, Any] = {}

        def ask(i: int) -> None:
            results[i] = running.client().completions.create(model="tiny", prompt=f"{i}", max_tokens=3, temperature=0)

        with running_stream(running):
            threads = []
            for i in range(3):
                threads.append(threading.Thread(target=ask, args=(i,)))
                threads[-1].start()
                wait_for(lambda: running.app.state.specdec.metrics.registry.get_sample_value("specdec_queue_length") == i + 1)
        for t in threads:
            t.join(30)
        wait_for(lambda: len(running.engine.history) == 4)  # a job is logged just after its answer
        order = [job for job in running.engine.history][1:]
        assert [job.outcome for job in order] == ["ok"] * 3
        assert [results[i].choices[0].text for i in range(3)] == [
            generate(target, f"{i}", tokenizer=tokenizer, max_new_tokens=3).text for i in range(3)]
        assert [j.arrived for j in order] == sorted(j.arrived for j in order)


def test_a_request_past_its_timeout_gets_504(pair):
    target, _, tokenizer = pair
    with serve(target, tokenizer, request_timeout=0.2) as running:
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            running.client().completions.create(model="tiny", prompt="x", max_tokens=480, temperature=0)
        assert err.value.status_code == 504 and err.value.body["code"] == "timeout"
        assert time.monotonic() - start < 5
        wait_for(lambda: len(running.engine.history) == 1)
        assert running.engine.history[0].outcome in ("timeout", "cancelled")
        assert running.engine.history[0].steps < 480


def test_metrics_count_requests_tokens_and_latencies(pair):
    target, draft, tokenizer = pair
    with serve(target, tokenizer, draft) as running:
        client = running.client()
        runs = [list(client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0, stream=True))
                for p in ("a", "b")]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="a", max_tokens=10, n=3)
        text = httpx.get(running.url + "/metrics", trust_env=False).text
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    summaries = [run[-1].speculative for run in runs]
    first_step_tokens = sum(len(run[0].speculative["token_ids"]) for run in runs)
    assert value("specdec_requests_total", endpoint="/v1/completions", outcome="ok") == 2
    assert value("specdec_requests_total", endpoint="/v1/completions", outcome="bad_request") == 1
    assert value("specdec_generated_tokens_total") == 20
    assert value("specdec_target_forwards_total") == sum(s["target_forwards"] for s in summaries)
    assert value("specdec_drafted_tokens_total") == sum(s["drafted_tokens"] for s in summaries)
    assert value("specdec_accepted_tokens_total") == sum(s["accepted_tokens"] for s in summaries)
    assert value("specdec_time_to_first_token_seconds_count") == 2
    # one observation per token after each request's first step (whose wait is the time to first token)
    assert value("specdec_inter_token_latency_seconds_count") == 20 - first_step_tokens
    assert value("specdec_queue_length") == 0 and value("specdec_running") == 0


def test_the_page_is_self_contained(server):
    page = httpx.get(server.url + "/", trust_env=False)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/completions" in page.text and "from_draft" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no CDN: everything inline


def test_health(server):
    assert httpx.get(server.url + "/health", trust_env=False).json() == {"status": "ok"}


# ------------------------------------------------------------------------------------------------
# The command line


@pytest.mark.parametrize("args, words", [
    (["--method", "spec:bogus"], "unknown verifier"),
    (["--method", "hf-assisted"], "unknown method"),
    (["--draft", "none", "--method", "spec:model:block:k=4:policy=static"], "needs a draft model"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--api-key", " "], "--api-key is empty"),
])
def test_serve_refuses_bad_options_before_loading(capsys, args, words):
    from specdec import cli

    code = cli.main(["serve", "--target", "/nonexistent-model-dir", *args])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err, err


def test_the_serve_command_serves_on_loopback(tmp_path):
    """``specdec serve`` itself: loads a model directory, binds 127.0.0.1, answers, stops on SIGTERM."""
    from helpers import make_model_dir

    path = str(make_model_dir(tmp_path / "model", chat=True))
    with socket.socket() as probe:  # a free port (the command binds it itself)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "specdec", "serve", "--target", path, "--draft", path, "--dtype", "float32",
               "--port", str(port), "--threads", "1", "--log-level", "warning"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "specdec serve did not start"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", trust_env=False).status_code == 200:
                    break
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(trust_env=False))
        got = client.completions.create(model=path, prompt="def f(x):", max_tokens=12, temperature=0)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    target, tokenizer = models.load(path, dtype="float32")
    want = generate(target, "def f(x):", draft=target, tokenizer=tokenizer, max_new_tokens=12)
    assert got.choices[0].text == want.text
    assert got.speculative["method"] == "spec:ngram+model:block:k=4:policy=auto"  # the default
    assert got.speculative["policy"] == "auto" and got.speculative["policy_state"]["name"] == "auto"
    assert f"on http://127.0.0.1:{port}/" in err and "Traceback" not in err, err
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn shuts down, then re-raises the signal


# ------------------------------------------------------------------------------------------------
# A real model


@pytest.mark.slow
def test_smollm2_server_matches_generate():
    pack = packs.PACKS["smollm2-135m"]
    missing = packs.missing_parts(pack)
    if missing:
        pytest.skip(f"pack smollm2-135m is not installed: {pack.install_command(missing)}")
    target, tokenizer = models.load("smollm2-135m")
    served = Pair(target, tokenizer, target, target_name="smollm2-135m", draft_name="smollm2-135m",
                          draft_weights="bf16")
    app = create_app(served, ServerOptions(method_config("spec:model:block:k=4:policy=static", True)))
    prompt = "def fibonacci(n):"
    want = generate(target, prompt, draft=target, draft_weights="bf16", tokenizer=tokenizer, max_new_tokens=24,
                    policy="static")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    want_chat = generate(target, ids, draft=target, draft_weights="bf16", tokenizer=tokenizer, max_new_tokens=24,
                         policy="static")
    with Server(app) as running:
        client = running.client()
        got = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0)
        chunks = list(client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24,
                                                     temperature=0, stream=True))
    assert got.choices[0].text == want.text
    assert got.speculative["acceptance_rate"] == 1.0  # drafting for itself under greedy
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_chat.text
    assert chunks[-1].choices[0].finish_reason == ("stop" if len(want_chat.token_ids) < 24 else "length")


@pytest.mark.slow
def test_qwen_coder_fim_prompt_holds_the_fim_tokens_by_id():
    """The default target's tokenizer (no model loaded) has the FIM tokens in its vocabulary but
    splits their text into pieces, so the server places them by id: each appears once, as itself."""
    from transformers import AutoTokenizer

    from specdec.server import requests as rq

    pack = packs.PACKS[models.DEFAULT_TARGET]
    if not packs.is_converted(pack):
        pytest.skip(f"{pack.name} is not converted yet (specdec generate --target {pack.name} converts it)")
    tokenizer = AutoTokenizer.from_pretrained(packs.pack_dir(pack), local_files_only=True)
    assert rq.has_fim_tokens(tokenizer)
    body = rq.CompletionBody.model_validate({"prompt": "def add(a, b):\n    ", "suffix": "\n    return c\n"})
    ids = rq.completion_prompt(body, tokenizer, fim=True)
    prefix, suffix, middle = tokenizer.convert_tokens_to_ids(list(rq.FIM_TOKENS))
    assert ids[0] == prefix and ids[-1] == middle and ids.count(suffix) == 1
    assert tokenizer.decode(ids) == "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n    return c\n<|fim_middle|>"


def test_methods_name_no_backend_the_server_runs_its_loaded_models():
    """A method is a decoding method only: the server runs it on the models it loaded (a bench's
    backend= key is refused, at start for --method, with a 400 for a request)."""
    import argparse

    from specdec.cli.common import CLIError
    from specdec.server import requests as rq
    from specdec.cli.serve import default_method

    args = argparse.Namespace(target="smollm2-135m", draft=None, backend="llamacpp", method="spec:ngram:block")
    method = default_method(args)
    assert method.drafter == "ngram" and str(method) == "spec:ngram:block:k=4:policy=auto"
    with pytest.raises(CLIError, match="backend="):
        default_method(argparse.Namespace(**{**vars(args), "method": "spec:ngram:block:backend=torch"}))
    body = rq.CompletionBody(prompt="x", speculative={"method": "spec:ngram:block:k=3"})
    assert rq.choose_method(body, method, has_draft=False).k == 3
    body = rq.CompletionBody(prompt="x", speculative={"method": "spec:ngram:block:backend=torch"})
    with pytest.raises(rq.APIError, match="backend="):
        rq.choose_method(body, method, has_draft=False)


@pytest.mark.parametrize("body, param, message", [
    ({"speculative": {"method": "spec:model:greedy:k=4:policy=static"}, "temperature": 1.0}, "speculative.method",
     'speculative.method: spec:model:greedy:k=4:policy=static: greedy verification (greedy) reproduces greedy '
     'decoding only, but "temperature" is 1.0; use token or block to sample'),
    ({"speculative": {"method": "spec:model:coupled"}, "sampler": "multinomial"}, "sampler",
     'sampler: spec:model:coupled:k=4:policy=auto: coupled verification (coupled) verifies Gumbel-max draws, but '
     '"sampler" is multinomial; drop "sampler" (coupled implies gumbel), or use block'),
    ({"speculative": {"method": "spec:model:typical"}, "seed": 3}, "sampler",
     'sampler: spec:model:typical:k=4:policy=auto: typical acceptance (typical) draws by its own lossy rule, but '
     '"sampler": "gumbel" draws by Gumbel-max with public noise; use coupled, or "sampler": "multinomial" for '
     'typical'),
])
def test_a_request_breaking_a_rule_of_the_config_gets_its_400(body, param, message):
    """The rules that tie a method to the sampling are DecodeConfig's; the server names the field."""
    from specdec.config import DecodeConfig
    from specdec.server import requests as rq

    with pytest.raises(rq.APIError) as refused:
        rq.choose_method(rq.CompletionBody(prompt="x", **body), DecodeConfig.parse("spec"), has_draft=True)
    assert (refused.value.status, refused.value.param, refused.value.message) == (400, param, message)
    seeded = rq.CompletionBody(prompt="x", seed=3, speculative={"method": "spec:model:coupled"})
    assert rq.choose_method(seeded, DecodeConfig.parse("spec"), True, seeded_sampler="multinomial").gumbel
