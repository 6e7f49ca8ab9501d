"""The serving engine (:mod:`specdec.serving`): several requests decoded together in its slots,
their passes sharing each pass of the weights (:class:`~specdec.serving.Engine`,
:func:`specdec.generate_many`): each answer is, token for token, the answer the same request gets
alone, whatever else runs beside it -- other methods, lengths, temperatures and constraints,
requests that arrive at random moments and requests cancelled mid-stream. A failure names the
request and its first differing token. Also: its queue, its board's seats, and that its requests
and messages are data (they pickle).
"""

from __future__ import annotations

import asyncio
import pickle
import random
import threading
import time

import pytest

from specdec import Constraints, DecodeConfig, generate, generate_many, models, packs, stream
from specdec.backends.gguf import GGUFCausalLM
from specdec.backends.shared import SharedPasses
from specdec.constraints import TokenLogprob
from specdec.models import Pair
from specdec.serving import (
    Cancelled, Chunk, ConstraintFailed, Engine, Finished, ModelFailed, QueueFull, ShuttingDown, TimedOut, Work,
)
from specdec.serving.board import Board
from specdec.stats import GenerationStats

from helpers import THREADS, tiny_pair, tiny_tokenizer

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


def work_of(pair, i: int) -> Work:
    """Request i as the engine takes it: token ids and a config holding every option."""
    kw = request_kwargs(i)
    config = kw["config"].replace(**{k: v for k, v in kw.items() if k not in ("config", "constraints", "logprobs")})
    ids = pair.tokenizer(REQUESTS[i][0], add_special_tokens=True)["input_ids"]
    return Work(ids, config, kw.get("constraints"), kw["logprobs"])


@pytest.mark.parametrize("parallel", [2, 4])
def test_requests_arriving_at_random_moments_and_cancelled_get_their_answers_alone(pair, alone, parallel):
    """Each request submitted to the engine after a random delay; two are stopped after their first step
    (their slots go to the next); every request that runs to its end equals its answer alone."""
    rng = random.Random(11)
    engine = Engine(Pair(pair.target, pair.tokenizer, pair.draft), parallel=parallel, prompt_cache_bytes=None)
    engine.start()
    results: dict[int, list] = {i: [] for i in range(len(REQUESTS))}
    ended: dict[int, str] = {}
    done = threading.Semaphore(0)
    cancelled = {2, 5}
    handles = {}

    def post_for(i: int):
        def post(kind, payload) -> None:
            if kind == "step":
                results[i].append(payload)
                if i in cancelled and len(results[i]) == 1:
                    handles[i].stop()
                return
            ended[i] = kind if kind == "done" else type(payload).__name__
            done.release()
        return post

    try:
        for i in range(len(REQUESTS)):
            time.sleep(rng.uniform(0, 0.1))
            handles[i] = engine.submit(work_of(pair, i), post_for(i))
        for _ in REQUESTS:
            assert done.acquire(timeout=300)
    finally:
        engine.close()
    for i in range(len(REQUESTS)):
        ids = [t for chunk in results[i] for t in chunk.token_ids]
        if i in cancelled:
            assert ended[i] == "Cancelled" and 0 < len(ids) and ids == alone[i].token_ids[:len(ids)], i
        else:
            assert ended[i] == "done", (i, ended[i])
            assert ids == alone[i].token_ids, (i, first_difference(ids, alone[i].token_ids))
            assert "".join(chunk.text for chunk in results[i]) == alone[i].text[:len("".join(c.text for c in results[i]))]
    passes = engine.pool.passes.stats
    assert passes.sequences > passes.passes  # passes were shared
    status = engine.status()
    assert (status.slots, status.busy, status.queued, status.requests) == (parallel, 0, 0, len(REQUESTS))


def test_the_engine_streams_in_an_event_loop_as_alone(pair, alone):
    """:meth:`Engine.stream`: two requests at once, greedy with logprobs and seeded Gumbel-max, each
    its answer alone; the end carries the held text, the whole text and the prompt's tokens."""
    engine = Engine(Pair(pair.target, pair.tokenizer, pair.draft), parallel=2, prompt_cache_bytes=None)
    engine.start()

    async def one(i: int):
        steps, end = [], None
        async for kind, payload in engine.stream(work_of(pair, i)):
            if kind == "step":
                steps.append(payload)
            else:
                end = payload
        return steps, end

    async def both():
        return await asyncio.gather(one(0), one(1))

    try:
        answers = asyncio.run(both())
    finally:
        engine.close()
    for i, (steps, end) in zip((0, 1), answers):
        assert isinstance(end, Finished), end
        assert end.token_ids == alone[i].token_ids and end.text == alone[i].text, i
        assert "".join(c.text for c in steps) + end.held == end.text
        assert end.logprobs == alone[i].logprobs and end.prompt_tokens == len(work_of(pair, i).prompt)


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


def test_only_models_that_share_passes_make_slots():
    target, draft = tiny_pair()
    served = Pair(target, tiny_tokenizer(), draft, target_name="tiny")
    with pytest.raises(ValueError, match="GGUF kernel"):
        Engine(served, parallel=2)
    assert Engine(served, parallel=1).pool is None
    with pytest.raises(ValueError, match="at least 1"):
        Engine(served, parallel=0)


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
    from specdec.server.metrics import Metrics
    from specdec.serving.pool import Pool

    assert pair.draft.weights is pair.target.weights
    metrics = Metrics()
    pool = Pool(pair.target, pair.draft, 2, metrics)
    slots, passes = pool.slots, pool.passes
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


def test_retry_after_grows_with_the_queue():
    target, draft = tiny_pair()
    engine = Engine(Pair(target, tiny_tokenizer(), draft), max_queue=16)  # not started: submitted work waits
    assert engine.retry_after() == 1  # nothing measured, nothing waiting
    engine.durations.extend([0.5, 1.5])
    seen = []
    for _ in range(6):
        engine.submit(Work([1, 2], DecodeConfig()), lambda kind, payload: None)
        seen.append(engine.retry_after())
    assert seen == [1, 2, 3, 4, 5, 6]
    engine.durations.extend([0.2] * 16)  # only recent generations count
    assert engine.retry_after() == 2


def test_a_full_queue_and_a_closed_engine_refuse_work_with_the_engines_errors():
    target, draft = tiny_pair()
    engine = Engine(Pair(target, tiny_tokenizer(), draft), max_queue=1)
    ended = []
    engine.submit(Work([1], DecodeConfig()), lambda kind, payload: ended.append(payload))  # runs (once started)
    engine.submit(Work([1], DecodeConfig()), lambda kind, payload: ended.append(payload))  # waits
    with pytest.raises(QueueFull) as full:
        engine.submit(Work([1], DecodeConfig()), lambda kind, payload: None)
    assert full.value.retry_after == 2  # two ahead, 1 s each before any has finished
    engine.close()
    assert [type(e) for e in ended] == [ShuttingDown, ShuttingDown]  # never started: both were waiting
    with pytest.raises(ShuttingDown):
        engine.submit(Work([1], DecodeConfig()), lambda kind, payload: None)


def test_seats_are_kept_by_slot_so_two_slots_on_one_thread_do_not_collide():
    board = Board()
    a, b, c = board.seat(), board.seat(), board.seat()
    a.post(3, 2.0)
    b.post(5, 4.0)  # the same thread: still another slot's plan
    assert a.others() == (5, 4.0, 1) and b.others() == (3, 2.0, 1) and c.others() == (8, 6.0, 2)
    b.leave()
    assert a.others() == (0, 0.0, 0) and c.others() == (3, 2.0, 1)


def test_work_messages_and_errors_pickle():
    """A request and everything the engine posts about it are data: they cross a process as they are."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    config = DecodeConfig.parse("spec:model:block:k=4").replace(temperature=0.7, seed=3, sampler="gumbel",
                                                                  max_new_tokens=16, stop=["\n\n"], prompt_cache=True)
    work = Work([1, 2, 3], config, Constraints(json_schema=schema, logit_bias={5: -100.0}), logprobs=2, timeout=30.0)
    tools = Constraints(grammar='start: "{" "}"', presence_penalty=0.5)  # a forced tool call's grammar
    for value in (work, Work("text", DecodeConfig(), tools)):
        assert pickle.loads(pickle.dumps(value)) == value
    logprobs = [TokenLogprob(5, -0.25, ((5, -0.25), (7, -2.0)))]
    chunk = Chunk([5], "hi", [True], 2, 3, logprobs)
    stats = GenerationStats(new_tokens=1, policy={"name": "auto"})
    finished = Finished("", [5], "hi", stats, logprobs, 3, 1)
    for value in (chunk, finished):
        assert pickle.loads(pickle.dumps(value)) == value
    for err in (QueueFull("full", retry_after=4), ConstraintFailed("past", field="json_schema", tokens=7),
                ModelFailed("nan", source="m.gguf", position=9), TimedOut("late"), Cancelled("stopped")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and back.__dict__ == err.__dict__ and str(back) == str(err)
