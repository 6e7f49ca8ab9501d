"""Drafters: each proposes tokens and the distributions they were drawn from.

- ``model``: a small causal LM sharing the target's vocabulary (:class:`ModelDrafter`).
- ``ngram``: prompt lookup, the continuation of the longest repeated suffix (:class:`NGramDrafter`).
- ``ngram+model``: the lookup where the context repeats itself, else a draft model, or what the
  planner picks each step (:class:`ChoiceDrafter`).
- ``early-exit``: the target's first layers, final norm and LM head (:class:`EarlyExitDrafter`).
- ``layer-skip``: the target with some layers skipped (:class:`LayerSkipDrafter`).
- ``heads``: trained heads on the target's final hidden state (:class:`HeadsDrafter`).
- ``eagle``: a trained one-layer autoregressive head on the target's features (:class:`EagleDrafter`).

``early-exit`` and ``layer-skip`` run inside the target and need it wrapped as
:class:`~specdec.backends.hf_layers.HFLayeredCausalLM` (see :data:`LAYERED_DRAFTERS`); ``heads``
and ``eagle`` read the target's hidden states and need ``make_backend(model, keep_hidden=True)``.
:func:`target_backend` builds the backend a drafter needs.
"""

from __future__ import annotations

from typing import Any

from specdec.drafters.base import Draft, Drafter
from specdec.drafters.choice import ChoiceDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.early_exit import EarlyExitDrafter
from specdec.drafters.heads import HeadsDrafter
from specdec.drafters.layer_skip import LayerSkipDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NGramDrafter

DRAFTERS = ("model", "ngram", "ngram+model", "early-exit", "layer-skip", "heads", "eagle")
MODEL_DRAFTERS = ("model", "ngram+model")  # these draft with a draft model
DEFAULT_DRAFTER = "ngram+model"  # the command line's and the server's, where a draft model is given
FEATURE_DRAFTERS = ("heads", "eagle")  # these read the target's hidden states
LAYERED_DRAFTERS = ("early-exit", "layer-skip")  # these need an HFLayeredCausalLM target


def target_backend(drafter: str, model: Any) -> Any:
    """The backend of the target ``model`` that drafter ``drafter`` needs (fresh cache)."""
    from specdec.backends.hf_layers import HFLayeredCausalLM
    from specdec.backends.lean import make_backend

    if all(hasattr(model, name) for name in ("forward", "trim", "tokens", "vocab_size")):  # a CausalLM backend
        if drafter in LAYERED_DRAFTERS or drafter in FEATURE_DRAFTERS:
            raise ValueError(
                f"the {drafter} drafter reads the target's layers or hidden states, which the "
                f"{type(model).__name__} backend does not expose; use a transformers target (backend 'torch') "
                "or the model or ngram drafter"
            )
        model.reset()
        return model
    if drafter in LAYERED_DRAFTERS:
        return HFLayeredCausalLM(model)
    return make_backend(model, keep_hidden=drafter in FEATURE_DRAFTERS)


def make_drafter(name: str, target_backend: Any, draft_backend: Any = None, **options: Any) -> Drafter:
    """Build a drafter by name for ``target_backend`` (a :class:`~specdec.backends.base.CausalLM`).

    model: needs ``draft_backend``. ngram+model: needs ``draft_backend``, options as ngram's (default 4 and 4). ngram: options ``max_ngram`` (3), ``min_ngram`` (1).
    early-exit: option ``exit_layer`` (default: all layers but the top two). layer-skip: option ``skip``
    (default: the set saved for this model, see :mod:`specdec.drafters.layer_skip`). heads: option
    ``path`` (a folder from ``specdec train-heads``; default: the heads shipped for this target).
    eagle: option ``path`` (a folder from ``specdec train-heads --kind eagle``; default: the shipped one).
    Build ``target_backend`` with :func:`target_backend`.
    Raises ``ValueError`` for an unknown name, a missing draft model or a bad option.
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    if name not in MODEL_DRAFTERS and draft_backend is not None:
        raise ValueError(f"the {name} drafter uses no draft model; leave the draft model out")
    try:
        if name == "model":
            if draft_backend is None:
                raise ValueError("the model drafter needs a draft model")
            _no_options(name, options)
            return ModelDrafter(draft_backend)
        if name == "ngram+model":
            if draft_backend is None:
                raise ValueError("the ngram+model drafter needs a draft model")
            return ChoiceDrafter.build(ModelDrafter(draft_backend), **options)
        if name == "ngram":
            return NGramDrafter(target_backend.vocab_size, **options)
        if name == "early-exit":
            return EarlyExitDrafter(target_backend, **options)
        if name == "heads":
            from specdec.heads import load_heads_for

            return HeadsDrafter(target_backend, load_heads_for(target_backend.model, **options))
        if name == "eagle":
            from specdec.heads.eagle import load_eagle_for

            return EagleDrafter(target_backend, load_eagle_for(target_backend.model, **options))
        return LayerSkipDrafter(target_backend, **options)
    except TypeError as e:  # an option the drafter does not take
        raise ValueError(f"bad option for the {name} drafter: {e}") from None


def _no_options(name: str, options: dict[str, Any]) -> None:
    if options:
        raise ValueError(f"the {name} drafter takes no options, got {', '.join(sorted(options))}")


__all__ = [
    "DEFAULT_DRAFTER",
    "DRAFTERS",
    "MODEL_DRAFTERS",
    "ChoiceDrafter",
    "FEATURE_DRAFTERS",
    "LAYERED_DRAFTERS",
    "Draft",
    "Drafter",
    "EagleDrafter",
    "EarlyExitDrafter",
    "HeadsDrafter",
    "LayerSkipDrafter",
    "ModelDrafter",
    "NGramDrafter",
    "make_drafter",
    "target_backend",
]
