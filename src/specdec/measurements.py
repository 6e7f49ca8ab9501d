"""Measurements of this machine, kept between runs: what a measurement is keyed by and where it lives.

Each thing specdec measures once and reuses -- the planner's row-cost curves
(:func:`specdec.policies.costs.row_costs`), llama.cpp's prefill weight layout
(:func:`specdec.backends.llamacpp.choose_prefill_layout`), a backend's batch invariance
(:func:`batch_invariance`) -- is keyed by :func:`cost_key` (the machine, the
backend, the model and its dtype, the threads) and kept as JSON at :func:`cache_file` of that key,
written atomically (:func:`specdec.paths.save_measurement`). This module sits below the backends
and imports no other part of specdec but :mod:`specdec.paths`.
"""

from __future__ import annotations

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
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


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
