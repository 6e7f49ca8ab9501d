"""The context a GGUF model is loaded with: -c/--ctx-size, models.load's and load_pair's n_ctx, the
backends' n_ctx.

Its default (4,096 tokens, or the model's trained context if shorter), its bounds (at least
models.MIN_CONTEXT, at most the context the GGUF says the model was trained on) and the prompt that
does not fit it, refused with the numbers. The tiny GGUF written here says it was trained on 256
tokens; SmolLM2's pack says 8,192.
"""

from __future__ import annotations

import pytest

from specdec import models, packs
from specdec.backends import gguf, llamacpp
from specdec.backends.base import DEFAULT_CONTEXT, ContextSizeError, context_size
from helpers import assert_one_line_error, run_main, write_tiny_gguf

TRAINED = 256  # the tiny GGUF's context_length


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("ctx") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def smollm2():
    missing = packs.missing_parts(packs.PACKS["smollm2-135m"])
    if missing:
        pytest.skip("pack smollm2-135m is not installed")
    return packs.gguf_file("smollm2-135m", progress=False)


# ------------------------------------------------------------------------------------------------
# The rule


def test_the_default_is_4096_or_the_trained_context_if_shorter():
    assert context_size(None, 32768, "m.gguf") == DEFAULT_CONTEXT == 4096
    assert context_size(None, 2048, "m.gguf") == 2048
    assert context_size(None, 0, "m.gguf") == 4096  # a GGUF that does not say
    assert context_size(32768, 32768, "m.gguf") == 32768 and context_size(300, 0, "m.gguf") == 300


@pytest.mark.parametrize("asked", [0, -5, 1.5, True, "512"])
def test_a_context_that_is_not_a_positive_integer_is_refused(asked):
    with pytest.raises(ContextSizeError, match="n_ctx must be a positive integer"):
        context_size(asked, 32768, "m.gguf")


def test_more_than_the_trained_context_is_refused_with_both_numbers():
    with pytest.raises(ContextSizeError) as caught:
        context_size(40000, 32768, "m.gguf")
    assert caught.value.message == "m.gguf: a context of 40000 tokens is more than the 32768 this model was trained on"
    assert "--ctx-size 32768" in caught.value.hint and isinstance(caught.value, ValueError)


# ------------------------------------------------------------------------------------------------
# The backends


def test_the_kernel_takes_the_context_asked_for_and_sizes_its_cache_by_it(tiny_gguf):
    default = gguf.load_gguf_native(tiny_gguf, n_threads=1)
    assert default.max_context == TRAINED  # 4096 capped at the trained context
    short = gguf.load_gguf_native(tiny_gguf, n_threads=1, n_ctx=64)
    assert short.max_context == 64
    per_position = default.cache_bytes // (TRAINED + gguf.TREE_SLACK)
    assert short.cache_bytes == per_position * (64 + gguf.TREE_SLACK)
    assert short.fork().max_context == 64


def test_the_kernel_refuses_more_than_the_trained_context(tiny_gguf):
    with pytest.raises(ContextSizeError, match=f"a context of 300 tokens is more than the {TRAINED} this model"):
        gguf.load_gguf_native(tiny_gguf, n_threads=1, n_ctx=300)


def test_llamacpp_takes_the_same_context(tiny_gguf):
    if not llamacpp.available():
        pytest.skip("the llama.cpp binding is not installed")
    model = llamacpp.load_gguf(tiny_gguf, n_threads=1, n_ctx=128, prefill_layout="repacked")
    assert model.max_context == 128
    assert llamacpp.load_gguf(tiny_gguf, n_threads=1, prefill_layout="repacked").max_context == TRAINED
    with pytest.raises(ContextSizeError, match=f"300 tokens is more than the {TRAINED}"):
        llamacpp.load_gguf(tiny_gguf, n_threads=1, n_ctx=300, prefill_layout="repacked")


# ------------------------------------------------------------------------------------------------
# The Python API


def test_models_load_takes_n_ctx(tiny_gguf):
    model, _ = models.load(str(tiny_gguf), backend="gguf", n_ctx=TRAINED)
    assert model.max_context == TRAINED


@pytest.mark.parametrize("n_ctx, words", [
    (100, "a context of 100 tokens is too short"),
    (300, f"a context of 300 tokens is more than the {TRAINED} this model was trained on"),
])
def test_models_load_refuses_a_context_out_of_bounds(tiny_gguf, n_ctx, words):
    with pytest.raises((ContextSizeError, models.ModelPackError), match=words):
        models.load(str(tiny_gguf), backend="gguf", n_ctx=n_ctx)


def test_n_ctx_is_refused_where_a_model_runs_on_torch(tiny_gguf):
    with pytest.raises(ContextSizeError, match="runs on torch"):
        models.load(str(tiny_gguf), backend="torch", n_ctx=TRAINED)


def test_load_pair_gives_both_models_the_context():
    path = str(smollm2())
    pair = models.load_pair(path, path, backend="gguf", n_ctx=1024)
    assert pair.target.max_context == pair.draft.max_context == 1024


# ------------------------------------------------------------------------------------------------
# The command line


def test_ctx_size_is_an_option_of_generate_and_serve(capsys):
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            run_main([command, "--help"], capsys)
        shown = capsys.readouterr().out
        assert "-c N, --ctx-size N" in shown and "default: 4096" in shown and "340 MiB at 4096" in shown


def test_ctx_size_below_the_floor_is_refused_before_loading(capsys):
    code, _, err = run_main(["generate", "hello", "--target", "nowhere.gguf", "-c", "100"], capsys)
    assert code == 2
    assert_one_line_error(err, contains=f"argument -c/--ctx-size: expected a number of tokens >= {models.MIN_CONTEXT}")


def test_ctx_size_above_the_trained_context_is_one_line(tiny_gguf, capsys):
    code, _, err = run_main(["generate", "hello", "--target", str(tiny_gguf), "--draft", "none", "--backend", "gguf",
                             "--ctx-size", "300"], capsys)
    assert code == 1
    assert_one_line_error(err[err.index("specdec: error"):], contains=f"300 tokens is more than the {TRAINED}")
    assert f"hint: ask for {TRAINED} tokens or fewer (n_ctx={TRAINED}; --ctx-size {TRAINED})" in err


def test_generate_runs_in_the_context_asked_for(capsys):
    path = str(smollm2())
    code, out, err = run_main(["generate", "def add(a, b):", "--target", path, "--draft", path, "--backend", "gguf",
                               "-c", "300", "--max-new-tokens", "4", "--temperature", "0", "--json"], capsys)
    assert code == 0, err
    assert '"token_ids"' in out


def test_a_prompt_that_does_not_fit_is_refused_with_the_numbers(capsys):
    path = str(smollm2())
    prompt = " ".join(["word"] * 400)  # 400 tokens in SmolLM2's vocabulary
    code, _, err = run_main(["generate", prompt, "--target", path, "--draft", path, "--backend", "gguf",
                             "-c", "256", "--max-new-tokens", "32"], capsys)
    assert code == 2
    lines = err.strip().splitlines()[-2:]
    assert lines[0] == ("specdec: error: the prompt has 400 tokens and --max-new-tokens asks for 32 more, 432 in all, "
                        "but the context holds 256 tokens")
    assert lines[1] == "hint: shorten the prompt, or give --ctx-size 432 (the model was trained on 8192 tokens)"


def test_a_prompt_that_fills_the_trained_context_cannot_be_helped_by_ctx_size(tiny_gguf, capsys):
    code, _, err = run_main(["generate", "a" * 300, "--target", str(tiny_gguf), "--draft", "none", "--backend", "gguf",
                             "--max-new-tokens", "8"], capsys)
    assert code == 2
    assert "the prompt has 300 tokens and --max-new-tokens asks for 8 more, 308 in all, but the context holds 256" in err
    assert f"hint: shorten the prompt: the context is already the {TRAINED} tokens the model was trained on" in err


def test_serve_loads_its_slots_with_the_context(monkeypatch):
    from specdec.cli import commands, common

    seen = {}

    def load_pair(target, draft, **kwargs):
        seen.update(kwargs)
        raise models.ModelPackError("stop here", "a test")

    monkeypatch.setattr(models, "load_pair", load_pair)
    args = commands.build_parser().parse_args(["serve", "--backend", "gguf", "--ctx-size", "8192"])
    with pytest.raises(common.CLIError, match="stop here"):
        common.load_models_from(args)
    assert seen["n_ctx"] == 8192
