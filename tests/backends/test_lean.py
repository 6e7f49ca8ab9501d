"""The lean backend computes transformers' logits bit for bit, and is used only where it can be."""

from __future__ import annotations

import pytest
import torch

from specdec import generate, kernels
from specdec.backends.hf import HFCausalLM
from specdec.backends.lean import LeanCausalLM, lean_unsupported, make_backend
from specdec.token_tree import TokenTree, forward_tree, keep_path
from helpers import needs_kernel, _on_kernels, _tiny_qwen2
from tiny import tiny_llama


def _models():
    return [("llama", _on_kernels(tiny_llama(3, vocab=64, layers=2, sharpness=4.0, context=512))),
            ("qwen2", _on_kernels(_tiny_qwen2(4)))]


@needs_kernel
@pytest.mark.parametrize("index", [0, 1], ids=["llama", "qwen2"])
def test_logits_are_bitwise_those_of_the_transformers_backend(index: int) -> None:
    _, model = _models()[index]
    assert lean_unsupported(model) is None
    hf, lean = HFCausalLM(model, keep_hidden=True), LeanCausalLM(model, keep_hidden=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (300,), generator=gen).tolist()
    # a prompt, single steps, multi-token passes; past the first cache allocation (256 positions)
    for chunk in (ids[:40], ids[40:41], ids[41:42], ids[42:47], ids[47:250], ids[250:251], ids[251:300]):
        assert torch.equal(hf.forward(chunk), lean.forward(chunk))
    assert torch.equal(hf.forward(ids[:3], 2), lean.forward(ids[:3], 2))  # num_logits
    assert hf.tokens == lean.tokens
    assert torch.equal(hf.hidden, lean.hidden)
    for backend in (hf, lean):
        backend.trim(120)  # roll back, then go on from there
    assert torch.equal(hf.forward(ids[200:204]), lean.forward(ids[200:204]))
    assert torch.equal(hf.hidden, lean.hidden) and lean.hidden.shape[0] == 124


@needs_kernel
@pytest.mark.parametrize("index", [0, 1], ids=["llama", "qwen2"])
def test_a_tree_pass_and_its_compaction_match_the_transformers_backend(index: int) -> None:
    _, model = _models()[index]
    context = [5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    tree = TokenTree([11, 12, 13, 14, 15, 16], [-1, -1, 0, 0, 1, 2])
    hf, lean = HFCausalLM(model), LeanCausalLM(model)
    assert torch.equal(forward_tree(hf, context, tree), forward_tree(lean, context, tree))
    path = tree.path(4)  # nodes 1, 4
    for backend in (hf, lean):
        keep_path(backend, len(context), path)
    assert lean.tokens == hf.tokens == context + [12, 15]
    assert torch.equal(hf.forward([20, 21]), lean.forward([20, 21]))  # the compacted cache is right


@needs_kernel
def test_the_lean_backend_keeps_greedy_speculative_output_bitwise_autoregressive() -> None:
    target = _on_kernels(tiny_llama(5, vocab=64, layers=2, sharpness=4.0))
    draft = _on_kernels(tiny_llama(6, vocab=64, layers=1))
    assert isinstance(make_backend(target), LeanCausalLM) and isinstance(make_backend(draft), LeanCausalLM)
    prompt = [1, 5, 9, 2, 7, 3]
    ar = generate(target, prompt, max_new_tokens=40, eos_token_ids=[])
    via_hf = [t for t in _hf_greedy(target, prompt, 40)]
    assert ar.token_ids == via_hf
    for k in (1, 3, 5):
        spec = generate(target, prompt, draft=draft, k=k, policy="static", max_new_tokens=40, eos_token_ids=[])
        assert spec.token_ids == ar.token_ids
    tree = generate(target, prompt, draft=draft, verify="tree", max_new_tokens=40, eos_token_ids=[])
    assert tree.token_ids == ar.token_ids


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    from specdec.engine import autoregressive_steps
    from specdec.sampling import SamplingConfig

    steps = autoregressive_steps(HFCausalLM(model), prompt, sampling=SamplingConfig(), max_new_tokens=n)
    return [t for step in steps for t in step.tokens]


def test_models_it_cannot_run_get_the_transformers_backend_and_a_reason() -> None:
    fp32 = tiny_llama(7, vocab=32)
    reason = lean_unsupported(fp32)
    assert reason is not None and ("kernel" in reason)
    assert isinstance(make_backend(fp32), HFCausalLM)
    with pytest.raises(ValueError, match="lean backend cannot run"):
        LeanCausalLM(fp32)


@needs_kernel
def test_a_model_off_the_kernels_is_refused() -> None:
    model = tiny_llama(8, vocab=32).to(torch.bfloat16)  # bf16 but not accelerated
    assert "kernel" in lean_unsupported(model)
    kernels.accelerate(model)
    assert "attention" in lean_unsupported(model)  # linear on the kernel, attention still sdpa
    kernels.use_invariant_attention(model)
    assert lean_unsupported(model) is None
    model.train()
    assert "training" in lean_unsupported(model)


@needs_kernel
def test_an_int8_draft_changes_speed_not_the_output() -> None:
    target = _on_kernels(tiny_llama(9, vocab=64, layers=2, sharpness=4.0))
    draft = _on_kernels(_tiny_qwen2(10, vocab=64))  # hidden 48: not whole int8 groups, stays bf16 ...
    with torch.no_grad():
        assert make_backend(draft, weights="int8")._head.int8 is None
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(12)  # ... and a draft whose layers are whole groups of 128 inputs
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    int8_draft = _on_kernels(LlamaForCausalLM(config).eval())
    backend = make_backend(int8_draft, weights="int8")
    assert backend._head.int8 is not None and all(lin.int8 is not None for lin in (backend._layers[0].q, backend._layers[0].down))
    bf16 = make_backend(int8_draft).forward([1, 2, 3])
    int8 = backend.forward([1, 2, 3])
    assert not torch.equal(bf16, int8)  # other numbers ...
    assert (bf16.float() - int8.float()).abs().max() < 0.1 * bf16.float().abs().max()  # ... close ones
    prompt = [1, 5, 9, 2, 7, 3]
    ar = generate(target, prompt, max_new_tokens=30, eos_token_ids=[])
    for d in (draft, int8_draft):
        spec = generate(target, prompt, draft=d, draft_weights="int8", k=3, policy="static", max_new_tokens=30,
                        eos_token_ids=[])
        assert spec.token_ids == ar.token_ids
    with pytest.raises(ValueError, match="weights must be one of"):
        make_backend(target, weights="int4")
