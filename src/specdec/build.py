"""The one place that turns a :class:`~specdec.config.DecodeConfig` and loaded models into what
the decode loop runs: the target's backend, the drafter, the verifier and the policy.

:func:`build` is what :func:`specdec.generate` / :func:`specdec.stream` call, so the command line,
the benchmark and the server (which all decode through them) build every method here.
:func:`make_drafter` is the only function that builds a drafter by name; :func:`target_backend`
the only one that chooses the target's backend for a drafter.

A drafter states what it needs of the target's backend (``needs``: :data:`LAYERS`,
:data:`HIDDEN_STATES`); a backend states what it offers (``capabilities``), and a tree needs
:data:`TREES`. The build checks these once, with an error naming what is missing, before any
model work (as mlx-lm checks that every cache can be trimmed before it speculates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdec.backends.base import HIDDEN_STATES, LAYERS, TREES, CausalLM, capabilities
from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.backends.lean import make_backend
from specdec.config import AR, DecodeConfig
from specdec.datastore import open_store
from specdec.drafters import DRAFTERS, MODEL_DRAFTERS, NEEDS, CascadeDrafter, ChoiceDrafter, ModelDrafter, NGramDrafter
from specdec.drafters.base import Drafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.early_exit import EarlyExitDrafter
from specdec.drafters.heads import HeadsDrafter
from specdec.drafters.layer_skip import LayerSkipDrafter
from specdec.drafters.lookahead import LookaheadDrafter
from specdec.drafters.retrieval import RetrievalChoice, RetrievalDrafter
from specdec.drafters.tree import DEFAULT_TREE, TreeDrafter
from specdec.policies import DraftLengthPolicy, make_policy
from specdec.verify import Verifier, make_verifier


@dataclass
class Built:
    """What one generation runs. ``drafter`` None: the target decodes alone. ``tree``: the drafter
    proposes token trees (its shape in ``shape``). ``method``: what runs, as reports name it."""

    config: DecodeConfig  # resolved: the drafter named
    target: CausalLM
    drafter: Any = None
    verifier: Verifier | None = None
    policy: DraftLengthPolicy | None = None
    tree: bool = False
    method: str = "ar"

    @property
    def exact(self) -> bool:
        return self.verifier is None or self.verifier.exact


def build(config: DecodeConfig, target: Any, draft: Any = None) -> Built:
    """Build ``config`` for ``target`` (a transformers causal LM or a :class:`CausalLM`) and the
    ``draft`` model (the same, or None). Raises ``ValueError`` naming what does not fit."""
    config = config.resolve(draft is not None)  # a drafter given by name or object stays as it is
    if config.is_ar:
        if draft is not None:
            raise ValueError("drafter='none' decodes with the target alone; leave draft out")
        return Built(config, as_backend(target))
    if isinstance(config.drafter, str):
        name = config.drafter
        if name not in MODEL_DRAFTERS and draft is not None:
            raise ValueError(f"the {name} drafter uses no draft model; leave draft out")
        draft_backend = None
        if name in MODEL_DRAFTERS:
            draft_backend = as_backend(draft, config.draft_weights)
            if not config.prompt_cache:
                draft_backend.reset()
        backend = (_ready(name, target, config.prompt_cache) if is_backend(target)
                   else target_backend(name, target))
        drafter = make_drafter(name, backend, draft_backend, **(config.drafter_options or {}))
    else:
        if draft is not None:
            raise ValueError("give either a draft model or a drafter, not both")
        drafter = config.drafter
        backend = as_backend(_drafter_target(drafter, target))
    _check_vocabulary(drafter, backend)
    if config.verify == "tree":
        _require(backend, TREES, "tree verification")
        tree_drafter, shape = _tree_drafter(drafter, config.tree)
        if isinstance(tree_drafter, TreeDrafter):
            tree_drafter.bind(backend)  # a Sequoia tree measures its cost curves (or reads them from the cache)
        coupled = ":coupled" if config.gumbel else ""
        return Built(config, backend, tree_drafter, tree=True, method=f"spec:{drafter.name}:tree:{shape}{coupled}")
    verifier = make_verifier(config.chain_verifier)
    policy = config.policy
    if isinstance(policy, str):
        policy = make_policy(policy, config.k, **(config.policy_options or {}))
    policy.bind(backend, drafter)  # the planner measures its models' costs (or reads them from its cache)
    method = f"spec:{drafter.name}:{verifier.name}:{policy.name}:k={config.k}"
    if not verifier.exact:
        method += " (LOSSY)"
    return Built(config, backend, drafter, verifier, policy, method=method)


def as_backend(model: Any, weights: str = "bf16") -> CausalLM:
    """Wrap a transformers model (:func:`~specdec.backends.lean.make_backend`: the lean backend
    where it applies, else :class:`~specdec.backends.hf.HFCausalLM`; ``weights="int8"`` for draft
    models only); pass a :class:`CausalLM` through unchanged."""
    if is_backend(model):
        return model
    return make_backend(model, weights=weights)


def is_backend(model: Any) -> bool:
    """Whether ``model`` is a :class:`CausalLM` backend (not a transformers model)."""
    return not isinstance(model, torch.nn.Module) and all(
        hasattr(model, name) for name in ("forward", "trim", "tokens", "vocab_size"))


def target_backend(drafter: str, model: Any) -> CausalLM:
    """The backend of the target ``model`` that the drafter named ``drafter`` needs, with a fresh
    cache: a transformers model is wrapped with what the drafter reads (its layers, or the
    hidden states); a backend is checked for it."""
    needs = NEEDS.get(drafter, frozenset())
    if is_backend(model):
        return _ready(drafter, model)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"the {drafter} drafter needs a transformers model or a CausalLM backend as the target")
    if LAYERS in needs:
        return HFLayeredCausalLM(model)
    return make_backend(model, keep_hidden=HIDDEN_STATES in needs)


def _ready(drafter: str, backend: CausalLM, keep: bool = False) -> CausalLM:
    """A target backend checked for what the drafter needs, its cache emptied (unless ``keep``:
    the prompt cache, trimmed to the prompt by the first forward)."""
    for need in sorted(NEEDS.get(drafter, frozenset())):
        _require(backend, need, f"the {drafter} drafter")
    if not keep:
        backend.reset()
    return backend


def make_drafter(name: str, target: CausalLM, draft: CausalLM | None = None, **options: Any) -> Drafter:
    """Build a drafter by name for the target's backend ``target`` (from :func:`target_backend`).

    model: needs ``draft`` (a backend). ngram+model: needs ``draft``, options as ngram's (default
    4 and 4). ngram: options ``max_ngram`` (3), ``min_ngram`` (1). early-exit: option
    ``exit_layer`` (default: all layers but the top two). layer-skip: option ``skip`` (default: the
    set saved for this model, see :mod:`specdec.drafters.layer_skip`). heads: option ``path`` (a
    folder from ``specdec train-heads``; default: the heads shipped for this target). eagle:
    option ``path`` (a folder from ``specdec train-heads --kind eagle``; default: the shipped one).
    retrieval: options ``datastore`` (a name or path, :func:`specdec.datastore.open_store`;
    default: the process's own store) and ``min_match`` (2); retrieval+model: needs ``draft``,
    options as retrieval's and ngram's. lookahead: options ``window``, ``ngram``, ``candidates``
    (default: from the target's measured row costs). cascade: needs ``draft``, options as ngram+model's
    (the lookup offered beside the cascaded draft model, :mod:`specdec.drafters.cascade`).
    Raises ``ValueError`` for an unknown name, a missing draft model or a bad option.
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    if name not in MODEL_DRAFTERS and draft is not None:
        raise ValueError(f"the {name} drafter uses no draft model; leave the draft model out")
    if name in MODEL_DRAFTERS and draft is None:
        raise ValueError(f"the {name} drafter needs a draft model")
    try:
        if name == "model":
            if options:
                raise ValueError(f"the model drafter takes no options, got {', '.join(sorted(options))}")
            return ModelDrafter(draft)
        if name == "ngram+model":
            return ChoiceDrafter.build(ModelDrafter(draft), **options)
        if name == "cascade":
            return CascadeDrafter(draft, **options)
        if name == "ngram":
            return NGramDrafter(target.vocab_size, **options)
        if name in ("retrieval", "retrieval+model"):
            store = open_store(options.pop("datastore", None))
            if name == "retrieval+model":
                return RetrievalChoice.build(ModelDrafter(draft), store, **options)
            return RetrievalDrafter(target.vocab_size, store, **options)
        if name == "lookahead":
            return LookaheadDrafter(target, **options)
        if name == "early-exit":
            return EarlyExitDrafter(target, **options)
        if name == "layer-skip":
            return LayerSkipDrafter(target, **options)
        if name == "heads":
            return HeadsDrafter.load(target, **options)
        return EagleDrafter.load(target, **options)
    except TypeError as e:  # an option the drafter does not take
        raise ValueError(f"bad option for the {name} drafter: {e}") from None


def _require(backend: Any, capability: str, who: str) -> None:
    if capability not in capabilities(backend):
        what = {TREES: "verify token trees (attention masks over a tree)", LAYERS: "run a subset of its layers",
                HIDDEN_STATES: "keep its hidden states"}[capability]
        raise ValueError(
            f"{who} needs a target backend that can {what}, which the {type(backend).__name__} backend "
            "cannot; use a transformers target (backend 'torch'), or the model or ngram drafter")


def _drafter_target(drafter: Drafter, target: Any) -> Any:
    """The target a drafter object runs on: its own backend where it has one (it must wrap ``target``)."""
    own = getattr(drafter, "target", None)
    if own is None or own is target:
        return target
    if getattr(own, "model", None) is not target:
        raise ValueError(f"the {drafter.name} drafter runs on its own target backend; pass target=drafter.target")
    return own


def _check_vocabulary(drafter: Drafter, backend: CausalLM) -> None:
    if drafter.vocab_size != backend.vocab_size:
        raise ValueError(
            f"the draft's vocabulary ({drafter.vocab_size} logits) differs from the target's "
            f"({backend.vocab_size}); use a draft from the same model family and tokenizer"
        )


def _tree_drafter(drafter: Drafter, tree: Any) -> tuple[Any, str]:
    """(the drafter that proposes trees, a short description of the tree's shape)."""
    if isinstance(drafter, ModelDrafter):
        tree_drafter = TreeDrafter(drafter.model, **(DEFAULT_TREE if tree is None else tree))
        shape = {"static": "static", "confident": f"threshold={tree_drafter.threshold}",
                 "dynamic": f"budget={tree_drafter.budget}",
                 "sequoia": "sequoia" + (f":budget={tree_drafter.fixed_budget}" if tree_drafter.fixed_budget else "")
                 }[tree_drafter.mode]
        return tree_drafter, shape
    if isinstance(drafter, RetrievalDrafter):  # the most frequent continuations in the datastore
        tree_drafter = drafter.with_tree(**dict(tree or {}))
        return tree_drafter, f"budget={tree_drafter.budget}:depth={tree_drafter.depth}"
    if isinstance(drafter, LookaheadDrafter):  # the Jacobi window and the pool's n-grams
        return drafter, f"window={drafter.window}:ngram={drafter.ngram}:candidates={drafter.candidates}"
    if isinstance(drafter, HeadsDrafter):  # a static Medusa tree
        tree = dict(tree or {})
        if tree.pop("mode", "static") != "static" or set(tree) - {"choices"}:
            raise ValueError(f"the {drafter.name} drafter's tree is static and takes only 'choices'")
        return (drafter.with_choices(tree["choices"]) if "choices" in tree else drafter), "static"
    raise ValueError(f"tree verification needs a draft model or the heads drafter, not {drafter.name}")


__all__ = ["AR", "Built", "as_backend", "build", "is_backend", "make_drafter", "target_backend"]
