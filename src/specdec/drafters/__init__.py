"""Drafters: each proposes tokens and the distributions they were drawn from.

- ``model``: a small causal LM sharing the target's vocabulary (:class:`ModelDrafter`).
- ``ngram``: prompt lookup, the continuation of the longest repeated suffix (:class:`NGramDrafter`).
- ``ngram+model``: the lookup where the context repeats itself, else a draft model, or what the
  planner picks each step (:class:`ChoiceDrafter`).
- ``early-exit``: the target's first layers, final norm and LM head (:class:`EarlyExitDrafter`).
- ``layer-skip``: the target with some layers skipped (:class:`LayerSkipDrafter`).
- ``heads``: trained heads on the target's final hidden state (:class:`HeadsDrafter`).
- ``eagle``: a trained one-layer autoregressive head on the target's features (:class:`EagleDrafter`).
- ``retrieval``: continuations found in a datastore, a chain or a tree (:class:`RetrievalDrafter`);
  ``retrieval+model``: the datastore, the n-gram lookup and a draft model, the planner choosing
  (:class:`RetrievalChoice`).
- ``lookahead``: lookahead decoding's Jacobi window and n-gram pool, a tree (:class:`LookaheadDrafter`).
- ``cascade``: a draft model whose drafting the n-gram lookup speeds up, and which the lookup
  continues where the planner stops it (cascade drafting, :class:`CascadeDrafter`).

Each drafter's module declares it once, beside its class, as a
:class:`~specdec.drafters.registry.DrafterSpec` (``SPEC``): its name, options, what it needs of
the target's backend, whether it drafts with the draft model or proposes token trees, and how
it is built. This module registers them, in the order above (:func:`names`); everything that
parses, checks or builds a method reads the registry when it runs (:func:`spec`). A new drafter
is a module with its class and its ``SPEC``, and one ``register`` line below (its module named
on the import line); a program may also :func:`register` one of its own.
"""

from __future__ import annotations

from specdec.drafters import cascade, choice, eagle, early_exit, heads, layer_skip, lookahead, model, ngram, retrieval
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.cascade import CascadeDrafter
from specdec.drafters.choice import ChoiceDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.early_exit import EarlyExitDrafter
from specdec.drafters.heads import HeadsDrafter
from specdec.drafters.layer_skip import LayerSkipDrafter
from specdec.drafters.lookahead import LookaheadDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NGramDrafter
from specdec.drafters.registry import DrafterSpec, find, names, needs, register, spec, specs, unregister
from specdec.drafters.retrieval import RetrievalChoice, RetrievalDrafter

register(model.SPEC)
register(ngram.SPEC)
register(choice.SPEC)  # ngram+model
register(early_exit.SPEC)
register(layer_skip.SPEC)
register(heads.SPEC)
register(eagle.SPEC)
register(retrieval.SPEC)
register(retrieval.CHOICE_SPEC)  # retrieval+model
register(lookahead.SPEC)
register(cascade.SPEC)

__all__ = [
    "CascadeDrafter",
    "ChoiceDrafter",
    "Draft",
    "Drafter",
    "DrafterSpec",
    "EagleDrafter",
    "EarlyExitDrafter",
    "HeadsDrafter",
    "LayerSkipDrafter",
    "LookaheadDrafter",
    "ModelDrafter",
    "NGramDrafter",
    "RetrievalChoice",
    "RetrievalDrafter",
    "find",
    "names",
    "needs",
    "register",
    "spec",
    "specs",
    "unregister",
]
