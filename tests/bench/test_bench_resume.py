"""The benchmark's output folder: finished runs are saved as they end, an interrupted run resumes,
a rerun never replaces results by accident, and bad method strings fail before any model loads."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from specdec.bench import runner
from specdec.cli.bench import main
from specdec.bench.methods import parse_method, parse_methods
from specdec.models import Pair
from helpers import VOCAB, CharTokenizer
from helpers import one_thread  # noqa: F401  (one_thread: an autouse fixture)
from tiny import tiny_llama

METHODS = "spec:model:block:k=2:policy=static,spec:ngram:block:k=2:policy=static"  # with ar: three methods


@pytest.fixture(scope="module")
def tiny_models():
    target = tiny_llama(0, vocab=VOCAB, sharpness=8.0)
    return Pair(target, CharTokenizer(), copy.deepcopy(target), "tiny", "tiny-copy")


@pytest.fixture
def bench(tiny_models, tmp_path, monkeypatch):
    """``bench(out, *extra, stop_after=None)``: run the bench CLI on the tiny models with two prompts;
    returns (exit code, timed runs computed). ``stop_after=N`` presses Ctrl-C as run N+1 starts."""
    prompt_file = tmp_path / "p.jsonl"
    prompt_file.write_text('{"prompt": "abcabcab"}\n{"prompt": "xyzxyzxy"}\n')
    monkeypatch.setattr("specdec.cli.bench.torch_pair", lambda args, methods: tiny_models)
    real = runner.run_method

    def run(out, *extra, stop_after=None, methods=METHODS, prompts=f"{prompt_file}:2"):
        calls = []

        def counted(*args, **kwargs):
            if stop_after is not None and len(calls) == stop_after:
                raise KeyboardInterrupt
            calls.append(args[0].name)
            return real(*args, **kwargs)

        monkeypatch.setattr(runner, "run_method", counted)
        argv = ["--prompts", prompts, "--methods", methods, "--temperature", "0", "1", "--repeats", "2",
                "--max-new-tokens", "4", "--warmup-tokens", "0", "--no-progress", "--out", str(out), *extra]
        return main(argv), len(calls)

    run.prompt_file = prompt_file
    return run


def _keys(out):
    """Per temperature folder, the (method, prompt, repeat, order) of every timed run in results.json."""
    return {folder: sorted((s["method"], s["prompt"], s["repeat"], s["order"])
                           for s in json.loads((out / folder / "results.json").read_text())["samples"])
            for folder in ("greedy", "t1")}


def _saved(folder):
    return [json.loads(p.read_text()) for p in sorted((folder / "samples").glob("*.json"))]


# ------------------------------------------------------------------------------------------
# Interrupt and resume


def test_an_interrupted_run_keeps_what_finished_and_a_rerun_does_only_the_rest(bench, tmp_path, capsys):
    whole = 2 * 3 * 2 * 2  # temperatures x methods x prompts x repeats
    code, ran = bench(tmp_path / "whole")
    assert (code, ran) == (0, whole)

    out = tmp_path / "out"
    code, ran = bench(out, stop_after=5)
    assert (code, ran) == (130, 5)
    err = capsys.readouterr().err
    assert "5 of 24 timed runs" in err and "resume" in err and str(out) in err
    saved = _saved(out / "greedy")
    first = sorted(_keys(tmp_path / "whole")["greedy"], key=lambda key: key[3])[:5]  # in the order run
    assert sorted((s["method"], s["prompt"], s["repeat"], s["sample"]["order"]) for s in saved) == sorted(first)
    assert not list((out / "greedy").glob("samples/.*")), "a temporary file was left behind"
    assert not (out / "greedy" / "results.json").exists()

    code, ran = bench(out)  # the same arguments: resume
    assert (code, ran) == (0, whole - 5)
    assert "resum" in capsys.readouterr().err
    assert _keys(out) == _keys(tmp_path / "whole")
    data = json.loads((out / "greedy" / "results.json").read_text())
    assert data["resumed_samples"] == 5
    assert "specdec bench" in (out / "README.md").read_text()


def test_a_rerun_of_a_finished_run_computes_nothing_and_rewrites_the_report(bench, tmp_path, capsys):
    out = tmp_path / "out"
    assert bench(out) == (0, 24)
    (out / "greedy" / "results.md").unlink()
    capsys.readouterr()
    assert bench(out) == (0, 0)
    assert (out / "greedy" / "results.md").is_file()
    # it says the runs were made and reported before, never that an invocation was interrupted
    err = capsys.readouterr().err
    assert f"all 24 timed runs are saved in {out} by an earlier invocation" in err and "resuming" not in err
    for folder in ("greedy", "t1"):
        data = json.loads((out / folder / "results.json").read_text())
        assert (data["resumed_samples"], data["resumed_from"]) == (12, "reported")
        note = (out / folder / "results.md").read_text()
        assert "All 12 timed runs were made, and reported, by an earlier invocation of the same command; " \
               "this one only wrote the report again." in note
        assert "interrupted" not in note


def test_a_rerun_after_an_interrupt_in_the_second_temperature_resumes_there(bench, tmp_path):
    out = tmp_path / "out"
    assert bench(out, stop_after=15) == (130, 15)
    assert len(_saved(out / "greedy")) == 12 and len(_saved(out / "t1")) == 3
    assert bench(out) == (0, 9)
    # the first temperature was finished and reported before the interrupt; the second was not
    assert "All 12 timed runs were made, and reported, by an earlier invocation" in (out / "greedy" / "results.md").read_text()
    assert "3 of the 12 timed runs were made by an earlier, interrupted invocation of the same command" \
        in (out / "t1" / "results.md").read_text()
    assert json.loads((out / "t1" / "results.json").read_text())["resumed_from"] == "interrupted"


# ------------------------------------------------------------------------------------------
# An existing --out


def test_a_rerun_with_other_arguments_is_refused_and_overwrite_replaces(bench, tmp_path, capsys):
    out = tmp_path / "out"
    assert bench(out)[0] == 0
    before = (out / "greedy" / "results.json").read_bytes()
    capsys.readouterr()
    code, ran = bench(out, "--seed", "5")
    assert (code, ran) == (2, 0)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("specdec: error: ") and "--seed" in err[0] and str(out) in err[0]
    assert err[1].startswith("hint: ") and "--overwrite" in err[1]
    assert (out / "greedy" / "results.json").read_bytes() == before

    assert bench(out, "--seed", "5", "--overwrite") == (0, 24)
    assert json.loads((out / "greedy" / "results.json").read_text())["settings"]["seed"] == 5
    assert bench(out, "--seed", "5") == (0, 0)  # the replacement resumes as its own


def test_overwrite_removes_the_old_runs_temperature_folders(bench, tmp_path):
    out = tmp_path / "out"
    assert bench(out)[0] == 0
    code, _ = bench(out, "--overwrite", "--temperature", "0")
    assert code == 0 and not (out / "t1").exists()


def test_a_changed_prompt_file_is_a_different_run(bench, tmp_path, capsys):
    out = tmp_path / "out"
    assert bench(out, stop_after=2)[0] == 130
    bench.prompt_file.write_text('{"prompt": "abcabcab"}\n{"prompt": "something else"}\n')
    assert bench(out) == (2, 0)
    assert "--prompts" in capsys.readouterr().err


def test_results_from_an_unknown_run_are_not_replaced(bench, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "greedy").mkdir(parents=True)
    (out / "greedy" / "results.json").write_text("{}")
    (out / "README.md").write_text("# older results\n")
    assert bench(out) == (2, 0)
    err = capsys.readouterr().err
    assert "already holds benchmark results" in err and "--overwrite" in err
    assert (out / "README.md").read_text() == "# older results\n"


def test_a_started_run_with_nothing_saved_may_be_restarted_with_other_arguments(bench, tmp_path):
    """A run stopped before any timed run finished (e.g. a wrong --target) leaves nothing to lose."""
    out = tmp_path / "out"
    assert bench(out, stop_after=0) == (130, 0)
    assert bench(out, "--seed", "3") == (0, 24)


def test_files_are_written_by_replacing_a_temporary_file(tmp_path, monkeypatch):
    from specdec import paths

    target = tmp_path / "x.json"
    paths.write_atomic(target, "old")
    seen = []

    def replace(src, dst):
        seen.append((Path(src), Path(dst), Path(src).read_text()))
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        paths.write_atomic(target, "new")
    (src, dst, text), = seen
    assert src.parent == tmp_path and dst == target and text == "new"  # whole, beside it, then renamed
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.json"]


# ------------------------------------------------------------------------------------------
# Method strings: refused when parsed


@pytest.mark.parametrize(
    "text, message",
    [
        ("spec:tree:budget=0", r"budget= takes a positive integer, got '0'"),
        ("spec:tree:depth=-1", r"depth= takes a positive integer"),
        ("spec:tree:width=2.5", r"width= takes a positive integer"),
        ("spec:tree:expand=x", r"expand= takes a positive integer"),
        ("spec:tree:threshold=1.5", r"threshold= takes a number from 0 to 1"),
        ("spec:tree:threshold=abc", r"threshold= takes a number from 0 to 1"),
        ("spec:ngram:block:max_ngram=abc", r"max_ngram= takes a positive integer, got 'abc'"),
        ("spec:ngram:block:min_ngram=0", r"min_ngram= takes a positive integer"),
        ("spec:block:policy=heuristic:k_max=0", r"k_max= takes a positive integer"),
        ("spec:block:policy=confidence:threshold=-0.1", r"threshold= takes a number from 0 to 1"),
        ("spec:early-exit:block:exit_layer=0", r"exit_layer= takes a positive integer"),
        ("spec:layer-skip:block:skip=-1", r"skip= takes layer indices"),
        ("spec:layer-skip:block:skip=1/x", r"skip= takes layer indices"),
        ("spec:block:k=-2", r"k= takes a positive integer"),
        ("hf-assisted:k=0", r"k must be a positive integer"),
        ("spec:block:budget=4", r"budget= .*tree"),
        ("spec:ngram:block:exit_layer=2", r"exit_layer= is an option of early-exit, but the drafter is ngram"),
        ("spec:model:block:max_ngram=2", r"max_ngram= is an option of ngram, ngram\+model, retrieval\+model or cascade, but the drafter is model"),
        ("spec:tree:choices=0|1:threshold=0.5", r"choices= fixes the tree's shape"),
    ],
)
def test_out_of_range_option_values_are_refused_when_parsed(text, message):
    with pytest.raises(ValueError, match=message):
        parse_method(text)


def test_valid_option_values_still_parse_and_round_trip():
    for text in ("spec:model:tree:budget=1:depth=2:expand=1:width=1", "spec:model:tree:threshold=0.0", "spec:model:tree:threshold=1.0",
                 "spec:ngram:block:k=4:policy=static:max_ngram=2:min_ngram=1", "spec:early-exit:block:k=4:policy=static:exit_layer=1",
                 "spec:layer-skip:token:k=4:policy=static:skip=3/5", "spec:layer-skip:token:k=4:policy=static:skip=0",
                 "spec:model:block:k=4:policy=confidence:k_max=6:threshold=0.3", "spec:heads:block:k=4:policy=static:path=123"):
        spec = parse_method(text)
        assert parse_method(spec.name) == spec, text
    assert parse_method("spec:layer-skip:token:k=4:policy=static:skip=0").config.drafter_options == {"skip": (0,)}
    assert parse_method("spec:heads:block:k=4:policy=static:path=123").config.drafter_options == {"path": "123"}


@pytest.mark.parametrize("text", ["", " ", ",", " , "])
def test_an_empty_method_list_is_an_error(text):
    with pytest.raises(ValueError, match="no methods"):
        parse_methods(text)


@pytest.mark.parametrize("methods, named", [("", "--methods"), ("spec:tree:budget=0", "budget="),
                                            ("spec:ngram:block:max_ngram=abc", "max_ngram=")])
def test_the_command_refuses_bad_methods_before_loading_a_model(methods, named, tmp_path, monkeypatch, capsys):
    def load(args, methods):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("specdec.cli.bench.torch_pair", load)
    assert main(["--methods", methods, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("specdec: error: ") and named in err[0] and err[1].startswith("hint: ")
    assert not (tmp_path / "out").exists()
