"""Cascade drafting (Chen et al. 2023, "Cascade Speculative Drafting"): a draft model whose own
drafting is sped up by a cheaper drafter (vertical), and a cheaper drafter for the later positions
of a chain (horizontal). The ``cascade`` drafter; the cheaper drafter is the n-gram lookup.

Vertical cascade. The draft model drafts autoregressively, one token per pass. Here, before each
pass, the lookup in the context and the tokens drafted so far (:class:`NGramIndex`, any match of
1 to 3 tokens) proposes how the draft model will go on, and the draft model scores the token it
must feed and the proposal in one pass of 1 + m rows: a row whose proposal agrees with the draft
model's own next token saves a pass. Which token the draft model drafts at each row is decided by
its rule alone, so the chain is the draft model's own:

- greedy decoding: its argmax, so the tokens and the one-hot q rows are what
  :class:`~specdec.drafters.model.ModelDrafter` drafts;
- the Gumbel-max sampler: its Gumbel-max token at the row's position, again the model drafter's;
- sampling with a generator: the proposal x is kept with probability q(x), otherwise a token is
  drawn from q with x removed (renormalised) -- a draw from q exactly (the one-draft rejection rule
  for a point mass), so each token is still a sample from the draft model's q, which the verifier
  is given as that token's row, though not the sample the model drafter would draw with the same
  generator.

Each row's q is the draft model's law given the context and the tokens drafted before it (the
rows past the first disagreement are dropped and the draft's cache trimmed back), so the verifier
sees exactly the draft model's q.

Horizontal cascade. The planner decides token by token whether the draft model's next token pays
(:meth:`~specdec.policies.auto.AutoPolicy.keep_going`: its per-position acceptance, the draft's
confidence and the measured costs). Where it stops the draft model, the chain goes on with the
lookup's continuation -- free tokens, each costing only its verify row -- while a match of at least
:data:`HORIZONTAL_MATCH` tokens continues it, up to the planned cap. Those tokens are point masses,
deterministic functions of the tokens before them, and the switch depends only on the context, the
draft so far and earlier steps, so the verifier's promise holds. A policy without ``keep_going``
(a fixed length) never switches.

The planner chooses, each step, between this cascaded draft model (source ``model``, priced as the
draft model's one-row pass per token) and the lookup alone (source ``ngram``, free, offered where
the context repeats itself, with the ``ngram+model`` drafter's defaults), as it does for
:class:`~specdec.drafters.choice.ChoiceDrafter`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specdec.backends.base import CausalLM, common_prefix_len, forward_after, rollback
from specdec.drafters.base import Draft, DraftCost, Drafter, KeepGoing, confidence
from specdec.drafters.choice import LOOKUP_DEFAULTS
from specdec.drafters.ngram import LOOKUP_OPTIONS, NGramDrafter, NGramIndex
from specdec.drafters.registry import DrafterSpec
from specdec.sampling import SamplingConfig, argmax, gumbel_token, logits_to_probs, sample

INNER_NGRAM = 3  # the longest suffix the vertical cascade's lookup matches (down to one token)
MAX_PROPOSAL = 8  # the most lookup tokens the draft model checks in one pass
HORIZONTAL_MATCH = 2  # the shortest match whose continuation the horizontal cascade appends


class CascadeDrafter(Drafter):
    """The draft model, its drafting cascaded with the n-gram lookup (see the module doc).

    Sources: ``ngram`` (the lookup alone, where the context's suffix of ``min_ngram`` to
    ``max_ngram`` tokens occurred before; defaults 4 and 4 as for ``ngram+model``) and ``model``
    (the cascaded draft model). :attr:`passes` counts the draft model's passes, :attr:`used` the
    tokens drafted by each part: ``model`` (one pass each), ``vertical`` (rows of a lookup proposal
    the draft model agreed with) and ``horizontal`` (lookup tokens after the switch).
    """

    name = "cascade"

    def __init__(self, model: CausalLM, *, max_ngram: int | None = None, min_ngram: int | None = None) -> None:
        options = {**LOOKUP_DEFAULTS, **{k: v for k, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram))
                                         if v is not None}}
        if min_ngram is None:
            options["min_ngram"] = min(options["min_ngram"], options["max_ngram"])
        self.model = model
        self.lookup = NGramDrafter(model.vocab_size, **options)
        self.index = NGramIndex(INNER_NGRAM)  # the vertical and horizontal cascades' lookup
        self.passes = 0
        self.used = {"ngram": 0, "model": 0, "vertical": 0, "horizontal": 0}

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def sources(self, context: Sequence[int]) -> dict[str, float | None]:
        sure = self.lookup.confidence(context)
        return {"model": None} if sure is None else {"ngram": sure, "model": None}

    def costs(self) -> dict[str, DraftCost]:
        return {"ngram": DraftCost(), "model": DraftCost(model=self.model)}

    def behind(self, context: Sequence[int]) -> dict[str, int]:
        lag = len(context) - common_prefix_len(self.model.tokens, context) - 1
        return {"model": lag} if lag > 0 else {}

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
        if name == "ngram":
            draft = self.lookup.propose(context, k, sampling, generator, keep_going)
            self.used["ngram"] += len(draft)
            return draft
        return self._cascade(context, k, sampling, generator, keep_going)

    def _cascade(
        self, context: Sequence[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None,
        keep_going: KeepGoing | None,
    ) -> Draft:
        tokens: list[int] = []
        qs: list[torch.Tensor] = []  # [V] each: the law token i was drawn from
        switched = False
        while len(tokens) < k:
            proposal = self._continuation(context, tokens, min(k - len(tokens) - 1, MAX_PROPOSAL), 1)
            if not tokens:
                rows = forward_after(self.model, context, proposal)  # [1 + m, V]
            else:
                rows = self.model.forward([tokens[-1], *proposal], num_logits=1 + len(proposal))
            self.passes += 1
            for j, logits in enumerate(rows):
                guess = proposal[j] if j < len(proposal) else None
                token, q = _draw(logits, guess, sampling, generator, len(context) + len(tokens))
                tokens.append(token)
                qs.append(q)
                self.used["vertical" if j > 0 else "model"] += 1
                if len(tokens) >= k:
                    break
                if keep_going is not None and not keep_going(confidence(logits)):
                    switched = True
                    break
                if token != guess:
                    break
            rollback(self.model, list(context) + tokens[:-1])  # drop the rows past the disagreement
            if switched:
                break
        if switched:  # the horizontal cascade: the lookup goes on where the draft model stopped
            for token in self._continuation(context, tokens, k - len(tokens), HORIZONTAL_MATCH):
                q = torch.zeros(self.vocab_size)
                q[token] = 1.0
                tokens.append(token)
                qs.append(q)
                self.used["horizontal"] += 1
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(qs))

    def _continuation(self, context: Sequence[int], drafted: list[int], count: int, shortest: int) -> list[int]:
        """Up to ``count`` tokens that followed the latest earlier occurrence of the longest suffix
        (at least ``shortest`` tokens) of the context and ``drafted``, copied on over themselves."""
        if count <= 0:
            return []
        self.index.sync(list(context) + drafted)
        start = next((at for n in range(INNER_NGRAM, shortest - 1, -1) if (at := self.index.lookup(n)) is not None),
                     None)
        if start is None:
            return []
        seq, out = self.index.seq, []
        while len(out) < count:
            at = start + len(out)
            out.append(seq[at] if at < len(seq) else out[at - len(seq)])
        return out

    def observe(self, context: Sequence[int]) -> None:
        rollback(self.model, context)
        self.lookup.observe(context)

    def describe(self) -> dict:
        """The drafter's settings, passes and where its tokens came from, for reports."""
        return {"name": self.name, "ngram": self.lookup.describe(), "passes": self.passes, "used": dict(self.used)}


def _draw(
    logits: torch.Tensor, guess: int | None, sampling: SamplingConfig, generator: torch.Generator | None,
    position: int,
) -> tuple[int, torch.Tensor]:
    """The draft model's token at one row ([V] logits) and the law q it follows ([V]): the rule of
    :func:`~specdec.drafters.base.draft_chain` (argmax; Gumbel-max at ``position`` with a point-mass
    row), or under sampling with a generator a draw from q that keeps the lookup's ``guess`` with
    probability q(guess) (see the module doc)."""
    if sampling.coupled:
        token = gumbel_token(logits, sampling, position)
        q = torch.zeros(logits.shape[-1])
        q[token] = 1.0
        return token, q
    q = logits_to_probs(logits, sampling)  # [V]
    if sampling.greedy:
        return int(argmax(q)), q
    if guess is not None:
        keep, rest = guess_rule(q, guess)
        if float(torch.rand((), dtype=torch.float64, generator=generator)) < keep:
            return guess, q
        return sample(rest, generator), q
    return sample(q, generator), q


def guess_rule(q: torch.Tensor, guess: int) -> tuple[float, torch.Tensor]:
    """How the vertical cascade draws from ``q`` ([V]) given the lookup's ``guess``: (the chance of
    keeping the guess, q(guess); the law drawn from otherwise, q without the guess renormalised
    ([V]), which is never read when q(guess) is 1). keep * onehot(guess) + (1 - keep) * rest = q."""
    keep = float(q[guess])
    rest = q.clone()
    rest[guess] = 0.0
    return keep, (rest if float(rest.sum()) > 0.0 else q)


def _create(target: Any, draft: CausalLM, **options: Any) -> CascadeDrafter:
    return CascadeDrafter(draft, **options)


SPEC = DrafterSpec(name="cascade", create=_create, options=LOOKUP_OPTIONS, uses_draft_model=True)
