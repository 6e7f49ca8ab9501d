"""The lookup on the context's text: it finds a copy that the token n-gram lookup cannot (the same
characters split into different tokens), keeps its index in step with a context that grows and is
cut back, drafts only once given a vocabulary, and under a grammar keeps plain decoding's output."""

from __future__ import annotations

import json

import pytest
import torch

from specdec import Constraints, generate
from specdec.config import DecodeConfig
from specdec.drafters.choice import ChoiceDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NGramDrafter
from specdec.drafters.text_lookup import TextIndex, TextLookupDrafter, text_confidence
from specdec.engine import speculative_steps
from specdec.policies import StaticK
from specdec.sampling import SamplingConfig
from specdec.verify import make_verifier

from helpers import THREADS

PIECES = [b"Dr", b".", b" Amara", b" Ok", b"afor", b" is", b" here", b'"', b"Am", b"ara", b"{", b"}", b":",
          b" ", b"a", b"r", b"O", b"k", b"f", b"o", b"A", b"m", b"D", b"e", b"h", b"i", b"s"]


class Pieces:
    """A toy vocabulary: token i is PIECES[i]; text is tokenized by longest match, left to right."""

    def decode_bytes(self, tokens):
        return b"".join(PIECES[t] for t in tokens)

    def tokenize_bytes(self, text):
        out, i = [], 0
        while i < len(text):
            best = max((t for t, p in enumerate(PIECES) if text.startswith(p, i)), key=lambda t: len(PIECES[t]))
            out.append(best)
            i += len(PIECES[best])
        return out


def ids(*pieces: bytes) -> list[int]:
    return [PIECES.index(p) for p in pieces]


# The prose "Dr. Amara Okafor is here", then the name quoted: '"Am' is tokenized '"', 'Am'.
PROSE = ids(b"Dr", b".", b" Amara", b" Ok", b"afor", b" is", b" here")
QUOTED = PROSE + ids(b"{", b'"', b"Am")


def test_the_text_finds_a_copy_that_no_token_ngram_of_the_context_repeats():
    greedy = SamplingConfig()
    tokens = NGramDrafter(len(PIECES), max_ngram=4, min_ngram=1).propose(QUOTED, 3, greedy, None)
    assert len(tokens) == 0  # 'Am' never occurred as a token before
    drafter = TextLookupDrafter(len(PIECES))
    drafter.read_text(Pieces())
    draft = drafter.propose(QUOTED, 3, greedy, None)
    assert draft.tokens.tolist() == ids(b"ara", b" Ok", b"afor")  # the rest of the name, tokenized afresh
    assert torch.equal(draft.q.sum(-1), torch.ones(3)) and draft.q.max(-1).values.eq(1).all()  # point masses
    assert drafter.confidence(QUOTED) == text_confidence(2)  # 'Am' matched, not '"Am'


def test_without_a_vocabulary_the_text_lookup_offers_nothing():
    drafter = TextLookupDrafter(len(PIECES))
    assert drafter.confidence(QUOTED) is None
    assert len(drafter.propose(QUOTED, 3, SamplingConfig(), None)) == 0
    drafter.read_text(Pieces())
    assert drafter.confidence(QUOTED) is not None
    drafter.read_text(None)
    assert drafter.confidence(QUOTED) is None


def test_the_index_follows_a_context_that_grows_and_is_cut_back():
    index = TextIndex(Pieces())
    index.sync(QUOTED)
    assert bytes(index.text) == b'Dr. Amara Okafor is here{"Am'
    index.sync(PROSE[:3])  # cut back to a prefix
    assert bytes(index.text) == b"Dr. Amara" and index.ends == [2, 3, 9]
    index.sync(PROSE[:2] + ids(b" Ok"))  # a different token after a shorter common prefix
    assert bytes(index.text) == b"Dr. Ok" and index.tokens == PROSE[:2] + ids(b" Ok")
    fresh = TextIndex(Pieces())
    fresh.sync(PROSE[:2] + ids(b" Ok"))
    assert fresh.text == index.text and fresh.ends == index.ends


def test_the_longest_earlier_suffix_wins_and_a_short_one_does_not_match():
    index = TextIndex(Pieces())
    index.sync(ids(b"A", b"m", b"a", b"r", b"a", b" ", b"A", b"m", b"a"))  # 'Amara Ama'
    assert index.match() == (3, 3)  # 'Ama' matched at the start; the copy goes on from 'ra'
    index.sync(ids(b"D", b"r", b" ", b"O"))  # no earlier occurrence of 'O', nor of ' O'
    assert index.match() is None
    index.sync(ids(b"a", b"a"))  # only a suffix of one byte ('a') repeats: shorter than MIN_BYTES
    assert index.match() is None


def test_the_default_offers_the_text_only_where_the_tokens_do_not_match_and_only_when_reading():
    vocab = len(PIECES)
    drafter = ChoiceDrafter(NGramDrafter(vocab, max_ngram=4, min_ngram=2), _Silent(vocab))
    assert drafter.sources(QUOTED) == {"model": None}
    drafter.read_text(Pieces())
    assert drafter.sources(QUOTED) == {"text": text_confidence(2), "model": None}
    repeated = PROSE + PROSE[:3]  # a token 3-gram seen before: the token lookup is offered instead
    assert set(drafter.sources(repeated)) == {"ngram", "model"}


class _Silent:
    """A stand-in draft model's drafter (never asked to draft here)."""

    name = "model"

    def __init__(self, vocab: int) -> None:
        self.vocab_size = vocab

    def observe(self, context):
        pass

    def describe(self):
        return {"name": self.name}


# ------------------------------------------------------------------------------------------------
# Exactness on a real model and tokenizer, under a JSON schema

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "city"], "additionalProperties": False}
PROMPT = ("Text: Yesterday Margaret Oyelaran-Whitfield moved from Saint-Nazaire to Wellington.\n"
          "The person and the city she moved to, as JSON:\n")


@pytest.fixture(scope="module")
def smollm():
    from specdec import models, packs
    from specdec.backends import llamacpp

    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    if packs.missing_parts(packs.PACKS["smollm2-135m"]):
        pytest.skip("pack smollm2-135m is not installed")
    model = llamacpp.load_gguf(packs.gguf_file("smollm2-135m", progress=False), n_threads=THREADS, n_ctx=512,
                               prefill_layout="repacked")
    return model, models.load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("setting", [dict(), dict(temperature=1.0, sampler="gumbel", seed=11)])
def test_the_text_lookup_keeps_plain_decodings_output_under_a_schema(smollm, setting):
    """The default's sources with the text read through the grammar's vocabulary, drafting the
    first source offered (static k): the output equals plain decoding's under the same schema,
    token for token, and the text lookup drafted tokens that were kept."""
    model, tokenizer = smollm
    constraints = Constraints(json_schema=SCHEMA)
    plain = generate(model, PROMPT, tokenizer=tokenizer, max_new_tokens=60, constraints=constraints, **setting)
    value = json.loads(plain.text)
    assert set(value) == {"name", "city"}

    config = DecodeConfig(**setting)
    prompt = tokenizer(PROMPT)["input_ids"]
    processor = constraints.processor(tokenizer, model.vocab_size, prompt, [tokenizer.eos_token_id])
    drafter = ChoiceDrafter.build(ModelDrafter(model.fork()))
    drafter.read_text(processor.vocabulary)
    model.reset()
    steps = list(speculative_steps(model, drafter, make_verifier(config.chain_verifier), StaticK(4), prompt,
                                   sampling=config.sampling, max_new_tokens=60, processor=processor,
                                   eos_ids={tokenizer.eos_token_id}))
    assert [t for s in steps for t in s.tokens] == plain.token_ids
    assert drafter.used["text"] > 0
    assert sum(s.accepted for s in steps) > 0
