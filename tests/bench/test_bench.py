"""The benchmark: method strings, prompt sets, interleaving, and a tiny end-to-end run."""

from __future__ import annotations

import argparse
import copy
import json

import pytest
import torch

from specdec.bench import report
from specdec.cli.bench import add_bench_parser, main
from specdec.bench.methods import MethodSpec, parse_method, parse_methods
from specdec import build as builder
from specdec.config import DecodeConfig
from specdec.prompts import (
    EDIT_REQUEST,
    Prompt,
    load_edit,
    load_humaneval,
    load_jsonl,
    load_mtbench,
    load_prompts,
    parse_prompt_sets,
    pick,
    read_json_records,
    read_sharegpt,
    sharegpt_prompts,
)
from specdec.bench.peers import _steps_from_forwards
from specdec.bench.runner import BenchSettings, run_bench, schedule
from specdec.models import Pair
from helpers import VOCAB, BatchRounding, CharTokenizer
from helpers import one_thread  # noqa: F401  (one_thread: an autouse fixture)
from tiny import tiny_llama


class ChatTokenizer(CharTokenizer):
    chat_template = "yes"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


# ------------------------------------------------------------------------------------------
# Method strings


def spec(text: str, backend: str = "torch") -> MethodSpec:
    """A project method as the bench holds it: the config of ``text``, its drafter named."""
    return MethodSpec("spec", DecodeConfig.parse(text).resolve(True), backend=backend)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("ar", MethodSpec("ar")),
        ("spec", spec("spec:ngram+model:block:k=4:policy=auto")),
        ("spec:block:k=4", spec("spec:ngram+model:block:k=4:policy=auto")),
        ("spec:model:block:k=4:policy=static", spec("spec:model:block:k=4:policy=static")),
        ("spec:model:greedy:k=2", spec("spec:model:greedy:k=2:policy=auto")),
        ("spec:block:drafter=model:k=3:policy=static", spec("spec:model:block:k=3:policy=static")),
        ("spec:ngram:block:k=8:max_ngram=2", spec("spec:ngram:block:k=8:policy=auto:max_ngram=2")),
        ("spec:layer-skip:token:skip=3/5", spec("spec:layer-skip:token:k=4:policy=auto:skip=3/5")),
        ("spec:model:block:policy=confidence:threshold=0.3:k_max=6",
         spec("spec:model:block:k=4:policy=confidence:k_max=6:threshold=0.3")),
        ("spec:heads:tree", spec("spec:heads:tree")),
        ("spec:heads:block:k=2:path=some/dir", spec("spec:heads:block:k=2:policy=auto:path=some/dir")),
        ("spec:tree:budget=8:depth=4", spec("spec:model:tree:budget=8:depth=4")),
        ("spec:tree:choices=0|1|0.0", spec("spec:model:tree:choices=0|1|0.0")),
        ("spec:tree:choices=0", spec("spec:model:tree:choices=0")),
        ("hf-assisted", MethodSpec("hf-assisted")),
        ("hf-assisted:k=5", MethodSpec("hf-assisted", k=5)),
        ("hf-prompt-lookup", MethodSpec("hf-prompt-lookup")),
        (" hf-ar ", MethodSpec("hf-ar")),
        ("ar:backend=llamacpp", MethodSpec("ar", backend="llamacpp")),
        ("ar:backend=torch", MethodSpec("ar")),
        ("spec:block:k=4:backend=llamacpp", spec("spec:ngram+model:block:k=4:policy=auto", "llamacpp")),
        ("spec:ngram:block:backend=llamacpp:k=3", spec("spec:ngram:block:k=3:policy=auto", "llamacpp")),
        ("llamacpp-ar", MethodSpec("llamacpp-ar")),
    ],
)
def test_parse_method(text, expected):
    method = parse_method(text)
    assert method == expected
    assert parse_method(method.name) == method


def test_canonical_names():
    assert parse_method("spec").name == "spec:ngram+model:block:k=4:policy=auto"  # drafter and policy spelled out
    assert parse_method("spec:block:drafter=model:k=4").name == "spec:model:block:k=4:policy=auto"
    assert parse_method("hf-prompt-lookup:k=7").name == "hf-prompt-lookup:k=7"
    assert parse_method("spec:model:block:k=4").peer == "hf-assisted"
    assert parse_method("spec:ngram:block").peer == "hf-prompt-lookup"
    assert parse_method("spec:early-exit:block").peer is None
    assert parse_method("spec:model:block:policy=confidence:threshold=0.3").config.policy_options == {"threshold": 0.3}
    assert parse_method("spec:early-exit:block:exit_layer=2").config.drafter_options == {"exit_layer": 2}
    assert parse_method("spec:token").needs_draft_model and parse_method("hf-assisted").needs_draft_model
    assert not parse_method("hf-prompt-lookup").needs_draft_model
    assert parse_method("spec:tree:choices=0|1|0.0").config.tree == {"choices": ((0,), (1,), (0, 0))}
    assert parse_method("spec:tree").config.tree is None  # the API's default tree, as generate() has it
    assert parse_method("spec:heads:tree:choices=default").config.tree["choices"][:2] == ((0,), (1,))


@pytest.mark.parametrize(
    "text, message",
    [
        ("beam", "unknown method"),
        ("ar:k=2", "ar takes no options"),
        ("ar:backend=gpu", "unknown backend"),
        ("llamacpp-ar:k=2", "unknown key"),
        ("spec:early-exit:block:backend=llamacpp", "runs on backend=torch only"),
        ("spec:nope:k=4", "unknown verifier"),
        ("spec:model:ngram:block", "the drafter is given twice"),
        ("spec:block:k=0", "positive integer"),
        ("spec:block:k=two", "positive integer"),
        ("spec:block:k=2:k=3", "given twice"),
        ("spec:model:block:drafter=model", "given twice"),
        ("spec:block:drafter=oracle", "unknown drafter"),
        ("spec:block:policy=psychic", "policy= takes one of"),
        ("spec:block:policy=confidence:threshold=2", "threshold"),
        ("spec:block:threshold=0.5", "threshold= is an option of policy=confidence"),
        ("spec:block:budget=4", "budget= shapes a token tree"),
        ("hf-assisted:policy=static", "unknown key"),
        ("hf-ar:k=2", "unknown key"),
        ("hf-assisted:block", "unexpected field"),
        ("spec:eagle:tree", "drafts its tree with the draft model or the heads"),
        ("spec:heads:tree:budget=4", "a heads tree is static"),
        ("spec:tree:choices=0|1.0", "prefixes are listed"),
        ("spec:tree:choices=0|x", "rank paths like 0|1|0.0"),
        ("spec:tree:k=3", "k= is an option of block"),
    ],
)
def test_parse_method_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_method(text)


def test_parse_methods_puts_ar_first_and_drops_duplicates():
    specs = parse_methods("spec:model:block:k=4, hf-assisted,spec:block:drafter=model:k=4,ar")
    assert [s.name for s in specs] == ["ar", "spec:model:block:k=4:policy=auto", "hf-assisted"]


def test_greedy_verifier_does_not_run_with_sampling():
    assert parse_method("spec:model:greedy:k=2:policy=static").runs_at(1.0)
    assert parse_method("spec:model:greedy:k=2:policy=static").runs_at(0.0) is None
    assert parse_method("spec:model:block:k=2:policy=static").runs_at(1.0) is None


# ------------------------------------------------------------------------------------------
# Prompt sets


def test_humaneval_and_mtbench_sizes():
    humaneval, mtbench = load_humaneval(), load_mtbench()
    assert len(humaneval) == 164 and len({p.id for p in humaneval}) == 164
    assert humaneval[0].id == "HumanEval/0" and "def " in humaneval[0].text and not humaneval[0].chat
    assert len(mtbench) == 80
    assert all(p.chat and p.messages[0]["role"] == "user" and p.messages[0]["content"] for p in mtbench)


def test_edit_prompts_hold_a_canonical_solution_in_a_chat_request():
    """``edit``: HumanEval's prompt + canonical solution, verbatim inside the request, in the chat template."""
    import gzip

    from specdec.prompts import HUMANEVAL_FILE, _package_file

    with gzip.open(_package_file(*HUMANEVAL_FILE), "rt") as f:
        rows = {r["task_id"]: r for r in map(json.loads, f)}
    edit = load_edit()
    assert len(edit) == 164 and len({p.id for p in edit}) == 164
    for prompt in edit:
        row = rows[prompt.id.removeprefix("edit/")]
        (message,) = prompt.messages
        assert prompt.set == "edit" and prompt.chat and message["role"] == "user"
        assert message["content"].startswith(EDIT_REQUEST + "\n```python\n")
        assert message["content"].endswith("\n```")
        assert (row["prompt"] + row["canonical_solution"]).strip() in message["content"]
    tok = ChatTokenizer()
    assert edit[0].token_ids(tok) == tok(f"<user>{edit[0].messages[0]['content']}<assistant>")["input_ids"]
    chosen = load_prompts("edit:4", seed=5)
    assert chosen == load_prompts("edit:4", seed=5) != load_prompts("edit:4", seed=6)
    assert len(chosen) == 4 and all(p in edit for p in chosen)


@pytest.fixture(scope="module")
def sharegpt_records():
    return read_sharegpt()


@pytest.fixture(scope="module")
def sharegpt(sharegpt_records):
    return sharegpt_prompts(sharegpt_records)


def test_sharegpt_is_recovered_record_by_record(sharegpt_records, sharegpt):
    assert len(sharegpt_records) == 17_671  # the whole records before the file's cut
    assert all("conversations" in r for r in sharegpt_records)
    # Kept: a first human turn of 16..2000 characters.
    assert 5_000 < len(sharegpt) < len(sharegpt_records)
    assert all(p.chat and 16 <= len(p.messages[0]["content"]) <= 2000 for p in sharegpt)


def test_read_json_records_stops_at_a_cut_off_record():
    whole = json.dumps([{"a": 1}, {"b": [1, 2]}, {"c": "x"}], indent=2)
    assert read_json_records(whole) == [{"a": 1}, {"b": [1, 2]}, {"c": "x"}]
    assert read_json_records(whole[: whole.index('"x"') + 2]) == [{"a": 1}, {"b": [1, 2]}]
    assert read_json_records("[]") == []


def test_the_same_seed_picks_the_same_prompts(sharegpt):
    first = load_prompts("humaneval:8,mtbench:8", seed=3)
    assert first == load_prompts("humaneval:8,mtbench:8", seed=3)
    assert [p.set for p in first] == ["humaneval"] * 8 + ["mtbench"] * 8
    assert first != load_prompts("humaneval:8,mtbench:8", seed=4)
    assert pick(sharegpt, 5, 0, "sharegpt") == pick(sharegpt, 5, 0, "sharegpt")
    assert len(load_prompts("mtbench")) == 80


def test_parse_prompt_sets():
    assert parse_prompt_sets("humaneval:8, mtbench") == [("humaneval", 8), ("mtbench", None)]
    assert parse_prompt_sets("/tmp/a:b.jsonl:3") == [("/tmp/a:b.jsonl", 3)]
    for bad in ("", "humaneval:0"):
        with pytest.raises(ValueError):
            parse_prompt_sets(bad)
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompts("wikipedia:3")


def test_user_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"prompt": "def f(x):", "id": "p1"}\n\n'
        '{"prompt": "hello", "chat": true}\n'
        '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}\n'
    )
    prompts = load_jsonl(path)
    assert [p.id for p in prompts] == ["p1", "mine/3", "mine/4"]
    assert [p.chat for p in prompts] == [False, True, True]
    tok = ChatTokenizer()
    assert prompts[0].token_ids(tok) == tok("def f(x):")["input_ids"]
    assert prompts[1].token_ids(tok) == tok("<user>hello<assistant>")["input_ids"]
    with pytest.warns(UserWarning, match="no chat template"):
        assert prompts[1].token_ids(CharTokenizer()) == CharTokenizer()("hello")["input_ids"]
    assert len(load_prompts(f"{path}:2")) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 1 has neither"):
        load_jsonl(bad)


# ------------------------------------------------------------------------------------------
# Order and per-step accounting


def test_methods_are_interleaved_prompt_by_prompt_in_turning_order():
    a, b, c = (MethodSpec(x) for x in ("ar", "hf-ar", "hf-assisted"))
    order = [(r, p, m.kind) for r, p, m in schedule([a, b, c], n_prompts=2, repeats=2)]
    assert order == [
        (0, 0, "ar"), (0, 0, "hf-ar"), (0, 0, "hf-assisted"),
        (0, 1, "hf-ar"), (0, 1, "hf-assisted"), (0, 1, "ar"),
        (1, 0, "hf-ar"), (1, 0, "hf-assisted"), (1, 0, "ar"),
        (1, 1, "hf-assisted"), (1, 1, "ar"), (1, 1, "hf-ar"),
    ]
    for prompt in range(4):  # over three repeats of a prompt, each method runs once in each place
        runs = [m.kind for r, p, m in schedule([a, b, c], n_prompts=4, repeats=3) if p == prompt]
        places = {kind: sorted(i % 3 for i, k in enumerate(runs) if k == kind) for kind in set(runs)}
        assert places == {kind: [0, 1, 2] for kind in ("ar", "hf-ar", "hf-assisted")}


def test_steps_from_forwards():
    # prompt of 5; step 0 feeds the prompt + 3 drafts and keeps 2 (output 5 -> 8);
    # step 1 feeds 1 + 4 drafts and keeps 4 (8 -> 13); step 2 feeds 1 + 0 drafts (13 -> 14).
    calls = [(0, 8, 0.1), (7, 5, 0.1), (12, 1, 0.1)]
    assert _steps_from_forwards(calls, prompt_len=5, new_tokens=9) == ([3, 4, 0], [2, 4, 0])
    assert _steps_from_forwards([(0, 5, 0.1), (5, 1, 0.1)], 5, 2) == ([0, 0], [0, 0])
    assert _steps_from_forwards([(0, 5, 0.1), (9, 1, 0.1)], 5, 6) == ([], [])  # does not fit


# ------------------------------------------------------------------------------------------
# End to end on tiny models


METHODS = (
    "ar,spec:model:greedy:k=2:policy=static,spec:model:block:k=3:policy=static,spec:model:token:k=2:policy=static,spec:ngram:block:k=3:policy=static,spec:early-exit:block:k=2:policy=static:exit_layer=1,"
    "spec:model:tree:budget=6:depth=3,spec:model:typical:k=2:policy=static,spec:early-exit:block:k=4:policy=static:exit_layer=9,"
    "hf-assisted,hf-prompt-lookup,hf-ar"
)


@pytest.fixture(scope="module")
def tiny_models():
    target = tiny_llama(0, vocab=VOCAB, sharpness=8.0)
    return Pair(target, CharTokenizer(), copy.deepcopy(target), "tiny", "tiny-copy")


@pytest.fixture(scope="module")
def prompts():
    return [Prompt("mine", "a", text="abcabcabcab"), Prompt("mine", "b", text="hello hello")]


@pytest.fixture(scope="module")
def greedy_run(tiny_models, prompts):
    settings = BenchSettings(max_new_tokens=10, temperature=0.0, repeats=2, warmup_tokens=2)
    return run_bench(tiny_models, parse_methods(METHODS), prompts, settings, progress=False)


def test_a_failing_method_is_reported_and_left_out(greedy_run):
    bad = "spec:early-exit:block:k=4:policy=static:exit_layer=9"  # the tiny target has 2 layers
    assert "exit_layer" in greedy_run.failed[bad]
    assert bad not in [m.name for m in greedy_run.methods]
    assert all(s.method != bad for s in greedy_run.samples)


def test_run_order_and_counts(greedy_run):
    runs = [(s.repeat, s.prompt, s.method) for s in sorted(greedy_run.samples, key=lambda s: s.order)]
    names = [m.name for m in greedy_run.methods]
    assert runs == [(r, p, m.name) for r, p, m in schedule(greedy_run.methods, 2, 2)]
    assert sorted(runs) == sorted((r, p, m) for r in range(2) for p in range(2) for m in names)
    assert all(s.new_tokens == 10 for s in greedy_run.samples)  # EOS ignored: same tokens for all


def test_self_drafting_accepts_everything(greedy_run):
    """The draft is a copy of the target, so under greedy every draft token must be kept."""
    methods = report.summarize(greedy_run)
    for name in ("spec:model:greedy:k=2:policy=static", "spec:model:block:k=3:policy=static", "spec:model:token:k=2:policy=static"):
        assert methods[name]["acceptance_rate"] == 1.0
    for name, m in methods.items():  # every exact method reproduces ar under greedy
        if m["kind"] == "project" and m["exact"]:
            assert m["identical_to_ar_fraction"] == 1.0, name
    assert not methods["spec:model:typical:k=2:policy=static"]["exact"]
    assert methods["spec:model:tree:budget=6:depth=3"]["predicted_speedup"] is None
    for s in greedy_run.samples:
        if s.method == "hf-assisted":  # recovered from forward hooks; the last step may be cut
            assert s.step_accepted[:-1] == s.step_drafted[:-1]
            assert sum(s.step_accepted) + len(s.step_accepted) == s.new_tokens


def test_the_first_step_is_timed_apart_from_decoding(greedy_run):
    """Each run knows when its first target forward (the prefill) ended and what it produced, for
    the project's methods and for the peers alike, and decoding figures are computed from the rest."""
    for s in greedy_run.samples:
        assert s.first_step_seconds is not None and 0 < s.first_step_seconds < s.seconds, s.method
        assert 1 <= s.first_step_tokens <= s.new_tokens, s.method
        if s.method == "ar":
            assert s.first_step_tokens == 1
        if s.method == "spec:model:block:k=3:policy=static":  # a copy of the target drafts: the first step keeps all 3
            assert s.first_step_tokens == 4
    methods = report.summarize(greedy_run)
    assert methods["ar"]["decode_speedup_vs_ar"] == pytest.approx(1.0)
    ar = [s for s in greedy_run.samples if s.method == "ar"]
    decode = sum(s.new_tokens - s.first_step_tokens for s in ar) / sum(s.seconds - s.first_step_seconds for s in ar)
    assert methods["ar"]["decode_tokens_per_second"] == pytest.approx(decode)
    for name, m in methods.items():
        assert m["decode_speedup_vs_ar"] > 0 and m["first_step_seconds"] > 0, name


def test_results_json_table_and_plots(greedy_run, tiny_models, tmp_path):
    env = report.environment("specdec bench --test", "float32")
    info = {"target": report.model_info(tiny_models.target, "tiny"), "draft": None}
    data = report.results(greedy_run, env, info)
    out = report.write_run(data, tmp_path)
    saved = json.loads((out / "results.json").read_text())
    assert saved["environment"]["command"] == "specdec bench --test"
    assert {"torch", "transformers"} <= set(saved["environment"]["versions"])
    assert saved["environment"]["torch_threads"] >= 1 and saved["environment"]["cpu"]
    for name, m in saved["methods"].items():
        for key in ("speedup_vs_ar", "mean_accepted_per_forward", "tokens_per_second", "identical_to_ar_fraction"):
            assert key in m, (name, key)
        assert m["tokens_per_second"] > 0
    assert saved["methods"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert saved["methods"]["ar"]["mean_accepted_per_forward"] == 1.0
    assert saved["methods"]["spec:model:block:k=3:policy=static"]["peer"] == "hf-assisted"
    assert saved["methods"]["spec:ngram:block:k=3:policy=static"]["peer"] == "hf-prompt-lookup"
    assert saved["methods"]["spec:model:block:k=3:policy=static"]["vs_peer"] > 0
    assert saved["methods"]["spec:model:block:k=3:policy=static"]["predicted_speedup"] is not None
    table = (out / "results.md").read_text()
    assert all(f"`{name}`" in table for name in saved["methods"])
    assert "decoding speed-up" in table and "first step (s)" in table
    assert "`spec:model:typical:k=2:policy=static` (LOSSY)" in table and "FAILED" in table
    for png in report.PLOTS:
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_sampling_run_skips_greedy_verification(tiny_models, prompts):
    settings = BenchSettings(max_new_tokens=6, temperature=1.0, warmup_tokens=0)
    run = run_bench(tiny_models, parse_methods("spec:model:greedy:k=2:policy=static,spec:model:block:k=2:policy=static"), prompts[:1], settings, progress=False)
    assert [m.name for m in run.methods] == ["ar", "spec:model:block:k=2:policy=static"]
    assert "spec:model:greedy:k=2:policy=static" in run.skipped
    methods = report.summarize(run)
    assert methods["spec:model:block:k=2:policy=static"]["identical_to_ar_fraction"] is None


def test_trained_drafters_run_in_the_bench_and_keep_the_greedy_output(tiny_models, prompts, tmp_path):
    from specdec.drafters.medusa import HeadsConfig, MedusaHeads
    from specdec.drafters.eagle_head import EagleConfig, EagleHead

    hidden = tiny_models.target.config.hidden_size
    MedusaHeads(HeadsConfig(3, hidden, VOCAB, VOCAB, "tiny"), torch.arange(VOCAB)).save(tmp_path / "heads")
    EagleHead(EagleConfig(hidden, VOCAB, VOCAB, num_heads=4, intermediate_size=64), torch.arange(VOCAB)).save(tmp_path / "eagle")
    methods = (f"spec:heads:block:k=2:path={tmp_path / 'heads'},spec:heads:tree:path={tmp_path / 'heads'},"
               f"spec:eagle:block:k=3:path={tmp_path / 'eagle'}")
    settings = BenchSettings(max_new_tokens=8, temperature=0.0, warmup_tokens=0)
    run = run_bench(tiny_models, parse_methods(methods), prompts, settings, progress=False)
    assert not run.failed, run.failed
    summary = report.summarize(run)
    assert len(summary) == 4
    for name, m in summary.items():
        assert m["identical_to_ar_fraction"] == 1.0, name


def test_cli_end_to_end(tiny_models, tmp_path, monkeypatch):
    prompt_file = tmp_path / "p.jsonl"
    prompt_file.write_text('{"prompt": "abcabc"}\n{"prompt": "xyzxyz"}\n')
    monkeypatch.setattr("specdec.cli.bench.torch_pair", lambda args, methods: tiny_models)
    out = tmp_path / "out"
    argv = ["--prompts", f"{prompt_file}:2", "--methods", "spec:model:block:k=2:policy=static,hf-prompt-lookup",
            "--temperature", "0", "1", "--max-new-tokens", "6", "--warmup-tokens", "0",
            "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    for folder in ("greedy", "t1"):
        data = json.loads((out / folder / "results.json").read_text())
        assert list(data["methods"]) == ["ar", "spec:model:block:k=2:policy=static", "hf-prompt-lookup"]
        assert "--temperature 0 1" in data["environment"]["command"]
        assert "--repeats 1" in data["environment"]["resolved_command"]
    assert "specdec bench" in (out / "README.md").read_text()
    assert main(["--methods", "spec:nope", "--out", str(out)]) == 2


def test_add_bench_parser_registers_the_subcommand():
    parser = argparse.ArgumentParser(prog="specdec")
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--prompts", "humaneval:2", "--temperature", "0", "1"])
    assert args.prompts == "humaneval:2" and args.temperature == [0.0, 1.0] and callable(args.func)


# ------------------------------------------------------------------------------------------
# Backends, llama.cpp peers and divergences (the parts that need no llama.cpp binding)


def test_parse_methods_runs_unmarked_methods_on_each_backend():
    both = parse_methods("spec:model:block:k=4:policy=static,spec:ngram:block:k=4:policy=static:backend=torch,llamacpp-ar,hf-ar", ("torch", "llamacpp"))
    assert [s.name for s in both] == [
        "ar", "ar:backend=llamacpp", "spec:model:block:k=4:policy=static", "spec:model:block:k=4:policy=static:backend=llamacpp",
        "spec:ngram:block:k=4:policy=static", "llamacpp-ar", "hf-ar",
    ]
    only = parse_methods("spec:model:block:k=2:policy=static,llamacpp-ar", ("llamacpp",))
    assert [s.name for s in only] == ["ar:backend=llamacpp", "spec:model:block:k=2:policy=static:backend=llamacpp", "llamacpp-ar"]
    assert [s.name for s in parse_methods("hf-ar")] == ["ar", "hf-ar"]
    assert [s.backend for s in only] == ["llamacpp"] * 3
    with pytest.raises(ValueError, match="unknown backend"):
        parse_methods("ar", ("cuda",))
    with pytest.raises(ValueError, match="runs on backend=torch only"):
        parse_methods("spec:layer-skip:block:k=4:policy=static", ("torch", "llamacpp"))


def test_each_method_is_compared_with_its_own_backend():
    llama_block = parse_method("spec:model:block:k=4:policy=static:backend=llamacpp")
    assert llama_block.ar == MethodSpec("ar", backend="llamacpp") and llama_block.ar.name == "ar:backend=llamacpp"
    assert parse_method("hf-prompt-lookup").ar.name == "ar" and parse_method("llamacpp-ar").ar.name == "ar:backend=llamacpp"
    assert parse_method("spec:ngram:block:k=4:policy=static:backend=llamacpp").peer is None  # the binding drafts nothing itself
    assert parse_method("spec:ngram:block:k=4:policy=static").peer == "hf-prompt-lookup"
    assert parse_method("spec:model:block:k=4:policy=static:backend=llamacpp").peer is None  # the binding has no draft-model peer
    assert not parse_method("llamacpp-ar").needs_draft_model


def _sample(method, prompt, tokens, seconds, first=None):
    from specdec.bench.sample import Sample

    return Sample(method=method, prompt=prompt, repeat=0, order=0, seed=0, token_ids=tokens, seconds=seconds,
                  target_forwards=len(tokens), first_step_seconds=first, first_step_tokens=1 if first else None)


def test_per_prompt_speedups_take_the_median_run_and_the_total_takes_every_run():
    """With repeats, a prompt's ratio is of median tokens per second: one run slowed 3x by other
    work on the machine moves the total but not the per-prompt figures."""
    from specdec.bench.runner import BenchRun

    methods = parse_methods("spec:ngram:block:k=2:policy=static,llamacpp-ar", ("llamacpp",))
    times = {"ar:backend=llamacpp": (1.0, 1.0, 1.0), "spec:ngram:block:k=2:policy=static:backend=llamacpp": (0.8, 2.4, 0.9),
             "llamacpp-ar": (1.0, 1.1, 0.9)}  # seconds for 10 tokens in repeats 0, 1, 2 of one prompt
    samples = []
    for name, seconds in times.items():
        for repeat, t in enumerate(seconds):
            samples.append(_sample(name, 0, list(range(10)), t))
            samples[-1].repeat = repeat
    run = BenchRun(BenchSettings(max_new_tokens=10, repeats=3), methods, {}, {}, [Prompt("code", "c/0", text="x")],
                   [3], samples, 1.0)
    spec = report.summarize(run)["spec:ngram:block:k=2:policy=static:backend=llamacpp"]
    assert spec["speedup_vs_llamacpp_ar_min"] == pytest.approx((10 / 0.9) / (10 / 1.0))  # medians: 0.9 s, 1.0 s
    assert spec["speedup_vs_ar_geomean"] == pytest.approx(1 / 0.9)
    assert spec["speedup_vs_llamacpp_ar"] == pytest.approx(3.0 / 4.1)  # totals: 30 tokens in 4.1 s and in 3.0 s


def test_decoding_alone_is_compared_with_llamacpp_ar_after_each_runs_first_step():
    """A method that prefills faster and decodes at the binding's pace shows a speed-up overall
    and none after the first step: where a gain comes from is in the table."""
    from specdec.bench.runner import BenchRun

    methods = parse_methods("llamacpp-ar", ("llamacpp",))
    runs = {"ar:backend=llamacpp": (3.0, 1.0), "llamacpp-ar": (4.0, 2.0)}  # (seconds, first step) for 11 tokens
    samples = [_sample(name, 0, list(range(11)), t, first) for name, (t, first) in runs.items()]
    run = BenchRun(BenchSettings(max_new_tokens=11), methods, {}, {}, [Prompt("code", "c/0", text="x")], [3],
                   samples, 1.0)
    ar = report.summarize(run)["ar:backend=llamacpp"]
    assert ar["speedup_vs_llamacpp_ar"] == pytest.approx(4.0 / 3.0)
    assert ar["decode_speedup_vs_llamacpp_ar"] == pytest.approx(1.0)  # 10 tokens in 2 s after the first step, both
    data = {"settings": {"greedy": True, "temperature": 0.0, "max_new_tokens": 11, "repeats": 1},
            "models": {"target": {"name": "t"}, "draft": None}, "environment": {"dtype": "bfloat16"},
            "prompts": [{"set": "code", "id": "c/0"}], "methods": report.summarize(run)}
    table = report.markdown(data)
    assert "| decoding vs llamacpp-ar |" in table
    row = next(line for line in table.splitlines() if line.startswith("| `ar:backend=llamacpp`"))
    assert row.split(" | ")[7:9] == ["1.00×", "1.00×"]  # decoding speed-up vs its ar, vs llamacpp-ar


def test_report_against_llamacpp_ar_and_each_backends_ar():
    """Speed-ups against the same backend's ar and against llamacpp-ar, per prompt, per set and in the
    table, computed from known times."""
    from specdec.bench.runner import BenchRun

    methods = parse_methods("spec:ngram:block:k=2:policy=static,llamacpp-ar", ("torch", "llamacpp"))
    seconds = {  # method -> seconds on prompt 0 (set "code") and prompt 1 (set "chat"); 10 tokens each
        "ar": (2.0, 2.0), "ar:backend=llamacpp": (1.0, 1.0), "spec:ngram:block:k=2:policy=static": (1.0, 2.0),
        "spec:ngram:block:k=2:policy=static:backend=llamacpp": (0.5, 1.25), "llamacpp-ar": (1.0, 1.0),
    }
    samples = [_sample(name, p, list(range(10)), t) for name, times in seconds.items() for p, t in enumerate(times)]
    samples[-3].token_ids = [0, 1, 2, 7, 7, 7, 7, 7, 7, 7]  # spec on llama.cpp leaves its ar on prompt 1
    prompts = [Prompt("code", "c/0", text="x"), Prompt("chat", "t/0", text="y")]
    run = BenchRun(BenchSettings(max_new_tokens=10), methods, {}, {}, prompts, [3, 3], samples, 1.0)
    summary = report.summarize(run)
    spec = summary["spec:ngram:block:k=2:policy=static:backend=llamacpp"]
    assert spec["ar"] == "ar:backend=llamacpp"
    assert spec["speedup_vs_ar"] == pytest.approx(2 / 1.75)  # 20 tokens in 1.75 s vs 20 in 2 s
    assert spec["speedup_vs_llamacpp_ar"] == pytest.approx(2 / 1.75)
    assert spec["speedup_vs_llamacpp_ar_min"] == pytest.approx(0.8)
    assert spec["speedup_vs_llamacpp_ar_geomean"] == pytest.approx((2 * 0.8) ** 0.5)
    assert spec["speedup_vs_llamacpp_ar_by_set"] == pytest.approx({"code": 2.0, "chat": 0.8})
    assert spec["ms_per_token"] == pytest.approx(1000 * 1.75 / 20)
    assert spec["identical_prompts"] == "1/2"
    torch_spec = summary["spec:ngram:block:k=2:policy=static"]
    assert torch_spec["ar"] == "ar" and torch_spec["speedup_vs_ar"] == pytest.approx(4 / 3)
    assert torch_spec["speedup_vs_llamacpp_ar"] == pytest.approx(2 / 3) and torch_spec["identical_prompts"] == "2/2"
    assert summary["llamacpp-ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert summary["ar"]["speedup_vs_llamacpp_ar"] == pytest.approx(0.5)
    data = {"settings": {"greedy": True, "temperature": 0.0, "max_new_tokens": 10, "repeats": 1},
            "models": {"target": {"name": "t"}, "draft": None}, "environment": {"dtype": "bfloat16"},
            "prompts": [p.to_dict() for p in prompts], "methods": summary}
    table = report.markdown(data)
    for column in ("ms/token", "vs llamacpp-ar", "speed-up vs ar"):
        assert f"| {column} |" in table
    assert "| `spec:ngram:block:k=2:policy=static:backend=llamacpp` | 11.4 | 87.5 | 1.14× |" in table
    assert "| `spec:ngram:block:k=2:policy=static:backend=llamacpp` | 2.00× | 0.80× |" in table  # per set: code, chat
    data["methods"] = report.summarize(BenchRun(BenchSettings(), methods[:1], {}, {}, prompts[:1], [3],
                                                samples[:1], 1.0))
    assert "vs llamacpp-ar" not in report.markdown(data)  # no llamacpp-ar, no column


def test_the_recorder_sees_the_row_that_chose_each_greedy_token(tiny_models, prompts):
    """Replaying greedy ar through a LogitsRecorder: each new token is the top-1 of the recorded row
    at the position before it, and its margin is the gap between the two best logits of that row
    as a fresh forward of the same context computes it."""
    from specdec.backends.lean import make_backend
    from specdec.divergence import LogitsRecorder, explain, first_difference

    import specdec

    prompt = prompts[0].token_ids(tiny_models.tokenizer)
    recorder = LogitsRecorder(make_backend(tiny_models.target))
    tokens = specdec.generate(recorder, prompt, max_new_tokens=8, eos_token_ids=[]).token_ids
    for i, token in enumerate(tokens):
        row = recorder.row(len(prompt) + i - 1, ([*prompt, *tokens][len(prompt) + i - 1]))
        assert row is not None and row.top[0] == token
        with torch.no_grad():
            logits = tiny_models.target(torch.tensor([prompt + tokens[:i]])).logits[0, -1]
        best = torch.topk(logits, 2)
        assert row.top[1] == int(best.indices[1])
        assert row.margin == pytest.approx(float(best.values[0] - best.values[1]), abs=1e-4)
    other = tokens[:3] + [(tokens[3] + 1) % VOCAB] + tokens[4:]
    found = explain(prompt, other, tokens, None, recorder)
    assert (found.position, found.token, found.ar_token) == (3, other[3], tokens[3])
    assert found.ar_top[0] == tokens[3] and found.ar_margin > 0 and found.margin is None
    assert explain(prompt, tokens, tokens, recorder, recorder) is None
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1], [2]) == 0


def test_a_near_tie_flipped_by_batched_rounding_is_explained(monkeypatch, prompts):
    """Greedy block verification on a target whose batched passes round differently leaves ar; the
    run says where, the two tokens, and the top-2 margins in ar's pass (whose best is ar's token) and
    in the method's own pass (whose best is the method's token), as a fresh pass of each kind gives them."""
    from specdec.backends.lean import make_backend
    from specdec.bench import runner

    target = tiny_llama(0, vocab=VOCAB, sharpness=1.0)
    models = Pair(target, CharTokenizer(), copy.deepcopy(target))
    monkeypatch.setattr(builder, "target_backend", lambda drafter, model: BatchRounding(make_backend(model), 0.05))
    settings = BenchSettings(max_new_tokens=16, temperature=0.0, warmup_tokens=0)
    run = run_bench(models, parse_methods("spec:model:block:k=4:policy=static"), prompts, settings, progress=False)
    summary = report.summarize(run)
    assert summary["spec:model:block:k=4:policy=static"]["identical_to_ar_fraction"] < 1, "the wobble flipped no token: raise it"
    assert [d["prompt"] for d in run.divergences] == [p for p in range(2) if _differs(run, p)]
    for d in run.divergences:
        ar, mine = (next(s for s in run.samples if s.method == name and s.prompt == d["prompt"])
                    for name in ("ar", "spec:model:block:k=4:policy=static"))
        p = d["position"]
        assert ar.token_ids[:p] == mine.token_ids[:p] and (d["token"], d["ar_token"]) == (mine.token_ids[p], ar.token_ids[p])
        assert d["replayed"] == {"ar": True, "method": True}
        assert d["ar_top"][0] == d["ar_token"] and d["top"][0] == d["token"]  # each pass's greedy choice
        context = torch.tensor([prompts[d["prompt"]].token_ids(models.tokenizer) + ar.token_ids[:p]])
        with torch.no_grad():
            exact = torch.topk(target(context).logits[0, -1], 2)
        assert d["ar_margin"] == pytest.approx(float(exact.values[0] - exact.values[1]), abs=1e-4)
        assert d["ar_margin"] < 2 * 0.05 * 2  # a near-tie: within what the wobble can move two logits
        assert d["batch_invariant"] is False  # measured on the wobbling backend
        assert 0 < d["logit_gap"] <= 0.05 + 1e-6  # the wobble at that row, as the two replays computed it
    table = report.markdown(report.results(run, report.environment("x", "float32"), {"target": None, "draft": None})
                            | {"models": {"target": {"name": "tiny"}, "draft": None}})
    assert "`spec:model:block:k=4:policy=static` leaves `ar` on" in table and "top-2 logit margin" in table
    assert "round differently from its one-token steps (measured)" in table and "defect" not in table


COUPLED = "spec:model:coupled:k=4:policy=static"
COUPLED_NGRAM = "spec:ngram:coupled:k=4:policy=static"


def test_coupled_methods_that_part_are_explained_by_the_noised_scores(monkeypatch, prompts):
    """At T = 1 the coupled methods of a backend must give one text for a seed; on a target whose
    batched passes round differently they can part at a near-tie of the Gumbel-max scores, and
    the run says where, against the first coupled method, with each pass's top-2 noised scores
    (whose best is that run's token). On a batch-invariant target they never part."""
    from specdec.backends.lean import make_backend

    target = tiny_llama(0, vocab=VOCAB, sharpness=1.0)
    models = Pair(target, CharTokenizer(), copy.deepcopy(target))
    settings = BenchSettings(max_new_tokens=16, temperature=1.0, warmup_tokens=0)
    methods = parse_methods(f"{COUPLED},{COUPLED_NGRAM}")
    monkeypatch.setattr(builder, "target_backend", lambda drafter, model: OneByOne(make_backend(model)))
    run = run_bench(models, methods, prompts, settings, progress=False)
    assert not run.divergences
    for p in range(len(prompts)):
        assert len({tuple(s.token_ids) for s in run.samples if s.prompt == p and "coupled" in s.method}) == 1
    monkeypatch.setattr(builder, "target_backend", lambda drafter, model: BatchRounding(make_backend(model), 0.3))
    run = run_bench(models, methods, prompts, settings, progress=False)
    assert run.divergences, "the wobble parted no coupled runs: raise it"
    for d in run.divergences:
        assert (d["method"], d["base"]) == (COUPLED_NGRAM, COUPLED)
        base, mine = (next(s for s in run.samples if s.method == name and s.prompt == d["prompt"])
                      for name in (COUPLED, COUPLED_NGRAM))
        p = d["position"]
        assert base.token_ids[:p] == mine.token_ids[:p] and (d["token"], d["ar_token"]) == (mine.token_ids[p], base.token_ids[p])
        assert d["replayed"] == {"ar": True, "method": True}
        assert d["ar_top"][0] == d["ar_token"] and d["top"][0] == d["token"]  # each pass's Gumbel-max choice
        assert d["ar_margin"] < 2 * 0.3 * 2 and d["batch_invariant"] is False
    table = report.markdown(report.results(run, report.environment("x", "float32"), {"target": None, "draft": None})
                            | {"models": {"target": {"name": "tiny"}, "draft": None}})
    assert f"`{COUPLED_NGRAM}` leaves `{COUPLED}` on" in table and "Gumbel-max scores" in table


class OneByOne:
    """A batch-invariant backend: every pass is computed as one-token steps."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, tokens, num_logits=0, attend=None, positions=None):
        assert attend is None, "chains only"
        rows = torch.cat([self.backend.forward([t]) for t in tokens])  # [n, V]
        return rows[-num_logits:] if num_logits > 0 else rows


class VerifyBug(BatchRounding):
    """A backend whose passes are batch invariant (a plain pass of any length equals one-token
    steps) but whose verification passes (several rows of logits asked for) are wrong: a bug in
    the path a speculative method takes, which no rounding explains."""

    def forward(self, tokens, num_logits=0, **kwargs):
        if num_logits > 1:
            return super().forward(tokens, num_logits, **kwargs)
        return self.backend.forward(tokens, num_logits, **kwargs)


def test_a_divergence_on_a_batch_invariant_backend_is_reported_as_a_defect_with_the_logit_gap(monkeypatch, prompts):
    from specdec.backends.lean import make_backend
    from specdec.bench import runner
    from specdec.measurements import batch_invariance

    target = tiny_llama(0, vocab=VOCAB, sharpness=1.0)
    models = Pair(target, CharTokenizer(), copy.deepcopy(target))
    assert batch_invariance(VerifyBug(OneByOne(make_backend(target)), 1.0))["invariant"] is True
    monkeypatch.setattr(builder, "target_backend", lambda drafter, model: VerifyBug(OneByOne(make_backend(model)), 1.0))
    settings = BenchSettings(max_new_tokens=16, temperature=0.0, warmup_tokens=0)
    run = run_bench(models, parse_methods("spec:model:block:k=4:policy=static"), prompts, settings, progress=False)
    assert run.divergences, "the bug flipped no token: raise its scale"
    for d in run.divergences:
        assert d["batch_invariant"] is True and 0 < d["logit_gap"] <= 1.0 + 1e-6
    table = report.markdown(report.results(run, report.environment("x", "float32"), {"target": None, "draft": None})
                            | {"models": {"target": {"name": "tiny"}, "draft": None}})
    assert "a defect: this backend's multi-token passes compute bit-identical rows" in table
    assert "verification pass's logits there differ from the one-token step's by up to" in table


def test_a_peer_that_leaves_ar_on_a_batch_invariant_backend_is_not_called_a_specdec_defect(monkeypatch, prompts):
    """A peer's output is its own library's: where it leaves ar (here one token changed in
    transformers' plain generate), the report says where and ar's margin, and that the difference is
    the peer's, even though specdec's own backend measures batch invariant."""
    from specdec.backends.lean import make_backend
    from specdec.bench import runner

    target = tiny_llama(0, vocab=VOCAB, sharpness=1.0)
    models = Pair(target, CharTokenizer(), copy.deepcopy(target))
    monkeypatch.setattr(builder, "target_backend", lambda drafter, model: OneByOne(make_backend(model)))
    run_peer = runner.run_peer

    def flipped(*args, **kwargs):  # the peer's third new token replaced by the next id
        sample = run_peer(*args, **kwargs)
        sample.token_ids = sample.token_ids[:2] + [(sample.token_ids[2] + 1) % VOCAB] + sample.token_ids[3:]
        return sample

    monkeypatch.setattr(runner, "run_peer", flipped)
    settings = BenchSettings(max_new_tokens=8, temperature=0.0, warmup_tokens=0)
    run = run_bench(models, parse_methods("hf-ar"), prompts, settings, progress=False)
    assert [d["method"] for d in run.divergences] == ["hf-ar"] * len(prompts)
    assert all(d["position"] == 2 and d["batch_invariant"] is True and d["margin"] is None for d in run.divergences)
    table = report.markdown(report.results(run, report.environment("x", "float32"), {"target": None, "draft": None})
                            | {"models": {"target": {"name": "tiny"}, "draft": None}})
    lines = [line for line in table.splitlines() if line.startswith("`hf-ar` leaves `ar`")]
    assert len(lines) == len(prompts)
    for line in lines:
        assert "at new token 2" in line and "in `ar`'s pass" in line
        assert "the difference is the peer's, not specdec's" in line
    assert "defect" not in table and "please report" not in table


def test_batch_invariance_is_measured_once_then_read_from_the_cache(tmp_path):
    from specdec.backends.lean import make_backend
    from specdec.measurements import INVARIANCE_ROWS, batch_invariance

    wobbly = BatchRounding(make_backend(tiny_llama(0, vocab=VOCAB)), 0.05)
    first = batch_invariance(wobbly, cache_dir=tmp_path)
    assert first == {"invariant": False, "rows": {n: False for n in INVARIANCE_ROWS}, "source": "measured"}
    assert batch_invariance(wobbly, cache_dir=tmp_path) == {**first, "source": "cache"}
    assert wobbly.tokens == []


def _differs(run, prompt):
    ar, mine = (next(s for s in run.samples if s.method == name and s.prompt == prompt) for name in ("ar", "spec:model:block:k=4:policy=static"))
    return ar.token_ids != mine.token_ids


def test_llamacpp_methods_without_the_binding_or_a_gguf_fail_clearly(monkeypatch, tmp_path, capsys):

    from specdec.cli.bench import gguf_path
    from specdec.cli.common import CLIError

    from specdec.backends import llamacpp

    monkeypatch.setattr(llamacpp, "available", lambda: False)
    assert main(["--methods", "llamacpp-ar", "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "llamacpp-ar run on llama.cpp, which needs its binding" in err and "pip install llama-cpp-python" in err
    with pytest.raises(CLIError, match="neither a model pack nor a .gguf file"):
        gguf_path(str(tmp_path), argparse.Namespace(cache_dir=None))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert gguf_path(str(tmp_path / "m.gguf"), argparse.Namespace(cache_dir=None)) == tmp_path / "m.gguf"


def test_every_drafter_that_drafts_with_the_draft_model_gets_it_in_the_bench():
    """The bench hands the draft model to exactly the methods whose drafter drafts with it (a
    cascade or retrieval+model method once failed: 'needs a draft model')."""
    from specdec.bench.methods import parse_method
    from specdec.drafters import names, spec

    model_drafters = [name for name in names() if spec(name).uses_draft_model]
    for name in ("model", "ngram+model", "retrieval+model", "cascade", "ngram", "retrieval", "lookahead"):
        text = f"spec:{name}:tree" if name == "lookahead" else f"spec:{name}:block"
        text += ":datastore=x.npz" if name.startswith("retrieval") else ""
        assert parse_method(text).needs_draft_model == (name in model_drafters), text
    assert set(model_drafters) == {"model", "ngram+model", "retrieval+model", "cascade"}


def test_a_peer_that_will_not_sample_the_end_where_ar_did_is_explained_as_such(monkeypatch, prompts):
    """With the end ignored, ar samples an end-of-generation token and goes on; a peer asked to
    ignore the end (llama-server's ignore_eos) never samples one. Where the peer leaves ar at such a
    token, the report says so instead of calling it a near-tie that rounding flipped; a peer that
    leaves ar at any other token keeps the rounding explanation."""
    from specdec.bench import runner

    target = tiny_llama(0, vocab=VOCAB, sharpness=1.0)
    models = Pair(target, CharTokenizer(), copy.deepcopy(target))
    run_peer = runner.run_peer
    settings = BenchSettings(max_new_tokens=8, temperature=0.0, warmup_tokens=0)
    plain = run_bench(models, parse_methods("hf-ar"), prompts, settings, progress=False)
    third = {s.prompt: s.token_ids[2] for s in plain.samples if s.method == "ar"}

    def flipped(*args, **kwargs):  # the peer's third new token replaced by the next id
        sample = run_peer(*args, **kwargs)
        sample.token_ids = sample.token_ids[:2] + [(sample.token_ids[2] + 1) % VOCAB] + sample.token_ids[3:]
        return sample

    monkeypatch.setattr(runner, "run_peer", flipped)
    for ends in (True, False):  # ar's third token an end-of-generation token, or not one
        eos = {third[0]} if ends else {VOCAB + 5}
        monkeypatch.setattr(runner, "eos_token_ids_of", lambda model, tokenizer: eos)
        run = run_bench(models, parse_methods("hf-ar"), prompts, settings, progress=False)
        first = next(d for d in run.divergences if d["prompt"] == 0)
        assert first["position"] == 2 and first["ar_token_ends"] is ends
        table = report.markdown(report.results(run, report.environment("x", "float32"), {"target": None, "draft": None})
                                | {"models": {"target": {"name": "tiny"}, "draft": None}})
        line = next(line for line in table.splitlines() if line.startswith("`hf-ar` leaves `ar` on") and "repeat 0) at new token 2" in line
                    and line.split(" on ")[1].startswith(str(run.prompts[0].id)))
        assert ("never samples such a token" in line) is ends
        assert ("can flip a near-tie" in line) is not ends


def test_the_bench_holds_a_pair_per_gguf_backend_loaded_with_the_runs_context(tmp_path):
    """Methods on the GGUF kernel run on a :class:`~specdec.models.Pair` of that backend, loaded once
    with the run's context (rounded up), its draft the target's weights where it is the target's
    file; a later run needing no more room keeps it."""
    from helpers import write_tiny_gguf
    from specdec.backends import table
    from specdec.bench import runner
    from specdec.models import locate

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path)
    located = locate(str(path))
    backends = runner.BenchBackends(ggufs={"gguf": runner.GGUFs(located, located)}, n_threads=1)
    methods = parse_methods("spec:model:block:k=2:policy=static:backend=gguf", ("gguf",))
    tokenizer = CharTokenizer()
    runner.load_gguf_pairs(backends, methods, 100, tokenizer)
    pair = backends.pairs["gguf"]
    assert (pair.backend, pair.draft_backend, pair.target_name, pair.draft_name) == ("gguf", "gguf", str(path), str(path))
    assert pair.tokenizer is tokenizer and table.row_of(pair.target).name == "gguf"
    assert pair.draft is not pair.target and pair.draft.weights is pair.target.weights  # forked: one set of weights
    assert backends.n_ctx == runner.CONTEXT_STEP == pair.target.max_context  # 100 tokens, rounded up
    runner.load_gguf_pairs(backends, methods, 200, tokenizer)
    assert backends.pairs["gguf"] is pair
