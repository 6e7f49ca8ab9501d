"""specdec: exact speculative decoding for GGUF files and Hugging Face causal language models.

Notation (kept everywhere): ``p`` is the target's distribution, ``q`` the draft's. See
:mod:`specdec.verify`.

Importing specdec changes nothing in the process. Programs that decode many tokens may call
:func:`specdec.memory.keep_freed_memory` once (the command line and the benchmark do): glibc then
keeps freed memory for reuse, which makes every step's vocabulary-sized tensors cheaper.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.api import GenerationResult, StreamEvent, generate, stream
    from specdec.config import DecodeConfig
    from specdec.constraints import ConstraintError, Constraints, TokenLogprob
    from specdec.engine import NonFiniteLogitsError
    from specdec.sampling import SamplingConfig
    from specdec.serving.batch import generate_many

__version__ = "0.1.0"
# The public names, by the module that defines them. They load on first use (PEP 562), so that
# ``import specdec.cli`` costs nothing before the command can catch Ctrl-C.
_HOMES = {"DecodeConfig": "specdec.config", "GenerationResult": "specdec.api", "SamplingConfig": "specdec.sampling",
          "StreamEvent": "specdec.api", "generate": "specdec.api", "generate_many": "specdec.serving.batch", "stream": "specdec.api",
          "Constraints": "specdec.constraints", "ConstraintError": "specdec.constraints",
          "TokenLogprob": "specdec.constraints", "NonFiniteLogitsError": "specdec.engine"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
