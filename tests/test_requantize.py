"""A draft's layers requantized (:mod:`specdec.requantize`, ``load_pair(draft_quant=...)``,
``--draft-quant``): the copy changes exactly the layers' Q5_0/Q5_1/Q8_0 tensors, each to what the
reference quantizer makes of it, keeps every other byte and field, is made once per source file,
and a draft run from it leaves greedy and seeded answers plain decoding's, token for token (a tiny
model; one run on Gemma-3-270M whose layers hold Q5_0 and Q8_0 tensors).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants

from specdec import DecodeConfig, generate, generate_many, models, packs, requantize

from helpers import THREADS, load_pair_arguments, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_q5(tmp_path_factory):
    """A tiny qwen2 GGUF whose layers' matrices are Q5_0 (attention) and Q8_0 (the MLP), as a
    downloaded draft's are: made from the float32 one by the same writer."""
    root = tmp_path_factory.mktemp("requantize")
    plain = root / "tiny-f32.gguf"
    write_tiny_gguf(plain, tie=False, seed=1)
    reader = GGUFReader(str(plain))
    kinds = {t.name: (T.Q8_0 if ".ffn_" in t.name else T.Q5_0) for t in reader.tensors
             if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) > 1}
    out = root / "tiny-q5.gguf"
    requantize.write_converted(reader, out, kinds)
    return out


def types_of(path):
    return {t.name: t.tensor_type for t in GGUFReader(str(path)).tensors}


def test_the_copy_changes_exactly_the_layers_block_tensors_and_keeps_every_field(tiny_q5, tmp_path):
    out = requantize.requantized(tiny_q5, "Q4_0", tmp_path)
    assert out.parent == tmp_path / "requantized" and out.name.startswith("tiny-q5.q4_0.")
    before, after = GGUFReader(str(tiny_q5)), GGUFReader(str(out))
    changed = 0
    for old, new in zip(before.tensors, after.tensors, strict=True):
        assert old.name == new.name and list(old.shape) == list(new.shape)
        if old.tensor_type in (T.Q5_0, T.Q8_0):
            assert new.tensor_type == T.Q4_0
            expected = quants.quantize(quants.dequantize(np.asarray(old.data), old.tensor_type), T.Q4_0)
            assert np.array_equal(np.asarray(new.data), expected)
            changed += 1
        else:  # norms, biases, the embedding and the output head: byte for byte
            assert new.tensor_type == old.tensor_type and np.array_equal(np.asarray(new.data), np.asarray(old.data))
    assert changed == 2 * 7  # two layers: q, k, v, o, gate, up, down
    assert {k: f.contents() for k, f in before.fields.items() if not k.startswith("GGUF.")} == \
        {k: f.contents() for k, f in after.fields.items() if not k.startswith("GGUF.")}
    assert not list(out.parent.glob("*.part"))


def test_it_is_made_once_per_source_file_and_again_when_the_file_changes(tiny_q5, tmp_path, monkeypatch):
    first = requantize.requantized(tiny_q5, "q4_0", tmp_path)
    notes = []
    monkeypatch.setattr(requantize, "write_converted", lambda *a: pytest.fail("written again"))
    assert requantize.requantized(tiny_q5, "q4_0", tmp_path, note=notes.append) == first and not notes
    monkeypatch.undo()
    stat = tiny_q5.stat()
    os.utime(tiny_q5, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = requantize.requantized(tiny_q5, "q4_0", tmp_path, note=notes.append)
    assert second != first and second.is_file() and len(notes) == 1 and "requantizing 14 layer tensors" in notes[0]


def test_a_file_without_such_tensors_is_used_as_it_is_and_a_wrong_format_is_named(tmp_path):
    plain = tmp_path / "tiny-f32.gguf"
    write_tiny_gguf(plain)
    assert requantize.requantized(plain, "q4_0", tmp_path) == plain
    assert not (tmp_path / "requantized").exists()
    for bad in ("q4_k", "Q2", "", 4):
        with pytest.raises(ValueError, match="draft_quant takes one of q4_0"):
            requantize.check_format(bad)
    assert requantize.check_format(" Q4_0 ") == "q4_0" and requantize.check_format(None) is None


def test_load_pair_refuses_it_where_the_draft_is_the_target_or_runs_on_torch(tiny_q5, tmp_path):
    with pytest.raises(models.ModelPackError, match="is the target"):
        models.load_pair(str(tiny_q5), str(tiny_q5), backend="gguf", n_threads=THREADS, draft_quant="q4_0",
                         cache_dir=tmp_path)
    located = models.locate(str(tiny_q5), tmp_path)
    with pytest.raises(models.ModelPackError, match="run the draft on backend 'gguf'"):
        models.requantized_draft(located, str(tiny_q5), "q4_0", "torch", "some-target")
    with pytest.raises(ValueError, match="draft_quant takes one of"):
        models.load_pair(str(tiny_q5), str(tiny_q5), backend="gguf", draft_quant="int4")


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_the_commands_take_draft_quant_and_pass_it_to_the_pair(command, monkeypatch):
    from specdec.cli import commands, common

    parser = commands.build_parser()
    prompt = ["def f(x):"] if command == "generate" else []
    parse = lambda *extra: parser.parse_args([command, *prompt, *extra])  # noqa: E731
    assert parse("--draft-quant", "Q4_0").draft_quant == "q4_0"
    assert parse().draft_quant is None
    with pytest.raises(common.CLIError, match="invalid choice: 'q4_k' \\(choose from 'q4_0'\\)"):
        parse("--draft-quant", "q4_k")
    if command == "bench":
        return
    assert load_pair_arguments(parse("--backend", "gguf", "--draft-quant", "q4_0"), monkeypatch)["draft_quant"] == "q4_0"


PROMPT = [5, 17, 99, 3, 42, 7, 120]


def test_a_tiny_requantized_draft_leaves_answers_plain_decodings(tiny_q5, tmp_path):
    pair = models.load_pair(str(tiny_q5), None, backend="gguf", n_threads=THREADS, n_ctx=256, cache_dir=tmp_path)
    draft = models.load_model(models.requantized_draft(models.locate(str(tiny_q5), tmp_path), "draft", "q4_0",
                                                       "gguf", "target"), "gguf", n_threads=THREADS, n_ctx=256)
    assert {t.name for t in draft.weights.reader.tensors if t.tensor_type == T.Q4_0}  # it is the copy
    config = DecodeConfig.parse("spec:model:block:k=4:policy=static")
    for options in (dict(), dict(temperature=0.9, sampler="gumbel", seed=5)):
        plain = generate(pair.target, PROMPT, max_new_tokens=30, eos_token_ids=[], **options)
        mine = generate(pair.target, PROMPT, draft=draft, config=config, max_new_tokens=30, eos_token_ids=[], **options)
        assert mine.token_ids == plain.token_ids and mine.stats.drafted_tokens > 0


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    pack = packs.PACKS["gemma3-270m"]
    if packs.missing_parts(pack):
        pytest.skip("pack gemma3-270m is not installed")
    cache = tmp_path_factory.mktemp("gemma-requantized")
    located = models.locate("gemma3-270m")
    copy = requantize.requantized(located.path, "q4_0", cache)
    return models.load_pair("gemma3-270m", str(copy), backend="gguf", n_threads=THREADS, n_ctx=512)


def test_gemma_with_its_layers_requantized_drafts_for_itself_and_answers_stay_plain_decodings(gemma):
    kinds = {t.tensor_type for t in gemma.draft.weights.reader.tensors if t.name.startswith("blk.")}
    assert T.Q4_0 in kinds and T.Q5_0 not in kinds and T.Q8_0 not in kinds
    config = DecodeConfig.parse("spec:model:block:k=4:policy=static")
    prompts = ["The capital of France is", "def add(a, b):\n"]
    for options in (dict(), dict(temperature=0.8, sampler="gumbel", seed=11)):
        for prompt in prompts:
            plain = generate(gemma.target, prompt, tokenizer=gemma.tokenizer, max_new_tokens=32, **options)
            mine = generate(gemma.target, prompt, draft=gemma.draft, tokenizer=gemma.tokenizer, config=config,
                            max_new_tokens=32, **options)
            assert mine.token_ids == plain.token_ids
            assert mine.stats.accepted_tokens > 0  # the requantized copy still agrees with its original
    together = generate_many(gemma.target, prompts, draft=gemma.draft, tokenizer=gemma.tokenizer,
                             configs=[config, config], max_new_tokens=24)
    for prompt, result in zip(prompts, together):
        assert result.token_ids == generate(gemma.target, prompt, tokenizer=gemma.tokenizer,
                                            max_new_tokens=24).token_ids
