"""A lean forward pass for llama/qwen2/mistral-style models: transformers' arithmetic, less Python.

transformers runs each decoder layer through a dozen modules, builds a mask on every call and grows
its KV cache with ``torch.cat``. On a 2-core CPU that costs some 30-40 ms per forward pass: about
half of a 0.5B draft model's step, and most of the gap between what a draft token costs and what
its weights cost to read. :class:`LeanCausalLM` runs the same operations in the same order and
dtypes (bf16 activations, specdec's bf16 linear and attention kernels, RMSNorm and RoPE as
transformers writes them) straight from the model's own parameters, over a preallocated KV cache
kept in fp32 (the bf16 values, widened once instead of in every layer of every call). Its logits
are therefore bit for bit those of :class:`~specdec.backends.hf.HFCausalLM` on the same model
(``tests/backends/test_lean.py``), so it changes speed only, never an output.

It runs a model only when :func:`lean_unsupported` finds nothing in the way: a llama, qwen2 or
mistral model in bf16 on the CPU whose linear layers and attention already run on specdec's kernels
(``models.load(..., kernels="auto")``, or :func:`specdec.kernels.accelerate` and
:func:`specdec.kernels.use_invariant_attention`), with SiLU MLPs and no sliding window.
:func:`make_backend` picks it when it can and :class:`~specdec.backends.hf.HFCausalLM` otherwise.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specdec import kernels
from specdec.backends.base import HIDDEN_STATES, TREES, ModelFacts
from specdec.backends.hf import HFCausalLM
from specdec.measurements import torch_identity

LEAN_MODEL_TYPES = ("llama", "qwen2", "mistral")
_FIRST_CAPACITY = 256  # cached positions allocated at first; the cache doubles when full


def lean_unsupported(model: Any) -> str | None:
    """None if :class:`LeanCausalLM` can run ``model``, else the reason it cannot."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in LEAN_MODEL_TYPES:
        return f"model type {kind!r} is not one of {', '.join(LEAN_MODEL_TYPES)}"
    if kernels.status() != "available":
        return f"specdec's kernels are {kernels.status()}"
    if getattr(config, "_attn_implementation", None) != kernels.ATTENTION:
        return "its attention is not specdec's invariant kernel (load it with kernels='auto')"
    if getattr(config, "hidden_act", None) != "silu":
        return f"its MLP activation is {getattr(config, 'hidden_act', None)!r}, not silu"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "it uses sliding-window attention"
    base = getattr(model, "model", None)
    if not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "it lacks model.embed_tokens/layers/norm/rotary_emb"
    head = getattr(model, "lm_head", None)
    linears = [head]
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        found = [getattr(attn, n, None) for n in names[:4]] + [getattr(mlp, n, None) for n in names[4:]]
        if any(m is None for m in found) or not hasattr(layer, "post_attention_layernorm"):
            return "a decoder layer is not llama-shaped (q/k/v/o_proj, gate/up/down_proj, two norms)"
        linears += found
    if not all(getattr(m, "_specdec_fast", False) for m in linears):
        return "its linear layers are not on specdec's bf16 kernel (load it with kernels='auto')"
    if model.training:
        return "it is in training mode"
    return None


def make_backend(model: Any, *, keep_hidden: bool = False, weights: str = "bf16") -> Any:
    """The fastest :class:`~specdec.backends.base.CausalLM` for a transformers ``model``:
    :class:`LeanCausalLM` where :func:`lean_unsupported` allows it, else ``HFCausalLM``. With
    ``weights="bf16"`` both compute the same logits bit for bit; ``weights="int8"`` (for draft
    models only, see :class:`LeanCausalLM`) applies where the lean backend does."""
    check_weights(weights)
    if lean_unsupported(model) is None:
        return LeanCausalLM(model, keep_hidden=keep_hidden, weights=weights)
    return HFCausalLM(model, keep_hidden=keep_hidden)


WEIGHTS = ("bf16", "int8")


def check_weights(weights: str, what: str = "weights") -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"{what} must be one of {', '.join(WEIGHTS)}, got {weights!r}")


class _Layer:
    """One decoder layer's parameters, read from the model (no copies)."""

    def __init__(self, layer: Any, int8: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.q, self.k, self.v, self.o = (_Linear(m, int8) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        self.gate, self.up, self.down = (_Linear(m, int8) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.scale = float(attn.scaling)


class _Linear:
    """``kernels.linear`` with its fp32 bias widened once: bf16 x -> bf16 y, the same numbers.

    int8: the weights quantised by :func:`specdec.kernels.quantize_int8` (once per model: kept on
    the module) and multiplied by the int8 kernel; not the same numbers, half the bytes."""

    def __init__(self, module: torch.nn.Linear, int8: bool = False) -> None:
        self.weight = module.weight  # [out, in] bf16
        self.bias = None if module.bias is None else module.bias.detach().to(torch.float32)  # [out]
        self.int8 = None
        if int8 and self.weight.shape[1] % kernels.INT8_GROUP == 0:
            if getattr(module, "_specdec_int8", None) is None:
                module._specdec_int8 = kernels.quantize_int8(self.weight)
            self.int8 = module._specdec_int8  # (q [out, in] int8, scales [out, in / G] fp32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] bf16 -> [n, out] bf16."""
        rows = x.to(torch.float32).contiguous()  # [n, in]
        y = kernels.linear_f32(rows, self.weight) if self.int8 is None else kernels.linear_i8_f32(rows, *self.int8)
        if self.bias is not None:
            y += self.bias
        return y.to(torch.bfloat16)


class LeanCausalLM(ModelFacts):
    """One sequence's view of a llama/qwen2-style model, computed as transformers computes it.

    Implements :class:`~specdec.backends.base.CausalLM` (trees included: ``attend`` and
    ``positions``), like :class:`~specdec.backends.hf.HFCausalLM`, whose ``keep_hidden`` and
    ``hidden`` it shares. Raises ``ValueError`` (with the reason) for a model it cannot run.

    ``weights="int8"`` is for draft models: their linear layers (the LM head too) read int8 weights
    with a scale per 128 inputs, half the bytes of bf16, so a draft token costs less. The draft's
    probabilities change slightly; the output law does not, because the verifier sees exactly the
    distribution the draft sampled from. Never use it for a target: its logits *are* the law.
    """

    def __init__(self, model: Any, *, keep_hidden: bool = False, weights: str = "bf16") -> None:
        check_weights(weights)
        why = lean_unsupported(model)
        if why is not None:
            raise ValueError(f"the lean backend cannot run {type(model).__name__}: {why}")
        self.model = model
        base = model.model
        config = model.config
        self._embed = base.embed_tokens
        self._rotary = base.rotary_emb
        self._norm, self._norm_eps = base.norm.weight, base.norm.variance_epsilon
        int8 = weights == "int8"
        self.weights = weights
        self._head = _Linear(model.lm_head, int8)
        self._layers = [_Layer(layer, int8) for layer in base.layers]
        self._heads = int(config.num_attention_heads)
        self._kv_heads = int(getattr(config, "num_key_value_heads", None) or self._heads)
        self._dim = int(getattr(config, "head_dim", None) or config.hidden_size // self._heads)
        self._vocab = int(model.lm_head.weight.shape[0])
        self._max_context = getattr(config, "max_position_embeddings", None)
        self._keep_hidden = keep_hidden
        self.capabilities = frozenset({TREES, HIDDEN_STATES} if keep_hidden else {TREES})
        self.reset()

    # -- the CausalLM protocol ------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def identity(self) -> dict[str, Any]:
        """What the planner's measurements of this backend are keyed by (with the machine and the
        class; :func:`specdec.measurements.cost_key`): the transformers model's name, config and
        dtype (``<dtype>/int8`` on int8 weights), and torch's thread count."""
        return torch_identity(self.model, self.weights)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int],
        num_logits: int = 0,
        *,
        attend: torch.Tensor | None = None,
        positions: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append ``tokens``; return logits [len(tokens), V] bf16, or only the last ``num_logits`` rows.

        ``attend`` [n, cache_len + n] bool and ``positions`` [n] replace the causal mask and the
        consecutive positions (token trees), as in ``HFCausalLM.forward``.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        start, length = self._length, self._length + n
        self._reserve(length)
        if positions is None:
            position_ids = torch.arange(start, length)[None]  # [1, n]
        else:
            position_ids = torch.as_tensor(list(positions), dtype=torch.long)[None]  # [1, n]
        if attend is not None:
            visible = attend.to(torch.bool)  # [n, length]
        else:
            visible = None if n == 1 else torch.ones(n, length, dtype=torch.bool).tril(start)  # [n, length]
        x = self._embed(torch.as_tensor(list(tokens), dtype=torch.long))  # [n, H] bf16
        cos, sin = self._rotary(x[None], position_ids)  # [1, n, d] each, bf16
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [n, 1, d]
        for layer, keys, values in zip(self._layers, self._keys, self._values):
            h = _rms_norm(x, layer.norm1, layer.eps1)  # [n, H]
            q = _rope(layer.q(h).view(n, self._heads, self._dim), cos, sin)  # [n, heads, d]
            k = _rope(layer.k(h).view(n, self._kv_heads, self._dim), cos, sin)  # [n, kv, d]
            v = layer.v(h).view(n, self._kv_heads, self._dim)  # [n, kv, d]
            keys[:, start:length] = k.transpose(0, 1)  # bf16 values, widened exactly
            values[:, start:length] = v.transpose(0, 1)
            q32 = q.transpose(0, 1).to(torch.float32).contiguous()  # [heads, n, d]
            out = kernels.attention_rows(q32, keys, values, length, visible, layer.scale)  # [n, heads, d]
            x = x + layer.o(out.to(torch.bfloat16).view(n, self._heads * self._dim))
            h = _rms_norm(x, layer.norm2, layer.eps2)
            x = x + layer.down(torch.nn.functional.silu(layer.gate(h)) * layer.up(h))
        h = _rms_norm(x, self._norm, self._norm_eps)  # [n, H]
        if self._keep_hidden:
            self._hidden[start:length] = h
        self._length = length
        self._tokens.extend(int(t) for t in tokens)
        return self._head(h[-num_logits:] if num_logits else h)  # [n or num_logits, V] bf16

    @property
    def keeps_hidden(self) -> bool:
        """Whether :attr:`hidden` is kept (``keep_hidden=True``)."""
        return self._keep_hidden

    @property
    def hidden(self) -> torch.Tensor:
        """[len(tokens), H]: the final normed hidden state at each cached position (the LM head's
        input). Needs ``keep_hidden=True``."""
        if not self._keep_hidden:
            raise ValueError("this backend was built without keep_hidden=True")
        return self._hidden[: self._length]

    def trim(self, length: int) -> None:
        if length < self._length:
            self._length = length
            del self._tokens[length:]

    @torch.inference_mode()
    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the cached positions ``indices`` (ascending), e.g. a tree's accepted path."""
        index = torch.as_tensor(list(indices), dtype=torch.long)
        m = len(index)
        for cache in (*self._keys, *self._values):
            cache[:, :m] = cache.index_select(1, index)
        if self._keep_hidden:
            self._hidden[:m] = self._hidden.index_select(0, index)
        self._tokens = [self._tokens[i] for i in indices]
        self._length = m

    def reset(self) -> None:
        self._length = 0
        self._tokens: list[int] = []
        self._keys: list[torch.Tensor] = []  # per layer [kv, capacity, d] fp32
        self._values: list[torch.Tensor] = []
        self._hidden = torch.zeros(0, self.model.config.hidden_size, dtype=torch.bfloat16)
        self._capacity = 0

    # -- internals -------------------------------------------------------------------------------

    def _reserve(self, length: int) -> None:
        """Make room for ``length`` cached positions (doubling), keeping what is cached."""
        if length <= self._capacity:
            return
        capacity = max(_FIRST_CAPACITY, self._capacity)
        while capacity < length:
            capacity *= 2
        if self._max_context is not None:
            capacity = max(length, min(capacity, self._max_context))
        shape = (self._kv_heads, capacity, self._dim)
        kept = self._length

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.empty(shape, dtype=torch.float32)
            if old is not None and kept:
                new[:, :kept] = old[:, :kept]
            return new

        count = len(self._layers)
        self._keys = [grown(self._keys[i] if self._keys else None) for i in range(count)]
        self._values = [grown(self._values[i] if self._values else None) for i in range(count)]
        if self._keep_hidden:
            hidden = torch.zeros(capacity, self._hidden.shape[1], dtype=torch.bfloat16)
            hidden[:kept] = self._hidden[:kept]
            self._hidden = hidden
        self._capacity = capacity


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as transformers' llama/qwen2 write it: in fp32, cast back, then scale."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it: x * cos + rotate_half(x) * sin, in x's dtype.
    x [n, heads, d]; cos, sin [n, 1, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)
