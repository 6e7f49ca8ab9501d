"""The GGUF side of a bench run: the located GGUFs and what runs them, loaded once per run.

Project methods with ``backend=llamacpp`` or ``backend=gguf`` run on the target's GGUF and, for
draft-model methods, the draft's, loaded the way every command loads a model
(:func:`specdec.models.load_model` on a :class:`~specdec.models.Located`), only with a context
the run sizes. The ``llamacpp-ar`` peer runs the binding's own ``llama_cpp.Llama`` on the target's
GGUF (:mod:`specdec.bench.peers`). The backend's models are loaded before the warm-up, with a
context long enough for the run's longest prompt plus its token budget, the peer's on its first
run (the warm-up); all are kept for every later method, prompt and temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from specdec.backends.llamacpp import DEFAULT_BATCH
from specdec.backends.table import LLAMACPP
from specdec.bench.methods import MethodSpec
from specdec.models import Located, load_model, load_tokenizer, trim_draft

CONTEXT_STEP = 256  # contexts are rounded up to a multiple of this
DRAFT_ROOM = 32  # room past the token budget for the last step's draft tokens


@dataclass
class LlamaCppModels:
    """The located GGUFs (:func:`specdec.models.locate`) and the models loaded from them.
    ``n_threads``: threads for every model (decode and batch), None: the backend's default.
    ``backend``: what runs the project's methods, ``llamacpp`` or ``gguf`` (specdec's own kernel;
    the ``llamacpp-*`` peers need ``llamacpp``). ``draft_vocab``: how many ids the draft's head
    scores (--draft-vocab; :func:`specdec.models.trim_draft`)."""

    target_gguf: Located
    draft_gguf: Located | None = None
    n_threads: int | None = None
    backend: str = LLAMACPP
    n_ctx: int = 0
    draft_vocab: int | str | None = None
    target: Any = None  # a CausalLM from specdec.backends.llamacpp or specdec.backends.gguf
    draft: Any = None
    peers: dict[str, Any] = field(default_factory=dict)  # peer kind -> the binding's own model object

    @property
    def target_path(self) -> Path:
        return self.target_gguf.path

    @property
    def draft_path(self) -> Path | None:
        return self.draft_gguf.path if self.draft_gguf is not None else None

    def prepare(self, methods: Sequence[MethodSpec], n_ctx: int) -> None:
        """Load what ``methods`` need, with room for ``n_ctx`` tokens; a model already loaded with
        that much room is kept."""
        n_ctx = CONTEXT_STEP * math.ceil(n_ctx / CONTEXT_STEP)
        if n_ctx > self.n_ctx:
            self.close()
            self.n_ctx = n_ctx
        mine = [m for m in methods if m.backend == self.backend and not m.is_server]  # servers load their own
        if any(not m.is_peer for m in mine) and self.target is None:
            self.target = self._load_backend(self.target_gguf)
        if any(m.needs_draft_model for m in mine) and self.draft is None:
            if self.draft_path is None:
                names = ", ".join(m.name for m in mine if m.needs_draft_model)
                raise ValueError(f"methods {names} need a draft model's GGUF; give one (--draft)")
            same = self.target is not None and self.draft_path == self.target_path
            draft = self.target.fork() if same else self._load_backend(self.draft_gguf)
            self.draft, _ = trim_draft(draft, load_tokenizer(self.draft_gguf), self.draft_vocab, self.backend,
                                       name=self.draft_gguf.name, cache_dir=self.draft_gguf.cache_dir)

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

    def _load_backend(self, located: Located) -> Any:
        return load_model(located, self.backend, n_threads=self.n_threads, n_ctx=self.n_ctx)


def context_needed(prompt_lengths: Sequence[int], max_new_tokens: int) -> int:
    """Tokens a run's context must hold: the longest prompt, the budget and a last step's drafts."""
    return max(prompt_lengths) + max_new_tokens + DRAFT_ROOM
