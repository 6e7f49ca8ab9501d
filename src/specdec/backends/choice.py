"""Which backend runs a GGUF file when the choice is left to specdec (``backend="auto"``).

Two backends run a GGUF file's own quantized weights: specdec's batch-invariant kernel
(:mod:`specdec.backends.gguf`) and llama.cpp (:mod:`specdec.backends.llamacpp`). Both are exact in
law (each verification rule keeps the target's distribution), but only the kernel computes every
row of a verification pass, a token tree or a prompt as a one-token step computes it, bit for bit:
there greedy and seeded speculative output is plain decoding's token for token, and a prompt the
prompt cache reuses gives the answer of a cold prefill. llama.cpp's rows are not batch-invariant
for every file (the Qwen Q4_K_M files: its repacked kernels round a pass of four rows or more
differently), so near-ties can go either way there. Exactness is the promise, so the choice is a
rule, not a measurement of speed:

- the kernel wherever it runs the file: its architecture and tensor types are the kernel's and
  its library builds here. On a CPU without AVX2, FMA or F16C it runs its portable C path, which
  performs the same operations and gives the same bits, only slower; the reason says so, and
  ``--backend llamacpp`` is the faster choice there for whoever accepts near-tie differences;
- llama.cpp where the kernel cannot run the file (and its binding is installed);
- neither (None) where both are out; the caller falls back to transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.backends import gguf, llamacpp
from specdec.backends.table import BY_NAME, GGUF, LLAMACPP

KERNEL_WHY = ("specdec's GGUF kernel: it runs this file, and its rows are batch-invariant, so greedy and seeded "
              "output is plain decoding's token for token")
PORTABLE_WHY = ("; this CPU lacks AVX2, FMA or F16C, so the kernel runs its portable C path, slower than llama.cpp "
                "(--backend llamacpp trades token-identical output at near-ties for speed)")


def kernel_refusal(path: str | Path) -> str | None:
    """Why specdec's GGUF kernel cannot run ``path`` here (None: it can)."""
    try:
        gguf.library()  # built (or found) once: a missing C compiler shows here
        gguf.GGUFWeights(path)  # memory-mapped: reads the header and the tensor table
    except gguf.KernelUnavailable as err:
        return f"specdec's GGUF kernel could not be built ({err})"
    except ValueError as err:
        return str(err).replace(f"; {gguf.LLAMACPP_HINT}", "")
    return None


def choose_gguf_backend(path: str | Path) -> dict[str, Any]:
    """``{"backend": "gguf" | "llamacpp" | None, "why": one line, "source": "rule"}``: the kernel
    wherever it runs ``path``, else llama.cpp where installed; ``None``: neither GGUF backend can
    run the file here (the caller falls back to transformers)."""
    refusal = kernel_refusal(path)
    if refusal is None:
        return {"backend": GGUF, "why": KERNEL_WHY + ("" if gguf.uses_avx2() else PORTABLE_WHY), "source": "rule"}
    if not llamacpp.available():
        return {"backend": None, "why": f"llama.cpp is not installed ({llamacpp.INSTALL} adds it, compiling "
                f"llama.cpp: about 6 minutes on 2 cores) and {refusal}", "source": "rule"}
    return {"backend": LLAMACPP, "why": f"llama.cpp: {refusal}; {BY_NAME[LLAMACPP].caveat}", "source": "rule"}
