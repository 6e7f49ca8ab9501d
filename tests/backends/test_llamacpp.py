"""The llama.cpp backend on the SmolLM2-135M GGUF (pack ``smollm2-135m``), and on its first 6 layers
for the tests that decode thousands of tokens (the ``shallow`` fixture).

Skipped, with the reason, when the binding (llama-cpp-python) or the pack is not installed. What
holds on this file, measured: its kernels are batch invariant (a row of an n-token pass has the
very logits of a one-token step, up to n = 40 tried), so the tests assert bit-identity for chains
and trees, and greedy speculative output equal to the backend's own greedy decoding.
"""

from __future__ import annotations

import math
from typing import Any

import builtins
import functools
import shutil

import numpy as np
import pytest
import torch

from specdec import generate, tokenizers
from specdec.backends import llamacpp
from specdec.token_tree import TokenTree, forward_tree, keep_path

from helpers import (
    THREADS, CONTEXT, SIGNIFICANCE, _Unsure, chi_square_p_value, chi_square_power, _gguf, smollm2_llamacpp,
)


@pytest.fixture(scope="module")
def model():
    return smollm2_llamacpp()


@pytest.fixture(scope="module")
def shallow():
    """The file's first 6 of its 30 layers (helpers.first_layers_gguf): the same tokenizer, tensor
    types and kernels at about a third of a step's cost, for the tests that decode thousands of
    tokens to compare speculative output with plain decoding (which the model's depth does not
    change: a row equals a one-token step's bits or it does not)."""
    return smollm2_llamacpp(6)


# Token ids of some English and code text in SmolLM2's vocabulary (any ids would do).
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
    (On the bf16 KV cache that load_gguf gives this batch-invariant model, the rows also equal
    a single 150-token pass's: test_trees_of_every_budget... and docs/backends.md.)"""
    prompt = (CONTEXT * 8)[:150]
    assert model.kv_type == "bf16"
    small = llamacpp.LlamaCppCausalLM(model.weights, n_threads=THREADS, n_ctx=512, n_batch=64, kv_type=model.kv_type)
    chunked = small.forward(prompt, num_logits=30)  # [30, V]: rows from the last two chunks
    model.reset()
    model.forward(prompt[:64])
    by_hand = torch.cat([model.forward(prompt[64:128])[-8:], model.forward(prompt[128:])])
    assert torch.equal(chunked, by_hand)
    assert small.tokens == prompt


def _layouts_agree(path) -> bool:
    """Whether a 100-token pass gives bit-identical logits on the repacked and the stored layout."""
    ids = (CONTEXT * 5)[:100]
    runs = [llamacpp.LlamaCppCausalLM(llamacpp.GGUFWeights(path, repack=r), n_threads=THREADS, n_ctx=512).forward(ids)
            for r in (True, False)]
    return torch.equal(*runs)


def test_a_prefill_on_the_stored_layout_leaves_the_cache_decoding_would_have(monkeypatch):
    """Chains of FILE_LAYOUT_ROWS tokens or more run in a second context on the file's layout and their
    cells move into the decoding context. This file's quantisation is not repacked, so both layouts
    compute bit-identical logits: any cell the move lost, shifted or left behind shows up as a
    difference from a model that never moves anything -- in the moved pass, in the steps after it,
    and after a rollback into the moved cells and a second long chain on top of a cache."""
    path = _gguf()
    assert _layouts_agree(path), "on this file the stored and repacked layouts should compute the same logits"
    moves = []
    real_move = llamacpp._move_sequence
    monkeypatch.setattr(llamacpp, "_move_sequence", lambda a, b: (moves.append((a, b)), real_move(a, b))[1])
    split = llamacpp.load_gguf(path, n_threads=THREADS, n_ctx=512, prefill_layout="file")
    plain = llamacpp.load_gguf(path, n_threads=THREADS, n_ctx=512, prefill_layout="repacked")
    assert split.prefill_choice == {"layout": "file", "source": "asked for"} and plain.prefill_weights is None
    prompt = (CONTEXT * 6)[: llamacpp.FILE_LAYOUT_ROWS + 36]
    for m in (split, plain):
        m.reset()
    assert torch.equal(split.forward(prompt, num_logits=3), plain.forward(prompt, num_logits=3))
    assert [(a is split, b is split) for a, b in moves] == [(False, True)]  # prefilled elsewhere, moved in
    for t in EXTRA[:5]:
        assert torch.equal(split.forward([t]), plain.forward([t]))
    for m in (split, plain):
        m.trim(30)  # back into the moved cells
    chain = (EXTRA * 5)[: llamacpp.FILE_LAYOUT_ROWS]
    assert torch.equal(split.forward(chain), plain.forward(chain))
    assert [(a is split, b is split) for a, b in moves[1:]] == [(True, False), (False, True)]  # out and back
    assert torch.equal(split.forward(EXTRA[:3]), plain.forward(EXTRA[:3]))
    assert split.tokens == plain.tokens and split._prefiller.tokens == []
    split.forward((EXTRA * 4)[: llamacpp.FILE_LAYOUT_ROWS - 1])  # shorter chains stay where they are
    assert len(moves) == 3


def test_a_failed_move_between_contexts_is_an_error_and_leaves_an_empty_cache(monkeypatch):
    split = llamacpp.load_gguf(_gguf(), n_threads=THREADS, n_ctx=512, prefill_layout="file")
    monkeypatch.setattr(split._api, "llama_state_seq_set_data", lambda *args: 0)
    with pytest.raises(RuntimeError, match="could not move a sequence's cache between contexts"):
        split.forward((CONTEXT * 4)[: llamacpp.FILE_LAYOUT_ROWS])
    assert split.tokens == []
    monkeypatch.undo()
    assert split.forward(CONTEXT, num_logits=1).shape == (1, split.vocab_size)  # usable again


def test_the_prefill_layout_is_measured_once_then_read_from_the_cache(model, tmp_path):
    model.reset()
    model.forward(CONTEXT)
    before = model.forward(EXTRA[:1])
    model.trim(len(CONTEXT))
    first = llamacpp.choose_prefill_layout(model, cache_dir=tmp_path)
    assert first["source"] == "measured" and first["rows"] == llamacpp.FILE_LAYOUT_ROWS
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


@pytest.mark.parametrize("path", [[0, 2, 4], [0, 2], [1, 5], [1], [0, 3], [0], []])
def test_after_keep_path_the_cache_computes_what_a_fresh_cache_of_that_path_does(model, path):
    """Bit-identical, not merely close: llama.cpp's attention sums a sequence's cells in cell
    order, so the discarded siblings' cells must not leave holes that later tokens fill ahead of
    older ones (a hole gave a logit 0.5 off on this file)."""
    model.reset()
    model.forward(CONTEXT[:-1])
    forward_tree(model, CONTEXT, TREE)
    keep_path(model, len(CONTEXT), path)
    kept = CONTEXT + [TREE.tokens[i] for i in path]
    assert model.tokens == kept
    after = torch.cat([model.forward([t]) for t in EXTRA[:6]])  # [6, V]
    assert torch.equal(after, one_token_steps(model, kept, EXTRA[:6])[1:])


def test_a_draft_tree_grown_over_several_passes_scores_each_node_as_its_path_would(model):
    """Passes that hang new nodes from an unresolved tree's nodes (as the static and dynamic
    draft trees grow a level at a time), then keeping one path of it."""
    model.reset()
    model.forward(CONTEXT)
    ctx = len(CONTEXT)
    levels = [([3158, 2784, 314], [-1, -1, -1]), ([30, 260, 28, 1070], [0, 0, 1, 2]), ([504, 30], [4, 6])]
    tokens, parents, rows = [], [], []
    for new_tokens, new_parents in levels:
        fed = len(tokens)
        tree = TokenTree(tokens + new_tokens, parents + new_parents)
        sees = tree.ancestry()[fed:]  # [new, all nodes]
        attend = torch.cat([torch.ones(len(new_tokens), ctx, dtype=torch.bool), sees], dim=1)
        positions = [ctx - 1 + d for d in tree.depths[fed:]]
        rows.append(model.forward(new_tokens, attend=attend, positions=positions))
        tokens, parents = tree.tokens, tree.parents
    rows = torch.cat(rows)  # [N, V]: the row after each node
    for node in range(len(tokens)):
        path = TokenTree(tokens, parents).path(node)
        expected = one_token_steps(model, CONTEXT + [tokens[i] for i in path[:-1]], [tokens[node]])[-1]
        assert torch.equal(rows[node], expected), node
    model.reset()
    model.forward(CONTEXT)  # grow it again, keep the path to node 8, continue after it
    tree = TokenTree(tokens, parents)
    for lo, hi in ((0, 3), (3, 7), (7, 9)):
        attend = torch.cat([torch.ones(hi - lo, ctx, dtype=torch.bool), tree.ancestry()[lo:hi, :hi]], dim=1)
        model.forward(tokens[lo:hi], attend=attend, positions=[ctx - 1 + d for d in tree.depths[lo:hi]])
    keep_path(model, ctx, tree.path(8))  # 2 -> 6 -> 8
    kept = CONTEXT + [tokens[i] for i in tree.path(8)]
    assert model.tokens == kept
    assert torch.equal(torch.cat([model.forward([t]) for t in EXTRA[:4]]), one_token_steps(model, kept, EXTRA[:4])[1:])


def test_parked_cells_are_compacted_away_when_they_would_fill_the_cache(monkeypatch):
    """Every kept path parks the tree's other cells; once they would not fit, or once the cache is
    trimmed back before them (a prompt cache's next prompt: freed cells among parked ones would
    take new tokens out of position order), sequence 0 is rewritten as one block and decoding goes
    on bit-identically."""
    monkeypatch.setattr(llamacpp, "_TREE_SLACK", 64)  # room for fewer parked cells: they fill it sooner
    small = llamacpp.load_gguf(_gguf(), n_threads=THREADS, n_ctx=64, prefill_layout="repacked")
    small.reset()
    small.forward(CONTEXT[:-1])
    context = list(CONTEXT)
    compactions = {"room": 0, "trim": 0}
    for step in range(120):
        parked = small._parked
        forward_tree(small, context, TREE)  # makes room first: compacts when parked cells are in the way
        compactions["room"] += small._parked < parked
        keep_path(small, len(context), [1])  # node 1 is a leaf after node 0's subtree: its siblings are parked
        context += [TREE.tokens[1], EXTRA[step % len(EXTRA)]]
        small.trim(len(context) - 1)
        if len(context) > 60:  # back before every tree
            context = context[:20]
            parked = small._parked
            small.trim(19)
            compactions["trim"] += small._parked < parked
    assert compactions["room"] >= 2 and compactions["trim"] >= 2
    assert torch.equal(small.forward(context[len(small.tokens):]), one_token_steps(small, context, [])[-1:])


PROMPTS = [
    "def fibonacci(n):",
    "The three largest cities in France are",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef",
]
# decoded after PROMPTS only until a tree kind has kept three paths with holes
MORE_PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\ndef normalize(x):",
    "A list of prime numbers: 2, 3, 5, 7,",
    "SELECT name, age FROM users WHERE",
]
TREES = {
    "static, branching at depths 1-3": dict(mode="static", choices=[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]),
    "static 0|1|0.0": dict(mode="static", choices=[(0,), (1,), (0, 0)]),
    "static default (16 nodes, 6 draft passes)": dict(mode="static"),
    "dynamic": dict(mode="dynamic", depth=4, width=2, expand=2, budget=10),
    "dynamic, default shape": dict(mode="dynamic"),
    "confident": dict(mode="confident", threshold=0.5),
    "confident, forking often": dict(mode="confident", threshold=0.95, width=3),
}


@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
def test_every_tree_kind_decodes_greedily_the_backends_own_greedy_output(request, tree, monkeypatch):
    # The first 6 layers (see the fixture), except for the confident tree: on their laws it keeps
    # only first children, and the kept paths with holes this checks need the whole model's.
    model = request.getfixturevalue("model" if tree == "confident" else "shallow")
    tokenizer = _tokenizer()
    draft = _Unsure(model.fork())
    holes = []  # kept paths that skip cells of the tree: where a cache with holes once went wrong
    real_keep = model.keep
    monkeypatch.setattr(model, "keep", lambda kept: (holes.append(kept != list(range(len(kept)))), real_keep(kept))[1])
    for n, prompt in enumerate(PROMPTS + MORE_PROMPTS):
        if n >= len(PROMPTS) and sum(holes) >= 3:
            break  # each kind's paths with holes come where its drafts part from the target: which
            # prompts give three depends on llama.cpp's rounding on this CPU (AVX2, AVX-512)
        ar = greedy_tokens(model, prompt, 40)
        spec = generate(model, prompt, tokenizer=tokenizer, draft=draft, verify="tree", tree=TREES[tree],
                        max_new_tokens=40, eos_token_ids=[])
        assert spec.token_ids == ar.token_ids, prompt
        assert spec.stats.accepted_tokens > 0
    assert sum(holes) >= 3


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
    ar = greedy_tokens(model, prompt, 40)
    assert len(ar.token_ids) == 40
    draft = model.fork()  # the same weights as their own draft: a second context and KV cache
    for kwargs in (dict(draft=draft, verify="block", k=4, policy="static"),
                   dict(draft=draft, verify="greedy", k=5, policy="static"),
                   dict(drafter="ngram", verify="greedy", k=4, policy="static"), dict(draft=draft, verify="tree")):
        spec = generate(model, prompt, tokenizer=tokenizer, max_new_tokens=40, eos_token_ids=[], **kwargs)
        assert spec.token_ids == ar.token_ids, kwargs
        assert spec.stats.target_forwards < len(ar.token_ids), kwargs
    selfdraft = generate(model, prompt, tokenizer=tokenizer, draft=draft, drafter="model", k=4, policy="static", max_new_tokens=40,
                         eos_token_ids=[])
    assert selfdraft.stats.acceptance_rate == 1.0  # draft = target accepts every greedy draft token


_GREEDY: dict[tuple[int, str, int], Any] = {}


def greedy_tokens(model, prompt: str, tokens: int) -> Any:
    """Plain greedy decoding of ``prompt`` on ``model`` (one of the module's; its ``token_ids`` the
    reference the speculative runs are compared with), decoded once per model, prompt and length:
    every speculative run of the file compares with the same bits, and the reference costs its
    seconds once."""
    key = (id(model), prompt, tokens)
    if key not in _GREEDY:
        _GREEDY[key] = generate(model, prompt, tokenizer=_tokenizer(), max_new_tokens=tokens, eos_token_ids=[])
    return _GREEDY[key]


@functools.cache
def _tokenizer():
    """The file's own tokenizer, built once per process (parsing its 49k-token vocabulary takes seconds)."""
    return tokenizers.tokenizer_from_gguf(_gguf())


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
    for seed in range(SAMPLES):  # the prompt cache keeps all but the prompt's last token: one prefill
        r = generate(model, prompt, drafter="ngram", verify="block", k=2, policy="static", temperature=1.0, top_k=TOP_K,
                     max_new_tokens=2, seed=seed, eos_token_ids=[], prompt_cache=True)
        assert r.stats.prompt_cached == len(prompt) - 1
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


def test_tree_methods_through_the_server_give_the_text_of_plain_decoding(shallow):
    """Every tree kind a request may name runs on llama.cpp (none is refused or fails mid-stream)
    and, greedy, answers the very text of the `ar` method with ``exact: true``."""
    model = shallow  # the first 6 layers: see the fixture
    from fastapi.testclient import TestClient

    from specdec.server.requests import method_config
    from specdec.server.app import ServerOptions, create_app
    from specdec.models import Pair

    tokenizer = _tokenizer()
    served = Pair(model, tokenizer, _Unsure(model.fork()), target_name="smollm2-135m", draft_name="smollm2-135m")
    app = create_app(served, ServerOptions(method_config("spec:model:block:k=4:policy=static", True)))
    methods = ["spec:tree:choices=0|1|0.0", "spec:tree:choices=default", "spec:tree:budget=16",
               "spec:tree:depth=3:width=2", "spec:tree"]
    with TestClient(app, base_url="http://localhost") as client:
        for prompt in PROMPTS[:2]:
            def ask(method):
                r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 32, "temperature": 0,
                                                         "speculative": {"method": method}})
                assert r.status_code == 200, (method, r.text)
                return r.json()
            want = ask("ar")["choices"][0]["text"]
            for method in methods:
                got = ask(method)
                assert got["choices"][0]["text"] == want, (method, prompt)
                assert got["speculative"]["exact"] is True


GUMBEL_SETTINGS = [dict(temperature=t, **f) for t in (0.7, 1.0, 1.5) for f in ({}, {"top_k": 40}, {"top_p": 0.9})]


@pytest.mark.parametrize("settings", GUMBEL_SETTINGS,
                         ids=[f"T{s['temperature']}-{next(iter(s.keys() - {'temperature'}), 'full')}" for s in GUMBEL_SETTINGS])
def test_coupled_methods_give_the_tokens_of_plain_gumbel_decoding(shallow, settings):
    """Same seed, same text: under the Gumbel-max sampler, chains of k = 1, 4 and 8 from an unsure
    draft, the n-gram lookup, the planner (ngram+model) and a tree give exactly the tokens of plain
    decoding with that seed; another seed gives other text."""
    model = shallow  # the first 6 layers: see the fixture
    from specdec.policies.auto import AutoPolicy

    from helpers import CHEAP_ROWS

    tokenizer = _tokenizer()
    prompt = PROMPTS[2]
    common = dict(tokenizer=tokenizer, sampler="gumbel", max_new_tokens=40, eos_token_ids=[], **settings)
    draft = _Unsure(model.fork(), scale=1.0)
    seed = 2**63 + GUMBEL_SETTINGS.index(settings)  # a seed per setting
    expected = generate(model, prompt, seed=seed, **common)
    assert generate(model, prompt, seed=seed + 1, **common).token_ids != expected.token_ids
    kept = 0
    for method in (dict(draft=draft, drafter="model", k=1, policy="static"),
                   dict(draft=draft, drafter="model", k=4, policy="static"),
                   dict(draft=draft, drafter="model", k=8, policy="static"),
                   dict(drafter="ngram", k=4, policy="static"),
                   dict(draft=draft, policy=AutoPolicy(costs=CHEAP_ROWS)),
                   dict(draft=draft, verify="tree", tree=dict(mode="confident", threshold=0.5))):
        result = generate(model, prompt, seed=seed, **method, **common)
        assert result.token_ids == expected.token_ids, (seed, method)
        assert result.stats.gumbel_seed == seed and ("coupled" in result.method) == ("verify" not in method)
        kept += result.stats.accepted_tokens
    assert kept > 0


def static_choices(nodes: int) -> list[tuple[int, ...]]:
    """A static tree of ``nodes`` nodes: one branch from each of the root's top sqrt(nodes) children
    (rounded to a power of two), each branch its top child's chain, parents before children
    (at most 11 leaves up to 128 nodes, within llama.cpp's 63 sequences)."""
    branches = 1 << (max(1, round(math.log2(nodes) / 2)))
    depth = nodes // branches
    return sorted(((r,) + (0,) * d for r in range(branches) for d in range(depth)), key=len)


@pytest.mark.parametrize("budget", [16, 32, 64, 128])
@pytest.mark.parametrize("shape", ["dynamic", "static"])
def test_trees_of_every_budget_decode_greedily_the_backends_own_greedy_output(shallow, shape, budget):
    """Trees of up to 128 nodes (two or more llama.cpp passes' worth of rows, at any context length):
    the bf16 KV cache keeps llama.cpp's flash attention on its per-row kernel, so every tree row
    equals a one-token step bit for bit and greedy output is plain decoding's (with an f16 cache,
    llama.cpp's tiled kernel for passes of 64 rows or more rounds them differently). The draft is the target itself (its tree's first path always holds)
    for the longer run, an unsure copy (other branches kept) for the others."""
    model = shallow  # the first 6 layers: see the fixture
    tokenizer = _tokenizer()
    tree = dict(mode="dynamic", budget=budget) if shape == "dynamic" else dict(mode="static", choices=static_choices(budget))
    long_run = budget == 64 and shape == "dynamic"
    for prompt, draft, tokens in ([("Once upon a time in a small village by the sea,", model.fork(), 400)] if long_run else
                                  [(PROMPTS[budget % 3], _Unsure(model.fork()), 32 if budget <= 32 else 16)]):
        ar = greedy_tokens(model, prompt, tokens)
        spec = generate(model, prompt, tokenizer=tokenizer, draft=draft, verify="tree", tree=tree,
                        max_new_tokens=tokens, eos_token_ids=[])
        assert spec.token_ids == ar.token_ids, (prompt, tree)
        assert spec.stats.accepted_tokens > 0 and spec.exact
