"""What weights a benchmark run computed with, in the words of its results' header: a GGUF's
architecture and file type as llama.cpp names them, read from the file's header alone."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Sequence

from specdec.backends.table import GGUF, GGUF_NAMES, LABELS, LLAMACPP, TORCH
from specdec.bench.methods import MethodSpec


# llama.cpp's names of the K-quant mixes (llama_model_ftype_name); other file types go by their own name.
_MIXES = {"S": "Small", "M": "Medium", "L": "Large", "XS": "Extra Small", "XXS": "Extra Extra Small"}


def gguf_weights(path: str | Path | None, model: Any = None) -> str | None:
    """A GGUF's weights as llama.cpp describes them: a loaded llama.cpp model's own description
    (``model.weights.description``, e.g. 'qwen2 1.5B Q4_K - Medium'), else the architecture and file
    type read from the file's header (e.g. 'qwen2 Q4_K - Medium'); None when neither can be read."""
    described = getattr(getattr(model, "weights", None), "description", None)
    if described:
        return str(described)
    if path is None:
        return None
    try:
        meta = _gguf_metadata(Path(path), ("general.architecture", "general.file_type"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if "general.file_type" not in meta:
        return None
    from gguf import LlamaFileType

    code = int(meta["general.file_type"]) & ~1024  # LLAMA_FTYPE_GUESSED
    try:
        name = LlamaFileType(code).name.removeprefix("MOSTLY_")
    except ValueError:
        name = f"file type {code}"
    if name == "ALL_F32":
        name = "all F32"
    elif name == "Q2_K":
        name = "Q2_K - Medium"
    elif "_K_" in name and name.rsplit("_", 1)[1] in _MIXES:
        base, mix = name.rsplit("_", 1)
        name = f"{base} - {_MIXES[mix]}"
    return " ".join(str(x) for x in (meta.get("general.architecture"), name) if x)


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_metadata(path: Path, keys: Sequence[str]) -> dict[str, Any]:
    """The scalar and string values of ``keys`` in a GGUF file's header (v2 or later), read until
    all are found: a few kilobytes, where the ``gguf`` package's reader maps every tensor."""
    wanted, found = set(keys), {}
    with open(path, "rb") as f:
        def read(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: the GGUF header ends early")
            return struct.unpack(fmt, data)[0]

        def text() -> str:
            return f.read(read("<Q")).decode("utf-8")

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(read("<Q"), 1)
            elif kind == 9:
                item, count = read("<I"), read("<Q")
                if item in _GGUF_SCALARS:
                    f.seek(count * struct.calcsize(_GGUF_SCALARS[item]), 1)
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _GGUF_SCALARS:
                f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF" or read("<I") < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        read("<Q")  # tensors
        for _ in range(read("<Q")):
            key, kind = text(), read("<I")
            if key in wanted and (kind == 8 or kind in _GGUF_SCALARS):
                found[key] = text() if kind == 8 else read(_GGUF_SCALARS[kind])
                if len(found) == len(wanted):
                    break
            else:
                skip(kind)
    return found


def run_weights(methods: Sequence[MethodSpec], dtype: str | None, models: dict[str, Any]) -> str:
    """What the run's methods computed with, for the results' header: the torch dtype where a
    method ran on transformers' weights, the GGUF's weights as llama.cpp describes them where one
    ran on llama.cpp (its peers and servers included), both when both ran."""
    backends = {m.backend for m in methods}
    parts = []
    if TORCH in backends or not backends:
        parts.append(f"{dtype} on torch" if backends & set(GGUF_NAMES) else str(dtype))
    for backend, where in ((LLAMACPP, f"via {LABELS[LLAMACPP]}"), (GGUF, f"on {LABELS[GGUF]}")):
        if backend not in backends:
            continue
        info = models.get(backend) or models.get(LLAMACPP) or {}  # servers on the kernel: the same files
        target, draft = info.get("target_weights"), info.get("draft_weights")
        if target and draft and draft != target:
            parts.append(f"{target} GGUF (draft: {draft}) {where}")
        else:
            parts.append(f"{target} GGUF {where}" if target else f"GGUF {where}")
    return " and ".join(parts)
