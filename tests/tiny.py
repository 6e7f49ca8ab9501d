"""Tiny random transformers built in code: no downloads, small vocabularies, fp32."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(
    seed: int, vocab: int = 16, layers: int = 2, sharpness: float = 1.0, context: int = 256
) -> LlamaForCausalLM:
    """A random llama with ``vocab`` tokens; ``sharpness`` scales the LM head (peakier outputs)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int = 1) -> LlamaForCausalLM:
    """A draft that partly agrees with ``model``: its weights plus Gaussian noise (relative scale)."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std())
    return draft
