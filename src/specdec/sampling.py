"""Sampling: pure functions from logits to the probabilities a token is drawn from.

The same :class:`SamplingConfig` turns the target's logits into ``p`` and the draft's logits into
``q`` (see :mod:`specdec.verify` for the notation). Verification is exact only if ``q`` is exactly
the distribution the draft sampled from, so drafters must sample through :func:`sample` from the
probabilities returned by :func:`logits_to_probs`, never from raw logits.

Greedy decoding (temperature 0) is represented as a one-hot distribution on the argmax, so every
verifier handles it without a special case.

Two samplers draw a token from that distribution. The default draws by inversion with a
``torch.Generator``. The *Gumbel-max* sampler (``SamplingConfig.gumbel_seed``) takes
argmax_v(log p(v) + G_{t,v}), where the Gumbel noise G_{t,v} of token v at absolute position t is
a function of (seed, t, v) alone (:func:`gumbel_noise`): every token a generation draws is then a
fixed function of the target's logits and the seed, which is what lets coupled verification
(:mod:`specdec.verify.coupled`) reproduce plain decoding token for token, whatever the drafter.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from specdec import kernels


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1.0`` disable those filters.
    ``gumbel_seed``: None draws by inversion with the caller's generator (:func:`sample`); an
    integer in [0, 2**64) draws every token by Gumbel-max with that seed's noise (:func:`gumbel_max`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    gumbel_seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise ValueError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        seed = self.gumbel_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
            raise ValueError(f"gumbel_seed must be None or an integer in [0, 2**64), got {seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        """Tokens are drawn by Gumbel-max with public noise (greedy decoding needs none)."""
        return self.gumbel_seed is not None and not self.greedy


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Return the sampling distribution for each row of ``logits``.

    logits: [..., V] (any float dtype). Returns [..., V] in float32 (float64 if given float64),
    each row summing to 1.
    Ties under greedy go to the lowest token id (``torch.argmax``), deterministically.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if config.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, argmax(logits).unsqueeze(-1), 1.0)
        return probs
    return torch.softmax(filtered_logits(logits, config), dim=-1)


def filtered_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """``logits / temperature`` with ``-inf`` outside the top-k / top-p support ([..., V], float32
    or float64): the log-probabilities of :func:`logits_to_probs` up to a constant per row.
    ``config`` must not be greedy."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = logits / config.temperature
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [..., V]
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        drop_sorted = mass_before >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from ``probs`` ([V], non-negative, need not be normalised).

    By inversion: one uniform draw against the float64 cumulative sum, so token i is drawn with
    probability probs[i] / sum(probs) (to float64 rounding) and a zero-probability token, whose
    interval is empty, never. About 5x faster than ``torch.multinomial`` on a 150k vocabulary,
    which costs milliseconds per call: several calls a step.
    """
    # In place on the fresh float64 copy: the same sums as torch.cumsum(x, 0), which on a freshly
    # converted tensor of 150k entries took 1.4 ms here against 0.2 ms in place.
    cdf = probs.to(torch.float64, copy=True).cumsum_(0)  # [V]
    total = cdf[-1]
    if not total > 0:
        raise ValueError("cannot sample from a distribution with no positive mass")
    u = torch.rand((), dtype=torch.float64, generator=generator) * total
    i = int(torch.searchsorted(cdf, u, right=True))  # the first i with cdf[i] > u
    if i >= cdf.shape[0]:  # u rounded up to the total: take the last token with mass
        i = int(torch.nonzero(probs > 0)[-1])
    return i


def next_token(
    logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None, position: int | None = None
) -> int:
    """Draw the token after one row of ``logits`` ([V]) under ``config``: what
    ``sample(logits_to_probs(logits, config), generator)`` draws, with greedy decoding by one
    argmax (no one-hot row, no cumulative sum, no uniform drawn). A plain decoding step costs one
    target pass and this; the autoregressive loop and the speculative loop's plain steps share it,
    so a seeded run that never drafts reproduces ``ar`` draw for draw.
    Under the Gumbel-max sampler the token is :func:`gumbel_token` at ``position``, the absolute
    position the token will have in the sequence (the context's length), and ``generator`` is unused.
    """
    if config.greedy:
        return int(argmax(logits))
    if config.gumbel_seed is not None:
        if position is None:
            raise ValueError("the Gumbel-max sampler needs the token's position")
        return gumbel_token(logits, config, position)
    return sample(logits_to_probs(logits, config), generator)


# ------------------------------------------------------------------------------------------------
# The Gumbel-max sampler: public noise keyed by (seed, position, token)
#
# Written here rather than taken from numpy.random: the noise of one token must be computable
# without the others' (a top-k support needs k values, not 152k), so the generator is
# counter-based: SplitMix64's output function (Steele, Lea and Flood 2014) applied to a counter
# made of the token id and a key mixed from the seed and the position. The largest keys of a
# 152k vocabulary are found without computing every token's noise (the candidate filter below);
# where every token's noise is needed it is computed once a position and cached, so the draft,
# the verifier and later steps that reach the same position read the same values.

_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio in 64 bits)
_MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    """SplitMix64's output function on one 64-bit integer (a bijection)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray) -> np.ndarray:
    """:func:`_mix` on a uint64 array, in place (uint64 arithmetic wraps)."""
    tmp = np.empty_like(z)
    np.right_shift(z, np.uint64(30), out=tmp)
    z ^= tmp
    z *= np.uint64(0xBF58476D1CE4E5B9)
    np.right_shift(z, np.uint64(27), out=tmp)
    z ^= tmp
    z *= np.uint64(0x94D049BB133111EB)
    np.right_shift(z, np.uint64(31), out=tmp)
    z ^= tmp
    return z


def gumbel_noise(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """log E for the tokens ``ids`` (int array [n]) at ``position`` under ``seed``: float64 [n], where
    E = -log U is a standard exponential and U a uniform in (0, 1) with 53 random bits. The Gumbel
    noise is G = -log E; each value depends on (seed, position, id) alone, and values of different
    triples are independent as far as SplitMix64's output is."""
    counters = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
    counters *= np.uint64(_GAMMA)
    return _noise(seed, position, counters)


def _key(seed: int, position: int) -> int:
    """The 64-bit key of ``position``'s noise under ``seed``, added to every token's counter."""
    return _mix((_mix(seed ^ 0x5EED5EED5EED5EED) + (position + 1) * _GAMMA) & _MASK)


def _noise(seed: int, position: int, counters: np.ndarray) -> np.ndarray:
    """:func:`gumbel_noise` from the tokens' counters ((id + 1) * gamma, uint64 [n])."""
    z = np.add(counters, np.uint64(_key(seed, position)))
    _mix_array(z)
    z >>= np.uint64(11)  # 53 bits
    u = z.astype(np.float64)
    u += 0.5
    u *= 2.0**-53  # U in (0, 1): never 0 or 1
    np.log(u, out=u)
    np.negative(u, out=u)  # E = -log U > 0
    return np.log(u, out=u)


@functools.lru_cache(maxsize=4)
def _vocabulary_counters(vocab: int) -> np.ndarray:
    counters = np.arange(1, vocab + 1, dtype=np.uint64)
    counters *= np.uint64(_GAMMA)
    counters.flags.writeable = False
    return counters


@functools.lru_cache(maxsize=40)
def _vocabulary_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """:func:`gumbel_noise` for every token id below ``vocab`` (read-only, [vocab]). Cached: a step
    reads the positions it drafts and verifies up to three times (draft, verify, the next step's
    draft of a position it did not keep); 40 positions of a 152k vocabulary hold 49 MB."""
    noise = _noise(seed, position, _vocabulary_counters(vocab))
    noise.flags.writeable = False
    return noise


def gumbel_max(scores: torch.Tensor | np.ndarray, seed: int, position: int, count: int = 1) -> list[int]:
    """The ``count`` tokens with the largest ``scores[v] + G_{position, v}`` among those with a finite
    score, largest first ([V] scores: log-probabilities up to a constant, ``-inf`` outside the
    support). One token is a draw from softmax(scores) (Gumbel 1954; the Gumbel-max trick); the first
    ``count`` are draws without replacement (Gumbel-top-k; Kool, van Hoof and Welling 2019).
    Fewer if the support is smaller."""
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().to("cpu", torch.float64).numpy()
    else:
        scores = np.asarray(scores, dtype=np.float64)
    vocab = scores.shape[-1]
    finite = np.isfinite(scores)
    support = int(np.count_nonzero(finite))
    if support == 0:
        raise ValueError("cannot sample from a distribution with no positive mass")
    count = min(count, support)
    if count <= 0:  # a tree node with no room for children asks for none
        return []
    if support * 8 <= vocab:  # a top-k / top-p support: noise for its tokens only
        ids = np.flatnonzero(finite)
    else:
        ids = _candidates(scores, seed, position, count)
    if ids is not None:
        keys = scores[ids] - gumbel_noise(seed, position, ids)
    else:
        keys = scores - _vocabulary_noise(seed, position, vocab)  # -inf stays -inf
    if count == 1:
        best = [int(np.argmax(keys))]
    else:
        top = np.argpartition(-keys, count - 1)[:count]
        best = top[np.argsort(-keys[top], kind="stable")].tolist()
    return best if ids is None else [int(ids[i]) for i in best]


# The candidate filter (csrc/gumbel.c) for large supports: the first keys are computed for the
# tokens within FIRST_WINDOW of the best score; the count-th best of them is the bar every other
# token's key must reach, and the filter lists, from integer arithmetic alone, every token whose
# key can (and a few more). Their exact keys then decide, as the whole vocabulary's would: the same
# float64 operations on the same values, ties to the lowest id. On a 152k vocabulary it replaces
# two logarithms a token by a hash and a comparison.
FILTER_FROM = 4096  # vocabularies smaller than this compute every key
FIRST_WINDOW = 4.0
FILTER_MARGIN = 1e-6  # slack on a token's bound for float rounding (keys are O(10), rounding O(1e-14))
FILTER_CAP = 4096  # more candidates than this (a near-flat distribution): every key is computed


@functools.lru_cache(maxsize=1)
def _filter() -> ctypes.CDLL | None:
    """The compiled candidate filter, or None where it cannot be built (no C compiler): the
    sampler then computes every key, with the same results."""
    try:
        return kernels.build_library("gumbel.c", ["-O2", "-ffp-contract=off", "-shared", "-fPIC"], name="gumbel",
                                     interface="gumbel_interface")
    except RuntimeError:
        return None


def _candidates(scores: np.ndarray, seed: int, position: int, count: int) -> np.ndarray | None:
    """Token ids ([m], ascending) among which the ``count`` largest keys of the whole vocabulary
    lie (see above), or None: compute every key."""
    vocab = scores.shape[-1]
    lib = _filter() if vocab >= FILTER_FROM else None
    if lib is None:
        return None
    first = np.flatnonzero(scores >= np.max(scores) - FIRST_WINDOW)
    if first.shape[0] < count:
        return None
    first_keys = scores[first] - gumbel_noise(seed, position, first)
    bar = float(np.partition(first_keys, first_keys.shape[0] - count)[first_keys.shape[0] - count])  # count-th best
    scores = np.ascontiguousarray(scores, dtype=np.float64)
    out = np.empty(FILTER_CAP, dtype=np.int64)
    found = lib.gumbel_candidates(scores.ctypes.data, vocab, _key(seed, position), bar, FILTER_MARGIN,
                                  out.ctypes.data, FILTER_CAP)
    return None if found < 0 else out[:found]


def gumbel_token(logits: torch.Tensor, config: SamplingConfig, position: int) -> int:
    """The Gumbel-max sampler's token after one row of ``logits`` ([V]) at ``position``: a draw from
    ``logits_to_probs(logits, config)`` that is a fixed function of the logits, the seed and the
    position (greedy decoding: the argmax)."""
    if config.greedy:
        return int(argmax(logits))
    if config.gumbel_seed is None:
        raise ValueError("gumbel_token needs a SamplingConfig with a gumbel_seed")
    return gumbel_max(filtered_logits(logits, config), config.gumbel_seed, position)[0]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` ([...] int64; ties to the lowest index, as torch's). On CPU float
    tensors through numpy: over a 150k vocabulary torch's CPU argmax took 0.25 ms a row here and
    numpy's 0.012 ms, once or more every step of every decoding loop."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return torch.from_numpy(np.asarray(logits.numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)
