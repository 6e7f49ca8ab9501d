"""Drafting from a predicted output (OpenAI's Predicted Outputs): where the drafter stands in the
prediction, and answers that are plain decoding's, token for token, whatever the prediction."""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec.drafters.ngram import NGramDrafter
from specdec.drafters.prediction import MIN_SYNC, START_CONFIDENCE, PredictionDrafter
from specdec.sampling import SamplingConfig

from helpers import tiny_pair, tiny_tokenizer

PREDICTION = list(range(100, 140))  # 40 distinct ids: every n-gram occurs once
PROMPT = [1, 2, 3]
GREEDY = SamplingConfig()


def drafted(drafter: PredictionDrafter, output: list[int], k: int = 5) -> list[int]:
    return drafter.propose(PROMPT + output, k, GREEDY, None, source="prediction").tokens.tolist()


def test_the_place_follows_the_output_and_is_found_again_after_an_edit():
    drafter = PredictionDrafter(PREDICTION, 200)
    assert drafter.confidence(PROMPT) == START_CONFIDENCE
    assert drafted(drafter, []) == PREDICTION[:5]  # before any output: the prediction's start
    assert drafted(drafter, PREDICTION[:7]) == PREDICTION[7:12]  # followed: on from there
    inserted = PREDICTION[:10] + [7, 8]  # two tokens the prediction lacks: the place is lost
    assert drafter.place(PROMPT + inserted) is None and drafted(drafter, inserted) == []
    assert drafter.sources(PROMPT + inserted) == {"prediction": None}  # alone: a source that proposes nothing
    resumed = inserted + PREDICTION[10:10 + MIN_SYNC - 1]  # one token short of finding it again
    assert drafter.place(PROMPT + resumed) is None
    resumed = inserted + PREDICTION[10:10 + MIN_SYNC]
    assert drafted(drafter, resumed) == PREDICTION[10 + MIN_SYNC:15 + MIN_SYNC]
    deleted = resumed + PREDICTION[20:20 + MIN_SYNC]  # a span deleted: found again past it
    assert drafter.place(PROMPT + deleted) == 20 + MIN_SYNC
    replaced = deleted + [9, 9, 9] + PREDICTION[30:30 + MIN_SYNC]
    assert drafter.place(PROMPT + replaced) == 30 + MIN_SYNC
    assert drafter.place(PROMPT + PREDICTION) is None  # past the end: nothing left to draft


def test_after_an_edit_the_place_found_is_the_next_one_on_not_an_earlier_repeat():
    block = [50, 51, 52, 53]
    prediction = block + [60, 61] + block + [70, 71]  # the block occurs twice
    drafter = PredictionDrafter(prediction, 200)
    drafter.observe(PROMPT)  # the output starts past the context the drafter first sees
    output = block + [60, 61] + [9] + block  # an insertion before the second block
    assert drafter.place(PROMPT + output) == 10  # after the second block, where the text goes on
    assert drafted(drafter, output, 2) == [70, 71]


def test_confidence_grows_with_the_run_and_the_source_comes_first():
    drafter = PredictionDrafter(PREDICTION, 200, NGramDrafter(200))
    drafter.observe(PROMPT)
    low = drafter.confidence(PROMPT + PREDICTION[:10] + [5] + PREDICTION[11:14])
    drafter = PredictionDrafter(PREDICTION, 200, NGramDrafter(200))
    drafter.observe(PROMPT)
    high = drafter.confidence(PROMPT + PREDICTION[:30])
    assert 0 < low < high < 1
    sources = drafter.sources(PROMPT + PREDICTION[:30])
    assert next(iter(sources)) == "prediction" and set(drafter.costs()) == {"prediction", "ngram"}


def test_past_an_edit_the_place_carries_the_agreement_it_had():
    from specdec.drafters.ngram import lookup_confidence
    from specdec.drafters.prediction import START_RUN

    drafter = PredictionDrafter(PREDICTION, 200)
    drafter.observe(PROMPT)
    kept = PREDICTION[:20]  # followed for 20 tokens: the run is the client's word and those 20
    assert drafter.confidence(PROMPT + kept) == lookup_confidence(START_RUN + 20)
    edited = kept + [5, 6] + PREDICTION[20:20 + MIN_SYNC]  # two tokens inserted, then the text goes on
    assert drafter.confidence(PROMPT + edited) == lookup_confidence(START_RUN + 20)
    # found again behind where it was lost (the output repeats earlier text): only the match counts
    back = edited + PREDICTION[2:2 + MIN_SYNC]
    assert drafter.place(PROMPT + back) == 2 + MIN_SYNC
    assert drafter.confidence(PROMPT + back) == lookup_confidence(MIN_SYNC)


def test_a_place_found_again_that_fails_at_once_halves_what_it_carries():
    from specdec.drafters.ngram import lookup_confidence
    from specdec.drafters.prediction import START_RUN

    block = [50, 51, 52]
    prediction = list(range(100, 110)) + block + list(range(110, 130))
    drafter = PredictionDrafter(prediction, 200)
    drafter.observe(PROMPT)
    output = [7] + block  # the first token is not the prediction's; a match further on
    assert drafter.place(PROMPT + output) == 13
    assert drafter.confidence(PROMPT + output) == lookup_confidence(START_RUN)  # the start's word, carried
    output += [8] + block  # it failed at its first token; found again, with half the run
    assert drafter.confidence(PROMPT + output) == lookup_confidence(max(MIN_SYNC, START_RUN // 2))


def test_an_edit_the_output_made_is_drafted_at_its_next_occurrences():
    old, new = [50, 51], [60]  # a name of two tokens renamed to one
    prediction = list(range(100, 110)) + old + list(range(110, 120)) + old + list(range(120, 130)) + old + [130]
    drafter = PredictionDrafter(prediction, 200)
    drafter.observe(PROMPT)
    output = prediction[:10] + new + prediction[12:12 + MIN_SYNC]  # renamed here, then the text goes on
    assert drafted(drafter, output, 13) == list(range(113, 120)) + new + [120, 121, 122, 123, 124]
    later = output + list(range(113, 120)) + new + list(range(120, 130)) + new
    assert drafted(drafter, later, 5) == [130]  # followed through the rewritten text to its end
    # an edit made once: where the output keeps the old span after all, it is rewritten back
    kept = output + list(range(113, 120)) + old + list(range(120, 120 + MIN_SYNC))
    assert drafted(drafter, kept, 8) == list(range(120 + MIN_SYNC, 130)) + old[:1]
    # the output cut back to before the edit: the prediction as the client sent it
    assert drafted(drafter, prediction[:8], 4) == prediction[8:12]
    assert drafter.describe()["tokens"] == len(prediction)


def test_an_insertion_is_learnt_with_the_tokens_before_it():
    first, last, suffix = [70, 71], [72, 71], [80]  # first_int and last_int share their second token
    prediction = list(range(100, 110)) + first + list(range(110, 120)) + last + [120] + first + list(range(121, 130))
    drafter = PredictionDrafter(prediction, 200)
    drafter.observe(PROMPT)
    output = prediction[:12] + suffix + prediction[12:12 + MIN_SYNC]  # first_int -> first_int_value
    assert drafted(drafter, output, 14) == list(range(113, 120)) + last + [120] + first + suffix + [121]


def test_a_drafter_rebuilt_state_matches_one_that_followed_step_by_step():
    stepwise = PredictionDrafter(PREDICTION, 200)
    output = PREDICTION[:8] + [3, 4] + PREDICTION[8:20]
    for n in range(len(output) + 1):
        stepwise.observe(PROMPT + output[:n])
    fresh = PredictionDrafter(PREDICTION, 200)
    fresh.observe(PROMPT)
    assert stepwise.place(PROMPT + output) == fresh.place(PROMPT + output) == 20


@pytest.fixture(scope="module")
def pair():
    target, draft = tiny_pair()
    return target, draft, tiny_tokenizer()


SETTINGS = [dict(), dict(temperature=1.0, sampler="gumbel", seed=11)]


@pytest.mark.parametrize("setting", SETTINGS, ids=["greedy", "gumbel-seeded"])
@pytest.mark.parametrize("method", ["none", "ngram", "ngram+model"])
def test_answers_with_a_prediction_are_plain_decodings(pair, setting, method):
    target, draft, tokenizer = pair
    prompt = tokenizer("def add(a, b):")["input_ids"]
    plain = specdec.generate(target, prompt, drafter="none", max_new_tokens=40, **setting).token_ids
    other = list(reversed(plain))
    edited = plain[:12] + [65, 66, 67] + plain[15:]  # diverges in the middle, matches again after
    uses_draft = method == "ngram+model"
    for prediction in (plain, edited, other, plain[:5]):
        result = specdec.generate(target, prompt, draft=draft if uses_draft else None, drafter=method,
                                  max_new_tokens=40, prediction=prediction, **setting)
        assert result.token_ids == plain, (method, prediction)
    exact = specdec.generate(target, prompt, draft=draft if uses_draft else None, drafter=method,
                             max_new_tokens=40, prediction=plain, **setting)
    assert exact.stats.accepted_by.get("prediction", 0) > 0  # a prediction that matches is drafted from


def test_usage_counts_on_a_case_small_enough_to_count(pair):
    target, _, tokenizer = pair
    prompt = tokenizer("x = ")["input_ids"]
    plain = specdec.generate(target, prompt, drafter="none", max_new_tokens=12).token_ids
    # The whole answer predicted, drafted by the static policy 4 tokens a step (fewer where the
    # token limit leaves less room): every drafted token is kept, and the target adds one a step.
    wrong = [(t + 1) % 259 for t in plain]
    run = specdec.generate(target, prompt, drafter="ngram", max_new_tokens=12, prediction=plain,
                           policy="static", k=4)  # the static policy drafts from the first source offered
    assert run.token_ids == plain
    drafted, produced = 0, 0
    while produced < 12:
        k = min(4, 12 - produced - 1)
        drafted += k
        produced += k + 1
    assert run.stats.drafted_by == {"prediction": drafted}
    assert run.stats.accepted_by == {"prediction": drafted}
    miss = specdec.generate(target, prompt, drafter="ngram", max_new_tokens=12, prediction=wrong,
                            policy="static", k=4)
    assert miss.token_ids == plain
    # Each token of ``wrong`` differs from the output's there: the first draft (4 tokens at the
    # start) is rejected whole; after it the output never follows the prediction, so nothing more.
    assert miss.stats.drafted_by["prediction"] == 4 and miss.stats.accepted_by["prediction"] == 0


def test_a_bad_prediction_is_an_error_naming_it(pair):
    target, _, tokenizer = pair
    with pytest.raises(TypeError, match="prediction"):
        specdec.generate(target, [1, 2], drafter="none", max_new_tokens=2, prediction=3.5)
    with pytest.raises(ValueError, match="prediction token ids"):
        specdec.generate(target, [1, 2], drafter="none", max_new_tokens=2, prediction=[10_000])
    with pytest.raises(ValueError, match="tokenizer"):
        specdec.generate(target, [1, 2], drafter="none", max_new_tokens=2, prediction="text")
    with pytest.raises(ValueError, match="prediction drafts chains"):
        specdec.generate(target, [1, 2], draft=pair[1], verify="tree", max_new_tokens=2, prediction=[5])
    empty = specdec.generate(target, [1, 2], drafter="none", max_new_tokens=4, prediction="", tokenizer=tokenizer)
    assert empty.stats.drafted_by == {}  # an empty prediction is none
