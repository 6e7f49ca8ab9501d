"""``--compare-ar`` explains a greedy difference: where, the two tokens, the target's margins."""

from __future__ import annotations

import copy

import torch

from specdec import DecodeConfig, generate
from specdec.backends.lean import make_backend
from specdec.cli.generate import _divergence_words, explain_divergence
from helpers import VOCAB, BatchRounding, CharTokenizer
from tiny import tiny_llama


def test_a_flipped_near_tie_is_located_and_its_margins_read():
    """A target whose batched passes round differently: greedy block verification leaves ar at some
    prompt, and the explanation names that position, both tokens, and each pass's top-2 margin,
    whose best token is that run's own choice; ar's margin is the one-token step's exactly."""
    model = tiny_llama(0, vocab=VOCAB, sharpness=1.0)
    tokenizer = CharTokenizer()
    target = BatchRounding(make_backend(model), 0.05)
    spec = (DecodeConfig(verify="block", k=4, policy="static", max_new_tokens=16), {"draft": copy.deepcopy(model)})
    ar = (DecodeConfig(max_new_tokens=16), {})
    found = 0
    for prompt in ("abcab", "hello", "ccbbaa", "abcdefg", "zzxy", "mnop"):
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        tokens = generate(target, ids, tokenizer=tokenizer, config=spec[0], **spec[1]).token_ids
        ar_tokens = generate(target, ids, tokenizer=tokenizer, config=ar[0]).token_ids
        if tokens == ar_tokens:
            continue
        found += 1
        d = explain_divergence(target, ids, tokenizer, spec, ar, tokens, ar_tokens)
        p = d["position"]
        assert tokens[:p] == ar_tokens[:p] and (d["token"], d["ar_token"]) == (tokens[p], ar_tokens[p])
        assert d["top"][0] == d["token"] and d["ar_top"][0] == d["ar_token"]
        with torch.no_grad():
            exact = torch.topk(model(torch.tensor([ids + ar_tokens[:p]])).logits[0, -1], 2)
        assert abs(d["ar_margin"] - float(exact.values[0] - exact.values[1])) < 1e-4
        assert d["ar_margin"] < 2 * 0.05 * 2  # a near-tie, within what the rounding stand-in moves
        assert "top-2 logit margin" in _divergence_words(d)
    assert found, "the rounding stand-in flipped no token: raise its scale"
