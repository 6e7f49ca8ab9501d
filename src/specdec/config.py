"""One object for every decoding option: :class:`DecodeConfig`.

:func:`specdec.stream` and :func:`specdec.generate` take one (``config=``) and/or its fields as
keyword overrides; the command line and the benchmark build the same object. A config checks
itself when it is made, so bad values fail before any model work with a ``ValueError`` (a bad
value) or ``TypeError`` (a value of the wrong kind) that names the field.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from specdec.policies import POLICIES, DraftLengthPolicy, check_k
from specdec.sampling import SamplingConfig
from specdec.verify import VERIFIERS

VERIFY = (*VERIFIERS, "tree")  # "tree": a token tree (specdec.drafters.tree, specdec.verify.tree)
DRAFT_WEIGHTS = ("bf16", "int8")  # specdec.backends.lean.WEIGHTS
TREE_OPTIONS = ("mode", "choices", "threshold", "depth", "width", "expand", "budget")
SEED_RANGE = 2**64  # torch.Generator.manual_seed takes 0 .. 2**64 - 1


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode: the method, the verifier, draft lengths, sampling and limits.

    drafter: None (a ``draft`` model if one is passed, else autoregressive), a name from
    :data:`specdec.drafters.DRAFTERS` built with ``drafter_options``, or a
    :class:`~specdec.drafters.base.Drafter`.
    draft_weights: ``int8`` (default) or ``bf16`` for a draft model (see :func:`specdec.generate`).
    verify: ``greedy``, ``token``, ``block``, ``typical`` (lossy) or ``tree``; ``tree`` holds
    :class:`~specdec.drafters.tree.TreeDrafter` options (``mode``: confident, dynamic or static).
    k: draft tokens per step with the ``static`` policy; the starting length of ``heuristic`` and
    ``theory``; ``auto`` and ``confidence`` draft up to max(k, 16) tokens.
    policy: a name from :data:`specdec.policies.POLICIES` or a
    :class:`~specdec.policies.DraftLengthPolicy`. The default, ``auto``, is the planner
    (:mod:`specdec.policies.auto`): each step it drafts the length -- 0 included -- with the most
    expected tokens per second from this machine's measured costs; ``static`` drafts k tokens
    every step. Autoregressive decoding and tree verification use no policy.
    temperature 0 means greedy; top_k 0 and top_p 1 disable those filters; seed fixes sampling.
    stop: strings that end generation (one string is one stop string). eos_token_ids: the ids that
    end generation (None: the model's and tokenizer's own).
    """

    drafter: Any = None
    drafter_options: Mapping[str, Any] | None = None
    draft_weights: str = "int8"
    verify: str = "block"
    k: int = 4
    policy: str | DraftLengthPolicy = "auto"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None
    stop: Sequence[str] = ()
    eos_token_ids: Sequence[int] | None = None
    tree: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once, here
        set_(self, "stop", _stop_strings(self.stop))
        set_(self, "eos_token_ids", _eos_ids(self.eos_token_ids))
        self._check_method()
        self._check_sampling()
        _positive_int(self.max_new_tokens, "max_new_tokens")
        if self.seed is not None:
            _integer(self.seed, "seed")
            if not 0 <= self.seed < SEED_RANGE:
                raise ValueError(f"seed must be in 0 .. 2**64 - 1, got {self.seed}")

    def _check_method(self) -> None:
        if self.drafter is not None and not isinstance(self.drafter, str) and not hasattr(self.drafter, "propose"):
            raise TypeError(f"drafter must be a drafter's name or a Drafter, got {type(self.drafter).__name__}")
        if isinstance(self.drafter, str):
            from specdec.drafters import DRAFTERS

            if self.drafter not in DRAFTERS:
                raise ValueError(f"unknown drafter {self.drafter!r}; choose one of {', '.join(DRAFTERS)}")
        if self.drafter_options is not None:
            if not isinstance(self.drafter_options, Mapping):
                raise TypeError(f"drafter_options must be a dict, got {type(self.drafter_options).__name__}")
            if self.drafter_options and not isinstance(self.drafter, str):
                raise ValueError("drafter_options go with a drafter given by name")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {self.draft_weights!r}")
        if self.verify not in VERIFY:
            raise ValueError(f"unknown verifier {self.verify!r}; choose one of {', '.join(VERIFY)}")
        check_k(self.k)
        if isinstance(self.policy, str):
            if self.policy not in POLICIES:
                raise ValueError(f"unknown draft-length policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        elif not all(hasattr(self.policy, m) for m in ("next_k", "keep_going", "update")):
            raise TypeError(f"policy must be a policy's name or a DraftLengthPolicy, got {type(self.policy).__name__}")
        if self.tree is not None:
            if not isinstance(self.tree, Mapping):
                raise TypeError(f"tree must be a dict of tree options, got {type(self.tree).__name__}")
            unknown = sorted(set(self.tree) - set(TREE_OPTIONS))
            if unknown:
                raise ValueError(f"unknown tree option {unknown[0]!r}; the tree takes {', '.join(TREE_OPTIONS)}")

    def _check_sampling(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        _integer(self.top_k, "top_k")
        SamplingConfig(float(self.temperature), self.top_k, float(self.top_p))  # the value checks
        if self.verify == "greedy" and self.temperature > 0:
            raise ValueError(
                "greedy verification reproduces greedy decoding only; with temperature > 0 "
                "use verify='token' or verify='block'"
            )

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(float(self.temperature), self.top_k, float(self.top_p))

    def replace(self, **overrides: Any) -> "DecodeConfig":
        """A copy with some fields changed (checked again). An unknown name is a ``TypeError``."""
        unknown = sorted(set(overrides) - set(FIELDS))
        if unknown:
            raise TypeError(
                f"unknown decoding option {unknown[0]!r}; the options are {', '.join(FIELDS)}"
            )
        return dataclasses.replace(self, **overrides) if overrides else self


FIELDS = tuple(f.name for f in dataclasses.fields(DecodeConfig))


def _integer(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")


def _positive_int(value: Any, name: str) -> None:
    _integer(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings; one string is one stop string, not its letters."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, (list, tuple, set, frozenset)):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError("stop strings must not be empty (an empty string would stop before the first token)")
    return tuple(stop)


def _eos_ids(ids: Any) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"eos_token_ids must be a list of token ids, got {type(ids).__name__}")
    ids = tuple(ids)
    for t in ids:
        _integer(t, "eos_token_ids")
    return tuple(int(t) for t in ids)
