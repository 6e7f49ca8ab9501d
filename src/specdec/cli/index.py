"""``specdec index PATH...``: tokenize files into a retrieval datastore (:mod:`specdec.datastore`)
that ``--drafter retrieval`` (or ``retrieval+model``) drafts from with ``--datastore NAME``.

Every text file under the paths (folders recursively, hidden entries and binary or non-UTF-8
files skipped) is one document, tokenized with the target's tokenizer (``--model``). The store is
written to ``<cache>/datastores/<NAME>.npz`` (``--name``, a name, not a path; default: the first
path's name) or to the file ``--output`` names.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from specdec import models
from specdec.datastore import SUFFIX, Datastore, store_path
from specdec.cli.common import CLIError, check_cache_dir, positive_int

MAX_FILE_BYTES = 8 << 20  # larger files are skipped (data, not text a model would repeat)


def add_index_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "index", help="tokenize files into a datastore for the retrieval drafter",
        description="Tokenize the text files under PATH... (folders recursively) into a retrieval datastore "
                    "that --drafter retrieval or retrieval+model searches (--datastore NAME).",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to index")
    parser.add_argument("--name", default=None,
                        help="the store's name, what --datastore takes: the store is <cache>/datastores/NAME.npz "
                             "(default: the first path's name; to write a file elsewhere use --output)")
    parser.add_argument("--output", default=None, metavar="FILE",
                        help="write the store to this .npz file instead of the cache")
    parser.add_argument("--model", default=models.DEFAULT_TARGET, metavar="MODEL",
                        help=f"whose tokenizer: a pack name, a Hugging Face model directory or a .gguf file "
                             f"(default: {models.DEFAULT_TARGET}; use the target you will decode with)")
    parser.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                        help="keep at most N tokens, the files read last kept (default: all)")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help=f"the cache the store is written to (default: ${models.CACHE_ENV} or ~/.cache/specdec)")
    parser.set_defaults(func=run_index)


def run_index(args: argparse.Namespace) -> int:
    check_cache_dir(args.cache_dir, create=True)
    roots = [Path(p).expanduser() for p in args.paths]
    for root in roots:
        if not root.exists():
            raise CLIError(f"no such file or folder: {root}", "give files or folders to index", 2)
    if args.name is not None:
        check_name(args.name)
    name = args.name or _default_name(roots[0])
    out = Path(args.output).expanduser() if args.output else store_path(name, args.cache_dir)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.model, args.cache_dir)
    store = Datastore(args.max_tokens)
    files = skipped = 0
    for path in text_files(roots):
        text = _read_text(path)
        if text is None:
            skipped += 1
            continue
        store.add(tokenizer(text, add_special_tokens=False)["input_ids"])
        files += 1
    if not files:
        raise CLIError(f"no text files under {', '.join(map(str, roots))}", "point at files or folders of text", 1)
    store.meta = {"model": args.model, "vocab_size": len(tokenizer), "files": files}
    store.save(out)
    seconds = time.perf_counter() - t0
    print(f"specdec: indexed {files} files ({len(store)} tokens; {skipped} skipped) with the {args.model} "
          f"tokenizer in {seconds:.1f} s into {out}")
    named = name if not args.output else str(out) if store_path(str(out)) == out else os.path.join(".", str(out))
    print(f"use it with: specdec generate ... --drafter retrieval+model --datastore {named}", file=sys.stderr)
    return 0


def check_name(name: str) -> None:
    """A store's name is a name: the store is ``<cache>/datastores/<name>.npz``. A path (a
    separator, ``..``), a name ending in ``.npz`` or starting with a dot is refused
    (:class:`CLIError`), since :func:`~specdec.datastore.store_path` would take it for a file."""
    separators = [sep for sep in (os.sep, os.altsep, "/") if sep]
    if not name.strip():
        why = "is empty"
    elif any(sep in name for sep in separators):
        why = "is a path, not a name"
    elif name.startswith("."):
        why = "starts with a dot"
    elif name.endswith(SUFFIX):
        why = f"ends in {SUFFIX}"
    else:
        return
    raise CLIError(f"--name {name!r} {why}: the store is <cache>/datastores/NAME{SUFFIX}, so NAME is a plain name",
                   f"give a name of letters, digits, '-' and '_' (e.g. --name docs), or write the store to a file "
                   f"with --output FILE{SUFFIX}", 2)


def _default_name(root: Path) -> str:
    """The store's name when ``--name`` is not given: the first path's name, less leading dots and
    the ``.npz`` suffix (``corpus`` if nothing is left)."""
    return root.resolve().name.lstrip(".").removesuffix(SUFFIX) or "corpus"


def text_files(roots: list[Path]) -> Iterator[Path]:
    """Every file under ``roots`` (a root that is a file is itself), hidden entries skipped, in name order."""
    for root in roots:
        if root.is_file():
            yield root
            continue
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root).parts
            if path.is_file() and not any(part.startswith(".") for part in rel):
                yield path


def _read_text(path: Path) -> str | None:
    """The file's text, or None for a binary, non-UTF-8, empty or oversized file."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        data = path.read_bytes()
    except OSError:
        return None
    if not data or b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def load_tokenizer(name_or_path: str, cache_dir: str | None) -> Any:
    """The tokenizer of a pack (read from its GGUF), a Hugging Face model directory or a .gguf file."""
    try:
        return models.load_tokenizer(name_or_path, cache_dir)
    except models.ModelPackError as err:
        raise CLIError(err.message, err.hint, 2) from None
