"""The llama.cpp side of a bench run: the GGUF files and what runs them, loaded once per run.

Project methods with ``backend=llamacpp`` run on :mod:`specdec.backends.llamacpp` (the target's
GGUF and, for draft-model methods, the draft's). The ``llamacpp-ar`` peer runs the binding's own
``llama_cpp.Llama`` on the target's GGUF (:mod:`specdec.bench.peers`). The backend's models are loaded
before the warm-up, with a context long enough for the run's longest prompt plus its token
budget, the peer's on its first run (the warm-up); all are kept for every later method, prompt
and temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from specdec.backends.gguf import load_gguf_native
from specdec.backends.llamacpp import DEFAULT_BATCH, load_gguf
from specdec.backends.table import GGUF, LLAMACPP
from specdec.bench.methods import MethodSpec

CONTEXT_STEP = 256  # contexts are rounded up to a multiple of this
DRAFT_ROOM = 32  # room past the token budget for the last step's draft tokens


@dataclass
class LlamaCppModels:
    """GGUF paths and the models loaded from them. ``n_threads``: threads for every model (decode
    and batch), None: the backend's default. ``backend``: what runs the project's methods,
    ``llamacpp`` or ``gguf`` (specdec's own kernel; the ``llamacpp-*`` peers need ``llamacpp``)."""

    target_path: Path
    draft_path: Path | None = None
    n_threads: int | None = None
    backend: str = LLAMACPP
    n_ctx: int = 0
    target: Any = None  # a CausalLM from specdec.backends.llamacpp
    draft: Any = None
    peers: dict[str, Any] = field(default_factory=dict)  # peer kind -> the binding's own model object

    def prepare(self, methods: Sequence[MethodSpec], n_ctx: int) -> None:
        """Load what ``methods`` need, with room for ``n_ctx`` tokens; a model already loaded with
        that much room is kept."""
        n_ctx = CONTEXT_STEP * math.ceil(n_ctx / CONTEXT_STEP)
        if n_ctx > self.n_ctx:
            self.close()
            self.n_ctx = n_ctx
        mine = [m for m in methods if m.backend == self.backend and not m.is_server]  # servers load their own
        if any(not m.is_peer for m in mine) and self.target is None:
            self.target = self._load_backend(self.target_path)
        if any(m.needs_draft_model for m in mine) and self.draft is None:
            if self.draft_path is None:
                names = ", ".join(m.name for m in mine if m.needs_draft_model)
                raise ValueError(f"methods {names} need a draft model's GGUF; give one (--draft)")
            same = self.target is not None and self.draft_path == self.target_path
            self.draft = self.target.fork() if same else self._load_backend(self.draft_path)

    def peer(self, method: MethodSpec) -> Any:
        """The binding's own model object for a ``llamacpp-*`` peer (loaded on first use)."""
        if method.kind not in self.peers:
            from llama_cpp import Llama  # the optional binding: imported when a peer first runs

            # The binding's own settings (flash attention off, repacked weights for every pass) with
            # the backend's prefill batch: a context of at least DEFAULT_BATCH tokens, since the
            # binding batches its prefill by min(n_ctx, 512). The backend leaves flash attention to
            # llama.cpp (on for the CPU) and prefills long prompts on the file's layout where that is
            # faster (specdec.backends.llamacpp.choose_prefill_layout), so near-ties can round apart.
            self.peers[method.kind] = Llama(
                str(self.target_path), n_ctx=max(self.n_ctx, DEFAULT_BATCH), n_threads=self.n_threads or None,
                n_threads_batch=self.n_threads or None, n_batch=DEFAULT_BATCH, flash_attn=False, verbose=False,
            )
        return self.peers[method.kind]

    def close(self) -> None:
        """Drop every loaded model (they free their memory when collected)."""
        self.target = self.draft = None
        self.peers.clear()

    def _load_backend(self, path: Path) -> Any:
        if self.backend == GGUF:
            return load_gguf_native(path, n_threads=self.n_threads, n_ctx=self.n_ctx)
        return load_gguf(path, n_threads=self.n_threads, n_ctx=self.n_ctx)


def context_needed(prompt_lengths: Sequence[int], max_new_tokens: int) -> int:
    """Tokens a run's context must hold: the longest prompt, the budget and a last step's drafts."""
    return max(prompt_lengths) + max_new_tokens + DRAFT_ROOM
