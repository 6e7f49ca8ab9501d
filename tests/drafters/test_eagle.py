"""The one-layer autoregressive draft head (EAGLE-style): exactness, its cache, its files, training.

- greedy output with the head equals greedy autoregressive output (every verifier, k = 1..4),
  also with a trimmed vocabulary that misses tokens the target picks;
- under sampling, the first 3 tokens follow the target's exact law (chi-square through the engine,
  power stated as in test_engine), with q zero where p is not;
- the drafter samples from the q it reports, and q is zero outside the kept ids;
- the head's incremental cache computes what one pass over all pairs computes, and the drafter's
  proposals after rejections equal a fresh drafter's on the same context;
- a head round-trips through its files; missing or damaged files fail with a clear message;
- training: windows never cross sequences, and a trained head agrees with the target better than
  an untrained one on held-out sequences; training resumes after its last epoch.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import (
    PROMPT, SAMPLES, SIGNIFICANCE, ContextLM, chi_square_p_value, chi_square_power, exact_target_law, random_head,
)
from tiny import tiny_llama

from specdec import generate
from specdec.backends.hf import HFCausalLM
from specdec.build import make_drafter, target_backend
from specdec.drafters.eagle import EagleDrafter
from specdec.engine import autoregressive_steps, speculative_steps
from specdec.drafters.eagle_head import EagleCache, EagleHead
from specdec.training.heads import TrainConfig, collect, eagle_windows, evaluate_eagle, load_data, load_ids, train_eagle
from specdec.policies import StaticK
from specdec.sampling import SamplingConfig, sample
from specdec.verify import make_verifier

GREEDY = SamplingConfig()


def test_the_cache_computes_what_one_pass_computes() -> None:
    model = tiny_llama(0, vocab=16)
    head = random_head(model, list(range(16)), window=5)
    h, emb = torch.randn(12, 32), torch.randn(12, 32)
    with torch.no_grad():
        whole = head(h, emb, 0)  # [12, H]
        cache = EagleCache()
        parts = [head(h[:7], emb[:7], 0, cache), head(h[7:8], emb[7:8], 7, cache), head(h[8:], emb[8:], 8, cache)]
        assert torch.allclose(torch.cat(parts), whole, atol=1e-5)
        cache.crop(8)
        assert len(cache) == 8 and torch.allclose(head(h[8:], emb[8:], 8, cache), whole[8:], atol=1e-5)
        # the window: the last query sees pairs 7..11 only, so changing pair 0..6 changes nothing there
        h2 = h.clone()
        h2[:7] += 1.0
        assert torch.allclose(head(h2, emb, 0)[-1], whole[-1], atol=1e-5)
        assert not torch.allclose(head(h2, emb, 0)[6], whole[6], atol=1e-3)
        with pytest.raises(ValueError, match="cache holds"):
            head(h[:1], emb[:1], 3, EagleCache())


@pytest.mark.parametrize("kept", [list(range(24)), [0, 2, 3, 5, 7, 11, 13, 17, 19, 23]])
@pytest.mark.parametrize("verifier", ["greedy", "token", "block"])
def test_greedy_output_with_the_head_equals_autoregressive(kept: list[int], verifier: str) -> None:
    target = tiny_llama(6, vocab=24, layers=3, sharpness=3.0)
    prompt = [3, 7, 1, 3, 7, 2, 3, 7]
    expected = [t for s in autoregressive_steps(HFCausalLM(target), prompt, sampling=GREEDY, max_new_tokens=20)
                for t in s.tokens]
    head = random_head(target, kept)
    for k in (1, 2, 4):
        backend = target_backend("eagle", target)
        drafter = EagleDrafter(backend, head)
        steps = list(speculative_steps(backend, drafter, make_verifier(verifier), StaticK(k), prompt,
                                       sampling=GREEDY, max_new_tokens=20))
        assert [t for s in steps for t in s.tokens] == expected, (verifier, k)
        assert sum(s.drafted for s in steps) > 0


def test_sampled_output_with_the_head_follows_the_target_law() -> None:
    vocab = 5
    target = tiny_llama(0, vocab=vocab, sharpness=6.0)
    head = random_head(target, kept=[0, 1, 3])  # q = 0 on tokens 2 and 4
    sampling = SamplingConfig(temperature=1.0)
    law = exact_target_law(target, sampling, vocab)
    assert (law.sum(axis=(1, 2))[[2, 4]] > 0.05).all()  # the target does pick the missing tokens
    assert chi_square_power(law, SAMPLES, effect=0.15) >= 0.95  # as in test_engine
    backend = ContextLM(target, keep_hidden=True)  # answers from memory: helpers.ContextLM
    drafter = EagleDrafter(backend, head)
    counts = np.zeros_like(law)
    accepted = 0
    for seed in range(SAMPLES):
        r = generate(backend, PROMPT, drafter=drafter, verify="block", k=2, policy="static", temperature=1.0,
                     max_new_tokens=3, seed=seed, eos_token_ids=[])
        counts[tuple(r.token_ids)] += 1
        accepted += r.stats.accepted_tokens
    assert accepted > SAMPLES // 10  # drafts are being accepted
    assert chi_square_p_value(counts, law) > SIGNIFICANCE


def test_the_head_samples_from_the_q_it_reports_and_forgets_rejected_tokens() -> None:
    target = tiny_llama(9, vocab=24, layers=2)
    kept = [1, 4, 6, 8, 9, 15, 20]
    head = random_head(target, kept)
    drafter = EagleDrafter(target_backend("eagle", target), head)
    sampling = SamplingConfig(temperature=1.3, top_k=5)
    contexts = [[5, 6, 7, 8], [5, 6, 7, 8, 2, 3], [5, 6, 7, 9], [5, 6, 7, 9, 1, 1, 4], [5, 6]]
    for seed, context in enumerate(contexts):
        draft = drafter.propose(context, 3, sampling, torch.Generator().manual_seed(seed))
        replay = torch.Generator().manual_seed(seed)
        assert draft.q.shape == (3, 24)
        assert torch.allclose(draft.q.sum(-1), torch.ones(3, dtype=draft.q.dtype))
        outside = [t for t in range(24) if t not in kept]
        assert float(draft.q[:, outside].abs().sum()) == 0.0
        assert [sample(row, replay) for row in draft.q] == draft.tokens.tolist()
        fresh = EagleDrafter(target_backend("eagle", target), head)
        again = fresh.propose(context, 3, sampling, torch.Generator().manual_seed(seed))
        assert torch.equal(again.tokens, draft.tokens) and torch.allclose(again.q, draft.q, atol=1e-6), context
    assert len(drafter.propose([5], 3, GREEDY, None)) == 0


def test_a_head_round_trips_and_bad_files_fail_clearly(tmp_path) -> None:
    target = tiny_llama(1, vocab=16)
    head = random_head(target, [0, 3, 5])
    head.save(tmp_path / "h")
    loaded = EagleHead.load(tmp_path / "h")
    h, emb = torch.randn(4, 32), torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(loaded(h, emb, 0), head(h, emb, 0))
    assert loaded.kept.tolist() == [0, 3, 5]
    (tmp_path / "h" / "eagle.safetensors").unlink()
    with pytest.raises(ValueError, match="eagle.safetensors is missing"):
        EagleHead.load(tmp_path / "h")
    head.save(tmp_path / "bad")
    (tmp_path / "bad" / "eagle.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="damaged"):
        EagleHead.load(tmp_path / "bad")
    with pytest.raises(ValueError, match="train them for this target"):
        EagleDrafter(target_backend("eagle", tiny_llama(1, vocab=20)), head)
    with pytest.raises(ValueError, match="keep_hidden"):
        EagleDrafter(HFCausalLM(target), head)
    head.save(tmp_path / "ok")
    assert make_drafter("eagle", target_backend("eagle", target), path=tmp_path / "ok").describe()["layers"] == 1
    with pytest.raises(ValueError, match="no one-layer draft head ships"):
        make_drafter("eagle", target_backend("eagle", target))


def test_windows_stay_inside_sequences() -> None:
    seq = torch.tensor([0] * 7 + [1] * 3 + [2] * 1)
    # sequence 0: pairs 0..5 (position 6 has no next); sequence 1: pairs 7..8; sequence 2: none
    assert eagle_windows(seq, 4) == [(0, 4, 0), (4, 6, 4), (7, 9, 0)]


def _patterned_sequences(n: int, length: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        start = rng.randrange(24)
        yield [(start + i) % 24 for i in range(length)]


def test_training_beats_an_untrained_head_and_resumes(tmp_path) -> None:
    target = tiny_llama(3, vocab=24, layers=2, sharpness=2.0)
    cfg = TrainConfig(kept_tokens=16, positions=2400, seq_len=24, epochs=4, batch=32, lr=3e-3, seed=0, kind="eagle")
    logs: list[str] = []
    collect(target, _patterned_sequences(200, 24, 0), tmp_path, cfg, logs.append, shard_positions=400)
    hidden, labels, seq = load_data(tmp_path / "data")
    ids = load_ids(tmp_path / "data")
    assert ids[:24].tolist() == list(_patterned_sequences(1, 24, 0))[0]  # the inputs are stored
    head = train_eagle(target, tmp_path, cfg, logs.append)
    agreement = head.config.training["held_out_agreement"]
    torch.manual_seed(1)
    untrained = EagleHead(head.config, head.kept)
    index = torch.full((24,), -100, dtype=torch.long)
    index[head.kept] = torch.arange(head.kept.numel())
    held_out = [w for w in eagle_windows(seq, head.config.window) if int(seq[w[0]]) % 10 == 9]
    head_w = target.lm_head.weight.detach()[head.kept]
    baseline = evaluate_eagle(untrained, hidden, ids, index[labels], target.get_input_embeddings(), head_w,
                              held_out, "cpu")
    assert agreement[0] > baseline[0] + 0.2, (agreement, baseline)
    assert agreement[1] > baseline[1] + 0.2, (agreement, baseline)
    assert (tmp_path / "eagle.safetensors").is_file()
    logs.clear()
    again = train_eagle(target, tmp_path, cfg, logs.append)  # all epochs done: resumes and trains none
    assert any("resuming after epoch 4" in line for line in logs)
    h, emb = hidden[:5].float(), torch.randn(5, 32)
    with torch.no_grad():
        assert torch.equal(again(h, emb, 0), head(h, emb, 0))
