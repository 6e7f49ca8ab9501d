"""``backend="auto"`` for a GGUF: the kernel or llama.cpp, as measured here, with the reason said."""

from __future__ import annotations

import json

import gguf
import pytest

from specdec import models, packs
from specdec.backends import choice
from specdec.backends import gguf as native
from specdec.backends import llamacpp

PACK = "smollm2-135m"


def smollm2_path():
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    return packs.gguf_file(PACK, progress=False)


def need_llamacpp():
    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Replace the timing with given seconds (choices cached in a folder of this test); counts how often it ran."""
    from specdec.measurements import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "measurements"))
    calls = []

    def use(seconds):
        def fake(path, n_threads):
            calls.append(path)
            return seconds
        monkeypatch.setattr(choice, "_measure", fake)
        return calls
    return use


@pytest.mark.parametrize("kernel, other, expected", [
    ([0.010, 0.020], [0.012, 0.030], "gguf"),  # cheaper at both row counts
    ([0.010, 0.020], [0.010, 0.020], "gguf"),  # a tie: no slower
    ([0.013, 0.020], [0.012, 0.030], "llamacpp"),  # a plain step would be slower
    ([0.010, 0.031], [0.012, 0.030], "llamacpp"),  # a verification pass would be slower
])
def test_the_choice_follows_the_measurement_and_is_cached(kernel, other, expected, measured, tmp_path):
    need_llamacpp()
    path = smollm2_path()
    calls = measured({"gguf": kernel, "llamacpp": other})
    first = choice.choose_gguf_backend(path, n_threads=1, cache_dir=tmp_path)
    assert (first["backend"], first["source"]) == (expected, "measured")
    assert first["why"].startswith("specdec's GGUF kernel: no slower" if expected == "gguf" else
                                   "llama.cpp: specdec's GGUF kernel is slower")
    assert f"1 row {1e3 * kernel[0]:.1f} ms against {1e3 * other[0]:.1f} ms" in first["why"]
    again = choice.choose_gguf_backend(path, n_threads=1, cache_dir=tmp_path)
    assert (again["backend"], again["source"], len(calls)) == (expected, "cache", 1)
    other_threads = choice.choose_gguf_backend(path, n_threads=2, cache_dir=tmp_path)  # another key: measured again
    assert (other_threads["source"], len(calls)) == ("measured", 2)


def test_a_real_measurement_times_both_backends(tmp_path):
    need_llamacpp()
    result = choice.choose_gguf_backend(smollm2_path(), n_threads=1, cache_dir=tmp_path)
    seconds = result["seconds"]
    assert set(seconds) == {"gguf", "llamacpp"} and all(len(v) == len(choice.ROWS) for v in seconds.values())
    assert all(v > 0 for times in seconds.values() for v in times)
    wins = all(k <= o for k, o in zip(seconds["gguf"], seconds["llamacpp"]))
    assert result["backend"] == ("gguf" if wins else "llamacpp")


def test_without_llamacpp_the_kernel_runs_it(monkeypatch, measured, tmp_path):
    calls = measured({"gguf": [1.0, 1.0], "llamacpp": [0.1, 0.1]})
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    result = choice.choose_gguf_backend(smollm2_path(), cache_dir=tmp_path)
    assert (result["backend"], result["source"], calls) == ("gguf", "rule", [])
    assert "llama.cpp binding is not installed" in result["why"]


def test_without_avx2_llamacpp_runs_it(monkeypatch, measured, tmp_path):
    need_llamacpp()
    calls = measured({"gguf": [0.1, 0.1], "llamacpp": [1.0, 1.0]})
    monkeypatch.setattr(native, "uses_avx2", lambda: False)
    result = choice.choose_gguf_backend(smollm2_path(), cache_dir=tmp_path)
    assert (result["backend"], result["source"], calls) == ("llamacpp", "rule", [])
    assert result["why"] == "llama.cpp: this CPU lacks AVX2, FMA or F16C, where specdec's GGUF kernel runs only its " \
                            "portable C path"


def write_header_only(path, arch: str) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_the_kernel_cannot_run_goes_to_llamacpp_or_torch(monkeypatch, measured, tmp_path):
    calls = measured({"gguf": [0.1, 0.1], "llamacpp": [1.0, 1.0]})
    path = tmp_path / "gemma.gguf"
    write_header_only(path, "gemma")
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    result = choice.choose_gguf_backend(path, cache_dir=tmp_path)
    assert (result["backend"], result["source"], calls) == ("llamacpp", "rule", [])
    assert result["why"].startswith("llama.cpp: ") and "architecture 'gemma'" in result["why"]
    assert "--backend llamacpp" not in result["why"]  # the hint is for users who named the kernel
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    fallback = models.backend_choice(str(path), "auto")
    assert fallback["backend"] == "torch" and fallback["why"].startswith("torch: llama.cpp is not installed and ")


@pytest.mark.parametrize("faster", ["gguf", "llamacpp"])
def test_load_pair_runs_the_target_where_the_choice_says(faster, measured):
    need_llamacpp()
    smollm2_path()
    slow, fast = [1.0, 2.0], [0.5, 1.0]
    measured({"gguf": fast if faster == "gguf" else slow, "llamacpp": fast if faster == "llamacpp" else slow})
    pair = models.load_pair(PACK, PACK, backend="auto", n_threads=1)
    expected = native.GGUFCausalLM if faster == "gguf" else llamacpp.LlamaCppCausalLM
    assert (pair.backend, pair.draft_backend) == (faster, faster)
    assert type(pair.target) is expected and type(pair.draft) is expected
    assert pair.backend_why == choice.choose_gguf_backend(smollm2_path(), n_threads=1)["why"]
    named = models.load_pair(PACK, None, backend="llamacpp", n_threads=1)
    assert (named.backend, named.backend_why) == ("llamacpp", "asked for")


def test_generate_says_where_and_why(measured, capsys):
    need_llamacpp()
    smollm2_path()
    measured({"gguf": [0.5, 1.0], "llamacpp": [1.0, 2.0]})
    from specdec.cli import main

    code = main(["generate", "def f(x):", "--target", PACK, "--draft", "none", "--threads", "1",
                 "--max-new-tokens", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    why = choice.choose_gguf_backend(smollm2_path(), n_threads=1)["why"]
    assert f"specdec: {PACK} runs on {why}" in err.splitlines()
    report = json.loads(out)
    assert report["backend"] == {"name": "gguf", "why": why}
    assert report["weights"].endswith("GGUF on specdec kernels")
