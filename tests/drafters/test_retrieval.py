"""The retrieval datastore (:mod:`specdec.datastore`) and the retrieval drafter
(:mod:`specdec.drafters.retrieval`): the suffix index finds what brute force finds, the store
round-trips through its file, ``specdec index`` builds one, and decoding with it keeps greedy
output, Gumbel-seeded output and the target's law exactly."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
import torch

from specdec import generate, packs
from specdec.backends import llamacpp
from specdec.build import as_backend
from specdec.config import ConfigError, DecodeConfig
from specdec.datastore import (
    MAX_MATCH, SEPARATOR, Datastore, best_path, continuation_trie, open_store, store_path, suffix_array, top_nodes,
    use_default,
)
from specdec.drafters.retrieval import RetrievalChoice, RetrievalDrafter
from specdec.drafters.model import ModelDrafter
from specdec.verify.tree import TreeVerifier

from tiny import noisy_copy, tiny_llama

PROMPT = [1, 2, 3, 4, 5]


def _brute(docs, context, depth):
    """(longest matched suffix length, sorted continuations of every occurrence) by scanning."""
    best, found = 0, []
    for m in range(1, min(len(context), MAX_MATCH) + 1):
        suffix = list(context[-m:])
        hits = [tuple(d[i + m: i + m + depth]) for d in map(list, docs) for i in range(len(d) - m + 1)
                if d[i:i + m] == suffix]
        if not hits:
            break
        best, found = m, hits
    return best, sorted(found)


@pytest.mark.parametrize("seed", range(4))
def test_the_suffix_index_finds_the_longest_match_and_every_continuation_brute_force_finds(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        vocab = int(rng.integers(2, 6))  # small alphabets: long and many matches
        docs = [rng.integers(0, vocab, int(rng.integers(1, 60))) for _ in range(int(rng.integers(1, 6)))]
        store = Datastore()
        for doc in docs[: len(docs) // 2]:
            store.add(doc)
        store.lookup([0], 1)  # the first documents go to the main index, the rest to the recent one
        for doc in docs[len(docs) // 2:]:
            store.add(doc)
        context = rng.integers(0, vocab, int(rng.integers(1, 70))).tolist()
        if rng.random() < 0.5:  # a context that ends in a long stretch of a document
            doc = docs[int(rng.integers(len(docs)))]
            context += doc[: int(rng.integers(1, len(doc) + 1))].tolist()
        match = store.lookup(context, 6, rows=10**6)
        length, continuations = _brute(docs, context, 6)
        if match is None:
            assert length == 0
            continue
        got = sorted(tuple(int(t) for t in row if t != SEPARATOR) for row in match.rows)
        assert (match.length, got, match.count) == (length, continuations, len(continuations))


def test_the_suffix_array_orders_suffixes_by_their_first_tokens():
    rng = np.random.default_rng(0)
    for depth in (1, 3, 8, 32):
        seq = rng.integers(0, 4, 300)
        sa = suffix_array(seq, depth)
        keys = [tuple(seq[i:i + depth]) for i in sa]
        assert sorted(sa.tolist()) == list(range(len(seq)))
        assert keys == sorted(keys)


def test_the_most_recent_occurrences_are_the_ones_counted():
    store = Datastore()
    for tail in (7, 8, 9):
        store.add([1, 2, 3, tail])
    match = store.lookup([1, 2, 3], 1, rows=2)
    assert match.count == 3 and match.rows[:, 0].tolist() == [9, 8]


def test_the_trie_ranks_continuations_by_how_often_they_followed():
    rows = np.array([[5, 6, 7], [5, 6, 8], [5, 6, 7], [9, 1, SEPARATOR], [5, 2, 3]], dtype=np.int32)
    nodes = continuation_trie(rows)
    assert best_path(nodes) == [5, 6, 7]
    tokens, parents = top_nodes(nodes, budget=4, max_depth=3)
    # counts 4, 3, 2 and the first-seen of the 1s, stored parents first (by depth)
    assert (tokens, parents) == ([5, 9, 6, 7], [-1, -1, 0, 2])
    tokens, parents = top_nodes(nodes, budget=10, max_depth=2)
    assert sorted(tokens) == [1, 2, 5, 6, 9] and all(p < i for i, p in enumerate(parents))  # all of depth <= 2


def test_a_bounded_store_drops_its_oldest_documents():
    store = Datastore(max_tokens=100)
    for i in range(30):
        store.add([1000 + i] * 3 + [i, i + 1, i + 2, i + 3, i + 4])
    assert len(store) <= 100
    assert store.lookup([1000, 1000], 1) is None  # the first documents are gone
    assert store.lookup([1029, 1029], 1).rows[:, 0].tolist() == [29, 1029]  # the latest occurrence first


def test_a_store_round_trips_through_its_file(tmp_path):
    rng = np.random.default_rng(1)
    store = Datastore()
    docs = [rng.integers(0, 50, 200) for _ in range(5)]
    for doc in docs:
        store.add(doc)
    store.meta = {"model": "tiny", "vocab_size": 50}
    path = store.save(tmp_path / "s.npz")
    loaded = Datastore.load(path)
    assert (len(loaded), loaded.documents, loaded.meta) == (len(store), 5, store.meta)
    for _ in range(20):
        context = docs[int(rng.integers(5))][: int(rng.integers(1, 200))]
        a, b = store.lookup(context, 4, rows=1000), loaded.lookup(context, 4, rows=1000)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.length == b.length and sorted(map(tuple, a.rows.tolist())) == sorted(map(tuple, b.rows.tolist()))
    (tmp_path / "bad.npz").write_bytes(b"not a store")
    with pytest.raises(ValueError, match="specdec index"):
        Datastore.load(tmp_path / "bad.npz")


def test_stores_are_found_by_name_in_the_cache_or_by_path(tmp_path):
    store = Datastore()
    store.add([1, 2, 3])
    store.save(store_path("named", tmp_path))
    assert open_store("named", cache_dir=tmp_path) is open_store("named", cache_dir=tmp_path)  # loaded once
    assert len(open_store(str(store_path("named", tmp_path)))) == 3
    with pytest.raises(ValueError, match="specdec index"):
        open_store("missing", cache_dir=tmp_path)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(0, vocab=128, sharpness=2.0)


def _store_of(model, prompts, tokens=60):
    store = Datastore()
    for prompt in prompts:
        store.add(prompt + generate(model, prompt, max_new_tokens=tokens, eos_token_ids=[]).token_ids)
    return store


def test_a_store_of_one_greedy_generation_drafts_its_repetition_in_full(tiny):
    """Greedy decoding repeats itself exactly, so every draft is the stored continuation: each step
    drafts k tokens and keeps them all, and N tokens take ceil(N / (k + 1)) target passes."""
    n, k = 60, 8
    ar = generate(tiny, PROMPT, max_new_tokens=n, eos_token_ids=[])
    store = Datastore()
    store.add(PROMPT + ar.token_ids)
    spec = generate(as_backend(tiny), PROMPT, drafter=RetrievalDrafter(128, store), policy="static", k=k,
                    max_new_tokens=n, eos_token_ids=[])
    assert spec.token_ids == ar.token_ids
    assert spec.stats.target_forwards == math.ceil(n / (k + 1))
    assert spec.stats.accepted_tokens == n - spec.stats.target_forwards


@pytest.mark.parametrize("method", ["spec:retrieval:block:k=4:policy=static", "spec:retrieval",
                                    "spec:retrieval:greedy:k=6:policy=static:min_match=1",
                                    "spec:retrieval:tree", "spec:retrieval:tree:budget=4:depth=3"])
def test_greedy_retrieval_decoding_is_plain_greedy_decoding(tiny, method):
    use_default(_store_of(tiny, [PROMPT, [9, 8, 7], [3, 1, 4, 1, 5]]))
    for prompt in ([1, 2, 3, 4, 5], [9, 8, 7, 6], [60, 61, 62]):  # stored, partly stored, not stored
        ar = generate(tiny, prompt, max_new_tokens=40, eos_token_ids=[])
        spec = generate(tiny, prompt, config=DecodeConfig.parse(method), max_new_tokens=40, eos_token_ids=[])
        assert spec.token_ids == ar.token_ids, prompt
    assert spec.stats is not None


def test_retrieval_beside_the_lookup_and_a_draft_model_keeps_greedy_output(tiny):
    store = _store_of(tiny, [PROMPT])
    draft = noisy_copy(tiny, 0.3)
    ar = generate(tiny, PROMPT, max_new_tokens=40, eos_token_ids=[])
    drafter = RetrievalChoice.build(ModelDrafter(as_backend(draft)), store)
    spec = generate(as_backend(tiny), PROMPT, drafter=drafter, max_new_tokens=40, eos_token_ids=[])
    assert spec.token_ids == ar.token_ids
    assert drafter.used["retrieval"] > 0
    by_name = generate(tiny, PROMPT, draft=draft, drafter="retrieval+model", max_new_tokens=40, eos_token_ids=[])
    assert by_name.token_ids == ar.token_ids


@pytest.mark.parametrize("method", [dict(verify="block", policy="static", k=4), dict(verify="tree")],
                         ids=["block", "tree"])
def test_a_seed_gives_plain_decodings_text_under_the_gumbel_sampler(tiny, method):
    use_default(_store_of(tiny, [PROMPT]))
    for seed in range(3):
        kw = dict(temperature=1.0, sampler="gumbel", seed=seed, max_new_tokens=40, eos_token_ids=[])
        ar = generate(tiny, PROMPT, **kw)
        use_default(_store_of(tiny, [PROMPT]) if seed == 0 else open_store())
        open_store().add(PROMPT + ar.token_ids)  # a store holding this very text: drafts get accepted
        spec = generate(tiny, PROMPT, drafter="retrieval", **method, **kw)
        assert spec.token_ids == ar.token_ids
        assert spec.stats.accepted_tokens > 0


def test_a_retrieval_tree_step_emits_the_targets_law_exactly():
    """The step's law of the first token, and of the first two where the first is a child of the
    root, equals the target's, to 1e-9, for trees the drafter builds from a store."""
    rng = np.random.default_rng(2)
    store = Datastore()
    for _ in range(40):
        store.add(rng.integers(0, 6, 12))
    drafter = RetrievalDrafter(6, store, min_match=1, budget=7, depth=3)
    from specdec.sampling import SamplingConfig

    checked = 0
    for _ in range(10):
        tree = drafter.propose_tree(rng.integers(0, 6, 5).tolist(), SamplingConfig(temperature=1.0), 3)
        if not len(tree):
            continue
        p = torch.softmax(torch.tensor(rng.normal(size=(1 + len(tree), 6)) * 2), -1)  # [1 + N, V] float64
        plan = TreeVerifier().plan_tree(tree, p)
        first = torch.zeros(6, dtype=torch.float64)
        pair = torch.zeros(6, 6, dtype=torch.float64)
        for outcome, chance in enumerate(plan.accept_len_probs.tolist()):
            path = tree.tokens_on(tree.path(outcome - 1))
            tokens = path + [None]  # the appended token: drawn from the outcome's law
            law = plan.next_token_probs[outcome].double()
            law = law / law.sum()  # rows may be unnormalised
            if not path:
                first += chance * law
            else:
                first[path[0]] += chance
                if len(path) == 1:
                    pair[path[0]] += chance * law
                else:
                    pair[path[0], tokens[1]] += chance
        assert torch.allclose(first, p[0], atol=1e-9)
        for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
            if parent < 0:
                assert torch.allclose(pair[token], p[0, token] * p[1 + i], atol=1e-9)
        checked += 1
    assert checked >= 5


def test_retrieval_options_in_the_configuration_language():
    config = DecodeConfig.parse("spec:retrieval+model:datastore=docs:min_match=3")
    assert (config.drafter, dict(config.drafter_options)) == ("retrieval+model", {"datastore": "docs", "min_match": 3})
    assert DecodeConfig.parse(str(config)) == config
    assert str(DecodeConfig.parse("spec:retrieval:tree:budget=8")) == "spec:retrieval:tree:budget=8"
    with pytest.raises(ConfigError, match="width"):
        DecodeConfig.parse("spec:retrieval:tree:width=2")
    with pytest.raises(ValueError, match="min_match"):
        DecodeConfig.parse("spec:retrieval:min_match=0")
    with pytest.raises(ValueError, match="specdec index"):
        generate(tiny_llama(0), PROMPT, drafter="retrieval", drafter_options={"datastore": "no-such-store"},
                 max_new_tokens=2)
    foreign = Datastore()
    foreign.meta = {"model": "another", "vocab_size": 49152}
    with pytest.raises(ValueError, match="target's tokenizer"):
        RetrievalDrafter(16, foreign)


def test_the_index_command_tokenizes_text_files_into_a_named_store(tmp_path, monkeypatch, capsys):
    from specdec.cli import commands, index

    class Bytes:  # a tokenizer: one id per byte
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(text.encode())}

        def __len__(self):
            return 256

    monkeypatch.setattr(index, "load_tokenizer", lambda name, cache_dir: Bytes())
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / ".git").mkdir()
    (docs / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (docs / "sub" / "b.txt").write_text("hello world\n")
    (docs / ".git" / "config").write_text("hidden\n")
    (docs / "blob.bin").write_bytes(b"\0\1\2")
    cache = tmp_path / "cache"
    assert commands.run(["index", str(docs), "--name", "mydocs", "--cache-dir", str(cache)]) == 0
    assert "indexed 2 files" in capsys.readouterr().out
    store = Datastore.load(store_path("mydocs", cache))
    assert (store.documents, len(store)) == (2, len("def add(a, b):\n    return a + b\n") + len("hello world\n"))
    assert store.lookup(list(b"return "), 5).rows[0].tolist() == list(b"a + b")
    assert commands.run(["index", str(tmp_path / "nowhere"), "--cache-dir", str(cache)]) == 2


def _gguf():
    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    missing = packs.missing_parts(packs.PACKS["smollm2-135m"])
    if missing:
        pytest.skip(f"pack smollm2-135m is not installed: {packs.PACKS['smollm2-135m'].install_command(missing)}")
    return packs.gguf_file("smollm2-135m", progress=False)


def test_greedy_retrieval_decoding_on_the_smollm2_gguf_is_its_greedy_decoding():
    model = llamacpp.load_gguf(_gguf(), n_threads=1, n_ctx=512, prefill_layout="repacked")
    prompts = [[504, 1070, 28, 30, 4667, 30, 3158, 314], [260, 1345, 30, 2784, 28, 1070]]
    store = Datastore()
    outputs = []
    for prompt in prompts:
        model.reset()
        outputs.append(generate(model, prompt, max_new_tokens=20, eos_token_ids=[]).token_ids)
        store.add(prompt + outputs[-1])
    use_default(store)
    for method in ("spec:retrieval:block:k=8:policy=static", "spec:retrieval:tree",
                   "spec:retrieval+model:block:k=8:policy=static"):
        for prompt, ar in zip(prompts, outputs):
            spec = generate(model, prompt, config=DecodeConfig.parse(method), max_new_tokens=20, eos_token_ids=[],
                            **({"draft": model.fork()} if "+model" in method else {}))
            assert spec.token_ids == ar, method
            assert spec.stats.accepted_tokens >= 10, method  # the store holds this very output


def test_a_server_adds_each_finished_output_to_its_datastore_and_drafts_from_it():
    from helpers import serve, tiny_pair, tiny_tokenizer

    target, _ = tiny_pair()
    store = Datastore()
    use_default(store)  # as 'specdec serve --datastore' does
    with serve(target, tiny_tokenizer(), method="spec:retrieval:block:k=8:policy=static", datastore=store) as server:
        client = server.client()
        first = client.completions.create(model="tiny", prompt="abc", max_tokens=40, temperature=0)
        assert store.documents == 1 and len(store) >= 40
        again = client.completions.create(model="tiny", prompt="abc", max_tokens=40, temperature=0)
        named = httpx.post(f"{server.url}/v1/completions", trust_env=False, json={
            "prompt": "abc", "max_tokens": 4, "speculative": {"method": "spec:retrieval:datastore=/etc/passwd"}})
    assert named.status_code == 400 and named.json()["error"]["param"] == "speculative.method"
    assert "may not choose" in named.json()["error"]["message"]  # a request names no file on the server
    assert again.choices[0].text == first.choices[0].text
    assert again.speculative["accepted_tokens"] >= 30  # the store holds this very output
