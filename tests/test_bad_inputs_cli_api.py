"""Bad input to the command line and the Python API that used to pass silently or be misreported.

Tree specs that swallow the prompt, options that do not apply to the chosen method or backend,
what a GGUF on llama.cpp really runs, shell-escaped stop strings, too many threads, API arguments
the command line already refuses, and temporaries left by an interrupted pack preparation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from specdec import generate, models, packs
from specdec.cli import common
from specdec.cli import commands
from specdec.backends import llamacpp

from helpers import assert_one_line_error, make_model_dir, run_main
from tiny import tiny_llama

SMOLLM2 = "smollm2-135m"


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
    return {"target": str(make_model_dir(root / "target", seed=0))}


def smollm2_gguf():
    missing = packs.missing_parts(packs.PACKS[SMOLLM2])
    if missing:
        pytest.skip(f"pack {SMOLLM2} is not installed: {packs.PACKS[SMOLLM2].install_command(missing)}")
    return packs.PACKS[SMOLLM2].parts[0].locate()


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


@pytest.mark.parametrize("option", [{"dtype": "float32"}, {"kernels": "torch"}])
def test_torch_options_on_llamacpp_are_refused_by_the_api(option):
    (name,) = option
    with pytest.raises(ValueError, match=f"^{name} does not apply to the llama.cpp backend"):
        models.load(SMOLLM2, backend="llamacpp", **option)


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


# ------------------------------------------------------------------------------------------------
# The API follows the command line's rules, naming the argument


def test_tree_without_a_draft_is_refused_by_the_api():
    target = tiny_llama(0, vocab=16)
    with pytest.raises(ValueError, match=r"^verify='tree' needs a draft model or a drafter; pass draft= \(or "
                                         r"drafter=\), or leave verify out to decode with the target alone$"):
        generate(target, [1, 2, 3], verify="tree", max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^policy='static' needs a draft model or a drafter; pass draft= \(or "
                                         r"drafter=\), or leave policy out to decode with the target alone$"):
        generate(target, [1, 2, 3], policy="static", max_new_tokens=2)
    assert generate(target, [1, 2, 3], max_new_tokens=2).method == "ar"


@pytest.mark.parametrize("bad", [-1, 10**9])
def test_eos_ids_outside_the_vocabulary_are_refused(bad):
    target = tiny_llama(0, vocab=16)
    with pytest.raises(ValueError, match=rf"^eos_token_ids \[{bad}\] are outside the vocabulary \(0\.\.15\)"):
        generate(target, [1, 2, 3], eos_token_ids=[3, bad], max_new_tokens=2)
    assert len(generate(target, [1, 2, 3], eos_token_ids=[15], max_new_tokens=2).token_ids) <= 2


@pytest.mark.parametrize("bad", [None, 3, b"smollm2-135m"])
def test_load_names_its_argument(bad):
    names = re.escape(", ".join(models.PACKS))  # every pack, by name
    with pytest.raises(TypeError, match=rf"^name_or_path must be a pack name \({names}\), a model directory or a "
                                        r"\.gguf file, got "):
        models.load(bad)


def test_load_refuses_an_empty_name():
    with pytest.raises(ValueError, match=r"^name_or_path is empty; give a pack name \("):
        models.load(" ")


# ------------------------------------------------------------------------------------------------
# Temporaries left by an interrupted pack preparation


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path):
    stale = tmp_path / f".{SMOLLM2}-tmp{dead_pid()}-ab12cd34"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "weights").write_bytes(b"x" * 10)
    stale_file = tmp_path / f".{SMOLLM2}-tmp{dead_pid()}-ef34gh56.gguf.part"
    stale_file.write_bytes(b"x")
    live = tmp_path / f".{SMOLLM2}-tmp{os.getpid()}-ij56kl78"
    live.mkdir()
    old_unnamed = tmp_path / f".{SMOLLM2}-k2x9_q7z"  # an older version's name, without a PID
    old_unnamed.mkdir()
    day_ago = time.time() - 2 * 86400
    os.utime(old_unnamed, (day_ago, day_ago))
    new_unnamed = tmp_path / f".{SMOLLM2}-m3y8_r6w"
    new_unnamed.mkdir()
    other = tmp_path / f".qwen2.5-coder-0.5b-tmp{dead_pid()}-zz99yy00"  # another pack's: its own lock guards it
    other.mkdir()
    keep = [tmp_path / SMOLLM2, tmp_path / f".{SMOLLM2}.lock"]
    keep[0].mkdir()
    keep[1].write_text("")
    removed = packs.remove_stale_temporaries(tmp_path, SMOLLM2)
    assert sorted(removed) == sorted([stale, stale_file, old_unnamed])
    assert not stale.exists() and not stale_file.exists() and not old_unnamed.exists()
    assert live.is_dir() and new_unnamed.is_dir() and other.is_dir() and all(p.exists() for p in keep)


def test_preparing_a_pack_removes_stale_temporaries(tmp_path, monkeypatch):
    from helpers import make_fake_pack

    (tmp_path / "pack").mkdir()
    pack = make_fake_pack(tmp_path / "pack", monkeypatch)
    cache = tmp_path / "cache"
    (cache / "gguf").mkdir(parents=True)
    stale_work = cache / f".{pack.name}-tmp{dead_pid()}-ab12cd34"
    (stale_work / "model").mkdir(parents=True)
    stale_join = cache / "gguf" / f".{pack.name}-tmp{dead_pid()}-ef34gh56.gguf.part"
    stale_join.write_bytes(b"x")
    made = []
    real_mkdtemp = packs.tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):  # the work folder is named with this process's id
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(packs.tempfile, "mkdtemp", mkdtemp)
    def convert_gguf(pack, gguf, out, progress):  # stands in for the dequantisation
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(packs, "_convert_gguf", convert_gguf)
    packs.gguf_file(pack, cache, progress=False)
    assert not stale_join.exists()
    packs.convert(pack, cache, progress=False)
    assert not stale_work.exists()
    assert made and os.path.basename(made[0]).startswith(f".{pack.name}-tmp{os.getpid()}-")
    assert sorted(p.name for p in cache.iterdir()) == sorted(["gguf", pack.name, f".{pack.name}.lock"])
