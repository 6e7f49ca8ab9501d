"""Measurements of this machine, kept between runs: what a measurement is keyed by and where it lives.

Each thing specdec measures once and reuses -- the planner's row-cost curves
(:func:`specdec.costs.row_costs`), llama.cpp's prefill weight layout
(:func:`specdec.backends.llamacpp.choose_prefill_layout`), a backend's batch invariance
(:func:`batch_invariance`) -- is keyed by :func:`cost_key` (the machine, the
backend, the model and its dtype, the threads) and kept as JSON at :func:`cache_file` of that key,
written atomically (:func:`specdec.paths.save_measurement`). This module sits below the backends
and imports no other part of specdec but :mod:`specdec.paths`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from specdec.paths import cache_root, load_measurement, save_measurement

CACHE_ENV = "SPECDEC_PLANNER_CACHE"  # a folder for measurements alone (tests point it elsewhere)


def cost_key(model: Any) -> dict[str, Any]:
    """What a cost curve depends on: the machine, the backend's class, and what the backend says
    it runs (its :meth:`~specdec.backends.base.CausalLM.identity`: the model, its dtype, the threads).

    A CausalLM without ``identity()`` is described by :func:`probed_identity`.
    """
    key: dict[str, Any] = {
        "machine": machine(),
        "cores": os.cpu_count(),
        "backend": f"{type(model).__module__}.{type(model).__qualname__}",
    }
    identity = getattr(model, "identity", None)
    return {**key, **(identity() if callable(identity) else probed_identity(model))}


def file_identity(path: str | Path, threads: int, batch: int | None = None, kv: str | None = None) -> dict[str, Any]:
    """The identity of a backend that runs a weights file (a GGUF): the file's name, size and
    modification time (its quantisation is in it), the threads, and the backend's batch size and
    KV cache type where it has them."""
    stat = Path(path).stat()
    return {"model": Path(path).name, "bytes": stat.st_size, "mtime": int(stat.st_mtime),
            "dtype": "as stored in the file", "threads": threads, "batch": batch, "kv": kv}


def torch_identity(model: Any, weights: Any = None) -> dict[str, Any]:
    """The identity of a backend that runs a transformers ``model``: its name (or type), a hash of
    its whole config, its parameters' dtype (followed by ``/<weights>`` for weights other than
    ``None`` or ``"bf16"``, e.g. the lean backend's int8 copies) and torch's thread count."""
    config = getattr(model, "config", None)
    described = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    param = next(model.parameters(), None) if hasattr(model, "parameters") else None
    dtype = str(param.dtype).removeprefix("torch.") if param is not None else "unknown"
    return {
        "model": str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", "unknown")),
        "config": hashlib.sha256(described.encode()).hexdigest()[:16],
        "dtype": dtype if weights in (None, "bf16") else f"{dtype}/{weights}",
        "threads": torch.get_num_threads(),
    }


def probed_identity(model: Any) -> dict[str, Any]:
    """The identity of a CausalLM that does not describe itself (no ``identity()``: a test double,
    a backend written outside specdec), read from the attributes specdec's own backends have.

    A backend that names a weights file (``weights.path`` or ``path``) is keyed by the file
    (:func:`file_identity`) with its ``n_threads`` (else torch's thread count), ``n_batch`` and
    ``kv_type``; any other by its ``model`` attribute as a transformers model and its ``weights``
    (:func:`torch_identity`).
    """
    file = _model_file(model)
    if file is not None:
        threads = getattr(model, "n_threads", None) or torch.get_num_threads()
        return file_identity(file, threads, getattr(model, "n_batch", None), getattr(model, "kv_type", None))
    return torch_identity(getattr(model, "model", None), getattr(model, "weights", None))


def _model_file(model: Any) -> Path | None:
    """The weights file a backend runs, where it names one (``model.weights.path`` or ``model.path``)."""
    for holder in (getattr(model, "weights", None), model):
        path = getattr(holder, "path", None)
        if isinstance(path, (str, Path)) and Path(path).is_file():
            return Path(path)
    return None


def machine() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), else what platform says."""
    return _cpuinfo_field(_cpuinfo(), "model name") or platform.processor() or platform.machine() or "unknown"


# The vector features that set a CPU's matrix-product speed (the names /proc/cpuinfo gives them)
# and how a report names them: the GGUF kernel's AVX2 path needs the first three, llama.cpp's
# native build also uses the AVX-512 and VNNI ones.
CPU_FEATURES = {"avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX-512F", "avx512bw": "AVX-512BW",
                "avx512vl": "AVX-512VL", "avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI",
                "avx512_bf16": "AVX512-BF16", "amx_int8": "AMX-INT8"}


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The instruction-set flags of the CPU (the first ``flags`` line of ``cpuinfo``, by default
    /proc/cpuinfo's); empty where there is none (another OS, an ARM CPU). The one place specdec
    reads them for its reports; the GGUF kernel chooses its path from what the CPU itself reports
    (``gguf_cpu_paths`` in csrc/linear_gguf.c), not from these."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    return frozenset((_cpuinfo_field(text, "flags") or "").split())


def cpu_features(cpuinfo: str | None = None) -> dict[str, bool] | None:
    """Each of :data:`CPU_FEATURES` (by its /proc/cpuinfo name): whether the CPU has it; None where
    no flags are known (no /proc/cpuinfo, or a CPU that lists none)."""
    flags = cpu_flags(cpuinfo)
    return {name: name in flags for name in CPU_FEATURES} if flags else None


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> str:
    """/proc/cpuinfo's text, read once ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _cpuinfo_field(text: str, name: str) -> str | None:
    """The value of the first ``name : value`` line of /proc/cpuinfo's ``text``, None if none."""
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip().lower() == name:
            return value.strip()
    return None


def cache_file(key: dict[str, Any], cache_dir: str | Path | None = None) -> Path:
    """Where the curve for ``key`` is kept: ``<folder>/<hash of the key>.json``, the folder being
    ``<cache_dir>/planner`` if ``cache_dir`` is given, else ``$SPECDEC_PLANNER_CACHE``, else
    ``planner`` under the cache directory (``$SPECDEC_CACHE`` or ``~/.cache/specdec``)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    folder = os.environ.get(CACHE_ENV) if cache_dir is None else None
    return (Path(folder).expanduser() if folder else cache_root(cache_dir) / "planner") / f"{digest}.json"


INVARIANCE_ROWS = (2, 4, 8, 16)  # pass lengths compared with one-token steps: a chain's verify passes
INVARIANCE_FORMAT = 1


def batch_invariance(model: Any, *, cache_dir: str | Path | None = None, refresh: bool = False) -> dict[str, Any]:
    """Whether ``model`` computes in one pass of n tokens the very logits (bit for bit) of n
    one-token steps, for each n in :data:`INVARIANCE_ROWS`: ``{"invariant": all of them,
    "rows": {n: bool}, "source": "measured" | "cache"}``.

    Measured on fixed token ids after an 8-token context, once per machine, model, backend and
    threads (the planner's cost key), and cached beside the planner's cost curves. Leaves the
    model's cache empty.
    """
    key = {**cost_key(model), "what": "batch invariance", "rows": list(INVARIANCE_ROWS)}
    path = cache_file(key, cache_dir)
    saved = None if refresh else load_measurement(path, key, INVARIANCE_FORMAT)
    if saved is not None and isinstance(saved.get("rows"), dict):
        rows = {int(n): bool(v) for n, v in saved["rows"].items()}
        return {"invariant": all(rows.values()), "rows": rows, "source": "cache"}
    longest = max(INVARIANCE_ROWS)
    ids = [(17 + 7919 * i) % model.vocab_size for i in range(8 + longest)]
    model.trim(0)
    model.forward(ids[:8])
    steps = torch.cat([model.forward([t]) for t in ids[8:]])  # [longest, V]
    rows = {}
    for n in INVARIANCE_ROWS:
        model.trim(8)
        rows[n] = bool(torch.equal(model.forward(ids[8 : 8 + n]), steps[:n]))
    model.trim(0)
    save_measurement(path, {"format": INVARIANCE_FORMAT, "key": key, "rows": rows})
    return {"invariant": all(rows.values()), "rows": rows, "source": "measured"}
