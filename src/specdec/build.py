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
from specdec.drafters import registry
from specdec.drafters.base import Drafter
from specdec.drafters.tree import TreeDrafter
from specdec.policies import DraftLengthPolicy, make_policy
from specdec.verify import Verifier, make_verifier


@dataclass
class Built:
    """What one generation runs. ``drafter`` None: the target decodes alone. ``tree``: the drafter
    proposes token trees. ``shape``: the tree's shape as the build chose it (``threshold=0.8``,
    ``window=6:ngram=4:candidates=5``; empty for a chain), which the config may leave open."""

    config: DecodeConfig  # resolved: the drafter named, a chain's verifier the one that runs (DecodeConfig.as_run)
    target: CausalLM
    drafter: Any = None
    verifier: Verifier | None = None
    policy: DraftLengthPolicy | None = None
    tree: bool = False
    shape: str = ""

    @property
    def method(self) -> str:
        """What runs, as reports name it: the config's text form (:meth:`DecodeConfig.parse` reads
        it back), lossy or not told by :attr:`exact`."""
        return str(self.config)

    @property
    def exact(self) -> bool:
        return self.verifier is None or self.verifier.exact


def build(config: DecodeConfig, target: Any, draft: Any = None, seat: Any = None) -> Built:
    """Build ``config`` for ``target`` (a transformers causal LM or a :class:`CausalLM`) and the
    ``draft`` model (the same, or None). ``seat``: the slot's seat on its pool's board where the
    target's passes are shared (:mod:`specdec.serving.board`), handed to the policy as it binds.
    Raises ``ValueError`` naming what does not fit."""
    config = config.resolve(draft is not None)  # a drafter given by name or object stays as it is
    if config.is_ar:
        if draft is not None:
            raise ValueError("drafter='none' decodes with the target alone; leave draft out")
        return Built(config, as_backend(target))
    if isinstance(config.drafter, str):
        name = config.drafter
        if not config.uses_draft_model and draft is not None:
            raise ValueError(f"the {name} drafter uses no draft model; leave draft out")
        draft_backend = None
        if config.uses_draft_model:
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
        return Built(config, backend, tree_drafter, tree=True, shape=shape)
    verifier = make_verifier(config.chain_verifier)
    policy = config.policy
    if isinstance(policy, str):
        policy = make_policy(policy, config.k, **(config.policy_options or {}))
    policy.bind(backend, drafter, seat)  # the planner measures its models' costs (or reads them from its cache)
    return Built(config.as_run, backend, drafter, verifier, policy)


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
    needs = registry.needs(drafter)
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
    for need in sorted(registry.needs(drafter)):
        _require(backend, need, f"the {drafter} drafter")
    if not keep:
        backend.reset()
    return backend


def make_drafter(name: str, target: CausalLM, draft: CausalLM | None = None, **options: Any) -> Drafter:
    """Build the drafter named ``name`` for the target's backend ``target`` (from
    :func:`target_backend`) and the draft model's backend ``draft``, as its declaration says
    (:func:`specdec.drafters.spec`: the options it takes, whether it drafts with the draft model;
    each drafter's class documents its options and their defaults).
    Raises ``ValueError`` for an unknown name, a missing or unwanted draft model or a bad option.
    """
    declared = registry.spec(name)  # an unknown name: the error names the choices
    if not declared.uses_draft_model and draft is not None:
        raise ValueError(f"the {name} drafter uses no draft model; leave the draft model out")
    if declared.uses_draft_model and draft is None:
        raise ValueError(f"the {name} drafter needs a draft model")
    try:
        return declared.create(target, draft, **options)
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
    """(the drafter that proposes trees, a short description of the tree's shape): the ``tree``
    function of the first registered drafter that proposes trees and describes ``drafter``."""
    for declared in registry.specs():
        if declared.tree is not None and declared.describes(drafter):
            return declared.tree(drafter, tree)
    trees = ", ".join(d.name for d in registry.specs() if d.tree is not None)
    raise ValueError(f"tree verification needs a drafter that proposes trees ({trees}), not {drafter.name}")


__all__ = ["AR", "Built", "as_backend", "build", "is_backend", "make_drafter", "target_backend"]
