"""Drafting from a text the client already holds (OpenAI's Predicted Outputs).

An editor or an agent that asks for a file back with a few lines changed knows most of the answer
before it is written: the file as it was. It sends that text as the request's *prediction*, and the
prediction, tokenized, is a draft source: :class:`PredictionDrafter` finds where the output stands
in it and proposes what follows there.

Where the output stands is kept as a position in the prediction. Each token the output gains moves
it on by one where it is the predicted token there; where it is not (an edit point: a line
inserted, a name changed, a span deleted) the drafter has lost its place and looks for it again
after every new token: the longest suffix of the output, :data:`MIN_SYNC` to :data:`MAX_SYNC`
tokens, that occurs in the prediction (an n-gram index of the prediction,
:class:`~specdec.drafters.ngram.NGramIndex`), preferring the first occurrence at or after where
it was lost (the text after an edit follows the text before it), else the last one before. So an
edit in the middle stops the drafting only until the output has written a few tokens past it that
the prediction holds.

How sure a draft from the prediction is, the planner sees as a lookup match's length (the
``run``): the client's word counts as :data:`START_RUN` tokens of agreement before any output, each
output token that follows the prediction adds one, and where the place is found again ahead of
where it was lost (the output went on past an edit) the run it had is carried over, since the text
after an edit is the client's text as much as the text before it was. So after an edit point in a
long kept passage the drafts are long again at once. A place found again that fails at its first
token halves the run carried (the match was a repeat, not the text going on), so a prediction the
output never follows soon drafts short, and the planner's running acceptance stops it.

An edit the output has made is often made again further on: a renamed identifier, a changed
quote, a changed argument. Where the place is found again ahead of where it was lost, the span the
output wrote in place of the prediction's span (both at most :data:`MAX_EDIT` tokens; an insertion,
where the prediction's span is empty, with the :data:`EDIT_CONTEXT` tokens before it on both
sides, so that ``first_int`` -> ``first_int_value`` is learnt as such and not as ``_int`` ->
``_int_value``) is taken as an edit, and the rest of the prediction is rewritten with it, every
later occurrence of the old span replaced by the new one; so a rename drafts the new name at its
next occurrences instead of failing there. An edit that was made only once costs a rejected token where
the rewritten text is wrong, and the output then writes the old span back, which rewrites it back.

The drafter is deterministic (point-mass drafts, as every lookup), so verification keeps the
target's law whatever the prediction says: a prediction changes how fast the answer comes, never
the answer. It is a source beside the request's own drafter (:meth:`PredictionDrafter.sources`
offers it first where it knows its place, with the confidence of how long the output has followed
the prediction; the planner weighs it against the others with its own running acceptance
estimates and drafts long where the prediction keeps matching, not at all where it never has).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specdec.drafters.base import Draft, DraftCost, Drafter, KeepGoing, draft_chain
from specdec.drafters.ngram import LONGEST_MATCH, NGramIndex, lookup_confidence, seeing
from specdec.sampling import SamplingConfig

SOURCE = "prediction"  # the source's name, in the planner's reports and the statistics
MIN_SYNC = 3  # the shortest suffix of the output that finds the drafter's place in the prediction again
MAX_SYNC = 8  # the longest tried first
MAX_EDIT = 16  # the longest span, old or new, taken as an edit that the rest of the prediction is rewritten with
EDIT_CONTEXT = 2  # the tokens before an insertion that an insertion is learnt with
# Where the output starts, the drafter stands at the prediction's first token on the client's word
# alone, taken as that many tokens of agreement: what the planner sees then is the confidence of
# an 8-token lookup match, 0.75.
START_RUN = 8
START_CONFIDENCE = lookup_confidence(START_RUN)


class PredictionDrafter(Drafter):
    """Proposes the prediction's continuation from where the output stands in it, as the source
    ``prediction`` beside ``inner``'s sources (``inner``: the request's own drafter, or None).

    prediction: the predicted output's token ids. The output is the context past its length when
    the drafter first sees it (the prompt). :attr:`drafted` and :attr:`accepted` count the
    prediction's tokens proposed and kept; :meth:`describe` reports them.
    """

    name = SOURCE

    def __init__(self, prediction: Sequence[int], vocab_size: int, inner: Drafter | None = None) -> None:
        if inner is not None and inner.vocab_size != vocab_size:
            raise ValueError(f"the prediction's vocabulary ({vocab_size}) differs from the drafter's ({inner.vocab_size})")
        self.original = [int(t) for t in prediction]  # as the client sent it
        self.prediction = list(self.original)  # with the output's edits applied past the place
        self.inner = inner
        self._vocab = int(vocab_size)
        self._index = NGramIndex(MAX_SYNC)
        self._index.sync(self.prediction)
        self._start: int | None = None  # the prompt's length: the output is context[_start:]
        self._output: list[int] = []  # the output the place below describes
        self._place: int | None = 0  # the prediction's position of the output's next token (None: lost)
        self._lost_at = 0  # where the place was last lost (a new place is looked for from there on)
        self._lost_out = 0  # the output's length when it was
        self._run = START_RUN  # the agreement the place stands on, in tokens (see the module's text)
        self._carried = START_RUN  # the run the place had when it was last lost
        self._fresh = False  # the place was found again and no token has followed it yet

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def place(self, context: Sequence[int]) -> int | None:
        """The position in the prediction of the token that follows ``context`` by the prediction
        (None: the output has left it and not found it again, or has run past its end)."""
        self._sync(context)
        return self._place if self._place is not None and self._place < len(self.prediction) else None

    def confidence(self, context: Sequence[int]) -> float | None:
        """What the planner sees for a draft after ``context``: the lookup confidence of the run
        the place stands on (:data:`START_CONFIDENCE` before any output; None: no place, nothing
        to draft)."""
        if self.place(context) is None:
            return None
        return lookup_confidence(min(self._run, LONGEST_MATCH))

    def sources(self, context: Sequence[int]) -> dict[str, float | None]:
        sure = self.confidence(context)
        inner = self.inner.sources(context) if self.inner is not None else {}
        if sure is not None:
            return {SOURCE: sure, **inner}
        return inner or {SOURCE: None}  # alone and lost: a source that proposes nothing (a plain step)

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        keep_going: KeepGoing | None = None,
        source: str | None = None,
    ) -> Draft:
        name = source if source is not None else next(iter(self.sources(context)))
        if name != SOURCE:
            return self.inner.propose(context, k, sampling, generator, keep_going, name)  # type: ignore[union-attr]
        place = self.place(context)
        if k <= 0 or place is None:
            return Draft.empty(self._vocab)
        sure = self.confidence(context)
        if keep_going is not None and sure is not None:
            keep_going = seeing(keep_going, sure)
        ahead = self.prediction[place:]
        proposed: list[int] = []

        def next_token(previous: int | None) -> int:
            if previous is not None:
                proposed.append(previous)
            return ahead[len(proposed)]

        draft = draft_chain(next_token, min(k, len(ahead)), sampling, generator, keep_going, self._vocab, len(context))
        return draft

    def observe(self, context: Sequence[int]) -> None:
        self._sync(context)
        if self.inner is not None:
            self.inner.observe(context)

    def costs(self) -> dict[str, DraftCost]:
        return {SOURCE: DraftCost(), **(self.inner.costs() if self.inner is not None else {})}

    def behind(self, context: Sequence[int]) -> dict[str, int]:
        return self.inner.behind(context) if self.inner is not None else {}

    def read_text(self, vocabulary: Any) -> None:
        if self.inner is not None:
            self.inner.read_text(vocabulary)

    def describe(self) -> dict:
        inner = self.inner.describe() if self.inner is not None and hasattr(self.inner, "describe") else None
        return {"name": SOURCE, "tokens": len(self.original), **({"drafter": inner} if inner is not None else {})}

    def _sync(self, context: Sequence[int]) -> None:
        """Move the place on over the output's new tokens (or find it again from scratch where
        the output is not the one the place describes plus new tokens)."""
        if self._start is None:
            self._start = len(context)
        output = context[self._start:]
        known = len(self._output)
        if len(output) < known or list(output[:known]) != self._output:  # cut back or changed: start over
            self._output, self._place, self._lost_at, self._run, self._carried = [], 0, 0, START_RUN, START_RUN
            self._fresh, self._lost_out = False, 0
            if self.prediction != self.original:
                self._rewrite(list(self.original))
            known = 0
        for token in output[known:]:
            token = int(token)
            self._output.append(token)
            place = self._place
            if place is not None and place < len(self.prediction) and self.prediction[place] == token:
                self._place, self._run, self._fresh = place + 1, self._run + 1, False
                continue
            if place is not None:
                carried = self._carried // 2 if self._fresh else self._run
                self._lost_at, self._place, self._carried, self._run, self._fresh = place, None, carried, 0, False
                self._lost_out = len(self._output) - 1
            self._find()

    def _find(self) -> None:
        """Look for the place again: the longest suffix of the output (:data:`MAX_SYNC` down to
        :data:`MIN_SYNC` tokens) that occurs in the prediction with a token after it; found ahead
        of where it was lost, the place carries the run it had then."""
        output = self._output
        for n in range(min(MAX_SYNC, len(output)), MIN_SYNC - 1, -1):
            after = self._index.positions.get(tuple(output[-n:]))
            if not after:
                continue
            ahead = [p for p in after if p >= self._lost_at]
            self._place, self._run = (ahead[0], max(n, self._carried)) if ahead else (after[-1], n)
            self._fresh = True
            if ahead:
                start, lost_out = self._lost_at, self._lost_out
                if start == ahead[0] - n and start >= EDIT_CONTEXT and lost_out >= EDIT_CONTEXT:  # an insertion
                    start, lost_out = start - EDIT_CONTEXT, lost_out - EDIT_CONTEXT
                    if self.prediction[start:self._lost_at] != output[lost_out:self._lost_out]:
                        return
                self._learn(self.prediction[start:ahead[0] - n], output[lost_out:len(output) - n])
            return

    def _learn(self, old: list[int], new: list[int]) -> None:
        """Rewrite the prediction past the place with an edit the output made (see the module's text)."""
        if not (0 < len(old) <= MAX_EDIT and 0 < len(new) <= MAX_EDIT) or old == new:
            return
        place, rest, out, i = self._place, self.prediction[self._place:], [], 0
        while i < len(rest):
            if rest[i:i + len(old)] == old:
                out += new
                i += len(old)
            else:
                out.append(rest[i])
                i += 1
        if out != rest:
            self._rewrite(self.prediction[:place] + out)

    def _rewrite(self, prediction: list[int]) -> None:
        self.prediction = prediction
        self._index = NGramIndex(MAX_SYNC)
        self._index.sync(self.prediction)
