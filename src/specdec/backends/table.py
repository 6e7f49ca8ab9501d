"""The backends a model can be loaded on, by name: the one table every list of backend names reads.

A :class:`Backend` row names a backend, says how messages call it and whether it runs a GGUF
file's own quantized weights. ``auto`` is a choice, not a backend: it picks one of these when a
model loads (:func:`specdec.models.resolve_backend`). This module names the backends; it imports
none of them (:func:`specdec.models.load` does).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    """One backend: ``name`` (what ``backend=`` and ``--backend`` take), ``label`` (what messages
    call it) and ``runs_gguf`` (whether it runs a GGUF file's own quantized weights, so that a
    GGUF, a pack or a ``.gguf`` file, is the only model it takes and ``dtype`` and ``kernels`` do not
    apply to it)."""

    name: str
    label: str
    runs_gguf: bool


TABLE: tuple[Backend, ...] = (
    Backend("torch", "torch", runs_gguf=False),  # a transformers model (a GGUF converted to bf16)
    Backend("llamacpp", "llama.cpp", runs_gguf=True),  # specdec.backends.llamacpp
    Backend("gguf", "specdec's GGUF kernel", runs_gguf=True),  # specdec.backends.gguf
)
AUTO = "auto"  # the choice that picks a backend per model when it loads

NAMES: tuple[str, ...] = tuple(b.name for b in TABLE)  # the backends themselves, in the table's order
CHOICES: tuple[str, ...] = (AUTO, *NAMES)  # what a model's backend may be asked as
GGUF_NAMES: tuple[str, ...] = tuple(b.name for b in TABLE if b.runs_gguf)
LABELS: dict[str, str] = {b.name: b.label for b in TABLE}
