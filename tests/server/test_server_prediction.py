"""OpenAI's Predicted Outputs on the server: ``prediction`` is parsed and checked, drafted from, and
changes no answer -- whole or streamed, one at a time or beside other requests -- while usage
counts the prediction's accepted and rejected tokens as OpenAI reports them."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from specdec import models, packs
from specdec.models import Pair
from specdec.server.app import ServerOptions, create_app
from specdec.server.requests import method_config
from helpers import THREADS, Server

PACK = "smollm2-135m"
CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
ASK = [{"role": "user", "content": "Repeat this code exactly, renaming width to w:\n\n" + CODE}]


@pytest.fixture(scope="module")
def server():
    if packs.missing_parts(packs.PACKS[PACK]):
        pytest.skip(f"pack {PACK} is not installed")
    pair = models.load_pair(PACK, PACK, backend="gguf", n_threads=THREADS)
    served = Pair(pair.target, pair.tokenizer, pair.draft, target_name=PACK, draft_name=PACK, backend="gguf")
    with Server(create_app(served, ServerOptions(method_config("spec", True), parallel=2))) as running:
        yield running


def chat(server: Server, stream: bool = False, **extra) -> dict:
    body = {"model": PACK, "messages": ASK, "max_tokens": 60, "temperature": 0, **extra}
    with httpx.Client(trust_env=False, timeout=300) as http:
        if not stream:
            response = http.post(server.url + "/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            answer = response.json()
            return {"text": answer["choices"][0]["message"]["content"], "usage": answer["usage"],
                    "sources": answer["speculative"]["sources"]}
        text, usage = "", None
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                if data["choices"]:
                    text += data["choices"][0]["delta"].get("content") or ""
                usage = data.get("usage") or usage
        return {"text": text, "usage": usage}


def test_answers_with_a_prediction_are_the_answers_without_and_usage_counts_it(server):
    plain = chat(server)
    assert "completion_tokens_details" not in plain["usage"]  # no prediction: OpenAI's usage as before
    same = plain["text"]
    edited = same.replace("w * height", "w * h", 1) if "w * height" in same else same[:20] + "# edit\n" + same[20:]
    unrelated = "SELECT name FROM users WHERE id = 42;\n" * 3
    parts = [{"type": "text", "text": same[:15]}, {"type": "text", "text": same[15:]}]
    results: dict[str, dict] = {}

    def ask(name: str, content, stream: bool) -> None:
        results[name] = chat(server, stream, prediction={"type": "content", "content": content})

    cases = [("same", same, False), ("edited", edited, False), ("unrelated", unrelated, False),
             ("parts", parts, False), ("same-stream", same, True), ("edited-stream", edited, True)]
    threads = [threading.Thread(target=ask, args=case) for case in cases]  # two slots, six requests at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, got in results.items():
        assert got["text"] == plain["text"], name
        assert got["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"], name
        details = got["usage"]["completion_tokens_details"]
        assert set(details) == {"accepted_prediction_tokens", "rejected_prediction_tokens"}, name
        assert details["accepted_prediction_tokens"] <= got["usage"]["completion_tokens"]
        if "sources" in got:  # the speculative object's counts are the usage's
            counts = got["sources"].get("prediction", {"drafted": 0, "accepted": 0})
            assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (
                counts["accepted"], counts["drafted"] - counts["accepted"]), name


def static_counts(n: int, k: int = 4) -> int:
    """The tokens a static policy drafts from a prediction that is the whole answer of ``n``
    tokens: ``k`` a step (fewer where the token limit leaves less room), each kept, and the target
    adds one a step."""
    drafted, produced = 0, 0
    while produced < n:
        step = min(k, n - produced - 1)
        drafted += step
        produced += step + 1
    return drafted


def test_a_whole_predicted_answer_is_drafted_from_the_prediction_and_counted(server):
    # How many tokens the default (planned) method drafts from the prediction depends on the
    # planner's timing, and here the draft model is the target itself, as sure a source as the
    # prediction; a static policy drafts from the first source offered (the prediction, where it
    # knows its place) a fixed number a step, so the counts are known exactly -- beside other
    # requests on the two slots too.
    static = {"speculative": {"method": "spec:k=4:policy=static"}}
    plain = chat(server, **static)
    results: dict[str, dict] = {}

    def ask(name: str, stream: bool) -> None:
        results[name] = chat(server, stream, prediction={"type": "content", "content": plain["text"]}, **static)

    threads = [threading.Thread(target=ask, args=(name, name.endswith("stream")))
               for name in ("whole", "whole-stream", "again")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n = plain["usage"]["completion_tokens"]
    assert n == 60  # the answer runs to max_tokens, so the policy's last steps are known
    for name, got in results.items():
        assert got["text"] == plain["text"], name
        assert got["usage"]["completion_tokens_details"] == {
            "accepted_prediction_tokens": static_counts(n), "rejected_prediction_tokens": 0}, name


@pytest.mark.parametrize("prediction, param", [
    ("some text", "prediction"),  # a chat completion's prediction is an object
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content", "content": 3}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content"),
    ({"type": "content"}, "prediction.content"),
])
def test_a_malformed_prediction_is_a_400_naming_the_field(server, prediction, param):
    body = {"model": PACK, "messages": ASK, "max_tokens": 4, "prediction": prediction}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, trust_env=False, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_an_empty_prediction_is_ignored_and_a_completion_takes_text(server):
    empty = chat(server, prediction={"type": "content", "content": ""})
    assert "completion_tokens_details" not in empty["usage"]
    body = {"model": PACK, "prompt": CODE[:40], "max_tokens": 20, "temperature": 0}
    with httpx.Client(trust_env=False, timeout=300) as http:
        plain = http.post(server.url + "/v1/completions", json=body).json()
        predicted = http.post(server.url + "/v1/completions", json={**body, "prediction": CODE[40:]}).json()
    assert predicted["choices"][0]["text"] == plain["choices"][0]["text"]
    assert "completion_tokens_details" in predicted["usage"]
