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
  its library builds here. On a CPU without AVX2, FMA or F16C (or where ``$SPECDEC_GGUF_PATH``
  asks for it) it runs its portable C path, which performs the same operations and gives the same
  bits, only slower; the reason says so, and ``--backend llamacpp`` is the faster choice there for
  whoever accepts near-tie differences;
- llama.cpp where the kernel cannot run the file (and its binding is installed);
- neither (None) where both are out: the caller refuses the file with the one line that says to
  install llama.cpp's binding (a GGUF is never converted for transformers unless ``--backend
  torch`` asks for it by name).

A file that is not a whole GGUF (:class:`~specdec.backends.gguf.UnreadableGGUF`) and a kernel path
the environment asks for and this CPU lacks (:class:`~specdec.backends.gguf.PathUnavailable`) are
errors, not reasons to choose another backend.
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
PORTABLE_ASKED_WHY = ("; {asked} asks for the kernel's portable C path, slower than its vector paths (the same bits; "
                      "unset it to run the best path this CPU has)")


def kernel_refusal(path: str | Path) -> str | None:
    """Why specdec's GGUF kernel cannot run ``path`` here (None: it can). Raises
    :class:`~specdec.backends.gguf.UnreadableGGUF` for a file that is not a whole GGUF and
    :class:`~specdec.backends.gguf.PathUnavailable` for a path the environment asks for and cannot have."""
    try:
        gguf.library()  # built (or found) once: a missing C compiler shows here
        with gguf.probing():  # memory-mapped: reads the header and the tensor table, repacks nothing
            gguf.GGUFWeights(path)
    except gguf.KernelUnavailable as err:
        return f"specdec's GGUF kernel could not be built ({err})"
    except gguf.Unsupported as err:
        return str(err).replace(f"; {gguf.LLAMACPP_HINT}", "")
    return None


def refusal(backend: str, path: str | Path) -> str | None:
    """Why the GGUF backend ``backend`` cannot run ``path`` here (None: it can): the kernel's
    :func:`kernel_refusal`, llama.cpp's missing binding."""
    if backend == GGUF:
        return kernel_refusal(path)
    return None if llamacpp.available() else f"the llama.cpp binding is not installed ({llamacpp.INSTALL})"


def choose_gguf_backend(path: str | Path) -> dict[str, Any]:
    """``{"backend": "gguf" | "llamacpp" | None, "why": one line, "source": "rule"}``: the kernel
    wherever it runs ``path``, else llama.cpp where installed; ``None``: neither GGUF backend can
    run the file here, ``why`` says why (the caller refuses it, with :data:`INSTALL_HINT`)."""
    refusal = kernel_refusal(path)
    if refusal is None:
        return {"backend": GGUF, "why": KERNEL_WHY + _path_why(), "source": "rule"}
    if not llamacpp.available():
        return {"backend": None, "why": f"{refusal}; llama.cpp's binding (llama-cpp-python), which would run it, is "
                "not installed", "source": "rule"}
    return {"backend": LLAMACPP, "why": f"llama.cpp: {refusal}; {BY_NAME[LLAMACPP].caveat}", "source": "rule"}


INSTALL_HINT = (f"install llama.cpp's binding: {llamacpp.INSTALL} (it compiles llama.cpp: about 6 minutes on 2 "
                "cores); --backend torch converts the file for transformers instead")


def _path_why() -> str:
    """What the reason adds where the kernel runs its portable path: who chose it."""
    if gguf.kernel_path() != "portable":
        return ""
    asked = gguf.path_asked_by()
    return PORTABLE_ASKED_WHY.format(asked=asked) if asked else PORTABLE_WHY
