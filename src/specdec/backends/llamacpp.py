"""The llama.cpp backend: GGUF files run natively, behind the same :class:`CausalLM` protocol.

:class:`LlamaCppCausalLM` drives llama.cpp through its C API (the ``llama_batch`` /
``llama_decode`` level, not a high-level generate call): a forward pass is one batch whose rows ask
for logits only where the verifier reads them; a long prompt is fed in ``n_batch`` chunks; rollback
removes positions from the KV memory (``seq_rm``); the number of threads is always set explicitly.

Two weight layouts, each where it is faster. llama.cpp repacks quantised weights at load for its
wide CPU kernels (``use_extra_bufts``): one-token steps and short verify passes run faster on the
repacked copy, but on some machines a long pass (a prompt's prefill) runs faster on the layout as
stored in the file. :func:`load_gguf` measures both once per machine, model and thread count
(:func:`choose_prefill_layout`, cached) and, where the file's layout wins, feeds every chain of at
least :data:`PREFILL_ROWS` tokens through a second context on the file's layout, then moves that
sequence's KV cells (``llama_state_seq_get_data`` / ``set_data``) into the decoding context. Both
contexts compute the same model; their kernels round differently, as two batch sizes already do
in llama.cpp.

Token trees are verified in one batch: each leaf of the tree gets a sequence id, each node carries
the ids of the leaves below it (a batch row may belong to several sequences), so a node's cache
cell is visible exactly to its descendants; keeping the accepted path is ``seq_keep`` on one leaf's
sequence followed by a ``seq_rm`` past the path (:meth:`LlamaCppCausalLM.keep`). What the binding
cannot express is refused with a ``ValueError``: masks that are not a tree hanging from the whole
cache (a draft tree extended over several passes), and hidden-state drafters (no output embeddings
are read back from llama.cpp).

The binding is llama-cpp-python (:data:`REQUIREMENT`), mainline llama.cpp: it computes these GGUF
files as transformers' dequantised models do (the ik_llama.cpp fork's prebuilt wheel, faster to
install, gave wrong logits for the SmolLM2 Q4_1 file), and only its C API is used. Why, and how
batch invariant its kernels are, is measured in ``docs/backends.md``.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import time
import types
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from specdec.backends.base import ModelFacts
from specdec.paths import load_measurement, save_measurement

REQUIREMENT = "llama-cpp-python==0.3.36"
INSTALL = f"pip install {REQUIREMENT}"
MODULE = "llama_cpp"
DEFAULT_CTX = 4096
DEFAULT_BATCH = 512
MAX_SEQUENCES = 64  # leaves a verified token tree may have
# A causal chain of at least this many new tokens may run on the file's weight layout (a prefill):
# shorter passes are faster on the repacked layout. On a 2-core AVX-512 CPU with Qwen2.5-Coder-1.5B
# Q4_K_M, 16 rows took 247 ms repacked and 294 ms as stored, 32 rows 443 and 451 ms, 64 rows 855 and
# 612 ms (benchmarks/prefill_layouts.py; docs/backends.md).
PREFILL_ROWS = 64
PREFILL_LAYOUTS = ("auto", "file", "repacked")
PREFILL_MARGIN = 0.9  # "auto" prefills on the file's layout when it takes under this share of the time
PREFILL_CACHE_FORMAT = 1
_TREE_SLACK = 256  # KV cells beyond max_context: a tree's siblings share positions, not cells


class LlamaCppUnavailable(ImportError):
    """The llama.cpp binding is not installed; the message holds the pip command that fixes it."""


def available() -> bool:
    """Whether the binding can be imported (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec(MODULE) is not None


@functools.lru_cache(maxsize=1)
def _api() -> Any:
    """The binding's low-level module, with llama.cpp's log routed into :data:`_LOG` (shown in
    errors, not printed)."""
    try:
        import llama_cpp as api
    except (ImportError, OSError) as err:
        raise LlamaCppUnavailable(
            f"the llama.cpp backend needs the llama-cpp-python binding ({err}); install it with: {INSTALL} "
            "(it compiles llama.cpp: several minutes)"
        ) from None
    api.llama_log_set(_log_callback, None)
    api.llama_backend_init()
    return api


_LOG: collections.deque[str] = collections.deque(maxlen=20)


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)  # ggml_log_callback
def _log_callback(level: int, text: bytes | None, _user: Any) -> None:
    if text:
        _LOG.append(text.decode("utf-8", "replace").rstrip())


def _last_error() -> str:
    lines = [line for line in _LOG if line]
    return f" (llama.cpp: {lines[-1]})" if lines else ""


def default_threads() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class GGUFWeights:
    """A GGUF file loaded by llama.cpp: the weights every context on it shares."""

    def __init__(self, path: str | Path, *, repack: bool = True) -> None:
        """repack: let llama.cpp repack quantised weights for the CPU's wide kernels (faster per
        token; rows of a pass of 4 or more tokens then round differently from one-token steps)."""
        self.path = Path(path)
        _check_gguf_file(self.path)
        api = _api()
        params = api.llama_model_default_params()
        params.use_extra_bufts = repack
        _LOG.clear()
        self._ptr = api.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._ptr:
            raise ValueError(
                f"{self.path}: llama.cpp cannot load this GGUF file{_last_error()}; it may be truncated "
                "or corrupt (check its size and sha256, or reinstall the pack)"
            )
        self._api = api
        self._vocab_ptr = api.llama_model_get_vocab(self._ptr)
        self.vocab_size = int(api.llama_vocab_n_tokens(self._vocab_ptr))
        self.n_ctx_train = int(api.llama_model_n_ctx_train(self._ptr))

    @property
    def pointer(self) -> int:
        return self._ptr

    def eog_ids(self) -> list[int]:
        """Token ids that end generation according to the GGUF (EOS, EOT, ...)."""
        is_eog = self._api.llama_vocab_is_eog
        return [t for t in range(self.vocab_size) if is_eog(self._vocab_ptr, t)]

    def __del__(self) -> None:
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            self._api.llama_model_free(ptr)


def _check_gguf_file(path: Path) -> None:
    """Fail clearly, before llama.cpp sees it, on a path that is not a GGUF file."""
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")


def load_gguf(
    path: str | Path,
    *,
    n_threads: int | None = None,
    n_ctx: int = DEFAULT_CTX,
    n_batch: int = DEFAULT_BATCH,
    eos_token_ids: Sequence[int] | None = None,
    prefill_layout: str = "auto",
    cache_dir: str | Path | None = None,
) -> "LlamaCppCausalLM":
    """Load a local ``.gguf`` file into a :class:`LlamaCppCausalLM` (one KV cache).

    n_threads: default :func:`default_threads`. n_ctx: the context length (capped at the model's
    training context), reported as ``max_context``. eos_token_ids: the ids that end generation
    (default: the GGUF's end-of-generation tokens). prefill_layout: the weight layout long chains
    (prompts) run on: ``"repacked"`` (the one decoding runs on), ``"file"`` (as stored in the
    GGUF) or ``"auto"``, whichever :func:`choose_prefill_layout` measures faster here (cached under
    ``cache_dir``, as the planner's cost curves are). Raises :class:`LlamaCppUnavailable` without
    the binding and ``ValueError`` naming the file when it is missing, not a GGUF or corrupt.
    """
    if prefill_layout not in PREFILL_LAYOUTS:
        raise ValueError(f"prefill_layout must be one of {', '.join(PREFILL_LAYOUTS)}, got {prefill_layout!r}")
    weights = GGUFWeights(path)
    model = LlamaCppCausalLM(weights, n_threads=n_threads, n_ctx=n_ctx, n_batch=n_batch, eos_token_ids=eos_token_ids)
    if prefill_layout == "auto":
        model.prefill_choice = choose_prefill_layout(model, cache_dir=cache_dir)
    elif prefill_layout == "file":
        model.prefill_choice = {"layout": "file", "source": "asked for"}
    if model.prefill_choice["layout"] == "file":
        model.prefill_weights = GGUFWeights(path, repack=False)  # memory-mapped: pages shared with the first load
    return model


def choose_prefill_layout(model: "LlamaCppCausalLM", *, cache_dir: str | Path | None = None,
                          refresh: bool = False) -> dict[str, Any]:
    """Which weight layout a chain of :data:`PREFILL_ROWS` tokens runs faster on, ``model``'s
    (repacked) or its file's as stored: ``{"layout": "file" | "repacked", "seconds": {layout:
    fastest time}, "rows", "source": "measured" | "cache"}``.

    Times a pass of :data:`PREFILL_ROWS` rows (logits for the last) on each, alternating, the
    fastest of two after a warm-up (other work on the machine only adds time); "file" wins when
    it takes under :data:`PREFILL_MARGIN` of the repacked time. Cached as JSON beside the
    planner's cost curves, keyed by machine, file, threads and n_batch.
    """
    from specdec import planner

    key = {**planner.cost_key(model), "what": "llama.cpp prefill layouts", "rows": PREFILL_ROWS}
    path = planner.cache_file(key, cache_dir)
    saved = None if refresh else load_measurement(path, key, PREFILL_CACHE_FORMAT)
    choice = saved.get("choice") if saved is not None else None
    if isinstance(choice, dict) and choice.get("layout") in ("file", "repacked"):
        return {**choice, "source": "cache"}
    other = LlamaCppCausalLM(GGUFWeights(model.weights.path, repack=False), n_threads=model.n_threads,
                             n_ctx=model.max_context, n_batch=model.n_batch,
                             eos_token_ids=model.generation_config.eos_token_id)
    rows = min(PREFILL_ROWS, model.max_context - len(model.tokens))
    ids = [(17 + 7919 * i) % model.vocab_size for i in range(rows)]
    times: dict[str, list[float]] = {"repacked": [], "file": []}
    for sweep in range(3):  # the first is a warm-up
        for layout, m in (("repacked", model), ("file", other)) if sweep % 2 else (("file", other), ("repacked", model)):
            base = len(m.tokens)
            t0 = time.perf_counter()
            try:
                m.forward(ids, num_logits=1)
            finally:
                m.trim(base)  # the cache as it was
            if sweep:
                times[layout].append(time.perf_counter() - t0)
    seconds = {layout: min(t) for layout, t in times.items()}
    layout = "file" if seconds["file"] < PREFILL_MARGIN * seconds["repacked"] else "repacked"
    choice = {"layout": layout, "seconds": seconds, "rows": rows}
    save_measurement(path, {"format": PREFILL_CACHE_FORMAT, "key": key, "choice": choice})
    return {**choice, "source": "measured"}


class LlamaCppCausalLM(ModelFacts):
    """One sequence's view of a GGUF model in llama.cpp: a context with its own KV cache.

    Implements :class:`~specdec.backends.base.CausalLM`; logits come back as float32 tensors
    [rows, V]. Several contexts may share one :class:`GGUFWeights` (:meth:`fork`), e.g. the
    same model as target and as its own draft.
    """

    def __init__(
        self,
        weights: GGUFWeights,
        *,
        n_threads: int | None = None,
        n_ctx: int = DEFAULT_CTX,
        n_batch: int = DEFAULT_BATCH,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        for name, value in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_threads", n_threads)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.weights = weights
        self.n_threads = n_threads or default_threads()
        self.n_batch = n_batch
        self._vocab = weights.vocab_size
        self._max_context = min(n_ctx, weights.n_ctx_train) if weights.n_ctx_train > 0 else n_ctx
        eos = list(eos_token_ids) if eos_token_ids is not None else weights.eog_ids()
        self.generation_config = types.SimpleNamespace(eos_token_id=eos)  # what eos_token_ids() reads
        api = self._api = _api()
        params = api.llama_context_default_params()
        params.n_ctx = self._max_context + _TREE_SLACK
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = MAX_SEQUENCES
        params.n_threads = params.n_threads_batch = self.n_threads
        params.kv_unified = True  # one cache for all sequences: a tree's shared cells are stored once
        params.no_perf = True
        _LOG.clear()
        self._ctx = api.llama_init_from_model(weights.pointer, params)
        if not self._ctx:
            raise ValueError(f"{weights.path}: llama.cpp could not create a context{_last_error()}")
        self._mem = api.llama_get_memory(self._ctx)
        self._batch = api.llama_batch_init(n_batch, 0, MAX_SEQUENCES)
        self._tokens: list[int] = []
        self._branch: _Branch | None = None
        # Chains of PREFILL_ROWS tokens or more run on these weights (the file's layout) when set,
        # in a context made on first use; prefill_choice says why (see load_gguf).
        self.prefill_weights: GGUFWeights | None = None
        self.prefill_choice: dict[str, Any] = {"layout": "repacked", "source": "default"}
        self._prefiller: LlamaCppCausalLM | None = None

    def fork(self) -> "LlamaCppCausalLM":
        """Another context (its own, empty KV cache) on the same weights and settings."""
        twin = LlamaCppCausalLM(
            self.weights, n_threads=self.n_threads, n_ctx=self._max_context, n_batch=self.n_batch,
            eos_token_ids=self.generation_config.eos_token_id,
        )
        twin.prefill_weights, twin.prefill_choice = self.prefill_weights, self.prefill_choice
        return twin

    def __del__(self) -> None:
        api = getattr(self, "_api", None)
        if api is None:
            return
        if getattr(self, "_batch", None) is not None:
            api.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            api.llama_free(self._ctx)
            self._ctx = None

    # -- the CausalLM protocol ------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(
        self,
        tokens: Sequence[int],
        num_logits: int = 0,
        *,
        attend: torch.Tensor | None = None,
        positions: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append ``tokens``; return logits [len(tokens), V] float32, or only the last ``num_logits`` rows.

        ``attend`` [n, cache_len + n] bool and ``positions`` [n] describe a token tree hanging
        from the whole cache (as :func:`specdec.tree.forward_tree` builds); other masks raise
        ``ValueError``. Until :meth:`keep` or :meth:`trim` resolves a tree, no forward may follow.
        """
        tokens = [int(t) for t in tokens]
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if self._branch is not None:
            raise ValueError(
                "the llama.cpp backend holds an unresolved token tree: keep() its accepted path or trim() "
                "back before the next forward (it cannot extend a tree over several passes; the dynamic and "
                "static draft trees do, the confident tree does not)"
            )
        bad = [t for t in tokens if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{self._vocab - 1})")
        want = n if num_logits <= 0 else min(num_logits, n)
        start = len(self._tokens)
        if attend is None:
            if positions is not None and list(positions) != list(range(start, start + n)):
                raise ValueError("positions without attend must continue the cache: start..start+n-1")
            self._check_room(start + n, n)
            if self.prefill_weights is not None and n >= PREFILL_ROWS:
                rows = self._decode_chain_as_stored(tokens, start, want)
            else:
                rows = self._decode_chain(tokens, start, want)
        else:
            parents = tree_parents(attend, positions, start)
            self._check_room(max(int(p) for p in positions) + 1, n)
            rows = self._decode_tree(tokens, parents, start, want)
        self._tokens.extend(tokens)
        return torch.from_numpy(rows)  # [want, V] float32

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the cached positions ``indices`` (ascending): the cache before the last
        tree and one path of it (what :func:`specdec.tree.keep_path` asks), or a prefix."""
        kept = [int(i) for i in indices]
        branch = self._branch
        if branch is None:
            if kept != list(range(len(kept))):
                raise ValueError("the llama.cpp backend keeps only a prefix of the cache or one path of its last tree")
            self.trim(len(kept))
            return
        head, path = kept[: branch.base], kept[branch.base :]
        if head != list(range(len(head))) or (path and len(head) < branch.base):
            raise ValueError("keep() takes the cache before the last tree and one path of that tree")
        if len(head) < branch.base or not path:
            self._drop_branch(len(head))
            return
        parent = branch.base - 1
        for node in path:
            if branch.parent.get(node) != parent:
                raise ValueError("keep() takes one root-to-node path of the last tree, in order")
            parent = node
        api, mem, seq = self._api, self._mem, branch.seq[path[-1]]
        api.llama_memory_seq_keep(mem, seq)  # cells off this leaf's path are freed
        api.llama_memory_seq_rm(mem, seq, branch.base + len(path), -1)  # below the kept node
        if seq != 0:
            api.llama_memory_seq_cp(mem, seq, 0, -1, -1)
            api.llama_memory_seq_rm(mem, seq, -1, -1)
        self._tokens = [self._tokens[i] for i in kept]
        self._branch = None

    def trim(self, length: int) -> None:
        """Forget every cached position >= ``length`` (after a tree: only back to before its branches)."""
        if length >= len(self._tokens):
            return
        if self._branch is not None:
            if length > self._branch.base:
                raise ValueError("trim() into an unresolved token tree: keep() one of its paths instead")
            self._drop_branch(length)
            return
        self._api.llama_memory_seq_rm(self._mem, 0, length, -1)
        del self._tokens[length:]

    def reset(self) -> None:
        self._api.llama_memory_clear(self._mem, True)
        self._tokens = []
        self._branch = None

    # -- internals -------------------------------------------------------------------------------

    def _check_room(self, end: int, n: int) -> None:
        """Positions up to ``end`` must fit the context; a tree's extra cells fit the slack."""
        if end > self._max_context:
            raise ValueError(
                f"position {end - 1} is past the context of {self._max_context} tokens (n_ctx); "
                "load the model with a larger n_ctx"
            )
        if len(self._tokens) + n > self._max_context + _TREE_SLACK:
            raise ValueError(f"a token tree of {n} nodes does not fit the KV cache's {_TREE_SLACK} spare cells")

    def _drop_branch(self, length: int) -> None:
        api = self._api
        for seq in range(1, self._branch.sequences):
            api.llama_memory_seq_rm(self._mem, seq, -1, -1)
        api.llama_memory_seq_rm(self._mem, 0, length, -1)
        del self._tokens[length:]
        self._branch = None

    def _decode_chain(self, tokens: list[int], start: int, want: int) -> np.ndarray:
        """Feed ``tokens`` causally at positions start.. in n_batch chunks: logits [want, V] of the last rows."""
        n, out = len(tokens), []
        for lo in range(0, n, self.n_batch):
            rows = [(tok, start + i, (0,), i >= n - want) for i, tok in enumerate(tokens[lo : lo + self.n_batch], lo)]
            out.append(self._decode(rows))
        return np.concatenate(out) if len(out) > 1 else out[0]

    def _decode_chain_as_stored(self, tokens: list[int], start: int, want: int) -> np.ndarray:
        """:meth:`_decode_chain` in a context on the file's weight layout: the cached sequence
        moves there, the chain is fed, and the sequence (now with the chain's cells) moves back."""
        other = self._prefiller
        if other is None:
            other = self._prefiller = LlamaCppCausalLM(
                self.prefill_weights, n_threads=self.n_threads, n_ctx=self._max_context, n_batch=self.n_batch,
                eos_token_ids=self.generation_config.eos_token_id,
            )
        try:
            if start:
                _move_sequence(self, other)
            rows = other._decode_chain(tokens, start, want)
            try:
                _move_sequence(other, self)
            except BaseException:
                self.reset()  # its cells are gone: keep the bookkeeping true (an empty cache)
                raise
        finally:
            other.reset()
        return rows

    def _decode_tree(self, tokens: list[int], parents: list[int], start: int, want: int) -> np.ndarray:
        """Feed a forest of new tokens (``parents`` [n], -1 = hangs from the cache) in one batch
        after its shared chain: sequence s holds the cache and the path to leaf s."""
        n = len(tokens)
        leaves_below = _leaves_below(parents)  # [n] sorted leaf numbers = sequence ids
        sequences = max(max(s) for s in leaves_below) + 1
        if sequences == 1:
            return self._decode_chain(tokens, start, want)
        if sequences > MAX_SEQUENCES:
            raise ValueError(f"a token tree with {sequences} leaves exceeds the llama.cpp backend's {MAX_SEQUENCES}")
        shared = next(i for i, s in enumerate(leaves_below) if len(s) < sequences)  # nodes every leaf descends from
        if n - shared > self.n_batch:
            raise ValueError(f"a token tree of {n - shared} nodes exceeds n_batch={self.n_batch}")
        out = [self._decode_chain(tokens[:shared], start, max(0, want - (n - shared)))] if shared else []
        for seq in range(1, sequences):
            self._api.llama_memory_seq_cp(self._mem, 0, seq, -1, -1)
        depth = [0] * n
        for i, par in enumerate(parents):
            depth[i] = 0 if par < 0 else depth[par] + 1
        rows = [(tokens[i], start + depth[i], leaves_below[i], i >= n - want) for i in range(shared, n)]
        out.append(self._decode(rows))
        base = start + shared
        self._branch = _Branch(
            base=base,
            parent={start + i: start + parents[i] for i in range(shared, n)},
            seq={start + i: leaves_below[i][0] for i in range(shared, n)},
            sequences=sequences,
        )
        out = [o for o in out if len(o)]
        return np.concatenate(out) if len(out) > 1 else out[0]

    def _decode(self, rows: list[tuple[int, int, Sequence[int], bool]]) -> np.ndarray:
        """One llama_decode of (token, position, sequence ids, wants logits) rows: logits [wanted, V]."""
        api, batch = self._api, self._batch
        batch.n_tokens = len(rows)
        wanted = []
        for i, (tok, pos, seqs, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, len(seqs), logits
            for j, seq in enumerate(seqs):
                batch.seq_id[i][j] = seq
            if logits:
                wanted.append(i)
        _LOG.clear()
        status = api.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}{_last_error()}")
        out = np.empty((len(wanted), self._vocab), dtype=np.float32)
        for row, i in enumerate(wanted):
            out[row] = np.ctypeslib.as_array(api.llama_get_logits_ith(self._ctx, i), shape=(self._vocab,))
        return out


def _move_sequence(source: LlamaCppCausalLM, dest: LlamaCppCausalLM) -> None:
    """Copy sequence 0's KV cells (positions and keys/values of every layer) from ``source``'s
    context into ``dest``'s, replacing what ``dest`` held there."""
    api = source._api
    size = api.llama_state_seq_get_size(source._ctx, 0)
    buffer = (ctypes.c_uint8 * size)()
    written = api.llama_state_seq_get_data(source._ctx, buffer, size, 0)
    api.llama_memory_seq_rm(dest._mem, 0, -1, -1)
    _LOG.clear()
    if not written or not api.llama_state_seq_set_data(dest._ctx, buffer, written, 0):
        raise RuntimeError(f"llama.cpp could not move a sequence's cache between contexts{_last_error()}")


class _Branch:
    """An unresolved token tree in the cache: nodes from ``base`` on (cache indices), each with
    its parent's index and one sequence (a leaf below it) whose cells are exactly its path."""

    def __init__(self, base: int, parent: dict[int, int], seq: dict[int, int], sequences: int) -> None:
        self.base, self.parent, self.seq, self.sequences = base, parent, seq, sequences


def _leaves_below(parents: list[int]) -> list[list[int]]:
    """For each node of a forest (parents first), the sorted numbers of the leaves below it
    (leaves numbered 0, 1, ... in node order)."""
    n = len(parents)
    has_child = [False] * n
    for par in parents:
        if par >= 0:
            has_child[par] = True
    number = {i: k for k, i in enumerate(i for i in range(n) if not has_child[i])}
    below: list[list[int]] = [[number[i]] if i in number else [] for i in range(n)]
    for i in range(n - 1, -1, -1):
        if parents[i] >= 0:
            below[parents[i]].extend(below[i])
    return [sorted(b) for b in below]


def tree_parents(attend: torch.Tensor, positions: Sequence[int] | None, cached: int) -> list[int]:
    """Read a forest from a tree mask: each new token's parent among the new tokens (-1: the cache).

    attend [n, cached + n] bool must show every new token the whole cache, itself, and exactly
    its parent's visible new tokens; positions [n] must be cached + depth - 1. Anything else is a
    mask llama.cpp's sequence ids cannot express: ``ValueError``.
    """
    attend = torch.as_tensor(attend).to(torch.bool)
    n = attend.shape[0]
    if attend.shape != (n, cached + n):
        raise ValueError(f"attend must be [n, cache_len + n] = [{n}, {cached + n}], got {list(attend.shape)}")
    if positions is None or len(positions) != n:
        raise ValueError("a tree forward needs positions [n] with attend")
    if not bool(attend[:, :cached].all()):
        raise ValueError("the llama.cpp backend runs token trees that see the whole cache; this mask hides part of it")
    new = attend[:, cached:]  # [n, n]
    earlier = torch.ones(n, n, dtype=torch.bool).tril(-1)
    index = torch.arange(n).expand(n, n)
    parents = torch.where(new & earlier, index, -1).max(dim=1).values.tolist()  # [n]
    sees = torch.zeros(n, n, dtype=torch.bool)
    for i, par in enumerate(parents):
        if par >= 0:
            sees[i] = sees[par]
        sees[i, i] = True
    if not torch.equal(sees, new):
        raise ValueError("attend is not a token-tree mask (each token must see exactly its ancestors and itself)")
    depth = sees.sum(dim=1)  # [n]
    if [int(p) for p in positions] != (cached - 1 + depth).tolist():
        raise ValueError("tree positions must be the cache length - 1 + each token's depth")
    return parents
