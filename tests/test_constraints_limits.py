"""What a JSON grammar allows between tokens, and grammars llguidance cannot follow, refused up front.

- JSON whitespace: between two tokens of the JSON text a schema allows nothing, one space, or one
  line break and an indent of at most 20 spaces or tabs (llama.cpp's JSON grammars allow the
  same); blank lines and runs of spaces are refused, so a model cannot loop on them.
- A JSON schema whose every value would contain another without end (``{"$ref": "#"}``, two
  definitions that only refer to each other, a required property that is the object itself) is
  refused from its structure alone; recursive schemas with a case that ends pass.
- A grammar llguidance compiles may still exceed its limits at its first tokens (a Lark rule
  repeated a million times, a pattern whose lexer states explode) or allow nothing at all: the
  check with the model's tokenizer refuses these with a ConstraintError naming the field, and so
  does the processor; a limit reached later in a generation is a ConstraintError too, never a
  RuntimeError with the grammar's dump.
- The command line says so in one line, before generating; schemas with a base case, formats,
  big enums and the packaged extraction schemas pass.
"""

from __future__ import annotations

import json

import pytest

from specdec import ConstraintError, Constraints
from specdec.constraints import LogitProcessor, grammar_tokenizer
from helpers import tiny_tokenizer

EXPLODING_PATTERN = "^(a|aa)*(b|bb){1000}$"  # its lexer states explode once a "b" follows an "a"
HUGE_LARK = 'start: "a"{1000000}'
SELF = {"$ref": "#"}
MUTUAL = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
TREE = {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                             "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                           "required": ["value"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}


@pytest.fixture(scope="module")
def byte_tokenizer():
    """256 byte tokens: the grammar sees every text byte by byte."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def smollm_tokenizer():
    """A real BPE vocabulary (49152 tokens, many of several bytes): what the first steps of a
    grammar cost depends on the tokens, so the limits show with a real one."""
    from specdec import models, packs

    if packs.missing_parts(packs.PACKS["smollm2-135m"]):
        pytest.skip("pack smollm2-135m is not installed")
    return models.load_tokenizer("smollm2-135m")


def _matches_prefix(constraints: Constraints, tokenizer, text: str) -> bool:
    """Whether the grammar allows ``text`` as the start of an output (byte tokens: one per byte)."""
    from llguidance import LLMatcher

    matcher = LLMatcher(grammar_tokenizer(tokenizer, 259), constraints.grammar_text(), log_level=0)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return matcher.validate_tokens(ids) == len(ids)


# ------------------------------------------------------------------------------------------------
# Whitespace in JSON

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["id", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("text", [
    '{"id":1,"tags":["x"]}',
    '{"id": 1, "tags": ["x", "y"]}',
    '{ "id" : 1 , "tags" : [ ] }',
    '{\n  "id": 1,\n  "tags": [\n    "x"\n  ]\n}',
    '{\n\t"id": 1,\n\t"tags": []\n}',
    '{\n' + " " * 20 + '"id": 1',
])
def test_json_allows_the_layouts_json_is_written_in(byte_tokenizer, text):
    assert _matches_prefix(Constraints(json_schema=SCHEMA), byte_tokenizer, text)


@pytest.mark.parametrize("text", [
    '{\n\n  "id": 1',  # a blank line
    '{\n  "id": 1\n  \n  ,',  # the loop a model fell into: blank lines between items
    '{"id":  1',  # two spaces
    '{\n' + " " * 21 + '"id": 1',  # an indent over 20
    '{\r\n  "id": 1',  # a carriage return
    ' {"id": 1',  # whitespace before the value
])
def test_json_refuses_runs_of_whitespace(byte_tokenizer, text):
    assert not _matches_prefix(Constraints(json_schema=SCHEMA), byte_tokenizer, text)


def test_a_schemas_own_layout_overrides_the_default(byte_tokenizer):
    loose = {**SCHEMA, "x-guidance": {"whitespace_pattern": r"[\x20\x0A]{0,8}"}}
    assert _matches_prefix(Constraints(json_schema=loose), byte_tokenizer, '{\n\n  "id":  1')


# ------------------------------------------------------------------------------------------------
# Grammars beyond the engine's limits, and grammars no output completes

@pytest.mark.parametrize("schema", [
    SELF,
    json.dumps(MUTUAL),
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # required: never ends
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"allOf": [{"$ref": "#"}]},
    {"anyOf": [{"$ref": "#"}, {"$ref": "#/anyOf/0"}]},
])
def test_a_schema_with_no_finite_value_is_refused_without_the_model(schema):
    """Its structure shows it: the check needs no tokenizer, so the command line refuses it before
    loading a model."""
    with pytest.raises(ConstraintError) as err:
        Constraints(json_schema=schema).check(259)
    assert err.value.field == "json_schema" and "admits no finite JSON value" in str(err.value)


@pytest.mark.parametrize("schema", [
    TREE,  # children are optional
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
    {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # a linked list
    {"type": "array", "items": {"$ref": "#"}},  # nested arrays end with []
    {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "integer"}]}}, "$ref": "#/$defs/a"},
])
def test_recursive_schemas_with_a_case_that_ends_pass(byte_tokenizer, schema):
    Constraints(json_schema=schema).check(259, byte_tokenizer)


@pytest.mark.parametrize("constraints, field, words", [
    (Constraints(grammar="start: start \"a\""), "grammar", "matches no finite text"),
    (Constraints(grammar=HUGE_LARK), "grammar", "exceeds llguidance's limits"),
])
def test_the_check_with_a_tokenizer_refuses_grammars_the_engine_cannot_complete(byte_tokenizer, constraints, field,
                                                                              words):
    constraints.check(259)  # the vocabulary alone cannot tell: it compiles
    for run in (lambda: constraints.check(259, byte_tokenizer), lambda: constraints.processor(byte_tokenizer, 259, [])):
        with pytest.raises(ConstraintError) as err:
            run()
        assert err.value.field == field and words in str(err.value) and "\n" not in str(err.value), err.value


def test_a_grammar_that_allows_nothing_at_its_start_is_refused_whatever_its_structure(byte_tokenizer):
    """The engine's own verdict backs the structural one: a schema llguidance finds no token for,
    not even the end, is refused (here as if the structural check had passed it)."""
    from specdec.constraints import try_grammar

    with pytest.raises(ConstraintError, match="admits no finite JSON value"):
        try_grammar(Constraints(json_schema=SELF).grammar_text(), grammar_tokenizer(byte_tokenizer, 259), "json_schema",
                    schema=True)


@pytest.mark.parametrize("constraints, field, words", [
    (Constraints(regex=EXPLODING_PATTERN), "regex", "exceeds llguidance's limits at the first tokens (lexer error"),
    (Constraints(json_schema={"type": "object", "properties": {"p": {"type": "string", "pattern": EXPLODING_PATTERN}},
                              "required": ["p"]}), "json_schema", f"its pattern {EXPLODING_PATTERN!r} exceeds"),
    (Constraints(grammar=HUGE_LARK), "grammar", "Too many items"),
])
def test_patterns_whose_lexer_explodes_are_refused_with_a_real_vocabulary(smollm_tokenizer, constraints, field, words):
    with pytest.raises(ConstraintError) as err:
        constraints.check(len(smollm_tokenizer), smollm_tokenizer)
    assert err.value.field == field and words in str(err.value) and "\n" not in str(err.value), err.value


def _extract_schemas() -> list[dict]:
    from specdec.prompts import EXTRACT_FILE

    return [row["schema"] for row in json.loads(EXTRACT_FILE.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("constraints", [
    Constraints(json_schema=TREE),
    Constraints(json_schema={"type": "object"}),
    Constraints(json_schema={"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"}, "mail": {"type": "string", "format": "email"},
        "id": {"type": "string", "format": "uuid"}, "phone": {"type": "string", "pattern": r"^\+?[0-9 ()-]{7,20}$"},
        "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$"},
        "code": {"enum": [f"code-{i}" for i in range(2000)]}, "note": {"type": "string", "maxLength": 4000}},
        "required": ["when", "mail", "id", "phone", "iban", "code", "note"]}),
    Constraints(regex="[0-9]{1000}"),
    Constraints(grammar='start: "yes" | "no"'),
    *[Constraints(json_schema=schema) for schema in _extract_schemas()],
])
def test_grammars_the_engine_follows_pass_the_check(smollm_tokenizer, constraints):
    constraints.check(len(smollm_tokenizer), smollm_tokenizer)


def test_a_limit_reached_during_a_generation_is_a_constraint_error(smollm_tokenizer):
    """The processor's matcher built without the check's first steps: the lexer's limit is reached
    when the output goes on, and the error names the field in one line."""
    from llguidance import LLMatcher

    constraints = Constraints(regex=EXPLODING_PATTERN)
    vocabulary = grammar_tokenizer(smollm_tokenizer, len(smollm_tokenizer))
    matcher = LLMatcher(vocabulary, constraints.grammar_text(), log_level=0)
    processor = LogitProcessor(constraints, matcher, len(smollm_tokenizer), [], vocabulary=vocabulary)
    ids = smollm_tokenizer("a" + "b" * 40, add_special_tokens=False)["input_ids"]
    with pytest.raises(ConstraintError) as err:
        for token in ids:
            processor._allowed()
            processor.advance([token])
    assert err.value.field == "regex" and "exceeded llguidance's limits (lexer error" in str(err.value)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------
# The command line

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from helpers import make_model_dir

    return str(make_model_dir(tmp_path_factory.mktemp("limits") / "target", seed=0))


@pytest.mark.parametrize("schema, grammar, words", [
    (SELF, None, "--json-schema: admits no finite JSON value"),
    (MUTUAL, None, "--json-schema: admits no finite JSON value"),
    (None, HUGE_LARK, "--grammar: is too large for the grammar engine"),  # known once the tokenizer is
])
def test_the_command_line_refuses_them_in_one_line(model_dir, capsys, tmp_path, schema, grammar, words):
    from helpers import assert_one_line_error, run_main

    path = tmp_path / "shape"
    path.write_text(json.dumps(schema) if schema is not None else grammar)
    flag = "--json-schema" if schema is not None else "--grammar"
    code, out, err = run_main(["generate", "x", "--target", model_dir, "--draft", "none", flag, str(path),
                               "--max-new-tokens", "4"], capsys)
    assert code == 2 and out == ""
    assert_one_line_error("\n".join(err.strip().splitlines()[-2:]), contains=words)
