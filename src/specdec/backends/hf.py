"""The transformers backend: any ``AutoModelForCausalLM`` with a ``DynamicCache``."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specdec.backends.base import HIDDEN_STATES, TREES, ModelFacts
from specdec.measurements import torch_identity


class HFCausalLM(ModelFacts):
    """One sequence's view of a transformers causal LM, with a trimmable KV cache.

    Refuses (``ValueError``) a model whose cache cannot be trimmed back, since rollback of rejected
    draft tokens depends on it.
    """

    def __init__(self, model: Any, *, keep_hidden: bool = False) -> None:
        """keep_hidden: also keep the final (normed) hidden state of every cached position, for
        drafters that read the target's features (:attr:`hidden`)."""
        from transformers import DynamicCache

        self.model = model.eval()
        self._norm = final_norm(model) if keep_hidden else None
        self.capabilities = frozenset({TREES, HIDDEN_STATES} if keep_hidden else {TREES})
        self._hidden: torch.Tensor | None = None  # [len(tokens), H] when keep_hidden
        self._cache_cls = DynamicCache
        self._cache = DynamicCache()
        self._tokens: list[int] = []
        head = model.get_output_embeddings()
        self._vocab = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        self._max_context = getattr(model.config, "max_position_embeddings", None)

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    @property
    def device(self) -> torch.device:
        return self.model.device

    def identity(self) -> dict[str, Any]:
        """What the planner's measurements of this backend are keyed by (with the machine and the
        class; :func:`specdec.measurements.cost_key`): the transformers model's name, config and
        dtype, and torch's thread count."""
        return torch_identity(self.model)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int],
        num_logits: int = 0,
        *,
        attend: torch.Tensor | None = None,
        positions: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append ``tokens``; return logits [len(tokens), V], or only the last ``num_logits`` rows.

        For token trees: ``attend`` [n, cache_len + n] bool says which positions each new token
        sees, ``positions`` [n] gives their position ids; both replace the causal defaults.
        """
        if len(tokens) == 0:
            raise ValueError("forward needs at least one token")
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)[None]  # [1, n]
        extra = {}
        if attend is not None:
            dtype = self.model.dtype
            mask = torch.zeros(attend.shape, dtype=dtype, device=self.device)
            mask.masked_fill_(~attend.to(self.device), torch.finfo(dtype).min)
            extra["attention_mask"] = mask[None, None]  # [1, 1, n, cache_len + n]
            extra["position_ids"] = torch.as_tensor(list(positions), device=self.device)[None]
        captured: list[torch.Tensor] = []
        hook = None
        if self._norm is not None:
            hook = self._norm.register_forward_hook(lambda _m, _a, out: captured.append(out[0]))  # [n, H]
        try:
            out = self.model(
                input_ids=ids,
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=num_logits,
                **extra,
            )
        finally:
            if hook is not None:
                hook.remove()
        if self._norm is not None:
            new = captured[-1]
            self._hidden = new if self._hidden is None else torch.cat([self._hidden, new])
        if out.past_key_values is not self._cache:
            self._cache = out.past_key_values
            self._check_trimmable()
        self._tokens.extend(int(t) for t in tokens)
        return out.logits[0]  # [n or num_logits, V]

    @property
    def keeps_hidden(self) -> bool:
        """Whether :attr:`hidden` is kept (``keep_hidden=True``)."""
        return self._norm is not None

    @property
    def hidden(self) -> torch.Tensor:
        """[len(tokens), H]: the final normed hidden state at each cached position (the input of
        the LM head there). Needs ``keep_hidden=True``."""
        if self._norm is None:
            raise ValueError("this backend was built without keep_hidden=True")
        if self._hidden is None:
            return torch.zeros(0, self.model.config.hidden_size, dtype=self.model.dtype)
        return self._hidden

    def trim(self, length: int) -> None:
        if length < len(self._tokens):
            self._cache.crop(length)
            del self._tokens[length:]
            if self._hidden is not None:
                self._hidden = self._hidden[:length]

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the cached positions ``indices`` (ascending), e.g. a tree's accepted path."""
        index = torch.as_tensor(list(indices), dtype=torch.long, device=self.device)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
        self._tokens = [self._tokens[i] for i in indices]
        if self._hidden is not None:
            self._hidden = self._hidden.index_select(0, index)

    def reset(self) -> None:
        self._cache = self._cache_cls()
        self._tokens = []
        self._hidden = None

    def _check_trimmable(self) -> None:
        if not isinstance(self._cache, self._cache_cls) or any(
            getattr(layer, "is_sliding", False) for layer in getattr(self._cache, "layers", [])
        ):
            raise ValueError(
                f"{type(self.model).__name__} keeps a {type(self._cache).__name__} that cannot be "
                "trimmed back after a rejected draft; speculative decoding needs a model whose "
                "cache is a plain transformers DynamicCache"
            )


def final_norm(model: Any) -> torch.nn.Module:
    """The module whose output feeds the LM head (llama/qwen2/mistral-style ``model.model.norm``).

    Raises ValueError naming the model class when there is none to find.
    """
    base = getattr(model, "model", None)
    norm = getattr(base, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ValueError(
            f"cannot find the final norm of {type(model).__name__} (expected model.model.norm, as in "
            "llama, qwen2 and mistral models); drafters that read the target's hidden states need one"
        )
    return norm


def eos_token_ids(model: Any, tokenizer: Any = None) -> set[int]:
    """The ids that end generation: the generation config's EOS ids, else the tokenizer's."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
        if ids:
            break
    return ids
