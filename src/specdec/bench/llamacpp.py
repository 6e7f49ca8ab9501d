"""The llama.cpp side of a bench run: the GGUF files and what runs them, loaded once per run.

Project methods with ``backend=llamacpp`` run on :mod:`specdec.backends.llamacpp` (the target's
GGUF and, for draft-model methods, the draft's). The ``llamacpp-*`` peers run llama-cpp-python's
own high-level ``Llama`` on the target's GGUF: one plain (for ``llamacpp-ar``) and one built with
a prompt-lookup draft model (it must keep every row's logits, which would slow the plain one).
Each is loaded on first need, with a context long enough for the run's longest prompt plus its
token budget, and kept for every later method, prompt and temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from specdec.bench.methods import PROMPT_LOOKUP_K, MethodSpec

CONTEXT_STEP = 256  # contexts are rounded up to a multiple of this
DRAFT_ROOM = 32  # room past the token budget for the last step's draft tokens


@dataclass
class LlamaCppModels:
    """GGUF paths and the models loaded from them. ``n_threads``: threads for every llama.cpp
    model (decode and batch), None: the backend's default."""

    target_path: Path
    draft_path: Path | None = None
    n_threads: int | None = None
    n_ctx: int = 0
    target: Any = None  # a CausalLM from specdec.backends.llamacpp
    draft: Any = None
    peers: dict[str, Any] = field(default_factory=dict)  # "plain" / "lookup" -> llama_cpp.Llama

    def prepare(self, methods: Sequence[MethodSpec], n_ctx: int) -> None:
        """Load what ``methods`` need, with room for ``n_ctx`` tokens; a model already loaded with
        that much room is kept."""
        n_ctx = CONTEXT_STEP * math.ceil(n_ctx / CONTEXT_STEP)
        if n_ctx > self.n_ctx:
            self.close()
            self.n_ctx = n_ctx
        mine = [m for m in methods if m.backend == "llamacpp"]
        if any(not m.is_peer for m in mine) and self.target is None:
            self.target = self._load_backend(self.target_path)
        if any(m.needs_draft_model for m in mine) and self.draft is None:
            if self.draft_path is None:
                names = ", ".join(m.name for m in mine if m.needs_draft_model)
                raise ValueError(f"methods {names} need a draft model's GGUF; give one (--draft)")
            self.draft = self._load_backend(self.draft_path)
        for m in mine:
            if m.is_peer:
                self.peer(m)

    def peer(self, method: MethodSpec) -> Any:
        """The binding's ``Llama`` for a ``llamacpp-*`` peer, set up for ``method`` (its k)."""
        key = "lookup" if method.kind == "llamacpp-prompt-lookup" else "plain"
        if key not in self.peers:
            self.peers[key] = self._load_llama(lookup=key == "lookup")
        llm = self.peers[key]
        if key == "lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            llm.draft_model = LlamaPromptLookupDecoding(num_pred_tokens=method.k or PROMPT_LOOKUP_K)
        return llm

    def close(self) -> None:
        """Drop every loaded model (they free their memory when collected)."""
        self.target = self.draft = None
        self.peers.clear()

    def _load_backend(self, path: Path) -> Any:
        from specdec.backends.llamacpp import load_gguf

        return load_gguf(path, n_threads=self.n_threads, n_ctx=self.n_ctx)

    def _load_llama(self, *, lookup: bool) -> Any:
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            raise ValueError(
                "the llamacpp-* peers need llama-cpp-python; install it with: pip install llama-cpp-python"
            ) from None
        threads = {"n_threads": self.n_threads, "n_threads_batch": self.n_threads} if self.n_threads else {}
        return Llama(
            str(self.target_path), n_ctx=self.n_ctx, n_gpu_layers=0, verbose=False, **threads,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_K) if lookup else None,
        )


def context_needed(prompt_lengths: Sequence[int], max_new_tokens: int) -> int:
    """Tokens a run's context must hold: the longest prompt, the budget and a last step's drafts."""
    return max(prompt_lengths) + max_new_tokens + DRAFT_ROOM
