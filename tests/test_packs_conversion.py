"""Converting a pack to bf16 safetensors, one tensor at a time: the same weights, bit for bit, as
transformers' own loading of the GGUF in bf16 (the route the conversion took before, holding the
whole model in float32), and what the conversion says before and while it runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec import packs, tokenizers
from helpers import make_fake_pack, write_tiny_gguf


def _direct(folder, name):
    """The model as transformers loads the GGUF itself, in bf16."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16, local_files_only=True).eval()


def _assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    different = [name for name in sa if not torch.equal(sa[name], sb[name])]
    assert not different, different[:5]


@pytest.mark.parametrize("tie", [True, False])
def test_rows_converted_in_slices_are_the_rows_converted_whole(tmp_path, monkeypatch, tie):
    """With slices of 64 values (two rows of the tiny model), every tensor is written in many
    pieces, and no model is loaded; the saved weights still equal transformers' own bf16 load of
    the GGUF."""
    from transformers import AutoModelForCausalLM

    pack = make_fake_pack(tmp_path, monkeypatch, tie=tie)
    monkeypatch.setattr(packs, "CONVERT_ROWS", 64)
    pieces = []
    real = packs._bf16_blocks
    monkeypatch.setattr(packs, "_bf16_blocks", lambda *a: (pieces.append(b.shape) or b for b in real(*a)))
    with monkeypatch.context() as during:  # the conversion never builds the model in memory
        during.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: pytest.fail("loaded the model"))
        folder = packs.convert(pack, tmp_path / "cache", progress=False)
    assert len(pieces) > 100 and max(shape.numel() for shape in pieces) <= 64
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, local_files_only=True)
    _assert_same_weights(converted, _direct(tmp_path, "whole.gguf"))
    assert converted.config.tie_word_embeddings is tie


def test_a_weight_the_gguf_lacks_stops_the_conversion(tmp_path):
    """A model that needs a weight the GGUF does not hold (here an untied output head, where the
    file ties it) is refused by name, not written with that weight left out."""
    from transformers import AutoConfig

    write_tiny_gguf(tmp_path / "m.gguf", tie=True)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="m.gguf", local_files_only=True)
    config.tie_word_embeddings = False
    with pytest.raises(RuntimeError, match=r"m.gguf lacks 1 weight the model needs, e.g. lm_head.weight"):
        packs.write_bf16_safetensors(tmp_path / "m.gguf", config, tmp_path / "model.safetensors")


def test_the_conversion_says_what_it_will_take_before_it_starts(tmp_path, monkeypatch, capfd):
    pack = dataclasses.replace(make_fake_pack(tmp_path, monkeypatch), bf16_size=3_550_000_000, convert_seconds=150)
    monkeypatch.setitem(packs.PACKS, pack.name, pack)
    packs.convert(pack, tmp_path / "cache")
    lines = capfd.readouterr().err.splitlines()
    first = next(i for i, line in enumerate(lines) if "first use" in line)
    assert lines[first] == (f"specdec: tiny-pack: first use, converting its GGUF to bf16 safetensors in "
                            f"{tmp_path / 'cache' / 'tiny-pack'}, once (about 2 minutes on 2 cores, "
                            f"{(3_550_000_000 + pack.size) / 1e9:.1f} GB of disk; later loads read the copy)")
    later = "\n".join(lines[first + 1:])
    assert "joining 3 parts" in later and "reading the tokenizer and configuration" in later
    assert "writing bf16 weights" in later and "tiny-pack: converted in" in later


@pytest.mark.slow
def test_smollm2_converted_one_tensor_at_a_time_has_transformers_own_weights_and_logits(tmp_path):
    """SmolLM2 is a llama GGUF (a Q8_0 embedding, Q4_1 layers, query and key rows that transformers
    un-permutes per head, a tied head): the converted copy holds the very tensors, and gives the
    very logits, of transformers' own bf16 load of the GGUF; its tokenizer encodes as the GGUF's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pack = packs.PACKS["smollm2-135m"]
    if packs.missing_parts(pack):
        pytest.skip(f"pack smollm2-135m is not installed: {pack.install_command()}")
    folder = packs.convert(pack, tmp_path, progress=False)
    gguf = packs.gguf_file(pack, progress=False)
    direct = _direct(gguf.parent, gguf.name)
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, local_files_only=True).eval()
    _assert_same_weights(converted, direct)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tokenizers.fix_gguf_tokenizer(reference, gguf)
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"
    assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    assert (tokenizer.eos_token, tokenizer.bos_token) == (reference.eos_token, reference.bos_token)
    ids = torch.tensor([tokenizer(text)["input_ids"][:12]])
    with torch.inference_mode():
        assert torch.equal(converted(ids).logits, direct(ids).logits)
    assert converted.generation_config.eos_token_id == list(pack.eos_token_ids)
    assert converted.config.architectures == ["LlamaForCausalLM"] and converted.config.tie_word_embeddings


def test_the_metadata_reader_gives_transformers_the_fields_gguf_reader_gives(tmp_path):
    """Every field of a GGUF file (scalars, a string, arrays of strings, of integers, of floats, of
    booleans) reads the same through the one-pass metadata reader as through gguf's own reader:
    the same types, the same ``contents()``, and the same values as transformers parses them."""
    import gguf
    from transformers.integrations.ggml import _gguf_parse_value

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    writer = gguf.GGUFWriter(str(tmp_path / "arrays.gguf"), "qwen2")
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.strings", ["", "é", "a b"])
    writer.add_array("test.empty", [])
    writer.add_string("test.string", "ünïcode")
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    for file in (path, tmp_path / "arrays.gguf"):
        ours, theirs = tokenizers._metadata_reader(file), gguf.GGUFReader(str(file))
        assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 5
        for name, field in theirs.fields.items():
            mine = ours.fields[name]
            assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
            assert mine.contents() == field.contents(), name
            parse = [_gguf_parse_value(f.parts[i], f.types) for f in (mine, field) for i in f.data]
            assert parse[:len(mine.data)] == parse[len(mine.data):], name
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert tokenizers._metadata_reader(path).fields["tokenizer.ggml.merges"].contents() == ["Ġ t", "h e", "Ġt he"]


def test_a_gguf_tokenizer_is_transformers_own_built_from_the_file_read_once(tmp_path, monkeypatch):
    """``tokenizer_from_gguf`` gives what transformers builds from the file, and parses the file's
    metadata once however many times transformers opens it."""
    import gguf
    from transformers import AutoTokenizer

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    made = []
    real = tokenizers._metadata_reader
    monkeypatch.setattr(tokenizers, "_metadata_reader", lambda p: made.append(p) or real(p))
    ours = tokenizers.tokenizer_from_gguf(path)
    assert len(made) == 1
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    tokenizers.fix_gguf_tokenizer(theirs, path)
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader  # the stand-in is gone after the block
    text = "the cat<|im_end|> then  the"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"] and len(ours(text)["input_ids"]) > 3
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert (ours.eos_token, ours.pad_token, ours.bos_token) == (theirs.eos_token, theirs.pad_token, theirs.bos_token)
