"""The engine's prompt cache: the target's cache of recent requests, kept in RAM within a budget.

Chat front-ends, agents and editors re-send a conversation or file with every request, and
several of them may take turns on one server. The target's live cache already serves the next
request as far as it shares its prefix (:attr:`specdec.config.DecodeConfig.prompt_cache`); before
a request would drop part of it, :meth:`PromptCache.prepare` copies it out (a backend
:data:`~specdec.backends.base.SNAPSHOTS` snapshot), and when a saved cache shares a longer prefix
with the new prompt than the live one does, puts that one back. Saved caches are dropped least
recently used first once they pass ``budget_bytes``. A saved cache that another one extends is
dropped for it. Backends without snapshots keep only the live cache.

Every call runs on the thread that drives the target's cache (the model thread, or a slot's thread
under the engine's lock: :class:`specdec.serving.engine.Engine`), before a generation.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Sequence

from specdec.backends.base import SNAPSHOTS, CacheSnapshot, capabilities, common_prefix_len

DEFAULT_BUDGET_MIB = 2048


@dataclass
class Prepared:
    """What :meth:`PromptCache.prepare` did: the prompt tokens the cache now holds, and whether a
    saved cache was put back (``restored``) or the live one copied out (``saved``)."""

    shared: int
    restored: bool = False
    saved: bool = False


class PromptCache:
    """Saved target caches, least recently used first, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.entries: collections.OrderedDict[int, CacheSnapshot] = collections.OrderedDict()  # oldest first
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def prepare(self, backend: Any, prompt: Sequence[int]) -> Prepared:
        """Make ``backend``'s cache the best start for ``prompt`` (before a generation)."""
        live = common_prefix_len(backend.tokens, prompt)
        if SNAPSHOTS not in capabilities(backend) or self.budget_bytes == 0:
            return Prepared(live)
        best, shared = None, live
        for key, entry in self.entries.items():
            n = common_prefix_len(entry.tokens, prompt)
            if n > shared:
                best, shared = key, n
        entry = None
        if best is not None:
            entry = self.entries[best]
            self.entries.move_to_end(best)  # the most recently used, before the live cache joins
        saved = False
        if live < len(backend.tokens):  # the request would drop part of the live cache
            saved = self.save(backend.snapshot())
        if entry is None:
            return Prepared(live, saved=saved)
        backend.restore(entry)
        return Prepared(shared, restored=True, saved=saved)

    def save(self, snapshot: CacheSnapshot) -> bool:
        """Keep ``snapshot`` (dropping saved caches it extends, then the oldest past the budget);
        False if it holds nothing, alone passes the budget, or a saved cache holds it already."""
        if not snapshot.tokens or snapshot.nbytes > self.budget_bytes:
            return False
        if any(e.tokens[: len(snapshot.tokens)] == snapshot.tokens for e in self.entries.values()):
            return False  # a saved cache holds it already
        for key in [k for k, e in self.entries.items() if snapshot.tokens[: len(e.tokens)] == e.tokens]:
            del self.entries[key]
        self.entries[self._next] = snapshot
        self._next += 1
        while self.nbytes > self.budget_bytes:
            self.entries.popitem(last=False)
        return True
