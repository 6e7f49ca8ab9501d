"""Trained draft heads on the target's final hidden state (blockwise parallel decoding / Medusa).

Head i (i = 1..K) maps the hidden state h_j at position j, whose LM-head output is the target's
distribution of token j+1, to a guess at token j+1+i: ``h + SiLU(W_i h + b_i)`` (the residual
feed-forward block of Stern et al. 2018; Medusa's ResBlock) followed by the target's own
LM head, restricted to a *trimmed vocabulary* of the most frequent tokens. The target's weights stay
frozen; only W_i, b_i are trained (:mod:`specdec.training.heads`).

Files: ``heads.safetensors`` (the K blocks and the kept token ids) and ``config.json`` (sizes, the
target it was trained on, and how). A head pack is small: K * (H^2 + H) parameters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from specdec import kernels
from specdec.paths import model_key

CONFIG = "config.json"
WEIGHTS = "heads.safetensors"


@dataclass
class HeadsConfig:
    """What a head pack is: K heads of width ``hidden_size`` for ``target`` over ``vocab_size`` ids."""

    num_heads: int
    hidden_size: int
    vocab_size: int  # the target's full vocabulary
    kept_tokens: int  # size of the trimmed vocabulary the heads score
    target: str = ""
    training: dict[str, Any] = field(default_factory=dict)


class ResBlock(torch.nn.Module):
    """h -> h + SiLU(W h + b); W starts at zero, so an untrained head repeats the LM head's guess."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.nn.functional.silu(self.linear(h))


class MedusaHeads(torch.nn.Module):
    """K residual blocks; ``kept`` [N] int64 are the token ids of the trimmed vocabulary, in order."""

    def __init__(self, config: HeadsConfig, kept: torch.Tensor) -> None:
        super().__init__()
        if kept.ndim != 1 or kept.numel() != config.kept_tokens:
            raise ValueError(f"kept must be [{config.kept_tokens}] token ids, got shape {tuple(kept.shape)}")
        self.config = config
        self.blocks = torch.nn.ModuleList(ResBlock(config.hidden_size) for _ in range(config.num_heads))
        self.register_buffer("kept", kept.to(torch.long))

    def features(self, h: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """h [..., H] -> [heads, ..., H]: the input of the LM head for heads 1..heads."""
        heads = self.config.num_heads if heads is None else heads
        return torch.stack([block(h) for block in self.blocks[:heads]])

    def save(self, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write ``config.json`` and ``heads.safetensors`` (weights in ``dtype`` if given)."""
        return save_pack(self, directory, WEIGHTS, dtype)

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> "MedusaHeads":
        """Load a head pack. Raises ValueError naming the file when it is missing or damaged."""
        return load_pack(cls, HeadsConfig, directory, WEIGHTS, dtype, what="draft heads",
                         train="specdec train-heads --out DIR")


def save_pack(module: torch.nn.Module, directory: str | Path, weights: str, dtype: torch.dtype | None) -> Path:
    """Write ``module.config`` as ``config.json`` and its state as ``weights`` (in ``dtype`` if given)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
               for k, v in module.state_dict().items()}
    save_file(tensors, str(directory / weights))
    (directory / CONFIG).write_text(json.dumps(asdict(module.config), indent=1) + "\n")
    return directory


def load_pack(cls: Any, config_cls: Any, directory: str | Path, weights: str, dtype: torch.dtype, *,
              what: str, train: str) -> Any:
    """``cls(config, kept)`` loaded from ``directory``; ValueError naming a missing or damaged file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (CONFIG, weights):
        if not (directory / name).is_file():
            raise ValueError(f"no {what} at {directory}: {name} is missing; train them with `{train}` "
                             f"or pass the folder that holds {CONFIG} and {weights}")
    try:
        config = config_cls(**json.loads((directory / CONFIG).read_text()))
        tensors = load_file(str(directory / weights))
        module = cls(config, tensors["kept"])
        module.load_state_dict(tensors)
    except (OSError, SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as err:
        raise ValueError(f"the {what} at {directory} are damaged ({err}); train them again") from None
    return module.to(dtype).eval()


def feature_target_head(target: Any, config: Any, drafter: str) -> torch.nn.Module:
    """The target's output embedding, after checking ``target`` keeps hidden states and matches the
    hidden size and vocabulary ``config`` was trained for; ValueError saying what to do otherwise."""
    if not getattr(target, "keeps_hidden", False):
        raise ValueError(f"the {drafter} drafter reads the target's hidden states: build the target as "
                         "make_backend(model, keep_hidden=True) (specdec.backends.lean)")
    head = target.model.get_output_embeddings()
    if config.hidden_size != head.weight.shape[1] or config.vocab_size != head.weight.shape[0]:
        raise ValueError(
            f"these {drafter} weights were trained for hidden size {config.hidden_size} and vocabulary "
            f"{config.vocab_size} (target {config.target or 'unknown'}), but the target has "
            f"{head.weight.shape[1]} and {head.weight.shape[0]}: train them for this target"
        )
    return head


class TrimmedLMHead:
    """The target's LM head restricted to ``kept`` token ids: logits elsewhere are -inf.

    weight: the target's [V, H] output embedding; only its kept rows are copied ([N, H]).
    """

    def __init__(self, weight: torch.Tensor, kept: torch.Tensor) -> None:
        self.vocab_size = int(weight.shape[0])
        self.kept = kept.to(torch.long)
        self.weight = weight.detach().index_select(0, self.kept).contiguous()  # [N, H]

    def trimmed_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> [..., N] logits over the kept ids."""
        if self.weight.dtype == torch.bfloat16 and kernels.status() == "available" and not torch.is_grad_enabled():
            return kernels.linear(h.to(torch.bfloat16), self.weight)
        return torch.nn.functional.linear(h.to(self.weight.dtype), self.weight)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> [..., V] logits over the full vocabulary, -inf outside the kept ids."""
        small = self.trimmed_logits(h).float()  # [..., N]
        full = torch.full((*small.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        full[..., self.kept] = small
        return full


def frequent_tokens(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids (ties by id), ascending: counts [V] -> [size] int64."""
    size = min(size, counts.numel())
    order = torch.argsort(-counts.to(torch.float64) * counts.numel() + torch.arange(counts.numel()), stable=True)
    return order[:size].sort().values


def shipped_dir(model: Any) -> Path:
    """Where heads for ``model`` ship inside the package (they may not exist)."""
    return Path(str(resources.files("specdec").joinpath("data", "heads", model_key(model))))


def load_heads_for(model: Any, path: str | Path | None = None) -> MedusaHeads:
    """Heads from ``path``, else those shipped for ``model``; ValueError saying how to get some."""
    if path is None:
        path = shipped_dir(model)
        if not (path / CONFIG).is_file():
            raise ValueError(
                f"no draft heads ship for this target ({path.name}); train some with "
                "`specdec train-heads --target MODEL --out DIR` and pass path=DIR (CLI: --heads DIR)"
            )
    heads = MedusaHeads.load(path)
    return heads
