"""specdec: exact speculative decoding for Hugging Face causal language models.

Notation (kept everywhere): ``p`` is the target's distribution, ``q`` the draft's. See
:mod:`specdec.verify`.
"""

from specdec.api import GenerationResult, StreamEvent, generate, stream
from specdec.memory import keep_freed_memory
from specdec.sampling import SamplingConfig

keep_freed_memory()  # vocabulary-sized tensors every step: see specdec.memory

__version__ = "0.1.0"
__all__ = ["GenerationResult", "SamplingConfig", "StreamEvent", "generate", "stream"]
