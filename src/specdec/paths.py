"""Where specdec keeps things on disk, and the key a model's files are kept under.

Everything lives under one cache directory (:func:`cache_root`): converted model packs, the
compiled kernel, searched layer-skip sets. This module imports nothing from the rest of the
package, so any module may use it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

CACHE_ENV = "SPECDEC_CACHE"
DEFAULT_CACHE = "~/.cache/specdec"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache directory: ``cache_dir`` if given, else ``$SPECDEC_CACHE``, else ``~/.cache/specdec``."""
    chosen = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return Path(chosen).expanduser()


def model_key(model: Any) -> str:
    """A readable key for a transformers model: the last part of its path or name plus its shape
    (``<name>-<layers>x<hidden>``). Files made for one model (a searched skip set, shipped heads)
    are kept under it."""
    config = model.config
    name = os.path.basename(str(getattr(config, "_name_or_path", "") or "").rstrip("/\\"))
    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or config.model_type
    return f"{name}-{config.num_hidden_layers}x{config.hidden_size}"


def load_measurement(path: Path, key: Any, version: int) -> dict | None:
    """What :func:`save_measurement` wrote to ``path``, if it is there, readable, and was measured
    for ``key`` in format ``version``; else None (measure again)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(saved, dict) and saved.get("format") == version and saved.get("key") == key
    return saved if ok else None


def save_measurement(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (:func:`write_atomic`), creating its folder.
    A cache that cannot be written is not an error: the measurement is only repeated next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, indent=1))
    except OSError:
        pass


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder renamed over it, so
    a reader (or a later run, after an interrupt) sees the old file or the new one, never a part."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
