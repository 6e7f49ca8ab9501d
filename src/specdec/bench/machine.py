"""The machine a benchmark ran on, in the figures that set its speeds: the CPU's vector features,
its memory read speed, and each GGUF backend's one-token step on the run's target file.

A one-token step of a quantized model reads every weight once. Where the CPU's arithmetic keeps up
(wide vectors, VNNI dot products) a step costs the weights' bytes over the memory's read speed, the
memory floor, and two engines that both reach it decode at the same speed; where it does not (an
AVX2-only CPU), the engine with the cheaper arithmetic leads. So a speed-up of specdec over
llama.cpp measured on one machine holds on another only where their one-row steps compare alike.
:func:`machine_record` measures these figures in a few seconds; the bench stores them in each
run's ``environment["machine"]`` and prints them above its table, and the GGUF benchmark scripts
store them in their JSON.
"""

from __future__ import annotations

import copy
import ctypes
import time
from pathlib import Path
from typing import Any

import numpy as np

from specdec import kernels
from specdec.backends import choice, gguf
from specdec.backends.table import BY_NAME, GGUF, LABELS, LLAMACPP
from specdec.measurements import cpu_features, machine

READ_MIB = 1024  # the buffer read: far larger than any CPU's last-level cache
READ_SECONDS = 1.0  # reads repeated for this long (and at least READ_REPEATS times); the fastest counts
READ_REPEATS = 3
STEP_CONTEXT = 32  # tokens cached before the timed one-token steps
STEP_REPEATS = 5  # timed steps per backend; the fastest counts (other work only adds time)
STEP_CTX = 256  # the context the timed models are loaded with
BACKENDS = {name: LABELS[name] for name in (GGUF, LLAMACPP)}  # what the one-row step is timed on, by label


class ReadSpeedUnavailable(RuntimeError):
    """The read loop could not be compiled or loaded (no C compiler, unwritable cache)."""


def machine_record(threads: int, target: str | Path | None, *, why_no_target: str = "no GGUF target",
                   read_mib: int = READ_MIB) -> dict[str, Any]:
    """``{"cpu": model name, "features": {flag: bool} | None, "memory_read": ..., "one_row_step": ...}``:
    :func:`specdec.measurements.cpu_features`, :func:`read_speed` with ``threads`` threads and
    :func:`one_row_steps` on ``target`` (a GGUF file; None: ``{"skipped": why_no_target}``). A
    figure that cannot be measured here is ``{"skipped": why}``.

    Measured once per process for the same arguments (and the same target file, by size and
    modification time): a process that runs several benches -- a notebook, a script, the test suite
    -- spends the seconds of the measurement once and records the same figures in each run."""
    file = None if target is None else Path(target)
    stamp = None if file is None or not file.exists() else (file.stat().st_size, file.stat().st_mtime_ns)
    key = (threads, None if file is None else str(file.resolve()), stamp, why_no_target, read_mib)
    if key not in _RECORDS:
        _RECORDS[key] = _measure(threads, target, why_no_target, read_mib)
    return copy.deepcopy(_RECORDS[key])


_RECORDS: dict[tuple, dict[str, Any]] = {}  # machine_record's measurements in this process, by its arguments


def _measure(threads: int, target: str | Path | None, why_no_target: str, read_mib: int) -> dict[str, Any]:
    try:
        read = read_speed(threads, mib=read_mib)
    except (ReadSpeedUnavailable, MemoryError) as err:
        read = {"skipped": str(err) or type(err).__name__}
    steps = one_row_steps(target, threads) if target is not None else {"skipped": why_no_target}
    return {"cpu": machine(), "features": cpu_features(), "memory_read": read, "one_row_step": steps,
            "gguf_kernel_path": gguf_kernel_path()}


def gguf_kernel_path() -> str:
    """The path specdec's GGUF kernel runs here (:data:`specdec.backends.gguf.PATHS`), or why it has none."""
    try:
        return gguf.kernel_path()
    except gguf.KernelUnavailable as err:
        return f"none ({err})"


def read_speed(threads: int, *, mib: int = READ_MIB, seconds: float = READ_SECONDS) -> dict[str, Any]:
    """The memory's read speed with ``threads`` threads, as STREAM measures it: the fastest of
    repeated sums of a ``mib`` MiB buffer (written first, so that its pages exist), in GB/s
    (10^9 bytes a second). ``{"gb_per_s", "threads", "mib", "repeats"}``. Raises
    :class:`ReadSpeedUnavailable` without a C compiler, ``MemoryError`` without the memory."""
    lib = _read_library()
    words = np.empty((mib << 20) // 8, dtype=np.uint64)  # [n] 64-bit words
    pointer, n = words.ctypes.data, words.size
    lib.specdec_fill_words(pointer, n, threads)
    lib.specdec_read_words(pointer, n, threads)  # a warm-up: threads started, pages mapped
    best, repeats = float("inf"), 0
    began = time.perf_counter()
    while repeats < READ_REPEATS or time.perf_counter() - began < seconds:
        t0 = time.perf_counter()
        lib.specdec_read_words(pointer, n, threads)
        best, repeats = min(best, time.perf_counter() - t0), repeats + 1
    return {"gb_per_s": words.nbytes / best / 1e9, "threads": threads, "mib": mib, "repeats": repeats}


def one_row_steps(path: str | Path, threads: int) -> dict[str, Any]:
    """Each GGUF backend's one-token step on ``path`` with ``threads`` threads: the fastest of
    :data:`STEP_REPEATS` steps after a :data:`STEP_CONTEXT`-token context, the backends taking turns.
    ``{"model": file name, "threads", "context", "ms": {backend: ms}, "skipped": {backend: why}}``,
    backends named as in :data:`BACKENDS`; a backend that cannot run the file here is skipped."""
    models, skipped = _load_backends(Path(path), threads)
    vocab = min((m.vocab_size for m in models.values()), default=1)
    ids = [(17 + 7919 * i) % vocab for i in range(STEP_CONTEXT + STEP_REPEATS + 1)]
    for model in models.values():
        model.forward(ids[:STEP_CONTEXT], num_logits=1)
        model.forward(ids[STEP_CONTEXT:STEP_CONTEXT + 1])  # a warm-up step
        model.trim(STEP_CONTEXT)
    best = {name: float("inf") for name in models}
    for token in ids[STEP_CONTEXT + 1:]:
        for name, model in models.items():
            t0 = time.perf_counter()
            model.forward([token])
            best[name] = min(best[name], time.perf_counter() - t0)
            model.trim(STEP_CONTEXT)
    return {"model": Path(path).name, "threads": threads, "context": STEP_CONTEXT,
            "ms": {name: 1e3 * s for name, s in best.items()}, "skipped": skipped}


def _load_backends(path: Path, threads: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The backends of :data:`BACKENDS` that run ``path`` here, each loaded by its row of the table
    (:meth:`specdec.backends.table.Backend.load`), and why each other does not."""
    models: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in BACKENDS:
        row = BY_NAME[name]
        refusal = choice.refusal(name, path)
        try:
            if refusal is None:
                models[name] = row.load(path, n_threads=threads, n_ctx=STEP_CTX)
            else:
                skipped[name] = refusal
        except (ValueError, RuntimeError) as err:
            skipped[name] = str(err)
    return models, skipped


_library: list[ctypes.CDLL] = []


def _read_library() -> ctypes.CDLL:
    """csrc/read_speed.c, compiled once (:func:`specdec.kernels.build_library`)."""
    if not _library:
        _library.append(kernels.build_library("read_speed.c", ["-O3", "-fopenmp", "-shared", "-fPIC"], name="read_speed",
                                              interface="read_speed_interface", error=ReadSpeedUnavailable,
                                              serial_fallback=True))
    return _library[0]
