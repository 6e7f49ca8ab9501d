"""A draft model's layers in fewer bits: a GGUF whose larger block-quantized layer tensors are
requantized once, kept in the cache, and loaded like any other GGUF.

On the GGUF kernel a draft token's layers sit on the memory floor (their bytes over the read
speed; docs/drafters.md, "What a draft token costs"): the only way to make them cheaper is to
read fewer bytes. The default draft (Qwen2.5-Coder 0.5B) keeps most of its layers in Q5_0
(5.5 bits a weight); the same tensors in Q4_0 (4.5 bits) read 18% fewer bytes. What this trades
is agreement, not exactness: the draft only proposes, the target's verification keeps the
output the target's own, whatever the draft's weights (the tests check it token for token).

Only the layers' tensors of the 32-weight block types with more bits than the asked type are
requantized (Q5_0, Q5_1, Q8_0, through gguf-py's reference quantizer: each block dequantized to
fp32, then quantized as llama.cpp's ``quantize`` does without an importance matrix); the
embedding, the output head (a trimmed head keeps its own rows), norms and the k-quant tensors
stay as the file has them, and every metadata field is copied unchanged. Made once per source
file (its path, size and modification time) and kept under ``requantized/`` in the cache.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from specdec.paths import cache_root

FORMAT_VERSION = 1
FORMATS = ("q4_0",)  # what a draft's layers may be requantized to
_SOURCE_TYPES = ("Q5_0", "Q5_1", "Q8_0")  # requantized where the file has them: 32-weight blocks of more bits


def check_format(name: object) -> str | None:
    """``name`` as :func:`requantized` takes it: None (the file's own types) or one of
    :data:`FORMATS` (any case). Raises ``ValueError`` naming the choices."""
    if name is None:
        return None
    text = str(name).strip().lower()
    if text not in FORMATS:
        raise ValueError(f"draft_quant takes one of {', '.join(FORMATS)} (or nothing: the file's own types), got {name!r}")
    return text


def cached_path(source: Path, to: str, cache_dir: str | Path | None = None) -> Path:
    """Where the requantized copy of ``source`` is kept: keyed by its resolved path, size and
    modification time, so a changed file is requantized again."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{to}|{FORMAT_VERSION}".encode())
    return cache_root(cache_dir) / "requantized" / f"{source.stem}.{to}.{key.hexdigest()[:16]}.gguf"


def requantized(source: str | Path, to: str, cache_dir: str | Path | None = None,
                note: Callable[[str], None] | None = None) -> Path:
    """The path of ``source`` with its layers' Q5_0, Q5_1 and Q8_0 tensors in ``to`` (made now
    if the cache does not hold it; ``note`` hears one line when it does). A file with no such
    tensor is returned as it is. Raises ``ValueError`` for an unknown format."""
    import gguf  # the GGUF reader and writer, and the reference quantizer

    to = check_format(to)
    source = Path(source)
    target_type = gguf.GGMLQuantizationType[to.upper()]
    reader = gguf.GGUFReader(str(source))
    change = {t.name for t in reader.tensors
              if t.name.startswith("blk.") and t.tensor_type.name in _SOURCE_TYPES and len(t.shape) > 1}
    if not change:
        return source
    out = cached_path(source, to, cache_dir)
    if out.is_file():
        return out
    if note is not None:
        note(f"requantizing {len(change)} layer tensors of {source.name} to {to.upper()} (once; kept in {out.parent})")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".part", dir=out.parent)
    os.close(fd)
    try:
        write_converted(reader, Path(tmp), dict.fromkeys(change, target_type))
        os.replace(tmp, out)  # whole or not at all: another process may be writing the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def write_converted(reader: "gguf.GGUFReader", out: Path, types: Mapping[str, Any]) -> None:
    """Write the GGUF ``reader`` reads to ``out``, every metadata field and tensor as it is but the
    tensors named in ``types``, each dequantized to fp32 and quantized to its type there."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch=str(reader.fields["general.architecture"].contents()),
                             endianess=reader.endianess)
    for field in reader.fields.values():  # every key but the ones the writer writes itself
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    datas = []
    for t in reader.tensors:
        data, kind = np.asarray(t.data), t.tensor_type
        if t.name in types:
            kind = types[t.name]
            data = gguf.quants.quantize(gguf.quants.dequantize(data, t.tensor_type).reshape(t.data.shape[0], -1), kind)
        datas.append(data)
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in datas:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
