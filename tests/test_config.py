"""One configuration object (DecodeConfig) for the API, the command line and the benchmark."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import specdec
from specdec import DecodeConfig, generate, stream
from specdec.backends.hf import HFCausalLM
from specdec.build import target_backend
from specdec.drafters.heads import HeadsDrafter
from specdec.drafters.tree import DEFAULT_CHOICES, TreeDrafter
from specdec.sampling import SamplingConfig
from tiny import noisy_copy, tiny_llama

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, vocab=16, sharpness=10.0)
    return target, noisy_copy(target, 0.3)


@pytest.mark.parametrize(
    "options",
    [
        dict(verify="block", k=3),
        dict(verify="token", k=2, temperature=1.0, top_k=5, seed=3),
        dict(verify="block", policy="confidence", temperature=0.8, top_p=0.9, seed=1),
        dict(verify="tree", tree={"mode": "dynamic", "budget": 8}, temperature=1.0, seed=2),
        dict(verify="tree"),
    ],
)
def test_a_config_gives_what_the_same_keywords_give(pair, options):
    target, draft = pair
    by_keywords = generate(target, PROMPT, draft=draft, max_new_tokens=16, **options)
    by_config = generate(target, PROMPT, draft=draft, config=DecodeConfig(max_new_tokens=16, **options))
    assert by_config.token_ids == by_keywords.token_ids and by_config.method == by_keywords.method
    streamed = [t for e in stream(target, PROMPT, draft=draft, config=DecodeConfig(max_new_tokens=16, **options))
                for t in e.token_ids]
    assert streamed == by_keywords.token_ids


def test_overrides_apply_on_top_of_a_config(pair):
    target, draft = pair
    config = DecodeConfig(verify="token", k=2, temperature=1.0, seed=5, max_new_tokens=10)
    over = generate(target, PROMPT, draft=draft, config=config, seed=6, k=3)
    assert over.token_ids == generate(target, PROMPT, draft=draft, config=dataclasses.replace(config, seed=6, k=3)).token_ids
    assert over.method == "spec:ngram+model:token:k=3:policy=auto"
    assert config.seed == 5  # the caller's config is not changed


def test_a_config_checks_itself_and_names_the_field():
    with pytest.raises(ValueError, match="k .*positive"):
        DecodeConfig(k=0)
    with pytest.raises(TypeError, match="temperature"):
        DecodeConfig(temperature=None)
    with pytest.raises(ValueError, match="max_new_tokens"):
        DecodeConfig(max_new_tokens=-1)
    with pytest.raises(ValueError, match="exit_layer is an option of drafter='early-exit'"):
        DecodeConfig(drafter_options={"exit_layer": 2})
    with pytest.raises(TypeError, match="unknown decoding option 'sed'"):
        DecodeConfig().replace(sed=1)
    with pytest.raises(TypeError, match="config must be a specdec.DecodeConfig"):
        generate(tiny_llama(0), PROMPT, config={"k": 2})


def test_stop_and_eos_are_normalised():
    config = DecodeConfig(stop="END", eos_token_ids=[2, 3])
    assert config.stop == ("END",) and config.eos_token_ids == (2, 3)
    assert DecodeConfig(stop=["a", "b"]).stop == ("a", "b")
    assert DecodeConfig().sampling == SamplingConfig()


def test_the_planner_is_the_default_policy(pair):
    assert DecodeConfig().policy == "auto"
    target, draft = pair
    ar = generate(target, PROMPT, max_new_tokens=12)
    assert ar.method == "ar" and ar.stats.policy == {}  # no draft: autoregressive, no policy at work
    spec = generate(target, PROMPT, draft=draft, max_new_tokens=12)
    assert spec.stats.policy["name"] == "auto" and spec.method == "spec:ngram+model:block:k=4:policy=auto"
    assert spec.token_ids == ar.token_ids


def test_the_package_exports_the_config():
    assert specdec.DecodeConfig is DecodeConfig and "DecodeConfig" in specdec.__all__


def test_the_command_line_builds_the_same_config():
    from specdec.cli.commands import build_parser
    from specdec.cli.common import decode_config

    args = build_parser().parse_args([
        "generate", "hi", "--verify", "token", "-k", "3", "--temperature", "0.7", "--top-k", "5",
        "--seed", "4", "--stop", "END", "--max-new-tokens", "9", "--draft-weights", "bf16",
    ])
    assert decode_config(args) == DecodeConfig(
        verify="token", k=3, temperature=0.7, top_k=5, seed=4, stop=["END"], max_new_tokens=9, draft_weights="bf16",
        drafter="ngram+model", drafter_options={},  # the command line's default drafter
    )
    args = build_parser().parse_args(["generate", "hi", "--drafter", "early-exit", "--exit-layer", "20"])
    config = decode_config(args)
    assert config.drafter == "early-exit" and config.drafter_options == {"exit_layer": 20}


# -- tree modes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "explicit, implicit",
    [
        (dict(mode="confident"), dict(threshold=0.8)),
        (dict(mode="confident", threshold=0.6, width=3), dict(threshold=0.6, width=3)),
        (dict(mode="dynamic", budget=8), dict(budget=8)),
        (dict(mode="static"), dict(choices=DEFAULT_CHOICES)),
    ],
)
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)])
def test_a_named_tree_mode_builds_the_tree_its_arguments_imply(pair, explicit, implicit, sampling):
    _, draft = pair
    a, b = TreeDrafter(HFCausalLM(draft), **explicit), TreeDrafter(HFCausalLM(draft), **implicit)
    assert a.mode == b.mode == explicit["mode"]
    for context in ([1, 2, 3], [4, 5, 6, 7]):
        ta = a.propose_tree(context, sampling, 6, torch.Generator().manual_seed(0))
        tb = b.propose_tree(context, sampling, 6, torch.Generator().manual_seed(0))
        assert ta.tokens == tb.tokens and ta.parents == tb.parents


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(mode="bushy"), "unknown tree mode"),
        (dict(mode="dynamic", threshold=0.5), "threshold shapes a confident tree"),
        (dict(mode="confident", choices=[(0,)]), "choices fix a static tree"),
        (dict(threshold=0.5, choices=[(0,)]), "fixed shape"),
    ],
)
def test_inconsistent_tree_modes_are_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        TreeDrafter(None, **options)


def test_the_heads_drafter_takes_other_choices_without_rebuilding():
    from helpers import random_heads

    target = tiny_llama(6, vocab=24, layers=3, sharpness=3.0)
    backend = target_backend("heads", target)
    drafter = HeadsDrafter(backend, random_heads(target, 3, [0, 2, 3, 5, 7, 11, 13, 17, 19, 23]))
    choices = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]
    other = drafter.with_choices(choices)
    assert other.heads is drafter.heads and other.choices == choices and drafter.choices != choices
    rebuilt = HeadsDrafter(backend, drafter.heads, choices)
    context = [3, 7, 1, 3, 7]
    ta, tb = other.propose_tree(context, SamplingConfig(), 3), rebuilt.propose_tree(context, SamplingConfig(), 3)
    assert ta.tokens == tb.tokens and ta.parents == tb.parents and len(ta) == len(choices)


@pytest.mark.parametrize("text", ["spec:k=99999999999999999999999", "spec:block:policy=heuristic:k_max=2147483648",
                                  "spec:model:tree:width=99999999999999999999999", "spec:model:tree:budget=1e400"])
def test_a_count_too_large_is_a_value_error_naming_its_option(text):
    """Counts are capped at 2**31 - 1: a larger one is a ValueError saying what the option takes
    (not an OverflowError from deep inside, which the front ends do not catch)."""
    option = text.rsplit(":", 1)[1].split("=")[0]
    with pytest.raises(ValueError, match=f"{option}= takes a positive integer"):
        DecodeConfig.parse(text)
    with pytest.raises(ValueError, match="k .tokens drafted per step. must be a positive integer up to 2147483647"):
        DecodeConfig(k=2**31)


@pytest.mark.parametrize("value", ["yes", "no", 1, None])
def test_prompt_cache_takes_true_or_false_only(value):
    with pytest.raises(TypeError, match="prompt_cache must be True or False"):
        DecodeConfig(prompt_cache=value)
