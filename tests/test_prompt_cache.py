"""The prompt cache: a generation keeps what the backend cached in the previous one as far as the
new prompt shares it, prefills only the rest, and gives exactly the tokens of a cold prefill on a
batch-invariant backend (SmolLM2's GGUF on llama.cpp, whose n-row passes equal one-token steps:
test_llamacpp.py; a tiny llama on torch). Through the server, the usage and /metrics count it."""

from __future__ import annotations

import pytest
from tiny import tiny_llama

import specdec
from specdec import packs
from specdec.backends import llamacpp
from specdec.backends.hf import HFCausalLM
from specdec.config import DecodeConfig

PACK = "smollm2-135m"
PROMPT = [504, 1070, 28, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30]
TURN = [3158, 314, 260, 1345, 30, 2784, 28, 1070]


def _smollm2():
    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    return llamacpp.load_gguf(packs.gguf_file(PACK, progress=False), n_threads=2, n_ctx=512,
                              prefill_layout="repacked")


def counting(model):
    """Record how many tokens each forward of ``model`` feeds."""
    fed: list[int] = []
    forward = model.forward

    def counted(tokens, *args, **kwargs):
        fed.append(len(tokens))
        return forward(tokens, *args, **kwargs)

    model.forward = counted
    return fed


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def backend(request):
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


def test_the_server_reports_cached_prompt_tokens_and_answers_as_a_cold_server():
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from specdec.server.app import ServedModels, ServerOptions, create_app
    from specdec.server.requests import method_config

    model = _smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(packs.pack_dir(PACK)))
    prompts = [PROMPT, PROMPT + TURN, PROMPT[:5] + TURN, PROMPT + TURN]  # a conversation, another, the first again
    answers = {}
    for cache in (True, False):
        served = ServedModels(model, tokenizer, name=PACK)
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
            # Each prompt shares with the one before it: nothing, then PROMPT, then PROMPT[:5], then PROMPT[:5].
            assert cached == [0, len(PROMPT), 5, 5]
            assert f'specdec_prompt_tokens_total{{source="cached"}} {float(sum(cached))}' in metrics
            computed = sum(map(len, prompts)) - sum(cached)
            assert f'specdec_prompt_tokens_total{{source="computed"}} {float(computed)}' in metrics
        else:
            assert cached == [0, 0, 0, 0]
    assert [g["choices"][0]["text"] for g in answers[True]] == [g["choices"][0]["text"] for g in answers[False]]
