"""Which backend runs a GGUF file when the choice is left to specdec (``backend="auto"``).

Two backends run a GGUF file's own quantized weights: llama.cpp (:mod:`specdec.backends.llamacpp`)
and specdec's batch-invariant kernel (:mod:`specdec.backends.gguf`). Which is faster is a property
of the machine and the file -- the kernel shares each weight block's read among a pass's rows and,
on AVX2 + FMA CPUs, makes one-row steps and 4-row verification passes cheaper than llama.cpp's
(benchmarks/gguf-row-cost.json); another CPU (AVX-512 VNNI, ARM) may favour llama.cpp. So the
choice is measured, once per machine, file and thread count, and cached beside the planner's cost
curves (:mod:`specdec.measurements`):

- where the kernel cannot run the file (an architecture or tensor type it lacks) or runs only its
  portable path (no AVX2 + FMA + F16C), llama.cpp;
- where the llama.cpp binding is not installed, the kernel;
- otherwise both are loaded and timed, alternating, on a plain step (1 row) and on a 4-row pass
  (what verifying three drafted tokens costs), fastest of :data:`SWEEPS` after a warm-up (other
  work on the machine only adds time). The kernel is chosen where neither costs more than
  llama.cpp's: then plain decoding is no slower and every verification pass is cheaper.

Either choice is exact (each backend's speculative output equals its own plain decoding); the
choice moves only speed and, where llama.cpp's rows are not batch-invariant, which near-ties a
verification row resolves as a one-token step would.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from specdec.backends import llamacpp
from specdec.measurements import cache_file, machine
from specdec.paths import load_measurement, save_measurement

CHOICE_FORMAT = 1  # bump when what is measured changes: older cache files are measured again
ROWS = (1, 4)  # a plain step, and a pass verifying three drafted tokens
SWEEPS = 3
CONTEXT = 32  # tokens fed before timing, so the rows attend to a context
LABELS = {"llamacpp": "llama.cpp", "gguf": "specdec's GGUF kernel"}


def kernel_refusal(path: str | Path) -> str | None:
    """Why specdec's GGUF kernel should not run ``path`` here (None: it can, on its AVX2 path)."""
    from specdec.backends import gguf

    try:
        if not gguf.uses_avx2():
            return "this CPU lacks AVX2, FMA or F16C, where specdec's GGUF kernel runs only its portable C path"
        gguf.GGUFWeights(path)  # memory-mapped: reads the header and the tensor table
    except gguf.KernelUnavailable as err:
        return f"specdec's GGUF kernel could not be built ({err})"
    except ValueError as err:
        return str(err).replace(f"; {gguf.LLAMACPP_HINT}", "")
    return None


def choose_gguf_backend(path: str | Path, *, n_threads: int | None = None, cache_dir: str | Path | None = None,
                        refresh: bool = False) -> dict[str, Any]:
    """``{"backend": "gguf" | "llamacpp" | None, "why": one line, "source": "rule" | "measured" |
    "cache", "seconds": {backend: [seconds for each of ROWS]} where measured}``. ``None``: neither
    GGUF backend can run the file here (the caller falls back to transformers)."""
    path = Path(path)
    refusal = kernel_refusal(path)
    if not llamacpp.available():
        if refusal is not None:
            return {"backend": None, "why": f"llama.cpp is not installed and {refusal}", "source": "rule"}
        return {"backend": "gguf", "source": "rule",
                "why": "specdec's GGUF kernel: the llama.cpp binding is not installed (pip install 'specdec[llamacpp]')"}
    if refusal is not None:
        return {"backend": "llamacpp", "why": f"llama.cpp: {refusal}", "source": "rule"}
    stat = path.stat()
    n_threads = n_threads or llamacpp.default_threads()
    key = {"what": "GGUF backend choice", "machine": machine(), "model": path.name, "bytes": stat.st_size,
           "mtime": int(stat.st_mtime), "threads": n_threads, "rows": list(ROWS)}
    where = cache_file(key, cache_dir)
    saved = None if refresh else load_measurement(where, key, CHOICE_FORMAT)
    seconds = saved.get("seconds") if saved is not None else None
    source = "cache"
    if not _valid(seconds):
        seconds, source = _measure(path, n_threads), "measured"
        save_measurement(where, {"format": CHOICE_FORMAT, "key": key, "seconds": seconds})
    kernel, other = seconds["gguf"], seconds["llamacpp"]
    wins = all(k <= o for k, o in zip(kernel, other))
    backend = "gguf" if wins else "llamacpp"
    rows = ", ".join(f"{n} row{'s' * (n > 1)} {1e3 * k:.1f} ms against {1e3 * o:.1f} ms"
                     for n, k, o in zip(ROWS, kernel, other))
    verdict = "specdec's GGUF kernel: no slower than llama.cpp here" if wins else \
        "llama.cpp: specdec's GGUF kernel is slower here"
    why = f"{verdict} (measured once on this machine: kernel against llama.cpp, {rows})"
    return {"backend": backend, "why": why, "source": source, "seconds": seconds}


def _valid(seconds: Any) -> bool:
    return (isinstance(seconds, dict) and all(isinstance(seconds.get(b), list) and len(seconds[b]) == len(ROWS)
                                              and all(isinstance(v, (int, float)) and v > 0 for v in seconds[b])
                                              for b in LABELS))


def _measure(path: Path, n_threads: int | None) -> dict[str, list[float]]:
    """Fastest seconds of a pass of each of :data:`ROWS` new rows (logits for all) on each backend."""
    from specdec.backends import gguf

    candidates = {"gguf": gguf.load_gguf_native(path, n_threads=n_threads),
                  "llamacpp": llamacpp.LlamaCppCausalLM(llamacpp.GGUFWeights(path), n_threads=n_threads)}
    vocab = candidates["gguf"].vocab_size
    ids = [(17 + 7919 * i) % vocab for i in range(CONTEXT + max(ROWS))]
    times: dict[str, list[list[float]]] = {b: [[] for _ in ROWS] for b in candidates}
    for model in candidates.values():
        model.forward(ids[:CONTEXT], num_logits=1)
        model.forward(ids[CONTEXT:CONTEXT + 1], num_logits=1)  # warm-up
        model.trim(CONTEXT)
    for sweep in range(SWEEPS):
        order = list(candidates.items())
        for name, model in order if sweep % 2 else order[::-1]:
            for i, n in enumerate(ROWS):
                t0 = time.perf_counter()
                model.forward(ids[CONTEXT:CONTEXT + n], num_logits=n)
                times[name][i].append(time.perf_counter() - t0)
                model.trim(CONTEXT)
    return {name: [min(t) for t in rows] for name, rows in times.items()}
