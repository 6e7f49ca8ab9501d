"""Predicted outputs in the bench: a prompt file's ``prediction`` reaches the specdec servers whose
method says ``prediction=yes`` and no other server, and the report carries the usage's accepted and
rejected prediction tokens, per request, beside each method's speed, the time to the first token
and identity to plain decoding."""

from __future__ import annotations

import json

import pytest

from specdec.bench.methods import method_of_record, parse_method
from specdec.bench.servers import Completion, Servers, chat_request_body, request_body, run_server, server_key
from specdec.prompts import load_jsonl
from specdec.server.requests import ChatBody, CompletionBody

CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
ASK = [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}]
PACK = "smollm2-135m"
METHOD = "spec:ngram:block:k=4:policy=static:backend=gguf:via=serve"


def test_prediction_yes_is_a_served_spec_methods_key():
    method = parse_method("spec:ngram:block:k=4:policy=static:via=serve:prediction=yes")
    assert method.prediction and method.name.endswith(":via=serve:prediction=yes")
    assert parse_method(method.name) == method == method_of_record(method.record())
    assert method.without_prediction == parse_method("spec:ngram:block:k=4:policy=static:via=serve")
    assert not parse_method("spec:via=serve:prediction=no").prediction
    for text, why in (("spec:prediction=yes", "with via=serve"), ("ar:via=serve:prediction=yes", "spec method"),
                      ("spec:via=serve:prediction=maybe", "takes yes or no"),
                      ("spec:via=serve:prediction=yes:prediction=yes", "given twice")):
        with pytest.raises(ValueError, match=why):
            parse_method(text)


def test_a_prompt_file_carries_the_prediction(tmp_path):
    path = tmp_path / "edits.jsonl"
    path.write_text(json.dumps({"messages": ASK, "prediction": CODE}) + "\n" + json.dumps({"messages": ASK}) + "\n")
    with_it, without = load_jsonl(path)
    assert (with_it.prediction, without.prediction) == (CODE, None)
    path.write_text(json.dumps({"messages": ASK, "prediction": ["x"]}) + "\n")
    with pytest.raises(ValueError, match='"prediction" must be a string'):
        load_jsonl(path)


def test_the_prediction_goes_as_openais_field_and_only_where_given():
    chat = chat_request_body(ASK, 0.0, 32, 0, False, prediction=CODE)
    assert chat["prediction"] == {"type": "content", "content": CODE}
    assert "prediction" not in chat_request_body(ASK, 0.0, 32, 0, False)
    ChatBody.model_validate(chat)
    ids = request_body([1, 2], 0.0, 8, 0, True, llama_server=False, prediction=CODE)
    assert ids["prediction"] == {"type": "content", "content": CODE} and ids["stream_options"]["include_usage"]
    CompletionBody.model_validate(ids)


def test_the_method_that_sends_predictions_has_a_server_of_its_own(tmp_path):
    """Each finds no prompt the other's run just left in its server's cache; both start alike."""
    sent, plain = parse_method(f"{METHOD}:prediction=yes"), parse_method(METHOD)
    assert server_key(sent) != server_key(plain)
    servers = Servers(tmp_path / "t.gguf", None, ["--target", "t", "--draft", "none"])
    assert servers._argv(server_key(sent)) == servers._argv(server_key(plain))


def test_several_clients_send_the_prediction_for_the_method_that_sends_it():
    from specdec.bench.concurrency import ConcurrencySettings, answer_of, request
    from specdec.prompts import Prompt

    prompt = Prompt("edits.jsonl", "repeat", messages=tuple(ASK), prediction=CODE)
    settings = ConcurrencySettings(levels=(1,))
    assert request(prompt, settings, 0, prediction=True)[1]["prediction"]["content"] == CODE
    assert "prediction" not in request(prompt, settings, 0)[1]
    text = Prompt("edits.jsonl", "text", text="def area(", prediction=CODE)
    path, body = request(text, settings, 0, prediction=True)
    assert path == "/v1/completions" and body["prediction"]["content"] == CODE
    CompletionBody.model_validate(body)
    answer = answer_of(_Streams().complete("k", body), 0, 0)
    assert (answer.prediction_accepted, answer.prediction_rejected) == (1, 2)


class _Streams:
    """Answers every request with one chunk and a usage chunk that counts what it was sent."""

    def __init__(self):
        self.bodies = []

    def complete(self, key, body, path="/v1/completions"):
        self.bodies.append(body)
        out = Completion()
        out.add({"choices": [{"delta": {"content": "ab"}}],
                 "speculative": {"token_ids": [7, 8], "from_draft": [True, False], "drafted": 3}}, 0.25)
        details = ({"completion_tokens_details": {"accepted_prediction_tokens": 1, "rejected_prediction_tokens": 2}}
                   if "prediction" in body else {})
        out.add({"choices": [], "usage": {"completion_tokens": 2} | details}, 0.5)
        out.seconds = 1.0
        return out


def test_a_served_run_reads_the_prediction_counts_from_the_usage():
    fake = _Streams()
    sent = run_server(fake, "specdec:gguf:spec", "spec", [1], 0.0, 2, [], 0, method="spec", messages=ASK,
                      prediction=CODE)
    plain = run_server(fake, "specdec:gguf:spec", "spec", [1], 0.0, 2, [], 0, method="spec", messages=ASK)
    assert (sent.prediction_accepted, sent.prediction_rejected) == (1, 2)
    assert (plain.prediction_accepted, plain.prediction_rejected) == (None, None)
    assert ["prediction" in body for body in fake.bodies] == [True, False]


# ------------------------------------------------------------------------------------------------
# One bench run on the SmolLM2 GGUF: a chat prompt with its prediction, sent and not sent

@pytest.fixture(scope="module")
def prediction_run(tmp_path_factory):
    from specdec import packs

    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    import torch

    from specdec.cli.bench import main

    out = tmp_path_factory.mktemp("prediction")
    prompts = out / "edits.jsonl"
    prompts.write_text(json.dumps({"id": "repeat", "messages": ASK, "prediction": CODE}) + "\n")
    argv = ["--target", PACK, "--draft", "none", "--backend", "gguf", "--methods",
            f"{METHOD}:prediction=yes,{METHOD}", "--prompts", str(prompts), "--server-endpoint", "chat",
            "--max-new-tokens", "24", "--warmup-tokens", "4", "--threads", "1", "--no-progress",
            "--out", str(out / "run")]
    before = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(before)
    return {"data": json.loads((out / "run" / "greedy" / "results.json").read_text()),
            "markdown": (out / "run" / "greedy" / "results.md").read_text()}


@pytest.mark.slow
def test_the_prediction_reaches_the_server_and_the_report_counts_it(prediction_run):
    data = prediction_run["data"]
    runs = {s["method"]: s for s in data["samples"]}
    sent, plain = runs[f"{METHOD}:prediction=yes"], runs[METHOD]
    assert sent["prediction_accepted"] + sent["prediction_rejected"] > 0  # drafted from what the request carried
    assert (plain["prediction_accepted"], plain["prediction_rejected"]) == (None, None)  # sent without it
    assert sent["token_ids"] == plain["token_ids"] == runs["ar:backend=gguf"]["token_ids"]  # the same answer
    figures = data["predictions"][f"{METHOD}:prediction=yes"]
    request, = figures["requests"]
    assert (request["accepted"], request["rejected"]) == (sent["prediction_accepted"], sent["prediction_rejected"])
    assert request["identical_to_ar"] is True and 0 < request["prefill_share"] < 1
    assert figures["without_prediction"] == METHOD and list(figures["geomean_vs"])[0] == METHOD
    assert set(request["tokens_per_second"]) == {f"{METHOD}:prediction=yes", METHOD, "ar:backend=gguf"}
    assert "accepted / rejected" in prediction_run["markdown"] and "| repeat |" in prediction_run["markdown"]
