"""The backends a model can be loaded on, by name: the one table every list of backend names reads.

A :class:`Backend` row names a backend, says how messages call it, whether it runs a GGUF file's
own quantized weights, what its models can do beyond a plain forward (token trees, a subset of
layers, hidden states, cache snapshots), whether several sequences may share its passes, what a
sequence's cache costs there, and what its output may not share with plain decoding; it names the
module that loads its models (:meth:`Backend.load`). ``auto`` is a choice, not a backend: it picks
one of these when a model loads (:func:`specdec.models.choose_backend`).

A loaded model says which row it runs on: the backends' own models declare ``backend_name``
(:func:`row_of`); any other model (a transformers model, a stand-in) runs on torch. The questions
the rest of specdec asks of a loaded model are answered here, from its row: may its passes be
shared (:func:`shares_passes`), what does its cache take (:func:`cache_bytes`), are its rows
batch-invariant (:attr:`Backend.batch_invariant`). This module imports no backend until a row
loads a model, only the names of the capabilities (:mod:`specdec.backends.base`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from specdec.backends.base import HIDDEN_STATES, LAYERS, SNAPSHOTS, TREES


@dataclass(frozen=True)
class Backend:
    """One backend: ``name`` (what ``backend=`` and ``--backend`` take), ``label`` (what messages
    call it) and ``runs_gguf`` (whether it runs a GGUF file's own quantized weights, so that a
    GGUF, a pack or a ``.gguf`` file, is the only model it takes and ``dtype`` and ``kernels`` do not
    apply to it). ``caveat``: what may differ from plain decoding on it, where its rows are not
    batch-invariant (a verification row, or a prompt row the prompt cache computed in another
    pass, may round differently from a one-token step); None where every row equals a one-token
    step's bit for bit, so greedy and seeded output is plain decoding's token for token.
    ``capabilities``: what its models can do beyond a plain forward (the names of
    :mod:`specdec.backends.base`; on torch the target is wrapped with what its drafter needs).
    ``shares_passes``: several sequences' rows may share one pass, each row computed as the
    sequence's own pass computes it (``specdec serve --parallel``); such a model tells what one
    sequence's KV cache takes at a full context (its ``cache_bytes``). ``weights``: what a model on
    it runs, as load notes say it after the weights' description (None: the dtype says it).
    ``trims_draft_head``: a draft model on it can score a subset of its vocabulary only
    (:func:`specdec.models.trim_draft`). ``module``: the module that loads a GGUF file onto it (its ``load``; None: transformers loads the
    model, :func:`specdec.models.load_model`)."""

    name: str
    label: str
    runs_gguf: bool
    caveat: str | None = None
    capabilities: frozenset[str] = frozenset()
    shares_passes: bool = False
    weights: str | None = None
    module: str | None = None
    trims_draft_head: bool = False

    @property
    def batch_invariant(self) -> bool:
        """Whether every row of a pass equals a one-token step's, bit for bit, whatever else the
        pass holds (a verification's rows, a prompt's, other sequences')."""
        return self.caveat is None

    @property
    def token_identical(self) -> bool:
        """Whether greedy and seeded speculative output is plain decoding's token for token here."""
        return self.batch_invariant

    def kernel_path(self, model: Any) -> str | None:
        """The path of specdec's kernel that ``model`` (a model on this backend) runs, as its load notes
        say it (``avx512vnni``, ``avx2``, ``portable``: :data:`specdec.backends.gguf.PATHS`); None on a
        backend that is not specdec's kernel."""
        return importlib.import_module(self.module).kernel_path(model.lib) if self.name == GGUF else None

    def available(self) -> bool:
        """Whether its models can be loaded here, as its module says (llama.cpp: whether its binding
        is installed); transformers is always there."""
        return self.module is None or importlib.import_module(self.module).available()

    def load(self, path: str | Path, *, n_threads: int | None = None, n_ctx: int | None = None,
             eos_token_ids: Sequence[int] | None = None, cache_dir: str | Path | None = None) -> Any:
        """The GGUF file ``path`` on this backend (its module's ``load``): one sequence's model on
        ``n_threads`` threads with room for ``n_ctx`` tokens (None: the backend's default), ending at
        ``eos_token_ids`` (None: the file's), with what it measures once kept under ``cache_dir``.
        Raises the backend's own errors (:mod:`specdec.models` says them to users)."""
        if self.module is None:
            raise ValueError(f"the {self.label} backend runs no GGUF file of its own: specdec.models.load_model "
                             "converts one for transformers")
        return importlib.import_module(self.module).load(path, n_threads=n_threads, n_ctx=n_ctx,
                                                         eos_token_ids=eos_token_ids, cache_dir=cache_dir)


TORCH, LLAMACPP, GGUF = "torch", "llamacpp", "gguf"
TABLE: tuple[Backend, ...] = (
    # a transformers model (a GGUF converted to bf16): specdec.backends.hf, hf_layers, lean
    Backend(TORCH, "torch", runs_gguf=False, capabilities=frozenset({TREES, LAYERS, HIDDEN_STATES})),
    Backend(LLAMACPP, "llama.cpp", runs_gguf=True, caveat=(
        "llama.cpp's rows are not batch-invariant for every file: greedy and seeded output may differ from "
        "plain decoding at near-ties, and a cached prompt may change an answer"),
        capabilities=frozenset({TREES, SNAPSHOTS}), weights="GGUF via llama.cpp", module="specdec.backends.llamacpp"),
    Backend(GGUF, "specdec's GGUF kernel", runs_gguf=True, capabilities=frozenset({TREES, SNAPSHOTS}),
            shares_passes=True, weights="GGUF on specdec kernels", module="specdec.backends.gguf",
            trims_draft_head=True),
)
AUTO = "auto"  # the choice that picks a backend per model when it loads

NAMES: tuple[str, ...] = tuple(b.name for b in TABLE)  # the backends themselves, in the table's order
CHOICES: tuple[str, ...] = (AUTO, *NAMES)  # what a model's backend may be asked as
GGUF_NAMES: tuple[str, ...] = tuple(b.name for b in TABLE if b.runs_gguf)
LABELS: dict[str, str] = {b.name: b.label for b in TABLE}
BY_NAME: dict[str, Backend] = {b.name: b for b in TABLE}


def row_of(model: Any) -> Backend:
    """The row of the backend ``model`` runs on: the one its ``backend_name`` names (the backends'
    own models declare it); torch's for a model that declares none (a transformers model)."""
    return BY_NAME[getattr(model, "backend_name", TORCH)]


def shares_passes(target: Any, draft: Any = None) -> bool:
    """Whether several sequences decoding with ``target`` (and ``draft``, None: no draft model) may
    share its passes, each row computed as the sequence's own pass computes it, so that an answer
    does not depend on its neighbours (``specdec serve --parallel``, :func:`specdec.generate_many`)."""
    return all(row_of(model).shares_passes for model in (target, draft) if model is not None)


def cache_bytes(model: Any) -> int | None:
    """Bytes of one sequence's KV cache of ``model`` at a full context, on a backend whose passes
    are shared (what each slot of ``specdec serve --parallel`` takes); None elsewhere."""
    return model.cache_bytes if row_of(model).shares_passes else None
