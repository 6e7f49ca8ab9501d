"""Drafting from the context where it repeats itself, else from a draft model (``ngram+model``).

Prompt lookup (Saxena 2023) costs nothing and is often right where the output copies its input
(editing code, quoting, refactoring); a draft model costs a forward pass per token and is right
more often elsewhere. :class:`ChoiceDrafter` holds both as sources and offers, each step, the
ones that can draft (:meth:`ChoiceDrafter.sources`: the lookup only where the context's suffix
occurred before). Under a grammar it has a third: the lookup on the context's text
(:mod:`specdec.drafters.text_lookup`), offered where the token lookup finds no match. The
draft-length policy picks one: a fixed-length policy the first offered (the
lookup where it matches, else the draft model); the planner (``policy="auto"``,
:class:`specdec.policies.auto.AutoPolicy`) the one, and the length (0: a plain target step), with
the most expected tokens per second from each one's measured cost and running acceptance estimates.

The choice depends only on the context and on earlier steps, never on this step's draws, so the
verifier still sees a proposal q drawn as reported and the output keeps the target's law.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specdec.backends.base import CausalLM
from specdec.drafters.base import Draft, DraftCost, Drafter, KeepGoing
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import LOOKUP_OPTIONS, NGramDrafter
from specdec.drafters.registry import DrafterSpec
from specdec.drafters.text_lookup import TextLookupDrafter, Vocabulary
from specdec.sampling import SamplingConfig

# The lookup's default: only a suffix of 4 tokens seen before proposes. Shorter matches are right
# far less often (greedy Qwen2.5-Coder-1.5B, 12 bench prompts: a 1-token match's first token was
# the output's 10-40% of the time, a 4-token match's 65-96%), and the draft model covers the rest.
LOOKUP_DEFAULTS = {"max_ngram": 4, "min_ngram": 4}


class ChoiceDrafter(Drafter):
    """Sources: the n-gram lookup where it finds a match, the lookup on the text where that
    finds none and a vocabulary was given (:meth:`read_text`), and the draft model.

    choices: ``{"ngram": NGramDrafter, "text": TextLookupDrafter, "model": ModelDrafter}``.
    :meth:`propose` drafts from the source it is given (the policy's pick), else from the first
    offered. :attr:`used` counts the steps each drafter drafted.
    """

    name = "ngram+model"

    def __init__(self, lookup: NGramDrafter, model: Drafter) -> None:
        if lookup.vocab_size != model.vocab_size:
            raise ValueError(
                f"the n-gram drafter's vocabulary ({lookup.vocab_size}) differs from the draft model's ({model.vocab_size})"
            )
        self.text = TextLookupDrafter(model.vocab_size)
        self.choices: dict[str, Drafter] = {"ngram": lookup, "text": self.text, "model": model}
        self.used: dict[str, int] = {name: 0 for name in self.choices}  # steps each drafter drafted

    @classmethod
    def build(cls, model: Drafter, **lookup_options: int) -> "ChoiceDrafter":
        """A draft model's drafter and an n-gram lookup with :data:`LOOKUP_DEFAULTS` updated by
        ``lookup_options`` (``max_ngram``, ``min_ngram``); a bad option is a ``ValueError``."""
        options = {**LOOKUP_DEFAULTS, **lookup_options}
        if "min_ngram" not in lookup_options:
            options["min_ngram"] = min(options["min_ngram"], options["max_ngram"])
        try:
            return cls(NGramDrafter(model.vocab_size, **options), model)
        except TypeError as e:
            raise ValueError(f"bad option for the ngram+model drafter: {e}") from None

    @property
    def vocab_size(self) -> int:
        return self.choices["model"].vocab_size

    @property
    def model(self) -> Drafter:
        return self.choices["model"]

    def read_text(self, vocabulary: Vocabulary | None) -> None:
        """Offer the lookup on the text, reading tokens' bytes from ``vocabulary`` (None: do not)."""
        self.text.read_text(vocabulary)

    def sources(self, context: Sequence[int]) -> dict[str, float | None]:
        """The drafters that can propose after ``context``, each lookup only where it matches (the
        text's only where the tokens' does not), each with the confidence its draft will have where
        that is known now (a lookup's match; None for the draft model)."""
        sure = self.choices["ngram"].confidence(context)
        if sure is not None:
            return {"ngram": sure, "model": None}
        on_text = self.text.confidence(context)
        return {"model": None} if on_text is None else {"text": on_text, "model": None}

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
        if k <= 0:
            return Draft.empty(self.vocab_size)
        self.used[name] += 1
        return self.choices[name].propose(context, k, sampling, generator, keep_going)

    def observe(self, context: Sequence[int]) -> None:
        for drafter in self.choices.values():
            drafter.observe(context)

    def costs(self) -> dict[str, DraftCost]:
        return {name: next(iter(drafter.costs().values())) for name, drafter in self.choices.items()}

    def behind(self, context: Sequence[int]) -> dict[str, int]:
        return {name: n for name, drafter in self.choices.items() for n in drafter.behind(context).values()}

    def describe(self) -> dict:
        """The drafter's settings and how often each choice drafted, for reports."""
        return {"name": self.name, "ngram": self.choices["ngram"].describe(), "text": self.text.describe(),
                "used": dict(self.used)}


def _create(target: Any, draft: CausalLM, **options: Any) -> ChoiceDrafter:
    return ChoiceDrafter.build(ModelDrafter(draft), **options)


SPEC = DrafterSpec(name="ngram+model", create=_create, options=LOOKUP_OPTIONS, uses_draft_model=True)
