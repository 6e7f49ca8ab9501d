"""Bad input from the command line, the bench and train-heads: one line and a hint, before model work.

Each test here stands for one kind of mistake a new user makes; the numbers of the defect list are
not repeated, the test names say what is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec import cli, models

from test_cli import assert_one_line_error, make_model_dir, run_main


@pytest.fixture
def no_model_work(monkeypatch):
    """Fail the test if a model is loaded or a pack converted."""
    monkeypatch.setattr(models, "load", lambda *a, **kw: pytest.fail("loaded a model for bad input"))
    monkeypatch.setattr(models, "convert", lambda *a, **kw: pytest.fail("converted a pack for bad input"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"target": str(make_model_dir(root / "target", seed=0)), "draft": str(make_model_dir(root / "draft", seed=1))}


# ------------------------------------------------------------------------------------------------
# Option values that parse but mean nothing


@pytest.mark.parametrize("args, contains", [
    (["generate", "x", "--temperature", "inf"], "argument --temperature: expected a finite number"),
    (["generate", "x", "--seed", "99999999999999999999999"], "argument --seed: expected an integer in [0, 2**64)"),
    (["generate", "x", "--seed", "-1"], "argument --seed"),
    (["generate", "x", "--verify", "tree", "--tree-static", "0|-1|0.0"], "ranks count from 0"),
    (["generate", "x", "--verify", "tree", "--tree-static", "0|99999"], "needs its elder sibling 99998"),
    (["generate", "x", "--draft", "none", "--verify", "tree"], "--draft none decodes with the target alone"),
    (["generate", "x", "--draft", "none", "--verify", "typical"], "--verify typical has nothing to act on"),
    (["generate", "x", "--draft", "none", "--policy", "theory"], "--policy theory has nothing to act on"),
])
def test_nonsense_options_are_one_line_errors(args, contains, capsys, no_model_work):
    code, out, err = run_main(args, capsys)
    assert (code, out) == (2, "")
    assert_one_line_error(err, contains=contains)


def test_draft_ignored_by_a_drafter_is_said(tiny, capsys):
    code, _, err = run_main(["generate", "hello", "--target", tiny["target"], "--draft", tiny["draft"],
                             "--drafter", "ngram", "--dtype", "float32", "--max-new-tokens", "4"], capsys)
    assert code == 0
    assert f"--draft {tiny['draft']} is ignored" in err


# ------------------------------------------------------------------------------------------------
# Prompts


@pytest.mark.parametrize("prompt, contains", [
    ("caf\udce9", "the byte 0xe9, which is not UTF-8"),  # how Python hands over a Latin-1 argument
    ("x\ud800y", "a lone surrogate U+D800"),
    ("", "the prompt is empty"),
    (" \n\t", "the prompt is whitespace-only"),
])
def test_prompts_that_are_not_text(prompt, contains, capsys, no_model_work):
    code, out, err = run_main(["generate", prompt], capsys)
    assert (code, out) == (2, "")
    assert_one_line_error(err, contains=contains)


# ------------------------------------------------------------------------------------------------
# Reports


@pytest.mark.parametrize("extra, shown", [
    (["--verify", "tree"], "confident tree: threshold 0.8"),
    (["--verify", "tree", "--tree-static", "0|1|0.0"], "static tree: 3 nodes, depth 2"),
    (["--verify", "tree", "--tree-budget", "6"], "dynamic tree: depth 5, width 4, up to 6 nodes"),
])
def test_tree_runs_show_the_tree(tiny, capsys, extra, shown):
    code, _, err = run_main(["generate", "hello", "--target", tiny["target"], "--draft", tiny["draft"],
                             "--dtype", "float32", "--max-new-tokens", "4", *extra], capsys)
    assert code == 0, err
    summary = [line for line in err.splitlines() if line.startswith("speculative (")]
    assert summary and shown in summary[0] and "k=" not in summary[0], err
