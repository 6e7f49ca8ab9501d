"""Lookahead decoding (:mod:`specdec.drafters.lookahead`): the pool collects the Jacobi iteration's
diagonal n-grams, its candidates get accepted on repetitive text, and decoding keeps greedy output
and a Gumbel seed's output exactly, on a tiny torch model and the SmolLM2 GGUF."""

from __future__ import annotations

import pytest
import torch

from specdec import generate, packs
from specdec.backends import llamacpp
from specdec.build import as_backend
from specdec.config import ConfigError, DecodeConfig
from specdec.drafters.lookahead import LookaheadDrafter
from specdec.engine import tree_steps
from specdec.sampling import SamplingConfig

from tiny import tiny_llama

PROMPT = [1, 2, 3, 4, 5]
FLAT = [1.0] + [1.2] * 15  # a row-cost curve where every extra row is cheap
STEEP = [float(n) for n in range(1, 17)]  # one where every row costs a whole step


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(0, vocab=128, sharpness=2.0)


def _logits_for(tokens, vocab=16):
    """[len, V] logits whose argmax is each of ``tokens``."""
    out = torch.zeros(len(tokens), vocab)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return out


def test_the_pool_holds_the_diagonal_n_grams_of_successive_iterations():
    """With n = 3 and a step that appends one token: the n-gram (guess j of iteration 1, the
    prediction after it, the prediction after that in iteration 2) is pooled under its first token."""
    drafter = LookaheadDrafter(as_backend(tiny_llama(0)), window=3, ngram=3, candidates=4)
    sampling = SamplingConfig()
    context = [9, 9, 9]
    tree = drafter.propose_tree(context, sampling, 8)
    guess1 = tree.tokens[: tree.window]
    out1 = [10, 11, 12, 13]  # the predictions at the root and after each window node
    tree.scored(context, _logits_for(out1 + [0] * (len(tree) - tree.window)))
    drafter.observe(context + [10])  # one token appended
    assert drafter.pool == {}  # one iteration makes 2-grams only
    tree = drafter.propose_tree(context + [10], sampling, 8)
    guess2 = tree.tokens[: tree.window]
    assert guess2 == [11, 12, 13]  # the iterates, shifted by the appended token
    out2 = [4, 5, 6, 7]
    tree.scored(context + [10], _logits_for(out2 + [0] * (len(tree) - tree.window)))
    drafter.observe(context + [10, 4])
    # guess2[j] = out1[j + 1] followed guess1[j]; out2[j + 1] followed guess2[j]
    expected = {(guess1[j], out1[j + 1], out2[j + 1]) for j in range(3)}
    pooled = {(first, *rest) for first, entries in drafter.pool.items() for rest in entries}
    assert pooled == expected


def test_greedy_lookahead_decoding_is_plain_greedy_decoding(tiny):
    backend = as_backend(tiny)
    for prompt in (PROMPT, [60, 61, 62, 63], [7]):
        ar = generate(tiny, prompt, max_new_tokens=60, eos_token_ids=[])
        for options in (dict(window=4, ngram=3, candidates=3), dict(window=1, ngram=2, candidates=1),
                        dict(window=7, ngram=5, candidates=2)):
            spec = generate(tiny, prompt, drafter="lookahead", verify="tree", drafter_options=options,
                            max_new_tokens=60, eos_token_ids=[])
            assert spec.token_ids == ar.token_ids, (prompt, options)
        chosen = LookaheadDrafter(backend, costs=FLAT)
        spec = generate(backend, prompt, drafter=chosen, verify="tree", max_new_tokens=60, eos_token_ids=[])
        assert spec.token_ids == ar.token_ids
        # cheap rows: the largest tree, 15 nodes besides the root, half of them (rounded up) the window
        assert (chosen.window, chosen.candidates, chosen.ngram) == (8, 2, 4)


def test_pooled_n_grams_are_accepted_on_repetitive_text(tiny):
    """With a one-token window a step keeps at most one window token, so every step that keeps two
    or more kept a pooled n-gram's."""
    backend = as_backend(tiny)
    drafter = LookaheadDrafter(backend, window=1, ngram=4, candidates=3)
    steps = list(tree_steps(backend, drafter, PROMPT, sampling=SamplingConfig(), max_new_tokens=80))
    assert drafter.collected > 0
    assert sum(step.accepted >= 2 for step in steps) >= 5
    ar = generate(tiny, PROMPT, max_new_tokens=80, eos_token_ids=[])
    assert [t for step in steps for t in step.tokens] == ar.token_ids


@pytest.mark.parametrize("options", [dict(window=4, ngram=3, candidates=3), dict(window=2, ngram=4, candidates=2)])
def test_a_seed_gives_plain_decodings_text_under_the_gumbel_sampler(tiny, options):
    accepted = 0
    for seed in range(4):
        kw = dict(temperature=1.0, sampler="gumbel", seed=seed, max_new_tokens=40, eos_token_ids=[])
        ar = generate(tiny, PROMPT, **kw)
        spec = generate(tiny, PROMPT, drafter="lookahead", verify="tree", drafter_options=options, **kw)
        assert spec.token_ids == ar.token_ids, seed
        accepted += spec.stats.accepted_tokens
    assert accepted > 0


def test_it_stops_drafting_where_rows_cost_as_much_as_steps(tiny):
    backend = as_backend(tiny)
    drafter = LookaheadDrafter(backend, costs=STEEP)
    ar = generate(tiny, [60, 61, 62], max_new_tokens=60, eos_token_ids=[])
    spec = generate(backend, [60, 61, 62], drafter=drafter, verify="tree", max_new_tokens=60, eos_token_ids=[])
    assert spec.token_ids == ar.token_ids
    assert drafter.plain_steps > 0


def test_lookahead_in_the_configuration_language():
    config = DecodeConfig.parse("spec:lookahead:tree:window=6:ngram=3:candidates=2")
    assert dict(config.drafter_options) == {"window": 6, "ngram": 3, "candidates": 2}
    assert DecodeConfig.parse(str(config)) == config
    with pytest.raises(ConfigError, match="tree"):
        DecodeConfig.parse("spec:lookahead:window=6")
    with pytest.raises(ValueError, match="ngram"):
        DecodeConfig.parse("spec:lookahead:tree:ngram=1")
    with pytest.raises(ConfigError, match="budget"):
        DecodeConfig.parse("spec:lookahead:tree:budget=8")


@pytest.mark.parametrize("text, fixed", [
    ("spec:lookahead", "spec:lookahead:tree"),
    ("spec:lookahead:block:window=6", "spec:lookahead:tree:window=6"),
    ("spec:drafter=lookahead:ngram=3", "spec:lookahead:tree:ngram=3"),
])
def test_lookahead_without_tree_is_refused_in_one_line_that_spells_the_fix(text, fixed):
    """Lookahead decoding drafts a tree: a method string without ``:tree`` is refused, and the
    error names the method to write, which parses; the server (a 400) and the bench say the same."""
    from specdec.bench.methods import parse_method
    from specdec.server import requests as rq

    message = f"lookahead decoding drafts a token tree each step, verified in one pass; write {fixed}"
    with pytest.raises(ValueError) as err:
        DecodeConfig.parse(text)
    assert str(err.value) == message
    assert DecodeConfig.parse(fixed).drafter == "lookahead"
    body = rq.CompletionBody(prompt="x", speculative={"method": text})
    with pytest.raises(rq.APIError) as refused:
        rq.choose_method(body, DecodeConfig.parse("spec"), has_draft=True)
    assert refused.value.status == 400 and refused.value.param == "speculative.method"
    assert refused.value.message == f"speculative.method: {message}"
    with pytest.raises(ValueError) as err:
        parse_method(text)
    assert str(err.value) == f"method {text!r}: {message}"


def test_the_command_lines_refuse_lookahead_without_tree_before_loading_a_model(capsys):
    """``specdec generate`` takes the method as flags (the hint: add ``--verify tree``);
    ``specdec serve --method`` takes the text form (the hint: the method to write)."""
    import argparse

    from specdec import cli
    from specdec.cli.serve import default_method
    from specdec.cli.common import CLIError

    assert cli.main(["generate", "x", "--drafter", "lookahead"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specdec: error: --drafter lookahead drafts a token tree each step, verified in one pass",
                   "hint: add --verify tree"]
    args = argparse.Namespace(target="smollm2-135m", draft=None, backend="llamacpp", method="spec:lookahead")
    with pytest.raises(CLIError) as refused:
        default_method(args)
    assert refused.value.message == ("--method: lookahead decoding drafts a token tree each step, verified in one "
                                     "pass; write spec:lookahead:tree")


def test_greedy_lookahead_decoding_on_the_smollm2_gguf_is_its_greedy_decoding():
    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    missing = packs.missing_parts(packs.PACKS["smollm2-135m"])
    if missing:
        pytest.skip(f"pack smollm2-135m is not installed: {packs.PACKS['smollm2-135m'].install_command(missing)}")
    model = llamacpp.load_gguf(packs.gguf_file("smollm2-135m", progress=False), n_threads=1, n_ctx=512,
                               prefill_layout="repacked")
    prompt = [504, 1070, 28, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30, 3158, 314, 260, 1345, 30]
    ar = generate(model, prompt, max_new_tokens=24, eos_token_ids=[])
    spec = generate(model, prompt, drafter="lookahead", verify="tree",
                    drafter_options=dict(window=4, ngram=3, candidates=2), max_new_tokens=24, eos_token_ids=[])
    assert spec.token_ids == ar.token_ids
    assert spec.stats.accepted_tokens > 0
