"""Bad input to the Python API: a ValueError or TypeError that names the argument, before model work."""

from __future__ import annotations

import warnings

import pytest
import torch

from specdec import Constraints, DecodeConfig, generate, generate_many, stream
from specdec.api import _Run
from tiny import noisy_copy, tiny_llama

PROMPT = [1, 2, 3]


class LetterTokenizer:
    """Token i is the letter chr(97 + i); encodes text as a real tokenizer does (UTF-8 first)."""

    def __call__(self, text, add_special_tokens=True):
        text.encode("utf-8")  # as the Rust tokenizers do: a lone surrogate fails here
        return {"input_ids": [(ord(c) - 97) % 16 for c in text]}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return "".join(chr(97 + int(i)) for i in ids)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, vocab=16, sharpness=10.0)
    return target, noisy_copy(target, 0.3)


# -- the prompt -----------------------------------------------------------------------------------


def test_a_bytes_prompt_is_not_read_as_token_ids(pair):
    target, _ = pair
    with pytest.raises(TypeError, match="prompt .*bytes.*decode"):
        generate(target, b"\x01\x02\x03", max_new_tokens=2)


@pytest.mark.parametrize("prompt", [[1.0, 2.5, 3.0], [1, 2, 3.0], [1, True, 2], torch.tensor([1.0, 2.0])])
def test_token_ids_must_be_integers_not_truncated(pair, prompt):
    target, _ = pair
    with pytest.raises(TypeError, match="prompt"):
        generate(target, prompt, max_new_tokens=2)


def test_integer_tensors_and_numpy_ids_are_token_ids(pair):
    import numpy as np

    target, _ = pair
    want = generate(target, PROMPT, max_new_tokens=4).token_ids
    assert generate(target, torch.tensor(PROMPT), max_new_tokens=4).token_ids == want
    assert generate(target, np.array(PROMPT), max_new_tokens=4).token_ids == want


def test_a_lone_surrogate_in_the_prompt_is_a_clear_value_error(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="not valid text.*surrogate"):
        generate(target, "abc\udcff", tokenizer=LetterTokenizer(), max_new_tokens=2)


# -- stop strings -------------------------------------------------------------------------------


def test_a_plain_string_stop_is_one_stop_string_not_its_letters(pair):
    target, _ = pair
    tok = LetterTokenizer()
    full = generate(target, PROMPT, tokenizer=tok, max_new_tokens=12).text
    assert len(full) == 12
    # Each letter of the stop string but the last occurs in the text; the whole string does not.
    stop = full[0] + "z"
    assert generate(target, PROMPT, tokenizer=tok, max_new_tokens=12, stop=stop).text == full
    cut = full[3:5]
    assert generate(target, PROMPT, tokenizer=tok, max_new_tokens=12, stop=cut).text == full[: full.find(cut)]


@pytest.mark.parametrize("stop", [[""], ["ab", ""], ""])
def test_an_empty_stop_string_is_rejected(pair, stop):
    target, _ = pair
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        generate(target, PROMPT, tokenizer=LetterTokenizer(), max_new_tokens=4, stop=stop)


@pytest.mark.parametrize("stop", [[1, 2], b"ab", 3])
def test_stop_strings_must_be_strings(pair, stop):
    target, _ = pair
    with pytest.raises(TypeError, match="stop"):
        generate(target, PROMPT, tokenizer=LetterTokenizer(), max_new_tokens=4, stop=stop)


# -- models and tokenizer -------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["smollm2-135m", None, 3])
def test_a_target_that_is_not_a_loaded_model(target):
    with pytest.raises(TypeError, match="target must be a loaded model.*specdec.models.load"):
        generate(target, PROMPT, max_new_tokens=2)


def test_a_draft_given_by_name(pair):
    target, _ = pair
    with pytest.raises(TypeError, match="draft must be a loaded model.*specdec.models.load\\('smollm2-135m'\\)"):
        generate(target, PROMPT, draft="smollm2-135m", max_new_tokens=2)


@pytest.mark.parametrize("tokenizer", ["x", 5])
def test_a_tokenizer_that_is_not_one(pair, tokenizer):
    target, _ = pair
    with pytest.raises(TypeError, match="tokenizer"):
        generate(target, PROMPT, tokenizer=tokenizer, max_new_tokens=2)


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(seed=1.5), TypeError, "seed must be an integer"),
        (dict(seed=2**70), ValueError, "seed must be in"),
        (dict(seed=-1), ValueError, "seed must be in"),
        (dict(temperature="1"), TypeError, "temperature must be a number"),
        (dict(temperature=float("inf")), ValueError, "temperature must be a finite"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(top_p="0.9"), TypeError, "top_p must be a number"),
        (dict(top_k=2.5), TypeError, "top_k must be an integer"),
        (dict(max_new_tokens=True), TypeError, "max_new_tokens"),
        (dict(eos_token_ids="2"), TypeError, "eos_token_ids"),
        (dict(verify="bogus"), ValueError, "unknown verifier 'bogus'"),
        (dict(policy="bogus"), ValueError, "unknown draft-length policy"),
        (dict(drafter="bogus"), ValueError, "unknown drafter"),
        (dict(draft_weights="fp4"), ValueError, "draft_weights"),
        (dict(tree={"widht": 2}), ValueError, "unknown tree option 'widht'"),
        (dict(temprature=1.0), TypeError, "unknown decoding option 'temprature'"),
    ],
)
def test_bad_options_without_a_draft_name_the_argument(pair, kwargs, error, message):
    target, _ = pair
    with pytest.raises(error, match=message):
        generate(target, PROMPT, max_new_tokens=2, **kwargs)


def test_bad_options_fail_before_any_model_work(pair, monkeypatch):
    target, draft = pair
    monkeypatch.setattr(target, "forward", lambda *a, **k: pytest.fail("the target ran"))
    with pytest.raises(ValueError):
        stream(target, PROMPT, draft=draft, seed=2**70)


# -- limits and timing ----------------------------------------------------------------------------


def test_a_prompt_that_leaves_less_room_than_asked_is_allowed_and_said(pair):
    target = tiny_llama(0, vocab=16, context=32)
    with pytest.warns(UserWarning, match="at most 8 new tokens fit, not max_new_tokens=100"):
        result = generate(target, PROMPT * 8, draft=target, k=4, policy="static", max_new_tokens=100,
                          eos_token_ids=[])
    assert len(result.token_ids) == 8 and result.stats.truncated_to == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full = generate(target, PROMPT * 8, max_new_tokens=8, eos_token_ids=[])
    assert full.stats.truncated_to is None and len(full.token_ids) == 8


def test_backends_are_built_before_the_timed_generation(pair, monkeypatch):
    """One-time costs (a draft's int8 weights) are paid when the run is built, not in its seconds."""
    from specdec import api
    from specdec import build as builder

    target, draft = pair
    built = []
    real = builder.make_backend
    monkeypatch.setattr(builder, "make_backend", lambda model, **kw: built.append(model) or real(model, **kw))
    run = _Run.build(target, PROMPT, draft=draft, tokenizer=None, config=api._config(None, {"max_new_tokens": 4}))
    assert built == [draft, target]  # the draft's backend (its weights converted) and the target's
    for _ in run.events():
        pass
    assert built == [draft, target]  # nothing built inside the timed loop


def test_a_tokenizer_of_another_vocabulary_is_refused_naming_both_sizes():
    """The byte-level test tokenizer has 259 tokens: a model of 5000 (or of 200) ids is another
    model's, and its ids would be read as other tokens; one padded a little past it is its own."""
    from helpers import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    for vocab in (5000, 200):
        with pytest.raises(ValueError, match=f"the tokenizer has 259 tokens but the model's vocabulary has {vocab}"):
            generate(tiny_llama(2, vocab=vocab), "hello", tokenizer=tokenizer, max_new_tokens=2)
    padded = generate(tiny_llama(2, vocab=320), "hello", tokenizer=tokenizer, max_new_tokens=2, eos_token_ids=[])
    assert len(padded.token_ids) == 2


# -- generate_many's arguments ---------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prompts="abc"), TypeError, "prompts must be a list of prompts .*got the str .abc.; pass \\[prompt\\]"),
    (dict(prompts=b"abc"), TypeError, "prompts must be a list"),
    (dict(prompts=[1, 2, 3]), TypeError, "prompts must be a list of prompts, got a list of 3 integers.*\\[ids\\]"),
    (dict(prompts=[PROMPT], configs=DecodeConfig()), TypeError, "configs must be a list .*got DecodeConfig"),
    (dict(prompts=[PROMPT], constraints=Constraints()), TypeError, "constraints must be a list .*got Constraints"),
    (dict(prompts=[PROMPT], configs=["ar"]), TypeError, "configs\\[0\\] must be a specdec.DecodeConfig, got str"),
    (dict(prompts=[PROMPT, PROMPT], configs=[None]), ValueError, "configs needs one entry per prompt \\(2\\), got 1"),
])
def test_generate_many_names_the_argument_of_the_wrong_kind(pair, kwargs, error, message, monkeypatch):
    from specdec import api

    target, _ = pair
    monkeypatch.setattr(api, "generate", lambda *a, **kw: pytest.fail("decoded a prompt of bad input"))
    with pytest.raises(error, match=message):
        generate_many(target, **kwargs, max_new_tokens=2)


def test_generate_many_gives_the_draft_to_the_prompts_that_draft_with_it_on_every_backend(pair):
    """On a transformers pair (the prompts in turn) as on the GGUF kernel (tests/test_engine_serving.py):
    a method that drafts with no draft model (plain decoding, the n-gram lookup) runs beside one that
    does, each prompt's answer the one generate gives it with the draft it uses."""
    target, draft = pair
    configs = [DecodeConfig.parse(m).replace(temperature=0, max_new_tokens=6, eos_token_ids=[])
               for m in ("ar", "spec:ngram:block", "spec")]
    many = generate_many(target, [PROMPT] * 3, draft=draft, configs=configs)
    alone = [generate(target, PROMPT, config=configs[0]), generate(target, PROMPT, config=configs[1]),
             generate(target, PROMPT, draft=draft, config=configs[2])]
    assert [r.token_ids for r in many] == [r.token_ids for r in alone]
    assert [r.method for r in many] == [r.method for r in alone]
