"""Trained draft heads: the drafter keeps the target's law, the trimmed vocabulary, the files, training.

- greedy output with heads equals greedy autoregressive output (every verifier, k = 1..4), also
  with a trimmed vocabulary that misses tokens the target picks;
- under sampling, the first 3 tokens follow the target's exact law (chi-square through the engine,
  power stated as in test_engine), with a trimmed vocabulary so q is zero where p is not;
- the drafter samples from the q it reports; q is zero outside the kept ids;
- the backend keeps the hidden states of exactly the cached positions;
- a pack round-trips through its files, and a missing or damaged one fails with a clear message;
- training: collection resumes where it stopped, training resumes after its last epoch, and the
  trained heads agree with the target better than untrained ones on held-out sequences.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import (
    PROMPT, SAMPLES, SIGNIFICANCE, ContextLM, chi_square_p_value, chi_square_power, exact_target_law, random_heads,
)
from tiny import tiny_llama

from specdec import generate
from specdec.config import DecodeConfig
from specdec.backends.hf import HFCausalLM
from specdec.build import make_drafter, target_backend
from specdec.drafters.heads import HeadsDrafter
from specdec.engine import autoregressive_steps, speculative_steps
from specdec.drafters.medusa import MedusaHeads, TrimmedLMHead, frequent_tokens
from specdec.training.heads import TrainConfig, collect, head_targets, load_data, train
from specdec.policies import StaticK
from specdec.sampling import SamplingConfig, sample
from specdec.verify import make_verifier

GREEDY = SamplingConfig()


def test_backend_keeps_the_hidden_state_of_each_cached_position() -> None:
    model = tiny_llama(0, vocab=16)
    backend = HFCausalLM(model, keep_hidden=True)
    backend.forward([1, 2, 3, 4], 1)
    backend.forward([5, 6, 7], 3)
    backend.trim(5)
    backend.forward([9], 1)
    with torch.no_grad():
        ref = model(torch.tensor([[1, 2, 3, 4, 5, 9]]), output_hidden_states=True)
    assert torch.allclose(backend.hidden, ref.hidden_states[-1][0], atol=1e-5)
    backend.keep([0, 2, 5])
    assert torch.allclose(backend.hidden, ref.hidden_states[-1][0][[0, 2, 5]], atol=1e-5)
    with pytest.raises(ValueError, match="keep_hidden"):
        HFCausalLM(model).hidden


@pytest.mark.parametrize("kept", [list(range(24)), [0, 2, 3, 5, 7, 11, 13, 17, 19, 23]])
@pytest.mark.parametrize("verifier", ["greedy", "token", "block"])
def test_greedy_output_with_heads_equals_autoregressive(kept: list[int], verifier: str) -> None:
    target = tiny_llama(6, vocab=24, layers=3, sharpness=3.0)
    prompt = [3, 7, 1, 3, 7, 2, 3, 7]
    expected = [t for s in autoregressive_steps(HFCausalLM(target), prompt, sampling=GREEDY, max_new_tokens=20)
                for t in s.tokens]
    heads = random_heads(target, 4, kept)
    for k in (1, 2, 4):
        backend = target_backend("heads", target)
        drafter = HeadsDrafter(backend, heads)
        steps = list(speculative_steps(backend, drafter, make_verifier(verifier), StaticK(k), prompt,
                                       sampling=GREEDY, max_new_tokens=20))
        assert [t for s in steps for t in s.tokens] == expected, (verifier, k)
        assert sum(s.drafted for s in steps) > 0


@pytest.mark.parametrize("choices", [None, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]])
def test_greedy_output_with_a_heads_tree_equals_autoregressive(choices) -> None:
    target = tiny_llama(6, vocab=24, layers=3, sharpness=3.0)
    prompt = [3, 7, 1, 3, 7, 2, 3, 7]
    expected = generate(target, prompt, max_new_tokens=20, eos_token_ids=[]).token_ids
    backend = target_backend("heads", target)
    drafter = HeadsDrafter(backend, random_heads(target, 3, [0, 2, 3, 5, 7, 11, 13, 17, 19, 23]))
    tree = {"choices": choices} if choices else None
    result = generate(backend, prompt, drafter=drafter, verify="tree", tree=tree, max_new_tokens=20, eos_token_ids=[])
    assert result.token_ids == expected
    assert result.method == str(DecodeConfig(drafter="heads", verify="tree", tree=tree)) and result.shape == "static"
    assert result.stats.drafted_tokens > 0


@pytest.mark.parametrize("verify", ["block", "tree"])
def test_sampled_output_with_heads_follows_the_target_law(verify: str) -> None:
    vocab = 5
    target = tiny_llama(0, vocab=vocab, sharpness=6.0)
    heads = random_heads(target, 2, kept=[0, 1, 3], scale=0.3)  # q = 0 on tokens 2 and 4
    sampling = SamplingConfig(temperature=1.0)
    law = exact_target_law(target, sampling, vocab)
    assert (law.sum(axis=(1, 2))[[2, 4]] > 0.05).all()  # the target does pick the missing tokens
    assert chi_square_power(law, SAMPLES, effect=0.15) >= 0.95  # as in test_engine
    backend = ContextLM(target, keep_hidden=True)  # answers from memory: helpers.ContextLM
    drafter = HeadsDrafter(backend, heads)
    counts = np.zeros_like(law)
    accepted = 0
    for seed in range(SAMPLES):
        chain = {} if verify == "tree" else dict(k=2, policy="static")  # a tree's shape sets its length
        r = generate(backend, PROMPT, drafter=drafter, verify=verify, **chain, temperature=1.0,
                     max_new_tokens=3, seed=seed, eos_token_ids=[])
        counts[tuple(r.token_ids)] += 1
        accepted += r.stats.accepted_tokens
    assert accepted > SAMPLES // 4  # drafts are being accepted
    assert chi_square_p_value(counts, law) > SIGNIFICANCE


def test_heads_sample_from_the_q_they_report_and_only_kept_ids() -> None:
    target = tiny_llama(9, vocab=24, layers=2)
    kept = [1, 4, 6, 8, 9, 15, 20]
    backend = target_backend("heads", target)
    drafter = HeadsDrafter(backend, random_heads(target, 3, kept))
    sampling = SamplingConfig(temperature=1.3, top_k=5)
    for seed in range(5):
        draft = drafter.propose([5, 6, 7, 8], 3, sampling, torch.Generator().manual_seed(seed))
        replay = torch.Generator().manual_seed(seed)
        assert draft.q.shape == (3, 24)
        assert torch.allclose(draft.q.sum(-1), torch.ones(3, dtype=draft.q.dtype))
        outside = [t for t in range(24) if t not in kept]
        assert float(draft.q[:, outside].abs().sum()) == 0.0
        assert [sample(row, replay) for row in draft.q] == draft.tokens.tolist()
    assert len(drafter.propose([5, 6, 7, 8], 9, GREEDY, None)) == 3  # never more than the heads


def test_trimmed_head_scores_only_the_kept_ids() -> None:
    weight = torch.randn(10, 4)
    kept = torch.tensor([1, 3, 8])
    head = TrimmedLMHead(weight, kept)
    h = torch.randn(2, 4)
    full = head.logits(h)
    assert torch.allclose(full[:, kept], h @ weight[kept].T, atol=1e-6)
    assert torch.isinf(full[:, [0, 2, 4, 5, 6, 7, 9]]).all()
    assert frequent_tokens(torch.tensor([5, 0, 5, 9, 1, 0]), 3).tolist() == [0, 2, 3]  # ties by id


def test_a_pack_round_trips_and_bad_packs_fail_clearly(tmp_path) -> None:
    target = tiny_llama(1, vocab=16)
    heads = random_heads(target, 2, [0, 3, 5])
    heads.save(tmp_path / "h")
    loaded = MedusaHeads.load(tmp_path / "h")
    h = torch.randn(3, target.config.hidden_size)
    assert torch.equal(loaded.features(h), heads.features(h))
    assert loaded.kept.tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match="heads.safetensors is missing"):
        (tmp_path / "h" / "heads.safetensors").unlink()
        MedusaHeads.load(tmp_path / "h")
    heads.save(tmp_path / "bad")
    (tmp_path / "bad" / "heads.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="damaged"):
        MedusaHeads.load(tmp_path / "bad")
    other = tiny_llama(1, vocab=20)
    with pytest.raises(ValueError, match="train them for this target"):
        HeadsDrafter(target_backend("heads", other), heads)
    with pytest.raises(ValueError, match="keep_hidden"):
        HeadsDrafter(HFCausalLM(target), heads)
    heads.save(tmp_path / "ok")
    drafter = make_drafter("heads", target_backend("heads", target), path=tmp_path / "ok")
    assert drafter.describe()["kept_tokens"] == 3
    with pytest.raises(ValueError, match="no draft heads ship"):
        make_drafter("heads", target_backend("heads", target))


def test_head_targets_are_later_labels_within_a_sequence() -> None:
    labels = torch.tensor([4, 5, 6, 7, 1, 2])
    seq = torch.tensor([0, 0, 0, 0, 1, 1])
    kept = torch.tensor([1, 2, 5, 6, 7])  # 4 is not kept
    t = head_targets(labels, seq, kept, 2)
    # head 1 at j predicts labels[j + 1]; head 2 labels[j + 2]; -100 past the sequence's end.
    assert t[0].tolist() == [2, 3, 4, -100, 1, -100]
    assert t[1].tolist() == [3, 4, -100, -100, -100, -100]


def _patterned_sequences(n: int, length: int, seed: int):
    """Sequences a head can learn from: counting up mod 24 from a random start, so the tokens after
    next are a function of the current token, which the hidden state carries."""
    rng = random.Random(seed)
    for _ in range(n):
        start = rng.randrange(24)
        yield [(start + i) % 24 for i in range(length)]


def test_training_resumes_and_beats_untrained_heads(tmp_path) -> None:
    target = tiny_llama(3, vocab=24, layers=2, sharpness=2.0)
    cfg = TrainConfig(num_heads=2, kept_tokens=16, positions=2400, seq_len=24, epochs=3, batch=32, lr=1e-2, seed=0)
    logs: list[str] = []
    small = TrainConfig(**{**cfg.__dict__, "positions": 1200})
    collect(target, _patterned_sequences(200, 24, 0), tmp_path, small, logs.append, shard_positions=400)
    first = load_data(tmp_path / "data")
    collect(target, _patterned_sequences(200, 24, 0), tmp_path, cfg, logs.append, shard_positions=400)
    resumed = [line for line in logs if "of 2400 positions stored" in line]
    assert resumed and int(resumed[0].split()[1]) >= 1200  # it picked up the stored shards
    hidden, labels, seq = load_data(tmp_path / "data")
    assert labels.numel() >= 2400 and torch.equal(labels[: first[1].numel()], first[1])
    one_shot = tmp_path / "again"
    collect(target, _patterned_sequences(200, 24, 0), one_shot, cfg, logs.append, shard_positions=400)
    assert torch.equal(load_data(one_shot / "data")[1], labels)  # resuming changed nothing
    with torch.no_grad():
        expected = target(torch.tensor([list(_patterned_sequences(1, 24, 0))[0]])).logits[0].argmax(-1)
    assert torch.equal(labels[:24], expected)  # labels are the target's own greedy choices

    heads = train(target, tmp_path, cfg, logs.append)
    agreement = heads.config.training["held_out_agreement"]
    # Untrained heads (zero blocks) repeat the LM head's next-token guess at every offset.
    untrained = MedusaHeads(heads.config, heads.kept)
    from specdec.training.heads import evaluate
    kept = heads.kept
    targets = head_targets(labels, seq, kept, 2)
    test_pos = torch.nonzero((seq % 10) == 9).flatten()
    head_w = target.lm_head.weight.detach()[kept]
    baseline = evaluate(untrained, hidden, targets, test_pos, head_w, "cpu")
    assert agreement[0] > baseline[0] + 0.2, (agreement, baseline)
    assert (tmp_path / "heads.safetensors").is_file()
    logs.clear()
    again = train(target, tmp_path, cfg, logs.append)  # all epochs done: resumes and trains none
    assert any("resuming after epoch 3" in line for line in logs)
    h = hidden[:5].float()
    assert torch.equal(again.features(h), heads.features(h))


def test_the_memoized_backend_keeps_the_hidden_states_of_a_whole_context_pass() -> None:
    """helpers.ContextLM (the law tests' target) gives each position the logits and the final normed
    hidden state that the transformers backend computes over that position's whole context, through
    extension, a kept tree path and a trim."""
    target = tiny_llama(4, vocab=24, layers=2)
    memo, fresh = ContextLM(target, keep_hidden=True), target_backend("heads", target)

    def whole(context: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        fresh.reset()
        logits = fresh.forward(context)
        return logits[-1], fresh.hidden[-1]

    memo.forward([3, 7, 1, 3])
    memo.forward([5, 2, 9], attend=torch.ones(3, 7, dtype=torch.bool).tril(4), positions=[4, 5, 6])
    memo.keep([0, 1, 2, 3, 4, 5])
    memo.trim(5)
    rows = memo.forward([11, 4])  # [2, V]
    assert memo.tokens == [3, 7, 1, 3, 5, 11, 4] and memo.hidden.shape == (7, target.config.hidden_size)
    for n in range(1, 8):
        logits, hidden = whole(memo.tokens[:n])
        assert torch.equal(memo.hidden[n - 1], hidden), n
        if n >= 6:
            assert torch.equal(rows[n - 6], logits.float()), n
