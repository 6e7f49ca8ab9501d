"""The drafter interface: propose a block of tokens with the distributions they were drawn from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from specdec.sampling import SamplingConfig


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


# Called with each draft distribution q[i] ([V]); returning False stops drafting after token i.
KeepGoing = Callable[[torch.Tensor], bool]


class Drafter(Protocol):
    """Something that proposes draft tokens for the target to verify."""

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
    ) -> Draft:
        """Propose up to ``k`` tokens to follow ``context``.

        Promise: token i was drawn from ``q[i]`` with ``generator`` (a deterministic drafter
        reports a point mass), and ``q[i]`` depends only on the context and tokens before i.
        """
        ...

    def observe(self, context: Sequence[int]) -> None:
        """The output now reads ``context``: forget state built on rejected tokens."""
        ...
