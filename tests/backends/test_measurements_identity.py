"""The keys of cached measurements: each backend's ``identity()`` gives, key for key, the dict that
reading its attributes gives (:func:`_probed_key`, a fixed copy of that rule: the key of the
measurements cached on this machine), so those measurements stay valid (specdec's GGUF kernel adds
the build of its library, whose speed is what was measured); and the one table of
backend names gives the lists the library, the CLI and the bench read."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import PACK, _gguf, _on_kernels, needs_kernel
from tiny import tiny_llama

from specdec import models, packs
from specdec.backends import gguf as native
from specdec.backends import table
from specdec.backends.hf import HFCausalLM
from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.backends.lean import LeanCausalLM
from specdec.backends.llamacpp import GGUFWeights, LlamaCppCausalLM
from specdec.cli import bench as bench_cli
from specdec.divergence import LogitsRecorder
from specdec.measurements import cost_key, machine


def _probed_key(model: Any) -> dict[str, Any]:
    """The cost key read from a backend's attributes alone (a fixed reference: cached keys have this form)."""
    key: dict[str, Any] = {
        "machine": machine(),
        "cores": os.cpu_count(),
        "backend": f"{type(model).__module__}.{type(model).__qualname__}",
    }
    own = getattr(model, "cost_key", None)
    if callable(own):
        return {**key, **own()}
    file = _model_file(model)
    if file is not None:  # e.g. a GGUF file in llama.cpp: the file is the model and its dtype
        stat = file.stat()
        threads = getattr(model, "n_threads", None) or torch.get_num_threads()
        return {**key, "model": file.name, "bytes": stat.st_size, "mtime": int(stat.st_mtime),
                "dtype": "as stored in the file", "threads": threads, "batch": getattr(model, "n_batch", None),
                "kv": getattr(model, "kv_type", None)}
    inner = getattr(model, "model", None)
    config = getattr(inner, "config", None)
    described = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    param = next(inner.parameters(), None) if hasattr(inner, "parameters") else None
    dtype = str(param.dtype).removeprefix("torch.") if param is not None else "unknown"
    weights = getattr(model, "weights", None)  # the lean backend's int8 copies
    return {
        **key,
        "model": str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", "unknown")),
        "config": hashlib.sha256(described.encode()).hexdigest()[:16],
        "dtype": dtype if weights in (None, "bf16") else f"{dtype}/{weights}",
        "threads": torch.get_num_threads(),
    }


def _model_file(model: Any) -> Path | None:
    for holder in (getattr(model, "weights", None), model):
        path = getattr(holder, "path", None)
        if isinstance(path, (str, Path)) and Path(path).is_file():
            return Path(path)
    return None


def _same_key(model: Any) -> dict[str, Any]:
    """``cost_key(model)``, asserted equal (same keys, same values) to :func:`_probed_key`'s."""
    key, probed = cost_key(model), _probed_key(model)
    assert list(key) == list(probed) and key == probed
    return key


def test_the_torch_backends_describe_themselves_as_their_attributes_did():
    model = tiny_llama(3, vocab=16)
    for backend in (HFCausalLM(model), HFCausalLM(model, keep_hidden=True), HFLayeredCausalLM(model)):
        assert callable(backend.identity)
        _same_key(backend)
    assert _same_key(HFCausalLM(tiny_llama(3, vocab=16).to(torch.bfloat16)))["dtype"] == "bfloat16"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert _same_key(HFCausalLM(model))["threads"] == threads + 1
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_the_lean_backend_describes_itself_as_its_attributes_did():
    model = _on_kernels(tiny_llama(3, vocab=16))
    assert _same_key(LeanCausalLM(model))["dtype"] == "bfloat16"
    assert _same_key(LeanCausalLM(model, keep_hidden=True, weights="int8"))["dtype"] == "bfloat16/int8"
    _same_key(LogitsRecorder(LeanCausalLM(model)))


def test_a_wrapper_that_passes_attributes_through_is_keyed_as_before():
    key = _same_key(LogitsRecorder(HFCausalLM(tiny_llama(3, vocab=16))))
    assert key["backend"] == "specdec.divergence.LogitsRecorder"


def test_a_causal_lm_that_does_not_describe_itself_is_probed(tmp_path):
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    for model in (SimpleNamespace(weights=SimpleNamespace(path=gguf), n_threads=2, n_batch=512),
                  SimpleNamespace(path=str(gguf)),
                  SimpleNamespace(model=tiny_llama(3, vocab=16), weights="int8"),
                  SimpleNamespace(weights=SimpleNamespace(path=tmp_path / "gone.gguf")),
                  object()):
        assert not hasattr(model, "identity")
        _same_key(model)


def test_smollm2_on_llamacpp_describes_itself_as_its_attributes_did():
    weights = GGUFWeights(_gguf())
    for model in (LlamaCppCausalLM(weights, n_threads=1), LlamaCppCausalLM(weights, n_threads=2, n_batch=64,
                                                                           kv_type="bf16")):
        key = _same_key(model)
        assert key["model"] == weights.path.name and key["kv"] == model.kv_type and key["batch"] == model.n_batch
        _same_key(LogitsRecorder(model))


def test_smollm2_on_the_gguf_kernel_describes_itself_as_its_attributes_did():
    pytest.importorskip("gguf")
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    path = packs.gguf_file(PACK, progress=False)
    try:
        model = native.load_gguf_native(path, n_threads=1, n_ctx=64)
    except native.KernelUnavailable as err:
        pytest.skip(f"the kernel cannot be built here: {err}")
    # the attributes' key, and the kernel library that runs it: measurements of another build of
    # the kernel (a changed source or flags) are not this one's
    # and the path it runs (each path's rows cost their own)
    key, probed = cost_key(model), _probed_key(model)
    kernel = Path(native.library()._name).stem
    assert key == {**probed, "kernel": kernel, "path": native.kernel_path()} and list(key) == [*probed, "kernel", "path"]
    assert kernel.startswith("linear_gguf-") and len(kernel.rsplit("-", 1)[1]) == 16  # the hash of source and flags
    assert key["model"] == path.name and (key["threads"], key["batch"], key["kv"]) == (1, None, None)
    assert cost_key(model.fork()) == key


def test_the_backend_lists_come_from_the_one_table():
    assert models.BACKENDS == ("auto", "torch", "llamacpp", "gguf")
    assert models.GGUF_BACKENDS == ("llamacpp", "gguf")
    assert models.BACKEND_LABELS == {"torch": "torch", "llamacpp": "llama.cpp", "gguf": "specdec's GGUF kernel"}
    assert table.NAMES == ("torch", "llamacpp", "gguf") and table.GGUF_NAMES == ("llamacpp", "gguf")
    assert bench_cli.BACKEND_CHOICES == {"torch": ("torch",), "llamacpp": ("llamacpp",), "gguf": ("gguf",),
                                         "both": ("torch", "llamacpp"), "gguf+llamacpp": ("gguf", "llamacpp")}
    assert list(bench_cli.BACKEND_CHOICES) == ["torch", "llamacpp", "gguf", "both", "gguf+llamacpp"]
    assert [b.name for b in table.TABLE if b.runs_gguf] == list(models.GGUF_BACKENDS)
