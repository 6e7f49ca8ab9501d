"""A retrieval datastore: token sequences searched by suffix, for drafting from a corpus (He et al.
2023, REST) and from a server's earlier outputs (Oliaro et al. 2024, SuffixDecoding).

A :class:`Datastore` holds documents (token-id sequences, oldest first). :meth:`Datastore.lookup`
finds the longest suffix of a context (up to :data:`MAX_MATCH` tokens) that occurs in them and
returns the tokens that followed its occurrences, most recent first; :func:`continuation_trie`
counts how often each continuation followed, the ranking the retrieval drafter proposes from.

The index is a suffix array over the *reversed* concatenation of the documents (a separator -1
between them, so no match crosses two documents). Reversed, a context's suffix read backwards is a
prefix of a suffix, so the suffix-array ranges of the suffixes of length 1, 2, 3, ... nest: each
longer match narrows the previous range by one token, a binary search over one column. Only the
first :data:`MAX_MATCH` tokens of each suffix decide the order, so the array is built by prefix
doubling in numpy in about log2(MAX_MATCH) sorts. It is written here rather than taken from a
suffix-array package (pydivsufsort, pysais): their full-depth arrays would be searched the same
way, would still be rebuilt as outputs arrive, and would add a compiled dependency for a sort
numpy does to the depth needed in about a second for a million tokens. Documents added later (a
server's outputs) go to a second index, rebuilt at the first lookup after they arrive, and are
merged into the main one once they exceed :data:`RECENT_TOKENS` or a quarter of the main index
(on a 2-core CPU, sorting 32k random tokens took 11 ms of CPU, 262k 0.2 s and 1M 1.2 s;
repetitive text takes a few more rounds).

With ``max_tokens`` the store keeps at most that many tokens, dropping the oldest documents (down
to nine tenths of the bound, so evictions come in batches). A store is saved as one ``.npz`` file
(the tokens and the main index) under ``<cache>/datastores/`` (:func:`store_path`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from specdec.paths import cache_root

MAX_MATCH = 32  # the longest context suffix matched (and the depth the suffix array sorts to)
SEPARATOR = -1  # between documents: never a token, so no match or continuation crosses it
_END = -2  # past the end of the reversed corpus (sorts before every token, as "no token" does)
_SCAN = 4096  # ranges at most this long are narrowed by one vectorised gather, longer ones by bisection
_BLOCK = 64  # at most this many occurrences left: the rest of the match is found in one comparison
RECENT_TOKENS = 1 << 16  # the most tokens the second index holds before a merge (and its least, 4096)
FORMAT = 1  # the saved file's layout
SUFFIX = ".npz"


def suffix_array(seq: np.ndarray, depth: int = MAX_MATCH) -> np.ndarray:
    """The start positions of ``seq``'s suffixes ([n] int64) sorted by their first ``depth`` tokens
    (ties in any order; a suffix that ends sorts before its extensions). Prefix doubling: each
    round sorts by (rank of the first k tokens, rank of the next k) until k >= depth or all ranks
    differ."""
    n = len(seq)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(seq, return_inverse=True)[1].astype(np.int64).reshape(-1)  # [n], dense from 0
    sa = np.argsort(rank, kind="stable")
    k = 1
    while k < depth and int(rank.max()) < n - 1:
        nxt = np.full(n, -1, dtype=np.int64)
        nxt[: n - k] = rank[k:]
        sa = np.lexsort((nxt, rank))
        r, x = rank[sa], nxt[sa]
        new = np.empty(n, dtype=np.int64)
        new[sa] = np.concatenate(([0], np.cumsum((r[1:] != r[:-1]) | (x[1:] != x[:-1]))))
        rank = new
        k *= 2
    return sa


class SuffixIndex:
    """A suffix array over one reversed concatenation of documents (see the module doc).

    tokens: [L] int32, documents joined and each ended by :data:`SEPARATOR`; sa: its reversal's
    suffix array, built if not given (a saved one is passed back in)."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray | None = None) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int32)  # [L]
        self.length = len(self.tokens)
        rev = self.tokens[::-1]
        self.sa = suffix_array(rev) if sa is None else np.asarray(sa, dtype=np.int64)  # [L]
        if len(self.sa) != self.length:
            raise ValueError(f"a suffix array of {len(self.sa)} entries for {self.length} tokens")
        self.rev = np.concatenate([rev, np.full(MAX_MATCH + 1, _END, dtype=np.int32)])  # [L + MAX_MATCH + 1]
        self.first = self.rev[self.sa]  # [L]: each sorted suffix's first token, for the first narrowing

    def match(self, backwards: Sequence[int], min_match: int = 1) -> tuple[int, int, int]:
        """(m, lo, hi): the longest m (at most len(backwards), :data:`MAX_MATCH`) such that the
        context's last m tokens (``backwards``: the context reversed) occur, and the suffix-array
        range [lo, hi) of their occurrences; (0, 0, 0) if shorter than ``min_match``."""
        if not self.length or not backwards:
            return 0, 0, 0
        first = np.int32(backwards[0])  # the array's own dtype: no conversion of the whole array
        lo = int(np.searchsorted(self.first, first, "left"))
        hi = int(np.searchsorted(self.first, first, "right"))
        if lo == hi:
            return 0, 0, 0
        m = 1
        backwards = backwards[:MAX_MATCH]
        while m < len(backwards) and hi - lo > _BLOCK:
            a, b = self._narrow(lo, hi, m, int(backwards[m]))
            if a == b:
                break
            lo, hi, m = a, b, m + 1
        else:  # a few occurrences left: compare them with the rest of the suffix at once
            if m < len(backwards):
                m, lo, hi = self._finish(lo, hi, m, backwards)
        return (m, lo, hi) if m >= min_match else (0, 0, 0)

    def _finish(self, lo: int, hi: int, m: int, backwards: Sequence[int]) -> tuple[int, int, int]:
        """(m, lo, hi) narrowed to the longest match among the occurrences [lo, hi), which all
        match the first m tokens of ``backwards``."""
        want = np.asarray(backwards[m:], dtype=np.int32)  # [n]
        block = self.rev[self.sa[lo:hi, None] + (m + np.arange(len(want)))[None, :]]  # [R, n]
        same = block == want[None, :]
        lcp = np.where(same.all(1), len(want), same.argmin(1))  # [R]: tokens matched past m
        best = int(lcp.max())
        where = np.flatnonzero(lcp == best)  # contiguous: the array is sorted on these columns
        return m + best, lo + int(where[0]), lo + int(where[-1]) + 1

    def _narrow(self, lo: int, hi: int, column: int, token: int) -> tuple[int, int]:
        """The part of [lo, hi) whose suffixes hold ``token`` at offset ``column`` (sorted there)."""
        sa, rev = self.sa, self.rev
        if hi - lo <= _SCAN:
            col, token = rev[sa[lo:hi] + column], np.int32(token)
            return lo + int(np.searchsorted(col, token, "left")), lo + int(np.searchsorted(col, token, "right"))
        a, b = lo, hi
        while a < b:  # first entry >= token
            mid = (a + b) // 2
            if rev[sa[mid] + column] < token:
                a = mid + 1
            else:
                b = mid
        c, d = a, hi
        while c < d:  # first entry > token
            mid = (c + d) // 2
            if rev[sa[mid] + column] <= token:
                c = mid + 1
            else:
                d = mid
        return a, c

    def continuations(self, lo: int, hi: int, m: int, depth: int, rows: int) -> np.ndarray:
        """The ``depth`` tokens after each occurrence in [lo, hi) of a match of length m, the
        ``rows`` most recent occurrences, most recent first: [min(rows, hi - lo), depth] int32,
        :data:`SEPARATOR` where a document ended (and after it)."""
        j = self.sa[lo:hi]  # reversed positions of each occurrence's last token
        if len(j) > rows:
            j = j[np.argpartition(j, rows - 1)[:rows]]
        j = np.sort(j)  # smallest reversed position: the latest occurrence
        start = self.length - j  # [R]: where each continuation starts in the corpus
        cols = start[:, None] + np.arange(depth)[None, :]  # [R, depth]
        out = np.full(cols.shape, SEPARATOR, dtype=np.int32)
        inside = cols < self.length
        out[inside] = self.tokens[cols[inside]]
        ended = np.cumsum(out == SEPARATOR, axis=1) > 0  # a separator ends the continuation there
        out[ended] = SEPARATOR
        return out


@dataclass(frozen=True)
class Match:
    """What :meth:`Datastore.lookup` found: the matched suffix's ``length`` and, for its most
    recent occurrences, the tokens that followed (``rows``: [R, depth] int32, most recent first,
    :data:`SEPARATOR` past a document's end), and ``count``: how many occurrences there were."""

    length: int
    rows: np.ndarray
    count: int


class Datastore:
    """Token sequences searched by suffix (module doc). ``max_tokens``: keep at most this many
    tokens, the oldest documents dropped first (None: unbounded)."""

    def __init__(self, max_tokens: int | None = None) -> None:
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens <= 0):
            raise ValueError(f"a datastore's max_tokens must be a positive integer, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.meta: dict = {}  # what built it (the tokenizer), for reports and checks
        self._docs: deque[np.ndarray] = deque()
        self._tokens = 0
        self._main: SuffixIndex | None = None  # over the first _in_main documents
        self._in_main = 0
        self._main_tokens = 0  # tokens of those documents
        self._recent: SuffixIndex | None = None  # over the others, rebuilt when stale
        self._recent_stale = False

    def __len__(self) -> int:
        """Tokens held (separators not counted)."""
        return self._tokens

    @property
    def documents(self) -> int:
        return len(self._docs)

    def add(self, tokens: Iterable[int]) -> None:
        """Add one document (a token-id sequence); empty ones are ignored."""
        doc = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens, dtype=np.int64)
        if doc.ndim != 1:
            raise ValueError("a datastore document is a flat sequence of token ids")
        if len(doc) and int(doc.min()) < 0:
            raise ValueError("token ids are >= 0")
        if self.max_tokens is not None and len(doc) > self.max_tokens:
            doc = doc[-self.max_tokens :]
        if not len(doc):
            return
        self._docs.append(doc.astype(np.int32))
        self._tokens += len(doc)
        self._recent_stale = True
        if self.max_tokens is not None and self._tokens > self.max_tokens:
            keep = max(self.max_tokens * 9 // 10, len(doc))
            while self._tokens > keep:
                self._tokens -= len(self._docs.popleft())
            self._main, self._in_main, self._main_tokens = None, 0, 0  # rebuilt at the next lookup

    def lookup(self, context: Sequence[int], depth: int, *, rows: int = 64, min_match: int = 1) -> Match | None:
        """The longest suffix of ``context`` (at least ``min_match`` tokens, at most
        :data:`MAX_MATCH`) found in the store and the ``depth`` tokens after its ``rows`` most
        recent occurrences; None if there is none."""
        if not self._docs or depth <= 0:
            return None
        backwards = [int(t) for t in context[: -MAX_MATCH - 1 : -1]]
        found = []
        for index in self._indexes():
            m, lo, hi = index.match(backwards, min_match)
            if m:
                found.append((m, index, lo, hi))
        if not found:
            return None
        best = max(m for m, *_ in found)
        hits = [(index, lo, hi) for m, index, lo, hi in found if m == best]
        parts = [index.continuations(lo, hi, best, depth, rows) for index, lo, hi in reversed(hits)]  # recent first
        return Match(best, np.concatenate(parts)[:rows], sum(hi - lo for _, lo, hi in hits))

    def _indexes(self) -> list[SuffixIndex]:
        """The main index and the recent one, each brought up to date (see the module doc)."""
        recent = self._tokens - self._main_tokens
        if self._docs and (self._main is None or recent > max(4096, min(self._main_tokens // 4, RECENT_TOKENS))):
            self._rebuild_main()
        if self._recent_stale:
            docs = list(self._docs)[self._in_main :]
            self._recent = SuffixIndex(_joined(docs)) if docs else None
            self._recent_stale = False
        return [i for i in (self._main, self._recent) if i is not None]

    def _rebuild_main(self) -> None:
        self._main = SuffixIndex(_joined(self._docs)) if self._docs else None
        self._in_main, self._main_tokens = len(self._docs), self._tokens
        self._recent, self._recent_stale = None, False

    # -- persistence ---------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the store (its documents and its index) to ``path`` (a ``.npz`` file), atomically."""
        path = Path(path)
        if self._docs and (self._main is None or self._in_main != len(self._docs)):
            self._rebuild_main()
        tokens = self._main.tokens if self._main is not None else np.zeros(0, dtype=np.int32)
        sa = self._main.sa if self._main is not None else np.zeros(0, dtype=np.int64)
        meta = {"format": FORMAT, "max_tokens": self.max_tokens, **self.meta}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, tokens=tokens, sa=sa, meta=np.array(json.dumps(meta)))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | Path, max_tokens: int | None = None) -> "Datastore":
        """A store saved by :meth:`save`; ``max_tokens`` None keeps the bound it was saved with."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                tokens, sa, meta = data["tokens"], data["sa"], json.loads(str(data["meta"]))
        except (OSError, KeyError, ValueError) as err:
            raise ValueError(f"{path} is not a specdec datastore ({err}); "
                             "build one with 'specdec index PATH...'") from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is a datastore of another format ({meta.get('format')}); build it again "
                             "with 'specdec index'")
        store = cls(max_tokens if max_tokens is not None else meta.pop("max_tokens", None))
        meta.pop("max_tokens", None)
        meta.pop("format", None)
        store.meta = meta
        ends = np.flatnonzero(tokens == SEPARATOR)
        starts = np.concatenate(([0], ends[:-1] + 1)) if len(ends) else np.zeros(0, dtype=np.int64)
        for a, b in zip(starts, ends):
            store._docs.append(tokens[a:b].copy())
            store._tokens += int(b - a)
        if len(ends):
            store._main, store._in_main, store._main_tokens = SuffixIndex(tokens, sa), len(store._docs), store._tokens
        if store.max_tokens is not None and store._tokens > store.max_tokens:
            while store._tokens > store.max_tokens:
                store._tokens -= len(store._docs.popleft())
            store._main, store._in_main, store._main_tokens = None, 0, 0
        return store


def _joined(docs: Iterable[np.ndarray]) -> np.ndarray:
    """Documents joined, each followed by :data:`SEPARATOR`: [sum(len + 1)] int32."""
    parts: list[np.ndarray] = []
    for doc in docs:
        parts += [doc, np.array([SEPARATOR], dtype=np.int32)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# ------------------------------------------------------------------------------------------------
# Ranking continuations


@dataclass
class TrieNode:
    token: int
    count: int
    parent: int  # index in the trie's node list, -1 for the root's children
    depth: int


def continuation_trie(rows: np.ndarray) -> list[TrieNode]:
    """The trie of the continuations in ``rows`` ([R, depth], :data:`SEPARATOR` past an end), each
    node counting the rows that pass through it; nodes in first-seen order (parents first)."""
    nodes: list[TrieNode] = []
    children: list[dict[int, int]] = [{}]  # entry 1 + u: node u's children by token (entry 0: the root's)
    for row in rows.tolist():
        at = -1
        for depth, token in enumerate(row, 1):
            if token == SEPARATOR:
                break
            kids = children[at + 1]
            node = kids.get(token)
            if node is None:
                node = kids[token] = len(nodes)
                nodes.append(TrieNode(token, 0, at, depth))
                children.append({})
            nodes[node].count += 1
            at = node
    return nodes


def best_path(nodes: list[TrieNode]) -> list[int]:
    """Token ids along the most frequent continuation: at each node the child most rows followed
    (ties to the one seen first, the most recent)."""
    best: dict[int, int] = {}  # parent -> its most frequent child
    for i, node in enumerate(nodes):
        j = best.get(node.parent)
        if j is None or node.count > nodes[j].count:
            best[node.parent] = i
    path, at = [], best.get(-1)
    while at is not None:
        path.append(nodes[at].token)
        at = best.get(at)
    return path


def top_nodes(nodes: list[TrieNode], budget: int, max_depth: int) -> tuple[list[int], list[int]]:
    """The ``budget`` most frequent continuation prefixes at most ``max_depth`` deep, as a token
    tree (tokens, parents; parents first). A child is followed by no more rows than its parent,
    and ties go to the shallower node, so the kept set holds every kept node's ancestors."""
    order = sorted((i for i, n in enumerate(nodes) if n.depth <= max_depth),
                   key=lambda i: (-nodes[i].count, nodes[i].depth, i))[:budget]
    kept = sorted(order, key=lambda i: (nodes[i].depth, i))
    index = {old: new for new, old in enumerate(kept)}
    return [nodes[i].token for i in kept], [index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in kept]


# ------------------------------------------------------------------------------------------------
# Stores by name


def store_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the store called ``name`` lives: ``name`` itself if it is a path to a file (or ends in
    ``.npz``), else ``<cache>/datastores/<name>.npz``."""
    if _names_a_file(name):
        return Path(name).expanduser()
    if not name or name.startswith("."):
        raise ValueError(f"datastore name {name!r}: give a name (letters, digits, '-', '_') or a path to a .npz file")
    return cache_root(cache_dir) / "datastores" / f"{name}{SUFFIX}"


def _names_a_file(name: str) -> bool:
    """Whether a store's name is the path of its file (:func:`store_path`)."""
    return os.sep in name or name.endswith(SUFFIX) or bool(os.altsep and os.altsep in name)


_OPEN: dict[str, Datastore] = {}  # stores opened in this process, by path ("" the in-memory one)


def open_store(name: str | None = None, *, cache_dir: str | Path | None = None) -> Datastore:
    """The store ``name`` names (:func:`store_path`), loaded once per process and shared by every
    generation that names it (a server adds its outputs to it). None: the process's in-memory
    store, empty until something adds to it. A name with no file is a ``ValueError``."""
    if name is None:
        return _OPEN.setdefault("", Datastore())
    path = store_path(name, cache_dir)
    key = str(path.resolve())
    if key not in _OPEN:
        if not path.is_file():
            where = f"--output {name}" if _names_a_file(name) else f"--name {name}"
            raise ValueError(f"no datastore {name!r} (looked for {path}); build one with 'specdec index PATH... "
                             f"{where}'")
        _OPEN[key] = Datastore.load(path)
    return _OPEN[key]


def use_default(store: Datastore) -> None:
    """Make ``store`` what :func:`open_store` returns for no name: the store a retrieval drafter
    that names none searches (``specdec serve --datastore`` sets the server's)."""
    if not isinstance(store, Datastore):
        raise TypeError(f"a default datastore must be a specdec.datastore.Datastore, got {type(store).__name__}")
    _OPEN[""] = store
