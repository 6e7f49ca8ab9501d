"""The text :func:`specdec.stream` yields: never taken back, adding up to the final text, and each
event's ``draft_chars`` counting the characters that kept draft tokens wrote.

A stop string may complete across steps; text that could still begin one is held back until the
next tokens tell, and released at the end where none completes. The server passes the library's
text on, so its streamed and non-streamed answers agree.
"""

from __future__ import annotations

import itertools

import httpx
import pytest

from specdec import generate, stream
from helpers import serve, sse_events, tiny_pair, tiny_tokenizer
from tiny import noisy_copy, tiny_llama

PROMPT = [1, 2, 3]
PIECES = [chr(97 + i) * (1 + i % 3) for i in range(16)]  # a, bb, ccc, d, ee, fff, ...


class PieceTokenizer:
    """Token i decodes to PIECES[i]: one to three characters, so characters and tokens differ."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [(ord(c) - 97) % 16 for c in text]}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return "".join(PIECES[int(i)] for i in ids)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, vocab=16, sharpness=10.0)
    return target, noisy_copy(target, 0.3)


def run(target, draft, **options):
    """(the events of stream, the text generate gives) with the same settings."""
    settings = dict(draft=draft, tokenizer=PieceTokenizer(), k=3, policy="static", max_new_tokens=40, **options)
    return list(stream(target, PROMPT, **settings)), generate(target, PROMPT, **settings).text


def check_never_taken_back(events, final: str) -> None:
    shown = ""
    for event in events:
        shown += event.text
        assert final.startswith(shown)  # nothing shown is ever cut from the final text
    assert shown == final


def spanning_stop(events) -> tuple[str, int]:
    """A stop string whose first occurrence begins in one step's text and ends in the next's."""
    text = "".join(e.text for e in events)
    for end in itertools.accumulate(len(e.text) for e in events[:-1]):
        for before, after in ((2, 2), (1, 2), (2, 1), (1, 1)):
            stop = text[end - before : end + after]
            if end >= before and len(stop) == before + after and text.find(stop) == end - before:
                return stop, end - before
    raise AssertionError("no step boundary makes a stop string here")


SETTINGS = [dict(temperature=0)] + [dict(temperature=1.0, seed=seed) for seed in range(4)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: f"T={s['temperature']},seed={s.get('seed')}")
def test_a_stop_string_across_two_steps_is_never_shown(pair, sampling):
    free_events, free = run(*pair, **sampling)
    check_never_taken_back(free_events, free)
    stop, at = spanning_stop(free_events)
    events, final = run(*pair, stop=stop, **sampling)
    assert final == free[:at]
    check_never_taken_back(events, final)


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: f"T={s['temperature']},seed={s.get('seed')}")
def test_stop_strings_that_never_complete_are_released_at_the_end(pair, sampling):
    free_events, free = run(*pair, **sampling)
    # "z" is no token's: each stop string begins where a step's text ends, and never completes
    stops = sorted({free[-2:] + "z"} | {e.text[-1] + "zz" for e in free_events})
    events, final = run(*pair, stop=stops, **sampling)
    assert [e.token_ids for e in events] == [e.token_ids for e in free_events]
    assert final == free
    check_never_taken_back(events, final)
    shown = itertools.accumulate(len(e.text) for e in events[:-1])
    unheld = itertools.accumulate(len(e.text) for e in free_events[:-1])
    assert all(a < b for a, b in zip(shown, unheld))  # each step's last letter waited for the next step


def draft_credit(events) -> list[bool]:
    """Per character of the output, whether a kept draft token wrote it, from the tokens alone."""
    return [d for e in events for t, d in zip(e.token_ids, e.from_draft) for _ in PIECES[t]]


@pytest.mark.parametrize("stop", [None, "spanning"])
def test_draft_chars_count_the_characters_of_kept_draft_tokens(pair, stop):
    target, _ = pair
    free_events, free = run(target, target, temperature=0)  # drafting for itself: every draft is kept
    assert all(all(e.from_draft[:-1]) and not e.from_draft[-1] for e in free_events)
    if stop is not None:
        stop, _ = spanning_stop(free_events)
    events, final = run(target, target, temperature=0, stop=stop)
    check_never_taken_back(events, final)
    credit = draft_credit(events)
    assert sum(e.draft_chars for e in events) == sum(credit[: len(final)])
    assert 0 < sum(e.draft_chars for e in events) < len(final)


def test_draft_chars_of_steps_that_keep_part_of_the_draft(pair):
    events, final = run(*pair, temperature=0)  # no stop string: each step's text is its own tokens'
    assert any(0 < sum(e.from_draft) < 3 for e in events)  # some drafts rejected after a kept one
    for e in events:
        assert e.text == "".join(PIECES[t] for t in e.token_ids)
        assert e.draft_chars == sum(len(PIECES[t]) for t, d in zip(e.token_ids, e.from_draft) if d)



@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: f"T={s['temperature']},seed={s.get('seed')}")
def test_a_stop_inside_a_kept_draft_ends_the_tokens_where_plain_decoding_does(pair, sampling):
    """Plain decoding ends at the token that completes a stop string; a kept draft that ran past it
    leaves none of its later tokens in the ids, the counts, the events or the logprobs."""
    target, _ = pair
    settings = dict(tokenizer=PieceTokenizer(), max_new_tokens=40, sampler="gumbel", **sampling)
    free = generate(target, PROMPT, **settings)
    text = free.text
    # a stop string completed by a token in the middle of the output, first seen there
    stop = next(text[at - 2 : at] for at in range(6, len(text) - 6) if text.find(text[at - 2 : at]) == at - 2)
    ar = generate(target, PROMPT, stop=stop, **settings)
    assert len(ar.token_ids) < len(free.token_ids)
    for k in (3, 8):  # the target drafting for itself: every draft is kept, so the stop falls inside one
        options = dict(draft=target, k=k, policy="static", stop=stop, logprobs=0, **settings)
        spec = generate(target, PROMPT, **options)
        assert spec.token_ids == ar.token_ids and spec.text == ar.text
        assert spec.stats.new_tokens == len(ar.token_ids) and len(spec.logprobs) == len(ar.token_ids)
        events = list(stream(target, PROMPT, **options))
        assert [t for e in events for t in e.token_ids] == ar.token_ids
        assert max(len(e.token_ids) for e in events) > 1


# -- the server: the library's text, streamed or whole ---------------------------------------------


@pytest.fixture(scope="module")
def server():
    target, draft = tiny_pair()
    tokenizer = tiny_tokenizer()
    with serve(target, tokenizer, draft) as running:
        yield running, target, draft, tokenizer


def completion(url: str, body: dict, streamed: bool) -> tuple[str, list[dict]]:
    """(the answer's text, its chunks with tokens) for a completion, streamed or not."""
    if not streamed:
        answer = httpx.post(url + "/v1/completions", json=body, trust_env=False, timeout=120).json()
        return answer["choices"][0]["text"], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, trust_env=False,
                      timeout=120) as response:
        chunks = [e for e in sse_events(response) if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    return text, [c for c in chunks if c["speculative"].get("token_ids")]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3)], ids=["T=0", "T=1"])
def test_streamed_and_whole_completions_with_a_stop_string_agree(server, sampling):
    running, target, draft, tokenizer = server
    prompt = "def quicksort(arr):"
    seeded = {"sampler": "gumbel"} if "seed" in sampling else {}  # the server's choice for seeded requests
    options = dict(draft=draft, tokenizer=tokenizer, verify="block", k=4, policy="static", max_new_tokens=32,
                   **sampling, **seeded)
    free_events = list(stream(target, prompt, **options))
    free = "".join(e.text for e in free_events)
    stop, at = spanning_stop(free_events)
    never = free[-2:] + "\x00"  # begins where the text ends, never completes
    for stops, want in (([stop], free[:at]), ([never], free)):
        assert generate(target, prompt, stop=stops, **options).text == want
        body = {"prompt": prompt, "max_tokens": 32, "stop": stops, **sampling}
        whole, _ = completion(running.url, body, streamed=False)
        streamed, steps = completion(running.url, body, streamed=True)
        assert whole == streamed == want
        assert all(0 <= c["speculative"]["draft_chars"] <= len(c["choices"][0]["text"]) for c in steps)


class CleanUpTokenizer(PieceTokenizer):
    """Tokens decode to 'a', ' ', ',' and 'b' (id mod 4); by default, as transformers'
    ``clean_up_tokenization_spaces`` does, a space before a comma is dropped, which rewrites text
    already decoded once the comma arrives."""

    PIECES = ["a", " ", ",", "b"]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        text = "".join(self.PIECES[int(i) % 4] for i in ids)
        return text if clean_up_tokenization_spaces is False else text.replace(" ,", ",")


@pytest.mark.parametrize("seed", range(3))
def test_streamed_text_is_the_text_of_the_tokens_where_clean_up_would_rewrite_it(pair, seed):
    """Each event's text appends to what was shown, and all of it is the tokens' text with spaces as
    they spell them: nothing shown is dropped or repeated when a later token would make the
    tokenizer's clean-up rewrite it (before the fix a ' ,' streamed as ' ' and then ',' lost the
    comma's neighbour)."""
    target, draft = pair
    tokenizer = CleanUpTokenizer()
    settings = dict(draft=draft, tokenizer=tokenizer, k=3, policy="static", max_new_tokens=60,
                    temperature=1.0, seed=seed)
    events = list(stream(target, PROMPT, **settings))
    ids = [t for e in events for t in e.token_ids]
    text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert " ," in text  # the case clean-up rewrites occurs
    check_never_taken_back(events, text)
    assert generate(target, PROMPT, **settings).text == text
