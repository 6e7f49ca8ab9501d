"""The environment of a benchmark run: versions, CPU, threads, the source's commit and the models,
what a reader needs to reproduce its figures."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from importlib.metadata import version
from pathlib import Path
from typing import Any

from specdec import kernels
from specdec.backends.lean import lean_unsupported
from specdec.backends.table import GGUF
from specdec.bench.weights import gguf_weights
from specdec.measurements import machine


def environment(command: str, dtype: str) -> dict[str, Any]:
    """Versions, CPU, threads, dtype and the exact command: what a reader needs to reproduce."""
    import numpy
    import torch
    import transformers

    return {
        "command": command,
        "dtype": dtype,
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {
            "specdec": version("specdec"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": numpy.__version__,
            "llama_cpp_python": _version("llama-cpp-python"),
        },
        "git": _git(),
        "cpu": machine(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "fast_bf16_kernel": kernels.status(),
    }


def gguf_info(backends: Any, backend: str) -> dict[str, Any]:
    """The GGUFs the methods and peers of the GGUF ``backend`` run (``backends``: the run's
    :class:`~specdec.bench.runner.BenchBackends`), their weights as llama.cpp describes them
    (:func:`gguf_weights`), their threads, and the weight layout its models prefill on
    (:func:`specdec.backends.llamacpp.choose_prefill_layout`)."""
    files, pair = backends.ggufs[backend], backends.pairs.get(backend)
    loaded = {"target": pair.target, "draft": pair.draft} if pair is not None else {}
    layouts = {role: getattr(model, "prefill_choice", None) for role, model in loaded.items() if model is not None}
    # specdec's GGUF kernel describes its weights otherwise: the file's header says it as llama.cpp does
    described = {} if backend == GGUF else loaded
    target, draft = files.target.path, files.draft.path if files.draft is not None else None
    return {"target_gguf": str(target),
            "draft_gguf": str(draft) if draft else None,
            "target_weights": gguf_weights(target, described.get("target")),
            "draft_weights": gguf_weights(draft, described.get("draft")) if draft else None,
            "threads": backends.n_threads,
            "prefill_layout": layouts or None}


def model_info(model: Any, name: str | None) -> dict[str, Any] | None:
    if model is None:
        return None
    return {
        "name": name,
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
        "linear_kernels": kernels.describe_model(model),
        "backend": "lean" if lean_unsupported(model) is None else f"transformers ({lean_unsupported(model)})",
    }


def _version(distribution: str) -> str | None:
    """An installed distribution's version, None if it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _git() -> dict[str, Any] | None:
    try:
        root = Path(__file__).resolve().parent
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
