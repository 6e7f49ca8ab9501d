"""The ``extract`` prompt set and schema-constrained server runs: the set's schemas, the validator
that judges the outputs, the figures a run reports, and one bench run of specdec serve (and
llama-server, where its binary is built) on the SmolLM2 GGUF with every extract prompt.

The bench run is skipped when the llama.cpp binding or the SmolLM2 pack is missing (the skip
message says what to install); without a llama-server binary it runs specdec serve alone.
"""

from __future__ import annotations

import json

import pytest

from specdec.bench.sample import Sample
from specdec.bench.schema_check import check_output, check_schema, markdown, method_figures, schema_errors
from specdec.constraints import Constraints
from specdec.prompts import EXTRACT_ANSWER, load_jsonl, load_prompts

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "maxItems": 2, "items": {"type": "string"}},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "score", "active"],
    "additionalProperties": False,
}
GOOD = {"name": "Ada", "age": 36, "role": "admin", "tags": ["x"], "score": 2.5, "active": True}


def _strict_objects(schema: dict) -> list[dict]:
    """Every object schema inside ``schema`` (itself included)."""
    found = [schema] if schema.get("type") == "object" else []
    for sub in [*schema.get("properties", {}).values(), *([schema["items"]] if "items" in schema else [])]:
        found += _strict_objects(sub)
    return found


def test_the_extract_set_has_twelve_chat_prompts_each_with_a_strict_schema():
    prompts = load_prompts("extract")
    assert len(prompts) == 12 and len({p.id for p in prompts}) == 12
    assert len({p.schema_name for p in prompts}) == 12
    for p in prompts:
        assert p.set == "extract" and p.chat and p.messages[-1]["content"].endswith(EXTRACT_ANSWER)
        assert p.schema is not None and p.schema["type"] == "object"
        assert p.to_dict() == {"set": "extract", "id": p.id, "chat": True, "schema": p.schema_name}
        check_schema(p.schema)  # within the subset the validator knows
        Constraints(json_schema=p.schema).check(50000)  # and llguidance compiles it
        for obj in _strict_objects(p.schema):  # OpenAI's strict mode: every field required, no others
            assert obj["required"] == list(obj["properties"]) and obj["additionalProperties"] is False, p.id
    kinds = {json.dumps(s.get("type", "enum")) for p in prompts for s in p.schema["properties"].values()}
    assert {'"string"', '"integer"', '"number"', '"array"', '"boolean"', '"enum"'} <= kinds
    assert load_prompts("extract:4", seed=3) == load_prompts("extract:4", seed=3)


def test_the_set_schemas_are_valid_json_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    for p in load_prompts("extract"):
        jsonschema.Draft202012Validator.check_schema(p.schema)


def test_the_validator_names_each_broken_rule():
    assert schema_errors(GOOD, PERSON) == []
    bad = GOOD | {"name": "Adelaide", "age": 2.5, "role": "root", "tags": ["a", "b", "c"], "extra": 1}
    del bad["active"]
    assert schema_errors(bad, PERSON) == [
        "$: required property 'active' is missing",
        "$.name: length 8 is above the maximum 5",
        "$.age: expected integer, got 2.5",
        '$.role: "root" is not one of ["admin", "user"]',
        "$.tags: item count 3 is above the maximum 2",
        "$: property 'extra' is not allowed",
    ]
    assert schema_errors(GOOD | {"age": 36.0}, PERSON) == []  # 36.0 is an integer in JSON Schema
    assert schema_errors(GOOD | {"age": True}, PERSON) == ["$.age: expected integer, got true"]  # a bool is not
    assert schema_errors(GOOD | {"age": -1}, PERSON) == ["$.age: value -1 is below the minimum 0"]
    assert schema_errors(GOOD | {"tags": [1]}, PERSON) == ["$.tags[0]: expected string, got 1"]
    assert schema_errors(GOOD | {"name": "é" * 5}, PERSON) == []  # lengths in code points


def test_the_validator_agrees_with_jsonschema_where_it_is_installed():
    jsonschema = pytest.importorskip("jsonschema")
    values = [GOOD, GOOD | {"age": 2.0}, GOOD | {"age": False}, GOOD | {"role": "user", "tags": []},
              GOOD | {"score": "1"}, {k: v for k, v in GOOD.items() if k != "name"}, GOOD | {"x": None}, [], None]
    for value in values:
        assert (not schema_errors(value, PERSON)) == jsonschema.Draft202012Validator(PERSON).is_valid(value), value


def test_an_output_must_be_one_json_value_that_follows_the_schema():
    text = json.dumps(GOOD)
    assert check_output(f"\n {text} \n", PERSON).valid
    assert check_output(text + " and more", PERSON).parsed is False  # nothing but the value
    assert check_output(text[:-1], PERSON).parsed is False  # cut off
    assert check_output(text.replace("2.5", "NaN"), PERSON).parsed is False  # not JSON
    checked = check_output(json.dumps(GOOD | {"role": "root"}), PERSON)
    assert (checked.parsed, checked.valid) == (True, False) and "role" in checked.error


def test_the_validator_refuses_schemas_outside_its_subset():
    with pytest.raises(ValueError, match=r"\$\.name: keyword 'pattern' is outside"):
        check_schema({"type": "object", "properties": {"name": {"type": "string", "pattern": "a+"}}})
    with pytest.raises(ValueError, match="required property 'b' is not among"):
        check_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]})
    with pytest.raises(ValueError, match="unknown type 'text'"):
        check_schema({"type": "text"})


def test_the_figures_give_each_method_its_valid_share_and_forced_share():
    def run(method, parsed, valid, forced, tokens):
        return Sample(method, 0, 0, 0, 0, [1] * tokens, 1.0, tokens, json_parsed=parsed, schema_valid=valid,
                      forced_tokens=forced)

    samples = [run("spec", True, True, 3, 10), run("spec", True, False, 1, 30), run("llama-server", False, False, None, 8),
               run("llama-server", True, True, None, 8), run("ar", None, None, 0, 5)]  # ar: no schema
    figures = method_figures(samples)
    assert figures == {
        "spec": {"schema_runs": 2, "json_parsed_fraction": 1.0, "schema_valid_fraction": 0.5, "forced_tokens": 4,
                 "forced_token_share": 0.1},
        "llama-server": {"schema_runs": 2, "json_parsed_fraction": 0.5, "schema_valid_fraction": 0.5,
                         "forced_tokens": None, "forced_token_share": None},
    }
    table = markdown(figures)
    assert "| spec | 2 | 100% | 50% | 10.0% (4) |" in table and "| llama-server | 2 | 50% | 50% | n/a |" in table
    assert markdown({}) == ""


def test_a_jsonl_prompt_may_carry_a_schema(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "Who?", "chat": True, "schema": PERSON, "schema_name": "person"}) + "\n"
                    + json.dumps({"prompt": "raw"}) + "\n")
    shaped, plain = load_jsonl(path)
    assert (shaped.schema, shaped.schema_name, shaped.chat) == (PERSON, "person", True)
    assert plain.schema is None and plain.to_dict() == {"set": "mine.jsonl", "id": "mine/2", "chat": False}
    path.write_text(json.dumps({"prompt": "Who?", "schema": "an object"}) + "\n")
    with pytest.raises(ValueError, match='line 1: "schema" must be a JSON schema object'):
        load_jsonl(path)


# ------------------------------------------------------------------------------------------------
# One bench run on the SmolLM2 GGUF: every extract prompt, through specdec serve (and llama-server)

PACK = "smollm2-135m"
SERVED = ("ar:backend=llamacpp:via=serve", "spec:ngram:block:k=4:policy=static:backend=llamacpp:via=serve")
NEW_TOKENS = 256  # room for every answer specdec's greedy runs give (a cut-off answer is invalid)


@pytest.fixture(scope="module")
def extract_run(tmp_path_factory):
    from specdec import packs
    from specdec.backends import llamacpp
    from specdec.bench.servers import ServerMissing, llama_server_binary

    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    try:
        llama_server_binary()
        peers = ("llama-server",)
    except ServerMissing:
        peers = ()
    import torch

    from specdec.cli.bench import main

    out = tmp_path_factory.mktemp("extract")
    before = torch.get_num_threads()
    argv = ["--target", PACK, "--draft", "none", "--backend", "llamacpp", "--methods",
            ",".join([*SERVED, "llamacpp-ar", *peers]), "--prompts", "extract", "--server-endpoint", "chat",
            "--eos", "stop", "--max-new-tokens", str(NEW_TOKENS), "--warmup-tokens", "4", "--threads", "1",
            "--no-progress", "--out", str(out)]
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(before)
    data = json.loads((out / "greedy" / "results.json").read_text())
    return {"data": data, "peers": peers, "markdown": (out / "greedy" / "results.md").read_text()}


@pytest.fixture(scope="module")
def tokenizer():
    from specdec.cli import common

    return common.load_models(PACK, None, backend="torch").tokenizer


def _samples(data: dict, method: str) -> list[dict]:
    return sorted((s for s in data["samples"] if s["method"] == method), key=lambda s: s["prompt"])


def test_every_specdec_output_follows_its_schema(extract_run, tokenizer):
    """The tokens of specdec's runs, library and served, spell a JSON value that follows the prompt's
    schema: the grammar held at every position (a run short of its token limit ended the value)."""
    data, prompts = extract_run["data"], load_prompts("extract")
    assert [p["schema"] for p in data["prompts"]] == [p.schema_name for p in prompts]
    for method in ("ar:backend=llamacpp", *SERVED):
        runs = _samples(data, method)
        assert [s["prompt"] for s in runs] == list(range(12)), method
        for s in runs:
            assert s["new_tokens"] < NEW_TOKENS, (method, s["prompt"])
            text = tokenizer.decode(s["token_ids"], skip_special_tokens=True, clean_up_tokenization_spaces=False)
            checked = check_output(text, prompts[s["prompt"]].schema)
            assert checked.valid, (method, s["prompt"], checked.error)


def test_served_greedy_runs_equal_ar_with_forced_drafts_counted(extract_run):
    methods = extract_run["data"]["methods"]
    for name in SERVED:  # exact under the grammar: the served runs' tokens are the library ar's
        assert methods[name]["ar"] == "ar:backend=llamacpp"
        assert methods[name]["identical_to_ar_fraction"] == 1.0, name
    spec, ar = methods[SERVED[1]], methods[SERVED[0]]
    assert ar["forced_tokens"] == 0 and ar["forced_token_share"] == 0.0  # ar drafts nothing, forced or not
    samples = _samples(extract_run["data"], SERVED[1])
    assert spec["forced_tokens"] == sum(s["forced_tokens"] for s in samples) > 0
    assert spec["forced_token_share"] == pytest.approx(spec["forced_tokens"] / sum(s["new_tokens"] for s in samples))
    for s in samples:  # forced tokens are accepted draft tokens
        assert 0 <= s["forced_tokens"] <= sum(s["step_accepted"])
    assert "Schema-constrained output" in extract_run["markdown"]


def test_a_library_peer_cannot_follow_a_schema(extract_run):
    assert "cannot constrain its output to a JSON schema" in extract_run["data"]["failed"]["llamacpp-ar"]


def test_llama_server_outputs_that_parse_follow_their_schemas(extract_run):
    """Its grammar holds too: every answer that parses follows its schema (the others ran into the
    token limit: SmolLM2-135M repeats itself inside the JSON until then), and most parse."""
    if not extract_run["peers"]:
        pytest.skip("llama-server is not built (benchmarks/build_llama_server.sh)")
    figures = extract_run["data"]["methods"]["llama-server"]
    assert figures["schema_runs"] == 12 and figures["forced_token_share"] is None  # it reports no forced tokens
    assert figures["schema_valid_fraction"] == figures["json_parsed_fraction"] >= 0.5


def test_the_text_specdec_serve_sends_parses_and_follows_its_schema(extract_run):
    figures = extract_run["data"]["methods"]
    for name in SERVED:
        assert figures[name]["json_parsed_fraction"] == figures[name]["schema_valid_fraction"] == 1.0, name
