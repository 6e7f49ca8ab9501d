"""``specdec serve`` as a drop-in OpenAI server: structured output, tool calls, logprobs, penalties
and logit_bias, driven by the official ``openai`` client against SmolLM2-135M's GGUF on llama.cpp
(a batch-invariant model: a verification row has the very logits of a one-token step, so a
speculative method and plain decoding give the same tokens and the same log-probabilities).

The pieces that need no model (the tool-call parser, the tool grammar, the generic tool prompt)
are tested on their own first, then a forced tool call on a tiny llama with a byte-level tokenizer.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from helpers import PACK, Server, _gguf, serve, tiny_pair, tiny_tokenizer

from specdec.server import tools
from specdec.server.tools import ToolCallParser

# ------------------------------------------------------------------------------------------------
# Without a model


CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": [1, {"a": 2}]}}'
         '\n</tool_call>\n<tool_call>\n{"arguments": {"x": 1}, "name": "other"}\n</tool_call>\nDone <tool')


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 11, len(CALLS)])
def test_the_tool_call_parser_gives_the_same_calls_and_content_however_the_text_arrives(piece):
    parser, deltas = ToolCallParser(), []
    for at in range(0, len(CALLS), piece):
        deltas += parser.feed(CALLS[at:at + piece])
    deltas += parser.finish()
    assert [(c.name, c.arguments) for c in parser.calls] == [
        ("get_weather", '{"city": "Pa\\"ris", "days": [1, {"a": 2}]}'), ("other", '{"x": 1}')]
    assert parser.content == "Let me look.Done <tool"  # whitespace beside an envelope is dropped
    assert "".join(d[1] for d in deltas if d[0] == "content") == parser.content
    for index, call in enumerate(parser.calls):  # a call's name comes first, then its arguments piece by piece
        assert ("call", index) in deltas
        assert "".join(d[2] for d in deltas if d[0] == "arguments" and d[1] == index) == call.arguments
        assert deltas.index(("call", index)) < min(i for i, d in enumerate(deltas) if d[:2] == ("arguments", index))


@pytest.mark.parametrize("text, content", [
    ("no calls here", "no calls here"),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>"),
    ('<tool_call>\n{"name": "f", "arguments": {"a": ', ""),  # cut short: the call keeps what came
])
def test_text_that_holds_no_whole_call_stays_content(text, content):
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    assert parser.content == content
    assert [c.arguments for c in parser.calls] == ([] if content else ['{"a": '])


FUNCTIONS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"]}},
             {"name": "get_time", "parameters": {"type": "object", "properties": {}}}]


@pytest.mark.parametrize("several, content", [(False, None), (True, None), (True, {"type": "object"})])
def test_the_tool_grammar_compiles_and_forces_the_envelope(several, content):
    import llguidance

    grammar = tools.tool_grammar(FUNCTIONS, several=several, content_schema=content)
    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled)
    assert not failed and not messages, messages
    assert grammar.count("%json") == (2 if content else 1) and ('("\\n" call)*' in grammar) == several


class Place(BaseModel):
    city: str


class Trip(BaseModel):  # nested: its schema refers to Place through "$defs"
    start: Place
    stops: list[Place]


def test_the_tool_grammar_takes_nested_schemas_and_matches_a_call_as_the_template_writes_it():
    import llguidance
    import llguidance.hf

    tokenizer = tiny_tokenizer()
    tokenizer.eos_token = "<|fim_middle|>"
    functions = [{"name": "plan", "parameters": Trip.model_json_schema()}, FUNCTIONS[1]]
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer),
                                   tools.tool_grammar(functions, several=False))
    call = tools.envelope("plan", {"start": {"city": "Oslo"}, "stops": [{"city": "Bergen"}]})
    assert matcher.consume_tokens(tokenizer(call)["input_ids"]) and matcher.is_accepting(), matcher.get_error()
    matcher.reset()
    wrong = tokenizer(tools.envelope("plan", {"start": {"town": "Oslo"}, "stops": []}))["input_ids"]
    assert matcher.try_consume_tokens(wrong) < len(wrong)  # "town" is not Place's key


def test_a_template_without_tools_gets_them_in_a_system_message_and_the_history_as_text():
    from transformers import AutoTokenizer

    from specdec import packs

    if packs.missing_parts(packs.PACKS[PACK]):
        pytest.skip(f"pack {PACK} is not installed")
    tokenizer = AutoTokenizer.from_pretrained(str(packs.pack_dir(PACK)))
    assert not tools.template_takes_tools(tokenizer)  # SmolLM2's template ignores tools
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    messages, given = tools.template_messages(history, [{"type": "function", "function": FUNCTIONS[0]}], native=False)
    assert given is None and messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[2] == {"role": "assistant", "content": call}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in text and "<tool_response>\nsunny" in text


def test_qwen_templates_get_the_tools_and_render_the_history_themselves():
    from transformers import AutoTokenizer

    from specdec import packs
    from specdec.server.requests import ChatBody, chat_prompt

    name = "qwen2.5-coder-0.5b"
    if packs.missing_parts(packs.PACKS[name]) or not (packs.pack_dir(name) / "tokenizer_config.json").is_file():
        pytest.skip(f"pack {name} is not installed or not converted")
    tokenizer = AutoTokenizer.from_pretrained(str(packs.pack_dir(name)), fix_mistral_regex=False)
    assert tools.template_takes_tools(tokenizer)
    body = ChatBody.model_validate({"tools": [{"type": "function", "function": FUNCTIONS[0]}], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    text = tokenizer.decode(chat_prompt(body, tokenizer))
    assert text.count('"name": "get_weather"') == 2  # in the tool list and in the earlier call
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


# A template that takes tools (as Qwen2.5's does), short enough for a tiny model's context
TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools> <tool_call>\n"
                  "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")


class ShortWeather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=6)
    unit: Literal["celsius", "fahrenheit"]


@pytest.mark.parametrize("choice", [{"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                                    {"tool_choice": "required", "parallel_tool_calls": False}])
def test_a_forced_call_on_a_tiny_model_follows_the_schema_and_streams_as_deltas(choice):
    """A byte-level tokenizer (which the grammar reads right) and a random tiny llama drafted by a
    noisy copy: the call is all the answer, its arguments follow the schema, the envelope is
    forced, and the streamed deltas join to the whole answer's call."""
    target, draft = tiny_pair()
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    assert tools.template_takes_tools(tokenizer)
    weather = {"name": "get_weather", "parameters": ShortWeather.model_json_schema()}
    functions = [{"type": "function", "function": weather},
                 {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with serve(target, tokenizer, draft) as running:
        kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], max_tokens=160, temperature=0,
                  tools=functions, **choice)
        done = running.client().chat.completions.create(**kw)
        chunks = list(running.client().chat.completions.create(**kw, stream=True))
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls" and message.content is None
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    ShortWeather.model_validate_json(call.function.arguments)
    assert done.speculative["forced_tokens"] >= len('<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_an_answer_under_the_planner_carries_its_short_state_unless_asked_for_all_of_it():
    """The planner's whole state (cost curves, acceptance tables, histograms) is kilobytes: an answer
    carries its single-valued figures, as docs/server.md shows the object, and all of it only with
    ``"speculative": {"policy_state": "full"}``, which changes nothing else."""
    target, draft = tiny_pair()
    with serve(target, tiny_tokenizer(), draft, method="spec:model:block:k=4:policy=auto") as running:
        client = running.client()
        kw = dict(model="tiny", prompt="abcabcabc", max_tokens=24, temperature=0)
        short = client.completions.create(**kw)
        full = client.completions.create(**kw, extra_body={"speculative": {"policy_state": "full"}})
        chunks = list(client.completions.create(**kw, stream=True))
        named = client.completions.create(**kw, extra_body={"speculative": {
            "method": "spec:model:block:k=4:policy=auto", "policy_state": "full"}})
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**kw, extra_body={"speculative": {"policy_state": "all"}})
    state, whole = short.speculative["policy_state"], full.speculative["policy_state"]
    assert short.speculative["policy"] == "auto" and state["name"] == "auto" and state["k_max"] == 16
    assert not any(isinstance(v, (dict, list)) for v in state.values()), state
    assert {"costs", "alpha_by_position", "calibration", "planned", "drafted", "reasons"} <= whole.keys()
    assert state == {k: v for k, v in whole.items() if k in state}
    assert len(json.dumps(short.speculative)) < 1000, short.speculative  # the short object the docs show
    assert chunks[-1].speculative["policy_state"] == state  # the last chunk's summary is the same
    assert named.speculative["policy_state"] == whole
    assert full.choices[0].text == short.choices[0].text == named.choices[0].text
    assert {k: v for k, v in full.speculative.items() if "second" not in k and k != "policy_state"} == \
        {k: v for k, v in short.speculative.items() if "second" not in k and k != "policy_state"}
    assert refused.value.status_code == 400 and refused.value.body["param"] == "speculative.policy_state"


# ------------------------------------------------------------------------------------------------
# A server on the SmolLM2 GGUF (one per module)

METHOD = "spec:ngram:block:k=4:policy=static"  # the server's default: a speculative chain


@pytest.fixture(scope="module")
def server():
    from transformers import AutoTokenizer

    from specdec import packs
    from specdec.backends import llamacpp
    from specdec.server.app import ServerOptions, create_app
    from specdec.models import Pair
    from specdec.server.requests import method_config

    model = llamacpp.load_gguf(_gguf(), n_threads=1, n_ctx=1024, prefill_layout="repacked")
    tokenizer = AutoTokenizer.from_pretrained(str(packs.pack_dir(PACK)))
    served = Pair(model, tokenizer, model.fork(), target_name=PACK, draft_name=PACK)  # drafting itself, for trees
    with Server(create_app(served, ServerOptions(method_config(METHOD, False)))) as running:
        yield running


@pytest.fixture(scope="module")
def grammar_reads_bytes(server):
    """Whether the library's grammar sees this tokenizer's tokens as the bytes they stand for: a
    grammar forcing a newline and a space must force tokens that decode to them. (SmolLM2's
    tokenizer decodes through a Sequence of decoders ending in ByteLevel, which llguidance's
    reading of a Hugging Face tokenizer takes for plain text: "Ċ" as the two bytes of "Ċ", not
    a newline.)"""
    from specdec.constraints import Constraints

    state = server.app.state.specdec
    tokenizer = state.models.tokenizer
    try:
        processor = Constraints(grammar='start: "\\n a"').processor(tokenizer, state.limits.vocab_size, [],
                                                                     sorted(state.eos))
        return tokenizer.decode(processor.forced(8)) == "\n a"
    except RuntimeError:
        return False


def needs_bytes_read_right(ok: bool) -> None:
    if not ok:
        pytest.xfail("specdec.constraints.grammar_tokenizer reads SmolLM2's byte-level tokens as text "
                     "(its decoder is a Sequence ending in ByteLevel); grammars with a space or newline fail")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300,
                         http_client=httpx.Client(trust_env=False))


class City(BaseModel):
    name: str
    country: str


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    done = client.beta.chat.completions.parse(
        model=PACK, messages=[{"role": "user", "content": "The capital of France, as JSON with name and country."}],
        response_format=City, max_tokens=40, temperature=0)
    choice = done.choices[0]
    assert isinstance(choice.message.parsed, City) and choice.finish_reason == "stop"
    assert City.model_validate_json(choice.message.content) == choice.message.parsed
    assert done.system_fingerprint.startswith("fp_specdec")
    assert done.speculative["forced_tokens"] >= 1  # the schema's opening '{' at least is forced


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")  # "additionalProperties": false, as strict function schemas have
    city: str
    unit: Literal["celsius", "fahrenheit"]


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                              "parameters": Weather.model_json_schema()}},
           {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                             "parameters": CITY}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_named_tool_choice_returns_a_call_whose_arguments_follow_the_schema_streamed_or_not(
        client, grammar_reads_bytes):
    needs_bytes_read_right(grammar_reads_bytes)
    kw = dict(model=PACK, messages=ASK, tools=WEATHER, max_tokens=48, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    done = client.chat.completions.create(**kw)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    Weather.model_validate_json(call.function.arguments)
    assert done.speculative["forced_tokens"] > 0  # the envelope up to the first argument is forced

    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert len(deltas) > 1  # then the arguments, piece by piece
    assert {d.index for d in deltas} == {0} and all(d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_a_conversation_with_earlier_calls_and_their_results_is_answered(client):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    done = client.chat.completions.create(model=PACK, messages=history, tools=WEATHER[:1], max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls") and done.usage.prompt_tokens > 100


def test_streamed_logprobs_equal_the_whole_answers(client):
    kw = dict(model=PACK, messages=ASK, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    content = whole.choices[0].logprobs.content
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert len(content) == whole.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob for e in content)
    shown = content[:-1] if whole.choices[0].finish_reason == "stop" else content  # less the end token
    assert "".join(e.token for e in shown) == whole.choices[0].message.content  # plain text, whole tokens

    kw = dict(model=PACK, prompt="def fibonacci(n):", max_tokens=12, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True))
    logprobs = whole.logprobs
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [x for c in chunks if c.choices[0].logprobs for x in getattr(c.choices[0].logprobs, key)]
        assert streamed == getattr(logprobs, key), key
    assert [whole.text[o:o + len(t)] for o, t in zip(logprobs.text_offset, logprobs.tokens)] == logprobs.tokens
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}])
def test_a_speculative_method_and_ar_give_equal_answers_and_logprobs_under_the_same_constraints(client, sampling):
    kw = dict(model=PACK, max_tokens=32, logprobs=True, top_logprobs=2, **sampling,
              messages=[{"role": "user", "content": "A JSON record: Alice is 30."}],
              response_format={"type": "json_schema",
                               "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
              presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"28": -2.5, "1": 1.5})
    answers = {m: client.chat.completions.create(**kw, extra_body={"speculative": {"method": m}})
               for m in ("ar", METHOD, "spec:model:tree")}
    ar = answers.pop("ar").choices[0]
    value = json.loads(ar.message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    for method, answer in answers.items():
        spec = answer.choices[0]
        assert answer.speculative["method"] != "ar" and answer.speculative["drafted_tokens"] > 0
        assert spec.message.content == ar.message.content, method
        assert [e.model_dump() for e in spec.logprobs.content] == [e.model_dump() for e in ar.logprobs.content], method


def _tool(name: Any = "f", parameters: Any = None) -> dict[str, Any]:
    function = {"parameters": parameters or {"type": "object"}}
    return {"type": "function", "function": function if name is None else {"name": name, **function}}


def test_a_json_answer_beside_tools_allows_the_whitespace_of_any_json_schema():
    """With tools and a response_format, the answer's JSON has the layout a json_schema constraint
    allows on its own: a line break and an indent between tokens, no blank lines."""
    from llguidance import LLMatcher

    from specdec.constraints import grammar_tokenizer
    from specdec.server import requests as rq
    from helpers import tiny_tokenizer

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = rq.ChatBody.model_validate({"messages": ASK, "tools": [_tool()], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    grammar = rq.constraint_fields(body).build().grammar_text()
    tokenizer = tiny_tokenizer()

    def allows(text: str) -> bool:
        matcher = LLMatcher(grammar_tokenizer(tokenizer, 259), grammar, log_level=0)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return matcher.validate_tokens(ids) == len(ids)

    assert allows('{\n  "a": 1\n}') and allows('{"a": 1}')
    assert not allows('{\n\n  "a": 1') and not allows('{"a":   1')


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"json_schema": {"type": "nope"}}, "json_schema"),
    ({"grammar": "start: ("}, "grammar"),
    ({"grammar": "start: /(a|aa)*(b|bb){1000}/"}, "grammar"),  # beyond the engine's limits at the first tokens
    ({"json_schema": {"type": "object", "properties": {"p": {"type": "string", "pattern": "^(a|aa)*(b|bb){1000}$"}},
                      "required": ["p"]}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format.json_schema.schema"),  # no finite value
    ({"grammar": 'start: "a"', "json_schema": {"type": "object"}}, "grammar"),
    ({"tools": [_tool(name=None)]}, "tools.0.function.name"),
    ({"tools": [_tool(name="has space")]}, "tools.0.function.name"),
    ({"tools": [_tool(), _tool(name="g", parameters={"type": "nope"})]}, "tools.1.function.parameters"),
    ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # SmolLM2's vocabulary is ids 0..49151
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
])
def test_each_bad_chat_field_gets_a_400_naming_it(server, extra, param):
    body = {"messages": ASK, "max_tokens": 2, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, trust_env=False, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(param), error


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logit_bias": {"-1": 2}}, "logit_bias"),
    ({"regex": "a+"}, "regex"),  # not a field of the API: the grammar field is llama-server's "grammar"
])
def test_each_bad_completion_field_gets_a_400_naming_it(server, extra, param):
    body = {"prompt": "x", "max_tokens": 2, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, trust_env=False, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_grammar_on_completions_constrains_the_text(client, grammar_reads_bytes):
    needs_bytes_read_right(grammar_reads_bytes)
    done = client.completions.create(model=PACK, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                     extra_body={"grammar": 'start: " yes" | " no"'})
    assert done.choices[0].text in (" yes", " no") and done.choices[0].finish_reason == "stop"
