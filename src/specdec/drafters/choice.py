"""Drafting from the context where it repeats itself, else from a draft model (``ngram+model``).

Prompt lookup (Saxena 2023) costs nothing and is often right where the output copies its input
(editing code, quoting, refactoring); a draft model costs a forward pass per token and is right
more often elsewhere. :class:`ChoiceDrafter` holds both and, each step, drafts from one of them:
the n-gram lookup where the context's suffix occurred before, else the draft model. A
planner (``policy="auto"``, :class:`specdec.policies.auto.AutoPolicy`) that binds to it makes the choice
itself -- which drafter, and how many tokens (0: a plain target step) -- from each one's measured
cost and running acceptance estimates (:attr:`ChoiceDrafter.chooser`).

The choice depends only on the context and on earlier steps, never on this step's draws, so the
verifier still sees a proposal q drawn as reported and the output keeps the target's law.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from specdec.drafters.base import Draft, Drafter, KeepGoing
from specdec.drafters.ngram import NGramDrafter
from specdec.sampling import SamplingConfig

# The lookup's default: only a suffix of 4 tokens seen before proposes. Shorter matches are right
# far less often (greedy Qwen2.5-Coder-1.5B, 12 bench prompts: a 1-token match's first token was
# the output's 10-40% of the time, a 4-token match's 65-96%), and the draft model covers the rest.
LOOKUP_DEFAULTS = {"max_ngram": 4, "min_ngram": 4}

# Given the drafters that can draft now (names, in order of preference, each with its draft's
# confidence where that is known before drafting: the lookup's match strength; None for a draft
# model), which one and at most how many tokens (0: none, a plain target step).
Chooser = Callable[[Mapping[str, "float | None"]], "tuple[str, int]"]


class ChoiceDrafter:
    """The n-gram lookup where it finds a match, else the draft model; or what :attr:`chooser` picks.

    choices: ``{"ngram": NGramDrafter, "model": ModelDrafter}`` as given. chooser: set by a planner
    (:meth:`specdec.policies.auto.AutoPolicy.bind`); without one the lookup is used whenever it matches.
    :attr:`used` counts the steps each drafter drafted.
    """

    name = "ngram+model"

    def __init__(self, lookup: NGramDrafter, model: Drafter) -> None:
        if lookup.vocab_size != model.vocab_size:
            raise ValueError(
                f"the n-gram drafter's vocabulary ({lookup.vocab_size}) differs from the draft model's ({model.vocab_size})"
            )
        self.choices: dict[str, Drafter] = {"ngram": lookup, "model": model}
        self.chooser: Chooser | None = None
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

    def available(self, context: Sequence[int]) -> dict[str, float | None]:
        """The drafters that can propose after ``context``, the lookup only where it matches, each
        with the confidence its draft will have where that is known now (the lookup's
        :func:`~specdec.drafters.ngram.lookup_confidence`; None for the draft model)."""
        sure = self.choices["ngram"].confidence(context)
        return {"model": None} if sure is None else {"ngram": sure, "model": None}

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        keep_going: KeepGoing | None = None,
    ) -> Draft:
        available = self.available(context)
        name = next(iter(available))
        if self.chooser is not None and k > 0:
            name, most = self.chooser(available)
            k = min(k, most)
        if k <= 0:
            return Draft.empty(self.vocab_size)
        self.used[name] += 1
        return self.choices[name].propose(context, k, sampling, generator, keep_going)

    def observe(self, context: Sequence[int]) -> None:
        for drafter in self.choices.values():
            drafter.observe(context)

    def describe(self) -> dict:
        """The drafter's settings and how often each choice drafted, for reports."""
        return {"name": self.name, "ngram": self.choices["ngram"].describe(), "used": dict(self.used)}
