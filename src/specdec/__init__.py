"""specdec: exact speculative decoding for Hugging Face causal language models.

Notation (kept everywhere): ``p`` is the target's distribution, ``q`` the draft's. See
:mod:`specdec.verify`.

Importing specdec changes nothing in the process. Programs that decode many tokens may call
:func:`specdec.memory.keep_freed_memory` once (the command line and the benchmark do): glibc then
keeps freed memory for reuse, which makes every step's vocabulary-sized tensors cheaper.
"""

from specdec.api import GenerationResult, StreamEvent, generate, stream
from specdec.config import DecodeConfig
from specdec.sampling import SamplingConfig

__version__ = "0.1.0"
__all__ = ["DecodeConfig", "GenerationResult", "SamplingConfig", "StreamEvent", "generate", "stream"]
