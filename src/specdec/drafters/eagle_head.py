"""A one-layer autoregressive draft head on the target's features (EAGLE, Li et al. 2024).

The head reads pairs (h_t, x_{t+1}): the target's final (normed) hidden state at position t and the
embedding of the token that followed. One transformer layer over the sequence of pairs predicts
the next feature, ĥ_{t+1} ≈ h_{t+1}, and the target's own LM head, restricted to a trimmed
vocabulary, turns ĥ_{t+1} into a guess at x_{t+2}. Drafting runs it autoregressively: the
predicted feature and the drafted token form the next pair.

Layer: ``x = fc([emb; h])``; ``x += Attn(RMSNorm(x))`` (causal, rotary positions, each query sees
the last ``window`` pairs); ``x += MLP(RMSNorm(x))`` (SwiGLU). The target's weights stay frozen;
the head is trained by :func:`specdec.training.heads.train_eagle`.

Files: ``eagle.safetensors`` (the layer and the kept token ids) and ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.drafters.medusa import CONFIG, load_pack, save_pack
from specdec.paths import model_key

WEIGHTS = "eagle.safetensors"


@dataclass
class EagleConfig:
    """Sizes of a one-layer head for ``target`` (hidden size H, vocabulary V)."""

    hidden_size: int
    vocab_size: int  # the target's full vocabulary
    kept_tokens: int  # size of the trimmed vocabulary the head scores
    num_heads: int = 12  # attention heads; hidden_size must be a multiple
    intermediate_size: int = 3072
    window: int = 128  # pairs each query attends to (training windows have this length)
    rope_theta: float = 10000.0
    target: str = ""
    training: dict[str, Any] = field(default_factory=dict)


@dataclass
class EagleCache:
    """Keys and values of the pairs seen so far: [heads, n, head_dim] each (empty at first)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else int(self.k.shape[1])

    def crop(self, length: int) -> None:
        """Keep the first ``length`` pairs."""
        if self.k is not None:
            self.k, self.v = self.k[:, :length], self.v[:, :length]


class EagleHead(nn.Module):
    """The layer; ``kept`` [N] int64 are the token ids its LM head scores, ascending."""

    def __init__(self, config: EagleConfig, kept: torch.Tensor) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        if h % config.num_heads:
            raise ValueError(f"hidden size {h} is not a multiple of {config.num_heads} attention heads")
        if kept.ndim != 1 or kept.numel() != config.kept_tokens:
            raise ValueError(f"kept must be [{config.kept_tokens}] token ids, got shape {tuple(kept.shape)}")
        self.config = config
        self.fc = nn.Linear(2 * h, h)
        self.attn_norm = nn.RMSNorm(h, eps=1e-6)
        self.qkv = nn.Linear(h, 3 * h)
        self.o = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=1e-6)
        self.gate_up = nn.Linear(h, 2 * i, bias=False)
        self.down = nn.Linear(i, h, bias=False)
        self.register_buffer("kept", kept.to(torch.long))

    def forward(self, h: torch.Tensor, emb: torch.Tensor, start: int, cache: EagleCache | None = None) -> torch.Tensor:
        """Pairs t = start .. start+T-1: h [T, H] (features), emb [T, H] (embeddings of x_{t+1})
        -> [T, H], the predicted features ĥ_{t+1}. ``cache`` holds pairs 0..start-1 and gains these."""
        cfg = self.config
        n_heads, d = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        t = h.shape[0]
        x = self.fc(torch.cat([emb, h], -1).to(self.fc.weight.dtype))  # [T, H]
        q, k, v = self.qkv(self.attn_norm(x)).view(t, 3, n_heads, d).permute(1, 2, 0, 3)  # 3 × [nh, T, d]
        pos = torch.arange(start, start + t, device=x.device)
        q, k = _rotate(q, pos, cfg.rope_theta), _rotate(k, pos, cfg.rope_theta)
        k_start = start  # position of k's first row
        if cache is not None:
            if len(cache) != start:
                raise ValueError(f"the cache holds {len(cache)} pairs but these start at {start}")
            if cache.k is not None:
                k, v = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)  # [nh, start+T, d]
            cache.k, cache.v = k, v
            k_start = 0
        first = max(k_start, start - cfg.window + 1)  # no query looks further back
        k, v = k[:, first - k_start :], v[:, first - k_start :]  # [nh, S, d]
        k_pos = torch.arange(first, start + t, device=x.device)  # [S]
        gap = pos[:, None] - k_pos[None, :]  # [T, S]
        visible = (gap >= 0) & (gap < cfg.window)
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)  # [nh, T, d]
        x = x + self.o(a.transpose(0, 1).reshape(t, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.down(nn.functional.silu(gate) * up)

    def save(self, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write ``config.json`` and ``eagle.safetensors`` (weights in ``dtype`` if given)."""
        return save_pack(self, directory, WEIGHTS, dtype)

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> "EagleHead":
        """Load a head. Raises ValueError naming the file when it is missing or damaged."""
        return load_pack(cls, EagleConfig, directory, WEIGHTS, dtype, what="one-layer draft head",
                         train="specdec train-heads --kind eagle --out DIR")


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form): x [nh, T, d], pos [T]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)  # [d/2]
    angle = pos.to(torch.float32)[:, None] * inv[None, :]  # [T, d/2]
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(x.dtype)  # [T, d]
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def shipped_dir(model: Any) -> Path:
    """Where a one-layer head for ``model`` ships inside the package (it may not exist)."""
    return Path(str(resources.files("specdec").joinpath("data", "eagle", model_key(model))))


def load_eagle_for(model: Any, path: str | Path | None = None) -> EagleHead:
    """The head at ``path``, else the one shipped for ``model``; ValueError saying how to get one."""
    if path is None:
        path = shipped_dir(model)
        if not (path / CONFIG).is_file():
            raise ValueError(
                f"no one-layer draft head ships for this target ({path.name}); train one with "
                "`specdec train-heads --kind eagle --target MODEL --out DIR` and pass path=DIR (CLI: --heads DIR)"
            )
    return EagleHead.load(path)

