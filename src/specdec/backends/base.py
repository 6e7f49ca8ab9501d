"""The narrow interface the engine needs from a model with a KV cache.

A backend holds one sequence's cache. ``forward`` appends tokens to the cache and returns their
logits; ``trim`` drops cached positions past a length, which is how rejected draft tokens are
rolled back. Nothing here names a framework: transformers is one implementation
(:mod:`specdec.backends.hf`), and a llama.cpp backend fits the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from specdec import kernels


# What a backend can do beyond the protocol's plain forward, trim and keep (its ``capabilities``).
TREES = "trees"  # forward takes attend= and positions=: token trees in one pass
LAYERS = "layers"  # runs a subset of its layers (early exit, layer skipping)
HIDDEN_STATES = "hidden_states"  # keeps the final hidden state of every cached position
SNAPSHOTS = "snapshots"  # snapshot() copies the cache out (a CacheSnapshot), restore() puts one back


@dataclass(frozen=True)
class CacheSnapshot:
    """A copy of a backend's cache: the tokens it holds and the backend's own bytes for it."""

    tokens: tuple[int, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


def capabilities(backend: Any) -> frozenset[str]:
    """What ``backend`` declares it can do (its ``capabilities``); a backend that declares
    nothing offers what the protocol's ``forward`` takes: token trees."""
    return frozenset(getattr(backend, "capabilities", (TREES,)))


class CausalLM(Protocol):
    """A causal language model with a trimmable KV cache for one sequence.

    ``capabilities`` (optional): a frozenset of :data:`TREES`, :data:`LAYERS`,
    :data:`HIDDEN_STATES`, :data:`SNAPSHOTS`, what the backend offers drafters, verifiers and the
    server beyond the methods below.

    ``identity()`` (optional): a dict of JSON values saying what the backend runs (model, dtype,
    threads; e.g. :func:`specdec.measurements.file_identity` for a weights file), which with the
    machine and the backend's class keys what specdec measures of it once and caches
    (:func:`specdec.measurements.cost_key`). A backend without it is described from its
    attributes (:func:`specdec.measurements.probed_identity`).
    """

    @property
    def vocab_size(self) -> int:
        """Width V of the logits."""
        ...

    @property
    def max_context(self) -> int | None:
        """Longest sequence the model accepts, or None if unknown."""
        ...

    @property
    def tokens(self) -> list[int]:
        """The token ids whose keys and values the cache holds, in order (do not mutate)."""
        ...

    def forward(
        self,
        tokens: Sequence[int],
        num_logits: int = 0,
        *,
        attend: torch.Tensor | None = None,
        positions: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append ``tokens`` after the cached ones; return logits [len(tokens), V].

        With ``num_logits > 0`` only the last ``num_logits`` rows are computed and returned.
        For token trees, ``attend`` [n, cache_len + n] (bool) and ``positions`` [n] replace the
        causal mask and the consecutive position ids.
        """
        ...

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the cached positions ``indices`` (ascending): compacts a token tree's path."""
        ...

    def trim(self, length: int) -> None:
        """Forget every cached position >= ``length`` (no-op if the cache is shorter)."""
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...


class ModelFacts:
    """The protocol's plain properties, read from ``_vocab`` and ``_max_context``, which a
    backend sets in its constructor (shared by the backends here)."""

    _vocab: int
    _max_context: int | None

    @property
    def vocab_size(self) -> int:
        """Width V of the logits."""
        return self._vocab

    @property
    def max_context(self) -> int | None:
        """Longest sequence the model accepts, or None if unknown."""
        return self._max_context


DEFAULT_CONTEXT = 4096  # a GGUF backend's context in tokens when none is asked for (or the model's trained one, if shorter)


class ContextSizeError(ValueError):
    """A context length a model cannot be loaded with: ``message`` says what, ``hint`` how to fix it."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(f"{message}; {hint}")
        self.message, self.hint = message, hint


def context_size(asked: int | None, trained: int, where: Any) -> int:
    """The context, in tokens, that a GGUF backend loads ``where`` (its file) with: ``asked``, or
    without one :data:`DEFAULT_CONTEXT` (capped at ``trained``, the context the model was trained
    on, as the GGUF's ``context_length`` says; 0: not said). Raises :class:`ContextSizeError` for
    an ``asked`` that is not a positive integer or exceeds ``trained``: the model's positions past
    its training are not what it learned, and its cache would only grow."""
    if asked is None:
        return min(DEFAULT_CONTEXT, trained) if trained > 0 else DEFAULT_CONTEXT
    if isinstance(asked, bool) or not isinstance(asked, int) or asked <= 0:
        raise ContextSizeError(f"n_ctx must be a positive integer, got {asked!r}", "give a number of tokens")
    if trained > 0 and asked > trained:
        raise ContextSizeError(f"{where}: a context of {asked} tokens is more than the {trained} this model was trained on",
                               f"ask for {trained} tokens or fewer (n_ctx={trained}; --ctx-size {trained})")
    return asked


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case (a cache that is a prefix), compared in C
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def rollback(model: CausalLM, context: Sequence[int]) -> None:
    """Trim the cache to the part of it that is a prefix of ``context`` (drops rejected drafts)."""
    model.trim(common_prefix_len(model.tokens, context))


def forward_after(model: CausalLM, context: Sequence[int], extra: Sequence[int] = ()) -> torch.Tensor:
    """Logits for the positions after ``context`` and after each of ``extra``: [1 + len(extra), V].

    Reuses the cached prefix of ``context`` (:func:`prefill` feeds a long uncached part), feeds the
    rest followed by ``extra`` in one forward pass. At least the last context token is always fed,
    since its logits are not cached.
    """
    keep = prefill(model, context)
    return model.forward(list(context[keep:]) + list(extra), num_logits=1 + len(extra))


def prefill(model: CausalLM, context: Sequence[int]) -> int:
    """Trim the cache to its prefix of ``context`` and return its length, the position to feed from.

    When that leaves :data:`specdec.kernels.PREFILL_ROWS` or more context tokens before the last
    one uncached (a new prompt), they are fed first, in a pass of their own under
    :func:`specdec.kernels.prefill`: their logits are never read, only their cache entries, and
    every method prefills the same tokens this way, so the faster kernels it allows change no
    method's output relative to another's.
    """
    if not context:
        raise ValueError("the context is empty: give at least one token")
    keep = min(common_prefix_len(model.tokens, context), len(context) - 1)
    model.trim(keep)
    if len(context) - 1 - keep >= kernels.PREFILL_ROWS:
        with kernels.prefill():
            model.forward(list(context[keep:-1]), num_logits=1)
        keep = len(context) - 1
    return keep
