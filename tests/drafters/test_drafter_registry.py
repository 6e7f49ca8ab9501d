"""The drafter registry: a drafter declared and registered here, in the test module, and nowhere
else, is a drafter for the API, the command line, the server and the benchmark."""

from __future__ import annotations

import json
from typing import Any, Sequence

import pytest
import torch

import specdec
from specdec import build as builder
from specdec.backends.base import LAYERS
from specdec.backends.hf import HFCausalLM
from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.config import DecodeConfig
from specdec.drafters import register, unregister
from specdec.drafters import registry
from specdec.drafters.base import Draft, Drafter, KeepGoing, draft_chain
from specdec.drafters.registry import DrafterSpec
from specdec.sampling import SamplingConfig
from helpers import VOCAB, CharTokenizer, run_main, tiny_pair, tiny_tokenizer
from helpers import one_thread, tiny  # noqa: F401  (fixtures)
from tiny import tiny_llama

TOY = "toy-repeat"
METHOD = f"spec:{TOY}:block:k=3:policy=static"
PROMPT = [3, 5, 7, 5, 7, 5]


class RepeatDrafter(Drafter):
    """Proposes the context's last token k times, each a point mass (q one-hot): a deterministic
    drafter whose guess is sometimes right, so the verifier both keeps and rejects tokens."""

    name = TOY

    def __init__(self, vocab_size: int) -> None:
        self._vocab = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def propose(self, context: Sequence[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None,
                keep_going: KeepGoing | None = None, source: str | None = None) -> Draft:
        last = int(context[-1])
        return draft_chain(lambda _previous: last, k, sampling, generator, keep_going, self._vocab, len(context))

    def observe(self, context: Sequence[int]) -> None:
        """Nothing to forget: the drafter keeps no state."""


def _create(target: Any, draft: None, **options: Any) -> RepeatDrafter:
    return RepeatDrafter(target.vocab_size, **options)


SPEC = DrafterSpec(name=TOY, create=_create)


@pytest.fixture
def toy(request):
    """The toy drafter, registered for one test."""
    register(SPEC)
    request.addfinalizer(lambda: registry.find(TOY) is not None and unregister(TOY))
    return SPEC


# ------------------------------------------------------------------------------------------------
# The registry itself


def test_the_builtin_drafters_are_registered_in_order():
    assert registry.names() == ("model", "ngram", "ngram+model", "early-exit", "layer-skip", "heads", "eagle",
                                "retrieval", "retrieval+model", "lookahead", "cascade")
    assert [s.name for s in registry.specs() if s.uses_draft_model] == ["model", "ngram+model", "retrieval+model",
                                                                        "cascade"]
    assert [s.name for s in registry.specs() if s.trees != "no"] == ["model", "heads", "retrieval", "lookahead"]
    assert registry.spec("lookahead").trees == "only"
    assert registry.needs("early-exit") == {LAYERS} and registry.needs("ngram") == frozenset()
    assert registry.needs(None) == registry.needs("none") == registry.needs(object()) == frozenset()


def test_register_refuses_a_duplicate_and_unregister_forgets(toy):
    assert registry.names()[-1] == TOY and registry.spec(TOY) is toy
    with pytest.raises(ValueError, match="already registered"):
        register(DrafterSpec(name=TOY, create=_create))
    other = DrafterSpec(name=TOY, create=_create)
    assert register(other, replace=True) is other and registry.spec(TOY) is other
    register(SPEC, replace=True)
    unregister(TOY)
    with pytest.raises(ValueError, match=f"unknown drafter '{TOY}'; choose one of model, ngram, "):
        registry.spec(TOY)
    with pytest.raises(ValueError, match="unknown drafter"):
        DecodeConfig(drafter=TOY)
    with pytest.raises(ValueError, match="nor is it a drafter"):
        DecodeConfig.parse(METHOD)


def test_a_spec_is_checked_when_declared():
    with pytest.raises(ValueError, match="without ':'"):
        DrafterSpec(name="a:b", create=_create)
    with pytest.raises(ValueError, match="plain decoding"):
        DrafterSpec(name="none", create=_create)
    with pytest.raises(ValueError, match="trees must be one of"):
        DrafterSpec(name="x", create=_create, trees="yes")
    with pytest.raises(ValueError, match="tree function exactly when"):
        DrafterSpec(name="x", create=_create, trees="also")
    with pytest.raises(TypeError, match="DrafterSpec"):
        register("x")  # type: ignore[arg-type]


def test_the_config_reads_the_registry_when_it_parses(toy):
    config = DecodeConfig.parse(METHOD)
    assert config.drafter == TOY and str(config) == METHOD and not config.uses_draft_model
    assert config.resolve(False) == config  # needs no draft model
    with pytest.raises(ValueError, match=f"drafts its tree with the draft model or the heads, not .*{TOY}"):
        DecodeConfig.parse(f"spec:{TOY}:tree")
    with pytest.raises(ValueError, match="is an option of"):
        DecodeConfig(drafter=TOY, drafter_options={"max_ngram": 2})
    with pytest.raises(ValueError, match="the toy-repeat drafter uses no draft model"):
        builder.make_drafter(TOY, HFCausalLM(tiny_llama(0, vocab=VOCAB)), HFCausalLM(tiny_llama(1, vocab=VOCAB)))
    with pytest.raises(ValueError, match="bad option for the toy-repeat drafter"):
        builder.make_drafter(TOY, HFCausalLM(tiny_llama(0, vocab=VOCAB)), depth=2)


def test_what_a_drafter_needs_chooses_and_checks_the_target_backend():
    spec = register(DrafterSpec(name="toy-layers", create=_create, needs=frozenset({LAYERS})))
    try:
        model = tiny_llama(0, vocab=VOCAB)
        assert isinstance(builder.target_backend("toy-layers", model), HFLayeredCausalLM)
        assert not isinstance(builder.target_backend(TOY, model), HFLayeredCausalLM)
        with pytest.raises(ValueError, match="the toy-layers drafter needs a target backend that can run a subset"):
            builder.target_backend("toy-layers", HFCausalLM(model))
        from specdec.bench.methods import parse_method

        with pytest.raises(ValueError, match="runs on backend=torch only"):
            parse_method("spec:toy-layers:block:backend=gguf")
    finally:
        unregister(spec.name)


# ------------------------------------------------------------------------------------------------
# The toy drafter through every front end


def test_the_api_runs_a_registered_drafter_and_keeps_the_output(toy):
    target = tiny_llama(0, vocab=VOCAB, sharpness=8.0)
    limits = dict(max_new_tokens=24, eos_token_ids=[])  # no end token: every run makes 24 tokens
    plain = specdec.generate(target, PROMPT, **limits)
    got = specdec.generate(target, PROMPT, config=DecodeConfig.parse(METHOD), **limits)
    assert got.token_ids == plain.token_ids and len(got.token_ids) == 24
    assert TOY in got.method and got.exact
    assert got.stats.drafted_tokens > 0
    by_name = specdec.generate(target, PROMPT, drafter=TOY, k=3, policy="static", **limits)
    assert by_name.token_ids == plain.token_ids


def test_the_gumbel_sampler_keeps_plain_decodings_sampled_output(toy):
    target = tiny_llama(0, vocab=VOCAB)
    options = dict(sampler="gumbel", temperature=1.0, seed=7, max_new_tokens=20, eos_token_ids=[])
    plain = specdec.generate(target, PROMPT, **options)
    got = specdec.generate(target, PROMPT, drafter=TOY, k=3, policy="static", **options)
    assert got.token_ids == plain.token_ids and "coupled" in got.method


def test_the_command_line_runs_a_registered_drafter(toy, tiny, capsys):
    args = ["generate", "hello", "--target", tiny["target"], "--draft", "none", "--dtype", "float32",
            "--drafter", TOY, "--policy", "static", "-k", "3", "--max-new-tokens", "12", "--json", "--compare-ar"]
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    report = json.loads(out)
    assert TOY in report["method"]
    assert len(report["token_ids"]) == 12 and report["ar"]["token_ids"] == report["token_ids"]
    assert report["ar"]["identical"] is True


def test_the_server_runs_a_registered_drafter(toy):
    from fastapi.testclient import TestClient

    from specdec.server.app import ServerOptions, create_app
    from specdec.models import Pair
    from specdec.server.requests import method_config

    target, _ = tiny_pair()
    app = create_app(Pair(target, tiny_tokenizer(), target_name="tiny"), ServerOptions(method_config("ar", False)))
    body = {"prompt": "abcabcabc", "max_tokens": 12, "temperature": 0}
    with TestClient(app, base_url="http://localhost") as client:
        plain = client.post("/v1/completions", json=body)
        got = client.post("/v1/completions", json={**body, "speculative": {"method": METHOD}})
    assert plain.status_code == 200 and got.status_code == 200, got.text
    assert got.json()["speculative"]["method"] == METHOD
    assert got.json()["speculative"]["drafted_tokens"] > 0
    assert got.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert got.json()["usage"]["completion_tokens"] == plain.json()["usage"]["completion_tokens"] == 12


def test_the_bench_parses_and_runs_a_registered_drafter(toy):
    from specdec.bench import report
    from specdec.bench.methods import parse_method, parse_methods
    from specdec.bench.runner import BenchSettings, run_bench
    from specdec.models import Pair
    from specdec.prompts import Prompt

    method = parse_method(METHOD)
    assert method.kind == "spec" and method.drafter == TOY and not method.needs_draft_model
    assert method.name == METHOD
    pair = Pair(tiny_llama(0, vocab=VOCAB, sharpness=8.0), CharTokenizer(), None, "tiny")
    prompts = [Prompt("mine", "a", text="abcabcabcab"), Prompt("mine", "b", text="hello hello")]
    settings = BenchSettings(max_new_tokens=10, temperature=0.0, warmup_tokens=0)
    run = run_bench(pair, parse_methods(METHOD), prompts, settings, progress=False)
    assert not run.failed, run.failed
    assert [m.name for m in run.methods] == ["ar", METHOD]
    summary = report.summarize(run)
    assert summary[METHOD]["identical_to_ar_fraction"] == 1.0
