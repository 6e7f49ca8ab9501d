"""Constraints (a grammar, logit_bias, penalties) and log-probabilities, exact under speculation.

- Exact enumeration: with a grammar-masked, biased and penalised target, the output law of token
  and block verification equals the processed, renormalised target law (the mask computed here
  from the regular language itself, not by llguidance) to 1e-9, with drafts that propose forbidden
  tokens; cutting a sampled forbidden draft token instead gives another law (the negative control).
- By equality, on a tiny torch model with a character-level tokenizer and on the SmolLM2 GGUF:
  greedy and Gumbel-seeded output under a JSON schema, a regex, penalties and logit_bias equals
  plain decoding's under the same constraints for the default method, chains (block, token),
  the n-gram lookup and trees, with the same log-probabilities; every output validates.
- Tokens the grammar forces are drafted, counted and accepted; bad values raise ConstraintError
  naming the field.
"""

from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest
import torch

from specdec import ConstraintError, Constraints, generate
from specdec.drafters.base import Draft
from specdec.policies.auto import AutoPolicy
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.token_tree import TokenTree
from specdec.verify import make_verifier
from helpers import THREADS, CHEAP_ROWS, dirichlet, outcomes, point_mass
from tiny import noisy_copy, tiny_llama


def char_tokenizer(pieces, merges=()):
    """A fast Hugging Face tokenizer over single characters (and ``merges``, pairs of pieces that
    BPE joins), id 0 the end of sequence; byte-level, as llguidance reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"</s>": 0}
    for piece in list(pieces) + ["".join(m) for m in merges]:
        vocab.setdefault(piece.replace(" ", "\u0120"), len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


# ------------------------------------------------------------------------------------------------
# Exact enumeration: the processed target law, whatever the drafts

# Four tokens: the end (0) and a, b, c. The language: five letters, the second depending on the
# first, the third forced (drafted at no cost), the fifth depending on the fourth, so the mask
# depends on the context; the end is never allowed within the horizon (the grammar is not complete
# before the fifth letter), so drafts that propose it propose a forbidden token.
LETTERS = "abc"
LANGUAGE = "(a[bc]|b[ab]|c[ac])c(ab|ba)"
HORIZON = 4
BIAS = {1: 0.7, 3: -0.4}
FREQUENCY, PRESENCE = 0.3, 0.2


def _words() -> list[str]:
    return ["".join(w) for w in itertools.product(LETTERS, repeat=5) if re.fullmatch(LANGUAGE, "".join(w))]


def reference_law(p, horizon: int) -> dict[tuple[int, ...], float]:
    """The processed target law of the first ``horizon`` tokens, computed from the language's words:
    log p + bias - penalties, -inf where no word continues the prefix, renormalised."""
    words = _words()
    law = {}
    for seq in itertools.product(range(4), repeat=horizon):
        prob = 1.0
        for t in range(horizon):
            prob *= _processed(np.log(p(seq[:t])), seq[:t], words)[seq[t]]
            if prob == 0:
                break
        if prob > 0:
            law[seq] = prob
    return law


def _processed(logp: np.ndarray, prefix: tuple[int, ...], words: list[str]) -> np.ndarray:
    logits = logp.copy()
    for token, bias in BIAS.items():
        logits[token] += bias
    for token in set(prefix):
        logits[token] -= FREQUENCY * prefix.count(token) + PRESENCE
    text = "".join(LETTERS[t - 1] for t in prefix)
    for token in range(4):
        if token == 0 or not any(w.startswith(text + LETTERS[token - 1]) for w in words):
            logits[token] = -np.inf
    out = np.exp(logits - logits.max())
    return out / out.sum()


@pytest.fixture(scope="module")
def letters():
    return char_tokenizer(LETTERS)


def speculative_law(verifier_name, p, q, k, tokenizer, naive_cut=False) -> dict[tuple[int, ...], float]:
    """The exact law of the first HORIZON tokens of the engine's step under the constraints: forced
    tokens first, then drafts from q, screened, every row processed with its prefix, verified.
    ``naive_cut``: cut every forbidden draft token (the wrong rule under sampling)."""
    constraints = Constraints(regex=LANGUAGE, logit_bias=BIAS, frequency_penalty=FREQUENCY, presence_penalty=PRESENCE)
    verifier = make_verifier(verifier_name)
    sampling = SamplingConfig(temperature=1.0)
    mass: dict[tuple[int, ...], float] = {(): 1.0}
    cut_seen = kept_forbidden = forced_seen = 0
    for length in range(HORIZON):
        for seq in [s for s in mass if len(s) == length]:
            weight = mass.pop(seq)
            proc = constraints.processor(tokenizer, 4, [1])
            proc.advance(list(seq))
            room = HORIZON - length - 1
            forced = proc.forced(room)
            forced_seen += len(forced)
            k_step = min(k, room - len(forced))
            for drafted in itertools.product(range(4), repeat=k_step):
                start = seq + tuple(forced)
                q_rows = [q(start + drafted[:i]) for i in range(k_step)]
                prob = float(np.prod([q_rows[i][drafted[i]] for i in range(k_step)]))
                if prob == 0.0:
                    continue
                one_hot = np.eye(4)[list(forced)].reshape(len(forced), 4)
                draft = Draft(torch.tensor(forced + list(drafted), dtype=torch.long),
                              torch.tensor(np.concatenate([one_hot, np.array(q_rows).reshape(k_step, 4)])))
                screened = proc.screen(draft, sampling)
                if naive_cut:
                    allowed = proc.matcher.validate_tokens(draft.tokens.tolist())
                    screened = Draft(draft.tokens[:allowed], draft.q[:allowed])
                cut_seen += len(screened) < len(draft)
                kept_forbidden += proc.matcher.validate_tokens(screened.tokens.tolist()) < len(screened)
                tokens = tuple(screened.tokens.tolist())
                logits = torch.tensor(np.log(np.array([p(seq + tokens[:i]) for i in range(len(tokens) + 1)])))
                probs = logits_to_probs(proc.apply(logits, [1, *seq], screened), sampling)
                plan = verifier.plan(screened.tokens, screened.q, probs)
                for n, y, py in outcomes(plan):
                    out = (seq + tokens[:n] + (y,))[:HORIZON]
                    mass[out] = mass.get(out, 0.0) + weight * prob * py
    assert cut_seen + kept_forbidden > 0 and forced_seen > 0  # forbidden tokens were drafted, forced ones too
    return mass


TARGET = dirichlet("p-masked", 4)
DRAFTS = {"random": dirichlet("q-masked", 4), "with-zeros": dirichlet("q-masked", 4, zeros=2),
          "point-mass": point_mass("q-masked", 4)}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("draft", sorted(DRAFTS))
@pytest.mark.parametrize("verifier", ["token", "block"])
def test_a_masked_target_law_is_kept_exactly_with_forbidden_drafts(letters, verifier, draft, k):
    expected = reference_law(TARGET, HORIZON)
    got = speculative_law(verifier, TARGET, DRAFTS[draft], k, letters)
    worst = max(abs(expected.get(s, 0.0) - got.get(s, 0.0)) for s in set(expected) | set(got))
    assert worst <= 1e-9, f"laws differ by {worst:.3e}"
    assert abs(sum(got.values()) - 1.0) <= 1e-9


@pytest.mark.parametrize("verifier", ["token", "block"])
def test_cutting_a_sampled_forbidden_draft_token_changes_the_law(letters, verifier):
    """The negative control: the enumeration above detects the wrong cut."""
    expected = reference_law(TARGET, HORIZON)
    got = speculative_law(verifier, TARGET, DRAFTS["random"], 2, letters, naive_cut=True)
    assert max(abs(expected.get(s, 0.0) - got.get(s, 0.0)) for s in set(expected) | set(got)) > 1e-3


def test_screening_keeps_a_sampled_forbidden_token_and_cuts_everything_after_it(letters):
    proc = Constraints(regex=LANGUAGE).processor(letters, 4, [1])
    tokens = torch.tensor([1, 1, 2])  # "a" then "a" (forbidden after "a") then "b"
    spread = torch.full((3, 4), 0.25)
    sampled = SamplingConfig(temperature=1.0)
    assert proc.screen(Draft(tokens, spread), sampled).tokens.tolist() == [1, 1]
    assert proc.screen(Draft(tokens, torch.eye(4)[tokens]), sampled).tokens.tolist() == [1]  # point masses
    assert proc.screen(Draft(tokens, spread), SamplingConfig()).tokens.tolist() == [1]  # greedy
    assert proc.screen(Draft(tokens, spread), SamplingConfig(temperature=1.0, gumbel_seed=3)).tokens.tolist() == [1]
    tree = TokenTree([1, 1, 2, 3], [-1, 0, 0, 1], torch.full((5, 4), 0.25))  # a -> {a -> c, b}
    kept = proc.screen(tree, sampled)
    assert (kept.tokens, kept.parents) == ([1, 1, 2], [-1, 0, 0]) and kept.q.shape == (4, 4)
    cut = proc.screen(TokenTree([1, 1, 2, 3], [-1, 0, 0, 1]), sampled)  # deterministic children
    assert (cut.tokens, cut.parents) == ([1, 2], [-1, 0])


# ------------------------------------------------------------------------------------------------
# Equality with plain decoding on a tiny torch model

JSON_PIECES = '{}[]":,-.0123456789abcdefghijklmnopqrstuvwxyz '
JSON_MERGES = [("{", '"'), ('"', ":"), ('"', ","), (",", '"'), ("t", "r"), ("tr", "u"), ("tru", "e")]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}, "tag": {"enum": ["red", "blue"]}},
          "required": ["name", "n", "ok", "tag"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}  # compact: no whitespace
REGEX = "[a-f]{2,5}(,[0-9]{1,2}){2}"


@pytest.fixture(scope="module")
def json_tokenizer():
    return char_tokenizer(JSON_PIECES, JSON_MERGES)


@pytest.fixture(scope="module")
def pair(json_tokenizer):
    target = tiny_llama(5, vocab=len(json_tokenizer), sharpness=3.0)
    return target, noisy_copy(target, 0.3)


def _methods(draft):
    return {"default": dict(draft=draft), "spec:model:block": dict(draft=draft, drafter="model", verify="block", k=4, policy="static"),
            "spec:model:token": dict(draft=draft, drafter="model", verify="token", k=3, policy="static"),
            "spec:ngram": dict(drafter="ngram", k=4, policy="static"), "spec:model:tree": dict(draft=draft, verify="tree")}


CONSTRAINTS = {
    "schema": Constraints(json_schema=SCHEMA),
    "regex": Constraints(regex=REGEX, presence_penalty=0.5),
    "penalties": Constraints(logit_bias={5: 3.0, 7: -100}, frequency_penalty=0.8, presence_penalty=-0.4,
                             repeat_penalty=1.3, repeat_last_n=8),
}
SETTINGS = {"greedy": dict(), "gumbel": dict(temperature=1.0, top_p=0.95, sampler="gumbel", seed=7)}


def assert_same_logprobs(got, expected, *, exact: bool) -> None:
    """The same tokens with the same log-probabilities: bit-equal where the backend's passes are
    batch invariant (``exact``); else (transformers' fp32 kernels on a tiny model, whose k-row pass
    rounds differently from a one-row pass) equal to float32 rounding of the logits, and the same
    top tokens."""
    if exact:
        assert got == expected
        return
    assert [lp.token for lp in got] == [lp.token for lp in expected]
    for a, b in zip(got, expected):
        assert abs(a.logprob - b.logprob) <= 1e-5 * max(1.0, abs(b.logprob)), (a, b)
        assert len(a.top) == len(b.top)
        assert all(abs(x[1] - y[1]) <= 1e-5 * max(1.0, abs(y[1])) for x, y in zip(a.top, b.top)), (a, b)


def _valid(name: str, text: str) -> None:
    if name == "schema":
        value = json.loads(text)
        try:
            import jsonschema
        except ImportError:
            assert set(value) == set(SCHEMA["required"]) and isinstance(value["ok"], bool)
        else:
            jsonschema.validate(value, SCHEMA)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_every_method_gives_plain_decodings_tokens_and_logprobs_under_constraints(pair, json_tokenizer, name, setting):
    target, draft = pair
    common = dict(tokenizer=json_tokenizer, max_new_tokens=60, constraints=CONSTRAINTS[name], logprobs=3,
                  **SETTINGS[setting])
    prompt = '{"name":"ab","n":1,"ok":true,"tag":"red"}\n{"name":"ab","n":'
    expected = generate(target, prompt, **common)
    assert expected.method == "ar" and len(expected.logprobs) == len(expected.token_ids)
    _valid(name, expected.text)
    unconstrained = generate(target, prompt, **{**common, "constraints": None})
    assert unconstrained.token_ids != expected.token_ids  # the constraints change the output
    accepted = 0
    for method, kwargs in _methods(draft).items():
        result = generate(target, prompt, **kwargs, **common)
        assert result.token_ids == expected.token_ids, method
        assert_same_logprobs(result.logprobs, expected.logprobs, exact=False)
        accepted += result.stats.accepted_tokens
    assert accepted > 0
    for lp in expected.logprobs:
        assert lp.logprob <= 0 and len(lp.top) <= 3 and lp.top[0][1] >= lp.logprob
        assert all(math.isfinite(v) for _, v in lp.top)


def test_a_bias_and_penalties_change_greedy_output_as_the_processed_law_says(pair, json_tokenizer):
    """logit_bias of +100 on a token makes greedy decoding, speculative too, repeat it; logprobs=0
    reports the chosen tokens' log-probabilities and no top tokens."""
    target, draft = pair
    out = generate(target, [3, 4, 5], max_new_tokens=8, constraints=Constraints(logit_bias={9: 100}), draft=draft)
    assert out.token_ids == [9] * 8
    logprobs = generate(target, [3, 4, 5], max_new_tokens=3, logprobs=0).logprobs
    assert [lp.top for lp in logprobs] == [(), (), ()] and all(lp.logprob <= 0 for lp in logprobs)


def test_forced_tokens_are_drafted_counted_and_accepted(pair, json_tokenizer):
    target, draft = pair
    constraints = Constraints(regex="answer is (yes|no), final")
    common = dict(tokenizer=json_tokenizer, max_new_tokens=40, constraints=constraints)
    ar = generate(target, "q:", **common)
    assert ar.text in ("answer is yes, final", "answer is no, final") and ar.stats.forced_tokens == 0
    for kwargs in (dict(draft=draft, drafter="model", k=2, policy="static"), dict(drafter="ngram", k=1, policy="static"),
                   dict(draft=draft, verify="tree")):
        result = generate(target, "q:", **kwargs, **common)
        assert result.token_ids == ar.token_ids
        assert result.stats.forced_tokens >= len("answer is ") + len(", final") - 1
        assert result.stats.target_forwards <= 3


# ------------------------------------------------------------------------------------------------
# Bad values

@pytest.mark.parametrize("field,kwargs", [
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=float("nan"))),
    ("repeat_penalty", dict(repeat_penalty=0.0)),
    ("repeat_last_n", dict(repeat_last_n=-2)),
    ("logit_bias", dict(logit_bias={100000: 1.0})),
    ("logit_bias", dict(logit_bias={3: 101.0})),
    ("logit_bias", dict(logit_bias={"three": 1.0})),
    ("json_schema", dict(json_schema="{not json")),
    ("json_schema", dict(json_schema={"type": "no-such-type"})),
    ("json_schema", dict(json_schema=[1, 2])),
    ("regex", dict(regex="[a-")),
    ("grammar", dict(grammar="start: undefined_rule")),
    ("regex", dict(json_schema={"type": "object"}, regex="a")),
])
def test_bad_values_raise_a_constraint_error_naming_the_field(field, kwargs):
    with pytest.raises(ConstraintError) as err:
        Constraints(**kwargs).check(1000)
    assert err.value.field == field and field in str(err.value)
    assert isinstance(err.value, ValueError)


def test_the_api_checks_constraints_and_logprobs(pair, json_tokenizer):
    target, _ = pair
    with pytest.raises(ConstraintError, match="logprobs"):
        generate(target, [1, 2], max_new_tokens=2, logprobs=21)
    with pytest.raises(ConstraintError, match="logit_bias"):
        generate(target, [1, 2], max_new_tokens=2, constraints=Constraints(logit_bias={len(json_tokenizer): 1}))
    with pytest.raises(ConstraintError, match="tokenizer"):
        generate(target, [1, 2], max_new_tokens=2, constraints=Constraints(regex="a+"))
    assert Constraints(logit_bias={"5": 2}).bias(10) == {5: 2.0}  # JSON's string keys
    assert not Constraints().active and not Constraints(logit_bias={3: 0}).active
    assert Constraints(regex="a").active and Constraints(repeat_penalty=1.1).active
    assert not Constraints(repeat_penalty=1.1, repeat_last_n=0).active


# ------------------------------------------------------------------------------------------------
# The SmolLM2 GGUF on llama.cpp

GGUF_SCHEMA = {"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                              "city": {"type": "string", "maxLength": 16}},
               "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smollm():
    from specdec import models, packs
    from specdec.backends import llamacpp

    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    pack = packs.PACKS["smollm2-135m"]
    if packs.missing_parts(pack):
        pytest.skip("pack smollm2-135m is not installed")
    gguf = packs.gguf_file("smollm2-135m", progress=False)
    model = llamacpp.load_gguf(gguf, n_threads=THREADS, n_ctx=512, prefill_layout="repacked")
    return model, models.load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_smollm_gguf_methods_give_plain_decodings_json_and_logprobs(smollm, setting):
    model, tokenizer = smollm
    draft = model.fork()
    constraints = Constraints(json_schema=GGUF_SCHEMA, frequency_penalty=0.2, logit_bias={28: -1.5})
    common = dict(tokenizer=tokenizer, max_new_tokens=40, constraints=constraints, logprobs=2, **SETTINGS[setting])
    prompt = "A JSON record of the person: Alice is 30 and lives in Paris.\n"
    expected = generate(model, prompt, **common)
    value = json.loads(expected.text)
    assert set(value) == {"name", "age", "city"} and isinstance(value["age"], int)
    forced = 0
    methods = {**_methods(draft), "default": dict(draft=draft, policy=AutoPolicy(costs=CHEAP_ROWS))}  # costs not measured
    for method in ("default", "spec:model:block", "spec:ngram", "spec:model:tree"):
        result = generate(model, prompt, **methods[method], **common)
        assert result.token_ids == expected.token_ids, method
        # llama.cpp's passes are batch invariant here (test_llamacpp.py: an n-token pass equals
        # one-token steps), so the log-probabilities are bit-equal.
        assert_same_logprobs(result.logprobs, expected.logprobs, exact=True)
        forced += result.stats.forced_tokens
    assert forced > 0


# ------------------------------------------------------------------------------------------------
# The command line

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from helpers import make_model_dir

    root = tmp_path_factory.mktemp("constrained")
    return str(make_model_dir(root / "target", seed=0)), str(make_model_dir(root / "draft", seed=1))


@pytest.mark.parametrize("args,contains", [
    (["--logit-bias", "7"], "--logit-bias '7' is not ID=BIAS"),
    (["--logit-bias", "7=500"], "--logit-bias: the bias of token 7"),
    (["--presence-penalty", "3"], "--presence-penalty: must be a number in [-2, 2]"),
    (["--repeat-last-n", "-5"], "--repeat-last-n: must be an integer >= -1"),
    (["--regex", "[a-"], "--regex: does not compile"),
    (["--logprobs", "21"], "--logprobs: must be None or an integer in [0, 20]"),
    (["--json-schema", "/no/such/schema.json"], "--json-schema /no/such/schema.json: cannot read it"),
])
def test_bad_constraint_options_are_one_line_errors_before_any_model_loads(args, contains, capsys, tmp_path):
    from helpers import assert_one_line_error, run_main

    code, _, err = run_main(["generate", "x", "--target", "absent", "--cache-dir", str(tmp_path), *args], capsys)
    assert code == 2
    assert_one_line_error(err, contains=contains)


def test_the_command_line_constrains_and_reports_logprobs(model_dir, capsys, tmp_path):
    from helpers import assert_one_line_error, run_main

    target, draft = model_dir
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False,
                                  "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}))
    code, out, _ = run_main(["generate", "x", "--target", target, "--draft", draft, "--json-schema", str(schema),
                             "--logprobs", "2", "--json", "--compare-ar", "--max-new-tokens", "20"], capsys)
    report = json.loads(out)
    assert code == 0 and json.loads(report["text"]) in ({"ok": True}, {"ok": False})
    assert report["ar"]["identical"] and len(report["logprobs"]) == len(report["token_ids"])
    code, out, _ = run_main(["generate", "x", "--target", target, "--draft", "none", "--logit-bias", "65=100",
                             "--frequency-penalty", "0.5", "--json", "--max-new-tokens", "5"], capsys)
    assert code == 0 and json.loads(out)["token_ids"] == [65] * 5
    code, _, err = run_main(["generate", "x", "--target", target, "--draft", "none", "--logit-bias", "999=1"], capsys)
    assert code == 2  # known once the model is loaded: after its notes, one line and a hint
    assert_one_line_error("\n".join(err.strip().splitlines()[-2:]), contains="--logit-bias: key 999 is not a token id")
