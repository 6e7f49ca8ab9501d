"""A batch-invariant bf16 linear layer for CPUs without native bf16 arithmetic.

Speculative decoding pays off only if a target forward over the k + 1 verified tokens costs about
what a one-token forward costs. On an AVX2 CPU (no AVX-512 bf16, no AMX), PyTorch 2.13's bf16
matmul costs about n times its one-row cost for n rows (measured on this project's CI machine: a
5-token forward of Qwen2.5-Coder-1.5B took 3.8x a 1-token forward), so verification is no cheaper
than decoding the tokens one by one. ``csrc/linear_bf16.c`` reads each weight row once per call and
multiplies it into every row of x, so a few rows cost little more than one.

It is also *batch invariant*: each output element is accumulated in the same order whatever the
number of rows, so a verification pass computes in these layers bit for bit what one-token passes
compute. Greedy speculative output then matches greedy autoregressive output even at near-ties
(attention and norms are per-row too; their kernels are PyTorch's).

:func:`accelerate` switches a loaded model's bf16 ``nn.Linear`` layers to the kernel; the kernel is
compiled once with the system C compiler into the cache directory. Where it cannot be used (not
x86-64 with AVX2 and FMA, no C compiler, weights not bf16 on the CPU, autograd needs gradients) the
layers keep PyTorch's implementation, and :func:`status` says why.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import types
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from specdec.paths import cache_root

SOURCE = "linear_bf16.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]

_library: ctypes.CDLL | None = None
_unavailable: str | None = None  # why the kernel cannot be used, once known
_cache_dir: str | Path | None = None  # the cache the compiled kernels live in (None: the default; see use_cache_dir)

# -- the prompt's prefill ----------------------------------------------------------------------
#
# Batch invariance matters for rows whose results are compared with one-token steps: verification
# rows and the rows that produce logits. A long prompt's other rows only fill the KV cache, and
# they are computed the same way for every method (specdec.backends.base.prefill feeds them in a
# forward pass of their own, before the last prompt token), so they may use whatever is fastest:
# PyTorch's bf16 matmul (oneDNN) and SDPA, several times faster than the kernels above for
# thousands of rows. Greedy speculative output still equals greedy autoregressive output, because
# both read the same prefilled cache.

PREFILL_ROWS = 64  # prompts with fewer uncached tokens than this are fed as one invariant pass
_prefilling: contextvars.ContextVar[bool] = contextvars.ContextVar("specdec_prefilling", default=False)


@contextlib.contextmanager
def prefill() -> Iterator[None]:
    """Within the block, :func:`linear_f32`, :func:`linear_i8_f32` and :func:`attention_rows` use
    PyTorch's fastest CPU kernels, which are not batch invariant. Only for forward passes that
    fill the cache with a prompt's tokens and whose logits are not used (see the note above)."""
    token = _prefilling.set(True)
    try:
        yield
    finally:
        _prefilling.reset(token)


def prefilling() -> bool:
    """Whether the calling code runs inside :func:`prefill`."""
    return _prefilling.get()


def status() -> str:
    """'available', or the reason the fast kernel cannot be used on this machine."""
    return "available" if _load() is not None else f"unavailable: {_unavailable}"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with the fast kernel; the result has ``x``'s dtype.

    x: (..., in) any float dtype; weight: (out, in) bf16 contiguous on the CPU; bias: (out,) or None.
    Raises RuntimeError if the kernel is unavailable (see :func:`status`).
    """
    out_features, in_features = weight.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, in_features).to(torch.float32).contiguous()  # (n, in) fp32
    y = linear_f32(rows, weight)  # (n, out) fp32
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(x.dtype).reshape(*lead, out_features)


def linear_f32(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows (n, in) fp32 contiguous times weight (out, in) bf16 contiguous, transposed: (n, out) fp32.

    Inside :func:`prefill` the rows (bf16 values widened, as every caller passes) go through
    PyTorch's bf16 matmul, whose product is rounded to bf16 before it is widened back."""
    if _prefilling.get():
        return torch.nn.functional.linear(rows.to(torch.bfloat16), weight).to(torch.float32)
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the fast bf16 kernel is unavailable: {_unavailable}")
    y = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)  # (n, out) fp32
    lib.specdec_linear_bf16(
        rows.data_ptr(), weight.data_ptr(), y.data_ptr(),
        rows.shape[0], weight.shape[1], weight.shape[0], torch.get_num_threads(),
    )
    return y


INT8_GROUP = 128  # inputs per int8 scale (the kernel's QG)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row per :data:`INT8_GROUP` inputs, for draft models.

    weight [out, in] (in a multiple of INT8_GROUP) -> (q [out, in] int8, scales [out, in / G] fp32)
    with weight ~ q * scale: each entry within half a step (max |w| of its group / 127 / 2).
    """
    out_features, in_features = weight.shape
    if in_features % INT8_GROUP:
        raise ValueError(f"int8 weights need a multiple of {INT8_GROUP} inputs, got {in_features}")
    groups = weight.detach().to(torch.float32).reshape(out_features, -1, INT8_GROUP)  # [out, in / G, G]
    scales = groups.abs().amax(-1) / 127.0  # [out, in / G]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8).reshape(out_features, in_features)
    return q.contiguous(), scales.contiguous()


def linear_i8_f32(rows: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows (n, in) fp32 contiguous times (q * scales) transposed, from :func:`quantize_int8`: (n, out) fp32.

    Inside :func:`prefill` the weights are dequantised for the call and multiplied by PyTorch's fp32 matmul."""
    if _prefilling.get():
        weight = (q.view(q.shape[0], -1, INT8_GROUP).to(torch.float32) * scales[..., None]).view(q.shape)  # [out, in]
        return torch.nn.functional.linear(rows, weight)
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the fast kernels are unavailable: {_unavailable}")
    y = torch.empty(rows.shape[0], q.shape[0], dtype=torch.float32)  # (n, out) fp32
    lib.specdec_linear_i8(
        rows.data_ptr(), q.data_ptr(), scales.data_ptr(), y.data_ptr(),
        rows.shape[0], q.shape[1], q.shape[0], torch.get_num_threads(),
    )
    return y


def accelerate(model: torch.nn.Module) -> int:
    """Route ``model``'s bf16 CPU ``nn.Linear`` layers through the fast kernel; returns how many.

    Returns 0 (and changes nothing) when the kernel is unavailable. Idempotent. Layers fall back to
    PyTorch whenever gradients are needed, so training code is unaffected.
    """
    if _load() is None:
        return 0
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or getattr(module, "_specdec_fast", False):
            continue
        weight = module.weight
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not weight.is_contiguous():
            continue
        module.forward = types.MethodType(_fast_forward, module)
        module._specdec_fast = True
        count += 1
    return count


def restore(model: torch.nn.Module) -> int:
    """Undo :func:`accelerate`: the layers use PyTorch's linear again; returns how many."""
    count = 0
    for module in model.modules():
        if getattr(module, "_specdec_fast", False):
            del module.forward  # the instance attribute; the class's forward shows through again
            del module._specdec_fast
            count += 1
    return count


def _fast_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
    if needs_grad or self.weight.dtype != torch.bfloat16 or not self.weight.is_contiguous():
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return linear(x, self.weight, self.bias)


# -- batch-invariant attention ---------------------------------------------------------------------

ATTENTION = "specdec"  # the name under which transformers finds the attention below


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function that is batch invariant (see ``csrc/linear_bf16.c``).

    query [1, heads, n, d]; key, value [1, kv_heads, L, d]; attention_mask: None (every row sees
    every key if n == 1, else causal), a bool [1, 1, n, L] (True = sees) or a float one (0 = sees).
    Returns ([1, n, heads, d] in query's dtype, None). Falls back to PyTorch's SDPA for batches,
    sliding windows, dropout in training, or when the kernel is unavailable.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    lib = _load()
    batch, heads, n, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if (lib is None or batch != 1 or query.device.type != "cpu" or kwargs.get("sliding_window") or (dropout and module.training)
            or torch.is_grad_enabled() and query.requires_grad):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scale = float(scaling) if scaling is not None else d**-0.5
    if attention_mask is None:
        visible = None if n == 1 else torch.ones(n, length, dtype=torch.bool).tril(length - n)
    else:
        mask = attention_mask[0, 0, :, :length]
        visible = mask if mask.dtype == torch.bool else mask == 0
    q = query[0].to(torch.float32).contiguous()  # [heads, n, d]
    k = key[0].to(torch.float32).contiguous()  # [kv_heads, L, d]
    v = value[0].to(torch.float32).contiguous()  # [kv_heads, L, d]
    out = attention_rows(q, k, v, length, visible, scale)  # [n, heads, d]
    return out.to(query.dtype)[None], None


def attention_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, visible: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The batch-invariant attention kernel on fp32 tensors: out [n, heads, d] fp32.

    q [heads, n, d] contiguous; k, v [kv_heads, cap, d] contiguous with cap >= length (the first
    ``length`` keys of each head are read, e.g. from a preallocated cache); visible [n, length]
    bool (True = the row sees that key) or None (every row sees every key).
    """
    if _prefilling.get():
        return _sdpa_rows(q, k, v, length, visible, scale)
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the attention kernel is unavailable: {_unavailable}")
    heads, n, d = q.shape
    kv_heads, cap = k.shape[0], k.shape[1]
    vis = None if visible is None else visible.to(torch.uint8).contiguous()  # [n, length]
    out = torch.empty(n, heads, d, dtype=torch.float32)  # [n, heads, d]
    threads = torch.get_num_threads()
    scratch = torch.empty(threads, length, dtype=torch.float32)
    lib.specdec_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), 0 if vis is None else vis.data_ptr(),
                          out.data_ptr(), heads, kv_heads, n, length, d, cap * d, ctypes.c_float(scale),
                          scratch.data_ptr(), threads)
    return out


def _sdpa_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, visible: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """:func:`attention_rows` computed by PyTorch's scaled_dot_product_attention (prefill only): out [n, heads, d] fp32."""
    heads, n, d = q.shape
    group = heads // k.shape[0]
    keys = k[:, :length].repeat_interleave(group, dim=0)  # [heads, L, d], contiguous whatever k's capacity
    values = v[:, :length].repeat_interleave(group, dim=0)  # [heads, L, d]
    mask = None if visible is None else visible.to(torch.bool)[None, None]  # [1, 1, n, L]
    # A prompt from an empty cache sees exactly the causal mask: say so, and SDPA takes its faster
    # causal kernel (the same numbers as with the mask, about half the time).
    causal = mask is not None and n == length and torch.equal(mask[0, 0], torch.ones(n, n, dtype=torch.bool).tril())
    out = torch.nn.functional.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=None if causal else mask, is_causal=causal, scale=scale
    )  # [1, heads, n, d]
    return out[0].transpose(0, 1).contiguous()  # [n, heads, d]


def use_invariant_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` to :func:`attention` (registered with transformers as ``"specdec"``).

    Returns False (and changes nothing) when the kernel is unavailable. Only llama/qwen2-style
    models whose attention reads ``config._attn_implementation`` are switched.
    """
    if _load() is None or any(p.device.type != "cpu" for p in model.parameters()):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    model.config._attn_implementation = ATTENTION
    return True


# -- building and loading the shared library ----------------------------------------------------


def _load() -> ctypes.CDLL | None:
    global _library, _unavailable
    if _library is not None or _unavailable is not None:
        return _library
    try:
        _library = _build_and_open()
    except _Unavailable as why:
        _unavailable = str(why)
    return _library


class _Unavailable(Exception):
    pass


def use_cache_dir(cache_dir: str | Path | None) -> None:
    """Keep the compiled kernels in ``cache_dir``'s ``kernels`` folder from now on (None: the
    default cache, :func:`specdec.paths.cache_root`). Loading a model sets it to the cache the model
    is loaded from, so ``--cache-dir`` holds the kernels too; a library this process has already
    loaded stays loaded."""
    global _cache_dir
    _cache_dir = cache_dir


def kernels_dir() -> Path:
    """The folder the compiled kernels are built into and loaded from (see :func:`use_cache_dir`)."""
    return cache_root(_cache_dir) / "kernels"


def build_library(source: str, flags: Sequence[str], *, name: str, interface: str, libs: Sequence[str] = (),
                  error: type[Exception] = RuntimeError, serial_fallback: bool = False) -> ctypes.CDLL:
    """Compile ``csrc/<source>`` with ``flags`` (then ``libs``) once into :func:`kernels_dir`,
    named ``<name>-<hash of source and flags>.so``, load it, and declare its functions to ctypes
    as the library describes them (:func:`declare`, from its function named ``interface``).
    ``serial_fallback``: retry without ``-fopenmp`` when the compiler lacks it. Raises ``error``
    with the reason (no compiler, an unwritable cache, a failed build or load, a description this
    module cannot read).

    Beside the library a stamp (``<library>.sha256``) holds its size and hash, written once the
    library is complete. A library that does not match its stamp (cut short, changed, or built
    before stamps) or that fails to load is built again, once: a damaged file is never loaded,
    since a truncated library loads and then kills the process with SIGBUS when its code runs."""
    code = resources.files("specdec").joinpath("csrc", source).read_bytes()
    digest = hashlib.sha256(code + " ".join([*flags, *libs]).encode()).hexdigest()[:16]
    target = kernels_dir() / f"{name}-{digest}.so"
    lib = None
    if _intact(target):
        with contextlib.suppress(OSError):  # matches its stamp yet does not load: built again below
            lib = ctypes.CDLL(str(target))
    if lib is None:
        _compile(code, target, flags, libs, error=error, serial_fallback=serial_fallback)
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as err:
            raise error(f"loading {target} failed: {err}") from None
    try:
        declare(lib, interface)
    except InterfaceMismatch as err:
        raise error(str(err)) from None
    return lib


# -- the interface, as each library describes it --------------------------------------------------
#
# Each source in csrc/ lists its exported functions once (an X-macro: a row per function) and
# exports a function returning their C prototypes as text, one a line, and optionally the fields
# of a record it reads ("field NAME COUNT"). Python declares every function from that text; no
# Python file repeats a C signature, and a change on the C side is read, not mirrored by hand.

# C types of the exported functions' prototypes -> ctypes (a pointer of any type is a c_void_p).
C_TYPES: dict[str, Any] = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
                           "uint64_t": ctypes.c_uint64, "float": ctypes.c_float, "double": ctypes.c_double}
_PROTOTYPE = re.compile(r"^(?P<result>[\w ]+?)\s*\b(?P<name>\w+)\s*\((?P<params>.*)\);$")
_fields: dict[int, tuple[tuple[str, int], ...]] = {}  # library handle -> the record's fields it describes


class InterfaceMismatch(RuntimeError):
    """A library's description of its interface and what the Python side reads or passes disagree."""


def _c_type(text: str, where: str) -> Any:
    """The ctypes type of a C parameter or result (``const float *x``, ``int64_t n``, ``void``)."""
    if "*" in text:
        return ctypes.c_void_p
    words = text.replace("const ", " ").split()  # a parameter's last word is its name
    base = words[0] if len(words) == 1 or where.endswith("result") else " ".join(words[:-1])
    if base not in C_TYPES:
        raise InterfaceMismatch(f"{where}: the C type {base!r} has no ctypes type here ({', '.join(C_TYPES)})")
    return C_TYPES[base]


def parse_interface(text: str) -> tuple[dict[str, tuple[list[Any], Any]], tuple[tuple[str, int], ...]]:
    """A library's description of its interface: each exported function's (argtypes, restype) by
    name, and the fields of the record it reads, (name, count) in their order."""
    functions: dict[str, tuple[list[Any], Any]] = {}
    fields: list[tuple[str, int]] = []
    for line in text.splitlines():
        if line.startswith("field "):
            _, name, count = line.split()
            fields.append((name, int(count)))
            continue
        m = _PROTOTYPE.match(line.strip())
        if m is None:
            raise InterfaceMismatch(f"a compiled kernel describes its interface with a line this module cannot read: "
                                    f"{line!r}")
        name, params = m["name"], m["params"].strip()
        args = [] if params in ("", "void") else [_c_type(p, f"{name} parameter {p.strip()!r}") for p in params.split(",")]
        functions[name] = (args, _c_type(m["result"], f"{name} result"))
    return functions, tuple(fields)


def declare(lib: ctypes.CDLL, interface: str) -> None:
    """Declares every exported function of ``lib`` to ctypes from the prototypes its function named
    ``interface`` returns, and keeps the record's fields it describes for :func:`record_fields`.
    Raises :class:`InterfaceMismatch` for a description this module cannot read."""
    describe = getattr(lib, interface)
    describe.argtypes, describe.restype = [], ctypes.c_char_p
    functions, fields = parse_interface(describe().decode())
    for name, (args, result) in functions.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    _fields[lib._handle] = fields


def record_fields(lib: ctypes.CDLL) -> tuple[tuple[str, int], ...]:
    """The fields of the record ``lib`` reads, (name, count) in the library's order, as its
    description gave them to :func:`declare`."""
    return _fields[lib._handle]


def _stamp(library: Path) -> Path:
    return library.with_name(f"{library.name}.sha256")


def _fingerprint(path: Path) -> str:
    """'<size> <sha256>' of the file at ``path``."""
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _intact(library: Path) -> bool:
    """Whether ``library`` is there and has the size and hash its stamp records."""
    try:
        return _stamp(library).read_text().strip() == _fingerprint(library)
    except OSError:
        return False


def _compiler(error: type[Exception]) -> list[str]:
    """The C compiler's command: ``$CC`` (split as a shell would, e.g. ``ccache gcc``), else cc or gcc."""
    chosen = os.environ.get("CC")
    if chosen and chosen.strip():
        return shlex.split(chosen)
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise error("no C compiler found (install gcc, or set CC)")
    return [found]


def _compile(code: bytes, target: Path, flags: Sequence[str], libs: Sequence[str], *,
             error: type[Exception], serial_fallback: bool) -> None:
    """Build ``code`` into ``target`` (renamed into place whole, so a concurrent load never sees
    half a file), then write its stamp."""
    compiler = _compiler(error)
    src = target.with_suffix(".c")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_whole(src, code)
    except OSError as err:
        raise error(f"cannot write into {target.parent} (the cache directory; set --cache-dir or $SPECDEC_CACHE): "
                    f"{err.strerror or err}") from None
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        done = _run(compiler, flags, partial, src, libs, error)
        if done.returncode != 0 and serial_fallback:  # a compiler without OpenMP (e.g. Apple's clang): one thread
            done = _run(compiler, [f for f in flags if f != "-fopenmp"], partial, src, libs, error)
        if done.returncode != 0:
            raise error(f"compiling {src} failed: {done.stderr.strip()[-400:]}")
        stamp = _fingerprint(partial)
        os.replace(partial, target)  # a new file: a process that has the old one loaded keeps it
        _write_whole(_stamp(target), f"{stamp}\n".encode())
    except OSError as err:
        raise error(f"building {target} failed: {err}") from None
    finally:
        partial.unlink(missing_ok=True)


def _write_whole(path: Path, data: bytes) -> None:
    """Write ``path`` through a file of this process renamed over it (a reader sees all of it or none),
    readable as the umask allows, like the library, so that a shared cache serves every user."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _run(compiler: list[str], flags: Sequence[str], out: Path, src: Path, libs: Sequence[str],
         error: type[Exception]) -> subprocess.CompletedProcess:
    try:
        # the source by its absolute name: a source that includes itself (#include __FILE__) finds itself
        return subprocess.run([*compiler, *flags, "-o", str(out), str(src.absolute()), *libs], capture_output=True,
                              text=True)
    except OSError as err:  # $CC names no program that runs
        raise error(f"cannot run the C compiler {' '.join(compiler)}: {err.strerror or err} "
                    "(install gcc, or set CC to a compiler that runs)") from None


def _build_and_open() -> ctypes.CDLL:
    if os.environ.get("SPECDEC_KERNELS", "").lower() == "torch":
        raise _Unavailable("disabled by SPECDEC_KERNELS=torch")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise _Unavailable(f"needs an x86-64 CPU, this is {platform.machine()}")
    lib = build_library(SOURCE, FLAGS, name="linear_bf16", interface="linear_bf16_interface", error=_Unavailable)
    if not lib.specdec_avx2_available():
        raise _Unavailable("this CPU lacks AVX2/FMA")
    return lib


def describe_model(model: Any) -> str:
    """'fast-bf16 (n layers)' or 'torch': which linear kernel ``model`` uses, for reports."""
    n = sum(1 for m in model.modules() if getattr(m, "_specdec_fast", False))
    return f"specdec bf16 ({n} linear layers)" if n else "torch"
