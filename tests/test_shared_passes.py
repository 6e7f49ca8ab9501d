"""Several requests decoded together, their passes sharing each pass of the weights
(:mod:`specdec.backends.shared`, :func:`specdec.generate_many`): each answer is, token for token,
the answer the same request gets alone, whatever else runs beside it -- other methods, lengths,
temperatures and constraints, requests that arrive at random moments and requests cancelled
mid-stream. A failure names the request and its first differing token.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from specdec import Constraints, DecodeConfig, generate, generate_many, models, packs, stream
from specdec.backends.gguf import GGUFCausalLM
from specdec.backends.shared import SharedPasses

from helpers import THREADS

PACK = "smollm2-135m"

# (prompt, method, options): greedy and Gumbel-seeded, chains, trees and plain decoding, stops,
# a schema, logprobs, short and long answers
REQUESTS = [
    ("def fibonacci(n):", "spec", dict(temperature=0, max_new_tokens=40)),
    ("The capital of France is", "spec:model:block:k=4:policy=static",
     dict(temperature=1.0, sampler="gumbel", seed=3, max_new_tokens=24)),
    ("1, 2, 3, 4, 5,", "spec:model:tree", dict(temperature=0, max_new_tokens=32, stop=["12,"])),
    ("import numpy as np\n", "ar", dict(temperature=0.7, top_k=20, sampler="gumbel", seed=5, max_new_tokens=16)),
    ("Alice is 30 years old. As JSON:", "spec", dict(temperature=0, max_new_tokens=48)),
    ("for i in range(10):", "spec:ngram+model:block", dict(temperature=0, max_new_tokens=56)),
    ("A list of fruits:", "spec:model:tree:mode=dynamic", dict(temperature=1.0, sampler="gumbel", seed=9,
                                                               max_new_tokens=20)),
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def pair():
    if packs.missing_parts(packs.PACKS[PACK]):
        pytest.skip(f"pack {PACK} is not installed")
    return models.load_pair(PACK, PACK, backend="gguf", n_threads=THREADS)


def request_kwargs(i: int) -> dict:
    prompt, method, options = REQUESTS[i]
    extra = {"constraints": Constraints(json_schema=SCHEMA)} if "JSON" in prompt else {}
    return dict(config=DecodeConfig.parse(method), logprobs=1 if i == 0 else None, **extra,
                **{**options, "eos_token_ids": []})


def solo(pair, i: int):
    draft = pair.draft if "model" in REQUESTS[i][1] or REQUESTS[i][1] == "spec" else None
    return generate(pair.target, REQUESTS[i][0], draft=draft, tokenizer=pair.tokenizer, **request_kwargs(i))


def first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_same(i: int, got, want) -> None:
    assert got.token_ids == want.token_ids, (
        f"request {i} ({REQUESTS[i][1]}, {REQUESTS[i][2]}): first difference at token "
        f"{first_difference(got.token_ids, want.token_ids)}")
    assert got.text == want.text and got.logprobs == want.logprobs, i


@pytest.fixture(scope="module")
def alone(pair):
    return [solo(pair, i) for i in range(len(REQUESTS))]


def test_generate_many_gives_each_prompt_its_answer_alone(pair, alone):
    configs, constraints, options = [], [], []
    for i in range(len(REQUESTS)):
        kw = request_kwargs(i)
        configs.append(kw["config"].replace(**{k: v for k, v in kw.items()
                                                if k not in ("config", "constraints", "logprobs")}))
        constraints.append(kw.get("constraints"))
    # one call can take one logprobs setting: the requests without logprobs run here, request 0 below
    rest = list(range(1, len(REQUESTS)))
    many = generate_many(pair.target, [REQUESTS[i][0] for i in rest], draft=pair.draft, tokenizer=pair.tokenizer,
                         configs=[configs[i] for i in rest], constraints=[constraints[i] for i in rest])
    for i, got in zip(rest, many):
        check_same(i, got, alone[i])
    assert sum(r.stats.accepted_tokens for r in many) > 0  # drafts were kept beside the other requests


def test_requests_arriving_at_random_moments_and_cancelled_get_their_answers_alone(pair, alone):
    """Each request on its own thread and slot, started after a random delay; two are cancelled
    after a few events (their slots leave); every request that runs to its end equals its answer alone."""
    rng = random.Random(11)
    shared = SharedPasses()
    results: dict[int, object] = {}
    cancelled = {2, 5}

    def run(i: int, delay: float) -> None:
        time.sleep(delay)
        with shared.member():
            target = shared.slot(pair.target)
            draft = shared.slot(pair.draft)
            uses_draft = "model" in REQUESTS[i][1] or REQUESTS[i][1] == "spec"
            events = stream(target, REQUESTS[i][0], draft=draft if uses_draft else None, tokenizer=pair.tokenizer,
                            **request_kwargs(i))
            ids = []
            for n, event in enumerate(events):
                ids += event.token_ids
                if i in cancelled and n == 2:
                    events.close()
                    break
            results[i] = ids

    threads = [threading.Thread(target=run, args=(i, rng.uniform(0, 0.5))) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared.close()
    for i in range(len(REQUESTS)):
        if i in cancelled:
            n = len(results[i])
            assert 0 < n and results[i] == alone[i].token_ids[:n], i
        else:
            assert results[i] == alone[i].token_ids, (i, first_difference(results[i], alone[i].token_ids))
    assert shared.stats.sequences > shared.stats.passes  # passes were shared


def test_a_long_prompt_is_prefilled_in_pieces_beside_the_others(pair, alone):
    """A prompt of several hundred tokens goes in passes of MAX_PASS_ROWS rows, beside another
    request's decoding steps; both answers equal their answers alone."""
    long_prompt = "Numbers: " + ", ".join(str(k) for k in range(150)) + ","
    config = DecodeConfig.parse("spec").replace(temperature=0, max_new_tokens=12, eos_token_ids=[])
    want = generate(pair.target, long_prompt, draft=pair.draft, tokenizer=pair.tokenizer, config=config)
    got = generate_many(pair.target, [long_prompt, REQUESTS[5][0]], draft=pair.draft, tokenizer=pair.tokenizer,
                        configs=[config, request_kwargs(5)["config"].replace(**{
                            k: v for k, v in request_kwargs(5).items() if k not in ("config", "logprobs")})])
    assert got[0].token_ids == want.token_ids
    check_same(5, got[1], alone[5])


def test_generate_many_on_another_backend_runs_the_prompts_in_turn():
    from tiny import noisy_copy, tiny_llama

    target = tiny_llama(0, vocab=16, sharpness=10.0)
    draft = noisy_copy(target, 0.3)
    prompts = [[1, 2, 3], [4, 5], [6]]
    many = generate_many(target, prompts, draft=draft, max_new_tokens=10, temperature=0, eos_token_ids=[])
    assert [r.token_ids for r in many] == [generate(target, p, draft=draft, max_new_tokens=10, temperature=0,
                                                    eos_token_ids=[]).token_ids for p in prompts]
    with pytest.raises(ValueError, match="one entry per prompt"):
        generate_many(target, prompts, configs=[None])


def test_a_slot_is_a_fresh_sequence_on_the_same_weights(pair):
    shared = SharedPasses()
    try:
        slot = shared.slot(pair.target)
        assert isinstance(slot, GGUFCausalLM) and slot.weights is pair.target.weights and slot.tokens == []
        assert slot.passes is shared and pair.target.passes is None
    finally:
        shared.close()


@pytest.mark.slow
def test_the_default_pair_answers_each_prompt_as_alone():
    """The default pair (Qwen2.5-Coder-1.5B drafted by 0.5B, Q4_K_M) on the kernel: prompts decoded
    together, greedy and seeded, each equal to its answer alone."""
    target, draft = packs.DEFAULT_TARGET, packs.DEFAULT_DRAFT
    if packs.missing_parts(packs.PACKS[target]) or packs.missing_parts(packs.PACKS[draft]):
        pytest.skip("the default pair is not installed")
    pair = models.load_pair(target, draft, backend="gguf", n_threads=THREADS)
    prompts = ["def quicksort(arr):", "# Read a CSV file and print its columns\n", "class Stack:"]
    configs = [DecodeConfig.parse("spec").replace(temperature=0, max_new_tokens=32, eos_token_ids=[]),
               DecodeConfig.parse("spec").replace(temperature=1.0, sampler="gumbel", seed=4, max_new_tokens=24,
                                                  eos_token_ids=[]),
               DecodeConfig.parse("spec:model:tree").replace(temperature=0, max_new_tokens=28, eos_token_ids=[])]
    alone = [generate(pair.target, p, draft=pair.draft, tokenizer=pair.tokenizer, config=c)
             for p, c in zip(prompts, configs)]
    together = generate_many(pair.target, prompts, draft=pair.draft, tokenizer=pair.tokenizer, configs=configs)
    for i, (got, want) in enumerate(zip(together, alone)):
        assert got.token_ids == want.token_ids, (i, first_difference(got.token_ids, want.token_ids))


def test_the_servers_pass_metrics_count_a_draft_on_the_targets_weights_as_the_draft(pair):
    """The draft named as the target is a fork of the target's weights, so their rows share passes;
    the server's shared-pass metrics still count the draft's rows (and its passes) as the draft's."""
    from specdec.models import Pair
    from specdec.server.app import make_slots
    from specdec.server.metrics import Metrics

    assert pair.draft.weights is pair.target.weights
    metrics = Metrics()
    slots = make_slots(Pair(pair.target, pair.tokenizer, pair.draft, target_name=PACK, draft_name=PACK), 2, metrics)
    passes = slots[0].passes
    handed: dict[str, int] = {"target": 0, "draft": 0}
    real = passes.run

    def run(model, piece):
        handed["draft" if any(model is s.draft for s in slots) else "target"] += len(piece.tokens)
        return real(model, piece)

    passes.run = run
    server = threading.Thread(target=passes.serve, daemon=True)
    server.start()

    def decode(slot) -> None:
        with passes.member():
            generate(slot.target, "def fibonacci(n):", draft=slot.draft, tokenizer=pair.tokenizer,
                     config=DecodeConfig.parse("spec:model:block:k=4:policy=static").replace(temperature=0,
                                                                                            max_new_tokens=12))

    threads = [threading.Thread(target=decode, args=(slot,)) for slot in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    passes.close()
    server.join()

    def total(name: str, model: str) -> float:
        return metrics.registry.get_sample_value(name + "_total", {"model": model}) or 0.0

    assert handed["draft"] > 0 and handed["target"] > 0
    for model in ("target", "draft"):
        assert total("specdec_shared_pass_rows", model) == handed[model], model
        assert total("specdec_shared_passes", model) > 0
    assert passes.stats.rows == handed["target"] + handed["draft"]
