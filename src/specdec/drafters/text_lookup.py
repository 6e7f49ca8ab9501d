"""Prompt lookup on the context's text rather than its tokens (a source of ``ngram+model``).

The token n-gram lookup (:mod:`specdec.drafters.ngram`) proposes what followed an earlier
occurrence of the context's last tokens. Where the output copies text into a new setting, the same
characters are often split into different tokens: a name quoted from the prompt into a JSON
string loses its leading space (`` Amara`` in the prose, ``"Am`` + ``ara`` after the quote), so no
token n-gram of the output ever occurred before. Matched on bytes, the copy is found: the longest
suffix of the context's text (at least :data:`MIN_BYTES`, at most :data:`LONGEST` bytes) that
occurred earlier is looked up, and the bytes that followed it are tokenized and proposed.

The drafter is deterministic (point-mass drafts, like every lookup), so verification keeps the
target's law whatever it proposes. It drafts only once it is given a vocabulary that maps tokens to
bytes and back (:meth:`TextLookupDrafter.read_text`); ``generate`` and ``stream`` give it the
grammar's tokenizer under a grammar, which also cuts every proposed token it forbids before the
target scores it (docs/drafters.md, "Lookup on the text").
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from specdec.backends.base import common_prefix_len
from specdec.drafters.base import Draft, Drafter, KeepGoing, draft_chain
from specdec.drafters.ngram import seeing
from specdec.sampling import SamplingConfig

MIN_BYTES = 2  # the shortest suffix that proposes
LONGEST = 64  # how far back a match's length is counted
BYTES_PER_TOKEN = 12  # bytes of the continuation tokenized per token asked for (a token is rarely longer)


class Vocabulary(Protocol):
    """Tokens to bytes and back (llguidance's ``LLTokenizer`` is one)."""

    def decode_bytes(self, tokens: list[int]) -> bytes: ...

    def tokenize_bytes(self, text: bytes) -> list[int]: ...


def text_confidence(length: int) -> float:
    """What a draft-length policy sees for a text match of ``length`` bytes: 1 - 2/length (2 bytes:
    0, 4: 0.5, 10: 0.8). A rank, like :func:`~specdec.drafters.ngram.lookup_confidence`; the
    planner maps it to measured acceptance through its calibration tables."""
    return max(0.0, 1.0 - 2.0 / max(length, 1))


class TextIndex:
    """The bytes of a token sequence, kept in step with it as it grows and is cut back."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary
        self.tokens: list[int] = []
        self.ends: list[int] = []  # ends[i]: the text's length after token i
        self.text = bytearray()
        self._found: tuple[int, int] | None = None  # match() of the text as it is (valid while _matched)
        self._matched = False

    def sync(self, context: Sequence[int]) -> None:
        """Make the index describe ``context``: cut back to the common prefix, then extend."""
        keep = common_prefix_len(self.tokens, context)
        if keep == len(self.tokens) == len(context):
            return  # unchanged (the planner's look and the draft after it ask about the same context)
        del self.tokens[keep:], self.ends[keep:]
        del self.text[self.ends[-1] if self.ends else 0:]
        for t in context[keep:]:
            self.tokens.append(int(t))
            self.text += self.vocabulary.decode_bytes([int(t)])
            self.ends.append(len(self.text))
        self._matched = False

    def match(self) -> tuple[int, int] | None:
        """(where the continuation starts, the match's length in bytes) for the longest suffix of
        the text, :data:`MIN_BYTES` to :data:`LONGEST` bytes, that occurred earlier (its most recent
        earlier occurrence); None without one."""
        if not self._matched:
            text, end = bytes(self.text), len(self.text)
            self._found, length = None, MIN_BYTES
            while length <= min(LONGEST, end - 1):
                at = text.rfind(text[end - length:], 0, end - 1)  # an occurrence ending before the end
                if at < 0:
                    break
                self._found, length = (at + length, length), length + 1
            self._matched = True
        return self._found

    def continuation(self, start: int, k: int) -> list[int]:
        """At most ``k`` tokens of the text from byte ``start`` on, tokenized afresh."""
        return list(self.vocabulary.tokenize_bytes(bytes(self.text[start:start + BYTES_PER_TOKEN * k])))[:k]


class TextLookupDrafter(Drafter):
    """Proposes the tokenized continuation of the longest earlier occurrence of the context's
    text (module docstring); nothing until :meth:`read_text` gives it a vocabulary."""

    name = "text"

    def __init__(self, vocab_size: int) -> None:
        self._vocab = int(vocab_size)
        self.index: TextIndex | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def read_text(self, vocabulary: Vocabulary | None) -> None:
        """Draft from now on with ``vocabulary``'s bytes (None: not at all)."""
        self.index = None if vocabulary is None else TextIndex(vocabulary)

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        keep_going: KeepGoing | None = None,
        source: str | None = None,
    ) -> Draft:
        found = self._match(context)
        tokens = self.index.continuation(found[0], k) if found is not None and k > 0 else []
        if not tokens:
            return Draft.empty(self._vocab)
        if keep_going is not None:
            keep_going = seeing(keep_going, text_confidence(found[1]))
        rest = iter(tokens)
        return draft_chain(lambda _previous: next(rest), len(tokens), sampling, generator, keep_going, self._vocab,
                           len(context))

    def observe(self, context: Sequence[int]) -> None:
        if self.index is not None:
            self.index.sync(context)

    def confidence(self, context: Sequence[int]) -> float | None:
        """:func:`text_confidence` of the match a draft after ``context`` would copy (None: no match)."""
        found = self._match(context)
        return None if found is None else text_confidence(found[1])

    def describe(self) -> dict:
        return {"name": self.name, "min_bytes": MIN_BYTES, "reading": self.index is not None}

    def _match(self, context: Sequence[int]) -> tuple[int, int] | None:
        if self.index is None:
            return None
        self.index.sync(context)
        return self.index.match()

