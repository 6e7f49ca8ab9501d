"""The transformers backend run layer by layer, so a drafter can run part of the target.

:class:`HFLayeredCausalLM` implements :class:`~specdec.backends.base.CausalLM` for llama/qwen2-style
models (``model.model.embed_tokens``, ``.layers``, ``.norm``, ``.rotary_emb``, ``model.lm_head``)
and adds :meth:`HFLayeredCausalLM.forward_layers`: run any ascending subset of the decoder layers
over a token sequence, then the final norm and the LM head. Self-drafters use it (early exit: the
first L layers; layer skipping: all layers but a skip set) and share the one ``DynamicCache``.

How the cache is shared. Each layer i keeps its own cached length. A key/value entry is *genuine*
when it is what the full model computes: true for the layers of a run that form a prefix
0..g-1 of the model. A run's genuine prefix also stores the hidden states that leave layer g-1,
so a later full forward can start layer g at those positions without running layers 0..g-1
again. Entries that a run writes past a skipped layer are *scratch*: the drafter's own keys and
values, kept while it drafts, dropped before the full model runs.

Rollback is lazy. ``tokens`` is the prefix that every layer holds; ``trim`` to that length or
beyond keeps the extra entries the drafter wrote into the lower layers, and ``forward`` reuses
every entry whose token prefix matches the tokens it is given (an entry at position t depends only
on tokens 0..t). So the engine's usual ``forward_after(target, context, draft)`` feeds the verify
pass, and the layers below the exit compute only positions they lack.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from specdec.backends.base import LAYERS, ModelFacts, common_prefix_len
from specdec.measurements import torch_identity

_SUPPORTED_ATTENTION = ("sdpa", "eager", "specdec")  # specdec: specdec.kernels.attention


class HFLayeredCausalLM(ModelFacts):
    """One sequence's view of a llama/qwen2-style transformers model, run layer by layer."""

    capabilities = frozenset({LAYERS})  # no tree masks

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        check_layered(model)
        self.model = model.eval()
        self._base = model.model
        self._layers = list(self._base.layers)
        self._cache_cls = DynamicCache
        self._vocab = int(model.lm_head.weight.shape[0])
        self._max_context = getattr(model.config, "max_position_embeddings", None)
        self.reset()

    # -- the CausalLM protocol ------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def identity(self) -> dict[str, Any]:
        """What the planner's measurements of this backend are keyed by (with the machine and the
        class; :func:`specdec.measurements.cost_key`): the transformers model's name, config and
        dtype, and torch's thread count."""
        return torch_identity(self.model)

    @property
    def tokens(self) -> list[int]:
        """The tokens every layer holds genuine entries for."""
        return self._seq[: min(self._genuine)]

    def forward(self, tokens: Sequence[int], num_logits: int = 0) -> torch.Tensor:
        """Append ``tokens`` after :attr:`tokens`; return logits [len(tokens), V] (or the last rows)."""
        if len(tokens) == 0:
            raise ValueError("forward needs at least one token")
        rows = min(num_logits, len(tokens)) if num_logits > 0 else len(tokens)
        return self.forward_layers(self.tokens + [int(t) for t in tokens], range(self.num_layers), rows)

    def trim(self, length: int) -> None:
        """Forget positions >= ``length``; a length at or past :attr:`tokens` keeps the drafter's extras."""
        if length < min(self._genuine):
            self._crop(length)

    def reset(self) -> None:
        self._cache = self._cache_cls()
        n = len(self._layers)
        self._seq: list[int] = []  # the tokens the cached entries were computed from
        self._length = [0] * n  # entries held per layer, genuine and scratch
        self._genuine = [0] * n  # per layer, positions [0, n) hold the full model's entries
        self._states: dict[int, tuple[int, torch.Tensor]] = {}  # depth -> (start, [1, n, H])
        self._scratch_layers: tuple[int, ...] = ()

    # -- running a subset of layers ------------------------------------------------------------

    @torch.inference_mode()
    def forward_layers(
        self, sequence: Sequence[int], layers: Iterable[int], num_logits: int = 1
    ) -> torch.Tensor:
        """Logits [num_logits, V] for the last positions of ``sequence``, through ``layers`` only.

        sequence: the whole token sequence (cached prefix included). layers: ascending layer
        indices. Each layer computes the positions it lacks; the final norm and LM head follow the
        last of them. Running every layer is the target's own forward.
        """
        run = sorted(set(int(i) for i in layers))
        if not run or run[0] < 0 or run[-1] >= self.num_layers:
            raise ValueError(f"layers must be a non-empty subset of 0..{self.num_layers - 1}")
        seq = [int(t) for t in sequence]
        if not 0 < num_logits <= len(seq):
            raise ValueError(f"num_logits must be in 1..{len(seq)}, got {num_logits}")
        genuine_depth = next((g for g, i in enumerate(run) if g != i), len(run))
        if tuple(run) != self._scratch_layers:
            self._drop_scratch()
        self._sync(seq)
        if self._length[run[-1]] > len(seq) - num_logits:  # the last layer must compute those rows
            self._crop(len(seq) - num_logits)
        hidden, start = self._run(seq, run, genuine_depth)
        for i in run:
            self._length[i] = len(seq)
            if i < genuine_depth:
                self._genuine[i] = len(seq)
        self._scratch_layers = tuple(run) if genuine_depth < len(run) else ()
        if genuine_depth == self.num_layers:
            self._states.clear()
        out = self._base.norm(hidden[:, len(seq) - num_logits - start :])
        return self.model.lm_head(out)[0]  # [num_logits, V]

    def end_draft(self) -> None:
        """Drop the scratch entries a layer-skipping draft wrote (the full forward does it too)."""
        self._drop_scratch()

    def _run(self, seq: list[int], run: list[int], genuine_depth: int) -> tuple[torch.Tensor, int]:
        """Run ``run`` over the positions each layer lacks; return (hidden [1, n, H], first position)."""
        total = len(seq)
        starts = self._plan(run, genuine_depth)
        if starts is None:  # some layer needs hidden states nobody kept: recompute from a common point
            self._crop(min(self._length[i] for i in run))
            starts = self._plan(run, genuine_depth)
            assert starts is not None
        lowest = min(starts)
        position_ids = torch.arange(lowest, total, device=self.device)[None]  # [1, total - lowest]
        ids = torch.tensor(seq[starts[0] :], dtype=torch.long, device=self.device)[None]
        hidden = self._base.embed_tokens(ids)  # [1, n, H]
        cos, sin = self._base.rotary_emb(hidden, position_ids)
        a = starts[0]  # hidden holds positions [a, total)
        masks: dict[int, torch.Tensor | None] = {}
        for g, (i, s) in enumerate(zip(run, starts)):
            if s < a:
                depth = i if g == i else genuine_depth
                begin, kept = self._states[depth]
                hidden = torch.cat([kept[:, s - begin : a - begin], hidden], dim=1)
                a = s
            elif s > a:
                hidden, a = hidden[:, s - a :], s
            if s == total:
                continue  # this layer holds every position already
            if s not in masks:
                masks[s] = self._mask(s, total, hidden.dtype)
            hidden = self._layers[i](
                hidden,
                attention_mask=masks[s],
                position_ids=position_ids[:, s - lowest :],
                past_key_values=self._cache,
                use_cache=True,
                cache_position=position_ids[0, s - lowest :],
                position_embeddings=(cos[:, s - lowest :], sin[:, s - lowest :]),
            )
            if isinstance(hidden, tuple):
                hidden = hidden[0]
            if g + 1 == genuine_depth and genuine_depth < self.num_layers:
                self._keep_states(genuine_depth, a, hidden)
        return hidden, a

    def _plan(self, run: list[int], genuine_depth: int) -> list[int] | None:
        """First position each run layer computes, or None if the hidden states it needs are gone."""
        starts = [self._length[i] for i in run]
        a = starts[0]
        for g, (i, s) in enumerate(zip(run, starts)):
            if s < a:
                if g > genuine_depth:  # inside the skipping stream: only this run produces its states
                    return None
                depth = i if g == i else genuine_depth
                kept = self._states.get(depth)
                if kept is None or kept[0] > s or kept[0] + kept[1].shape[1] < a:
                    return None
                a = s
            else:
                a = max(a, s)
        return starts

    def _keep_states(self, depth: int, start: int, hidden: torch.Tensor) -> None:
        """Remember the genuine hidden states entering layer ``depth`` at positions [start, ...)."""
        old = self._states.get(depth)
        if old is not None and old[0] <= start <= old[0] + old[1].shape[1]:
            hidden = torch.cat([old[1][:, : start - old[0]], hidden], dim=1)
            start = old[0]
        floor = self._length[depth]  # layer ``depth`` already holds positions below this
        if floor > start:
            hidden, start = hidden[:, floor - start :], floor
        self._states[depth] = (start, hidden)

    def _mask(self, start: int, total: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Causal mask for queries at [start, total) over keys [0, total): [1, 1, q, total] or None."""
        q = total - start
        sdpa = self.model.config._attn_implementation == "sdpa"
        if q == 1 or (sdpa and start == 0):
            return None  # one query sees everything; SDPA's own causal mask fits a square block
        allowed = torch.arange(total, device=self.device)[None, :] <= torch.arange(
            start, total, device=self.device
        )[:, None]  # [q, total]
        if sdpa:
            return allowed[None, None]
        mask = torch.zeros(q, total, dtype=dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]

    # -- cache bookkeeping ---------------------------------------------------------------------

    def _sync(self, seq: list[int]) -> None:
        """Drop the entries computed from tokens that ``seq`` does not start with."""
        n = len(self._seq)
        if len(seq) >= n and seq[:n] == self._seq:
            keep = n  # the usual case, compared at C speed
        else:
            keep = common_prefix_len(self._seq, seq)
        if keep < n:
            self._crop(keep)
        self._seq = seq

    def _crop(self, length: int) -> None:
        for i, n in enumerate(self._length):
            if n > length:
                self._crop_layer(i, length)
        self._genuine = [min(n, length) for n in self._genuine]
        for depth, (start, kept) in list(self._states.items()):
            if start >= length:
                del self._states[depth]
            else:
                self._states[depth] = (start, kept[:, : length - start])
        self._seq = self._seq[:length]  # a new list: callers may hold the old one

    def _drop_scratch(self) -> None:
        for i, (n, g) in enumerate(zip(self._length, self._genuine)):
            if n > g:
                self._crop_layer(i, g)
        self._scratch_layers = ()

    def _crop_layer(self, i: int, length: int) -> None:
        if i < len(self._cache.layers):
            self._cache.layers[i].crop(length)
        self._length[i] = length


def check_layered(model: Any) -> None:
    """Raise ``ValueError`` unless ``model`` has the llama/qwen2 layout the layered runner needs."""
    base = getattr(model, "model", None)
    missing = [
        name
        for name, owner in (("model", model), ("lm_head", model))
        if getattr(owner, name, None) is None
    ] + [
        f"model.{name}"
        for name in ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is not None and getattr(base, name, None) is None
    ]
    if missing:
        raise ValueError(
            f"{type(model).__name__} lacks {', '.join(missing)}: layer-wise drafting (early exit, "
            "layer skipping) supports llama/qwen2-style transformers models"
        )
    config = model.config
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{config.model_type} uses sliding-window attention, which the layered runner does not "
            "model; use the model drafter or the n-gram drafter with this target"
        )
    if config._attn_implementation not in _SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {config._attn_implementation!r} is not supported by the "
            f"layered runner; load the model with attn_implementation='sdpa' or 'eager'"
        )
