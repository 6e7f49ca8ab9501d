"""The llama.cpp backend on the SmolLM2-135M GGUF (pack ``smollm2-135m``).

Skipped, with the reason, when the binding (llama-cpp-python) or the pack is not installed. What
holds on this file, measured: its kernels are batch invariant (a row of an n-token pass has the
very logits of a one-token step, up to n = 40 tried), so the tests assert bit-identity for chains
and trees, and greedy speculative output equal to the backend's own greedy decoding.
"""

from __future__ import annotations

import builtins
import shutil

import numpy as np
import pytest
import torch

from specdec import generate, models
from specdec.backends import llamacpp
from specdec.tree import TokenTree, forward_tree, keep_path

from test_engine import SIGNIFICANCE, chi_square_p_value, chi_square_power

PACK = "smollm2-135m"


def _gguf():
    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    missing = models.missing_parts(models.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {models.PACKS[PACK].install_command(missing)}")
    return models.gguf_file(PACK, progress=False)


@pytest.fixture(scope="module")
def model():
    return llamacpp.load_gguf(_gguf(), n_threads=2, n_ctx=512, prefill_layout="repacked")


# Token ids of some English and code text in SmolLM2's vocabulary (any ids would do).
CONTEXT = [504, 1070, 28, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30]
EXTRA = [3158, 314, 260, 1345, 30, 2784, 28, 1070, 30, 504, 28, 30, 4667, 314, 260, 1345]


def one_token_steps(model, context, tokens):
    """Logits after context and after each of tokens, fed one token at a time: [1 + n, V]."""
    model.reset()
    model.forward(context[:-1])
    return torch.stack([model.forward([t])[0] for t in [context[-1], *tokens]])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16])
def test_an_n_token_pass_equals_one_token_steps(model, n):
    steps = one_token_steps(model, CONTEXT, EXTRA[:n])
    model.reset()
    model.forward(CONTEXT[:-1])
    rows = model.forward([CONTEXT[-1], *EXTRA[:n]])
    assert rows.dtype == torch.float32 and rows.shape == (1 + n, model.vocab_size)
    assert torch.equal(rows, steps)
    model.trim(len(CONTEXT))
    assert torch.equal(model.forward(EXTRA[:n], num_logits=2), steps[-2:] if n > 1 else steps[-1:])


def test_prefill_is_fed_in_n_batch_chunks(model):
    """A 150-token prompt with n_batch=64 is three llama_decode calls of 64, 64 and 22 tokens.
    (Rows of a pass this long are not bit-identical to a single 150-token pass: the prefill is
    batch-size dependent beyond some tens of rows, which no output depends on, since greedy
    decoding and every speculative method prefill the prompt the same way.)"""
    prompt = (CONTEXT * 8)[:150]
    small = llamacpp.LlamaCppCausalLM(model.weights, n_threads=2, n_ctx=512, n_batch=64)
    chunked = small.forward(prompt, num_logits=30)  # [30, V]: rows from the last two chunks
    model.reset()
    model.forward(prompt[:64])
    by_hand = torch.cat([model.forward(prompt[64:128])[-8:], model.forward(prompt[128:])])
    assert torch.equal(chunked, by_hand)
    assert small.tokens == prompt


def _layouts_agree(path) -> bool:
    """Whether a 100-token pass gives bit-identical logits on the repacked and the stored layout."""
    ids = (CONTEXT * 5)[:100]
    runs = [llamacpp.LlamaCppCausalLM(llamacpp.GGUFWeights(path, repack=r), n_threads=2, n_ctx=512).forward(ids)
            for r in (True, False)]
    return torch.equal(*runs)


def test_a_prefill_on_the_stored_layout_leaves_the_cache_decoding_would_have(monkeypatch):
    """Chains of PREFILL_ROWS tokens or more run in a second context on the file's layout and their
    cells move into the decoding context. This file's quantisation is not repacked, so both layouts
    compute bit-identical logits: any cell the move lost, shifted or left behind shows up as a
    difference from a model that never moves anything -- in the moved pass, in the steps after it,
    and after a rollback into the moved cells and a second long chain on top of a cache."""
    path = _gguf()
    assert _layouts_agree(path), "on this file the stored and repacked layouts should compute the same logits"
    moves = []
    real_move = llamacpp._move_sequence
    monkeypatch.setattr(llamacpp, "_move_sequence", lambda a, b: (moves.append((a, b)), real_move(a, b))[1])
    split = llamacpp.load_gguf(path, n_threads=2, n_ctx=512, prefill_layout="file")
    plain = llamacpp.load_gguf(path, n_threads=2, n_ctx=512, prefill_layout="repacked")
    assert split.prefill_choice == {"layout": "file", "source": "asked for"} and plain.prefill_weights is None
    prompt = (CONTEXT * 6)[: llamacpp.PREFILL_ROWS + 36]
    for m in (split, plain):
        m.reset()
    assert torch.equal(split.forward(prompt, num_logits=3), plain.forward(prompt, num_logits=3))
    assert [(a is split, b is split) for a, b in moves] == [(False, True)]  # prefilled elsewhere, moved in
    for t in EXTRA[:5]:
        assert torch.equal(split.forward([t]), plain.forward([t]))
    for m in (split, plain):
        m.trim(30)  # back into the moved cells
    chain = (EXTRA * 5)[: llamacpp.PREFILL_ROWS]
    assert torch.equal(split.forward(chain), plain.forward(chain))
    assert [(a is split, b is split) for a, b in moves[1:]] == [(True, False), (False, True)]  # out and back
    assert torch.equal(split.forward(EXTRA[:3]), plain.forward(EXTRA[:3]))
    assert split.tokens == plain.tokens and split._prefiller.tokens == []
    split.forward((EXTRA * 4)[: llamacpp.PREFILL_ROWS - 1])  # shorter chains stay where they are
    assert len(moves) == 3


def test_a_failed_move_between_contexts_is_an_error_and_leaves_an_empty_cache(monkeypatch):
    split = llamacpp.load_gguf(_gguf(), n_threads=2, n_ctx=512, prefill_layout="file")
    monkeypatch.setattr(split._api, "llama_state_seq_set_data", lambda *args: 0)
    with pytest.raises(RuntimeError, match="could not move a sequence's cache between contexts"):
        split.forward((CONTEXT * 4)[: llamacpp.PREFILL_ROWS])
    assert split.tokens == []
    monkeypatch.undo()
    assert split.forward(CONTEXT, num_logits=1).shape == (1, split.vocab_size)  # usable again


def test_the_prefill_layout_is_measured_once_then_read_from_the_cache(model, tmp_path):
    model.reset()
    model.forward(CONTEXT)
    before = model.forward(EXTRA[:1])
    model.trim(len(CONTEXT))
    first = llamacpp.choose_prefill_layout(model, cache_dir=tmp_path)
    assert first["source"] == "measured" and first["rows"] == llamacpp.PREFILL_ROWS
    assert first["layout"] in ("file", "repacked") and all(v > 0 for v in first["seconds"].values())
    wins = first["seconds"]["file"] < llamacpp.PREFILL_MARGIN * first["seconds"]["repacked"]
    assert first["layout"] == ("file" if wins else "repacked")
    assert llamacpp.choose_prefill_layout(model, cache_dir=tmp_path) == {**first, "source": "cache"}
    assert model.tokens == CONTEXT and torch.equal(model.forward(EXTRA[:1]), before)  # the cache as it was


def test_a_bad_prefill_layout_is_refused():
    with pytest.raises(ValueError, match="prefill_layout must be one of auto, file, repacked"):
        llamacpp.load_gguf(_gguf(), prefill_layout="stored")


def test_rollback_trims_the_cache_by_absolute_length(model):
    steps = one_token_steps(model, CONTEXT, EXTRA[:4])
    model.reset()
    model.forward(CONTEXT)
    model.forward([11, 12, 13])  # a rejected draft
    model.trim(len(CONTEXT))
    assert model.tokens == CONTEXT
    assert torch.equal(model.forward(EXTRA[:4]), steps[1:])
    model.trim(10_000)  # longer than the cache: nothing happens
    assert len(model.tokens) == len(CONTEXT) + 4


TREE = TokenTree([3158, 2784, 314, 30, 260, 28], [-1, -1, 0, 0, 2, 1])


def path_logits(model, nodes):
    """Logits after the context and after each node of a root-to-node path, one token at a time."""
    return one_token_steps(model, CONTEXT, [TREE.tokens[i] for i in nodes])


def test_a_tree_pass_scores_every_node_as_its_path_would(model):
    model.reset()
    model.forward(CONTEXT[:-1])
    rows = forward_tree(model, CONTEXT, TREE)  # [1 + N, V]
    for leaf in (4, 3, 5):
        path = TREE.path(leaf)
        expected = path_logits(model, path)
        assert torch.equal(rows[0], expected[0])
        for depth, node in enumerate(path, start=1):
            assert torch.equal(rows[1 + node], expected[depth])


@pytest.mark.parametrize("path", [[0, 2], [1], [0, 3], []])
def test_keep_path_leaves_exactly_that_path_in_the_cache(model, path):
    model.reset()
    model.forward(CONTEXT[:-1])
    forward_tree(model, CONTEXT, TREE)
    keep_path(model, len(CONTEXT), path)
    kept = CONTEXT + [TREE.tokens[i] for i in path]
    assert model.tokens == kept
    after = model.forward([30])[0]
    # The freed sibling cells leave holes that change the attention's summation order, so the
    # logits need not be bit-identical to a fresh cache; they must be those of this path and
    # of no other path of the tree.
    own = one_token_steps(model, kept, [30])[-1]
    others = [CONTEXT + [TREE.tokens[i] for i in TREE.path(u)] for u in range(len(TREE)) if TREE.path(u) != path]
    gap = float((after - own).abs().max())
    assert all(gap < float((after - one_token_steps(model, o, [30])[-1]).abs().max()) for o in others)
    assert torch.equal(after.argmax(), own.argmax())


def test_masks_that_are_not_a_tree_on_the_whole_cache_are_refused(model):
    model.reset()
    model.forward(CONTEXT)
    hidden = torch.ones(2, len(CONTEXT) + 2, dtype=torch.bool).tril(len(CONTEXT))
    hidden[:, 0] = False
    with pytest.raises(ValueError, match="whole cache"):
        model.forward([1, 2], attend=hidden, positions=[20, 21])
    crossed = torch.ones(2, len(CONTEXT) + 2, dtype=torch.bool)  # the first token sees the second
    with pytest.raises(ValueError, match="not a token-tree mask"):
        model.forward([1, 2], attend=crossed, positions=[20, 21])
    assert model.tokens == CONTEXT


def test_greedy_speculative_output_equals_its_own_autoregressive_output(model):
    tokenizer = _tokenizer()
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef"
    model.reset()
    ar = generate(model, prompt, tokenizer=tokenizer, max_new_tokens=40, eos_token_ids=[])
    assert len(ar.token_ids) == 40
    draft = model.fork()  # the same weights as their own draft: a second context and KV cache
    for kwargs in (dict(draft=draft, verify="block", k=4, policy="static"),
                   dict(draft=draft, verify="greedy", k=5, policy="static"),
                   dict(drafter="ngram", verify="greedy", k=4, policy="static"), dict(draft=draft, verify="tree")):
        spec = generate(model, prompt, tokenizer=tokenizer, max_new_tokens=40, eos_token_ids=[], **kwargs)
        assert spec.token_ids == ar.token_ids, kwargs
        assert spec.stats.target_forwards < len(ar.token_ids), kwargs
    selfdraft = generate(model, prompt, tokenizer=tokenizer, draft=draft, k=4, policy="static", max_new_tokens=40,
                         eos_token_ids=[])
    assert selfdraft.stats.acceptance_rate == 1.0  # draft = target accepts every greedy draft token


def _tokenizer():
    from transformers import AutoTokenizer

    path = _gguf()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    models.fix_gguf_tokenizer(tokenizer, path)
    return tokenizer


SAMPLES = 2000
TOP_K = 3


def test_sampled_speculative_output_follows_the_target_law(model):
    """Chi-square through the engine at T=1 (top-3, 2 tokens: 9 sequences) with the n-gram
    drafter, whose drafts on this repetitive prompt are often proposed and often rejected."""
    from specdec.sampling import SamplingConfig, logits_to_probs

    sampling = SamplingConfig(temperature=1.0, top_k=TOP_K)
    prompt = CONTEXT
    model.reset()
    first = logits_to_probs(model.forward(prompt, num_logits=1)[0].double(), sampling)  # [V]
    law = {}
    for a in torch.nonzero(first).flatten().tolist():
        model.trim(len(prompt))
        second = logits_to_probs(model.forward([a])[0].double(), sampling)
        for b in torch.nonzero(second).flatten().tolist():
            law[(a, b)] = float(first[a] * second[b])
    keys = sorted(law)
    expected = np.array([law[key] for key in keys])
    # Stated power: a deviation of Cohen's w = 0.15 is detected with probability >= 0.95.
    assert chi_square_power(expected, SAMPLES, effect=0.15) >= 0.95
    counts = np.zeros(len(keys))
    accepted = 0
    for seed in range(SAMPLES):
        r = generate(model, prompt, drafter="ngram", verify="block", k=2, policy="static", temperature=1.0, top_k=TOP_K,
                     max_new_tokens=2, seed=seed, eos_token_ids=[])
        counts[keys.index(tuple(r.token_ids))] += 1
        accepted += r.stats.accepted_tokens
    assert accepted > 0  # drafts are really being accepted, not just resampled
    assert chi_square_p_value(counts, expected) > SIGNIFICANCE


def test_a_missing_binding_is_reported_with_the_install_command(monkeypatch):
    real_import = builtins.__import__

    def no_binding(name, *args, **kwargs):
        if name == llamacpp.MODULE or name.startswith(llamacpp.MODULE + "."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_binding)
    llamacpp._api.cache_clear()
    try:
        with pytest.raises(llamacpp.LlamaCppUnavailable, match="pip install llama-cpp-python=="):
            llamacpp.load_gguf(_gguf())
    finally:
        monkeypatch.undo()
        llamacpp._api.cache_clear()


def test_a_truncated_or_foreign_file_is_named_in_the_error(tmp_path):
    source = _gguf()
    truncated = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        truncated.write_bytes(f.read(5_000_000))
    with pytest.raises(ValueError, match="cut.gguf: llama.cpp cannot load this GGUF file"):
        llamacpp.load_gguf(truncated)
    foreign = tmp_path / "notes.gguf"
    foreign.write_text("hello")
    with pytest.raises(ValueError, match="notes.gguf: not a GGUF file"):
        llamacpp.load_gguf(foreign)
    with pytest.raises(ValueError, match="no such GGUF file"):
        llamacpp.load_gguf(tmp_path / "absent.gguf")
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_context_limit_is_max_context(model):
    assert model.max_context == 512
    model.reset()
    with pytest.raises(ValueError, match="past the context of 512"):
        model.forward([1] * 513)
