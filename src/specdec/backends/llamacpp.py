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
least :data:`FILE_LAYOUT_ROWS` tokens through a second context on the file's layout, then moves that
sequence's KV cells (``llama_state_seq_get_data`` / ``set_data``) into the decoding context. Both
contexts compute the same model; their kernels round differently, as two batch sizes already do
in llama.cpp.

Token trees are verified in one batch: each leaf of the tree gets a sequence id, each node carries
the ids of the leaves below it (a batch row may belong to several sequences), so a node's cache
cell is visible exactly to its descendants. A draft tree may grow over several passes: a new node
hanging from an earlier one takes over that node's sequence, or a copy of its path in a new one.
Keeping the accepted path (:meth:`LlamaCppCausalLM.keep`) moves it into sequence 0.

Cells stay in position order. llama.cpp's CPU attention sums over a sequence's cells in cell order
(and accumulates in half precision), so a token placed in a hole before older cells gets logits
that differ from a one-token step's by much more than rounding (0.5 in a logit on SmolLM2).
Cells of discarded branches are therefore not freed but parked in a spare sequence that no row
attends to (:data:`SPARE_SEQUENCE`), so that new tokens always land after every visible cell;
when parked cells would fill the cache, sequence 0 is copied out and back in one block
(:meth:`LlamaCppCausalLM._compact`). What the binding cannot express is refused with a
``ValueError``: masks that are not a tree hanging from the cache, and hidden-state drafters (no
output embeddings are read back from llama.cpp).

The binding is llama-cpp-python (:data:`REQUIREMENT`), mainline llama.cpp: it computes these GGUF
files as transformers' dequantised models do (the ik_llama.cpp fork's prebuilt wheel, faster to
install, gave wrong logits for the SmolLM2 Q4_1 file), and only its C API is used. Why, and how
batch invariant its kernels are, is measured in ``docs/backends.md``.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import importlib.util
import os
import time
import types
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from specdec.backends.base import DEFAULT_CONTEXT, SNAPSHOTS, TREES, CacheSnapshot, ModelFacts, context_size
from specdec.backends.table import LLAMACPP
from specdec.measurements import batch_invariance, cache_file, cost_key, file_identity
from specdec.paths import load_measurement, save_measurement

REQUIREMENT = "llama-cpp-python==0.3.36"
INSTALL = f"pip install {REQUIREMENT}"
MODULE = "llama_cpp"
DEFAULT_CTX = DEFAULT_CONTEXT  # tokens of context when none is asked for (capped at the model's trained context)
DEFAULT_BATCH = 512
MAX_SEQUENCES = 64  # sequence ids in a context: a token tree's leaves, and the spare one
SPARE_SEQUENCE = MAX_SEQUENCES - 1  # holds the cells of discarded branches, out of every row's sight
# A causal chain of at least this many new tokens may run on the file's weight layout (a prefill):
# shorter passes are faster on the repacked layout. On a 2-core AVX-512 CPU with Qwen2.5-Coder-1.5B
# Q4_K_M, 16 rows took 247 ms repacked and 294 ms as stored, 32 rows 443 and 451 ms, 64 rows 855 and
# 612 ms (benchmarks/prefill_layouts.py; docs/backends.md).
FILE_LAYOUT_ROWS = 64
PREFILL_LAYOUTS = ("auto", "file", "repacked")
PREFILL_MARGIN = 0.9  # "auto" prefills on the file's layout when it takes under this share of the time
PREFILL_CACHE_FORMAT = 1
# The KV cache's element type. llama.cpp's CPU flash attention has two kernels of its own for an
# f16 (or f32) cache that round differently from its per-row kernel: a tiled one for passes of 64
# rows or more, and one that splits the keys among threads for a one-token step over a KV view of
# 512 cells or more. With a bf16 cache it runs the per-row kernel for every pass, so on a model
# whose matrix products are batch invariant every row equals a one-token step's bit for bit, at
# any length and in any pass. load_gguf picks bf16 for such a model (docs/backends.md).
KV_TYPES = {"f16": 1, "bf16": 30}  # ggml_type ids
_TREE_SLACK = 256  # KV cells beyond max_context: a tree's siblings and parked cells (see SPARE_SEQUENCE)


class LlamaCppUnavailable(ImportError):
    """The llama.cpp binding is not installed, or does not import; the message holds the pip
    command that fixes it, ``reason`` the import's own error."""

    reason: str = ""


def available() -> bool:
    """Whether the binding can be imported (checked without importing it)."""
    return importlib.util.find_spec(MODULE) is not None


@functools.lru_cache(maxsize=1)
def _api() -> Any:
    """The binding's low-level module, with llama.cpp's log routed into :data:`_LOG` (shown in
    errors, not printed)."""
    try:
        import llama_cpp as api
    except (ImportError, OSError) as err:
        unavailable = LlamaCppUnavailable(
            f"the llama.cpp backend needs the llama-cpp-python binding ({err}); install it with: {INSTALL} "
            "(it compiles llama.cpp: several minutes)"
        )
        unavailable.reason = str(err)
        raise unavailable from None
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
        desc = ctypes.create_string_buffer(256)
        api.llama_model_desc(self._ptr, desc, len(desc))
        self.n_params = int(api.llama_model_n_params(self._ptr))  # counted from the file's tensors
        self.description = describe(desc.value.decode("utf-8", "replace"), self.n_params)

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


def describe(desc: str, n_params: int) -> str:
    """llama.cpp's description of a model (``'qwen2 1B Q4_K - Medium'``: architecture, a size class
    of its own, file type) with the size class replaced by the parameter count of the file's
    tensors: ``'qwen2 494M Q4_K - Medium'``."""
    arch, _size_class, file_type = (desc.split(" ", 2) + ["", ""])[:3]
    return " ".join(part for part in (arch, params_label(n_params), file_type) if part)


def params_label(n_params: int) -> str:
    """A parameter count as people write it: 27072 -> '27K', 134515008 -> '135M', 1543714304 -> '1.5B'."""
    if n_params < 999_500:
        return f"{n_params / 1e3:.0f}K"
    return f"{n_params / 1e6:.0f}M" if n_params < 999_500_000 else f"{n_params / 1e9:.1f}B"


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
    n_ctx: int | None = None,
    n_batch: int = DEFAULT_BATCH,
    eos_token_ids: Sequence[int] | None = None,
    prefill_layout: str = "auto",
    cache_dir: str | Path | None = None,
) -> "LlamaCppCausalLM":
    """Load a local ``.gguf`` file into a :class:`LlamaCppCausalLM` (one KV cache).

    n_threads: default :func:`default_threads`. n_ctx: the context length in tokens (llama.cpp's
    n_ctx, less the cells kept for trees), reported as ``max_context`` (default :data:`DEFAULT_CTX`,
    or the model's trained context if shorter; more than the trained context is refused, a
    :class:`~specdec.backends.base.ContextSizeError`). eos_token_ids: the ids that end generation
    (default: the GGUF's end-of-generation tokens). prefill_layout: the weight layout long chains
    (prompts) run on: ``"repacked"`` (the one decoding runs on), ``"file"`` (as stored in the
    GGUF) or ``"auto"``, whichever :func:`choose_prefill_layout` measures faster here (cached under
    ``cache_dir``, as the planner's cost curves are). A model whose short passes equal its one-token
    steps (:func:`specdec.measurements.batch_invariance`, measured once and cached the same way) gets a
    bf16 KV cache and the repacked layout for every pass (see :data:`KV_TYPES`); others an f16
    cache. Raises :class:`LlamaCppUnavailable` without
    the binding and ``ValueError`` naming the file when it is missing, not a GGUF or corrupt.
    """
    if prefill_layout not in PREFILL_LAYOUTS:
        raise ValueError(f"prefill_layout must be one of {', '.join(PREFILL_LAYOUTS)}, got {prefill_layout!r}")
    context_size(n_ctx, 0, path)  # a bad value is refused before the file loads
    weights = GGUFWeights(path)
    model = LlamaCppCausalLM(weights, n_threads=n_threads, n_ctx=n_ctx, n_batch=n_batch, eos_token_ids=eos_token_ids)
    invariance = batch_invariance(model, cache_dir=cache_dir)  # its matrix products, measured once (cached)
    if invariance["invariant"]:
        # Keep it invariant everywhere: a bf16 cache (see KV_TYPES) and one weight layout for every
        # pass, so a prompt's cells, a tree's rows and verification rows all equal one-token steps'
        # (prefill costs more: no tiled attention).
        model = LlamaCppCausalLM(weights, n_threads=n_threads, n_ctx=n_ctx, n_batch=n_batch,
                                 eos_token_ids=eos_token_ids, kv_type="bf16")
        if prefill_layout == "auto":
            model.prefill_choice = {"layout": "repacked", "source": "batch invariant: one layout for every pass"}
            return model
    if prefill_layout == "auto":
        model.prefill_choice = choose_prefill_layout(model, cache_dir=cache_dir)
    elif prefill_layout == "file":
        model.prefill_choice = {"layout": "file", "source": "asked for"}
    if model.prefill_choice["layout"] == "file":
        model.prefill_weights = GGUFWeights(path, repack=False)  # memory-mapped: pages shared with the first load
        # Its context now, and one pass on it: the first long prompt would otherwise pay for creating
        # it and for mapping every weight page (0.4 s on the 1.5B Q4_K_M file, 2 cores).
        model._prefill_context().forward([0])
        model._prefill_context().reset()
    return model


def load(path: str | Path, *, n_threads: int | None = None, n_ctx: int | None = None,
         eos_token_ids: Sequence[int] | None = None, cache_dir: str | Path | None = None) -> "LlamaCppCausalLM":
    """The table's loader for this backend (:meth:`specdec.backends.table.Backend.load`):
    :func:`load_gguf` with its default batch and prefill layout."""
    return load_gguf(path, n_threads=n_threads, n_ctx=n_ctx, eos_token_ids=eos_token_ids, cache_dir=cache_dir)


def choose_prefill_layout(model: "LlamaCppCausalLM", *, cache_dir: str | Path | None = None,
                          refresh: bool = False) -> dict[str, Any]:
    """Which weight layout a chain of :data:`FILE_LAYOUT_ROWS` tokens runs faster on, ``model``'s
    (repacked) or its file's as stored: ``{"layout": "file" | "repacked", "seconds": {layout:
    fastest time}, "rows", "source": "measured" | "cache"}``.

    Times a pass of :data:`FILE_LAYOUT_ROWS` rows (logits for the last) on each, alternating, the
    fastest of two after a warm-up (other work on the machine only adds time); "file" wins when
    it takes under :data:`PREFILL_MARGIN` of the repacked time. Cached as JSON beside the
    planner's cost curves, keyed by machine, file, threads and n_batch.
    """
    key = {**cost_key(model), "what": "llama.cpp prefill layouts", "rows": FILE_LAYOUT_ROWS}
    path = cache_file(key, cache_dir)
    saved = None if refresh else load_measurement(path, key, PREFILL_CACHE_FORMAT)
    choice = saved.get("choice") if saved is not None else None
    if isinstance(choice, dict) and choice.get("layout") in ("file", "repacked"):
        return {**choice, "source": "cache"}
    other = LlamaCppCausalLM(GGUFWeights(model.weights.path, repack=False), n_threads=model.n_threads,
                             n_ctx=model.max_context, n_batch=model.n_batch,
                             eos_token_ids=model.generation_config.eos_token_id)
    rows = min(FILE_LAYOUT_ROWS, model.max_context - len(model.tokens))
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

    backend_name = LLAMACPP  # its row in specdec.backends.table
    capabilities = frozenset({TREES, SNAPSHOTS})  # neither layers nor hidden states are exposed

    def __init__(
        self,
        weights: GGUFWeights,
        *,
        n_threads: int | None = None,
        n_ctx: int | None = None,
        n_batch: int = DEFAULT_BATCH,
        eos_token_ids: Sequence[int] | None = None,
        kv_type: str = "f16",
    ) -> None:
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        for name, value in (("n_batch", n_batch), ("n_threads", n_threads)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.weights = weights
        self.n_threads = n_threads or default_threads()
        self.n_batch = n_batch
        self._vocab = weights.vocab_size
        self._max_context = context_size(n_ctx, weights.n_ctx_train, weights.path)  # refuses more than the trained context
        eos = list(eos_token_ids) if eos_token_ids is not None else weights.eog_ids()
        self.generation_config = types.SimpleNamespace(eos_token_id=eos)  # what eos_token_ids() reads
        api = self._api = _api()
        params = api.llama_context_default_params()
        params.n_ctx = self._max_context + _TREE_SLACK
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = MAX_SEQUENCES
        params.n_threads = params.n_threads_batch = self.n_threads
        params.kv_unified = True  # one cache for all sequences: a tree's shared cells are stored once
        params.type_k = params.type_v = KV_TYPES[kv_type]
        self.kv_type = kv_type
        params.no_perf = True
        _LOG.clear()
        self._ctx = api.llama_init_from_model(weights.pointer, params)
        if not self._ctx:
            raise ValueError(f"{weights.path}: llama.cpp could not create a context{_last_error()}")
        self._mem = api.llama_get_memory(self._ctx)
        self._batch = api.llama_batch_init(n_batch, 0, MAX_SEQUENCES)
        self._tokens: list[int] = []
        self._branch: _Branch | None = None
        self._parked = 0  # at least as many cells as the spare sequence holds (see SPARE_SEQUENCE)
        self._parked_from: int | None = None  # the lowest position a parked cell may hold
        # Chains of FILE_LAYOUT_ROWS tokens or more run on these weights (the file's layout) when set,
        # in a context made on first use; prefill_choice says why (see load_gguf).
        self.prefill_weights: GGUFWeights | None = None
        self.prefill_choice: dict[str, Any] = {"layout": "repacked", "source": "default"}
        self._prefiller: LlamaCppCausalLM | None = None

    def fork(self) -> "LlamaCppCausalLM":
        """Another context (its own, empty KV cache) on the same weights and settings."""
        twin = LlamaCppCausalLM(
            self.weights, n_threads=self.n_threads, n_ctx=self._max_context, n_batch=self.n_batch,
            eos_token_ids=self.generation_config.eos_token_id, kv_type=self.kv_type,
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

    def identity(self) -> dict[str, Any]:
        """What the planner's measurements of this backend are keyed by (with the machine and the
        class; :func:`specdec.measurements.cost_key`): the GGUF file, the threads, the batch size
        and the KV cache type."""
        return file_identity(self.weights.path, self.n_threads, self.n_batch, self.kv_type)

    def forward(
        self,
        tokens: Sequence[int],
        num_logits: int = 0,
        *,
        attend: torch.Tensor | None = None,
        positions: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append ``tokens``; return logits [len(tokens), V] float32, or only the last ``num_logits`` rows.

        ``attend`` [n, cache_len + n] bool and ``positions`` [n] describe a token tree: each new
        token sees the cache before the tree, its ancestors and itself (as
        :func:`specdec.token_tree.forward_tree` and the draft trees build); a later pass may hang new
        nodes from the tree's earlier ones. Other masks raise ``ValueError``. While a tree is
        unresolved, only another tree pass, :meth:`keep` or :meth:`trim` may follow.
        """
        tokens = [int(t) for t in tokens]
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if self._branch is not None and attend is None:
            raise ValueError(
                "the llama.cpp backend holds an unresolved token tree: keep() its accepted path or trim() "
                "back before a causal forward"
            )
        bad = [t for t in tokens if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{self._vocab - 1})")
        want = n if num_logits <= 0 else min(num_logits, n)
        start = len(self._tokens)
        if attend is None:
            if positions is not None and list(positions) != list(range(start, start + n)):
                raise ValueError("positions without attend must continue the cache: start..start+n-1")
            self._make_room(start + n, n)
            if self.prefill_weights is not None and n >= FILE_LAYOUT_ROWS:
                rows = self._decode_chain_as_stored(tokens, start, want)
            else:
                rows = self._decode_chain(tokens, start, want)
        else:
            parents, pos = self._read_tree(attend, positions, start)
            self._make_room(max(pos) + 1, n)
            rows = self._decode_tree(tokens, parents, pos, start, want)
        self._tokens.extend(tokens)
        return torch.from_numpy(rows)  # [want, V] float32

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the cached positions ``indices`` (ascending): the cache before the last
        tree and one path of it (what :func:`specdec.token_tree.keep_path` asks), or a prefix."""
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
        api, mem, seq, base = self._api, self._mem, branch.owner[path[-1]], branch.base
        for other in branch.sequences - {seq}:  # every other branch's cells: parked, not freed
            api.llama_memory_seq_cp(mem, other, SPARE_SEQUENCE, base, -1)
        api.llama_memory_seq_rm(mem, seq, branch.pos[path[-1]] + 1, -1)  # below the kept node: at the cache's end
        if seq != 0:
            api.llama_memory_seq_rm(mem, 0, base, -1)
            api.llama_memory_seq_cp(mem, seq, 0, base, -1)
        for other in branch.sequences - {0}:
            api.llama_memory_seq_rm(mem, other, -1, -1)
        self._parked += len(branch.parent)  # a bound: shared cells of the kept path may be parked too
        self._parked_from = base if self._parked_from is None else min(self._parked_from, base)
        self._tokens = [self._tokens[i] for i in kept]
        self._branch = None

    def snapshot(self) -> CacheSnapshot:
        """The cache's tokens and sequence 0's cells (``llama_state_seq_get_data``), for :meth:`restore`."""
        if self._branch is not None:
            raise ValueError("snapshot() of an unresolved token tree: keep() a path or trim() first")
        if not self._tokens:
            return CacheSnapshot((), b"")
        buffer, written = _cells_out(self)
        if not written:
            raise RuntimeError(f"llama.cpp could not copy the cache out{_last_error()}")
        return CacheSnapshot(tuple(self._tokens), bytes(memoryview(buffer)[:written]))

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Replace the cache with ``snapshot`` (from :meth:`snapshot` of a context on the same
        weights): one block, in position order."""
        self.reset()
        if not snapshot.tokens:
            return
        buffer = (ctypes.c_uint8 * len(snapshot.data)).from_buffer_copy(snapshot.data)
        if not _cells_in(self, buffer, len(snapshot.data)):
            self.reset()
            raise RuntimeError(f"llama.cpp could not restore a cache snapshot{_last_error()}")
        self._tokens = list(snapshot.tokens)

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
        if self._parked_from is not None and length <= self._parked_from:
            # Back before every parked branch (a prompt cache's next prompt): the freed cells lie
            # among parked ones, where new tokens would land out of position order.
            self._compact()

    def reset(self) -> None:
        self._api.llama_memory_clear(self._mem, True)
        self._tokens = []
        self._branch = None
        self._parked, self._parked_from = 0, None

    # -- internals -------------------------------------------------------------------------------

    def _make_room(self, end: int, n: int) -> None:
        """Positions up to ``end`` must fit the context, and ``n`` new cells the KV cache:
        compact it (:meth:`_compact`) when parked cells stand in the way."""
        if end > self._max_context:
            raise ValueError(
                f"position {end - 1} is past the context of {self._max_context} tokens (n_ctx); "
                "load the model with a larger n_ctx"
            )
        cells = self._max_context + _TREE_SLACK
        if len(self._tokens) + self._parked + n > cells and self._branch is None:
            self._compact()
        if len(self._tokens) + self._parked + n > cells:
            raise ValueError(f"a token tree of {n} nodes does not fit the KV cache's {_TREE_SLACK} spare cells")

    def _compact(self) -> None:
        """Drop the parked cells: sequence 0 is copied out and written back as one block, in order."""
        if self._parked == 0:
            return
        if self._tokens:
            _move_sequence(self, self)
        else:
            self._api.llama_memory_clear(self._mem, False)
        self._parked, self._parked_from = 0, None

    def _drop_branch(self, length: int) -> None:
        """Resolve the tree by keeping none of it: its cells are the cache's last, so they may be freed."""
        api = self._api
        for seq in self._branch.sequences - {0}:
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
        other = self._prefill_context()
        try:
            if start:
                _move_sequence(self, other)
            rows = other._decode_chain(tokens, start, want)
            try:
                _move_sequence(other, self)
                self._parked, self._parked_from = 0, None
            except BaseException:
                self.reset()  # its cells are gone: keep the bookkeeping true (an empty cache)
                raise
        finally:
            other.reset()
        return rows

    def _prefill_context(self) -> "LlamaCppCausalLM":
        """The context on the file's weight layout that long chains run in (made on first use)."""
        if self._prefiller is None:
            self._prefiller = LlamaCppCausalLM(
                self.prefill_weights, n_threads=self.n_threads, n_ctx=self._max_context, n_batch=self.n_batch,
                eos_token_ids=self.generation_config.eos_token_id, kv_type=self.kv_type,
            )
        return self._prefiller

    def _read_tree(self, attend: torch.Tensor, positions: Sequence[int] | None, start: int) -> tuple[list[int], list[int]]:
        """Read a tree pass from its mask: each new token's parent as a cache index (the new
        tokens' being start, start + 1, ...; ``base - 1`` for a node hanging from the cache before
        the tree) and its position. Raises ``ValueError`` for a mask llama.cpp's sequences cannot
        express, or positions that are not the parent's + 1."""
        attend = torch.as_tensor(attend).to(torch.bool)
        n = attend.shape[0]
        if attend.shape != (n, start + n):
            raise ValueError(f"attend must be [n, cache_len + n] = [{n}, {start + n}], got {list(attend.shape)}")
        if positions is None or len(positions) != n:
            raise ValueError("a tree forward needs positions [n] with attend")
        branch = self._branch
        base = branch.base if branch is not None else start
        if not bool(attend[:, :base].all()):
            raise ValueError("the llama.cpp backend runs token trees that see the whole cache before the tree; "
                             "this mask hides part of it")
        parents: list[int] = []
        pos: list[int] = []
        for i in range(n):
            row = attend[i]
            if not row[start + i]:
                raise ValueError("attend is not a token-tree mask (each token must see itself)")
            seen = (row[start : start + i].nonzero().flatten() + start).tolist() or (row[base:start].nonzero().flatten() + base).tolist()
            parent = seen[-1] if seen else base - 1  # the deepest node it sees: its parent
            expected = torch.zeros(start + n, dtype=torch.bool)
            expected[:base] = True
            expected[start + i] = True
            node = parent
            while node >= base:
                expected[node] = True
                node = parents[node - start] if node >= start else branch.parent[node]
            if not torch.equal(row, expected):
                raise ValueError("attend is not a token-tree mask (each token must see exactly the cache before "
                                 "the tree, its ancestors and itself)")
            parents.append(parent)
            pos.append((pos[parent - start] if parent >= start else branch.pos[parent] if parent >= base else base - 1) + 1)
        if [int(p) for p in positions] != pos:
            raise ValueError("tree positions must be each token's parent's position + 1 (the cache's length - 1 + "
                             "depth for a tree on the cache)")
        return parents, pos

    def _decode_tree(self, tokens: list[int], parents: list[int], pos: list[int], start: int, want: int) -> np.ndarray:
        """Feed a tree pass (``parents`` as cache indices, ``pos`` [n] positions). Without an open
        tree, the leading tokens every leaf descends from are fed as a chain first."""
        n, out = len(tokens), []
        if self._branch is None:
            below = _leaves_below([p - start if p >= start else -1 for p in parents])  # [n] leaf numbers
            leaves = 1 + max(max(b) for b in below)
            if leaves == 1:
                return self._decode_chain(tokens, start, want)  # a chain: no tree
            shared = next(i for i, b in enumerate(below) if len(b) < leaves)  # nodes every leaf descends from
            if shared:
                out.append(self._decode_chain(tokens[:shared], start, max(0, want - (n - shared))))
            self._branch = _Branch(base=start + shared)
            tokens, parents, pos = tokens[shared:], parents[shared:], pos[shared:]
            start, n = start + shared, n - shared
        if n > self.n_batch:
            raise ValueError(f"a token tree of {n} nodes exceeds n_batch={self.n_batch}")
        seqs = self._branch.grow(self._api, self._mem, parents, pos, start)  # [n] sequence ids of each new node
        out.append(self._decode([(tokens[i], pos[i], seqs[i], i >= n - want) for i in range(n)]))
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
    context into ``dest``'s, replacing every cell ``dest`` held (parked ones too): one block, in
    cell order. ``source`` may be ``dest``."""
    buffer, written = _cells_out(source)
    if not _cells_in(dest, buffer, written):
        raise RuntimeError(f"llama.cpp could not move a sequence's cache between contexts{_last_error()}")


def _cells_out(model: LlamaCppCausalLM) -> tuple[Any, int]:
    """Sequence 0's cells as llama.cpp serialises them: a buffer and the bytes written (0: failed)."""
    api = model._api
    size = api.llama_state_seq_get_size(model._ctx, 0)
    buffer = (ctypes.c_uint8 * size)()
    return buffer, api.llama_state_seq_get_data(model._ctx, buffer, size, 0)


def _cells_in(model: LlamaCppCausalLM, buffer: Any, size: int) -> bool:
    """Empty ``model``'s cache and write ``size`` bytes of cells from :func:`_cells_out` into it."""
    model._api.llama_memory_clear(model._mem, False)
    _LOG.clear()
    return bool(size) and bool(model._api.llama_state_seq_set_data(model._ctx, buffer, size, 0))


class _Branch:
    """An unresolved token tree in the cache, from cache index (and position) ``base`` on.

    Each sequence in ``sequences`` holds the cache before the tree and the path to its ``tip``
    (``base - 1``: none yet); each node has its parent's cache index, its position and an
    ``owner``: a sequence whose path runs through it, so its cells up to the node's position are
    exactly the cache and the node's path.
    """

    def __init__(self, base: int) -> None:
        self.base = base
        self.parent: dict[int, int] = {}
        self.pos: dict[int, int] = {}
        self.owner: dict[int, int] = {base - 1: 0}
        self.tip: dict[int, int] = {0: base - 1}
        self.sequences: set[int] = {0}

    def grow(self, api: Any, mem: Any, parents: list[int], pos: list[int], start: int) -> list[list[int]]:
        """Give the new nodes (cache indices start.., ``parents`` as cache indices) sequences:
        each leaf of the pass one, which a node hanging from an old node ``a`` takes over from a
        sequence whose tip is ``a``, or else gets as a fresh copy of ``a``'s path. Returns each
        node's sequence ids (those of the leaves below it)."""
        n = len(parents)
        below = _leaves_below([p - start if p >= start else -1 for p in parents])
        anchor = [0] * n  # the old node each new node's subtree hangs from
        for i, par in enumerate(parents):
            anchor[i] = anchor[par - start] if par >= start else par
        seq_of_leaf: dict[int, int] = {}
        leaves = [i for i in range(n) if start + i not in parents]  # numbered as _leaves_below numbers them
        for number, i in enumerate(leaves):
            a = anchor[i]
            seq = next((s for s, t in self.tip.items() if t == a), None)
            if seq is None:
                free = [s for s in range(SPARE_SEQUENCE) if s not in self.sequences]
                if not free:
                    raise ValueError(f"a token tree with more than {SPARE_SEQUENCE} leaves exceeds the llama.cpp "
                                     "backend's sequences")
                seq = free[0]
                a_pos = self.pos.get(a, self.base - 1)
                api.llama_memory_seq_cp(mem, self.owner[a], seq, -1, a_pos + 1)  # the cache and a's path
                self.sequences.add(seq)
            self.tip[seq] = start + i
            seq_of_leaf[number] = seq
        seqs = [[seq_of_leaf[b] for b in below[i]] for i in range(n)]
        for i in range(n):
            self.parent[start + i], self.pos[start + i], self.owner[start + i] = parents[i], pos[i], seqs[i][0]
        return seqs


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
