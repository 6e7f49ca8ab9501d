"""Bad input from the command line, the bench and train-heads: one line and a hint, before model work.

Each test here stands for one kind of mistake a new user makes; the test names say what is checked.
Among them, input that once passed silently or was misreported: tree specs that swallow the prompt,
options that do not apply to the chosen method or backend, what a GGUF on llama.cpp really runs,
shell-escaped stop strings, too many threads. (The Python API's bad input is
tests/test_api_errors.py; a damaged GGUF's, tests/backends/test_damaged_gguf.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec import cli, models, packs
from specdec.backends import llamacpp
from specdec.cli import commands, common

from helpers import assert_one_line_error, make_model_dir, run_main

SMOLLM2 = "smollm2-135m"


def assert_error_after_notes(err: str, *, contains: str) -> None:
    """As assert_one_line_error, after the progress notes ('specdec: loading ...') that precede it."""
    notes = [line for line in err.splitlines() if line.startswith("specdec: ") and not line.startswith("specdec: error: ")]
    assert_one_line_error("\n".join(line for line in err.splitlines() if line not in notes), contains=contains)


@pytest.fixture
def no_model_work(monkeypatch):
    """Fail the test if a model is loaded or a pack converted."""
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: pytest.fail("loaded a model for bad input"))
    monkeypatch.setattr(packs, "convert", lambda *a, **kw: pytest.fail("converted a pack for bad input"))


@pytest.fixture
def load_stops(monkeypatch):
    """Loading a model fails with a pack error: a command that gets this far passed its checks."""
    def refuse(*args, **kwargs):
        raise models.ModelPackError("loading stopped by the test", "none")

    monkeypatch.setattr(models, "load_model", refuse)  # the step every route loads a model through


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


# ------------------------------------------------------------------------------------------------
# specdec bench


def bench_args(tiny, tmp_path, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    return ["bench", "--target", tiny["target"], "--draft", "none", "--dtype", "float32", "--methods", "ar",
            "--prompts", f"{prompts}:1", "--max-new-tokens", "3", "--warmup-tokens", "0", "--no-progress", *extra]


@pytest.mark.parametrize("extra, contains", [
    (["--warmup-tokens", "-1"], "argument --warmup-tokens: expected an integer >= 0"),
    (["--temperature", "0", "inf"], "argument --temperature"),
    (["--repeats", "0"], "argument --repeats"),
    (["--methods", "spec:magic"], "spec:magic"),
    (["--methods", "spec:model:block:k=4:policy=static"], "spec:model:block:k=4:policy=static needs a draft model, but --draft is none"),
])
def test_bench_errors_are_one_line_with_a_hint(tiny, tmp_path, capsys, no_model_work, extra, contains):
    code, out, err = run_main(bench_args(tiny, tmp_path, "--out", str(tmp_path / "out"), *extra), capsys)
    assert (code, out) == (2, "")
    assert_one_line_error(err, contains=contains)


def test_bench_checks_out_before_any_work(tiny, tmp_path, capsys, no_model_work):
    taken = tmp_path / "results.txt"
    taken.write_text("not a folder")
    for out in (taken, taken / "sub"):
        code, _, err = run_main(bench_args(tiny, tmp_path, "--out", str(out)), capsys)
        assert code == 2
        assert_one_line_error(err, contains=f"--out: {taken} is a file, not a folder")
    assert taken.read_text() == "not a folder"


def test_bench_never_loses_a_finished_run(tiny, tmp_path, capsys, monkeypatch):
    from specdec.bench import report

    write_run = report.write_run
    failures = []

    def disk_full_once(data, folder):
        if not failures:
            failures.append(folder)
            raise OSError(28, "No space left on device")
        return write_run(data, folder)

    monkeypatch.setattr(report, "write_run", disk_full_once)
    code, out, err = run_main(bench_args(tiny, tmp_path, "--out", str(tmp_path / "out")), capsys)
    assert code == 0, err
    line = next(x for x in err.splitlines() if "could not write into" in x)
    fallback = Path(line.rsplit("writing to ", 1)[1].removesuffix(" instead"))
    saved = json.loads((fallback / "results.json").read_text())
    assert saved["methods"]["ar"]["new_tokens"] == 3 if "new_tokens" in saved["methods"]["ar"] else saved["samples"]
    assert f"(written to {fallback})" in out


def test_bench_with_only_ar_warns_of_nothing(tiny, tmp_path, capsys, recwarn):
    code, _, err = run_main(bench_args(tiny, tmp_path, "--out", str(tmp_path / "out")), capsys)
    assert code == 0, err
    assert not [w for w in recwarn if "legend" in str(w.message)], [str(w.message) for w in recwarn]
    assert (tmp_path / "out" / "greedy" / "k_sweep.png").is_file()


@pytest.mark.parametrize("line, contains", [
    ('{"prompt": ', "line 1 is not valid JSON: expecting value at the end of the line"),
    ('{"prompt": x}', "line 1 is not valid JSON: expecting value at column 12"),
    ("[1, 2]", "line 1 is a JSON list, not an object"),
])
def test_broken_prompt_file_is_named_in_full(tiny, tmp_path, capsys, no_model_work, line, contains):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(line + "\n")
    args = bench_args(tiny, tmp_path, "--out", str(tmp_path / "out"))
    args[args.index("--prompts") + 1] = f"{broken}:1"
    code, _, err = run_main(args, capsys)
    assert code == 2
    assert_one_line_error(err, contains=contains)


# ------------------------------------------------------------------------------------------------
# The cache and damaged model files


@pytest.mark.parametrize("command", [["generate", "x"], ["models"]])
def test_cache_dir_that_is_a_file(tmp_path, capsys, no_model_work, command):
    taken = tmp_path / "cache"
    taken.write_text("")
    code, _, err = run_main([*command, "--cache-dir", str(taken / "sub")], capsys)
    assert code == 1
    assert_one_line_error(err, contains=f"cannot be used: {taken} is a file")


def test_cache_env_that_cannot_be_created(tmp_path, capsys, monkeypatch, no_model_work):
    monkeypatch.setenv(models.CACHE_ENV, "/proc/specdec-cannot-be-here")
    code, _, err = run_main(["generate", "x"], capsys)
    assert code == 1
    assert_one_line_error(err, contains="cannot write into the cache directory /proc/specdec-cannot-be-here ($SPECDEC_CACHE)")


def converted_copy(tiny, root: Path) -> Path:
    """A tiny model saved where a converted pack lives, with the pack's marker."""
    import shutil

    pack = packs.PACKS["smollm2-135m"]
    folder = packs.pack_dir(pack, root)
    shutil.copytree(tiny["target"], folder)
    (folder / packs.MARKER).write_text(json.dumps({"gguf_sha256": pack.sha256, "format": packs.FORMAT}))
    return folder


@pytest.mark.parametrize("damage, named", [("truncate", "model.safetensors is truncated"),
                                            ("config", "config.json is missing")])
def test_damaged_conversion_is_not_called_converted(tiny, tmp_path, capsys, damage, named):
    folder = converted_copy(tiny, tmp_path)
    assert packs.is_converted(packs.PACKS["smollm2-135m"], tmp_path)
    if damage == "truncate":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    else:
        (folder / "config.json").unlink()
    assert not packs.is_converted(packs.PACKS["smollm2-135m"], tmp_path)
    code, out, err = run_main(["models", "--cache-dir", str(tmp_path), "--json"], capsys)
    row = next(r for r in json.loads(out) if r["name"] == "smollm2-135m")
    assert row["converted"] is False and named in row["damaged"]
    code, out, err = run_main(["models", "--cache-dir", str(tmp_path)], capsys)
    assert "damaged (redone on first use)" in out and named in out


def test_damaged_model_directory_names_the_file(tiny, tmp_path, capsys):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(tiny["target"], copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = run_main(["generate", "x", "--target", str(copy), "--draft", "none"], capsys)
    assert code == 1
    assert_error_after_notes(err, contains=f"{weights} is truncated")


def test_truncated_gguf_names_the_file(tmp_path, capsys):
    source = packs.locate_parts(packs.PACKS["smollm2-135m"])[0]
    cut = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        cut.write_bytes(f.read(5_000_000))
    # transformers' reader (--backend torch); llama.cpp's backend has a check of its own
    code, _, err = run_main(["generate", "x", "--target", str(cut), "--draft", "none", "--backend", "torch"], capsys)
    assert code == 1
    assert_error_after_notes(err, contains=f"{cut} is not a readable GGUF file")


def test_damaged_conversion_is_converted_again(tiny, tmp_path, capsys, monkeypatch):
    import shutil

    folder = converted_copy(tiny, tmp_path)
    (folder / "config.json").unlink()
    redone = []

    def convert_gguf(pack, gguf, out, progress):  # stands in for the minute-long dequantisation
        redone.append(gguf)
        shutil.copytree(tiny["target"], out)

    monkeypatch.setattr(packs, "_convert_gguf", convert_gguf)
    assert packs.convert("smollm2-135m", tmp_path) == folder
    assert len(redone) == 1 and (folder / "config.json").is_file()
    assert packs.is_converted(packs.PACKS["smollm2-135m"], tmp_path)
    assert f"the converted copy is damaged ({folder / 'config.json'} is missing); converting it again" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# specdec train-heads


@pytest.mark.parametrize("extra, contains", [
    (["--lr", "nan"], "argument --lr: expected a finite number > 0, got 'nan'"),
    (["--lr", "-0.1"], "argument --lr"),
    (["--lr", "inf"], "argument --lr"),
    (["--seed", "99999999999999999999999"], "argument --seed"),
])
def test_train_heads_options_checked_at_parse_time(tmp_path, capsys, no_model_work, extra, contains):
    code, out, err = run_main(["train-heads", "--out", str(tmp_path / "heads"), *extra], capsys)
    assert (code, out) == (2, "")
    assert_one_line_error(err, contains=contains)


def test_train_heads_checks_before_collecting(tiny, tmp_path, capsys, monkeypatch):
    from specdec.training import heads as train

    monkeypatch.setattr(train, "collect", lambda *a, **kw: pytest.fail("collected data for bad options"))
    taken = tmp_path / "file"
    taken.write_text("")
    code, _, err = run_main(["train-heads", "--out", str(taken), "--target", tiny["target"]], capsys)
    assert code == 2
    assert_one_line_error(err, contains=f"--out: {taken} is a file, not a folder")
    code, _, err = run_main(["train-heads", "--out", str(tmp_path / "heads"), "--target", tiny["target"],
                             "--kept-tokens", "100000"], capsys)
    assert code == 2
    assert_error_after_notes(err, contains="--kept-tokens 100000 is more than the target's 256-token vocabulary")


def test_train_heads_help_lists_only_its_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train-heads", "--help"])
    shown = capsys.readouterr().out
    assert "--target" in shown and "--lr" in shown
    assert "--draft MODEL" not in shown and "--draft-weights" not in shown  # neither does anything here


# ------------------------------------------------------------------------------------------------
# A prompt that leaves less room than --max-new-tokens


@pytest.mark.parametrize("mode", ["--json", "--stream"])
def test_prompt_that_fills_the_context_is_said(tiny, capsys, mode):
    prompt = "a" * 506  # one token per byte; the tiny models hold 512 positions: room for 6
    code, out, err = run_main(["generate", prompt, "--target", tiny["target"], "--draft", tiny["draft"],
                               "--dtype", "float32", "--max-new-tokens", "8", mode], capsys)
    assert code == 0, err
    warned = [line for line in err.splitlines() if line.startswith("specdec: warning: ")]
    assert len(warned) == 1 and "at most 6 new tokens fit" in warned[0], err
    assert "UserWarning" not in err
    if mode == "--json":
        report = json.loads(out)
        assert report["stats"]["truncated_to"] == 6 and len(report["token_ids"]) == 6


# ------------------------------------------------------------------------------------------------
# Long prompts: the prefill takes the fast kernels, verification keeps batch invariance


def test_long_prompt_prefill_is_fast_and_keeps_greedy_equality(monkeypatch):
    import torch

    from specdec import generate, kernels
    from specdec.backends.hf import HFCausalLM
    from specdec.backends.lean import LeanCausalLM
    from specdec.backends.base import forward_after
    from helpers import _on_kernels, _tiny_qwen2, needs_kernel  # noqa: F401
    from tiny import noisy_copy, tiny_llama

    if kernels.status() != "available":
        pytest.skip(f"fast kernel {kernels.status()}")
    target = _on_kernels(tiny_llama(3, vocab=64, layers=2, sharpness=4.0, context=512))
    draft = _on_kernels(noisy_copy(tiny_llama(3, vocab=64, layers=2, sharpness=4.0, context=512), 0.3))
    prompt = torch.randint(0, 64, (3 * kernels.PREFILL_ROWS,), generator=torch.Generator().manual_seed(0)).tolist()

    rows_by_mode = {True: [], False: []}  # prefill or not -> row counts of the linear calls
    linear = kernels.linear_f32

    def counting(rows, weight):
        rows_by_mode[kernels.prefilling()].append(rows.shape[0])
        return linear(rows, weight)

    monkeypatch.setattr(kernels, "linear_f32", counting)
    ar = generate(target, prompt, max_new_tokens=24)
    # the prompt but its last token in every layer, and the one unused row of the head
    assert sorted(set(rows_by_mode[True])) == [1, len(prompt) - 1]
    assert max(rows_by_mode[False]) == 1  # the last prompt token and every step: invariant kernels
    for options in (dict(k=4, policy="static"), dict(k=6, verify="token", policy="static"), dict(verify="tree")):
        rows_by_mode[True].clear()
        spec = generate(target, prompt, draft=draft, max_new_tokens=24, **options)
        assert spec.token_ids == ar.token_ids, options
        assert len(prompt) - 1 in rows_by_mode[True]  # the same prefill as ar's

    # The transformers backend and the lean one still compute the same logits, prefill included.
    for model in (target, _on_kernels(_tiny_qwen2(4))):
        hf, lean = HFCausalLM(model), LeanCausalLM(model)
        assert torch.equal(forward_after(hf, prompt, [1, 2, 3]), forward_after(lean, prompt, [1, 2, 3]))
        assert torch.equal(forward_after(hf, prompt + [5, 6], [7]), forward_after(lean, prompt + [5, 6], [7]))


# ------------------------------------------------------------------------------------------------
# --tree-static is parsed as its option's value


@pytest.mark.parametrize("args, message", [
    # the would-be prompt taken as a tree: the error names the tree, not a missing PROMPT
    (["generate", "--verify", "tree", "--tree-static", "x"],
     "argument --tree-static: tree choices 'x': write 'default' or rank paths like 0|1|0.0 "
     "(paths joined by '|', ranks by '.')"),
    (["generate", "hello", "--verify", "tree", "--tree-static", ""],
     "argument --tree-static: tree choices '': write 'default' or rank paths like 0|1|0.0 "
     "(paths joined by '|', ranks by '.')"),
])
def test_bad_tree_static_is_a_bad_option_value(args, message, capsys, no_model_work):
    code, out, err = run_main(args, capsys)
    assert (code, out) == (2, "")
    assert_one_line_error(err, contains=message)
    assert err.splitlines()[0] == f"specdec: error: {message}"


def test_tree_static_alone_and_by_name_is_the_default_shape():
    from specdec.drafters.tree import DEFAULT_CHOICES

    for extra in (["--tree-static"], ["--tree-static", "default"]):
        args = commands.build_parser().parse_args(["generate", "hi", "--verify", "tree", *extra])
        assert common.decode_config(args).tree == {"choices": DEFAULT_CHOICES}
    args = commands.build_parser().parse_args(["generate", "hi", "--verify", "tree", "--tree-static", "0|1|0.0"])
    assert common.decode_config(args).tree == {"choices": ((0,), (1,), (0, 0))}


# ------------------------------------------------------------------------------------------------
# Options that do not apply are errors naming them, only when given


@pytest.mark.parametrize("extra, option", [(["--policy", "static"], "--policy"), (["-k", "2"], "-k")])
def test_chain_options_under_a_tree_are_refused(extra, option, capsys, no_model_work):
    code, out, err = run_main(["generate", "hi", "--verify", "tree", *extra], capsys)
    assert (code, out) == (2, "")
    assert_one_line_error(err, contains=f"{option} is an option of --verify block, coupled, greedy, token or typical, "
                                        "but --verify is tree")
    assert err.splitlines()[1] == (f"hint: drop {option} (the tree's shape sets how much it drafts: --tree-depth, "
                                   "--tree-budget), or use --verify block")


def test_chain_defaults_do_not_count_as_given():
    for argv in (["--verify", "tree"], ["--verify", "block", "-k", "2", "--policy", "static"]):
        args = commands.build_parser().parse_args(["generate", "hi", *argv])
        common.decode_config(args)  # no error


def test_num_heads_with_eagle_is_refused(tmp_path, capsys, no_model_work):
    code, out, err = run_main(["train-heads", "--out", str(tmp_path / "heads"), "--kind", "eagle",
                               "--num-heads", "3"], capsys)
    assert (code, out) == (2, "")
    assert_one_line_error(err, contains="--num-heads is an option of --kind medusa, but --kind is eagle")
    assert not (tmp_path / "heads").exists()  # refused before any work


@pytest.mark.parametrize("extra", [["--kind", "eagle"], ["--kind", "medusa", "--num-heads", "3"]])
def test_train_heads_kinds_without_foreign_options_pass(extra, tmp_path, capsys, load_stops):
    code, _, err = run_main(["train-heads", "--out", str(tmp_path / "heads"), "--cache-dir", str(tmp_path / "cache"),
                             *extra], capsys)
    assert code == 1 and "loading stopped by the test" in err, err


# ------------------------------------------------------------------------------------------------
# A GGUF on llama.cpp: say what runs, refuse what does not apply


def smollm2_gguf():
    missing = packs.missing_parts(packs.PACKS[SMOLLM2])
    if missing:
        pytest.skip(f"pack {SMOLLM2} is not installed: {packs.PACKS[SMOLLM2].install_command(missing)}")
    return packs.PACKS[SMOLLM2].parts[0].locate()


def test_llamacpp_run_says_what_runs(tmp_path, capsys):
    smollm2_gguf()
    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    code, out, err = run_main(["generate", "def f(x):", "--target", SMOLLM2, "--draft", "none", "--backend",
                               "llamacpp", "--threads", "1", "--max-new-tokens", "2", "--json",
                               "--cache-dir", str(tmp_path)], capsys)
    assert code == 0, err
    lines = err.splitlines()
    assert "specdec: loading smollm2-135m (GGUF via llama.cpp)" in lines
    assert "specdec: smollm2-135m: llama 135M Q4_1 GGUF via llama.cpp" in lines  # llama.cpp's words, with the parameter count of its tensors
    assert "float16" not in err
    report = json.loads(out)
    assert report["weights"] == "llama 135M Q4_1 GGUF via llama.cpp" and "dtype" not in report


@pytest.mark.parametrize("extra, option", [(["--dtype", "float32"], "--dtype"), (["--kernels", "torch"], "--kernels")])
def test_torch_options_on_llamacpp_are_refused(extra, option, tmp_path, capsys, no_model_work):
    code, out, err = run_main(["generate", "hi", "--target", SMOLLM2, "--draft", "none", "--backend", "llamacpp",
                               "--cache-dir", str(tmp_path), *extra], capsys)
    assert (code, out) == (2, "")
    assert_one_line_error(err, contains=f"{option} is an option of the torch backend, but {SMOLLM2} runs on llama.cpp")


# ------------------------------------------------------------------------------------------------
# Stop strings with a shell escape typed literally


def test_stop_with_a_literal_backslash_escape_gets_a_hint(tiny, capsys):
    code, _, err = run_main(["generate", "hi", "--target", tiny["target"], "--draft", "none", "--dtype", "float32",
                             "--max-new-tokens", "2", "--stop", "END\\n", "--stop", "\t"], capsys)
    assert code == 0, err
    hints = [line for line in err.splitlines() if "--stop" in line]
    assert hints == ["specdec: warning: --stop 'END\\n' holds \\n as two characters (a backslash and 'n'), not a "
                     "newline; to stop at a newline pass --stop $'END\\n' (bash)"]


# ------------------------------------------------------------------------------------------------
# More threads than CPUs


@pytest.mark.parametrize("command", [["generate", "hi", "--draft", "none"], ["train-heads", "--out", "OUT"],
                                     ["bench", "--draft", "none", "--methods", "ar", "--out", "OUT"],
                                     ["serve", "--draft", "none"]])
def test_threads_beyond_the_cpus_are_warned_of(command, tiny, tmp_path, capsys, monkeypatch, load_stops):
    monkeypatch.setattr(llamacpp, "default_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # keep this process's threads
    for threads, warned in (("3", True), ("2", False)):
        command = [str(tmp_path / f"out{threads}") if a == "OUT" or a.startswith(str(tmp_path)) else a for a in command]
        code, _, err = run_main([*command, "--target", tiny["target"], "--threads", threads], capsys)
        assert code == 1 and "loading stopped by the test" in err, err
        line = ("specdec: warning: --threads 3 is more than the 2 CPUs this process may run on; threads beyond "
                "them only contend (use --threads 2 or fewer)")
        assert (line in err.splitlines()) == warned, err
