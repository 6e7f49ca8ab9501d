"""Drafting from a retrieval datastore (He et al. 2023, REST; Oliaro et al. 2024, SuffixDecoding).

The context's longest suffix found in a :class:`~specdec.datastore.Datastore` (a corpus indexed with
``specdec index``, a server's earlier outputs) is looked up, and the continuations that followed its
most recent occurrences are counted into a trie (:func:`~specdec.datastore.continuation_trie`).
As a chain (``spec:retrieval``, any chain verifier) the drafter proposes the most frequent
continuation; as a token tree (``spec:retrieval:tree``) the ``budget`` most frequent continuation
prefixes, verified together by :class:`~specdec.verify.tree.TreeVerifier`. Either way the draft
is a function of the context and the store alone, so each ``q[i]`` is a point mass (as the n-gram
lookup's, :mod:`specdec.drafters.ngram`) and a tree's children are deterministic: every verifier
keeps the target's law.

The planner weighs a retrieval draft by :func:`retrieval_confidence`: the n-gram lookup's
:func:`~specdec.drafters.ngram.lookup_confidence` of the match's length, times the share of the
occurrences that the proposed first token followed. ``retrieval+model`` (:class:`RetrievalChoice`)
offers the datastore beside the n-gram lookup in the context and the draft model, the planner
choosing each step, as it does for ``ngram+model``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from specdec.backends.base import CausalLM
from specdec.datastore import MAX_MATCH, Datastore, Match, best_path, continuation_trie, open_store, top_nodes
from specdec.drafters.base import Draft, DraftCost, Drafter, KeepGoing, draft_chain
from specdec.drafters.choice import LOOKUP_DEFAULTS, ChoiceDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import LOOKUP_OPTIONS, NGramDrafter, lookup_confidence
from specdec.drafters.registry import DrafterSpec
from specdec.options import Option, integer_from, nonempty
from specdec.sampling import SamplingConfig
from specdec.token_tree import TokenTree

DEFAULT_MIN_MATCH = 2  # a one-token match in a large corpus says little about what follows
DEFAULT_ROWS = 64  # occurrences whose continuations are counted (the most recent)
DEFAULT_BUDGET = 16  # nodes of a retrieval tree
DEFAULT_DEPTH = 8  # levels of a retrieval tree
CHAIN_DEPTH = 16  # the longest chain looked up (a draft-length policy asks for at most its k_max)


def retrieval_confidence(match: Match, first_count: int) -> float:
    """What a draft-length policy sees for a retrieval draft: :func:`lookup_confidence` of the
    match's length times the share of the counted continuations that began with the proposed
    token (``first_count`` of ``len(match.rows)``). A rank the planner calibrates to measured
    acceptance, like the lookup's."""
    return lookup_confidence(match.length) * first_count / max(len(match.rows), 1)


class RetrievalDrafter(Drafter):
    """Drafts the continuations a :class:`~specdec.datastore.Datastore` holds after the context's
    longest matching suffix (module doc). min_match: the shortest suffix that proposes; rows: the
    occurrences counted; budget, depth: a tree's nodes and levels."""

    name = "retrieval"

    def __init__(self, vocab_size: int, store: Datastore, *, min_match: int = DEFAULT_MIN_MATCH,
                 rows: int = DEFAULT_ROWS, budget: int = DEFAULT_BUDGET, depth: int = DEFAULT_DEPTH) -> None:
        for label, value, top in (("min_match", min_match, MAX_MATCH), ("rows", rows, None),
                                  ("budget", budget, None), ("depth", depth, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (top and value > top):
                bound = f" from 1 to {top}" if top else ""
                raise ValueError(f"the retrieval drafter's {label} must be a positive integer{bound}, got {value!r}")
        if not isinstance(store, Datastore):
            raise TypeError(f"the retrieval drafter needs a specdec.datastore.Datastore, got {type(store).__name__}")
        stored = store.meta.get("vocab_size")
        if isinstance(stored, int) and stored > vocab_size:
            raise ValueError(f"the datastore was tokenized with a {stored}-token vocabulary "
                             f"({store.meta.get('model')}), larger than the target's {vocab_size}; index it with "
                             "the target's tokenizer "
                             "('specdec index PATH... --model TARGET')")
        self._vocab = int(vocab_size)
        self.store = store
        self.min_match, self.rows, self.budget, self.depth = min_match, rows, budget, depth
        self._last: tuple | None = None  # (key, match, trie) of the last lookup
        self.looked_up = self.matched = 0  # lookups, and those that found a match

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def _trie(self, context: Sequence[int], depth: int):
        """(match, trie) for ``context``, looked up once per context and store state."""
        key = (len(context), tuple(context[-MAX_MATCH:]), len(self.store), self.store.documents, depth)
        if self._last is None or self._last[0] != key:
            self.looked_up += 1
            match = self.store.lookup(context, depth, rows=self.rows, min_match=self.min_match)
            nodes = continuation_trie(match.rows) if match is not None else []
            self.matched += bool(nodes)
            self._last = (key, match, nodes)
        return self._last[1], self._last[2]

    def confidence(self, context: Sequence[int]) -> float | None:
        """:func:`retrieval_confidence` of the draft after ``context`` (None: nothing to propose)."""
        match, nodes = self._trie(context, CHAIN_DEPTH)
        if not nodes:
            return None
        return retrieval_confidence(match, max(n.count for n in nodes if n.parent < 0))

    def sources(self, context: Sequence[int]) -> dict[str, float | None]:
        return {self.name: self.confidence(context)}

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        keep_going: KeepGoing | None = None,
        source: str | None = None,
    ) -> Draft:
        """The most frequent continuation, at most ``k`` tokens (point masses)."""
        if k <= 0:
            return Draft.empty(self._vocab)
        match, nodes = self._trie(context, CHAIN_DEPTH)
        path = best_path(nodes)[:k]
        if not path:
            return Draft.empty(self._vocab)
        if keep_going is not None:  # every token is asked about with the match's confidence
            sure = torch.tensor([retrieval_confidence(match, max(n.count for n in nodes if n.parent < 0))])
            ask = keep_going

            def keep_going(_point_mass: torch.Tensor) -> bool:
                return ask(sure)

        proposed = iter(path)
        return draft_chain(lambda _previous: next(proposed), len(path), sampling, generator, keep_going,
                           self._vocab, len(context))

    def propose_tree(self, context: Sequence[int], sampling: SamplingConfig, max_depth: int,
                     generator: torch.Generator | None = None) -> TokenTree:
        """The ``budget`` most frequent continuation prefixes, at most ``min(depth, max_depth)``
        levels: a tree with deterministic children (``q`` None) whatever the sampling."""
        depth = min(self.depth, max_depth)
        if depth <= 0:
            return TokenTree([], [])
        _, nodes = self._trie(context, self.depth)
        tokens, parents = top_nodes(nodes, self.budget, depth)
        return TokenTree(tokens, parents)

    def observe(self, context: Sequence[int]) -> None:
        """Nothing: the store does not change during a generation (a server adds outputs after it)."""

    def with_tree(self, budget: int | None = None, depth: int | None = None) -> "RetrievalDrafter":
        """This drafter with a tree's shape set (``budget`` nodes, ``depth`` levels)."""
        return RetrievalDrafter(self._vocab, self.store, min_match=self.min_match, rows=self.rows,
                                budget=self.budget if budget is None else budget,
                                depth=self.depth if depth is None else depth)

    def describe(self) -> dict:
        return {"name": self.name, "store_tokens": len(self.store), "min_match": self.min_match,
                "rows": self.rows, "lookups": self.looked_up, "matched": self.matched}


class RetrievalChoice(ChoiceDrafter):
    """Three sources, the planner choosing each step: the n-gram lookup in the context, the
    datastore (:class:`RetrievalDrafter`) and the draft model. Each offers itself where it can
    draft; those with a foreseen confidence come first, the surer first."""

    name = "retrieval+model"

    def __init__(self, lookup: NGramDrafter, retrieval: RetrievalDrafter, model: Drafter) -> None:
        super().__init__(lookup, model)
        if retrieval.vocab_size != model.vocab_size:
            raise ValueError(f"the retrieval drafter's vocabulary ({retrieval.vocab_size}) differs from the draft "
                             f"model's ({model.vocab_size})")
        self.choices = {"ngram": lookup, "retrieval": retrieval, "model": model}
        self.used = {name: 0 for name in self.choices}

    @classmethod
    def build(cls, model: Drafter, store: Datastore | None = None, *, min_match: int = DEFAULT_MIN_MATCH,
              **lookup_options: int) -> "RetrievalChoice":
        """The draft model's drafter, a retrieval drafter over ``store`` and an n-gram lookup with
        :data:`~specdec.drafters.choice.LOOKUP_DEFAULTS` updated by ``lookup_options``."""
        options = {**LOOKUP_DEFAULTS, **lookup_options}
        if "min_ngram" not in lookup_options:
            options["min_ngram"] = min(options["min_ngram"], options["max_ngram"])
        try:
            lookup = NGramDrafter(model.vocab_size, **options)
        except TypeError as e:
            raise ValueError(f"bad option for the retrieval+model drafter: {e}") from None
        return cls(lookup, RetrievalDrafter(model.vocab_size, store if store is not None else Datastore(),
                                            min_match=min_match), model)

    def sources(self, context: Sequence[int]) -> dict[str, float | None]:
        known = {name: self.choices[name].confidence(context) for name in ("ngram", "retrieval")}
        ranked = sorted((name for name, sure in known.items() if sure is not None), key=lambda n: -known[n])
        return {**{name: known[name] for name in ranked}, "model": None}

    def costs(self) -> dict[str, DraftCost]:
        return {name: next(iter(drafter.costs().values())) for name, drafter in self.choices.items()}

    def describe(self) -> dict:
        return {"name": self.name, "ngram": self.choices["ngram"].describe(),
                "retrieval": self.choices["retrieval"].describe(), "used": dict(self.used)}


def _create(target: Any, draft: None, *, datastore: str | None = None, **options: Any) -> RetrievalDrafter:
    """``datastore``: a store's name or path (:func:`~specdec.datastore.open_store`; None: the
    process's own store)."""
    return RetrievalDrafter(target.vocab_size, open_store(datastore), **options)


def _tree(drafter: RetrievalDrafter, tree: Mapping[str, Any] | None) -> tuple[RetrievalDrafter, str]:
    """The most frequent continuations in the datastore, ``budget`` nodes over ``depth`` levels."""
    tree_drafter = drafter.with_tree(**dict(tree or {}))
    return tree_drafter, f"budget={tree_drafter.budget}:depth={tree_drafter.depth}"


def _create_choice(target: Any, draft: CausalLM, *, datastore: str | None = None, **options: Any) -> RetrievalChoice:
    return RetrievalChoice.build(ModelDrafter(draft), open_store(datastore), **options)


DATASTORE = Option("drafter", "datastore", nonempty, "a datastore's name or a .npz file", None,
                   "--drafter retrieval or retrieval+model: the datastore searched, a name given to 'specdec index' "
                   "or a path (default: this process's own store, which 'specdec serve' fills with its outputs)",
                   "--datastore")
MIN_MATCH = Option("drafter", "min_match", integer_from(1, MAX_MATCH + 1), f"an integer from 1 to {MAX_MATCH}", None,
                   "--drafter retrieval or retrieval+model: the shortest context suffix matched in the datastore "
                   "(default: 2)", "--min-match")

# Its own trees: the most frequent continuations, shaped by the tree options budget and depth.
SPEC = DrafterSpec(name="retrieval", create=_create, options=(DATASTORE, MIN_MATCH), trees="also", tree=_tree,
                   cls=RetrievalDrafter, tree_keys=("budget", "depth"))
CHOICE_SPEC = DrafterSpec(name="retrieval+model", create=_create_choice,
                          options=(DATASTORE, MIN_MATCH, *LOOKUP_OPTIONS), uses_draft_model=True)
