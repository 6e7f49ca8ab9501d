"""specdec's own GGUF backend: llama-family GGUF files run on a batch-invariant quantized kernel.

:class:`GGUFCausalLM` runs GGUF files of the ``llama`` (SmolLM2, Llama), ``qwen2``
(Qwen2.5-Coder), ``qwen3``, ``phi3`` and ``gemma3`` (Gemma 3) architectures (docs/kernels.md, "What it runs,
and what it refuses") from their quantized weights as stored in the file, memory-mapped
by ``gguf.GGUFReader`` and never dequantized (except the few embedding rows a step looks up; norms
and biases are small fp32 vectors). The forward pass runs in the C kernels of ``csrc/linear_gguf.c``
(one call for all the decoder layers of a pass, one for the head), compiled once into the cache
directory (:func:`library`); ``SPECDEC_GGUF_PORTABLE=1`` runs their portable C path.

Why a kernel of our own. Speculative decoding verifies k drafted tokens in one pass of k + 1 rows,
so it pays only if such a pass costs little more than one row, and it is exact at near-ties only if
each verification row computes what a one-token step computes. llama.cpp's Q4_K passes of k rows
cost almost k one-row passes on an AVX2 CPU, and their rows round differently from a one-token
step's. Here a pass of 1..16 rows reads each weight block once and applies it to every row (the
product is memory bound, so a few rows cost about what one costs), and every output element is
computed by the same floating-point operations whatever the number of rows in the pass and
wherever the row sits in it: a verification row equals the one-token step bit for bit.

Block formats (ggml's; each block holds fp16 scales and packed integers):

- ``Q4_0``: 32 weights, ``d`` and 16 bytes of nibbles, w = d * (q - 8);
- ``Q4_1``: 32 weights, ``d``, ``m`` and 16 bytes of nibbles, w = d * q + m;
- ``Q5_0``: 32 weights, ``d``, 32 high bits and 16 bytes of nibbles, w = d * (q - 16) (q of 5 bits);
- ``Q5_1``: 32 weights, ``d``, ``m``, 32 high bits and 16 bytes of nibbles, w = d * q + m;
- ``Q8_0``: 32 weights, ``d`` and 32 signed bytes, w = d * q;
- ``IQ4_NL``: 32 weights, ``d`` and 16 bytes of nibbles, w = d * level[q] (16 non-linear levels);
- ``Q2_K``: 256 weights, 16 bytes of 4-bit scales and mins (one pair per 16 weights), 64 bytes of
  2-bit q, ``d``, ``dmin``; w = d * sc * q - dmin * m;
- ``Q3_K``: 256 weights, 32 bytes of high bits, 64 bytes of 2-bit lows, 16 six-bit signed scales,
  ``d``; w = d * scale * (q - 4) (q of 3 bits);
- ``Q4_K``: 256 weights, ``d``, ``dmin``, 12 bytes holding 8 six-bit scales and mins, 128 bytes of
  nibbles; sub-block s of 32 has w = d * sc[s] * q - dmin * m[s];
- ``Q5_K``: Q4_K's layout with 32 bytes of fifth bits: w = d * sc[s] * q - dmin * m[s], q of 5 bits;
- ``Q6_K``: 256 weights, 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed scales (one
  per 16 weights) and ``d``; w = d * scale * (q - 32);
- ``IQ4_XS``: 256 weights, ``d``, 8 six-bit signed scales (one per 32), 128 bytes of nibbles;
  w = d * scale * level[q], IQ4_NL's levels;
- ``F32``, ``F16``, ``BF16``: plain floats.

Accumulation order. Each activation row is quantized on its own, as llama.cpp does for its dot
products: to signed bytes in blocks of 256 with an fp32 scale (for the K types and IQ4_XS) or of
32 (for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL). Within a weight block the products of integers are summed exactly into 8 integer
lanes (lane l: the elements e with (e % 32) // 4 == l), so their order does not matter; each block
then adds its lanes, times weight scale * activation scale, into 8 fp32 lane accumulators with one
fused multiply-add per lane, blocks in order 0, 1, 2, ...; the lanes are finally summed in a fixed
tree. Float weights multiply the fp32 row into 8 lanes in order, with the same tree. Threads split
the output elements, never the sum. The AVX2 path and the portable C path perform the very same
operations and agree bit for bit (``tests/backends/test_gguf_native.py``).

Why it is batch invariant. Every step of a row's result is a function of that row alone: its
quantization, its integer block sums, its fixed-order float accumulation; the weight block is
merely reused across rows. The other operations of the forward pass are per-row too (RMSNorm with
its sum of squares in order, RoPE from a table, SwiGLU and GeGLU with an exp of fixed operations) and
attention computes each (head, query row) in one job over the keys in order, skipping those the
row does not see: a row of a k-token pass, or of a token tree, sees exactly the operations of the
one-token step at its position.

Numbers: the activation quantization (8 bits per value, one scale per block) is the same
approximation llama.cpp's CPU kernels make; logits differ from a float computation on the
dequantized weights by about what llama.cpp's differ (measured in the tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import functools
import mmap
import os
import sys
import types
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from specdec import kernels
from specdec.backends.base import DEFAULT_CONTEXT, SNAPSHOTS, TREES, CacheSnapshot, ModelFacts, context_size
from specdec.backends.table import GGUF
from specdec.measurements import file_identity

SOURCE = "linear_gguf.c"
# One build for every CPU: the source compiles its AVX2 code under a target pragma and chooses the
# path at run time from what the CPU reports (gguf_cpu_paths, the one detection).
FLAGS_NATIVE = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
# A test build of the portable path alone: what a CPU of another family (ARM) compiles.
FLAGS_PORTABLE = [*FLAGS_NATIVE, "-DGG_PORTABLE_ONLY"]
LIBS = ["-lm"]  # after the source file
PORTABLE_ENV = "SPECDEC_GGUF_PORTABLE"  # "1": run the portable C path even where AVX2 is available
PATH_ENV = "SPECDEC_GGUF_PATH"  # a name of PATHS: run that path (where this CPU has it) instead of the best
# "0": a loaded model keeps its tensors of the grouped types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K, Q5_K) in the
# file's layout instead of repacking them (:func:`repack`); the same bits, slower (for measurements)
REPACK_ENV = "SPECDEC_GGUF_REPACK"
# The kernel's paths (csrc/linear_gguf.c), by the id the library gives them; each gives the same bits.
PATHS = ("portable", "avx2", "avx512vnni", "avxvnni", "amx")
# A test build whose avx512vnni path runs on any AVX2 CPU, its two VNNI instructions emulated by
# SIMDe's portable definitions (Debian's libsimde-dev): what the path computes, checked where no
# CPU at hand has VNNI.
FLAGS_EMULATED_VNNI = [*FLAGS_NATIVE, "-DGG_EMULATE_VNNI"]
# A measurement build whose KV cache holds fp16 keys and values (each rounded to the nearest fp16 as
# it is stored) instead of fp32: what an fp16 cache would cost and change (benchmarks/kv_cache_f16.py,
# docs/kernels.md "The context and its KV cache"). Its caches are torch.float16 tensors.
FLAGS_KV_F16 = [*FLAGS_NATIVE, "-DGG_KV_F16"]

# ggml type ids this backend's kernel multiplies.
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 30: "BF16"}
ARCHITECTURES = {"llama": False, "qwen2": True, "qwen3": True, "gemma3": True, "phi3": True}  # architecture -> NEOX rope (pairs i, i + d/2)
QKV_BIASES = {"qwen2"}  # architectures whose Q, K and V projections have biases
QK_NORMS = {"qwen3", "gemma3"}  # architectures that RMSNorm each head of Q and K before RoPE
GEMMA = {"gemma3"}  # embedding times sqrt(hidden), post-attention and post-FFN norms, GeGLU, sliding-window layers
GEMMA3_SWA_PATTERN = 6  # llama.cpp's gemma3: of each 6 layers the first 5 slide, the 6th is global
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3 (unless rope.freq_base_swa says)
ACT_SWIGLU, ACT_GEGLU = 0, 1
DEFAULT_CTX = DEFAULT_CONTEXT  # tokens of context when none is asked for (capped at the model's trained context)
TREE_SLACK = 256  # cache rows beyond max_context, for token trees' nodes
MAX_PASS_ROWS = 64  # longer causal chains are fed in passes of this many rows (same numbers)
_stop: contextvars.ContextVar[Any] = contextvars.ContextVar("specdec_gguf_stop", default=None)
LLAMACPP_HINT = "the llama.cpp backend (--backend llamacpp) can run it"


# -- the compiled kernels ------------------------------------------------------------------------

_libraries: dict[str, ctypes.CDLL] = {}


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded (no compiler, unwritable cache)."""


class PathUnavailable(ValueError):
    """The environment asks for a path of the kernel (:data:`PATH_ENV`, :data:`PORTABLE_ENV`) that
    this CPU or this build does not have, or names none: the kernel does not run another instead."""


class UnreadableGGUF(ValueError):
    """A path that is not a whole GGUF file: missing, another kind of file, truncated or damaged.
    Whatever here reads a GGUF file (:func:`_reader`, :class:`GGUFWeights`) raises this one kind for
    such a file, never the reader's own IndexError or numpy's errors."""


class Unsupported(ValueError):
    """A readable GGUF file that specdec's kernel does not run (its architecture, a tensor type, an
    option of the model); its message ends with :data:`LLAMACPP_HINT`."""


def unreadable(path: str | Path, err: BaseException) -> UnreadableGGUF:
    """The error for a file at ``path`` that the GGUF reader (or the model's layout) trips over."""
    try:
        size = f"{Path(path).stat().st_size:,} bytes; "
    except OSError:
        size = ""
    return UnreadableGGUF(f"{path} is not a readable GGUF file ({size}truncated or damaged: "
                          f"{type(err).__name__}: {str(err)[:120]})")


def library(variant: str = "native") -> ctypes.CDLL:
    """The compiled ``linear_gguf.c``: ``"native"`` (every path; it runs the best one the CPU has,
    which the library itself detects), or the test builds ``"portable"`` (the portable path alone)
    and ``"emulated-vnni"``, or the measurement build ``"kv-f16"`` (:data:`FLAGS_KV_F16`). Built once
    per source and flags into :func:`specdec.kernels.kernels_dir` (rebuilt where damaged). Raises
    :class:`KernelUnavailable`."""
    flags = {"native": FLAGS_NATIVE, "portable": FLAGS_PORTABLE, "emulated-vnni": FLAGS_EMULATED_VNNI,
             "kv-f16": FLAGS_KV_F16}
    if variant not in flags:
        raise ValueError(f"variant must be one of {', '.join(flags)}, got {variant!r}")
    lib = _libraries.get(variant)
    if lib is None:
        lib = _build_and_open(flags[variant], variant)
        if variant == "native":
            _choose_path(lib)  # kept only once the path asked for runs: every call refuses a path it lacks
        _libraries[variant] = lib
    return lib


_asked_by: str | None = None  # "$SPECDEC_GGUF_PATH=avx2": the variable that chose the running path, if one did


def asked_path() -> tuple[str, str] | None:
    """The path the environment asks for, as (the variable that asks, its value as given):
    $SPECDEC_GGUF_PORTABLE (any value but 0) asks for the portable path, else $SPECDEC_GGUF_PATH
    names one; None where neither asks (the best path this CPU has runs)."""
    if os.environ.get(PORTABLE_ENV, "") not in ("", "0"):
        return PORTABLE_ENV, os.environ[PORTABLE_ENV]
    asked = os.environ.get(PATH_ENV, "").strip()
    return (PATH_ENV, asked) if asked else None


def path_asked_by() -> str | None:
    """How the environment chose the path the native library runs (``"$SPECDEC_GGUF_PATH=portable"``),
    or None where the best path this CPU has runs."""
    return _asked_by


def _choose_path(lib: ctypes.CDLL) -> None:
    """The best path this CPU has, unless the environment asks for another (:func:`asked_path`).
    Raises :class:`PathUnavailable` for a name that is no path, or a path this CPU or build lacks:
    a path asked for and not run would change the numbers without a word."""
    global _asked_by
    asked = asked_path()
    if asked is None:
        _asked_by = None
        return
    variable, value = asked
    name = "portable" if variable == PORTABLE_ENV else value.lower()
    has = available_paths(lib)
    if name not in PATHS:
        raise PathUnavailable(f"${variable}={value!r} names no path of specdec's GGUF kernel (it takes "
                              f"{', '.join(PATHS)}; this CPU runs {', '.join(has)})")
    if name not in has or lib.gguf_set_path(PATHS.index(name)) != 0:
        raise PathUnavailable(f"${variable}={value}: this CPU (or this build) cannot run the GGUF kernel's {name} "
                              f"path; it runs {', '.join(has)}")
    _asked_by = f"${variable}={value}"


def available_paths(lib: ctypes.CDLL | None = None) -> list[str]:
    """The kernel's paths this CPU runs (and the library carries), portable first."""
    mask = (lib or library()).gguf_cpu_paths()
    return [name for i, name in enumerate(PATHS) if (mask >> i) & 1]


def kernel_path(lib: ctypes.CDLL | None = None) -> str:
    """The path the kernels run now: a name of :data:`PATHS`."""
    return PATHS[(lib or library()).gguf_path()]


@contextlib.contextmanager
def running_path(name: str, lib: ctypes.CDLL | None = None) -> Iterator[None]:
    """Within the block, the library runs path ``name`` (for tests and measurements); ValueError
    where this CPU or the build lacks it."""
    lib = lib or library()
    was = lib.gguf_path()
    if name not in PATHS or lib.gguf_set_path(PATHS.index(name)) != 0:
        raise ValueError(f"the GGUF kernel has no {name!r} path on this CPU; it has {', '.join(available_paths(lib))}")
    try:
        yield
    finally:
        lib.gguf_set_path(was)


def _build_and_open(flags: list[str], variant: str) -> ctypes.CDLL:
    return kernels.build_library(SOURCE, flags, name=f"linear_gguf-{variant}", interface="gguf_interface", libs=LIBS,
                                 error=KernelUnavailable, serial_fallback=True)


# -- the interface, as the library describes it ----------------------------------------------------


class InterfaceMismatch(KernelUnavailable, kernels.InterfaceMismatch):
    """The GGUF kernel's description of its interface (its prototypes, its layer record) and what
    this module passes it disagree: the kernel cannot be used."""


def declare(lib: ctypes.CDLL) -> None:
    """Declares every exported function of a build of ``linear_gguf.c`` to ctypes from the
    prototypes it gives (``gguf_interface``, :func:`specdec.kernels.declare`), and keeps its layer
    record's fields for :func:`layer_record`."""
    try:
        kernels.declare(lib, "gguf_interface")
    except kernels.InterfaceMismatch as err:
        raise InterfaceMismatch(str(err)) from None


def layer_fields(lib: ctypes.CDLL | None = None) -> tuple[tuple[str, int], ...]:
    """The fields of a layer's record for ``gguf_forward_seqs``, (name, count) in the library's order."""
    return kernels.record_fields(lib or library())


def layer_record(values: dict[str, Sequence[int] | int], fields: Sequence[tuple[str, int]]) -> list[int]:
    """A layer's record: ``values`` (field name -> its ints, or one int) placed as ``fields`` (the
    library's :func:`layer_fields`) lay them out. Raises :class:`InterfaceMismatch` naming the first
    field that the two sides do not share, or whose count differs."""
    record: list[int] = []
    for name, count in fields:
        if name not in values:
            raise InterfaceMismatch(f"the GGUF kernel's layer record has a field {name!r} ({count} values) that this "
                                    f"module does not fill (it fills {', '.join(values)})")
        value = values[name]
        got = [int(value)] if isinstance(value, int) else [int(v) for v in value]
        if len(got) != count:
            raise InterfaceMismatch(f"the GGUF kernel's layer record field {name!r} holds {count} values, this module "
                                    f"gives {len(got)}")
        record += got
    extra = [name for name in values if name not in dict(fields)]
    if extra:
        raise InterfaceMismatch(f"this module fills a layer record field {extra[0]!r} that the GGUF kernel's record "
                                f"lacks (it has {', '.join(name for name, _ in fields)})")
    return record


def portable_path() -> contextlib.AbstractContextManager[None]:
    """Within the block, the native library runs its portable C path (for tests)."""
    return running_path("portable")


def type_name(ggml_type: int) -> str:
    """ggml's name of a type id (e.g. 12 -> 'Q4_K')."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type {ggml_type}"


def row_bytes(ggml_type: int, n_in: int) -> int:
    """Bytes of one weight row of ``n_in`` values of ``ggml_type`` (-1: unsupported)."""
    return int(library().gguf_row_bytes(int(ggml_type), int(n_in)))


def matmul(weight: np.ndarray, ggml_type: int, n_in: int, x: torch.Tensor, *, threads: int = 1,
           lib: ctypes.CDLL | None = None, n_out: int | None = None) -> torch.Tensor:
    """x [n, n_in] fp32 times the GGUF tensor ``weight`` (its bytes, [n_out, row_bytes] uint8, or
    a float array [n_out, n_in]; or :func:`repack`'s bytes and type) transposed: [n, n_out] fp32,
    with the batch-invariant kernel. n_out: the rows to compute (default: every row the bytes hold;
    a repacked tensor holds a multiple of 8)."""
    lib = lib or library()
    rb = int(lib.gguf_row_bytes(int(ggml_type), int(n_in)))
    if rb < 0:
        raise ValueError(f"{type_name(ggml_type)} with {n_in} inputs is not supported by specdec's GGUF kernel")
    if not weight.flags["C_CONTIGUOUS"] or weight.nbytes % rb:
        raise ValueError("weight must be a C-contiguous array of whole rows")
    if n_out is None:
        n_out = weight.nbytes // rb
    elif not 0 < n_out <= weight.nbytes // rb:
        raise ValueError(f"n_out must be 1 .. {weight.nbytes // rb}, got {n_out}")
    rows = x.to(torch.float32).contiguous()
    if rows.dim() != 2 or rows.shape[1] != n_in:
        raise ValueError(f"x must be [n, {n_in}], got {list(x.shape)}")
    y = torch.empty(rows.shape[0], n_out, dtype=torch.float32)
    rc = lib.gguf_matmul(int(ggml_type), weight.ctypes.data, n_out, n_in, rows.data_ptr(), rows.shape[0],
                         y.data_ptr(), 0, threads)
    if rc != 0:
        raise RuntimeError(f"gguf_matmul failed ({rc})")
    return y


def repack(weight: np.ndarray, ggml_type: int, n_in: int, lib: ctypes.CDLL | None = None) -> tuple[np.ndarray, int] | None:
    """A tensor of a type the vector kernels take 8 outputs at a time (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    IQ4_NL, Q4_K, Q5_K; its bytes, whole rows of the file's layout) with its rows repacked eight at a time, the layout the kernel's vector paths
    multiply without rearranging it (``linear_gguf.c``, "rows repacked eight at a time"): (the new
    bytes, uint8, the row count rounded up to a multiple of 8; the type id that names the layout to
    :func:`matmul`, the kernel and :func:`dequantize_rows`). None for another type. Every path gives
    the same bits on either layout."""
    lib = lib or library()
    packed_type = int(lib.gguf_repacked_type(int(ggml_type)))
    if packed_type < 0:
        return None
    rb = int(lib.gguf_row_bytes(int(ggml_type), int(n_in)))
    if rb < 0 or not weight.flags["C_CONTIGUOUS"] or weight.nbytes % rb or weight.nbytes == 0:
        raise ValueError("weight must be a C-contiguous array of whole rows")
    n_out = weight.nbytes // rb
    out = np.empty(int(lib.gguf_repacked_bytes(int(ggml_type), n_out, int(n_in))), dtype=np.uint8)
    if lib.gguf_repack(int(ggml_type), weight.ctypes.data, n_out, int(n_in), out.ctypes.data) != 0:
        raise ValueError(f"{type_name(ggml_type)} with {n_in} inputs cannot be repacked")
    return out, packed_type


def dequantize_rows(weight: np.ndarray, ggml_type: int, n_in: int, ids: Sequence[int],
                    lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rows ``ids`` of a GGUF tensor as fp32 [len(ids), n_in] (what ``gguf.quants.dequantize``
    computes for them)."""
    lib = lib or library()
    index = np.ascontiguousarray(np.asarray(list(ids), dtype=np.int64))
    out = torch.empty(len(index), n_in, dtype=torch.float32)
    if lib.gguf_get_rows(int(ggml_type), weight.ctypes.data, n_in, index.ctypes.data, len(index), out.data_ptr()) != 0:
        raise ValueError(f"{type_name(ggml_type)} with {n_in} inputs is not supported by specdec's GGUF kernel")
    return out


def quantize_activations(x: torch.Tensor, block: int, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's quantization of activation rows x [n, n_in] fp32 in blocks of ``block`` (256
    for the K types, 32 for the others): (q [n, n_in] int8, d [n, n_in / block] fp32), x ~ q * d."""
    lib = lib or library()
    rows = x.to(torch.float32).contiguous()
    n, n_in = rows.shape
    q = torch.empty(n, n_in, dtype=torch.int8)
    d = torch.empty(n, n_in // block, dtype=torch.float32)
    lib.gguf_quantize_rows(rows.data_ptr(), n, n_in, block, q.data_ptr(), d.data_ptr())
    return q, d


# -- reading the file -----------------------------------------------------------------------------


class _Bytes(bytes):
    """A string element of a GGUF array as :func:`_reader` keeps it with ``elements``: the bytes
    themselves (transformers decodes a part with ``list(part)``, fast on bytes and slow on a numpy
    view), with numpy's ``tobytes`` for ``gguf``'s own ``ReaderField.contents``."""

    def tobytes(self) -> bytes:
        return bytes(self)


def _reader(path: str | Path, *, elements: bool = False) -> Any:
    """A ``gguf.GGUFReader`` on ``path`` (memory-mapped) whose arrays are parsed in one pass over
    the header's bytes. ``GGUFReader`` takes a numpy view per element, 1.5 million for Qwen's
    151,936-token vocabulary and merges (tens of seconds to minutes on 2 cores). By default arrays
    of numbers are one view and arrays of strings are skipped (their ``contents()`` is empty: this
    backend never reads the vocabulary); with ``elements`` every element is a part of its own, a
    string element its bytes, the fields, parts and data indices ``GGUFReader`` gives, which is what
    transformers reads (:func:`specdec.tokenizers.tokenizer_from_gguf`)."""
    from gguf import GGUFValueType
    from gguf.gguf_reader import GGUFReader  # the class itself, even where a caller stands in for gguf.GGUFReader

    class _Reader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, count, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            kinds = [GGUFValueType.ARRAY, itype]
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None and count:
                values = self._get(offs, nptype, count)
                if not elements:  # [itype, count, values]
                    return 12 + int(values.nbytes), [raw_itype, alen, values], [2], kinds
                parts = [raw_itype, alen, *(values[i:i + 1] for i in range(count))]  # one part per element
                return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), kinds
            if itype == GGUFValueType.STRING and count:  # [itype, count(, len0, str0, len1, str1, ...)]
                buf = memoryview(self.data)
                parts = [raw_itype, alen]
                for _ in range(count):
                    n = int.from_bytes(buf[offs:offs + 8], "little")
                    if elements:
                        parts += (n, _Bytes(buf[offs + 8:offs + 8 + n]))
                    offs += 8 + n
                return offs - orig_offs, parts, list(range(3, len(parts), 2)), kinds
            return super()._get_field_parts(orig_offs, raw_type)

    try:
        return _Reader(str(path))
    except Exception as err:  # noqa: BLE001 - whatever the reader trips over, the file is not a whole GGUF
        raise unreadable(path, err) from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value if value is not None else default


class _Tensor:
    """One tensor of the file: ggml type, shape as (n_out, n_in), its bytes (memory-mapped)."""

    def __init__(self, t: Any) -> None:
        self.name = t.name
        self.type = int(t.tensor_type)
        dims = [int(v) for v in t.shape]  # GGUF order: n_in first
        self.n_in = dims[0]
        self.n_out = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        self.data = t.data  # numpy memmap view: [n_out, row bytes] uint8, or floats
        self.ptr = int(t.data.ctypes.data)

    def vector(self) -> torch.Tensor:
        """A small F32/F16/BF16 tensor (a norm or a bias) as an fp32 copy."""
        if self.type == 0:
            return torch.from_numpy(np.array(self.data, dtype=np.float32).reshape(-1))
        if self.type == 1:
            return torch.from_numpy(np.array(self.data).view(np.float16).astype(np.float32).reshape(-1))
        if self.type == 30:
            raw = np.array(self.data).view(np.uint16).astype(np.uint32) << 16
            return torch.from_numpy(raw.view(np.float32).reshape(-1))
        raise Unsupported(f"tensor {self.name} has type {self.type_name}, expected F32 for a norm or a bias; {LLAMACPP_HINT}")

    @property
    def type_name(self) -> str:
        return type_name(self.type)


def _rows(t: _Tensor, first: int, count: int, name: str) -> _Tensor:
    """Rows first .. first + count - 1 of a tensor, as a tensor of their own (a view of its bytes):
    phi3 stores Q, K and V in one tensor (attn_qkv) and gate and up in another (ffn_up)."""
    if first + count > t.n_out:
        raise UnreadableGGUF(f"tensor {t.name} has {t.n_out} rows, fewer than {first + count}")
    part = object.__new__(_Tensor)
    row_bytes = t.data.nbytes // t.n_out
    part.name, part.type, part.n_in, part.n_out = name, t.type, t.n_in, count
    part.data = t.data.reshape(t.n_out, -1)[first : first + count]
    part.ptr = t.ptr + first * row_bytes
    return part


def _take_rows(t: _Tensor, ids: np.ndarray, name: str) -> _Tensor:
    """Rows ``ids`` (ascending) of a tensor copied, in that order, into a contiguous tensor of
    their own in memory: a row of a quantized tensor is whole blocks of bytes, so its copy is the
    row itself (a trimmed head, :class:`TrimmedHead`)."""
    part = object.__new__(_Tensor)
    data = np.ascontiguousarray(t.data.reshape(t.n_out, -1)[ids])
    part.name, part.type, part.n_in, part.n_out = name, t.type, t.n_in, len(ids)
    part.data, part.ptr = data, int(data.ctypes.data)
    return part


def _drop_pages(view: np.ndarray) -> None:
    """Let go of the pages of a memory-mapped tensor that a repacked copy replaced: they leave this
    process's memory and stay in the file, read again if ever touched. (Kept, they double what the
    tensors hold: the default draft is 798 MB resident after a step, 628 MB with them let go, as
    much as without repacking.) Whole pages inside the tensor only; nothing where the
    view is not of a memory map or the platform has no madvise."""
    owner = view  # the array whose buffer is the map itself
    while isinstance(owner, np.ndarray) and not isinstance(owner.base, mmap.mmap):
        owner = owner.base
    if not isinstance(owner, np.ndarray) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = view.ctypes.data - (owner.ctypes.data - getattr(owner, "offset", 0) % mmap.ALLOCATIONGRANULARITY)  # in the map
    lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        owner.base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class _Fused:
    """Tensors that read the same input, multiplied in one kernel call (outputs side by side)."""

    def __init__(self, tensors: list[_Tensor], biases: list[torch.Tensor | None] | None = None) -> None:
        n_in = tensors[0].n_in
        for t in tensors:
            if t.type not in TYPE_NAMES:
                raise Unsupported(f"tensor {t.name} has type {t.type_name}, which specdec's GGUF backend does not "
                                 f"support ({', '.join(sorted(TYPE_NAMES.values()))}); {LLAMACPP_HINT}")
            if t.n_in != n_in:
                raise UnreadableGGUF(f"tensor {t.name} has {t.n_in} inputs, expected {n_in}")
        self.n_in = n_in
        self.width = sum(t.n_out for t in tensors)
        self.count = len(tensors)
        self.names = [t.name for t in tensors]
        self.tensors = list(tensors)  # the file's tensors (a tied head: the embedding itself)
        types, ptrs = [t.type for t in tensors], [t.ptr for t in tensors]
        # the grouped types' rows repacked eight at a time (a copy in memory, the file's pages let
        # go): what the vector kernels read fastest, the same bits
        self._packed: list[np.ndarray] = []
        if os.environ.get(REPACK_ENV, "1") != "0" and not _probing.get():
            lib = library()
            for i, t in enumerate(tensors):
                packed = repack(t.data, t.type, n_in, lib)  # None: a type without that layout
                if packed is not None:
                    self._packed.append(packed[0])
                    types[i], ptrs[i] = packed[1], int(packed[0].ctypes.data)
                    _drop_pages(t.data)  # a tied embedding's rows come back from the file page by page, as looked up
        self._types = (ctypes.c_int32 * len(tensors))(*types)
        self._ptrs = (ctypes.c_uint64 * len(tensors))(*ptrs)
        self._outs = (ctypes.c_int64 * len(tensors))(*[t.n_out for t in tensors])
        self.types, self.ptrs, self.outs = (ctypes.addressof(a) for a in (self._types, self._ptrs, self._outs))
        self.biases = 0
        if biases is not None and any(b is not None for b in biases):
            self._bias_tensors = [b.contiguous() if b is not None else None for b in biases]
            self._bias_ptrs = (ctypes.c_uint64 * len(tensors))(*[b.data_ptr() if b is not None else 0 for b in self._bias_tensors])
            self.biases = ctypes.addressof(self._bias_ptrs)

    def __call__(self, lib: ctypes.CDLL, x: torch.Tensor, y: torch.Tensor, n: int, accumulate: bool, threads: int) -> None:
        rc = lib.gguf_matmul_multi(self.count, self.types, self.ptrs, self.outs, self.biases, self.n_in, x.data_ptr(),
                                   n, y.data_ptr(), y.shape[1], int(accumulate), threads)
        if rc != 0:
            raise RuntimeError(f"gguf_matmul_multi failed ({rc})")


class _Layer:
    def __init__(self, get: Any, i: int, arch: str, widths: tuple[int, int, int] = (0, 0, 0), ffn: int = 0) -> None:
        p = f"blk.{i}."
        self.norm1 = get(p + "attn_norm.weight").vector()
        self.norm2 = get(p + "ffn_norm.weight").vector()
        fused = get(p + "attn_qkv.weight", optional=True)  # phi3: Q, K and V rows in one tensor
        if fused is not None:
            q_rows, kv_rows, _ = widths
            qkv = [_rows(fused, 0, q_rows, fused.name + " (Q)"), _rows(fused, q_rows, kv_rows, fused.name + " (K)"),
                   _rows(fused, q_rows + kv_rows, kv_rows, fused.name + " (V)")]
        else:
            qkv = [get(p + f"attn_{x}.weight") for x in "qkv"]
        biases = arch in QKV_BIASES
        bias = [get(p + f"attn_{x}.bias", optional=True) for x in "qkv"] if biases else [None] * 3
        self.qkv = _Fused(qkv, [b.vector() if b is not None else None for b in bias])
        self.o = _Fused([get(p + "attn_output.weight")])
        gate = get(p + "ffn_gate.weight", optional=True)
        if gate is None:  # phi3: gate and up rows in one tensor, gate first
            up = get(p + "ffn_up.weight")
            gate, up = _rows(up, 0, ffn, up.name + " (gate)"), _rows(up, ffn, ffn, up.name + " (up)")
        else:
            up = get(p + "ffn_up.weight")
        self.gate_up = _Fused([gate, up])
        self.down = _Fused([get(p + "ffn_down.weight")])
        qk = arch in QK_NORMS
        self.q_norm = get(p + "attn_q_norm.weight").vector() if qk else None
        self.k_norm = get(p + "attn_k_norm.weight").vector() if qk else None
        gemma = arch in GEMMA
        self.post1 = get(p + "post_attention_norm.weight").vector() if gemma else None
        self.post2 = get(p + "post_ffw_norm.weight").vector() if gemma else None
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin), set by GGUFWeights
        self.window = 0  # > 0: a sliding-window layer, set by GGUFWeights

    def fields(self) -> dict[str, Sequence[int] | int]:
        """This layer's fields for gguf_forward_seqs, by the names of the kernel's layer record
        (:func:`layer_record` lays them out): types, pointers and widths of its tensors."""
        q, o, gu, down = self.qkv, self.o, self.gate_up, self.down
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        assert self.rope is not None
        return {"qkv_type": q._types, "qkv_ptr": q._ptrs, "qkv_out": q._outs,
                "qkv_bias": q._bias_ptrs if q.biases else (0, 0, 0),
                "o_type": o._types[0], "o_ptr": o._ptrs[0], "o_out": o._outs[0],
                "gu_type": gu._types, "gu_ptr": gu._ptrs, "gu_out": gu._outs,
                "down_type": down._types[0], "down_ptr": down._ptrs[0], "down_out": down._outs[0],
                "norm1": self.norm1.data_ptr(), "norm2": self.norm2.data_ptr(),
                "q_norm": ptr(self.q_norm), "k_norm": ptr(self.k_norm), "post1": ptr(self.post1), "post2": ptr(self.post2),
                "cos": self.rope[0].data_ptr(), "sin": self.rope[1].data_ptr(), "window": self.window}


def rope_tables(base: float, head_dim: int, positions: int, scale: float = 1.0,
                factors: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, d / 2] fp32 of the angles (p * scale) * base^(-2i / d) / factors[i],
    computed in float64 and rounded once (scale < 1: linear rope scaling, positions squeezed by it;
    factors: Llama 3's rope_freqs.weight, each frequency divided by its factor)."""
    half = head_dim // 2
    inv = base ** (-2.0 * np.arange(half, dtype=np.float64) / head_dim)  # [d/2]
    if factors is not None:
        inv = inv / factors
    theta = (np.arange(positions, dtype=np.float64) * scale)[:, None] * inv[None]  # [positions, d/2]
    return torch.from_numpy(np.cos(theta).astype(np.float32)), torch.from_numpy(np.sin(theta).astype(np.float32))


_probing: contextvars.ContextVar[bool] = contextvars.ContextVar("specdec_gguf_probing", default=False)


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Within the block, :class:`GGUFWeights` reads a file and checks that the kernel runs it
    without repacking its tensors (weights only looked at, never multiplied: ``auto``'s probe,
    :func:`specdec.backends.choice.kernel_refusal`, seconds less for the default pair)."""
    token = _probing.set(True)
    try:
        yield
    finally:
        _probing.reset(token)


def _as_file_errors(init: Any) -> Any:
    """:class:`GGUFWeights`' constructor, whose stray errors on a file's metadata or tensor table
    (a key missing or of another type, a count out of range: a damaged file) are
    :class:`UnreadableGGUF` naming the file; the ValueErrors it raises itself (its refusals, a bad
    argument) pass as they are."""

    @functools.wraps(init)
    def read(self: Any, path: str | Path, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, path, *args, **kwargs)
        except (TypeError, KeyError, IndexError, OverflowError) as err:
            raise unreadable(path, err) from None

    return read


class GGUFWeights:
    """A GGUF file of the llama family, memory-mapped: its layers and its configuration. Shared by
    every :class:`GGUFCausalLM` on it (:meth:`GGUFCausalLM.fork`). Raises :class:`UnreadableGGUF`
    for a file that is not a whole GGUF (or whose metadata no model has), :class:`Unsupported` for
    one the kernel does not run."""

    @_as_file_errors
    def __init__(self, path: str | Path, *, n_ctx: int | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise UnreadableGGUF(f"{self.path}: no such GGUF file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise UnreadableGGUF(f"{self.path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        reader = self.reader = _reader(self.path)
        arch = _field(reader, "general.architecture")
        if arch not in ARCHITECTURES:
            raise Unsupported(f"{self.path}: architecture {arch!r} is not one specdec's GGUF backend runs "
                             f"({', '.join(ARCHITECTURES)}); {LLAMACPP_HINT}")
        self.architecture = arch
        self.neox = ARCHITECTURES[arch]
        key = lambda name, default=None: _field(reader, f"{arch}.{name}", default)  # noqa: E731
        self.n_layers = int(key("block_count"))
        self.hidden = int(key("embedding_length"))
        self.ffn = int(key("feed_forward_length"))
        self.heads = int(key("attention.head_count"))
        self.kv_heads = int(key("attention.head_count_kv", self.heads))
        self.head_dim = int(key("attention.key_length", self.hidden // self.heads))
        if int(key("attention.value_length", self.head_dim)) != self.head_dim:
            raise Unsupported(f"{self.path}: keys and values of different widths are not supported; {LLAMACPP_HINT}")
        if int(key("rope.dimension_count", self.head_dim)) != self.head_dim:
            raise Unsupported(f"{self.path}: partial rotary embeddings are not supported; {LLAMACPP_HINT}")
        # rope scaling as llama.cpp reads it: the factor (rope.scaling.factor, or the older
        # rope.scale_linear) squeezes positions linearly unless the type asks for another method
        scaling = key("rope.scaling.type", "linear")
        factor = float(key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0) or 0.0)
        if scaling not in (None, "none", "linear"):
            raise Unsupported(f"{self.path}: rope scaling ({scaling}) is not supported; {LLAMACPP_HINT}")
        self.rope_scale = 1.0 / factor if factor > 0 else 1.0
        if int(key("expert_count", 0) or 0) > 0:
            raise Unsupported(f"{self.path}: a mixture of experts is not supported; {LLAMACPP_HINT}")
        if self.heads % self.kv_heads:
            raise UnreadableGGUF(f"{self.path}: {self.heads} heads do not share {self.kv_heads} kv heads evenly")
        self.rope_base = float(key("rope.freq_base", 10000.0))
        self.eps = float(key("attention.layer_norm_rms_epsilon", 1e-5))
        self.gemma = arch in GEMMA
        self.activation = ACT_GEGLU if self.gemma else ACT_SWIGLU
        # Gemma multiplies the embedded tokens by sqrt(hidden), rounded to fp32 (llama.cpp: sqrtf(n_embd))
        self.embed_scale = float(np.sqrt(np.float32(self.hidden))) if self.gemma else 1.0
        # the attention's scale: llama.cpp's attention.scale where the file has one; gemma3's
        # query_pre_attn_scalar (1/sqrt of it); else 1/sqrt(head_dim) (gemma3 27B: 1/sqrt(hidden/heads))
        scalar = key("attention.query_pre_attn_scalar")
        if key("attention.scale") is not None and float(key("attention.scale")) != 0.0:
            self.attn_scale = float(key("attention.scale"))
        elif scalar is not None and float(scalar) > 0:
            self.attn_scale = 1.0 / float(np.sqrt(float(scalar)))
        elif self.gemma and self.n_layers == 62:
            self.attn_scale = 1.0 / float(np.sqrt(self.hidden // self.heads))
        else:
            self.attn_scale = 1.0 / float(np.sqrt(self.head_dim))
        # sliding-window layers (gemma3): every layer but the last of each `pattern` sees only the
        # last `window` positions, with its own rope base and no rope scaling
        self.window = int(key("attention.sliding_window", 0) or 0) if self.gemma else 0
        pattern = key("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN) if self.gemma else 0
        if self.window > 0:
            if isinstance(pattern, (list, tuple, np.ndarray)):  # one flag per layer
                self.sliding = [bool(v) for v in pattern][: self.n_layers]
                if len(self.sliding) != self.n_layers:
                    raise Unsupported(f"{self.path}: attention.sliding_window_pattern has {len(pattern)} entries for "
                                     f"{self.n_layers} layers; {LLAMACPP_HINT}")
            else:
                period = int(pattern)
                self.sliding = [period == 0 or i % period < period - 1 for i in range(self.n_layers)]
        else:
            self.sliding = [False] * self.n_layers
        self.local_rope_base = float(key("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
        self.n_ctx_train = int(key("context_length", 0) or 0)
        self.max_context = context_size(n_ctx, self.n_ctx_train, self.path)  # refuses more than the trained context
        self.eos_ids = [int(v) for v in (_field(reader, "tokenizer.ggml.eos_token_id"),
                                         _field(reader, "tokenizer.ggml.eot_token_id"),
                                         _field(reader, "tokenizer.ggml.eom_token_id")) if v is not None]
        self.eos_ids = list(dict.fromkeys(self.eos_ids))

        tensors = {t.name: _Tensor(t) for t in reader.tensors}

        def get(name: str, optional: bool = False) -> _Tensor | None:
            t = tensors.get(name)
            if t is None and not optional:
                raise UnreadableGGUF(f"{self.path}: tensor {name} is missing")
            return t

        self.embed = get("token_embd.weight")
        if any(name.endswith("_exps.weight") for name in tensors):
            raise Unsupported(f"{self.path}: a mixture of experts is not supported; {LLAMACPP_HINT}")
        self.head = _Fused([get("output.weight", optional=True) or self.embed])
        if self.embed.type not in TYPE_NAMES:
            raise Unsupported(f"tensor {self.embed.name} has type {self.embed.type_name}, which specdec's GGUF backend "
                             f"does not support; {LLAMACPP_HINT}")
        self.vocab_size = self.head.width
        self.final_norm = get("output_norm.weight").vector()
        if any(name.startswith("rope_factors_") for name in tensors):  # phi3's LongRoPE
            raise Unsupported(f"{self.path}: rope scaling (LongRoPE factors) is not supported; {LLAMACPP_HINT}")
        widths = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.layers = [_Layer(get, i, arch, widths, self.ffn) for i in range(self.n_layers)]
        for layer in self.layers:
            if ((layer.qkv.width, layer.qkv.n_in, layer.o.width, layer.o.n_in, layer.gate_up.width, layer.gate_up.n_in,
                 layer.down.width, layer.down.n_in) != ((self.heads + 2 * self.kv_heads) * self.head_dim, self.hidden,
                                                        self.hidden, self.heads * self.head_dim, 2 * self.ffn,
                                                        self.hidden, self.hidden, self.ffn)
                    or layer.qkv.count != 3 or layer.norm1.numel() != self.hidden or layer.norm2.numel() != self.hidden
                    or any(v is not None and v.numel() != self.head_dim for v in (layer.q_norm, layer.k_norm))
                    or any(v is not None and v.numel() != self.hidden for v in (layer.post1, layer.post2))):
                raise UnreadableGGUF(f"{self.path}: a layer's tensor shapes do not match the model's configuration")
        self.capacity = self.max_context + TREE_SLACK  # cache rows, and rope positions tabulated
        # Llama 3's rope scaling: rope_freqs.weight divides each frequency (llama.cpp's freq_factors)
        factors = get("rope_freqs.weight", optional=True)
        self.rope_factors = factors.vector().numpy().astype(np.float64) if factors is not None else None
        if self.rope_factors is not None and (self.gemma or self.rope_factors.shape != (self.head_dim // 2,)):
            raise Unsupported(f"{self.path}: rope_freqs.weight does not fit this model; {LLAMACPP_HINT}")
        self.cos, self.sin = rope_tables(self.rope_base, self.head_dim, self.capacity, self.rope_scale, self.rope_factors)
        local = rope_tables(self.local_rope_base, self.head_dim, self.capacity) if any(self.sliding) else None
        for layer, sliding in zip(self.layers, self.sliding):
            layer.rope = local if sliding else (self.cos, self.sin)
            layer.window = self.window if sliding else 0
        self.records = self.layer_records()
        self.weight_bytes = sum(int(t.data.nbytes) for t in tensors.values())
        types_seen = sorted({tensors[n].type_name for n in tensors if len(tensors[n].data.shape) > 1})
        self.description = f"{arch} {self.n_layers}x{self.hidden} ({'/'.join(types_seen)})"

    def layer_records(self, fields: Sequence[tuple[str, int]] | None = None) -> np.ndarray:
        """The layers' records for gguf_forward_seqs, int64 [layers, fields], laid out as ``fields``
        (default: the library's :func:`layer_fields`)."""
        fields = layer_fields() if fields is None else fields
        return np.array([layer_record(layer.fields(), fields) for layer in self.layers], dtype=np.uint64).view(np.int64)


class TrimmedHead:
    """The output head of :class:`GGUFWeights` restricted to a subset of the vocabulary, ``ids``:
    the head's rows for those ids copied once into a contiguous tensor of their own (repacked as
    the full head is), which a draft model scores instead of every row. A pass's logits are still
    full rows [n, V]: the kept ids' logits (each computed as the full head computes it, bit for
    bit: a row's result depends on that row of weights alone), -inf elsewhere. A draft's
    distribution q is then 0 outside the subset, which every verification rule handles exactly;
    what it costs is acceptance where the target's token lies outside (docs/drafters.md, "A
    trimmed draft vocabulary")."""

    def __init__(self, weights: "GGUFWeights", ids: Sequence[int]) -> None:
        kept = sorted({int(i) for i in ids})
        if not kept or not 0 <= kept[0] <= kept[-1] < weights.vocab_size:
            raise ValueError(f"a trimmed head keeps 1 .. {weights.vocab_size} ids of 0 .. {weights.vocab_size - 1}")
        source = weights.head.tensors[0]
        self.vocab_size = weights.vocab_size
        self.ids = torch.tensor(kept, dtype=torch.int64)  # [m], ascending
        self.rows = _Fused([_take_rows(source, np.asarray(kept, dtype=np.int64), f"{source.name} ({len(kept)} rows)")])

    @property
    def size(self) -> int:
        """How many ids it scores."""
        return int(self.ids.numel())

    def __call__(self, lib: ctypes.CDLL, x: torch.Tensor, logits: torch.Tensor, n: int, threads: int) -> None:
        """Logits [n, V] of the normed rows x [n, H]: the kept ids' scores, -inf elsewhere."""
        kept = torch.empty(n, self.size, dtype=torch.float32)  # [n, m]
        self.rows(lib, x, kept, n, False, threads)
        logits.fill_(float("-inf"))
        logits.index_copy_(1, self.ids, kept)


# -- the backend ------------------------------------------------------------------------------------


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_gguf_native(
    path: str | Path,
    *,
    n_threads: int | None = None,
    n_ctx: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> "GGUFCausalLM":
    """Load a local llama, qwen2, qwen3, phi3 or gemma3 ``.gguf`` file into a :class:`GGUFCausalLM` (one KV cache).

    n_threads: default the CPUs this process may use. n_ctx: the context length in tokens, reported
    as ``max_context`` (default :data:`DEFAULT_CTX`, or the model's trained context if shorter; more
    than the trained context is refused, a :class:`~specdec.backends.base.ContextSizeError`). The KV
    cache holds ``n_ctx`` + :data:`TREE_SLACK` positions (:attr:`GGUFCausalLM.cache_bytes`; its pages
    are taken as it fills). eos_token_ids: default the GGUF's
    end-of-sequence (and end-of-turn) tokens. Raises ``ValueError`` naming the file for a missing
    or non-GGUF file, an architecture or tensor type this backend does not run (the llama.cpp
    backend may), and :class:`KernelUnavailable` when the kernel cannot be compiled.
    """
    context_size(n_ctx, 0, path)  # a bad value is refused before the file is read
    weights = GGUFWeights(path, n_ctx=n_ctx)
    return GGUFCausalLM(weights, n_threads=n_threads, eos_token_ids=eos_token_ids)


def available() -> bool:
    """Always: the kernel is compiled when a model first loads, and a failure there is
    :class:`KernelUnavailable` (the table asks each backend, :meth:`specdec.backends.table.Backend.available`)."""
    return True


def load(path: str | Path, *, n_threads: int | None = None, n_ctx: int | None = None,
         eos_token_ids: Sequence[int] | None = None, cache_dir: str | Path | None = None) -> "GGUFCausalLM":
    """The table's loader for this backend (:meth:`specdec.backends.table.Backend.load`):
    :func:`load_gguf_native`. The kernel measures nothing at load, and its library is kept where
    :func:`specdec.kernels.use_cache_dir` says, so ``cache_dir`` is not read here."""
    return load_gguf_native(path, n_threads=n_threads, n_ctx=n_ctx, eos_token_ids=eos_token_ids)


class GGUFCausalLM(ModelFacts):
    """One sequence's view of a GGUF model on specdec's batch-invariant kernels.

    Implements :class:`~specdec.backends.base.CausalLM` with token trees (``attend`` and
    ``positions``) and cache snapshots. Logits are float32 [rows, V]. The KV cache is fp32,
    preallocated for ``max_context`` + :data:`TREE_SLACK` positions (pages are touched as used).
    """

    backend_name = GGUF  # its row in specdec.backends.table
    capabilities = frozenset({TREES, SNAPSHOTS})
    passes: Any = None  # a specdec.backends.shared.SharedPasses this sequence's passes run in (a slot), or None

    def __init__(self, weights: GGUFWeights, *, n_threads: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, head: TrimmedHead | None = None) -> None:
        if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads <= 0):
            raise ValueError(f"n_threads must be a positive integer, got {n_threads!r}")
        self.weights = w = weights
        self.head = head  # None: the full head scores every id; a TrimmedHead: only its ids (a draft)
        self.lib = library()
        self.n_threads = n_threads or default_threads()
        self._vocab = w.vocab_size
        self._max_context = w.max_context
        eos = list(eos_token_ids) if eos_token_ids is not None else list(w.eos_ids)
        self.generation_config = types.SimpleNamespace(eos_token_id=eos)  # what eos_token_ids() reads
        # [layers, 2 (keys, values), kv heads, capacity, head dim] fp32
        self._cache = torch.empty(w.n_layers, 2, w.kv_heads, w.capacity, w.head_dim, dtype=torch.float32)
        self._layer_stride = 2 * w.kv_heads * w.capacity * w.head_dim * 4  # bytes
        self._half_stride = w.kv_heads * w.capacity * w.head_dim * 4
        self._length = 0
        self._tokens: list[int] = []
        self._pos = torch.zeros(w.capacity, dtype=torch.int64)  # the position of each cache row (sliding windows read it)

    @property
    def cache_bytes(self) -> int:
        """Bytes of this sequence's KV cache once every position is used (its pages are taken as it fills)."""
        return self._cache.numel() * self._cache.element_size()

    def fork(self) -> "GGUFCausalLM":
        """Another cache (empty) on the same weights and settings (its head too)."""
        return GGUFCausalLM(self.weights, n_threads=self.n_threads, eos_token_ids=self.generation_config.eos_token_id,
                            head=self.head)

    def trimmed(self, ids: Sequence[int] | None) -> "GGUFCausalLM":
        """Another cache (empty) on the same weights whose head scores only ``ids`` (a
        :class:`TrimmedHead`, its rows copied once here and shared by its forks); None: the full
        head. For a draft model: its logits are -inf outside ``ids``."""
        head = None if ids is None else TrimmedHead(self.weights, ids)
        return GGUFCausalLM(self.weights, n_threads=self.n_threads, eos_token_ids=self.generation_config.eos_token_id,
                            head=head)

    # -- the CausalLM protocol ------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def identity(self) -> dict[str, Any]:
        """What the planner's measurements of this backend are keyed by (with the machine and the
        class; :func:`specdec.measurements.cost_key`): the GGUF file, the threads and the kernel
        library (its file name holds a hash of its source and flags: a changed kernel is measured
        again), the path it runs (each path's rows cost their own) and, for a trimmed head, its rows."""
        head = {} if self.head is None else {"head_rows": self.head.size}
        return {**file_identity(self.weights.path, self.n_threads), "kernel": Path(self.lib._name).stem,
                "path": kernel_path(self.lib), **head}

    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int],
        num_logits: int = 0,
        *,
        attend: torch.Tensor | None = None,
        positions: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append ``tokens``; return logits [len(tokens), V] float32, or only the last ``num_logits`` rows.

        ``attend`` [n, cache_len + n] bool and ``positions`` [n] replace the causal mask and the
        consecutive positions (token trees). Every row is computed as the one-token step at its
        position with the same visible keys would compute it, bit for bit.
        """
        pieces = self.pieces(tokens, num_logits, attend=attend, positions=positions)
        parts = []
        for piece in pieces:
            check_stop()  # between two passes of a long prompt (see stop_when)
            if self.passes is not None:  # a slot: its pieces run in passes shared with other sequences
                parts.append(self.passes.run(self, piece))
            else:
                parts.append(run_together([(self, piece)])[0])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def pieces(self, tokens: Sequence[int], num_logits: int = 0, *, attend: torch.Tensor | None = None,
               positions: Sequence[int] | None = None) -> list["Piece"]:
        """:meth:`forward`'s arguments checked and cut into the passes that run them, in order (a
        causal chain of more than :data:`MAX_PASS_ROWS` tokens takes several): each piece's rows are
        computed as they would be alone, whatever runs beside them (:func:`run_together`)."""
        tokens = [int(t) for t in tokens]
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        bad = [t for t in tokens if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{self._vocab - 1})")
        want = n if num_logits <= 0 else min(num_logits, n)
        start = self._length
        if start + n > self.weights.capacity:
            raise ValueError(f"{start + n} cached positions exceed the cache ({self._max_context} tokens of context "
                             f"and {TREE_SLACK} for trees); load the model with a larger n_ctx")
        pos = list(range(start, start + n)) if positions is None else [int(p) for p in positions]
        if len(pos) != n:
            raise ValueError(f"positions must have one entry per token ({n}), got {len(pos)}")
        if pos and not 0 <= min(pos) <= max(pos) < self.weights.capacity:
            raise ValueError(f"positions must lie in 0..{self.weights.capacity - 1}")
        if attend is not None:
            visible = torch.as_tensor(attend).to(torch.bool)
            if visible.shape != (n, start + n):
                raise ValueError(f"attend must be [n, cache_len + n] = [{n}, {start + n}], got {list(visible.shape)}")
            return [Piece(tokens, pos, visible.to(torch.uint8).contiguous(), want)]
        pieces = []
        for lo in range(0, n, MAX_PASS_ROWS):
            chunk = tokens[lo : lo + MAX_PASS_ROWS]
            m, first = len(chunk), start + lo
            mask = None if m == 1 else torch.ones(m, first + m, dtype=torch.uint8).tril(first)
            rows = min(m, max(0, want - (n - lo - m)))  # of the last `want` rows, those in this chunk
            pieces.append(Piece(chunk, pos[lo : lo + m], mask, rows))
        return pieces

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the cached positions ``indices`` (ascending), e.g. a tree's accepted path."""
        kept = [int(i) for i in indices]
        if any(not 0 <= i < self._length for i in kept):
            raise ValueError(f"keep() indices must lie in 0..{self._length - 1}")
        m = len(kept)
        if kept != list(range(m)):
            index = torch.as_tensor(kept, dtype=torch.long)
            self._cache[:, :, :, :m] = self._cache.index_select(3, index)
            self._pos[:m] = self._pos.index_select(0, index)
        self._tokens = [self._tokens[i] for i in kept]
        self._length = m

    def trim(self, length: int) -> None:
        """Forget every cached position >= ``length`` (no-op if the cache is shorter)."""
        if length < self._length:
            self._length = max(0, length)
            del self._tokens[self._length :]

    def reset(self) -> None:
        self._length = 0
        self._tokens = []

    def snapshot(self) -> CacheSnapshot:
        """The cache's tokens and its keys and values (fp32 bytes), for :meth:`restore`."""
        data = self._cache[:, :, :, : self._length].contiguous().numpy().tobytes()
        return CacheSnapshot(tuple(self._tokens), data)

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Replace the cache with ``snapshot`` (from :meth:`snapshot` of a backend on the same weights)."""
        w, length = self.weights, len(snapshot.tokens)
        shape = (w.n_layers, 2, w.kv_heads, length, w.head_dim)
        if len(snapshot.data) != int(np.prod(shape)) * 4 or length > w.capacity:
            raise ValueError("this snapshot was not taken from a backend on these weights")
        self.reset()
        if length:
            saved = np.frombuffer(snapshot.data, dtype=np.float32).reshape(shape)
            self._cache[:, :, :, :length] = torch.from_numpy(saved.copy())  # (a read-only buffer)
        self._pos[:length] = torch.arange(length)  # a snapshot holds a causal prefix: row i at position i
        self._tokens = list(snapshot.tokens)
        self._length = length


class Stopped(Exception):
    """A sequence's forward was stopped between two of its passes: the event of :func:`stop_when`
    was set. The cache holds the rows of the passes run before (its tokens say which), a prefix the
    next generation on it reuses or rolls back by absolute length."""


@contextlib.contextmanager
def stop_when(event: Any) -> Iterator[None]:
    """Within the block, forward passes on this thread stop once ``event`` (a ``threading.Event``)
    is set: a forward of several passes (a long prompt's, :data:`MAX_PASS_ROWS` rows each, or fewer
    in shared passes: :mod:`specdec.backends.shared`) raises :class:`Stopped` before its next pass,
    so a generation whose client left runs at most the pass under way, not the rest of its prompt."""
    token = _stop.set(event)
    try:
        yield
    finally:
        _stop.reset(token)


def stop_event() -> Any:
    """The event of the :func:`stop_when` block this thread runs in (None outside one)."""
    return _stop.get()


def check_stop() -> None:
    """Raise :class:`Stopped` where this thread's :func:`stop_when` event is set."""
    event = _stop.get()
    if event is not None and event.is_set():
        raise Stopped("the generation was stopped")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One sequence's rows of a pass: its tokens and their positions, its mask ([n, cached + n]
    uint8, or None for one row that sees every key) and how many of its last rows want logits."""

    tokens: list[int]
    pos: list[int]
    visible: torch.Tensor | None
    want: int

    def split(self, rows: int) -> tuple["Piece", "Piece"]:
        """The piece's first ``rows`` rows and the rest, as two pieces run one after the other (0 <
        rows < its rows). Each row of a piece sees only keys before it and itself (a causal chain, or
        a tree's nodes after their parents), so the first part's mask is its rows' mask up to its
        last row, and the rest sees the first part's rows as cached keys: both compute what the
        whole piece computes, bit for bit. The wanted rows (the last ``want``) go with their rows."""
        n = len(self.tokens)
        if not 0 < rows < n:  # (a piece of several rows has a mask)
            raise ValueError(f"a piece of {n} rows splits after 1..{n - 1} rows, not {rows}")
        cached = self.visible.shape[1] - n
        rest_want = min(self.want, n - rows)
        return (Piece(self.tokens[:rows], self.pos[:rows], self.visible[:rows, : cached + rows].contiguous(),
                      self.want - rest_want),
                Piece(self.tokens[rows:], self.pos[rows:], self.visible[rows:].contiguous(), rest_want))


def run_together(calls: Sequence[tuple[GGUFCausalLM, Piece]]) -> list[torch.Tensor]:
    """One pass of the weights for the pieces of several sequences (each a :class:`GGUFCausalLM`
    on the same :class:`GGUFWeights`, each at most once): each sequence's rows go to its own cache
    and attend to its own keys, and each row is computed as it would be alone, bit for bit (the
    kernel is batch-invariant). Returns each call's logits [want, V] float32, in order."""
    if not calls:
        return []
    first = calls[0][0]
    w, lib, threads = first.weights, first.lib, first.n_threads
    if any(model.weights is not w for model, _ in calls) or len({id(m) for m, _ in calls}) != len(calls):
        raise ValueError("run_together takes one piece of each sequence, all on the same weights")
    rows_of = [len(piece.tokens) for _, piece in calls]
    n, H, heads, kv, d = sum(rows_of), w.hidden, w.heads, w.kv_heads, w.head_dim
    ids = torch.tensor([t for _, piece in calls for t in piece.tokens], dtype=torch.int64)  # [n]
    position = torch.tensor([p for _, piece in calls for p in piece.pos], dtype=torch.int64)  # [n]
    x = torch.empty(n, H, dtype=torch.float32)  # [n, H]
    if lib.gguf_get_rows(w.embed.type, w.embed.ptr, H, ids.data_ptr(), n, x.data_ptr()) != 0:
        raise RuntimeError("the embedding lookup failed")
    if w.embed_scale != 1.0:  # Gemma: each element times sqrtf(hidden), one fp32 product
        x.mul_(torch.tensor(w.embed_scale, dtype=torch.float32))
    scratch = torch.empty(n * (H + (heads + 2 * kv) * d + 2 * heads * d + 3 * w.ffn), dtype=torch.float32)
    seqs = len(calls)
    counts = (ctypes.c_int64 * seqs)(*rows_of)
    visibles = (ctypes.c_uint64 * seqs)(*[0 if p.visible is None else p.visible.data_ptr() for _, p in calls])
    caches = (ctypes.c_uint64 * seqs)(*[m._cache.data_ptr() for m, _ in calls])
    starts = (ctypes.c_int64 * seqs)(*[m._length for m, _ in calls])
    for (model, piece) in calls:  # the positions of the rows this pass writes, for the sliding windows
        model._pos[model._length : model._length + len(piece.pos)] = torch.tensor(piece.pos, dtype=torch.int64)
    kposes = (ctypes.c_uint64 * seqs)(*[m._pos.data_ptr() for m, _ in calls])
    rc = lib.gguf_forward_seqs(w.records.ctypes.data, w.n_layers, H, heads, kv, d, w.ffn, int(w.neox), w.activation,
                               w.capacity, w.eps, w.attn_scale, x.data_ptr(), n, position.data_ptr(), seqs, counts,
                               visibles, caches, starts, kposes, scratch.data_ptr(), threads)
    if rc != 0:
        raise MemoryError("out of memory in the GGUF kernels") if rc == -2 else RuntimeError(f"gguf_forward_seqs failed ({rc})")
    wanted, at = [], 0
    for (model, piece), m in zip(calls, rows_of):
        model._length += m
        model._tokens.extend(piece.tokens)
        wanted += range(at + m - piece.want, at + m)
        at += m
    total = len(wanted)
    logits = torch.empty(total, w.vocab_size, dtype=torch.float32)  # [wanted rows, V]
    if total:
        last = x[wanted].contiguous()
        normed = torch.empty(total, H, dtype=torch.float32)
        lib.gguf_rmsnorm(last.data_ptr(), w.final_norm.data_ptr(), total, H, w.eps, normed.data_ptr())
        _score_heads(lib, w, [(model.head, piece.want) for model, piece in calls], normed, logits, threads)
        # The head quantizes its input rows, which reads a NaN as 0 (finite, uniform logits): a row
        # whose hidden state is not finite (damaged weights) gets NaN logits, for the decode loop to stop on.
        broken = ~torch.isfinite(last).all(dim=1)
        if bool(broken.any()):
            logits[broken] = float("nan")
    return list(logits.split([piece.want for _, piece in calls]))


def _score_heads(lib: ctypes.CDLL, w: GGUFWeights, heads: Sequence[tuple[TrimmedHead | None, int]],
                 normed: torch.Tensor, logits: torch.Tensor, threads: int) -> None:
    """Logits [rows, V] of the normed rows [rows, H], each sequence's rows (in order, ``heads``:
    its head and its row count) through its own head: the full head (None) or a trimmed one."""
    rows_of: dict[int, list[int]] = {}  # id(head) -> the rows it scores
    by_id: dict[int, TrimmedHead | None] = {}
    at = 0
    for head, want in heads:
        rows_of.setdefault(id(head), []).extend(range(at, at + want))
        by_id[id(head)] = head
        at += want
    for key, rows in rows_of.items():
        head, n = by_id[key], len(rows)
        if n == 0:
            continue
        x, out = (normed, logits) if n == at else (normed[rows].contiguous(), torch.empty(n, w.vocab_size))
        if head is None:
            w.head(lib, x, out, n, False, threads)
        else:
            head(lib, x, out, n, threads)
        if out is not logits:
            logits[rows] = out
