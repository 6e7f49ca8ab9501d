"""The batch-invariant bf16 linear kernel: correct, batch invariant, and safely optional."""

from __future__ import annotations

import pytest
import torch

from specdec import generate, kernels
from tiny import tiny_llama

needs_kernel = pytest.mark.skipif(kernels.status() != "available", reason=f"fast kernel {kernels.status()}")


def _bf16(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("n_in, n_out", [(64, 36), (37, 13), (8, 4), (3, 5), (1536, 257)])
def test_linear_matches_a_float64_reference(n_in: int, n_out: int) -> None:
    x, w, b = _bf16((7, n_in), 0), _bf16((n_out, n_in), 1), _bf16((n_out,), 2)
    got = kernels.linear(x.float(), w, b)  # fp32 out: only fp32 accumulation error remains
    want = x.double() @ w.double().T + b.double()
    # Forward error bound of an fp32 dot product: n_in * eps * sum |x_i w_i| (Higham 3.1).
    bound = n_in * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert (got.double() - want).abs().le(bound).all()
    assert kernels.linear(x, w, b).dtype == torch.bfloat16


@needs_kernel
def test_rows_past_one_call_chunk_are_computed_as_if_alone() -> None:
    # The kernel takes rows 48 at a time (16 groups of 3): check across that boundary too.
    x, w = _bf16((100, 40), 5).float(), _bf16((9, 40), 6)
    alone = torch.cat([kernels.linear(x[t : t + 1], w) for t in range(100)])
    for n in (4, 47, 48, 49, 96, 100):
        assert torch.equal(kernels.linear(x[:n], w), alone[:n]), n


@needs_kernel
@pytest.mark.parametrize("n_in, n_out", [(64, 36), (37, 13), (1536, 8)])
def test_every_row_is_computed_as_if_it_were_alone(n_in: int, n_out: int) -> None:
    x, w = _bf16((13, n_in), 3).float(), _bf16((n_out, n_in), 4)
    alone = torch.cat([kernels.linear(x[t : t + 1], w) for t in range(13)])
    for n in range(1, 14):
        assert torch.equal(kernels.linear(x[:n], w), alone[:n]), n
        assert torch.equal(kernels.linear(x[13 - n :], w), alone[13 - n :]), n


@needs_kernel
def test_an_accelerated_model_agrees_with_torch_and_decodes_the_same_greedy_text() -> None:
    model = tiny_llama(0, vocab=64, layers=2, sharpness=4.0).to(torch.bfloat16)
    prompt = [1, 5, 9, 2, 7, 3]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        before = model(ids).logits.float()
        assert kernels.accelerate(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
        assert kernels.accelerate(model) == 0  # idempotent
        after = model(ids).logits.float()
    # bf16 activations: the two differ only by roundings of bf16 intermediates.
    assert torch.allclose(before, after, atol=0.1, rtol=0.05)
    assert kernels.restore(model) == 15 and kernels.describe_model(model) == "torch"
    with torch.inference_mode():
        assert torch.equal(model(ids).logits.float(), before)
    kernels.accelerate(model)
    assert (before.argmax(-1) == after.argmax(-1)).float().mean() > 0.8
    ar = generate(model, prompt, max_new_tokens=24, draft=None)
    spec = generate(model, prompt, draft=model, k=4, policy="static", max_new_tokens=24)
    assert spec.token_ids == ar.token_ids


@needs_kernel
def test_gradients_still_flow_through_pytorch() -> None:
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    kernels.accelerate(layer)
    x = _bf16((3, 16), 5)
    layer(x).float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_disabled_kernel_leaves_the_model_alone(monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_KERNELS", "torch")
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setattr(kernels, "_unavailable", None)
    assert kernels.status() == "unavailable: disabled by SPECDEC_KERNELS=torch"
    model = tiny_llama(0).to(torch.bfloat16)
    assert kernels.accelerate(model) == 0
    assert kernels.describe_model(model) == "torch"
    with pytest.raises(RuntimeError, match="SPECDEC_KERNELS"):
        kernels.linear(torch.zeros(1, 4), torch.zeros(2, 4, dtype=torch.bfloat16))


def test_fp32_layers_are_not_touched() -> None:
    model = tiny_llama(0)
    assert kernels.accelerate(model) == 0


# -- batch-invariant attention ----------------------------------------------------------------------


def _invariant_tiny(seed: int = 0):
    model = tiny_llama(seed, vocab=64, layers=2, sharpness=4.0).to(torch.bfloat16)
    kernels.accelerate(model)
    assert kernels.use_invariant_attention(model)
    return model


@needs_kernel
def test_attention_matches_sdpa_in_fp32() -> None:
    model = tiny_llama(1, vocab=32, layers=2)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.no_grad():
        before = model(ids).logits
        kernels.use_invariant_attention(model)
        after = model(ids).logits
    assert torch.allclose(before, after, atol=1e-5)


@needs_kernel
def test_a_verification_pass_computes_what_one_token_steps_compute() -> None:
    from specdec.backends.hf import HFCausalLM

    model = _invariant_tiny()
    ids = [(7 * i + 3) % 64 for i in range(40)]
    backend = HFCausalLM(model)
    backend.forward(ids[:30], 1)
    one = torch.cat([backend.forward([t], 1) for t in ids[30:]])  # [10, V]
    for n in (2, 5, 10):
        backend.trim(30)
        many = torch.cat([backend.forward(ids[30 + i : 30 + i + n], n) for i in range(0, 10, n)])
        assert torch.equal(many, one), n  # bit for bit, in bf16


@needs_kernel
def test_a_tree_pass_computes_what_one_token_steps_along_each_path_compute() -> None:
    from specdec.backends.hf import HFCausalLM
    from specdec.token_tree import TokenTree, forward_tree

    model = _invariant_tiny(2)
    context = [5, 9, 2, 6, 5, 3, 5, 8]
    tree = TokenTree([11, 12, 13, 14, 15, 16], [-1, -1, 0, 0, 1, 2])
    logits = forward_tree(HFCausalLM(model), context, tree)  # [1 + N, V]
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path(node)]
        plain = HFCausalLM(model)
        plain.forward(context, 1)
        for t in path:
            last = plain.forward([t], 1)
        assert torch.equal(logits[1 + node], last[0]), node


@needs_kernel
def test_greedy_speculative_output_is_bitwise_the_autoregressive_one_in_bf16() -> None:
    target = _invariant_tiny(3)
    draft = tiny_llama(4, vocab=64, layers=1).to(torch.bfloat16)
    prompt = [1, 5, 9, 2, 7, 3]
    ar = generate(target, prompt, max_new_tokens=40, eos_token_ids=[])
    for k in (1, 3, 6):
        spec = generate(target, prompt, draft=draft, k=k, policy="static", max_new_tokens=40, eos_token_ids=[])
        assert spec.token_ids == ar.token_ids
    tree = generate(target, prompt, draft=draft, verify="tree", max_new_tokens=40, eos_token_ids=[])
    assert tree.token_ids == ar.token_ids


@needs_kernel
@pytest.mark.parametrize("sampling", [dict(temperature=0.7), dict(temperature=1.0, top_k=8),
                                      dict(temperature=1.5, top_p=0.9)], ids=["T0.7", "T1-topk", "T1.5-topp"])
def test_coupled_sampled_output_is_bitwise_the_autoregressive_one_in_bf16(sampling) -> None:
    """Same seed, same text on the batch-invariant bf16 kernels: under the Gumbel-max sampler,
    chains of several lengths, the planner (ngram+model) and the tree draw plain decoding's tokens."""
    target = _invariant_tiny(3)
    draft = tiny_llama(4, vocab=64, layers=1).to(torch.bfloat16)
    prompt = [1, 5, 9, 2, 7, 3, 1, 5, 9]
    common = dict(sampler="gumbel", seed=21, max_new_tokens=40, eos_token_ids=[], **sampling)
    ar = generate(target, prompt, **common)
    kept = 0
    for method in (dict(k=1, policy="static"), dict(k=4, policy="static"), dict(k=8, policy="static"), dict(),
                   dict(verify="tree")):
        spec = generate(target, prompt, draft=draft, **method, **common)
        assert spec.token_ids == ar.token_ids, method
        kept += spec.stats.accepted_tokens
    assert kept > 0
    assert generate(target, prompt, **{**common, "seed": 22}).token_ids != ar.token_ids


@needs_kernel
@pytest.mark.parametrize("n_out, n_in", [(7, 128), (36, 256), (13, 384)])
def test_int8_weights_are_within_half_a_step_and_the_kernel_matches_a_float64_reference(n_out: int, n_in: int) -> None:
    w = _bf16((n_out, n_in), 7)
    q, scales = kernels.quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (n_out, n_in // kernels.INT8_GROUP)
    deq = (q.double().reshape(n_out, -1, kernels.INT8_GROUP) * scales.double()[..., None]).reshape(n_out, n_in)
    step = scales.double().repeat_interleave(kernels.INT8_GROUP, dim=1)  # [out, in]
    # Half a step, plus the fp32 rounding of w / scale (relative eps, on values up to 127 steps).
    assert (deq - w.double()).abs().le(step / 2 + 127 * torch.finfo(torch.float32).eps * step).all()
    for n in (1, 2, 3, 4, 5, 50):
        x = _bf16((n, n_in), 8 + n).float()
        got = kernels.linear_i8_f32(x, q, scales).double()
        want = x.double() @ deq.T
        # fp32 accumulation: per group of G a dot product, then scaled and summed (Higham 3.1, loosely x2).
        bound = 2 * n_in * torch.finfo(torch.float32).eps * (x.double().abs() @ deq.abs().T)
        assert (got - want).abs().le(bound).all(), n


def test_int8_needs_whole_groups() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        kernels.quantize_int8(torch.zeros(4, 100, dtype=torch.bfloat16))
