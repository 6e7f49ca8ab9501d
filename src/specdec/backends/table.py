"""The backends a model can be loaded on, by name: the one table every list of backend names reads.

A :class:`Backend` row names a backend, says how messages call it, whether it runs a GGUF file's
own quantized weights, what its models can do beyond a plain forward (token trees, a subset of
layers, hidden states, cache snapshots), whether several sequences may share its passes, and what
its output may not share with plain decoding. ``auto`` is a choice, not a backend: it picks one of
these when a model loads (:func:`specdec.models.choose_backend`). This module names the
backends; it imports none of them (:func:`specdec.models.load_model` does), only the names of the
capabilities (:mod:`specdec.backends.base`).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    sequence's own pass computes it (``specdec serve --parallel``). ``weights``: what a model on it
    runs, as load notes say it after the weights' description (None: the dtype says it)."""

    name: str
    label: str
    runs_gguf: bool
    caveat: str | None = None
    capabilities: frozenset[str] = frozenset()
    shares_passes: bool = False
    weights: str | None = None

    @property
    def token_identical(self) -> bool:
        """Whether greedy and seeded speculative output is plain decoding's token for token here."""
        return self.caveat is None


TORCH, LLAMACPP, GGUF = "torch", "llamacpp", "gguf"
TABLE: tuple[Backend, ...] = (
    # a transformers model (a GGUF converted to bf16): specdec.backends.hf, hf_layers, lean
    Backend(TORCH, "torch", runs_gguf=False, capabilities=frozenset({TREES, LAYERS, HIDDEN_STATES})),
    Backend(LLAMACPP, "llama.cpp", runs_gguf=True, caveat=(
        "llama.cpp's rows are not batch-invariant for every file: greedy and seeded output may differ from "
        "plain decoding at near-ties, and a cached prompt may change an answer"),
        capabilities=frozenset({TREES, SNAPSHOTS}), weights="GGUF via llama.cpp"),  # specdec.backends.llamacpp
    Backend(GGUF, "specdec's GGUF kernel", runs_gguf=True, capabilities=frozenset({TREES, SNAPSHOTS}),
            shares_passes=True, weights="GGUF on specdec kernels"),  # specdec.backends.gguf
)
AUTO = "auto"  # the choice that picks a backend per model when it loads

NAMES: tuple[str, ...] = tuple(b.name for b in TABLE)  # the backends themselves, in the table's order
CHOICES: tuple[str, ...] = (AUTO, *NAMES)  # what a model's backend may be asked as
GGUF_NAMES: tuple[str, ...] = tuple(b.name for b in TABLE if b.runs_gguf)
LABELS: dict[str, str] = {b.name: b.label for b in TABLE}
BY_NAME: dict[str, Backend] = {b.name: b for b in TABLE}
