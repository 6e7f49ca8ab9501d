"""The drafter interface: propose a block of tokens with the distributions they were drawn from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from specdec.backends.base import CausalLM, forward_after
from specdec.sampling import SamplingConfig, argmax, gumbel_token, logits_to_probs, sample

# How far a draft goes unless told otherwise (the policies' defaults, and the trees' that follow
# them). DEFAULT_K_MAX: the longest draft an adaptive policy tries. DEFAULT_THRESHOLD: the
# confidence policy stops after a token the draft gives less than 0.8 (transformers uses 0.4; with a
# 0.5B draft at c ~ 0.5 target steps per token that drafted 7 tokens a step at 52% acceptance on our
# probe prompts, slower than ar).
DEFAULT_K_MAX = 16
DEFAULT_THRESHOLD = 0.8


@dataclass(frozen=True)
class Draft:
    """A proposed block. tokens: [k] int64; q: [k, V] float, row i is what token i was drawn from.

    k may be 0 (nothing to propose): the step then decodes one token from the target.
    """

    tokens: torch.Tensor
    q: torch.Tensor

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty(vocab_size: int) -> "Draft":
        return Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, vocab_size))

    # A chain is the token tree whose node i's parent is i - 1: the engine reads both through
    # score / path / tokens_on / keep (:class:`specdec.token_tree.TokenTree` for the tree).

    def score(self, target: CausalLM, context: Sequence[int]) -> torch.Tensor:
        """The target's logits after the context and after each draft token: [k + 1, V]."""
        return forward_after(target, context, self.tokens.tolist())

    def path(self, node: int) -> list[int]:
        """The draft positions from the first down to ``node`` (none for -1)."""
        return list(range(node + 1))

    def tokens_on(self, path: Sequence[int]) -> list[int]:
        return self.tokens[: len(path)].tolist()  # a chain's path is always a prefix

    def keep(self, target: CausalLM, context_len: int, path: Sequence[int]) -> None:
        """Nothing to do: a kept chain is a prefix, and rolling back by length drops the rest."""


# Called after each draft token but the last with the draft's confidence there ([V], see
# :func:`confidence`; policies read its largest entry); returning False stops drafting after
# that token.
KeepGoing = Callable[[torch.Tensor], bool]

# What a drafter computes for the next draft position, given the token just drafted (None for the
# first position): the draft model's logits there ([V]), or a token id for a deterministic
# drafter (a point mass).
NextLogits = Callable[[int | None], "torch.Tensor | int"]


def confidence(logits: torch.Tensor) -> torch.Tensor:
    """What a draft-length policy's ``keep_going`` sees: the draft model's own probabilities at
    the position just drafted, the softmax of its logits at temperature 1 before any sampling
    filter, whatever the sampling settings. [V] float32 (float64 for float64 logits).

    One meaning for every drafter: the sampling law q would be one-hot under greedy decoding and
    sharpened, flattened or cut by temperature, top-k and top-p, so a threshold on it would mean
    something different for each setting."""
    return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)


def draft_chain(
    next_logits: NextLogits,
    k: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    keep_going: KeepGoing | None,
    vocab_size: int,
    start: int | None = None,
) -> Draft:
    """The drafting loop every chain drafter shares: draw, append, ask whether to go on.

    Token i is drawn with ``generator`` from q[i] = ``logits_to_probs(next_logits(prev), sampling)``
    (a point mass where ``next_logits`` returns a token id, and under greedy decoding; neither
    draws). Under the Gumbel-max sampler token i is instead the Gumbel-max of the draft's logits
    with the noise of its absolute position ``start + i`` (``start``: the context's length), the
    noise the target's token there uses (:mod:`specdec.verify.coupled`); q[i] is then the point
    mass on it, which the coupled rule does not read. After each token but the k-th,
    ``keep_going`` gets the draft's :func:`confidence` there (the point mass for a token id: a
    drafter with a better measure of its own certainty, like the n-gram lookup, wraps
    ``keep_going``) and may stop the draft.
    Returns at most ``k`` tokens; q[i] depends on the context and the tokens before i only.
    """
    if sampling.coupled and start is None:
        raise ValueError("a draft under the Gumbel-max sampler needs its start position")
    tokens: list[int] = []
    qs: list[torch.Tensor] = []
    previous: int | None = None
    while len(tokens) < k:
        out = next_logits(previous)
        if isinstance(out, int) or sampling.coupled:  # a point mass; a lookup's its own confidence too
            token = out if isinstance(out, int) else gumbel_token(out, sampling, start + len(tokens))
            q = torch.zeros(vocab_size)
            q[token] = 1.0
        else:
            q = logits_to_probs(out, sampling)  # [V]
            token = int(argmax(q)) if sampling.greedy else sample(q, generator)  # greedy: q is one-hot
        tokens.append(token)
        qs.append(q)
        if len(tokens) < k and keep_going is not None:
            if not keep_going(q if isinstance(out, int) else confidence(out)):
                break
        previous = token
    if not tokens:
        return Draft.empty(vocab_size)
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(qs))


@dataclass(frozen=True)
class DraftCost:
    """What one drafted token costs, as a drafter declares it to the planner: a one-row pass of
    ``model`` (a :class:`~specdec.backends.base.CausalLM`, measured), else ``layers`` of the
    target's ``of`` layers (that share of a target one-row pass), else nothing (a lookup; heads
    whose cost is small beside a target pass)."""

    model: Any = None
    layers: int = 0
    of: int = 0


@runtime_checkable
class Drafter(Protocol):
    """Something that proposes draft tokens for the target to verify.

    A drafter drafts from one or more *sources* (its own name; the n-gram lookup and the draft
    model for :class:`~specdec.drafters.choice.ChoiceDrafter`). Each step the engine asks
    :meth:`sources` what can draft now, the draft-length policy picks one and a length
    (:meth:`~specdec.policies.base.DraftLengthPolicy.plan`), and :meth:`propose` drafts it.
    A class that subclasses this protocol inherits the one-source :meth:`sources` and a free
    :meth:`costs`.
    """

    name: str

    @property
    def vocab_size(self) -> int: ...

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        keep_going: KeepGoing | None = None,
        source: str | None = None,
    ) -> Draft:
        """Propose up to ``k`` tokens to follow ``context`` from ``source`` (one of
        :meth:`sources`; None: the first there).

        Promise: token i was drawn from ``q[i]`` with ``generator`` (a deterministic drafter
        reports a point mass), and ``q[i]`` depends only on the context and tokens before i.
        Under the Gumbel-max sampler (``sampling.coupled``) token i is instead the Gumbel-max of
        the draft's scores with the noise of position ``len(context) + i`` (:func:`draft_chain`);
        the coupled rule keeps the output exact whatever the draft.
        ``keep_going`` sees the draft's :func:`confidence` (a lookup: its match's strength,
        :func:`~specdec.drafters.ngram.lookup_confidence`); chain drafters draft through
        :func:`draft_chain`.
        """
        ...

    def observe(self, context: Sequence[int]) -> None:
        """The output now reads ``context``: forget state built on rejected tokens."""
        ...

    def sources(self, context: Sequence[int]) -> dict[str, float | None]:
        """The sources that can draft after ``context``, in order of preference, each with its
        draft's confidence where that is known before drafting (None: known only as it drafts)."""
        return {self.name: None}

    def costs(self) -> dict[str, DraftCost]:
        """Every source this drafter may draft from, and what a token from it costs."""
        return {self.name: DraftCost()}

    def behind(self, context: Sequence[int]) -> dict[str, int]:
        """For each source that must first catch up to draft after ``context``, how many tokens
        it would feed beyond the one every draft feeds (a draft model's cache lacks the tokens
        drafted or decoded since it last drafted); sources not named feed nothing."""
        return {}

    def read_text(self, vocabulary: Any) -> None:
        """Tokens' bytes and back (``decode_bytes``, ``tokenize_bytes``) for a drafter that can
        match the context's text (:mod:`specdec.drafters.text_lookup`); given for a generation
        under a grammar, None otherwise. Other drafters ignore it."""
