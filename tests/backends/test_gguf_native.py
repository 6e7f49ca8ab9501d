"""specdec's own GGUF backend (:mod:`specdec.backends.gguf`) and its quantized kernel.

The kernel (``csrc/linear_gguf.c``) multiplies fp32 rows by GGUF weights as stored (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, F32, F16, BF16). What is checked here:

- against float64 products with the dequantized weights (``gguf.quants.dequantize``): exactly the
  product with the activations quantized as the kernel quantizes them, up to fp32 rounding, and
  within the error that quantization explains (half a step per activation) of the float product;
- batch invariance: a pass of n rows (1..16) gives each row the very bits of a one-row pass, for
  any thread count, and the portable C path gives the AVX2 path's bits;
- the backend: a k-token pass, a token tree and a restored snapshot give the bits of one-token
  steps; its logits are as close to a float forward on the dequantized weights as llama.cpp's are
  (SmolLM2-135M Q4_1, measured: mean |diff| 0.24 for both, max 2.0 vs 2.1, over 19 prompt rows of
  logits up to 33); the default target (Qwen2.5-Coder-1.5B Q4_K_M) is invariant too (slow);
- the architectures beyond llama and qwen2 (qwen3, gemma3 with its sliding windows, phi3, llama
  with Llama 3's rope_freqs.weight) on tiny random files: a float forward, batch invariance,
  speculative decoding, and llama.cpp's logits within a bound derived from what it rounds; the
  gemma3-270m pack against llama.cpp's greedy text.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from specdec import kernels, packs  # noqa: E402
from specdec.backends import gguf as native  # noqa: E402
from specdec.backends.base import SNAPSHOTS, TREES, capabilities  # noqa: E402
from specdec.token_tree import TokenTree, forward_tree, keep_path  # noqa: E402
from helpers import THREADS  # noqa: E402

TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
         T.Q6_K, T.IQ4_XS]
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)  # activations quantized in blocks of 256
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # the quantized types gguf.quants.quantize writes
# Where each type's fp16 scales sit in a block, and a plausible range of their size (weights of a
# few hundredths): for the types gguf.quants can only dequantize, whose blocks are made of random bytes.
BLOCK_SCALES = {
    T.Q4_K: ((0, 2e-4, 2e-3), (2, 2e-4, 2e-3)),  # d, dmin
    T.Q6_K: ((208, 2e-5, 2e-4),),
    T.Q5_K: ((0, 1e-4, 1e-3), (2, 1e-4, 1e-3)),
    T.Q3_K: ((108, 5e-4, 5e-3),),
    T.Q2_K: ((80, 1e-3, 1e-2), (82, 1e-3, 1e-2)),
    T.IQ4_XS: ((0, 2e-5, 2e-4),),
    T.IQ4_NL: ((0, 2e-4, 2e-3),),
}


@pytest.fixture(scope="module")
def lib():
    try:
        return native.library()
    except native.KernelUnavailable as err:
        pytest.skip(f"the kernel cannot be built here: {err}")


def random_blocks(qtype: T, n_out: int, n_in: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Valid random blocks of a type gguf.quants can only dequantize (those of BLOCK_SCALES): random
    bytes, with finite fp16 scales of a plausible size (times ``scale``); another type's blocks are
    random bytes. [n_out, row bytes] uint8."""
    block, size = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_out, n_in // block, size), dtype=np.uint8)
    for at, lo, hi in BLOCK_SCALES.get(qtype, ()):
        values = (rng.uniform(lo, hi, raw.shape[:2]) * scale).astype(np.float16)
        raw[..., at : at + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n_out, -1)


def make_weight(qtype: T, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """A GGUF tensor's bytes [n_out, row bytes] uint8 (float types: their values)."""
    if qtype in BLOCK_SCALES:
        return random_blocks(qtype, n_out, n_in, rng)
    w = (rng.standard_normal((n_out, n_in)) * 0.05).astype(np.float32)
    return np.ascontiguousarray(quants.quantize(w, qtype))


def dequantized(weight: np.ndarray, qtype: T, n_out: int, n_in: int) -> np.ndarray:
    return quants.dequantize(weight, qtype).reshape(n_out, n_in).astype(np.float64)


def quantize_like_the_kernel(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Each block of each row: d = amax / 127, q = round-half-even(x * (127 / amax)), in fp32.
    Returns (q [n, n_in] float64, d per element [n, n_in] float64)."""
    xb = x.reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    d = np.broadcast_to(amax / np.float32(127), xb.shape).astype(np.float32)
    return q.reshape(x.shape).astype(np.float64), d.reshape(x.shape).astype(np.float64)


def activations(n: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    x[:, 5] *= 40.0  # an outlier, as hidden states have
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    return x


SHAPES = {"quantized": (37, 512), "float": (29, 300)}  # n_out odd; a float n_in off the 8-lane grid


def shape_of(qtype: T) -> tuple[int, int]:
    return SHAPES["float" if qtype in FLOAT_TYPES else "quantized"]


# -- (a) the kernel against float64 references -----------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernel_is_the_product_with_quantized_activations(lib, qtype):
    rng = np.random.default_rng(int(qtype))
    n_out, n_in = shape_of(qtype)
    weight = make_weight(qtype, n_out, n_in, rng)
    w = dequantized(weight, qtype, n_out, n_in)
    x = activations(6, n_in, rng)
    y = native.matmul(weight, int(qtype), n_in, torch.from_numpy(x), threads=2).double().numpy()
    exact = x.astype(np.float64) @ w.T  # [6, n_out]
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w).T
    if qtype in FLOAT_TYPES:
        # fp32 products and sums: a relative error of a few fp32 epsilons of the magnitude
        assert np.all(np.abs(y - exact) <= 1e-6 * magnitude + 1e-30)
        return
    block = 256 if qtype in K_TYPES else 32
    q, d = quantize_like_the_kernel(x, block)
    xq = q * d
    # 1. exactly the product with the quantized activations, up to fp32 rounding of the sums
    product = xq @ w.T
    assert np.all(np.abs(y - product) <= 1e-6 * (np.abs(xq) @ np.abs(w).T) + 1e-30)
    # 2. the activation quantization explains the rest: each activation within half a step
    assert np.all(np.abs(x - xq) <= d / 2 * (1 + 1e-6))
    bound = (d / 2) @ np.abs(w).T + 2e-6 * magnitude
    assert np.all(np.abs(y - exact) <= bound)
    # and the kernel's own quantization is what was replicated above
    qk, dk = native.quantize_activations(torch.from_numpy(x), block)
    assert np.array_equal(qk.numpy().astype(np.float64), q)
    assert np.array_equal(np.repeat(dk.numpy(), block, axis=1).astype(np.float64), d)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantized_rows_are_those_of_gguf_quants(lib, qtype):
    rng = np.random.default_rng(100 + int(qtype))
    n_out, n_in = shape_of(qtype)
    weight = make_weight(qtype, n_out, n_in, rng)
    ids = [0, 3, n_out - 1, 3]
    rows = native.dequantize_rows(weight, int(qtype), n_in, ids).numpy()
    assert np.array_equal(rows, quants.dequantize(weight, qtype).reshape(n_out, n_in)[ids].astype(np.float32))


def test_unsupported_types_and_shapes_are_refused(lib):
    assert native.row_bytes(int(T.IQ3_S), 256) == -1
    assert native.row_bytes(int(T.Q4_K), 300) == -1  # not whole blocks
    assert native.row_bytes(int(T.Q5_1), 48) == -1
    with pytest.raises(ValueError, match="IQ2_XS"):
        native.matmul(np.zeros((2, 74), np.uint8), int(T.IQ2_XS), 256, torch.zeros(1, 256))


# -- (b) batch invariance, (c) portable == AVX2 ----------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_pass_of_n_rows_gives_each_row_the_bits_of_a_one_row_pass(lib, qtype):
    rng = np.random.default_rng(200 + int(qtype))
    n_out, n_in = shape_of(qtype)
    weight = make_weight(qtype, n_out, n_in, rng)
    x = torch.from_numpy(activations(16, n_in, rng))
    one = torch.cat([native.matmul(weight, int(qtype), n_in, x[i : i + 1], threads=1) for i in range(16)])
    for n in range(1, 17):
        for threads in (1, 2):
            rows = native.matmul(weight, int(qtype), n_in, x[:n], threads=threads)
            assert torch.equal(rows, one[:n]), (n, threads)
    # a row's place in the pass does not matter either
    rolled = native.matmul(weight, int(qtype), n_in, x.roll(5, 0), threads=2)
    assert torch.equal(rolled, one.roll(5, 0))
    # more rows than one tile of the kernel (16)
    many = native.matmul(weight, int(qtype), n_in, x.repeat(3, 1), threads=2)
    assert torch.equal(many, one.repeat(3, 1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_portable_path_gives_the_avx2_paths_bits(lib, qtype):
    rng = np.random.default_rng(300 + int(qtype))
    n_out, n_in = shape_of(qtype)
    weight = make_weight(qtype, n_out, n_in, rng)
    x = torch.from_numpy(activations(5, n_in, rng))
    fast = native.matmul(weight, int(qtype), n_in, x, threads=2)
    with native.portable_path():
        assert native.kernel_path() == "portable"
        scalar = native.matmul(weight, int(qtype), n_in, x, threads=2)
    assert torch.equal(fast, scalar)
    # the build of the portable path alone (what a CPU of another family compiles)
    portable = native.library("portable")
    assert native.available_paths(portable) == ["portable"] and not portable.gguf_avx2_compiled()
    assert torch.equal(native.matmul(weight, int(qtype), n_in, x, threads=2, lib=portable), fast)


SCALE_BYTES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.IQ4_NL: (0,),
               T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,)}


def any_blocks(qtype: T, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks of random bytes with finite fp16 scales: every weight value a type can hold, the
    extremes included (Q8_0's -128, which no quantizer writes), for the paths' integer products."""
    if qtype in FLOAT_TYPES:
        return make_weight(qtype, n_out, n_in, rng)
    block, size = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_out, n_in // block, size), dtype=np.uint8)
    for at in SCALE_BYTES[qtype]:
        halves = rng.uniform(-2e-3, 2e-3, raw.shape[:2]).astype(np.float16)
        raw[..., at : at + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n_out, -1)


def path_outputs(lib, path: str, weight: np.ndarray, qtype: T, n_in: int, x: torch.Tensor) -> list[torch.Tensor]:
    """Passes of 1, 2, 3, 4, 5, 16 and 17 rows of ``x`` (every kernel shape: the register kernels,
    the tile, and more rows than one tile) on ``path``, 2 threads."""
    with native.running_path(path, lib):
        return [native.matmul(weight, int(qtype), n_in, x[:n], threads=2, lib=lib) for n in (1, 2, 3, 4, 5, 16, 17)]


@pytest.mark.parametrize("path", native.PATHS[1:])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_path_this_cpu_has_gives_the_portable_paths_bits(lib, path, qtype):
    if path not in native.available_paths(lib):
        pytest.skip(f"this CPU lacks the {path} path (it runs {', '.join(native.available_paths(lib))}); "
                    "the emulated build checks the VNNI code")
    rng = np.random.default_rng(350 + int(qtype))
    n_out, n_in = shape_of(qtype)
    weight = any_blocks(qtype, n_out, n_in, rng)
    x = torch.from_numpy(activations(17, n_in, rng))
    for fast, scalar in zip(path_outputs(lib, path, weight, qtype, n_in, x),
                            path_outputs(lib, "portable", weight, qtype, n_in, x)):
        assert torch.equal(fast, scalar)


@pytest.fixture(scope="module")
def emulated(lib):
    """The test build whose avx512vnni path runs here, its VNNI instructions emulated (SIMDe)."""
    from pathlib import Path

    if not Path("/usr/include/simde/x86/avx512/dpwssd.h").is_file():
        pytest.skip("the SIMDe headers (Debian's libsimde-dev) are not installed: the VNNI code is not checked here")
    if "avx2" not in native.available_paths(lib):
        pytest.skip("this CPU lacks AVX2: the emulated VNNI build needs it")
    return native.library("emulated-vnni")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_vnni_path_gives_the_portable_paths_bits(lib, emulated, qtype):
    """The VNNI path's code (vpdpwssd and vpdpbusd where the AVX2 path uses maddubs, madd and add),
    its two instructions emulated: the same bits as the portable path and the AVX2 path, for every
    type and kernel shape."""
    assert native.available_paths(emulated) == ["portable", "avx2", "avx512vnni"]
    rng = np.random.default_rng(400 + int(qtype))
    n_out, n_in = shape_of(qtype)
    weight = any_blocks(qtype, n_out, n_in, rng)
    x = torch.from_numpy(activations(17, n_in, rng))
    vnni = path_outputs(emulated, "avx512vnni", weight, qtype, n_in, x)
    for got, scalar, avx2 in zip(vnni, path_outputs(emulated, "portable", weight, qtype, n_in, x),
                                 path_outputs(lib, "avx2", weight, qtype, n_in, x)):
        assert torch.equal(got, scalar) and torch.equal(got, avx2)


@pytest.mark.parametrize("tiny_model", ["qwen2", "qwen2-more-types"])
def test_a_model_pass_on_the_vnni_path_has_the_bits_of_the_other_paths(lib, emulated, tmp_path, tiny_model):
    """A whole forward of a tiny model of every quantized type (a Q6_K or Q5_K head) on each path."""
    path = tmp_path / "tiny-qwen2.gguf"
    arch, kwargs = TINY_MODELS[tiny_model]
    write_tiny_gguf(path, arch, **kwargs)
    model = native.load_gguf_native(path, n_threads=THREADS, n_ctx=256)
    tokens = [1, 17, 200, 3, 3, 99, 250, 14, 8, 301, 42, 5]
    logits = {}
    for name, library in (("portable", lib), ("avx2", lib), ("avx512vnni", emulated)):
        model.lib = library
        with native.running_path(name, library):
            model.reset()
            logits[name] = model.forward(tokens)
    assert torch.equal(logits["avx512vnni"], logits["portable"]) and torch.equal(logits["avx2"], logits["portable"])


REPACKABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.IQ4_XS]  # native.repack's types


@pytest.mark.parametrize("qtype", REPACKABLE, ids=lambda t: t.name)
def test_rows_repacked_eight_at_a_time_give_the_files_layouts_bits_on_every_path(lib, qtype):
    """A tensor repacked eight rows at a time (what a loaded model multiplies) gives the bits of the
    file's layout, on every path (the emulated VNNI one where SIMDe is installed, the portable build),
    for passes of 1 .. 9 rows on 1 and 2 threads, for row counts that are not a multiple of 8, and
    for a tensor that 2 threads split; its dequantized rows are the file layout's."""
    from pathlib import Path

    runs = [(lib, name) for name in native.available_paths(lib)] + [(native.library("portable"), "portable")]
    if Path("/usr/include/simde/x86/avx512/dpwssd.h").is_file() and "avx2" in native.available_paths(lib):
        runs.append((native.library("emulated-vnni"), "avx512vnni"))
    rng = np.random.default_rng(500 + int(qtype))
    n_in = 512
    rb = native.row_bytes(int(qtype), n_in)
    for n_out, rows in ((1, 9), (5, 9), (8, 9), (13, 9), (37, 9), (1859, 3)):  # 1859 rows: chunks for 2 threads
        weight = any_blocks(qtype, n_out, n_in, rng)
        packed, packed_type = native.repack(weight, int(qtype), n_in)
        assert packed_type != int(qtype) and packed.nbytes == (n_out + 7) // 8 * 8 * rb
        x = torch.from_numpy(activations(rows, n_in, rng))
        with native.running_path("portable", lib):
            one = torch.cat([native.matmul(weight, int(qtype), n_in, x[i : i + 1], lib=lib) for i in range(rows)])
        for library, path in runs:
            with native.running_path(path, library):
                for n in range(1, rows + 1):
                    for threads in (1, 2):
                        for w, t in ((weight, int(qtype)), (packed, packed_type)):
                            got = native.matmul(w, t, n_in, x[:n], threads=threads, lib=library, n_out=n_out)
                            assert torch.equal(got, one[:n]), (n_out, path, t, n, threads)
        ids = [0, n_out - 1, n_out // 2, 0]
        assert torch.equal(native.dequantize_rows(packed, packed_type, n_in, ids),
                           native.dequantize_rows(weight, int(qtype), n_in, ids))
    assert native.repack(any_blocks(T.Q6_K, 8, 256, rng), int(T.Q6_K), 256) is None  # no such layout for another type


def test_the_amx_path_gives_the_other_paths_bits_for_passes_of_any_size(lib):
    """The AMX path multiplies a repacked Q4_K tensor with Intel's tile products from 10 rows up, 16
    rows a tile, up to 64 rows on one decoding of the weights, 16 outputs a product: for passes of 1
    to 90 rows (a tile of 10, full tiles, a last tile of 1 to 9 rows after full ones, blocks of 64
    and the rows after them, rows below the threshold) against tensors of 8, 24 and 40 outputs
    (pairs of groups and a group alone) and one that two threads split, each row gets the
    avx512vnni path's bits and the portable path's."""
    if "amx" not in native.available_paths(lib):
        pytest.skip(f"this CPU (or its OS) does not run AMX tiles; it runs {', '.join(native.available_paths(lib))}")
    rng = np.random.default_rng(640)
    n_in = 768
    for n_out in (8, 24, 40, 1859):
        weight = any_blocks(T.Q4_K, n_out, n_in, rng)
        packed, packed_type = native.repack(weight, int(T.Q4_K), n_in)
        x = torch.from_numpy(activations(90, n_in, rng))
        with native.running_path("portable", lib):
            one = native.matmul(weight, int(T.Q4_K), n_in, x, lib=lib)
        for n in ((1, 9, 10, 11, 16, 17, 20, 25, 26, 33, 41, 42, 64, 65, 74, 90) if n_out < 1000 else (10, 17, 42, 90)):
            for threads in (1, 2):
                for path in ("avx512vnni", "amx"):
                    with native.running_path(path, lib):
                        got = native.matmul(packed, packed_type, n_in, x[:n], threads=threads, lib=lib, n_out=n_out)
                    assert torch.equal(got, one[:n]), (n_out, n, threads, path)


def test_the_amx_paths_q6k_pairs_give_the_other_paths_bits_for_passes_of_any_size(lib):
    """On the AMX path, Q6_K passes of 4 rows and more take two outputs per 512-bit vector, up to 64
    rows on one decoding of their blocks: for passes of 1 to 90 rows against an odd number of
    outputs (the last paired with itself), one pair, and a tensor two threads split, each row gets
    the avx512vnni path's bits and the portable path's."""
    if "amx" not in native.available_paths(lib):
        pytest.skip(f"this CPU (or its OS) does not run AMX tiles; it runs {', '.join(native.available_paths(lib))}")
    rng = np.random.default_rng(660)
    n_in = 768
    x = torch.from_numpy(activations(90, n_in, rng))
    for n_out in (1, 2, 37, 1001):
        weight = any_blocks(T.Q6_K, n_out, n_in, rng)
        with native.running_path("portable", lib):
            one = native.matmul(weight, int(T.Q6_K), n_in, x, lib=lib)
        for n in ((1, 3, 4, 5, 16, 17, 63, 64, 65, 67, 90) if n_out < 1000 else (4, 17, 90)):
            for threads in (1, 2):
                for path in ("avx512vnni", "amx"):
                    with native.running_path(path, lib):
                        got = native.matmul(weight, int(T.Q6_K), n_in, x[:n], threads=threads, lib=lib)
                    assert torch.equal(got, one[:n]), (n_out, n, threads, path)


def test_the_path_is_chosen_once_and_named(lib):
    """The best path the CPU has runs unless $SPECDEC_GGUF_PATH names another; the planner's cost
    key names the path."""
    import os
    import subprocess
    import sys

    paths = native.available_paths(lib)
    best = next((name for name in ("amx", "avx512vnni") if name in paths), paths[-1])
    assert native.kernel_path(lib) == best
    code = "from specdec.backends import gguf; print(gguf.kernel_path())"
    for asked in paths:
        env = {**os.environ, native.PATH_ENV: asked}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.stdout.strip() == asked, done.stderr
    with pytest.raises(ValueError, match="no 'sse9' path"):
        with native.running_path("sse9", lib):
            pass


def test_every_function_is_declared_from_the_librarys_prototypes(lib):
    """The library describes its interface once (gguf_interface: its C prototypes and its layer
    record's fields); every function is declared to ctypes from that text, nothing by hand."""
    functions, fields = kernels.parse_interface(lib.gguf_interface().decode())
    assert {"gguf_forward_seqs", "gguf_matmul_multi", "gguf_attention", "gguf_cpu_paths"} <= set(functions)
    for name, (args, result) in functions.items():
        assert getattr(lib, name).argtypes == args and getattr(lib, name).restype == result, name
    assert functions["gguf_row_bytes"] == ([ctypes.c_int, ctypes.c_int64], ctypes.c_int64)
    assert fields == native.layer_fields(lib) and fields[0] == ("qkv_type", 3) and fields[-1] == ("window", 1)
    with pytest.raises(kernels.InterfaceMismatch, match="'unsigned long'"):
        kernels.parse_interface("int gguf_f(unsigned long n);")
    with pytest.raises(kernels.InterfaceMismatch, match="cannot read"):
        kernels.parse_interface("gguf_f(int n)")


def test_a_layer_record_is_laid_out_as_the_library_says_and_a_mismatch_is_named(lib):
    fields = native.layer_fields(lib)
    values = {name: [1000 * i + k for k in range(count)] for i, (name, count) in enumerate(fields)}
    assert native.layer_record(values, fields) == [v for name, _ in fields for v in values[name]]
    swapped = (fields[1], fields[0], *fields[2:])  # a library whose first two fields traded places
    assert native.layer_record(values, swapped)[: fields[1][1]] == values[fields[1][0]]
    with pytest.raises(native.InterfaceMismatch, match="has a field 'window'"):
        native.layer_record({k: v for k, v in values.items() if k != "window"}, fields)
    with pytest.raises(native.InterfaceMismatch, match="'qkv_ptr' holds 3 values, this module gives 2"):
        native.layer_record({**values, "qkv_ptr": [1, 2]}, fields)
    with pytest.raises(native.InterfaceMismatch, match="fills a layer record field 'rope_scale'"):
        native.layer_record({**values, "rope_scale": 1}, fields)


def test_a_library_with_its_record_reordered_gives_the_same_model(lib, tmp_path):
    """The record's order is the C source's alone: a build whose GG_LAYER lists two fields the other
    way round (Python unchanged) runs a model to the same bits."""
    import re
    import subprocess
    from importlib import resources

    code = resources.files("specdec").joinpath("csrc", native.SOURCE).read_text()
    swapped, n = re.subn(r"F\(norm1, 1\) F\(norm2, 1\)", "F(norm2, 1) F(norm1, 1)", code)
    assert n == 1
    source, built = tmp_path / native.SOURCE, tmp_path / "swapped.so"
    source.write_text(swapped)
    done = subprocess.run(["gcc", *native.FLAGS_PORTABLE, "-o", str(built), str(source), *native.LIBS],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"no C compiler for the reordered build: {done.stderr[-300:]}")
    other = ctypes.CDLL(str(built))
    native.declare(other)
    fields = native.layer_fields(other)
    assert fields[13:15] == (("norm2", 1), ("norm1", 1))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2", **TINY_MODELS["qwen2"][1])
    model = native.load_gguf_native(path, n_threads=THREADS, n_ctx=256)
    tokens = [1, 17, 200, 3, 3, 99, 250, 14]
    with native.running_path("portable", lib):
        expected = model.forward(tokens)
    model.weights.records = model.weights.layer_records(fields)
    model.lib = other
    model.reset()
    assert torch.equal(model.forward(tokens), expected)


def test_the_avx2_path_runs_where_the_cpu_has_it(lib):
    if "avx2" not in native.available_paths(lib):
        pytest.skip("this CPU lacks AVX2/FMA/F16C: only the portable path runs")
    assert native.kernel_path() != "portable"
    # and SPECDEC_GGUF_PORTABLE=1 asks for the portable path
    import os
    import subprocess
    import sys

    code = "from specdec.backends import gguf; print(gguf.kernel_path())"
    env = {**os.environ, native.PORTABLE_ENV: "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "portable", done.stderr


def test_exp_is_accurate_and_the_same_on_both_paths(lib):
    x = torch.linspace(-100.0, 90.0, 20001, dtype=torch.float32)
    fast = torch.empty_like(x)
    lib.gguf_exp(x.data_ptr(), len(x), fast.data_ptr())
    with native.portable_path():
        scalar = torch.empty_like(x)
        lib.gguf_exp(x.data_ptr(), len(x), scalar.data_ptr())
    assert torch.equal(fast, scalar)
    inside = (x > -87) & (x < 88)
    exact = torch.exp(x.double())
    assert ((fast.double() - exact).abs() / exact)[inside].max() < 4e-7


# -- a tiny model written here: both architectures, every type ----------------------------------------

TINY = dict(hidden=256, heads=4, kv_heads=2, ffn=512, layers=1, vocab=320)  # depth: SmolLM2 below
TINY_TYPES = {  # tensor -> type: every type the kernel runs appears in the tiny models
    "attn_q": T.Q4_K, "attn_k": T.Q6_K, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
    "ffn_gate": T.Q4_1, "ffn_up": T.F16, "ffn_down": T.BF16,
}


def write_tiny_gguf(path, arch: str, *, head_type: T | None = T.Q6_K, embed_type: T = T.Q8_0,
                    override: dict[str, T] | None = None, seed: int = 0, tokenizer: bool = False) -> None:
    """A random llama-family model as a GGUF file (no tokenizer, unless asked: a byte-level one of
    261 tokens, which llama.cpp needs to load the file)."""
    rng = np.random.default_rng(seed)
    c = TINY
    d = c["hidden"] // c["heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(c["hidden"])
    writer.add_feed_forward_length(c["ffn"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if tokenizer:
        from helpers import add_byte_tokenizer

        vocab = add_byte_tokenizer(writer)
    else:
        vocab = c["vocab"]
        writer.add_eos_token_id(7)

    def add(name: str, qtype: T, n_out: int, n_in: int) -> None:
        if qtype not in FLOAT_TYPES and qtype not in QUANTIZABLE:
            data = random_blocks(qtype, n_out, n_in, rng, scale=0.1)
        else:
            w = (rng.standard_normal((n_out, n_in)) * 0.08).astype(np.float32)
            data = quants.quantize(w, qtype) if qtype not in (T.F32, T.F16) else w.astype(np.float16 if qtype == T.F16 else np.float32)
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype if data.dtype == np.uint8 else None)

    def vec(name: str, n: int, scale: float, offset: float) -> None:
        writer.add_tensor(name, (offset + scale * rng.standard_normal(n)).astype(np.float32))

    add("token_embd.weight", embed_type, vocab, c["hidden"])
    if head_type is not None:
        add("output.weight", head_type, vocab, c["hidden"])
    vec("output_norm.weight", c["hidden"], 0.1, 1.0)
    types = {**TINY_TYPES, **(override or {})}
    outs = {"attn_q": c["heads"] * d, "attn_k": c["kv_heads"] * d, "attn_v": c["kv_heads"] * d,
            "attn_output": c["hidden"], "ffn_gate": c["ffn"], "ffn_up": c["ffn"], "ffn_down": c["hidden"]}
    for i in range(c["layers"]):
        vec(f"blk.{i}.attn_norm.weight", c["hidden"], 0.1, 1.0)
        vec(f"blk.{i}.ffn_norm.weight", c["hidden"], 0.1, 1.0)
        for name, n_out in outs.items():
            n_in = c["ffn"] if name == "ffn_down" else c["heads"] * d if name == "attn_output" else c["hidden"]
            add(f"blk.{i}.{name}.weight", types[name], n_out, n_in)
        if arch == "qwen2":
            for x in "qkv":
                vec(f"blk.{i}.attn_{x}.bias", outs[f"attn_{x}"], 0.5, 0.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference_logits(weights: native.GGUFWeights, tokens: list[int], *, quantized: bool = False,
                     bf16_cache: bool = False, tap: Any = None) -> torch.Tensor:
    """A float64 causal forward on the dequantized weights, written independently of the backend
    (llama.cpp's graph: RMSNorm, RoPE NORM for llama / NEOX for qwen2 and qwen3, GQA, SwiGLU;
    qwen3's and gemma3's per-head Q/K norms; gemma3's scaled embedding, post-norms, GeGLU and
    sliding-window layers): [n, V].
    quantized: each product's input rows quantized first, as the kernel does for the tensor's type.
    tap(kind, t, spread): called on the intermediates another engine may round (see
    :func:`llamacpp_bound`); returns the tensor to go on with.
    bf16_cache: the keys (after RoPE) and values rounded to bf16, as a 16-bit KV cache holds them."""
    tap = tap or (lambda kind, t, spread=None: t)
    tensors = {t.name: t for t in weights.reader.tensors}

    def W(name: str) -> torch.Tensor:
        t = tensors[name]
        n_in = int(t.shape[0])
        return torch.from_numpy(quants.dequantize(t.data, t.tensor_type).reshape(-1, n_in).astype(np.float64))

    def mul(x: torch.Tensor, name: str) -> torch.Tensor:
        qtype = tensors[name].tensor_type
        x = tap(f"input of {qtype.name}", x)
        if quantized and qtype not in FLOAT_TYPES:
            q, d = quantize_like_the_kernel(x.float().numpy(), 256 if qtype in K_TYPES else 32)
            x = torch.from_numpy(q * d)
        return x @ W(name).T

    def V(name: str) -> torch.Tensor:
        return W(name).reshape(-1)

    n, heads, kv, d = len(tokens), weights.heads, weights.kv_heads, weights.head_dim
    arch = weights.architecture

    def angles(base: float, scale: float = 1.0, factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv = base ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
        if factors is not None:  # Llama 3: each frequency divided by its factor
            inv = inv / factors
        theta = (torch.arange(n, dtype=torch.float64) * scale)[:, None] * inv[None]
        return theta.cos()[:, None], theta.sin()[:, None]  # [n, 1, d/2]

    def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [n, h, d]
        a, b = (t[..., : d // 2], t[..., d // 2 :]) if weights.neox else (t[..., 0::2], t[..., 1::2])
        out = torch.empty_like(t)
        ra, rb = a * cos - b * sin, a * sin + b * cos
        if weights.neox:
            out[..., : d // 2], out[..., d // 2 :] = ra, rb
        else:
            out[..., 0::2], out[..., 1::2] = ra, rb
        return out

    def norm(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + weights.eps) * g

    gemma = arch == "gemma3"
    x = W("token_embd.weight")[tokens]
    if gemma:  # Gemma scales the embedding by sqrt(hidden)
        x = x * weights.hidden**0.5
    x = tap("embedding", x)
    position = torch.arange(n)
    causal = position[None, :] <= position[:, None]
    scale = weights.attn_scale if gemma else d**-0.5
    for i in range(weights.n_layers):
        p = f"blk.{i}."
        sliding = gemma and weights.sliding[i]
        factors = V("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
        cos, sin = angles(weights.local_rope_base) if sliding else angles(weights.rope_base, weights.rope_scale, factors)
        seen = causal & (position[:, None] - position[None, :] < weights.window) if sliding else causal
        h = norm(x, V(p + "attn_norm.weight"))
        if p + "attn_qkv.weight" in tensors:  # phi3: Q, K and V rows in one tensor
            q, k, v = mul(h, p + "attn_qkv.weight").split([heads * d, kv * d, kv * d], -1)
        else:
            q, k, v = (mul(h, p + f"attn_{s}.weight") for s in "qkv")
        if arch == "qwen2":
            q, k, v = q + V(p + "attn_q.bias"), k + V(p + "attn_k.bias"), v + V(p + "attn_v.bias")
        q, k = q.view(n, heads, d), k.view(n, kv, d)
        if arch in ("qwen3", "gemma3"):  # each head of Q and K normalized before RoPE
            q, k = norm(q, V(p + "attn_q_norm.weight")), norm(k, V(p + "attn_k_norm.weight"))
        q, k = tap("q", rope(q, cos, sin)), tap("k", rope(k, cos, sin))
        if bf16_cache:
            k, v = (t.to(torch.bfloat16).to(torch.float64) for t in (k, v))
        k = k.repeat_interleave(heads // kv, 1)
        v = tap("v", v.view(n, kv, d)).repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        attended = torch.einsum("hqk,khd->qhd", probs, v)
        # the size of the roundings of a sum over the keys kept in another precision: |p_j v_j| summed,
        # times the square root of the roundings (one add and one rescale per key)
        spread = torch.einsum("hqk,khd->qhd", probs, v.abs()) * (2 * seen.sum(-1)[:, None, None]) ** 0.5
        attended = tap("attention", attended, spread.detach())
        out = mul(attended.reshape(n, heads * d), p + "attn_output.weight")
        x = x + (norm(out, V(p + "post_attention_norm.weight")) if gemma else out)
        h = norm(x, V(p + "ffn_norm.weight"))
        if p + "ffn_gate.weight" in tensors:
            gate, up = mul(h, p + "ffn_gate.weight"), mul(h, p + "ffn_up.weight")
        else:  # phi3: gate and up rows in one tensor, gate first
            gate, up = mul(h, p + "ffn_up.weight").chunk(2, -1)
        if gemma:
            act = tap("gelu", torch.nn.functional.gelu(tap("gelu input", gate), approximate="tanh"))
        else:
            act = torch.nn.functional.silu(gate)
        out = mul(act * up, p + "ffn_down.weight")
        x = x + (norm(out, V(p + "post_ffw_norm.weight")) if gemma else out)
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return mul(norm(x, V("output_norm.weight")), head).float()


MORE_TYPES = {  # a third tiny model: the other types, a tied Q3_K embedding and head (llama), a Q5_K head (qwen2)
    "attn_q": T.Q5_K, "attn_k": T.Q2_K, "attn_v": T.IQ4_NL, "attn_output": T.IQ4_XS,
    "ffn_gate": T.Q5_1, "ffn_up": T.Q3_K, "ffn_down": T.Q5_K,
}
TINY_MODELS = {  # name -> (architecture, keyword arguments of write_tiny_gguf)
    "llama": ("llama", dict(head_type=None)),
    "qwen2": ("qwen2", dict(head_type=T.Q6_K)),
    "llama-more-types": ("llama", dict(head_type=None, embed_type=T.Q3_K, override=MORE_TYPES)),
    "qwen2-more-types": ("qwen2", dict(head_type=T.Q5_K, embed_type=T.IQ4_XS, override=MORE_TYPES)),
}


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def tiny(request, tmp_path_factory, lib):
    arch, kwargs = TINY_MODELS[request.param]
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{request.param}.gguf"
    write_tiny_gguf(path, arch, **kwargs)
    return native.load_gguf_native(path, n_threads=THREADS, n_ctx=256)


def test_a_tiny_model_of_every_type_matches_a_float_forward(tiny):
    tokens = [1, 17, 200, 3, 3, 99, 250, 14, 8, 301, 42, 5]
    tiny.reset()
    ours = tiny.forward(tokens)
    # The same forward in float64 with each product's input quantized as the kernel does it: equal
    # up to fp32 rounding (measured: 1e-6 of the spread), except where that rounding flips one
    # activation's 8-bit step, which moves the rows that read it (then ~1e-2 of the spread).
    ref = reference_logits(tiny.weights, tokens, quantized=True)
    spread = ref.abs().max()
    per_row = (ours - ref).abs().max(-1).values
    assert per_row.median() <= 1e-5 * spread
    assert per_row.max() <= 0.02 * spread
    # In float64 throughout: the 8-bit activations move the logits by about 1% of their spread.
    ref = reference_logits(tiny.weights, tokens)
    assert (ours - ref).abs().mean() <= 0.02 * spread
    assert torch.equal(ours.argmax(-1)[0], ref.argmax(-1)[0])


def test_a_tiny_models_rows_are_batch_invariant(tiny):
    context, extra = [5, 9, 33, 2, 100, 7], [11, 12, 250, 3, 4, 5, 6, 7]
    tiny.reset()
    tiny.forward(context[:-1])
    steps = torch.cat([tiny.forward([t]) for t in [context[-1], *extra]])
    for n in (1, 2, 3, 5, 8):
        tiny.reset()
        tiny.forward(context[:-1])
        assert torch.equal(tiny.forward([context[-1], *extra[:n]]), steps[: n + 1])
    with native.portable_path():
        tiny.reset()
        tiny.forward(context[:-1])
        assert torch.equal(tiny.forward([context[-1], *extra]), steps)


def test_a_trimmed_head_scores_its_ids_as_the_full_head_and_no_other(tiny):
    tokens, vocab = [1, 17, 200, 3, 3, 99, 250, 14], tiny.vocab_size
    kept = sorted({0, 5, 17, vocab - 1, *range(40, vocab, 7)})
    draft = tiny.trimmed(kept)
    assert draft.head.size == len(kept) and draft.fork().head is draft.head  # copied once, shared by forks
    assert draft.identity()["head_rows"] == len(kept) and "head_rows" not in tiny.identity()
    tiny.reset()
    full = tiny.forward(tokens)
    mine = draft.forward(tokens)
    ids = torch.tensor(kept)
    assert torch.equal(mine[:, ids], full[:, ids])  # the same bits: a row depends on its own weights alone
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(mine[:, outside]).all())
    # in one pass beside sequences on the full head (a draft that is the target's own weights), each
    # sequence's rows go through its own head
    a, b = tiny.fork(), draft.fork()
    together = native.run_together([(a, native.Piece(tokens[:3], [0, 1, 2], torch.ones(3, 3, dtype=torch.uint8).tril(), 2)),
                                    (b, native.Piece(tokens[:4], [0, 1, 2, 3], torch.ones(4, 4, dtype=torch.uint8).tril(), 3))])
    assert torch.equal(together[0], full[1:3]) and torch.equal(together[1], mine[1:4])
    with pytest.raises(ValueError, match="keeps 1"):
        tiny.trimmed([vocab])


def test_the_fp16_cache_build_keeps_rows_batch_invariant(tiny):
    """The measurement build with fp16 keys and values (docs/kernels.md, "The context and its KV
    cache"): each row still equals the one-token step at its position, on every path, since each
    key and value is rounded once, as it is stored, whatever pass stores it."""
    model = native.GGUFCausalLM(tiny.weights, n_threads=THREADS)
    model.lib = native.library("kv-f16")
    model._cache = torch.zeros(model._cache.shape, dtype=torch.float16)
    context, extra = [5, 9, 33, 2, 100, 7], [11, 12, 250, 3, 4, 5, 6, 7]
    model.forward(context[:-1])
    steps = torch.cat([model.forward([t]) for t in [context[-1], *extra]])
    for n in (2, 5, 8):
        model.trim(len(context) - 1)
        assert torch.equal(model.forward([context[-1], *extra[:n]]), steps[: n + 1])
    with native.running_path("portable", model.lib):
        model.trim(len(context) - 1)
        assert torch.equal(model.forward([context[-1], *extra]), steps)
    tiny.reset()
    tiny.forward(context[:-1])
    fp32 = torch.cat([tiny.forward([t]) for t in [context[-1], *extra]])
    assert not torch.equal(steps, fp32)  # the build does round: it is not the fp32 cache under another name


def test_unsupported_types_and_architectures_are_refused_at_load(tmp_path, lib):
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(path, "llama", override={"ffn_up": T.IQ3_S})
    with pytest.raises(ValueError, match=r"IQ3_S.*--backend llamacpp"):
        native.load_gguf_native(path)
    other = tmp_path / "gemma.gguf"
    write_tiny_gguf(other, "gemma")
    with pytest.raises(ValueError, match=r"'gemma'.*--backend llamacpp"):
        native.load_gguf_native(other)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"nope" * 10)
    with pytest.raises(ValueError, match="not a GGUF file"):
        native.load_gguf_native(not_gguf)


def test_a_tiny_model_of_the_other_types_agrees_with_llamacpp_within_a_bound(tmp_path, lib):
    """Q2_K, Q3_K, Q5_K, Q5_1, IQ4_NL, IQ4_XS tensors (a qwen2 model, its embedding IQ4_XS and its
    head Q5_K) on both engines: the same model, each engine with its own roundings."""
    from specdec.backends import llamacpp

    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    path = tmp_path / "tiny-more-types.gguf"
    write_tiny_gguf(path, "qwen2", head_type=T.Q5_K, embed_type=T.IQ4_XS, override=MORE_TYPES, tokenizer=True)
    model = native.load_gguf_native(path, n_threads=THREADS, n_ctx=256)
    theirs = llamacpp.load_gguf(path, n_threads=THREADS, n_ctx=256, prefill_layout="repacked", cache_dir=tmp_path)
    tokens = [1, 17, 200, 3, 3, 99, 250, 14, 8, 160, 42, 5]
    model.reset()
    ours, ref_llamacpp = model.forward(tokens), theirs.forward(tokens)  # [n, V]
    # The bound, from the two engines' roundings. Both compute the float64 forward on the dequantized
    # weights (ref) but for: the 8-bit rounding of each product's input rows (ours within half a
    # step of amax / 127 per block; llama.cpp's the same, its fp16 block scales (Q8_0, Q8_1) adding
    # at most 127 * 2^-11 of a step: 1.125 times ours at most), llama.cpp's 16-bit KV cache (bf16
    # the coarser: 2^-9 of each key and value) and fp32 rounding elsewhere. A logit's error is the sum
    # of the effects of thousands of such roundings: centred, close to normal. Its standard
    # deviation is measured here for each source on the float64 forward: ours against ref
    # (sigma_ours; the 8-bit rounding, fp32 adds about 1e-5 of it), and the bf16 cache's
    # (sigma_kv). llama.cpp's is then at most sqrt((1.125 sigma_ours)^2 + sigma_kv^2) and, the two
    # engines' roundings being independent, their difference's at most
    # sigma = sqrt(sigma_ours^2 + (1.125 sigma_ours)^2 + sigma_kv^2): over these n * V logits the
    # largest |difference| exceeds 6 sigma with probability under 1e-5 (2e-9 per logit). (The
    # engines round most activations alike, so their difference is in fact smaller than either's
    # distance to ref: measured max 0.23 against a bound of 0.61, rms 0.052 against sigma_ours
    # 0.067, logits up to 11.5.)
    ref = reference_logits(model.weights, tokens)
    sigma_ours = (ours.double() - ref.double()).pow(2).mean().sqrt()
    sigma_kv = (reference_logits(model.weights, tokens, bf16_cache=True).double() - ref.double()).pow(2).mean().sqrt()
    sigma = (sigma_ours**2 * (1 + 1.125**2) + sigma_kv**2).sqrt()
    bound = float(6 * sigma)
    assert 0 < sigma_ours <= 0.02 * ref.abs().max()  # the 8-bit rounding moves logits by about 1% of their spread
    assert (ours - ref_llamacpp).abs().max() <= bound
    # an argmax may differ only where llama.cpp's top-two margin is within twice the bound
    top2 = ref_llamacpp.topk(2, -1).values
    decided = top2[:, 0] - top2[:, 1] > 2 * bound
    assert decided.any()
    assert torch.equal(ours.argmax(-1)[decided], ref_llamacpp.argmax(-1)[decided])


# -- (c') qwen3 and gemma3: per-head Q/K norms, a head width of its own; Gemma's post-norms, GeGLU,
# scaled embedding and sliding-window layers -----------------------------------------------------

ARCH_TINY = dict(hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=512, layers=6, vocab=320)
# The layers' tensors at F32 and F16, the embedding (and the head) at Q8_0: the products whose
# input llama.cpp rounds (to fp16 for an F16 weight, to 8-bit blocks with an fp16 scale for Q8_0)
# are those the bound of test_the_new_architectures_logits_agree_with_llamacpp_within_a_bound accounts for.
ARCH_TYPES = {
    "attn_q": T.F32, "attn_k": T.F16, "attn_v": T.F32, "attn_output": T.F16,
    "ffn_gate": T.F16, "ffn_up": T.F32, "ffn_down": T.F16,
}
WINDOW = 6  # gemma3's sliding window in the tiny model: shorter than the tests' sequences


def write_arch_gguf(path, arch: str, *, seed: int = 0, types: dict[str, T] | None = None,
                    extra: dict[str, Any] | None = None) -> None:
    """A random qwen3, gemma3, llama (with Llama 3's rope_freqs.weight) or phi3 (fused Q/K/V and
    gate/up tensors) model as a GGUF file, at
    F32, F16 and Q8_0, with a byte-level
    vocabulary (llama.cpp loads a file only with one); gemma3 ties its head to the embedding and
    has 6 layers (llama.cpp's pattern: five sliding-window layers, then a global one) with a
    window of WINDOW positions."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    rng = np.random.default_rng(seed)
    c = ARCH_TINY
    d = c["hidden"] // c["heads"] if arch == "phi3" else c["head_dim"]  # llama.cpp's phi3 needs heads * d = hidden
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(c["hidden"])
    writer.add_feed_forward_length(c["ffn"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        writer.add_sliding_window(WINDOW)
    tokens = list(bytes_to_unicode().values())
    tokens += [f"<t{i}>" for i in range(c["vocab"] - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(7)
    for key, value in (extra or {}).items():  # more metadata (strings or unsigned integers)
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(key, value)

    def add(name: str, qtype: T, n_out: int, n_in: int) -> None:
        w = (rng.standard_normal((n_out, n_in)) * 0.08).astype(np.float32)
        if qtype == T.Q8_0:
            writer.add_tensor(name, np.ascontiguousarray(quants.quantize(w, qtype)), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w.astype(np.float16 if qtype == T.F16 else np.float32))

    def vec(name: str, n: int, scale: float, offset: float) -> None:
        writer.add_tensor(name, (offset + scale * rng.standard_normal(n)).astype(np.float32))

    add("token_embd.weight", T.Q8_0, c["vocab"], c["hidden"])
    if arch == "llama":  # Llama 3's rope scaling: the low frequencies divided by up to 8
        writer.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, d // 2).astype(np.float32))
    if arch != "gemma3":
        add("output.weight", T.Q8_0, c["vocab"], c["hidden"])
    vec("output_norm.weight", c["hidden"], 0.1, 1.0)
    kinds = {**ARCH_TYPES, **(types or {})}
    outs = {"attn_q": c["heads"] * d, "attn_k": c["kv_heads"] * d, "attn_v": c["kv_heads"] * d,
            "attn_output": c["hidden"], "ffn_gate": c["ffn"], "ffn_up": c["ffn"], "ffn_down": c["hidden"]}
    for i in range(c["layers"]):
        vec(f"blk.{i}.attn_norm.weight", c["hidden"], 0.1, 1.0)
        vec(f"blk.{i}.ffn_norm.weight", c["hidden"], 0.1, 1.0)
        if arch in ("qwen3", "gemma3"):
            vec(f"blk.{i}.attn_q_norm.weight", d, 0.1, 1.0)
            vec(f"blk.{i}.attn_k_norm.weight", d, 0.1, 1.0)
        if arch == "gemma3":
            vec(f"blk.{i}.post_attention_norm.weight", c["hidden"], 0.1, 1.0)
            vec(f"blk.{i}.post_ffw_norm.weight", c["hidden"], 0.1, 1.0)
        if arch == "phi3":  # Q, K, V in one tensor; gate and up in another
            add(f"blk.{i}.attn_qkv.weight", kinds["attn_q"], outs["attn_q"] + 2 * outs["attn_k"], c["hidden"])
            add(f"blk.{i}.ffn_up.weight", kinds["ffn_up"], 2 * c["ffn"], c["hidden"])
        for name, n_out in outs.items():
            if arch == "phi3" and name in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
                continue
            n_in = c["ffn"] if name == "ffn_down" else c["heads"] * d if name == "attn_output" else c["hidden"]
            add(f"blk.{i}.{name}.weight", kinds[name], n_out, n_in)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


ARCH_TOKENS = [1, 17, 200, 3, 3, 99, 250, 14, 8, 301, 42, 5, 77, 160, 2, 9]  # longer than WINDOW


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "llama", "phi3"])
def arch_model(request, tmp_path_factory, lib):
    path = tmp_path_factory.mktemp("arch") / f"tiny-{request.param}.gguf"
    write_arch_gguf(path, request.param)
    return native.load_gguf_native(path, n_threads=THREADS, n_ctx=256)


def test_the_new_architectures_load_with_their_facts(arch_model):
    w = arch_model.weights
    if w.architecture == "phi3":  # its Q, K, V and gate, up: rows of two fused tensors
        assert w.head_dim == 64 and "blk.0.attn_qkv.weight (K)" in w.layers[0].qkv.names
    else:
        assert w.head_dim == 128 and w.heads * w.head_dim != w.hidden  # a head width of its own
    norms = w.architecture in ("qwen3", "gemma3")
    assert all((layer.q_norm is not None and layer.k_norm is not None) == norms for layer in w.layers)
    assert (w.rope_factors is not None) == (w.architecture == "llama")
    if w.architecture == "gemma3":
        assert w.sliding == [True] * 5 + [False] and w.window == WINDOW
        assert [layer.window for layer in w.layers] == [WINDOW] * 5 + [0]
        assert w.local_rope_base == 10000.0 and w.rope_base == 1e6
        assert w.embed_scale == float(np.sqrt(np.float32(256))) and w.activation == native.ACT_GEGLU
        assert w.head.tensors[0] is w.embed and arch_model.vocab_size == ARCH_TINY["vocab"]  # tied to the embedding
    else:
        assert not any(w.sliding) and w.activation == native.ACT_SWIGLU and w.embed_scale == 1.0


def test_the_new_architectures_match_a_float_forward(arch_model):
    arch_model.reset()
    ours = arch_model.forward(ARCH_TOKENS)
    # As for the llama and qwen2 models above: with each product's input quantized as the kernel
    # does it, equal up to fp32 rounding but where that rounding flips an activation's 8-bit step.
    ref = reference_logits(arch_model.weights, ARCH_TOKENS, quantized=True)
    spread = ref.abs().max()
    per_row = (ours - ref).abs().max(-1).values
    assert per_row.median() <= 1e-5 * spread
    assert per_row.max() <= 0.02 * spread
    ref = reference_logits(arch_model.weights, ARCH_TOKENS)
    assert (ours - ref).abs().mean() <= 0.02 * spread


def test_a_mixture_of_experts_and_rope_scaling_the_kernel_lacks_are_refused_at_load(tmp_path, lib):
    for name, extra, what in [("moe", {"qwen3.expert_count": 8}, "mixture of experts"),
                              ("yarn", {"qwen3.rope.scaling.type": "yarn"}, "rope scaling")]:
        path = tmp_path / f"{name}.gguf"
        write_arch_gguf(path, "qwen3", extra=extra)
        with pytest.raises(ValueError, match=rf"{what}.*--backend llamacpp"):
            native.load_gguf_native(path)


def test_gemma3s_sliding_window_hides_the_keys_behind_it(tmp_path, lib):
    """The tokens more than WINDOW positions back reach a sliding-window layer's rows no more:
    the same model with a window longer than the sequence gives other logits from row WINDOW on."""
    path = tmp_path / "g.gguf"
    write_arch_gguf(path, "gemma3")
    model = native.load_gguf_native(path, n_threads=1, n_ctx=64)
    windowed = model.forward(ARCH_TOKENS)
    for layer in model.weights.layers:
        layer.window = 1000 if layer.window else 0
    model.weights.records[:] = model.weights.layer_records()
    model.reset()
    unwindowed = model.forward(ARCH_TOKENS)
    assert torch.equal(windowed[:WINDOW], unwindowed[:WINDOW])
    assert not torch.equal(windowed[WINDOW:], unwindowed[WINDOW:])


def test_the_new_architectures_rows_are_batch_invariant(arch_model):
    """A pass of n rows has the bits of n one-token steps (beyond the window too), on every path."""
    context, extra = ARCH_TOKENS[:9], [11, 12, 250, 3, 4, 5, 6, 7]
    steps = one_token_steps(arch_model, context, extra)
    for n in (1, 2, 3, 5, 8):
        arch_model.reset()
        arch_model.forward(context[:-1])
        assert torch.equal(arch_model.forward([context[-1], *extra[:n]]), steps[: n + 1]), n
    with native.portable_path():
        assert torch.equal(one_token_steps(arch_model, context, extra), steps)
    # a token tree: each node's row is its path's one-token step
    a, b, c_, e = range(4)
    tree = TokenTree(tokens=extra[:4], parents=[-1, a, a, c_])
    arch_model.reset()
    rows = forward_tree(arch_model, context, tree)
    for node in (a, b, c_, e):
        path = tree.path(node)
        assert torch.equal(rows[1 + node], one_token_steps(arch_model, context, [tree.tokens[i] for i in path])[-1])


def test_the_new_architectures_greedy_speculative_output_equals_plain_decoding(arch_model):
    from specdec import generate

    arch_model.reset()
    ar = generate(arch_model, ARCH_TOKENS[:5], max_new_tokens=24, eos_token_ids=[])
    draft = arch_model.fork()
    for kwargs in (dict(draft=draft, verify="block", k=4, policy="static"), dict(draft=draft, verify="tree")):
        spec = generate(arch_model, ARCH_TOKENS[:5], max_new_tokens=24, eos_token_ids=[], **kwargs)
        assert spec.token_ids == ar.token_ids, kwargs


F16_UNIT = 2.0**-11  # fp16's unit roundoff
# What llama.cpp's CPU graph rounds to fp16 on these files, beyond fp32 arithmetic: its KV cache
# (f16: K and V), Q (converted to K's type in its flash attention), the sums over the keys (kept in
# an f16 accumulator, rescaled at each key), the input of a product with F16 weights (converted to
# fp16), GeGLU's input and output (a table of fp16 values indexed by the fp16 input), and the
# scale of each 8-bit block of a Q8_0 product's input (fp16, where the kernel keeps fp32).
LLAMACPP_UNITS = {"k": F16_UNIT, "v": F16_UNIT, "q": F16_UNIT, "input of F16": F16_UNIT, "gelu input": F16_UNIT,
                  "gelu": F16_UNIT, "input of Q8_0": F16_UNIT, "attention": F16_UNIT}
SIGMAS = 6  # the bound: this many standard deviations of the rounding's effect


def llamacpp_bound(weights: native.GGUFWeights, tokens: list[int], cells: list[tuple[int, int]]) -> list[float]:
    """For each logit (row, column) of ``cells``: a bound on how far llama.cpp's value may lie from
    the kernel's on this file, derived from what each rounds, not measured.

    Each element e of a quantity llama.cpp rounds at fp16 precision (:data:`LLAMACPP_UNITS`) is
    moved by a rounding error of at most s_e = u |t_e| (u = 2^-11); a sum over the keys kept in an
    f16 accumulator takes two roundings per key, s_e = u sqrt(2 L) sum_j p_j |v_j| for L keys (their
    errors add up like independent ones); RoPE's angles, which llama.cpp computes in fp32 as
    repeated products (up to d/2 + 1 roundings of 2^-24), rotate Q and K by at most (d/2 + 1) 2^-24 p
    more. To first order a logit moves by sum_e g_e err_e, g_e its derivative in a float64 forward of
    the model (:func:`reference_logits`). Roundings of different values are independent and
    uniform on [-s_e, s_e] (the probabilistic model of rounding errors, Higham & Mary 2019), so that
    sum has standard deviation sqrt(sum_e (g_e s_e)^2 / 3); the bound is :data:`SIGMAS` of them
    (the fp32 roundings of both engines, 2^-24, are 2^13 times smaller than fp16's). Plus one step
    of the head's 8-bit input: llama.cpp quantizes with 1/d where the kernel uses 127/amax, and a
    value at a rounding boundary may land one step (d) apart: |w| d."""
    taps: list[tuple[torch.Tensor, torch.Tensor]] = []
    rope = (weights.head_dim // 2 + 1) * 2.0**-24 * torch.arange(len(tokens), dtype=torch.float64)[:, None, None]
    head_input: list[torch.Tensor] = []

    def tap(kind: str, t: torch.Tensor, spread: torch.Tensor | None = None) -> torch.Tensor:
        if kind == "embedding":
            return t.clone().requires_grad_(True)
        unit = LLAMACPP_UNITS.get(kind)
        if unit is None:
            return t
        if kind == "input of Q8_0":
            head_input.append(t.detach())
        spread = (spread if spread is not None else t.abs()) * unit
        if kind in ("q", "k"):
            spread = spread + t.abs() * rope
        t = t.clone()  # a node of its own: its gradient is this use's alone (h feeds Q, K and V)
        t.retain_grad()
        taps.append((t, spread.detach()))
        return t

    logits = reference_logits(weights, tokens, tap=tap)
    tensors = {t.name: t for t in weights.reader.tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    assert head.tensor_type == T.Q8_0 and len(head_input) == 1  # the one 8-bit product: the head
    w_max = np.abs(quants.dequantize(head.data, head.tensor_type).reshape(-1, weights.hidden)).max(-1)  # [V]
    step = head_input[0].abs().reshape(len(tokens), -1, 32).amax(-1).max(-1).values / 127  # [n]: the largest d of a row
    bounds = []
    for row, col in cells:
        for t, _ in taps:
            t.grad = None
        logits[row, col].backward(retain_graph=True)
        variance = sum(float(((t.grad * spread) ** 2).sum()) / 3 for t, spread in taps if t.grad is not None)
        bounds.append(SIGMAS * variance**0.5 + float(step[row]) * float(w_max[col]))
    return bounds


def llamacpp_model(path):
    from specdec.backends import llamacpp

    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    # an f16 KV cache (the rounding the bound accounts for), every pass on the file's layout
    return llamacpp.LlamaCppCausalLM(llamacpp.GGUFWeights(path), n_threads=1, n_ctx=256)


def test_the_new_architectures_logits_agree_with_llamacpp_within_a_bound(arch_model):
    theirs = llamacpp_model(arch_model.weights.path)
    arch_model.reset()
    ours, ref = arch_model.forward(ARCH_TOKENS), theirs.forward(ARCH_TOKENS)  # [n, V]
    top = ref.topk(2, -1).indices  # the logits greedy decoding compares
    cells = [(r, int(c)) for r in range(len(ARCH_TOKENS)) for c in top[r]]
    bounds = torch.tensor(llamacpp_bound(arch_model.weights, ARCH_TOKENS, cells))
    diffs = torch.stack([(ours[r, c] - ref[r, c]).abs() for r, c in cells])
    assert (diffs <= bounds).all(), (diffs / bounds).max()
    assert bounds.max() < 0.1 * ref.abs().max()  # a bound that says something


def test_the_new_architectures_greedy_tokens_equal_llamacpps_where_the_margin_exceeds_the_bound(arch_model):
    """64 greedy steps of the kernel, then the whole sequence through llama.cpp: at each step its
    argmax is the kernel's token, or the two are a near tie: llama.cpp's margin between them is
    within the sum of their bounds (each logit may move by its bound)."""
    from specdec import generate

    theirs = llamacpp_model(arch_model.weights.path)
    prompt = ARCH_TOKENS
    arch_model.reset()
    out = generate(arch_model, prompt, max_new_tokens=64, eos_token_ids=[]).token_ids
    assert len(out) == 64
    ref = theirs.forward(prompt + out[:-1])[len(prompt) - 1 :]  # [64, V]: the logits that chose each token
    chosen = torch.tensor(out)
    differ = (ref.argmax(-1) != chosen).nonzero().flatten().tolist()
    assert len(differ) <= len(out) // 4  # most steps are far from a tie
    for step in differ:
        row, theirs_top, ours_top = len(prompt) - 1 + step, int(ref[step].argmax()), out[step]
        bound_a, bound_b = llamacpp_bound(arch_model.weights, prompt + out[:-1], [(row, theirs_top), (row, ours_top)])
        assert ref[step, theirs_top] - ref[step, ours_top] <= bound_a + bound_b, step


def test_gelu_is_accurate_and_the_same_on_both_paths(lib):
    x = torch.linspace(-12, 12, 4001, dtype=torch.float32)
    y = torch.empty_like(x)
    lib.gguf_gelu(x.data_ptr(), len(x), y.data_ptr())
    # the tanh form equals x / (1 + e^-z) (compared where 1 + tanh(y) does not cancel in float64)
    assert torch.allclose(torch.nn.functional.gelu(x.double(), approximate="tanh")[x.abs() < 4],
                          (x.double() / (1 + torch.exp(-(8 / torch.pi) ** 0.5 * x.double() * (1 + 0.044715 * x.double() ** 2))))[x.abs() < 4],
                          rtol=1e-9, atol=0)
    z = (8 / torch.pi) ** 0.5 * x.double() * (1 + 0.044715 * x.double() ** 2)
    exact = x.double() / (1 + torch.exp(-z))
    # fp32 arithmetic: z is rounded, which moves exp(-z) by a relative few ulp times |z|; where z > 88
    # the kernel's exp saturates at e^88, and the result stays below 12 / e^88 < 1e-37 in magnitude
    assert ((y.double() - exact).abs() <= 1e-6 * exact.abs() * (1 + z.abs()) + 1e-37).all()
    with native.portable_path():
        z = torch.empty_like(x)
        lib.gguf_gelu(x.data_ptr(), len(x), z.data_ptr())
    assert torch.equal(y, z)


# -- (d) SmolLM2-135M Q4_1 ---------------------------------------------------------------------------

PACK = "smollm2-135m"
# Token ids of some English and code text in SmolLM2's vocabulary (as tests/backends/test_llamacpp.py).
CONTEXT = [504, 1070, 28, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30]
EXTRA = [3158, 314, 260, 1345, 30, 2784, 28, 1070, 30, 504, 28, 30, 4667, 314, 260, 1345]
# "def fibonacci(n):\n    if n < 2:\n        return n\n    return" in SmolLM2's tokenizer (BOS first)
PROMPT = [1, 1604, 3987, 46477, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42, 448, 1003, 304, 472, 1003]


def smollm2_path():
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    return packs.gguf_file(PACK, progress=False)


@pytest.fixture(scope="module")
def smol(lib):
    return native.load_gguf_native(smollm2_path(), n_threads=1, n_ctx=512)


def one_token_steps(model, context, tokens):
    """Logits after context and after each of tokens, fed one token at a time: [1 + n, V]."""
    model.reset()
    model.forward(context[:-1])
    return torch.cat([model.forward([t]) for t in [context[-1], *tokens]])


def test_smollm2_loads_with_its_facts(smol):
    assert smol.vocab_size == 49152 and smol.max_context == 512
    assert smol.generation_config.eos_token_id == [2]
    assert capabilities(smol) == frozenset({TREES, SNAPSHOTS})
    assert smol.weights.architecture == "llama" and not smol.weights.neox


def test_smollm2_logits_are_as_close_to_a_float_forward_as_llamacpps(smol):
    smol.reset()
    ours = smol.forward(PROMPT)
    ref = reference_logits(smol.weights, PROMPT)  # [n, V], logits up to about 35
    diff = (ours - ref).abs()
    # measured: max 2.0, mean 0.24 (llama.cpp on this file: 2.1 and 0.24)
    assert diff.max() <= 3.0 and diff.mean() <= 0.35
    top2 = ref.topk(2, -1).values
    decided = top2[:, 0] - top2[:, 1] > 1.0  # rows the quantization cannot plausibly flip
    assert decided.sum() >= len(PROMPT) // 2
    assert torch.equal(ours.argmax(-1)[decided], ref.argmax(-1)[decided])
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_smollm2_logits_agree_with_llamacpp_within_a_bound(smol):
    from specdec.backends import llamacpp

    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    theirs = llamacpp.load_gguf(smollm2_path(), n_threads=1, n_ctx=512, prefill_layout="repacked")
    smol.reset()
    ours, ref = smol.forward(PROMPT), theirs.forward(PROMPT)  # [n, V]
    # llama.cpp rounds its own way, and how depends on the CPU (measured max |diff| 0.82 on an AVX2
    # machine): the difference is bounded, and an argmax may differ only where llama.cpp's top-two
    # margin is within twice the bound (the prompt's last row is such a near tie: margin 0.49).
    bound = 3.0
    assert (ours - ref).abs().max() <= bound
    top2 = ref.topk(2, -1).values
    decided = top2[:, 0] - top2[:, 1] > 2 * bound
    assert decided.any()
    assert torch.equal(ours.argmax(-1)[decided], ref.argmax(-1)[decided])


def test_smollm2_an_8_token_pass_has_the_bits_of_8_one_token_steps(smol):
    steps = one_token_steps(smol, CONTEXT, EXTRA[:7])  # [8, V]
    smol.reset()
    smol.forward(CONTEXT[:-1])
    rows = smol.forward([CONTEXT[-1], *EXTRA[:7]])
    assert rows.dtype == torch.float32 and rows.shape == (8, smol.vocab_size)
    assert torch.equal(rows, steps)
    smol.reset()
    smol.forward(CONTEXT[:-1])
    assert torch.equal(smol.forward([CONTEXT[-1], *EXTRA[:7]], num_logits=3), steps[-3:])


def test_smollm2_a_prompt_fed_in_several_passes_has_the_same_bits(smol, monkeypatch):
    smol.reset()
    whole = smol.forward(CONTEXT + EXTRA)
    monkeypatch.setattr(native, "MAX_PASS_ROWS", 7)
    smol.reset()
    assert torch.equal(smol.forward(CONTEXT + EXTRA), whole)
    smol.reset()
    assert torch.equal(smol.forward(CONTEXT + EXTRA, num_logits=9), whole[-9:])


def test_smollm2_a_tree_pass_has_the_bits_of_its_paths_one_token_steps(smol):
    a, b, c, d, e = range(5)  # a -> b, a -> c -> e, and d, under the root
    tree = TokenTree(tokens=EXTRA[:5], parents=[-1, a, a, -1, c])
    smol.reset()
    rows = forward_tree(smol, CONTEXT, tree)  # [1 + 5, V]
    for node in (a, b, c, d, e):
        path = tree.path(node)
        steps = one_token_steps(smol, CONTEXT, [tree.tokens[i] for i in path])
        assert torch.equal(rows[1 + node], steps[-1]), node
    assert torch.equal(rows[0], steps[0])
    # keep the path a -> c -> e: the next token's logits are the causal steps'
    smol.reset()
    forward_tree(smol, CONTEXT, tree)
    keep_path(smol, len(CONTEXT), tree.path(e))
    assert smol.tokens == CONTEXT + [EXTRA[0], EXTRA[2], EXTRA[4]]
    after = smol.forward([EXTRA[5]])
    expected = one_token_steps(smol, CONTEXT, [EXTRA[0], EXTRA[2], EXTRA[4], EXTRA[5]])[-1:]
    assert torch.equal(after, expected)


def test_smollm2_trim_snapshot_restore(smol):
    steps = one_token_steps(smol, CONTEXT, EXTRA[:4])
    # trim rolls back: feeding again gives the same bits
    smol.trim(len(CONTEXT) + 1)
    assert smol.tokens == CONTEXT + EXTRA[:1]
    assert torch.equal(smol.forward(EXTRA[1:4]), steps[2:])
    smol.trim(10_000)  # longer than the cache: no-op
    assert len(smol.tokens) == len(CONTEXT) + 4
    # snapshot / restore, on this backend and on a fork (another cache on the same weights)
    smol.trim(len(CONTEXT))
    snap = smol.snapshot()
    assert snap.tokens == tuple(CONTEXT) and snap.nbytes > 0
    smol.forward(EXTRA[5:9])
    smol.restore(snap)
    assert smol.tokens == CONTEXT
    assert torch.equal(smol.forward(EXTRA[:4]), steps[1:])
    twin = smol.fork()
    twin.restore(snap)
    assert torch.equal(twin.forward(EXTRA[:4]), steps[1:])
    with pytest.raises(ValueError):
        twin.restore(type(snap)(snap.tokens[:-1], snap.data))
    # keep a prefix, reset
    smol.keep(list(range(5)))
    assert smol.tokens == CONTEXT[:5]
    smol.reset()
    assert smol.tokens == []


def test_smollm2_greedy_speculative_output_equals_its_own_autoregressive_output(smol):
    from specdec import generate

    smol.reset()
    ar = generate(smol, PROMPT, max_new_tokens=24, eos_token_ids=[])
    assert len(ar.token_ids) == 24
    draft = smol.fork()  # the same weights as their own draft: a second KV cache
    for kwargs in (dict(draft=draft, verify="block", k=4, policy="static"),
                   dict(drafter="ngram", verify="greedy", k=4, policy="static"),
                   dict(draft=draft, verify="tree")):
        spec = generate(smol, PROMPT, max_new_tokens=24, eos_token_ids=[], **kwargs)
        assert spec.token_ids == ar.token_ids, kwargs
        assert spec.stats.target_forwards < len(ar.token_ids), kwargs


SPECIFICATION_METHODS = {  # the methods of the specification added last, with their draft model (if any)
    "lookahead": ("spec:lookahead:tree:window=4:ngram=3:candidates=2", False),
    "sequoia": ("spec:model:tree:mode=sequoia:budget=12", True),
    "dynamic-tree": ("spec:model:tree:mode=dynamic", True),
    "cascade": ("spec:cascade:block:k=4:policy=static", True),
    "retrieval": ("spec:retrieval:block:k=4:policy=static", False),
    "retrieval-tree": ("spec:retrieval:tree", False),
    "retrieval+model": ("spec:retrieval+model:block", True),
}


@pytest.mark.parametrize("name", SPECIFICATION_METHODS)
def test_smollm2_lookahead_sequoia_cascade_and_retrieval_keep_plain_decodings_output(smol, name):
    """On the kernel, whose rows have the bits of one-token steps: greedy output, and a seed's
    output under the Gumbel-max sampler (T = 1, and T = 0.7 with top-k), equal plain decoding's,
    token for token. The draft is an unsure copy of the model, so that drafts are also rejected;
    the retrieval store holds an earlier greedy answer to the prompt."""
    from helpers import _Unsure

    from specdec import generate
    from specdec.config import DecodeConfig
    from specdec.datastore import Datastore, open_store, use_default

    before = open_store()  # the process's store, given back at the end
    method, uses_draft = SPECIFICATION_METHODS[name]
    settings = [dict(), dict(temperature=1.0, sampler="gumbel", seed=3),
                dict(temperature=0.7, top_k=20, sampler="gumbel", seed=4)]
    for kw in settings:
        smol.reset()
        ar = generate(smol, PROMPT, max_new_tokens=24, eos_token_ids=[], **kw)
        store = Datastore()
        store.add(PROMPT + generate(smol, PROMPT, max_new_tokens=24, eos_token_ids=[]).token_ids)
        use_default(store)
        draft = _Unsure(smol.fork(), scale=2.0) if uses_draft else None
        try:
            spec = generate(smol, PROMPT, draft=draft, config=DecodeConfig.parse(method), max_new_tokens=24,
                            eos_token_ids=[], **kw)
        finally:
            use_default(before)
        assert spec.token_ids == ar.token_ids, (name, kw)
        if not kw:  # greedy: the drafts were checked, and some kept
            assert spec.stats.accepted_tokens > 0, name


def test_smollm2_sequences_in_one_pass_get_the_bits_they_get_alone(smol):
    """run_together: the rows of several sequences (their own caches, lengths, masks) in one pass of
    the weights; each sequence's logits are those of its own passes, bit for bit, a token tree's included."""
    models = [smol.fork() for _ in range(3)]
    contexts = [CONTEXT, PROMPT, CONTEXT[:5]]
    extras = [EXTRA[:1], EXTRA[:4], EXTRA[:3]]
    length = len(contexts[2])
    tree = torch.ones(3, length + 3, dtype=torch.bool)
    tree[1:, length + 1 :] = torch.eye(2, dtype=torch.bool)  # nodes 1 and 2 both hang from node 0
    tree[0, length + 1 :] = False
    options = [{}, {"num_logits": 2}, {"attend": tree, "positions": [length, length + 1, length + 1]}]
    alone = []
    for model, context, extra, kw in zip(models, contexts, extras, options):
        model.reset()
        first = model.forward(context)
        alone.append((first, model.forward(extra, **kw)))
    for model in models:
        model.reset()
    firsts = native.run_together([(m, m.pieces(c)[0]) for m, c in zip(models, contexts)])
    seconds = native.run_together([(m, m.pieces(e, **kw)[0]) for m, e, kw in zip(models, extras, options)])
    for (first, second), got_first, got_second in zip(alone, firsts, seconds):
        assert torch.equal(got_first, first) and torch.equal(got_second, second)
    assert [m.tokens for m in models] == [c + e for c, e in zip(contexts, extras)]
    with pytest.raises(ValueError, match="one piece of each sequence"):
        native.run_together([(models[0], models[0].pieces([1])[0])] * 2)


def test_smollm2_bad_inputs(smol):
    smol.reset()
    with pytest.raises(ValueError, match="at least one token"):
        smol.forward([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smol.forward([49152])
    with pytest.raises(ValueError, match="attend must be"):
        smol.forward([1, 2], attend=torch.ones(2, 3, dtype=torch.bool), positions=[0, 1])
    assert smol.tokens == []


# -- (d') the backend choice: --backend gguf ----------------------------------------------------------


def test_a_pack_loads_on_the_gguf_backend_and_decodes_as_plain_decoding(lib):
    """``load_pair(backend="gguf")``: the target on the GGUF kernel, the draft a second cache on the
    same weights; the default method (the n-gram lookup and the draft model, block verification,
    the planner) and a tree give the tokens of plain decoding."""
    from specdec import generate, models
    from specdec.config import DecodeConfig

    smollm2_path()
    pair = models.load_pair(PACK, PACK, backend="gguf", n_threads=1)
    assert pair.backend == "gguf"
    assert isinstance(pair.target, native.GGUFCausalLM) and isinstance(pair.draft, native.GGUFCausalLM)
    assert pair.draft is not pair.target and pair.draft.weights is pair.target.weights
    ids = pair.tokenizer("def fibonacci(n):")["input_ids"]
    ar = generate(pair.target, ids, max_new_tokens=20, eos_token_ids=[])
    for method in ("spec", "spec:model:tree"):
        spec = generate(pair.target, ids, draft=pair.draft, max_new_tokens=20, eos_token_ids=[],
                        config=DecodeConfig.parse(method))
        assert spec.token_ids == ar.token_ids, method
        assert spec.exact


def test_the_gguf_backend_is_refused_for_what_it_cannot_run(tmp_path):
    from specdec import models

    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(models.ModelPackError, match="the gguf backend runs GGUF files"):
        models.check_backend(str(folder), "gguf")
    smollm2_path()
    with pytest.raises(ValueError, match="dtype does not apply to the specdec's GGUF kernel backend"):
        models.load(PACK, backend="gguf", dtype="float32")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(models.ModelPackError, match="not a GGUF file") as err:
        models.load(str(fake), backend="gguf")
    assert err.value.hint.startswith("copy or download the .gguf file again")  # damaged, not another backend's


def test_specdec_generate_runs_on_the_gguf_backend(capsys):
    import json

    from specdec import cli

    smollm2_path()
    code = cli.main(["generate", "def add(a, b):", "--target", PACK, "--draft", "none", "--backend", "gguf",
                     "--drafter", "ngram", "--max-new-tokens", "12", "--threads", "1", "--compare-ar", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["weights"].endswith(f"GGUF on specdec kernels ({report['backend']['kernel_path']} path)")
    assert report["exact"] and report["ar"]["token_ids"] == report["token_ids"]
    assert "GGUF on specdec kernels" in err
    code = cli.main(["generate", "x", "--target", PACK, "--draft", "none", "--backend", "gguf", "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert code == 2 and "--dtype is an option of the torch backend" in err and "runs on specdec's GGUF kernel" in err


# -- (e) the default target: Qwen2.5-Coder-1.5B-Instruct Q4_K_M ----------------------------------------


@pytest.mark.slow
def test_the_default_target_is_batch_invariant(lib):
    name = packs.DEFAULT_TARGET
    missing = packs.missing_parts(packs.PACKS[name])
    if missing:
        pytest.skip(f"pack {name} is not installed: {packs.PACKS[name].install_command(missing)}")
    # one thread: spinning thread barriers crawl on a busy 2-core machine (the tiny models and the
    # kernel tests cover two threads)
    model = native.load_gguf_native(packs.gguf_file(name, progress=False), n_threads=1, n_ctx=512)
    assert model.weights.architecture == "qwen2" and model.vocab_size == 151936
    # "def quicksort(arr):\n    if len(arr) <= 1:" in Qwen's tokenizer, and three more tokens
    context = [750, 3974, 6860, 10939, 982, 262, 421, 2422, 10939, 8, 2651, 220, 16, 25]
    extra = [198, 286, 470]
    steps = one_token_steps(model, context, extra)  # [4, V]
    model.reset()
    model.forward(context[:-1])
    rows = model.forward([context[-1], *extra])
    assert torch.equal(rows, steps)
    assert torch.isfinite(rows).all()
    from specdec.backends import llamacpp

    if not llamacpp.available():
        return
    # llama.cpp on the same file rounds its own way, and how depends on the CPU (its AVX-512 VNNI
    # build sums in another order than its AVX2 build): measured max |diff| 0.74, mean 0.076 (logits
    # up to 28) on an AVX2 machine. What may be asserted against another engine is a bound on the
    # difference; an argmax then may differ wherever the reference's top-two margin is within twice
    # that bound (each of the two logits may move by the bound), so argmaxes are compared only where
    # the margin exceeds it -- a near tie may go either way on either engine.
    theirs = llamacpp.load_gguf(model.weights.path, n_threads=1, n_ctx=512, prefill_layout="repacked")
    model.reset()
    ours, ref = model.forward(context), theirs.forward(context)
    bound = 2.0
    assert (ours - ref).abs().max() <= bound and (ours - ref).abs().mean() <= 0.2
    top2 = ref.topk(2, -1).values
    decided = top2[:, 0] - top2[:, 1] > 2 * bound
    assert decided.any()  # the comparison below is not empty: most rows of this prompt are far from a tie
    assert torch.equal(ours.argmax(-1)[decided], ref.argmax(-1)[decided])


# -- (f) Gemma 3 270M (the gemma3-270m pack: Q4_K_M, sliding-window layers, a tied Q8_0 head) -------

GEMMA = "gemma3-270m"
GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


def gemma_path():
    missing = packs.missing_parts(packs.PACKS[GEMMA])
    if missing:
        pytest.skip(f"pack {GEMMA} is not installed: {packs.PACKS[GEMMA].install_command(missing)}")
    return packs.gguf_file(GEMMA, progress=False)


def test_gemma3_270m_runs_on_specdec_generate_and_speculation_keeps_plain_decodings_tokens(capsys):
    import json

    from specdec import cli

    gemma_path()
    code = cli.main(["generate", GEMMA_PROMPTS[0], "--target", GEMMA, "--draft", GEMMA, "--backend", "gguf",
                     "--max-new-tokens", "24", "--threads", str(THREADS), "--compare-ar", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["exact"] and report["ar"]["token_ids"] == report["token_ids"]
    assert "France" in report["text"]  # sensible text: the tokenizer and the model agree


def test_gemma3_270m_greedy_text_is_llamacpps_up_to_a_near_tie():
    """On each prompt the kernel's greedy tokens are llama.cpp's, or the first difference is a near
    tie: llama.cpp's margin between its token and the kernel's is within twice the largest
    difference between the two engines' logits on the prompt's rows (each logit may move by it)."""
    from specdec import generate, models

    path = gemma_path()
    model = native.load_gguf_native(path, n_threads=THREADS, n_ctx=512)
    theirs = llamacpp_model(path)
    tokenizer = models.load_tokenizer(GEMMA)
    assert model.weights.architecture == "gemma3" and model.vocab_size == 262144
    assert model.weights.window == 512 and sum(model.weights.sliding) == 15
    for prompt in GEMMA_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        assert ids[0] == 2  # <bos>
        model.reset()
        theirs.reset()
        ours_rows, ref_rows = model.forward(ids), theirs.forward(ids)
        top = ref_rows.topk(8, -1).indices
        bound = float((ours_rows.gather(1, top) - ref_rows.gather(1, top)).abs().max())
        ours = generate(model, ids, max_new_tokens=24, eos_token_ids=[]).token_ids
        ref = generate(theirs, ids, max_new_tokens=24, eos_token_ids=[]).token_ids
        if ours == ref:
            continue
        step = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        theirs.reset()
        row = theirs.forward(ids + ref[:step])[-1]
        margin = float(row[ref[step]] - row[ours[step]])
        assert margin <= 2 * bound, (prompt, step, margin, bound)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads this process's memory from /proc")
def test_a_repacked_tensors_file_pages_leave_the_process_and_read_back_the_same(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensor = mapped[4196:4196 + 60_000_000].reshape(-1, 100)  # [rows, row bytes], not page-aligned
    total = int(tensor.astype(np.uint64).sum())  # every page read: resident
    before = _rss_kib()
    native._drop_pages(tensor)
    assert before - _rss_kib() > 0.9 * tensor.nbytes / 1024  # the tensor's pages are no longer resident
    assert int(tensor.astype(np.uint64).sum()) == total  # and read back from the file
