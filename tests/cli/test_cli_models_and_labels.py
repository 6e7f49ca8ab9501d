"""What the CLI says about models: ``specdec models`` lists what is prepared for each backend
(paths that exist, or "not yet"); a GGUF loaded by llama.cpp is described by the parameter count of
its tensors; ``--logprobs`` shows each token's text beside its id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import _gguf, make_fake_pack, run_main
from helpers import tiny  # noqa: F401  (tiny: a fixture)

from specdec import packs
from specdec.backends import llamacpp


def rows_of(capsys, cache: Path) -> dict[str, dict]:
    code, out, err = run_main(["models", "--cache-dir", str(cache), "--json"], capsys)
    assert code == 0, err
    return {row["name"]: row for row in json.loads(out)}


def test_models_shows_the_joined_gguf_once_it_is_made_and_not_yet_before(tmp_path, monkeypatch, capsys):
    pack = make_fake_pack(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    before = rows_of(capsys, cache)[pack.name]
    assert before["prepared"] == {"gguf": None, "torch": None}
    code, out, _ = run_main(["models", "--cache-dir", str(cache)], capsys)
    line = next(line for line in out.splitlines() if line.startswith(pack.name))
    assert "not yet (joined into the cache on first use)" in line and "not yet (converted on first use" in line
    assert str(cache) not in line  # no folder that does not exist

    joined = packs.gguf_file(pack, cache, progress=False)  # what the GGUF backends run
    after = rows_of(capsys, cache)[pack.name]
    assert after["prepared"] == {"gguf": str(joined), "torch": None} and joined.is_file()
    code, out, _ = run_main(["models", "--cache-dir", str(cache)], capsys)
    line = next(line for line in out.splitlines() if line.startswith(pack.name))
    assert str(joined) in line and "not yet (converted on first use" in line


def test_models_shows_the_bf16_conversion_once_it_is_made(tmp_path, monkeypatch, capsys):
    pack = make_fake_pack(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    folder = packs.convert(pack, cache, progress=False)
    row = rows_of(capsys, cache)[pack.name]
    assert row["prepared"]["torch"] == str(folder) and folder.is_dir()


def test_an_installed_single_file_pack_runs_its_installed_file(capsys, tmp_path):
    pack = packs.PACKS["smollm2-135m"]
    if packs.missing_parts(pack):
        pytest.skip("the smollm2-135m pack is not installed")
    row = rows_of(capsys, tmp_path)[pack.name]
    assert row["prepared"]["gguf"] == str(pack.parts[0].locate()) and Path(row["prepared"]["gguf"]).is_file()


@pytest.mark.parametrize("count, label", [(27_072, "27K"), (999_400, "999K"), (999_600, "1M"), (134_515_008, "135M"), (494_032_768, "494M"), (999_400_000, "999M"),
                                          (999_600_000, "1.0B"), (1_543_714_304, "1.5B"), (7_615_616_512, "7.6B")])
def test_a_parameter_count_is_written_as_people_write_it(count, label):
    assert llamacpp.params_label(count) == label


def test_llamacpps_size_class_gives_way_to_the_files_parameter_count():
    assert llamacpp.describe("qwen2 1B Q4_K - Medium", 494_032_768) == "qwen2 494M Q4_K - Medium"
    assert llamacpp.describe("llama 256M Q4_1", 134_515_008) == "llama 135M Q4_1"


def test_a_gguf_on_llamacpp_is_described_by_its_tensors():
    weights = llamacpp.GGUFWeights(_gguf())
    assert weights.n_params == 134_515_008
    assert weights.description == "llama 135M Q4_1"


def test_logprobs_show_each_tokens_text_beside_its_id(tiny, capsys):
    from specdec.models import load_tokenizer

    code, out, err = run_main(["generate", "hello", "--target", tiny["target"], "--draft", "none",
                               "--max-new-tokens", "4", "--logprobs", "2", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    tokenizer = load_tokenizer(tiny["target"])
    assert [lp["token"] for lp in report["logprobs"]] == report["token_ids"]
    for lp in report["logprobs"]:
        assert lp["text"] == tokenizer.decode([lp["token"]])
        assert len(lp["top"]) == 2
        for token, logprob, text in lp["top"]:
            assert isinstance(token, int) and logprob <= 0 and text == tokenizer.decode([token])
