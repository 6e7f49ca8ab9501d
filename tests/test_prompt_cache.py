"""The prompt cache: a generation keeps what the backend cached in the previous one as far as the
new prompt shares it, prefills only the rest, and gives exactly the tokens of a cold prefill on a
batch-invariant backend (SmolLM2's GGUF on llama.cpp, whose n-row passes equal one-token steps:
test_llamacpp.py; a tiny llama on torch). Through the server, the usage and /metrics count it."""

from __future__ import annotations

import pytest
import torch
from helpers import THREADS, PACK, _gguf, smollm2_llamacpp
from tiny import tiny_llama

import specdec
from specdec import models, packs
from specdec.backends.hf import HFCausalLM
from specdec.config import DecodeConfig

PROMPT = [504, 1070, 28, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30]
TURN = [3158, 314, 260, 1345, 30, 2784, 28, 1070]


def _smollm2():
    """A fresh SmolLM2 context (skipped without the binding or the pack), as test_llamacpp loads it."""
    return smollm2_llamacpp()


def counting(model):
    """Record how many tokens each forward of ``model`` feeds."""
    fed: list[int] = []
    forward = model.forward

    def counted(tokens, *args, **kwargs):
        fed.append(len(tokens))
        return forward(tokens, *args, **kwargs)

    model.forward = counted
    return fed


@pytest.fixture(scope="module", params=["llamacpp", "gguf", "torch"])
def backend(request):
    if request.param == "gguf":  # specdec's GGUF kernel on the same file
        from specdec.backends.gguf import load_gguf_native

        return load_gguf_native(_gguf(), n_threads=THREADS, n_ctx=512)
    return _smollm2() if request.param == "llamacpp" else HFCausalLM(tiny_llama(3, vocab=5000, context=512))


@pytest.mark.parametrize("method", ["ar", "spec:ngram:block:k=4:policy=static"])
def test_a_follow_up_prefills_only_what_it_adds_and_equals_a_cold_prefill(backend, method):
    kw = dict(config=DecodeConfig.parse(method), max_new_tokens=12, temperature=0.0, eos_token_ids=[])
    first = specdec.generate(backend, PROMPT, prompt_cache=True, **kw)
    conversation = PROMPT + first.token_ids + TURN  # the next turn re-sends the history
    fed = counting(backend)
    try:
        again = specdec.generate(backend, conversation, prompt_cache=True, **kw)
    finally:
        del backend.forward
    # The cache held the prompt and every output token but the last (never fed): the rest is prefilled.
    cached = len(PROMPT) + len(first.token_ids) - 1
    assert again.stats.prompt_cached == cached
    rest = len(conversation) - cached  # the first forward feeds it, and the first step's draft (k=4)
    assert fed[0] == rest if method == "ar" else rest <= fed[0] <= rest + 4
    cold = specdec.generate(backend, conversation, **kw)
    assert cold.stats.prompt_cached == 0
    assert again.token_ids == cold.token_ids


def test_a_prompt_that_leaves_the_cached_one_keeps_only_the_shared_part(backend):
    kw = dict(config=DecodeConfig.parse("ar"), max_new_tokens=6, temperature=0.0, eos_token_ids=[])
    specdec.generate(backend, PROMPT, prompt_cache=True, **kw)
    other = PROMPT[:7] + [2784, 28, 1070, 30, 504]
    got = specdec.generate(backend, other, prompt_cache=True, **kw)
    assert got.stats.prompt_cached == 7
    assert got.token_ids == specdec.generate(backend, other, **kw).token_ids
    same = specdec.generate(backend, other, prompt_cache=True, **kw)  # the very prompt again
    assert same.stats.prompt_cached == len(other) - 1 and same.token_ids == got.token_ids


def _kept_after_answer(model, prompt, new_tokens, turn):
    """How much of ``prompt + turn`` the cache a greedy answer of ``new_tokens`` to ``prompt`` leaves
    holds: the prompt, then the answer's tokens that were fed (all but the last) as far as they are
    the turn's, less the last token of the whole (its logits are computed again). Which tokens the
    answer has depends on llama.cpp's rounding on this CPU, so the test reads them."""
    answer = specdec.generate(model, prompt, config=DecodeConfig.parse("ar"), max_new_tokens=new_tokens,
                              temperature=0.0).token_ids
    fed, shared = answer[:-1], 0
    while shared < min(len(fed), len(turn)) and fed[shared] == turn[shared]:
        shared += 1
    return min(len(prompt) + shared, len(prompt + turn) - 1)


def test_the_server_reports_cached_prompt_tokens_and_answers_as_a_cold_server():
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from specdec.server.app import ServerOptions, create_app
    from specdec.models import Pair
    from specdec.server.requests import method_config

    model = _smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(packs.pack_dir(PACK)))
    prompts = [PROMPT, PROMPT + TURN, PROMPT[:5] + TURN, PROMPT + TURN]  # a conversation, another, the first again
    answers = {}
    for cache in (True, False):
        served = Pair(model, tokenizer, target_name=PACK)
        app = create_app(served, ServerOptions(method_config("ar", False), prompt_cache=cache))
        with TestClient(app, base_url="http://localhost") as client:
            got = []
            for prompt in prompts:
                r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                got.append(r.json())
            metrics = client.get("/metrics").text
        answers[cache] = got
        cached = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
        if cache:
            # The second shares PROMPT with the first's cache, the third PROMPT[:5] with the second's; the
            # fourth is the second again, whose saved cache holds all of it but the last token.
            assert cached == [0, _kept_after_answer(model, PROMPT, 8, TURN), 5, len(PROMPT + TURN) - 1]
            assert f'specdec_prompt_tokens_total{{source="cached"}} {float(sum(cached))}' in metrics
            computed = sum(map(len, prompts)) - sum(cached)
            assert f'specdec_prompt_tokens_total{{source="computed"}} {float(computed)}' in metrics
        else:
            assert cached == [0, 0, 0, 0]
    assert [g["choices"][0]["text"] for g in answers[True]] == [g["choices"][0]["text"] for g in answers[False]]


# ------------------------------------------------------------------------------------------------
# Saved caches of earlier requests (the server's PromptCache, on llama.cpp's snapshots)

OTHER = [2784, 28, 1070, 30, 504, 28, 30, 4667, 314, 260, 1345, 30]


def test_a_snapshot_put_back_decodes_as_the_cache_it_copied():
    from specdec.backends.base import SNAPSHOTS, capabilities

    model = _smollm2()
    assert SNAPSHOTS in capabilities(model)
    model.reset()
    model.forward(PROMPT)
    snapshot = model.snapshot()
    want = model.forward(TURN)
    model.reset()
    model.forward(OTHER)
    model.restore(snapshot)
    assert model.tokens == PROMPT and torch.equal(model.forward(TURN), want)


def test_the_prompt_cache_puts_back_the_saved_cache_sharing_most_and_drops_the_oldest_past_its_budget():
    from specdec.serving.prompt_cache import PromptCache

    model = _smollm2()
    model.reset()
    one = _snapshot_size(model, PROMPT)
    cache = PromptCache(budget_bytes=int(2.5 * one))  # room for two saved caches of that size
    conversations = [PROMPT, OTHER + PROMPT[:8], [30] + PROMPT]
    model.reset()
    for c in conversations:  # each new one drops the live cache, which is saved first
        prepared = cache.prepare(model, c)
        assert not prepared.restored
        model.trim(prepared.shared)
        model.forward(c[len(model.tokens):])
    assert [e.tokens for e in cache.entries.values()] == [tuple(PROMPT), tuple(OTHER + PROMPT[:8])]
    back = cache.prepare(model, PROMPT + TURN)  # the live cache shares 0, the oldest saved one all of PROMPT
    assert back.restored and back.saved and back.shared == len(PROMPT) and model.tokens == PROMPT
    # the live cache was saved and the budget holds two: the least recently used (OTHER...) went
    assert [e.tokens for e in cache.entries.values()] == [tuple(PROMPT), tuple([30] + PROMPT)]
    model.forward(TURN)
    cache.prepare(model, PROMPT + TURN + [28])  # extends the live cache: nothing to save or restore
    assert len(cache.entries) == 2 and model.tokens == PROMPT + TURN
    assert cache.nbytes <= cache.budget_bytes
    with pytest.raises(ValueError, match="budget"):
        PromptCache(-1)


def _snapshot_size(model, tokens):
    model.reset()
    model.forward(tokens)
    size = model.snapshot().nbytes
    model.reset()
    return size


def test_the_server_returns_to_a_conversation_from_its_saved_cache_and_answers_concurrent_requests_as_cold():
    import threading

    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from specdec.server.app import ServerOptions, create_app
    from specdec.models import Pair
    from specdec.server.requests import method_config

    model = _smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(packs.pack_dir(PACK)))
    served = Pair(model, tokenizer, target_name=PACK)

    def ask(client, prompt):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    cold_app = create_app(served, ServerOptions(method_config("ar", False), prompt_cache=False))
    prompts = [PROMPT, OTHER, PROMPT + TURN, OTHER + TURN, [30] + OTHER, PROMPT[:3] + TURN]
    with TestClient(cold_app, base_url="http://localhost") as client:
        cold = {tuple(p): ask(client, p)["choices"][0]["text"] for p in prompts}
    kept = [_kept_after_answer(model, PROMPT, 6, TURN), _kept_after_answer(model, OTHER, 6, TURN)]
    model.reset()  # what the cold server left
    app = create_app(served, ServerOptions(method_config("ar", False)))
    with TestClient(app, base_url="http://localhost") as client:
        got = [ask(client, p) for p in prompts[:4]]  # A, B, A again with a new turn, B again
        cached = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
        assert cached == [0, 0, *kept]  # each return found its conversation's saved cache
        assert [g["choices"][0]["text"] for g in got] == [cold[tuple(p)] for p in prompts[:4]]
        answers: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, ask(client, prompts[i])["choices"][0]["text"]))
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [answers[i] for i in range(len(prompts))] == [cold[tuple(p)] for p in prompts]


def test_the_torch_server_keeps_its_cache_and_answers_as_a_cold_server():
    """A transformers target (and draft) is wrapped once for the prompt cache; the follow-up turn
    prefills only what it adds and answers as a server that prefills everything."""
    from fastapi.testclient import TestClient
    from helpers import tiny_pair, tiny_tokenizer

    from specdec.server.app import ServerOptions, create_app
    from specdec.models import Pair
    from specdec.server.requests import method_config

    target, draft = tiny_pair()
    tokenizer = tiny_tokenizer()
    first, follow = "def quicksort(arr):", "def quicksort(arr):\n    pivot = arr[0]\n"
    answers = {}
    for cache in (True, False):
        for method in ("ar", "spec:model:block:k=4:policy=static"):
            served = Pair(target, tokenizer, draft, target_name="tiny")
            app = create_app(served, ServerOptions(method_config(method, True), prompt_cache=cache))
            with TestClient(app, base_url="http://localhost") as client:
                got = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0}).json()
                       for p in (first, follow)]
            answers[cache, method] = [g["choices"][0]["text"] for g in got]
            cached = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
            shared = len(tokenizer(first)["input_ids"])  # the follow-up begins with the first prompt's tokens
            assert cached == ([0, shared] if cache else [0, 0]), method
    assert answers[True, "ar"] == answers[False, "ar"]
    assert answers[True, "spec:model:block:k=4:policy=static"] == answers[False, "spec:model:block:k=4:policy=static"]


USER_TURNS = ["Tell me a story about a lighthouse keeper and a storm at sea.",
              "What happened to the ship after that night?",
              "Write a short poem about the keeper's lamp.",
              "Now explain in two sentences why lighthouses are painted in stripes.",
              "Summarise everything so far in one line.",
              "Thank you. Give the story a title."]


@pytest.mark.parametrize("method", ["ar", "spec:model:block",
                                    "spec:model:tree:budget=64"])
def test_a_six_turn_chat_that_resends_its_answers_is_answered_as_a_cold_server_turn_by_turn(method):
    """Each turn re-sends the conversation, the server's earlier answers included, so the cache
    reuses cells of tokens the server generated (one-token steps and verification rows) where a
    cold server prefills them, all through the per-row attention kernel that a bf16 KV cache gives this batch-invariant model. Prompts
    grow past 64 tokens, where llama.cpp's attention would take its tiled kernel."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from specdec.server.app import ServerOptions, create_app
    from specdec.models import Pair
    from specdec.server.requests import method_config

    model = smollm2_llamacpp(6)  # the first 6 layers: its tokenizer and kernels, a third of the cost
    draft = model.fork()
    tokenizer = packs.gguf_tokenizer(_gguf(), pack=models.PACKS[PACK])
    answers, cached = {}, {}
    for cache in (True, False):
        served = Pair(model, tokenizer, draft, target_name=PACK)
        app = create_app(served, ServerOptions(method_config(method, True), prompt_cache=cache))
        messages: list[dict[str, str]] = []
        answers[cache], cached[cache] = [], []
        with TestClient(app, base_url="http://localhost") as client:
            for turn in USER_TURNS:
                messages.append({"role": "user", "content": turn})
                r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 24, "temperature": 0})
                assert r.status_code == 200, r.text
                body = r.json()
                text = body["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": text})
                answers[cache].append(text)
                cached[cache].append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                prompt_tokens = body["usage"]["prompt_tokens"]
        model.reset()
    assert prompt_tokens > 200  # the last prompt went well past a 64-row pass
    assert min(cached[True][1:]) > 0 and cached[False] == [0] * len(USER_TURNS)
    assert answers[True] == answers[False]
