"""``backend="auto"`` for a GGUF: specdec's batch-invariant kernel wherever it runs the file,
llama.cpp only where it does not, chosen by rule (nothing measured), with the reason said; and what
the CLI says of llama.cpp's output when it runs a model."""

from __future__ import annotations

import json

import gguf
import pytest

from specdec import models, packs
from specdec.backends import choice
from specdec.backends import gguf as native
from specdec.backends import llamacpp
from specdec.backends.table import BY_NAME

PACK = "smollm2-135m"
CAVEAT = BY_NAME["llamacpp"].caveat


def smollm2_path():
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    return packs.gguf_file(PACK, progress=False)


def need_llamacpp():
    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")


@pytest.fixture
def llamacpp_faster(monkeypatch, tmp_path):
    """llama.cpp installed and, were anything timed, faster at every row count; measurements kept in
    a folder of this test, which must stay empty: the choice measures nothing."""
    from specdec.measurements import CACHE_ENV

    folder = tmp_path / "measurements"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    monkeypatch.setattr(choice, "_measure", lambda *a, **k: {"gguf": [1.0, 2.0], "llamacpp": [0.1, 0.2]}, raising=False)
    yield
    assert not folder.exists() or not any(folder.iterdir())


def test_the_kernel_runs_a_file_it_runs_even_where_llamacpp_would_be_faster(llamacpp_faster):
    result = choice.choose_gguf_backend(smollm2_path())
    assert result == {"backend": "gguf", "source": "rule", "why": choice.KERNEL_WHY}
    assert result["why"] == ("specdec's GGUF kernel: it runs this file, and its rows are batch-invariant, so greedy "
                             "and seeded output is plain decoding's token for token")


def test_without_avx2_the_kernel_runs_its_portable_path_and_says_so(monkeypatch, llamacpp_faster):
    """The portable C path gives the AVX2 path's bits (tests/test_gguf_native.py): exact, only slower."""
    monkeypatch.setattr(native, "uses_avx2", lambda: False)
    result = choice.choose_gguf_backend(smollm2_path())
    assert (result["backend"], result["source"]) == ("gguf", "rule")
    assert result["why"] == choice.KERNEL_WHY + choice.PORTABLE_WHY
    assert "portable C path" in result["why"] and "--backend llamacpp" in result["why"]


def test_without_llamacpp_the_kernel_runs_it(monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    result = choice.choose_gguf_backend(smollm2_path())
    assert (result["backend"], result["why"]) == ("gguf", choice.KERNEL_WHY)


def write_header_only(path, arch: str) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_the_kernel_cannot_run_goes_to_llamacpp_with_its_caveat_or_to_torch(monkeypatch, llamacpp_faster,
                                                                                   tmp_path):
    path = tmp_path / "gemma.gguf"
    write_header_only(path, "gemma")
    result = choice.choose_gguf_backend(path)
    assert (result["backend"], result["source"]) == ("llamacpp", "rule")
    assert result["why"].startswith("llama.cpp: ") and "architecture 'gemma'" in result["why"]
    assert result["why"].endswith(f"; {CAVEAT}")
    assert "near-ties" in CAVEAT and "cached prompt" in CAVEAT
    assert "--backend llamacpp" not in result["why"]  # the hint is for users who named the kernel
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    fallback = models.backend_choice(str(path), "auto")
    assert fallback["backend"] == "torch" and fallback["why"].startswith("torch: llama.cpp is not installed (")
    assert f"{llamacpp.INSTALL} adds it" in fallback["why"]  # the one line that names what to install


def test_the_choice_takes_no_thread_count_and_keeps_no_measurement():
    import inspect

    assert list(inspect.signature(choice.choose_gguf_backend).parameters) == ["path"]
    assert not hasattr(choice, "CHOICE_FORMAT") and not hasattr(choice, "_measure")


def test_load_pair_runs_both_models_on_the_kernel(llamacpp_faster):
    smollm2_path()
    pair = models.load_pair(PACK, PACK, backend="auto", n_threads=1)
    assert (pair.backend, pair.draft_backend) == ("gguf", "gguf")
    assert type(pair.target) is native.GGUFCausalLM and type(pair.draft) is native.GGUFCausalLM
    assert pair.backend_why == choice.KERNEL_WHY


def test_a_named_backend_says_what_may_differ_from_plain_decoding():
    smollm2_path()
    assert models.backend_choice(PACK, "gguf")["why"] == "asked for"
    assert models.backend_choice(PACK, "llamacpp")["why"] == f"asked for; {CAVEAT}"


def test_generate_says_where_and_why(llamacpp_faster, capsys):
    smollm2_path()
    from specdec.cli import main

    code = main(["generate", "def f(x):", "--target", PACK, "--draft", "none", "--threads", "1",
                 "--max-new-tokens", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"specdec: {PACK} runs on {choice.KERNEL_WHY}" in err.splitlines()
    report = json.loads(out)
    assert report["backend"] == {"name": "gguf", "why": choice.KERNEL_WHY, "kernel_path": native.kernel_path()}
    assert report["exact"] and report["token_identical"] is True
    assert report["weights"].endswith(f"GGUF on specdec kernels ({report['backend']['kernel_path']} path)")


def test_generate_on_llamacpp_says_output_may_differ_from_plain_decoding(capsys):
    need_llamacpp()
    smollm2_path()
    from specdec.cli import main

    code = main(["generate", "def f(x):", "--target", PACK, "--draft", "none", "--threads", "1", "--backend",
                 "llamacpp", "--max-new-tokens", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"specdec: {PACK} runs on llama.cpp (asked for; {CAVEAT})" in err.splitlines()
    report = json.loads(out)
    assert report["backend"] == {"name": "llamacpp", "why": f"asked for; {CAVEAT}"}
    assert report["exact"] and report["token_identical"] is False


def test_the_table_says_what_each_backend_runs():
    """Each row's capabilities are its models' (torch: what the wrapper a drafter needs offers),
    and only the kernel shares its passes between sequences."""
    from specdec.backends.base import HIDDEN_STATES, LAYERS, TREES
    from specdec.backends.hf_layers import HFLayeredCausalLM
    from specdec.backends.table import GGUF, LLAMACPP, TABLE, TORCH

    assert BY_NAME[GGUF].capabilities == native.GGUFCausalLM.capabilities
    assert BY_NAME[LLAMACPP].capabilities == llamacpp.LlamaCppCausalLM.capabilities
    assert BY_NAME[TORCH].capabilities == {TREES, HIDDEN_STATES} | HFLayeredCausalLM.capabilities == {
        TREES, HIDDEN_STATES, LAYERS}
    assert [b.name for b in TABLE if b.shares_passes] == [GGUF]
    assert [b.name for b in TABLE if b.weights is None] == [TORCH]
