"""The shared passes' budget and stops (:mod:`specdec.backends.shared`, :func:`specdec.backends.gguf.stop_when`):
a long prompt prefilled beside a decoding request puts only as many rows in each pass as keep the
pass within the budget's multiple of the decoding rows' cost, both answers still equal to their
answers alone; a sequence stopped during its prompt's prefill stops before its next pass, its
caches holding a prefix the next generation reuses.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from specdec import DecodeConfig, generate, models, packs
from specdec.backends import gguf, shared as shared_module
from specdec.backends.gguf import MAX_PASS_ROWS, Piece, Stopped, stop_when
from specdec.backends.shared import SharedPasses, _Call

from helpers import THREADS

PACK = "smollm2-135m"


@pytest.fixture(scope="module")
def pair():
    if packs.missing_parts(packs.PACKS[PACK]):
        pytest.skip(f"pack {PACK} is not installed")
    return models.load_pair(PACK, PACK, backend="gguf", n_threads=THREADS)


def linear(model) -> list[float]:
    """A made-up cost curve: a pass of n rows costs n."""
    return [float(n) for n in range(1, MAX_PASS_ROWS + 1)]


# ----------------------------------------------------------------------------------------------
# The rule, on made-up sequences and costs


@dataclass
class Weights:
    name: str


@dataclass
class Seq:
    weights: Weights


def call(weights: Weights, rows: int, prefill: bool = False) -> _Call:
    return _Call(Seq(weights), Piece(list(range(rows)), list(range(rows)), None, 0), prefill=prefill)


def test_decoding_rows_go_whole_and_prompts_take_what_the_budget_leaves_oldest_first():
    target, draft = Weights("target"), Weights("draft")
    costs = {"target": [1.0, 1.2, 1.4, 1.6] + [1.6 + 0.5 * n for n in range(1, 61)],  # 4 rows cost 1.6, then 0.5 a row
             "draft": [0.5 * n for n in range(1, 65)]}
    passes = SharedPasses(own_thread=False, budget=3.0, costs=lambda model: costs[model.weights.name])
    # one decoding sequence verifying 4 rows (1.6) and two prompts: 2 x 1.6 left over; the first prompt's
    # rows cost 0.5 each after the 4th row: 6 rows (3.0), the second prompt the 0.2 left: none
    calls = [call(target, 64, prefill=True), call(target, 4), call(target, 64, prefill=True)]
    assert passes._rows(calls, members=3) == [6, 4, 0]
    # the prompt on the draft's weights: its own curve, from its first row
    assert passes._rows([call(target, 4), call(draft, 64, prefill=True)], members=2) == [4, 6]
    # a decoding row of each model (1.0 + 0.5): 3.0 left, the prompt's target rows from the 2nd: 8 rows cost 3.6
    assert passes._rows([call(target, 1), call(draft, 1), call(target, 64, prefill=True)], members=3) == [1, 1, 7]
    # prompts alone, every member prefilling: whole pieces
    assert passes._rows([call(target, 64, prefill=True), call(draft, 64, prefill=True)], members=2) == [64, 64]
    # prompts alone while another member is busy: the pass is kept to what one decoding row would allow
    assert passes._rows([call(target, 64, prefill=True)], members=2) == [4]  # 2 x 1.0 left: 4 rows cost 1.6
    # the oldest prompt advances even where nothing fits
    tight = SharedPasses(own_thread=False, budget=1.01, costs=lambda model: costs[model.weights.name])
    assert tight._rows([call(target, 1), call(target, 64, prefill=True), call(target, 64, prefill=True)],
                       members=3) == [1, 1, 0]
    # a one-row prompt piece, and anything without a budget or costs, goes whole
    assert passes._rows([call(target, 1), call(target, 1, prefill=True)], members=2) == [1, 1]
    unbounded = [SharedPasses(own_thread=False, budget=None, costs=linear), SharedPasses(own_thread=False)]
    for p in unbounded:
        assert p._rows([call(target, 1), call(target, 64, prefill=True)], members=2) == [1, 64]
    with pytest.raises(ValueError, match="above 1"):
        SharedPasses(own_thread=False, budget=1.0)


def test_a_piece_split_in_two_computes_what_it_computes_whole(pair):
    """A causal chain's rows split after any row: the same logits and cache, bit for bit."""
    model = pair.target.fork()
    context = [(7 * k + 3) % 1000 + 10 for k in range(40)]
    chain = [(11 * k + 5) % 1000 + 10 for k in range(20)]

    def run(pieces):
        model.reset()
        model.forward(context)
        out = [gguf.run_together([(model, piece)])[0] for piece in pieces]
        return torch.cat(out), model._cache[:, :, :, : model._length].clone(), list(model.tokens)

    model.reset()
    model.forward(context)
    whole = model.pieces(chain, num_logits=5)
    assert len(whole) == 1
    want_logits, want_cache, want_tokens = run(whole)
    for at in (1, 7, 19):
        head, rest = whole[0].split(at)
        assert (head.want, rest.want) == (max(0, 5 - (20 - at)), min(5, 20 - at))
        logits, cache, tokens = run([head, rest])
        assert torch.equal(logits, want_logits) and torch.equal(cache, want_cache) and tokens == want_tokens, at
    with pytest.raises(ValueError, match="splits after"):
        whole[0].split(20)


# ----------------------------------------------------------------------------------------------
# On SmolLM2: exact answers within the budget, and stops


def long_prompt(pair, tokens: int, salt: int = 0) -> list[int]:
    text = "Numbers: " + ", ".join(str(k * (salt + 1)) for k in range(tokens))
    ids = pair.tokenizer(text)["input_ids"]
    assert len(ids) >= tokens
    return ids[:tokens]


class Recorder:
    """Wraps run_together: each pass's (sequence, rows) pairs, and a hook called after each pass."""

    def __init__(self, monkeypatch, module) -> None:
        self.passes: list[list[tuple[object, int]]] = []
        self.after = lambda: None
        original = module.run_together

        def recording(calls):
            out = original(calls)
            self.passes.append([(model, len(piece.tokens)) for model, piece in calls])
            self.after()
            return out

        monkeypatch.setattr(module, "run_together", recording)


def test_a_short_request_beside_a_long_prompt_gets_passes_within_the_budget(pair, monkeypatch):
    """On a made-up curve where each row costs a one-row pass, a budget of 3: every pass holding the
    short request's rows holds at most twice as many prompt rows; the prompt goes whole (64 rows a
    pass) once it is alone; both answers equal their answers alone."""
    prompt = long_prompt(pair, 300)
    config = DecodeConfig.parse("spec").replace(temperature=0, max_new_tokens=8, eos_token_ids=[])
    short_config = DecodeConfig.parse("ar").replace(temperature=0, max_new_tokens=16, eos_token_ids=[])
    want_long = generate(pair.target, prompt, draft=pair.draft, config=config).token_ids
    want_short = generate(pair.target, "def fibonacci(n):", tokenizer=pair.tokenizer, config=short_config).token_ids

    recorder = Recorder(monkeypatch, shared_module)
    passes = SharedPasses(budget=3.0, costs=linear)
    slots = {}
    got = {}
    begun = threading.Event()
    recorder.after = begun.set

    def run_long():
        with passes.member():
            slots["long"] = (passes.slot(pair.target), passes.slot(pair.draft))
            target, draft = slots["long"]
            got["long"] = generate(target, prompt, draft=draft, config=config).token_ids

    def run_short():
        begun.wait()
        with passes.member():
            slots["short"] = passes.slot(pair.target)
            got["short"] = generate(slots["short"], "def fibonacci(n):", tokenizer=pair.tokenizer,
                                    config=short_config).token_ids

    threads = [threading.Thread(target=run_long), threading.Thread(target=run_short)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    passes.close()
    assert got["long"] == want_long and got["short"] == want_short
    mixed = 0
    for pass_ in recorder.passes:
        short = sum(rows for model, rows in pass_ if model is slots["short"])
        prompt_rows = sum(rows for model, rows in pass_ if model in slots["long"])
        if short:
            mixed += prompt_rows > 0
            assert prompt_rows <= 2 * short, pass_
    assert mixed >= 5  # the prompt did advance beside the short request
    assert any(rows == MAX_PASS_ROWS for pass_ in recorder.passes for _, rows in pass_)  # and went whole alone
    assert passes.stats.held > 0 and passes.stats.prompt_rows >= len(prompt) - 1


def test_a_sequence_stopped_during_its_prompt_stops_before_its_next_pass(pair, monkeypatch):
    """Shared passes under a budget: the stop is set after the prompt's second pass; the generation
    raises Stopped without another pass of its rows; its caches hold a prefix of the prompt, which
    the next generation on the same slots reuses for its answer alone."""
    prompt = long_prompt(pair, 300, salt=1)
    config = DecodeConfig.parse("spec").replace(temperature=0, max_new_tokens=8, eos_token_ids=[])
    recorder = Recorder(monkeypatch, shared_module)
    passes = SharedPasses(budget=3.0, costs=linear)
    stop = threading.Event()
    outcome = {}

    def run():
        with stop_when(stop), passes.member():
            target, draft = passes.slot(pair.target), passes.slot(pair.draft)
            outcome["slots"] = (target, draft)
            try:
                generate(target, prompt, draft=draft, config=config)
            except Stopped:
                outcome["stopped"] = len(recorder.passes)

    recorder.after = lambda: len(recorder.passes) >= 2 and stop.set()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert outcome.get("stopped") == 2  # no pass after the stop
    target, draft = outcome["slots"]
    ran = sum(rows for pass_ in recorder.passes for _, rows in pass_)
    assert 0 < len(target.tokens) <= ran < len(prompt) - 1
    for cache in (target, draft):
        assert cache.tokens == prompt[: len(cache.tokens)] and cache._length == len(cache.tokens)
    # the same slots, not stopped: the answer alone, from the prefix they hold
    recorder.after = lambda: None
    held = len(target.tokens)
    with passes.member():
        got = generate(target, prompt, draft=draft, config=config.replace(prompt_cache=True))
    passes.close()
    assert got.token_ids == generate(pair.target, prompt, draft=pair.draft, config=config).token_ids
    assert got.stats.prompt_cached >= held > 0


def test_a_forward_of_its_own_stops_between_its_passes(pair, monkeypatch):
    """Without shared passes (one request at a time), a long prompt's forward stops after the pass
    under way once the event is set."""
    prompt = long_prompt(pair, 200, salt=2)
    recorder = Recorder(monkeypatch, gguf)
    stop = threading.Event()
    recorder.after = stop.set
    model = pair.target.fork()
    with stop_when(stop), pytest.raises(Stopped):
        generate(model, prompt, max_new_tokens=4, temperature=0)
    assert len(recorder.passes) == 1 and model.tokens == prompt[:MAX_PASS_ROWS]
    with stop_when(threading.Event()):  # an event not set: runs to the end
        assert generate(model, prompt, max_new_tokens=4, temperature=0).token_ids == \
            generate(pair.target, prompt, max_new_tokens=4, temperature=0).token_ids


def test_an_error_out_of_the_executor_reaches_the_sequences_waiting_on_it(pair):
    """An exception that ends the executor's loop (an interrupt on the thread running it, as in
    generate_many) is handed to every sequence waiting for a pass, and to any that hands a piece in
    later, instead of leaving them waiting for ever."""
    def observe(pieces):
        raise KeyboardInterrupt

    passes = SharedPasses(own_thread=False, observe=observe)
    ended = []

    def serve():
        try:
            passes.serve()
        except KeyboardInterrupt:
            ended.append(True)

    errors = []

    def decode():
        with passes.member():
            slot = passes.slot(pair.target)
            for _ in range(2):
                try:
                    slot.forward([5, 6, 7])
                except RuntimeError as err:
                    errors.append(str(err))

    threads = [threading.Thread(target=serve, daemon=True), threading.Thread(target=decode, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert ended == [True] and not any(t.is_alive() for t in threads)
    assert errors == ["the shared passes stopped: KeyboardInterrupt()", "the shared passes were closed"]
