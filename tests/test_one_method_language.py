"""One way to say a decoding method: every front end resolves the default to the same config, and
every option of the text form round-trips through it."""

from __future__ import annotations

import argparse

import pytest

from specdec.cli import common
from specdec.cli import commands
from specdec.config import DecodeConfig, options
from specdec.server import requests as rq
from specdec.cli.serve import DEFAULT_METHOD, default_method

from helpers import REPO

DEFAULT = "spec:ngram+model:block:k=4:policy=auto"


def test_every_front_end_resolves_the_default_to_the_same_config():
    args = commands.build_parser().parse_args(["generate", "hello"])  # the command line with no options
    from_cli = common.decode_config(args)
    from_api = DecodeConfig().resolve(has_draft=True)
    from_text = DecodeConfig.parse("spec").resolve(has_draft=True)
    serve_args = argparse.Namespace(target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", method=None)
    from_server = default_method(serve_args)
    body = rq.CompletionBody(prompt="x", speculative={"method": "spec"})
    from_request = rq.choose_method(body, from_server, has_draft=True)
    assert from_cli == from_api == from_text == from_server == from_request
    assert str(from_cli) == DEFAULT and DEFAULT_METHOD == "spec"
    # without a draft model the default is the target alone, on every front end
    no_draft = commands.build_parser().parse_args(["generate", "hello", "--draft", "none"])
    assert common.decode_config(no_draft) == DecodeConfig().resolve(has_draft=False) == DecodeConfig.parse("ar")
    assert default_method(argparse.Namespace(**{**vars(serve_args), "draft": None})).is_ar  # --draft none


# A value for each option of the text form (one that differs from its default), and the method it needs.
SAMPLE = {
    ("method", "drafter"): ("ngram", "spec:ngram:block"),
    ("method", "verify"): ("token", "spec:token"),
    ("method", "k"): (7, "spec:block"),
    ("method", "policy"): ("theory", "spec:block"),
    ("policy", "k_max"): (9, "spec:block:policy=heuristic"),
    ("policy", "threshold"): (0.35, "spec:block:policy=confidence"),
    ("drafter", "max_ngram"): (2, "spec:ngram:block"),
    ("drafter", "min_ngram"): (2, "spec:ngram:block"),
    ("drafter", "exit_layer"): (20, "spec:early-exit:block"),
    ("drafter", "skip"): ((3, 5, 7), "spec:layer-skip:block"),
    ("drafter", "path"): ("some/heads", "spec:heads:block"),
    ("drafter", "datastore"): ("docs", "spec:retrieval:block"),
    ("drafter", "min_match"): (3, "spec:retrieval:block"),
    ("drafter", "window"): (6, "spec:lookahead:tree"),
    ("drafter", "ngram"): (3, "spec:lookahead:tree"),
    ("drafter", "candidates"): (2, "spec:lookahead:tree"),
    ("tree", "mode"): ("dynamic", "spec:tree"),
    ("tree", "choices"): (((0,), (1,), (0, 0)), "spec:tree"),
    ("tree", "threshold"): (0.6, "spec:tree"),
    ("tree", "depth"): (3, "spec:tree"),
    ("tree", "width"): (3, "spec:tree"),
    ("tree", "expand"): (2, "spec:tree:mode=dynamic"),
    ("tree", "budget"): (8, "spec:tree"),
}
FIELD = {"drafter": "drafter_options", "policy": "policy_options", "tree": "tree"}


@pytest.mark.parametrize("opt", [o for o in options() if o.in_text], ids=lambda o: f"{o.group}.{o.name}")
def test_every_option_of_the_text_form_round_trips(opt):
    value, base = SAMPLE[opt.group, opt.name]
    config = DecodeConfig.parse(base)
    if opt.group == "method":
        config = config.replace(**{opt.name: value})
    else:
        config = config.replace(**{FIELD[opt.group]: {**(getattr(config, FIELD[opt.group]) or {}), opt.name: value}})
    text = str(config)
    again = DecodeConfig.parse(text)
    assert again == config, text
    assert str(again) == text
    assert opt.value(opt.format(value)) == value  # the option's own reader and writer agree
    resolved = config.resolve(has_draft=True)  # the canonical name spells the drafter and, for chains, the policy
    assert DecodeConfig.parse(str(resolved)) == resolved and isinstance(resolved.drafter, str)


def test_the_sampling_options_are_not_part_of_a_method():
    config = DecodeConfig.parse("spec", temperature=0.5, seed=3)
    assert str(config) == "spec:block:k=4:policy=auto" and config.temperature == 0.5
    assert {o.name for o in options() if not o.in_text} == {
        "draft_weights", "temperature", "top_k", "top_p", "max_new_tokens", "seed", "sampler"}


def test_committed_results_read_back_as_the_methods_they_name():
    """Result files keep their meaning: each method record, whatever its name was when written,
    reads back (method_of_record) as a method with the same drafter, verifier and policy."""
    import json

    from specdec.bench.methods import method_of_record

    files = sorted(REPO.glob("benchmarks/*/*/results.json"))
    assert files
    for path in files:
        # a concurrency run's results.json holds runs of servers named by method text, no records
        for name, entry in json.loads(path.read_text()).get("methods", {}).items():
            record = entry["spec"]
            method = method_of_record(record)
            if record["kind"] == "spec":
                assert (method.drafter, method.verifier) == (record["drafter"], record["verifier"]), (path, name)
                assert method.is_tree or method.policy == record["policy"], (path, name)
