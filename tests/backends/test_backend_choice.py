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
    """The portable C path gives the AVX2 path's bits (tests/backends/test_gguf_native.py): exact, only slower."""
    monkeypatch.setattr(native, "kernel_path", lambda lib=None: "portable")
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


def test_a_file_the_kernel_cannot_run_goes_to_llamacpp_with_its_caveat(llamacpp_faster, tmp_path):
    path = tmp_path / "gemma.gguf"
    write_header_only(path, "gemma")
    result = choice.choose_gguf_backend(path)
    assert (result["backend"], result["source"]) == ("llamacpp", "rule")
    assert result["why"].startswith("llama.cpp: ") and "architecture 'gemma'" in result["why"]
    assert result["why"].endswith(f"; {CAVEAT}")
    assert "near-ties" in CAVEAT and "cached prompt" in CAVEAT
    assert "--backend llamacpp" not in result["why"]  # the hint is for users who named the kernel


def test_a_file_neither_backend_runs_here_is_refused_with_the_binding_to_install(monkeypatch, tmp_path, capsys):
    """Without llama.cpp's binding, ``auto`` on a GGUF the kernel does not run says in one line to
    install the binding; it never starts a transformers conversion. ``--backend torch`` still
    takes the file to transformers, asked for by name."""
    path = tmp_path / "gemma.gguf"
    write_header_only(path, "gemma")
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model that cannot run here"))
    with pytest.raises(models.ModelPackError) as refused:
        models.choose_backend(models.locate(str(path)), "auto")
    assert refused.value.message == (f"{path}: architecture 'gemma' is not one specdec's GGUF backend runs "
                                     f"({', '.join(native.ARCHITECTURES)}); llama.cpp's binding (llama-cpp-python), "
                                     "which would run it, is not installed")
    assert refused.value.hint == choice.INSTALL_HINT
    assert choice.INSTALL_HINT.startswith("install llama.cpp's binding: pip install llama-cpp-python==0.3.36 ")
    with pytest.raises(models.ModelPackError, match="which would run it, is not installed"):
        models.load(str(path), backend="auto")
    assert models.check_backend(str(path), "torch")  # a GGUF, taken to transformers by name
    assert models.choose_backend(models.locate(str(path), backend="torch"), "torch") == {
        "backend": "torch", "why": "asked for", "source": "asked for"}

    from specdec.cli import main

    code = main(["generate", "x", "--target", str(path), "--draft", "none"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.splitlines() == [f"specdec: error: {refused.value.message}", f"hint: {choice.INSTALL_HINT}"]


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


def test_a_named_backend_says_what_may_differ_from_plain_decoding(monkeypatch):
    smollm2_path()
    monkeypatch.setattr(llamacpp, "available", lambda: True)  # named, llama.cpp needs its binding
    located = models.locate(PACK)
    for backend in ("gguf", "llamacpp"):
        assert models.check_backend(PACK, backend)
    assert models.choose_backend(located, "gguf")["why"] == "asked for"
    assert models.choose_backend(located, "llamacpp")["why"] == f"asked for; {CAVEAT}"


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
    assert [b.name for b in TABLE if b.batch_invariant] == [TORCH, GGUF]
    assert [b.module for b in TABLE] == [None, "specdec.backends.llamacpp", "specdec.backends.gguf"]


def test_a_loaded_model_is_asked_its_capabilities_through_its_row(tmp_path):
    """A model says which row it runs on; its row answers whether its passes may be shared and what
    one sequence's cache takes. A transformers model (or anything that declares no row) is torch's."""
    from helpers import tiny_pair, write_tiny_gguf
    from specdec.backends import table
    from specdec.backends.table import GGUF, LLAMACPP, TORCH

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path)
    kernel = BY_NAME[GGUF].load(path, n_threads=1, n_ctx=256)  # the row loads its own models
    assert type(kernel) is native.GGUFCausalLM and kernel.max_context == 256
    assert table.row_of(kernel) is BY_NAME[GGUF] and table.row_of(kernel.fork()) is BY_NAME[GGUF]
    assert table.row_of(llamacpp.LlamaCppCausalLM) is BY_NAME[LLAMACPP]
    target, draft = tiny_pair()
    assert table.row_of(target) is BY_NAME[TORCH]
    assert table.shares_passes(kernel) and table.shares_passes(kernel, kernel.fork())
    assert not table.shares_passes(target) and not table.shares_passes(kernel, draft)
    assert not table.shares_passes(target, kernel)
    assert table.cache_bytes(kernel) == kernel.cache_bytes > 0
    assert table.cache_bytes(target) is None
    with pytest.raises(ValueError, match="runs no GGUF file of its own"):
        BY_NAME[TORCH].load(path)


def test_a_backend_is_available_where_its_module_says(monkeypatch):
    from specdec.backends.table import GGUF, LLAMACPP, TORCH

    monkeypatch.setattr(llamacpp, "available", lambda: False)
    assert [BY_NAME[name].available() for name in (TORCH, LLAMACPP, GGUF)] == [True, False, True]
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    assert BY_NAME[LLAMACPP].available()


# ------------------------------------------------------------------------------------------------
# The kernel's path as the environment asks for it


@pytest.fixture
def ask_path(monkeypatch):
    """``ask_path(value, paths=None)``: $SPECDEC_GGUF_PATH set to ``value`` before the native library
    is opened afresh, on a CPU that runs ``paths`` (None: this CPU's own). The path the process ran
    before is put back afterwards (every copy of the library shares it)."""
    lib = native.library()
    was = lib.gguf_path()

    def ask(value: str, paths: list[str] | None = None) -> None:
        monkeypatch.setattr(native, "_libraries", {})
        monkeypatch.setattr(native, "_asked_by", None)
        monkeypatch.delenv(native.PORTABLE_ENV, raising=False)
        monkeypatch.setenv(native.PATH_ENV, value)
        if paths is not None:
            monkeypatch.setattr(native, "available_paths", lambda lib=None: list(paths))

    yield ask
    lib.gguf_set_path(was)


@pytest.mark.parametrize("value, paths, message", [
    ("banana", None, "$SPECDEC_GGUF_PATH='banana' names no path of specdec's GGUF kernel (it takes portable, avx2, "
                     "avx512vnni, avxvnni, amx; this CPU runs "),
    # a CPU with AVX2 and no AVX-512 VNNI, whatever this one has
    ("avx512vnni", ["portable", "avx2"], "$SPECDEC_GGUF_PATH=avx512vnni: this CPU (or this build) cannot run the GGUF "
                                         "kernel's avx512vnni path; it runs portable, avx2"),
])
def test_a_path_asked_for_and_not_had_is_an_error_naming_the_variable(ask_path, value, paths, message, tmp_path,
                                                                      monkeypatch, capsys):
    """Not a fallback to another backend (another greedy text, and under --parallel a hint to
    --backend gguf): the error names the variable and the paths it takes."""
    from helpers import write_tiny_gguf
    from specdec.cli import main

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path)
    ask_path(value, paths)
    for backend in ("gguf", "auto"):  # auto: before any model loads
        if backend == "auto":
            monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model on another path"))
        with pytest.raises(models.ModelPackError) as refused:
            models.load(str(path), backend=backend)
        assert refused.value.message.startswith(message)
        assert refused.value.hint.startswith("unset $SPECDEC_GGUF_PATH (and $SPECDEC_GGUF_PORTABLE) to run the best "
                                             "path this CPU has")
    for command in (["generate", "x"], ["serve", "--parallel", "4"]):
        code = main([*command, "--target", str(path), "--draft", "none"])
        err = capsys.readouterr().err
        assert code == 1 and "Traceback" not in err and "--backend gguf" not in err
        assert err.splitlines()[0].startswith(f"specdec: error: {message}") and len(err.splitlines()) == 2


def test_a_path_asked_for_runs_and_the_reason_says_who_chose_the_portable_one(ask_path, monkeypatch):
    """$SPECDEC_GGUF_PATH=portable: the reason says the variable chose it (not that the CPU lacks
    AVX2, FMA or F16C); a vector path asked for runs as asked, with the plain reason."""
    path = smollm2_path()
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    ask_path("portable")
    result = choice.choose_gguf_backend(path)
    assert native.kernel_path() == "portable"
    assert result == {"backend": "gguf", "source": "rule", "why": choice.KERNEL_WHY + choice.PORTABLE_ASKED_WHY.format(
        asked="$SPECDEC_GGUF_PATH=portable")}
    assert "$SPECDEC_GGUF_PATH=portable asks for the kernel's portable C path" in result["why"]
    assert "lacks" not in result["why"]
    if "avx2" not in native.available_paths():
        pytest.skip("this CPU lacks AVX2/FMA/F16C: only the portable path runs")
    ask_path("AVX2", ["portable", "avx2"])  # any AVX2 CPU has it; the name in any case
    assert choice.choose_gguf_backend(path)["why"] == choice.KERNEL_WHY
    assert native.kernel_path() == "avx2" and native.path_asked_by() == "$SPECDEC_GGUF_PATH=AVX2"


def test_a_path_refused_once_is_refused_every_time(ask_path):
    """The library is kept only once the path asked for runs: a second call does not quietly run
    the best path."""
    ask_path("banana")
    for _ in range(2):
        with pytest.raises(native.PathUnavailable, match="names no path"):
            native.library()


# ------------------------------------------------------------------------------------------------
# The llama.cpp backend without its binding


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"]])
def test_llamacpp_by_name_without_the_binding_is_one_line(command, monkeypatch, tmp_path, capsys):
    from helpers import write_tiny_gguf
    from specdec.cli import main

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path)
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model without its backend"))
    code = main([*command, "--target", str(path), "--draft", "none", "--backend", "llamacpp"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.splitlines() == [
        "specdec: error: the llama.cpp backend needs llama.cpp's binding (llama-cpp-python), which is not installed",
        f"hint: {llamacpp.INSTALL} (it compiles llama.cpp: about 6 minutes on 2 cores), or run the file on specdec's "
        "own kernel: --backend gguf (or auto)"]


def test_llamacpp_whose_binding_does_not_import_is_a_pack_error(monkeypatch, tmp_path):
    from helpers import write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path)

    def broken():
        error = llamacpp.LlamaCppUnavailable("the llama.cpp backend needs the llama-cpp-python binding")
        error.reason = "libllama.so: cannot open shared object file"
        raise error

    monkeypatch.setattr(llamacpp, "available", lambda: True)
    monkeypatch.setattr(llamacpp, "_api", broken)
    with pytest.raises(models.ModelPackError) as refused:
        models.load(str(path), backend="llamacpp")
    assert refused.value.message == ("the llama.cpp backend needs llama.cpp's binding (llama-cpp-python), which does "
                                     "not import here (libllama.so: cannot open shared object file)")



def test_the_probe_repacks_nothing(monkeypatch):
    """auto's probe reads the file and checks the kernel runs it; repacking the weights (seconds for
    the default pair, thrown away) is the load's work, done once there."""
    path = smollm2_path()
    monkeypatch.setattr(native, "repack", lambda *a, **k: pytest.fail("the probe repacked a tensor"))
    assert choice.kernel_refusal(path) is None
