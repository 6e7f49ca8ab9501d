"""The drafters beyond the draft model: n-gram lookup, early exit, layer skipping.

- the layered backend reproduces the stock transformers forward, and shares its cache with the
  early-exit drafter (the verify pass recomputes nothing below the exit);
- every drafter gives greedy speculative output identical to greedy autoregressive decoding;
- self-drafters sample each token from the q they report (replayed with the same generator);
- the n-gram index stays correct as the context grows and is cut back;
- the n-gram drafter's point-mass drafts keep the target's law exactly under token and block
  verification (exact enumeration over a 3-token vocabulary).
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import zlib

import numpy as np
import pytest
import torch
from tiny import tiny_llama
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec.backends.hf import HFCausalLM
from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.build import make_drafter
from specdec.drafters import names as drafter_names
from specdec import layer_skip_search as tuning
from specdec.drafters.early_exit import EarlyExitDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.layer_skip import LayerSkipDrafter, load_skip_set, model_key, save_skip_set
from specdec.drafters.ngram import NGramDrafter, NGramIndex
from specdec.engine import autoregressive_steps, speculative_steps
from specdec.policies import StaticK, make_policy
from specdec.sampling import SamplingConfig, sample
from specdec.verify import make_verifier

GREEDY = SamplingConfig()


def tiny_qwen2(seed: int, vocab: int = 32, layers: int = 4) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(config).float().eval()


def reference_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


# -- the layered backend ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama-sdpa", "llama-eager", "qwen2"])
def test_layered_forward_matches_stock_through_drafts_and_rollbacks(arch):
    if arch == "qwen2":
        model = tiny_qwen2(1)
    else:
        model = tiny_llama(1, vocab=32, layers=5)
        model.config._attn_implementation = arch.split("-")[1]
    n = model.config.num_hidden_layers
    backend = HFLayeredCausalLM(model)
    rng = random.Random(0)
    prompt = [rng.randrange(32) for _ in range(9)]
    assert torch.allclose(backend.forward(prompt), reference_logits(model, prompt), atol=1e-5)
    for step in range(24):
        if step % 2:
            layers = range(rng.randrange(1, n))  # early exit
        else:
            skip = set(rng.sample(range(n), rng.randrange(1, n)))
            layers = [i for i in range(n) if i not in skip]
        context = backend.tokens + [rng.randrange(32)]
        draft: list[int] = []
        for _ in range(rng.randrange(4)):
            backend.forward_layers(context + draft, layers, 1)
            draft.append(rng.randrange(32))
        keep = min(len(backend.tokens), len(context) - 1)
        backend.trim(keep)
        logits = backend.forward(context[keep:] + draft, num_logits=1 + len(draft))
        expected = reference_logits(model, context + draft)[-1 - len(draft) :]
        assert torch.allclose(logits, expected, atol=1e-5), step
        backend.trim(len(context) + rng.randrange(len(draft) + 1))
    assert [layer.get_seq_length() for layer in backend._cache.layers] == backend._length


def test_early_exit_logits_are_the_truncated_model():
    model = tiny_llama(2, vocab=32, layers=4)
    seq = list(range(3, 15))
    with torch.no_grad():
        hidden = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    for exit_layer in (1, 2, 3):
        backend = HFLayeredCausalLM(model)
        got = backend.forward_layers(seq, range(exit_layer), len(seq))
        expected = model.lm_head(model.model.norm(hidden[exit_layer]))[0]
        assert torch.allclose(got, expected, atol=1e-5)


def test_skipping_layers_runs_the_model_without_them():
    model = tiny_llama(3, vocab=32, layers=5)
    seq = list(range(2, 14))
    for skip in ([1], [0, 3], [2, 3, 4]):
        pruned = copy.deepcopy(model)
        pruned.model.layers = torch.nn.ModuleList(
            [layer for i, layer in enumerate(pruned.model.layers) if i not in skip]
        )
        pruned.config.num_hidden_layers = len(pruned.model.layers)
        with torch.no_grad():
            expected = pruned(torch.tensor([seq]), use_cache=False).logits[0]
        backend = HFLayeredCausalLM(model)
        got = backend.forward_layers(seq, [i for i in range(5) if i not in skip], len(seq))
        assert torch.allclose(got, expected, atol=1e-5), skip


def count_positions(model) -> list[int]:
    """Register hooks that count, per decoder layer, the positions it computes."""
    counts = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda _m, args, kwargs, i=i: counts.__setitem__(i, counts[i] + args[0].shape[1]),
            with_kwargs=True,
        )
    return counts


def test_early_exit_shares_the_cache_with_verification():
    model = tiny_llama(4, vocab=32, layers=4)
    backend = HFLayeredCausalLM(model)
    drafter = EarlyExitDrafter(backend, exit_layer=2)
    context = list(range(1, 11))
    backend.forward(context[:-1])
    counts = count_positions(model)
    draft = drafter.propose(context, 3, GREEDY, None)
    assert counts == [3, 3, 0, 0]  # the last context token and two drafts
    counts[:] = [0] * 4
    backend.trim(len(context) - 1)  # what forward_after does: no-op, the extras stay
    backend.forward(context[-1:] + draft.tokens.tolist(), num_logits=4)
    assert counts == [1, 1, 4, 4]  # below the exit only the last draft token is new
    # and those logits are the stock model's
    full = reference_logits(model, context + draft.tokens.tolist())[-4:]
    backend.trim(len(context) - 1)
    assert torch.allclose(backend.forward(context[-1:] + draft.tokens.tolist(), 4), full, atol=1e-5)


def test_layered_backend_refuses_unsupported_models():
    model = tiny_qwen2(5)
    model.config.use_sliding_window = True
    with pytest.raises(ValueError, match="sliding"):
        HFLayeredCausalLM(model)
    with pytest.raises(ValueError, match="layered backend"):
        EarlyExitDrafter(HFCausalLM(tiny_llama(5)), exit_layer=1)


# -- greedy equality for every drafter ----------------------------------------------------------


def ar_greedy(model, prompt, n):
    steps = autoregressive_steps(HFCausalLM(model), prompt, sampling=GREEDY, max_new_tokens=n)
    return [t for s in steps for t in s.tokens]


DRAFTER_CASES = [
    ("model", {}),
    ("ngram", {}),
    ("early-exit", {"exit_layer": 1}),
    ("early-exit", {"exit_layer": 3}),
    ("layer-skip", {"skip": [2]}),
    ("layer-skip", {"skip": [0, 1]}),
    ("layer-skip", {"skip": []}),
]


@pytest.mark.parametrize("name,options", DRAFTER_CASES)
@pytest.mark.parametrize("verifier", ["greedy", "token", "block"])
def test_greedy_speculative_output_equals_autoregressive(name, options, verifier):
    target = tiny_llama(6, vocab=24, layers=4, sharpness=3.0)
    prompt = [3, 7, 1, 3, 7, 2, 3, 7]
    expected = ar_greedy(target, prompt, 20)
    for k in (1, 4):
        backend = HFLayeredCausalLM(target) if name in ("early-exit", "layer-skip") else HFCausalLM(target)
        draft = HFCausalLM(tiny_llama(7, vocab=24, layers=1)) if name == "model" else None
        drafter = make_drafter(name, backend, draft, **options)
        steps = list(
            speculative_steps(
                backend, drafter, make_verifier(verifier), StaticK(k), prompt,
                sampling=GREEDY, max_new_tokens=20,
            )
        )
        assert [t for s in steps for t in s.tokens] == expected, (name, options, verifier, k)


def test_self_draft_without_skipping_is_always_accepted():
    target = tiny_llama(8, vocab=24, layers=3)
    backend = HFLayeredCausalLM(target)
    drafter = LayerSkipDrafter(backend, skip=[])
    steps = list(
        speculative_steps(backend, drafter, make_verifier("greedy"), StaticK(4), [1, 2, 3],
                          sampling=GREEDY, max_new_tokens=20)
    )
    assert all(s.accepted == s.drafted for s in steps)


@pytest.mark.parametrize("name,options", [("early-exit", {"exit_layer": 2}), ("layer-skip", {"skip": [1]})])
def test_self_drafters_sample_from_the_q_they_report(name, options):
    backend = HFLayeredCausalLM(tiny_llama(9, vocab=24, layers=4))
    drafter = make_drafter(name, backend, **options)
    sampling = SamplingConfig(temperature=1.3, top_k=10, top_p=0.95)
    context = [5, 6, 7, 8]
    for seed in range(5):
        draft = drafter.propose(context, 4, sampling, torch.Generator().manual_seed(seed))
        replay = torch.Generator().manual_seed(seed)
        assert draft.q.shape == (4, 24)
        assert torch.allclose(draft.q.sum(-1), torch.ones(4))
        assert [sample(row, replay) for row in draft.q] == draft.tokens.tolist()
        drafter.observe(context)


def test_keep_going_gets_the_drafts_own_confidence_and_can_stop_it():
    backend = HFLayeredCausalLM(tiny_llama(10, vocab=24, layers=4))
    drafter = EarlyExitDrafter(backend, exit_layer=2)
    seen = []
    draft = drafter.propose([1, 2, 3], 5, GREEDY, None, lambda q: seen.append(q) or len(seen) < 2)
    assert len(draft) == 2
    assert all(0 < float(q.max()) < 1 for q in seen)  # a softmax, not the one-hot greedy q


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.7)])
def test_the_model_drafter_shows_its_own_softmax_to_keep_going(sampling):
    model = HFCausalLM(tiny_llama(11, vocab=24, layers=2))
    seen = []
    draft = ModelDrafter(model).propose([1, 2, 3], 5, sampling, torch.Generator().manual_seed(0),
                                        lambda q: seen.append(q) or len(seen) < 3)
    assert len(draft) == 3 and len(seen) == 3
    assert all(0 < float(q.max()) < 1 for q in seen)  # under greedy too: not the one-hot q
    # The draft model's own softmax (temperature 1, no filter) at each drafted position, whatever
    # the sampling settings: at the first position, that of the context's last logits.
    own = torch.softmax(tiny_llama(11, vocab=24, layers=2)(torch.tensor([[1, 2, 3]])).logits[0, -1].float(), -1)
    assert torch.allclose(seen[0], own, atol=1e-6)


# -- the n-gram drafter ------------------------------------------------------------------------


def brute_force_positions(seq, max_ngram):
    positions = {}
    for i in range(1, len(seq)):
        for n in range(1, min(max_ngram, i) + 1):
            positions.setdefault(tuple(seq[i - n : i]), []).append(i)
    return positions


def test_ngram_index_follows_growth_and_cuts():
    rng = random.Random(1)
    index = NGramIndex(max_ngram=3)
    context: list[int] = []
    for _ in range(300):
        if context and rng.random() < 0.3:
            context = context[: rng.randrange(len(context) + 1)]  # a rejection: cut back to a prefix
        elif context and rng.random() < 0.05:
            context = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]  # a different prompt
        else:
            context = context + [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
        index.sync(context)
        assert index.seq == context
        assert index.positions == brute_force_positions(context, 3)


def test_ngram_proposes_the_continuation_of_the_longest_recent_match():
    drafter = NGramDrafter(vocab_size=10, max_ngram=3)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    draft = drafter.propose(context, 3, GREEDY, None)
    assert draft.tokens.tolist() == [4, 9, 2]  # "1 2 3" matched at 0..2, not the later "2 3"
    assert torch.equal(draft.q, torch.nn.functional.one_hot(draft.tokens, 10).float())
    # a 1-gram match takes the most recent occurrence; copying runs on over its own proposals
    assert drafter.propose([7, 8, 7], 5, GREEDY, None).tokens.tolist() == [8, 7, 8, 7, 8]
    assert len(drafter.propose([1, 2, 3], 4, GREEDY, None)) == 0  # nothing repeats
    assert drafter.propose([1, 2, 3], 4, GREEDY, None).q.shape == (0, 10)


def test_ngram_draft_stops_when_told():
    drafter = NGramDrafter(vocab_size=10)
    draft = drafter.propose([1, 2, 1, 2, 1], 6, GREEDY, None, lambda q: False)
    assert len(draft) == 1


TAG = "ngram-exact"


def toy_target(vocab: int):
    """A context-dependent target law (float64), strongly favouring repeats so drafts get accepted."""

    def p(context: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng(zlib.crc32(repr((TAG, context)).encode()))
        d = rng.dirichlet(np.full(vocab, 0.8))
        if len(context) >= 3:
            d[context[-3]] += 1.0  # period-3 repetition is likely
        return d / d.sum()

    return p


def ngram_speculative_joint(verifier_name, p, vocab, prompt, horizon, k):
    """Exact law of the first ``horizon`` tokens, the n-gram drafter's proposals as drafts."""
    verifier = make_verifier(verifier_name)
    drafter = NGramDrafter(vocab_size=vocab, max_ngram=2)
    law: dict[tuple[int, ...], float] = {}

    def unroll(out: tuple[int, ...], prob: float) -> None:
        if len(out) >= horizon:
            law[out[:horizon]] = law.get(out[:horizon], 0.0) + prob
            return
        context = list(prompt) + list(out)
        draft = drafter.propose(context, k, GREEDY, None)
        tokens = draft.tokens.tolist()
        rows = [p(tuple(context + tokens[:i])) for i in range(len(tokens) + 1)]
        plan = verifier.plan(draft.tokens, draft.q.double(), torch.tensor(np.array(rows)))
        for n, pn in enumerate(plan.accept_len_probs.tolist()):
            if pn <= 0:
                continue
            row = plan.next_token_probs[n].double()
            row = row / row.sum()
            for y, py in enumerate(row.tolist()):
                if py > 0:
                    unroll(out + tuple(tokens[:n]) + (y,), prob * pn * py)

    unroll((), 1.0)
    return law


@pytest.mark.parametrize("verifier", ["token", "block"])
@pytest.mark.parametrize("k", [1, 3])
def test_ngram_point_mass_drafts_keep_the_target_law_exactly(verifier, k):
    vocab, horizon = 3, 5
    prompt = (0, 1, 2, 0, 1)
    p = toy_target(vocab)
    got = ngram_speculative_joint(verifier, p, vocab, prompt, horizon, k)
    for seq in itertools.product(range(vocab), repeat=horizon):
        expected = 1.0
        for t in range(horizon):
            expected *= p(prompt + seq[:t])[seq[t]]
        assert abs(got.get(seq, 0.0) - expected) < 1e-9, seq


def test_ngram_sampled_engine_run_is_reproducible_and_in_vocabulary():
    target = HFCausalLM(tiny_llama(11, vocab=16, layers=2))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    outs = []
    for _ in range(2):
        target.reset()
        steps = speculative_steps(
            target, NGramDrafter(16), make_verifier("block"), make_policy("heuristic", 3), prompt,
            sampling=SamplingConfig(temperature=1.0), max_new_tokens=25,
            generator=torch.Generator().manual_seed(3),
        )
        outs.append([t for s in steps for t in s.tokens])
    assert outs[0] == outs[1] and len(outs[0]) == 25 and all(0 <= t < 16 for t in outs[0])


# -- registry and the skip-set store -----------------------------------------------------------


def test_make_drafter_checks_names_and_options():
    backend = HFLayeredCausalLM(tiny_llama(12, vocab=16, layers=3))
    assert set(drafter_names()) == {"model", "ngram", "ngram+model", "early-exit", "layer-skip", "heads", "eagle",
                                    "retrieval", "retrieval+model", "lookahead", "cascade"}
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("medusa", backend)
    with pytest.raises(ValueError, match="needs a draft model"):
        make_drafter("model", backend)
    with pytest.raises(ValueError, match="bad option"):
        make_drafter("ngram", backend, exit_layer=2)
    with pytest.raises(ValueError, match="exit_layer"):
        make_drafter("early-exit", backend, exit_layer=3)
    with pytest.raises(ValueError, match="skip"):
        make_drafter("layer-skip", backend, skip=[0, 1, 2])
    assert make_drafter("early-exit", backend).exit_layer == 1  # two below the top of 3 layers


def test_skip_sets_are_saved_per_model_and_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = tiny_llama(13, vocab=16, layers=6)
    model.config._name_or_path = "/somewhere/tiny-model/"
    assert model_key(model) == "tiny-model-6x32"
    skip, source = load_skip_set(model)
    assert source == "heuristic" and skip == [2, 3]  # the middle fifth, rounded
    result = tuning.SkipSearchResult(model_key(model), [2, 4], 1.3, 0.7, 3, 6, 1.0)
    path = save_skip_set(model, result)
    assert path.parent == tmp_path / "layer_skip"
    assert json.loads(path.read_text())["skip"] == [2, 4]
    drafter = LayerSkipDrafter(HFLayeredCausalLM(model))
    assert drafter.skip == [2, 4] and drafter.source.startswith("searched")


def test_skip_search_is_bounded_and_returns_a_working_set(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = tiny_llama(14, vocab=24, layers=4, sharpness=3.0)
    prompts = [[1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6]]
    result = tuning.search_skip_set(model, prompts, time_budget=20, new_tokens=8, measure_top=2)
    assert result.seconds < 40 and 1 <= len(result.skip) < 4
    assert result.path and all("agreement" in entry for entry in result.path)
    assert any("measured" in entry for entry in result.path)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_search_scores_skip_sets_by_the_engines_first_draft(attn):
    model = tiny_llama(15, vocab=32, layers=5)
    model.config._attn_implementation = attn
    seq = list(range(1, 16))
    scored = tuning._ContextKV.of(model, seq)
    backend = HFLayeredCausalLM(model)
    for layers, start in (([0, 2, 4], 0), ([1, 3], 1), (list(range(5)), 0)):
        logits = scored.first_draft_logits(backend, seq, layers, start)
        assert logits.shape == (len(seq) - start, 32)
        for t in (1, 7, 14):
            backend.reset()
            backend.forward(seq[:t])  # the verified context, as after a target step
            drafted = backend.forward_layers(seq[: t + 1], layers, 1)[-1]
            assert torch.allclose(logits[t - start], drafted, atol=1e-5), (layers, t)


def test_the_default_target_ships_a_searched_skip_set(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # no user-searched set
    config = SimpleNamespace(
        _name_or_path="/cache/qwen2.5-coder-1.5b", model_type="qwen2", num_hidden_layers=28, hidden_size=1536
    )
    skip, source = load_skip_set(SimpleNamespace(config=config))
    assert source == "shipped default" and skip and max(skip) < 27
