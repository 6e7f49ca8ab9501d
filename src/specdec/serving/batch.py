"""Several prompts at once from a program: :func:`generate_many`, a thin caller of the serving engine."""

from __future__ import annotations

import numbers
from typing import Any, Iterable, Sequence

from specdec.api import GenerationResult, _check_model, _config
from specdec.backends.table import shares_passes
from specdec.config import DecodeConfig
from specdec.constraints import Constraints
from specdec.models import Pair
from specdec.serving.engine import Engine, Work


def generate_many(
    target: Any,
    prompts: Sequence[str | Sequence[int]],
    *,
    draft: Any = None,
    tokenizer: Any = None,
    configs: Sequence[DecodeConfig | None] | None = None,
    constraints: Sequence[Constraints | None] | None = None,
    logprobs: int | None = None,
    **overrides: Any,
) -> list[GenerationResult]:
    """:func:`~specdec.api.generate` for several prompts at once: on specdec's GGUF kernel their forward passes
    share each pass of the weights (:mod:`specdec.backends.shared`: one slot, a cache of the target
    and of the draft, per prompt), so that n prompts take far less than n times one prompt's time.
    Each result is the one :func:`~specdec.api.generate` gives the prompt alone, token for token (greedy, and
    under the Gumbel-max sampler with a seed). ``prompts``: a list of prompts (each text or token
    ids). ``configs`` and ``constraints``: lists, one entry per prompt (or None); ``overrides``
    apply to every prompt; ``draft`` serves the prompts whose method drafts with it (the others
    decode as :func:`~specdec.api.generate` does without a draft), on every backend alike. On another backend
    the prompts run one after another. Bad input raises ``ValueError`` or ``TypeError`` naming the
    argument, before any prompt is decoded."""
    prompts = _listed(prompts, "prompts", "prompts (each text or token ids)")
    configs = _listed(configs, "configs", "specdec.DecodeConfig (or None), one per prompt", len(prompts))
    constraints = _listed(constraints, "constraints", "specdec.Constraints (or None), one per prompt", len(prompts))
    configs = [_config(c, overrides, f"configs[{i}]") for i, c in enumerate(configs)]
    if draft is not None:
        _check_model(draft, "draft")
    # one slot per prompt where the models share passes (one prompt too); else one prompt after another
    sharing = shares_passes(target, draft)
    engine = Engine(Pair(target, tokenizer, draft), parallel=max(1, len(prompts)) if sharing else 1,
                    prompt_cache_bytes=None, slots=sharing)
    return engine.run([Work(p, c, k, logprobs) for p, c, k in zip(prompts, configs, constraints)])


def _listed(values: Any, name: str, each: str, count: int | None = None) -> list[Any]:
    """:func:`generate_many`'s list argument ``name`` as a list: ``prompts`` (``count`` None), or
    one entry per prompt (None: one None each). A ``TypeError`` for a single value where a list of
    them belongs (a string is one prompt, not a list of one-character prompts), a ``ValueError`` for
    a list of the wrong length."""
    if values is None and count is not None:
        return [None] * count
    if isinstance(values, (str, bytes, bytearray, DecodeConfig, Constraints)) or not isinstance(values, Iterable):
        got = f"the str {values!r}" if isinstance(values, str) else type(values).__name__
        remedy = ("pass [prompt] for one prompt" if count is None
                  else f"pass [{name[:-1]}] * len(prompts) to use one for every prompt")
        raise TypeError(f"{name} must be a list of {each}, got {got}; {remedy}")
    listed = list(values)
    if count is None and listed and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in listed):
        raise TypeError(f"{name} must be a list of prompts, got a list of {len(listed)} integers; "
                        "pass [ids] for one prompt of token ids")
    if count is not None and len(listed) != count:
        raise ValueError(f"{name} needs one entry per prompt ({count}), got {len(listed)}")
    return listed
