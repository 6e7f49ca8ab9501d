"""The planner (policy="auto"): its choice under injected cost curves, a 0-token draft through every
drafter and verifier, the measurement and its cache, and the output law with k switching between steps.

No test here asserts on a timing: the cost curves are injected, and where the real measurement
runs it is only checked for what it leaves behind (the model's cache) and its shape.
"""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
import torch
from helpers import (
    ContextLM, CHEAP_ROWS, DEAR_ROWS, EDGE_ROWS, PROMPT, ROWS, SAMPLES, SIGNIFICANCE, ar_tokens, chi_square_p_value,
    chi_square_power, drafter_for, exact_target_law, run_main,
)
from helpers import tiny  # noqa: F401  (tiny: a fixture)
from tiny import noisy_copy, tiny_llama

from specdec import generate
from specdec.backends.base import forward_after
from specdec.serving.board import Board
from specdec.backends.hf import HFCausalLM
from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.build import make_drafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NGramDrafter
from specdec.engine import autoregressive_steps, speculative_steps
from specdec.drafters.choice import ChoiceDrafter
from specdec.measurements import cost_key
from specdec.policies.auto import PROBE_SHARE, AutoPolicy, best_length, summary_line
from specdec.costs import MAX_ROWS, CostModel, measure_rows, plausible, row_costs
from specdec.policies import make_policy
from specdec.sampling import SamplingConfig
from specdec.stats import Step
from specdec.verify import VERIFIERS, make_verifier

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, vocab=16, sharpness=10.0)
    return target, noisy_copy(target, 0.3)


def planner_chose_plain(steps, limit: int) -> tuple[int, int]:
    """(steps that drafted nothing though there was room, steps that drafted): the planner's choices."""
    produced, plain, drafting = 0, 0, 0
    for s in steps:
        if s.drafted == 0 and produced < limit - 1:
            plain += 1
        drafting += s.drafted > 0
        produced += len(s.tokens)
    return plain, drafting


# --- the choice, from injected costs --------------------------------------------------------------


def test_best_length_weighs_expected_tokens_against_time():
    assert best_length([0.9] * 4, [1.0, 1.05, 1.1, 1.15, 1.2])[0] == 4  # cheap rows: draft all
    assert best_length([0.9] * 4, [0.9, 1.8, 2.7, 3.6, 4.5])[0] == 0  # a row costs a step: never
    # E(1) = 1.6 for 1.4x a plain step pays (1.14x); E(2) = 1.96 for 1.8x pays less
    k, expected, rate = best_length([0.6, 0.6], [1.0, 1.4, 1.8])
    assert (k, expected, rate) == (1, pytest.approx(1.6), pytest.approx(1.6 / 1.4))


def test_cheap_rows_and_high_acceptance_speculate_long(pair):
    target, _ = pair
    policy = AutoPolicy(costs=CHEAP_ROWS)
    result = generate(target, PROMPT, draft=target, drafter="model", verify="block", policy=policy, max_new_tokens=100)
    state = result.stats.policy
    assert result.token_ids == ar_tokens(target, PROMPT, 100)
    planned = {int(k): n for k, n in state["planned"].items()}
    assert min(planned) >= 3  # every step planned at least 3 drafts
    # keep_going cuts drafts at tokens the draft is unsure of until the calibration learns that
    # this draft (the target itself) is always right there; over the run it drafts long
    assert result.stats.drafted_tokens / result.stats.target_forwards >= 3
    assert state["reason"].startswith(f"k={max(planned, key=planned.get)}:")
    assert state["costs"]["source"] == "injected" and state["costs"]["target_ms"][0] == 1000.0


def test_expensive_rows_choose_plain_steps_and_reproduce_ar_exactly(pair):
    target, draft = pair
    policy = AutoPolicy(costs=DEAR_ROWS)
    result = generate(target, PROMPT, draft=draft, drafter="model", verify="block", policy=policy, max_new_tokens=30)
    assert result.token_ids == ar_tokens(target, PROMPT, 30)
    assert result.stats.drafted_tokens == 0 and result.stats.target_forwards == 30
    state = result.stats.policy
    assert state["planned"] == {"0": 30} and state["probes"] == 0
    assert state["reason"].startswith("k=0: even a draft accepted in full does not pay: a 2-row pass costs 2.00x")
    line = summary_line(state)
    assert line.startswith("planner: drafted k=0 x30;") and "2 rows 2.00x" in line and "\n" not in line


def test_the_planner_drafts_less_after_rejections_and_probes_back():
    policy = AutoPolicy(k_max=4, costs=EDGE_ROWS)
    assert policy.next_k() >= 1  # the prior alpha (0.6) pays for one token
    policy.update(Step([5], 1, 0, 0.0, 1.0))  # rejected
    assert policy.next_k() == 0
    assert "alpha=0.40 does not pay" in policy.describe()["reason"]  # (0 + 2 x 0.6) / (1 + 2)
    plans = [policy.next_k() for _ in range(40)]  # no drafting: the estimates stay, probes come
    # A probe costs 0.4 s beyond a plain step (one more row); it comes once the plain steps since
    # the last one (1 s each, the first before the list) took 0.4 / PROBE_SHARE seconds.
    every = math.ceil(0.4 / PROBE_SHARE)
    assert [i for i, k in enumerate(plans) if k] == [every - 1, 2 * every] and policy.describe()["probes"] == 2


def test_a_lagging_draft_model_is_charged_its_catch_up():
    """The draft model pays per step (rows nearly free, alpha 0.9); behind by a prompt of 200
    tokens it must first feed them, C = 1.5 s, which the step is charged as C * E(k) / room."""
    costs = CostModel([1.0 + 0.05 * (n - 1) for n in ROWS], draft=0.05, draft_rows=[0.05 * n for n in ROWS])
    catch_up = 0.05 * 16 * 201 / 16 - 0.05  # past the 16-row curve: its cost per row
    policy = AutoPolicy(k_max=4, costs=costs, prior_alpha=0.9)
    policy.bind(None, ChoiceDrafter.build(ModelDrafter(HFCausalLM(tiny_llama(0)))))
    assert policy.plan({"model": None}, {}, 100).k > 0  # caught up: it drafts
    assert policy.catch_up() == 0.0
    assert policy.plan({"model": None}, {"model": 200}, 2).k == 0  # two tokens cannot carry 1.5 s
    assert policy.catch_up() == pytest.approx(catch_up)
    assert policy.plan({"model": None}, {"model": 200}, 1000).k > 0  # a thousand can
    lone = AutoPolicy(k_max=4, costs=DEAR_ROWS)  # no draft_rows: nothing to price
    lone.bind(None, ModelDrafter(HFCausalLM(tiny_llama(0))))
    lone.plan({"model": None}, {"model": 200}, 2)
    assert lone.catch_up() == 0.0


def test_a_draft_model_is_behind_by_what_it_has_not_fed():
    model = HFCausalLM(tiny_llama(0))
    drafter = ModelDrafter(model)
    assert drafter.behind([1, 2, 3]) == {"model": 2}  # every draft feeds the last token; the rest is catch-up
    model.forward([1, 2, 3])
    assert drafter.behind([1, 2, 3]) == {} and drafter.behind([1, 2, 3, 4, 5]) == {"model": 1}
    assert drafter.behind([1, 9, 3, 4]) == {"model": 2}  # a rejected token is trimmed, then fed again
    assert ChoiceDrafter.build(drafter).behind([1, 2, 3, 4, 5]) == {"model": 1}


def test_a_slot_plans_for_the_whole_shared_pass():
    """In a shared pass the planner maximises the pass's expected tokens per second: the other
    slots' rows set where its own rows fall on the cost curve, and their expected tokens join its
    own. Rows that are dear in a pass of their own (a second row 0.9x a first) are cheap beside four
    others (0.1x each): alone it does not draft; in the pass it drafts, and its length is the
    brute-force maximum of (E_others + E(k)) / T(R + k + 1)."""
    curve = [1.0 + 0.9 * n for n in range(5)] + [4.6 + 0.1 * n for n in range(1, 12)]  # 1..16 rows
    costs = CostModel(curve, draft=0.0)
    alone = AutoPolicy(k_max=4, costs=costs, prior_alpha=0.6)
    alone.bind(None, NGramDrafter(16))
    assert alone.next_k() == 0
    board = Board()
    mine = board.seat()
    mine.post(4, 4.0)  # this slot's own post is not the others'
    others = [board.seat(), board.seat()]
    others[0].post(4, 4.0)  # posted by another slot on this thread: four sequences of one row, a token each
    worker = threading.Thread(target=others[1].post, args=(4, 4.0))
    worker.start(), worker.join()
    others[0].leave()
    policy = AutoPolicy(k_max=4, costs=costs, prior_alpha=0.6)
    policy.bind(None, NGramDrafter(16), mine)
    k = policy.next_k()
    expected = [1.0 + sum(0.6 ** i for i in range(1, n + 1)) for n in range(5)]
    rates = [(4.0 + expected[n]) / costs.target_cost(4 + n + 1) for n in range(5)]
    assert k == max(range(5), key=lambda n: (rates[n], -n)) and k > 0
    assert policy.describe()["shared_pass"]["steps_with_others"] == 1


def test_the_board_sums_the_other_slots_plans_and_forgets_a_slot_that_leaves():
    board, seen = Board(), {}
    posted, read, left = threading.Barrier(4), threading.Barrier(4), threading.Barrier(4)  # three slots and this test
    done = threading.Event()
    mine = board.seat()  # this test's seat, with no plan posted

    def slot(name, rows, expected):
        seat = board.seat()
        seat.post(rows, expected)
        posted.wait()
        seen[name] = seat.others()
        read.wait()
        if name == "b":
            seat.leave()
        left.wait()
        done.wait()

    threads = [threading.Thread(target=slot, args=plan) for plan in (("a", 3, 2.5), ("b", 1, 1.0), ("c", 5, 3.0))]
    for t in threads:
        t.start()
    posted.wait(), read.wait(), left.wait()
    assert seen == {"a": (6, 4.0, 1), "b": (8, 5.5, 2), "c": (4, 3.5, 1)}  # a row of 1: not drafting
    assert mine.others() == (8, 5.5, 2)  # b left: a and c
    done.set()
    for t in threads:
        t.join()


def test_keep_going_stops_where_the_next_token_does_not_pay():
    policy = AutoPolicy(k_max=8, costs=CostModel([1.0 + 0.1 * (n - 1) for n in ROWS], draft=0.1))
    assert policy.next_k() >= 2
    sure, unsure = torch.tensor([0.97, 0.03]), torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    assert policy.keep_going(sure)  # chance 0.95: 0.9 extra tokens for 0.2 extra time
    assert not policy.keep_going(unsure)  # chance 0.25 of a draft already at 0.95 x 0.25


def test_auto_is_a_policy_by_name():
    policy = make_policy("auto", 4)
    assert isinstance(policy, AutoPolicy) and policy.k_max == 16
    assert make_policy("auto", 4, k_max=6).k_max == 6
    with pytest.raises(ValueError, match="positive"):
        CostModel([1.0, 0.0])
    with pytest.raises(ValueError, match="decay"):
        AutoPolicy(decay=0.0)


# --- a 0-token draft is a plain target step, through every drafter and verifier -------------------


@pytest.mark.parametrize("drafter_name", ["model", "ngram", "early-exit", "layer-skip", "heads", "eagle"])
def test_plain_steps_through_every_drafter_and_verifier_equal_ar(drafter_name):
    model = tiny_llama(3, vocab=16, layers=2, sharpness=4.0)
    prompt = [1, 2, 3, 1, 2, 3, 1]
    expected = ar_tokens(model, prompt, 12)
    for verify in VERIFIERS:
        target, drafter = drafter_for(drafter_name, model)
        steps = list(speculative_steps(
            target, drafter, make_verifier(verify), AutoPolicy(costs=DEAR_ROWS), prompt,
            sampling=GREEDY, max_new_tokens=12,
        ))
        assert [t for s in steps for t in s.tokens] == expected, verify
        assert all(s.drafted == 0 and len(s.tokens) == 1 for s in steps)
        assert target.tokens == (prompt + expected)[: len(target.tokens)]  # nothing stale cached


def test_sampled_plain_steps_reproduce_seeded_ar_draw_for_draw():
    """A plain step through the speculative loop is the autoregressive step: at T=1 with a seed,
    a run that never drafts gives ar's tokens exactly (the same uniforms, drawn the same way)."""
    model = tiny_llama(3, vocab=16, layers=2, sharpness=1.0)
    prompt = [1, 2, 3, 1, 2, 3, 1]
    sampling = SamplingConfig(temperature=1.0)
    for seed in range(5):
        ar = autoregressive_steps(HFCausalLM(model), prompt, sampling=sampling, max_new_tokens=20,
                                  generator=torch.Generator().manual_seed(seed))
        expected = [t for s in ar for t in s.tokens]
        for verify in VERIFIERS:
            target, drafter = drafter_for("model", model)
            steps = list(speculative_steps(
                target, drafter, make_verifier(verify), AutoPolicy(costs=DEAR_ROWS), prompt,
                sampling=sampling, max_new_tokens=20, generator=torch.Generator().manual_seed(seed),
            ))
            assert [t for s in steps for t in s.tokens] == expected, (seed, verify)
    assert len({tuple(t for s in autoregressive_steps(HFCausalLM(model), prompt, sampling=sampling, max_new_tokens=20,
                                                      generator=torch.Generator().manual_seed(seed)) for t in s.tokens)
                for seed in range(5)}) > 1  # the seeds do draw different outputs


# --- measurement and cache -------------------------------------------------------------------------


def test_measuring_leaves_the_models_cache_as_it_was():
    model = tiny_llama(4, vocab=16)
    backend = HFCausalLM(model)
    context = [1, 2, 3, 4, 5]
    forward_after(backend, context[:-1])
    before = list(backend.tokens)
    curve = measure_rows(backend, 5, repeats=(1, 1))
    assert backend.tokens == before
    assert len(curve) == 5 and all(b >= a > 0 for a, b in zip(curve, curve[1:]))
    cached = forward_after(backend, context)[-1]
    with torch.no_grad():
        fresh = model(torch.tensor([context])).logits[0, -1]
    torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)


def fake_measure(calls: list):
    def measure(model, max_rows=MAX_ROWS, **_):
        calls.append(max_rows)
        return [1.0 + 0.5 * n for n in range(max_rows)]

    return measure


def test_the_cache_round_trips_and_its_key_follows_threads_and_dtype(tmp_path, monkeypatch):
    import specdec.costs as planner

    calls: list[int] = []
    monkeypatch.setattr(planner, "measure_rows", fake_measure(calls))
    backend = HFCausalLM(tiny_llama(5, vocab=16))
    curve, source = row_costs(backend, cache_dir=tmp_path)
    assert source == "measured" and calls == [MAX_ROWS]
    again, source = row_costs(backend, cache_dir=tmp_path)
    assert (again, source) == (curve, "cache") and calls == [MAX_ROWS]
    assert row_costs(backend, 4, cache_dir=tmp_path) == (curve[:4], "cache")
    files = list((tmp_path / "planner").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"] == cost_key(backend)
    files[0].write_text("{not json")
    assert row_costs(backend, cache_dir=tmp_path) == (curve, "measured") and len(calls) == 2

    key = cost_key(backend)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cost_key(backend)["threads"] == threads + 1 and cost_key(backend) != key
    finally:
        torch.set_num_threads(threads)
    half = HFCausalLM(tiny_llama(5, vocab=16).to(torch.bfloat16))
    assert cost_key(half)["dtype"] == "bfloat16" and key["dtype"] == "float32"
    assert {k: v for k, v in cost_key(half).items() if k != "dtype"} == {k: v for k, v in key.items() if k != "dtype"}
    assert row_costs(half, cache_dir=tmp_path)[1] == "measured"  # its own entry
    assert len(list((tmp_path / "planner").glob("*.json"))) == 2


def test_the_curve_covers_the_longest_pass_and_a_disturbed_one_is_measured_again_and_not_kept(tmp_path, monkeypatch):
    import specdec.costs as planner
    from specdec.drafters.base import DEFAULT_K_MAX

    assert MAX_ROWS == DEFAULT_K_MAX + 1  # every pass the planner may choose is measured, none extrapolated
    disturbed = [1.0] + [2.8] * (MAX_ROWS - 1)  # two replicas measured at once on 2 cores: 2 rows at 2.8x
    calm = [1.0 + 0.3 * n for n in range(MAX_ROWS)]
    assert not plausible(disturbed) and plausible(calm)
    takes = iter([disturbed, disturbed, calm])
    monkeypatch.setattr(planner, "measure_rows", lambda model, max_rows=MAX_ROWS, **_: list(next(takes)))
    backend = HFCausalLM(tiny_llama(5, vocab=16))
    assert row_costs(backend, cache_dir=tmp_path) == (disturbed, "measured")  # twice disturbed: used, not kept
    assert not list((tmp_path / "planner").glob("*.json"))
    takes = iter([disturbed, calm])
    curve, source = row_costs(backend, cache_dir=tmp_path)  # the second take's faster times, kept
    assert source == "measured" and curve == [min(a, b) for a, b in zip(disturbed, calm)]
    assert row_costs(backend, cache_dir=tmp_path) == (curve, "cache")


def test_a_backend_that_runs_a_weights_file_is_keyed_by_the_file_and_its_threads(tmp_path):
    from types import SimpleNamespace

    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    two = SimpleNamespace(weights=SimpleNamespace(path=gguf), n_threads=2, n_batch=512)
    key = cost_key(two)
    assert key["model"] == gguf.name and key["bytes"] == 64 and key["threads"] == 2
    assert cost_key(SimpleNamespace(weights=two.weights, n_threads=1, n_batch=512)) != key
    gguf.write_bytes(b"GGUF" + bytes(100))  # another file under the same name
    assert cost_key(two) != key


def test_bind_measures_the_target_and_the_draft_model_once(tmp_path, monkeypatch):
    import specdec.costs as planner

    calls: list[int] = []
    monkeypatch.setattr(planner, "measure_rows", fake_measure(calls))
    target = HFCausalLM(tiny_llama(5, vocab=16))
    policy = AutoPolicy(cache_dir=tmp_path)
    policy.bind(target, ModelDrafter(HFCausalLM(tiny_llama(6, vocab=16, layers=1))))
    # the draft model's whole curve: its one-row pass drafts a token, longer passes catch it up
    assert calls == [MAX_ROWS, MAX_ROWS] and policy.costs.draft == 1.0 and policy.costs.source == "measured"
    assert len(policy.costs.draft_rows) == MAX_ROWS
    other = AutoPolicy(cache_dir=tmp_path)
    other.bind(target, NGramDrafter(16))
    assert calls == [MAX_ROWS, MAX_ROWS] and other.costs.source == "cache" and other.costs.draft_rows is None
    assert other.costs.draft == 0.0 and other.describe()["costs"]["draft_source"] == "taken as free"
    layered = HFLayeredCausalLM(tiny_llama(5, vocab=16))
    part = AutoPolicy(cache_dir=tmp_path)
    part.bind(layered, make_drafter("early-exit", layered, exit_layer=1))
    assert part.costs.draft == part.costs.target[0] / 2 and part.costs.draft_source == "1 of 2 target layers"
    injected = AutoPolicy(costs=CHEAP_ROWS)
    injected.bind(target, NGramDrafter(16))
    assert injected.costs is CHEAP_ROWS and calls == [MAX_ROWS] * 3  # the layered backend was measured once


def test_a_seed_fixes_the_output_with_measured_costs(pair, tmp_path, monkeypatch):
    """The choices depend on the cached curve and the outcomes, never on a step's timing."""
    monkeypatch.setenv("SPECDEC_PLANNER_CACHE", str(tmp_path))
    target, draft = pair
    kw = dict(draft=draft, verify="block", policy="auto", temperature=1.0, max_new_tokens=30, seed=11)
    first = generate(target, PROMPT, **kw)  # measures
    second = generate(target, PROMPT, **kw)  # reads the cache
    assert first.stats.policy["costs"]["source"] == "measured" and second.stats.policy["costs"]["source"] == "cache"
    assert first.token_ids == second.token_ids and first.stats.policy["planned"] == second.stats.policy["planned"]


# --- exactness with k switching between steps -------------------------------------------------------


def test_greedy_output_is_ar_while_the_planner_switches_k(pair):
    target, draft = pair
    target_backend, draft_backend = HFCausalLM(target), HFCausalLM(draft)
    policy = AutoPolicy(k_max=4, costs=EDGE_ROWS)
    steps = list(speculative_steps(
        target_backend, ModelDrafter(draft_backend), make_verifier("block"), policy, PROMPT,
        sampling=GREEDY, max_new_tokens=60,
    ))
    assert [t for s in steps for t in s.tokens] == ar_tokens(target, PROMPT, 60)
    plain, drafting = planner_chose_plain(steps, 60)
    assert plain > 0 and drafting > 0  # both choices made in one run


@pytest.mark.parametrize("verify", ["token", "block"])
def test_sampled_output_follows_the_target_law_while_the_planner_switches_k(verify):
    vocab, horizon = 5, 3
    target = tiny_llama(0, vocab=vocab, sharpness=6.0)
    draft = noisy_copy(target, 0.5)
    sampling = SamplingConfig(temperature=1.0)
    law = exact_target_law(target, sampling, vocab)
    # Stated power, as in test_engine: a deviation of Cohen's w = 0.15 is caught with prob. >= 0.95.
    assert chi_square_power(law, SAMPLES, effect=0.15) >= 0.95
    target_backend, draft_backend = ContextLM(target), ContextLM(draft)  # answers from memory: helpers.ContextLM
    counts = np.zeros_like(law)
    plain = drafting = 0
    for seed in range(SAMPLES):
        target_backend.reset()
        draft_backend.reset()
        steps = list(speculative_steps(
            target_backend, ModelDrafter(draft_backend), make_verifier(verify), AutoPolicy(k_max=4, costs=EDGE_ROWS),
            PROMPT, sampling=sampling, max_new_tokens=horizon, generator=torch.Generator().manual_seed(seed),
        ))
        counts[tuple(t for s in steps for t in s.tokens)] += 1
        p, d = planner_chose_plain(steps, horizon)
        plain, drafting = plain + p, drafting + d
    # the planner really switched: plain steps after rejections, drafts otherwise
    assert plain > SAMPLES // 10 and drafting > SAMPLES // 2
    assert chi_square_p_value(counts, law) > SIGNIFICANCE


# --- the command line ---------------------------------------------------------------------------------


def test_generate_says_what_the_planner_chose_in_one_line(tiny, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_PLANNER_CACHE")  # the planner's folder under the cache directory
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    args = ["generate", "hello", "--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
            "--max-new-tokens", "12", "--policy", "auto", "--compare-ar"]
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    planner_lines = [line for line in err.splitlines() if line.startswith("planner: ")]
    assert len(planner_lines) == 1 and "(measured)" in planner_lines[0], err
    assert "identical output: yes" in err
    code, out, err = run_main(args + ["--json"], capsys)  # the second run reads the cache
    report = json.loads(out)
    assert report["stats"]["policy"]["costs"]["source"] == "cache" and report["ar"]["identical"] is True
    assert len(list((tmp_path / "planner").glob("*.json"))) == 2  # the target's and the draft's
