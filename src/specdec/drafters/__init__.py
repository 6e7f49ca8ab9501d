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
- ``cascade``: a draft model whose drafting the n-gram lookup speeds up, and which the lookup
  continues where the planner stops it (cascade drafting, :class:`CascadeDrafter`).
- ``lookahead``: lookahead decoding's Jacobi window and n-gram pool, a tree (:class:`LookaheadDrafter`).

The registries below say what each drafter takes (:data:`DRAFTER_OPTIONS`) and needs of the
target's backend (:data:`NEEDS`); :func:`specdec.build.make_drafter` builds one by name.
"""

from __future__ import annotations

from specdec.backends.base import HIDDEN_STATES, LAYERS
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
from specdec.drafters.retrieval import RetrievalChoice, RetrievalDrafter

DRAFTERS = ("model", "ngram", "ngram+model", "early-exit", "layer-skip", "heads", "eagle", "retrieval",
            "retrieval+model", "lookahead", "cascade")
MODEL_DRAFTERS = ("model", "ngram+model", "retrieval+model", "cascade")  # these draft with a draft model
TREE_ONLY_DRAFTERS = ("lookahead",)  # these draft token trees only (verify="tree")
# The options each drafter takes (their keyword arguments in specdec.build.make_drafter).
DRAFTER_OPTIONS: dict[str, tuple[str, ...]] = {
    "model": (), "ngram": ("max_ngram", "min_ngram"), "ngram+model": ("max_ngram", "min_ngram"),
    "early-exit": ("exit_layer",), "layer-skip": ("skip",), "heads": ("path",), "eagle": ("path",),
    "retrieval": ("datastore", "min_match"), "retrieval+model": ("datastore", "min_match", "max_ngram", "min_ngram"),
    "lookahead": ("window", "ngram", "candidates"), "cascade": ("max_ngram", "min_ngram"),
}
# What each drafter reads of the target's backend beyond its logits (its capabilities).
NEEDS: dict[str, frozenset[str]] = {
    "early-exit": frozenset({LAYERS}), "layer-skip": frozenset({LAYERS}),
    "heads": frozenset({HIDDEN_STATES}), "eagle": frozenset({HIDDEN_STATES}),
}

__all__ = [
    "DRAFTERS",
    "DRAFTER_OPTIONS",
    "MODEL_DRAFTERS",
    "NEEDS",
    "CascadeDrafter",
    "ChoiceDrafter",
    "Draft",
    "Drafter",
    "EagleDrafter",
    "EarlyExitDrafter",
    "HeadsDrafter",
    "LayerSkipDrafter",
    "LookaheadDrafter",
    "ModelDrafter",
    "NGramDrafter",
    "RetrievalChoice",
    "RetrievalDrafter",
    "TREE_ONLY_DRAFTERS",
]
